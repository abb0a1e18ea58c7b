/* sessions.c - the engine's session table: create, delete, look up, list
 * and describe sessions and list requests (loop thread, under the engine
 * lock), and the
 * crop, fork, past-recording, KV export and import jobs the engine thread
 * runs on a session.
 * Split from engine.c, which keeps the jobs, the scheduler and the thread,
 * so that neither file passes 1,000 lines; both share engine_impl.h.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "daemon/engine_impl.h"
#include "tiers/quant.h"
#include "util/clock.h"
#include "util/log.h"

static struct session *session_find(engine *e, const char *id)
{
    for (struct session *s = e->sessions; s; s = s->next)
        if (!strcmp(s->id, id))
            return s;
    return NULL;
}

/* Owner check shared by every session endpoint: 404 unknown, 403 not yours. */
enum ipc_status session_get(engine *e, uid_t uid, const char *id, struct session **out, struct ipc_error *err)
{
    struct session *s = session_find(e, id);
    if (!s)
        return ipc_fail(err, IPC_ENOTFOUND, "session", "no session \"%.64s\"", id);
    if (s->uid != uid)
        return ipc_fail(err, IPC_EFORBIDDEN, "session", "session \"%.64s\" belongs to another user", id);
    *out = s;
    return IPC_OK;
}

/* Frees a list of sessions and their KV (engine thread, or after it ended). */
void free_dead_sessions(struct session *s)
{
    while (s) {
        struct session *next = s->next;
        kv_seq_free(s->kv);
        cross_unref(s->cross);
        free(s->input);
        free(s->toks);
        free(s->request);
        free(s);
        s = next;
    }
}

void cross_unref(struct cross_cache *c)
{
    if (!c || --c->refs > 0)
        return;
    if (c->kept)
        kv_kept_unref(c->kept);
    else
        kv_seq_free(c->kv);
    free(c);
}

void session_drop_cross(engine *e, struct session *s, bool drop_input)
{
    cross_unref(s->cross);
    s->cross = NULL;
    int32_t *input = drop_input ? s->input : NULL;
    pthread_mutex_lock(&e->mu);
    s->cross_kvs = (struct kv_seq_stats){0};
    if (drop_input) {
        s->input = NULL;
        s->n_input = 0;
    }
    pthread_mutex_unlock(&e->mu);
    free(input);
}

struct cross_cache *cross_find(engine *e, uid_t uid, const int32_t *ids, size_t n)
{
    /* the engine thread owns every session's cross and input: the lock
     * only keeps the table still.  One still loading from a restore (or
     * that failed to) stays its session's alone: it lives as long as the
     * read that fills it. */
    struct cross_cache *c = NULL;
    pthread_mutex_lock(&e->mu);
    for (struct session *s = e->sessions; s && !c; s = s->next)
        if (s->uid == uid && s->cross && s->n_input == n && !memcmp(s->input, ids, n * sizeof(*ids)) &&
            !kv_seq_loading(s->cross->kv) && kv_seq_load_status(s->cross->kv) == TIER_OK)
            c = s->cross;
    pthread_mutex_unlock(&e->mu);
    if (c)
        c->refs++;
    return c;
}

struct session *session_new(uid_t uid, const struct ipc_cache_choice *cache, bool record, const json_t *request,
                            struct ipc_error *err)
{
    struct session *s = calloc(1, sizeof(*s));
    if (!s || (request && !(s->request = json_dumps(request, JSON_COMPACT)))) {
        free(s);
        ipc_fail(err, IPC_ENOMEM, "", "no memory for a session");
        return NULL;
    }
    unsigned char rnd[8];
    if (getrandom(rnd, sizeof(rnd), 0) != (ssize_t)sizeof(rnd)) {
        ipc_fail(err, IPC_EINTERNAL, "", "getrandom failed: %s", strerror(errno));
        free(s->request);
        free(s);
        return NULL;
    }
    int n = snprintf(s->id, sizeof(s->id), "sess-");
    for (size_t i = 0; i < sizeof(rnd); i++)
        n += snprintf(s->id + n, sizeof(s->id) - (size_t)n, "%02x", rnd[i]);
    s->uid = uid;
    s->created = time(NULL);
    s->cache = *cache;
    s->record = record;
    /* kept in the request, so that its file and its forks keep it too */
    s->private_kv = json_is_true(json_object_get(request, "private"));
    s->version = 1; /* its file, none yet, holds version 0 */
    s->t_idle = clock_ms();
    return s;
}

enum ipc_status session_insert(engine *e, struct session *s, struct ipc_error *err)
{
    pthread_mutex_lock(&e->mu);
    enum ipc_status st = IPC_OK;
    if (e->draining)
        st = ipc_fail(err, IPC_EUNAVAIL, "", "kvtierd is shutting down");
    else if (e->n_sessions >= e->cfg.max_sessions)
        st = ipc_fail(err, IPC_EBUSY, "", "the session table is full (%d sessions; --max-sessions)",
                      e->cfg.max_sessions);
    if (st == IPC_OK) {
        s->next = e->sessions;
        e->sessions = s;
        e->n_sessions++;
    }
    pthread_mutex_unlock(&e->mu);
    return st;
}

enum ipc_status session_choice_check(engine *e, const struct ipc_cache_choice *cache, bool record,
                                     struct ipc_error *err)
{
    /* an empty session opens its KV only at its first request: params or a
     * format the store refuses would otherwise be found there, the session
     * left behind unusable.  The store's message and field, as kv_open
     * gives them. */
    char why[256], param[IPC_PARAM_LEN];
    enum tier_status ts = kv_store_check_params(e->store, &cache->params, why, sizeof(why));
    if (ts != TIER_OK) {
        ipc_cache_param_of(why, param);
        return tier_error(ts, param, why, err);
    }
    if (record && !kv_store_past_recording_ok(e->store, &cache->params, why, sizeof(why)))
        return ipc_fail(err, IPC_ENOTIMPL, "activate_past_recording", "%s", why);
    struct be_kvq_format fmt;
    struct kvq_error ke;
    if (cache->params.strategy == KV_QUANTIZED &&
        kvq_store_format(e->store, &cache->params.quant, &fmt, &ke) != TIER_OK) {
        ipc_cache_param_of(ke.msg, param);
        return ipc_fail(err, IPC_EINVAL, param, "%s", ke.msg);
    }
    return IPC_OK;
}

