/* kvtier-bench-wq - the matmul of the weight formats (bf16, Q8_0, Q4_K)
 * at each SIMD level, for decode (a few tokens) or a prefill batch, in
 * CPU time, so that the ratios hold on a shared machine where wall-clock
 * figures do not.
 *
 *   kvtier-bench-wq [--in 2048] [--out 22528] [--tokens 1] [--rounds 5] [--calls 20]
 *
 * One matrix of out x in random weights (the default: four TinyLlama
 * gate/up matrices' worth, 92 MB of bf16, far past the last-level cache)
 * in each format, times --tokens activation rows, on a one-thread CPU
 * backend per SIMD level the CPU has (KVTIER_SIMD).  Each round runs every
 * (level, format) pair in a rotated order, each --calls times, and keeps
 * the best call by the thread's CPU time (CLOCK_THREAD_CPUTIME_ID: time
 * the thread spent descheduled does not count; other tenants' use of the
 * memory bus still does).  Prints per pair the median over rounds of
 * those best calls, the weight bytes they streamed per CPU second, and
 * the median of the per-round ratios of bf16's time at the same level to
 * the pair's (> 1: faster than bf16).
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "util/args.h"
#include "util/half.h"
#include "util/q4k.h"
#include "util/q8.h"
#include "util/version.h"
#include "util/median.h"

enum { N_FMT = 3, MAX_LEVELS = 5, MAX_ROUNDS = 101 };
static const char *const LEVELS[MAX_LEVELS] = {"scalar", "avx2", "avx512", "avx512vnni", "avx512bf16"};
static const enum be_dtype FMTS[N_FMT] = {BE_BF16, BE_Q8_0, BE_Q4_K};

static double cpu_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static be_backend *open_level(const char *simd)
{
    be_backend *be = NULL;
    struct be_params p = {.n_threads = 1};
    setenv("KVTIER_SIMD", simd, 1);
    enum be_status st = be_open("cpu", &p, &be);
    unsetenv("KVTIER_SIMD");
    return st == BE_OK ? be : NULL;
}

int main(int argc, char **argv)
{
    if (version_requested(argc, argv, "kvtier-bench-wq"))
        return 0;
    int in = 2048, out = 22528, tokens = 1, rounds = 5, calls = 20;
    static const struct option opts[] = {
        {"in", required_argument, 0, 'i'},     {"out", required_argument, 0, 'o'},
        {"tokens", required_argument, 0, 't'}, {"rounds", required_argument, 0, 'r'},
        {"calls", required_argument, 0, 'c'},  {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    int c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        bool ok = true;
        switch (c) {
        case 'i': ok = args_int(optarg, Q4_K_BLOCK, 1 << 20, &in) && in % Q4_K_BLOCK == 0; break;
        case 'o': ok = args_int(optarg, 1, 1 << 22, &out); break;
        case 't': ok = args_int(optarg, 1, 4096, &tokens); break;
        case 'r': ok = args_int(optarg, 1, MAX_ROUNDS, &rounds); break;
        case 'c': ok = args_int(optarg, 1, 100000, &calls); break;
        default:
            fprintf(c == 'h' ? stdout : stderr,
                    "usage: kvtier-bench-wq [--in N (multiple of 256)] [--out N] [--tokens 1..4096] [--rounds N] "
                    "[--calls N]\n");
            return c == 'h' ? 0 : 2;
        }
        if (!ok)
            return args_invalid("kvtier-bench-wq", opts, c, optarg);
    }
    size_t n = (size_t)in * (size_t)out;
    float *w = malloc(n * sizeof *w), *x = malloc((size_t)tokens * in * sizeof *x);
    float *y = malloc((size_t)tokens * out * sizeof *y);
    void *data[N_FMT] = {malloc(n * 2), malloc(be_row_bytes(BE_Q8_0, n)), malloc(be_row_bytes(BE_Q4_K, n))};
    if (!w || !x || !y || !data[0] || !data[1] || !data[2]) {
        fprintf(stderr, "kvtier-bench-wq: out of memory for a %d x %d matrix\n", out, in);
        return 1;
    }
    uint64_t s = 0x9e3779b97f4a7c15u;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005u + 1442695040888963407u;
        w[i] = ((float)(s >> 40) / (float)(1u << 24) - 0.5f) * 0.1f;
        ((uint16_t *)data[0])[i] = f32_to_bf16(w[i]);
    }
    for (size_t i = 0; i < (size_t)tokens * in; i++)
        x[i] = (float)(i % 17) - 8.0f;
    if (!q8_0_quantize(w, data[1], n) || !q4_k_quantize(w, data[2], n)) {
        fprintf(stderr, "kvtier-bench-wq: quantizing failed\n");
        return 1;
    }
    free(w);

    be_backend *be[MAX_LEVELS];
    int nl = 0, lv[MAX_LEVELS];
    for (int l = 1; l < MAX_LEVELS; l++) /* scalar is the reference, not a contender */
        if ((be[nl] = open_level(LEVELS[l])))
            lv[nl++] = l;
    if (!nl) {
        fprintf(stderr, "kvtier-bench-wq: no SIMD level on this CPU\n");
        return 1;
    }
    static double best[MAX_LEVELS][N_FMT][MAX_ROUNDS];
    int pairs = nl * N_FMT;
    for (int r = 0; r < rounds; r++)
        for (int k = 0; k < pairs; k++) {
            int p = (k + r) % pairs, l = p / N_FMT, f = p % N_FMT;
            double b = 1e30;
            for (int i = 0; i < calls; i++) {
                double t0 = cpu_seconds();
                enum be_status st = be_matmul(be[l], y, BE_F32, x, data[f], FMTS[f], NULL, tokens, in, out);
                double t = cpu_seconds() - t0;
                if (st != BE_OK) {
                    fprintf(stderr, "kvtier-bench-wq: be_matmul: %s\n", be_strerror(st));
                    return 1;
                }
                b = t < b ? t : b;
            }
            best[l][f][r] = b;
        }
    printf("matmul %d x %d, %d token(s), 1 thread, %d rounds of %d calls, best call per round by thread CPU time\n",
           out, in, tokens, rounds, calls);
    printf("%-11s %-5s %10s %12s %9s\n", "level", "fmt", "ms/call", "GB/CPU-s", "vs bf16");
    for (int l = 0; l < nl; l++)
        for (int f = 0; f < N_FMT; f++) {
            double ratio[MAX_ROUNDS], t[MAX_ROUNDS];
            for (int r = 0; r < rounds; r++) {
                ratio[r] = best[l][0][r] / best[l][f][r];
                t[r] = best[l][f][r];
            }
            double tm = median_sort(t, rounds);
            printf("%-11s %-5s %10.3f %12.1f %9.2f\n", LEVELS[lv[l]], be_dtype_name(FMTS[f]), tm * 1e3,
                   (double)(size_t)out * (double)be_row_bytes(FMTS[f], (size_t)in) / tm / 1e9, median_sort(ratio, rounds));
        }
    for (int l = 0; l < nl; l++)
        be_free(be[l]);
    for (int f = 0; f < N_FMT; f++)
        free(data[f]);
    free(x);
    free(y);
    return 0;
}
