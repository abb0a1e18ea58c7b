/* spill.c - the sessions' side of the disk tier (docs/persistence.md).
 *
 * A session is written to the disk tier as one object: its KV image
 * (kv_seq_save; an encoder-decoder session's, the decoder's image then its
 * cross-attention cache's) and a JSON meta with what the table needs to
 * list it again (id, owner, creation time, the cache choice as the client
 * sent it, past recording, the token ids, the encoder input).  Files are kept per owner (namespace
 * "u<uid>"), so one uid's files are never named by another's requests.
 *
 * When: a session idle for --spill-after, or the least recently used idle
 * one when a step finds the memory tiers full, is written and, once the
 * write is complete and the session was not used meanwhile, its KV leaves
 * memory.  The next request on it reads the object back; other requests
 * keep running meanwhile, since the disk tier's own thread does the I/O.
 * Layer by layer: as soon as the image's head (its layer table) is in, the
 * session gets its KV, allocated and empty (kv_seq_load_begin), and a
 * request that only appends to its tokens starts: each layer is filled
 * from the image when the forward pass reaches it, waiting there for its
 * bytes if they are still on their way (restore_src), so the first
 * layers compute while the last are read; an encoder-decoder session's
 * cross cache, whose image follows the decoder's, the same way once its
 * head is in too (the meta says where it starts).  A request that would
 * rewind the KV (or copy it: fork, export) waits for the whole read
 * instead.  At exit every session whose file is
 * not current is written; at start the files a previous run left are
 * listed as sessions again and restored by their first request.
 *
 * A write that fails keeps the KV where it was; a read that fails (a file
 * quarantined as corrupt, an I/O error) costs the session its KV, never its
 * correctness: the next request computes the tokens again, and so does one
 * whose step found a layer's bytes missing part-way (disk_restore_lost).
 *
 * Images: a spill's image and a restore's buffer are 4 KiB-aligned and
 * sized by kv_disk_data_alloc_len, so the disk tier moves raw chunks
 * between them and the file with no staging copy.  Where the KV lives on
 * a device (the backend's memory is not unified with the host's) they come
 * from the backend's host memory, page-locked, so a restore goes disk ->
 * pinned memory -> device; on the CPU backend, whose host memory is mapped
 * and locked up front (0.2 s for an 8k image, serial before the first
 * read), from the heap, whose pages the reads fault in as they go.  They
 * are freed on the disk tier's thread (kv_disk_defer): unmapping a GB-sized
 * image costs a tenth of a second or more.
 *
 * Versions: every change to a session's KV or ids bumps s->version; its
 * file holds s->disk_version.  A file older than the KV in memory is a
 * consistent snapshot of an earlier state, replaced by the next spill.
 * Everything here runs on the engine thread except notify().
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/engine_impl.h"
#include "model/encdec.h"
#include "model/model.h"
#include "util/clock.h"
#include "util/log.h"

#define META_FORMAT 1

void engine_io_notify(void *arg)
{
    engine *e = arg;
    pthread_mutex_lock(&e->mu);
    e->io_event = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

static void ns_of(uid_t uid, char out[24])
{
    snprintf(out, 24, "u%u", (unsigned)uid);
}

static json_t *ids_json(const int32_t *ids, size_t n)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < n; i++)
        if (json_array_append_new(a, json_integer(ids[i])) != 0) {
            json_decref(a);
            a = NULL;
        }
    return a;
}

/* {"kvtier_session": 1, "id", "uid", "created", "record", "request",
 *  "tokens": [...]}: what the table needs to list the session again.  An
 * encoder-decoder session adds "encoder": {"input": [...], "self_image":
 * bytes}: its encoder input, and where the input's cross cache's image
 * starts in the data, after the decoder cache's (at its end: none, the
 * cache was lost and the input will be encoded again). */
static char *meta_json(const struct session *s, size_t self_image)
{
    json_t *req = NULL, *toks = ids_json(s->toks, s->n_toks);
    json_t *enc = s->n_input ? json_pack("{s:o, s:I}", "input", ids_json(s->input, s->n_input), "self_image",
                                         (json_int_t)self_image)
                             : NULL;
    if ((s->request && !(req = json_loads(s->request, 0, NULL))) || (s->n_input && !enc)) {
        json_decref(toks);
        json_decref(req);
        json_decref(enc);
        return NULL;
    }
    json_t *o = toks ? json_pack("{s:i, s:s, s:I, s:I, s:b, s:o*, s:o, s:o*}", "kvtier_session", META_FORMAT, "id",
                                 s->id, "uid", (json_int_t)s->uid, "created", (json_int_t)s->created, "record",
                                 s->record, "request", req, "tokens", toks, "encoder", enc)
                     : NULL;
    if (!o) {
        json_decref(req);
        json_decref(enc);
    }
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return text;
}

bool image_pinned(const engine *e)
{
    return !be_get_caps(e->rt.be).unified_memory;
}

static void free_image(void *arg, void *p)
{
    if (image_pinned(arg))
        be_buffer_free(p);
    else
        free(p);
}

/* An image buffer of len bytes (a handle for free_image), *data its first
 * byte; the disk tier's allocator for a restore (runs on its thread). */
