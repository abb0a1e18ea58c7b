"""HTTP framing kvtierd refuses: two Content-Lengths, a Content-Length that
is not a count (one JSON reply, not libmicrohttpd's doubled head), Content-Length with
chunked, a NUL (%00) in the path, a raw NUL byte anywhere in the request
head (method, path, version, header names and values, a line of its own),
on the first request of a connection, a later one on the same kept-alive
connection, or split over two writes (a pipelined request is never parsed:
the one before it closes the connection); transfer
codings other than chunked, a garbage request line -- each a 400 and a
closed connection (the client does not half-close: the daemon must close),
and never the reply of the route a truncated path names.  A client looping on bad
requests gets one log line a second, with a count of the rest."""
import re
import socket
import time

from daemon_harness import Daemon, check

d = Daemon()
d.start()


def send(data, timeout=5, first=None):
    """(status, closed by the daemon before timeout); with first, that
    request goes ahead on the same connection and its reply is read."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(d.sock)
    pending = b""
    if first:
        s.sendall(first)
        while b"\r\n\r\n" not in pending or len(pending.split(b"\r\n\r\n", 1)[1]) < int(
                re.search(rb"Content-Length: (\d+)", pending).group(1)):
            pending += s.recv(65536)
        head, rest = pending.split(b"\r\n\r\n", 1)
        check(head.startswith(b"HTTP/1.1 200") and b"close" not in head.lower(), "a first request kept alive")
        pending = rest[int(re.search(rb"Content-Length: (\d+)", head).group(1)):]
    for part in data if isinstance(data, list) else [data]:
        s.sendall(part)
        time.sleep(0.05)
    buf, closed = pending, False
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                closed = True
                break
            buf += chunk
    except (OSError, socket.timeout):
        pass
    s.close()
    global replies
    replies = [int(c) for c in re.findall(rb"^HTTP/1\.1 (\d{3}) ", buf, re.M)] if buf.startswith(b"HTTP/1.") else []
    return replies[-1] if replies else 0, closed


H = b"POST /tokenize HTTP/1.1\r\nHost: x\r\n"
cases = {
    "two Content-Lengths": H + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "Content-Length with chunked": H + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "%00 in the path": b"GET /health%00 HTTP/1.1\r\nHost: x\r\n\r\n",
    "Transfer-Encoding: gzip, chunked": H + b"Transfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "Transfer-Encoding: gzip": H + b"Transfer-Encoding: gzip\r\n\r\n{}",
    "a garbage request line": b"\x01\x02 garbage\r\n\r\n",
}
for what, data in cases.items():
    code, closed = send(data)
    check(code == 400 and closed, "%s -> 400 and closed (%d, %s)" % (what, code, closed))

# A Content-Length that is not a count, or one past any 64-bit count:
# kvtierd's own 400 or 413 (libmicrohttpd's sends its status line and
# headers twice), once, as JSON; any number of blanks before the count,
# leading zeros, any case of the name and bare LFs are served, and a count
# over --max-body is the route's 413
for what, data, want in (("Content-Length: abc", H + b"Content-Length: abc\r\n\r\n", 400),
                          ("Content-Length: -5", H + b"content-length: -5\r\n\r\n{}", 400),
                          ("Content-Length: +2", H + b"Content-Length: +2\r\n\r\n{}", 400),
                          ("Content-Length: 2x", H + b"Content-Length: 2x\r\n\r\n{}", 400),
                          ("a blank after the count", H + b"Content-Length: 2 \r\n\r\n{}", 400),
                          ("a CR inside the line", H + b"Content-Length: 2\r\r\n\r\n{}", 400),
                          ("no count", H + b"Content-Length:\r\n\r\n{}", 400),
                          ("a count past 64 bits", H + b"Content-Length: 18446744073709551616\r\n\r\n{}", 413),
                          ("split over two writes", [H + b"Content-Le", b"ngth: 1e3\r\n\r\n{}"], 400)):
    code, closed = send(data)
    check(replies == [want] and closed, "%s -> one %d and closed (%s, %s)" % (what, want, replies, closed))
body = b'{"content":"hi"}'
for what, data, want in (("blanks before the count", H + b"Content-Length: \t 16\r\n\r\n" + body, 200),
                         ("40 blanks, over three writes", [H + b"Content-Length: " + b" " * 20, b" " * 20,
                                                           b"16\r\n\r\n" + body], 200),
                         ("leading zeros, a lower-case name, bare LFs",
                          b"POST /tokenize HTTP/1.1\nHost: x\ncontent-length:0000000000000000000016\n\n" + body, 200),
                         ("a count over --max-body", H + b"Content-Length: 10000000000000000000\r\n\r\n", 413)):
    code, closed = send(data, timeout=1)
    check(replies == [want], "%s: %s (%s)" % (what, want, replies))
log = d.logtext()
check(log.count("Content-Length must be a decimal byte count") == 8 and
      log.count("Content-Length is past any body kvtierd takes") == 1, "each refusal logged")

# A raw NUL: libmicrohttpd would read the strings up to it (GET /health\0junk
# would be served as /health; a NUL-led line would end the head)
G = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def invalid_total():
    m = re.search(r'^kvtier_errors_total\{kind="invalid"\} (\d+)', d.get("/metrics")[1].decode(), re.M)
    return int(m.group(1))


before = invalid_total()
nul = {
    "NUL in the path": b"GET /health\x00junk HTTP/1.1\r\nHost: x\r\n\r\n",
    "NUL in the method": b"GET\x00X /health HTTP/1.1\r\nHost: x\r\n\r\n",
    "NUL in the version": b"GET /health HTTP/1.1\x00\r\nHost: x\r\n\r\n",
    "NUL in the query": b"GET /health?a=\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    "NUL before the request line": b"\x00GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
    "NUL in a header value": b"GET /health HTTP/1.1\r\nHost: x\x00y\r\n\r\n",
    "NUL in a header name": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A\x00b: y\r\n\r\n",
    "NUL before a bare LF": b"GET /health HTTP/1.1\nHost: x\x00\n\n",
    "a header line starting with NUL": b"GET /health HTTP/1.1\r\n\x00Host: x\r\n\r\n",
    "NUL as the blank line": b"GET /health HTTP/1.1\r\nHost: x\r\n\x00\r\n",
    "split over two writes": [b"GET /health", b"\x00junk HTTP/1.1\r\nHost: x\r\n\r\n"],
}
for what, data in nul.items():
    code, closed = send(data)
    check(replies == [400] and closed, "%s -> 400 and closed (%s, %s)" % (what, replies, closed))
code, closed = send(b"GET /health\x00junk HTTP/1.1\r\nHost: x\r\n\r\n", first=G)
check(code == 400 and closed, "NUL in the path of a kept-alive connection's second request -> 400 and closed")
code, closed = send(G, first=G)
check(code == 200 and not closed, "an ordinary second request on a kept-alive connection is served (%d)" % code)
code, closed = send(G, first=H + b"Content-Length: 16\r\n\r\n{\"content\":\"hi\"}")
check(code == 200 and not closed, "... and after a request with a body (%d)" % code)
check(d.logtext().count("the request head holds a NUL byte") == len(nul) + 1, "each logged")
check(invalid_total() - before == len(nul) + 1, "each counted as an invalid request in /metrics")
# a request sent behind another before its reply was read with that one's
# bytes, unchecked: the first is answered, the connection closed, and the
# second never parsed
for what, data in {"NUL in a pipelined request": G + b"GET /health\x00junk HTTP/1.1\r\nHost: x\r\n\r\n",
                   "a pipelined request": G + G,
                   "a request pipelined behind a body": H + b"Content-Length: 16\r\n\r\n{\"content\":\"hi\"}" + G}.items():
    code, closed = send(data)
    check(replies == [200] and closed, "%s: one reply (%s), then closed" % (what, replies))
# bodies may hold a NUL (a KV import is binary): this one is JSON, so invalid
J = b'{"content":"a\x00b"}'
code = d.raw(H + b"Content-Length: %d\r\n\r\n" % len(J) + J)
check(code == 400, "a NUL in a JSON body: the JSON parser's 400 (%d)" % code)
# the end of a chunked body is libmicrohttpd's to find: its reply closes
code, closed = send(H + b"Transfer-Encoding: chunked\r\n\r\n10\r\n{\"content\":\"hi\"}\r\n0\r\n\r\n")
check(code == 200 and closed, "a chunked body: 200, then closed (%d, %s)" % (code, closed))

check(d.get("/health")[0] == 200, "the daemon serves on")

# 4xx log lines: one a second per client, the rest counted
before = d.logtext().count("no endpoint")
t0 = time.time()
for _ in range(200):
    d.get("/nowhere")
n = d.logtext().count("no endpoint") - before
check(n <= int(time.time() - t0) + 2, "200 404s from one client: %d log lines" % n)
time.sleep(1.1)
d.get("/nowhere")
check(re.search(r"and \d+ client errors not logged", d.logtext()), "the next line counts the ones not logged")
check(d.stop() == 0, "clean stop")
