/* prefix.c - the automatic prefix cache: full token blocks shared across
 * sequences by the content hash of their token-id chain.
 *
 * NOTES
 * A cache entry stands for one full block of bt tokens at a block boundary
 * of some sequence, identified by its chain: the parent entry (the block
 * before it, NULL for block 0) and its bt token ids.  Its hash is
 * xxh3(token ids, seed = parent's hash), so equal hashes mean equal chains
 * with overwhelming probability, and a lookup still compares the parent
 * pointer and the ids: a collision can only miss, never attach the wrong
 * KV.  The entry owns one pool block per layer holding that block's KV.
 *
 * Who takes part: sequences whose every layer is paged (dynamic strategy,
 * on the device) and full attention.  A sliding layer drops blocks as its
 * window moves, so a cached prefix could not be restored for it; static
 * and offloaded layers live in rings, not shareable blocks.
 *
 * Namespaces: an entry belongs to the namespace (kv_seq_params.prefix_ns)
 * of the sequence that published it, and only sequences of that namespace
 * find it: the daemon keeps users apart this way.
 *
 * Budget: the bytes of unreferenced entries are kept within
 * kv_store_set_prefix_mem's budget, least recently used first, as soon as
 * an entry becomes unreferenced; the device budget may evict more.
 *
 * Entry states: referenced (refs > 0: some sequence table holds one of its
 * blocks, or children > 0: a cached entry continues its chain) -> evictable
 * (both 0; on the LRU list, oldest first) -> evicted (its blocks return to
 * the free list).  A sequence attaching to it (match, dedupe, fork) makes
 * it referenced again.
 *
 * Invariants:
 *   (1) an entry is on the LRU list iff refs == 0 and children == 0, so
 *       a parent outlives its children and every cached chain is complete
 *       back to block 0.  n_unref counts the entries with refs == 0: all
 *       of them can go, leaves first.
 *   (2) e->refs is the sum of ref over e->blocks; a block with pub set is
 *       never written (kvstore.c copies it first) and never on the free
 *       list while its entry exists.
 *   (3) for a publishing sequence, blocks [0, pub_blocks) of every layer
 *       are the blocks of the chain ending at pub_tail, and ids[] holds the
 *       token ids of the positions [pub_blocks * bt, len + pending).
 *   (4) publishing never fails a commit: without memory for an entry the
 *       sequence just stops publishing.
 * All functions run on the inference thread.
 *
 * On disk (kvstore.h "the prefix cache on disk"): an evicted entry can be
 * serialized for the caller to keep, and read back later into another
 * store.  Its parent is then named by hash only, which a 64-bit hash (and
 * the test mask) could confuse, so every entry also carries a second chain
 * hash, `check` (other seeds, never masked), and an entry is inserted only
 * under a cached parent whose two hashes both match: a wrong attachment
 * then needs a 128-bit collision, where in memory the parent pointer rules
 * it out.  The ids are still compared at every match.
 *
 * FORMAT of a serialized entry (version 1; little-endian):
 *    0  8  magic "KVTPFX\r\n"
 *    8  u32 version, 12 n_layers, 16 n_kv_heads, 20 head_dim, 24 dtype,
 *           28 block_tokens (the store's geometry)
 *   32  u32 flags: 1 = has a parent; 36 u32 reserved, 0
 *   40  u64 namespace, 48 hash, 56 check, 64 parent's hash, 72 parent's
 *           check (both 0 without a parent), 80 size of the whole entry
 *   88  i32 token ids [block_tokens]
 *   then each layer's pool block as stored (block_bytes: K then V)
 */
#include "tiers/kvstore_impl.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "util/le.h"

#define PFX_MAGIC "KVTPFX\r\n"
#define PFX_VERSION 1
#define PFX_HDR 88
#define CHECK_SALT 0x9e3779b97f4a7c15u /* seeds the check chain apart from the hash chain */

/* Block 0 is seeded with the namespace, so namespaces spread over the
 * buckets; the lookup compares ns itself, as it does the ids. */
