/* server.c - kvtierd's front end: it wires the event loop (loop.h) to
 * the listening socket (accept, SO_PEERCRED, the client limit, then
 * MHD_add_connection), the signal pipe, the engine's and the workers'
 * eventfds and libmicrohttpd, and owns each connection's life: the
 * request state, suspend and resume, the hang-up watch, the drain.  The
 * routes and handlers are in route.c and h_*.c; see http.h for the map.
 */
#include "daemon/server.h"

#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/http.h"
#include "daemon/sock.h"
#include "util/clock.h"
#include "util/log.h"

/* Workers for route_prepare: two, so that one large body being tokenized
 * does not queue the small requests behind it. */
#define PREP_WORKERS 2

/* Bytes of a body past its limit read and dropped before its 413: reading
 * costs a local daemon little, and a client that cannot stop its upload
 * (a chunked stream) still learns why it failed. */
#define DISCARD_MAX ((size_t)64 << 20)

static void server_exit(struct server *s, enum server_exit rc)
{
    s->rc = rc;
    ev_stop(s->loop);
}

/* ---- suspend / resume ---- */

static void on_hangup(void *data, unsigned events);

/* Parks the connection without watching it: a worker holds the request.
 * Its work is bounded, and a client that half-closed its side after the
 * body still gets the reply. */
static void park(struct req *r)
{
    MHD_suspend_connection(r->conn);
    r->suspended = true;
}

void suspend(struct req *r)
{
    park(r);
    /* MHD stops watching a suspended connection; we watch for the hang-up
     * (only: a half-closed client waits for its reply) */
    int rc = ev_io_start(r->srv->loop, &r->io, r->fd, EV_HUP, on_hangup, r);
    if (rc)
        log_msg(LOG_WARN, "cannot watch connection fd %d: %s", r->fd, strerror(-rc));
}

static void resume(struct req *r)
{
    if (!r->suspended)
        return;
    ev_io_stop(r->srv->loop, &r->io);
    r->suspended = false;
    MHD_resume_connection(r->conn);
}

/* The client hung up while its request waited for the engine: the
 * generation stops. */
static void on_hangup(void *data, unsigned events)
{
    (void)events;
    struct req *r = data;
    r->hup = true;
    engine_cancel(r->srv->eng, r->job);
    resume(r);
}

void track(struct req *r, struct job *j)
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

enum MHD_Result req_submit(struct req *r, struct job *j)
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
    bool ndjson = r->kind == REPLY_OLLAMA_GENERATE || r->kind == REPLY_OLLAMA_CHAT;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ndjson ? "application/x-ndjson" : "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    if (r->close || r->last)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result res = MHD_queue_response(r->conn, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    return res;
}

/* ---- the workers ---- */

static void prep_run(void *data)
{
    route_prepare(data);
}

static void prep_done(void *data, bool ran)
{
    struct req *r = data;
    if (!ran || r->srv->stopping)
        r->hup = true;
    resume(r);
}

enum MHD_Result req_offload(struct req *r)
{
    r->work = (struct work){.run = prep_run, .done = prep_done, .data = r};
    workers_submit(r->srv->workers, &r->work);
    park(r);
    return MHD_YES;
}

static void on_workers(void *data, unsigned events)
{
    (void)events;
    struct server *s = data;
    workers_complete(s->workers);
}

/* ---- libmicrohttpd ---- */

/* libmicrohttpd decodes %00 into a NUL that would cut the path short
 * ("/health%00x" would reach /health): a URL holding one is left as it
 * came, and refused by strict_framing. */
static size_t unescape(void *cls, struct MHD_Connection *conn, char *val)
{
    (void)cls;
    (void)conn;
    if (strstr(val, "%00"))
        return strlen(val);
    return MHD_http_unescape(val);
}

/* A Content-Length header's name and colon, as head_scan sees the line. */
#define CONTENT_LENGTH "content-length:"

/* The number of Content-Length and of Transfer-Encoding headers. */
struct framing {
    int n_cl, n_te;
};

static enum MHD_Result count_framing(void *cls, enum MHD_ValueKind kind, const char *key, const char *value)
{
    (void)kind;
    (void)value;
    struct framing *f = cls;
    f->n_cl += strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH) == 0;
    f->n_te += strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING) == 0;
    return MHD_YES;
}

/* What libmicrohttpd lets through and a request must not be, since a
 * proxy in front could frame the body differently: a version other than
 * HTTP/1.0 or 1.1, a NUL (%00) in the path, a transfer coding other than
 * chunked alone, two Content-Length or Transfer-Encoding headers, or both.
 * IPC_OK or the error; its reply closes the connection (r->close). */
