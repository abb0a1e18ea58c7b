/* kvtier-bench-quant - what the quantized KV cache costs.
 *
 *   accuracy -m DIR -f FILE [-t TOKDIR] [--tokens N] [--window W] [--prompt P]
 *     Splits FILE's ids (tokenized by TOKDIR's tokenizer, default DIR) into
 *     windows of W tokens.  Every cache configuration reads the same window
 *     as a prompt of P tokens (quantized at the first update, KIVI) and then
 *     one token per step, all configurations in lockstep (one batched step
 *     per token: the f32-store ones share a step, the bf16 cache has its own
 *     store).  Over the decode positions it reports, against the f32 cache:
 *     the perplexity delta, the mean KL(f32 || config) of the next-token
 *     distributions, the rate of same top token, and the marginal KV bytes
 *     per token measured from the store (kv_seq_bytes over the second half of
 *     a window) as a ratio to the bf16 cache's.  --csv FILE also writes
 *     those figures, one row per cache (util/csvout.h), for `make plots`.
 *
 *   speed -m DIR [--context N] [--steps S] [--rounds R]
 *     Prefills N random tokens into a bf16 cache, an int8 and an int4
 *     (quanto, keys per channel, residual 128) cache, then in each round
 *     times S decode steps of each, in an order rotated every round, and
 *     reports the median tokens/s and the median of the per-round ratios to
 *     the bf16 cache.
 */
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util/args.h"
#include "util/clock.h"
#include "util/csvout.h"
#include "model/generate.h"
#include "text/tokenizer.h"
#include "tiers/quant.h"
#include "util/version.h"
#include "util/median.h"
#include "util/argmax.h"

struct cfg {
    const char *name;
    bool bf16_store; /* dense, in the bf16 store */
    bool quantized;
    struct kv_quant_params q;
};

/* KIVI's choice in each backend's numbering: keys per channel, values per
 * token; group 64. */
static struct cfg quant_cfg(const char *name, enum kv_quant_backend b, int nbits, int residual)
{
    struct cfg c = {.name = name, .quantized = true, .q = kv_quant_defaults(b)};
    if (b != KVQ_FP8) {
        c.q.nbits = nbits;
        c.q.axis_key = b == KVQ_QUANTO ? -1 : 0;
        c.q.axis_value = b == KVQ_QUANTO ? 0 : 1;
        c.q.residual_length = residual;
    }
    return c;
}

struct bench {
    be_backend *be;
    model *m;
    kv_store *store[2]; /* f32, bf16 */
    int V;
};

static int bench_open(struct bench *b, const char *dir, int threads, int batch)
{
    char err[MODEL_ERR_LEN] = "";
    struct be_params bp = {.n_threads = threads};
    if (be_open("cpu", &bp, &b->be) != BE_OK) {
        fprintf(stderr, "kvtier-bench-quant: no CPU backend\n");
        return -1;
    }
    struct model_params mp = {.max_batch_tokens = batch};
    enum model_status st = model_load(dir, b->be, &mp, &b->m, err);
    if (st != MODEL_OK) {
        fprintf(stderr, "kvtier-bench-quant: %s: %s\n", model_strerror(st), err);
        return -1;
    }
    for (int i = 0; i < 2; i++) {
        struct kv_geom g = model_kv_geom(b->m);
        g.dtype = i ? BE_BF16 : BE_F32;
        if (kv_store_open(b->be, &g, NULL, &b->store[i]) != TIER_OK) {
            fprintf(stderr, "kvtier-bench-quant: cannot open a KV store\n");
            return -1;
        }
    }
    b->V = model_get_config(b->m)->vocab_size;
    return 0;
}

/* Frees the n sequences of q (NULL ones too), then whatever bench_open opened. */
static void bench_close(struct bench *b, kv_seq **q, int n)
{
    for (int i = 0; i < n; i++)
        kv_seq_free(q[i]);
    for (int i = 0; i < 2; i++)
        kv_store_free(b->store[i]);
    model_free(b->m);
    be_free(b->be);
}

