/* kvtier-bench-tiers - decode speed with the KV resident on the device,
 * streamed from the host tier (offloaded) and split by adaptive residency,
 * at several context lengths, measured in one run so that the figures are
 * ratios that survive a noisy machine:
 *
 *   kvtier-bench-tiers -m DIR [--ctx 1024,4096,16384] [--decode 8] [--repeat 2] [--threads N]
 *                      [--block-tokens N] [--kv-dtype auto|f32|bf16|f16]... [--csv FILE] [--backend cpu|cuda]
 *                      [--device-mem BYTES]
 *
 * For each context the three sequences are filled to that length and then
 * decode --decode tokens each, interleaved, over --repeat rounds.  The
 * context is reserved and committed without computing it: a decode step's
 * work does not depend on the values in its KV.  Adaptive runs on a second
 * backend whose device budget holds the activations, two slots and half of
 * the layers' KV.  Reported per mode: tokens/s (median and best of the
 * rounds) and the ratio of the medians to resident; for streamed modes
 * overlap = 1 - stall / transfer and the bytes moved per token against the
 * KV bytes the step reads (of the best round).
 *
 * --kv-dtype given more than once runs every mode once per KV dtype in
 * each round, in an order rotated round by round, and reports each later
 * dtype's tokens/s as the median (and range) of its per-round ratios to
 * the first's.  --csv FILE also writes one row per context, mode and KV
 * dtype (util/csvout.h) for `make plots`.  --backend cuda runs it on the
 * GPU; give --device-mem there (the resident backend's budget), since the
 * CUDA default takes the device's free memory and leaves none for the
 * adaptive one.
 */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util/args.h"
#include "util/clock.h"
#include "util/csvout.h"
#include "model/model.h"
#include "util/version.h"
#include "util/median.h"

enum { RESIDENT, OFFLOADED, ADAPTIVE, N_MODES };
enum { MAX_DTYPES = 4, MAX_ROUNDS = 1000 };
static const char *const mode_name[N_MODES] = {"resident", "offloaded", "adaptive"};

struct rig {
    be_backend *be;
    model *m;
    kv_store *store;
};

static const char *backend = "cpu";

static int rig_open(struct rig *r, const char *dir, int threads, size_t device_mem, int block_tokens,
                    enum model_kv_dtype kv_dtype)
{
    char err[MODEL_ERR_LEN];
    struct be_params bp = {.n_threads = threads, .device_mem = device_mem};
    enum be_status bs = be_open(backend, &bp, &r->be);
    if (bs != BE_OK) {
        fprintf(stderr, "kvtier-bench-tiers: --backend %s: %s\n", backend, *be_open_error() ? be_open_error()
                                                                                              : be_strerror(bs));
        return -1;
    }
    struct model_params mp = {.max_batch_tokens = 16, .kv_dtype = kv_dtype};
    enum model_status st = model_load(dir, r->be, &mp, &r->m, err);
    if (st != MODEL_OK) {
        fprintf(stderr, "kvtier-bench-tiers: %s: %s\n", model_strerror(st), err);
        return -1;
    }
    struct kv_geom g = model_kv_geom(r->m);
    struct kv_store_params sp = {.block_tokens = block_tokens};
    return kv_store_open(r->be, &g, &sp, &r->store) == TIER_OK ? 0 : -1;
}

static void rig_close(struct rig *r)
{
    kv_store_free(r->store);
    model_free(r->m);
    be_free(r->be);
}

/* A sequence holding ctx tokens whose KV was never computed. */
static kv_seq *filled(struct rig *r, const struct kv_seq_params *p, int ctx)
{
    kv_seq *q;
    enum tier_status st = kv_seq_create(r->store, p, &q);
    if (st == TIER_OK && (st = kv_seq_reserve(q, ctx)) == TIER_OK)
        kv_seq_commit(q);
    if (st != TIER_OK) {
        fprintf(stderr, "kvtier-bench-tiers: filling %d tokens: %s: %s\n", ctx, tier_strerror(st),
                kv_store_errmsg(r->store));
        kv_seq_free(q);
        return NULL;
    }
    return q;
}

struct result {
    double tps;
    struct kv_xfer_stats x; /* of the timed steps */
};

