"""kvtierd input ranges: every numeric field of every endpoint gets the
edge values (its minimum and maximum, 0, -1, +-2^53, +-2^63, 2^64, tiny and
huge floats, NaN and Infinity as JSON extensions and as strings, floats for
integers, huge strings, arrays nested 10,000 deep).  Each answer must be 200
or a 400 naming the field (a body jansson itself refuses names no field:
its message gives the column), never 5xx, and the daemon must still serve
afterwards (docs/reliability.md "Input ranges").  A model whose logits
overflow gets a 500 naming them, not sampled tokens."""
import json
import os
import shutil
import struct
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check  # noqa: E402

d = Daemon()
d.start()
meta = d.get("/v1/models")[1]["data"][0]["meta"]
CTX, VOCAB = meta["n_ctx"], meta["n_vocab"]

INTS = [0, -1, 1, 2**31 - 1, 2**31, -2**31 - 1, 2**53, -2**53, 2**63 - 1, -2**63]
FLOATS = [0.0, -0.0, -1.0, 1e-300, 5e-324, 1e-45, 1e-38, 0.99999999999999999, 1.0000001, 2.0000001, 1e300,
          -1e300, 0.5, 1.5]
ODD = ["NaN", "Infinity", "-Infinity", "1", None, True, [], {}, [1], "x" * 100000]
# written into the body as text: jansson refuses them (no NaN or Infinity
# in JSON, integers past int64) or limits them (nesting)
RAW = ["NaN", "Infinity", "-Infinity", "9223372036854775808", "18446744073709551616", "-9223372036854775809",
       "1e999", "[" * 10000 + "]" * 10000]

failures = []
count = 0


def send(path, body_text, field):
    global count
    count += 1
    code, r = d.post(path, body_text)
    if code == 200:
        return
    param = r.get("error", {}).get("param") if isinstance(r, dict) else None
    jansson = isinstance(r, dict) and r.get("error", {}).get("message", "").startswith("invalid JSON body")
    if code == 400 and (param == field or (jansson and not param)):
        return
    # a cache parameter that breaks a rule between two (num_sink_tokens <
    # window_length) may be answered naming the other one
    msg = r.get("error", {}).get("message", "") if isinstance(r, dict) else ""
    if code == 400 and field.startswith("cache.") and param and param.startswith("cache.") and \
            field[6:] in msg and param[6:] in msg:
        return
    if code == 413 and len(body_text) > 4 << 20:
        return
    failures.append("%s %s=%s -> %d %s" % (path, field, body_text[-80:], code, str(r)[-160:]))


def probe(path, base, field, values, raw=True):
    """Sends base with field set to each value (a dotted field sets a key of
    the nested object, e.g. cache.max_cache_len)."""
    outer, _, inner = field.partition(".")
    for v in values:
        body = json.loads(json.dumps(base))
        if inner:
            body.setdefault(outer, {})[inner] = v
        else:
            body[outer] = v
        send(path, json.dumps(body), field)
    if not raw:
        return
    for text in RAW:
        body = json.loads(json.dumps(base))
        if inner:
            body.setdefault(outer, {})[inner] = "@RAW@"
        else:
            body[outer] = "@RAW@"
        send(path, json.dumps(body).replace('"@RAW@"', text), field)


def edges(lo, hi):
    return [lo, hi, lo - 1, hi + 1]


