"""kvtierd driven by the official openai npm package (tests/openai/test.mjs)."""
import os
import shutil
import subprocess
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, skip  # noqa: E402

if not shutil.which("node") or not shutil.which("npm"):
    skip("node/npm missing")
if not os.path.isdir("tests/openai/node_modules/openai"):
    r = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd="tests/openai", capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        skip("npm ci failed (offline?): " + r.stderr[-300:])
d = Daemon().start()
r = subprocess.run(["node", "tests/openai/test.mjs", d.sock], capture_output=True, text=True, timeout=300)
print(r.stdout, end="")
check(r.returncode == 0, "openai-node test\n" + r.stderr[-2000:])
check(d.stop() == 0, "stop")
