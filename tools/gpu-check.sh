#!/bin/sh
# gpu-check.sh - the one prepared check of the CUDA backend on a GPU machine,
# from a bare machine with this repository, in at most 8 minutes:
#
#   sh tools/gpu-check.sh            (as root; results under $OUT, else ./gpu-check.out)
#
# 1. Debian packages the build needs (tools/deps.sh build, plus cmocka);
#    where the machine cannot reach a mirror, .deb files carried in
#    $KVTIER_DEBS (default .debs/) are installed instead.
# 2. make CUDA=1: the library, daemon, tools, the plugin, kvtier-cuda-limits.
# 3. The GPU's limits (kvtier-cuda-limits): HBM copy, pinned host<->device
#    bandwidth, cuBLAS bf16 GEMM peak.
# 4. Tests: the op conformance (test_cuda), end to end against the CPU with
#    every strategy and a real OOM (cuda_e2e.py), the device-allocator fault
#    sweeps and the memory-budget test with every "cpu" backend the plugin
#    (KVTIER_TEST_BACKEND=cuda).
# 5. Benchmarks: decode and prefill of the TinyLlama-1.1B shape and of a
#    Llama-3-8B shape (random bf16 weights made here, 16 GB), each next to
#    the limit step 3 measured; resident vs offloaded decode at 32k context
#    for the 8B shape with the host->device rate and the overlap.
#
# Every step runs under a timeout cut to what is left of the 8 minutes;
# what does not fit is reported as not run.  $OUT gets results.md (the
# table, the commands, the pass/fail of each step) and logs.tar.gz (every
# step's whole output).
set -u
cd "$(dirname "$0")/.." || exit 1
T0=$(date +%s)
BUDGET=${KVTIER_GPU_CHECK_SECONDS:-470}
OUT=${OUT:-$PWD/gpu-check.out}
LOGS=$OUT/logs
mkdir -p "$LOGS" || exit 1
RES=$OUT/results.md
PY=$(command -v python3 || echo /usr/bin/python3) # the machine's python3 (with torch) for mkmodel
JOBS=$(nproc 2>/dev/null || echo 4)
WORK=${KVTIER_GPU_WORK:-/tmp/kvtier-gpu-check}
mkdir -p "$WORK"

left() { echo $((BUDGET - ($(date +%s) - T0))); }
STEPS=""
# step NAME SECONDS CMD...: CMD under min(SECONDS, what is left - 5 s), its
# output in $LOGS/NAME.log; the status joins the step table
step() {
  name=$1; want=$2; shift 2
  l=$(($(left) - 5))
  if [ "$l" -lt 10 ]; then
    STEPS="$STEPS
| $name | not run (out of time) | |"
    return 1
  fi
  [ "$want" -lt "$l" ] && l=$want
  s0=$(date +%s)
  timeout "$l" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  dt=$(($(date +%s) - s0))
  case $rc in
    0) st=pass ;;
    77) st="skipped (exit 77)" ;;
    124) st="timed out after ${l}s" ;;
    *) st="FAILED (exit $rc)" ;;
  esac
  STEPS="$STEPS
| $name | $st | ${dt}s |"
  echo "== $name: $st (${dt}s)"
  return $rc
}

# value KEY FILE: the number after "KEY " in FILE
value() { awk -v k="$1" '$1 == k { print $2; exit }' "$2" 2>/dev/null; }
pct() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b > 0) printf "%.0f %%", 100 * a / b; else print "n/a" }'; }

