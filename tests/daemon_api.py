"""kvtierd end to end over its Unix socket: endpoints, streaming, sessions
(the second turn computes only the new tokens), cache strategy errors,
cancellation on disconnect, limits, peer credentials, sd_notify, SIGTERM
drain and socket rules."""
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, "tests")
from daemon_harness import KVTIERD, Daemon, check, template_model, wait_spilled  # noqa: E402

notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
d = Daemon("--max-sessions", "3", "--max-body", "100000")
notify_path = os.path.join(d.tmp, "notify.sock")
notify.bind(notify_path)
notify.settimeout(10)
d.start(extra_env={"NOTIFY_SOCKET": notify_path})
msgs = []
while not any("READY=1" in m for m in msgs):
    msgs.append(notify.recv(4096).decode())
check(True, "sd_notify READY=1 after the model loaded")
check(oct(os.stat(d.sock).st_mode & 0o777) == "0o600", "socket mode 0600")

code, h = d.get("/health")
check(code == 200 and h == {"status": "ok"}, "/health")
code, m = d.get("/v1/models")
check(code == 200 and m["data"][0]["object"] == "model" and m["data"][0]["meta"]["n_ctx"] == 2048, "/v1/models")

code, t = d.post("/tokenize", {"content": "Hello world"})
check(code == 200 and t["count"] == len(t["tokens"]) > 0, "/tokenize")
code, dt = d.post("/detokenize", {"tokens": t["tokens"]})
check(code == 200 and dt["content"] == "Hello world", "/detokenize round trip")
# a character left incomplete at the end is U+FFFD, as transformers decodes
# with errors="replace": detokenized, and as a completion's last token
# (the schema forces '"' and then the byte tokens of U+00E9: cut after the first)
code, r = d.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0, "return_tokens": True,
                                     "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "e", "schema": {"enum": ["\u00e9"]}}}})
check(code == 200 and r["choices"][0]["finish_reason"] == "length" and r["choices"][0]["text"] == '"\ufffd',
      "a completion that ends inside a character ends with U+FFFD (%r)" % r["choices"][0].get("text"))
code, dt3 = d.post("/detokenize", {"tokens": r["choices"][0]["tokens"]})
check(code == 200 and dt3["content"] == '"\ufffd', "/detokenize of tokens that end inside a character: U+FFFD")
# a token that holds part of a character: its logprobs text is U+FFFD (as
# transformers decodes that one id), whichever part it holds, and its bytes
# its own; /tokenize's piece is its bytes, as llama.cpp's server gives them
code, r = d.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12,
                                          "logprobs": True, "response_format": {
                                              "type": "json_schema",
                                              "json_schema": {"name": "e", "schema": {"enum": ["\U0001F389\u4e2d"]}}}})
lp = r["choices"][0]["logprobs"]["content"] if code == 200 else []
split = [x for x in lp if bytes(x["bytes"]).decode("utf-8", "replace") != bytes(x["bytes"]).decode("utf-8", "ignore")]
check(len(split) >= 2 and all(x["token"] == "\ufffd" for x in split) and
      b"".join(bytes(x["bytes"]) for x in lp).decode().startswith('"\U0001F389\u4e2d"'),
      "chat logprobs: the tokens of split characters read U+FFFD, their bytes join up (%s)" %
      [(x["token"], x["bytes"]) for x in lp])
code, tp = d.post("/tokenize", {"content": '"\U0001F389\u4e2d', "with_pieces": True})
pieces = [x["piece"] for x in tp["tokens"]] if code == 200 else []
check(any(isinstance(p, list) for p in pieces) and
      b"".join(bytes(p) if isinstance(p, list) else p.encode() for p in pieces) == '"\U0001F389\u4e2d'.encode(),
      "/tokenize with_pieces: a part of a character is its bytes, whole ones their text (%s)" % pieces)
code, t2 = d.post("/tokenize", {"prompt": "Hello world"})
check(code == 200 and t2["tokens"][1:] == t["tokens"], "vLLM shape adds BOS by default")
code, e = d.post("/tokenize", {"content": "Hello", "prompt": "world"})
check(code == 400 and e["error"]["param"] in ("content", "prompt"), "/tokenize with content and prompt -> 400")

