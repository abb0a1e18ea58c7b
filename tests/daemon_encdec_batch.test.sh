#!/bin/sh
# kvtierd: concurrent T5 and BART requests share decoder steps and each gets
# the tokens and logprobs it gets alone.
exec /usr/bin/python3 tests/daemon_encdec_batch.py
