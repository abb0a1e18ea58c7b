#!/usr/bin/python3
"""mkmodel - write a random-weight Hugging Face model directory.

    /usr/bin/python3 tools/mkmodel.py --arch llama --preset tiny --dtype bf16 --out DIR
    /usr/bin/python3 tools/mkmodel.py --preset tinyllama-1.1b --dtype bf16 --shards 2 --out DIR

Writes config.json, generation_config.json, model.safetensors (or shards +
model.safetensors.index.json), tokenizer.json and tokenizer_config.json.

Tensors are streamed (each shard's header first, then each tensor in
row chunks), so realistic shapes never sit in memory.  Each tensor draws from
its own generator seeded by (--seed, tensor index), so --shards does not
change the weights.  The tensor names and shapes come from torchref (the
HF layout); the initialisation keeps every sublayer's output at unit scale so
a random model has spread logits (greedy decoding is not a sea of ties):
  2-D weights [out, in]   N(0, 1/in)
  embed_tokens            N(0, 1); tied: N(0, 9/dim), as lm_head
  lm_head                 N(0, 9/dim)  -> logits with std ~3
  norm weights            1 + N(0, 0.1^2)  (not all ones, so a missed norm shows;
                          Gemma stores the offset from 1: N(0, 0.1^2))
  biases                  N(0, 0.5^2)
Mamba's own tensors keep its scan in the range trained models work in:
  A_log                   log(1..state_size) + N(0, 0.1^2)  (S4D-real, as HF initialises it)
  D                       1 + N(0, 0.1^2)
  dt_proj.bias            -2.5 + N(0, 0.5^2)  (softplus: dt around 0.08)
  conv1d.weight           N(0, 1/conv_kernel)
"""
import argparse
import collections
import json
import math
import os
import re
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchref  # noqa: E402
from bytelevel import bytes_to_unicode  # noqa: E402

ARCH_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
              "gpt2": "GPT2LMHeadModel", "mamba": "MambaForCausalLM", "t5": "T5ForConditionalGeneration",
              "bart": "BartForConditionalGeneration"}

# Shapes of public checkpoints (benchmarks) and a tiny default (tests).
PRESETS = {
    "tiny": dict(layers=2, dim=64, heads=4, kv_heads=2, ffn=176, vocab=384, max_pos=2048, theta=10000.0),
    "smollm-135m": dict(arch="llama", layers=30, dim=576, heads=9, kv_heads=3, ffn=1536, vocab=49152,
                        max_pos=2048, theta=10000.0, tie=True, eps=1e-5),
    "tinyllama-1.1b": dict(arch="llama", layers=22, dim=2048, heads=32, kv_heads=4, ffn=5632, vocab=32000,
                           max_pos=2048, theta=10000.0, eps=1e-5),
    "llama3.2-1b": dict(arch="llama", layers=16, dim=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256,
                        max_pos=131072, theta=500000.0, tie=True, eps=1e-5, rope_scaling="llama3:32:8192"),
    "llama3-8b": dict(arch="llama", layers=32, dim=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                      max_pos=8192, theta=500000.0, eps=1e-5),
    "mistral-7b": dict(arch="mistral", layers=32, dim=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
                       max_pos=32768, theta=10000.0, eps=1e-5, window=4096),
    "qwen2-0.5b": dict(arch="qwen2", layers=24, dim=896, heads=14, kv_heads=2, ffn=4864, vocab=151936,
                       max_pos=32768, theta=1000000.0, tie=True),
    "qwen3-0.6b": dict(arch="qwen3", layers=28, dim=1024, heads=16, kv_heads=8, head_dim=128, ffn=3072,
                       vocab=151936, max_pos=40960, theta=1000000.0, tie=True),
    "gemma2-2b": dict(arch="gemma2", layers=26, dim=2304, heads=8, kv_heads=4, head_dim=256, ffn=9216,
                      vocab=256000, max_pos=8192, theta=10000.0, tie=True, window=4096, qpas=256,
                      attn_softcap=50.0, final_softcap=30.0),
    "gemma3-1b": dict(arch="gemma3", layers=26, dim=1152, heads=4, kv_heads=1, head_dim=256, ffn=6912,
                      vocab=262144, max_pos=32768, theta=1000000.0, tie=True, window=512, qpas=256,
                      window_pattern=6),
    "phi3-mini": dict(arch="phi3", layers=32, dim=3072, heads=32, kv_heads=32, ffn=8192, vocab=32064,
                      max_pos=4096, theta=10000.0, eps=1e-5, window=2047),
    "gpt2": dict(arch="gpt2", layers=12, dim=768, heads=12, kv_heads=12, ffn=3072, vocab=50257, max_pos=1024),
    "mamba-130m": dict(arch="mamba", layers=24, dim=768, vocab=50280, state=16, conv_kernel=4, expand=2,
                       tie=True, eps=1e-5),
}

