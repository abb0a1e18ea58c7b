#!/usr/bin/python3
"""train_tokenizer.py - the corpus of the built-in model and its byte-level BPE.

    /usr/bin/python3 tools/train_tokenizer.py --out model/builtin [--vocab 2048]

Extracts the King James Bible from the Debian package bible-kjv (the `bible`
program of bible-kjv reading bible-kjv-text's /usr/lib/bible.data), splits it
into a training text and the shipped validation text, trains a byte-level BPE
on the training text and writes a Hugging Face tokenizer.json and
tokenizer_config.json.  Deterministic: the same package gives byte-identical
files.  Needs python3-regex (for the \\p{L} classes of the split regex, which
the C tokenizer runs through PCRE2).  Not used at runtime or by `make test`.
"""
import argparse
import collections
import heapq
import json
import os
import subprocess
import sys

import regex

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bytelevel import bytes_to_unicode  # noqa: E402

# The whole book, one verse per line, "Ge1:1 In the beginning ..." (bible(1):
# -f turns pretty-printing off, which also puts each verse on one line).
BIBLE_CMD = ["bible", "-f", "Gen1:1-Rev22:21"]
# Every VAL_EVERY-th chapter (the last of each group of VAL_EVERY) is held out.
VAL_EVERY = 40

# The GPT-2 split regex: contractions, letter runs, digit runs, punctuation
# runs (each with at most one leading space), then whitespace.  \s+(?!\S)
# leaves the last space of a run to prefix the next word.
SPLIT_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIALS = [BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


BYTE_CHARS = bytes_to_unicode()


def load_chapters():
    """The Bible as a list of chapters, each a list of verse strings."""
    out = subprocess.run(BIBLE_CMD, check=True, stdout=subprocess.PIPE).stdout.decode("ascii")
    chapters, last = [], None
    for line in out.splitlines():
        ref, _, text = line.partition(" ")
        chapter = ref.split(":")[0]  # "Ge1:1" -> "Ge1"
        if chapter != last:
            chapters.append([])
            last = chapter
        chapters[-1].append(text.strip())
    return chapters


def split_chapters(chapters):
    """(train, validation) chapter lists: chapter i is held out when
    i % VAL_EVERY == VAL_EVERY - 1."""
    train = [c for i, c in enumerate(chapters) if i % VAL_EVERY != VAL_EVERY - 1]
    val = [c for i, c in enumerate(chapters) if i % VAL_EVERY == VAL_EVERY - 1]
    return train, val


def chapters_text(chapters):
    """One verse per line, a blank line between chapters."""
    return "".join("\n".join(c) + "\n\n" for c in chapters)


def pretokenize(text):
    """The pre-tokenizer of tokenizer.json: split, then map bytes to chars."""
    return ["".join(BYTE_CHARS[b] for b in w.encode("utf-8")) for w in regex.findall(SPLIT_REGEX, text)]


def train_bpe(text, n_merges):
    """Greedy BPE over the words of text.  Each step merges the most frequent
    adjacent pair (ties: the lexicographically smallest pair, so the result
    does not depend on hash order).  Pair counts are updated incrementally
    through an index pair -> words; stale heap entries are skipped."""
    counts = collections.Counter(pretokenize(text))
    words = [list(w) for w in sorted(counts)]
    freq = [counts[w] for w in sorted(counts)]
    pairs = collections.Counter()
    where = collections.defaultdict(set)
    for i, w in enumerate(words):
        for p in zip(w, w[1:]):
            pairs[p] += freq[i]
            where[p].add(i)
    heap = [(-c, p) for p, c in pairs.items()]
    heapq.heapify(heap)
    merges = []
    while len(merges) < n_merges and heap:
        negc, p = heapq.heappop(heap)
        if pairs.get(p, 0) != -negc or negc == 0:
            continue  # stale entry: the count changed after it was pushed
        merges.append(p)
        merged = p[0] + p[1]
        changed = set()
        for i in sorted(where.pop(p)):
            w = words[i]
            for q in zip(w, w[1:]):
                pairs[q] -= freq[i]
                changed.add(q)
            j, nw = 0, []
            while j < len(w):
                if j + 1 < len(w) and w[j] == p[0] and w[j + 1] == p[1]:
                    nw.append(merged)
                    j += 2
                else:
                    nw.append(w[j])
                    j += 1
            words[i] = nw
            for q in zip(nw, nw[1:]):
                pairs[q] += freq[i]
                where[q].add(i)
                changed.add(q)
        del pairs[p]
        changed.discard(p)
        for q in changed:
            if pairs[q] > 0:
                heapq.heappush(heap, (-pairs[q], q))
    return merges


class Encoder:
    """Encodes text with a trained vocab and merges (no special-token
    parsing: the training script inserts special ids itself)."""

    def __init__(self, vocab, merges):
        self.vocab = vocab
        self.rank = {tuple(m): r for r, m in enumerate(merges)}
        self.cache = {}

    def word(self, w):
        if w in self.cache:
            return self.cache[w]
        parts = list(w)
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda k: self.rank.get((parts[k], parts[k + 1]), len(self.rank)))
            if (parts[best], parts[best + 1]) not in self.rank:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        ids = [self.vocab[x] for x in parts]
        self.cache[w] = ids
        return ids

    def encode(self, text):
        out = []
        for w in pretokenize(text):
            out.extend(self.word(w))
        return out

    @classmethod
    def load(cls, path):
        with open(path, encoding="utf-8") as f:
            tj = json.load(f)
        enc = cls(tj["model"]["vocab"], [m.split(" ") for m in tj["model"]["merges"]])
        enc.special = {t["content"]: t["id"] for t in tj["added_tokens"]}
        return enc


def tokenizer_json(merges):
    vocab = {BYTE_CHARS[b]: b for b in range(256)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    added = [
        {"id": len(vocab) + k, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for k, s in enumerate(SPECIALS)
    ]
    bos_id = added[0]["id"]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": SPLIT_REGEX}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": BOS, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": [a + " " + b for a, b in merges],
        },
    }


def tokenizer_config(tj):
    decoder = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in tj["added_tokens"]
    }
    return {
        "added_tokens_decoder": decoder,
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="model directory to write into")
    ap.add_argument("--vocab", type=int, default=2048, help="total vocabulary, special tokens included")
    args = ap.parse_args()
    n_merges = args.vocab - 256 - len(SPECIALS)
    if n_merges < 0:
        sys.exit("train_tokenizer.py: --vocab must be at least %d" % (256 + len(SPECIALS)))
    train, val = split_chapters(load_chapters())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "validation.txt"), "w", encoding="utf-8") as f:
        f.write(chapters_text(val))
    merges = train_bpe(chapters_text(train), n_merges)
    if len(merges) < n_merges:
        sys.exit("train_tokenizer.py: the corpus only supports %d merges" % len(merges))
    tj = tokenizer_json(merges)
    write_json(os.path.join(args.out, "tokenizer.json"), tj)
    write_json(os.path.join(args.out, "tokenizer_config.json"), tokenizer_config(tj))
    print("chapters: %d train, %d validation; vocab %d (%d merges)" % (len(train), len(val), args.vocab, len(merges)))


if __name__ == "__main__":
    main()
