/* render.c - what goes back to the client: HTTP replies (JSON, errors with
 * OpenAI's error object) and the OpenAI response bodies (completions and
 * chat, choices, logprobs, usage, the kvtier object) that whole replies and
 * stream events share.  Loop thread: the logprobs token texts go through
 * the server's one piece buffer.  A job's output is read through
 * job_progress()/job_result() once it is done or under the engine lock. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/http.h"
#include "util/clock.h"
#include "util/log.h"

enum MHD_Result queue(struct req *r, unsigned code, char *body, size_t len, const char *type)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (code == MHD_HTTP_UNAUTHORIZED)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (r->srv->draining || r->close || r->last)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result res = MHD_queue_response(r->conn, code, resp);
    MHD_destroy_response(resp);
    return res;
}

enum MHD_Result reply_jw(struct req *r, unsigned code, struct jw *w)
{
    if (w->failed) {
        free(w->p);
        return MHD_NO; /* out of memory even for the reply: drop the connection */
    }
    jw_raw(w, "\n", 1);
    return queue(r, code, w->p, w->n, "application/json");
}

enum MHD_Result reply_json(struct req *r, unsigned code, json_t *obj)
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

void write_error_body(struct jw *w, const struct ipc_error *e)
{
    const char *code = ipc_error_code(e->st);
    if (code)
        jw_fmt(w, "{\"code\":\"%s\",\"message\":", code);
    else
        jw_fmt(w, "{\"code\":%d,\"message\":", ipc_http_status(e->st));
    jw_str(w, e->msg, strlen(e->msg));
    jw_fmt(w, ",\"type\":\"%s\",\"param\":", ipc_error_type(e->st));
    if (e->param[0])
        jw_str(w, e->param, strlen(e->param));
    else
        jw_lit(w, "null");
    jw_lit(w, "}");
}

/* Whether a client's 4xx may be logged now: one line a second per client
 * (uid and pid), so a client that loops on a bad request cannot flood the
 * log.  *suppressed: how many were not logged since its last line.  Sixteen
 * clients are remembered; the one silent longest makes room. */
static bool log_gate(struct server *s, const struct req *r, unsigned *suppressed)
{
    long now = (long)(clock_ms() / 1000);
    struct log_gate *g = &s->gates[0];
    for (int i = 0; i < LOG_GATES; i++) {
        struct log_gate *c = &s->gates[i];
        if (c->uid == r->uid && c->pid == r->pid && c->sec) {
            g = c;
            break;
        }
        if (c->sec < g->sec)
            g = c;
    }
    if (g->uid == r->uid && g->pid == r->pid && g->sec == now) {
        g->suppressed++;
        return false;
    }
    *suppressed = g->uid == r->uid && g->pid == r->pid ? g->suppressed : 0;
    *g = (struct log_gate){.uid = r->uid, .pid = r->pid, .sec = now};
    return true;
}

enum MHD_Result reply_error(struct req *r, const struct ipc_error *e)
{
    int code = ipc_http_status(e->st);
    engine_count_error(r->srv->eng, e->st);
    unsigned quiet = 0;
    if (code >= 500 || log_gate(r->srv, r, &quiet)) {
        char more[64] = "";
        if (quiet)
            snprintf(more, sizeof(more), " (and %u client errors not logged)", quiet);
        log_msg(code >= 500 || code == 413 || code == 429 ? LOG_WARN : LOG_INFO, "uid %u pid %d %s: %d %s%s",
                (unsigned)r->uid, (int)r->pid, r->url, code, e->msg, more);
    }
    struct jw w;
    jw_dynamic(&w);
    jw_lit(&w, "{\"error\":");
    if (!strncmp(r->url, "/api/", 5)) /* Ollama's envelope: the message alone */
        jw_str(&w, e->msg, strlen(e->msg));
    else
        write_error_body(&w, e);
    jw_lit(&w, "}");
    return reply_jw(r, (unsigned)code, &w);
}

enum MHD_Result fail(struct req *r, enum ipc_status st, const char *param, const char *msg)
{
    struct ipc_error e;
    ipc_fail(&e, st, param, "%s", msg);
    return reply_error(r, &e);
}

/* ---- bodies shared by whole replies and stream events ---- */

