"""daemon_beams - beam search and parallel sampling through kvtierd.

Beam search: the daemon's batched beams return exactly kvtier-run's (whose
decisions tests/beams.test.sh checks against Hugging Face's over the
PyTorch reference), ordered by sequence_score; every cache strategy whose
sequences fork gives the same beams; the KV is shared (the bytes copied
per step are copy-on-write blocks, far below a whole-cache reorder); what
does not combine with beams is refused naming the field.  n > 1: one
prefill, every other choice forks it (exactly one copied block per layer
and choice), each choice the tokens of a request of its own seed; best_of
returns the n choices with the highest logprob sums.  Last, 40 beams whose
KV does not fit a tight --device-mem start offloaded and return the
unconstrained run's beams."""
import json
import os
import subprocess
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from daemon_harness import BUILD, Daemon, check  # noqa: E402

d = Daemon("--parallel", "48").start()
cfg = json.load(open(os.path.join(d.model, "config.json")))
head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
BLOCK = 16 * 2 * cfg["num_key_value_heads"] * head_dim * 4  # one layer's K and V of a block, f32
LAYERS = cfg["num_hidden_layers"]

prompt = [(i * 37 + 11) % 1900 + 50 for i in range(101)]
req = {"prompt": prompt, "max_tokens": 12, "num_beams": 4, "num_return_sequences": 4, "return_tokens": True}


def run_tool(nb, nret, n, extra=()):
    p = subprocess.run([os.path.join(BUILD, "kvtier-run"), "-m", d.model, "--ids", ",".join(map(str, prompt)),
                        "-n", str(n), "--num-beams", str(nb), "--num-return", str(nret), "--quiet", *extra],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out = []
    for ln in p.stdout.splitlines():
        f = ln.split()
        out.append((float(f[3]), [int(x) for x in f[7].split(",")]))
    return out


code, r = d.post("/v1/completions", req)
want = run_tool(4, 4, 12)
got = [(c["sequence_score"], c["tokens"]) for c in r.get("choices", [])]
check(code == 200 and [g[1] for g in got] == [w[1] for w in want] and
      all(abs(g[0] - w[0]) < 1e-5 for g, w in zip(got, want)),
      "4 beams: kvtier-run's hypotheses and scores %s" % [round(g[0], 4) for g in got])
check([g[0] for g in got] == sorted([g[0] for g in got], reverse=True), "choices ordered by sequence_score")
k = r["kvtier"]["beam_search"]
# each step forks at most 3 beams, each copying its partly filled block per layer
check(k["steps"] == 11 and 0 < k["kv_bytes_copied_per_step"] <= 3 * LAYERS * BLOCK and
      k["whole_cache_reorder_bytes_per_step"] >= 4 * 101 * LAYERS * BLOCK / 16 and
      k["kv_bytes_copied"] * 4 < k["whole_cache_reorder_bytes"],
      "KV shared: %.0f bytes copied per step against %.0f for a whole-cache reorder" %
      (k["kv_bytes_copied_per_step"], k["whole_cache_reorder_bytes_per_step"]))

code, r = d.post("/v1/completions", dict(req, num_return_sequences=2, length_penalty=0.5, early_stopping="never",
                                         no_repeat_ngram_size=2, min_tokens=3))
want = run_tool(4, 2, 12, ("--length-penalty", "0.5", "--early-stopping", "never", "--no-repeat-ngram", "2",
                            "--min-new", "3"))
check(code == 200 and [c["tokens"] for c in r["choices"]] == [w[1] for w in want],
      "length_penalty, early_stopping \"never\", no_repeat_ngram_size, min_tokens: kvtier-run's beams")

code, r = d.post("/v1/completions", dict(req, num_return_sequences=3, num_beam_groups=2, diversity_penalty=1.5))
want = run_tool(4, 3, 12, ("--num-beam-groups", "2", "--diversity-penalty", "1.5"))
got = [(c["sequence_score"], c["tokens"]) for c in r.get("choices", [])]
check(code == 200 and [g[1] for g in got] == [w[1] for w in want] and
      all(abs(g[0] - w[0]) < 1e-5 for g, w in zip(got, want)),
      "group beam search (2 groups, diversity_penalty 1.5): kvtier-run's hypotheses")

# beams batched with other requests: each gets what it gets alone
reqs = [dict(req, num_beams=3, num_return_sequences=3, max_tokens=30), dict(req, prompt=prompt[:50], max_tokens=30),
        {"prompt": prompt[:30], "max_tokens": 30, "temperature": 1.0, "seed": 3, "n": 3, "return_tokens": True}]
alone = [[c["tokens"] for c in d.post("/v1/completions", q)[1]["choices"]] for q in reqs]
together = [None] * len(reqs)


def run(i):
    together[i] = [c["tokens"] for c in d.post("/v1/completions", reqs[i])[1]["choices"]]


threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
for t in threads:
    t.start()
for t in threads:
    t.join()
check(together == alone, "two beam searches and n=3 sampling batched together: each its results alone")

code, r = d.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
                                          "num_beams": 3, "num_return_sequences": 2})
