#!/usr/bin/python3
"""bench_llamacpp - kvtier and llama.cpp on the very same GGUF files, in
alternating rounds on this machine; medians and ratios.

    /usr/bin/python3 tools/bench_llamacpp.py --llama PATH [-r ROUNDS] [-t THREADS] [-p PROMPT] [-n DECODE]
        [--depth D[,D...] [--kv-bits 8|4]] [--model DIR [--quant TYPE[,TYPE...]]] [--work DIR] [--build DIR]
        [FILE.gguf ...]

--llama is a llama.cpp build directory (with bin/llama-bench), a source
tree, or a bare git mirror of one (--llama-branch, default upstream_master,
is exported into WORK/llama.cpp without the vocabulary GGUFs a mirror may
lack).  A tree without build/bin/llama-bench and llama-quantize is built,
on 2 jobs, with
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build -j2 --target llama-bench llama-quantize
The files both programs run are the FILE.gguf arguments, and with --model
DIR (safetensors) also WORK/model-bf16.gguf, converted by tools/st2gguf.py
(llama.cpp's converter's layout), and for each --quant TYPE
WORK/model-TYPE.gguf, made by `llama-quantize WORK/model-bf16.gguf
WORK/model-TYPE.gguf TYPE`; a file already there is reused.

Every round runs, file by file, one program after the other (a
disturbance of the shared machine then lands in one round of both
programs, not in every round of one):

    kvtier-bench -m F --prompt P --decode N --threads T --repeat 1
        prefill of P tokens, decode of N tokens after them (context P..P+N),
        and the read ceiling of that moment (util/readbw)
    llama-bench -m F -t T -p P -n N -r 1 -o jsonl        pp P and tg N at depth 0
    llama-bench -m F -t T -p 0 -n N -d P -r 1 -o jsonl   tg N after P tokens

Decode is compared at the same depth P.  --depth D adds, per round, file
and depth, long-context decode: N tokens after D tokens of context,
    kvtier-bench -m F --fill D-1 --prompt 1 --decode N --threads T --repeat 1
        (D - 1 positions reserved without being computed: a step's work
        does not depend on the KV's values)
    llama-bench -m F -t T -p 0 -n N -d D -r 1 -o jsonl  (llama.cpp computes the D tokens, untimed)
with each side's bytes per decode step: the weights plus D times its KV
bytes per token (kvtier-bench prints its own; llama.cpp's default f16 KV
is 2 * layers * kv_heads * head_dim * 2 bytes), and that traffic per
second against the best read ceiling of the run.  --kv-bits B runs the
depths with a quantized KV on both sides: kvtier-bench --nbits B (quanto,
per-token groups of 64, under 128 recent tokens in full precision) against
llama-bench -ctk/-ctv q8_0 (B 8) or q4_0 (B 4), which needs -fa 1 (blocks
of 32 elements, 34 and 18 bytes each).  Ratios kvtier /
llama.cpp are the medians of the per-round ratios.  "weights GB/s" is the
bytes of every tensor but the token embedding as stored in the file (what
a decode step streams) times decode tokens/s.  Every command is printed
(to stderr, as "+ ...") and listed at the end.  A timed comparison: never
run by make test.
"""
import argparse
import collections
import json
import os
import re
import shlex
import statistics
import struct
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
COMMANDS = []


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run(cmd, cwd=None, capture=True):
    line = " ".join(shlex.quote(c) for c in cmd)
    if (cmd, cwd) not in COMMANDS:
        COMMANDS.append((cmd, cwd))
    log("+ " + (f"(cd {shlex.quote(cwd)} && {line})" if cwd else line))
    r = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE if capture else None, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_llamacpp: {cmd[0]} exited with {r.returncode}")
    return r.stdout