static uint64_t seeded_hash(const kv_store *s, uint64_t seed, const int32_t *tokens)
{
    return XXH3_64bits_withSeed(tokens, (size_t)s->bt * sizeof(int32_t), seed) & s->hash_mask;
}

static uint64_t chain_hash(const kv_store *s, const struct kv_pentry *parent, const int32_t *tokens, uint64_t ns)
{
    return seeded_hash(s, parent ? parent->hash : ns, tokens);
}

static uint64_t seeded_check(const kv_store *s, uint64_t seed, const int32_t *tokens)
{
    return XXH3_64bits_withSeed(tokens, (size_t)s->bt * sizeof(int32_t), seed ^ CHECK_SALT);
}

static uint64_t chain_check(const kv_store *s, const struct kv_pentry *parent, const int32_t *tokens, uint64_t ns)
{
    return seeded_check(s, parent ? parent->check : ns, tokens);
}

static struct kv_pentry *lookup(const kv_store *s, const struct kv_pentry *parent, const int32_t *tokens,
                                uint64_t ns)
{
    if (!s->n_buckets)
        return NULL;
    uint64_t h = chain_hash(s, parent, tokens, ns);
    for (struct kv_pentry *e = s->buckets[h & (s->n_buckets - 1)]; e; e = e->next)
        if (e->hash == h && e->parent == parent && e->ns == ns &&
            !memcmp(e->tokens, tokens, (size_t)s->bt * sizeof(int32_t)))
            return e;
    return NULL;
}

/* ---- the LRU list of evictable entries ----------------------------------- */

static void lru_unlink(kv_store *s, struct kv_pentry *e)
{
    *(e->lru_prev ? &e->lru_prev->lru_next : &s->lru_head) = e->lru_next;
    *(e->lru_next ? &e->lru_next->lru_prev : &s->lru_tail) = e->lru_prev;
    e->lru_prev = e->lru_next = NULL;
}

/* Appends e as the most recently used; oldest = true puts it first instead. */
static void lru_link(kv_store *s, struct kv_pentry *e, bool oldest)
{
    if (oldest) {
        e->lru_next = s->lru_head;
        *(s->lru_head ? &s->lru_head->lru_prev : &s->lru_tail) = e;
        s->lru_head = e;
    } else {
        e->lru_prev = s->lru_tail;
        *(s->lru_tail ? &s->lru_tail->lru_next : &s->lru_head) = e;
        s->lru_tail = e;
    }
}

void prefix_hold(kv_store *s, struct kv_pentry *e)
{
    if (e->refs++ > 0)
        return;
    s->n_unref--;
    if (!e->children)
        lru_unlink(s, e);
}

/* Evicts least recently used entries until the unreferenced ones fit
 * s->prefix_mem.  Their blocks have no reference, so no table changes. */
static void fit_budget(kv_store *s)
{
    size_t entry_bytes = (size_t)s->g.n_layers * s->block_bytes;
    while (s->prefix_mem && s->n_unref * entry_bytes > s->prefix_mem && prefix_evict_one(s))
        ;
}

void prefix_unhold(kv_store *s, struct kv_pentry *e)
{
    if (--e->refs > 0)
        return;
    s->n_unref++;
    if (!e->children)
        lru_link(s, e, false);
    fit_budget(s);
}

void kv_store_set_prefix_mem(kv_store *s, size_t bytes)
{
    s->prefix_mem = bytes;
    fit_budget(s);
    state_shared_fit(s);
    kept_fit(s);
}

/* ---- entries -------------------------------------------------------------- */

static void bucket_unlink(kv_store *s, struct kv_pentry *e)
{
    struct kv_pentry **p = &s->buckets[e->hash & (s->n_buckets - 1)];
    while (*p != e)
        p = &(*p)->next;
    *p = e->next;
}

/* Doubles the bucket array; on failure the table stays as it is (longer
 * chains, still correct). */
