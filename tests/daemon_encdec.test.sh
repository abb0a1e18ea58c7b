#!/bin/sh
# kvtierd with encoder-decoder models (T5, BART) against kvtier-encdec.
exec /usr/bin/python3 tests/daemon_encdec.py