static enum ipc_status strict_framing(struct req *r, const char *version, struct ipc_error *e)
{
    if (strcmp(version, MHD_HTTP_VERSION_1_1) != 0 && strcmp(version, MHD_HTTP_VERSION_1_0) != 0)
        return ipc_fail(e, IPC_EINVAL, "", "the request line has no HTTP/1.0 or HTTP/1.1 version");
    if (strstr(r->url, "%00"))
        return ipc_fail(e, IPC_EINVAL, "", "the path holds a NUL byte (%%00)");
    const char *te = MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING);
    if (te && strcasecmp(te, "chunked") != 0)
        return ipc_fail(e, IPC_EINVAL, "", "Transfer-Encoding \"%.64s\" is not supported (only chunked)", te);
    struct framing f = {0};
    MHD_get_connection_values(r->conn, MHD_HEADER_KIND, count_framing, &f);
    if (f.n_te > 1 || f.n_cl > 1 || (te && f.n_cl))
        return ipc_fail(e, IPC_EINVAL, "", f.n_te > 1 || f.n_cl > 1 ? "the request has two Content-Length or "
                                                                  "Transfer-Encoding headers"
                                                                : "the request has both Content-Length and "
                                                                  "Transfer-Encoding");
    return IPC_OK;
}

/* --max-body, except for a KV import, whose file is as large as the KV of
 * a whole context may be (engine_kv_max_size). */
static size_t body_limit(const struct server *s, const char *method, const char *url)
{
    if (strcmp(method, "POST") || strcmp(url, "/v1/sessions/import") ||
        engine_state(s->eng, NULL, 0) != ENGINE_READY)
        return s->cfg->max_body;
    size_t kv = engine_kv_max_size(s->eng);
    return kv ? kv : s->cfg->max_body;
}

#define CL_NOT 0xff /* cl_at: the line is not a Content-Length header */

/* A header line's next byte b (not its LF) for the Content-Length check:
 * the name, then blanks, then a decimal count (leading zeros and all, as
 * libmicrohttpd reads it), then at most a CR, which only the LF follows. */
static void cl_feed(struct conn *c, unsigned char b)
{
    static const char name[] = CONTENT_LENGTH;
    if (c->cl_at == CL_NOT)
        return;
    if (c->cl_at < sizeof(name) - 1) {
        c->cl_at = (unsigned char)tolower(b) == (unsigned char)name[c->cl_at] ? (unsigned char)(c->cl_at + 1) : CL_NOT;
    } else if (c->cl_cr) {
        c->cl_bad = true;
    } else if (b == '\r') {
        c->cl_cr = true;
    } else if (b == ' ' || b == '\t') {
        c->cl_bad |= c->cl_digits; /* libmicrohttpd refuses a blank after the count */
    } else if (b >= '0' && b <= '9') {
        unsigned d = b - '0';
        c->cl_over |= c->cl_val > (UINT64_MAX - d) / 10;
        c->cl_val = c->cl_over ? 0 : c->cl_val * 10 + d;
        c->cl_digits = true;
    } else {
        c->cl_bad = true;
    }
}

/* The next line starts: a header line (the request line went before it)
 * is read as a Content-Length header until its name differs. */
static void cl_start(struct conn *c)
{
    c->cl_at = c->head_line ? 0 : CL_NOT;
    c->cl_digits = c->cl_cr = c->cl_bad = c->cl_over = false;
    c->cl_val = 0;
}

/* Follows the request head through the bytes read, as libmicrohttpd
 * splits it (lines end at LF or CR LF; empty lines before the request line
 * are skipped; an empty line after it ends the head): why the head cannot
 * be served (and *code, its status), or NULL.  It cannot when a byte of it
 * is a NUL, or when a Content-Length header is not a count or one past
 * any body: libmicrohttpd's own 400 or 413 for those sends its status line
 * and headers twice.  The bytes after the head are counted in past_head,
 * until on_completed starts the next head. */
static const char *head_scan(struct conn *c, const unsigned char *p, size_t n, int *code)
{
    *code = 400;
    for (size_t i = 0; i < n; i++) {
        if (!c->in_head) {
            c->past_head += n - i;
            return NULL;
        }
        if (!p[i])
            return "the request head holds a NUL byte";
        if (p[i] != '\n') {
            c->line_len = c->line_len < 2 ? c->line_len + 1 : 2;
            c->line_last = p[i];
            cl_feed(c, p[i]);
            continue;
        }
        if (c->cl_at == sizeof(CONTENT_LENGTH) - 1) {
            if (c->cl_bad || !c->cl_digits)
                return "Content-Length must be a decimal byte count";
            if (c->cl_over || c->cl_val == UINT64_MAX) {
                *code = 413;
                return "Content-Length is past any body kvtierd takes";
            }
        }
        bool empty = !c->line_len || (c->line_len == 1 && c->line_last == '\r');
        c->line_len = 0;
        if (!empty)
            c->head_line = true;
        else if (c->head_line)
            c->in_head = false;
        cl_start(c);
    }
    return NULL;
}

