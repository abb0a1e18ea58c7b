#!/usr/bin/python3
"""bench_restore - the disk tier's restore against recomputing the prefill.

    /usr/bin/python3 tools/bench_restore.py --model DIR [--sizes 2048,8192] [--repeat 3]
        [--prefills K] [--import-sizes 32704] [--threads 2] [--dir /tmp/bench-restore]
        [--json OUT] [--cold-restart] [--keep] [--resume JSON]

Starts build/kvtierd on a socket of its own (--spill-after 1, no prefix
cache, --disk-dir DIR/disk) and, for --repeat sessions of each size:

1. prefill: POST /v1/sessions with the prompt as token ids, timed;
2. restore: once every session has left memory (bytes.disk > 0, device
   and host 0), the page cache dropped (sync; drop_caches: root only, else
   said so), a completion on the session adding one token with
   max_tokens 1, timed; then a warm one of the same shape on the session,
   now in memory, for the step's own cost.  Restore = cold - warm;
3. 2. under --disk-compress never, then always (one daemon per mode; the
   sessions carry over through the restart, each rewritten by the next
   idle spill under the new mode);
4. restart: SIGTERM, start, /health 200, the first request (one token
   more, max_tokens 1) on a persisted session of the largest size, each
   part timed; --repeat restarts under --disk-compress never, the page
   cache as the previous daemon left it (the session file is read with
   O_DIRECT regardless); --cold-restart adds one with the cache dropped
   before the start (the weights come from disk too);
5. build/kvtier-bench-disk --dir DIR --mib 512 --repeat 2 in the same run:
   the directory's raw O_DIRECT read bandwidth, against which the restore
   throughput (bytes.disk / restore) is given.

--prefills K prefills only K sessions of the largest size; the others up
to --repeat are imports of the first one's exported KV (the same KV and
tokens).  --import-sizes adds sessions of larger sizes, never prefilled:
that KV tiled (restored exactly as computed KV would be; the prefill time
is then an estimate, t = a n + b n^2 through the two largest prefilled
sizes).  --resume JSON goes on from an interrupted run kept with --keep
(its --json and --dir): its prefills are taken, its sessions adopted.

Every completion checks cached_tokens == the tokens the session held, so a
restore that silently recomputed would fail the run.  Prints medians and
ranges; --json writes every sample.  python3 stdlib only; the daemon and
its disk directory are removed at the end (the model is not touched).
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import struct
import subprocess
import time

import kvclient
from kvclient import BUILD, log

class Daemon(kvclient.Daemon):
    def __init__(self, o, compress):
        self.o = o
        super().__init__(os.path.join(o.dir, "kvtierd.sock"), os.path.join(o.dir, "kvtierd.log"),
                         ["--model", o.model, "--threads", str(o.threads), "--disk-dir", os.path.join(o.dir, "disk"),
                          "--spill-after", "1", "--disk-compress", compress, "--no-prefix-cache",
                          "--ctx-size", str(o.ctx), "--parallel", "2", "--device-mem", o.device_mem,
                          "--max-body", "8M", "--kv-dtype", "f32"])


def drop_caches():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


class Sess:
    def __init__(self, n, idx, imported=False):
        rng = random.Random(n * 1000 + idx)
        self.n = n
        self.toks = [rng.randrange(100, 31000) for _ in range(n)]
        self.id = None
        self.imported = imported


def tiled_kv(d, src, n):
    """A safetensors KV file of n tokens: src's exported KV rows repeated.
    The values are not what a prefill of those tokens would give, but a
    restore moves them the same way (tiers/image.c checks the structure,
    not the numbers)."""
    for _ in range(50):
        code, blob = d.raw("GET", "/v1/sessions/%s/kv" % src.id)
        if code == 200:
            break
        time.sleep(0.2)  # 409 while a spill or restore holds it
    else:
        raise SystemExit("export of %s: %d %s" % (src.id, code, blob[:200]))
    (hl,) = struct.unpack("<Q", blob[:8])
    h = json.loads(blob[8:8 + hl])
    meta = h.pop("__metadata__")
    data = memoryview(blob)[8 + hl:]
    out, parts, off = {}, [], 0
    for name, t in h.items():
        heads, rows, hd = t["shape"][1], t["shape"][2], t["shape"][3]
        a, b = t["data_offsets"]
        if t["dtype"] != "F32" or b - a != heads * rows * hd * 4 or rows < 1:
            raise SystemExit("unexpected tensor %s %s" % (name, t))
        per = rows * hd * 4
        for hh in range(heads):
            head = bytes(data[a + hh * per:a + (hh + 1) * per])
            parts.append((head * (n // rows + 1))[:n * hd * 4])
        size = heads * n * hd * 4
        out[name] = {"dtype": "F32", "shape": [1, heads, n, hd], "data_offsets": [off, off + size]}
        off += size
    meta["tokens"] = json.dumps(Sess(n, 0, True).toks)
    out["__metadata__"] = meta
    hdr = json.dumps(out).encode()
    hdr += b" " * ((-len(hdr)) % 8)
    return struct.pack("<Q", len(hdr)) + hdr + b"".join(parts)


def import_kv(d, s, blob):
    t0 = time.perf_counter()
    code, r = d.raw("POST", "/v1/sessions/import", blob)
    if code not in (200, 201):
        raise SystemExit("import: %d %s" % (code, r[:300]))
    r = json.loads(r)
    if r["tokens"] != s.n:
        raise SystemExit("imported session holds %d tokens, want %d" % (r["tokens"], s.n))
    s.id = r["id"]
    return time.perf_counter() - t0


def prefill(d, s):
    t0 = time.perf_counter()
    r = d.ok("POST", "/v1/sessions", {"prompt": s.toks})
    dt = time.perf_counter() - t0
    if r["tokens"] != len(s.toks):
        raise SystemExit("session holds %d tokens, %d sent" % (r["tokens"], len(s.toks)))
    s.id = r["id"]
    return dt


def step(d, s):
    """One token more, one generated: (seconds, server prefill_ms)."""
    s.toks.append(random.Random(len(s.toks)).randrange(100, 31000))
    body = {"prompt": s.toks, "session": s.id, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    r = d.ok("POST", "/v1/completions", body)
    dt = time.perf_counter() - t0
    cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
    if cached != len(s.toks) - 1:
        raise SystemExit("session %s: cached_tokens %d, held %d: the KV was not restored"
                         % (s.id, cached, len(s.toks) - 1))
    return dt, r.get("kvtier", {}).get("prefill_ms")


def where(d, s):
    return d.ok("GET", "/v1/sessions/" + s.id)["bytes"]


def wait_spilled(d, sessions, timeout=300):
    end = time.time() + timeout
    while time.time() < end:
        b = [where(d, s) for s in sessions]
        if all(x["disk"] > 0 and x["device"] == 0 and x["host"] == 0 for x in b):
            return b
        time.sleep(0.1)
    raise SystemExit("sessions never left memory: %s" % b)


def adopt(d, sessions):
    """--resume: the persisted sessions of an interrupted run, told apart by
    the tokens of their export; any other (an imported copy) is deleted."""
    want = {tuple(s.toks): s for s in sessions}
    for e in d.ok("GET", "/v1/sessions")["data"]:
        code, blob = d.raw("GET", "/v1/sessions/%s/kv" % e["id"])
        if code != 200:
            raise SystemExit("export of %s: %d" % (e["id"], code))
        (hl,) = struct.unpack("<Q", blob[:8])
        s = want.pop(tuple(json.loads(json.loads(blob[8:8 + hl])["__metadata__"]["tokens"])), None)
        if s:
            s.id = e["id"]
        else:
            d.ok("DELETE", "/v1/sessions/" + e["id"])
    if want:
        raise SystemExit("--resume: %d session(s) of the run are not on disk" % len(want))


def file_size(o, s):
    return os.stat(os.path.join(o.dir, "disk", "u%d" % os.getuid(), s.id + ".kvt")).st_size


def restores(o, d, sessions, label, res):
    for s in sessions:
        wait_spilled(d, sessions)
        kv = where(d, s)["disk"]
        fb = file_size(o, s)
        res["dropped"] &= drop_caches()
        cold, cold_ms = step(d, s)
        warm, warm_ms = step(d, s)
        res["restore"].append(dict(mode=label, n=s.n, imported=s.imported, kv_bytes=kv, file_bytes=fb, cold_s=cold,
                                   warm_s=warm, cold_prefill_ms=cold_ms, warm_prefill_ms=warm_ms))
        log("restore %-6s %6d tokens: KV %.1f MB, file %.1f MB, cold %.3f s, warm %.3f s"
            % (label, s.n, kv / 1e6, fb / 1e6, cold, warm))


def bench_disk(o):
    r = subprocess.run([os.path.join(BUILD, "kvtier-bench-disk"), "--dir", o.dir, "--mib", "512", "--repeat", "2"],
                       capture_output=True, text=True, check=True)
    out = r.stdout
    m = re.search(r"raw: write ([\d.]+) MB/s, read ([\d.]+) MB/s", out)
    if not m:
        raise SystemExit("kvtier-bench-disk: no raw line:\n" + out)
    return dict(text=out, write_mbs=float(m.group(1)), read_mbs=float(m.group(2)))


def med(xs, f="%.3f"):
    return (f + " (" + f + "-" + f + ")") % (statistics.median(xs), min(xs), max(xs))


def prefill_model(res):
    """t(n) = a n + b n^2 through the medians of the two largest prefilled
    sizes (the attention is the quadratic part): an estimate for sizes
    that were imported instead of prefilled."""
    ns = sorted({p["n"] for p in res["prefill"]})[-2:]
    if len(ns) < 2:
        return None
    (n1, n2) = ns
    t1, t2 = (statistics.median(p["s"] for p in res["prefill"] if p["n"] == n) for n in ns)
    b = (t2 / n2 - t1 / n1) / (n2 - n1)
    a = t1 / n1 - b * n1
    return lambda n: a * n + b * n * n


def report(res):
    raw_read = statistics.median(b["read_mbs"] for b in res["disk"])
    est = prefill_model(res)
    print("\n## Results: median (min-max) of %d; --threads %d\n" % (res["repeat"], res["threads"]))
    print("raw O_DIRECT read of the directory (kvtier-bench-disk, before and after): %s MB/s, median %.0f"
          % (" / ".join("%.0f" % b["read_mbs"] for b in res["disk"]), raw_read))
    for n in sorted({r["n"] for r in res["restore"]}):
        pf = [p["s"] for p in res["prefill"] if p["n"] == n]
        if pf:
            pfm = statistics.median(pf)
            print("\n%d tokens: prefill %s s (%.1f tok/s)" % (n, med(pf, "%.1f"), n / pfm))
        else:
            pfm = est(n) if est else None
            print("\n%d tokens: KV imported (tiled from an export), not prefilled; prefill estimated %s"
                  % (n, "%.0f s" % pfm if pfm else "-"))
        for mode in ("never", "always"):
            rs = [r for r in res["restore"] if r["n"] == n and r["mode"] == mode]
            if not rs:
                continue
            cold = [r["cold_s"] for r in rs]
            warm = [r["warm_s"] for r in rs]
            rest = [r["cold_s"] - r["warm_s"] for r in rs]
            kv = statistics.median(r["kv_bytes"] for r in rs)
            fb = statistics.median(r["file_bytes"] for r in rs)
            # a restore inside the noise of the step (cold <= warm) has no throughput
            thr = [r["kv_bytes"] / 1e6 / (r["cold_s"] - r["warm_s"]) for r in rs if r["cold_s"] > r["warm_s"]]
            print("  %-6s KV %.1f MB, file %.1f MB (%.3f): cold request %s s, warm %s s, restore (cold - warm) %s s"
                  % (mode, kv / 1e6, fb / 1e6, fb / kv, med(cold), med(warm), med(rest)))
            line = "         restore throughput %s MB/s of KV = %.0f %% of the raw read%s" % (
                med(thr, "%.0f"), 100 * statistics.median(thr) / raw_read,
                "" if len(thr) == len(rs) else " (%d of %d samples: cold <= warm in the others)" % (len(thr), len(rs))
            ) if thr else "         restore inside the noise of the step (cold <= warm)"
            if pfm:
                line += "; prefill / cold request %.0fx, prefill / restore %.0fx" % (
                    pfm / statistics.median(cold), pfm / statistics.median(rest))
            print(line)
    for kind in ("warm", "cold"):
        rr = [r for r in res["restart"] if r["cache"] == kind]
        if rr:
            print("\nrestart, %s page cache, first request on a %d-token session: stop %s s, exec to /health 200 %s s, "
                  "first request %s s, exec to first token %s s" % (
                      kind, rr[0]["n"], med([r["stop_s"] for r in rr]), med([r["start_s"] for r in rr]),
                      med([r["first_s"] for r in rr]), med([r["start_s"] + r["first_s"] for r in rr])))
    print("\ndisk tier I/O: %s" % res.get("io_mode"))
    if not res["dropped"]:
        print("NOTE: drop_caches failed (not root?): the disk tier's O_DIRECT reads bypass the cache anyway")


def run(o, res):
    if not res["disk"]:
        res["disk"].append(bench_disk(o))
    log("kvtier-bench-disk:\n" + res["disk"][0]["text"])
    d = Daemon(o, "never")
    res["daemons"] = [d]
    log("kvtierd up in %.2f s" % d.start())
    top = max(o.sizes)
    sessions = [Sess(n, i) for n in o.sizes for i in range(o.repeat if n < top else o.prefills)]
    if o.resume:
        adopt(d, sessions)
        if "blob" not in res:
            res["blob"] = {n: tiled_kv(d, sessions[-1], n) for n in [top] * (o.prefills < o.repeat) + o.import_sizes}
    for s in sessions if not o.resume else []:
        dt = prefill(d, s)
        res["prefill"].append(dict(n=s.n, s=dt))
        log("prefill %6d tokens: %.2f s (%.1f tok/s)" % (s.n, dt, s.n / dt))
        if s.n == top and "blob" not in res:
            # the first session of the largest size, exported before anything else touched it
            res["blob"] = {n: tiled_kv(d, s, n) for n in [top] * (o.prefills < o.repeat) + o.import_sizes}
    # copies of it up to --repeat (its exact KV and tokens), then the larger sizes (its rows repeated)
    for n, k in [(top, o.repeat - o.prefills)] + [(n, o.repeat) for n in o.import_sizes]:
        for i in range(k):
            s = Sess(n, 0, n != top)
            log("import %6d tokens: %.2f s" % (n, import_kv(d, s, res["blob"][n])))
            sessions.append(s)
    res.pop("blob", None)
    restores(o, d, sessions, "never", res)

    # restarts: the first request on a persisted session of the largest prefilled size
    big = [s for s in sessions if s.n == top]
    kinds = ["warm"] * o.repeat + (["cold"] if o.cold_restart else [])
    for i, kind in enumerate(kinds):
        wait_spilled(d, sessions)
        stop = d.stop()
        if kind == "cold":
            res["dropped"] &= drop_caches()
        d = Daemon(o, "never")
        res["daemons"] = [d]
        start = d.start()
        s = big[i % len(big)]
        first, _ = step(d, s)
        res["restart"].append(dict(cache=kind, n=s.n, stop_s=stop, start_s=start, first_s=first))
        log("restart (%s): stop %.2f s, start %.2f s, first request %.3f s" % (kind, stop, start, first))

    # compressed: every session rewritten by an idle spill under --disk-compress always
    wait_spilled(d, sessions)
    d.stop()
    d = Daemon(o, "always")
    res["daemons"] = [d]
    d.start()
    for s in sessions:
        step(d, s)
    restores(o, d, sessions, "always", res)
    wait_spilled(d, sessions)
    d.stop()
    with open(d.logpath) as f:
        res["io_mode"] = [ln.strip() for ln in f if re.search(r"disk tier .*(direct|buffered) I/O", ln)][-1:]
    res["disk"].append(bench_disk(o))
    log("kvtier-bench-disk:\n" + res["disk"][1]["text"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--sizes", default="2048,8192", help="prefilled session sizes")
    ap.add_argument("--import-sizes", default="", help="sizes imported (tiled KV of the largest prefilled one)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prefills", type=int, help="prefilled sessions of the largest size (default --repeat); "
                    "the others up to --repeat are imported copies of the first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device-mem", default="8G")
    ap.add_argument("--dir", default="/tmp/bench-restore")
    ap.add_argument("--json")
    ap.add_argument("--cold-restart", action="store_true")
    ap.add_argument("--resume", metavar="JSON", help="go on from an interrupted run's --json and --dir (kept "
                    "with --keep): its prefills are taken, its persisted sessions used")
    ap.add_argument("--keep", action="store_true", help="keep DIR (the daemon's log and disk tier)")
    o = ap.parse_args()
    o.sizes = [int(x) for x in o.sizes.split(",")]
    o.import_sizes = [int(x) for x in o.import_sizes.split(",") if x]
    o.prefills = o.repeat if o.prefills is None else o.prefills
    if not 1 <= o.prefills <= o.repeat or any(n <= max(o.sizes) for n in o.import_sizes):
        raise SystemExit("--prefills must be 1..--repeat, --import-sizes above --sizes")
    o.ctx = max(o.sizes + o.import_sizes) + 64
    with open(os.path.join(o.model, "config.json")) as f:
        # a state-space model (Mamba) has no positions and so no context limit
        max_pos = json.load(f).get("max_position_embeddings", o.ctx)
    if o.ctx > max_pos:
        raise SystemExit("sizes up to %d need a context of %d; the model has %d (mkmodel.py --max-pos)"
                         % (o.ctx - 64, o.ctx, max_pos))
    res = dict(sizes=o.sizes, import_sizes=o.import_sizes, repeat=o.repeat, threads=o.threads, prefill=[],
               restore=[], restart=[], disk=[], dropped=True)
    if o.resume:  # the prefills and the first disk figure of an interrupted run, its sessions in DIR
        with open(o.resume) as f:
            old = json.load(f)
        res.update(prefill=old["prefill"], disk=old["disk"][:1], resumed=True)
    elif os.path.exists(o.dir):
        raise SystemExit(o.dir + " exists: give a new --dir")
    else:
        os.makedirs(o.dir)
    t0 = time.time()
    try:
        run(o, res)
    finally:
        for d in res.pop("daemons", []):
            d.kill()
        res.pop("blob", None)
        res["total_s"] = time.time() - t0
        if o.json:
            with open(o.json, "w") as f:
                json.dump(res, f, indent=1)
        if not o.keep:
            shutil.rmtree(o.dir, ignore_errors=True)
    log("total %.0f s" % res["total_s"])
    report(res)


if __name__ == "__main__":
    main()
