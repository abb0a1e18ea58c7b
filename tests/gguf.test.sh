#!/bin/sh
# gguf.test.sh - GGUF files written by tools/st2gguf.py (an independent
# writer: standard-library Python) load and compute what the same weights
# do from safetensors: the greedy tokens and every logit of kvtier-run
# --dump byte for byte, for the built-in model (f32) and random bf16
# llama, qwen2, qwen3, gemma2, gemma3, phi3 and gpt2 models
# (tools/mkmodel.py; Gemma's norms stored as 1 + w, Phi-3's fused
# projections and longrope factor tensors, GPT-2's transposed Conv1D
# weights, Gemma 3's window period and linear RoPE scaling), and with Q8_0 layer
# matrices the same as --weights q8_0 from safetensors, and with Q4_K ones
# (st2gguf's numpy quantizer, written to produce util/q4k.c's blocks bit
# for bit) the same as --weights q4_k, and Q6_K ones as their Q8_0
# requantization; the tokenizer from the GGUF
# metadata encodes as tokenizer.json does (tests/test_gguf.c); `kvtier
# quantize` writes a GGUF that loads as --weights q8_0 (q4_k); a cut file
# is refused with a message.  The random models need Debian's python3 with
# torch (else only the built-in model's part runs).
build=${KVTIER_BUILD:-build}
run=$build/kvtier-run
for b in "$run" "$build/tests/test_gguf" "$build/kvtier"; do
  [ -x "$b" ] || { echo "gguf.test.sh: $b is not built"; exit 1; }
done
py=/usr/bin/python3
work=$(mktemp -d) || exit 1
trap 'rm -rf "$work"' EXIT
ids=5,17,33,2,9,44,101

# same MODEL_A ARGS_A MODEL_B ARGS_B: the two dumps are one file
same() {
  "$run" -m "$1" $2 --ids $ids -n 12 --greedy --ignore-eos --quiet --dump "$work/a" >/dev/null || exit 1
  "$run" -m "$3" $4 --ids $ids -n 12 --greedy --ignore-eos --quiet --dump "$work/b" >/dev/null || exit 1
  cmp -s "$work/a" "$work/b" || { echo "gguf.test.sh: $1 $2 and $3 $4 differ"; exit 1; }
  echo "gguf.test.sh: $1 $2 = $3 $4"
}

$py tools/st2gguf.py --model model/builtin --out "$work/builtin.gguf" >/dev/null || exit 1
same model/builtin "" "$work/builtin.gguf" ""
KVTIER_GGUF_TOK="$work/builtin.gguf" KVTIER_GGUF_TOK_DIR=model/builtin "$build/tests/test_gguf" || exit 1

# kvtier quantize: the built-in model as Q8_0 runs as --weights q8_0 does
"$build/kvtier" quantize model/builtin "$work/builtin-q8.gguf" || exit 1
same model/builtin "--weights q8_0" "$work/builtin-q8.gguf" ""
# and as Q4_K (down_proj; the other matrices' rows fall back to Q8_0) as --weights q4_k
"$build/kvtier" quantize --type q4_k model/builtin "$work/builtin-q4.gguf" 2>/dev/null || exit 1
same model/builtin "--weights q4_k" "$work/builtin-q4.gguf" ""
"$build/kvtier" quantize --type bf16 model/builtin "$work/builtin-bf16.gguf" || exit 1
"$run" -m "$work/builtin-bf16.gguf" --ids $ids -n 4 --greedy --quiet >/dev/null || exit 1
KVTIER_GGUF_TOK="$work/builtin-q8.gguf" KVTIER_GGUF_TOK_DIR=model/builtin "$build/tests/test_gguf" >/dev/null || exit 1

# a cut file: an error naming it, not a crash
head -c 3000 "$work/builtin.gguf" > "$work/cut.gguf"
"$run" -m "$work/cut.gguf" --ids $ids -n 4 --greedy --quiet >/dev/null 2>"$work/err"
rc=$?
if [ $rc -eq 0 ] || [ $rc -gt 128 ] || ! grep -q "cut.gguf" "$work/err"; then
  echo "gguf.test.sh: the cut file gave rc $rc: $(cat "$work/err")"
  exit 1
fi

if ! $py -c 'import torch' 2>/dev/null; then
  echo "gguf.test.sh: no torch in $py: the random models are skipped"
  exit 0
fi
for arch in llama qwen2 qwen3; do
  $py tools/mkmodel.py --preset tiny --arch $arch --ffn 192 --dtype bf16 --seed 7 --out "$work/$arch" >/dev/null || exit 1
  $py tools/st2gguf.py --model "$work/$arch" --out "$work/$arch.gguf" >/dev/null || exit 1
  same "$work/$arch" "" "$work/$arch.gguf" ""
done
# the shapes tests/reference.test.sh checks against PyTorch, with what
# llama.cpp derives instead of reading (Gemma's query_pre_attn_scalar is
# head_dim; Gemma 2 always caps)
while read -r arch args; do
  $py tools/mkmodel.py $args --dtype bf16 --seed 7 --out "$work/$arch" >/dev/null || exit 1
  $py tools/st2gguf.py --model "$work/$arch" --out "$work/$arch.gguf" >/dev/null || exit 1
  same "$work/$arch" "" "$work/$arch.gguf" ""
