"""torchref - an independent plain-PyTorch reference for the decoder-only
architectures kvtier runs: LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM,
Phi3ForCausalLM, GPT2LMHeadModel and the state-space MambaForCausalLM.

Written from the semantics of Hugging Face transformers' modeling code (not
copied): RMSNorm with the variance in f32, NeoX / rotate_half RoPE with HF's
inv_freq (default, linear, llama3), GQA, SiLU-gated MLP, Qwen2 q/k/v biases,
Qwen3 per-head q/k RMSNorm before RoPE, causal masks with HF's sliding-window
rule (a query at q sees keys k with q - k < window) on the layers HF makes
sliding.  Gemma 2/3: RMSNorm scaling by (1 + weight), a norm on each block's
output as well as its input, GeGLU (tanh GELU), embeddings times
sqrt(hidden_size) in their dtype, scores scaled by query_pre_attn_scalar^-1/2
and tanh-capped (Gemma 2, also its final logits), every pattern-th layer
global and the others sliding, Gemma 3's per-head q/k norm and its sliding
layers' own unscaled RoPE base (rope_local_base_freq).  Phi-3: fused
qkv_proj and gate_up_proj, RoPE on the first head_dim * partial_rotary_factor
dimensions, longrope (inv_freq divided by short_factor, or by long_factor in
a forward call whose last position + 1 passes original_max_position_embeddings,
cos and sin times the attention factor of both), a window on every layer when
sliding_window is set.
GPT-2: learned absolute positions (wpe), LayerNorm with bias, Conv1D
projections stored [in, out], fused c_attn (q, k, v), gelu_new, tied head.
Mamba: per block RMSNorm -> in_proj into (x, z) -> causal depthwise conv1d
over the last conv_kernel positions + SiLU -> x_proj into (dt, B, C) ->
dt_proj + softplus -> the selective scan h = exp(dt A) h + dt B x with
A = -exp(A_log), y = C h + D x -> y * SiLU(z) -> out_proj -> residual; the
scan is written as the recurrence it is, one token at a time, and the
same module runs one decode step from a carried state (conv window + SSM
state), so the two forms can be compared.  Parameter names equal the HF state-dict keys, so
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

ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
         "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel", "MambaForCausalLM")
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


# --------------------------------------------------------------------------
# Configuration: the HF defaults that matter when a config.json omits a field.
# --------------------------------------------------------------------------
def arch_of(cfg):
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in ARCHS or a in ENCDEC_ARCHS:
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
    if arch_of(cfg) in GEMMA:
        return 256
    return cfg["hidden_size"] // cfg["num_attention_heads"]


def rot_dim_of(cfg):
    """Dimensions of each head RoPE rotates: Phi-3's partial_rotary_factor
    of them (int() of the product), every one elsewhere."""
    hd = head_dim_of(cfg)
    if arch_of(cfg) == "Phi3ForCausalLM":
        return int(hd * cfg.get("partial_rotary_factor", 1.0))
    return hd


def rope_attention_factor(cfg):
    """longrope's factor on cos and sin: attention_factor, else
    sqrt(1 + ln(s) / ln(original)) with s = max_pos / original (1 when s <= 1)."""
    _, sc = rope_params(cfg)
    if sc is None or sc["rope_type"] not in ("longrope", "su"):
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    orig = cfg.get("original_max_position_embeddings", 4096)
    s = cfg["max_position_embeddings"] / orig
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(orig))


def rope_params(cfg):
    """(theta, scaling dict or None).  Older config.json files carry
    rope_theta + rope_scaling; newer transformers write rope_parameters."""
    rp = cfg.get("rope_parameters")
    default_theta = 1000000.0 if arch_of(cfg) == "Gemma3ForCausalLM" else 10000.0
    if isinstance(rp, dict) and "full_attention" in rp:  # Gemma 3, transformers 5: one per layer type
        rp = rp["full_attention"]
    if isinstance(rp, dict):
        theta = rp.get("rope_theta", cfg.get("rope_theta", default_theta))
        kind = rp.get("rope_type", rp.get("type", "default"))
        return float(theta), (None if kind == "default" else dict(rp, rope_type=kind))
    theta = float(cfg.get("rope_theta", default_theta))
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
    if arch == "Phi3ForCausalLM":  # Phi3Config: no window unless set, then on every layer
        w = cfg.get("sliding_window")
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
    if arch in GEMMA:
        # Gemma 2 alternates (even layers slide); Gemma 3 makes every
        # sliding_window_pattern-th layer global
        w = cfg.get("sliding_window", 4096)
        if not w:
            raise ValueError("config.json: sliding_window must be set for Gemma")
        pattern = 2 if arch == "Gemma2ForCausalLM" else cfg.get("sliding_window_pattern", 6)
        types = cfg.get("layer_types") or \
            ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        return [w if t == "sliding_attention" else None for t in types]
    return [None] * n


def local_rope_theta(cfg):
    """Gemma 3's sliding layers: their RoPE base (unscaled), else None."""
    if arch_of(cfg) != "Gemma3ForCausalLM":
        return None
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "sliding_attention" in rp:
        return float(rp["sliding_attention"].get("rope_theta", 10000.0))
    return float(cfg.get("rope_local_base_freq", 10000.0))


def rope_inv_freq(cfg, local=False, long=False):
    """inv_freq[head_dim/2] exactly as HF computes it (f32 throughout);
    local: Gemma 3's sliding layers' (their own base, no scaling); long:
    longrope's long_factor table (other scalings have one table)."""
    dim = rot_dim_of(cfg)
    theta, sc = rope_params(cfg)
    if local:
        theta, sc = local_rope_theta(cfg), None
    expo = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (theta ** expo)
    if sc is None:
        return inv
    kind = sc["rope_type"]
    if kind in ("longrope", "su"):
        if len(sc["short_factor"]) != dim // 2 or len(sc["long_factor"]) != dim // 2:
            raise ValueError(f"config.json: longrope factors must number rotated dimensions / 2 = {dim // 2}")
        ext = sc["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** expo)
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
    """plus_one (Gemma): the weight is stored as an offset from 1, and the
    whole product is formed in f32 before the cast back."""

    def __init__(self, dim, eps, device=None, plus_one=False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, device=device) if plus_one else torch.ones(dim, device=device))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x):
        dt = x.dtype
        x32 = x.float()  # HF: variance in f32 whatever the compute dtype
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + self.weight.float())).to(dt)
        return self.weight * x32.to(dt)


