# npm.sh - sourced by the oracle tests that run a JavaScript reference:
# npm_ready NAME DIR PACKAGE... installs DIR's pinned packages
# (DIR/package-lock.json) unless every PACKAGE is already in
# DIR/node_modules, and exits the test with 77 (skipped) when node or npm
# is missing or the registry cannot be reached; any other npm failure
# fails the test.
npm_ready() {
  name=$1 dir=$2
  shift 2
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "$name: node/npm not installed, skipping"
    exit 77
  fi
  missing=
  for p in "$@"; do
    [ -d "$dir/node_modules/$p" ] || missing=1
  done
  [ -z "$missing" ] && return 0
  log=$(mktemp) || exit 1
  if ! (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error) >"$log" 2>&1; then
    if ! (cd "$dir" && npm ping --loglevel=error) >/dev/null 2>&1; then
      echo "$name: the npm registry is unreachable, skipping"
      rm -f "$log"
      exit 77
    fi
    cat "$log"
    rm -f "$log"
    exit 1
  fi
  rm -f "$log"
}