size_t token_piece(const engine *e, int32_t id, char *buf, size_t cap, bool *whole)
{
    struct tok_stream ts = {.started = true};
    size_t n = tokenizer_decode_stream(engine_tokenizer(e), &ts, id, false, buf, cap), raw_len;
    if (whole)
        *whole = false;
    if (n > cap) /* nothing written: engine_max_piece was not the buffer's size */
        return 0;
    bool special;
    const char *raw = tokenizer_token_bytes(engine_tokenizer(e), id, &raw_len, &special);
    if (whole) /* what the stream wrote is the token's own bytes: no U+FFFD for a bad byte, none pending */
        *whole = !ts.n_pending && (special || (raw && raw_len == n && !memcmp(raw, buf, n)));
    return n + tokenizer_decode_flush(&ts, buf + n, cap - n);
}

/* token_piece into the loop thread's s->piece (valid until the next call). */
static size_t piece(struct server *s, int32_t id)
{
    return token_piece(s->eng, id, s->piece, s->piece_cap, NULL);
}

const char *finish_name(enum gen_finish f)
{
    return f == GEN_FINISH_LENGTH ? "length" : f == GEN_FINISH_NONE ? NULL : "stop";
}

/* The token's own bytes, for logprobs' "bytes": a token that holds part of
 * a character has them, where its text (piece) has U+FFFD or nothing. */
static void write_token_bytes(struct jw *w, const struct server *s, int32_t id, const char *piece, size_t n)
{
    size_t len;
    bool special;
    const char *raw = tokenizer_token_bytes(engine_tokenizer(s->eng), id, &len, &special);
    if (raw && !special)
        jw_bytes(w, raw, len);
    else
        jw_bytes(w, piece, n);
}

/* The characters token id adds to its choice's text: decoded through the
 * choice's stream as the generation decodes it (special tokens dropped, a
 * character split over tokens counted at the token that completes it). */
static size_t text_chars(struct server *s, struct tok_stream *ts, int32_t id)
{
    size_t n = tokenizer_decode_stream(engine_tokenizer(s->eng), ts, id, true, s->piece, s->piece_cap), chars = 0;
    for (size_t b = 0; b < n && n <= s->piece_cap; b++)
        chars += ((unsigned char)s->piece[b] & 0xc0) != 0x80;
    return chars;
}

/* logprobs of generated tokens [from, to) of choice i, in the endpoint's
 * shape; a completion's text_offset counts characters (code points) of the
 * choice's text, as vLLM's, in which each token starts */
static void write_logprobs(struct jw *w, struct req *r, int i, int from, int to)
{
    const struct job *j = r->job;
    const struct tok_logprob *lps = job_progress(j, i).lps;
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
            const struct tok_logprob *lp = lps + (size_t)t * (size_t)(1 + k);
            for (int a = 0; a <= k; a++) {
                size_t n = piece(s, lp[a].id);
                jw_lit(w, a == 0 ? (t > from ? ",{\"token\":" : "{\"token\":") : a == 1 ? "\"top_logprobs\":[{\"token\":"
                                                                                       : ",{\"token\":");
                jw_str(w, buf, n);
                jw_lit(w, ",\"logprob\":");
                jw_real(w, lp[a].logprob, 6);
                jw_lit(w, ",\"bytes\":");
                write_token_bytes(w, s, lp[a].id, buf, n);
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
            const struct tok_logprob *lp = lps + (size_t)t * (size_t)(1 + k);
            if (t > from)
                jw_lit(w, ",");
            if (part == 0) {
                size_t n = piece(s, lp[0].id);
                jw_str(w, buf, n);
            } else if (part == 1)
                jw_real(w, lp[0].logprob, 6);
            else if (part == 3) {
                jw_fmt(w, "%zu", off);
                off += text_chars(s, &r->text_ts[i], lp[0].id);
            } else {
                jw_lit(w, "{");
                for (int a = 1; a <= k; a++) {
                    size_t m = piece(s, lp[a].id);
                    if (a > 1)
                        jw_lit(w, ",");
                    jw_str(w, buf, m);
                    jw_lit(w, ":");
                    jw_real(w, lp[a].logprob, 6);
                }
                jw_lit(w, "}");
            }
        }
        if (part == 3)
            r->text_offset[i] = off;
    }
    jw_lit(w, "]}");
}

