/* kvtier-bench-attn - the attention op alone, on the backend's own KV
 * blocks: one call for --tokens queries at the positions right after
 * --context keys (a prefill chunk, or with --tokens 1 a decode step),
 * causal, repeated.
 *
 *   kvtier-bench-attn [--context 4096] [--tokens 256] [--heads 32] [--kv-heads 4]
 *                     [--head-dim 64] [--kv-dtype bf16|f16|f32] [--block-tokens 16]
 *                     [--threads 1] [--repeat 5]
 *
 * Prints per call the process CPU milliseconds (the figure to read on a
 * shared machine: a process that takes the cores slows the wall time, not
 * it; --threads 1 keeps pool threads from waiting on each other), the wall
 * milliseconds, the multiply-adds per second (2 per key and head_dim for
 * the scores and the values, every visible key) and the KV bytes read per
 * second of wall time as if every (token, kv head) read its keys once.
 * The defaults are one TinyLlama-1.1B layer.
 */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "util/args.h"
#include "util/clock.h"
#include "util/version.h"

struct setup {
    int context, tokens, heads, kv_heads, head_dim, block_tokens, threads, repeat;
    enum be_dtype dt;
};

/* The blocks, queries and output of one run; every buffer on the backend. */
struct run {
    be_backend *be;
    be_buffer **bufs, *qb, *ob;
    void **blocks;
    int n_blocks;
    struct be_tok *toks;
};

static void run_free(struct run *r)
{
    for (int b = 0; r->bufs && b < r->n_blocks; b++)
        be_buffer_free(r->bufs[b]);
    be_buffer_free(r->qb);
    be_buffer_free(r->ob);
    free(r->bufs);
    free(r->blocks);
    free(r->toks);
    be_free(r->be);
}

