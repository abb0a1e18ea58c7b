#include "ipc/cache.h"

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
};
#define N_KEYS (sizeof(cache_keys) / sizeof(cache_keys[0]))

#define K_STORAGE_KEYS (K_MAX_CACHE_LEN | K_ALLOW_OFFLOAD | K_WINDOW_LENGTH)
#define K_OFFLOADED_KEYS (K_STORAGE_KEYS | K_OFFLOAD_ONLY_NON_SLIDING | K_ADAPTIVE)

/* THE table.  `takes` lists the parameters a row accepts and `needs`
 * those it requires.  A dynamic request's max_cache_len is the length it expects to reach: the store
 * sizes it up front and starts it offloaded when that cannot fit.
 * window_length makes every layer slide on any storage (sliding_window +
 * offloaded is {"implementation": "offloaded", "window_length": W});
 * "sliding_window" itself is dynamic storage whose window defaults to the
 * model's.  "sink" (StreamingLLM) is dynamic storage keeping the first
 * num_sink_tokens and the rest of window_length, with HF SinkCache's
 * defaults (256, 4); the store refuses what it cannot combine it with. */
enum row_window { WINDOW_GIVEN = 0, WINDOW_MODEL, WINDOW_SINK };
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
    {"quantized", KV_QUANTIZED, 0, 0, WINDOW_GIVEN}, /* its parameters: parse_quant */
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
        if (k == N_KEYS || !(cache_keys[k].key & strategies[row].takes)) {
            list_names(strategies[row].takes, true, list, sizeof(list));
            return ipc_fail(err, IPC_EINVAL, "cache", "cache.%.40s is not a parameter of \"%s\"; valid: %s", key, name,
                            list);
        }
        enum ipc_status st = parse_key(name, k, v, m->max_len, p, err);
        if (st != IPC_OK)
            return st;
        given |= cache_keys[k].key;
    }
    unsigned missing = strategies[row].needs & ~given;
    if (missing) {
        list_names(missing, true, list, sizeof(list));
        return ipc_fail(err, IPC_EINVAL, "cache", "\"%s\" needs cache.%s", name, list);
    }
    if (p->adaptive && !(given & K_MAX_CACHE_LEN))
        return ipc_fail(err, IPC_EINVAL, "cache.adaptive",
                        "cache.adaptive needs cache.max_cache_len (the expected length) to size the device share");
    if (strategies[row].window == WINDOW_MODEL && !p->window_length) {
        if (m->sliding_window <= 0)
            return ipc_fail(err, IPC_EINVAL, "cache.window_length",
                            "\"%s\" needs cache.window_length: the model has no sliding_window of its own", name);
        p->window_length = m->sliding_window;
    }
    if (strategies[row].window == WINDOW_SINK) {
        p->sink = true;
        if (!(given & K_WINDOW_LENGTH))
            p->window_length = SINK_WINDOW_DEFAULT;
        if (!(given & K_NUM_SINK_TOKENS))
            p->num_sink_tokens = SINK_TOKENS_DEFAULT;
    }
    p->strategy = strategies[row].strategy;
    return IPC_OK;
}

/* The quantized strategy's parameters are the store's (tiers/quant.h), so
 * kv_quant_parse reads them, after the two storage keys a quantized KV
 * takes: offload (kvtier's: its blocks live in the host tier from the
 * start and stream, quantized + offloaded) and allow_offload (a full
 * device moves it there instead of failing).  Layer-level residency
 * (offload_only_non_sliding, adaptive) does not apply: a quantized KV
 * streams every layer or none. */
static enum ipc_status parse_quant(const json_t *cache, struct kv_seq_params *p, struct ipc_error *err)
{
    static const char *const layer_keys[] = {"offload_only_non_sliding", "adaptive"};
    static const char *const storage_keys[] = {"offload", "allow_offload"};
    bool on[2] = {false, true};
    for (size_t i = 0; i < 2 && cache; i++) {
        char param[IPC_PARAM_LEN];
        snprintf(param, sizeof(param), "cache.%s", layer_keys[i]);
        if (json_object_get(cache, layer_keys[i]))
            return ipc_fail(err, IPC_EINVAL, param,
                            "%s is not a parameter of \"quantized\": a quantized KV streams every layer or none "
                            "(cache.offload)", param);
        snprintf(param, sizeof(param), "cache.%s", storage_keys[i]);
        const json_t *v = json_object_get(cache, storage_keys[i]);
        if (v && !json_is_boolean(v))
            return ipc_fail(err, IPC_EINVAL, param, "%s must be true or false", param);
        if (v)
            on[i] = json_is_true(v);
    }
    json_t *rest = cache ? json_copy((json_t *)cache) : NULL;
    if (cache && !rest)
        return ipc_fail(err, IPC_ENOMEM, "cache", "out of memory reading the cache object");
    for (size_t i = 0; rest && i < 2; i++)
        json_object_del(rest, storage_keys[i]);
    struct kvq_error e;
    enum tier_status st = kv_quant_parse(rest, &p->quant, &e);
    json_decref(rest);
    if (st != TIER_OK)
        return ipc_fail(err, IPC_EINVAL, e.param, "%s", e.msg);
    p->strategy = KV_QUANTIZED;
    p->offload = on[0];
    p->no_fallback = !on[1];
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
        if (strategies[i].strategy == KV_QUANTIZED)
            return parse_quant(json_is_object(cache) ? cache : NULL, &out->params, err);
        return parse_params(i, json_is_object(cache) ? cache : NULL, m, &out->params, err);
    }
    char list[IPC_MSG_LEN / 2];
    list_names(0, false, list, sizeof(list));
    return ipc_fail(err, IPC_EINVAL, "cache.implementation", "unknown cache strategy \"%.48s\"; valid values: %s", name,
                    list);
}

