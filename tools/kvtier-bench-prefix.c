/* kvtier-bench-prefix - what the prefix cache and copy-on-write forks buy,
 * measured in one run so the figures are ratios:
 *
 *   kvtier-bench-prefix -m DIR [--prefix 2048[,N...]] [--suffix 16] [--forks 64] [--threads N]
 *                       [--block-tokens N] [--kv-dtype auto|f32|bf16|f16] [--csv FILE]
 *
 * TTFT: time from a request's tokens to its first logits, cold (the whole
 * prompt computed) vs warm (the same prefix attached from the cache, only
 * the suffix computed), best of three each, for every prefix length given.
 * Forks: KV bytes held by N forks of the last prefix, each after one decode
 * step, against one session.  --csv FILE also writes the TTFT figures, one
 * row per prefix length (util/csvout.h), for `make plots`.
 */
#include <errno.h>
#include <getopt.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "util/args.h"
#include "util/clock.h"
#include "util/csvout.h"
#include "model/model.h"
#include "util/version.h"

static int die(const char *what, const char *msg)
{
    fprintf(stderr, "kvtier-bench-prefix: %s: %s\n", what, msg);
    return 1;
}

/* One request: a fresh sequence, the cache match, the forward pass of the
 * rest; returns the seconds to the logits and leaves the sequence in *out. */
static double request(model *m, kv_store *st, const int32_t *ids, int n, float *row, kv_seq **out, int64_t *cached)
{
    double t0 = clock_s();
    if (kv_seq_create(st, NULL, out) != TIER_OK || kv_seq_match_prefix(*out, ids, n, cached) != TIER_OK)
        return -1;
    struct fw_seq fs = {.kv = *out, .tokens = ids + *cached, .n_tokens = n - (int)*cached, .logits = row};
    if (model_forward(m, &fs, 1) != MODEL_OK)
        return -1;
    return clock_s() - t0;
}

