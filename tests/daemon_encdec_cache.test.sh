#!/bin/sh
# kvtierd's encoder cache: cross-attention caches shared across requests.
exec /usr/bin/python3 tests/daemon_encdec_cache.py
