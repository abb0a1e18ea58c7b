#!/bin/sh
# quant.test.sh - kvtier's quantized-KV codec against a PyTorch replay of the
# reference quantizers (quanto, hqq, e4m3), bit for bit, on random rows and
# on a random tiny model's K/V (tests/quant_oracle.py).  Skips (77) without
# the test binary or Debian's python3 with torch.
build=${KVTIER_BUILD:-build}
py=/usr/bin/python3
[ -x "$build/tests/test_quant" ] || { echo "no $build/tests/test_quant"; exit 77; }
$py -c 'import torch, numpy' 2>/dev/null || { echo "no torch in $py"; exit 77; }
work=$(mktemp -d) || exit 1
trap 'rm -rf "$work"' EXIT
$py tests/quant_oracle.py "$build" "$work"