static int seq_new(struct bench *b, const struct cfg *c, kv_seq **out)
{
    struct kv_seq_params p = {.strategy = c->quantized ? KV_QUANTIZED : KV_DYNAMIC, .no_prefix_cache = true};
    if (c->quantized)
        p.quant = c->q;
    kv_store *s = b->store[c->bf16_store];
    if (kv_seq_create(s, &p, out) != TIER_OK) {
        fprintf(stderr, "kvtier-bench-quant: %s: %s\n", c->name, kv_store_errmsg(s));
        return -1;
    }
    return 0;
}

/* One step of every configuration: the f32-store sequences in one batch,
 * the bf16-store ones in another.  fs[i].tokens/n_tokens/logits are set. */
static int step(struct bench *b, const struct cfg *cfgs, int n, struct fw_seq *fs, struct fw_seq *tmp)
{
    for (int store = 0; store < 2; store++) {
        int k = 0;
        for (int i = 0; i < n; i++)
            if (cfgs[i].bf16_store == store)
                tmp[k++] = fs[i];
        enum model_status st = k ? model_forward(b->m, tmp, k) : MODEL_OK;
        if (st != MODEL_OK) {
            fprintf(stderr, "kvtier-bench-quant: model_forward: %s\n", model_strerror(st));
            return -1;
        }
    }
    return 0;
}

/* log softmax of x[V] into lp, in double. */
static void log_softmax(const float *x, int V, double *lp)
{
    double mx = x[0], sum = 0;
    for (int v = 1; v < V; v++)
        mx = x[v] > mx ? x[v] : mx;
    for (int v = 0; v < V; v++)
        sum += exp((double)x[v] - mx);
    double lse = mx + log(sum);
    for (int v = 0; v < V; v++)
        lp[v] = (double)x[v] - lse;
}

static int read_ids(const char *path, const char *tokdir, struct tok_ids *ids)
{
    char err[MODEL_ERR_LEN] = "";
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        return -1;
    }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = len >= 0 ? malloc((size_t)len + 1) : NULL;
    bool ok = text && fread(text, 1, (size_t)len, f) == (size_t)len;
    fclose(f);
    tokenizer *tok = NULL;
    enum model_status st = ok ? model_from_text(tokenizer_load(tokdir, &tok, err)) : MODEL_ENOMEM;
    if (st == MODEL_OK)
        st = model_from_text(tokenizer_encode(tok, text, (size_t)len, false, ids, err));
    tokenizer_free(tok);
    free(text);
    if (st != MODEL_OK) {
        fprintf(stderr, "kvtier-bench-quant: %s: %s %s\n", path, model_strerror(st), err);
        return -1;
    }
    return 0;
}

#define N_ACC 17

