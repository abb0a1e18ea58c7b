/* ops.c - the CPU kernels behind backend.h: threading and the loops over
 * tokens, heads and rows; the inner loops come from the SIMD table the
 * backend picked (cpu.h).  Arguments were validated by backend.c.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "backend/cpu/cpu.h"

/* Below this many elements of work a job runs on the caller alone: waking
 * the pool costs more than the loop. */
#define PAR_MIN_WORK 32768

/* [*lo, *hi) = the ith of nth near-equal parts of [0, n), boundaries on
 * multiples of align so threads never share a cache line of output. */
static void split(size_t n, int ith, int nth, size_t align, size_t *lo, size_t *hi)
{
    size_t units = (n + align - 1) / align;
    *lo = units * (size_t)ith / (size_t)nth * align;
    *hi = units * (size_t)(ith + 1) / (size_t)nth * align;
    if (*lo > n)
        *lo = n;
    if (*hi > n)
        *hi = n;
}

static void run(struct cpu_ctx *c, cpu_job_fn *fn, void *arg, size_t work)
{
    if (work < PAR_MIN_WORK)
        fn(arg, 0, 1);
    else
        cpu_pool_run(cpu_ctx_pool(c), fn, arg);
}

/* ---- matmul ------------------------------------------------------------- */

/* Rows are handed out in chunks from a shared counter rather than split in
 * equal halves up front: on a shared machine a thread that loses its core
 * for a while leaves its rows to the others instead of making every one of
 * them wait at the join (decode runs ~10 joins per layer). */
struct matmul_job {
    struct cpu_ctx *c;
    struct cpu_mm mm;
    const float *bias;
    size_t chunk;         /* rows per grab, a multiple of 16 (whole cache lines of y) */
    _Atomic size_t next;  /* first row not yet handed out */
};

static void matmul_job(void *arg, int ith, int nth)
{
    struct matmul_job *j = arg;
    (void)nth;
    size_t out = (size_t)j->mm.out;
    for (;;) {
        size_t r0 = atomic_fetch_add(&j->next, j->chunk);
        if (r0 >= out)
            return;
        size_t r1 = r0 + j->chunk < out ? r0 + j->chunk : out;
        cpu_ctx_kern(j->c)->matmul_rows(&j->mm, (int)r0, (int)r1, cpu_ctx_scratch(j->c, ith));
        if (j->bias)
            for (int t = 0; t < j->mm.n; t++)
                cpu_ctx_kern(j->c)->add(j->mm.y + (size_t)t * out + r0, j->bias + r0, r1 - r0);
    }
}

/* The activations of a quantized-weight matmul, blocks split over the
 * threads: int8 blocks and their sums, and x as those blocks dequantized
 * where xd is not NULL. */
struct wq_act_job {
    struct cpu_ctx *c;
    const float *x;
    struct cpu_q8_act *xq;
    int32_t *xsum;
    float *xd;
    size_t blocks;
};

static void wq_act_job(void *arg, int ith, int nth)
{
    struct wq_act_job *j = arg;
    size_t lo, hi;
    split(j->blocks, ith, nth, 16, &lo, &hi);
    if (lo >= hi)
        return;
    cpu_ctx_kern(j->c)->q8_act(j->xq + lo, j->xsum + lo, j->x + lo * 32, (hi - lo) * 32);
    if (j->xd)
        for (size_t b = lo; b < hi; b++)
            for (int i = 0; i < 32; i++)
                j->xd[b * 32 + (size_t)i] = j->xq[b].d * (float)j->xq[b].qs[i];
}

enum be_status cpu_matmul(void *ctx, void *y_, enum be_dtype yt, const void *x_, const void *w, enum be_dtype wt, const float *bias,
                          int n, int in, int out)
{
    if (yt != BE_F32) /* activations and logits are f32 here */
        return BE_ENOTSUP;
    float *y = y_;
    const float *x = x_;
    struct matmul_job j = {
        .c = ctx,
        .mm = {.y = y, .x = x, .w = w, .wt = wt, .n = n, .in = in, .out = out},
        .bias = bias,
    };
    if (cpu_wq(wt)) { /* once here, not once per thread and row chunk */
        size_t elems = (size_t)n * (size_t)in, bfl = elems / 32 * (sizeof(struct cpu_q8_act) / sizeof(float));
        _Static_assert(sizeof(struct cpu_q8_act) % sizeof(float) == 0, "blocks tile a float work area");
        _Static_assert(sizeof(int32_t) == sizeof(float), "block sums fill a float work area");
        /* the panels' sgemm multiplies floats: it gets x as rounded too,
         * so every path and batch size computes the same product */
        bool f32 = cpu_ctx_kern(j.c)->wq_f32 && cpu_ctx_kern(j.c)->wq_f32(n, in);
        float *work = cpu_ctx_rows(j.c, bfl + elems / 32 + (f32 ? elems : 0));
        if (!work)
            return BE_ENOMEM_HOST;
        struct wq_act_job aj = {.c = j.c, .x = x, .xq = (struct cpu_q8_act *)work, .xsum = (int32_t *)(work + bfl),
                                .xd = f32 ? work + bfl + elems / 32 : NULL, .blocks = elems / 32};
        run(j.c, wq_act_job, &aj, elems);
        j.mm.xq = aj.xq;
        j.mm.xsum = aj.xsum;
        j.mm.x = aj.xd;
    }
    const struct cpu_kern *k = cpu_ctx_kern(j.c);
    if (wt == BE_BF16 && k->bf16_pack_act) { /* once here, as for Q8_0 */
        size_t words = cpu_bf16_act_words(n, in);
        _Static_assert(sizeof(uint32_t) == sizeof(float), "packed pairs fill a float work area");
        uint32_t *xb = (uint32_t *)cpu_ctx_rows(j.c, words);
        if (!xb)
            return BE_ENOMEM_HOST;
        k->bf16_pack_act(xb, x, n, in);
        j.mm.xb = xb;
    }
    /* grabs per thread: a batch takes about 8, small enough to rebalance,
     * large enough that each grab's per-call setup (x deinterleave, sgemm
     * panel) stays negligible; a few tokens stream W, and each grab starts
     * its stream cold, so they take 6 longer runs: enough that a thread
     * slowed by another tenant does not hold the other back for long
     * (docs/benchmarks.md, "bf16 decode") */
    size_t grabs = n < CPU_BF16_GEMM_MIN_TOKENS ? 6 : 8;
    size_t per = (size_t)out / (grabs * (size_t)cpu_pool_size(cpu_ctx_pool(j.c))) / 16 * 16;
    j.chunk = per < 64 ? 64 : per;
    atomic_init(&j.next, 0);
    run(j.c, matmul_job, &j, (size_t)in * (size_t)out);
    return BE_OK;
}

