/* fuzz_request.c - the JSON bodies of the generation and session endpoints,
 * parsed the way kvtierd parses them (json_loadb with duplicate keys
 * rejected, then ipc_gen_req_parse / ipc_session_req_parse /
 * ipc_crop_req_parse / ipc_parse_ids / ipc_cache_parse).
 *
 * Invariants: an error has a non-empty message, an HTTP status of 4xx/5xx
 * and, when it names a field, the message names it too; an accepted request
 * stays inside the limits it was parsed against (ids below the vocabulary,
 * arrays and lengths within the context, stops, n, messages, sampling
 * ranges, cache parameters); parsing the re-serialised JSON gives the same
 * answer. */
#include <jansson.h>
#include <math.h>

#include "ipc/request.h"
#include "tests/fuzz/fuzz_util.h"

/* The message names the field: it holds param's first component (up to
 * '.' or '['), or its first 32 bytes of it. */
static void check_error(enum ipc_status st, const struct ipc_error *e, const char *what)
{
    FUZZ_CHECK(st != IPC_OK && e->st == st, "%s: status %d, error struct %d", what, st, e->st);
    FUZZ_CHECK(e->msg[0], "%s: empty message (param \"%s\")", what, e->param);
    int http = ipc_http_status(st);
    FUZZ_CHECK(http >= 400 && http < 600, "%s: status %d maps to HTTP %d", what, st, http);
    if (!e->param[0])
        return;
    size_t head = strcspn(e->param, ".[");
    if (head > 32)
        head = 32;
    char want[40];
    snprintf(want, sizeof want, "%.*s", (int)head, e->param);
    FUZZ_CHECK(strstr(e->msg, want), "%s: message \"%s\" does not name its field \"%s\"", what, e->msg, e->param);
}

static void check_cache(const struct ipc_cache_choice *c, const struct ipc_limits *lim)
{
    FUZZ_CHECK(c->name && c->name[0], "cache strategy without a name");
    const struct kv_seq_params *p = &c->params;
    FUZZ_CHECK(p->max_cache_len >= 0 && p->max_cache_len <= lim->max_context, "max_cache_len %lld",
               (long long)p->max_cache_len);
    FUZZ_CHECK(p->window_length >= 0 && p->window_length <= lim->max_context, "window_length %d", p->window_length);
    FUZZ_CHECK(p->num_sink_tokens >= 0 && p->num_sink_tokens <= lim->max_context, "num_sink_tokens %d",
               p->num_sink_tokens);
    FUZZ_CHECK(p->no_prefix_cache == !c->use_cache, "use_cache %d but no_prefix_cache %d", c->use_cache,
               p->no_prefix_cache);
}

static void check_ids(const int32_t *ids, size_t n, const struct ipc_limits *lim)
{
    FUZZ_CHECK(n <= (size_t)lim->max_context, "%zu ids", n);
    FUZZ_CHECK(!n == !ids, "%zu ids at %p", n, (const void *)ids);
    for (size_t i = 0; i < n; i++)
        FUZZ_CHECK(ids[i] >= 0 && ids[i] < lim->vocab, "ids[%zu] = %d", i, ids[i]);
}

