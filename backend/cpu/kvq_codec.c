/* kvq_codec.c - the CPU backend's writer of quantized KV blocks: the
 * affine (quanto, hqq) and e4m3 quantizers, the flush that turns a run of
 * full-precision positions into codes (be_kvq_quantize), the e4m3 tensor
 * scales' input (be_kv_absmax) and the row copy the sink strategy keeps its
 * sinks with (be_kv_copy).  It shares the block accessors with the kernels
 * that read the codes (kvq_format.h), so both agree bit for bit.
 *
 * NOTES
 * Numerics follow the reference quantizers on f32 tensors, per group:
 *   quanto (MaxOptimizer + quantize_affine):  s = (max - min) / (2^b - 1),
 *     shift = -min, c = clamp(round((x + shift) / s)), x' = c*s - shift
 *   hqq (Quantizer.quantize, optimize=False): i = min((1 / (max - min)) *
 *     (2^b - 1), 2e4), zero = -min * i, c = clamp(round(x*i + zero)), s = 1/i,
 *     x' = (c - zero) * s
 * round is half to even (torch.round).  The pair (s, shift|zero) is stored
 * as f16, the reference's storage for a half-precision model: quanto's
 * optimizer returns it in the model dtype before quantize_affine uses it, so
 * quanto codes are computed with the rounded pair; hqq quantizes in f32 and
 * casts its meta to compute_dtype afterwards, so hqq codes use the f32 pair
 * and only dequantization sees the rounded one.  tests/quant_oracle.py
 * replays both in PyTorch and compares bit for bit.
 */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "backend/kvq_format.h"

#define KVQ_MAX_GROUP_ROWS 1024 /* the largest per-channel group tiers accept */

/* One affine group of n values x[i*stride]: writes its f16 pair to pr and
 * code i through put(i, code). */
struct group_io {
    uint8_t *const *rows; /* code row of each value's token (per-channel) or one row (per-token) */
    int first;            /* code index of value 0 within its row */
    bool per_row;         /* value i lives in rows[i] at `first`; else rows[0] at first + i */
};

static void quantize_group(const struct be_kvq_format *f, const float *x, size_t stride, int n, uint16_t *pr,
                           const struct group_io *io)
{
    float mn = x[0], mx = x[0];
    for (int i = 1; i < n; i++) {
        float e = x[(size_t)i * stride];
        mn = e < mn ? e : mn;
        mx = e > mx ? e : mx;
    }
    float s, z;
    kvq_affine_params(f->kind, f->nbits, mn, mx, pr, &s, &z);
    for (int i = 0; i < n; i++) {
        unsigned c = kvq_affine_code(f->kind, f->nbits, x[(size_t)i * stride], s, z);
        if (io->per_row)
            kvq_code_put(io->rows[i], f->nbits, io->first, c);
        else
            kvq_code_put(io->rows[0], f->nbits, io->first + i, c);
    }
}

static void quantize_half(const struct be_kvq_format *f, const struct be_kvq_half *h, void *blk, int t0, int t1,
                          const float *x, size_t stride, float scale)
{
    int D = f->head_dim, H = f->n_kv_heads;
    for (int kvh = 0; kvh < H; kvh++) {
        if (f->kind == BE_KVQ_E4M3) {
            for (int t = t0; t < t1; t++) {
                const float *r = x + (size_t)(t - t0) * stride + (size_t)kvh * (size_t)D;
                uint8_t *c = kvq_code_row(f, h, blk, kvh, t);
                for (int d = 0; d < D; d++)
                    c[d] = f32_to_e4m3(r[d] / scale);
            }
        } else if (h->gt == 1) {
            for (int t = t0; t < t1; t++) {
                uint8_t *row = kvq_code_row(f, h, blk, kvh, t);
                const float *r = x + (size_t)(t - t0) * stride + (size_t)kvh * (size_t)D;
                for (int g = 0; g < D / h->gd; g++) {
                    struct group_io io = {.rows = &row, .first = g * h->gd};
                    quantize_group(f, r + g * h->gd, 1, h->gd, kvq_group_params(f, h, blk, kvh, t, g), &io);
                }
            }
        } else {
            uint8_t *rows[KVQ_MAX_GROUP_ROWS];
            for (int r0 = t0; r0 < t1; r0 += h->gt) {
                int n = t1 - r0 < h->gt ? t1 - r0 : h->gt;
                for (int i = 0; i < n; i++)
                    rows[i] = kvq_code_row(f, h, blk, kvh, r0 + i);
                const float *r = x + (size_t)(r0 - t0) * stride + (size_t)kvh * (size_t)D;
                for (int d = 0; d < D; d++) {
                    struct group_io io = {.rows = rows, .first = d, .per_row = true};
                    quantize_group(f, r + d, stride, n, kvq_group_params(f, h, blk, kvh, r0 / h->gt, d), &io);
                }
            }
        }
    }
}

