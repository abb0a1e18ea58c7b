#!/bin/sh
# kvtierd's encoder-decoder models continuing past a device OOM in the host tier.
exec /usr/bin/python3 tests/daemon_encdec_oom.py
