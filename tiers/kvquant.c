/* kvquant.c - the quantized strategy (KV_QUANTIZED) inside the store: one
 * kvq_layer (quant.c) per layer of the sequence, joined to the store's step
 * transaction, views and sliding windows through the hooks kvstore.c calls
 * (kvstore_impl.h).
 *
 * NOTES
 * - Blocks.  Quantized blocks (fmt->block_bytes) and the residual's
 *   blocks (the store's dense layout and dtype) are buffers of one block each.  A
 *   resident sequence takes device buffers from the device tier's budget
 *   like every KV block: an allocation over budget first evicts
 *   unreferenced prefix-cache blocks (kv_store_reclaim), then fails the
 *   step with TIER_ENOMEM_DEV; their bytes count in the store's
 *   dev_ext_bytes (device bytes outside the pool).  A returned block goes
 *   on the sequence's free list of its kind, so the decode loop reuses
 *   blocks (each flush returns the residual's, which the next tokens take
 *   again); after a commit the free lists keep a residual's f32 blocks
 *   and one quantized block per layer, not the f32 blocks of a whole
 *   prompt.  A prompt fed in parts (kv_seq_update_continues) holds its
 *   full-attention layers' parts in f32 blocks until its last part, the
 *   peak a dense cache has; a windowed layer quantizes every part.
 * - Offloaded (host set: kv_seq_params.offload, or kv_seq_offload after the
 *   device ran out): blocks are host-tier ranges (kv_host_alloc), and each
 *   layer streams through the store's device slots (stream.c): its
 *   quantized blocks up to nq and its residual blocks are copied into the
 *   layer's slot region, kv_seq_qview points the view there, and the
 *   residual blocks a chunk wrote go back.  The commit's flush quantizes on
 *   the host blocks after the step's copies have drained.
 * - The store's kv_layer of a quantized layer is paged with no blocks: it
 *   keeps window, keep and lo, so the sliding rule (NOTES invariant 1 of
 *   kvstore.c) is the store's own; after each commit the quantized blocks
 *   wholly below lo are returned (kvq_layer_drop).
 * - Sinks (kv_seq_params.sink): the window is quantized like a sliding
 *   layer's (the store's lo, kvq_layer_drop), keys before RoPE; the sinks
 *   stay full precision in the store's sink block (kvstore.c invariant 8),
 *   which kv_seq_qview puts in the view's rest for be_attention_quant.
 * - Not supported yet, each refused with TIER_ENOTSUP naming it: crop, fork
 *   and past recording; the prefix cache skips quantized sequences.
 */
#include "tiers/kvstore_impl.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tiers/quant.h"

/* One kind of block: every block allocated (own) and the free ones. */
struct kvq_pool {
    size_t bytes;
    void **own;       /* the blocks' data */
    be_buffer **buf;  /* device blocks: own[i]'s buffer (unused on the host) */
    void **free_list; /* same capacity as own, so a put never allocates */
    size_t n_own, n_free, cap;
};

struct kvq_seq {
    kv_store *s;
    kvq_ctx *ctx;
    kvq_layer **layers;          /* [n_layers] */
    struct kvq_pool pool[2];     /* by enum kvq_block_kind */
    bool host;                   /* quantized + offloaded: blocks in the host tier, streamed */
    void **slot_blocks;          /* streaming: the current layer's blocks in its slot */
    int slot_cap;
    enum tier_status why;        /* what the last failed get ran out of */
};

static enum tier_status pool_grow(struct kvq_pool *p)
{
    size_t cap = p->cap ? 2 * p->cap : 16;
    void **own = realloc(p->own, cap * sizeof(*own));
    if (own)
        p->own = own;
    be_buffer **buf = own ? realloc(p->buf, cap * sizeof(*buf)) : NULL;
    if (buf)
        p->buf = buf;
    void **fl = buf ? realloc(p->free_list, cap * sizeof(*fl)) : NULL;
    if (!fl)
        return TIER_ENOMEM_HOST;
    p->free_list = fl;
    p->cap = cap;
    return TIER_OK;
}

/* A new block in the sequence's tier: the host tier once offloaded, else
 * the device's. */
