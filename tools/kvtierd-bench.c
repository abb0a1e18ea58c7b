/* kvtierd-bench - throughput of a running kvtierd under concurrent clients,
 * and the cost of serving over the socket compared with the in-process
 * generator.
 *
 *   kvtierd-bench --socket PATH [--clients 1,4,16] [-n TOKENS] [--reps R] [--prompt TEXT]
 *                 [--model DIR [--threads N]]
 *
 * For each client count C, C threads each stream one greedy completion of
 * TOKENS tokens (ignore_eos) at the same time; the aggregate decode rate is
 * C*TOKENS over the wall time.  With --model the same completion also runs
 * in-process through generate(), each time followed by one streamed client,
 * and the two are compared (the model, threads and context must match the
 * daemon's).  Everything repeats R times, interleaved, and the table shows
 * medians and the median of each repetition's ratios, so that load from
 * other processes, which drifts over minutes, cancels out.  The daemon's
 * CPU time per token (from /proc, its pid from SO_PEERCRED) measures the
 * work batching saves independently of that load.  Prints Markdown.
 */
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client/kvtier/client.h"
#include "util/args.h"
#include "util/clock.h"
#include "model/runtime.h"
#include "util/version.h"
#include "util/median.h"

#define MAX_REPS 32
#define MAX_COUNTS 16

struct client {
    const char *sock, *prompt;
    const struct kvtier_params *p;
    pthread_barrier_t *start;
    double t0, t_first, t_end; /* seconds */
    int tokens;
    bool ok;
};

static bool on_token(void *ud, const char *text, size_t len)
{
    (void)text, (void)len;
    struct client *c = ud;
    if (!c->t_first)
        c->t_first = clock_s();
    return true;
}

static void *run_client(void *arg)
{
    struct client *c = arg;
    pthread_barrier_wait(c->start);
    kvtier_client *kc = NULL;
    struct kvtier_result r = {0};
    enum kvtier_status st = kvtier_open(c->sock, &kc);
    c->t0 = clock_s();
    if (st == KVTIER_OK)
        st = kvtier_stream(kc, c->prompt, c->p, on_token, c, &r);
    c->t_end = clock_s();
    c->ok = st == KVTIER_OK;
    c->tokens = (int)r.completion_tokens;
    if (!c->ok)
        fprintf(stderr, "kvtierd-bench: request failed: %s\n", kc ? kvtier_errmsg(kc) : kvtier_strerror(st));
    kvtier_result_free(&r);
    kvtier_close(kc);
    return NULL;
}

/* Runs n clients at once; returns aggregate tokens/s (0 on failure), *ttft the mean time to first token. */
static double round_of(const char *sock, const char *prompt, const struct kvtier_params *p, int n, double *ttft, double *per_client)
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
        cs[i] = (struct client){.sock = sock, .prompt = prompt, .p = p, .start = &start};
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

/* The daemon's pid, from the peer credentials of a connection (0 when
 * unknown): its CPU time is read from /proc around each round. */
static pid_t daemon_pid(const char *path)
{
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    struct ucred cr = {0};
    socklen_t len = sizeof(cr);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
    bool ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
              getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0;
    if (fd >= 0)
        close(fd);
    return ok ? cr.pid : 0;
}

/* User + system CPU seconds pid has used (-1 when unreadable).  The
 * computation's CPU time per token does not depend on how much of the
 * machine other processes take, unlike tokens per wall second. */
