"""bench_encdec - an encoder-decoder session on kvtierd's disk tier: a
generation on the session just back from disk (its cross-attention cache
read back, the encoder not run) against one on a fresh session that
encodes the same input, alternating, and one on the session while it is
resident (the decoder alone).

    /usr/bin/python3 tools/bench_encdec.py --model DIR [--enc-len 2048] [-n 16] [--rounds 3]
                                           [--cache dynamic|offloaded] [--dir DIR]
                                           [--requests [--remote URL]]

Starts build/kvtierd on a socket of its own with --spill-after 1 and a
disk tier in --dir (a temporary directory by default).  The input is
--enc-len token ids (i * 7919 mod vocab, as kvtier-encdec --enc-len), the
decoder prompt the model's decoder_start_token_id, each generation -n
greedy tokens.  Session S is made with the input first; then per round, once S has left
memory (disk bytes > 0, device and host 0, its encoder's too):
  re-encoding: a new session T given the input, timed, then deleted (so
               that S's restore does not find T's cross cache in memory,
               nor T S's);
  restored:    the same generation on S, read back from disk;
  resident:    the same on S at once, now in memory.
Every generation checks encoder_cached_tokens (the input length on S, 0
on T), so a restore that encoded again fails the run.  Prints the medians,
the ratios and S's bytes per tier, resident and spilled.  The daemon runs
with --no-prefix-cache, so that T encodes (the encoder cache would
otherwise still hold S's cross cache).

--requests measures the encoder cache instead (requests outside sessions,
no disk tier): per round a request with an input no request gave before
(its first id the round's number), which encodes it (miss), then the same
request again, which reads its cross cache from the encoder cache (hit:
encoder_cached_tokens checked, and the same tokens).  Prints the medians
of each and their ratio.  With --remote URL (a Redis both daemons use,
docs/remote.md) a second daemon B then gets the same request, which reads
the cross cache A published (a remote hit, encoder_cached_tokens checked,
after A's value is in: the lookup does not wait for a publish in flight),
timed too.

    /usr/bin/python3 tools/bench_encdec.py --model DIR --concurrent N [--enc-len 32] [-n 64] [--rounds 3]
                                           [--threads T]

--concurrent N measures batched decoding instead (no sessions, no disk
tier, no encoder cache): per round, one request alone, then N requests
at once (each its own input: token k of request r is (k * 7919 + r * 31)
mod vocab), each
generating -n greedy tokens; the aggregate tokens/s is every request's
tokens over the wall time from the first send to the last answer (the
encoder's run over the input included: keep --enc-len short to see the
decoder).  Request 0's tokens together must equal its tokens alone.
Beside wall time, the daemon's own CPU time (user + system, from
/proc/PID/stat) gives tokens per CPU second, which other jobs on a shared
machine disturb far less.  Prints the medians, the ratios N-at-once /
alone, and the forward passes (kvtier_forward_steps_total) each
concurrent round took."""
import argparse
import json
import os
import statistics
import tempfile
import threading
import time

