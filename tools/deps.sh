#!/bin/sh
# deps.sh build|test|plot - installs the Debian packages kvtier needs, but only
# those that are missing, so a configured machine pays one dpkg query.
set -e
build_pkgs="gcc make pkg-config libhwloc-dev libjansson-dev libpcre2-dev libxxhash-dev libmicrohttpd-dev libopenblas-dev libopenblas0-pthread liburing-dev libzstd-dev libcurl4-openssl-dev libedit-dev libncurses-dev libutf8proc-dev libhiredis-dev"
# clang + libclang-rt-dev: libFuzzer for `make fuzz` (the runtime is only a Recommends of clang)
test_pkgs="libcmocka-dev python3 python3-numpy python3-torch curl nodejs npm clang libclang-rt-dev tmux redis-server"
# groff-base: tests/install.test.sh renders the man pages and checks for warnings
test_pkgs="$test_pkgs groff-base"
test_pkgs="$test_pkgs python3-jsonschema" # the schema oracle of the constrained-output test
test_pkgs="$test_pkgs python3-sentencepiece" # trains the Unigram tokenizer test's models and encodes its corpus
# the Prometheus text parser tests/daemon_metrics.py checks /metrics with (promtool, in the 100 MB
# prometheus package, is used when installed but not required)
test_pkgs="$test_pkgs python3-prometheus-client"
# gnuplot renders the figures of docs/benchmarks.md (`make plots`, and tests/plots.test.sh)
plot_pkgs="gnuplot-nox"
case "$1" in
  build) want=$build_pkgs ;;
  test) want="$build_pkgs $test_pkgs $plot_pkgs" ;;
  plot) want=$plot_pkgs ;;
  *) echo "usage: $0 build|test|plot" >&2; exit 2 ;;
esac
missing=""
for p in $want; do
  # node and npm may come from another source than Debian; working commands are enough.
  if [ "$p" = nodejs ] && command -v node >/dev/null 2>&1; then continue; fi
  if [ "$p" = npm ] && command -v npm >/dev/null 2>&1; then continue; fi
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "deps.sh: missing Debian packages:$missing (run as root, or install them)" >&2
  exit 1
fi
echo "deps.sh: installing$missing" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends $missing >&2
