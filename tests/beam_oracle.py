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

--ties L,T: the model's ids L and T have the same input and output
embedding rows (beams.test.sh copies T's rows to L), so every candidate
through L ties exactly with the one through T, and so do all their
continuations.  Other cases run (plain and group search), and besides
the comparison above: the returned hypotheses must hold at least
--min-ties pairs of equal scores whose ids differ only by L <-> T (the
ties happen, in kvtier and in the reference alike), and transformers'
literal ranking (torch.topk, whose order of equal values is unspecified)
must return the same scores with the same ids up to swapping L and T:
only the tie rule tells which of the two comes first.
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


def tie_cases():
    for nb in (2, 4):
        for lp, early in ((1.0, "false"), (2.0, "true"), (0.5, "never")):
            yield {"num-beams": nb, "num-return": nb, "length-penalty": lp, "early-stopping": early}
    # group search: the pair splits over two groups, or fills one group
    # whose full list then takes a better hypothesis
    for nb, g, d, lp in ((4, 2, 1.0, 1.0), (6, 2, 0.5, 0.5), (6, 3, 0.0001, 2.0)):
        yield {"num-beams": nb, "num-return": nb, "length-penalty": lp, "early-stopping": "false",
               "num-beam-groups": g, "diversity-penalty": d}


def swapped(ids, a, b):
    return [b if t == a else a if t == b else t for t in ids]


def tie_pairs(hyps, a, b):
    """Pairs of hypotheses with equal scores whose ids differ by a <-> b."""
    return sum(1 for i, x in enumerate(hyps) for y in hyps[i + 1:]
               if x[0] == y[0] and x[2] != y[2] and swapped(x[2], a, b) == y[2])


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
    ap.add_argument("--ties", help="L,T: ids with the same embedding rows (tie cases)")
    ap.add_argument("--min-ties", type=int, default=1)
    o = ap.parse_args(argv)
    ties = [int(x) for x in o.ties.split(",")] if o.ties else None
    case_list = list(tie_cases() if ties else cases())
    torch.set_num_threads(2)
    name = o.name or os.path.basename(os.path.normpath(o.dir))
    model = torchref.load_model(o.dir, torch.float32)
    prompt = [int(x) for x in o.ids.split(",")]
    eos = beamref.eos_ids(o.dir)
    ok, n_eos, n_ties, n_torch_order = True, 0, 0, 0
    for c in case_list:
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
        def search(topk):
            if c.get("num-beam-groups", 1) > 1:
                return beamref.group_beam_search(*common, c["num-beam-groups"], c["diversity-penalty"], topk=topk)
            return beamref.beam_search(*common, topk=topk)
        ref = search(beamref.stable_topk)
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
        if ties and not bad:
            n_ties += tie_pairs(got, *ties)
            lit = search(torch.topk)
            key = sorted((r[0], r[1], min(r[2], swapped(r[2], *ties))) for r in ref)
            if key != sorted((r[0], r[1], min(r[2], swapped(r[2], *ties))) for r in lit):
                bad = f"torch.topk's ranking returns other hypotheses than L <-> T swaps: {lit}"
            n_torch_order += lit != ref
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
    if ties and n_ties < o.min_ties:
        print(f"FAIL {name}: {n_ties} tied pairs returned over all cases; the test needs {o.min_ties}")
        ok = False
    extra = (f", {n_ties} tied pairs, {n_torch_order} cases where torch.topk puts the other of a tie first"
             if ties else "")
    print(f"{'PASS' if ok else 'FAIL'} {name}: {len(case_list)} beam search cases, {n_eos} eos-ended hypotheses"
          + extra)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
