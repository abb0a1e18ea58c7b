/* kvtier - the client of kvtierd.
 *
 *   kvtier [--socket PATH] [--json] generate [-n N] [-t T] [--seed S] [--stop STR] [--session ID] PROMPT|-
 *   kvtier [...] chat [--system TEXT] [-n N] [-t T]        interactive; /undo, /reset, /bye
 *   kvtier [...] sessions [rm ID]
 *   kvtier [...] session export ID FILE | session import FILE   KV as safetensors
 *   kvtier [...] status
 *   kvtier [...] batch IN.jsonl [-o OUT.jsonl] [-j N]      OpenAI batch lines, results in input order
 *
 * Exit codes: 0 success, 1 the daemon answered with an error, 2 usage,
 * 3 kvtierd cannot be reached, 4 a reply kvtier cannot understand.
 */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "util/clock.h"
#include "ipc/httpc.h"
#include "ipc/sockpath.h"
#include "util/version.h"

enum { EXIT_DAEMON = 1, EXIT_USAGE = 2, EXIT_UNREACHABLE = 3, EXIT_PROTO = 4 };

static char sock[256];
static bool json_out;

static int transport_error(const struct ipc_error *e)
{
    fprintf(stderr, "kvtier: %s\n", e->msg);
    return e->st == IPC_EIO ? EXIT_UNREACHABLE : e->st == IPC_EPROTO ? EXIT_PROTO : EXIT_DAEMON;
}

/* Prints the daemon's error message for a non-2xx reply. */
static int http_error(const struct ipc_reply *r)
{
    json_t *o = json_loadb(r->body, r->len, 0, NULL);
    const char *msg = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
    fprintf(stderr, "kvtier: HTTP %d: %s\n", r->status, msg ? msg : r->body);
    json_decref(o);
    return EXIT_DAEMON;
}

/* One JSON call: *out gets the parsed reply (caller decrefs).  Returns an exit code. */
static int call_json(const char *method, const char *path, json_t *body, json_t **out)
{
    char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
    if (body && !text) {
        fprintf(stderr, "kvtier: out of memory\n");
        return EXIT_DAEMON;
    }
    struct ipc_reply r;
    struct ipc_error err;
    enum ipc_status st = ipc_call(sock, method, path, text, text ? strlen(text) : 0, NULL, NULL, &r, &err);
    free(text);
    if (st != IPC_OK)
        return transport_error(&err);
    int rc = 0;
    if (r.status / 100 != 2)
        rc = http_error(&r);
    else if (out && !(*out = json_loadb(r.body, r.len, 0, NULL))) {
        fprintf(stderr, "kvtier: the daemon's reply is not JSON\n");
        rc = EXIT_PROTO;
    }
    ipc_reply_free(&r);
    return rc;
}

/* ---- streaming ------------------------------------------------------------------------ */

struct stream_ctx {
    bool chat;
    char *text; /* everything printed, for chat history */
    size_t len;
    json_t *usage;
    char error[512];
};

static bool on_event(void *ud, const char *data, size_t len)
{
    struct stream_ctx *c = ud;
    if (!strcmp(data, "[DONE]"))
        return true;
    json_t *ev = json_loadb(data, len, 0, NULL);
    if (!ev) {
        snprintf(c->error, sizeof(c->error), "a stream event is not JSON");
        return false;
    }
    const json_t *e = json_object_get(ev, "error");
    if (e) {
        const char *m = json_string_value(json_object_get(e, "message"));
        snprintf(c->error, sizeof(c->error), "%s", m ? m : "error event");
    }
    const json_t *ch = json_array_get(json_object_get(ev, "choices"), 0);
    const json_t *t = c->chat ? json_object_get(json_object_get(ch, "delta"), "content") : json_object_get(ch, "text");
    if (json_is_string(t)) {
        size_t n = json_string_length(t);
        fwrite(json_string_value(t), 1, n, stdout);
        fflush(stdout);
        char *p = realloc(c->text, c->len + n + 1);
        if (p) {
            memcpy(p + c->len, json_string_value(t), n);
            c->len += n;
            p[c->len] = '\0';
            c->text = p;
        }
    }
    if (json_object_get(ev, "usage")) {
        json_decref(c->usage);
        c->usage = json_incref(json_object_get(ev, "usage"));
    }
    json_decref(ev);
    return !e;
}

