/* kvq.cu - quantized KV on the device: the writer that turns a run of
 * full-precision positions into codes (be_kvq_quantize), its inverse for
 * export (be_kvq_dequantize), the e4m3 tensor scales' input
 * (be_kv_absmax) and the row copy the sink strategy keeps its sinks with
 * (be_kv_copy).  The arithmetic is backend/kvq_format.h's, compiled for the
 * device, so the codes and group parameters are the CPU backend's bit for
 * bit.
 *
 * NOTES
 * A flush rewrites the positions [r0, end): the new ones from hi, and
 * before them the part of a per-channel group row that is already coded
 * (decoded and quantized again with the new tokens).  It runs in three
 * launches: gather (every element as f32 into scratch, decoded from its
 * codes or read from the full-precision rest), groups (a thread per group:
 * its min and max, its f16 pair, a byte per code into scratch) and pack (a
 * thread per byte of the code rows), so codes narrower than a byte never
 * share a write between threads.
 */
#include <string.h>

#include "backend/cuda/cuda.h"

extern "C" {
#include "backend/kvq_format.h"
}

#define THREADS 256
#define GRID_MAX 4096 /* blocks of a grid-stride launch: enough to fill any GPU */

static unsigned grid_for(size_t n)
{
    size_t g = (n + THREADS - 1) / THREADS;
    return g == 0 ? 1 : g > GRID_MAX ? GRID_MAX : (unsigned)g;
}

/* A grid-stride loop over [0, n). */
#define FOR_EACH(i, n)                                                                                               \
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)

size_t cu_qviews_bytes(const struct be_kvq_view *views, int n_views)
{
    size_t n_ptrs = 0;
    for (int i = 0; i < n_views; i++)
        n_ptrs += views[i].fmt ? (size_t)views[i].n_blocks : 0;
    return (size_t)n_views * sizeof(struct cu_qview) + n_ptrs * sizeof(void *);
}

enum be_status cu_upload_qviews(struct cu_ctx *c, const struct be_kvq_view *views, int n_views,
                                const struct cu_qview **dq)
{
    size_t bytes = cu_qviews_bytes(views, n_views), off = (size_t)n_views * sizeof(struct cu_qview);
    char *h, *d;
    BE_TRY(cu_meta_reserve(c, bytes, &h, &d));
    /* [qviews][block tables] */
    struct cu_qview *hq = (struct cu_qview *)h;
    for (int i = 0; i < n_views; i++) {
        const struct be_kvq_view *v = &views[i];
        memset(&hq[i], 0, sizeof(hq[i]));
        if (!v->fmt)
            continue;
        if (v->n_blocks)
            memcpy(h + off, v->blocks, (size_t)v->n_blocks * sizeof(void *));
        hq[i].fmt = *v->fmt;
        hq[i].blocks = (const char *const *)(d + off);
        hq[i].base = v->base;
        hq[i].scale_k = v->scale_k;
        hq[i].scale_v = v->scale_v;
        hq[i].quantized = true;
        off += (size_t)v->n_blocks * sizeof(void *);
    }
    *dq = (const struct cu_qview *)d;
    return cu_meta_upload(c, h, d, bytes);
}

/* ---- the flush ------------------------------------------------------------- */

/* Positions [r0, end) in scratch, element (half, pos, kvh, d) at
 * ((half * n + pos - r0) * H + kvh) * D + d with n = end - r0; half i is
 * rewritten from h0[i]; positions below hi are coded already. */
struct flush {
    int64_t r0, hi, end, h0[2];
    int H, D;
    float *x;
    uint8_t *code;
};

__device__ __forceinline__ const struct be_kvq_half *half_of(const struct be_kvq_format *f, int half)
{
    return half ? &f->v : &f->k;
}

__global__ void k_flush_gather(struct flush fl, const struct cu_qview *q, const struct cu_view *rest,
                               enum be_dtype rt)
{
    size_t per = (size_t)(fl.end - fl.r0) * fl.H * fl.D, esz = rt == BE_F32 ? 4 : 2;
    FOR_EACH(i, 2 * per) {
        int half = (int)(i / per), d = (int)(i % fl.D), kvh = (int)(i / fl.D % fl.H);
        int64_t pos = fl.r0 + (int64_t)(i % per / ((size_t)fl.D * fl.H));
        if (pos < fl.h0[half])
            continue;
        if (pos < fl.hi) {
            int t;
            const char *blk = cu_qblock(q, pos, &t);
            fl.x[i] = kvq_decode(&q->fmt, half_of(&q->fmt, half), blk, kvh, t, d, half ? q->scale_v : q->scale_k);
        } else {
            const char *row = kv_row(rest, pos, kvh, fl.D, esz);
            fl.x[i] = ld(row + (half ? rest->v_offset : 0), (size_t)d, rt);
        }
    }
}

