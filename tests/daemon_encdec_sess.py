"""kvtierd's encoder-decoder sessions (tiny random T5 and BART from
tools/mkmodel.py) forked and spilled to the disk tier, against
kvtier-encdec's greedy tokens (which tests/encdec.test.sh checks against
tools/torchref.py).

Fork: a session and its fork each continue with the tokens of a fresh run
of their decoder prompt; neither encodes the input again
(encoder_cached_tokens); the fork shares the cross-attention cache, so the
store's KV bytes (kvtier_kv_cache_bytes) do not grow by it (a static self
cache's extents are copied, the cross cache is not); deleting the parent
leaves the fork's cross cache in place, deleting the fork frees it.
Another session of the user's given the same input shares it too.  An
offloaded session keeps its input's cross cache in the host tier with its
self cache (each step streams both) and continues as a fresh run.

Disk: a session idle for --spill-after leaves memory (both caches), and its
next request, without an input, continues with the fresh run's tokens and
the never-spilled session's cached_tokens, encoding nothing (dynamic,
static, offloaded, quantized); a spilled session forks;
another input on a spilled session is encoded afresh; SIGTERM writes the
sessions, a restart lists them with their input and they continue; a file
whose data is damaged costs the session its caches, not its tokens (the
kept input is encoded again).  Export carries both caches and the input,
and an imported session continues as a fresh run, encoding nothing;
a quantized self cache (T5's and BART's) exports raw (its blocks as stored, the cross
cache dense) and imports back to the same file and tokens, a mismatched
raw file is a 400 naming the field; it does not fork (400)."""
import glob
import json
import os
import struct
import subprocess
import sys
import time

sys.path.insert(0, "tests")
from daemon_harness import BUILD, Daemon, check, metric, skip, wait_spilled  # noqa: E402
sys.path.insert(0, "tools")
import mkmodel  # noqa: E402

ENC = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 264, 33, 83, 279, 50, 288, 41, 97, 169, 39]
N = 6
gen = {"max_tokens": N, "temperature": 0, "ignore_eos": True, "return_tokens": True}
oracle = os.path.join(BUILD, "kvtier-encdec")
if not os.access(oracle, os.X_OK):
    skip(oracle + " not built")


