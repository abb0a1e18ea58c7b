#!/bin/sh
# kvtierd through the ollama npm package over the Unix socket.
exec /usr/bin/python3 tests/daemon_ollama.py
