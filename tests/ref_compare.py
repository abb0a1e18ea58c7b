#!/usr/bin/python3
"""ref_compare - compares a kvtier-run --dump with the PyTorch reference.

    /usr/bin/python3 tests/ref_compare.py DIR DUMP --tol X [--expect-gen N] [--same-tokens DUMP2]...
                                          [--no-cache DUMP3]... [--kv-dtype f32|bf16|f16] [--weights auto|q8_0|q4_k]
                                          [--matmul-input f32|bf16]

The dump (little-endian): "KVTL", int32 n_prompt, n_gen, vocab,
int32 tokens[n_prompt + n_gen] (prompt, then generated), float32
logits[n_gen][vocab], row i holding the logits that chose generated token i.

The model of DIR is loaded by tools/torchref.py in f32 (bf16/f16 weights
upcast: same weights, f32 math) and run ONCE over prompt + generated[:-1];
its rows n_prompt-1 ... n_prompt+n_gen-2 are what kvtier should have
produced for the prefill and each decode step (longrope: each row rotated
with the table of the forward call that computed it, a prefill of n_prompt
rows then one row per call, as Hugging Face's cache keeps them).  --kv-dtype bf16/f16: the
reference rounds K (after RoPE) and V to that type, as a cache of it
keeps them (kvtier's KV dtype of the dump; default f32, unrounded).
--weights q8_0: the reference's layer matrices are the Q8_0 blocks of the
checkpoint's, dequantized, and their inputs rounded as kvtier rounds them
(kvtier-run --weights q8_0); with --apart, the reference with the
unquantized weights must also be further than --tol from the dump (the
tolerance tells the two apart).  --weights q4_k --q4k-quantizer PROG: the
same with Q4_K blocks, written by PROG --quantize IN OUT (BUILD/tests/
test_q4k: kvtier's quantizer) and decoded here, for the matrices whose rows
are whole super-blocks of 256 (Q8_0 for the others, as kvtier does).
--matmul-input bf16: the input of every weight matrix rounded to bf16 (what
kvtier's CPU backend multiplies bf16 weights by on AVX512_BF16).  Passes when
  * every logit is within --tol of the reference (max abs error), and
  * every generated token is the reference's argmax, or within --tol of the
    reference maximum (a near tie the two sides may break differently).
--same-tokens DUMP2: DUMP2 (e.g. the --no-cache run) must hold exactly the
same tokens, and its logits are checked against the reference too.
--no-cache DUMP3: a --no-cache run, checked against the reference that
recomputes the whole sequence at each step (one forward call per generated
token, so longrope rotates every key with the table of the current length);
its tokens are its own.
Prints one verdict line per dump; exit 0 = pass, 1 = mismatch, 2 = bad input.
"""
import argparse
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import torchref  # noqa: E402


class BadDump(Exception):
    pass


def read_dump(path):
    """(tokens [n_prompt+n_gen] int64, n_prompt, logits [n_gen, vocab] f32)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 16 or data[:4] != b"KVTL":
        raise BadDump(f"{path}: not a KVTL dump (bad magic or shorter than its header)")
    n_prompt, n_gen, vocab = struct.unpack("<3i", data[4:16])
    if n_prompt < 1 or n_gen < 1 or vocab < 1:
        raise BadDump(f"{path}: header n_prompt={n_prompt} n_gen={n_gen} vocab={vocab}")
    want = 16 + 4 * (n_prompt + n_gen) + 4 * n_gen * vocab
    if len(data) != want:
        raise BadDump(f"{path}: {len(data)} bytes, the header implies {want}")
    tokens = np.frombuffer(data, "<i4", n_prompt + n_gen, 16).astype(np.int64)
    logits = np.frombuffer(data, "<f4", n_gen * vocab, 16 + 4 * (n_prompt + n_gen)).reshape(n_gen, vocab)
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise BadDump(f"{path}: token id out of range 0..{vocab - 1}")
    return tokens, n_prompt, logits


def reference_rows(model, tokens, n_prompt, no_cache=False):
    """The reference's logits for each generated position: [n_gen, vocab]."""
    ids = torch.from_numpy(tokens[None, :-1].copy())
    with torch.no_grad():
        if no_cache:
            return np.stack([model(ids[:, :t])[0, -1].double().numpy() for t in range(n_prompt, ids.shape[1] + 1)])
        out = model(ids, prefill=n_prompt)[0]  # [n_prompt+n_gen-1, vocab]
    return out[n_prompt - 1:].double().numpy()


def compare(name, tokens, n_prompt, got, ref, tol):
    """Returns (ok, verdict line)."""
    if not np.all(np.isfinite(got)):
        bad = int(np.argwhere(~np.isfinite(got))[0][0])
        return False, f"FAIL {name}: non-finite logits in row {bad}"
    err = np.abs(got.astype(np.float64) - ref)
    row_err = err.max(axis=1)
    worst = int(row_err.argmax())
    gen = tokens[n_prompt:]
    ref_max = ref.max(axis=1)
    chosen = ref[np.arange(len(gen)), gen]
    # a token other than the reference argmax is only acceptable when its
    # reference logit is within tol of the maximum (a near tie)
    wrong = [i for i in range(len(gen)) if chosen[i] < ref_max[i] - tol]
    ties = sum(1 for i in range(len(gen)) if gen[i] != ref[i].argmax() and i not in wrong)
    ok = row_err[worst] <= tol and not wrong
    line = (f"{'PASS' if ok else 'FAIL'} {name}: {len(gen)} rows (prefill + {len(gen) - 1} decode steps), "
            f"max abs err {row_err[worst]:.3g} in row {worst} (tol {tol:g}); ")
    if wrong:
        i = wrong[0]
        line += (f"{len(wrong)} token(s) not the reference argmax, first at step {i}: got {gen[i]}, "
                 f"reference {int(ref[i].argmax())} (margin {ref_max[i] - chosen[i]:.3g})")
    else:
        line += f"every token is the reference argmax ({ties} near tie(s))"
    if row_err[worst] > tol:
        over = np.flatnonzero(row_err > tol)
        line += f"; rows over tol: {over[:10].tolist()}{' ...' if len(over) > 10 else ''}"
    return ok, line


