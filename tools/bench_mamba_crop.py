#!/usr/bin/python3
"""bench_mamba_crop - what a state model's checkpoint interval costs a crop.

    /usr/bin/python3 tools/bench_mamba_crop.py --model DIR [--intervals 16,64,256,1024]
        [--length 2048] [--crops 8] [--threads 1] [--dir /tmp/bench-mamba-crop]

For each interval, starts build/kvtierd --checkpoint-interval I on a
socket of its own, puts a session of --length tokens (ids) on it, and
times --crops crops of one token each, alternating with a step that
feeds the token back (so every crop starts at the same length): a crop
goes back to the last checkpoint at or below its target and feeds the
tokens from there, (length - 1) mod I of them.  Prints, per interval,
the median crop time, the tokens it fed, and the host-tier bytes the
session's checkpoints take.  python3 stdlib only.
"""
import argparse
import os
import shutil
import statistics
import time

import kvclient


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--intervals", default="16,64,256,1024")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--crops", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dir", default="/tmp/bench-mamba-crop")
    o = ap.parse_args()
    os.makedirs(o.dir, exist_ok=True)
    ids = [(i * 53 + 7) % 1900 + 50 for i in range(o.length)]
    print("interval  crop ms (median)  tokens fed  checkpoints in the host tier")
    for iv in (int(x) for x in o.intervals.split(",")):
        d = kvclient.Daemon(os.path.join(o.dir, "kvtierd.sock"), os.path.join(o.dir, "kvtierd.log"),
                            ["--model", o.model, "--threads", str(o.threads), "--checkpoint-interval", str(iv),
                             "--no-prefix-cache", "--disk-dir", "none"])
        d.start()
        try:
            sid = d.ok("POST", "/v1/sessions", {"prompt": ids})["id"]
            times = []
            for _ in range(o.crops):
                t0 = time.perf_counter()
                r = d.ok("POST", "/v1/sessions/%s/crop" % sid, {"n": -1})
                times.append(time.perf_counter() - t0)
                if r["tokens"] != o.length - 1:
                    raise SystemExit("crop left %d tokens, not %d" % (r["tokens"], o.length - 1))
                d.ok("POST", "/v1/completions", {"prompt": ids, "session": sid, "max_tokens": 1})
            host = d.ok("GET", "/v1/sessions/" + sid)["bytes"]["host"]
            print("%8d  %16.1f  %10d  %d bytes" % (iv, statistics.median(times) * 1e3, (o.length - 1) % iv, host))
        finally:
            d.stop()
    shutil.rmtree(o.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
