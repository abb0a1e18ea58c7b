/* state.c - the sequences of a state-space model (Mamba): per layer a
 * fixed-size state (conv window + SSM state, be_ssm_state_bytes) instead of
 * K and V, and checkpoints of it in the host tier.
 *
 * The step is a transaction as for KV: the state lives in `cur`; a step's
 * chunks read cur (the first chunk) or `next` (the later ones) and write
 * next; the commit swaps them, an abort leaves cur as it was.  Two copies
 * per sequence, whatever its length.
 *
 * Where it lives between steps: on the device (cur and next), or, when the
 * device tier ran out (at creation, or kv_seq_offload when a step did) or
 * an offloaded strategy asked for it, in the host tier (hcur).  Such a
 * state streams layer by layer as an offloaded KV layer does (stream.c):
 * each layer's state is copied into the layer's device slot while the
 * layer before computes, updated there in place (be_ssm_view allows
 * in == out) and written back to a second host copy, hnext, taken at the
 * reserve; a later chunk of the step copies in from hnext, and the commit
 * makes hnext the state (an abort drops it).  On the device it needs one
 * layer's state per slot, not the whole state twice.
 *
 * A state cannot be cut back to an earlier position the way KV blocks
 * can.  Where a chunk ends on a multiple of checkpoint_interval (the
 * forward pass cuts its chunks there), the state is copied to the host
 * tier; an abort drops the step's copies.  Crop, reuse and forks go back
 * to the nearest checkpoint at or below where they want to be (position 0
 * is the zero state), and the caller feeds the tokens from there again: at
 * most one interval.
 *
 * Shared checkpoints (the prefix cache of a state store): at a commit, a
 * sequence whose every step named its token ids (kv_seq_tokens) copies
 * its new checkpoints into a table of the store, each keyed by the chain
 * hash of the ids before it, interval by interval (seeded with the
 * namespace, as prefix.c chains blocks), and holding those ids:
 * kv_seq_match_prefix copies the deepest one whose namespace and ids equal
 * the new prompt's into a fresh sequence, so a collision can only miss.
 * An entry holds all its ids, not a parent: entries are independent and
 * any of them can go, least recently used first, within
 * kv_store_set_prefix_mem's budget or when the host tier needs room for a
 * sequence's own checkpoint.  The table is a list: a store holds few
 * states, each MiBs.
 */
#include "tiers/kvstore_impl.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "util/le.h"

struct kv_ckpt {
    int64_t pos;
    void *host; /* n_layers * state_bytes in the host tier */
};

struct kv_state {
    be_buffer *cur, *next; /* n_layers * state_bytes each, device; NULL between a host state's steps */
    void *hcur;            /* the state in the host tier, or NULL when it is on the device */
    void *hnext;           /* a host state's step: where its layers' new state goes back */
    struct kv_ckpt *ckpt;  /* ascending pos */
    int n_ckpt, cap_ckpt;
    /* shared checkpoints: q->ids holds the ids of [0, len + pending) while
     * `share`; those up to shared_to are in the table (or were evicted) */
    bool share;
    int64_t shared_to;
};

struct kv_sckpt {
    uint64_t hash, ns;
    int64_t pos;
    int32_t *tokens; /* [pos] */
    void *host;      /* n_layers * state_bytes in the host tier */
    struct kv_sckpt *older, *newer;
};

static size_t seq_state_bytes(const kv_store *s)
{
    return (size_t)s->g.n_layers * s->g.state_bytes;
}

size_t kv_store_state_bytes(const kv_store *s)
{
    return 2 * seq_state_bytes(s);
}

bool state_on_host(const kv_seq *q)
{
    return q->state->hcur != NULL;
}

/* A refusal of p on a state store, naming why the strategy does not apply
 * to a state; TIER_OK for those that do (dynamic and static: a state's
 * size is fixed either way; offloaded: it waits in the host tier). */
