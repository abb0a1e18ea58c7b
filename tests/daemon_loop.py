"""A large request body is decoded off the event loop: while one client
streams a generation, another POSTs a 4 MiB prompt, and the stream's
largest gap between two events during that POST stays well below the time
the daemon needs to parse and tokenize the body (measured first, alone).
When the loop thread did that work itself, every stream stalled for all of
it.  The built-in model's context is 512 tokens, so the big prompt ends as
the same 400 as always, after it was tokenized."""
import json
import sys
import threading
import time

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check  # noqa: E402

d = Daemon("--max-body", "8M", model="model/builtin").start()
words = "the quick brown fox jumps over a lazy dog and keeps running through the forest "
text = (words * (4 * 1024 * 1024 // len(words) + 1))[:4 * 1024 * 1024]
big = json.dumps({"prompt": text, "max_tokens": 1}).encode()


def post_big():
    """The big POST: (seconds from sending to the reply, status, reply)."""
    c = d.conn()
    t = time.monotonic()
    c.request("POST", "/v1/completions", body=big, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    reply = json.loads(r.read())
    took = time.monotonic() - t
    c.close()
    return took, r.status, reply


# How long parsing and tokenizing 4 MiB take: the stall a loop thread doing it would cause.
alone = []
for _ in range(2):
    took, code, reply = post_big()
    check(code == 400 and reply["error"]["type"] == "exceed_context_size_error" and
          "1433500 tokens" in reply["error"]["message"], "a 4 MiB prompt: 400, the context is too small")
    alone.append(took)
t_alone = min(alone)
# The worker holds the request for that long; a client that shut down its
# sending side after the body is still there to read the reply.
code = d.raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n" % len(big) + big, timeout=60)
check(code == 400, "a client that half-closes after the 4 MiB body still gets its 400")
bound = 0.4 * t_alone
print("4 MiB prompt alone: %.3f s (best of %s); gap bound %.3f s" % (t_alone, ["%.3f" % a for a in alone], bound))


def one_try():
    """Streams while the big POST runs.  Returns the largest gap between two
    stream events that touches the POST's interval, or None when the stream
    did not span it (then the try says nothing)."""
    c = d.conn()
    c.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "Once upon a time", "max_tokens": 490, "n": 8, "ignore_eos": True, "stream": True,
         "temperature": 1, "logprobs": 2}), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    check(r.status == 200, "the stream starts")
    arrivals, window, result = [], [], []
    poster = None
    for line in iter(r.readline, b""):
        if not line.startswith(b"data: "):
            continue
        arrivals.append(time.monotonic())
        if len(arrivals) == 40:  # the stream is flowing: now the big POST
            def run():
                t0 = time.monotonic()
                result.append(post_big())
                window.extend([t0, time.monotonic()])
            poster = threading.Thread(target=run)
            poster.start()
    c.close()
    poster.join()
    took, code, reply = result[0]
    check(code == 400 and reply["error"]["type"] == "exceed_context_size_error", "the big POST during the stream: 400")
    t0, t1 = window
    if arrivals[0] > t0 or arrivals[-1] < t1:
        print("the stream did not span the POST (%.3f-%.3f s, POST %.3f-%.3f s)" %
              (0, arrivals[-1] - arrivals[0], t0 - arrivals[0], t1 - arrivals[0]))
        return None
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > t0 and a < t1]
    print("stream: %d events, %d during the %.3f s POST, largest gap %.3f s" %
          (len(arrivals), len(gaps), t1 - t0, max(gaps)))
    return max(gaps)


# The best of three tries: on a busy machine one gap may be long by chance,
# while a loop that tokenizes stalls the stream in every try.
gaps = []
for _ in range(3):
    g = one_try()
    if g is not None:
        gaps.append(g)
        if g < bound:
            break
check(gaps, "the stream spanned the big POST in at least one try")
check(min(gaps) < bound, "a 4 MiB POST does not stall another client's stream: largest gap %.3f s < %.3f s "
      "(0.4 x the %.3f s the body takes alone)" % (min(gaps), bound, t_alone))
check(d.stop() == 0, "stop")