# ---- completions and chat ---------------------------------------------------
compl = {"prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0}
chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
gen_fields = {
    "max_tokens": edges(1, CTX - 3),
    "temperature": [2.0, 1e-30],
    "top_p": [1.0, 1e-300, 1e-46],
    "min_p": [1.0, 1e-300],
    "repetition_penalty": [0.01, 10.0, 0.0099999, 10.000001],
    "top_k": edges(-1, VOCAB),
    "seed": [2**64 - 1],
    "n": edges(1, 8),
}
for path, base in (("/v1/completions", compl), ("/v1/chat/completions", chat)):
    for field, extra in gen_fields.items():
        probe(path, base, field, INTS + FLOATS + ODD + extra)
probe("/v1/completions", compl, "logprobs", INTS + FLOATS + ODD + edges(0, 20))
probe("/v1/chat/completions", dict(chat, logprobs=True), "top_logprobs", INTS + FLOATS + ODD + edges(0, 20))
probe("/v1/chat/completions", chat, "max_completion_tokens", INTS + FLOATS + ODD + edges(1, CTX - 16))
probe("/v1/completions", compl, "prompt", [[v] for v in INTS + FLOATS + [VOCAB, VOCAB - 1]] +
      [[[5]], [], "", "x" * 100000, [5] * (CTX + 1)])
probe("/v1/completions", compl, "stop", ["", "x" * 257, ["x"] * 17, [5], 5, 5.5])

# ---- cache objects ----------------------------------------------------------
caches = {
    "dynamic": ["max_cache_len", "window_length"],
    "static": ["max_cache_len", "window_length"],
    "offloaded_static": ["max_cache_len"],
    "sink": ["window_length", "num_sink_tokens"],
    "quantized": ["nbits", "axis_key", "axis_value", "q_group_size", "residual_length", "num_sink_tokens",
                  "window_length"],
}
for impl, keys in caches.items():
    base = dict(compl, cache={"implementation": impl, "max_cache_len": 64} if "static" in impl else
                {"implementation": impl})
    for k in keys:
        probe("/v1/completions", base, "cache." + k, INTS + [1.0, 1.5, "1", None, [], CTX, CTX + 1, 16, 17],
              raw=k == "max_cache_len")

# ---- sessions, tokenize, detokenize -----------------------------------------
probe("/v1/sessions", {}, "prompt", [[v] for v in INTS + [1.5, VOCAB]] + [[5] * CTX])
probe("/v1/sessions", {}, "cache.max_cache_len", INTS + FLOATS[:3], raw=False)
sid = d.post("/v1/sessions", {"prompt": [5, 6, 7, 8]})[1]["id"]
probe("/v1/sessions/%s/crop" % sid, {}, "n", INTS + FLOATS + ODD + [2**40, -2**40, 2**40 + 1])
probe("/v1/sessions/%s/fork" % sid, {}, "n", [0, 1])  # fork takes no fields: 400 naming the stray one
probe("/detokenize", {}, "tokens", [[v] for v in INTS + FLOATS + [VOCAB]] + [[[1]], [], "x"])
probe("/tokenize", {}, "content", [5, 5.5, None, "x" * 100000, "\u00e9" * 1000])
probe("/tokenize", {"content": "hi"}, "add_special", [0, 1, "true", None])

check(not failures, "%d edge values: every answer is 200 or a 400 naming the field%s" %
      (count, "" if not failures else "; failures:\n" + "\n".join(failures[:40])))

# max_tokens and its alias: one length, so two different ones are a 400
code, e = d.post("/v1/chat/completions", dict(chat, max_tokens=3, max_completion_tokens=600))
check(code == 400 and e["error"]["param"] == "max_completion_tokens" and "disagree" in e["error"]["message"],
      "max_tokens 3 with max_completion_tokens 600 -> 400 naming max_completion_tokens")
code, r = d.post("/v1/chat/completions", dict(chat, max_tokens=2, max_completion_tokens=2))
check(code == 200 and r["usage"]["completion_tokens"] <= 2, "the two with one value: served")

# ---- still serving ----------------------------------------------------------
check(d.proc.poll() is None, "kvtierd is still running")
code, r = d.post("/v1/completions", dict(compl, max_tokens=4))
check(code == 200 and r["usage"]["completion_tokens"] == 4, "kvtierd still serves a completion")
check(d.get("/health")[0] == 200, "/health is 200")

# ---- a model whose logits overflow: 500 saying why, never sampled ----------
# the final norm's weights set to 3e38 (finite, so the load takes them):
# every logit is then infinite or NaN, which no sampler can draw from
d.stop()
bad = os.path.join(d.tmp, "overflow")
shutil.copytree(d.model, bad)
with open(os.path.join(bad, "model.safetensors"), "r+b") as f:
    hlen = struct.unpack("<Q", f.read(8))[0]
    head = json.loads(f.read(hlen))
    t = head["model.norm.weight"]
    assert t["dtype"] == "F32", t
    lo, hi = t["data_offsets"]
    f.seek(8 + hlen + lo)
    f.write(struct.pack("<f", 3e38) * ((hi - lo) // 4))
o = Daemon(model=bad, tmp=d.tmp)
o.sock = os.path.join(d.tmp, "overflow.sock")
o.start()
for body in (dict(compl, max_tokens=4), dict(compl, max_tokens=4, num_beams=2)):
    code, e = o.post("/v1/completions", body)
    check(code == 500 and "logits are not finite" in e["error"]["message"],
          "logits that overflow (%s): 500 naming them, not tokens: %s" %
          ("beams" if "num_beams" in body else "sampled", e.get("error", {}).get("message", e)))
check(o.get("/health")[0] == 200 and o.stop() == 0, "the daemon serves on and stops cleanly")

# ---- a tokenizer with ids past the model's embedding rows ------------------
# the built-in tokenizer's ids run to 2047 (<|im_start|> 2046, <|im_end|> 2047)
import subprocess  # noqa: E402
from daemon_harness import KVTIERD, PYTHON  # noqa: E402


def rows(out, n):
    """A one-layer llama with n embedding rows and the built-in tokenizer
    (copied in: mkmodel refuses a tokenizer past its vocabulary)."""
    subprocess.run([PYTHON, "tools/mkmodel.py", "--arch", "llama", "--layers", "1", "--dim", "32", "--vocab", str(n),
                    "--out", out], check=True, capture_output=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy("model/builtin/" + f, out)
    return out


short = Daemon("--disk-dir", "none")
short.model = rows(short.tmp + "/short", 2046)
short.start()
code, e = short.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
check(code == 400 and e["error"]["param"] == "messages" and "2046" in e["error"]["message"],
      "a chat template's <|im_start|> has no embedding row: 400 naming the messages: %s" % e.get("error", e))
code, t = short.post("/tokenize", {"content": "<|im_start|>"})
check(code == 200 and [x if isinstance(x, int) else x["id"] for x in t["tokens"]] == [2046],
      "/tokenize still gives the tokenizer's ids: %s" % t)
r = short.post_ok("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "ignore_eos": True})
check(r["usage"]["completion_tokens"] == 2, "other texts are served")
check(short.stop() == 0, "stop")
tiny = rows(short.tmp + "/tiny", 2000)
r = subprocess.run([KVTIERD, "--model", tiny, "--socket", short.tmp + "/tiny.sock", "--disk-dir", "none"],
                   capture_output=True, text=True, timeout=60)
check(r.returncode == 3 and "bos_token id 2044 is past the model's 2000 embedding rows" in r.stderr,
      "a BOS id without an embedding row: the model is refused at start naming it (%d): %s" %
      (r.returncode, r.stderr.strip().splitlines()[-2:]))