static double median(const double *v, int n)
{
    double s[MAX_ROUNDS];
    memcpy(s, v, (size_t)n * sizeof(*v));
    return median_sort(s, n);
}

/* One warm-up step (slots, caches), then n timed decode steps: their
 * tokens/s is returned (< 0 on failure), the best round kept in *out. */
static double decode(struct rig *r, kv_seq *q, int n, float *logits, struct result *out)
{
    int32_t tok = 7;
    struct fw_seq fs = {.kv = q, .tokens = &tok, .n_tokens = 1, .logits = logits};
    if (model_forward(r->m, &fs, 1) != MODEL_OK)
        return -1;
    struct kv_xfer_stats x0 = kv_seq_stats(q).xfer;
    double t0 = clock_s();
    for (int i = 0; i < n; i++) {
        tok = (int32_t)(i * 31 + 11) % model_get_config(r->m)->vocab_size;
        if (model_forward(r->m, &fs, 1) != MODEL_OK)
            return -1;
    }
    double t = clock_s() - t0;
    struct kv_xfer_stats x1 = kv_seq_stats(q).xfer;
    struct result res = {.tps = n / t};
    res.x = (struct kv_xfer_stats){
        .steps = x1.steps - x0.steps,
        .tokens = x1.tokens - x0.tokens,
        .bytes_h2d = x1.bytes_h2d - x0.bytes_h2d,
        .bytes_d2h = x1.bytes_d2h - x0.bytes_d2h,
        .transfer_s = x1.transfer_s - x0.transfer_s,
        .stall_s = x1.stall_s - x0.stall_s,
        .compute_s = x1.compute_s - x0.compute_s,
    };
    if (res.tps > out->tps)
        *out = res;
    return res.tps;
}

