#!/bin/sh
# The kvtier CLI: --help, waiting while the model loads, --session-ttl, and chat and top in a real terminal (tmux).
exec /usr/bin/python3 tests/cli_tty.py
