// kvtierd's Ollama-compatible API through the ollama npm package, pointed
// at the Unix socket with an undici Agent: version, tags, show, generate
// and chat (streamed and not), the load-only request, errors, and ps with
// the tier split of a session's KV.  Usage: node test.mjs SOCKET
import assert from 'node:assert/strict';
import { Ollama } from 'ollama';
import { Agent, fetch as undiciFetch } from 'undici';

const sock = process.argv[2];
const agent = new Agent({ connect: { socketPath: sock } });
const dial = (url, init) => undiciFetch(url, { ...init, dispatcher: agent });
const ollama = new Ollama({ host: 'http://localhost', fetch: dial });
let passed = 0;
function ok(what) {
  passed++;
  console.log('ok -', what);
}

// the client has no call for it; Ollama-aware apps GET it themselves
const v = await (await dial('http://localhost/api/version')).json();
assert.match(v.version, /^\d+\.\d+\.\d+/);
ok('version: ' + v.version);
const tags = await ollama.list();
assert.equal(tags.models.length, 1);
const model = tags.models[0].name;
assert.match(model, /:latest$/);
assert.ok(tags.models[0].size > 0 && tags.models[0].details.family.length > 0);
ok('list: ' + model);
const show = await ollama.show({ model });
assert.equal(show.model_info['general.architecture'], tags.models[0].details.family);
ok('show');

const greedy = { temperature: 0, repeat_penalty: 1, num_predict: 8 };
const g = await ollama.generate({ model, prompt: 'Once upon a time', options: greedy });
assert.equal(g.done, true);
assert.equal(g.eval_count, 8);
assert.equal(g.done_reason, 'length');
assert.ok(g.prompt_eval_count > 0 && g.total_duration > 0);
let text = '';
let last;
for await (const part of await ollama.generate({ model, prompt: 'Once upon a time', options: greedy, stream: true })) {
  text += part.response;
  last = part;
}
assert.equal(text, g.response);
assert.equal(last.done, true);
assert.equal(last.eval_count, 8);
ok('generate: the stream adds up to the single reply');

// the same request through the OpenAI endpoint: the translation keeps its meaning
const messages = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Hello there' }];
const c = await ollama.chat({ model, messages, options: greedy });
assert.equal(c.message.role, 'assistant');
const oa = await (await dial('http://localhost/v1/chat/completions', {
  method: 'POST', headers: { 'content-type': 'application/json' },
  body: JSON.stringify({ messages, temperature: 0, max_tokens: 8 }),
})).json();
assert.equal(c.message.content, oa.choices[0].message.content);
let chatText = '';
for await (const part of await ollama.chat({ model, messages, options: greedy, stream: true })) {
  chatText += part.message.content;
  if (part.done) assert.equal(part.eval_count, 8);
}
assert.equal(chatText, c.message.content);
ok('chat: stream == single reply == /v1/chat/completions');

// what the ollama client sends empty is the message without it; anything else is refused by name
const empty = await ollama.chat({ model, options: greedy,
  messages: [messages[0], { ...messages[1], images: [], tool_calls: null }] });
assert.equal(empty.message.content, c.message.content);
await assert.rejects(ollama.chat({ model, messages: [messages[0], { ...messages[1], images: ['aGk='] }] }),
  (e) => e.status_code === 400 && /messages\[1\]\.images/.test(e.error));
await assert.rejects(ollama.chat({ model, messages: [...messages,
  { role: 'assistant', content: '', tool_calls: [{ function: { name: 'f', arguments: { a: 1 } } }] }] }),
  (e) => e.status_code === 400 && /messages\[2\]\.tool_calls/.test(e.error));
ok('chat: empty images and tool_calls are dropped, others refused naming them');

const gs = await ollama.generate({ model, prompt: 'system says', system: 'Be brief.', options: greedy });
const raw = await ollama.generate({ model, prompt: 'Once upon a time', raw: true, options: greedy });
assert.equal(raw.eval_count, 8);
assert.notEqual(gs.response, undefined);
ok('generate with system, and raw');

const load = await ollama.generate({ model, prompt: '' });
assert.equal(load.done_reason, 'load');
ok('an empty prompt loads only');

await assert.rejects(ollama.generate({ model: 'llama3:8b', prompt: 'x' }),
  (e) => e.name === 'ResponseError' && e.status_code === 404 && /llama3:8b/.test(e.error));
ok('another model: 404 naming it');
await assert.rejects(ollama.chat({ model, messages, options: { mirostat: 2 } }),
  (e) => e.status_code === 400 && /mirostat/.test(e.error));
await assert.rejects(ollama.chat({ model, messages, options: { temperature: 9 } }),
  (e) => e.status_code === 400 && /^options\.temperature: /.test(e.error));
// the envelope carries only the message: it names the option as written
await assert.rejects(ollama.generate({ model, prompt: 'Hi', options: { num_predict: 100000 } }),
  (e) => e.status_code === 400 && /^options\.num_predict: /.test(e.error));
await assert.rejects(ollama.generate({ model, prompt: 'Hi', options: { num_predict: -3 } }),
  (e) => e.status_code === 400 && /num_predict/.test(e.error));
await assert.rejects(ollama.generate({ model, prompt: 'Hi', options: { num_thread: 'lots' } }),
  (e) => e.status_code === 400 && /num_thread/.test(e.error));
await assert.rejects(ollama.chat({ model, messages: false }), (e) => e.status_code === 400 && /messages/.test(e.error));
ok('unsupported and invalid options and messages: 400 naming them as written');

const sess = await (await dial('http://localhost/v1/sessions', {
  method: 'POST', headers: { 'content-type': 'application/json' },
  body: JSON.stringify({ system: 'You are a helpful assistant.' }),
})).json();
const ps = await ollama.ps();
assert.equal(ps.models[0].name, model);
const kv = ps.models[0].kvtier;
const mine = kv.sessions.find((s) => s.id === sess.id);
assert.ok(mine, 'the session is listed');
const b = mine.bytes;
assert.ok(b.device + b.host + b.disk > 0, JSON.stringify(b));
assert.ok(kv.kv_bytes.device >= b.device && kv.kv_bytes.host >= b.host);
ok(`ps: session ${sess.id} KV device ${b.device} host ${b.host} disk ${b.disk}`);

await agent.close();
console.log(`${passed} passed`);
