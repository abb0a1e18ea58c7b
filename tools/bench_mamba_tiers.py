#!/usr/bin/python3
"""bench_mamba_tiers - what streaming a state model's state from the host tier costs.

    /usr/bin/python3 tools/bench_mamba_tiers.py --model DIR [--prompt 512] [--decode 64]
        [--rounds 5] [--threads 2] [--dir /tmp/bench-mamba-tiers]

Starts build/kvtierd on the Mamba model DIR (no prefix cache, no disk
tier) and, round by round, runs the same request twice in alternating
order: once with the state on the device (dynamic) and once in the host
tier (offloaded: every step copies each layer's state into a device slot
while the layer before computes, and back).  Each round's prompt is new
(--prompt ids), followed by --decode greedy tokens.  Prints per mode the
median prefill and decode tokens/s, the median of the per-round ratios
offloaded / device, and the offloaded runs' copy figures (kvtier.prefetch:
bytes per token, overlap = 1 - stall / transfer).  python3 stdlib only.
"""
import argparse
import os
import shutil
import statistics

import kvclient


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/bench-mamba-tiers")
    o = ap.parse_args()
    os.makedirs(o.dir, exist_ok=True)
    d = kvclient.Daemon(os.path.join(o.dir, "kvtierd.sock"), os.path.join(o.dir, "kvtierd.log"),
                        ["--model", o.model, "--threads", str(o.threads), "--no-prefix-cache", "--disk-dir", "none"])
    d.start()
    modes = ("dynamic", "offloaded")
    got = {m: {"prefill": [], "decode": []} for m in modes}
    ratios = {"prefill": [], "decode": []}
    pf = []
    try:
        for r in range(o.rounds):
            ids = [(i * 53 + 7 * r + 11) % 1900 + 50 for i in range(o.prompt)]
            this = {}
            for m in (modes if r % 2 == 0 else modes[::-1]):
                res = d.ok("POST", "/v1/completions",
                           {"prompt": ids, "max_tokens": o.decode, "temperature": 0, "ignore_eos": True,
                            "cache": {"implementation": m}})
                k = res["kvtier"]
                if m == "offloaded" and (k["bytes"]["device"] or not k.get("prefetch")):
                    raise SystemExit("the offloaded run did not stream: %s" % k)
                this[m] = {"prefill": o.prompt / (k["prefill_ms"] / 1e3),
                           "decode": (o.decode - 1) / (k["decode_ms"] / 1e3)}
                if m == "offloaded":
                    pf.append(k["prefetch"])
            for m in modes:
                for w in ("prefill", "decode"):
                    got[m][w].append(this[m][w])
            for w in ("prefill", "decode"):
                ratios[w].append(this["offloaded"][w] / this["dynamic"][w])
            print("round %d: %s" % (r, "  ".join("%s prefill %.1f decode %.1f tok/s" % (m, this[m]["prefill"],
                                                                                     this[m]["decode"])
                                                 for m in modes)))
    finally:
        d.stop()
    shutil.rmtree(o.dir, ignore_errors=True)
    for m in modes:
        print("%-9s  prefill %8.1f tok/s  decode %7.1f tok/s (medians of %d)" %
              (m, statistics.median(got[m]["prefill"]), statistics.median(got[m]["decode"]), o.rounds))
    for w in ("prefill", "decode"):
        print("offloaded / dynamic, %s: %.3f (median of per-round ratios; range %.3f-%.3f)" %
              (w, statistics.median(ratios[w]), min(ratios[w]), max(ratios[w])))
    last = pf[-1]
    print("offloaded, last round: %s" % last)


if __name__ == "__main__":
    main()
