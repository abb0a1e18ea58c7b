#!/bin/sh
# Loading is visible and paid before ready: /health's progress, the weights in memory, the warm-up.
exec /usr/bin/python3 tests/daemon_load.py
