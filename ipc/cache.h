/* cache.h - the KV cache strategies a request or session may name, in ONE
 * table (cache.c) mirroring Hugging Face's cache_implementation strings and
 * cache_config parameters.  A strategy whose row is not built yet answers
 * 501 naming it; a name not in the table, a parameter the strategy does not
 * take, a missing required one or a bad value gets 400 listing the valid
 * values.  Issues that build a strategy flip its row on and list the
 * parameters it takes.  Never a silent fallback.
 */
#ifndef KVTIER_IPC_CACHE_H
#define KVTIER_IPC_CACHE_H

#include <jansson.h>

#include "ipc/status.h"
#include "tiers/kvstore.h"

struct ipc_cache_choice {
    const char *name;            /* the table's name (static) */
    struct kv_seq_params params; /* what kv_seq_create gets */
    bool use_cache;              /* false: every step recomputes the whole history (HF use_cache=False) */
};

/* What the table checks against the loaded model. */
struct ipc_cache_model {
    int max_len;        /* lengths (max_cache_len, window_length) lie in [1, max_len], the context */
    int sliding_window; /* the model's window, "sliding_window"'s default; 0 = none */
    const char *no_sink; /* why the model cannot take a sink cache (model_sink_refusal), NULL: it can */
};

/* Reads the request's "cache" object (NULL or JSON null: "dynamic") and
 * "use_cache" (NULL: true).  Nothing is sized by the client beyond the
 * context.  Errors: IPC_EINVAL naming cache.implementation or the
 * parameter. */
enum ipc_status ipc_cache_parse(const json_t *cache, const json_t *use_cache, const struct ipc_cache_model *m,
                                struct ipc_cache_choice *out, struct ipc_error *err);

/* What a reply's "strategy" says of a KV created from c that is now in
 * strategy used: kv_strategy_name, except "sink" for a sink cache. */
const char *ipc_cache_strategy_name(const struct ipc_cache_choice *c, enum kv_strategy used);

/* The request field a KV store refusal of a parsed cache is about: the
 * first cache parameter the store's message names ("sink: num_sink_tokens
 * 17 exceeds ..." -> "cache.num_sink_tokens"), else "cache".  Checks that
 * need the model or the store's block size are the store's, so its
 * message is what knows the parameter. */
void ipc_cache_param_of(const char *msg, char out[IPC_PARAM_LEN]);

#endif
