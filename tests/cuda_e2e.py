"""kvtierd --backend cuda against --backend cpu, end to end: with f32
activations (KVTIER_CUDA_ACT=f32) greedy tokens identical to the CPU's for
the built-in model and a random Llama and Qwen3, under every strategy
(dynamic, static, offloaded, offloaded_static, adaptive, sliding window,
sinks, quantized KV (quanto int4 per token, hqq int2 with per-channel
keys, fp8, and a quantized window with sinks), forks (n=2), the prefix
cache); with bf16 activations (sinks aside: they need f32) the chosen
tokens' logprobs within 0.1 of the CPU's while the tokens agree.  A T5,
a BART and a Mamba model: greedy tokens with f32 activations equal to the
CPU's.  Then a
real out-of-memory: a --device-mem that holds the weights and a third of
the request's KV completes offloaded with the unconstrained run's tokens.
Where the CUDA backend does not open (no GPU, driver or plugin) it prints
"no CUDA device (...)" and exits 77."""
import os
import subprocess
import sys
import time

sys.path.insert(0, "tests")
from daemon_harness import KVTIERD, Daemon, check, skip  # noqa: E402

if not os.access(KVTIERD, os.X_OK):
    skip(KVTIERD + " not built")
probe = Daemon("--backend", "cuda", model="model/builtin")
probe.start(wait=False, extra_env={"KVTIER_CUDA_ACT": "f32"})
t = time.time() + 20
while probe.proc.poll() is None and time.time() < t:
    try:
        if probe.get("/health")[0] == 200:
            break
    except OSError:
        time.sleep(0.1)
if probe.proc.poll() is not None:
    line = [x for x in probe.logtext().splitlines() if "--backend cuda:" in x]
    why = line[-1].split("--backend cuda: ", 1)[1] if line else ""
    # skipped only where there is no GPU or no plugin: a plugin that loads
    # and then fails to open, or a daemon that dies otherwise, is a failure
    if not why.startswith(("no CUDA device", "no CUDA plugin")):
        print("FAIL cuda: kvtierd --backend cuda exited %d: %s" % (probe.proc.returncode, why or probe.logtext()[-500:]))
        sys.exit(1)
    print(why)
    sys.exit(77)
probe.cleanup()


def models(tmp):
    out = [("builtin", "model/builtin")]
    for arch in ("llama", "qwen3"):
        path = os.path.join(tmp, arch)
        r = subprocess.run([sys.executable, "tools/mkmodel.py", "--arch", arch, "--preset", "tiny", "--vocab",
                            "2048", "--tokenizer-from", "model/builtin", "--out", path], capture_output=True, text=True)
        check(r.returncode == 0, "mkmodel %s: %s" % (arch, r.stderr[-300:]))
        out.append((arch, path))
    return out


prompt = [(i * 37 + 11) % 1900 + 50 for i in range(300)]
base = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_tokens": True}
STRATEGIES = [
    ("dynamic", {}),
    ("static", {"cache": {"implementation": "static", "max_cache_len": 512}}),
    ("offloaded", {"cache": {"implementation": "offloaded"}}),
    ("offloaded_static", {"cache": {"implementation": "offloaded_static", "max_cache_len": 512}}),
    ("adaptive", {"cache": {"implementation": "offloaded", "max_cache_len": 512, "adaptive": True}}),
    ("sliding", {"cache": {"implementation": "dynamic", "window_length": 64}}),
    ("sinks", {"cache": {"implementation": "sink", "window_length": 128, "num_sink_tokens": 4}}),
    ("quanto int4", {"cache": {"implementation": "quantized", "backend": "quanto", "nbits": 4,
                               "residual_length": 32}}),
    ("hqq int2 per-channel keys", {"cache": {"implementation": "quantized", "backend": "hqq", "nbits": 2,
                                             "axis_key": 0, "axis_value": 1, "q_group_size": 32,
                                             "residual_length": 32}}),
    ("fp8", {"cache": {"implementation": "quantized", "backend": "fp8"}}),
    ("quantized sinks", {"cache": {"implementation": "quantized", "nbits": 4, "num_sink_tokens": 4,
                                   "window_length": 128, "residual_length": 32}}),
    ("forks", {"n": 2, "temperature": 0}),
    ("prefix cache", {}),  # the same prompt again: its blocks come from the prefix cache
]


def run_all(d, logprobs=False, skip=()):
    out = {}
    for name, extra in STRATEGIES:
        if name in skip:
            continue
        body = dict(base, **extra)
        if logprobs:
            body["logprobs"] = 1
        code, r = d.post("/v1/completions", body)
        check(code == 200, "%s: %d %s" % (name, code, str(r)[:200]))
        out[name] = r["choices"]
    return out


