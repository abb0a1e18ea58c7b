/* cache.h - the KV cache strategies a request or session may name, in ONE
 * table (cache.c) mirroring Hugging Face's cache_implementation strings.  A
 * strategy whose row has no parse function is known but not built yet: a
 * request naming it gets 501; a name not in the table gets 400 listing the
 * valid ones.  Issues that build a strategy flip its row on by giving it a
 * parse function for its cache_config parameters.  Never a silent fallback.
 */
#ifndef KVTIER_IPC_CACHE_H
#define KVTIER_IPC_CACHE_H

#include <jansson.h>

#include "ipc/status.h"
#include "tiers/kvstore.h"

struct ipc_cache_choice {
    const char *name;            /* the table's name (static) */
    struct kv_seq_params params; /* what kv_seq_create gets */
};

/* Reads the request's "cache" object (NULL or JSON null: "dynamic") and
 * "use_cache" (NULL: true).  Errors: IPC_EINVAL naming cache.implementation or
 * the parameter, IPC_ENOTIMPL naming the strategy. */
enum ipc_status ipc_cache_parse(const json_t *cache, const json_t *use_cache, struct ipc_cache_choice *out,
                                struct ipc_error *err);

#endif
