/* prefix_disk.c - the prefix cache's blocks on the disk tier
 * (docs/persistence.md "Prefix blocks on disk"), so that a prefix computed
 * before a restart, or evicted for room, is still a hit.
 *
 * An object per block: namespace "p<prefix namespace in hex>", name its
 * chain hash in 16 hex digits, data the store's serialized entry
 * (kvstore.h "the prefix cache on disk"), meta {"kvtier_prefix": 1,
 * "parent": hex or null}.  The store queues the entries it evicts; the
 * engine loop drains the queue here and writes them (cold: compressed
 * under auto).  At exit every cached entry not on disk yet is written.
 *
 * The index: every block on disk or being written, by (namespace, hash),
 * built at start from the scan and kept up to date with every put and
 * read, in the order of last use.  When a put does not fit the budget,
 * the least recently used prefix files (never a session's) are removed
 * and the put tried once more after the removal ran.
 *
 * Reading: at admission, when the prompt's chain goes on on disk past
 * what memory holds, the job waits (io_wait) while those blocks are read;
 * they are inserted in chain order, then the job starts and its
 * kv_seq_match_prefix finds them.  A missing, corrupt or refused block is
 * a miss from there on, with a log line, never an error.  The reads land
 * in the staging ring (below), so that on a GPU a block's upload is a DMA
 * straight from page-locked memory.
 *
 * An encoder-decoder model's encoder cache goes the same way, an object
 * per cross-attention cache: namespace "x<prefix namespace in hex>", name
 * the hash the store keys it by (kv_store_kept_hash), data the store's
 * image of it (kv_store_kept_image: its namespace and input ids, then the
 * cache), meta {"kvtier_encoder": 1}.  The store queues those it evicts
 * with the blocks; at admission an input in no memory whose key is on
 * disk is read (encoder_disk_fetch) and checked against the input id by
 * id: a collision of the hash is a miss that leaves the file, a file that
 * is not what its name says is removed.  The model and the KV layout are
 * the disk tier's to check (every file records them).
 * Everything here runs on the engine thread, but the staging ring's
 * allocation, which runs on the disk tier's I/O thread.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine_impl.h"
#include "util/clock.h"
#include "util/log.h"

#define META_FORMAT 1
/* bytes of evicted blocks the store may queue, and bytes being written */
#define QUEUE_BYTES ((size_t)64 << 20)
/* besides the block's bytes, what its file's header, meta and padding may take */
#define FILE_SLACK ((size_t)16 << 10)

struct pfile {
    uint64_t ns, hash, parent;
    bool kept; /* an encoder-cache entry, not a prefix block */
    bool has_parent;
    bool writing; /* its put is in flight: not readable yet */
    size_t bytes;
    struct pfile *next;          /* bucket chain */
    struct pfile *older, *newer; /* the order of last use */
};

enum pop_kind { POP_PUT, POP_BARRIER };

/* A put in flight, or the barrier a put waits behind: a read queued after
 * removals is done only once they ran, so their bytes are free by then. */
struct pop {
    enum pop_kind kind;
    kv_disk_op *op;
    struct kv_prefix_block blk;
    char *meta;
    struct pfile *f; /* POP_PUT: its index entry */
    struct pop *next;
};

/* The reads one job waits for, in chain order; or the one read of its
 * input's cross cache (ids: the input, which the file must hold). */
struct prefix_fetch {
    struct job *j; /* NULL once the job retired */
    uint64_t ns;
    int32_t *ids;
    size_t n_ids;
    int n;
    struct prefix_fetch *next;
    struct {
        kv_disk_op *op;
        uint64_t hash;
    } blk[];
};

/* Where prefix-block reads land on a backend whose device is apart from
 * the host: slots of one block file's data, carved from one buffer of its
 * page-locked host memory (be_host_alloc), so that inserting a block
 * uploads each layer straight from it.  Page-locking costs far more than a
 * block's copy, so the buffer is locked once and its slots reused.  A read
 * that finds every slot taken gets ordinary memory, as every read does on
 * a unified backend.  The I/O thread takes slots; the engine thread gives
 * them back, or the I/O thread for a read that failed: a mutex. */