/* ---- rmsnorm ------------------------------------------------------------ */

struct rows_job {
    struct cpu_ctx *c;
    float *y;
    const float *x, *w, *b;
    int rows, cols;
    float eps;
};

static void rmsnorm_job(void *arg, int ith, int nth)
{
    struct rows_job *j = arg;
    const struct cpu_kern *k = cpu_ctx_kern(j->c);
    size_t r0, r1;
    split((size_t)j->rows, ith, nth, 1, &r0, &r1);
    for (size_t r = r0; r < r1; r++) {
        const float *x = j->x + r * (size_t)j->cols;
        float s = 1.0f / sqrtf(k->sumsq(x, j->cols) / (float)j->cols + j->eps);
        k->norm_mul(j->y + r * (size_t)j->cols, x, s, j->w, j->cols);
    }
}

enum be_status cpu_rmsnorm(void *ctx, void *y_, const void *x_, const float *w, int n, int dim, float eps)
{
    float *y = y_;
    const float *x = x_;
    struct rows_job j = {.c = ctx, .y = y, .x = x, .w = w, .rows = n, .cols = dim, .eps = eps};
    run(j.c, rmsnorm_job, &j, (size_t)n * (size_t)dim);
    return BE_OK;
}

static void layernorm_job(void *arg, int ith, int nth)
{
    struct rows_job *j = arg;
    size_t r0, r1;
    split((size_t)j->rows, ith, nth, 1, &r0, &r1);
    for (size_t r = r0; r < r1; r++) {
        const float *x = j->x + r * (size_t)j->cols;
        float *y = j->y + r * (size_t)j->cols, mean = 0.0f, var = 0.0f;
        for (int i = 0; i < j->cols; i++)
            mean += x[i];
        mean /= (float)j->cols;
        for (int i = 0; i < j->cols; i++) /* two passes: no cancellation in E[x^2] - mean^2 */
            var += (x[i] - mean) * (x[i] - mean);
        float s = 1.0f / sqrtf(var / (float)j->cols + j->eps);
        for (int i = 0; i < j->cols; i++)
            y[i] = (x[i] - mean) * s * j->w[i] + j->b[i];
    }
}

enum be_status cpu_layernorm(void *ctx, void *y_, const void *x_, const float *w, const float *b, int n, int dim,
                             float eps)
{
    float *y = y_;
    const float *x = x_;
    struct rows_job j = {.c = ctx, .y = y, .x = x, .w = w, .b = b, .rows = n, .cols = dim, .eps = eps};
    run(j.c, layernorm_job, &j, (size_t)n * (size_t)dim * 2);
    return BE_OK;
}

/* ---- rope --------------------------------------------------------------- */

/* Angles are computed in f32 as Hugging Face does (pos * inv_freq, then
 * cos/sin), a chunk of frequencies at a time so one token's table serves
 * all its heads without scratch memory. */
#define ROPE_CHUNK 32

struct rope_job {
    float *x;
    int n_tok, n_heads, head_dim, rot_dim;
    const int64_t *pos;
    const float *inv_freq;
    float mscale;
    enum be_rope_layout layout;
};

static void rope_job(void *arg, int ith, int nth)
{
    struct rope_job *j = arg;
    int half = j->rot_dim / 2;
    size_t t0, t1;
    split((size_t)j->n_tok, ith, nth, 1, &t0, &t1);
    for (size_t t = t0; t < t1; t++) {
        float fpos = (float)j->pos[t];
        for (int i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
            int m = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
            float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
            for (int i = 0; i < m; i++) {
                float a = fpos * j->inv_freq[i0 + i];
                cs[i] = cosf(a) * j->mscale;
                sn[i] = sinf(a) * j->mscale;
            }
            for (int h = 0; h < j->n_heads; h++) {
                float *v = j->x + (t * (size_t)j->n_heads + (size_t)h) * (size_t)j->head_dim;
                for (int i = 0; i < m; i++) {
                    int a = j->layout == BE_ROPE_NEOX ? i0 + i : 2 * (i0 + i);
                    int b = j->layout == BE_ROPE_NEOX ? i0 + i + half : a + 1;
                    float x0 = v[a], x1 = v[b];
                    v[a] = x0 * cs[i] - x1 * sn[i];
                    v[b] = x1 * cs[i] + x0 * sn[i];
                }
            }
        }
    }
}

enum be_status cpu_rope(void *ctx, void *x_, int n_tok, int n_heads, int head_dim, const int64_t *pos,
                        const float *inv_freq, int rot_dim, float mscale, enum be_rope_layout layout)
{
    float *x = x_;
    struct rope_job j = {.x = x, .n_tok = n_tok, .n_heads = n_heads, .head_dim = head_dim, .rot_dim = rot_dim,
                         .pos = pos, .inv_freq = inv_freq, .mscale = mscale, .layout = layout};
    run(ctx, rope_job, &j, (size_t)n_tok * (size_t)n_heads * (size_t)rot_dim * 4);
    return BE_OK;
}

/* ---- paged KV ----------------------------------------------------------- */