static void *image_alloc(void *arg, size_t len, void **data)
{
    engine *e = arg;
    if (!image_pinned(e))
        return kv_disk_heap_alloc(NULL, len, data);
    be_buffer *b = NULL;
    if (be_host_alloc(e->rt.be, len, &b) != BE_OK)
        return NULL;
    *data = be_buffer_data(b);
    return b;
}

/* Frees an image off the engine thread: the disk tier's thread takes it
 * after the ops already queued. */
static void image_release(engine *e, void *img)
{
    if (img)
        kv_disk_defer(e->disk, free_image, e, img);
}

/* Whether s's cross cache is still loading from s's op: a loading cache
 * is never shared (cross_find), so one s holds is its own restore's. */
static bool cross_loading(const struct session *s)
{
    return s->cross && kv_seq_loading(s->cross->kv);
}

static void op_clear(engine *e, struct session *s)
{
    /* a sequence loading from the op's buffer is filled (or fails) first:
     * none outlives its source */
    if (s->op_restore && ((s->kv && kv_seq_loading(s->kv)) || cross_loading(s))) {
        kv_disk_op_wait(s->op);
        if (s->kv)
            kv_seq_load_finish(s->kv);
        if (s->cross)
            kv_seq_load_finish(s->cross->kv);
    }
    kv_disk_op_free(s->op);
    s->op = NULL;
    if (s->op_restore) {
        pthread_mutex_lock(&e->mu);
        e->st.restore_early_layers += s->op_early;
        pthread_mutex_unlock(&e->mu);
        s->op_early = 0;
    }
    image_release(e, s->op_img);
    s->op_img = NULL;
    free(s->op_meta);
    s->op_meta = NULL;
    e->n_ops--;
    if (!s->op_restore)
        e->n_spilling--;
}

void engine_count(engine *e, uint64_t *counter)
{
    pthread_mutex_lock(&e->mu);
    (*counter)++;
    pthread_mutex_unlock(&e->mu);
}

/* A spill that failed is not tried again for a while: the disk is full or
 * failing, and a step waiting for memory must not spin on it. */
static void spill_backoff(engine *e, struct session *s)
{
    int s_after = e->cfg.spill_after_s > 10 ? e->cfg.spill_after_s : 10;
    s->t_idle = clock_ms();
    s->spill_retry_at = s->t_idle + s_after * 1e3;
}

const char *engine_spill_why_name(enum engine_spill_why why)
{
    static const char *const names[ENGINE_N_SPILL_WHY] = {"idle", "memory", "exit"};
    return (unsigned)why < ENGINE_N_SPILL_WHY ? names[why] : "unknown";
}

/* Starts writing s: its image is taken now, so the session may be used
 * while the write is in flight.  An idle session's file is compressed
 * (cold); one in the way of a step or of the exit is not. */
static bool spill_start(engine *e, struct session *s, enum engine_spill_why reason)
{
    bool cold = reason == ENGINE_SPILL_IDLE;
    /* an encoder-decoder session's cross cache follows the decoder's */
    size_t n_self = s->kv ? kv_seq_image_size(s->kv) : 0, n = n_self + (s->cross ? kv_seq_image_size(s->cross->kv) : 0);
    void *data = NULL, *img = n ? image_alloc(e, kv_disk_data_alloc_len(n), &data) : NULL;
    char *meta = meta_json(s, n_self);
    const char *why = NULL;
    if ((n && !img) || !meta)
        why = "no host memory for its image";
    else if ((n_self && kv_seq_save(s->kv, data, n_self) != TIER_OK) ||
             (s->cross && kv_seq_save(s->cross->kv, (char *)data + n_self, n - n_self) != TIER_OK))
        why = kv_store_errmsg(e->store);
    char ns[24];
    ns_of(s->uid, ns);
    enum tier_status ts = TIER_OK;
    if (!why) {
        struct kv_disk_obj o = {.meta = meta, .meta_len = strlen(meta), .data = data, .data_len = n, .cold = cold};
        if ((ts = kv_disk_put(e->disk, ns, s->id, &o, &s->op)) != TIER_OK)
            why = kv_disk_errmsg(e->disk)[0] ? kv_disk_errmsg(e->disk) : tier_strerror(ts);
    }
    if (why) {
        log_msg(ts == TIER_EFULL ? LOG_DEBUG : LOG_WARN, "session %s: not spilled to disk: %s", s->id, why);
        if (img)
            free_image(e, img);
        free(meta);
        s->op = NULL;
        engine_count(e, &e->st.disk_errors);
        spill_backoff(e, s);
        return false;
    }
    s->op_len = n + strlen(meta);
    s->op_cross = s->cross;
    s->op_restore = false;
    s->op_version = s->version;
    s->op_why = reason;
    s->op_img = img;
    s->op_meta = meta;
    e->n_ops++;
    e->n_spilling++;
    return true;
}

/* Drops s's KV (and its reference to a cross cache; the input's ids stay:
 * listed, and encoded again should the file be lost) from memory once its
 * file holds it. */
