#!/usr/bin/env python3
"""make_seeds.py - writes the hand-made seed inputs of the file-format
harnesses (config, safetensors, tokenizer, tokenize, chat) into
tests/fuzz/<harness>/seed.  Run from the repository root; libFuzzer grows
the corpus from these, and `-merge=1` keeps it small before committing."""
import json, os, struct, sys

def put(h, name, data):
    d = f"tests/fuzz/{h}/seed"
    os.makedirs(d, exist_ok=True)
    with open(f"{d}/{name}", "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())

# ---- config.json (+ NUL + generation_config.json) ---------------------------
builtin = open("model/builtin/config.json", "rb").read()
put("config", "builtin", builtin + b"\0" + open("model/builtin/generation_config.json", "rb").read())
base = json.loads(builtin)
def cfg(name, **kw):
    c = dict(base); c.update(kw)
    c = {k: v for k, v in c.items() if v is not None}
    put("config", name, json.dumps(c))
cfg("qwen2_window", architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64,
    max_window_layers=3, bos_token_id=None, eos_token_id=2045)
cfg("qwen3_types", architectures=["Qwen3ForCausalLM"], head_dim=None, use_sliding_window=True, sliding_window=32,
    layer_types=["full_attention", "sliding_attention"] * 3, attention_bias=True)
cfg("mistral", architectures=["MistralForCausalLM"], sliding_window=None, torch_dtype=None, dtype="bfloat16")
cfg("llama3_rope", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
cfg("rope_params", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}, torch_dtype="float16")
put("config", "mamba", json.dumps({"architectures": ["MambaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
    "num_hidden_layers": 2, "state_size": 4, "conv_kernel": 4, "time_step_rank": "auto", "torch_dtype": "float32",
    "eos_token_id": 0}))

put("config", "t5", json.dumps({"architectures": ["T5ForConditionalGeneration"], "vocab_size": 320, "d_model": 64,
    "num_heads": 4, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2,
    "relative_attention_num_buckets": 16, "relative_attention_max_distance": 12, "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6, "decoder_start_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32"}))
put("config", "bart", json.dumps({"architectures": ["BartForConditionalGeneration"], "vocab_size": 320, "d_model": 64,
    "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "max_position_embeddings": 128, "activation_function": "gelu",
    "scale_embedding": False, "decoder_start_token_id": 2, "eos_token_id": 2, "pad_token_id": 1,
    "torch_dtype": "float32"}))

# ---- safetensors (mode byte + file) -----------------------------------------
def safetensors(tensors, pad=True, dtype="F32"):
    size = {"F32": 4, "F16": 2, "BF16": 2}[dtype]
    hdr, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        n = size
        for d in shape: n *= d
        hdr[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(hdr, separators=(",", ":")).encode()
    while pad and len(h) % 8: h += b" "
    one = struct.pack("<f", 0.5) if size == 4 else (b"\x00\x38" if dtype == "F16" else b"\x00\x3f")
    return struct.pack("<Q", len(h)) + h + one * (off // size)
L = "model.layers.0."
llama = [("model.embed_tokens.weight", (4, 2))] + [(L + "self_attn.%s_proj.weight" % p, (2, 2)) for p in "qkvo"] + \
    [(L + "mlp.%s_proj.weight" % p, (2, 2)) for p in ("gate", "up", "down")] + \
    [(L + "input_layernorm.weight", (2,)), (L + "post_attention_layernorm.weight", (2,)), ("model.norm.weight", (2,))]
put("safetensors", "llama_f32", b"\x00" + safetensors(llama))
put("safetensors", "llama_unaligned", b"\x00" + safetensors(llama, pad=False))
qwen = llama + [(L + "self_attn.%s_proj.bias" % p, (2,)) for p in "qkv"] + [("lm_head.weight", (4, 2))]
put("safetensors", "qwen2_f16", b"\x01" + safetensors(qwen, dtype="F16"))
put("safetensors", "bad_overlap", b"\x00" + safetensors([("a", (2,)), ("b", (2,))]).replace(b'"data_offsets":[8,16]', b'"data_offsets":[4,12]'))
wm = {n: "model-00001-of-00002.safetensors" for n, _ in llama[:5]}
wm.update({n: "model-00002-of-00002.safetensors" for n, _ in llama[5:]})
put("safetensors", "index", b"\x02" + json.dumps({"metadata": {"total_size": 160}, "weight_map": wm}).encode())

# ---- tokenizer.json (+ NUL + tokenizer_config.json) -------------------------
for d, name in (("model/builtin", "byte_level"), ("tests/fuzz/tokenize/sp", "sentencepiece")):
    put("tokenizer", name, open(f"{d}/tokenizer.json", "rb").read() + b"\0" + open(f"{d}/tokenizer_config.json", "rb").read())
small = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "<0x41>": 3}, "merges": [["a", "b"]],
         "byte_fallback": True, "ignore_merges": True},
         "added_tokens": [{"id": 5, "content": "<x>", "special": True, "lstrip": True, "rstrip": True}],
         "normalizer": {"type": "NFC"},
         "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
         "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"}}
put("tokenizer", "small_metaspace", json.dumps(small))
splits = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, " ": 2, "ab": 3, "a ": 4, " b": 5}, "merges": [["a", "b"]]},
          "normalizer": {"type": "Replace", "pattern": {"String": "x"}, "content": " "},
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
              {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
              {"type": "Split", "pattern": {"Regex": "b+"}, "behavior": "MergedWithNext", "invert": True},
              {"type": "Split", "pattern": {"Regex": "\\s"}, "behavior": "Contiguous", "invert": False},
              {"type": "Split", "pattern": {"String": "ab"}, "behavior": "Removed", "invert": True}]}}
