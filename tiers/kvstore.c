/* kvstore.c - the KV store: the device pool of paged blocks, extents on the
 * device and in the host tier, the strategies as choices of a home per
 * layer, the step transaction and the migration to the host tier.  It is
 * longer than the other files because all of these keep the invariants of
 * one struct kv_layer (kvstore_impl.h) at every step; the parts with an
 * interface of their own (streaming, the host pool, quantized layers, the
 * prefix cache) live in their own files.
 *
 * NOTES
 * Homes (kvstore_impl.h).  A dynamic sequence's layers are paged: blocks
 * from chunks allocated on the backend's device pool, recycled through a
 * free list, so the decode loop never allocates device memory except when
 * the pool has to grow.  Every other layer lives in an extent: one
 * contiguous range (a device buffer, or a piece of a host-pool slab) used
 * as a ring of ext_blocks blocks, logical block b (positions
 * [b*bt, (b+1)*bt)) in ring block b % ext_blocks.  One copy moves a layer
 * (two where the ring wraps).
 *
 * Strategies -> homes, per layer (docs/strategies.md):
 *   dynamic            paged
 *   static             device extent; a full layer's is sized for
 *                      max_cache_len at creation and never grows
 *   offloaded          host extent, grown by doubling; sliding layers too
 *                      unless offload_sliding says NO (then device extent)
 *   offloaded_static   host extent sized at creation; sliding layers stay
 *                      on the device unless offload_sliding says YES
 *   adaptive           the first R streamable layers on the device, R the
 *                      most the device budget holds at max_cache_len
 *   sink               paged (dynamic) or quantized (kvquant.c): sinks +
 *                      the last W-S tokens, keys unrotated (invariant 8)
 *
 * Sequence states: idle (pending == 0) -> reserved (pending > 0, listed in
 * s->active) -> idle by commit or abort.  Offload, crop, fork and prefix
 * match only while idle.  Orthogonally, recording (record_past): sliding
 * layers stop dropping states at commit until the next crop shrinks them.
 * A sink sequence (dynamic or quantized) is growing while len <= W (crop
 * allowed unless quantized),
 * then evicting (lo > 0: crop, recording, offload and the prefix cache
 * refused); it never goes back.
 *
 * Sharing: pool blocks carry a reference count (struct kv_block); a fork
 * and a prefix match put the same blocks in several tables, and the prefix
 * cache (prefix.c) keeps published blocks after their last table lets go.
 *
 * Invariants:
 *   (1) every position in [lo, len) is stored; lo only grows.  Sliding
 *       layers keep `keep` tokens: W-1 for dynamic strategies (HF
 *       DynamicSlidingWindowLayer), W for static ones
 *       (StaticSlidingWindowLayer); attention during a step sees from
 *       len - (W-1) in both (the rows HF's sliding layers return).
 *   (2) paged: n_blocks is exactly what [base, len + pending) needs, so
 *       abort can recompute what to release from len alone; base is a
 *       multiple of bt and base <= lo.
 *   (3) extent: [floor(lo/bt), ceil((len + pending)/bt)) spans at most
 *       ext_blocks blocks, so no two live positions share a ring slot and
 *       writing the step's tokens never touches a stored one (abort needs
 *       no undo).
 *   (4) a failed call leaves every sequence's positions and contents as
 *       they were.  It may leave an extent larger (capacity is not state)
 *       and a formerly shared block private (a copy with equal contents).
 *   (5) s->host_used is the sum of host extent sizes and never exceeds a
 *       non-zero host_budget.
 *   (6) a step writes only into blocks with ref == 1 that are not
 *       published: the block holding position len is copied first
 *       otherwise (copy on write); blocks after it are fresh.
 *   (7) a block is on the free list iff ref == 0 and it is not published.
 *   (8) sink strategy (S sinks, window W): a layer stores [0, S) and
 *       [lo, len), lo = 0 until len > W, then len - (W-S).  The positions
 *       [0, S) sit in table block 0 while base == 0, else in sink_blk,
 *       which the layer references from the commit that lets lo reach the
 *       second block on; that block is never written again (the sinks
 *       were written by earlier steps, crop is refused once lo > 0).
 *       Keys are stored unrotated; RoPE uses indices in the cache.
 *       Quantized: sink_blk is a pool block taken at creation, filled
 *       at the commits that bring positions [0, S), and read for every
 *       committed sink from then on (a sink is never read quantized);
 *       the window is the quantized layer's, with lo as above.
 *   (9) host extents are ranges of the host pool's slabs (s->hp,
 *       hostpool.c), never backend buffers of their own: a slab is taken
 *       from the backend only when no free range fits, and returned when
 *       it empties unless it is the last.  The backend's host accounting
 *       counts the slabs, host_used the extents.
 * All functions run on one thread (the inference thread).
 */
#include "tiers/kvstore_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util/clock.h"

#define KV_DEFAULT_BLOCK_TOKENS 16 /* vLLM's default too; docs/architecture.md "Block size" */
#define KV_CHUNK_BLOCKS 64 /* blocks per device allocation when the pool grows */

const char *tier_strerror(enum tier_status st)
{
    switch (st) {
    case TIER_OK: return "ok";
    case TIER_ENOMEM_DEV: return "device tier budget exhausted";
    case TIER_ENOMEM_HOST: return "host tier exhausted";
    case TIER_EINVAL: return "invalid KV store parameter";
    case TIER_EFULL: return "KV cache is full";
    case TIER_ENOTSUP: return "KV strategy not supported";
    case TIER_EIO: return "KV tier I/O error";
    case TIER_ECONFLICT: return "KV cache state conflict";
    }
    return "unknown tier status";
}

const char *kv_strategy_name(enum kv_strategy st)
{
    switch (st) {
    case KV_DYNAMIC: return "dynamic";
    case KV_STATIC: return "static";
    case KV_OFFLOADED: return "offloaded";
    case KV_OFFLOADED_STATIC: return "offloaded_static";
    case KV_QUANTIZED: return "quantized";
    }
    return "?";
}

enum tier_status kv_fail(kv_store *s, enum tier_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->err, sizeof(s->err), fmt, ap);
    va_end(ap);
    return st;
}

enum tier_status why_fail(char *why, size_t cap, enum tier_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, cap, fmt, ap);
    va_end(ap);
    return st;
}

static bool is_static(enum kv_strategy st)
{
    return st == KV_STATIC || st == KV_OFFLOADED_STATIC;
}

static bool is_offloaded(enum kv_strategy st)
{
    return st == KV_OFFLOADED || st == KV_OFFLOADED_STATIC;
}

/* What a sequence of st continues as in the host tier (a fallback keeps
 * its static shapes). */
static enum kv_strategy offloaded_of(enum kv_strategy st)
{
    return is_static(st) ? KV_OFFLOADED_STATIC : KV_OFFLOADED;
}

/* ---- the store ------------------------------------------------------------ */

enum tier_status kv_store_open(be_backend *be, const struct kv_geom *g, const struct kv_store_params *p,
                               kv_store **out)
{
    static const struct kv_store_params defaults;
    if (!p)
        p = &defaults;
    *out = NULL;
    bool state = g && g->state_bytes > 0; /* a state model has no heads */
    if (!be || !g || g->n_layers <= 0 || (state ? g->n_kv_heads || g->head_dim : g->n_kv_heads <= 0 || g->head_dim <= 0) ||
        p->block_tokens < 0 || p->checkpoint_interval < 0 || !be_dtype_size(g->dtype))
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
    hp_init(&s->hp, be);
    s->g = *g;
    s->g.layer_window = s->layer_window;
    s->bt = p->block_tokens ? p->block_tokens : KV_DEFAULT_BLOCK_TOKENS;
    s->block_bytes = 2 * (size_t)g->n_kv_heads * (size_t)s->bt * (size_t)g->head_dim * be_dtype_size(g->dtype);
    s->host_budget = p->host_mem;
    s->prefix_on = p->prefix_cache && !state; /* a state has no blocks to share */
    s->state_prefix = p->prefix_cache && state; /* it shares checkpoints instead */
    s->ckpt_interval = p->checkpoint_interval ? p->checkpoint_interval : 256;
    s->hash_mask = p->prefix_hash_mask ? p->prefix_hash_mask : UINT64_MAX;
    enum tier_status st = kv_stream_init(s);
    if (st != TIER_OK) {
        kv_store_free(s);
        return st;
    }
    *out = s;
    return TIER_OK;
}

void kv_store_free(kv_store *s)
{
    if (!s)
        return;
    prefix_release_all(s);
    state_shared_release(s);
    kept_release_all(s);
    kv_stream_release(s);
    hp_release(&s->hp);
    for (size_t i = 0; i < s->n_chunks; i++) {
        be_buffer_free(s->chunks[i]);
        free(s->chunk_desc[i]);
    }
    free(s->chunks);
    free(s->chunk_desc);
    free(s->free_blocks);
    free(s->active);
    free(s->layer_window);
    free(s);
}

int kv_store_checkpoint_interval(const kv_store *s)
{
    return s->g.state_bytes ? (int)s->ckpt_interval : 0;
}

int kv_store_block_tokens(const kv_store *s)
{
    return s->bt;
}

enum be_dtype kv_store_dtype(const kv_store *s)
{
    return s->g.dtype;
}

const char *kv_store_errmsg(const kv_store *s)
{
    return s->err;
}

