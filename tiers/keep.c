/* keep.c - kept sequences: whole read-only sequences the store shares by
 * the token ids they were computed from (an encoder-decoder model's
 * cross-attention cache, a function of its encoder input alone).
 *
 * NOTES
 * An entry owns one sequence, written once before it was kept and only
 * read afterwards, so any number of holders read it at once and nothing
 * is ever copied.  Its key is the namespace and all the ids; the hash
 * (xxh3 of the ids, seeded with the namespace) only narrows the search:
 * a lookup compares the namespace, the length and every id, so a
 * collision can only miss, never hand out another input's cache.
 *
 * The rules are the prefix cache's (prefix.c): entries no holder
 * references are evictable, least recently used first, their bytes (both
 * tiers) kept within kv_store_set_prefix_mem's budget as soon as one
 * becomes unreferenced, and they go before a device allocation fails
 * (pool_take, kv_store_reclaim) or a host one does (kv_host_alloc).
 *
 * Elsewhere (kvstore.h "Kept sequences elsewhere"): an entry travels as
 * an image that names its key, checked against the input looked up; one
 * the store evicts is queued as such an image with the prefix cache's
 * evicted blocks (prefix.c "On disk"), unless the caller holds it already.
 *
 * FORMAT of a kept sequence's image (version 1, little-endian):
 *    0  8  magic "KVTXCR\r\n"
 *    8  u32 version, 12 u32 reserved (0)
 *   16  u64 namespace, 24 u64 n (the ids)
 *   32  i32 ids [n]
 *   then the sequence's image (kv_seq_save), the rest of the buffer
 *
 * Invariants: an entry is on the LRU list iff refs == 0; n_unref_kept and
 * kept_unref_bytes sum over exactly those.  Entries sit on one list,
 * newest first: a store keeps few (each a whole input's KV).
 * All functions run on the inference thread.
 */
#include "tiers/kvstore_impl.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "util/le.h"

#define XC_MAGIC "KVTXCR\r\n"
#define XC_VERSION 1
#define XC_HDR 32

struct kv_kept {
    kv_store *s;
    kv_seq *q;
    uint64_t ns, hash;
    int32_t *ids;
    int64_t n;
    int refs;
    size_t bytes;                      /* kv_seq_bytes(q) when it became unreferenced */
    bool saved;                        /* its image is the caller's already: not queued at eviction */
    struct kv_kept *prev, *next;       /* all entries, newest first */
    struct kv_kept *lru_prev, *lru_next; /* evictable ones, oldest first */
};

uint64_t kv_store_kept_hash(uint64_t ns, const int32_t *ids, int64_t n)
{
    return XXH3_64bits_withSeed(ids, (size_t)n * sizeof(*ids), ns);
}

static void lru_unlink(kv_store *s, struct kv_kept *k)
{
    *(k->lru_prev ? &k->lru_prev->lru_next : &s->kept_old) = k->lru_next;
    *(k->lru_next ? &k->lru_next->lru_prev : &s->kept_new) = k->lru_prev;
    k->lru_prev = k->lru_next = NULL;
}

static void lru_link_newest(kv_store *s, struct kv_kept *k)
{
    k->lru_prev = s->kept_new;
    *(s->kept_new ? &s->kept_new->lru_next : &s->kept_old) = k;
    s->kept_new = k;
}

/* k's image, queued for the caller.  Eviction runs inside other
 * operations, whose message must stand. */
static void spill(kv_store *s, const struct kv_kept *k)
{
    char err[sizeof(s->err)];
    memcpy(err, s->err, sizeof(err));
    struct kv_prefix_block b;
    if (XC_HDR + (size_t)k->n * 4 + kv_seq_image_size(k->q) > s->spill_max ||
        kv_store_kept_image(k->q, k->ns, k->ids, k->n, &b) != TIER_OK)
        s->spill_dropped++;
    else
        spill_push(s, &b);
    memcpy(s->err, err, sizeof(err));
}

