"""kvtierd decodes concurrent encoder-decoder requests (T5, BART) in one
decoder pass a step: four clients at once (different inputs and lengths,
greedy and seeded sampling, n=2 sharing one encoder output, logprobs; for
BART a quantized self cache beside dense ones) each get exactly the tokens
and logprobs they get alone, and the daemon made fewer forward passes than
it generated tokens (forward_steps_total counts passes: one decoder call
per sequence would count at least one per token).  The same four at once
on a daemon whose device budget is its idle use plus KV_BYTES run out of
device memory in shared steps, continue with caches moved to the host
tier, and still get their tokens alone, bit for bit."""
import sys
import threading

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, metric  # noqa: E402
sys.path.insert(0, "tools")
import mkmodel  # noqa: E402

# larger than the other enc-dec tests' models, so a step lasts long enough
# for the four clients' requests to meet in the engine
SIZE = ["--seed", "9", "--layers", "3", "--dim", "192", "--heads", "4", "--ffn", "512", "--vocab", "600",
        "--max-pos", "256"]
KV_BYTES = 1 << 20  # about half of what the four need at their ends


def enc(seed, n):
    return [(seed * 37 + i * 101) % 590 + 5 for i in range(n)]


def outputs(code, r):
    if code != 200:
        return code, r
    return [(c["tokens"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]) for c in r["choices"]]


def at_once(d, reqs):
    """Every request of reqs posted at the same moment: their outputs."""
    together = [None] * len(reqs)
    barrier = threading.Barrier(len(reqs))

    def client(i):
        barrier.wait()
        together[i] = outputs(*d.post("/v1/completions", reqs[i]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return together


def run(name, args, quant):
    d = Daemon("--parallel", "8", model="made below")
    model = d.model = d.tmp + "/" + name
    mkmodel.main(["--out", model] + SIZE + args)
    d.start()
    idle = int(metric(d, 'device_memory_bytes{kind="used"}'))
    sample = dict(temperature=0.9, top_k=40)
    reqs = [dict(input=enc(1, 12), max_tokens=40, temperature=0),
            dict(input=enc(2, 47), max_tokens=64, seed=11, **sample),
            dict(input=enc(3, 30), max_tokens=52, n=2, seed=5, **sample),
            dict(input=enc(4, 21), max_tokens=58, temperature=0)]
    if quant:  # its attention reads quantized blocks, the others' dense ones
        reqs[3]["cache"] = {"implementation": "quantized", "residual_length": 8}
    for r in reqs:
        r.update(ignore_eos=True, return_tokens=True, logprobs=2)
    alone = [outputs(*d.post("/v1/completions", r)) for r in reqs]
    n_tok = sum(r["max_tokens"] * r.get("n", 1) for r in reqs)
    steps0 = metric(d, "forward_steps_total")
    together = at_once(d, reqs)
    passes = metric(d, "forward_steps_total") - steps0
    for i, (a, b) in enumerate(zip(alone, together)):
        check(a == b, "%s: request %d (%s) together: the tokens and logprobs it gets alone" %
              (name, i, "greedy" if reqs[i]["temperature"] == 0 else "sampled, n=%d" % reqs[i].get("n", 1)))
    # each request alone is at least its own max_tokens passes; together
    # they overlap, and a pass per sequence would be n_tok or more (the
    # threads may reach the daemon spread out on a loaded machine)
    check(passes < 0.7 * n_tok, "%s: %d forward passes for %d tokens of %d sequences: they shared decoder steps" %
          (name, passes, n_tok, sum(r.get("n", 1) for r in reqs)))
    check(d.stop() == 0, "%s: kvtierd stops cleanly" % name)
    # out of device memory in shared steps: caches move, tokens stay
    b = Daemon("--parallel", "8", "--device-mem", str(idle + KV_BYTES), model=model, tmp=d.tmp)
    b.sock = d.tmp + "/oom.sock"
    b.start()
    together = at_once(b, reqs)
    moved = metric(b, 'kv_fallbacks_total{reason="oom"}')
    check(together == alone and moved > 0, "%s: device budget %d + %d bytes: %d caches moved to the host tier, every "
          "request's tokens and logprobs alone" % (name, idle, KV_BYTES, moved))
    check(b.stop() == 0, "%s: the budgeted kvtierd stops cleanly" % name)
    d.cleanup()


run("t5", ["--arch", "t5", "--ffn-kind", "gated-gelu", "--no-tie", "--buckets", "16", "--max-distance", "24"], False)
run("bart", ["--arch", "bart", "--tie"], True)