ST_DTYPE = {"f32": ("F32", torch.float32, "float32"), "bf16": ("BF16", torch.bfloat16, "bfloat16"),
            "f16": ("F16", torch.float16, "float16")}

# ---------------------------------------------------------------------------
# Tokenizer: byte-level BPE in the Llama-3 layout (Split regex + ByteLevel),
# merges learned from this text.
# ---------------------------------------------------------------------------
CORPUS = """\
The cache keeps the keys and values of every token the model has already
seen, so that each new token costs one pass over the weights instead of a
pass over the whole prompt.  When memory runs short, the oldest blocks move
to a slower tier: first host memory, then a file on disk, and the model
reads them back when a request needs them again.  A request that shares a
prefix with an earlier one starts where that one left off.

def forward(tokens, cache):
    for layer in range(n_layers):
        x = attention(norm(x), cache[layer]) + x
        x = feed_forward(norm(x)) + x
    return logits(norm(x))

int main(int argc, char **argv) {
    for (int i = 0; i < argc; i++)
        printf("%d: %s\\n", i, argv[i]);
    return 0;
}

Numbers such as 3.14159, 2048, 65536 and 1,000,000 appear in the text, and
so do dates like 2024-06-01 and times like 12:30.  Some words are written in
other languages: the café in München serves crème brûlée; 東京 and 北京 are
cities; привет means hello; emoji such as 🙂 and 🚀 take four bytes each.
"Why," she asked, "does the window slide?"  Because the model only looks
back a fixed number of tokens, and everything older can be dropped.
"""

SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# The same split for learning, in Python's re dialect (\p{L} ~ [^\W\d_]).
_LEARN_SPLIT = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d|[^\r\n\w]?[^\W\d_]+|\d{1,3}| ?[^\s\w]+[\r\n]*|"
                          r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]


def learn_merges(n_merges):
    """Classic BPE training on CORPUS: repeatedly merge the most frequent
    adjacent pair (ties broken by first appearance, so it is deterministic)."""
    b2u = bytes_to_unicode()
    words = collections.Counter(
        tuple(b2u[b] for b in piece.encode()) for piece in _LEARN_SPLIT.findall(CORPUS))
    words = {w: c for w, c in words.items()}
    merges = []
    while len(merges) < n_merges:
        pairs = collections.Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: kv[1])[0]  # first max in insertion order
        merges.append(best)
        joined = best[0] + best[1]
        new = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(joined)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] = new.get(tuple(out), 0) + c
        words = new
    return merges


def build_tokenizer(vocab_size, max_learned=2000):
    """(tokenizer.json dict, tokenizer_config.json dict, bos id, eos id).
    Ids: 256 byte tokens, learned merges, then unreachable filler tokens up
    to vocab_size - 2, then the two specials (as Llama 3 places them)."""
    n_regular = vocab_size - len(SPECIALS)
    if n_regular < 256:
        raise SystemExit(f"mkmodel: --vocab {vocab_size} too small for a byte-level tokenizer (>= 258)")
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    merges = []
    for a, b in learn_merges(min(n_regular - 256, max_learned)):
        vocab[a + b] = len(vocab)
        merges.append(f"{a} {b}")
    # Large vocabularies (benchmark shapes) are padded with tokens no merge
    # produces; all their characters are printable ASCII, so they decode to
    # themselves.
    while len(vocab) < n_regular:
        vocab[f"<filler_{len(vocab)}>"] = len(vocab)
    added = [{"id": n_regular + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(SPECIALS)]
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT_REGEX}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
    }
    tcfg = {
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                  "single_word", "special")} for a in added},
        "bos_token": SPECIALS[0], "eos_token": SPECIALS[1], "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 1000000, "tokenizer_class": "PreTrainedTokenizerFast",
    }
    return tok, tcfg, n_regular, n_regular + 1


