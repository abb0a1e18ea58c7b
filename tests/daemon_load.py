"""kvtierd reads its weights before it says ready.  A test hook
(KVTIER_TEST_LOAD_DELAY_MS: a pause per MiB read) makes the built-in
model's load last about a second, so /health is seen answering 503
"loading" with bytes read of the total, rising, then 200.  Before the
first request every page of the weights file is mapped into the daemon
(the kernel's own counter, Rss of the mapping in /proc/PID/smaps), so no
request faults them in; while loading, Rss keeps up with the bytes
/health says were read.  /metrics says the same bytes and the load's
time."""
import os
import re
import socket
import time

from daemon_harness import Daemon, check

MODEL = "model/builtin"
ST = os.path.join(MODEL, "model.safetensors")
size = os.path.getsize(ST)

def mapping_kb(pid, path):
    """Size and Rss (kB) of the mapping of path in pid's smaps."""
    real = os.path.realpath(path)
    size_kb = rss_kb = None
    inside = False
    with open("/proc/%d/smaps" % pid) as f:
        for line in f:
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith(real)
            elif inside and line.startswith("Size:"):
                size_kb = int(line.split()[1])
            elif inside and line.startswith("Rss:"):
                rss_kb = int(line.split()[1])
    return size_kb, rss_kb


d = Daemon(model=MODEL)
notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
notify.bind(os.path.join(d.tmp, "notify.sock"))
notify.settimeout(0)
# about 1.5 s of loading: at least one of the once-a-second STATUS lines
d.start(wait=False, extra_env={"KVTIER_TEST_LOAD_DELAY_MS": "150", "NOTIFY_SOCKET": os.path.join(d.tmp, "notify.sock")})
loading = []
t_end = time.time() + 60
while time.time() < t_end:
    try:
        code, h = d.get("/health")
    except OSError:
        time.sleep(0.02)
        continue
    if code == 200:
        break
    if not (code == 503 and h["status"] == "loading" and h["error"]["code"] == 503):
        check(False, "while loading, /health answers 503 loading: %d %s" % (code, h))
    # the pages the loader says it read are mapped already (the kernel's count)
    h["loading"]["rss"] = (mapping_kb(d.proc.pid, ST)[1] or 0) * 1024
    loading.append(h["loading"])
    time.sleep(0.05)
check(code == 200 and h == {"status": "ok"}, "ready after %d polls of 503 loading: %s" % (len(loading), h))

weights = [l for l in loading if l["phase"] == "weights"]
check(weights and all(l["bytes_total"] == size for l in weights),
      "/health named the weights' total, %d bytes: %s" % (size, weights[:2]))
middle = [l["bytes_done"] for l in weights if 0 < l["bytes_done"] < size]
check(len(middle) >= 2, "progress seen part-way (%d polls between 0 and the total)" % len(middle))
done = [l["bytes_done"] for l in weights]
check(done == sorted(done), "bytes_done never goes back")
check(all(l["seconds"] >= 0 for l in loading), "seconds since the load began")
behind = [(l["bytes_done"], l["rss"]) for l in weights if l["rss"] < l["bytes_done"]]
check(not behind, "what /health counted as read was in memory and mapped (bytes read, Rss): %s" % behind[:3])


size_kb, rss_kb = mapping_kb(d.proc.pid, ST)
check(size_kb is not None and size_kb * 1024 >= size, "the weights file is mapped (%s kB)" % size_kb)
check(rss_kb == size_kb, "before the first request every page of the weights is in memory and mapped: "
      "Rss %s kB of %s kB" % (rss_kb, size_kb))

code, m = d.get("/metrics")
text = m.decode() if isinstance(m, bytes) else str(m)
check('kvtier_model_load_bytes{kind="done"} %d' % size in text and
      'kvtier_model_load_bytes{kind="total"} %d' % size in text, "/metrics: the bytes read at load")
secs = float(re.search(r"^kvtier_model_load_seconds (\S+)$", text, re.M).group(1))
check(secs >= 0.15 * (size >> 20), "/metrics: the load took the hook's pauses at least (%.2f s)" % secs)

msgs = []
while True:
    try:
        msgs.append(notify.recv(4096).decode())
    except BlockingIOError:
        break
loading_msgs = [m for m in msgs if m.startswith("STATUS=Loading model: ")]
check(loading_msgs and "READY=1" in msgs[-1] and all("READY=1" not in m for m in msgs[:-1]),
      "sd_notify: STATUS lines with the load's progress, then READY=1: %s" % msgs)
check(any("MiB read" in m and "EXTEND_TIMEOUT_USEC=60000000" in m for m in loading_msgs),
      "while the read moves on, systemd's start timeout is extended: %s" % loading_msgs)

code, r = d.post("/v1/completions", {"prompt": "In the beginning", "max_tokens": 4, "temperature": 0})
check(code == 200 and r["usage"]["completion_tokens"] == 4, "the first request: %s" % str(r)[:200])
check(mapping_kb(d.proc.pid, ST)[1] == size_kb, "the weights stayed mapped")
check(d.stop() == 0, "SIGTERM: exit 0")
log = d.logtext()
check(log.index("warm-up: a forward pass of one token") < log.index("model builtin loaded"),
      "the warm-up pass ran before the daemon said ready")
