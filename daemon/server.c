#include "daemon/server.h"

#include <errno.h>
#include <microhttpd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "util/log.h"
#include "daemon/sock.h"
#include "text/chat.h"
#include "ipc/jsonw.h"
#include "util/clock.h"

/* What an epoll event belongs to; the first member of everything registered. */
enum src_kind { SRC_LISTEN = 1, SRC_SIGNAL, SRC_WAKE, SRC_MHD, SRC_CONN };
struct ev_src {
    enum src_kind kind;
};

enum reply_kind { REPLY_COMPLETION = 0, REPLY_CHAT, REPLY_SESSION, REPLY_SESSION_OP };

struct req {
    struct ev_src src; /* SRC_CONN while suspended */
    struct server *srv;
    struct MHD_Connection *conn;
    const struct route *route;
    const char *url;
    uid_t uid;
    pid_t pid;
    char *body;
    size_t n_body, cap_body;
    json_t *root;
    /* a request waiting for the engine */
    struct job *job;
    enum reply_kind kind;
    bool stream, include_usage, return_tokens, logprobs;
    int top_logprobs;
    bool suspended, hup, overflow, wake;
    int fd;
    struct req *prev, *next; /* server.waiting */
    char id[48];
    time_t created;
    /* stream progress (loop thread) */
    bool role_sent[SERVER_MAX_N], fin_sent[SERVER_MAX_N];
    size_t sent_text[SERVER_MAX_N], text_offset[SERVER_MAX_N];
    int sent_gen[SERVER_MAX_N];
    int phase; /* 0: choices, 1: usage chunk, 2: [DONE], 3: ended */
    char *snap; /* STREAM_BLOCK bytes: unsent text copied under the engine lock */
};

struct server {
    engine *eng;
    const struct server_config *cfg;
    struct MHD_Daemon *mhd;
    int ep, listen_fd, sig_fd, wake_fd, mhd_fd;
    struct ev_src s_listen, s_sig, s_wake, s_mhd;
    struct req *waiting; /* requests holding a job */
    bool ready, draining, quit;
    double drain_deadline;
    time_t started;
    uint64_t ids, http_requests, refused;
    char *piece; /* one token's text for logprobs: engine_max_piece bytes (loop thread) */
    size_t piece_cap;
};

/* ---- replies ----------------------------------------------------------------- */

static enum MHD_Result queue(struct req *r, unsigned code, char *body, size_t len, const char *type)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (r->srv->draining)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result res = MHD_queue_response(r->conn, code, resp);
    MHD_destroy_response(resp);
    return res;
}

static enum MHD_Result reply_jw(struct req *r, unsigned code, struct jw *w)
{
    if (w->failed) {
        free(w->p);
        return MHD_NO; /* out of memory even for the reply: drop the connection */
    }
    jw_raw(w, "\n", 1);
    return queue(r, code, w->p, w->n, "application/json");
}

static enum MHD_Result reply_json(struct req *r, unsigned code, json_t *obj)
{
    char *s = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    if (!s)
        return MHD_NO;
    size_t n = strlen(s);
    char *t = realloc(s, n + 2);
    if (!t) {
        free(s);
        return MHD_NO;
    }
    t[n] = '\n';
    t[n + 1] = '\0';
    return queue(r, code, t, n + 1, "application/json");
}

static void write_error_body(struct jw *w, const struct ipc_error *e)
{
    jw_fmt(w, "{\"code\":%d,\"message\":", ipc_http_status(e->st));
    jw_str(w, e->msg, strlen(e->msg));
    jw_fmt(w, ",\"type\":\"%s\",\"param\":", ipc_error_type(e->st));
    if (e->param[0])
        jw_str(w, e->param, strlen(e->param));
    else
        jw_lit(w, "null");
    jw_lit(w, "}");
}

static enum MHD_Result reply_error(struct req *r, const struct ipc_error *e)
{
    int code = ipc_http_status(e->st);
    engine_count_error(r->srv->eng, e->st);
    log_msg(code >= 500 || code == 413 || code == 429 ? LOG_WARN : LOG_INFO, "uid %u pid %d %s: %d %s",
            (unsigned)r->uid, (int)r->pid, r->url, code, e->msg);
    struct jw w;
    jw_dynamic(&w);
    jw_lit(&w, "{\"error\":");
    write_error_body(&w, e);
    jw_lit(&w, "}");
    return reply_jw(r, (unsigned)code, &w);
}

static enum MHD_Result fail(struct req *r, enum ipc_status st, const char *param, const char *msg)
{
    struct ipc_error e;
    ipc_fail(&e, st, param, "%s", msg);
    return reply_error(r, &e);
}

/* ---- suspend / resume ------------------------------------------------------------ */

static void suspend(struct req *r)
{
    MHD_suspend_connection(r->conn);
    r->suspended = true;
    /* MHD stops watching a suspended connection; we watch for the hang-up */
    struct epoll_event ev = {.events = EPOLLRDHUP, .data.ptr = &r->src};
    r->src.kind = SRC_CONN;
    if (epoll_ctl(r->srv->ep, EPOLL_CTL_ADD, r->fd, &ev) != 0)
        log_msg(LOG_WARN, "cannot watch connection fd %d: %s", r->fd, strerror(errno));
}

static void resume(struct req *r)
{
    if (!r->suspended)
        return;
    epoll_ctl(r->srv->ep, EPOLL_CTL_DEL, r->fd, NULL);
    r->suspended = false;
    MHD_resume_connection(r->conn);
}

static void track(struct req *r, struct job *j)
{
    struct server *s = r->srv;
    r->job = j;
    r->next = s->waiting;
    r->prev = NULL;
    if (s->waiting)
        s->waiting->prev = r;
    s->waiting = r;
}

static void untrack(struct req *r)
{
    struct server *s = r->srv;
    if (r->prev)
        r->prev->next = r->next;
    else if (s->waiting == r)
        s->waiting = r->next;
    if (r->next)
        r->next->prev = r->prev;
    r->prev = r->next = NULL;
}

/* ---- response bodies shared by whole replies and stream events ----------------- */

/* The text of one token for logprobs, as the tokenizer spells it alone, in
 * s->piece (sized for the longest token, so it always fits; valid until
 * the next call). */
static size_t piece(struct server *s, int32_t id)
{
    struct tok_stream ts = {.started = true};
    return tokenizer_decode_stream(engine_tokenizer(s->eng), &ts, id, false, s->piece, s->piece_cap);
}

static const char *finish_name(enum gen_finish f)
{
    return f == GEN_FINISH_LENGTH ? "length" : f == GEN_FINISH_NONE ? NULL : "stop";
}

/* logprobs of generated tokens [from, to) of choice i, in the endpoint's shape */
static void write_logprobs(struct jw *w, struct req *r, int i, int from, int to)
{
    const struct job *j = r->job;
    const struct job_choice *c = &j->ch[i];
    int k = j->top_logprobs;
    struct server *s = r->srv;
    const char *buf = s->piece;
    if (!r->logprobs) {
        jw_lit(w, "null");
        return;
    }
    if (r->kind == REPLY_CHAT) {
        jw_lit(w, "{\"content\":[");
        for (int t = from; t < to; t++) {
            const struct tok_logprob *lp = c->lps + (size_t)t * (size_t)(1 + k);
            for (int a = 0; a <= k; a++) {
                size_t n = piece(s, lp[a].id);
                jw_lit(w, a == 0 ? (t > from ? ",{\"token\":" : "{\"token\":") : a == 1 ? "\"top_logprobs\":[{\"token\":"
                                                                                       : ",{\"token\":");
                jw_str(w, buf, n);
                jw_fmt(w, ",\"logprob\":%.6g,\"bytes\":", lp[a].logprob);
                jw_bytes(w, buf, n);
                jw_lit(w, a == 0 ? "," : "}");
            }
            jw_lit(w, k ? "]}" : "\"top_logprobs\":[]}");
        }
        jw_lit(w, "]}");
        return;
    }
    /* completions: four parallel arrays */
    static const char *keys[] = {"{\"tokens\":[", "],\"token_logprobs\":[", "],\"top_logprobs\":[",
                                 "],\"text_offset\":["};
    for (int part = 0; part < 4; part++) {
        jw_lit(w, keys[part]);
        size_t off = r->text_offset[i];
        for (int t = from; t < to; t++) {
            const struct tok_logprob *lp = c->lps + (size_t)t * (size_t)(1 + k);
            size_t n = piece(s, lp[0].id);
            if (t > from)
                jw_lit(w, ",");
            if (part == 0)
                jw_str(w, buf, n);
            else if (part == 1)
                jw_fmt(w, "%.6g", lp[0].logprob);
            else if (part == 3)
                jw_fmt(w, "%zu", off);
            else {
                jw_lit(w, "{");
                for (int a = 1; a <= k; a++) {
                    size_t m = piece(s, lp[a].id);
                    if (a > 1)
                        jw_lit(w, ",");
                    jw_str(w, buf, m);
                    jw_fmt(w, ":%.6g", lp[a].logprob);
                }
                jw_lit(w, "}");
            }
            off += n;
        }
        if (part == 3)
            r->text_offset[i] = off;
    }
    jw_lit(w, "]}");
}

