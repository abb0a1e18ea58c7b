"""kvtierd's disk tier: a session idle for --spill-after leaves memory for
disk and its next request continues from the restored KV with the tokens of
a daemon that never spilled (every strategy); sessions survive a restart;
a corrupt, truncated, zero-filled or swapped file is quarantined with a log
line naming it and the daemon keeps serving (a session whose data is bad
recomputes, with the same tokens); a tiny --disk-mem keeps sessions in
memory and says why; a full host tier spills an idle session instead of
answering 507; a forged meta the creation checks refuse is not listed."""
import glob
import os
import subprocess
import sys
import time

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, damage_spill, forge_sparse_session, forge_spill_meta, metric, skip, wait_spilled  # noqa: E402

ref = Daemon("--disk-dir", "none")
ref.start()
d = Daemon("--spill-after", "1", model=ref.model, tmp=ref.tmp)
d.sock = os.path.join(ref.tmp, "disk.sock")
d.start()
disk_dir = d.sock + ".disk"
prompt = [(i * 53 + 7) % 1900 + 50 for i in range(70)]
gen = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_tokens": True}


def complete(dm, ids, **kw):
    return dm.post_ok("/v1/completions", dict(gen, prompt=ids, **kw))


def session(dm, **body):
    return dm.post_ok("/v1/sessions", body)["id"]


STRATEGIES = [
    ("dynamic", None),
    ("static", {"implementation": "static", "max_cache_len": 256}),
    ("offloaded", {"implementation": "offloaded"}),
    ("offloaded_static", {"implementation": "offloaded_static", "max_cache_len": 256}),
    ("quantized", {"implementation": "quantized", "nbits": 4, "residual_length": 16}),
    ("sliding_window", {"implementation": "sliding_window", "window_length": 24}),
    ("sink", {"implementation": "sink", "window_length": 40, "num_sink_tokens": 4}),
]

# ---- spill on idle, restore on the next request: the tokens of a session that never left memory ----
pairs = {}
for name, cache in STRATEGIES:
    body = {"prompt": prompt[:30]} if cache is None else {"prompt": prompt[:30], "cache": cache}
    a, b = session(ref, **body), session(d, **body)
    ra, rb = complete(ref, prompt[:40], session=a), complete(d, prompt[:40], session=b)
    check(ra["choices"][0]["tokens"] == rb["choices"][0]["tokens"], name + ": the same tokens before any spill")
    ran = d.get("/v1/sessions/" + b)[1]["strategy"]
    s = wait_spilled(d, b)
    check(s["strategy"] == ran, "%s: listed on disk with the strategy it ran with (%s)" % (name, s["strategy"]))
    held = s["tokens"]
    nxt = prompt[:40] + ra["choices"][0]["tokens"] + [77, 78]
    ra, rb = complete(ref, nxt, session=a), complete(d, nxt, session=b)
    check(ra["choices"][0]["tokens"] == rb["choices"][0]["tokens"] and
          rb["usage"]["prompt_tokens_details"]["cached_tokens"] == ra["usage"]["prompt_tokens_details"]["cached_tokens"]
          and rb["usage"]["prompt_tokens_details"]["cached_tokens"] > 0,
          "%s: spilled (%d tokens, %d bytes on disk), restored, continued with the same tokens (%d cached)" %
          (name, held, s["bytes"]["disk"], rb["usage"]["prompt_tokens_details"]["cached_tokens"]))
    pairs[name] = (a, b, nxt + ra["choices"][0]["tokens"], ran)
# a restore begun layer by layer is counted when its read ends, which may
# be after the reply of the request that started on its first layers
end = time.time() + 20
while True:
    spills, restores = metric(d, "session_spills_total", '{reason="idle"}'), metric(d, "session_restores_total")
    if (spills >= len(STRATEGIES) and restores >= len(STRATEGIES)) or time.time() > end:
        break
    time.sleep(0.2)
check(spills >= len(STRATEGIES) and restores >= len(STRATEGIES),
      "/metrics counts spills and restores (%d idle spills, %d restores, %d strategies)" %
      (spills, restores, len(STRATEGIES)))
