/* test_client.c - libkvtier-client against a stand-in for kvtierd: a
 * thread on a Unix socket that records each request and answers with the
 * raw reply the test set, so every framing (whole bodies, chunked event
 * streams split mid-line, errors, garbage) is checked byte for byte. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>

#include "client/kvtier/client.h"

static struct fake {
    int lfd;
    char sock[108], dir[64];
    pthread_t th;
    pthread_mutex_t mu;
    const char *reply; /* raw bytes sent back */
    bool hold;         /* keep the connection open after the reply until the client closes it */
    char method[16], path[128], body[4096];
    int requests, closes_seen;
} fk = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void *serve(void *arg)
{
    (void)arg;
    int fd;
    while ((fd = accept(fk.lfd, NULL, NULL)) >= 0) {
        char buf[8192];
        size_t n = 0;
        const char *head_end = NULL;
        long body = 0;
        ssize_t got;
        while (n < sizeof(buf) - 1 && (got = recv(fd, buf + n, sizeof(buf) - 1 - n, 0)) > 0) {
            n += (size_t)got;
            buf[n] = '\0';
            if (!head_end && (head_end = strstr(buf, "\r\n\r\n"))) {
                const char *cl = strcasestr(buf, "Content-Length: ");
                body = cl && cl < head_end ? strtol(cl + 16, NULL, 10) : 0;
            }
            if (head_end && n >= (size_t)(head_end + 4 - buf) + (size_t)body)
                break;
        }
        if (!head_end) {
            close(fd);
            continue;
        }
        pthread_mutex_lock(&fk.mu);
        sscanf(buf, "%15s %127s", fk.method, fk.path);
        snprintf(fk.body, sizeof(fk.body), "%.*s", (int)body, head_end + 4);
        fk.requests++;
        const char *reply = fk.reply;
        bool hold = fk.hold;
        pthread_mutex_unlock(&fk.mu);
        send(fd, reply, strlen(reply), MSG_NOSIGNAL);
        if (hold) {
            while (recv(fd, buf, sizeof(buf), 0) > 0)
                ;
            pthread_mutex_lock(&fk.mu);
            fk.closes_seen++;
            pthread_mutex_unlock(&fk.mu);
        }
        close(fd);
    }
    return NULL;
}

static void set_reply(const char *reply, bool hold)
{
    pthread_mutex_lock(&fk.mu);
    fk.reply = reply;
    fk.hold = hold;
    pthread_mutex_unlock(&fk.mu);
}

static int setup(void **state)
{
    (void)state;
    snprintf(fk.dir, sizeof(fk.dir), "/tmp/kvtier-client.XXXXXX");
    if (!mkdtemp(fk.dir))
        return -1;
    snprintf(fk.sock, sizeof(fk.sock), "%s/s", fk.dir);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", fk.sock);
    fk.lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fk.lfd < 0 || bind(fk.lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(fk.lfd, 16))
        return -1;
    return pthread_create(&fk.th, NULL, serve, NULL) ? -1 : 0;
}

static int teardown(void **state)
{
    (void)state;
    shutdown(fk.lfd, SHUT_RDWR); /* accept fails: the thread ends */
    pthread_join(fk.th, NULL);
    close(fk.lfd);
    unlink(fk.sock);
    rmdir(fk.dir);
    return 0;
}

