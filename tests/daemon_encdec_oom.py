"""kvtierd's encoder-decoder models out of device memory mid-generation: a
daemon whose device budget is its idle use plus a few KV blocks (the cross
cache fits, the decoder's growing self cache soon does not) continues each
generation with the self cache, then the cross cache, moved to the host
tier, streamed from there through the device slots: the tokens and their
log-probabilities are those of a daemon without a budget, bit for bit, and
those tokens kvtier-encdec's; the session then holds both caches in the
host tier, /metrics counts the two fallbacks, and its next generation
(its self cache cropped back to a prefix), encoding nothing, again equals
the unbudgeted daemon's.  A T5 (3 decoder
layers) and a BART (4): with two decoder layers the two streaming slots
would need what the move frees.  The budget is measured, not assumed: the
strict pass uploads the weights into it."""
import json
import os
import subprocess
import sys

sys.path.insert(0, "tests")
from daemon_harness import BUILD, Daemon, check, metric, skip  # noqa: E402
sys.path.insert(0, "tools")
import mkmodel  # noqa: E402

ENC = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 264, 33, 83, 279, 50, 288, 41, 97, 169, 39]
N = 32
gen = {"max_tokens": N, "temperature": 0, "ignore_eos": True, "return_tokens": True, "logprobs": 1}
oracle = os.path.join(BUILD, "kvtier-encdec")
if not os.access(oracle, os.X_OK):
    skip(oracle + " not built")


def run(name, args, kv_bytes):
    ref = Daemon(model="made below")
    model = ref.model = ref.tmp + "/" + name
    mkmodel.main(["--out", model, "--seed", "5", "--layers", "2", "--dim", "64", "--heads", "4", "--ffn", "128",
                  "--vocab", "320", "--max-pos", "128"] + args)
    with open(model + "/config.json") as f:
        start = json.load(f)["decoder_start_token_id"]
    ref.start()
    idle = int(metric(ref, "device_memory_bytes", '{kind="used"}'))
    d = Daemon("--device-mem", str(idle + kv_bytes), model=model, tmp=ref.tmp)
    d.sock = os.path.join(ref.tmp, "oom.sock")
    d.start()
    r = subprocess.run([oracle, "-m", model, "--enc", ",".join(map(str, ENC)), "-n", str(N)], capture_output=True,
                       text=True)
    want = [int(t) for t in r.stdout.split()[0].split(",")]
    sid, rid = d.post_ok("/v1/sessions", {})["id"], ref.post_ok("/v1/sessions", {})["id"]
    dec = None
    for i in range(2):
        body = dict(gen, input=ENC) if i == 0 else dict(gen, prompt=dec, max_tokens=8)
        a = ref.post_ok("/v1/completions", dict(body, session=rid))["choices"][0]
        b = d.post_ok("/v1/completions", dict(body, session=sid))
        s = d.get("/v1/sessions/" + sid)[1]
        c = b["choices"][0]
        check(c["tokens"] == a["tokens"] and (i or a["tokens"] == want) and
              c["logprobs"]["token_logprobs"] == a["logprobs"]["token_logprobs"] and
              b["usage"]["prompt_tokens_details"]["encoder_cached_tokens"] == (len(ENC) if i else 0),
              "%s, generation %d, device budget %d + %d bytes: the unbudgeted daemon's tokens and logprobs%s" %
              (name, i + 1, idle, kv_bytes, " (kvtier-encdec's tokens), encoded once" if not i else
               ", nothing encoded"))
        check(s["bytes"]["device"] == 0 and s["bytes"]["host"] > 0 and s["encoder"]["bytes"]["device"] == 0 and
              s["encoder"]["bytes"]["host"] > 0 and metric(d, "kv_fallbacks_total", '{reason="oom"}') == 2,
              "%s, generation %d: both caches in the host tier after two OOM fallbacks (%s, encoder %s)" %
              (name, i + 1, s["bytes"], s["encoder"]["bytes"]))
        # the next one crops the self cache back into what the budget streams
        dec = [start] + c["tokens"][:8] + [5]
    # a new input whose encoder output the budget cannot hold: the session's caches went first, to
    # make room, and the session says it holds nothing
    code, e = d.post("/v1/completions", dict(gen, input=list(range(3, 123)), session=sid))
    s = d.get("/v1/sessions/" + sid)[1]
    check(code == 507 and e["error"]["param"] == "input" and s["tokens"] == 0 and not s.get("encoder") and
          s["bytes"]["device"] == s["bytes"]["host"] == 0,
          "%s: a new input that cannot be encoded: %d, the session empty (%s tokens, %s, encoder %s)" %
          (name, code, s["tokens"], s["bytes"], s.get("encoder")))
    check(ref.stop() == 0 and d.stop() == 0, "%s: both daemons exit cleanly" % name)
    ref.cleanup()


# the KV allowance: the cross cache and a few self blocks, so that the move
# comes part-way (at generation 17 of 33 on the CPU backend)
run("t5", ["--arch", "t5", "--ffn-kind", "gated-gelu", "--no-tie", "--head-dim", "24", "--dec-layers", "3"], 125568)
run("bart", ["--arch", "bart", "--no-tie", "--scale-embedding", "--dec-layers", "4"], 90880)
