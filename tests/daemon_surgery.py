"""kvtierd cache surgery: POST /v1/sessions/{id}/crop with HF's
crop(n) semantics, crop-then-regenerate equal to never having generated,
the partial rewind of a session whose input diverges (only the suffix after
the common prefix is computed, the whole input re-sent included),
copy-on-write forks (generating from a fork == a fresh prefill), past
recording on a sliding model (409 with the reference's explanation without
it), and the automatic prefix cache (usage.cached_tokens for requests that
share a prefix)."""
import os
import subprocess
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, skip  # noqa: E402

d = Daemon()
d.start()
prompt = [(i * 53 + 7) % 1900 + 50 for i in range(100)]
gen = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True}


def complete(ids, **kw):
    return d.post_ok("/v1/completions", dict(gen, prompt=ids, **kw))


def session(**body):
    return d.post_ok("/v1/sessions", body)


def crop(sid, n):
    return d.post("/v1/sessions/%s/crop" % sid, {"n": n})


def tokens_of(sid):
    return d.get("/v1/sessions/" + sid)[1]["tokens"]


# ---- automatic prefix cache -------------------------------------------------
cold = complete(prompt, cache=None)
warm = complete(prompt[:96] + [11, 12, 13])
check(cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "prefix cache: the first request computes all")
check(warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 96,
      "prefix cache: a request sharing 96 tokens reuses 6 blocks (cached_tokens %d)" %
      warm["usage"]["prompt_tokens_details"]["cached_tokens"])
fresh = Daemon("--no-prefix-cache", model=d.model, tmp=d.tmp)
fresh.sock = os.path.join(d.tmp, "fresh.sock")
fresh.start()
code, want = fresh.post("/v1/completions", dict(gen, prompt=prompt[:96] + [11, 12, 13]))
check(want["choices"][0]["tokens"] == warm["choices"][0]["tokens"] and
      want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
      "prefix cache: the same tokens as computing everything (--no-prefix-cache)")
fresh.stop()
check("MiB of unreferenced blocks (--prefix-cache-mem), one namespace per uid" in d.logtext(),
      "the prefix cache's budget and namespaces are logged at start")
tight = Daemon("--prefix-cache-mem", "1k", model=d.model, tmp=d.tmp)
tight.sock = os.path.join(d.tmp, "tight.sock")
tight.start()
tight.post("/v1/completions", dict(gen, prompt=prompt))
code, r = tight.post("/v1/completions", dict(gen, prompt=prompt[:96] + [11, 12, 13]))
check(code == 200 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
      "--prefix-cache-mem 1k: no finished request's blocks are kept")
tight.stop()
metrics = d.get("/metrics")[1].decode()
check("kvtier_prefix_cache_hit_tokens_total 96" in metrics, "/metrics: prefix cache hits")

# ---- crop -------------------------------------------------------------------
s = session(prompt=prompt[:40])
sid = s["id"]
r1 = complete(prompt[:40], session=sid)
held = tokens_of(sid)
check(held == 47, "session holds 40 + 8 - 1 tokens")
code, c = crop(sid, -7)
check(code == 200 and c["tokens"] == 40 and tokens_of(sid) == 40, "crop -7: 40 tokens left")
r2 = complete(prompt[:40], session=sid)
check(r2["choices"][0]["tokens"] == r1["choices"][0]["tokens"] and
      r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 39,
      "crop then regenerate == the first generation (39 tokens reused)")
code, c = crop(sid, 0)
check(code == 200 and c["tokens"] == 47, "crop 0 is a no-op on full attention")
code, c = crop(sid, -1000)
check(code == 200 and c["tokens"] == 0, "cropping more than exists empties the session")
for bad in ({"n": "3"}, {"n": 1.5}, {}, {"n": -1, "x": 1}):
    code, e = d.post("/v1/sessions/%s/crop" % sid, bad)
    check(code == 400, "crop %s -> 400 (%s)" % (bad, e["error"]["message"][:60]))
check(crop("sess-nope", -1)[0] == 404, "crop of an unknown session -> 404")
# an empty session has no ids and no KV: its fork copies nothing (it
# passed NULL to memcpy, which the sanitizer build aborts on)
empty = session()["id"]
code, f = d.post("/v1/sessions/%s/fork" % empty, {})
check(code == 200 and f["tokens"] == 0, "fork of an empty session -> an empty session")
check(complete(prompt[:20], session=f["id"])["usage"]["prompt_tokens"] == 20, "the empty fork serves a request")
# -n of INT64_MIN overflowed in the store (a crash); every |n| past the
# store's bound is a 400 naming n, and the session is unchanged
full = session(prompt=prompt[:40])["id"]
for n in (-2**63, -2**63 + 1, 2**63 - 1, -2**40 - 1, 2**40 + 1):
    code, e = crop(full, n)
    check(code == 400 and e["error"]["param"] == "n" and tokens_of(full) == 40,
          "crop %d -> 400 naming n, session unchanged" % n)