# idle spills are compressed under --disk-compress auto: the ratio and its cost show
check(metric(d, "disk_compression_ratio") > 1.05 and metric(d, "disk_compress_seconds_total") > 0 and
      metric(d, "disk_op_seconds_total", '{op="read"}') > 0,
      "/metrics reports the compression ratio (%.2f) and what it cost (%.3f s)" %
      (metric(d, "disk_compression_ratio"), metric(d, "disk_compress_seconds_total")))
files = glob.glob(os.path.join(disk_dir, "u%d" % os.getuid(), "*.kvt"))
check(len(files) == len(STRATEGIES) and all(os.stat(f).st_mode & 0o777 == 0o600 for f in files) and
      os.stat(os.path.join(disk_dir, "u%d" % os.getuid())).st_mode & 0o777 == 0o700,
      "one file per session under u<uid>/, files 0600 and directories 0700")

# ---- persistence: SIGTERM writes every session, a restart lists them, each continues ----
check(d.stop() == 0, "SIGTERM: clean exit")
d.start()
listed = {s["id"]: s for s in d.get("/v1/sessions")[1]["data"]}
check(all(b in listed and listed[b]["bytes"]["disk"] > 0 and listed[b]["strategy"] == ran
          for _, b, _, ran in pairs.values()),
      "after a restart every session is listed, on disk, with its strategy")
for name, (a, b, nxt, _) in pairs.items():
    ra, rb = complete(ref, nxt, session=a), complete(d, nxt, session=b)
    check(ra["choices"][0]["tokens"] == rb["choices"][0]["tokens"] and
          rb["usage"]["prompt_tokens_details"]["cached_tokens"] == ra["usage"]["prompt_tokens_details"]["cached_tokens"],
          "%s: after the restart the session continues with the same tokens" % name)

