"""daemon_harness - starts kvtierd on a temporary socket with a tiny random
model and talks HTTP/1.1 to it over the Unix socket (stdlib only).  Used by
tests/daemon*.test.sh; exits 77 (skip) when kvtierd or the model tool is
missing.  The daemon is killed and the temp dir removed on exit."""
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
from kvclient import UnixHTTP  # noqa: E402  (tests/ may use tools/, the layer below)

BUILD = os.environ.get("KVTIER_BUILD", "build")
KVTIERD = os.path.join(BUILD, "kvtierd")
# the Python with torch for tools/mkmodel.py (tests/python.h says why)
PYTHON = os.environ.get("KVTIER_PYTHON") or "/usr/bin/python3"


def skip(why):
    print("skip:", why)
    sys.exit(77)


def make_model(tmp):
    """A tiny random llama with the built-in tokenizer (or $KVTIER_TEST_MODEL)."""
    if os.environ.get("KVTIER_TEST_MODEL"):
        return os.environ["KVTIER_TEST_MODEL"]
    out = os.path.join(tmp, "model")
    if not os.path.exists("tools/mkmodel.py") or not os.path.exists("model/builtin/tokenizer.json"):
        skip("tools/mkmodel.py or model/builtin/tokenizer.json missing")
    return mkmodel(out, "--arch", "llama", "--preset", "tiny")


def mkmodel(out, *args):
    """tools/mkmodel.py ARGS into out, with the built-in tokenizer and a
    2048-token vocabulary; the test is skipped when it fails."""
    r = subprocess.run([PYTHON, "tools/mkmodel.py", *args, "--vocab", "2048",
                        "--tokenizer-from", "model/builtin", "--out", out], capture_output=True, text=True)
    if r.returncode != 0:
        skip("mkmodel failed: " + r.stderr[-300:])
    return out


def template_model(out, template):
    """A one-layer model (mkmodel) whose tokenizer_config.json carries the
    chat_template template."""
    mkmodel(out, "--arch", "llama", "--layers", "1", "--dim", "32")
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = template
    with open(path, "w") as f:
        json.dump(cfg, f)
    return out


