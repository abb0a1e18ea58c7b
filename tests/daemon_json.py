"""Constrained output and tool calls through kvtierd with the built-in model.

response_format json_object and two json_schema schemas: 100 choices each
(temperature 1, several seeds, a max_tokens short enough that the grammar
must steer every string and key to an end) all parse with Python's json and
validate with python3-jsonschema; a streamed choice's deltas join into a
valid document; unsupported schema keywords are a 400 naming them.
Tools: tool_choice named and required force calls whose arguments validate
against the tool's parameters schema (finish_reason "tool_calls"), also
streamed as OpenAI's tool_calls deltas; tool and assistant tool_calls turns
are accepted and rendered with the tools in the ChatML prompt."""
import json
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, skip  # noqa: E402

try:
    import jsonschema
except ImportError:
    skip("python3-jsonschema is not installed (tools/deps.sh test)")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "mood": {"enum": ["glad", "sad", 3, None]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "home": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"x": {"type": "number"}},
                                                "required": ["x"], "additionalProperties": False}]},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}
POINTS = {
    "type": "array",
    "items": {"type": "object", "properties": {"ok": {"type": "boolean"}, "v": {"type": ["number", "string"]}},
              "required": ["ok"]},
    "minItems": 2,
}


def sample(d, body, total=100, per=50):
    """total choices over several seeds; their contents and finish reasons."""
    out = []
    for seed in range(total // per):
        code, r = d.post("/v1/chat/completions", dict(body, n=per, seed=seed, temperature=1))
        assert code == 200, (code, r)
        out += [(c["message"]["content"], c["finish_reason"]) for c in r["choices"]]
    return out


def all_valid(outs, schema):
    for text, finish in outs:
        try:
            v = json.loads(text)
            jsonschema.validate(v, schema)
        except (ValueError, jsonschema.ValidationError) as e:
            return "%r (%s): %s" % (text, finish, e)
    return None


d = Daemon("--parallel", "50", model="model/builtin")
d.start()
msgs = [{"role": "user", "content": "Answer in JSON."}]

outs = sample(d, {"messages": msgs, "response_format": {"type": "json_object"}, "max_tokens": 40})
bad = all_valid(outs, {"type": "object"})
check(len(outs) == 100 and bad is None, "json_object: 100 of 100 choices are JSON objects: %s" % bad)
check(any(t != "{}" for t, _ in outs), "json_object: not every choice is the empty object")
for name, schema, max_tokens in (("person", PERSON, 72), ("points", POINTS, 48)):
    rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    outs = sample(d, {"messages": msgs, "response_format": rf, "max_tokens": max_tokens})
    bad = all_valid(outs, schema)
    check(len(outs) == 100 and bad is None, "json_schema %s: 100 of 100 choices validate: %s" % (name, bad))
    check(len(set(t for t, _ in outs)) > 50, "json_schema %s: the choices differ" % name)

ev = d.stream("/v1/chat/completions", {"messages": msgs, "response_format": {"type": "json_object"},
                                       "max_tokens": 40, "seed": 7, "stream": True})
text = "".join(e["choices"][0]["delta"].get("content") or "" for e in ev if e != "[DONE]" and e["choices"])
check(isinstance(json.loads(text), dict), "json_object streamed: the deltas join into an object")
code, r = d.post("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object"}, "max_tokens": 30})
check(code == 200 and isinstance(json.loads(r["choices"][0]["text"]), dict), "completions take response_format too")

# text_offset counts characters of the text: a constant of multi-byte
# characters (some split over tokens, which count where they complete)
# puts every whole token's text at its offset, streamed or not
rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": "\U0001F389\u4e2d\u6587\u00f1 \u00e9!"}}}
for stream in (False, True):
    body = {"prompt": "x", "response_format": rf, "max_tokens": 40, "logprobs": 1, "seed": 3}
    if stream:
        ev = [e for e in d.stream("/v1/completions", dict(body, stream=True)) if e != "[DONE]" and e["choices"]]
        text = "".join(e["choices"][0]["text"] for e in ev)
        lp = [e["choices"][0]["logprobs"] for e in ev if e["choices"][0]["logprobs"]]
        toks = [t for x in lp for t in x["tokens"]]
        offs = [o for x in lp for o in x["text_offset"]]
    else:
        code, r = d.post("/v1/completions", body)
        text, toks, offs = r["choices"][0]["text"], r["choices"][0]["logprobs"]["tokens"], \
            r["choices"][0]["logprobs"]["text_offset"]
    whole = [(t, o) for t, o in zip(toks, offs) if t and "\ufffd" not in t and o < len(text)]  # not <|im_end|>
    check(json.loads(text) == "\U0001F389\u4e2d\u6587\u00f1 \u00e9!" and offs[0] == 0 and offs == sorted(offs) and
          len(whole) < len(toks) and offs[-1] <= len(text) and all(text[o:o + len(t)] == t for t, o in whole),
          "text_offset in characters of %r (stream %s): %s at %s" % (text, stream, toks, offs))

for kw, schema in (("pattern", {"type": "string", "pattern": "^a"}),
                   ("$ref", {"type": "object", "properties": {"a": {"$ref": "#/x"}}})):
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    code, e = d.post("/v1/chat/completions", {"messages": msgs, "response_format": rf})
    check(code == 400 and e["error"]["param"] == "response_format" and kw in e["error"]["message"]
          and e["error"]["type"] == "invalid_request_error", "an unsupported keyword (%s) is a 400 naming it: %s"
          % (kw, e))