enum ipc_status engine_session_create(engine *e, uid_t uid, const struct ipc_cache_choice *cache, bool record,
                                      const json_t *request, char *id, size_t cap, struct ipc_error *err)
{
    if (session_choice_check(e, cache, record, err) != IPC_OK)
        return err->st;
    struct session *s = session_new(uid, cache, record, request, err);
    if (!s)
        return err->st;
    enum ipc_status st = session_insert(e, s, err);
    if (st == IPC_OK)
        snprintf(id, cap, "%s", s->id);
    else
        free_dead_sessions(s);
    return st;
}

/* Takes s out of the table; the engine thread frees its KV (caller holds mu). */
void session_unlink_locked(engine *e, struct session *s)
{
    struct session **pp = &e->sessions;
    while (*pp != s)
        pp = &(*pp)->next;
    *pp = s->next;
    e->n_sessions--;
    s->next = e->dead;
    e->dead = s;
    pthread_cond_signal(&e->cv);
}

enum ipc_status engine_session_delete(engine *e, uid_t uid, const char *id, struct ipc_error *err)
{
    pthread_mutex_lock(&e->mu);
    struct session *s;
    enum ipc_status st = session_get(e, uid, id, &s, err);
    if (st == IPC_OK && s->busy)
        st = ipc_fail(err, IPC_ECONFLICT, "session", "session \"%s\" is busy with a request", id);
    if (st == IPC_OK)
        session_unlink_locked(e, s);
    pthread_mutex_unlock(&e->mu);
    return st;
}

const char *engine_fallback_name(enum kv_fallback f)
{
    /* both kinds end with the KV in the host tier; how is in the log */
    return f == KV_FALLBACK_NONE ? NULL : "offloaded";
}

static json_t *session_to_json(const struct session *s)
{
    /* before its first request a session has no KV: it will use what it asked for */
    const char *used = s->n_toks ? ipc_cache_strategy_name(&s->cache, s->kvs.strategy) : s->cache.name;
    /* an encoder-decoder session's cross cache, which its forks share:
     * the store holds it once */
    json_t *enc = s->n_input ? json_pack("{s:I, s:{s:I, s:I}}", "tokens", (json_int_t)s->n_input, "bytes", "device",
                                         (json_int_t)s->cross_kvs.dev_bytes, "host",
                                         (json_int_t)s->cross_kvs.host_bytes)
                             : NULL;
    return json_pack("{s:s, s:s, s:I, s:I, s:{s:I, s:I, s:I}, s:s, s:s, s:s?, s:b, s:b, s:o*}", "id", s->id, "object",
                     "session", "created", (json_int_t)s->created, "tokens", (json_int_t)s->n_toks, "bytes", "device",
                     (json_int_t)s->kvs.dev_bytes, "host", (json_int_t)s->kvs.host_bytes, "disk",
                     (json_int_t)s->disk_bytes, "strategy", used,
                     "requested_strategy", s->cache.name, "fallback", engine_fallback_name(s->kvs.fallback),
                     "past_recording", s->record, "busy", s->busy, "encoder", enc);
}

enum ipc_status engine_session_json(engine *e, uid_t uid, const char *id, json_t **out, struct ipc_error *err)
{
    pthread_mutex_lock(&e->mu);
    struct session *s;
    enum ipc_status st = session_get(e, uid, id, &s, err);
    if (st == IPC_OK && !(*out = session_to_json(s)))
        st = ipc_fail(err, IPC_ENOMEM, "", "no memory for the reply");
    pthread_mutex_unlock(&e->mu);
    return st;
}

enum ipc_status engine_session_cache(engine *e, uid_t uid, const char *id, struct kv_seq_params *out,
                                     struct ipc_error *err)
{
    pthread_mutex_lock(&e->mu);
    struct session *s;
    enum ipc_status st = session_get(e, uid, id, &s, err);
    if (st == IPC_OK)
        *out = s->cache.params;
    pthread_mutex_unlock(&e->mu);
    return st;
}