static void dequantize_half(const struct be_kvq_format *f, const struct be_kvq_half *h, const void *blk, int t0,
                            int t1, float *x, size_t stride, float scale)
{
    int D = f->head_dim;
    for (int kvh = 0; kvh < f->n_kv_heads; kvh++)
        for (int t = t0; t < t1; t++) {
            float *r = x + (size_t)(t - t0) * stride + (size_t)kvh * (size_t)D;
            for (int d = 0; d < D; d++)
                r[d] = kvq_decode(f, h, blk, kvh, t, d, scale);
        }
}

void kvq_quantize(const struct be_kvq_format *f, void *block, int t0, int t1, const float *k, const float *v,
                  size_t row_stride, float scale_k, float scale_v)
{
    quantize_half(f, &f->k, block, t0, t1, k, row_stride, scale_k);
    quantize_half(f, &f->v, block, t0, t1, v, row_stride, scale_v);
}

void kvq_dequantize(const struct be_kvq_format *f, const void *block, int t0, int t1, float *k, float *v,
                    size_t row_stride, float scale_k, float scale_v)
{
    dequantize_half(f, &f->k, block, t0, t1, k, row_stride, scale_k);
    dequantize_half(f, &f->v, block, t0, t1, v, row_stride, scale_v);
}

/* The rows of positions [p0, p1) of a full-precision view of dt, as f32
 * into rows (token-major, n_kv_heads * head_dim floats per token). */
static void gather_rows(const struct cpu_kern *kern, const struct be_kv_view *v, enum be_dtype dt, int H, int D,
                        int64_t p0, int64_t p1, float *rk, float *rv)
{
    for (int64_t pos = p0; pos < p1; pos++)
        for (int h = 0; h < H; h++) {
            const char *k = cpu_kv_row(v, pos, h, D, be_dtype_size(dt));
            size_t dst = ((size_t)(pos - p0) * (size_t)H + (size_t)h) * (size_t)D;
            kern->to_f32(rk + dst, k, dt, (size_t)D);
            kern->to_f32(rv + dst, k + v->v_offset, dt, (size_t)D);
        }
}

enum be_status cpu_kvq_quantize(void *ctx, const struct be_kvq_view *v, int64_t end)
{
    const struct be_kvq_format *f = v->fmt;
    int64_t T = f->block_tokens, nq = v->hi;
    size_t stride = (size_t)f->n_kv_heads * (size_t)f->head_dim;
    float *rows_k = cpu_ctx_rows(ctx, 2 * (size_t)T * stride);
    if (!rows_k)
        return BE_ENOMEM_HOST;
    float *rows_v = rows_k + (size_t)T * stride;
    for (int64_t b = nq / T; b * T < end; b++) {
        int64_t lo = nq > b * T ? nq : b * T, hi = end < (b + 1) * T ? end : (b + 1) * T;
        int64_t k0 = kvq_reopen_from(&f->k, f->kind, lo), v0 = kvq_reopen_from(&f->v, f->kind, lo);
        int64_t r0 = k0 < v0 ? k0 : v0; /* rows[0] is position r0 */
        void *blk = v->blocks[(b * T - v->base) / T];
        if (k0 < lo)
            dequantize_half(f, &f->k, blk, (int)(k0 - b * T), (int)(lo - b * T), rows_k + (size_t)(k0 - r0) * stride,
                            stride, v->scale_k);
        if (v0 < lo)
            dequantize_half(f, &f->v, blk, (int)(v0 - b * T), (int)(lo - b * T), rows_v + (size_t)(v0 - r0) * stride,
                            stride, v->scale_v);
        gather_rows(cpu_ctx_kern(ctx), &v->rest, v->rest_dtype, f->n_kv_heads, f->head_dim, lo, hi, rows_k + (size_t)(lo - r0) * stride,
                    rows_v + (size_t)(lo - r0) * stride);
        quantize_half(f, &f->k, blk, (int)(k0 - b * T), (int)(hi - b * T), rows_k + (size_t)(k0 - r0) * stride,
                      stride, v->scale_k);
        quantize_half(f, &f->v, blk, (int)(v0 - b * T), (int)(hi - b * T), rows_v + (size_t)(v0 - r0) * stride,
                      stride, v->scale_v);
    }
    return BE_OK;
}

