#!/bin/sh
# beams.test.sh - beam search (model/beam.c through kvtier-run) against
# the oracle tools/beamref.py: Hugging Face's beam search decisions over
# the PyTorch reference model (tests/beam_oracle.py runs the cases).
# Two small random models from tools/mkmodel.py: llama (full attention)
# and mistral with window 8 on every layer, so that forked beams cross
# the window and share, copy and drop sliding blocks.  Each model's eos
# ids are set to [a token the best beam emits early, the tokenizer's
# eos], so that beams end in eos inside the search.  A third model, the
# llama one with the embedding rows of its best first token T copied to
# the id L = T / 2, makes every candidate through L tie exactly with the
# one through T: the tie cases (beam_oracle.py --ties).
set -u
build=${KVTIER_BUILD:-build}
py=/usr/bin/python3
run=$build/kvtier-run
[ -x "$run" ] || { echo "beams.test: $run not built, skipping"; exit 77; }
tmp=$(mktemp -d) || exit 1
trap 'rm -rf "$tmp"' EXIT INT TERM
prompt=3,141,59,26,53,58,97,93,238,46
llama='--arch llama --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn 160 --vocab 320'
cases="
llama   12 $llama
mistral 16 --arch mistral --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn 176 --vocab 384 --window 8
"

# best_ids DIR N: the ids of the best of 2 beams after N tokens, comma-separated
best_ids() {
    "$run" -m "$1" --ids "$prompt" -n "$2" --num-beams 2 --num-return 1 --ignore-eos --quiet |
        sed -n 's/^beam 0 .* ids \([0-9,]*\)$/\1/p'
}

# set_eos DIR ID: the model's eos ids become [ID, the tokenizer's eos]
set_eos() {
    $py - "$1" "$2" <<'PY'
import json, sys
d, e = sys.argv[1], int(sys.argv[2])
for f in ("config.json", "generation_config.json"):
    p = f"{d}/{f}"
    c = json.load(open(p))
    tok_eos = c.get("eos_token_id")
    c["eos_token_id"] = [e] + ([tok_eos] if isinstance(tok_eos, int) and tok_eos != e else [])
    json.dump(c, open(p, "w"))
PY
}

# copy_rows DIR FROM TO: embedding and head row FROM overwrite row TO
copy_rows() {
    $py - "$1" "$2" "$3" <<'PY'
import json, struct, sys
d, src, dst = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(f"{d}/model.safetensors", "r+b") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    head = json.loads(f.read(n))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t = head[name]
        assert t["dtype"] == "F32"
        row = 4 * t["shape"][1]
        base = 8 + n + t["data_offsets"][0]
        f.seek(base + src * row)
        data = f.read(row)
        f.seek(base + dst * row)
        f.write(data)
PY
}

echo "$cases" | while read -r name n args; do
    [ -n "$name" ] || continue
    dir=$tmp/$name
    # shellcheck disable=SC2086 # $args is a list of options
    $py tools/mkmodel.py --out "$dir" --dtype f32 --seed 11 $args > /dev/null || { touch "$tmp/failed"; continue; }
    # the best beam's third token becomes an eos id
    third=$(best_ids "$dir" 3 | cut -d, -f3)
    [ -n "$third" ] || { echo "FAIL $name: no third token"; touch "$tmp/failed"; continue; }
    set_eos "$dir" "$third" || { touch "$tmp/failed"; continue; }
    $py tests/beam_oracle.py "$dir" --run "$run" --ids "$prompt" -n "$n" --name "$name" --min-eos 4 ||
        touch "$tmp/failed"
done

# the tie cases; the best beam's second token becomes an eos id
dir=$tmp/ties
# shellcheck disable=SC2086 # $llama is a list of options
if $py tools/mkmodel.py --out "$dir" --dtype f32 --seed 11 --no-tie $llama > /dev/null &&
   first=$(best_ids "$dir" 2) && t=${first%%,*} && [ -n "$t" ] && l=$((t / 2)) &&
   copy_rows "$dir" "$t" "$l" && set_eos "$dir" "$(best_ids "$dir" 2 | cut -d, -f2)"; then
    $py tests/beam_oracle.py "$dir" --run "$run" --ids "$prompt" -n 8 --name ties --ties "$l,$t" --min-ties 4 --min-eos 2 ||
        touch "$tmp/failed"
else
    echo "FAIL ties: could not build the tie model"
    touch "$tmp/failed"
fi
[ -e "$tmp/failed" ] && { echo "beams.test: FAILED"; exit 1; }
echo "beams.test: every case matches the reference"
