#include "ipc/httpc.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

/* The daemon's socket, read in blocks. */
struct src {
    int fd;
    char buf[16384];
    size_t pos, len;
    bool eof;
};

static bool fill(struct src *s)
{
    if (s->pos < s->len)
        return true;
    if (s->eof)
        return false;
    s->pos = 0;
    ssize_t n;
    do
        n = read(s->fd, s->buf, sizeof(s->buf));
    while (n < 0 && errno == EINTR);
    s->len = n > 0 ? (size_t)n : 0;
    s->eof = s->len == 0;
    return !s->eof;
}

/* One line without its CRLF into out (cap bytes); false on EOF or overlong. */
static bool get_line(struct src *s, char *out, size_t cap)
{
    size_t n = 0;
    for (;;) {
        if (!fill(s))
            return false;
        char c = s->buf[s->pos++];
        if (c == '\n')
            break;
        if (n + 1 >= cap)
            return false;
        out[n++] = c;
    }
    if (n && out[n - 1] == '\r')
        n--;
    out[n] = '\0';
    return true;
}

/* Where body bytes go: the reply buffer, or the SSE event splitter. */
struct sink {
    ipc_event_fn on_event;
    void *ud;
    bool sse, stop;
    char *p;
    size_t n, cap;
    struct ipc_error *err;
};

static enum ipc_status grow(struct sink *k, size_t need)
{
    if (need > IPC_MAX_REPLY)
        return ipc_fail(k->err, IPC_EPROTO, "", "the daemon's reply is over %u bytes", IPC_MAX_REPLY);
    if (need <= k->cap)
        return IPC_OK;
    size_t cap = k->cap ? k->cap : 4096;
    while (cap < need)
        cap *= 2;
    char *p = realloc(k->p, cap);
    if (!p)
        return ipc_fail(k->err, IPC_ENOMEM, "", "no memory for the reply");
    k->p = p;
    k->cap = cap;
    return IPC_OK;
}

/* Delivers every complete event ("...\n\n") held in the buffer. */
static void sse_dispatch(struct sink *k)
{
    size_t start = 0;
    for (;;) {
        char *end = k->n > start ? memmem(k->p + start, k->n - start, "\n\n", 2) : NULL;
        if (!end)
            break;
        *end = '\0';
        for (char *line = k->p + start; line && *line && !k->stop;) {
            char *nl = strchr(line, '\n');
            if (nl)
                *nl = '\0';
            if (!strncmp(line, "data:", 5)) {
                const char *d = line + 5 + (line[5] == ' ');
                k->stop = !k->on_event(k->ud, d, strlen(d));
            }
            line = nl ? nl + 1 : NULL;
        }
        start = (size_t)(end - k->p) + 2;
    }
    memmove(k->p, k->p + start, k->n - start);
    k->n -= start;
}

static enum ipc_status put(struct sink *k, const char *data, size_t n)
{
    enum ipc_status st = grow(k, k->n + n + 1);
    if (st != IPC_OK)
        return st;
    memcpy(k->p + k->n, data, n);
    k->n += n;
    k->p[k->n] = '\0';
    if (k->sse)
        sse_dispatch(k);
    return IPC_OK;
}

/* Copies n bytes (n = SIZE_MAX: until EOF) from the source to the sink. */
static enum ipc_status copy(struct src *s, struct sink *k, size_t n)
{
    while (n && !k->stop) {
        if (!fill(s)) {
            if (n == SIZE_MAX)
                return IPC_OK;
            return ipc_fail(k->err, IPC_EIO, "", "the daemon closed the connection mid-reply");
        }
        size_t avail = s->len - s->pos;
        size_t take = avail < n ? avail : n;
        enum ipc_status st = put(k, s->buf + s->pos, take);
        if (st != IPC_OK)
            return st;
        s->pos += take;
        if (n != SIZE_MAX)
            n -= take;
    }
    return IPC_OK;
}