static int call_stream(const char *path, json_t *body, struct stream_ctx *c)
{
    json_object_set_new(body, "stream", json_true());
    char *text = json_dumps(body, JSON_COMPACT);
    if (!text)
        return EXIT_DAEMON;
    struct ipc_reply r;
    struct ipc_error err;
    enum ipc_status st = ipc_call(sock, "POST", path, text, strlen(text), on_event, c, &r, &err);
    free(text);
    if (st != IPC_OK)
        return transport_error(&err);
    int rc = r.status / 100 != 2 ? http_error(&r) : 0;
    ipc_reply_free(&r);
    if (!rc && c->error[0]) {
        fprintf(stderr, "\nkvtier: %s\n", c->error);
        rc = EXIT_DAEMON;
    }
    return rc;
}

/* ---- commands -------------------------------------------------------------------------- */

struct gen_opts {
    int max_tokens;
    double temperature;
    long long seed;
    bool has_seed;
    json_t *stops;
    const char *session, *system;
};

/* Options shared by generate and chat; returns false on a usage error. */
static bool parse_gen_opts(int argc, char **argv, struct gen_opts *o)
{
    static const struct option opts[] = {{"max-tokens", required_argument, 0, 'n'},
                                         {"temperature", required_argument, 0, 't'},
                                         {"seed", required_argument, 0, 's'},
                                         {"stop", required_argument, 0, 'S'},
                                         {"session", required_argument, 0, 'i'},
                                         {"system", required_argument, 0, 'y'},
                                         {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "n:t:", opts, NULL)) != -1) {
        char *end = NULL;
        switch (c) {
        case 'n': o->max_tokens = (int)strtol(optarg, &end, 10); break;
        case 't': o->temperature = strtod(optarg, &end); break;
        case 's': o->seed = strtoll(optarg, &end, 10), o->has_seed = true; break;
        case 'S': json_array_append_new(o->stops, json_string(optarg)); break;
        case 'i': o->session = optarg; break;
        case 'y': o->system = optarg; break;
        default: return false;
        }
        if (end && *end) {
            fprintf(stderr, "kvtier: invalid number \"%s\"\n", optarg);
            return false;
        }
    }
    return true;
}

static json_t *gen_body(const struct gen_opts *o)
{
    json_t *b = json_pack("{s:i,s:f}", "max_tokens", o->max_tokens, "temperature", o->temperature);
    if (o->has_seed)
        json_object_set_new(b, "seed", json_integer(o->seed));
    if (json_array_size(o->stops))
        json_object_set(b, "stop", o->stops);
    if (o->session)
        json_object_set_new(b, "session", json_string(o->session));
    return b;
}

static char *read_all(FILE *f)
{
    size_t n = 0, cap = 4096;
    char *p = malloc(cap);
    while (p) {
        n += fread(p + n, 1, cap - n - 1, f);
        if (n < cap - 1)
            break;
        char *q = realloc(p, cap *= 2);
        if (!q)
            free(p);
        p = q;
    }
    if (p)
        p[n] = '\0';
    return p;
}

static int cmd_generate(int argc, char **argv)
{
    struct gen_opts o = {.max_tokens = 128, .temperature = 0.8, .stops = json_array()};
    if (!parse_gen_opts(argc, argv, &o) || optind >= argc) {
        fprintf(stderr, "usage: kvtier generate [-n N] [-t T] [--seed S] [--stop STR] [--session ID] PROMPT|-\n");
        json_decref(o.stops);
        return EXIT_USAGE;
    }
    char *prompt = NULL;
    if (!strcmp(argv[optind], "-")) {
        prompt = read_all(stdin);
    } else {
        size_t len = 0;
        for (int i = optind; i < argc; i++)
            len += strlen(argv[i]) + 1;
        prompt = calloc(1, len + 1);
        for (int i = optind; prompt && i < argc; i++)
            strcat(strcat(prompt, i > optind ? " " : ""), argv[i]);
    }
    json_t *b = gen_body(&o);
    json_object_set_new(b, "prompt", json_string(prompt ? prompt : ""));
    free(prompt);
    json_decref(o.stops);
    int rc;
    if (json_out) {
        json_t *r = NULL;
        rc = call_json("POST", "/v1/completions", b, &r);
        if (!rc)
            json_dumpf(r, stdout, JSON_COMPACT), putchar('\n');
        json_decref(r);
    } else {
        struct stream_ctx c = {0};
        rc = call_stream("/v1/completions", b, &c);
        if (isatty(STDOUT_FILENO))
            putchar('\n');
        free(c.text);
        json_decref(c.usage);
    }
    json_decref(b);
    return rc;
}