struct kv_store_stats kv_store_stats(const kv_store *s)
{
    uint64_t used = s->n_total - s->n_free;
    return (struct kv_store_stats){
        .dev_bytes = (size_t)used * s->block_bytes + s->dev_ext_bytes + 2 * s->slot_cap,
        .host_bytes = s->host_used,
        .host_budget = s->host_budget,
        .slot_bytes = 2 * s->slot_cap,
        .blocks_used = used,
        .fallbacks = s->fallbacks,
        .fallbacks_oom = s->fallbacks_oom,
        .prefix_entries = s->n_entries + s->n_sckpt + s->n_kept,
        .prefix_evictable = s->n_unref + s->n_sckpt + s->n_kept_unref,
        .prefix_unref_bytes = s->n_unref * (size_t)s->g.n_layers * s->block_bytes +
                              s->n_sckpt * (size_t)s->g.n_layers * s->g.state_bytes + s->kept_unref_bytes,
        .prefix_hit_tokens = s->prefix_hits,
        .prefix_evictions = s->prefix_evictions,
        .prefix_spill_dropped = s->spill_dropped,
        .xfer = s->total,
        .last_step = s->step,
    };
}

/* Adds one chunk of blocks to the free list.  Under a tight budget a full
 * chunk may not fit while a smaller one does, so the size halves down to a
 * single block before giving up. */
static enum tier_status pool_grow(kv_store *s)
{
    if (s->n_chunks == s->cap_chunks) {
        size_t cap = s->cap_chunks ? 2 * s->cap_chunks : 16;
        be_buffer **c = realloc(s->chunks, cap * sizeof(*c));
        if (!c)
            return TIER_ENOMEM_HOST;
        s->chunks = c;
        struct kv_block **d = realloc(s->chunk_desc, cap * sizeof(*d));
        if (!d)
            return TIER_ENOMEM_HOST;
        s->chunk_desc = d;
        s->cap_chunks = cap;
    }
    for (size_t nb = KV_CHUNK_BLOCKS; nb >= 1; nb /= 2) {
        struct kv_block **fb = realloc(s->free_blocks, (s->n_total + nb) * sizeof(*fb));
        if (!fb)
            return TIER_ENOMEM_HOST;
        s->free_blocks = fb;
        struct kv_block *desc = calloc(nb, sizeof(*desc));
        if (!desc)
            return TIER_ENOMEM_HOST;
        be_buffer *buf;
        enum be_status st = be_dev_alloc(s->be, nb * s->block_bytes, &buf);
        if (st != BE_OK)
            free(desc);
        if (st == BE_ENOMEM_DEV)
            continue;
        if (st != BE_OK)
            return st == BE_ENOMEM_HOST ? TIER_ENOMEM_HOST : TIER_EIO;
        s->chunk_desc[s->n_chunks] = desc;
        s->chunks[s->n_chunks++] = buf;
        char *base = be_buffer_data(buf);
        for (size_t i = 0; i < nb; i++) {
            desc[nb - 1 - i].data = base + (nb - 1 - i) * s->block_bytes;
            s->free_blocks[s->n_free++] = &desc[nb - 1 - i];
        }
        s->n_total += nb;
        return TIER_OK;
    }
    struct be_mem_stats ms = be_mem_stats(s->be);
    return kv_fail(s, TIER_ENOMEM_DEV,
                   "device tier budget of %zu bytes exhausted (%zu in use) growing the KV pool by a %zu-byte block",
                   ms.dev_budget, ms.dev_used, s->block_bytes);
}

/* Returns the pool chunks none of whose blocks is in use to the device, so
 * that a sequence moved to the host tier really frees device budget. */
static void kv_store_trim(kv_store *s)
{
    size_t keep = 0;
    for (size_t c = 0; c < s->n_chunks; c++) {
        const struct kv_block *lo = s->chunk_desc[c];
        size_t nb = be_buffer_size(s->chunks[c]) / s->block_bytes;
        const struct kv_block *hi = lo + nb;
        size_t n_in = 0;
        for (size_t i = 0; i < s->n_free; i++)
            n_in += s->free_blocks[i] >= lo && s->free_blocks[i] < hi;
        if (n_in < nb) {
            s->chunk_desc[keep] = s->chunk_desc[c];
            s->chunks[keep++] = s->chunks[c];
            continue;
        }
        size_t k = 0;
        for (size_t i = 0; i < s->n_free; i++)
            if (s->free_blocks[i] < lo || s->free_blocks[i] >= hi)
                s->free_blocks[k++] = s->free_blocks[i];
        s->n_free = k;
        s->n_total -= nb;
        be_buffer_free(s->chunks[c]);
        free(s->chunk_desc[c]);
    }
    s->n_chunks = keep;
}

size_t kv_store_pool_warm(kv_store *s, size_t bytes)
{
    size_t from = s->n_chunks, grown = 0;
    while (grown < bytes && pool_grow(s) == TIER_OK)
        grown += be_buffer_size(s->chunks[s->n_chunks - 1]);
    s->err[0] = '\0'; /* the budget's end is where warming stops, not an error */
    void *zero = grown ? calloc(1, KV_CHUNK_BLOCKS * s->block_bytes) : NULL;
    for (size_t c = from; zero && c < s->n_chunks; c++)
        be_copy(s->be, be_buffer_data(s->chunks[c]), zero, be_buffer_size(s->chunks[c]), BE_H2D);
    free(zero);
    return grown;
}

/* Evicts every unreferenced prefix-cache entry and returns the emptied
 * chunks: what a device allocation outside the pool tries before failing. */
bool kv_store_reclaim(kv_store *s)
{
    bool any = false;
    while (prefix_evict_one(s) || kept_evict_one(s))
        any = true;
    kv_store_trim(s);
    return any;
}

void blk_get(kv_store *s, struct kv_block *b)
{
    b->ref++;
    if (b->pub)
        prefix_hold(s, b->pub);
}

void blk_put(kv_store *s, struct kv_block *b)
{
    b->ref--;
    if (b->pub)
        prefix_unhold(s, b->pub); /* the cache keeps it until evicted */
    else if (!b->ref)
        s->free_blocks[s->n_free++] = b;
}

/* One block for a sequence's table (ref 1): from the free list, else a
 * new chunk, else, when the device budget refuses, the least recently used
 * unreferenced prefix-cache entry's blocks. */
enum tier_status pool_take(kv_store *s, struct kv_block **out)
{
    while (!s->n_free) {
        enum tier_status st = pool_grow(s);
        if (st == TIER_OK)
            break;
        if (st != TIER_ENOMEM_DEV || !(prefix_evict_one(s) || kept_evict_one(s)))
            return st;
        s->err[0] = '\0';
    }
    *out = s->free_blocks[--s->n_free];
    (*out)->ref = 1;
    return TIER_OK;
}

/* Device bytes free to the store: the budget left plus its free pool blocks. */
static size_t dev_available(const kv_store *s)
{
    struct be_mem_stats ms = be_mem_stats(s->be);
    return ms.dev_budget - ms.dev_used + (s->n_free + s->n_unref * (size_t)s->g.n_layers) * s->block_bytes;
}

/* ---- extents -------------------------------------------------------------- */

/* An extent of nb blocks in the home's tier: a device buffer, or a range
 * of the host pool charged to the host budget. */
static enum tier_status ext_alloc(kv_store *s, enum kv_home home, int nb, struct kv_ext *out)
{
    size_t bytes = (size_t)nb * s->block_bytes;
    struct kv_ext e = {.size = bytes};
    enum tier_status ts = home == KV_HOME_HOST ? kv_host_alloc(s, bytes, &e.data)
                                               : kv_dev_alloc(s, bytes, "a KV extent", &e.dev);
    if (ts != TIER_OK)
        return ts;
    if (e.dev)
        e.data = be_buffer_data(e.dev);
    *out = e;
    return TIER_OK;
}

enum tier_status kv_dev_alloc(kv_store *s, size_t bytes, const char *what, be_buffer **out)
{
    enum be_status st = be_dev_alloc(s->be, bytes, out);
    if (st == BE_ENOMEM_DEV && kv_store_reclaim(s))
        st = be_dev_alloc(s->be, bytes, out);
    if (st == BE_ENOMEM_DEV) {
        struct be_mem_stats ms = be_mem_stats(s->be);
        return kv_fail(s, TIER_ENOMEM_DEV, "device tier budget of %zu bytes exhausted: %zu in use, %zu more needed for %s",
                       ms.dev_budget, ms.dev_used, bytes, what);
    }
    if (st != BE_OK)
        return kv_fail(s, st == BE_ENOMEM_HOST ? TIER_ENOMEM_HOST : TIER_EIO,
                       "cannot allocate %zu device bytes for %s: %s", bytes, what, be_strerror(st));
    s->dev_ext_bytes += bytes;
    return TIER_OK;
}

void kv_dev_free(kv_store *s, be_buffer *b, size_t bytes)
{
    s->dev_ext_bytes -= bytes;
    be_buffer_free(b);
}

