/* kvtierd-bench - throughput of a running kvtierd under concurrent clients,
 * and the cost of serving over the socket compared with the in-process
 * generator.
 *
 *   kvtierd-bench --socket PATH [--clients 1,4,16] [-n TOKENS] [--prompt TEXT]
 *                 [--model DIR [--threads N]]
 *
 * For each client count C, C threads each stream one greedy completion of
 * TOKENS tokens (ignore_eos) at the same time; the aggregate decode rate is
 * C*TOKENS over the wall time.  With --model the same completion runs
 * in-process through generate() first, and the single-client stream is
 * compared with it (the model, threads and context must match the daemon's).
 * Prints a Markdown table.
 */
#include <getopt.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ipc/httpc.h"
#include "model/runtime.h"

struct client {
    const char *sock, *body;
    pthread_barrier_t *start;
    double t0, t_first, t_end; /* seconds */
    int tokens;
    bool ok;
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static bool on_event(void *ud, const char *data, size_t len)
{
    struct client *c = ud;
    if (!c->t_first)
        c->t_first = now_s();
    json_t *ev = json_loadb(data, len, 0, NULL);
    const json_t *u = json_object_get(json_object_get(ev, "usage"), "completion_tokens");
    if (json_is_integer(u))
        c->tokens = (int)json_integer_value(u);
    json_decref(ev);
    return true;
}

static void *run_client(void *arg)
{
    struct client *c = arg;
    pthread_barrier_wait(c->start);
    c->t0 = now_s();
    struct ipc_reply r;
    struct ipc_error err;
    c->ok = ipc_call(c->sock, "POST", "/v1/completions", c->body, strlen(c->body), on_event, c, &r, &err) == IPC_OK &&
            r.status == 200;
    if (!c->ok)
        fprintf(stderr, "kvtierd-bench: request failed: %s\n", r.status ? r.body : err.msg);
    ipc_reply_free(&r);
    c->t_end = now_s();
    return NULL;
}

/* Runs n clients at once; returns aggregate tokens/s (0 on failure), *ttft the mean time to first token. */
static double round_of(const char *sock, const char *body, int n, double *ttft, double *per_client)
{
    struct client *cs = calloc((size_t)n, sizeof(*cs));
    pthread_t *th = calloc((size_t)n, sizeof(*th));
    pthread_barrier_t start;
    if (!cs || !th || pthread_barrier_init(&start, NULL, (unsigned)n)) {
        free(cs);
        free(th);
        return 0;
    }
    for (int i = 0; i < n; i++) {
        cs[i] = (struct client){.sock = sock, .body = body, .start = &start};
        pthread_create(&th[i], NULL, run_client, &cs[i]);
    }
    double t0 = 1e300, t1 = 0, first = 0, per = 0;
    long tokens = 0;
    bool ok = true;
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        ok = ok && cs[i].ok;
        t0 = cs[i].t0 < t0 ? cs[i].t0 : t0;
        t1 = cs[i].t_end > t1 ? cs[i].t_end : t1;
        first += cs[i].t_first - cs[i].t0;
        per += cs[i].tokens / (cs[i].t_end - cs[i].t0);
        tokens += cs[i].tokens;
    }
    pthread_barrier_destroy(&start);
    free(cs);
    free(th);
    *ttft = first / n;
    *per_client = per / n;
    return ok ? tokens / (t1 - t0) : 0;
}

/* Decode tokens/s of the in-process generator on the same request. */
static double in_process(const char *dir, int threads, const char *prompt, int n_tok)
{
    char err[MODEL_ERR_LEN];
    struct runtime rt;
    struct runtime_params rp = {.be = {.n_threads = threads}};
    if (runtime_open(dir, &rp, &rt, err) != MODEL_OK) {
        fprintf(stderr, "kvtierd-bench: %s\n", err);
        return 0;
    }
    struct tok_ids ids = {0};
    struct gen_params gp;
    gen_params_default(&gp);
    gp.max_new_tokens = n_tok;
    gp.ignore_eos = true;
    struct gen_result res = {0};
    double rate = 0;
    if (tokenizer_encode(rt.tok, prompt, strlen(prompt), true, &ids, err) == MODEL_OK &&
        generate(rt.m, rt.tok, rt.store, ids.ids, ids.n, &gp, NULL, NULL, &res, err) == MODEL_OK)
        rate = res.tokens.n / ((res.prefill_ms + res.decode_ms) / 1e3);
    else
        fprintf(stderr, "kvtierd-bench: %s\n", err);
    free(ids.ids);
    free(res.tokens.ids);
    runtime_close(&rt);
    return rate;
}

int main(int argc, char **argv)
{
    const char *sock = NULL, *clients = "1,4,16", *prompt = "In the beginning", *model_dir = NULL;
    int n_tok = 128, threads = 0, c;
    static const struct option opts[] = {{"socket", required_argument, 0, 's'}, {"clients", required_argument, 0, 'c'},
                                         {"prompt", required_argument, 0, 'p'}, {"model", required_argument, 0, 'm'},
                                         {"threads", required_argument, 0, 't'}, {0, 0, 0, 0}};
    while ((c = getopt_long(argc, argv, "n:", opts, NULL)) != -1) {
        switch (c) {
        case 's': sock = optarg; break;
        case 'c': clients = optarg; break;
        case 'p': prompt = optarg; break;
        case 'm': model_dir = optarg; break;
        case 't': threads = atoi(optarg); break;
        case 'n': n_tok = atoi(optarg); break;
        default: sock = NULL, optind = argc + 1;
        }
    }
    if (!sock || optind != argc || n_tok < 1) {
        fprintf(stderr, "usage: kvtierd-bench --socket PATH [--clients 1,4,16] [-n TOKENS] [--prompt TEXT] "
                        "[--model DIR [--threads N]]\n");
        return 2;
    }
    json_t *b = json_pack("{s:s,s:i,s:i,s:b,s:b}", "prompt", prompt, "max_tokens", n_tok, "temperature", 0,
                          "ignore_eos", 1, "stream", 1);
    char *body = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    double base = model_dir ? in_process(model_dir, threads, prompt, n_tok) : 0;
    printf("| clients | aggregate tok/s | per client tok/s | mean TTFT ms | vs 1 client |\n|---|---|---|---|---|\n");
    double one = 0;
    int rc = 0;
    for (const char *p = clients; *p;) {
        int n = atoi(p);
        double ttft, per, agg = n > 0 ? round_of(sock, body, n, &ttft, &per) : 0;
        if (agg <= 0) {
            rc = 1;
            break;
        }
        one = one ? one : agg;
        printf("| %d | %.1f | %.1f | %.1f | %.2fx |\n", n, agg, per, ttft * 1e3, agg / one);
        p = strchr(p, ',') ? strchr(p, ',') + 1 : p + strlen(p);
    }
    if (base > 0 && one > 0)
        printf("\nin-process generate(): %.1f tok/s; one streamed client: %.1f tok/s; overhead %.1f %%\n", base, one,
               (base / one - 1) * 100);
    free(body);
    return rc;
}