static enum ipc_status parse(struct src *s, ipc_event_fn on_event, void *ud, struct ipc_reply *reply,
                             struct ipc_error *err)
{
    memset(reply, 0, sizeof(*reply));
    char line[8192];
    int status;
    do { /* skip interim 1xx replies */
        if (!get_line(s, line, sizeof(line)) || sscanf(line, "HTTP/1.%*1[01] %3d", &status) != 1 || status < 100)
            return ipc_fail(err, IPC_EPROTO, "", "the reply is not HTTP");
        bool chunked = false, sse = false;
        long long length = -1;
        for (;;) {
            if (!get_line(s, line, sizeof(line)))
                return ipc_fail(err, IPC_EPROTO, "", "the reply's headers are cut or too long");
            if (!line[0])
                break;
            char *colon = strchr(line, ':');
            if (!colon)
                return ipc_fail(err, IPC_EPROTO, "", "a reply header has no colon");
            *colon = '\0';
            const char *v = colon + 1 + strspn(colon + 1, " \t");
            if (!strcasecmp(line, "Content-Length")) {
                char *end;
                length = strtoll(v, &end, 10);
                if (*end || length < 0)
                    return ipc_fail(err, IPC_EPROTO, "", "bad Content-Length in the reply");
            } else if (!strcasecmp(line, "Transfer-Encoding")) {
                chunked = strcasestr(v, "chunked") != NULL;
            } else if (!strcasecmp(line, "Content-Type")) {
                sse = !strncasecmp(v, "text/event-stream", 17);
            }
        }
        if (status < 200)
            continue;
        struct sink k = {.on_event = on_event, .ud = ud, .sse = sse && on_event, .err = err};
        enum ipc_status st = grow(&k, 1);
        if (st == IPC_OK)
            k.p[0] = '\0'; /* an empty body is "" too */
        if (st == IPC_OK && chunked) {
            for (;;) {
                char *end;
                if (!get_line(s, line, sizeof(line))) {
                    st = ipc_fail(err, IPC_EIO, "", "the daemon closed the connection mid-reply");
                    break;
                }
                unsigned long long n = strtoull(line, &end, 16);
                if (end == line || (*end && *end != ';') || n > IPC_MAX_REPLY) {
                    st = ipc_fail(err, IPC_EPROTO, "", "bad chunk size in the reply");
                    break;
                }
                if (!n || k.stop)
                    break;
                st = copy(s, &k, (size_t)n);
                if (st == IPC_OK && !k.stop && (!get_line(s, line, sizeof(line)) || line[0]))
                    st = ipc_fail(err, IPC_EPROTO, "", "a chunk is not followed by CRLF");
                if (st != IPC_OK)
                    break;
            }
        } else if (st == IPC_OK) {
            st = copy(s, &k, length >= 0 ? (size_t)length : SIZE_MAX);
        }
        if (st != IPC_OK) {
            free(k.p);
            return st;
        }
        reply->status = status;
        reply->body = k.p;
        reply->len = k.sse ? 0 : k.n;
        if (k.sse)
            k.p[0] = '\0';
        return IPC_OK;
    } while (1);
}

static enum ipc_status send_all(int fd, const char *p, size_t n, struct ipc_error *err)
{
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return ipc_fail(err, IPC_EIO, "", "cannot send to kvtierd: %s", strerror(errno));
        p += w;
        n -= (size_t)w;
    }
    return IPC_OK;
}

enum ipc_status ipc_call(const char *sock_path, const char *method, const char *path, const char *body, size_t len,
                         ipc_event_fn on_event, void *ud, struct ipc_reply *reply, struct ipc_error *err)
{
    memset(reply, 0, sizeof(*reply));
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(sock_path) >= sizeof(sa.sun_path))
        return ipc_fail(err, IPC_EINVAL, "socket", "socket path too long: %s", sock_path);
    strcpy(sa.sun_path, sock_path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return ipc_fail(err, IPC_EIO, "socket", "cannot connect to kvtierd at %s: %s", sock_path, strerror(e));
    }
    char head[512];
    int hn = snprintf(head, sizeof(head),
                      "%s %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAccept: %s\r\n"
                      "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                      method, path, on_event ? "text/event-stream" : "application/json", body ? len : 0);
    enum ipc_status st = hn > 0 && (size_t)hn < sizeof(head) ? IPC_OK
                                                             : ipc_fail(err, IPC_EINVAL, "", "request path too long");
    if (st == IPC_OK)
        st = send_all(fd, head, (size_t)hn, err);
    if (st == IPC_OK && body)
        st = send_all(fd, body, len, err);
    if (st == IPC_OK)
        st = ipc_read_reply(fd, on_event, ud, reply, err);
    close(fd);
    return st;
}

enum ipc_status ipc_read_reply(int fd, ipc_event_fn on_event, void *ud, struct ipc_reply *reply,
                               struct ipc_error *err)
{
    memset(reply, 0, sizeof(*reply));
    struct src *s = calloc(1, sizeof(*s));
    if (!s)
        return ipc_fail(err, IPC_ENOMEM, "", "no memory");
    s->fd = fd;
    enum ipc_status st = parse(s, on_event, ud, reply, err);
    free(s);
    return st;
}

void ipc_reply_free(struct ipc_reply *r)
{
    free(r->body);
    r->body = NULL;
}
