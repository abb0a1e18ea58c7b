#include "ipc/cache.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>

#include "tiers/quant.h"

/* The cache_config parameters a strategy may take, as bits of a row's
 * `takes` mask.  Names are Hugging Face's where HF has the parameter;
 * adaptive and allow_offload are kvtier's (docs/strategies.md). */
enum cache_key {
    K_MAX_CACHE_LEN = 1u << 0,
    K_OFFLOAD_ONLY_NON_SLIDING = 1u << 1,
    K_ADAPTIVE = 1u << 2,
    K_ALLOW_OFFLOAD = 1u << 3,
    K_WINDOW_LENGTH = 1u << 4,
    K_NUM_SINK_TOKENS = 1u << 5,
    K_OFFLOAD = 1u << 6,
};

enum key_type { KEY_LEN, KEY_COUNT, KEY_BOOL }; /* lengths from 1, counts from 0, both up to the context */

static const struct {
    const char *name;
    enum cache_key key;
    enum key_type type;
} cache_keys[] = {
    {"max_cache_len", K_MAX_CACHE_LEN, KEY_LEN},
    {"offload_only_non_sliding", K_OFFLOAD_ONLY_NON_SLIDING, KEY_BOOL},
    {"adaptive", K_ADAPTIVE, KEY_BOOL},
    {"allow_offload", K_ALLOW_OFFLOAD, KEY_BOOL},
    {"window_length", K_WINDOW_LENGTH, KEY_LEN},
    {"num_sink_tokens", K_NUM_SINK_TOKENS, KEY_COUNT},
    {"offload", K_OFFLOAD, KEY_BOOL},
};
#define N_KEYS (sizeof(cache_keys) / sizeof(cache_keys[0]))

#define K_STORAGE_KEYS (K_MAX_CACHE_LEN | K_ALLOW_OFFLOAD | K_WINDOW_LENGTH)
#define K_OFFLOADED_KEYS (K_STORAGE_KEYS | K_OFFLOAD_ONLY_NON_SLIDING | K_ADAPTIVE)
/* a quantized KV streams every layer or none, so it takes offload, not the
 * layer-level keys; its format parameters are kv_quant_parse's */
#define K_QUANT_KEYS (K_OFFLOAD | K_ALLOW_OFFLOAD | K_WINDOW_LENGTH | K_NUM_SINK_TOKENS)

/* THE table.  `takes` lists the parameters a row accepts and `needs`
 * those it requires.  A dynamic request's max_cache_len is the length it expects to reach: the store
 * sizes it up front and starts it offloaded when that cannot fit.
 * window_length makes every layer slide on any storage (sliding_window +
 * offloaded is {"implementation": "offloaded", "window_length": W});
 * "sliding_window" itself is dynamic storage whose window defaults to the
 * model's.  "sink" (StreamingLLM) is dynamic storage keeping the first
 * num_sink_tokens and the rest of window_length, with HF SinkCache's
 * defaults (256, 4); the store refuses what it cannot combine it with.
 * "quantized" takes sinks when num_sink_tokens is given (sinks +
 * quantized), else window_length is a sliding window. */
enum row_window { WINDOW_GIVEN = 0, WINDOW_MODEL, WINDOW_SINK, WINDOW_SINK_IF_GIVEN };
static const struct {
    const char *name;
    enum kv_strategy strategy;
    unsigned takes, needs;
    enum row_window window;
} strategies[] = {
    {"dynamic", KV_DYNAMIC, K_STORAGE_KEYS, 0, WINDOW_GIVEN},
    {"static", KV_STATIC, K_STORAGE_KEYS, K_MAX_CACHE_LEN, WINDOW_GIVEN},
    {"offloaded", KV_OFFLOADED, K_OFFLOADED_KEYS, 0, WINDOW_GIVEN},
    {"offloaded_static", KV_OFFLOADED_STATIC, K_OFFLOADED_KEYS, K_MAX_CACHE_LEN, WINDOW_GIVEN},
    {"quantized", KV_QUANTIZED, K_QUANT_KEYS, 0, WINDOW_SINK_IF_GIVEN}, /* and parse_quant's */
    {"sliding_window", KV_DYNAMIC, K_STORAGE_KEYS, 0, WINDOW_MODEL},
    {"sink", KV_DYNAMIC, K_WINDOW_LENGTH | K_NUM_SINK_TOKENS, 0, WINDOW_SINK},
};
#define SINK_WINDOW_DEFAULT 256
#define SINK_TOKENS_DEFAULT 4
#define N_STRATEGIES (sizeof(strategies) / sizeof(strategies[0]))

/* "a, b, c": the names of the keys in mask (or every strategy's name). */
static void list_names(unsigned mask, bool keys, char *out, size_t cap)
{
    size_t n = 0;
    out[0] = '\0';
    size_t count = keys ? N_KEYS : N_STRATEGIES;
    for (size_t i = 0; i < count && n < cap; i++) {
        if (keys && !(cache_keys[i].key & mask))
            continue;
        n += (size_t)snprintf(out + n, cap - n, "%s%s", n ? ", " : "", keys ? cache_keys[i].name : strategies[i].name);
    }
    if (!out[0])
        snprintf(out, cap, "none");
}