static int completion_tokens(const struct job *j)
{
    int n = 0;
    for (int i = 0; i < j->n; i++)
        n += j->ch[i].n_gen;
    return n;
}

static void write_usage(struct jw *w, const struct job *j)
{
    int c = completion_tokens(j);
    jw_fmt(w, "\"usage\":{\"prompt_tokens\":%zu,\"completion_tokens\":%d,\"total_tokens\":%zu,", j->n_prompt, c,
           j->n_prompt + (size_t)c);
    jw_fmt(w, "\"prompt_tokens_details\":{\"cached_tokens\":%d}}", j->n_cached);
}

/* The measured prefetch of the steps that streamed this request's KV
 * (null when none did): overlap = 1 - stall / transfer. */
static void write_prefetch(struct jw *w, const struct kv_xfer_stats *x)
{
    if (!x->steps) {
        jw_lit(w, "null");
        return;
    }
    jw_fmt(w, "{\"steps\":%llu,\"tokens\":%llu,\"transfer_ms\":%.3f,\"compute_ms\":%.3f,\"stall_ms\":%.3f,",
           (unsigned long long)x->steps, (unsigned long long)x->tokens, x->transfer_s * 1e3, x->compute_s * 1e3,
           x->stall_s * 1e3);
    if (x->transfer_s > 0)
        jw_fmt(w, "\"overlap\":%.4f,", 1.0 - x->stall_s / x->transfer_s);
    else
        jw_lit(w, "\"overlap\":null,");
    jw_fmt(w, "\"bytes_h2d\":%llu,\"bytes_d2h\":%llu,\"bytes_per_token\":%.1f}", (unsigned long long)x->bytes_h2d,
           (unsigned long long)x->bytes_d2h,
           x->tokens ? (double)(x->bytes_h2d + x->bytes_d2h) / (double)x->tokens : 0.0);
}

/* The response's kvtier object: the strategy in use (it differs from the
 * requested one after a fallback), bytes per tier, timings, prefetch. */
static void write_kvtier_obj(struct jw *w, const struct job *j)
{
    const struct kv_seq_stats *k = &j->kv;
    jw_fmt(w, "{\"strategy\":\"%s\",\"requested_strategy\":\"%s\",", ipc_cache_strategy_name(&j->cache, k->strategy),
           j->cache.name);
    jw_fmt(w, "\"bytes\":{\"device\":%zu,\"host\":%zu,\"disk\":0},\"resident_layers\":%d,\"streamed_layers\":%d,",
           k->dev_bytes, k->host_bytes, k->resident_layers, k->streamed_layers);
    jw_fmt(w, "\"prefill_ms\":%.3f,\"decode_ms\":%.3f,\"fallback\":", j->prefill_ms, j->decode_ms);
    const char *fb = engine_fallback_name(k->fallback);
    if (fb)
        jw_fmt(w, "\"%s\"", fb);
    else
        jw_lit(w, "null");
    jw_lit(w, ",\"prefetch\":");
    write_prefetch(w, &k->xfer);
    jw_lit(w, "}");
}

static void write_kvtier(struct jw *w, const struct job *j)
{
    jw_lit(w, "\"kvtier\":");
    write_kvtier_obj(w, j);
}

static void write_head(struct jw *w, struct req *r, const char *object)
{
    jw_lit(w, "{\"id\":");
    jw_str(w, r->id, strlen(r->id));
    jw_fmt(w, ",\"object\":\"%s\",\"created\":%lld,\"model\":", object, (long long)r->created);
    const char *m = engine_model_id(r->srv->eng);
    jw_str(w, m, strlen(m));
    jw_lit(w, ",\"choices\":[");
}

/* One choice: text[0, n) and generated tokens [g0, g1). */
static void write_choice(struct jw *w, struct req *r, int i, const char *text, size_t n, int g0, int g1,
                         const char *finish, bool delta, bool role)
{
    const struct job_choice *c = &r->job->ch[i];
    jw_fmt(w, "{\"index\":%d,", i);
    if (r->kind == REPLY_CHAT) {
        jw_lit(w, delta ? "\"delta\":{" : "\"message\":{\"role\":\"assistant\",");
        if (role)
            jw_lit(w, "\"role\":\"assistant\",");
        if (!delta || role || n) {
            jw_lit(w, "\"content\":");
            jw_str(w, text, n);
        } else if (w->p[w->n - 1] == ',') {
            w->n--;
        }
        jw_lit(w, "},");
    } else {
        jw_lit(w, "\"text\":");
        jw_str(w, text, n);
        jw_lit(w, ",");
    }
    jw_lit(w, "\"logprobs\":");
    write_logprobs(w, r, i, g0, g1);
    if (r->return_tokens) {
        jw_lit(w, ",\"tokens\":[");
        for (int t = g0; t < g1; t++)
            jw_fmt(w, t > g0 ? ",%d" : "%d", c->seq.toks[r->job->n_prompt + (size_t)t]);
        jw_lit(w, "]");
    }
    jw_lit(w, ",\"finish_reason\":");
    if (finish)
        jw_fmt(w, "\"%s\"}", finish);
    else
        jw_lit(w, "null}");
}

static enum MHD_Result reply_done(struct req *r)
{
    struct job *j = r->job;
    if (j->err.st != IPC_OK)
        return reply_error(r, &j->err);
    if (r->kind == REPLY_SESSION_OP) { /* the session as it is now (a fork: the new one) */
        json_t *o;
        struct ipc_error err;
        if (engine_session_json(r->srv->eng, r->uid, j->reply_id[0] ? j->reply_id : j->session_id, &o, &err) != IPC_OK)
            return reply_error(r, &err);
        return reply_json(r, 200, o);
    }
    if (r->kind == REPLY_SESSION) {
        json_t *o;
        struct ipc_error err;
        if (engine_session_json(r->srv->eng, r->uid, j->session_id, &o, &err) != IPC_OK)
            return reply_error(r, &err);
        json_object_set_new(o, "usage", json_pack("{s:I,s:i}", "prompt_tokens", (json_int_t)j->n_prompt,
                                                  "cached_tokens", j->n_cached));
        struct jw w;
        jw_dynamic(&w);
        write_kvtier_obj(&w, j);
        json_t *k = w.failed ? NULL : json_loadb(w.p, w.n, 0, NULL);
        free(w.p);
        if (!k || json_object_set_new(o, "kvtier", k) != 0) {
            json_decref(o);
            return MHD_NO; /* out of memory even for the reply: drop the connection */
        }
        return reply_json(r, 200, o);
    }
    struct jw w;
    jw_dynamic(&w);
    write_head(&w, r, r->kind == REPLY_CHAT ? "chat.completion" : "text_completion");
    for (int i = 0; i < j->n; i++) {
        if (i)
            jw_lit(&w, ",");
        write_choice(&w, r, i, j->ch[i].seq.text, j->ch[i].n_text, 0, j->ch[i].n_gen, finish_name(j->ch[i].finish),
                     false, false);
    }
    jw_lit(&w, "],");
    write_usage(&w, j);
    jw_lit(&w, ",");
    write_kvtier(&w, j);
    jw_lit(&w, "}");
    return reply_jw(r, 200, &w);
}

/* ---- SSE streams ----------------------------------------------------------------- */

#define STREAM_BLOCK (64 * 1024)
#define EVENT_SLACK 1024 /* room kept for an event's fixed fields */

/* Appends one "data: {...}\n\n" event built by the caller between begin
 * and end; false (and nothing written) when it did not fit. */
static size_t event_begin(struct jw *w)
{
    jw_lit(w, "data: ");
    return w->n - 6;
}

static bool event_end(struct jw *w, size_t mark)
{
    jw_lit(w, "\n\n");
    if (!w->failed)
        return true;
    w->failed = false;
    w->n = mark;
    return false;
}

