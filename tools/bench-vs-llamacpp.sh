#!/bin/sh
# bench-vs-llamacpp.sh - kvtier and llama.cpp on the very same GGUF files,
# in alternating rounds, on this machine; prints medians and ratios.
#
#   sh tools/bench-vs-llamacpp.sh [-r ROUNDS] [-t THREADS] [-p PROMPT] [-n DECODE] \
#       LLAMA_BUILD_DIR MODEL.gguf [MODEL.gguf ...]
#
# LLAMA_BUILD_DIR is a llama.cpp cmake build directory with bin/llama-bench
# (docs/benchmarks.md, "kvtier against llama.cpp on the same GGUF files",
# says how one was made); kvtier's tools come from $KVTIER_BUILD (default
# build/).  Defaults: 3 rounds, 2 threads, a 256-token prompt, 64 decode
# tokens.  Every round runs, file by file, one program after the other:
#
#   kvtier-bench -m F --prompt P --decode N --threads T --repeat 1
#       prefill of P tokens; decode of N tokens after them (context P..P+N);
#       and the read ceiling of that moment (util/readbw)
#   llama-bench -m F -t T -p P -n N -r 1                 pp P and tg N at depth 0
#   llama-bench -m F -t T -p 0 -n N -d P -r 1            tg N after P tokens
#
# so a disturbance of a shared machine lands in one round of both programs
# rather than in every round of one.  Ratios kvtier / llama.cpp are the
# medians of the per-round ratios; decode is compared at the same depth P.
# "weights GB/s" is the bytes a decode step streams (every tensor but the
# token embedding, as stored in the file) times decode tokens/s; it is set
# against the best read ceiling of the run, which no decode may exceed.
# A timed comparison: never run by make test.
set -eu

usage() {
    echo "usage: bench-vs-llamacpp.sh [-r ROUNDS] [-t THREADS] [-p PROMPT] [-n DECODE] LLAMA_BUILD_DIR MODEL.gguf..." >&2
    exit 2
}

rounds=3 threads=2 prompt=256 decode=64
while getopts r:t:p:n: o; do
    case $o in
    r) rounds=$OPTARG ;;
    t) threads=$OPTARG ;;
    p) prompt=$OPTARG ;;
    n) decode=$OPTARG ;;
    *) usage ;;
    esac
done
shift $((OPTIND - 1))
[ $# -ge 2 ] || usage
for v in "$rounds" "$threads" "$prompt" "$decode"; do
    case $v in '' | *[!0-9]*) usage ;; esac
    if [ "$v" -lt 1 ] || [ "$v" -gt 100000 ]; then usage; fi
done

here=$(cd "$(dirname "$0")" && pwd)
kvbench=${KVTIER_BUILD:-$here/../build}/kvtier-bench
llbench=$1/bin/llama-bench
shift
[ -x "$kvbench" ] || { echo "bench-vs-llamacpp: no $kvbench; run make first" >&2; exit 1; }
[ -x "$llbench" ] || { echo "bench-vs-llamacpp: no $llbench" >&2; exit 1; }
for f in "$@"; do
    [ -f "$f" ] || { echo "bench-vs-llamacpp: no file $f" >&2; exit 1; }
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rows=$tmp/rows # round, file, program, measure, value

# Each command is printed before it runs; its output is kept in $tmp/out.
run() {
    echo "+ $*" >&2
    "$@" >"$tmp/out" 2>"$tmp/err" || { cat "$tmp/err" >&2; echo "bench-vs-llamacpp: $1 failed" >&2; exit 1; }
}

# "avg_ts" of the llama-bench test with n_prompt $1, n_gen $2 in $tmp/out (JSON lines)
llama_ts() {
    /usr/bin/python3 -c '
import json, sys
for line in open(sys.argv[1]):
    t = json.loads(line)
    if t["n_prompt"] == int(sys.argv[2]) and t["n_gen"] == int(sys.argv[3]):
        print(t["avg_ts"])
        break
else:
    sys.exit("bench-vs-llamacpp: no such test in llama-bench output")' "$tmp/out" "$1" "$2"
}