json_t *engine_session_list(engine *e, uid_t uid)
{
    json_t *arr = json_array();
    pthread_mutex_lock(&e->mu);
    for (struct session *s = e->sessions; s && arr; s = s->next) {
        if (s->uid == uid && json_array_append_new(arr, session_to_json(s)) != 0) {
            json_decref(arr);
            arr = NULL;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return arr;
}

double session_expire_idle(engine *e, double now)
{
    /* with a disk tier an idle session is spilled instead (spill_idle_ms),
     * and stays listed: its KV comes back on its next request */
    if (e->cfg.session_ttl_s <= 0 || e->disk)
        return 0;
    double ttl = e->cfg.session_ttl_s * 1e3, next = 0;
    pthread_mutex_lock(&e->mu);
    for (struct session *s = e->sessions, *n; s; s = n) {
        n = s->next;
        if (s->busy || s->op)
            continue;
        double due = s->t_idle + ttl;
        if (due <= now) {
            log_msg(LOG_INFO, "session %s: idle for %d s (--session-ttl), dropped", s->id, e->cfg.session_ttl_s);
            session_unlink_locked(e, s);
        } else if (next == 0 || due < next) {
            next = due;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return next;
}

static json_t *request_to_json(const struct job *j, const char *state)
{
    int gen = 0;
    for (int i = 0; i < j->n; i++)
        gen += job_progress(j, i).n_gen;
    /* a running request's KV is never on disk (only an idle session's is);
     * overlap as in the response's prefetch object, once a step streamed */
    const struct kv_seq_stats *k = &j->kv_now;
    json_t *overlap = k->xfer.transfer_s > 0 ? json_real(1.0 - k->xfer.stall_s / k->xfer.transfer_s) : json_null();
    return json_pack("{s:I, s:s, s:s?, s:I, s:i, s:i, s:i, s:s, s:{s:I, s:I, s:i}, s:o}", "id", (json_int_t)j->order,
                     "state", state, "session", j->session_id[0] ? j->session_id : NULL, "prompt_tokens",
                     (json_int_t)j->n_prompt, "generated_tokens", gen, "max_tokens", j->max_new, "choices", j->n,
                     "strategy", j->cache.name, "bytes", "device", (json_int_t)k->dev_bytes, "host",
                     (json_int_t)k->host_bytes, "disk", 0, "overlap", overlap);
}

json_t *engine_request_list(engine *e, uid_t uid)
{
    json_t *arr = json_array();
    pthread_mutex_lock(&e->mu);
    for (int q = 0; q < 2 && arr; q++) {
        for (const struct job *j = q ? e->queue : e->active; j && arr; j = j->next) {
            if (j->uid != uid || j->kind != JOB_GENERATE)
                continue;
            const char *state = q ? "queued" : j->io_wait ? "restoring" : j->mem_wait ? "waiting_memory" : "running";
            if (json_array_append_new(arr, request_to_json(j, state)) != 0) {
                json_decref(arr);
                arr = NULL;
            }
        }
    }
    pthread_mutex_unlock(&e->mu);
    return arr;
}

/* The session's state after an operation, for GET and the loop thread. */
static void session_publish(engine *e, struct session *s)
{
    size_t n = s->kv ? (size_t)kv_seq_length(s->kv) : 0;
    struct kv_seq_stats kvs = s->kv ? kv_seq_stats(s->kv) : (struct kv_seq_stats){0};
    pthread_mutex_lock(&e->mu);
    s->n_toks = n < s->n_toks ? n : s->n_toks; /* a crop keeps a prefix of the ids */
    s->kvs = kvs;
    pthread_mutex_unlock(&e->mu);
}

/* A session that shares s's KV blocks copy-on-write (extents are copied),
 * in the table under a new id; an encoder-decoder session's cross cache is
 * shared whole, never copied (it is only read). */
static enum ipc_status session_fork(engine *e, struct session *s, struct session **out, struct ipc_error *err)
{
    struct session *c = session_new(s->uid, &s->cache, s->record, NULL, err);
    if (!c)
        return err->st;
    enum ipc_status st = IPC_OK;
    if (s->request && !(c->request = strdup(s->request)))
        st = ipc_fail(err, IPC_ENOMEM, "", "no host memory for the fork");
    c->private_kv = s->private_kv;
    if ((s->n_toks && !(c->toks = malloc(s->n_toks * sizeof(*c->toks)))) ||
        (s->n_input && !(c->input = malloc(s->n_input * sizeof(*c->input)))))
        st = ipc_fail(err, IPC_ENOMEM, "", "no host memory for the fork's token ids");
    enum tier_status ts = st == IPC_OK && s->kv ? kv_seq_fork(s->kv, &c->kv) : TIER_OK;
    if (ts != TIER_OK) /* a refusal is the session's cache strategy's */
        st = kv_error(e, ts, "cache", err);
    if (st == IPC_OK) {
        if (s->n_toks) /* an empty session's toks is NULL, which memcpy may not take even for 0 bytes */
            memcpy(c->toks, s->toks, s->n_toks * sizeof(*c->toks));
        c->n_toks = s->n_toks;
        c->kvs = c->kv ? kv_seq_stats(c->kv) : (struct kv_seq_stats){0};
        if (s->n_input)
            memcpy(c->input, s->input, s->n_input * sizeof(*c->input));
        c->n_input = s->n_input;
        if ((c->cross = s->cross))
            c->cross->refs++;
        c->cross_kvs = s->cross_kvs;
        st = session_insert(e, c, err);
    }
    if (st != IPC_OK) {
        free_dead_sessions(c);
        return st;
    }
    *out = c;
    return IPC_OK;
}

/* ---- KV export and import ---------------------------------------------------- */

size_t engine_kv_max_size(const engine *e)
{
    const struct model_config *c = e->mc;
    if (c->arch == ARCH_MAMBA) /* a state file: its size does not grow with the tokens, its header does */
        return kvfile_state_max_size(c->n_layers, c->intermediate_size, c->ssm_state, c->ssm_conv, e->ctx,
                                     kv_store_checkpoint_interval(e->store));
    size_t n = kvfile_max_size(e->mc->n_layers, e->mc->n_kv_heads, e->mc->head_dim, e->ctx);
    /* an encoder-decoder file adds the cross K and V of an input up to the
     * context and its ids: as much again */
    return e->ed && n <= SIZE_MAX / 2 ? 2 * n : e->ed ? 0 : n;
}

/* The rows an imported layer must have: a dynamic sequence's (the import's
 * session is a dynamic one, with the model's windows). */
static int64_t import_rows(void *ctx, int layer, int64_t n)
{
    const engine *e = ctx;
    static const struct kv_seq_params dynamic = {.strategy = KV_DYNAMIC};
    return kv_store_dense_rows(e->store, &dynamic, layer, n);
}

enum ipc_status engine_kv_cache(const engine *e, const char *quantization, struct ipc_cache_choice *out,
                                struct ipc_error *err)
{
    json_error_t je;
    json_t *c = json_loads(quantization, 0, &je);
    struct ipc_cache_model cm = {.max_len = e->ctx, .sliding_window = e->mc->sliding_window,
                                 .no_sink = model_sink_refusal(e->mc)};
    enum ipc_status st = json_is_object(c) ? ipc_cache_parse(c, NULL, &cm, out, err)
                                           : ipc_fail(err, IPC_EINVAL, "quantization", "not a JSON object");
    json_decref(c);
    /* the only caches a raw file is exported from (kv_seq_layer_quant) */
    if (st == IPC_OK &&
        (out->params.strategy != KV_QUANTIZED || out->params.sink || out->params.offload || !out->use_cache))
        st = ipc_fail(err, IPC_EINVAL, "quantization", "%s is not a quantized cache without sinks or offload",
                      out->name);
    return st;
}

/* kvfile_expect.quant: the block layout of a raw file's quantization. */
static enum model_status import_quant(void *ctx, const char *quantization, struct be_kvq_format *fmt, char *err)
{
    const engine *e = ctx;
    struct ipc_cache_choice c;
    struct ipc_error ie;
    struct kvq_error ke;
    if (engine_kv_cache(e, quantization, &c, &ie) != IPC_OK) {
        snprintf(err, MODEL_ERR_LEN, "%s: %s", ie.param, ie.msg);
        return MODEL_EINVAL;
    }
    if (kvq_store_format(e->store, &c.params.quant, fmt, &ke) != TIER_OK) {
        snprintf(err, MODEL_ERR_LEN, "%s", ke.msg);
        return MODEL_EINVAL;
    }
    return MODEL_OK;
}

enum ipc_status engine_kv_parse(const engine *e, const void *buf, size_t len, struct kvfile *out,
                                struct ipc_error *err)
{
    int tv = tokenizer_vocab_size(e->tok);
    struct kvfile_expect x = {.fingerprint = engine_fingerprint(e), .n_layers = e->mc->n_layers,
                              .n_kv_heads = e->mc->n_kv_heads, .head_dim = e->mc->head_dim,
                              /* the next request feeds at least one token */
                              .max_tokens = e->ctx - 1, .vocab_size = tv < e->vocab ? tv : e->vocab,
                              .rows = import_rows, .rows_ctx = (void *)e,
                              /* an encoder-decoder session's cross cache */
                              .max_input = e->ed ? e->ctx : 0, .quant = import_quant,
                              .raw_dtype = kv_store_dtype(e->store)};
    if (e->mc->arch == ARCH_MAMBA) {
        x.ssm_inner = e->mc->intermediate_size;
        x.ssm_state = e->mc->ssm_state;
        x.ssm_conv = e->mc->ssm_conv;
        x.ssm_ckpt_interval = kv_store_checkpoint_interval(e->store);
    }
    char msg[MODEL_ERR_LEN];
    switch (kvfile_parse(buf, len, &x, out, msg)) {
    case MODEL_OK: return IPC_OK;
    /* another model's KV, or a state where K and V are wanted (or the
     * reverse): the part of the file that says so */
    case MODEL_ECONFIG:
        return ipc_fail(err, IPC_ECONFLICT, strstr(msg, "__metadata__.layout") ? "layout" : "model_fingerprint", "%s",
                        msg);
    case MODEL_ENOMEM: return ipc_fail(err, IPC_ENOMEM, "", "%s", msg);
    /* the file is the request's body; the message names its part */
    default: return ipc_fail(err, IPC_EINVAL, "body", "%s", msg);
    }
}

/* The "quantization" metadata of a raw file: the request's cache object
 * that creates a cache of the same format. */
static char *quant_cache_json(const struct kv_seq_params *p)
{
    const struct kv_quant_params *q = &p->quant;
    json_t *c = q->backend == KVQ_FP8
                    ? json_pack("{s:s, s:s}", "implementation", "quantized", "backend", "fp8")
                    : json_pack("{s:s, s:s, s:i, s:i, s:i, s:i, s:i}", "implementation", "quantized", "backend",
                                kv_quant_backend_name(q->backend), "nbits", q->nbits, "axis_key", q->axis_key,
                                "axis_value", q->axis_value, "q_group_size", q->q_group_size, "residual_length",
                                q->residual_length);
    if (c && p->window_length && json_object_set_new(c, "window_length", json_integer(p->window_length))) {
        json_decref(c);
        c = NULL;
    }
    char *text = c ? json_dumps(c, JSON_COMPACT) : NULL;
    json_decref(c);
    return text;
}

/* Tensors of a raw layer: K then V, each its codes and its scales (affine
 * pairs or the e4m3 tensor scale), then the residual's K and V. */
#define RAW_PER_LAYER 6

static void raw_tensors(const struct kv_quant_layer *ql, int l, int H, int D, enum be_dtype dt,
                        struct kvfile_tensor *t)
{
    const struct be_kvq_format *f = ql->fmt;
    for (int half = 0; half < 2; half++) {
        const struct be_kvq_half *h = half ? &f->v : &f->k;
        const char *kv = half ? "value" : "key";
        struct kvfile_tensor *c = &t[2 * half], *sc = &t[2 * half + 1];
        *c = (struct kvfile_tensor){.dtype = "U8", .ndim = 4,
                                    .shape = {ql->n_blocks, H, f->block_tokens, D * f->nbits / 8}};
        snprintf(c->name, sizeof(c->name), "past_key_values.%d.%s.qdata", l, kv);
        if (f->kind == BE_KVQ_E4M3) {
            *sc = (struct kvfile_tensor){.dtype = "F32", .ndim = 1, .shape = {1}};
            snprintf(sc->name, sizeof(sc->name), "past_key_values.%d.%s.qscale", l, kv);
        } else {
            *sc = (struct kvfile_tensor){.dtype = "F16", .ndim = 5,
                                         .shape = {ql->n_blocks, H, f->block_tokens / h->gt, D / h->gd, 2}};
            snprintf(sc->name, sizeof(sc->name), "past_key_values.%d.%s.qparams", l, kv);
        }
        t[4 + half] = (struct kvfile_tensor){.dtype = kvfile_dtype_name(dt), .ndim = 4,
                                             .shape = {1, H, ql->residual, D}};
        snprintf(t[4 + half].name, sizeof(t[4 + half].name), "past_key_values.%d.%s", l, kv);
    }
}

/* Moves a layer's n whole blocks to (or, to_blocks, from) its code and
 * affine parameter tensors; the e4m3 scales travel apart. */
/* Bytes of one block's code rows (one token's: *row) and of one half's
 * group parameters (one group row's: *prow; 0 for e4m3, which has none). */
static size_t raw_code_bytes(const struct be_kvq_format *f, size_t *row)
{
    *row = (size_t)f->head_dim * (size_t)f->nbits / 8;
    return (size_t)f->n_kv_heads * (size_t)f->block_tokens * *row;
}

static size_t raw_param_bytes(const struct be_kvq_format *f, const struct be_kvq_half *h, size_t *prow)
{
    *prow = f->kind == BE_KVQ_E4M3 ? 0 : (size_t)(f->head_dim / h->gd) * 4; /* an f16 pair per group */
    return (size_t)f->n_kv_heads * (size_t)(f->block_tokens / h->gt) * *prow;
}

static void raw_move(const struct be_kvq_format *f, int n, char *const codes[2], char *const params[2], char *blocks,
                     bool to_blocks)
{
    size_t row, prow, cb = raw_code_bytes(f, &row);
    for (int half = 0; half < 2; half++) {
        const struct be_kvq_half *h = half ? &f->v : &f->k;
        size_t pb = raw_param_bytes(f, h, &prow);
        for (int b = 0; b < n; b++) {
            char *blk = blocks + (size_t)b * f->block_bytes, *c = codes[half] + (size_t)b * cb;
            memcpy(to_blocks ? blk + h->codes : c, to_blocks ? c : blk + h->codes, cb);
            if (pb) {
                char *p = params[half] + (size_t)b * pb;
                memcpy(to_blocks ? blk + h->params : p, to_blocks ? p : blk + h->params, pb);
            }
        }
    }
}

/* Zeroes the code rows and group parameters of the positions attention
 * does not read ([lo, nq) are read): the store leaves a block's unused rows
 * as the memory was, which may have held another sequence's KV. */
static void raw_clear_unused(const struct kv_quant_layer *ql, char *const codes[2], char *const params[2])
{
    const struct be_kvq_format *f = ql->fmt;
    int64_t T = f->block_tokens, H = f->n_kv_heads;
    size_t row, pr, cb = raw_code_bytes(f, &row);
    for (int half = 0; half < 2; half++) {
        const struct be_kvq_half *h = half ? &f->v : &f->k;
        int64_t gt = h->gt;
        size_t pb = raw_param_bytes(f, h, &pr);
        for (int b = 0; b < ql->n_blocks; b++) {
            int64_t p0 = (ql->first_block + b) * T;
            for (int64_t t = 0; t < T; t++)
                if (p0 + t < ql->lo || p0 + t >= ql->nq)
                    for (int64_t k = 0; k < H; k++)
                        memset(codes[half] + (size_t)b * cb + (size_t)(k * T + t) * row, 0, row);
            for (int64_t g = 0; pb && g < T / gt; g++) /* a group row is kept if any of its positions is read */
                if (p0 + (g + 1) * gt <= ql->lo || p0 + g * gt >= ql->nq)
                    for (int64_t k = 0; k < H; k++)
                        memset(params[half] + (size_t)b * pb + (size_t)(k * (T / gt) + g) * pr, 0, pr);
        }
    }
}

/* Scatters a layer's whole blocks into its code and scale tensors. */
static void raw_fill(char *file, const struct kv_quant_layer *ql, const struct kvfile_tensor *t, char *blocks)
{
    char *const codes[2] = {file + t[0].off, file + t[2].off}, *const params[2] = {file + t[1].off, file + t[3].off};
    raw_move(ql->fmt, ql->n_blocks, codes, params, blocks, false);
    raw_clear_unused(ql, codes, params);
    if (ql->fmt->kind == BE_KVQ_E4M3) {
        memcpy(file + t[1].off, &ql->scale_k, sizeof(float));
        memcpy(file + t[3].off, &ql->scale_v, sizeof(float));
    }
}

/* ?raw=1 on a quantized session: the stored form (docs/api.md "Raw
 * quantized export"); an encoder-decoder session's cross cache, dense,
 * after each layer's. */
static enum ipc_status session_export_raw(engine *e, struct session *s, struct job *j, struct ipc_error *err)
{
    int L = e->mc->n_layers, H = e->mc->n_kv_heads, D = e->mc->head_dim, per = RAW_PER_LAYER + (e->ed ? 2 : 0);
    struct kv_quant_layer *ql = calloc((size_t)L, sizeof(*ql));
    struct kvfile_tensor *t = calloc((size_t)L * (size_t)per, sizeof(*t));
    json_t *layers = json_array();
    enum ipc_status st = ql && t && layers ? IPC_OK : ipc_fail(err, IPC_ENOMEM, "", "no host memory for the export");
    size_t max_blocks = 0;
    for (int l = 0; l < L && st == IPC_OK; l++) {
        enum tier_status ts = kv_seq_layer_quant(s->kv, l, &ql[l]);
        if (ts != TIER_OK) {
            st = kv_error(e, ts, "raw", err);
            break;
        }
        raw_tensors(&ql[l], l, H, D, kv_store_dtype(e->store), t + (size_t)l * (size_t)per);
        for (int half = 0; half < per - RAW_PER_LAYER; half++) {
            struct kvfile_tensor *c = t + (size_t)l * (size_t)per + RAW_PER_LAYER + half;
            *c = (struct kvfile_tensor){.dtype = "F32", .ndim = 4, .shape = {1, H, (int64_t)s->n_input, D}};
            snprintf(c->name, sizeof(c->name), "past_key_values.%d.%s", l, half ? "cross_value" : "cross_key");
        }
        size_t nb = (size_t)ql[l].n_blocks * ql[l].fmt->block_bytes;
        max_blocks = nb > max_blocks ? nb : max_blocks;
        if (json_array_append_new(layers, json_pack("[I,I,I]", (json_int_t)ql[l].lo, (json_int_t)ql[l].nq,
                                                    (json_int_t)ql[l].first_block)))
            st = ipc_fail(err, IPC_ENOMEM, "", "no host memory for the export");
    }
    char *cache = st == IPC_OK ? quant_cache_json(&s->cache.params) : NULL;
    char *lay = st == IPC_OK ? json_dumps(layers, JSON_COMPACT) : NULL, bt[16];
    snprintf(bt, sizeof(bt), "%d", st == IPC_OK ? ql[0].fmt->block_tokens : 0);
    if (st == IPC_OK && (!cache || !lay))
        st = ipc_fail(err, IPC_ENOMEM, "", "no host memory for the export");
    const char *meta[] = {"layout", "quantized", "quantization", cache, "q_block_tokens", bt, "q_layers", lay, NULL};
    struct kvfile_info in = {.fingerprint = engine_fingerprint(e),
                             .strategy = ipc_cache_strategy_name(&s->cache, s->kvs.strategy),
                             .dtype = kv_store_dtype(e->store), .n_layers = L, .n_kv_heads = H, .head_dim = D,
                             .tokens = s->toks, .n_tokens = (int64_t)s->n_toks,
                             .input = e->ed ? s->input : NULL, .n_input = e->ed ? (int64_t)s->n_input : 0};
    char msg[MODEL_ERR_LEN];
    void *buf = NULL, *blocks = NULL;
    size_t size = 0;
    if (st == IPC_OK && kvfile_build_tensors(&in, meta, t, L * per, &buf, &size, msg) != MODEL_OK)
        st = ipc_fail(err, IPC_ENOMEM, "", "%s", msg);
    /* a sliding layer may hold no block; malloc(0) may return NULL */
    if (st == IPC_OK && !(blocks = malloc(max_blocks ? max_blocks : 1)))
        st = ipc_fail(err, IPC_ENOMEM, "", "no host memory for the export");
    for (int l = 0; l < L && st == IPC_OK; l++) {
        const struct kvfile_tensor *lt = t + (size_t)l * (size_t)per;
        enum tier_status ts = kv_seq_layer_quant_read(s->kv, l, blocks, (char *)buf + lt[4].off,
                                                      (char *)buf + lt[5].off);
        if (ts == TIER_OK && e->ed)
            ts = kv_seq_layer_dense(s->cross->kv, l, BE_F32, (char *)buf + lt[6].off, (char *)buf + lt[7].off);
        if (ts != TIER_OK)
            st = kv_error(e, ts, "", err);
        else
            raw_fill(buf, &ql[l], lt, blocks);
    }
    free(blocks);
    free(cache);
    free(lay);
    json_decref(layers);
    free(t);
    free(ql);
    if (st != IPC_OK) {
        free(buf);
        return st;
    }
    j->res.blob = buf;
    j->res.n_blob = size;
    return IPC_OK;
}

/* A state model's session: its state and checkpoints (kvfile.h). */
static enum ipc_status session_export_state(engine *e, struct session *s, struct job *j, struct ipc_error *err)
{
    const struct model_config *c = e->mc;
    size_t n = kv_store_state_bytes(e->store) / 2;
    int n_ckpt = 0;
    enum tier_status ts = kv_seq_state_checkpoints(s->kv, &n_ckpt);
    if (ts != TIER_OK)
        return kv_error(e, ts, "", err);
    float *state = malloc((1 + (size_t)n_ckpt) * n);
    int64_t *pos = malloc(((size_t)n_ckpt + 1) * sizeof(*pos));
    if (!state || !pos) {
        free(state);
        free(pos);
        return ipc_fail(err, IPC_ENOMEM, "", "no host memory for the export of a state and %d checkpoints", n_ckpt);
    }
    ts = kv_seq_state_read(s->kv, state, (1 + (size_t)n_ckpt) * n, pos, n_ckpt);
    enum ipc_status st = ts == TIER_OK ? IPC_OK : kv_error(e, ts, "", err);
    struct kvfile_info in = {.fingerprint = engine_fingerprint(e),
                             .strategy = ipc_cache_strategy_name(&s->cache, s->kvs.strategy), .dtype = BE_F32,
                             /* the state's tokens: a crop whose feed failed left it short of them */
                             .n_layers = c->n_layers, .tokens = s->toks, .n_tokens = kv_seq_length(s->kv)};
    char msg[MODEL_ERR_LEN];
    void *buf = NULL;
    size_t size = 0;
    if (st == IPC_OK && kvfile_build_state(&in, c->intermediate_size, c->ssm_state, c->ssm_conv, state, pos, n_ckpt,
                                           &buf, &size, msg) != MODEL_OK)
        st = ipc_fail(err, IPC_ENOMEM, "", "%s", msg);
    free(state);
    free(pos);
    if (st != IPC_OK)
        return st;
    j->res.blob = buf;
    j->res.n_blob = size;
    return IPC_OK;
}

/* The session's KV as a safetensors file in j->res.blob: dense layers as
 * stored, quantized ones decoded to f32 (or in their stored form, raw);
 * an encoder-decoder session's cross cache and input with it; a state
 * model's state and checkpoints. */
static enum ipc_status session_export(engine *e, struct session *s, struct job *j, struct ipc_error *err)
{
    if (!s->kv || !s->n_toks || (e->ed && !s->cross))
        return ipc_fail(err, IPC_ECONFLICT, "session", "session \"%s\" holds no KV yet", s->id);
    if (e->mc->arch == ARCH_MAMBA)
        return session_export_state(e, s, j, err);
    if (j->raw && s->kvs.strategy == KV_QUANTIZED)
        return session_export_raw(e, s, j, err);
    int L = e->mc->n_layers, per = e->ed ? 4 : 2; /* K and V, and the cross K and V */
    int64_t *rows = calloc((size_t)L, sizeof(*rows));
    size_t *off = calloc((size_t)per * (size_t)L, sizeof(*off));
    enum ipc_status st = rows && off ? IPC_OK : ipc_fail(err, IPC_ENOMEM, "", "no host memory for the export");
    for (int l = 0; l < L && st == IPC_OK; l++)
        rows[l] = kv_seq_layer_rows(s->kv, l);
    enum be_dtype dt = s->kvs.strategy == KV_QUANTIZED ? BE_F32 : kv_store_dtype(e->store);
    struct kvfile_info in = {.fingerprint = engine_fingerprint(e),
                             .strategy = ipc_cache_strategy_name(&s->cache, s->kvs.strategy), .dtype = dt,
                             .n_layers = L, .n_kv_heads = e->mc->n_kv_heads, .head_dim = e->mc->head_dim,
                             .rows = rows, .tokens = s->toks, .n_tokens = (int64_t)s->n_toks,
                             .input = e->ed ? s->input : NULL, .n_input = e->ed ? (int64_t)s->n_input : 0};
    char msg[MODEL_ERR_LEN];
    void *buf = NULL;
    size_t size = 0, *voff = off + (size_t)per / 2 * (size_t)L;
    if (st == IPC_OK && kvfile_build(&in, &buf, &size, off, voff, msg) != MODEL_OK)
        st = ipc_fail(err, IPC_ENOMEM, "", "%s", msg);
    for (int i = 0; i < per / 2 * L && st == IPC_OK; i++) {
        kv_seq *q = i < L ? s->kv : s->cross->kv;
        enum tier_status ts = kv_seq_layer_dense(q, i % L, dt, (char *)buf + off[i], (char *)buf + voff[i]);
        if (ts != TIER_OK)
            st = kv_error(e, ts, "", err);
    }
    free(rows);
    free(off);
    if (st != IPC_OK) {
        free(buf);
        return st;
    }
    j->res.blob = buf;
    j->res.n_blob = size;
    return IPC_OK;
}

/* A raw file's KV as stored, loaded whole (kv_seq_load_quant): the
 * blocks are gathered back from the code and parameter tensors. */
static enum ipc_status import_raw(engine *e, const struct kvfile *f, const struct kv_seq_params *p, kv_seq **out,
                                  struct ipc_error *err)
{
    int L = e->mc->n_layers;
    struct kv_quant_layer_in *in = calloc((size_t)L, sizeof(*in));
    bool ok = in;
    for (int l = 0; l < L && ok; l++) {
        const struct kvfile_qlayer *fq = &f->q[l];
        /* calloc: the bytes of a block no tensor holds stay zero */
        char *blocks = calloc((size_t)fq->n_blocks + 1, f->fmt.block_bytes);
        if (!(ok = blocks))
            break;
        char *const codes[2] = {(char *)fq->codes[0], (char *)fq->codes[1]},
                    *const params[2] = {(char *)fq->params[0], (char *)fq->params[1]};
        raw_move(&f->fmt, fq->n_blocks, codes, params, blocks, true);
        in[l] = (struct kv_quant_layer_in){
            .d = {.fmt = &f->fmt, .lo = fq->lo, .nq = fq->nq, .first_block = fq->first_block,
                  .residual = fq->residual, .n_blocks = fq->n_blocks, .scale_k = fq->scale[0],
                  .scale_v = fq->scale[1]},
            .blocks = blocks, .k = fq->res[0], .v = fq->res[1]};
    }
    enum ipc_status st = IPC_OK;
    if (!ok)
        st = ipc_fail(err, IPC_ENOMEM, "", "no host memory for the imported blocks");
    else {
        enum tier_status ts = kv_seq_load_quant(e->store, p, f->n_tokens, in, out);
        if (ts != TIER_OK)
            st = kv_error(e, ts, "body", err);
    }
    for (int l = 0; in && l < L; l++)
        free((void *)in[l].blocks);
    free(in);
    return st;
}

/* An encoder-decoder file's cross cache, for s, which takes its input. */
static enum ipc_status import_cross(engine *e, struct session *s, struct kvfile *f, struct ipc_error *err)
{
    struct cross_cache *cc = malloc(sizeof(*cc));
    kv_seq *q = NULL;
    if (!cc)
        return ipc_fail(err, IPC_ENOMEM, "", "no host memory for the imported cross-attention cache");
    enum tier_status ts = kv_seq_create(e->store, &(struct kv_seq_params){.no_prefix_cache = true}, &q);
    /* a raw file's dtype is its residual's; its cross K and V are f32 */
    if (ts == TIER_OK)
        ts = kv_seq_import_dense(q, f->n_input, f->q ? BE_F32 : f->dtype, f->ck, f->cv);
    if (ts != TIER_OK) {
        kv_seq_free(q);
        free(cc);
        return kv_error(e, ts, "body", err);
    }
    *cc = (struct cross_cache){.kv = q, .refs = 1};
    struct kv_seq_stats k = kv_seq_stats(q);
    s->cross = cc;
    s->input = f->input;
    f->input = NULL;
    pthread_mutex_lock(&e->mu);
    s->n_input = (size_t)f->n_input;
    s->cross_kvs = k;
    pthread_mutex_unlock(&e->mu);
    return IPC_OK;
}

/* Fills the job's new session with the file's KV and tokens (and an
 * encoder-decoder file's cross cache and input). */
static enum ipc_status session_import(engine *e, struct session *s, struct job *j, struct ipc_error *err)
{
    struct kvfile *f = &j->kvf;
    if (s->kv || s->n_toks)
        return ipc_fail(err, IPC_ECONFLICT, "session", "session \"%s\" is not empty", s->id);
    int32_t *toks = malloc((size_t)f->n_tokens * sizeof(*toks));
    if (!toks)
        return ipc_fail(err, IPC_ENOMEM, "", "no host memory for the imported token ids");
    struct kv_seq_params p = s->cache.params;
    p.prefix_ns = e->cfg.share_prefix_cache ? 0 : (uint64_t)s->uid + 1;
    kv_seq *q = NULL;
    if (f->n_input) {
        enum ipc_status st = import_cross(e, s, f, err);
        if (st != IPC_OK) {
            free(toks);
            return st;
        }
    }
    if (f->q) {
        enum ipc_status st = import_raw(e, f, &p, &q, err);
        if (st != IPC_OK) {
            free(toks);
            return st;
        }
    } else if (f->state) {
        enum tier_status ts = kv_seq_load_state(e->store, &p, f->n_tokens, f->state, f->ckpt_pos, f->n_ckpt, &q);
        if (ts != TIER_OK) {
            free(toks);
            return kv_error(e, ts, "body", err);
        }
    } else {
        enum tier_status ts = kv_seq_create(e->store, &p, &q);
        if (ts == TIER_OK)
            ts = kv_seq_import_dense(q, f->n_tokens, f->dtype, f->k, f->v);
        if (ts != TIER_OK) {
            kv_seq_free(q);
            free(toks);
            return kv_error(e, ts, "body", err);
        }
    }
    memcpy(toks, f->tokens, (size_t)f->n_tokens * sizeof(*toks));
    pthread_mutex_lock(&e->mu);
    s->kv = q;
    s->toks = toks;
    s->n_toks = (size_t)f->n_tokens;
    pthread_mutex_unlock(&e->mu);
    return IPC_OK;
}

/* A state model's crop goes back to the last checkpoint at or below what
 * it was asked to leave (tiers/state.c): the session's tokens from there
 * to target are fed again, so it holds what the crop said, as a KV
 * session would.  A failure leaves the session at the checkpoint, which
 * is as valid (the next request feeds the rest). */
static void crop_refeed(engine *e, struct session *s, int64_t target, struct ipc_error *err)
{
    int64_t len = kv_seq_length(s->kv);
    if (len >= target || (size_t)target > s->n_toks || target - len > INT32_MAX)
        return;
    struct fw_seq f = {.kv = s->kv, .tokens = s->toks + len, .n_tokens = (int)(target - len)};
    enum model_status st = model_forward(e->m, &f, 1);
    if (st != MODEL_OK)
        ipc_fail(err, st == MODEL_ENOMEM || st == MODEL_EDEVMEM ? IPC_ESTORAGE : IPC_EINTERNAL, "",
                 "crop: feeding %lld tokens after the state's checkpoint: %s", (long long)(target - len),
                 model_strerror(st));
}

/* Crop, fork or past recording on the job's session.  They run here, on
 * the engine thread, because the store is not shared with the loop thread;
 * the job ends at once. */
void session_run_op(engine *e, struct job *j)
{
    struct session *s = j->sess, *child = NULL;
    struct ipc_error err = {0};
    enum tier_status ts = TIER_OK;
    if (j->kind == JOB_CROP && s->kv) { /* an empty session has nothing to crop */
        int64_t len = kv_seq_length(s->kv);
        ts = kv_seq_crop(s->kv, j->op_n);
        if (ts != TIER_OK)
            kv_error(e, ts, "n", &err);
        else /* |op_n| is within KV_SEQ_MAX_LEN now */
            crop_refeed(e, s, j->op_n > 0 ? (j->op_n < len ? j->op_n : len) : (-j->op_n < len ? len + j->op_n : 0),
                        &err);
    } else if (e->ed && j->kind == JOB_RECORD) {
        ipc_fail(&err, IPC_EINVAL, "", "an encoder-decoder model's decoder attends to all its tokens: there are no "
                 "past states to record");
    } else if (j->kind == JOB_RECORD) {
        char why[160];
        if (s->kv && (ts = kv_seq_activate_past_recording(s->kv)) != TIER_OK)
            kv_error(e, ts, "cache", &err);
        else if (!s->kv && !kv_store_past_recording_ok(e->store, &s->cache.params, why, sizeof(why)))
            ipc_fail(&err, IPC_ENOTIMPL, "cache", "%s", why); /* refused now, not at its first request */
    } else if (j->kind == JOB_FORK) {
        session_fork(e, s, &child, &err);
    } else if (j->kind == JOB_EXPORT) {
        session_export(e, s, j, &err);
    } else if (j->kind == JOB_IMPORT) {
        session_import(e, s, j, &err);
    }
    if (j->kind != JOB_FORK && j->kind != JOB_EXPORT)
        s->version++; /* its file, if any, no longer holds its KV */
    session_publish(e, s);
    pthread_mutex_lock(&e->mu);
    if (j->kind == JOB_RECORD && err.st == IPC_OK)
        s->record = true;
    if (child)
        snprintf(j->res.reply_id, sizeof(j->res.reply_id), "%s", child->id);
    pthread_mutex_unlock(&e->mu);
    if (err.st != IPC_OK)
        job_fail(e, j, &err);
    j->ch[0].seq.finish = GEN_FINISH_LENGTH;
}
