"""kvtierd with a state-space model (Mamba): greedy tokens of a prompt fed
in chunks cut at every checkpoint equal tools/torchref.py's; those of a session
reused over a diverging input, of a cropped session and of a fork equal a
fresh run's (each rewinds to a state checkpoint and feeds the rest);
the strategies that act on single tokens are refused with a 400 naming why,
by a request and by the creation of a session;
a sequence's state bytes are the same at 1k and 16k tokens; with the device
full, states go to the host tier (at creation, and an idle session's to
make room for a step, the next idle one when the least recently used
asked for no fallback) with unchanged tokens, and with a device budget below
one state every step streams it layer by layer with unchanged tokens (the disk tier:
tests/daemon_mamba_disk.py); a request sharing 85 tokens with an earlier
one starts from the shared checkpoint at 80 with the reference's tokens; a
session's state exported as a file equals the reference's states, and
imported (or the reference's states imported) continues with the same
tokens; the file's checkpoints equal the reference's states at 16, 32 and
48, an imported session reused or cropped goes back to them (a crop to 40
leaves the same state and checkpoints as cropping the exporting session,
the reference's state after 40 tokens), a file without them still
imports (and goes back to the zero state), and bad checkpoint fields are
refused naming them."""
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, mkmodel  # noqa: E402

d = Daemon("--checkpoint-interval", "16")
model = mkmodel(d.tmp + "/mamba", "--arch", "mamba", "--layers", "2", "--dim", "64")
d.model = model
d.start()
# what the daemon holds on the device with no sequence: activations (and,
# on a backend that cannot read the host's memory, the weights)
metrics = d.get("/metrics")[1].decode()
idle_bytes = int(float(metrics.split('kvtier_device_memory_bytes{kind="used"} ')[1].split()[0]))
prompt = [(i * 53 + 7) % 1900 + 50 for i in range(100)]
gen = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_tokens": True}


def complete(ids, **kw):
    return d.post_ok("/v1/completions", dict(gen, prompt=ids, **kw))


def session(**body):
    return d.post_ok("/v1/sessions", body)["id"]


def toks(r):
    return r["choices"][0]["tokens"]


# ---- the reference: a 100-token prompt, chunks cut at 16, 32, ... 96 ----------
fresh = complete(prompt)
sys.path.insert(0, "tools")
import torch  # noqa: E402
import torchref  # noqa: E402
torch.set_num_threads(1)
ref, ids = torchref.load_model(model), list(prompt)
with torch.no_grad():
    for _ in range(8):
        ids.append(int(ref(torch.tensor([ids]))[0, -1].argmax()))
check(toks(fresh) == ids[100:], "a prompt fed in chunks ending at each checkpoint: the reference's greedy tokens")

# ---- the prefix cache: two requests sharing 85 tokens ----------------------
def greedy(ids, n=8):
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids]))[0, -1].argmax()))
    return ids[-n:]


shared = [(i * 31 + 11) % 1900 + 50 for i in range(85)]
r1 = complete(shared + [7, 8, 9, 10, 11])
check(r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "prefix cache: the first request computes all")
r2 = complete(shared + [12, 13, 14])
cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
check(cached == 80, "prefix cache: the second starts from the shared checkpoint at 80, the last multiple of 16 "
                    "within the 85 shared tokens (cached_tokens %d)" % cached)
check(toks(r2) == greedy(shared + [12, 13, 14]) and toks(r1) == greedy(shared + [7, 8, 9, 10, 11]),
      "prefix cache: both give the reference's greedy tokens")

# ---- session reuse over a diverging input --------------------------------
sid = session(prompt=prompt[:60])
complete(prompt[:60], session=sid)
r = complete(prompt, session=sid)
cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
check(toks(r) == toks(fresh), "session reuse: the same tokens as a fresh run")
check(cached == 48, "session reuse: back to the checkpoint at 48, the last multiple of 16 within the 60 "
                   "common tokens (cached_tokens %d)" % cached)

# ---- crop: back to a checkpoint, the rest fed again ----------------------------
sid = session(prompt=prompt[:40])
r1 = complete(prompt[:40], session=sid)
code, c = d.post("/v1/sessions/%s/crop" % sid, {"n": -7})
check(code == 200 and c["tokens"] == 40, "crop -7 of 47: the session holds 40 tokens (%s)" % c.get("tokens"))
r2 = complete(prompt[:40], session=sid)
check(toks(r2) == toks(r1), "crop then regenerate == the first generation")
check(r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 32,
      "re-sending the 40 tokens goes back to the checkpoint at 32 (39 would be kept; cached_tokens %d)" %
      r2["usage"]["prompt_tokens_details"]["cached_tokens"])