/* What the stream needs of the job's shared state, taken under the engine
 * lock so that the JSON is formatted after unlocking (the engine thread
 * takes the lock to publish every step).  Tokens and logprobs below n_gen
 * never change once published, and nothing changes after done; the text
 * buffer may move, so the unsent text is copied (into r->snap). */
struct stream_view {
    bool done;
    struct ipc_error err;
    const char *text[SERVER_MAX_N]; /* the text from base[i] on */
    size_t base[SERVER_MAX_N], n_text[SERVER_MAX_N];
    bool partial[SERVER_MAX_N]; /* n_text is short of the published text: more to come */
    int n_gen[SERVER_MAX_N];
    enum gen_finish finish[SERVER_MAX_N];
};

/* Called under the engine lock.  Copies at most max bytes of text: no
 * more fits in one read's buffer anyway. */
static void stream_snapshot(const struct req *r, struct stream_view *v, size_t max)
{
    const struct job *j = r->job;
    size_t left = max < STREAM_BLOCK ? max : STREAM_BLOCK, at = 0;
    v->done = j->done;
    v->err = j->err;
    for (int i = 0; i < j->n; i++) {
        const struct job_choice *c = &j->ch[i];
        size_t want = c->n_text - r->sent_text[i], take = want < left ? want : left;
        if (take) /* c->seq.text is NULL until the job is admitted */
            memcpy(r->snap + at, c->seq.text + r->sent_text[i], take);
        v->text[i] = r->snap + at;
        v->base[i] = r->sent_text[i];
        v->n_text[i] = r->sent_text[i] + take;
        v->partial[i] = take < want;
        v->n_gen[i] = c->n_gen;
        v->finish[i] = c->finish;
        at += take;
        left -= take;
    }
}

/* Writes as many pending events as fit in buf[0..max) (no lock held).
 * Returns the bytes written; *stuck when an event cannot fit even an
 * empty buffer. */
