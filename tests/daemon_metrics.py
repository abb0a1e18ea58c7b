"""kvtierd's /metrics histograms and reason-labelled counters: the text
parses (prometheus_client's parser, and `promtool check metrics` where
installed); every histogram has the documented bucket bounds, cumulative
buckets, +Inf equal to _count, and after a known set of requests the counts
the requests and tokens served imply (one queue wait, time to first token,
prefill and decode observation per request, one inter-token observation per
token after each choice's first) with positive sums; an idle session's
spill is counted under reason="idle"."""
import math
import shutil
import subprocess
import sys
import time

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, skip  # noqa: E402

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    skip("python3-prometheus-client is not installed (tools/deps.sh test)")

# the bounds docs/operations.md lists
LATENCY = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120]
TOKEN = [0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
         0.5, 1, 2.5]
HISTOGRAMS = {
    "queue_wait_seconds": LATENCY,
    "time_to_first_token_seconds": LATENCY,
    "inter_token_latency_seconds": TOKEN,
    "prefill_time_per_token_seconds": TOKEN,
    "decode_time_per_token_seconds": TOKEN,
}

d = Daemon("--spill-after", "1").start()


def scrape():
    """{family name: family} from /metrics, after promtool's check when it is installed."""
    code, raw = d.get("/metrics")
    assert code == 200, code
    text = raw.decode()
    if shutil.which("promtool"):
        r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert r.returncode == 0, "promtool check metrics:\n" + r.stdout + r.stderr
    return {f.name: f for f in text_string_to_metric_families(text)}


def histogram(fams, name):
    """(bounds, cumulative counts with +Inf last, sum, count) of kvtier_<name>, its invariants checked."""
    f = fams["kvtier_" + name]
    assert f.type == "histogram", (name, f.type)
    buckets, total, count = [], None, None
    for s in f.samples:
        if s.name.endswith("_bucket"):
            buckets.append((float(s.labels["le"]), s.value))
        elif s.name.endswith("_sum"):
            total = s.value
        elif s.name.endswith("_count"):
            count = s.value
    bounds = [b for b, _ in buckets]
    cum = [c for _, c in buckets]
    assert bounds[:-1] == HISTOGRAMS[name] and math.isinf(bounds[-1]), (name, bounds)
    assert all(a <= b for a, b in zip(cum, cum[1:])), (name, "buckets not cumulative", cum)
    assert cum[-1] == count, (name, "+Inf bucket %s != _count %s" % (cum[-1], count))
    assert total is not None and total >= 0, (name, total)
    return bounds, cum, total, count


fams = scrape()
for name in HISTOGRAMS:
    _, cum, total, count = histogram(fams, name)
    assert count == 0 and total == 0 and not any(cum), (name, cum, total)
check(True, "a fresh daemon: %d histograms with the documented buckets, all empty" % len(HISTOGRAMS))

# a known load: each request's tokens are fixed by ignore_eos and max_tokens
reqs = [
    {"prompt": "The metrics of a daemon", "max_tokens": 6},
    {"prompt": "The metrics of a daemon", "max_tokens": 3},  # its prefix may come from the prefix cache
    {"prompt": "Two choices at once", "max_tokens": 4, "n": 2, "temperature": 1, "seed": 7},
    {"prompt": "A single token", "max_tokens": 1},
]
served = []
for body in reqs:
    code, r = d.post("/v1/completions", dict({"ignore_eos": True, "temperature": 0}, **body))
    assert code == 200, (code, r)
    served.append((body.get("n", 1), r["usage"]["completion_tokens"]))
check([c for _, c in served] == [6, 3, 8, 1], "the requests generated 6, 3, 2x4 and 1 tokens")

fams = scrape()
h = {name: histogram(fams, name) for name in HISTOGRAMS}
n_req = len(reqs)
tokens_after_first = sum(c - n for n, c in served)  # per choice, every token but its first
multi = sum(1 for n, c in served if c // n > 1)  # requests that decoded past their first token
check(h["queue_wait_seconds"][3] == n_req and h["time_to_first_token_seconds"][3] == n_req,
      "queue wait and time to first token: one observation per request (%d)" % n_req)
check(h["inter_token_latency_seconds"][3] == tokens_after_first,
      "inter-token latency: one observation per token after each choice's first (%d)" % tokens_after_first)
check(h["prefill_time_per_token_seconds"][3] == n_req and h["decode_time_per_token_seconds"][3] == multi,
      "prefill per token: one per request (%d); decode per token: one per request past one token (%d)" %
      (n_req, multi))
check(all(h[name][2] > 0 for name in HISTOGRAMS if name != "queue_wait_seconds") and
      h["queue_wait_seconds"][2] >= 0, "the sums are positive once requests were served")
# each request's first token comes after its admission, both timed from submission
check(h["time_to_first_token_seconds"][2] >= h["queue_wait_seconds"][2],
      "time to first token (%.4f s in all) >= queue wait (%.4f s)" %
      (h["time_to_first_token_seconds"][2], h["queue_wait_seconds"][2]))
gen = fams["kvtier_generation_tokens"].samples[0].value
check(gen == sum(c for _, c in served), "generation_tokens_total (%d) agrees with the usage" % gen)

# reason-labelled counters: every reason is there from the start
spills = {s.labels["reason"]: s.value for s in fams["kvtier_session_spills"].samples}
falls = {s.labels["reason"]: s.value for s in fams["kvtier_kv_fallbacks"].samples}
check(spills == {"idle": 0, "memory": 0, "exit": 0} and falls == {"oom": 0, "sized": 0},
      "spills and fallbacks by reason, all 0 so far: %s %s" % (spills, falls))
code, s = d.post("/v1/sessions", {"prompt": "A session that goes idle"})
assert code == 200, (code, s)
end = time.time() + 20
while time.time() < end:
    spills = {x.labels["reason"]: x.value for x in scrape()["kvtier_session_spills"].samples}
    if spills["idle"]:
        break
    time.sleep(0.2)
check(spills == {"idle": 1, "memory": 0, "exit": 0}, "an idle session's spill counts under reason=\"idle\"")
h2 = histogram(scrape(), "queue_wait_seconds")
check(h2[3] == n_req + 1, "the session's prefill job was queued and admitted too")
d.stop()
