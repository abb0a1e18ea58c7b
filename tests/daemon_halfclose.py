"""A client that sends its whole request and then shuts down its writing
side (shutdown(SHUT_WR), `nc -N`) gets its answer on every route: the
daemon tells a half-close (EPOLLRDHUP) from a hang-up (EPOLLHUP)."""
import json
import socket

from daemon_harness import Daemon, check, read_to_eof

d = Daemon()
d.start()


def half_closed(method, path, body=None, timeout=30):
    """The status and body of one request sent whole, then SHUT_WR."""
    data = b"" if body is None else json.dumps(body).encode()
    head = "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" % (method, path)
    if body is not None:
        head += "Content-Type: application/json\r\nContent-Length: %d\r\n" % len(data)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(d.sock)
    s.sendall(head.encode() + b"\r\n" + data)
    s.shutdown(socket.SHUT_WR)
    buf = read_to_eof(s)
    s.close()
    if not buf.startswith(b"HTTP/1."):
        return 0, buf
    return int(buf.split(b" ", 2)[1]), buf.split(b"\r\n\r\n", 1)[-1]


gen = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
for method, path, body in [("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
                           ("POST", "/tokenize", {"content": "hello"}),
                           ("POST", "/v1/completions", gen)]:
    code, _ = half_closed(method, path, body)
    check(code == 200, "half-closed %s %s -> %d" % (method, path, code))

code, out = half_closed("POST", "/v1/completions", dict(gen, stream=True))
check(code == 200 and b"[DONE]" in out, "half-closed streamed completion ends with [DONE]")
code, out = half_closed("POST", "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
check(code == 200, "half-closed chat completion -> %d" % code)

code, out = half_closed("POST", "/v1/sessions", {"prompt": "In the beginning was"})
check(code == 200, "half-closed session create -> %d" % code)
sid = json.loads(out)["id"]
code, out = half_closed("POST", "/v1/completions", {"session": sid, "max_tokens": 4, "temperature": 0,
                                                    "prompt": " the word"})
check(code == 200, "half-closed session turn -> %d" % code)
code, out = half_closed("POST", "/v1/sessions/%s/fork" % sid, {})
check(code == 200, "half-closed fork -> %d" % code)
code, out = half_closed("GET", "/v1/sessions/" + sid)
check(code == 200 and json.loads(out)["tokens"] > 0, "half-closed session get")
code, _ = half_closed("DELETE", "/v1/sessions/" + sid)
check(code == 200, "half-closed session delete -> %d" % code)

# a full hang-up still cancels: the daemon serves on
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(d.sock)
data = json.dumps(dict(gen, max_tokens=2000)).encode()
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
s.close()
check(d.get("/health")[0] == 200, "a client that hangs up does not stop the daemon")
check(d.stop() == 0, "clean stop")
