// casing.mjs OUT - how JavaScript (toUpperCase/toLowerCase, which
// @huggingface/jinja's upper and lower call) changes the case of every code
// point, for test_jinja to compare text/casemap.c with: OUT/casing.json
// holds the Unicode version, the code points unassigned in it (ranges),
// every code point that either mapping changes with both mappings, and the
// final sigma's two classes of neighbours, probed as lowercasing sees them:
// "cased" (x before a capital sigma makes it final) and "ignorable" (not
// cased, but a cased letter before x still makes it final).
import fs from "node:fs";
import path from "node:path";

const ranges = (list) => {
  const out = [];
  for (const c of list) {
    if (out.length && out[out.length - 1][1] === c - 1) out[out.length - 1][1] = c;
    else out.push([c, c]);
  }
  return out;
};
const cps = (s) => [...s].map((x) => x.codePointAt(0));
const unassigned = [], map = [], cased = [], ignorable = [];
for (let c = 0; c <= 0x10ffff; c++) {
  if (c >= 0xd800 && c <= 0xdfff) continue;
  const s = String.fromCodePoint(c);
  if (/\p{Cn}/u.test(s)) unassigned.push(c);
  const up = s.toUpperCase(), low = s.toLowerCase();
  if (up !== s || low !== s) map.push([c, cps(up), cps(low)]);
  if ((s + "\u03a3").toLowerCase().endsWith("\u03c2")) cased.push(c);
  else if (("A" + s + "\u03a3").toLowerCase().endsWith("\u03c2")) ignorable.push(c);
}
const out = { unicode: process.versions.unicode, unassigned: ranges(unassigned), map, cased: ranges(cased),
  ignorable: ranges(ignorable) };
fs.writeFileSync(path.join(process.argv[2], "casing.json"), JSON.stringify(out));
console.log(`casing: Unicode ${out.unicode}, ${map.length} code points change case`);
