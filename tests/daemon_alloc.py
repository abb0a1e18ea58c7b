"""Decoding allocates nothing per token: a shim preloaded into kvtierd and
kvtier-run counts malloc, calloc and realloc calls (tests/alloc_count.c),
and a request with 8 and with 200 new tokens must differ by less than half
an allocation per extra token: kvtier-run, and in kvtierd each of a stream,
a chat reply with log-probabilities, a session's turn, a draw through the
sampling filters and a beam search, each in a daemon of its own.  What may
grow with the length is per KV block of 16 tokens (a block's table entry
and prefix-cache entry, per beam; a buffer that doubles): 0.05-0.35 of an
allocation per token here; one allocation in every token's path gives at
least one per token.  Skipped under the sanitizers, whose allocator the
shim would hide."""
import os
import re
import subprocess
import tempfile

from daemon_harness import BUILD, Daemon, check, make_model, skip

SHORT, LONG = 8, 200
PER_TOKEN = 0.5  # the bound on allocations per extra token

if "asan" in subprocess.run(["ldd", os.path.join(BUILD, "kvtierd")], capture_output=True, text=True).stdout:
    skip("the sanitizers' allocator: the shim cannot count through it")
tmp = tempfile.mkdtemp(prefix="kvtier-alloc.")
shim = os.path.join(tmp, "alloc_count.so")
cc = subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", shim, "tests/alloc_count.c"],
                    capture_output=True, text=True)
check(cc.returncode == 0, "the counting shim compiles: " + cc.stderr[-300:])
model = make_model(tmp)


def counts(text):
    m = re.findall(r"alloc_count: malloc (\d+) calloc (\d+) realloc (\d+)", text)
    if len(m) != 1:
        raise AssertionError("%d count lines at exit, not one: %r" % (len(m), text[-400:]))
    return sum(int(x) for x in m[0])


def stream(d, gen):
    events = d.stream("/v1/completions", dict(gen, prompt="Once upon a time", stream=True,
                                              stream_options={"include_usage": True}))
    check(events[-1] == "[DONE]", "a stream ends with [DONE]")
    return events[-2]["usage"]["completion_tokens"]


def chat(d, gen):
    code, r = d.post("/v1/chat/completions", dict(gen, messages=[{"role": "user", "content": "Hello"}],
                                                  logprobs=True, top_logprobs=3))
    check(code == 200, "a chat reply with log-probabilities (%d)" % code)
    return r["usage"]["completion_tokens"]


def session_turn(d, gen):
    sid = d.post_ok("/v1/sessions", {})["id"]
    code, r = d.post("/v1/completions", dict(gen, prompt="Once upon a time", session=sid))
    check(code == 200, "a session's turn (%d)" % code)
    return r["usage"]["completion_tokens"]


def filtered(d, gen):
    code, r = d.post("/v1/completions", dict(gen, prompt="Once upon a time", temperature=0.9, top_p=0.9,
                                             typical_p=0.95, min_p=0.01, seed=7))
    check(code == 200, "a draw through top_p, min_p and typical_p (%d)" % code)
    return r["usage"]["completion_tokens"]


def beams(d, gen):
    code, r = d.post("/v1/completions", dict(gen, prompt="Once upon a time", num_beams=3))
    check(code == 200, "a beam search of 3 beams (%d)" % code)
    return r["usage"]["completion_tokens"]


def daemon_allocs(request, n):
    """Allocations of a daemon's whole life that serves one request of n new tokens."""
    # no disk tier: at exit it writes every cached prefix block to disk,
    # about a dozen allocations per 16-token block, which is shutdown's
    # work and not decoding's
    d = Daemon("--disk-dir", "none", model=model, tmp=tempfile.mkdtemp(dir=tmp))
    d.start(extra_env={"LD_PRELOAD": shim})
    got = request(d, {"max_tokens": n, "temperature": 0, "ignore_eos": True})
    check(got == n, "%s: %d new tokens" % (request.__name__, got))
    check(d.stop() == 0, "stop")
    return counts(d.logtext())


def run_allocs(n):
    r = subprocess.run([os.path.join(BUILD, "kvtier-run"), "-m", model, "-p", "Once upon a time", "-n", str(n),
                        "--greedy", "--ignore-eos", "--quiet", "--threads", "1"],
                       capture_output=True, text=True, env=dict(os.environ, LD_PRELOAD=shim))
    check(r.returncode == 0, "kvtier-run -n %d: %s" % (n, r.stderr[-300:]))
    return counts(r.stderr)


cases = [("kvtier-run", run_allocs)]
cases += [("kvtierd " + r.__name__, lambda n, r=r: daemon_allocs(r, n)) for r in (stream, chat, session_turn, filtered, beams)]
for name, fn in cases:
    a, b = fn(SHORT), fn(LONG)
    check(b - a < PER_TOKEN * (LONG - SHORT),
          "%s: %d allocations with %d new tokens, %d with %d: %.2f per extra token (below %.1f)" %
          (name, a, SHORT, b, LONG, (b - a) / (LONG - SHORT), PER_TOKEN))
