#!/bin/sh
# /health says "stalled" when work waits and no engine step completes within --stall-timeout.
exec /usr/bin/python3 tests/daemon_stall.py