static size_t stream_events(struct req *r, const struct stream_view *v, char *buf, size_t max, bool *stuck)
{
    struct job *j = r->job;
    struct jw w;
    jw_fixed(&w, buf, max);
    *stuck = false;
    const char *object = r->kind == REPLY_CHAT ? "chat.completion.chunk" : "text_completion";
    bool need_toks = r->return_tokens || r->logprobs;
    /* a first guess; an event that does not fit is retried smaller */
    size_t per_tok = 16 + (r->logprobs ? (size_t)(1 + j->top_logprobs) * 96 : 0);
    if (r->phase == 0 && v->done && v->err.st != IPC_OK) {
        size_t mark = event_begin(&w);
        jw_lit(&w, "{\"error\":");
        write_error_body(&w, &v->err);
        jw_lit(&w, "}");
        if (event_end(&w, mark)) {
            r->phase = 2;
            engine_count_error(r->srv->eng, v->err.st);
        }
    }
    bool all_fin = true;
    for (int i = 0; i < j->n && r->phase == 0; i++) {
        for (;;) {
            bool role = r->kind == REPLY_CHAT && !r->role_sent[i];
            size_t t0 = r->sent_text[i];
            int g0 = r->sent_gen[i];
            bool news = role || v->n_text[i] > t0 || (need_toks && v->n_gen[i] > g0);
            bool fin = !news && v->done && !v->partial[i] && !r->fin_sent[i];
            if (!news && !fin)
                break;
            size_t room = w.cap > w.n + EVENT_SLACK ? w.cap - w.n - EVENT_SLACK : 0;
            int g1 = v->n_gen[i];
            if (need_toks && per_tok * (size_t)(g1 - g0) > room / 2)
                g1 = g0 + (int)(room / 2 / per_tok);
            if (w.n == 0 && g1 == g0 && need_toks && v->n_gen[i] > g0)
                g1 = g0 + 1; /* an empty buffer always gets a try with one token */
            size_t t1 = t0 + jw_fit(v->text[i] + (t0 - v->base[i]), v->n_text[i] - t0, need_toks ? room / 2 : room);
            if (news && !role && t1 == t0 && g1 == g0) {
                *stuck = w.n == 0;
                return w.n; /* not even one piece fits: wait for the socket to drain */
            }
            size_t offset = r->text_offset[i]; /* write_logprobs moves it on */
            for (;;) {
                bool last = fin && i == j->n - 1;
                size_t mark = event_begin(&w);
                write_head(&w, r, object);
                write_choice(&w, r, i, v->text[i] + (t0 - v->base[i]), t1 - t0, g0, g1,
                             fin ? finish_name(v->finish[i]) : NULL, true, role);
                jw_lit(&w, "]");
                if (last) {
                    jw_lit(&w, ",");
                    write_usage(&w, j);
                    jw_lit(&w, ",");
                    write_kvtier(&w, j);
                }
                jw_lit(&w, "}");
                if (event_end(&w, mark))
                    break;
                r->text_offset[i] = offset;
                if (mark > 0)
                    return w.n; /* send what is there; the retry gets an empty buffer */
                /* Longer token texts than guessed: fewer tokens, then the
                 * text alone in a later event. */
                if (g1 - g0 > 1) {
                    g1 = g0 + (g1 - g0) / 2;
                } else if (g1 > g0 && t1 > t0) {
                    t1 = t0;
                } else {
                    *stuck = true;
                    return 0;
                }
            }
            r->role_sent[i] = true;
            r->sent_text[i] = t1;
            r->sent_gen[i] = g1;
            if (fin)
                r->fin_sent[i] = true;
        }
        all_fin = all_fin && r->fin_sent[i];
    }
    if (r->phase == 0 && all_fin)
        r->phase = r->include_usage ? 1 : 2;
    if (r->phase == 1) {
        size_t mark = event_begin(&w);
        write_head(&w, r, object);
        jw_lit(&w, "],");
        write_usage(&w, j);
        jw_lit(&w, "}");
        if (!event_end(&w, mark))
            return w.n;
        r->phase = 2;
    }
    if (r->phase == 2) {
        size_t mark = event_begin(&w);
        jw_lit(&w, "[DONE]");
        if (event_end(&w, mark))
            r->phase = 3;
    }
    return w.n;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    struct req *r = cls;
    if (r->hup || r->overflow)
        return MHD_CONTENT_READER_END_WITH_ERROR;
    if (r->phase == 3)
        return MHD_CONTENT_READER_END_OF_STREAM;
    struct stream_view v;
    engine_lock(r->srv->eng);
    stream_snapshot(r, &v, max);
    engine_unlock(r->srv->eng);
    bool stuck;
    size_t n = stream_events(r, &v, buf, max, &stuck);
    if (stuck) {
        log_msg(LOG_ERR, "uid %u pid %d: a stream event does not fit %zu bytes; stream ended", (unsigned)r->uid,
                (int)r->pid, max);
        return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    if (n)
        return (ssize_t)n;
    if (r->phase == 3)
        return MHD_CONTENT_READER_END_OF_STREAM;
    suspend(r);
    return 0;
}

/* Whether a suspended request has something new for its client (under the lock). */
static bool has_news(const struct req *r)
{
    const struct job *j = r->job;
    if (j->done || r->phase > 0)
        return true;
    if (!r->stream)
        return false;
    for (int i = 0; i < j->n; i++)
        if (j->ch[i].n_text > r->sent_text[i] || j->ch[i].n_gen > r->sent_gen[i] ||
            (r->kind == REPLY_CHAT && !r->role_sent[i]))
            return true;
    return false;
}

/* Generated text the client has not read yet, over the limit: the reader
 * is too slow (or stopped), so its generation ends rather than buffering. */
static bool over_limit(const struct req *r, size_t max)
{
    size_t backlog = 0;
    for (int i = 0; i < r->job->n; i++)
        backlog += r->job->ch[i].n_text - r->sent_text[i];
    return r->stream && backlog > max;
}

/* ---- request decoding helpers ------------------------------------------------------ */

static enum MHD_Result need_ready(struct req *r, bool *ok)
{
    char msg[256];
    enum engine_state st = engine_state(r->srv->eng, msg, sizeof(msg));
    /* ready once the loop has seen it too: it sizes s->piece then */
    *ok = st == ENGINE_READY && r->srv->ready;
    if (*ok)
        return MHD_YES;
    return fail(r, IPC_EUNAVAIL, "", st != ENGINE_FAILED ? "the model is loading" : "the model failed to load");
}

static enum MHD_Result parse_body(struct req *r, bool empty_ok, bool *ok)
{
    *ok = false;
    if (!r->n_body && empty_ok) {
        *ok = true;
        return MHD_YES;
    }
    json_error_t je;
    r->root = json_loadb(r->body ? r->body : "", r->n_body, JSON_REJECT_DUPLICATES, &je);
    if (!r->root) {
        struct ipc_error e;
        ipc_fail(&e, IPC_EINVAL, "", "invalid JSON body at line %d column %d: %s", je.line, je.column, je.text);
        return reply_error(r, &e);
    }
    if (!json_is_object(r->root))
        return fail(r, IPC_EINVAL, "", "the request body must be a JSON object");
    *ok = true;
    return MHD_YES;
}

static enum MHD_Result unknown_field(struct req *r, const char *key, const char *known)
{
    struct ipc_error e;
    ipc_fail(&e, IPC_EINVAL, key, "unknown field \"%.48s\" (known: %s)", key, known);
    return reply_error(r, &e);
}

static struct ipc_limits limits(const struct server *s)
{
    const engine *e = s->eng;
    int vocab = engine_model_config(e)->vocab_size;
    int tv = tokenizer_vocab_size(engine_tokenizer(e));
    return (struct ipc_limits){.vocab = tv < vocab ? tv : vocab, .max_context = engine_context(e),
                               .max_n = s->cfg->max_n, .max_messages = s->cfg->max_messages,
                               .sliding_window = engine_model_config(e)->sliding_window};
}

static enum ipc_status encode(struct server *s, const char *text, size_t len, bool add_special, const char *field,
                              struct tok_ids *ids, struct ipc_error *err)
{
    char msg[TEXT_ERR_LEN];
    enum text_status ts = tokenizer_encode(engine_tokenizer(s->eng), text, len, add_special, ids, msg);
    if (ts == TEXT_OK)
        return IPC_OK;
    return ipc_fail(err, ts == TEXT_ENOMEM ? IPC_ENOMEM : IPC_EINVAL, field, "%s: %s", field, msg);
}

static enum ipc_status render_text(struct server *s, const struct chat_msg *m, size_t n, bool gen_prompt, char **text,
                                   size_t *len, struct ipc_error *err)
{
    char msg[TEXT_ERR_LEN];
    enum text_status ts = chat_render(engine_chat_template(s->eng), m, n, gen_prompt, engine_bos_text(s->eng),
                                      engine_eos_text(s->eng), text, len, msg);
    if (ts == TEXT_OK)
        return IPC_OK;
    enum ipc_status st = ts == TEXT_EUNSUPPORTED ? IPC_ENOTIMPL : ts == TEXT_ENOMEM ? IPC_ENOMEM : IPC_EINVAL;
    return ipc_fail(err, st, "messages", "%s", msg);
}

static enum ipc_status render(struct server *s, const struct chat_msg *m, size_t n, bool gen_prompt, struct tok_ids *ids,
                              struct ipc_error *err)
{
    char *text;
    size_t len;
    enum ipc_status st = render_text(s, m, n, gen_prompt, &text, &len, err);
    if (st != IPC_OK)
        return st;
    /* the template spells the special tokens out, so none are added */
    st = encode(s, text, len, false, "messages", ids, err);
    free(text);
    return st;
}

/* The request's prompt as ids (owned by *ids). */
static enum ipc_status prompt_ids(struct server *s, const struct ipc_gen_req *g, struct tok_ids *ids,
                                  struct ipc_error *err)
{
    if (g->chat)
        return render(s, g->msgs, g->n_msgs, true, ids, err);
    if (g->text)
        return encode(s, g->text, g->text_len, true, "prompt", ids, err);
    ids->ids = malloc(g->n_ids * sizeof(*ids->ids));
    if (!ids->ids)
        return ipc_fail(err, IPC_ENOMEM, "prompt", "no memory for the prompt");
    memcpy(ids->ids, g->ids, g->n_ids * sizeof(*ids->ids));
    ids->n = ids->cap = g->n_ids;
    return IPC_OK;
}

static void new_id(struct req *r, const char *prefix)
{
    snprintf(r->id, sizeof(r->id), "%s-%llx%06llx", prefix, (unsigned long long)r->srv->started,
             (unsigned long long)++r->srv->ids);
    r->created = time(NULL);
}

/* Hands j to the engine and parks the request until it has output. */
static enum MHD_Result submit(struct req *r, struct job *j)
{
    struct ipc_error err;
    if (r->stream && !(r->snap = malloc(STREAM_BLOCK))) {
        job_release(r->srv->eng, j);
        return fail(r, IPC_ENOMEM, "", "no memory for the stream's buffer");
    }
    if (engine_submit(r->srv->eng, j, &err) != IPC_OK) {
        job_release(r->srv->eng, j);
        return reply_error(r, &err);
    }
    track(r, j);
    if (!r->stream) {
        suspend(r);
        return MHD_YES;
    }
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, STREAM_BLOCK, stream_read, r, NULL);
    if (!resp)
        return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result res = MHD_queue_response(r->conn, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return res;
}

/* ---- endpoints -------------------------------------------------------------------- */

/* Whether some layer attends to every token, so that a static cache fills
 * (sliding layers keep a ring of their window). */
static bool has_full_layer(const struct model_config *mc)
{
    for (int l = 0; l < mc->n_layers; l++)
        if (!mc->layer_window[l])
            return true;
    return false;
}

static enum MHD_Result h_generate(struct req *r, bool chat)
{
    struct server *s = r->srv;
    struct ipc_limits lim = limits(s);
    struct ipc_gen_req g;
    struct ipc_error err;
    struct tok_ids ids = {0};
    enum ipc_status st = ipc_gen_req_parse(r->root, chat, &lim, &g, &err);
    if (st == IPC_OK && g.session && g.cache_given)
        st = ipc_fail(&err, IPC_EINVAL, "cache", "a session's cache strategy is fixed when it is created");
    if (st == IPC_OK)
        st = prompt_ids(s, &g, &ids, &err);
    int ctx = engine_context(s->eng);
    if (st == IPC_OK && !ids.n)
        st = ipc_fail(&err, IPC_EINVAL, chat ? "messages" : "prompt", "the prompt is empty (no tokens)");
    else if (st == IPC_OK && ids.n >= (size_t)ctx)
        st = ipc_fail(&err, IPC_ECONTEXT, chat ? "messages" : "prompt",
                      "the prompt has %zu tokens; the context holds %d", ids.n, ctx);
    int left = ctx - (int)ids.n;
    /* OpenAI's defaults: 16 tokens for completions, the rest of the context for chat */
    int max_new = g.max_tokens > 0 ? g.max_tokens : chat ? left : left < 16 ? left : 16;
    /* a sink cache's positions are indices in its window: it goes past the context */
    if (st == IPC_OK && max_new > left && !g.cache.params.sink)
        st = ipc_fail(&err, IPC_ECONTEXT, "max_tokens",
                      "the prompt (%zu tokens) + max_tokens (%d) exceeds the context (%d tokens)", ids.n, max_new, ctx);
    const struct kv_seq_params *cp = &g.cache.params;
    bool is_static = cp->strategy == KV_STATIC || cp->strategy == KV_OFFLOADED_STATIC;
    /* both lengths are known now: refuse before any work what would fail
     * part-way (the last generated token is never stored) */
    if (st == IPC_OK && is_static && !cp->window_length && has_full_layer(engine_model_config(s->eng)) &&
        (int64_t)ids.n + max_new - 1 > cp->max_cache_len)
        st = ipc_fail(&err, IPC_EINVAL, "cache.max_cache_len",
                      "cache.max_cache_len (%lld) cannot hold the prompt (%zu tokens) + max_tokens (%d) - 1",
                      (long long)cp->max_cache_len, ids.n, max_new);
    struct job *j = st == IPC_OK ? job_new(g.n, g.stops, g.n_stops) : NULL;
    if (st == IPC_OK && !j)
        st = ipc_fail(&err, IPC_ENOMEM, "", "no memory for the request");
    if (st != IPC_OK) {
        free(ids.ids);
        ipc_gen_req_release(&g);
        return reply_error(r, &err);
    }
    j->kind = JOB_GENERATE;
    j->uid = r->uid;
    j->prompt = ids.ids;
    j->n_prompt = ids.n;
    j->max_new = max_new;
    j->sampling = g.sampling;
    if (!g.has_seed && getrandom(&j->sampling.seed, sizeof(j->sampling.seed), 0) < 0)
        j->sampling.seed = (uint64_t)time(NULL);
    j->ignore_eos = g.ignore_eos;
    j->logprobs = g.logprobs;
    j->top_logprobs = g.top_logprobs;
    j->cache = g.cache;
    if (g.session)
        snprintf(j->session_id, sizeof(j->session_id), "%s", g.session);
    j->owner = r;
    r->kind = chat ? REPLY_CHAT : REPLY_COMPLETION;
    r->stream = g.stream;
    r->include_usage = g.include_usage;
    r->return_tokens = g.return_tokens;
    r->logprobs = g.logprobs;
    r->top_logprobs = g.top_logprobs;
    new_id(r, chat ? "chatcmpl" : "cmpl");
    ipc_gen_req_release(&g);
    return submit(r, j);
}

static enum MHD_Result h_completions(struct req *r, const char *arg)
{
    (void)arg;
    return h_generate(r, false);
}

static enum MHD_Result h_chat(struct req *r, const char *arg)
{
    (void)arg;
    return h_generate(r, true);
}

static enum MHD_Result h_health(struct req *r, const char *arg)
{
    (void)arg;
    char msg[256];
    enum engine_state st = engine_state(r->srv->eng, msg, sizeof(msg));
    if (st == ENGINE_READY && !r->srv->ready)
        st = ENGINE_LOADING; /* until the loop has seen it (need_ready) */
    if (st == ENGINE_READY && !r->srv->draining)
        return reply_json(r, 200, json_pack("{s:s}", "status", "ok"));
    const char *what = st == ENGINE_LOADING ? "loading" : st == ENGINE_FAILED ? "failed" : "draining";
    return reply_json(r, 503, json_pack("{s:s,s:{s:i,s:s,s:s}}", "status", what, "error", "code", 503, "message",
                                        st == ENGINE_LOADING ? "Loading model" : st == ENGINE_FAILED ? msg
                                                                                                    : "Shutting down",
                                        "type", "unavailable_error"));
}

static enum MHD_Result h_models(struct req *r, const char *arg)
{
    (void)arg;
    engine *e = r->srv->eng;
    const struct model_config *mc = engine_model_config(e);
    return reply_json(r, 200, json_pack("{s:s,s:[{s:s,s:s,s:I,s:s,s:{s:i,s:i,s:i,s:i,s:s,s:s}}]}", "object", "list",
                                        "data", "id", engine_model_id(e), "object", "model", "created",
                                        (json_int_t)r->srv->started, "owned_by", "kvtier", "meta", "n_vocab",
                                        mc->vocab_size, "n_ctx_train", mc->max_position_embeddings, "n_ctx",
                                        engine_context(e), "n_embd", mc->hidden_size, "architecture", mc->arch_name,
                                        "chat_template", chat_family_name(engine_chat_template(e)->family)));
}

static enum MHD_Result h_tokenize(struct req *r, const char *arg)
{
    (void)arg;
    /* llama.cpp's {"content", "add_special"} and vLLM's {"prompt", "add_special_tokens"} */
    const json_t *text = NULL;
    bool add = false, pieces = false, vllm = false;
    const char *key;
    json_t *v;
    json_object_foreach(r->root, key, v)
    {
        bool *flag = !strcmp(key, "add_special") || !strcmp(key, "add_special_tokens") ? &add
                     : !strcmp(key, "with_pieces")                                    ? &pieces
                                                                                      : NULL;
        if (!strcmp(key, "content") || !strcmp(key, "prompt")) {
            if (!json_is_string(v))
                return fail(r, IPC_EINVAL, key, "content must be a string");
            text = v;
            vllm = !strcmp(key, "prompt");
        } else if (flag) {
            if (!json_is_boolean(v))
                return fail(r, IPC_EINVAL, key, "this field must be true or false");
            *flag = json_is_true(v);
        } else if (strcmp(key, "model") != 0) {
            return unknown_field(r, key, "content, add_special, with_pieces");
        }
    }
    if (!text)
        return fail(r, IPC_EINVAL, "content", "content is required");
    if (vllm && !json_object_get(r->root, "add_special_tokens") && !json_object_get(r->root, "add_special"))
        add = true; /* vLLM's default */
    struct tok_ids ids = {0};
    struct ipc_error err;
    if (encode(r->srv, json_string_value(text), json_string_length(text), add, "content", &ids, &err) != IPC_OK)
        return reply_error(r, &err);
    struct jw w;
    jw_dynamic(&w);
    jw_lit(&w, "{\"tokens\":[");
    for (size_t i = 0; i < ids.n; i++) {
        if (i)
            jw_lit(&w, ",");
        if (!pieces) {
            jw_fmt(&w, "%d", ids.ids[i]);
            continue;
        }
        size_t n = piece(r->srv, ids.ids[i]);
        jw_fmt(&w, "{\"id\":%d,\"piece\":", ids.ids[i]);
        jw_str(&w, r->srv->piece, n);
        jw_lit(&w, "}");
    }
    jw_fmt(&w, "],\"count\":%zu,\"max_model_len\":%d}", ids.n, engine_context(r->srv->eng));
    free(ids.ids);
    return reply_jw(r, 200, &w);
}

/* {"<key1>": text[, "<key2>": text]} (keys given with their punctuation); frees text. */
static enum MHD_Result reply_text(struct req *r, const char *key1, const char *key2, char *text, size_t len)
{
    struct jw w;
    jw_dynamic(&w);
    for (int i = 0; i < 2; i++) {
        const char *key = i ? key2 : key1;
        if (key) {
            jw_lit(&w, key);
            jw_str(&w, text, len);
        }
    }
    jw_lit(&w, "}");
    free(text);
    return reply_jw(r, 200, &w);
}

static enum MHD_Result h_detokenize(struct req *r, const char *arg)
{
    (void)arg;
    const char *key;
    json_t *v;
    json_object_foreach(r->root, key, v)
    {
        if (strcmp(key, "tokens") && strcmp(key, "model"))
            return unknown_field(r, key, "tokens");
    }
    struct ipc_limits lim = limits(r->srv);
    struct ipc_error err;
    int32_t *ids;
    size_t n;
    const json_t *toks = json_object_get(r->root, "tokens");
    if (!toks)
        return fail(r, IPC_EINVAL, "tokens", "tokens is required");
    if (ipc_parse_ids(toks, "tokens", &lim, &ids, &n, &err) != IPC_OK)
        return reply_error(r, &err);
    char *text = NULL;
    size_t len = 0;
    enum text_status ms = tokenizer_decode(engine_tokenizer(r->srv->eng), ids, n, false, &text, &len);
    free(ids);
    if (ms != TEXT_OK)
        return fail(r, IPC_ENOMEM, "tokens", "cannot decode the tokens");
    return reply_text(r, "{\"content\":", ",\"prompt\":", text, len); /* llama.cpp's and vLLM's names */
}

static enum MHD_Result h_apply_template(struct req *r, const char *arg)
{
    (void)arg;
    struct ipc_limits lim = limits(r->srv);
    struct ipc_gen_req g;
    struct ipc_error err;
    char *text = NULL;
    size_t len = 0;
    enum ipc_status st = ipc_gen_req_parse(r->root, true, &lim, &g, &err);
    if (st == IPC_OK)
        st = render_text(r->srv, g.msgs, g.n_msgs, true, &text, &len, &err);
    ipc_gen_req_release(&g);
    if (st != IPC_OK)
        return reply_error(r, &err);
    return reply_text(r, "{\"prompt\":", NULL, text, len);
}

static enum MHD_Result h_session_create(struct req *r, const char *arg)
{
    (void)arg;
    struct server *s = r->srv;
    struct ipc_limits lim = limits(s);
    struct ipc_session_req q;
    struct ipc_error err;
    struct tok_ids ids = {0};
    char id[IPC_SESSION_ID_MAX + 1];
    enum ipc_status st = ipc_session_req_parse(r->root, &lim, &q, &err);
    if (st == IPC_OK && q.system) {
        struct chat_msg m = {CHAT_ROLE_SYSTEM, q.system, q.system_len, NULL};
        st = render(s, &m, 1, false, &ids, &err);
    } else if (st == IPC_OK && q.prefix) {
        st = encode(s, q.prefix, q.prefix_len, true, "prefix", &ids, &err);
    } else if (st == IPC_OK && q.ids) {
        ids.ids = q.ids;
        ids.n = q.n_ids;
        q.ids = NULL;
    }
    if (st == IPC_OK && ids.n >= (size_t)engine_context(s->eng))
        st = ipc_fail(&err, IPC_ECONTEXT, q.field, "%s has %zu tokens; a session's start must be shorter than the context (%d)", q.field, ids.n,
                      engine_context(s->eng));
    if (st == IPC_OK)
        st = engine_session_create(s->eng, r->uid, &q.cache, q.record, id, sizeof(id), &err);
    ipc_session_req_release(&q);
    struct job *j = NULL;
    if (st == IPC_OK && ids.n && !(j = job_new(1, NULL, 0))) {
        st = ipc_fail(&err, IPC_ENOMEM, "", "no memory for the request");
        engine_session_delete(s->eng, r->uid, id, &err);
    }
    if (st != IPC_OK) {
        free(ids.ids);
        return reply_error(r, &err);
    }
    if (!j) {
        json_t *o;
        if (engine_session_json(s->eng, r->uid, id, &o, &err) != IPC_OK)
            return reply_error(r, &err);
        return reply_json(r, 200, o);
    }
    j->kind = JOB_PREFILL;
    j->uid = r->uid;
    j->prompt = ids.ids;
    j->n_prompt = ids.n;
    sampler_params_default(&j->sampling);
    j->owner = r;
    snprintf(j->session_id, sizeof(j->session_id), "%s", id);
    r->kind = REPLY_SESSION;
    struct ipc_error serr;
    if (engine_submit(s->eng, j, &serr) != IPC_OK) {
        job_release(s->eng, j);
        engine_session_delete(s->eng, r->uid, id, &err);
        return reply_error(r, &serr);
    }
    track(r, j);
    suspend(r);
    return MHD_YES;
}

static enum MHD_Result h_session_list(struct req *r, const char *arg)
{
    (void)arg;
    json_t *arr = engine_session_list(r->srv->eng, r->uid);
    return reply_json(r, 200, arr ? json_pack("{s:s,s:o}", "object", "list", "data", arr) : NULL);
}

static enum MHD_Result h_session_get(struct req *r, const char *id)
{
    json_t *o;
    struct ipc_error err;
    if (engine_session_json(r->srv->eng, r->uid, id, &o, &err) != IPC_OK)
        return reply_error(r, &err);
    return reply_json(r, 200, o);
}

/* Crop, fork and past recording run on the engine thread as jobs naming
 * the session (404, 403 and 409 busy come from engine_submit). */
static enum MHD_Result session_op(struct req *r, const char *id, enum job_kind kind, int64_t n)
{
    struct job *j = job_new(1, NULL, 0);
    if (!j)
        return fail(r, IPC_ENOMEM, "", "no memory for the request");
    j->kind = kind;
    j->uid = r->uid;
    j->op_n = n;
    j->owner = r;
    snprintf(j->session_id, sizeof(j->session_id), "%s", id);
    r->kind = REPLY_SESSION_OP;
    return submit(r, j);
}

static enum MHD_Result h_session_crop(struct req *r, const char *id)
{
    int64_t n;
    struct ipc_error err;
    if (ipc_crop_req_parse(r->root, &n, &err) != IPC_OK)
        return reply_error(r, &err);
    return session_op(r, id, JOB_CROP, n);
}

static enum MHD_Result h_session_fork(struct req *r, const char *id)
{
    if (json_object_size(r->root))
        return fail(r, IPC_EINVAL, json_object_iter_key(json_object_iter(r->root)), "fork takes no fields");
    return session_op(r, id, JOB_FORK, 0);
}

static enum MHD_Result h_session_record(struct req *r, const char *id)
{
    if (json_object_size(r->root))
        return fail(r, IPC_EINVAL, json_object_iter_key(json_object_iter(r->root)),
                    "activate_past_recording takes no fields");
    return session_op(r, id, JOB_RECORD, 0);
}

static enum MHD_Result h_session_delete(struct req *r, const char *id)
{
    struct ipc_error err;
    if (engine_session_delete(r->srv->eng, r->uid, id, &err) != IPC_OK)
        return reply_error(r, &err);
    return reply_json(r, 200, json_pack("{s:s,s:s,s:b}", "id", id, "object", "session", "deleted", 1));
}

static void metric(struct jw *w, const char *name, const char *type, const char *help, const char *labels, double v)
{
    if (help)
        jw_fmt(w, "# HELP kvtier_%s %s\n# TYPE kvtier_%s %s\n", name, help, name, type);
    jw_fmt(w, "kvtier_%s%s %.17g\n", name, labels ? labels : "", v);
}

static enum MHD_Result h_metrics(struct req *r, const char *arg)
{
    (void)arg;
    struct server *s = r->srv;
    struct engine_stats st = engine_get_stats(s->eng);
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->mhd, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
    struct jw w;
    jw_dynamic(&w);
    metric(&w, "requests_total", "counter", "Generation and session requests accepted.", NULL, (double)st.requests);
    metric(&w, "http_requests_total", "counter", "HTTP requests received.", NULL, (double)s->http_requests);
    metric(&w, "connections_refused_total", "counter", "Connections refused (peer credentials or limits).", NULL,
           (double)s->refused);
    metric(&w, "prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", NULL, (double)st.prompt_tokens);
    metric(&w, "prompt_cached_tokens_total", "counter", "Prompt tokens reused from a session's KV cache.", NULL,
           (double)st.cached_tokens);
    metric(&w, "generation_tokens_total", "counter", "Tokens generated.", NULL, (double)st.gen_tokens);
    metric(&w, "forward_steps_total", "counter", "Batched forward passes.", NULL, (double)st.steps);
    metric(&w, "requests_running", "gauge", "Sequences being generated.", NULL, st.running);
    metric(&w, "requests_waiting", "gauge", "Requests queued for admission.", NULL, st.queued);
    metric(&w, "sessions", "gauge", "Open sessions.", NULL, st.sessions);
    metric(&w, "connections", "gauge", "Open client connections.", NULL, di ? di->num_connections : 0);
    metric(&w, "kv_cache_bytes", "gauge", "KV cache bytes resident per tier.", "{tier=\"device\"}",
           (double)st.kv_dev_bytes);
    metric(&w, "kv_cache_bytes", "gauge", NULL, "{tier=\"host\"}", (double)st.kv_host_bytes);
    metric(&w, "kv_cache_bytes", "gauge", NULL, "{tier=\"disk\"}", 0);
    metric(&w, "prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the automatic prefix cache.", NULL,
           (double)st.prefix_hit_tokens);
    metric(&w, "prefix_cache_blocks", "gauge", "Token blocks in the prefix cache.", NULL, (double)st.prefix_entries);
    metric(&w, "prefix_cache_evictions_total", "counter", "Unreferenced prefix-cache blocks freed for room.", NULL,
           (double)st.prefix_evictions);
    metric(&w, "device_memory_bytes", "gauge", "Device memory budget (--device-mem) and bytes in use.",
           "{kind=\"budget\"}", (double)st.dev_budget);
    metric(&w, "device_memory_bytes", "gauge", NULL, "{kind=\"used\"}", (double)st.dev_used);
    metric(&w, "kv_fallbacks_total", "counter",
           "Sequences moved to the host tier because the device tier could not hold them.", NULL,
           (double)st.kv_fallbacks);
    jw_lit(&w, "# HELP kvtier_errors_total Error replies by kind.\n# TYPE kvtier_errors_total counter\n");
    for (int k = IPC_EINVAL; k < IPC_N_STATUS; k++)
        if (k != IPC_EPROTO && k != IPC_EIO) /* the client's own kinds */
            jw_fmt(&w, "kvtier_errors_total{kind=\"%s\"} %llu\n", ipc_status_name((enum ipc_status)k),
                   (unsigned long long)st.errors[k]);
    metric(&w, "process_start_time_seconds", "gauge", "Start time of kvtierd (Unix seconds).", NULL,
           (double)s->started);
    if (w.failed) {
        free(w.p);
        return MHD_NO;
    }
    return queue(r, 200, w.p, w.n, "text/plain; version=0.0.4; charset=utf-8");
}

/* ---- routing ---------------------------------------------------------------------------- */

typedef enum MHD_Result (*handler_fn)(struct req *r, const char *arg);

enum route_needs {
    NEEDS_NOTHING = 0,
    NEEDS_MODEL = 1,              /* 503 until the model is loaded */
    NEEDS_BODY = 2 | NEEDS_MODEL, /* a JSON object body, parsed into r->root */
    NEEDS_ANY_BODY = 4 | NEEDS_BODY, /* ... or an empty one */
};

struct route {
    const char *method;
    const char *path; /* a '*' matches one path segment (a session id): the handler's arg */
    handler_fn fn;
    enum route_needs needs; /* checked before the handler runs: model loaded, JSON object body (or none) */
};

static const struct route routes[] = {
    {"GET", "/health", h_health, NEEDS_NOTHING},
    {"GET", "/v1/health", h_health, NEEDS_NOTHING},
    {"GET", "/v1/models", h_models, NEEDS_MODEL},
    {"GET", "/metrics", h_metrics, NEEDS_NOTHING},
    {"POST", "/v1/completions", h_completions, NEEDS_BODY},
    {"POST", "/v1/chat/completions", h_chat, NEEDS_BODY},
    {"POST", "/tokenize", h_tokenize, NEEDS_BODY},
    {"POST", "/detokenize", h_detokenize, NEEDS_BODY},
    {"POST", "/apply-template", h_apply_template, NEEDS_BODY},
    {"POST", "/v1/sessions", h_session_create, NEEDS_ANY_BODY},
    {"GET", "/v1/sessions", h_session_list, NEEDS_NOTHING},
    {"GET", "/v1/sessions/*", h_session_get, NEEDS_NOTHING},
    {"DELETE", "/v1/sessions/*", h_session_delete, NEEDS_NOTHING},
    {"POST", "/v1/sessions/*/crop", h_session_crop, NEEDS_BODY},
    {"POST", "/v1/sessions/*/fork", h_session_fork, NEEDS_ANY_BODY},
    {"POST", "/v1/sessions/*/activate_past_recording", h_session_record, NEEDS_ANY_BODY},
};

/* The route for method+url; *path_ok tells a wrong method (405) from an
 * unknown path (404). */
/* Whether url matches pattern; a '*' matches one non-empty segment of at
 * most IPC_SESSION_ID_MAX bytes, copied into seg. */
static bool path_match(const char *pattern, const char *url, char *seg)
{
    const char *star = strchr(pattern, '*');
    if (!star)
        return !strcmp(url, pattern);
    size_t pre = (size_t)(star - pattern);
    if (strncmp(url, pattern, pre) != 0)
        return false;
    const char *a = url + pre, *b = strchrnul(a, '/');
    size_t len = (size_t)(b - a);
    if (!len || len > IPC_SESSION_ID_MAX || strcmp(b, star + 1) != 0)
        return false;
    memcpy(seg, a, len);
    seg[len] = '\0';
    return true;
}

static const struct route *route_find(const char *method, const char *url, bool *path_ok, char *seg)
{
    *path_ok = false;
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++) {
        const struct route *rt = &routes[i];
        if (!path_match(rt->path, url, seg))
            continue;
        *path_ok = true;
        if (!strcmp(method, rt->method))
            return rt;
    }
    return NULL;
}