import kvclient
from kvclient import log


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--enc-len", type=int, default=2048)
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache", choices=("dynamic", "offloaded"), default="dynamic")
    ap.add_argument("--dir")
    ap.add_argument("--requests", action="store_true", help="the encoder cache: a request's hit against its miss")
    ap.add_argument("--remote", help="with --requests: a Redis URL; a second daemon's remote hit is timed too")
    ap.add_argument("--concurrent", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="kvtierd --threads (default: its own)")
    o = ap.parse_args()
    if o.concurrent:
        return concurrent(o)
    work = o.dir or tempfile.mkdtemp(prefix="bench-encdec-")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(o.model, "config.json")) as f:
        cfg = json.load(f)
    enc = [i * 7919 % cfg["vocab_size"] for i in range(o.enc_len)]
    dec = [cfg["decoder_start_token_id"]]
    d = kvclient.Daemon(os.path.join(work, "kvtierd.sock"), os.path.join(work, "kvtierd.log"),
                        ["--model", o.model, "--max-body", "8M"] +
                        (["--disk-dir", "none", "--parallel", "1"] if o.requests else
                         ["--disk-dir", os.path.join(work, "disk"), "--spill-after", "1", "--parallel", "2",
                          "--no-prefix-cache"]))
    body = {} if o.cache == "dynamic" else {"cache": {"implementation": o.cache}}
    if o.requests:
        b = None
        if o.remote:
            d.args += ["--remote", o.remote]
            b = kvclient.Daemon(os.path.join(work, "b.sock"), os.path.join(work, "b.log"),
                                ["--model", o.model, "--max-body", "8M", "--disk-dir", "none", "--parallel", "1",
                                 "--remote", o.remote])
        log("kvtierd up in %.2f s" % d.start())
        if b:
            log("second kvtierd up in %.2f s" % b.start())
        bench_requests(d, b, o, enc, dec, body)
        return
    log("kvtierd up in %.2f s" % d.start())

    def generate(sid, cached):
        t0 = time.perf_counter()
        r = d.ok("POST", "/v1/completions", {"input": enc, "prompt": dec, "session": sid, "max_tokens": o.n,
                                             "temperature": 0, "ignore_eos": True, "return_tokens": True})
        dt = time.perf_counter() - t0
        got = r["usage"]["prompt_tokens_details"]["encoder_cached_tokens"]
        if got != cached or len(r["choices"][0]["tokens"]) != o.n:
            raise SystemExit("session %s: encoder_cached_tokens %d, want %d" % (sid, got, cached))
        return dt, r["choices"][0]["tokens"]

    def spilled(sid):
        end = time.time() + 300
        while time.time() < end:
            s = d.ok("GET", "/v1/sessions/" + sid)
            b, e = s["bytes"], s["encoder"]["bytes"]
            if b["disk"] > 0 and b["device"] == b["host"] == e["device"] == e["host"] == 0:
                return s
            time.sleep(0.1)
        raise SystemExit("session %s never left memory" % sid)

    try:
        s = d.ok("POST", "/v1/sessions", body)["id"]
        t, want = generate(s, 0)
        log("session %s: first generation %.3f s (encodes the input)" % (s, t))
        res = {"restored": [], "resident": [], "re-encoding": []}
        for r in range(o.rounds):
            on_disk = spilled(s)
            # while S is on disk, so that T does not share its cross cache
            tid = d.ok("POST", "/v1/sessions", body)["id"]
            t, got3 = generate(tid, 0)
            res["re-encoding"].append(t)
            d.request("DELETE", "/v1/sessions/" + tid)
            t, got = generate(s, o.enc_len)
            res["restored"].append(t)
            in_mem = d.ok("GET", "/v1/sessions/" + s)
            t, got2 = generate(s, o.enc_len)
            res["resident"].append(t)
            if not got == got2 == got3 == want:
                raise SystemExit("round %d: the generations differ" % r)
            log("round %d: restored %.3f s, resident %.3f s, re-encoding %.3f s" %
                (r + 1, res["restored"][-1], res["resident"][-1], res["re-encoding"][-1]))
    finally:
        d.stop()
    med = {k: statistics.median(v) for k, v in res.items()}
    print("encoder input %d tokens, %d generated per generation, %s self cache, %d rounds (medians)" %
          (o.enc_len, o.n, o.cache, o.rounds))
    for k in ("resident", "restored", "re-encoding"):
        print("%-12s %8.3f s per generation, %7.1f tokens/s" % (k, med[k], o.n / med[k]))
    print("re-encoding / restored %.2fx, restored / resident %.2fx" %
          (med["re-encoding"] / med["restored"], med["restored"] / med["resident"]))
    mib = 1048576.0
    for name, s in (("resident", in_mem), ("spilled", on_disk)):
        b, e = s["bytes"], s["encoder"]["bytes"]
        print("%-8s self: device %.2f MiB, host %.2f MiB; cross: device %.2f MiB, host %.2f MiB; disk %.2f MiB" %
              (name, b["device"] / mib, b["host"] / mib, e["device"] / mib, e["host"] / mib, b["disk"] / mib))


def bench_requests(d, b, o, enc, dec, body):
    def generate(inp, cached, dm=d):
        t0 = time.perf_counter()
        r = dm.ok("POST", "/v1/completions", dict(body, input=inp, prompt=dec, max_tokens=o.n, temperature=0,
                                                 ignore_eos=True, return_tokens=True))
        dt = time.perf_counter() - t0
        got = r["usage"]["prompt_tokens_details"]["encoder_cached_tokens"]
        if got != cached or len(r["choices"][0]["tokens"]) != o.n:
            raise SystemExit("encoder_cached_tokens %d, want %d" % (got, cached))
        return dt, r["choices"][0]["tokens"]

    res = {"miss": [], "hit": []}
    if b:
        res["remote hit"] = []
    try:
        for r in range(o.rounds):
            inp = [r + 1] + enc[1:]
            t, miss = generate(inp, 0)
            res["miss"].append(t)
            t, hit = generate(inp, len(inp))
            res["hit"].append(t)
            if hit != miss:
                raise SystemExit("round %d: the hit's tokens differ from the miss's" % r)
            if b:
                end = time.time() + 60
                while published(d.ok("GET", "/metrics")) < r + 1:
                    if time.time() > end:
                        raise SystemExit("round %d: A's cross cache never reached Redis" % r)
                    time.sleep(0.05)
                t, remote = generate(inp, len(inp), b)
                res["remote hit"].append(t)
                if remote != miss:
                    raise SystemExit("round %d: the remote hit's tokens differ from the miss's" % r)
            log("round %d: %s" % (r + 1, ", ".join("%s %.3f s" % (k, v[-1]) for k, v in res.items())))
    finally:
        d.stop()
        if b:
            b.stop()
    med = {k: statistics.median(v) for k, v in res.items()}
    print("encoder input %d tokens, %d generated per request, %s self cache, %d rounds (medians)" %
          (o.enc_len, o.n, o.cache, o.rounds))
    for k in med:
        print("%-10s %8.3f s per request, %7.1f tokens/s" % (k, med[k], o.n / med[k]))
    print("miss / hit %.2fx" % (med["miss"] / med["hit"]))
    if b:
        print("miss / remote hit %.2fx" % (med["miss"] / med["remote hit"]))


