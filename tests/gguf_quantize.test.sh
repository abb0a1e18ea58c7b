#!/bin/sh
# gguf_quantize.test.sh - `kvtier quantize` (bf16, q8_0, q4_k) on a random
# model of every architecture the GGUF loader reads: each file computes
# what the directory computes (--weights q8_0, q4_k), and the bf16 file is
# tools/st2gguf.py's, tensor for tensor and key for key
# (tests/gguf_quantize.py).  Skips (77) without Debian's python3 with
# torch, which tools/mkmodel.py needs.
build=${KVTIER_BUILD:-build}
for b in "$build/kvtier" "$build/kvtier-run"; do
  [ -x "$b" ] || { echo "gguf_quantize.test.sh: $b is not built"; exit 1; }
done
py=/usr/bin/python3
$py -c 'import torch' 2>/dev/null || { echo "no torch in $py"; exit 77; }
work=$(mktemp -d) || exit 1
trap 'rm -rf "$work"' EXIT
$py tests/gguf_quantize.py "$build" "$work"
