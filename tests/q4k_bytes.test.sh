#!/bin/sh
# q4k_bytes.test.sh - tools/torchref.py's q4_k_quantize (numpy; what
# tools/st2gguf.py --type q4_k writes) against util/q4k.c's q4_k_quantize
# (test_q4k --quantize): the same bytes for every super-block of 512
# random ones of mixed scales, with the cases the fit branches on (zero
# sub-blocks, all-negative and all-positive ones, a lone outlier, values
# small enough for subnormal f16 factors, large ones).  Exit 77 when
# test_q4k is not built or numpy/torch are absent.
build=${KVTIER_BUILD:-build}
py=/usr/bin/python3
[ -x "$build/tests/test_q4k" ] || { echo "q4k_bytes.test: test_q4k not built, skipping"; exit 77; }
$py -c 'import torch, numpy' 2>/dev/null || { echo "q4k_bytes.test: no torch in $py, skipping"; exit 77; }
work=$(mktemp -d) || exit 1
trap 'rm -rf "$work"' EXIT
$py - "$build/tests/test_q4k" "$work" <<'PY' || exit 1
import os, subprocess, sys
import numpy as np
sys.path.insert(0, "tools")
from torchref import q4_k_quantize, Q4_K_DTYPE

prog, work = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(5)
n = 512
x = (rng.standard_normal((n, 256)) * np.exp(rng.uniform(-6, 3, (n, 1)))).astype(np.float32)
x[0] = 0                                      # all zero
x[1, :32] = 0                                 # one zero sub-block
x[2] = -np.abs(x[2])                          # no positive value
x[3] = np.abs(x[3]) + 1                       # no negative value (the offset clamps to 0)
x[4] = 0; x[4, 77] = 3.5                      # a lone outlier
x[5] *= np.float32(1e-7)                      # factors below f16's normal range
x[6] *= np.float32(200)                       # large
x[7] = np.round(x[7])                         # ties for the rounding
x[8, ::2] = x[8, 1::2]                        # repeated values
x.tofile(os.path.join(work, "in"))
subprocess.run([prog, "--quantize", os.path.join(work, "in"), os.path.join(work, "out")], check=True)
c = np.fromfile(os.path.join(work, "out"), Q4_K_DTYPE)
p = q4_k_quantize(x)
bad = [i for i in range(n) if c[i].tobytes() != p[i].tobytes()]
if bad:
    print("q4k_bytes.test: %d of %d super-blocks differ, first %d:\n  C  %s\n  py %s"
          % (len(bad), n, bad[0], c[bad[0]].tobytes().hex(), p[bad[0]].tobytes().hex()))
    sys.exit(1)
print("q4k_bytes.test: %d super-blocks byte-identical" % n)
PY
