#!/bin/sh
# 32 concurrent clients (16 on bf16): every greedy output equals the same request run
# alone, with f32 weights and with bf16 (the bf16 kernels on AVX512_BF16).
/usr/bin/python3 tests/daemon_batch.py f32 || exit
exec /usr/bin/python3 tests/daemon_batch.py bf16
