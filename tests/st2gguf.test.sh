#!/bin/sh
# st2gguf.test.sh - tools/st2gguf.py's GGUF (what llama.cpp is benchmarked
# on) read back and checked against the safetensors it came from
# (tests/st2gguf_check.py).  Skips (77) without Debian's python3 with torch,
# which tools/mkmodel.py needs.
py=/usr/bin/python3
$py -c 'import torch' 2>/dev/null || { echo "no torch in $py"; exit 77; }
work=$(mktemp -d) || exit 1
trap 'rm -rf "$work"' EXIT
$py tests/st2gguf_check.py "$work"
