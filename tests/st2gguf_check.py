"""st2gguf_check - tools/st2gguf.py on a random tiny llama model, read back
with an independent GGUF reader: the metadata llama.cpp loads, every
tensor's name, shape, type and bytes, and the q/k row permutation checked
by what it is for: attention scores under llama.cpp's interleaved rope on
the converted rows equal those under Hugging Face's rotate-half rope on
the original rows.  Also bench_llamacpp's count of the bytes decode reads
and of llama.cpp's KV bytes per token.

    /usr/bin/python3 tests/st2gguf_check.py WORKDIR
"""
import json
import os
import struct
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_llamacpp  # noqa: E402

SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf(path):
    with open(path, "rb") as f:
        buf = f.read()
    pos = 0

    def rd(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return v

    def rstr():
        nonlocal pos
        (n,) = rd("Q")
        s = buf[pos:pos + n].decode("utf-8")
        pos += n
        return s

    def val(t):
        if t == 8:
            return rstr()
        if t == 9:
            et, n = rd("IQ")
            return [val(et) for _ in range(n)]
        return rd(SCALAR[t])[0]

    assert buf[:4] == b"GGUF"
    pos = 4
    version, n_t, n_kv = rd("IQQ")
    assert version == 3
    meta = {}
    for _ in range(n_kv):
        k = rstr()
        (t,) = rd("I")
        meta[k] = val(t)
    tensors = {}
    for _ in range(n_t):
        name = rstr()
        (nd,) = rd("I")
        ne = rd("Q" * nd)
        ttype, off = rd("IQ")
        tensors[name] = (ne, ttype, off)
    data = (pos + 31) // 32 * 32
    return meta, tensors, buf, data


def st_tensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
        raw = f.read()
    h.pop("__metadata__", None)
    out = {}
    for k, t in h.items():
        b0, b1 = t["data_offsets"]
        assert t["dtype"] == "BF16"
        out[k] = torch.frombuffer(bytearray(raw[b0:b1]), dtype=torch.bfloat16).reshape(t["shape"])
    return out


def rope_half(x, pos, theta):
    """Hugging Face: pairs (i, i + d/2)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = torch.cos(pos * inv), torch.sin(pos * inv)
    a, b = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([a * c - b * s, a * s + b * c], -1)


def rope_interleaved(x, pos, theta):
    """llama.cpp's LLAMA_ROPE_TYPE_NORM: pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = torch.cos(pos * inv), torch.sin(pos * inv)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)


def main():
    work = sys.argv[1]
    model, out = os.path.join(work, "m"), os.path.join(work, "m.gguf")
    py = sys.executable
    subprocess.run([py, os.path.join(ROOT, "tools/mkmodel.py"), "--preset", "tiny", "--dtype", "bf16", "--out", model],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([py, os.path.join(ROOT, "tools/st2gguf.py"), "--model", model, "--out", out], check=True)
    cfg = json.load(open(os.path.join(model, "config.json")))
    meta, tensors, buf, data = read_gguf(out)

    want = {"general.architecture": "llama", "llama.block_count": cfg["num_hidden_layers"],
            "llama.embedding_length": cfg["hidden_size"], "llama.feed_forward_length": cfg["intermediate_size"],
            "llama.attention.head_count": cfg["num_attention_heads"],
            "llama.attention.head_count_kv": cfg["num_key_value_heads"], "llama.vocab_size": cfg["vocab_size"],
            "llama.context_length": cfg["max_position_embeddings"], "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.bos_token_id": cfg["bos_token_id"], "tokenizer.ggml.eos_token_id": cfg["eos_token_id"],
            "general.file_type": 32}
    for k, v in want.items():
        assert meta[k] == v, (k, meta.get(k), v)
    assert abs(meta["llama.attention.layer_norm_rms_epsilon"] - cfg["rms_norm_eps"]) < 1e-12
    assert meta["llama.rope.freq_base"] == cfg["rope_theta"]
    tj = json.load(open(os.path.join(model, "tokenizer.json")))
    assert len(meta["tokenizer.ggml.tokens"]) == cfg["vocab_size"]
    for t, i in tj["model"]["vocab"].items():
        assert meta["tokenizer.ggml.tokens"][i] == t
    assert len(meta["tokenizer.ggml.merges"]) == len(tj["model"]["merges"])
    for a in tj["added_tokens"]:
        assert meta["tokenizer.ggml.tokens"][a["id"]] == a["content"]
        assert meta["tokenizer.ggml.token_type"][a["id"]] == 3

    st = st_tensors(os.path.join(model, "model.safetensors"))
    L = cfg["num_hidden_layers"]
    assert len(tensors) == 2 + 9 * L + 1, sorted(tensors)

    def get(name):
        ne, ttype, off = tensors[name]
        n = 1
        for d in ne:
            n *= d
        if ttype == 30:
            raw = bytearray(buf[data + off:data + off + 2 * n])
            return torch.frombuffer(raw, dtype=torch.bfloat16).reshape(list(reversed(ne)))
        assert ttype == 0, (name, ttype)
        return torch.frombuffer(bytearray(buf[data + off:data + off + 4 * n]), dtype=torch.float32)

    same = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
            "output_norm.weight": "model.norm.weight"}
    for i in range(L):
        for g, h in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"),
                     ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"), ("attn_norm", "input_layernorm"),
                     ("ffn_norm", "post_attention_layernorm")):
            same[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{h}.weight"
    for g, h in same.items():
        got, ref = get(g), st[h]
        if ref.dim() == 1:
            assert tensors[g][1] == 0, g  # norms in F32
            assert torch.equal(got, ref.float()), g
        else:
            assert torch.equal(got, ref), g

    # q/k: scores under each engine's rope agree, and the rows are a permutation
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, theta = cfg["hidden_size"] // nh, cfg["rope_theta"]
    torch.manual_seed(0)
    x = torch.randn(cfg["hidden_size"], dtype=torch.float64)
    for i in range(L):
        wq, wk = st[f"model.layers.{i}.self_attn.q_proj.weight"], st[f"model.layers.{i}.self_attn.k_proj.weight"]
        gq, gk = get(f"blk.{i}.attn_q.weight"), get(f"blk.{i}.attn_k.weight")
        assert not torch.equal(gq, wq) and not torch.equal(gk, wk)  # permuted, not copied
        assert torch.equal(gq.float().sum(0), wq.float().sum(0))
        q_hf = rope_half((wq.double() @ x).view(nh, hd), 5, theta)
        k_hf = rope_half((wk.double() @ x).view(nkv, hd), 2, theta)
        q_gg = rope_interleaved((gq.double() @ x).view(nh, hd), 5, theta)
        k_gg = rope_interleaved((gk.double() @ x).view(nkv, hd), 2, theta)
        for h in range(nh):
            s_hf = q_hf[h] @ k_hf[h // (nh // nkv)]
            s_gg = q_gg[h] @ k_gg[h // (nh // nkv)]
            assert abs(s_hf - s_gg) < 1e-9 * (1 + abs(s_hf)), (i, h, float(s_hf), float(s_gg))

    # the bytes a decode step reads: all but the embedding, as stored
    mats = sum(t.numel() * 2 for k, t in st.items() if k != "model.embed_tokens.weight" and t.dim() == 2)
    norms = sum(t.numel() * 4 for t in st.values() if t.dim() == 1)
    pad = 32 * len(tensors)
    got = bench_llamacpp.gguf_stream_bytes(out)
    assert mats + norms <= got <= mats + norms + pad, (got, mats + norms)
    # and llama.cpp's f16 KV per token, from the metadata (--depth's tables)
    kv = 2 * L * cfg["num_key_value_heads"] * (cfg["hidden_size"] // cfg["num_attention_heads"]) * 2
    assert bench_llamacpp.llama_kv_token_bytes(out) == kv, (bench_llamacpp.llama_kv_token_bytes(out), kv)
    # --kv-bits: q8_0 and q4_0 blocks of 32 elements in 34 and 18 bytes
    for bits, block in ((8, 34), (4, 18)):
        got = bench_llamacpp.llama_kv_token_bytes(out, bits)
        assert got == kv // 2 * block // 32, (bits, got, kv)
    print("st2gguf: ok (%d tensors, q/k rope permutation checked on %d layers)" % (len(tensors), L))


if __name__ == "__main__":
    main()
