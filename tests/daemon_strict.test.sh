#!/bin/sh
# Ambiguous HTTP framing gets 400 and a close; repeated 4xx log lines are rate-limited.
exec /usr/bin/python3 tests/daemon_strict.py
