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
 * All of it for the nq query heads that share a kv head at once, so each
 * row of codes is widened once for all of them (cpu.h's driver).
 * Keys are visited in chunks that never straddle a group row, and the
 * online softmax (running max m and sum l, rescaling o when m grows) is
 * folded once per chunk, so the per-chunk accumulators need no rescaling.
 * The full-precision rest of the view continues the same softmax.
 * Scores are shaped as be_attention shapes them: scaled, capped, then
 * p->rel_bias added by the key's distance (T5); p->bidirectional lets a
 * query read the keys after it too.
 * Views whose keys are stored before RoPE (rest.key_rope, the sink
 * strategy) are the exception: a rotation mixes the channels of a pair, so
 * each key is decoded into a row of its own (c*s + b per code, through the
 * same code loops), rotated at its index in the cache as be_attention
 * rotates a full-precision key, then dotted; values are read as above.
 * The sinks (rest.sinks, full precision in rest.sink_block) come first.
 */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "backend/kvq_format.h"

/* Keys per chunk when no per-channel group fixes it. */
#define QATTN_CHUNK 64

/* ---- scalar code loops -------------------------------------------------- */

void cpu_qdot_scalar(float *s, const float *x, size_t xs, int nq, const uint8_t *c, size_t stride, int nbits, int n,
                     int rows)
{
    for (int g = 0; g < nq; g++)
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int i = 0; i < n; i++)
                acc += x[(size_t)g * xs + (size_t)i] * (float)kvq_code_get(c + (size_t)r * stride, nbits, i);
            s[(size_t)g * (size_t)rows + (size_t)r] = acc;
        }
}

void cpu_qaxpy_scalar(float *y, size_t ys, const float *a, int nq, const uint8_t *c, size_t stride, int nbits, int n,
                      int rows)
{
    for (int g = 0; g < nq; g++)
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < n; i++)
                y[(size_t)g * ys + (size_t)i] +=
                    a[(size_t)g * (size_t)rows + (size_t)r] * (float)kvq_code_get(c + (size_t)r * stride, nbits, i);
}

void cpu_params_scalar(float *s, float *b, const uint16_t *pr, size_t step, int n, enum be_kvq_codes kind)
{
    for (int i = 0; i < n; i++, pr += step) {
        float scale = f16_to_f32(pr[0]), zero = f16_to_f32(pr[1]);
        s[i] = scale;
        b[i] = kind == BE_KVQ_AFFINE_SHIFT ? -zero : -zero * scale;
    }
}

void cpu_e4m3_dot_scalar(float *s, const float *x, int nq, const uint8_t *c, size_t stride, int n, int rows)
{
    for (int g = 0; g < nq; g++)
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int i = 0; i < n; i++)
                acc += x[(size_t)g * (size_t)n + (size_t)i] * e4m3_to_f32(c[(size_t)r * stride + (size_t)i]);
            s[(size_t)g * (size_t)rows + (size_t)r] = acc;
        }
}

void cpu_e4m3_axpy_scalar(float *y, const float *a, int nq, const uint8_t *c, size_t stride, int n, int rows)
{
    for (int g = 0; g < nq; g++)
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < n; i++)
                y[(size_t)g * (size_t)n + (size_t)i] +=
                    a[(size_t)g * (size_t)rows + (size_t)r] * e4m3_to_f32(c[(size_t)r * stride + (size_t)i]);
}

const struct cpu_qkern cpu_qkern_scalar = {
    .name = "scalar",
    .qdot = cpu_qdot_scalar,
    .qaxpy = cpu_qaxpy_scalar,
    .params = cpu_params_scalar,
    .e4m3_dot = cpu_e4m3_dot_scalar,
    .e4m3_axpy = cpu_e4m3_axpy_scalar,
};

const struct cpu_qkern *cpu_qkern_for(const struct cpu_kern *k)
{
    return k == &cpu_kern_avx512 || k == &cpu_kern_avx512vnni || k == &cpu_kern_avx512bf16 ? &cpu_qkern_avx512
                                                                                            : &cpu_qkern_scalar;
}

/* The (s, b) of n groups of head kvh in the c*s + b form, from group (row
 * gr, column gc): along the group row, or with down (per-token groups) down
 * the group column, one per token. */