static void spill_release(engine *e, struct session *s)
{
    kv_seq_free(s->kv);
    s->kv = NULL;
    session_drop_cross(e, s, false);
    pthread_mutex_lock(&e->mu);
    /* listed with the strategy it ran with, nothing in memory */
    s->kvs = (struct kv_seq_stats){.strategy = s->kvs.strategy, .fallback = s->kvs.fallback};
    pthread_mutex_unlock(&e->mu);
}

/* Whether s holds KV in memory that its file could stand for. */
static bool in_memory(const struct session *s)
{
    return s->kv || s->cross;
}

static void spill_done(engine *e, struct session *s)
{
    enum tier_status ts = kv_disk_op_status(s->op);
    if (ts != TIER_OK) {
        log_msg(LOG_WARN, "session %s: spill to disk failed, its KV stays in memory: %s", s->id,
                kv_disk_op_errmsg(s->op));
        engine_count(e, &e->st.disk_errors);
        spill_backoff(e, s);
        op_clear(e, s);
        return;
    }
    s->disk_version = s->op_version;
    s->disk_cross = s->op_cross;
    pthread_mutex_lock(&e->mu);
    s->disk_bytes = s->op_len;
    bool unchanged = !s->busy && s->version == s->op_version;
    e->st.spills[s->op_why]++;
    pthread_mutex_unlock(&e->mu);
    op_clear(e, s);
    if (unchanged && in_memory(s))
        spill_release(e, s);
}

/* Whether j, waiting for its session's KV, only appends to its tokens: it
 * keeps every one of them (kv_seq_reuse keeps all and computes at least
 * the last prompt token), and an encoder-decoder job the session's input
 * (another drops both caches), so it may start on a KV still loading. */
static bool appends(const struct job *j, const struct session *s)
{
    return (j->kind == JOB_GENERATE || j->kind == JOB_PREFILL) && j->n_prompt > s->n_toks &&
           !memcmp(j->prompt, s->toks, s->n_toks * sizeof(*s->toks)) &&
           (!j->input || (j->n_input == s->n_input && !memcmp(j->input, s->input, s->n_input * sizeof(*s->input))));
}

/* Jobs waiting for s's restore start now (or fail with err); with
 * only_appending, those that may start on a KV still loading. */
static void restore_wake(engine *e, struct session *s, const struct ipc_error *err, bool only_appending)
{
    for (struct job *j = e->active; j; j = j->next) {
        if (j->sess != s || !j->io_wait || j->pfetch || j->rfetch || (only_appending && !appends(j, s)))
            continue;
        j->io_wait = false;
        if (err)
            job_fail(e, j, err);
        else if (!j->kill)
            start_job(e, j);
    }
}

/* s's KV is gone for good (a restore failed): its tokens will be computed
 * again, and its file no longer holds them. */
static void restore_lost(engine *e, struct session *s, const char *why)
{
    log_msg(LOG_WARN, "session %s: restore from disk failed, its tokens will be computed again: %s", s->id, why);
    engine_count(e, &e->st.disk_errors);
    s->disk_version = 0;
    s->disk_cross = false; /* an encoder-decoder session's input is encoded again */
    s->version++;
    pthread_mutex_lock(&e->mu);
    free(s->toks);
    s->toks = NULL;
    s->n_toks = 0;
    s->disk_bytes = 0;
    s->kvs = (struct kv_seq_stats){0};
    pthread_mutex_unlock(&e->mu);
}

static void restore_restored(engine *e, struct session *s)
{
    struct kv_seq_stats k = s->kv ? kv_seq_stats(s->kv) : (struct kv_seq_stats){0};
    struct kv_seq_stats c = s->cross ? kv_seq_stats(s->cross->kv) : (struct kv_seq_stats){0};
    pthread_mutex_lock(&e->mu);
    s->kvs = k;
    s->cross_kvs = c;
    e->st.restores++;
    pthread_mutex_unlock(&e->mu);
}

/* An encoder-decoder session's "encoder" meta (meta_json): the input's
 * ids in the vocabulary into *ids (malloc'd; *n 0 and *ids NULL when the
 * meta has none), the decoder cache's image bytes (at most data_len; the
 * cross cache's image is the rest) into *self_image; else why not. */
static const char *meta_encoder(const engine *e, const json_t *o, size_t data_len, int32_t **ids, size_t *n,
                                size_t *self_image)
{
    json_t *enc = json_object_get(o, "encoder");
    json_t *in = json_object_get(enc, "input"), *si = json_object_get(enc, "self_image");
    *ids = NULL;
    *n = 0;
    *self_image = data_len;
    if (!enc)
        return NULL;
    if (!e->ed)
        return "an encoder input, and this model has no encoder";
    if (!json_is_array(in) || !json_array_size(in) || json_array_size(in) > (size_t)KV_SEQ_MAX_LEN ||
        !json_is_integer(si) || json_integer_value(si) < 0 || (uint64_t)json_integer_value(si) > data_len)
        return "encoder fields out of range";
    size_t k = json_array_size(in);
    if (!(*ids = malloc(k * sizeof(**ids))))
        return "no memory";
    for (size_t i = 0; i < k; i++) {
        json_t *v = json_array_get(in, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= e->vocab) {
            free(*ids);
            *ids = NULL;
            return "an encoder input id out of range";
        }
        (*ids)[i] = (int32_t)json_integer_value(v);
    }
    *n = k;
    *self_image = (size_t)json_integer_value(si);
    return NULL;
}