# ---- damaged files: quarantined, named in the log, the daemon serves ----
check(d.stop() == 0, "stop before damaging the files")
udir = os.path.join(disk_dir, "u%d" % os.getuid())
victims = {}
for (name, (a, b, nxt, _)), how in zip(pairs.items(), ["truncate", "zero", "swap", "data"]):
    path = os.path.join(udir, b + ".kvt")
    size = os.path.getsize(path)
    if how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    elif how == "zero":
        with open(path, "r+b") as f:
            f.write(b"\0" * size)
    elif how == "swap":
        other = pairs["sink"][1]
        with open(os.path.join(udir, other + ".kvt"), "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data)
    else:  # one byte of the KV data, past the header
        with open(path, "r+b") as f:
            f.seek(size - 100)
            byte = f.read(1)
            f.seek(size - 100)
            f.write(bytes([byte[0] ^ 0x5A]))
    victims[name] = (how, b)
d.start()
log = d.logtext()
listed = {s["id"] for s in d.get("/v1/sessions")[1]["data"]}
for name, (how, b) in victims.items():
    if how == "data":
        continue
    check(b not in listed and b in log and os.path.exists(os.path.join(disk_dir, "quarantine")),
          "%s file of %s: quarantined at start, named in the log, not listed" % (how, name))
name = [n for n, (how, _) in victims.items() if how == "data"][0]
a, b, nxt, _ = pairs[name]
if b in listed:
    ra, rb = complete(ref, nxt, session=a), complete(d, nxt, session=b)
    check(ra["choices"][0]["tokens"] == rb["choices"][0]["tokens"] and "quarantine" in d.logtext(),
          "a session whose KV data is corrupt recomputes: the same tokens, its file quarantined")
else:
    check(b in d.logtext(), "a session whose KV data is corrupt is quarantined at start")
code, r = d.post("/v1/completions", dict(gen, prompt=prompt[:20]))
check(code == 200, "the daemon keeps serving")
d.stop()

# ---- a disk tier too small: sessions stay in memory, the log and /metrics say why ----
tiny = Daemon("--spill-after", "1", "--disk-mem", "4k", model=ref.model, tmp=ref.tmp)
tiny.sock = os.path.join(ref.tmp, "tiny.sock")
tiny.start()
sid = session(tiny, prompt=prompt[:30])
r1 = complete(tiny, prompt[:40], session=sid)
until = time.time() + 30  # the spill is tried once the session has been idle a second
while metric(tiny, "disk_errors_total") < 1 and time.time() < until:
    time.sleep(0.1)
s = tiny.get("/v1/sessions/" + sid)[1]
check(s["bytes"]["disk"] == 0 and s["bytes"]["device"] > 0 and metric(tiny, "disk_errors_total") >= 1,
      "--disk-mem 4k: the session stays in memory, /metrics counts the failed spill")
r2 = complete(tiny, prompt[:40] + r1["choices"][0]["tokens"], session=sid)
check(r2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "and keeps serving from memory")
# at exit the session cannot be written either: it is lost, and the log says so
check(tiny.stop() == 0 and "0 session(s) written at exit, 1 failed" in tiny.logtext(),
      "--disk-mem 4k: the session that fits no file is counted at exit as failed")

# ---- a full host tier spills an idle session instead of answering 507 ----
deep = os.path.join(ref.tmp, "deep")
r = subprocess.run(["/usr/bin/python3", "tools/mkmodel.py", "--arch", "llama", "--preset", "tiny", "--layers", "8",
                    "--vocab", "2048", "--tokenizer-from", "model/builtin", "--out", deep],
                   capture_output=True, text=True)
if r.returncode:
    skip("mkmodel failed: " + r.stderr[-300:])
long = [(i * 37 + 11) % 1900 + 50 for i in range(200)]
off = {"implementation": "offloaded"}
for disk in ("none", None):
    args = ["--host-mem", "768k", "--spill-after", "3600"] + (["--disk-dir", disk] if disk else [])
    h = Daemon(*args, model=deep, tmp=ref.tmp)
    h.sock = os.path.join(ref.tmp, "host-%s.sock" % (disk or "disk"))
    h.start()
    a = session(h, prompt=long, cache=off)
    code, e = h.post("/v1/sessions", {"prompt": long[::-1], "cache": off})
    if disk == "none":
        check(code == 507 and "host tier" in e["error"]["message"],
              "without a disk tier, a second session the host tier cannot hold: 507")
    else:
        s = h.get("/v1/sessions/" + a)[1]
        check(code == 200 and s["bytes"]["disk"] > 0 and s["bytes"]["host"] == 0,
              "with one, the idle session goes to disk and the new one is served (%s)" % s["bytes"])
        check(metric(h, "session_spills_total", '{reason="memory"}') == 1 and
              metric(h, "session_spills_total", '{reason="idle"}') == 0,
              "/metrics counts that spill under reason=\"memory\"")
        r = complete(h, long + [5], session=a)
        check(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 200,
              "the spilled session comes back when the other one is done with the memory")
    h.stop()

# ---- kill -9 in the middle of a write: the previous file, never a torn one ----
# v1 (one 1 MiB chunk) is written whole; v2 (two chunks) is paused after its
# chunks are down, before its rename, and the daemon is killed there.
bigger = [(i * 29 + 3) % 1900 + 50 for i in range(700)]
hook = Daemon("--spill-after", "1", model=deep, tmp=ref.tmp)
hook.sock = os.path.join(ref.tmp, "hook.sock")
hook.start(extra_env={"KVTIER_DISK_PAUSE_AFTER_CHUNK": "2"})
href = Daemon("--disk-dir", "none", model=deep, tmp=ref.tmp)
href.sock = os.path.join(ref.tmp, "href.sock")
href.start()
a, b = session(href, prompt=bigger[:200]), session(hook, prompt=bigger[:200])
v1 = wait_spilled(hook, b)
complete(href, bigger, session=a)
complete(hook, bigger, session=b)
# idle again: the v2 write starts and stops after its two chunks
udir = os.path.join(hook.sock + ".disk", "u%d" % os.getuid())


def temp_bytes():
    total = 0
    for n in os.listdir(udir):
        try:
            total += os.path.getsize(os.path.join(udir, n)) if n.startswith(".") else 0
        except FileNotFoundError:  # renamed meanwhile
            pass
    return total


until, last = time.time() + 30, -1
while time.time() < until and (temp_bytes() == 0 or temp_bytes() != last):  # written, and paused
    last = temp_bytes()
    time.sleep(0.5)
hook.proc.kill()
hook.proc.wait()
check(any(n.startswith(".") for n in os.listdir(udir)), "killed with a temporary file half-way")
hook.start()
s = hook.get("/v1/sessions/" + b)[1]
quarantine = os.path.join(hook.sock + ".disk", "quarantine")
check(s["tokens"] == v1["tokens"] and not any(n.startswith(".") for n in os.listdir(udir)) and
      not (os.path.exists(quarantine) and os.listdir(quarantine)),
      "after the restart: the session as of its last complete write (%d tokens), the temporary file gone" % s["tokens"])
ids = bigger[:200] + [9, 8, 7]
ra, rb = complete(href, ids, session=a), complete(hook, ids, session=b)
check(ra["choices"][0]["tokens"] == rb["choices"][0]["tokens"] and
      rb["usage"]["prompt_tokens_details"]["cached_tokens"] == 200,
      "and it continues from that state with the tokens of a daemon that never stopped")
hook.stop()
href.stop()

# ---- a restore computes its first layers while the last are still read ----
# A model whose 400-token session spans four windows of the disk tier's
# reads, on a disk slowed to 150 ms a window: the next request starts on
# the layers that are in (kvtier_session_restore_early_layers_total), with
# the tokens of a daemon that never spilled.  Then a chunk near the end of
# the file is damaged: the step that already computed the first layers
# finds the last one missing, the session starts over from its tokens (the
# prefix cache may still hold them), and the reply is still the clean one.
wide = os.path.join(ref.tmp, "wide")
r = subprocess.run(["/usr/bin/python3", "tools/mkmodel.py", "--arch", "llama", "--preset", "tiny", "--layers", "8",
                    "--dim", "512", "--heads", "8", "--kv-heads", "8", "--ffn", "256", "--vocab", "2048",
                    "--tokenizer-from", "model/builtin", "--out", wide], capture_output=True, text=True)
if r.returncode:
    skip("mkmodel failed: " + r.stderr[-300:])
wref = Daemon("--disk-dir", "none", "--kv-dtype", "f32", model=wide, tmp=ref.tmp)
wref.sock = os.path.join(ref.tmp, "wref.sock")
wref.start()
slow = Daemon("--spill-after", "1", "--kv-dtype", "f32", model=wide, tmp=ref.tmp)
slow.sock = os.path.join(ref.tmp, "slow.sock")
slow.start(extra_env={"KVTIER_DISK_READ_DELAY_MS": "150"})
ctx = [(i * 41 + 5) % 1900 + 50 for i in range(400)]
for damage in (False, True):
    a, b = session(wref, prompt=ctx), session(slow, prompt=ctx)
    s = wait_spilled(slow, b)
    if damage:
        damage_spill(slow, b)
    early = metric(slow, "session_restore_early_layers_total")
    ids = ctx + [11, 12]
    ra, rb = complete(wref, ids, session=a), complete(slow, ids, session=b)
    same = ra["choices"][0]["tokens"] == rb["choices"][0]["tokens"]
    end = time.time() + 20  # counted when the read ends, which can be after the reply
    while metric(slow, "session_restore_early_layers_total") == early and time.time() < end:
        time.sleep(0.1)
    grew = metric(slow, "session_restore_early_layers_total") - early
    if not damage:
        check(same and grew > 0 and rb["usage"]["prompt_tokens_details"]["cached_tokens"] == 400,
              "a %.1f MiB session on a slow disk: %d layer(s) computed before its read was done, the same tokens"
              % (s["bytes"]["disk"] / 1048576, grew))
    else:
        check(same and grew > 0 and "restore from disk failed" in slow.logtext(),
              "its last chunk damaged: the step that began on %d layer(s) starts over (%d tokens from the prefix "
              "cache), the same tokens" % (grew, rb["usage"]["prompt_tokens_details"]["cached_tokens"]))
slow.stop()
wref.stop()
# a sink session past the context whose file is damaged: its whole
# conversation sent again can no longer be continued (the KV that held its
# start is lost, and computing it afresh would pass the context), so it is
# the 400 naming the context, whether the damage is found before the step
# or by a step already begun on the first layers
sk2 = Daemon("--ctx-size", "210", "--spill-after", "1", "--kv-dtype", "f32", model=wide, tmp=ref.tmp)
sk2.sock = os.path.join(ref.tmp, "sink2.sock")
sk2.start(extra_env={"KVTIER_DISK_READ_DELAY_MS": "150"})
sid2 = session(sk2, cache={"implementation": "sink", "window_length": 200, "num_sink_tokens": 4})
gone = sk2.post_ok("/v1/completions", dict(gen, max_tokens=10, prompt=ctx[:205], session=sid2))["choices"][0]["tokens"]
wait_spilled(sk2, sid2)
damage_spill(sk2, sid2, back=100000)  # inside the last layer, not the padding
code, e = sk2.post("/v1/completions", dict(gen, prompt=ctx[:205] + gone, session=sid2))
check(code == 400 and e["error"]["type"] == "exceed_context_size_error" and "restore from disk failed" in sk2.logtext(),
      "a damaged sink session past the context, sent whole again: 400 naming the context (%s)" %
      str(e.get("error", {}).get("message", e))[30:130])
check(sk2.stop() == 0, "and the daemon stops cleanly")

# ---- /metrics follows a spill and a delete at once, in an idle daemon ----
m = Daemon("--spill-after", "1", "--no-prefix-cache", model=ref.model, tmp=ref.tmp)
m.sock = os.path.join(ref.tmp, "metrics.sock")
m.start()
c = session(m, prompt=prompt[:60])
s = wait_spilled(m, c)
on_disk, dev = metric(m, "kv_cache_bytes", '{tier="disk"}'), metric(m, "kv_cache_bytes", '{tier="device"}')
check(on_disk > 0 and dev == 0,
      "spilled: /metrics shows the KV on disk (%d bytes, the session %d) and none on the device (%d)" %
      (on_disk, s["bytes"]["disk"], dev))
check(m.request("DELETE", "/v1/sessions/" + c)[0] == 200, "the spilled session deleted")
end = time.time() + 5  # the file goes on the disk thread
while metric(m, "kv_cache_bytes", '{tier="disk"}') and time.time() < end:
    time.sleep(0.05)
check(metric(m, "kv_cache_bytes", '{tier="disk"}') == 0, "deleted: /metrics shows no KV on disk")
m.stop()

# ---- a quantized cache over bf16 KV (the residual in bf16): spilled, restored, restarted ----
qref = Daemon("--disk-dir", "none", "--kv-dtype", "bf16", model=ref.model, tmp=ref.tmp)
qref.sock = os.path.join(ref.tmp, "qref.sock")
qref.start()
q = Daemon("--spill-after", "1", "--kv-dtype", "bf16", model=ref.model, tmp=ref.tmp)
q.sock = os.path.join(ref.tmp, "qbf16.sock")
q.start()
cache = dict(STRATEGIES)["quantized"]
a, b = session(qref, prompt=prompt[:30], cache=cache), session(q, prompt=prompt[:30], cache=cache)
ra, rb = complete(qref, prompt[:40], session=a), complete(q, prompt[:40], session=b)
wait_spilled(q, b)
nxt = prompt[:40] + ra["choices"][0]["tokens"] + [77, 78]
ra, rb = complete(qref, nxt, session=a), complete(q, nxt, session=b)
cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (ra, rb)]
check(ra["choices"][0]["tokens"] == rb["choices"][0]["tokens"] and cached[0] == cached[1] > 0,
      "bf16 KV, quantized: spilled, restored, the same tokens with the same %d tokens cached" % cached[1])
