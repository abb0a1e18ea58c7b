#!/bin/sh
# Beam search and parallel sampling on shared KV through kvtierd.
exec /usr/bin/python3 tests/daemon_beams.py
