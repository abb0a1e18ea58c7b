/* kvstore.h - the paged KV store.
 *
 * Per layer and per sequence, keys and values live in fixed-size blocks of
 * tokens addressed through a block table.  Every cache strategy (dynamic,
 * static, offloaded, quantized, sliding, sinks, prefix sharing, disk) is a
 * policy over this one store.
 *
 * A forward step is a transaction: kv_seq_reserve(n) makes room for n new
 * tokens in every layer (all or nothing), the forward pass writes and reads
 * them through kv_seq_view(), then kv_seq_commit() makes them part of the
 * sequence or kv_seq_abort() returns the sequence exactly to its state
 * before the reserve.
 */
#ifndef KVTIER_KVSTORE_H
#define KVTIER_KVSTORE_H

#include "../model/backend.h"

enum tier_status {
    TIER_OK = 0,
    TIER_ENOMEM_DEV = 1,  /* the device tier's budget is exhausted */
    TIER_ENOMEM_HOST = 2, /* the host tier's budget is exhausted */
    TIER_EINVAL = 3,      /* bad parameter (named in the error text) */
    TIER_EFULL = 4,       /* static cache: writing past max_cache_len */
    TIER_ENOTSUP = 5,     /* strategy or combination not available */
    TIER_EIO = 6,
};
const char *tier_strerror(enum tier_status st);

typedef struct kv_store kv_store;
typedef struct kv_seq kv_seq;

/* Shape of the model's KV, fixed for a store's lifetime. */
struct kv_geom {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    const int *layer_window; /* [n_layers]: 0 = full attention, else sliding window W */
    enum be_dtype dtype;     /* storage type (f32 default) */
};

enum kv_strategy {
    KV_DYNAMIC = 0, /* grows block by block; sliding layers keep <= W-1 (+ one block) tokens */
};

struct kv_seq_params {
    enum kv_strategy strategy;
};

/* block_tokens: tokens per block (0 = default 32). */
enum tier_status kv_store_create(be_backend *be, const struct kv_geom *g, int block_tokens, kv_store **out);
void kv_store_free(kv_store *s); /* accepts NULL; all sequences must be freed first */
int kv_store_block_tokens(const kv_store *s);

struct kv_store_stats {
    size_t dev_bytes;     /* device bytes held by blocks */
    size_t host_bytes;
    uint64_t blocks_used; /* blocks referenced by some sequence */
};
struct kv_store_stats kv_store_stats(const kv_store *s);

enum tier_status kv_seq_create(kv_store *s, const struct kv_seq_params *p, kv_seq **out);
void kv_seq_free(kv_seq *q); /* accepts NULL; returns its blocks to the store */

/* Tokens seen by the sequence (HF get_seq_length(): absolute, sliding layers included). */
int64_t kv_seq_length(const kv_seq *q);
/* Bytes this sequence's blocks occupy. */
size_t kv_seq_bytes(const kv_seq *q);

enum tier_status kv_seq_reserve(kv_seq *q, int n_new);
/* The view of layer l covering committed tokens plus the reserved ones
 * (positions [length, length + n_new)).  Valid until the next reserve,
 * commit or abort. */
void kv_seq_view(const kv_seq *q, int layer, struct be_kv_view *out);
void kv_seq_commit(kv_seq *q);
void kv_seq_abort(kv_seq *q);

#endif
