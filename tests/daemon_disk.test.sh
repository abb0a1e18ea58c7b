#!/bin/sh
# kvtierd's disk tier: spill, restore, restart, damaged files, disk and host full, kill -9 mid-write.
exec /usr/bin/python3 tests/daemon_disk.py
