// kvtierd through the official openai npm package, pointed at the Unix
// socket with an undici Agent: completions, chat, streams, sessions, errors,
// and a stream the client aborts.  Usage: node test.mjs SOCKET
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { Agent, fetch as undiciFetch } from 'undici';

const sock = process.argv[2];
const agent = new Agent({ connect: { socketPath: sock } });
const client = new OpenAI({
  apiKey: 'unused',
  baseURL: 'http://localhost/v1',
  maxRetries: 0,
  fetch: (url, init) => undiciFetch(url, { ...init, dispatcher: agent }),
});
let passed = 0;
function ok(what) {
  passed++;
  console.log('ok -', what);
}

const models = await client.models.list();
assert.equal(models.data.length, 1);
ok('models.list: ' + models.data[0].id);
const model = models.data[0].id;

const params = { model, prompt: 'In the beginning', max_tokens: 10, temperature: 0, ignore_eos: true };
const c = await client.completions.create(params);
assert.equal(c.object, 'text_completion');
assert.equal(c.usage.completion_tokens, 10);
assert.equal(c.kvtier.strategy, 'dynamic');
ok('completions.create');

let streamed = '';
let last;
for await (const chunk of await client.completions.create({ ...params, stream: true })) {
  streamed += chunk.choices[0]?.text ?? '';
  last = chunk;
}
assert.equal(streamed, c.choices[0].text);
assert.equal(last.choices[0].finish_reason, 'length');
ok('completions stream == non-stream');

const messages = [{ role: 'user', content: 'Hello there' }];
const chat = await client.chat.completions.create({ model, messages, max_tokens: 8, temperature: 0, ignore_eos: true });
assert.equal(chat.choices[0].message.role, 'assistant');
let chatStreamed = '';
const stream = await client.chat.completions.create({
  model, messages, max_tokens: 8, temperature: 0, ignore_eos: true, stream: true,
  stream_options: { include_usage: true },
});
let usage;
for await (const chunk of stream) {
  chatStreamed += chunk.choices[0]?.delta?.content ?? '';
  if (chunk.usage) usage = chunk.usage;
}
assert.equal(chatStreamed, chat.choices[0].message.content);
assert.equal(usage.completion_tokens, 8);
ok('chat.completions stream == non-stream, include_usage');

const session = await client.post('/sessions', { body: { system: 'You are terse.' } });
const conv = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Hi' }];
const t1 = await client.chat.completions.create({
  model, messages: conv, max_tokens: 5, temperature: 0, ignore_eos: true, session: session.id,
});
assert.equal(t1.usage.prompt_tokens_details.cached_tokens, session.tokens);
conv.push({ role: 'assistant', content: t1.choices[0].message.content }, { role: 'user', content: 'More' });
const held = (await client.get(`/sessions/${session.id}`)).tokens;
const t2 = await client.chat.completions.create({
  model, messages: conv, max_tokens: 5, temperature: 0, ignore_eos: true, session: session.id,
});
assert.equal(t2.usage.prompt_tokens_details.cached_tokens, held);
assert.ok(t2.usage.prompt_tokens > held);
await client.delete(`/sessions/${session.id}`);
ok(`session: turn 2 computed ${t2.usage.prompt_tokens - held} new tokens, ${held} cached`);

await assert.rejects(client.completions.create({ ...params, temperature: 5 }),
  (e) => e instanceof OpenAI.BadRequestError && /temperature/.test(e.message));
ok('invalid temperature: BadRequestError naming the field');
await assert.rejects(client.completions.create({ ...params, cache: { implementation: 'static' } }),
  (e) => e instanceof OpenAI.BadRequestError && /max_cache_len/.test(e.message));
ok('cache static without max_cache_len: BadRequestError naming it');
const st = await client.completions.create({ ...params, cache: { implementation: 'static', max_cache_len: 64 } });
assert.equal(st.kvtier.strategy, 'static');
ok('cache static with max_cache_len: the kvtier object reports it');