static void check_gen(const struct ipc_gen_req *r, bool chat, const struct ipc_limits *lim)
{
    FUZZ_CHECK(r->chat == chat, "chat flag");
    if (chat) {
        size_t n = json_array_size(r->messages);
        FUZZ_CHECK(n >= 1 && n <= (size_t)lim->max_messages, "%zu messages", n);
        for (size_t i = 0; i < n; i++) {
            const json_t *m = json_array_get(r->messages, i), *c = json_object_get(m, "content");
            const char *role = json_string_value(json_object_get(m, "role"));
            FUZZ_CHECK(role && (!strcmp(role, "system") || !strcmp(role, "user") || !strcmp(role, "assistant") ||
                                !strcmp(role, "tool")), "messages[%zu].role", i);
            FUZZ_CHECK(json_is_string(c) || (json_is_null(c) && !strcmp(role, "assistant")),
                       "messages[%zu] content", i);
            FUZZ_CHECK(!json_object_get(m, "tool_calls") || json_is_array(json_object_get(m, "tool_calls")),
                       "messages[%zu] tool_calls", i);
        }
        FUZZ_CHECK(!r->tools || (json_is_array(r->tools) && json_array_size(r->tools)), "tools");
    } else {
        /* whether a prompt is needed depends on the model (an encoder-decoder
         * one takes "input"): the daemon's prepare step checks it */
        check_ids(r->ids, r->n_ids, lim);
    }
    /* past the context only for a sink cache, the request's or (checked
     * by the daemon) its session's */
    int max_new = r->session || r->cache.params.sink
                      ? (lim->max_context > IPC_MAX_SINK_TOKENS ? lim->max_context : IPC_MAX_SINK_TOKENS)
                      : lim->max_context;
    FUZZ_CHECK(r->max_tokens == -1 || (r->max_tokens >= 1 && r->max_tokens <= max_new), "max_tokens %d",
               r->max_tokens);
    FUZZ_CHECK(r->n >= 1 && r->n <= lim->max_n, "n %d", r->n);
    FUZZ_CHECK(!r->session || r->n == 1, "n %d with a session", r->n);
    FUZZ_CHECK(r->num_beams >= 1 && r->num_beams <= lim->max_n, "num_beams %d", r->num_beams);
    if (r->num_beams > 1) {
        FUZZ_CHECK(r->num_return_sequences >= 1 && r->num_return_sequences <= r->num_beams,
                   "num_return_sequences %d of %d beams", r->num_return_sequences, r->num_beams);
        FUZZ_CHECK(!r->stream && r->n == 1 && !r->session && !r->logprobs && !r->n_stops, "beams with %s",
                   r->stream ? "stream" : r->n != 1 ? "n" : r->session ? "a session" : r->logprobs ? "logprobs" : "stop");
        FUZZ_CHECK(isfinite(r->length_penalty), "length_penalty %g", r->length_penalty);
        FUZZ_CHECK(r->num_beam_groups <= 1 ? r->diversity_penalty == 0
                                           : r->num_beams % r->num_beam_groups == 0 && r->diversity_penalty > 0 &&
                                                 isfinite(r->diversity_penalty),
                   "num_beam_groups %d, diversity_penalty %g", r->num_beam_groups, r->diversity_penalty);
        FUZZ_CHECK(r->min_tokens >= 0 && r->min_tokens <= lim->max_context && r->no_repeat_ngram_size >= 0 &&
                   r->no_repeat_ngram_size <= lim->max_context, "min_tokens %d, no_repeat_ngram_size %d",
                   r->min_tokens, r->no_repeat_ngram_size);
    } else {
        FUZZ_CHECK(r->best_of >= r->n && r->best_of <= lim->max_n, "best_of %d with n %d", r->best_of, r->n);
        FUZZ_CHECK(r->best_of == r->n || (!r->stream && !r->session), "best_of %d streamed or in a session",
                   r->best_of);
    }
    FUZZ_CHECK(r->n_stops >= 0 && r->n_stops <= IPC_MAX_STOPS, "%d stops", r->n_stops);
    for (int i = 0; i < r->n_stops; i++) {
        size_t len = strlen(r->stops[i]);
        FUZZ_CHECK(len >= 1 && len <= IPC_MAX_STOP_LEN, "stop[%d] has %zu bytes", i, len);
    }
    FUZZ_CHECK(r->top_logprobs >= 0 && r->top_logprobs <= IPC_MAX_TOP_LOGPROBS, "top_logprobs %d", r->top_logprobs);
    const struct sampler_params *s = &r->sampling;
    FUZZ_CHECK(isfinite(s->temperature) && s->temperature >= 0 && s->temperature <= 2, "temperature %g",
               s->temperature);
    FUZZ_CHECK(s->top_p > 0 && s->top_p <= 1, "top_p %g", s->top_p);
    FUZZ_CHECK(s->min_p >= 0 && s->min_p <= 1, "min_p %g", s->min_p);
    FUZZ_CHECK(s->top_k >= 0 && s->top_k <= lim->vocab, "top_k %d", s->top_k);
    FUZZ_CHECK(s->repetition_penalty >= 0.01f && s->repetition_penalty <= 10, "repetition_penalty %g",
               s->repetition_penalty);
    FUZZ_CHECK(!r->session || (strlen(r->session) >= 1 && strlen(r->session) <= IPC_SESSION_ID_MAX), "session id");
    check_cache(&r->cache, lim);
}

/* One pass of every parser over root; the outcome of each, as text, goes to
 * out so that a second pass over the re-serialised JSON can be compared. */
