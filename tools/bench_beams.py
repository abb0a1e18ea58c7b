#!/usr/bin/python3
"""bench_beams - beam search on shared KV blocks, and n samples on one prefill.

    /usr/bin/python3 tools/bench_beams.py --model DIR [--beams 4,16,40] [--prompt-len 128]
        [--max-tokens 16] [--repeat 2] [--offload-mem 40M] [--n 16] [--n-repeat 1]
        [--threads 2] [--dir /tmp/bench-beams] [--json OUT]

Starts build/kvtierd on a socket of its own (--parallel max(beams, n), no
prefix cache so every prompt is computed, --disk-dir none) and, on one
prompt of --prompt-len random token ids, after one untimed request:

1. beam search, --repeat times per --beams entry: num_beams B,
   num_return_sequences B, ignore_eos (every beam runs --max-tokens, so
   the work is the same each time).  Reported: wall time; computed decode
   tokens/s = B * beam_search.steps / decode_ms (the beam tokens the model
   ran, after the prefill); returned tokens/s = usage.completion_tokens /
   wall (the B sequences returned, the prefill included); the KV bytes per
   tier from /metrics (kvtier_kv_cache_bytes, polled every 0.1 s while the
   request runs: the store's own count, shared blocks once) and from the
   response's kvtier.bytes (summed over the beams: a shared block is
   counted in every beam that holds it); beam_search's bytes copied per
   step against a whole-cache reorder per step.
2. the largest B again on a second daemon with --device-mem --offload-mem:
   the request is sized up front and must start offloaded (fallback
   "offloaded", checked), and return the same beams (token ids equal,
   sequence_score within 1e-5) as step 1's (checked).
3. n = --n samples (temperature 0.8, seed S) in one request against --n
   separate requests with seeds S..S+n-1 sent at once (each a full
   prefill: no prefix cache), --n-repeat times.  Choice i must equal the
   request with seed S+i alone (checked: a choice that differs from its
   concurrent request, which ran batched with the others, is sent again
   alone; how many differed is reported).  Reported: wall time, the
   prefill's time (kvtier.prefill_ms), prompt tokens computed, KV peak.
   No counter gives the prompt tokens computed directly:
   kvtier_prompt_tokens_total counts n * prompt for an n request (each
   choice's prompt, forked or not), so computed = prompt_tokens_total -
   cached_tokens_total - prefix-cache hits for the separate requests, and
   the prompt once for the n request (choice 0 computes it, the others
   fork it: engine.c share_prefill); forward_steps_total is shown too.

python3 stdlib only; prints medians (min-max), --json writes every sample.
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import threading
import time

import kvclient
from kvclient import log

class Daemon(kvclient.Daemon):
    def __init__(self, o, name, extra):
        super().__init__(os.path.join(o.dir, name + ".sock"), os.path.join(o.dir, name + ".log"),
                         ["--model", o.model, "--threads", str(o.threads), "--disk-dir", "none", "--no-prefix-cache",
                          "--parallel", str(max(o.beams + [o.n]))] + extra)

    def metrics(self):
        code, raw = self.request("GET", "/metrics", timeout=30)
        if code != 200:
            raise SystemExit("/metrics: %d" % code)
        out = {}
        for ln in raw.decode().splitlines():
            m = re.match(r"kvtier_(\w+)(\{[^}]*\})? (\S+)$", ln)
            if m:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out


DEV, HOST = 'kv_cache_bytes{tier="device"}', 'kv_cache_bytes{tier="host"}'
COUNTERS = ("prompt_tokens_total", "prompt_cached_tokens_total", "prefix_cache_hit_tokens_total",
            "forward_steps_total", "generation_tokens_total")


class Peak:
    """Polls /metrics while work runs: the largest KV bytes per tier seen,
    and the counters' change from start to stop."""

    def __init__(self, d):
        self.d = d
        self.before = d.metrics()
        self.peak = {DEV: 0.0, HOST: 0.0, "sum": 0.0}
        self.done = threading.Event()
        self.t = threading.Thread(target=self.poll)
        self.t.start()

    def sample(self):
        m = self.d.metrics()
        for k in (DEV, HOST):
            self.peak[k] = max(self.peak[k], m[k])
        self.peak["sum"] = max(self.peak["sum"], m[DEV] + m[HOST])
        return m

    def poll(self):
        while not self.done.wait(0.1):
            self.sample()

    def stop(self):
        self.done.set()
        self.t.join()
        after = self.sample()
        return dict(peak_device=self.peak[DEV], peak_host=self.peak[HOST], peak_total=self.peak["sum"],
                    **{k: after[k] - self.before[k] for k in COUNTERS})


