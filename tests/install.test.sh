#!/bin/sh
# install.test.sh - `make install DESTDIR=... PREFIX=/usr` puts every file in
# place (binaries, the built-in model, systemd units with the prefix filled
# in, man pages, the client library with its header and kvtier.pc, and a
# program built with `pkg-config kvtier` against them talks to the daemon);
# the installed daemon, started from / with nothing but a socket path, finds
# its model beside itself and answers the installed CLI; every installed
# binary says the version; the man pages render without a warning; `make
# uninstall` leaves nothing behind.
build=${KVTIER_BUILD:-build}
[ -x "$build/kvtierd" ] && [ -x "$build/kvtier" ] || { echo "skip: $build not built"; exit 77; }
tmp=$(mktemp -d) || exit 1
pid=
trap '[ -n "$pid" ] && kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT
root=$tmp/root
fail() { echo "FAIL: $*"; [ -f "$tmp/log" ] && tail -20 "$tmp/log"; exit 1; }
ok() { echo "ok - $*"; }

# the sanitizer build is build/asan under SANITIZE=1 (its flags, should anything relink)
# (a program linked with the sanitized library is built with the sanitizers too)
case $build in *asan*) mk="make SANITIZE=1"; san="-fsanitize=address,undefined" ;; *) mk="make BUILD=$build"; san= ;; esac
$mk -s --no-print-directory install DESTDIR="$root" PREFIX=/usr > "$tmp/make.log" 2>&1 ||
  { cat "$tmp/make.log"; fail "make install"; }

for f in bin/kvtierd bin/kvtier bin/kvtier-run bin/kvtier-ppl \
  share/kvtier/builtin/config.json share/kvtier/builtin/tokenizer.json share/kvtier/builtin/tokenizer_config.json \
  share/kvtier/builtin/generation_config.json share/kvtier/builtin/model.safetensors \
  share/man/man1/kvtier.1 share/man/man8/kvtierd.8 \
  lib/systemd/system/kvtierd.service lib/systemd/system/kvtierd.socket \
  lib/systemd/user/kvtierd.service lib/systemd/user/kvtierd.socket lib/sysusers.d/kvtier.conf \
  lib/libkvtier-client.a lib/libkvtier-client.so.1 lib/libkvtier-client.so include/kvtier/client.h \
  lib/pkgconfig/kvtier.pc; do
  [ -f "$root/usr/$f" ] || fail "missing /usr/$f"
done
ok "every file under DESTDIR/usr"
cmp -s model/builtin/model.safetensors "$root/usr/share/kvtier/builtin/model.safetensors" || fail "model copied"
[ -x "$root/usr/bin/kvtierd" ] && [ ! -x "$root/usr/share/man/man8/kvtierd.8" ] || fail "modes"
grep -q '^ExecStart=/usr/bin/kvtierd --system --allow-group kvtier \$KVTIER_OPTS$' "$root/usr/lib/systemd/system/kvtierd.service" ||
  fail "system unit's ExecStart: $(grep ExecStart "$root/usr/lib/systemd/system/kvtierd.service")"
grep -q '^ExecStart=/usr/bin/kvtierd \$KVTIER_OPTS$' "$root/usr/lib/systemd/user/kvtierd.service" || fail "user unit's ExecStart"
! grep -rIq '@[A-Z]*@' "$root/usr/lib" || fail "a placeholder left: $(grep -rIl '@[A-Z]*@' "$root/usr/lib")"
ok "units name /usr/bin/kvtierd"
if command -v systemd-analyze >/dev/null 2>&1; then
  # the units' syntax and directives (the binary they name is under DESTDIR, not /usr)
  for u in "$root"/usr/lib/systemd/system/kvtierd.* "$root"/usr/lib/systemd/user/kvtierd.*; do
    out=$(systemd-analyze verify --man=no "$u" 2>&1 | grep -v 'Command /usr/bin/kvtierd is not executable')
    [ -z "$out" ] || fail "systemd-analyze verify $u: $out"
  done
  ok "systemd-analyze verify: no complaint about the units' directives"
fi

pc=$(PKG_CONFIG_PATH="$root/usr/lib/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$root" pkg-config --cflags --libs kvtier) ||
  fail "pkg-config kvtier"
pc=$(echo $pc)
# (libcurl, a private requirement, may add an include directory of its own)
case " $pc " in *" -I$root/usr/include "*" -L$root/usr/lib -lkvtier-client "*) ;; *) fail "pkg-config --cflags --libs: $pc" ;; esac
[ "$(PKG_CONFIG_PATH="$root/usr/lib/pkgconfig" pkg-config --modversion kvtier)" = "$(cat VERSION)" ] || fail "pc version"
PKG_CONFIG_PATH="$root/usr/lib/pkgconfig" \
  pkg-config --print-requires-private kvtier | sort | tr '\n' ' ' | grep -qx 'jansson libcurl ' ||
  fail "Requires.private: $(PKG_CONFIG_PATH="$root/usr/lib/pkgconfig" pkg-config --print-requires-private kvtier)"
