#!/usr/bin/env python3
"""unigram_oracle.py OUTDIR - trains two small SentencePiece Unigram models
(Debian's python3-sentencepiece) on the repository's docs and a few
sentences in other scripts: "t5" (T5's settings: <pad> </s> <unk>, no byte
fallback) and "t5-bytes" (byte_fallback).  Each is converted to a T5-style
tokenizer.json by tools/spm2hf.py into OUTDIR/NAME ("t5" also into
OUTDIR/t5-strip-replace, the converter's later layout), and SentencePiece's own
encoding of every corpus case (plus </s>, which the post-processor appends)
goes to OUTDIR/spm.json for tests/tokenizer/unigram.mjs.  SentencePiece is
the reference for the charsmap normalisation and for byte fallback, which
the transformers.js port lacks."""
import glob
import json
import os
import sys

import sentencepiece as spm

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(os.path.dirname(here))
sys.path.insert(0, os.path.join(root, "tools"))
import spm2hf  # noqa: E402

# Text in other scripts so that some non-ASCII pieces exist; the corpus has
# characters found nowhere here, which become unk (or bytes).
EXTRA = [
    "Le café était fermé, mais la boulangerie était ouverte à côté.",
    "Straße, Größe und Übermaß: schöne Wörter für Ärger über Öl.",
    "日本語のテキストです。東京は大きい都市です。",
    "Привет, мир! Это небольшой текст на русском языке.",
    "Ελληνικά γράμματα: άλφα, βήτα, γάμμα.",
    "Números: uno, dos, tres; señor, niño, acción.",
]


def train_text():
    lines = []
    for path in sorted(glob.glob(os.path.join(root, "docs", "*.md"))) + [os.path.join(root, "README.md")]:
        with open(path, encoding="utf-8") as f:
            lines += [l for l in f.read().split("\n") if l.strip()]
    return lines + EXTRA * 20


def train(prefix, text, size, byte_fallback=False):
    """Trains a Unigram model with T5's specials (<pad> </s> <unk> = 0, 1, 2,
    no <s>) on the lines of text into prefix.model; returns its processor."""
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_prefix=prefix, model_type="unigram", vocab_size=size,
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, byte_fallback=byte_fallback, num_threads=1,
        hard_vocab_limit=False, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=prefix + ".model")


def skip_reason(sp, text):
    """Why SentencePiece's ids for text are not Hugging Face's, or None:
    "special" when the text holds a special token's text (Hugging Face
    matches it before the model; SentencePiece knows no added tokens), "tie"
    when the two best segmentations score the same to float32 precision
    (SentencePiece sums scores in float32, Hugging Face in float64, and the
    rounding picks between them)."""
    if any(s in text for s in ("<pad>", "</s>", "<unk>")):
        return "special"
    best = sp.nbest_encode(text, out_type="immutable_proto", nbest_size=2).nbests
    if len(best) == 2 and best[0].score - best[1].score <= 1e-5 * max(1.0, abs(best[0].score)):
        return "tie"
    return None


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(here, "corpus.json"), encoding="utf-8") as f:
        corpus = json.load(f)
    with open(os.path.join(here, "unigram_corpus.json"), encoding="utf-8") as f:
        corpus += json.load(f)
    text = train_text()
    models = []
    for name, byte_fallback, size in (("t5", False, 800), ("t5-bytes", True, 1200)):
        prefix = os.path.join(out, name)
        sp = train(prefix, text, size, byte_fallback)
        spm2hf.convert(prefix + ".model", os.path.join(out, name))
        if not byte_fallback:
            spm2hf.convert(prefix + ".model", os.path.join(out, name + "-strip-replace"), strip_replace=True)
        ids = [sp.encode(t) + [sp.eos_id()] for t in corpus]
        models.append({"name": name, "dir": os.path.join(out, name), "ids": ids,
                       "decoded": [sp.decode(i) for i in ids],
                       "skip": [skip_reason(sp, t) for t in corpus]})
    with open(os.path.join(out, "spm.json"), "w", encoding="utf-8") as f:
        json.dump({"corpus": corpus, "models": models}, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
