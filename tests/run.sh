#!/bin/sh
# run.sh BUILD - runs every test program in BUILD/tests and every oracle
# script tests/*.test.sh (which get BUILD in $KVTIER_BUILD), each under a
# timeout.  Exit 77 means "skipped" (a missing capability, e.g. no GPU).
# Ends with the line "N passed, N failed, N skipped".
build=${1:-build}
export KVTIER_BUILD="$build"
export CMOCKA_MESSAGE_OUTPUT=stdout
pass=0; fail=0; skip=0; failed=""
run_one() {
  name=$1; shift
  printf '== %s\n' "$name"
  timeout "${KVTIER_TEST_TIMEOUT:-600}" "$@"
  rc=$?
  case $rc in
    0) pass=$((pass+1)) ;;
    77) skip=$((skip+1)); echo "-- $name: skipped" ;;
    *) fail=$((fail+1)); failed="$failed $name"; echo "-- $name: FAILED (exit $rc)" ;;
  esac
}
for t in "$build"/tests/test_*; do
  [ -x "$t" ] || continue
  case $t in *.d|*.o) continue ;; esac
  run_one "$(basename "$t")" "$t"
done
for s in tests/*.test.sh; do
  [ -f "$s" ] || continue
  run_one "$(basename "$s")" sh "$s"
done
[ -n "$failed" ] && echo "failed:$failed"
echo "$pass passed, $fail failed, $skip skipped"
[ "$fail" -eq 0 ]
