#!/usr/bin/python3
"""bench_remote - the remote tier (Redis) against computing and against a
local prefix hit.

    /usr/bin/python3 tools/bench_remote.py --model DIR [--sizes 2048,8192] [--repeat 2]
        [--threads 2] [--dir /tmp/bench-remote] [--fleet-model DIR] [--json OUT]
        [--remote-timeout MS] [--no-redis-benchmark]

Starts its own redis-server on a Unix socket under --dir (killed at the
end) and, per prompt size and repeat (a fresh random prompt of token ids
each time):

1. cold: daemon A (--remote) computes two prompts, max_tokens 1, timed
   (the second is the cold figure: A has run a request before it);
2. local hit: A again on the second (the prefix cache in memory);
3. remote first hit: daemon B (--remote, nothing local), started with A
   and given no request before, on the first prompt once A's blocks are
   published: B's first request;
4. remote warmed hit: B again, on the second prompt;
   cached_tokens and the token are checked for 2.-4.
   (a run that silently recomputed fails);
5. the fetch's throughput (of 4.): B's kvtier_remote_bytes_total{dir="in"} over
   kvtier_remote_lookup_seconds_total, against redis-benchmark GET of the
   same value size on the same socket (-P 32, the lookup's batch);
6. with --fleet-model: 4 daemons on one Redis and 4 without it, the same
   stream of prompts (16 documents of 512 tokens + a 32-token question,
   documents Zipf(1.1)-distributed, 64 requests round-robin over the
   daemons): prompt tokens computed in each case (prompt - cached).
python3 stdlib only.
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import time

import kvclient
from kvclient import log


def redis_start(d):
    sock = os.path.join(d, "redis.sock")
    p = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", sock, "--save", "", "--appendonly", "no",
                          "--dir", d, "--maxmemory", "8gb", "--maxmemory-policy", "allkeys-lru"],
                         stdout=open(os.path.join(d, "redis.log"), "ab"), stderr=subprocess.STDOUT)
    for _ in range(500):
        if subprocess.run(["redis-cli", "-s", sock, "PING"], capture_output=True).stdout.strip() == b"PONG":
            return p, sock
        time.sleep(0.02)
    raise SystemExit("redis-server did not start")


def metric(d, name):
    code, raw = d.raw("GET", "/metrics")
    m = re.search(r"^kvtier_%s (\S+)$" % re.escape(name), raw.decode(), re.M)
    return float(m.group(1)) if m else 0.0


def complete(d, ids, max_tokens=1):
    t = time.perf_counter()
    r = d.ok("POST", "/v1/completions", {"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                         "ignore_eos": True, "return_tokens": True})
    return time.perf_counter() - t, r["usage"]["prompt_tokens_details"]["cached_tokens"], r["choices"][0]["tokens"]


def daemon(o, name, model, flags):
    d = kvclient.Daemon(os.path.join(o.dir, name + ".sock"), os.path.join(o.dir, name + ".log"),
                        ["--model", model, "--threads", str(o.threads), "--disk-dir", "none", "--ctx-size",
                         str(max(o.sizes + [2048]) + 64), "--parallel", "2", "--device-mem", o.device_mem,
                         "--remote-timeout", str(o.remote_timeout)] + flags)
    d.start()
    return d


def ttft(o, sock, res):
    rflags = ["--remote", "unix:" + sock]
    for n in o.sizes:
        for rep in range(o.repeat):
            a = daemon(o, "a", o.model, rflags)
            b = daemon(o, "b", o.model, rflags)
            try:
                first = [random.randrange(100, 1900) for _ in range(n)]
                ids = [random.randrange(100, 1900) for _ in range(n)]
                cold_first, _, tf = complete(a, first)
                cold, c0, t0 = complete(a, ids)
                local, c1, t1 = complete(a, ids)
                nb = 2 * (n // 16)
                t_end = time.time() + 600
                while metric(a, 'remote_blocks_total{result="published"}') < nb and time.time() < t_end:
                    time.sleep(0.05)
                r_first, c2, t2 = complete(b, first)
                b0, s0 = metric(b, 'remote_bytes_total{dir="in"}'), metric(b, "remote_lookup_seconds_total")
                first_lookup = s0
                remote, c3, t3 = complete(b, ids)
                want = (n - 1) // 16 * 16
                if (c1, c2, c3) != (want,) * 3 or t0 != t1 or t0 != t3 or tf != t2:
                    raise SystemExit("size %d: cached %d / %d / %d (want %d) or tokens differ" % (n, c1, c2, c3, want))
                mb = (metric(b, 'remote_bytes_total{dir="in"}') - b0) / 1e6
                secs = metric(b, "remote_lookup_seconds_total") - s0
                row = {"size": n, "cold_first_s": cold_first, "cold_s": cold, "local_s": local,
                       "remote_first_s": r_first, "first_lookup_s": first_lookup, "remote_s": remote, "fetched_mb": mb, "lookup_s": secs,
                       "fetch_mb_s": mb / secs if secs else 0}
                log("size %d: cold %.3f s (A's first %.3f s), local hit %.3f s, remote first hit %.3f s (%.1fx; "
                    "lookup %.3f s), remote warmed hit %.3f s (%.1fx; %.1f MB fetched in %.3f s: %.0f MB/s)"
                    % (n, cold, cold_first, local, r_first, cold / r_first, first_lookup, remote, cold / remote, mb,
                       secs, row["fetch_mb_s"]))
                res["ttft"].append(row)
            finally:
                a.kill()
                b.kill()
    if o.no_redis_benchmark:
        return
    value = max(1, int(res["ttft"][-1]["fetched_mb"] * 1e6 / ((max(o.sizes) - 1) // 16)))
    out = subprocess.run(["redis-benchmark", "-s", sock, "-t", "set,get", "-d", str(value), "-n", "2000", "-P", "32",
                          "-c", "1", "--csv"], capture_output=True, text=True).stdout
    log("redis-benchmark, %d-byte values, -P 32 -c 1 (csv):\n%s" % (value, out.strip()))
    res["redis_benchmark"] = {"value_bytes": value, "out": out}


def fleet(o, sock, res):
    rng = random.Random(7)
    docs = [[rng.randrange(100, 1900) for _ in range(512)] for _ in range(16)]
    w = [1 / (k + 1) ** 1.1 for k in range(16)]
    reqs = [(rng.choices(range(16), w)[0], [rng.randrange(100, 1900) for _ in range(32)]) for _ in range(64)]
    for label, flags in (("no sharing", []), ("remote tier", ["--remote", "unix:" + sock])):
        subprocess.run(["redis-cli", "-s", sock, "FLUSHALL"], capture_output=True)
        ds = [daemon(o, "f%d" % i, o.fleet_model, flags) for i in range(4)]
        try:
            prompt = cached = 0
            t = time.perf_counter()
            for i, (doc, q) in enumerate(reqs):
                _, c, _ = complete(ds[i % 4], docs[doc] + q)
                prompt += 544
                cached += c
                time.sleep(0.05)  # a publish lands before the next daemon asks (a fleet's requests are apart)
            wall = time.perf_counter() - t
        finally:
            for d in ds:
                d.kill()
        log("fleet, %s: %d prompt tokens, %d computed (%.0f%%), %d from caches, %.1f s"
            % (label, prompt, prompt - cached, 100 * (prompt - cached) / prompt, cached, wall))
        res["fleet"].append({"mode": label, "prompt": prompt, "computed": prompt - cached, "wall_s": wall})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--fleet-model")
    ap.add_argument("--sizes", default="2048,8192")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device-mem", default="2G")
    ap.add_argument("--dir", default="/tmp/bench-remote")
    ap.add_argument("--json")
    # a loaded machine stalls Redis past the daemon's default 500 ms at times: a timeout is a miss, not what
    # this measures
    ap.add_argument("--remote-timeout", type=int, default=5000)
    ap.add_argument("--no-redis-benchmark", action="store_true")
    o = ap.parse_args()
    o.sizes = [int(x) for x in o.sizes.split(",") if x]
    os.makedirs(o.dir, exist_ok=True)
    rp, sock = redis_start(o.dir)
    res = {"ttft": [], "fleet": []}
    try:
        if o.sizes:
            ttft(o, sock, res)
        if o.fleet_model:
            fleet(o, sock, res)
    finally:
        rp.kill()
        rp.wait()
    if o.json:
        with open(o.json, "w") as f:
            json.dump(res, f, indent=1)
    if res["ttft"]:
        for n in o.sizes:
            rows = [r for r in res["ttft"] if r["size"] == n]
            log("median, size %d: cold %.3f s, local %.3f s, remote first %.3f s, remote warmed %.3f s, fetch %.0f MB/s"
                % (n, statistics.median(r["cold_s"] for r in rows), statistics.median(r["local_s"] for r in rows),
                   statistics.median(r["remote_first_s"] for r in rows), statistics.median(r["remote_s"] for r in rows),
                   statistics.median(r["fetch_mb_s"] for r in rows)))
    shutil.rmtree(o.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
