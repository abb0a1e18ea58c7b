"""kvtierd KV export and import against PyTorch: GET /v1/sessions/{id}/kv
of a session equals tools/torchref.py's past_key_values for the same
prompt, layer by layer (a Mistral with sliding layers: their last W-1 rows,
as HF's DynamicSlidingWindowLayer keeps them); a file built here from the
torch reference's KV and the prompt, imported with POST
/v1/sessions/import, continues greedily with the tokens of a session that
computed the prompt itself (and the request reuses the KV: cached_tokens);
an export re-imported is byte for byte the same file; broken files (another
model's fingerprint, wrong shapes, truncated, a huge header length, more
tokens than the context, extra tensors) are 4xx naming the field, never 5xx.
?raw=1 is the same file on a dense session; on quantized ones (quanto,
hqq per channel, fp8) the stored form, dequantized by the rule docs/api.md
gives, equals the default export bit for bit.
The file is parsed here with a small reader: no safetensors package."""
import json
import math
import os
import struct
import subprocess
import sys

sys.path.insert(0, "tests")
sys.path.insert(0, "tools")
from daemon_harness import Daemon, check, skip  # noqa: E402

try:
    import torch
    import torchref
except ImportError as e:  # torch missing: the reference cannot run
    skip("torch: %s" % e)

CTX = 256
WINDOW = 8


def make_model(tmp):
    out = os.path.join(tmp, "model")
    r = subprocess.run(["/usr/bin/python3", "tools/mkmodel.py", "--arch", "mistral", "--layers", "2", "--dim", "64",
                        "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "2048", "--window",
                        str(WINDOW), "--tokenizer-from", "model/builtin", "--out", out], capture_output=True,
                       text=True)
    if r.returncode != 0:
        skip("mkmodel failed: " + r.stderr[-300:])
    return out


def parse(blob):
    """(metadata, {name: (dtype, shape, bytes)}) of a safetensors file."""
    (n,) = struct.unpack("<Q", blob[:8])
    h = json.loads(blob[8:8 + n])
    meta = h.pop("__metadata__")
    data = blob[8 + n:]
    return meta, {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in h.items()}


def tensor(dtype, shape, raw):
    assert dtype == "F32", dtype
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)


def build(meta, tensors):
    """A safetensors file: tensors {name: torch f32}, 8-byte aligned."""
    header, data, off = {"__metadata__": meta}, b"", 0
    for name, t in tensors.items():
        raw = t.contiguous().to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        pad = (-len(raw)) % 8
        data += raw + b"\0" * pad
        off += len(raw) + pad
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + data


