#!/usr/bin/python3
"""beam_oracle - kvtier-run's beam search against tools/beamref.py.

    /usr/bin/python3 tests/beam_oracle.py DIR --run BUILD/kvtier-run --ids 1,2,3 -n N [--name NAME]
                                          [--tol X] [--min-eos N]

For each case (num_beams 2 and 4; length_penalty 1.0, 0.5, 2.0;
early_stopping true, false, "never"; then num_return_sequences,
min_new_tokens and no_repeat_ngram_size; then group beam search with
num_beam_groups and diversity_penalty) both sides return their
hypotheses: the token ids must be equal and the sequence scores within
--tol (absolute; both compute in f32, kvtier with a KV cache, the
reference without).  --min-eos: at least that many returned hypotheses,
over all cases, must end in an eos id, so that the cases exercise
finished beams and not only max_tokens.  Exit 0 = pass, 1 = mismatch.
"""
import argparse
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import beamref  # noqa: E402
import torchref  # noqa: E402


def cases():
    for nb in (2, 4):
        for lp in (1.0, 0.5, 2.0):
            for early in ("true", "false", "never"):
                yield {"num-beams": nb, "num-return": nb, "length-penalty": lp, "early-stopping": early}
    yield {"num-beams": 4, "num-return": 2, "length-penalty": 1.0, "early-stopping": "false", "min-new": 6}
    yield {"num-beams": 3, "num-return": 3, "length-penalty": 1.0, "early-stopping": "false", "no-repeat-ngram": 2}
    yield {"num-beams": 5, "num-return": 1, "length-penalty": 0.0, "early-stopping": "never"}
    # group (diverse) beam search
    for nb, g, d, lp, early in ((4, 2, 1.0, 1.0, "false"), (6, 3, 0.5, 2.0, "never"), (4, 2, 5.0, 0.5, "true"),
                                (4, 4, 0.7, 1.0, "false")):
        yield {"num-beams": nb, "num-return": nb // 2, "length-penalty": lp, "early-stopping": early,
               "num-beam-groups": g, "diversity-penalty": d}


def parse(lines):
    out = []
    for ln in lines:
        f = ln.split()
        if len(f) != 8 or f[0] != "beam":
            raise ValueError(f"unexpected line {ln!r}")
        out.append((float(f[3]), f[5] == "1", [int(x) for x in f[7].split(",")] if f[7] else []))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--run", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("-n", type=int, required=True)
    ap.add_argument("--name")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--min-eos", type=int, default=0)
    o = ap.parse_args(argv)
    torch.set_num_threads(2)
    name = o.name or os.path.basename(os.path.normpath(o.dir))
    model = torchref.load_model(o.dir, torch.float32)
    prompt = [int(x) for x in o.ids.split(",")]
    eos = beamref.eos_ids(o.dir)
    ok, n_eos = True, 0
    for c in cases():
        label = f"{name} " + " ".join(f"{k}={v}" for k, v in c.items())
        args = [o.run, "-m", o.dir, "--ids", o.ids, "-n", str(o.n), "--quiet"]
        for k, v in c.items():
            args += [f"--{k}", str(v)]
        p = subprocess.run(args, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"FAIL {label}: kvtier-run exited {p.returncode}: {p.stderr.strip()}")
            ok = False
            continue
        got = parse(p.stdout.splitlines())
        common = (model, prompt, o.n, c["num-beams"], c["num-return"], c["length-penalty"],
                  beamref.parse_early(c["early-stopping"]), c.get("min-new", 0), c.get("no-repeat-ngram", 0), eos)
        if c.get("num-beam-groups", 1) > 1:
            ref = beamref.group_beam_search(*common, c["num-beam-groups"], c["diversity-penalty"])
        else:
            ref = beamref.beam_search(*common)
        bad = None
        if len(got) != len(ref):
            bad = f"{len(got)} hypotheses, the reference {len(ref)}"
        for i, (g, r) in enumerate(zip(got, ref)):
            if bad:
                break
            if g[2] != r[2] or g[1] != r[1]:
                bad = f"hypothesis {i}: ids {g[2]} eos {g[1]}, the reference {r[2]} eos {r[1]}"
            elif abs(g[0] - r[0]) > o.tol:
                bad = f"hypothesis {i}: score {g[0]:.9g}, the reference {r[0]:.9g} (tol {o.tol:g})"
        if bad:
            print(f"FAIL {label}: {bad}")
            ok = False
        n_eos += sum(1 for r in ref if r[1])
        if c.get("min-new") and any(r[1] and len(r[2]) < c["min-new"] for r in got):
            print(f"FAIL {label}: a hypothesis ended in eos before min_new_tokens")
            ok = False
    if n_eos < o.min_eos:
        print(f"FAIL {name}: {n_eos} hypotheses ended in eos over all cases; the test needs {o.min_eos}")
        ok = False
    print(f"{'PASS' if ok else 'FAIL'} {name}: {len(list(cases()))} beam search cases, {n_eos} eos-ended hypotheses")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
