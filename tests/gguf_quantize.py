"""gguf_quantize - `kvtier quantize` on every architecture the GGUF loader
reads (random models from tools/mkmodel.py, rows wide enough for Q4_K's
super-blocks and one matrix of Q8_0 rows): each file loads and computes,
greedy tokens and every logit of kvtier-run --dump byte for byte, what the
safetensors computes with --weights q8_0, q4_k, or as stored for bf16; the
bf16 file holds what tools/st2gguf.py (the independent writer, written as
llama.cpp's converter writes) holds: the same tensors under the same names,
shapes, types and bytes, and the same metadata.  Architectures the loader
does not read, shapes llama.cpp would compute differently and rows that are
not whole Q8_0 blocks are refused with a message naming them.

    /usr/bin/python3 tests/gguf_quantize.py BUILD WORKDIR
"""
import contextlib
import filecmp
import io
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import mkmodel  # noqa: E402
import st2gguf  # noqa: E402
from st2gguf_check import read_gguf  # noqa: E402

# rows of 256 (Q4_K) but for ffn_down's 320 (Q8_0 under q4_k)
WIDE = "--layers 2 --dim 256 --heads 4 --head-dim 64 --ffn 320 --vocab 384".split()
MODELS = {
    "llama": WIDE + ["--kv-heads", "2"],
    "qwen2": WIDE + ["--kv-heads", "2"],
    "qwen3": WIDE + ["--kv-heads", "1"],
    "gemma2": WIDE + "--kv-heads 2 --window 8 --attn-softcap 5 --final-softcap 10 --tie".split(),
    "gemma3": WIDE + "--kv-heads 1 --window 8 --window-pattern 3 --theta 1000000 --local-theta 5000 "
                     "--rope-scaling linear:4 --final-softcap 10 --tie --layers 4".split(),  # 4: period 3 shows
    "phi3": "--layers 2 --dim 256 --heads 4 --kv-heads 2 --ffn 320 --vocab 384 --window 8 --partial-rotary 0.75 "
            "--rope-scaling longrope --max-pos 2048 --orig-max-pos 512".split(),
    "gpt2": "--layers 2 --dim 256 --heads 4 --ffn 320 --vocab 384 --max-pos 64".split(),
}
IDS = "5,17,33,2,9,44,101"


def fail(msg):
    raise SystemExit("gguf_quantize: " + msg)


def quantize(build, model, out, qtype):
    r = subprocess.run([os.path.join(build, "kvtier"), "quantize", "--type", qtype, model, out],
                       capture_output=True, text=True)
    return r.returncode, r.stderr


def dump(build, model, weights, out):
    cmd = [os.path.join(build, "kvtier-run"), "-m", model, "--ids", IDS, "-n", "12", "--greedy", "--ignore-eos",
           "--quiet", "--dump", out]
    if weights:
        cmd += ["--weights", weights]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def same_layout(arch, ours, ref):
    """Every tensor and metadata entry of st2gguf's file in ours, equal."""
    m1, t1, b1, d1 = read_gguf(ours)
    m2, t2, b2, d2 = read_gguf(ref)
    if set(t1) != set(t2):
        fail(f"{arch}: tensors {sorted(set(t1) ^ set(t2))} in one file only")
    for name, (ne, ttype, off) in t2.items():
        ne1, ttype1, off1 = t1[name]
        if (ne1, ttype1) != (ne, ttype):
            fail(f"{arch}: {name}: shape {ne1} type {ttype1}, st2gguf's {ne} {ttype}")

    def extents(t, end):
        """each tensor's bytes: up to the next offset in its own file"""
        offs = sorted(o for _, _, o in t.values()) + [end]
        return {k: (o, offs[offs.index(o) + 1]) for k, (_, _, o) in t.items()}
    e1, e2 = extents(t1, len(b1) - d1), extents(t2, len(b2) - d2)
    for name in t2:
        a = b1[d1 + e1[name][0]:d1 + e1[name][1]].rstrip(b"\0")
        b = b2[d2 + e2[name][0]:d2 + e2[name][1]].rstrip(b"\0")
        if a != b:
            fail(f"{arch}: tensor {name}: bytes differ from st2gguf's")
    extra = set(m1) - set(m2)
    if extra:
        fail(f"{arch}: metadata {sorted(extra)} st2gguf does not write")
    for k, v in m2.items():
        if k not in m1:
            fail(f"{arch}: metadata {k} missing (st2gguf writes {str(v)[:60]})")
        if m1[k] != v:
            fail(f"{arch}: metadata {k} = {str(m1[k])[:60]}, st2gguf's {str(v)[:60]}")


