#!/bin/sh
# The remote tier: prefix blocks shared through Redis (own redis-server processes), its faults and a cluster.
exec /usr/bin/python3 tests/daemon_remote.py
