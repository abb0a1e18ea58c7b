#!/bin/sh
# GPT-2's and Gemma 2's cache rules through kvtierd (tests/daemon_models.py).
exec /usr/bin/python3 tests/daemon_models.py
