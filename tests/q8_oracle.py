"""q8_oracle - tools/torchref.py's Q8_0 quantizer against kvtier's, byte
for byte: both quantize the same float32 rows (normal weights at several
scales, exact ties, zeros, scales that f16 stores as subnormals, the
largest magnitudes f16 can scale) and the 34-byte blocks must be equal.

    /usr/bin/python3 tests/q8_oracle.py BUILD WORKDIR

kvtier's side is BUILD/tests/test_q8 --quantize.  Exit 0 = identical.
"""
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import torchref  # noqa: E402


def rows():
    rng = np.random.default_rng(7)
    out = [rng.standard_normal((64, 256)) * s for s in (1e-6, 1e-3, 0.02, 1.0, 300.0)]
    # ties: with max 254 the scale is 2 and odd integers land on .5
    t = np.zeros((1, 64))
    t[0, :32] = np.arange(-15, 17) * 2 + 1
    t[0, 0] = 254
    t[0, 32:] = np.arange(32) - 16.5
    t[0, 63] = 127
    out.append(t)
    out.append(np.zeros((1, 64)))
    out.append(rng.integers(-127, 128, (4, 128)).astype(np.float64))  # exact codes, scale 1
    w = rng.standard_normal((8, 64)) * 1e-4
    w[:, 5] = 3e4  # one outlier per block row: the others round to 0
    out.append(w)
    return [np.asarray(r, np.float32) for r in out]


def main():
    build, work = sys.argv[1], sys.argv[2]
    x = np.concatenate([r.reshape(-1) for r in rows()])
    src, dst = os.path.join(work, "q8_in.f32"), os.path.join(work, "q8_out.bin")
    x.astype("<f4").tofile(src)
    subprocess.run([os.path.join(build, "tests", "test_q8"), "--quantize", src, dst], check=True)
    got = np.fromfile(dst, np.uint8)
    want = np.frombuffer(torchref.q8_0_quantize(x).tobytes(), np.uint8)
    if got.size != want.size:
        print(f"q8_oracle: FAIL kvtier wrote {got.size} bytes, torchref {want.size}")
        return 1
    diff = np.flatnonzero(got != want)
    if diff.size:
        b = int(diff[0]) // 34
        print(f"q8_oracle: FAIL {diff.size} bytes differ, first in block {b}: kvtier "
              f"{got[34 * b:34 * b + 34].tolist()} torchref {want[34 * b:34 * b + 34].tolist()}")
        return 1
    print(f"q8_oracle: {x.size // 32} Q8_0 blocks identical to kvtier's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
