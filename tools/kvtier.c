/* kvtier - the client of kvtierd.
 *
 *   kvtier [--socket PATH] [--json] generate [-n N] [-t T] [--seed S] [--stop STR] [--session ID] PROMPT|-
 *   kvtier [...] chat [--system TEXT] [-n N] [-t T]        interactive; /undo, /reset, /bye
 *   kvtier [...] sessions [rm ID]
 *   kvtier [...] session export ID FILE | session import FILE   KV as safetensors
 *   kvtier [...] status
 *   kvtier [...] batch IN.jsonl [-o OUT.jsonl] [-j N]      OpenAI batch lines, results in input order
 *   kvtier [...] top [-d SECONDS]                          live view of sessions, requests and tiers
 *
 * Every command takes --help.  All of them talk to kvtierd through
 * libkvtier-client; chat and top live in tools/kvtier/.
 * Exit codes: 0 success, 1 the daemon answered with an error, 2 usage,
 * 3 kvtierd cannot be reached, 4 a reply kvtier cannot understand.
 */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "tools/kvtier/cli.h"
#include "ipc/sockpath.h"
#include "util/args.h"
#include "util/clock.h"
#include "util/version.h"

kvtier_client *cli;
bool cli_json;

int cli_fail(enum kvtier_status st)
{
    const char *msg = kvtier_errmsg(cli);
    fprintf(stderr, "kvtier: %s\n", msg && *msg ? msg : kvtier_strerror(st));
    return st == KVTIER_EUNREACHABLE || st == KVTIER_EIO ? EXIT_UNREACHABLE : st == KVTIER_EPROTO ? EXIT_PROTO
                                                                                                  : EXIT_DAEMON;
}

void cli_nap_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int cli_wait_loading(void)
{
    bool tty = isatty(STDERR_FILENO), waited = false;
    double t0 = clock_s();
    for (;;) {
        struct kvtier_health h;
        enum kvtier_status st = kvtier_health(cli, &h);
        if (st != KVTIER_OK)
            return cli_fail(st);
        if (h.ready || strcmp(h.status, "loading") != 0) {
            if (waited && tty)
                fputs("\r\033[K", stderr); /* the bar goes; what follows starts on a clean line */
            if (h.ready)
                return waited ? 0 : -1;
            if (!waited)
                return -1;
            fprintf(stderr, "kvtier: kvtierd is %s\n", h.status);
            return EXIT_DAEMON;
        }
        if (tty && h.total_bytes > 0) {
            int width = 30, fill = (int)((double)width * (double)h.loaded_bytes / (double)h.total_bytes);
            fprintf(stderr, "\r\033[Kloading model [%.*s%*s] %3d%%  %.1f of %.1f GiB", fill,
                    "##############################", width - fill, "",
                    (int)(100.0 * (double)h.loaded_bytes / (double)h.total_bytes), h.loaded_bytes / 1073741824.0,
                    h.total_bytes / 1073741824.0);
        } else if (tty) {
            fprintf(stderr, "\r\033[Kloading model %c %.0f s", "|/-\\"[(int)((clock_s() - t0) * 4) % 4],
                    clock_s() - t0);
        } else if (!waited) {
            fprintf(stderr, "kvtier: waiting for kvtierd to load its model\n");
        }
        waited = true;
        cli_nap_ms(200);
    }
}

/* The daemon's error message for a non-2xx reply. */
static int http_error(const struct kvtier_reply *r)
{
    json_t *o = json_loadb(r->body, r->len, 0, NULL);
    const char *msg = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
    fprintf(stderr, "kvtier: HTTP %d: %s\n", r->status, msg ? msg : r->body);
    json_decref(o);
    return EXIT_DAEMON;
}

/* kvtier_request, asked again after a wait while the model loads. */
static int request(const char *method, const char *path, const char *body, size_t len, struct kvtier_reply *r)
{
    for (;;) {
        enum kvtier_status st = kvtier_request(cli, method, path, body, len, r);
        if (st != KVTIER_OK)
            return cli_fail(st);
        if (r->status != 503)
            return 0;
        int w = cli_wait_loading();
        if (w == -1)
            return 0; /* not loading: the 503 is the answer */
        kvtier_reply_free(r);
        if (w)
            return w;
    }
}