static enum MHD_Result dispatch(struct req *r, const char *method)
{
    bool path_ok;
    char arg[IPC_SESSION_ID_MAX + 1] = "";
    const struct route *rt = route_find(method, r->url, &path_ok, arg);
    if (!rt) {
        struct ipc_error e;
        ipc_fail(&e, path_ok ? IPC_EMETHOD : IPC_ENOTFOUND, "", path_ok ? "method %.16s is not allowed on %.128s"
                                                                        : "no endpoint %.16s %.128s", method, r->url);
        return reply_error(r, &e);
    }
    bool ok = true;
    enum MHD_Result res = MHD_YES;
    if (rt->needs & NEEDS_MODEL)
        res = need_ready(r, &ok);
    if (ok && (rt->needs & NEEDS_BODY) == NEEDS_BODY)
        res = parse_body(r, rt->needs == NEEDS_ANY_BODY, &ok);
    return ok ? rt->fn(r, arg) : res;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **ctx)
{
    (void)version;
    struct server *s = cls;
    struct req *r = *ctx;
    if (!r) {
        r = calloc(1, sizeof(*r));
        if (!r)
            return MHD_NO;
        *ctx = r;
        r->srv = s;
        r->conn = conn;
        r->url = url;
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        r->fd = ci ? ci->connect_fd : -1;
        struct ucred cr = {.pid = 0, .uid = (uid_t)-1, .gid = (gid_t)-1};
        socklen_t len = sizeof(cr);
        if (r->fd < 0 || getsockopt(r->fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0)
            return MHD_NO;
        r->uid = cr.uid;
        r->pid = cr.pid;
        s->http_requests++;
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long n = strtoull(cl, &end, 10);
            if (errno || *end || n > s->cfg->max_body) {
                struct ipc_error e;
                ipc_fail(&e, IPC_ETOOLARGE, "", "the body is %.24s bytes; the limit is %zu (--max-body)", cl,
                         s->cfg->max_body);
                return reply_error(r, &e);
            }
            r->cap_body = (size_t)n;
        }
        return MHD_YES;
    }
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        if (r->n_body + n > s->cfg->max_body) {
            struct ipc_error e;
            ipc_fail(&e, IPC_ETOOLARGE, "", "the body is over the limit of %zu bytes (--max-body)", s->cfg->max_body);
            return reply_error(r, &e);
        }
        if (r->n_body + n > r->cap_body || !r->body) {
            size_t cap = r->cap_body > r->n_body + n ? r->cap_body : (r->n_body + n) * 2;
            cap = cap > s->cfg->max_body ? s->cfg->max_body : cap;
            char *b = realloc(r->body, cap);
            if (!b)
                return fail(r, IPC_ENOMEM, "", "no memory for the request body");
            r->body = b;
            r->cap_body = cap;
        }
        memcpy(r->body + r->n_body, upload, n);
        r->n_body += n;
        return MHD_YES;
    }
    if (r->job) { /* resumed */
        if (r->hup)
            return MHD_NO;
        engine_lock(s->eng);
        bool done = r->job->done;
        engine_unlock(s->eng);
        if (!done) {
            suspend(r);
            return MHD_YES;
        }
        return reply_done(r);
    }
    return dispatch(r, method);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **ctx, enum MHD_RequestTerminationCode why)
{
    (void)conn;
    struct server *s = cls;
    struct req *r = *ctx;
    if (!r)
        return;
    if (r->job) {
        if (why != MHD_REQUEST_TERMINATED_COMPLETED_OK)
            log_msg(LOG_INFO, "uid %u pid %d %s: client gone, generation cancelled", (unsigned)r->uid, (int)r->pid,
                    r->url);
        engine_cancel(s->eng, r->job);
        untrack(r);
        job_release(s->eng, r->job);
    }
    if (r->suspended)
        epoll_ctl(s->ep, EPOLL_CTL_DEL, r->fd, NULL);
    json_decref(r->root);
    free(r->body);
    free(r->snap);
    free(r);
    *ctx = NULL;
}

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char buf[512];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    size_t n = strlen(buf);
    while (n && buf[n - 1] == '\n')
        buf[--n] = '\0';
    log_msg(LOG_DEBUG, "http: %s", buf);
}