static int accuracy(const char *dir, const char *file, const char *tokdir, int max_tokens, int W, int P, int threads,
                    FILE *csv)
{
    struct cfg cfgs[N_ACC] = {
        {.name = "f32 (reference)"},
        {.name = "bf16", .bf16_store = true},
        quant_cfg("fp8 e4m3", KVQ_FP8, 8, 0),
        quant_cfg("int8 quanto R128", KVQ_QUANTO, 8, 128),
        quant_cfg("int8 hqq R128", KVQ_HQQ, 8, 128),
        quant_cfg("int8 quanto R0", KVQ_QUANTO, 8, 0),
        quant_cfg("int8 hqq R0", KVQ_HQQ, 8, 0),
        quant_cfg("int4 quanto R128", KVQ_QUANTO, 4, 128),
        quant_cfg("int4 hqq R128", KVQ_HQQ, 4, 128),
        quant_cfg("int4 quanto R0", KVQ_QUANTO, 4, 0),
        quant_cfg("int4 hqq R0", KVQ_HQQ, 4, 0),
        quant_cfg("int2 quanto R128", KVQ_QUANTO, 2, 128),
        quant_cfg("int2 hqq R128", KVQ_HQQ, 2, 128),
        quant_cfg("int2 quanto R0", KVQ_QUANTO, 2, 0),
        quant_cfg("int2 hqq R0", KVQ_HQQ, 2, 0),
        quant_cfg("int3 hqq R128", KVQ_HQQ, 3, 128),
        quant_cfg("int1 hqq R128", KVQ_HQQ, 1, 128),
    };
    struct tok_ids ids = {0};
    if (read_ids(file, tokdir ? tokdir : dir, &ids) != 0)
        return 1;
    struct bench b = {0};
    int rc = 1;
    double nll[N_ACC] = {0}, kl[N_ACC] = {0}, bytes_tok[N_ACC] = {0};
    long same[N_ACC] = {0}, n_pos = 0;
    int n_win = 0;
    float *logits = NULL;
    double *lp_ref = NULL, *lp = NULL;
    struct fw_seq fs[N_ACC], tmp[N_ACC];
    kv_seq *q[N_ACC] = {0};
    if (bench_open(&b, dir, threads, P) != 0)
        goto out;
    logits = malloc((size_t)N_ACC * b.V * sizeof(float));
    lp_ref = malloc((size_t)b.V * sizeof(double));
    lp = malloc((size_t)b.V * sizeof(double));
    if (!logits || !lp_ref || !lp) {
        fprintf(stderr, "kvtier-bench-quant: out of memory\n");
        goto out;
    }
    size_t total = ids.n < (size_t)max_tokens ? ids.n : (size_t)max_tokens;
    double t0 = clock_s();
    for (size_t w0 = 0; w0 + (size_t)W <= total; w0 += (size_t)W, n_win++) {
        const int32_t *c = ids.ids + w0;
        for (int i = 0; i < N_ACC; i++) {
            if (seq_new(&b, &cfgs[i], &q[i]) != 0)
                goto out;
            fs[i] = (struct fw_seq){.kv = q[i], .tokens = c, .n_tokens = P, .logits = logits + (size_t)i * b.V};
        }
        if (step(&b, cfgs, N_ACC, fs, tmp) != 0)
            goto out;
        size_t half[N_ACC];
        for (int t = P; t + 1 < W; t++) {
            /* logits after c[t] predict c[t + 1]; the prompt's last row
             * attended in full precision for every configuration, so it is
             * not counted */
            for (int i = 0; i < N_ACC; i++)
                fs[i].tokens = &c[t], fs[i].n_tokens = 1;
            if (step(&b, cfgs, N_ACC, fs, tmp) != 0)
                goto out;
            log_softmax(logits, b.V, lp_ref);
            int top = argmax_f32(logits, b.V);
            for (int i = 0; i < N_ACC; i++) {
                const float *x = logits + (size_t)i * b.V;
                log_softmax(x, b.V, lp);
                double d = 0;
                for (int v = 0; v < b.V; v++)
                    d += exp(lp_ref[v]) * (lp_ref[v] - lp[v]);
                kl[i] += d;
                nll[i] -= lp[c[t + 1]];
                same[i] += argmax_f32(x, b.V) == top;
                if (t == W / 2)
                    half[i] = kv_seq_bytes(q[i]);
            }
            n_pos++;
        }
        for (int i = 0; i < N_ACC; i++) {
            bytes_tok[i] += (double)(kv_seq_bytes(q[i]) - half[i]) / (double)(W - 1 - W / 2);
            kv_seq_free(q[i]);
            q[i] = NULL;
        }
    }
    if (!n_pos) {
        fprintf(stderr, "kvtier-bench-quant: fewer than --window (%d) tokens\n", W);
        goto out;
    }
    printf("%d windows of %d tokens (prompt %d, %ld decode positions), %.0f s\n\n", n_win, W, P, n_pos, clock_s() - t0);
    printf("| cache | ppl | ΔPPL | mean KL vs f32 | same top token | KV bytes/token vs bf16 |\n|---|---|---|---|---|---|\n");
    double ppl0 = exp(nll[0] / (double)n_pos);
    for (int i = 0; i < N_ACC; i++) {
        double ppl = exp(nll[i] / (double)n_pos);
        printf("| %s | %.4f | %+.3f %% | %.2e | %.2f %% | %.3f |\n", cfgs[i].name, ppl, 100 * (ppl / ppl0 - 1),
               kl[i] / (double)n_pos, 100.0 * (double)same[i] / (double)n_pos, bytes_tok[i] / bytes_tok[1]);
        if (csv)
            fprintf(csv, "%s,%.6f,%.5f,%.4e,%.4f,%.5f\n", cfgs[i].name, ppl, 100 * (ppl / ppl0 - 1),
                    kl[i] / (double)n_pos, 100.0 * (double)same[i] / (double)n_pos, bytes_tok[i] / bytes_tok[1]);
    }
    rc = 0;
out:
    bench_close(&b, q, N_ACC);
    free(logits);
    free(lp_ref);
    free(lp);
    free(ids.ids);
    return rc;
}

