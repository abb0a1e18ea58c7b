#!/bin/sh
# kvtierd with a Mamba model on the disk tier: spill, restore, restart.
exec /usr/bin/python3 tests/daemon_mamba_disk.py