static int bench(const struct setup *s)
{
    struct run r = {0};
    int n_keys = s->context + s->tokens;
    size_t esz = be_dtype_size(s->dt);
    size_t half = (size_t)s->kv_heads * (size_t)s->block_tokens * (size_t)s->head_dim * esz;
    size_t qd = (size_t)s->heads * (size_t)s->head_dim;
    enum be_status st = be_open("cpu", &(struct be_params){.n_threads = s->threads}, &r.be);
    r.n_blocks = (n_keys + s->block_tokens - 1) / s->block_tokens;
    r.bufs = calloc((size_t)r.n_blocks, sizeof(*r.bufs));
    r.blocks = calloc((size_t)r.n_blocks, sizeof(*r.blocks));
    r.toks = calloc((size_t)s->tokens, sizeof(*r.toks));
    if (st == BE_OK && !(r.bufs && r.blocks && r.toks))
        st = BE_ENOMEM_HOST;
    for (int b = 0; st == BE_OK && b < r.n_blocks; b++)
        if ((st = be_dev_alloc(r.be, 2 * half, &r.bufs[b])) == BE_OK) {
            r.blocks[b] = be_buffer_data(r.bufs[b]);
            memset(r.blocks[b], 0x3c, 2 * half); /* every K and V element 0.0115 (bf16), finite in any type */
        }
    if (st == BE_OK && (st = be_dev_alloc(r.be, (size_t)s->tokens * qd * sizeof(float), &r.qb)) == BE_OK)
        st = be_dev_alloc(r.be, (size_t)s->tokens * qd * sizeof(float), &r.ob);
    if (st != BE_OK) {
        fprintf(stderr, "kvtier-bench-attn: %s\n", be_strerror(st));
        run_free(&r);
        return 1;
    }
    float *q = be_buffer_data(r.qb);
    for (size_t i = 0; i < (size_t)s->tokens * qd; i++) /* spread scores, so the softmax has work */
        q[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    for (int t = 0; t < s->tokens; t++)
        r.toks[t] = (struct be_tok){.view = 0, .pos = s->context + t};
    struct be_kv_view view = {.blocks = r.blocks, .n_blocks = r.n_blocks, .block_tokens = s->block_tokens,
                              .v_offset = half, .hi = n_keys};
    struct be_attn_params p = {.n_heads = s->heads, .n_kv_heads = s->kv_heads, .head_dim = s->head_dim,
                               .scale = 0.125f, .kv_dtype = s->dt};
    /* one call first: the pool's threads started, the blocks in the TLB */
    st = be_attention(r.be, be_buffer_data(r.ob), q, &view, r.toks, s->tokens, &p);
    double c0 = clock_cpu_s(), w0 = clock_s();
    for (int i = 0; st == BE_OK && i < s->repeat; i++)
        st = be_attention(r.be, be_buffer_data(r.ob), q, &view, r.toks, s->tokens, &p);
    if (st == BE_OK)
        st = be_sync(r.be);
    double cpu = (clock_cpu_s() - c0) / s->repeat, wall = (clock_s() - w0) / s->repeat;
    run_free(&r);
    if (st != BE_OK) {
        fprintf(stderr, "kvtier-bench-attn: %s\n", be_strerror(st));
        return 1;
    }
    /* token t sees context + t + 1 keys */
    double keys = (double)s->tokens * s->context + (double)s->tokens * (s->tokens + 1) / 2.0;
    double macs = 2.0 * keys * s->heads * s->head_dim;
    double bytes = keys * s->kv_heads * 2.0 * s->head_dim * (double)esz;
    printf("attention %d tokens after %d keys, %d heads / %d kv heads of %d, %s KV, %d thread(s): "
           "cpu %.3f ms, wall %.3f ms per call; %.1f GMAC/s of cpu, %.2f GB/s of KV read per wall second\n",
           s->tokens, s->context, s->heads, s->kv_heads, s->head_dim, be_dtype_name(s->dt), s->threads, cpu * 1e3,
           wall * 1e3, macs / cpu * 1e-9, bytes / wall * 1e-9);
    return 0;
}

int main(int argc, char **argv)
{
    if (version_requested(argc, argv, "kvtier-bench-attn"))
        return 0;
    struct setup s = {.context = 4096, .tokens = 256, .heads = 32, .kv_heads = 4, .head_dim = 64,
                      .block_tokens = 16, .threads = 1, .repeat = 5, .dt = BE_BF16};
    enum { O_CONTEXT = 256, O_TOKENS, O_HEADS, O_KV_HEADS, O_HEAD_DIM, O_KV_DTYPE, O_BLOCK, O_THREADS, O_REPEAT };
    static const struct option opts[] = {
        {"context", required_argument, 0, O_CONTEXT},   {"tokens", required_argument, 0, O_TOKENS},
        {"heads", required_argument, 0, O_HEADS},       {"kv-heads", required_argument, 0, O_KV_HEADS},
        {"head-dim", required_argument, 0, O_HEAD_DIM}, {"kv-dtype", required_argument, 0, O_KV_DTYPE},
        {"block-tokens", required_argument, 0, O_BLOCK}, {"threads", required_argument, 0, O_THREADS},
        {"repeat", required_argument, 0, O_REPEAT},     {0, 0, 0, 0},
    };
    for (int c; (c = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
        bool ok = true;
        switch (c) {
        case O_CONTEXT: ok = args_int(optarg, 0, 1 << 24, &s.context); break;
        case O_TOKENS: ok = args_int(optarg, 1, 1 << 16, &s.tokens); break;
        case O_HEADS: ok = args_int(optarg, 1, 1024, &s.heads); break;
        case O_KV_HEADS: ok = args_int(optarg, 1, 1024, &s.kv_heads); break;
        case O_HEAD_DIM: ok = args_int(optarg, 1, 1024, &s.head_dim); break;
        case O_BLOCK: ok = args_int(optarg, 1, 4096, &s.block_tokens); break;
        case O_THREADS: ok = args_int(optarg, 1, 1024, &s.threads); break;
        case O_REPEAT: ok = args_int(optarg, 1, 1 << 20, &s.repeat); break;
        case O_KV_DTYPE:
            ok = !strcmp(optarg, "bf16") || !strcmp(optarg, "f16") || !strcmp(optarg, "f32");
            s.dt = !strcmp(optarg, "f32") ? BE_F32 : !strcmp(optarg, "f16") ? BE_F16 : BE_BF16;
            break;
        default:
            fprintf(stderr, "usage: kvtier-bench-attn [--context N] [--tokens N] [--heads H] [--kv-heads K] "
                            "[--head-dim D] [--kv-dtype bf16|f16|f32] [--block-tokens B] [--threads N] "
                            "[--repeat R]\n");
            return 2;
        }
        if (!ok)
            return args_invalid("kvtier-bench-attn", opts, c, optarg);
    }
    if (optind != argc || s.heads % s.kv_heads) {
        fprintf(stderr, "kvtier-bench-attn: --heads must be a multiple of --kv-heads, and no other arguments\n");
        return 2;
    }
    return bench(&s);
}