def rotate_half(x):
    """NeoX layout: the two halves of the head are the (re, im) pairs."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x, cos, sin):
    """x: [B, H, T, hd]; cos, sin: [T, rot] with rot <= hd: the first rot
    dimensions rotate, the rest pass through (partial rotary)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
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
        self.attn_input = None  # load_model: what the query and the weights are rounded to
        # Qwen2: q/k/v biased, o not.  Llama/Qwen3: attention_bias on all
        # four.  Mistral: none.
        qkv_bias = arch == "Qwen2ForCausalLM" or (arch != "MistralForCausalLM" and cfg.get("attention_bias", False))
        o_bias = arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") + GEMMA and cfg.get("attention_bias", False)
        # Gemma: scores scaled by query_pre_attn_scalar^-1/2, and Gemma 2's
        # capped by attn_logit_softcapping (None: uncapped)
        self.scale = self.hd ** -0.5
        self.softcap = None
        if arch in GEMMA:
            self.scale = float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5
            self.softcap = cfg.get("attn_logit_softcapping", 50.0 if arch == "Gemma2ForCausalLM" else None)
        # Gemma 3's sliding layers use the local RoPE table
        self.rope = "local" if window is not None and arch == "Gemma3ForCausalLM" else "global"
        self.fused = arch == "Phi3ForCausalLM"  # one qkv_proj: q rows, then k, then v
        if self.fused:
            self.qkv_proj = nn.Linear(dim, (self.n_heads + 2 * self.n_kv) * self.hd, bias=False, device=device)
        else:
            self.q_proj = nn.Linear(dim, self.n_heads * self.hd, bias=qkv_bias, device=device)
            self.k_proj = nn.Linear(dim, self.n_kv * self.hd, bias=qkv_bias, device=device)
            self.v_proj = nn.Linear(dim, self.n_kv * self.hd, bias=qkv_bias, device=device)
        self.o_proj = nn.Linear(self.n_heads * self.hd, dim, bias=o_bias, device=device)
        if arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
            eps = cfg.get("rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(self.hd, eps, device, plus_one=arch in GEMMA)
            self.k_norm = RMSNorm(self.hd, eps, device, plus_one=arch in GEMMA)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, ropes, masks):
        """ropes: {"global": (cos, sin), "local": (cos, sin)}, each [T, hd]."""
        cos, sin = ropes[self.rope]
        b, t, _ = x.shape
        if self.fused:
            q, k, v = self.qkv_proj(x).split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.n_heads, self.hd)  # [B, T, H, hd]
        k = k.view(b, t, self.n_kv, self.hd)     # [B, T, Hkv, hd]
        v = v.view(b, t, self.n_kv, self.hd)     # [B, T, Hkv, hd]
        if self.q_norm is not None:  # Qwen3, Gemma 3: per head, before RoPE
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, T, hd]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, hd]
        v = v.transpose(1, 2)
        if self.kv_dtype is not None:
            k, v = k.to(self.kv_dtype).to(q.dtype), v.to(self.kv_dtype).to(q.dtype)
        rep = self.n_heads // self.n_kv
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        s = torch.matmul(round_to(q, self.attn_input), k.transpose(2, 3)) * self.scale  # [B, H, T, T]
        if self.softcap is not None:
            s = torch.tanh(s / self.softcap) * self.softcap
        s = s + masks[self.window]
        o = weighted_values(s, v, self.attn_input).transpose(1, 2).reshape(b, t, self.n_heads * self.hd)  # [B, T, H*hd]
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        dim, ffn = cfg["hidden_size"], cfg["intermediate_size"]
        bias = arch_of(cfg) == "LlamaForCausalLM" and cfg.get("mlp_bias", False)
        self.fused = arch_of(cfg) == "Phi3ForCausalLM"  # one gate_up_proj: gate rows, then up
        if self.fused:
            self.gate_up_proj = nn.Linear(dim, 2 * ffn, bias=False, device=device)
        else:
            self.gate_proj = nn.Linear(dim, ffn, bias=bias, device=device)
            self.up_proj = nn.Linear(dim, ffn, bias=bias, device=device)
        self.down_proj = nn.Linear(ffn, dim, bias=bias, device=device)
        # SwiGLU, or Gemma's GeGLU with the tanh approximation
        self.act = (lambda g: F.gelu(g, approximate="tanh")) if arch_of(cfg) in GEMMA else F.silu

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1) if self.fused else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, window, device=None):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        dim = cfg["hidden_size"]
        self.gemma = arch_of(cfg) in GEMMA
        self.input_layernorm = RMSNorm(dim, eps, device, self.gemma)
        self.self_attn = Attention(cfg, window, device)
        # Llama: post_attention_layernorm is the MLP's input norm.  Gemma:
        # it norms the attention output, pre_feedforward_layernorm the MLP's
        # input and post_feedforward_layernorm its output.
        self.post_attention_layernorm = RMSNorm(dim, eps, device, self.gemma)
        if self.gemma:
            self.pre_feedforward_layernorm = RMSNorm(dim, eps, device, True)
            self.post_feedforward_layernorm = RMSNorm(dim, eps, device, True)
        self.mlp = MLP(cfg, device)

    def forward(self, x, ropes, masks):
        if self.gemma:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), ropes, masks))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), ropes, masks)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """The HF `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg, device=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"], device=device)
        self.windows = layer_windows(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, w, device) for w in self.windows)
        gemma = arch_of(cfg) in GEMMA
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6), device, gemma)
        self.embed_scale = cfg["hidden_size"] ** 0.5 if gemma else None
        # not persistent: HF checkpoints carry no inv_freq
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        local = local_rope_theta(cfg) is not None
        self.register_buffer("inv_freq_local", rope_inv_freq(cfg, local=local), persistent=False)
        self.register_buffer("inv_freq_long", rope_inv_freq(cfg, long=True), persistent=False)
        _, sc = rope_params(cfg)
        longrope = sc is not None and sc["rope_type"] in ("longrope", "su")
        # past this many positions in one forward call, longrope's long table
        self.long_after = cfg.get("original_max_position_embeddings", cfg["max_position_embeddings"]) \
            if longrope else None
        self.rope_scale = rope_attention_factor(cfg)

    def rope_tables(self, inv_freq, t, dtype, long_rows=None):
        """cos, sin [T, rot] for positions 0..T-1, computed in f32 as HF
        does (longrope: times its attention factor before the cast);
        long_rows [T] bool: those rows with inv_freq_long instead."""
        pos = torch.arange(t, device=inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq.float())  # [T, rot/2]
        if long_rows is not None:
            freqs = torch.where(long_rows[:, None], torch.outer(pos, self.inv_freq_long.float()), freqs)
        emb = torch.cat((freqs, freqs), dim=-1)      # [T, rot]
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    def forward(self, input_ids, prefill=None):
        x = self.embed_tokens(input_ids)  # [B, T, dim]
        if self.embed_scale is not None:  # Gemma: the normalizer in the activations' dtype
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        t = input_ids.shape[1]
        long_rows = None
        if self.long_after is not None:
            # HF picks the table per forward call from max(position_ids) + 1;
            # a cached key keeps the rotation of the call that computed it
            call_end = torch.arange(1, t + 1).clamp(min=prefill) if prefill is not None else torch.full((t,), t)
            long_rows = (call_end > self.long_after).to(input_ids.device)
        ropes = {"global": self.rope_tables(self.inv_freq, t, x.dtype, long_rows),
                 "local": self.rope_tables(self.inv_freq_local, t, x.dtype)}
        masks = {w: causal_mask(t, w, x.device).to(x.dtype) for w in set(self.windows)}
        for layer in self.layers:
            x = layer(x, ropes, masks)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, cfg: dict, device=None):
        """device="meta" builds the parameter layout without memory (used
        to list a realistic model's tensors)."""
        super().__init__()
        self.cfg = cfg
        self.arch = arch_of(cfg)
        gemma = self.arch in GEMMA
        key, want = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
        if cfg.get(key, want) != want:
            raise ValueError(f"config.json: {key} {cfg[key]!r} not supported ({want})")
        self.model = Backbone(cfg, device)
        # HF's default for tie_word_embeddings: False for Llama, Mistral,
        # Qwen and Phi-3, True for Gemma
        self.tied = bool(cfg.get("tie_word_embeddings", gemma))
        self.head_input = None  # the dtype the head's input is rounded to (load_model's matmul_input)
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False, device=device)
        self.final_softcap = cfg.get("final_logit_softcapping",
                                     30.0 if self.arch == "Gemma2ForCausalLM" else None) if gemma else None

    def forward(self, input_ids, prefill=None):
        """input_ids [B, T] (positions 0..T-1, full causal) -> logits [B, T, V].
        prefill None: one forward call over all T rows (as without a cache);
        else the length of the first call of a cached generation, which then
        fed one token per call (it decides longrope's table per row)."""
        h = self.model(input_ids, prefill)
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        logits = F.linear(round_to(h, self.head_input), w)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