# ---- fork --------------------------------------------------------------------
sid = session(prompt=prompt)
code, f = d.post("/v1/sessions/%s/fork" % sid, {})
check(code == 200 and f["tokens"] == 100, "fork: a new session holding the parent's 100 tokens")
a = complete(prompt + [21, 22], session=f["id"])
check(toks(a) == toks(complete(prompt + [21, 22])) and a["usage"]["prompt_tokens_details"]["cached_tokens"] == 100,
      "generating from a fork == a fresh run of the same text")
b = complete(prompt + [23], session=sid)
check(b["usage"]["prompt_tokens_details"]["cached_tokens"] == 100, "the parent is untouched by the fork's steps")
# a session cropped to nothing still forks (an empty state, no token ids to copy)
code, c = d.post("/v1/sessions/%s/crop" % sid, {"n": -1000})
code2, f0 = d.post("/v1/sessions/%s/fork" % sid, {})
check(code == 200 and c["tokens"] == 0 and code2 == 200 and f0["tokens"] == 0 and
      toks(complete(prompt, session=f0["id"])) == toks(complete(prompt)),
      "a session cropped to 0 tokens forks: an empty session that generates as a fresh run")

# ---- strategies that make no sense for a state ------------------------------
for cache, why in (({"implementation": "sliding_window", "window_length": 8}, "sliding_window"),
                   ({"implementation": "sink", "window_length": 8, "num_sink_tokens": 4}, "sink"),
                   ({"implementation": "quantized"}, "quantized")):
    code, e = d.post("/v1/completions", dict(gen, prompt=prompt[:10], cache=cache))
    msg = e.get("error", {}).get("message", "")
    check(code == 400 and msg.startswith(why) and "state" in msg, "%s -> 400: %s" % (why, msg[:90]))
    # an empty session would hold the choice until its first request
    param = e.get("error", {}).get("param")
    n_sessions = len(d.get("/v1/sessions")[1]["data"])
    code, e = d.post("/v1/sessions", {"cache": cache})
    err = e.get("error", {})
    check(code == 400 and err.get("message") == msg and err.get("param") == param and
          len(d.get("/v1/sessions")[1]["data"]) == n_sessions,
          "%s: a session is refused at creation with the same 400 (%d, param %s)" % (why, code, err.get("param")))

r = complete(prompt, cache={"implementation": "offloaded"})
check(toks(r) == toks(fresh) and r["kvtier"]["bytes"]["device"] == 0 and r["kvtier"]["bytes"]["host"] > 0,
      "offloaded: the state waits in the host tier between steps, the same tokens")

# ---- export and import: the state as a file ---------------------------------
import json  # noqa: E402
import struct  # noqa: E402


def parse(blob):
    """(metadata, {name: tensor}) of a safetensors file of F32 tensors."""
    (n,) = struct.unpack("<Q", blob[:8])
    h = json.loads(blob[8:8 + n])
    meta, data = h.pop("__metadata__"), blob[8 + n:]
    return meta, {k: torch.frombuffer(bytearray(data[v["data_offsets"][0]:v["data_offsets"][1]]),
                                      dtype=torch.float32).reshape(v["shape"]) for k, v in h.items() if
                  v["dtype"] == "F32"}


def build(meta, tensors):
    header, data = {"__metadata__": meta}, b""
    for name, t in tensors.items():
        raw = t.contiguous().to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw + b"\0" * ((-len(raw)) % 8)
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + data


def post_file(blob):
    return d.request("POST", "/v1/sessions/import", blob, {"Content-Type": "application/octet-stream"})


# a text no earlier request published checkpoints of: the session takes its own at 16, 32, 48
xp = [(i * 37 + 3) % 1900 + 50 for i in range(50)]
sid = session(prompt=xp)
code, blob = d.get("/v1/sessions/%s/kv" % sid)
meta, ts = parse(blob)
code_f, fk = d.post("/v1/sessions/%s/fork" % sid, {})  # the exporting session as it is, to crop later


def ref_states(n):
    with torch.no_grad():
        return ref.step(torch.tensor([xp[:n]]))[1]


def state_err(ts, states, pre=""):
    """Worst relative difference of ts's tensors named pre + conv_states.{l}
    and ssm_states.{l} from the reference's states."""
    return max(float((ts["%s%s.%d" % (pre, kind, l)] - st[i]).abs().max() / max(1.0, float(st[i].abs().max())))
               for l, st in enumerate(states) for i, kind in enumerate(("conv_states", "ssm_states")))


want_states = ref_states(50)
worst = state_err(ts, want_states)
check(code == 200 and meta.get("layout") == "state" and json.loads(meta["tokens"]) == xp and
      len(ts) == 16 and worst < 1e-4,
      "export: conv_states and ssm_states per layer equal torchref's states after the 50 tokens (worst %.2g)" % worst)