static void buckets_grow(kv_store *s)
{
    size_t n = s->n_buckets ? 2 * s->n_buckets : 64;
    struct kv_pentry **b = calloc(n, sizeof(*b));
    if (!b)
        return;
    for (size_t i = 0; i < s->n_buckets; i++) {
        for (struct kv_pentry *e = s->buckets[i], *next; e; e = next) {
            next = e->next;
            e->next = b[e->hash & (n - 1)];
            b[e->hash & (n - 1)] = e;
        }
    }
    free(s->buckets);
    s->buckets = b;
    s->n_buckets = n;
}

static void child_add(kv_store *s, struct kv_pentry *p)
{
    if (p && p->children++ == 0 && p->refs == 0)
        lru_unlink(s, p);
}

static void child_drop(kv_store *s, struct kv_pentry *p)
{
    if (p && --p->children == 0 && p->refs == 0)
        lru_link(s, p, true); /* the chain goes tail first */
}

static void spill_queue(kv_store *s, const struct kv_pentry *e);

bool prefix_evict_one(kv_store *s)
{
    struct kv_pentry *e = s->lru_head;
    if (!e)
        return false;
    if (s->spill_max && !e->saved)
        spill_queue(s, e);
    lru_unlink(s, e);
    bucket_unlink(s, e);
    for (int l = 0; l < s->g.n_layers; l++) {
        e->blocks[l]->pub = NULL;
        s->free_blocks[s->n_free++] = e->blocks[l];
    }
    child_drop(s, e->parent);
    s->n_entries--;
    s->n_unref--;
    s->prefix_evictions++;
    free(e);
    return true;
}

void prefix_release_all(kv_store *s)
{
    kv_store_set_prefix_spill(s, 0); /* the store goes: nobody would take them */
    while (prefix_evict_one(s))
        ;
    free(s->buckets);
    s->buckets = NULL;
    s->n_buckets = 0;
}

/* An entry with room for its blocks and ids, not linked anywhere; NULL
 * without memory (for it or for the bucket array). */
static struct kv_pentry *entry_alloc(kv_store *s)
{
    if (s->n_entries >= s->n_buckets)
        buckets_grow(s);
    if (!s->n_buckets)
        return NULL;
    int nl = s->g.n_layers;
    struct kv_pentry *e = calloc(1, sizeof(*e) + (size_t)nl * sizeof(struct kv_block *) +
                                        (size_t)s->bt * sizeof(int32_t));
    if (!e)
        return NULL;
    e->blocks = (struct kv_block **)(e + 1);
    e->tokens = (int32_t *)(e->blocks + nl);
    return e;
}

/* Puts e (parent, ns, hash set) in its bucket and under its parent. */
static void entry_link(kv_store *s, struct kv_pentry *e)
{
    struct kv_pentry **bucket = &s->buckets[e->hash & (s->n_buckets - 1)];
    e->next = *bucket;
    *bucket = e;
    s->n_entries++;
}

/* A new entry for block b of q (the chain continues q's pub_tail), taking
 * q's blocks; NULL without memory. */
static struct kv_pentry *entry_new(kv_seq *q, int64_t b)
{
    kv_store *s = q->s;
    struct kv_pentry *e = entry_alloc(s);
    if (!e)
        return NULL;
    memcpy(e->tokens, q->ids, (size_t)s->bt * sizeof(int32_t));
    e->parent = q->pub_tail;
    e->ns = q->p.prefix_ns;
    e->hash = chain_hash(s, e->parent, e->tokens, e->ns);
    e->check = chain_check(s, e->parent, e->tokens, e->ns);
    for (int l = 0; l < s->g.n_layers; l++) {
        struct kv_block *blk = q->layers[l].pb[b]; /* full paged layers: base 0 */
        blk->pub = e;
        e->blocks[l] = blk;
        e->refs += blk->ref;
    }
    if (e->parent)
        e->parent->children++; /* referenced by q: not on the LRU list */
    entry_link(s, e);
    return e;
}

/* ---- sequences ------------------------------------------------------------ */

