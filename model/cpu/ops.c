/* ops.c - the CPU kernels behind backend.h: threading and the loops over
 * tokens, heads and rows; the inner loops come from the SIMD table the
 * backend picked (cpu.h).  Arguments were validated by backend.c.
 */
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "model/cpu/cpu.h"

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

enum be_status cpu_matmul(void *ctx, float *y, const float *x, const void *w, enum be_dtype wt, const float *bias,
                          int n, int in, int out)
{
    struct matmul_job j = {
        .c = ctx,
        .mm = {.y = y, .x = x, .w = w, .wt = wt, .n = n, .in = in, .out = out},
        .bias = bias,
    };
    /* about 8 grabs per thread: small enough to rebalance, large enough
     * that each grab's per-call setup (x deinterleave, sgemm panel) stays
     * negligible */
    size_t per = (size_t)out / (8 * (size_t)cpu_pool_size(cpu_ctx_pool(j.c))) / 16 * 16;
    j.chunk = per < 64 ? 64 : per;
    atomic_init(&j.next, 0);
    run(j.c, matmul_job, &j, (size_t)in * (size_t)out);
    return BE_OK;
}

/* ---- rmsnorm ------------------------------------------------------------ */

struct rows_job {
    struct cpu_ctx *c;
    float *y;
    const float *x, *w;
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

enum be_status cpu_rmsnorm(void *ctx, float *y, const float *x, const float *w, int n, int dim, float eps)
{
    struct rows_job j = {.c = ctx, .y = y, .x = x, .w = w, .rows = n, .cols = dim, .eps = eps};
    run(j.c, rmsnorm_job, &j, (size_t)n * (size_t)dim);
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
                cs[i] = cosf(a);
                sn[i] = sinf(a);
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

enum be_status cpu_rope(void *ctx, float *x, int n_tok, int n_heads, int head_dim, const int64_t *pos,
                        const float *inv_freq, int rot_dim, enum be_rope_layout layout)
{
    struct rope_job j = {.x = x, .n_tok = n_tok, .n_heads = n_heads, .head_dim = head_dim, .rot_dim = rot_dim,
                         .pos = pos, .inv_freq = inv_freq, .layout = layout};
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
                            const float *k, const float *v, const struct be_attn_params *p)
{
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

/* Online softmax (running max and sum, rescaling the output when the max
 * grows) over chunks of keys, so any context length needs only a small
 * stack array of scores; everything in f32. */
#define ATTN_CHUNK 64

struct attn_job {
    struct cpu_ctx *c;
    float *out;
    const float *q;
    const struct be_kv_view *views;
    const struct be_tok *toks;
    int n_tok;
    const struct be_attn_params *p;
};

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

/* One query against its keys: the view's sinks, then [k0, k1) (causal,
 * windowed, within [lo, hi)).  scratch: 2 * head_dim floats for a key
 * rotated at read time (key_rope views). */
static void attend_one(const struct cpu_kern *k, const struct be_attn_params *p, const struct be_kv_view *v,
                       int64_t qpos, int kvh, const float *q, float *o, float *scratch)
{
    size_t esz = be_dtype_size(p->kv_dtype);
    int64_t k0 = v->lo, k1 = qpos + 1 < v->hi ? qpos + 1 : v->hi;
    int window = v->window ? v->window : p->window;
    if (window > 0 && qpos - window + 1 > k0)
        k0 = qpos - window + 1;
    int64_t n_keys = v->sinks + (k1 > k0 ? k1 - k0 : 0);
    float *rot = scratch + p->head_dim;
    memset(o, 0, (size_t)p->head_dim * sizeof(float));
    float m = -INFINITY, l = 0.0f, s[ATTN_CHUNK];
    const char *rows[ATTN_CHUNK];
    for (int64_t c0 = 0; c0 < n_keys; c0 += ATTN_CHUNK) {
        int nc = n_keys - c0 < ATTN_CHUNK ? (int)(n_keys - c0) : ATTN_CHUNK;
        for (int i = 0; i < nc; i++) {
            int64_t pos = c0 + i < v->sinks ? c0 + i : k0 + (c0 + i - v->sinks);
            rows[i] = cpu_key_row(v, pos, kvh, p->head_dim, esz);
            if (v->key_rope) { /* each key rotated at its index before its dot */
                k->to_f32(scratch, rows[i], p->kv_dtype, (size_t)p->head_dim);
                cpu_key_rope(p, v, pos, scratch, rot);
                k->dot(&s[i], q, &(const char *){(const char *)rot}, BE_F32, p->head_dim, 1);
            }
        }
        if (!v->key_rope)
            k->dot(s, q, rows, p->kv_dtype, p->head_dim, nc);
        float cm = m;
        for (int i = 0; i < nc; i++) {
            s[i] *= p->scale;
            if (s[i] > cm)
                cm = s[i];
        }
        if (cm > m) {
            float f = expf(m - cm);
            l *= f;
            k->scale(o, f, p->head_dim);
            m = cm;
        }
        for (int i = 0; i < nc; i++) {
            s[i] = expf(s[i] - m); /* the score becomes the value's weight */
            l += s[i];
        }
        k->axpy(o, s, rows, v->v_offset, p->kv_dtype, p->head_dim, nc);
    }
    if (l > 0.0f)
        k->scale(o, 1.0f / l, p->head_dim);
}

static void attn_job(void *arg, int ith, int nth)
{
    struct attn_job *j = arg;
    const struct be_attn_params *p = j->p;
    const struct cpu_kern *k = cpu_ctx_kern(j->c);
    float *scratch = cpu_ctx_scratch(j->c, ith);
    int group = p->n_heads / p->n_kv_heads;
    size_t i0, i1;
    split((size_t)j->n_tok * (size_t)p->n_heads, ith, nth, 1, &i0, &i1);
    for (size_t i = i0; i < i1; i++) {
        size_t t = i / (size_t)p->n_heads;
        int h = (int)(i % (size_t)p->n_heads);
        size_t off = i * (size_t)p->head_dim;
        attend_one(k, p, &j->views[j->toks[t].view], j->toks[t].pos, h / group, j->q + off, j->out + off,
                   scratch);
    }
}

enum be_status cpu_attention(void *ctx, float *out, const float *q, const struct be_kv_view *views,
                             const struct be_tok *toks, int n_tok, const struct be_attn_params *p)
{
    struct attn_job j = {.c = ctx, .out = out, .q = q, .views = views, .toks = toks, .n_tok = n_tok, .p = p};
    /* even one decode token reads its whole context: always worth the pool */
    cpu_pool_run(cpu_ctx_pool(j.c), attn_job, &j);
    return BE_OK;
}

/* ---- element-wise and row-wise ------------------------------------------- */

struct elem_job {
    struct cpu_ctx *c;
    float *y;
    const float *a, *b;
    size_t n;
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

enum be_status cpu_silu_mul(void *ctx, float *y, const float *gate, const float *up, size_t n)
{
    struct elem_job j = {.c = ctx, .y = y, .a = gate, .b = up, .n = n};
    run(j.c, silu_mul_job, &j, n * 8);
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

enum be_status cpu_add(void *ctx, float *y, const float *x, size_t n)
{
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

enum be_status cpu_softmax(void *ctx, float *x, int rows, int cols)
{
    struct rows_job j = {.c = ctx, .y = x, .rows = rows, .cols = cols};
    run(j.c, softmax_job, &j, (size_t)rows * (size_t)cols * 8);
    return BE_OK;
}

enum be_status cpu_embed(void *ctx, float *y, const void *table, enum be_dtype dt, const int32_t *ids, int n,
                         int dim)
{
    const struct cpu_kern *k = cpu_ctx_kern(ctx);
    size_t row = (size_t)dim * be_dtype_size(dt);
    for (int t = 0; t < n; t++)
        k->to_f32(y + (size_t)t * (size_t)dim, (const char *)table + (size_t)ids[t] * row, dt, (size_t)dim);
    return BE_OK;
}

enum be_status cpu_argmax(void *ctx, const float *x, int rows, int cols, int32_t *out)
{
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
