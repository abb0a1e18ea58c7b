/* prefix_remote.c - the prefix cache's blocks on the remote tier
 * (docs/remote.md): blocks a request computes are published as its
 * prefill completes them, and a prompt whose chain goes on past what
 * memory (and the disk) holds asks the remote tier for the rest before
 * it starts.
 *
 * Reading is the disk's path: at admission, after the disk tier's blocks
 * are in, the job waits (io_wait, j->rfetch) while the lookup thread
 * fetches and checks the chain's next blocks; they are inserted in chain
 * order as each batch of them arrives (while the lookup thread reads the
 * next), up to the first one the store refuses, then the job starts and
 * kv_seq_match_prefix attaches them.  Every failure is a miss: the rest
 * of the prompt is computed.  Publishing: after each prefill chunk the
 * job's prompt up to its last whole block is kept (its ids), and the
 * blocks not shipped before are serialized (kv_store_prefix_ship) as the
 * publish queue has room, a few per loop iteration (the publish thread
 * wakes the loop after each batch), so a long prompt is neither dropped
 * past the queue's bound nor serialized all at once, and a second daemon
 * can find a long prompt's first blocks while the first still computes
 * the rest; a block evicted meanwhile is not published.  The network is
 * the publish thread's.  Everything here runs on the engine thread.
 *
 * An encoder-decoder model shares no prefix blocks but whole cross-
 * attention caches (the encoder cache, docs/encdec.md): one value per
 * input, under the hash the store keys it by (kv_store_kept_hash of the
 * uid's namespace and the ids), published once the encoder computed it,
 * and looked up at admission when the input is in no memory; the job
 * waits as for blocks.  The value holds the ids with the cache's image,
 * and a value whose namespace or ids are not exactly the input's is a
 * miss: a collision of the key's hash never loads another input's cache.
 * The value, inside the remote tier's container, is the store's image of
 * a kept sequence (kv_store_kept_image, tiers/keep.c "FORMAT"): its key,
 * then the cross cache.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine_impl.h"
#include "util/log.h"

/* memory a lookup fills (its arenas, the store's blocks) faulted in at
 * start rather than by the first lookups: a 2.8k-token prefix of the
 * TinyLlama-1.1B shape */
#define WARM_BYTES ((size_t)64 << 20)
/* prompts kept for publishing; past this the oldest is given up */
#define MAX_PENDING 64
/* blocks serialized per call of pump: bounds the copies a loop iteration makes */
#define SHIP_BATCH 16

struct remote_pub {
    struct kv_seq_params p;
    const struct job *j; /* the job whose prompt it is; NULL once it retired */
    int32_t *tokens;     /* its whole blocks */
    int64_t n_blocks;
    struct remote_pub *next;
};

struct remote_fetch {
    struct job *j; /* NULL once the job retired */
    kv_remote_fetch *f;
    int taken;     /* blocks inserted (or given up) so far */
    int got;       /* of which inserted */
    bool stopped;  /* a block was not inserted: the rest is a miss */
    bool refused;  /* one that checked as a container but not as a block of its chain */
    /* a cross cache's lookup (encoder_remote_fetch): its input */
    bool cross;
    uint64_t ns;
    int32_t *ids;
    size_t n_ids;
    struct remote_fetch *next;
};

static void notify(void *arg)
{
    engine_io_notify(arg);
}

void prefix_remote_open(engine *e)
{
    const struct engine_config *c = &e->cfg;
    if (!c->remote_url && !c->remote_cluster)
        return;
    if (c->no_prefix_cache && !e->enc_cache) {
        log_msg(LOG_WARN, "remote tier not used: it holds prefix-cache blocks%s and --no-prefix-cache is set",
                e->ed ? " (an encoder-decoder model's: cross-attention caches)" : "");
        return;
    }
    struct kv_remote_params p = {.url = c->remote_url,
                                 .cluster = c->remote_cluster,
                                 .user = c->remote_user,
                                 .password = c->remote_password,
                                 .timeout_ms = c->remote_timeout_ms,
                                 .ttl_s = c->remote_ttl_s,
                                 .compress = c->remote_compress,
                                 .warm_bytes = WARM_BYTES,
                                 .block_bytes = kv_store_prefix_block_bytes(e->store),
                                 .layout = engine_kv_layout(e),
                                 .variant = c->weights == MODEL_WEIGHTS_Q8_0   ? "q8_0"
                                            : c->weights == MODEL_WEIGHTS_Q4_K ? "q4_k"
                                                                               : "w",
                                 .notify = notify,
                                 .notify_arg = e};
    char err[256];
    enum tier_status ts = kv_remote_open(&p, &e->remote, err);
    if (ts != TIER_OK) {
        log_msg(LOG_ERR, "remote tier not used: %s", err[0] ? err : tier_strerror(ts));
        return;
    }
    kv_store_pool_warm(e->store, WARM_BYTES);
    log_msg(LOG_INFO, "remote tier %s: timeout %d ms, TTL %d s, values %s, publishing %s",
            c->remote_url ? c->remote_url : c->remote_cluster, c->remote_timeout_ms, c->remote_ttl_s,
            c->remote_compress ? "zstd-compressed" : "raw",
            c->remote_share == REMOTE_SHARE_OFF           ? "off (read only)"
            : c->remote_share == REMOTE_SHARE_PREFIX_ONLY ? "the blocks before a chat's first user message"
                                                          : "every prompt block");
}

