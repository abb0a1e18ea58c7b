#!/bin/sh
# kvtierd input ranges: edge values of every numeric field -> 200 or 400 naming it.
exec /usr/bin/python3 tests/daemon_ranges.py
