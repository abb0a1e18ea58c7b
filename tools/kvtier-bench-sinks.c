/* kvtier-bench-sinks - greedy generation with the sink strategy
 * (StreamingLLM attention sinks), one token per step after the prompt.
 *
 *   kvtier-bench-sinks -m DIR [--window W] [--sinks S] [--ids 1,2,3] [-n N]
 *                      [--dump FILE] [--every K] [--threads N] [--nbits B] [--kv-dtype T]
 *
 * Prints, every K generated tokens (default 1000), the tokens/s of the last
 * K tokens, the process CPU milliseconds they took per token and the
 * sequence's KV bytes, then the ratios of the last interval to the first:
 * flat generation speed and flat memory are what the sink strategy
 * promises.  CPU time per token is the figure to read on a shared machine
 * (another process taking the cores slows the wall rate, not it), with
 * --threads 1 so that no pool thread waits on another.  --nbits 2, 4 or 8
 * runs sinks + quantized (quanto, KIVI axes, residual 128).  Fails (exit 1)
 * on a NaN or infinite logit or when the KV bytes ever exceed what the
 * window needs: per layer, the blocks that W-S consecutive tokens can
 * touch plus the block of the sinks; quantized, the sink block, the
 * quantized blocks W-S tokens touch plus the one a flush reopens, and the
 * residual's f32 blocks (the bound of tests/test_tiers.c).
 * --dump writes the KVTL file of kvtier-run (its header comment) for
 * tests/sinks_oracle.py.
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
#include "model/runtime.h"
#include "tiers/quant.h"
#include "util/version.h"

static int parse_ids(const char *s, struct tok_ids *out)
{
    for (char *end; *s; s = *end ? end + 1 : end) {
        errno = 0;
        long v = strtol(s, &end, 10);
        if (end == s || errno || v < 0 || v > INT32_MAX || (*end && *end != ','))
            return -1;
        if (tok_ids_push(out, (int32_t)v) != TEXT_OK)
            return -1;
    }
    return 0;
}

/* The logits rows of a --dump: every generated token's. */
struct rows {
    FILE *f;      /* a temporary file: n_gen x vocab floats can be large */
    size_t n;
};

static bool dump_write(const char *path, const struct tok_ids *ids, size_t n_prompt, int vocab, struct rows *r)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return false;
    int32_t hdr[3] = {(int32_t)n_prompt, (int32_t)r->n, vocab};
    bool ok = fwrite("KVTL", 1, 4, f) == 4 && fwrite(hdr, 4, 3, f) == 3 && fwrite(ids->ids, 4, ids->n, f) == ids->n;
    float buf[4096];
    rewind(r->f);
    for (size_t got; ok && (got = fread(buf, 4, 4096, r->f)) > 0;)
        ok = fwrite(buf, 4, got, f) == got;
    return fclose(f) == 0 && ok;
}

