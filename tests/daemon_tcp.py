"""kvtierd's optional TCP listener: --listen on 127.0.0.1 with an API key
(Bearer auth, 401 otherwise) through curl, http.client and the openai npm
package; a non-loopback address without a key and a key file others can
read are refused at start; the Unix socket keeps working beside it, also
while idle TCP connections without a key hold every slot TCP may have."""
import http.client
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time

sys.path.insert(0, "tests")
from daemon_harness import KVTIERD, Daemon, check, metric  # noqa: E402


def free_port():
    """A port below the kernel's ephemeral range: no outgoing connection of another
    test can take it between this probe and the daemon's bind."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    while True:
        port = random.randint(1024, max(low - 1, 2048))
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", port))
            return port
        except OSError:
            pass
        finally:
            s.close()


def tcp(method, path, key=None, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = "Bearer " + key
    c.request(method, path, json.dumps(body) if body is not None else None, headers)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, r.getheader("WWW-Authenticate"), json.loads(data) if data else None


KEY = "k3y-" + os.urandom(12).hex()
port = free_port()
d = Daemon()
keyfile = os.path.join(d.tmp, "key")
with open(keyfile, "w") as f:
    f.write(KEY + "\n")
os.chmod(keyfile, 0o644)
r = subprocess.run([KVTIERD, "--model", d.model, "--socket", d.sock, "--listen", "127.0.0.1:%d" % port,
                    "--api-key-file", keyfile], capture_output=True, text=True, timeout=30)
check(r.returncode == 2 and "readable by others" in r.stderr, "a key file others can read is refused")
r = subprocess.run([KVTIERD, "--model", d.model, "--socket", d.sock, "--listen", "0.0.0.0:%d" % port],
                   capture_output=True, text=True, timeout=30)
check(r.returncode == 2 and "api-key" in r.stderr and not os.path.exists(d.sock),
      "a non-loopback address without a key is refused, its socket removed: " + r.stderr.strip()[-200:])
os.chmod(keyfile, 0o600)
d.args = ["--listen", "127.0.0.1:%d" % port, "--api-key-file", keyfile, "--max-clients", "16"]
d.start()

code, auth, e = tcp("GET", "/v1/models")
check(code == 401 and auth == "Bearer" and e["error"]["code"] == "invalid_api_key", "no key -> 401 Bearer")
code, _, e = tcp("POST", "/v1/completions", KEY[:-1] + "x", {"prompt": "hi", "max_tokens": 2})
check(code == 401, "a wrong key of the same length -> 401")
code, _, e = tcp("GET", "/health", KEY + "x")
check(code == 401, "a longer key -> 401")
code, _, m = tcp("GET", "/v1/models", KEY)
check(code == 200 and m["data"][0]["object"] == "model", "the key -> 200")
code, _, c = tcp("POST", "/v1/completions", KEY, {"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                                    "ignore_eos": True})
check(code == 200 and c["usage"]["completion_tokens"] == 3, "a completion over TCP")
code, s = d.get("/v1/models")
check(code == 200, "the Unix socket still needs no key")
if shutil.which("curl"):
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", "-H", "Authorization: Bearer " + KEY,
                          "http://127.0.0.1:%d/v1/models" % port], capture_output=True, text=True, timeout=30)
    check(out.stdout.rstrip().endswith("200"), "curl with the key")
    out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "http://127.0.0.1:%d/health" % port],
                         capture_output=True, text=True, timeout=30)
    check(out.stdout == "401", "curl without the key -> 401")
if shutil.which("node") and os.path.isdir("tests/openai/node_modules/openai"):
    r = subprocess.run(["node", "tests/openai/tcp.mjs", "http://127.0.0.1:%d/v1" % port, KEY], capture_output=True,
                       text=True, timeout=120)
    print(r.stdout, end="")
    check(r.returncode == 0, "openai-node over TCP\n" + r.stderr[-1500:])
else:
    print("note: tests/openai/node_modules missing; the openai package over TCP not run")

# TCP connections hold a slot from the accept, before any key: together they
# have one uid's share (--max-clients 16: 14) of their own, not the daemon
# user's, so 20 idle ones without a key leave that user's socket working.
def answer(s):
    s.setblocking(False)
    try:
        return s.recv(4096)
    except BlockingIOError:
        return b""


idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(20)]
code, m = d.get("/v1/models")  # accepted after all of them
check(code == 200, "the socket's uid gets 200 while TCP holds its share: %s %s" % (code, m))
answers = [answer(s) for s in idle]
held = [s for s, a in zip(idle, answers) if not a]
refused = [a for a in answers if a]
check(len(held) == 14 and all(a.startswith(b"HTTP/1.1 503") and b"too many TCP connections" in a for a in refused),
      "20 idle TCP connections: 14 held, 6 refused with 503 (%d held; %r)" % (len(held), refused[:1]))
code, c = d.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})
check(code == 200, "a completion over the socket meanwhile: %s" % code)
code, _, e = tcp("GET", "/v1/models", KEY)
check(code == 503 and "too many TCP connections" in e["error"]["message"], "past TCP's share even the key gets 503")
# one line a second: the first refusal of the burst, then the count of the
# rest once the burst is over (the once-a-second sweep), every one counted
deadline = time.time() + 5
while time.time() < deadline:
    log = d.logtext()
    lines = log.count("refused a TCP connection: ")
    quiet = sum(int(n) for n in re.findall(r"refused (\d+) more TCP connections since the last such line", log))
    quiet += sum(int(n) for n in re.findall(r"; (\d+) more refused since the last such line", log))
    if lines + quiet >= 7:
        break
    time.sleep(0.2)
check(lines >= 1 and lines + quiet == 7,
      "the 7 refusals are logged, %d of them on lines of their own, the rest counted within seconds (%d)" %
      (lines, quiet))
socks = [socket.socket(socket.AF_UNIX) for _ in range(2)]
for s in socks:
    s.connect(d.sock)  # 14 + 2: --max-clients is full
code, _ = d.get("/health")
check(code == 200, "/health from the reserve: %s" % code)
code, _ = d.get("/v1/models")
check(code == 503, "other routes in the reserve: 503, got %s" % code)
for s in socks + idle:
    s.close()
# the 8 reserved slots are the local monitor's: with 3 local connections
# and TCP's share (14) not used up, TCP still stops at --max-clients (16)
deadline = time.time() + 10
while metric(d, "connections") > 1 and time.time() < deadline:  # this scrape's own
    time.sleep(0.05)
local = [socket.socket(socket.AF_UNIX) for _ in range(3)]
for s in local:
    s.connect(d.sock)
idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(14)]
deadline = time.time() + 10
answers = [b""] * len(idle)
while not any(answers) and time.time() < deadline:  # the refusal's answer, once accepted
    time.sleep(0.1)
    answers = [answer(s) for s in idle]
refused = [a for a in answers if a]
check(refused and all(b"too many clients connected" in a for a in refused),
      "TCP connections beside 3 local ones stop at --max-clients: %d of 14 refused, none given a reserved slot (%r)"
      % (len(refused), refused[:1]))
code, _ = d.get("/health")
check(code == 200, "/health over the socket still has the reserve: %s" % code)
for s in local + idle:
    s.close()
check(d.stop() == 0, "stop")