put("tokenizer", "splits", json.dumps(splits))

# ---- tokenize: mode byte + text, or + 16-bit ids ----------------------------
put("tokenize", "bl_text", b"\x00Hello world, <|im_start|>user\n caf\xc3\xa9 \xf0\x9f\x98\x80 123  \t\n")
put("tokenize", "bl_special", b"\x04<|begin_of_text|>x<|im_end|>")
put("tokenize", "bl_invalid", b"\x00ok \xc3\x28 \xed\xa0\x80 \xf4\x90\x80\x80")
put("tokenize", "sp_text", b"\x01 the cab \xc3\xa9\xf0\x9f\x98\x80  x")
put("tokenize", "sp_special", b"\x05<s>a</s>\xe2\x96\x81b")
put("tokenize", "bl_ids", b"\x02" + struct.pack("<8H", 1, 200, 2044, 2046, 150, 151, 2047, 5))
put("tokenize", "sp_ids", b"\x07" + struct.pack("<8H", 1, 0xC3 + 3, 0xA9 + 3, 0xF0 + 3, 259, 260, 0xFFFF, 2))

# ---- chat: template NUL (role byte + content NUL)* -------------------------
conv = b"\x00You are terse.\0\x01  Hi there \0\x02Hello!\0\x01What now?"
for name, tpl in (("chatml", "{{ bos_token }}<|im_start|>system\\nYou are Qwen.<|im_end|> {% if messages[0]['role'] != 'system' %}"),
                  ("llama2", "{{ bos_token }}[INST] <<SYS>>"), ("mistral", "[INST] {{ m }} [/INST]"),
                  ("llama3", "<|start_header_id|>{{ role }}<|end_header_id|>"), ("zephyr", "<|user|> <|assistant|> bos_token"),
                  ("qwen3", "<|im_start|><think>"), ("llama31", "<|start_header_id|>Cutting Knowledge")):
    put("chat", name, tpl.encode() + b"\0" + conv)
put("chat", "mistral_alternating", b"[INST]\0\x01q1\0\x02a1\0\x01q2")