def oracle_tokens(model, dec, enc=ENC):
    r = subprocess.run([oracle, "-m", model, "--enc", ",".join(map(str, enc)), "-n", str(N), "--dec",
                        ",".join(map(str, dec))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [int(t) for t in r.stdout.split()[0].split(",")]


def dev_bytes(d):
    return metric(d, "kv_cache_bytes", '{tier="device"}') + metric(d, "kv_cache_bytes", '{tier="host"}')


def rebuilt(blob, edit):
    """A KV file with its header edited in place (edit(header)), the data
    as it was."""
    (hlen,) = struct.unpack("<Q", blob[:8])
    h = json.loads(blob[8:8 + hlen])
    edit(h)
    text = json.dumps(h).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob[8 + hlen:]


def settle(d, want, timeout=10):
    """The store's KV bytes once they are want (a deleted session's KV is
    freed by the engine thread after the reply)."""
    end = time.time() + timeout
    while dev_bytes(d) != want and time.time() < end:
        time.sleep(0.05)
    return dev_bytes(d)


def run(name, args, dp):
    # an encoder cache of no bytes: a cross cache goes with its last session
    ref = Daemon("--disk-dir", "none", "--prefix-cache-mem", "1", model="made below")
    model = ref.model = ref.tmp + "/" + name
    mkmodel.main(["--out", model, "--seed", "5", "--layers", "2", "--dim", "64", "--heads", "4", "--ffn", "128",
                  "--vocab", "320", "--max-pos", "128"] + args)
    with open(model + "/config.json") as f:
        dp = dp or [json.load(f)["decoder_start_token_id"]]
    ref.start()
    d = Daemon("--spill-after", "1", model=model, tmp=ref.tmp)
    d.sock = os.path.join(ref.tmp, "disk.sock")
    d.start()

    def complete(dm, **kw):
        return dm.post_ok("/v1/completions", dict(gen, **kw))

    def raw_roundtrip(dm, sid, nxt, held):
        """A quantized self cache's raw export: its blocks as stored and the
        cross cache; the import exports the same file and continues with
        the original's tokens and logprobs; a file that does not match is
        a 400 naming the field or tensor.  Leaves sid fed with nxt."""
        code, blob = dm.get("/v1/sessions/%s/kv?raw=1" % sid)
        assert code == 200, (code, blob)
        (hlen,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8:8 + hlen])
        meta = header["__metadata__"]
        check(meta.get("layout") == "quantized" and json.loads(meta["encoder_input"]) == ENC and
              len(header) - 1 == 8 * 2 and all(header["past_key_values.%d.%s" % (l, c)]["shape"] == [1, 4, len(ENC), 16]
                                               for l in range(2) for c in ("cross_key", "cross_value")) and
              "past_key_values.0.key.qdata" in header,
              "%s: raw export of a quantized self cache -> its blocks as stored and the cross cache (%d tensors)" %
              (name, len(header) - 1))
        code, imp = dm.request("POST", "/v1/sessions/import", blob, {"Content-Type": "application/octet-stream"})
        check(code == 201 and imp["encoder"]["tokens"] == len(ENC) and imp["strategy"] == "quantized",
              "%s: raw import -> a quantized session holding the input (%s)" % (name, imp.get("strategy", imp)))
        code, again = dm.get("/v1/sessions/%s/kv?raw=1" % imp["id"])
        check(code == 200 and again == blob, "%s: the imported session exports the same raw file" % name)
        lp = dict(prompt=nxt, logprobs=2)
        ri, ro = complete(dm, session=imp["id"], **lp), complete(dm, session=sid, **lp)
        check(toks(ri) == toks(ro) and ri["choices"][0]["logprobs"] == ro["choices"][0]["logprobs"] and
              details(ri)["encoder_cached_tokens"] == len(ENC) and details(ri)["cached_tokens"] == len(held) - 1,
              "%s: the raw-imported session continues with the original's tokens and logprobs, %d cached, nothing "
              "encoded" % (name, details(ri)["cached_tokens"]))
        dm.request("DELETE", "/v1/sessions/" + imp["id"])

        bad = [("encoder_input", lambda h: h["__metadata__"].pop("encoder_input")),
               ("past_key_values.1.cross_value",
                lambda h: h["past_key_values.1.cross_value"].update(shape=[1, 4, len(ENC) - 1, 16])),
               ("tensors", lambda h: h.pop("past_key_values.0.cross_key"))]
        for field, edit in bad:
            code, e = dm.request("POST", "/v1/sessions/import", rebuilt(blob, edit),
                                 {"Content-Type": "application/octet-stream"})
            msg = e["error"]["message"] if code != 201 else ""
            check(code == 400 and field in msg, "%s: a raw file with %s changed -> 400: %s" % (name, field, msg[:90]))

    toks = lambda r: r["choices"][0]["tokens"]  # noqa: E731
    details = lambda r: r["usage"]["prompt_tokens_details"]  # noqa: E731
    want = oracle_tokens(model, dp)

    # ---- fork: both continue as fresh runs, the cross cache shared ----
    for cache in (None, {"implementation": "static", "max_cache_len": 64}):
        kind = cache["implementation"] if cache else "dynamic"
        base = dev_bytes(ref)
        sid = ref.post_ok("/v1/sessions", {"cache": cache} if cache else {})["id"]
        first = complete(ref, input=ENC, prompt=dp, session=sid)
        check(toks(first) == want, "%s %s: a session's first generation: kvtier-encdec's tokens" % (name, kind))
        before = dev_bytes(ref)
        parent = ref.get("/v1/sessions/" + sid)[1]
        code, fork = ref.post("/v1/sessions/%s/fork" % sid, {})
        check(code == 200 and fork["id"] != sid and fork["tokens"] == parent["tokens"] and
              fork["encoder"] == parent["encoder"] and fork["encoder"]["tokens"] == len(ENC),
              "%s %s: fork -> a new session with the parent's tokens and encoder input (%s)" %
              (name, kind, fork.get("encoder")))
        grown = dev_bytes(ref) - before
        # static: the self cache's extents are copied; dynamic: its blocks shared
        own = parent["bytes"]["device"] + parent["bytes"]["host"] if cache else 0
        check(grown == own and parent["encoder"]["bytes"]["device"] > 0,
              "%s %s: the fork adds %d KV bytes (its own self cache: %d), not the %d of the cross cache" %
              (name, kind, grown, own, parent["encoder"]["bytes"]["device"]))
        held = dp + toks(first)
        if cache:  # a request the static self cache cannot hold, with a new input: refused before the input
            code, e = ref.post("/v1/completions", dict(gen, input=ENC[:10], prompt=held, max_tokens=64, session=sid))
            after = ref.get("/v1/sessions/" + sid)[1]
            check(code == 400 and e["error"]["param"] == "cache.max_cache_len" and after["tokens"] == parent["tokens"]
                  and after["encoder"]["tokens"] == len(ENC),
                  "%s static: a request past max_cache_len with a new input -> 400, the session's input and tokens "
                  "untouched" % name)
        for i, s in enumerate((sid, fork["id"])):
            nxt = held + [100 + 7 * i]
            r = complete(ref, prompt=nxt, session=s)
            check(toks(r) == oracle_tokens(model, nxt) and details(r)["encoder_cached_tokens"] == len(ENC) and
                  details(r)["cached_tokens"] == len(held) - 1,
                  "%s %s: the %s continues with a fresh run's tokens, %d encoder tokens not recomputed, %d cached" %
                  (name, kind, ("parent", "fork")[i], len(ENC), details(r)["cached_tokens"]))
        code, _ = ref.request("DELETE", "/v1/sessions/" + sid)
        nxt = held + [200]
        r = complete(ref, prompt=nxt, session=fork["id"])
        check(code == 200 and toks(r) == oracle_tokens(model, nxt) and
              details(r)["encoder_cached_tokens"] == len(ENC),
              "%s %s: the parent deleted, the fork still reads the shared cross cache" % (name, kind))
        ref.request("DELETE", "/v1/sessions/" + fork["id"])
        left = settle(ref, base)
        check(left == base, "%s %s: the last session deleted frees the cross cache (%d KV bytes left)" %
              (name, kind, left))

    # two sessions of one user given the same input: one cross cache serves both
    base = dev_bytes(ref)
    one, two = ref.post_ok("/v1/sessions", {})["id"], ref.post_ok("/v1/sessions", {})["id"]
    complete(ref, input=ENC, prompt=dp, session=one)
    mid = dev_bytes(ref)
    r = complete(ref, input=ENC, prompt=dp, session=two)
    self_bytes = ref.get("/v1/sessions/" + two)[1]["bytes"]["device"]
    check(toks(r) == want and details(r)["encoder_cached_tokens"] == len(ENC) and
          dev_bytes(ref) - mid == self_bytes > 0,
          "%s: another session given the same input encodes nothing (%d encoder tokens cached) and adds only its "
          "decoder cache (%d bytes)" % (name, details(r)["encoder_cached_tokens"], self_bytes))
    for sid in (one, two):
        ref.request("DELETE", "/v1/sessions/" + sid)
    settle(ref, base)

    # ---- offloaded: the input's cross cache in the host tier too, streamed ----
    other = ENC[::-1]  # an input no other session holds
    sid = ref.post_ok("/v1/sessions", {"cache": {"implementation": "offloaded"}})["id"]
    r = complete(ref, input=other, prompt=dp, session=sid)
    s = ref.get("/v1/sessions/" + sid)[1]
    check(toks(r) == oracle_tokens(model, dp, other) and s["bytes"]["device"] == 0 and
          s["encoder"]["bytes"]["device"] == 0 and s["encoder"]["bytes"]["host"] > 0,
          "%s offloaded: a fresh run's tokens, both caches in the host tier (%s)" % (name, s["encoder"]))
    nxt = dp + toks(r) + [5]
    r = complete(ref, prompt=nxt, session=sid)
    check(toks(r) == oracle_tokens(model, nxt, other) and details(r)["encoder_cached_tokens"] == len(other),
          "%s offloaded: the session continues with a fresh run's tokens, nothing encoded" % name)
    ref.request("DELETE", "/v1/sessions/" + sid)
    settle(ref, base)

    # ---- disk: spilled with both caches, restored without encoding ----
    caches = [("dynamic", None), ("static", {"implementation": "static", "max_cache_len": 64}),
              ("offloaded", {"implementation": "offloaded"}),
              ("quantized", {"implementation": "quantized", "nbits": 4, "residual_length": 4})]
    sess = {}
    for kind, cache in caches:
        body = {"cache": cache} if cache else {}
        a, b = ref.post_ok("/v1/sessions", body)["id"], d.post_ok("/v1/sessions", body)["id"]
        ra, rb = complete(ref, input=ENC, prompt=dp, session=a), complete(d, input=ENC, prompt=dp, session=b)
        check(toks(ra) == toks(rb), "%s %s: the same tokens before any spill" % (name, kind))
        sess[kind] = (a, b, dp + toks(rb))
    restores = metric(d, "session_restores_total")
    for kind, (a, b, held) in sess.items():
        s = wait_spilled(d, b)
        nxt = held + [77]
        ra, rb = complete(ref, prompt=nxt, session=a), complete(d, prompt=nxt, session=b)
        w = oracle_tokens(model, nxt) if kind != "quantized" else toks(ra)
        check(toks(rb) == w and details(rb)["encoder_cached_tokens"] == len(ENC) and
              details(rb)["cached_tokens"] == details(ra)["cached_tokens"] > 0,
              "%s %s: spilled (%d bytes on disk), restored, continued with %s tokens, %d cached, the input not "
              "encoded again" % (name, kind, s["bytes"]["disk"], "a fresh run's" if kind != "quantized"
                                 else "the never-spilled session's", details(rb)["cached_tokens"]))
        sess[kind] = (a, b, nxt + toks(rb))
    end = time.time() + 20  # a restore is counted when its read ends, which can be after the reply
    while metric(d, "session_restores_total") - restores < len(caches) and time.time() < end:
        time.sleep(0.1)
    check(metric(d, "session_restores_total") - restores == len(caches),
          "%s: /metrics counts the %d restores" % (name, len(caches)))

    # a spilled session forks: both continue, sharing the restored cross cache
    a, b, held = sess["dynamic"]
    wait_spilled(d, b)
    code, fork = d.post("/v1/sessions/%s/fork" % b, {})
    check(code == 200 and fork["encoder"]["tokens"] == len(ENC), "%s: a spilled session forks" % name)
    for s in (b, fork["id"]):
        nxt = held + [150]
        r = complete(d, prompt=nxt, session=s)
        check(toks(r) == oracle_tokens(model, nxt) and details(r)["encoder_cached_tokens"] == len(ENC),
              "%s: the spilled session's %s continues with a fresh run's tokens" %
              (name, "fork" if s != b else "parent"))
    d.request("DELETE", "/v1/sessions/" + fork["id"])
    complete(ref, prompt=held + [150], session=a)
    sess["dynamic"] = (a, b, held + [150] + toks(r))

    # another input on a spilled session: encoded afresh
    a, b, held = sess["static"]
    wait_spilled(d, b)
    other = ENC[::-1]
    r = complete(d, input=other, prompt=dp, session=b)
    check(toks(r) == oracle_tokens(model, dp, other) and details(r)["encoder_cached_tokens"] == 0,
          "%s: another input on a spilled session: encoded afresh, a fresh run's tokens" % name)
    del sess["static"]

    # ---- export and import: both caches and the input travel in the file ----
    for kind, (a, b, held) in sess.items():
        if kind not in ("dynamic", "quantized"):
            continue
        code, blob = d.get("/v1/sessions/%s/kv" % b)
        assert code == 200, (code, blob)
        (hlen,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8:8 + hlen])
        meta = header.pop("__metadata__")
        shapes = {k: v["shape"] for k, v in header.items()}
        L, H = 2, 4
        check(json.loads(meta["encoder_input"]) == ENC and len(shapes) == 4 * L and
              all(shapes["past_key_values.%d.cross_key" % l] == shapes["past_key_values.%d.cross_value" % l] ==
                  [1, H, len(ENC), 16] for l in range(L)),
              "%s %s: export -> the self and cross K and V of %d layers and the encoder input" % (name, kind, L))
        code, imp = d.request("POST", "/v1/sessions/import", blob, {"Content-Type": "application/octet-stream"})
        check(code == 201 and imp["encoder"]["tokens"] == len(ENC),
              "%s %s: import -> a new session holding the input (%s)" % (name, kind, imp.get("encoder", imp)))
        nxt = held + [33]
        r = complete(d, prompt=nxt, session=imp["id"])
        w = oracle_tokens(model, nxt) if kind != "quantized" else toks(complete(ref, prompt=nxt, session=a))
        check(toks(r) == w and details(r)["encoder_cached_tokens"] == len(ENC) and
              details(r)["cached_tokens"] == len(held) - 1,
              "%s %s: the imported session continues with %s tokens, %d cached, nothing encoded" %
              (name, kind, "a fresh run's" if kind != "quantized" else "the original's", details(r)["cached_tokens"]))
        if kind == "quantized":
            raw_roundtrip(d, b, nxt, held)
            code, e = d.post("/v1/sessions/%s/fork" % b, {})
            check(code == 400 and "quantized" in e["error"]["message"],
                  "%s: fork of a quantized self cache -> 400: %s" % (name, e["error"]["message"][:80]))
        d.request("DELETE", "/v1/sessions/" + imp["id"])
        if kind == "quantized":
            sess[kind] = (a, b, nxt + toks(r))

    # ---- restart: SIGTERM writes the sessions, the next daemon lists and continues them ----
    check(d.stop() == 0, "%s: SIGTERM: clean exit" % name)
    d.start()
    listed = {s["id"]: s for s in d.get("/v1/sessions")[1]["data"]}
    check(all(b in listed and listed[b]["bytes"]["disk"] > 0 and listed[b]["encoder"]["tokens"] == len(ENC)
              for _, b, _ in sess.values()), "%s: after a restart the sessions are listed with their input" % name)
    udir = os.path.join(d.sock + ".disk", "u%d" % os.getuid())
    _, victim, _ = sess.pop("offloaded")
    d.stop()
    path = os.path.join(udir, victim + ".kvt")
    with open(path, "rb") as f:
        blob = f.read()
    # the data starts on the first 4 KiB page after the meta (tiers/disk.c)
    meta = blob.index(b'{"kvtier_session"')
    at = (blob.index(b"\0", meta) + 4095) // 4096 * 4096 + 64
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes([blob[at] ^ 0x5A]))
    d.start()
    # first, while no session holds that input's cache in memory: the
    # encoder cache wrote it at the first exit
    r = complete(d, prompt=dp, session=victim)
    check(toks(r) == want and details(r)["encoder_cached_tokens"] == len(ENC) and
          glob.glob(os.path.join(d.sock + ".disk", "quarantine", "*")),
          "%s: a damaged file is quarantined; its session reads its input's cross cache from the encoder cache on "
          "disk, a fresh run's tokens" % name)
    for kind, (a, b, held) in sess.items():
        nxt = held + [91]
        ra, rb = complete(ref, prompt=nxt, session=a), complete(d, prompt=nxt, session=b)
        w = oracle_tokens(model, nxt) if kind != "quantized" else toks(ra)
        check(toks(rb) == w and details(rb)["encoder_cached_tokens"] == len(ENC) and
              details(rb)["cached_tokens"] == details(ra)["cached_tokens"] > 0,
              "%s %s: after the restart the session continues with the same tokens, %d cached, nothing encoded" %
              (name, kind, details(rb)["cached_tokens"]))
    check(ref.stop() == 0 and d.stop() == 0, "%s: both daemons exit cleanly" % name)

    # ---- a quantized self cache over bf16 KV: the raw file's residual is
    # bf16, its cross K and V f32, and both come back as they were ----
    bd = Daemon("--disk-dir", "none", "--kv-dtype", "bf16", model=model, tmp=ref.tmp)
    bd.sock = os.path.join(ref.tmp, "bf16.sock")
    bd.start()
    sid = bd.post_ok("/v1/sessions", {"cache": {"implementation": "quantized", "nbits": 4, "residual_length": 4}})["id"]
    held = dp + toks(complete(bd, input=ENC, prompt=dp, session=sid))
    raw_roundtrip(bd, sid, held + [33], held)
    check(bd.stop() == 0, "%s: the bf16 daemon exits cleanly" % name)
    ref.cleanup()


run("t5", ["--arch", "t5", "--ffn-kind", "gated-gelu", "--tie", "--buckets", "16", "--max-distance", "12"],
    [0, 17, 230, 91, 150])
run("bart", ["--arch", "bart", "--tie"], None)