enum tier_status kv_host_alloc(kv_store *s, size_t bytes, void **out)
{
    /* shared checkpoints (state.c) and kept sequences give way to a sequence's memory */
    while (s->host_budget && bytes > s->host_budget - s->host_used &&
           (state_shared_evict_one(s) || kept_evict_one(s)))
        ;
    if (s->host_budget && bytes > s->host_budget - s->host_used)
        return kv_fail(s, TIER_ENOMEM_HOST, "host tier budget of %zu bytes exhausted: %zu in use, %zu more needed",
                       s->host_budget, s->host_used, bytes);
    enum be_status st = hp_alloc(&s->hp, bytes, s->host_budget, out);
    if (st != BE_OK)
        return kv_fail(s, st == BE_ENOMEM_HOST ? TIER_ENOMEM_HOST : TIER_EIO,
                       "host memory: cannot allocate %zu bytes of host-tier KV: %s", bytes, be_strerror(st));
    s->host_used += bytes;
    return TIER_OK;
}

void kv_host_free(kv_store *s, void *ptr, size_t bytes)
{
    s->host_used -= bytes;
    hp_free(&s->hp, ptr, bytes);
    /* The last host bytes gone, nothing streams any more: the slots go
     * back to the device (invariant 3), or one out-of-memory fallback
     * would keep two layers' worth of device memory and push later
     * requests to the host tier too. */
    if (s->host_used == 0 && !s->streaming)
        kv_stream_slots_release(s);
}

static void ext_release(kv_store *s, enum kv_home home, const struct kv_ext *e)
{
    if (!e->data)
        return;
    if (home == KV_HOME_HOST)
        kv_host_free(s, e->data, e->size);
    else
        kv_dev_free(s, e->dev, e->size);
}

char *kv_layer_block(const kv_store *s, const struct kv_layer *L, int64_t b)
{
    if (L->home == KV_HOME_PAGED)
        return L->blocks[b - L->base / s->bt];
    return (char *)L->ext.data + (size_t)(b % L->ext_blocks) * s->block_bytes;
}

/* Copies logical blocks [b0, b1) between two layers' storage (growth and
 * migration, never the decode path: one synchronous copy per block). */
static enum tier_status copy_blocks(kv_store *s, const struct kv_layer *to, const struct kv_layer *from, int64_t b0,
                                    int64_t b1)
{
    for (int64_t b = b0; b < b1; b++) {
        char *d = kv_layer_block(s, to, b), *src = kv_layer_block(s, from, b);
        if (to->home == KV_HOME_HOST && from->home == KV_HOME_HOST) {
            memcpy(d, src, s->block_bytes);
            continue;
        }
        enum be_copy_dir dir = to->home == KV_HOME_HOST ? BE_D2H : from->home == KV_HOME_HOST ? BE_H2D : BE_D2D;
        enum be_status st = be_copy(s->be, d, src, s->block_bytes, dir);
        if (st != BE_OK) {
            return kv_fail(s, TIER_EIO, "copying KV blocks between tiers: %s", be_strerror(st));
        }
    }
    return TIER_OK;
}

int64_t layer_view_lo(const kv_seq *q, const struct kv_layer *L)
{
    if (!L->window || !q->pending)
        return L->lo;
    int64_t from = q->len - (L->window - 1);
    return from > L->lo ? from : L->lo;
}

/* Blocks an extent must span for [floor(lo/bt), ceil(end/bt)) (invariant 3). */
static int ext_need(const kv_store *s, const struct kv_layer *L, int64_t end)
{
    return (int)((end + s->bt - 1) / s->bt - L->lo / s->bt);
}

void ext_view_refresh(const kv_seq *q, struct kv_layer *L)
{
    const kv_store *s = q->s;
    if (L->home == KV_HOME_PAGED)
        return;
    int64_t b0 = L->lo / s->bt;
    L->base = b0 * s->bt;
    L->n_blocks = L->ext.data ? ext_need(s, L, q->len + q->pending) : 0;
    for (int i = 0; i < L->n_blocks; i++)
        L->blocks[i] = kv_layer_block(s, L, b0 + i);
}

/* Frees whatever storage L holds (pool blocks, extent, table). */
static void layer_storage_release(kv_store *s, struct kv_layer *L)
{
    if (L->home == KV_HOME_PAGED) {
        while (L->n_blocks > 0)
            blk_put(s, L->pb[--L->n_blocks]);
        if (L->sink_blk)
            blk_put(s, L->sink_blk);
        L->sink_blk = NULL;
    } else {
        ext_release(s, L->home, &L->ext);
    }
    free(L->blocks);
    free(L->pb);
    L->blocks = NULL;
    L->pb = NULL;
    L->ext = (struct kv_ext){0};
    L->n_blocks = L->cap = L->ext_blocks = 0;
}

/* Builds in *n a copy of layer L whose storage is a new extent of nb
 * blocks in home, holding L's live blocks.  L is not touched. */
static enum tier_status ext_build(kv_seq *q, const struct kv_layer *L, enum kv_home home, int nb,
                                  struct kv_layer *n)
{
    kv_store *s = q->s;
    *n = *L;
    n->home = home;
    n->ext = (struct kv_ext){0};
    n->pb = NULL;
    n->ext_blocks = n->cap = nb;
    n->blocks = NULL;
    /* the budgets first: a size they refuse never reaches malloc (an image's
     * max_cache_len, kv_seq_load) */
    enum tier_status st = ext_alloc(s, home, nb, &n->ext);
    if (st == TIER_OK && !(n->blocks = malloc((size_t)nb * sizeof(void *))))
        st = kv_fail(s, TIER_ENOMEM_HOST, "host memory: a KV block table of %d entries", nb);
    if (st == TIER_OK && L->n_blocks > 0)
        st = copy_blocks(s, n, L, L->base / s->bt, L->base / s->bt + L->n_blocks);
    if (st != TIER_OK) { /* *n holds nothing, so that freeing the layer it is in frees nothing twice */
        ext_release(s, home, &n->ext);
        free(n->blocks);
        n->ext = (struct kv_ext){0};
        n->blocks = NULL;
    }
    return st;
}

/* Puts the storage ext_build made in place of L's. */
static void layer_install(kv_seq *q, struct kv_layer *L, const struct kv_layer *n)
{
    layer_storage_release(q->s, L);
    *L = *n;
    ext_view_refresh(q, L);
}

static enum tier_status ext_resize(kv_seq *q, struct kv_layer *L, int nb)
{
    struct kv_layer n;
    enum tier_status st = ext_build(q, L, L->home, nb, &n);
    if (st == TIER_OK)
        layer_install(q, L, &n);
    return st;
}

/* Makes an extent span [lo, end).  A growable full layer doubles (fewer
 * copies) when that leaves room for every layer to grow to the exact need
 * after it; otherwise, near a budget, it takes the exact need so that the
 * first layers do not starve the last ones. */
static enum tier_status ext_reserve(kv_seq *q, struct kv_layer *L, int64_t end)
{
    kv_store *s = q->s;
    int need = ext_need(s, L, end);
    if (need <= L->ext_blocks)
        return TIER_OK;
    size_t headroom = ((size_t)2 * L->ext_blocks + (size_t)s->g.n_layers * need) * s->block_bytes;
    bool room = L->home == KV_HOME_HOST ? !s->host_budget || s->host_used + headroom <= s->host_budget
                                        : headroom <= dev_available(s);
    if (!L->window && 2 * L->ext_blocks > need && room && ext_resize(q, L, 2 * L->ext_blocks) == TIER_OK)
        return TIER_OK;
    return ext_resize(q, L, need);
}

/* ---- sequences ------------------------------------------------------------ */

kv_store *kv_seq_store(const kv_seq *q)
{
    return q->s;
}

int64_t kv_seq_length(const kv_seq *q)
{
    return q->len;
}

/* Does layer l stream from the host tier under strategy st (before the
 * adaptive choice)? */
static bool layer_streamable(const kv_seq *q, enum kv_strategy st, int l)
{
    if (!is_offloaded(st))
        return false;
    if (!q->layers[l].window)
        return true;
    enum kv_offload_sliding o = q->p.offload_sliding;
    if (o == KV_OFFLOAD_SLIDING_DEFAULT)
        o = st == KV_OFFLOADED ? KV_OFFLOAD_SLIDING_YES : KV_OFFLOAD_SLIDING_NO;
    return o == KV_OFFLOAD_SLIDING_YES;
}

/* Blocks a layer holds at most for n tokens in one-token steps. */
static int layer_blocks_for(const kv_store *s, int keep, int64_t n)
{
    int64_t span = keep && keep < n ? keep + 1 : n;
    return (int)((span + s->bt - 1) / s->bt) + (keep ? 1 : 0);
}

/* The adaptive choice: how many streamable layers (from the front) stay on
 * the device so that they, the non-streamed layers and the two slots fit. */
static int adaptive_resident(const kv_seq *q, enum kv_strategy st)
{
    const kv_store *s = q->s;
    size_t fixed = 0, biggest = 0;
    int n_stream = 0;
    for (int l = 0; l < s->g.n_layers; l++) {
        size_t b = (size_t)layer_blocks_for(s, q->layers[l].keep, q->p.max_cache_len) * s->block_bytes;
        if (!layer_streamable(q, st, l))
            fixed += b;
        else if (b > biggest)
            biggest = b;
        n_stream += layer_streamable(q, st, l);
    }
    size_t avail = dev_available(s);
    for (int r = n_stream; r > 0; r--) {
        size_t need = fixed + (size_t)r * biggest + (r < n_stream ? 2 * biggest : 0);
        if (need <= avail)
            return r;
    }
    return 0;
}

