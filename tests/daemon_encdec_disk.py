"""kvtierd: an encoder-decoder session restored from disk layer by layer.

A BART whose 640-token input's cross-attention cache (4 decoder layers of
512 f32 channels: 10 MiB) spans three windows of the disk tier's reads, on
a disk slowed to 150 ms a window.  The restored session's next request
starts once both caches' heads are in and computes decoder layer l as soon
as the cross cache's layer l is (kvtier_session_restore_early_layers_total
grows before the read is done), with the tokens and log-probabilities of a
daemon that never spilled, bit for bit, encoding nothing.  Then another
session's file is damaged near its end: the step that began on its first
layers finds the last one missing, the session starts over (its decoder
tokens computed again, its kept input encoded again) and the reply is
still the never-spilled daemon's."""
import json
import os
import sys
import time

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, damage_spill, metric, wait_spilled  # noqa: E402
sys.path.insert(0, "tools")
import mkmodel  # noqa: E402

gen = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_tokens": True, "logprobs": 2}


ref = Daemon("--disk-dir", "none", "--kv-dtype", "f32", model="made below")
model = ref.model = ref.tmp + "/bart"
mkmodel.main(["--out", model, "--seed", "7", "--arch", "bart", "--tie", "--layers", "4", "--dim", "512", "--heads",
              "8", "--ffn", "256", "--vocab", "320", "--max-pos", "1024"])
with open(model + "/config.json") as f:
    dp = [json.load(f)["decoder_start_token_id"]]
ref.start()
# no encoder cache: it would keep the spilled sessions' cross caches in
# memory and serve a restarted session's input from there
slow = Daemon("--spill-after", "1", "--kv-dtype", "f32", "--no-prefix-cache", model=model, tmp=ref.tmp)
slow.sock = os.path.join(ref.tmp, "slow.sock")
slow.start(extra_env={"KVTIER_DISK_READ_DELAY_MS": "150"})

for damage in (False, True):
    enc = [(i * 37 + (11 if damage else 5)) % 300 + 10 for i in range(640)]
    a, b = ref.post_ok("/v1/sessions", {})["id"], slow.post_ok("/v1/sessions", {})["id"]
    ra = ref.post_ok("/v1/completions", dict(gen, input=enc, prompt=dp, session=a))
    rb = slow.post_ok("/v1/completions", dict(gen, input=enc, prompt=dp, session=b))
    held = dp + ra["choices"][0]["tokens"]
    s = wait_spilled(slow, b)
    if damage:
        damage_spill(slow, b)
    early = metric(slow, "session_restore_early_layers_total")
    nxt = held + [77]
    ra = ref.post_ok("/v1/completions", dict(gen, prompt=nxt, session=a))
    rb = slow.post_ok("/v1/completions", dict(gen, prompt=nxt, session=b))
    end = time.time() + 20  # counted when the read ends, which can be after the reply
    while metric(slow, "session_restore_early_layers_total") == early and time.time() < end:
        time.sleep(0.1)
    grew = metric(slow, "session_restore_early_layers_total") - early
    ca, cb = ra["choices"][0], rb["choices"][0]
    da, db = ra["usage"]["prompt_tokens_details"], rb["usage"]["prompt_tokens_details"]
    same = ca["tokens"] == cb["tokens"] and ca["logprobs"] == cb["logprobs"]
    if not damage:
        check(same and grew > 0 and db["cached_tokens"] == da["cached_tokens"] == len(held) - 1 and
              db["encoder_cached_tokens"] == len(enc),
              "a %.1f MiB session on a slow disk: %d layer(s) computed before its read was done, the never-spilled "
              "daemon's tokens and logprobs, %d cached, nothing encoded" %
              (s["bytes"]["disk"] / 1048576, grew, db["cached_tokens"]))
    else:
        check(same and grew > 0 and "restore from disk failed" in slow.logtext() and
              db["encoder_cached_tokens"] == 0,
              "its last chunk damaged: the step that began on %d layer(s) starts over, the input encoded again "
              "(%d tokens cached), the same tokens and logprobs" % (grew, db["cached_tokens"]))
    nxt = nxt + ca["tokens"] + [78]
    ra = ref.post_ok("/v1/completions", dict(gen, prompt=nxt, session=a))
    rb = slow.post_ok("/v1/completions", dict(gen, prompt=nxt, session=b))
    check(ra["choices"][0]["tokens"] == rb["choices"][0]["tokens"] and
          rb["usage"]["prompt_tokens_details"]["encoder_cached_tokens"] == len(enc),
          "%s: the session goes on in memory, as the never-spilled one" % ("damaged" if damage else "restored"))
check(ref.stop() == 0 and slow.stop() == 0, "both daemons exit cleanly")
ref.cleanup()