static void *block_alloc(struct kvq_seq *k, enum kvq_block_kind kind, be_buffer **buf)
{
    size_t bytes = k->pool[kind].bytes;
    *buf = NULL;
    if (k->host) {
        void *data;
        k->why = kv_host_alloc(k->s, bytes, &data);
        return k->why == TIER_OK ? data : NULL;
    }
    k->why = kv_dev_alloc(k->s, bytes, kind == KVQ_BLOCK_QUANT ? "a quantized KV block" : "a residual KV block", buf);
    return k->why == TIER_OK ? be_buffer_data(*buf) : NULL;
}

static void block_free(struct kvq_seq *k, enum kvq_block_kind kind, size_t i)
{
    struct kvq_pool *p = &k->pool[kind];
    if (k->host)
        kv_host_free(k->s, p->own[i], p->bytes);
    else
        kv_dev_free(k->s, p->buf[i], p->bytes);
}

static void *pool_get(void *ctx, enum kvq_block_kind kind)
{
    struct kvq_seq *k = ctx;
    struct kvq_pool *p = &k->pool[kind];
    if (p->n_free)
        return p->free_list[--p->n_free];
    if (p->n_own == p->cap && pool_grow(p) != TIER_OK) {
        k->why = kv_fail(k->s, TIER_ENOMEM_HOST, "host memory: growing the table of %zu quantized KV blocks", p->n_own);
        return NULL;
    }
    void *data = block_alloc(k, kind, &p->buf[p->n_own]);
    if (data)
        p->own[p->n_own++] = data;
    return data;
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
            block_free(k, i, b);
        free(p->own);
        free(p->buf);
        free(p->free_list);
    }
    free(k->layers);
    free(k->slot_blocks);
    free(k);
    q->kvq = NULL;
}

enum tier_status kvq_store_format(const kv_store *s, const struct kv_quant_params *p, struct be_kvq_format *f,
                                  struct kvq_error *err)
{
    return kvq_format_init(f, p, s->g.n_kv_heads, s->g.head_dim, kvq_block_tokens(p, s->bt), err);
}