code, e = d.post("/v1/chat/completions", {"messages": msgs, "response_format": {"type": "json_object"}, "num_beams": 2})
check(code == 400 and e["error"]["param"] == "num_beams", "response_format with num_beams is a 400")
code, e = d.post("/v1/chat/completions", {"messages": msgs, "response_format": {"type": "json_object"}, "min_tokens": 20})
check(code == 400 and e["error"]["param"] == "min_tokens",
      "response_format with min_tokens is a 400 (a complete document ends the choice)")

# ---- tools ----
# small: the tools go into the prompt, and the built-in model's context is 512 tokens
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
schemas = {"get_weather": WEATHER, "get_time": {"type": "object"}}  # no parameters: any object


def calls_valid(choices, names):
    for c in choices:
        m = c["message"]
        tc = m.get("tool_calls") or []
        if c["finish_reason"] != "tool_calls" or len(tc) != 1 or m["content"] is not None:
            return "not one call: %r" % c
        f = tc[0]["function"]
        if f["name"] not in names or tc[0]["type"] != "function" or not tc[0]["id"].startswith("call_"):
            return "bad call: %r" % tc[0]
        try:
            jsonschema.validate(json.loads(f["arguments"]), schemas[f["name"]])
        except (ValueError, jsonschema.ValidationError) as e:
            return "%r: %s" % (f["arguments"], e)
    return None


body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools, "max_tokens": 80,
        "temperature": 1, "n": 20}
code, r = d.post("/v1/chat/completions", dict(body, seed=3, tool_choice={"type": "function",
                                                                          "function": {"name": "get_weather"}}))
bad = calls_valid(r["choices"], ["get_weather"]) if code == 200 else r
check(code == 200 and bad is None, "tool_choice named: 20 of 20 calls of get_weather validate: %s" % bad)
code, r = d.post("/v1/chat/completions", dict(body, seed=4, tool_choice="required"))
bad = calls_valid(r["choices"], schemas) if code == 200 else r
check(code == 200 and bad is None, "tool_choice required: 20 of 20 calls validate: %s" % bad)
# parameters {} allows any value, but a call's arguments are an object; a
# schema with no object in it cannot be called
anyp = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
code, r = d.post("/v1/chat/completions", dict(body, n=8, seed=6, tools=anyp, tool_choice="required"))
schemas["f"] = {"type": "object"}
bad = calls_valid(r["choices"], ["f"]) if code == 200 else r
check(code == 200 and bad is None, "parameters {}: 8 of 8 forced calls have object arguments: %s" % bad)
for sch in ({"type": "string"}, {"anyOf": [{"type": "integer"}, {"type": "array"}]}, {"enum": [1, 2]}):
    code, e = d.post("/v1/chat/completions", dict(body, n=1, tools=[{"type": "function", "function": {
        "name": "f", "parameters": sch}}], tool_choice="required"))
    check(code == 400 and e["error"]["param"] == "tools" and "object" in e["error"]["message"],
          "parameters %s with a forced call -> 400 naming tools: %s" % (json.dumps(sch), e))
code, r = d.post("/v1/chat/completions", dict(body, seed=4, n=1))
m = r["choices"][0]["message"] if code == 200 else {}
check(code == 200 and isinstance(m.get("content"), str) and "tool_calls" not in m,
      "tool_choice auto: the built-in model answers in prose, which stays content")

ev = d.stream("/v1/chat/completions", dict(body, n=1, seed=5, stream=True, tool_choice="required"))
deltas = [e["choices"][0] for e in ev if e != "[DONE]" and e["choices"]]
tcs = [t for c in deltas for t in c["delta"].get("tool_calls") or []]
args = "".join(t["function"].get("arguments", "") for t in tcs)
check(len(tcs) >= 1 and tcs[0]["index"] == 0 and tcs[0]["function"]["name"] in schemas
      and deltas[-1]["finish_reason"] == "tool_calls" and not any(c["delta"].get("content") for c in deltas),
      "a streamed call comes as tool_calls deltas ending with finish_reason tool_calls: %r" % deltas)
jsonschema.validate(json.loads(args), schemas[tcs[0]["function"]["name"]])
check(True, "the streamed call's arguments validate")

conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
# (tool_choice none keeps the tools out of the prompt, which would not fit the context)
code, r = d.post("/v1/chat/completions", {"messages": conv, "tools": tools, "tool_choice": "none", "max_tokens": 8})
check(code == 200 and r["choices"][0]["message"]["role"] == "assistant",
      "tool and assistant tool_calls turns are accepted: %s" % r)
code, r = d.post("/apply-template", {"messages": conv, "tools": tools})
p = r.get("prompt", "")
# the model's own template renders the turns (the built-in one has no tool
# syntax: the tools themselves reach templates that have one, tests/jinja)
check(code == 200 and "<|im_start|>system\nBe brief.<|im_end|>" in p
      and "<|im_start|>tool\n21 degrees<|im_end|>\n<|im_start|>assistant\n" in p,
      "the model's template renders the call and the tool's response: %r" % p)

for tc, why in (({"type": "function", "function": {"name": "nope"}}, "not in tools"), ("required", "tools")):
    b = {"messages": msgs, "tool_choice": tc}
    if why == "not in tools":
        b["tools"] = tools
    code, e = d.post("/v1/chat/completions", b)
    check(code == 400 and e["error"]["param"] == "tool_choice", "tool_choice %r: 400 (%s)" % (tc, e["error"]["message"]))
code, e = d.post("/v1/chat/completions", {"messages": msgs, "tools": tools, "tool_choice": "required",
                                          "response_format": {"type": "json_object"}})
check(code == 400, "a forced call and response_format together: 400")
d.stop()
