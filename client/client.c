/* client.c - libkvtier-client over libcurl: HTTP/1.1 on kvtierd's Unix
 * socket (CURLOPT_UNIX_SOCKET_PATH), bodies in jansson, and the daemon's
 * Server-Sent Events split into "data:" payloads here.  libcurl does the
 * HTTP framing (chunked bodies, Content-Length, 100-continue); what this
 * file bounds is what it keeps: a reply or one event over KVTIER_MAX_REPLY
 * is a protocol error, so a confused peer cannot make the client allocate
 * without limit. */
#include "client/kvtier/client.h"

#include <curl/curl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ipc/sockpath.h"

struct kvtier_client {
    CURL *curl; /* kept across calls: libcurl reuses its connection */
    char sock[128];
    char err[512];
    int http;
    volatile sig_atomic_t cancel;
};

const char *kvtier_strerror(enum kvtier_status st)
{
    switch (st) {
    case KVTIER_OK: return "success";
    case KVTIER_EINVAL: return "invalid argument";
    case KVTIER_ENOMEM: return "out of memory";
    case KVTIER_EUNREACHABLE: return "kvtierd cannot be reached";
    case KVTIER_EIO: return "the connection to kvtierd broke";
    case KVTIER_EPROTO: return "malformed reply from kvtierd";
    case KVTIER_EHTTP: return "kvtierd answered with an error";
    case KVTIER_ELOADING: return "kvtierd is loading its model";
    case KVTIER_ECANCELLED: return "cancelled";
    }
    return "unknown status";
}

__attribute__((format(printf, 3, 4))) static enum kvtier_status fail(kvtier_client *c, enum kvtier_status st,
                                                                     const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, sizeof(c->err), fmt, ap);
    va_end(ap);
    return st;
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;
static void curl_init(void)
{
    curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT);
}

enum kvtier_status kvtier_open(const char *socket_path, kvtier_client **out)
{
    if (!out)
        return KVTIER_EINVAL;
    *out = NULL;
    pthread_once(&curl_once, curl_init);
    if (curl_init_rc != CURLE_OK)
        return KVTIER_ENOMEM;
    kvtier_client *c = calloc(1, sizeof(*c));
    if (!c)
        return KVTIER_ENOMEM;
    struct ipc_error e;
    if (ipc_socket_path(socket_path, false, c->sock, sizeof(c->sock), &e) != IPC_OK) {
        free(c);
        return KVTIER_EINVAL;
    }
    if (!(c->curl = curl_easy_init())) {
        free(c);
        return KVTIER_ENOMEM;
    }
    *out = c;
    return KVTIER_OK;
}

void kvtier_close(kvtier_client *c)
{
    if (!c)
        return;
    curl_easy_cleanup(c->curl);
    free(c);
}

const char *kvtier_socket(const kvtier_client *c)
{
    return c ? c->sock : "";
}

const char *kvtier_errmsg(const kvtier_client *c)
{
    return c ? c->err : "";
}

int kvtier_http_status(const kvtier_client *c)
{
    return c ? c->http : 0;
}

void kvtier_cancel(kvtier_client *c)
{
    if (c)
        c->cancel = 1;
}

void kvtier_reply_free(struct kvtier_reply *r)
{
    if (!r)
        return;
    free(r->body);
    *r = (struct kvtier_reply){0};
}

void kvtier_result_free(struct kvtier_result *r)
{
    if (!r)
        return;
    free(r->text);
    *r = (struct kvtier_result){0};
}

/* ---- one transfer --------------------------------------------------------- */

struct xfer {
    kvtier_client *c;
    char *body; /* a whole reply, or an error reply to a stream */
    size_t len;
    bool sse; /* a 2xx event stream: payloads go to on_event */
    bool (*on_event)(struct xfer *x, const char *data, size_t len);
    char *pend; /* the event stream's unfinished line and event */
    size_t n_pend;
    char *data; /* the current event's data lines */
    size_t n_data;
    bool stopped, too_big, bad;
    bool ended; /* an error event ended the stream: the daemon's message is the outcome */
    /* what a generation's events fill in */
    kvtier_token_fn fn;
    void *ud;
    bool chat;
    struct kvtier_result *res;
    char daemon_err[256];
};

