/* attn_quant.c - attention over quantized KV blocks (backend.h's
 * be_kvq_view): the driver, and the scalar code loops that are the
 * reference for the SIMD tables (attn_quant_avx512.c).
 *
 * NOTES
 * Nothing is dequantized into memory.  An affine code c with group
 * parameters (s, b) means c*s + b (quanto: b = -shift; hqq: b = -zero*s),
 * so the loops work on the raw codes and apply s and b per group:
 *   per-token K:   q.k = sum_g s_g * (q_g . c_g) + b_g * sum(q_g)
 *   per-channel K: q.k = (q*s) . c + q . b      (q*s, q.b once per group row)
 *   per-token V:   o_g += (p*s_g) c_g, and p*b_g summed per group
 *   per-channel V: acc += p c over a group row, then o += s*acc + b*sum(p)
 * Keys are visited in chunks that never straddle a group row, and the
 * online softmax (running max m and sum l, rescaling o when m grows) is
 * folded once per chunk, so the per-chunk accumulators need no rescaling.
 * The full-precision rest of the view continues the same softmax.
 * Views whose keys are stored before RoPE (rest.key_rope, the sink
 * strategy) are the exception: a rotation mixes the channels of a pair, so
 * each key is decoded into a row of its own (c*s + b per code, through the
 * same code loops), rotated at its index in the cache as be_attention
 * rotates a full-precision key, then dotted; values are read as above.
 * The sinks (rest.sinks, full precision in rest.sink_block) come first.
 */
#include <math.h>
#include <string.h>

#include "model/cpu/cpu.h"
#include "model/cpu/kvq_format.h"

/* Keys per chunk when no per-channel group fixes it. */
#define QATTN_CHUNK 64

/* ---- scalar code loops -------------------------------------------------- */

void cpu_qdot_scalar(float *s, const float *x, const uint8_t *c, size_t stride, int nbits, int n, int rows)
{
    for (int r = 0; r < rows; r++) {
        float acc = 0.0f;
        for (int i = 0; i < n; i++)
            acc += x[i] * (float)kvq_code_get(c + (size_t)r * stride, nbits, i);
        s[r] = acc;
    }
}

void cpu_qaxpy_scalar(float *y, const float *a, const uint8_t *c, size_t stride, int nbits, int n, int rows)
{
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < n; i++)
            y[i] += a[r] * (float)kvq_code_get(c + (size_t)r * stride, nbits, i);
}

float cpu_e4m3_dot_scalar(const float *x, const uint8_t *c, int n)
{
    float acc = 0.0f;
    for (int i = 0; i < n; i++)
        acc += x[i] * e4m3_to_f32(c[i]);
    return acc;
}

void cpu_e4m3_axpy_scalar(float *y, float a, const uint8_t *c, int n)
{
    for (int i = 0; i < n; i++)
        y[i] += a * e4m3_to_f32(c[i]);
}

const struct cpu_qkern cpu_qkern_scalar = {
    .name = "scalar",
    .qdot = cpu_qdot_scalar,
    .qaxpy = cpu_qaxpy_scalar,
    .e4m3_dot = cpu_e4m3_dot_scalar,
    .e4m3_axpy = cpu_e4m3_axpy_scalar,
};

const struct cpu_qkern *cpu_qkern_for(const struct cpu_kern *k)
{
    return k == &cpu_kern_avx512 ? &cpu_qkern_avx512 : &cpu_qkern_scalar;
}

/* The (s, b) of group (group row gr, group column gc) of head kvh, in the
 * c*s + b form. */
static void group_sb(const struct be_kvq_format *f, const struct be_kvq_half *h, const void *blk, int kvh, int gr,
                     int gc, float *s, float *b)
{
    const uint16_t *pr = kvq_group_params(f, h, blk, kvh, gr, gc);
    float scale = f16_to_f32(pr[0]), zero = f16_to_f32(pr[1]);
    *s = scale;
    *b = f->kind == BE_KVQ_AFFINE_SHIFT ? -zero : -zero * scale;
}

/* ---- the driver ---------------------------------------------------------- */

/* Per-thread scratch, carved from cpu_ctx_scratch: chunk scores and a
 * chunk of per-row partials (per-token groups), q*s of a group row,
 * per-group sums of q, and the V accumulators. */
struct qattn {
    const struct cpu_kern *k;
    const struct cpu_qkern *qk;
    const struct be_attn_params *p;
    const struct be_kvq_view *v;
    int kvh;
    const float *q;
    float *o;
    float m, l;
    float *s, *t, *qs, *qsum, *acc; /* s, t: a chunk of rows each */
    float *ks, *kb, *krow, *krot; /* key_rope views: a group row's (s, b), one key decoded and rotated */
};