#define STAGE_BYTES ((size_t)32 << 20)
#define STAGE_SLOTS 64 /* bits of used */

struct stage {
    pthread_mutex_t mu;
    be_buffer *buf; /* NULL: no ring, every read in ordinary memory */
    char *base;
    size_t slot; /* bytes */
    int n;
    uint64_t used; /* bit i: slot i holds a read's data */
};

struct prefix_disk {
    struct stage stage;
    struct pfile **buckets;
    size_t n_buckets, n_files;
    struct pfile *oldest, *newest;
    struct pop *ops;
    size_t put_bytes; /* of the blocks in ops */
    struct prefix_fetch *fetches;
    bool exiting; /* the shutdown waits for the writes: they go uncompressed */
};

static void names(bool kept, uint64_t ns, uint64_t hash, char nsb[24], char name[24])
{
    snprintf(nsb, 24, "%c%" PRIx64, kept ? 'x' : 'p', ns);
    snprintf(name, 24, "%016" PRIx64, hash);
}

/* for the log: an object's kind, and the daemon's in counts */
static const char *what(bool kept)
{
    return kept ? "cross-attention cache" : "prefix block";
}

static const char *counted(const engine *e)
{
    return e->enc_cache ? "encoder-cache cross-attention cache" : "prefix-cache block";
}

/* ---- the staging ring -------------------------------------------------------- */

/* The ring for blocks of block_bytes, or none when the backend has no host
 * memory for it (the reads then take ordinary memory). */
static void stage_open(engine *e, struct stage *st, size_t block_bytes)
{
    pthread_mutex_init(&st->mu, NULL);
    st->slot = kv_disk_data_alloc_len(block_bytes);
    size_t n = st->slot ? STAGE_BYTES / st->slot : 0;
    st->n = n > STAGE_SLOTS ? STAGE_SLOTS : (int)n;
    if (st->n && be_host_alloc(e->rt.be, (size_t)st->n * st->slot, &st->buf) != BE_OK) {
        st->buf = NULL;
        st->n = 0;
    }
    st->base = st->buf ? be_buffer_data(st->buf) : NULL;
}

static void stage_close(struct stage *st)
{
    be_buffer_free(st->buf);
    pthread_mutex_destroy(&st->mu);
}

/* kv_disk_alloc's alloc: a free slot, else ordinary memory. */
static void *stage_alloc(void *arg, size_t len, void **data)
{
    struct stage *st = arg;
    pthread_mutex_lock(&st->mu);
    int i = 0;
    while (i < st->n && (st->used >> i & 1))
        i++;
    bool in_ring = i < st->n && len <= st->slot;
    if (in_ring)
        st->used |= 1ull << i;
    pthread_mutex_unlock(&st->mu);
    if (in_ring)
        return *data = st->base + (size_t)i * st->slot;
    return kv_disk_heap_alloc(NULL, len, data);
}

static bool in_stage(const struct stage *st, const void *buf)
{
    uintptr_t p = (uintptr_t)buf, base = (uintptr_t)st->base;
    return st->n && p >= base && p < base + (size_t)st->n * st->slot;
}

static void stage_free(void *arg, void *buf)
{
    struct stage *st = arg;
    char *p = buf;
    if (!in_stage(st, buf)) {
        free(buf);
        return;
    }
    pthread_mutex_lock(&st->mu);
    st->used &= ~(1ull << ((size_t)(p - st->base) / st->slot));
    pthread_mutex_unlock(&st->mu);
}

/* ---- the index ------------------------------------------------------------- */

static size_t bucket_of(const struct prefix_disk *pd, uint64_t ns, uint64_t hash)
{
    return (size_t)((hash ^ (ns * 0x9e3779b97f4a7c15u)) & (pd->n_buckets - 1));
}