/* Appends src[0, len) to the NUL-terminated buffer *p of *n bytes,
 * refusing to pass KVTIER_MAX_REPLY. */
static bool grow(char **p, size_t *n, const char *src, size_t len)
{
    if (*n > KVTIER_MAX_REPLY || len > KVTIER_MAX_REPLY - *n)
        return false;
    char *q = realloc(*p, *n + len + 1);
    if (!q)
        return false;
    memcpy(q + *n, src, len);
    *n += len;
    q[*n] = '\0';
    *p = q;
    return true;
}

/* One line of the event stream (without its newline). */
static bool sse_line(struct xfer *x, const char *line, size_t len)
{
    if (len && line[len - 1] == '\r')
        len--;
    if (!len) { /* a blank line ends the event */
        if (!x->data)
            return true;
        bool go = x->on_event(x, x->data, x->n_data);
        free(x->data);
        x->data = NULL;
        x->n_data = 0;
        return go;
    }
    if (len < 5 || memcmp(line, "data:", 5) != 0)
        return true; /* comments (": keep-alive"), event:, id:, retry: */
    line += 5, len -= 5;
    if (len && *line == ' ')
        line++, len--;
    if (x->data && !grow(&x->data, &x->n_data, "\n", 1))
        return x->too_big = true, false;
    if (!grow(&x->data, &x->n_data, line, len))
        return x->too_big = true, false;
    return true;
}

static size_t on_write(char *ptr, size_t size, size_t nmemb, void *ud)
{
    struct xfer *x = ud;
    size_t n = size * nmemb;
    long code = 0;
    char *type = NULL;
    curl_easy_getinfo(x->c->curl, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_getinfo(x->c->curl, CURLINFO_CONTENT_TYPE, &type);
    bool sse = x->on_event && code / 100 == 2 && type && !strncmp(type, "text/event-stream", 17);
    if (!sse) {
        if (!grow(&x->body, &x->len, ptr, n))
            return x->too_big = true, 0;
        return n;
    }
    x->sse = true;
    if (!grow(&x->pend, &x->n_pend, ptr, n))
        return x->too_big = true, 0;
    size_t start = 0;
    for (char *nl; (nl = memchr(x->pend + start, '\n', x->n_pend - start));) {
        size_t end = (size_t)(nl - x->pend);
        if (!sse_line(x, x->pend + start, end - start))
            return 0;
        start = end + 1;
    }
    memmove(x->pend, x->pend + start, x->n_pend - start);
    x->n_pend -= start;
    return n;
}

static int on_progress(void *ud, curl_off_t dt, curl_off_t dn, curl_off_t ut, curl_off_t un)
{
    (void)dt, (void)dn, (void)ut, (void)un;
    return ((struct xfer *)ud)->c->cancel != 0;
}

/* Sends one request; the reply lands in x (body or events).  Returns the
 * transport's outcome; c->http holds the status. */
static enum kvtier_status perform(kvtier_client *c, const char *method, const char *path, const char *body,
                                  size_t len, struct xfer *x)
{
    if (!c || !method || !path || path[0] != '/' || (len && !body))
        return c ? fail(c, KVTIER_EINVAL, "invalid arguments") : KVTIER_EINVAL;
    char url[1024], errbuf[CURL_ERROR_SIZE] = "";
    if ((size_t)snprintf(url, sizeof(url), "http://localhost%s", path) >= sizeof(url))
        return fail(c, KVTIER_EINVAL, "the path is too long");
    c->err[0] = '\0';
    c->http = 0;
    c->cancel = 0;
    CURL *h = c->curl;
    curl_easy_reset(h);
    struct curl_slist *hdr = NULL, *h2 = curl_slist_append(NULL, "Content-Type: application/json");
    /* no 100-continue round trip: kvtierd reads whatever body it is sent */
    if (h2 && !(hdr = curl_slist_append(h2, "Expect:")))
        curl_slist_free_all(h2);
    if (!hdr)
        return fail(c, KVTIER_ENOMEM, "out of memory");
    curl_easy_setopt(h, CURLOPT_UNIX_SOCKET_PATH, c->sock);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, x);
    curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(h, CURLOPT_XFERINFODATA, x);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    if (body || strcmp(method, "GET") != 0) {
        curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body ? body : "");
    }
    if (strcmp(method, "POST") != 0)
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, method);
    CURLcode rc = curl_easy_perform(h);
    curl_slist_free_all(hdr);
    long code = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
    c->http = (int)code;
    if ((rc == CURLE_OK || x->ended) && !x->bad && !x->too_big)
        return KVTIER_OK;
    if (x->too_big)
        return fail(c, KVTIER_EPROTO, "a reply from kvtierd is over %u bytes", KVTIER_MAX_REPLY);
    if (x->bad)
        return fail(c, KVTIER_EPROTO, "a stream event from kvtierd is not JSON");
    if (x->stopped || rc == CURLE_ABORTED_BY_CALLBACK)
        return fail(c, KVTIER_ECANCELLED, "cancelled");
    switch (rc) {
    case CURLE_COULDNT_CONNECT:
        /* libcurl's own text names a TCP port, which says nothing here */
        return fail(c, KVTIER_EUNREACHABLE, "cannot connect to %s (is kvtierd running?)", c->sock);
    case CURLE_OUT_OF_MEMORY:
        return fail(c, KVTIER_ENOMEM, "out of memory");
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_UNSUPPORTED_PROTOCOL:
    case CURLE_BAD_CONTENT_ENCODING:
    case CURLE_HTTP2:
        return fail(c, KVTIER_EPROTO, "malformed reply from %s: %s", c->sock, errbuf);
    default:
        return fail(c, KVTIER_EIO, "%s: %s", c->sock, errbuf[0] ? errbuf : curl_easy_strerror(rc));
    }
}