/* Inserts a lookup's blocks [x->taken, ready) in chain order, up to the
 * first one the store refuses: the blocks a batch brought are inserted
 * while the lookup thread reads the next one. */
static void fetch_take(engine *e, struct remote_fetch *x, int ready)
{
    if (x->cross) /* one value, taken at the end */
        return;
    for (; !x->stopped && x->taken < ready; x->taken++) {
        const void *data;
        size_t n;
        kv_remote_fetch_block(x->f, x->taken, &data, &n);
        enum tier_status ts = kv_store_prefix_insert(e->store, data, n);
        if (ts == TIER_OK) {
            x->got++;
            continue;
        }
        x->stopped = true;
        /* a value that checked as a container but not as a block of this
         * chain is one somebody wrote on purpose or by a bug: say so (a
         * parent evicted in between is TIER_ECONFLICT, no fault of it) */
        x->refused = ts == TIER_EINVAL;
        log_msg(x->refused ? LOG_WARN : LOG_DEBUG,
                "remote tier: a block not used, the chain is a miss from there on: %s",
                kv_store_errmsg(e->store)[0] ? kv_store_errmsg(e->store) : tier_strerror(ts));
    }
}

/* A cross cache's value, checked against the input looked up, into the
 * encoder cache; its job (if it still waits) takes the reference.  Every
 * failure is a miss: the job encodes. */
static void cross_take(engine *e, struct remote_fetch *x)
{
    if (kv_remote_fetch_found(x->f) < 1)
        return;
    const void *p;
    size_t len;
    kv_remote_fetch_block(x->f, 0, &p, &len);
    kv_kept *k;
    enum tier_status ts = kv_store_kept_insert(e->store, p, len, x->ns, x->ids, (int64_t)x->n_ids, false, &k);
    if (ts != TIER_OK) {
        x->refused = ts == TIER_EINVAL || ts == TIER_ECONFLICT;
        log_msg(x->refused ? LOG_WARN : LOG_DEBUG, "remote tier: a cross-attention cache not used: %s",
                kv_store_errmsg(e->store));
        return;
    }
    x->got = 1;
    if (x->j)
        x->j->cross_kept = k;
    else
        kv_kept_unref(k);
}

/* Takes a finished lookup's last blocks, then starts its job. */
static void fetch_finish(engine *e, struct remote_fetch *x)
{
    if (x->cross)
        cross_take(e, x);
    else
        fetch_take(e, x, kv_remote_fetch_found(x->f));
    kv_remote_fetch_free(x->f);
    free(x->ids);
    pthread_mutex_lock(&e->mu);
    e->st.remote_hits += x->got > 0;
    e->st.remote_refused += x->refused;
    pthread_mutex_unlock(&e->mu);
    struct job *j = x->j;
    free(x);
    if (!j)
        return;
    j->rfetch = NULL;
    resume_job(e, j);
}

bool prefix_remote_fetch(engine *e, struct job *j)
{
    uint64_t pns;
    int64_t n_mem, nb;
    uint64_t *h = e->remote ? prefix_chain_of(e, j, &pns, &n_mem, &nb) : NULL;
    if (!h)
        return false;
    struct remote_fetch *x = nb > n_mem && nb - n_mem <= INT32_MAX ? calloc(1, sizeof(*x)) : NULL;
    if (x && kv_remote_fetch_start(e->remote, pns, h + n_mem, (int)(nb - n_mem), &x->f) != TIER_OK) {
        free(x);
        x = NULL;
    }
    free(h);
    if (!x)
        return false;
    x->j = j;
    x->next = e->rfetches;
    e->rfetches = x;
    j->rfetch = x;
    return true;
}

bool encoder_remote_fetch(engine *e, struct job *j, uint64_t ns, const int32_t *ids, size_t n)
{
    if (!e->remote || !n)
        return false;
    size_t max = kv_store_kept_image_bound(e->store, (int64_t)n);
    struct remote_fetch *x = calloc(1, sizeof(*x));
    int32_t *copy = x ? malloc(n * sizeof(*copy)) : NULL;
    if (!copy || kv_remote_fetch_seq_start(e->remote, ns, kv_store_kept_hash(ns, ids, (int64_t)n), max, &x->f) !=
                     TIER_OK) {
        free(copy);
        free(x);
        return false;
    }
    memcpy(copy, ids, n * sizeof(*copy));
    *x = (struct remote_fetch){.j = j, .f = x->f, .cross = true, .ns = ns, .ids = copy, .n_ids = n,
                               .next = e->rfetches};
    e->rfetches = x;
    j->rfetch = x;
    return true;
}

