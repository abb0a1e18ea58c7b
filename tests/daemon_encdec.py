"""kvtierd with encoder-decoder models (T5, BART; tiny random ones from
tools/mkmodel.py): greedy tokens through /v1/completions ("input" the
encoder's ids, "prompt" the decoder's) equal kvtier-encdec's, which
tests/encdec.test.sh checks against tools/torchref.py; offloaded and static
self caches give the same tokens; sampled generation is reproducible by
seed, n > 1 included; usage counts the encoder input; a text input is
tokenized; a session's later generations with the same input, or none,
and after a crop give a fresh request's tokens with the encoder tokens
reported as not recomputed, so do beams on it and a request after them,
another input is encoded afresh; a quantized self cache (T5's read with
its position bias) gives kvtier-encdec's quantized run's tokens; chat,
sliding, sink, shared_prefix, a session's prefix or past recording, and "input" or
beams on a session to a decoder-only model are refused with a 400 naming
why (forks and the disk tier: tests/daemon_encdec_sess.py).  Started
without --device-mem, the daemon's budget is sized from the model, both
caches counted."""
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, "tests")
from daemon_harness import BUILD, Daemon, check, skip  # noqa: E402
sys.path.insert(0, "tools")
import mkmodel  # noqa: E402

ENC = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 264, 33, 83, 279, 50, 288, 41, 97, 169, 39]
N = 8
gen = {"max_tokens": N, "temperature": 0, "ignore_eos": True, "return_tokens": True}
oracle = os.path.join(BUILD, "kvtier-encdec")
if not os.access(oracle, os.X_OK):
    skip(oracle + " not built")


