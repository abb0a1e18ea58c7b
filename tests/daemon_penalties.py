"""kvtierd's presence, frequency and repeat penalties and min_tokens against
a Python reimplementation over the PyTorch reference's logits of the
built-in model (tools/torchref.py).

Greedy requests return their token ids; the reference recomputes the
logits of every generated position from the same ids, applies OpenAI's
presence/frequency penalties (over the generated tokens) and llama.cpp's
repeat_penalty (over the last repeat_last_n tokens), and must pick the
daemon's token at each step.  Each penalised run must also differ from
the plain one, so a daemon that ignored the fields would fail."""
import json
import os
import shutil
import sys
from collections import Counter

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, skip  # noqa: E402

try:
    import numpy as np
    import torch
except ImportError:
    skip("numpy/torch missing")
sys.path.insert(0, "tools")
import torchref  # noqa: E402

MODEL = "model/builtin"
if not os.path.exists(os.path.join(MODEL, "model.safetensors")):
    skip("no built-in model")
torch.set_num_threads(1)
ref = torchref.load_model(MODEL, torch.float32)
d = Daemon(model=MODEL).start()
code, t = d.post("/tokenize", {"content": "Once upon a time there was a little girl who"})
check(code == 200, "tokenize")
prompt = t["tokens"]
N = 40
EOS = (2045, 2047)


def penalise(row, hist, n_prompt, c):
    x = row.copy()
    rp = c.get("repeat_penalty", 1.0)
    last = c.get("repeat_last_n", 64)
    if rp != 1.0 and last != 0:
        for i in set(hist if last < 0 else hist[-last:]):
            x[i] = x[i] * rp if x[i] < 0 else x[i] / rp
    for i, n in Counter(hist[n_prompt:]).items():
        x[i] -= n * c.get("frequency_penalty", 0.0) + c.get("presence_penalty", 0.0)
    if len(hist) - n_prompt < c.get("min_tokens", 0):
        x[list(EOS)] = -np.inf
    return x


def run(c, n=N, ignore_eos=True):
    body = dict(prompt=prompt, max_tokens=n, temperature=0, return_tokens=True, ignore_eos=ignore_eos, **c)
    code, r = d.post("/v1/completions", body)
    check(code == 200, "completion %s -> %d %s" % (c, code, "" if code == 200 else r))
    return r["choices"][0]["tokens"], r["choices"][0]["finish_reason"]


def oracle(c, toks):
    full = prompt + toks
    with torch.no_grad():
        rows = ref(torch.tensor([full[:-1]]), prefill=len(prompt))[0][len(prompt) - 1:].double().numpy()
    close = 0
    for s, tok in enumerate(toks):
        x = penalise(rows[s], full[:len(prompt) + s], len(prompt), c)
        top = np.sort(x)[-2:]
        if top[1] - top[0] < 1e-3:  # a near tie: f32 rounding may pick either
            close += 1
            continue
        if int(np.argmax(x)) != tok:
            return "step %d: daemon %d, reference %d" % (s, tok, int(np.argmax(x)))
    return None if close <= 2 else "%d near ties" % close


plain, _ = run({})
check(oracle({}, plain) is None, "plain greedy matches the reference")
cases = [{"frequency_penalty": 1.5}, {"presence_penalty": 1.5}, {"frequency_penalty": 0.8, "presence_penalty": -0.4},
         {"repeat_penalty": 1.5}, {"repeat_penalty": 1.8, "repeat_last_n": 4}, {"repeat_penalty": 1.3,
                                                                                "repeat_last_n": -1}]
for c in cases:
    toks, _ = run(c)
    why = oracle(c, toks)
    check(why is None and toks != plain, "%s: %s" % (c, why or "the reference picks every token, output changed"))

check(d.stop() == 0, "stop")

# min_tokens: the built-in model seldom ends on its own, so a copy of it
# takes the plain run's fourth token as an eos id; min_tokens must hold
# that token (and the real eos ids) back until it is reached
m2 = os.path.join(d.tmp, "eos-model")
os.makedirs(m2)
for f in os.listdir(MODEL):
    if f.endswith(".json"):
        shutil.copy(os.path.join(MODEL, f), m2)
    else:
        os.symlink(os.path.abspath(os.path.join(MODEL, f)), os.path.join(m2, f))
EOS = (plain[3],) + EOS
for f in ("config.json", "generation_config.json"):
    path = os.path.join(m2, f)
    c = json.load(open(path))
    c["eos_token_id"] = list(EOS)
    json.dump(c, open(path, "w"))
d = Daemon(model=m2).start()
early, fin = run({}, n=30, ignore_eos=False)
check(fin == "stop" and len(early) == 4, "the copy ends on its new eos id: %d tokens, %s" % (len(early), fin))
longer, fin = run({"min_tokens": 12}, n=30, ignore_eos=False)
why = oracle({"min_tokens": 12}, longer)
check(len(longer) >= 12 and why is None, "min_tokens 12: %d tokens, the reference agrees (%s)" % (len(longer), why))
check(d.stop() == 0, "stop")