static double cpu_seconds(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = pid > 0 ? fopen(path, "r") : NULL;
    size_t n = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
    if (f)
        fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    unsigned long long ut, st;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* The in-process side of the comparison: the same model, loaded once. */
struct local {
    struct runtime rt;
    struct tok_ids ids;
};

static bool local_open(struct local *l, const char *dir, int threads, const char *prompt)
{
    char err[MODEL_ERR_LEN];
    struct runtime_params rp = {.be = {.n_threads = threads}};
    memset(l, 0, sizeof(*l));
    if (runtime_open(dir, &rp, &l->rt, err) != MODEL_OK) {
        fprintf(stderr, "kvtierd-bench: %s\n", err);
        return false;
    }
    if (tokenizer_encode(l->rt.tok, prompt, strlen(prompt), true, &l->ids, err) != TEXT_OK) {
        fprintf(stderr, "kvtierd-bench: %s\n", err);
        runtime_close(&l->rt);
        return false;
    }
    return true;
}

static void local_close(struct local *l)
{
    free(l->ids.ids);
    runtime_close(&l->rt);
}

/* Tokens/s of generate() on the request, prefill included as the client's
 * wall time includes it; 0 on failure. */
static double local_rate(struct local *l, int n_tok)
{
    char err[MODEL_ERR_LEN];
    struct gen_params gp;
    gen_params_default(&gp);
    gp.max_new_tokens = n_tok;
    gp.ignore_eos = true;
    struct gen_result res = {0};
    double rate = 0;
    if (generate(l->rt.m, l->rt.tok, l->rt.store, l->ids.ids, l->ids.n, &gp, NULL, NULL, &res, err) == MODEL_OK)
        rate = res.seq.gen / ((res.prefill_ms + res.decode_ms) / 1e3);
    else
        fprintf(stderr, "kvtierd-bench: %s\n", err);
    gen_seq_free(&res.seq);
    return rate;
}

/* Median of x[0..n) (sorts a copy); n <= MAX_REPS. */
static double median(const double *x, int n)
{
    double c[MAX_REPS];
    memcpy(c, x, (size_t)n * sizeof(*c));
    return median_sort(c, n);
}

int main(int argc, char **argv)
{
    if (version_requested(argc, argv, "kvtierd-bench"))
        return 0;
    const char *sock = NULL, *prompt = "In the beginning", *model_dir = NULL;
    int n_tok = 128, threads = 0, reps = 5, c, counts[MAX_COUNTS] = {1, 4, 16}, n_counts = 3;
    static const struct option opts[] = {{"socket", required_argument, 0, 's'}, {"clients", required_argument, 0, 'c'},
                                         {"prompt", required_argument, 0, 'p'}, {"model", required_argument, 0, 'm'},
                                         {"threads", required_argument, 0, 't'}, {"reps", required_argument, 0, 'r'},
                                         {0, 0, 0, 0}};
    while ((c = getopt_long(argc, argv, "n:", opts, NULL)) != -1) {
        bool ok = true;
        switch (c) {
        case 's': sock = optarg; break;
        case 'c': ok = args_int_list(optarg, 1, 1024, counts, MAX_COUNTS, &n_counts); break;
        case 'p': prompt = optarg; break;
        case 'm': model_dir = optarg; break;
        case 't': ok = args_int(optarg, 0, 1024, &threads); break;
        case 'n': ok = args_int(optarg, 1, 1 << 24, &n_tok); break;
        case 'r': ok = args_int(optarg, 1, MAX_REPS, &reps); break;
        default: sock = NULL, optind = argc + 1;
        }
        if (!ok)
            return args_invalid("kvtierd-bench", opts, c, optarg);
    }
    if (!sock || optind != argc) {
        fprintf(stderr, "usage: kvtierd-bench --socket PATH [--clients 1,4,16] [-n TOKENS] [--reps 1-%d] "
                        "[--prompt TEXT] [--model DIR [--threads N]]\n", MAX_REPS);
        return 2;
    }
    struct kvtier_params gen = {.max_tokens = n_tok, .temperature = 0, .extra_json = "{\"ignore_eos\":true}"};
    struct local l;
    bool with_local = model_dir && local_open(&l, model_dir, threads, prompt);
    if (model_dir && !with_local)
        return 1;
    /* Repetitions interleave every measurement, so a load change on the
     * machine hits all of them alike; ratios are taken within a repetition. */
    static double agg[MAX_REPS][MAX_COUNTS], ttft[MAX_REPS][MAX_COUNTS], per[MAX_REPS][MAX_COUNTS];
    static double cpu[MAX_REPS][MAX_COUNTS]; /* daemon CPU ms per generated token */
    double inproc[MAX_REPS], streamed[MAX_REPS], overhead[MAX_REPS];
    pid_t pid = daemon_pid(sock);
    int rc = 0;
    for (int r = 0; r < reps && !rc; r++) {
        for (int k = 0; k < n_counts && !rc; k++) {
            double c0 = cpu_seconds(pid);
            if ((agg[r][k] = round_of(sock, prompt, &gen, counts[k], &ttft[r][k], &per[r][k])) <= 0)
                rc = 1;
            cpu[r][k] = (cpu_seconds(pid) - c0) * 1e3 / ((double)counts[k] * n_tok);
        }
        if (with_local && !rc) {
            double t;
            inproc[r] = local_rate(&l, n_tok);
            streamed[r] = round_of(sock, prompt, &gen, 1, &t, &t);
            rc = inproc[r] <= 0 || streamed[r] <= 0;
            overhead[r] = rc ? 0 : inproc[r] / streamed[r] - 1;
        }
        fprintf(stderr, "kvtierd-bench: repetition %d of %d done\n", r + 1, reps);
    }
    if (!rc) {
        printf("%d repetitions, medians; the ratio is the median of each repetition's ratio to %d client(s)\n\n",
               reps, counts[0]);
        printf("| clients | aggregate tok/s | per client tok/s | mean TTFT ms | vs %d | ratio range "
               "| daemon CPU ms/token | tokens per CPU-s vs %d |\n|---|---|---|---|---|---|---|---|\n", counts[0],
               counts[0]);
        for (int k = 0; k < n_counts; k++) {
            double a[MAX_REPS], p[MAX_REPS], t[MAX_REPS], ratio[MAX_REPS], cms[MAX_REPS], gain[MAX_REPS];
            double lo = 1e300, hi = 0;
            bool cpu_ok = pid > 0; /* rounds shorter than the clock tick read 0 */
            for (int r = 0; r < reps; r++) {
                cpu_ok = cpu_ok && cpu[r][0] > 0 && cpu[r][k] > 0;
                a[r] = agg[r][k], p[r] = per[r][k], t[r] = ttft[r][k] * 1e3, cms[r] = cpu[r][k];
                ratio[r] = agg[r][k] / agg[r][0];
                gain[r] = cpu[r][0] / cpu[r][k];
                lo = ratio[r] < lo ? ratio[r] : lo;
                hi = ratio[r] > hi ? ratio[r] : hi;
            }
            printf("| %d | %.2f | %.2f | %.0f | %.2fx | %.2f-%.2f | ", counts[k], median(a, reps), median(p, reps),
                   median(t, reps), median(ratio, reps), lo, hi);
            if (cpu_ok)
                printf("%.1f | %.2fx |\n", median(cms, reps), median(gain, reps));
            else
                printf("- | - |\n");
        }
    }
    if (with_local && !rc) {
        double lo = 1e300, hi = -1e300;
        for (int r = 0; r < reps; r++) {
            lo = overhead[r] < lo ? overhead[r] : lo;
            hi = overhead[r] > hi ? overhead[r] : hi;
        }
        printf("\nin-process generate(): %.2f tok/s; one streamed client: %.2f tok/s (medians); "
               "overhead (median of each repetition's in-process/streamed - 1): %.1f %% (range %.1f to %.1f %%)\n",
               median(inproc, reps), median(streamed, reps), median(overhead, reps) * 100, lo * 100, hi * 100);
    }
    if (with_local)
        local_close(&l);
    return rc;
}
