#!/bin/sh
# run.sh BUILD - what `make run` does: start kvtierd in the foreground on the
# built-in model (or MODEL=dir) and print how to talk to it.  Ctrl-C stops it
# (SIGINT drains in-flight requests first).
build=${1:-build}
model=${MODEL:-model/builtin}
if [ ! -f "$model/config.json" ]; then
  echo "run.sh: no model in $model (config.json missing); give one with MODEL=dir" >&2
  exit 1
fi
if [ -n "$KVTIER_SOCKET" ]; then
  sock=$KVTIER_SOCKET
elif [ -n "$XDG_RUNTIME_DIR" ]; then
  sock=$XDG_RUNTIME_DIR/kvtier/kvtierd.sock
else
  sock=${TMPDIR:-/tmp}/kvtier-$(id -u)/kvtierd.sock
fi
cat <<EOT
kvtierd: serving $model on $sock (Ctrl-C to stop)
  $build/kvtier --socket $sock status
  $build/kvtier --socket $sock generate "In the beginning"
  $build/kvtier --socket $sock chat
  curl -s --unix-socket $sock http://localhost/v1/completions -d '{"prompt":"In the beginning","max_tokens":32}'
EOT
exec "$build/kvtierd" --model "$model" --socket "$sock"