static void xfer_free(struct xfer *x)
{
    free(x->body);
    free(x->pend);
    free(x->data);
}

enum kvtier_status kvtier_request(kvtier_client *c, const char *method, const char *path, const char *body,
                                  size_t len, struct kvtier_reply *reply)
{
    if (!reply)
        return KVTIER_EINVAL;
    *reply = (struct kvtier_reply){0};
    struct xfer x = {.c = c};
    enum kvtier_status st = perform(c, method, path, body, len, &x);
    if (st != KVTIER_OK) {
        xfer_free(&x);
        return st;
    }
    if (!x.body && !(x.body = calloc(1, 1))) {
        xfer_free(&x);
        return fail(c, KVTIER_ENOMEM, "out of memory");
    }
    *reply = (struct kvtier_reply){.status = c->http, .body = x.body, .len = x.len};
    x.body = NULL;
    xfer_free(&x);
    return KVTIER_OK;
}

/* The outcome of a non-2xx reply: its message into c->err, and the kind. */
static enum kvtier_status http_fail(kvtier_client *c, const char *body, size_t len)
{
    json_t *o = body ? json_loadb(body, len, 0, NULL) : NULL;
    const char *msg = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
    const char *status = json_string_value(json_object_get(o, "status"));
    bool loading = c->http == 503 && ((status && !strcmp(status, "loading")) || (msg && strstr(msg, "loading")));
    enum kvtier_status st = fail(c, loading ? KVTIER_ELOADING : KVTIER_EHTTP, "HTTP %d: %.400s", c->http,
                                 msg ? msg : body && len ? body : "(no message)");
    json_decref(o);
    return st;
}

/* A JSON call: *out gets the 2xx reply's JSON (NULL out: not parsed). */
static enum kvtier_status call_json(kvtier_client *c, const char *method, const char *path, json_t *body, json_t **out)
{
    char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
    if (body && !text)
        return fail(c, KVTIER_ENOMEM, "out of memory");
    struct kvtier_reply r;
    enum kvtier_status st = kvtier_request(c, method, path, text, text ? strlen(text) : 0, &r);
    free(text);
    if (st != KVTIER_OK)
        return st;
    if (r.status / 100 != 2)
        st = http_fail(c, r.body, r.len);
    else if (out && !(*out = json_loadb(r.body, r.len, 0, NULL)))
        st = fail(c, KVTIER_EPROTO, "the reply to %s %s is not JSON", method, path);
    kvtier_reply_free(&r);
    return st;
}

