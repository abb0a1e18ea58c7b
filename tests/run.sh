#!/bin/sh
# run.sh BUILD - runs every test program in BUILD/tests and every oracle
# script tests/*.test.sh (which get BUILD in $KVTIER_BUILD), each under a
# timeout, on the CPU backend and again on the strict one.  Exit 77 means
# "skipped" (a missing capability, e.g. no GPU).
# Tests run KVTIER_TEST_JOBS at a time (default: the number of CPUs, at most
# 2): many of them wait on sockets, timers and the disk rather than compute,
# and every test keeps its files in a directory of its own.  Each test's
# output is printed whole when it ends.
# Ends with the line "N passed, N failed, N skipped".
if [ "$1" = --one ]; then
  # run.sh --one DIR INDEX BACKEND KIND NAME: one test, output to DIR/INDEX.log
  dir=$2; idx=$3; backend=$4; kind=$5; name=$6
  tag=""
  if [ "$backend" = cpu-strict ]; then export KVTIER_BACKEND_STRICT=1; tag=" [cpu-strict]"; fi
  if [ "$backend" = cuda ]; then export KVTIER_TEST_BACKEND=cuda; tag=" [cuda]"; fi
  t0=$(date +%s)
  {
    printf '== %s\n' "$name$tag"
    if [ "$kind" = bin ]; then
      timeout "${KVTIER_TEST_TIMEOUT:-600}" "$KVTIER_BUILD/tests/$name"
    else
      timeout "${KVTIER_TEST_TIMEOUT:-600}" sh "tests/$name"
    fi
    rc=$?
    echo "-- $name$tag: $(( $(date +%s) - t0 )) s"
    case $rc in
      0) ;;
      77) echo "-- $name$tag: skipped" ;;
      *) echo "-- $name$tag: FAILED (exit $rc)" ;;
    esac
    echo "$rc $name$tag" >"$dir/$idx.rc"
  } >"$dir/$idx.log" 2>&1 </dev/null
  flock "$dir/lock" cat "$dir/$idx.log"
  exit 0
fi

build=${1:-build}
export KVTIER_BUILD="$build"
export CMOCKA_MESSAGE_OUTPUT=stdout
# a daemon a test starts without the harness never touches the user's
# state directory (the harness gives each daemon a disk tier of its own)
export KVTIER_DISK_DIR=none
# The suite runs twice: on the CPU backend, then with every "cpu" backend
# replaced by the strict one (backend/strict.c), whose device memory faults
# on any access from outside the backend: the same tests, the same expected
# tokens.  Tests that open no backend run once, and so does test_backend:
# it is the CPU backend's own conformance test, which fills and reads its
# buffers directly, and it checks the strict backend itself.  So do the
# tests of what lies beside the backend, not behind it: connection limits
# between uids, I/O faults of the disk tier, file ownership; and the
# oracle tests of the numbers (PyTorch, beam search's decisions, the Python
# sinks and quantization oracles, the built-in model's sample), whose forward
# passes the unit and daemon tests already run on the strict backend.
# Under the sanitizers (build/asan) only the first pass runs: the strict
# pass looks for host access to device memory, which does not depend on
# ASan, and the second pass would double the sanitizer run's time.  The
# oracle tests are left out there too: they compare numbers with Python
# references (PyTorch, beam decisions, the tokenizer oracle, the GGUF
# reader), and the C they run (the forward pass of every architecture, the
# kernels, the loader, the tokenizer) runs under the sanitizers in the
# unit tests, the daemon tests and the fuzzers.
no_backend=" test_backend test_disk test_tokenizer test_daemon_ipc test_sampler test_client layers.test.sh tokenizer.test.sh unigram.test.sh "
no_backend="$no_backend daemon_slow.test.sh daemon_disk_faults.test.sh daemon_disk_uid.test.sh "
no_backend="$no_backend reference.test.sh beams.test.sh sinks.test.sh quant.test.sh builtin.test.sh "
no_backend="$no_backend test_readbw st2gguf.test.sh q8ref.test.sh q4kref.test.sh cli_tty.test.sh "
# the API's other faces (Ollama, TCP) and the penalties' oracle: what they
# check is above the forward pass, which the daemon tests run strict
no_backend="$no_backend daemon_ollama.test.sh daemon_tcp.test.sh daemon_penalties.test.sh "
no_backend="$no_backend install.test.sh sockpath.test.sh "
no_backend="$no_backend test_grammar test_toolcall daemon_json.test.sh "
no_backend="$no_backend test_hist plots.test.sh daemon_alloc.test.sh "
# test_tiers and daemon_loop run once too: on machines where mprotect is
# slow their strict pass (every op opens and closes the arena, thousands
# of decode steps) takes 8 to over 15 minutes, past CI's budget, and
# daemon_loop measures stalls that the strict backend's cost is not; the
# other daemon tests keep the store on the strict backend.
no_backend="$no_backend test_tiers daemon_loop.test.sh "
no_backend="$no_backend daemon_remote.test.sh test_remote test_cuda cuda_nodev.test.sh cuda_e2e.test.sh "
# the encoder-decoder oracles (PyTorch, beam decisions) run once; the
# daemon's encoder-decoder tests, over kvtier-encdec's tokens, run strict too
# (daemon_encdec_sess restores layer by layer there; daemon_encdec_disk's
# 10 MiB session on a slowed disk takes over a minute strict)
no_backend="$no_backend test_jinja jinja.test.sh encdec.test.sh daemon_encdec_beams.test.sh daemon_encdec_disk.test.sh "
no_backend="$no_backend test_gguf gguf.test.sh gguf_tokenizer.test.sh q4k_bytes.test.sh gguf_quantize.test.sh "
oracles=" reference.test.sh q8ref.test.sh q4kref.test.sh beams.test.sh sinks.test.sh quant.test.sh builtin.test.sh "
oracles="$oracles tokenizer.test.sh unigram.test.sh st2gguf.test.sh "
oracles="$oracles daemon_penalties.test.sh daemon_json.test.sh jinja.test.sh daemon_mamba.test.sh encdec.test.sh "
oracles="$oracles gguf.test.sh gguf_tokenizer.test.sh q4k_bytes.test.sh daemon_encdec_beams.test.sh gguf_quantize.test.sh "
# The longest tests start first, so the last minutes are not one long test
# running alone.
first=" reference.test.sh test_tiers test_disk daemon_disk_faults.test.sh daemon_slow.test.sh "
first="$first daemon_disk.test.sh daemon_stall.test.sh daemon_loop.test.sh q8ref.test.sh beams.test.sh "
passes="cpu cpu-strict"
# KVTIER_TEST_PASSES=cuda (tools/gpu-check.sh): one pass, every "cpu"
# backend the CUDA plugin, the tests that open no backend left out
[ -n "${KVTIER_TEST_PASSES:-}" ] && passes=$KVTIER_TEST_PASSES
asan=0
case $build in *asan*) passes=cpu; asan=1 ;; esac