code, c = crop(full, -2**40)
check(code == 200 and c["tokens"] == 0, "crop -2^40 (the bound) empties the session")

# ---- partial rewind on a diverging input ---------------------------------------
s = session()
sid = s["id"]
complete(prompt[:60], session=sid)  # holds 67
r = complete(prompt[:50] + [9, 9, 9], session=sid)
check(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 50,
      "an input diverging at token 50 recomputes only from there (cached_tokens %d)" %
      r["usage"]["prompt_tokens_details"]["cached_tokens"])
want = complete(prompt[:50] + [9, 9, 9], cache={"implementation": "static", "max_cache_len": 64})
check(r["choices"][0]["tokens"] == want["choices"][0]["tokens"], "the rewound session generates a fresh run's tokens")
held = tokens_of(sid)
ids_held = prompt[:50] + [9, 9, 9] + r["choices"][0]["tokens"][:7]
r = complete(ids_held, session=sid)
check(r["usage"]["prompt_tokens_details"]["cached_tokens"] == held - 1 and tokens_of(sid) == held - 1 + 8,
      "re-sending exactly the cached tokens recomputes only the last one")

# ---- forks --------------------------------------------------------------------
s = session(prompt=prompt)
sid = s["id"]
code, f = d.post("/v1/sessions/%s/fork" % sid, {})
check(code == 200 and f["id"] != sid and f["tokens"] == 100, "fork: a new session holding the parent's 100 tokens")
code, f2 = d.post("/v1/sessions/%s/fork" % sid, None)
check(f2["bytes"]["device"] > 0, "fork: bytes reported per tier")
cont = prompt + [21, 22]
a = complete(cont, session=f["id"])
b = complete(cont)
check(a["choices"][0]["tokens"] == b["choices"][0]["tokens"] and
      a["usage"]["prompt_tokens_details"]["cached_tokens"] == 100,
      "generating from a fork == a fresh prefill of the same text")
c = complete(prompt + [23], session=sid)
check(c["usage"]["prompt_tokens_details"]["cached_tokens"] == 100 and tokens_of(f2["id"]) == 100,
      "the parent and the other fork are untouched by the first fork's writes")
code, e = d.post("/v1/sessions/%s/fork" % sid, {"deep": True})
check(code == 400, "fork takes no fields")
for x in (f["id"], f2["id"], sid):
    d.request("DELETE", "/v1/sessions/" + x)
d.stop()

# ---- past recording on a sliding-window model -----------------------------------
model = os.path.join(d.tmp, "mistral")
r = subprocess.run(["/usr/bin/python3", "tools/mkmodel.py", "--arch", "mistral", "--preset", "tiny", "--window", "16",
                    "--vocab", "2048", "--tokenizer-from", "model/builtin", "--out", model], capture_output=True, text=True)
if r.returncode:
    skip("mkmodel mistral failed: " + r.stderr[-300:])
m = Daemon(model=model, tmp=d.tmp)
m.sock = os.path.join(d.tmp, "mistral.sock")
m.start()
llama = d
d = m
s = session(prompt=prompt[:40])
code, e = crop(s["id"], -3)
check(code == 409 and "activate_past_recording" in e["error"]["message"],
      "sliding model without recording: crop -> 409 with the reference's explanation")
check(tokens_of(s["id"]) == 40, "the refused crop changed nothing")
r = complete(prompt[:30] + [5, 5], session=s["id"])
check(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
      "a diverging input on a sliding session without recording starts over")
s = session(prompt=prompt[:40], activate_past_recording=True)
check(s["past_recording"], "activate_past_recording at creation")
r1 = complete(prompt[:40], session=s["id"])
code, c = crop(s["id"], -7)
check(code == 200 and c["tokens"] == 40, "with recording, crop works on a sliding model")
r2 = complete(prompt[:40], session=s["id"])
check(r2["choices"][0]["tokens"] == r1["choices"][0]["tokens"], "with recording, crop then regenerate is identical")
# the rewinds of the session's own requests keep what recording kept: a
# turn re-sending exactly what it holds (a rewind of one token, to
# recompute the last), then one departing at token 20, which the window of
# 16 dropped without recording
s = session(prompt=prompt[:40], activate_past_recording=True)
complete(prompt[:40], session=s["id"])
r = complete(prompt[:20] + [5, 5], session=s["id"])
check(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 20,
      "with recording, a turn rewinds past a re-sent turn's own rewind (cached_tokens %d)" %
      r["usage"]["prompt_tokens_details"]["cached_tokens"])
s2 = session()
code, x = d.post("/v1/sessions/%s/activate_past_recording" % s2["id"], {})
check(code == 200 and x["past_recording"], "POST /v1/sessions/{id}/activate_past_recording")