char *cpu_kv_row(const struct be_kv_view *v, int64_t pos, int kvh, int head_dim, size_t esz)
{
    int64_t rel = pos - v->base;
    int64_t blk = rel / v->block_tokens, slot = rel % v->block_tokens;
    return (char *)v->blocks[blk] + (((size_t)kvh * (size_t)v->block_tokens + (size_t)slot) * (size_t)head_dim) * esz;
}

enum be_status cpu_kv_store(void *ctx, const struct be_kv_view *views, const struct be_tok *toks, int n_tok,
                            const void *k_, const void *v_, const struct be_attn_params *p)
{
    const float *k = k_;
    const float *v = v_;
    const struct cpu_kern *kern = cpu_ctx_kern(ctx);
    size_t esz = be_dtype_size(p->kv_dtype), row = (size_t)p->n_kv_heads * (size_t)p->head_dim;
    for (int t = 0; t < n_tok; t++) {
        const struct be_kv_view *view = &views[toks[t].view];
        for (int h = 0; h < p->n_kv_heads; h++) {
            char *dst = cpu_kv_row(view, toks[t].pos, h, p->head_dim, esz);
            size_t src = (size_t)t * row + (size_t)h * (size_t)p->head_dim;
            kern->from_f32(dst, p->kv_dtype, k + src, (size_t)p->head_dim);
            kern->from_f32(dst + view->v_offset, p->kv_dtype, v + src, (size_t)p->head_dim);
        }
    }
    return BE_OK;
}

/* ---- attention ------------------------------------------------------------ */

/* Keys per chunk: a chunk's scores live in a small scratch array, so any
 * context length needs no more memory; everything in f32. */
#define ATTN_CHUNK 64

const char *cpu_key_row(const struct be_kv_view *v, int64_t pos, int kvh, int head_dim, size_t esz)
{
    if (pos >= v->sinks)
        return cpu_kv_row(v, pos, kvh, head_dim, esz);
    return (const char *)v->sink_block +
           ((size_t)kvh * (size_t)v->block_tokens + (size_t)pos) * (size_t)head_dim * esz;
}

void cpu_key_rope(const struct be_attn_params *p, const struct be_kv_view *v, int64_t pos, const float *x,
                  float *out)
{
    int hd = p->head_dim, half = hd / 2;
    const float *t = p->key_rope + (size_t)(pos < v->sinks ? pos : pos - v->shift) * (size_t)hd;
    for (int i = 0; i < half; i++) {
        int a = p->key_rope_layout == BE_ROPE_NEOX ? i : 2 * i;
        int b = p->key_rope_layout == BE_ROPE_NEOX ? i + half : a + 1;
        out[a] = x[a] * t[a] - x[b] * t[b];
        out[b] = x[b] * t[a] + x[a] * t[b];
    }
}

void cpu_attn_softcap(float *s, int n, float cap)
{
    if (cap > 0.0f)
        for (int i = 0; i < n; i++)
            s[i] = cap * tanhf(s[i] / cap);
}

void cpu_attn_rel_bias(const struct be_attn_params *p, int h, int64_t qpos, float *s, int64_t u0, int a, int b)
{
    if (!p->rel_bias)
        return;
    /* T5: the bias of the key's distance, per query head */
    const float *bias = p->rel_bias + (size_t)h * (size_t)(2 * p->rel_span + 1) + p->rel_span;
    for (int i = a; i < b; i++) {
        int64_t d = u0 + i - qpos;
        s[i] += bias[d < -p->rel_span ? -p->rel_span : d > p->rel_span ? p->rel_span : d];
    }
}

void cpu_attn_fold(const struct cpu_kern *k, struct cpu_attn_part *pt, float *s, size_t ss, int nq, int a, int b,
                   int head_dim)
{
    for (int g = 0; g < nq; g++) {
        float *sg = s + (size_t)g * ss, m = pt->m[g], cm = k->max(sg + a, b - a);
        memset(sg, 0, (size_t)a * sizeof(float));
        memset(sg + b, 0, (ss - (size_t)b) * sizeof(float));
        if (cm > m) {
            float f = expf(m - cm);
            pt->l[g] *= f;
            k->scale(pt->o + (size_t)g * (size_t)head_dim, f, head_dim);
            pt->m[g] = m = cm;
        }
        if (m == -INFINITY) { /* no score above -inf yet: these keys weigh nothing */
            memset(sg + a, 0, (size_t)(b - a) * sizeof(float));
            continue;
        }
        pt->l[g] += k->exp_sum(sg + a, m, b - a); /* the scores become the values' weights */
    }
}

/* Prefetches the K and V rows of positions [lo, hi) (sinks excepted: a
 * handful, read by every token) of kv head kvh, one run per block. */
static void prefetch_rows(const struct be_kv_view *v, int kvh, int D, size_t esz, int64_t lo, int64_t hi)
{
    size_t row = (size_t)D * esz;
    for (int64_t pos = lo > v->sinks ? lo : v->sinks; pos < hi;) {
        int64_t end = pos + (v->block_tokens - (pos - v->base) % v->block_tokens);
        end = end < hi ? end : hi;
        const char *k = cpu_kv_row(v, pos, kvh, D, esz);
        cpu_prefetch(k, (size_t)(end - pos) * row);
        cpu_prefetch(k + v->v_offset, (size_t)(end - pos) * row);
        pos = end;
    }
}

size_t cpu_attend_span_work(const struct be_attn_params *p, int n_tok)
{
    size_t rows = (size_t)n_tok * (size_t)(p->n_heads / p->n_kv_heads), d = (size_t)p->head_dim;
    return ATTN_CHUNK * (rows + d) + d;
}

/* The rows of pt that hold token j's nq heads. */
static struct cpu_attn_part part_rows(const struct cpu_attn_part *pt, int j, int nq, int D)
{
    size_t r = (size_t)j * (size_t)nq;
    return (struct cpu_attn_part){.m = pt->m + r, .l = pt->l + r, .o = pt->o + r * (size_t)D};
}