/* A reply with the right Content-Length for body. */
static const char *json_reply(const char *status, const char *body)
{
    static char buf[4][4096];
    static int k;
    char *b = buf[k++ % 4];
    snprintf(b, sizeof(buf[0]), "HTTP/1.1 %s\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                "Content-Length: %zu\r\n\r\n%s", status, strlen(body), body);
    return b;
}

static void test_complete(void **state)
{
    (void)state;
    kvtier_client *c;
    assert_int_equal(kvtier_open(fk.sock, &c), KVTIER_OK);
    assert_string_equal(kvtier_socket(c), fk.sock);
    set_reply(json_reply("200 OK", "{\"choices\":[{\"text\":\"hi there\",\"finish_reason\":\"length\"}],"
                                   "\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,"
                                   "\"prompt_tokens_details\":{\"cached_tokens\":1}}}"),
              false);
    struct kvtier_params p = KVTIER_PARAMS_INIT;
    const char *stops[] = {"\n\n"};
    p.max_tokens = 5;
    p.session = "sess-00ff";
    p.stop = stops;
    p.n_stop = 1;
    p.extra_json = "{\"top_k\":7}";
    struct kvtier_result r;
    assert_int_equal(kvtier_complete(c, "hello", &p, &r), KVTIER_OK);
    assert_string_equal(r.text, "hi there");
    assert_int_equal(r.len, 8);
    assert_string_equal(r.finish_reason, "length");
    assert_int_equal(r.prompt_tokens, 3);
    assert_int_equal(r.completion_tokens, 2);
    assert_int_equal(r.cached_tokens, 1);
    assert_string_equal(fk.method, "POST");
    assert_string_equal(fk.path, "/v1/completions");
    assert_non_null(strstr(fk.body, "\"prompt\":\"hello\""));
    assert_non_null(strstr(fk.body, "\"max_tokens\":5"));
    assert_non_null(strstr(fk.body, "\"session\":\"sess-00ff\""));
    assert_non_null(strstr(fk.body, "\"stop\":[\"\\n\\n\"]"));
    assert_non_null(strstr(fk.body, "\"top_k\":7"));
    assert_null(strstr(fk.body, "temperature")); /* < 0: the daemon's default */
    assert_null(strstr(fk.body, "stream"));
    kvtier_result_free(&r);
    kvtier_result_free(&r); /* zeroed: a second free is harmless */
    p.extra_json = "[1]";
    assert_int_equal(kvtier_complete(c, "hello", &p, &r), KVTIER_EINVAL);
    assert_null(r.text);
    kvtier_close(c);
    kvtier_close(NULL);
}

struct got {
    char text[256];
    int calls, stop_after;
    kvtier_client *cancel;
};

static bool on_token(void *ud, const char *t, size_t n)
{
    struct got *g = ud;
    strncat(g->text, t, n);
    g->calls++;
    if (g->cancel)
        kvtier_cancel(g->cancel);
    return !g->stop_after || g->calls < g->stop_after;
}

/* An event-stream reply in chunked encoding, one chunk per part. */
static const char *chunked(const char *const *parts, size_t n)
{
    static char buf[4096];
    int k = snprintf(buf, sizeof(buf), "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                       "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
    for (size_t i = 0; i < n; i++)
        k += snprintf(buf + k, sizeof(buf) - (size_t)k, "%zx\r\n%s\r\n", strlen(parts[i]), parts[i]);
    snprintf(buf + k, sizeof(buf) - (size_t)k, "0\r\n\r\n");
    return buf;
}

/* Events split across chunks and mid-line, a comment, CRLF line ends, a
 * usage event and [DONE]. */
static const char *const sse[] = {
    ": keep-alive\n\ndata: {\"choi",
    "ces\":[{\"delta\":{\"content\":\"Hel\"}}]}\r",
    "\n",
    "\r\ndata: {\"choices\":[{\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"stop\"}]}\n",
    "\n",
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2}}\n\n",
    "data: [DONE]\n\n",
};

static void test_stream(void **state)
{
    (void)state;
    kvtier_client *c;
    assert_int_equal(kvtier_open(fk.sock, &c), KVTIER_OK);
    set_reply(chunked(sse, sizeof(sse) / sizeof(sse[0])), false);
    struct kvtier_message m[] = {{"system", "be brief"}, {"user", "hi"}};
    struct got g = {0};
    struct kvtier_result r;
    assert_int_equal(kvtier_chat(c, m, 2, NULL, on_token, &g, &r), KVTIER_OK);
    assert_string_equal(g.text, "Hello");
    assert_int_equal(g.calls, 2);
    assert_string_equal(r.text, "Hello");
    assert_string_equal(r.finish_reason, "stop");
    assert_int_equal(r.prompt_tokens, 4);
    assert_int_equal(r.completion_tokens, 2);
    assert_string_equal(fk.path, "/v1/chat/completions");
    assert_non_null(strstr(fk.body, "\"stream\":true"));
    assert_non_null(strstr(fk.body, "{\"role\":\"system\",\"content\":\"be brief\"}"));
    kvtier_result_free(&r);
    /* the callback stops the stream: cancelled, nothing kept */
    g = (struct got){.stop_after = 1};
    assert_int_equal(kvtier_chat(c, m, 2, NULL, on_token, &g, &r), KVTIER_ECANCELLED);
    assert_int_equal(g.calls, 1);
    assert_null(r.text);
    /* a completion stream's pieces are choices[0].text */
    set_reply("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
              "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"bc\"}]}\n\n"
              "data: {\"choices\":[{\"text\":\"\\u0000d\"}]}\n\ndata: [DONE]\n\n",
              false);
    g = (struct got){0};
    assert_int_equal(kvtier_stream(c, "x", NULL, on_token, &g, &r), KVTIER_OK);
    assert_string_equal(g.text, "abc"); /* strncat stops at the NUL a model may generate */
    assert_int_equal(g.calls, 3);
    assert_int_equal(r.len, 5);
    assert_memory_equal(r.text, "abc\0d", 5);
    kvtier_result_free(&r);
    assert_int_equal(kvtier_stream(c, "x", NULL, NULL, NULL, &r), KVTIER_EINVAL);
    kvtier_close(c);
}

