/* kvstore.c - the paged KV store: a block pool on the device tier and, per
 * sequence and layer, a table of blocks.
 *
 * NOTES
 * Blocks come from chunks allocated on the backend's device pool.  A chunk
 * is never returned while the store lives: blocks cycle through the free
 * list, so the decode loop never allocates device memory except when the
 * store has to grow.
 *
 * Per sequence and layer the table holds blocks[0..n_blocks); block b
 * covers the positions [base + b*bt, base + (b+1)*bt).  Invariants:
 *   (1) every position in [lo, len) is stored; lo only grows (sliding
 *       layers drop what no later query can see, HF keeps W-1 tokens).
 *   (2) n_blocks is exactly what [base, len + pending) needs, so abort can
 *       recompute what to release from len alone.
 *   (3) base is a multiple of bt and base <= lo (whole blocks are dropped
 *       from the front once all their positions fall below lo).
 * All functions run on one thread (the inference thread).
 */
#include "tiers/kvstore.h"

#include <stdlib.h>
#include <string.h>

#define KV_DEFAULT_BLOCK_TOKENS 32
#define KV_CHUNK_BLOCKS 64 /* blocks per device allocation when growing */

struct kv_store {
    be_backend *be;
    struct kv_geom g;
    int *layer_window;  /* owned copy of g.layer_window */
    int bt;             /* tokens per block */
    size_t block_bytes; /* K and V of one block */
    be_buffer **chunks;
    size_t n_chunks, cap_chunks;
    void **free_blocks; /* stack of unused blocks */
    size_t n_free;
    size_t n_total;     /* blocks owned by the store */
};

struct kv_layer {
    void **blocks;
    int n_blocks, cap;
    int64_t base, lo;
};

struct kv_seq {
    kv_store *s;
    struct kv_seq_params p;
    int64_t len;     /* committed tokens (HF get_seq_length) */
    int pending;     /* reserved, not yet committed */
    struct kv_layer *layers;
};

const char *tier_strerror(enum tier_status st)
{
    switch (st) {
    case TIER_OK: return "ok";
    case TIER_ENOMEM_DEV: return "device tier budget exhausted";
    case TIER_ENOMEM_HOST: return "host memory exhausted";
    case TIER_EINVAL: return "invalid KV store parameter";
    case TIER_EFULL: return "KV cache is full";
    case TIER_ENOTSUP: return "KV strategy not supported";
    case TIER_EIO: return "KV tier I/O error";
    }
    return "unknown tier status";
}

enum tier_status kv_store_create(be_backend *be, const struct kv_geom *g, int block_tokens, kv_store **out)
{
    *out = NULL;
    if (!be || !g || g->n_layers <= 0 || g->n_kv_heads <= 0 || g->head_dim <= 0 || block_tokens < 0)
        return TIER_EINVAL;
    kv_store *s = calloc(1, sizeof(*s));
    if (!s)
        return TIER_ENOMEM_HOST;
    s->layer_window = calloc((size_t)g->n_layers, sizeof(int));
    if (!s->layer_window) {
        free(s);
        return TIER_ENOMEM_HOST;
    }
    if (g->layer_window)
        memcpy(s->layer_window, g->layer_window, (size_t)g->n_layers * sizeof(int));
    s->be = be;
    s->g = *g;
    s->g.layer_window = s->layer_window;
    s->bt = block_tokens ? block_tokens : KV_DEFAULT_BLOCK_TOKENS;
    s->block_bytes = 2 * (size_t)g->n_kv_heads * (size_t)s->bt * (size_t)g->head_dim * be_dtype_size(g->dtype);
    *out = s;
    return TIER_OK;
}

void kv_store_free(kv_store *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n_chunks; i++)
        be_buffer_free(s->chunks[i]);
    free(s->chunks);
    free(s->free_blocks);
    free(s->layer_window);
    free(s);
}

int kv_store_block_tokens(const kv_store *s)
{
    return s->bt;
}

struct kv_store_stats kv_store_stats(const kv_store *s)
{
    uint64_t used = s->n_total - s->n_free;
    return (struct kv_store_stats){
        .dev_bytes = (size_t)used * s->block_bytes,
        .host_bytes = 0,
        .blocks_used = used,
    };
}

/* Adds one chunk of blocks to the free list.  Under a tight budget a full
 * chunk may not fit while a smaller one does, so the size halves down to a
 * single block before giving up. */
static enum tier_status store_grow(kv_store *s)
{
    if (s->n_chunks == s->cap_chunks) {
        size_t cap = s->cap_chunks ? 2 * s->cap_chunks : 16;
        be_buffer **c = realloc(s->chunks, cap * sizeof(*c));
        if (!c)
            return TIER_ENOMEM_HOST;
        s->chunks = c;
        s->cap_chunks = cap;
    }
    for (size_t nb = KV_CHUNK_BLOCKS; nb >= 1; nb /= 2) {
        void **fb = realloc(s->free_blocks, (s->n_total + nb) * sizeof(void *));
        if (!fb)
            return TIER_ENOMEM_HOST;
        s->free_blocks = fb;
        be_buffer *buf;
        enum be_status st = be_dev_alloc(s->be, nb * s->block_bytes, &buf);
        if (st == BE_ENOMEM_DEV)
            continue;
        if (st != BE_OK)
            return st == BE_ENOMEM_HOST ? TIER_ENOMEM_HOST : TIER_EIO;
        s->chunks[s->n_chunks++] = buf;
        char *base = be_buffer_data(buf);
        for (size_t i = 0; i < nb; i++)
            s->free_blocks[s->n_free++] = base + (nb - 1 - i) * s->block_bytes;
        s->n_total += nb;
        return TIER_OK;
    }
    return TIER_ENOMEM_DEV;
}

