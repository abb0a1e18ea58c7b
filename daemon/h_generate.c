/* h_generate.c - POST /v1/completions and /v1/chat/completions.  The
 * prepare step (a worker) validates the request, renders the chat
 * template, tokenizes and checks the prompt against the context, and
 * builds the job; h_generate (the loop thread) names the reply and hands
 * the job to the engine. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "daemon/http.h"
#include "model/encdec.h"

/* The request's prompt as ids (owned by *ids). */
static enum ipc_status prompt_ids(struct server *s, const struct ipc_gen_req *g, struct tok_ids *ids,
                                  struct ipc_error *err)
{
    if (g->chat)
        return render(s, g->messages, g->tools, g->documents, g->template_kwargs, g->chat_end, ids, err);
    if (g->text)
        return encode(s, g->text, g->text_len, true, "prompt", ids, err);
    ids->ids = malloc(g->n_ids * sizeof(*ids->ids));
    if (!ids->ids)
        return ipc_fail(err, IPC_ENOMEM, "prompt", "no memory for the prompt");
    memcpy(ids->ids, g->ids, g->n_ids * sizeof(*ids->ids));
    ids->n = ids->cap = g->n_ids;
    return IPC_OK;
}

enum ipc_status encdec_cache_check(const struct kv_seq_params *cp, struct ipc_error *err)
{
    if (cp->sink || cp->window_length)
        return ipc_fail(err, IPC_EINVAL, "cache", "an encoder-decoder model's decoder attends to all its tokens: "
                        "a %s cache would drop some", cp->sink ? "sink" : "sliding");
    return IPC_OK;
}

/* An encoder-decoder model's request: what it cannot serve is refused
 * naming why; *in gets the encoder input's ids (none: a session's input
 * again), *ids the decoder's prompt (its start token unless the request
 * gives one). */
static enum ipc_status encdec_ids(struct server *s, const struct ipc_gen_req *g, bool chat, struct tok_ids *in,
                                  struct tok_ids *ids, struct ipc_error *err)
{
    const struct encdec_config *ec = engine_encdec(s->eng);
    if (chat)
        return ipc_fail(err, IPC_EINVAL, "messages", "%s is an encoder-decoder model without a chat template: send "
                        "its encoder input to /v1/completions as \"input\"", ec->arch_name);
    if (!g->has_input && !g->session)
        return ipc_fail(err, IPC_EINVAL, "input", "%s is an encoder-decoder model: \"input\" (text or token ids) is "
                        "its encoder's input, \"prompt\" the decoder's (optional)", ec->arch_name);
    enum ipc_status st = encdec_cache_check(&g->cache.params, err);
    if (st != IPC_OK)
        return st;
    if (g->shared_tokens >= 0 || g->shared_text)
        return ipc_fail(err, IPC_EINVAL, "shared_prefix", "a decoder's tokens depend on the encoder input: an "
                        "encoder-decoder model shares no prefix");
    st = g->input_text ? encode(s, g->input_text, g->input_text_len, true, "input", in, err) : IPC_OK;
    if (st == IPC_OK && g->input_ids) {
        if (!(in->ids = malloc(g->n_input_ids * sizeof(*in->ids))))
            return ipc_fail(err, IPC_ENOMEM, "input", "no memory for the input");
        memcpy(in->ids, g->input_ids, g->n_input_ids * sizeof(*in->ids));
        in->n = in->cap = g->n_input_ids;
    }
    if (st == IPC_OK && g->has_input && !in->n)
        st = ipc_fail(err, IPC_EINVAL, "input", "the input is empty (no tokens)");
    /* the bound the ids of an input get when they are parsed, for a text
     * one once it is tokenized: an encoder pass grows with the square of
     * the input, and the engine thread does it */
    else if (st == IPC_OK && in->n > (size_t)engine_context(s->eng))
        st = ipc_fail(err, IPC_ECONTEXT, "input", "input has %zu tokens; the context holds %d", in->n,
                      engine_context(s->eng));
    if (st != IPC_OK)
        return st;
    /* the decoder's prompt goes on: no end-of-sequence appended */
    if (g->text)
        return encode(s, g->text, g->text_len, false, "prompt", ids, err);
    size_t n = g->ids ? g->n_ids : 1;
    if (!(ids->ids = malloc(n * sizeof(*ids->ids))))
        return ipc_fail(err, IPC_ENOMEM, "prompt", "no memory for the prompt");
    if (g->ids)
        memcpy(ids->ids, g->ids, n * sizeof(*ids->ids));
    else
        ids->ids[0] = ec->decoder_start_token_id;
    ids->n = ids->cap = n;
    return IPC_OK;
}

