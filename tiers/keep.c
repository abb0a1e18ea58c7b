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
 * Invariants: an entry is on the LRU list iff refs == 0; n_unref_kept and
 * kept_unref_bytes sum over exactly those.  Entries sit on one list,
 * newest first: a store keeps few (each a whole input's KV).
 * All functions run on the inference thread.
 */
#include "tiers/kvstore_impl.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

struct kv_kept {
    kv_store *s;
    kv_seq *q;
    uint64_t ns, hash;
    int32_t *ids;
    int64_t n;
    int refs;
    size_t bytes;                      /* kv_seq_bytes(q) when it became unreferenced */
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

bool kept_evict_one(kv_store *s)
{
    struct kv_kept *k = s->kept_old;
    if (!k)
        return false;
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

kv_kept *kv_store_kept_find(kv_store *s, uint64_t ns, const int32_t *ids, int64_t n)
{
    if (n <= 0 || !s->kept)
        return NULL;
    uint64_t h = kv_store_kept_hash(ns, ids, n);
    for (struct kv_kept *k = s->kept; k; k = k->next) {
        if (k->hash != h || k->ns != ns || k->n != n || memcmp(k->ids, ids, (size_t)n * sizeof(*ids)))
            continue;
        if (k->refs++ == 0) {
            lru_unlink(s, k);
            s->n_kept_unref--;
            s->kept_unref_bytes -= k->bytes;
        }
        s->prefix_hits += (uint64_t)n;
        return k;
    }
    return NULL;
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
