#!/usr/bin/python3
"""beamref - Hugging Face transformers' beam search decisions over the
PyTorch reference model (tools/torchref.py), the oracle of kvtier's beams.

    /usr/bin/python3 tools/beamref.py DIR --ids 1,2,3 -n N --num-beams B [--num-return R]
        [--length-penalty L] [--early-stopping true|false|never] [--min-new N]
        [--no-repeat-ngram N] [--ignore-eos]

Prints the returned hypotheses as kvtier-run --num-beams does:
"beam I score S eos 0|1 ids A,B,C" (generated ids, best first).

It follows the vectorized _beam_search of transformers' generation/utils.py
(v4.5x, after the beam search refactor), written anew over tensors:
log_softmax of each running beam's last logits, then the processors
(min_new_tokens: eos ids -inf; no_repeat_ngram_size: -inf for ids that
would repeat an n-gram of prompt + beam), plus the running scores; the
top K = max(2, 1 + n_eos) * num_beams over beams x vocabulary; candidates
ending in eos (or reaching max_new) among the first num_beams are scored
sum_logprobs / generated_len ** length_penalty (generated tokens only,
the eos included) and merged into the num_beams best finished ones unless
early_stopping is true and they are full, or the heuristic says no
improvement is possible; the best num_beams candidates that do not end
run on; the search stops as utils.py's _beam_search_has_unfinished_sequences
says.  -1e9 marks are added as HF adds them.  The model runs without a
cache: each step is a full forward over every running sequence, so the
oracle shares no code path with kvtier's KV.

Ties.  transformers ranks with torch.topk, whose order among equal values
is unspecified (torch documents no order; on CPU, torch 1.13, two equal
values come out either way round depending on their positions and k, and
CUDA differs again).  So transformers has no tie rule, and this oracle
ranks with a stable top-k instead: equal scores by the lower flat index
(beam * vocab + token: the lower beam, then the lower token), and in the
finished-hypotheses merge the ones already kept before new ones.  The
values are torch.topk's; only the order of equal ones (and which of them
the k-th place keeps) is this rule's.  kvtier follows the same rule.  Group beam search's scorer (BeamHypotheses) is plain Python and
has a rule of its own, kept here: a full group drops the earliest added of
its equally worst hypotheses, and the results, sorted by score with
Python's stable sort and popped from the best end, put the later added of
equal ones first.  Every running sequence gets a forward of its own (a
batch of one): batched rows of identical sequences differ in the last bits
on CPU, which would break a tie kvtier keeps exact.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchref  # noqa: E402

NEG = -1.0e9


def eos_ids(d):
    with open(os.path.join(d, "config.json")) as f:
        e = json.load(f).get("eos_token_id")
    if e is None:
        return []
    return [int(x) for x in (e if isinstance(e, list) else [e])]


def stable_topk(x, k):
    """torch.topk(x, k) with equal values in index order (see Ties)."""
    v, i = torch.sort(x, descending=True, stable=True)
    return v[:k], i[:k]


def last_logits(model, seqs):
    """The last position's logits of each row of seqs, one forward per row."""
    with torch.no_grad():
        return torch.cat([model(seqs[i:i + 1])[:, -1, :] for i in range(seqs.shape[0])]).float()


def banned_ngram(seq, n):
    """Ids that would complete an n-gram already in seq (a list)."""
    if n <= 0 or len(seq) + 1 < n:
        return []
    tail = seq[len(seq) - (n - 1):] if n > 1 else []
    return [seq[s + n - 1] for s in range(len(seq) - n + 1) if seq[s:s + n - 1] == tail]