/* The restore's source: the image's first n bytes, once the disk tier has
 * read and checked them (NULL: it never will). */
static const void *restore_src(void *arg, size_t n)
{
    struct session *s = arg;
    bool early = !kv_disk_op_done(s->op);
    const void *img = kv_disk_op_wait_ready(s->op, n);
    s->op_early += early && img;
    return img;
}

/* An encoder-decoder restore's cross cache's source: its image follows
 * the decoder cache's. */
static const void *restore_src_cross(void *arg, size_t n)
{
    struct session *s = arg;
    const char *img = restore_src(arg, s->op_self + n);
    return img ? img + s->op_self : NULL;
}

/* Whether the bytes a begin needs are in: the decoder-only image's head;
 * an encoder-decoder one's meta first (restore_begin reads what it needs
 * from it), then both caches' heads. */
static bool head_in(const engine *e, const struct session *s, double now)
{
    (void)now;
    void *data;
    size_t len, head = kv_image_head_size(e->store);
    if (!s->op || !s->op_restore || s->op_begun || s->kv)
        return false;
    size_t ready = kv_disk_op_ready(s->op, &data, &len);
    size_t need = s->op_need ? s->op_need : e->ed ? 0 : len < head ? len : head;
    return data && ready >= need;
}

/* The cross cache of an input of n_input tokens from its image img[0,
 * len), there whole (src NULL) or still arriving (filled layer by layer
 * from src); the store's refusal, or TIER_EINVAL naming why. */
static enum tier_status load_cross(engine *e, const void *img, size_t len, const struct kv_image_src *src,
                                   size_t n_input, struct cross_cache **out, char why[256])
{
    kv_seq *kv = NULL;
    enum tier_status ts = src ? kv_seq_load_begin(e->store, img, len, src, &kv) : kv_seq_load(e->store, img, len, &kv);
    if (ts != TIER_OK)
        snprintf(why, 256, "%s", kv_store_errmsg(e->store));
    else if ((size_t)kv_seq_length(kv) != n_input)
        ts = TIER_EINVAL, snprintf(why, 256, "its cross-attention cache is of another number of tokens than its input");
    else if (!(*out = malloc(sizeof(**out))))
        ts = TIER_ENOMEM_HOST, snprintf(why, 256, "no host memory for the cross-attention cache");
    if (ts != TIER_OK) {
        kv_seq_free(kv);
        return ts;
    }
    **out = (struct cross_cache){.kv = kv, .refs = 1};
    return TIER_OK;
}

/* s takes a restore's caches: the decoder's kv, and an encoder-decoder
 * file's cross cache of input[0, n_input) (taken; NULL: the file held
 * none).  What the file turned out to hold is what its disk_cross says. */
static void restore_take(engine *e, struct session *s, kv_seq *kv, struct cross_cache *cross, int32_t *input,
                         size_t n_input)
{
    s->kv = kv;
    s->disk_cross = cross;
    if (cross) { /* the file's input is the one its cross cache is of */
        session_drop_cross(e, s, true);
        s->cross = cross;
        s->input = input;
        pthread_mutex_lock(&e->mu);
        s->n_input = n_input;
        pthread_mutex_unlock(&e->mu);
    }
}

/* The heads of s's image are in: s gets its caches, to be filled layer by
 * layer, and the jobs that only append to them start.  An
 * encoder-decoder image is the decoder cache's then the cross cache's
 * (whose layer l a step reads with the decoder's layer l); the first call
 * reads where the second starts from the meta, and returns until its head
 * is in too.  What does not begin (memory, a bad image or meta) is left to
 * restore_done, which reads it whole and says why. */
static void restore_begin(engine *e, struct session *s)
{
    void *data;
    size_t len, n_self, n_input = 0, head = kv_image_head_size(e->store);
    size_t ready = kv_disk_op_ready(s->op, &data, &len);
    int32_t *input = NULL;
    if (e->ed) {
        size_t meta_len;
        const void *meta = kv_disk_op_meta(s->op, &meta_len);
        json_t *o = meta ? json_loadb(meta, meta_len, 0, NULL) : NULL;
        const char *bad = o ? meta_encoder(e, o, len, &input, &n_input, &n_self) : "no meta";
        json_decref(o);
        if (bad) {
            s->op_begun = true;
            return;
        }
        size_t last = len > n_self ? n_self : 0; /* where the last image starts */
        s->op_self = n_self;
        s->op_need = last + (len - last < head ? len - last : head);
        if (ready < s->op_need) {
            free(input);
            return;
        }
    } else {
        n_self = len;
    }
    s->op_begun = true;
    kv_seq *kv = NULL;
    struct cross_cache *cross = NULL;
    char why[256];
    bool ok = !s->n_toks;
    if (n_self)
        ok = kv_seq_load_begin(e->store, data, n_self, &(struct kv_image_src){restore_src, s}, &kv) == TIER_OK &&
             (size_t)kv_seq_length(kv) == s->n_toks;
    /* another of the user's sessions may hold the input's cache (cross_find) */
    if (ok && len > n_self && !(cross = cross_find(e, s->uid, input, n_input)))
        ok = load_cross(e, (const char *)data + n_self, len - n_self, &(struct kv_image_src){restore_src_cross, s},
                        n_input, &cross, why) == TIER_OK;
    if (!ok) {
        kv_seq_free(kv);
        cross_unref(cross);
        free(input);
        return;
    }
    restore_take(e, s, kv, cross, input, n_input);
    if (!cross)
        free(input);
    s->op_layered = true;
    struct kv_seq_stats k = kv ? kv_seq_stats(kv) : (struct kv_seq_stats){0};
    struct kv_seq_stats c = s->cross ? kv_seq_stats(s->cross->kv) : (struct kv_seq_stats){0};
    pthread_mutex_lock(&e->mu);
    s->kvs = k;
    s->cross_kvs = c;
    pthread_mutex_unlock(&e->mu);
    restore_wake(e, s, NULL, true);
}

