#!/bin/sh
# kvtierd's default device budget: sized from the model and the context.
exec /usr/bin/python3 tests/daemon_budget.py
