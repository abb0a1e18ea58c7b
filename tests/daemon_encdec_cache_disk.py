"""kvtierd's encoder cache on the disk tier (tiny random T5 and BART from
tools/mkmodel.py).  A cross-attention cache evicted under a small
--prefix-cache-mem is written to disk, and the next request with its input
reads it back instead of running the encoder: encoder_cached_tokens the
input's length, the tokens and log-probabilities of a daemon without a disk
tier, bit for bit.  At SIGTERM the caches not on disk yet are written, and
after a restart on the same --disk-dir an input encoded before is read from
there.  Another model on that directory finds nothing.  A file with a
flipped byte, and a truncated one, are misses with a log line, quarantined,
the input encoded again with the same tokens, the daemon serving on.
/metrics counts the writes and reads (kvtier_encoder_disk_caches_total);
--disk-dir none writes nothing."""
import glob
import os
import sys
import time

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, metric  # noqa: E402
sys.path.insert(0, "tools")
import mkmodel  # noqa: E402

A = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 264, 33, 83, 279, 50, 288, 41, 97, 169, 39]
B, C, D = A[::-1], A[1:] + [7], [(i * 37 + 5) % 300 + 10 for i in range(20)]
gen = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True, "logprobs": 2}
# one cross cache of 20 tokens: 2 layers x 2 blocks of 16 tokens x 4 heads x
# 16 x f32, K and V: 32 KiB; 40000 bytes hold one unreferenced
SMALL = ["--prefix-cache-mem", "40000"]


def written(d):
    return metric(d, "encoder_disk_caches_total", '{op="write"}')


def read(d):
    return metric(d, "encoder_disk_caches_total", '{op="read"}')


def wait_written(d, n, timeout=10):
    end = time.time() + timeout
    while written(d) < n and time.time() < end:
        time.sleep(0.05)
    return written(d)


def complete(d, enc):
    r = d.post_ok("/v1/completions", dict(gen, input=enc))
    c = r["choices"][0]
    return (c["tokens"], c["logprobs"]), r["usage"]["prompt_tokens_details"]["encoder_cached_tokens"]


def files(d):
    return sorted(glob.glob(os.path.join(d.sock + ".disk", "x*", "*.kvt")))


def quarantined(d):
    return glob.glob(os.path.join(d.sock + ".disk", "quarantine", "*"))


def daemon(tmp, model, name, *args):
    d = Daemon(*args, model=model, tmp=tmp)
    d.sock = os.path.join(tmp, name + ".sock")
    d.log = os.path.join(tmp, name + ".log")
    return d


def run(name, args):
    ref = Daemon("--disk-dir", "none", model="made below")
    tmp = ref.tmp
    model = ref.model = os.path.join(tmp, name)
    mkmodel.main(["--out", model, "--seed", "5", "--layers", "2", "--dim", "64", "--heads", "4", "--ffn", "128",
                  "--vocab", "320", "--max-pos", "128"] + args)
    ref.start()
    want = {tuple(enc): complete(ref, enc)[0] for enc in (A, B, C, D)}
    check(written(ref) == 0 and read(ref) == 0, "%s: --disk-dir none: nothing written or read" % name)
    check(ref.stop() == 0, "%s: the reference stops cleanly" % name)

    # (a) evicted to disk, read back
    d = daemon(tmp, model, "d", *SMALL).start()
    for enc in (A, B):
        got, cached = complete(d, enc)
        check(got == want[tuple(enc)] and cached == 0, "%s: a new input is encoded: the reference's tokens" % name)
    check(wait_written(d, 1) == 1 and len(files(d)) == 1 and metric(d, "prefix_cache_evictions_total") >= 1,
          "%s: the older cross cache, evicted under --prefix-cache-mem, is written to disk (%s)" % (name, files(d)))
    got, cached = complete(d, A)
    check(cached == len(A) and got == want[tuple(A)] and read(d) == 1,
          "%s: the evicted input again: %d encoder tokens read from disk, the reference's tokens and logprobs bit "
          "for bit" % (name, cached))
    # B, evicted for A, goes to disk too; A came from there and is not written again
    check(wait_written(d, 2) == 2 and len(files(d)) == 2, "%s: the one evicted for it is written" % name)
    got, cached = complete(d, C)
    check(cached == 0 and got == want[tuple(C)], "%s: another input: encoded" % name)
    check(d.stop() == 0 and "1 encoder-cache cross-attention cache(s) written at exit" in d.logtext() and
          len(files(d)) == 3, "%s: SIGTERM writes the cache not on disk yet (C's), only it" % name)

    # (b) a restart reads what the last run encoded
    d.start()
    check("3 encoder-cache cross-attention cache(s) on disk" in d.logtext(), "%s: the restart lists the 3" % name)
    for i, enc in enumerate((C, B)):
        got, cached = complete(d, enc)
        check(cached == len(enc) and got == want[tuple(enc)] and read(d) == i + 1,
              "%s: after the restart, an input encoded before is read from disk: the reference's tokens" % name)
    check(d.stop() == 0, "%s: stops cleanly" % name)
    return tmp, model, want, d


tmp, model, want, d = run("t5", ["--arch", "t5", "--ffn-kind", "gated-gelu", "--tie", "--buckets", "16",
                                 "--max-distance", "12"])
_, bart, _, _ = run("bart", ["--arch", "bart", "--tie"])

# another model on the T5's directory (and writing nothing there at exit)
b = daemon(tmp, bart, "d", "--prefix-exit-seconds", "0").start()
got, cached = complete(b, A)
check(cached == 0 and read(b) == 0 and "left alone" in b.logtext(),
      "a BART on the T5's disk directory: the T5's files are another model's, left alone: A encoded")
check(b.stop() == 0, "the BART stops cleanly")

# (c) damaged files: a miss with a log line, quarantined, the same tokens
d.args = SMALL
d.start()
before = files(d)
complete(d, D)
got, cached = complete(d, A)  # from disk; D, evicted for it, goes there
check(cached == len(A) and wait_written(d, 1) == 1, "t5: A read from disk, D evicted and written")
path = next(f for f in files(d) if f not in before)
with open(path, "r+b") as f:
    f.seek(8192 + 100)  # in the first chunk: after the header's and the meta's 4 KiB pages (tiers/disk.c)
    byte = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([byte[0] ^ 0x5A]))
got, cached = complete(d, D)
check(cached == 0 and got == want[tuple(D)] and read(d) == 1 and "cross-attention cache x" in d.logtext() and
      len(quarantined(d)) == 1,
      "t5: a byte flipped in D's file: a miss, logged and quarantined, D encoded with the same tokens")
complete(d, A)  # D evicted again: written afresh
check(wait_written(d, 2) == 2 and os.path.exists(path), "t5: D evicted again and written afresh")
with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
got, cached = complete(d, D)
check(cached == 0 and got == want[tuple(D)] and read(d) == 2 and len(quarantined(d)) == 2,
      "t5: D's file truncated: a miss, quarantined, the same tokens")
got, cached = complete(d, C)
check(cached == len(C) and got == want[tuple(C)] and d.get("/health")[0] == 200,
      "t5: the daemon serves on: C still read from disk")
check(d.stop() == 0, "t5: stops cleanly")