static enum ipc_status parse_key(const char *strategy, size_t k, const json_t *v, int max_len,
                                 struct kv_seq_params *p, struct ipc_error *err)
{
    char param[IPC_PARAM_LEN];
    snprintf(param, sizeof(param), "cache.%s", cache_keys[k].name);
    if (cache_keys[k].type == KEY_BOOL && !json_is_boolean(v))
        return ipc_fail(err, IPC_EINVAL, param, "%s must be true or false", param);
    int lo = cache_keys[k].type == KEY_LEN;
    if (cache_keys[k].type != KEY_BOOL &&
        (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > max_len))
        return ipc_fail(err, IPC_EINVAL, param, "%s must be an integer from %d to %d (the context size) for \"%s\"",
                        param, lo, max_len, strategy);
    bool on = json_is_true(v);
    switch (cache_keys[k].key) {
    case K_MAX_CACHE_LEN: p->max_cache_len = json_integer_value(v); break;
    case K_OFFLOAD_ONLY_NON_SLIDING: p->offload_sliding = on ? KV_OFFLOAD_SLIDING_NO : KV_OFFLOAD_SLIDING_YES; break;
    case K_ADAPTIVE: p->adaptive = on; break;
    case K_ALLOW_OFFLOAD: p->no_fallback = !on; break;
    case K_WINDOW_LENGTH: p->window_length = (int)json_integer_value(v); break;
    case K_NUM_SINK_TOKENS: p->num_sink_tokens = (int)json_integer_value(v); break;
    case K_OFFLOAD: p->offload = on; break;
    }
    return IPC_OK;
}

/* The row's parameters from the cache object (NULL: none given). */
static enum ipc_status parse_params(size_t row, const json_t *cache, const struct ipc_cache_model *m,
                                    struct kv_seq_params *p, struct ipc_error *err)
{
    const char *name = strategies[row].name;
    unsigned given = 0;
    char list[IPC_MSG_LEN / 2];
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)cache, key, v)
    {
        if (!strcmp(key, "implementation"))
            continue;
        size_t k = 0;
        while (k < N_KEYS && strcmp(cache_keys[k].name, key) != 0)
            k++;
        bool quant = strategies[row].strategy == KV_QUANTIZED;
        if (k == N_KEYS && quant && kv_quant_is_param(key))
            continue;
        if (k == N_KEYS || !(cache_keys[k].key & strategies[row].takes)) {
            char param[IPC_PARAM_LEN];
            snprintf(param, sizeof(param), "cache.%.40s", key);
            list_names(strategies[row].takes, true, list, sizeof(list));
            return ipc_fail(err, IPC_EINVAL, param, "%s is not a parameter of \"%s\"; valid: %s%s%s", param, name,
                            quant ? KV_QUANT_PARAM_NAMES : "", quant ? ", " : "", list);
        }
        enum ipc_status st = parse_key(name, k, v, m->max_len, p, err);
        if (st != IPC_OK)
            return st;
        given |= cache_keys[k].key;
    }
    unsigned missing = strategies[row].needs & ~given;
    if (missing) {
        list_names(missing, true, list, sizeof(list));
        char param[IPC_PARAM_LEN];
        ipc_cache_param_of(list, param); /* the first one missing */
        return ipc_fail(err, IPC_EINVAL, param, "\"%s\" needs cache.%s", name, list);
    }
    if (p->adaptive && !(given & K_MAX_CACHE_LEN))
        return ipc_fail(err, IPC_EINVAL, "cache.adaptive",
                        "cache.adaptive needs cache.max_cache_len (the expected length) to size the device share");
    bool is_static = strategies[row].strategy == KV_STATIC || strategies[row].strategy == KV_OFFLOADED_STATIC;
    if (is_static && (given & K_WINDOW_LENGTH) && p->window_length > p->max_cache_len)
        return ipc_fail(err, IPC_EINVAL, "cache.window_length",
                        "cache.window_length (%d) must be at most cache.max_cache_len (%lld): a static cache holds the "
                        "whole window", p->window_length, (long long)p->max_cache_len);
    if (strategies[row].window == WINDOW_MODEL && !p->window_length) {
        if (m->sliding_window <= 0)
            return ipc_fail(err, IPC_EINVAL, "cache.window_length",
                            "\"%s\" needs cache.window_length: the model has no sliding_window of its own", name);
        p->window_length = m->sliding_window;
    }
    if (strategies[row].window == WINDOW_SINK ||
        (strategies[row].window == WINDOW_SINK_IF_GIVEN && (given & K_NUM_SINK_TOKENS))) {
        if (m->no_sink) /* a sink cache re-rotates positions (indices in the cache) */
            return ipc_fail(err, IPC_EINVAL,
                            strategies[row].window == WINDOW_SINK ? "cache.implementation" : "cache.num_sink_tokens",
                            "sinks (cache \"%s\") cannot run this model: %s", name, m->no_sink);
        p->sink = true;
        if (!(given & K_WINDOW_LENGTH))
            p->window_length = SINK_WINDOW_DEFAULT;
        if (!(given & K_NUM_SINK_TOKENS))
            p->num_sink_tokens = SINK_TOKENS_DEFAULT;
    }
    p->strategy = strategies[row].strategy;
    return IPC_OK;
}