/* Chooses every layer's home for strategy st; all_host streams every layer
 * (the fallback after a device allocation failed at creation). */
static void plan_homes(kv_seq *q, enum kv_strategy st, bool all_host)
{
    kv_store *s = q->s;
    int resident = q->p.adaptive && !all_host ? adaptive_resident(q, st) : 0;
    for (int l = 0; l < s->g.n_layers; l++) {
        struct kv_layer *L = &q->layers[l];
        if (st == KV_DYNAMIC || st == KV_QUANTIZED) /* quantized: no blocks of its own (kvquant.c) */
            L->home = KV_HOME_PAGED;
        else if (all_host || (layer_streamable(q, st, l) && resident-- <= 0))
            L->home = KV_HOME_HOST;
        else
            L->home = KV_HOME_DEV;
        L->ext_fixed = is_static(st) && !L->window;
    }
    q->strategy = all_host ? offloaded_of(st) : st;
}

static void layers_release(kv_seq *q)
{
    for (int l = 0; l < q->s->g.n_layers; l++)
        layer_storage_release(q->s, &q->layers[l]);
}

/* Preallocates the extents of a static strategy and of adaptive resident
 * layers for max_cache_len tokens in one-token steps, so that decode never
 * allocates. */
static enum tier_status layers_prealloc(kv_seq *q)
{
    kv_store *s = q->s;
    for (int l = 0; l < s->g.n_layers; l++) {
        struct kv_layer *L = &q->layers[l];
        if (L->home == KV_HOME_PAGED || !(is_static(q->strategy) || (q->p.adaptive && L->home == KV_HOME_DEV)))
            continue;
        enum tier_status st = ext_resize(q, L, layer_blocks_for(s, L->keep, q->p.max_cache_len));
        if (st != TIER_OK)
            return st;
    }
    return TIER_OK;
}

/* Layer l's window for a sequence created with p: the model's, narrowed to
 * p->window_length (0 = full attention). */
static int layer_window(const kv_store *s, const struct kv_seq_params *p, int l)
{
    int w = s->layer_window[l];
    if (p->sink) /* window_length is the sink cache's size, not a sliding window */
        return w;
    return p->window_length && (!w || p->window_length < w) ? p->window_length : w;
}

void kv_layer_shape(const kv_store *s, const struct kv_seq_params *p, int l, int *window, int *keep)
{
    int w = layer_window(s, p, l);
    int64_t k = !w ? 0 : is_static(p->strategy) ? (p->max_cache_len < w ? p->max_cache_len : w) : w - 1;
    *window = w;
    *keep = (int)k;
}

/* The sink strategy's own limits (see kv_seq_params.sink): why each
 * combination is refused is in docs/strategies.md "Sinks". */
static enum tier_status check_sink(const kv_store *s, const struct kv_seq_params *p, char *why, size_t cap)
{
    if (p->strategy != KV_DYNAMIC && p->strategy != KV_QUANTIZED)
        return why_fail(why, cap, TIER_ENOTSUP,
                        "sink + %s is not supported: attention sinks keep their bounded KV on the device, paged "
                        "(dynamic) or quantized",
                        kv_strategy_name(p->strategy));
    if (p->offload)
        return why_fail(why, cap, TIER_ENOTSUP, "sink + offloaded quantized is not supported (offload): a sink sequence "
                                                "stays on the device (its KV is bounded by window_length)");
    if (p->window_length <= 0)
        return why_fail(why, cap, TIER_EINVAL, "sink needs window_length > 0 (got %d)", p->window_length);
    if (p->num_sink_tokens < 0 || p->num_sink_tokens >= p->window_length)
        return why_fail(why, cap, TIER_EINVAL, "sink: num_sink_tokens %d must be in [0, window_length %d)",
                        p->num_sink_tokens, p->window_length);
    if (p->num_sink_tokens > s->bt)
        return why_fail(why, cap, TIER_EINVAL, "sink: num_sink_tokens %d exceeds the KV block of %d tokens",
                        p->num_sink_tokens, s->bt);
    for (int l = 0; l < s->g.n_layers; l++)
        if (s->layer_window[l])
            return why_fail(why, cap, TIER_ENOTSUP,
                            "sink + sliding layers is not supported: layer %d of the model slides by %d tokens", l,
                            s->layer_window[l]);
    return TIER_OK;
}

/* A quantized sink sequence's sink blocks, one per layer, taken at
 * creation so that the commit that fills them cannot fail. */
static enum tier_status sink_blocks_take(kv_seq *q)
{
    for (int l = 0; l < q->s->g.n_layers && q->p.num_sink_tokens; l++) {
        enum tier_status st = pool_take(q->s, &q->layers[l].sink_blk);
        if (st != TIER_OK)
            return st;
    }
    return TIER_OK;
}

enum tier_status kv_store_check_params(const kv_store *s, const struct kv_seq_params *p, char *why, size_t cap)
{
    if ((unsigned)p->strategy > KV_QUANTIZED)
        return why_fail(why, cap, TIER_EINVAL, "unknown KV strategy %d", (int)p->strategy);
    if ((unsigned)p->offload_sliding > KV_OFFLOAD_SLIDING_NO)
        return why_fail(why, cap, TIER_EINVAL, "unknown offload_sliding value %d", (int)p->offload_sliding);
    if (p->max_cache_len < 0 || p->max_cache_len > INT32_MAX)
        return why_fail(why, cap, TIER_EINVAL, "max_cache_len %lld out of range", (long long)p->max_cache_len);
    if (is_static(p->strategy) && !p->max_cache_len)
        return why_fail(why, cap, TIER_EINVAL, "%s needs max_cache_len > 0", kv_strategy_name(p->strategy));
    if (p->offload && p->strategy != KV_QUANTIZED)
        return why_fail(why, cap, TIER_EINVAL, "offload applies to the quantized strategy, not %s (%s is offloaded already)",
                        kv_strategy_name(p->strategy),
                        kv_strategy_name(offloaded_of(p->strategy)));
    if (p->adaptive && !is_offloaded(p->strategy))
        return why_fail(why, cap, TIER_EINVAL, "adaptive residency applies to offloaded strategies, not %s",
                        kv_strategy_name(p->strategy));
    if (p->window_length < 0)
        return why_fail(why, cap, TIER_EINVAL, "window_length %d must be positive (0: the model's windows)", p->window_length);
    if (p->adaptive && !p->max_cache_len)
        return why_fail(why, cap, TIER_EINVAL, "adaptive residency needs max_cache_len (the expected length) to size the device share");
    if (p->sink) {
        enum tier_status st = check_sink(s, p, why, cap);
        if (st != TIER_OK)
            return st;
    }
    if (s->g.state_bytes)
        return state_check_params(p, why, cap);
    int min_window = 0;
    for (int l = 0; l < s->g.n_layers; l++) {
        int w = layer_window(s, p, l);
        if (!w)
            return TIER_OK;
        if (!min_window || w < min_window)
            min_window = w;
    }
    /* every layer slides: HF would narrow the window to max_cache_len */
    if (is_static(p->strategy) && p->max_cache_len < min_window)
        return why_fail(why, cap, TIER_EINVAL, "max_cache_len %lld is below the sliding window %d of a model whose every layer slides",
                        (long long)p->max_cache_len, min_window);
    return TIER_OK;
}

/* A sequence with p's layers (window, keep) and no storage yet. */
static kv_seq *seq_new(kv_store *s, const struct kv_seq_params *p)
{
    kv_seq *q = calloc(1, sizeof(*q));
    if (!q)
        return NULL;
    q->layers = calloc((size_t)s->g.n_layers, sizeof(*q->layers));
    if (!q->layers) {
        free(q);
        return NULL;
    }
    q->s = s;
    q->p = *p;
    for (int l = 0; l < s->g.n_layers; l++)
        kv_layer_shape(s, p, l, &q->layers[l].window, &q->layers[l].keep);
    return q;
}

static void note_fallback(kv_seq *q, enum kv_fallback why);

enum tier_status kv_seq_create(kv_store *s, const struct kv_seq_params *p, kv_seq **out)
{
    static const struct kv_seq_params defaults;
    *out = NULL;
    s->err[0] = '\0';
    if (!p)
        p = &defaults;
    enum tier_status st = kv_store_check_params(s, p, s->err, sizeof(s->err));
    if (st != TIER_OK)
        return st;
    kv_seq *q = seq_new(s, p);
    if (!q)
        return TIER_ENOMEM_HOST;
    if (s->g.state_bytes) { /* as a KV layer: the device, else the host tier unless no_fallback */
        bool host = is_offloaded(p->strategy);
        q->strategy = p->strategy;
        st = state_seq_init(q, host);
        if (st == TIER_ENOMEM_DEV && !p->no_fallback) {
            state_seq_release(q);
            q->strategy = offloaded_of(p->strategy);
            s->err[0] = '\0';
            if ((st = state_seq_init(q, true)) == TIER_OK)
                note_fallback(q, KV_FALLBACK_SIZED);
        }
        if (st != TIER_OK) {
            kv_seq_free(q);
            return st;
        }
        *out = q;
        return TIER_OK;
    }
    /* A dynamic request that announces its length and cannot fit the
     * device starts offloaded instead of failing part-way. */
    enum kv_strategy want = p->strategy;
    bool all_host = false;
    if (want == KV_DYNAMIC && p->max_cache_len && !p->no_fallback && !p->sink) {
        size_t need = 0;
        for (int l = 0; l < s->g.n_layers; l++)
            need += (size_t)layer_blocks_for(s, q->layers[l].keep, p->max_cache_len) * s->block_bytes;
        if (need > dev_available(s)) {
            want = KV_OFFLOADED;
            all_host = true;
            q->fallback = KV_FALLBACK_SIZED;
        }
    }
    if (want == KV_QUANTIZED && (st = kvq_seq_init(q)) != TIER_OK) {
        kv_seq_free(q);
        return st;
    }
    if (want == KV_QUANTIZED && p->sink && (st = sink_blocks_take(q)) != TIER_OK) {
        kv_seq_free(q);
        return st;
    }
    plan_homes(q, want, all_host);
    st = layers_prealloc(q);
    if (st == TIER_ENOMEM_DEV && !p->no_fallback) {
        layers_release(q);
        plan_homes(q, want, true);
        q->fallback = KV_FALLBACK_SIZED;
        st = layers_prealloc(q);
    }
    if (st != TIER_OK) {
        kv_seq_free(q);
        return st;
    }
    if (q->fallback)
        s->fallbacks++;
    if (!q->kvq)
        prefix_init(q);
    if (p->sink) /* a sink sequence's blocks past the sinks hold keys at shifting positions */
        prefix_stop(q);
    *out = q;
    return TIER_OK;
}

