// The openai npm package over kvtierd's TCP listener with its API key.
// Usage: node tcp.mjs BASE_URL KEY
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const [base, key] = process.argv.slice(2);
const client = new OpenAI({ apiKey: key, baseURL: base, maxRetries: 2 });
const model = (await client.models.list()).data[0].id;
const c = await client.completions.create({ model, prompt: 'Hello', max_tokens: 4, temperature: 0, ignore_eos: true });
assert.equal(c.usage.completion_tokens, 4);
console.log('ok - completions over TCP with the key');
const bad = new OpenAI({ apiKey: key + 'x', baseURL: base, maxRetries: 2 });
await assert.rejects(bad.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
console.log('ok - a wrong key: AuthenticationError (401)');
