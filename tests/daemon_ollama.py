"""kvtierd's Ollama-compatible API driven by the ollama npm package over the
Unix socket (tests/ollama/test.mjs); num_predict 0 is no limit."""
import os
import shutil
import subprocess
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, skip  # noqa: E402

if not shutil.which("node") or not shutil.which("npm"):
    skip("node/npm missing")
if not os.path.isdir("tests/ollama/node_modules/ollama"):
    r = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd="tests/ollama", capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        skip("npm ci failed (offline?): " + r.stderr[-300:])
d = Daemon().start()
r = subprocess.run(["node", "tests/ollama/test.mjs", d.sock], capture_output=True, text=True, timeout=300)
print(r.stdout, end="")
check(r.returncode == 0, "ollama-js test\n" + r.stderr[-2000:])
check(d.stop() == 0, "stop")
# num_predict 0 is no limit, as Ollama's runner counts it: the same reply as -1
small = Daemon("--ctx-size", "48", model=d.model, tmp=d.tmp)
small.sock = os.path.join(d.tmp, "small.sock")
small.start()
body = {"model": "model", "prompt": "In the beginning", "stream": False,
        "options": {"temperature": 0, "repeat_penalty": 1}}
got = {n: small.post("/api/generate", dict(body, options=dict(body["options"], num_predict=n))) for n in (0, -1, 1)}
check(all(code == 200 for code, _ in got.values()) and got[0][1]["response"] == got[-1][1]["response"] and
      got[0][1]["eval_count"] == got[-1][1]["eval_count"] > got[1][1]["eval_count"] == 1,
      "num_predict 0 generates as -1 does (%d tokens), not one" % got[0][1]["eval_count"])
# as Ollama, an empty system text adds no system turn; a non-empty one does
one = dict(body, options=dict(body["options"], num_predict=1))
counts = [small.post("/api/generate", dict(one, **extra))[1]["prompt_eval_count"]
          for extra in ({}, {"system": ""}, {"system": "Be brief."})]
check(counts[0] == counts[1] < counts[2], "system \"\" adds no system turn: prompt_eval_count %s" % counts)
check(small.stop() == 0, "stop")