static int completion_tokens(const struct job *j)
{
    int n = 0;
    for (int i = 0; i < j->n_out; i++)
        n += job_progress(j, i).n_gen;
    return n;
}

void write_usage(struct jw *w, const struct job *j)
{
    int c = completion_tokens(j);
    /* an encoder-decoder model's prompt is its encoder input and its decoder's prompt */
    const struct job_result *res = job_result(j);
    size_t np = res->n_encoder + j->n_prompt;
    jw_fmt(w, "\"usage\":{\"prompt_tokens\":%zu,\"completion_tokens\":%d,\"total_tokens\":%zu,", np, c,
           np + (size_t)c);
    jw_fmt(w, "\"prompt_tokens_details\":{\"cached_tokens\":%d", res->n_cached);
    if (res->n_encoder)
        jw_fmt(w, ",\"encoder_tokens\":%zu,\"encoder_cached_tokens\":%zu", res->n_encoder, res->n_encoder_cached);
    jw_fmt(w, "}}");
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
    const struct job_result *res = job_result(j);
    const struct kv_seq_stats *k = &res->kv;
    jw_fmt(w, "{\"strategy\":\"%s\",\"requested_strategy\":\"%s\",", ipc_cache_strategy_name(&j->cache, k->strategy),
           j->cache.name);
    jw_fmt(w, "\"bytes\":{\"device\":%zu,\"host\":%zu,\"disk\":0},\"resident_layers\":%d,\"streamed_layers\":%d,",
           k->dev_bytes, k->host_bytes, k->resident_layers, k->streamed_layers);
    jw_fmt(w, "\"prefill_ms\":%.3f,\"decode_ms\":%.3f,\"fallback\":", res->prefill_ms, res->decode_ms);
    const char *fb = engine_fallback_name(k->fallback);
    if (fb)
        jw_fmt(w, "\"%s\"", fb);
    else
        jw_lit(w, "null");
    jw_lit(w, ",\"prefetch\":");
    write_prefetch(w, &k->xfer);
    jw_fmt(w, ",\"kv_bytes_copied\":%llu", (unsigned long long)k->copied_bytes);
    if (j->beam.num_beams > 1) {
        /* the beams' reorders as fork/free, against gathering the whole cache by beam each step */
        int s = res->beam_steps;
        jw_fmt(w, ",\"beam_search\":{\"steps\":%d,\"kv_bytes_copied\":%llu,\"kv_bytes_copied_per_step\":%.1f,", s,
               (unsigned long long)k->copied_bytes, s ? (double)k->copied_bytes / s : 0.0);
        jw_fmt(w, "\"whole_cache_reorder_bytes\":%llu,\"whole_cache_reorder_bytes_per_step\":%.1f}",
               (unsigned long long)res->whole_reorder_bytes, s ? (double)res->whole_reorder_bytes / s : 0.0);
    }
    jw_lit(w, "}");
}

void write_kvtier(struct jw *w, const struct job *j)
{
    jw_lit(w, "\"kvtier\":");
    write_kvtier_obj(w, j);
}

void write_head(struct jw *w, struct req *r, const char *object)
{
    jw_lit(w, "{\"id\":");
    jw_str(w, r->id, strlen(r->id));
    jw_fmt(w, ",\"object\":\"%s\",\"created\":%lld,\"model\":", object, (long long)r->created);
    const char *m = engine_model_id(r->srv->eng);
    jw_str(w, m, strlen(m));
    jw_lit(w, ",\"choices\":[");
}

const struct ipc_tool_calls *read_calls(struct req *r, int i)
{
    if (!r->tools)
        return NULL;
    if (!r->calls_read[i]) {
        struct job_progress p = job_progress(r->job, i);
        /* out of memory reads as no calls: the text goes back as content */
        ipc_tool_calls_parse(p.text ? p.text : "", p.n_text, r->tool_fmt, r->tools, &r->calls[i]);
        r->calls_read[i] = true;
    }
    return r->calls[i].n ? &r->calls[i] : NULL;
}

