#!/bin/sh
# gpu-bundle.sh - what tools/gpu-check.sh runs on a GPU machine that can
# build nothing: the machines lent for the check reach no package mirror
# and run another distribution, so kvtier's build dependencies (jansson,
# libmicrohttpd, OpenBLAS, ...) cannot be installed there.  This builds
# with CUDA=1 here and packs the programs the check runs, without their
# debug information, and every shared library they load beyond the C
# library, libstdc++ and CUDA's own into .gpu/bundle.tar.gz (git ignores
# .gpu/; the device tool carries it: `carry: [".gpu"]`).  Each program and
# library finds the bundled libraries through its own DT_RPATH ($ORIGIN),
# not LD_LIBRARY_PATH, so the machine's python3 (and torch) keeps its own.
#
#   sh tools/gpu-bundle.sh      (needs patchelf: apt-get install patchelf)
#
# The bundle records `git describe --dirty` of the tree it was built from;
# gpu-check.sh prints it.
set -eu
cd "$(dirname "$0")/.."
PROGS="kvtierd kvtier kvtier-bench kvtier-bench-tiers kvtier-cuda-limits libkvtier-cuda.so tests/test_cuda
tests/test_tiers tests/test_kvstore"
command -v patchelf >/dev/null || { echo "gpu-bundle: patchelf is missing (apt-get install patchelf)" >&2; exit 1; }
make -j2 CUDA=1 all build/tests/test_cuda build/tests/test_tiers build/tests/test_kvstore
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/build/tests" "$stage/lib"
for p in $PROGS; do
  cp "build/$p" "$stage/build/$p"
  strip --strip-debug "$stage/build/$p"
done
# the libraries ldd resolves, but the C library's, libgcc_s, libstdc++ (a
# newer system has a newer one, which these programs also run with) and
# CUDA's (the GPU machine has its own, matching its driver)
for p in $PROGS; do ldd "$stage/build/$p"; done | awk '$3 ~ /^\// { print $3 }' | sort -u |
  grep -v -E '/(libc|libm|libpthread|libdl|librt|libresolv|libutil|libanl|libgcc_s|libstdc\+\+|ld-linux[^/]*)\.so[^/]*$' |
  grep -v -E '^/usr/local/cuda|/libcublas' | while read -r lib; do cp -L "$lib" "$stage/lib/"; done
for p in $PROGS; do
  case $p in tests/*) up='$ORIGIN/../../lib' ;; *) up='$ORIGIN/../lib' ;; esac
  old=$(patchelf --print-rpath "$stage/build/$p")
  patchelf --force-rpath --set-rpath "$up${old:+:$old}" "$stage/build/$p"
done
for lib in "$stage"/lib/*; do patchelf --force-rpath --set-rpath '$ORIGIN' "$lib"; done
git describe --always --dirty >"$stage/COMMIT"
[ -z "$(git status --porcelain --untracked-files=no)" ] || echo "gpu-bundle: warning: built from a tree with uncommitted changes" >&2
mkdir -p .gpu
tar -C "$stage" -czf .gpu/bundle.tar.gz .
echo "gpu-bundle: .gpu/bundle.tar.gz ($(du -h .gpu/bundle.tar.gz | cut -f1)), commit $(cat "$stage/COMMIT")"
