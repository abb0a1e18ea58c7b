/* engine.c - the inference thread (see engine.h): job submission and
 * cancellation from the loop thread, admission, the batched step and its
 * failure handling, retirement, model loading and the thread's life.  The
 * session table and the operations on a session are in sessions.c; the
 * structures both files use are in engine_impl.h.
 */
#include "daemon/engine_impl.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util/log.h"
#include "util/args.h"
#include "util/clock.h"

/* Upper bounds (seconds) of the /metrics histograms (docs/operations.md).
 * Per request (queue wait, time to first token): 0.5 ms, a tiny model on a
 * GPU with an empty queue, to 2 min, a long prompt on two CPU cores behind
 * a queue.  Per token (inter-token, prefill and decode time per token):
 * 10 us, a batched prefill on a GPU, to 2.5 s, a large model decoding on a
 * busy CPU.  About three buckets per decade (1, 2.5, 5). */
static const double LATENCY_BOUNDS[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                        0.5,    1,     2.5,    5,     10,   25,    60,   120};
static const double TOKEN_BOUNDS[] = {0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                      0.01,    0.025,    0.05,    0.1,    0.25,    0.5,    1,     2.5};
#define N_BOUNDS(b) ((int)(sizeof(b) / sizeof((b)[0])))

static void wake(engine *e)
{
    uint64_t one = 1;
    /* a full eventfd counter still wakes the loop, so EAGAIN is harmless */
    if (write(e->wake_fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
        log_msg(LOG_WARN, "engine: wake-up write failed: %s", strerror(errno));
}

struct job *job_new(int n, const char *const *stops, int n_stops)
{
    struct job *j = calloc(1, sizeof(*j) + (size_t)n * sizeof(j->ch[0]));
    if (!j)
        return NULL;
    j->n = n;
    j->n_out = n;
    j->refs = 1;
    size_t total = 0;
    for (int i = 0; i < n_stops; i++)
        total += strlen(stops[i]) + 1;
    if (n_stops) {
        j->stop_buf = malloc(total);
        if (!j->stop_buf) {
            free(j);
            return NULL;
        }
        char *p = j->stop_buf;
        for (int i = 0; i < n_stops; i++) {
            size_t l = strlen(stops[i]) + 1;
            memcpy(p, stops[i], l);
            j->stops[i] = p;
            p += l;
        }
        j->n_stops = n_stops;
    }
    return j;
}

static void job_free(struct job *j)
{
    for (int i = 0; i < j->n; i++) {
        gen_seq_free(&j->ch[i].seq);
        free(j->ch[i].lps);
    }
    beam_free(j->bs);
    gram_free(j->grammar);
    free(j->prompt);
    free(j->input);
    free(j->stop_buf);
    kvfile_release(&j->kvf);
    free(j->blob);
    free(j->res.blob);
    free(j);
}

/* Drops one reference; the caller holds mu. */
static void job_unref_locked(struct job *j)
{
    if (--j->refs == 0)
        job_free(j);
}

void *job_take_blob(struct job *j, size_t *n)
{
    void *b = j->res.blob;
    *n = j->res.n_blob;
    j->res.blob = NULL;
    j->res.n_blob = 0;
    return b;
}

void job_release(engine *e, struct job *j)
{
    if (!j)
        return;
    pthread_mutex_lock(&e->mu);
    job_unref_locked(j);
    pthread_mutex_unlock(&e->mu);
}

void engine_lock(engine *e)
{
    pthread_mutex_lock(&e->mu);
}

void engine_unlock(engine *e)
{
    pthread_mutex_unlock(&e->mu);
}

/* ---- submission and cancellation (loop thread) ------------------------------ */

enum ipc_status engine_submit(engine *e, struct job *j, struct ipc_error *err)
{
    enum ipc_status st = IPC_OK;
    pthread_mutex_lock(&e->mu);
    if (e->draining)
        st = ipc_fail(err, IPC_EUNAVAIL, "", "kvtierd is shutting down");
    else if (e->n_queued >= e->cfg.max_queue)
        st = ipc_fail(err, IPC_EBUSY, "", "too many requests waiting (%d queued; --max-queue)", e->n_queued);
    else if (j->session_id[0]) {
        struct session *s;
        st = session_get(e, j->uid, j->session_id, &s, err);
        if (st == IPC_OK && s->busy)
            st = ipc_fail(err, IPC_ECONFLICT, "session", "session \"%s\" is busy with another request", s->id);
        if (st == IPC_OK) {
            s->busy = true;
            j->sess = s;
            j->cache = s->cache;
            if (s->private_kv)
                j->remote_shareable = 0;
        }
    }
    if (st == IPC_OK) {
        j->refs++;
        j->t_submit = clock_ms();
        j->next = NULL;
        j->order = ++e->order;
        *e->queue_tail = j;
        e->queue_tail = &j->next;
        e->n_queued++;
        e->st.requests++;
        pthread_cond_signal(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

void engine_cancel_locked(engine *e, struct job *j)
{
    if (!j->done) {
        j->cancelled = true;
        pthread_cond_signal(&e->cv);
    }
}

void engine_cancel(engine *e, struct job *j)
{
    pthread_mutex_lock(&e->mu);
    engine_cancel_locked(e, j);
    pthread_mutex_unlock(&e->mu);
}

bool job_done_locked(const struct job *j)
{
    return j->done;
}

bool job_done(engine *e, const struct job *j)
{
    pthread_mutex_lock(&e->mu);
    bool done = j->done;
    pthread_mutex_unlock(&e->mu);
    return done;
}

struct job_progress job_progress(const struct job *j, int i)
{
    const struct job_choice *c = &j->ch[i];
    return (struct job_progress){c->seq.text, c->n_text, c->n_gen, c->seq.toks, c->lps, c->finish, c->score};
}

const struct job_result *job_result(const struct job *j)
{
    return &j->res;
}

void engine_drain(engine *e)
{
    pthread_mutex_lock(&e->mu);
    e->draining = true;
    pthread_mutex_unlock(&e->mu);
}

int engine_pending(engine *e)
{
    pthread_mutex_lock(&e->mu);
    int n = e->n_queued;
    for (struct job *j = e->active; j; j = j->next)
        n++;
    pthread_mutex_unlock(&e->mu);
    return n;
}

void engine_abort_all(engine *e, enum ipc_status st, const char *msg)
{
    pthread_mutex_lock(&e->mu);
    for (struct job *j = e->active; j; j = j->next)
        if (j->res.err.st == IPC_OK)
            ipc_fail(&j->res.err, st, "", "%s", msg);
    for (struct job *j = e->queue; j; j = j->next)
        if (j->res.err.st == IPC_OK)
            ipc_fail(&j->res.err, st, "", "%s", msg);
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

struct engine_stats engine_get_stats(engine *e)
{
    pthread_mutex_lock(&e->mu);
    struct engine_stats s = e->st;
    s.queued = e->n_queued;
    s.running = e->active_seqs;
    s.sessions = e->n_sessions;
    /* under mu: the engine thread clears it under mu before closing it */
    s.remote_on = e->remote != NULL;
    if (e->remote)
        s.remote = kv_remote_stats(e->remote);
    /* read now: removals run on the disk thread and tell the engine nothing */
    if (e->disk)
        s.disk = kv_disk_stats(e->disk);
    pthread_mutex_unlock(&e->mu);
    return s;
}

const struct engine_hists *engine_hists(const engine *e)
{
    return &e->hists;
}

void engine_count_error(engine *e, enum ipc_status st)
{
    pthread_mutex_lock(&e->mu);
    if ((unsigned)st < sizeof(e->st.errors) / sizeof(e->st.errors[0]))
        e->st.errors[st]++;
    pthread_mutex_unlock(&e->mu);
}

/* ---- admission and retirement (engine thread) --------------------------------- */

/* The store's refusal as a client error; kv_store_errmsg names the budget,
 * the parameter or (409) the reference's explanation.  param: the request
 * field the call came from. */
enum ipc_status kv_error(engine *e, enum tier_status ts, const char *param, struct ipc_error *err)
{
    return tier_error(ts, param, kv_store_errmsg(e->store), err);
}

enum ipc_status tier_error(enum tier_status ts, const char *param, const char *why, struct ipc_error *err)
{
    if (!why[0])
        why = tier_strerror(ts);
    switch (ts) {
    case TIER_EINVAL: return ipc_fail(err, IPC_EINVAL, param, "%s", why);
    case TIER_ENOTSUP: return ipc_fail(err, IPC_ENOTIMPL, param, "%s", why); /* not the client's mistake */
    case TIER_ECONFLICT: return ipc_fail(err, IPC_ECONFLICT, param, "%s", why);
    case TIER_ENOMEM_DEV:
    case TIER_ENOMEM_HOST: return ipc_fail(err, IPC_ESTORAGE, "", "%s", why);
    default: return ipc_fail(err, IPC_EINTERNAL, "", "KV store: %s", why);
    }
}

uint64_t prefix_ns_of(const engine *e, uid_t uid)
{
    /* each uid its own prefix namespace (uid + 1: 0 is the shared one), so
     * that cached_tokens and timing tell nobody what another user sent */
    return e->cfg.share_prefix_cache ? 0 : (uint64_t)uid + 1;
}

uint64_t *prefix_chain_of(engine *e, const struct job *j, uint64_t *ns, int64_t *n_mem, int64_t *n_blocks)
{
    if (j->n_prompt < 2 || (j->sess && j->sess->kv))
        return NULL;
    struct kv_seq_params p = j->cache.params;
    p.prefix_ns = *ns = prefix_ns_of(e, j->uid);
    size_t bt = (size_t)kv_store_block_tokens(e->store);
    uint64_t *h = malloc(((j->n_prompt - 1) / bt + 1) * sizeof(*h));
    if (h)
        *n_blocks = kv_store_prefix_chain(e->store, &p, j->prompt, (int64_t)j->n_prompt, h, n_mem);
    return h;
}

/* A new KV sequence for ids[0, n): the strategy, past recording when the
 * session asks for it, and the prefix cache's blocks for the start of ids
 * (*n_cached tokens that need not be computed). */
static enum ipc_status kv_open(engine *e, const struct kv_seq_params *p, uid_t uid, bool record, const int32_t *ids,
                               size_t n, kv_seq **out, size_t *n_cached, struct ipc_error *err)
{
    int64_t cached = 0;
    const char *param = "cache";
    struct kv_seq_params ps = *p;
    ps.prefix_ns = prefix_ns_of(e, uid);
    enum tier_status ts = kv_seq_create(e->store, &ps, out);
    if (ts == TIER_OK && record) {
        param = "activate_past_recording";
        ts = kv_seq_activate_past_recording(*out);
    }
    if (ts == TIER_OK)
        ts = kv_seq_match_prefix(*out, ids, (int64_t)n, &cached); /* fails only for host memory */
    char cache_param[IPC_PARAM_LEN];
    if (ts != TIER_OK && !strcmp(param, "cache")) {
        ipc_cache_param_of(kv_store_errmsg(e->store), cache_param);
        param = cache_param;
    }
    if (ts != TIER_OK) {
        kv_seq_free(*out);
        *out = NULL;
        return kv_error(e, ts, param, err);
    }
    *n_cached = (size_t)cached;
    return IPC_OK;
}

/* Whether the choices of j share one prefill of the prompt: choice 0
 * computes it, the others fork its KV (a quantized cache cannot fork;
 * without a cache every step recomputes everything anyway). */
static bool shares_prefill(const struct job *j)
{
    return j->n > 1 && !j->sess && j->kind == JOB_GENERATE && j->cache.use_cache &&
           j->cache.params.strategy != KV_QUANTIZED;
}

/* A sink session's conversation past the context (the only prompt that
 * long the request checks let through) goes on only from the KV that holds
 * its start: computed afresh, its positions would pass the context. */
#define SINK_PAST "; a sink session goes past it only with a prompt that extends the tokens it holds"

/* A fresh KV for j's session to compute in (prefix-cache blocks for the
 * start of j's prompt: c->n_fed tokens need not be computed). */
static enum ipc_status session_kv_fresh(engine *e, struct job *j, struct job_choice *c, struct ipc_error *err)
{
    if (j->n_prompt >= (size_t)e->ctx)
        return ipc_fail(err, IPC_ECONTEXT, "prompt", "the prompt has %zu tokens; the context holds %d, and the "
                        "session's KV no longer holds the prompt's start (it departs before the last eviction, "
                        "or the KV was lost)" SINK_PAST, j->n_prompt, e->ctx);
    struct session *s = j->sess;
    kv_seq *q = NULL;
    enum ipc_status st = kv_open(e, &s->cache.params, s->uid, s->record, j->prompt, j->n_prompt, &q, &c->n_fed, err);
    c->kv = j->skv = q;
    return st;
}

/* The KV j's session computes in (j->skv, which the session takes at
 * retire), reused as far as the session's KV is a real prefix of the new
 * input (HF checks only the length): an edited turn rewinds it.  The
 * rewind happens on a fork when that shares the KV and the device has
 * room for what the request writes beside the session's old tail, so a
 * request that fails leaves the session as it was.  Otherwise (a cache
 * whose fork would copy it, static or offloaded; a device too full to
 * keep the tail) it rewinds in place, freeing the tail, as memory comes
 * first.  A sliding layer that already dropped the states to rewind to
 * without past recording, or a cache that cannot rewind, starts over in
 * a fresh KV beside the session's (prefix-cache blocks for the start of
 * j's prompt). */
static enum ipc_status session_kv_setup(engine *e, struct job *j, struct job_choice *c, struct ipc_error *err)
{
    const struct session *s = j->sess;
    kv_seq *q = s->kv, *fork = NULL;
    int64_t n = (int64_t)j->n_prompt, keep = q ? kv_seq_common(q, s->toks, j->prompt, n) : 0;
    if (n >= e->ctx && n - keep >= e->ctx)
        return ipc_fail(err, IPC_ECONTEXT, "prompt", "the prompt has %lld tokens, %lld of them new; the context holds "
                        "%d" SINK_PAST, (long long)n, (long long)(n - keep), e->ctx);
    if (q && keep < kv_seq_length(q) && kv_seq_fork_fits(q, keep, n - keep + j->max_new))
        q = kv_seq_fork(q, &fork) == TIER_OK ? fork : q; /* without host memory for it: in place */
    if (q && kv_seq_reuse(q, s->toks, j->prompt, n, &keep) != TIER_OK) {
        log_msg(LOG_DEBUG, "session %s: recomputed from the start: %s", s->id, kv_store_errmsg(e->store));
        kv_seq_free(fork);
        q = NULL;
    }
    c->n_fed = (size_t)keep;
    c->kv = j->skv = q;
    return q ? IPC_OK : session_kv_fresh(e, j, c, err);
}

static enum ipc_status seq_setup(engine *e, struct job *j, struct job_choice *c, int idx, struct ipc_error *err)
{
    if (j->logprobs && !(c->lps = malloc((size_t)j->max_new * (size_t)(1 + j->top_logprobs) * sizeof(*c->lps))))
        return ipc_fail(err, IPC_ENOMEM, "", "no host memory for the request's buffers");
    struct gen_seq_params gp = {.sampling = j->sampling,
                                .max_new = j->max_new,
                                /* positions of a sink cache stay inside its window */
                                .ctx = j->cache.params.sink ? INT_MAX : e->ctx,
                                .ignore_eos = j->ignore_eos,
                                .min_new = j->min_new,
                                .stops = j->stops,
                                .n_stops = j->n_stops,
                                .text_lock = &e->mu,
                                .grammar = j->grammar,
                                .gvocab = j->grammar ? e->gvocab : NULL};
    gp.sampling.seed += (uint64_t)idx; /* the n choices of one request differ */
    enum model_status ms = gen_seq_init(&c->seq, e->mc, e->tok, &gp, j->prompt, j->n_prompt);
    if (ms == MODEL_EINVAL) /* the parser's ranges make this a bug, still the client's 400 */
        return ipc_fail(err, IPC_EINVAL, "", "invalid sampling parameters");
    if (ms != MODEL_OK)
        return ipc_fail(err, IPC_ENOMEM, "", "no host memory for the request's buffers");
    struct session *s = j->sess;
    if (idx > 0 && (j->bs || shares_prefill(j)))
        return IPC_OK; /* its KV comes from choice 0 (share_prefill, beam_reorder) */
    if (!s) {
        /* A one-shot request knows its final length: sized up front, one
         * that cannot fit the device starts offloaded instead of failing
         * part-way (the store only checks, it reserves nothing). */
        struct kv_seq_params p = j->cache.params;
        /* Choices sharing the prompt's KV need it once, and each its own
         * blocks for what it generates (the partly filled one copied). */
        int64_t own = (int64_t)j->max_new + (shares_prefill(j) ? kv_store_block_tokens(e->store) : 0);
        if (p.strategy == KV_DYNAMIC && !p.max_cache_len)
            p.max_cache_len = (int64_t)j->n_prompt + (shares_prefill(j) ? j->n : 1) * own;
        return kv_open(e, &p, j->uid, false, j->prompt, j->n_prompt, &c->kv, &c->n_fed, err);
    }
    return session_kv_setup(e, j, c, err);
}

/* What the response's kvtier object reports: choice 0's strategy and layer
 * split, any choice's fallback, bytes and transfers summed. */
static void add_kv_stats(struct kv_seq_stats *sum, const kv_seq *q, bool first)
{
    struct kv_seq_stats k = kv_seq_stats(q);
    if (first) {
        *sum = k;
        return;
    }
    if (k.fallback > sum->fallback)
        sum->fallback = k.fallback;
    sum->dev_bytes += k.dev_bytes;
    sum->host_bytes += k.host_bytes;
    struct kv_xfer_stats *x = &sum->xfer;
    x->steps += k.xfer.steps;
    x->tokens += k.xfer.tokens;
    x->bytes_h2d += k.xfer.bytes_h2d;
    x->bytes_d2h += k.xfer.bytes_d2h;
    x->transfer_s += k.xfer.transfer_s;
    x->stall_s += k.xfer.stall_s;
    x->compute_s += k.xfer.compute_s;
    sum->copied_bytes += k.copied_bytes;
}

/* best_of: the n_out choices with the highest logprob sums go first, in
 * that order (ties: the earlier choice); the others are not returned. */
static void rank_choices(struct job *j)
{
    for (int i = 0; i < j->n_out; i++) {
        int best = i;
        for (int k = i + 1; k < j->n; k++)
            if (j->ch[k].lp_sum > j->ch[best].lp_sum)
                best = k;
        if (best != i) {
            struct job_choice t = j->ch[best];
            memmove(&j->ch[i + 1], &j->ch[i], (size_t)(best - i) * sizeof(t));
            j->ch[i] = t;
        }
    }
}

static void publish(engine *e, int nb);

/* A finished job's prefill and decode time per token (caller holds mu,
 * which keeps its result still). */
static void observe_request(engine *e, const struct job *j)
{
    if (j->res.err.st != IPC_OK || j->cancelled || (j->kind != JOB_GENERATE && j->kind != JOB_PREFILL))
        return;
    int cached = j->res.n_cached;
    if (cached >= 0 && (size_t)cached < j->n_prompt && j->res.prefill_ms > 0)
        hist_observe(&e->hists.prefill_token, j->res.prefill_ms / 1e3 / (double)(j->n_prompt - (size_t)cached));
    int n_gen = 0;
    for (int i = 0; i < j->n; i++)
        n_gen = j->ch[i].seq.gen > n_gen ? j->ch[i].seq.gen : n_gen;
    if (n_gen > 1 && j->t_first > 0)
        hist_observe(&e->hists.decode_token, j->res.decode_ms / 1e3 / (n_gen - 1));
}

/* Frees what the engine owns of a finished job and hands a session its KV
 * back.  Then publishes done and drops the engine's reference (caller holds
 * no lock). */
static void retire(engine *e, struct job *j)
{
    prefix_disk_forget_job(j);
    /* normally handed over chunk by chunk (advance): this catches a
     * prompt computed some other way */
    if (j->ch[0].kv && j->res.err.st == IPC_OK && !j->kill)
        prefix_remote_publish(e, j, j->n_prompt);
    prefix_remote_forget_job(e, j);
    struct kv_seq_stats kvs = {0};
    bool any = false;
    for (int i = 0; i < j->n; i++) {
        struct job_choice *c = &j->ch[i];
        gen_seq_end(&c->seq);
        if (c->kv) {
            add_kv_stats(&kvs, c->kv, !any);
            any = true;
        }
        /* a session's KV stays for below; its beams' forks go */
        if (c->kv != j->skv)
            kv_seq_free(c->kv);
        c->kv = NULL;
    }
    if (j->cross_kept) /* the encoder cache keeps it */
        kv_kept_unref(j->cross_kept);
    else if (!j->sess) /* a session keeps it */
        kv_seq_free(j->cross);
    j->cross = NULL;
    j->cross_kept = NULL;
    /* A session keeps its KV together with the ids in it; when the two
     * disagree (setup failed half-way) the KV is dropped and recomputed. */
    struct session *s = j->sess;
    struct job_choice *c0 = &j->ch[0];
    bool admitted = c0->seq.toks != NULL;
    /* A job that computed in a KV beside the session's (a rewound fork, a
     * fresh start) hands it over unless it failed: a failed request leaves
     * the session as it was. */
    bool failed = j->res.err.st != IPC_OK || !j->skv;
    if (s && j->skv != s->kv) {
        bool take = admitted && (!failed || !s->kv);
        kv_seq_free(take ? s->kv : j->skv);
        if (take)
            s->kv = j->skv;
        else
            admitted = false; /* nothing of the session changes */
    }
    int32_t *keep = NULL;
    size_t n_keep = 0;
    if (s && admitted) {
        n_keep = s->kv ? (size_t)kv_seq_length(s->kv) : 0;
        /* once beams forked it (beam_advance), the session's KV stayed at the prompt */
        size_t fed = j->bs && c0->kv != s->kv ? j->n_prompt : c0->n_fed;
        /* a KV whose restore failed part-way is no KV */
        if (n_keep != fed || (s->kv && kv_seq_load_status(s->kv) != TIER_OK) ||
            (n_keep && !(keep = malloc(n_keep * sizeof(*keep))))) {
            kv_seq_free(s->kv);
            s->kv = NULL;
            n_keep = 0;
        } else if (keep) {
            memcpy(keep, c0->seq.toks, n_keep * sizeof(*keep));
        }
    }
    /* before the client is woken: the KV freed here leaves /metrics now,
     * not at the next step (an idle daemon takes none) */
    publish(e, 0);
    double t = clock_ms();
    pthread_mutex_lock(&e->mu);
    if (s && admitted) {
        free(s->toks);
        s->toks = keep;
        s->n_toks = n_keep;
        s->kvs = s->kv ? kv_seq_stats(s->kv) : (struct kv_seq_stats){0};
        /* a step may have moved it to the host tier */
        s->cross_kvs = s->cross ? kv_seq_stats(s->cross->kv) : (struct kv_seq_stats){0};
        s->version++; /* its file, if any, no longer holds its KV */
    }
    if (s) {
        s->busy = false;
        s->t_idle = t;
    }
    /* A session whose creating prefill or import failed or was abandoned
     * was never handed to its client: it must not keep a --max-sessions slot. */
    if (s && (j->kind == JOB_PREFILL || j->kind == JOB_IMPORT) && (j->cancelled || j->res.err.st != IPC_OK))
        session_unlink_locked(e, s);
    kvs.copied_bytes += j->freed_copied;
    j->res.kv = kvs;
    if (j->n_out < j->n && !j->bs && j->res.err.st == IPC_OK)
        rank_choices(j);
    if (j->t_first > 0)
        j->res.decode_ms = t - j->t_first;
    else if (j->t_admit > 0)
        j->res.prefill_ms = t - j->t_admit;
    observe_request(e, j);
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].finish == GEN_FINISH_NONE)
            j->ch[i].finish = GEN_FINISH_LENGTH;
    j->done = true;
    struct job **pp = &e->active;
    while (*pp && *pp != j)
        pp = &(*pp)->next;
    if (*pp) {
        *pp = j->next;
        e->active_seqs -= j->n;
    }
    job_unref_locked(j);
    pthread_mutex_unlock(&e->mu);
    wake(e);
}

/* Records err as the job's failure (first one wins); the engine retires it
 * at the next step. */
void job_fail(engine *e, struct job *j, const struct ipc_error *err)
{
    pthread_mutex_lock(&e->mu);
    if (j->res.err.st == IPC_OK)
        j->res.err = *err;
    j->kill = true;
    pthread_mutex_unlock(&e->mu);
}

static void job_fail_msg(engine *e, struct job *j, enum ipc_status st, const char *msg)
{
    struct ipc_error err;
    ipc_fail(&err, st, "", "%s", msg);
    job_fail(e, j, &err);
}

void resume_job(engine *e, struct job *j)
{
    j->io_wait = false;
    if (!j->kill)
        start_job(e, j);
}

/* Whether j reads and fills the encoder cache: not a request outside a
 * session that asked for no cache (use_cache: false), as the prefix cache. */
static bool uses_enc_cache(const engine *e, const struct job *j)
{
    return e->enc_cache && (j->sess || j->cache.use_cache);
}

/* The encoder cache's entry for (uid's namespace, ids[0, n)), referenced
 * for the caller; NULL: none. */
static kv_kept *kept_find(engine *e, uid_t uid, const int32_t *ids, size_t n)
{
    return kv_store_kept_find(e->store, prefix_ns_of(e, uid), ids, (int64_t)n);
}

/* An encoder-decoder job's encoder input becomes its cross-attention
 * cache, which every choice's decoder reads: a session's, kept for its
 * next requests, is reused when they give the same input or none (one
 * whose cache was lost is encoded again).  Another input drops the
 * session's caches.  Before encoding, the input is looked for among the
 * user's sessions, then in the encoder cache (the store's kept sequences,
 * in the uid's prefix namespace), where an input just encoded goes too,
 * then on the remote tier.  Before the choices' setup, which reuses the
 * session's decoder cache only over the same input.  False: j failed, or
 * waits for the remote tier (io_wait; it comes back here). */
static bool encode_input(engine *e, struct job *j)
{
    struct session *s = j->sess;
    const int32_t *in = j->input;
    size_t n = j->n_input;
    struct ipc_error err;
    if (s && !in) {
        if (!s->n_input) {
            ipc_fail(&err, IPC_EINVAL, "input", "session %s holds no encoder input yet: give \"input\"", s->id);
            job_fail(e, j, &err);
            return false;
        }
        in = s->input;
        n = s->n_input;
    }
    pthread_mutex_lock(&e->mu);
    j->res.n_encoder = n;
    pthread_mutex_unlock(&e->mu);
    if (s && s->cross && n == s->n_input && !memcmp(in, s->input, n * sizeof(*in))) {
        j->cross = s->cross->kv;
        pthread_mutex_lock(&e->mu);
        j->res.n_encoder_cached = n;
        pthread_mutex_unlock(&e->mu);
        return true;
    }
    uint64_t ns = prefix_ns_of(e, s ? s->uid : j->uid);
    /* in no memory: the disk tier, then the remote tier may have it (the
     * job waits, then comes back here holding what it found,
     * j->cross_kept) */
    while (uses_enc_cache(e, j) && !j->cross_kept && j->xlooked < 2 &&
           !kv_store_kept_held(e->store, ns, in, (int64_t)n)) {
        if (j->xlooked++ == 0 ? encoder_disk_fetch(e, j, ns, in, n) : encoder_remote_fetch(e, j, ns, in, n)) {
            j->io_wait = true; /* prefix_disk_poll or prefix_remote_poll starts it again */
            return false;
        }
    }
    int32_t *keep = NULL;
    struct cross_cache *cc = NULL;
    kv_kept *kept = NULL;
    if (s) {
        keep = malloc(n * sizeof(*keep));
        cc = calloc(1, sizeof(*cc));
        if (!keep || !cc) {
            free(keep);
            free(cc);
            job_fail_msg(e, j, IPC_ENOMEM, "no host memory for the session's input");
            return false;
        }
        memcpy(keep, in, n * sizeof(*keep)); /* in may be s->input, which goes now */
        in = keep;
        /* A new input replaces the session's caches before the encoder
         * runs, which gets their memory; if it then fails the session
         * holds nothing, and says so. */
        kv_seq_free(s->kv);
        s->kv = NULL;
        session_drop_cross(e, s, true);
        pthread_mutex_lock(&e->mu);
        free(s->toks);
        s->toks = NULL;
        s->n_toks = 0;
        s->kvs = (struct kv_seq_stats){0};
        s->version++; /* its file, if any, no longer holds its caches */
        pthread_mutex_unlock(&e->mu);
        /* another of the user's sessions may hold it (a fork given the
         * same input, or another session): its cache serves both */
        struct cross_cache *found = cross_find(e, s->uid, keep, n);
        if (!found && uses_enc_cache(e, j) && (kept = kept_find(e, s->uid, keep, n))) {
            *cc = (struct cross_cache){.kv = kv_kept_seq(kept), .refs = 1, .kept = kept};
            found = cc;
            cc = NULL;
        }
        if (found) {
            free(cc);
            s->cross = found;
            s->input = keep;
            j->cross = found->kv;
            struct kv_seq_stats k = kv_seq_stats(found->kv);
            pthread_mutex_lock(&e->mu);
            s->n_input = n;
            s->cross_kvs = k;
            j->res.n_encoder_cached = n;
            pthread_mutex_unlock(&e->mu);
            return true;
        }
    } else if (uses_enc_cache(e, j) && (kept = j->cross_kept ? j->cross_kept : kept_find(e, j->uid, in, n))) {
        j->cross_kept = kept;
        j->cross = kv_kept_seq(kept);
        pthread_mutex_lock(&e->mu);
        j->res.n_encoder_cached = n;
        pthread_mutex_unlock(&e->mu);
        return true;
    }
    struct kv_seq_params cp = {.no_prefix_cache = true};
    enum tier_status ts = kv_seq_create(e->store, &cp, &j->cross);
    enum model_status ms = ts == TIER_OK ? encdec_encode(e->ed, j->cross, in, (int)n) : MODEL_OK;
    /* an offloaded decoder cache keeps the encoder's output in the host
     * tier too: every step streams it through the device slots with the
     * self cache's layers (the encoder needed it on the device) */
    const struct kv_seq_params *sp = s ? &s->cache.params : &j->cache.params;
    if (ts == TIER_OK && ms == MODEL_OK &&
        (sp->strategy == KV_OFFLOADED || sp->strategy == KV_OFFLOADED_STATIC || sp->offload))
        ts = kv_seq_offload(j->cross, KV_FALLBACK_NONE);
    if (ts == TIER_OK && ms == MODEL_OK) {
        /* into the encoder cache for the next request with this input; a
         * cache the store cannot keep (no host memory for the ids) stays
         * this job's or session's alone */
        if (uses_enc_cache(e, j) && kv_store_keep(e->store, ns, in, (int64_t)n, j->cross, &kept) != TIER_OK)
            log_msg(LOG_DEBUG, "engine: encoder cache: %s", kv_store_errmsg(e->store));
        if (uses_enc_cache(e, j))
            encoder_remote_publish(e, j, ns, in, n, j->cross);
        if (s) {
            *cc = (struct cross_cache){.kv = j->cross, .refs = 1, .kept = kept};
            s->cross = cc;
            s->input = keep;
            struct kv_seq_stats k = kv_seq_stats(cc->kv);
            pthread_mutex_lock(&e->mu);
            s->n_input = n;
            s->cross_kvs = k;
            pthread_mutex_unlock(&e->mu);
        } else {
            j->cross_kept = kept;
        }
        return true;
    }
    /* a session's job does not free it at retire */
    kv_seq_free(j->cross);
    j->cross = NULL;
    free(keep);
    free(cc);
    if (ts != TIER_OK)
        kv_error(e, ts, "input", &err);
    else if (ms == MODEL_EINVAL) /* BART's learned positions end */
        ipc_fail(&err, IPC_ECONTEXT, "input", "the input has %zu tokens; the encoder's positions end at %d", n,
                 encdec_get_config(e->ed)->max_positions);
    else if (ms == MODEL_ENOMEM || ms == MODEL_EDEVMEM)
        ipc_fail(&err, IPC_ESTORAGE, "input", "no memory for the encoder's output: %s", kv_store_errmsg(e->store));
    else
        ipc_fail(&err, IPC_EINTERNAL, "input", "the encoder failed: %s", model_strerror(ms));
    job_fail(e, j, &err);
    return false;
}

void start_job(engine *e, struct job *j)
{
    if (j->t_admit == 0) {
        j->t_admit = clock_ms();
        hist_observe(&e->hists.queue_wait, (j->t_admit - j->t_submit) / 1e3);
    }
    if (j->sess && disk_needs_restore(e, j->sess)) {
        j->io_wait = true; /* disk_poll starts it again once the KV is back */
        /* a restore begun for another job (one since cancelled, say) may be
         * in flight: this one waits for it rather than reading the file
         * again over it */
        if (!j->sess->op)
            disk_restore(e, j->sess);
        return;
    }
    if (j->kind >= JOB_CROP) {
        session_run_op(e, j);
        return;
    }
    if (!j->pfetched) {
        j->pfetched = true;
        if (prefix_disk_fetch(e, j)) {
            j->io_wait = true; /* prefix_disk_poll starts it again once the blocks are in */
            return;
        }
    }
    if (!j->rfetched) {
        j->rfetched = true;
        if (prefix_remote_fetch(e, j)) {
            j->io_wait = true; /* prefix_remote_poll starts it again once the blocks are in */
            return;
        }
    }
    if (j->beam.num_beams > 1 && !j->bs) {
        char msg[MODEL_ERR_LEN] = "";
        j->beam.eos = j->eos;
        j->beam.n_eos = j->ignore_eos ? 0 : gen_eos_ids(e->mc, e->tok, j->eos);
        j->beam.max_new = j->max_new;
        enum model_status ms = beam_create(&j->beam, e->vocab, j->prompt, j->n_prompt, &j->bs, msg);
        if (ms != MODEL_OK) {
            struct ipc_error err;
            if (ms == MODEL_EINVAL)
                ipc_fail(&err, IPC_EINVAL, "num_beams", "%s", msg);
            else
                ipc_fail(&err, IPC_ENOMEM, "", "no host memory for the beam search");
            job_fail(e, j, &err);
            return;
        }
    }
    if (e->ed && !encode_input(e, j))
        return;
    for (int i = 0; i < j->n; i++) {
        struct ipc_error err;
        if (seq_setup(e, j, &j->ch[i], i, &err) != IPC_OK) {
            job_fail(e, j, &err);
            return;
        }
    }
    if (j->kind == JOB_PREFILL && j->ch[0].n_fed == j->ch[0].seq.n_toks)
        j->ch[0].seq.finish = GEN_FINISH_LENGTH; /* nothing to compute */
    pthread_mutex_lock(&e->mu);
    j->res.n_cached = (int)j->ch[0].n_fed;
    e->st.prompt_tokens += j->n_prompt * (size_t)j->n;
    e->st.cached_tokens += (uint64_t)j->res.n_cached;
    pthread_mutex_unlock(&e->mu);
}

/* Log-probabilities of the chosen id and the top alternatives, from the raw
 * logits in e->scratch (OpenAI reports the model's distribution, before
 * temperature and filters). */
static void record_logprobs(engine *e, struct job *j, struct job_choice *c, int32_t id)
{
    const float *x = e->scratch;
    float lse = (float)gen_log_sum_exp(x, e->vocab);
    int k = j->top_logprobs;
    struct tok_logprob *out = c->lps + (size_t)c->seq.gen * (size_t)(1 + k);
    out[0] = (struct tok_logprob){id, x[id] - lse};
    struct tok_logprob *top = out + 1;
    int n = 0;
    for (int i = 0; i < e->vocab && k; i++) { /* insertion into a sorted top-k: k <= 20 */
        if (n == k && x[i] <= top[n - 1].logprob)
            continue;
        int p = n < k ? n++ : n - 1;
        while (p > 0 && top[p - 1].logprob < x[i]) {
            top[p] = top[p - 1];
            p--;
        }
        top[p] = (struct tok_logprob){i, x[i]};
    }
    for (int i = 0; i < n; i++)
        top[i].logprob -= lse;
}

/* A token of c (NULL: of every beam of j) came at t. */
static void note_token(engine *e, struct job *j, struct job_choice *c, double t)
{
    if (j->t_first == 0) {
        j->t_first = t;
        j->res.prefill_ms = t - j->t_admit;
        hist_observe(&e->hists.ttft, (t - j->t_submit) / 1e3);
    }
    if (!c)
        c = &j->ch[0];
    if (c->t_last > 0)
        hist_observe(&e->hists.inter_token, (t - c->t_last) / 1e3);
    c->t_last = t;
}

static void sample_one(engine *e, struct job *j, struct job_choice *c, float *logits, double t)
{
    note_token(e, j, c, t);
    c->refeeding = false;
    bool rank = j->n_out < j->n;
    if (j->logprobs || rank)
        memcpy(e->scratch, logits, (size_t)e->vocab * sizeof(*logits));
    int32_t id = gen_seq_sample(&c->seq, logits);
    if (j->logprobs)
        record_logprobs(e, j, c, id);
    if (rank) /* the model's distribution, as OpenAI's best_of ranks by it */
        c->lp_sum += (double)(e->scratch[id] - (float)gen_log_sum_exp(e->scratch, e->vocab));
    if (gen_seq_accept(&c->seq, id) != MODEL_OK)
        job_fail_msg(e, j, IPC_ENOMEM, "no host memory for the generated text");
}

/* use_cache=false (HF semantics): a choice about to decode drops its KV
 * and feeds its whole history again, as a prefill, in as many chunks as
 * the step's budget needs; until that ends in its next token it is
 * refeeding, even when a chunk leaves one token to feed.  False when the
 * new sequence cannot be made (the job then fails). */
static bool restart_uncached(engine *e, struct job *j, struct job_choice *c)
{
    kv_seq_free(c->kv);
    c->kv = NULL;
    c->n_fed = 0;
    c->refeeding = true;
    enum tier_status ts = kv_seq_create(e->store, &j->cache.params, &c->kv);
    if (ts == TIER_OK)
        return true;
    struct ipc_error err;
    kv_error(e, ts, "use_cache", &err);
    job_fail(e, j, &err);
    return false;
}

/* The step's batch: one decode token per running sequence, then prefill
 * chunks round-robin until the token budget is spent.  Returns the number
 * of entries. */
static int build_batch(engine *e)
{
    int nb = 0, n_pre = 0;
    for (struct job *j = e->active; j; j = j->next) {
        for (int i = 0; i < j->n && !j->kill && !j->mem_wait; i++) {
            struct job_choice *c = &j->ch[i];
            if (c->seq.finish != GEN_FINISH_NONE || !c->seq.toks || !c->kv)
                continue;
            if (!j->cache.use_cache && c->n_fed && !c->refeeding && c->seq.n_toks - c->n_fed == 1 &&
                !restart_uncached(e, j, c))
                continue;
            if (c->seq.n_toks - c->n_fed == 1) {
                float *logits = j->kind == JOB_GENERATE ? e->logits + (size_t)nb * e->vocab : NULL;
                e->batch[nb] = (struct fw_seq){c->kv, c->seq.toks + c->n_fed, 1, logits, false, 0};
                e->batch_ch[nb] = c;
                e->batch_job[nb++] = j;
            } else {
                n_pre++;
            }
        }
    }
    int budget = e->cfg.batch_tokens - nb;
    if (budget < e->cfg.batch_tokens / 4)
        budget = e->cfg.batch_tokens / 4; /* decode-heavy steps still move prefills along */
    if (!n_pre)
        return nb;
    int skip = (int)(e->rr++ % (unsigned)n_pre), seen = 0;
    for (int pass = 0; pass < 2 && budget > 0; pass++) {
        for (struct job *j = e->active; j && budget > 0; j = j->next) {
            for (int i = 0; i < j->n && budget > 0 && !j->kill && !j->mem_wait; i++) {
                struct job_choice *c = &j->ch[i];
                if (c->seq.finish != GEN_FINISH_NONE || !c->seq.toks || !c->kv || c->seq.n_toks - c->n_fed <= 1)
                    continue;
                int ord = seen++;
                /* first pass: those at or after the round-robin start; second: the rest */
                if ((pass == 0) != (ord % n_pre >= skip))
                    continue;
                size_t left = c->seq.n_toks - c->n_fed;
                int chunk = left < (size_t)budget ? (int)left : budget;
                bool last = (size_t)chunk == left;
                bool logits = last && j->kind == JOB_GENERATE;
                /* the chunks of one prefill pick longrope's table as one
                 * forward call over the whole history would */
                e->batch[nb] = (struct fw_seq){c->kv, c->seq.toks + c->n_fed, chunk,
                                               logits ? e->logits + (size_t)nb * e->vocab : NULL, false,
                                               (int64_t)c->seq.n_toks};
                e->batch_ch[nb] = c;
                e->batch_job[nb++] = j;
                budget -= chunk;
            }
        }
    }
    return nb;
}

/* Makes c's progress visible to the loop thread (caller holds mu). */
static void publish_choice_locked(engine *e, struct job_choice *c)
{
    e->st.gen_tokens += (uint64_t)(c->seq.gen - c->n_gen);
    c->n_text = c->seq.vis;
    c->n_gen = c->seq.gen;
    c->finish = c->seq.finish;
}

static void publish(engine *e, int nb)
{
    /* a job's choices share the batch: each job is summed once, before the lock */
    e->pub_round++;
    for (int i = 0; i < nb; i++) {
        struct job *j = e->batch_job[i];
        if (j->kv_round == e->pub_round)
            continue;
        j->kv_round = e->pub_round;
        j->kv_step = (struct kv_seq_stats){0};
        bool any = false;
        for (int k = 0; k < j->n; k++) {
            if (j->ch[k].kv) {
                add_kv_stats(&j->kv_step, j->ch[k].kv, !any);
                any = true;
            }
        }
    }
    struct kv_store_stats ks = kv_store_stats(e->store);
    struct be_mem_stats ms = be_mem_stats(e->rt.be);
    pthread_mutex_lock(&e->mu);
    e->st.dev_budget = ms.dev_budget;
    e->st.dev_used = ms.dev_used;
    e->st.kv_dev_bytes = ks.dev_bytes;
    e->st.kv_host_bytes = ks.host_bytes;
    e->st.kv_host_budget = ks.host_budget;
    e->st.kv_fallbacks = ks.fallbacks;
    e->st.kv_fallbacks_oom = ks.fallbacks_oom;
    e->st.prefix_hit_tokens = ks.prefix_hit_tokens;
    e->st.prefix_entries = ks.prefix_entries;
    e->st.prefix_evictions = ks.prefix_evictions;
    for (int i = 0; i < nb; i++) {
        publish_choice_locked(e, e->batch_ch[i]);
        e->batch_job[i]->kv_now = e->batch_job[i]->kv_step;
    }
    e->st.steps += (uint64_t)e->passes; /* published once */
    e->passes = 0;
    pthread_mutex_unlock(&e->mu);
}

/* A forward pass over batch entries [from, to) failed; they changed no KV. */
static void fail_forward(engine *e, int from, int to, enum model_status st)
{
    struct ipc_error err;
    const char *why = kv_store_errmsg(e->store);
    if (st == MODEL_ENOMEM) /* the host tier's message names its budget (--host-mem) */
        ipc_fail(&err, IPC_ESTORAGE, "", "%s", why[0] ? why : model_strerror(st));
    else if (st == MODEL_EDEVMEM) /* no fallback allowed, or not even the streaming slots fit */
        ipc_fail(&err, IPC_ESTORAGE, "", "device memory budget of %zu bytes (--device-mem) exhausted: %s",
                 be_mem_stats(e->rt.be).dev_budget, why[0] ? why : model_strerror(st));
    else if (st == MODEL_EKVFULL)
        ipc_fail(&err, IPC_EINVAL, "cache.max_cache_len", "%s", why[0] ? why : model_strerror(st));
    else
        ipc_fail(&err, IPC_EINTERNAL, "", "forward pass failed: %s", model_strerror(st));
    log_msg(err.st == IPC_EINTERNAL ? LOG_ERR : LOG_WARN, "engine: %d sequence(s): %s", to - from, err.msg);
    for (int i = from; i < to; i++)
        job_fail(e, e->batch_job[i], &err);
}

/* Whether entry i failed for its session's restore from disk: its KV, or
 * its job's cross cache, lost a layer on its way. */
static bool restore_failed(const engine *e, int i)
{
    const struct job *j = e->batch_job[i];
    return j->sess && (kv_seq_load_status(e->batch_ch[i]->kv) != TIER_OK ||
                       (j->cross && kv_seq_load_status(j->cross) != TIER_OK));
}

/* Entry i's session KV lost a layer on its way from disk: the job starts
 * over on a fresh KV, computing what the session held again (and, for a
 * lost cross cache, encoding the input again). */
static void restart_session(engine *e, int i)
{
    struct job *j = e->batch_job[i];
    struct job_choice *c = e->batch_ch[i];
    disk_restore_lost(e, j->sess); /* frees the KV c ran on */
    c->kv = j->skv = NULL;
    c->n_fed = 0;
    if (e->ed && !j->sess->cross) {
        j->cross = NULL;
        pthread_mutex_lock(&e->mu);
        j->res.n_encoder_cached = 0;
        pthread_mutex_unlock(&e->mu);
        if (!encode_input(e, j))
            return;
    }
    struct ipc_error err;
    if (session_kv_fresh(e, j, c, &err) != IPC_OK) {
        job_fail(e, j, &err);
        return;
    }
    pthread_mutex_lock(&e->mu);
    j->res.n_cached = (int)c->n_fed;
    pthread_mutex_unlock(&e->mu);
}

static void advance(engine *e, int from, int to);
static enum model_status forward(engine *e, int from, int to);

/* Whether s's KV is on no step's way: the session is idle, or its request
 * starts over in a KV of its own (session_kv_setup) and keeps the old one
 * only to leave the session as it was should the request fail. */
static bool kv_set_aside(const engine *e, const struct session *s)
{
    if (!s->busy)
        return true;
    for (const struct job *j = e->active; j; j = j->next)
        if (j->sess == s)
            return j->skv != s->kv;
    return false;
}

/* Whether a is used less recently than b, in a total order. */
static bool before(const struct session *a, const struct session *b)
{
    return a->t_idle < b->t_idle || (a->t_idle == b->t_idle && (uintptr_t)a < (uintptr_t)b);
}

/* When a step finds the device full, a KV set aside moves to the host tier
 * (kv_seq_offload; its later steps stream it through the device slots
 * layer by layer), the least recently used first, the next when one
 * cannot move (a sink cache, allow_offload false): a session's old KV
 * beside its request's fresh one (a fork of it shares its blocks, and
 * only the tail past them leaves the device), and a state model's idle
 * sessions (a state is a few MiB whatever its length), before any
 * session waits for a spill to disk.  False when none could move. */
static bool offload_set_aside(engine *e)
{
    bool states = kv_store_state_bytes(e->store) > 0;
    const struct session *tried = NULL; /* the last that could not move */
    struct session *lru;
    enum tier_status st;
    do {
        pthread_mutex_lock(&e->mu);
        lru = NULL;
        for (struct session *s = e->sessions; s; s = s->next)
            if (s->kv && !s->op && (states || s->busy) && kv_set_aside(e, s) &&
                kv_seq_stats(s->kv).resident_layers && (!tried || before(tried, s)) && (!lru || before(s, lru)))
                lru = s;
        pthread_mutex_unlock(&e->mu);
        if (!lru)
            return false;
        tried = lru;
        /* a full host tier or a fault ends the search: the next would fail
         * the same way, after copying */
    } while ((st = kv_seq_offload(lru->kv, KV_FALLBACK_OOM)) == TIER_ENOTSUP);
    if (st != TIER_OK)
        return false;
    struct kv_seq_stats kvs = kv_seq_stats(lru->kv);
    pthread_mutex_lock(&e->mu);
    lru->kvs = kvs;
    pthread_mutex_unlock(&e->mu);
    log_msg(LOG_DEBUG, "engine: session %s: its %s moved to the host tier to make room", lru->id,
            states ? "state" : "old KV");
    return true;
}

/* Entry i found the memory tiers full: with a disk tier, an idle session
 * goes to disk and the entry's job waits to be retried, else it fails.  A
 * KV set aside (offload_set_aside) moves to the host tier first and the
 * entry runs again at once. */
static void fail_or_wait(engine *e, int i, enum model_status st)
{
    if (restore_failed(e, i)) {
        restart_session(e, i);
        return;
    }
    while (st == MODEL_EDEVMEM && offload_set_aside(e))
        if ((st = forward(e, i, i + 1)) == MODEL_OK) {
            advance(e, i, i + 1);
            return;
        }
    /* a beam search cannot wait: its other beams of the step advanced */
    if ((st == MODEL_ENOMEM || st == MODEL_EDEVMEM) && !e->batch_job[i]->bs && disk_spill_for_memory(e)) {
        log_msg(LOG_DEBUG, "engine: memory tiers full (%s); waiting for a session to spill to disk",
                kv_store_errmsg(e->store));
        e->batch_job[i]->mem_wait = true;
        return;
    }
    fail_forward(e, i, i + 1, st);
}

/* Choice 0 of j computed the prompt: every other choice forks its KV and
 * samples its first token from the same logits (not yet modified). */
static void share_prefill(engine *e, struct job *j, const float *logits, double t)
{
    memcpy(e->share, logits, (size_t)e->vocab * sizeof(*logits));
    for (int k = 1; k < j->n && !j->kill; k++) {
        struct job_choice *c = &j->ch[k];
        enum tier_status ts = kv_seq_fork(j->ch[0].kv, &c->kv);
        if (ts != TIER_OK) {
            struct ipc_error err;
            kv_error(e, ts, "n", &err);
            job_fail(e, j, &err);
            return;
        }
        c->n_fed = j->ch[0].n_fed;
        memcpy(e->share_tmp, e->share, (size_t)e->vocab * sizeof(*logits));
        sample_one(e, j, c, e->share_tmp, t);
        /* not in this step's batch: published here (it may be finished already) */
        pthread_mutex_lock(&e->mu);
        publish_choice_locked(e, c);
        pthread_mutex_unlock(&e->mu);
    }
}

/* Whether a step's logits row can be sampled: a NaN or an infinity comes
 * only from unsound weights or KV (a finite row stays finite through the
 * forward pass of sound ones), and sampling it would answer 200 with
 * arbitrary tokens.  The request fails instead, saying why. */
static bool logits_sound(engine *e, struct job *j, const float *logits)
{
    for (int i = 0; i < e->vocab; i++)
        if (!isfinite(logits[i])) {
            job_fail_msg(e, j, IPC_EINTERNAL, "the model's logits are not finite (NaN or infinity): its weights, "
                         "or the KV this request reads, are unsound");
            return false;
        }
    return true;
}

/* Entries [from, to) were computed: take their tokens and sample. */
static void advance(engine *e, int from, int to)
{
    double t = clock_ms();
    for (int i = from; i < to; i++) {
        struct job_choice *c = e->batch_ch[i];
        struct job *j = e->batch_job[i];
        c->n_fed += (size_t)e->batch[i].n_tokens;
        /* the blocks this chunk completed go out now, not when the request ends */
        if (c == &j->ch[0] && c->n_fed - (size_t)e->batch[i].n_tokens < j->n_prompt)
            prefix_remote_publish(e, j, c->n_fed);
        if (e->batch[i].logits && !logits_sound(e, j, e->batch[i].logits)) {
            continue;
        } else if (e->batch[i].logits && j->bs) {
            c->beam_logits = e->batch[i].logits; /* beams_decide, once every beam has its own */
        } else if (e->batch[i].logits) {
            if (c == &j->ch[0] && !c->seq.gen && shares_prefill(j))
                share_prefill(e, j, e->batch[i].logits, t);
            sample_one(e, j, c, e->batch[i].logits, t);
        }
        else if (j->kind == JOB_PREFILL && c->n_fed == c->seq.n_toks)
            c->seq.finish = GEN_FINISH_LENGTH;
    }
}

/* The search ended: its best hypotheses become choices [0, n_out) (ids,
 * text, finish, sequence_score); the rest finish unreturned. */
static void beam_finish(engine *e, struct job *j)
{
    int n = beam_results(j->bs);
    struct gen_seq out[BEAM_MAX_BEAMS];
    memset(out, 0, sizeof(out));
    /* the hypotheses' tokens replayed as the search read them: with
     * ignore_eos an eos id was one more token, not the end */
    struct gen_seq_params gp = {.max_new = j->max_new, .ctx = INT_MAX, .ignore_eos = j->ignore_eos,
                                .text_lock = &e->mu};
    sampler_params_default(&gp.sampling);
    enum model_status ms = MODEL_OK;
    for (int i = 0; i < n && ms == MODEL_OK; i++) {
        struct beam_hyp h = beam_result(j->bs, i);
        ms = gen_seq_init(&out[i], e->mc, e->tok, &gp, j->prompt, j->n_prompt);
        for (int t = 0; t < h.n_gen && ms == MODEL_OK; t++)
            ms = gen_seq_accept(&out[i], h.toks[t]);
        gen_seq_end(&out[i]);
    }
    if (ms != MODEL_OK) {
        for (int i = 0; i < n; i++)
            gen_seq_free(&out[i]);
        job_fail_msg(e, j, IPC_ENOMEM, "no host memory for the beam search's results");
        return;
    }
    pthread_mutex_lock(&e->mu);
    for (int i = 0; i < j->n; i++) {
        struct job_choice *c = &j->ch[i];
        if (i < n) {
            struct gen_seq old = c->seq;
            c->seq = out[i];
            out[i] = old; /* freed below, outside the lock */
            c->score = beam_result(j->bs, i).score;
        }
        if (c->seq.finish == GEN_FINISH_NONE)
            c->seq.finish = GEN_FINISH_LENGTH;
        c->n_gen = c->seq.gen; /* what publish() counts from */
        c->n_text = c->seq.vis;
        c->finish = c->seq.finish;
    }
    j->n_out = n;
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < n; i++)
        gen_seq_free(&out[i]);
}

/* Every running beam of j has this step's logits: the decision, then the
 * beams' KV follows their parents (beam_reorder) and their ids. */
static void beam_advance(engine *e, struct job *j, double t)
{
    int nr = beam_running(j->bs), ready = 0;
    const float *rows[BEAM_MAX_BEAMS];
    for (int i = 0; i < nr; i++) {
        rows[i] = j->ch[i].beam_logits;
        ready += rows[i] != NULL;
    }
    if (!ready)
        return;
    /* every beam decodes one token in the same step, and the logits rows
     * are the step's: beams out of step would wait on overwritten rows */
    if (ready < nr) {
        job_fail_msg(e, j, IPC_EINTERNAL, "beam search: the beams' logits came in different steps");
        return;
    }
    for (int i = 0; i < nr; i++)
        j->ch[i].beam_logits = NULL;
    note_token(e, j, NULL, t);
    int parent[BEAM_MAX_BEAMS];
    bool done = false;
    if (beam_step(j->bs, rows, parent, &done) != MODEL_OK) { /* beam_create's checks rule it out */
        job_fail_msg(e, j, IPC_EINTERNAL, "beam search: no decision for this step");
        return;
    }
    if (done) {
        beam_finish(e, j);
        return;
    }
    int nn = beam_running(j->bs);
    kv_seq *kv[BEAM_MAX_BEAMS], *tmp[BEAM_MAX_BEAMS];
    size_t fed[BEAM_MAX_BEAMS];
    for (int i = 0; i < nr; i++) {
        kv[i] = j->ch[i].kv;
        fed[i] = j->ch[i].n_fed;
    }
    struct ipc_error err;
    enum tier_status ts = TIER_OK;
    /* a session's decoder cache stays at the prompt for its next request
     * (retire): the beams go on from a fork of it */
    if (j->sess && kv[0] == j->skv && (ts = kv_seq_fork(j->skv, &kv[0])) != TIER_OK) {
        kv_error(e, ts, "num_beams", &err);
        job_fail(e, j, &err);
        return;
    }
    ts = beam_reorder(kv, nr, parent, nn, tmp, &j->freed_copied);
    size_t len = 0;
    for (int k = 0; k < nn; k++) {
        struct job_choice *c = &j->ch[k];
        const int32_t *ids = beam_tokens(j->bs, k, &len);
        c->kv = kv[k];
        c->n_fed = fed[parent[k]];
        memcpy(c->seq.toks + j->n_prompt, ids + j->n_prompt, (len - j->n_prompt) * sizeof(*ids));
        c->seq.n_toks = len;
        c->seq.gen = (int)(len - j->n_prompt);
    }
    if (ts != TIER_OK) {
        kv_error(e, ts, "num_beams", &err);
        job_fail(e, j, &err);
        return;
    }
    enum be_dtype dt = kv_store_dtype(e->store);
    uint64_t whole = beam_whole_reorder_bytes(e->mc, dt, nn, (int64_t)len - 1, j->cache.params.window_length);
    /* an encoder-decoder model's reorder_cache gathers the beams' copies
     * of the cross-attention cache too; here the beams read one */
    if (j->cross)
        whole += beam_whole_reorder_bytes(e->mc, dt, nn, kv_seq_length(j->cross), 0);
    pthread_mutex_lock(&e->mu);
    j->res.beam_steps++;
    j->res.whole_reorder_bytes += whole;
    pthread_mutex_unlock(&e->mu);
}

/* After a step's forward passes: the beam searches whose beams all have
 * their logits decide. */
static void beams_decide(engine *e)
{
    double t = clock_ms();
    for (struct job *j = e->active; j; j = j->next)
        if (j->bs && !j->kill && j->res.err.st == IPC_OK)
            beam_advance(e, j, t);
}

/* A fault the tests can place: what the engine does with a step that
 * fails for no client's mistake (KVTIER_TEST_FAIL_TOKEN). */
static bool poisoned(const engine *e, int from, int to)
{
    for (int i = from; e->fail_token >= 0 && i < to; i++)
        for (int t = 0; t < e->batch[i].n_tokens; t++)
            if (e->batch[i].tokens[t] == e->fail_token)
                return true;
    return false;
}

/* One forward pass over batch entries [from, to), weights read once: the
 * decoder-only model's, or the encoder-decoder model's decoder, each entry
 * over its job's encoder output (it continues in the host tier itself). */
static enum model_status forward(engine *e, int from, int to)
{
    e->passes++;
    if (poisoned(e, from, to))
        return MODEL_EBACKEND;
    if (!e->ed)
        return model_forward(e->m, &e->batch[from], to - from);
    for (int i = from; i < to; i++) {
        const struct fw_seq *f = &e->batch[i];
        e->ed_batch[i] = (struct encdec_seq){.self = f->kv, .cross = e->batch_job[i]->cross, .ids = f->tokens,
                                             .n = f->n_tokens, .logits = f->logits};
    }
    return encdec_decode_batch(e->ed, &e->ed_batch[from], to - from);
}

/* Entry i's pass failed: an encoder-decoder entry fails (its decoder
 * already moved what it could to the host tier) unless its session's
 * restore lost a layer; another may wait for memory (fail_or_wait, which
 * also restarts a session whose restore failed). */
static void fail_entry(engine *e, int i, enum model_status st)
{
    if (e->ed && !restore_failed(e, i))
        fail_forward(e, i, i + 1, st);
    else
        fail_or_wait(e, i, st);
}

static void step(engine *e)
{
    int nb = build_batch(e);
    if (!nb)
        return;
    enum model_status st = forward(e, 0, nb);
    if (st == MODEL_OK) {
        advance(e, 0, nb);
    } else if (nb == 1) {
        fail_entry(e, 0, st);
    } else {
        /* The failed step changed no KV (model_forward and
         * encdec_decode_batch are transactional), so redoing it one
         * sequence at a time finds whose tokens do not fit; the others
         * advance as if the step had succeeded. */
        log_msg(LOG_DEBUG, "engine: a %d-sequence step failed (%s); redoing it one by one", nb, model_strerror(st));
        for (int i = 0; i < nb; i++) {
            if (e->batch_job[i]->mem_wait)
                continue; /* another choice of its job found memory full */
            st = forward(e, i, i + 1);
            if (st == MODEL_OK)
                advance(e, i, i + 1);
            else
                fail_entry(e, i, st);
        }
    }
    beams_decide(e);
    publish(e, nb);
    wake(e);
}

static bool job_finished(const struct job *j)
{
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].seq.finish == GEN_FINISH_NONE)
            return false;
    return true;
}

/* ---- the thread ------------------------------------------------------------ */

/* Moves admissible queued jobs to the tail of the active list (under mu);
 * returns the first newly admitted job. */
static struct job *admit_locked(engine *e)
{
    struct job **tail = &e->active;
    while (*tail)
        tail = &(*tail)->next;
    struct job *first = NULL;
    while (e->queue && (e->active_seqs + e->queue->n <= e->cfg.max_seqs || !e->active)) {
        struct job *j = e->queue;
        e->queue = j->next;
        if (!e->queue)
            e->queue_tail = &e->queue;
        e->n_queued--;
        j->next = NULL;
        *tail = j;
        tail = &j->next;
        e->active_seqs += j->n;
        if (!first)
            first = j;
    }
    return first;
}

/* Whether an active job has something for the loop to do: a step, or its
 * failure to retire.  Jobs waiting for the disk do not (caller holds mu). */
static bool any_turn_locked(const engine *e)
{
    for (const struct job *j = e->active; j; j = j->next)
        if ((!j->io_wait && !j->mem_wait) || j->cancelled || j->res.err.st != IPC_OK)
            return true;
    return false;
}

static void loop(engine *e)
{
    for (;;) {
        if (disk_poll(e))
            publish(e, 0); /* a spill's freed KV, a restore's loaded one */
        double now = clock_ms(), due = disk_spill_idle(e, now), expire = session_expire_idle(e, now);
        due = expire && (!due || expire < due) ? expire : due;
        pthread_mutex_lock(&e->mu);
        while (!e->stopping && !e->queue && !any_turn_locked(e) && !e->dead && !e->io_event) {
            if (due == 0) {
                pthread_cond_wait(&e->cv, &e->mu);
                continue;
            }
            double left = due - clock_ms();
            if (left <= 0)
                break;
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            double ns = (double)ts.tv_nsec + left * 1e6;
            ts.tv_sec += (time_t)(ns / 1e9);
            ts.tv_nsec = (long)(ns - (double)(time_t)(ns / 1e9) * 1e9);
            pthread_cond_timedwait(&e->cv, &e->mu, &ts);
        }
        if (e->stopping) {
            pthread_mutex_unlock(&e->mu);
            return;
        }
        struct session *dead = e->dead;
        e->dead = NULL;
        struct job *fresh = admit_locked(e);
        for (struct job *j = e->active; j; j = j->next)
            j->kill = j->kill || j->cancelled || j->res.err.st != IPC_OK;
        pthread_mutex_unlock(&e->mu);

        if (dead) {
            for (struct session *s = dead; s; s = s->next)
                disk_forget(e, s);
            free_dead_sessions(dead);
            publish(e, 0); /* the freed KV shows in the metrics */
        }
        for (struct job *j = fresh; j; j = j->next)
            if (!j->kill)
                start_job(e, j);
        step(e);
        for (struct job *j = e->active, *next; j; j = next) {
            next = j->next;
            if (j->kill || job_finished(j))
                retire(e, j);
        }
    }
}

/* Shutdown: every job still known fails, so no client waits forever. */
static void fail_everything(engine *e)
{
    pthread_mutex_lock(&e->mu);
    for (struct job *j = e->queue; j; j = j->next)
        e->active_seqs += j->n;
    struct job **tail = &e->active;
    while (*tail)
        tail = &(*tail)->next;
    *tail = e->queue;
    e->queue = NULL;
    e->queue_tail = &e->queue;
    e->n_queued = 0;
    for (struct job *j = e->active; j; j = j->next)
        if (j->res.err.st == IPC_OK)
            ipc_fail(&j->res.err, IPC_EUNAVAIL, "", "kvtierd is shutting down");
    pthread_mutex_unlock(&e->mu);
    while (e->active)
        retire(e, e->active);
}

static void load_phase(engine *e, const char *phase)
{
    pthread_mutex_lock(&e->mu);
    e->load.phase = phase;
    pthread_mutex_unlock(&e->mu);
}

static void load_progress(void *arg, uint64_t done, uint64_t total)
{
    engine *e = arg;
    pthread_mutex_lock(&e->mu);
    e->load.phase = "weights";
    e->load.bytes_done = done;
    e->load.bytes_total = total;
    pthread_mutex_unlock(&e->mu);
    if (e->load_delay_ms && done < total)
        usleep((useconds_t)e->load_delay_ms * 1000);
}

/* One token through a throwaway sequence, before the daemon says ready:
 * the backend's thread pool and scratch buffers come into being here
 * instead of in the first request.  The sequence is static, one token: its
 * extent is freed with it, while a dynamic one would leave the KV pool
 * grown by a chunk, so the daemon's idle memory is what it was.  A window
 * of one on every layer keeps one token valid for a model whose layers
 * all slide (the store refuses a static cache shorter than their window).
 * A state model (Mamba) keeps no tokens: no window.  It touches no session and no statistic. */
static bool warm_up(engine *e, char *err)
{
    load_phase(e, "warmup");
    struct kv_seq_params p = {.strategy = KV_STATIC, .max_cache_len = 1, .window_length = 1, .no_prefix_cache = true};
    if (kv_store_state_bytes(e->store)) /* a state model's store refuses windows: its state has no tokens */
        p.window_length = 0;
    kv_seq *kv = NULL;
    int32_t tok = tokenizer_bos_id(e->tok) >= 0 ? tokenizer_bos_id(e->tok) : 0;
    enum tier_status ts = kv_seq_create(e->store, &p, &kv);
    if (ts != TIER_OK) {
        snprintf(err, MODEL_ERR_LEN, "warm-up: cannot open a KV sequence: %s", kv_store_errmsg(e->store));
        return false;
    }
    struct fw_seq f = {.kv = kv, .tokens = &tok, .n_tokens = 1, .logits = e->logits};
    double t = clock_ms();
    enum model_status st = model_forward(e->m, &f, 1);
    kv_seq_free(kv);
    if (st != MODEL_OK)
        snprintf(err, MODEL_ERR_LEN, "warm-up: a forward pass of one token failed: %s", model_strerror(st));
    else
        log_msg(LOG_INFO, "warm-up: a forward pass of one token in %.1f ms", clock_ms() - t);
    return st == MODEL_OK;
}

static bool load(engine *e)
{
    char err[MODEL_ERR_LEN] = "";
    struct runtime_params rp = {.backend = e->cfg.backend,
                                .be = {.n_threads = e->cfg.n_threads, .device_mem = e->cfg.device_mem},
                                .model = {.max_batch_tokens = e->cfg.batch_tokens, .verify_weights = e->cfg.verify_weights,
                                          .kv_dtype = e->cfg.kv_dtype, .weights = e->cfg.weights,
                                          .page_in = load_progress, .page_in_arg = e},
                                .kv = {.host_mem = e->cfg.host_mem, .prefix_cache = !e->cfg.no_prefix_cache,
                                       .checkpoint_interval = e->cfg.checkpoint_interval},
                                .size_seqs = e->cfg.max_seqs, .size_ctx = e->cfg.ctx, .allow_encdec = true};
    /* a decoder's tokens say nothing of the encoder input they attend to:
     * they are no prefix to share (encdec_decode) */
    if (encdec_is_encdec(e->cfg.model_dir)) {
        e->enc_cache = !e->cfg.no_prefix_cache;
        e->cfg.no_prefix_cache = true;
        rp.kv.prefix_cache = false;
    }
    if (runtime_open(e->cfg.model_dir, &rp, &e->rt, err) != MODEL_OK) {
        pthread_mutex_lock(&e->mu);
        e->state = ENGINE_FAILED;
        e->load.phase = "failed";
        e->load.seconds = (clock_ms() - e->load_t0) / 1e3;
        snprintf(e->state_msg, sizeof(e->state_msg), "%s", err[0] ? err : "model load failed");
        pthread_mutex_unlock(&e->mu);
        return false;
    }
    e->m = e->rt.m;
    e->ed = e->rt.ed;
    e->tok = e->rt.tok;
    e->store = e->rt.store;
    const struct runtime_budget *b = &e->rt.budget;
    size_t dev_budget = be_mem_stats(e->rt.be).dev_budget;
    if (b->total)
        log_msg(LOG_INFO, "device budget %.1f MiB (sized from the model: weights %.1f + activations %.1f + KV %.1f "
                "for %d sequences of %d tokens%s + margin %.1f MiB, at least %zu MiB; --device-mem overrides)",
                dev_budget / 1048576.0, b->weights / 1048576.0, b->activations / 1048576.0, b->kv / 1048576.0,
                b->seqs, b->ctx, b->encdec ? " and inputs of as many" : "", b->margin / 1048576.0,
                RUNTIME_MIN_DEVICE_MEM >> 20);
    else
        log_msg(LOG_INFO, "device budget %.1f MiB (%s)", dev_budget / 1048576.0,
                e->cfg.device_mem ? "--device-mem"
                                  : "the backend's own: a GPU's free memory less a reserve; --device-mem overrides");
    if (e->m)
        log_msg(LOG_INFO, "KV cache in %s (--kv-dtype), weights in %s, layers' in %s (--weights)",
                be_dtype_name(kv_store_dtype(e->store)), be_dtype_name(model_get_config(e->m)->dtype),
                be_dtype_name(model_get_weights(e->m)->layers[0].wq.dtype));
    /* default: a quarter of the device budget may hold blocks only the
     * prefix cache keeps, so they never crowd out the running requests */
    size_t prefix_mem = e->cfg.prefix_mem ? e->cfg.prefix_mem : dev_budget / 4;
    if (!e->cfg.no_prefix_cache || e->enc_cache) {
        kv_store_set_prefix_mem(e->store, prefix_mem);
        log_msg(LOG_INFO, "%s: %.1f MiB of unreferenced %s (--prefix-cache-mem), %s",
                e->enc_cache ? "encoder cache" : "prefix cache", prefix_mem / 1048576.0,
                e->enc_cache ? "cross-attention caches" : "blocks",
                e->cfg.share_prefix_cache ? "shared by every uid (--share-prefix-cache)" : "one namespace per uid");
    }
    if (e->ed && encdec_model_config(e->ed, &e->edmc) != MODEL_OK) {
        pthread_mutex_lock(&e->mu);
        e->state = ENGINE_FAILED;
        e->load.phase = "failed";
        snprintf(e->state_msg, sizeof(e->state_msg), "no host memory for the model's configuration");
        pthread_mutex_unlock(&e->mu);
        return false;
    }
    e->mc = e->ed ? &e->edmc : model_get_config(e->m);
    e->vocab = e->mc->vocab_size;
    e->ctx = model_context(e->mc, e->cfg.ctx);
    /* the model's id is its directory's name */
    char dir[sizeof(e->model_id)];
    snprintf(dir, sizeof(dir), "%s", e->cfg.model_dir);
    size_t dl = strlen(dir);
    while (dl > 1 && dir[dl - 1] == '/')
        dir[--dl] = '\0';
    const char *slash = strrchr(dir, '/');
    snprintf(e->model_id, sizeof(e->model_id), "%s", slash && slash[1] ? slash + 1 : dir);
    int32_t ids[2] = {tokenizer_bos_id(e->tok), tokenizer_eos_id(e->tok)};
    /* a special token the model has no embedding row for would fail every
     * request that starts or ends with it */
    for (int i = 0; i < 2; i++)
        if (ids[i] >= e->vocab) {
            pthread_mutex_lock(&e->mu);
            e->state = ENGINE_FAILED;
            snprintf(e->state_msg, sizeof(e->state_msg), "the tokenizer's %s id %d is past the model's %d embedding "
                     "rows (vocab_size)", i ? "eos_token" : "bos_token", ids[i], e->vocab);
            pthread_mutex_unlock(&e->mu);
            return false;
        }
    if (tokenizer_vocab_size(e->tok) > e->vocab)
        log_msg(LOG_WARN, "the tokenizer's ids %d to %d have no embedding row in the model (vocab_size %d): a text "
                "that tokenizes to one is refused", e->vocab, tokenizer_vocab_size(e->tok) - 1, e->vocab);
    char *dst[2] = {e->bos, e->eos};
    for (int i = 0; i < 2; i++) {
        char *s = NULL;
        size_t len;
        if (ids[i] >= 0 && tokenizer_decode(e->tok, &ids[i], 1, false, &s, &len) == TEXT_OK)
            snprintf(dst[i], sizeof(e->bos), "%s", s);
        free(s);
    }
    char why[TEXT_ERR_LEN], terr[TEXT_ERR_LEN];
    if (chat_tpl_load(tokenizer_chat_template(e->tok), &e->chat, why, terr) != TEXT_OK) {
        pthread_mutex_lock(&e->mu);
        e->state = ENGINE_FAILED;
        snprintf(e->state_msg, sizeof(e->state_msg), "%s", terr);
        pthread_mutex_unlock(&e->mu);
        return false;
    }
    if (why[0] && !strcmp(chat_tpl_kind(e->chat), "jinja"))
        log_msg(LOG_WARN, "the tool_use chat template does not parse as Jinja (%s); the default one renders "
                "requests with tools", why);
    else if (why[0]) /* the sniffed family stands in for a template the Jinja engine cannot parse */
        log_msg(LOG_WARN, "the chat template does not parse as Jinja (%s); rendering it as the \"%s\" family "
                "instead", why, chat_tpl_kind(e->chat));
    /* With no room, decode_stream returns the size a token's text needs. */
    char none[1];
    for (int32_t id = 0; id < tokenizer_vocab_size(e->tok); id++) {
        struct tok_stream ts = {.started = true};
        size_t need = tokenizer_decode_stream(e->tok, &ts, id, false, none, 0);
        e->max_piece = need > e->max_piece ? need : e->max_piece;
    }
    e->max_piece += 3; /* a character the token leaves unfinished, flushed as U+FFFD */
    size_t n = (size_t)e->cfg.max_seqs;
    e->batch = calloc(n, sizeof(*e->batch));
    e->batch_ch = calloc(n, sizeof(*e->batch_ch));
    e->batch_job = calloc(n, sizeof(*e->batch_job));
    e->ed_batch = e->ed ? calloc(n, sizeof(*e->ed_batch)) : NULL;
    e->logits = malloc(n * (size_t)e->vocab * sizeof(*e->logits));
    e->scratch = malloc((size_t)e->vocab * sizeof(*e->scratch));
    e->share = malloc((size_t)e->vocab * sizeof(*e->share));
    e->share_tmp = malloc((size_t)e->vocab * sizeof(*e->share_tmp));
    enum text_status gs = gram_vocab_create(e->tok, &e->gvocab);
    bool ok = e->batch && e->batch_ch && e->batch_job && (e->ed_batch || !e->ed) && e->logits && e->scratch && e->share && e->share_tmp &&
              gs == TEXT_OK;
    if (!ok)
        snprintf(err, sizeof(err), "no host memory for %d sequences' logits or the token trie", e->cfg.max_seqs);
    /* an encoder-decoder model's first request pays the first-call costs */
    ok = ok && (e->ed || warm_up(e, err));
    /* an encoder-decoder model's remote tier holds its encoder cache's
     * cross-attention caches (prefix_remote.c) */
    if (ok) {
        disk_open(e);
        prefix_remote_open(e);
    }
    pthread_mutex_lock(&e->mu);
    e->state = ok ? ENGINE_READY : ENGINE_FAILED;
    e->load.phase = ok ? "ready" : "failed";
    e->load.seconds = (clock_ms() - e->load_t0) / 1e3;
    if (!ok)
        snprintf(e->state_msg, sizeof(e->state_msg), "%s", err);
    pthread_mutex_unlock(&e->mu);
    return ok;
}

static void *engine_main(void *arg)
{
    engine *e = arg;
    double t = e->load_t0;
    bool ok = load(e);
    if (ok) {
        publish(e, 0); /* /metrics shows the device bytes the model holds from the start */
        log_msg(LOG_INFO, "model %s loaded in %.1f s: %s, %d layers, vocab %d, context %d, chat template %s",
                e->model_id, (clock_ms() - t) / 1e3, e->mc->arch_name, e->mc->n_layers, e->vocab, e->ctx,
                chat_tpl_kind(e->chat));
    }
    wake(e);
    if (ok)
        loop(e);
    fail_everything(e);
    prefix_remote_close(e);
    disk_close(e);
    return NULL;
}

enum ipc_status engine_create(const struct engine_config *cfg, int wake_fd, engine **out, struct ipc_error *err)
{
    engine *e = calloc(1, sizeof(*e));
    if (!e)
        return ipc_fail(err, IPC_ENOMEM, "", "no memory for the engine");
    e->cfg = *cfg;
    e->wake_fd = wake_fd;
    e->queue_tail = &e->queue;
    e->load = (struct engine_load){.phase = "model"};
    e->load_t0 = clock_ms();
    const char *delay = getenv("KVTIER_TEST_LOAD_DELAY_MS");
    if (delay && !args_int(delay, 0, 1000, &e->load_delay_ms))
        e->load_delay_ms = 0;
    const char *poison = getenv("KVTIER_TEST_FAIL_TOKEN");
    if (!poison || !args_int(poison, 0, INT32_MAX, &e->fail_token))
        e->fail_token = -1;
    struct engine_hists *h = &e->hists;
    if (!hist_init(&h->queue_wait, LATENCY_BOUNDS, N_BOUNDS(LATENCY_BOUNDS)) ||
        !hist_init(&h->ttft, LATENCY_BOUNDS, N_BOUNDS(LATENCY_BOUNDS)) ||
        !hist_init(&h->inter_token, TOKEN_BOUNDS, N_BOUNDS(TOKEN_BOUNDS)) ||
        !hist_init(&h->prefill_token, TOKEN_BOUNDS, N_BOUNDS(TOKEN_BOUNDS)) ||
        !hist_init(&h->decode_token, TOKEN_BOUNDS, N_BOUNDS(TOKEN_BOUNDS))) {
        free(e);
        return ipc_fail(err, IPC_EINTERNAL, "", "the histograms' bucket bounds are not ascending");
    }
    pthread_mutex_init(&e->mu, NULL);
    /* monotonic: the loop sleeps until the next idle session is due to spill */
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&e->cv, &ca);
    pthread_condattr_destroy(&ca);
    int rc = pthread_create(&e->thread, NULL, engine_main, e);
    if (rc) {
        engine_free(e);
        return ipc_fail(err, IPC_EINTERNAL, "", "cannot start the inference thread: %s", strerror(rc));
    }
    e->thread_started = true;
    *out = e;
    return IPC_OK;
}

