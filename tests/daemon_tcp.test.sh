#!/bin/sh
# kvtierd over TCP (--listen) with an API key.
exec /usr/bin/python3 tests/daemon_tcp.py