void kv_seq_free(kv_seq *q)
{
    if (!q)
        return;
    if (q->pending)
        kv_seq_abort(q);
    kv_seq_loader_free(q->load); /* its uploads land before the blocks go */
    layers_release(q);
    kvq_seq_release(q);
    state_seq_release(q);
    free(q->layers);
    free(q->ids);
    free(q);
}

size_t kv_seq_bytes(const kv_seq *q)
{
    struct kv_seq_stats st = kv_seq_stats(q);
    return st.dev_bytes + st.host_bytes;
}

struct kv_seq_stats kv_seq_stats(const kv_seq *q)
{
    struct kv_seq_stats st = {.requested = q->p.strategy, .strategy = q->strategy, .fallback = q->fallback,
                              .xfer = q->xfer, .copied_bytes = q->copied_bytes};
    if (q->state) {
        *(state_on_host(q) ? &st.streamed_layers : &st.resident_layers) = q->s->g.n_layers;
        state_seq_bytes(q, &st.dev_bytes, &st.host_bytes);
        return st;
    }
    if (kvq_seq_on_host(q)) {
        st.streamed_layers = q->s->g.n_layers;
        st.host_bytes = kvq_seq_bytes(q);
        return st;
    }
    for (int l = 0; l < q->s->g.n_layers; l++) {
        const struct kv_layer *L = &q->layers[l];
        if (L->home == KV_HOME_HOST) {
            st.streamed_layers++;
            st.host_bytes += L->ext.size;
        } else {
            st.resident_layers++;
            st.dev_bytes += L->home == KV_HOME_PAGED ? (size_t)(L->n_blocks + !!L->sink_blk) * q->s->block_bytes
                                                     : L->ext.size;
        }
    }
    if (q->kvq)
        st.dev_bytes += kvq_seq_bytes(q);
    return st;
}

static void note_fallback(kv_seq *q, enum kv_fallback why)
{
    if (why == KV_FALLBACK_NONE)
        return;
    if (q->fallback == KV_FALLBACK_NONE) {
        q->s->fallbacks++;
        q->s->fallbacks_oom += why == KV_FALLBACK_OOM;
    }
    q->fallback = why;
}

enum tier_status kv_seq_offload(kv_seq *q, enum kv_fallback why)
{
    kv_store *s = q->s;
    if (q->pending)
        return kv_fail(s, TIER_EINVAL, "kv_seq_offload during a step");
    enum tier_status lst = kv_seq_load_finish(q); /* the migration copies every layer */
    if (lst != TIER_OK)
        return lst;
    if (why == KV_FALLBACK_OOM && q->p.no_fallback) { /* the message still names what ran out */
        char was[KV_ERR_LEN];
        snprintf(was, sizeof(was), "%s", s->err);
        return kv_fail(s, TIER_ENOTSUP, "%s%sthe sequence asked for no fallback to the host tier", was,
                       was[0] ? "; " : "");
    }
    if (q->p.sink)
        return kv_fail(s, TIER_ENOTSUP, "sink + offloaded is not supported: a sink sequence stays on the device "
                                        "(its KV is bounded by window_length)");
    if (q->kvq || q->state) {
        enum tier_status st = q->kvq ? kvq_seq_offload(q) : state_seq_offload(q);
        if (st == TIER_OK && q->state && !is_offloaded(q->strategy))
            q->strategy = offloaded_of(q->strategy);
        if (st == TIER_OK)
            note_fallback(q, why);
        return st;
    }
    int n = s->g.n_layers;
    struct kv_layer *moved = calloc((size_t)n, sizeof(*moved));
    if (!moved)
        return TIER_ENOMEM_HOST;
    /* Every host extent exists and holds its copy before the sequence
     * changes (invariant 4). */
    enum tier_status st = TIER_OK;
    int built = 0;
    for (; built < n && st == TIER_OK; built++) {
        const struct kv_layer *L = &q->layers[built];
        if (L->home == KV_HOME_HOST)
            continue;
        int nb = L->ext_fixed ? L->ext_blocks : layer_blocks_for(s, L->keep, q->len + 1);
        int need = ext_need(s, L, q->len + 1);
        st = ext_build(q, L, KV_HOME_HOST, nb > need ? nb : need, &moved[built]);
    }
    for (int l = 0; l < n; l++) {
        if (q->layers[l].home == KV_HOME_HOST || (st != TIER_OK && l >= built - 1))
            continue;
        if (st == TIER_OK)
            layer_install(q, &q->layers[l], &moved[l]);
        else
            layer_storage_release(s, &moved[l]);
    }
    free(moved);
    if (st != TIER_OK)
        return st;
    kv_store_trim(s);
    prefix_stop(q);
    q->strategy = offloaded_of(q->strategy);
    note_fallback(q, why);
    return TIER_OK;
}

/* ---- the step transaction ------------------------------------------------- */

/* Blocks a paged layer needs to cover [base, end). */
static int paged_blocks_for(const kv_store *s, const struct kv_layer *L, int64_t end)
{
    return (int)((end - L->base + s->bt - 1) / s->bt);
}

static void paged_set(struct kv_layer *L, int i, struct kv_block *b)
{
    L->pb[i] = b;
    L->blocks[i] = b->data;
}

/* Makes a paged layer's tables hold at least need entries. */
static enum tier_status paged_table(struct kv_layer *L, int need)
{
    if (need <= L->cap)
        return TIER_OK;
    int cap = L->cap ? L->cap : 4;
    while (cap < need)
        cap *= 2;
    void **b = realloc(L->blocks, (size_t)cap * sizeof(*b));
    if (!b)
        return TIER_ENOMEM_HOST;
    L->blocks = b;
    struct kv_block **pb = realloc(L->pb, (size_t)cap * sizeof(*pb));
    if (!pb)
        return TIER_ENOMEM_HOST;
    L->pb = pb;
    L->cap = cap;
    return TIER_OK;
}

/* Copy on write: the block holding position len, which the step writes
 * into, becomes private if another table shares it or the prefix cache
 * holds it (a published block never changes).  The copy has the same
 * contents, so an abort needs no undo (invariant 4). */
static enum tier_status paged_own_tail(kv_seq *q, struct kv_layer *L, int64_t len)
{
    kv_store *s = q->s;
    if (len % s->bt == 0 || len < L->base)
        return TIER_OK;
    int i = (int)((len - L->base) / s->bt);
    struct kv_block *old = L->pb[i], *b;
    if (old->ref == 1 && !old->pub)
        return TIER_OK;
    enum tier_status st = pool_take(s, &b);
    if (st != TIER_OK)
        return st;
    enum be_status bs = be_copy(s->be, b->data, old->data, s->block_bytes, BE_D2D);
    if (bs != BE_OK) {
        blk_put(s, b);
        return kv_fail(s, TIER_EIO, "copying a shared KV block before writing into it: %s", be_strerror(bs));
    }
    paged_set(L, i, b);
    blk_put(s, old);
    q->copied_bytes += s->block_bytes;
    return TIER_OK;
}

static enum tier_status paged_reserve(kv_seq *q, struct kv_layer *L, int64_t len, int64_t end)
{
    kv_store *s = q->s;
    enum tier_status st = paged_table(L, paged_blocks_for(s, L, end));
    if (st == TIER_OK)
        st = paged_own_tail(q, L, len);
    while (st == TIER_OK && L->n_blocks < paged_blocks_for(s, L, end)) {
        struct kv_block *b;
        st = pool_take(s, &b);
        if (st == TIER_OK)
            paged_set(L, L->n_blocks++, b);
    }
    return st;
}

/* Releases a paged layer's blocks outside [lo, end): those before the
 * block holding lo and those after the one holding end - 1. */