def q4_k_blocks(prog, w):
    """Q4_K blocks of the float32 matrix w, as PROG --quantize writes them."""
    if not prog:
        raise ValueError("--weights q4_k needs --q4k-quantizer")
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "w.f32"), os.path.join(tmp, "w.q4k")
        np.ascontiguousarray(w, np.float32).tofile(src)
        subprocess.run([prog, "--quantize", src, dst], check=True)
        blocks = np.fromfile(dst, torchref.Q4_K_DTYPE)
    if len(blocks) * torchref.Q4_K_BLOCK != w.size:
        raise ValueError(f"{prog} wrote {len(blocks)} Q4_K blocks for {w.size} weights")
    return blocks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("dump")
    ap.add_argument("--tol", type=float, required=True)
    ap.add_argument("--expect-gen", type=int, help="require exactly this many generated tokens")
    ap.add_argument("--same-tokens", action="append", default=[], metavar="DUMP2")
    ap.add_argument("--no-cache", action="append", default=[], metavar="DUMP3")
    ap.add_argument("--name", help="label for the verdict lines (default: the directory name)")
    ap.add_argument("--kv-dtype", choices=("f32", "bf16", "f16"), default="f32")
    ap.add_argument("--weights", choices=("auto", "q8_0", "q4_k"), default="auto")
    ap.add_argument("--q4k-quantizer", metavar="PROG", help="with --weights q4_k: PROG --quantize IN OUT")
    ap.add_argument("--matmul-input", choices=("f32", "bf16"), default="f32",
                    help="bf16: every weight matrix's input rounded to bf16 (torchref.load_model)")
    ap.add_argument("--attn-input", choices=("f32", "bf16"), default="f32",
                    help="bf16: with a bf16 cache, attention's query and weights rounded to bf16, as kvtier's "
                    "avx512bf16 level rounds them (torchref.load_model)")
    ap.add_argument("--apart", action="store_true", help="with --weights q8_0|q4_k: the unquantized reference must fail")
    o = ap.parse_args(argv)
    torch.set_num_threads(2)
    name = o.name or os.path.basename(os.path.normpath(o.dir))
    try:
        dumps = [(o.dump, *read_dump(o.dump))] + [(p, *read_dump(p)) for p in o.same_tokens + o.no_cache]
        kv = {"f32": None, "bf16": torch.bfloat16, "f16": torch.float16}[o.kv_dtype]
        mm_in = {"f32": None, "bf16": torch.bfloat16}[o.matmul_input]
        at_in = {"f32": None, "bf16": torch.bfloat16}[o.attn_input]
        model = torchref.load_model(o.dir, torch.float32, kv, o.weights,
                                    lambda w: q4_k_blocks(o.q4k_quantizer, w), mm_in, at_in)
    except (BadDump, OSError, ValueError, KeyError, RuntimeError, subprocess.CalledProcessError) as e:
        print(f"FAIL {name}: {e}")
        return 2
    ok = True
    tokens0 = dumps[0][1]
    for path, tokens, n_prompt, logits in dumps:
        label = f"{name} [{os.path.basename(path)}]"
        if logits.shape[1] != model.cfg["vocab_size"]:
            print(f"FAIL {label}: dump vocab {logits.shape[1]} != config vocab_size {model.cfg['vocab_size']}")
            ok = False
            continue
        if o.expect_gen is not None and logits.shape[0] != o.expect_gen:
            print(f"FAIL {label}: {logits.shape[0]} generated tokens, expected {o.expect_gen}")
            ok = False
            continue
        no_cache = path in o.no_cache
        if path != o.dump and not no_cache and not np.array_equal(tokens, tokens0):
            n = min(len(tokens), len(tokens0))
            diff = np.flatnonzero(tokens[:n] != tokens0[:n])
            print(f"FAIL {label}: tokens differ from {os.path.basename(o.dump)} at position "
                  f"{int(diff[0]) if len(diff) else n}")
            ok = False
            continue
        row_ok, line = compare(label, tokens, n_prompt, logits, reference_rows(model, tokens, n_prompt, no_cache),
                               o.tol)
        print(line)
        ok = ok and row_ok
        if o.apart and o.weights != "auto":
            plain = torchref.load_model(o.dir, torch.float32, kv)
            err = np.abs(logits - reference_rows(plain, tokens, n_prompt, no_cache)).max()
            print(f"{'PASS' if err > o.tol else 'FAIL'} {label}: the unquantized reference is {err:.3g} away "
                  f"(must be over tol {o.tol:g})")
            ok = ok and err > o.tol
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