/* ---- generation ----------------------------------------------------------- */

static enum kvtier_status gen_body(kvtier_client *c, const struct kvtier_params *p, bool stream, json_t **out)
{
    *out = NULL;
    json_t *b = json_object();
    bool ok = b != NULL;
    if (ok && p) {
        if (p->max_tokens > 0)
            ok = !json_object_set_new(b, "max_tokens", json_integer(p->max_tokens));
        if (ok && p->temperature >= 0)
            ok = !json_object_set_new(b, "temperature", json_real(p->temperature));
        if (ok && p->has_seed)
            ok = !json_object_set_new(b, "seed", json_integer(p->seed));
        if (ok && p->n_stop) {
            json_t *s = json_array();
            for (size_t i = 0; ok && i < p->n_stop; i++)
                ok = s && p->stop && p->stop[i] && !json_array_append_new(s, json_string(p->stop[i]));
            ok = ok && !json_object_set_new(b, "stop", s);
        }
        if (ok && p->session)
            ok = !json_object_set_new(b, "session", json_string(p->session));
        if (ok && p->extra_json) {
            json_t *extra = json_loads(p->extra_json, 0, NULL);
            ok = json_is_object(extra) && !json_object_update(b, extra);
            json_decref(extra);
            if (!ok) {
                json_decref(b);
                return fail(c, KVTIER_EINVAL, "extra_json is not a JSON object");
            }
        }
    }
    if (ok && stream)
        ok = !json_object_set_new(b, "stream", json_true()) &&
             !json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
    if (!ok) {
        json_decref(b);
        return fail(c, KVTIER_ENOMEM, "out of memory");
    }
    *out = b;
    return KVTIER_OK;
}

static void take_usage(struct kvtier_result *res, const json_t *u)
{
    if (!json_is_object(u))
        return;
    res->prompt_tokens = json_integer_value(json_object_get(u, "prompt_tokens"));
    res->completion_tokens = json_integer_value(json_object_get(u, "completion_tokens"));
    res->cached_tokens = json_integer_value(json_object_get(json_object_get(u, "prompt_tokens_details"),
                                                            "cached_tokens"));
}

static void take_finish(struct kvtier_result *res, const json_t *choice)
{
    const char *f = json_string_value(json_object_get(choice, "finish_reason"));
    if (f)
        snprintf(res->finish_reason, sizeof(res->finish_reason), "%s", f);
}

static bool on_gen_event(struct xfer *x, const char *data, size_t len)
{
    if (len == 6 && !memcmp(data, "[DONE]", 6))
        return true;
    /* generated text may hold any byte, NUL too (a model's own token) */
    json_t *ev = json_loadb(data, len, JSON_ALLOW_NUL, NULL);
    if (!json_is_object(ev)) {
        json_decref(ev);
        x->bad = true;
        return false;
    }
    const json_t *e = json_object_get(ev, "error");
    if (e) {
        const char *m = json_string_value(json_object_get(e, "message"));
        snprintf(x->daemon_err, sizeof(x->daemon_err), "%s", m ? m : "an error event");
        x->ended = true;
    }
    const json_t *ch = json_array_get(json_object_get(ev, "choices"), 0);
    const json_t *t = x->chat ? json_object_get(json_object_get(ch, "delta"), "content") : json_object_get(ch, "text");
    bool go = !e;
    if (json_is_string(t) && json_string_length(t)) {
        size_t n = json_string_length(t);
        if (!grow(&x->res->text, &x->res->len, json_string_value(t), n))
            x->too_big = true, go = false;
        else if (x->fn && !x->fn(x->ud, json_string_value(t), n))
            x->stopped = true, go = false;
    }
    take_finish(x->res, ch);
    take_usage(x->res, json_object_get(ev, "usage"));
    json_decref(ev);
    return go;
}

