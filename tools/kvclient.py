"""kvclient - the benchmark tools' kvtierd: started on a socket of its own,
spoken to over HTTP on that Unix socket, stopped with SIGTERM.  python3
stdlib only.

    d = Daemon(sock, logpath, ["--model", DIR, ...])   # kvtierd's own flags
    d.start()                    # seconds from exec to /health 200
    code, obj = d.request("POST", "/v1/completions", {...})
    d.ok(...)                    # the object, or SystemExit naming the status
    d.stop()                     # seconds from SIGTERM to exit 0

$KVTIER_BUILD names the build directory (default build)."""
import http.client
import json
import os
import signal
import socket
import subprocess
import time

BUILD = os.environ.get("KVTIER_BUILD", "build")


class UnixHTTP(http.client.HTTPConnection):
    """http.client over a Unix socket."""

    def __init__(self, path, timeout=30):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.path)
        self.sock = s


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


class Daemon:
    def __init__(self, sock, logpath, flags):
        self.sock = sock
        self.logpath = logpath
        self.args = [os.path.join(BUILD, "kvtierd"), "--socket", sock, "--log", logpath] + flags
        self.proc = None

    def start(self):
        """Seconds from exec to /health 200."""
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL)
        while True:
            if self.proc.poll() is not None:
                raise SystemExit("kvtierd exited %d; see %s" % (self.proc.returncode, self.logpath))
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return time.perf_counter() - t0
            except OSError:
                pass
            if time.perf_counter() - t0 > 300:
                raise SystemExit("kvtierd not ready after 300 s")
            time.sleep(0.01)

    def stop(self):
        """Seconds from SIGTERM to exit (every stale session written)."""
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(600)
        if rc != 0:
            raise SystemExit("kvtierd exited %d on SIGTERM" % rc)
        return time.perf_counter() - t0

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def raw(self, method, path, body=None, timeout=1800, ctype="application/octet-stream"):
        """(status, bytes)."""
        c = UnixHTTP(self.sock, timeout)
        try:
            c.request(method, path, body=body, headers={"Content-Type": ctype} if body is not None else {})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()

    def request(self, method, path, body=None, timeout=1800):
        """(status, the JSON reply, or its bytes when it is not JSON); body is sent as JSON."""
        code, raw = self.raw(method, path, None if body is None else json.dumps(body), timeout, "application/json")
        try:
            return code, json.loads(raw)
        except ValueError:
            return code, raw

    def ok(self, method, path, body=None):
        code, r = self.request(method, path, body)
        if code != 200:
            raise SystemExit("%s %s: %d %s" % (method, path, code, str(r)[:300]))
        return r
