#!/usr/bin/python3
"""st2gguf - a Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3 or GPT-2
Hugging Face model (safetensors) as GGUF, so that llama.cpp runs the very weights kvtier runs, and kvtier's
GGUF loader is tested against a writer it shares no code with.

    /usr/bin/python3 tools/st2gguf.py --model DIR --out FILE.gguf [--type q8_0 [--q8-embed] | --type q4_k |
                                                                 --type q6_k [--q6k-as-q8]]
    /usr/bin/python3 tools/st2gguf.py --vocab-only --model DIR --out FILE.gguf

What llama.cpp's convert_hf_to_gguf.py does for these classes, written
with the standard library alone (its converter needs torch, transformers
and gguf-py): the hyperparameters under the ARCH.* keys, the byte-level
BPE tokenizer as tokenizer.ggml.model "gpt2" (its split regex named by
tokenizer.ggml.pre) or a SentencePiece-style one (byte_fallback) as
"llama" with scores, the chat template and a second eos id as the
end-of-turn token, the tensors renamed (token_embd, blk.N.attn_q, ..., output),
matrices kept in their dtype (BF16, F16 or F32), 1-D tensors as F32, and
for llama q_proj/k_proj rows permuted per head from Hugging Face's
rotate-half order to the interleaved pairs llama.cpp's rope reads
(convert_hf_to_gguf's LlamaModel.permute).  Gemma's norm weights are
stored as 1 + w (computed in f32), Phi-3's fused qkv_proj and gate_up_proj
stay fused (attn_qkv, ffn_up) with longrope's factors as the
rope_factors_long/short tensors, and GPT-2's Conv1D weights ([in, out])
are transposed to [out, in].  What llama.cpp derives rather than reads is
checked instead of written: Gemma's query_pre_attn_scalar (head_dim, or
hidden / heads for the 27B shapes) and Gemma 2's soft caps (present).
Gemma 3's sliding_window_pattern, which the converter drops (llama.cpp
then takes 6), is written under the key llama.cpp reads when it is not 6.

--type q8_0 writes the layer matrices (q, k, v, o, gate, up, down) as
Q8_0 blocks and the rest as above, the split kvtier's --weights q8_0
makes; --q8-embed quantizes token_embd and output too, as llama.cpp's
Q8_0 files do.  --type q4_k writes those whose rows are whole 256-element
super-blocks as Q4_K and the others as Q8_0, the split of --weights q4_k.
--type q6_k does the same with Q6_K blocks (a simple quantizer, not
llama.cpp's); --q6k-as-q8 writes instead the Q8_0 blocks of those Q6_K
values, which is what kvtier's loader holds for a Q6_K tensor.
Quantizing takes numpy and tools/torchref.py's quantizers.
"""
import argparse
import json
import math
import os
import struct
import sys

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGN = 32

# GGUF metadata value types
T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR = 4, 5, 6, 7, 8, 9
# ggml tensor types
GGML = {"F32": 0, "F16": 1, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14, "BF16": 30}
# llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0, MOSTLY_Q4_K_M, MOSTLY_Q6_K, MOSTLY_BF16
FILE_TYPE = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K": 15, "Q6_K": 18, "BF16": 32}
# bytes of a row of n elements of a block type: (elements per block, bytes per block)
BLOCKS = {"Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}
ELEM = {"F32": 4, "F16": 2, "BF16": 2}
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
        "gemma3": "gemma3", "phi3": "phi3", "gpt2": "gpt2"}