int main(int argc, char **argv)
{
    if (version_requested(argc, argv, "kvtier-bench-tiers"))
        return 0;
    const char *dir = NULL;
    int ctxs[16] = {1024, 4096, 16384}, n_ctx = 3, n_decode = 8, repeat = 2, threads = 0, block_tokens = 0;
    size_t device_mem = 0;
    enum model_kv_dtype kdts[MAX_DTYPES] = {MODEL_KV_AUTO};
    int n_dt = 0;
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},   {"ctx", required_argument, 0, 'c'},
        {"decode", required_argument, 0, 'd'},  {"repeat", required_argument, 0, 'r'},
        {"threads", required_argument, 0, 't'}, {"block-tokens", required_argument, 0, 'b'},
        {"kv-dtype", required_argument, 0, 'k'}, {"csv", required_argument, 0, 'C'},
        {"backend", required_argument, 0, 'B'}, {"device-mem", required_argument, 0, 'M'},
        {0, 0, 0, 0},
    };
    const char *csv_path = NULL;
    int o;
    while ((o = getopt_long(argc, argv, "m:c:d:r:t:b:k:", opts, NULL)) != -1) {
        bool ok = true;
        switch (o) {
        case 'm': dir = optarg; break;
        case 'c': ok = args_int_list(optarg, 1, 1 << 24, ctxs, 16, &n_ctx); break;
        case 'd': ok = args_int(optarg, 1, 1 << 20, &n_decode); break;
        case 'r': ok = args_int(optarg, 1, MAX_ROUNDS, &repeat); break;
        case 't': ok = args_int(optarg, 0, 1024, &threads); break;
        case 'b': ok = args_int(optarg, 1, 1 << 16, &block_tokens); break;
        case 'k': ok = n_dt < MAX_DTYPES && model_kv_dtype_parse(optarg, &kdts[n_dt++]); break;
        case 'C': csv_path = optarg; break;
        case 'B': backend = optarg; break;
        case 'M': ok = args_size(optarg, &device_mem); break;
        default: return 2;
        }
        if (!ok)
            return args_invalid("kvtier-bench-tiers", opts, o, optarg);
    }
    if (!dir || optind != argc) {
        fprintf(stderr, "usage: kvtier-bench-tiers -m DIR [--ctx 1024,4096,16384] [--decode N] [--repeat N] "
                        "[--threads N] [--block-tokens N] [--kv-dtype auto|f32|bf16|f16]... [--csv FILE] "
                        "[--backend cpu|cuda] [--device-mem BYTES]\n");
        return 2;
    }
    FILE *csv = NULL;
    if (csv_path && !(csv = csv_open(csv_path, argc, argv,
                                     "ctx,mode,kv,tok_s,tok_s_best,ratio,resident_layers,n_layers,transfer_ms,"
                                     "stall_ms,overlap_pct,moved_mb_per_token"))) {
        fprintf(stderr, "kvtier-bench-tiers: %s: %s\n", csv_path, strerror(errno));
        return 1;
    }
    n_dt = n_dt ? n_dt : 1;
    struct rig full[MAX_DTYPES];
    for (int d = 0; d < n_dt; d++)
        if (rig_open(&full[d], dir, threads, device_mem, block_tokens, kdts[d]) != 0)
            return 1;
    const struct model_config *c = model_get_config(full[0].m);
    size_t act = be_mem_stats(full[0].be).dev_used;
    float *logits = malloc((size_t)c->vocab_size * sizeof(float));
    double *tps = malloc(sizeof(double) * N_MODES * MAX_DTYPES * (size_t)repeat), ratio[MAX_ROUNDS];
    if (!logits || !tps)
        return 1;
    printf("model %s: %d layers, %d kv heads x %d, %s weights; KV in blocks of %d tokens; backend %s, %d "
           "threads, %s\n",
           dir, c->n_layers, c->n_kv_heads, c->head_dim, be_dtype_name(c->dtype), kv_store_block_tokens(full[0].store),
           be_get_caps(full[0].be).name, be_get_caps(full[0].be).n_threads,
           be_get_caps(full[0].be).pinned_host ? "pinned host tier" : "host tier not pinned");
    for (int d = 0; d < n_dt; d++) {
        enum be_dtype dt = kv_store_dtype(full[d].store);
        printf("KV %s: %zu bytes per token over all layers\n", be_dtype_name(dt),
               2 * (size_t)c->n_layers * (size_t)c->n_kv_heads * (size_t)c->head_dim * be_dtype_size(dt));
    }
    printf("%d rounds of %d decode steps per mode and KV dtype%s\n", repeat, n_decode,
           n_dt > 1 ? ", the dtypes' order rotated round by round" : "");
    printf("%7s %-10s %-4s %9s %9s %7s %9s %8s %8s %8s %12s %10s%s\n", "ctx", "mode", "kv", "tok/s", "best", "ratio",
           "resident", "xfer ms", "stall ms", "overlap", "moved/token", "moved/read", n_dt > 1 ? "  vs first kv (range)" : "");
    for (int i = 0; i < n_ctx; i++) {
        int ctx = ctxs[i];
        /* a layer holding the context in whole blocks, whatever their size */
        size_t bt = (size_t)kv_store_block_tokens(full[0].store);
        struct rig half[MAX_DTYPES];
        size_t per_tok[MAX_DTYPES];
        for (int d = 0; d < n_dt; d++) {
            per_tok[d] = 2 * (size_t)c->n_kv_heads * (size_t)c->head_dim * be_dtype_size(kv_store_dtype(full[d].store));
            size_t layer = per_tok[d] * (((size_t)(ctx + n_decode + 64) + bt - 1) / bt * bt);
            if (rig_open(&half[d], dir, threads, act + (size_t)(c->n_layers / 2 + 2) * layer, block_tokens,
                         kdts[d]) != 0)
                return 1;
        }
        const struct kv_seq_params ps[N_MODES] = {
            {.strategy = KV_DYNAMIC},
            {.strategy = KV_OFFLOADED},
            {.strategy = KV_OFFLOADED, .adaptive = true, .max_cache_len = ctx + (repeat + 1) * (n_decode + 1)},
        };
        kv_seq *q[N_MODES][MAX_DTYPES];
        struct rig *rigs[N_MODES][MAX_DTYPES];
        struct result res[N_MODES][MAX_DTYPES] = {{{0}}};
        for (int k = 0; k < N_MODES; k++)
            for (int d = 0; d < n_dt; d++) {
                rigs[k][d] = k == ADAPTIVE ? &half[d] : &full[d];
                if (!(q[k][d] = filled(rigs[k][d], &ps[k], ctx)))
                    return 1;
            }
#define TPS(k, d, r) tps[((size_t)(k) * MAX_DTYPES + (size_t)(d)) * (size_t)repeat + (size_t)(r)]
        for (int r = 0; r < repeat; r++)
            for (int k = 0; k < N_MODES; k++)
                for (int j = 0; j < n_dt; j++) {
                    int d = (j + r) % n_dt;
                    if ((TPS(k, d, r) = decode(rigs[k][d], q[k][d], n_decode, logits, &res[k][d])) < 0) {
                        fprintf(stderr, "kvtier-bench-tiers: %s decode failed: %s\n", mode_name[k],
                                kv_store_errmsg(rigs[k][d]->store));
                        return 1;
                    }
                }
        for (int k = 0; k < N_MODES; k++)
            for (int d = 0; d < n_dt; d++) {
                struct kv_seq_stats ss = kv_seq_stats(q[k][d]);
                const struct kv_xfer_stats *x = &res[k][d].x;
                double kv_read = (double)per_tok[d] * (double)(ctx + n_decode) * ss.streamed_layers;
                double med = median(&TPS(k, d, 0), repeat);
                printf("%7d %-10s %-4s %9.3f %9.3f %7.3f %5d/%-3d", ctx, mode_name[k],
                       be_dtype_name(kv_store_dtype(rigs[k][d]->store)), med, res[k][d].tps,
                       med / median(&TPS(RESIDENT, d, 0), repeat), ss.resident_layers, c->n_layers);
                if (csv) {
                    fprintf(csv, "%d,%s,%s,%.4f,%.4f,%.4f,%d,%d", ctx, mode_name[k],
                            be_dtype_name(kv_store_dtype(rigs[k][d]->store)), med, res[k][d].tps,
                            med / median(&TPS(RESIDENT, d, 0), repeat), ss.resident_layers, c->n_layers);
                    if (x->steps)
                        fprintf(csv, ",%.3f,%.3f,%.2f,%.3f\n", 1e3 * x->transfer_s / x->steps,
                                1e3 * x->stall_s / x->steps, 100.0 * (1.0 - x->stall_s / x->transfer_s),
                                (double)(x->bytes_h2d + x->bytes_d2h) / x->tokens / 1e6);
                    else
                        fputs(",,,,\n", csv);
                }
                if (x->steps)
                    printf(" %8.2f %8.2f %7.1f%% %10.2fMB %10.3f", 1e3 * x->transfer_s / x->steps,
                           1e3 * x->stall_s / x->steps, 100.0 * (1.0 - x->stall_s / x->transfer_s),
                           (double)(x->bytes_h2d + x->bytes_d2h) / x->tokens / 1e6,
                           (double)(x->bytes_h2d + x->bytes_d2h) / x->tokens / kv_read);
                else
                    printf(" %8s %8s %8s %12s %10s", "-", "-", "-", "-", "-");
                if (d > 0) {
                    for (int r = 0; r < repeat; r++)
                        ratio[r] = TPS(k, d, r) / TPS(k, 0, r);
                    double lo = ratio[0], hi = ratio[0];
                    for (int r = 1; r < repeat; r++) {
                        lo = ratio[r] < lo ? ratio[r] : lo;
                        hi = ratio[r] > hi ? ratio[r] : hi;
                    }
                    printf("  %.3f (%.3f-%.3f)", median(ratio, repeat), lo, hi);
                }
                putchar('\n');
            }
#undef TPS
        for (int k = 0; k < N_MODES; k++)
            for (int d = 0; d < n_dt; d++)
                kv_seq_free(q[k][d]);
        for (int d = 0; d < n_dt; d++)
            rig_close(&half[d]);
        fflush(stdout);
    }
    free(tps);
    free(logits);
    for (int d = 0; d < n_dt; d++)
        rig_close(&full[d]);
    if (csv && !csv_close(csv)) {
        fprintf(stderr, "kvtier-bench-tiers: %s: %s\n", csv_path, strerror(errno));
        return 1;
    }
    return 0;
}
