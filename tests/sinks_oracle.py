"""sinks_oracle - a PyTorch StreamingLLM (attention sinks) reference for the
sink strategy, on tools/torchref.py's modules and weights.

    sinks_oracle.py --model DIR --dump FILE --window W --sinks S [--tol T]

FILE is a KVTL dump (tools/kvtier-run.c) of a greedy generation with the
sink strategy (tools/kvtier-bench-sinks --dump): the prompt fed as one step,
then one token per step.  The oracle replays the same steps the way
mit-han-lab/streaming-llm's pos_shift attention does, with HF SinkCache's
counting:

- keys are cached before RoPE; before a step of n tokens on a cache of L,
  when L > 0 and L + n > W, the cache keeps its first S entries and its last
  max(0, W - S - n) (nothing else is ever dropped, and a first input is
  kept whole);
- every key is rotated at its index in the cache and every query at its own
  index in the cache, so attention sees positions 0..len-1 whatever the
  absolute position (SinkCache's re-rotation, without its over-rotation at
  the first shift).

Checks: every logits row within --tol of kvtier's, every generated token the
oracle's argmax, and (so that the comparison can fail) that past the window
a plain full-attention forward of torchref disagrees with kvtier by far more
than --tol.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchref  # noqa: E402
from ref_compare import read_dump  # noqa: E402


class SinkOracle:
    def __init__(self, model, window, sinks):
        self.m, self.w, self.s = model, window, sinks
        self.k = [None] * len(model.model.layers)  # per layer [1, Hkv, T, hd], before RoPE
        self.v = [None] * len(model.model.layers)

    def evict(self, n):
        """SinkCache's shift, on unrotated keys: sinks + the last W-S-n."""
        length = 0 if self.k[0] is None else self.k[0].shape[2]
        if length == 0 or length + n <= self.w:
            return
        keep = max(0, self.w - self.s - n)
        for i in range(len(self.k)):
            for c in (self.k, self.v):
                c[i] = torch.cat((c[i][:, :, :self.s], c[i][:, :, length - keep:length]), dim=2)

    def attention(self, i, a, h):
        """One layer's attention over the cache (torchref.Attention's maths
        with cache indices for positions)."""
        b, t, _ = h.shape
        q = a.q_proj(h).view(b, t, a.n_heads, a.hd)
        k = a.k_proj(h).view(b, t, a.n_kv, a.hd)
        v = a.v_proj(h).view(b, t, a.n_kv, a.hd)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        self.k[i] = k if self.k[i] is None else torch.cat((self.k[i], k), dim=2)
        self.v[i] = v if self.v[i] is None else torch.cat((self.v[i], v), dim=2)
        total = self.k[i].shape[2]
        cos, sin = self.m.model.rope_tables(self.m.model.inv_freq, total, h.dtype)  # indices 0..total-1
        q = torchref.apply_rope(q.transpose(1, 2), cos[total - t:], sin[total - t:])
        kr = torchref.apply_rope(self.k[i], cos, sin)
        rep = a.n_heads // a.n_kv
        kr, vr = torchref.repeat_kv(kr, rep), torchref.repeat_kv(self.v[i], rep)
        # query j (cache index total-t+j) sees keys 0..total-t+j
        mask = torchref.causal_mask(total, None, h.device)[total - t:]
        s = torch.matmul(q, kr.transpose(2, 3)) * (a.hd ** -0.5) + mask
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        o = torch.matmul(p, vr).transpose(1, 2).reshape(b, t, a.n_heads * a.hd)
        return a.o_proj(o)

    def step(self, ids):
        """Feeds ids (1-D) as one step; returns the last token's logits."""
        self.evict(len(ids))
        m = self.m
        x = m.model.embed_tokens(torch.tensor([ids]))
        for i, layer in enumerate(m.model.layers):
            x = x + self.attention(i, layer.self_attn, layer.input_layernorm(x))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        x = m.model.norm(x)
        w = m.model.embed_tokens.weight if m.tied else m.lm_head.weight
        return torch.nn.functional.linear(x[0, -1], w)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--window", type=int, required=True)
    ap.add_argument("--sinks", type=int, required=True)
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args(argv)
    tokens, n_prompt, got = read_dump(a.dump)
    model = torchref.load_model(a.model)
    if any(model.model.windows):
        sys.exit("sinks_oracle: the model has sliding layers; the sink strategy refuses those")
    oracle = SinkOracle(model, a.window, a.sinks)
    worst, worst_at, bad = 0.0, -1, 0
    with torch.no_grad():
        ref = []
        for g in range(got.shape[0]):
            feed = tokens[:n_prompt] if g == 0 else tokens[n_prompt + g - 1:n_prompt + g]
            row = oracle.step([int(t) for t in feed]).double()
            ref.append(row)
            err = (row - torch.from_numpy(got[g].copy()).double()).abs().max().item()
            if err > worst:
                worst, worst_at = err, g
            if int(row.argmax()) != int(tokens[n_prompt + g]):
                bad += 1
        plain = model(torch.from_numpy(tokens[None, :-1].copy()))[0, n_prompt - 1:].double()
    past = [g for g in range(got.shape[0]) if n_prompt + g >= a.window + 8]
    plain_err = max(((plain[g] - ref[g]).abs().max().item() for g in past), default=0.0)
    print(f"sinks_oracle: {got.shape[0]} rows, window {a.window}, {a.sinks} sinks: max |kvtier - oracle| = "
          f"{worst:.3g} (row {worst_at}), {bad} tokens not the oracle's argmax; full attention differs by "
          f"{plain_err:.3g} past the window")
    if worst > a.tol or bad:
        return 1
    if past and plain_err <= 100 * a.tol:
        print("sinks_oracle: the oracle does not tell sinks from full attention; the comparison proves nothing")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
