#!/bin/sh
# Penalties and min_tokens against a Python reimplementation over the reference logits.
exec /usr/bin/python3 tests/daemon_penalties.py