worst = max(state_err(ts, ref_states(p), "checkpoint.%d." % i) for i, p in enumerate((16, 32, 48)))
check(json.loads(meta.get("checkpoint_positions", "[]")) == [16, 32, 48] and worst < 1e-4,
      "export: checkpoint_positions [16, 32, 48] and checkpoint.{i}.conv_states/ssm_states equal torchref's states "
      "there (worst %.2g)" % worst)
more = xp + [5, 6, 7]
own = complete(more, session=sid)
code, imp = post_file(blob)
check(code == 201 and imp["tokens"] == 50, "import of the exported file -> 201, a session holding 50 tokens")
r = complete(more, session=imp["id"])
check(toks(r) == toks(own) == toks(complete(more)) and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 50,
      "the imported session continues with the exporting session's (and a fresh run's) tokens, 50 cached")
# a client that knows MambaCache's names only: no checkpoints
bare = {k: v for k, v in meta.items() if k != "checkpoint_positions"}
code, imp2 = post_file(build(bare, {"%s.%d" % (kind, l): st[i] for l, st in enumerate(want_states)
                                    for i, kind in enumerate(("conv_states", "ssm_states"))}))
r = complete(more, session=imp2["id"]) if code == 201 else {}
check(code == 201 and toks(r) == toks(own), "torchref's states imported (no checkpoints) continue with the same tokens")


def export(sid):
    code, blob = d.get("/v1/sessions/%s/kv" % sid)
    assert code == 200, (code, blob)
    return parse(blob)


def same_file(a, b):
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


# the checkpoints came back: the imported session exports the same file,
# and a reuse diverging at 40 goes back to the one at 32
code, imp3 = post_file(blob)
check(code == 201 and same_file(export(imp3["id"]), (meta, ts)),
      "an imported session exports the file it came from, checkpoints included")
div = xp[:40] + [9, 10, 11]
r = complete(div, session=imp3["id"])
check(toks(r) == toks(complete(div)) and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 32,
      "an imported session reused over an input diverging at 40 goes back to the imported checkpoint at 32, a fresh "
      "run's tokens (cached_tokens %d)" % r["usage"]["prompt_tokens_details"]["cached_tokens"])
