/* kvtier-bench - measures the forward pass against what this machine can do,
 * in one run, so that the figures are ratios that survive a noisy machine:
 *
 *   decode efficiency  = bytes read per token (weights + KV) x tokens/s
 *                        / memory read ceiling measured here (util/readbw:
 *                        a thread per online CPU (at least the decode's),
 *                        the widest loads, plain and non-temporal, 1, 4 and
 *                        16 streams per thread, a buffer >= 1 GiB and >= 8x
 *                        the last-level cache, the best of --bw-passes
 *                        passes)
 *   prefill efficiency = prefill GFLOP/s / OpenBLAS sgemm GFLOP/s measured here
 *
 *   kvtier-bench -m DIR [--prompt 256] [--decode 32] [--threads N] [--repeat 3]
 *                [--block-tokens N[,N...]] [--batch N[,N...]] [--fill N]
 *                [--kv-dtype auto|f32|bf16|f16] [--nbits 8|4|2] [--bw-passes 3]
 *                [--weights auto|q8_0|q4_k] [--csv FILE] [--backend cpu|cuda]
 *
 * Each round measures the limits and the model back to back and gives its
 * own ratios; reported are the medians of those over --repeat rounds and,
 * beside them, the best model figure against the best limit figure.  With
 * several KV block sizes, every round runs the model once per size (in an
 * order rotated round by round) and each size's tokens/s is also given as
 * the median of the per-round ratios to the first size's.  --fill N puts N
 * positions before the prompt, reserved and committed without computing
 * them (a step's work does not depend on the KV's values), so that prefill
 * and decode run at a long context without paying for its prefill.
 * --nbits B runs every sequence with the quantized cache (quanto's
 * defaults at B bits: keys and values in per-token groups of 64, a
 * residual of under 128 tokens in full precision); with --fill, the
 * filled positions are quantized as they are committed.
 * --batch N runs N sequences side by side, as the daemon's scheduler does
 * with N concurrent requests: their prompts (each its own tokens) in one
 * forward call, then every decode step one call of one token per sequence,
 * so the weights are read once for all N; tokens/s are then the aggregate
 * over the N.  Several batch sizes are measured as several block sizes
 * are (one list of the two may have more than one entry), and each size's
 * tokens/s is also given as the median of the per-round ratios to the
 * first size's.  --csv FILE also writes one row per KV block size or batch
 * size (util/csvout.h).
 */
#include <cblas.h>
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "util/clock.h"
#include "util/args.h"
#include "util/csvout.h"
#include "util/readbw.h"
#include "model/runtime.h"
#include "tiers/quant.h"
#include "util/version.h"
#include "util/median.h"

#define MAX_BLOCK_SIZES 4
#define MAX_BATCH_SIZES 8
#define MAX_BATCH 256

#define SG_M 512 /* the shape of a 512-token prefill chunk */
#define SG_N 2048
#define SG_K 2048

/* One timed OpenBLAS sgemm of SG_M x SG_N x SG_K on threads threads. */
static double sgemm_gflops(const float *a, const float *b, float *c, int threads)
{
    openblas_set_num_threads(threads);
    double t0 = clock_s();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, SG_M, SG_N, SG_K, 1, a, SG_K, b, SG_K, 0, c, SG_N);
    double g = 2.0 * SG_M * SG_N * SG_K / (clock_s() - t0) / 1e9;
    /* the CPU backend calls sgemm from each of its own workers, single-threaded */
    openblas_set_num_threads(1);
    return g;
}

/* The buffers of a run of up to MAX_BATCH sequences, allocated once. */
struct batch_bufs {
    kv_seq **q;
    struct fw_seq *fs;
    int32_t *ids;  /* each sequence's prompt: n_prompt tokens of its own */
    int32_t *next; /* each sequence's decode token of the step */
    float *logits; /* each sequence's row of vocab */
};

/* batch fresh sequences in s: n_fill reserved tokens each, their prompts in
 * one forward call, n_decode steps of one token each; their seconds in *tp
 * and *td, the decode's CPU seconds (all threads) in *tdc.  false (after a
 * message) on error. */
