"""continue_final_message through kvtierd: the prompt is the conversation
rendered by the model's template and cut right after the final message's
text (transformers' rule), so the model continues that message; the
prompt's tokens end with the prefix's, with no end-of-turn token, and a
chat completion generates what a completion of exactly those tokens does.
The refusals name the field; a template's upper filter maps beyond ASCII."""
import json
import sys

sys.path.insert(0, "tests")
from daemon_harness import Daemon, check, template_model  # noqa: E402

d = Daemon("--disk-dir", "none").start()
IM_END = d.post_ok("/tokenize", {"content": "<|im_end|>", "add_special": False})["tokens"]
check(len(IM_END) == 1, "<|im_end|> is one special token: %s" % IM_END)
prefix = "The colour of the sky is"
msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": prefix}]
# the built-in ChatML template, written out: the assistant's turn left open
want = ("<|begin_of_text|><|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n" + prefix)

text = d.post_ok("/apply-template", {"messages": msgs, "continue_final_message": True})["prompt"]
check(text == want, "apply-template ends with the prefix: %r" % text[-40:])
closed = d.post_ok("/apply-template", {"messages": msgs, "add_generation_prompt": False})["prompt"]
check(closed == want + "<|im_end|>\n", "without it the turn is closed: %r" % closed[-40:])
same = d.post_ok("/apply-template", {"messages": msgs, "continue_final_message": True,
                                     "add_generation_prompt": False})["prompt"]
check(same == want, "add_generation_prompt false with it: the same prompt")
# trailing whitespace the template printed goes with the rest of the
# message when the content starts with whitespace (transformers' rule)
spaced = [msgs[0], {"role": "assistant", "content": " Blue, "}]
text = d.post_ok("/apply-template", {"messages": spaced, "continue_final_message": True})["prompt"]
check(text.endswith("<|im_start|>assistant\n Blue,"), "stripped at the end: %r" % text[-20:])

ids = d.post_ok("/tokenize", {"content": want, "add_special": False})["tokens"]
tail = d.post_ok("/tokenize", {"content": prefix, "add_special": False})["tokens"]
check(ids[-len(tail):] == tail and ids.count(IM_END[0]) == 1,
      "the prompt's tokens end with the prefix's, the user's turn the only one closed")

greedy = {"max_tokens": 8, "temperature": 0, "return_tokens": True, "ignore_eos": True}
chat = d.post_ok("/v1/chat/completions", dict(greedy, messages=msgs, continue_final_message=True))
compl = d.post_ok("/v1/completions", dict(greedy, prompt=ids))
check(chat["usage"]["prompt_tokens"] == len(ids) == compl["usage"]["prompt_tokens"],
      "the chat's prompt is those %d tokens" % len(ids))
check(chat["choices"][0]["tokens"] == compl["choices"][0]["tokens"] and
      chat["choices"][0]["message"]["content"] == compl["choices"][0]["text"],
      "it generates what a completion of those tokens generates")
gen = d.post_ok("/v1/chat/completions", dict(greedy, messages=msgs))
check(gen["usage"]["prompt_tokens"] > len(ids) + 1, "the default opens a new assistant turn after the prefix")
ev = d.stream("/v1/chat/completions", dict(greedy, messages=msgs, continue_final_message=True, stream=True))
check("".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1]) ==
      chat["choices"][0]["message"]["content"], "streamed, the same continuation")

for body, param, why in (
        (dict(messages=msgs, continue_final_message=True, add_generation_prompt=True), "continue_final_message",
         "cannot both be true"),
        (dict(messages=msgs, continue_final_message="yes"), "continue_final_message", "true or false"),
        (dict(messages=msgs, chat_template_kwargs={"continue_final_message": True}), "chat_template_kwargs",
         "set by the request"),
        (dict(messages=[msgs[0], {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
              continue_final_message=True), "continue_final_message", "no text content")):
    for path in ("/v1/chat/completions", "/apply-template"):
        code, e = d.post(path, dict(body, max_tokens=1) if path != "/apply-template" else body)
        check(code == 400 and e["error"]["param"] == param and why in e["error"]["message"],
              "%s %s -> 400 naming %s: %s" % (path, json.dumps(body)[-60:], param, e["error"]["message"]))
code, e = d.post("/v1/completions", {"prompt": "x", "continue_final_message": True})
check(code == 400 and e["error"]["param"] == "continue_final_message", "not a completion's field")
check(d.stop() == 0, "stop")

# a template that changes the text: upper maps beyond ASCII (ß to SS, as
# transformers and JavaScript do), and a final message it changed cannot be
# continued
tm = Daemon("--disk-dir", "none")
tm.model = template_model(tm.tmp + "/tpl", "{% for m in messages %}<{{ m.role }}>{{ m.content | upper }}{% endfor %}")
tm.start()
text = tm.post_ok("/apply-template", {"messages": [{"role": "user", "content": "straße, été, ǰ"}]})["prompt"]
check(text == "<user>STRASSE, ÉTÉ, J̌", "upper: %r" % text)
text = tm.post_ok("/apply-template", {"messages": [{"role": "user", "content": "ÉTÉ"}],
                                      "continue_final_message": True})["prompt"]
check(text == "<user>ÉTÉ", "a final message the template leaves alone is continued")
code, e = tm.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "été"}], "max_tokens": 1,
                                           "continue_final_message": True})
check(code == 400 and e["error"]["param"] == "continue_final_message" and "not in the prompt" in e["error"]["message"],
      "a final message the template changed -> 400: %s" % e["error"]["message"])
check(tm.stop() == 0, "stop")