bool kept_evict_one(kv_store *s)
{
    struct kv_kept *k = s->kept_old;
    if (!k)
        return false;
    if (s->spill_max && !k->saved)
        spill(s, k);
    lru_unlink(s, k);
    *(k->prev ? &k->prev->next : &s->kept) = k->next;
    if (k->next)
        k->next->prev = k->prev;
    s->n_kept--;
    s->n_kept_unref--;
    s->kept_unref_bytes -= k->bytes;
    s->prefix_evictions++;
    kv_seq_free(k->q);
    free(k->ids);
    free(k);
    return true;
}

void kept_fit(kv_store *s)
{
    while (s->prefix_mem && s->kept_unref_bytes > s->prefix_mem && kept_evict_one(s))
        ;
}

void kept_release_all(kv_store *s)
{
    while (kept_evict_one(s))
        ;
}

enum tier_status kv_store_keep(kv_store *s, uint64_t ns, const int32_t *ids, int64_t n, kv_seq *q, kv_kept **out)
{
    s->err[0] = '\0';
    *out = NULL;
    if (n <= 0 || n > KV_SEQ_MAX_LEN || q->s != s || q->pending)
        return kv_fail(s, TIER_EINVAL, "kv_store_keep: %lld ids, a sequence of %s store%s", (long long)n,
                       q->s == s ? "this" : "another", q->pending ? ", inside a step" : "");
    struct kv_kept *k = calloc(1, sizeof(*k));
    int32_t *copy = k ? malloc((size_t)n * sizeof(*copy)) : NULL;
    if (!copy) {
        free(k);
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: the %lld ids of a kept sequence", (long long)n);
    }
    memcpy(copy, ids, (size_t)n * sizeof(*copy));
    *k = (struct kv_kept){.s = s, .q = q, .ns = ns, .hash = kv_store_kept_hash(ns, ids, n), .ids = copy, .n = n, .refs = 1};
    k->next = s->kept;
    if (s->kept)
        s->kept->prev = k;
    s->kept = k;
    s->n_kept++;
    *out = k;
    return TIER_OK;
}

static struct kv_kept *lookup(const kv_store *s, uint64_t ns, const int32_t *ids, int64_t n)
{
    if (n <= 0 || !s->kept)
        return NULL;
    uint64_t h = kv_store_kept_hash(ns, ids, n);
    for (struct kv_kept *k = s->kept; k; k = k->next)
        if (k->hash == h && k->ns == ns && k->n == n && !memcmp(k->ids, ids, (size_t)n * sizeof(*ids)))
            return k;
    return NULL;
}

bool kv_store_kept_held(const kv_store *s, uint64_t ns, const int32_t *ids, int64_t n)
{
    return lookup(s, ns, ids, n) != NULL;
}

kv_kept *kv_store_kept_find(kv_store *s, uint64_t ns, const int32_t *ids, int64_t n)
{
    struct kv_kept *k = lookup(s, ns, ids, n);
    if (!k)
        return NULL;
    if (k->refs++ == 0) {
        lru_unlink(s, k);
        s->n_kept_unref--;
        s->kept_unref_bytes -= k->bytes;
    }
    s->prefix_hits += (uint64_t)n;
    return k;
}

enum tier_status kv_store_kept_image(kv_seq *q, uint64_t ns, const int32_t *ids, int64_t n,
                                     struct kv_prefix_block *out)
{
    kv_store *s = q->s;
    size_t img = kv_seq_image_size(q), at = XC_HDR + 4 * (size_t)n;
    uint8_t *p = img <= SIZE_MAX - at ? malloc(at + img) : NULL;
    if (!p)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: the %zu-byte image of a kept sequence", img);
    enum tier_status st = kv_seq_save(q, p + at, img);
    if (st != TIER_OK) {
        free(p);
        return st;
    }
    memcpy(p, XC_MAGIC, 8);
    put32(p + 8, XC_VERSION);
    put32(p + 12, 0);
    put64(p + 16, ns);
    put64(p + 24, (uint64_t)n);
    for (int64_t i = 0; i < n; i++)
        put32(p + XC_HDR + 4 * i, (uint32_t)ids[i]);
    *out = (struct kv_prefix_block){
        .buf = p, .len = at + img, .ns = ns, .hash = kv_store_kept_hash(ns, ids, n), .kept = true};
    return TIER_OK;
}

