#!/bin/sh
# Another uid can neither list, read, use, export, fork nor delete a session on disk.
exec /usr/bin/python3 tests/daemon_disk_uid.py
