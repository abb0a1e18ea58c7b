#!/bin/sh
# encdec.test.sh - the encoder-decoder models (T5, BART) against the
# independent PyTorch reference (tools/torchref.py).  Run by tests/run.sh
# from the repository root with the build directory in $KVTIER_BUILD.
#
# For each case and each of f32 / bf16 weights: a random model from
# tools/mkmodel.py, a 20-token encoder input, the decoder start token (or
# the case's decoder prompt) and 32 greedy steps (33 tokens) with kvtier-encdec, compared by
# tests/encdec_compare.py: every logits row within the tolerance of the
# reference decoding the same tokens through its cache, every token its
# argmax (up to ties within the tolerance).  KV as the checkpoint's dtype:
# f32 within 3e-4; bf16 against the reference whose caches round K and V
# to bf16 within 3e-2.  T5's scores are unscaled, so one flip of a bf16
# rounding between the two sides moves its logits more than a
# decoder-only model's: the worst seen is 1.8e-2, and the unrounded
# reference is 0.14 away, so the test tells the dtypes apart.  The same
# run crops the self-attention cache by 8 tokens and decodes them again,
# forks both caches 8 tokens before the end, and decodes afresh over the
# same cross-attention cache: each gives the fresh run's tokens.  The
# static and offloaded strategies of the self-attention cache, and the
# cross-attention cache moved to the host tier after the encoder (as a
# device OOM moves it; every step then streams it through the device
# slots), give the dynamic run's tokens and logits, bit for bit, and so
# does a run of a T5 and of a BART model whose device budget runs out
# mid-generation (both caches then continue in the host tier, streamed),
# and an f32 run on the strict backend with the cross cache streamed.  A quantized self cache
# (T5's with its position bias in the quantized kernel): BART's within
# 5e-2 of the reference, T5's within 3e-1 (its unscaled scores carry the
# codes' rounding further: the worst seen is 0.18, and the quantized
# kernel without the bias is 3.8 off), the same with its cross cache
# streamed, and on the strict backend.
#  t5relu: T5 v1.0 ReLU FFN, untied head
#  t5tied: gated-GELU, tied head (x * d_model^-0.5), 16 buckets up to
#          distance 12, so the 20 + 37 positions reach the logarithmic and
#          the last buckets of both signs.  A decoder prompt of 5 tokens:
#          from the start token alone it repeats it, and a decoder that
#          has seen one token only, without position embeddings, computes
#          the same logits at every step
#  t5gg:   gated-GELU, untied, d_kv 24 != d_model / heads, 3 decoder layers
#          over 2 encoder layers
#  bart:   tied head, final_logits_bias
#  bartsc: scale_embedding, untied head, 4 decoder layers over 2 encoder
#          layers (with two, the two streaming slots would hold all of them)
# Exit 77 (skip) only when kvtier-encdec is not built.
set -u
build=${KVTIER_BUILD:-build}
py=/usr/bin/python3
run=$build/kvtier-encdec
if [ ! -x "$run" ]; then
    echo "encdec.test: $run not built, skipping"
    exit 77
fi
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT INT TERM

cases='
t5relu -               --arch t5 --ffn-kind relu --no-tie
t5tied 0,17,230,91,150 --arch t5 --ffn-kind gated-gelu --tie --buckets 16 --max-distance 12
t5gg   -               --arch t5 --ffn-kind gated-gelu --no-tie --head-dim 24 --dec-layers 3
bart   -               --arch bart --tie
bartsc -               --arch bart --no-tie --scale-embedding --dec-layers 4
'
enc=3,141,59,26,53,58,97,93,238,46,264,33,83,279,50,288,41,97,169,39

# every model in one Python process (torch imports once)
echo "$cases" | $py -c '
import sys
sys.path.insert(0, "tools")
import mkmodel
for line in sys.stdin:
    if line.split():
        name, _, *args = line.split()
        for dt in ("f32", "bf16"):
            mkmodel.main(["--out", sys.argv[1] + "/" + name + "-" + dt, "--dtype", dt, "--seed", "5", "--layers", "2",
                          "--dim", "64", "--heads", "4", "--ffn", "128", "--vocab", "320", "--max-pos", "128"] + args)
' "$tmp" || { echo "encdec.test: mkmodel FAILED"; exit 1; }

# Where the CPU has the avx512bf16 level, bf16 weights take bf16-rounded
# activations there, which the reference does not round: the cases run on
# the avx512 level (f32 activations), as tests/reference.test.sh runs its
# plain cases; the rounding itself is checked by that test's last step.
if KVTIER_SIMD=avx512bf16 "$build/kvtier-run" -m model/builtin --ids 1 -n 1 --quiet > /dev/null 2>&1; then
    export KVTIER_SIMD=avx512
fi