# ---- 1. packages ----
# the .deb files carried in $KVTIER_DEBS first (a GPU machine may reach no
# mirror), then tools/deps.sh for whatever is still missing
DEBS=${KVTIER_DEBS:-.debs}
step deps 90 sh -c '
  if ls "$1"/*.deb >/dev/null 2>&1; then dpkg -i "$1"/*.deb || exit 1; fi
  tools/deps.sh build && { dpkg-query -W libcmocka-dev >/dev/null 2>&1 || apt-get install -y -qq libcmocka-dev; }' \
  deps "$DEBS"

# ---- 2. build ----
# -o deps: step 1 did what `make deps` would (and may have done it offline)
step build 200 make -j"$JOBS" -o deps -o deps-test CUDA=1 all build/tests/test_cuda build/tests/test_dense \
  build/tests/test_image build/tests/test_kvquant build/tests/test_tiers build/tests/test_kvstore

{
  nvidia-smi 2>&1 | head -15
  build/kvtierd --version 2>&1
} >"$LOGS/machine.log"

# ---- 3. limits ----
step limits 60 build/kvtier-cuda-limits --passes 5
GPU=1
grep -q "^no CUDA device" "$LOGS/limits.log" 2>/dev/null && GPU=0
L=$LOGS/limits.log
HBM=$(value hbm_copy_gbs "$L"); H2D=$(value h2d_pinned_gbs "$L"); D2H=$(value d2h_pinned_gbs "$L")
GEMM=$(value gemm_bf16_tflops "$L")

# ---- 4. tests ----
export KVTIER_BUILD=build KVTIER_DISK_DIR=none
step test_cuda 90 build/tests/test_cuda
step cuda_e2e 150 env PYTHONUNBUFFERED=1 "$PY" tests/cuda_e2e.py

# ---- 5. benchmarks (a machine without a GPU stops here) ----
if [ $GPU = 0 ]; then
  STEPS="$STEPS
| benchmarks, sweeps on the plugin | not run: $(head -1 "$LOGS/limits.log") | |"
else
# bench NAME MODEL: kvtier-bench on the plugin; prefill and decode tokens/s
bench() {
  step "bench_$1" 90 build/kvtier-bench --backend cuda -m "$2" --prompt 512 --decode 64 --repeat 3 --bw-passes 1
}
TL=$WORK/tinyllama
step mkmodel_tinyllama 90 "$PY" tools/mkmodel.py --preset tinyllama-1.1b --dtype bf16 --out "$TL" && bench tinyllama "$TL"
L8=$WORK/llama3-8b
step mkmodel_8b 150 "$PY" tools/mkmodel.py --preset llama3-8b --dtype bf16 --max-pos 40960 --out "$L8" &&
  bench 8b "$L8" &&
  step tiers_8b 120 build/kvtier-bench-tiers --backend cuda -m "$L8" --ctx 32768 --decode 8 --repeat 2 \
    --kv-dtype bf16 --device-mem 40G

# ---- the rest of the suite on the plugin, as time allows (f32 activations:
# these tests expect the CPU backend's numbers) ----
for t in test_dense test_image test_kvquant test_tiers test_kvstore; do
  step "sweep_$t" 60 env KVTIER_TEST_BACKEND=cuda KVTIER_CUDA_ACT=f32 "build/tests/$t"
done
step daemon_memory 90 env KVTIER_TEST_BACKEND=cuda KVTIER_CUDA_ACT=f32 "$PY" tests/daemon_memory.py
fi

# ---- results ----
# row LABEL LOG: prefill and decode figures of a kvtier-bench log against the limits
row() {
  log=$LOGS/bench_$2.log
  [ -f "$log" ] || { echo "| $1 | not run | | | |"; return; }
  pre=$(awk '$1 == "prefill" { print $7; exit }' "$log")
  dec=$(awk '$1 == "decode" && $2 != "weights" { print $7; exit }' "$log")
  wgb=$(awk '$1 == "decode" && $2 == "weights" { print $3; exit }' "$log")
  gb=$(sed -n 's/.*, \([0-9.]*\) GB of matrices).*/\1/p' "$log" | head -1)
  # prefill FLOP/s = 2 x parameters (bf16: 2 bytes each) x tokens/s
  tf=$(awk -v g="$gb" -v t="$pre" 'BEGIN { if (g != "" && t != "") printf "%.1f", 2 * g * 1e9 / 2 * t / 1e12 }')
  echo "| $1 | ${pre:-n/a} tok/s, ${tf:-n/a} TFLOP/s = $(pct "$tf" "$GEMM") of cuBLAS bf16 ${GEMM:-n/a} | ${dec:-n/a} tok/s | ${wgb:-n/a} GB/s of weights = $(pct "$wgb" "$HBM") of HBM copy ${HBM:-n/a} GB/s | |"
}
{
  echo "# kvtier GPU check"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), \`sh tools/gpu-check.sh\`"
  echo
  echo '```'
  cat "$LOGS/machine.log"
  echo '```'
  echo
  echo "## Steps"
  echo
  echo "| step | result | time |"
  echo "|---|---|---|$STEPS"
  echo
  echo "## Limits (kvtier-cuda-limits, best of 5)"
  echo
  echo "HBM copy ${HBM:-n/a} GB/s (read + write), pinned host->device ${H2D:-n/a} GB/s, device->host ${D2H:-n/a} GB/s, cuBLAS bf16 GEMM ${GEMM:-n/a} TFLOP/s."
  echo
  echo "## Forward pass (kvtier-bench --backend cuda --prompt 512 --decode 64 --repeat 3, medians of rounds)"
  echo
  echo "| model (bf16, random weights) | prefill vs GEMM peak | decode | decode weights vs HBM copy | |"
  echo "|---|---|---|---|---|"
  row "TinyLlama-1.1B shape" tinyllama
  row "Llama-3-8B shape" 8b
  echo
  echo "## Offloaded vs resident decode, 8B shape, 32k context (kvtier-bench-tiers --backend cuda)"
  echo
  echo "Pinned host->device measured above: ${H2D:-n/a} GB/s. Targets: moved/token x tok/s >= 80 % of it, overlap >= 90 %."
  echo
  echo '```'
  sed -n '/ctx mode/,$p' "$LOGS/tiers_8b.log" 2>/dev/null || echo "not run"
  echo '```'
  echo
  echo "Not measured by this script: CUDA graphs (the backend does not capture graphs yet)."
} >"$RES"
tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs && rm -rf "$LOGS"
echo "results: $RES ($(($(date +%s) - T0)) s)"