static void group_params(const struct cpu_qkern *qk, const struct be_kvq_format *f, const struct be_kvq_half *h,
                         const void *blk, int kvh, int gr, int gc, int n, bool down, float *s, float *b)
{
    size_t step = down ? 2 * (size_t)(f->head_dim / h->gd) : 2;
    qk->params(s, b, kvq_group_params(f, h, blk, kvh, gr, gc), step, n, f->kind);
}

/* For each of nq heads: y[g][i] = x[g][i] * s[i], and hv[g] = sum x[g][i] * b[i]
 * (len elements a head): the groups' scales folded into x, their zero
 * points into one sum per head. */
static void fold_params(float *y, float *hv, const float *x, const float *s, const float *b, int nq, int len)
{
    for (int g = 0; g < nq; g++) {
        float sum = 0.0f;
        for (int i = 0; i < len; i++) {
            y[g * len + i] = x[g * len + i] * s[i];
            sum += x[g * len + i] * b[i];
        }
        hv[g] = sum;
    }
}

/* ---- one piece ------------------------------------------------------------- */

/* A piece of one token's attention for the nq query heads of kv head kvh,
 * with its scratch (after cpu_attend_span's work area): */
struct qattn {
    const struct cpu_kern *k;
    const struct cpu_qkern *qk;
    const struct be_attn_params *p;
    const struct be_kvq_view *v;
    int kvh, nq, D;
    int64_t qpos;   /* the token's position: the distance of each key, for p->rel_bias */
    const float *q; /* [nq][D] */
    struct cpu_attn_part *pt;
    float *s, *t;         /* [nq][a chunk of rows]: scores then weights; per-row partials */
    float *qs, *acc;      /* [nq][D]: q*s of a group row; per-channel V accumulators */
    float *qsum;          /* [nq][D / gd]: per-token K groups' sums of q */
    float *hv;            /* [nq]: per head q.b, sum of weights, or sum of weight*b */
    float *ks, *kb, *krow; /* [D]: a group row's (s, b), or one token row's groups' (s, b); one key decoded */
    float *rs, *rb;       /* [a chunk of rows]: (s, b) of one group of each token row */
    float *krot;          /* [QATTN_CHUNK][D]: keys decoded and rotated (key_rope views) */
};

/* Scores of keys stored before RoPE, QATTN_CHUNK keys at a time: key
 * t0 + i (position pos0 + i) is decoded into krow and rotated into its row
 * of krot, then one dot for all heads. */
static void key_scores_rope(struct qattn *a, const void *blk, int64_t pos0, int t0, int n)
{
    const struct be_kvq_format *f = a->v->fmt;
    const struct be_kvq_half *h = &f->k;
    int D = a->D;
    bool affine = f->kind != BE_KVQ_E4M3;
    if (affine && h->gt > 1) /* per-channel: one group row for the whole chunk */
        group_params(a->qk, f, h, blk, a->kvh, t0 / h->gt, 0, D, false, a->ks, a->kb);
    size_t gbytes = affine && h->gt == 1 ? (size_t)h->gd * (size_t)f->nbits / 8 : 0;
    for (int i0 = 0; i0 < n; i0 += QATTN_CHUNK) {
        int m = n - i0 < QATTN_CHUNK ? n - i0 : QATTN_CHUNK;
        const char *rows[QATTN_CHUNK];
        for (int i = 0; i < m; i++) {
            const uint8_t *c = kvq_code_row(f, h, blk, a->kvh, t0 + i0 + i);
            memset(a->krow, 0, (size_t)D * sizeof(float));
            if (!affine) {
                a->qk->e4m3_axpy(a->krow, &a->v->scale_k, 1, c, 0, D, 1);
            } else if (h->gt > 1) {
                a->qk->qaxpy(a->krow, 0, &(const float){1.0f}, 1, c, 0, f->nbits, D, 1);
                for (int d = 0; d < D; d++)
                    a->krow[d] = a->krow[d] * a->ks[d] + a->kb[d];
            } else { /* per-token groups: this row's D / gd of them, into ks and kb */
                group_params(a->qk, f, h, blk, a->kvh, t0 + i0 + i, 0, D / h->gd, false, a->ks, a->kb);
                for (int g = 0; g < D / h->gd; g++) {
                    a->qk->qaxpy(a->krow + g * h->gd, 0, &a->ks[g], 1, c + (size_t)g * gbytes, 0, f->nbits, h->gd,
                                 1);
                    for (int d = g * h->gd; d < (g + 1) * h->gd; d++)
                        a->krow[d] += a->kb[g];
                }
            }
            rows[i] = (const char *)(a->krot + (size_t)i * (size_t)D);
            cpu_key_rope(a->p, &a->v->rest, pos0 + i0 + i, a->krow, a->krot + (size_t)i * (size_t)D);
        }
        a->k->dot(a->t, a->q, a->nq, rows, BE_F32, D, m);
        for (int g = 0; g < a->nq; g++)
            for (int i = 0; i < m; i++)
                a->s[g * n + i0 + i] = a->t[g * m + i] * a->p->scale;
    }
}

