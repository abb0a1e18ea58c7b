#!/bin/sh
# Slow clients (trickled heads, stalled bodies) from one process, and 1,000 from
# several processes of one uid (as root), do not lock the others out.
exec /usr/bin/python3 tests/daemon_slow.py
