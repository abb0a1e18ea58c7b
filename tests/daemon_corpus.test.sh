#!/bin/sh
# kvtierd answers >= 50 malformed or hostile requests with a 4xx each and keeps serving.
exec /usr/bin/python3 tests/daemon_corpus.py