greedy = {"prompt": "In the beginning", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_tokens": True}
code, r = d.post("/v1/completions", greedy)
check(code == 200 and r["object"] == "text_completion" and r["usage"]["completion_tokens"] == 12 and
      r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and len(r["choices"][0]["tokens"]) == 12,
      "completion: usage and tokens")
k = r["kvtier"]
check(k["strategy"] == "dynamic" and k["bytes"]["device"] > 0 and k["fallback"] is None and k["decode_ms"] >= 0,
      "completion: kvtier object")
code, r2 = d.post("/v1/completions", dict(greedy, prompt=r["choices"][0]["tokens"][:3]))
check(code == 200 and r2["usage"]["prompt_tokens"] == 3, "prompt as token ids")

ev = d.stream("/v1/completions", dict(greedy, stream=True, stream_options={"include_usage": True}))
check(ev[-1] == "[DONE]", "stream ends with [DONE]")
text = "".join(e["choices"][0]["text"] for e in ev[:-1] if e.get("choices"))
toks = [t for e in ev[:-1] if e.get("choices") for t in e["choices"][0]["tokens"]]
check(text == r["choices"][0]["text"] and toks == r["choices"][0]["tokens"], "streamed text == non-streamed text")
check(ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 12, "include_usage chunk")
check(ev[-3]["choices"][0]["finish_reason"] == "length" and "kvtier" in ev[-3], "final chunk: finish_reason, kvtier")

code, r = d.post("/v1/completions", dict(greedy, n=3, temperature=1.0, seed=7, return_tokens=False))
check(code == 200 and [c["index"] for c in r["choices"]] == [0, 1, 2] and r["usage"]["completion_tokens"] == 36, "n=3")
code, r3 = d.post("/v1/completions", dict(greedy, n=3, temperature=1.0, seed=7, return_tokens=False))
check(r3["choices"] == r["choices"], "seed makes sampling repeatable")
code, r = d.post("/v1/completions", dict(greedy, stop=[r2["choices"][0]["text"][2:5] or "e"]))
check(code == 200 and r["choices"][0]["finish_reason"] in ("stop", "length"), "stop strings")
code, r = d.post("/v1/completions", dict(greedy, logprobs=2, max_tokens=3))
lp = r["choices"][0]["logprobs"]
check(len(lp["tokens"]) == 3 and all(x <= 0 for x in lp["token_logprobs"]) and len(lp["top_logprobs"][0]) <= 2,
      "completions logprobs")

chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
code, c = d.post("/v1/chat/completions", chat)
check(code == 200 and c["object"] == "chat.completion" and c["choices"][0]["message"]["role"] == "assistant",
      "chat completion")
ev = d.stream("/v1/chat/completions", dict(chat, stream=True))
check(ev[0]["choices"][0]["delta"]["role"] == "assistant" and ev[-1] == "[DONE]", "chat stream")
check("".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1]) == c["choices"][0]["message"]["content"],
      "chat stream text == chat text")
code, p = d.post("/apply-template", {"messages": chat["messages"]})
check(code == 200 and p["prompt"].endswith("<|im_start|>assistant\n"), "apply-template (ChatML)")
code, c = d.post("/v1/chat/completions", dict(chat, logprobs=True, top_logprobs=2))
check(len(c["choices"][0]["logprobs"]["content"]) == 6, "chat logprobs")

# the quantized strategy: int8 keeps greedy decoding on dynamic's tokens
q8 = {"implementation": "quantized", "backend": "quanto", "nbits": 8}
code, dyn = d.post("/v1/completions", greedy)
code, q = d.post("/v1/completions", dict(greedy, cache=q8))
k = q.get("kvtier", {})
check(code == 200 and q["choices"][0]["tokens"][:6] == dyn["choices"][0]["tokens"][:6] and
      k["strategy"] == "quantized" and k["requested_strategy"] == "quantized" and k["bytes"]["device"] > 0 and
      q["usage"]["completion_tokens"] == 12, "quantized int8: dynamic's first greedy tokens, reported as quantized")
