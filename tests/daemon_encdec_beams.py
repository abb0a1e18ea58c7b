"""kvtierd's beam search over encoder-decoder models (tiny random T5 and BART
from tools/mkmodel.py) against tools/beamref.py: Hugging Face's beam search
decisions over the PyTorch reference decoder (tools/torchref.py's EncDecLM),
which recomputes every sequence from its encoder output at each step (no
cache), where kvtier's beams read one cross-attention cache and fork their
self-attention caches.

Each model's eos id becomes a token the best beam emits early, so that beams
finish in eos inside the search.  The cases vary num_beams, length_penalty,
early_stopping (true, false, "never"), num_return_sequences, min_tokens,
no_repeat_ngram_size and group beam search; every returned hypothesis must
have the reference's ids, and its sequence_score must be within TOL.  Then:
the beam_search stats count the beams' copies of the cross cache a
whole-cache reorder would gather; static and offloaded self caches give the
same hypotheses; two searches over different inputs batched together give
each its results alone; beams over a session's input return the same
hypotheses with the input encoded once (encoder_cached_tokens), and the
session's next greedy request gives a fresh request's tokens."""
import json
import os
import sys
import threading

import torch

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check  # noqa: E402
sys.path.insert(0, "tools")
import beamref  # noqa: E402
import mkmodel  # noqa: E402
import torchref  # noqa: E402

ENC = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 264, 33, 83, 279, 50, 288, 41, 97, 169, 39]
N = 10
TOL = 2e-4  # sums of f32 log-probabilities, kvtier's through its caches, the reference's without
CASES = [  # num_beams, num_return, length_penalty, early_stopping, extra request fields
    (2, 2, 1.0, False, {}),
    (4, 4, 1.0, True, {}),
    (4, 3, 0.5, "never", {}),
    (4, 4, 2.0, False, {}),
    (3, 1, 0.0, "never", {}),
    (4, 2, 1.0, False, {"min_tokens": 5}),
    (3, 3, 1.0, False, {"no_repeat_ngram_size": 2}),
    (4, 4, 1.0, False, {"num_beam_groups": 2, "diversity_penalty": 1.0}),
]
torch.set_num_threads(2)


class Decoder:
    """The reference decoder over one encoded input as beamref calls a
    model: ids [1, T] -> logits [1, T, vocab], recomputed from scratch (the
    cases share many sequences: each is computed once)."""

    def __init__(self, m, enc):
        self.m, self.cfg, self.seen = m, {"vocab_size": m.cfg["vocab_size"]}, {}
        with torch.no_grad():
            self.enc = m.encode(enc)

    def __call__(self, seqs):
        ids = tuple(seqs[0].tolist())
        if ids not in self.seen:
            with torch.no_grad():
                self.seen[ids] = self.m.decode(list(ids), self.enc, self.m.new_cache())[None]
        return self.seen[ids]


def tokenizer_eos(d):
    """The id of tokenizer_config.json's eos_token, which kvtier adds to the model's."""
    tcfg = json.load(open(os.path.join(d, "tokenizer_config.json")))
    tok = json.load(open(os.path.join(d, "tokenizer.json")))
    return next(a["id"] for a in tok["added_tokens"] if a["content"] == tcfg["eos_token"])


def reference(dec, prompt, eos, nb, nret, lp, early, extra, n=N):
    args = (dec, prompt, n, nb, nret, lp, early, extra.get("min_tokens", 0), extra.get("no_repeat_ngram_size", 0), eos)
    if extra.get("num_beam_groups", 1) > 1:
        return beamref.group_beam_search(*args, extra["num_beam_groups"], extra["diversity_penalty"])
    return beamref.beam_search(*args)


