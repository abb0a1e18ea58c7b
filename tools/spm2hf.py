#!/usr/bin/env python3
"""spm2hf.py [--strip-replace] MODEL OUTDIR - writes OUTDIR/tokenizer.json
and OUTDIR/tokenizer_config.json for a SentencePiece Unigram model file, in
the layout of T5's tokenizer.json: a Unigram model over the pieces and their
scores, the model's precompiled_charsmap as a Precompiled normalizer,
WhitespaceSplit then Metaspace pre-tokenizers, a Metaspace decoder (or, with
byte fallback, Replace + ByteFallback + Fuse + Strip) and a TemplateProcessing
post-processor appending "</s>".  --strip-replace writes the later layout of
Hugging Face's converter instead: Precompiled, Strip (right) and a Regex
Replace of space runs by "▁" as normalizers, then Metaspace alone
(prepend_scheme, split).

Only the standard library: the model file is a protobuf (ModelProto), read
here with a small wire-format reader, so no protobuf package is needed."""
import base64
import json
import os
import struct
import sys

# sentencepiece_model.proto field numbers
MODEL_PIECES, MODEL_NORMALIZER = 1, 3
PIECE_TEXT, PIECE_SCORE, PIECE_TYPE = 1, 2, 3
NORM_CHARSMAP, NORM_DUMMY_PREFIX = 2, 3
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def varint(buf, i):
    v = shift = 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return v, i


def fields(buf):
    """Yields (field number, value) of a message: ints for varints, bytes
    for length-delimited fields, raw 4/8 bytes for fixed ones."""
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            v, i = varint(buf, i)
        elif wire == 1:
            v, i = buf[i:i + 8], i + 8
        elif wire == 2:
            n, i = varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif wire == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {wire} of field {num} is not supported")
        yield num, v


def read_model(path):
    pieces, charsmap, dummy_prefix = [], b"", True
    with open(path, "rb") as f:
        data = f.read()
    for num, v in fields(data):
        if num == MODEL_PIECES:
            p = {"type": NORMAL, "score": 0.0}
            for pn, pv in fields(v):
                if pn == PIECE_TEXT:
                    p["piece"] = pv.decode("utf-8")
                elif pn == PIECE_SCORE:
                    p["score"] = struct.unpack("<f", pv)[0]
                elif pn == PIECE_TYPE:
                    p["type"] = pv
            pieces.append(p)
        elif num == MODEL_NORMALIZER:
            for nn, nv in fields(v):
                if nn == NORM_CHARSMAP:
                    charsmap = nv
                elif nn == NORM_DUMMY_PREFIX:
                    dummy_prefix = bool(nv)
    return pieces, charsmap, dummy_prefix


def convert(model_path, outdir, strip_replace=False):
    pieces, charsmap, dummy_prefix = read_model(model_path)
    unk_id = next(i for i, p in enumerate(pieces) if p["type"] == UNKNOWN)
    byte_fallback = any(p["type"] == BYTE for p in pieces)
    ids = {p["piece"]: i for i, p in enumerate(pieces)}
    if "</s>" not in ids:
        raise SystemExit(f"{model_path}: no </s> piece for the post-processor")
    added = [
        {"id": i, "content": p["piece"], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, p in enumerate(pieces) if p["type"] in (UNKNOWN, CONTROL)
    ]
    scheme = "always" if dummy_prefix else "never"
    metaspace = {"replacement": "\u2581", "add_prefix_space": dummy_prefix, "prepend_scheme": scheme}
    if byte_fallback:
        decoder = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1 if dummy_prefix else 0, "stop": 0},
        ]}
    else:
        decoder = {"type": "Metaspace", **metaspace}
    precompiled = [{"type": "Precompiled", "precompiled_charsmap": base64.b64encode(charsmap).decode()}] \
        if charsmap else []
    if strip_replace:
        normalizer = {"type": "Sequence", "normalizers": precompiled + [
            {"type": "Strip", "strip_left": False, "strip_right": True},
            {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": "\u2581"}]}
        pre_tokenizer = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": scheme, "split": True}
    else:
        normalizer = precompiled[0] if precompiled else None
        pre_tokenizer = {"type": "Sequence", "pretokenizers": [
            {"type": "WhitespaceSplit"}, {"type": "Metaspace", **metaspace}]}
    eos = {"SpecialToken": {"id": "</s>", "type_id": 0}}
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"Sequence": {"id": "A", "type_id": 0}}, eos],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, eos, {"Sequence": {"id": "B", "type_id": 0}}, eos],
            "special_tokens": {"</s>": {"id": "</s>", "ids": [ids["</s>"]], "tokens": ["</s>"]}},
        },
        "decoder": decoder,
        "model": {"type": "Unigram", "unk_id": unk_id, "byte_fallback": byte_fallback,
                  "vocab": [[p["piece"], p["score"]] for p in pieces]},
    }
    config = {"eos_token": "</s>", "unk_token": pieces[unk_id]["piece"], "model_max_length": 512,
              "tokenizer_class": "T5Tokenizer"}
    if "<pad>" in ids:
        config["pad_token"] = "<pad>"
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    with open(os.path.join(outdir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False)


if __name__ == "__main__":
    args = sys.argv[1:]
    strip_replace = args[:1] == ["--strip-replace"]
    args = args[1:] if strip_replace else args
    if len(args) != 2:
        raise SystemExit(__doc__)
    convert(args[0], args[1], strip_replace)