static void paged_trim(kv_store *s, struct kv_layer *L, int64_t end)
{
    int keep = paged_blocks_for(s, L, end);
    while (L->n_blocks > keep)
        blk_put(s, L->pb[--L->n_blocks]);
    int drop = (int)((L->lo - L->base) / s->bt); /* invariant 2 */
    if (drop <= 0)
        return;
    for (int b = 0; b < drop; b++)
        blk_put(s, L->pb[b]);
    memmove(L->blocks, L->blocks + drop, (size_t)(L->n_blocks - drop) * sizeof(*L->blocks));
    memmove(L->pb, L->pb + drop, (size_t)(L->n_blocks - drop) * sizeof(*L->pb));
    L->n_blocks -= drop;
    L->base += (int64_t)drop * s->bt;
}

static bool has_full_layer(const kv_seq *q)
{
    for (int l = 0; l < q->s->g.n_layers; l++)
        if (!q->layers[l].window)
            return true;
    return false;
}

static enum tier_status active_add(kv_store *s, kv_seq *q)
{
    if (s->n_active == s->cap_active) {
        int cap = s->cap_active ? 2 * s->cap_active : 8;
        kv_seq **a = realloc(s->active, (size_t)cap * sizeof(*a));
        if (!a)
            return TIER_ENOMEM_HOST;
        s->active = a;
        s->cap_active = cap;
    }
    s->active[s->n_active++] = q;
    return TIER_OK;
}

static void active_remove(kv_store *s, kv_seq *q)
{
    for (int i = 0; i < s->n_active; i++) {
        if (s->active[i] == q) {
            s->active[i] = s->active[--s->n_active];
            return;
        }
    }
}

/* kv_seq_reserve(q, 0): q joins the step's batch as it is, so that
 * stream.c plans its host-tier layers into the slots with the others';
 * its chunk is empty, so nothing of it is written back, and its commit
 * changes nothing but the views. */
static enum tier_status reserve_read(kv_seq *q)
{
    kv_store *s = q->s;
    for (int i = 0; i < s->n_active; i++)
        if (s->active[i] == q)
            return kv_fail(s, TIER_EINVAL, "kv_seq_reserve of 0 tokens: the sequence is in the step already");
    if (q->kvq || q->state)
        return kv_fail(s, TIER_ENOTSUP, "kv_seq_reserve of 0 tokens: only a dense sequence is read without "
                                        "writing");
    q->chunk_from = q->chunk_to = q->len;
    return active_add(s, q);
}

void kv_seq_update_continues(kv_seq *q)
{
    q->more = true;
}

enum tier_status kv_seq_reserve(kv_seq *q, int n_new)
{
    kv_store *s = q->s;
    bool more = q->more;
    q->more = false;
    s->err[0] = '\0';
    if (n_new < 0 || q->pending)
        return kv_fail(s, TIER_EINVAL, "kv_seq_reserve of %d tokens%s", n_new, q->pending ? " inside a step" : "");
    if (n_new == 0)
        return reserve_read(q);
    int64_t end = q->len + n_new;
    if (end > KV_SEQ_MAX_LEN)
        return kv_fail(s, TIER_EINVAL, "kv_seq_reserve: %lld + %d tokens is over the %lld a sequence may see",
                       (long long)q->len, n_new, (long long)KV_SEQ_MAX_LEN);
    if (is_static(q->strategy) && end > q->p.max_cache_len && has_full_layer(q))
        return kv_fail(s, TIER_EFULL, "static cache is full: max_cache_len %lld, %lld cached + %d new tokens",
                       (long long)q->p.max_cache_len, (long long)q->len, n_new);
    enum tier_status st = active_add(s, q);
    if (st != TIER_OK)
        return st;
    /* pending is set first so that abort releases whatever paged blocks
     * were taken when a later layer fails (invariant 2) */
    q->pending = n_new;
    if (q->state) {
        if ((st = state_seq_reserve(q)) != TIER_OK) {
            kv_seq_abort(q);
            return st;
        }
        q->chunk_from = q->len;
        q->chunk_to = end;
        return TIER_OK;
    }
    if (q->kvq)
        st = kvq_seq_reserve(q, n_new, more);
    for (int l = 0; l < s->g.n_layers && st == TIER_OK && !q->kvq; l++) {
        struct kv_layer *L = &q->layers[l];
        st = L->home == KV_HOME_PAGED ? paged_reserve(q, L, q->len, end) : ext_reserve(q, L, end);
    }
    if (st != TIER_OK) {
        kv_seq_abort(q);
        return st;
    }
    for (int l = 0; l < s->g.n_layers; l++)
        ext_view_refresh(q, &q->layers[l]);
    prefix_reserve(q, end);
    q->chunk_from = q->len;
    q->chunk_to = end;
    return TIER_OK;
}

/* Sink strategy: the oldest non-sink position the step reads, which sits
 * at index S of the cache (HF SinkCache: a step of n tokens keeps the last
 * W-S-n cached ones; all of them while the cache grows, S+n <= W; and a
 * first input is attended whole).  Between steps: the oldest one kept. */
static int64_t sink_recent(const kv_seq *q)
{
    int64_t S = q->p.num_sink_tokens;
    int64_t r = q->len + q->pending - q->p.window_length + S;
    if (r > q->len)
        r = q->len;
    return r > S ? r : S;
}

void kv_seq_view(const kv_seq *q, int layer, struct be_kv_view *out)
{
    const struct kv_layer *L = &q->layers[layer];
    if (q->kvq) { /* the full-precision rest, where the step writes */
        struct be_kvq_view qv;
        kv_seq_qview(q, layer, &qv);
        *out = qv.rest;
        return;
    }
    *out = (struct be_kv_view){
        .blocks = L->blocks,
        .n_blocks = L->n_blocks,
        .block_tokens = q->s->bt,
        .v_offset = q->s->block_bytes / 2,
        .base = L->base,
        .lo = layer_view_lo(q, L),
        .hi = q->len + q->pending,
        .window = L->window,
    };
    if (q->p.sink)
        sink_view(q, L, out);
}

void sink_view(const kv_seq *q, const struct kv_layer *L, struct be_kv_view *out)
{
    int64_t S = q->p.num_sink_tokens;
    /* keys unrotated; sinks at their own index, the rest moved down to
     * follow them (nothing moves until the first eviction) */
    out->key_rope = true;
    out->shift = sink_recent(q) - S;
    if (out->shift > 0)
        out->sinks = (int)S;
    else if (q->kvq) /* from the first commit on, never read quantized (invariant 8) */
        out->sinks = (int)(q->len < S ? q->len : S);
    if (out->sinks)
        out->sink_block = L->sink_blk ? L->sink_blk->data : L->blocks[0]; /* invariant 8 */
    /* the window starts after the sinks, without sinks too (S = 0) */
    if (out->lo < out->shift + out->sinks)
        out->lo = out->shift + out->sinks;
}

void kv_seq_rope_pos(const kv_seq *q, int64_t pos, int64_t *q_pos, int64_t *k_pos)
{
    if (!q->p.sink) {
        *q_pos = *k_pos = pos;
        return;
    }
    *q_pos = pos - (sink_recent(q) - q->p.num_sink_tokens);
    *k_pos = 0;
}

/* Copies the sinks among positions [from, len) of layer l from the
 * quantized sequence's residual, where the step wrote them, into the sink
 * block before the KIVI commit may quantize them (invariant 8). */
static enum tier_status sink_keep_full(kv_seq *q, int l, int64_t from)
{
    kv_store *s = q->s;
    int64_t S = q->p.num_sink_tokens, end = q->len < S ? q->len : S;
    struct be_kvq_view v;
    kv_seq_qview(q, l, &v);
    void *sink = q->layers[l].sink_blk->data;
    struct be_kv_view dst = {.blocks = &sink, .n_blocks = 1, .block_tokens = s->bt, .v_offset = s->block_bytes / 2};
    struct be_attn_params p = {.n_heads = s->g.n_kv_heads, .n_kv_heads = s->g.n_kv_heads, .head_dim = s->g.head_dim,
                               .kv_dtype = s->g.dtype};
    enum be_status st = from < end ? be_kv_copy(s->be, &dst, &v.rest, from, end, &p) : BE_OK;
    return st == BE_OK ? TIER_OK : kv_fail(s, TIER_EIO, "keeping the sinks: %s", be_strerror(st));
}

/* Sink strategy at commit: keep the sinks and the last W-S tokens (what
 * HF's cache holds after a step); the block of the sinks is kept by a
 * reference of its own before the table lets go of it (invariant 8).
 * from: the length before the step. */
static enum tier_status sink_commit(kv_seq *q, int l, int64_t from)
{
    struct kv_layer *L = &q->layers[l];
    int64_t W = q->p.window_length, S = q->p.num_sink_tokens;
    if (q->len > W)
        L->lo = q->len - (W - S);
    if (q->kvq && from < S) {
        enum tier_status st = sink_keep_full(q, l, from);
        if (st != TIER_OK)
            return st;
    }
    if (S && !L->sink_blk && L->base == 0 && L->lo >= q->s->bt) {
        L->sink_blk = L->pb[0];
        blk_get(q->s, L->sink_blk);
    }
    return TIER_OK;
}

