#!/bin/sh
# gpu-check.sh - the one prepared check of the CUDA backend on a GPU machine,
# in one call of about 6 minutes:
#
#   sh tools/gpu-bundle.sh           (here, on the build machine: makes .gpu/bundle.tar.gz)
#   sh tools/gpu-check.sh            (there, as root; results under $OUT, else ./gpu-check.out)
#
# 1. The programs: the bundle tools/gpu-bundle.sh made (the GPU machines
#    lent for this reach no package mirror and run another distribution,
#    so kvtier's build dependencies cannot be installed there), else a
#    build here (tools/deps.sh, make CUDA=1) where the machine can.
# 2. The GPU's limits (kvtier-cuda-limits): HBM copy, pinned host<->device
#    bandwidth, cuBLAS bf16 GEMM peak on random data.
# 3. Correctness first: the op conformance against the CPU (test_cuda, and
#    again under compute-sanitizer's memcheck where the machine has it), end
#    to end against the CPU with every strategy and a real OOM (cuda_e2e.py),
#    the store and tier tests and the memory-budget test with every "cpu"
#    backend the plugin (KVTIER_TEST_BACKEND=cuda, f32 activations).  On a
#    machine with a GPU a test that skips (exit 77) counts as failed.
# 4. Benchmarks: decode and prefill of the TinyLlama-1.1B shape next to the
#    limits of step 2; with KVTIER_GPU_CHECK_8B=1 also a Llama-3-8B shape
#    (random bf16 weights made there, 16 GB) and its resident vs offloaded
#    decode at 32k context with the host->device rate and the overlap.
#
# Every step runs under a timeout cut to what is left of the budget
# (KVTIER_GPU_CHECK_SECONDS, default 330); what does not fit is reported as
# not run.  KVTIER_GPU_CHECK_STEPS="test_cuda cuda_e2e ..." runs only the
# steps named (a rerun after a fix; a benchmark needs its model step named
# too: "mkmodel_tinyllama bench_tinyllama").  $OUT gets results.md (the table, the
# commands, the pass/fail of each step), rewritten after every step so a
# cut-off run still reports, and logs.tar.gz (every step's whole output).
set -u
cd "$(dirname "$0")/.." || exit 1
T0=$(date +%s)
BUDGET=${KVTIER_GPU_CHECK_SECONDS:-330}
ONLY=${KVTIER_GPU_CHECK_STEPS:-}
OUT=${OUT:-$PWD/gpu-check.out}
LOGS=$OUT/logs
mkdir -p "$LOGS" || exit 1
RES=$OUT/results.md
# the machine's python3, the one with torch, for tools/mkmodel.py; the
# tests read it from KVTIER_PYTHON
PY=$(command -v python3 || echo /usr/bin/python3)
export KVTIER_PYTHON=$PY PYTHONUNBUFFERED=1
JOBS=$(nproc 2>/dev/null || echo 4)
WORK=${KVTIER_GPU_WORK:-/tmp/kvtier-gpu-check}
mkdir -p "$WORK"
GPU=0
HBM= H2D= D2H= GEMM=

left() { echo $((BUDGET - ($(date +%s) - T0))); }
STEPS=""
# step NAME SECONDS CMD...: CMD under min(SECONDS, what is left - 5 s), its
# output in $LOGS/NAME.log; the status joins the step table
step() {
  name=$1; want=$2; shift 2
  if [ -n "$ONLY" ] && ! echo " $ONLY " | grep -q " $name "; then
    return 1
  fi
  l=$(($(left) - 5))
  if [ "$l" -lt 10 ]; then
    STEPS="$STEPS
| $name | not run (out of time) | |"
    results
    return 1
  fi
  [ "$want" -lt "$l" ] && l=$want
  s0=$(date +%s)
  timeout "$l" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  dt=$(($(date +%s) - s0))
  case $rc in
    0) st=pass ;;
    77) if [ $GPU = 1 ]; then st="FAILED (skipped, exit 77, on a machine with a GPU)"; else st="skipped (exit 77)"; fi ;;
    124) st="timed out after ${l}s" ;;
    *) st="FAILED (exit $rc)" ;;
  esac
  STEPS="$STEPS
