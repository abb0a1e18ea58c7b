#!/bin/sh
# kvtierd through the official openai npm package over the Unix socket.
exec /usr/bin/python3 tests/daemon_openai.py