/* ---- the loop ------------------------------------------------------------------------------ */

/* A refused peer gets a short HTTP answer before the close, so curl says why. */
static void refuse(int fd, int code, const char *why)
{
    char buf[512];
    char body[256];
    int bn = snprintf(body, sizeof(body), "{\"error\":{\"code\":%d,\"message\":\"%s\",\"type\":\"%s\"}}\n", code, why,
                      code == 403 ? "permission_error" : "unavailable_error");
    int n = snprintf(buf, sizeof(buf),
                     "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n"
                     "\r\n%s",
                     code, code == 403 ? "Forbidden" : "Service Unavailable", bn, body);
    if (send(fd, buf, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
        log_msg(LOG_DEBUG, "refusal not sent: %s", strerror(errno));
    close(fd);
}

static void on_accept(struct server *s)
{
    for (;;) {
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                log_msg(LOG_WARN, "accept: %s", strerror(errno));
            return;
        }
        struct ucred cr;
        socklen_t len = sizeof(cr);
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0 ||
            !sock_peer_allowed(cr.uid, cr.gid, s->cfg->allow_gid)) {
            log_msg(LOG_WARN, "refused a connection from uid %u pid %d: not the daemon's user or --allow-group",
                    (unsigned)cr.uid, (int)cr.pid);
            s->refused++;
            refuse(fd, 403, "this uid may not use kvtierd");
            continue;
        }
        const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->mhd, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
        if (di && di->num_connections >= (unsigned)s->cfg->max_clients) {
            log_msg(LOG_WARN, "refused a connection from uid %u pid %d: %d clients connected (--max-clients)",
                    (unsigned)cr.uid, (int)cr.pid, s->cfg->max_clients);
            s->refused++;
            refuse(fd, 503, "too many clients connected");
            continue;
        }
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        if (MHD_add_connection(s->mhd, fd, (struct sockaddr *)&sa, sizeof(sa)) != MHD_YES)
            log_msg(LOG_WARN, "cannot serve a connection: %s", strerror(errno));
    }
}