static int new_session(const char *system, char *id, size_t cap)
{
    json_t *b = system ? json_pack("{s:s}", "system", system) : json_object();
    json_t *r = NULL;
    int rc = call_json("POST", "/v1/sessions", b, &r);
    json_decref(b);
    if (!rc)
        snprintf(id, cap, "%s", json_string_value(json_object_get(r, "id")) ? json_string_value(json_object_get(r, "id"))
                                                                            : "");
    json_decref(r);
    return rc;
}

static void delete_session(const char *id)
{
    char path[160];
    snprintf(path, sizeof(path), "/v1/sessions/%s", id);
    call_json("DELETE", path, NULL, NULL);
}

/* Tokens the session's KV holds, or -1 (the error is printed). */
static json_int_t session_tokens(const char *id)
{
    char path[160];
    snprintf(path, sizeof(path), "/v1/sessions/%s", id);
    json_t *r = NULL;
    json_int_t n = call_json("GET", path, NULL, &r) ? -1 : json_integer_value(json_object_get(r, "tokens"));
    json_decref(r);
    return n;
}

/* /undo: crops the session back to where the last turn started and drops
 * the turn from the history.  turns[] holds the session's length before
 * each turn. */
static int chat_undo(const char *id, json_t *msgs, json_t *turns)
{
    size_t t = json_array_size(turns);
    if (!t) {
        fprintf(stderr, "nothing to undo\n");
        return 0;
    }
    json_int_t before = json_integer_value(json_array_get(turns, t - 1)), now = session_tokens(id);
    if (now < 0)
        return EXIT_DAEMON;
    char path[160];
    snprintf(path, sizeof(path), "/v1/sessions/%s/crop", id);
    json_t *b = json_pack("{s:I}", "n", before - now);
    int rc = b ? call_json("POST", path, b, NULL) : EXIT_DAEMON;
    json_decref(b);
    if (rc)
        return rc;
    json_array_remove(turns, t - 1);
    json_array_remove(msgs, json_array_size(msgs) - 1); /* the answer */
    json_array_remove(msgs, json_array_size(msgs) - 1); /* the question */
    fprintf(stderr, "undone: %lld tokens dropped\n", (long long)(now - before));
    return 0;
}

static json_t *chat_history(const char *system)
{
    json_t *m = json_array();
    if (system)
        json_array_append_new(m, json_pack("{s:s,s:s}", "role", "system", "content", system));
    return m;
}

static int cmd_chat(int argc, char **argv)
{
    struct gen_opts o = {.max_tokens = 256, .temperature = 0.8, .stops = json_array()};
    if (!parse_gen_opts(argc, argv, &o) || optind != argc) {
        fprintf(stderr, "usage: kvtier chat [--system TEXT] [-n N] [-t T] [--seed S]\n");
        json_decref(o.stops);
        return EXIT_USAGE;
    }
    char id[128];
    int rc = new_session(o.system, id, sizeof(id));
    if (rc)
        return rc;
    bool tty = isatty(STDIN_FILENO);
    if (tty)
        fprintf(stderr, "session %s. /undo drops the last turn, /reset starts over, /bye (or Ctrl-D) quits.\n", id);
    json_t *msgs = chat_history(o.system), *turns = json_array();
    char *line = NULL;
    size_t cap = 0;
    for (;;) {
        if (tty)
            fputs("> ", stderr);
        ssize_t n = getline(&line, &cap, stdin);
        if (n < 0)
            break;
        while (n && (line[n - 1] == '\n' || line[n - 1] == '\r'))
            line[--n] = '\0';
        if (!n)
            continue;
        if (!strcmp(line, "/bye"))
            break;
        if (!strcmp(line, "/undo")) {
            if ((rc = chat_undo(id, msgs, turns)))
                break;
            continue;
        }
        if (!strcmp(line, "/reset")) {
            delete_session(id);
            json_decref(msgs);
            msgs = chat_history(o.system);
            json_array_clear(turns);
            if ((rc = new_session(o.system, id, sizeof(id))))
                break;
            if (tty)
                fprintf(stderr, "new session %s\n", id);
            continue;
        }
        json_int_t held = session_tokens(id);
        if (held < 0) {
            rc = EXIT_DAEMON;
            break;
        }
        json_array_append_new(turns, json_integer(held));
        json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "user", "content", line));
        o.session = id;
        json_t *b = gen_body(&o);
        json_object_set(b, "messages", msgs);
        struct stream_ctx c = {.chat = true};
        rc = call_stream("/v1/chat/completions", b, &c);
        json_decref(b);
        putchar('\n');
        if (json_out && c.usage)
            json_dumpf(c.usage, stderr, JSON_COMPACT), fputc('\n', stderr);
        json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "assistant", "content", c.text ? c.text : ""));
        free(c.text);
        json_decref(c.usage);
        if (rc)
            break;
    }
    free(line);
    json_decref(msgs);
    json_decref(turns);
    json_decref(o.stops);
    delete_session(id);
    return rc;
}

