#!/bin/sh
# kvtierd: encoder-decoder sessions forked and spilled to the disk tier, against kvtier-encdec.
exec /usr/bin/python3 tests/daemon_encdec_sess.py