static enum kvtier_status generate(kvtier_client *c, const char *path, json_t *body, bool chat, kvtier_token_fn fn,
                                   void *ud, struct kvtier_result *res)
{
    char *text = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    if (!text)
        return fail(c, KVTIER_ENOMEM, "out of memory");
    struct xfer x = {.c = c, .on_event = fn ? on_gen_event : NULL, .fn = fn, .ud = ud, .chat = chat, .res = res};
    enum kvtier_status st = perform(c, "POST", path, text, strlen(text), &x);
    free(text);
    if (st == KVTIER_OK && c->http / 100 != 2)
        st = http_fail(c, x.body, x.len);
    else if (st == KVTIER_OK && x.daemon_err[0])
        st = fail(c, KVTIER_EHTTP, "%s", x.daemon_err);
    else if (st == KVTIER_OK && !x.sse) {
        /* a whole reply (fn NULL, or a daemon that chose not to stream) */
        json_t *o = json_loadb(x.body ? x.body : "", x.len, JSON_ALLOW_NUL, NULL);
        const json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
        const json_t *t = chat ? json_object_get(json_object_get(ch, "message"), "content")
                               : json_object_get(ch, "text");
        if (!json_is_string(t))
            st = fail(c, KVTIER_EPROTO, "the reply to POST %s has no text", path);
        else if (!grow(&res->text, &res->len, json_string_value(t), json_string_length(t)))
            st = fail(c, KVTIER_ENOMEM, "out of memory");
        else if (fn && res->len && !fn(ud, res->text, res->len))
            st = fail(c, KVTIER_ECANCELLED, "cancelled");
        take_finish(res, ch);
        take_usage(res, json_object_get(o, "usage"));
        json_decref(o);
    }
    xfer_free(&x);
    if (st == KVTIER_OK && !res->text && !(res->text = calloc(1, 1)))
        st = fail(c, KVTIER_ENOMEM, "out of memory");
    if (st != KVTIER_OK)
        kvtier_result_free(res);
    return st;
}

static enum kvtier_status complete(kvtier_client *c, const char *prompt, const struct kvtier_params *p,
                                   kvtier_token_fn fn, void *ud, struct kvtier_result *res)
{
    if (!res)
        return KVTIER_EINVAL;
    *res = (struct kvtier_result){0};
    if (!c || !prompt)
        return c ? fail(c, KVTIER_EINVAL, "no prompt") : KVTIER_EINVAL;
    json_t *b;
    enum kvtier_status st = gen_body(c, p, fn != NULL, &b);
    if (st != KVTIER_OK)
        return st;
    if (json_object_set_new(b, "prompt", json_string(prompt))) {
        json_decref(b);
        return fail(c, KVTIER_EINVAL, "the prompt is not UTF-8");
    }
    return generate(c, "/v1/completions", b, false, fn, ud, res);
}

enum kvtier_status kvtier_complete(kvtier_client *c, const char *prompt, const struct kvtier_params *p,
                                   struct kvtier_result *res)
{
    return complete(c, prompt, p, NULL, NULL, res);
}

enum kvtier_status kvtier_stream(kvtier_client *c, const char *prompt, const struct kvtier_params *p,
                                 kvtier_token_fn fn, void *ud, struct kvtier_result *res)
{
    if (!fn)
        return c ? fail(c, KVTIER_EINVAL, "no callback") : KVTIER_EINVAL;
    return complete(c, prompt, p, fn, ud, res);
}

enum kvtier_status kvtier_chat(kvtier_client *c, const struct kvtier_message *msgs, size_t n,
                               const struct kvtier_params *p, kvtier_token_fn fn, void *ud,
                               struct kvtier_result *res)
{
    if (!res)
        return KVTIER_EINVAL;
    *res = (struct kvtier_result){0};
    if (!c || (n && !msgs))
        return c ? fail(c, KVTIER_EINVAL, "no messages") : KVTIER_EINVAL;
    json_t *b;
    enum kvtier_status st = gen_body(c, p, fn != NULL, &b);
    if (st != KVTIER_OK)
        return st;
    json_t *arr = json_array();
    bool ok = arr && !json_object_set_new(b, "messages", arr);
    for (size_t i = 0; ok && i < n; i++) {
        json_t *m = msgs[i].role && msgs[i].content ? json_pack("{s:s,s:s}", "role", msgs[i].role, "content",
                                                                msgs[i].content)
                                                    : NULL;
        ok = m && !json_array_append_new(arr, m);
    }
    if (!ok) {
        json_decref(b);
        return fail(c, KVTIER_EINVAL, "a message has no role or content, or is not UTF-8");
    }
    return generate(c, "/v1/chat/completions", b, true, fn, ud, res);
}

