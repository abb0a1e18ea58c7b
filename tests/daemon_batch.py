"""Continuous batching: 32 (bf16: 16) concurrent clients each get exactly the greedy
output they get alone, and the daemon shares forward passes between them
(fewer steps than tokens); a quantized cache's greedy tokens do not depend
on how the steps cut its prompt.  argv[1]: the weights' dtype (f32, or bf16,
which a CPU with AVX512_BF16 multiplies on its own kernels)."""
import atexit
import os
import shutil
import sys
import tempfile
import threading

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, mkmodel  # noqa: E402

dtype = sys.argv[1] if len(sys.argv) > 1 else "f32"
model = None  # the harness's tiny f32 model
if dtype != "f32":
    tmp = tempfile.mkdtemp(prefix="kvtier-test.")
    atexit.register(shutil.rmtree, tmp, True)
    model = mkmodel(os.path.join(tmp, "model"), "--arch", "llama", "--preset", "tiny", "--dtype", dtype)
d = Daemon("--parallel", "32", "--batch-tokens", "128", model=model).start()
# the bf16 pass is a second daemon run: half the clients keep the test short
N, T = (32 if dtype == "f32" else 16), 24
words = ["In the beginning", "And God said", "The king", "Blessed are", "He that", "Now the", "Behold", "Thus saith"]
reqs = [{"prompt": "%s %s" % (words[i % len(words)], " and" * (i // len(words) * 7)), "max_tokens": T,
         "temperature": 0, "ignore_eos": True, "return_tokens": True} for i in range(N)]


def metric(name):
    for line in d.get("/metrics")[1].decode().splitlines():
        if line.startswith("kvtier_" + name + " "):
            return float(line.split()[1])


alone = []
for r in reqs:
    code, out = d.post("/v1/completions", r)
    assert code == 200, out
    alone.append(out["choices"][0])

steps0 = metric("forward_steps_total")
together = [None] * N
barrier = threading.Barrier(N)


def client(i):
    barrier.wait()
    if i % 2:  # half the clients stream
        ev = d.stream("/v1/completions", dict(reqs[i], stream=True))
        chunks = [e["choices"][0] for e in ev[:-1]]
        together[i] = {"text": "".join(c["text"] for c in chunks), "tokens": [t for c in chunks for t in c["tokens"]]}
        return
    code, out = d.post("/v1/completions", reqs[i])
    together[i] = out["choices"][0] if code == 200 else out


threads = [threading.Thread(target=client, args=(i,)) for i in range(N)]
for t in threads:
    t.start()
for t in threads:
    t.join(120)
steps = metric("forward_steps_total") - steps0
same = sum(1 for a, b in zip(alone, together) if a["tokens"] == b.get("tokens") and a["text"] == b.get("text"))
check(same == N, "%d of %d concurrent greedy outputs identical to the same request alone" % (same, N))
# unbatched, every token is a step of its own (N * T steps and more); on a
# loaded machine the clients' threads reach the daemon spread out and a
# small model's steps are a millisecond, so only three quarters is asked
# (a CI run saw 245 steps for 384 tokens with batching working)
check(steps < N * T * 3 / 4, "%d forward steps for %d tokens: requests were batched" % (steps, N * T))

# A quantized cache applies its rule once per update, as transformers does
# for one forward call over the prompt: how the step budget cuts a prompt
# (here 128 + 72 alone; the two choices of n = 2 share the steps and are
# cut otherwise) must not change what is quantized, so neither the tokens
# nor their log-probabilities (which show a difference a greedy token of
# this model may not).
prompt = [(i * 37 + 11) % 1900 + 50 for i in range(200)]
for cache in ({"implementation": "quantized", "nbits": 4}, {"implementation": "quantized", "backend": "fp8"}):
    body = {"prompt": prompt, "max_tokens": T, "temperature": 0, "ignore_eos": True, "return_tokens": True,
            "logprobs": 1, "cache": cache}
    solo = d.post_ok("/v1/completions", body)["choices"][0]
    two = d.post_ok("/v1/completions", dict(body, n=2))["choices"]
    check(all(c["tokens"] == solo["tokens"] and c["logprobs"]["token_logprobs"] == solo["logprobs"]["token_logprobs"]
              for c in two),
          "%s: the two greedy choices of n = 2, whose prompts are cut into other steps, give the tokens and "
          "log-probabilities of the request alone" % cache)
check(d.stop() == 0, "stop")