static int cmd_sessions(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "rm")) {
        char path[160];
        snprintf(path, sizeof(path), "/v1/sessions/%s", argv[2]);
        return call_json("DELETE", path, NULL, NULL);
    }
    if (argc != 1) {
        fprintf(stderr, "usage: kvtier sessions [rm ID]\n");
        return EXIT_USAGE;
    }
    json_t *r = NULL;
    int rc = call_json("GET", "/v1/sessions", NULL, &r);
    if (rc)
        return rc;
    if (json_out) {
        json_dumpf(json_object_get(r, "data"), stdout, JSON_COMPACT);
        putchar('\n');
    } else {
        printf("%-24s %8s %12s %-10s %s\n", "ID", "TOKENS", "KV BYTES", "STRATEGY", "BUSY");
        size_t i;
        json_t *s;
        json_array_foreach(json_object_get(r, "data"), i, s)
        {
            printf("%-24s %8lld %12lld %-10s %s\n", json_string_value(json_object_get(s, "id")),
                   json_integer_value(json_object_get(s, "tokens")),
                   json_integer_value(json_object_get(json_object_get(s, "bytes"), "device")),
                   json_string_value(json_object_get(s, "strategy")),
                   json_is_true(json_object_get(s, "busy")) ? "yes" : "no");
        }
    }
    json_decref(r);
    return 0;
}

/* Reads all of path into *buf (malloc'd). */
static int read_file(const char *path, char **buf, size_t *len)
{
    FILE *f = fopen(path, "rb");
    char *b = NULL;
    size_t n = 0, cap = 0;
    while (f) {
        if (n == cap) {
            char *nb = realloc(b, cap = cap ? 2 * cap : 1 << 20);
            if (!nb)
                break;
            b = nb;
        }
        size_t got = fread(b + n, 1, cap - n, f);
        n += got;
        if (got == 0 && !ferror(f)) {
            fclose(f);
            *buf = b;
            *len = n;
            return 0;
        }
        if (ferror(f))
            break;
    }
    fprintf(stderr, "kvtier: %s: %s\n", path, f ? "read failed or out of memory" : strerror(errno));
    if (f)
        fclose(f);
    free(b);
    return EXIT_USAGE;
}

/* session export ID FILE: the session's KV as safetensors into FILE;
 * session import FILE: a new session holding FILE's KV (prints its id). */
