"""Hostile and malformed requests: every one gets a 4xx with an error
envelope, and kvtierd keeps serving (health and a real completion after
each)."""
import json
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check  # noqa: E402

d = Daemon("--max-body", "65536").start()
C = "/v1/completions"
H = "/v1/chat/completions"


def compl(**kw):
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    body.update(kw)
    return body


def drop(key):
    body = compl()
    del body[key]
    return body


json_cases = [
    (C, b""), (C, b"{"), (C, b"[]"), (C, b'"text"'), (C, b"null"), (C, b"42"),
    (C, b'{"prompt":"a","prompt":"b"}'), (C, b'{"prompt":"\xff\xfe"}'), (C, b'{"prompt":"a\\u0000b"}'),
    (C, b'{"prompt":"\\ud800"}'), (C, b'{"prompt":"a",}'), (C, b"{'prompt':'a'}"),
    (C, b'{"max_tokens":99999999999999999999999,"prompt":"a"}'), (C, b'{"prompt":"a","temperature":1e999}'),
    (C, b"[" * 5000 + b"]" * 5000), (C, b'{"prompt":"a"} trailing'),
    (C, compl(prompt=5)), (C, drop("prompt")), (C, compl(prompt=[])), (C, compl(prompt=[-1])),
    (C, compl(prompt=[99999999])), (C, compl(prompt=[1.5])), (C, compl(prompt=[1, "a"])), (C, compl(prompt=[[]])),
    (C, compl(max_tokens=-1)), (C, compl(max_tokens=0)), (C, compl(max_tokens=1e30)), (C, compl(max_tokens="10")),
    (C, compl(max_tokens=10**9)), (C, compl(temperature=-1)), (C, compl(temperature="hot")),
    (C, compl(temperature=None, top_p=0)), (C, compl(top_p=2)), (C, compl(top_k=-5)), (C, compl(min_p=1.5)),
    (C, compl(repetition_penalty=0)), (C, compl(n=0)), (C, compl(n=1000)), (C, compl(stop=5)), (C, compl(stop=[1])),
    (C, compl(stop=[""])), (C, compl(stop=["x"] * 17)), (C, compl(stop="y" * 300)), (C, compl(stream="yes")),
    (C, compl(foo=1)), (C, compl(logprobs=50)), (C, compl(logprobs=True)), (C, compl(seed="x")), (C, compl(seed=1.5)),
    (C, compl(session=5)), (C, compl(session="")), (C, compl(session="nonexistent")),
    (C, compl(cache={"implementation": "bogus"})), (C, compl(cache="dynamic")),
    (C, compl(cache={"implementation": "dynamic", "num_sink_tokens": 5})), (C, compl(cache={"implementation": 3})),
    (C, compl(cache={"implementation": "static"})), (C, compl(cache={"implementation": "static", "max_cache_len": -1})),
    (C, compl(cache={"implementation": "static", "max_cache_len": 2 ** 62})),
    (C, compl(cache={"implementation": "static", "max_cache_len": 4})),
    (C, compl(cache={"implementation": "offloaded", "adaptive": "yes"})),
    (C, compl(cache={"implementation": "offloaded", "adaptive": True})),
    (C, compl(cache={"implementation": "offloaded_static", "max_cache_len": 64, "allow_offload": 0})),
    (C, compl(cache={"implementation": "sliding_window"})),
    (C, compl(cache={"implementation": "sliding_window", "window_length": -4})),
    (C, compl(cache={"implementation": "static", "max_cache_len": 64, "window_length": 128})),
    (C, compl(use_cache="no")), (C, compl(prompt=[1] * 3000)), (C, compl(max_tokens=2047)),
    (C, compl(stream_options={"foo": 1})), (C, compl(stream_options=[])), (C, compl(ignore_eos=1)),
    (C, compl(return_tokens="y")), (C, compl(model=5)), (C, compl(messages=[])),
    (H, {"messages": []}), (H, {"messages": "hi"}), (H, {"messages": [{"role": "wizard", "content": "x"}]}),
    (H, {"messages": [{"content": "x"}]}), (H, {"messages": [{"role": "user", "content": 5}]}),
    (H, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    (H, {"messages": [{"role": "user", "content": "x", "extra": 1}]}), (H, {"messages": [1]}),
    (H, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    (H, {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}),
    (H, {"messages": [{"role": "user", "content": "x"}], "prompt": "x"}),
    (H, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3}),
    (H, {"messages": [{"role": "user", "content": "x"}] * 1100}),  # over --max-messages, under --max-body
    ("/tokenize", {}), ("/tokenize", {"content": 5}), ("/tokenize", {"content": "a", "add_special": "yes"}),
    ("/tokenize", {"content": "a", "bogus": 1}), ("/detokenize", {"tokens": "abc"}), ("/detokenize", {"tokens": [-5]}),
    ("/detokenize", {}), ("/v1/sessions", {"prefix": 5}), ("/v1/sessions", {"system": "a", "prefix": "b"}),
    ("/v1/sessions", {"bogus": 1}), ("/v1/sessions", {"system": 7}), ("/v1/sessions", b"[1]"),
    ("/v1/sessions", {"prefix": [1] * 5000}), ("/v1/sessions", {"cache": {"implementation": "nope"}}),
    ("/apply-template", {"messages": [{"role": "x"}]}),
    ("/v1/sessions/unknown/crop", {"n": -1}), ("/v1/sessions/unknown/crop", {"n": "x"}),
    ("/v1/sessions/unknown/crop", {"n": 10 ** 30}), ("/v1/sessions/unknown/crop", {}),
    ("/v1/sessions/unknown/fork", {"x": 1}), ("/v1/sessions", {"activate_past_recording": "yes"}),
]

http_cases = [
    ("GET", "/nope", None), ("DELETE", "/v1/completions", None), ("GET", "/v1/completions", None),
    ("PUT", "/health", None), ("GET", "/v1/sessions/unknown", None), ("DELETE", "/v1/sessions/unknown", None),
    ("GET", "/v1/sessions/../../etc/passwd", None), ("GET", "/v1/sessions/a/b", None),
    ("POST", "/v1/sessions/unknown/fork", None), ("GET", "/v1/sessions/unknown/crop", None),
    ("POST", "/v1/sessions//crop", None), ("POST", "/v1/sessions/" + "a" * 100 + "/fork", None),
    ("POST", "/v1/sessions/unknown/crop/x", None), ("DELETE", "/v1/sessions/unknown/fork", None),
    ("POST", "/v1/sessions/unknown/activate_past_recording", None),
]

raw_cases = [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 70000\r\n\r\n" + b"x" * 70000,
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
    b"8000\r\n" + b"y" * 0x8000 + b"\r\n" + b"8000\r\n" + b"y" * 0x8000 + b"\r\n0\r\n\r\n",
    b"GARBAGE / HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /health HTTP/1.1\r\n\tfolded\r\n\r\n", b"GET /health HTTP/1.1\r\nNoColonHeader\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000000000000\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
    b"GET /he\x00alth HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n12345",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n\x00\x01\x02",
]

n = 0


def alive():
    code, body = d.get("/health")
    assert code == 200, (code, body)


for path, body in json_cases:
    code, reply = d.post(path, body)
    shown = body if isinstance(body, bytes) else json.dumps(body)
    check(400 <= code < 500 and isinstance(reply, dict) and "message" in reply.get("error", {}),
          "%s %.60r -> %d %s" % (path, shown, code, reply))
    alive()
    n += 1
for method, path, body in http_cases:
    code, reply = d.request(method, path, body)
    check(400 <= code < 500, "%s %.60s -> %d" % (method, path, code))
    alive()
    n += 1
for data in raw_cases:
    code = d.raw(data)
    check(400 <= code < 500, "raw %.50r -> %d" % (data, code))
    alive()
    n += 1

code = d.raw(b"GET / HTTP/9.9\r\n\r\n")
check(code == 505, "an unknown HTTP version -> 505")
# no request line, truncated bodies and silent clients get no reply, but must not hurt anyone
for data in [b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"prompt\"",
             b"GET /health HTTP/1.1\r\nHo"]:
    d.raw(data, timeout=0.5)
    alive()

# a chunked body has no length to refuse up front: it passes the limit while
# it arrives, and still gets its 413 (not a dropped connection)
chunk = b"a" * 32768
code = d.raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
             (b"8000\r\n" + chunk + b"\r\n") * 5 + b"0\r\n\r\n")
check(code == 413, "a chunked body of 160 KiB over --max-body 64 KiB -> 413 (%d)" % code)
alive()

code, e = d.request("POST", C, b'{"prompt":"a\\u0000b"}', {"Content-Type": "application/json"})
check(code == 400 and "holds \\u0000 (NUL)" in e["error"]["message"] and "JSON_ALLOW_NUL" not in e["error"]["message"],
      "a NUL in a string: 400 saying so, not jansson's flag: " + e["error"]["message"])

code, reply = d.post(C, compl(max_tokens=4))
check(code == 200 and reply["usage"]["completion_tokens"] == 4, "a valid completion after %d hostile requests" % n)
code, reply = d.get("/metrics")
check(code == 200 and b"kvtier_errors_total" in reply, "metrics count the errors")
check(n >= 50, "%d hostile requests" % n)
check(d.stop() == 0, "SIGTERM: exit 0")
