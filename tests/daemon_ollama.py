"""kvtierd's Ollama-compatible API driven by the ollama npm package over the
Unix socket (tests/ollama/test.mjs)."""
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