done <<EOF
gemma2 --arch gemma2 --layers 4 --dim 64 --heads 4 --kv-heads 2 --head-dim 16 --ffn 160 --vocab 384 --window 8 --attn-softcap 5 --final-softcap 10 --tie
gemma3 --arch gemma3 --layers 4 --dim 64 --heads 4 --kv-heads 1 --head-dim 32 --ffn 160 --vocab 384 --window 8 --window-pattern 3 --theta 1000000 --local-theta 5000 --rope-scaling linear:4 --final-softcap 10 --tie
phi3 --arch phi3 --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn 160 --vocab 384 --window 8 --partial-rotary 0.75 --rope-scaling longrope --max-pos 2048 --orig-max-pos 512
gpt2 --arch gpt2 --layers 2 --dim 64 --heads 4 --ffn 160 --vocab 384 --max-pos 64
EOF
for arch in llama phi3 gpt2; do
  $py tools/st2gguf.py --model "$work/$arch" --out "$work/$arch-q8.gguf" --type q8_0 >/dev/null || exit 1
  same "$work/$arch" "--weights q8_0" "$work/$arch-q8.gguf" ""
done
# Q6_K (no kernel reads it) is requantized to Q8_0 at load: the same as a
# file of the Q8_0 blocks tools/torchref.py makes from its own Q6_K
# dequantizer (written from the block layout; the rows must be whole
# super-blocks, hence the wider model)
$py tools/mkmodel.py --arch llama --layers 2 --dim 256 --heads 4 --kv-heads 2 --ffn 512 --vocab 384 --dtype bf16 \
  --seed 3 --out "$work/wide" >/dev/null || exit 1
$py tools/st2gguf.py --model "$work/wide" --out "$work/wide-q6.gguf" --type q6_k >/dev/null || exit 1
$py tools/st2gguf.py --model "$work/wide" --out "$work/wide-q6q8.gguf" --type q6_k --q6k-as-q8 >/dev/null || exit 1
same "$work/wide-q6.gguf" "" "$work/wide-q6q8.gguf" ""
# refused with a message naming the field: an architecture not read, a
# longrope file missing one factor tensor (bytes renamed in place)
refused() {
  $py -c 'import sys; b = open(sys.argv[1], "rb").read(); open(sys.argv[2], "wb").write(b.replace(sys.argv[3].encode(), sys.argv[4].encode(), 1))' \
    "$work/$1.gguf" "$work/bad.gguf" "$2" "$3" || exit 1
  "$run" -m "$work/bad.gguf" --ids $ids -n 1 --greedy --quiet >/dev/null 2>"$work/err"
  rc=$?
  if [ $rc -eq 0 ] || [ $rc -gt 128 ] || ! grep -q "$4" "$work/err"; then
    echo "gguf.test.sh: $1 with $2 -> $3 gave rc $rc: $(cat "$work/err")"; exit 1
  fi
}
refused gpt2 gpt2 gptx 'general.architecture "gptx" is not supported (llama, qwen2, qwen3, gemma2, gemma3, phi3, gpt2)'
refused phi3 rope_factors_short.weight rope_factors_shorx.weight 'missing tensor rope_factors_short.weight'
# a query_pre_attn_scalar llama.cpp would not take is refused, not written
$py tools/mkmodel.py --arch gemma2 --layers 2 --dim 64 --heads 4 --kv-heads 2 --head-dim 16 --ffn 160 --vocab 384 \
  --window 8 --qpas 24 --attn-softcap 5 --final-softcap 10 --tie --dtype bf16 --out "$work/gemma2q" >/dev/null || exit 1
if $py tools/st2gguf.py --model "$work/gemma2q" --out "$work/gemma2q.gguf" 2>"$work/err"; then
  echo "gguf.test.sh: st2gguf wrote a gemma2 with query_pre_attn_scalar 24"; exit 1
fi
grep -q query_pre_attn_scalar "$work/err" || { echo "gguf.test.sh: $(cat "$work/err")"; exit 1; }
# Q4_K from the other writer: every block must equal kvtier's for the dumps to
$py tools/st2gguf.py --model model/builtin --out "$work/builtin-q4py.gguf" --type q4_k >/dev/null || exit 1
same model/builtin "--weights q4_k" "$work/builtin-q4py.gguf" ""
# kvtier quantize on a bf16 llama: its q/k rows permuted as llama.cpp's converter does
"$build/kvtier" quantize --type bf16 "$work/llama" "$work/llama-kq.gguf" || exit 1
same "$work/llama" "" "$work/llama-kq.gguf" ""
"$build/kvtier" quantize "$work/qwen2" "$work/qwen2-kq8.gguf" || exit 1
same "$work/qwen2" "--weights q8_0" "$work/qwen2-kq8.gguf" ""
KVTIER_GGUF_TOK="$work/llama.gguf" KVTIER_GGUF_TOK_DIR="$work/llama" "$build/tests/test_gguf" || exit 1
echo "gguf.test.sh: ok"