/* The groups of one half, a thread each (n of them): e4m3 elements one by
 * one; per-token groups (pos, kvh, column); per-channel groups (group
 * row, kvh, channel), a row ending at end having only its present tokens. */
__global__ void k_flush_groups(struct flush fl, const struct cu_qview *q, int half, size_t n)
{
    const struct be_kvq_format *f = &q->fmt;
    const struct be_kvq_half *h = half_of(f, half);
    int D = fl.D, H = fl.H;
    size_t per = (size_t)(fl.end - fl.r0) * H * D;
    const float *x = fl.x + half * per;
    uint8_t *code = fl.code + half * per;
    int64_t h0 = fl.h0[half];
    FOR_EACH(u, n) {
        if (f->kind == BE_KVQ_E4M3) {
            size_t e = (size_t)(h0 - fl.r0) * H * D + u;
            code[e] = f32_to_e4m3(x[e] / (half ? q->scale_v : q->scale_k));
            continue;
        }
        int64_t pos;
        int kvh, d0, n_el;
        size_t step;
        if (h->gt == 1) {
            int ng = D / h->gd;
            pos = h0 + (int64_t)(u / ((size_t)H * ng));
            kvh = (int)(u / ng % H);
            d0 = (int)(u % ng) * h->gd;
            n_el = h->gd;
            step = 1;
        } else {
            pos = h0 + (int64_t)(u / ((size_t)H * D)) * h->gt;
            kvh = (int)(u / D % H);
            d0 = (int)(u % D);
            n_el = fl.end - pos < h->gt ? (int)(fl.end - pos) : h->gt;
            step = (size_t)H * D;
        }
        size_t e0 = ((size_t)(pos - fl.r0) * H + kvh) * D + d0;
        float mn = x[e0], mx = x[e0];
        for (int i = 1; i < n_el; i++) {
            float e = x[e0 + i * step];
            mn = e < mn ? e : mn;
            mx = e > mx ? e : mx;
        }
        int t;
        const char *blk = cu_qblock(q, pos, &t);
        float s, z;
        kvq_affine_params(f->kind, f->nbits, mn, mx, kvq_group_params(f, h, blk, kvh, t / h->gt, d0 / h->gd), &s,
                          &z);
        for (int i = 0; i < n_el; i++)
            code[e0 + i * step] = (uint8_t)kvq_affine_code(f->kind, f->nbits, x[e0 + i * step], s, z);
    }
}

/* Byte j of the code row of (pos, kvh) of one half, a thread each: the
 * bits of every code that reaches into it. */
__global__ void k_flush_pack(struct flush fl, const struct cu_qview *q, int half, size_t n)
{
    const struct be_kvq_format *f = &q->fmt;
    int D = fl.D, H = fl.H, nb = f->nbits;
    size_t per = (size_t)(fl.end - fl.r0) * H * D, rb = kvq_row_bytes(f);
    int64_t h0 = fl.h0[half];
    FOR_EACH(u, n) {
        int64_t pos = h0 + (int64_t)(u / (H * rb));
        int kvh = (int)(u / rb % H), j = (int)(u % rb), bit0 = 8 * j;
        const uint8_t *cd = fl.code + half * per + ((size_t)(pos - fl.r0) * H + kvh) * D;
        unsigned byte = 0;
        for (int i = bit0 / nb; i < D && i * nb < bit0 + 8; i++) {
            int sh = i * nb - bit0;
            byte |= sh >= 0 ? (unsigned)cd[i] << sh : (unsigned)cd[i] >> -sh;
        }
        int t;
        const char *blk = cu_qblock(q, pos, &t);
        kvq_code_row(f, half_of(f, half), blk, kvh, t)[j] = (uint8_t)byte;
    }
}

/* The launches of one flush over [fl->r0, fl->end). */
static void flush_run(struct cu_ctx *c, const struct flush *fl, const struct be_kvq_format *f,
                      const struct cu_qview *dq, const struct cu_view *dr, enum be_dtype rt)
{
    size_t per = (size_t)(fl->end - fl->r0) * fl->H * fl->D;
    k_flush_gather<<<grid_for(2 * per), THREADS, 0, c->compute>>>(*fl, dq, dr, rt);
    for (int half = 0; half < 2; half++) {
        const struct be_kvq_half *h = half ? &f->v : &f->k;
        size_t rows = (size_t)(fl->end - fl->h0[half]), n;
        if (f->kind == BE_KVQ_E4M3)
            n = rows * fl->H * fl->D;
        else if (h->gt == 1)
            n = rows * fl->H * (size_t)(fl->D / h->gd);
        else
            n = (rows + (size_t)h->gt - 1) / (size_t)h->gt * fl->H * fl->D;
        k_flush_groups<<<grid_for(n), THREADS, 0, c->compute>>>(*fl, dq, half, n);
    }
    for (int half = 0; half < 2; half++) {
        size_t n = (size_t)(fl->end - fl->h0[half]) * fl->H * kvq_row_bytes(f);
        k_flush_pack<<<grid_for(n), THREADS, 0, c->compute>>>(*fl, dq, half, n);
    }
}

