#!/bin/sh
# sockpath.test.sh - the one socket rule (ipc/sockpath.c) that kvtierd, the
# kvtier CLI and `make run` (kvtierd --print-socket) share: flag, env,
# --system, XDG_RUNTIME_DIR, /run/user/UID, root's /run/kvtier, and the
# ownership-checked /tmp/kvtier-UID fallback.  As root it also runs the
# daemon and the CLI as nobody with no socket option and no XDG_RUNTIME_DIR:
# they must meet on the same path.
build=${KVTIER_BUILD:-build}
d=$build/kvtierd; k=$build/kvtier
[ -x "$d" ] && [ -x "$k" ] || { echo "skip: $build not built"; exit 77; }
tmp=$(mktemp -d) || exit 1
pid=; made_run_user=
nuid=$(id -u nobody 2>/dev/null)
fb=/tmp/kvtier-$nuid
cleanup() {
  [ -n "$pid" ] && kill $pid 2>/dev/null && wait $pid
  [ -n "$made_run_user" ] && rm -rf "$made_run_user"
  [ -n "$nuid" ] && [ "$(id -u)" = 0 ] && rm -rf "$fb"
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; [ -f "$tmp/log" ] && tail -5 "$tmp/log"; exit 1; }
ok() { echo "ok - $*"; }
# print-socket with a clean environment: ps [VAR=value...] [-- option...]
ps() {
  envs=""
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs="$envs $1"; shift; done
  [ "$1" = -- ] && shift
  env -u KVTIER_SOCKET -u XDG_RUNTIME_DIR -u KVTIER_SYSTEM $envs "$d" --print-socket "$@" 2>&1
}
expect() { want=$1; shift; got=$(ps "$@"); [ "$got" = "$want" ] || fail "$* gave '$got', not '$want'"; }

expect /a/b.sock KVTIER_SOCKET=/a/b.sock XDG_RUNTIME_DIR=/r
expect /s/x KVTIER_SOCKET=/a/b.sock -- --socket /s/x
expect /r/kvtier/kvtierd.sock XDG_RUNTIME_DIR=/r
expect /run/kvtier/kvtierd.sock XDG_RUNTIME_DIR=/r -- --system
ok "flag, KVTIER_SOCKET, --system, XDG_RUNTIME_DIR"
out=$(ps -- --socket @abstract); rc=$?
[ $rc -eq 4 ] && echo "$out" | grep -q "abstract" || fail "an abstract socket: $rc $out"
out=$(ps -- --socket "/$(printf '%0120d' 0)"); rc=$?
[ $rc -eq 4 ] && echo "$out" | grep -q "at most 107" || fail "a 121-byte path: $rc $out"
ok "abstract and over-long paths are refused (exit 4)"

[ "$(id -u)" = 0 ] && command -v setpriv >/dev/null 2>&1 && [ -n "$nuid" ] || { echo "skip: the rest needs root"; exit 0; }
if [ -d /run/user/0 ] && [ "$(stat -c %u /run/user/0)" = 0 ]; then want=/run/user/0/kvtier/kvtierd.sock
else want=/run/kvtier/kvtierd.sock; fi
expect $want
ok "root without XDG_RUNTIME_DIR: $want"

asnobody() { env -u KVTIER_SOCKET -u XDG_RUNTIME_DIR -u KVTIER_SYSTEM \
  setpriv --reuid=nobody --regid=nogroup --clear-groups "$@"; }
rm -rf "$fb"
got=$(asnobody "$d" --print-socket) && [ "$got" = "$fb/kvtierd.sock" ] || fail "nobody's fallback: $got"
mkdir -m 0755 "$fb"
out=$(asnobody "$d" --print-socket 2>&1); rc=$?
[ $rc -eq 4 ] && echo "$out" | grep -q "not a directory of uid $nuid" || fail "a $fb of root's: $rc $out"
out=$(asnobody "$k" status 2>&1); rc=$?
[ $rc -eq 2 ] && echo "$out" | grep -q "not a directory of uid $nuid" || fail "the CLI with a $fb of root's: $rc $out"
chown nobody "$fb"; chmod 0770 "$fb"
asnobody "$d" --print-socket >/dev/null 2>&1 && fail "a group-writable $fb was taken"
chmod 0700 "$fb"
got=$(asnobody "$d" --print-socket) && [ "$got" = "$fb/kvtierd.sock" ] || fail "nobody's own $fb: $got"
ok "/tmp/kvtier-UID: refused unless it is the user's and no one else can write to it (daemon and CLI)"

if [ -d /run/user ] && [ ! -e /run/user/$nuid ]; then
  made_run_user=/run/user/$nuid
  mkdir -m 0700 $made_run_user && chown nobody $made_run_user
  got=$(asnobody "$d" --print-socket) && [ "$got" = "$made_run_user/kvtier/kvtierd.sock" ] ||
    fail "with $made_run_user: $got"
  rm -rf $made_run_user; made_run_user=
  ok "/run/user/UID when it exists and is the user's"
fi

# the daemon refuses a socket directory of another (non-root) user
mkdir -m 0777 "$tmp/other"; chmod +t "$tmp/other"; chown daemon "$tmp/other"; chmod 0711 "$tmp"
out=$(asnobody "$d" --socket "$tmp/other/s" --disk-dir none 2>&1); rc=$?
[ $rc -eq 4 ] && echo "$out" | grep -q "belongs to uid $(id -u daemon)" || fail "a directory of uid daemon: $rc $out"
ok "the socket's directory must be the daemon user's or root's"

# the daemon and the CLI, as nobody with no socket option, meet on one path
chmod 0755 "$tmp"
here=$(pwd)
case $d in /*) dabs=$d ;; *) dabs=$here/$d ;; esac
(cd / && exec env -u KVTIER_SOCKET -u XDG_RUNTIME_DIR setpriv --reuid=nobody --regid=nogroup --clear-groups \
  "$dabs" --model "$here/model/builtin" --disk-dir none --threads 1 > "$tmp/log" 2>&1) &
pid=$!
i=0
until asnobody "$k" status > "$tmp/status" 2>&1; do
  i=$((i + 1)); [ $i -lt 300 ] || fail "the CLI never reached the daemon: $(cat "$tmp/status")"
  kill -0 $pid 2>/dev/null || fail "the daemon exited"
  sleep 0.1
done
grep -q "kvtierd at $fb/kvtierd.sock: ok" "$tmp/status" || fail "status: $(cat "$tmp/status")"
[ "$(stat -c '%U %a' "$fb/kvtierd.sock")" = "nobody 600" ] || fail "socket owner and mode: $(stat -c '%U %a' "$fb/kvtierd.sock")"
ok "daemon and CLI agree without XDG_RUNTIME_DIR: $fb/kvtierd.sock"