enum tier_status kvq_seq_init(kv_seq *q)
{
    kv_store *s = q->s;
    struct kvq_error e;
    struct be_kvq_format f;
    /* the check a session's creation makes too: both refuse the same caches
     * with the same message */
    if (kvq_store_format(s, &q->p.quant, &f, &e) != TIER_OK)
        return kv_fail(s, TIER_EINVAL, "%s", e.msg);
    struct kvq_seq *k = calloc(1, sizeof(*k));
    if (!k)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: a quantized sequence");
    q->kvq = k;
    k->s = s;
    k->host = q->p.offload;
    k->layers = calloc((size_t)s->g.n_layers, sizeof(*k->layers));
    if (!k->layers) {
        kvq_seq_release(q);
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: a quantized sequence");
    }
    struct kvq_alloc a = {.ctx = k, .get = pool_get, .put = pool_put};
    enum tier_status st = kvq_ctx_create(s->be, &q->p.quant, s->g.dtype, s->g.n_kv_heads, s->g.head_dim, s->bt, &a, &k->ctx, &e);
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

struct kvq_layer *kvq_seq_layer(const kv_seq *q, int layer)
{
    return q->kvq->layers[layer];
}

enum tier_status kvq_seq_restore(kv_seq *q, bool host, const struct kvq_layer_state *ls)
{
    struct kvq_seq *k = q->kvq;
    k->host = host;
    for (int l = 0; l < q->s->g.n_layers; l++) {
        enum tier_status st = kvq_layer_restore(k->layers[l], q->len, ls[l].nq, ls[l].qoff, ls[l].scale_k,
                                                ls[l].scale_v);
        if (st == TIER_ENOMEM_DEV) /* any failed get (kvq_layer_reserve's convention) */
            return k->why;
        if (st != TIER_OK)
            return kv_fail(q->s, st, "restoring quantized layer %d: %s", l, tier_strerror(st));
    }
    return TIER_OK;
}

enum tier_status kvq_seq_reserve(kv_seq *q, int n_new, bool more)
{
    struct kvq_seq *k = q->kvq;
    for (int l = 0; l < q->s->g.n_layers; l++) {
        /* A windowed layer (sliding, sink) applies the rule at every part:
         * waiting for the last would hold the whole prompt unquantized where
         * the layer keeps a window, and it has no reference to match. */
        enum tier_status st = kvq_layer_reserve(k->layers[l], n_new, more && !q->layers[l].window && !q->p.sink);
        if (st == TIER_OK)
            continue;
        while (l-- > 0)
            kvq_layer_abort(k->layers[l]);
        /* kvq_layer_reserve says ENOMEM_DEV for any failed get */
        return st == TIER_ENOMEM_DEV ? k->why : kv_fail(q->s, st, "quantized KV: %s", tier_strerror(st));
    }
    return TIER_OK;
}

/* Returns free blocks beyond `keep` to their tier. */
static void pool_trim(struct kvq_seq *k, enum kvq_block_kind kind, size_t keep)
{
    struct kvq_pool *p = &k->pool[kind];
    while (p->n_free > keep) {
        void *b = p->free_list[--p->n_free];
        size_t i = p->n_own;
        while (p->own[--i] != b)
            ;
        block_free(k, kind, i);
        p->own[i] = p->own[--p->n_own];
        p->buf[i] = p->buf[p->n_own];
    }
}

enum tier_status kvq_seq_commit(kv_seq *q)
{
    struct kvq_seq *k = q->kvq;
    int n = q->s->g.n_layers;
    for (int l = 0; l < n; l++) {
        enum be_status st = kvq_layer_commit(k->layers[l]);
        if (st != BE_OK)
            return kv_fail(q->s, TIER_EIO, "quantizing KV: %s", be_strerror(st));
        kvq_layer_drop(k->layers[l], q->layers[l].lo);
    }
    /* A prompt's step takes f32 blocks for all its tokens and its flush
     * hands them back: keep what decoding takes again, a residual's f32
     * blocks (plus the one a flush leaves partly filled) and one quantized
     * block per layer, not a full-precision prompt's worth. */
    size_t bt = (size_t)q->s->bt, R = (size_t)q->p.quant.residual_length;
    pool_trim(k, KVQ_BLOCK_FULL, (size_t)n * ((R + bt - 1) / bt + 1));
    pool_trim(k, KVQ_BLOCK_QUANT, (size_t)n);
    return TIER_OK;
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

bool kvq_seq_on_host(const kv_seq *q)
{
    return q->kvq && q->kvq->host;
}

/* ---- quantized + offloaded -------------------------------------------------- */

/* A device block and the host block that replaces it. */
struct moved {
    void *dev, *host;
};

static int cmp_ptr(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t)*(void *const *)a, y = (uintptr_t)*(void *const *)b;
    return (x > y) - (x < y);
}

static int cmp_moved(const void *a, const void *b)
{
    return cmp_ptr(&((const struct moved *)a)->dev, &((const struct moved *)b)->dev);
}

struct move_plan {
    struct moved *m[2]; /* by kind, sorted by dev */
    size_t n[2];
};

static void *moved_to(void *ctx, enum kvq_block_kind kind, void *block)
{
    const struct move_plan *plan = ctx;
    struct moved key = {.dev = block};
    const struct moved *hit = bsearch(&key, plan->m[kind], plan->n[kind], sizeof(key), cmp_moved);
    return hit->host; /* every block a layer holds is in use, so it was moved */
}

/* Copies every block in use (owned, not on the free list) of one kind into
 * a new host block.  On failure the host blocks taken are returned. */
static enum tier_status move_kind(struct kvq_seq *k, enum kvq_block_kind kind, struct move_plan *plan)
{
    struct kvq_pool *p = &k->pool[kind];
    kv_store *s = k->s;
    void **free_sorted = malloc((p->n_free + 1) * sizeof(*free_sorted));
    struct moved *m = malloc((p->n_own + 1) * sizeof(*m));
    if (!free_sorted || !m) {
        free(free_sorted);
        free(m);
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: moving %zu quantized KV blocks", p->n_own);
    }
    if (p->n_free) /* free_list is NULL before the first block */
        memcpy(free_sorted, p->free_list, p->n_free * sizeof(*free_sorted));
    qsort(free_sorted, p->n_free, sizeof(*free_sorted), cmp_ptr);
    size_t n = 0;
    enum tier_status st = TIER_OK;
    for (size_t i = 0; i < p->n_own && st == TIER_OK; i++) {
        if (bsearch(&p->own[i], free_sorted, p->n_free, sizeof(*free_sorted), cmp_ptr))
            continue;
        st = kv_host_alloc(s, p->bytes, &m[n].host);
        if (st != TIER_OK)
            break;
        m[n].dev = p->own[i];
        enum be_status bs = be_copy(s->be, m[n].host, m[n].dev, p->bytes, BE_D2H);
        n++;
        if (bs != BE_OK)
            st = kv_fail(s, TIER_EIO, "copying a quantized KV block to the host tier: %s", be_strerror(bs));
    }
    free(free_sorted);
    if (st != TIER_OK) {
        while (n-- > 0)
            kv_host_free(s, m[n].host, p->bytes);
        free(m);
        return st;
    }
    qsort(m, n, sizeof(*m), cmp_moved);
    plan->m[kind] = m;
    plan->n[kind] = n;
    return TIER_OK;
}

enum tier_status kvq_seq_offload(kv_seq *q)
{
    struct kvq_seq *k = q->kvq;
    if (k->host)
        return TIER_OK;
    struct move_plan plan = {0};
    enum tier_status st = move_kind(k, KVQ_BLOCK_QUANT, &plan);
    if (st == TIER_OK && (st = move_kind(k, KVQ_BLOCK_FULL, &plan)) != TIER_OK) {
        for (size_t i = 0; i < plan.n[KVQ_BLOCK_QUANT]; i++)
            kv_host_free(k->s, plan.m[KVQ_BLOCK_QUANT][i].host, k->pool[KVQ_BLOCK_QUANT].bytes);
    }
    if (st != TIER_OK) {
        free(plan.m[KVQ_BLOCK_QUANT]);
        return st;
    }
    /* Nothing can fail from here: the layers point at the host copies, the
     * device blocks (free ones included) go back. */
    for (int l = 0; l < k->s->g.n_layers; l++)
        kvq_layer_remap(k->layers[l], moved_to, &plan);
    for (int kind = 0; kind < 2; kind++) {
        struct kvq_pool *p = &k->pool[kind];
        for (size_t i = 0; i < p->n_own; i++)
            block_free(k, kind, i);
        for (size_t i = 0; i < plan.n[kind]; i++)
            p->own[i] = plan.m[kind][i].host;
        p->n_own = plan.n[kind];
        p->n_free = 0;
        free(plan.m[kind]);
    }
    k->host = true;
    return TIER_OK;
}

/* A layer's region in its slot: its nq quantized blocks up to the last
 * quantized position (those the commit may fill are written on the host,
 * after the step), then its nf full-precision ones; v is the layer's own
 * view, on its host blocks. */
struct slot_layout {
    struct be_kvq_view v;
    int nq, nf;
    size_t qb, fb; /* bytes of a block of each kind */
};

static void slot_layout(const struct kvq_seq *k, int layer, struct slot_layout *o)
{
    kvq_layer_view(k->layers[layer], &o->v);
    int64_t T = o->v.fmt->block_tokens;
    o->nq = o->v.hi > o->v.base ? (int)((o->v.hi - o->v.base + T - 1) / T) : 0;
    o->nf = o->v.rest.n_blocks;
    o->qb = k->pool[KVQ_BLOCK_QUANT].bytes;
    o->fb = k->pool[KVQ_BLOCK_FULL].bytes;
}

size_t kvq_seq_slot_bytes(const kv_seq *q, int layer)
{
    struct slot_layout o;
    slot_layout(q->kvq, layer, &o);
    return (size_t)o.nq * o.qb + (size_t)o.nf * o.fb;
}

enum tier_status kvq_seq_slot_table(kv_seq *q)
{
    struct kvq_seq *k = q->kvq;
    int need = 0;
    for (int l = 0; l < q->s->g.n_layers; l++) {
        struct slot_layout o;
        slot_layout(k, l, &o);
        need = o.nq + o.nf > need ? o.nq + o.nf : need;
    }
    if (need <= k->slot_cap)
        return TIER_OK;
    int cap = k->slot_cap ? k->slot_cap : 16;
    while (cap < need)
        cap *= 2;
    void **b = realloc(k->slot_blocks, (size_t)cap * sizeof(*b));
    if (!b)
        return kv_fail(q->s, TIER_ENOMEM_HOST, "host memory: a table of %d streamed quantized KV blocks", cap);
    k->slot_blocks = b;
    k->slot_cap = cap;
    return TIER_OK;
}

/* One copy per block: a layer's blocks are separate allocations. */
static enum be_status copy_blocks(kv_store *s, void *const *host, int n, char *region, size_t bytes,
                                  enum be_copy_dir dir, struct kv_xfer_stats *x)
{
    for (int i = 0; i < n; i++) {
        char *d = region + (size_t)i * bytes;
        enum be_status st = dir == BE_H2D ? be_copy_async(s->be, d, host[i], bytes, dir)
                                          : be_copy_async(s->be, host[i], d, bytes, dir);
        if (st != BE_OK)
            return st;
        if (dir == BE_H2D)
            x->bytes_h2d += bytes;
        else
            x->bytes_d2h += bytes;
    }
    return BE_OK;
}

enum be_status kvq_seq_copy_in(kv_seq *q, int layer, char *region, struct kv_xfer_stats *x)
{
    struct slot_layout o;
    slot_layout(q->kvq, layer, &o);
    enum be_status st = copy_blocks(q->s, o.v.blocks, o.nq, region, o.qb, BE_H2D, x);
    if (st == BE_OK)
        st = copy_blocks(q->s, o.v.rest.blocks, o.nf, region + (size_t)o.nq * o.qb, o.fb, BE_H2D, x);
    return st;
}

enum be_status kvq_seq_write_back(kv_seq *q, int layer, char *region, int64_t from, int64_t to,
                                  struct kv_xfer_stats *x)
{
    struct slot_layout o;
    slot_layout(q->kvq, layer, &o);
    const struct be_kv_view *r = &o.v.rest;
    int64_t b0 = (from - r->base) / r->block_tokens, b1 = (to - r->base + r->block_tokens - 1) / r->block_tokens;
    return copy_blocks(q->s, r->blocks + b0, (int)(b1 - b0), region + (size_t)o.nq * o.qb + (size_t)b0 * o.fb, o.fb,
                       BE_D2H, x);
}

void kv_seq_qview(const kv_seq *q, int layer, struct be_kvq_view *out)
{
    const struct kv_layer *L = &q->layers[layer];
    if (!q->kvq) {
        *out = (struct be_kvq_view){.rest_dtype = q->s->g.dtype};
        kv_seq_view(q, layer, &out->rest);
        out->lo = out->hi = out->rest.lo;
        return;
    }
    struct kvq_seq *k = q->kvq;
    const kv_store *s = q->s;
    if (k->host && s->streaming) { /* the step reads and writes the copies in the layer's slot */
        struct slot_layout o;
        slot_layout(k, layer, &o);
        char *region = kv_slot_region(s, layer, L);
        for (int i = 0; i < o.nq; i++)
            k->slot_blocks[i] = region + (size_t)i * o.qb;
        for (int i = 0; i < o.nf; i++)
            k->slot_blocks[o.nq + i] = region + (size_t)o.nq * o.qb + (size_t)i * o.fb;
        *out = o.v;
        out->blocks = k->slot_blocks;
        out->n_blocks = o.nq;
        out->rest.blocks = k->slot_blocks + o.nq;
    } else {
        kvq_layer_view(k->layers[layer], out);
    }
    /* a sliding layer reads from its window: the blocks below it may be gone */
    int64_t lo = layer_view_lo(q, L);
    if (lo > out->lo)
        out->lo = lo < out->hi ? lo : out->hi;
    out->rest.window = L->window;
    if (!q->p.sink)
        return;
    /* the sinks in full precision, then the window after them (kvstore.c
     * invariant 8); the window may start inside the residual */
    sink_view(q, L, &out->rest);
    int64_t first = out->rest.shift + out->rest.sinks;
    if (first > out->lo)
        out->lo = first < out->hi ? first : out->hi;
}

enum tier_status kvq_unsupported(kv_seq *q, const char *what)
{
    return kv_fail(q->s, TIER_ENOTSUP, "%s of a quantized cache is not supported yet", what);
}