nxt += ra["choices"][0]["tokens"]
check(q.stop() == 0, "bf16 KV: SIGTERM writes the quantized session")
seen = len(q.logtext())
q.start()
ra, rb = complete(qref, nxt, session=a), complete(q, nxt, session=b)
cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (ra, rb)]
check(ra["choices"][0]["tokens"] == rb["choices"][0]["tokens"] and cached[0] == cached[1] > 0 and
      "restore from disk failed" not in q.logtext()[seen:],
      "bf16 KV, quantized: after a restart the same tokens with the same %d tokens cached" % cached[1])
q.stop()
qref.stop()

# ---- a sink session that generated past the context survives a restart ----
sk = Daemon("--ctx-size", "256", model=ref.model, tmp=ref.tmp)
sk.sock = os.path.join(ref.tmp, "sink.sock")
sk.start()
sid = session(sk, cache={"implementation": "sink", "window_length": 64, "num_sink_tokens": 4})
long_gen = dict(gen, max_tokens=300)
r = sk.post_ok("/v1/completions", dict(long_gen, prompt=prompt, session=sid))
first = r["choices"][0]["tokens"]
one = sk.post_ok("/v1/completions", dict(long_gen, max_tokens=360, prompt=prompt,
                                         cache={"implementation": "sink", "window_length": 64, "num_sink_tokens": 4}))