static void key_scores(struct qattn *a, const void *blk, int64_t pos0, int t0, int n)
{
    const struct be_kvq_format *f = a->v->fmt;
    const struct be_kvq_half *h = &f->k;
    int D = a->D, nq = a->nq;
    size_t stride = kvq_row_bytes(f);
    const uint8_t *c0 = kvq_code_row(f, h, blk, a->kvh, t0);
    if (a->v->rest.key_rope) {
        key_scores_rope(a, blk, pos0, t0, n);
        return;
    }
    if (f->kind == BE_KVQ_E4M3) {
        a->qk->e4m3_dot(a->s, a->q, nq, c0, stride, D, n);
        for (int i = 0; i < nq * n; i++)
            a->s[i] = a->s[i] * a->v->scale_k * a->p->scale;
        return;
    }
    if (h->gt > 1) { /* per-channel: one group row for the whole chunk */
        group_params(a->qk, f, h, blk, a->kvh, t0 / h->gt, 0, D, false, a->ks, a->kb);
        fold_params(a->qs, a->hv, a->q, a->ks, a->kb, nq, D);
        a->qk->qdot(a->s, a->qs, (size_t)D, nq, c0, stride, f->nbits, D, n);
        for (int g = 0; g < nq; g++)
            for (int i = 0; i < n; i++)
                a->s[g * n + i] = (a->s[g * n + i] + a->hv[g]) * a->p->scale;
        return;
    }
    /* per-token groups: group gi of every row of the chunk in one call, then
     * each row's (s, b) of that group */
    size_t gbytes = (size_t)h->gd * (size_t)f->nbits / 8;
    int ng = D / h->gd;
    memset(a->s, 0, (size_t)nq * (size_t)n * sizeof(float));
    for (int gi = 0; gi < ng; gi++) {
        a->qk->qdot(a->t, a->q + gi * h->gd, (size_t)D, nq, c0 + (size_t)gi * gbytes, stride, f->nbits, h->gd, n);
        group_params(a->qk, f, h, blk, a->kvh, t0, gi, n, true, a->rs, a->rb);
        for (int g = 0; g < nq; g++) {
            float qsum = a->qsum[g * ng + gi];
            for (int i = 0; i < n; i++)
                a->s[g * n + i] += a->rs[i] * a->t[g * n + i] + a->rb[i] * qsum;
        }
    }
    for (int i = 0; i < nq * n; i++)
        a->s[i] *= a->p->scale;
}

static void value_accumulate(struct qattn *a, const void *blk, int t0, int n)
{
    const struct be_kvq_format *f = a->v->fmt;
    const struct be_kvq_half *h = &f->v;
    int D = a->D, nq = a->nq;
    size_t stride = kvq_row_bytes(f);
    const uint8_t *c0 = kvq_code_row(f, h, blk, a->kvh, t0);
    float *o = a->pt->o;
    if (f->kind == BE_KVQ_E4M3) {
        for (int i = 0; i < nq * n; i++)
            a->t[i] = a->s[i] * a->v->scale_v;
        a->qk->e4m3_axpy(o, a->t, nq, c0, stride, D, n);
        return;
    }
    if (h->gt > 1) {
        memset(a->acc, 0, (size_t)nq * (size_t)D * sizeof(float));
        a->qk->qaxpy(a->acc, (size_t)D, a->s, nq, c0, stride, f->nbits, D, n);
        group_params(a->qk, f, h, blk, a->kvh, t0 / h->gt, 0, D, false, a->ks, a->kb);
        for (int g = 0; g < nq; g++) {
            float psum = 0.0f;
            for (int i = 0; i < n; i++)
                psum += a->s[g * n + i];
            for (int d = 0; d < D; d++)
                o[g * D + d] += a->ks[d] * a->acc[g * D + d] + a->kb[d] * psum;
        }
        return;
    }
    /* per-token groups: group gi of every row weighted by p_i * s_i in one
     * call; the zero points add sum p_i * b_i to each channel of the group */
    size_t gbytes = (size_t)h->gd * (size_t)f->nbits / 8;
    for (int gi = 0; gi < D / h->gd; gi++) {
        group_params(a->qk, f, h, blk, a->kvh, t0, gi, n, true, a->rs, a->rb);
        fold_params(a->t, a->hv, a->s, a->rs, a->rb, nq, n);
        a->qk->qaxpy(o + gi * h->gd, (size_t)D, a->t, nq, c0 + (size_t)gi * gbytes, stride, f->nbits, h->gd, n);
        for (int g = 0; g < nq; g++)
            for (int d = gi * h->gd; d < (gi + 1) * h->gd; d++)
                o[g * D + d] += a->hv[g];
    }
}

