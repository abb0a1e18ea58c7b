#!/usr/bin/python3
"""train.py - trains the built-in model (docs/builtin-model.md).

    nice -n 10 /usr/bin/python3 tools/train.py --out model/builtin

Run tools/train_tokenizer.py --out DIR first (it writes tokenizer.json and
validation.txt).  Trains a small LlamaForCausalLM (tools/torchref.py) on the
training chapters of the KJV plus a few chat-formatted rows, then writes
config.json, generation_config.json, model.safetensors and metrics.json
(with the validation perplexity, measured as `ppl_windows` describes) into
DIR.  Deterministic: fixed seed, fixed step count, fixed thread count, so the
same torch build on the same CPU gives the same weights.
--bench N times N steps and exits without writing anything.
"""
import argparse
import json
import math
import os
import random
import sys
import time

# One thread everywhere: on the shared 2-core machine one thread trained
# faster than two (measured), and a fixed thread count keeps the float
# reductions, hence the weights, reproducible.  Set before torch loads BLAS.
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchref  # noqa: E402
import train_tokenizer as tt  # noqa: E402

SEQ = 512          # training rows and validation windows: BOS + 511 tokens of input
CHAT_EVERY = 10    # one row in CHAT_EVERY is a chat conversation (makes the chat template meaningful)


def model_config(vocab, special, a):
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": a.dim,
        "intermediate_size": a.ffn,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.dim // a.heads,
        "max_position_embeddings": SEQ,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": special[tt.BOS],
        "eos_token_id": [special[tt.EOS], special[tt.IM_END]],
        "pad_token_id": special[tt.EOS],
        "torch_dtype": "float32",
    }


def generation_config(cfg):
    return {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
        "do_sample": True,
        "temperature": 0.8,
        "max_new_tokens": 200,
    }


def ppl_windows(ids, bos):
    """The validation windowing, shared with tools/kvtier-ppl.c: ids are cut
    into consecutive chunks of SEQ tokens (the last may be shorter); chunk c
    is fed as a fresh sequence [BOS] + c[:-1] and its logits at position i
    predict c[i].  Yields (input, target) pairs."""
    for s in range(0, len(ids), SEQ):
        c = ids[s:s + SEQ]
        yield [bos] + c[:-1], c


@torch.no_grad()
def perplexity(model, ids, bos):
    model.eval()
    nll, n = 0.0, 0
    for x, y in ppl_windows(ids, bos):
        logits = model(torch.tensor([x]))[0].double()
        nll -= F.log_softmax(logits, dim=-1)[torch.arange(len(y)), torch.tensor(y)].sum().item()
        n += len(y)
    model.train()
    return math.exp(nll / n), n


class Rows:
    """Training rows of SEQ + 1 tokens (input = row[:-1], target = row[1:]).
    Plain rows are BOS + a random span of the training text; chat rows are
    BOS + conversations where the user gives a verse and the assistant
    answers with the verses that follow it."""

    def __init__(self, enc, chapters, special, rng):
        self.rng = rng
        self.special = special
        self.stream = enc.encode(tt.chapters_text(chapters))
        self.verses = [enc.encode(v) for c in chapters for v in c]
        self.nl = enc.encode("\n")
        self.role = {r: enc.encode(r + "\n") for r in ("user", "assistant")}

    def turn(self, role, ids):
        return [self.special[tt.IM_START]] + self.role[role] + ids + [self.special[tt.IM_END]] + self.nl

    def chat(self):
        row = [self.special[tt.BOS]]
        v = self.rng.randrange(len(self.verses))
        while len(row) <= SEQ:
            row += self.turn("user", self.verses[v % len(self.verses)])
            k = self.rng.randint(1, 2)
            answer = [t for j in range(1, k + 1) for t in self.verses[(v + j) % len(self.verses)] + self.nl]
            row += self.turn("assistant", answer[:-len(self.nl)])
            v += k + 1
        return row[:SEQ + 1]

    def plain(self):
        o = self.rng.randrange(len(self.stream) - SEQ)
        return [self.special[tt.BOS]] + self.stream[o:o + SEQ]

    def batch(self, n):
        rows = [self.chat() if self.rng.randrange(CHAT_EVERY) == 0 else self.plain() for _ in range(n)]
        t = torch.tensor(rows)
        return t[:, :-1], t[:, 1:]


def init_weights(model, std):
    """GPT-style init (HF's initializer_range): N(0, std) matrices and
    embeddings, norms at one.  torch's defaults (N(0,1) embeddings) would make
    the tied output layer start with huge logits."""
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def lr_at(step, a):
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    f = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * f)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory with tokenizer.json; receives the model")
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=1400)
    ap.add_argument("--batch", type=int, default=4, help="rows of 512 tokens per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--bench", type=int, default=0, help="time this many steps and exit")
    a = ap.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    enc = tt.Encoder.load(os.path.join(a.out, "tokenizer.json"))
    vocab = len(enc.vocab) + len(enc.special)
    cfg = model_config(vocab, enc.special, a)
    train_ch, val_ch = tt.split_chapters(tt.load_chapters())
    with open(os.path.join(a.out, "validation.txt"), encoding="utf-8") as f:
        val_text = f.read()
    if val_text != tt.chapters_text(val_ch):
        sys.exit("train.py: %s/validation.txt is not this corpus's split; rerun train_tokenizer.py" % a.out)
    val_ids = enc.encode(val_text)
    rows = Rows(enc, train_ch, enc.special, random.Random(a.seed))

    model = torchref.CausalLM(cfg)
    init_weights(model, cfg["initializer_range"])
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    print("params %d, train tokens %d, validation tokens %d" % (n_params, len(rows.stream), len(val_ids)),
          flush=True)
    steps = a.bench or a.steps
    t0 = time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a)
        x, y = rows.batch(a.batch)
        loss = F.cross_entropy(model(x).view(-1, vocab), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0 or step == steps - 1:
            el = time.time() - t0
            print("step %d loss %.4f lr %.2e %.0fs %.0f tok/s" % (step, loss.item(), lr_at(step, a), el,
                                                                 (step + 1) * a.batch * SEQ / el), flush=True)
    train_s = time.time() - t0
    if a.bench:
        return
    ppl, n_val = perplexity(model, val_ids, enc.special[tt.BOS])
    print("validation perplexity %.4f over %d tokens; trained in %.0f s" % (ppl, n_val, train_s), flush=True)

    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    torchref.save_safetensors(os.path.join(a.out, "model.safetensors"), tensors, {"format": "pt"})
    tt.write_json(os.path.join(a.out, "config.json"), cfg)
    tt.write_json(os.path.join(a.out, "generation_config.json"), generation_config(cfg))
    tt.write_json(os.path.join(a.out, "metrics.json"), {
        "validation_file": "validation.txt",
        "validation_tokens": n_val,
        "validation_perplexity": round(ppl, 4),
        "windowing": "tokens of validation.txt (no special tokens) in consecutive chunks of %d; chunk c is fed as "
                     "a fresh sequence [BOS] + c[:-1] and the logits at position i predict c[i]" % SEQ,
        "parameters": n_params,
        "train_tokens": len(rows.stream),
        "steps": a.steps,
        "batch_rows": a.batch,
        "seq_len": SEQ,
        "train_seconds": round(train_s),
        "command": "nice -n 10 /usr/bin/python3 tools/train.py --out " + a.out + "".join(
            " --%s %s" % (k.replace("_", "-"), v) for k, v in sorted(vars(a).items()) if k not in ("out", "bench")),
    })


if __name__ == "__main__":
    main()