# ---- sliding_window: any model slides; the same weights as a Mistral sliding by 16 -------
long_gen = dict(gen, max_tokens=40)
code, want = d.post("/v1/completions", dict(long_gen, prompt=prompt[:30]))
code, r = d.post("/v1/completions", dict(long_gen, prompt=prompt[:30], cache={"implementation": "sliding_window"}))
check(code == 200 and r["choices"][0]["tokens"] == want["choices"][0]["tokens"],
      "sliding_window without window_length takes the model's window")
code, e = d.post("/v1/completions", dict(long_gen, prompt=prompt[:30], cache={"implementation": "sink"}))
check(code == 400 and "sink" in e["error"]["message"], "sink on a model with sliding layers -> 400: " +
      e["error"]["message"])
d.stop()
d = llama
d.start()
code, full = d.post("/v1/completions", dict(long_gen, prompt=prompt[:30]))
check(full["choices"][0]["tokens"] != want["choices"][0]["tokens"], "a full-attention run differs from a sliding one")
for cache in ({"implementation": "sliding_window", "window_length": 16},
              {"implementation": "offloaded", "window_length": 16},
              {"implementation": "static", "max_cache_len": 70, "window_length": 16}):
    code, r = d.post("/v1/completions", dict(long_gen, prompt=prompt[:30], cache=cache))
    check(code == 200 and r["choices"][0]["tokens"] == want["choices"][0]["tokens"] and
          sum(r["kvtier"]["bytes"].values()) < sum(full["kvtier"]["bytes"].values()),
          "%s: a Llama sliding by 16 == the Mistral, in less KV (%s)" % (cache, r["kvtier"]["bytes"]))
code, e = d.post("/v1/completions", dict(long_gen, prompt=prompt[:30], cache={"implementation": "sliding_window"}))
check(code == 400 and e["error"]["param"] == "cache.window_length", "sliding_window on a model without one -> 400")

# ---- sink: bounded KV however long the generation ---------------------------------------
sink = {"implementation": "sink", "window_length": 64, "num_sink_tokens": 4}
code, short = d.post("/v1/completions", dict(gen, max_tokens=100, prompt=prompt[:30], cache=sink))
code, long_ = d.post("/v1/completions", dict(gen, max_tokens=600, prompt=prompt[:30], cache=sink))
code, dyn = d.post("/v1/completions", dict(gen, max_tokens=600, prompt=prompt[:30]))
check(code == 200 and len(long_["choices"][0]["tokens"]) == 600 and
      long_["kvtier"]["bytes"] == short["kvtier"]["bytes"] and
      long_["kvtier"]["bytes"]["device"] * 4 < dyn["kvtier"]["bytes"]["device"],
      "sink: the same KV bytes after 100 and 600 tokens (%s), a fraction of dynamic's (%s)" %
      (long_["kvtier"]["bytes"]["device"], dyn["kvtier"]["bytes"]["device"]))
check(long_["choices"][0]["tokens"][:30] == dyn["choices"][0]["tokens"][:30],
      "sink: identical to dynamic while everything fits the window")
code, e = d.post("/v1/sessions", {"prompt": prompt[:10], "cache": sink, "activate_past_recording": True})
check(code == 400 and "sink" in e["error"]["message"], "sink + past recording -> 400: " + e["error"]["message"])
code, e = d.post("/v1/completions", dict(gen, prompt=prompt[:30], cache=dict(sink, num_sink_tokens=64)))
check(code == 400 and e["error"]["param"] == "cache.num_sink_tokens", "num_sink_tokens >= window_length -> 400: " +
      e["error"]["message"])
check(long_["kvtier"]["strategy"] == "sink" and long_["kvtier"]["requested_strategy"] == "sink",
      "a sink request reports strategy \"sink\"")
code, sess = d.post("/v1/sessions", {"prompt": prompt[:10], "cache": sink})
check(code == 200 and sess["strategy"] == "sink", "a sink session reports strategy \"sink\"")
# an empty session is refused what its first request could not do, not
# accepted and then unusable
code, e = d.post("/v1/sessions", {"cache": sink, "activate_past_recording": True})
check(code == 400 and e["error"]["param"] == "activate_past_recording" and "sink" in e["error"]["message"],
      "an empty sink session with past recording -> 400 at creation: " + str(e))
code, q = d.post("/v1/sessions", {"cache": {"implementation": "quantized"}})
code2, e = d.post("/v1/sessions/%s/activate_past_recording" % q["id"], {})
code3, r = d.post("/v1/completions", dict(gen, prompt=prompt[:10], session=q["id"]))
check(code == 200 and code2 == 400 and e["error"]["param"] == "cache" and "quantized" in e["error"]["message"] and
      code3 == 200, "past recording on an empty quantized session -> 400 naming cache; the session still serves")