def llama_bins(o):
    """llama-bench and llama-quantize from a build directory, or a source
    tree (exported from a mirror and built if need be)."""
    src = os.path.abspath(o.llama)
    if os.path.exists(os.path.join(src, "bin", "llama-bench")):
        return os.path.join(src, "bin", "llama-bench"), os.path.join(src, "bin", "llama-quantize")
    if not os.path.exists(os.path.join(src, "CMakeLists.txt")):
        if not os.path.exists(os.path.join(src, "HEAD")):
            raise SystemExit(f"bench_llamacpp: {src} is no llama.cpp build directory, tree or bare git repository")
        tree = os.path.join(o.work, "llama.cpp")
        if not os.path.exists(os.path.join(tree, "CMakeLists.txt")):
            os.makedirs(tree, exist_ok=True)
            log(f"+ git --git-dir={src} archive {o.llama_branch} | tar -x -C {tree}")
            COMMANDS.append((["git", f"--git-dir={src}", "archive", o.llama_branch, "|", "tar", "-x", "-C", tree], None))
            # a mirror may lack the large vocabulary test files; nothing here needs them
            arc = subprocess.Popen(["git", f"--git-dir={src}", "archive", o.llama_branch, "--", ".",
                                    ":(exclude)models/*.gguf", ":(exclude)models/*.gguf.*"], stdout=subprocess.PIPE)
            tar = subprocess.run(["tar", "-x", "-C", tree], stdin=arc.stdout)
            arc.wait()
            if tar.returncode != 0 or not os.path.exists(os.path.join(tree, "CMakeLists.txt")):
                raise SystemExit("bench_llamacpp: exporting the llama.cpp tree failed")
        src = tree
    bench = os.path.join(src, "build", "bin", "llama-bench")
    quant = os.path.join(src, "build", "bin", "llama-quantize")
    if not (os.path.exists(bench) and os.path.exists(quant)):
        run(["cmake", "-B", "build", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"],
            cwd=src, capture=False)
        run(["cmake", "--build", "build", "-j2", "--target", "llama-bench", "llama-quantize"], cwd=src, capture=False)
    return bench, quant


def gguf_header(path):
    """A GGUF file's scalar metadata and its tensors as {name: bytes}, the
    sizes from the data offsets, so any ggml type is counted as stored."""
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))

        def rstr():
            (n,) = rd("Q")
            return f.read(n).decode("utf-8", "replace")

        sizes = {4: "I", 5: "i", 6: "f", 7: "B", 0: "B", 1: "b", 2: "H", 3: "h", 10: "Q", 11: "q", 12: "d"}

        def value(t):
            if t == 8:
                return rstr()
            if t == 9:  # arrays are skipped, not kept
                et, n = rd("IQ")
                if et == 8:
                    for _ in range(n):
                        rstr()
                else:
                    f.seek(struct.calcsize("<" + sizes[et]) * n, 1)
                return None
            return rd(sizes[t])[0]

        if f.read(4) != b"GGUF":
            raise SystemExit(f"bench_llamacpp: {path} is not GGUF")
        _, n_t, n_kv = rd("IQQ")
        meta = {}
        for _ in range(n_kv):
            k = rstr()
            (t,) = rd("I")
            meta[k] = value(t)
        align = meta.get("general.alignment", 32)
        infos = []
        for _ in range(n_t):
            name = rstr()
            (nd,) = rd("I")
            rd("Q" * nd)
            _, off = rd("IQ")
            infos.append((off, name))
        data = (f.tell() + align - 1) // align * align
        end = os.path.getsize(path) - data
    infos.sort()
    return meta, {name: (infos[i + 1][0] if i + 1 < len(infos) else end) - off for i, (off, name) in enumerate(infos)}


def gguf_stream_bytes(path):
    """Bytes of the tensors one decode step reads: every matrix but the
    token embedding (of which one row is read); 1-D norms are counted too,
    they are a few KB."""
    return sum(size for name, size in gguf_header(path)[1].items() if name != "token_embd.weight")


# llama.cpp's KV cache type for --kv-bits (0: its default) and its bytes per
# block of 32 elements
LLAMA_KV = {0: ("f16", 64), 8: ("q8_0", 34), 4: ("q4_0", 18)}