code, imp4 = post_file(build(bare, {k: v for k, v in ts.items() if not k.startswith("checkpoint.")}))
r = complete(div, session=imp4["id"]) if code == 201 else {}
check(code == 201 and toks(r) == toks(complete(div)) and r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0,
      "the exported file without its checkpoints imports; its reuse goes back to the zero state (cached_tokens %s)" %
      r.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens"))

# crop to 40, between the checkpoints at 32 and 48: the imported session and
# the exporting one (its fork taken at the export) end the same
code, impc = post_file(blob)
orig = fk["id"]
for s in (impc["id"], orig):
    code, c = d.post("/v1/sessions/%s/crop" % s, {"n": 40})
    check(code == 200 and c["tokens"] == 40, "crop to 40: the session holds 40 tokens (%s)" % c.get("tokens"))
fa, fb = export(impc["id"]), export(orig)
worst = state_err(fa[1], ref_states(40))
check(same_file(fa, fb) and json.loads(fa[0]["checkpoint_positions"]) == [16, 32] and worst < 1e-4,
      "crop to 40: the imported session's state and checkpoints [16, 32] equal the exporting session's cropped the "
      "same way, and torchref's state after 40 tokens (worst %.2g)" % worst)
r = complete(div, session=impc["id"])
check(toks(r) == toks(complete(div, session=orig)) == toks(complete(div)),
      "crop to 40: the imported session continues with the exporting session's and a fresh run's tokens")

# bad checkpoint fields, refused naming them
for pos, tensors, field in (("[16,33,48]", ts, "checkpoint_positions[1]"),
                            ("[32,16,48]", ts, "checkpoint_positions[1]"),
                            ("[16,32,64]", ts, "checkpoint_positions[2]"),
                            ("[0,16,32]", ts, "checkpoint_positions[0]"),
                            ("[16,32,\"48\"]", ts, "checkpoint_positions[2]"),
                            ("{\"a\": 16}", ts, "checkpoint_positions"),
                            ("[16,32,48,64]", ts, "checkpoint_positions"),
                            ("[16,32]", ts, "checkpoint_positions"),
                            ("[16,32,48]", dict(ts, **{"checkpoint.1.ssm_states.0": ts["ssm_states.0"][:, :, :8]}),
                             "checkpoint.1.ssm_states.0"),
                            ("[16,32,48]", {k: v for k, v in ts.items() if k != "checkpoint.2.conv_states.1"},
                             "checkpoint_positions")):
    code, e = post_file(build(dict(meta, checkpoint_positions=pos), tensors))
    msg = e.get("error", {}).get("message", "") if isinstance(e, dict) else ""
    check(code == 400 and field in msg, "checkpoint_positions %s -> 400 naming %s (%d: %s)" % (pos, field, code, msg))
kv_meta = dict(meta)
del kv_meta["layout"]
code, e = post_file(build(kv_meta, {}))
check(code == 409 and e["error"]["param"] == "layout" and "state" in e["error"]["message"],
      "a file of K and V is refused naming the state layout (%d: %s)" % (code, e.get("error", {}).get("message")))
bad = dict(ts)
bad["ssm_states.1"] = bad["ssm_states.1"][:, :, :8]
code, e = post_file(build(meta, bad))
check(code == 400 and "ssm_states.1" in e.get("error", {}).get("message", ""),
      "a state of another shape is refused naming the tensor (%d: %s)" % (code, e.get("error", {}).get("message")))

# ---- constant state --------------------------------------------------------
sizes = []
for n in (1000, 16000):
    r = complete([(i * 31 + 5) % 1900 + 50 for i in range(n)], max_tokens=1)
    sizes.append(r["kvtier"]["bytes"]["device"])
state = 2 * 2 * (3 + 16) * 128 * 4  # two copies x 2 layers x (window + SSM state) x 128 channels, f32
check(sizes == [state, state], "the state's device bytes at 1k and 16k tokens: %s (%d each)" % (sizes, state))
check(d.stop() == 0, "stop")

# ---- out of device memory: states move to the host tier, tokens unchanged ----
# room for one sequence's state beside what an idle daemon holds
tight = Daemon("--device-mem", str(idle_bytes + state + 8192), model=model, tmp=d.tmp)
tight.sock = d.tmp + "/tight.sock"
tight.start()
d = tight
a = session(prompt=prompt[:30])
ra = complete(prompt[:30], session=a)
check(d.get("/v1/sessions/" + a)[1]["bytes"]["device"] == state, "session a's state is on the device")
rb = complete(prompt)
check(toks(rb) == toks(fresh) and rb["kvtier"]["fallback"] is not None,
      "a request with the device full of a's state: its state in the host tier (fallback %s), a fresh run's "
      "tokens" % rb["kvtier"]["fallback"])
sa = d.get("/v1/sessions/" + a)[1]
check(sa["bytes"]["device"] == 0 and sa["bytes"]["host"] == state // 2,
      "its step's streaming slots made idle a's state move to the host tier (%s)" % sa["bytes"])
ra2 = complete(prompt[:30] + toks(ra) + [5], session=a)
want = complete(prompt[:30] + toks(ra) + [5], cache={"implementation": "offloaded"})
check(toks(ra2) == toks(want), "a continues from the host tier with a fresh run's tokens")
check(d.stop() == 0, "stop")

# room for two states, no disk tier to wait for: the least recently used
# idle session asked for no fallback, so the next one's state moves instead
two = Daemon("--device-mem", str(idle_bytes + 2 * state + 8192), "--disk-dir", "none", model=model, tmp=d.tmp)
two.sock = d.tmp + "/two.sock"
two.start()
d = two
x = session(prompt=prompt[:30], cache={"implementation": "dynamic", "allow_offload": False})
complete(prompt[:30], session=x)
a = session(prompt=prompt[:30])
complete(prompt[:30], session=a)
check(all(d.get("/v1/sessions/" + s)[1]["bytes"]["device"] == state for s in (x, a)), "two idle states on the device")
code, rb = d.post("/v1/completions", dict(gen, prompt=prompt))
check(code == 200 and toks(rb) == toks(fresh) and d.get("/v1/sessions/" + x)[1]["bytes"]["device"] == state and
      d.get("/v1/sessions/" + a)[1]["bytes"]["device"] == 0,
      "the least recently used state may not move: the next one does, and the request gets a fresh run's tokens "
      "(%d)" % code)
check(d.stop() == 0, "stop")

# ---- a device budget below one state: it streams layer by layer -------------
# room for the two streaming slots (one layer's state each), not for the
# state's two whole copies: every step streams the state through the slots
small = Daemon("--device-mem", str(idle_bytes + state // 2 + 1024), model=model, tmp=d.tmp)
small.sock = d.tmp + "/small.sock"
small.start()
d = small
r = complete(prompt)
check(toks(r) == toks(fresh) and r["kvtier"]["bytes"]["device"] == 0 and r["kvtier"]["fallback"] is not None,
      "with less device memory than one state: the prompt (in chunks cut at each checkpoint) streams layer by "
      "layer with a fresh run's tokens (fallback %s)" % r["kvtier"]["fallback"])
sid = session(prompt=prompt[:40])
complete(prompt[:40], session=sid)
code, c = d.post("/v1/sessions/%s/crop" % sid, {"n": -7})
r2 = complete(prompt[:40], session=sid)
check(code == 200 and toks(r2) == toks(complete(prompt[:40])),
      "a streamed session cropped back to its checkpoint regenerates a fresh run's tokens")
check(d.stop() == 0, "stop")
