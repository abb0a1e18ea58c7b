"""HTTP framing kvtierd refuses: two Content-Lengths, Content-Length with
chunked, a NUL (%00) in the path, transfer codings other than chunked, a
garbage request line -- each a 400 and a closed connection (the client
does not half-close: the daemon must close).  A client looping on bad
requests gets one log line a second, with a count of the rest."""
import re
import socket
import time

from daemon_harness import Daemon, check

d = Daemon()
d.start()


def send(data, timeout=5):
    """(status, closed by the daemon before timeout)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(d.sock)
    s.sendall(data)
    buf, closed = b"", False
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
    code = int(buf.split(b" ", 2)[1]) if buf.startswith(b"HTTP/1.") else 0
    return code, closed


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
