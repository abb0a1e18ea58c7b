#!/bin/sh
# sinks.test.sh - the sink strategy (StreamingLLM attention sinks) against
# the PyTorch oracle tests/sinks_oracle.py on the built-in model's weights.
# kvtier-bench-sinks generates greedily with the sink strategy and dumps
# every logits row; the oracle replays the steps and requires each row
# within 1e-4, each token its argmax, and full attention to disagree (so
# the check can fail).  Cases:
#   short prompt, 300 tokens through a window of 64 with 4 sinks
#     (growing, the first eviction, ~4 windows of steady shifting);
#   a 100-token prompt past a window of 48 with 4 sinks (a first input is
#     attended whole, then evicted down to the window), 40 tokens;
#   no sinks at all (window 32), 80 tokens.
# And --window abc is refused with exit 2.
# Run by tests/run.sh from the repository root with $KVTIER_BUILD set.
set -u
build=${KVTIER_BUILD:-build}
py=/usr/bin/python3
bench=$build/kvtier-bench-sinks
if [ ! -x "$bench" ]; then
    echo "sinks.test: $bench not built, skipping"
    exit 77
fi
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT INT TERM

prompt20=2044,100,200,300,400,500,600,700,800,900,17,33,44,55,66,77,88,99,111,222
prompt100=$($py -c 'print(",".join(str((i * 37 + 11) % 2000) for i in range(100)))')
fail=0
# A value that is not a number is a usage error naming the flag, not a
# silent 0 (the tools' option numbers go through util/args.c).
out=$("$bench" -m model/builtin --window abc 2>&1)
rc=$?
if [ $rc != 2 ] || ! printf '%s\n' "$out" | grep -q -- "invalid value 'abc' for --window"; then
    echo "sinks.test: --window abc: exit $rc, '$out' (want 2 and a message naming --window)"; fail=1
fi
check() { # name window sinks ids n
    "$bench" -m model/builtin --window "$2" --sinks "$3" --ids "$4" -n "$5" --every "$5" \
        --dump "$tmp/$1.kvtl" > "$tmp/$1.log" 2>&1 || {
        cat "$tmp/$1.log"; echo "sinks.test: $1: kvtier-bench-sinks FAILED"; fail=1; return; }
    $py tests/sinks_oracle.py --model model/builtin --dump "$tmp/$1.kvtl" --window "$2" --sinks "$3" \
        --tol 1e-4 || { echo "sinks.test: $1 FAILED"; fail=1; }
}
check long300 64 4 "$prompt20" 300
check prompt100 48 4 "$prompt100" 40
check nosinks 32 0 "$prompt20" 80
# Sinks + quantized (no dense oracle): finite logits and the KV bytes
# within the quantized window's bound at every report, with a residual
# (128) longer than the window.
"$bench" -m model/builtin --window 64 --sinks 4 --nbits 4 --ids "$prompt20" -n 600 --every 100 \
    > "$tmp/quant.log" 2>&1 || { cat "$tmp/quant.log"; echo "sinks.test: quantized FAILED"; fail=1; }
[ $fail = 0 ] && echo "sinks.test: ok"
exit $fail
