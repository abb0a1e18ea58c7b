#!/bin/sh
# beams.test.sh - beam search (model/beam.c through kvtier-run) against
# the oracle tools/beamref.py: Hugging Face's beam search decisions over
# the PyTorch reference model (tests/beam_oracle.py runs the cases).
# Two small random models from tools/mkmodel.py: llama (full attention)
# and mistral with window 8 on every layer, so that forked beams cross
# the window and share, copy and drop sliding blocks.  Each model's eos
# ids are set to [a token the best beam emits early, the tokenizer's
# eos], so that beams end in eos inside the search.
set -u
build=${KVTIER_BUILD:-build}
py=/usr/bin/python3
run=$build/kvtier-run
[ -x "$run" ] || { echo "beams.test: $run not built, skipping"; exit 77; }
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT INT TERM
prompt=3,141,59,26,53,58,97,93,238,46
cases='
llama   12 --arch llama --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn 160 --vocab 320
mistral 16 --arch mistral --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn 176 --vocab 384 --window 8
'
echo "$cases" | while read -r name n args; do
    [ -n "$name" ] || continue
    dir=$tmp/$name
    # shellcheck disable=SC2086 # $args is a list of options
    $py tools/mkmodel.py --out "$dir" --dtype f32 --seed 11 $args > /dev/null || { touch "$tmp/failed"; continue; }
    # the best beam's third token becomes an eos id
    third=$("$run" -m "$dir" --ids "$prompt" -n 3 --num-beams 2 --num-return 1 --ignore-eos --quiet |
            sed -n 's/.* ids [0-9]*,[0-9]*,\([0-9]*\)$/\1/p')
    [ -n "$third" ] || { echo "FAIL $name: no third token"; touch "$tmp/failed"; continue; }
    $py - "$dir" "$third" <<'PY' || { touch "$tmp/failed"; continue; }
import json, sys
d, e = sys.argv[1], int(sys.argv[2])
for f in ("config.json", "generation_config.json"):
    p = f"{d}/{f}"
    c = json.load(open(p))
    tok_eos = c.get("eos_token_id")
    c["eos_token_id"] = [e] + ([tok_eos] if isinstance(tok_eos, int) and tok_eos != e else [])
    json.dump(c, open(p, "w"))
PY
    $py tests/beam_oracle.py "$dir" --run "$run" --ids "$prompt" -n "$n" --name "$name" --min-eos 4 ||
        touch "$tmp/failed"
done
[ -e "$tmp/failed" ] && { echo "beams.test: FAILED"; exit 1; }
echo "beams.test: every case matches the reference"
