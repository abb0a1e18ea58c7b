"""The kvtier client against a live kvtierd: status, generate, chat in one
session, sessions, batch (input order, resume after interruption) and its
exit codes."""
import json
import os
import subprocess
import sys

sys.path.insert(0, "tests")
from daemon_harness import BUILD, Daemon, check  # noqa: E402

KVTIER = os.path.join(BUILD, "kvtier")
d = Daemon().start()


def kv(*args, stdin=None):
    return subprocess.run([KVTIER, "--socket", d.sock] + list(args), input=stdin, capture_output=True, text=True,
                          timeout=120)


r = kv("status")
check(r.returncode == 0 and "ok" in r.stdout, "status")
r = kv("--json", "status")
check(r.returncode == 0 and json.loads(r.stdout)["health"]["status"] == "ok", "status --json")
r = subprocess.run([KVTIER, "--socket", d.tmp + "/none.sock", "status"], capture_output=True, text=True)
check(r.returncode == 3, "unreachable daemon: exit 3")
check(kv("frobnicate").returncode == 2 and kv("generate").returncode == 2, "usage errors: exit 2")

r = kv("generate", "-n", "8", "-t", "0", "In", "the", "beginning")
code, ref = d.post("/v1/completions", {"prompt": "In the beginning", "max_tokens": 8, "temperature": 0})
text = ref["choices"][0]["text"]
check(r.returncode == 0 and r.stdout == text + ("" if text.endswith("\n") else "\n"),
      "generate streams the greedy text, and the output ends with a newline")
r = kv("--json", "generate", "-n", "3", "-t", "0", "-", stdin="In the beginning")
check(r.returncode == 0 and json.loads(r.stdout)["usage"]["completion_tokens"] <= 3, "generate --json, prompt on stdin")
r = kv("generate", "-n", "3", "--session", "nope", "x")
check(r.returncode == 1 and "404" in r.stderr, "a daemon error: exit 1 with its message")

r = kv("--json", "chat", "--system", "Be brief.", "-n", "4", "-t", "0", stdin="hello\nand more\n/reset\nagain\n")
usage = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
check(r.returncode == 0 and len(usage) == 3, "chat: three turns")
check(usage[1]["prompt_tokens_details"]["cached_tokens"] > usage[0]["prompt_tokens"],
      "chat: the second turn reuses the session's KV")
check(usage[2]["prompt_tokens_details"]["cached_tokens"] < usage[1]["prompt_tokens_details"]["cached_tokens"],
      "chat: /reset starts a new session")
r = kv("--json", "chat", "-n", "4", "-t", "0", stdin="hello\nand more\n/undo\nand more\n/undo\n/undo\n/undo\n")
usage = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
answers = r.stdout.splitlines()
check(r.returncode == 0 and len(usage) == 3 and r.stderr.count("undone:") == 3 and "nothing to undo" in r.stderr,
      "chat: /undo crops the last turn (three times, then nothing to undo)")
check(answers[2] == answers[1] and usage[2]["prompt_tokens_details"]["cached_tokens"] ==
      usage[1]["prompt_tokens_details"]["cached_tokens"], "chat: the turn after /undo is the undone turn again")
r = kv("--json", "sessions")
check(r.returncode == 0 and json.loads(r.stdout) == [], "chat deletes its session at the end")
code, s = d.post("/v1/sessions", {"prefix": "Once upon"})
r = kv("sessions")
check(s["id"] in r.stdout, "sessions lists a session")
check(kv("sessions", "rm", s["id"]).returncode == 0 and kv("--json", "sessions").stdout.strip() == "[]", "sessions rm")

lines = []
for i in range(8):
    url = "/v1/chat/completions" if i % 2 else "/v1/completions"
    body = {"max_tokens": 4 + i, "temperature": 0, "ignore_eos": True}
    body.update({"messages": [{"role": "user", "content": "q%d" % i}]} if i % 2 else {"prompt": "p%d" % i})
    lines.append(json.dumps({"custom_id": "r%d" % i, "method": "POST", "url": url, "body": body}))
inp = os.path.join(d.tmp, "in.jsonl")
out = os.path.join(d.tmp, "out.jsonl")
with open(inp, "w") as f:
    f.write("\n".join(lines) + "\n")
r = kv("batch", inp, "-j", "4")
res = [json.loads(x) for x in r.stdout.splitlines()]
check(r.returncode == 0 and [x["custom_id"] for x in res] == ["r%d" % i for i in range(8)], "batch: input order")
check(all(x["response"]["body"]["usage"]["completion_tokens"] == 4 + i for i, x in enumerate(res)),
      "batch: every line answered")
with open(out, "w") as f:  # an interrupted run: three lines done, the fourth cut
    f.write("\n".join(r.stdout.splitlines()[:3]) + "\n" + r.stdout.splitlines()[3][:20])
code, m0 = d.get("/metrics")
r2 = kv("batch", inp, "-o", out, "-j", "2")
code, m1 = d.get("/metrics")


def requests(m):
    return [float(x.split()[1]) for x in m.decode().splitlines() if x.startswith("kvtier_requests_total ")][0]


with open(out) as f:
    got = [json.loads(x) for x in f]
check(r2.returncode == 0 and "resuming after 3" in r2.stderr, "batch -o: resumes after the finished lines")
check([x["custom_id"] for x in got] == ["r%d" % i for i in range(8)] and requests(m1) - requests(m0) == 5,
      "batch resume: 5 requests sent, 8 results in order")
# -o naming the input would write results over the requests: refused, the
# input as it was; an output file holding request lines resumes after none
before = open(inp).read()
r3 = kv("batch", inp, "-o", inp)
check(r3.returncode == 2 and "is the input file" in r3.stderr and open(inp).read() == before,
      "batch -o IN.jsonl: refused, the input untouched")
copy = os.path.join(d.tmp, "copy.jsonl")
with open(copy, "w") as f:
    f.write(before)
r3 = kv("batch", inp, "-o", copy, "-j", "4")
with open(copy) as f:
    got = [json.loads(x) for x in f]
check(r3.returncode == 0 and "resuming" not in r3.stderr and [x["custom_id"] for x in got] == ["r%d" % i for i in range(8)]
      and all(x["response"]["status_code"] == 200 for x in got),
      "batch -o over a file of request lines: none taken as finished, 8 results")
with open(inp, "a") as f:
    f.write('{"custom_id":"bad","url":"/etc/passwd","body":{}}\n')
r = kv("batch", inp, "-o", out)
check(r.returncode == 1 and json.loads(open(out).read().splitlines()[-1])["error"]["code"] == "invalid_line",
      "batch: a bad line is reported in its place, exit 1")
with open(inp, "a") as f:
    f.write('{"custom_id":"get","method":"GET","url":"/v1/completions","body":{"prompt":"x","max_tokens":1}}\n')
r = kv("batch", inp, "-o", out)
last = json.loads(open(out).read().splitlines()[-1])
check(r.returncode == 1 and last["custom_id"] == "get" and last["error"]["code"] == "invalid_line" and
      "POST" in last["error"]["message"], "batch: a line whose method is not POST is refused in its place")
check(d.stop() == 0, "stop")