def torch_kv(model, ids):
    """past_key_values of the torch reference: per layer (K, V) [1, Hkv, T, hd],
    K after RoPE; sliding layers cut to their last W-1 rows."""
    kv = []

    def hook(attn, args, out):
        x, ropes, _ = args
        cos, sin = ropes[attn.rope]
        b, t, _ = x.shape
        k = attn.k_proj(x).view(b, t, attn.n_kv, attn.hd)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        k = torchref.apply_rope(k.transpose(1, 2), cos, sin)
        v = attn.v_proj(x).view(b, t, attn.n_kv, attn.hd).transpose(1, 2)
        if attn.window:
            k, v = k[:, :, -(attn.window - 1):], v[:, :, -(attn.window - 1):]
        kv.append((k.detach(), v.detach()))

    hs = [layer.self_attn.register_forward_hook(hook) for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hs:
        h.remove()
    return kv


d = Daemon("--ctx-size", str(CTX))
d.model = make_model(d.tmp)
d.start()
ref = torchref.load_model(d.model)
prompt = [(i * 53 + 7) % 1900 + 50 for i in range(40)]
gen = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_tokens": True}

code, s = d.post("/v1/sessions", {"prompt": prompt})
check(code == 200 and s["tokens"] == len(prompt), "a session holds the prompt's KV")
code, blob = d.get("/v1/sessions/%s/kv" % s["id"])
check(code == 200 and isinstance(blob, bytes), "GET /v1/sessions/{id}/kv returns the file")
meta, ts = parse(blob)
check(meta["format"] == "kvtier-kv" and meta["version"] == "1" and json.loads(meta["tokens"]) == prompt and
      meta["strategy"] == "dynamic" and meta["dtype"] == "f32" and len(meta["model_fingerprint"]) == 16,
      "metadata: format, version, tokens, strategy, dtype, model_fingerprint")
check(all(isinstance(v, str) for v in meta.values()), "every metadata value is a string")
(hlen,) = struct.unpack("<Q", blob[:8])
check((8 + hlen) % 8 == 0, "the data starts 8-byte aligned")

kv = torch_kv(ref, prompt)
worst = 0.0
for l, (k, v) in enumerate(kv):
    for half, want in (("key", k), ("value", v)):
        dt, shape, raw = ts["past_key_values.%d.%s" % (l, half)]
        check(shape == list(want.shape), "layer %d %s: shape %s (sliding: W-1 rows)" % (l, half, shape))
        got = tensor(dt, shape, raw)
        err = (got - want).abs().max().item() / max(1e-6, want.abs().max().item())
        worst = max(worst, err)
check(worst < 1e-4, "every layer's key and value equal torch's past_key_values (worst relative error %.2e)" % worst)

# A continuation from the session itself: the tokens an import must give.
# The next request sends the prompt and one more token, as a chat's next
# turn does: on a sliding model the held KV cannot be cropped, so the
# request must extend it to reuse it.
more = prompt + [77]
code, own = d.post("/v1/completions", dict(gen, prompt=more, session=s["id"]))
assert code == 200, own
want_toks = own["choices"][0]["tokens"]

fp = meta["model_fingerprint"]
base_meta = {"format": "kvtier-kv", "version": "1", "model_fingerprint": fp, "tokens": json.dumps(prompt),
             "strategy": "dynamic", "dtype": "f32"}
tensors = {}
for l, (k, v) in enumerate(kv):
    tensors["past_key_values.%d.key" % l] = k
    tensors["past_key_values.%d.value" % l] = v
code, imp = d.request("POST", "/v1/sessions/import", build(base_meta, tensors),
                      {"Content-Type": "application/octet-stream"})
check(code == 201 and imp["tokens"] == len(prompt) and imp["strategy"] == "dynamic",
      "POST /v1/sessions/import of torch's KV -> 201, a dynamic session holding the prompt")
code, cont = d.post("/v1/completions", dict(gen, prompt=more, session=imp["id"]))
check(code == 200 and cont["choices"][0]["tokens"] == want_toks,
      "the imported session continues with the tokens of one that computed the prompt")
check(cont["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) ==
      own["usage"]["prompt_tokens_details"]["cached_tokens"], "the request reuses the imported KV: cached_tokens %d"
      % cont["usage"]["prompt_tokens_details"]["cached_tokens"])

# export -> import -> export is the same file (tokens and KV)
code, s2 = d.post("/v1/sessions", {"prompt": prompt})
code, blob2 = d.get("/v1/sessions/%s/kv" % s2["id"])
code, imp2 = d.request("POST", "/v1/sessions/import", blob2, {"Content-Type": "application/octet-stream"})
code, blob3 = d.get("/v1/sessions/%s/kv" % imp2["id"])
check(code == 200 and blob3 == blob2, "an export re-imported exports the same bytes")

# owner checks
code, e = d.get("/v1/sessions/sess-0000000000000000/kv")
check(code == 404, "GET kv of an unknown session -> 404")


def refused(blob, what, want_code=(400,), field=None):
    code, e = d.request("POST", "/v1/sessions/import", blob, {"Content-Type": "application/octet-stream"})
    msg = json.dumps(e) if not isinstance(e, bytes) else e.decode(errors="replace")
    # the file is the body: a 400 says so in param, its message names the part
    param = e.get("error", {}).get("param") if isinstance(e, dict) else None
    check(code in want_code and (field is None or field in msg) and (code != 400 or param == "body"),
          "%s -> %d naming %s (param %s)" % (what, code, field, param))


bad = dict(base_meta, model_fingerprint="0123456789abcdef")
refused(build(bad, tensors), "another model's fingerprint", (409,), "model_fingerprint")
t2 = dict(tensors)
t2["past_key_values.0.key"] = tensors["past_key_values.0.key"][:, :, :-1]
refused(build(base_meta, t2), "a layer with a row too few", (400,), "past_key_values.0.key")
t3 = dict(tensors)
t3["past_key_values.1.value"] = torch.zeros(1, 2, 7, 8)
refused(build(base_meta, t3), "a wrong head_dim", (400,), "past_key_values.1.value")
good = build(base_meta, tensors)
refused(good[:-5], "a truncated file", (400,), "past_key_values")
refused(good[:6], "a file shorter than its header length", (400,), "truncated")
refused(struct.pack("<Q", 1 << 62) + good[8:], "a huge header length", (400,), "header length")
many = dict(base_meta, tokens=json.dumps([5] * CTX))
refused(build(many, tensors), "more tokens than the context", (400,), "allows at most %d" % (CTX - 1))
t4 = dict(tensors)
t4["extra"] = torch.zeros(1)
refused(build(base_meta, t4), "an extra tensor", (400,), "tensors")
refused(build(dict(base_meta, format="other"), tensors), "another format", (400,), "format")
refused(build(dict(base_meta, tokens="[1, -3]"), tensors), "a negative token id", (400,), "tokens")
refused(b"", "an empty body", (400,), "truncated")
# NaN, infinity, or finite but beyond +-1e9 (3e38 overflows the first dot
# product: every later token would be garbage); -1e9 itself is in
for bad_value in (float("nan"), float("inf"), 3e38, -2e9):
    t5 = dict(tensors)
    t5["past_key_values.1.key"] = tensors["past_key_values.1.key"].clone()
    t5["past_key_values.1.key"][0, 1, 3, 5] = bad_value
    refused(build(base_meta, t5), "a key that is %s" % bad_value, (400,), "past_key_values.1.key")
t5 = dict(tensors)
t5["past_key_values.0.value"] = tensors["past_key_values.0.value"].clone()
t5["past_key_values.0.value"][0, 0, 0, 0] = -1e9
code, edge = d.request("POST", "/v1/sessions/import", build(base_meta, t5),
                       {"Content-Type": "application/octet-stream"})
check(code == 201 and d.request("DELETE", "/v1/sessions/" + edge["id"])[0] == 200,
      "a value of -1e9, the bound, is imported")
code = d.raw(b"POST /v1/sessions/import HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (1 << 40) + b"\0" * 64)
check(code == 413, "a body over the KV size cap -> 413")
code, lst = d.get("/v1/sessions")
check(code == 200 and len(lst["data"]) == 4, "failed imports leave no session behind")
code, _ = d.get("/health")
check(code == 200, "the daemon is alive")

# the CLI: kvtier session export ID FILE, kvtier session import FILE
kvtier = os.path.join(os.environ.get("KVTIER_BUILD", "build"), "kvtier")
f = os.path.join(d.tmp, "s.safetensors")
r = subprocess.run([kvtier, "--socket", d.sock, "session", "export", s2["id"], f], capture_output=True, text=True)
check(r.returncode == 0 and open(f, "rb").read() == blob2, "kvtier session export writes the file")
r = subprocess.run([kvtier, "--socket", d.sock, "session", "import", f], capture_output=True, text=True)
new_id = r.stdout.strip()
code, got = d.get("/v1/sessions/" + new_id)
check(r.returncode == 0 and code == 200 and got["tokens"] == len(prompt), "kvtier session import prints the new id")
r = subprocess.run([kvtier, "--socket", d.sock, "session", "import", os.path.join(d.tmp, "missing")],
                   capture_output=True, text=True)
check(r.returncode == 2, "kvtier session import of a missing file -> exit 2")
# a device has no size: read whole, /dev/zero would grow without end
r = subprocess.run([kvtier, "--socket", d.sock, "session", "import", "/dev/zero"], capture_output=True, text=True,
                   timeout=30)
check(r.returncode == 2 and "not a regular file" in r.stderr, "kvtier session import /dev/zero -> exit 2 at once")

# ?raw=1 on a quantized session: the stored form.  Dequantized by the rule
# docs/api.md gives (the function below is that snippet), it equals the
# default (dequantized) export bit for bit; on a dense session raw=1 is the
# same file as without.
code, rawd = d.get("/v1/sessions/%s/kv?raw=1" % s2["id"])
check(code == 200 and rawd == blob2, "raw=1 on a dense session is the dense export")


# e4m3 (float8_e4m3fn) byte -> value: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7f, 0xff NaN
E4M3 = torch.tensor([(-1.0 if b & 0x80 else 1.0) *
                     (float("nan") if b & 0x7f == 0x7f else
                      (b & 7) / 8 * 2.0 ** -6 if not (b >> 3) & 15 else (1 + (b & 7) / 8) * 2.0 ** (((b >> 3) & 15) - 7))
                     for b in range(256)], dtype=torch.float32)


def dequantize(meta, tensor):
    """The documented rule: per layer (K, V) [1, H, rows, D] f32, the rows
    of the dequantized export."""
    q = json.loads(meta["quantization"])
    T = int(meta["q_block_tokens"])
    out = []
    for l, (lo, nq, first) in enumerate(json.loads(meta["q_layers"])):
        kv = []
        for half in ("key", "value"):
            p = "past_key_values.%d.%s" % (l, half)
            codes = tensor(p + ".qdata")                       # [B, H, T, D*nbits/8] uint8
            res = tensor(p)                                    # [1, H, rows after nq, D]
            B, H, D = codes.shape[0], codes.shape[1], res.shape[3]
            if q["backend"] == "fp8":
                x = E4M3[codes.long()] * tensor(p + ".qscale")   # or codes.view(torch.float8_e4m3fn)
            else:
                nbits = q["nbits"]
                bits = (codes.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1   # little-endian bits
                c = (bits.reshape(B, H, T, D, nbits).int() << torch.arange(nbits)).sum(-1).float()
                pr = tensor(p + ".qparams").float()            # [B, H, T/gt, D/gd, (scale, shift|zero)]
                gt, gd = T // pr.shape[2], D // pr.shape[3]
                sc = pr[..., 0].repeat_interleave(gt, 2).repeat_interleave(gd, 3)
                z = pr[..., 1].repeat_interleave(gt, 2).repeat_interleave(gd, 3)
                x = c * sc - z if q["backend"] == "quanto" else (c - z) * sc
            x = x.permute(1, 0, 2, 3).reshape(1, H, B * T, D)[:, :, lo - first * T:nq - first * T]
            kv.append(torch.cat([x, res], dim=2))
        out.append(kv)
    return out


TDT = {"F32": torch.float32, "F16": torch.float16, "U8": torch.uint8}


def raw_tensor(ts):
    def get(name):
        dt, shape, raw = ts[name]
        flat = torch.frombuffer(bytearray(raw), dtype=TDT[dt]) if raw else torch.empty(0, dtype=TDT[dt])
        return flat.reshape(shape)
    return get


raw_files = {}
qcaches = [
    {"implementation": "quantized", "backend": "quanto", "nbits": 4, "q_group_size": 16, "residual_length": 8},
    {"implementation": "quantized", "backend": "hqq", "nbits": 2, "axis_key": 0, "axis_value": 1,
     "q_group_size": 16, "residual_length": 4},
    {"implementation": "quantized", "backend": "fp8"},
]
for cache in qcaches:
    what = cache["backend"]
    code, qs = d.post("/v1/sessions", {"prompt": prompt, "cache": cache})
    check(code == 200 and qs["strategy"] == "quantized", "%s: a quantized session" % what)
    code, deq = d.get("/v1/sessions/%s/kv" % qs["id"])
    code2, raw = d.get("/v1/sessions/%s/kv?raw=1" % qs["id"])
    check(code == 200 and code2 == 200 and raw != deq, "%s: raw=1 answers the stored form" % what)
    rmeta, rts = parse(raw)
    dmeta, dts = parse(deq)
    qmeta = json.loads(rmeta["quantization"])
    check(rmeta["layout"] == "quantized" and json.loads(rmeta["tokens"]) == prompt and
          all(qmeta.get(k) == v for k, v in cache.items()) and all(isinstance(v, str) for v in rmeta.values()),
          "%s: raw metadata names the quantization %s" % (what, rmeta["quantization"]))
    # the positions attention does not read are zeros, not whatever the
    # block's memory held before
    stale = 0
    for l, (lo, nq, first) in enumerate(json.loads(rmeta["q_layers"])):
        codes = raw_tensor(rts)("past_key_values.%d.key.qdata" % l)
        T = codes.shape[2]
        for b in range(codes.shape[0]):
            for t in range(T):
                if not lo <= (first + b) * T + t < nq:
                    stale += int(codes[b, :, t].count_nonzero())
    check(stale == 0, "%s: the raw export's unread rows are zeros (%d stale bytes)" % (what, stale))
    got = dequantize(rmeta, raw_tensor(rts))
    same = True
    for l, kv2 in enumerate(got):
        for half, x in zip(("key", "value"), kv2):
            want = raw_tensor(dts)("past_key_values.%d.%s" % (l, half))
            same = same and list(x.shape) == list(want.shape) and torch.equal(x, want)
    check(same, "%s: the raw form dequantized by the documented rule equals the dequantized export bit for bit"
          % what)

    # the raw form imported: the same cache, the same stored bytes, the
    # same continuation as the original session
    code, qi = d.request("POST", "/v1/sessions/import", raw, {"Content-Type": "application/octet-stream"})
    check(code == 201 and qi["strategy"] == "quantized" and qi["tokens"] == len(prompt),
          "%s: the raw file imports into a quantized session (%d %s)" % (what, code, qi))
    code, raw2 = d.get("/v1/sessions/%s/kv?raw=1" % qi["id"])
    check(code == 200 and raw2 == raw, "%s: the imported session exports the same raw bytes" % what)
    code, q_own = d.post("/v1/completions", dict(gen, prompt=more, session=qs["id"]))
    code2, q_imp = d.post("/v1/completions", dict(gen, prompt=more, session=qi["id"]))
    check(code == 200 and code2 == 200 and q_imp["choices"][0]["tokens"] == q_own["choices"][0]["tokens"],
          "%s: the imported session continues with the original's tokens" % what)
    cached = [x["usage"]["prompt_tokens_details"]["cached_tokens"] for x in (q_own, q_imp)]
    check(cached[0] == cached[1] == len(prompt), "%s: both reuse the prompt's KV: cached_tokens %s" % (what, cached))
    raw_files[what] = (rmeta, rts)


def build_raw(meta, ts):
    """A safetensors file of (dtype, shape, bytes) tensors, in their order."""
    header, data, off = {"__metadata__": meta}, b"", 0
    for name, (dt, shape, raw) in ts.items():
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        pad = (-len(raw)) % 8
        data += raw + b"\0" * pad
        off += len(raw) + pad
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)
    return struct.pack("<Q", len(h)) + h + data


# an fp8 scale that decodes the codes past +-1e9, as a dense cache's values are held
fmeta, fts = raw_files["fp8"]
dt, shape, _ = fts["past_key_values.0.key.qscale"]
refused(build_raw(fmeta, dict(fts, **{"past_key_values.0.key.qscale": (dt, shape, struct.pack("<f", 3e38))})),
        "fp8: a scale of 3e38", (400,), "past_key_values.0.key.qscale")
rmeta, rts = raw_files["quanto"]
code, n_before = d.get("/v1/sessions")
code, qi = d.request("POST", "/v1/sessions/import", build_raw(rmeta, rts), {"Content-Type": "application/octet-stream"})
check(code == 201, "a raw file rebuilt here imports (%d)" % code)
q2 = dict(json.loads(rmeta["quantization"]), nbits=2)
refused(build_raw(dict(rmeta, quantization=json.dumps(q2)), rts), "raw: another nbits", (400,),
        "past_key_values.0.key.qdata")
q3 = dict(json.loads(rmeta["quantization"]), backend="nope")
refused(build_raw(dict(rmeta, quantization=json.dumps(q3)), rts), "raw: an unknown backend", (400,), "quantization")
refused(build_raw(dict(rmeta, quantization='{"implementation": "dynamic"}'), rts), "raw: a dense cache", (400,),
        "quantization")
q4 = dict(json.loads(rmeta["quantization"]), offload=True)
refused(build_raw(dict(rmeta, quantization=json.dumps(q4)), rts), "raw: an offloaded cache", (400,), "quantization")
refused(build_raw(dict(rmeta, q_block_tokens="3"), rts), "raw: another block size", (400,), "q_block_tokens")
lay = json.loads(rmeta["q_layers"])
lay[1][1] -= 1
refused(build_raw(dict(rmeta, q_layers=json.dumps(lay)), rts), "raw: another nq", (400,), "past_key_values.1.key")
refused(build_raw(dict(rmeta, q_layers="[[0, 1, 0]]"), rts), "raw: too few layers", (400,), "q_layers")
lay = json.loads(rmeta["q_layers"])
slid = [l for l, (lo, nq, first) in enumerate(lay) if lo > first * int(rmeta["q_block_tokens"])]
check(slid, "a sliding layer reads from inside its blocks (q_layers %s)" % lay)
lay[slid[0]][0] -= 1
refused(build_raw(dict(rmeta, q_layers=json.dumps(lay)), rts), "raw: a window start the cache would not have",
        (400,), "field lo")
refused(build_raw(dict(rmeta, layout="other"), rts), "raw: another layout", (400,), "layout")
t5 = dict(rts)
dt, shape, b = t5["past_key_values.0.value.qparams"]
t5["past_key_values.0.value.qparams"] = (dt, [shape[0], shape[1], shape[2], shape[3] * 2, 1], b)
refused(build_raw(rmeta, t5), "raw: a qparams shape", (400,), "past_key_values.0.value.qparams")
t6 = dict(rts)
del t6["past_key_values.1.value"]
refused(build_raw(rmeta, t6), "raw: a missing residual", (400,), "tensors")
# a NaN scale in the group of layer 0's first read position
lo, nq, first = json.loads(rmeta["q_layers"])[0]
t7 = dict(rts)
name = "past_key_values.0.key.qparams"
dt, shape, b = t7[name]  # [blocks, kv_heads, T/gt, D/gd, 2] f16
T = int(rmeta["q_block_tokens"])
at = 2 * (((lo // T - first) * shape[1]) * shape[2] + (lo % T) // (T // shape[2])) * shape[3] * 2
t7[name] = (dt, shape, b[:at] + struct.pack("<H", 0x7e00) + b[at + 2:])
refused(build_raw(rmeta, t7), "raw: a NaN scale of a group attention reads", (400,), name)
code, n_after = d.get("/v1/sessions")
check(len(n_after["data"]) == len(n_before["data"]) + 1, "failed raw imports leave no session behind")

# A store of bf16 KV keeps a quantized cache's residual in bf16: its raw
# export carries that residual as stored (dtype and tensors BF16), imports
# back into the same store with the same continuation, and a store of
# another KV dtype refuses it naming the dtype.
b = Daemon("--ctx-size", str(CTX), "--kv-dtype", "bf16", model=d.model)
b.start()
TDT["BF16"] = torch.bfloat16
cache = qcaches[0]
code, qs = b.post("/v1/sessions", {"prompt": prompt, "cache": cache})
check(code == 200 and qs["strategy"] == "quantized", "bf16 KV: a quantized session")
# a continuation leaves the decoded tokens in the residual
code, first = b.post("/v1/completions", dict(gen, prompt=more, session=qs["id"]))
check(code == 200, "bf16 KV: the session continues (%d)" % code)
held = more + first["choices"][0]["tokens"]
code, raw = b.get("/v1/sessions/%s/kv?raw=1" % qs["id"])
check(code == 200, "bf16 KV: raw=1 answers (%d)" % code)
rmeta, rts = parse(raw)
res = [rts["past_key_values.%d.%s" % (l, half)] for l in range(len(json.loads(rmeta["q_layers"])))
       for half in ("key", "value")]
check(rmeta["dtype"] == "bf16" and all(dt == "BF16" and len(r) == 2 * math.prod(shape) for dt, shape, r in res) and
      all(shape[2] > 0 for dt, shape, r in res),
      "bf16 KV: the raw file says bf16 and its residual tensors, not empty, are BF16 (%s, %s)" %
      (rmeta["dtype"], [(dt, shape) for dt, shape, r in res[:2]]))
code, deq = b.get("/v1/sessions/%s/kv" % qs["id"])
dmeta, dts = parse(deq)
got = dequantize(rmeta, raw_tensor(rts))
same = True
for l, kv2 in enumerate(got):
    for half, x in zip(("key", "value"), kv2):
        dt, shape, r = dts["past_key_values.%d.%s" % (l, half)]
        want = torch.frombuffer(bytearray(r), dtype=TDT[dt]).reshape(shape)
        same = same and list(x.shape) == shape and torch.equal(x.to(want.dtype), want)
check(same, "bf16 KV: the raw form dequantized by the documented rule equals the dense export")
code, qi = b.request("POST", "/v1/sessions/import", raw, {"Content-Type": "application/octet-stream"})
check(code == 201 and qi["strategy"] == "quantized" and qi["tokens"] == len(held) - 1,
      "bf16 KV: the raw file imports back (%d %s)" % (code, qi))
code, raw2 = b.get("/v1/sessions/%s/kv?raw=1" % qi["id"])
check(code == 200 and raw2 == raw, "bf16 KV: the imported session exports the same raw bytes")
code, q_own = b.post("/v1/completions", dict(gen, prompt=held + [77], session=qs["id"]))
code2, q_imp = b.post("/v1/completions", dict(gen, prompt=held + [77], session=qi["id"]))
check(code == 200 and code2 == 200 and q_imp["choices"][0]["tokens"] == q_own["choices"][0]["tokens"] and
      q_imp["usage"]["prompt_tokens_details"]["cached_tokens"] == q_own["usage"]["prompt_tokens_details"]["cached_tokens"]
      > len(prompt),
      "bf16 KV: the imported session continues with the original's tokens, as much cached")
refused(raw, "raw: a bf16 file into a store of f32 KV", (400,), "dtype bf16")
b.stop()