enum tier_status state_check_params(const struct kv_seq_params *p, char *why, size_t cap)
{
    if (p->sink)
        return why_fail(why, cap, TIER_ENOTSUP, "sink: a state-space model has no tokens to keep as sinks (its state is "
                                                "fixed in size and summarizes every token)");
    if (p->window_length)
        return why_fail(why, cap, TIER_ENOTSUP, "sliding_window (window_length): a state-space model's state already has a "
                                                "fixed size and cannot drop single old tokens");
    if (p->strategy == KV_QUANTIZED)
        return why_fail(why, cap, TIER_ENOTSUP, "quantized: the cache of a state-space model is a recurrent state, not KV; "
                                                "quantizing it would compound its error at every token");
    return TIER_OK;
}

/* Copies n bytes of a state between any two homes: a device buffer or host memory. */
static enum tier_status copy_bytes(kv_store *s, void *dst, bool dst_dev, const void *src, bool src_dev, size_t n)
{
    if (!dst_dev && !src_dev) {
        memcpy(dst, src, n);
        return TIER_OK;
    }
    enum be_status st = be_copy(s->be, dst, src, n, dst_dev ? (src_dev ? BE_D2D : BE_H2D) : BE_D2H);
    return st == BE_OK ? TIER_OK : kv_fail(s, TIER_EIO, "copying a %zu-byte state: %s", n, be_strerror(st));
}

/* Copies a whole state. */
static enum tier_status state_copy(kv_store *s, void *dst, bool dst_dev, const void *src, bool src_dev)
{
    return copy_bytes(s, dst, dst_dev, src, src_dev, seq_state_bytes(s));
}

/* The state's committed copy, wherever it lives. */
static void *cur_of(const kv_seq *q, bool *dev)
{
    *dev = !state_on_host(q);
    return *dev ? be_buffer_data(q->state->cur) : q->state->hcur;
}

/* Room in q->ids for the ids of [0, need). */
static bool ids_room(kv_seq *q, int64_t need)
{
    if (need <= q->ids_cap)
        return true;
    int64_t cap = q->ids_cap ? 2 * q->ids_cap : 4 * q->s->ckpt_interval;
    while (cap < need)
        cap *= 2;
    int32_t *ids = realloc(q->ids, (size_t)cap * sizeof(*ids));
    if (!ids)
        return false;
    q->ids = ids;
    q->ids_cap = cap;
    return true;
}

static enum tier_status state_zero(kv_seq *q)
{
    bool dev;
    void *dst = cur_of(q, &dev);
    if (!dev) {
        memset(dst, 0, seq_state_bytes(q->s));
        return TIER_OK;
    }
    void *zeros = calloc(1, seq_state_bytes(q->s));
    if (!zeros)
        return kv_fail(q->s, TIER_ENOMEM_HOST, "host memory: zeroing a state");
    enum tier_status st = state_copy(q->s, dst, true, zeros, false);
    free(zeros);
    return st;
}

static void dev_release(kv_seq *q)
{
    struct kv_state *x = q->state;
    size_t n = seq_state_bytes(q->s);
    if (x->cur)
        kv_dev_free(q->s, x->cur, n);
    if (x->next)
        kv_dev_free(q->s, x->next, n);
    x->cur = x->next = NULL;
}

static enum tier_status dev_take(kv_seq *q)
{
    size_t n = seq_state_bytes(q->s);
    enum tier_status st = kv_dev_alloc(q->s, n, "a sequence's state", &q->state->cur);
    if (st == TIER_OK)
        st = kv_dev_alloc(q->s, n, "a sequence's next state", &q->state->next);
    if (st != TIER_OK)
        dev_release(q);
    return st;
}

enum tier_status state_seq_init(kv_seq *q, bool host)
{
    q->state = calloc(1, sizeof *q->state);
    if (!q->state)
        return kv_fail(q->s, TIER_ENOMEM_HOST, "host memory: a state sequence");
    /* a loaded or forked sequence's ids are not known here */
    q->state->share = q->s->state_prefix && !q->p.no_prefix_cache && q->len == 0;
    enum tier_status st = host ? kv_host_alloc(q->s, seq_state_bytes(q->s), &q->state->hcur) : dev_take(q);
    return st == TIER_OK ? state_zero(q) : st;
}

static void ckpt_drop_from(kv_seq *q, int i)
{
    struct kv_state *x = q->state;
    for (int k = i; k < x->n_ckpt; k++)
        kv_host_free(q->s, x->ckpt[k].host, seq_state_bytes(q->s));
    if (i < x->n_ckpt)
        x->n_ckpt = i;
}

