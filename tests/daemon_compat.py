"""What the client libraries send that a server of their API must take:
requests shaped as openai-node and ollama-js build them, checked over the
socket without the libraries.

- An assistant message with "refusal": null, as openai-node's stream
  helpers assemble it, goes into the next request as it is; null audio and
  function_call too. A refusal, audio or function_call with a value is a
  400 naming messages, never a silent drop.
- Ollama options that are null are left out, as Ollama's clients drop
  unset ones: Ollama's defaults stay (temperature 0.8, top_k 40, ...), and
  a null num_predict or num_ctx is no 400.
- Ollama's format: "json" is one JSON object and a schema object a value
  valid for it, on /api/generate and /api/chat, streamed or not (the
  grammar of response_format); another string, or a schema keyword outside
  the subset, is a 400 whose message names format.
- Ollama's num_ctx above kvtierd's context is taken (no effect), as Ollama
  clamps it to the model's trained context; one that is not a positive
  integer is still a 400.
- GET / (and HEAD /, HEAD /api/tags), the probe Ollama's clients send to
  see whether a server is up, answers 200 "Ollama is running" as Ollama."""
import json
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

# -- Ollama: a null option is an absent one
OPTS = {"seed": 7, "num_predict": 8}
ref = d.post("/api/generate", {"model": "model", "prompt": "In the beginning", "stream": False, "options": OPTS})
check(ref[0] == 200, "generate with a seed: %s" % (ref,))
nulls = dict(OPTS, temperature=None, top_k=None, top_p=None, repeat_penalty=None, repeat_last_n=None, stop=None,
             num_ctx=None, mirostat=None, num_thread=None)
code, got = d.post("/api/generate", {"model": "model", "prompt": "In the beginning", "stream": False, "options": nulls})
check(code == 200 and got["response"] == ref[1]["response"],
      "null options keep Ollama's defaults, the same reply as without them: %s %r vs %r"
      % (code, got.get("response", got), ref[1]["response"]))
code, got = d.post("/api/generate", {"model": "model", "prompt": "In the beginning", "stream": False,
                                     "options": {"seed": 7, "num_predict": None}})
check(code == 200 and got["done"], "a null num_predict is no limit, not a 400: %s %s" % (code, got))
code, got = d.post("/api/generate", {"model": "model", "prompt": "x", "stream": False, "options": {"nosuch": None}})
check(code == 400 and "nosuch" in got["error"], "an unknown option is still a 400 when null: %s %s" % (code, got))

# -- Ollama: format
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "w": {"type": "string", "maxLength": 6}},
          "required": ["n", "w"], "additionalProperties": False}
for path, body, field in (("/api/generate", {"prompt": "Describe a city."}, "response"),
                          ("/api/chat", {"messages": [{"role": "user", "content": "Describe a city."}]}, "message")):
    for fmt in ("json", SCHEMA):
        for seed in (1, 2):
            req = dict(body, model="model", format=fmt, options={"seed": seed, "num_predict": 60, "temperature": 1})
            code, got = d.post(path, dict(req, stream=False))
            text = got.get(field) if code == 200 else got
            text = text["content"] if isinstance(text, dict) and field == "message" else text
            try:
                doc = json.loads(text)
            except (TypeError, ValueError):
                doc = None
            ok = isinstance(doc, dict) and (fmt == "json" or (isinstance(doc.get("n"), int) and
                                                              isinstance(doc.get("w"), str) and set(doc) == {"n", "w"}))
            check(code == 200 and ok, "%s format %s seed %d: a valid document: %s %r"
                  % (path, "json" if fmt == "json" else "schema", seed, code, text))
            # streamed: the pieces join into the same document
            c = d.conn()
            c.request("POST", path, body=json.dumps(dict(req, stream=True)), headers={"Content-Type": "application/json"})
            lines = [json.loads(x) for x in c.getresponse().read().decode().splitlines() if x.strip()]
            c.close()
            joined = "".join(x["response"] if field == "response" else x["message"]["content"] for x in lines)
            check(lines[-1]["done"] and joined == text, "%s streamed with format: the same document %r" % (path, joined))
code, got = d.post("/api/generate", {"model": "model", "prompt": "x", "format": "xml"})
check(code == 400 and got["error"].startswith("format"), "format \"xml\" is a 400 naming format: %s %s" % (code, got))
code, got = d.post("/api/chat", {"model": "model", "messages": [USER], "format": {"type": "string", "pattern": "a+"}})
check(code == 400 and got["error"].startswith("format") and "pattern" in got["error"],
      "a schema keyword outside the subset is a 400 naming format and the keyword: %s %s" % (code, got))
for off in ("", None):
    code, got = d.post("/api/generate", {"model": "model", "prompt": "x", "format": off, "stream": False,
                                         "options": {"num_predict": 2}})
    check(code == 200, "format %r is free text: %s" % (off, code))

# -- Ollama: num_ctx past the context
ctx = d.get("/v1/models")[1]["data"][0]["meta"]["n_ctx"]
for n in (ctx, ctx + 1, 131072):
    code, got = d.post("/api/chat", {"model": "model", "messages": [USER], "stream": False,
                                     "options": {"num_ctx": n, "num_predict": 2}})
    check(code == 200 and got["done"], "num_ctx %d (context %d) is taken: %s %s" % (n, ctx, code, got))
for n in (0, -1, 1.5, "8k"):
    code, got = d.post("/api/chat", {"model": "model", "messages": [USER], "options": {"num_ctx": n}})
    check(code == 400 and got["error"].startswith("options.num_ctx"), "num_ctx %r is a 400: %s %s" % (n, code, got))

# -- Ollama: the liveness probe
c = d.conn()
c.request("GET", "/")
r = c.getresponse()
body = r.read()
c.close()
check(r.status == 200 and body == b"Ollama is running" and r.getheader("Content-Type").startswith("text/plain"),
      "GET /: 200 \"Ollama is running\" (%d %r)" % (r.status, body))
for path in ("/", "/api/tags"):
    c = d.conn()
    c.request("HEAD", path)
    r = c.getresponse()
    check(r.status == 200 and r.read() == b"", "HEAD %s: 200 without a body (%d)" % (path, r.status))
    c.close()
check(d.post("/", {})[0] == 405, "POST / is a 405")

check(d.stop() == 0, "stop")