static struct pfile *find(const struct prefix_disk *pd, bool kept, uint64_t ns, uint64_t hash)
{
    if (!pd->n_buckets)
        return NULL;
    for (struct pfile *f = pd->buckets[bucket_of(pd, ns, hash)]; f; f = f->next)
        if (f->ns == ns && f->hash == hash && f->kept == kept)
            return f;
    return NULL;
}

static void lru_unlink(struct prefix_disk *pd, struct pfile *f)
{
    *(f->older ? &f->older->newer : &pd->oldest) = f->newer;
    *(f->newer ? &f->newer->older : &pd->newest) = f->older;
    f->older = f->newer = NULL;
}

static void lru_append(struct prefix_disk *pd, struct pfile *f)
{
    f->older = pd->newest;
    *(pd->newest ? &pd->newest->newer : &pd->oldest) = f;
    pd->newest = f;
}

static void touch(struct prefix_disk *pd, struct pfile *f)
{
    lru_unlink(pd, f);
    lru_append(pd, f);
}

/* Doubles the buckets; on failure the chains just grow longer. */
static void grow(struct prefix_disk *pd)
{
    size_t n = pd->n_buckets ? 2 * pd->n_buckets : 256;
    struct pfile **b = calloc(n, sizeof(*b));
    if (!b)
        return;
    struct pfile **old = pd->buckets;
    size_t n_old = pd->n_buckets;
    pd->buckets = b;
    pd->n_buckets = n;
    for (size_t i = 0; i < n_old; i++) {
        for (struct pfile *f = old[i], *next; f; f = next) {
            next = f->next;
            size_t k = bucket_of(pd, f->ns, f->hash);
            f->next = b[k];
            b[k] = f;
        }
    }
    free(old);
}

static struct pfile *index_add(struct prefix_disk *pd, bool kept, uint64_t ns, uint64_t hash, bool has_parent,
                               uint64_t parent, size_t bytes)
{
    if (pd->n_files >= pd->n_buckets)
        grow(pd);
    struct pfile *f = pd->n_buckets ? calloc(1, sizeof(*f)) : NULL;
    if (!f)
        return NULL;
    *f = (struct pfile){
        .ns = ns, .hash = hash, .parent = parent, .kept = kept, .has_parent = has_parent, .bytes = bytes};
    size_t k = bucket_of(pd, ns, hash);
    f->next = pd->buckets[k];
    pd->buckets[k] = f;
    lru_append(pd, f);
    pd->n_files++;
    return f;
}

static void index_del(struct prefix_disk *pd, struct pfile *f)
{
    struct pfile **p = &pd->buckets[bucket_of(pd, f->ns, f->hash)];
    while (*p != f)
        p = &(*p)->next;
    *p = f->next;
    lru_unlink(pd, f);
    pd->n_files--;
    free(f);
}

/* ---- writing ------------------------------------------------------------- */

static char *meta_json(const struct kv_prefix_block *b)
{
    char parent[24];
    snprintf(parent, sizeof(parent), "%016" PRIx64, b->parent);
    json_t *o = b->kept ? json_pack("{s:i}", "kvtier_encoder", META_FORMAT)
                        : json_pack("{s:i, s:s?}", "kvtier_prefix", META_FORMAT, "parent",
                                    b->has_parent ? parent : NULL);
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return text;
}

/* Removes least recently used prefix files not being written until about
 * need bytes are free, and queues a read behind the removals; NULL when
 * nothing could go. */
static kv_disk_op *make_room(engine *e, size_t need)
{
    struct prefix_disk *pd = e->pd;
    size_t freed = 0;
    char ns[24], name[24];
    int n = 0;
    for (struct pfile *f = pd->oldest, *next; f && freed < need; f = next) {
        next = f->newer;
        if (f->writing)
            continue;
        names(f->kept, f->ns, f->hash, ns, name);
        kv_disk_remove(e->disk, ns, name);
        freed += f->bytes + FILE_SLACK;
        index_del(pd, f);
        n++;
    }
    kv_disk_op *op = NULL;
    if (n)
        log_msg(LOG_DEBUG, "disk tier full: %d least recently used %s file(s) removed for a new one", n,
                e->enc_cache ? "encoder-cache" : "prefix");
    if (n && kv_disk_get(e->disk, ns, name, &op) != TIER_OK)
        op = NULL;
    return op;
}

