#!/bin/sh
# kvtierd operations: socket activation, sd_notify READY/STOPPING, SIGHUP log reopen, --max-output.
exec /usr/bin/python3 tests/daemon_ops.py
