"""The kvtier CLI as people use it: --help on every subcommand; waiting
through a 503 while the model loads (a stand-in daemon); idle sessions
expiring after --session-ttl (dropped without a disk tier, spilled with
one); and, in a real terminal (tmux), chat's Ctrl-C cancelling a reply in
the daemon, its history file and its exit deleting the session, and
`kvtier top` showing the session and the tier totals."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, "tests")
from daemon_harness import BUILD, Daemon, check, skip  # noqa: E402

KVTIER = os.path.join(BUILD, "kvtier")
if not os.access(KVTIER, os.X_OK):
    skip(KVTIER + " not built")
tmp = tempfile.mkdtemp(prefix="kvtier-cli.")


def kv(sock, *args, stdin=None, env=None):
    return subprocess.run([KVTIER, "--socket", sock] + list(args), input=stdin, capture_output=True, text=True,
                          timeout=60, env=env)


def wait_for(what, cond, timeout=15, step=0.05):
    t = time.time() + timeout
    while time.time() < t:
        v = cond()
        if v:
            return v
        time.sleep(step)
    raise AssertionError("timed out waiting for " + what)


# ---- --help --------------------------------------------------------------
for cmd in ["generate", "chat", "sessions", "session", "status", "batch", "top"]:
    r = kv(os.path.join(tmp, "none.sock"), cmd, "--help")
    check(r.returncode == 0 and r.stdout.startswith("usage: kvtier " + cmd) and r.stdout.endswith("\n")
          and r.stderr == "", "%s --help: usage on stdout, exit 0, no daemon needed" % cmd)
r = kv(os.path.join(tmp, "none.sock"), "--help")
check(r.returncode == 0 and "top" in r.stdout and r.stdout.endswith("\n"), "kvtier --help lists top")
# a number out of range is a usage error (exit 2) naming the option, before
# any daemon is asked: NaN and infinities too, which comparisons let through
for args, opt in ((["generate", "-t", "inf", "hi"], "-t"), (["generate", "-t", "nan", "hi"], "-t"),
                  (["generate", "-t", "-1", "hi"], "-t"), (["generate", "--seed", "18446744073709551616", "hi"],
                                                           "--seed"),
                  (["generate", "-n", "0", "hi"], "-n"), (["top", "-d", "nan"], "usage: kvtier top")):
    r = kv(os.path.join(tmp, "none.sock"), *args)
    check(r.returncode == 2 and opt in r.stderr, "kvtier %s: exit 2 naming %s" % (" ".join(args), opt))

# ---- a daemon still loading: the CLI waits -------------------------------
# A stand-in answers 503 "loading" (with progress) to the first requests,
# then serves: generate must wait and then print the completion.
fake_sock = os.path.join(tmp, "loading.sock")
lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
lsock.bind(fake_sock)
lsock.listen(8)
seen = []


def reply(conn, status, body, ctype="application/json"):
    conn.sendall(("HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                  % (status, ctype, len(body))).encode() + body.encode())


def fake_daemon():
    while True:
        try:
            conn, _ = lsock.accept()
        except OSError:
            return
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        n = int([h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")][0]
                if b"ontent-length" in head else 0)
        while len(body) < n:
            body += conn.recv(65536)
        path = head.split(b" ")[1].decode()
        seen.append(path)
        loading = len(seen) <= 3
        if loading:
            reply(conn, "503 Service Unavailable", json.dumps(
                {"status": "loading", "loading": {"phase": "weights", "bytes_done": 10 * len(seen), "bytes_total": 100},
                 "error": {"code": 503, "message": "the model is loading"}}))
        elif path == "/health":
            reply(conn, "200 OK", '{"status":"ok"}')
        else:
            reply(conn, "200 OK", 'data: {"choices":[{"text":"loaded"}]}\n\ndata: [DONE]\n\n', "text/event-stream")
        conn.close()


th = threading.Thread(target=fake_daemon, daemon=True)
th.start()
r = kv(fake_sock, "generate", "hi")
check(r.returncode == 0 and r.stdout == "loaded\n", "generate waits through 503 loading, then prints the reply")
check("waiting for kvtierd to load its model" in r.stderr and seen[0] == "/v1/completions"
      and "/health" in seen[1:3], "generate: says it waits, polls /health")
lsock.close()

# ---- --session-ttl ------------------------------------------------------
# one small model, slow enough to decode that a reply can be interrupted
model = os.path.join(tmp, "model")
mk = subprocess.run(["/usr/bin/python3", "tools/mkmodel.py", "--arch", "llama", "--preset", "tiny", "--layers", "2",
                     "--dim", "256", "--heads", "4", "--kv-heads", "2", "--ffn", "512", "--vocab", "2048",
                     "--tokenizer-from", "model/builtin", "--out", model], capture_output=True, text=True)
if mk.returncode != 0:
    skip("mkmodel failed: " + mk.stderr[-300:])

d = Daemon("--session-ttl", "3", "--disk-dir", "none", model=model, tmp=os.path.join(tmp, "a"))
os.makedirs(d.tmp)
d.start()
_, s1 = d.post("/v1/sessions", {})
_, s2 = d.post("/v1/sessions", {})
t0 = time.time()  # s1's last use is after this
code, _ = d.post("/v1/completions", {"prompt": "hello", "max_tokens": 2, "session": s1["id"]})
check(code == 200, "ttl: a session in use")
# s2 is kept busy with requests every 0.3 s until s1 expires: idle time,
# not age, expires a session (3 s leave room for a stall of the machine)
codes = []
while d.get("/v1/sessions/" + s1["id"])[0] != 404 and time.time() - t0 < 20:
    codes.append(d.post("/v1/completions", {"prompt": "x", "max_tokens": 1, "session": s2["id"]})[0])
    time.sleep(0.3)
expired = time.time() - t0
check(d.get("/v1/sessions/" + s1["id"])[0] == 404 and expired >= 3.0,
      "ttl: a session idle for --session-ttl is dropped without a disk tier (%.1f s)" % expired)
check(set(codes) == {200} and d.get("/v1/sessions/" + s2["id"])[0] == 200,
      "ttl: a session used every 0.3 s stays (idle time, not age, expires it)")
check("idle for 3 s (--session-ttl), dropped" in d.logtext(), "ttl: the drop is logged")
d.stop()

d = Daemon("--session-ttl", "1", model=model, tmp=os.path.join(tmp, "b"))  # the harness gives it a disk tier
os.makedirs(d.tmp)
d.start()
_, s = d.post("/v1/sessions", {})
code, first = d.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                                         "session": s["id"]})
check(code == 200, "ttl with a disk tier: a session with KV")
got = wait_for("the session to spill",
               lambda: (lambda o: o if o[1]["bytes"]["disk"] > 0 and o[1]["bytes"]["device"] == 0 else None)(
                   d.get("/v1/sessions/" + s["id"])), timeout=10)
check(got[0] == 200 and got[1]["tokens"] > 0, "ttl with a disk tier: the idle session is spilled, not dropped")
code, again = d.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1, "session": s["id"]})
check(code == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0,
      "ttl with a disk tier: its next request reuses the KV read back")
d.stop()

# ---- a real terminal: chat and top under tmux ----------------------------
if not shutil.which("tmux"):
    skip("tmux is not installed (tools/deps.sh test)")
d = Daemon(model=model, tmp=os.path.join(tmp, "c"))
os.makedirs(d.tmp)
d.start()
# the example program of docs/api.md, built against the shared library and
# the header alone
doc = open("docs/api.md").read().split("<!-- example: hello.c -->\n```c\n")[1].split("```")[0]
with open(os.path.join(tmp, "hello.c"), "w") as f:
    f.write(doc)
# a sanitizer build's library needs its runtime loaded first
san = ["-fsanitize=address,undefined"] if "asan" in BUILD else []
cc = subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-Iclient"] + san + [os.path.join(tmp, "hello.c"), "-o",
                     os.path.join(tmp, "hello"), "-L" + BUILD, "-lkvtier-client",
                     "-Wl,-rpath," + os.path.abspath(BUILD)], capture_output=True, text=True)
check(cc.returncode == 0, "docs/api.md's example compiles against <kvtier/client.h> and the .so\n" + cc.stderr)
r = subprocess.run([os.path.join(tmp, "hello"), d.sock], capture_output=True, text=True, timeout=60)
tail = r.stdout.rsplit("\n[", 1)[-1]
check(r.returncode == 0 and r.stdout.endswith("]\n") and int(tail.split()[0]) <= 32 and int(tail.split()[2]) > 0,
      "the example chats in a session (prompt from the session's cache)\n" + r.stdout + r.stderr)
check(d.get("/v1/sessions")[1]["data"] == [], "the example deleted its session")
state = os.path.join(tmp, "state")
# a tmux server of our own (-L): other users' sessions stay out of it
tmx = ["tmux", "-L", "kvtier-test-%d" % os.getpid(), "-f", "/dev/null"]
env = dict(os.environ, XDG_STATE_HOME=state, TERM="xterm-256color")


def tmux(*a):
    return subprocess.run(tmx + list(a), capture_output=True, text=True, env=env, timeout=10)


def pane(target):
    return tmux("capture-pane", "-p", "-t", target).stdout


try:
    tmux("new-session", "-d", "-s", "chat", "-x", "160", "-y", "40",
         "%s --socket %s chat -n 2000 -t 0; echo kvtier-exit=$?; sleep 30" % (KVTIER, d.sock))
    sid = wait_for("chat to open its session",
                   lambda: [w.rstrip(".") for w in pane("chat").split() if w.startswith("sess-")])[0]
    tmux("send-keys", "-t", "chat", "hello there", "Enter")
    wait_for("the reply to start", lambda: [q for q in d.get("/v1/requests")[1]["data"]
                                            if q["state"] == "running" and q["generated_tokens"] > 0], step=0.02)
    tmux("send-keys", "-t", "chat", "C-c")
    wait_for("the generation to stop", lambda: d.get("/v1/requests")[1]["data"] == [])
    # top, in a second terminal, while the session exists
    tmux("new-session", "-d", "-s", "top", "-x", "160", "-y", "40",
         "%s --socket %s top -d 0.3; echo kvtier-exit=$?; sleep 30" % (KVTIER, d.sock))
    code, info = d.get("/v1/sessions/" + sid)
    check(code == 200 and info["tokens"] < 2000 and not info["busy"],
          "chat: Ctrl-C cancels the reply in the daemon (%d tokens held, not 2000 more)" % info["tokens"])
    check("client gone, generation cancelled" in d.logtext(), "chat: the daemon logs the cancelled generation")
    wait_for("the prompt after the cancel", lambda: "(reply cancelled)" in pane("chat"))
    def session_row():  # top's row for the session once it shows the tokens held now
        rows = [ln.split() for ln in pane("top").splitlines() if ln.startswith(sid)]
        return rows[0] if rows and rows[0][1] == str(info["tokens"]) else None

    row = wait_for("top to show the session's tokens", session_row)
    check(row[8] == info["strategy"] and row[10].startswith("idle"), "top: the session's tokens, strategy and state")
    screen = pane("top")
    check(all(t in screen for t in ("TIER", "device", "host", "disk", " of ", "SESSION", "REQUEST")),
          "top: tier totals against budgets, the session and request tables")
    # counters kept by reason are shown summed, not as missing (-1)
    check(re.search(r"spills \d+ .*fallbacks \d+", screen), "top: spills and fallbacks summed over their reasons")
    req_head = [ln.split() for ln in screen.splitlines() if ln.startswith("REQUEST ")]
    check(req_head and req_head[0][6:10] == ["DEVICE", "HOST", "DISK", "OVERLAP"],
          "top: the request table's KV per tier and prefetch overlap columns (%s)" % req_head)
    tmux("send-keys", "-t", "top", "q")
    wait_for("top to quit on q", lambda: "kvtier-exit=" in pane("top"))
    check("kvtier-exit=0" in pane("top"), "top: q quits, exit 0")
    tmux("send-keys", "-t", "chat", "C-c")
    wait_for("the hint", lambda: "Ctrl-C again" in pane("chat"))
    check(d.get("/v1/sessions/" + sid)[0] == 200, "chat: one Ctrl-C at the prompt does not end the chat")
    tmux("send-keys", "-t", "chat", "C-c")
    wait_for("chat to end and delete its session", lambda: d.get("/v1/sessions/" + sid)[0] == 404)
    wait_for("chat to exit", lambda: "kvtier-exit=" in pane("chat"))
    check("kvtier-exit=0" in pane("chat"), "chat: a second Ctrl-C ends the chat (exit 0) and deletes its session")
    with open(os.path.join(state, "kvtier", "history")) as f:
        check("hello" in f.read(), "chat: the line is in $XDG_STATE_HOME/kvtier/history")
finally:
    tmux("kill-server")
check(d.stop() == 0, "stop")
shutil.rmtree(tmp, ignore_errors=True)