/* The quantized format's parameters are the store's (tiers/quant.h):
 * kv_quant_parse reads what parse_params left, the storage keys taken out. */
static enum ipc_status parse_quant(const json_t *cache, struct kv_seq_params *p, struct ipc_error *err)
{
    json_t *rest = cache ? json_copy((json_t *)cache) : NULL;
    if (cache && !rest)
        return ipc_fail(err, IPC_ENOMEM, "cache", "out of memory reading the cache object");
    for (size_t k = 0; rest && k < N_KEYS; k++)
        json_object_del(rest, cache_keys[k].name);
    struct kvq_error e;
    enum tier_status st = kv_quant_parse(rest, &p->quant, &e);
    json_decref(rest);
    if (st != TIER_OK)
        return ipc_fail(err, IPC_EINVAL, e.param, "%s", e.msg);
    return IPC_OK;
}

enum ipc_status ipc_cache_parse(const json_t *cache, const json_t *use_cache, const struct ipc_cache_model *m,
                                struct ipc_cache_choice *out, struct ipc_error *err)
{
    if (use_cache && !json_is_null(use_cache) && !json_is_boolean(use_cache))
        return ipc_fail(err, IPC_EINVAL, "use_cache", "use_cache must be a boolean");
    const char *name = "dynamic";
    if (cache && !json_is_null(cache)) {
        if (!json_is_object(cache))
            return ipc_fail(err, IPC_EINVAL, "cache", "cache must be an object {\"implementation\": ...}");
        const json_t *impl = json_object_get(cache, "implementation");
        if (impl && !json_is_string(impl))
            return ipc_fail(err, IPC_EINVAL, "cache.implementation", "cache.implementation must be a string");
        if (impl)
            name = json_string_value(impl);
    }
    for (size_t i = 0; i < N_STRATEGIES; i++) {
        if (strcmp(strategies[i].name, name) != 0)
            continue;
        out->name = strategies[i].name;
        memset(&out->params, 0, sizeof(out->params));
        /* without a cache each step starts from an empty KV: nothing may
         * come from the prefix cache either */
        out->use_cache = !json_is_false(use_cache);
        out->params.no_prefix_cache = !out->use_cache;
        const json_t *obj = json_is_object(cache) ? cache : NULL;
        enum ipc_status st = parse_params(i, obj, m, &out->params, err);
        if (st == IPC_OK && strategies[i].strategy == KV_QUANTIZED)
            st = parse_quant(obj, &out->params, err);
        /* without a cache every step recomputes from full-precision states:
         * the result would be dynamic's while the reply said otherwise */
        if (st == IPC_OK && !out->use_cache && (strategies[i].strategy == KV_QUANTIZED || out->params.sink))
            return ipc_fail(err, IPC_EINVAL, "use_cache",
                            "use_cache=false recomputes every step without a cache, which cannot give what the "
                            "\"%s\" cache gives; use the \"dynamic\" cache with it", out->name);
        return st;
    }
    char list[IPC_MSG_LEN / 2];
    list_names(0, false, list, sizeof(list));
    return ipc_fail(err, IPC_EINVAL, "cache.implementation", "unknown cache strategy \"%.48s\"; valid values: %s", name,
                    list);
}


void ipc_cache_param_of(const char *msg, char out[IPC_PARAM_LEN])
{
    snprintf(out, IPC_PARAM_LEN, "cache");
    for (const char *p = msg; *p;) {
        size_t n = 0;
        while (isalnum((unsigned char)p[n]) || p[n] == '_')
            n++;
        char word[IPC_PARAM_LEN - sizeof("cache.")];
        if (n && n < sizeof(word)) {
            memcpy(word, p, n);
            word[n] = '\0';
            bool known = kv_quant_is_param(word);
            for (size_t k = 0; k < N_KEYS && !known; k++)
                known = !strcmp(cache_keys[k].name, word);
            if (known) {
                snprintf(out, IPC_PARAM_LEN, "cache.%s", word);
                return;
            }
        }
        p += n ? n : 1;
    }
}

const char *ipc_cache_strategy_name(const struct ipc_cache_choice *c, enum kv_strategy used)
{
    /* a sink KV never falls back: its dynamic storage is the sink strategy */
    return c->params.sink && used == KV_DYNAMIC ? "sink" : kv_strategy_name(used);
}
