#!/bin/sh
# kvtierd's encoder cache on the disk tier: evicted and at exit, read back.
exec /usr/bin/python3 tests/daemon_encdec_cache_disk.py