enum tier_status kv_seq_create(kv_store *s, const struct kv_seq_params *p, kv_seq **out)
{
    *out = NULL;
    if (p && p->strategy != KV_DYNAMIC)
        return TIER_ENOTSUP;
    kv_seq *q = calloc(1, sizeof(*q));
    if (!q)
        return TIER_ENOMEM_HOST;
    q->layers = calloc((size_t)s->g.n_layers, sizeof(*q->layers));
    if (!q->layers) {
        free(q);
        return TIER_ENOMEM_HOST;
    }
    q->s = s;
    if (p)
        q->p = *p;
    *out = q;
    return TIER_OK;
}

/* Returns blocks [keep, n_blocks) of a layer to the free list. */
static void layer_truncate(kv_store *s, struct kv_layer *L, int keep)
{
    while (L->n_blocks > keep)
        s->free_blocks[s->n_free++] = L->blocks[--L->n_blocks];
}

void kv_seq_free(kv_seq *q)
{
    if (!q)
        return;
    for (int l = 0; l < q->s->g.n_layers; l++) {
        layer_truncate(q->s, &q->layers[l], 0);
        free(q->layers[l].blocks);
    }
    free(q->layers);
    free(q);
}

int64_t kv_seq_length(const kv_seq *q)
{
    return q->len;
}

size_t kv_seq_bytes(const kv_seq *q)
{
    size_t n = 0;
    for (int l = 0; l < q->s->g.n_layers; l++)
        n += (size_t)q->layers[l].n_blocks;
    return n * q->s->block_bytes;
}

/* Blocks a layer needs to cover [base, end). */
static int blocks_for(const kv_store *s, const struct kv_layer *L, int64_t end)
{
    return (int)((end - L->base + s->bt - 1) / s->bt);
}

enum tier_status kv_seq_reserve(kv_seq *q, int n_new)
{
    kv_store *s = q->s;
    if (n_new <= 0 || q->pending)
        return TIER_EINVAL;
    int64_t end = q->len + n_new;
    /* Table capacity first, so that taking blocks below cannot fail half-way
     * for a reason other than the pool itself. */
    for (int l = 0; l < s->g.n_layers; l++) {
        struct kv_layer *L = &q->layers[l];
        int need = blocks_for(s, L, end);
        if (need > L->cap) {
            int cap = L->cap ? L->cap : 4;
            while (cap < need)
                cap *= 2;
            void **b = realloc(L->blocks, (size_t)cap * sizeof(void *));
            if (!b)
                return TIER_ENOMEM_HOST;
            L->blocks = b;
            L->cap = cap;
        }
    }
    for (int l = 0; l < s->g.n_layers; l++) {
        struct kv_layer *L = &q->layers[l];
        int need = blocks_for(s, L, end);
        while (L->n_blocks < need) {
            if (s->n_free == 0) {
                enum tier_status st = store_grow(s);
                if (st != TIER_OK) {
                    q->pending = n_new; /* let abort release what was taken (invariant 2) */
                    kv_seq_abort(q);
                    return st;
                }
            }
            L->blocks[L->n_blocks++] = s->free_blocks[--s->n_free];
        }
    }
    q->pending = n_new;
    return TIER_OK;
}

void kv_seq_view(const kv_seq *q, int layer, struct be_kv_view *out)
{
    const struct kv_layer *L = &q->layers[layer];
    *out = (struct be_kv_view){
        .blocks = L->blocks,
        .n_blocks = L->n_blocks,
        .block_tokens = q->s->bt,
        .v_offset = q->s->block_bytes / 2,
        .base = L->base,
        .lo = L->lo,
        .hi = q->len + q->pending,
    };
}

void kv_seq_commit(kv_seq *q)
{
    kv_store *s = q->s;
    q->len += q->pending;
    q->pending = 0;
    for (int l = 0; l < s->g.n_layers; l++) {
        int w = s->layer_window[l];
        if (!w)
            continue;
        struct kv_layer *L = &q->layers[l];
        /* The next query sits at position len and sees keys k with
         * len - k < w, so positions below len - (w - 1) are dead. */
        int64_t keep_from = q->len - (w - 1);
        if (keep_from > L->lo)
            L->lo = keep_from;
        int drop = (int)((L->lo - L->base) / s->bt); /* invariant 3 */
        if (drop <= 0)
            continue;
        for (int b = 0; b < drop; b++)
            s->free_blocks[s->n_free++] = L->blocks[b];
        memmove(L->blocks, L->blocks + drop, (size_t)(L->n_blocks - drop) * sizeof(void *));
        L->n_blocks -= drop;
        L->base += (int64_t)drop * s->bt;
    }
}

void kv_seq_abort(kv_seq *q)
{
    kv_store *s = q->s;
    for (int l = 0; l < s->g.n_layers; l++) {
        struct kv_layer *L = &q->layers[l];
        layer_truncate(s, L, blocks_for(s, L, q->len));
    }
    q->pending = 0;
}