/* The scratch of one flush run, at most (a prompt's first flush covers
 * all of it): longer flushes go in runs of whole quantized blocks, which
 * no group row straddles, so only the first run reopens one. */
#define FLUSH_SCRATCH ((size_t)64 << 20)

enum be_status cu_kvq_quantize(void *ctx, const struct be_kvq_view *v, int64_t end)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "kvq_quantize"));
    const struct be_kvq_format *f = v->fmt;
    int64_t T = f->block_tokens, first = kvq_reopen_from(&f->k, f->kind, v->hi);
    int64_t v0 = kvq_reopen_from(&f->v, f->kind, v->hi);
    first = v0 < first ? v0 : first;
    size_t pos_bytes = 2 * (size_t)f->n_kv_heads * (size_t)f->head_dim * (sizeof(float) + 1);
    int64_t run = (int64_t)(FLUSH_SCRATCH / pos_bytes) / T * T;
    run = run < T ? T : run;
    /* a run ends on a block boundary past its start: at most run + T positions from the reopened row */
    int64_t most = end - first < run + T ? end - first : run + T;
    void *scr;
    BE_TRY(cu_scratch(c, (size_t)most * pos_bytes, &scr));

    BE_TRY(cu_meta_ensure(c, cu_meta_size(cu_qviews_bytes(v, 1)) + cu_meta_size(cu_views_bytes(&v->rest, 1, 0))));
    const struct cu_qview *dq;
    const struct cu_view *dr;
    BE_TRY(cu_upload_qviews(c, v, 1, &dq));
    BE_TRY(cu_upload_views(c, &v->rest, 1, NULL, 0, &dr, NULL));

    for (int64_t lo = v->hi; lo < end;) {
        int64_t hi = (lo + run) / T * T; /* a block boundary past lo */
        hi = hi <= lo ? lo + T : hi;
        struct flush fl = {};
        fl.hi = v->hi; /* positions below it are decoded (the first run's reopened rows) */
        fl.end = hi < end ? hi : end;
        fl.H = f->n_kv_heads;
        fl.D = f->head_dim;
        fl.h0[0] = kvq_reopen_from(&f->k, f->kind, lo);
        fl.h0[1] = kvq_reopen_from(&f->v, f->kind, lo);
        fl.r0 = fl.h0[0] < fl.h0[1] ? fl.h0[0] : fl.h0[1];
        size_t per = (size_t)(fl.end - fl.r0) * fl.H * fl.D;
        fl.x = (float *)scr;
        fl.code = (uint8_t *)(fl.x + 2 * per);
        flush_run(c, &fl, f, dq, dr, v->rest_dtype);
        lo = fl.end;
    }
    return cu_leave(c, "kvq_quantize");
}

/* ---- export, scales, sinks -------------------------------------------------- */

/* Positions [p0, p1) of both halves decoded into dst, an f32 view. */
__global__ void k_kvq_dequantize(const struct cu_qview *q, const struct cu_view *dst, int64_t p0, int64_t p1)
{
    int H = q->fmt.n_kv_heads, D = q->fmt.head_dim;
    size_t per = (size_t)(p1 - p0) * H * D;
    FOR_EACH(i, 2 * per) {
        int half = (int)(i / per), d = (int)(i % D), kvh = (int)(i / D % H);
        int64_t pos = p0 + (int64_t)(i % per / ((size_t)D * H));
        int t;
        const char *blk = cu_qblock(q, pos, &t);
        char *row = (char *)kv_row(dst, pos, kvh, D, sizeof(float)) + (half ? dst->v_offset : 0);
        ((float *)row)[d] = kvq_decode(&q->fmt, half_of(&q->fmt, half), blk, kvh, t, d,
                                       half ? q->scale_v : q->scale_k);
    }
}

enum be_status cu_kvq_dequantize(void *ctx, const struct be_kvq_view *v, int64_t p0, int64_t p1,
                                 const struct be_kv_view *dst)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "kvq_dequantize"));
    BE_TRY(cu_meta_ensure(c, cu_meta_size(cu_qviews_bytes(v, 1)) + cu_meta_size(cu_views_bytes(dst, 1, 0))));
    const struct cu_qview *dq;
    const struct cu_view *dd;
    BE_TRY(cu_upload_qviews(c, v, 1, &dq));
    BE_TRY(cu_upload_views(c, dst, 1, NULL, 0, &dd, NULL));
    size_t n = 2 * (size_t)(p1 - p0) * v->fmt->n_kv_heads * v->fmt->head_dim;
    k_kvq_dequantize<<<grid_for(n), THREADS, 0, c->compute>>>(dq, dd, p0, p1);
    return cu_leave(c, "kvq_dequantize");
}

