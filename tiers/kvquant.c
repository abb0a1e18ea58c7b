/* kvquant.c - the quantized strategy (KV_QUANTIZED) inside the store: one
 * kvq_layer (quant.c) per layer of the sequence, joined to the store's step
 * transaction, views and sliding windows through the hooks kvstore.c calls
 * (kvstore_impl.h).
 *
 * NOTES
 * - Blocks.  Quantized blocks (fmt->block_bytes) and the residual's f32
 *   blocks (the store's dense layout) are device buffers of one block each,
 *   from the device tier's budget like every KV block: an allocation over
 *   budget first evicts unreferenced prefix-cache blocks (kv_store_reclaim),
 *   then fails the step with TIER_ENOMEM_DEV.  A returned block goes on the
 *   sequence's free list of its kind, so after the first flush the decode
 *   loop allocates nothing (each flush returns the residual's blocks, which
 *   the next tokens take again).  Buffers are freed with the sequence; their
 *   bytes count in the store's dev_ext_bytes (device bytes outside the pool).
 * - The store's kv_layer of a quantized layer is paged with no blocks: it
 *   keeps window, keep and lo, so the sliding rule (NOTES invariant 1 of
 *   kvstore.c) is the store's own; after each commit the quantized blocks
 *   wholly below lo are returned (kvq_layer_drop).
 * - Not supported yet, each refused with TIER_ENOTSUP naming it: offloading
 *   (kv_seq_offload, so an out-of-memory step fails cleanly), crop, fork
 *   and past recording; the prefix cache skips quantized sequences.
 */
#include "tiers/kvstore_impl.h"

#include <stdlib.h>

#include "tiers/quant.h"

/* One kind of block: every buffer allocated (own) and the free ones. */
struct kvq_pool {
    size_t bytes;
    be_buffer **own;
    void **free_list; /* same capacity as own, so a put never allocates */
    size_t n_own, n_free, cap;
};

struct kvq_seq {
    kv_store *s;
    kvq_ctx *ctx;
    kvq_layer **layers;          /* [n_layers] */
    struct kvq_pool pool[2];     /* by enum kvq_block_kind */
    enum tier_status why;        /* what the last failed get ran out of */
};

static void *pool_get(void *ctx, enum kvq_block_kind kind)
{
    struct kvq_seq *k = ctx;
    struct kvq_pool *p = &k->pool[kind];
    kv_store *s = k->s;
    if (p->n_free)
        return p->free_list[--p->n_free];
    if (p->n_own == p->cap) {
        size_t cap = p->cap ? 2 * p->cap : 16;
        be_buffer **own = realloc(p->own, cap * sizeof(*own));
        if (own)
            p->own = own;
        void **fl = own ? realloc(p->free_list, cap * sizeof(*fl)) : NULL;
        if (!fl) {
            k->why = kv_fail(s, TIER_ENOMEM_HOST, "host memory: a table of %zu quantized KV blocks", cap);
            return NULL;
        }
        p->free_list = fl;
        p->cap = cap;
    }
    be_buffer *b;
    enum be_status st = be_dev_alloc(s->be, p->bytes, &b);
    if (st == BE_ENOMEM_DEV && kv_store_reclaim(s))
        st = be_dev_alloc(s->be, p->bytes, &b);
    if (st == BE_ENOMEM_DEV) {
        struct be_mem_stats ms = be_mem_stats(s->be);
        k->why = kv_fail(s, TIER_ENOMEM_DEV,
                         "device tier budget of %zu bytes exhausted (%zu in use) taking a %zu-byte %s KV block",
                         ms.dev_budget, ms.dev_used, p->bytes, kind == KVQ_BLOCK_QUANT ? "quantized" : "residual");
        return NULL;
    }
    if (st != BE_OK) {
        k->why = kv_fail(s, st == BE_ENOMEM_HOST ? TIER_ENOMEM_HOST : TIER_EIO,
                         "cannot allocate a %zu-byte quantized KV block: %s", p->bytes, be_strerror(st));
        return NULL;
    }
    p->own[p->n_own++] = b;
    s->dev_ext_bytes += p->bytes;
    return be_buffer_data(b);
}

static void pool_put(void *ctx, enum kvq_block_kind kind, void *block)
{
    struct kvq_pool *p = &((struct kvq_seq *)ctx)->pool[kind];
    p->free_list[p->n_free++] = block;
}

