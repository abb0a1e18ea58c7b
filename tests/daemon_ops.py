"""kvtierd operations: socket activation through LISTEN_FDS (a
small stand-in for systemd creates the listening socket and execs kvtierd
with it at fd 3), sd_notify READY=1 then STOPPING=1 at SIGTERM, SIGHUP
reopening the log after rotation, and the --max-output limit cancelling a
stream whose reader does not keep up while other clients are served."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, "tests")
from daemon_harness import KVTIERD, Daemon, UnixHTTP, check  # noqa: E402

d = Daemon("--max-output", "2k")
tmp = d.tmp


def notify_msgs(sock, want, timeout=20):
    """Datagrams from the notify socket until one contains want."""
    got = []
    end = time.time() + timeout
    while not any(want in m for m in got) and time.time() < end:
        try:
            got.append(sock.recv(4096).decode())
        except socket.timeout:
            break
    return got


def get(path, sockpath, timeout=10):
    c = UnixHTTP(sockpath, timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


# ---- socket activation + sd_notify ------------------------------------------
act_path = os.path.join(tmp, "activated.sock")
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(act_path)
listener.listen(16)
notify_path = os.path.join(tmp, "notify.sock")
notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
notify.bind(notify_path)
notify.settimeout(20)
fd = listener.fileno()
env = dict(os.environ, NOTIFY_SOCKET=notify_path)
# As systemd does: the socket at fd 3 and LISTEN_PID = the daemon's own pid,
# set by a stand-in that execs kvtierd (so the pid stays).
EXEC_AS_SYSTEMD = ("import os, sys; fd = int(sys.argv[1]); fd != 3 and (os.dup2(fd, 3), os.close(fd)); "
                   "os.set_inheritable(3, True); "
                   "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1', LISTEN_FDNAMES='kvtierd.socket'); "
                   "os.execv(sys.argv[2], sys.argv[2:])")


def activated(fd, *args, **kw):
    return [sys.executable, "-c", EXEC_AS_SYSTEMD, str(fd), KVTIERD] + list(args), dict(kw, pass_fds=(fd,))


log = open(os.path.join(tmp, "activated.log"), "wb")
cmd, kw = activated(fd, "--model", d.model, "--threads", "1", "--socket", os.path.join(tmp, "not-this-one.sock"))
p = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, **kw)
msgs = notify_msgs(notify, "READY=1")
check(any("READY=1" in m for m in msgs),
      "socket activation: READY=1 on NOTIFY_SOCKET\n" + open(os.path.join(tmp, "activated.log")).read())
check(get("/health", act_path)[0] == 200, "socket activation: kvtierd serves on the passed socket")
check(not os.path.exists(os.path.join(tmp, "not-this-one.sock")), "socket activation: --socket is not bound")
listener.close()  # the daemon holds its own copy, as it would systemd's
p.send_signal(signal.SIGTERM)
msgs = notify_msgs(notify, "STOPPING=1")
check(any("STOPPING=1" in m for m in msgs), "SIGTERM: STOPPING=1 on NOTIFY_SOCKET")
check(p.wait(30) == 0, "socket activation: SIGTERM exits 0")
check(os.path.exists(act_path), "socket activation: the socket file is systemd's and stays")
os.unlink(act_path)

r, w = os.pipe()
cmd, kw = activated(r, "--model", d.model)
res = subprocess.run(cmd, capture_output=True, text=True, timeout=30, **kw)
os.close(r)
os.close(w)
check(res.returncode == 4 and "not a Unix stream socket" in res.stderr, "LISTEN_FDS with a pipe at fd 3: exit 4")
# LISTEN_PID naming another process: the variables are not for us, kvtierd binds its own socket
own = Daemon(model=d.model, tmp=tmp).start(extra_env={"LISTEN_PID": "1", "LISTEN_FDS": "1"})
check(os.path.exists(own.sock) and own.get("/health")[0] == 200, "LISTEN_PID of another process is ignored")
own.stop()

# ---- SIGHUP reopens the log (logrotate's move-then-HUP) ------------------------
logpath = os.path.join(tmp, "rotated.log")
h = Daemon("--log", logpath, model=d.model, tmp=tmp).start()
h.get("/v1/models")
os.rename(logpath, logpath + ".1")
h.proc.send_signal(signal.SIGHUP)
end = time.time() + 10
while not os.path.exists(logpath) and time.time() < end:
    time.sleep(0.05)
check(os.path.exists(logpath), "SIGHUP: the log file is created again")
code, _ = h.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "cache": {"implementation": "nope"}})
time.sleep(0.2)
new, old = open(logpath).read(), open(logpath + ".1").read()
check("log reopened" in new and "nope" in new and "nope" not in old and "loaded" in old,
      "SIGHUP: later lines go to the new file, earlier ones stay in the rotated one")
check(h.get("/health")[0] == 200, "SIGHUP does not stop the daemon")
h.stop()

# ---- --max-output: a stream reader that does not read ---------------------------
d.start()
before = d.get("/metrics")[1].decode()
slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
slow.connect(d.sock)
# logprobs with 20 alternatives make every event ~2 KB, so the socket fills within a few hundred tokens
body = json.dumps({"prompt": "Once", "max_tokens": 1900, "temperature": 0, "ignore_eos": True, "stream": True,
                   "logprobs": 20})
slow.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              "Content-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
end = time.time() + 60
while "too slow" not in d.logtext() and time.time() < end:
    time.sleep(0.1)
check("too slow" in d.logtext() and "--max-output" in d.logtext(), "--max-output: the slow reader is logged")
code, r = d.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
check(code == 200 and r["usage"]["completion_tokens"] == 4, "--max-output: other clients are served meanwhile")
slow.settimeout(10)
data = b""
try:
    while True:
        chunk = slow.recv(1 << 16)
        if not chunk:
            break
        data += chunk
except socket.timeout:
    pass
slow.close()
check(data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in data,
      "--max-output: the slow stream ends without [DONE] (%d bytes read)" % len(data))


def metric(text, name):
    return float([x for x in text.splitlines() if x.startswith("kvtier_" + name + " ")][0].split()[1])


after = d.get("/metrics")[1].decode()
made = metric(after, "generation_tokens_total") - metric(before, "generation_tokens_total")
check(metric(after, "requests_running") == 0 and made < 1900 + 4,
      "--max-output: the generation was cancelled (%d tokens made)" % made)

# a chat stream with tools holds its text back until the end (it may turn
# out to be a tool call): that text is the daemon's, not a slow reader's
# backlog.  Two choices of 300 tokens hold about 2.6 KB, over the 2k limit.
tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
c = d.conn()
c.request("POST", "/v1/chat/completions", json.dumps({
    "messages": [{"role": "user", "content": "Tell a story."}], "tools": tools, "n": 2, "max_tokens": 300,
    "temperature": 0, "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
data = c.getresponse().read().decode()
c.close()
held = sum(len(json.loads(x[6:])["choices"][0]["delta"].get("content") or "")
           for x in data.splitlines() if x.startswith("data: {") and json.loads(x[6:])["choices"])
check(data.rstrip().endswith("data: [DONE]") and held > 2048,
      "--max-output: a chat stream with tools whose held-back text passes the limit completes (%d chars)" % held)
check(d.stop() == 0, "stop")