void encoder_remote_publish(engine *e, const struct job *j, uint64_t ns, const int32_t *ids, size_t n, kv_seq *q)
{
    if (!e->remote || e->cfg.remote_share == REMOTE_SHARE_OFF || !j->remote_shareable)
        return;
    struct kv_prefix_block b;
    if (kv_store_kept_image(q, ns, ids, (int64_t)n, &b) != TIER_OK) {
        log_msg(LOG_DEBUG, "remote tier: a cross-attention cache not published: %s", kv_store_errmsg(e->store));
        return;
    }
    kv_remote_publish_seq(e->remote, ns, b.hash, b.buf, b.len);
}

void prefix_remote_forget_job(engine *e, struct job *j)
{
    if (j->rfetch)
        j->rfetch->j = NULL;
    j->rfetch = NULL;
    for (struct remote_pub *x = e->rpubs; x; x = x->next)
        if (x->j == j)
            x->j = NULL;
}


static void pub_pop(engine *e)
{
    struct remote_pub *x = e->rpubs;
    e->rpubs = x->next;
    e->n_rpubs--;
    free(x->tokens);
    free(x);
}

/* Serializes and queues the kept prompts' blocks while the queue has room,
 * at most SHIP_BATCH per call: each call is a step's worth of copies at
 * most, and the publish thread's notification after each batch it sends
 * brings the next. */
static void pump(engine *e)
{
    int64_t budget = SHIP_BATCH;
    while (e->rpubs && budget > 0) {
        struct remote_pub *x = e->rpubs;
        size_t room = kv_remote_publish_room(e->remote);
        size_t fit = e->rblk_len ? room / e->rblk_len : 1; /* one first, to learn the size */
        if (!fit)
            return;
        struct kv_prefix_block b[SHIP_BATCH];
        int64_t got = 0;
        bool done = true;
        enum tier_status ts = kv_store_prefix_ship(e->store, &x->p, x->tokens, x->n_blocks, b,
                                                   fit < (size_t)budget ? (int64_t)fit : budget, &got, &done);
        if (ts != TIER_OK)
            log_msg(LOG_DEBUG, "remote tier: blocks not published: %s", kv_store_errmsg(e->store));
        for (int64_t i = 0; i < got; i++) {
            e->rblk_len = b[i].len;
            kv_remote_publish(e->remote, &b[i]);
        }
        budget -= got;
        /* a job still computing its prompt hands over a new entry for its next blocks */
        if (done || ts != TIER_OK)
            pub_pop(e);
    }
}

void prefix_remote_publish(engine *e, struct job *j, size_t n_done)
{
    if (!e->remote || e->cfg.remote_share == REMOTE_SHARE_OFF || (j->kind != JOB_GENERATE && j->kind != JOB_PREFILL))
        return;
    size_t n = n_done < j->n_prompt ? n_done : j->n_prompt;
    n = n < j->remote_shareable ? n : j->remote_shareable;
    size_t bt = (size_t)kv_store_block_tokens(e->store);
    int64_t nb = (int64_t)(n / bt);
    if (nb <= j->rpub_blocks)
        return;
    /* j's entry still waiting grows; otherwise a new one walks the chain
     * from its start, skipping the blocks shipped before */
    struct remote_pub *x = NULL, **tail = &e->rpubs;
    for (; *tail; tail = &(*tail)->next)
        if ((*tail)->j == j)
            x = *tail;
    int32_t *tokens = realloc(x ? x->tokens : NULL, (size_t)nb * bt * sizeof(*tokens));
    if (!tokens)
        return;
    if (!x && !(x = calloc(1, sizeof(*x)))) {
        free(tokens);
        return;
    }
    x->tokens = tokens;
    memcpy(x->tokens, j->prompt, (size_t)nb * bt * sizeof(*x->tokens));
    x->n_blocks = nb;
    j->rpub_blocks = nb;
    if (!x->j) {
        x->j = j;
        x->p = j->cache.params;
        x->p.prefix_ns = prefix_ns_of(e, j->uid);
        *tail = x;
        if (++e->n_rpubs > MAX_PENDING)
            pub_pop(e);
    }
    pump(e);
}

void prefix_remote_poll(engine *e)
{
    if (e->rpubs)
        pump(e);
    for (struct remote_fetch **xp = &e->rfetches, *x; (x = *xp);) {
        bool done;
        int ready = kv_remote_fetch_ready(x->f, &done);
        if (!done) {
            fetch_take(e, x, ready);
            xp = &x->next;
            continue;
        }
        *xp = x->next;
        fetch_finish(e, x);
    }
}

void prefix_remote_close(engine *e)
{
    while (e->rfetches) {
        struct remote_fetch *x = e->rfetches;
        e->rfetches = x->next;
        x->j = NULL;
        kv_remote_fetch_wait(x->f);
        fetch_finish(e, x);
    }
    while (e->rpubs)
        pub_pop(e);
    pthread_mutex_lock(&e->mu);
    kv_remote *r = e->remote;
    e->remote = NULL;
    pthread_mutex_unlock(&e->mu);
    kv_remote_free(r);
}