static void stop_listening(struct server *s)
{
    if (s->listen_fd < 0)
        return;
    epoll_ctl(s->ep, EPOLL_CTL_DEL, s->listen_fd, NULL);
    close(s->listen_fd);
    s->listen_fd = -1;
    /* a socket-activated path belongs to systemd's .socket unit */
    if (s->cfg->sock_path && !s->cfg->socket_activated)
        unlink(s->cfg->sock_path);
}

static void on_signal(struct server *s)
{
    unsigned char sig;
    while (read(s->sig_fd, &sig, 1) == 1) {
        if (sig == SIGHUP) {
            int rc = log_reopen();
            log_msg(rc ? LOG_ERR : LOG_INFO, "SIGHUP: log reopened%s%s", rc ? ": " : "", rc ? strerror(-rc) : "");
            continue;
        }
        if (s->draining) { /* a second TERM/INT: stop now */
            log_msg(LOG_WARN, "second signal %u: exiting without waiting", sig);
            engine_abort_all(s->eng, IPC_EUNAVAIL, "kvtierd is shutting down");
            s->quit = true;
            continue;
        }
        int n = engine_pending(s->eng);
        log_msg(LOG_INFO, "signal %u: draining %d request(s), at most %d s", sig, n, s->cfg->drain_timeout_s);
        char msg[96];
        snprintf(msg, sizeof(msg), "STOPPING=1\nSTATUS=Draining %d requests", n);
        sd_notify_msg(msg);
        s->draining = true;
        s->drain_deadline = clock_ms() + s->cfg->drain_timeout_s * 1e3;
        stop_listening(s);
        engine_drain(s->eng);
    }
}