void prefix_init(kv_seq *q)
{
    const kv_store *s = q->s;
    q->publish = s->prefix_on && !q->p.no_prefix_cache;
    for (int l = 0; l < s->g.n_layers; l++)
        q->publish = q->publish && q->layers[l].home == KV_HOME_PAGED && !q->layers[l].window;
}

void prefix_stop(kv_seq *q)
{
    q->publish = false;
    q->pub_blocks = 0;
    q->pub_tail = NULL;
}

void prefix_reserve(kv_seq *q, int64_t end)
{
    q->ids_set = false;
    if (!q->publish)
        return;
    int64_t need = end - q->pub_blocks * q->s->bt;
    if (need <= q->ids_cap)
        return;
    int64_t cap = q->ids_cap ? 2 * q->ids_cap : 4 * q->s->bt;
    while (cap < need)
        cap *= 2;
    int32_t *ids = realloc(q->ids, (size_t)cap * sizeof(*ids));
    if (!ids) {
        prefix_stop(q); /* invariant 4 */
        return;
    }
    q->ids = ids;
    q->ids_cap = cap;
}

void kv_seq_tokens(kv_seq *q, const int32_t *ids)
{
    if (q->state) {
        state_seq_tokens(q, ids);
        return;
    }
    if (!q->publish || !q->pending)
        return;
    memcpy(q->ids + (q->len - q->pub_blocks * q->s->bt), ids, (size_t)q->pending * sizeof(*ids));
    q->ids_set = true;
}

/* Puts the cached entry e's blocks in place of q's block b (same contents:
 * the chain is equal), so equal prefixes share memory. */
static void dedupe(kv_seq *q, int64_t b, struct kv_pentry *e)
{
    kv_store *s = q->s;
    for (int l = 0; l < s->g.n_layers; l++) {
        struct kv_layer *L = &q->layers[l];
        struct kv_block *mine = L->pb[b];
        if (mine == e->blocks[l])
            continue;
        blk_get(s, e->blocks[l]);
        L->pb[b] = e->blocks[l];
        L->blocks[b] = e->blocks[l]->data;
        blk_put(s, mine);
    }
}

void prefix_publish(kv_seq *q)
{
    kv_store *s = q->s;
    if (!q->publish)
        return;
    if (!q->ids_set) { /* a step without ids: the chain is unknown from here */
        prefix_stop(q);
        return;
    }
    q->ids_set = false;
    while ((q->pub_blocks + 1) * s->bt <= q->len) {
        int64_t b = q->pub_blocks;
        struct kv_pentry *e = lookup(s, q->pub_tail, q->ids, q->p.prefix_ns);
        if (e)
            dedupe(q, b, e);
        else if (!(e = entry_new(q, b))) {
            prefix_stop(q);
            return;
        }
        q->pub_tail = e;
        q->pub_blocks++;
        memmove(q->ids, q->ids + s->bt, (size_t)(q->len - q->pub_blocks * s->bt) * sizeof(*q->ids));
    }
}

void prefix_crop(kv_seq *q, int64_t len)
{
    kv_store *s = q->s;
    if (!q->publish || len >= q->pub_blocks * s->bt)
        return;
    /* the blocks from len / bt on are no longer the sequence's; the ids of
     * the kept part of block len / bt are in its entry */
    int64_t nb = len / s->bt;
    struct kv_pentry *e = q->layers[0].pb[nb]->pub;
    memcpy(q->ids, e->tokens, (size_t)(len - nb * s->bt) * sizeof(*q->ids));
    q->pub_tail = e->parent;
    q->pub_blocks = nb;
}

enum tier_status prefix_fork(const kv_seq *q, kv_seq *c)
{
    c->publish = q->publish;
    c->pub_blocks = q->pub_blocks;
    c->pub_tail = q->pub_tail;
    if (!q->publish)
        return TIER_OK;
    int64_t n = q->len - q->pub_blocks * q->s->bt;
    if (c->ids_cap < q->ids_cap) { /* a re-forked sequence may have room already */
        int32_t *ids = realloc(c->ids, (size_t)q->ids_cap * sizeof(*ids));
        if (!ids)
            return TIER_ENOMEM_HOST;
        c->ids = ids;
        c->ids_cap = q->ids_cap;
    }
    memcpy(c->ids, q->ids, (size_t)n * sizeof(*c->ids));
    return TIER_OK;
}