static int cmd_session(int argc, char **argv)
{
    bool export = argc == 4 && !strcmp(argv[1], "export"), import = argc == 3 && !strcmp(argv[1], "import");
    if (!export && !import) {
        fprintf(stderr, "usage: kvtier session export ID FILE | kvtier session import FILE\n");
        return EXIT_USAGE;
    }
    char path[160], *body = NULL;
    size_t len = 0;
    int rc = import ? read_file(argv[2], &body, &len) : 0;
    if (rc)
        return rc;
    snprintf(path, sizeof(path), export ? "/v1/sessions/%.64s/kv" : "/v1/sessions/import", argv[2]);
    struct ipc_reply r;
    struct ipc_error err;
    enum ipc_status st = ipc_call(sock, export ? "GET" : "POST", path, body, len, NULL, NULL, &r, &err);
    free(body);
    if (st != IPC_OK)
        return transport_error(&err);
    if (r.status / 100 != 2) {
        rc = http_error(&r);
    } else if (export) {
        FILE *f = fopen(argv[3], "wb");
        if (!f || fwrite(r.body, 1, r.len, f) != r.len || fclose(f) != 0) {
            fprintf(stderr, "kvtier: %s: %s\n", argv[3], strerror(errno));
            rc = EXIT_USAGE;
        }
    } else {
        json_t *o = json_loadb(r.body, r.len, 0, NULL);
        const char *id = json_string_value(json_object_get(o, "id"));
        if (id)
            printf("%s\n", id);
        else
            fprintf(stderr, "kvtier: the daemon's reply names no session\n");
        rc = id ? 0 : EXIT_PROTO;
        json_decref(o);
    }
    ipc_reply_free(&r);
    return rc;
}

static int cmd_status(int argc, char **argv)
{
    (void)argv;
    if (argc != 1) {
        fprintf(stderr, "usage: kvtier status\n");
        return EXIT_USAGE;
    }
    json_t *h = NULL, *m = NULL;
    int rc = call_json("GET", "/health", NULL, &h);
    if (!rc)
        rc = call_json("GET", "/v1/models", NULL, &m);
    const json_t *model = json_array_get(json_object_get(m, "data"), 0);
    if (json_out && !rc) {
        json_t *o = json_pack("{s:s,s:O,s:O}", "socket", sock, "health", h, "model", model);
        json_dumpf(o, stdout, JSON_COMPACT);
        putchar('\n');
        json_decref(o);
    } else if (!rc) {
        const json_t *meta = json_object_get(model, "meta");
        printf("kvtierd at %s: %s\nmodel %s (%s), context %lld tokens, vocabulary %lld, chat template %s\n", sock,
               json_string_value(json_object_get(h, "status")), json_string_value(json_object_get(model, "id")),
               json_string_value(json_object_get(meta, "architecture")),
               json_integer_value(json_object_get(meta, "n_ctx")), json_integer_value(json_object_get(meta, "n_vocab")),
               json_string_value(json_object_get(meta, "chat_template")));
    }
    json_decref(h);
    json_decref(m);
    return rc;
}

/* ---- batch ------------------------------------------------------------------------------- */

struct batch {
    char **lines; /* input */
    size_t n, next, written;
    char **out;   /* result lines by input index */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    size_t window;
    unsigned long long tokens;
    int failed;
};

static char *batch_result(size_t idx, const char *line, unsigned long long *tokens, int *failed)
{
    json_t *in = json_loads(line, 0, NULL);
    const json_t *custom = json_object_get(in, "custom_id");
    const char *url = json_string_value(json_object_get(in, "url"));
    const json_t *body = json_object_get(in, "body");
    json_t *res = json_pack("{s:o,s:O}", "id", json_sprintf("batch_req_%zu", idx), "custom_id",
                            custom ? custom : json_null());
    const char *why = !in ? "the line is not JSON" : !json_is_object(body) ? "body must be an object"
                      : !url || (strcmp(url, "/v1/completions") && strcmp(url, "/v1/chat/completions"))
                          ? "url must be /v1/completions or /v1/chat/completions"
                          : NULL;
    if (!why) {
        char *text = json_dumps(body, JSON_COMPACT);
        struct ipc_reply r;
        struct ipc_error err;
        enum ipc_status st = text ? ipc_call(sock, "POST", url, text, strlen(text), NULL, NULL, &r, &err) : IPC_ENOMEM;
        free(text);
        if (st == IPC_OK) {
            json_t *rb = json_loadb(r.body, r.len, 0, NULL);
            json_object_set_new(res, "response", json_pack("{s:i,s:o}", "status_code", r.status, "body",
                                                           rb ? rb : json_stringn(r.body, r.len)));
            json_object_set_new(res, "error", json_null());
            *tokens += (unsigned long long)json_integer_value(
                json_object_get(json_object_get(rb, "usage"), "completion_tokens"));
            *failed += r.status / 100 != 2;
            ipc_reply_free(&r);
        } else {
            why = st == IPC_ENOMEM ? "out of memory" : err.msg;
            json_object_set_new(res, "error", json_pack("{s:s,s:s}", "code", ipc_status_name(st), "message", why));
            why = NULL;
            *failed += 1;
        }
    }
    if (why) {
        json_object_set_new(res, "response", json_null());
        json_object_set_new(res, "error", json_pack("{s:s,s:s}", "code", "invalid_line", "message", why));
        *failed += 1;
    }
    char *s = json_dumps(res, JSON_COMPACT);
    json_decref(res);
    json_decref(in);
    return s;
}

