"""kvtierd's disk tier with a state-space model (Mamba): an idle session
spills (its state and its checkpoints) and its next request continues from
the restored state with a fresh run's tokens; a crop after the restore goes
back to a checkpoint that came back from disk; a session survives a
restart (and exports the same state file after it); on a slow disk a restore computes with the state's layers while
the checkpoints after them are still being read."""
import sys
import time

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, mkmodel  # noqa: E402

sp = Daemon("--checkpoint-interval", "16", "--spill-after", "1")
model = mkmodel(sp.tmp + "/mamba", "--arch", "mamba", "--layers", "2", "--dim", "64")
sp.model = model
sp.start()
prompt = [(i * 53 + 7) % 1900 + 50 for i in range(100)]
gen = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True}


def toks(r):
    return r["choices"][0]["tokens"]


def spilled(sid, timeout=20):
    end = time.time() + timeout
    while time.time() < end:
        s = sp.get("/v1/sessions/" + sid)[1]
        if s["bytes"]["disk"] > 0 and s["bytes"]["device"] == 0 and s["bytes"]["host"] == 0:
            return s
        time.sleep(0.2)
    return None


def spcomplete(ids, **kw):
    code, r = sp.post("/v1/completions", dict(gen, prompt=ids, **kw))
    assert code == 200, (code, r)
    return r


sid = sp.post("/v1/sessions", {"prompt": prompt[:40]})[1]["id"]
r1 = spcomplete(prompt[:40], session=sid)
s = spilled(sid)
check(s is not None, "an idle Mamba session leaves memory for disk")
nxt = prompt[:40] + toks(r1) + [77, 78]
r2 = spcomplete(nxt, session=sid)
check(toks(r2) == toks(spcomplete(nxt)) and r2["usage"]["prompt_tokens_details"]["cached_tokens"] == s["tokens"],
      "restored from disk: a fresh run's tokens, the %d tokens it held cached (%d)" %
      (s["tokens"], r2["usage"]["prompt_tokens_details"]["cached_tokens"]))
code, c = sp.post("/v1/sessions/%s/crop" % sid, {"n": 45})
check(code == 200 and c["tokens"] == 45, "a crop of the restored session (%s)" % c.get("tokens"))
r3 = spcomplete(nxt[:45], session=sid)
check(r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 32 and toks(r3) == toks(spcomplete(nxt[:45])),
      "its checkpoints came back from disk: re-sending 45 tokens goes back to 32 (cached_tokens %d), a fresh "
      "run's tokens" % r3["usage"]["prompt_tokens_details"]["cached_tokens"])
held = nxt[:45] + toks(r3)
n_held = sp.get("/v1/sessions/" + sid)[1]["tokens"]
code, exported = sp.get("/v1/sessions/%s/kv" % sid)
check(code == 200 and isinstance(exported, bytes), "the session's state exported before the restart")
check(sp.stop() == 0, "SIGTERM writes the session")
sp.start()
s = sp.get("/v1/sessions/" + sid)[1]
check(s.get("tokens") == n_held and s["bytes"]["disk"] > 0, "after a restart the session is listed, on disk (%s)" % s)
code, again = sp.get("/v1/sessions/%s/kv" % sid)
check(code == 200 and again == exported, "exported from the disk tier, the same file as before the restart")
r4 = spcomplete(held + [9], session=sid)
check(toks(r4) == toks(spcomplete(held + [9])) and r4["usage"]["prompt_tokens_details"]["cached_tokens"] == n_held,
      "after the restart it continues with a fresh run's tokens (cached_tokens %d, held %d)" %
      (r4["usage"]["prompt_tokens_details"]["cached_tokens"], n_held))
check(sp.stop() == 0, "stop")

# ---- layer by layer: the state computes while the checkpoints are read ------
# A 1024-token session of a wider Mamba (4 layers of 512 channels: 152 KiB
# of state) with a checkpoint every 32 tokens: its image, the state then 32
# checkpoints, spans two windows of the disk tier's reads, slowed to
# 150 ms a window.  Its next request starts on the state's layers, in the
# first window, before the read is done
# (kvtier_session_restore_early_layers_total), with a fresh run's tokens.
wide = mkmodel(sp.tmp + "/wide", "--arch", "mamba", "--layers", "4", "--dim", "256")
ctx = [(i * 41 + 5) % 1900 + 50 for i in range(1024)]
ids = ctx + [11, 12]
ref = Daemon("--checkpoint-interval", "32", "--disk-dir", "none", model=wide, tmp=sp.tmp)
ref.sock = sp.tmp + "/ref.sock"
ref.start()
want = ref.post_ok("/v1/completions", dict(gen, prompt=ids))
check(ref.stop() == 0, "a fresh run on a daemon without a disk tier")
slow = Daemon("--checkpoint-interval", "32", "--spill-after", "1", model=wide, tmp=sp.tmp)
slow.sock = sp.tmp + "/slow.sock"
slow.start(extra_env={"KVTIER_DISK_READ_DELAY_MS": "150"})
sp = slow
sid = sp.post("/v1/sessions", {"prompt": ctx})[1]["id"]
s = spilled(sid, 60)
check(s is not None and s["bytes"]["disk"] > 4 << 20, "the 1024-token session spilled: %s" % (s and s["bytes"]))


def early():
    for line in sp.get("/metrics")[1].decode().splitlines():
        if line.startswith("kvtier_session_restore_early_layers_total "):
            return float(line.split()[1])
    raise KeyError("kvtier_session_restore_early_layers_total")


before = early()
r = spcomplete(ids, session=sid)
end = time.time() + 20  # counted when the read ends, which can be after the reply
while early() == before and time.time() < end:
    time.sleep(0.1)
grew = early() - before
check(toks(r) == toks(want) and grew > 0 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 1024,
      "restored on a slow disk: %d layer(s) computed before the read was done, a fresh run's tokens, 1024 cached"
      % grew)
check(sp.stop() == 0, "stop")