void state_seq_release(kv_seq *q)
{
    struct kv_state *x = q->state;
    if (!x)
        return;
    ckpt_drop_from(q, 0);
    free(x->ckpt);
    dev_release(q);
    if (x->hcur)
        kv_host_free(q->s, x->hcur, seq_state_bytes(q->s));
    if (x->hnext)
        kv_host_free(q->s, x->hnext, seq_state_bytes(q->s));
    free(x);
    q->state = NULL;
}

/* A host state's step takes its second host copy here; its device room
 * is the slots kv_store_step_begin plans (TIER_ENOMEM_DEV there: the
 * forward pass moves another sequence to the host tier and tries again). */
enum tier_status state_seq_reserve(kv_seq *q)
{
    q->ids_set = false;
    if (q->state->share && !ids_room(q, q->len + q->pending))
        q->state->share = false;
    return state_on_host(q) ? kv_host_alloc(q->s, seq_state_bytes(q->s), &q->state->hnext) : TIER_OK;
}

void kv_seq_state_view(const kv_seq *q, int layer, struct be_ssm_view *out)
{
    const struct kv_state *x = q->state;
    if (state_on_host(q)) { /* in its slot, updated in place */
        out->out = kv_slot_region(q->s, layer, &q->layers[layer]);
        out->in = out->out;
        return;
    }
    size_t off = (size_t)layer * q->s->g.state_bytes;
    /* the step's first chunk starts from the committed state */
    const be_buffer *in = q->chunk_from == q->len ? x->cur : x->next;
    out->in = (const char *)be_buffer_data(in) + off;
    out->out = (char *)be_buffer_data(x->next) + off;
}

static bool ckpt_room(struct kv_state *x)
{
    if (x->n_ckpt < x->cap_ckpt)
        return true;
    int cap = x->cap_ckpt ? 2 * x->cap_ckpt : 8;
    struct kv_ckpt *c = realloc(x->ckpt, (size_t)cap * sizeof *c);
    if (!c)
        return false;
    x->ckpt = c;
    x->cap_ckpt = cap;
    return true;
}

/* A copy of the state at src, at position pos, in the host tier; a
 * failure (host budget) only costs the recomputation it would have saved. */
static void ckpt_take(kv_seq *q, const void *src, bool src_dev, int64_t pos)
{
    kv_store *s = q->s;
    struct kv_state *x = q->state;
    void *host;
    if (!ckpt_room(x) || kv_host_alloc(s, seq_state_bytes(s), &host) != TIER_OK) {
        s->err[0] = '\0';
        return;
    }
    if (state_copy(s, host, false, src, src_dev) != TIER_OK) {
        s->err[0] = '\0';
        kv_host_free(s, host, seq_state_bytes(s));
        return;
    }
    x->ckpt[x->n_ckpt++] = (struct kv_ckpt){.pos = pos, .host = host};
}

/* ---- shared checkpoints (NOTES) ---------------------------------------- */

/* The chain one interval further: the ids at `ids`, seeded with h. */
static uint64_t chain_step(const kv_store *s, uint64_t h, const int32_t *ids)
{
    return XXH3_64bits_withSeed(ids, (size_t)s->ckpt_interval * sizeof(int32_t), h) & s->hash_mask;
}

static struct kv_sckpt *sc_lookup(const kv_store *s, uint64_t h, uint64_t ns, const int32_t *ids, int64_t pos)
{
    for (struct kv_sckpt *e = s->sc_new; e; e = e->older)
        if (e->hash == h && e->pos == pos && e->ns == ns && !memcmp(e->tokens, ids, (size_t)pos * sizeof(int32_t)))
            return e;
    return NULL;
}

static void sc_unlink(kv_store *s, struct kv_sckpt *e)
{
    *(e->older ? &e->older->newer : &s->sc_old) = e->newer;
    *(e->newer ? &e->newer->older : &s->sc_new) = e->older;
    e->older = e->newer = NULL;
}

static void sc_link_newest(kv_store *s, struct kv_sckpt *e)
{
    e->older = s->sc_new;
    *(s->sc_new ? &s->sc_new->newer : &s->sc_old) = e;
    s->sc_new = e;
}