/* Folds the chunk's scores s[0..n) into the running max and sum, rescaling
 * o, and leaves each key's softmax weight (unnormalised) in s. */
static void fold_chunk(struct qattn *a, int n)
{
    float cm = a->m;
    for (int i = 0; i < n; i++)
        cm = a->s[i] > cm ? a->s[i] : cm;
    if (cm > a->m) {
        float f = expf(a->m - cm);
        a->l *= f;
        a->k->scale(a->o, f, a->p->head_dim);
        a->m = cm;
    }
    for (int i = 0; i < n; i++) {
        a->s[i] = expf(a->s[i] - a->m);
        a->l += a->s[i];
    }
}

/* Scores of keys stored before RoPE: key t0 + i (position pos0 + i) is
 * decoded into krow, rotated into krot, then dotted with q. */
static void key_scores_rope(struct qattn *a, const void *blk, int64_t pos0, int t0, int n)
{
    const struct be_kvq_format *f = a->v->fmt;
    const struct be_kvq_half *h = &f->k;
    int D = f->head_dim;
    bool affine = f->kind != BE_KVQ_E4M3;
    if (affine && h->gt > 1) /* per-channel: one group row for the whole chunk */
        for (int d = 0; d < D; d++)
            group_sb(f, h, blk, a->kvh, t0 / h->gt, d, &a->ks[d], &a->kb[d]);
    size_t gbytes = affine && h->gt == 1 ? (size_t)h->gd * (size_t)f->nbits / 8 : 0;
    for (int i = 0; i < n; i++) {
        const uint8_t *c = kvq_code_row(f, h, blk, a->kvh, t0 + i);
        memset(a->krow, 0, (size_t)D * sizeof(float));
        if (!affine) {
            a->qk->e4m3_axpy(a->krow, a->v->scale_k, c, D);
        } else if (h->gt > 1) {
            a->qk->qaxpy(a->krow, &(const float){1.0f}, c, 0, f->nbits, D, 1);
            for (int d = 0; d < D; d++)
                a->krow[d] = a->krow[d] * a->ks[d] + a->kb[d];
        } else {
            for (int g = 0; g < D / h->gd; g++) {
                float s, b;
                group_sb(f, h, blk, a->kvh, t0 + i, g, &s, &b);
                a->qk->qaxpy(a->krow + g * h->gd, &s, c + (size_t)g * gbytes, 0, f->nbits, h->gd, 1);
                for (int d = g * h->gd; d < (g + 1) * h->gd; d++)
                    a->krow[d] += b;
            }
        }
        cpu_key_rope(a->p, &a->v->rest, pos0 + i, a->krow, a->krot);
        a->k->dot(&a->s[i], a->q, &(const char *){(const char *)a->krot}, BE_F32, D, 1);
        a->s[i] *= a->p->scale;
    }
}

static void key_scores(struct qattn *a, const void *blk, int64_t pos0, int t0, int n)
{
    const struct be_kvq_format *f = a->v->fmt;
    const struct be_kvq_half *h = &f->k;
    int D = f->head_dim;
    if (a->v->rest.key_rope) {
        key_scores_rope(a, blk, pos0, t0, n);
        return;
    }
    if (f->kind == BE_KVQ_E4M3) {
        for (int i = 0; i < n; i++)
            a->s[i] = a->qk->e4m3_dot(a->q, kvq_code_row(f, h, blk, a->kvh, t0 + i), D) * a->v->scale_k * a->p->scale;
        return;
    }
    if (h->gt > 1) { /* per-channel: one group row for the whole chunk */
        float qb = 0.0f, s, b;
        for (int d = 0; d < D; d++) {
            group_sb(f, h, blk, a->kvh, t0 / h->gt, d, &s, &b);
            a->qs[d] = a->q[d] * s;
            qb += a->q[d] * b;
        }
        a->qk->qdot(a->s, a->qs, kvq_code_row(f, h, blk, a->kvh, t0), kvq_row_bytes(f), f->nbits, D, n);
        for (int i = 0; i < n; i++)
            a->s[i] = (a->s[i] + qb) * a->p->scale;
        return;
    }
    /* per-token groups: group g of every row of the chunk in one call, then
     * each row's (s, b) of that group */
    const uint8_t *c0 = kvq_code_row(f, h, blk, a->kvh, t0);
    size_t gbytes = (size_t)h->gd * (size_t)f->nbits / 8;
    memset(a->s, 0, (size_t)n * sizeof(float));
    for (int g = 0; g < D / h->gd; g++) {
        a->qk->qdot(a->t, a->q + g * h->gd, c0 + (size_t)g * gbytes, kvq_row_bytes(f), f->nbits, h->gd, n);
        for (int i = 0; i < n; i++) {
            float sc, b;
            group_sb(f, h, blk, a->kvh, t0 + i, g, &sc, &b);
            a->s[i] += sc * a->t[i] + b * a->qsum[g];
        }
    }
    for (int i = 0; i < n; i++)
        a->s[i] *= a->p->scale;
}

