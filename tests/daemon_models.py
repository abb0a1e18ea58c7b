"""kvtierd with the architectures whose cache rules differ: GPT-2 (learned
positions) and Gemma 2 (alternating sliding and global layers).

GPT-2: its context is n_positions (/v1/models reports it), a prompt +
max_tokens past it is a 400 naming max_tokens, and a sink cache (which
re-rotates positions) is a 400 naming cache.implementation, as are sinks on
a quantized cache (cache.num_sink_tokens); dynamic generation works.
Gemma 2: static and offloaded caches keep the model's own per-layer
windows (the dynamic cache's logprobs); sliding_window windows every layer
(different logprobs past the window); the sink cache, which needs every
layer full-attention, is a 400."""
import subprocess
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, skip  # noqa: E402


def model(tmp, name, *args):
    out = tmp + "/" + name
    r = subprocess.run(["/usr/bin/python3", "tools/mkmodel.py", "--vocab", "2048", "--tokenizer-from", "model/builtin",
                        "--layers", "2", "--dim", "64", "--heads", "4", "--ffn", "160", "--seed", "5", "--out", out]
                       + list(args), capture_output=True, text=True)
    if r.returncode != 0:
        skip("mkmodel failed: " + r.stderr[-300:])
    return out


d = Daemon()
gpt2 = model(d.tmp, "gpt2", "--arch", "gpt2", "--max-pos", "96")
d.model = gpt2
d.start()
code, m = d.get("/v1/models")
check(code == 200 and m["data"][0]["meta"]["n_ctx"] == 96, "gpt2: the context is n_positions (96)")
req = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 8, "temperature": 0}
code, r = d.post("/v1/completions", req)
check(code == 200 and r["usage"]["completion_tokens"] == 8, "gpt2: a dynamic cache generates")
code, e = d.post("/v1/completions", dict(req, max_tokens=89))
check(code == 400 and e["error"]["param"] == "max_tokens",
      "gpt2: prompt + max_tokens past n_positions -> 400 naming max_tokens: " + str(e))
code, e = d.post("/v1/completions", dict(req, cache={"implementation": "sink", "window_length": 32}))
check(code == 400 and e["error"]["param"] == "cache.implementation" and "n_positions" in e["error"]["message"],
      "gpt2: a sink cache -> 400 naming cache.implementation: " + str(e))
code, e = d.post("/v1/completions", dict(req, cache={"implementation": "quantized", "nbits": 8, "window_length": 32,
                                                     "num_sink_tokens": 4}))
check(code == 400 and e["error"]["param"] == "cache.num_sink_tokens",
      "gpt2: sinks on a quantized cache -> 400 naming cache.num_sink_tokens: " + str(e))
d.stop()

# layers 0 and 2 slide with window 8, 1 and 3 are global
gemma = model(d.tmp, "gemma2", "--arch", "gemma2", "--layers", "4", "--head-dim", "16", "--kv-heads", "2",
              "--window", "8", "--tie")
d.model = gemma
d.start()
long = {"prompt": list(range(40, 60)), "max_tokens": 12, "temperature": 0, "logprobs": 1}


def logprobs(r):
    return r["choices"][0]["logprobs"]["token_logprobs"]


def same(a, b):
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 for x, y in zip(a, b))


code, base = d.post("/v1/completions", long)
check(code == 200 and base["usage"]["completion_tokens"] == 12, "gemma2: a dynamic cache generates")
for cache in ({"implementation": "static", "max_cache_len": 64}, {"implementation": "offloaded"}):
    code, r = d.post("/v1/completions", dict(long, cache=cache))
    check(code == 200 and r["choices"][0]["text"] == base["choices"][0]["text"] and same(logprobs(r), logprobs(base)),
          "gemma2: %s keeps the model's own windows (the dynamic cache's logprobs)" % cache["implementation"])
# the sliding_window cache slides every layer, the global ones too
code, r = d.post("/v1/completions", dict(long, cache={"implementation": "sliding_window"}))
check(code == 200 and r["usage"]["completion_tokens"] == 12 and not same(logprobs(r), logprobs(base)),
      "gemma2: sliding_window (the model's 8) windows the global layers too")
code, e = d.post("/v1/completions", dict(long, cache={"implementation": "sink", "window_length": 16}))
check(code == 400 and "sink" in e["error"]["message"], "gemma2 (sliding layers): a sink cache -> 400: " + str(e))
d.stop()
print("daemon_models: ok")
