#!/bin/sh
# continue_final_message and the template's case filters through kvtierd
# (tests/daemon_continue.py).
exec /usr/bin/python3 tests/daemon_continue.py