// the SDK retries 5xx (and 408/409/429) maxRetries times: a feature kvtier
// does not support must be a 400 it sends once
let sent = 0;
const retrying = new OpenAI({
  apiKey: 'unused',
  baseURL: 'http://localhost/v1',
  maxRetries: 2,
  fetch: (url, init) => { sent++; return undiciFetch(url, { ...init, dispatcher: agent }); },
});
await assert.rejects(retrying.completions.create({ ...params, logit_bias: { 5: 1 } }),
  (e) => e instanceof OpenAI.BadRequestError && e.param === 'logit_bias' && e.type === 'invalid_request_error');
assert.equal(sent, 1);
ok('an unsupported field: one HTTP request, a 400 naming it');
sent = 0;
await assert.rejects(retrying.chat.completions.create({ model: 'gpt-4o', messages, max_tokens: 2 }),
  (e) => e instanceof OpenAI.NotFoundError && e.code === 'model_not_found');
assert.equal(sent, 1);
ok('another model: one HTTP request, 404 model_not_found');
assert.equal((await retrying.models.retrieve(model)).id, model);
await assert.rejects(retrying.models.retrieve('other'), (e) => e instanceof OpenAI.NotFoundError);
ok('models.retrieve');
const pen = await client.completions.create({ ...params, presence_penalty: 1, frequency_penalty: 0.5, typical_p: 0.9,
  repeat_penalty: 1.1, min_tokens: 2, cache_prompt: true, keep_alive: '5m', reasoning_effort: 'low' });
assert.equal(pen.usage.completion_tokens, 10);
ok('the fields other local servers accept are accepted');
// tools: a forced call reaches the SDK's types, whole and assembled from a stream's deltas
const tools = [{ type: 'function', function: { name: 'get_weather', parameters: {
  type: 'object', properties: { city: { type: 'string', maxLength: 12 } }, required: ['city'],
  additionalProperties: false } } }];
const callParams = { model, messages, tools, tool_choice: 'required', max_tokens: 60, temperature: 1, seed: 3 };
const call = await client.chat.completions.create(callParams);
assert.equal(call.choices[0].finish_reason, 'tool_calls');
assert.equal(call.choices[0].message.content, null);
const tc = call.choices[0].message.tool_calls[0];
assert.equal(tc.type, 'function');
assert.equal(tc.function.name, 'get_weather');
assert.equal(typeof JSON.parse(tc.function.arguments).city, 'string');
ok('tool_choice required: message.tool_calls with valid arguments');
const callStream = client.beta.chat.completions.stream({ ...callParams, stream: true });
const assembled = await callStream.finalChatCompletion();
assert.deepEqual(assembled.choices[0].message.tool_calls.map((t) => [t.id, t.function.name, t.function.arguments]),
  call.choices[0].message.tool_calls.map((t) => [t.id.replace(call.id, assembled.id), t.function.name,
    t.function.arguments]));
ok('a streamed call assembles into the same tool_calls');
const fmt = await client.chat.completions.create({
  model, messages, max_tokens: 40, temperature: 1, seed: 2,
  response_format: { type: 'json_schema', json_schema: { name: 'n', strict: true, schema: {
    type: 'object', properties: { n: { type: 'integer' } }, required: ['n'], additionalProperties: false } } },
});
assert.equal(typeof JSON.parse(fmt.choices[0].message.content).n, 'number');
ok('response_format json_schema: the content parses and has its required key');

const controller = new AbortController();
const long = await client.completions.create({ ...params, max_tokens: 1500, stream: true },
  { signal: controller.signal });
let chunks = 0;
try {
  for await (const chunk of long) {
    if (++chunks === 3) controller.abort();
  }
} catch (e) {
  assert.ok(e.name === 'APIUserAbortError' || e.name === 'AbortError', e.name);
}
let running = -1;
for (let i = 0; i < 400 && running !== 0; i++) {
  const r = await undiciFetch('http://localhost/metrics', { dispatcher: agent });
  running = Number((await r.text()).match(/^kvtier_requests_running (\d+)/m)[1]);
  if (running) await new Promise((res) => setTimeout(res, 50));
}
assert.equal(running, 0);
ok('an aborted stream cancels its generation');

await agent.close();
console.log(`${passed} passed`);