int main(int argc, char **argv)
{
    if (version_requested(argc, argv, "kvtier-bench-prefix"))
        return 0;
    const char *dir = NULL;
    int prefixes[16] = {2048}, n_prefix = 1, suffix = 16, forks = 64, threads = 0;
    const char *csv_path = NULL;
    struct kv_store_params sp = {.prefix_cache = true};
    static const struct option opts[] = {{"prefix", 1, 0, 'p'},  {"suffix", 1, 0, 's'},
                                         {"forks", 1, 0, 'f'},   {"threads", 1, 0, 't'},
                                         {"block-tokens", 1, 0, 'b'}, {"kv-dtype", 1, 0, 'k'},
                                         {"csv", 1, 0, 'C'},          {0, 0, 0, 0}};
    struct model_params mp = {0};
    for (int c; (c = getopt_long(argc, argv, "m:", opts, NULL)) != -1;) {
        bool ok = true;
        switch (c) {
        case 'm': dir = optarg; break;
        case 'p': ok = args_int_list(optarg, 1, 1 << 24, prefixes, 16, &n_prefix); break;
        case 's': ok = args_int(optarg, 1, 1 << 24, &suffix); break;
        case 'f': ok = args_int(optarg, 1, 1 << 16, &forks); break;
        case 't': ok = args_int(optarg, 0, 1024, &threads); break;
        case 'b': ok = args_int(optarg, 1, 1 << 16, &sp.block_tokens); break;
        case 'k': ok = model_kv_dtype_parse(optarg, &mp.kv_dtype); break;
        case 'C': csv_path = optarg; break;
        default: return 2;
        }
        if (!ok)
            return args_invalid("kvtier-bench-prefix", opts, c, optarg);
    }
    if (!dir || optind != argc) {
        fprintf(stderr, "usage: kvtier-bench-prefix -m DIR [--prefix N[,N...]] [--suffix N] [--forks N] [--threads N] "
                        "[--block-tokens N] [--kv-dtype auto|f32|bf16|f16] [--csv FILE]\n");
        return 2;
    }
    FILE *csv = NULL;
    static const char *const header = "prefix_tokens,suffix_tokens,cached_tokens,ttft_cold_ms,ttft_warm_ms";
    if (csv_path && !(csv = csv_open(csv_path, argc, argv, header))) {
        fprintf(stderr, "kvtier-bench-prefix: %s: %s\n", csv_path, strerror(errno));
        return 1;
    }
    int prefix = 0;
    for (int i = 0; i < n_prefix; i++)
        prefix = prefixes[i] > prefix ? prefixes[i] : prefix;
    be_backend *be;
    model *m;
    kv_store *st;
    char err[MODEL_ERR_LEN];
    if (be_open("cpu", &(struct be_params){.n_threads = threads}, &be) != BE_OK)
        return die("backend", "cannot open cpu");
    if (model_load(dir, be, &mp, &m, err) != MODEL_OK)
        return die(dir, err);
    struct kv_geom g = model_kv_geom(m);
    if (kv_store_open(be, &g, &sp, &st) != TIER_OK)
        return die("store", "cannot open");
    const struct model_config *c = model_get_config(m);
    int n = prefix + suffix;
    int32_t *ids = malloc((size_t)n * sizeof(int32_t));
    float *row = malloc((size_t)c->vocab_size * sizeof(float));
    kv_seq **kids = calloc((size_t)forks, sizeof(*kids));
    if (!ids || !row || !kids)
        return die("memory", "out of host memory");
    for (int p = 0; p < n_prefix; p++) {
        int np = prefixes[p] + suffix;
        double cold = 1e30, warm = 1e30;
        int64_t cached = 0;
        for (int round = 0; round < 3; round++) {
            /* a new prefix every round and length: the cold run finds nothing */
            unsigned seed = (unsigned)(p * 3 + round) * 97u;
            for (int i = 0; i < np; i++)
                ids[i] = (int32_t)((i * 2654435761u + seed) % (unsigned)c->vocab_size);
            kv_seq *a, *b;
            double t = request(m, st, ids, np, row, &a, &cached);
            if (t < 0 || cached)
                return die("cold request", kv_store_errmsg(st));
            cold = t < cold ? t : cold;
            kv_seq_free(a);
            for (int i = prefixes[p]; i < np; i++) /* same prefix, another suffix */
                ids[i] = (ids[i] + 1) % c->vocab_size;
            t = request(m, st, ids, np, row, &b, &cached);
            if (t < 0)
                return die("warm request", kv_store_errmsg(st));
            warm = t < warm ? t : warm;
            kv_seq_free(b);
        }
        printf("model %s: %d layers, %d kv heads x %d, prefix %d + suffix %d tokens, block %d, KV %s\n", dir,
               c->n_layers, c->n_kv_heads, c->head_dim, prefixes[p], suffix, kv_store_block_tokens(st),
               be_dtype_name(kv_store_dtype(st)));
        printf("TTFT cold %.2f ms, warm (%lld tokens cached) %.2f ms: %.1fx\n", cold * 1e3, (long long)cached,
               warm * 1e3, cold / warm);
        if (csv)
            fprintf(csv, "%d,%d,%lld,%.3f,%.3f\n", prefixes[p], suffix, (long long)cached, cold * 1e3, warm * 1e3);
    }
    if (csv && !csv_close(csv)) {
        fprintf(stderr, "kvtier-bench-prefix: %s: %s\n", csv_path, strerror(errno));
        return 1;
    }
    /* the forks share the last prefix (the ids of its last round) */
    prefix = prefixes[n_prefix - 1];

    kv_seq *parent;
    int64_t dummy;
    if (request(m, st, ids, prefix, row, &parent, &dummy) < 0)
        return die("fork parent", kv_store_errmsg(st));
    size_t one = kv_seq_bytes(parent);
    int32_t next = 1;
    for (int k = 0; k < forks; k++) {
        struct fw_seq fs = {.tokens = &next, .n_tokens = 1, .logits = row};
        if (kv_seq_fork(parent, &kids[k]) != TIER_OK)
            return die("fork", kv_store_errmsg(st));
        fs.kv = kids[k];
        if (model_forward(m, &fs, 1) != MODEL_OK)
            return die("fork decode", kv_store_errmsg(st));
    }
    struct kv_store_stats ss = kv_store_stats(st);
    /* blocks held by sequences: the pool's in-use blocks less the earlier
     * rounds' cached ones that nothing references */
    size_t block = one / (size_t)((prefix + kv_store_block_tokens(st) - 1) / kv_store_block_tokens(st)) / (size_t)c->n_layers;
    size_t used = (size_t)(ss.blocks_used - ss.prefix_evictable * (uint64_t)c->n_layers) * block;
    printf("%d forks after one decode step each: %.1f MiB of KV vs %.1f MiB for one session: %.3fx (deep copies: %dx)\n",
           forks, (double)used / 1048576.0, (double)one / 1048576.0, (double)used / (double)one,
           forks + 1);
    for (int k = 0; k < forks; k++)
        kv_seq_free(kids[k]);
    kv_seq_free(parent);
    free(kids);
    free(ids);
    free(row);
    kv_store_free(st);
    model_free(m);
    be_free(be);
    return 0;
}