/* Scales, caps and biases token j's scores of keys [a, b) of the chunk at
 * u0 (row g at s + g * n). */
static void shape_scores(const struct cpu_kern *k, const struct be_attn_params *p, int kvh, int nq, int64_t qpos,
                         float *s, int n, int64_t u0, int a, int b)
{
    for (int g = 0; g < nq; g++) {
        float *sg = s + (size_t)g * (size_t)n;
        k->scale(sg + a, p->scale, b - a);
        cpu_attn_softcap(sg + a, b - a, p->softcap);
        cpu_attn_rel_bias(p, kvh * nq + g, qpos, sg, u0, a, b);
    }
}

void cpu_attend_span(const struct cpu_kern *k, const struct be_attn_params *p, const struct be_kv_view *v, int kvh,
                     const struct cpu_attn_tile *t, struct cpu_attn_part *pt, float *scratch)
{
    int D = p->head_dim, nq = p->n_heads / p->n_kv_heads, R = t->n * nq;
    size_t esz = be_dtype_size(p->kv_dtype);
    int64_t lo = INT64_MAX, hi = INT64_MIN; /* the keys any token reads */
    for (int j = 0; j < t->n; j++)
        if (t->from[j] < t->to[j]) {
            lo = t->from[j] < lo ? t->from[j] : lo;
            hi = t->to[j] > hi ? t->to[j] : hi;
        }
    float *s = scratch;                              /* [R][a chunk] scores, then weights */
    float *rot = s + (size_t)R * ATTN_CHUNK;         /* [ATTN_CHUNK][D] keys rotated at read time */
    float *x = rot + (size_t)ATTN_CHUNK * (size_t)D; /* one key before its rotation */
    const char *rows[ATTN_CHUNK], *keys[ATTN_CHUNK];
    int64_t ahead = lo; /* prefetched below this */
    /* chunks on the multiples of ATTN_CHUNK, so a token's are the same in any tile */
    for (int64_t c0 = lo < hi ? lo - lo % ATTN_CHUNK : hi; c0 < hi; c0 += ATTN_CHUNK) {
        int64_t u0 = c0 > lo ? c0 : lo, u1 = c0 + ATTN_CHUNK < hi ? c0 + ATTN_CHUNK : hi;
        int n = (int)(u1 - u0);
        int64_t from = ahead > u1 ? ahead : u1;
        int64_t to = hi - u1 > CPU_PREFETCH_KEYS ? u1 + CPU_PREFETCH_KEYS : hi;
        if (from < to) /* the next chunks, while this one computes */
            prefetch_rows(v, kvh, D, esz, from, ahead = to);
        for (int i = 0, left = 0; i < n; i++, left--) {
            int64_t pos = u0 + i;
            if (left > 0) { /* a block's rows follow each other: one lookup per block */
                rows[i] = keys[i] = rows[i - 1] + (size_t)D * esz;
            } else {
                rows[i] = keys[i] = cpu_key_row(v, pos, kvh, D, esz);
                left = pos < v->sinks ? 1 : v->block_tokens - (int)((pos - v->base) % v->block_tokens);
            }
            if (v->key_rope) { /* rotated at its index, once for every query row */
                k->to_f32(x, rows[i], p->kv_dtype, (size_t)D);
                cpu_key_rope(p, v, pos, x, rot + (size_t)i * (size_t)D);
                keys[i] = (const char *)(rot + (size_t)i * (size_t)D);
            }
        }
        k->dot(s, t->q, R, keys, v->key_rope ? BE_F32 : p->kv_dtype, D, n);
        for (int j = 0; j < t->n; j++) {
            float *sj = s + (size_t)j * (size_t)nq * (size_t)n;
            int64_t a = t->from[j] - u0, b = t->to[j] - u0;
            a = a < 0 ? 0 : a;
            b = b > n ? n : b;
            if (a >= b) { /* none of this token's keys: its rows weigh nothing */
                memset(sj, 0, (size_t)nq * (size_t)n * sizeof(float));
                continue;
            }
            shape_scores(k, p, kvh, nq, t->pos[j], sj, n, u0, (int)a, (int)b);
            struct cpu_attn_part pj = part_rows(pt, j, nq, D);
            cpu_attn_fold(k, &pj, sj, (size_t)n, nq, (int)a, (int)b, D);
        }
        k->axpy(pt->o, s, R, rows, v->v_offset, p->kv_dtype, D, n, u0 % 2 != 0);
    }
}

/* ---- the driver ---- */

/* At most this many (token, kv head) pairs have their pieces spread over
 * the threads: a decode step's, or a small batch's.  More pairs keep every
 * thread busy a tile at a time. */
#define SPLIT_PAIRS 64

struct attn_run {
    struct cpu_ctx *c;
    const struct cpu_attn_src *src;
    float *out;
    const float *q;
    const struct be_tok *toks;
    int n_tok, nq, D, n_kv, nth;
    int tile;                  /* tokens per tile */
    size_t n_items;            /* items: (tile, kv head) pairs, or with split, pieces of (token, kv head) */
    size_t part;               /* floats of one token's piece state */
    bool split;
    size_t first[SPLIT_PAIRS + 1]; /* split: pair u's pieces are items [first[u], first[u + 1]) */
    _Atomic size_t next;
};

/* The pieces keys [c0, c1) cross (one when there are none). */
static int64_t n_pieces(int64_t c0, int64_t c1)
{
    return c1 > c0 ? (c1 - 1) / CPU_ATTN_PIECE - c0 / CPU_ATTN_PIECE + 1 : 1;
}

/* Piece i of keys [c0, c1), cut at the multiples of CPU_ATTN_PIECE. */
static void piece_keys(int64_t c0, int64_t c1, int64_t i, int64_t *p0, int64_t *p1)
{
    int64_t at = (c0 / CPU_ATTN_PIECE + i) * CPU_ATTN_PIECE;
    *p0 = at > c0 ? at : c0;
    *p1 = at + CPU_ATTN_PIECE < c1 ? at + CPU_ATTN_PIECE : c1;
}