work=$(mktemp -d) || exit 1
trap 'rm -rf "$work"' EXIT
: >"$work/lock"
# one line per test: BACKEND KIND NAME; the long ones first
for backend in $passes; do
  for t in "$build"/tests/test_*; do
    [ -x "$t" ] || continue
    case $t in *.d|*.o) continue ;; esac
    name=$(basename "$t")
    [ $backend != cpu ] && case $no_backend in *" $name "*) continue ;; esac
    echo "$backend bin $name"
  done
  for s in tests/*.test.sh; do
    [ -f "$s" ] || continue
    name=$(basename "$s")
    [ $backend != cpu ] && case $no_backend in *" $name "*) continue ;; esac
    [ $asan = 1 ] && case $oracles in *" $name "*) continue ;; esac
    echo "$backend sh $name"
  done
done >"$work/all"
while read -r backend kind name; do
  case $first in *" $name "*) echo "$backend $kind $name" ;; esac
done <"$work/all" >"$work/queue"
while read -r backend kind name; do
  case $first in *" $name "*) ;; *) echo "$backend $kind $name" ;; esac
done <"$work/all" >>"$work/queue"

jobs=${KVTIER_TEST_JOBS:-$(nproc 2>/dev/null || echo 1)}
[ "$jobs" -gt 2 ] 2>/dev/null && jobs=2
[ "$jobs" -ge 1 ] 2>/dev/null || jobs=1
awk '{ print NR, $0 }' "$work/queue" |
  xargs -P "$jobs" -L 1 sh "$0" --one "$work"

pass=0; fail=0; skip=0; failed=""
n=$(wc -l <"$work/queue")
i=1
while [ "$i" -le "$n" ]; do
  if [ -f "$work/$i.rc" ]; then
    read -r rc name <"$work/$i.rc"
  else
    rc=1; name=$(sed -n "${i}p" "$work/queue")
  fi
  case $rc in
    0) pass=$((pass+1)) ;;
    77) skip=$((skip+1)) ;;
    *) fail=$((fail+1)); failed="$failed $(echo "$name" | tr ' ' '_')" ;;
  esac
  i=$((i+1))
done
[ -n "$failed" ] && echo "failed:$failed"
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