enum tier_status kv_seq_match_prefix(kv_seq *q, const int32_t *tokens, int64_t n, int64_t *n_cached)
{
    kv_store *s = q->s;
    s->err[0] = '\0';
    *n_cached = 0;
    if (q->pending || q->len)
        return kv_fail(s, TIER_EINVAL, "kv_seq_match_prefix needs an empty sequence (it holds %lld tokens%s)",
                       (long long)q->len, q->pending ? " and is inside a step" : "");
    if (q->state)
        return state_seq_match(q, tokens, n, n_cached);
    if (!q->publish || n <= 0)
        return TIER_OK;
    /* whole blocks only, and never the last token: its logits are needed */
    int64_t nb = 0;
    struct kv_pentry *tail = NULL, *e;
    while ((nb + 1) * s->bt < n && (e = lookup(s, tail, tokens + nb * s->bt, q->p.prefix_ns))) {
        tail = e;
        nb++;
    }
    if (!nb)
        return TIER_OK;
    prefix_reserve(q, nb * s->bt);
    if (!q->publish)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: token ids of a %lld-token prefix", (long long)(nb * s->bt));
    for (int l = 0; l < s->g.n_layers; l++) {
        struct kv_layer *L = &q->layers[l];
        if (nb > L->cap) {
            void **bl = realloc(L->blocks, (size_t)nb * sizeof(*bl));
            if (bl)
                L->blocks = bl;
            struct kv_block **pb = bl ? realloc(L->pb, (size_t)nb * sizeof(*pb)) : NULL;
            if (!pb)
                return kv_fail(s, TIER_ENOMEM_HOST, "host memory: block tables of a %lld-block prefix", (long long)nb);
            L->pb = pb;
            L->cap = (int)nb;
        }
    }
    e = tail;
    for (int64_t b = nb - 1; b >= 0; b--, e = e->parent) {
        for (int l = 0; l < s->g.n_layers; l++) {
            struct kv_layer *L = &q->layers[l];
            blk_get(s, e->blocks[l]);
            L->pb[b] = e->blocks[l];
            L->blocks[b] = e->blocks[l]->data;
        }
    }
    for (int l = 0; l < s->g.n_layers; l++)
        q->layers[l].n_blocks = (int)nb;
    q->len = nb * s->bt;
    q->pub_blocks = nb;
    q->pub_tail = tail;
    s->prefix_hits += (uint64_t)q->len;
    *n_cached = q->len;
    return TIER_OK;
}

/* ---- on disk -------------------------------------------------------------- */

static size_t entry_bytes_on_disk(const kv_store *s)
{
    return PFX_HDR + (size_t)s->bt * sizeof(int32_t) + (size_t)s->g.n_layers * s->block_bytes;
}

size_t kv_store_prefix_block_bytes(const kv_store *s)
{
    return entry_bytes_on_disk(s);
}

/* e serialized into a new buffer; TIER_ENOMEM_HOST or TIER_EIO (a device
 * copy) with nothing allocated.  No message: eviction calls it from inside
 * other operations, whose own message must stand. */
