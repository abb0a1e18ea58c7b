#include "ipc/cache.h"

#include <string.h>

typedef enum ipc_status (*cache_parse_fn)(const json_t *cache, struct kv_seq_params *p, struct ipc_error *err);

/* "dynamic" takes no cache_config parameters: any key but the name is a
 * mistake worth reporting (HF would warn and ignore it). */
static enum ipc_status parse_dynamic(const json_t *cache, struct kv_seq_params *p, struct ipc_error *err)
{
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)cache, key, v)
    {
        if (strcmp(key, "implementation") != 0)
            return ipc_fail(err, IPC_EINVAL, "cache", "cache.%.40s is not a parameter of \"dynamic\" (it takes none)",
                            key);
    }
    p->strategy = KV_DYNAMIC;
    return IPC_OK;
}

static const struct {
    const char *name;
    cache_parse_fn parse; /* NULL: known, not built yet (501) */
} strategies[] = {
    {"dynamic", parse_dynamic},
    {"static", NULL},
    {"offloaded", NULL},
    {"offloaded_static", NULL},
    {"quantized", NULL},
    {"sliding_window", NULL},
    {"sink", NULL},
};
#define N_STRATEGIES (sizeof(strategies) / sizeof(strategies[0]))

enum ipc_status ipc_cache_parse(const json_t *cache, const json_t *use_cache, struct ipc_cache_choice *out,
                                struct ipc_error *err)
{
    if (use_cache && !json_is_null(use_cache)) {
        if (!json_is_boolean(use_cache))
            return ipc_fail(err, IPC_EINVAL, "use_cache", "use_cache must be a boolean");
        if (json_is_false(use_cache))
            return ipc_fail(err, IPC_ENOTIMPL, "use_cache", "use_cache=false (recompute every step) is not implemented yet");
    }
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
        if (!strategies[i].parse)
            return ipc_fail(err, IPC_ENOTIMPL, "cache.implementation", "cache strategy \"%s\" is not implemented yet",
                            strategies[i].name);
        out->name = strategies[i].name;
        memset(&out->params, 0, sizeof(out->params));
        /* parse functions see NULL for "no cache object" (json_object_foreach skips it) */
        return strategies[i].parse(json_is_object(cache) ? cache : NULL, &out->params, err);
    }
    char list[IPC_MSG_LEN / 2] = "";
    size_t n = 0;
    for (size_t i = 0; i < N_STRATEGIES && n < sizeof(list); i++)
        n += (size_t)snprintf(list + n, sizeof(list) - n, "%s%s", i ? ", " : "", strategies[i].name);
    return ipc_fail(err, IPC_EINVAL, "cache.implementation", "unknown cache strategy \"%.48s\"; valid values: %s", name,
                    list);
}
