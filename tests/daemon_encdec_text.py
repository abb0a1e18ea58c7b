"""kvtierd with a T5 whose tokenizer.json is a SentencePiece Unigram model,
as real T5 checkpoints ship: a small model is trained on docs/encdec.md
and a few sentences in other scripts (tests/tokenizer/unigram_oracle.py),
converted by tools/spm2hf.py and given to a tiny random T5
(tools/mkmodel.py --tokenizer-from, the vocabulary the model's size).  A
text "input" is tokenized as SentencePiece does, with "</s>" appended as
transformers' T5 tokenizer does: the usage counts those ids, and "input"
given as the same ids (the end token included) gives the same tokens, with
or without the encoder cache (whose key is every id, so a hit proves the
ids equal).  Ids are the encoder's input as given: without "</s>" they are
one token fewer, a different input."""
import os
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, skip  # noqa: E402
sys.path.insert(0, "tools")
import mkmodel  # noqa: E402
import spm2hf  # noqa: E402

sys.path.insert(0, "tests/tokenizer")
try:
    import unigram_oracle
except ImportError:
    skip("python3-sentencepiece is not installed (tools/deps.sh test)")

# ASCII, full-width letters and a circled digit (the charsmap's NFKC), a run
# of spaces (WhitespaceSplit), accents and a character no piece holds (unk)
TEXTS = ["The house is small. Le café était fermé.", "ＡＢＣ ①  double  space, Übermaß ☃"]
DEC = [0, 17, 230, 91, 150]
gen = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True, "prompt": DEC}

d = Daemon(model="made below")
with open("docs/encdec.md", encoding="utf-8") as f:
    lines = [line for line in f.read().split("\n") if line.strip()]
prefix = os.path.join(d.tmp, "t5")
sp = unigram_oracle.train(prefix, lines + unigram_oracle.EXTRA * 20, 400)
spm2hf.convert(prefix + ".model", prefix)
d.model = os.path.join(d.tmp, "model")
mkmodel.main(["--out", d.model, "--arch", "t5", "--seed", "5", "--layers", "2", "--dim", "64", "--heads", "4",
              "--ffn", "128", "--vocab", str(sp.get_piece_size()), "--tokenizer-from", prefix])
d.start()


def complete(**kw):
    code, r = d.post("/v1/completions", dict(gen, **kw))
    assert code == 200, (code, r)
    return r["choices"][0]["tokens"], r["usage"]


for text in TEXTS:
    assert unigram_oracle.skip_reason(sp, text) is None, text
    ids = sp.encode(text) + [sp.eos_id()]
    toks, u = complete(input=text)
    p = u["prompt_tokens_details"]
    check(p["encoder_tokens"] == len(ids) and u["prompt_tokens"] == len(ids) + len(DEC) and
          p["encoder_cached_tokens"] == 0,
          "%r: %d encoder tokens, SentencePiece's ids and </s> (%s)" % (text, len(ids), u))
    t, u = complete(input=ids, use_cache=False)
    check(t == toks and u["prompt_tokens_details"]["encoder_tokens"] == len(ids),
          "%r: input as those ids, encoded afresh: the text's tokens %s" % (text, toks))
    t, u = complete(input=ids)
    check(t == toks and u["prompt_tokens_details"]["encoder_cached_tokens"] == len(ids),
          "%r: the ids find the text's encoder cache: its key, the same ids" % text)
    t, u = complete(input=ids[:-1])
    p = u["prompt_tokens_details"]
    check(p["encoder_tokens"] == len(ids) - 1 and p["encoder_cached_tokens"] == 0,
          "%r: the ids without </s> are used as given: %d encoder tokens, another input (%s)" %
          (text, len(ids) - 1, p))
check(d.stop() == 0, "kvtierd stops cleanly")
d.cleanup()
