#!/bin/sh
# cuda_nodev.test.sh - `kvtierd --backend cuda` where it cannot run: one
# line "--backend cuda: ..." naming why, exit 3 (the model's code), no
# socket left behind, no crash.  Without the plugin the line says how to
# build it; with the plugin on a machine without a GPU or driver it says
# "no CUDA device (<the runtime's reason>)".  On a machine with a GPU the
# daemon starts: then this test has nothing to check and exits 77.
build=${KVTIER_BUILD:-build}
d=$build/kvtierd
[ -x "$d" ] || { echo "skip: $build not built"; exit 77; }
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; cat "$tmp/err"; exit 1; }

# run [VAR=value...]: kvtierd --backend cuda, its stderr in $tmp/err, rc in $rc
run() {
  env KVTIER_DISK_DIR=none "$@" timeout 30 "$d" --backend cuda --socket "$tmp/s.sock" 2>"$tmp/err" >/dev/null
  rc=$?
}

# no plugin where it is looked for
run KVTIER_CUDA_PLUGIN="$tmp/none"
if [ -f "$build/libkvtier-cuda.so" ]; then
  :  # next to the daemon: found without the variable, tried below
else
  [ $rc -eq 3 ] || fail "without the plugin: exit $rc, not 3"
  grep -q -- "--backend cuda: no CUDA plugin (libkvtier-cuda.so not built: make CUDA=1)" "$tmp/err" ||
    fail "without the plugin: no clear line"
  [ -e "$tmp/s.sock" ] && fail "the socket was left behind"
  echo "ok - no plugin: exit 3 and why"
  echo "no CUDA device: the plugin is not built (make CUDA=1), the device half skipped"
  exit 77
fi

# a file that is not a plugin
printf 'not an ELF file' >"$tmp/libkvtier-cuda.so"
run KVTIER_CUDA_PLUGIN="$tmp/libkvtier-cuda.so"
if [ $rc -eq 3 ]; then
  # the real plugin next to the daemon is the fallback: either line is fine
  grep -q -- "--backend cuda: " "$tmp/err" || fail "a broken plugin: no --backend line"
else
  [ $rc -eq 124 ] || fail "a broken plugin: exit $rc"
fi

run
if [ $rc -eq 124 ]; then
  echo "a CUDA device is present: kvtierd --backend cuda started; nothing to check here"
  exit 77
fi
[ $rc -eq 3 ] || fail "exit $rc, not 3"
grep -q -- "--backend cuda: no CUDA device (..*)" "$tmp/err" || fail "no '--backend cuda: no CUDA device (why)' line"
[ "$(grep -c . "$tmp/err")" -eq 1 ] || fail "more than the one line"
[ -e "$tmp/s.sock" ] && fail "the socket was left behind"
echo "ok - $(cat "$tmp/err" | sed 's/^.*error: //')"