/* How many leading ids of pre the prompt's ids start with: a part
 * tokenized alone may end in a token the whole prompt merges further. */
static size_t agree(const struct tok_ids *pre, const struct tok_ids *ids)
{
    size_t n = 0;
    while (n < pre->n && n < ids->n && pre->ids[n] == ids->ids[n])
        n++;
    return n;
}

/* The leading prompt tokens whose blocks the remote tier may get: none of
 * a private request's; a completion's shared_prefix under any
 * --remote-share but off (the request says the rest is its own); under
 * prefix-only, a chat's up to its first user message (rendered alone),
 * and none of a raw prompt without shared_prefix. */
static size_t shareable(struct server *s, const struct ipc_gen_req *g, const struct tok_ids *ids)
{
    bool on;
    enum engine_remote_share m = engine_remote_share(s->eng, &on);
    if (!on || m == REMOTE_SHARE_OFF || g->private_kv)
        return 0;
    if (g->shared_tokens >= 0)
        return (size_t)g->shared_tokens;
    if (g->shared_text) {
        struct tok_ids pre = {0};
        struct ipc_error err;
        size_t n = encode(s, g->shared_text, g->shared_text_len, true, "shared_prefix", &pre, &err) == IPC_OK
                       ? agree(&pre, ids)
                       : 0;
        free(pre.ids);
        return n;
    }
    if (m == REMOTE_SHARE_ALL)
        return SIZE_MAX;
    json_t *head = g->chat ? json_array() : NULL; /* the messages before the first user message */
    for (size_t k = 0; head && k < json_array_size(g->messages); k++) {
        json_t *msg = json_array_get(g->messages, k);
        const char *role = json_string_value(json_object_get(msg, "role"));
        if ((role && !strcmp(role, "user")) || json_array_append(head, msg))
            break; /* out of memory: a shorter head is still a prefix */
    }
    struct tok_ids pre = {0};
    struct ipc_error err;
    size_t n = 0;
    if (json_array_size(head) && render(s, head, NULL, NULL, g->template_kwargs, IPC_CHAT_CLOSED, &pre, &err) == IPC_OK)
        n = agree(&pre, ids);
    json_decref(head);
    free(pre.ids);
    return n;
}

void new_id(struct req *r, const char *prefix)
{
    snprintf(r->id, sizeof(r->id), "%s-%llx%06llx", prefix, (unsigned long long)r->srv->started,
             (unsigned long long)++r->srv->ids);
    r->created = time(NULL);
}