static void *batch_worker(void *arg)
{
    struct batch *b = arg;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        /* stay within a window of the writer, so results wait in memory briefly */
        while (b->next < b->n && b->next >= b->written + b->window)
            pthread_cond_wait(&b->cv, &b->mu);
        if (b->next >= b->n)
            break;
        size_t i = b->next++;
        pthread_mutex_unlock(&b->mu);
        unsigned long long tok = 0;
        int failed = 0;
        char *res = batch_result(i, b->lines[i], &tok, &failed);
        pthread_mutex_lock(&b->mu);
        b->out[i] = res ? res : strdup("{\"error\":{\"code\":\"no_memory\",\"message\":\"out of memory\"}}");
        b->tokens += tok;
        b->failed += failed;
        pthread_cond_broadcast(&b->cv);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

static void progress(struct batch *b, size_t start, double t0, bool final)
{
    double dt = clock_s() - t0;
    size_t done = b->written - start, total = b->n - start;
    int width = 30, fill = total ? (int)(width * done / total) : width;
    double eta = done ? dt / done * (total - done) : 0;
    fprintf(stderr, "\r\033[K[%.*s%*s] %zu/%zu  %.1f tok/s  ETA %d:%02d%s", fill, "##############################",
            width - fill, "", b->written, b->n, dt > 0 ? b->tokens / dt : 0.0, (int)eta / 60, (int)eta % 60,
            final ? "\n" : "");
}

/* Lines of out already written for the same inputs: resume after them. */
static size_t resume_point(FILE *out, char **lines, size_t n, long *keep)
{
    char *line = NULL;
    size_t cap = 0, k = 0;
    ssize_t len;
    *keep = 0;
    while (k < n && (len = getline(&line, &cap, out)) > 0 && line[len - 1] == '\n') {
        json_t *o = json_loads(line, 0, NULL), *in = json_loads(lines[k], 0, NULL);
        bool same = o && json_equal(json_object_get(o, "custom_id"), json_object_get(in, "custom_id"));
        json_decref(o);
        json_decref(in);
        if (!same)
            break;
        k++;
        *keep = ftell(out);
    }
    free(line);
    return k;
}

static int cmd_batch(int argc, char **argv)
{
    const char *out_path = NULL;
    int jobs = 4, c;
    optind = 1;
    while ((c = getopt(argc, argv, "o:j:")) != -1) {
        if (c == 'o')
            out_path = optarg;
        else if (c == 'j' && (jobs = atoi(optarg)) >= 1 && jobs <= 256)
            continue;
        else {
            fprintf(stderr, "usage: kvtier batch IN.jsonl [-o OUT.jsonl] [-j CONCURRENCY]\n");
            return EXIT_USAGE;
        }
    }
    if (optind != argc - 1) {
        fprintf(stderr, "usage: kvtier batch IN.jsonl [-o OUT.jsonl] [-j CONCURRENCY]\n");
        return EXIT_USAGE;
    }
    FILE *in = fopen(argv[optind], "r");
    if (!in) {
        fprintf(stderr, "kvtier: cannot open %s: %s\n", argv[optind], strerror(errno));
        return EXIT_USAGE;
    }
    struct batch b = {.window = (size_t)jobs * 4, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    char *line = NULL;
    size_t cap = 0, lcap = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, in)) > 0) {
        if (len == 1 && line[0] == '\n')
            continue;
        if (b.n == lcap) {
            char **p = realloc(b.lines, (lcap = lcap ? lcap * 2 : 64) * sizeof(*p));
            if (!p)
                return EXIT_DAEMON;
            b.lines = p;
        }
        b.lines[b.n++] = strdup(line);
    }
    free(line);
    fclose(in);
    FILE *out = stdout;
    size_t start = 0;
    if (out_path) {
        out = fopen(out_path, "a+");
        long keep = 0;
        if (out) {
            rewind(out);
            start = resume_point(out, b.lines, b.n, &keep);
            if (ftruncate(fileno(out), keep) != 0 || fseek(out, keep, SEEK_SET) != 0)
                out = NULL;
        }
        if (!out) {
            fprintf(stderr, "kvtier: cannot write %s: %s\n", out_path, strerror(errno));
            return EXIT_USAGE;
        }
        if (start)
            fprintf(stderr, "kvtier: resuming after %zu finished line(s)\n", start);
    }
    b.next = b.written = start;
    b.out = calloc(b.n + 1, sizeof(*b.out));
    pthread_t th[256];
    for (int i = 0; i < jobs; i++)
        pthread_create(&th[i], NULL, batch_worker, &b);
    bool bar = isatty(STDERR_FILENO);
    double t0 = clock_s(), last = 0;
    pthread_mutex_lock(&b.mu);
    while (b.written < b.n) {
        while (b.written < b.n && b.out[b.written]) {
            fprintf(out, "%s\n", b.out[b.written]);
            fflush(out);
            free(b.out[b.written]);
            b.out[b.written++] = NULL;
            pthread_cond_broadcast(&b.cv);
        }
        if (bar && clock_s() - last > 0.1) {
            progress(&b, start, t0, false);
            last = clock_s();
        }
        if (b.written < b.n) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100000000;
            if (ts.tv_nsec >= 1000000000)
                ts.tv_sec++, ts.tv_nsec -= 1000000000;
            pthread_cond_timedwait(&b.cv, &b.mu, &ts);
        }
    }
    pthread_mutex_unlock(&b.mu);
    for (int i = 0; i < jobs; i++)
        pthread_join(th[i], NULL);
    if (bar)
        progress(&b, start, t0, true);
    if (out != stdout)
        fclose(out);
    for (size_t i = 0; i < b.n; i++)
        free(b.lines[i]);
    free(b.lines);
    free(b.out);
    return b.failed ? EXIT_DAEMON : 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier [--socket PATH] [--json] COMMAND ...   (kvtier --version: the version)\n"
               "  generate [-n N] [-t T] [--seed S] [--stop STR] [--session ID] PROMPT|-   stream a completion\n"
               "  chat [--system TEXT] [-n N] [-t T]        interactive chat in one session (/undo, /reset, /bye)\n"
               "  sessions [rm ID]                          list or delete your sessions\n"
               "  session export ID FILE                    save a session's KV as safetensors\n"
               "  session import FILE                       a new session from such a file (prints its id)\n"
               "  status                                    daemon health and model\n"
               "  batch IN.jsonl [-o OUT.jsonl] [-j N]      OpenAI batch lines, results in input order\n"
               "exit codes: 0 ok, 1 daemon error, 2 usage, 3 kvtierd unreachable, 4 malformed reply\n");
}

