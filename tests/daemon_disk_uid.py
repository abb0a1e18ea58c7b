"""The disk tier keeps users apart: a session of uid A, spilled to disk and
then persisted across a restart, cannot be listed, read, restored (used),
exported or deleted by uid B (403 or absent), while A continues it from
disk.  Needs root: kvtierd runs as root with --allow-group and the clients
run as two other uids (skipped otherwise)."""
import grp
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check  # noqa: E402

if os.geteuid() != 0:
    print("skip: needs root (kvtierd as root with --allow-group, clients as two other uids)")
    sys.exit(77)
group = next((g for g in ("nogroup", "nobody", "users") if g in {e.gr_name for e in grp.getgrall()}), None)
if group is None:
    print("skip: no group nogroup, nobody or users to name in --allow-group")
    sys.exit(77)
gid = grp.getgrnam(group).gr_gid
UID_A, UID_B = 65534, 65533

# runs as another uid: each argv[2:] item is "METHOD PATH [JSON]"; prints [[status, body], ...]
CLIENT = r"""
import http.client, json, socket, sys
class C(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(sys.argv[1])
out = []
for item in sys.argv[2:]:
    method, path, *body = item.split(" ", 2)
    c = C("localhost", timeout=60)
    c.request(method, path, body=body[0] if body else None, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    raw = r.read()
    try:
        out.append([r.status, json.loads(raw)])
    except ValueError:
        out.append([r.status, len(raw)])
    c.close()
print(json.dumps(out))
"""

d = Daemon("--allow-group", group, "--spill-after", "1")
os.chmod(d.tmp, 0o711)
d.sock = os.path.join(d.tmp, "run", "kvtierd.sock")
d.start()


def as_uid(uid, *reqs):
    r = subprocess.run([sys.executable, "-c", CLIENT, d.sock] + list(reqs), user=uid, group=gid, extra_groups=[],
                       cwd="/", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


prompt = [(i * 53 + 7) % 1900 + 50 for i in range(40)]
gen = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_tokens": True}
(code, s), = as_uid(UID_A, "POST /v1/sessions " + json.dumps({"prompt": prompt[:30]}))
check(code == 200, "uid A creates a session")
sid = s["id"]
(code, r1), = as_uid(UID_A, "POST /v1/completions " + json.dumps(dict(gen, prompt=prompt, session=sid)))
check(code == 200, "uid A uses it")
for _ in range(100):
    (code, s), = as_uid(UID_A, "GET /v1/sessions/" + sid)
    if s["bytes"]["disk"] > 0 and s["bytes"]["device"] == 0:
        break
    time.sleep(0.2)
check(s["bytes"]["disk"] > 0 and s["bytes"]["device"] == 0, "A's session went to disk")
path = os.path.join(d.sock + ".disk", "u%d" % UID_A, sid + ".kvt")
st = os.stat(path)
check(st.st_uid == 0 and st.st_mode & 0o777 == 0o600 and
      os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700,
      "its file is kvtierd's (uid 0), 0600, in a 0700 directory of uid A's namespace")


def b_cannot(when):
    res = as_uid(UID_B, "GET /v1/sessions", "GET /v1/sessions/" + sid,
                 "POST /v1/completions " + json.dumps(dict(gen, prompt=prompt, session=sid)),
                 "GET /v1/sessions/%s/kv" % sid, "POST /v1/sessions/%s/fork {}" % sid, "DELETE /v1/sessions/" + sid)
    codes = [c for c, _ in res]
    check(res[0][0] == 200 and res[0][1]["data"] == [] and codes[1:] == [403] * 5,
          "%s: uid B lists nothing, and reading, using, exporting, forking, deleting A's session get 403 (%s)" %
          (when, codes))
    (code, s2), = as_uid(UID_A, "GET /v1/sessions/" + sid)
    check(code == 200 and s2["bytes"]["disk"] > 0 and s2["bytes"]["device"] == 0 and os.path.exists(path),
          "%s: A's session is still on disk, untouched" % when)


b_cannot("spilled")
check(d.stop() == 0, "SIGTERM")
d.start()
b_cannot("after a restart")
nxt = prompt + r1["choices"][0]["tokens"] + [5]
(code, r2), = as_uid(UID_A, "POST /v1/completions " + json.dumps(dict(gen, prompt=nxt, session=sid)))
check(code == 200 and r2["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) + 5,
      "uid A continues its session from disk (%d cached)" % r2["usage"]["prompt_tokens_details"]["cached_tokens"])
d.stop()