def tokenizer_from(src, vocab_size):
    """Reads an existing tokenizer; returns (tok, tcfg, bos, eos) after
    checking every id fits the model's vocabulary."""
    with open(os.path.join(src, "tokenizer.json")) as f:
        tok = json.load(f)
    with open(os.path.join(src, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    v = tok["model"]["vocab"]
    ids.update(v if isinstance(v, dict) else {p[0]: i for i, p in enumerate(v)})  # BPE dict / Unigram list
    top = max(ids.values())
    if top >= vocab_size:
        raise SystemExit(f"mkmodel: {src}/tokenizer.json has id {top}, past --vocab {vocab_size}")

    def tok_id(field):
        t = tcfg.get(field)
        t = t.get("content") if isinstance(t, dict) else t
        return ids.get(t) if t is not None else None
    return tok, tcfg, tok_id("bos_token"), tok_id("eos_token")


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------
def parse_rope_scaling(spec, rot_dim=None):
    """linear:F | llama3:F[:ORIG_MAX_POS] | longrope -> the HF rope_scaling
    dict.  longrope's factors (rot_dim / 2 of each) are a fixed ramp, short
    ones from 1 to 1.5 and long ones from 1 to 8."""
    kind, *nums = spec.split(":")
    if kind == "longrope" and not nums:
        n = rot_dim // 2
        return {"type": "longrope", "short_factor": [1.0 + 0.5 * i / max(n - 1, 1) for i in range(n)],
                "long_factor": [1.0 + 7.0 * i / max(n - 1, 1) for i in range(n)]}
    if kind == "linear" and len(nums) == 1:
        return {"rope_type": "linear", "factor": float(nums[0])}
    if kind == "llama3" and len(nums) in (1, 2):
        orig = int(nums[1]) if len(nums) == 2 else 8192
        return {"rope_type": "llama3", "factor": float(nums[0]), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": orig}
    raise SystemExit(f"mkmodel: bad --rope-scaling {spec!r} (linear:F, llama3:F[:ORIG] or longrope)")


def gpt2_config(o, bos, eos):
    """GPT2Config's names; n_inner only when not 4 * n_embd."""
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": o.vocab, "n_embd": o.dim,
           "n_layer": o.layers, "n_head": o.heads, "n_positions": o.max_pos, "n_ctx": o.max_pos,
           "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
           "tie_word_embeddings": True, "bos_token_id": bos, "eos_token_id": eos, "use_cache": True,
           "torch_dtype": ST_DTYPE[o.dtype][2], "transformers_version": "4.45.0"}
    if o.ffn != 4 * o.dim:
        cfg["n_inner"] = o.ffn
    return cfg


def mamba_config(o, bos, eos):
    """MambaConfig as transformers writes it (time_step_rank resolved from
    "auto", intermediate_size = expand * hidden_size)."""
    return {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "vocab_size": o.vocab,
            "hidden_size": o.dim, "state_size": o.state, "num_hidden_layers": o.layers,
            "layer_norm_epsilon": o.eps, "pad_token_id": eos, "bos_token_id": bos, "eos_token_id": eos,
            "expand": o.expand, "conv_kernel": o.conv_kernel, "use_bias": False, "use_conv_bias": True,
            "hidden_act": "silu", "initializer_range": 0.1, "residual_in_fp32": True,
            "time_step_rank": math.ceil(o.dim / 16), "time_step_scale": 1.0, "time_step_min": 0.001,
            "time_step_max": 0.1, "time_step_init_scheme": "random", "time_step_floor": 0.0001,
            "rescale_prenorm_residual": False, "use_cache": True, "use_mambapy": False,
            "intermediate_size": int(o.expand * o.dim), "tie_word_embeddings": bool(o.tie),
            "torch_dtype": ST_DTYPE[o.dtype][2], "transformers_version": "4.45.0"}


def encdec_config(o, bos, eos):
    """T5Config / BartConfig as transformers writes them.  --layers is both
    stacks' depth (T5: --dec-layers may differ), --head-dim T5's d_kv;
    --ffn-kind picks T5's feed_forward_proj (relu or gated-gelu)."""
    common = {"architectures": [ARCH_CLASS[o.arch]], "model_type": o.arch, "vocab_size": o.vocab,
              "d_model": o.dim, "is_encoder_decoder": True, "use_cache": True,
              "tie_word_embeddings": bool(o.tie), "torch_dtype": ST_DTYPE[o.dtype][2],
              "transformers_version": "4.45.0"}
    if o.arch == "t5":
        gated = o.ffn_kind == "gated-gelu"
        return {**common, "d_kv": o.head_dim or o.dim // o.heads, "d_ff": o.ffn, "num_layers": o.layers,
                "num_decoder_layers": o.dec_layers or o.layers, "num_heads": o.heads,
                "relative_attention_num_buckets": o.buckets, "relative_attention_max_distance": o.max_distance,
                "dropout_rate": 0.1, "layer_norm_epsilon": o.eps, "initializer_factor": 1.0,
                "feed_forward_proj": o.ffn_kind, "dense_act_fn": "gelu_new" if gated else "relu",
                "is_gated_act": gated, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}
    return {**common, "encoder_layers": o.layers, "decoder_layers": o.dec_layers or o.layers,
            "encoder_attention_heads": o.heads, "decoder_attention_heads": o.heads,
            "encoder_ffn_dim": o.ffn, "decoder_ffn_dim": o.ffn, "activation_function": "gelu",
            "max_position_embeddings": o.max_pos, "scale_embedding": bool(o.scale_embedding),
            "normalize_before": False, "add_final_layer_norm": False, "init_std": 0.02,
            "dropout": 0.1, "attention_dropout": 0.0, "activation_dropout": 0.0,
            "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos, "decoder_start_token_id": eos,
            "forced_eos_token_id": eos}


def make_config(o, bos, eos):
    if o.arch == "gpt2":
        return gpt2_config(o, bos, eos)
    if o.arch == "mamba":
        return mamba_config(o, bos, eos)
    if o.arch in ("t5", "bart"):
        return encdec_config(o, bos, eos)
    arch = ARCH_CLASS[o.arch]
    head_dim = o.head_dim or o.dim // o.heads
    if o.dim % o.heads and not o.head_dim:
        raise SystemExit("mkmodel: --dim must be a multiple of --heads (or give --head-dim)")
    if o.heads % o.kv_heads:
        raise SystemExit("mkmodel: --heads must be a multiple of --kv-heads")
    cfg = {
        "architectures": [arch], "model_type": o.arch,
        "vocab_size": o.vocab, "hidden_size": o.dim, "intermediate_size": o.ffn,
        "num_hidden_layers": o.layers, "num_attention_heads": o.heads, "num_key_value_heads": o.kv_heads,
        "hidden_act": "silu", "max_position_embeddings": o.max_pos, "rms_norm_eps": o.eps,
        "rope_theta": o.theta,
        "rope_scaling": parse_rope_scaling(o.rope_scaling, int(head_dim * (o.partial_rotary or 1.0)))
        if o.rope_scaling else None,
        "tie_word_embeddings": bool(o.tie), "attention_dropout": 0.0, "initializer_range": 0.02,
        "bos_token_id": bos, "eos_token_id": eos, "use_cache": True,
        "torch_dtype": ST_DTYPE[o.dtype][2], "transformers_version": "4.45.0",
    }
    # head_dim is written when it is not the derived one, and always for
    # Qwen3 (whose HF default is 128, not dim/heads).
    if o.head_dim or o.arch == "qwen3":
        cfg["head_dim"] = head_dim
    if o.arch in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if o.arch == "llama":
        cfg["mlp_bias"] = False
    if o.arch == "mistral":
        cfg["sliding_window"] = o.window or None
    if o.arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = bool(o.window)
        cfg["sliding_window"] = o.window or None
        cfg["max_window_layers"] = o.max_window_layers if o.window else o.layers
    if o.arch in ("gemma2", "gemma3"):
        # Gemma: every layer kind needs the window; no layer_types, so the
        # config class's own pattern decides which layers slide
        if not o.window:
            raise SystemExit("mkmodel: gemma needs --window")
        del cfg["hidden_act"]
        cfg.update(hidden_activation="gelu_pytorch_tanh", sliding_window=o.window, attention_bias=False,
                   query_pre_attn_scalar=o.qpas or head_dim, head_dim=head_dim,
                   attn_logit_softcapping=o.attn_softcap, final_logit_softcapping=o.final_softcap)
    if o.arch == "phi3":
        # every layer slides when sliding_window is set (Phi3Config: None)
        cfg.update(sliding_window=o.window or None, partial_rotary_factor=o.partial_rotary or 1.0,
                   original_max_position_embeddings=o.orig_max_pos or o.max_pos)
    if o.arch == "gemma3":
        cfg.update(sliding_window_pattern=o.window_pattern or 6, rope_local_base_freq=o.local_theta or 10000.0)
    return cfg


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------
CHUNK = 1 << 22  # elements generated per step: bounds memory for any shape


def init_kind(name, shape, cfg):
    """(mean, std) of a tensor by its role (see the module docstring)."""
    gpt2 = cfg["architectures"][0] == "GPT2LMHeadModel"
    if cfg["architectures"][0] == "MambaForCausalLM":
        return mamba_init(name, shape, cfg)
    if cfg.get("is_encoder_decoder"):
        return encdec_init(name, shape, cfg)
    if name.endswith("norm.weight") or (gpt2 and ".ln_" in name and name.endswith(".weight")):
        return (0.0 if cfg["architectures"][0].startswith("Gemma") else 1.0), 0.1
    if name.endswith(".bias"):
        return 0.0, 0.5
    head_std = 3.0 / math.sqrt(cfg["n_embd"] if gpt2 else cfg["hidden_size"])  # final-normed h has unit RMS
    if gpt2:  # tied wte is the head; Conv1D weights are [in, out]
        return 0.0, head_std if name.endswith(("wte.weight", "wpe.weight")) else 1.0 / math.sqrt(shape[0])
    if name == "model.embed_tokens.weight":
        return 0.0, head_std if cfg["tie_word_embeddings"] else 1.0
    if name == "lm_head.weight":
        return 0.0, head_std
    return 0.0, 1.0 / math.sqrt(shape[-1])


def mamba_init(name, shape, cfg):
    """(mean, std) of a Mamba tensor; A_log's mean is per column (a tensor)."""
    if name.endswith(("norm.weight", "norm_f.weight", ".D")):
        return 1.0, 0.1
    if name.endswith(".A_log"):
        return torch.log(torch.arange(1, shape[1] + 1, dtype=torch.float32)).repeat(shape[0]), 0.1
    if name.endswith("dt_proj.bias"):
        return -2.5, 0.5
    if name.endswith(".bias"):
        return 0.0, 0.5
    head_std = 3.0 / math.sqrt(cfg["hidden_size"])
    if name == "backbone.embeddings.weight":
        return 0.0, head_std if cfg["tie_word_embeddings"] else 1.0
    if name == "lm_head.weight":
        return 0.0, head_std
    return 0.0, 1.0 / math.sqrt(shape[-1])  # conv1d [inner, 1, kernel]: 1/kernel


def encdec_init(name, shape, cfg):
    """T5 / BART: as above; a tied T5 head multiplies by d_model^-0.5, so its
    shared embeddings have std 1 (its greedy tokens repeat: tests read its logits); T5's relative biases N(0, 1) and BART's
    final_logits_bias N(0, 0.5^2), so that a miss of either shows; BART's
    other biases N(0, 0.1^2) and the cross-attention output N(0, 0.04/in):
    both add nearly the same vector at every step (the encoder output does
    not change), and at full scale greedy decoding repeats one token."""
    d = cfg["d_model"]
    t5 = cfg["model_type"] == "t5"
    if name.endswith("norm.weight") or name.endswith("layernorm_embedding.weight"):
        return 1.0, 0.1
    if name.endswith(".bias"):
        return 0.0, 0.1
    if name == "final_logits_bias":
        return 0.0, 0.5
    if name.endswith("relative_attention_bias.weight"):
        return 0.0, 1.0
    if name.endswith("shared.weight"):
        if not cfg["tie_word_embeddings"]:
            return 0.0, 1.0
        return 0.0, 1.0 if t5 else 3.0 / math.sqrt(d)
    if name == "lm_head.weight":
        return 0.0, 3.0 / math.sqrt(d)
    if name.endswith("embed_positions.weight"):
        return 0.0, 1.0
    if name.endswith(("EncDecAttention.o.weight", "encoder_attn.out_proj.weight")):
        return 0.0, 0.2 / math.sqrt(shape[-1])
    return 0.0, 1.0 / math.sqrt(shape[-1])


def write_tensor(f, name, shape, idx, o, cfg):
    """Streams one tensor: rows in chunks of ~CHUNK elements."""
    mean, std = init_kind(name, shape, cfg)
    gen = torch.Generator().manual_seed(o.seed * 1000003 + idx)
    dt = ST_DTYPE[o.dtype][1]
    row = int(math.prod(shape[1:]))
    rows_per = max(1, CHUNK // max(row, 1))
    for r0 in range(0, shape[0], rows_per):
        n = min(rows_per, shape[0] - r0) * row
        m = mean[r0 * row:r0 * row + n] if torch.is_tensor(mean) else mean
        x = torch.randn(n, generator=gen).mul_(std).add_(m)
        f.write(torchref.tensor_bytes(x.to(dt)))  # .to(bf16) rounds to nearest even


def write_weights(out, cfg, o):
    shapes = torchref.param_shapes(cfg)
    st = ST_DTYPE[o.dtype][0]
    size = {n: torchref.ST_ITEMSIZE[st] * math.prod(s) for n, s in shapes}
    total = sum(size.values())
    # Greedy split into --shards files of about total/shards bytes each.
    groups, acc = [[]], 0
    for n, s in shapes:
        if groups[-1] and acc >= total * len(groups) / o.shards and len(groups) < o.shards:
            groups.append([])
        groups[-1].append((n, s))
        acc += size[n]
    if len(groups) < o.shards:
        raise SystemExit(f"mkmodel: {len(shapes)} tensors cannot fill {o.shards} shards")
    index = {n: i for i, (n, _) in enumerate(shapes)}
    names = ["model.safetensors"] if o.shards == 1 else \
        [f"model-{i + 1:05d}-of-{o.shards:05d}.safetensors" for i in range(o.shards)]
    for fn, group in zip(names, groups):
        head, _ = torchref.safetensors_header([(n, st, s) for n, s in group], {"format": "pt"})
        with open(os.path.join(out, fn), "wb") as f:
            f.write(head)
            for n, s in group:
                write_tensor(f, n, s, index[n], o, cfg)
    if o.shards > 1:
        wm = {n: fn for fn, group in zip(names, groups) for n, _ in group}
        dump_json(os.path.join(out, "model.safetensors.index.json"),
                  {"metadata": {"total_size": total}, "weight_map": wm})


def dump_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory to write (created)")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--arch", choices=sorted(ARCH_CLASS), help="default: the preset's, else llama")
    ap.add_argument("--dtype", default="f32", choices=sorted(ST_DTYPE))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--dim", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--ffn", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--max-pos", type=int)
    ap.add_argument("--theta", "--rope-theta", type=float)
    ap.add_argument("--eps", type=float)
    ap.add_argument("--window", type=int, help="sliding window (mistral: every layer; qwen2/3: "
                                               "use_sliding_window, layers >= --max-window-layers)")
    ap.add_argument("--max-window-layers", type=int, default=0)
    ap.add_argument("--window-pattern", type=int, help="gemma3: sliding_window_pattern (every Nth layer global)")
    ap.add_argument("--qpas", type=float, help="gemma: query_pre_attn_scalar (default head_dim)")
    ap.add_argument("--attn-softcap", type=float, help="gemma: attn_logit_softcapping (default none)")
    ap.add_argument("--final-softcap", type=float, help="gemma: final_logit_softcapping (default none)")
    ap.add_argument("--local-theta", type=float, help="gemma3: rope_local_base_freq (default 10000)")
    ap.add_argument("--partial-rotary", type=float, help="phi3: partial_rotary_factor (default 1)")
    ap.add_argument("--orig-max-pos", type=int, help="phi3: original_max_position_embeddings (default --max-pos)")
    ap.add_argument("--state", type=int, help="mamba: state_size (default 16)")
    ap.add_argument("--conv-kernel", type=int, help="mamba: conv_kernel (default 4)")
    ap.add_argument("--expand", type=int, help="mamba: expand (default 2)")
    ap.add_argument("--tie", action="store_true", default=None, help="tie_word_embeddings")
    ap.add_argument("--no-tie", dest="tie", action="store_false")
    ap.add_argument("--rope-scaling", help="linear:F, llama3:F[:ORIG_MAX_POS] or longrope (phi3)")
    ap.add_argument("--dec-layers", type=int, help="t5, bart: decoder layers (default --layers)")
    ap.add_argument("--ffn-kind", default="relu", choices=("relu", "gated-gelu"), help="t5: feed_forward_proj")
    ap.add_argument("--buckets", type=int, default=32, help="t5: relative_attention_num_buckets")
    ap.add_argument("--max-distance", type=int, default=128, help="t5: relative_attention_max_distance")
    ap.add_argument("--scale-embedding", action="store_true", help="bart: scale_embedding")
    ap.add_argument("--tokenizer-from", help="copy tokenizer.json/tokenizer_config.json from this directory")
    o = ap.parse_args(argv)
    p = dict(PRESETS[o.preset])
    defaults = dict(arch="llama", eps=1e-6, tie=False, head_dim=None, window=None, rope_scaling=None,
                    window_pattern=None, qpas=None, attn_softcap=None, final_softcap=None, local_theta=None,
                    partial_rotary=None, orig_max_pos=None, state=16, conv_kernel=4, expand=2)
    for k, v in {**defaults, **p}.items():
        if getattr(o, k, None) is None:
            setattr(o, k, v)
    if o.shards < 1:
        ap.error("--shards must be >= 1")
    return o


def main(argv=None):
    o = parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    os.makedirs(o.out, exist_ok=True)
    if o.tokenizer_from:
        tok, tcfg, bos, eos = tokenizer_from(o.tokenizer_from, o.vocab)
    else:
        tok, tcfg, bos, eos = build_tokenizer(o.vocab)
    cfg = make_config(o, bos, eos)
    if o.tokenizer_from:  # copy the files byte for byte
        for fn in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(os.path.join(o.tokenizer_from, fn), os.path.join(o.out, fn))
    else:
        dump_json(os.path.join(o.out, "tokenizer.json"), tok)
        dump_json(os.path.join(o.out, "tokenizer_config.json"), tcfg)
    dump_json(os.path.join(o.out, "config.json"), cfg)
    dump_json(os.path.join(o.out, "generation_config.json"),
              {"bos_token_id": bos, "eos_token_id": eos, "transformers_version": cfg["transformers_version"]})
    write_weights(o.out, cfg, o)


if __name__ == "__main__":
    main()
