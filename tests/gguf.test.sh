#!/bin/sh
# gguf.test.sh - GGUF files written by tools/st2gguf.py (an independent
# writer: standard-library Python) load and compute what the same weights
# do from safetensors: the greedy tokens and every logit of kvtier-run
# --dump byte for byte, for the built-in model (f32) and random bf16
# llama, qwen2 and qwen3 models (tools/mkmodel.py), and with Q8_0 layer
# matrices the same as --weights q8_0 from safetensors, and with Q4_K ones
# (st2gguf's numpy quantizer, written to produce util/q4k.c's blocks bit
# for bit) the same as --weights q4_k; the tokenizer from the GGUF
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
$py tools/st2gguf.py --model "$work/llama" --out "$work/llama-q8.gguf" --type q8_0 >/dev/null || exit 1
same "$work/llama" "--weights q8_0" "$work/llama-q8.gguf" ""
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
