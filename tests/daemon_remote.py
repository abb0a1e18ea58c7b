"""The remote tier: prefix-cache blocks shared through Redis.  The test runs
its own redis-server processes (a Unix socket in a temp dir, three loopback
ports for a cluster) and kills only those.

- two daemons, one Redis: B's first request on a prompt A computed (90
  tokens, then 2,032) gets cached_tokens from the remote tier and A's (= a
  cold run's) tokens;
- a private request publishes nothing, nor a private session (its start,
  its turns, its fork's);
  --remote-share prefix-only
  publishes a chat's system part, a completion's shared_prefix (tokens or
  text; it bounds --remote-share all too), nothing else;
- blocks are published while the request still decodes; compressed
  values (--remote-compress zstd) are read by a daemon without the flag;
- a value written for another layout (another KV dtype) and corrupted
  values are misses, counted, never loaded;
- AUTH as an ACL user (--remote-user, --remote-password-file), and a
  wrong password (a counted miss, never logged);
- faults: Redis down at start (logged once per connection, not per
  request), stopped (SIGSTOP: bounded by --remote-timeout), killed and back
  (reconnects), full (OOM): every request completes with the tokens of a
  daemon without the remote tier;
- a three-master cluster (slots assigned by the test, keys routed by CRC16
  slot); a slot migrated under running daemons (ASK followed while it
  migrates, MOVED once it moved: full hits); then one master killed with SIGKILL while requests run: they
  complete with the same tokens, and a fresh daemon hits the chain's
  blocks up to the dead master's first one, exactly."""
import glob
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, resp, skip  # noqa: E402

REDIS = shutil.which("redis-server")
if not REDIS:
    skip("redis-server not installed (tools/deps.sh test)")

BT = 16
GEN = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_tokens": True}
procs = []


def start_redis(tmp, name, *extra, port=None, conf=None):
    d = os.path.join(tmp, name)
    os.makedirs(d, exist_ok=True)
    sock = os.path.join(d, "redis.sock")
    if conf:
        with open(os.path.join(d, "redis.conf"), "w") as f:
            f.write(conf)
    args = [REDIS] + ([os.path.join(d, "redis.conf")] if conf else []) + ["--port", str(port or 0), "--unixsocket", sock, "--save", "", "--appendonly", "no",
            "--dir", d, "--bind", "127.0.0.1", "--enable-debug-command", "yes"] + list(extra)
    p = subprocess.Popen(args, stdout=open(os.path.join(d, "log"), "ab"), stderr=subprocess.STDOUT)
    procs.append(p)
    deadline = time.time() + 30  # a loaded machine, a sanitizer build beside it
    while time.time() < deadline and p.poll() is None:
        try:
            resp(sock, "PING")
            return p, sock
        except RuntimeError:  # NOAUTH: up, and wants a password
            return p, sock
        except OSError:
            time.sleep(0.02)
    raise AssertionError("redis-server did not start: " + open(os.path.join(d, "log")).read()[-500:])


def stop_redis(p):
    if p.poll() is None:
        p.send_signal(signal.SIGCONT)
        p.kill()
        p.wait()