def published(metrics):
    for line in metrics.decode().splitlines():
        if line.startswith('kvtier_remote_blocks_total{result="published"} '):
            return float(line.split()[1])
    return 0.0


def concurrent(o):
    """--concurrent: one request alone against o.concurrent at once, alternating."""
    work = o.dir or tempfile.mkdtemp(prefix="bench-encdec-")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(o.model, "config.json")) as f:
        cfg = json.load(f)
    n_req = o.concurrent
    inputs = [[(k * 7919 + r * 31) % cfg["vocab_size"] for k in range(o.enc_len)] for r in range(n_req)]
    d = kvclient.Daemon(os.path.join(work, "kvtierd.sock"), os.path.join(work, "kvtierd.log"),
                        ["--model", o.model, "--disk-dir", "none", "--parallel", str(max(n_req, 2)),
                         "--max-body", "8M", "--no-prefix-cache"] + (["--threads", str(o.threads)] if o.threads else []))
    log("kvtierd up in %.2f s" % d.start())

    def generate(r):
        out = d.ok("POST", "/v1/completions", {"input": inputs[r], "max_tokens": o.n, "temperature": 0,
                                               "ignore_eos": True, "return_tokens": True})
        toks = out["choices"][0]["tokens"]
        if len(toks) != o.n:
            raise SystemExit("request %d: %d tokens, want %d" % (r, len(toks), o.n))
        return toks

    def passes():
        for line in d.raw("GET", "/metrics")[1].decode().splitlines():
            if line.startswith("kvtier_forward_steps_total "):
                return int(float(line.split()[1]))
        raise SystemExit("no kvtier_forward_steps_total in /metrics")

    def cpu_s():
        with open("/proc/%d/stat" % d.proc.pid) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    res = {"alone": [], "together": [], "passes": [], "alone_cpu": [], "together_cpu": []}
    try:
        want = generate(0)  # warms the daemon up
        for rnd in range(o.rounds):
            t0, c0 = time.perf_counter(), cpu_s()
            if generate(0) != want:
                raise SystemExit("round %d: request 0 alone changed its tokens" % (rnd + 1))
            res["alone"].append(o.n / (time.perf_counter() - t0))
            res["alone_cpu"].append(o.n / max(cpu_s() - c0, 1e-3))
            got = [None] * n_req
            p0 = passes()
            barrier = threading.Barrier(n_req + 1)

            def client(r):
                barrier.wait()
                got[r] = generate(r)

            threads = [threading.Thread(target=client, args=(r,)) for r in range(n_req)]
            for t in threads:
                t.start()
            barrier.wait()
            t0, c0 = time.perf_counter(), cpu_s()
            for t in threads:
                t.join()
            res["together"].append(n_req * o.n / (time.perf_counter() - t0))
            res["together_cpu"].append(n_req * o.n / max(cpu_s() - c0, 1e-3))
            res["passes"].append(passes() - p0)
            if got[0] != want or any(g is None for g in got):
                raise SystemExit("round %d: request 0 at once differs from alone" % (rnd + 1))
            log("round %d: alone %.1f tokens/s, %d at once %.1f tokens/s (%.2fx); per CPU second %.1f and %.1f "
                "(%.2fx); %d forward passes" %
                (rnd + 1, res["alone"][-1], n_req, res["together"][-1], res["together"][-1] / res["alone"][-1],
                 res["alone_cpu"][-1], res["together_cpu"][-1], res["together_cpu"][-1] / res["alone_cpu"][-1],
                 res["passes"][-1]))
    finally:
        d.stop()
    med = {k: statistics.median(v) for k, v in res.items()}
    print("encoder input %d tokens, %d generated per request, %d rounds (medians)" % (o.enc_len, o.n, o.rounds))
    print("alone        %8.1f tokens/s, %8.1f per CPU second" % (med["alone"], med["alone_cpu"]))
    print("%d at once    %8.1f tokens/s aggregate, %8.1f per CPU second, %d forward passes for %d tokens" %
          (n_req, med["together"], med["together_cpu"], med["passes"], n_req * o.n))
    for unit, a, b in (("wall", "alone", "together"), ("CPU", "alone_cpu", "together_cpu")):
        print("%d at once / alone, %s: %.2fx (rounds: %s)" % (n_req, unit, med[b] / med[a], ", ".join(
            "%.2fx" % (y / x) for x, y in zip(res[a], res[b]))))


if __name__ == "__main__":
    main()
