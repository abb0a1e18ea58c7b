#!/usr/bin/python3
"""ref_selfcheck - checks the PyTorch reference (tools/torchref.py) and the
model generator (tools/mkmodel.py) against hand computations, so the oracle
the C forward pass is compared with is itself checked.

  * a second, deliberately naive forward pass (float64 numpy, one token and
    one head at a time, RoPE as a rotation of the pairs (i, i + hd/2), GQA
    by index h // group, the window as an explicit range) must match
    CausalLM for every architecture and feature, and EncDecLM's decoder
    logits for T5 (relu / gated tanh-GELU, tied / untied head, relative
    position buckets) and BART (learned positions, scaled embeddings);
  * RoPE against the complex-number rotation, llama3 inv_freq against
    values worked out by hand, repeat_kv, the sliding mask;
  * which layers slide under HF's per-architecture rules;
  * safetensors bytes written by hand, and a save/load round trip;
  * mkmodel: shards hold the same weights as one file, the tokenizer's ids
    and merges are consistent, the config matches its options;
  * ref_compare: accepts a faithful dump, rejects each kind of wrong one.

Usage: /usr/bin/python3 tests/ref_selfcheck.py   (exit 0 = all passed)
"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(HERE, "..", "tools")
sys.path.insert(0, TOOLS)
import mkmodel as mkm  # noqa: E402
import torchref as tr  # noqa: E402

torch.set_num_threads(2)
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def close(a, b, tol, what):
    err = float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))
    check(err <= tol, f"{what} (max err {err:.3g} <= {tol:g})")


# ---------------------------------------------------------------------------
# The naive forward: float64, loops, direct formulas.
# ---------------------------------------------------------------------------
def naive_rmsnorm(x, w, eps):
    return w * (x / math.sqrt(float(np.mean(x * x)) + eps))


def naive_rope(v, pos, inv_freq, mscale=1.0):
    """Rotates pair (v[i], v[i + rot/2]) by angle pos * inv_freq[i], rot =
    2 * len(inv_freq) <= len(v), cos and sin times mscale; the dimensions
    past rot pass through."""
    h = len(inv_freq)
    out = v.copy()
    for i in range(h):
        c, s = mscale * math.cos(pos * inv_freq[i]), mscale * math.sin(pos * inv_freq[i])
        out[i] = v[i] * c - v[i + h] * s
        out[i + h] = v[i] * s + v[i + h] * c
    return out


def naive_gelu_tanh(v):
    return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))


def naive_forward(cfg, sd, ids, inv_freq, windows, inv_local=None, mscale=1.0):
    """inv_local: Gemma 3's sliding layers' RoPE frequencies; mscale:
    longrope's factor on cos and sin."""
    P = {k: v.double().numpy() for k, v in sd.items()}
    eps = cfg.get("rms_norm_eps", 1e-6)
    H, Hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], tr.head_dim_of(cfg)
    arch = cfg["architectures"][0]
    gemma = arch in tr.GEMMA
    # Gemma's defaults where the config is silent (Gemma2Config / Gemma3TextConfig)
    scale = float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else 1 / math.sqrt(hd)
    g2 = arch == "Gemma2ForCausalLM"
    attn_cap = cfg.get("attn_logit_softcapping", 50.0 if g2 else None) if gemma else None
    final_cap = cfg.get("final_logit_softcapping", 30.0 if g2 else None) if gemma else None
    T = len(ids)
    x = [P["model.embed_tokens.weight"][t] * (math.sqrt(cfg["hidden_size"]) if gemma else 1.0) for t in ids]

    def norm(v, name):
        w = P[name]
        return naive_rmsnorm(v, 1 + w if gemma else w, eps)

    def lin(name, v):
        y = P[name + ".weight"] @ v
        return y + P[name + ".bias"] if name + ".bias" in P else y

    for li, win in enumerate(windows):
        pre = f"model.layers.{li}."
        inv = inv_local if (win is not None and inv_local is not None) else inv_freq
        qs, ks, vs = [], [], []
        for t in range(T):
            hN = norm(x[t], pre + "input_layernorm.weight")
            if pre + "self_attn.qkv_proj.weight" in P:  # Phi-3: q, k, v rows of one matrix
                qkv = lin(pre + "self_attn.qkv_proj", hN)
                q, k, v = qkv[:H * hd], qkv[H * hd:(H + Hkv) * hd], qkv[(H + Hkv) * hd:]
            else:
                q, k, v = (lin(pre + "self_attn." + n, hN) for n in ("q_proj", "k_proj", "v_proj"))
            q, k = q.reshape(H, hd), k.reshape(Hkv, hd)
            if pre + "self_attn.q_norm.weight" in P:
                q = np.stack([norm(r, pre + "self_attn.q_norm.weight") for r in q])
                k = np.stack([norm(r, pre + "self_attn.k_norm.weight") for r in k])
            qs.append(np.stack([naive_rope(r, t, inv, mscale) for r in q]))
            ks.append(np.stack([naive_rope(r, t, inv, mscale) for r in k]))
            vs.append(v.reshape(Hkv, hd))
        new_x = []
        for t in range(T):
            first = 0 if win is None else max(0, t - win + 1)
            heads = []
            for h in range(H):
                g = h // (H // Hkv)
                sc = [float(qs[t][h] @ ks[j][g]) * scale for j in range(first, t + 1)]
                if attn_cap:
                    sc = [attn_cap * math.tanh(s / attn_cap) for s in sc]
                m = max(sc)
                e = [math.exp(s - m) for s in sc]
                heads.append(sum(e[j - first] / sum(e) * vs[j][g] for j in range(first, t + 1)))
            a = lin(pre + "self_attn.o_proj", np.concatenate(heads))
            if gemma:
                xt = x[t] + norm(a, pre + "post_attention_layernorm.weight")
                hN = norm(xt, pre + "pre_feedforward_layernorm.weight")
                gate = lin(pre + "mlp.gate_proj", hN)
                f = lin(pre + "mlp.down_proj", naive_gelu_tanh(gate) * lin(pre + "mlp.up_proj", hN))
                new_x.append(xt + norm(f, pre + "post_feedforward_layernorm.weight"))
                continue
            xt = x[t] + a
            hN = norm(xt, pre + "post_attention_layernorm.weight")
            if pre + "mlp.gate_up_proj.weight" in P:  # Phi-3: gate rows, then up rows
                gu = lin(pre + "mlp.gate_up_proj", hN)
                gate, up = gu[:len(gu) // 2], gu[len(gu) // 2:]
            else:
                gate, up = lin(pre + "mlp.gate_proj", hN), lin(pre + "mlp.up_proj", hN)
            new_x.append(xt + lin(pre + "mlp.down_proj", gate / (1 + np.exp(-gate)) * up))
        x = new_x
    head = P["lm_head.weight"] if "lm_head.weight" in P else P["model.embed_tokens.weight"]
    logits = np.stack([head @ norm(v, "model.norm.weight") for v in x])
    return final_cap * np.tanh(logits / final_cap) if final_cap else logits


def randomize(model, seed):
    """Non-trivial values everywhere (norm weights not 1, biases not 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.5 if p.dim() == 1 else 1 / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if name.endswith("norm.weight") else 0.0))


def base_cfg(arch, **kw):
    cfg = {"architectures": [arch], "vocab_size": 50, "hidden_size": 24, "intermediate_size": 40,
           "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
           "rope_theta": 100.0}
    cfg.update(kw)
    return cfg


NAIVE_CASES = [
    ("llama GQA", base_cfg("LlamaForCausalLM")),
    ("llama tied + llama3 rope", base_cfg("LlamaForCausalLM", tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    ("llama linear rope + attention_bias", base_cfg("LlamaForCausalLM", attention_bias=True,
                                                    rope_scaling={"type": "linear", "factor": 2.0})),
    ("mistral window 3", base_cfg("MistralForCausalLM", sliding_window=3)),
    ("qwen2 bias, layer 1 slides", base_cfg("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=4,
                                           max_window_layers=1)),
    ("qwen3 head_dim 8 != 24/4, q/k norm", base_cfg("Qwen3ForCausalLM", head_dim=8, num_attention_heads=4,
                                                       layer_types=["sliding_attention", "full_attention"],
                                                       use_sliding_window=True, sliding_window=5)),
    ("gemma2 defaults (caps 50/30), window 4 on even layers",
     base_cfg("Gemma2ForCausalLM", head_dim=4, num_hidden_layers=3, sliding_window=4)),
    ("gemma2 low caps, query_pre_attn_scalar 6, layer_types",
     base_cfg("Gemma2ForCausalLM", head_dim=4, sliding_window=3, query_pre_attn_scalar=6,
              attn_logit_softcapping=0.5, final_logit_softcapping=2.0,
              layer_types=["full_attention", "sliding_attention"])),
    ("gemma3 q/k norm, pattern 2, local theta 10 vs 1e4 linear 2",
     base_cfg("Gemma3ForCausalLM", head_dim=8, num_hidden_layers=3, sliding_window=5, sliding_window_pattern=2,
              rope_theta=10000.0, rope_local_base_freq=10.0, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    ("phi3 fused, window 4", base_cfg("Phi3ForCausalLM", sliding_window=4)),
    ("phi3 partial rotary 0.5, longrope", base_cfg(
        "Phi3ForCausalLM", num_attention_heads=3, num_key_value_heads=1, partial_rotary_factor=0.5,
        max_position_embeddings=256, original_max_position_embeddings=32,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]})),
    ("phi3 longrope, 12 tokens past original_max_position_embeddings 8: long_factor", base_cfg(
        "Phi3ForCausalLM", num_attention_heads=3, num_key_value_heads=1, partial_rotary_factor=0.5,
        max_position_embeddings=64, original_max_position_embeddings=8,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [3.0, 4.0]})),
]


def check_naive_forward():
    ids = [3, 17, 9, 41, 0, 22, 22, 8, 49, 30, 5, 11]
    for i, (what, cfg) in enumerate(NAIVE_CASES):
        m = tr.CausalLM(cfg).double()
        randomize(m, 100 + i)
        with torch.no_grad():
            got = m(torch.tensor([ids, ids[::-1]]))  # batch of 2: rows must not mix
        sd = m.state_dict()
        inv = m.model.inv_freq.double().numpy()
        inv_local = None
        if tr.local_rope_theta(cfg) is not None:  # computed here, not taken from the model under test
            theta, hd = tr.local_rope_theta(cfg), tr.head_dim_of(cfg)
            inv_local = np.array([theta ** (-2 * i / hd) for i in range(hd // 2)])
        mscale = 1.0
        rs = cfg.get("rope_scaling") or {}
        if rs.get("type") == "longrope":  # worked out here from the definition
            rot, theta = len(rs["short_factor"]) * 2, cfg["rope_theta"]
            orig = cfg["original_max_position_embeddings"]
            ext = rs["long_factor" if len(ids) > orig else "short_factor"]  # one forward call of len(ids)
            inv = np.array([1 / (f * theta ** (2 * i / rot)) for i, f in enumerate(ext)])
            mscale = math.sqrt(1 + math.log(cfg["max_position_embeddings"] / orig) / math.log(orig))
        for b, seq in enumerate((ids, ids[::-1])):
            want = naive_forward(cfg, sd, seq, inv, tr.layer_windows(cfg), inv_local, mscale)
            # not 1e-12: CausalLM builds its RoPE tables in f32, as HF does
            close(got[b].numpy(), want, 2e-5, f"naive forward == CausalLM: {what}, batch row {b}")


def naive_gpt2(cfg, sd, ids):
    """GPT-2 from its definition: x = wte + wpe; per block x += c_proj(attn(
    LN(x))), x += mlp(LN(x)) with y = x W + b for the [in, out] weights."""
    P = {k: v.double().numpy() for k, v in sd.items()}
    H, dim, eps = cfg["n_head"], cfg["n_embd"], cfg.get("layer_norm_epsilon", 1e-5)
    hd = dim // H

    def ln(v, name):
        mu = float(np.mean(v))
        var = float(np.mean((v - mu) ** 2))
        return (v - mu) / math.sqrt(var + eps) * P[name + ".weight"] + P[name + ".bias"]

    def conv(name, v):
        return v @ P[name + ".weight"] + P[name + ".bias"]

    x = [P["transformer.wte.weight"][tok] + P["transformer.wpe.weight"][t] for t, tok in enumerate(ids)]
    for li in range(cfg["n_layer"]):
        pre = f"transformer.h.{li}."
        qkv = [conv(pre + "attn.c_attn", ln(v, pre + "ln_1")) for v in x]
        new_x = []
        for t in range(len(x)):
            heads = []
            for h in range(H):
                sl = slice(h * hd, (h + 1) * hd)
                sc = [float(qkv[t][:dim][sl] @ qkv[j][dim:2 * dim][sl]) / math.sqrt(hd) for j in range(t + 1)]
                m = max(sc)
                e = [math.exp(v - m) for v in sc]
                heads.append(sum(e[j] / sum(e) * qkv[j][2 * dim:][sl] for j in range(t + 1)))
            xt = x[t] + conv(pre + "attn.c_proj", np.concatenate(heads))
            f = conv(pre + "mlp.c_fc", ln(xt, pre + "ln_2"))
            f = 0.5 * f * (1 + np.tanh(math.sqrt(2 / math.pi) * (f + 0.044715 * f ** 3)))
            new_x.append(xt + conv(pre + "mlp.c_proj", f))
        x = new_x
    return np.stack([P["transformer.wte.weight"] @ ln(v, "transformer.ln_f") for v in x])


def check_naive_gpt2():
    cfg = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 50, "n_embd": 24, "n_layer": 2, "n_head": 4,
           "n_positions": 16, "n_inner": 40}
    ids = [3, 17, 9, 41, 0, 22, 22, 8, 49, 30, 5, 11]
    m = tr.build_model(cfg).double()
    randomize(m, 7)
    with torch.no_grad():
        got = m(torch.tensor([ids]))
    close(got[0].numpy(), naive_gpt2(cfg, m.state_dict(), ids), 1e-6, "naive forward == GPT2LM")
    check(tr.param_shapes(cfg)[2] == ("transformer.h.0.ln_1.weight", (24,)) and
          dict(tr.param_shapes(cfg))["transformer.h.0.attn.c_attn.weight"] == (24, 72),
          "GPT-2 state dict: HF names, Conv1D weights [in, out]")


def naive_mamba(cfg, sd, ids):
    """Mamba in float64, one token, one channel and one state element at a
    time: the recurrence as the paper writes it."""
    P = {k: v.double().numpy() for k, v in sd.items()}
    dim, inner, n, kern, rank = tr.mamba_dims(cfg)
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    x = [P["backbone.embeddings.weight"][t] for t in ids]
    for li in range(cfg["num_hidden_layers"]):
        pre = f"backbone.layers.{li}."
        M = lambda k: P[pre + "mixer." + k]  # noqa: E731
        u = [M("in_proj.weight") @ naive_rmsnorm(v, P[pre + "norm.weight"], eps) for v in x]
        h = np.zeros((inner, n))
        new_x = []
        for t, v in enumerate(x):
            xin, z = u[t][:inner], u[t][inner:]
            c = np.array([sum(M("conv1d.weight")[i, 0, k] * u[t - (kern - 1) + k][i]
                              for k in range(kern) if t - (kern - 1) + k >= 0) + M("conv1d.bias")[i]
                          for i in range(inner)])
            c = c / (1 + np.exp(-c))
            p = M("x_proj.weight") @ c
            dt = M("dt_proj.weight") @ p[:rank] + M("dt_proj.bias")
            dt = np.log1p(np.exp(dt))
            B, C = p[rank:rank + n], p[rank + n:]
            y = np.zeros(inner)
            for i in range(inner):
                for s in range(n):
                    h[i, s] = math.exp(-math.exp(M("A_log")[i, s]) * dt[i]) * h[i, s] + dt[i] * B[s] * c[i]
                y[i] = (h[i] @ C + M("D")[i] * c[i]) * z[i] / (1 + math.exp(-z[i]))
            new_x.append(v + M("out_proj.weight") @ y)
        x = new_x
    head = P.get("lm_head.weight", P["backbone.embeddings.weight"])
    return np.stack([head @ naive_rmsnorm(v, P["backbone.norm_f.weight"], eps) for v in x])


def check_naive_mamba():
    ids = [3, 17, 9, 41, 0, 22, 22, 8, 49, 30]
    for tie in (True, False):
        cfg = {"architectures": ["MambaForCausalLM"], "vocab_size": 50, "hidden_size": 24, "state_size": 4,
               "num_hidden_layers": 2, "expand": 2, "conv_kernel": 3, "tie_word_embeddings": tie}
        m = tr.build_model(cfg).double()
        randomize(m, 9)
        with torch.no_grad():
            got = m(torch.tensor([ids]))
            a, st = m.step(torch.tensor([ids[:4]]))
            b, st = m.step(torch.tensor([ids[4:5]]), st)
            c, _ = m.step(torch.tensor([ids[5:]]), st)
        close(got[0].numpy(), naive_mamba(cfg, m.state_dict(), ids), 1e-6,
              f"naive forward == MambaLM ({'tied' if tie else 'untied'} head)")
        close(torch.cat([a, b, c], 1)[0].numpy(), got[0].numpy(), 1e-9,
              "MambaLM: prefill + a step + the rest from the carried state == one pass")
    check(dict(tr.param_shapes(cfg))["backbone.layers.0.mixer.x_proj.weight"] == (2 + 8, 48) and
          dict(tr.param_shapes(cfg))["backbone.layers.0.mixer.conv1d.weight"] == (48, 1, 3),
          "Mamba state dict: HF names and shapes (time_step_rank auto = ceil(24 / 16))")


def naive_t5_bucket(rel, bidirectional, n, max_distance):
    """T5's bucket of one relative position rel = key - query.  The encoder
    splits the n buckets by sign (keys after the query in the upper half);
    the decoder's keys are never after it and use all n for the distance
    back.  In a range of m buckets, distances below m/2 have one each, then
    the bucket grows with log(distance) up to max_distance, the range's
    last bucket from there on."""
    first = 0
    if bidirectional:
        n //= 2
        first = n if rel > 0 else 0
        r = abs(rel)
    else:
        r = max(-rel, 0)
    exact = n // 2
    if r < exact:
        return first + r
    return first + min(n - 1, exact + int(math.log(r / exact) / math.log(max_distance / exact) * (n - exact)))


def naive_attend(q, keys, vals, heads, scale, bias):
    """q's attention over the rows keys / vals, one head at a time:
    softmax_j(scale * q_h . k_jh + bias(h, j)) weighting v_jh."""
    hd = len(q) // heads
    out = []
    for h in range(heads):
        sl = slice(h * hd, (h + 1) * hd)
        sc = [scale * float(q[sl] @ k[sl]) + bias(h, j) for j, k in enumerate(keys)]
        m = max(sc)
        e = [math.exp(s - m) for s in sc]
        out.append(sum(e[j] / sum(e) * vals[j][sl] for j in range(len(keys))))
    return np.concatenate(out)


def naive_t5(cfg, P, enc_ids, dec_ids):
    """T5 from its definition: no positions but a per-head bias on the
    unscaled scores, looked up by the bucket of key - query in the table of
    the stack's first layer and added in every layer (the decoder's buckets
    causal); before each sublayer x / rms(x) * w, after it the residual;
    cross-attention with no bias over the encoder's normed output; FFN
    relu(wi x) or gelu_tanh(wi_0 x) * wi_1 x; a tied head reads
    x * d_model^-0.5."""
    d, H = cfg["d_model"], cfg["num_heads"]
    eps = cfg.get("layer_norm_epsilon", 1e-6)
    nb, maxd = cfg.get("relative_attention_num_buckets", 32), cfg.get("relative_attention_max_distance", 128)
    gated = cfg.get("feed_forward_proj", "relu") == "gated-gelu"

    def norm(v, name):
        return naive_rmsnorm(v, P[name + ".weight"], eps)

    def W(name, v):
        return P[name + ".weight"] @ v

    def stack(name, ids, layers, enc=None):
        decoder = enc is not None
        table = P[name + ".block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        x = [P["shared.weight"][t] for t in ids]
        for li in range(layers):
            pre = f"{name}.block.{li}.layer."
            hN = [norm(v, pre + "0.layer_norm") for v in x]
            ks = [W(pre + "0.SelfAttention.k", v) for v in hN]
            vs = [W(pre + "0.SelfAttention.v", v) for v in hN]
            new_x = []
            for t in range(len(x)):
                seen = t + 1 if decoder else len(x)
                a = naive_attend(W(pre + "0.SelfAttention.q", hN[t]), ks[:seen], vs[:seen], H, 1.0,
                                 lambda h, j: table[naive_t5_bucket(j - t, not decoder, nb, maxd), h])
                new_x.append(x[t] + W(pre + "0.SelfAttention.o", a))
            x = new_x
            if decoder:
                ck = [W(pre + "1.EncDecAttention.k", e) for e in enc]
                cv = [W(pre + "1.EncDecAttention.v", e) for e in enc]
                x = [v + W(pre + "1.EncDecAttention.o",
                           naive_attend(W(pre + "1.EncDecAttention.q", norm(v, pre + "1.layer_norm")), ck, cv, H,
                                        1.0, lambda h, j: 0.0)) for v in x]
            ff = pre + ("2." if decoder else "1.")
            new_x = []
            for v in x:
                hN = norm(v, ff + "layer_norm")
                if gated:
                    f = naive_gelu_tanh(W(ff + "DenseReluDense.wi_0", hN)) * W(ff + "DenseReluDense.wi_1", hN)
                else:
                    f = np.maximum(W(ff + "DenseReluDense.wi", hN), 0.0)
                new_x.append(v + W(ff + "DenseReluDense.wo", f))
            x = new_x
        return [norm(v, name + ".final_layer_norm") for v in x]

    enc = stack("encoder", enc_ids, cfg["num_layers"])
    dec = stack("decoder", dec_ids, cfg.get("num_decoder_layers") or cfg["num_layers"], enc)
    if cfg.get("tie_word_embeddings", True):
        return np.stack([P["shared.weight"] @ (v * d ** -0.5) for v in dec])
    return np.stack([P["lm_head.weight"] @ v for v in dec])


def naive_bart(cfg, P, enc_ids, dec_ids):
    """BART from its definition: token embedding (times sqrt(d_model) when
    scale_embedding) plus the learned position's row p + 2, LayerNorm'd;
    post-norm blocks LN(x + sublayer(x)) with biased projections, scores
    divided by sqrt(head_dim), the decoder's causal, cross-attention over
    the encoder's output; FFN fc2(gelu_erf(fc1 x)); logits from the shared
    (tied) or own head plus final_logits_bias."""
    d = cfg["d_model"]
    emb_scale = math.sqrt(d) if cfg.get("scale_embedding", False) else 1.0

    def ln(v, name):
        mu = float(np.mean(v))
        var = float(np.mean((v - mu) ** 2))
        return (v - mu) / math.sqrt(var + 1e-5) * P[name + ".weight"] + P[name + ".bias"]

    def lin(name, v):
        return P[name + ".weight"] @ v + P[name + ".bias"]

    def attend(name, q_in, src, heads, causal_t=None):
        ks = [lin(name + ".k_proj", v) for v in src]
        vs = [lin(name + ".v_proj", v) for v in src]
        seen = len(src) if causal_t is None else causal_t + 1
        a = naive_attend(lin(name + ".q_proj", q_in), ks[:seen], vs[:seen], heads, (d // heads) ** -0.5,
                         lambda h, j: 0.0)
        return lin(name + ".out_proj", a)

    def stack(name, ids, enc=None):
        decoder = enc is not None
        side = "decoder" if decoder else "encoder"
        heads = cfg[side + "_attention_heads"]
        x = [ln(P["model.shared.weight"][tok] * emb_scale + P[f"model.{name}.embed_positions.weight"][p + 2],
                f"model.{name}.layernorm_embedding") for p, tok in enumerate(ids)]
        for li in range(cfg[side + "_layers"]):
            pre = f"model.{name}.layers.{li}."
            x = [ln(x[t] + attend(pre + "self_attn", x[t], x, heads, t if decoder else None),
                    pre + "self_attn_layer_norm") for t in range(len(x))]
            if decoder:
                x = [ln(v + attend(pre + "encoder_attn", v, enc, heads), pre + "encoder_attn_layer_norm") for v in x]
            x = [ln(v + lin(pre + "fc2", np.array([0.5 * u * (1 + math.erf(u / math.sqrt(2)))
                                                      for u in lin(pre + "fc1", v)])),
                    pre + "final_layer_norm") for v in x]
        return x

    dec = stack("decoder", dec_ids, stack("encoder", enc_ids))
    head = P["model.shared.weight"] if cfg.get("tie_word_embeddings", True) else P["lm_head.weight"]
    return np.stack([head @ v + P["final_logits_bias"][0] for v in dec])


# Through the 9 encoder and 8 decoder tokens, the 8-bucket case's distances
# reach the logarithmic and the last buckets of both signs, the others' stay
# exact.
ENCDEC_CASES = [
    ("t5 relu, untied head", ["--arch", "t5", "--ffn-kind", "relu", "--no-tie"]),
    ("t5 gated-gelu, tied head, 8 buckets to distance 6",
     ["--arch", "t5", "--ffn-kind", "gated-gelu", "--tie", "--buckets", "8", "--max-distance", "6"]),
    ("t5 gated-gelu, untied, d_kv 12 != 32/4, 3 decoder layers",
     ["--arch", "t5", "--ffn-kind", "gated-gelu", "--no-tie", "--head-dim", "12", "--dec-layers", "3"]),
    ("bart tied, final_logits_bias", ["--arch", "bart", "--tie"]),
    ("bart scale_embedding, untied, 2 heads, 3 decoder layers",
     ["--arch", "bart", "--no-tie", "--scale-embedding", "--heads", "2", "--dec-layers", "3"]),
]


def check_naive_encdec(tmp):
    enc_ids, dec_ids = [3, 141, 59, 26, 53, 58, 97, 93, 238], [0, 17, 230, 91, 150, 8, 44, 201]
    for i, (what, args) in enumerate(ENCDEC_CASES):
        d = os.path.join(tmp, f"encdec{i}")
        mkm.main(["--out", d, "--seed", str(20 + i), "--layers", "2", "--dim", "32", "--heads", "4",
                  "--ffn", "64", "--vocab", "260", "--max-pos", "16"] + args)
        cfg = tr.load_config(d)
        m = tr.load_encdec(d)
        with torch.no_grad():
            enc = m.encode(enc_ids)
            whole = m.decode(dec_ids, enc, m.new_cache())
            cache = m.new_cache()
            steps = torch.cat([m.decode(dec_ids[:6], enc, cache), m.decode(dec_ids[6:7], enc, cache),
                               m.decode(dec_ids[7:], enc, cache)])
        P = {k: v.double().numpy() for k, v in tr.load_checkpoint(d).items()}
        naive = naive_bart if cfg["architectures"][0] == "BartForConditionalGeneration" else naive_t5
        want = naive(cfg, P, enc_ids, dec_ids)
        scale = float(np.abs(want).max())  # errors relative to the largest logit (3 to 10 here)
        close(whole.numpy() / scale, want / scale, 1e-5, f"naive forward == EncDecLM, relative: {what}")
        close(steps.numpy() / scale, whole.numpy() / scale, 1e-5,
              f"EncDecLM: a 6-token prefill and 2 steps through the cache == one pass, relative: {what}")


# ---------------------------------------------------------------------------
# Pieces by hand
# ---------------------------------------------------------------------------
def check_pieces():
    # RoPE: the NeoX halves are the real and imaginary parts of hd/2 complex
    # numbers, each multiplied by e^{i pos theta_j}.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1, 5, 8, generator=g, dtype=torch.float64)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    ang = torch.outer(torch.arange(5, dtype=torch.float64), inv)
    emb = torch.cat((ang, ang), -1)
    got = tr.apply_rope(x, emb.cos(), emb.sin())
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(ang), ang)
    close(got.numpy(), torch.cat((z.real, z.imag), -1).numpy(), 1e-12, "RoPE == complex rotation of (x_i, x_i+hd/2)")

    # llama3: theta 1e4, head_dim 8 -> inv_freq 1, .1, .01, .001, wavelengths
    # 2pi/inv = 6.3, 63, 628, 6283 against the band [1024/high, 1024/low] =
    # [256, 1024] (original 1024, factor 8): the first two are kept, the last
    # divided by 8, and 628 interpolated with s = (1024/628.3 - 1) / 3:
    # (1 - s) * 0.01 / 8 + s * 0.01.
    cfg = base_cfg("LlamaForCausalLM", hidden_size=16, num_attention_heads=2, rope_theta=10000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024})
    close(tr.rope_inv_freq(cfg).numpy(), [1.0, 0.1, 0.003086760967011274, 0.000125], 1e-7,
          "llama3 inv_freq == hand-computed values")
    cfg["rope_scaling"] = {"type": "linear", "factor": 4.0}
    close(tr.rope_inv_freq(cfg).numpy(), [0.25, 0.025, 0.0025, 0.00025], 1e-9, "linear inv_freq == inv/4")
    cfg = base_cfg("Qwen3ForCausalLM", hidden_size=16, num_attention_heads=2, head_dim=4, rope_theta=100.0)
    close(tr.rope_inv_freq(cfg).numpy(), [1.0, 0.1], 1e-7, "qwen3 inv_freq uses explicit head_dim")

    # GQA: query head h reads kv head h // group
    kv = torch.arange(3, dtype=torch.float32).view(1, 3, 1, 1).expand(1, 3, 2, 4)
    rep = tr.repeat_kv(kv, 4)
    check([int(rep[0, h, 0, 0]) for h in range(12)] == [h // 4 for h in range(12)], "repeat_kv: head h -> kv h // 4")

    # the sliding mask: q sees k iff k <= q and q - k < window
    m = tr.causal_mask(6, 3, "cpu")
    vis = [[int(m[q, k] == 0) for k in range(6)] for q in range(6)]
    check(vis == [[1 if 0 <= q - k < 3 else 0 for k in range(6)] for q in range(6)] and vis[5] == [0, 0, 0, 1, 1, 1],
          "sliding mask, window 3: row 5 sees keys 3, 4, 5")

    # RMSNorm: x / sqrt(mean x^2 + eps) * w
    n = tr.RMSNorm(4, 1e-6)
    with torch.no_grad():
        n.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    close(n(torch.tensor([1.0, -1.0, 1.0, -1.0])).detach().numpy(), [1, -2, 3, -4], 1e-5, "RMSNorm of (1,-1,1,-1)")


def check_windows():
    L = lambda arch, **kw: tr.layer_windows(base_cfg(arch, num_hidden_layers=4, **kw))  # noqa: E731
    check(L("MistralForCausalLM") == [4096] * 4, "mistral: absent sliding_window -> HF default 4096 on all layers")
    check(L("MistralForCausalLM", sliding_window=None) == [None] * 4, "mistral: sliding_window null -> full")
    check(L("Qwen2ForCausalLM", sliding_window=8) == [None] * 4, "qwen2: no use_sliding_window -> full")
    check(L("Qwen2ForCausalLM", sliding_window=8, use_sliding_window=True, max_window_layers=2)
          == [None, None, 8, 8], "qwen2: layers >= max_window_layers slide")
    check(L("Qwen3ForCausalLM", sliding_window=8, use_sliding_window=True,
            layer_types=["sliding_attention", "full_attention"] * 2) == [8, None, 8, None],
          "qwen3: explicit layer_types")
    check(L("LlamaForCausalLM", sliding_window=8) == [None] * 4, "llama: never slides")


# ---------------------------------------------------------------------------
# safetensors and mkmodel
# ---------------------------------------------------------------------------
def check_safetensors(tmp):
    # bf16 0x3F80 = 1.0, 0xC040 = -3.0; f16 0x3C00 = 1.0; f32 0.5
    hdr = json.dumps({"b": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
                      "h": {"dtype": "F16", "shape": [1], "data_offsets": [4, 6]},
                      "f": {"dtype": "F32", "shape": [1, 1], "data_offsets": [6, 10]},
                      "__metadata__": {"format": "pt"}}).encode()
    path = os.path.join(tmp, "hand.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hdr)) + hdr + struct.pack("<HHHf", 0x3F80, 0xC040, 0x3C00, 0.5))
    t = tr.load_safetensors(path)
    check(t["b"].dtype == torch.bfloat16 and t["b"].float().tolist() == [1.0, -3.0], "load BF16 bytes by hand")
    check(t["h"].dtype == torch.float16 and t["h"].tolist() == [1.0], "load F16 bytes by hand")
    check(t["f"].shape == (1, 1) and t["f"].item() == 0.5, "load F32 bytes by hand")
    src = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.randn(2, 2).half()}
    tr.save_safetensors(path, src, {"format": "pt"})
    with open(path, "rb") as f:
        (hl,) = struct.unpack("<Q", f.read(8))
    back = tr.load_safetensors(path)
    check(hl % 8 == 0 and all(torch.equal(src[k], back[k]) and src[k].dtype == back[k].dtype for k in src),
          "save/load round trip, header padded to 8 bytes")


def mkmodel(out, *args):
    subprocess.run([sys.executable, os.path.join(TOOLS, "mkmodel.py"), "--out", out, *args], check=True)


def check_mkmodel(tmp):
    one, three = os.path.join(tmp, "one"), os.path.join(tmp, "three")
    args = ["--arch", "qwen3", "--dtype", "bf16", "--layers", "3", "--head-dim", "24", "--vocab", "300",
            "--window", "6", "--max-window-layers", "1", "--seed", "7"]
    mkmodel(one, *args)
    mkmodel(three, *args, "--shards", "3")
    a, b = tr.load_checkpoint(one), tr.load_checkpoint(three)
    check(os.path.exists(os.path.join(three, "model-00003-of-00003.safetensors"))
          and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a),
          "mkmodel --shards 3 holds the same tensors as one file")
    cfg = tr.load_config(one)
    check(cfg["head_dim"] == 24 and a["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 24, 64)
          and a["model.layers.0.self_attn.q_norm.weight"].shape == (24,) and tr.layer_windows(cfg) == [None, 6, 6],
          "mkmodel qwen3: explicit head_dim, q_norm, windows on layers >= 1")
    check(all(v.dtype == torch.bfloat16 for v in a.values()) and cfg["torch_dtype"] == "bfloat16", "bf16 weights")
    with open(os.path.join(one, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab, merges = tok["model"]["vocab"], tok["model"]["merges"]
    ids = sorted(list(vocab.values()) + [t["id"] for t in tok["added_tokens"]])
    check(ids == list(range(300)), "tokenizer ids are exactly 0..vocab-1")
    check(all(m.count(" ") == 1 and m.replace(" ", "") in vocab and all(p in vocab for p in m.split(" "))
              for m in merges), "every merge joins two vocab tokens into a vocab token")
    check(cfg["eos_token_id"] == 299 and cfg["bos_token_id"] == 298
          and tok["added_tokens"][1]["content"] == "<|end_of_text|>", "bos/eos ids point at the specials")
    m = tr.load_model(one)
    with torch.no_grad():
        logits = m(torch.tensor([list(range(0, 300, 15))]))[0]
    top2 = logits.topk(2, -1).values
    check(float(logits.std()) > 1.0 and float((top2[:, 0] - top2[:, 1]).min()) > 1e-3,
          f"random model has spread logits (std {float(logits.std()):.2f}, no near ties)")


def write_dump(path, prompt, gen, rows):
    with open(path, "wb") as f:
        f.write(b"KVTL" + struct.pack("<3i", len(prompt), len(gen), rows.shape[1]))
        f.write(np.asarray(list(prompt) + list(gen), "<i4").tobytes() + np.asarray(rows, "<f4").tobytes())


def check_ref_compare(tmp):
    """The comparer must accept a faithful dump and reject each kind of
    wrong one (so reference.test.sh can fail)."""
    import ref_compare
    d = os.path.join(tmp, "one")  # the qwen3 model check_mkmodel wrote
    m = tr.load_model(d)
    prompt, gen, rows = [5, 80, 13, 200, 7], [], []
    with torch.no_grad():
        for _ in range(6):  # greedy, recomputing the prefix each step
            r = m(torch.tensor([prompt + gen]))[0, -1]
            rows.append(r.numpy())
            gen.append(int(r.argmax()))
    rows = np.stack(rows)
    good = os.path.join(tmp, "good.kvtl")
    write_dump(good, prompt, gen, rows)

    def verdict(path, *extra):
        return ref_compare.main([d, path, "--tol", "1e-4", *extra])
    check(verdict(good, "--expect-gen", "6", "--same-tokens", good) == 0, "ref_compare accepts a faithful dump")
    bumped = rows.copy()
    bumped[3, 17] += 3e-4
    write_dump(os.path.join(tmp, "bumped.kvtl"), prompt, gen, bumped)
    check(verdict(os.path.join(tmp, "bumped.kvtl")) == 1, "ref_compare rejects one logit off by 3e-4")
    # the last token feeds no row, so only the argmax check can catch it
    worst = int(rows[-1].argmin())
    write_dump(os.path.join(tmp, "token.kvtl"), prompt, gen[:-1] + [worst], rows)
    check(verdict(os.path.join(tmp, "token.kvtl")) == 1, "ref_compare rejects a token that is not the argmax")
    check(verdict(good, "--same-tokens", os.path.join(tmp, "token.kvtl")) == 1,
          "ref_compare --same-tokens rejects different tokens")
    check(verdict(good, "--expect-gen", "7") == 1, "ref_compare --expect-gen rejects a short run")
    with open(good, "rb") as f:
        data = f.read()
    with open(os.path.join(tmp, "cut.kvtl"), "wb") as f:
        f.write(data[:-4])
    check(verdict(os.path.join(tmp, "cut.kvtl")) == 2, "ref_compare rejects a truncated dump")


def main():
    sys.path.insert(0, HERE)
    with tempfile.TemporaryDirectory() as tmp:
        check_pieces()
        check_windows()
        check_naive_forward()
        check_naive_gpt2()
        check_naive_mamba()
        check_naive_encdec(tmp)
        check_safetensors(tmp)
        check_mkmodel(tmp)
        check_ref_compare(tmp)
    print(f"ref_selfcheck: {len(failures)} failure(s)" + ("" if not failures else ": " + "; ".join(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