bool state_shared_evict_one(kv_store *s)
{
    struct kv_sckpt *e = s->sc_old;
    if (!e)
        return false;
    sc_unlink(s, e);
    kv_host_free(s, e->host, seq_state_bytes(s));
    free(e->tokens);
    free(e);
    s->n_sckpt--;
    s->prefix_evictions++;
    return true;
}

void state_shared_fit(kv_store *s)
{
    while (s->prefix_mem && s->n_sckpt * seq_state_bytes(s) > s->prefix_mem && state_shared_evict_one(s))
        ;
}

void state_shared_release(kv_store *s)
{
    while (state_shared_evict_one(s))
        ;
}

/* Puts q's checkpoint at pos (state at `state`, host) into the table, or
 * makes the equal entry the most recently used.  Never fails: without
 * memory the entry is just not shared. */
static void sc_publish(kv_seq *q, int64_t pos, const void *state)
{
    kv_store *s = q->s;
    uint64_t h = q->p.prefix_ns;
    for (int64_t at = 0; at < pos; at += s->ckpt_interval)
        h = chain_step(s, h, q->ids + at);
    struct kv_sckpt *e = sc_lookup(s, h, q->p.prefix_ns, q->ids, pos);
    if (e) {
        sc_unlink(s, e);
        sc_link_newest(s, e);
        return;
    }
    if (!(e = calloc(1, sizeof *e)) || !(e->tokens = malloc((size_t)pos * sizeof(int32_t))) ||
        kv_host_alloc(s, seq_state_bytes(s), &e->host) != TIER_OK) {
        s->err[0] = '\0';
        if (e)
            free(e->tokens);
        free(e);
        return;
    }
    e->hash = h;
    e->ns = q->p.prefix_ns;
    e->pos = pos;
    memcpy(e->tokens, q->ids, (size_t)pos * sizeof(int32_t));
    memcpy(e->host, state, seq_state_bytes(s));
    sc_link_newest(s, e);
    s->n_sckpt++;
    state_shared_fit(s);
}

void state_seq_tokens(kv_seq *q, const int32_t *ids)
{
    if (!q->state->share || !q->pending)
        return;
    memcpy(q->ids + q->len, ids, (size_t)q->pending * sizeof(*ids));
    q->ids_set = true;
}

enum tier_status state_seq_match(kv_seq *q, const int32_t *tokens, int64_t n, int64_t *n_cached)
{
    kv_store *s = q->s;
    struct kv_state *x = q->state;
    if (!x->share)
        return TIER_OK;
    /* the deepest entry, whole intervals, never the last token: its logits
     * are needed; a shallower one may have been evicted, so all are tried */
    struct kv_sckpt *best = NULL, *e;
    uint64_t h = q->p.prefix_ns;
    for (int64_t pos = s->ckpt_interval; pos < n; pos += s->ckpt_interval) {
        h = chain_step(s, h, tokens + pos - s->ckpt_interval);
        if ((e = sc_lookup(s, h, q->p.prefix_ns, tokens, pos)))
            best = e;
    }
    if (!best)
        return TIER_OK;
    if (!ids_room(q, best->pos))
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: token ids of a %lld-token prefix", (long long)best->pos);
    bool dev;
    void *dst = cur_of(q, &dev);
    enum tier_status st = state_copy(s, dst, dev, best->host, false);
    if (st != TIER_OK)
        return st;
    memcpy(q->ids, best->tokens, (size_t)best->pos * sizeof(int32_t));
    q->len = x->shared_to = best->pos;
    /* a checkpoint of its own, so that a crop goes back here, not to 0;
     * off the list meanwhile: the host tier may evict entries for it */
    sc_unlink(s, best);
    ckpt_take(q, best->host, false, best->pos);
    sc_link_newest(s, best);
    s->prefix_hits += (uint64_t)q->len;
    *n_cached = q->len;
    return TIER_OK;
}

/* Layer l of a host state's chunk: its state in from the host (the
 * committed copy in the step's first chunk, else what the chunk before
 * wrote back), and back out to hnext; a sequence outside the chunk moves
 * nothing.  On the copy stream, in order (stream.c invariant 1). */