def beam(d, o, toks, b):
    body = {"prompt": toks, "max_tokens": o.max_tokens, "num_beams": b, "num_return_sequences": b,
            "ignore_eos": True, "return_tokens": True}
    pk = Peak(d)
    t0 = time.perf_counter()
    try:
        r = d.ok("POST", "/v1/completions", body)
    finally:
        wall = time.perf_counter() - t0
        m = pk.stop()
    k, bs = r["kvtier"], r["kvtier"]["beam_search"]
    if len(r["choices"]) != b or bs["steps"] != o.max_tokens - 1:
        raise SystemExit("%d beams: %d choices, %d steps" % (b, len(r["choices"]), bs["steps"]))
    return dict(beams=b, wall_s=wall, prefill_s=k["prefill_ms"] / 1e3, decode_s=k["decode_ms"] / 1e3,
                steps=bs["steps"], computed_tok_s=b * bs["steps"] / (k["decode_ms"] / 1e3),
                returned_tok_s=r["usage"]["completion_tokens"] / wall,
                completion_tokens=r["usage"]["completion_tokens"],
                strategy=k["strategy"], fallback=k["fallback"], resident_layers=k["resident_layers"],
                streamed_layers=k["streamed_layers"], resp_bytes=k["bytes"], kv_bytes_copied=k["kv_bytes_copied"],
                copied_per_step=bs["kv_bytes_copied_per_step"],
                reorder_per_step=bs["whole_cache_reorder_bytes_per_step"], prefetch=k["prefetch"],
                beams_out=[(c["tokens"], c["sequence_score"]) for c in r["choices"]], **m)


def sample_body(o, toks, n, seed):
    return {"prompt": toks, "max_tokens": o.max_tokens, "n": n, "seed": seed, "temperature": 0.8,
            "ignore_eos": True, "return_tokens": True}