/* The engine published output: resume the requests that can move on. */
static enum server_exit on_wake(struct server *s)
{
    uint64_t v;
    if (read(s->wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
        log_msg(LOG_WARN, "eventfd read: %s", strerror(errno));
    if (!s->ready) {
        char msg[512];
        enum engine_state st = engine_state(s->eng, msg, sizeof(msg));
        if (st == ENGINE_FAILED) {
            log_msg(LOG_ERR, "cannot load the model: %s", msg);
            return SERVER_ELOAD;
        }
        if (st == ENGINE_READY) {
            s->piece_cap = engine_max_piece(s->eng);
            if (!(s->piece = malloc(s->piece_cap + 1))) {
                log_msg(LOG_ERR, "no memory for a %zu-byte token text buffer", s->piece_cap);
                return SERVER_EFATAL;
            }
            s->ready = true;
            snprintf(msg, sizeof(msg), "READY=1\nSTATUS=Ready: %s, context %d", engine_model_id(s->eng),
                     engine_context(s->eng));
            sd_notify_msg(msg);
        }
    }
    engine_lock(s->eng);
    for (struct req *r = s->waiting; r; r = r->next) {
        if (!r->overflow && over_limit(r, s->cfg->max_output)) {
            r->overflow = true;
            r->job->cancelled = true;
            log_msg(LOG_WARN, "uid %u pid %d: stream reader too slow (over %zu bytes queued; --max-output), cancelled",
                    (unsigned)r->uid, (int)r->pid, s->cfg->max_output);
        }
        r->wake = r->suspended && (r->overflow || has_news(r));
    }
    engine_unlock(s->eng);
    for (struct req *r = s->waiting; r; r = r->next)
        if (r->wake)
            resume(r);
    return SERVER_OK;
}

static void on_hangup(struct server *s, struct req *r)
{
    r->hup = true;
    engine_cancel(s->eng, r->job);
    resume(r);
}

enum server_exit server_run(engine *e, const struct server_config *cfg, int listen_fd, int sig_fd, int wake_fd)
{
    struct server s = {.eng = e, .cfg = cfg, .listen_fd = listen_fd, .sig_fd = sig_fd, .wake_fd = wake_fd,
                       .started = time(NULL), .s_listen = {SRC_LISTEN}, .s_sig = {SRC_SIGNAL}, .s_wake = {SRC_WAKE},
                       .s_mhd = {SRC_MHD}};
    s.mhd = MHD_start_daemon(MHD_USE_EPOLL | MHD_USE_NO_LISTEN_SOCKET | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG,
                             0, NULL, NULL, on_request, &s, MHD_OPTION_NOTIFY_COMPLETED, on_completed, &s,
                             MHD_OPTION_CONNECTION_LIMIT, (unsigned)cfg->max_clients + 16,
                             MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)64 * 1024, MHD_OPTION_CONNECTION_TIMEOUT,
                             (unsigned)cfg->idle_timeout_s, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL, MHD_OPTION_END);
    if (!s.mhd) {
        log_msg(LOG_ERR, "cannot start the HTTP server (libmicrohttpd)");
        return SERVER_EFATAL;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s.mhd, MHD_DAEMON_INFO_EPOLL_FD);
    s.mhd_fd = di ? di->epoll_fd : -1;
    s.ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev[4] = {{.events = EPOLLIN, .data.ptr = &s.s_listen},
                                {.events = EPOLLIN, .data.ptr = &s.s_sig},
                                {.events = EPOLLIN, .data.ptr = &s.s_wake},
                                {.events = EPOLLIN, .data.ptr = &s.s_mhd}};
    int fds[4] = {listen_fd, sig_fd, wake_fd, s.mhd_fd};
    for (int i = 0; i < 4; i++) {
        if (s.ep < 0 || fds[i] < 0 || epoll_ctl(s.ep, EPOLL_CTL_ADD, fds[i], &ev[i]) != 0) {
            log_msg(LOG_ERR, "cannot set up the event loop: %s", strerror(errno));
            MHD_stop_daemon(s.mhd);
            if (s.ep >= 0)
                close(s.ep);
            return SERVER_EFATAL;
        }
    }
    enum server_exit rc = SERVER_OK;
    bool aborted = false;
    while (!s.quit) {
        MHD_run(s.mhd);
        if (s.draining && !s.waiting && engine_pending(e) == 0)
            break;
        int timeout = -1;
        MHD_UNSIGNED_LONG_LONG mt;
        if (MHD_get_timeout(s.mhd, &mt) == MHD_YES)
            timeout = mt > 60000 ? 60000 : (int)mt;
        if (s.draining) {
            double left = s.drain_deadline - clock_ms();
            if (left <= 0 && !aborted) {
                log_msg(LOG_WARN, "drain timeout: cancelling %d request(s)", engine_pending(e));
                engine_abort_all(e, IPC_EUNAVAIL, "kvtierd is shutting down (drain timeout)");
                aborted = true;
                s.drain_deadline = clock_ms() + 2000; /* time for the error replies to go out */
            } else if (left <= 0) {
                break;
            }
            timeout = timeout < 0 || timeout > 100 ? 100 : timeout;
        }
        struct epoll_event evs[64];
        int n = epoll_wait(s.ep, evs, 64, timeout);
        if (n < 0 && errno != EINTR) {
            log_msg(LOG_ERR, "epoll_wait: %s", strerror(errno));
            rc = SERVER_EFATAL;
            break;
        }
        for (int i = 0; i < n; i++) {
            struct ev_src *src = evs[i].data.ptr;
            if (src->kind == SRC_LISTEN && !s.draining)
                on_accept(&s);
            else if (src->kind == SRC_SIGNAL)
                on_signal(&s);
            else if (src->kind == SRC_WAKE)
                rc = on_wake(&s);
            else if (src->kind == SRC_CONN)
                on_hangup(&s, (struct req *)src);
        }
        if (rc != SERVER_OK)
            break;
    }
    /* MHD must not be stopped with suspended connections */
    for (struct req *r = s.waiting; r; r = r->next) {
        r->hup = true;
        resume(r);
    }
    MHD_run(s.mhd);
    MHD_stop_daemon(s.mhd);
    stop_listening(&s);
    close(s.ep);
    free(s.piece);
    return rc;
}
