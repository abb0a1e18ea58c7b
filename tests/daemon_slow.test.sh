#!/bin/sh
# Slow clients (trickled heads, stalled bodies) from one process do not lock the others out.
exec /usr/bin/python3 tests/daemon_slow.py