code, q4 = d.post("/v1/completions", dict(greedy, cache={"implementation": "quantized"}))
check(code == 200 and q4["kvtier"]["strategy"] == "quantized", "quantized with the reference defaults")
for extra, param in (({"nbits": 3}, "cache.nbits"), ({"backend": "gptq"}, "cache.backend"),
                     ({"max_cache_len": 64}, "cache.max_cache_len"), ({"allow_offload": 1}, "cache.allow_offload")):
    code, e = d.post("/v1/completions", dict(greedy, cache=dict(extra, implementation="quantized")))
    check(code == 400 and e["error"]["param"] == param, "quantized %s -> 400 naming %s: %s" %
          (extra, param, e["error"]["message"]))
code, s = d.post("/v1/sessions", {"prompt": "In the beginning was", "cache": q8})
check(code == 200 and s["strategy"] == "quantized" and s["tokens"] > 0, "a quantized session")
for op, body, param in (("crop", {"n": 1}, "n"), ("fork", {}, "cache")):
    code, e = d.post("/v1/sessions/%s/%s" % (s["id"], op), body)
    check(code == 400 and op in e["error"]["message"] and e["error"]["param"] == param,
          "%s of a quantized session -> 400 naming it and %s: %s" % (op, param, e["error"]["message"]))
check(d.request("DELETE", "/v1/sessions/" + s["id"])[0] == 200, "delete the quantized session")
# a format the store refuses for this model (groups whose codes split a
# byte, or that do not divide the head) is refused when a session is
# created, empty or not, with the 400 a completion with that cache gets,
# and leaves no session
before = sorted(x["id"] for x in d.get("/v1/sessions")[1]["data"])
for bad in ({"nbits": 4, "axis_key": -1, "q_group_size": 1}, {"nbits": 4, "q_group_size": 3},
            {"backend": "hqq", "nbits": 3, "axis_key": 1, "axis_value": 1, "q_group_size": 4}):
    cache = dict(bad, implementation="quantized")
    gcode, ge = d.post("/v1/completions", dict(greedy, cache=cache))
    for body in ({"cache": cache}, {"prompt": "In the beginning was", "cache": cache}):
        code, e = d.post("/v1/sessions", body)
        check(gcode == code == 400 and e == ge and e["error"]["param"] == "cache.q_group_size",
              "session %s -> the completion's 400 naming cache.q_group_size: %s" %
              (body, e.get("error", {}).get("message")))
check(sorted(x["id"] for x in d.get("/v1/sessions")[1]["data"]) == before, "the refused caches left no session")
# sinks + quantized: num_sink_tokens on a quantized cache; the window bounds its KV
qsink = dict(q8, window_length=32, num_sink_tokens=4, residual_length=16)
long = dict(greedy, max_tokens=64)
code, qs1 = d.post("/v1/completions", dict(long, cache=qsink))
code2, qs2 = d.post("/v1/completions", dict(long, max_tokens=192, cache=qsink))
code, ds = d.post("/v1/completions", dict(long, cache={"implementation": "sink", "window_length": 32,
                                                        "num_sink_tokens": 4}))
b1, b2 = qs1["kvtier"]["bytes"]["device"], qs2["kvtier"]["bytes"]["device"]
check(code == code2 == 200 and qs2["usage"]["completion_tokens"] == 192 and qs1["kvtier"]["strategy"] == "quantized" and
      qs1["choices"][0]["tokens"][:6] == ds["choices"][0]["tokens"][:6] and 0 < b2 <= b1,
      "sinks + quantized int8: the dense sink cache's first tokens, KV bounded (%d bytes after 64 tokens, %d after 192)"
      % (b1, b2))
code, e = d.post("/v1/completions", dict(long, cache=dict(qsink, offload=True)))
check(code == 400 and "sink" in e["error"]["message"] and e["error"]["param"] == "cache.offload",
      "sinks + offloaded quantized -> 400 naming cache.offload: " + e["error"]["message"])
# sink and quantized sequences share forward batches (the quantized kernel
# rotates sink keys): concurrent requests of both kinds all succeed
out = {}
kinds = [q8, {"implementation": "sink", "window_length": 8, "num_sink_tokens": 2}] * 3
threads = [threading.Thread(target=lambda i=i, c=c: out.update({i: d.post("/v1/completions", dict(long, cache=c))}))
           for i, c in enumerate(kinds)]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