/* pt over mem for rows query rows: m and l, then o. */
static void part_at(struct cpu_attn_part *pt, float *mem, int rows)
{
    pt->m = mem;
    pt->l = mem + rows;
    pt->o = mem + 2 * (size_t)rows;
}

static void part_clear(struct cpu_attn_part *pt, int rows, int D)
{
    for (int g = 0; g < rows; g++) {
        pt->m[g] = -INFINITY;
        pt->l[g] = 0.0f;
    }
    memset(pt->o, 0, (size_t)rows * (size_t)D * sizeof(float));
}

/* acc becomes the softmax over both pieces' keys (once per piece: a
 * plain loop).  A row empty in either takes the other's exactly. */
static void part_merge(struct cpu_attn_part *acc, const struct cpu_attn_part *pt, int rows, int D)
{
    for (int g = 0; g < rows; g++) {
        float m = acc->m[g] > pt->m[g] ? acc->m[g] : pt->m[g];
        if (m == -INFINITY) /* neither saw a key */
            continue;
        float fa = expf(acc->m[g] - m), fb = expf(pt->m[g] - m);
        float *o = acc->o + (size_t)g * (size_t)D;
        const float *po = pt->o + (size_t)g * (size_t)D;
        for (int i = 0; i < D; i++)
            o[i] = o[i] * fa + po[i] * fb;
        acc->l[g] = acc->l[g] * fa + pt->l[g] * fb;
        acc->m[g] = m;
    }
}

/* out[g] = o[g] / l[g] for token j's nq rows; a head that saw no key gets
 * zeros. */
static void part_finish(const struct cpu_kern *k, const struct cpu_attn_part *pt, int j, float *out, int nq, int D)
{
    struct cpu_attn_part pj = part_rows(pt, j, nq, D);
    for (int g = 0; g < nq; g++) {
        float *y = out + (size_t)g * (size_t)D;
        memcpy(y, pj.o + (size_t)g * (size_t)D, (size_t)D * sizeof(float));
        if (pj.l[g] > 0.0f)
            k->scale(y, 1.0f / pj.l[g], D);
    }
}

static float *out_rows(const struct attn_run *r, int t, int kvh)
{
    return r->out + ((size_t)t * (size_t)r->n_kv + (size_t)kvh) * (size_t)r->nq * (size_t)r->D;
}

static const float *q_rows(const struct attn_run *r, int t, int kvh)
{
    return r->q + ((size_t)t * (size_t)r->n_kv + (size_t)kvh) * (size_t)r->nq * (size_t)r->D;
}

/* Floats a tile of n tokens keeps past CPU_ATTN_WORK: its queries and two
 * piece states. */
static size_t tile_floats(const struct attn_run *r, int n)
{
    return (size_t)n * ((size_t)r->nq * (size_t)r->D + 2 * r->part);
}

/* The n tokens from t0 (one view) against kv head kvh, every piece of
 * their keys merged in order. */
static void attend_tile(struct attn_run *r, int t0, int n, int kvh, float *scratch)
{
    const struct cpu_kern *k = cpu_ctx_kern(r->c);
    int rows = n * r->nq;
    float *q = scratch + CPU_ATTN_WORK, *mem = q + (size_t)rows * (size_t)r->D;
    struct cpu_attn_part acc, pt;
    part_at(&acc, mem, rows);
    part_at(&pt, mem + (size_t)n * r->part, rows);
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int j = 0; j < n; j++) {
        int64_t c0, c1;
        r->src->keys(r->src, &r->toks[t0 + j], &c0, &c1);
        if (c0 < c1) {
            lo = c0 < lo ? c0 : lo;
            hi = c1 > hi ? c1 : hi;
        }
        memcpy(q + (size_t)j * (size_t)r->nq * (size_t)r->D, q_rows(r, t0 + j, kvh),
               (size_t)r->nq * (size_t)r->D * sizeof(float));
    }
    if (lo >= hi)
        lo = hi = 0;
    for (int64_t i = 0, np = n_pieces(lo, hi); i < np; i++) {
        int64_t p0, p1;
        piece_keys(lo, hi, i, &p0, &p1);
        part_clear(i ? &pt : &acc, rows, r->D);
        r->src->piece(r->src, k, &r->toks[t0], n, kvh, q, p0, p1, i ? &pt : &acc, scratch);
        if (i)
            part_merge(&acc, &pt, rows, r->D);
    }
    for (int j = 0; j < n; j++)
        part_finish(k, &acc, j, out_rows(r, t0 + j, kvh), r->nq, r->D);
}

/* Item i: the tokens [tile * (i / n_kv), + tile) against kv head i % n_kv,
 * a tile per run of one view's tokens (each token alone where its view's
 * tokens do not share tiles). */
static void attend_group(struct attn_run *r, size_t i, float *scratch)
{
    int kvh = (int)(i % (size_t)r->n_kv), t = (int)(i / (size_t)r->n_kv) * r->tile;
    int end = t + r->tile < r->n_tok ? t + r->tile : r->n_tok;
    while (t < end) {
        int n = 1, view = r->toks[t].view;
        if (r->src->tiles && r->src->tiles(r->src, view))
            while (t + n < end && r->toks[t + n].view == view)
                n++;
        attend_tile(r, t, n, kvh, scratch);
        t += n;
    }
}

/* Where split item i keeps its state: spread over the threads' scratch,
 * after each one's work area. */
static float *item_state(const struct attn_run *r, size_t i)
{
    return cpu_ctx_scratch(r->c, (int)(i % (size_t)r->nth)) + CPU_ATTN_WORK + i / (size_t)r->nth * r->part;
}