echo "load average at the start: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
r=1
while [ "$r" -le "$rounds" ]; do
    for f in "$@"; do
        run "$kvbench" -m "$f" --prompt "$prompt" --decode "$decode" --threads "$threads" --repeat 1
        pre=$(sed -n 's/^prefill .*: \([0-9.]*\) tokens\/s (best).*/\1/p' "$tmp/out")
        dec=$(sed -n 's/^decode  .*: \([0-9.]*\) tokens\/s (best).*/\1/p' "$tmp/out")
        wgb=$(sed -n 's/^decode weights *\([0-9.]*\) GB\/s.*/\1/p' "$tmp/out")
        ceil=$(sed -n 's/^read ceiling *\([0-9.]*\) GB\/s.*/\1/p' "$tmp/out")
        if [ -z "$pre" ] || [ -z "$dec" ] || [ -z "$wgb" ] || [ -z "$ceil" ]; then
            cat "$tmp/out" >&2
            echo "bench-vs-llamacpp: unexpected kvtier-bench output" >&2
            exit 1
        fi
        printf '%s\t%s\tkvtier\tprefill\t%s\n%s\t%s\tkvtier\tdecode\t%s\n%s\t%s\tkvtier\twgbs\t%s\n%s\t%s\tkvtier\tceiling\t%s\n' \
            "$r" "$f" "$pre" "$r" "$f" "$dec" "$r" "$f" "$wgb" "$r" "$f" "$ceil" >>"$rows"
        run "$llbench" -m "$f" -t "$threads" -p "$prompt" -n "$decode" -r 1 -o jsonl
        lpre=$(llama_ts "$prompt" 0)
        ldec0=$(llama_ts 0 "$decode")
        run "$llbench" -m "$f" -t "$threads" -p 0 -n "$decode" -d "$prompt" -r 1 -o jsonl
        ldec=$(llama_ts 0 "$decode")
        printf '%s\t%s\tllama.cpp\tprefill\t%s\n%s\t%s\tllama.cpp\tdecode0\t%s\n%s\t%s\tllama.cpp\tdecode\t%s\n' \
            "$r" "$f" "$lpre" "$r" "$f" "$ldec0" "$r" "$f" "$ldec" >>"$rows"
        echo "round $r, $f: kvtier prefill $pre, decode $dec, read ceiling $ceil GB/s;" \
            "llama.cpp prefill $lpre, decode $ldec (at depth 0: $ldec0)" >&2
    done
    r=$((r + 1))
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)" >&2

/usr/bin/python3 - "$rows" "$rounds" "$threads" "$prompt" "$decode" "$here" <<'EOF'
import collections, os, statistics, sys
rows, rounds, threads, prompt, decode, here = sys.argv[1:]
sys.path.insert(0, here)
from bench_llamacpp import gguf_stream_bytes  # noqa: E402

v = collections.defaultdict(dict)  # (file, program, measure) -> {round: value}
for line in open(rows):
    r, f, prog, what, val = line.rstrip("\n").split("\t")
    v[f, prog, what][int(r)] = float(val)
files = list(dict.fromkeys(k[0] for k in v))
med = lambda d: statistics.median(d.values())
ceil = max(max(v[f, "kvtier", "ceiling"].values()) for f in files)
print(f"kvtier vs llama.cpp: {rounds} alternating rounds, {threads} threads, prefill {prompt} tokens, "
      f"decode {decode} tokens after {prompt} (llama.cpp also at depth 0); medians over rounds")
print(f"read ceiling (util/readbw, every kvtier-bench run): best {ceil:.2f} GB/s, median "
      f"{statistics.median(x for f in files for x in v[f, 'kvtier', 'ceiling'].values()):.2f}")
print("| file | program | prefill tok/s | decode tok/s @%s | decode tok/s @0 | weights GB/s @%s | of best ceiling |"
      % (prompt, prompt))
print("|---|---|---|---|---|---|---|")
for f in files:
    wb = gguf_stream_bytes(f)
    v[f, "llama.cpp", "wgbs"] = {r: wb * t / 1e9 for r, t in v[f, "llama.cpp", "decode"].items()}
    for prog in ("kvtier", "llama.cpp"):
        d0 = f"{med(v[f, prog, 'decode0']):.2f}" if (f, prog, "decode0") in v else "-"
        w = med(v[f, prog, "wgbs"])
        print(f"| {os.path.basename(f)} | {prog} | {med(v[f, prog, 'prefill']):.2f} | "
              f"{med(v[f, prog, 'decode']):.2f} | {d0} | {w:.2f} | {100 * w / ceil:.0f} % |")
print()
print("| file | prefill kvtier/llama.cpp | decode @%s kvtier/llama.cpp | decode, per round | "
      "llama.cpp's best decode weights GB/s, of best ceiling |" % prompt)
print("|---|---|---|---|---|")
for f in files:
    ratio = {}
    for what in ("prefill", "decode"):
        a, b = v[f, "kvtier", what], v[f, "llama.cpp", what]
        ratio[what] = [a[r] / b[r] for r in sorted(a)]
    best = max(v[f, "llama.cpp", "wgbs"].values())
    print(f"| {os.path.basename(f)} | {statistics.median(ratio['prefill']):.2f}x | "
          f"{statistics.median(ratio['decode']):.2f}x | {', '.join(f'{x:.2f}' for x in ratio['decode'])} | "
          f"{best:.2f} ({100 * best / ceil:.0f} %) |")
EOF