/* amax[0], amax[1] as f32 bits (non-negative floats order as their bits):
 * the largest |K|, |V| over positions [p0, p1); NaNs are passed over, as
 * on the CPU. */
__global__ void k_kv_absmax(const struct cu_view *v, enum be_dtype dt, int H, int D, int64_t p0, int64_t p1,
                            unsigned *amax)
{
    size_t esz = dt == BE_F32 ? 4 : 2;
    float m[2] = {0.0f, 0.0f};
    FOR_EACH(i, (size_t)(p1 - p0) * H * D) {
        int d = (int)(i % D), kvh = (int)(i / D % H);
        const char *row = kv_row(v, p0 + (int64_t)(i / ((size_t)D * H)), kvh, D, esz);
        float a = fabsf(ld(row, (size_t)d, dt)), b = fabsf(ld(row + v->v_offset, (size_t)d, dt));
        m[0] = a > m[0] ? a : m[0];
        m[1] = b > m[1] ? b : m[1];
    }
    for (int k = 0; k < 2; k++) {
        float w = warp_max(m[k]);
        if ((threadIdx.x & 31) == 0)
            atomicMax(&amax[k], __float_as_uint(w));
    }
}

enum be_status cu_kv_absmax(void *ctx, const struct be_kv_view *v, enum be_dtype dt, int n_kv_heads, int head_dim,
                            int64_t p0, int64_t p1, float amax[2])
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "kv_absmax"));
    void *d;
    BE_TRY(cu_scratch(c, 2 * sizeof(unsigned), &d));
    const struct cu_view *dv;
    BE_TRY(cu_upload_views(c, v, 1, NULL, 0, &dv, NULL));
    CU_TRY(c, cudaMemsetAsync(d, 0, 2 * sizeof(unsigned), c->compute), "kv_absmax");
    size_t n = (size_t)(p1 - p0) * n_kv_heads * head_dim;
    k_kv_absmax<<<grid_for(n), THREADS, 0, c->compute>>>(dv, dt, n_kv_heads, head_dim, p0, p1, (unsigned *)d);
    BE_TRY(cu_leave(c, "kv_absmax"));
    unsigned bits[2];
    CU_TRY(c, cudaMemcpyAsync(bits, d, sizeof(bits), cudaMemcpyDeviceToHost, c->compute), "kv_absmax");
    CU_TRY(c, cudaStreamSynchronize(c->compute), "kv_absmax");
    memcpy(amax, bits, sizeof(bits));
    return BE_OK;
}

/* The K and V rows of positions [p0, p1), element by element. */
__global__ void k_kv_copy(const struct cu_view *dst, const struct cu_view *src, int64_t p0, int64_t p1, int H,
                          int D, enum be_dtype kt)
{
    size_t esz = kt == BE_F32 ? 4 : 2, per = (size_t)(p1 - p0) * H * D;
    FOR_EACH(i, 2 * per) {
        int half = (int)(i / per), d = (int)(i % D), kvh = (int)(i / D % H);
        int64_t pos = p0 + (int64_t)(i % per / ((size_t)D * H));
        size_t off = half ? dst->v_offset : 0, soff = half ? src->v_offset : 0;
        char *to = (char *)kv_row(dst, pos, kvh, D, esz) + off + (size_t)d * esz;
        const char *from = kv_row(src, pos, kvh, D, esz) + soff + (size_t)d * esz;
        memcpy(to, from, esz);
    }
}

enum be_status cu_kv_copy(void *ctx, const struct be_kv_view *dst, const struct be_kv_view *src, int64_t p0,
                          int64_t p1, const struct be_attn_params *p)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "kv_copy"));
    BE_TRY(cu_meta_ensure(c, cu_meta_size(cu_views_bytes(dst, 1, 0)) + cu_meta_size(cu_views_bytes(src, 1, 0))));
    const struct cu_view *dd, *ds;
    BE_TRY(cu_upload_views(c, dst, 1, NULL, 0, &dd, NULL));
    BE_TRY(cu_upload_views(c, src, 1, NULL, 0, &ds, NULL));
    size_t n = 2 * (size_t)(p1 - p0) * p->n_kv_heads * p->head_dim;
    k_kv_copy<<<grid_for(n), THREADS, 0, c->compute>>>(dd, ds, p0, p1, p->n_kv_heads, p->head_dim, p->kv_dtype);
    return cu_leave(c, "kv_copy");
}