static void value_accumulate(struct qattn *a, const void *blk, int t0, int n)
{
    const struct be_kvq_format *f = a->v->fmt;
    const struct be_kvq_half *h = &f->v;
    int D = f->head_dim;
    if (f->kind == BE_KVQ_E4M3) {
        for (int i = 0; i < n; i++)
            a->qk->e4m3_axpy(a->o, a->s[i] * a->v->scale_v, kvq_code_row(f, h, blk, a->kvh, t0 + i), D);
        return;
    }
    if (h->gt > 1) {
        float psum = 0.0f, s, b;
        memset(a->acc, 0, (size_t)D * sizeof(float));
        a->qk->qaxpy(a->acc, a->s, kvq_code_row(f, h, blk, a->kvh, t0), kvq_row_bytes(f), f->nbits, D, n);
        for (int i = 0; i < n; i++)
            psum += a->s[i];
        for (int d = 0; d < D; d++) {
            group_sb(f, h, blk, a->kvh, t0 / h->gt, d, &s, &b);
            a->o[d] += s * a->acc[d] + b * psum;
        }
        return;
    }
    /* per-token groups: group g of every row weighted by p_i * s_i in one
     * call; the zero points add sum p_i * b_i to each channel of the group */
    const uint8_t *c0 = kvq_code_row(f, h, blk, a->kvh, t0);
    size_t gbytes = (size_t)h->gd * (size_t)f->nbits / 8;
    for (int g = 0; g < D / h->gd; g++) {
        float bsum = 0.0f;
        for (int i = 0; i < n; i++) {
            float sc, b;
            group_sb(f, h, blk, a->kvh, t0 + i, g, &sc, &b);
            a->t[i] = a->s[i] * sc;
            bsum += a->s[i] * b;
        }
        a->qk->qaxpy(a->o + g * h->gd, a->t, c0 + (size_t)g * gbytes, kvq_row_bytes(f), f->nbits, h->gd, n);
        for (int d = g * h->gd; d < (g + 1) * h->gd; d++)
            a->o[d] += bsum;
    }
}

/* Keys [k0, k1) of the quantized part, chunk by chunk. */
static void attend_quantized(struct qattn *a, int64_t k0, int64_t k1)
{
    const struct be_kvq_view *v = a->v;
    const struct be_kvq_format *f = v->fmt;
    int T = f->block_tokens;
    int chunk = f->kind == BE_KVQ_E4M3 ? QATTN_CHUNK : f->k.gt > f->v.gt ? f->k.gt : f->v.gt;
    if (chunk == 1)
        chunk = QATTN_CHUNK;
    for (int64_t pos = k0; pos < k1;) {
        int64_t rel = pos - v->base;
        int blk = (int)(rel / T), t0 = (int)(rel % T);
        /* the chunk ends at the next multiple of `chunk` within the block */
        int end = (t0 / chunk + 1) * chunk;
        if (end > T)
            end = T;
        if (k1 - pos < end - t0)
            end = t0 + (int)(k1 - pos);
        key_scores(a, v->blocks[blk], pos, t0, end - t0);
        fold_chunk(a, end - t0);
        value_accumulate(a, v->blocks[blk], t0, end - t0);
        pos += end - t0;
    }
}

/* Keys [k0, k1) of the full-precision rest (positions below rest.sinks:
 * the sinks). */
static void attend_rest(struct qattn *a, int64_t k0, int64_t k1)
{
    const struct be_kv_view *r = &a->v->rest;
    const struct be_attn_params *p = a->p;
    size_t esz = be_dtype_size(p->kv_dtype);
    const char *rows[QATTN_CHUNK];
    for (int64_t c0 = k0; c0 < k1; c0 += QATTN_CHUNK) {
        int n = k1 - c0 < QATTN_CHUNK ? (int)(k1 - c0) : QATTN_CHUNK;
        for (int i = 0; i < n; i++) {
            rows[i] = cpu_key_row(r, c0 + i, a->kvh, p->head_dim, esz);
            if (r->key_rope) { /* each key rotated at its index before its dot */
                a->k->to_f32(a->krow, rows[i], p->kv_dtype, (size_t)p->head_dim);
                cpu_key_rope(p, r, c0 + i, a->krow, a->krot);
                a->k->dot(&a->s[i], a->q, &(const char *){(const char *)a->krot}, BE_F32, p->head_dim, 1);
            }
        }
        if (!r->key_rope)
            a->k->dot(a->s, a->q, rows, p->kv_dtype, p->head_dim, n);
        for (int i = 0; i < n; i++)
            a->s[i] *= p->scale;
        fold_chunk(a, n);
        a->k->axpy(a->o, a->s, rows, r->v_offset, p->kv_dtype, p->head_dim, n);
    }
}

