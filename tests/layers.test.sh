#!/bin/sh
# The source tree is a strictly downward stack of layers: a file includes
# headers of its own folder and of the layers below it, never above, and
# always from the root ("tiers/kvstore.h", never "../").  This is the one
# place the order is written down (docs/architecture.md draws it):
LAYERS="util text backend tiers model ipc client daemon tools tests"
# util and text are leaves: any layer may use them, they use only util.
# Above backend/, only the seam (backend/backend.h) is visible: a backend's
# own files and the plugin table are private to it (tests may look inside).

rank() {
    r=0
    for l in $LAYERS; do
        [ "$l" = "$1" ] && { echo $r; return; }
        r=$((r + 1))
    done
    echo -1
}

# check ROOT: prints every violation under ROOT, fails if there is one.
check() {
    bad=0
    for f in $(cd "$1" && find . -name '*.[ch]' -o -name '*.cu' | sed 's#^\./##' | grep -v '^build/'); do
        own=${f%%/*}
        ro=$(rank "$own")
        [ "$ro" -ge 0 ] || continue
        for inc in $(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$1/$f"); do
            case $inc in
            ../*|*/../*) echo "$f: includes \"$inc\" (write includes from the root)"; bad=1; continue ;;
            */*) ;;
            *) echo "$f: includes \"$inc\" without its folder"; bad=1; continue ;;
            esac
            layer=${inc%%/*}
            [ "$layer" = "$own" ] && continue
            if [ "$layer" = backend ] && [ "$inc" != backend/backend.h ] && [ "$own" != tests ]; then
                echo "$f: includes \"$inc\", private to the backend layer"; bad=1; continue
            fi
            ri=$(rank "$layer")
            if [ "$ri" -lt 0 ]; then
                echo "$f: includes \"$inc\" from no known layer"; bad=1
            elif [ "$ri" -ge "$ro" ]; then
                echo "$f: layer $own includes \"$inc\" from $layer, which is not below it"; bad=1
            fi
        done
    done
    return $bad
}

cd "$(dirname "$0")/.." || exit 1
check . || { echo "layers: FAIL"; exit 1; }

# The check must be able to fail: a tree with tiers/ reaching up into model/
# and text/ reaching into model/ is refused, a downward include is not.
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/tiers" "$tmp/model" "$tmp/text"
printf '#include "backend/backend.h"\n' > "$tmp/tiers/ok.c"
printf '#include "tiers/kvstore.h"\n' > "$tmp/model/ok.c"
check "$tmp" >/dev/null || { echo "layers: a downward include was refused"; exit 1; }
printf '#include "model/model.h"\n' > "$tmp/tiers/up.c"
out=$(check "$tmp") && { echo "layers: tiers -> model was not caught"; exit 1; }
echo "$out" | grep -q 'tiers/up.c: layer tiers includes "model/model.h"' || { echo "layers: wrong report: $out"; exit 1; }
rm "$tmp/tiers/up.c"
printf '#include "backend/cpu/cpu.h"\n' > "$tmp/tiers/private.c"
check "$tmp" >/dev/null && { echo "layers: a backend-private include was not caught"; exit 1; }
rm "$tmp/tiers/private.c"
printf '#include "../model/model.h"\n' > "$tmp/model/rel.c"
check "$tmp" >/dev/null && { echo "layers: a ../ include was not caught"; exit 1; }
echo "layers: ok ($(echo $LAYERS | tr ' ' '<'))"