int main(int argc, char **argv)
{
    if (version_requested(argc, argv, "kvtier"))
        return 0;
    const char *sock_flag = NULL;
    int i = 1;
    for (; i < argc && argv[i][0] == '-'; i++) {
        if (!strcmp(argv[i], "--socket") && i + 1 < argc)
            sock_flag = argv[++i];
        else if (!strcmp(argv[i], "--json"))
            json_out = true;
        else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else {
            usage(stderr);
            return EXIT_USAGE;
        }
    }
    if (i >= argc) {
        usage(stderr);
        return EXIT_USAGE;
    }
    struct ipc_error err;
    if (ipc_socket_path(sock_flag, getenv("KVTIER_SYSTEM") != NULL, sock, sizeof(sock), &err) != IPC_OK) {
        fprintf(stderr, "kvtier: %s\n", err.msg);
        return EXIT_USAGE;
    }
    static const struct {
        const char *name;
        int (*fn)(int, char **);
    } cmds[] = {{"generate", cmd_generate}, {"chat", cmd_chat}, {"sessions", cmd_sessions}, {"status", cmd_status},
                {"batch", cmd_batch}, {"session", cmd_session}};
    for (size_t k = 0; k < sizeof(cmds) / sizeof(cmds[0]); k++)
        if (!strcmp(argv[i], cmds[k].name))
            return cmds[k].fn(argc - i, argv + i);
    fprintf(stderr, "kvtier: unknown command \"%s\"\n", argv[i]);
    usage(stderr);
    return EXIT_USAGE;
}