held = sk.get("/v1/sessions/" + sid)[1]["tokens"]
check(held > 256, "a sink session generated past the context: %d tokens" % held)
check(sk.stop() == 0, "sink: SIGTERM writes the session")
seen = len(sk.logtext())
sk.start()
code, s = sk.get("/v1/sessions/" + sid)
check(code == 200 and s["tokens"] == held and "not listed" not in sk.logtext()[seen:],
      "after a restart the sink session past the context is listed with its %d tokens" % held)
# the whole conversation sent again, past the context: the session holds its
# start, so it goes on with the tokens of one request that generated them all
whole = prompt + first
r = sk.post_ok("/v1/completions", dict(long_gen, max_tokens=60, prompt=whole, session=sid))
check(first == one["choices"][0]["tokens"][:300] and r["choices"][0]["tokens"] == one["choices"][0]["tokens"][300:] and
      r["usage"]["prompt_tokens_details"]["cached_tokens"] == len(whole) - 1,
      "a sink session continued with its whole %d-token conversation: one request's tokens, one token computed"
      % len(whole))
for what, body in (("a one-shot request", dict(gen, prompt=whole)),
                   ("a session that departs from its start", dict(gen, prompt=[whole[0] ^ 1] + whole[1:],
                                                                  session=sid)),
                   ("a session that departs after its first eviction",
                    dict(gen, prompt=whole[:-5] + [whole[-5] ^ 1] + whole[-4:], session=sid))):
    code, e = sk.post("/v1/completions", body)
    check(code == 400 and e["error"]["type"] == "exceed_context_size_error" and "256" in e["error"]["message"],
          "%s past the context: 400 naming it: %s" % (what, e.get("error", {}).get("message")))
