/* kvtier-bench-remote - the remote tier's lookup throughput against what
 * redis-benchmark gets from the same server for the same value size:
 *
 *   kvtier-bench-remote --remote unix:PATH|redis://HOST:PORT [--blocks 512] [--rounds 5]
 *                       [--compress] [--no-redis-benchmark]
 *
 * Publishes a chain of --blocks synthetic blocks of the TinyLlama-1.1B KV
 * shape (22 layers, 4 KV heads, head_dim 64, bf16, 16 tokens: 360 KiB
 * each, bf16-like bytes) through the tier, then per round looks the whole
 * chain up (kv_remote_fetch: pipelined GETEX, every value checked) and
 * runs `redis-benchmark -t get -P 32 -c 1` with the same value size on the
 * same server, alternately.  Prints each round, the best and the medians:
 * MB/s of values, CPU milliseconds per MB (this process during a lookup,
 * redis-benchmark's client), and their ratios.  The model and the store are not involved: this
 * is the lookup thread alone (what kvtier_remote_lookup_seconds_total
 * measures in the daemon).
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sys/resource.h>

#include "tiers/remote.h"
#include "util/args.h"
#include "util/clock.h"
#include "util/median.h"

#define MAX_ROUNDS 64

static int die(const char *msg)
{
    fprintf(stderr, "kvtier-bench-remote: %s\n", msg);
    return 1;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* CPU seconds of this process, or of its waited-for children */
