// unigram.mjs OUTDIR - reads OUTDIR/spm.json (tests/tokenizer/unigram_oracle.py:
// SentencePiece's encodings of the corpus with two small Unigram models
// converted to T5-style tokenizer.json files) and writes OUTDIR/expected.json
// for kvtier's checker (tests/test_tokenizer.c) with three references:
//   t5-transformersjs  the transformers.js port (@lenml/tokenizers) on the
//                      T5-style file: ids and decodes;
//   t5-sentencepiece   SentencePiece on the same model: ids only (its decoder
//                      renders unk as " ⁇ ", Hugging Face's as "<unk>");
//   t5-strip-replace   the same, on the converter's later layout of the file;
//   t5-bytes           SentencePiece with byte fallback, which the port lacks:
//                      ids, and its decode with "</s>" kept for the
//                      specials-kept one.
// The port leaves consecutive unknown characters as separate unk ids where
// Hugging Face's tokenizers and SentencePiece fuse them into one; that is
// undone here.  It approximates the Precompiled charsmap with NFKC, so a case
// where its ids differ from SentencePiece's is left out of its entry (and
// listed); there must be at most MAX_NFKC_GAPS of them.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const MAX_NFKC_GAPS = 6;
const require = createRequire(import.meta.url);
const { TokenizerLoader } = require("@lenml/tokenizers");
const outdir = process.argv[2];
if (!outdir) {
  console.error("usage: node unigram.mjs OUTDIR");
  process.exit(2);
}
const spm = JSON.parse(fs.readFileSync(path.join(outdir, "spm.json"), "utf8"));
const corpus = spm.corpus;
const same = (a, b) => a.length === b.length && a.every((x, i) => x === b[i]);
const tokenizers = [];

const t5 = spm.models.find((m) => m.name === "t5");
const tokenizerJSON = JSON.parse(fs.readFileSync(path.join(t5.dir, "tokenizer.json"), "utf8"));
const tokenizerConfig = JSON.parse(fs.readFileSync(path.join(t5.dir, "tokenizer_config.json"), "utf8"));
const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig });
const unk = tokenizerJSON.model.unk_id;
const gaps = [];
const jsCases = corpus.map((text, i) => {
  const ids = tok.encode(text).filter((id, k, all) => !(id === unk && k > 0 && all[k - 1] === unk));
  const decode = (skip) =>
    ids.length ? tok.decode(ids, { clean_up_tokenization_spaces: false, skip_special_tokens: skip }) : "";
  if (!t5.skip[i] && !same(ids, t5.ids[i])) {
    gaps.push(i);
    console.error(`unigram.mjs: transformers.js differs from SentencePiece on case ${i} ${JSON.stringify(text)}`);
    return { ids, skip: true };
  }
  return { ids, decoded_skip: decode(true), decoded_all: decode(false) };
});
if (gaps.length > MAX_NFKC_GAPS) {
  console.error(`unigram.mjs: ${gaps.length} cases differ (at most ${MAX_NFKC_GAPS} expected)`);
  process.exit(1);
}
// The checker reads the corpus by index: a case left out keeps its slot.
const fromSpm = (m, decodes) =>
  m.ids.map((ids, i) =>
    m.skip[i]
      ? { ids, skip: true }
      : decodes
        ? { ids, decoded_skip: m.decoded[i], decoded_all: m.decoded[i] + "</s>" }
        : { ids },
  );
const bytes = spm.models.find((m) => m.name === "t5-bytes");
for (const m of [t5, bytes]) {
  const left = m.skip.map((r, i) => (r ? `${i} (${r})` : null)).filter((x) => x);
  console.error(`unigram.mjs: ${m.name}: cases left out of the SentencePiece reference: ${left.join(", ") || "none"}`);
}
tokenizers.push({ name: "t5-transformersjs", dir: t5.dir, cases: jsCases });
tokenizers.push({ name: "t5-sentencepiece", dir: t5.dir, cases: fromSpm(t5, false) });
// the same model in the converter's later layout (Strip + Regex Replace,
// Metaspace alone), which the port reads differently: SentencePiece only
tokenizers.push({ name: "t5-strip-replace", dir: t5.dir + "-strip-replace", cases: fromSpm(t5, false) });
tokenizers.push({ name: "t5-bytes", dir: bytes.dir, cases: fromSpm(bytes, true) });
fs.writeFileSync(path.join(outdir, "expected.json"), JSON.stringify({ corpus, tokenizers }));