| $name | $st | ${dt}s |"
  echo "== $name: $st (${dt}s)"
  results
  return $rc
}

# value KEY FILE: the number after "KEY " in FILE
value() { awk -v k="$1" '$1 == k { print $2; exit }' "$2" 2>/dev/null; }
pct() { awk -v a="$1" -v b="$2" 'BEGIN { if (a != "" && b > 0) printf "%.0f %%", 100 * a / b; else print "n/a" }'; }

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

# results: results.md from what has run so far
results() {
  {
    echo "# kvtier GPU check"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), programs: ${FROM:-?}, \`sh tools/gpu-check.sh\`${ONLY:+ (steps: $ONLY)}"
    echo
    echo '```'
    cat "$LOGS/machine.log" 2>/dev/null
    echo '```'
    echo
    echo "## Steps"
    echo
    echo "| step | result | time |"
    echo "|---|---|---|$STEPS"
    echo
    echo "## Limits (kvtier-cuda-limits, best of 5)"
    echo
    echo "HBM copy ${HBM:-n/a} GB/s (read + write), pinned host->device ${H2D:-n/a} GB/s, device->host ${D2H:-n/a} GB/s, cuBLAS bf16 GEMM ${GEMM:-n/a} TFLOP/s (random data)."
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
    sed -n '/ctx mode/,$p' "$LOGS/tiers_8b.log" 2>/dev/null || echo "not run (KVTIER_GPU_CHECK_8B=1 runs it)"
    echo '```'
    echo
    echo "Not measured by this script: CUDA graphs (the backend does not capture graphs yet)."
  } >"$RES"
}
# at any exit, the logs in one file: the device tool returns 8 files at most
trap 'results; tar -C "$OUT" -czf "$OUT/logs.tar.gz" logs && rm -rf "$LOGS"; echo "results: $RES ($(($(date +%s) - T0)) s)"' EXIT

# ---- 1. the programs ----
if [ -f .gpu/bundle.tar.gz ]; then
  ONLY_SAVED=$ONLY; ONLY=
  step bundle 60 tar -C .gpu -xzf .gpu/bundle.tar.gz
  ONLY=$ONLY_SAVED
  B=.gpu/build
  FROM="the bundle of $(cat .gpu/COMMIT 2>/dev/null || echo '?') (tools/gpu-bundle.sh)"
else
  # .deb files carried in $KVTIER_DEBS first, then tools/deps.sh for
  # whatever is still missing (a machine that reaches a mirror)
  DEBS=${KVTIER_DEBS:-.debs}
  step deps 90 sh -c '
    if ls "$1"/*.deb >/dev/null 2>&1; then dpkg -i "$1"/*.deb || exit 1; fi
    tools/deps.sh build && { dpkg-query -W libcmocka-dev >/dev/null 2>&1 || apt-get install -y -qq libcmocka-dev; }' \
    deps "$DEBS"
  # -o deps: the step above did what `make deps` would
  step build 200 make -j"$JOBS" -o deps -o deps-test CUDA=1 all build/tests/test_cuda build/tests/test_tiers \
    build/tests/test_kvstore
  B=build
  FROM="built here (make CUDA=1)"
fi
export KVTIER_BUILD=$B KVTIER_DISK_DIR=none
# cuBLAS: the plugin's rpath names /usr/local/cuda/lib64; where the machine
# keeps it elsewhere (beside its nvcc, or in its python's nvidia wheels),
# the loader is told
if ldd "$B/kvtier-cuda-limits" 2>/dev/null | grep -q "not found"; then
  nv=$(command -v nvcc || echo /nonexistent/bin/nvcc)
  for d in "${nv%/bin/nvcc}/lib64" /usr/local/cuda/targets/x86_64-linux/lib \
    $("$PY" -c 'import glob, os, site
print(" ".join(sorted({os.path.dirname(p) for d in site.getsitepackages()
                       for p in glob.glob(d + "/nvidia/**/libcublas.so*", recursive=True)})))' 2>/dev/null); do
    [ -d "$d" ] && LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d
  done
  export LD_LIBRARY_PATH