check(sk.get("/v1/sessions/" + sid)[1]["tokens"] == len(whole) + 59, "the refused request left the session as it was")
# a hand-edited meta asking past recording of the sink cache, which creation
# refuses: not listed, rather than listed and refusing every request; and
# a valid container claiming 6 GiB of KV for the session's tokens (a
# sparse file): not listed, rather than read into 6 GiB of memory
check(sk.stop() == 0, "sink: stopped again")
big = "sess-00000000000000ab"
forge_sparse_session(sk, sid, big, 6144)
forge_spill_meta(sk, sid, lambda m: m.__setitem__("record", True))
seen = len(sk.logtext())
sk.start()
code, _ = sk.get("/v1/sessions/" + sid)
check(code == 404 and sid + ".kvt not listed" in sk.logtext()[seen:],
      "a forged meta asking past recording of a sink cache: not listed, named in the log")
code, _ = sk.get("/v1/sessions/" + big)
check(code == 404 and big + ".kvt not listed: its KV image is larger" in sk.logtext()[seen:],
      "a file claiming 6 GiB of KV for its tokens: not listed, named in the log")
on_disk = metric(sk, "kv_cache_bytes", '{tier="disk"}')
check(on_disk < 64 << 20, "the disk budget counts the sparse file's blocks, not the 6 GiB it claims (%d bytes)" % on_disk)
sk.stop()