static void pop_link(struct prefix_disk *pd, struct pop *p)
{
    p->next = pd->ops;
    pd->ops = p;
    pd->put_bytes += p->blk.len;
}

/* Starts writing b (taking it) unless it is on disk already; retry: this
 * is the second try, after make_room. */
static void put_block(engine *e, struct kv_prefix_block b, bool retry)
{
    struct prefix_disk *pd = e->pd;
    struct pfile *f = find(pd, b.kept, b.ns, b.hash);
    if (f) {
        touch(pd, f);
        free(b.buf);
        return;
    }
    char ns[24], name[24];
    names(b.kept, b.ns, b.hash, ns, name);
    struct pop *p = calloc(1, sizeof(*p));
    char *meta = p ? meta_json(&b) : NULL;
    enum tier_status ts = TIER_ENOMEM_HOST;
    if (meta) {
        struct kv_disk_obj o = {.meta = meta, .meta_len = strlen(meta), .data = b.buf, .data_len = b.len,
                                 .cold = !pd->exiting};
        ts = kv_disk_put(e->disk, ns, name, &o, &p->op);
    }
    if (ts == TIER_OK && !(f = index_add(pd, b.kept, b.ns, b.hash, b.has_parent, b.parent, b.len + strlen(meta)))) {
        kv_disk_op_wait(p->op); /* written, but unknown to the index: an orphan the budget ignores */
        kv_disk_op_free(p->op);
        ts = TIER_ENOMEM_HOST;
    }
    if (ts == TIER_OK) {
        f->writing = true;
        *p = (struct pop){.kind = POP_PUT, .op = p->op, .blk = b, .meta = meta, .f = f};
        pop_link(pd, p);
        return;
    }
    free(meta);
    if (ts == TIER_EFULL && !retry && (p->op = make_room(e, b.len + FILE_SLACK))) {
        p->kind = POP_BARRIER;
        p->blk = b;
        pop_link(pd, p);
        return;
    }
    log_msg(LOG_DEBUG, "%s %s/%s not written to disk: %s", what(b.kept), ns, name,
            kv_disk_errmsg(e->disk)[0] ? kv_disk_errmsg(e->disk) : tier_strerror(ts));
    engine_count(e, &e->st.disk_errors);
    free(p);
    free(b.buf);
}

/* Handles the finished puts and barriers (all of them with wait). */
static void reap(engine *e, bool wait)
{
    struct prefix_disk *pd = e->pd;
    for (struct pop **pp = &pd->ops, *p; (p = *pp);) {
        if (!wait && !kv_disk_op_done(p->op)) {
            pp = &p->next;
            continue;
        }
        enum tier_status ts = kv_disk_op_wait(p->op);
        *pp = p->next;
        pd->put_bytes -= p->blk.len;
        if (p->kind == POP_BARRIER) {
            kv_disk_op_free(p->op);
            put_block(e, p->blk, true);
            free(p);
            continue;
        }
        if (ts == TIER_OK) {
            p->f->writing = false;
            engine_count(e, p->blk.kept ? &e->st.encoder_disk_written : &e->st.prefix_disk_written);
        } else {
            log_msg(LOG_DEBUG, "%s not written to disk: %s", what(p->blk.kept), kv_disk_op_errmsg(p->op));
            engine_count(e, &e->st.disk_errors);
            index_del(pd, p->f);
        }
        kv_disk_op_free(p->op);
        free(p->blk.buf);
        free(p->meta);
        free(p);
    }
}

