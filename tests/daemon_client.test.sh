#!/bin/sh
# The kvtier client (generate, chat, sessions, status, batch) against kvtierd.
exec /usr/bin/python3 tests/daemon_client.py