check(all(out[i][0] == 200 and out[i][1]["kvtier"]["strategy"] == ("quantized" if i % 2 == 0 else "sink")
          for i in range(len(kinds))), "concurrent sink and quantized requests: %s" % [out[i][0] for i in out])
code, e = d.post("/v1/completions", dict(greedy, cache={"implementation": "fancy"}))
check(code == 400 and "dynamic" in e["error"]["message"] and "static" in e["error"]["message"],
      "unknown cache -> 400 listing the valid values")
# use_cache=false recomputes the whole history every step: dynamic's tokens, nothing cached
code, nc = d.post("/v1/completions", dict(greedy, use_cache=False))
check(code == 200 and nc["choices"][0]["tokens"] == dyn["choices"][0]["tokens"] and
      nc["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "use_cache=false: the dynamic run's tokens")
# a history that grows past a step's token budget (--batch-tokens, 256 by
# default) is fed again in several chunks, one of which leaves a single
# token: still a refeed, not a decode to restart (it used to loop there)
long_ids = [(i * 37 + 11) % 1900 + 50 for i in range(250)]
code, nc = d.post("/v1/completions", dict(greedy, prompt=long_ids, max_tokens=12, ignore_eos=True, use_cache=False))
code2, dc = d.post("/v1/completions", dict(greedy, prompt=long_ids, max_tokens=12, ignore_eos=True))
check(code == code2 == 200 and nc["choices"][0]["tokens"] == dc["choices"][0]["tokens"],
      "use_cache=false past the step budget (250 + 12 tokens): it ends, with the cached run's tokens")
code, e = d.post("/v1/sessions", {"prompt": "In the beginning", "use_cache": False})
check(code == 400 and e["error"]["param"] == "use_cache", "a session with use_cache=false -> 400")
code, e = d.post("/v1/completions", dict(greedy, logit_bias={"5": 1}))
check(code == 400 and e["error"]["type"] == "invalid_request_error" and e["error"]["param"] == "logit_bias",
      "an unsupported feature -> 400 naming it, never 5xx")
code, e = d.post("/v1/completions", dict(greedy, model="gpt-4o"))
check(code == 404 and e["error"]["code"] == "model_not_found" and e["error"]["param"] == "model",
      "another model -> 404 model_not_found")
mid = m["data"][0]["id"]
for name in (mid, mid + ":latest", d.model):
    code, r = d.post("/v1/completions", dict(greedy, model=name, max_tokens=1))
    check(code == 200 and r["model"] == mid, "model alias %r accepted" % name)
code, r = d.post("/v1/completions", dict(greedy, max_tokens=1, cache_prompt=True, keep_alive="5m",
                                         reasoning_effort="low", typical_p=0.9))
check(code == 200, "cache_prompt, keep_alive, reasoning_effort, typical_p accepted")
code, r = d.get("/v1/models/" + mid)
check(code == 200 and r["id"] == mid and r["object"] == "model", "GET /v1/models/{id}")
code, r = d.get("/v1/models/other")
check(code == 404 and r["error"]["code"] == "model_not_found", "GET /v1/models/{other} -> 404 model_not_found")
code, r = d.post("/tokenize", {"content": "x", "model": "other"})
check(code == 404 and r["error"]["param"] == "model", "/tokenize naming another model -> 404")
code, e = d.post("/v1/chat/completions", dict(chat, tools=[{"type": "function"}]))
check(code == 400 and e["error"]["param"] == "tools", "a malformed tool -> 400")
# the model's own Jinja template renders tool calls and results (its text, not a sniffed family's)
tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
conv = [{"role": "user", "content": "Call f"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]
code, p = d.post("/apply-template", {"messages": conv, "tools": tools})
check(code == 200 and p["prompt"].endswith("<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"),
      "apply-template with tool calls and a tool result: %s" % (p.get("prompt") or p)[-80:])

# sessions: the second turn computes only its new tokens
system = "You are terse."
code, s = d.post("/v1/sessions", {"system": system})
sid = s["id"]
check(code == 200 and s["tokens"] > 0 and s["strategy"] == "dynamic", "session with a system prompt, prefilled")
turn = {"session": sid, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Hello"}]
code, c1 = d.post("/v1/chat/completions", dict(turn, messages=msgs))
check(code == 200 and c1["usage"]["prompt_tokens_details"]["cached_tokens"] == s["tokens"], "turn 1 reuses the prefix")
code, info = d.get("/v1/sessions/" + sid)
held = info["tokens"]
check(held == c1["usage"]["prompt_tokens"] + 4, "session holds prompt + generated - 1 tokens")
msgs += [{"role": "assistant", "content": c1["choices"][0]["message"]["content"]}, {"role": "user", "content": "More"}]
code, c2 = d.post("/v1/chat/completions", dict(turn, messages=msgs))
cached = c2["usage"]["prompt_tokens_details"]["cached_tokens"]
check(code == 200 and cached == held, "turn 2: cached_tokens %d == tokens held %d" % (cached, held))
fresh = dict(turn)
del fresh["session"]
code, c2f = d.post("/v1/chat/completions", dict(fresh, messages=msgs))
check(c2f["choices"][0]["message"]["content"] == c2["choices"][0]["message"]["content"],
      "a session turn generates what a fresh request does")
other = [{"role": "user", "content": "Other"}]
code, c3 = d.post("/v1/chat/completions", dict(turn, messages=other))
code, c3f = d.post("/v1/chat/completions", dict(fresh, messages=other))
check(code == 200 and c3["usage"]["prompt_tokens_details"]["cached_tokens"] < held and
      c3["choices"][0]["message"]["content"] == c3f["choices"][0]["message"]["content"],
      "a prompt that is not a continuation is recomputed from the first mismatch (prefix check)")
code, e = d.post("/v1/completions", dict(greedy, session=sid, cache={"implementation": "dynamic"}))
check(code == 400 and e["error"]["param"] == "cache", "session + cache -> 400")
code, body = d.request("HEAD", "/health")
code2, e = d.request("HEAD", "/v1/completions")
code3, e = d.request("HEAD", "/v1/sessions/%s/kv" % sid)
check(code == 200 and body == b"" and code2 == 405 and code3 == 405,
      "HEAD /health: 200 without a body; HEAD on a POST route or a session's export: 405")
code, e = d.post("/v1/completions", dict(greedy, session=sid, use_cache=False))
check(code == 400 and e["error"]["param"] == "use_cache", "session + use_cache -> 400 naming use_cache")
code, lst = d.get("/v1/sessions")
check(code == 200 and [x["id"] for x in lst["data"]] == [sid], "GET /v1/sessions")
ids = [d.post("/v1/sessions", {})[1]["id"] for _ in range(2)]
code, e = d.post("/v1/sessions", {})
check(code == 429, "--max-sessions: 429")
code, _ = d.request("DELETE", "/v1/sessions/" + sid)
check(code == 200 and d.get("/v1/sessions/" + sid)[0] == 404, "DELETE session")
for i in ids:
    d.request("DELETE", "/v1/sessions/" + i)


def metric(name):
    text = d.get("/metrics")[1].decode()
    for line in text.splitlines():
        if line.startswith("kvtier_" + name + " "):
            return float(line.split()[1])
    raise KeyError(name)


# a client that disconnects cancels its generation
for stream in (False, True):
    before = metric("generation_tokens_total")
    conn = d.conn()
    # n=8: long enough (16000 tokens) that the disconnect lands mid-generation
    conn.request("POST", "/v1/completions", json.dumps(dict(greedy, max_tokens=2000, n=8, stream=stream,
                                                            return_tokens=False)))
    if stream:
        resp = conn.getresponse()
        resp.fp.readline()
    else:
        while metric("generation_tokens_total") == before:
            time.sleep(0.01)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    t = time.time()
    while metric("requests_running") > 0 and time.time() < t + 10:
        time.sleep(0.05)
    made = metric("generation_tokens_total") - before
    check(metric("requests_running") == 0 and made < 16000, "disconnect cancels (%s): %d of 16000 tokens made" %
          ("stream" if stream else "plain", made))

# peer credentials: another uid is refused; with --allow-group its member gets in but not into our sessions
if os.geteuid() == 0:
    nobody = pwd.getpwnam("nobody")

    def as_nobody(path):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(d.sock)
                try:  # a refused peer may be closed on before its request is sent
                    s.sendall(("GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path).encode())
                except BrokenPipeError:
                    pass
                data = s.recv(100)
                os.write(w, data.split(b" ")[1] if data.startswith(b"HTTP") else b"0")
            except OSError as e:
                os.write(w, ("E%d" % e.errno).encode())
            os._exit(0)
        os.close(w)
        out = os.read(r, 16).decode()
        os.waitpid(pid, 0)
        return out

    os.chmod(d.tmp, 0o755)
    os.chmod(d.sock, 0o777)  # the filesystem lets nobody in; SO_PEERCRED must not
    check(as_nobody("/health") == "403", "SO_PEERCRED: another uid is refused with 403")
    d.stop()
    os.chown(d.tmp, 0, nobody.pw_gid)
    g = Daemon("--allow-group", "nogroup", model=d.model, tmp=d.tmp).start()
    d = g
    code, s = d.post("/v1/sessions", {})
    check(oct(os.stat(d.sock).st_mode & 0o777) == "0o660", "--allow-group: socket 0660")
    check(as_nobody("/health") == "200", "--allow-group: a member is accepted")
    check(as_nobody("/v1/sessions/" + s["id"]) == "403", "another uid cannot read our session (403)")

# SIGTERM drains: the running generation completes, then exit 0 and the socket is gone
result = {}


def long_request():
    result["r"] = d.post("/v1/completions", dict(greedy, max_tokens=300))


th = threading.Thread(target=long_request)
th.start()
until = time.time() + 30  # admitted before the signal
while not d.get("/v1/requests")[1]["data"] and "r" not in result and time.time() < until:
    time.sleep(0.02)
d.proc.send_signal(signal.SIGTERM)
th.join(60)
code, r = result["r"]
check(code == 200 and r["usage"]["completion_tokens"] == 300, "SIGTERM: the in-flight request completes")
check(d.proc.wait(30) == 0 and not os.path.exists(d.sock), "SIGTERM: exit 0, socket removed")

# socket rules
d2 = Daemon(model=d.model, tmp=d.tmp)
d2.start()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
d2.proc.kill()
d2.proc.wait()
check(os.path.exists(d2.sock), "kill -9 leaves a stale socket")
d2.start()
check(True, "a stale socket is replaced")
r = subprocess.run([KVTIERD, "--model", d.model, "--socket", d2.sock], capture_output=True, text=True, timeout=30)
check(r.returncode == 4 and "another kvtierd" in r.stderr, "a live socket is not taken over (exit 4)")
r = subprocess.run([KVTIERD, "--model", d.model, "--socket", "/tmp/" + "x" * 120], capture_output=True, text=True)
check(r.returncode == 4 and "at most" in r.stderr, "a path longer than sun_path is a clear error (exit 4)")
r = subprocess.run([KVTIERD, "--model", d.tmp + "/nothing", "--socket", d.tmp + "/other.sock"], capture_output=True,
                   text=True, timeout=30)
check(r.returncode == 3, "a model that cannot load: exit 3")
r = subprocess.run([KVTIERD, "--parallel", "zero"], capture_output=True, text=True)
check(r.returncode == 2, "usage error: exit 2")
r = subprocess.run([KVTIERD, "--max-queue", "0"], capture_output=True, text=True)
check(r.returncode == 2 and "--max-queue" in r.stderr, "--max-queue 0 (every request would be 429) is a usage error")
check(d2.stop() == 0, "stop")
# a second SIGTERM stops at once, but a request in flight still reads its
# 503: one that waits for its spilled session's KV from a slowed disk
d3 = Daemon("--spill-after", "1", model=d.model, tmp=d.tmp)
d3.sock = os.path.join(d.tmp, "sig2.sock")
d3.start(extra_env={"KVTIER_DISK_READ_DELAY_MS": "3000"})
sid3 = d3.post("/v1/sessions", {"prompt": "In the beginning"})[1]["id"]
wait_spilled(d3, sid3)
result = {}
th = threading.Thread(target=lambda: result.update(r=d3.post("/v1/completions", dict(greedy, session=sid3))))
th.start()
until = time.time() + 30
while not d3.get("/v1/requests")[1]["data"] and "r" not in result and time.time() < until:
    time.sleep(0.02)
d3.proc.send_signal(signal.SIGTERM)
time.sleep(0.3)
d3.proc.send_signal(signal.SIGTERM)
th.join(60)
code, r = result.get("r", (None, None))
check(code == 503 and "shutting down" in r["error"]["message"] and d3.proc.wait(30) == 0,
      "a second SIGTERM: the request in flight gets 503, exit 0 (got %s)" % code)

# Token texts far longer than the stream's per-token guess (and than 256
# bytes): logprobs spell them out whole, and a streamed chat with 20
# alternatives per token still completes (it used to stall once two such
# tokens were pending, since not even one event fit the empty buffer).
lm = os.path.join(d.tmp, "longpieces")
shutil.copytree(d.model, lm)
with open(os.path.join(lm, "tokenizer.json")) as f:
    tj = json.load(f)
vocab = tj["model"]["vocab"]
for k, i in list(vocab.items()):
    if i >= 256:  # keep the byte alphabet so prompts still encode
        del vocab[k]
        vocab["q" * 400 + str(i)] = i
tj["model"]["merges"] = []
with open(os.path.join(lm, "tokenizer.json"), "w") as f:
    json.dump(tj, f)
dl = Daemon(model=lm).start()
lchat = dict(chat, max_tokens=8, logprobs=True, top_logprobs=20)
code, c = dl.post("/v1/chat/completions", lchat)
content = c["choices"][0]["logprobs"]["content"]
check(code == 200 and len(content) == 8 and
      all(t["token"].encode() == bytes(t["bytes"]) for t in content) and
      max(len(a["token"]) for t in content for a in t["top_logprobs"]) > 400,
      "logprobs spell out tokens longer than 256 bytes")
ev = dl.stream("/v1/chat/completions", dict(lchat, stream=True))
toks = [t for e in ev[:-1] for t in (e["choices"][0]["logprobs"] or {}).get("content", [])]
check(ev[-1] == "[DONE]" and toks == content and
      "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1]) == c["choices"][0]["message"]["content"],
      "a streamed chat with top_logprobs 20 on long tokens completes with the whole reply")
check(dl.stop() == 0, "stop")

# ---- the template's other variables and the generation prompt ---------------
# a template that shows both: chat_template_kwargs reach it as variables
# (Qwen3's enable_thinking), add_generation_prompt false leaves the
# assistant header out, and the variables the request sets are refused
tm = Daemon("--disk-dir", "none")
tm.model = template_model(tm.tmp + "/tpl", "{% for m in messages %}{{ m.content }}{% endfor %}"
                          "{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}"
                          "{% if add_generation_prompt %}[gen]{% endif %}")
tm.start()
hi = {"messages": [{"role": "user", "content": "Hi"}]}
prompts = [tm.post_ok("/apply-template", dict(hi, **extra))["prompt"]
           for extra in ({}, {"add_generation_prompt": False}, {"chat_template_kwargs": {"enable_thinking": False}})]
check(prompts == ["Hi[gen]", "Hi", "Hi[no-think][gen]"], "apply-template: %s" % prompts)
r = tm.post_ok("/v1/chat/completions", dict(hi, max_tokens=1, chat_template_kwargs={"enable_thinking": False},
                                            add_generation_prompt=False))
n_tok = len(tm.post_ok("/tokenize", {"content": "Hi[no-think]", "add_special": False})["tokens"])
check(r["usage"]["prompt_tokens"] == n_tok, "a chat completion renders its prompt with them (%d tokens, %d)" %
      (r["usage"]["prompt_tokens"], n_tok))
for bad, why in (({"messages": []}, "set by the request"), ("x", "an object"), ({"add_generation_prompt": 1}, "set by")):
    code, e = tm.post("/v1/chat/completions", dict(hi, max_tokens=1, chat_template_kwargs=bad))
    check(code == 400 and e["error"]["param"] == "chat_template_kwargs" and why in e["error"]["message"],
          "chat_template_kwargs %s -> 400 naming it: %s" % (json.dumps(bad), e["error"]["message"]))
code, e = tm.post("/v1/chat/completions", dict(hi, max_tokens=1, add_generation_prompt="no"))
check(code == 400 and e["error"]["param"] == "add_generation_prompt", "add_generation_prompt \"no\" -> 400")
check(tm.stop() == 0, "stop")