static bool run_once(model *m, kv_store *s, const struct kv_seq_params *sp, const struct batch_bufs *bb, int batch,
                     int n_fill, int n_prompt, int n_decode, int vocab, double *tp, double *td, double *tdc)
{
    enum model_status st = MODEL_OK;
    int made = 0;
    for (; made < batch; made++) {
        bb->q[made] = NULL;
        if (kv_seq_create(s, sp, &bb->q[made]) != TIER_OK ||
            (n_fill && kv_seq_reserve(bb->q[made], n_fill) != TIER_OK)) {
            fprintf(stderr, "kvtier-bench: KV store: %s\n", kv_store_errmsg(s));
            kv_seq_free(bb->q[made]);
            st = MODEL_ENOMEM;
            break;
        }
        if (n_fill)
            kv_seq_commit(bb->q[made]);
        bb->fs[made] = (struct fw_seq){.kv = bb->q[made], .tokens = bb->ids + (size_t)made * n_prompt,
                                       .n_tokens = n_prompt, .logits = bb->logits + (size_t)made * vocab};
    }
    double t0 = clock_s();
    if (st == MODEL_OK)
        st = model_forward(m, bb->fs, batch);
    *tp = clock_s() - t0;
    t0 = clock_s();
    double c0 = clock_cpu_s();
    for (int i = 0; i < n_decode && st == MODEL_OK; i++) {
        for (int b = 0; b < batch; b++) {
            bb->next[b] = (int32_t)((i * 31 + 7 + b * 13) % vocab);
            bb->fs[b].tokens = &bb->next[b];
            bb->fs[b].n_tokens = 1;
        }
        st = model_forward(m, bb->fs, batch);
    }
    *td = clock_s() - t0;
    *tdc = clock_cpu_s() - c0;
    for (int b = 0; b < made; b++)
        kv_seq_free(bb->q[b]);
    if (st != MODEL_OK && made == batch)
        fprintf(stderr, "kvtier-bench: forward: %s\n", model_strerror(st));
    return st == MODEL_OK;
}

/* Bytes and elements one decode step streams: every matrix once, lm_head
 * once (the embedding row is negligible). */
static void weight_totals(const struct model_config *c, const struct model_weights *w, size_t *bytes,
                          double *elems)
{
    *bytes = 0;
    *elems = 0;
    for (int l = -1; l < c->n_layers; l++) {
        const struct model_layer *L = l >= 0 ? &w->layers[l] : NULL;
        const struct model_mat *ms[14] = {&w->lm_head};
        if (L) { /* a family's matrices; the others' have no rows */
            const struct model_mat *lm[14] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down,
                                              &L->ssm_in_x, &L->ssm_in_z, &L->ssm_x_dt, &L->ssm_x_B, &L->ssm_x_C,
                                              &L->ssm_dt, &L->ssm_out};
            memcpy(ms, lm, sizeof(ms));
        }
        for (int i = 0; i < 14 && ms[i]; i++) {
            *elems += (double)ms[i]->rows * ms[i]->cols;
            *bytes += (size_t)ms[i]->rows * be_row_bytes(ms[i]->dtype, (size_t)ms[i]->cols);
        }
    }
}

/* Bytes one decode step of batch sequences reads: the weights once, each
 * sequence's KV (kv_bytes at the run's mean context). */
static double step_bytes(size_t wbytes, double kv_bytes, int batch)
{
    return (double)wbytes + batch * kv_bytes;
}

