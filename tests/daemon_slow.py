"""Slow clients cannot lock the others out: 400 connections from one
process trickling a request head a byte a second get --max-clients-per-pid
slots (the rest a 503 at once) and a 408 after --header-timeout, while
another process's /health and small completions are answered at once.  A
body that never comes (chunk size 2^64-1) is closed by --body-rate, not the
idle timeout; a daemon full of slow clients still answers /health from its
reserve.

Then, as root only (else exit 77 after the rest): kvtierd runs as root with
--allow-group, uid A (nobody) opens 1,000 trickling connections from 18
processes -- one of 150, then 17 of 50 -- and uid B, another uid of the
group, is served /health, /metrics and small completions within bounds
meanwhile.  A holds exactly --max-clients-per-pid in its first process and
--max-clients-per-uid in all; each connection past them gets a 503 and a
close at once, counted by A and by kvtierd's log."""
import grp
import json
import os
import resource
import socket
import subprocess
import sys
import time

from daemon_harness import Daemon, check, read_to_eof

d = Daemon("--header-timeout", "4", "--idle-timeout", "300")
d.start()

SLOW = r'''
import socket, sys, time
path, n, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(path)
    except OSError:
        pass
    socks.append(s)
head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
end = time.time() + secs
i = 0
while time.time() < end:
    for s in socks:
        try:
            s.send(head[i % len(head):i % len(head) + 1])
        except OSError:
            pass
    i += 1
    time.sleep(1)
'''


def slow(daemon, n, secs):
    return subprocess.Popen([sys.executable, "-c", SLOW, daemon.sock, str(n), str(secs)])


def timed(fn):
    t = time.time()
    v = fn()
    return v, time.time() - t


t0 = time.time()
p = slow(d, 400, 10)


def connections_line(name):
    return next(l for l in d.get("/metrics")[1].decode().splitlines() if l.startswith(name + " "))


until = time.time() + 3.5  # the child connects; none of them is past --header-timeout yet
while float(connections_line("kvtier_connections").split()[1]) < 60 and time.time() < until:
    time.sleep(0.1)
conns = connections_line("kvtier_connections")
check(60 <= float(conns.split()[1]) <= 64 + 2, "one process holds --max-clients-per-pid: " + conns)
worst = 0
for _ in range(5):
    (code, _), dt = timed(lambda: d.get("/health"))
    check(code == 200, "/health during 400 slow connections")
    worst = max(worst, dt)
    (code, out), dt = timed(lambda: d.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0}))
    check(code == 200, "a small completion during 400 slow connections")
    worst = max(worst, dt)
    time.sleep(0.5)
check(worst < 5, "answered within 5 s (worst %.2f s)" % worst)
# --header-timeout from the first bytes, checked by a once-a-second sweep;
# the child trickles for 10 s
while float(connections_line("kvtier_connections_timed_out_total").split()[1]) < 60 and time.time() < t0 + 9.5:
    time.sleep(0.1)
timed_out = connections_line("kvtier_connections_timed_out_total")
check(float(timed_out.split()[1]) >= 60, "the trickled heads were closed: " + timed_out)
p.kill()
p.wait()

# a chunked body that never comes: closed after the grace, not the idle timeout
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(15)
s.connect(d.sock)
t = time.time()
s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nab")
buf = b""
while True:
    try:
        chunk = s.recv(4096)
    except socket.timeout:
        break
    if not chunk:
        break
    buf += chunk
s.close()
check(buf.startswith(b"HTTP/1.1 408") and time.time() - t < 9, "a stalled chunked body: 408 after %.1f s" %
      (time.time() - t))
check(d.stop() == 0, "clean stop")

# a full daemon answers /health from its reserve, and nothing else there
d2 = Daemon("--max-clients", "4", "--max-clients-per-pid", "4", "--max-clients-per-uid", "100", "--header-timeout", "30")
d2.start()
p = slow(d2, 4, 8)
for _ in range(50):
    time.sleep(0.1)
    m = d2.get("/metrics")[1].decode()
    if "kvtier_connections 5" in m:  # the four, and this one from the reserve
        break