def n_vs_separate(d, o, toks, seed):
    pk = Peak(d)
    t0 = time.perf_counter()
    try:
        r = d.ok("POST", "/v1/completions", sample_body(o, toks, o.n, seed))
    finally:
        wall = time.perf_counter() - t0
        m = pk.stop()
    one = dict(wall_s=wall, prefill_s=r["kvtier"]["prefill_ms"] / 1e3, resp_bytes=r["kvtier"]["bytes"],
               kv_bytes_copied=r["kvtier"]["kv_bytes_copied"], prompt_computed=len(toks), **m)
    got = {c["index"]: c["tokens"] for c in r["choices"]}

    res = [None] * o.n

    def one_req(i):
        try:
            res[i] = d.ok("POST", "/v1/completions", sample_body(o, toks, 1, seed + i))
        except SystemExit as e:  # raised in a thread: kept for the main one
            res[i] = e

    pk = Peak(d)
    t0 = time.perf_counter()
    th = [threading.Thread(target=one_req, args=(i,)) for i in range(o.n)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    wall = time.perf_counter() - t0
    m = pk.stop()
    for x in res:
        if isinstance(x, SystemExit):
            raise x
    # The promise is about a request alone; these ran batched with each other (prefill chunks and
    # decode steps mixed), so a choice that differs is sent again alone, where it must be equal.
    differ = [i for i, x in enumerate(res) if x["choices"][0]["tokens"] != got[i]]
    for i in differ:
        if d.ok("POST", "/v1/completions", sample_body(o, toks, 1, seed + i))["choices"][0]["tokens"] != got[i]:
            raise SystemExit("choice %d of the n=%d request differs from the lone request with seed %d"
                             % (i, o.n, seed + i))
    # each request's prefill_ms includes the others' prefills batched with its own: the last one's is the
    # time until every prompt was computed
    sep = dict(wall_s=wall, prefill_s=max(x["kvtier"]["prefill_ms"] for x in res) / 1e3,
               resp_bytes={t: sum(x["kvtier"]["bytes"][t] for x in res) for t in ("device", "host", "disk")},
               prompt_computed=m["prompt_tokens_total"] - m["prompt_cached_tokens_total"]
               - m["prefix_cache_hit_tokens_total"], differ_concurrent=differ, **m)
    return one, sep


def med(xs, f="%.2f"):
    xs = list(xs)
    return (f + " (" + f + "-" + f + ")") % (statistics.median(xs), min(xs), max(xs)) if len(xs) > 1 else f % xs[0]


def mb(x):
    return x / 1e6


def report(o, res):
    print("\n## Results: median (min-max) of %d; prompt %d token ids, max_tokens %d, --threads %d\n"
          % (o.repeat, o.prompt_len, o.max_tokens, o.threads))
    print("| beams | device-mem | wall s | prefill s | decode s | computed decode tok/s | returned tok/s "
          "| KV peak MB device / host (metrics) | KV at end MB device / host (response, per beam summed) "
          "| copied MB/step | whole reorder MB/step | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label in ("default", "offload"):
        for b in o.beams:
            rs = [r for r in res["beams"] if r["beams"] == b and r["mem"] == label]
            if not rs:
                continue
            cp = statistics.median(r["copied_per_step"] for r in rs)
            wr = statistics.median(r["reorder_per_step"] for r in rs)
            print("| %d | %s | %s | %s | %s | %s | %s | %.1f / %.1f | %.1f / %.1f | %.2f | %.1f | %.1f%% |" % (
                b, "default" if label == "default" else o.offload_mem + " (%s, %d/%d layers streamed)" % (
                    rs[0]["fallback"], rs[0]["streamed_layers"], rs[0]["streamed_layers"] + rs[0]["resident_layers"]),
                med(r["wall_s"] for r in rs), med(r["prefill_s"] for r in rs), med(r["decode_s"] for r in rs),
                med((r["computed_tok_s"] for r in rs), "%.1f"), med((r["returned_tok_s"] for r in rs), "%.1f"),
                mb(max(r["peak_device"] for r in rs)), mb(max(r["peak_host"] for r in rs)),
                mb(rs[0]["resp_bytes"]["device"]), mb(rs[0]["resp_bytes"]["host"]), mb(cp), mb(wr), 100 * cp / wr))
    print("\n| n=%d, temperature 0.8 | wall s | first token s (the last request's) | prompt tokens computed "
          "| prompt_tokens_total | forward steps | KV peak MB (metrics, device + host) "
          "| KV at end MB (response) |" % o.n)
    print("|---|---|---|---|---|---|---|---|")
    for kind, label in (("one", "one request, n=%d" % o.n), ("sep", "%d requests at once" % o.n)):
        rs = [x[kind] for x in res["n"]]
        print("| %s | %s | %s | %d | %d | %s | %.1f | %.1f |" % (
            label, med(r["wall_s"] for r in rs), med(r["prefill_s"] for r in rs), rs[0]["prompt_computed"],
            rs[0]["prompt_tokens_total"], med((r["forward_steps_total"] for r in rs), "%.0f"),
            mb(max(r["peak_total"] for r in rs)), mb(rs[0]["resp_bytes"]["device"] + rs[0]["resp_bytes"]["host"])))
    one, sep = res["n"][0]["one"], res["n"][0]["sep"]
    print("\nchoices equal to their concurrent request: %s of %d (the others equal the request alone)"
          % (", ".join(str(o.n - len(x["sep"]["differ_concurrent"])) for x in res["n"]), o.n))
    print("separate / one (first repeat): wall %.2fx, prefill %.1fx, prompt computed %.0fx, KV peak %.2fx"
          % (sep["wall_s"] / one["wall_s"], sep["prefill_s"] / one["prefill_s"],
             sep["prompt_computed"] / one["prompt_computed"], sep["peak_total"] / one["peak_total"]))


def warm_up(d, toks):
    """One untimed request: the first one faults the mapped weights in."""
    d.ok("POST", "/v1/completions", {"prompt": toks, "max_tokens": 2, "ignore_eos": True})


def run(o, res):
    toks = [random.Random(o.seed).randrange(100, 31000) for _ in range(o.prompt_len)]
    d = Daemon(o, "default", [])
    res["daemons"] = [d]
    log("kvtierd up in %.2f s" % d.start())
    warm_up(d, toks)
    for i in range(o.repeat):
        for b in o.beams:
            r = beam(d, o, toks, b)
            r["mem"] = "default"
            res["beams"].append(r)
            log("%2d beams: wall %.1f s, prefill %.1f s, decode %.1f s, %.1f computed tok/s, KV peak %.1f MB device"
                " %.1f MB host, copied %.2f MB/step vs reorder %.1f MB/step" % (
                    b, r["wall_s"], r["prefill_s"], r["decode_s"], r["computed_tok_s"], mb(r["peak_device"]),
                    mb(r["peak_host"]), mb(r["copied_per_step"]), mb(r["reorder_per_step"])))
    ref = next(r["beams_out"] for r in res["beams"] if r["beams"] == max(o.beams))
    for i in range(o.n_repeat):
        one, sep = n_vs_separate(d, o, toks, o.seed + 1000 * i)
        res["n"].append(dict(one=one, sep=sep))
        log("n=%d: one request %.1f s (prefill %.1f s, KV peak %.1f MB), %d requests %.1f s (last prefill %.1f s, "
            "KV peak %.1f MB); choices equal to the concurrent requests: %d of %d, the others equal alone" % (
                o.n, one["wall_s"], one["prefill_s"], mb(one["peak_total"]), o.n, sep["wall_s"], sep["prefill_s"],
                mb(sep["peak_total"]), o.n - len(sep["differ_concurrent"]), o.n))
    d.stop()

    d = Daemon(o, "offload", ["--device-mem", o.offload_mem])
    res["daemons"] = [d]
    log("kvtierd --device-mem %s up in %.2f s" % (o.offload_mem, d.start()))
    warm_up(d, toks)
    b = max(o.beams)
    for i in range(o.repeat):
        r = beam(d, o, toks, b)
        r["mem"] = "offload"
        res["beams"].append(r)
        if r["fallback"] != "offloaded":
            raise SystemExit("%d beams under --device-mem %s did not start offloaded: %s"
                             % (b, o.offload_mem, r["strategy"]))
        # the streamed attention rounds differently in the last digits of a score
        if [t for t, _ in r["beams_out"]] != [t for t, _ in ref] or \
                any(abs(x - y) > 1e-5 for (_, x), (_, y) in zip(r["beams_out"], ref)):
            raise SystemExit("%d beams offloaded returned other beams than with the default budget" % b)
        log("%2d beams offloaded: wall %.1f s, decode %.1f s, %.1f computed tok/s, KV peak %.1f MB device"
            " %.1f MB host, same beams" % (b, r["wall_s"], r["decode_s"], r["computed_tok_s"], mb(r["peak_device"]),
                                          mb(r["peak_host"])))
    d.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--beams", default="4,16,40")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=2, help="beam-search runs per size")
    ap.add_argument("--offload-mem", default="40M", help="--device-mem of the offloaded run")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--n-repeat", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/bench-beams")
    ap.add_argument("--json")
    o = ap.parse_args()
    o.beams = [int(x) for x in o.beams.split(",")]
    if min(o.beams) < 2 or max(o.beams + [o.n]) > 64 or o.n < 2 or o.max_tokens < 2 or o.prompt_len < 1 \
            or o.repeat < 1 or o.n_repeat < 1:
        raise SystemExit("--beams 2..64, --n 2..64, --max-tokens >= 2, --prompt-len, --repeat, --n-repeat >= 1")
    if os.path.exists(o.dir):
        raise SystemExit(o.dir + " exists: give a new --dir")
    os.makedirs(o.dir)
    res = dict(args=vars(o).copy(), beams=[], n=[])
    t0 = time.time()
    try:
        run(o, res)
    finally:
        for d in res.pop("daemons", []):
            d.kill()
        res["total_s"] = time.time() - t0
        if o.json:
            with open(o.json, "w") as f:
                json.dump(res, f, indent=1)
        shutil.rmtree(o.dir, ignore_errors=True)
    log("total %.0f s" % res["total_s"])
    report(o, res)


if __name__ == "__main__":
    main()