enum tier_status kv_store_kept_insert(kv_store *s, const void *buf, size_t len, uint64_t ns, const int32_t *ids,
                                      int64_t n, bool on_disk, kv_kept **out)
{
    s->err[0] = '\0';
    *out = NULL;
    const uint8_t *p = buf;
    if (len < XC_HDR || memcmp(p, XC_MAGIC, 8) || get32(p + 8) != XC_VERSION || get32(p + 12))
        return kv_fail(s, TIER_EINVAL, "kept sequence: not a kept sequence's image of version %d", XC_VERSION);
    uint64_t fns = get64(p + 16), fn = get64(p + 24);
    if (fn == 0 || fn > KV_SEQ_MAX_LEN || fn > (len - XC_HDR) / 4)
        return kv_fail(s, TIER_EINVAL, "kept sequence: %llu ids in an image of %zu bytes", (unsigned long long)fn,
                       len);
    const uint8_t *fids = p + XC_HDR;
    bool same = fns == ns && fn == (uint64_t)n;
    for (int64_t i = 0; same && i < n; i++)
        same = (int32_t)get32(fids + 4 * i) == ids[i];
    /* the ids as stored are the int32 the hash reads on a little-endian host */
    if (!same)
        return XXH3_64bits_withSeed(fids, 4 * fn, fns) == kv_store_kept_hash(ns, ids, n)
                   ? kv_fail(s, TIER_ECONFLICT, "kept sequence: of another input whose key hashes as this one's")
                   : kv_fail(s, TIER_EINVAL, "kept sequence: of another namespace or input than its key");
    size_t at = XC_HDR + 4 * (size_t)fn;
    kv_seq *q;
    enum tier_status st = kv_seq_load(s, p + at, len - at, &q);
    if (st != TIER_OK)
        return st;
    int64_t got = kv_seq_length(q);
    if (got != n) {
        kv_seq_free(q);
        return kv_fail(s, TIER_EINVAL, "kept sequence: %lld positions for %lld ids", (long long)got, (long long)n);
    }
    if ((st = kv_store_keep(s, ns, ids, n, q, out)) != TIER_OK) {
        kv_seq_free(q);
        return st;
    }
    (*out)->saved = on_disk;
    return TIER_OK;
}

size_t kv_store_kept_image_bound(const kv_store *s, int64_t n)
{
    size_t nb = ((size_t)n + (size_t)s->bt - 1) / (size_t)s->bt;
    return XC_HDR + 4 * (size_t)n + kv_image_head_size(s) + 2 * nb * kv_store_prefix_block_bytes(s);
}

enum tier_status kept_export(kv_store *s, struct kv_prefix_block *out, bool *got)
{
    for (struct kv_kept *k = s->kept; k; k = k->next) {
        if (k->saved)
            continue;
        enum tier_status st = kv_store_kept_image(k->q, k->ns, k->ids, k->n, out);
        if (st != TIER_OK)
            return st;
        k->saved = true;
        *got = true;
        return TIER_OK;
    }
    return TIER_OK;
}

kv_seq *kv_kept_seq(const kv_kept *k)
{
    return k->q;
}

void kv_kept_unref(kv_kept *k)
{
    if (!k || --k->refs > 0)
        return;
    kv_store *s = k->s;
    /* its bytes as of now: a holder may have moved it to the host tier */
    k->bytes = kv_seq_bytes(k->q);
    s->n_kept_unref++;
    s->kept_unref_bytes += k->bytes;
    lru_link_newest(s, k);
    kept_fit(s);
}