int main(int argc, char **argv)
{
    if (version_requested(argc, argv, "kvtier-bench-sinks"))
        return 0;
    const char *dir = NULL, *ids_arg = "1", *dump_path = NULL;
    int n_gen = 1000, every = 1000, window = 256, sinks = 4, nbits = 0;
    enum { O_WINDOW = 256, O_SINKS, O_IDS, O_DUMP, O_EVERY, O_THREADS, O_NBITS, O_KVDTYPE };
    struct runtime_params rp = {0};
    static const struct option opts[] = {
        {"window", required_argument, 0, O_WINDOW}, {"sinks", required_argument, 0, O_SINKS},
        {"ids", required_argument, 0, O_IDS},       {"dump", required_argument, 0, O_DUMP},
        {"every", required_argument, 0, O_EVERY},   {"threads", required_argument, 0, O_THREADS},
        {"nbits", required_argument, 0, O_NBITS},   {"kv-dtype", required_argument, 0, O_KVDTYPE},
        {0, 0, 0, 0},
    };
    for (int c; (c = getopt_long(argc, argv, "m:n:", opts, NULL)) != -1;) {
        bool ok = true;
        switch (c) {
        case 'm': dir = optarg; break;
        case 'n': ok = args_int(optarg, 1, INT32_MAX, &n_gen); break;
        case O_WINDOW: ok = args_int(optarg, 1, INT32_MAX, &window); break;
        case O_SINKS: ok = args_int(optarg, 0, INT32_MAX, &sinks); break;
        case O_IDS: ids_arg = optarg; break;
        case O_DUMP: dump_path = optarg; break;
        case O_EVERY: ok = args_int(optarg, 1, INT32_MAX, &every); break;
        case O_THREADS: ok = args_int(optarg, 0, 1024, &rp.be.n_threads); break;
        case O_KVDTYPE: ok = model_kv_dtype_parse(optarg, &rp.model.kv_dtype); break;
        case O_NBITS: ok = args_int(optarg, 2, 8, &nbits) && (nbits == 2 || nbits == 4 || nbits == 8); break;
        default:
            fprintf(stderr, "usage: kvtier-bench-sinks -m DIR [--window W] [--sinks S] [--ids 1,2,3] [-n N] "
                            "[--dump FILE] [--every K] [--threads N] [--nbits 2|4|8] [--kv-dtype auto|f32|bf16|f16]\n");
            return 2;
        }
        if (!ok)
            return args_invalid("kvtier-bench-sinks", opts, c, optarg);
    }
    struct tok_ids ids = {0};
    if (!dir || optind != argc || parse_ids(ids_arg, &ids) || !ids.n) {
        fprintf(stderr, "kvtier-bench-sinks: need -m DIR and --ids of token ids\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0); /* reports show up while a long run goes on */
    size_t n_prompt = ids.n;
    char err[MODEL_ERR_LEN];
    struct runtime rt = {0};
    enum model_status ms = runtime_open(dir, &rp, &rt, err);
    if (ms != MODEL_OK) {
        fprintf(stderr, "kvtier-bench-sinks: %s\n", err);
        return 1;
    }
    kv_seq *q = NULL;
    struct kv_seq_params kp = {.strategy = KV_DYNAMIC, .sink = true, .window_length = window, .num_sink_tokens = sinks};
    if (nbits) {
        kp.strategy = KV_QUANTIZED;
        kp.quant = kv_quant_defaults(KVQ_QUANTO);
        kp.quant.nbits = nbits;
        kp.quant.axis_key = -1; /* KIVI: keys per channel, values per token */
    }
    int vocab = model_get_config(rt.m)->vocab_size;
    float *logits = malloc((size_t)vocab * sizeof(float));
    struct rows rows = {.f = dump_path ? tmpfile() : NULL};
    int rc = 1;
    if (!logits || (dump_path && !rows.f)) {
        fprintf(stderr, "kvtier-bench-sinks: out of memory\n");
        goto out;
    }
    if (kv_seq_create(rt.store, &kp, &q) != TIER_OK) {
        fprintf(stderr, "kvtier-bench-sinks: %s\n", kv_store_errmsg(rt.store));
        goto out;
    }
    printf("window %d, %d sinks, %s KV, prompt %zu tokens\n%10s %12s %14s %12s\n", window, sinks,
           nbits == 8 ? "int8" : nbits == 4 ? "int4" : nbits == 2 ? "int2" : be_dtype_name(kv_store_dtype(rt.store)), n_prompt, "generated", "tokens/s",
           "CPU ms/token", "KV bytes");
    struct kv_geom geo = model_kv_geom(rt.m);
    size_t bt = (size_t)kv_store_block_tokens(rt.store);
    size_t block = 2 * (size_t)geo.n_kv_heads * bt * (size_t)geo.head_dim * be_dtype_size(geo.dtype);
    size_t live = (size_t)window - (size_t)sinks, layer = ((live + bt - 1) / bt + 2) * block;
    if (nbits) {
        struct be_kvq_format f;
        struct kvq_error e;
        size_t T = (size_t)kvq_block_tokens(&kp.quant, (int)bt), R = (size_t)kp.quant.residual_length;
        if (kvq_format_init(&f, &kp.quant, geo.n_kv_heads, geo.head_dim, (int)T, &e) != TIER_OK) {
            fprintf(stderr, "kvtier-bench-sinks: %s\n", e.msg);
            goto out;
        }
        layer = block + ((live + T - 1) / T + 2) * f.block_bytes + ((R + bt - 1) / bt + 2) * block;
    }
    size_t bound = (size_t)geo.n_layers * layer;
    double first_rate = 0, rate = 0, first_cpu = 0, cpu = 0, t0 = clock_s(), c0 = clock_cpu_s();
    const int32_t *feed = ids.ids;
    int n_feed = (int)n_prompt;
    for (int g = 1; g <= n_gen; g++) {
        struct fw_seq fs = {.kv = q, .tokens = feed, .n_tokens = n_feed, .logits = logits};
        if ((ms = model_forward(rt.m, &fs, 1)) != MODEL_OK) {
            fprintf(stderr, "kvtier-bench-sinks: step %d: %s %s\n", g, model_strerror(ms), kv_store_errmsg(rt.store));
            goto out;
        }
        int32_t best = 0;
        for (int i = 0; i < vocab; i++) {
            if (!isfinite(logits[i])) {
                fprintf(stderr, "kvtier-bench-sinks: logit %d of generated token %d is %f\n", i, g, logits[i]);
                goto out;
            }
            best = logits[i] > logits[best] ? i : best;
        }
        if (rows.f && fwrite(logits, 4, (size_t)vocab, rows.f) != (size_t)vocab)
            goto out;
        rows.n++;
        if (tok_ids_push(&ids, best) != TEXT_OK)
            goto out;
        feed = &ids.ids[ids.n - 1];
        n_feed = 1;
        if (g % every == 0) {
            double t1 = clock_s();
            rate = (double)every / (t1 - t0);
            cpu = (clock_cpu_s() - c0) * 1e3 / every;
            size_t bytes = kv_seq_bytes(q);
            if (!first_rate) {
                first_rate = rate;
                first_cpu = cpu;
            }
            printf("%10d %12.1f %14.4f %12zu\n", g, rate, cpu, bytes);
            if (bytes > bound) {
                fprintf(stderr, "kvtier-bench-sinks: KV bytes %zu above the window's %zu\n", bytes, bound);
                goto out;
            }
            t0 = clock_s(); /* the report itself is not timed */
            c0 = clock_cpu_s();
        }
    }
    if (first_rate)
        printf("at %d generated / at %d generated: tokens/s %.3f, CPU per token %.3f\n", n_gen, every,
               rate / first_rate, cpu / first_cpu);
    if (dump_path && !dump_write(dump_path, &ids, n_prompt, vocab, &rows)) {
        fprintf(stderr, "kvtier-bench-sinks: writing %s failed\n", dump_path);
        goto out;
    }
    rc = 0;
out:
    if (rows.f)
        fclose(rows.f);
    kv_seq_free(q);
    free(logits);
    free(ids.ids);
    runtime_close(&rt);
    return rc;
}