/* The store's evicted blocks, as long as the writes in flight stay bounded. */
static void drain(engine *e)
{
    struct kv_prefix_block b;
    while (e->pd->put_bytes < QUEUE_BYTES && kv_store_prefix_take_evicted(e->store, &b))
        put_block(e, b, false);
}

/* ---- reading ------------------------------------------------------------- */

/* Inserts a finished fetch's blocks in chain order up to the first one
 * that is missing, corrupt or refused (which leaves the index; a refused
 * one the disk too), then starts its job; a cross cache's read hands the
 * job the entry (j->cross_kept). */
static void fetch_finish(engine *e, struct prefix_fetch *x)
{
    struct prefix_disk *pd = e->pd;
    bool kept = x->ids != NULL;
    kv_kept *k = NULL;
    int got = 0, staged = 0;
    bool miss = false;
    for (int i = 0; i < x->n; i++) {
        kv_disk_op *op = x->blk[i].op;
        void *meta = NULL, *buf = NULL, *data = NULL;
        size_t meta_len = 0, n = 0;
        enum tier_status ts = kv_disk_op_wait(op);
        const char *why = kv_disk_op_errmsg(op);
        bool refused = false;
        if (ts == TIER_OK && !miss) {
            kv_disk_op_take_buf(op, &meta, &meta_len, &buf, &data, &n);
            ts = kept ? kv_store_kept_insert(e->store, data, n, x->ns, x->ids, (int64_t)x->n_ids, true, &k)
                      : kv_store_prefix_insert(e->store, data, n);
            why = kv_store_errmsg(e->store);
            refused = ts == TIER_EINVAL;
        }
        if (!miss && ts != TIER_OK) {
            char ns[24], name[24];
            names(kept, x->ns, x->blk[i].hash, ns, name);
            /* TIER_ECONFLICT: a sound file, another input's whose key
             * collides (a cross cache), or one whose parent the cache
             * evicted while it was read (a block, no news) */
            bool evicted = ts == TIER_ECONFLICT && !kept;
            log_msg(evicted ? LOG_DEBUG : LOG_WARN, "%s %s/%s not used, %s: %s", what(kept), ns, name,
                    kept ? "the input is encoded" : "the chain is a miss from there on",
                    why[0] ? why : tier_strerror(ts));
            struct pfile *f = find(pd, kept, x->ns, x->blk[i].hash);
            if (f && !f->writing && ts != TIER_ENOMEM_DEV && ts != TIER_ENOMEM_HOST && ts != TIER_ECONFLICT)
                index_del(pd, f);
            if (refused)
                kv_disk_remove(e->disk, ns, name);
            miss = true;
        } else if (!miss) {
            got++;
        }
        free(meta);
        staged += in_stage(&pd->stage, buf);
        stage_free(&pd->stage, buf); /* a cross cache's read: ordinary memory */
        kv_disk_op_free(op);
    }
    if (!kept)
        log_msg(LOG_DEBUG, "prefix blocks read from disk: %d, %d of them into the staging ring", x->n, staged);
    pthread_mutex_lock(&e->mu);
    if (kept) {
        e->st.encoder_disk_read += (uint64_t)got;
    } else {
        e->st.prefix_disk_read += (uint64_t)got;
        e->st.prefix_disk_hits += got > 0;
    }
    pthread_mutex_unlock(&e->mu);
    struct job *j = x->j;
    free(x->ids);
    free(x);
    if (!j) {
        kv_kept_unref(k);
        return;
    }
    j->cross_kept = k;
    j->pfetch = NULL;
    resume_job(e, j);
}

/* x (its reads started) becomes j's: j waits for it. */
static void fetch_link(struct prefix_disk *pd, struct prefix_fetch *x, struct job *j, uint64_t ns)
{
    x->j = j;
    x->ns = ns;
    x->next = pd->fetches;
    pd->fetches = x;
    j->pfetch = x;
}