static void parse_all(const json_t *root, const struct ipc_limits *lim, char *out, size_t cap)
{
    size_t at = 0;
    out[0] = '\0';
    for (int chat = 0; chat < 2; chat++) {
        struct ipc_gen_req r;
        struct ipc_error e;
        enum ipc_status st = ipc_gen_req_parse(root, chat, lim, &r, &e);
        if (st == IPC_OK)
            check_gen(&r, chat, lim);
        else
            check_error(st, &e, chat ? "chat request" : "completion request");
        at += (size_t)snprintf(out + at, cap - at, "gen%d %d %s %s|", chat, st, st ? e.param : "", st ? e.msg : "");
        ipc_gen_req_release(&r);
        ipc_gen_req_release(&r); /* documented: accepts a released request */
    }
    if (json_is_object(root)) { /* kvtierd replies 400 to any other body before parsing */
        struct ipc_session_req q;
        struct ipc_error e;
        enum ipc_status st = ipc_session_req_parse(root, lim, &q, &e);
        if (st == IPC_OK) {
            check_ids(q.ids, q.n_ids, lim);
            FUZZ_CHECK(!(q.system && (q.prefix || q.ids)), "system and prefix both set");
            FUZZ_CHECK(!(q.prefix && q.ids), "prefix text and ids both set");
            FUZZ_CHECK(q.cache.use_cache, "a session without a cache");
            check_cache(&q.cache, lim);
        } else {
            check_error(st, &e, "session request");
        }
        at += (size_t)snprintf(out + at, cap - at, "session %d %s|", st, st ? e.msg : "");
        ipc_session_req_release(&q);

        int64_t n = 0;
        st = ipc_crop_req_parse(root, &n, &e);
        if (st == IPC_OK)
            FUZZ_CHECK(json_integer_value(json_object_get(root, "n")) == n, "crop n");
        else
            check_error(st, &e, "crop request");
        at += (size_t)snprintf(out + at, cap - at, "crop %d %lld|", st, (long long)n);
    }
    /* /detokenize's "tokens", or the body itself when it is an array */
    const json_t *arr = json_is_array(root) ? root : json_object_get(root, "tokens");
    if (arr) {
        int32_t *ids;
        size_t n;
        struct ipc_error e;
        enum ipc_status st = ipc_parse_ids(arr, "tokens", lim, &ids, &n, &e);
        if (st == IPC_OK) {
            check_ids(ids, n, lim);
            FUZZ_CHECK(n == json_array_size(arr), "%zu of %zu ids", n, json_array_size(arr));
        } else {
            check_error(st, &e, "ids");
            FUZZ_CHECK(!ids && !n, "ids left on error");
        }
        free(ids);
        at += (size_t)snprintf(out + at, cap - at, "ids %d|", st);
    }
    /* the cache object on its own, as the table reads it */
    struct ipc_cache_choice c;
    struct ipc_error e;
    const json_t *cache = json_is_object(root) ? json_object_get(root, "cache") : root;
    enum ipc_status st = ipc_cache_parse(cache, json_object_get(root, "use_cache"),
                                         &(struct ipc_cache_model){.max_len = lim->max_context,
                                                                   .sliding_window = lim->sliding_window}, &c, &e);
    if (st == IPC_OK)
        check_cache(&c, lim);
    else
        check_error(st, &e, "cache");
    snprintf(out + at, cap - at, "cache %d %s", st, st ? e.msg : "");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 1 << 16)
        return 0;
    json_error_t je;
    json_t *root = json_loadb((const char *)data, size, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return 0;
    static const struct ipc_limits limits[] = {
        {.vocab = 2048, .max_context = 512, .max_n = 4, .max_messages = 16, .sliding_window = 0},
        {.vocab = 151936, .max_context = 32768, .max_n = 16, .max_messages = 256, .sliding_window = 4096},
    };
    static char first[16384], again[16384];
    char *dump = json_dumps(root, JSON_ENCODE_ANY | JSON_COMPACT);
    json_t *root2 = dump ? json_loads(dump, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &je) : NULL;
    FUZZ_CHECK(!dump || root2, "re-serialised JSON does not parse: %s", je.text);
    for (size_t i = 0; i < sizeof limits / sizeof limits[0]; i++) {
        parse_all(root, &limits[i], first, sizeof first);
        if (root2) {
            parse_all(root2, &limits[i], again, sizeof again);
            FUZZ_CHECK(strcmp(first, again) == 0, "not a fixed point:\n%s\n%s", first, again);
        }
    }
    json_decref(root2);
    free(dump);
    json_decref(root);
    return 0;
}