static void attend_item(struct attn_run *r, size_t i, float *scratch)
{
    size_t u = 0;
    while (i >= r->first[u + 1])
        u++;
    int t = (int)(u / (size_t)r->n_kv), kvh = (int)(u % (size_t)r->n_kv);
    int64_t c0, c1, p0, p1;
    r->src->keys(r->src, &r->toks[t], &c0, &c1);
    piece_keys(c0, c1, (int64_t)(i - r->first[u]), &p0, &p1);
    struct cpu_attn_part pt;
    part_at(&pt, item_state(r, i), r->nq);
    part_clear(&pt, r->nq, r->D);
    r->src->piece(r->src, cpu_ctx_kern(r->c), &r->toks[t], 1, kvh, q_rows(r, t, kvh), p0, p1, &pt, scratch);
}

static void attn_job(void *arg, int ith, int nth)
{
    struct attn_run *r = arg;
    float *scratch = cpu_ctx_scratch(r->c, ith);
    (void)nth;
    /* grabbed one at a time: a causal prompt's later tokens have more keys */
    for (size_t i; (i = atomic_fetch_add(&r->next, 1)) < r->n_items;) {
        if (r->split)
            attend_item(r, i, scratch);
        else
            attend_group(r, i, scratch);
    }
}

enum be_status cpu_attn_run(struct cpu_ctx *c, const struct cpu_attn_src *src, float *out, const float *q,
                            const struct be_tok *toks, int n_tok)
{
    const struct be_attn_params *p = src->p;
    struct attn_run r = {.c = c, .src = src, .out = out, .q = q, .toks = toks, .n_tok = n_tok,
                         .nq = p->n_heads / p->n_kv_heads, .D = p->head_dim, .n_kv = p->n_kv_heads,
                         .nth = cpu_pool_size(cpu_ctx_pool(c)), .tile = 1};
    size_t room = CPU_SCRATCH_FLOATS - CPU_ATTN_WORK;
    r.part = (size_t)r.nq * ((size_t)r.D + 2);
    if (tile_floats(&r, 1) > room)
        return BE_ENOTSUP; /* far beyond any model: a kv head read by 300 query heads of 256 */
    if (src->tiles) /* as many tokens as fit the scratch, up to the row budget */
        for (int t = CPU_ATTN_TILE_ROWS / r.nq < CPU_ATTN_TILE ? CPU_ATTN_TILE_ROWS / r.nq : CPU_ATTN_TILE; t > 1; t--)
            if (tile_floats(&r, t) <= room && cpu_attend_span_work(p, t) <= CPU_ATTN_WORK) {
                r.tile = t;
                break;
            }
    size_t n_pairs = (size_t)n_tok * (size_t)r.n_kv;
    r.n_items = ((size_t)n_tok + (size_t)r.tile - 1) / (size_t)r.tile * (size_t)r.n_kv;
    /* Too few pairs to keep every thread busy: hand out their pieces,
     * whose states then wait in the scratch for the merge below. */
    if (r.nth > 1 && n_pairs < 4 * (size_t)r.nth && n_pairs <= SPLIT_PAIRS) {
        r.first[0] = 0;
        for (size_t u = 0; u < n_pairs; u++) {
            int64_t c0, c1;
            src->keys(src, &toks[u / (size_t)r.n_kv], &c0, &c1);
            r.first[u + 1] = r.first[u] + (size_t)n_pieces(c0, c1);
        }
        r.split = r.first[n_pairs] > n_pairs && r.first[n_pairs] <= room / r.part * (size_t)r.nth;
        if (r.split)
            r.n_items = r.first[n_pairs];
    }
    atomic_init(&r.next, 0);
    /* even one decode token reads its whole context: always worth the pool */
    cpu_pool_run(cpu_ctx_pool(c), attn_job, &r);
    if (!r.split)
        return BE_OK;
    const struct cpu_kern *k = cpu_ctx_kern(c);
    for (size_t u = 0; u < n_pairs; u++) {
        struct cpu_attn_part acc, pt;
        part_at(&acc, item_state(&r, r.first[u]), r.nq);
        for (size_t i = r.first[u] + 1; i < r.first[u + 1]; i++) {
            part_at(&pt, item_state(&r, i), r.nq);
            part_merge(&acc, &pt, r.nq, r.D);
        }
        part_finish(k, &acc, 0, out_rows(&r, (int)(u / (size_t)r.n_kv), (int)(u % (size_t)r.n_kv)), r.nq, r.D);
    }
    return BE_OK;
}

/* ---- the dense cache ---- */

/* The keys of the token at qpos beyond the view's sinks: [*k0, *k1)
 * (causal, windowed, within [lo, hi)), possibly empty. */
static void dense_keys(const struct be_attn_params *p, const struct be_kv_view *v, int64_t qpos, int64_t *k0,
                       int64_t *k1)
{
    int64_t lo = v->lo, hi = qpos + 1 < v->hi && !p->bidirectional ? qpos + 1 : v->hi;
    int window = v->window ? v->window : p->window;
    if (window > 0 && qpos - window + 1 > lo)
        lo = qpos - window + 1;
    *k0 = lo;
    *k1 = hi > lo ? hi : lo;
}

/* A view without sinks orders its keys by position; one with sinks puts
 * them first, then the token's others: [0, sinks + k1 - k0). */
static void dense_src_keys(const struct cpu_attn_src *s, const struct be_tok *t, int64_t *c0, int64_t *c1)
{
    const struct be_kv_view *v = (const struct be_kv_view *)s->views + t->view;
    dense_keys(s->p, v, t->pos, c0, c1);
    if (v->sinks) {
        *c1 = v->sinks + (*c1 - *c0);
        *c0 = 0;
    }
}

static bool dense_tiles(const struct cpu_attn_src *s, int view)
{
    return ((const struct be_kv_view *)s->views)[view].sinks == 0;
}

