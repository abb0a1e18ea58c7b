#!/bin/sh
# kvtierd cache surgery: crop, rewind, forks, past recording, prefix cache.
exec /usr/bin/python3 tests/daemon_surgery.py
