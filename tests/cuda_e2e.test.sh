#!/bin/sh
# kvtierd --backend cuda against the CPU backend, every strategy, and a real OOM (skips without a GPU).
exec /usr/bin/python3 tests/cuda_e2e.py
