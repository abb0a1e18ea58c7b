"""Soak: kvtierd on the built-in model under a bounded mix of requests from
a few client threads: completions (streamed and not), chat, sessions
(create, turns, crop, fork, delete), clients that hang up mid-stream, and
bad requests.  After a warm-up, with the daemon idle, its RSS, open fds
and threads are sampled (/proc/PID); at the end, idle again, the fds and
threads must be back to those values and the RSS may have grown by at most
8 MiB or 10 %, whichever is larger: a leak per request shows in minutes.
Every request must get the status its kind expects.  Sampling prompts
from a fixed set at temperature 0 keeps what the prefix cache may hold
bounded, so the warm-up fills it.  KVTIER_SOAK_SECONDS sets the length
(default 120); `make soak` runs it for 15 minutes."""
import json
import os
import random
import socket
import sys
import threading
import time

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check  # noqa: E402

SECONDS = int(os.environ.get("KVTIER_SOAK_SECONDS", "120"))
WARMUP = min(20, SECONDS // 4)
CLIENTS = 4
SAMPLE_EVERY = 3
MIB = 1 << 20

PROMPTS = ["Once upon a time", "The weather today is", "A list of fruits:", "In the beginning",
           "Dear diary,", "The quick brown fox", "Tell me about the sea.", "Numbers: 1, 2, 3,"]

d = Daemon(model="model/builtin").start()
pid = d.proc.pid


IOU_MAX = 16  # the disk tier caps the kernel's io_uring workers at 8 bounded + 8 unbounded


def sample():
    with open("/proc/%d/status" % pid) as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    comms = []
    for t in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/comm" % (pid, t)) as f:
                comms.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    # the kernel's io_uring workers (iou-wrk-*) are its own: one stays once
    # the disk tier has blocked on an op; counted apart, within their cap
    iou = sum(c.startswith("iou-") for c in comms)
    return {"rss": rss, "fds": len(os.listdir("/proc/%d/fd" % pid)), "threads": len(comms) - iou, "iou": iou}


def expect(code, want, what):
    if code not in want:
        raise AssertionError("%s: status %s, expected %s" % (what, code, want))


def completion(r):
    code, body = d.post("/v1/completions", {"prompt": r.choice(PROMPTS), "max_tokens": r.randint(1, 24),
                                            "temperature": 0})
    expect(code, (200,), "completion")


def streamed(r):
    events = d.stream("/v1/completions", {"prompt": r.choice(PROMPTS), "max_tokens": r.randint(1, 24),
                                          "temperature": 0, "stream": True})
    expect(events[-1], ("[DONE]",), "streamed completion")


def chat(r):
    code, _ = d.post("/v1/chat/completions", {"messages": [{"role": "user", "content": r.choice(PROMPTS)}],
                                              "max_tokens": r.randint(1, 16), "temperature": 0})
    expect(code, (200,), "chat")


def session(r):
    code, s = d.post("/v1/sessions", {"system": "You are terse."})
    expect(code, (200,), "session create")
    sid, msgs = s["id"], [{"role": "system", "content": "You are terse."}]
    try:
        for _ in range(r.randint(1, 3)):
            msgs.append({"role": "user", "content": r.choice(PROMPTS)})
            code, c = d.post("/v1/chat/completions", {"session": sid, "messages": msgs, "max_tokens": 8,
                                                      "temperature": 0})
            expect(code, (200,), "session turn")
            msgs.append({"role": "assistant", "content": c["choices"][0]["message"]["content"]})
        expect(d.post("/v1/sessions/%s/crop" % sid, {"n": -2})[0], (200,), "session crop")
        code, f = d.post("/v1/sessions/%s/fork" % sid, {})
        expect(code, (200,), "session fork")
        expect(d.request("DELETE", "/v1/sessions/" + f["id"])[0], (200, 204), "fork delete")
    finally:
        expect(d.request("DELETE", "/v1/sessions/" + sid)[0], (200, 204), "session delete")


def hang_up(r):
    """A streamed request whose client reads the first event and leaves."""
    body = json.dumps({"prompt": r.choice(PROMPTS), "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    try:
        s.connect(d.sock)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        if not s.recv(4096).startswith(b"HTTP/1.1 200"):
            raise AssertionError("hang-up stream: no 200")
    finally:
        s.close()


def bad(r):
    kind = r.randrange(4)
    if kind == 0:
        expect(d.request("POST", "/v1/completions", "{not json", {"Content-Type": "application/json"})[0], (400,),
               "malformed JSON")
    elif kind == 1:
        expect(d.post("/v1/completions", {"prompt": "x", "max_tokens": -5})[0], (400,), "negative max_tokens")
    elif kind == 2:
        expect(d.get("/v1/sessions/sess-0000")[0], (404,), "unknown session")
    else:
        expect(d.get("/no/such/path")[0], (404,), "unknown path")


ACTIONS = [completion, streamed, chat, session, hang_up, bad]
errors, counts = [], {}
lock = threading.Lock()


def client(seed, stop):
    r = random.Random(seed)
    while not stop.is_set() and not errors:
        a = r.choice(ACTIONS)
        try:
            a(r)
        except Exception as e:  # every failure is reported, the run stops at the first
            with lock:
                errors.append("%s: %r" % (a.__name__, e))
        with lock:
            counts[a.__name__] = counts.get(a.__name__, 0) + 1


def load(seconds, seed, peaks=None):
    stop = threading.Event()
    ts = [threading.Thread(target=client, args=(seed + i, stop)) for i in range(CLIENTS)]
    for t in ts:
        t.start()
    end = time.time() + seconds
    while time.time() < end and not errors:
        time.sleep(min(SAMPLE_EVERY, max(0, end - time.time())))
        if peaks is not None:
            s = sample()
            for k in s:
                peaks[k] = max(peaks.get(k, 0), s[k])
    stop.set()
    for t in ts:
        t.join()
    check(not errors, "%d s of requests, none failed%s" % (seconds, "".join("\n" + e for e in errors[:3])))


def idle(base=None):
    """A sample once the daemon has closed what the clients left (it notices
    a hang-up at its next write or poll), waiting at most 10 s: for no more
    fds and threads than base, or without base, for two samples half a
    second apart that agree."""
    t = time.time() + 10
    last = sample()
    while True:
        time.sleep(0.5 if base is None else 0.2)
        s = sample()
        if base is None:
            if (s["fds"], s["threads"]) == (last["fds"], last["threads"]) or time.time() > t:
                return s
            last = s
        elif (s["fds"] <= base["fds"] and s["threads"] <= base["threads"]) or time.time() > t:
            return s


load(WARMUP, 1)
time.sleep(1)
base = idle()
print("warm-up (%d s): rss %.1f MiB, %d fds, %d threads" % (WARMUP, base["rss"] / MIB, base["fds"], base["threads"]))
peaks = {}
load(SECONDS - WARMUP, 100, peaks)
end = idle(base)
print("after %d s: rss %.1f MiB, %d fds, %d threads; peak under load rss %.1f MiB, %d fds, %d threads" %
      (SECONDS, end["rss"] / MIB, end["fds"], end["threads"], peaks["rss"] / MIB, peaks["fds"], peaks["threads"]))
print("requests:", ", ".join("%s %d" % kv for kv in sorted(counts.items())))
check(end["fds"] <= base["fds"], "idle fds back to the warm-up's (%d -> %d)" % (base["fds"], end["fds"]))
check(end["threads"] <= base["threads"], "idle threads back to the warm-up's (%d -> %d)" %
      (base["threads"], end["threads"]))
check(peaks["iou"] <= IOU_MAX, "the kernel's io_uring workers stayed within the cap (%d, at most %d; %d idle)" %
      (peaks["iou"], IOU_MAX, end["iou"]))
bound = max(8 * MIB, base["rss"] // 10)
check(end["rss"] - base["rss"] < bound, "RSS grew %.1f MiB, under %.1f MiB" %
      ((end["rss"] - base["rss"]) / MIB, bound / MIB))
code, h = d.get("/health")
check(code == 200, "still healthy")
check(d.stop() == 0, "kvtierd stops cleanly")