/* Whether a started job holds s's caches (its choice 0 runs on its KV, or
 * its decoder reads its cross cache). */
static bool kv_in_use(const engine *e, const struct session *s)
{
    for (const struct job *j = e->active; j; j = j->next)
        if (j->sess == s &&
            ((j->ch[0].kv && j->ch[0].kv == s->kv) || (j->cross && s->cross && j->cross == s->cross->kv)))
            return true;
    return false;
}

/* The read of a restore begun layer by layer is done: the layers no step
 * has reached yet are filled now, or the caches are lost. */
static void restore_finish(engine *e, struct session *s)
{
    /* before op_clear: the source is the op */
    enum tier_status ts = s->kv ? kv_seq_load_finish(s->kv) : TIER_OK;
    if (ts == TIER_OK && s->cross)
        ts = kv_seq_load_finish(s->cross->kv);
    char why[256];
    snprintf(why, sizeof why, "%s", ts == TIER_OK ? "" : kv_disk_op_status(s->op) != TIER_OK
                                                        ? kv_disk_op_errmsg(s->op)
                                                        : kv_store_errmsg(e->store));
    op_clear(e, s);
    if (ts == TIER_OK) {
        restore_restored(e, s);
        restore_wake(e, s, NULL, false);
        return;
    }
    /* a job running on it fails its next step and starts over
     * (disk_restore_lost); otherwise the KV goes now */
    if (kv_in_use(e, s))
        return;
    kv_seq_free(s->kv);
    s->kv = NULL;
    session_drop_cross(e, s, false);
    restore_lost(e, s, why);
    restore_wake(e, s, NULL, false);
}

void disk_restore_lost(engine *e, struct session *s)
{
    char why[256];
    snprintf(why, sizeof why, "%s", kv_store_errmsg(e->store));
    kv_seq_free(s->kv);
    s->kv = NULL;
    if (s->op)
        op_clear(e, s);
    /* a cross cache lost with it goes too: the kept input is encoded again */
    if (s->cross && kv_seq_load_status(s->cross->kv) != TIER_OK)
        session_drop_cross(e, s, false);
    restore_lost(e, s, why);
}

static void restore_done(engine *e, struct session *s)
{
    if (s->op_layered) {
        restore_finish(e, s);
        return;
    }
    enum tier_status ts = kv_disk_op_status(s->op);
    void *meta = NULL, *img = NULL, *buf = NULL;
    size_t meta_len = 0, n = 0, n_self = 0, n_input = 0;
    kv_seq *kv = NULL;
    struct cross_cache *cross = NULL;
    int32_t *input = NULL;
    /* a copy: the op's message goes with the op, the store's with its next call */
    char why[256] = "";
    if (ts == TIER_OK) {
        kv_disk_op_take_buf(s->op, &meta, &meta_len, &buf, &img, &n);
        json_t *o = e->ed ? json_loadb(meta, meta_len, 0, NULL) : NULL;
        const char *bad = e->ed ? (o ? meta_encoder(e, o, n, &input, &n_input, &n_self) : "its meta is not JSON")
                                : (n_self = n, NULL);
        json_decref(o);
        if (bad)
            ts = TIER_EINVAL, snprintf(why, sizeof why, "%s", bad);
        else if (n_self && (ts = kv_seq_load(e->store, img, n_self, &kv)) != TIER_OK)
            snprintf(why, sizeof why, "%s", kv_store_errmsg(e->store));
        else if (n_self && (size_t)kv_seq_length(kv) != s->n_toks)
            ts = TIER_EINVAL, snprintf(why, sizeof why, "its KV holds another number of tokens than its meta");
        else if (!n_self && s->n_toks)
            ts = TIER_EINVAL, snprintf(why, sizeof why, "the file holds no KV");
        /* a fork restored before it (or another of the user's sessions)
         * may hold the same input's: one cache serves both */
        else if (n > n_self && !(cross = cross_find(e, s->uid, input, n_input)))
            ts = load_cross(e, (const char *)img + n_self, n - n_self, NULL, n_input, &cross, why);
    } else {
        snprintf(why, sizeof why, "%s", kv_disk_op_errmsg(s->op));
    }
    free(meta);
    image_release(e, buf);
    op_clear(e, s);
    if (ts != TIER_OK) {
        kv_seq_free(kv);
        free(input);
    }
    if ((ts == TIER_ENOMEM_DEV || ts == TIER_ENOMEM_HOST) && disk_spill_for_memory(e))
        return; /* its jobs wait on; disk_poll reads it again once the spill is done */
    if (ts == TIER_ENOMEM_DEV || ts == TIER_ENOMEM_HOST) {
        /* memory, not the file: the session stays on disk for a retry */
        struct ipc_error err;
        ipc_fail(&err, IPC_ESTORAGE, "", "no memory to restore session \"%s\" from disk: %s", s->id, why);
        restore_wake(e, s, &err, false);
        return;
    }
    if (ts != TIER_OK) {
        restore_lost(e, s, why[0] ? why : tier_strerror(ts));
    } else {
        restore_take(e, s, kv, cross, input, n_input);
        if (!cross)
            free(input);
        if (kv || cross)
            restore_restored(e, s);
    }
    restore_wake(e, s, NULL, false);
}

