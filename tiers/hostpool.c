/* hostpool.c - the host tier's memory: slabs of pinned host memory taken
 * from the backend rarely and in large pieces, extents carved out of them.
 *
 * Pinning (mlock, cudaMallocHost) and NUMA binding cost per allocation,
 * and offloaded layers grow by doubling, so one backend allocation per
 * extent would pay that cost on every growth.  Each slab keeps its free
 * ranges in an array sorted by offset; a release merges with its
 * neighbours, so a slab whose extents are all gone is one free range.
 *
 * Invariants:
 *   (1) a slab's free ranges and its live extents tile it; no two free
 *       ranges touch (a release merges them).
 *   (2) cap_free >= n_live + 1, the most free ranges n_live extents can
 *       separate, so a release never allocates and cannot fail.
 *   (3) a slab without live extents is held only while it is the only
 *       slab (kept warm for the next sequence).
 * All functions run on the store's thread.
 */
#include "tiers/kvstore_impl.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HP_ALIGN 64                        /* extents stay cache-line (and SIMD) aligned */
#define HP_SLAB_MIN ((size_t)64 << 20)     /* the smallest slab the budget allows */
#define HP_SLAB_ROUND ((size_t)2 << 20)    /* larger slabs: whole huge pages */

void hp_init(struct kv_hostpool *p, be_backend *be)
{
    *p = (struct kv_hostpool){.be = be};
}

static char *slab_base(const struct hp_slab *sl)
{
    return be_buffer_data(sl->buf);
}

/* Makes room for one more free range than n_live extents can separate
 * after the next carve (invariant 2).  Capacity only: nothing changes on
 * failure. */
static bool slab_reserve(struct hp_slab *sl)
{
    if (sl->cap_free >= sl->n_live + 2)
        return true;
    size_t cap = 2 * (sl->n_live + 2);
    struct hp_range *r = realloc(sl->free, cap * sizeof(*r));
    if (!r)
        return false;
    sl->free = r;
    sl->cap_free = cap;
    return true;
}

/* Takes need bytes from the front of free range i of a slab. */
static void *slab_carve(struct hp_slab *sl, size_t i, size_t need)
{
    struct hp_range *r = &sl->free[i];
    void *ptr = slab_base(sl) + r->off;
    r->off += need;
    r->len -= need;
    if (!r->len) {
        memmove(r, r + 1, (sl->n_free - i - 1) * sizeof(*r));
        sl->n_free--;
    }
    sl->n_live++;
    return ptr;
}

static void slab_drop(struct kv_hostpool *p, size_t i)
{
    struct hp_slab *sl = &p->slabs[i];
    p->slab_bytes -= be_buffer_size(sl->buf);
    be_buffer_free(sl->buf);
    free(sl->free);
    p->slabs[i] = p->slabs[--p->n_slabs];
}

/* A new slab for an extent of need bytes: max(HP_SLAB_MIN, need rounded
 * up to HP_SLAB_ROUND), cut to what keeps every slab within a non-zero
 * budget but never below need; the exact need if the backend refuses the
 * larger size. */
static enum be_status slab_new(struct kv_hostpool *p, size_t need, size_t budget, void **out)
{
    if (p->n_slabs == p->cap_slabs) {
        size_t cap = p->cap_slabs ? 2 * p->cap_slabs : 4;
        struct hp_slab *sl = realloc(p->slabs, cap * sizeof(*sl));
        if (!sl)
            return BE_ENOMEM_HOST;
        p->slabs = sl;
        p->cap_slabs = cap;
    }
    struct hp_slab sl = {.cap_free = 2};
    sl.free = malloc(sl.cap_free * sizeof(*sl.free));
    if (!sl.free)
        return BE_ENOMEM_HOST;
    /* an empty warm slab did not fit need: it goes back before the new
     * one is charged (invariant 3) */
    if (p->n_slabs == 1 && !p->slabs[0].n_live)
        slab_drop(p, 0);
    size_t size = (need + HP_SLAB_ROUND - 1) & ~(HP_SLAB_ROUND - 1); /* hp_alloc bounded need */
    if (size < HP_SLAB_MIN)
        size = HP_SLAB_MIN;
    if (budget) {
        size_t room = budget > p->slab_bytes ? (budget - p->slab_bytes) & ~(size_t)(HP_ALIGN - 1) : 0;
        if (size > room)
            size = room > need ? room : need;
    }
    enum be_status st = be_host_alloc(p->be, size, &sl.buf);
    if (st == BE_ENOMEM_HOST && size > need)
        st = be_host_alloc(p->be, size = need, &sl.buf);
    if (st != BE_OK) {
        free(sl.free);
        return st;
    }
    sl.free[0] = (struct hp_range){.off = 0, .len = size};
    sl.n_free = 1;
    p->slab_bytes += size;
    p->slab_allocs++;
    p->slabs[p->n_slabs] = sl;
    *out = slab_carve(&p->slabs[p->n_slabs++], 0, need);
    return BE_OK;
}

enum be_status hp_alloc(struct kv_hostpool *p, size_t bytes, size_t budget, void **out)
{
    if (!bytes || bytes > SIZE_MAX - HP_SLAB_ROUND)
        return BE_EINVAL;
    size_t need = (bytes + HP_ALIGN - 1) & ~(size_t)(HP_ALIGN - 1);
    for (size_t s = 0; s < p->n_slabs; s++) {
        struct hp_slab *sl = &p->slabs[s];
        for (size_t i = 0; i < sl->n_free; i++) {
            if (sl->free[i].len < need)
                continue;
            if (!slab_reserve(sl))
                return BE_ENOMEM_HOST;
            *out = slab_carve(sl, i, need);
            return BE_OK;
        }
    }
    return slab_new(p, need, budget, out);
}

void hp_free(struct kv_hostpool *p, void *ptr, size_t bytes)
{
    size_t need = (bytes + HP_ALIGN - 1) & ~(size_t)(HP_ALIGN - 1);
    size_t s = 0; /* the slab holding ptr: a linear search, slabs are few */
    while ((char *)ptr < slab_base(&p->slabs[s]) ||
           (char *)ptr >= slab_base(&p->slabs[s]) + be_buffer_size(p->slabs[s].buf))
        s++;
    struct hp_slab *sl = &p->slabs[s];
    size_t off = (size_t)((char *)ptr - slab_base(sl)), i = 0;
    while (i < sl->n_free && sl->free[i].off < off)
        i++;
    struct hp_range *r = sl->free;
    bool prev = i > 0 && r[i - 1].off + r[i - 1].len == off;
    bool next = i < sl->n_free && off + need == r[i].off;
    if (prev && next) {
        r[i - 1].len += need + r[i].len;
        memmove(&r[i], &r[i + 1], (sl->n_free - i - 1) * sizeof(*r));
        sl->n_free--;
    } else if (prev) {
        r[i - 1].len += need;
    } else if (next) {
        r[i].off = off;
        r[i].len += need;
    } else {
        memmove(&r[i + 1], &r[i], (sl->n_free - i) * sizeof(*r));
        r[i] = (struct hp_range){.off = off, .len = need};
        sl->n_free++;
    }
    if (!--sl->n_live && p->n_slabs > 1)
        slab_drop(p, s);
}

void hp_release(struct kv_hostpool *p)
{
    while (p->n_slabs)
        slab_drop(p, p->n_slabs - 1);
    free(p->slabs);
    p->slabs = NULL;
    p->cap_slabs = 0;
}
