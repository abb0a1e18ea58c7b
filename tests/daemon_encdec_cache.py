"""kvtierd's encoder cache for encoder-decoder models (T5, BART; tiny random
ones from tools/mkmodel.py): a request outside a session whose input another
request or a session encoded before reads that cross-attention cache instead
of running the encoder (encoder_cached_tokens == the input's length), and
its tokens and log-probabilities are the first request's bit for bit and
kvtier-encdec's tokens; an input one id off at the end, a prefix of it and
one it is a prefix of do not hit (each gives kvtier-encdec's tokens for
itself), nor does a request with use_cache false; a session's cross cache serves a request outside it and the other
way round; an offloaded request reads a cache kept on the device; under a
small --prefix-cache-mem the least recently used cache goes (and
/metrics counts the eviction); --no-prefix-cache turns it off."""
import os
import subprocess
import sys

sys.path.insert(0, "tests")
from daemon_harness import BUILD, Daemon, check, metric, skip  # noqa: E402
sys.path.insert(0, "tools")
import mkmodel  # noqa: E402

ENC = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 264, 33, 83, 279, 50, 288, 41, 97, 169, 39]
N = 8
gen = {"max_tokens": N, "temperature": 0, "ignore_eos": True, "return_tokens": True, "logprobs": 2}
oracle = os.path.join(BUILD, "kvtier-encdec")
if not os.access(oracle, os.X_OK):
    skip(oracle + " not built")


def oracle_tokens(model, enc):
    r = subprocess.run([oracle, "-m", model, "--enc", ",".join(map(str, enc)), "-n", str(N)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    return [int(t) for t in r.stdout.split()[0].split(",")]


toks = lambda r: r["choices"][0]["tokens"]  # noqa: E731
cached = lambda r: r["usage"]["prompt_tokens_details"]["encoder_cached_tokens"]  # noqa: E731


def complete(d, **kw):
    return d.post_ok("/v1/completions", dict(gen, **kw))


def make(name, args):
    d = Daemon(model="made below")
    model = d.model = d.tmp + "/" + name
    mkmodel.main(["--out", model, "--seed", "5", "--layers", "2", "--dim", "64", "--heads", "4", "--ffn", "128",
                  "--vocab", "320", "--max-pos", "128"] + args)
    return d, model


def run(name, args):
    d, model = make(name, args)
    d.start()
    want = oracle_tokens(model, ENC)
    first = complete(d, input=ENC)
    check(toks(first) == want and cached(first) == 0,
          "%s: the first request encodes its input: kvtier-encdec's tokens" % name)
    again = complete(d, input=ENC)
    lp = lambda r: r["choices"][0]["logprobs"]  # noqa: E731
    check(cached(again) == len(ENC) and toks(again) == want and lp(again) == lp(first),
          "%s: the same input again: %d encoder tokens cached, the same tokens and logprobs bit for bit" %
          (name, cached(again)))
    last = ENC[:-1] + [ENC[-1] + 1]
    for enc, what in ((last, "the last id different"), (ENC[:-1], "a prefix of it"),
                      (ENC + [7], "one it is a prefix of")):
        r = complete(d, input=enc)
        check(cached(r) == 0 and toks(r) == oracle_tokens(model, enc),
              "%s: an input with %s: encoded, kvtier-encdec's tokens for it" % (name, what))
    r = complete(d, input=ENC, use_cache=False)
    check(cached(r) == 0 and toks(r) == want, "%s: use_cache false: the input encoded, the same tokens" % name)
    r = complete(d, input=ENC, cache={"implementation": "offloaded"})
    check(cached(r) == len(ENC) and toks(r) == want,
          "%s: an offloaded request reads the kept cache: the same tokens" % name)
    # a session's cross cache serves requests outside it, and theirs the session
    other = ENC[::-1]
    sid = d.post_ok("/v1/sessions", {})["id"]
    s = complete(d, input=other, session=sid)
    r = complete(d, input=other)
    check(cached(s) == 0 and cached(r) == len(other) and toks(r) == toks(s) == oracle_tokens(model, other),
          "%s: a session's input, then a request with it: the session's cross cache, the same tokens" % name)
    sid2 = d.post_ok("/v1/sessions", {})["id"]
    r = complete(d, input=last, session=sid2)
    check(cached(r) == len(last) and toks(r) == oracle_tokens(model, last),
          "%s: a new session given an input a request encoded: not encoded again" % name)
    for s in (sid, sid2):
        d.request("DELETE", "/v1/sessions/" + s)
    r = complete(d, input=other)
    check(cached(r) == len(other), "%s: its session deleted, the cache stays in the encoder cache" % name)
    check(d.stop() == 0, "%s: kvtierd stops cleanly" % name)
    d.cleanup()


def evict(name, args):
    """One cross cache of 20 tokens: 2 layers x 2 blocks of 16 tokens x 4
    heads x 16 x f32, K and V: 32 KiB; a budget of 40000 bytes holds one
    unreferenced."""
    d, model = make(name, args)
    # no disk tier, which would keep the evicted one (daemon_encdec_cache_disk)
    d.args = ["--prefix-cache-mem", "40000", "--disk-dir", "none"]
    d.start()
    a, b = ENC, ENC[::-1]
    for enc in (a, b):
        complete(d, input=enc)
    rb = complete(d, input=b)
    ra = complete(d, input=a)
    check(cached(rb) == len(b) and cached(ra) == 0 and toks(ra) == oracle_tokens(model, a) and
          metric(d, "prefix_cache_evictions_total") >= 1,
          "%s: --prefix-cache-mem 40000: the most recent input hits, the older one was evicted and is encoded "
          "again" % name)
    check(d.stop() == 0, "%s: kvtierd stops cleanly" % name)
    d.cleanup()
    d, model = make(name, args)
    d.args = ["--no-prefix-cache"]
    d.start()
    complete(d, input=a)
    r = complete(d, input=a)
    check(cached(r) == 0 and toks(r) == oracle_tokens(model, a), "%s: --no-prefix-cache: no encoder cache" % name)
    check(d.stop() == 0, "%s: kvtierd stops cleanly" % name)
    d.cleanup()


T5 = ["--arch", "t5", "--ffn-kind", "gated-gelu", "--tie", "--buckets", "16", "--max-distance", "12"]
run("t5", T5)
run("bart", ["--arch", "bart", "--tie"])
evict("t5", T5)
