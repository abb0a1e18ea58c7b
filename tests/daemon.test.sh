#!/bin/sh
# kvtierd end to end: endpoints, streams, sessions, limits, credentials, drain.
exec /usr/bin/python3 tests/daemon_api.py