int cli_call(const char *method, const char *path, json_t *body, json_t **out)
{
    char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
    if (body && !text) {
        fprintf(stderr, "kvtier: out of memory\n");
        return EXIT_DAEMON;
    }
    struct kvtier_reply r;
    int rc = request(method, path, text, text ? strlen(text) : 0, &r);
    free(text);
    if (rc)
        return rc;
    if (r.status / 100 != 2)
        rc = http_error(&r);
    else if (out && !(*out = json_loadb(r.body, r.len, 0, NULL))) {
        fprintf(stderr, "kvtier: the daemon's reply is not JSON\n");
        rc = EXIT_PROTO;
    }
    kvtier_reply_free(&r);
    return rc;
}

/* ---- generation ------------------------------------------------------------------------- */

bool cli_gen_opts(int argc, char **argv, struct cli_gen *o)
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
        float t;
        switch (c) {
        case 'n':
            if (!args_int(optarg, 1, 1 << 24, &o->p.max_tokens)) {
                fprintf(stderr, "kvtier: -n must be 1 to %d\n", 1 << 24);
                return false;
            }
            break;
        case 't': /* the API's range: NaN, infinities and negatives are usage errors here */
            if (!args_float(optarg, 0.0f, 2.0f, &t)) {
                fprintf(stderr, "kvtier: -t must be a number from 0 to 2\n");
                return false;
            }
            o->p.temperature = t;
            break;
        case 's': { /* any 64-bit integer, as the API takes */
            char *end;
            errno = 0;
            o->p.seed = strtoll(optarg, &end, 10);
            if (errno || end == optarg || *end) {
                fprintf(stderr, "kvtier: --seed must be an integer from %lld to %lld\n", (long long)INT64_MIN,
                        (long long)INT64_MAX);
                return false;
            }
            o->p.has_seed = true;
            break;
        }
        case 'S':
            if (o->p.n_stop == sizeof(o->stops) / sizeof(o->stops[0])) {
                fprintf(stderr, "kvtier: at most %zu --stop strings\n", o->p.n_stop);
                return false;
            }
            o->stops[o->p.n_stop++] = optarg;
            o->p.stop = o->stops;
            break;
        case 'i': o->p.session = optarg; break;
        case 'y': o->system = optarg; break;
        default: return false;
        }
    }
    return true;
}

bool cli_print_piece(void *ud, const char *text, size_t len)
{
    bool *ends_nl = ud;
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    *ends_nl = len && text[len - 1] == '\n';
    return true;
}

