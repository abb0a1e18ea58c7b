"""quant_oracle - a PyTorch oracle for kvtier's quantized KV codec.

Replays the reference quantizers of Hugging Face's QuantizedCache on the
same K/V rows kvtier quantizes, and compares kvtier's codes, group
parameters and dequantized values bit for bit (tests/test_quant --codec):

  quanto   optimum-quanto's MaxOptimizer (scale = (max - min) / (2^b - 1),
           shift = -min over each group of quanto's group() layout),
           quantize_affine (round((x + shift) / scale), clamped) and the
           QBits dequantizer (scale * code - shift)
  hqq      hqq's Quantizer.quantize with optimize=False (inverse scale
           (2^b - 1) / (max - min) clamped to 2e4, zero = -min * inverse
           scale, round(x * inverse + zero), clamped) and dequantize
           ((code - zero) * scale)
  fp8      e4m3fn with one scale per tensor, amax / 448 (the transformers
           PR #48677 description), round to nearest even, saturating

Written from those libraries' semantics, not copied.  The one change to
both affine pipelines is the storage of the (scale, shift|zero) pair in
f16, as the reference stores it for a half-precision model: quanto receives
its optimizer's outputs in the model dtype before quantizing, hqq casts its
meta to compute_dtype after quantizing.  float8 dtypes do not exist in
torch 1.13, so e4m3 rounding is done against the table of all 127
non-negative e4m3fn values.

Inputs: seeded random rows with offset channels, and post-RoPE K and V of
a random-weight tiny Llama (tools/mkmodel.py + tools/torchref.py).  Also
checks round-trip error bounds on those activations.

Usage: quant_oracle.py BUILD_DIR WORK_DIR
"""
import os
import struct
import subprocess
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import torchref  # noqa: E402

QUANTO, HQQ, FP8 = 0, 1, 2
NAMES = {QUANTO: "quanto", HQQ: "hqq", FP8: "fp8"}


def f16(t):
    return t.half().float()


# ---- quanto ---------------------------------------------------------------

def quanto_group(base, axis, g):
    """quanto's group(): axis 0 -> rows of g consecutive elements; axis -1 ->
    columns of g consecutive rows (rows = all leading dims), one per channel."""
    if axis == 0:
        return base.reshape(-1, g)
    d = base.shape[-1]
    n_groups = base.numel() // d // g
    return base.reshape(n_groups, g, d).permute(1, 2, 0).reshape(g, d * n_groups)


def quanto_ungroup(grouped, axis, shape):
    if axis == 0:
        return grouped.reshape(shape)
    g, d = grouped.shape[0], shape[-1]
    n_groups = grouped.numel() // d // g
    return grouped.reshape(g, d, n_groups).permute(2, 0, 1).reshape(shape)


def quanto_pipeline(x, bits, axis, g):
    """x: (H, n, D) f32.  Returns dequantized, codes (both (H, n, D)) and the
    (scale, shift) pairs in quanto's grouped order."""
    base = quanto_group(x, axis, g)
    red = 1 if axis == 0 else 0
    rmin = base.amin(dim=red, keepdim=True)
    rmax = base.amax(dim=red, keepdim=True)
    scale = f16((rmax - rmin) / (2 ** bits - 1))
    shift = f16(-rmin)
    data = torch.round((base + shift) / scale)
    data = torch.where(scale == 0, torch.zeros_like(data), data)  # 0/0: kvtier defines code 0
    codes = data.clamp(0, 2 ** bits - 1).to(torch.uint8)
    deq = scale * codes - shift
    return quanto_ungroup(deq, axis, x.shape), quanto_ungroup(codes, axis, x.shape), scale, shift


# ---- hqq ------------------------------------------------------------------

def hqq_pipeline(w, bits, axis, g):
    """hqq Quantizer.quantize/dequantize on w with meta stored as f16.
    axis 1: rows of g consecutive elements; axis 0: reshape(g, -1) columns."""
    shape = w.shape
    W = w.float().reshape(-1, g) if axis == 1 else w.float().reshape(g, -1)
    mn = W.min(dim=axis, keepdim=True)[0]
    mx = W.max(dim=axis, keepdim=True)[0]
    max_v = 2 ** bits - 1
    inv = (max_v / (mx - mn)).clamp(max=2e4)
    zero = -mn * inv
    codes = torch.round(W * inv + zero).clamp(0, max_v)
    scale, zero = f16(1.0 / inv), f16(zero)
    deq = ((codes - zero) * scale).reshape(shape)
    return deq, codes.to(torch.uint8).reshape(shape), scale.flatten(), zero.flatten()