static void write_calls(struct jw *w, struct req *r, int i, const struct ipc_tool_calls *tc, bool delta)
{
    jw_lit(w, "\"tool_calls\":[");
    for (size_t k = 0; k < tc->n; k++) {
        jw_lit(w, k ? ",{" : "{");
        if (delta)
            jw_fmt(w, "\"index\":%zu,", k);
        jw_fmt(w, "\"id\":\"call_%s_%d_%zu\",\"type\":\"function\",\"function\":{\"name\":", r->id, i, k);
        jw_str(w, tc->calls[k].name, strlen(tc->calls[k].name));
        jw_lit(w, ",\"arguments\":");
        jw_str(w, tc->calls[k].arguments, strlen(tc->calls[k].arguments));
        jw_lit(w, "}}");
    }
    jw_lit(w, "]");
}

void write_choice(struct jw *w, struct req *r, int i, const char *text, size_t n, int g0, int g1,
                         const char *finish, bool delta, bool role)
{
    const int32_t *gen = job_progress(r->job, i).toks + r->job->n_prompt;
    const struct ipc_tool_calls *tc = r->calls_read[i] && r->calls[i].n ? &r->calls[i] : NULL;
    jw_fmt(w, "{\"index\":%d,", i);
    if (tc) {
        jw_lit(w, delta ? "\"delta\":{" : "\"message\":{\"role\":\"assistant\",");
        if (delta && role)
            jw_lit(w, "\"role\":\"assistant\",");
        jw_lit(w, "\"content\":");
        if (tc->content_len)
            jw_str(w, text, tc->content_len < n ? tc->content_len : n);
        else
            jw_lit(w, "null");
        jw_lit(w, ",");
        write_calls(w, r, i, tc, delta);
        jw_lit(w, "},");
        if (finish)
            finish = "tool_calls";
    } else if (r->kind == REPLY_CHAT) {
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
            jw_fmt(w, t > g0 ? ",%d" : "%d", gen[t]);
        jw_lit(w, "]");
    }
    if (r->job->beam.num_beams > 1) {
        jw_lit(w, ",\"sequence_score\":");
        jw_real(w, job_progress(r->job, i).score, 9);
    }
    jw_lit(w, ",\"finish_reason\":");
    if (finish)
        jw_fmt(w, "\"%s\"}", finish);
    else
        jw_lit(w, "null}");
}

enum MHD_Result reply_done(struct req *r)
{
    struct job *j = r->job;
    const struct job_result *res = job_result(j);
    if (res->err.st != IPC_OK)
        return reply_error(r, &res->err);
    if (r->kind == REPLY_SESSION_OP || r->kind == REPLY_SESSION_IMPORT) { /* the session now (a fork: the new one) */
        json_t *o;
        struct ipc_error err;
        if (engine_session_json(r->srv->eng, r->uid, res->reply_id[0] ? res->reply_id : j->session_id, &o, &err) != IPC_OK)
            return reply_error(r, &err);
        return reply_json(r, r->kind == REPLY_SESSION_IMPORT ? 201 : 200, o);
    }
    if (r->kind == REPLY_OLLAMA_GENERATE || r->kind == REPLY_OLLAMA_CHAT)
        return ollama_reply_done(r);
    if (r->kind == REPLY_KV) { /* the reply takes the file: the job is done with it */
        size_t n;
        char *blob = job_take_blob(j, &n);
        return queue(r, 200, blob, n, "application/octet-stream");
    }
    if (r->kind == REPLY_SESSION) {
        json_t *o;
        struct ipc_error err;
        if (engine_session_json(r->srv->eng, r->uid, j->session_id, &o, &err) != IPC_OK)
            return reply_error(r, &err);
        json_object_set_new(o, "usage", json_pack("{s:I,s:i}", "prompt_tokens", (json_int_t)j->n_prompt,
                                                  "cached_tokens", res->n_cached));
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
    for (int i = 0; i < j->n_out; i++) {
        struct job_progress p = job_progress(j, i);
        read_calls(r, i);
        if (i)
            jw_lit(&w, ",");
        write_choice(&w, r, i, p.text, p.n_text, 0, p.n_gen, finish_name(p.finish), false, false);
    }
    jw_lit(&w, "],");
    write_usage(&w, j);
    jw_lit(&w, ",");
    write_kvtier(&w, j);
    jw_lit(&w, "}");
    return reply_jw(r, 200, &w);
}

