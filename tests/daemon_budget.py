"""kvtierd's default device budget is sized from the model and the context,
not from the machine: weights (when the backend uploads them: the strict
backend does, the CPU backend reads the mmap) + activations + the f32 KV
of --parallel sequences at the full context, an eighth on top, at least
64 MiB.  The built-in model's figure is recomputed here from its
config.json and must be the start-up line's and /metrics' exactly;
--device-mem still overrides."""
import json
import os
import re
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check  # noqa: E402

MIB = 1 << 20
FLOOR = 64 * MIB
STRICT = os.environ.get("KVTIER_BACKEND_STRICT") == "1"  # no unified memory: the weights are uploaded


def charged(n):
    return (n + 63) // 64 * 64  # the backend charges in multiples of 64 bytes


def formula(seqs, batch_tokens=256):
    with open("model/builtin/config.json") as f:
        c = json.load(f)
    assert c["torch_dtype"] == "float32" and c["tie_word_embeddings"] and not c["attention_bias"]
    dim, ffn, vocab, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    hd = c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    weights = 0
    if STRICT:
        per_layer = sum(charged(n * 4) for n in (q * dim, kv * dim, kv * dim, dim * q, ffn * dim, ffn * dim, dim * ffn))
        weights = charged(vocab * dim * 4) + charged(dim * 4) + layers * (per_layer + 2 * charged(dim * 4))
    rows = batch_tokens
    # the last two: the RoPE tables of the global and of the sliding layers
    act = sum(charged(n * 4) for n in (rows * dim, rows * dim, rows * q, rows * kv, rows * kv, rows * q,
                                         rows * ffn, rows * ffn, 16 * vocab, hd // 2, hd // 2))
    kv_bytes = seqs * c["max_position_embeddings"] * layers * 2 * kv * 4
    total = weights + act + kv_bytes
    return max(FLOOR, total + total // 8)


def budget_metric(d):
    for line in d.get("/metrics")[1].decode().splitlines():
        if line.startswith('kvtier_device_memory_bytes{kind="budget"} '):
            return int(float(line.split()[1]))
    raise KeyError("device budget")


for seqs in (64, 32):  # above the floor (both backends), then at or near it
    d = Daemon("--parallel", str(seqs), model="model/builtin").start()
    want = formula(seqs)
    m = re.search(r"device budget ([0-9.]+) MiB \(sized from the model: .* for (\d+) sequences of (\d+) tokens",
                  d.logtext())
    check(m is not None and float(m.group(1)) == round(want / MIB, 1) and m.group(2) == str(seqs) and
          m.group(3) == "512", "--parallel %d: the start-up line says %.1f MiB sized from the model\n%s" %
          (seqs, want / MIB, d.logtext()))
    got = budget_metric(d)
    check(got == want, "--parallel %d: /metrics' device budget %d is the formula's %d" % (seqs, got, want))
    check(d.stop() == 0, "kvtierd stops cleanly")

d = Daemon("--device-mem", "96M", model="model/builtin").start()
check("device budget 96.0 MiB (--device-mem)" in d.logtext(), "--device-mem overrides the sizing (start-up line)")
check(budget_metric(d) == 96 * MIB, "--device-mem overrides the sizing (/metrics)")
check(d.stop() == 0, "kvtierd stops cleanly")