for dtype in f32 bf16; do
    case $dtype in f32) tol=3e-4 ;; bf16) tol=3e-2 ;; esac
    echo "$cases" | while read -r name dec _; do
        [ -n "$name" ] || continue
        dir=$tmp/$name-$dtype
        d=; [ "$dec" = - ] || d="--dec $dec"
        # shellcheck disable=SC2086 # $d is empty or one option and its value
        if ! "$run" -m "$dir" --enc "$enc" $d -n 33 --check 8 --dump "$dir/out.kved" > "$dir/log" 2>&1; then
            cat "$dir/log"; echo "FAIL $name-$dtype: kvtier-encdec"; touch "$tmp/failed"; continue
        fi
        echo "$dir $dir/out.kved $dtype $tol $name-$dtype ${d#--dec }" >> "$tmp/cases"
        strict=; [ "$dtype" = f32 ] && strict=strict
        for s in static offloaded cross-host $strict; do
            o="--strategy $s"; e=
            [ "$s" = cross-host ] && o=--cross-host
            # the strict backend (weights uploaded, device memory unreadable
            # from the host), the cross cache streamed: the same numbers
            [ "$s" = strict ] && o=--cross-host && e=KVTIER_BACKEND_STRICT=1
            # shellcheck disable=SC2086
            env $e "$run" -m "$dir" --enc "$enc" $d -n 33 $o --dump "$dir/$s.kved" > "$dir/$s.log" 2>&1 &&
                cmp -s "$dir/out.kved" "$dir/$s.kved" ||
                { cat "$dir/$s.log"; echo "FAIL $name-$dtype: $s differs"; touch "$tmp/failed"; }
        done
        # quantized self cache (8-bit quanto, residual 8), T5's read with its
        # position bias: within the tolerance above of the unquantized
        # reference (BART's rounding is 2e-2 off), and not the dense run's dump
        if [ "$dtype" = f32 ]; then
            case $name in t5*) qtol=3e-1 ;; *) qtol=5e-2 ;; esac
            # shellcheck disable=SC2086
            "$run" -m "$dir" --enc "$enc" $d -n 33 --strategy quantized --dump "$dir/quant.kved" > "$dir/quant.log" 2>&1
            if [ -s "$dir/quant.kved" ] && ! cmp -s "$dir/out.kved" "$dir/quant.kved"; then
                echo "$dir $dir/quant.kved f32 $qtol $name-quantized ${d#--dec }" >> "$tmp/cases"
            else
                cat "$dir/quant.log"; echo "FAIL $name: quantized did not run or did not quantize"; touch "$tmp/failed"
            fi
            # its cross cache streamed beside the quantized blocks, and the
            # same on the strict backend: the same dump
            for e in "" KVTIER_BACKEND_STRICT=1; do
                # shellcheck disable=SC2086
                env $e "$run" -m "$dir" --enc "$enc" $d -n 33 --strategy quantized --cross-host \
                    --dump "$dir/quant-host.kved" > "$dir/quant-host.log" 2>&1 &&
                    cmp -s "$dir/quant.kved" "$dir/quant-host.kved" ||
                    { cat "$dir/quant-host.log"; echo "FAIL $name: quantized, cross cache streamed ${e:-}, differs"; touch "$tmp/failed"; }
            done
        fi
        # BART's learned positions end at max_position_embeddings (128)
        if [ "$name-$dtype" = bart-f32 ]; then
            "$run" -m "$dir" --enc-len 128 -n 1 > "$dir/pos.log" 2>&1 &&
                ! "$run" -m "$dir" --enc-len 129 -n 1 >> "$dir/pos.log" 2>&1 ||
                { cat "$dir/pos.log"; echo "FAIL $name-$dtype: an input past max_position_embeddings"; touch "$tmp/failed"; }
        fi
        # a device budget of the activations and a few KV blocks: a step
        # runs out, the self cache and then, steps later, the cross cache
        # move to the host tier, the cross cache then streaming through the
        # device slots, and the generation goes on with the same numbers
        # (the budgets are this model's, the head's 16 rows of logits
        # included: the cross cache moves mid-way)
        case $name-$dtype in t5gg-f32) mem=920K ;; bartsc-f32) mem=750K ;; *) mem= ;; esac
        if [ -n "$mem" ]; then
            "$run" -m "$dir" --enc "$enc" -n 33 --device-mem "$mem" --dump "$dir/oom.kved" > "$dir/oom.log" 2>&1 &&
                cmp -s "$dir/out.kved" "$dir/oom.kved" &&
                grep -q "self-attention cache: 33 tokens, device 0 bytes, host [1-9].*moved to the host tier by a device OOM" \
                    "$dir/oom.log" &&
                grep -Eq "cross-attention cache: 20 tokens, device 0 bytes, host [1-9][0-9]* bytes, streamed through the device slots in ([2-9]|[12][0-9]) steps, moved to the host tier by a device OOM" \
                    "$dir/oom.log" ||
                { cat "$dir/oom.log"; echo "FAIL $name-$dtype: the OOM continuation"; touch "$tmp/failed"; }
        fi
        grep -q "cross-attention cache: 20 tokens, device 0 bytes, host [1-9][0-9]* bytes, streamed through the device slots in 33 steps" \
            "$dir/cross-host.log" ||
            { cat "$dir/cross-host.log"; echo "FAIL $name-$dtype: the cross cache is not streamed from the host tier"; touch "$tmp/failed"; }
    done
done
$py tests/encdec_compare.py --enc "$enc" "$tmp/cases" || touch "$tmp/failed"
if [ -e "$tmp/failed" ]; then
    echo "encdec.test: FAILED"
    exit 1
fi
echo "encdec.test: T5 and BART match the reference; crop, fork, reuse and the strategies agree"
