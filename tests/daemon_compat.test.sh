#!/bin/sh
# Requests shaped as the OpenAI and Ollama client libraries send them.
exec /usr/bin/python3 tests/daemon_compat.py