/* ---- sessions ------------------------------------------------------------- */

/* A session id goes into a path: the daemon's own alphabet only. */
static bool id_ok(const char *id)
{
    size_t n = id ? strlen(id) : 0;
    return n && n <= KVTIER_SESSION_ID_MAX && strspn(id, "abcdefghijklmnopqrstuvwxyz0123456789-_") == n;
}

enum kvtier_status kvtier_session_create(kvtier_client *c, const char *system, char *id)
{
    if (!c || !id)
        return c ? fail(c, KVTIER_EINVAL, "no id buffer") : KVTIER_EINVAL;
    id[0] = '\0';
    json_t *b = system ? json_pack("{s:s}", "system", system) : json_object(), *r = NULL;
    if (!b)
        return fail(c, KVTIER_EINVAL, "the system prompt is not UTF-8");
    enum kvtier_status st = call_json(c, "POST", "/v1/sessions", b, &r);
    json_decref(b);
    const char *got = json_string_value(json_object_get(r, "id"));
    if (st == KVTIER_OK && !id_ok(got))
        st = fail(c, KVTIER_EPROTO, "the daemon's reply names no valid session id");
    if (st == KVTIER_OK)
        snprintf(id, KVTIER_SESSION_ID_MAX + 1, "%s", got);
    json_decref(r);
    return st;
}

enum kvtier_status kvtier_session_delete(kvtier_client *c, const char *id)
{
    if (!c || !id_ok(id))
        return c ? fail(c, KVTIER_EINVAL, "invalid session id") : KVTIER_EINVAL;
    char path[96];
    snprintf(path, sizeof(path), "/v1/sessions/%s", id);
    return call_json(c, "DELETE", path, NULL, NULL);
}

/* ---- health --------------------------------------------------------------- */

/* A byte count member of o, or -1. */
static long long byte_count(const json_t *o, const char *name)
{
    const json_t *v = json_object_get(o, name);
    return json_is_integer(v) && json_integer_value(v) >= 0 ? (long long)json_integer_value(v) : -1;
}

enum kvtier_status kvtier_health(kvtier_client *c, struct kvtier_health *h)
{
    if (!c || !h)
        return c ? fail(c, KVTIER_EINVAL, "no health struct") : KVTIER_EINVAL;
    *h = (struct kvtier_health){.loaded_bytes = -1, .total_bytes = -1};
    struct kvtier_reply r;
    enum kvtier_status st = kvtier_request(c, "GET", "/health", NULL, 0, &r);
    if (st != KVTIER_OK)
        return st;
    json_t *o = json_loadb(r.body, r.len, 0, NULL);
    const char *s = json_string_value(json_object_get(o, "status"));
    if (!s) {
        st = fail(c, KVTIER_EPROTO, "the reply to GET /health names no status (HTTP %d)", r.status);
    } else {
        h->ready = r.status == 200;
        snprintf(h->status, sizeof(h->status), "%s", s);
        /* while the model loads: {"loading": {"bytes_done": N, "bytes_total": M, ...}} */
        const json_t *l = json_object_get(o, "loading");
        h->loaded_bytes = byte_count(l, "bytes_done");
        h->total_bytes = byte_count(l, "bytes_total");
        if (h->total_bytes <= 0 || h->loaded_bytes < 0 || h->loaded_bytes > h->total_bytes)
            h->loaded_bytes = h->total_bytes = -1;
    }
    json_decref(o);
    kvtier_reply_free(&r);
    return st;
}