check("kvtier_connections 5" in m, "four slow connections take --max-clients 4: ")
code, _ = d2.get("/health")
check(code == 200, "/health from the reserve while --max-clients are taken")
code = d2.raw(b'POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 13\r\n\r\n{"content":1}')
check(code == 503, "other routes from the reserve: 503 (%d)" % code)
p.kill()
p.wait()
check(d2.stop() == 0, "clean stop")

# A client over --max-clients-per-pid that sends its request at once reads
# the 503 (the daemon reads and drops the request before it closes), not a
# reset or a broken pipe: whether the request arrives before or after the
# refusal.  Over the slots kept for that, a refusal may still reset.
d4 = Daemon("--max-clients-per-pid", "1", "--header-timeout", "30")
d4.start()


def held(sock_path):
    """This process's one connection, kept alive: retried while the
    daemon still counts a connection of the start-up checks."""
    for _ in range(50):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(sock_path)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head = s.recv(4096)
        if head.startswith(b"HTTP/1.1 200"):
            return s
        s.close()
        time.sleep(0.1)
    raise AssertionError("no connection of this process was accepted")


hold = held(d4.sock)
got = {}
for i in range(40):
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(10)
    c.connect(d4.sock)
    if i % 2:
        time.sleep(0.02)  # the refusal is sent before the request
    try:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n\r\n{\"prompt\":1}")
        k = read_to_eof(c).split(b"\r\n")[0].decode()
    except OSError as e:
        k = "%s (%s)" % (type(e).__name__, e.errno)
    got[k] = got.get(k, 0) + 1
    c.close()
check(got == {"HTTP/1.1 503 Service Unavailable": 40},
      "40 requests over --max-clients-per-pid, sent at once or after the refusal: each reads its 503 (%s)" % got)
hold.close()
for _ in range(50):  # once the daemon has seen the close
    code, _ = d4.get("/health")
    if code == 200:
        break
    time.sleep(0.1)
check(code == 200, "the held connection closed: served again")
check(d4.stop() == 0, "clean stop")


# ---- two uids: A trickles 1,000 connections, B must be served ----
if os.geteuid() != 0:
    print("skip: the two-uid part needs root (kvtierd as root with --allow-group, clients as other uids)")
    sys.exit(77)

# Each process of A connects its n sockets (blocking: a full backlog waits
# for kvtierd's accept), then trickles a head a byte a second; a socket
# that gets a reply or an EOF was refused.  It prints one JSON line of
# counts once its connects are done and the refusals had time to arrive.
TRICKLE = r"""
import json, socket, sys, time
path, n, secs = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.setblocking(False)
    socks.append(s)
head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n"
live, refused, replies, end, i, told = set(range(n)), 0, {}, time.time() + secs, 0, False
t_told = time.time() + 1.5
while time.time() < end:
    for k in list(live):
        try:
            got = socks[k].recv(4096)
        except BlockingIOError:
            got = None
        except OSError:
            got = b""
        if got is None:
            try:
                socks[k].send(head[i % len(head):i % len(head) + 1])
            except BlockingIOError:
                pass
            except OSError:
                pass
            continue
        code = got[9:12].decode() if got.startswith(b"HTTP/1.1 ") else "eof"
        replies[code] = replies.get(code, 0) + 1
        live.discard(k)
        refused += 1
    if not told and time.time() >= t_told:
        print(json.dumps({"held": len(live), "refused": refused, "replies": replies}), flush=True)
        told = True
    i += 1
    time.sleep(1 if told else 0.1)
"""

# B: its requests in turn for secs, each on a new connection; the latencies
B_CLIENT = r"""
import http.client, json, socket, sys, time
path, secs = sys.argv[1], float(sys.argv[2])

class C(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(path)

out = {"health": [], "metrics": [], "completions": [], "bad": []}
body = json.dumps({"prompt": "Hi", "max_tokens": 4, "temperature": 0})
end = time.time() + secs
while time.time() < end:
    for kind, method, url, data in [("health", "GET", "/health", None), ("metrics", "GET", "/metrics", None),
                                    ("completions", "POST", "/v1/completions", body)]:
        t = time.time()
        c = C("localhost", timeout=60)
        try:
            c.request(method, url, body=data, headers={"Content-Type": "application/json"} if data else {})
            r = c.getresponse()
            r.read()
            status = r.status
        except OSError as e:
            status = str(e)
        c.close()
        out[kind].append(time.time() - t)
        if status != 200:
            out["bad"].append("%s %s" % (url, status))
    time.sleep(0.2)
print(json.dumps(out), flush=True)
"""