def beam_search(model, prompt, max_new, num_beams, num_return, length_penalty, early, min_new, ngram, eos,
                topk=stable_topk):
    vocab = model.cfg["vocab_size"]
    k = max(2, 1 + len(eos)) * num_beams
    plen = len(prompt)
    max_len = plen + max_new
    running = torch.tensor([prompt] * num_beams, dtype=torch.int64)
    run_scores = torch.zeros(num_beams)
    run_scores[1:] = NEG
    fin_seqs = [[] for _ in range(num_beams)]
    fin_scores = torch.full((num_beams,), NEG)
    fin_eos = [False] * num_beams
    finished = torch.zeros(num_beams, dtype=torch.bool)
    unsat = True
    cur = plen
    while True:
        logits = last_logits(model, running)
        lp = torch.log_softmax(logits, dim=-1)
        if cur - plen < min_new:
            lp[:, eos] = float("-inf")
        for b in range(num_beams):
            for t in banned_ngram(running[b].tolist(), ngram):
                lp[b, t] = float("-inf")
        acc = (lp + run_scores[:, None]).reshape(-1)
        top_lp, top_idx = topk(acc, k)
        top_beam = top_idx // vocab
        top_tok = top_idx % vocab
        cand = torch.cat([running[top_beam], top_tok[:, None]], dim=1)
        hits = torch.tensor([int(t) in eos or cur + 1 >= max_len for t in top_tok.tolist()])
        # the beams that run on
        run_lp = top_lp + hits.float() * NEG
        nxt = topk(run_lp, num_beams)[1]
        new_running, new_scores = cand[nxt], run_lp[nxt]
        # the finished ones
        just = hits & (torch.arange(k) < num_beams)
        fl = top_lp / ((cur + 1 - plen) ** length_penalty)
        if bool(finished.all()) and early is True:
            fl = fl + NEG
        if not unsat:
            fl = fl + NEG
        fl = fl + (~just).float() * NEG
        merged_scores = torch.cat([fin_scores, fl])
        merged_seqs = fin_seqs + [cand[i, plen:].tolist() for i in range(k)]
        merged_eos = fin_eos + [int(t) in eos for t in top_tok.tolist()]
        merged_fin = torch.cat([finished, just])
        sel = topk(merged_scores, num_beams)[1].tolist()
        fin_scores = merged_scores[sel]
        fin_seqs = [merged_seqs[i] for i in sel]
        fin_eos = [merged_eos[i] for i in sel]
        finished = merged_fin[sel]
        running, run_scores = new_running, new_scores
        cur += 1
        hyp = max_new if (early == "never" and length_penalty > 0) else cur - plen
        best = run_scores[0] / (hyp ** length_penalty)
        worst = torch.where(finished, fin_scores.min(), torch.tensor(NEG))
        unsat = unsat and bool((best > worst).any())
        open_beam = not (bool(finished.all()) and early is True)
        if not (unsat and open_beam and not bool(hits.all())):
            break
    return [(float(fin_scores[i]), fin_eos[i], fin_seqs[i]) for i in range(num_return)]


class Hyps:
    """The finished hypotheses of one group, as the BeamSearchScorer that
    group beam search keeps them: at most n, the worst dropped."""

    def __init__(self, n, length_penalty, early, max_new):
        self.n, self.lp, self.early, self.max_new = n, length_penalty, early, max_new
        self.beams, self.worst = [], 1e9

    def add(self, ids, sum_logprobs, gen_len, eos):
        # a tensor over a Python number, as the scorer divides: a hypothesis
        # finished at its first token (length 0) scores -inf, not an error
        score = float(torch.tensor(sum_logprobs, dtype=torch.float64) / (gen_len ** self.lp))
        if len(self.beams) < self.n or score > self.worst:
            self.beams.append((score, ids, eos))
            if len(self.beams) > self.n:
                order = sorted((s, i) for i, (s, _, _) in enumerate(self.beams))
                del self.beams[order[0][1]]
                self.worst = order[1][0]
            else:
                self.worst = min(score, self.worst)

    def is_done(self, best, gen):
        if len(self.beams) < self.n:
            return False
        if self.early is True:
            return True
        length = self.max_new if (self.early == "never" and self.lp > 0) else gen
        return self.worst >= best / (length ** self.lp)