#define N_SPEED 3
#define MAX_ROUNDS 64

static int speed(const char *dir, int context, int steps, int rounds, int threads)
{
    const struct cfg cfgs[N_SPEED] = {
        {.name = "bf16", .bf16_store = true},
        quant_cfg("int8 quanto R128", KVQ_QUANTO, 8, 128),
        quant_cfg("int4 quanto R128", KVQ_QUANTO, 4, 128),
    };
    struct bench b = {0};
    kv_seq *q[N_SPEED] = {0};
    int32_t *ids = malloc((size_t)(context + steps) * sizeof(int32_t));
    float *row = NULL;
    int rc = 1;
    double tps[N_SPEED][MAX_ROUNDS], ratio[N_SPEED][MAX_ROUNDS];
    if (!ids || bench_open(&b, dir, threads, 512) != 0)
        goto out;
    row = malloc((size_t)b.V * sizeof(float));
    if (!row)
        goto out;
    srand(7);
    for (int i = 0; i < context + steps; i++)
        ids[i] = rand() % b.V;
    double t0 = clock_s();
    for (int i = 0; i < N_SPEED; i++) {
        if (seq_new(&b, &cfgs[i], &q[i]) != 0)
            goto out;
        struct fw_seq fs = {.kv = q[i], .tokens = ids, .n_tokens = context, .logits = row};
        if (model_forward(b.m, &fs, 1) != MODEL_OK)
            goto out;
    }
    printf("prefill of %d tokens x %d caches: %.0f s\n", context, N_SPEED, clock_s() - t0);
    for (int r = 0; r < rounds; r++) {
        for (int k = 0; k < N_SPEED; k++) {
            int i = (k + r) % N_SPEED;
            double t = clock_s();
            for (int s = 0; s < steps; s++) {
                struct fw_seq fs = {.kv = q[i], .tokens = &ids[context + s], .n_tokens = 1, .logits = row};
                if (model_forward(b.m, &fs, 1) != MODEL_OK)
                    goto out;
            }
            tps[i][r] = steps / (clock_s() - t);
        }
        for (int i = 0; i < N_SPEED; i++)
            ratio[i][r] = tps[i][r] / tps[0][r];
    }
    printf("\n| cache | decode tokens/s (median) | ratio to bf16 (median of rounds) | KV bytes at the end |\n|---|---|---|---|\n");
    for (int i = 0; i < N_SPEED; i++) {
        qsort(tps[i], (size_t)rounds, sizeof(double), median_cmp_double);
        qsort(ratio[i], (size_t)rounds, sizeof(double), median_cmp_double);
        printf("| %s | %.2f | %.3f | %zu |\n", cfgs[i].name, tps[i][rounds / 2], ratio[i][rounds / 2],
               kv_seq_bytes(q[i]));
    }
    rc = 0;
out:
    bench_close(&b, q, N_SPEED);
    free(row);
    free(ids);
    return rc;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvtier-bench-quant accuracy -m DIR -f FILE [-t TOKDIR] [--tokens N] [--window W] [--prompt P] "
               "[--threads N] [--csv FILE]\n"
               "       kvtier-bench-quant speed -m DIR [--context N] [--steps S] [--rounds R] [--threads N]\n");
}