def oracle_tokens(model, dec=None, n=N, strategy="dynamic"):
    cmd = [oracle, "-m", model, "--enc", ",".join(map(str, ENC)), "-n", str(n), "--strategy", strategy]
    if dec:
        cmd += ["--dec", ",".join(map(str, dec))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [int(t) for t in r.stdout.split()[0].split(",")]


def run(name, args, dec):
    d = Daemon(model="made below")
    model = d.model = d.tmp + "/" + name
    mkmodel.main(["--out", model, "--seed", "5", "--layers", "2", "--dim", "64", "--heads", "4", "--ffn", "128",
                  "--vocab", "320", "--max-pos", "128"] + args)
    d.start()

    def complete(**kw):
        code, r = d.post("/v1/completions", dict(gen, **kw))
        assert code == 200, (code, r)
        return r

    def refused(field, want, param=None, **kw):
        code, e = d.post("/v1/completions" if field != "messages" else "/v1/chat/completions", dict(gen, **kw))
        msg = e.get("error", {}).get("message", "")
        check(code == 400 and want in msg and (param is None or e["error"]["param"] == param),
              "%s %s -> 400: %s" % (name, field, msg[:100]))

    toks = lambda r: r["choices"][0]["tokens"]  # noqa: E731
    want = oracle_tokens(model)
    r = complete(input=ENC)
    check(toks(r) == want, "%s: greedy tokens from the decoder start token == kvtier-encdec's %s" % (name, want))
    # without --device-mem the budget is sized from the model: per sequence
    # the self cache of a context's tokens and the cross cache of an input
    # of as many, each every decoder layer's K and V (f32 here)
    with open(model + "/config.json") as f:
        cfg = json.load(f)
    layers = cfg.get("num_decoder_layers", cfg.get("decoder_layers", cfg.get("num_layers")))
    heads = cfg.get("num_heads", cfg.get("decoder_attention_heads"))
    hd = cfg.get("d_kv", cfg["d_model"] // heads)
    m = re.search(r"device budget ([0-9.]+) MiB \(sized from the model: .* KV ([0-9.]+) for (\d+) sequences of "
                  r"(\d+) tokens and inputs of as many", d.logtext())
    kv = m and int(m.group(3)) * 2 * int(m.group(4)) * layers * 2 * heads * hd * 4 / 1048576
    check(m and abs(float(m.group(2)) - kv) < 0.06 and float(m.group(1)) > kv,
          "%s: without --device-mem the device budget is sized from the model (%s)" %
          (name, m and m.group(0)[:150]))
    u = r["usage"]
    check(u["prompt_tokens"] == len(ENC) + 1 and u["completion_tokens"] == N and
          u["prompt_tokens_details"]["encoder_tokens"] == len(ENC),
          "%s: usage counts the encoder input and the decoder's start token (%s)" % (name, u))
    if dec:
        check(toks(complete(input=ENC, prompt=dec)) == oracle_tokens(model, dec),
              "%s: a decoder prompt %s: kvtier-encdec's tokens" % (name, dec))
    for cache in ({"implementation": "offloaded"}, {"implementation": "static", "max_cache_len": 16}):
        check(toks(complete(input=ENC, cache=cache)) == want,
              "%s: %s self cache: the same tokens" % (name, cache["implementation"]))
    s = dict(temperature=0.9, top_k=50, seed=7)
    a, b = complete(input=ENC, n=2, **s), complete(input=ENC, n=2, **s)
    ta = [c["tokens"] for c in a["choices"]]
    check(ta == [c["tokens"] for c in b["choices"]] and all(len(t) == N for t in ta),
          "%s: sampled, n=2: the same tokens for the same seed" % name)
    r = complete(input="hello world")
    check(r["usage"]["prompt_tokens_details"]["encoder_tokens"] > 0 and len(toks(r)) == N,
          "%s: a text input is tokenized (%d tokens)" % (name, r["usage"]["prompt_tokens_details"]["encoder_tokens"]))
    refused("messages", "encoder-decoder", messages=[{"role": "user", "content": "hi"}])
    refused("input", "\"input\"", "input", prompt=[1, 2])
    refused("input", "\"input\"", "input")  # neither input nor prompt: the missing field is input
    # a text input is held to the context once tokenized, as ids are when parsed
    n_ctx = d.get("/v1/models")[1]["data"][0]["meta"]["n_ctx"]
    refused("input", "the context holds %d" % n_ctx, "input", input="in the beginning " * n_ctx)
    refused("sliding", "sliding", input=ENC, cache={"implementation": "sliding_window", "window_length": 8})
    refused("sink", "not rotary", input=ENC, cache={"implementation": "sink", "window_length": 8, "num_sink_tokens": 4})
    refused("shared_prefix", "shares no prefix", input=ENC, prompt=[0, 5], shared_prefix=1)
    # kvtier-encdec's quantized cache (8-bit quanto, groups of 8, a
    # residual of 8): 24 tokens reach past the residual, so the attention
    # reads quantized blocks
    q = {"implementation": "quantized", "backend": "quanto", "nbits": 8, "q_group_size": 8, "residual_length": 8}
    dp = {"prompt": dec} if dec else {}
    check(toks(complete(input=ENC, cache=q, max_tokens=24, **dp)) == oracle_tokens(model, dec, 24, "quantized"),
          "%s: a quantized self cache: kvtier-encdec's quantized tokens" % name)
    # a session keeps the cross-attention cache: later requests with the
    # same input, or none, encode nothing and give a fresh request's tokens
    # (T5 with its decoder prompt: from the start token alone it repeats it)
    want = oracle_tokens(model, dec)
    code, sess = d.post("/v1/sessions", {})
    assert code == 200, (code, sess)
    sid = sess["id"]
    first = complete(input=ENC, session=sid, **dp)
    p = first["usage"]["prompt_tokens_details"]
    check(toks(first) == want and p["encoder_cached_tokens"] == len(ENC),
          "%s: a session's first generation finds its input in the encoder cache, where the requests before "
          "left it (%s)" % (name, p))
    for kw, how in ((dict(input=ENC), "the same input"), ({}, "no input")):
        r = complete(session=sid, **kw, **dp)
        p = r["usage"]["prompt_tokens_details"]
        check(toks(r) == want and p["encoder_cached_tokens"] == len(ENC) == p["encoder_tokens"],
              "%s: the session again with %s: a fresh request's tokens, %d encoder tokens not recomputed" %
              (name, how, p["encoder_cached_tokens"]))
    code, c = d.post("/v1/sessions/%s/crop" % sid, {"n": -3})
    check(code == 200, "%s: crop of the decoder's cache (%s)" % (name, c))
    r = complete(session=sid, **dp)
    check(toks(r) == want and r["usage"]["prompt_tokens_details"]["encoder_cached_tokens"] == len(ENC),
          "%s: after a crop: a fresh request's tokens over the kept encoder output" % name)
    # beams on the session read its cross cache and fork its decoder's,
    # which stays at the prompt (tests/daemon_encdec_beams.py checks the
    # beams themselves against the reference)
    bq = dict(num_beams=3, num_return_sequences=2, **dp)
    r = complete(session=sid, **bq)
    check([c["tokens"] for c in r["choices"]] == [c["tokens"] for c in complete(input=ENC, **bq)["choices"]] and
          r["usage"]["prompt_tokens_details"]["encoder_cached_tokens"] == len(ENC),
          "%s: beams on the session: a fresh request's beams, the input not encoded again" % name)
    check(toks(complete(session=sid, **dp)) == want, "%s: after the beams: a fresh request's tokens" % name)
    other = ENC[::-1]
    r = complete(session=sid, input=other, **dp)
    check(toks(r) == toks(complete(input=other, **dp)) and
          r["usage"]["prompt_tokens_details"]["encoder_cached_tokens"] == 0 and
          r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
          "%s: another input on the session is encoded afresh, the decoder's cache dropped: a fresh request's "
          "tokens" % name)
    code, e = d.post("/v1/sessions/%s/activate_past_recording" % sid, {})
    check(code == 400 and "no past states" in e["error"]["message"],
          "%s: past recording on an encoder-decoder session -> 400" % name)
    code, e = d.post("/v1/sessions", {"prompt": [1, 2]})
    check(code == 400 and "starts empty" in e["error"]["message"], "%s: a session's prefix -> 400" % name)
    code, sess = d.post("/v1/sessions", {})
    code, e = d.post("/v1/completions", dict(gen, session=sess["id"]))
    check(code == 400 and "no encoder input" in e["error"]["message"],
          "%s: an empty session without input -> 400" % name)
    check(d.stop() == 0, "%s: kvtierd stops cleanly" % name)
    d.cleanup()


run("t5", ["--arch", "t5", "--ffn-kind", "gated-gelu", "--tie", "--buckets", "16", "--max-distance", "12"],
    [0, 17, 230, 91, 150])
run("bart", ["--arch", "bart", "--tie"], None)

# a decoder-only model refuses the encoder's field, and beams on a session
d = Daemon().start()
code, e = d.post("/v1/completions", dict(gen, input=[1, 2, 3], prompt=[1, 2]))
msg = e.get("error", {}).get("message", "")
check(code == 400 and "decoder-only" in msg, "a decoder-only model: input -> 400: %s" % msg[:100])
code, sess = d.post("/v1/sessions", {})
code, e = d.post("/v1/completions", dict(gen, prompt=[1, 2], num_beams=2, session=sess.get("id")))
msg = e.get("error", {}).get("message", "")
check(code == 400 and e["error"]["param"] == "session",
      "a decoder-only model: beams on a session -> 400: %s" % msg[:100])