# ---- what the docs promise about lengths and use_cache ----------------------------------
d.stop()
small = Daemon("--ctx-size", "128", model=d.model, tmp=d.tmp)
small.sock = os.path.join(d.tmp, "small.sock")
small.start()
code, r = small.post("/v1/completions", dict(gen, max_tokens=300, prompt=prompt[:10], cache=sink))
check(code == 200 and len(r["choices"][0]["tokens"]) == 300,
      "sink: 10 + 300 tokens on a 128-token context (positions stay in the window)")
code, e = small.post("/v1/completions", dict(gen, max_tokens=300, prompt=prompt[:10]))
check(code == 400 and e["error"]["param"] == "max_tokens", "dynamic: max_tokens past the context -> 400")
# a session's sink cache goes past the context as a request's does; a
# dense session's max_tokens is held to it
code, ss = small.post("/v1/sessions", {"cache": sink})
code2, r = small.post("/v1/completions", dict(gen, max_tokens=300, prompt=prompt[:10], session=ss["id"]))
check(code == 200 and code2 == 200 and len(r["choices"][0]["tokens"]) == 300,
      "a sink session: 10 + 300 tokens on a 128-token context (%d %s)" % (code2, r if code2 != 200 else ""))
code, r = small.post("/v1/completions", dict(gen, max_tokens=110, prompt=prompt[:10], session=ss["id"]))
check(code == 200 and len(r["choices"][0]["tokens"]) == 110,
      "a sink session: prompt + max_tokens past the context again (%d)" % code)
code, ds = small.post("/v1/sessions", {})
code2, e = small.post("/v1/completions", dict(gen, max_tokens=300, prompt=prompt[:10], session=ds["id"]))
check(code == 200 and code2 == 400 and e["error"]["param"] == "max_tokens" and "sink" in e["error"]["message"],
      "a dynamic session: max_tokens past the context -> 400 naming max_tokens")
for impl in ({"implementation": "quantized"}, sink):
    code, e = small.post("/v1/completions", dict(gen, prompt=prompt[:10], cache=impl, use_cache=False))
    check(code == 400 and e["error"]["param"] == "use_cache",
          "use_cache false + %s -> 400 naming use_cache" % impl["implementation"])
static = {"implementation": "static", "max_cache_len": 20}
code, r = small.post("/v1/completions", dict(gen, max_tokens=11, prompt=prompt[:10], cache=static))
check(code == 200 and len(r["choices"][0]["tokens"]) == 11, "static: 10 + 11 - 1 tokens fill max_cache_len 20")
generated = small.get("/metrics")[1].decode().split("kvtier_generation_tokens_total ")[1].split()[0]
code, e = small.post("/v1/completions", dict(gen, max_tokens=12, prompt=prompt[:10], cache=static))
check(code == 400 and e["error"]["param"] == "cache.max_cache_len" and
      small.get("/metrics")[1].decode().split("kvtier_generation_tokens_total ")[1].split()[0] == generated,
      "static: 10 + 12 - 1 tokens over max_cache_len 20 -> 400 before any token")
# a static session: the same refusal, before its KV is cropped to the new
# prompt's common prefix (a failed request leaves the session as it was)
code, s = small.post("/v1/sessions", {"prompt": prompt[:9], "cache": static})
sid = s["id"]
code2, r = small.post("/v1/completions", dict(gen, max_tokens=5, prompt=prompt[:15], session=sid))
before = small.get("/v1/sessions/" + sid)[1]["tokens"]
code3, e = small.post("/v1/completions", dict(gen, max_tokens=5, prompt=prompt[:8] + prompt[40:58], session=sid))
after = small.get("/v1/sessions/" + sid)[1]["tokens"]
check((code, code2, code3) == (200, 200, 400) and e["error"]["param"] == "cache.max_cache_len" and before == after,
      "static session: 26 + 5 - 1 tokens over max_cache_len 20 -> 400, the session untouched (%s tokens)" % after)
code, e = small.post("/v1/completions", dict(gen, max_tokens=5, prompt=prompt[:8] + prompt[40:58], session=sid,
                                            stream=True))
check(code == 400 and e["error"]["param"] == "cache.max_cache_len",
      "the same, streamed: a 400 before the stream starts, not a 200 carrying an error event")
# chat's default length is the rest of the context, or of a static cache
code, s = small.post("/v1/sessions", {"cache": {"implementation": "static", "max_cache_len": 40}})
code2, r = small.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "session": s["id"],
                                               "temperature": 0, "ignore_eos": True})
u = r.get("usage", {})
check(code2 == 200 and u["prompt_tokens"] + u["completion_tokens"] - 1 == 40,
      "chat on a static session without max_tokens: generates to max_cache_len (%s)" % u)
d = small
check(d.stop() == 0, "stop")