check(code == 200 and len(r["choices"]) == 2 and all("sequence_score" in c and c["message"]["role"] == "assistant"
                                                       for c in r["choices"]), "chat: beams as choices")

code, r = d.post("/v1/completions", req)
base = [c["tokens"] for c in r["choices"]]
dyn_copied = r["kvtier"]["kv_bytes_copied"]
for name, cache in (("static", {"implementation": "static", "max_cache_len": 128}),
                    ("offloaded", {"implementation": "offloaded"}),
                    ("offloaded_static", {"implementation": "offloaded_static", "max_cache_len": 128}),
                    ("sliding_window", {"implementation": "sliding_window", "window_length": 64})):
    code, r = d.post("/v1/completions", dict(req, cache=cache))
    if name == "sliding_window":
        ok = code == 200 and len(r["choices"]) == 4
    else:  # their forks copy the parent's extents: more than the dynamic run's blocks
        ok = code == 200 and [c["tokens"] for c in r["choices"]] == base and r["kvtier"]["kv_bytes_copied"] > dyn_copied
    check(ok and r["kvtier"]["requested_strategy"] == name,
          "%s: %s (copied %s bytes)" % (name, "the dynamic run's beams" if name != "sliding_window" else "4 beams",
                                        r.get("kvtier", {}).get("kv_bytes_copied")))

for body, param, status in (
        (dict(req, stream=True), "stream", 400),
        (dict(req, n=2), "n", 400),
        (dict(req, num_return_sequences=5), "num_return_sequences", 400),
        (dict(req, logprobs=1), "logprobs", 400),
        (dict(req, stop=["x"]), "stop", 400),
        (dict(req, top_p=0.5), "top_p", 400),
        (dict(req, cache={"implementation": "quantized"}), "num_beams", 400),
        (dict(req, use_cache=False), "use_cache", 400),
        (dict(req, num_beam_groups=3, diversity_penalty=0.5), "num_beam_groups", 400),
        (dict(req, diversity_penalty=0.5), "diversity_penalty", 400),
        (dict(req, num_beams=100), "num_beams", 400),
        ({"prompt": prompt, "length_penalty": 2.0}, "length_penalty", 400),
        ({"prompt": prompt, "early_stopping": True}, "early_stopping", 400),
        ({"prompt": prompt, "n": 3, "best_of": 2}, "best_of", 400),
        ({"prompt": prompt, "n": 1, "best_of": 2, "stream": True}, "best_of", 400)):
    code, e = d.post("/v1/completions", body)
    check(code == status and e["error"]["param"] == param,
          "%s -> %d: %s" % (param, status, e["error"]["message"][:90]))

# n > 1: one prefill forked; choice i is what a request with seed + i gives
samp = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 7, "return_tokens": True, "ignore_eos": True}
code, r = d.post("/v1/completions", dict(samp, n=5))
alone = [d.post("/v1/completions", dict(samp, seed=7 + i))[1]["choices"][0]["tokens"] for i in range(5)]
check(code == 200 and [c["tokens"] for c in r["choices"]] == alone,
      "n=5: each choice the tokens of a request of its own seed")
# 101 prompt tokens end in a partly filled block, shared by the five: four copy it
check(r["kvtier"]["kv_bytes_copied"] == 4 * LAYERS * BLOCK,
      "n=5 shares the prompt's KV: %d bytes copied (4 blocks per layer)" % r["kvtier"]["kv_bytes_copied"])