void engine_free(engine *e)
{
    if (!e)
        return;
    if (e->thread_started) {
        pthread_mutex_lock(&e->mu);
        e->stopping = true;
        pthread_cond_signal(&e->cv);
        pthread_mutex_unlock(&e->mu);
        pthread_join(e->thread, NULL);
    }
    free_dead_sessions(e->dead);
    free_dead_sessions(e->sessions);
    runtime_close(&e->rt);
    model_config_release(&e->edmc);
    gram_vocab_free(e->gvocab);
    chat_tpl_free(e->chat);
    free(e->batch);
    free(e->batch_ch);
    free(e->batch_job);
    free(e->ed_batch);
    free(e->logits);
    free(e->scratch);
    free(e->share);
    free(e->share_tmp);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

enum engine_state engine_state(engine *e, char *msg, size_t cap)
{
    pthread_mutex_lock(&e->mu);
    enum engine_state s = e->state;
    if (msg)
        snprintf(msg, cap, "%s", e->state_msg);
    pthread_mutex_unlock(&e->mu);
    return s;
}

struct engine_load engine_load_progress(engine *e)
{
    pthread_mutex_lock(&e->mu);
    struct engine_load l = e->load;
    if (e->state == ENGINE_LOADING)
        l.seconds = (clock_ms() - e->load_t0) / 1e3;
    pthread_mutex_unlock(&e->mu);
    return l;
}

const tokenizer *engine_tokenizer(const engine *e)
{
    return e->tok;
}

const struct encdec_config *engine_encdec(const engine *e)
{
    return e->ed ? encdec_get_config(e->ed) : NULL;
}

const struct model_config *engine_model_config(const engine *e)
{
    return e->mc;
}

int engine_context(const engine *e)
{
    return e->ctx;
}

int64_t engine_static_limit(const engine *e, const struct kv_seq_params *p)
{
    bool is_static = p->strategy == KV_STATIC || p->strategy == KV_OFFLOADED_STATIC;
    return is_static && !p->window_length && model_has_full_layer(e->mc) ? p->max_cache_len : INT64_MAX;
}

enum engine_remote_share engine_remote_share(const engine *e, bool *on)
{
    *on = e->cfg.remote_url || e->cfg.remote_cluster;
    return e->cfg.remote_share;
}

const char *engine_model_id(const engine *e)
{
    return e->model_id;
}

const char *engine_model_dir(const engine *e)
{
    return e->cfg.model_dir;
}

size_t engine_max_piece(const engine *e)
{
    return e->max_piece;
}

const char *engine_bos_text(const engine *e)
{
    return e->bos;
}

const char *engine_eos_text(const engine *e)
{
    return e->eos;
}

const chat_tpl *engine_chat_template(const engine *e)
{
    return e->chat;
}