/* The first session matching pred (checked under mu), or NULL.  The
 * engine thread is the only one that frees sessions, so it may use s
 * after the lock is released. */
static struct session *find(engine *e, bool (*pred)(const engine *, const struct session *, double), double now)
{
    pthread_mutex_lock(&e->mu);
    struct session *s = e->sessions;
    while (s && !pred(e, s, now))
        s = s->next;
    pthread_mutex_unlock(&e->mu);
    return s;
}

static bool op_finished(const engine *e, const struct session *s, double now)
{
    (void)e, (void)now;
    return s->op && kv_disk_op_done(s->op);
}

bool disk_poll(engine *e)
{
    pthread_mutex_lock(&e->mu);
    e->io_event = false;
    pthread_mutex_unlock(&e->mu);
    prefix_disk_poll(e);
    prefix_remote_poll(e);
    if (!e->n_ops)
        return false;
    for (struct session *s; (s = find(e, head_in, 0));)
        restore_begin(e, s);
    bool moved = false;
    for (struct session *s; (s = find(e, op_finished, 0)); moved = true) {
        if (s->op_restore)
            restore_done(e, s);
        else
            spill_done(e, s);
    }
    if (e->n_spilling)
        return moved;
    /* memory freed: steps that found it full go again, and so do restores
     * that could not load */
    for (struct job *j = e->active; j; j = j->next) {
        j->mem_wait = false;
        if (j->io_wait && !j->pfetch && !j->rfetch && !j->sess->op) {
            j->io_wait = false;
            start_job(e, j);
        }
    }
    return moved;
}

/* Idle, with its KV in memory and nothing in flight: it may go to disk. */
static bool spillable(const engine *e, const struct session *s, double now)
{
    (void)e;
    return !s->busy && !s->op && (in_memory(s) || s->version != s->disk_version) && now >= s->spill_retry_at;
}

double spill_idle_ms(const engine *e)
{
    int ttl = e->cfg.session_ttl_s, after = e->cfg.spill_after_s;
    return (ttl > 0 && ttl < after ? ttl : after) * 1e3;
}

static bool idle_due(const engine *e, const struct session *s, double now)
{
    return spillable(e, s, now) && now - s->t_idle >= spill_idle_ms(e);
}

double disk_spill_idle(engine *e, double now)
{
    if (!e->disk)
        return 0;
    for (struct session *s; (s = find(e, idle_due, now));) {
        if (in_memory(s) && s->version == s->disk_version)
            spill_release(e, s); /* its file is current: nothing to write */
        else
            spill_start(e, s, ENGINE_SPILL_IDLE);
    }
    double next = 0;
    pthread_mutex_lock(&e->mu);
    for (struct session *s = e->sessions; s; s = s->next) {
        double due = s->t_idle + spill_idle_ms(e);
        due = due > s->spill_retry_at ? due : s->spill_retry_at;
        if (!s->busy && !s->op && (in_memory(s) || s->version != s->disk_version) && (next == 0 || due < next))
            next = due;
    }
    pthread_mutex_unlock(&e->mu);
    return next;
}

bool disk_spill_for_memory(engine *e)
{
    if (!e->disk)
        return false;
    if (e->n_spilling)
        return true;
    double now = clock_ms();
    pthread_mutex_lock(&e->mu);
    struct session *lru = NULL;
    for (struct session *s = e->sessions; s; s = s->next)
        if (in_memory(s) && spillable(e, s, now) && (!lru || s->t_idle < lru->t_idle))
            lru = s;
    pthread_mutex_unlock(&e->mu);
    if (!lru)
        return false;
    if (lru->version == lru->disk_version) {
        spill_release(e, lru);
        return true;
    }
    /* hot: it is in the way now, so it goes out uncompressed */
    return spill_start(e, lru, ENGINE_SPILL_MEMORY);
}

bool disk_needs_restore(const engine *e, const struct session *s)
{
    /* an encoder-decoder session's cross cache comes back with it, unless
     * the session changed since (another input, which dropped it) */
    return e->disk && !s->kv && s->disk_version &&
           (s->n_toks || (s->disk_cross && !s->cross && s->version == s->disk_version));
}