bool prefix_disk_fetch(engine *e, struct job *j)
{
    struct prefix_disk *pd = e->pd;
    uint64_t pns;
    int64_t n_mem, nb;
    uint64_t *h = pd ? prefix_chain_of(e, j, &pns, &n_mem, &nb) : NULL;
    if (!h)
        return false;
    int64_t k = n_mem;
    for (struct pfile *f;
         k < nb && (f = find(pd, false, pns, h[k])) && !f->writing && f->has_parent == (k > 0) &&
         (!k || f->parent == h[k - 1]);
         k++)
        ;
    struct prefix_fetch *x = k > n_mem ? calloc(1, sizeof(*x) + (size_t)(k - n_mem) * sizeof(x->blk[0])) : NULL;
    for (int64_t b = n_mem; x && b < k; b++) {
        char ns[24], name[24];
        names(false, pns, h[b], ns, name);
        touch(pd, find(pd, false, pns, h[b]));
        x->blk[x->n].hash = h[b];
        if (kv_disk_get_into(e->disk, ns, name, &(struct kv_disk_alloc){stage_alloc, stage_free, &pd->stage},
                             &x->blk[x->n].op) != TIER_OK)
            break;
        x->n++;
    }
    free(h);
    if (x && !x->n) {
        free(x);
        x = NULL;
    }
    if (!x)
        return false;
    fetch_link(pd, x, j, pns);
    return true;
}

bool encoder_disk_fetch(engine *e, struct job *j, uint64_t ns, const int32_t *ids, size_t n)
{
    struct prefix_disk *pd = e->pd;
    uint64_t hash = kv_store_kept_hash(ns, ids, (int64_t)n);
    struct pfile *f = pd ? find(pd, true, ns, hash) : NULL;
    if (!f || f->writing)
        return false;
    char nsb[24], name[24];
    names(true, ns, hash, nsb, name);
    struct prefix_fetch *x = calloc(1, sizeof(*x) + sizeof(x->blk[0]));
    int32_t *copy = x ? malloc(n * sizeof(*copy)) : NULL;
    if (!copy || kv_disk_get(e->disk, nsb, name, &x->blk[0].op) != TIER_OK) {
        free(copy);
        free(x);
        return false;
    }
    touch(pd, f);
    memcpy(copy, ids, n * sizeof(*copy));
    x->ids = copy;
    x->n_ids = n;
    x->n = 1;
    x->blk[0].hash = hash;
    fetch_link(pd, x, j, ns);
    return true;
}

void prefix_disk_forget_job(struct job *j)
{
    if (j->pfetch)
        j->pfetch->j = NULL;
    j->pfetch = NULL;
}

static bool fetch_done(const struct prefix_fetch *x)
{
    for (int i = 0; i < x->n; i++)
        if (!kv_disk_op_done(x->blk[i].op))
            return false;
    return true;
}

void prefix_disk_poll(engine *e)
{
    struct prefix_disk *pd = e->pd;
    if (!pd)
        return;
    reap(e, false);
    for (struct prefix_fetch **xp = &pd->fetches, *x; (x = *xp);) {
        if (!fetch_done(x)) {
            xp = &x->next;
            continue;
        }
        *xp = x->next;
        fetch_finish(e, x);
    }
    drain(e);
}

/* ---- start and exit ------------------------------------------------------ */

static bool parse_hex(const char *s, uint64_t *out)
{
    size_t n = strlen(s);
    if (n == 0 || n > 16 || strspn(s, "0123456789abcdef") != n)
        return false;
    *out = strtoull(s, NULL, 16);
    return true;
}

