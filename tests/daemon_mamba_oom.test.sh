#!/bin/sh
# kvtierd's Mamba state moved to the host tier in the middle of its generation.
exec /usr/bin/python3 tests/daemon_mamba_oom.py