# --------------------------------------------------------------------------
# GPT-2: its own layout and names (GPT2Config: n_embd, n_layer, n_head, ...)
# --------------------------------------------------------------------------
class Conv1D(nn.Module):
    """GPT-2's projection: weight [in, out], y = x W + b."""

    def __init__(self, n_in, n_out, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out, device=device))
        self.bias = nn.Parameter(torch.zeros(n_out, device=device))

    def forward(self, x):
        return torch.matmul(x, self.weight) + self.bias


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class GPT2Attention(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        dim = cfg["n_embd"]
        self.n_heads = cfg["n_head"]
        self.hd = dim // self.n_heads
        self.kv_dtype = None  # as Attention.kv_dtype
        self.attn_input = None  # as Attention.attn_input
        self.c_attn = Conv1D(dim, 3 * dim, device)  # q, k, v side by side
        self.c_proj = Conv1D(dim, dim, device)

    def forward(self, x, mask):
        b, t, dim = x.shape
        q, k, v = (y.view(b, t, self.n_heads, self.hd).transpose(1, 2) for y in self.c_attn(x).split(dim, dim=2))
        if self.kv_dtype is not None:
            k, v = k.to(self.kv_dtype).to(q.dtype), v.to(self.kv_dtype).to(q.dtype)
        q = round_to(q, self.attn_input)
        s = torch.matmul(q, k.transpose(2, 3)) / (self.hd ** 0.5) + mask  # [B, H, T, T]
        return self.c_proj(weighted_values(s, v, self.attn_input).transpose(1, 2).reshape(b, t, dim))


class GPT2Block(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        dim, eps = cfg["n_embd"], cfg.get("layer_norm_epsilon", 1e-5)
        inner = cfg.get("n_inner") or 4 * dim
        self.ln_1 = nn.LayerNorm(dim, eps=eps, device=device)
        self.attn = GPT2Attention(cfg, device)
        self.ln_2 = nn.LayerNorm(dim, eps=eps, device=device)
        self.mlp = nn.ModuleDict({"c_fc": Conv1D(dim, inner, device), "c_proj": Conv1D(inner, dim, device)})

    def forward(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp["c_proj"](gelu_new(self.mlp["c_fc"](self.ln_2(x))))


class GPT2Backbone(nn.Module):
    """The HF `transformer.` prefix."""

    def __init__(self, cfg, device=None):
        super().__init__()
        dim = cfg["n_embd"]
        self.wte = nn.Embedding(cfg["vocab_size"], dim, device=device)
        self.wpe = nn.Embedding(cfg.get("n_positions", 1024), dim, device=device)
        self.h = nn.ModuleList(GPT2Block(cfg, device) for _ in range(cfg["n_layer"]))
        self.ln_f = nn.LayerNorm(dim, eps=cfg.get("layer_norm_epsilon", 1e-5), device=device)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        if t > self.wpe.num_embeddings:
            raise ValueError(f"{t} positions, n_positions is {self.wpe.num_embeddings}")
        x = self.wte(input_ids) + self.wpe(torch.arange(t, device=input_ids.device))[None]  # [B, T, dim]
        mask = causal_mask(t, None, x.device).to(x.dtype)
        for block in self.h:
            x = block(x, mask)
        return self.ln_f(x)


class GPT2LM(nn.Module):
    def __init__(self, cfg: dict, device=None):
        super().__init__()
        self.cfg = cfg
        self.arch = arch_of(cfg)
        for key, want in (("activation_function", "gelu_new"), ("scale_attn_weights", True),
                          ("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False)):
            if cfg.get(key, want) != want:
                raise ValueError(f"config.json: {key} {cfg[key]!r} not supported ({want})")
        self.transformer = GPT2Backbone(cfg, device)
        self.tied = bool(cfg.get("tie_word_embeddings", True))
        self.head_input = None  # as in CausalLM
        if not self.tied:
            self.lm_head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False, device=device)

    def forward(self, input_ids, prefill=None):  # prefill: learned positions have one table
        h = self.transformer(input_ids)
        return F.linear(round_to(h, self.head_input), self.transformer.wte.weight if self.tied else self.lm_head.weight)


# --------------------------------------------------------------------------
# Mamba (MambaConfig's names: hidden_size, state_size, conv_kernel, expand,
# intermediate_size, time_step_rank, layer_norm_epsilon, use_bias,
# use_conv_bias; the HF `backbone.` prefix)
# --------------------------------------------------------------------------
def mamba_dims(cfg):
    """(dim, inner, state, kernel, rank) with MambaConfig's defaults:
    intermediate_size = int(expand * hidden_size), time_step_rank "auto" =
    ceil(hidden_size / 16)."""
    dim = cfg["hidden_size"]
    inner = cfg.get("intermediate_size") or int(cfg.get("expand", 2) * dim)
    rank = cfg.get("time_step_rank", "auto")
    rank = math.ceil(dim / 16) if rank == "auto" else int(rank)
    return dim, inner, cfg.get("state_size", 16), cfg.get("conv_kernel", 4), rank


class MambaMixer(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        dim, self.inner, self.n_state, self.kernel, self.rank = mamba_dims(cfg)
        self.in_proj = nn.Linear(dim, 2 * self.inner, bias=cfg.get("use_bias", False), device=device)
        self.conv1d = nn.Conv1d(self.inner, self.inner, self.kernel, groups=self.inner,
                                bias=cfg.get("use_conv_bias", True), device=device)
        self.x_proj = nn.Linear(self.inner, self.rank + 2 * self.n_state, bias=False, device=device)
        self.dt_proj = nn.Linear(self.rank, self.inner, bias=True, device=device)
        self.A_log = nn.Parameter(torch.zeros(self.inner, self.n_state, device=device))
        self.D = nn.Parameter(torch.ones(self.inner, device=device))
        self.out_proj = nn.Linear(self.inner, dim, bias=cfg.get("use_bias", False), device=device)

    def empty_state(self, b, dtype):
        """(conv window [B, inner, kernel-1]: the inputs before the first
        token, zeros; SSM state [B, inner, state] in f32)."""
        return (torch.zeros(b, self.inner, self.kernel - 1, dtype=dtype),
                torch.zeros(b, self.inner, self.n_state, dtype=torch.float32))

    def forward(self, x, state):
        """x [B, T, dim], state from empty_state or a previous call ->
        (y [B, T, dim], the state after the last token)."""
        conv, h = state
        t = x.shape[1]
        xz = self.in_proj(x)
        u, z = xz[..., :self.inner], xz[..., self.inner:]                    # [B, T, inner] each
        # causal depthwise conv: position i sees inputs i-kernel+1 .. i, the
        # ones before this call coming from the carried window
        seq = torch.cat((conv, u.transpose(1, 2)), dim=2)                      # [B, inner, kernel-1+T]
        w = self.conv1d.weight[:, 0, :]                                         # [inner, kernel]
        cu = torch.stack([(seq[:, :, i:i + self.kernel] * w).sum(-1) for i in range(t)], dim=1)
        if self.conv1d.bias is not None:
            cu = cu + self.conv1d.bias
        cu = F.silu(cu)                                                        # [B, T, inner]
        dt, bm, cm = self.x_proj(cu).split([self.rank, self.n_state, self.n_state], dim=-1)
        dt = F.softplus(self.dt_proj(dt)).float()                              # [B, T, inner]
        a = -torch.exp(self.A_log.float())                                     # [inner, state]
        ys = []
        for i in range(t):  # the recurrence itself, in f32
            h = torch.exp(dt[:, i, :, None] * a) * h + \
                dt[:, i, :, None] * bm[:, i, None, :].float() * cu[:, i, :, None].float()
            ys.append((h * cm[:, i, None, :].float()).sum(-1))                # [B, inner]
        y = torch.stack(ys, dim=1).to(x.dtype) + cu * self.D                   # [B, T, inner]
        y = y * F.silu(z)
        return self.out_proj(y), (seq[:, :, seq.shape[2] - (self.kernel - 1):], h)


class MambaBlock(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("layer_norm_epsilon", 1e-5), device)
        self.mixer = MambaMixer(cfg, device)

    def forward(self, x, state):
        y, state = self.mixer(self.norm(x), state)
        return x + y, state


class MambaBackbone(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        self.embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"], device=device)
        self.layers = nn.ModuleList(MambaBlock(cfg, device) for _ in range(cfg["num_hidden_layers"]))
        self.norm_f = RMSNorm(cfg["hidden_size"], cfg.get("layer_norm_epsilon", 1e-5), device)


class MambaLM(nn.Module):
    def __init__(self, cfg: dict, device=None):
        super().__init__()
        self.cfg = cfg
        self.arch = arch_of(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {cfg['hidden_act']!r} not supported (silu)")
        self.backbone = MambaBackbone(cfg, device)
        self.tied = bool(cfg.get("tie_word_embeddings", True))  # MambaConfig's default
        self.head_input = None  # as in CausalLM
        if not self.tied:
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False, device=device)

    def step(self, input_ids, states=None):
        """input_ids [B, T] continuing states (None: a fresh sequence) ->
        (logits [B, T, V], the states after them, one per layer)."""
        x = self.backbone.embeddings(input_ids)
        if states is None:
            states = [blk.mixer.empty_state(x.shape[0], x.dtype) for blk in self.backbone.layers]
        out = []
        for blk, st in zip(self.backbone.layers, states):
            x, st = blk(x, st)
            out.append(st)
        h = self.backbone.norm_f(x)
        w = self.backbone.embeddings.weight if self.tied else self.lm_head.weight
        return F.linear(round_to(h, self.head_input), w), out

    def forward(self, input_ids, prefill=None):  # prefill: a state model has no per-call table
        return self.step(input_ids)[0]


def build_model(cfg, device=None):
    """The module of cfg's architecture."""
    arch = arch_of(cfg)
    if arch == "MambaForCausalLM":
        return MambaLM(cfg, device)
    if arch in ENCDEC_ARCHS:
        return EncDecLM(cfg, device)
    return GPT2LM(cfg, device) if arch == "GPT2LMHeadModel" else CausalLM(cfg, device)


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
    return [(k, tuple(v.shape)) for k, v in build_model(cfg, device="meta").state_dict().items()]


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
# the layer matrices kvtier --weights q8_0 quantizes (embeddings, norms and lm_head stay; a
# Mamba matrix whose rows are not whole blocks, dt_proj of dt_rank columns, stays too)
Q8_0_LAYER_MATS = re.compile(r"(model\.layers\.\d+\.(self_attn\.(qkv|[qkvo])_proj|mlp\.(gate_up|gate|up|down)_proj)|"
                             r"backbone\.layers\.\d+\.mixer\.(in|x|dt|out)_proj)\.weight$")


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


def round_to(x, dtype):
    """x rounded to dtype (to nearest even) and back; dtype None: x."""
    return x if dtype is None else x.to(dtype).to(x.dtype)


def weighted_values(s, v, rounding=None):
    """softmax(s) v over the last axis of the scores s; rounding (a dtype):
    the weights exp(s - max) rounded to it before they are normalised, as
    kvtier's online softmax rounds them on a bf16 cache at the avx512bf16
    level (the same weights while a row's keys fit one chunk of 64)."""
    if rounding is None:
        return torch.matmul(F.softmax(s, dim=-1, dtype=torch.float32).to(v.dtype), v)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return torch.matmul(round_to(e, rounding), v) / e.sum(-1, keepdim=True)


# --------------------------------------------------------------------------
# Q4_K (GGUF's GGML type 12): super-blocks of 256 weights, 8 sub-blocks of
# 32 with 6-bit scales sc and mins m, 4-bit codes q; w ~ f16(d) * sc * q -
# f16(dmin) * m.  The quantizer replays util/q4k.c's bytes
# (tests/q4k_bytes.test.sh); its error bound is what tests/test_q4k.c checks.
# --------------------------------------------------------------------------
Q4_K_BLOCK = 256
Q4_K_DTYPE = np.dtype([("d", "<u2"), ("dmin", "<u2"), ("scales", "u1", (12,)), ("qs", "u1", (128,))])  # 144 bytes


def _q4_k_code(v, hi):
    """v rounded halves up into [0, hi] in float32: 0 unless v > 0, hi from
    hi up, else trunc(v + 0.5) (the f32 sum)."""
    r = np.trunc((v + np.float32(0.5)).astype(np.float32))
    return np.where(~(v > 0), 0, np.where(v >= np.float32(hi), hi, np.minimum(r, hi))).astype(np.int64)


def q4_k_quantize(w):
    """Q4_K blocks (a Q4_K_DTYPE array) of w, whose rows have a multiple of
    256 elements: each sub-block of 32 fitted as x ~ s*q - mn by weighted
    least squares (weights rms(super-block) + |x|) over the 21 code
    assignments rounded against (max - min) / (15 + t), t = -1.0 .. 1.0 by
    0.1, where a positive offset is clamped to 0; s and mn rounded to 6 bits
    against d = max s / 63 and dmin = max mn / 63 (f16), and the codes
    against those stored values.  Every step in the precision and order of
    kvtier's C quantizer (float32 fit sums and products, the block's
    float64 sum of squares, element by element; each candidate's error
    expanded from its fit's sums) so the bytes match; vectorized over the
    blocks instead of looping."""
    x = np.ascontiguousarray(w, dtype=np.float32)
    if x.shape[-1] % Q4_K_BLOCK:
        raise ValueError(f"Q4_K: rows of {x.shape[-1]} elements are not whole super-blocks of {Q4_K_BLOCK}")
    x = x.reshape(-1, Q4_K_BLOCK)
    if not np.all(np.isfinite(x)):
        raise ValueError("Q4_K: a weight is NaN or infinite")
    nb, f32, f64 = len(x), np.float32, np.float64
    ss = np.zeros(nb, f64)
    for i in range(Q4_K_BLOCK):
        ss += x[:, i].astype(f64) * x[:, i].astype(f64)
    av = np.sqrt(ss / Q4_K_BLOCK).astype(f32)
    xs = x.reshape(nb * 8, 32)  # the sub-blocks
    wt = (np.repeat(av, 8)[:, None] + np.abs(xs)).astype(f32)
    lo = np.minimum(xs.min(axis=1), f32(0))
    hi = xs.max(axis=1)
    rng = (hi - lo).astype(f32)
    live = hi > lo
    sw, sx, sxx = (np.zeros(len(xs), f32) for _ in range(3))
    for i in range(32):
        wi, xi = wt[:, i], xs[:, i]
        sw += wi
        sx += wi * xi
        sxx += (wi * xi) * xi
    best_s = np.where(live, rng / f32(15), f32(0)).astype(f32)
    best_b = lo.copy()
    best_err = np.full(len(xs), np.inf, f32)
    two = f32(2)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for step in range(21):
            inv = ((f32(15) + f32(0.1) * f32(step - 10)) / rng).astype(f32)
            v = (xs - lo[:, None]) * inv[:, None] + f32(0.5)  # x - lo >= 0: round by truncating
            qf = np.where(v >= f32(16), f32(15), np.trunc(v)).astype(f32)
            sl, sll, slx = (np.zeros(len(xs), f32) for _ in range(3))
            for i in range(32):
                wq = wt[:, i] * qf[:, i]
                sl += wq
                sll += wq * qf[:, i]
                slx += wq * xs[:, i]
            det = sw * sll - sl * sl
            s = (sw * slx - sl * sx) / det
            b = (sll * sx - sl * slx) / det
            pos = b > f32(0)
            b = np.where(pos, f32(0), b).astype(f32)
            s = np.where(pos, slx / sll, s).astype(f32)
            # sum w (s q + b - x)^2 expanded, term by term as the C sums it
            err = (s * s * sll + two * s * b * sl + b * b * sw - two * s * slx - two * b * sx + sxx).astype(f32)
            take = live & (det > f32(0)) & ~(s < f32(0)) & (err < best_err)
            best_err = np.where(take, err, best_err)
            best_s = np.where(take, s, best_s)
            best_b = np.where(take, b, best_b)
    sv, mn = best_s.reshape(nb, 8), (-best_b).astype(f32).reshape(nb, 8)
    d = (np.maximum(sv.max(axis=1), f32(0)) / f32(63)).astype(f32)
    dmin = (np.maximum(mn.max(axis=1), f32(0)) / f32(63)).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, _q4_k_code((sv / d[:, None]).astype(f32), 63), 0)
        m = np.where(dmin[:, None] > 0, _q4_k_code((mn / dmin[:, None]).astype(f32), 63), 0)
    out = np.zeros(nb, Q4_K_DTYPE)
    out["d"] = d.astype(np.float16).view(np.uint16)
    out["dmin"] = dmin.astype(np.float16).view(np.uint16)
    d16, dmin16 = out["d"].view(np.float16).astype(f32), out["dmin"].view(np.float16).astype(f32)
    if not (np.all(np.isfinite(d16)) and np.all(np.isfinite(dmin16))):
        raise ValueError("Q4_K: a super-block's factors overflow f16")
    for j in range(4):
        out["scales"][:, j] = sc[:, j] | (sc[:, j + 4] >> 4) << 6
        out["scales"][:, j + 4] = m[:, j] | (m[:, j + 4] >> 4) << 6
        out["scales"][:, j + 8] = (sc[:, j + 4] & 15) | (m[:, j + 4] & 15) << 4
    step = (d16[:, None] * sc.astype(f32)).astype(f32)
    off = (dmin16[:, None] * m.astype(f32)).astype(f32)
    with np.errstate(divide="ignore"):
        inv = np.where(step > 0, f32(1) / step, f32(0)).astype(f32)
    xb = x.reshape(nb, 8, 32)
    codes = _q4_k_code(((xb + off[:, :, None]) * inv[:, :, None]).astype(f32), 15)
    for i in range(4):
        out["qs"][:, 32 * i:32 * i + 32] = codes[:, 2 * i] | codes[:, 2 * i + 1] << 4
    return out


def q4_k_dequantize(blocks, shape):
    """float32 array of shape from Q4_K blocks, by the format's definition:
    sub-blocks 0..3 take the low 6 bits of scales[j] (sc) and scales[j+4]
    (m); 4..7 the nibbles of scales[j+4] with the top 2 bits of scales[j-4]
    (sc) and scales[j] (m); sub-blocks 2i and 2i+1 are the low and high
    nibbles of qs[32i:32i+32]; each value (d*sc) * q - (dmin*m) in float32."""
    d = blocks["d"].view(np.float16).astype(np.float32)
    dmin = blocks["dmin"].view(np.float16).astype(np.float32)
    s = blocks["scales"].astype(np.int32)
    out = np.empty((len(blocks), Q4_K_BLOCK), np.float32)
    for j in range(8):
        if j < 4:
            sc, m = s[:, j] & 63, s[:, j + 4] & 63
        else:
            sc = (s[:, j + 4] & 15) | ((s[:, j - 4] >> 6) << 4)
            m = (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)
        byte = blocks["qs"][:, 32 * (j // 2):32 * (j // 2) + 32]
        q = (byte >> 4 if j % 2 else byte & 15).astype(np.float32)
        step, off = d * sc.astype(np.float32), dmin * m.astype(np.float32)
        out[:, 32 * j:32 * j + 32] = step[:, None] * q - off[:, None]
    return out.reshape(shape)


# --------------------------------------------------------------------------
# Q6_K (read only in kvtier, which requantizes it to Q8_0 at load): 256
# elements in 16 groups of 16, x = (f16(d) * scale) * (q - 32), q a 6-bit
# code whose low 4 bits are in ql and high 2 in qh.
# --------------------------------------------------------------------------
Q6_K_BLOCK = 256
Q6_K_DTYPE = np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)), ("d", "<u2")])  # 210


def _q6_k_layout():
    """For each element e of a super-block: its ql byte and shift, its qh
    byte and shift and its group's scale index, by the format: e = 128 h +
    32 k + l (h the half, k the quarter, l < 32) takes the low (k < 2) or
    high nibble of ql[64 h + 32 (k % 2) + l], bits 2k..2k+1 of qh[32 h + l]
    and scales[8 h + 2 k + l // 16]."""
    e = np.arange(Q6_K_BLOCK)
    h, k, l = e // 128, (e % 128) // 32, e % 32
    return 64 * h + 32 * (k % 2) + l, 4 * (k // 2), 32 * h + l, 2 * k, 8 * h + 2 * k + l // 16


def q6_k_quantize(w):
    """Q6_K blocks of w (rows of whole super-blocks): a simple valid
    quantizer, not llama.cpp's (whose scale search a loader does not need):
    each group's scale max|x| / 31 as an int8 multiple of d = the largest
    scale / 127 (d stored as f16), codes round(x / (d * sc)) in [-32, 31]."""
    x = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, Q6_K_BLOCK)
    g = np.abs(x.reshape(len(x), 16, 16)).max(axis=2) / np.float32(31)
    d = (g.max(axis=1) / np.float32(127)).astype(np.float16)
    d32 = d.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32[:, None] > 0, np.rint(g / d32[:, None]), 0).clip(0, 127).astype(np.int8)
    qb, qs, hb, hs, si = _q6_k_layout()
    step = d32[:, None] * sc[:, si].astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint(x / step), 0).clip(-32, 31).astype(np.int32) + 32
    out = np.zeros(len(x), Q6_K_DTYPE)
    out["d"] = d.view(np.uint16)
    out["scales"] = sc
    ql = np.zeros((len(x), 128), np.int32)
    qh = np.zeros((len(x), 64), np.int32)
    np.add.at(ql, (slice(None), qb), (q & 15) << qs)
    np.add.at(qh, (slice(None), hb), (q >> 4) << hs)
    out["ql"], out["qh"] = ql.astype(np.uint8), qh.astype(np.uint8)
    return out


def q6_k_dequantize(blocks, shape):
    """float32 array of shape from Q6_K blocks: (d * scale) * (q - 32) in
    float32, element by element from _q6_k_layout."""
    qb, qs, hb, hs, si = _q6_k_layout()
    q = ((blocks["ql"][:, qb].astype(np.int32) >> qs) & 15) | (((blocks["qh"][:, hb].astype(np.int32) >> hs) & 3) << 4)
    d = blocks["d"].view(np.float16).astype(np.float32)
    step = d[:, None] * blocks["scales"][:, si].astype(np.float32)
    return (step * (q - 32).astype(np.float32)).reshape(shape)


def load_model(d, dtype=torch.float32, kv_dtype=None, weights="auto", q4_k_quantize=None, matmul_input=None,
               attn_input=None):
    """CausalLM of directory d with its weights upcast (or cast) to dtype;
    kv_dtype (e.g. torch.bfloat16): K and V rounded to it, as a cache of
    that type keeps them; weights "q8_0": every layer matrix replaced by
    its Q8_0 blocks dequantized and its input rounded by q8_act (what
    kvtier --weights q8_0 multiplies; the Linear-named families only, not
    GPT-2's Conv1D layers); weights "q4_k": the same with Q4_K blocks from
    q4_k_quantize (float32 matrix -> Q4_K_DTYPE array) for matrices whose
    rows are whole super-blocks, Q8_0 for the others, as kvtier falls back;
    matmul_input (torch.bfloat16): the input of every weight matrix, the
    head's included, rounded to it, as PyTorch's bf16 matmul takes its bf16
    input (and kvtier's CPU backend rounds it for bf16 weights on
    AVX512_BF16), the products summed in dtype; attn_input (torch.bfloat16),
    with kv_dtype bfloat16: attention's query and softmax weights rounded to
    it, as that level's attention rounds them over a bf16 cache whatever the
    weights (weighted_values)."""
    m = build_model(load_config(d))
    m.head_input = matmul_input
    if matmul_input is not None:
        for mod in m.modules():
            if isinstance(mod, (nn.Linear, Conv1D)):
                mod.register_forward_pre_hook(lambda _mod, args: (round_to(args[0], matmul_input),))
    for mod in m.modules():
        if isinstance(mod, (Attention, GPT2Attention)):
            mod.kv_dtype = kv_dtype
            mod.attn_input = attn_input if kv_dtype is torch.bfloat16 else None
    sd = load_checkpoint(d)
    if m.tied:
        sd.pop("lm_head.weight", None)  # some tied checkpoints still carry it
    if weights in ("q8_0", "q4_k"):
        whole = m.arch != "MambaForCausalLM"  # Mamba: only matrices whose rows are whole blocks
        for k in [k for k in sd if Q8_0_LAYER_MATS.match(k) and (whole or sd[k].shape[-1] % Q8_0_BLOCK == 0)]:
            w = sd[k].float().numpy()
            if weights == "q4_k" and w.shape[-1] % Q4_K_BLOCK == 0:
                sd[k] = torch.from_numpy(q4_k_dequantize(q4_k_quantize(w), w.shape))
            else:
                sd[k] = torch.from_numpy(q8_0_dequantize(q8_0_quantize(w), w.shape))
        for name, mod in m.named_modules():
            if Q8_0_LAYER_MATS.match(name + ".weight") and (whole or mod.in_features % Q8_0_BLOCK == 0):
                mod.register_forward_pre_hook(lambda _mod, args: (q8_act(args[0]),))
    elif weights != "auto":
        raise ValueError(f"weights {weights!r}: auto, q8_0 or q4_k")
    m.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    return m.to(dtype).eval()


# --------------------------------------------------------------------------
# Encoder-decoder models: T5ForConditionalGeneration and
# BartForConditionalGeneration.
#
# T5: no position embeddings; each stack's first self-attention layer owns
# a table [num_buckets, heads] of biases added to the unscaled scores by the
# bucket of the relative position key - query (the encoder's buckets split
# by sign, the decoder's causal ones not); every layer of the stack reuses
# that bias, cross-attention has none.  RMS-style T5LayerNorm (no mean, no
# bias, variance in f32) before each sublayer, residual after; FFN ReLU
# (v1.0, "relu") or gated tanh-GELU (v1.1/Flan, "gated-gelu"); a tied head
# multiplies the decoder output by d_model^-0.5 first.
# BART: learned positions whose row is position + 2, embeddings times
# sqrt(d_model) when scale_embedding, layernorm_embedding after the sum,
# post-norm LayerNorm blocks (residual add, then the norm), biased
# projections with q scaled by head_dim^-0.5, erf GELU, and final_logits_bias
# added to the tied head's logits.
# Both decode with a cache: per layer, the self-attention K/V grow by the
# step's tokens; the cross-attention K/V are projected once from the encoder
# output.  kv_dtype rounds both as a cache of that type keeps them.
# --------------------------------------------------------------------------
ENCDEC_ARCHS = ("T5ForConditionalGeneration", "BartForConditionalGeneration")


def t5_bucket(rel, bidirectional, num_buckets, max_distance):
    """T5's bucket of each relative position rel = key - query (a long
    tensor): exact below half the (per-sign) buckets, logarithmic up to
    max_distance, the last bucket beyond."""
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    max_exact = num_buckets // 2
    large = max_exact + (torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(rel < max_exact, rel, large)


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class EDAttention(nn.Module):
    """Self- or cross-attention of T5 (no biases, unscaled scores) or BART
    (biases, q scaled by head_dim^-0.5).  K/V of cross-attention come from
    the encoder output once (kv_once)."""

    def __init__(self, dim, heads, hd, bart, device=None):
        super().__init__()
        self.heads, self.hd, self.bart = heads, hd, bart
        names = ("q_proj", "k_proj", "v_proj", "out_proj") if bart else ("q", "k", "v", "o")
        self.names = names
        for n in names[:3]:
            setattr(self, n, nn.Linear(dim, heads * hd, bias=bart, device=device))
        setattr(self, names[3], nn.Linear(heads * hd, dim, bias=bart, device=device))
        self.kv_dtype = None

    def kv(self, x):
        """[B, H, T, hd] K and V of x, rounded to the cache's type."""
        b, t, _ = x.shape
        k = getattr(self, self.names[1])(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        v = getattr(self, self.names[2])(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        if self.kv_dtype is not None:
            k, v = k.to(self.kv_dtype).to(x.dtype), v.to(self.kv_dtype).to(x.dtype)
        return k, v

    def forward(self, x, k, v, bias):
        """x [B, T, dim] queries over k, v [B, H, S, hd]; bias: additive
        [H, T, S] (relative bias and mask) or None."""
        b, t, _ = x.shape
        q = getattr(self, self.names[0])(x)
        if self.bart:
            q = q * self.hd ** -0.5
        q = q.view(b, t, self.heads, self.hd).transpose(1, 2)
        s = torch.matmul(q, k.transpose(2, 3))
        if bias is not None:
            s = s + bias
        p = F.softmax(s.float(), dim=-1).to(q.dtype)
        o = torch.matmul(p, v).transpose(1, 2).reshape(b, t, self.heads * self.hd)
        return getattr(self, self.names[3])(o)


class EDLayer(nn.Module):
    """One block of either stack, holding its parameters under the HF names
    (T5: layer.N.*; BART: self_attn, encoder_attn, fc1, fc2 and norms)."""

    def __init__(self, cfg, decoder, device=None):
        super().__init__()
        self.bart = arch_of(cfg) == "BartForConditionalGeneration"
        self.decoder = decoder
        if self.bart:
            d = cfg["d_model"]
            heads = cfg["decoder_attention_heads" if decoder else "encoder_attention_heads"]
            ffn = cfg["decoder_ffn_dim" if decoder else "encoder_ffn_dim"]
            self.self_attn = EDAttention(d, heads, d // heads, True, device)
            self.self_attn_layer_norm = nn.LayerNorm(d, eps=1e-5, device=device)
            if decoder:
                self.encoder_attn = EDAttention(d, heads, d // heads, True, device)
                self.encoder_attn_layer_norm = nn.LayerNorm(d, eps=1e-5, device=device)
            self.fc1 = nn.Linear(d, ffn, device=device)
            self.fc2 = nn.Linear(ffn, d, device=device)
            self.final_layer_norm = nn.LayerNorm(d, eps=1e-5, device=device)
            return
        d, heads, hd, ffn = cfg["d_model"], cfg["num_heads"], cfg["d_kv"], cfg["d_ff"]
        eps = cfg.get("layer_norm_epsilon", 1e-6)
        self.gated = cfg.get("feed_forward_proj", "relu").startswith("gated-")
        subs = [nn.ModuleDict({"SelfAttention": EDAttention(d, heads, hd, False, device),
                               "layer_norm": RMSNorm(d, eps, device)})]
        if decoder:
            subs.append(nn.ModuleDict({"EncDecAttention": EDAttention(d, heads, hd, False, device),
                                       "layer_norm": RMSNorm(d, eps, device)}))
        ff = nn.ModuleDict({"wo": nn.Linear(ffn, d, bias=False, device=device)})
        if self.gated:
            ff["wi_0"] = nn.Linear(d, ffn, bias=False, device=device)
            ff["wi_1"] = nn.Linear(d, ffn, bias=False, device=device)
        else:
            ff["wi"] = nn.Linear(d, ffn, bias=False, device=device)
        subs.append(nn.ModuleDict({"DenseReluDense": ff, "layer_norm": RMSNorm(d, eps, device)}))
        self.layer = nn.ModuleList(subs)

    def attns(self):
        """(self-attention, cross-attention or None)."""
        if self.bart:
            return self.self_attn, getattr(self, "encoder_attn", None)
        return self.layer[0]["SelfAttention"], self.layer[1]["EncDecAttention"] if self.decoder else None

    def forward(self, x, self_kv, self_bias, cross_kv):
        """self_kv: this layer's (K, V) including x's own rows; cross_kv:
        the encoder output's (decoder only)."""
        sa, ca = self.attns()
        if self.bart:
            x = self.self_attn_layer_norm(x + sa(x, *self_kv, self_bias))
            if ca is not None:
                x = self.encoder_attn_layer_norm(x + ca(x, *cross_kv, None))
            return self.final_layer_norm(x + self.fc2(F.gelu(self.fc1(x))))
        x = x + sa(self.layer[0]["layer_norm"](x), *self_kv, self_bias)
        if ca is not None:
            x = x + ca(self.layer[1]["layer_norm"](x), *cross_kv, None)
        ff = self.layer[-1]["DenseReluDense"]
        h = self.layer[-1]["layer_norm"](x)
        h = gelu_tanh(ff["wi_0"](h)) * ff["wi_1"](h) if self.gated else F.relu(ff["wi"](h))
        return x + ff["wo"](h)

    def self_kv_input(self, x):
        """What this layer's self-attention projects K, V from."""
        return x if self.bart else self.layer[0]["layer_norm"](x)


class EDStack(nn.Module):
    def __init__(self, cfg, decoder, device=None):
        super().__init__()
        self.cfg = cfg
        self.bart = arch_of(cfg) == "BartForConditionalGeneration"
        self.decoder = decoder
        if self.bart:
            n = cfg["decoder_layers" if decoder else "encoder_layers"]
            d = cfg["d_model"]
            self.embed_positions = nn.Embedding(cfg["max_position_embeddings"] + 2, d, device=device)
            self.layernorm_embedding = nn.LayerNorm(d, eps=1e-5, device=device)
            self.layers = nn.ModuleList(EDLayer(cfg, decoder, device) for _ in range(n))
        else:
            n = cfg.get("num_decoder_layers") or cfg["num_layers"] if decoder else cfg["num_layers"]
            self.block = nn.ModuleList(EDLayer(cfg, decoder, device) for _ in range(n))
            self.block[0].layer[0]["SelfAttention"].relative_attention_bias = nn.Embedding(
                cfg.get("relative_attention_num_buckets", 32), cfg["num_heads"], device=device)
            self.final_layer_norm = RMSNorm(cfg["d_model"], cfg.get("layer_norm_epsilon", 1e-6), device)

    def blocks(self):
        return self.layers if self.bart else self.block

    def bias(self, q0, t, s):
        """Additive [H, t, s] scores bias of queries at q0.. over keys 0..s:
        T5's relative bias (+ the decoder's causal mask), BART's mask."""
        q = torch.arange(q0, q0 + t)[:, None]
        k = torch.arange(s)[None, :]
        mask = torch.zeros(t, s).masked_fill(k > q, float("-inf")) if self.decoder else torch.zeros(t, s)
        if self.bart:
            return mask[None]
        c = self.cfg
        b = t5_bucket(k - q, not self.decoder, c.get("relative_attention_num_buckets", 32),
                      c.get("relative_attention_max_distance", 128))
        return self.block[0].layer[0]["SelfAttention"].relative_attention_bias(b).permute(2, 0, 1) + mask[None]

    def forward(self, x, cache=None, enc=None):
        """x: embedded inputs [1, T, dim] (BART: before positions).  cache
        (decoder): {"self": [(K, V)] per layer, "cross": [(K, V)]}, grown
        in place; the encoder has none (every token sees every other)."""
        past = cache["self"][0][0].shape[2] if cache and cache["self"] else 0
        t = x.shape[1]
        if self.bart:
            x = self.layernorm_embedding(x + self.embed_positions(torch.arange(past, past + t) + 2))
        bias = self.bias(past, t, past + t)
        for i, blk in enumerate(self.blocks()):
            sa, ca = blk.attns()
            k, v = sa.kv(blk.self_kv_input(x))
            if cache is not None:
                if len(cache["self"]) > i:
                    pk, pv = cache["self"][i]
                    k, v = torch.cat((pk, k), 2), torch.cat((pv, v), 2)
                    cache["self"][i] = (k, v)
                else:
                    cache["self"].append((k, v))
                if len(cache["cross"]) <= i:
                    cache["cross"].append(ca.kv(enc))
            x = blk(x, (k, v), bias, cache["cross"][i] if cache is not None else None)
        return x if self.bart else self.final_layer_norm(x)


class EncDecLM(nn.Module):
    def __init__(self, cfg, device=None):
        super().__init__()
        self.cfg = cfg
        self.arch = arch_of(cfg)
        self.bart = self.arch == "BartForConditionalGeneration"
        self.tied = bool(cfg.get("tie_word_embeddings", True))
        d, vocab = cfg["d_model"], cfg["vocab_size"]
        if self.bart:
            if cfg.get("activation_function", "gelu") != "gelu" or cfg.get("normalize_before", False) or \
                    cfg.get("add_final_layer_norm", False):
                raise ValueError("config.json: only BART's gelu, post-norm layout is supported")
            self.model = nn.Module()
            self.model.shared = nn.Embedding(vocab, d, device=device)
            self.model.encoder = EDStack(cfg, False, device)
            self.model.decoder = EDStack(cfg, True, device)
            self.register_buffer("final_logits_bias", torch.zeros(1, vocab, device=device))
        else:
            if cfg.get("feed_forward_proj", "relu") not in ("relu", "gated-gelu"):
                raise ValueError(f"config.json: feed_forward_proj {cfg['feed_forward_proj']!r} (relu, gated-gelu)")
            self.shared = nn.Embedding(vocab, d, device=device)
            self.encoder = EDStack(cfg, False, device)
            self.decoder = EDStack(cfg, True, device)
        if not self.tied:
            self.lm_head = nn.Linear(d, vocab, bias=False, device=device)

    def stacks(self):
        return (self.model.encoder, self.model.decoder) if self.bart else (self.encoder, self.decoder)

    def embed(self, ids):
        emb = self.model.shared if self.bart else self.shared
        x = emb(torch.as_tensor(ids).view(1, -1))
        if self.bart and self.cfg.get("scale_embedding", False):
            x = x * math.sqrt(self.cfg["d_model"])
        return x

    def encode(self, ids):
        """[1, S, dim] encoder output."""
        return self.stacks()[0](self.embed(ids))

    def new_cache(self):
        return {"self": [], "cross": []}

    def decode(self, ids, enc, cache):
        """[T, vocab] f32 logits of decoder tokens ids fed after the cache's."""
        h = self.stacks()[1](self.embed(ids), cache, enc)[0]
        emb = self.model.shared.weight if self.bart else self.shared.weight
        if self.tied and not self.bart:
            h = h * self.cfg["d_model"] ** -0.5
        logits = F.linear(h, emb if self.tied else self.lm_head.weight)
        if self.bart:
            logits = logits + self.final_logits_bias[0]
        return logits.float()


def load_encdec(d, dtype=torch.float32, kv_dtype=None):
    """EncDecLM of directory d, weights cast to dtype; kv_dtype: the caches'
    K and V rounded to it."""
    m = EncDecLM(load_config(d))
    for mod in m.modules():
        if isinstance(mod, EDAttention):
            mod.kv_dtype = kv_dtype
    sd = load_checkpoint(d)
    if m.tied:
        sd.pop("lm_head.weight", None)
    m.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    return m.to(dtype).eval()