enum be_status state_copy_in(kv_seq *q, int layer, char *region, struct kv_xfer_stats *x)
{
    if (!q->chunk_live)
        return BE_OK;
    size_t sb = q->s->g.state_bytes;
    const char *src = q->chunk_from == q->len ? q->state->hcur : q->state->hnext;
    x->bytes_h2d += sb;
    return be_copy_async(q->s->be, region, src + (size_t)layer * sb, sb, BE_H2D);
}

enum be_status state_write_back(kv_seq *q, int layer, const char *region, struct kv_xfer_stats *x)
{
    if (!q->chunk_live)
        return BE_OK;
    size_t sb = q->s->g.state_bytes;
    x->bytes_d2h += sb;
    return be_copy_async(q->s->be, (char *)q->state->hnext + (size_t)layer * sb, region, sb, BE_D2H);
}

enum be_status state_chunk_end(kv_store *s)
{
    bool synced = false;
    for (int i = 0; i < s->n_active; i++) {
        kv_seq *q = s->active[i];
        if (!q->state || !q->chunk_live)
            continue;
        q->chunk_live = false;
        if (q->chunk_to % s->ckpt_interval)
            continue;
        if (!state_on_host(q)) {
            ckpt_take(q, be_buffer_data(q->state->next), true, q->chunk_to);
            continue;
        }
        /* the layers' write-backs to hnext land first: rare (once an
         * interval), so a drain rather than per-layer copies */
        enum be_status st = synced ? BE_OK : be_sync(s->be);
        if (st != BE_OK)
            return st;
        synced = true;
        ckpt_take(q, q->state->hnext, false, q->chunk_to);
    }
    return BE_OK;
}

enum tier_status state_seq_commit(kv_seq *q)
{
    struct kv_state *x = q->state;
    be_buffer *t = x->cur;
    x->cur = x->next;
    x->next = t;
    if (x->share && !q->ids_set) /* a step without ids: the chain is unknown from here */
        x->share = false;
    for (int i = 0; i < x->n_ckpt && x->share; i++)
        if (x->ckpt[i].pos > x->shared_to)
            sc_publish(q, x->ckpt[i].pos, x->ckpt[i].host);
    x->shared_to = q->len;
    q->ids_set = false;
    if (state_on_host(q)) { /* kv_store_step_end drained the write-backs */
        void *h = x->hcur;
        x->hcur = x->hnext;
        x->hnext = NULL;
        kv_host_free(q->s, h, seq_state_bytes(q->s));
    }
    return TIER_OK;
}

void state_seq_abort(kv_seq *q)
{
    struct kv_state *x = q->state;
    int i = x->n_ckpt;
    while (i > 0 && x->ckpt[i - 1].pos > q->len)
        i--;
    ckpt_drop_from(q, i);
    if (x->hnext)
        kv_host_free(q->s, x->hnext, seq_state_bytes(q->s));
    x->hnext = NULL;
}

enum tier_status state_seq_offload(kv_seq *q)
{
    kv_store *s = q->s;
    struct kv_state *x = q->state;
    if (state_on_host(q))
        return TIER_OK;
    enum tier_status st = kv_host_alloc(s, seq_state_bytes(s), &x->hcur);
    if (st == TIER_OK && (st = state_copy(s, x->hcur, false, be_buffer_data(x->cur), true)) != TIER_OK) {
        kv_host_free(s, x->hcur, seq_state_bytes(s));
        x->hcur = NULL;
    }
    if (st == TIER_OK)
        dev_release(q);
    return st;
}

/* Goes back to the latest checkpoint at or below len (the zero state at
 * 0); q->len is then where the state is. */
enum tier_status state_seq_rewind(kv_seq *q, int64_t len)
{
    struct kv_state *x = q->state;
    if (len >= q->len)
        return TIER_OK;
    int i = x->n_ckpt;
    while (i > 0 && x->ckpt[i - 1].pos > len)
        i--;
    bool dev;
    void *dst = cur_of(q, &dev);
    enum tier_status st = i ? state_copy(q->s, dst, dev, x->ckpt[i - 1].host, false) : state_zero(q);
    if (st != TIER_OK)
        return st;
    q->len = i ? x->ckpt[i - 1].pos : 0;
    if (x->shared_to > q->len)
        x->shared_to = q->len;
    ckpt_drop_from(q, i);
    return TIER_OK;
}