int main(int argc, char **argv)
{
    if (version_requested(argc, argv, "kvtier-bench"))
        return 0;
    const char *dir = NULL;
    int n_prompt = 256, n_decode = 32, repeat = 3, bts[MAX_BLOCK_SIZES] = {0}, nb = 1, n_fill = 0, bw_passes = 3;
    int bats[MAX_BATCH_SIZES] = {1}, nbat = 1, nbits = 0;
    struct runtime_params rp = {0};
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"prompt", required_argument, 0, 'p'},
        {"decode", required_argument, 0, 'd'}, {"threads", required_argument, 0, 't'},
        {"repeat", required_argument, 0, 'r'}, {"block-tokens", required_argument, 0, 'b'},
        {"fill", required_argument, 0, 'f'},   {"kv-dtype", required_argument, 0, 'k'},
        {"bw-passes", required_argument, 0, 'P'}, {"weights", required_argument, 0, 'w'},
        {"csv", required_argument, 0, 'C'},   {"backend", required_argument, 0, 'B'},
        {"batch", required_argument, 0, 'n'}, {"nbits", required_argument, 0, 'q'},
        {0, 0, 0, 0},
    };
    const char *csv_path = NULL;
    int o;
    while ((o = getopt_long(argc, argv, "m:p:d:t:r:b:f:k:w:P:n:q:", opts, NULL)) != -1) {
        bool ok = true;
        switch (o) {
        case 'm': dir = optarg; break;
        case 'p': ok = args_int(optarg, 1, 1 << 20, &n_prompt); break;
        case 'd': ok = args_int(optarg, 1, 1 << 20, &n_decode); break;
        case 't': ok = args_int(optarg, 0, 1024, &rp.be.n_threads); break;
        case 'r': ok = args_int(optarg, 1, 1000, &repeat); break;
        case 'b': ok = args_int_list(optarg, 1, 1 << 16, bts, MAX_BLOCK_SIZES, &nb); break;
        case 'n': ok = args_int_list(optarg, 1, MAX_BATCH, bats, MAX_BATCH_SIZES, &nbat); break;
        case 'f': ok = args_int(optarg, 0, 1 << 24, &n_fill); break;
        case 'k': ok = model_kv_dtype_parse(optarg, &rp.model.kv_dtype); break;
        case 'P': ok = args_int(optarg, 1, 100, &bw_passes); break;
        case 'w': ok = model_weights_parse(optarg, &rp.model.weights); break;
        case 'q': ok = args_int(optarg, 2, 8, &nbits) && (nbits == 2 || nbits == 4 || nbits == 8); break;
        case 'C': csv_path = optarg; break;
        case 'B': rp.backend = optarg; break;
        default: return 2;
        }
        if (!ok)
            return args_invalid("kvtier-bench", opts, o, optarg);
    }
    if (!dir || optind != argc || (nb > 1 && nbat > 1) || (nb > 1 && nbits)) {
        fprintf(stderr, "usage: kvtier-bench -m DIR [--prompt N] [--decode N] [--threads N] [--repeat N] "
                        "[--block-tokens N[,N...] (not with --nbits) | --batch N[,N...]] [--fill N] "
                        "[--kv-dtype auto|f32|bf16|f16] "
                        "[--nbits 8|4|2] [--bw-passes N] "
                        "[--weights auto|q8_0|q4_k] [--csv FILE] [--backend cpu|cuda]\n");
        return 2;
    }
    FILE *csv = NULL;
    if (csv_path && !(csv = csv_open(csv_path, argc, argv,
                                     "block_tokens,batch,fill,prompt,decode,prefill_tok_s_best,prefill_tok_s_median,"
                                     "prefill_pct_sgemm,decode_tok_s_best,decode_tok_s_median,decode_pct_read"))) {
        fprintf(stderr, "kvtier-bench: %s: %s\n", csv_path, strerror(errno));
        return 1;
    }
    char err[MODEL_ERR_LEN];
    struct runtime rt;
    int max_batch = 0;
    for (int i = 0; i < nbat; i++)
        max_batch = bats[i] > max_batch ? bats[i] : max_batch;
    /* every decode step of the largest batch in one chunk */
    _Static_assert(MAX_BATCH <= 512, "a batch's decode step fits the chunk");
    long all_prompts = (long)n_prompt * max_batch;
    rp.model.max_batch_tokens = all_prompts < 512 ? (int)all_prompts : 512;
    rp.kv.block_tokens = bts[0];
    enum model_status st = runtime_open(dir, &rp, &rt, err);
    if (st != MODEL_OK) {
        fprintf(stderr, "kvtier-bench: %s: %s\n", model_strerror(st), err);
        return 1;
    }
    model *m = rt.m;
    const struct model_config *c = model_get_config(m);
    be_backend *be = rt.be;
    struct be_caps caps = be_get_caps(be);
    int threads = caps.n_threads;
    kv_store *stores[MAX_BLOCK_SIZES] = {rt.store};
    struct kv_geom g = model_kv_geom(m);
    for (int b = 1; b < nb; b++)
        if (kv_store_open(be, &g, &(struct kv_store_params){.block_tokens = bts[b]}, &stores[b]) != TIER_OK) {
            fprintf(stderr, "kvtier-bench: cannot open a KV store with blocks of %d tokens\n", bts[b]);
            return 1;
        }

    /* Limits and model are measured in alternation, round by round, and
     * each round gives its own ratios: on a shared machine a disturbance
     * then hits both sides of a ratio, and the median drops the outliers. */
    int nv = nb > 1 ? nb : nbat; /* the variants measured: block sizes or batch sizes */
    size_t runs = (size_t)repeat * (size_t)nv;
    /* every CPU reads: a ceiling for the decode's threads must not be lower
     * than what the machine gives all of them */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int bw_threads = cpus > threads ? (cpus < 256 ? (int)cpus : 256) : threads;
    readbw *rb = readbw_create((size_t)1 << 30, bw_threads);
    float *sa = malloc(sizeof(float) * SG_M * SG_K), *sb = malloc(sizeof(float) * SG_K * SG_N),
          *sc = malloc(sizeof(float) * SG_M * SG_N);
    struct batch_bufs bb = {
        .q = calloc((size_t)max_batch, sizeof(*bb.q)),
        .fs = calloc((size_t)max_batch, sizeof(*bb.fs)),
        .ids = malloc(sizeof(int32_t) * (size_t)n_prompt * (size_t)max_batch),
        .next = malloc(sizeof(int32_t) * (size_t)max_batch),
        .logits = malloc(sizeof(float) * (size_t)c->vocab_size * (size_t)max_batch),
    };
    double *r_bw = calloc((size_t)repeat, sizeof(double)), *r_sg = calloc((size_t)repeat, sizeof(double));
    /* per round and block size: tokens/s, then the ratios made of them */
    double *t_pre = calloc(runs, sizeof(double)), *t_dec = calloc(runs, sizeof(double));
    double *c_dec = calloc(runs, sizeof(double)); /* decode tokens per CPU second */
    double *ratio = calloc((size_t)repeat, sizeof(double));
    if (!rb || !sa || !sb || !sc || !bb.q || !bb.fs || !bb.ids || !bb.next || !bb.logits || !r_bw || !r_sg || !t_pre || !t_dec || !c_dec || !ratio) {
        fprintf(stderr, "kvtier-bench: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < (size_t)SG_M * SG_K; i++)
        sa[i] = (float)(i % 7) * 0.1f;
    for (size_t i = 0; i < (size_t)SG_K * SG_N; i++)
        sb[i] = (float)(i % 5) * 0.1f;
    sgemm_gflops(sa, sb, sc, threads); /* warm-up: OpenBLAS starts its threads */
    /* sequence 0's prompt is the one-sequence runs' of earlier builds */
    for (size_t i = 0; i < (size_t)n_prompt * (size_t)max_batch; i++)
        bb.ids[i] = (int32_t)((i % (size_t)n_prompt * 7919 + i / (size_t)n_prompt * 104729) % (size_t)c->vocab_size);

    const struct model_weights *w = model_get_weights(m);
    size_t wbytes;
    double welems;
    weight_totals(c, w, &wbytes, &welems);
    double flops_tok = 2.0 * welems; /* one multiply-add per weight per token */
    /* KV bytes per token over all layers: K and V in the store's dtype, or
     * a quantized block's codes and scales per token (the full-precision
     * residual, under 128 tokens, counted at that rate too) */
    double kv_tok = 2.0 * c->n_layers * c->n_kv_heads * c->head_dim * (double)be_dtype_size(g.dtype);
    struct kv_seq_params qp = {.strategy = KV_QUANTIZED, .quant = kv_quant_defaults(KVQ_QUANTO)};
    const struct kv_seq_params *sp = NULL;
    if (nbits) {
        qp.quant.nbits = nbits;
        struct be_kvq_format f;
        struct kvq_error e;
        int T = kvq_block_tokens(&qp.quant, kv_store_block_tokens(rt.store));
        if (kvq_format_init(&f, &qp.quant, g.n_kv_heads, g.head_dim, T, &e) != TIER_OK) {
            fprintf(stderr, "kvtier-bench: --nbits %d: %s\n", nbits, e.msg);
            return 1;
        }
        kv_tok = (double)c->n_layers * (double)f.block_bytes / T;
        sp = &qp;
    }
    /* KV read per decode token at the mean context of the decode run */
    double kv_bytes = kv_tok * (n_fill + n_prompt + n_decode / 2.0);

    /* untimed, so round 0's first store does not pay for cold pages and caches */
    for (int v = 0; v < nv; v++) {
        double tp, td, tdc;
        if (!run_once(m, stores[nb > 1 ? v : 0], sp, &bb, bats[nbat > 1 ? v : 0], n_fill, n_prompt, 1, c->vocab_size,
                      &tp, &td, &tdc))
            return 1;
    }
    int n_stream = 0;   /* rounds whose ceiling came from non-temporal loads */
    int best_streams = 0; /* streams per thread of the best round's ceiling */
    double best_round = 0;
    for (int r = 0; r < repeat; r++) {
        enum readbw_load load;
        int streams;
        /* sgemm first: OpenBLAS's threads spin for a while after it, and
         * would count in the decode's CPU time */
        r_sg[r] = sgemm_gflops(sa, sb, sc, threads);
        r_bw[r] = readbw_ceiling(rb, bw_passes, &load, &streams);
        n_stream += load == READBW_STREAM;
        if (r_bw[r] > best_round) {
            best_round = r_bw[r];
            best_streams = streams;
        }
        for (int k = 0; k < nv; k++) {
            int v = (k + r) % nv, batch = bats[nbat > 1 ? v : 0];
            kv_store *s = stores[nb > 1 ? v : 0];
            double tp, td, tdc;
            if (!run_once(m, s, sp, &bb, batch, n_fill, n_prompt, n_decode, c->vocab_size, &tp, &td, &tdc))
                return 1;
            t_pre[r * nv + v] = (double)batch * n_prompt / tp;
            t_dec[r * nv + v] = (double)batch * n_decode / td;
            c_dec[r * nv + v] = (double)batch * n_decode / tdc;
            fprintf(stderr, "round %d, blocks of %d, batch %d: read %.1f GB/s, sgemm %.1f GFLOP/s, prefill %.0f %%, "
                    "decode %.0f %%\n", r, kv_store_block_tokens(s), batch, r_bw[r], r_sg[r],
                    100 * flops_tok * t_pre[r * nv + v] / 1e9 / r_sg[r],
                    100 * step_bytes(wbytes, kv_bytes, batch) * t_dec[r * nv + v] / batch / 1e9 / r_bw[r]);
        }
    }
    printf("model            %s (%s, %d layers, dim %d, %s weights, %.2f GB of matrices)\n", dir, c->arch_name,
           c->n_layers, c->hidden_size, be_dtype_name(c->dtype), wbytes / 1e9);
    printf("backend          %s, %d threads, simd %s, %d rounds, %d context tokens before the prompt\n", caps.name,
           threads, caps.simd, repeat, n_fill);
    if (nbits)
        printf("KV               int%d, %.0f bytes per token over all layers (quanto, per-token groups of %d, "
               "under %d recent tokens in %s)\n",
               nbits, kv_tok, qp.quant.q_group_size, qp.quant.residual_length, be_dtype_name(g.dtype));
    else
        printf("KV               %s, %.0f bytes per token over all layers\n", be_dtype_name(g.dtype), kv_tok);
    /* best against best: each side's least disturbed round */
    double best_bw = 0, best_sg = 0;
    for (int r = 0; r < repeat; r++) {
        best_bw = r_bw[r] > best_bw ? r_bw[r] : best_bw;
        best_sg = r_sg[r] > best_sg ? r_sg[r] : best_sg;
    }
    for (int v = 0; v < nv; v++) {
        int batch = bats[nbat > 1 ? v : 0];
        kv_store *s = stores[nb > 1 ? v : 0];
        /* bytes a decode step reads (weights once, every sequence's KV) per token */
        double tok_bytes = step_bytes(wbytes, kv_bytes, batch) / batch;
        double prefill_tps = 0, decode_tps = 0;
        for (int r = 0; r < repeat; r++) {
            prefill_tps = t_pre[r * nv + v] > prefill_tps ? t_pre[r * nv + v] : prefill_tps;
            decode_tps = t_dec[r * nv + v] > decode_tps ? t_dec[r * nv + v] : decode_tps;
        }
        printf("KV blocks        %d tokens\n", kv_store_block_tokens(s));
        if (nbat > 1 || batch > 1)
            printf("batch            %d sequences decoding together: tokens/s below are their sum\n", batch);
        for (int r = 0; r < repeat; r++)
            ratio[r] = t_pre[r * nv + v];
        double prefill_med = median_sort(ratio, repeat);
        for (int r = 0; r < repeat; r++)
            ratio[r] = flops_tok * t_pre[r * nv + v] / 1e9 / r_sg[r];
        double prefill_pct = 100 * median_sort(ratio, repeat);
        printf("prefill          %d tokens: %.1f tokens/s (best), %.1f (median), %.0f %% of sgemm (median of rounds), "
               "%.0f %% best/best\n",
               n_prompt, prefill_tps, prefill_med, prefill_pct, 100 * flops_tok * prefill_tps / 1e9 / best_sg);
        for (int r = 0; r < repeat; r++)
            ratio[r] = t_dec[r * nv + v];
        double decode_med = median_sort(ratio, repeat);
        for (int r = 0; r < repeat; r++)
            ratio[r] = tok_bytes * t_dec[r * nv + v] / 1e9 / r_bw[r];
        double decode_pct = 100 * median_sort(ratio, repeat);
        printf("decode           %d tokens: %.2f tokens/s (best), %.2f (median), %.0f %% of the read ceiling with KV "
               "(median of rounds), %.0f %% best/best\n",
               n_decode, decode_tps, decode_med, decode_pct, 100 * tok_bytes * decode_tps / 1e9 / best_bw);
        if (csv)
            fprintf(csv, "%d,%d,%d,%d,%d,%.3f,%.3f,%.2f,%.3f,%.3f,%.2f\n", kv_store_block_tokens(s), batch, n_fill,
                    n_prompt, n_decode, prefill_tps, prefill_med, prefill_pct, decode_tps, decode_med, decode_pct);
        /* the weights alone, read once per step: the figure comparable
         * with another engine's, whose KV layout and size differ */
        for (int r = 0; r < repeat; r++)
            ratio[r] = wbytes * t_dec[r * nv + v] / batch / 1e9 / r_bw[r];
        printf("decode weights   %.2f GB/s (median), %.2f (best), %.0f %% of the read ceiling (median of rounds), "
               "%.0f %% best/best\n",
               wbytes * decode_med / batch / 1e9, wbytes * decode_tps / batch / 1e9, 100 * median_sort(ratio, repeat),
               100 * wbytes * decode_tps / batch / 1e9 / best_bw);
        for (int r = 0; r < repeat; r++)
            ratio[r] = 1e3 / c_dec[r * nv + v];
        printf("decode CPU       %.1f ms of CPU time per token, all threads (median of rounds)\n",
               median_sort(ratio, repeat));
        if (v > 0) {
            double lo[3], hi[3], med[3];
            for (int d = 0; d < 3; d++) {
                const double *t = d == 2 ? c_dec : d ? t_dec : t_pre;
                for (int r = 0; r < repeat; r++)
                    ratio[r] = t[r * nv + v] / t[r * nv];
                med[d] = median_sort(ratio, repeat); /* sorts ratio */
                lo[d] = ratio[0];
                hi[d] = ratio[repeat - 1];
            }
            if (nb > 1)
                printf("vs %d-token blocks: ", kv_store_block_tokens(stores[0]));
            else
                printf("vs a batch of %d: ", bats[0]);
            printf("prefill %.3fx (median of rounds, %.3f-%.3f), decode %.3fx (%.3f-%.3f), decode tokens per CPU "
                   "second %.3fx (%.3f-%.3f)\n", med[0], lo[0], hi[0], med[1], lo[1], hi[1], med[2], lo[2], hi[2]);
        }
    }
    /* last: median_sort() sorts, and the ratios above pair the rounds */
    printf("read ceiling     %.2f GB/s (median), %.2f (best, %d streams per thread): %d threads, %s loads, "
           "non-temporal best in %d of %d rounds, %.2f GiB buffer, best of %d passes per round\n",
           median_sort(r_bw, repeat), best_bw, best_streams, bw_threads, readbw_isa_name(readbw_best_isa()), n_stream,
           repeat,
           readbw_bytes(rb) / (double)(1 << 30), bw_passes);
    printf("sgemm            %.1f GFLOP/s (OpenBLAS, %d threads, median)\n", median_sort(r_sg, repeat), threads);
    readbw_free(rb);
    free(sa);
    free(sb);
    free(sc);
    free(r_bw);
    free(r_sg);
    free(t_pre);
    free(t_dec);
    free(c_dec);
    free(ratio);
    free(bb.q);
    free(bb.fs);
    free(bb.ids);
    free(bb.next);
    free(bb.logits);
    for (int b = 1; b < nb; b++)
        kv_store_free(stores[b]);
    runtime_close(&rt);
    if (csv && !csv_close(csv)) {
        fprintf(stderr, "kvtier-bench: %s: %s\n", csv_path, strerror(errno));
        return 1;
    }
    return 0;
}