static enum tier_status entry_save(kv_store *s, const struct kv_pentry *e, struct kv_prefix_block *out)
{
    size_t n = entry_bytes_on_disk(s);
    uint8_t *p = malloc(n);
    if (!p)
        return TIER_ENOMEM_HOST;
    const struct kv_pentry *par = e->parent;
    memcpy(p, PFX_MAGIC, 8);
    put32(p + 8, PFX_VERSION);
    put32(p + 12, (uint32_t)s->g.n_layers);
    put32(p + 16, (uint32_t)s->g.n_kv_heads);
    put32(p + 20, (uint32_t)s->g.head_dim);
    put32(p + 24, (uint32_t)s->g.dtype);
    put32(p + 28, (uint32_t)s->bt);
    put32(p + 32, par ? 1 : 0);
    put32(p + 36, 0);
    put64(p + 40, e->ns);
    put64(p + 48, e->hash);
    put64(p + 56, e->check);
    put64(p + 64, par ? par->hash : 0);
    put64(p + 72, par ? par->check : 0);
    put64(p + 80, n);
    for (int i = 0; i < s->bt; i++)
        put32(p + PFX_HDR + 4 * (size_t)i, (uint32_t)e->tokens[i]);
    uint8_t *kv = p + PFX_HDR + (size_t)s->bt * sizeof(int32_t);
    for (int l = 0; l < s->g.n_layers; l++) {
        if (be_copy(s->be, kv + (size_t)l * s->block_bytes, e->blocks[l]->data, s->block_bytes, BE_D2H) != BE_OK) {
            free(p);
            return TIER_EIO;
        }
    }
    *out = (struct kv_prefix_block){
        .buf = p, .len = n, .ns = e->ns, .hash = e->hash, .has_parent = par != NULL, .parent = par ? par->hash : 0};
    return TIER_OK;
}

static void spill_drop_oldest(kv_store *s)
{
    struct kv_pqueued *q = s->spill_head;
    s->spill_head = q->next;
    if (!s->spill_head)
        s->spill_tail = NULL;
    s->spill_bytes -= q->b.len;
    s->spill_dropped++;
    free(q->b.buf);
    free(q);
}

void spill_push(kv_store *s, const struct kv_prefix_block *b)
{
    struct kv_pqueued *q = b->len <= s->spill_max ? malloc(sizeof(*q)) : NULL;
    if (!q) {
        free(b->buf);
        s->spill_dropped++;
        return;
    }
    while (s->spill_head && s->spill_bytes + b->len > s->spill_max)
        spill_drop_oldest(s);
    *q = (struct kv_pqueued){.b = *b};
    *(s->spill_tail ? &s->spill_tail->next : &s->spill_head) = q;
    s->spill_tail = q;
    s->spill_bytes += b->len;
}

static void spill_queue(kv_store *s, const struct kv_pentry *e)
{
    struct kv_prefix_block b;
    if (entry_bytes_on_disk(s) > s->spill_max || entry_save(s, e, &b) != TIER_OK) {
        s->spill_dropped++;
        return;
    }
    spill_push(s, &b);
}

void kv_store_set_prefix_spill(kv_store *s, size_t max_bytes)
{
    s->spill_max = max_bytes;
    while (s->spill_head && s->spill_bytes > max_bytes)
        spill_drop_oldest(s);
}

bool kv_store_prefix_take_evicted(kv_store *s, struct kv_prefix_block *out)
{
    struct kv_pqueued *q = s->spill_head;
    if (!q)
        return false;
    s->spill_head = q->next;
    if (!s->spill_head)
        s->spill_tail = NULL;
    s->spill_bytes -= q->b.len;
    *out = q->b;
    free(q);
    return true;
}

enum tier_status kv_store_prefix_export(kv_store *s, struct kv_prefix_block *out, bool *got)
{
    s->err[0] = '\0';
    *got = false;
    for (; s->export_at < s->n_buckets; s->export_at++) {
        for (struct kv_pentry *e = s->buckets[s->export_at]; e; e = e->next) {
            if (e->saved)
                continue;
            enum tier_status st = entry_save(s, e, out);
            if (st != TIER_OK)
                return kv_fail(s, st, st == TIER_EIO ? "device copy of a prefix-cache block failed"
                                                     : "host memory: a %zu-byte prefix-cache block",
                               entry_bytes_on_disk(s));
            e->saved = true;
            *got = true;
            return TIER_OK;
        }
    }
    enum tier_status st = kept_export(s, out, got);
    if (st == TIER_OK && !*got)
        s->export_at = 0;
    return st;
}