fi
{
  nvidia-smi 2>&1 | head -15
  sed -n 's/^PRETTY_NAME=//p' /etc/os-release 2>/dev/null
  "$B/kvtierd" --version 2>&1
  ldd "$B/libkvtier-cuda.so" 2>&1 | grep -E "cublas|not found"
  echo "python3: $PY ($("$PY" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1))"
} >"$LOGS/machine.log"

# ---- 2. limits ----
# whether the machine has a GPU comes from the driver, not from the CUDA
# runtime: a driver too old for it says "no CUDA device" too, and that is
# a failure here, not a skip
if nvidia-smi -L 2>/dev/null | grep -q '^GPU ' || [ -e /dev/nvidia0 ]; then GPU=1; fi
ONLY_SAVED=$ONLY; ONLY=
step limits 60 "$B/kvtier-cuda-limits" --passes 5
ONLY=$ONLY_SAVED
L=$LOGS/limits.log
HBM=$(value hbm_copy_gbs "$L"); H2D=$(value h2d_pinned_gbs "$L"); D2H=$(value d2h_pinned_gbs "$L")
GEMM=$(value gemm_bf16_tflops "$L")

# ---- 3. correctness ----
step test_cuda 60 "$B/tests/test_cuda"
# the same ops under compute-sanitizer's memcheck: an out-of-bounds access
# in a kernel that never ran before shows here even where the numbers agree
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ $GPU = 1 ] && [ -n "$CS" ]; then
  step memcheck_test_cuda 90 "$CS" --tool memcheck --error-exitcode 86 "$B/tests/test_cuda"
elif [ $GPU = 1 ]; then
  STEPS="$STEPS
| memcheck_test_cuda | not run: no compute-sanitizer | |"
fi
step cuda_e2e 120 "$PY" tests/cuda_e2e.py
if [ $GPU = 0 ]; then
  STEPS="$STEPS
| sweeps, benchmarks | not run: $(head -1 "$LOGS/limits.log" 2>/dev/null) | |"
  exit 0
fi
# the store's and tiers' tests, f32 activations: they expect the CPU
# backend's numbers (a failure there may be the batch-dependent sums
# docs/gpu.md describes: read the log before blaming a kernel)
for t in test_tiers test_kvstore; do
  step "sweep_$t" 60 env KVTIER_TEST_BACKEND=cuda KVTIER_CUDA_ACT=f32 "$B/tests/$t"
done
step daemon_memory 60 env KVTIER_TEST_BACKEND=cuda KVTIER_CUDA_ACT=f32 "$PY" tests/daemon_memory.py

# ---- 4. benchmarks ----
# bench NAME MODEL: kvtier-bench on the plugin; prefill and decode tokens/s
bench() {
  step "bench_$1" 90 "$B/kvtier-bench" --backend cuda -m "$2" --prompt 512 --decode 64 --repeat 3 --bw-passes 1
}
TL=$WORK/tinyllama
step mkmodel_tinyllama 60 "$PY" tools/mkmodel.py --preset tinyllama-1.1b --dtype bf16 --out "$TL" && bench tinyllama "$TL"
if [ "${KVTIER_GPU_CHECK_8B:-0}" = 1 ]; then
  L8=$WORK/llama3-8b
  step mkmodel_8b 150 "$PY" tools/mkmodel.py --preset llama3-8b --dtype bf16 --max-pos 40960 --out "$L8" &&
    bench 8b "$L8" &&
    step tiers_8b 120 "$B/kvtier-bench-tiers" --backend cuda -m "$L8" --ctx 32768 --decode 8 --repeat 2 \
      --kv-dtype bf16 --device-mem 40G
fi