def start_cluster_node(tmp, i, ports):
    """A cluster node needs a fixed port and its bus at port + 10000. Both are drawn
    below the kernel's ephemeral range, so no outgoing connection can take them, and
    a port another program grabbed before the bind means another draw. Without full
    coverage the masters left serve their slots once a dead one is marked failed."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for attempt in range(20):
        port = random.randint(1024, max(low - 10001, 2048))
        if port in ports:
            continue
        try:
            node = start_redis(tmp, "c%d-%d" % (i, attempt), "--cluster-enabled", "yes",
                               "--cluster-config-file", "nodes.conf",
                               "--cluster-require-full-coverage", "no", port=port)
        except AssertionError as err:
            if "Address already in use" not in str(err):
                raise
            continue
        ports.append(port)
        return node
    raise AssertionError("no free port pair for a cluster node in 20 draws")


def _sleep(sock):
    try:
        resp(sock, "DEBUG", "SLEEP", 10, timeout=30)
    except (OSError, RuntimeError):
        pass  # killed under it


def metric(dm, name, labels=""):
    for line in dm.get("/metrics")[1].decode().splitlines():
        if line.startswith("kvtier_" + name + labels + " "):
            return float(line.split()[1])
    return 0.0


def complete(dm, ids, **kw):
    code, r = dm.post("/v1/completions", dict(GEN, **dict(kw, prompt=ids)))
    assert code == 200, (code, r)
    return r["choices"][0]["tokens"], r["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_metric(dm, name, labels, at_least, timeout=10):
    t = time.time() + timeout
    while time.time() < t:
        v = metric(dm, name, labels)
        if v >= at_least:
            return v
        time.sleep(0.05)
    return metric(dm, name, labels)


def prompt_of(seed, n=90):
    return [(i * 61 + seed * 7 + 11) % 1900 + 50 for i in range(n)]


ref = Daemon("--disk-dir", "none")
ref.start()
tmp = ref.tmp
want = {}


def reference(p):
    key = tuple(p)
    if key not in want:
        want[key] = complete(ref, p)[0]
    return want[key]


def daemon(name, *args):
    d = Daemon("--disk-dir", "none", "--remote-timeout", "300", *args, model=ref.model, tmp=tmp)
    d.sock = os.path.join(tmp, name + ".sock")
    d.log = os.path.join(tmp, name + ".log")
    return d.start()


try:
    rp, rsock = start_redis(tmp, "r1")
    url = "unix:" + rsock
    # ---- two daemons, one Redis ----
    a = daemon("a", "--remote", url)
    b = daemon("b", "--remote", url)
    p1 = prompt_of(1)
    toks, cached = complete(a, p1)
    check(toks == reference(p1) and cached == 0, "daemon A computes the prompt (a cold run's tokens)")
    n_blk = len(p1) // BT
    pub = wait_metric(a, "remote_blocks_total", '{result="published"}', n_blk)
    keys = resp(rsock, "KEYS", "kvt:*")
    check(pub == n_blk and len(keys) == n_blk, "A published its %d prompt blocks (%d keys)" % (n_blk, len(keys)))
    ttl = resp(rsock, "TTL", keys[0])
    check(0 < ttl <= 86400, "published with a TTL (%d s)" % ttl)
    resp(rsock, "EXPIRE", keys[0], 1000)
    toks, cached = complete(b, p1)
    hit = (len(p1) - 1) // BT * BT
    check(toks == reference(p1) and cached == hit,
          "daemon B's first request: cached_tokens %d from the remote tier, the same tokens" % cached)
    check(metric(b, "remote_blocks_total", '{result="hit"}') == hit // BT and metric(b, "remote_hits_total") == 1,
          "B's /metrics count %d remote block hits" % (hit // BT))
    check(resp(rsock, "TTL", keys[0]) > 1000, "a hit refreshed the key's TTL (GETEX)")
    check(metric(b, "remote_blocks_total", '{result="published"}') == 0 and
          wait_metric(b, "remote_blocks_total", '{result="published"}', 1, timeout=0.5) == 0,
          "blocks B got from the remote tier are not published again")

    # ---- a 2k-token prefix: B's first request on it, from the remote tier ----
    p2k = prompt_of(21, 2032)
    base = metric(a, "remote_blocks_total", '{result="published"}')
    toks, cached = complete(a, p2k)
    check(toks == reference(p2k) and cached == 0, "daemon A computes a %d-token prompt" % len(p2k))
    wait_metric(a, "remote_blocks_total", '{result="published"}', base + len(p2k) // BT)
    toks, cached = complete(b, p2k)
    check(toks == reference(p2k) and cached == (len(p2k) - 1) // BT * BT and cached >= 2000,
          "daemon B's first request on that prefix: cached_tokens %d from the remote tier, a cold run's tokens" % cached)

    # ---- published as the prefill computes them, not when the request ends ----
    base = metric(a, "remote_blocks_total", '{result="published"}')
    p12 = prompt_of(12)
    # eight choices of 1500 tokens: still decoding however fast the machine
    long_req = threading.Thread(target=complete, args=(a, p12), kwargs={"max_tokens": 1500, "n": 8})
    long_req.start()
    pub = wait_metric(a, "remote_blocks_total", '{result="published"}', base + n_blk)
    check(pub == base + n_blk and long_req.is_alive(),
          "a request's blocks are published while it still decodes (%d of %d)" % (pub - base, n_blk))

    # ---- compressed values: self-describing, read by a daemon without the flag ----
    z = daemon("z", "--remote", url, "--remote-compress", "zstd")
    before_z = set(resp(rsock, "KEYS", "kvt:*"))
    p13 = prompt_of(13)
    complete(z, p13)
    wait_metric(z, "remote_blocks_total", '{result="published"}', n_blk)
    zkeys = [k for k in resp(rsock, "KEYS", "kvt:*") if k not in before_z]
    codecs = set()
    for k in zkeys:
        v = resp(rsock, "GET", k)
        codecs.add(int.from_bytes(v[224 + 16:224 + 20], "little"))  # the first chunk's codec in the container
    check(codecs and 0 not in codecs, "--remote-compress zstd: every value's chunk table says compressed (codecs %s)" % codecs)
    toks, cached = complete(b, p13)
    check(toks == reference(p13) and cached == (len(p13) - 1) // BT * BT,
          "a daemon without the flag reads compressed values: cached_tokens %d, the same tokens" % cached)
    check(z.stop() == 0, "and it exits cleanly")
    long_req.join()

    # ---- private requests ----
    p2 = prompt_of(2)
    n_keys = len(resp(rsock, "KEYS", "kvt:*"))
    toks, _ = complete(a, p2, private=True)
    time.sleep(0.3)
    check(toks == reference(p2) and len(resp(rsock, "KEYS", "kvt:*")) == n_keys, "a private request publishes nothing")

    # ---- a private session start ----
    n0 = metric(a, "remote_blocks_total", '{result="published"}')
    code, r = a.post("/v1/sessions", {"prompt": prompt_of(16), "private": True})
    sid = r["id"]
    code2, _ = a.post("/v1/completions", dict(GEN, prompt=prompt_of(16) + prompt_of(18, 40), session=sid))
    code3, f = a.post("/v1/sessions/%s/fork" % sid, {})
    code4, _ = a.post("/v1/completions", dict(GEN, prompt=prompt_of(16) + prompt_of(19, 40), session=f["id"]))
    time.sleep(0.3)
    check((code, code2, code3, code4) == (200,) * 4 and metric(a, "remote_blocks_total", '{result="published"}') == n0,
          "a session created with private: true publishes nothing: its start, a turn on it, a turn on its fork")
    # the mark survives a restart: it is in the session's file
    ps = Daemon("--remote", url, "--remote-timeout", "300", model=ref.model, tmp=tmp)
    ps.sock, ps.log = os.path.join(tmp, "ps.sock"), os.path.join(tmp, "ps.log")
    ps.start()
    code, r = ps.post("/v1/sessions", {"prompt": prompt_of(16), "private": True})
    sid = r["id"]
    check(code == 200 and ps.stop() == 0, "a private session, then SIGTERM (its KV to the disk tier)")
    ps.start()
    code, _ = ps.post("/v1/completions", dict(GEN, prompt=prompt_of(16) + prompt_of(18, 40), session=sid))
    time.sleep(0.3)
    check(code == 200 and metric(ps, "remote_blocks_total", '{result="published"}') == 0 and ps.stop() == 0,
          "after the restart a turn on it still publishes nothing")
    code, r = a.post("/v1/sessions", {"prompt": prompt_of(17)})
    check(code == 200 and wait_metric(a, "remote_blocks_total", '{result="published"}', n0 + n_blk) == n0 + n_blk,
          "and one without it publishes its start's %d blocks" % n_blk)

    # ---- --remote-share prefix-only: a chat's blocks before its first user message ----
    po = daemon("po", "--remote", url, "--remote-share", "prefix-only")
    system = " ".join("rule %d: answer in the voice of a careful librarian" % i for i in range(6))
    user = " ".join("question %d about the archive and its catalogue" % i for i in range(12))
    before = len(resp(rsock, "KEYS", "kvt:*"))
    code, r = po.post("/v1/chat/completions", {"messages": [{"role": "system", "content": system},
                                                             {"role": "user", "content": user}],
                                               "max_tokens": 2, "temperature": 0})
    n_prompt = r["usage"]["prompt_tokens"]
    wait_metric(po, "remote_blocks_total", '{result="published"}', 1)
    time.sleep(0.3)
    got = metric(po, "remote_blocks_total", '{result="published"}')
    check(code == 200 and 1 <= got < n_prompt // BT - 2 and len(resp(rsock, "KEYS", "kvt:*")) == before + got,
          "prefix-only: %d of the %d-token chat's blocks published (the system prompt's)" % (got, n_prompt))
    code, r = po.post("/v1/completions", dict(GEN, prompt=prompt_of(10)))
    time.sleep(0.2)
    check(code == 200 and metric(po, "remote_blocks_total", '{result="published"}') == got,
          "prefix-only: a raw prompt publishes nothing")

    # ---- a completion's shared_prefix: the blocks before it, under prefix-only and all ----
    def published_after(dm, n0, want):
        wait_metric(dm, "remote_blocks_total", '{result="published"}', n0 + want)
        time.sleep(0.2)  # and nothing more
        return metric(dm, "remote_blocks_total", '{result="published"}') - n0

    n0 = metric(po, "remote_blocks_total", '{result="published"}')
    p14 = prompt_of(14)
    code, _ = po.post("/v1/completions", dict(GEN, prompt=p14, shared_prefix=40))
    got = published_after(po, n0, 2)
    toks, cached = complete(b, p14)
    check(code == 200 and got == 2 and cached == 32 and toks == reference(p14),
          "prefix-only, shared_prefix 40 tokens: its 2 whole blocks published, none after (B gets %d cached)" % cached)
    doc = " ".join("clause %d of the shared contract between the parties" % i for i in range(8))
    question = " and now a question only this user asks about clause %d" % 3
    code, r = po.post("/tokenize", {"content": doc})
    doc_ids = r["tokens"]
    code, r = po.post("/tokenize", {"content": doc + question})
    n_agree = next((i for i, (x, y) in enumerate(zip(doc_ids, r["tokens"])) if x != y), min(len(doc_ids), len(r["tokens"])))
    n0 += got
    code, _ = po.post("/v1/completions", dict(GEN, prompt=doc + question, shared_prefix=doc))
    got = published_after(po, n0, n_agree // BT)
    check(code == 200 and got == n_agree // BT and len(r["tokens"]) // BT > got,
          "prefix-only, shared_prefix as the prompt's first text: %d blocks (its %d tokens), none of the question's" %
          (got, n_agree))
    code, r = po.post("/v1/completions", dict(GEN, prompt=doc + question, shared_prefix=question))
    check(code == 400 and r["error"]["param"] == "shared_prefix", "shared_prefix text that does not start the prompt: 400")
    code, r = po.post("/v1/completions", dict(GEN, prompt=p14, shared_prefix="x"))
    check(code == 400, "shared_prefix text with a prompt of token ids: 400")
    check(po.stop() == 0, "and it exits cleanly")
    n0 = metric(a, "remote_blocks_total", '{result="published"}')
    p15 = prompt_of(15)
    complete(a, p15, shared_prefix=20)
    check(published_after(a, n0, 1) == 1, "under --remote-share all, shared_prefix still bounds what is published")

    # ---- another layout's value, corrupt values ----
    # the same chain under another KV dtype looks for these keys with that
    # dtype (enum be_dtype: 0 f32, 2 bf16) in the layout part
    other, other_id = ("bf16", "d2") if keys[0].split(b":")[2].startswith(b"d0.") else ("f32", "d0")
    for k in keys:
        ks = k.decode()
        parts = ks.split(":")
        lay = parts[2].split(".")
        lay[0] = other_id
        resp(rsock, "SET", ":".join(parts[:2] + [".".join(lay)] + parts[3:]), resp(rsock, "GET", k))
    f32 = daemon("f", "--remote", url, "--kv-dtype", other)
    f32ref = daemon("fr", "--kv-dtype", other)
    toks, cached = complete(f32, p1)
    check(cached == 0 and toks == complete(f32ref, p1)[0] and metric(f32, "remote_errors_total", '{kind="foreign"}') >= 1,
          "a value written for another layout is a miss, counted as foreign, never loaded")
    check(f32.stop() == 0 and f32ref.stop() == 0, "and both exit cleanly")
    for i, k in enumerate(keys):
        v = bytearray(resp(rsock, "GET", k))
        if i == 0:
            v = b"x" * (40 * len(v))  # far longer than a block's value: read past, never held
        elif i % 2:
            v[len(v) // 2] ^= 0x40  # a flipped bit in the KV
        else:
            v = b"garbage" * 3
        resp(rsock, "SET", k, bytes(v))
    c = daemon("c", "--remote", url)
    toks, cached = complete(c, p1)
    check(toks == reference(p1) and cached == 0 and metric(c, "remote_errors_total", '{kind="corrupt"}') >= 1,
          "corrupt values (oversized, garbage, a flipped bit) are misses, counted, with the same tokens")
    toks, cached = complete(c, p13)
    check(toks == reference(p13) and cached == (len(p13) - 1) // BT * BT and
          metric(c, "remote_errors_total", '{kind="io"}') == 0,
          "and the connection reads the next lookup's values in step (cached_tokens %d)" % cached)

    # ---- full: OOM command not allowed ----
    resp(rsock, "CONFIG", "SET", "maxmemory-policy", "noeviction")
    resp(rsock, "CONFIG", "SET", "maxmemory", "1")
    p3 = prompt_of(3)
    for p in (p3, prompt_of(4)):
        toks, _ = complete(c, p)
        check(toks == reference(p), "Redis full: the request completes with the same tokens")
    check(wait_metric(c, "remote_errors_total", '{kind="oom"}', 1) >= 1 and c.logtext().count("redis is full") == 1,
          "OOM counted, and logged once")
    resp(rsock, "CONFIG", "SET", "maxmemory", "0")

    # ---- slow: a stopped server, bounded by --remote-timeout ----
    d = daemon("d", "--remote", url)
    rp.send_signal(signal.SIGSTOP)
    p5 = prompt_of(5)
    toks, cached = complete(d, p5)
    check(toks == reference(p5) and cached == 0 and metric(d, "remote_errors_total", '{kind="timeout"}') >= 1,
          "a stopped Redis: the lookup times out, the request computes with the same tokens")
    rp.send_signal(signal.SIGCONT)

    # ---- killed mid-request: the lookup waits on a server busy in DEBUG SLEEP, which is then killed ----
    k = daemon("k", "--remote", url, "--remote-timeout", "20000")
    complete(k, prompt_of(11))  # connected
    sleeper = threading.Thread(target=_sleep, args=(rsock,))
    sleeper.start()
    busy = time.time() + 10
    while time.time() < busy:  # until the server is held in DEBUG SLEEP
        try:
            resp(rsock, "PING", timeout=0.1)
            time.sleep(0.05)
        except socket.timeout:
            break
    threading.Timer(0.5, stop_redis, (rp,)).start()
    t0 = time.time()
    toks, cached = complete(k, p1)
    sleeper.join()
    check(toks == reference(p1) and cached == 0 and time.time() - t0 < 15 and
          metric(k, "remote_errors_total", '{kind="io"}') >= 1,
          "Redis killed while a lookup waits on it: a miss (io), the request completes with the same tokens")
    check(k.stop() == 0, "and it exits cleanly")

    # ---- killed, then back ----
    p6 = prompt_of(6)
    n0 = d.logtext().count("unavailable")
    for _ in range(3):
        toks, _ = complete(d, p6)
        check(toks == reference(p6), "Redis killed: requests complete with the same tokens")
    check(d.logtext().count("unavailable") - n0 <= 2, "the loss is logged once per connection, not per request")
    rp, rsock2 = start_redis(tmp, "r1")
    # the reconnect backoff has grown with each failed connect (up to 5 s):
    # fresh prompts until one publishes
    pub0, back, seed = metric(d, "remote_blocks_total", '{result="published"}'), time.time() + 30, 70
    while time.time() < back:
        complete(d, prompt_of(seed))
        seed += 1
        if "is back" in d.logtext() and \
                wait_metric(d, "remote_blocks_total", '{result="published"}', pub0 + 1, timeout=0.5) > pub0:
            break
        time.sleep(0.5)
    check(metric(d, "remote_blocks_total", '{result="published"}') > pub0 and "is back" in d.logtext(),
          "Redis back: the daemon reconnects and publishes again")
    stop_redis(rp)

    # ---- AUTH: an ACL user with its password from a file; a wrong password ----
    ap, asock = start_redis(tmp, "r2", conf="user default on >default-pw ~* +@all\nuser kv on >kv-pw ~kvt:* +@all\n")
    for name, pw in (("good", "kv-pw\n"), ("bad", "nope\n")):
        with open(os.path.join(tmp, name + ".pw"), "w") as f:
            f.write(pw)
    ga = daemon("ga", "--remote", "unix:" + asock, "--remote-user", "kv", "--remote-password-file",
                os.path.join(tmp, "good.pw"))
    ba = daemon("ba", "--remote", "unix:" + asock, "--remote-password-file", os.path.join(tmp, "bad.pw"))
    toks, _ = complete(ga, p1)
    got = wait_metric(ga, "remote_blocks_total", '{result="published"}', len(p1) // BT)
    check(toks == reference(p1) and got == len(p1) // BT, "AUTH as an ACL user, password from a file: published")
    toks, cached = complete(ba, p1)
    check(toks == reference(p1) and cached == 0 and metric(ba, "remote_errors_total", '{kind="auth"}') >= 1 and
          "kv-pw" not in ba.logtext() and "nope" not in ba.logtext(),
          "a wrong password: AUTH refused (counted, the password never logged), the same tokens")
    check(ga.stop() == 0 and ba.stop() == 0, "and both exit cleanly")
    stop_redis(ap)

    # ---- down at start ----
    e = daemon("e", "--remote", "unix:" + os.path.join(tmp, "none.sock"))
    for p in (p1, p5, p6):
        toks, _ = complete(e, p)
        check(toks == reference(p), "Redis down at start: the request completes with the same tokens")
    check(e.logtext().count("unavailable") == 2 and metric(e, "remote_errors_total", '{kind="connect"}') >= 1,
          "down at start: logged once per connection, counted as connect errors")
    codes = [dm.stop() for dm in (a, b, c, d, e)]
    check(codes == [0] * 5, "SIGTERM: every daemon exits cleanly (%s)" % codes)

    # ---- a three-master cluster ----
    nodes, ports = [], []
    while len(nodes) < 3:
        nodes.append(start_cluster_node(tmp, len(nodes), ports))
    for i, (_, sk) in enumerate(nodes):
        resp(sk, "CLUSTER", "ADDSLOTSRANGE", i * 5462, min(16383, i * 5462 + 5461))
    for port in ports[1:]:
        resp(nodes[0][1], "CLUSTER", "MEET", "127.0.0.1", port)
    t = time.time() + 15
    while time.time() < t and not all(b"cluster_state:ok" in resp(sk, "CLUSTER", "INFO") for _, sk in nodes):
        time.sleep(0.1)
    check(all(b"cluster_state:ok" in resp(sk, "CLUSTER", "INFO") for _, sk in nodes), "a three-master cluster is up")
    seeds = "127.0.0.1:%d" % ports[0]
    ca = daemon("ca", "--remote-cluster", seeds)
    cb = daemon("cb", "--remote-cluster", seeds)
    p8 = prompt_of(8)
    toks, _ = complete(ca, p8)
    wait_metric(ca, "remote_blocks_total", '{result="published"}', len(p8) // BT)
    per_node = [len(resp(sk, "KEYS", "kvt:*")) for _, sk in nodes]
    check(toks == reference(p8) and sum(per_node) == len(p8) // BT and sum(1 for n in per_node if n) >= 2,
          "the cluster holds the blocks on their slots' nodes (%s)" % per_node)
    toks, cached = complete(cb, p8)
    check(toks == reference(p8) and cached == (len(p8) - 1) // BT * BT,
          "B's first request: cached_tokens %d from the cluster, the same tokens" % cached)
    # which node holds which block of p8's chain (each value names its parent)
    order, where, keyof = {}, {}, {}
    for ni, (_, sk) in enumerate(nodes):
        for k in resp(sk, "KEYS", "kvt:*"):
            v = resp(sk, "GET", k)
            data = int.from_bytes(v[224:232], "little")  # the first chunk's offset: the serialized block
            flags = int.from_bytes(v[data + 32:data + 36], "little")
            h, parent = v[data + 48:data + 56], v[data + 64:data + 72] if flags else None
            order[parent] = h
            where[h] = ni
            keyof[h] = k
    chain, h = [], order.get(None)
    while h is not None:
        chain.append(h)
        h = order.get(h)
    # ---- a slot moving under the daemons: ASK while it migrates, MOVED once it moved ----
    cd = daemon("cd", "--remote-cluster", seeds)
    ce = daemon("ce", "--remote-cluster", seeds)
    complete(cd, prompt_of(30))  # each has its slot map now
    complete(ce, prompt_of(31))
    ids = [resp(sk, "CLUSTER", "MYID").decode() for _, sk in nodes]
    mk = keyof[chain[len(chain) // 2]]
    src = where[chain[len(chain) // 2]]
    dst = (src + 1) % 3
    slot = resp(nodes[src][1], "CLUSTER", "KEYSLOT", mk)
    resp(nodes[dst][1], "CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src])
    resp(nodes[src][1], "CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst])
    resp(nodes[src][1], "MIGRATE", "127.0.0.1", ports[dst], mk, 0, 5000)
    toks, cached = complete(cd, p8)
    check(toks == reference(p8) and cached == (len(p8) - 1) // BT * BT and
          metric(cd, "remote_errors_total", '{kind="reply"}') == 0,
          "a block whose slot is migrating: the ASK is followed, cached_tokens %d, the same tokens" % cached)
    for _, sk in nodes:
        resp(sk, "CLUSTER", "SETSLOT", slot, "NODE", ids[dst])
    toks, cached = complete(ce, p8)
    check(toks == reference(p8) and cached == (len(p8) - 1) // BT * BT and
          metric(ce, "remote_errors_total", '{kind="reply"}') == 0,
          "once the slot moved: the MOVED is followed, cached_tokens %d, the same tokens" % cached)
    where[chain[len(chain) // 2]] = dst
    check(cd.stop() == 0 and ce.stop() == 0, "and both exit cleanly")

    first = {}
    for i, h in enumerate(chain):
        first.setdefault(where[h], i)
    # the seed stays; of the others, the master whose first block comes latest
    victim = max((ni for ni in (1, 2) if ni in first), key=lambda ni: first[ni])
    want_cached = first[victim] * BT
    prompts = [prompt_of(20 + i) for i in range(12)]
    for p in prompts:
        reference(p)
    bad, done, after = [], [0, 0], [0, 0]
    killed = threading.Event()

    # each daemon keeps sending until two of its requests started after the kill, so the kill always
    # lands while both have requests to go, however the two share the cores
    def run(k, dm, ps):
        i = 0
        while after[k] < 2 and i < 200:
            p, late = ps[i % len(ps)], killed.is_set()
            i += 1
            try:
                if complete(dm, p)[0] != reference(p):
                    bad.append(p)
            except AssertionError as e:
                bad.append(str(e))
            done[k] += 1
            after[k] += late

    runners = [threading.Thread(target=run, args=(i, dm, prompts[i::2])) for i, dm in enumerate((ca, cb))]
    for t in runners:
        t.start()
    t_end = time.time() + 10
    while min(done) < 2 and time.time() < t_end:
        time.sleep(0.01)
    os.kill(nodes[victim][0].pid, signal.SIGKILL)
    killed.set()
    for t in runners:
        t.join()
    nodes[victim][0].wait()
    check(len(chain) == len(p8) // BT and not bad and min(after) >= 2,
          "a master killed (SIGKILL) while requests run: each completes with the tokens of a run without the tier "
          "(chain %d, wrong %s, after the kill %s)" % (len(chain), bad[:3], after))
    check(all(dm.proc.poll() is None for dm in (ca, cb)) and
          metric(ca, "remote_errors_total", '{kind="io"}') + metric(ca, "remote_errors_total", '{kind="connect"}') +
          metric(cb, "remote_errors_total", '{kind="io"}') + metric(cb, "remote_errors_total", '{kind="connect"}') >= 1,
          "the lost node is counted (io / connect), the daemons run on")
    cc = daemon("cc", "--remote-cluster", seeds)
    toks, cached = complete(cc, p8)
    check(toks == reference(p8) and cached == want_cached,
          "a fresh daemon: blocks up to the dead master's first one hit, from there misses (cached_tokens %d of %d)" %
          (cached, want_cached))
    check(all(dm.stop() == 0 for dm in (ca, cb, cc)), "and the cluster's daemons exit cleanly")
finally:
    for p in procs:
        stop_redis(p)