void disk_restore(engine *e, struct session *s)
{
    char ns[24];
    ns_of(s->uid, ns);
    enum tier_status ts = kv_disk_get_into(e->disk, ns, s->id, &(struct kv_disk_alloc){image_alloc, free_image, e},
                                           &s->op);
    if (ts != TIER_OK) {
        struct ipc_error err;
        ipc_fail(&err, IPC_ESTORAGE, "", "cannot read session \"%s\" from disk: %s", s->id, tier_strerror(ts));
        s->op = NULL;
        restore_wake(e, s, &err, false);
        return;
    }
    s->op_restore = true;
    s->op_begun = s->op_layered = false;
    s->op_need = 0;
    s->op_early = 0;
    e->n_ops++;
}

void disk_forget(engine *e, struct session *s)
{
    if (!e->disk)
        return;
    if (s->op)
        op_clear(e, s); /* waits for it */
    if (s->disk_version) {
        char ns[24];
        ns_of(s->uid, ns);
        kv_disk_remove(e->disk, ns, s->id);
    }
}

/* ---- start and exit ------------------------------------------------------ */

static bool valid_id(const char *id)
{
    size_t n = strlen(id);
    if (n < 6 || n > IPC_SESSION_ID_MAX || strncmp(id, "sess-", 5) != 0)
        return false;
    for (size_t i = 5; i < n; i++)
        if (!((id[i] >= '0' && id[i] <= '9') || (id[i] >= 'a' && id[i] <= 'f')))
            return false;
    return true;
}

/* A session from a file's meta, or NULL naming why in *why. */
static struct session *session_of_meta(engine *e, const char *ns, const char *name, const void *meta,
                                       size_t meta_len, size_t data_len, const char **why)
{
    json_error_t je;
    json_t *o = json_loadb(meta, meta_len, JSON_REJECT_DUPLICATES, &je);
    json_t *id = json_object_get(o, "id"), *uid = json_object_get(o, "uid"), *created = json_object_get(o, "created");
    json_t *record = json_object_get(o, "record"), *req = json_object_get(o, "request");
    json_t *toks = json_object_get(o, "tokens");
    char want_ns[24];
    struct session *s = NULL;
    *why = NULL;
    if (!o || json_integer_value(json_object_get(o, "kvtier_session")) != META_FORMAT)
        *why = "meta is not a session of this format";
    else if (!json_is_string(id) || !valid_id(json_string_value(id)) || strcmp(json_string_value(id), name) != 0)
        *why = "meta names another session";
    else if (!json_is_integer(uid) || json_integer_value(uid) < 0 || json_integer_value(uid) > UINT32_MAX - 1 ||
             (ns_of((uid_t)json_integer_value(uid), want_ns), strcmp(want_ns, ns) != 0))
        *why = "meta names another owner";
    else if (!json_is_integer(created) || !json_is_boolean(record) || !json_is_array(toks) ||
             json_array_size(toks) > (size_t)INT32_MAX || (req && !json_is_object(req) && !json_is_null(req)))
        *why = "meta fields out of range";
    else if (data_len == 0 && json_array_size(toks))
        *why = "tokens without KV";
    int32_t *input = NULL;
    size_t n_input = 0, self_image;
    if (!*why)
        *why = meta_encoder(e, o, data_len, &input, &n_input, &self_image);
    struct ipc_cache_choice cache;
    struct ipc_error err;
    if (!*why && ipc_cache_parse(json_object_get(req, "cache"), json_object_get(req, "use_cache"),
                                 &(struct ipc_cache_model){.max_len = e->ctx, .sliding_window = e->mc->sliding_window,
                                                           .no_sink = model_sink_refusal(e->mc)},
                                 &cache, &err) != IPC_OK)
        *why = "its cache choice is not valid for this model";
    else if (!*why && session_choice_check(e, &cache, json_is_true(record), &err) != IPC_OK)
        *why = "its cache choice or past recording is refused at creation";
    /* a sink cache's positions are indices in its window: its session may
     * have generated past the context */
    if (!*why && !cache.params.sink && json_array_size(toks) >= (size_t)e->ctx)
        *why = "meta fields out of range";
    /* the image is read into memory of its size: one larger than its
     * tokens' KV can be (a sparse file claiming a terabyte) is not read */
    if (!*why && (self_image > kv_seq_image_bound(e->store, &cache.params, (int64_t)json_array_size(toks)) ||
                  data_len - self_image > kv_seq_image_bound(e->store, &(struct kv_seq_params){0}, (int64_t)n_input)))
        *why = "its KV image is larger than the KV of its tokens can be";
    if (!*why && !(s = session_new((uid_t)json_integer_value(uid), &cache, json_is_true(record), req, &err)))
        *why = "no memory";
    size_t n = json_array_size(toks);
    if (s && n && !(s->toks = malloc(n * sizeof(*s->toks)))) {
        *why = "no memory";
    } else if (s) {
        for (size_t i = 0; i < n && !*why; i++) {
            json_t *v = json_array_get(toks, i);
            if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= e->vocab)
                *why = "a token id out of range";
            else
                s->toks[i] = (int32_t)json_integer_value(v);
        }
        s->n_toks = n;
    }
    if (s && !*why) {
        s->input = input;
        s->n_input = n_input;
        s->disk_cross = data_len > self_image;
        input = NULL;
        snprintf(s->id, sizeof(s->id), "%s", name);
        s->created = (time_t)json_integer_value(created);
        s->version = s->disk_version = 1;
        s->disk_bytes = data_len + meta_len;
        s->kvs.strategy = cache.params.strategy; /* listed as asked for until its image is read */
    }
    json_decref(o);
    free(input);
    if (*why) {
        free_dead_sessions(s);
        return NULL;
    }
    return s;
}