def llama_kv_token_bytes(path, bits=0):
    """llama.cpp's KV bytes per token of a file: K and V of every layer in
    the cache type of LLAMA_KV[bits]."""
    meta = gguf_header(path)[0]
    a = meta["general.architecture"]
    heads = meta[f"{a}.attention.head_count"]
    kv_heads = meta.get(f"{a}.attention.head_count_kv", heads)
    head_dim = meta.get(f"{a}.attention.key_length", meta[f"{a}.embedding_length"] // heads)
    elems = 2 * meta[f"{a}.block_count"] * kv_heads * head_dim
    return elems * LLAMA_KV[bits][1] // 32


def field(pattern, out, what):
    m = re.search(pattern, out, re.M)
    if not m:
        raise SystemExit(f"bench_llamacpp: no {what} in kvtier-bench's output:\n{out}")
    return float(m.group(1))


def kvtier_run(o, f, fill, prompt, bits=0):
    """One kvtier-bench round (--repeat 1: its best is its one value)."""
    out = run([o.kvtier_bench, "-m", f] + (["--fill", str(fill)] if fill else []) +
              (["--nbits", str(bits)] if bits else []) +
              ["--prompt", str(prompt), "--decode", str(o.decode), "--threads", str(o.threads), "--repeat", "1"])
    return {"prefill": field(r"^prefill .*?: ([\d.]+) tokens/s", out, "prefill"),
            "decode": field(r"^decode  .*?: ([\d.]+) tokens/s", out, "decode"),
            "wgbs": field(r"^decode weights\s+([\d.]+) GB/s", out, "decode weights"),
            "ceiling": field(r"^read ceiling\s+([\d.]+) GB/s", out, "read ceiling"),
            "kv_tok": field(r"^KV\s+\S+, ([\d.]+) bytes per token", out, "KV bytes per token")}


def llama_ts(out, n_prompt, n_gen):
    for line in out.splitlines():
        if not line.strip():
            continue
        t = json.loads(line)
        if t["n_prompt"] == n_prompt and t["n_gen"] == n_gen:
            return t["avg_ts"]
    raise SystemExit(f"bench_llamacpp: no test pp {n_prompt} tg {n_gen} in llama-bench's output:\n{out}")


def llama_run(o, f, args):
    return run([o.llama_bench, "-m", f, "-t", str(o.threads)] + args + ["-r", "1", "-o", "jsonl"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", metavar="FILE.gguf", help="GGUF files both programs run")
    ap.add_argument("--llama", required=True, help="llama.cpp build directory, source tree or bare git mirror")
    ap.add_argument("--llama-branch", default="upstream_master", help="the branch a mirror is exported from")
    ap.add_argument("--model", help="a safetensors directory, converted to WORK/model-bf16.gguf and run too")
    ap.add_argument("--quant", default="", help="with --model: llama-quantize types of it to run too, e.g. Q8_0")
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--prompt", type=int, default=256)
    ap.add_argument("-n", "--decode", type=int, default=64)
    ap.add_argument("--depth", default="", help="long-context decode after D tokens of context, D[,D...]")
    ap.add_argument("--kv-bits", type=int, default=0, choices=(8, 4),
                    help="the depths with a quantized KV: kvtier int8/int4 against llama.cpp q8_0/q4_0")
    ap.add_argument("--work", default="/tmp/llamabench", help="where converted and quantized files go")
    ap.add_argument("--build", default=os.environ.get("KVTIER_BUILD", os.path.join(os.path.dirname(HERE), "build")))
    o = ap.parse_args()
    try:
        depths = [int(d) for d in o.depth.split(",") if d]
    except ValueError:
        raise SystemExit("bench_llamacpp: --depth takes token counts, D[,D...]")
    if not 1 <= o.rounds <= 100 or not 1 <= o.threads <= 256 or not 1 <= o.prompt <= 1 << 20 or \
            not 1 <= o.decode <= 1 << 20 or any(not 2 <= d <= 1 << 24 for d in depths):
        raise SystemExit("bench_llamacpp: -r 1-100, -t 1-256, -p and -n 1-1048576, --depth 2-16777216")
    if o.kv_bits and not depths:
        raise SystemExit("bench_llamacpp: --kv-bits applies to the --depth runs")
    if o.quant and not o.model:
        raise SystemExit("bench_llamacpp: --quant quantizes --model's conversion")
    o.kvtier_bench = os.path.join(o.build, "kvtier-bench")
    if not os.path.exists(o.kvtier_bench):
        raise SystemExit(f"bench_llamacpp: no {o.kvtier_bench}; run make first")
    for f in o.files:
        if not os.path.isfile(f):
            raise SystemExit(f"bench_llamacpp: no file {f}")
    os.makedirs(o.work, exist_ok=True)
    o.llama_bench, quantize = llama_bins(o)
    files = list(o.files)
    if o.model:
        bf16 = os.path.join(o.work, "model-bf16.gguf")
        if not os.path.exists(bf16):
            run([sys.executable, os.path.join(HERE, "st2gguf.py"), "--model", o.model, "--out", bf16], capture=False)
        files.append(bf16)
        for q in filter(None, o.quant.split(",")):
            qf = os.path.join(o.work, f"model-{q}.gguf")
            if not os.path.exists(qf):
                run([quantize, bf16, qf, q], capture=False)
            files.append(qf)
    if not files:
        raise SystemExit("bench_llamacpp: no GGUF file to run (FILE.gguf arguments or --model)")

    # (file, program, measure) -> {round: value}; measures carry the depth
    v = collections.defaultdict(dict)
    kv_type = LLAMA_KV[o.kv_bits][0]
    kv_args = ["-ctk", kv_type, "-ctv", kv_type, "-fa", "1"] if o.kv_bits else []
    with open("/proc/loadavg") as f:
        log("load average at the start: " + " ".join(f.read().split()[:3]))
    for r in range(1, o.rounds + 1):
        for f in files:
            k = kvtier_run(o, f, 0, o.prompt)
            pre = llama_run(o, f, ["-p", str(o.prompt), "-n", str(o.decode)])
            dec = llama_run(o, f, ["-p", "0", "-n", str(o.decode), "-d", str(o.prompt)])
            got = {("kvtier", "prefill"): k["prefill"], ("kvtier", "decode"): k["decode"],
                   ("kvtier", "wgbs"): k["wgbs"], ("kvtier", "ceiling"): k["ceiling"],
                   ("llama.cpp", "prefill"): llama_ts(pre, o.prompt, 0),
                   ("llama.cpp", "decode0"): llama_ts(pre, 0, o.decode),
                   ("llama.cpp", "decode"): llama_ts(dec, 0, o.decode)}
            for d in depths:
                kd = kvtier_run(o, f, d - 1, 1, o.kv_bits)
                got["kvtier", f"decode@{d}"] = kd["decode"]
                got["kvtier", f"kv_tok@{d}"] = kd["kv_tok"]
                got["kvtier", "ceiling"] = max(got["kvtier", "ceiling"], kd["ceiling"])
                got["llama.cpp", f"decode@{d}"] = llama_ts(llama_run(o, f, ["-p", "0", "-n", str(o.decode), "-d",
                                                                            str(d)] + kv_args), 0, o.decode)
            for (prog, what), x in got.items():
                v[f, prog, what][r] = x
            log(f"round {r}, {f}: " + ", ".join(f"{p} {w} {x:.2f}" for (p, w), x in got.items()))
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    log("load average at the end: " + load)

    def med(key):
        return statistics.median(v[key].values())

    def ratios(f, what):
        a, b = v[f, "kvtier", what], v[f, "llama.cpp", what]
        return [a[r] / b[r] for r in sorted(a)]

    ceil = max(max(v[f, "kvtier", "ceiling"].values()) for f in files)
    print(f"kvtier vs llama.cpp: {o.rounds} alternating rounds, {o.threads} threads, prefill {o.prompt} tokens, "
          f"decode {o.decode} tokens after {o.prompt} (llama.cpp also at depth 0); medians over rounds; "
          f"load average at the end {load}")
    print(f"read ceiling (util/readbw, every kvtier-bench run): best {ceil:.2f} GB/s, median "
          f"{statistics.median(x for f in files for x in v[f, 'kvtier', 'ceiling'].values()):.2f}")
    print(f"| file | program | prefill tok/s | decode tok/s @{o.prompt} | decode tok/s @0 | weights GB/s @{o.prompt} "
          "| of best ceiling |")
    print("|---|---|---|---|---|---|---|")
    wbytes = {f: gguf_stream_bytes(f) for f in files}
    for f in files:
        v[f, "llama.cpp", "wgbs"] = {r: wbytes[f] * t / 1e9 for r, t in v[f, "llama.cpp", "decode"].items()}
        for prog in ("kvtier", "llama.cpp"):
            d0 = f"{med((f, prog, 'decode0')):.2f}" if (f, prog, "decode0") in v else "-"
            w = med((f, prog, "wgbs"))
            print(f"| {os.path.basename(f)} | {prog} | {med((f, prog, 'prefill')):.2f} | "
                  f"{med((f, prog, 'decode')):.2f} | {d0} | {w:.2f} | {100 * w / ceil:.0f} % |")
    print()
    print(f"| file | prefill kvtier/llama.cpp | decode @{o.prompt} kvtier/llama.cpp | decode, per round | "
          "llama.cpp's best decode weights GB/s, of best ceiling |")
    print("|---|---|---|---|---|")
    for f in files:
        best = max(v[f, "llama.cpp", "wgbs"].values())
        dec = ratios(f, "decode")
        print(f"| {os.path.basename(f)} | {statistics.median(ratios(f, 'prefill')):.2f}x | "
              f"{statistics.median(dec):.2f}x | {', '.join(f'{x:.2f}' for x in dec)} | "
              f"{best:.2f} ({100 * best / ceil:.0f} %) |")
    if depths:
        print()
        print(f"long-context decode, {o.decode} tokens after D tokens of context; bytes a step reads: the weights "
              f"and D tokens of KV (kvtier: {f'int{o.kv_bits}' if o.kv_bits else 'its KV dtype'}; llama.cpp: {kv_type})")
        print("| file | D | program | decode tok/s | KV bytes/token | MB read per step | GB/s | of best ceiling "
              "| kvtier/llama.cpp, per round |")
        print("|---|---|---|---|---|---|---|---|---|")
        for f in files:
            llama_kv = llama_kv_token_bytes(f, o.kv_bits)
            for d in depths:
                rs = ratios(f, f"decode@{d}")
                for prog in ("kvtier", "llama.cpp"):
                    kv = med((f, "kvtier", f"kv_tok@{d}")) if prog == "kvtier" else llama_kv
                    step = wbytes[f] + d * kv
                    tps = med((f, prog, f"decode@{d}"))
                    last = f"{statistics.median(rs):.2f}x ({', '.join(f'{x:.2f}' for x in rs)})" \
                        if prog == "kvtier" else ""
                    print(f"| {os.path.basename(f)} | {d} | {prog} | {tps:.2f} | {kv:.0f} | {step / 1e6:.1f} | "
                          f"{step * tps / 1e9:.2f} | {100 * step * tps / 1e9 / ceil:.0f} % | {last} |")
    print("commands:")
    for cmd, cwd in COMMANDS:
        line = " ".join(shlex.quote(c) if c != "|" else c for c in cmd)
        print("  " + (f"(cd {cwd} && {line})" if cwd else line))


if __name__ == "__main__":
    sys.exit(main())