static void dense_piece(const struct cpu_attn_src *s, const struct cpu_kern *k, const struct be_tok *toks, int n,
                        int kvh, const float *q, int64_t c0, int64_t c1, struct cpu_attn_part *pt, float *scratch)
{
    const struct be_kv_view *v = (const struct be_kv_view *)s->views + toks[0].view;
    struct cpu_attn_tile t = {.n = n, .q = q};
    int64_t S = v->sinks, k0, k1;
    if (!S) {
        for (int j = 0; j < n; j++) {
            dense_keys(s->p, v, toks[j].pos, &k0, &k1);
            t.pos[j] = toks[j].pos;
            t.from[j] = k0 > c0 ? k0 : c0;
            t.to[j] = k1 < c1 ? k1 : c1;
        }
        cpu_attend_span(k, s->p, v, kvh, &t, pt, scratch);
        return;
    }
    /* one token: the sinks within [c0, c1), then its other keys */
    dense_keys(s->p, v, toks[0].pos, &k0, &k1);
    t.pos[0] = toks[0].pos;
    t.from[0] = c0;
    t.to[0] = c1 < S ? c1 : S;
    cpu_attend_span(k, s->p, v, kvh, &t, pt, scratch);
    t.from[0] = k0 + (c0 > S ? c0 - S : 0);
    t.to[0] = c1 > S ? k0 + (c1 - S) : t.from[0];
    cpu_attend_span(k, s->p, v, kvh, &t, pt, scratch);
}

enum be_status cpu_attention(void *ctx, void *out_, const void *q_, const struct be_kv_view *views,
                             const struct be_tok *toks, int n_tok, const struct be_attn_params *p)
{
    float *out = out_;
    const float *q = q_;
    if (cpu_attend_span_work(p, 1) > CPU_ATTN_WORK)
        return BE_ENOTSUP; /* far beyond any model: head_dim above 2000 */
    struct cpu_attn_src src = {.p = p, .views = views, .keys = dense_src_keys, .tiles = dense_tiles, .piece = dense_piece};
    return cpu_attn_run(ctx, &src, out, q, toks, n_tok);
}

/* ---- state-space layers (Mamba) ------------------------------------------- */

/* Both kernels split the channels between the threads: a channel's window
 * and state are its own, and its rows run in order through each view. */
struct ssm_job {
    struct cpu_ctx *c;
    float *y;
    const float *x, *dt, *B, *C, *z;
    const struct be_ssm_view *views;
    const struct be_tok *toks;
    int n_tok;
    const struct be_ssm_params *p;
};

static void ssm_conv_job(void *arg, int ith, int nth)
{
    const struct ssm_job *j = arg;
    const struct be_ssm_params *p = j->p;
    int di = p->d_inner, K = p->d_conv;
    size_t lo, hi;
    split((size_t)di, ith, nth, 16, &lo, &hi);
    for (int t0 = 0; t0 < j->n_tok;) {
        int v = j->toks[t0].view, t1 = t0;
        while (t1 < j->n_tok && j->toks[t1].view == v)
            t1++;
        const float *win_in = j->views[v].in;
        float *win_out = j->views[v].out;
        for (size_t i = lo; i < hi; i++) {
            const float *w = p->conv_w + i * (size_t)K;
            float buf[BE_SSM_MAX_CONV]; /* the last K inputs, oldest first */
            for (int k = 0; k < K - 1; k++)
                buf[k] = win_in[(size_t)k * di + i];
            for (int t = t0; t < t1; t++) {
                buf[K - 1] = j->x[(size_t)t * di + i];
                float acc = p->conv_b ? p->conv_b[i] : 0.0f;
                for (int k = 0; k < K; k++)
                    acc += w[k] * buf[k];
                j->y[(size_t)t * di + i] = acc / (1.0f + expf(-acc));
                for (int k = 0; k < K - 1; k++)
                    buf[k] = buf[k + 1];
            }
            for (int k = 0; k < K - 1; k++)
                win_out[(size_t)k * di + i] = buf[k];
        }
        t0 = t1;
    }
}

enum be_status cpu_ssm_conv(void *ctx, void *y, const void *x, const struct be_ssm_view *views,
                            const struct be_tok *toks, int n_tok, const struct be_ssm_params *p)
{
    struct ssm_job j = {.c = ctx, .y = y, .x = x, .views = views, .toks = toks, .n_tok = n_tok, .p = p};
    run(j.c, ssm_conv_job, &j, (size_t)n_tok * (size_t)p->d_inner * (size_t)p->d_conv);
    return BE_OK;
}

/* The kernel table scans a thread's channels through each view's rows in
 * turn (a view's rows are consecutive). */
static void ssm_scan_job(void *arg, int ith, int nth)
{
    const struct ssm_job *j = arg;
    const struct be_ssm_params *p = j->p;
    int di = p->d_inner;
    size_t h_off = (size_t)(p->d_conv - 1) * di; /* floats: h follows the window */
    size_t lo, hi;
    split((size_t)di, ith, nth, 16, &lo, &hi);
    for (int t0 = 0; t0 < j->n_tok;) {
        int v = j->toks[t0].view, t1 = t0;
        while (t1 < j->n_tok && j->toks[t1].view == v)
            t1++;
        struct cpu_ssm a = {.y = j->y, .x = j->x, .dt = j->dt, .B = j->B, .C = j->C, .z = j->z,
                            .h_in = (const float *)j->views[v].in + h_off, .h_out = (float *)j->views[v].out + h_off,
                            .t0 = t0, .t1 = t1, .p = p};
        cpu_ctx_kern(j->c)->ssm_scan(&a, lo, hi);
        t0 = t1;
    }
}

enum be_status cpu_ssm_scan(void *ctx, void *y, const void *x, const void *dt_raw, const void *B, const void *C,
                            const void *z, const struct be_ssm_view *views, const struct be_tok *toks, int n_tok,
                            const struct be_ssm_params *p)
{
    struct ssm_job j = {.c = ctx, .y = y, .x = x, .dt = dt_raw, .B = B, .C = C, .z = z, .views = views,
                        .toks = toks, .n_tok = n_tok, .p = p};
    run(j.c, ssm_scan_job, &j, (size_t)n_tok * (size_t)p->d_inner * (size_t)p->d_state * 4);
    return BE_OK;
}