enum tier_status kv_seq_commit(kv_seq *q)
{
    kv_store *s = q->s;
    enum tier_status st = TIER_OK;
    int64_t from = q->len;
    if (!q->pending && !q->kvq && !q->state) { /* read only (reserve_read): nothing to publish */
        kv_seq_abort(q);
        return TIER_OK;
    }
    q->len += q->pending;
    q->pending = 0;
    active_remove(s, q);
    if (q->state)
        return state_seq_commit(q);
    for (int l = 0; l < s->g.n_layers; l++) {
        struct kv_layer *L = &q->layers[l];
        /* The next query sits at position len and sees keys k with
         * len - k < w; `keep` says how many of those are stored (all of
         * them while recording: the next crop shrinks them). */
        if (L->keep && !q->record_past && q->len - L->keep > L->lo)
            L->lo = q->len - L->keep;
        if (q->p.sink && st == TIER_OK)
            st = sink_commit(q, l, from);
        if (L->home != KV_HOME_PAGED)
            ext_view_refresh(q, L);
        else if (!q->kvq)
            paged_trim(s, L, q->len);
    }
    if (q->kvq && st == TIER_OK)
        st = kvq_seq_commit(q);
    prefix_publish(q);
    return st;
}

void kv_seq_abort(kv_seq *q)
{
    kv_store *s = q->s;
    q->pending = 0;
    active_remove(s, q);
    if (q->state) {
        state_seq_abort(q);
        return;
    }
    if (q->kvq)
        kvq_seq_abort(q);
    for (int l = 0; l < s->g.n_layers; l++) {
        struct kv_layer *L = &q->layers[l];
        if (L->home != KV_HOME_PAGED)
            ext_view_refresh(q, L);
        else if (!q->kvq)
            paged_trim(s, L, q->len);
    }
}

/* ---- cache surgery -------------------------------------------------------- */

bool kv_store_past_recording_ok(const kv_store *s, const struct kv_seq_params *p, char *why, size_t cap)
{
    if (s->g.state_bytes) /* its checkpoints are its past */
        return true;
    if (p->sink) {
        snprintf(why, cap, "past recording + sink is not supported: a sink sequence drops evicted tokens at commit "
                           "(crop works until the first eviction)");
        return false;
    }
    if (p->strategy == KV_QUANTIZED) {
        snprintf(why, cap, "past recording of a quantized cache is not supported yet");
        return false;
    }
    for (int l = 0; l < s->g.n_layers && is_static(p->strategy); l++) {
        int window, keep;
        kv_layer_shape(s, p, l, &window, &keep);
        if (window) {
            snprintf(why, cap, "past recording needs a dynamic strategy: the sliding layers of %s keep a fixed %d "
                               "states", kv_strategy_name(p->strategy), keep);
            return false;
        }
    }
    return true;
}

enum tier_status kv_seq_activate_past_recording(kv_seq *q)
{
    kv_store *s = q->s;
    s->err[0] = '\0';
    if (q->pending)
        return kv_fail(s, TIER_EINVAL, "activate_past_recording during a step");
    char why[160];
    if (!kv_store_past_recording_ok(s, &q->p, why, sizeof(why)))
        return kv_fail(s, TIER_ENOTSUP, "%s", why);
    if (q->kvq)
        return kvq_unsupported(q, "past recording");
    if (!q->state)
        q->record_past = true;
    return TIER_OK;
}

/* kv_seq_crop; trim: the crop ends what past recording kept so far (HF's
 * crop), else it keeps it (the rewind of a session's reuse, which the
 * client did not ask for and must not cost it the states it records). */
static enum tier_status crop(kv_seq *q, int64_t n, bool trim)
{
    kv_store *s = q->s;
    s->err[0] = '\0';
    if (q->pending)
        return kv_fail(s, TIER_EINVAL, "kv_seq_crop during a step");
    enum tier_status lst = kv_seq_load_finish(q); /* the rules below read what the layers hold */
    if (lst != TIER_OK)
        return lst;
    /* bounded first: -n and len - n below must not overflow */
    if (n < -KV_SEQ_MAX_LEN || n > KV_SEQ_MAX_LEN)
        return kv_fail(s, TIER_EINVAL, "crop(%lld): n must be between %lld and %lld", (long long)n,
                       (long long)-KV_SEQ_MAX_LEN, (long long)KV_SEQ_MAX_LEN);
    if (q->kvq)
        return kvq_unsupported(q, "crop");
    if (q->state) /* back to the nearest checkpoint; the caller feeds the rest */
        return n > 0 && n >= q->len ? TIER_OK : state_seq_rewind(q, n > 0 ? n : (-n < q->len ? q->len + n : 0));
    /* every refusal comes before the first change (invariant 4) */
    for (int l = 0; l < s->g.n_layers; l++) {
        const struct kv_layer *L = &q->layers[l];
        if (!L->window || q->len < L->window)
            continue;
        if (!q->record_past)
            return kv_fail(s, TIER_ECONFLICT,
                           "`crop` was called, but the current layer does not track past states, and the sliding "
                           "window size was already reached. Call `activate_past_recording` before `crop` to be able "
                           "to rollback the cache. (layer %d, window %d, %lld tokens seen)",
                           l, L->window, (long long)q->len);
        if (n > 0)
            return kv_fail(s, TIER_EINVAL,
                           "Once the sliding window size has been reached, `DynamicSlidingWindowLayer` can only be "
                           "cropped by passing a negative int, to specify how many tokens to remove (layer %d, "
                           "window %d, crop(%lld))",
                           l, L->window, (long long)n);
    }
    if (n > 0 && n >= q->len)
        return TIER_OK;
    int64_t remove = n > 0 ? q->len - n : -n;
    int64_t len = remove < q->len ? q->len - remove : 0;
    if (q->p.sink && q->layers[0].lo > 0 && len == q->len)
        return TIER_OK; /* nothing to free: the sink layers hold only what they read */
    if (q->p.sink && q->layers[0].lo > 0)
        return kv_fail(s, TIER_ECONFLICT,
                       "crop + sink: the sink cache already evicted tokens %d..%lld (window_length %d, %lld tokens "
                       "seen) and cannot roll back; crop works only until the first eviction",
                       q->p.num_sink_tokens, (long long)q->layers[0].lo - 1, q->p.window_length, (long long)q->len);
    for (int l = 0; l < s->g.n_layers; l++) {
        const struct kv_layer *L = &q->layers[l];
        int64_t need = L->keep && len > L->keep ? len - L->keep : 0;
        if (L->lo > need)
            return kv_fail(s, TIER_ECONFLICT,
                           "crop(%lld) needs the states of layer %d from position %lld, but it recorded only from "
                           "position %lld (recording restarts at every crop)",
                           (long long)n, l, (long long)need, (long long)L->lo);
    }
    prefix_crop(q, len);
    q->len = len;
    for (int l = 0; l < s->g.n_layers; l++) {
        struct kv_layer *L = &q->layers[l];
        if (trim && L->keep && len - L->keep > L->lo) /* crop(0) shrinks recorded states back to keep */
            L->lo = len - L->keep;
        if (L->home == KV_HOME_PAGED)
            paged_trim(s, L, len);
        else
            ext_view_refresh(q, L);
    }
    return TIER_OK;
}

enum tier_status kv_seq_crop(kv_seq *q, int64_t n)
{
    return crop(q, n, true);
}

int64_t kv_seq_common(const kv_seq *q, const int32_t *held, const int32_t *input, int64_t n_input)
{
    int64_t k = 0;
    while (k < q->len && k < n_input - 1 && held[k] == input[k])
        k++;
    return k;
}

enum tier_status kv_seq_reuse(kv_seq *q, const int32_t *held, const int32_t *input, int64_t n_input,
                              int64_t *n_keep)
{
    *n_keep = 0;
    if (n_input <= 0)
        return kv_fail(q->s, TIER_EINVAL, "kv_seq_reuse of an empty input");
    int64_t k = kv_seq_common(q, held, input, n_input);
    if (k < q->len) {
        enum tier_status st = crop(q, -(q->len - k), false);
        if (st != TIER_OK)
            return st;
    }
    *n_keep = q->state ? q->len : k; /* a state goes back to a checkpoint */
    return TIER_OK;
}

static bool fork_shares(const kv_seq *q)
{
    if (q->kvq || q->state)
        return false;
    for (int l = 0; l < q->s->g.n_layers; l++)
        if (q->layers[l].home != KV_HOME_PAGED)
            return false;
    return true;
}

bool kv_seq_fork_fits(const kv_seq *q, int64_t keep, int64_t n_more)
{
    if (!fork_shares(q) || keep < 0 || keep > q->len || n_more < 0 || n_more > INT64_MAX / 2)
        return false;
    const kv_store *s = q->s;
    int64_t room = (int64_t)(dev_available(s) / s->block_bytes), need = 0;
    for (int l = 0; l < s->g.n_layers && need <= room; l++) {
        /* the fork's own blocks: the partly filled one it copies and those
         * it fills, at most what a sliding layer's window spans
         * (layer_blocks_for) */
        int64_t own = (keep % s->bt + n_more + s->bt - 1) / s->bt, win = q->layers[l].keep;
        int64_t span = win ? (win + s->bt) / s->bt + 1 : own;
        need += own < span ? own : span;
    }
    return need <= room;
}

/* Gives the fork c q's layers: paged ones share q's blocks, extents are
 * copied (into the host tier when all_host; a ring has no blocks to
 * share).  On failure c's layers hold what was built, for the caller to
 * release. */