/* Rows in a chunk: at most one group row (q_group_size <= block_tokens). */
static int chunk_rows(const struct be_kvq_format *f)
{
    if (!f || f->kind == BE_KVQ_E4M3)
        return QATTN_CHUNK;
    int chunk = f->k.gt > f->v.gt ? f->k.gt : f->v.gt;
    return chunk == 1 ? QATTN_CHUNK : chunk;
}

/* The chunk at pos, of positions below k1: its block and first row
 * there; returns its length.  A chunk ends at the next multiple of
 * chunk_rows within its block, so it never straddles a group row. */
static int next_chunk(const struct be_kvq_view *v, int chunk, int64_t pos, int64_t k1, int *blk, int *t0)
{
    int T = v->fmt->block_tokens;
    int64_t rel = pos - v->base;
    *blk = (int)(rel / T);
    *t0 = (int)(rel % T);
    int end = (*t0 / chunk + 1) * chunk;
    if (end > T)
        end = T;
    if (k1 - pos < end - *t0)
        end = *t0 + (int)(k1 - pos);
    return end - *t0;
}

/* Prefetches one half's codes and group parameters of rows [t0, t0 + n). */
static void prefetch_half(const struct be_kvq_format *f, const struct be_kvq_half *h, const void *blk, int kvh,
                          int t0, int n)
{
    cpu_prefetch(kvq_code_row(f, h, blk, kvh, t0), (size_t)n * kvq_row_bytes(f));
    if (f->kind != BE_KVQ_E4M3) {
        int gr0 = t0 / h->gt, gr1 = (t0 + n - 1) / h->gt;
        cpu_prefetch(kvq_group_params(f, h, blk, kvh, gr0, 0),
                     (size_t)(gr1 - gr0 + 1) * (size_t)(f->head_dim / h->gd) * 2 * sizeof(uint16_t));
    }
}

/* Positions [k0, k1) of the quantized part, chunk by chunk. */
static void attend_quantized(struct qattn *a, int64_t k0, int64_t k1)
{
    const struct be_kvq_view *v = a->v;
    const struct be_kvq_format *f = v->fmt;
    int chunk = chunk_rows(f);
    if (f->kind != BE_KVQ_E4M3 && f->k.gt == 1) {
        int ng = a->D / f->k.gd;
        for (int g = 0; g < a->nq; g++)
            for (int gi = 0; gi < ng; gi++) {
                float sum = 0.0f;
                for (int d = 0; d < f->k.gd; d++)
                    sum += a->q[g * a->D + gi * f->k.gd + d];
                a->qsum[g * ng + gi] = sum;
            }
    }
    int64_t ahead = k0; /* prefetched below this */
    for (int64_t pos = k0; pos < k1;) {
        int blk, t0, n = next_chunk(v, chunk, pos, k1, &blk, &t0);
        int64_t to = k1 - pos - n > CPU_PREFETCH_KEYS ? pos + n + CPU_PREFETCH_KEYS : k1;
        for (ahead = ahead > pos + n ? ahead : pos + n; ahead < to;) { /* the next chunks, while this one computes */
            int pb, pt0, pn = next_chunk(v, chunk, ahead, to, &pb, &pt0);
            prefetch_half(f, &f->k, v->blocks[pb], a->kvh, pt0, pn);
            prefetch_half(f, &f->v, v->blocks[pb], a->kvh, pt0, pn);
            ahead += pn;
        }
        key_scores(a, v->blocks[blk], pos, t0, n);
        cpu_attn_softcap(a->s, a->nq * n, a->p->softcap);
        for (int g = 0; g < a->nq; g++)
            cpu_attn_rel_bias(a->p, a->kvh * a->nq + g, a->qpos, a->s + (size_t)g * (size_t)n, pos, 0, n);
        cpu_attn_fold(a->k, a->pt, a->s, (size_t)n, a->nq, 0, n, a->D);
        value_accumulate(a, v->blocks[blk], t0, n);
        pos += n;
    }
}

