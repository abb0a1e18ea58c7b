"""kvtierd under memory budgets: a request whose KV is several
times what --device-mem leaves after the model continues offloaded with
the unconstrained run's tokens and reports the fallback (response, /metrics);
the offloaded strategies give the same tokens with their prefetch figures;
forks of a static cache that the device has no room to copy (n choices,
beams, POST /fork) and an imported session's KV over the budget continue
in the host tier with the same tokens; host-tier exhaustion (--host-mem) is a 507 naming the budget, the session's
KV stays intact and the daemon keeps serving."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, "tests")
from daemon_harness import Daemon, PYTHON, check, metric, skip  # noqa: E402

# a deeper model than the harness's (8 layers) so two streaming slots are a
# small part of the KV: 8 layers x 2 KV heads x 16 dims x 4 bytes x 2 = 2 KiB a token
probe = Daemon()
model = os.path.join(probe.tmp, "deep")
r = subprocess.run([PYTHON, "tools/mkmodel.py", "--arch", "llama", "--preset", "tiny", "--layers", "8",
                    "--vocab", "2048", "--tokenizer-from", "model/builtin", "--out", model],
                   capture_output=True, text=True)
if r.returncode:
    skip("mkmodel failed: " + r.stderr[-300:])
KV_PER_TOKEN = 8 * 2 * 16 * 4 * 2


# the prompt: ~400 tokens of ids, so the KV is ~1 MiB
prompt = [(i * 37 + 11) % 1900 + 50 for i in range(400)]
req = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_tokens": True}
n_tok = len(prompt) + 24
kv = n_tok * KV_PER_TOKEN

free = Daemon(model=model, tmp=probe.tmp).start()
model_bytes = metric(free, "device_memory_bytes", '{kind="used"}')
check(model_bytes > 0 and metric(free, "device_memory_bytes", '{kind="budget"}') > model_bytes,
      "/metrics: device bytes used by the model and the budget")
code, clean = free.post("/v1/completions", req)
check(code == 200 and clean["kvtier"]["fallback"] is None and clean["kvtier"]["prefetch"] is None and
      clean["kvtier"]["bytes"]["device"] >= kv and clean["kvtier"]["bytes"]["host"] == 0,
      "unconstrained: all KV on the device, no fallback")
want = clean["choices"][0]["tokens"]
small_want = free.post("/v1/completions", dict(req, prompt=prompt[:20]))[1]["choices"][0]["tokens"]
same = {}
for impl, extra in (("offloaded", {}), ("offloaded_static", {"max_cache_len": 512}),
                    ("static", {"max_cache_len": 512}),
                    ("offloaded", {"max_cache_len": 512, "adaptive": True, "offload_only_non_sliding": True})):
    code, r = free.post("/v1/completions", dict(req, cache=dict(extra, implementation=impl)))
    k = r.get("kvtier", {})
    name = impl + (" adaptive" if extra.get("adaptive") else "")
    check(code == 200 and r["choices"][0]["tokens"] == want and k["requested_strategy"] == impl and
          k["strategy"] == impl, "%s: the dynamic run's tokens (%s)" % (name, k.get("bytes")))
    same[name] = k
for name in ("offloaded", "offloaded_static"):
    p = same[name]["prefetch"]
    check(same[name]["bytes"]["host"] >= kv and p["steps"] > 0 and p["transfer_ms"] > 0 and
          p["overlap"] is not None and p["overlap"] <= 1 and p["bytes_per_token"] > 0 and p["bytes_d2h"] > 0,
          "%s: KV in the host tier, prefetch figures %s" % (name, p))
check(same["static"]["bytes"]["device"] >= 512 * KV_PER_TOKEN and same["static"]["prefetch"] is None,
      "static: max_cache_len preallocated on the device")
check(same["offloaded adaptive"]["resident_layers"] == 8 and same["offloaded adaptive"]["streamed_layers"] == 0,
      "adaptive with room for everything keeps every layer resident")


def running_request(d, cache):
    """GET /v1/requests' entry for a sessionless stream of 8 choices, once
    it has generated (2x1000 tokens each: still running when read), then
    the stream is dropped, which cancels it."""
    conn = d.conn()
    conn.request("POST", "/v1/completions", json.dumps(dict(req, max_tokens=1000, n=8, stream=True, cache=cache,
                                                            return_tokens=False)),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.fp.readline()
    found, t = None, time.time()
    while found is None and time.time() < t + 30:
        rows = [q for q in d.get("/v1/requests")[1]["data"] if q["state"] == "running" and q["generated_tokens"] > 0]
        found = rows[0] if rows and rows[0]["bytes"]["device"] + rows[0]["bytes"]["host"] > 0 else None
        time.sleep(0 if found else 0.01)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    while d.get("/v1/requests")[1]["data"] and time.time() < t + 30:
        time.sleep(0.02)
    return found


# a running request's own KV per tier (8 choices over a 400-token prompt)
# and, offloaded, the overlap of its prefetch, in GET /v1/requests
q = running_request(free, {"implementation": "dynamic"})
check(q is not None and q["session"] is None and q["bytes"]["device"] >= 8 * kv * 400 // n_tok and
      q["bytes"]["host"] == 0 and q["bytes"]["disk"] == 0 and q["overlap"] is None,
      "GET /v1/requests: a running sessionless request's KV on the device (%s)" % q)
q = running_request(free, {"implementation": "offloaded"})
check(q is not None and q["bytes"]["host"] >= 8 * kv * 400 // n_tok and q["overlap"] is not None and
      q["overlap"] <= 1, "GET /v1/requests: an offloaded request's KV in the host tier, its overlap (%s)" % q)
# quantized + offloaded: the blocks in the host tier, streamed, the resident run's tokens
q8 = {"implementation": "quantized", "backend": "quanto", "nbits": 8}
code, r = free.post("/v1/completions", dict(req, cache=q8))
q8_want = r["choices"][0]["tokens"]
check(code == 200 and r["kvtier"]["bytes"]["host"] == 0 and r["kvtier"]["prefetch"] is None, "quantized int8, resident")
code, r = free.post("/v1/completions", dict(req, cache=dict(q8, offload=True)))
k = r.get("kvtier", {})
# int8 codes take about a quarter of the f32 KV; the sequence also keeps a
# residual's f32 blocks (128 tokens: 8 blocks of 16, plus one) per layer
residual = 8 * (128 // 16 + 1) * 16 * KV_PER_TOKEN // 8
check(code == 200 and r["choices"][0]["tokens"] == q8_want and k["strategy"] == "quantized" and
      k["fallback"] is None and k["bytes"]["device"] == 0 and 0 < k["bytes"]["host"] < kv / 2 + residual and
      k["streamed_layers"] == 8 and k["prefetch"]["steps"] > 0 and k["prefetch"]["bytes_d2h"] > 0,
      "quantized int8 + offload: the resident run's tokens, KV in the host tier (%s)" % k)
for extra, param in (({"offload": "yes"}, "cache.offload"), ({"adaptive": True}, "cache.adaptive")):
    code, e = free.post("/v1/completions", dict(req, cache=dict(q8, **extra)))
    check(code == 400 and e["error"]["param"] == param, "quantized %s -> 400 naming %s: %s" %
          (extra, param, e["error"]["message"]))
code, e = free.post("/v1/completions", dict(req, cache={"implementation": "static", "max_cache_len": 64}))
check(code == 400 and "max_cache_len" in e["error"]["message"] and e["error"]["param"] == "cache.max_cache_len",
      "static: writing past max_cache_len -> 400 naming it: " + e["error"]["message"])
code, e = free.post("/v1/completions", dict(req, cache={"implementation": "static"}))
check(code == 400 and "max_cache_len" in e["error"]["message"], "static without max_cache_len -> 400")
code, e = free.post("/v1/completions", dict(req, cache={"implementation": "offloaded", "num_sink_tokens": 4}))
check(code == 400 and "valid: max_cache_len, offload_only_non_sliding, adaptive, allow_offload, window_length" in
      e["error"]["message"], "unknown parameter -> 400 listing the valid ones")
code, e = free.post("/v1/completions", dict(req, cache={"implementation": "static", "max_cache_len": 10 ** 9}))
check(code == 400 and e["error"]["param"] == "cache.max_cache_len", "max_cache_len beyond the context -> 400")
# references for the budgets below: forks of a static cache (n choices, beams) and a session's
# exported KV with its continuation
STATIC = {"implementation": "static", "max_cache_len": 512}
code, r = free.post("/v1/completions", dict(req, n=3, cache=STATIC))
check(code == 200 and all(c["tokens"] == want for c in r["choices"]) and r["kvtier"]["fallback"] is None,
      "static, n=3: every choice has the dynamic run's tokens")
code, r = free.post("/v1/completions", dict(req, num_beams=3, cache=STATIC))
check(code == 200, "static, num_beams=3")
beams_want = [c["tokens"] for c in r["choices"]]
code, s = free.post("/v1/sessions", {"prompt": prompt})
code, blob = free.request("GET", "/v1/sessions/%s/kv" % s["id"])
check(code == 200 and isinstance(blob, bytes), "a session's KV exported")
code, r = free.post("/v1/completions", dict(req, session=s["id"], prompt=prompt + [5]))
cont_want = r["choices"][0]["tokens"]
free.request("DELETE", "/v1/sessions/" + s["id"])  # or the disk tier keeps it for the daemons below
free.stop()

# --device-mem: the model plus a third of the request's KV
budget = int(model_bytes + kv / 3)
d = Daemon("--device-mem", str(budget), model=model, tmp=probe.tmp).start()
code, r = d.post("/v1/completions", req)
k = r.get("kvtier", {})
check(code == 200 and r["choices"][0]["tokens"] == want,
      "KV 3x the device budget: the unconstrained run's %d tokens" % len(want))
check(k["fallback"] == "offloaded" and k["strategy"] == "offloaded" and k["requested_strategy"] == "dynamic" and
      k["bytes"]["host"] >= kv and k["prefetch"]["steps"] > 0, "the response reports the fallback: %s" % k)
# the request announces its length (prompt + max_tokens): it starts offloaded
check(metric(d, "kv_fallbacks_total", '{reason="sized"}') == 1 and
      metric(d, "kv_fallbacks_total", '{reason="oom"}') == 0, "/metrics counts the fallback under reason=\"sized\"")
code, e = d.post("/v1/completions", dict(req, cache={"implementation": "dynamic", "allow_offload": False}))
check(code == 507 and "device" in e["error"]["message"],
      "allow_offload=false: 507 naming the device budget: " + e["error"]["message"])
code, r = d.post("/v1/completions", dict(req, cache=q8))
k = r.get("kvtier", {})
check(code == 200 and r["choices"][0]["tokens"] == q8_want and k["strategy"] == "quantized" and
      k["fallback"] == "offloaded" and k["bytes"]["host"] > 0 and k["bytes"]["device"] == 0,
      "quantized int8 over the device budget: continues from the host tier with the resident run's tokens (%s)" % k)
# a quantized cache has no size check at creation: its step runs out of device memory
check(metric(d, "kv_fallbacks_total", '{reason="oom"}') == 1 and
      metric(d, "kv_fallbacks_total", '{reason="sized"}') == 1, "/metrics counts that one under reason=\"oom\"")
code, e = d.post("/v1/completions", dict(req, cache=dict(q8, allow_offload=False)))
check(code == 507 and "device tier budget" in e["error"]["message"],
      "quantized, allow_offload=false: 507 naming the device budget: " + e["error"]["message"])
code, r = d.post("/v1/completions", dict(req, prompt=prompt[:20]))
check(code == 200 and len(r["choices"][0]["tokens"]) == 24, "the daemon keeps serving (%s)" % r["kvtier"]["strategy"])
# an exported session's KV, 3x what the device has room for, imports into the host tier
code, imp = d.request("POST", "/v1/sessions/import", blob, {"Content-Type": "application/octet-stream"})
check(code == 201 and imp["strategy"] == "offloaded" and imp["fallback"] == "offloaded" and
      imp["bytes"]["device"] == 0 and imp["bytes"]["host"] > 0,
      "import of KV over the device budget: 201, the session in the host tier (%s)" % imp)
check(metric(d, "kv_fallbacks_total", '{reason="oom"}') == 2, "/metrics counts the import's fallback")
code, r = d.post("/v1/completions", dict(req, session=imp.get("id"), prompt=prompt + [5]))
check(code == 200 and r["choices"][0]["tokens"] == cont_want and
      r["usage"]["prompt_tokens_details"]["cached_tokens"] == imp["tokens"],
      "the imported session continues as the exported one, reusing its KV")
d.request("DELETE", "/v1/sessions/" + imp["id"])
d.stop()

# room for one static cache (and the streaming slots), not for a copy of it: its forks start in the
# host tier, with the tokens of the free daemon's
static_kv = STATIC["max_cache_len"] * KV_PER_TOKEN
d = Daemon("--device-mem", str(int(model_bytes + static_kv * 3 // 2)), model=model, tmp=probe.tmp).start()
code, r = d.post("/v1/completions", dict(req, n=3, cache=STATIC))
k = r.get("kvtier", {})
check(code == 200 and all(c["tokens"] == want for c in r["choices"]) and k["fallback"] == "offloaded" and
      k["bytes"]["host"] >= 2 * static_kv and k["prefetch"]["steps"] > 0,
      "static, n=3, room for one copy: the forked choices continue in the host tier (%s)" %
      (k or r["error"]["message"]))
check(metric(d, "kv_fallbacks_total", '{reason="sized"}') == 2, "/metrics counts each fork's fallback")
code, r = d.post("/v1/completions", dict(req, num_beams=3, cache=STATIC))
check(code == 200 and [c["tokens"] for c in r["choices"]] == beams_want and r["kvtier"]["fallback"] == "offloaded",
      "static, num_beams=3: the free daemon's beams, forks in the host tier")
code, e = d.post("/v1/completions", dict(req, n=3, cache=dict(STATIC, allow_offload=False)))
check(code == 507 and "device tier budget" in e["error"]["message"],
      "static, n=3, allow_offload=false: 507 naming the device budget: " + e["error"]["message"])
code, s = d.post("/v1/sessions", {"prompt": prompt, "cache": STATIC})
code, f = d.post("/v1/sessions/%s/fork" % s["id"], {})
check(code == 200 and f["strategy"] == "offloaded_static" and f["fallback"] == "offloaded",
      "POST /fork of a static session: the fork in the host tier (%s)" % f)
code, r = d.post("/v1/completions", dict(req, session=f.get("id"), prompt=prompt + [5]))
code2, r2 = d.post("/v1/completions", dict(req, session=s["id"], prompt=prompt + [5]))
check(code == code2 == 200 and r["choices"][0]["tokens"] == r2["choices"][0]["tokens"] == cont_want,
      "the fork and its parent continue alike")
for sid in (s["id"], f["id"]):
    d.request("DELETE", "/v1/sessions/" + sid)
d.stop()

# --host-mem too small for the request: 507 naming the host budget; sessions keep their KV
d = Daemon("--device-mem", str(budget), "--host-mem", str(kv // 4), model=model, tmp=probe.tmp).start()
code, e = d.post("/v1/completions", req)
check(code == 507 and "host tier budget" in e["error"]["message"],
      "host tier exhausted: 507 naming the budget: " + e["error"]["message"])
check(metric(d, "errors_total", '{kind="kv_memory"}') == 1, "/metrics counts the 507")
code, e = d.post("/v1/sessions", {"prompt": prompt})
check(code == 507 and d.get("/v1/sessions")[1]["data"] == [] and metric(d, "sessions") == 0,
      "a session whose prefix prefill fails is not kept (no --max-sessions slot held)")
code, s = d.post("/v1/sessions", {"prompt": prompt[:40]})
sid = s["id"]
held = s["tokens"]
check(code == 200 and held == 40 and s["bytes"]["device"] > 0 and s["strategy"] == "dynamic",
      "session prefilled on the device: %s" % s["bytes"])
code, e = d.post("/v1/completions", dict(req, session=sid, prompt=prompt))
check(code == 507, "a session turn that cannot fit: 507")
code, s2 = d.get("/v1/sessions/" + sid)
check(s2["tokens"] == held and not s2["busy"], "the session's KV is intact (%d tokens)" % s2["tokens"])
code, r = d.post("/v1/completions", dict(req, session=sid, prompt=prompt[:60], max_tokens=4))
check(code == 200 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == held,
      "the session continues from its KV after the 507")
# a turn that rewinds a session's history and needs the device room its old tail holds: the rewind
# frees the tail (in place), and the turn runs
turn = r["choices"][0]["tokens"]
code, s3 = d.get("/v1/sessions/" + sid)
code, r = d.post("/v1/completions", dict(req, session=sid, prompt=prompt[:30] + prompt[30:60][::-1], max_tokens=4))
check(code == 200 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 30,
      "an edited turn on a session in the host tier rewinds in place: 200, 30 tokens reused (%d)" %
      r["usage"]["prompt_tokens_details"]["cached_tokens"])
# in one batch with a request that fits, only the one that does not fit fails
out = {}
big = threading.Thread(target=lambda: out.update(big=d.post("/v1/completions", dict(req, max_tokens=40))))
small = threading.Thread(target=lambda: out.update(small=d.post("/v1/completions", dict(req, prompt=prompt[:20]))))
big.start()
small.start()
big.join(60)
small.join(60)
check(out["big"][0] == 507 and out["small"][0] == 200 and out["small"][1]["choices"][0]["tokens"] == small_want,
      "concurrent: the request that does not fit gets 507, the other its tokens")
check(d.stop() == 0, "stop")

# a turn that rewinds a session's history and then fails (here a step feeding the test's poisoned
# token fails as a backend fault) leaves the session as it was: the rewind ran on a fork of its KV
POISON = prompt[50]
d = Daemon(model=model, tmp=probe.tmp)
d.sock = probe.tmp + "/poison.sock"
d.start(extra_env={"KVTIER_TEST_FAIL_TOKEN": str(POISON)})
clean = [t for t in prompt if t != POISON]
code, s1 = d.post("/v1/sessions", {"prompt": clean[:40]})
sid = s1["id"]
code, e = d.post("/v1/completions", dict(req, session=sid, prompt=clean[:30] + [POISON] + clean[30:60]))
code2, s2 = d.get("/v1/sessions/" + sid)
check(code == 500 and s2["tokens"] == s1["tokens"] == 40 and s2["bytes"] == s1["bytes"],
      "an edited turn whose step fails: %d, the session as it was (%s tokens, %s)" % (code, s2["tokens"], s2["bytes"]))
code, r = d.post("/v1/completions", dict(req, session=sid, prompt=clean[:60], max_tokens=4))
code, want = d.post("/v1/completions", dict(req, prompt=clean[:60], max_tokens=4))
check(code == 200 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 40 and
      r["choices"][0]["tokens"] == want["choices"][0]["tokens"],
      "its KV is intact: the next turn reuses its 40 tokens (%d) with a fresh run's tokens" %
      r["usage"]["prompt_tokens_details"]["cached_tokens"])
held = clean[:60] + r["choices"][0]["tokens"]  # its last token has no KV yet
code, e = d.post("/v1/completions", dict(req, session=sid, prompt=held + [POISON], max_tokens=4))
code2, s3 = d.get("/v1/sessions/" + sid)
code3, r = d.post("/v1/completions", dict(req, session=sid, prompt=held, max_tokens=4))
check(code == 500 and s3["tokens"] == 63 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 63,
      "a turn that extends the history and fails keeps the history (%s tokens, the next turn reuses %d)" %
      (s3["tokens"], r["usage"]["prompt_tokens_details"]["cached_tokens"]))
check(d.stop() == 0, "stop")

# An edited turn on a session whose sliding window (every layer's, 16
# tokens) dropped what it would rewind to starts over in a fresh KV beside
# the old one, which it keeps to leave the session as it was should the
# turn fail.  Past recording, switched on after the first turn, keeps the
# states of the turns after it: a large old KV that cannot go back to the
# edit at token 60.  With room on the device for the old KV and not for
# the fresh one's streaming slots too, the old one moves to the host tier:
# the turn gets the tokens of the same prompt one-shot.
win = {"implementation": "dynamic", "window_length": 16}
P, edit = prompt[:70], prompt[:60] + prompt[200:205]
ref = Daemon(model=model, tmp=probe.tmp).start()
want_edit = ref.post_ok("/v1/completions", dict(req, max_tokens=30, prompt=edit, cache=win))["choices"][0]["tokens"]
ref.stop()
d = Daemon("--device-mem", str(int(model_bytes + 166 * KV_PER_TOKEN)), model=model, tmp=probe.tmp).start()
sid = d.post_ok("/v1/sessions", {"prompt": P, "cache": win})["id"]
held = P
for t in range(3):
    r = d.post_ok("/v1/completions", dict(req, max_tokens=30, session=sid, prompt=held))
    held = held + r["choices"][0]["tokens"] + prompt[100 + 40 * t:140 + 40 * t]
    if t == 0:
        check(d.post("/v1/sessions/%s/activate_past_recording" % sid, {})[0] == 200, "recording from the second turn")
info = d.get("/v1/sessions/" + sid)[1]
check(info["bytes"]["device"] > 120 * KV_PER_TOKEN and info["bytes"]["host"] == 0,
      "three turns: the session's KV on the device (%s)" % info["bytes"])
code, r = d.post("/v1/completions", dict(req, max_tokens=30, session=sid, prompt=edit))
check(code == 200 and r["choices"][0]["tokens"] == want_edit and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
      "an edited turn past what the window kept starts over beside the old KV, which moves to the host tier: the "
      "one-shot run's tokens (%d: %s)" % (code, r.get("error", {}).get("message", "")))
check(d.get("/v1/sessions/" + sid)[1]["tokens"] == len(edit) + 29, "the session holds the edited history")
check(d.stop() == 0, "stop")