static enum tier_status fork_layers(const kv_seq *q, kv_seq *c, bool all_host)
{
    kv_store *s = q->s;
    enum tier_status st = TIER_OK;
    for (int l = 0; l < s->g.n_layers && st == TIER_OK; l++) {
        const struct kv_layer *L = &q->layers[l];
        struct kv_layer *C = &c->layers[l];
        if (L->home != KV_HOME_PAGED) {
            st = ext_build(c, L, all_host ? KV_HOME_HOST : L->home, L->ext_blocks, C);
            if (st == TIER_OK) {
                ext_view_refresh(c, C);
                c->copied_bytes += (uint64_t)L->n_blocks * s->block_bytes;
            }
            continue;
        }
        /* the table a re-forked sequence kept (kv_seq_refork), else none */
        void **blocks = C->blocks;
        struct kv_block **pb = C->pb;
        int cap = C->cap;
        *C = (struct kv_layer){.home = KV_HOME_PAGED, .window = L->window, .keep = L->keep, .base = L->base,
                               .lo = L->lo, .sink_blk = L->sink_blk, .blocks = blocks, .pb = pb, .cap = cap};
        if (C->sink_blk)
            blk_get(s, C->sink_blk);
        st = paged_table(C, L->n_blocks);
        for (int b = 0; b < L->n_blocks && st == TIER_OK; b++) {
            blk_get(s, L->pb[b]);
            paged_set(C, C->n_blocks++, L->pb[b]);
        }
    }
    return st;
}

/* c (zeroed but for a re-forked sequence's layer array, block tables and
 * ids) becomes a fork of q: the paged layers share q's blocks, extents are
 * copied.  On failure c holds what was built, for kv_seq_free. */
static enum tier_status fork_into(kv_seq *q, kv_seq *c)
{
    kv_store *s = q->s;
    c->s = s;
    c->p = q->p;
    c->strategy = q->strategy;
    c->fallback = q->fallback;
    c->len = q->len;
    c->record_past = q->record_past;
    enum tier_status st = fork_layers(q, c, false);
    /* A fork is a new sequence: where the device cannot hold a copy of the
     * extents it starts in the host tier, as kv_seq_create does. */
    if (st == TIER_ENOMEM_DEV && !c->p.no_fallback) {
        layers_release(c);
        c->copied_bytes = 0;
        s->err[0] = '\0';
        if ((st = fork_layers(q, c, true)) == TIER_OK) {
            c->strategy = offloaded_of(c->strategy);
            note_fallback(c, KV_FALLBACK_SIZED);
        }
    }
    if (st == TIER_OK)
        st = prefix_fork(q, c);
    return st == TIER_ENOMEM_HOST && !s->err[0] ? kv_fail(s, st, "host memory: forking a sequence") : st;
}

enum tier_status kv_seq_fork(kv_seq *q, kv_seq **out)
{
    kv_store *s = q->s;
    s->err[0] = '\0';
    *out = NULL;
    if (q->pending)
        return kv_fail(s, TIER_EINVAL, "kv_seq_fork during a step");
    enum tier_status lst = kv_seq_load_finish(q); /* the child shares the blocks as they are */
    if (lst != TIER_OK)
        return lst;
    if (q->kvq)
        return kvq_unsupported(q, "fork");
    if (q->state) {
        kv_seq *c = seq_new(s, &q->p);
        if (!c)
            return kv_fail(s, TIER_ENOMEM_HOST, "host memory: forking a sequence");
        c->strategy = q->strategy;
        c->fallback = q->fallback; /* as the KV branch's child reports its parent's */
        c->len = q->len;
        enum tier_status st = state_seq_fork(q, c);
        if (st == TIER_OK && state_on_host(c) && !is_offloaded(c->strategy)) { /* fell back as kv_seq_create does */
            c->strategy = offloaded_of(c->strategy);
            note_fallback(c, KV_FALLBACK_SIZED);
        }
        if (st != TIER_OK) {
            kv_seq_free(c);
            return st;
        }
        *out = c;
        return TIER_OK;
    }
    kv_seq *c = calloc(1, sizeof(*c));
    if (!c)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: forking a sequence");
    c->layers = calloc((size_t)s->g.n_layers, sizeof(*c->layers));
    if (!c->layers) {
        free(c);
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: forking a sequence");
    }
    enum tier_status st = fork_into(q, c);
    if (st != TIER_OK) {
        kv_seq_free(c);
        return st;
    }
    *out = c;
    return TIER_OK;
}

/* Whether kv_seq_refork can rebuild c as a fork of q in place: both KV
 * sequences of one store, every layer paged (an extent's copy is a new
 * allocation anyway), neither inside a step nor still loading. */
static bool refork_in_place(const kv_seq *q, const kv_seq *c)
{
    if (c->s != q->s || q->pending || c->pending || q->load || c->load || q->kvq || c->kvq || q->state || c->state)
        return false;
    for (int l = 0; l < q->s->g.n_layers; l++)
        if (q->layers[l].home != KV_HOME_PAGED || c->layers[l].home != KV_HOME_PAGED)
            return false;
    return true;
}

enum tier_status kv_seq_refork(kv_seq *q, kv_seq **c)
{
    kv_seq *r = *c;
    if (r == q)
        return kv_fail(q->s, TIER_EINVAL, "kv_seq_refork of a sequence into itself");
    if (!r || !refork_in_place(q, r)) {
        kv_seq_free(r);
        *c = NULL;
        return kv_seq_fork(q, c);
    }
    kv_store *s = q->s;
    s->err[0] = '\0';
    /* r's blocks go back; its layer array, block tables and ids stay */
    struct kv_layer *layers = r->layers;
    for (int l = 0; l < s->g.n_layers; l++) {
        struct kv_layer *L = &layers[l];
        while (L->n_blocks > 0)
            blk_put(s, L->pb[--L->n_blocks]);
        if (L->sink_blk)
            blk_put(s, L->sink_blk);
        *L = (struct kv_layer){.home = KV_HOME_PAGED, .blocks = L->blocks, .pb = L->pb, .cap = L->cap};
    }
    *r = (struct kv_seq){.layers = layers, .ids = r->ids, .ids_cap = r->ids_cap};
    enum tier_status st = fork_into(q, r);
    if (st != TIER_OK) {
        kv_seq_free(r);
        *c = NULL;
    }
    return st;
}

/* ---- images: the storage of a restored sequence ---------------------------- */

/* Storage for layer L of a restored sequence covering [lo, len), as
 * kv_seq_create and kv_seq_offload size it: a static or adaptive resident
 * extent for max_cache_len, a growable one for the next token. */
static enum tier_status layer_restore(kv_seq *q, struct kv_layer *L)
{
    kv_store *s = q->s;
    if (L->home == KV_HOME_PAGED) {
        if (q->kvq) /* the quantized layers hold the blocks (kvquant.c) */
            return TIER_OK;
        L->base = L->lo / s->bt * s->bt; /* invariant 2 */
        int n = q->len > L->base ? paged_blocks_for(s, L, q->len) : 0;
        enum tier_status st = paged_table(L, n);
        while (st == TIER_OK && L->n_blocks < n) {
            struct kv_block *b;
            st = pool_take(s, &b);
            if (st == TIER_OK)
                paged_set(L, L->n_blocks++, b);
        }
        /* invariant 8: once the table starts past block 0 the sinks have a
         * block of their own */
        if (st == TIER_OK && q->p.sink && q->p.num_sink_tokens && L->base > 0)
            st = pool_take(s, &L->sink_blk);
        return st;
    }
    bool sized = is_static(q->strategy) || (q->p.adaptive && L->home == KV_HOME_DEV);
    int nb = layer_blocks_for(s, L->keep, sized ? q->p.max_cache_len : q->len + 1);
    int need = ext_need(s, L, q->len + 1);
    return ext_resize(q, L, nb > need ? nb : need);
}

enum tier_status kv_seq_restore(kv_store *s, const struct kv_seq_state *x, bool all_host, kv_seq **out)
{
    *out = NULL;
    kv_seq *q = seq_new(s, &x->p);
    if (!q)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: a restored sequence");
    q->strategy = x->strategy;
    q->fallback = x->fallback;
    q->len = x->len;
    q->record_past = x->record_past;
    bool quant = x->p.strategy == KV_QUANTIZED;
    if (all_host && !quant)
        q->strategy = offloaded_of(q->strategy);
    enum tier_status st = TIER_OK;
    if (s->g.state_bytes)
        st = state_seq_init(q, is_offloaded(q->strategy)); /* image.c fills it */
    if (quant && (st = kvq_seq_init(q)) == TIER_OK)
        st = kvq_seq_restore(q, x->kvq_host || all_host, x->kvq);
    if (quant && x->p.sink && st == TIER_OK)
        st = sink_blocks_take(q);
    for (int l = 0; l < s->g.n_layers && st == TIER_OK && !s->g.state_bytes; l++) {
        struct kv_layer *L = &q->layers[l];
        L->home = quant ? KV_HOME_PAGED : all_host ? KV_HOME_HOST : x->home[l];
        L->lo = x->lo[l];
        L->ext_fixed = is_static(q->strategy) && !L->window;
        st = layer_restore(q, L);
    }
    if (st != TIER_OK) {
        kv_seq_free(q);
        if (all_host) /* the device attempt before may have grown the pool */
            kv_store_trim(s);
        return st == TIER_ENOMEM_HOST && !s->err[0] ? kv_fail(s, st, "host memory: a restored sequence") : st;
    }
    if (all_host) {
        kv_store_trim(s);
        note_fallback(q, KV_FALLBACK_OOM);
    }
    *out = q;
    return TIER_OK;
}
