#!/bin/sh
# kvtierd under --device-mem / --host-mem: offloaded continuation, strategies, 507.
exec /usr/bin/python3 tests/daemon_memory.py