class Daemon:
    def __init__(self, *args, model=None, tmp=None):
        if not os.access(KVTIERD, os.X_OK):
            skip(KVTIERD + " not built")
        self.tmp = tmp or tempfile.mkdtemp(prefix="kvtier-test.")
        self.own_tmp = tmp is None
        self.model = model or make_model(self.tmp)
        self.sock = os.path.join(self.tmp, "kvtierd.sock")
        self.log = os.path.join(self.tmp, "kvtierd.log")
        self.args = list(args)
        self.proc = None
        atexit.register(self.cleanup)

    def start(self, wait=True, extra_env=None):
        env = dict(os.environ)
        env.update(extra_env or {})
        self.logf = open(self.log, "ab")
        # each socket its own disk tier, kept across restarts of this daemon
        disk = [] if "--disk-dir" in self.args else ["--disk-dir", self.sock + ".disk"]
        self.proc = subprocess.Popen([KVTIERD, "--model", self.model, "--socket", self.sock, "--threads", "1"] +
                                     disk + self.args, stdout=self.logf, stderr=self.logf, env=env)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout=60):
        t = time.time() + timeout
        while time.time() < t:
            if self.proc.poll() is not None:
                raise AssertionError("kvtierd exited %d:\n%s" % (self.proc.returncode, self.logtext()))
            try:
                code, _ = self.get("/health")
                if code == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError("kvtierd not ready:\n" + self.logtext())

    def logtext(self):
        with open(self.log, errors="replace") as f:
            return f.read()

    # A reply may take minutes on the strict backend of a loaded machine
    # (a restore that starts over recomputes its whole prompt); a test that
    # hangs still ends at run.sh's timeout.
    def conn(self, timeout=240):
        return UnixHTTP(self.sock, timeout)

    def request(self, method, path, body=None, headers=None):
        c = self.conn()
        try:
            data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
            c.request(method, path, body=data, headers=headers or {})
            r = c.getresponse()
            raw = r.read()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw
        finally:
            c.close()

    def get(self, path):
        return self.request("GET", path)

    def post(self, path, body):
        return self.request("POST", path, body, {"Content-Type": "application/json"})

    def post_ok(self, path, body):
        """POST that must answer 200: the parsed reply."""
        code, r = self.post(path, body)
        assert code == 200, (code, r)
        return r

    def stream(self, path, body):
        """POST with stream: the list of parsed SSE data payloads ('[DONE]' kept as a string)."""
        c = self.conn()
        c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200, (r.status, r.read())
        assert r.getheader("Content-Type", "").startswith("text/event-stream")
        events = []
        for block in r.read().decode().split("\n\n"):
            if not block:
                continue
            assert block.startswith("data: "), block
            payload = block[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
        c.close()
        return events

    def raw(self, data, timeout=5):
        """Sends raw bytes; returns the status code of the reply (0 when the connection closed without one)."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        s.connect(self.sock)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        buf = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except (OSError, socket.timeout):
            pass
        s.close()
        if not buf.startswith(b"HTTP/1."):
            return 0
        return int(buf.split(b" ", 2)[1])

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("kvtierd did not stop on signal %d" % sig)
        return self.proc.returncode

    def cleanup(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.own_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


def wait_spilled(d, sid, timeout=30):
    """Session sid's info once all of it (an encoder-decoder session's
    cross cache too) is on disk and none in memory."""
    end = time.time() + timeout
    while time.time() < end:
        s = d.get("/v1/sessions/" + sid)[1]
        enc = s.get("encoder", {"bytes": {"device": 0, "host": 0}})["bytes"]
        if s["bytes"]["disk"] > 0 and s["bytes"]["device"] == s["bytes"]["host"] == enc["device"] == enc["host"] == 0:
            return s
        time.sleep(0.1)
    raise AssertionError("session %s never left memory: %s" % (sid, d.get("/v1/sessions/" + sid)[1]))


def metric(d, name, labels=""):
    """The value of d's /metrics sample kvtier_NAME (labels, e.g.
    '{reason="oom"}', as the exposition writes them)."""
    for line in d.get("/metrics")[1].decode().splitlines():
        if line.startswith("kvtier_" + name + labels + " "):
            return float(line.split()[1])
    raise KeyError(name + labels)


def damage_spill(d, sid, back=5000):
    """Flips a byte of session sid's file on d's disk tier, back bytes
    before its end."""
    path = os.path.join(d.sock + ".disk", "u%d" % os.getuid(), sid + ".kvt")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - back)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x5A]))


def forge_spill_meta(d, sid, edit):
    """Rewrites the JSON meta of session sid's file on d's disk tier with
    edit(meta) applied and every hash made right again, as a hand-edited
    file would be: the container accepts it, so the daemon's own checks of
    the meta are what is left to refuse it."""
    import ctypes
    import struct
    xxh = ctypes.CDLL("libxxhash.so.0")
    xxh.XXH3_64bits.restype = ctypes.c_uint64
    xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    path = os.path.join(d.sock + ".disk", "u%d" % os.getuid(), sid + ".kvt")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    header = struct.unpack_from("<I", data, 12)[0]
    off, length = struct.unpack_from("<QQ", data, 176)
    meta = json.loads(bytes(data[off:off + length]))
    edit(meta)
    new = json.dumps(meta).encode()
    end = struct.unpack_from("<Q", data, 224)[0] if struct.unpack_from("<I", data, 212)[0] else len(data)
    if off + len(new) > end:
        raise AssertionError("the forged meta does not fit its section")
    data[off:off + length] = bytes(length)
    data[off:off + len(new)] = new
    struct.pack_into("<QQ", data, 184, len(new), xxh.XXH3_64bits(new, len(new)))
    struct.pack_into("<Q", data, header - 8, xxh.XXH3_64bits(bytes(data[:header - 8]), header - 8))
    with open(path, "wb") as f:
        f.write(data)


def forge_sparse_session(d, template, sid, chunks):
    """Writes session sid's file on d's disk tier as a valid container
    (header, hashes) whose data is `chunks` raw MiB of zeros, a sparse
    file, with the geometry and meta (its id made sid) of session
    template's file: a file that claims far more KV than its tokens."""
    import ctypes
    import struct
    xxh = ctypes.CDLL("libxxhash.so.0")
    xxh.XXH3_64bits.restype = ctypes.c_uint64
    xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    h = lambda b: xxh.XXH3_64bits(bytes(b), len(b))  # noqa: E731
    udir = os.path.join(d.sock + ".disk", "u%d" % os.getuid())
    with open(os.path.join(udir, template + ".kvt"), "rb") as f:
        t = f.read()
    off, length = struct.unpack_from("<QQ", t, 176)
    meta = json.loads(t[off:off + length])
    meta["id"] = sid
    meta = json.dumps(meta).encode()
    align = lambda n: (n + 4095) // 4096 * 4096  # noqa: E731
    mib = 1 << 20
    hl = 224 + 32 * chunks + 8
    hdr = bytearray(hl)
    hdr[:112] = t[:112]  # magic, version, geometry, namespace
    struct.pack_into("<I", hdr, 12, hl)
    hdr[112:176] = sid.encode().ljust(64, b"\0")
    meta_off = align(hl)
    data_off = meta_off + align(len(meta))
    struct.pack_into("<QQQQIIQ", hdr, 176, meta_off, len(meta), h(meta), chunks * mib, mib, chunks, 0)
    zero = h(bytes(mib))
    for i in range(chunks):
        struct.pack_into("<QIIIIQ", hdr, 224 + 32 * i, data_off + i * mib, mib, mib, 0, 0, zero)
    struct.pack_into("<Q", hdr, hl - 8, h(hdr[:hl - 8]))
    with open(os.path.join(udir, sid + ".kvt"), "wb") as f:
        f.write(hdr)
        f.seek(meta_off)
        f.write(meta)
        f.truncate(data_off + chunks * mib)


def read_to_eof(sock):
    """Every byte the peer sends until it closes or shuts down its side."""
    buf = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return buf
        buf += chunk


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok -", what.split("\n")[0][:120])


def resp(addr, *args, timeout=5):
    """One command over RESP; returns the reply (bytes, int, list, None) or raises on an error reply."""
    s = socket.socket(socket.AF_UNIX if isinstance(addr, str) else socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(addr)
    out = b"*%d\r\n" % len(args)
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out += b"$%d\r\n%s\r\n" % (len(a), a)
    s.sendall(out)
    f = s.makefile("rb")

    def read():
        line = f.readline()
        t, rest = line[:1], line[1:-2]
        if t == b"+":
            return rest
        if t == b"-":
            raise RuntimeError(rest.decode())
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            v = f.read(n + 2)[:-2]
            return v
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [read() for _ in range(n)]
        raise RuntimeError("bad reply %r" % line)

    try:
        return read()
    finally:
        s.close()