void kvq_seq_release(kv_seq *q)
{
    struct kvq_seq *k = q->kvq;
    if (!k)
        return;
    for (int l = 0; k->layers && l < q->s->g.n_layers; l++)
        kvq_layer_free(k->layers[l]);
    kvq_ctx_free(k->ctx);
    for (int i = 0; i < 2; i++) {
        struct kvq_pool *p = &k->pool[i];
        for (size_t b = 0; b < p->n_own; b++)
            be_buffer_free(p->own[b]);
        q->s->dev_ext_bytes -= p->n_own * p->bytes;
        free(p->own);
        free(p->free_list);
    }
    free(k->layers);
    free(k);
    q->kvq = NULL;
}

enum tier_status kvq_seq_init(kv_seq *q)
{
    kv_store *s = q->s;
    struct kvq_error e;
    if (s->g.dtype != BE_F32)
        return kv_fail(s, TIER_ENOTSUP, "the quantized cache keeps its residual in f32; this store holds %s KV",
                       be_dtype_name(s->g.dtype));
    if (kv_quant_validate(&q->p.quant, &e) != TIER_OK)
        return kv_fail(s, TIER_EINVAL, "%s", e.msg);
    struct kvq_seq *k = calloc(1, sizeof(*k));
    if (!k)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: a quantized sequence");
    q->kvq = k;
    k->s = s;
    k->layers = calloc((size_t)s->g.n_layers, sizeof(*k->layers));
    if (!k->layers) {
        kvq_seq_release(q);
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: a quantized sequence");
    }
    struct kvq_alloc a = {.ctx = k, .get = pool_get, .put = pool_put};
    enum tier_status st = kvq_ctx_create(&q->p.quant, s->g.n_kv_heads, s->g.head_dim, s->bt, &a, &k->ctx, &e);
    if (st == TIER_EINVAL)
        st = kv_fail(s, st, "%s", e.msg);
    if (st == TIER_OK) {
        k->pool[KVQ_BLOCK_QUANT].bytes = kvq_ctx_format(k->ctx)->block_bytes;
        k->pool[KVQ_BLOCK_FULL].bytes = kvq_full_block_bytes(k->ctx);
    }
    for (int l = 0; l < s->g.n_layers && st == TIER_OK; l++)
        st = kvq_layer_create(k->ctx, &k->layers[l]);
    if (st != TIER_OK) {
        kvq_seq_release(q);
        return st == TIER_ENOMEM_HOST && !s->err[0] ? kv_fail(s, st, "host memory: a quantized sequence") : st;
    }
    return TIER_OK;
}

enum tier_status kvq_seq_reserve(kv_seq *q, int n_new)
{
    struct kvq_seq *k = q->kvq;
    for (int l = 0; l < q->s->g.n_layers; l++) {
        enum tier_status st = kvq_layer_reserve(k->layers[l], n_new);
        if (st == TIER_OK)
            continue;
        while (l-- > 0)
            kvq_layer_abort(k->layers[l]);
        /* kvq_layer_reserve says ENOMEM_DEV for any failed get */
        return st == TIER_ENOMEM_DEV ? k->why : kv_fail(q->s, st, "quantized KV: %s", tier_strerror(st));
    }
    return TIER_OK;
}

void kvq_seq_commit(kv_seq *q)
{
    for (int l = 0; l < q->s->g.n_layers; l++) {
        kvq_layer_commit(q->kvq->layers[l]);
        kvq_layer_drop(q->kvq->layers[l], q->layers[l].lo);
    }
}

void kvq_seq_abort(kv_seq *q)
{
    for (int l = 0; l < q->s->g.n_layers; l++)
        kvq_layer_abort(q->kvq->layers[l]);
}

size_t kvq_seq_bytes(const kv_seq *q)
{
    const struct kvq_seq *k = q->kvq;
    return k->pool[0].n_own * k->pool[0].bytes + k->pool[1].n_own * k->pool[1].bytes;
}

void kv_seq_qview(const kv_seq *q, int layer, struct be_kvq_view *out)
{
    const struct kv_layer *L = &q->layers[layer];
    if (!q->kvq) {
        *out = (struct be_kvq_view){0};
        kv_seq_view(q, layer, &out->rest);
        out->lo = out->hi = out->rest.lo;
        return;
    }
    kvq_layer_view(q->kvq->layers[layer], out);
    /* a sliding layer reads from its window: the blocks below it may be gone */
    int64_t lo = layer_view_lo(q, L);
    if (lo > out->lo)
        out->lo = lo < out->hi ? lo : out->hi;
    out->rest.window = L->window;
}

enum tier_status kvq_unsupported(kv_seq *q, const char *what)
{
    return kv_fail(q->s, TIER_ENOTSUP, "%s of a quantized cache is not supported yet (quantized blocks stay on the device)",
                   what);
}