probe_tmp = Daemon(model="model/builtin").tmp
MODELS = models(probe_tmp)
for label, path in MODELS:
    cpu = Daemon(model=path, tmp=probe_tmp).start()
    want = run_all(cpu, logprobs=True)
    cpu.cleanup()
    gpu = Daemon("--backend", "cuda", model=path, tmp=probe_tmp).start(extra_env={"KVTIER_CUDA_ACT": "f32"})
    got = run_all(gpu)
    for name, _ in STRATEGIES:
        check([c["tokens"] for c in got[name]] == [c["tokens"] for c in want[name]],
              "%s, %s: cuda f32 greedy tokens = cpu's" % (label, name))
    gpu.cleanup()
    bf = Daemon("--backend", "cuda", model=path, tmp=probe_tmp).start(extra_env={"KVTIER_CUDA_ACT": "bf16"})
    # the sinks' rotation table is f32: the model refuses them with bf16 activations
    got = run_all(bf, logprobs=True, skip=("sinks", "quantized sinks"))
    for name in got:
        a, b = want[name][0], got[name][0]
        worst = 0.0
        for i, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"])):
            if ta != tb:
                break
            worst = max(worst, abs(a["logprobs"]["token_logprobs"][i] - b["logprobs"]["token_logprobs"][i]))
        check(worst < 0.1, "%s, %s: bf16 logprobs within 0.1 of cpu's while the tokens agree (%.3g)" %
              (label, name, worst))
    bf.cleanup()

# encoder-decoder models (T5 with its relative position bias, BART): the
# encoder's bidirectional attention and the cross-attention on the device,
# greedy tokens with f32 activations equal to the CPU's
sys.path.insert(0, "tools")
import mkmodel  # noqa: E402
ENC = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 264, 33, 83, 279, 50, 288, 41, 97, 169, 39]
for arch, args in (("t5", ["--ffn-kind", "gated-gelu", "--tie", "--buckets", "16", "--max-distance", "12"]),
                   ("bart", ["--tie"])):
    path = os.path.join(probe_tmp, arch)
    mkmodel.main(["--out", path, "--arch", arch, "--seed", "5", "--layers", "2", "--dim", "64", "--heads", "4",
                  "--ffn", "128", "--vocab", "320", "--max-pos", "128"] + args)
    body = {"input": ENC, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True}
    runs = {}
    for backend in ("cpu", "cuda"):
        d = Daemon("--backend", backend, model=path, tmp=probe_tmp).start(extra_env={"KVTIER_CUDA_ACT": "f32"})
        for name, extra in (("dynamic", {}), ("offloaded", {"cache": {"implementation": "offloaded"}})):
            code, r = d.post("/v1/completions", dict(body, **extra))
            check(code == 200, "%s on %s, %s: %d %s" % (arch, backend, name, code, str(r)[:200]))
            runs[backend, name] = r["choices"][0]["tokens"]
        d.cleanup()
    for name in ("dynamic", "offloaded"):
        check(runs["cuda", name] == runs["cpu", name], "%s, %s: cuda f32 greedy tokens = cpu's" % (arch, name))

# a Mamba model: the state-space ops on the device, greedy tokens with f32
# activations equal to the CPU's
path = os.path.join(probe_tmp, "mamba")
mkmodel.main(["--out", path, "--arch", "mamba", "--preset", "tiny", "--vocab", "2048", "--tokenizer-from",
              "model/builtin"])
runs = {}
for backend in ("cpu", "cuda"):
    d = Daemon("--backend", backend, model=path, tmp=probe_tmp).start(extra_env={"KVTIER_CUDA_ACT": "f32"})
    code, r = d.post("/v1/completions", base)
    check(code == 200, "mamba on %s: %d %s" % (backend, code, str(r)[:200]))
    runs[backend] = r["choices"][0]["tokens"]
    d.cleanup()
check(runs["cuda"] == runs["cpu"], "mamba: cuda f32 greedy tokens = cpu's")

# a real OOM: what the unconstrained run used less two thirds of its KV
path = dict(MODELS)["llama"]
free = Daemon("--backend", "cuda", model=path, tmp=probe_tmp).start(extra_env={"KVTIER_CUDA_ACT": "f32"})
code, clean = free.post("/v1/completions", base)
check(code == 200 and clean["kvtier"]["fallback"] is None, "unconstrained cuda: no fallback")
kv = clean["kvtier"]["bytes"]["device"]
used = [ln for ln in free.get("/metrics")[1].decode().splitlines()
        if ln.startswith('kvtier_device_memory_bytes{kind="used"} ')]
free.cleanup()
check(used and kv > 0, "/metrics: the device bytes used")
budget = int(float(used[0].split()[1])) - kv + kv // 3
tight = Daemon("--backend", "cuda", "--device-mem", str(budget), model=path,
               tmp=probe_tmp).start(extra_env={"KVTIER_CUDA_ACT": "f32"})
code, r = tight.post("/v1/completions", base)
check(code == 200 and r["kvtier"]["fallback"] == "offloaded" and
      r["choices"][0]["tokens"] == clean["choices"][0]["tokens"],
      "a budget below the request's KV: offloaded, the unconstrained run's tokens (%s)" % r.get("kvtier"))