# every strategy that forks: the forked choices continue exactly, sliding
# and sink caches past their window too
for cache in ({"implementation": "sink", "window_length": 64}, {"implementation": "sliding_window", "window_length": 48},
              {"implementation": "static", "max_cache_len": 160}, {"implementation": "offloaded"}):
    long = dict(samp, max_tokens=40, cache=cache)
    code, r = d.post("/v1/completions", dict(long, n=4))
    alone = [d.post("/v1/completions", dict(long, seed=7 + i))[1]["choices"][0]["tokens"] for i in range(4)]
    check(code == 200 and [c["tokens"] for c in r["choices"]] == alone and r["kvtier"]["kv_bytes_copied"] > 0,
          "n=4 on %s: forked choices give their own seeds' tokens" % cache["implementation"])
code, r = d.post("/v1/completions", dict(samp, n=40, max_tokens=2))
check(code == 200 and len(r["choices"]) == 40, "n=40 (the cap is above 8 now)")

code, r = d.post("/v1/completions", dict(samp, n=2, best_of=6))
code6, r6 = d.post("/v1/completions", dict(samp, n=6, logprobs=0))
sums = [sum(c["logprobs"]["token_logprobs"]) for c in r6["choices"]]
order = sorted(range(6), key=lambda i: (-sums[i], i))[:2]
check(code == 200 and code6 == 200 and [c["tokens"] for c in r["choices"]] == [r6["choices"][i]["tokens"]
                                                                                for i in order],
      "best_of=6, n=2: the two choices with the highest logprob sums (%s)" % [round(sums[i], 3) for i in order])
d.stop()

# 40 beams whose KV does not fit the device: they start offloaded, no step fails
big = dict(req, num_beams=40, num_return_sequences=40, max_tokens=8)
free = Daemon("--parallel", "48", model=d.model).start()
used = None  # before any request: the store's pool keeps the blocks it grew by
for line in free.get("/metrics")[1].decode().splitlines():
    if line.startswith('kvtier_device_memory_bytes{kind="used"} '):
        used = float(line.split()[1])
code, clean = free.post("/v1/completions", big)
check(code == 200 and clean["kvtier"]["fallback"] is None, "40 beams, unconstrained: on the device")
kv_dev = None  # the daemon is idle now: what its prefix cache keeps of the prompt, not the 40 beams' KV
for line in free.get("/metrics")[1].decode().splitlines():
    if line.startswith('kvtier_kv_cache_bytes{tier="device"} '):
        kv_dev = float(line.split()[1])
check(kv_dev is not None and kv_dev <= -(-len(prompt) // 16) * LAYERS * BLOCK,
      "the finished request's KV left /metrics: %s device bytes" % kv_dev)
free.stop()
budget = int(used + 40 * LAYERS * BLOCK)  # the model and 40 blocks per layer: far below 40 beams' KV
tight = Daemon("--parallel", "48", "--device-mem", str(budget), model=d.model).start()
code, r = tight.post("/v1/completions", big)
k = r.get("kvtier", {})
# the streamed attention rounds differently in the last digits of a score
check(code == 200 and [c["tokens"] for c in r["choices"]] == [c["tokens"] for c in clean["choices"]] and
      all(abs(a["sequence_score"] - b["sequence_score"]) < 1e-5 for a, b in zip(r["choices"], clean["choices"])),
      "40 beams over --device-mem %d: the unconstrained run's beams (ids equal, scores within 1e-5)" % budget)
check(k.get("strategy") == "offloaded" and k.get("fallback") == "offloaded" and k["bytes"]["host"] > 0 and
      k["bytes"]["device"] == 0,
      "they ran offloaded: %s" % {x: k.get(x) for x in ("strategy", "fallback", "bytes")})
log = tight.logtext()
check("failed" not in log and "redoing" not in log and "exhausted" not in log, "no step failed or was redone")
tight.stop()

# ignore_eos: an eos id the search kept is one more token, not the end.
# The built-in model under a 2-token window falls into eos ids (2047).
b = Daemon(model="model/builtin").start()
code, r = b.post("/v1/completions", {"prompt": "Hi there friend", "max_tokens": 20, "ignore_eos": True, "num_beams": 3,
                                     "return_tokens": True,
                                     "cache": {"implementation": "sliding_window", "window_length": 2}})
c = r["choices"][0] if code == 200 else {}
check(code == 200 and 2047 in c["tokens"] and len(c["tokens"]) == 20 and c["finish_reason"] == "length",
      "beams with ignore_eos: eos ids among the 20 tokens, finish_reason length (%s)" % c)
b.stop()
print("daemon_beams: ok")
