#!/bin/sh
# kvtierd: an encoder-decoder session restored from disk layer by layer, and a damaged one recomputed.
exec /usr/bin/python3 tests/daemon_encdec_disk.py
