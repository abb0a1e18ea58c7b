#!/bin/sh
# Decoding allocates nothing per token, in kvtier-run and in kvtierd.
exec /usr/bin/python3 tests/daemon_alloc.py
