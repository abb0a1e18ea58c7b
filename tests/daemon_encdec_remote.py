"""The encoder cache on the remote tier: an encoder-decoder model's
cross-attention caches shared through Redis (the test runs its own
redis-server on a Unix socket and kills only it).  Daemon A encodes an
input and publishes its cross cache; daemon B (same model, same Redis)
given the same input reads it from there instead of running the encoder:
encoder_cached_tokens the input's length, A's tokens and log-probabilities
bit for bit (and kvtier-encdec's tokens).  An input one id off misses.  A
value moved under another input's key (what a hash collision would give)
is refused by the ids it holds: a miss, the right tokens.  A corrupted
value is a miss.  A daemon with --remote-share off publishes nothing."""
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, "tests")
from daemon_harness import BUILD, Daemon, check, resp, skip  # noqa: E402
sys.path.insert(0, "tools")
import mkmodel  # noqa: E402

REDIS = shutil.which("redis-server")
if not REDIS:
    skip("redis-server not installed (tools/deps.sh test)")
oracle = os.path.join(BUILD, "kvtier-encdec")
if not os.access(oracle, os.X_OK):
    skip(oracle + " not built")

ENC = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 264, 33, 83, 279, 50, 288, 41, 97, 169, 39]
N = 8
gen = {"max_tokens": N, "temperature": 0, "ignore_eos": True, "return_tokens": True, "logprobs": 2}


def oracle_tokens(model, enc):
    r = subprocess.run([oracle, "-m", model, "--enc", ",".join(map(str, enc)), "-n", str(N)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    return [int(t) for t in r.stdout.split()[0].split(",")]


def metric(dm, name, labels=""):
    for line in dm.get("/metrics")[1].decode().splitlines():
        if line.startswith("kvtier_" + name + labels + " "):
            return float(line.split()[1])
    return 0.0


def xkeys(sock):
    return sorted(k for k in resp(sock, "KEYS", "kvt:*") if b":x" in k)


def wait_keys(sock, n, timeout=10):
    end = time.time() + timeout
    while len(xkeys(sock)) < n and time.time() < end:
        time.sleep(0.05)
    return xkeys(sock)


first = Daemon(model="made below")
tmp = first.tmp
model = os.path.join(tmp, "t5")
mkmodel.main(["--out", model, "--seed", "5", "--layers", "2", "--dim", "64", "--heads", "4", "--ffn", "128",
              "--vocab", "320", "--max-pos", "128", "--arch", "t5", "--ffn-kind", "gated-gelu", "--tie",
              "--buckets", "16", "--max-distance", "12"])
rdir = os.path.join(tmp, "redis")
os.makedirs(rdir)
rsock = os.path.join(rdir, "redis.sock")
rp = subprocess.Popen([REDIS, "--port", "0", "--unixsocket", rsock, "--save", "", "--appendonly", "no", "--dir", rdir],
                      stdout=open(os.path.join(rdir, "log"), "ab"), stderr=subprocess.STDOUT)
deadline = time.time() + 30
while True:
    try:
        resp(rsock, "PING")
        break
    except OSError:
        if time.time() > deadline or rp.poll() is not None:
            raise AssertionError("redis-server did not start: " + open(os.path.join(rdir, "log")).read()[-500:])
        time.sleep(0.02)


def daemon(name, *args):
    d = Daemon("--disk-dir", "none", "--remote", "unix:" + rsock, "--remote-timeout", "300", *args, model=model,
               tmp=tmp)
    d.sock = os.path.join(tmp, name + ".sock")
    d.log = os.path.join(tmp, name + ".log")
    return d.start()


def complete(dm, **kw):
    return dm.post_ok("/v1/completions", dict(gen, **kw))


toks = lambda r: r["choices"][0]["tokens"]  # noqa: E731
cached = lambda r: r["usage"]["prompt_tokens_details"]["encoder_cached_tokens"]  # noqa: E731
lp = lambda r: r["choices"][0]["logprobs"]  # noqa: E731
try:
    a, b = daemon("a"), daemon("b")
    want = oracle_tokens(model, ENC)
    ra = complete(a, input=ENC)
    keys = wait_keys(rsock, 1)
    check(toks(ra) == want and cached(ra) == 0 and len(keys) == 1,
          "daemon A encodes the input (kvtier-encdec's tokens) and publishes its cross cache (%s)" % keys)
    rb = complete(b, input=ENC)
    check(cached(rb) == len(ENC) and toks(rb) == want and lp(rb) == lp(ra),
          "daemon B: %d encoder tokens from the remote tier, A's tokens and logprobs bit for bit" % cached(rb))
    check(metric(b, "remote_hits_total") == 1, "B's /metrics count the remote hit")
    rb = complete(b, input=ENC)
    check(cached(rb) == len(ENC) and metric(b, "remote_lookups_total") == 1,
          "B again: from its own encoder cache, no second lookup")
    last = ENC[:-1] + [ENC[-1] + 1]
    r = complete(b, input=last)
    check(cached(r) == 0 and toks(r) == oracle_tokens(model, last), "an input one id off: a miss, encoded")
    # B published `last`: swap the two values, as a collision of the keys' hash would pair them
    keys = wait_keys(rsock, 2)
    vals = [resp(rsock, "GET", k) for k in keys]
    resp(rsock, "SET", keys[0], vals[1])
    resp(rsock, "SET", keys[1], vals[0])
    c = daemon("c")
    for enc in (ENC, last):
        r = complete(c, input=enc)
        check(cached(r) == 0 and toks(r) == oracle_tokens(model, enc),
              "daemon C: a value of another input under this input's key is refused by its ids: encoded, the "
              "right tokens")
    check(c.stop() == 0, "daemon C stops cleanly")
    for k in keys:
        resp(rsock, "SET", k, b"not a value")
    c = daemon("c2")
    r = complete(c, input=ENC)
    check(cached(r) == 0 and toks(r) == want and metric(c, "remote_errors_total", '{kind="corrupt"}') >= 1,
          "a corrupted value: a counted miss, encoded")
    # C2 publishes the input it encoded on its own thread: let that land before the flush, or it would be
    # counted against the daemon below
    end = time.time() + 10
    while metric(c, "remote_blocks_total", '{result="published"}') < 1 and time.time() < end:
        time.sleep(0.05)
    resp(rsock, "FLUSHALL")
    o = daemon("o", "--remote-share", "off")
    complete(o, input=ENC)
    time.sleep(0.3)
    check(not xkeys(rsock), "--remote-share off publishes no cross cache")
    for name, dm in (("A", a), ("B", b), ("C2", c), ("O", o)):
        check(dm.stop() == 0, "daemon %s stops cleanly" % name)
finally:
    rp.kill()
    rp.wait()
