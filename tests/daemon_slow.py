"""Slow clients cannot lock the others out: 400 connections from one
process trickling a request head a byte a second get --max-clients-per-pid
slots (the rest a 503 at once) and a 408 after --header-timeout, while
another process's /health and small completions are answered at once.  A
body that never comes (chunk size 2^64-1) is closed by --body-rate, not the
idle timeout; a daemon full of slow clients still answers /health from its
reserve."""
import socket
import subprocess
import sys
import time

from daemon_harness import Daemon, check

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
time.sleep(1.5)
code, m = d.get("/metrics")
conns = [l for l in m.decode().splitlines() if l.startswith("kvtier_connections ")]
check(60 <= float(conns[0].split()[1]) <= 64 + 2, "one process holds --max-clients-per-pid: " + conns[0])
worst = 0
for _ in range(5):
    (code, _), dt = timed(lambda: d.get("/health"))
    check(code == 200, "/health during 400 slow connections")
    worst = max(worst, dt)
    (code, out), dt = timed(lambda: d.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0}))
    check(code == 200, "a small completion during 400 slow connections")
    worst = max(worst, dt)
    time.sleep(0.5)
check(worst < 2, "answered within 2 s (worst %.2f s)" % worst)
time.sleep(max(0, 6 - (time.time() - t0)))  # past --header-timeout from the first bytes
code, m = d.get("/metrics")
text = m.decode()
timed_out = [l for l in text.splitlines() if l.startswith("kvtier_connections_timed_out_total")]
check(float(timed_out[0].split()[1]) >= 60, "the trickled heads were closed: " + timed_out[0])
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