enum be_status cpu_kvq_dequantize(void *ctx, const struct be_kvq_view *v, int64_t p0, int64_t p1,
                                  const struct be_kv_view *dst)
{
    const struct be_kvq_format *f = v->fmt;
    int64_t T = f->block_tokens;
    int H = f->n_kv_heads, D = f->head_dim;
    size_t stride = (size_t)H * (size_t)D, hd = (size_t)D * sizeof(float);
    float *rows_k = cpu_ctx_rows(ctx, 2 * (size_t)T * stride);
    if (!rows_k)
        return BE_ENOMEM_HOST;
    float *rows_v = rows_k + (size_t)T * stride;
    for (int64_t b = p0 / T; b * T < p1; b++) {
        int64_t lo = p0 > b * T ? p0 : b * T, hi = p1 < (b + 1) * T ? p1 : (b + 1) * T;
        kvq_dequantize(f, v->blocks[(b * T - v->base) / T], (int)(lo - b * T), (int)(hi - b * T), rows_k, rows_v,
                       stride, v->scale_k, v->scale_v);
        for (int64_t pos = lo; pos < hi; pos++)
            for (int h = 0; h < H; h++) {
                char *d = cpu_kv_row(dst, pos, h, D, sizeof(float));
                size_t src = (size_t)(pos - lo) * stride + (size_t)h * (size_t)D;
                memcpy(d, rows_k + src, hd);
                memcpy(d + dst->v_offset, rows_v + src, hd);
            }
    }
    return BE_OK;
}

enum be_status cpu_kv_absmax(void *ctx, const struct be_kv_view *v, enum be_dtype dt, int n_kv_heads, int head_dim,
                             int64_t p0, int64_t p1, float amax[2])
{
    float *k = cpu_ctx_rows(ctx, 2 * (size_t)head_dim), *x = k + head_dim;
    if (!k)
        return BE_ENOMEM_HOST;
    const struct cpu_kern *kern = cpu_ctx_kern(ctx);
    amax[0] = amax[1] = 0.0f;
    for (int64_t pos = p0; pos < p1; pos++)
        for (int h = 0; h < n_kv_heads; h++) {
            const char *row = cpu_kv_row(v, pos, h, head_dim, be_dtype_size(dt));
            kern->to_f32(k, row, dt, (size_t)head_dim);
            kern->to_f32(x, row + v->v_offset, dt, (size_t)head_dim);
            for (int d = 0; d < head_dim; d++) {
                amax[0] = fabsf(k[d]) > amax[0] ? fabsf(k[d]) : amax[0];
                amax[1] = fabsf(x[d]) > amax[1] ? fabsf(x[d]) : amax[1];
            }
        }
    return BE_OK;
}

enum be_status cpu_kv_copy(void *ctx, const struct be_kv_view *dst, const struct be_kv_view *src, int64_t p0,
                           int64_t p1, const struct be_attn_params *p)
{
    (void)ctx;
    size_t esz = be_dtype_size(p->kv_dtype), row = (size_t)p->head_dim * esz;
    for (int64_t pos = p0; pos < p1; pos++)
        for (int h = 0; h < p->n_kv_heads; h++) {
            char *d = cpu_kv_row(dst, pos, h, p->head_dim, esz);
            const char *s = cpu_kv_row(src, pos, h, p->head_dim, esz);
            memcpy(d, s, row);
            memcpy(d + dst->v_offset, s + src->v_offset, row);
        }
    return BE_OK;
}
