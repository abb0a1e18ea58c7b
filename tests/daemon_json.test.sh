#!/bin/sh
# Constrained output and tool calls through kvtierd (tests/daemon_json.py).
exec /usr/bin/python3 tests/daemon_json.py