/* The child takes a state of its own (the device, else the host tier, as
 * kv_seq_create) equal to q's, and copies of q's checkpoints. */
enum tier_status state_seq_fork(const kv_seq *q, kv_seq *c)
{
    kv_store *s = q->s;
    size_t n = seq_state_bytes(s);
    enum tier_status st = state_seq_init(c, false);
    if (st == TIER_ENOMEM_DEV && !c->p.no_fallback) {
        state_seq_release(c);
        s->err[0] = '\0';
        st = state_seq_init(c, true); /* kv_seq_fork notes the fallback */
    }
    if (st != TIER_OK)
        return st;
    bool sdev, ddev;
    void *src = cur_of(q, &sdev), *dst = cur_of(c, &ddev);
    if ((st = state_copy(s, dst, ddev, src, sdev)) != TIER_OK)
        return st;
    c->copied_bytes += n;
    c->state->share = q->state->share && ids_room(c, q->len);
    if (c->state->share && q->len) /* a state cropped to nothing has no ids, nor room for them */
        memcpy(c->ids, q->ids, (size_t)q->len * sizeof(*c->ids));
    c->state->shared_to = q->state->shared_to;
    /* the child's rollbacks need the parent's checkpoints */
    for (int i = 0; i < q->state->n_ckpt; i++) {
        void *host;
        if (!ckpt_room(c->state))
            return kv_fail(s, TIER_ENOMEM_HOST, "host memory: forking a state's checkpoints");
        if ((st = kv_host_alloc(s, n, &host)) != TIER_OK)
            return st;
        memcpy(host, q->state->ckpt[i].host, n);
        c->state->ckpt[c->state->n_ckpt++] = (struct kv_ckpt){.pos = q->state->ckpt[i].pos, .host = host};
    }
    return TIER_OK;
}

void state_seq_bytes(const kv_seq *q, size_t *dev, size_t *host)
{
    size_t n = seq_state_bytes(q->s);
    *dev = (q->state->cur ? n : 0) + (q->state->next ? n : 0);
    *host = (state_on_host(q) ? n : 0) + (q->state->hnext ? n : 0) + (size_t)q->state->n_ckpt * n;
}

enum tier_status kv_seq_state_checkpoints(kv_seq *q, int *n_ckpt)
{
    *n_ckpt = 0;
    q->s->err[0] = '\0';
    if (!q->state)
        return kv_fail(q->s, TIER_EINVAL, "kv_seq_state_checkpoints: a sequence of KV, not a state");
    enum tier_status st = kv_seq_load_finish(q);
    if (st == TIER_OK)
        *n_ckpt = q->state->n_ckpt;
    return st;
}

enum tier_status kv_seq_state_read(kv_seq *q, void *dst, size_t size, int64_t *ckpt_pos, int n_ckpt)
{
    kv_store *s = q->s;
    s->err[0] = '\0';
    size_t n = seq_state_bytes(s);
    if (!q->state || q->pending || n_ckpt < 0 || size / n != 1 + (size_t)n_ckpt || size % n)
        return kv_fail(s, TIER_EINVAL, "kv_seq_state_read: %s", !q->state ? "a sequence of KV, not a state"
                                                               : q->pending ? "during a step"
                                                                            : "a buffer of another size");
    enum tier_status st = kv_seq_load_finish(q);
    if (st != TIER_OK)
        return st;
    if (n_ckpt > q->state->n_ckpt)
        return kv_fail(s, TIER_EINVAL, "kv_seq_state_read: %d checkpoints asked, %d held", n_ckpt,
                       q->state->n_ckpt);
    bool dev;
    const void *src = cur_of(q, &dev);
    st = state_copy(s, dst, false, src, dev);
    for (int i = 0; i < n_ckpt && st == TIER_OK; i++) {
        ckpt_pos[i] = q->state->ckpt[i].pos;
        memcpy((char *)dst + (1 + (size_t)i) * n, q->state->ckpt[i].host, n);
    }
    return st;
}

/* ---- images (image.c): after the header and a zero layer table, the
 * state (n_layers * state_bytes, as the layers lay it out), then each
 * checkpoint as u64 pos and its state, pos ascending. */

