#!/usr/bin/python3
"""bench_llamacpp - kvtier against llama.cpp on this machine, same weights,
alternating rounds, ratios.

    /usr/bin/python3 tools/bench_llamacpp.py --model DIR --llama PATH
        [--gguf FILE] [--quant Q8_0[,...]] [--rounds 4] [--threads 2]
        [--prompt 256] [--decode 64] [--work /tmp/llamabench] [--build build]

Every round runs, one after the other, `kvtier-bench --repeat 1` on the
safetensors model (which also measures the read ceiling, util/readbw) and
`llama-bench -r 1` on each GGUF: the same weights in BF16 (and, with
--quant, llama.cpp's own quantizations of them, for reference).  A
disturbance of the shared machine then lands in one round of every engine
instead of in all rounds of one; the medians over the rounds are reported,
and the ratios kvtier / llama.cpp of decode and prefill tokens/s and of the
weight bytes decode streams per second, each also against the ceiling.

--llama is a llama.cpp source tree, or a bare git mirror of one (the branch
--llama-branch, default upstream_master, is exported into WORK/llama.cpp,
without the vocabulary GGUFs a mirror may lack).  When WORK/... or the
tree has no build/bin/llama-bench, it is built, on 2 jobs, with
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build -j2 --target llama-bench llama-quantize
Without --gguf the model is converted by tools/st2gguf.py into
WORK/model-bf16.gguf; --quant Q8_0 runs
    llama-quantize WORK/model-bf16.gguf WORK/model-Q8_0.gguf Q8_0
Every command run is printed (to stderr, as "+ ...") and listed at the end.

Decode: kvtier-bench decodes after the prompt (context prompt..prompt+decode),
llama-bench's tg test from an empty context.  The KV read that adds is
n_layers * 2 * kv_heads * head_dim * 2 bytes per position (22.5 KB for
TinyLlama): under 1 % of the weights at a few hundred positions.
"""
import argparse
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
    if cmd not in [c for c, _ in COMMANDS]:
        COMMANDS.append((cmd, cwd))
    log("+ " + (f"(cd {shlex.quote(cwd)} && {line})" if cwd else line))
    r = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE if capture else None, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_llamacpp: {cmd[0]} exited with {r.returncode}")
    return r.stdout


def llama_tree(o):
    """A llama.cpp source tree with build/bin/llama-bench, exported and built if need be."""
    src = os.path.abspath(o.llama)
    if not os.path.exists(os.path.join(src, "CMakeLists.txt")):
        if not os.path.exists(os.path.join(src, "HEAD")):
            raise SystemExit(f"bench_llamacpp: {src} is neither a llama.cpp tree nor a bare git repository")
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
    return src, bench, quant


def gguf_stream_bytes(path):
    """Bytes of the tensors one decode step reads: every matrix but the
    token embedding (of which one row is read); 1-D norms are counted too,
    they are a few KB.  Sizes come from the data offsets, so any ggml type
    (BF16, Q8_0, ...) is counted as stored."""
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))

        def rstr():
            (n,) = rd("Q")
            return f.read(n).decode("utf-8", "replace")

        sizes = {4: "I", 5: "i", 6: "f", 7: "B", 0: "B", 1: "b", 2: "H", 3: "h", 10: "Q", 11: "q", 12: "d"}

        def skip(t):
            if t == 8:
                rstr()
            elif t == 9:
                et, n = rd("IQ")
                if et == 8:
                    for _ in range(n):
                        rstr()
                else:
                    f.seek(struct.calcsize("<" + sizes[et]) * n, 1)
            else:
                f.read(struct.calcsize("<" + sizes[t]))

        if f.read(4) != b"GGUF":
            raise SystemExit(f"bench_llamacpp: {path} is not GGUF")
        _, n_t, n_kv = rd("IQQ")
        align = 32
        for _ in range(n_kv):
            k = rstr()
            (t,) = rd("I")
            if k == "general.alignment" and t == 4:
                (align,) = rd("I")
            else:
                skip(t)
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
    total = 0
    for i, (off, name) in enumerate(infos):
        size = (infos[i + 1][0] if i + 1 < len(infos) else end) - off
        if name != "token_embd.weight":
            total += size
    return total


def field(pattern, text, what):
    m = re.search(pattern, text, re.M)
    if not m:
        raise SystemExit(f"bench_llamacpp: no {what} in kvtier-bench's output:\n{text}")
    return float(m.group(1))


def kvtier_round(o):
    out = run([o.kvtier_bench, "-m", o.model, "--prompt", str(o.prompt), "--decode", str(o.decode),
               "--threads", str(o.threads), "--repeat", "1"])
    return {"prefill": field(r"^prefill .*?: ([\d.]+) tokens/s", out, "prefill"),
            "decode": field(r"^decode  .*?: ([\d.]+) tokens/s", out, "decode"),
            "wgbs": field(r"^decode weights\s+([\d.]+) GB/s", out, "decode weights"),
            "ceiling": field(r"^read ceiling\s+([\d.]+) GB/s", out, "read ceiling")}