# ---- fp8 ------------------------------------------------------------------

def e4m3_table():
    vals = []
    for c in range(0x7f):  # 0x7f is NaN
        e, m = c >> 3, c & 7
        vals.append((1 + m / 8) * 2.0 ** (e - 7) if e else (m / 8) * 2.0 ** -6)
    return np.array(vals, dtype=np.float64)


E4M3 = e4m3_table()


def to_e4m3(x):
    """Codes of f32 array x: nearest value of the table, ties to the even code."""
    a = np.minimum(np.abs(x.astype(np.float64)), 448.0)
    idx = np.searchsorted(E4M3, a)  # first value >= a
    lo = np.clip(idx - 1, 0, len(E4M3) - 1)
    hi = np.clip(idx, 0, len(E4M3) - 1)
    dlo, dhi = a - E4M3[lo], E4M3[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (pick | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def from_e4m3(c):
    v = E4M3[c & 0x7f].astype(np.float32)
    return np.where(c & 0x80, -v, v).astype(np.float32)


# ---- expected output in kvtier's layout ---------------------------------------

def expected_half(x, backend, bits, axis, g, T):
    """x: (H, n, D).  Returns deq (H, n, D), codes (H, n, D) and the pairs
    in kvtier's order (head, group row, group column)."""
    H, n, D = x.shape
    if backend == FP8:
        raise ValueError("fp8 has no groups")
    per_channel = (backend == QUANTO and axis == -1) or (backend == HQQ and axis == 0)
    if not per_channel:
        gd = min(g, D)
        if backend == QUANTO:
            deq, codes, s, z = quanto_pipeline(x, bits, 0, gd)
        else:
            deq, codes, s, z = hqq_pipeline(x, bits, 1, gd)
        return deq, codes, torch.stack([s.flatten(), z.flatten()], 1)
    deq = torch.empty_like(x)
    codes = torch.empty(x.shape, dtype=torch.uint8)
    pairs = []
    for h in range(H):
        for r0 in range(0, n, g):
            sl = x[h:h + 1, r0:r0 + g]  # one head, one group row (the last may be partial)
            rows = sl.shape[1]
            if backend == QUANTO:
                d_, c_, s, z = quanto_pipeline(sl, bits, -1, rows)
            else:
                d_, c_, s, z = hqq_pipeline(sl, bits, 0, rows)
            deq[h:h + 1, r0:r0 + g], codes[h:h + 1, r0:r0 + g] = d_, c_
            pairs.append(torch.stack([s.flatten(), z.flatten()], 1))
    return deq, codes, torch.cat(pairs, 0)


def run_codec(build, work, case, k, v):
    backend, bits, ak, av, g, T = case
    n, H, D = k.shape
    inp, out = os.path.join(work, "in.bin"), os.path.join(work, "out.bin")
    with open(inp, "wb") as f:
        f.write(struct.pack("<9i", backend, bits, ak, av, g, H, D, T, n))
        f.write(k.astype("<f4").tobytes())
        f.write(v.astype("<f4").tobytes())
    subprocess.run([os.path.join(build, "tests", "test_quant"), "--codec", inp, out], check=True)
    raw = open(out, "rb").read()
    rows = n * H * D
    off = 0

    def take(count, dtype):
        nonlocal off
        a = np.frombuffer(raw, dtype=dtype, count=count, offset=off)
        off += a.nbytes
        return a

    dk, dv = take(rows, "<f4").reshape(n, H, D), take(rows, "<f4").reshape(n, H, D)
    ck, cv = take(rows, np.uint8).reshape(H, n, D), take(rows, np.uint8).reshape(H, n, D)
    rest = np.frombuffer(raw, dtype="<f4", offset=off)
    return dk, dv, ck, cv, rest


def same_bits(a, b):
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def check_case(build, work, case, k, v, label):
    backend, bits, ak, av, g, T = case
    dk, dv, ck, cv, rest = run_codec(build, work, case, k, v)
    name = f"{label}: {NAMES[backend]} int{bits} axes {ak}/{av} group {g}"
    if backend == FP8:
        worst = 0.0
        for x, d, c, s in ((k, dk, ck, rest[0]), (v, dv, cv, rest[1])):
            scale = np.float32(np.abs(x).max()) / np.float32(448.0)
            assert same_bits(np.float32(s), scale), f"{name}: tensor scale {s} != {scale}"
            codes = to_e4m3((x / scale).astype(np.float32))
            assert np.array_equal(c, codes.transpose(1, 0, 2)), f"{name}: e4m3 codes differ"
            assert same_bits(d, from_e4m3(codes) * scale), f"{name}: e4m3 values differ"
            # 3 mantissa bits: within 2^-4 of each value, or half the smallest subnormal step
            worst = max(worst, (np.abs(d - x) / (np.abs(x) * 2.0 ** -4 + scale * 2.0 ** -10)).max())
        return worst
    worst = 0.0
    at = 0
    for x, d, c, axis in ((k, dk, ck, ak), (v, dv, cv, av)):
        xt = torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)))
        deq, codes, pairs = expected_half(xt, backend, bits, axis, g, T)
        got_pairs = rest[at:at + pairs.numel()].reshape(-1, 2)
        at += pairs.numel()
        assert np.array_equal(c, codes.numpy()), f"{name}: codes differ ({(c != codes.numpy()).sum()} of {c.size})"
        assert same_bits(got_pairs, pairs.numpy()), f"{name}: (scale, zero) pairs differ"
        assert same_bits(d.transpose(1, 0, 2), deq.numpy()), f"{name}: dequantized values differ"
        # round trip: within one step of the tensor's span (half a step plus
        # what the f16 pair moves; hqq rounds its pair after quantizing) and
        # the f16 rounding of the extremes
        span = (xt.amax() - xt.amin()).item()
        bound = span / (2 ** bits - 1) + 2.0 ** -9 * xt.abs().max().item()
        worst = max(worst, np.abs(deq.numpy() - xt.numpy()).max() / bound)
    assert at == rest.size, f"{name}: {rest.size - at} parameters left over"
    return worst