/* The next head starts where this request ends. */
static void head_reset(struct conn *c)
{
    c->in_head = true;
    c->head_line = false;
    c->line_len = 0;
    cl_start(c);
    c->past_head = c->body_len = 0;
}

/* Bytes past the head beyond its body are a request pipelined behind this
 * one, read before recv() knew where this one ends: the reply closes the
 * connection and they are never parsed (r->last, not r->close: the request
 * itself is sound and keeps its body deadline).  So does the reply to a
 * chunked body, whose end only libmicrohttpd finds. */
static void pipelined_close(struct req *r, bool chunked)
{
    if (r->c && (chunked || r->c->past_head > r->c->body_len))
        r->last = true;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **ctx)
{
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
        r->started = clock_ms();
        const union MHD_ConnectionInfo *sc = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        r->c = sc ? sc->socket_context : NULL;
        if (r->c) {
            ev_io_stop(s->loop, &r->c->first); /* before suspend() watches the same fd */
            r->c->req = r;
            r->c->head_since = 0;
        }
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
        r->fd = ci ? ci->connect_fd : -1;
        struct ucred cr = {.pid = 0, .uid = (uid_t)-1, .gid = (gid_t)-1};
        socklen_t len = sizeof(cr);
        bool tcp = r->c && r->c->tcp;
        if (tcp)
            cr = (struct ucred){.pid = r->c->pid, .uid = r->c->uid};
        else if (r->fd < 0 || getsockopt(r->fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0)
            return MHD_NO;
        r->uid = cr.uid;
        r->pid = cr.pid;
        s->http_requests++;
        struct ipc_error e;
        if (strict_framing(r, version, &e) != IPC_OK) {
            r->close = true;
            return reply_error(r, &e);
        }
        if (tcp && s->cfg->api_key &&
            !sock_bearer_ok(MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION),
                            s->cfg->api_key)) {
            r->close = true; /* its body is never read */
            return fail(r, IPC_EAUTH, "", "a valid API key is required: Authorization: Bearer KEY");
        }
        if (r->c && r->c->reserve && strcmp(url, "/health") && strcmp(url, "/v1/health") && strcmp(url, "/metrics")) {
            r->close = true;
            return fail(r, IPC_EUNAVAIL, "", "too many clients connected (--max-clients): only /health and /metrics");
        }
        r->max_body = body_limit(s, method, url);
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long n = strtoull(cl, &end, 10);
            if (errno || *end || n > r->max_body) {
                ipc_fail(&e, IPC_ETOOLARGE, "", "the body is %.24s bytes; the limit is %zu%s", cl, r->max_body,
                         r->max_body == s->cfg->max_body ? " (--max-body)" : " (the KV of the whole context)");
                return reply_error(r, &e);
            }
            r->cap_body = (size_t)n;
            if (r->c)
                r->c->body_len = (size_t)n;
        }
        pipelined_close(r, MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING));
        return MHD_YES;
    }
    pipelined_close(r, false);
    if (*upload_size) {
        size_t n = *upload_size;
        *upload_size = 0;
        /* A body without a length (chunked) passes the limit while it
         * arrives, when libmicrohttpd cannot queue a reply yet: the rest is
         * read and dropped, up to DISCARD_MAX or another limit's worth, for
         * the 413 to go out once it ends; a client that sends more loses
         * the connection. */
        if (r->over || r->n_body + n > r->max_body) {
            r->over += n;
            r->close = true;
            return r->over > (r->max_body > DISCARD_MAX ? r->max_body : DISCARD_MAX) ? MHD_NO : MHD_YES;
        }
        if (r->n_body + n > r->cap_body || !r->body) {
            size_t cap = r->cap_body > r->n_body + n ? r->cap_body : (r->n_body + n) * 2;
            cap = cap > r->max_body ? r->max_body : cap;
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
    if (r->over) {
        struct ipc_error e;
        ipc_fail(&e, IPC_ETOOLARGE, "", "the body is over the limit of %zu bytes%s", r->max_body,
                 r->max_body == s->cfg->max_body ? " (--max-body)" : " (the KV of the whole context)");
        return reply_error(r, &e);
    }
    if (r->hup)
        return MHD_NO; /* resumed to be closed */
    if (r->job) { /* resumed by the engine */
        if (!job_done(s->eng, r->job)) {
            suspend(r);
            return MHD_YES;
        }
        return reply_done(r);
    }
    if (r->route) /* resumed by a worker */
        return route_resume(r);
    return dispatch(r, method);
}

static void on_first_byte(void *data, unsigned events)
{
    (void)events;
    struct conn *c = data;
    c->head_since = clock_ms();
    ev_io_stop(c->srv->loop, &c->first);
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
    ev_io_stop(s->loop, &r->io);
    if (r->c) { /* the next request's head: its deadline starts at its first byte */
        r->c->req = NULL;
        head_reset(r->c);
        if (!s->stopping)
            ev_io_start(s->loop, &r->c->first, r->c->fd, EV_READ, on_first_byte, r->c);
    }
    job_release(s->eng, r->prep.job);
    free(r->prep.ids.ids);
    kvfile_release(&r->prep.kvf);
    free(r->prep.out.p);
    json_decref(r->prep.request);
    json_decref(r->root);
    free(r->body);
    free(r->snap);
    for (int i = 0; i < SERVER_MAX_N; i++)
        ipc_tool_calls_free(&r->calls[i]);
    free(r);
    *ctx = NULL;
}

/* MHD_add_connection hands over the conn on_accept made; closed, it goes. */
static void on_connection(void *cls, struct MHD_Connection *conn, void **socket_ctx,
                          enum MHD_ConnectionNotificationCode code)
{
    (void)conn;
    struct server *s = cls;
    struct conn *c = *socket_ctx;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        c = s->accepting;
        s->accepting = NULL;
        *socket_ctx = c;
        if (!c)
            return;
        c->next = s->conns;
        if (s->conns)
            s->conns->prev = c;
        s->conns = c;
        return;
    }
    if (!c)
        return;
    ev_io_stop(s->loop, &c->first);
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    free(c);
    *socket_ctx = NULL;
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

/* ---- the loop's sources ---- */

/* A refused, timed-out or NUL-sending peer gets a short HTTP answer before
 * the close, so curl says why (libmicrohttpd has sent nothing on it yet). */
static void answer_raw(int fd, int code, const char *why)
{
    char buf[512];
    char body[256];
    const char *reason = code == 400   ? "Bad Request"
                         : code == 403 ? "Forbidden"
                         : code == 408 ? "Request Timeout"
                         : code == 413 ? "Content Too Large"
                                       : "Service Unavailable";
    /* no request field is at fault: the connection or its head is */
    int bn = snprintf(body, sizeof(body),
                      "{\"error\":{\"code\":%d,\"message\":\"%s\",\"type\":\"%s\",\"param\":null}}\n", code, why,
                      code == 403 ? "permission_error" : code >= 500 ? "unavailable_error" : "invalid_request_error");
    int n = snprintf(buf, sizeof(buf),
                     "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n"
                     "\r\n%s",
                     code, reason, bn, body);
    if (send(fd, buf, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
        log_msg(LOG_DEBUG, "answer not sent: %s", strerror(errno));
}

/* A refusal is sent at accept, usually before the client's request has
 * arrived.  Closing at once would reset the connection: a client whose
 * request comes in after the close fails to send it (EPIPE), and one whose
 * request sits unread when the socket closes reads ECONNRESET in place of
 * the answer.  So the answer is followed by a shutdown of the sending side
 * only, and what the client sends is read and dropped until it closes,
 * LINGER_BYTES have come, or LINGER_MS pass.  The slots are few and fixed:
 * a flood of refused connections must not hold descriptors, so past them
 * a refusal closes at once, as before. */
#define LINGER_MS 2000
#define LINGER_BYTES ((size_t)64 << 10)

static void linger_end(struct refused *l)
{
    ev_io_stop(l->srv->loop, &l->io);
    ev_timer_stop(l->srv->loop, &l->t);
    close(l->fd);
    l->fd = -1;
}

static void on_linger_timeout(void *data)
{
    linger_end(data);
}

static void on_linger_read(void *data, unsigned events)
{
    (void)events;
    struct refused *l = data;
    char buf[4096];
    for (;;) {
        ssize_t n = recvfrom(l->fd, buf, sizeof(buf), MSG_DONTWAIT, NULL, NULL);
        if (n > 0 && (l->dropped += (size_t)n) < LINGER_BYTES)
            continue;
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        linger_end(l); /* the client closed, failed, or sends too much */
        return;
    }
}

static void refuse(struct server *s, int fd, int code, const char *why)
{
    answer_raw(fd, code, why);
    struct refused *l = NULL;
    for (int i = 0; i < LINGER_SLOTS && !l; i++)
        if (s->lingering[i].fd < 0)
            l = &s->lingering[i];
    if (!l || shutdown(fd, SHUT_WR) != 0 || ev_io_start(s->loop, &l->io, fd, EV_READ, on_linger_read, l) != 0) {
        close(fd);
        return;
    }
    l->fd = fd;
    l->dropped = 0;
    ev_timer_start(s->loop, &l->t, LINGER_MS, on_linger_timeout, l);
}

/* The running server, for recv() below; NULL outside server_run.  Only
 * its loop thread, where libmicrohttpd reads, may walk its connections. */
static struct server *nul_guard;
static pthread_t nul_guard_thread;

/* libmicrohttpd 0.9.75 reads the request head as C strings, so a NUL byte
 * there ends what it holds: "GET /health\0junk" reaches /health, a NUL in a
 * value ends the value, a line that starts with one ends the head.  It has
 * no option that refuses a NUL, and once it has parsed a head the bytes are
 * gone; peeking at the socket before it reads would miss the heads that
 * follow on a kept-alive connection.  What it does do is read every byte a
 * client sends with recv(), which kvtierd defines here: a head holding a
 * NUL (or a Content-Length that is not a count: head_scan) gets a 400
 * (or 413), and libmicrohttpd is told the connection was reset, so it
 * closes it without parsing the bytes.  Bodies may hold NULs (a KV
 * import is binary); a request sent behind another before its reply
 * (pipelined) would be read with that one's body, so pipelined_close()
 * ends the connection after that reply instead. */
ssize_t recv(int fd, void *buf, size_t len, int flags)
{
    ssize_t n = recvfrom(fd, buf, len, flags, NULL, NULL);
    struct server *s = nul_guard;
    if (n <= 0 || !s || (flags & MSG_PEEK) || !pthread_equal(pthread_self(), nul_guard_thread))
        return n;
    struct conn *c = s->conns;
    while (c && c->fd != fd)
        c = c->next;
    int code;
    const char *why = c ? head_scan(c, buf, (size_t)n, &code) : NULL;
    if (!why)
        return n; /* not a client's bytes, or a head that can be parsed */
    log_msg(LOG_INFO, "uid %u pid %d: %s, connection closed", (unsigned)c->uid, (int)c->pid, why);
    engine_count_error(s->eng, code == 413 ? IPC_ETOOLARGE : IPC_EINVAL);
    answer_raw(fd, code, why);
    errno = ECONNRESET;
    return -1;
}

/* Connections held by this uid and by this pid; tcp: by --listen's
 * clients, all of them, whose share is apart from every uid's. */
static void count_peer(const struct server *s, const struct ucred *cr, bool tcp, int *by_uid, int *by_pid)
{
    *by_uid = *by_pid = 0;
    for (const struct conn *c = s->conns; c; c = c->next) {
        if (c->tcp != tcp)
            continue;
        *by_uid += tcp || c->uid == cr->uid;
        *by_pid += !tcp && c->pid == cr->pid;
    }
}

/* Past the deadline of its head or the rate of its body: a 408, then
 * shutdown() -- libmicrohttpd sees the end of the stream and closes the
 * connection the usual way. */
static void time_out(struct server *s, struct conn *c, const char *what)
{
    char why[96];
    snprintf(why, sizeof(why), "%s came too slowly (--header-timeout, --body-rate)", what);
    log_msg(LOG_INFO, "uid %u pid %d: %s, connection closed", (unsigned)c->uid, (int)c->pid, why);
    answer_raw(c->fd, 408, why);
    shutdown(c->fd, SHUT_RDWR);
    c->head_since = 0;
    s->timed_out++;
}

/* Whether the engine moves: with work queued or running, a step must
 * complete every --stall-timeout, else /health says "stalled" (logged once,
 * and once again when it moves). */
static void watch_progress(struct server *s, double now)
{
    struct engine_stats st = engine_get_stats(s->eng);
    if (st.steps != s->last_steps || (!st.queued && !st.running)) {
        if (s->stalled)
            log_msg(LOG_WARN, "the engine advances again");
        s->stalled = false;
        s->last_steps = st.steps;
        s->progress_at = now;
    } else if (!s->stalled && now - s->progress_at > s->cfg->stall_timeout_s * 1e3) {
        s->stalled = true;
        log_msg(LOG_ERR, "the engine is stalled: %d running, %d queued, no step for %d s (--stall-timeout)",
                st.running, st.queued, s->cfg->stall_timeout_s);
    }
}

/* Once a second: heads past --header-timeout from their first byte, bodies
 * slower than --body-rate after that same grace, the engine's progress,
 * the TCP refusals not yet logged. */
static void on_sweep(void *data)
{
    struct server *s = data;
    double now = clock_ms(), grace = s->cfg->header_timeout_s * 1e3;
    watch_progress(s, now);
    /* a burst of TCP refusals logs its count once it is over, not at the
     * next refusal, which may never come */
    if (s->tcp_refused_quiet && now - s->tcp_refused_log_ms >= 1000) {
        log_msg(LOG_WARN, "refused %u more TCP connections since the last such line", s->tcp_refused_quiet);
        s->tcp_refused_log_ms = now;
        s->tcp_refused_quiet = 0;
    }
    if (!s->ready) {
        /* systemctl status shows how far the load is; while the read moves
         * on, the unit's start timeout is pushed a minute past now, so the
         * timeout catches a load that is stuck, not one that is large */
        struct engine_load l = engine_load_progress(s->eng);
        char msg[160];
        snprintf(msg, sizeof(msg), "STATUS=Loading model: %s, %.0f of %.0f MiB read%s", l.phase,
                 l.bytes_done / 1048576.0, l.bytes_total / 1048576.0,
                 l.bytes_done > s->load_seen ? "\nEXTEND_TIMEOUT_USEC=60000000" : "");
        s->load_seen = l.bytes_done;
        sd_notify_msg(msg);
    }
    for (struct conn *c = s->conns; c; c = c->next) {
        struct req *r = c->req;
        if (!r && c->head_since && now - c->head_since > grace)
            time_out(s, c, "the request head");
        else if (r && !r->route && !r->suspended && !r->close && now - r->started > grace &&
                 (double)r->n_body < (double)s->cfg->body_rate * (now - r->started - grace) / 1e3)
            time_out(s, c, "the request body");
    }
    ev_timer_start(s->loop, &s->t_sweep, 1000, on_sweep, s);
}

/* Accepts on the Unix socket or, tcp, on --listen's, whose clients have
 * no peer credentials: they act as the daemon's uid once their key is
 * checked (on_request), with pid 0.  A connection holds its slot from
 * here, before any key, so TCP's are not counted with the daemon's user:
 * together they are one peer of their own, with a uid's share
 * (--max-clients-per-uid) and no per-process limit, and a port anyone can
 * reach never takes the slots of a local uid. */
static void accept_on(struct server *s, int lfd, bool tcp)
{
    for (;;) {
        struct sockaddr_storage peer;
        socklen_t pl = sizeof(peer);
        int fd = accept4(lfd, (struct sockaddr *)&peer, &pl, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                log_msg(LOG_WARN, "accept: %s", strerror(errno));
            return;
        }
        struct ucred cr = {.pid = 0, .uid = geteuid(), .gid = getegid()};
        socklen_t len = sizeof(cr);
        if (!tcp && (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0 ||
                     !sock_peer_allowed(cr.uid, cr.gid, s->cfg->allow_gid))) {
            log_msg(LOG_WARN, "refused a connection from uid %u pid %d: not the daemon's user or --allow-group",
                    (unsigned)cr.uid, (int)cr.pid);
            s->refused++;
            refuse(s, fd, 403, "this uid may not use kvtierd");
            continue;
        }
        const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->mhd, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
        unsigned open = di ? di->num_connections : 0;
        int by_uid, by_pid;
        count_peer(s, &cr, tcp, &by_uid, &by_pid);
        /* the reserve is the local monitor's: a TCP peer holds its slot
         * before its key is read */
        const char *full = open >= (unsigned)s->cfg->max_clients + (tcp ? 0 : HEALTH_RESERVE)
                               ? "too many clients connected"
                           : !tcp && by_pid >= s->cfg->max_per_pid ? "too many connections from this process"
                           : by_uid >= s->cfg->max_per_uid ? (tcp ? "too many TCP connections"
                                                                  : "too many connections from this uid")
                                                           : NULL;
        struct conn *c = full ? NULL : calloc(1, sizeof(*c));
        double now = clock_ms();
        /* one line a second at most: anyone who reaches the port could fill the log */
        if (!c && tcp && now - s->tcp_refused_log_ms < 1000) {
            s->tcp_refused_quiet++;
        } else if (!c && tcp) {
            log_msg(LOG_WARN, "refused a TCP connection: %s (%u open, %d over TCP; --max-clients %d, "
                    "--max-clients-per-uid %d; %u more refused since the last such line)", full ? full : "out of memory",
                    open, by_uid, s->cfg->max_clients, s->cfg->max_per_uid, s->tcp_refused_quiet);
            s->tcp_refused_log_ms = now;
            s->tcp_refused_quiet = 0;
        } else if (!c)
            log_msg(LOG_WARN, "refused a connection from uid %u pid %d: %s (%u open, %d of its uid, %d of its pid; "
                    "--max-clients %d, --max-clients-per-uid %d, --max-clients-per-pid %d)", (unsigned)cr.uid,
                    (int)cr.pid, full ? full : "out of memory", open, by_uid, by_pid, s->cfg->max_clients,
                    s->cfg->max_per_uid, s->cfg->max_per_pid);
        if (!c) {
            s->refused++;
            refuse(s, fd, 503, full ? full : "out of memory");
            continue;
        }
        *c = (struct conn){.srv = s, .uid = cr.uid, .pid = cr.pid, .fd = fd, .head_since = now,
                           .reserve = open >= (unsigned)s->cfg->max_clients, .in_head = true, .tcp = tcp, .cl_at = CL_NOT};
        s->accepting = c;
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        if (MHD_add_connection(s->mhd, fd, tcp ? (struct sockaddr *)&peer : (struct sockaddr *)&sa,
                               tcp ? pl : (socklen_t)sizeof(sa)) != MHD_YES)
            log_msg(LOG_WARN, "cannot serve a connection: %s", strerror(errno));
        free(s->accepting); /* not taken by on_connection */
        s->accepting = NULL;
    }
}

static void on_accept(void *data, unsigned events)
{
    (void)events;
    struct server *s = data;
    accept_on(s, s->listen_fd, false);
}

static void on_accept_tcp(void *data, unsigned events)
{
    (void)events;
    struct server *s = data;
    accept_on(s, s->tcp_fd, true);
}

static void stop_listening(struct server *s)
{
    if (s->listen_fd < 0)
        return;
    ev_io_stop(s->loop, &s->io_listen);
    close(s->listen_fd);
    s->listen_fd = -1;
    if (s->tcp_fd >= 0) {
        ev_io_stop(s->loop, &s->io_tcp);
        close(s->tcp_fd);
        s->tcp_fd = -1;
    }
    /* a socket-activated path belongs to systemd's .socket unit */
    if (s->cfg->sock_path && !s->cfg->socket_activated)
        unlink(s->cfg->sock_path);
}

/* The drain deadline: first the jobs still running fail (their clients get
 * the error), then, 2 s later, the loop ends whatever is left. */
/* After a second signal, the time the error replies get to go out: a
 * client reads its 503 rather than a closed connection. */
#define SECOND_SIGNAL_GRACE_MS 300

static void on_drain_timeout(void *data)
{
    struct server *s = data;
    if (s->aborted) {
        ev_stop(s->loop);
        return;
    }
    log_msg(LOG_WARN, "drain timeout: cancelling %d request(s)", engine_pending(s->eng));
    engine_abort_all(s->eng, IPC_EUNAVAIL, "kvtierd is shutting down (drain timeout)");
    s->aborted = true;
    ev_timer_start(s->loop, &s->t_drain, 2000, on_drain_timeout, s); /* time for the error replies to go out */
}

static void on_signal(void *data, unsigned events)
{
    (void)events;
    struct server *s = data;
    unsigned char sig;
    while (read(s->sig_fd, &sig, 1) == 1) {
        if (sig == SIGHUP) {
            int rc = log_reopen();
            log_msg(rc ? LOG_ERR : LOG_INFO, "SIGHUP: log reopened%s%s", rc ? ": " : "", rc ? strerror(-rc) : "");
            continue;
        }
        if (s->draining) { /* a second TERM/INT: stop now, once the 503s of what was in flight are out */
            log_msg(LOG_WARN, "second signal %u: failing %d request(s) in flight and exiting", sig,
                    engine_pending(s->eng));
            if (!s->aborted)
                engine_abort_all(s->eng, IPC_EUNAVAIL, "kvtierd is shutting down");
            s->aborted = true;
            ev_timer_start(s->loop, &s->t_drain, SECOND_SIGNAL_GRACE_MS, on_drain_timeout, s);
            continue;
        }
        int n = engine_pending(s->eng);
        log_msg(LOG_INFO, "signal %u: draining %d request(s), at most %d s", sig, n, s->cfg->drain_timeout_s);
        char msg[96];
        snprintf(msg, sizeof(msg), "STOPPING=1\nSTATUS=Draining %d requests", n);
        sd_notify_msg(msg);
        s->draining = true;
        ev_timer_start(s->loop, &s->t_drain, s->cfg->drain_timeout_s * 1e3, on_drain_timeout, s);
        stop_listening(s);
        engine_drain(s->eng);
    }
}

/* The engine published output: resume the requests that can move on. */
static void on_wake(void *data, unsigned events)
{
    (void)events;
    struct server *s = data;
    uint64_t v;
    if (read(s->wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
        log_msg(LOG_WARN, "eventfd read: %s", strerror(errno));
    if (!s->ready) {
        char msg[512];
        enum engine_state st = engine_state(s->eng, msg, sizeof(msg));
        if (st == ENGINE_FAILED) {
            log_msg(LOG_ERR, "cannot load the model: %s", msg);
            server_exit(s, SERVER_ELOAD);
            return;
        }
        if (st == ENGINE_READY) {
            s->piece_cap = engine_max_piece(s->eng);
            if (!(s->piece = malloc(s->piece_cap + 1))) {
                log_msg(LOG_ERR, "no memory for a %zu-byte token text buffer", s->piece_cap);
                server_exit(s, SERVER_EFATAL);
                return;
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
            engine_cancel_locked(s->eng, r->job);
            log_msg(LOG_WARN, "uid %u pid %d: stream reader too slow (over %zu bytes queued; --max-output), cancelled",
                    (unsigned)r->uid, (int)r->pid, s->cfg->max_output);
        }
        r->wake = r->suspended && (r->overflow || has_news(r));
    }
    engine_unlock(s->eng);
    for (struct req *r = s->waiting; r; r = r->next)
        if (r->wake)
            resume(r);
}

/* libmicrohttpd's fd and timeout only end the wait: before_sleep runs it. */
static void mhd_poke(void *data, unsigned events)
{
    (void)data;
    (void)events;
}

static void mhd_timeout(void *data)
{
    (void)data;
}

/* Every round ends here: libmicrohttpd processes its connections (and the
 * ones resumed this round), the drain ends when nothing is in flight, and
 * libmicrohttpd's next timeout is armed. */
static void before_sleep(void *data)
{
    struct server *s = data;
    MHD_run(s->mhd);
    if (s->draining && !s->waiting && engine_pending(s->eng) == 0 && workers_pending(s->workers) == 0) {
        ev_stop(s->loop);
        return;
    }
    MHD_UNSIGNED_LONG_LONG mt;
    if (MHD_get_timeout(s->mhd, &mt) == MHD_YES)
        ev_timer_start(s->loop, &s->t_mhd, (double)mt, mhd_timeout, s);
    else
        ev_timer_stop(s->loop, &s->t_mhd);
}

/* The fds the loop watches from the start; 0 or -errno. */
static int watch(struct server *s)
{
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->mhd, MHD_DAEMON_INFO_EPOLL_FD);
    int rc = di ? 0 : -EINVAL;
    if (!rc)
        rc = ev_io_start(s->loop, &s->io_mhd, di->epoll_fd, EV_READ, mhd_poke, s);
    if (!rc)
        rc = ev_io_start(s->loop, &s->io_listen, s->listen_fd, EV_READ, on_accept, s);
    if (!rc && s->tcp_fd >= 0)
        rc = ev_io_start(s->loop, &s->io_tcp, s->tcp_fd, EV_READ, on_accept_tcp, s);
    if (!rc)
        rc = ev_io_start(s->loop, &s->io_sig, s->sig_fd, EV_READ, on_signal, s);
    if (!rc)
        rc = ev_io_start(s->loop, &s->io_wake, s->wake_fd, EV_READ, on_wake, s);
    if (!rc)
        rc = ev_io_start(s->loop, &s->io_workers, workers_fd(s->workers), EV_READ, on_workers, s);
    return rc;
}

enum server_exit server_run(engine *e, const struct server_config *cfg, int listen_fd, int sig_fd, int wake_fd)
{
    struct server s = {.eng = e, .cfg = cfg, .listen_fd = listen_fd, .tcp_fd = cfg->tcp_fd, .sig_fd = sig_fd,
                       .wake_fd = wake_fd,
                       .started = time(NULL), .progress_at = clock_ms(), .rc = SERVER_OK};
    s.mhd = MHD_start_daemon(MHD_USE_EPOLL | MHD_USE_NO_LISTEN_SOCKET | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG,
                             0, NULL, NULL, on_request, &s, MHD_OPTION_NOTIFY_COMPLETED, on_completed, &s,
                             MHD_OPTION_NOTIFY_CONNECTION, on_connection, &s,
                             MHD_OPTION_CONNECTION_LIMIT, (unsigned)cfg->max_clients + HEALTH_RESERVE,
                             MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)64 * 1024, MHD_OPTION_CONNECTION_TIMEOUT,
                             (unsigned)cfg->idle_timeout_s, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
                             MHD_OPTION_UNESCAPE_CALLBACK, unescape, NULL, MHD_OPTION_END);
    if (!s.mhd) {
        log_msg(LOG_ERR, "cannot start the HTTP server (libmicrohttpd)");
        return SERVER_EFATAL;
    }
    int rc = ev_loop_create(&s.loop);
    if (!rc)
        rc = workers_start(PREP_WORKERS, &s.workers);
    if (!rc)
        rc = watch(&s);
    if (rc) {
        log_msg(LOG_ERR, "cannot set up the event loop: %s", strerror(-rc));
        workers_free(s.workers);
        ev_loop_free(s.loop);
        MHD_stop_daemon(s.mhd);
        return SERVER_EFATAL;
    }
    ev_set_before_sleep(s.loop, before_sleep, &s);
    for (int i = 0; i < LINGER_SLOTS; i++)
        s.lingering[i] = (struct refused){.srv = &s, .fd = -1};
    nul_guard_thread = pthread_self();
    nul_guard = &s;
    ev_timer_start(s.loop, &s.t_sweep, 1000, on_sweep, &s);
    rc = ev_run(s.loop);
    if (rc) {
        log_msg(LOG_ERR, "epoll_wait: %s", strerror(-rc));
        s.rc = SERVER_EFATAL;
    }
    /* MHD must not be stopped with suspended connections: the workers hand
     * theirs back (closed, as s.stopping says), and every parked request
     * is resumed to be closed. */
    s.stopping = true;
    workers_stop(s.workers);
    workers_complete(s.workers);
    for (struct req *r = s.waiting; r; r = r->next) {
        r->hup = true;
        resume(r);
    }
    MHD_run(s.mhd);
    MHD_stop_daemon(s.mhd);
    for (int i = 0; i < LINGER_SLOTS; i++)
        if (s.lingering[i].fd >= 0)
            linger_end(&s.lingering[i]);
    nul_guard = NULL;
    stop_listening(&s);
    workers_free(s.workers);
    ev_loop_free(s.loop);
    free(s.piece);
    return s.rc;
}
