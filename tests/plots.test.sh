#!/bin/sh
# make plots' renderer: every gnuplot script of tools/plots draws its figure
# from the small CSVs in tests/plots (the format the benchmark tools write
# with --csv) with its axis labels, series and the CSV's machine and
# command; a missing CSV is an error, not a figure left out.
set -e
command -v gnuplot >/dev/null 2>&1 || { echo "FAIL: gnuplot missing (tools/deps.sh test installs gnuplot-nox)"; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp tests/plots/*.csv "$tmp"/
out=$(tools/plots.sh "$tmp")
echo "$out" | grep -q "^plots.sh: 4 figure(s)" || { echo "FAIL: $out"; exit 1; }
fail=0
# expect FIGURE TEXT: the SVG holds TEXT (gnuplot writes each label as text)
expect() {
  if ! grep -qF -- "$2" "$tmp/$1.svg"; then
    echo "FAIL: $1.svg lacks \"$2\""
    fail=1
  fi
}
for f in tiers tiers-ratio prefix quant; do
  head -c 200 "$tmp/$f.svg" | grep -q "<svg" || { echo "FAIL: $f.svg is not SVG"; fail=1; }
  expect $f "machine: Test CPU, 2 online CPUs (2026-12-03 19:00 UTC, load average 1.00)"
done
expect tiers "decode speed (tokens/s)"
expect tiers "context (tokens already in the KV cache)"
expect tiers "offloaded (every layer streamed from the host tier)"
expect tiers "command: build/kvtier-bench-tiers -m /tmp/m --ctx 512,2048 --csv tiers.csv"
expect tiers-ratio "tokens/s relative to resident (1 = as fast)"
expect tiers-ratio "adaptive / resident"
expect prefix "time to first token (ms, log scale)"
expect prefix "warm: prefix from the cache, suffix computed"
expect quant "KV bytes per token, relative to the bf16 cache"
expect quant "int4 hqq R128"
[ $fail = 0 ]
rm "$tmp/quant.csv"
if tools/plots.sh "$tmp" 2>/dev/null; then
  echo "FAIL: plots.sh succeeded without quant.csv"
  exit 1
fi
echo "ok - 4 figures rendered with their labels; a missing CSV fails"
