"""kvtierd's Mamba state out of device memory mid-generation: a daemon whose
device budget is its idle use plus one sequence's state runs a long
generation A with its state on the device; a request B arriving while A
decodes starts in the host tier (no room for a second state), and B's step
finds no room for its streaming slots beside A's state, so the forward pass
moves A's state to the host tier in the middle of A's decode and A goes on
streaming it layer by layer.  Both report the fallback, /metrics counts
A's move as an OOM fallback and B's as a sized one, and both give the
tokens of a daemon without a budget.  The budget is measured, not assumed:
the strict pass uploads the weights into it."""
import json
import os
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, metric, mkmodel  # noqa: E402

gen = {"temperature": 0, "ignore_eos": True, "return_tokens": True}
PA = [(i * 53 + 7) % 1900 + 50 for i in range(30)]
PB = [(i * 31 + 11) % 1900 + 50 for i in range(20)]
# a width of 512 makes a decode step about 0.4 ms on the CPU: A's 600 take
# far longer than B takes to arrive once A's first token is out
NA, NB = 600, 8
STATE = 2 * 2 * (3 + 16) * 1024 * 4  # two copies x 2 layers x (window + SSM state) x 1024 channels, f32


ref = Daemon(model="made below")
ref.model = mkmodel(ref.tmp + "/mamba", "--arch", "mamba", "--layers", "2", "--dim", "512")
ref.start()
idle = int(metric(ref, "device_memory_bytes", '{kind="used"}'))
want_a = ref.post_ok("/v1/completions", dict(gen, prompt=PA, max_tokens=NA))["choices"][0]["tokens"]
want_b = ref.post_ok("/v1/completions", dict(gen, prompt=PB, max_tokens=NB))["choices"][0]["tokens"]
check(ref.stop() == 0, "the unbudgeted daemon exits cleanly")

d = Daemon("--device-mem", str(idle + STATE + 8192), model=ref.model, tmp=ref.tmp)
d.sock = os.path.join(ref.tmp, "oom.sock")
d.start()
# A streams: once its first token is out, its prefill is done (its state on
# the device, alone there) and its decode under way
c = d.conn()
c.request("POST", "/v1/completions", body=json.dumps(dict(gen, prompt=PA, max_tokens=NA, stream=True)),
          headers={"Content-Type": "application/json"})
ra = c.getresponse()
events = []
while not events or not events[-1]["choices"][0].get("tokens"):
    line = ra.readline().decode()
    if line.startswith("data: "):
        events.append(json.loads(line[6:]))
b = d.post_ok("/v1/completions", dict(gen, prompt=PB, max_tokens=NB))
events += [json.loads(line[6:]) for line in ra.read().decode().splitlines() if line.startswith("data: {")]
c.close()
got_a = [t for e in events for t in e["choices"][0].get("tokens", [])]
ka = events[-1]["kvtier"]
check(b["choices"][0]["tokens"] == want_b and b["kvtier"]["fallback"] is not None,
      "B, arriving during A's decode: its state in the host tier (fallback %s), the unbudgeted daemon's tokens" %
      b["kvtier"]["fallback"])
check(got_a == want_a and ka["fallback"] is not None and ka["bytes"]["device"] == 0 and ka["bytes"]["host"] > 0,
      "A, its state moved to the host tier mid-decode (fallback %s, bytes %s): the unbudgeted daemon's %d tokens" %
      (ka["fallback"], ka["bytes"], NA))
oom, sized = (metric(d, "kv_fallbacks_total", '{reason="%s"}' % why) for why in ("oom", "sized"))
check(oom == 1 and sized == 1, "/metrics: one OOM move (A's, mid-decode) and one sized fallback (B's, at creation)")
check(d.stop() == 0, "the budgeted daemon exits cleanly")
ref.cleanup()