group = next((g for g in ("nogroup", "nobody", "users") if g in {e.gr_name for e in grp.getgrall()}), None)
if group is None:
    print("skip: no group nogroup, nobody or users to name in --allow-group")
    sys.exit(77)
gid = grp.getgrnam(group).gr_gid
UID_A, UID_B = 65534, 65533  # allowed through their gid: no account needed
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft < 4096:  # kvtierd and A's processes inherit it
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))

# max 256: per uid 224, per pid 64 (the defaults' shares); heads may take 60 s
d3 = Daemon("--allow-group", group, "--header-timeout", "60", "--idle-timeout", "300")
os.chmod(d3.tmp, 0o711)  # the socket's own directory is kvtierd's, 0750 with the group
d3.sock = os.path.join(d3.tmp, "run", "kvtierd.sock")
d3.start()
check(os.stat(d3.sock).st_gid == gid, "kvtierd as root, the socket given to --allow-group " + group)


def as_uid(uid, code, *args):
    return subprocess.Popen([sys.executable, "-c", code] + [str(a) for a in args], user=uid, group=gid,
                            extra_groups=[], cwd="/", stdout=subprocess.PIPE, text=True)


def metric(text, name):
    return float(next(l for l in text.splitlines() if l.startswith(name + " ")).split()[1])


base = metric(d3.get("/metrics")[1].decode(), "kvtier_connections_refused_total")
SECS = 45  # under d3's --header-timeout: A's connections stay open throughout
t0 = time.time()
first = as_uid(UID_A, TRICKLE, d3.sock, 150, SECS)
r1 = json.loads(first.stdout.readline())
check(r1["held"] == 64 and r1["refused"] == 86 and r1["replies"] == {"503": 86},
      "uid A, one process, 150 connections: --max-clients-per-pid 64 held, 86 refused with 503 (%s)" % r1)
rest = [as_uid(UID_A, TRICKLE, d3.sock, 50, SECS - (time.time() - t0)) for _ in range(17)]
rs = [json.loads(p.stdout.readline()) for p in rest]
held = sum(r["held"] for r in rs)
check(held == 224 - 64,
      "17 more processes of uid A, 850 connections: %d held, so 224 (--max-clients-per-uid) in all" % held)
check(sum(r["refused"] for r in rs) == 850 - held and all(set(r["replies"]) <= {"503"} for r in rs),
      "the other %d refused with 503 at once" % (850 - held))
log = d3.logtext()
check(log.count("uid %d pid %d: too many connections from this process" % (UID_A, first.pid)) == 86 and
      log.count("uid %d pid" % UID_A) == 86 + 850 - held and log.count("too many connections from this uid") ==
      850 - held, "kvtierd logged each refusal with its reason (86 for the process, %d for the uid)" % (850 - held))
m = d3.get("/metrics")[1].decode()
check(metric(m, "kvtier_connections_refused_total") - base == 1000 - 224, "kvtier_connections_refused_total +776")
check(metric(m, "kvtier_connections") == 224 + 1, "A's 224 trickling connections are open, and this one: " +
      "kvtier_connections %d" % metric(m, "kvtier_connections"))

b = as_uid(UID_B, B_CLIENT, d3.sock, 8)
lat = json.loads(b.stdout.readline())
b.wait()
check(not lat["bad"], "every request of uid B answered 200 (%s)" % lat["bad"][:3])
for kind, bound in (("health", 10), ("metrics", 10), ("completions", 20)):
    worst = max(lat[kind])
    check(len(lat[kind]) >= 5 and worst < bound, "uid B: %d %s requests, worst %.3f s (bound %d s)" %
          (len(lat[kind]), kind, worst, bound))
m = d3.get("/metrics")[1].decode()
check(metric(m, "kvtier_connections") == 224 + 1 and metric(m, "kvtier_connections_timed_out_total") == 0,
      "A's connections still held after B's requests, none timed out yet")
check(time.time() - t0 < SECS, "all within A's trickle (%.1f s)" % (time.time() - t0))
for p in [first] + rest:
    p.kill()
    p.wait()
check(d3.stop() == 0, "clean stop")
