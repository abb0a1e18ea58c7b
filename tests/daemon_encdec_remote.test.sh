#!/bin/sh
# The encoder cache on the remote tier: cross-attention caches through Redis.
exec /usr/bin/python3 tests/daemon_encdec_remote.py
