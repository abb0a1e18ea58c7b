#!/bin/sh
# Prefix-cache blocks on disk: a hit after a restart, per-uid namespaces, a corrupt block is a miss.
exec /usr/bin/python3 tests/daemon_disk_prefix.py