void prefix_disk_file(engine *e, const char *ns, const char *name, const void *meta, size_t meta_len,
                      size_t data_len)
{
    struct prefix_disk *pd = e->pd;
    if (!pd)
        return;
    bool kept = ns[0] == 'x';
    uint64_t pns, hash, parent = 0;
    char want[24], ignored[24];
    json_t *o = json_loadb(meta, meta_len, JSON_REJECT_DUPLICATES, NULL);
    json_t *par = kept ? NULL : json_object_get(o, "parent");
    const char *why = NULL;
    if (!parse_hex(ns + 1, &pns) || (names(kept, pns, 0, want, ignored), strcmp(want, ns) != 0) ||
        strlen(name) != 16 || !parse_hex(name, &hash))
        why = kept ? "not an encoder-cache entry's name" : "not a prefix block's name";
    else if (!o || json_integer_value(json_object_get(o, kept ? "kvtier_encoder" : "kvtier_prefix")) != META_FORMAT)
        why = kept ? "meta is not an encoder-cache entry of this format" : "meta is not a prefix block of this format";
    else if (par && !json_is_null(par) &&
             (!json_is_string(par) || strlen(json_string_value(par)) != 16 || !parse_hex(json_string_value(par), &parent)))
        why = "meta's parent is not a hash";
    else if (!index_add(pd, kept, pns, hash, par && !json_is_null(par), parent, data_len + meta_len))
        why = "no memory";
    json_decref(o);
    if (why)
        log_msg(LOG_WARN, "disk tier: %s/%s.kvt not listed: %s", ns, name, why);
}

void prefix_disk_open(engine *e)
{
    if ((e->cfg.no_prefix_cache && !e->enc_cache) || !(e->pd = calloc(1, sizeof(*e->pd))))
        return;
    stage_open(e, &e->pd->stage, e->enc_cache || !image_pinned(e) ? 0 : kv_store_prefix_block_bytes(e->store));
    kv_store_set_prefix_spill(e->store, QUEUE_BYTES);
}

void prefix_disk_opened(engine *e)
{
    if (e->pd)
        log_msg(LOG_INFO, "disk tier: %zu %s(s) on disk", e->pd->n_files, counted(e));
}

void prefix_disk_close(engine *e)
{
    struct prefix_disk *pd = e->pd;
    if (!pd)
        return;
    while (pd->fetches) {
        struct prefix_fetch *x = pd->fetches;
        pd->fetches = x->next;
        x->j = NULL;
        fetch_finish(e, x);
    }
    /* the blocks evicted but not written yet, then every one still cached,
     * for at most --prefix-exit-seconds: a cache is not worth a slow stop
     * (the writes in flight then still land) */
    pd->exiting = true;
    struct engine_stats st = engine_get_stats(e);
    uint64_t before = st.prefix_disk_written + st.encoder_disk_written;
    double deadline = clock_s() + e->cfg.prefix_exit_s;
    bool cut = false;
    for (;;) {
        reap(e, true);
        bool more = false;
        while (pd->put_bytes < QUEUE_BYTES && !cut) {
            struct kv_prefix_block b;
            bool got = kv_store_prefix_take_evicted(e->store, &b);
            if (!got && kv_store_prefix_export(e->store, &b, &got) != TIER_OK) {
                log_msg(LOG_WARN, "%s: not every one written at exit: %s",
                        e->enc_cache ? "encoder cache" : "prefix cache", kv_store_errmsg(e->store));
                break;
            }
            if (!got)
                break;
            if ((cut = clock_s() >= deadline)) {
                free(b.buf);
                break;
            }
            put_block(e, b, false);
            more = true;
        }
        if (!more && !pd->ops)
            break;
    }
    kv_store_set_prefix_spill(e->store, 0);
    st = engine_get_stats(e);
    uint64_t written = st.prefix_disk_written + st.encoder_disk_written - before;
    if (written)
        log_msg(LOG_INFO, "disk tier: %" PRIu64 " %s(s) written at exit", written, counted(e));
    if (cut)
        log_msg(LOG_INFO, "disk tier: %s writes at exit stopped after %d s (--prefix-exit-seconds): the %ss not "
                "written are dropped", e->enc_cache ? "encoder-cache" : "prefix-cache", e->cfg.prefix_exit_s,
                what(e->enc_cache));
    while (pd->oldest)
        index_del(pd, pd->oldest);
    free(pd->buckets);
    stage_close(&pd->stage);
    free(pd);
    e->pd = NULL;
}
