"""kvtierd's disk tier under injected I/O faults: for every N, the Nth
io_uring submission after start fails with EIO (KVTIER_DISK_FAIL_NTH) while
a session is spilled, restored and written at exit.  Every request still
gets the tokens of a daemon without a disk tier, the session stays usable,
and after a restart the daemon serves; the sweep ends once a whole run
passes N without hitting it."""
import os
import sys
import time

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, metric  # noqa: E402

ref = Daemon("--disk-dir", "none")
ref.start()
prompt = [(i * 53 + 7) % 1900 + 50 for i in range(60)]
gen = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_tokens": True}


def complete(dm, ids, sid):
    code, r = dm.post("/v1/completions", dict(gen, prompt=ids, session=sid))
    assert code == 200, (code, r)
    return r["choices"][0]["tokens"]


def scenario(dm):
    """Two turns on one session with a spill between them; the tokens of each turn."""
    code, s = dm.post("/v1/sessions", {"prompt": prompt[:30]})
    assert code == 200, (code, s)
    sid = s["id"]
    t1 = complete(dm, prompt[:40], sid)
    end = time.time() + 10
    while time.time() < end:
        b = dm.get("/v1/sessions/" + sid)[1]["bytes"]
        if (b["disk"] > 0 and b["device"] == 0) or metric(dm, "disk_errors_total") > 0:
            break
        time.sleep(0.1)
    t2 = complete(dm, prompt[:40] + t1 + [5, 6], sid)
    return sid, t1, t2


_, want1, want2 = scenario(ref)
ref.stop()
clean_runs = 0
n = 0
hits = 0
while clean_runs < 3 and n < 80:
    n += 1
    d = Daemon("--spill-after", "1", model=ref.model, tmp=ref.tmp)
    d.sock = os.path.join(ref.tmp, "f%d.sock" % n)
    d.start(extra_env={"KVTIER_DISK_FAIL_NTH": str(n)})
    try:
        sid, t1, t2 = scenario(d)
    except Exception:
        print("N=%d, kvtierd's log:\n%s" % (n, d.logtext()[-6000:]))
        raise
    assert t1 == want1 and t2 == want2, "N=%d: tokens differ from a daemon without a disk tier" % n
    errors = metric(d, "disk_errors_total")
    assert d.stop() == 0, "N=%d: exit status" % n
    hit = errors > 0 or "failed" in d.logtext().split("kvtierd exits")[0].split("listening on")[-1]
    hits += hit
    clean_runs = 0 if hit else clean_runs + 1
    d.start()  # no fault: whatever the failed run left must load or be set aside
    code, lst = d.get("/v1/sessions")
    assert code == 200, lst
    if any(s["id"] == sid for s in lst["data"]):
        assert complete(d, prompt[:40] + t1 + [5, 6], sid) == want2, "N=%d: after the restart" % n
    d.stop()
check(hits >= 10, "fault sweep: %d submissions failed in turn (%d hit the scenario), every request got the clean "
      "tokens, every restart served" % (n, hits))

# A full file system: a spill's data write comes back short, which is the
# disk being full, and the log says so (not an I/O error).  Needs a small
# tmpfs, so root where mounts are allowed; skipped otherwise.
full = Daemon(model="model/builtin")
mnt = os.path.join(full.tmp, "tiny")
os.makedirs(mnt)
if os.geteuid() == 0 and os.system("mount -t tmpfs -o size=600k tmpfs %s 2>/dev/null" % mnt) == 0:
    try:
        full.args += ["--disk-dir", os.path.join(mnt, "d"), "--disk-mem", "100000000", "--spill-after", "1"]
        full.start()
        for i in range(4):
            full.post_ok("/v1/sessions", {"prompt": [(j * 7 + i) % 1900 + 50 for j in range(400)]})
        end = time.time() + 15
        while "spill to disk failed" not in full.logtext() and time.time() < end:
            time.sleep(0.2)
        log = full.logtext()
        check("No space left on device" in log and "Input/output error" not in log and
              full.get("/health")[0] == 200,
              "a full file system: spills fail with 'No space left on device', the KV stays, the daemon serves")
        full.stop()
    finally:
        os.system("umount %s" % mnt)
else:
    print("skip: the full file system case needs root and tmpfs mounts")
