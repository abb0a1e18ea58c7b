#!/bin/sh
# kvtierd with a Mamba model: session reuse, crop and forks through state
# checkpoints, the refused strategies, constant state bytes.
exec /usr/bin/python3 tests/daemon_mamba.py
