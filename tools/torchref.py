"""torchref - an independent plain-PyTorch reference for the decoder-only
architectures kvtier runs: LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM and Qwen3ForCausalLM.

Written from the semantics of Hugging Face transformers' modeling code (not
copied): RMSNorm with the variance in f32, NeoX / rotate_half RoPE with HF's
inv_freq (default, linear, llama3), GQA, SiLU-gated MLP, Qwen2 q/k/v biases,
Qwen3 per-head q/k RMSNorm before RoPE, causal masks with HF's sliding-window
rule (a query at q sees keys k with q - k < window) on the layers HF makes
sliding.  Parameter names equal the HF state-dict keys, so
`model.state_dict()` is a checkpoint (a tied lm_head has no key of its own).

Also: a hand-written safetensors reader/writer (F32/F16/BF16 and a few
integer types), load_model(dir), which upcasts stored weights to the
compute dtype ("same weights, f32 math"), and GGUF's Q8_0 weight
quantization, byte for byte as kvtier's util/q8.c does it, for the
reference of kvtier --weights q8_0 (load_model(dir, weights="q8_0")).

It is a test oracle and a training model, never part of the runtime.  Run
with Debian's /usr/bin/python3 (torch 1.13).
"""
import json
import math
import mmap
import os
import re
import struct

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


# --------------------------------------------------------------------------
# Configuration: the HF defaults that matter when a config.json omits a field.
# --------------------------------------------------------------------------
def arch_of(cfg):
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in ARCHS:
            return a
    raise ValueError(f"config.json: unsupported architectures {archs!r}; supported: {', '.join(ARCHS)}")


def head_dim_of(cfg):
    """Explicit head_dim wins.  Qwen3Config defaults head_dim to 128 (not
    hidden/heads) when the field is absent; the others derive it."""
    hd = cfg.get("head_dim")
    if hd:
        return int(hd)
    if arch_of(cfg) == "Qwen3ForCausalLM":
        return 128
    return cfg["hidden_size"] // cfg["num_attention_heads"]


def rope_params(cfg):
    """(theta, scaling dict or None).  Older config.json files carry
    rope_theta + rope_scaling; newer transformers write rope_parameters."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = rp.get("rope_type", rp.get("type", "default"))
        return float(theta), (None if kind == "default" else dict(rp, rope_type=kind))
    theta = float(cfg.get("rope_theta", 10000.0))
    rs = cfg.get("rope_scaling")
    if not rs:
        return theta, None
    kind = rs.get("rope_type", rs.get("type", "default"))
    return theta, (None if kind == "default" else dict(rs, rope_type=kind))


def layer_windows(cfg):
    """Per layer: the sliding window (int) or None for full attention.

    Mistral: every layer slides when sliding_window is set (MistralConfig
    defaults it to 4096 when the key is absent; null disables it).
    Qwen2/Qwen3: sliding_window only counts when use_sliding_window; then the
    layers marked "sliding_attention" in layer_types slide, and layer_types,
    when absent, marks layers i >= max_window_layers.
    Llama: never."""
    n = cfg["num_hidden_layers"]
    arch = arch_of(cfg)
    if arch == "MistralForCausalLM":
        w = cfg.get("sliding_window", 4096)
        return [w if w else None] * n
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        w = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
        types = cfg.get("layer_types")
        if types is None:
            mwl = cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if w is not None and i >= mwl else "full_attention" for i in range(n)]
        if len(types) != n:
            raise ValueError(f"config.json: layer_types has {len(types)} entries for {n} layers")
        return [w if (t == "sliding_attention" and w) else None for t in types]
    return [None] * n


def rope_inv_freq(cfg):
    """inv_freq[head_dim/2] exactly as HF computes it (f32 throughout)."""
    dim = head_dim_of(cfg)
    theta, sc = rope_params(cfg)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if sc is None:
        return inv
    kind = sc["rope_type"]
    if kind == "linear":
        # scaling the positions by 1/factor == scaling the frequencies
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor = float(sc["factor"])
        lo, hi = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # long wavelengths (low frequencies) are slowed by factor, short ones
        # kept, and the band in between interpolated smoothly
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi) & ~(wavelen > old_ctx / lo)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"config.json: rope scaling type {kind!r} not supported (linear, llama3)")


# --------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim, eps, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x32 = x.float()  # HF: variance in f32 whatever the compute dtype
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dt)


def rotate_half(x):
    """NeoX layout: the two halves of the head are the (re, im) pairs."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x, cos, sin):
    """x: [B, H, T, hd]; cos, sin: [T, hd]."""
    return x * cos + rotate_half(x) * sin