int64_t kv_store_prefix_chain(const kv_store *s, const struct kv_seq_params *p, const int32_t *tokens, int64_t n,
                              uint64_t *hashes, int64_t *n_mem)
{
    *n_mem = 0;
    if (!s->prefix_on || p->no_prefix_cache || p->strategy != KV_DYNAMIC || p->sink || n <= 1)
        return 0;
    for (int l = 0; l < s->g.n_layers; l++) {
        int window, keep;
        kv_layer_shape(s, p, l, &window, &keep);
        if (window) /* prefix_init: a sliding layer keeps the sequence out */
            return 0;
    }
    /* the blocks kv_seq_match_prefix could attach: never the last token */
    int64_t nb = (n - 1) / s->bt;
    const struct kv_pentry *tail = NULL;
    bool in_mem = true;
    uint64_t unref = 0; /* of the cached ones, those no sequence holds */
    for (int64_t b = 0; b < nb; b++) {
        const int32_t *t = tokens + b * s->bt;
        hashes[b] = seeded_hash(s, b ? hashes[b - 1] : p->prefix_ns, t);
        if (in_mem && (tail = lookup(s, tail, t, p->prefix_ns)) != NULL) {
            (*n_mem)++;
            unref += tail->refs == 0;
        } else {
            in_mem = false;
        }
    }
    /* blocks read in go in unreferenced, beside the chain's unreferenced
     * cached ones: more than the budget holds would evict their own newest
     * (it takes other chains first) */
    uint64_t fit = s->prefix_mem / ((size_t)s->g.n_layers * s->block_bytes), room = fit > unref ? fit - unref : 0;
    if (s->prefix_mem && (uint64_t)(nb - *n_mem) > room)
        nb = *n_mem + (int64_t)room;
    return nb;
}

enum tier_status kv_store_prefix_ship(kv_store *s, const struct kv_seq_params *p, const int32_t *tokens,
                                      int64_t n_blocks, struct kv_prefix_block *out, int64_t max_out, int64_t *n_out,
                                      bool *done)
{
    s->err[0] = '\0';
    *n_out = 0;
    *done = true;
    if (!s->prefix_on || p->no_prefix_cache)
        return TIER_OK;
    struct kv_pentry *tail = NULL;
    for (int64_t b = 0; b < n_blocks && (tail = lookup(s, tail, tokens + b * s->bt, p->prefix_ns)); b++) {
        if (tail->shipped)
            continue;
        if (*n_out == max_out) {
            *done = false;
            return TIER_OK;
        }
        enum tier_status st = entry_save(s, tail, &out[*n_out]);
        if (st != TIER_OK)
            return kv_fail(s, st, st == TIER_EIO ? "device copy of a prefix-cache block failed"
                                                 : "host memory: a %zu-byte prefix-cache block",
                           entry_bytes_on_disk(s));
        tail->shipped = true;
        (*n_out)++;
    }
    return TIER_OK;
}

/* The cached entry of namespace ns with both hashes; NULL if none. */
static struct kv_pentry *find_by_hash(const kv_store *s, uint64_t ns, uint64_t hash, uint64_t check)
{
    if (!s->n_buckets)
        return NULL;
    for (struct kv_pentry *e = s->buckets[hash & (s->n_buckets - 1)]; e; e = e->next)
        if (e->hash == hash && e->check == check && e->ns == ns)
            return e;
    return NULL;
}