def run(name, args, prompt):
    d = Daemon(model="made below")
    model = d.model = d.tmp + "/" + name
    mkmodel.main(["--out", model, "--seed", "5", "--layers", "2", "--dim", "64", "--heads", "4", "--ffn", "128",
                  "--vocab", "320", "--max-pos", "128"] + args)
    cfg_path = os.path.join(model, "config.json")
    cfg = json.load(open(cfg_path))
    dec = Decoder(torchref.load_encdec(model), ENC)
    start = prompt or [cfg["decoder_start_token_id"]]
    # the best beam's third token becomes the model's eos id
    third = reference(dec, start, [], 2, 1, 1.0, False, {}, n=3)[0][2][2]
    cfg["eos_token_id"] = third
    json.dump(cfg, open(cfg_path, "w"))
    eos = [third] + [t for t in [tokenizer_eos(model)] if t != third]
    d.start()
    base = {"input": ENC, "max_tokens": N, "return_tokens": True}
    if prompt:
        base["prompt"] = prompt

    def beams(nb, nret, lp, early, extra, **kw):
        code, r = d.post("/v1/completions", dict(base, num_beams=nb, num_return_sequences=nret, length_penalty=lp,
                                                 early_stopping=early, **extra, **kw))
        assert code == 200, (code, r)
        return r

    hyps = lambda r: [(c["tokens"], c["finish_reason"] == "stop") for c in r["choices"]]  # noqa: E731
    n_eos = 0
    for nb, nret, lp, early, extra in CASES:
        r = beams(nb, nret, lp, early, extra)
        ref = reference(dec, start, eos, nb, nret, lp, early, extra)
        got = [(c["sequence_score"], c["tokens"]) for c in r["choices"]]
        same = [g[1] for g in got] == [x[2] for x in ref] and all(abs(g[0] - x[0]) <= TOL for g, x in zip(got, ref))
        # group search appends the first eos id to a hypothesis it finished
        ends = all(c["finish_reason"] == ("stop" if x[1] else "length") for c, x in zip(r["choices"], ref))
        check(same and ends, "%s num_beams=%d num_return=%d length_penalty=%g early_stopping=%s %s: the reference's "
              "%d hypotheses (scores %s)" % (name, nb, nret, lp, early, extra, len(ref), [round(g[0], 4) for g in got]))
        if not same:
            print("  kvtier:   ", got, "\n  reference:", [(x[0], x[2]) for x in ref])
        n_eos += sum(1 for x in ref if x[1])
    check(n_eos >= 4, "%s: %d returned hypotheses ended in eos over the cases" % (name, n_eos))

    # a whole-cache reorder gathers every beam's copy of the cross cache too
    r = beams(4, 4, 1.0, False, {})
    k = r["kvtier"]["beam_search"]
    row = 2 * cfg["d_model"] * 4 * 2  # a layer's K and V of one token, f32, over both decoder layers
    check(k["steps"] > 0 and k["whole_cache_reorder_bytes_per_step"] >= 4 * len(ENC) * row and
          0 < k["kv_bytes_copied"] < k["whole_cache_reorder_bytes"],
          "%s: a step copies %.0f bytes against %.0f for a whole-cache reorder of both caches" %
          (name, k["kv_bytes_copied_per_step"], k["whole_cache_reorder_bytes_per_step"]))

    fresh = hyps(r)
    # the self cache's other strategies fork by copying: the same beams
    for cache in ({"implementation": "static", "max_cache_len": 32}, {"implementation": "offloaded"}):
        check(hyps(beams(4, 4, 1.0, False, {}, cache=cache)) == fresh,
              "%s: %s self cache: the same hypotheses" % (name, cache["implementation"]))
    # beams need a cache that forks: a quantized one, either model's, is refused
    code, e = d.post("/v1/completions", dict(base, num_beams=2, cache={"implementation": "quantized"}))
    check(code == 400 and e["error"]["param"] == "num_beams", "%s: beams on a quantized cache -> 400" % name)
    code, q = d.post("/v1/sessions", {"cache": {"implementation": "quantized"}})
    code, e = d.post("/v1/completions", dict(base, num_beams=2, session=q.get("id")))
    check(code == 400 and e["error"]["param"] == "num_beams" and "quantized" in e["error"]["message"],
          "%s: beams on a session's quantized cache -> 400: %s" % (name, e["error"]["message"]))
    # gone, so that the session below encodes the input itself (a
    # session of the same user holding it would share its cache)
    check(d.request("DELETE", "/v1/sessions/" + q["id"])[0] in (200, 204), "%s: the session deleted" % name)
    # two searches over different inputs batched together: each its own cross cache
    other = dict(base, input=ENC[::-1], num_beams=3, num_return_sequences=3)
    alone = hyps(d.post_ok("/v1/completions", other))
    out = [None, None]

    def post(i, body):
        out[i] = hyps(d.post_ok("/v1/completions", body))
    ts = [threading.Thread(target=post, args=(0, dict(base, num_beams=4, num_return_sequences=4))),
          threading.Thread(target=post, args=(1, other))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    check(out == [fresh, alone], "%s: two beam searches over different inputs at once: each its results alone" % name)
    # beams over a session's input: encoded once, the same hypotheses
    code, sess = d.post("/v1/sessions", {})
    assert code == 200, (code, sess)
    sid = sess["id"]
    for i, kw in enumerate((dict(input=ENC), {})):
        q = dict(base, num_beams=4, num_return_sequences=4, session=sid, **kw)
        if not kw:
            del q["input"]
        code, r = d.post("/v1/completions", q)
        p = r.get("usage", {}).get("prompt_tokens_details", {})
        # the requests before left the input in the encoder cache
        check(code == 200 and hyps(r) == fresh and p.get("encoder_cached_tokens") == len(ENC),
              "%s: beams on a session (%s input): a fresh request's hypotheses, %s encoder tokens not recomputed" %
              (name, "the same" if kw else "no", p.get("encoder_cached_tokens")))
    code, g1 = d.post("/v1/completions", dict(base, session=sid, max_tokens=N, temperature=0, ignore_eos=True))
    code2, g2 = d.post("/v1/completions", dict(base, max_tokens=N, temperature=0, ignore_eos=True))
    check(code == 200 and code2 == 200 and g1["choices"][0]["tokens"] == g2["choices"][0]["tokens"] and
          g1["usage"]["prompt_tokens_details"]["encoder_cached_tokens"] == len(ENC),
          "%s: greedy on the session after its beams: a fresh request's tokens" % name)
    check(d.stop() == 0, "%s: kvtierd stops cleanly" % name)
    d.cleanup()


run("t5", ["--arch", "t5", "--ffn-kind", "gated-gelu", "--tie", "--buckets", "16", "--max-distance", "12"],
    [0, 17, 230, 91, 150])
run("bart", ["--arch", "bart", "--tie"], None)
print("daemon_encdec_beams: ok")