/* The request body of --json generate: the daemon's whole reply is printed. */
static json_t *gen_body(const struct cli_gen *o, const char *prompt)
{
    json_t *b = json_pack("{s:i,s:f,s:s}", "max_tokens", o->p.max_tokens, "temperature", o->p.temperature, "prompt",
                          prompt);
    if (b && o->p.has_seed)
        json_object_set_new(b, "seed", json_integer(o->p.seed));
    for (size_t i = 0; b && i < o->p.n_stop; i++) {
        if (!json_object_get(b, "stop"))
            json_object_set_new(b, "stop", json_array());
        json_array_append_new(json_object_get(b, "stop"), json_string(o->stops[i]));
    }
    if (b && o->p.session)
        json_object_set_new(b, "session", json_string(o->p.session));
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

static const char generate_usage[] =
    "usage: kvtier generate [-n N] [-t T] [--seed S] [--stop STR] [--session ID] PROMPT...|-\n"
    "  streams a completion of PROMPT (the words joined by spaces; - reads stdin) to stdout\n"
    "  -n, --max-tokens N   tokens to generate, 1 to 16777216 (default 128)\n"
    "  -t, --temperature T  sampling temperature, 0 (greedy) to 2 (default 0.8)\n"
    "  --seed S             sampling seed, a 64-bit integer\n"
    "  --stop STR           stop at STR (repeatable)\n"
    "  --session ID         continue in a session (kvtier sessions)\n";

static int cmd_generate(int argc, char **argv)
{
    struct cli_gen o = {.p = {.max_tokens = 128, .temperature = 0.8}};
    if (!cli_gen_opts(argc, argv, &o) || optind >= argc || o.system) {
        fputs(generate_usage, stderr);
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
    if (!prompt) {
        fprintf(stderr, "kvtier: out of memory\n");
        return EXIT_DAEMON;
    }
    int rc;
    if (cli_json) {
        json_t *b = gen_body(&o, prompt), *r = NULL;
        rc = b ? cli_call("POST", "/v1/completions", b, &r) : EXIT_DAEMON;
        if (!rc)
            json_dumpf(r, stdout, JSON_COMPACT), putchar('\n');
        json_decref(r);
        json_decref(b);
    } else {
        bool ends_nl = true;
        struct kvtier_result res;
        enum kvtier_status st;
        int w = 0;
        while ((st = kvtier_stream(cli, prompt, &o.p, cli_print_piece, &ends_nl, &res)) == KVTIER_ELOADING &&
               (w = cli_wait_loading()) == 0)
            ;
        if (!ends_nl)
            putchar('\n'); /* output ends with a newline, also when the text does not */
        rc = st == KVTIER_OK ? 0 : w > 0 ? w : cli_fail(st);
        kvtier_result_free(&res);
    }
    free(prompt);
    return rc;
}

static const char sessions_usage[] = "usage: kvtier sessions [rm ID]\n"
                                     "  lists your sessions (id, tokens, KV bytes on the device, strategy, busy),\n"
                                     "  or deletes one\n";

static int cmd_sessions(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "rm")) {
        enum kvtier_status st = kvtier_session_delete(cli, argv[2]);
        return st == KVTIER_OK ? 0 : cli_fail(st);
    }
    if (argc != 1) {
        fputs(sessions_usage, stderr);
        return EXIT_USAGE;
    }
    json_t *r = NULL;
    int rc = cli_call("GET", "/v1/sessions", NULL, &r);
    if (rc)
        return rc;
    if (cli_json) {
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

/* Reads all of path into *buf (malloc'd): a regular file, one that has a
 * size, so that a device or a pipe (/dev/zero) cannot grow the buffer
 * without end. */
static int read_file(const char *path, char **buf, size_t *len)
{
    FILE *f = fopen(path, "rb");
    struct stat st;
    const char *why = !f ? strerror(errno) : fstat(fileno(f), &st) ? strerror(errno)
                                           : !S_ISREG(st.st_mode) ? "not a regular file"
                                                                  : NULL;
    size_t n = why ? 0 : (size_t)st.st_size;
    char *b = why ? NULL : malloc(n ? n : 1);
    if (!why && !b)
        why = "out of memory";
    if (!why && fread(b, 1, n, f) != n)
        why = "read failed";
    if (f)
        fclose(f);
    if (why) {
        fprintf(stderr, "kvtier: %s: %s\n", path, why);
        free(b);
        return EXIT_USAGE;
    }
    *buf = b;
    *len = n;
    return 0;
}

static const char session_usage[] =
    "usage: kvtier session export ID FILE | kvtier session import FILE\n"
    "  export: writes the session's KV to FILE as safetensors\n"
    "  import: a new session holding FILE's KV (prints its id)\n";

static int cmd_session(int argc, char **argv)
{
    bool export = argc == 4 && !strcmp(argv[1], "export"), import = argc == 3 && !strcmp(argv[1], "import");
    if (!export && !import) {
        fputs(session_usage, stderr);
        return EXIT_USAGE;
    }
    char path[160], *body = NULL;
    size_t len = 0;
    int rc = import ? read_file(argv[2], &body, &len) : 0;
    if (rc)
        return rc;
    snprintf(path, sizeof(path), export ? "/v1/sessions/%.64s/kv" : "/v1/sessions/import", argv[2]);
    struct kvtier_reply r;
    rc = request(export ? "GET" : "POST", path, body, len, &r);
    free(body);
    if (rc)
        return rc;
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
    kvtier_reply_free(&r);
    return rc;
}

static const char status_usage[] = "usage: kvtier status\n"
                                   "  the daemon's health and model; while it loads its model, a progress bar\n"
                                   "  until it is ready\n";

static int cmd_status(int argc, char **argv)
{
    (void)argv;
    if (argc != 1) {
        fputs(status_usage, stderr);
        return EXIT_USAGE;
    }
    json_t *h = NULL, *m = NULL;
    int rc = cli_call("GET", "/health", NULL, &h);
    if (!rc)
        rc = cli_call("GET", "/v1/models", NULL, &m);
    const json_t *model = json_array_get(json_object_get(m, "data"), 0);
    if (cli_json && !rc) {
        json_t *o = json_pack("{s:s,s:O,s:O}", "socket", kvtier_socket(cli), "health", h, "model", model);
        json_dumpf(o, stdout, JSON_COMPACT);
        putchar('\n');
        json_decref(o);
    } else if (!rc) {
        const json_t *meta = json_object_get(model, "meta");
        printf("kvtierd at %s: %s\nmodel %s (%s), context %lld tokens, vocabulary %lld, chat template %s\n", kvtier_socket(cli),
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

static char *batch_result(kvtier_client *kc, size_t idx, const char *line, unsigned long long *tokens, int *failed)
{
    json_t *in = json_loads(line, 0, NULL);
    const json_t *custom = json_object_get(in, "custom_id");
    const char *url = json_string_value(json_object_get(in, "url"));
    const json_t *body = json_object_get(in, "body"), *method = json_object_get(in, "method");
    json_t *res = json_pack("{s:o,s:O}", "id", json_sprintf("batch_req_%zu", idx), "custom_id",
                            custom ? custom : json_null());
    /* OpenAI's batch lines are POSTs; a method left out means that too */
    const char *why = !in ? "the line is not JSON" : !json_is_object(body) ? "body must be an object"
                      : method && (!json_is_string(method) || strcmp(json_string_value(method), "POST"))
                          ? "method must be POST"
                      : !url || (strcmp(url, "/v1/completions") && strcmp(url, "/v1/chat/completions"))
                          ? "url must be /v1/completions or /v1/chat/completions"
                          : NULL;
    if (!why) {
        char *text = json_dumps(body, JSON_COMPACT);
        struct kvtier_reply r;
        enum kvtier_status st = !kc ? KVTIER_ENOMEM : text ? kvtier_request(kc, "POST", url, text, strlen(text), &r)
                                                          : KVTIER_ENOMEM;
        free(text);
        if (st == KVTIER_OK) {
            json_t *rb = json_loadb(r.body, r.len, 0, NULL);
            json_object_set_new(res, "response", json_pack("{s:i,s:o}", "status_code", r.status, "body",
                                                           rb ? rb : json_stringn(r.body, r.len)));
            json_object_set_new(res, "error", json_null());
            *tokens += (unsigned long long)json_integer_value(
                json_object_get(json_object_get(rb, "usage"), "completion_tokens"));
            *failed += r.status / 100 != 2;
            kvtier_reply_free(&r);
        } else {
            why = st == KVTIER_ENOMEM ? "out of memory" : kvtier_errmsg(kc);
            json_object_set_new(res, "response", json_null());
            json_object_set_new(res, "error", json_pack("{s:s,s:s}", "code", st == KVTIER_ENOMEM ? "no_memory"
                                                                             : st == KVTIER_EPROTO ? "protocol" : "io",
                                                        "message", why));
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
    kvtier_client *kc = NULL; /* a client serves one thread; a failed open fails each line it takes */
    kvtier_open(kvtier_socket(cli), &kc);
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
        char *res = batch_result(kc, i, b->lines[i], &tok, &failed);
        pthread_mutex_lock(&b->mu);
        b->out[i] = res ? res : strdup("{\"error\":{\"code\":\"no_memory\",\"message\":\"out of memory\"}}");
        b->tokens += tok;
        b->failed += failed;
        pthread_cond_broadcast(&b->cv);
    }
    pthread_mutex_unlock(&b->mu);
    kvtier_close(kc);
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

/* Lines of out already written for the same inputs: resume after them.
 * A finished line is a result of this input line (its id and custom_id,
 * an absent one as null) that the daemon answered, or an invalid line's;
 * never a request line, nor one the daemon never got (io, protocol,
 * no_memory), which a rerun sends again. */
static size_t resume_point(FILE *out, char **lines, size_t n, long *keep)
{
    char *line = NULL;
    size_t cap = 0, k = 0;
    ssize_t len;
    *keep = 0;
    while (k < n && (len = getline(&line, &cap, out)) > 0 && line[len - 1] == '\n') {
        json_t *o = json_loads(line, 0, NULL), *in = json_loads(lines[k], 0, NULL);
        char id[32];
        snprintf(id, sizeof(id), "batch_req_%zu", k);
        const char *got = json_string_value(json_object_get(o, "id"));
        const json_t *oc = json_object_get(o, "custom_id"), *ic = json_object_get(in, "custom_id");
        const char *code = json_string_value(json_object_get(json_object_get(o, "error"), "code"));
        bool answered = json_is_object(json_object_get(o, "response")) || (code && !strcmp(code, "invalid_line"));
        bool same = o && got && !strcmp(got, id) && answered &&
                    json_equal(oc ? oc : json_null(), ic ? ic : json_null());
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

static const char batch_usage[] =
    "usage: kvtier batch IN.jsonl [-o OUT.jsonl] [-j CONCURRENCY]\n"
    "  sends each line of IN.jsonl (OpenAI batch format) and writes the results in input\n"
    "  order to stdout or OUT.jsonl; with -o, a rerun resumes after the finished lines\n"
    "  -j N   requests in flight (1-256, default 4)\n";

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
            fputs(batch_usage, stderr);
            return EXIT_USAGE;
        }
    }
    if (optind != argc - 1) {
        fprintf(stderr, "usage: kvtier batch IN.jsonl [-o OUT.jsonl] [-j CONCURRENCY]\n");
        return EXIT_USAGE;
    }
    int w = cli_wait_loading(); /* a daemon still loading would answer each line 503 */
    if (w > 0)
        return w;
    FILE *in = fopen(argv[optind], "r");
    if (!in) {
        fprintf(stderr, "kvtier: cannot open %s: %s\n", argv[optind], strerror(errno));
        return EXIT_USAGE;
    }
    /* the results written over the requests would lose them */
    struct stat si, so;
    if (out_path && fstat(fileno(in), &si) == 0 && stat(out_path, &so) == 0 && si.st_dev == so.st_dev &&
        si.st_ino == so.st_ino) {
        fprintf(stderr, "kvtier: -o %s is the input file: the results would overwrite the requests\n", out_path);
        fclose(in);
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
               "  generate [-n N] [-t T] [--seed S] [--stop STR] [--session ID] PROMPT...|-   stream a completion\n"
               "  chat [--system TEXT] [-n N] [-t T] [--seed S] [--stop STR]   interactive chat in one session\n"
               "  sessions [rm ID]                          list or delete your sessions\n"
               "  session export ID FILE                    save a session's KV as safetensors\n"
               "  session import FILE                       a new session from such a file (prints its id)\n"
               "  status                                    daemon health and model\n"
               "  batch IN.jsonl [-o OUT.jsonl] [-j N]      OpenAI batch lines, results in input order\n"
               "  top [-d SECONDS] [-n FRAMES]              live view of sessions, requests and tiers\n"
               "  quantize [--type T] MODEL_DIR OUT.gguf    a model directory as a (Q8_0) GGUF file\n"
               "kvtier COMMAND --help describes a command.\n"
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
            cli_json = true;
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
    static const struct {
        const char *name;
        int (*fn)(int, char **);
        const char *usage;
    } cmds[] = {{"generate", cmd_generate, generate_usage}, {"chat", cmd_chat, cli_chat_usage},
                {"sessions", cmd_sessions, sessions_usage}, {"status", cmd_status, status_usage},
                {"batch", cmd_batch, batch_usage}, {"session", cmd_session, session_usage},
                {"top", cmd_top, cli_top_usage}, {"quantize", cmd_quantize, cli_quantize_usage}};
    size_t k = 0, n_cmds = sizeof(cmds) / sizeof(cmds[0]);
    while (k < n_cmds && strcmp(argv[i], cmds[k].name))
        k++;
    if (k == n_cmds) {
        fprintf(stderr, "kvtier: unknown command \"%s\"\n", argv[i]);
        usage(stderr);
        return EXIT_USAGE;
    }
    /* --help anywhere before a "--" asks for the command's help, not the daemon */
    for (int a = i + 1; a < argc && strcmp(argv[a], "--"); a++)
        if (!strcmp(argv[a], "--help") || !strcmp(argv[a], "-h")) {
            fputs(cmds[k].usage, stdout);
            return 0;
        }
    if (cmds[k].fn == cmd_quantize) /* files only: no daemon */
        return cmd_quantize(argc - i, argv + i);
    char path[256];
    struct ipc_error err;
    if (ipc_socket_path(sock_flag, getenv("KVTIER_SYSTEM") != NULL, path, sizeof(path), &err) != IPC_OK) {
        fprintf(stderr, "kvtier: %s\n", err.msg);
        return EXIT_USAGE;
    }
    enum kvtier_status st = kvtier_open(path, &cli);
    if (st != KVTIER_OK) {
        fprintf(stderr, "kvtier: %s\n", kvtier_strerror(st));
        return EXIT_DAEMON;
    }
    int rc = cmds[k].fn(argc - i, argv + i);
    kvtier_close(cli);
    return rc;
}
