#!/bin/sh
# A 4 MiB prompt is parsed and tokenized off the event loop: another client's stream keeps flowing.
exec /usr/bin/python3 tests/daemon_loop.py