int main(int argc, char **argv)
{
    if (version_requested(argc, argv, "kvtier-bench-quant"))
        return 0;
    const char *dir = NULL, *file = NULL, *tokdir = NULL;
    int tokens = 4096, window = 512, prompt = 64, threads = 0, context = 4096, steps = 16, rounds = 5;
    const char *csv_path = NULL;
    enum { O_TOKENS = 256, O_WINDOW, O_PROMPT, O_THREADS, O_CONTEXT, O_STEPS, O_ROUNDS, O_CSV };
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},       {"file", required_argument, 0, 'f'},
        {"tokenizer", required_argument, 0, 't'},   {"tokens", required_argument, 0, O_TOKENS},
        {"window", required_argument, 0, O_WINDOW}, {"prompt", required_argument, 0, O_PROMPT},
        {"threads", required_argument, 0, O_THREADS}, {"context", required_argument, 0, O_CONTEXT},
        {"steps", required_argument, 0, O_STEPS},   {"rounds", required_argument, 0, O_ROUNDS},
        {"csv", required_argument, 0, O_CSV},       {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *mode = argv[1];
    optind = 2;
    int c;
    while ((c = getopt_long(argc, argv, "m:f:t:h", opts, NULL)) != -1) {
        bool ok = true;
        switch (c) {
        case 'm': dir = optarg; break;
        case 'f': file = optarg; break;
        case 't': tokdir = optarg; break;
        case O_TOKENS: ok = args_int(optarg, 1, INT32_MAX, &tokens); break;
        case O_WINDOW: ok = args_int(optarg, 3, 1 << 24, &window); break;
        case O_PROMPT: ok = args_int(optarg, 1, 1 << 24, &prompt); break;
        case O_THREADS: ok = args_int(optarg, 0, 1024, &threads); break;
        case O_CONTEXT: ok = args_int(optarg, 1, 1 << 24, &context); break;
        case O_STEPS: ok = args_int(optarg, 1, 1 << 20, &steps); break;
        case O_ROUNDS: ok = args_int(optarg, 1, MAX_ROUNDS, &rounds); break;
        case O_CSV: csv_path = optarg; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
        if (!ok)
            return args_invalid("kvtier-bench-quant", opts, c, optarg);
    }
    if (!dir || optind != argc) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(mode, "accuracy") && file && window > prompt + 1) {
        FILE *csv = NULL;
        if (csv_path &&
            !(csv = csv_open(csv_path, argc, argv, "cache,ppl,dppl_pct,mean_kl,same_top_pct,kv_bytes_vs_bf16"))) {
            fprintf(stderr, "kvtier-bench-quant: %s: %s\n", csv_path, strerror(errno));
            return 1;
        }
        int rc = accuracy(dir, file, tokdir, tokens, window, prompt, threads, csv);
        if (csv && !csv_close(csv) && !rc) {
            fprintf(stderr, "kvtier-bench-quant: %s: %s\n", csv_path, strerror(errno));
            rc = 1;
        }
        return rc;
    }
    if (csv_path) {
        fprintf(stderr, "kvtier-bench-quant: --csv is for the accuracy mode\n");
        return 2;
    }
    if (!strcmp(mode, "speed"))
        return speed(dir, context, steps, rounds, threads);
    usage(stderr);
    return 2;
}
