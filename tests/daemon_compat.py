"""What the client libraries send that a server of their API must take:
requests shaped as openai-node and ollama-js build them, checked over the
socket without the libraries.

- An assistant message with "refusal": null, as openai-node's stream
  helpers assemble it, goes into the next request as it is; null audio and
  function_call too. A refusal, audio or function_call with a value is a
  400 naming messages, never a silent drop."""
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check  # noqa: E402

d = Daemon().start()
USER = {"role": "user", "content": "Hello there"}
GEN = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


def chat(**body):
    return d.post("/v1/chat/completions", dict(GEN, **body))


# -- an assistant turn as the SDK returned it goes back in as it is
code, r = chat(messages=[USER])
check(code == 200, "a first turn: %s %s" % (code, r))
turn = dict(r["choices"][0]["message"])
base = chat(messages=[USER, turn, {"role": "user", "content": "More"}])
check(base[0] == 200, "the reply's own message goes back: %s" % (base,))
for extra in ({"refusal": None}, {"audio": None}, {"function_call": None},
              {"refusal": None, "audio": None, "function_call": None}):
    code, got = chat(messages=[USER, dict(turn, **extra), {"role": "user", "content": "More"}])
    check(code == 200 and got["choices"][0]["message"]["content"] == base[1]["choices"][0]["message"]["content"]
          and got["usage"]["prompt_tokens"] == base[1]["usage"]["prompt_tokens"],
          "an assistant message with %s is taken and renders as without it: %s %s" % (extra, code, got))
for extra, name in (({"refusal": "I cannot help with that."}, "refusal"),
                    ({"function_call": {"name": "f", "arguments": "{}"}}, "function_call"),
                    ({"audio": {"id": "audio_1"}}, "audio")):
    code, got = chat(messages=[USER, dict(turn, **extra), {"role": "user", "content": "More"}])
    check(code == 400 and got["error"]["param"] == "messages" and name in got["error"]["message"],
          "a %s with a value is a 400 naming it: %s %s" % (name, code, got))

check(d.stop() == 0, "stop")