size_t state_image_bytes(const kv_seq *q)
{
    size_t n = seq_state_bytes(q->s);
    return n + (size_t)q->state->n_ckpt * (8 + n);
}

size_t state_image_bound(const kv_store *s, int64_t len)
{
    /* a checkpoint at every position at most: an image written under a
     * finer --checkpoint-interval than this run's still loads */
    size_t n = seq_state_bytes(s);
    return n + (size_t)(len + 1) * (8 + n);
}

enum tier_status state_seq_save(const kv_seq *q, uint8_t *p)
{
    size_t n = seq_state_bytes(q->s);
    bool dev;
    const void *src = cur_of(q, &dev);
    enum tier_status st = state_copy(q->s, p, false, src, dev);
    p += n;
    for (int i = 0; i < q->state->n_ckpt && st == TIER_OK; i++) {
        put64(p, (uint64_t)q->state->ckpt[i].pos);
        memcpy(p + 8, q->state->ckpt[i].host, n);
        p += 8 + n;
    }
    return st;
}

/* A body of size bytes: the state and *n_ckpt checkpoints (their
 * positions are checked as they load, state_fill_ckpts). */
enum tier_status state_image_check(kv_store *s, size_t size, int *n_ckpt)
{
    size_t n = seq_state_bytes(s);
    if (size < n || (size - n) % (8 + n) || (size - n) / (8 + n) > INT32_MAX)
        return kv_fail(s, TIER_EINVAL, "sequence image: a state body of %zu bytes is not a %zu-byte state and "
                                       "checkpoints of %zu bytes each (field size)", size, n, 8 + n);
    *n_ckpt = (int)((size - n) / (8 + n));
    return TIER_OK;
}

/* Layer l of a loading sequence's state (state_seq_init gave it storage),
 * from a body's state: where the state lives, the device or the host. */
enum tier_status state_fill_layer(kv_seq *q, int layer, const uint8_t *body)
{
    size_t off = (size_t)layer * q->s->g.state_bytes;
    bool dev;
    char *dst = cur_of(q, &dev);
    return copy_bytes(q->s, dst + off, dev, body + off, false, q->s->g.state_bytes);
}

/* A loading sequence takes the body's n_ckpt checkpoints, checked first:
 * positions ascending in (0, len], len its length at the load.  They go
 * before any its steps took since (those are past len). */
enum tier_status state_fill_ckpts(kv_seq *q, const uint8_t *body, int n_ckpt, int64_t len)
{
    kv_store *s = q->s;
    struct kv_state *x = q->state;
    size_t n = seq_state_bytes(s);
    const uint8_t *c = body + n;
    int64_t prev = 0;
    for (int i = 0; i < n_ckpt; i++) {
        int64_t pos = (int64_t)get64(c + (size_t)i * (8 + n));
        if (pos <= prev || pos > len)
            return kv_fail(s, TIER_EINVAL, "sequence image: checkpoint %d: field pos is %lld, not in (%lld, %lld]", i,
                           (long long)pos, (long long)prev, (long long)len);
        prev = pos;
    }
    if (!n_ckpt)
        return TIER_OK;
    if (x->n_ckpt > INT32_MAX - n_ckpt)
        return kv_fail(s, TIER_EINVAL, "sequence image: %d checkpoints and %d more", n_ckpt, x->n_ckpt);
    int total = n_ckpt + x->n_ckpt;
    struct kv_ckpt *all = malloc((size_t)total * sizeof *all);
    if (!all)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: a state's checkpoints");
    for (int i = 0; i < n_ckpt; i++) {
        const uint8_t *e = c + (size_t)i * (8 + n);
        enum tier_status st = kv_host_alloc(s, n, &all[i].host);
        if (st != TIER_OK) {
            while (i--)
                kv_host_free(s, all[i].host, n);
            free(all);
            return st;
        }
        all[i].pos = (int64_t)get64(e);
        memcpy(all[i].host, e + 8, n);
    }
    if (x->n_ckpt)
        memcpy(all + n_ckpt, x->ckpt, (size_t)x->n_ckpt * sizeof *all);
    free(x->ckpt);
    x->ckpt = all;
    x->n_ckpt = x->cap_ckpt = total;
    return TIER_OK;
}