def repeat_kv(x, n_rep):
    """[B, Hkv, T, hd] -> [B, Hkv*n_rep, T, hd]: query head h uses kv head
    h // n_rep (each kv head repeated n_rep times in a row)."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def causal_mask(t, window, device):
    """Additive [T, T] mask: 0 where key k is visible to query q (k <= q and,
    with a window, q - k < window), -inf elsewhere."""
    q = torch.arange(t, device=device)[:, None]
    k = torch.arange(t, device=device)[None, :]
    ok = k <= q
    if window is not None:
        ok = ok & (q - k < window)
    return torch.zeros(t, t, device=device).masked_fill(~ok, float("-inf"))


class Attention(nn.Module):
    def __init__(self, cfg, window, device=None):
        super().__init__()
        arch = arch_of(cfg)
        dim = cfg["hidden_size"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads") or self.n_heads
        self.hd = head_dim_of(cfg)
        self.window = window
        # The type the cache keeps K (after RoPE) and V in: Hugging Face's
        # cache holds them in the model's dtype, so f32 math over a 16-bit
        # cache rounds them once, right here (None: kept as computed).
        self.kv_dtype = None
        # Qwen2: q/k/v biased, o not.  Llama/Qwen3: attention_bias on all
        # four.  Mistral: none.
        qkv_bias = arch == "Qwen2ForCausalLM" or (arch != "MistralForCausalLM" and cfg.get("attention_bias", False))
        o_bias = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") and cfg.get("attention_bias", False)
        self.q_proj = nn.Linear(dim, self.n_heads * self.hd, bias=qkv_bias, device=device)
        self.k_proj = nn.Linear(dim, self.n_kv * self.hd, bias=qkv_bias, device=device)
        self.v_proj = nn.Linear(dim, self.n_kv * self.hd, bias=qkv_bias, device=device)
        self.o_proj = nn.Linear(self.n_heads * self.hd, dim, bias=o_bias, device=device)
        if arch == "Qwen3ForCausalLM":
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(self.hd, eps, device)
            self.k_norm = RMSNorm(self.hd, eps, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, masks):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.hd)  # [B, T, H, hd]
        k = self.k_proj(x).view(b, t, self.n_kv, self.hd)     # [B, T, Hkv, hd]
        v = self.v_proj(x).view(b, t, self.n_kv, self.hd)     # [B, T, Hkv, hd]
        if self.q_norm is not None:  # Qwen3: per head, before RoPE
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, T, hd]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, hd]
        v = v.transpose(1, 2)
        if self.kv_dtype is not None:
            k, v = k.to(self.kv_dtype).to(q.dtype), v.to(self.kv_dtype).to(q.dtype)
        rep = self.n_heads // self.n_kv
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        s = torch.matmul(q, k.transpose(2, 3)) * (self.hd ** -0.5) + masks[self.window]  # [B, H, T, T]
        p = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(p, v).transpose(1, 2).reshape(b, t, self.n_heads * self.hd)  # [B, T, H*hd]
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        dim, ffn = cfg["hidden_size"], cfg["intermediate_size"]
        bias = arch_of(cfg) == "LlamaForCausalLM" and cfg.get("mlp_bias", False)
        self.gate_proj = nn.Linear(dim, ffn, bias=bias, device=device)
        self.up_proj = nn.Linear(dim, ffn, bias=bias, device=device)
        self.down_proj = nn.Linear(ffn, dim, bias=bias, device=device)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, window, device=None):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, device)
        self.self_attn = Attention(cfg, window, device)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, device)
        self.mlp = MLP(cfg, device)

    def forward(self, x, cos, sin, masks):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, masks)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """The HF `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg, device=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"], device=device)
        self.windows = layer_windows(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, w, device) for w in self.windows)
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), device)
        # not persistent: HF checkpoints carry no inv_freq
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def rope_tables(self, t, dtype):
        """cos, sin [T, hd] for positions 0..T-1, computed in f32 as HF does."""
        pos = torch.arange(t, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq.float())  # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)           # [T, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)  # [B, T, dim]
        t = input_ids.shape[1]
        cos, sin = self.rope_tables(t, x.dtype)
        masks = {w: causal_mask(t, w, x.device).to(x.dtype) for w in set(self.windows)}
        for layer in self.layers:
            x = layer(x, cos, sin, masks)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, cfg: dict, device=None):
        """device="meta" builds the parameter layout without memory (used
        to list a realistic model's tensors)."""
        super().__init__()
        self.cfg = cfg
        self.arch = arch_of(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {cfg['hidden_act']!r} not supported (silu)")
        self.model = Backbone(cfg, device)
        # HF's default for tie_word_embeddings is False for these four classes
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False, device=device)

    def forward(self, input_ids):
        """input_ids [B, T] (positions 0..T-1, full causal) -> logits [B, T, V]."""
        h = self.model(input_ids)
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return F.linear(h, w)


# --------------------------------------------------------------------------
# safetensors: 8-byte LE header length, JSON header, raw little-endian data
# --------------------------------------------------------------------------
_ST_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.int16, "F64": np.float64,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8}
_ST_TORCH = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8"}
ST_ITEMSIZE = {k: np.dtype(v).itemsize for k, v in _ST_NP.items()}


def safetensors_header(entries, metadata=None):
    """entries: [(name, dtype "F32"/"BF16"/..., shape)] in file order.
    Returns the bytes that precede the data (length + JSON, padded with spaces
    to 8 bytes so every tensor stays aligned) and the data size."""
    hdr = {}
    if metadata:
        hdr["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for name, dt, shape in entries:
        n = ST_ITEMSIZE[dt] * int(np.prod(shape, dtype=np.int64))
        hdr[name] = {"dtype": dt, "shape": [int(s) for s in shape], "data_offsets": [off, off + n]}
        off += n
    js = json.dumps(hdr, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js, off


def tensor_bytes(t):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bf16: write the raw bits
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def save_safetensors(path, tensors, metadata=None):
    entries = [(k, _ST_TORCH[v.dtype], tuple(v.shape)) for k, v in tensors.items()]
    head, _ = safetensors_header(entries, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for v in tensors.values():
            f.write(tensor_bytes(v))


def load_safetensors(path):
    """name -> tensor in the stored dtype (copied out of the mmap)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if len(mm) < 8:
            raise ValueError(f"{path}: truncated (no header length)")
        (hlen,) = struct.unpack("<Q", mm[:8])
        if 8 + hlen > len(mm):
            raise ValueError(f"{path}: header length {hlen} past the end of the file")
        hdr = json.loads(mm[8:8 + hlen])
        base = 8 + hlen
        out = {}
        for name, e in hdr.items():
            if name == "__metadata__":
                continue
            dt, shape = e["dtype"], e["shape"]
            a, b = e["data_offsets"]
            if dt not in _ST_NP:
                raise ValueError(f"{path}: tensor {name}: dtype {dt} not supported")
            if not (0 <= a <= b <= len(mm) - base) or b - a != ST_ITEMSIZE[dt] * int(np.prod(shape, dtype=np.int64)):
                raise ValueError(f"{path}: tensor {name}: bad data_offsets {a}..{b}")
            arr = np.frombuffer(mm, dtype=_ST_NP[dt], count=(b - a) // ST_ITEMSIZE[dt], offset=base + a)
            t = torch.from_numpy(arr.copy()).reshape(shape)
            out[name] = t.view(torch.bfloat16) if dt == "BF16" else t
            del arr  # release the mmap export before the mmap closes
        return out


def load_checkpoint(d):
    """All tensors of an HF directory: model.safetensors or the shards named
    by model.safetensors.index.json."""
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fn in files:
        out.update(load_safetensors(os.path.join(d, fn)))
    return out


def param_shapes(cfg):
    """[(HF tensor name, shape)] in state-dict order, without allocating."""
    return [(k, tuple(v.shape)) for k, v in CausalLM(cfg, device="meta").state_dict().items()]


def load_config(d):
    with open(os.path.join(d, "config.json")) as f:
        return json.load(f)


# --------------------------------------------------------------------------
# Q8_0: blocks of 32 weights along a row, an f16 scale d = max|w| / 127 and
# int8 codes round(w / d) (ties away from zero), computed with the f32 d as
# llama.cpp's quantize_row_q8_0_ref does; w ~ f16(d) * code.
# --------------------------------------------------------------------------
Q8_0_BLOCK = 32
Q8_0_DTYPE = np.dtype([("d", "<u2"), ("qs", "i1", (Q8_0_BLOCK,))])  # 34 bytes, as struct q8_0_block
# the layer matrices kvtier --weights q8_0 quantizes (embeddings, norms and lm_head stay)
Q8_0_LAYER_MATS = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def q8_0_quantize(w):
    """Q8_0 blocks (a Q8_0_DTYPE array) of w, whose rows have a multiple of
    32 elements; every step in float32 as the C quantizer takes it."""
    x = np.ascontiguousarray(w, dtype=np.float32)
    if x.shape[-1] % Q8_0_BLOCK:
        raise ValueError(f"Q8_0: rows of {x.shape[-1]} elements are not whole blocks of {Q8_0_BLOCK}")
    x = x.reshape(-1, Q8_0_BLOCK)
    if not np.all(np.isfinite(x)):
        raise ValueError("Q8_0: a weight is NaN or infinite")
    d = np.abs(x).max(axis=1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = (x * inv[:, None]).astype(np.float64)  # the f32 product, then exactly
    out = np.empty(len(x), Q8_0_DTYPE)
    out["d"] = d.astype(np.float16).view(np.uint16)
    out["qs"] = np.trunc(v + np.copysign(0.5, v)).astype(np.int8)  # roundf: v + 0.5 is exact in float64
    return out


def q8_0_dequantize(blocks, shape):
    """float32 array of shape from Q8_0 blocks: f16(d) * code, in float32."""
    d = blocks["d"].view(np.float16).astype(np.float32)
    return (d[:, None] * blocks["qs"].astype(np.float32)).reshape(shape)


def q8_act(x):
    """x rounded as kvtier's CPU backend rounds a Q8_0 matmul's input: per
    block of 32 along the last dimension, d = max|x| / 127 in float32 (not
    stored as f16, unlike GGUF's Q8_0 activations), codes x * (1 / d)
    rounded to nearest even, back as d * code."""
    b = x.float().reshape(*x.shape[:-1], -1, Q8_0_BLOCK)
    d = b.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (d * torch.round(b * inv)).reshape(x.shape).to(x.dtype)


def load_model(d, dtype=torch.float32, kv_dtype=None, weights="auto"):
    """CausalLM of directory d with its weights upcast (or cast) to dtype;
    kv_dtype (e.g. torch.bfloat16): K and V rounded to it, as a cache of
    that type keeps them; weights "q8_0": every layer matrix replaced by
    its Q8_0 blocks dequantized and its input rounded by q8_act (what
    kvtier --weights q8_0 multiplies)."""
    m = CausalLM(load_config(d))
    for layer in m.model.layers:
        layer.self_attn.kv_dtype = kv_dtype
    sd = load_checkpoint(d)
    if m.tied:
        sd.pop("lm_head.weight", None)  # some tied checkpoints still carry it
    if weights == "q8_0":
        for k in [k for k in sd if Q8_0_LAYER_MATS.match(k)]:
            w = sd[k].float().numpy()
            sd[k] = torch.from_numpy(q8_0_dequantize(q8_0_quantize(w), w.shape))
        for name, mod in m.named_modules():
            if Q8_0_LAYER_MATS.match(name + ".weight"):
                mod.register_forward_pre_hook(lambda _mod, args: (q8_act(args[0]),))
    elif weights != "auto":
        raise ValueError(f"weights {weights!r}: auto or q8_0")
    m.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    return m.to(dtype).eval()