def refused(build, work, name, config, want):
    d = os.path.join(work, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    rc, err = quantize(build, d, os.path.join(work, name + ".gguf"), "q8_0")
    if rc == 0 or rc > 128 or want not in err:
        fail(f"{name}: rc {rc}, {err.strip()!r} (wanted {want!r})")
    print(f"gguf_quantize: {name} refused: {err.strip()}")


def main():
    build, work = sys.argv[1:3]
    for arch, args in MODELS.items():
        d = os.path.join(work, arch)
        mkmodel.main(["--arch", arch, "--dtype", "bf16", "--seed", "7", "--out", d] + args)
        ref = os.path.join(work, arch + "-st.gguf")
        with contextlib.redirect_stdout(io.StringIO()):  # its one-line summary
            st2gguf.main(["--model", d, "--out", ref])
        for qtype in ("bf16", "q8_0", "q4_k"):
            out = os.path.join(work, f"{arch}-{qtype}.gguf")
            rc, err = quantize(build, d, out, qtype)
            if rc != 0:
                fail(f"{arch}: kvtier quantize --type {qtype}: {err.strip()}")
            dump(build, d, None if qtype == "bf16" else qtype, os.path.join(work, "a"))
            dump(build, out, None, os.path.join(work, "b"))
            if not filecmp.cmp(os.path.join(work, "a"), os.path.join(work, "b"), shallow=False):
                fail(f"{arch}: {out} computes otherwise than {d} with --weights {qtype}")
        same_layout(arch, os.path.join(work, f"{arch}-bf16.gguf"), ref)
        print(f"gguf_quantize: {arch}: bf16, q8_0, q4_k files = the directory; bf16 = st2gguf's")
    # a query_pre_attn_scalar llama.cpp would not take
    d = os.path.join(work, "gemma2q")
    mkmodel.main(["--arch", "gemma2", "--dtype", "bf16", "--out", d, "--qpas", "24"] + MODELS["gemma2"])
    rc, err = quantize(build, d, os.path.join(work, "gemma2q.gguf"), "q8_0")
    if rc == 0 or "query_pre_attn_scalar" not in err:
        fail(f"gemma2 with query_pre_attn_scalar 24: rc {rc}, {err.strip()!r}")
    # rows that are not whole Q8_0 blocks: refused naming the tensor (bf16 is written)
    d = os.path.join(work, "narrow")
    mkmodel.main(["--arch", "llama", "--dtype", "bf16", "--out", d, "--layers", "1", "--dim", "48", "--heads", "4",
                  "--ffn", "96", "--vocab", "384"])
    rc, err = quantize(build, d, os.path.join(work, "narrow.gguf"), "q8_0")
    if rc == 0 or "blk.0.attn_q.weight: 48 columns, not a multiple of 32" not in err:
        fail(f"rows of 48 as Q8_0: rc {rc}, {err.strip()!r}")
    if quantize(build, d, os.path.join(work, "narrow.gguf"), "bf16")[0] != 0:
        fail("rows of 48 as bf16 refused")
    refused(build, work, "mamba", {"architectures": ["MambaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
                                   "vocab_size": 384, "torch_dtype": "float32"}, "MambaForCausalLM is not written to GGUF")
    refused(build, work, "mistral", {"architectures": ["MistralForCausalLM"], "hidden_size": 64,
                                     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "vocab_size": 384, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "sliding_window": 8, "torch_dtype": "float32"},
            "MistralForCausalLM with a sliding window is not written to GGUF")
    print("gguf_quantize: ok")


if __name__ == "__main__":
    main()
