#!/bin/sh
# run.sh BUILD - what `make run` does: start kvtierd in the foreground on the
# built-in model (or MODEL=dir) and print how to talk to it.  Ctrl-C stops it
# (SIGINT drains in-flight requests first).  The socket is the daemon's own
# default (kvtierd --print-socket), the path the kvtier CLI looks at too.
build=${1:-build}
model=${MODEL:-model/builtin}
if [ ! -f "$model/config.json" ]; then
  echo "run.sh: no model in $model (config.json missing); give one with MODEL=dir" >&2
  exit 1
fi
sock=$("$build/kvtierd" --print-socket) || exit $?
cat <<EOT
kvtierd: serving $model on $sock (Ctrl-C to stop)
  $build/kvtier status
  $build/kvtier generate "In the beginning"
  $build/kvtier chat
  curl -s --unix-socket $sock http://localhost/v1/completions -d '{"prompt":"In the beginning","max_tokens":32}'
EOT
exec "$build/kvtierd" --model "$model" --socket "$sock"