# ---- diskhdr: mode byte + file size (u64 LE) + header and chunk table --------
# From real disk-tier files named on the command line (files a test or
# kvtier-bench-disk wrote, e.g. under a kept test directory); the header's
# length is the u32 at offset 12.  Mode 0: as written; mode 1: the harness
# recomputes the checksum, so mutations get past it.
for path in sys.argv[1:]:
    raw = open(path, "rb").read()
    hdr = raw[:struct.unpack_from("<I", raw, 12)[0]]
    base = os.path.basename(path).replace(".kvt", "")
    for mode in (0, 1):
        put("diskhdr", f"{base}_m{mode}", bytes([mode]) + struct.pack("<Q", len(raw)) + hdr)

# ---- gguf: a GGUF file ---------------------------------------------------------
# tools/st2gguf.py's writer on a two-layer llama of 64 wide with a 300-token
# byte-level vocabulary (f32, then Q8_0 layer matrices), and the same
# vocabulary alone (--vocab-only).
sys.path.insert(0, "tools")
import st2gguf  # noqa: E402
def gguf_seed(q8):
    L, dim, ffn, heads, n_tok = 1, 32, 32, 2, 300
    b2u = {}
    n = 0
    for b in range(256):
        if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255:
            b2u[b] = chr(b)
        else:
            b2u[b] = chr(256 + n); n += 1
    toks = [b2u[b] for b in range(256)] + ["te"] + ["t%d" % i for i in range(n_tok - 257)]
    kvs = [st2gguf.kv("general.architecture", st2gguf.T_STR, "llama"),
           st2gguf.kv("llama.embedding_length", st2gguf.T_U32, dim),
           st2gguf.kv("llama.feed_forward_length", st2gguf.T_U32, ffn),
           st2gguf.kv("llama.block_count", st2gguf.T_U32, L),
           st2gguf.kv("llama.attention.head_count", st2gguf.T_U32, heads),
           st2gguf.kv("llama.context_length", st2gguf.T_U32, 64),
           st2gguf.kv("llama.attention.layer_norm_rms_epsilon", st2gguf.T_F32, 1e-5),
           st2gguf.kv("tokenizer.ggml.model", st2gguf.T_STR, "gpt2"),
           st2gguf.kv("tokenizer.ggml.pre", st2gguf.T_STR, "gpt-2"),
           st2gguf.kv("tokenizer.ggml.tokens", st2gguf.T_ARR, (st2gguf.T_STR, toks)),
           st2gguf.kv("tokenizer.ggml.merges", st2gguf.T_ARR, (st2gguf.T_STR, ["t e"]))]
    mats = [("token_embd.weight", n_tok, dim)] + [("blk.0.%s.weight" % g, r, c) for g, r, c in (
        ("attn_q", dim, dim), ("attn_k", dim, dim), ("attn_v", dim, dim), ("attn_output", dim, dim),
        ("ffn_gate", ffn, dim), ("ffn_up", ffn, dim), ("ffn_down", dim, ffn))]
    vecs = [("blk.0.attn_norm.weight", dim), ("blk.0.ffn_norm.weight", dim), ("output_norm.weight", dim)]
    infos, data, off = b"", b"", 0
    for name, r, c in mats + [(v, 0, d) for v, d in vecs]:
        q = q8 and r and name.startswith("blk")
        t, nb = (8, r * c // 32 * 34) if q else (0, 4 * (r or 1) * c)
        dims = [c, r] if r else [c]
        infos += st2gguf.s_str(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", t, off)
        blob = (struct.pack("<e", 0.01) + bytes(range(32))) * (nb // 34) if q else struct.pack("<f", 0.5) * (nb // 4)
        data += blob + b"\0" * (-len(blob) % 32)
        off += len(blob) + (-len(blob) % 32)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(mats) + len(vecs), len(kvs)) + b"".join(kvs) + infos
    return head + b"\0" * (-len(head) % 32) + data
put("gguf", "llama_f32", gguf_seed(False))
put("gguf", "llama_q8_0", gguf_seed(True))