def group_beam_search(model, prompt, max_new, num_beams, num_return, length_penalty, early, min_new, ngram, eos,
                      groups, diversity, topk=stable_topk):
    """transformers' group (diverse) beam search (the transformers-community
    group-beam-search generate with its BeamSearchScorer), written anew:
    per step the groups choose in turn, each over its own beams, log-probs
    minus diversity * (how many beams of earlier groups chose the id this
    step); eos candidates among a group's first group_size become
    hypotheses without the eos in their length (the first eos id appended
    to the returned ids); a done group pads (first eos id, score 0)."""
    vocab = model.cfg["vocab_size"]
    gs = num_beams // groups
    k = max(2, 1 + len(eos)) * gs
    plen = len(prompt)
    pad = eos[0] if eos else 0
    seqs = torch.tensor([prompt] * num_beams, dtype=torch.int64)
    scores = torch.full((num_beams,), NEG)
    scores[::gs] = 0
    hyps = [Hyps(gs, length_penalty, early, max_new) for _ in range(groups)]
    done = [False] * groups
    gen = 0
    while True:
        logits = last_logits(model, seqs)
        cur = torch.zeros(num_beams, dtype=torch.int64)
        new_seqs = seqs.clone()
        new_scores = scores.clone()
        next_tok = torch.zeros(num_beams, dtype=torch.int64)
        for g in range(groups):
            o = g * gs
            if done[g]:
                new_seqs[o:o + gs] = seqs[o]
                new_scores[o:o + gs] = 0
                next_tok[o:o + gs] = pad
                cur[o:o + gs] = pad
                continue
            lp = torch.log_softmax(logits[o:o + gs], dim=-1)
            if gen < min_new:
                lp[:, eos] = float("-inf")
            for b in range(gs):
                for t in banned_ngram(seqs[o + b].tolist(), ngram):
                    lp[b, t] = float("-inf")
            if o > 0:
                lp = lp - diversity * torch.bincount(cur[:o], minlength=vocab).float()
            acc = (lp + scores[o:o + gs, None]).reshape(-1)
            top_lp, top_idx = topk(acc, k)
            r = 0
            for rank in range(k):
                beam, tok = int(top_idx[rank]) // vocab, int(top_idx[rank]) % vocab
                if tok in eos:
                    if rank < gs:
                        hyps[g].add(seqs[o + beam, plen:].tolist() + [pad], float(top_lp[rank]), gen, True)
                    continue
                new_seqs[o + r] = seqs[o + beam]
                new_scores[o + r] = top_lp[rank]
                next_tok[o + r] = tok
                cur[o + r] = tok
                r += 1
                if r == gs:
                    break
            done[g] = done[g] or hyps[g].is_done(float(top_lp[0]), gen)
        seqs = torch.cat([new_seqs, next_tok[:, None]], dim=1)
        scores = new_scores
        gen += 1
        if all(done) or gen >= max_new:
            break
    for g in range(groups):
        if not done[g]:
            for b in range(g * gs, (g + 1) * gs):
                hyps[g].add(seqs[b, plen:].tolist(), float(scores[b]), gen, False)
    pool = sorted(sum((h.beams for h in hyps), []), key=lambda x: x[0])
    return [(s, e, ids) for s, ids, e in reversed(pool[-num_return:])]


def parse_early(s):
    return {"true": True, "false": False, "never": "never"}[s]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--ids", required=True)
    ap.add_argument("-n", type=int, required=True)
    ap.add_argument("--num-beams", type=int, required=True)
    ap.add_argument("--num-return", type=int, default=1)
    ap.add_argument("--length-penalty", type=float, default=1.0)
    ap.add_argument("--early-stopping", type=parse_early, default=False)
    ap.add_argument("--min-new", type=int, default=0)
    ap.add_argument("--no-repeat-ngram", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--num-beam-groups", type=int, default=1)
    ap.add_argument("--diversity-penalty", type=float, default=0.0)
    o = ap.parse_args(argv)
    torch.set_num_threads(2)
    model = torchref.load_model(o.dir, torch.float32)
    prompt = [int(x) for x in o.ids.split(",")]
    eos = [] if o.ignore_eos else eos_ids(o.dir)
    if o.num_beam_groups > 1:
        res = group_beam_search(model, prompt, o.n, o.num_beams, o.num_return, o.length_penalty, o.early_stopping,
                                o.min_new, o.no_repeat_ngram, eos, o.num_beam_groups, o.diversity_penalty)
    else:
        res = beam_search(model, prompt, o.n, o.num_beams, o.num_return, o.length_penalty, o.early_stopping,
                          o.min_new, o.no_repeat_ngram, eos)
    for i, (score, eos_end, ids) in enumerate(res):
        print(f"beam {i} score {score:.9g} eos {int(eos_end)} ids {','.join(map(str, ids))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
