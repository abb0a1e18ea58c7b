#!/bin/sh
# unigram.test.sh - kvtier's Unigram tokenizer (T5's tokenizer.json layout:
# Precompiled charsmap normaliser, WhitespaceSplit + Metaspace, Viterbi over
# the pieces, unk or byte fallback, "</s>" appended) against two references
# on the corpus of tests/tokenizer/corpus.json + unigram_corpus.json:
# SentencePiece itself (Debian's python3-sentencepiece trains two small
# models and encodes the corpus; tools/spm2hf.py converts them) and the
# transformers.js port (@lenml/tokenizers, pinned in
# tests/tokenizer/package-lock.json) on the converted files.  Builds
# nothing: `make test` builds test_tokenizer.
build=${KVTIER_BUILD:-build}
here=$(cd "$(dirname "$0")/tokenizer" && pwd)
bin=$build/tests/test_tokenizer
if [ ! -x "$bin" ]; then
  echo "unigram.test.sh: $bin is not built (make test builds it)"
  exit 1
fi
if ! /usr/bin/python3 -c 'import sentencepiece' 2>/dev/null; then
  echo "unigram.test.sh: python3-sentencepiece is not installed (tools/deps.sh test), skipping"
  exit 77
fi
. tests/npm.sh
npm_ready unigram.test.sh "$here" @lenml/tokenizers
out=$(mktemp -d) || exit 1
trap 'rm -rf "$out"' EXIT
/usr/bin/python3 "$here/unigram_oracle.py" "$out" || exit 1
node "$here/unigram.mjs" "$out" || exit 1
KVTIER_TOKENIZER_ORACLE="$out/expected.json" "$bin" || exit 1