static void attend_quant_one(struct qattn *a, int64_t qpos)
{
    const struct be_kvq_view *v = a->v;
    const struct be_attn_params *p = a->p;
    int64_t k0 = v->lo, k1 = qpos + 1;
    int window = v->rest.window ? v->rest.window : p->window; /* a sequence's own window first */
    if (window > 0 && qpos - window + 1 > k0)
        k0 = qpos - window + 1;
    memset(a->o, 0, (size_t)p->head_dim * sizeof(float));
    a->m = -INFINITY;
    a->l = 0.0f;
    attend_rest(a, 0, v->rest.sinks);
    if (v->fmt) { /* NULL: a dense sequence of a mixed batch, all rest */
        const struct be_kvq_half *kh = &v->fmt->k;
        if (v->fmt->kind != BE_KVQ_E4M3 && kh->gt == 1)
            for (int g = 0; g < p->head_dim / kh->gd; g++) {
                a->qsum[g] = 0.0f;
                for (int d = 0; d < kh->gd; d++)
                    a->qsum[g] += a->q[g * kh->gd + d];
            }
        attend_quantized(a, k0, k1 < v->hi ? k1 : v->hi);
    }
    int64_t r0 = k0 > v->rest.lo ? k0 : v->rest.lo;
    attend_rest(a, r0, k1 < v->rest.hi ? k1 : v->rest.hi);
    if (a->l > 0.0f)
        a->k->scale(a->o, 1.0f / a->l, p->head_dim);
}

struct qattn_job {
    struct cpu_ctx *c;
    float *out;
    const float *q;
    const struct be_kvq_view *views;
    const struct be_tok *toks;
    int n_tok;
    const struct be_attn_params *p;
};

static void qattn_job(void *arg, int ith, int nth)
{
    struct qattn_job *j = arg;
    const struct be_attn_params *p = j->p;
    int D = p->head_dim, group = p->n_heads / p->n_kv_heads;
    float *scratch = cpu_ctx_scratch(j->c, ith);
    /* scores are at most one group row (q_group_size <= block_tokens) */
    struct qattn a = {.k = cpu_ctx_kern(j->c), .qk = cpu_qkern_for(cpu_ctx_kern(j->c)), .p = p};
    size_t i0, i1, n = (size_t)j->n_tok * (size_t)p->n_heads;
    i0 = n * (size_t)ith / (size_t)nth;
    i1 = n * (size_t)(ith + 1) / (size_t)nth;
    for (size_t i = i0; i < i1; i++) {
        size_t t = i / (size_t)p->n_heads;
        int h = (int)(i % (size_t)p->n_heads);
        a.v = &j->views[j->toks[t].view];
        a.kvh = h / group;
        a.q = j->q + i * (size_t)D;
        a.o = j->out + i * (size_t)D;
        int rows = a.v->fmt && a.v->fmt->block_tokens > QATTN_CHUNK ? a.v->fmt->block_tokens : QATTN_CHUNK;
        a.s = scratch;
        a.t = a.s + rows;
        a.qs = a.t + rows;
        a.qsum = a.qs + D;
        a.acc = a.qsum + D;
        a.ks = a.acc + D;
        a.kb = a.ks + D;
        a.krow = a.kb + D;
        a.krot = a.krow + D;
        attend_quant_one(&a, j->toks[t].pos);
    }
}

enum be_status cpu_attention_quant(void *ctx, float *out, const float *q, const struct be_kvq_view *views,
                                   const struct be_tok *toks, int n_tok, const struct be_attn_params *p)
{
    for (int t = 0; t < n_tok; t++) {
        const struct be_kvq_format *f = views[toks[t].view].fmt;
        int rows = f && f->block_tokens > QATTN_CHUNK ? f->block_tokens : QATTN_CHUNK;
        if (2 * (size_t)rows + 7 * (size_t)p->head_dim > CPU_SCRATCH_FLOATS)
            return BE_ENOTSUP; /* far beyond any model: a block of 200k tokens */
    }
    struct qattn_job j = {.c = ctx, .out = out, .q = q, .views = views, .toks = toks, .n_tok = n_tok, .p = p};
    cpu_pool_run(cpu_ctx_pool(j.c), qattn_job, &j);
    return BE_OK;
}