# tokenizer.ggml.pre: the split regexes of tokenizer.json files llama.cpp names
PRE = {"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+": "gpt-2",
       "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
       "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "llama-bpe",
       "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
       "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "qwen2"}
LAYER_MATS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# llama_token_type
TOK_NORMAL, TOK_UNKNOWN, TOK_CONTROL, TOK_USER, TOK_BYTE = 1, 2, 3, 4, 6


def s_str(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype, value):
    out = s_str(key) + struct.pack("<I", vtype)
    if vtype == T_U32:
        return out + struct.pack("<I", value)
    if vtype == T_F32:
        return out + struct.pack("<f", value)
    if vtype == T_BOOL:
        return out + struct.pack("<B", 1 if value else 0)
    if vtype == T_STR:
        return out + s_str(value)
    etype, items = value
    out += struct.pack("<IQ", etype, len(items))
    if etype == T_STR:
        return out + b"".join(s_str(x) for x in items)
    if etype == T_I32:
        return out + struct.pack("<%di" % len(items), *items)
    if etype == T_F32:
        return out + struct.pack("<%df" % len(items), *items)
    raise ValueError("array of type %d" % etype)


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def tensor_names(arch, n_layers, tie, header):
    """(gguf name, HF name) in file order; biases and q/k norms when the
    checkpoint has them."""
    if arch == "gpt2":
        return gpt2_names(n_layers, tie, header)
    out = [("token_embd.weight", "model.embed_tokens.weight")]
    per = [("attn_norm.weight", "input_layernorm.weight"), ("attn_q.weight", "self_attn.q_proj.weight"),
           ("attn_q.bias", "self_attn.q_proj.bias"), ("attn_k.weight", "self_attn.k_proj.weight"),
           ("attn_k.bias", "self_attn.k_proj.bias"), ("attn_v.weight", "self_attn.v_proj.weight"),
           ("attn_v.bias", "self_attn.v_proj.bias"), ("attn_output.weight", "self_attn.o_proj.weight"),
           ("attn_output.bias", "self_attn.o_proj.bias"), ("attn_q_norm.weight", "self_attn.q_norm.weight"),
           ("attn_k_norm.weight", "self_attn.k_norm.weight"),
           ("ffn_norm.weight", "post_attention_layernorm.weight"), ("ffn_gate.weight", "mlp.gate_proj.weight"),
           ("ffn_up.weight", "mlp.up_proj.weight"), ("ffn_down.weight", "mlp.down_proj.weight")]
    if arch in ("gemma2", "gemma3"):
        per = [p for p in per if p[0] != "ffn_norm.weight"]
        per[per.index(("attn_output.bias", "self_attn.o_proj.bias")) + 1:1] = [
            ("post_attention_norm.weight", "post_attention_layernorm.weight")]
        per += [("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
                ("post_ffw_norm.weight", "post_feedforward_layernorm.weight")]
    if arch == "phi3":
        per = [("attn_norm.weight", "input_layernorm.weight"), ("attn_qkv.weight", "self_attn.qkv_proj.weight"),
               ("attn_output.weight", "self_attn.o_proj.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
               ("ffn_up.weight", "mlp.gate_up_proj.weight"), ("ffn_down.weight", "mlp.down_proj.weight")]
    for i in range(n_layers):
        for g, h in per:
            gn, hn = "blk.%d.%s" % (i, g), "model.layers.%d.%s" % (i, h)
            optional = g.endswith(".bias") or g.startswith(("attn_q_norm", "attn_k_norm"))
            if hn in header or not optional:
                out.append((gn, hn))
    out.append(("output_norm.weight", "model.norm.weight"))
    if not tie:
        out.append(("output.weight", "lm_head.weight"))
    return out


def gpt2_names(n_layers, tie, header):
    """GPT-2's tensors (under "transformer." or, in the original
    checkpoints, without it) as llama.cpp's converter names them."""
    pre = "transformer." if "transformer.wte.weight" in header else ""
    out = [("token_embd.weight", pre + "wte.weight"), ("position_embd.weight", pre + "wpe.weight")]
    per = [("attn_norm", "ln_1"), ("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"),
           ("ffn_norm", "ln_2"), ("ffn_up", "mlp.c_fc"), ("ffn_down", "mlp.c_proj")]
    for i in range(n_layers):
        for g, h in per:
            for part in ("weight", "bias"):
                out.append(("blk.%d.%s.%s" % (i, g, part), "%sh.%d.%s.%s" % (pre, i, h, part)))
    out += [("output_norm.weight", pre + "ln_f.weight"), ("output_norm.bias", pre + "ln_f.bias")]
    if not tie:
        out.append(("output.weight", "lm_head.weight"))
    return out


def transpose(data, shape, dtype):
    """A Conv1D weight [in, out] as [out, in] (GPT-2's, as the converter
    transposes it)."""
    import array
    a = array.array({"F32": "I", "F16": "H", "BF16": "H"}[dtype], data)
    n_in, n_out = shape
    cols = [a[o::n_out] for o in range(n_out)]
    return b"".join(c.tobytes() for c in cols), [n_out, n_in]


def plus_one(data):
    """An F32 norm weight w as 1 + w rounded once to f32 (Gemma's RMSNorm
    scale, which llama.cpp's converter stores)."""
    n = len(data) // 4
    return struct.pack("<%df" % n, *[1.0 + x for x in struct.unpack("<%df" % n, data)])


def arch_kvs(arch, cfg, header):
    """The {arch}.* hyperparameters llama.cpp reads."""
    a = arch
    if arch == "gpt2":
        n_embd = cfg.get("n_embd", 768)
        if cfg.get("activation_function", "gelu_new") != "gelu_new":
            raise SystemExit("st2gguf: gpt2 activation_function %r (gelu_new)" % cfg["activation_function"])
        pre = "transformer." if "transformer.wte.weight" in header else ""
        return [kv(a + ".block_count", T_U32, cfg.get("n_layer", 12)),
                kv(a + ".context_length", T_U32, header[pre + "wpe.weight"]["shape"][0]),
                kv(a + ".embedding_length", T_U32, n_embd),
                kv(a + ".feed_forward_length", T_U32, cfg.get("n_inner") or 4 * n_embd),
                kv(a + ".attention.head_count", T_U32, cfg.get("n_head", 12)),
                kv(a + ".attention.layer_norm_epsilon", T_F32, cfg.get("layer_norm_epsilon", 1e-5))]
    n_layers, n_head = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_head)
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // n_head
    rot = head_dim
    if arch == "phi3":
        rot = int(cfg.get("partial_rotary_factor", 1.0) * hidden) // n_head
    out = [kv(a + ".vocab_size", T_U32, cfg["vocab_size"]),
           kv(a + ".context_length", T_U32, cfg.get("max_position_embeddings", 2048)),
           kv(a + ".embedding_length", T_U32, hidden),
           kv(a + ".block_count", T_U32, n_layers),
           kv(a + ".feed_forward_length", T_U32, cfg["intermediate_size"]),
           kv(a + ".rope.dimension_count", T_U32, rot),
           kv(a + ".attention.head_count", T_U32, n_head),
           kv(a + ".attention.head_count_kv", T_U32, n_kv),
           kv(a + ".attention.layer_norm_rms_epsilon", T_F32, cfg.get("rms_norm_eps", 1e-6)),
           kv(a + ".rope.freq_base", T_F32, cfg.get("rope_theta", 10000.0))]
    if head_dim != hidden // n_head or arch in ("gemma2", "gemma3"):
        out += [kv(a + ".attention.key_length", T_U32, head_dim), kv(a + ".attention.value_length", T_U32, head_dim)]
    if arch in ("gemma2", "gemma3"):
        out += gemma_kvs(arch, cfg, n_layers, hidden, n_head, head_dim)
    if arch == "phi3":
        out.append(kv(a + ".rope.scaling.original_context_length", T_U32,
                      cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))))
        out.append(kv(a + ".attention.sliding_window", T_U32, cfg.get("sliding_window") or 0))
        rs = cfg.get("rope_scaling")
        if rs:
            scale = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
            orig = cfg["original_max_position_embeddings"]
            attn = rs.get("attention_factor") or (math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
            out.append(kv(a + ".rope.scaling.attn_factor", T_F32, attn))
    return out


def gemma_kvs(arch, cfg, n_layers, hidden, n_head, head_dim):
    a = arch
    big = n_layers == (46 if arch == "gemma2" else 62)
    want = hidden // n_head if big else head_dim
    if cfg.get("query_pre_attn_scalar", 256) != want:
        raise SystemExit("st2gguf: query_pre_attn_scalar %r: llama.cpp takes %d for this shape"
                         % (cfg.get("query_pre_attn_scalar"), want))
    if cfg.get("layer_types"):
        raise SystemExit("st2gguf: layer_types is not converted (llama.cpp derives the layers from a period)")
    out = [kv(a + ".attention.sliding_window", T_U32, cfg.get("sliding_window") or 4096)]
    if arch == "gemma2":
        caps = (cfg.get("attn_logit_softcapping", 50.0), cfg.get("final_logit_softcapping", 30.0))
        if None in caps:
            raise SystemExit("st2gguf: gemma2 without a soft cap (llama.cpp always caps)")
        out += [kv(a + ".attn_logit_softcapping", T_F32, caps[0]), kv(a + ".final_logit_softcapping", T_F32, caps[1])]
        return out
    if cfg.get("attn_logit_softcapping") is not None:
        raise SystemExit("st2gguf: gemma3 with attn_logit_softcapping (llama.cpp has none)")
    if cfg.get("final_logit_softcapping"):
        out.append(kv(a + ".final_logit_softcapping", T_F32, cfg["final_logit_softcapping"]))
    pattern = cfg.get("sliding_window_pattern", 6)
    if pattern != 6:
        out.append(kv(a + ".attention.sliding_window_pattern", T_U32, pattern))
    out.append(kv(a + ".rope.freq_base_swa", T_F32, cfg.get("rope_local_base_freq", 10000.0)))
    rs = cfg.get("rope_scaling")
    if rs:
        out += [kv(a + ".rope.scaling.type", T_STR, "linear"), kv(a + ".rope.scaling.factor", T_F32, rs["factor"])]
    return out


def rope_factor_tensors(arch, cfg):
    """Phi-3's longrope factors as the (name, F32 bytes) llama.cpp reads."""
    rs = cfg.get("rope_scaling")
    if arch != "phi3" or not rs:
        return []
    return [("rope_factors_long.weight", struct.pack("<%df" % len(rs["long_factor"]), *rs["long_factor"])),
            ("rope_factors_short.weight", struct.pack("<%df" % len(rs["short_factor"]), *rs["short_factor"]))]


def permute_rows(data, rows, row_bytes, n_head):
    """HF stores each head's rotary pairs as (first halves, second halves);
    llama.cpp's rope wants them interleaved: new row h*hd + 2i + j is old
    row h*hd + j*hd/2 + i."""
    hd = rows // n_head
    if hd * n_head != rows or hd % 2:
        raise SystemExit("st2gguf: %d rows do not split into %d heads of even size" % (rows, n_head))
    mv = memoryview(data)
    parts = []
    for h in range(n_head):
        for i in range(hd // 2):
            for j in range(2):
                r = h * hd + j * (hd // 2) + i
                parts.append(mv[r * row_bytes:(r + 1) * row_bytes])
    return b"".join(parts)


def to_f32(data, dtype):
    """A 1-D tensor as little-endian F32 (llama.cpp keeps norms in F32)."""
    if dtype == "F32":
        return bytes(data)
    n = len(data) // 2
    if dtype == "BF16":
        return struct.pack("<%dI" % n, *[u << 16 for u in struct.unpack("<%dH" % n, data)])
    return struct.pack("<%df" % n, *struct.unpack("<%de" % n, data))


def tokenizer_kvs(model_dir, vocab_size, cfg):
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    m = tj["model"]
    if m.get("type") != "BPE":
        raise SystemExit("st2gguf: only BPE tokenizers (tokenizer.json model BPE), not %r" % m.get("type"))
    tokens = [None] * vocab_size
    types = [TOK_NORMAL] * vocab_size
    for t, i in m["vocab"].items():
        if not 0 <= i < vocab_size:
            raise SystemExit("st2gguf: token id %d outside the vocabulary of %d" % (i, vocab_size))
        tokens[i] = t
    for a in tj.get("added_tokens", []):
        i = a["id"]
        if not 0 <= i < vocab_size:
            raise SystemExit("st2gguf: added token id %d outside the vocabulary of %d" % (i, vocab_size))
        tokens[i] = a["content"]
        types[i] = TOK_CONTROL if a.get("special") else TOK_USER
    for i, t in enumerate(tokens):
        if t is None:  # the embedding has rows no token names: llama.cpp wants every id named
            tokens[i] = "[PAD%d]" % i
            types[i] = TOK_CONTROL
    tc = {}
    p = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(p):
        with open(p, encoding="utf-8") as f:
            tc = json.load(f)
    if m.get("byte_fallback"):
        out = spm_kvs(tj, tokens, types)
    else:
        out = bpe_kvs(tj, tokens, types)
    ids = {"bos": cfg.get("bos_token_id")}
    if not cfg:  # --vocab-only: tokenizer_config.json names them
        text = {t: i for i, t in enumerate(tokens)}
        ids["bos"] = text.get(tc.get("bos_token"))
        cfg = {"eos_token_id": text.get(tc.get("eos_token"))}
    eos = cfg.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [eos]
    if len(eos) > 2:
        raise SystemExit("st2gguf: eos_token_id lists %d ids; GGUF holds an eos and an end-of-turn id" % len(eos))
    ids.update(zip(("eos", "eot"), eos))
    for key, v in ids.items():
        if isinstance(v, int) and 0 <= v < vocab_size:
            out.append(kv("tokenizer.ggml.%s_token_id" % key, T_U32, v))
    out.append(kv("tokenizer.ggml.add_bos_token", T_BOOL, bool(tc.get("add_bos_token", False))))
    if isinstance(tc.get("chat_template"), str):
        out.append(kv("tokenizer.chat_template", T_STR, tc["chat_template"]))
    return out


def spm_kvs(tj, tokens, types):
    """A SentencePiece-style tokenizer.json (byte_fallback, "▁" for spaces)
    as tokenizer.ggml.model "llama", as llama.cpp's converter writes
    tokenizer.model: every token with a score, the unknown token typed 2,
    <0xNN> typed 6 (bytes), added special tokens 3 (control).  The scores
    are what transformers' converter made the merges from: a token's score
    is minus the rank of the first merge that makes it (-1e9 for a token no
    merge makes), so the merges a loader rebuilds from the scores come in
    tokenizer.json's order."""
    m = tj["model"]
    norms = (tj.get("normalizer") or {}).get("normalizers", [])
    if not any(n.get("type") == "Replace" and n.get("content") == "\u2581" for n in norms):
        raise SystemExit("st2gguf: a byte_fallback tokenizer without SentencePiece's Replace(' ', '\u2581')")
    prefix = any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581" for n in norms)
    vocab = m.get("vocab", {})
    unk = vocab.get(m.get("unk_token"))
    made = {}
    for rank, x in enumerate(m.get("merges", [])):
        a, b = x.split(" ", 1) if isinstance(x, str) else x
        made.setdefault(vocab.get(a + b), rank)
    scores = []
    for i, t in enumerate(tokens):
        if i == unk:
            types[i] = TOK_UNKNOWN
        elif len(t) == 6 and t.startswith("<0x") and t.endswith(">") and types[i] == TOK_NORMAL:
            types[i] = TOK_BYTE
        scores.append(-float(made.get(i, 1e9)) if types[i] == TOK_NORMAL else 0.0)
    out = [kv("tokenizer.ggml.model", T_STR, "llama"),
           kv("tokenizer.ggml.tokens", T_ARR, (T_STR, tokens)),
           kv("tokenizer.ggml.scores", T_ARR, (T_F32, scores)),
           kv("tokenizer.ggml.token_type", T_ARR, (T_I32, types)),
           kv("tokenizer.ggml.add_space_prefix", T_BOOL, prefix)]
    if unk is not None:
        out.append(kv("tokenizer.ggml.unknown_token_id", T_U32, unk))
    return out


def bpe_kvs(tj, tokens, types):
    """A byte-level BPE tokenizer.json as tokenizer.ggml.model "gpt2"."""
    m = tj["model"]
    merges = [x if isinstance(x, str) else " ".join(x) for x in m.get("merges", [])]
    pre = tj.get("pre_tokenizer") or {}
    splits = [p for p in pre.get("pretokenizers", [pre]) if p.get("type") == "Split"]
    regex = splits[0]["pattern"].get("Regex") if len(splits) == 1 else None
    if regex not in PRE:
        raise SystemExit("st2gguf: the pre-tokenizer's split regex is none llama.cpp names (%s)" % sorted(PRE.values()))
    out = [kv("tokenizer.ggml.model", T_STR, "gpt2"),
           kv("tokenizer.ggml.pre", T_STR, PRE[regex]),
           kv("tokenizer.ggml.tokens", T_ARR, (T_STR, tokens)),
           kv("tokenizer.ggml.token_type", T_ARR, (T_I32, types)),
           kv("tokenizer.ggml.merges", T_ARR, (T_STR, merges))]
    return out


def block_bytes(out_type, data, dtype, shape, q6k_as_q8=False):
    """Q8_0, Q4_K or Q6_K blocks of a matrix, quantized by tools/torchref.py's
    quantizers; q6k_as_q8: the Q8_0 blocks of the matrix's Q6_K values."""
    import numpy as np
    from torchref import q4_k_quantize, q6_k_dequantize, q6_k_quantize, q8_0_quantize
    np_dtype = {"F32": np.float32, "F16": np.float16}.get(dtype)
    if np_dtype is None:  # bf16: the top half of an f32
        x = (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        x = np.frombuffer(data, np_dtype).astype(np.float32)
    x = x.reshape(shape)
    if q6k_as_q8:
        return q8_0_quantize(q6_k_dequantize(q6_k_quantize(x), shape)).tobytes()
    return {"Q4_K": q4_k_quantize, "Q6_K": q6_k_quantize, "Q8_0": q8_0_quantize}[out_type](x).tobytes()


def vocab_only(model_dir, out):
    """A GGUF of the tokenizer alone, as llama.cpp's --vocab-only writes."""
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    n = 1 + max(list(tj["model"]["vocab"].values()) + [a["id"] for a in tj.get("added_tokens", [])])
    kvs = [kv("general.architecture", T_STR, "llama"), kv("general.alignment", T_U32, ALIGN)]
    kvs += tokenizer_kvs(model_dir, n, {})
    head = GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, 0, len(kvs)) + b"".join(kvs)
    with open(out, "wb") as f:
        f.write(head + b"\0" * (-len(head) % ALIGN))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory (config.json, model.safetensors)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--type", choices=("auto", "q8_0", "q4_k", "q6_k"), default="auto",
                    help="auto: matrices as stored; q8_0: layer matrices as Q8_0; q4_k: as Q4_K (Q8_0 where "
                    "rows are not whole super-blocks)")
    ap.add_argument("--q8-embed", action="store_true", help="with --type q8_0: token_embd and output too")
    ap.add_argument("--q6k-as-q8", action="store_true",
                    help="with --type q6_k: the Q8_0 blocks of the Q6_K values (what kvtier loads a Q6_K file as)")
    ap.add_argument("--vocab-only", action="store_true",
                    help="only the tokenizer's metadata, from --model's tokenizer.json (no config or weights needed)")
    o = ap.parse_args(argv)
    if o.vocab_only:
        return vocab_only(o.model, o.out)
    with open(os.path.join(o.model, "config.json")) as f:
        cfg = json.load(f)
    arch = ARCH.get(cfg.get("model_type"))
    if not arch:
        raise SystemExit("st2gguf: model_type %r; only %s" % (cfg.get("model_type"), ", ".join(ARCH)))
    if cfg.get("model_type") == "mistral" and cfg.get("sliding_window"):
        raise SystemExit("st2gguf: mistral with a sliding window (llama.cpp's llama architecture has none)")
    rs = cfg.get("rope_scaling") or {}
    rs_type = rs.get("rope_type", rs.get("type"))
    if rs and not ((arch == "gemma3" and rs_type == "linear") or (arch == "phi3" and rs_type in ("longrope", "su"))):
        raise SystemExit("st2gguf: rope_scaling %r is not converted for %s" % (rs_type, arch))
    st = os.path.join(o.model, "model.safetensors")
    header, base = read_safetensors(st)
    n_layers = cfg["n_layer"] if arch == "gpt2" else cfg["num_hidden_layers"]
    tie = cfg.get("tie_word_embeddings", arch in ("gpt2", "gemma2", "gemma3")) or "lm_head.weight" not in header
    names = tensor_names(arch, n_layers, tie, header)
    missing = [h for _, h in names if h not in header]
    if missing:
        raise SystemExit("st2gguf: missing tensors: %s" % ", ".join(missing[:5]))
    dtypes = {header[h]["dtype"] for _, h in names if len(header[h]["shape"]) == 2}
    if len(dtypes) != 1 or not dtypes <= set(GGML):
        raise SystemExit("st2gguf: matrices in %s; one of F32, F16, BF16 expected" % sorted(dtypes))
    wtype = dtypes.pop()

    if o.q8_embed and o.type != "q8_0":
        raise SystemExit("st2gguf: --q8-embed goes with --type q8_0")
    if o.q6k_as_q8 and o.type != "q6_k":
        raise SystemExit("st2gguf: --q6k-as-q8 goes with --type q6_k")

    def quantized(g, cols):
        """The block type of matrix g under --type, or None."""
        if o.type == "auto":
            return None
        if g in ("token_embd.weight", "output.weight"):
            return "Q8_0" if o.q8_embed else None
        if not g.startswith("blk.") or g.split(".")[2] not in LAYER_MATS or not g.endswith(".weight"):
            return None
        if o.type in ("q4_k", "q6_k") and cols % 256 == 0:
            return "Q8_0" if o.q6k_as_q8 else o.type.upper()
        return "Q8_0"

    kvs = [kv("general.architecture", T_STR, arch),
           kv("general.name", T_STR, os.path.basename(os.path.normpath(o.model))),
           kv("general.file_type", T_U32, FILE_TYPE[o.type.upper() if o.type != "auto" else wtype]),
           kv("general.alignment", T_U32, ALIGN)]
    kvs += arch_kvs(arch, cfg, header)
    kvs += tokenizer_kvs(o.model, cfg["vocab_size"] if "vocab_size" in cfg else 50257, cfg)

    # tensor infos: ne[0] is the innermost (column) count
    conv1d = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
    infos, plan, off = [], [], 0
    for g, h, raw in [(g, h, None) for g, h in names] + [(g, None, d) for g, d in rope_factor_tensors(arch, cfg)]:
        t = header[h] if h else {"shape": [len(raw) // 4], "dtype": "F32"}
        shape = t["shape"]
        if arch == "gpt2" and h.endswith(conv1d):
            shape = shape[::-1]
        out_type = (quantized(g, shape[-1]) or wtype) if len(shape) == 2 else "F32"
        if out_type in BLOCKS:
            per, size = BLOCKS[out_type]
            if shape[-1] % per:
                raise SystemExit("st2gguf: %s: rows of %d are not whole %s blocks" % (h, shape[-1], out_type))
            nbytes = shape[0] * shape[1] // per * size
        else:
            nbytes = ELEM[out_type]
            for d in shape:
                nbytes *= d
        infos.append(s_str(g) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in reversed(shape))
                     + struct.pack("<IQ", GGML[out_type], off))
        plan.append((g, h, t, raw, out_type, nbytes, off))
        off += (nbytes + ALIGN - 1) // ALIGN * ALIGN

    head = GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    head += b"\0" * (-len(head) % ALIGN)
    tmp = o.out + ".tmp"
    with open(st, "rb") as src, open(tmp, "wb") as dst:
        dst.write(head)
        for g, h, t, raw, out_type, nbytes, toff in plan:
            if raw is not None:
                dst.write(raw)
                dst.write(b"\0" * (-nbytes % ALIGN))
                continue
            b0, b1 = t["data_offsets"]
            src.seek(base + b0)
            data = src.read(b1 - b0)
            if len(data) != b1 - b0:
                raise SystemExit("st2gguf: %s: short read" % h)
            shape = t["shape"]
            if arch == "llama" and g.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
                rows = t["shape"][0]
                row_bytes = (len(data) // rows)
                heads = cfg["num_attention_heads"] if ".attn_q." in g else cfg.get("num_key_value_heads",
                                                                                  cfg["num_attention_heads"])
                data = permute_rows(data, rows, row_bytes, heads)
            if arch == "gpt2" and h.endswith(conv1d):
                data, shape = transpose(data, shape, t["dtype"])
            if len(shape) == 1:
                data = to_f32(data, t["dtype"])
                if arch in ("gemma2", "gemma3") and g.endswith("norm.weight"):
                    data = plus_one(data)
            elif out_type in BLOCKS:
                data = block_bytes(out_type, data, t["dtype"], shape,
                                   o.q6k_as_q8 and o.type == "q6_k" and shape[-1] % 256 == 0)
            if len(data) != nbytes:
                raise SystemExit("st2gguf: %s: %d bytes, %d expected" % (h, len(data), nbytes))
            dst.write(data)
            dst.write(b"\0" * (-nbytes % ALIGN))
    os.replace(tmp, o.out)
    print("st2gguf: %s: %d tensors, %s matrices, %.2f GB" % (o.out, len(plan), wtype, (len(head) + off) / 1e9))


if __name__ == "__main__":
    sys.exit(main())