/* kvtier_cancel closes the connection while the daemon still holds it open
 * (as a generation would): the call ends and the server sees the close. */
static void test_cancel(void **state)
{
    (void)state;
    kvtier_client *c;
    assert_int_equal(kvtier_open(fk.sock, &c), KVTIER_OK);
    set_reply("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
              "data: {\"choices\":[{\"text\":\"first\"}]}\n\n",
              true);
    int closes = fk.closes_seen;
    struct got g = {.cancel = c};
    struct kvtier_result r;
    assert_int_equal(kvtier_stream(c, "x", NULL, on_token, &g, &r), KVTIER_ECANCELLED);
    assert_string_equal(g.text, "first");
    assert_string_equal(kvtier_errmsg(c), "cancelled");
    for (int i = 0; i < 500; i++) { /* the server thread notices the close */
        pthread_mutex_lock(&fk.mu);
        int now = fk.closes_seen;
        pthread_mutex_unlock(&fk.mu);
        if (now > closes)
            break;
        usleep(10000);
    }
    assert_int_equal(fk.closes_seen, closes + 1);
    /* the next call starts afresh */
    set_reply(json_reply("200 OK", "{\"choices\":[{\"text\":\"ok\"}]}"), false);
    assert_int_equal(kvtier_complete(c, "x", NULL, &r), KVTIER_OK);
    assert_string_equal(r.text, "ok");
    kvtier_result_free(&r);
    kvtier_close(c);
}

static void test_errors(void **state)
{
    (void)state;
    kvtier_client *c;
    struct kvtier_result r;
    assert_int_equal(kvtier_open(fk.sock, &c), KVTIER_OK);
    set_reply(json_reply("503 Service Unavailable", "{\"error\":{\"message\":\"the model is loading\",\"code\":503}}"),
              false);
    assert_int_equal(kvtier_complete(c, "x", NULL, &r), KVTIER_ELOADING);
    assert_int_equal(kvtier_http_status(c), 503);
    assert_null(r.text);
    set_reply(json_reply("503 Service Unavailable", "{\"error\":{\"message\":\"Shutting down\"}}"), false);
    assert_int_equal(kvtier_complete(c, "x", NULL, &r), KVTIER_EHTTP);
    set_reply(json_reply("400 Bad Request", "{\"error\":{\"message\":\"max_tokens must be positive\"}}"), false);
    struct got g = {0};
    assert_int_equal(kvtier_stream(c, "x", NULL, on_token, &g, &r), KVTIER_EHTTP);
    assert_string_equal(kvtier_errmsg(c), "HTTP 400: max_tokens must be positive");
    assert_int_equal(g.calls, 0);
    /* an error event inside a stream */
    set_reply("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
              "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"error\":{\"message\":\"out of KV memory\"}}\n\n",
              false);
    assert_int_equal(kvtier_stream(c, "x", NULL, on_token, &g, &r), KVTIER_EHTTP);
    assert_string_equal(kvtier_errmsg(c), "out of KV memory");
    /* not JSON where JSON is due, and not HTTP at all */
    set_reply("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\ndata: {nope\n\n", false);
    assert_int_equal(kvtier_stream(c, "x", NULL, on_token, &g, &r), KVTIER_EPROTO);
    set_reply(json_reply("200 OK", "{\"choices\":[]}"), false);
    assert_int_equal(kvtier_complete(c, "x", NULL, &r), KVTIER_EPROTO);
    set_reply("SSH-2.0-OpenSSH\r\n", false);
    assert_int_equal(kvtier_complete(c, "x", NULL, &r), KVTIER_EPROTO);
    kvtier_close(c);
    /* nobody listens */
    char none[128];
    snprintf(none, sizeof(none), "%s/none", fk.dir);
    assert_int_equal(kvtier_open(none, &c), KVTIER_OK);
    assert_int_equal(kvtier_complete(c, "x", NULL, &r), KVTIER_EUNREACHABLE);
    assert_non_null(strstr(kvtier_errmsg(c), "is kvtierd running?"));
    kvtier_close(c);
    assert_int_equal(kvtier_open("@abstract", &c), KVTIER_EINVAL);
    assert_null(c);
    assert_string_equal(kvtier_strerror(KVTIER_ELOADING), "kvtierd is loading its model");
}