enum tier_status kv_store_prefix_insert(kv_store *s, const void *buf, size_t len)
{
    s->err[0] = '\0';
    const uint8_t *p = buf;
    size_t want = entry_bytes_on_disk(s);
    if (!s->prefix_on)
        return kv_fail(s, TIER_EINVAL, "prefix block: the store has no prefix cache");
    if (len < PFX_HDR || memcmp(p, PFX_MAGIC, 8) != 0)
        return kv_fail(s, TIER_EINVAL, "prefix block: not a prefix block (magic)");
    if (get32(p + 8) != PFX_VERSION)
        return kv_fail(s, TIER_EINVAL, "prefix block: version %u (this build reads %d)", get32(p + 8), PFX_VERSION);
    static const char *const geom_name[] = {"n_layers", "n_kv_heads", "head_dim", "dtype", "block_tokens"};
    const uint32_t geom[] = {(uint32_t)s->g.n_layers, (uint32_t)s->g.n_kv_heads, (uint32_t)s->g.head_dim,
                             (uint32_t)s->g.dtype, (uint32_t)s->bt};
    for (int i = 0; i < 5; i++)
        if (get32(p + 12 + 4 * i) != geom[i])
            return kv_fail(s, TIER_EINVAL, "prefix block: %s %u (the store's is %u)", geom_name[i],
                           get32(p + 12 + 4 * i), geom[i]);
    uint32_t flags = get32(p + 32);
    if (flags > 1 || get32(p + 36) != 0)
        return kv_fail(s, TIER_EINVAL, "prefix block: flags %#x / reserved %#x", flags, get32(p + 36));
    if (get64(p + 80) != len || len != want)
        return kv_fail(s, TIER_EINVAL, "prefix block: size %zu, header says %llu (want %zu)", len,
                       (unsigned long long)get64(p + 80), want);
    uint64_t ns = get64(p + 40), hash = get64(p + 48), check = get64(p + 56);
    uint64_t par_hash = get64(p + 64), par_check = get64(p + 72);
    if (!flags && (par_hash || par_check))
        return kv_fail(s, TIER_EINVAL, "prefix block: parent hashes without a parent");
    struct kv_pentry *e = entry_alloc(s);
    if (!e)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: a prefix-cache entry");
    for (int i = 0; i < s->bt; i++)
        e->tokens[i] = (int32_t)get32(p + PFX_HDR + 4 * (size_t)i);
    /* its hashes against its tokens and the parent it names (the chain's
     * seeds): damage to either is a corrupt block, checked before the
     * parent is looked for */
    const char *bad = seeded_hash(s, flags ? par_hash : ns, e->tokens) != hash     ? "hash"
                      : seeded_check(s, flags ? par_check : ns, e->tokens) != check ? "check hash"
                                                                                    : NULL;
    struct kv_pentry *parent = NULL;
    /* a sound block whose parent the cache dropped: not the block's fault */
    if (!bad && flags && !(parent = find_by_hash(s, ns, par_hash, par_check))) {
        free(e);
        return kv_fail(s, TIER_ECONFLICT, "prefix block: parent %016llx is not cached", (unsigned long long)par_hash);
    }
    if (bad || lookup(s, parent, e->tokens, ns)) {
        free(e);
        return bad ? kv_fail(s, TIER_EINVAL, "prefix block: its %s does not match its tokens and parent", bad)
                   : TIER_OK; /* cached already */
    }
    /* the parent's new child keeps it off the LRU list, so taking pool
     * blocks cannot evict it */
    child_add(s, parent);
    const uint8_t *kv = p + PFX_HDR + (size_t)s->bt * sizeof(int32_t);
    enum tier_status st = TIER_OK;
    int l = 0;
    for (; l < s->g.n_layers && st == TIER_OK; l++) {
        if ((st = pool_take(s, &e->blocks[l])) != TIER_OK)
            break;
        if (be_copy(s->be, e->blocks[l]->data, kv + (size_t)l * s->block_bytes, s->block_bytes, BE_H2D) != BE_OK)
            st = kv_fail(s, TIER_EIO, "prefix block: device copy failed");
        else
            e->blocks[l]->ref = 0;
    }
    if (st != TIER_OK) {
        for (int i = 0; i < l; i++) {
            e->blocks[i]->ref = 1;
            blk_put(s, e->blocks[i]);
        }
        child_drop(s, parent);
        free(e);
        return st;
    }
    for (l = 0; l < s->g.n_layers; l++)
        e->blocks[l]->pub = e;
    e->parent = parent;
    e->ns = ns;
    e->hash = hash;
    e->check = check;
    e->saved = e->shipped = true;
    entry_link(s, e);
    s->n_unref++;
    lru_link(s, e, false);
    fit_budget(s);
    return TIER_OK;
}