[ "$(readlink "$root/usr/lib/libkvtier-client.so")" = libkvtier-client.so.1 ] || fail "the .so link"
ok "kvtier.pc: $pc"

version=$(cat VERSION)
for b in kvtierd kvtier kvtier-run kvtier-ppl; do
  v=$("$root/usr/bin/$b" --version) || fail "$b --version exits $?"
  case $v in "$b $version"*) ;; *) fail "$b --version: $v" ;; esac
done
ok "--version: $v"

# the installed daemon, from /, with no model option and no XDG_RUNTIME_DIR
sock=$tmp/run/kvtierd.sock
(cd / && exec env -u KVTIER_MODEL -u XDG_RUNTIME_DIR "$root/usr/bin/kvtierd" --socket "$sock" --disk-dir none \
  --threads 1 > "$tmp/log" 2>&1) &
pid=$!
i=0
until "$root/usr/bin/kvtier" --socket "$sock" status > "$tmp/status" 2>/dev/null; do
  i=$((i + 1)); [ $i -lt 300 ] || fail "the installed daemon is not ready"
  kill -0 $pid 2>/dev/null || fail "the installed daemon exited"
  sleep 0.1
done
grep -q "loading $root/usr/share/kvtier/builtin" "$tmp/log" || fail "the model beside the binary: $(head -1 "$tmp/log")"
grep -q "model builtin" "$tmp/status" || fail "status: $(cat "$tmp/status")"
out=$(cd / && "$root/usr/bin/kvtier" --socket "$sock" generate -n 8 -t 0 "In the beginning") || fail "generate"
[ -n "$out" ] || fail "generate printed nothing"
ok "the installed daemon, started from /, serves its built-in model: $(echo "$out" | head -c 60)"
# a program built against the installed header and library, as pkg-config says
cat > "$tmp/prog.c" <<'EOF'
#include <kvtier/client.h>
#include <stdio.h>
int main(int argc, char **argv) {
    kvtier_client *c = NULL;
    struct kvtier_health h = {0};
    enum kvtier_status st = kvtier_open(argc > 1 ? argv[1] : NULL, &c);
    if (st == KVTIER_OK)
        st = kvtier_health(c, &h);
    printf("%s %s\n", kvtier_strerror(st), h.ready ? "ready" : "not ready");
    kvtier_close(c);
    return st != KVTIER_OK;
}
EOF
cc $san -o "$tmp/prog" "$tmp/prog.c" $(PKG_CONFIG_PATH="$root/usr/lib/pkgconfig" PKG_CONFIG_SYSROOT_DIR="$root" \
  pkg-config --cflags --libs kvtier) > "$tmp/cc.log" 2>&1 || { cat "$tmp/cc.log"; fail "a program against the installed library"; }
out=$(LD_LIBRARY_PATH="$root/usr/lib" "$tmp/prog" "$sock") || fail "the program: $out"
ok "a program built with pkg-config kvtier against the installed library: $out"
kill -TERM $pid; wait $pid; rc=$?; pid=
[ $rc -eq 0 ] || fail "SIGTERM: exit $rc"

# the man pages render without a warning
for m in man1/kvtier.1 man8/kvtierd.8; do
  f=$root/usr/share/man/$m
  if command -v man >/dev/null 2>&1; then
    w=$(MANWIDTH=80 man --warnings -l "$f" 2>&1 >/dev/null); lines=$(MANWIDTH=80 man -l "$f" 2>/dev/null | wc -l)
  elif command -v mandoc >/dev/null 2>&1; then
    w=$(mandoc -Tlint -Wwarning "$f" 2>&1); lines=$(mandoc -Tutf8 "$f" | wc -l)
  else
    w=$(groff -man -ww -Tutf8 -rLL=80n "$f" 2>&1 >/dev/null); lines=$(groff -man -Tutf8 "$f" 2>/dev/null | wc -l)
  fi
  [ -z "$w" ] || fail "$m: $w"
  [ "$lines" -gt 60 ] || fail "$m renders to $lines lines"
done
ok "man pages render without warnings"

$mk -s --no-print-directory uninstall DESTDIR="$root" PREFIX=/usr > "$tmp/make.log" 2>&1 || { cat "$tmp/make.log"; fail "make uninstall"; }
left=$(find "$root" -type f)
[ -z "$left" ] || fail "left after uninstall: $left"
ok "make uninstall removes every file"
