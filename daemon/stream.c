/* stream.c - SSE streams (stream: true): the chunked response's reader
 * callback formats OpenAI chunk events straight into libmicrohttpd's
 * socket buffer and suspends the connection when it has nothing to send.
 * The job's output is snapshot under the engine lock and formatted after
 * unlocking, so the engine thread never waits for JSON.  A stream moves
 * through enum stream_phase. */
#include <string.h>

#include "daemon/http.h"
#include "util/log.h"

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
    v->done = job_done_locked(j);
    if (v->done)
        v->err = job_result(j)->err;
    for (int i = 0; i < j->n; i++) {
        struct job_progress c = job_progress(j, i);
        size_t want = c.n_text - r->sent_text[i], take = want < left ? want : left;
        if (r->tools && !v->done)
            take = 0; /* the text may turn out to be a tool call: held until the end */
        if (take) /* c.text is NULL until the first piece of text */
            memcpy(r->snap + at, c.text + r->sent_text[i], take);
        v->text[i] = r->snap + at;
        v->base[i] = r->sent_text[i];
        v->n_text[i] = r->sent_text[i] + take;
        v->partial[i] = take < want;
        v->n_gen[i] = c.n_gen;
        v->finish[i] = c.finish;
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
    if (r->phase == STREAM_CHOICES && v->done && v->err.st != IPC_OK) {
        size_t mark = event_begin(&w);
        jw_lit(&w, "{\"error\":");
        write_error_body(&w, &v->err);
        jw_lit(&w, "}");
        if (event_end(&w, mark)) {
            r->phase = STREAM_DONE;
            engine_count_error(r->srv->eng, v->err.st);
        }
    }
    bool all_fin = true;
    for (int i = 0; i < j->n && r->phase == STREAM_CHOICES; i++) {
        if (v->done && v->err.st == IPC_OK && !r->fin_sent[i] && read_calls(r, i)) {
            /* the calls whole in one chunk (a client joins the deltas of a
             * call's index, so one delta is a complete one); after done the
             * text no longer changes and is read without the lock */
            struct job_progress p = job_progress(j, i);
            size_t mark = event_begin(&w);
            write_head(&w, r, object);
            write_choice(&w, r, i, p.text, p.n_text, r->sent_gen[i], p.n_gen, "tool_calls", true,
                         !r->role_sent[i]);
            jw_lit(&w, "]");
            if (i == j->n - 1) {
                jw_lit(&w, ",");
                write_usage(&w, j);
                jw_lit(&w, ",");
                write_kvtier(&w, j);
            }
            jw_lit(&w, "}");
            if (!event_end(&w, mark)) {
                *stuck = w.n == 0;
                return w.n;
            }
            r->role_sent[i] = r->fin_sent[i] = true;
            r->sent_text[i] = p.n_text;
            r->sent_gen[i] = p.n_gen;
            continue;
        }
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
            struct tok_stream text_ts = r->text_ts[i];
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
                r->text_ts[i] = text_ts;
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
    if (r->phase == STREAM_CHOICES && all_fin)
        r->phase = r->include_usage ? STREAM_USAGE : STREAM_DONE;
    if (r->phase == STREAM_USAGE) {
        size_t mark = event_begin(&w);
        write_head(&w, r, object);
        jw_lit(&w, "],");
        write_usage(&w, j);
        jw_lit(&w, "}");
        if (!event_end(&w, mark))
            return w.n;
        r->phase = STREAM_DONE;
    }
    if (r->phase == STREAM_DONE) {
        size_t mark = event_begin(&w);
        jw_lit(&w, "[DONE]");
        if (event_end(&w, mark))
            r->phase = STREAM_ENDED;
    }
    return w.n;
}

/* stream_events for Ollama's NDJSON: one object a line, the text of one
 * choice, then the final object with the statistics; an error is
 * {"error": "..."}. */
static size_t ollama_events(struct req *r, const struct stream_view *v, char *buf, size_t max, bool *stuck)
{
    struct jw w;
    jw_fixed(&w, buf, max);
    *stuck = false;
    if (r->phase != STREAM_CHOICES)
        return 0;
    if (v->done && v->err.st != IPC_OK) {
        jw_lit(&w, "{\"error\":");
        jw_str(&w, v->err.msg, strlen(v->err.msg));
        jw_lit(&w, "}\n");
        *stuck = w.failed;
        if (!w.failed) {
            r->phase = STREAM_ENDED;
            engine_count_error(r->srv->eng, v->err.st);
        }
        return w.failed ? 0 : w.n;
    }
    for (;;) {
        size_t t0 = r->sent_text[0], mark = w.n;
        bool news = v->n_text[0] > t0;
        if (!news && !(v->done && !v->partial[0]))
            break;
        if (news) {
            size_t room = w.cap > w.n + EVENT_SLACK ? w.cap - w.n - EVENT_SLACK : 0;
            size_t t1 = t0 + jw_fit(v->text[0] + (t0 - v->base[0]), v->n_text[0] - t0, room);
            if (t1 == t0) {
                *stuck = w.n == 0;
                return w.n;
            }
            ollama_write_chunk(&w, r, v->text[0] + (t0 - v->base[0]), t1 - t0);
            jw_lit(&w, "\"done\":false}\n");
            if (!w.failed)
                r->sent_text[0] = t1;
        } else {
            ollama_write_final(&w, r, "", 0);
            jw_lit(&w, "\n");
            if (!w.failed)
                r->phase = STREAM_ENDED;
        }
        if (w.failed) { /* sent in a later read, with an empty buffer */
            w.failed = false;
            w.n = mark;
            *stuck = mark == 0;
            return w.n;
        }
        if (r->phase == STREAM_ENDED)
            break;
    }
    /* tokens are not sent, only their text: has_news waits for more */
    r->sent_gen[0] = v->n_gen[0];
    return w.n;
}

ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    struct req *r = cls;
    if (r->hup || r->overflow)
        return MHD_CONTENT_READER_END_WITH_ERROR;
    if (r->phase == STREAM_ENDED)
        return MHD_CONTENT_READER_END_OF_STREAM;
    struct stream_view v;
    engine_lock(r->srv->eng);
    stream_snapshot(r, &v, max);
    engine_unlock(r->srv->eng);
    bool stuck;
    bool ndjson = r->kind == REPLY_OLLAMA_GENERATE || r->kind == REPLY_OLLAMA_CHAT;
    size_t n = ndjson ? ollama_events(r, &v, buf, max, &stuck) : stream_events(r, &v, buf, max, &stuck);
    if (stuck) {
        log_msg(LOG_ERR, "uid %u pid %d: a stream event does not fit %zu bytes; stream ended", (unsigned)r->uid,
                (int)r->pid, max);
        return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    if (n)
        return (ssize_t)n;
    if (r->phase == STREAM_ENDED)
        return MHD_CONTENT_READER_END_OF_STREAM;
    suspend(r);
    return 0;
}

/* Whether a suspended request has something new for its client (under the lock). */
bool has_news(const struct req *r)
{
    const struct job *j = r->job;
    if (job_done_locked(j) || r->phase != STREAM_CHOICES)
        return true;
    if (!r->stream)
        return false;
    for (int i = 0; i < j->n; i++) {
        struct job_progress c = job_progress(j, i);
        /* text held back for tool calls is no news until the job is done */
        bool more = !r->tools && (c.n_text > r->sent_text[i] || c.n_gen > r->sent_gen[i]);
        if (more || (r->kind == REPLY_CHAT && !r->role_sent[i]))
            return true;
    }
    return false;
}

/* Generated text the client has not read yet, over the limit: the reader
 * is too slow (or stopped), so its generation ends rather than buffering.
 * Text held back for tool calls is no backlog of the reader's: it is sent
 * at the end, and the job holds it anyway. */
bool over_limit(const struct req *r, size_t max)
{
    if (!r->stream || r->tools)
        return false;
    size_t backlog = 0;
    for (int i = 0; i < r->job->n; i++)
        backlog += job_progress(r->job, i).n_text - r->sent_text[i];
    return backlog > max;
}