static void test_sessions_health(void **state)
{
    (void)state;
    kvtier_client *c;
    char id[KVTIER_SESSION_ID_MAX + 1];
    assert_int_equal(kvtier_open(fk.sock, &c), KVTIER_OK);
    set_reply(json_reply("200 OK", "{\"id\":\"sess-0123abcd\",\"object\":\"session\"}"), false);
    assert_int_equal(kvtier_session_create(c, "you are terse", id), KVTIER_OK);
    assert_string_equal(id, "sess-0123abcd");
    assert_string_equal(fk.path, "/v1/sessions");
    assert_string_equal(fk.body, "{\"system\":\"you are terse\"}");
    set_reply(json_reply("200 OK", "{\"id\":\"../../etc\"}"), false);
    assert_int_equal(kvtier_session_create(c, NULL, id), KVTIER_EPROTO);
    assert_string_equal(id, "");
    set_reply(json_reply("200 OK", "{\"deleted\":true}"), false);
    assert_int_equal(kvtier_session_delete(c, "sess-0123abcd"), KVTIER_OK);
    assert_string_equal(fk.method, "DELETE");
    assert_string_equal(fk.path, "/v1/sessions/sess-0123abcd");
    int before = fk.requests;
    assert_int_equal(kvtier_session_delete(c, "a/b"), KVTIER_EINVAL);
    assert_int_equal(fk.requests, before); /* refused before sending */

    struct kvtier_health h;
    set_reply(json_reply("503 Service Unavailable",
                         "{\"status\":\"loading\",\"loading\":{\"phase\":\"weights\",\"bytes_done\":50,\"bytes_total\":200}}"), false);
    assert_int_equal(kvtier_health(c, &h), KVTIER_OK);
    assert_false(h.ready);
    assert_string_equal(h.status, "loading");
    assert_int_equal(h.loaded_bytes, 50);
    assert_int_equal(h.total_bytes, 200);
    assert_string_equal(fk.method, "GET");
    set_reply(json_reply("200 OK", "{\"status\":\"ok\"}"), false);
    assert_int_equal(kvtier_health(c, &h), KVTIER_OK);
    assert_true(h.ready);
    assert_int_equal(h.total_bytes, -1);
    /* progress that does not add up is no progress */
    set_reply(json_reply("503 Service Unavailable", "{\"status\":\"loading\",\"loading\":{\"bytes_done\":9,\"bytes_total\":3}}"),
              false);
    assert_int_equal(kvtier_health(c, &h), KVTIER_OK);
    assert_int_equal(h.loaded_bytes, -1);
    set_reply(json_reply("200 OK", "[]"), false);
    assert_int_equal(kvtier_health(c, &h), KVTIER_EPROTO);

    struct kvtier_reply rep;
    set_reply(json_reply("404 Not Found", "{\"error\":{}}"), false);
    assert_int_equal(kvtier_request(c, "GET", "/v1/nothing", NULL, 0, &rep), KVTIER_OK);
    assert_int_equal(rep.status, 404);
    assert_string_equal(rep.body, "{\"error\":{}}");
    kvtier_reply_free(&rep);
    assert_int_equal(kvtier_request(c, "GET", "no-slash", NULL, 0, &rep), KVTIER_EINVAL);
    kvtier_close(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_complete), cmocka_unit_test(test_stream), cmocka_unit_test(test_cancel),
        cmocka_unit_test(test_errors), cmocka_unit_test(test_sessions_health),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