static double cpu_s(int who)
{
    struct rusage ru;
    getrusage(who, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_stime.tv_sec +
           ((double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_usec) / 1e6;
}

/* redis-benchmark's GET requests per second ("GET","rps",... in --csv), 0 if it did not run. */
static double redis_benchmark(const char *cmd)
{
    FILE *p = popen(cmd, "r");
    if (!p)
        return 0;
    char line[512];
    double rps = 0;
    while (fgets(line, sizeof(line), p))
        if (!strncmp(line, "\"GET\",\"", 7))
            rps = strtod(line + 7, NULL);
    pclose(p);
    return rps;
}

/* The address as redis-benchmark takes it. */
static void rb_target(const char *url, char *out, size_t cap)
{
    if (!strncmp(url, "unix:", 5)) {
        snprintf(out, cap, "-s '%s'", url + 5);
        return;
    }
    char host[256] = "127.0.0.1";
    int port = 6379;
    sscanf(url, "redis://%255[^:/]:%d", host, &port);
    snprintf(out, cap, "-h '%s' -p %d", host, port);
}

int main(int argc, char **argv)
{
    const char *url = NULL;
    int n_blocks = 512, rounds = 5;
    bool compress = false, rb = true;
    static const struct option opts[] = {{"remote", required_argument, 0, 'r'},
                                         {"blocks", required_argument, 0, 'b'},
                                         {"rounds", required_argument, 0, 'n'},
                                         {"compress", no_argument, 0, 'z'},
                                         {"no-redis-benchmark", no_argument, 0, 'R'},
                                         {0, 0, 0, 0}};
    for (int c; (c = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
        bool ok = true;
        switch (c) {
        case 'r': url = optarg; break;
        case 'b': ok = args_int(optarg, 1, 1 << 16, &n_blocks); break;
        case 'n': ok = args_int(optarg, 1, MAX_ROUNDS, &rounds); break;
        case 'z': compress = true; break;
        case 'R': rb = false; break;
        default: ok = false;
        }
        if (!ok)
            return die("usage: kvtier-bench-remote --remote URL [--blocks N] [--rounds N] [--compress] "
                       "[--no-redis-benchmark]");
    }
    if (!url)
        return die("--remote is required");
    /* TinyLlama-1.1B's KV block: 22 layers x K,V x 4 heads x 64 x 16 tokens of bf16, plus the entry's header and ids */
    const size_t block = 22 * 2 * 4 * 64 * 16 * 2 + 88 + 16 * 4;
    struct kv_remote_params p = {.url = url,
                                 .timeout_ms = 5000,
                                 .ttl_s = 3600,
                                 .queue_bytes = (size_t)256 << 20,
                                 .compress = compress,
                                 .block_bytes = block,
                                 .layout = {0x6b76746965726265ull ^ (uint64_t)clock_ms(), 2, 16, 22, 4, 64},
                                 .variant = "bench"};
    kv_remote *r;
    char err[256];
    if (kv_remote_open(&p, &r, err) != TIER_OK)
        return die(err[0] ? err : "cannot open the tier");
    uint64_t *hashes = malloc((size_t)n_blocks * sizeof(*hashes));
    if (!hashes)
        return die("out of memory");
    double t0 = clock_ms();
    for (int i = 0; i < n_blocks; i++) {
        hashes[i] = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
        uint16_t *v = malloc(block);
        if (!v)
            return die("out of memory");
        /* bf16 of values around +-1: a sign and exponent that repeat, a noisy mantissa */
        uint64_t x = hashes[i];
        for (size_t k = 0; k < block / 2; k++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            v[k] = (uint16_t)(0x3f00 | (x & 0x80ff) | ((x >> 20) & 0x0080));
        }
        struct kv_prefix_block b = {.buf = v, .len = block, .ns = 1, .hash = hashes[i]};
        while (kv_remote_publish_room(r) < block)
            sleep_ms(1);
        if (!kv_remote_publish(r, &b))
            return die("publish queue refused a block");
    }
    while (kv_remote_stats(r).published < (uint64_t)n_blocks) {
        struct kv_remote_stats s = kv_remote_stats(r);
        uint64_t bad = 0;
        for (int e = 0; e < KV_REMOTE_N_ERR; e++)
            bad += s.errors[e];
        if (bad)
            return die("publishing failed (see the log above)");
        sleep_ms(5);
    }
    struct kv_remote_stats s0 = kv_remote_stats(r);
    double stored = (double)s0.bytes_out / n_blocks;
    printf("published %d blocks of %zu bytes (%.0f bytes stored each%s) in %.2f s\n", n_blocks, block, stored,
           compress ? ", zstd" : "", (clock_ms() - t0) / 1e3);
    char target[512], cmd[1024];
    rb_target(url, target, sizeof(target));
    if (rb) {
        snprintf(cmd, sizeof(cmd), "redis-benchmark %s -t set -n 1 -d %.0f --csv >/dev/null 2>&1", target, stored);
        if (system(cmd) != 0)
            rb = false;
    }
    double mine[MAX_ROUNDS], theirs[MAX_ROUNDS], mine_cpu[MAX_ROUNDS], theirs_cpu[MAX_ROUNDS];
    for (int k = 0; k < rounds; k++) {
        struct kv_remote_stats a = kv_remote_stats(r);
        double t = clock_ms(), c0 = cpu_s(RUSAGE_SELF);
        kv_remote_fetch *f;
        if (kv_remote_fetch_start(r, 1, hashes, n_blocks, &f) != TIER_OK)
            return die("fetch_start failed");
        kv_remote_fetch_wait(f);
        double ms = clock_ms() - t;
        /* only the lookup thread runs meanwhile: its CPU per MB is what the load moves least */
        mine_cpu[k] = (cpu_s(RUSAGE_SELF) - c0) * 1e3 / ((double)n_blocks * stored / 1e6);
        int found = kv_remote_fetch_found(f);
        kv_remote_fetch_free(f);
        struct kv_remote_stats b = kv_remote_stats(r);
        if (found != n_blocks)
            return die("a lookup missed blocks it published");
        mine[k] = (double)(b.bytes_in - a.bytes_in) / 1e3 / ms;
        theirs[k] = theirs_cpu[k] = 0;
        if (rb) {
            int n_get = n_blocks * 4;
            snprintf(cmd, sizeof(cmd), "redis-benchmark %s -t get -n %d -d %.0f -P 32 -c 1 --csv 2>/dev/null", target,
                     n_get, stored);
            double cc = cpu_s(RUSAGE_CHILDREN);
            theirs[k] = redis_benchmark(cmd) * stored / 1e6;
            theirs_cpu[k] = (cpu_s(RUSAGE_CHILDREN) - cc) * 1e3 / ((double)n_get * stored / 1e6);
        }
        printf("round %d: kvtier lookup %d blocks in %.0f ms: %.0f MB/s, %.2f CPU ms/MB; redis-benchmark GET -P 32 -c "
               "1: %.0f MB/s, %.2f CPU ms/MB\n",
               k + 1, found, ms, mine[k], mine_cpu[k], theirs[k], theirs_cpu[k]);
    }
    double best_m = 0, best_t = 0;
    for (int k = 0; k < rounds; k++) {
        best_m = mine[k] > best_m ? mine[k] : best_m;
        best_t = theirs[k] > best_t ? theirs[k] : best_t;
    }
    printf("best: kvtier %.0f MB/s, redis-benchmark %.0f MB/s, ratio %.2f\n", best_m, best_t,
           best_t > 0 ? best_m / best_t : 0);
    double m = median_sort(mine, rounds), t = median_sort(theirs, rounds);
    double mc = median_sort(mine_cpu, rounds), tc = median_sort(theirs_cpu, rounds);
    printf("median: kvtier %.0f MB/s (%.2f CPU ms/MB), redis-benchmark %.0f MB/s (%.2f CPU ms/MB); throughput ratio "
           "%.2f, CPU per MB ratio %.2f\n",
           m, mc, t, tc, t > 0 ? m / t : 0, tc > 0 ? mc / tc : 0);
    free(hashes);
    kv_remote_free(r);
    return 0;
}
