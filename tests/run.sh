#!/bin/sh
# run.sh BUILD - runs every test program in BUILD/tests and every oracle
# script tests/*.test.sh (which get BUILD in $KVTIER_BUILD), each under a
# timeout, on the CPU backend and again on the strict one.  Exit 77 means
# "skipped" (a missing capability, e.g. no GPU).
# Ends with the line "N passed, N failed, N skipped".
build=${1:-build}
export KVTIER_BUILD="$build"
export CMOCKA_MESSAGE_OUTPUT=stdout
# a daemon a test starts without the harness never touches the user's
# state directory (the harness gives each daemon a disk tier of its own)
export KVTIER_DISK_DIR=none
pass=0; fail=0; skip=0; failed=""
run_one() {
  name=$1; shift
  printf '== %s\n' "$name"
  t0=$(date +%s)
  timeout "${KVTIER_TEST_TIMEOUT:-600}" "$@"
  rc=$?
  echo "-- $name: $(( $(date +%s) - t0 )) s"
  case $rc in
    0) pass=$((pass+1)) ;;
    77) skip=$((skip+1)); echo "-- $name: skipped" ;;
    *) fail=$((fail+1)); failed="$failed $name"; echo "-- $name: FAILED (exit $rc)" ;;
  esac
}
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
no_backend=" test_backend test_disk test_tokenizer test_daemon_ipc test_sampler layers.test.sh tokenizer.test.sh "
no_backend="$no_backend daemon_slow.test.sh daemon_disk_faults.test.sh daemon_disk_uid.test.sh "
no_backend="$no_backend reference.test.sh beams.test.sh sinks.test.sh quant.test.sh builtin.test.sh "
no_backend="$no_backend test_readbw st2gguf.test.sh q8ref.test.sh "
no_backend="$no_backend test_jinja jinja.test.sh "
oracles=" reference.test.sh q8ref.test.sh beams.test.sh sinks.test.sh quant.test.sh builtin.test.sh "
oracles="$oracles tokenizer.test.sh st2gguf.test.sh "
oracles="$oracles jinja.test.sh "
passes="cpu cpu-strict"
asan=0
case $build in *asan*) passes=cpu; asan=1 ;; esac
for backend in $passes; do
  if [ $backend = cpu-strict ]; then export KVTIER_BACKEND_STRICT=1; tag=" [cpu-strict]"; else tag=""; fi
  for t in "$build"/tests/test_*; do
    [ -x "$t" ] || continue
    case $t in *.d|*.o) continue ;; esac
    name=$(basename "$t")
    [ -n "$tag" ] && case $no_backend in *" $name "*) continue ;; esac
    run_one "$name$tag" "$t"
  done
  for s in tests/*.test.sh; do
    [ -f "$s" ] || continue
    name=$(basename "$s")
    [ -n "$tag" ] && case $no_backend in *" $name "*) continue ;; esac
    [ $asan = 1 ] && case $oracles in *" $name "*) continue ;; esac
    run_one "$name$tag" sh "$s"
  done
done
unset KVTIER_BACKEND_STRICT
[ -n "$failed" ] && echo "failed:$failed"
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
