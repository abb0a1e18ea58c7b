#!/bin/sh
# kvtierd's disk tier with the Nth io_uring submission failing, for every N.
exec /usr/bin/python3 tests/daemon_disk_faults.py
