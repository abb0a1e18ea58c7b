#!/bin/sh
# Half-closed clients (request, then shutdown(SHUT_WR)) get their answer on every route.
exec /usr/bin/python3 tests/daemon_halfclose.py