def llama_round(o, bench, gguf, wbytes):
    out = run([bench, "-m", gguf, "-t", str(o.threads), "-p", str(o.prompt), "-n", str(o.decode), "-r", "1",
               "-o", "json"])
    res = {}
    for t in json.loads(out):
        if t["n_prompt"] > 0 and t["n_gen"] == 0:
            res["prefill"] = t["avg_ts"]
        elif t["n_gen"] > 0 and t["n_prompt"] == 0:
            res["decode"] = t["avg_ts"]
    if len(res) != 2:
        raise SystemExit(f"bench_llamacpp: llama-bench gave no pp/tg results:\n{out}")
    res["wgbs"] = wbytes * res["decode"] / 1e9
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the safetensors model directory kvtier runs")
    ap.add_argument("--llama", required=True, help="llama.cpp source tree or bare git mirror")
    ap.add_argument("--llama-branch", default="upstream_master")
    ap.add_argument("--gguf", help="the same weights as GGUF (default: converted into --work)")
    ap.add_argument("--quant", default="", help="llama-quantize types to add, e.g. Q8_0")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--work", default="/tmp/llamabench")
    ap.add_argument("--build", default=os.path.join(os.path.dirname(HERE), "build"))
    o = ap.parse_args()
    if not 1 <= o.rounds <= 100 or not 1 <= o.threads <= 256 or o.prompt < 1 or o.decode < 1:
        raise SystemExit("bench_llamacpp: --rounds 1-100, --threads 1-256, --prompt and --decode >= 1")
    o.kvtier_bench = os.path.join(o.build, "kvtier-bench")
    if not os.path.exists(o.kvtier_bench):
        raise SystemExit(f"bench_llamacpp: no {o.kvtier_bench}; run make first")
    os.makedirs(o.work, exist_ok=True)
    _, bench, quant = llama_tree(o)
    gguf = o.gguf or os.path.join(o.work, "model-bf16.gguf")
    if not os.path.exists(gguf):
        run([sys.executable, os.path.join(HERE, "st2gguf.py"), "--model", o.model, "--out", gguf], capture=False)
    engines = [("llama.cpp BF16", gguf)]
    for q in filter(None, o.quant.split(",")):
        qf = os.path.join(o.work, f"model-{q}.gguf")
        if not os.path.exists(qf):
            run([quant, gguf, qf, q], capture=False)
        engines.append((f"llama.cpp {q}", qf))
    wbytes = {name: gguf_stream_bytes(path) for name, path in engines}

    res = {"kvtier": []}
    res.update({name: [] for name, _ in engines})
    for r in range(o.rounds):
        k = kvtier_round(o)
        res["kvtier"].append(k)
        line = f"round {r}: kvtier prefill {k['prefill']:.2f} decode {k['decode']:.3f} tok/s " \
               f"({k['wgbs']:.2f} GB/s weights, ceiling {k['ceiling']:.2f})"
        for name, path in engines:
            lr = llama_round(o, bench, path, wbytes[name])
            lr["ceiling"] = k["ceiling"]  # the ceiling of the same round
            res[name].append(lr)
            line += f"; {name} prefill {lr['prefill']:.2f} decode {lr['decode']:.3f} ({lr['wgbs']:.2f} GB/s)"
        log(line)

    def med(name, key):
        return statistics.median(x[key] for x in res[name])

    def med_ratio(name, key):
        """the median of the per-round ratios kvtier / name"""
        return statistics.median(a[key] / b[key] for a, b in zip(res["kvtier"], res[name]))

    def med_ceil(name):
        return statistics.median(x["wgbs"] / x["ceiling"] for x in res[name])

    print(f"kvtier against llama.cpp: {o.rounds} alternating rounds, {o.threads} threads, "
          f"prompt {o.prompt}, decode {o.decode}; medians over rounds")
    print(f"read ceiling (util/readbw, in every round): {med('kvtier', 'ceiling'):.2f} GB/s median, "
          f"{min(x['ceiling'] for x in res['kvtier']):.2f}-{max(x['ceiling'] for x in res['kvtier']):.2f}")
    print(f"{'engine':<18} {'prefill tok/s':>13} {'decode tok/s':>12} {'weights GB/s':>12} {'of ceiling':>10}")
    for name in ["kvtier"] + [n for n, _ in engines]:
        print(f"{name:<18} {med(name, 'prefill'):13.2f} {med(name, 'decode'):12.3f} {med(name, 'wgbs'):12.2f} "
              f"{100 * med_ceil(name):9.0f}%")
    for name, _ in engines:
        print(f"kvtier / {name}: prefill {med_ratio(name, 'prefill'):.3f}x, decode {med_ratio(name, 'decode'):.3f}x, "
              f"decode weight bytes/s {med_ratio(name, 'wgbs'):.3f}x (medians of per-round ratios; per round "
              + ", ".join(f"{a['decode'] / b['decode']:.2f}" for a, b in zip(res["kvtier"], res[name])) + " decode)")
    print(f"weight bytes per decode token: kvtier {res['kvtier'][0]['wgbs'] / res['kvtier'][0]['decode'] * 1e3:.1f} MB, "
          + ", ".join(f"{n} {wbytes[n] / 1e6:.1f} MB" for n, _ in engines))
    try:
        with open("/proc/loadavg") as f:
            print("load average at the end (1, 5, 15 min): " + " ".join(f.read().split()[:3]))
    except OSError:
        pass
    print("commands:")
    for cmd, cwd in COMMANDS:
        line = " ".join(shlex.quote(c) if c != "|" else c for c in cmd)
        print("  " + (f"(cd {cwd} && {line})" if cwd else line))


if __name__ == "__main__":
    sys.exit(main())