struct scan {
    engine *e;
    int listed, skipped;
};

static void on_file(void *arg, const char *ns, const char *name, const void *meta, size_t meta_len, size_t data_len)
{
    struct scan *sc = arg;
    engine *e = sc->e;
    if (ns[0] == 'p' || ns[0] == 'x') {
        prefix_disk_file(e, ns, name, meta, meta_len, data_len);
        return;
    }
    if (ns[0] != 'u')
        return;
    const char *why;
    struct session *s = session_of_meta(e, ns, name, meta, meta_len, data_len, &why);
    struct ipc_error err;
    if (s && session_insert(e, s, &err) != IPC_OK) {
        why = err.msg;
        free_dead_sessions(s);
        s = NULL;
    }
    if (!s) {
        log_msg(LOG_WARN, "disk tier: %s/%s.kvt not listed: %s", ns, name, why);
        sc->skipped++;
        return;
    }
    sc->listed++;
}

uint64_t engine_fingerprint(const engine *e)
{
    return e->ed ? encdec_fingerprint(e->ed) : model_fingerprint(e->m);
}

struct kv_disk_layout engine_kv_layout(const engine *e)
{
    const struct kv_geom g = e->ed ? encdec_kv_geom(e->ed) : model_kv_geom(e->m);
    return (struct kv_disk_layout){.fingerprint = engine_fingerprint(e),
                                   .dtype = (uint32_t)kv_store_dtype(e->store),
                                   .block_tokens = (uint32_t)kv_store_block_tokens(e->store),
                                   .n_layers = (uint32_t)g.n_layers,
                                   .n_kv_heads = (uint32_t)g.n_kv_heads,
                                   .head_dim = (uint32_t)g.head_dim};
}

void disk_open(engine *e)
{
    if (!e->cfg.disk_dir)
        return;
    struct kv_disk_params p = {.dir = e->cfg.disk_dir,
                               .budget = e->cfg.disk_mem,
                               .compress = (enum kv_disk_compress)e->cfg.disk_compress,
                               .layout = engine_kv_layout(e),
                               .notify = engine_io_notify,
                               .notify_arg = e};
    kv_disk *d = NULL;
    enum tier_status ts = kv_disk_open(&p, &d);
    if (ts != TIER_OK) {
        log_msg(LOG_ERR, "disk tier %s not used (the line above says why): sessions live in memory only",
                e->cfg.disk_dir);
        kv_disk_free(d);
        return;
    }
    pthread_mutex_lock(&e->mu); /* engine_get_stats reads it */
    e->disk = d;
    pthread_mutex_unlock(&e->mu);
    prefix_disk_open(e);
    struct scan sc = {.e = e};
    kv_disk_scan(e->disk, "", on_file, &sc);
    prefix_disk_opened(e);
    struct kv_disk_stats ds = kv_disk_stats(e->disk);
    log_msg(LOG_INFO, "disk tier %s: budget %.1f MiB (--disk-mem), %s I/O, %d session(s) restored to the table%s",
            e->cfg.disk_dir, ds.budget / 1048576.0, ds.direct ? "direct" : "buffered", sc.listed,
            sc.skipped ? ", some skipped (see above)" : "");
}

void disk_close(engine *e)
{
    if (!e->disk)
        return;
    /* every session whose file is not current, one at a time so that at
     * most one image is in memory besides the KV */
    int written = 0, failed = 0;
    for (struct session *s = e->sessions; s; s = s->next) {
        if (s->op) {
            kv_disk_op_wait(s->op);
            if (s->op_restore)
                restore_done(e, s);
            else
                spill_done(e, s);
        }
        if (s->version == s->disk_version)
            continue;
        if (!spill_start(e, s, ENGINE_SPILL_EXIT)) { /* the disk is full or failing: it is lost, and said so */
            failed++;
            continue;
        }
        kv_disk_op_wait(s->op);
        if (kv_disk_op_status(s->op) == TIER_OK)
            written++;
        else
            failed++;
        spill_done(e, s);
    }
    if (written || failed)
        log_msg(failed ? LOG_WARN : LOG_INFO, "disk tier: %d session(s) written at exit, %d failed", written, failed);
    prefix_disk_close(e);
    pthread_mutex_lock(&e->mu);
    kv_disk *d = e->disk;
    e->disk = NULL;
    pthread_mutex_unlock(&e->mu);
    kv_disk_free(d);
}
