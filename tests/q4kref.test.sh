#!/bin/sh
# q4kref.test.sh - Q4_K weights (--weights q4_k) against the PyTorch
# reference.  Run by tests/run.sh with the build directory in $KVTIER_BUILD.
#
# Per case, a model (random ones from tools/mkmodel.py whose layer
# matrices' rows are whole super-blocks of 256, and the built-in model,
# where only down_proj's are and the rest fall back to Q8_0), a 20-token
# prompt, its prefill and 16 greedy decode steps with kvtier-run --weights
# q4_k, compared by tests/ref_compare.py with the reference whose layer
# matrices are kvtier's own Q4_K blocks (written by test_q4k --quantize:
# the quantizer has no byte-exact replay; its error bound is
# tests/test_q4k.c's) decoded by numpy from the format's definition
# (tools/torchref.q4_k_dequantize), Q8_0 ones by torchref's own Q8_0
# quantizer, and every input to them rounded to int8 blocks as the CPU
# backend rounds it.  So this checks the decoding, the kernels' arithmetic
# and the model's use of both formats, not the quantizer's choices.  The
# tolerance is q8ref.test.sh's (0.15, an activation rounding to a
# neighbouring code on the two sides moves every later logit), with its
# two guards: the reference with the unquantized weights must be further
# than that (--apart), and at least one case within 1e-4.
# Exit 77 (skip) when kvtier-run or test_q4k is not built or torch is absent.
set -u
build=${KVTIER_BUILD:-build}
py=/usr/bin/python3
[ -x "$build/kvtier-run" ] && [ -x "$build/tests/test_q4k" ] || { echo "q4kref.test: not built, skipping"; exit 77; }
$py -c 'import torch, numpy' 2>/dev/null || { echo "q4kref.test: no torch in $py, skipping"; exit 77; }
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT INT TERM

tol=0.15
# the default level rounds attention's query and weights over a bf16 cache
# to bf16 where the CPU has AVX512_BF16 (its avx512bf16 level)
attn=f32
KVTIER_SIMD=avx512bf16 "$build/kvtier-run" -m model/builtin --ids 1 -n 1 --quiet > /dev/null 2>&1 && attn=bf16
prompt=3,141,59,26,53,58,97,93,238,46,264,33,83,279,50,288,41,97,169,39
# llama1: one layer, so no earlier layer's f32 summation order can move an
# activation across an int8 rounding boundary; it stays within 1e-4 at
# every level (the others drift by one code somewhere: 0.04-0.11).
# mamba1: in_proj, x_proj and out_proj Q4_K, dt_proj (32 columns) Q8_0;
# mamba: in_proj (128 columns) Q8_0, x_proj and out_proj Q4_K, dt_proj (8
# columns, not a whole block) as stored, on both sides
cases='
llama   bf16 --arch llama --layers 2 --dim 256 --heads 4 --kv-heads 2 --ffn 512 --vocab 512
llama1  f32  --arch llama --layers 1 --dim 256 --heads 4 --kv-heads 2 --ffn 256 --vocab 384
qwen3   f32  --arch qwen3 --layers 2 --dim 256 --heads 4 --kv-heads 2 --head-dim 64 --ffn 256 --vocab 384
mamba1  f32  --arch mamba --layers 1 --dim 512 --vocab 384
mamba   bf16 --arch mamba --layers 2 --dim 128 --vocab 384 --tie
builtin f32
'
echo "$cases" | while read -r name dtype args; do
    [ -n "$name" ] || continue
    dir=$tmp/$name-$dtype
    kv=f32; [ "$dtype" = bf16 ] && kv=bf16 # the default KV dtype (auto) of each
    if [ "$name" = builtin ]; then
        dir=model/builtin
        out=$tmp/builtin
        mkdir -p "$out"
    else
        out=$dir
        # shellcheck disable=SC2086 # $args is a list of options
        $py tools/mkmodel.py --out "$dir" --dtype "$dtype" --seed 11 $args > /dev/null || { touch "$tmp/failed"; continue; }
    fi
    "$build/kvtier-run" -m "$dir" --ids "$prompt" -n 17 --greedy --ignore-eos --quiet --weights q4_k \
        --dump "$out/q4.kvtl" > "$out/run.log" 2>&1 || { cat "$out/run.log"; echo "FAIL $name: kvtier-run"; touch "$tmp/failed"; continue; }
    $py tests/ref_compare.py "$dir" "$out/q4.kvtl" --tol $tol --expect-gen 17 --kv-dtype $kv --weights q4_k \
        --q4k-quantizer "$build/tests/test_q4k" --attn-input $attn --apart --name "$name-$dtype" > "$out/q4.txt"
    rc=$?
    cat "$out/q4.txt"
    [ $rc -eq 0 ] || { touch "$tmp/failed"; continue; }
    err=$(sed -n 's/.*max abs err \([^ ]*\) .*/\1/p' "$out/q4.txt" | head -n 1)
    awk -v e="$err" 'BEGIN { exit !(e + 0 <= 1e-4) }' && echo "$name" >> "$tmp/exact"
done
exact=$(cat "$tmp/exact" 2>/dev/null | wc -l)
echo "q4kref.test: $exact of 6 cases within 1e-4 of the reference"
[ "$exact" -ge 1 ] || touch "$tmp/failed"
if [ -e "$tmp/failed" ]; then
    echo "q4kref.test: FAILED"
    exit 1
fi
echo "q4kref.test: Q4_K weights match the reference"