/* Decodes the request into a job (r->prep.job) and the reply's shape. */
enum ipc_status prepare_generate(struct req *r, bool chat, bool rest)
{
    struct server *s = r->srv;
    struct ipc_limits lim = limits(s);
    struct ipc_gen_req g;
    struct ipc_error *err = &r->prep.err;
    struct tok_ids ids = {0};
    enum ipc_status st = ipc_gen_req_parse(r->root, chat, &lim, &g, err);
    if (st == IPC_OK && g.session && g.cache_given) {
        const char *f = json_object_get(r->root, "cache") ? "cache" : "use_cache";
        st = ipc_fail(err, IPC_EINVAL, f, "%s: a session's cache strategy is fixed when it is created", f);
    }
    struct tok_ids in = {0};
    if (st == IPC_OK && engine_encdec(s->eng))
        st = encdec_ids(s, &g, chat, &in, &ids, err);
    else if (st == IPC_OK && g.has_input)
        st = ipc_fail(err, IPC_EINVAL, "input", "input is an encoder-decoder model's encoder input; %s is "
                      "decoder-only: send the text as prompt", engine_model_config(s->eng)->arch_name);
    else if (st == IPC_OK && !chat && !g.text && !g.ids)
        st = ipc_fail(err, IPC_EINVAL, "prompt", "prompt is required");
    else if (st == IPC_OK)
        st = prompt_ids(s, &g, &ids, err);
    /* an encoder-decoder session is worth its encoded input, which beams
     * read as any request does; a decoder-only one is the conversation it
     * continues, which no beam's hypothesis extends */
    if (st == IPC_OK && g.num_beams > 1 && g.session && !engine_encdec(s->eng))
        st = ipc_fail(err, IPC_EINVAL, "session", "session is not available with num_beams > 1 on a decoder-only "
                      "model (an encoder-decoder model's sessions take beams)");
    int ctx = engine_context(s->eng);
    if (st == IPC_OK && !ids.n)
        st = ipc_fail(err, IPC_EINVAL, chat ? "messages" : "prompt", "the prompt is empty (no tokens)");
    else if (st == IPC_OK && ids.n > IPC_MAX_SINK_TOKENS)
        st = ipc_fail(err, IPC_ECONTEXT, chat ? "messages" : "prompt", "the prompt has %zu tokens; the context "
                      "holds %d (a sink session's whole conversation, %d)", ids.n, ctx, IPC_MAX_SINK_TOKENS);
    /* a session's cache is its own, fixed when it was created: checked
     * here, before the reply starts and before anything of the session is
     * touched (a new encoder input replaces its caches, a new prompt crops
     * its KV to the common prefix) */
    struct kv_seq_params sp;
    const struct kv_seq_params *cp = &g.cache.params;
    if (st == IPC_OK && g.session && (st = engine_session_cache(s->eng, r->uid, g.session, &sp, err)) == IPC_OK) {
        cp = &sp;
        st = ipc_max_tokens_check(&g, cp->sink, ctx, err);
    }
    /* a sink session's positions stay in its window: its conversation may
     * be resent past the context, as long as the session still holds the
     * start of it (checked on the engine thread, which owns its tokens) */
    bool past_ctx = ids.n >= (size_t)ctx;
    if (st == IPC_OK && past_ctx && !(g.session && cp->sink))
        st = ipc_fail(err, IPC_ECONTEXT, chat ? "messages" : "prompt",
                      "the prompt has %zu tokens; the context holds %d", ids.n, ctx);
    int left = past_ctx ? 0 : ctx - (int)ids.n;
    /* a static cache may end before the context (the last generated token
     * is never stored) */
    int64_t limit = engine_static_limit(s->eng, cp);
    int64_t room = limit == INT64_MAX ? left : limit + 1 - (int64_t)ids.n;
    /* OpenAI's defaults: 16 tokens for completions, the rest of the context
     * (or of a static cache) for chat */
    int chat_default = room < left ? (room > 1 ? (int)room : 1) : left;
    if (past_ctx) /* a sink session past the context: no "rest" to fill */
        chat_default = 16;
    int max_new = g.max_tokens > 0 ? g.max_tokens : chat || rest ? chat_default : chat_default < 16 ? chat_default : 16;
    /* a sink cache's positions are indices in its window: it goes past the context */
    if (st == IPC_OK && max_new > left && !cp->sink)
        st = ipc_fail(err, IPC_ECONTEXT, "max_tokens",
                      "the prompt (%zu tokens) + max_tokens (%d) exceeds the context (%d tokens)", ids.n, max_new, ctx);
    /* both lengths are known now: refuse before any work what would fail
     * part-way */
    if (st == IPC_OK && (int64_t)ids.n + max_new - 1 > limit)
        st = ipc_fail(err, IPC_EINVAL, "cache.max_cache_len",
                      "%scache.max_cache_len (%lld) cannot hold the prompt (%zu tokens) + max_tokens (%d) - 1",
                      cp == &sp ? "the session's " : "", (long long)cp->max_cache_len, ids.n, max_new);
    bool beams = g.num_beams > 1;
    /* beams and shared samples fork the prompt's KV sequence */
    if (st == IPC_OK && beams && cp->strategy == KV_QUANTIZED)
        st = ipc_fail(err, IPC_EINVAL, "num_beams",
                      "num_beams > 1 needs KV sequences that fork; the quantized cache does not (use another "
                      "cache strategy)");
    if (st == IPC_OK && beams && !g.cache.use_cache)
        st = ipc_fail(err, IPC_EINVAL, "use_cache",
                      "num_beams > 1 permutes the beams' KV sequences after every step; use_cache=false has none");
    struct job *j = st == IPC_OK ? job_new(beams ? g.num_beams : g.best_of, g.stops, g.n_stops) : NULL;
    if (st == IPC_OK && !j)
        st = ipc_fail(err, IPC_ENOMEM, "", "no memory for the request");
    if (st != IPC_OK) {
        free(ids.ids);
        free(in.ids);
        ipc_gen_req_release(&g);
        return st;
    }
    j->kind = JOB_GENERATE;
    j->uid = r->uid;
    j->prompt = ids.ids;
    j->n_prompt = ids.n;
    j->input = in.ids;
    j->n_input = in.n;
    j->max_new = max_new;
    j->sampling = g.sampling;
    if (!g.has_seed && getrandom(&j->sampling.seed, sizeof(j->sampling.seed), 0) < 0)
        j->sampling.seed = (uint64_t)time(NULL);
    j->ignore_eos = g.ignore_eos;
    j->min_new = beams ? 0 : g.min_tokens;
    j->grammar = g.grammar;
    g.grammar = NULL;
    j->remote_shareable = shareable(s, &g, &ids);
    j->logprobs = g.logprobs;
    j->top_logprobs = g.top_logprobs;
    j->cache = g.cache;
    j->n_out = beams ? g.num_return_sequences : g.n;
    if (beams)
        j->beam = (struct beam_params){.num_beams = g.num_beams,
                                       .num_return = g.num_return_sequences,
                                       .length_penalty = g.length_penalty,
                                       .early_stopping = g.early_stopping,
                                       .min_new = g.min_tokens,
                                       .no_repeat_ngram = g.no_repeat_ngram_size,
                                       .num_groups = g.num_beam_groups,
                                       .diversity_penalty = g.diversity_penalty};
    if (g.session)
        snprintf(j->session_id, sizeof(j->session_id), "%s", g.session);
    r->kind = chat ? REPLY_CHAT : REPLY_COMPLETION;
    r->stream = g.stream;
    r->include_usage = g.include_usage;
    r->return_tokens = g.return_tokens;
    r->logprobs = g.logprobs;
    if (g.tools && g.tool_choice != IPC_TOOLS_NONE) {
        r->tools = g.tools;
        /* a forced call is the grammar's bare object, which reads as Llama's */
        bool bare = g.tool_choice >= IPC_TOOLS_REQUIRED || chat_tpl_bare_tool_calls(engine_chat_template(s->eng));
        r->tool_fmt = bare ? IPC_TOOLFMT_LLAMA : IPC_TOOLFMT_HERMES;
    }
    ipc_gen_req_release(&g);
    r->prep.job = j;
    return IPC_OK;
}

enum ipc_status prep_completions(struct req *r)
{
    return prepare_generate(r, false, false);
}

enum ipc_status prep_chat(struct req *r)
{
    return prepare_generate(r, true, false);
}

enum MHD_Result h_generate(struct req *r, const char *arg)
{
    (void)arg;
    struct job *j = r->prep.job;
    r->prep.job = NULL;
    new_id(r, r->kind == REPLY_CHAT ? "chatcmpl" : "cmpl");
    return req_submit(r, j);
}