/* ---- element-wise and row-wise ------------------------------------------- */

struct elem_job {
    struct cpu_ctx *c;
    float *y;
    const float *a, *b;
    size_t n;
    float s;
    enum be_act act; /* act_job's */
};

static void silu_mul_job(void *arg, int ith, int nth)
{
    struct elem_job *j = arg;
    size_t lo, hi;
    split(j->n, ith, nth, 16, &lo, &hi);
    for (size_t i = lo; i < hi; i++) {
        float g = j->a[i];
        j->y[i] = g / (1.0f + expf(-g)) * j->b[i];
    }
}

enum be_status cpu_silu_mul(void *ctx, void *y_, const void *gate_, const void *up_, size_t n)
{
    float *y = y_;
    const float *gate = gate_;
    const float *up = up_;
    struct elem_job j = {.c = ctx, .y = y, .a = gate, .b = up, .n = n};
    run(j.c, silu_mul_job, &j, n * 8);
    return BE_OK;
}

/* gelu_tanh(g) = g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))) */
static void gelu_mul_job(void *arg, int ith, int nth)
{
    struct elem_job *j = arg;
    size_t lo, hi;
    split(j->n, ith, nth, 16, &lo, &hi);
    const float c = 0.7978845608028654f; /* sqrt(2/pi) */
    for (size_t i = lo; i < hi; i++) {
        float g = j->a[i];
        float y = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g)));
        j->y[i] = j->b ? y * j->b[i] : y;
    }
}

enum be_status cpu_gelu_mul(void *ctx, void *y_, const void *gate_, const void *up_, size_t n)
{
    float *y = y_;
    const float *gate = gate_;
    const float *up = up_;
    struct elem_job j = {.c = ctx, .y = y, .a = gate, .b = up, .n = n};
    run(j.c, gelu_mul_job, &j, n * 8);
    return BE_OK;
}

static void act_job(void *arg, int ith, int nth)
{
    struct elem_job *j = arg;
    size_t lo, hi;
    split(j->n, ith, nth, 16, &lo, &hi);
    for (size_t i = lo; i < hi; i++) {
        float x = j->y[i];
        /* erf GELU: x/2 * (1 + erf(x / sqrt 2)) */
        j->y[i] = j->act == BE_ACT_RELU ? (x > 0.0f ? x : 0.0f) : 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    }
}

enum be_status cpu_act(void *ctx, void *x_, size_t n, enum be_act act)
{
    float *x = x_;
    struct elem_job j = {.c = ctx, .y = x, .n = n, .act = act};
    run(j.c, act_job, &j, n * 8);
    return BE_OK;
}

static void scale_job(void *arg, int ith, int nth)
{
    struct elem_job *j = arg;
    size_t lo, hi;
    split(j->n, ith, nth, 16, &lo, &hi);
    if (lo < hi)
        cpu_ctx_kern(j->c)->scale(j->y + lo, j->s, (int)(hi - lo));
}

enum be_status cpu_scale(void *ctx, void *x_, size_t n, float s)
{
    float *x = x_;
    struct elem_job j = {.c = ctx, .y = x, .n = n, .s = s};
    run(j.c, scale_job, &j, n);
    return BE_OK;
}

static void add_job(void *arg, int ith, int nth)
{
    struct elem_job *j = arg;
    size_t lo, hi;
    split(j->n, ith, nth, 16, &lo, &hi);
    if (lo < hi)
        cpu_ctx_kern(j->c)->add(j->y + lo, j->a + lo, hi - lo);
}

enum be_status cpu_add(void *ctx, void *y_, const void *x_, size_t n)
{
    float *y = y_;
    const float *x = x_;
    struct elem_job j = {.c = ctx, .y = y, .a = x, .n = n};
    run(j.c, add_job, &j, n);
    return BE_OK;
}

static void softmax_job(void *arg, int ith, int nth)
{
    struct rows_job *j = arg;
    size_t r0, r1;
    split((size_t)j->rows, ith, nth, 1, &r0, &r1);
    for (size_t r = r0; r < r1; r++) {
        float *x = j->y + r * (size_t)j->cols, m = x[0], sum = 0.0f;
        for (int i = 1; i < j->cols; i++)
            m = x[i] > m ? x[i] : m;
        for (int i = 0; i < j->cols; i++)
            sum += (x[i] = expf(x[i] - m));
        cpu_ctx_kern(j->c)->scale(x, 1.0f / sum, j->cols);
    }
}

enum be_status cpu_softmax(void *ctx, void *x_, int rows, int cols)
{
    float *x = x_;
    struct rows_job j = {.c = ctx, .y = x, .rows = rows, .cols = cols};
    run(j.c, softmax_job, &j, (size_t)rows * (size_t)cols * 8);
    return BE_OK;
}

enum be_status cpu_embed(void *ctx, void *y_, const void *table, enum be_dtype dt, const int32_t *ids, int n,
                         int dim)
{
    float *y = y_;
    const struct cpu_kern *k = cpu_ctx_kern(ctx);
    size_t row = (size_t)dim * be_dtype_size(dt);
    for (int t = 0; t < n; t++)
        k->to_f32(y + (size_t)t * (size_t)dim, (const char *)table + (size_t)ids[t] * row, dt, (size_t)dim);
    return BE_OK;
}

enum be_status cpu_argmax(void *ctx, const void *x_, int rows, int cols, int32_t *out)
{
    const float *x = x_;
    (void)ctx;
    for (int r = 0; r < rows; r++) {
        const float *v = x + (size_t)r * (size_t)cols;
        int32_t best = 0;
        /* a strict > keeps the first index on ties and never picks a NaN
         * over a number */
        for (int32_t i = 1; i < cols; i++)
            if (v[i] > v[best] || v[best] != v[best])
                best = i;
        out[r] = best;
    }
    return BE_OK;
}
