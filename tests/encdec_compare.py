#!/usr/bin/python3
"""encdec_compare - kvtier-encdec's dumps against tools/torchref.py's
encoder-decoder reference: the reference encodes the same ids, then decodes
each dump's tokens through its cache step by step; every logits row must
lie within the tolerance of the reference's (max abs difference) and every
token be the reference's argmax (or tie with it within the tolerance).

    encdec_compare.py --enc 5,6,7 CASES

CASES: a file of lines "DIR DUMP KV-DTYPE TOL NAME [DEC]" (KV-DTYPE f32,
bf16 or f16: the type the reference's caches round K and V to; DEC: the
decoder prompt, default decoder_start_token_id), all compared in one
process (torch loads once).
"""
import argparse
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import torchref  # noqa: E402

KV = {"f32": None, "bf16": torch.bfloat16, "f16": torch.float16}


def read_dump(path):
    with open(path, "rb") as f:
        b = f.read()
    if b[:4] != b"KVED":
        raise SystemExit(f"{path}: not a kvtier-encdec dump")
    n, vocab = struct.unpack_from("<ii", b, 4)
    toks = np.frombuffer(b, np.int32, n, 12)
    logits = np.frombuffer(b, np.float32, n * vocab, 12 + 4 * n).reshape(n, vocab)
    return toks.tolist(), logits


def selfcheck():
    """T5's buckets against values worked by hand from its definition
    (32 buckets, max_distance 128): exact below max_exact, then
    max_exact + int(log(r / max_exact) / log(128 / max_exact) * (n - max_exact)),
    the last bucket from max_distance on; the encoder's split by sign."""
    hand = {True: {0: 0, -1: 1, 1: 17, -7: 7, -8: 8, -12: 9, -128: 15, -500: 15, 200: 31},
            False: {0: 0, -1: 1, 3: 0, -15: 15, -16: 16, -20: 17, -128: 31, -999: 31}}
    for bidir, want in hand.items():
        rel = torch.tensor(list(want))
        got = torchref.t5_bucket(rel, bidir, 32, 128).tolist()
        if got != list(want.values()):
            raise SystemExit(f"selfcheck: t5_bucket(bidirectional={bidir}) of {list(want)} is {got}, "
                             f"by hand {list(want.values())}")


def compare(d, dump, kv_dtype, tol, name, enc_ids, dec_arg):
    toks, got = read_dump(dump)
    m = torchref.load_encdec(d, kv_dtype=KV[kv_dtype])
    cfg = torchref.load_config(d)
    dec = [int(x) for x in dec_arg.split(",")] if dec_arg else [cfg.get("decoder_start_token_id", 0)]
    with torch.no_grad():
        enc = m.encode(enc_ids)
        cache = m.new_cache()
        want = [m.decode(dec, enc, cache)[-1]]
        for t in toks[:-1]:
            want.append(m.decode([t], enc, cache)[-1])
    want = torch.stack(want).numpy()
    worst = float(np.abs(want - got).max())
    # a token may differ only where the reference's top two are closer than the tolerance
    bad = [i for i, t in enumerate(toks) if np.sort(want[i])[-1] - want[i][t] > tol]
    ok = worst <= tol and not bad
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {len(toks)} tokens, max |logit diff| {worst:.3g} (tol {tol:g})"
          + (f", tokens off the reference argmax at {bad}" if bad else ""))
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases")
    ap.add_argument("--enc", required=True)
    o = ap.parse_args()
    torch.set_num_threads(1)
    selfcheck()
    enc = [int(x) for x in o.enc.split(",")]
    ok = True
    with open(o.cases) as f:
        for line in f:
            if line.strip():
                d, dump, kv, tol, name, *dec = line.split()
                ok &= compare(d, dump, kv, float(tol), name, enc, dec[0] if dec else None)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