def cases(T):
    out = []
    for bits in (2, 4, 8):
        for ak, av in ((0, 0), (-1, 0), (-1, -1)):
            out.append((QUANTO, bits, ak, av, 16, T))
    for bits in (1, 2, 3, 4, 8):
        for ak, av in ((1, 1), (0, 1), (0, 0)):
            out.append((HQQ, bits, ak, av, 16, T))
    out.append((QUANTO, 4, 0, 0, 8, T))   # several per-token groups per head row
    out.append((HQQ, 4, 1, 1, 1024, T))   # a group wider than head_dim: one head row
    out.append((FP8, 8, 0, 0, 0, T))
    return out


def tiny_model_kv(work, n_tok):
    """Post-RoPE K and V, [layers][n, H, D], of a random-weight tiny Llama."""
    mdir = os.path.join(work, "model")
    subprocess.run([sys.executable, os.path.join(HERE, "..", "tools", "mkmodel.py"), "--preset", "tiny",
                    "--head-dim", "32", "--seed", "3", "--out", mdir], check=True, stdout=subprocess.DEVNULL)
    model = torchref.load_model(mdir)
    seen = []
    orig = torchref.repeat_kv

    def record(x, n_rep):
        seen.append(x[0].transpose(0, 1).detach().numpy().copy())  # [T, Hkv, hd]
        return orig(x, n_rep)

    torchref.repeat_kv = record
    try:
        ids = torch.randint(0, 384, (1, n_tok), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            model(ids)
    finally:
        torchref.repeat_kv = orig
    return [(seen[i], seen[i + 1]) for i in range(0, len(seen), 2)]


def main():
    build, work = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(11)
    H, D, T = 2, 32, 48
    checked = 0
    for n in (T, 40):  # a full block, and one whose last per-channel row is partial
        base = np.where(np.arange(D) % 7 == 3, 6.0, 0.0).astype(np.float32)
        k = (rng.standard_normal((n, H, D)) * 1.5 + base).astype(np.float32)
        v = rng.standard_normal((n, H, D)).astype(np.float32)
        k[:, 1, 5] = 2.5  # a constant channel: quanto's zero scale
        for case in cases(T):
            assert check_case(build, work, case, k, v, f"random n={n}") <= 1.0
            checked += 1
    for n in (T, 40):
        for layer, (k, v) in enumerate(tiny_model_kv(work, n)):
            for case in cases(T):
                worst = check_case(build, work, case, k, v, f"tiny model layer {layer} n={n}")
                assert worst <= 1.0, f"layer {layer} {NAMES[case[0]]} int{case[1]}: round trip {worst} x the bound"
                checked += 1
    print(f"quant_oracle: {checked} cases bit-exact against the reference quantizers")


if __name__ == "__main__":
    main()
