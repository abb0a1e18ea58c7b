#!/bin/sh
# 32 concurrent clients: every greedy output equals the same request run alone.
exec /usr/bin/python3 tests/daemon_batch.py