static void quant_keys(const struct cpu_attn_src *s, const struct be_tok *t, int64_t *c0, int64_t *c1)
{
    struct kvq_keys kk;
    *c0 = 0;
    *c1 = kvq_keys(s->p, (const struct be_kvq_view *)s->views + t->view, t->pos, &kk);
}

/* Lays a's arrays out from base, after cpu_attend_span's work area (NULL:
 * only counts); returns the floats they take. */
static size_t qattn_carve(struct qattn *a, float *base, size_t nq, size_t D, size_t rows)
{
    struct {
        float **at;
        size_t n;
    } arrays[] = {
        {&a->s, nq * rows}, {&a->t, nq * rows}, {&a->qs, nq * D},  {&a->acc, nq * D}, {&a->qsum, nq * D},
        {&a->hv, nq},       {&a->ks, D},        {&a->kb, D},       {&a->krow, D},     {&a->rs, rows},
        {&a->rb, rows},     {&a->krot, QATTN_CHUNK * D},
    };
    size_t used = 0;
    for (size_t i = 0; i < sizeof(arrays) / sizeof(arrays[0]); i++) {
        if (base)
            *arrays[i].at = base + used;
        used += arrays[i].n;
    }
    return used;
}

/* One token (the source shares no tiles): n is 1. */
static void quant_piece(const struct cpu_attn_src *s, const struct cpu_kern *k, const struct be_tok *t, int n, int kvh,
                        const float *q, int64_t c0, int64_t c1, struct cpu_attn_part *pt, float *scratch)
{
    (void)n;
    const struct be_kvq_view *v = (const struct be_kvq_view *)s->views + t->view;
    const struct be_attn_params *p = s->p;
    struct kvq_keys kk;
    kvq_keys(p, v, t->pos, &kk);
    int D = p->head_dim, nq = p->n_heads / p->n_kv_heads, rows = chunk_rows(v->fmt);
    struct qattn a = {.k = k, .qk = cpu_qkern_for(k), .p = p, .v = v, .kvh = kvh, .nq = nq, .D = D, .qpos = t->pos,
                      .q = q, .pt = pt};
    qattn_carve(&a, scratch + cpu_attend_span_work(p, 1), (size_t)nq, (size_t)D, (size_t)rows);
    /* the three runs of the key order, each cut to [c0, c1) */
    int64_t n_q = kk.qhi - kk.qlo, at[4] = {0, kk.sinks, kk.sinks + n_q, kk.sinks + n_q + (kk.rhi - kk.rlo)};
    int64_t from[3] = {0, kk.qlo, kk.rlo};
    for (int run = 0; run < 3; run++) {
        int64_t lo = c0 > at[run] ? c0 : at[run], hi = c1 < at[run + 1] ? c1 : at[run + 1];
        if (lo >= hi)
            continue;
        lo = from[run] + (lo - at[run]);
        hi = from[run] + (hi - at[run]);
        if (run == 1)
            attend_quantized(&a, lo, hi);
        else
            cpu_attend_span(k, p, &v->rest, kvh, &(struct cpu_attn_tile){.n = 1, .q = q, .pos = {t->pos}, .from = {lo}, .to = {hi}},
                            pt, scratch);
    }
}

enum be_status cpu_attention_quant(void *ctx, void *out_, const void *q_, const struct be_kvq_view *views,
                                   const struct be_tok *toks, int n_tok, const struct be_attn_params *p)
{
    float *out = out_;
    const float *q = q_;
    size_t nq = (size_t)(p->n_heads / p->n_kv_heads), D = (size_t)p->head_dim;
    for (int t = 0; t < n_tok; t++) {
        struct qattn a;
        size_t rows = (size_t)chunk_rows(views[toks[t].view].fmt);
        if (cpu_attend_span_work(p, 1) + qattn_carve(&a, NULL, nq, D, rows) > CPU_ATTN_WORK)
            return BE_ENOTSUP; /* far beyond any model: 60 query heads per kv head and 1024-token groups */
    }
    struct cpu_attn_src src = {.p = p, .views = views, .keys = quant_keys, .piece = quant_piece};
    return cpu_attn_run(ctx, &src, out, q, toks, n_tok);
}
