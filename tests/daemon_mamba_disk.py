"""kvtierd's disk tier with a state-space model (Mamba): an idle session
spills (its state and its checkpoints) and its next request continues from
the restored state with a fresh run's tokens; a crop after the restore goes
back to a checkpoint that came back from disk; a session survives a
restart."""
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
check(sp.stop() == 0, "SIGTERM writes the session")
sp.start()
s = sp.get("/v1/sessions/" + sid)[1]
check(s.get("tokens") == n_held and s["bytes"]["disk"] > 0, "after a restart the session is listed, on disk (%s)" % s)
r4 = spcomplete(held + [9], session=sid)
check(toks(r4) == toks(spcomplete(held + [9])) and r4["usage"]["prompt_tokens_details"]["cached_tokens"] == n_held,
      "after the restart it continues with a fresh run's tokens (cached_tokens %d, held %d)" %
      (r4["usage"]["prompt_tokens_details"]["cached_tokens"], n_held))
check(sp.stop() == 0, "stop")
