/* kernels.cu - the CUDA backend's kernels other than attention: matmul
 * (cuBLAS, and a row kernel for decode and mixed types), the fused norms,
 * RoPE, the gated activations, element-wise ops, embedding, argmax and the
 * KV store.  Each op validates nothing (backend.c did), launches on the
 * compute stream and returns without waiting.
 */
#include <math.h>
#include <string.h>

#include "backend/cuda/cuda.h"
#include "util/q4k.h"

#define THREADS 256

static unsigned blocks_for(size_t n)
{
    size_t b = (n + THREADS - 1) / THREADS;
    return b > 65535u * 8u ? 65535u * 8u : (unsigned)b; /* grid-stride loops cover the rest */
}

/* Block-wide sum over THREADS threads; every thread gets it. */
__device__ float block_sum(float v)
{
    __shared__ float part[THREADS / 32];
    v = warp_sum(v);
    __syncthreads(); /* part may still be read by a previous call */
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x / 32] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < THREADS / 32; i++)
        s += part[i];
    return s;
}

/* ---- matmul ------------------------------------------------------------- */

/* Tokens per warp pass of the row kernel: each weight element loaded is
 * used this many times. */
#define ROW_TOKENS 4
#define ROW_WARPS (THREADS / 32)

/* y[t, r] = x[t, :] . W[r, :] (+ bias[r]), f32 sums: one warp per row r of
 * W, ROW_TOKENS tokens at a time.  Streams W once per ROW_TOKENS tokens,
 * so one-token decode reads each weight once, coalesced. */
__global__ void k_matmul_rows(void *y, enum be_dtype yt, const void *x, enum be_dtype xt, const void *w,
                              enum be_dtype wt, const float *bias, int n, int in, int out)
{
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (r >= out)
        return;
    for (int t0 = 0; t0 < n; t0 += ROW_TOKENS) {
        float acc[ROW_TOKENS] = {};
        int nt = n - t0 < ROW_TOKENS ? n - t0 : ROW_TOKENS;
        for (int i = lane; i < in; i += 32) {
            float wv = ld(w, (size_t)r * in + i, wt);
            for (int u = 0; u < nt; u++)
                acc[u] += wv * ld(x, (size_t)(t0 + u) * in + i, xt);
        }
        for (int u = 0; u < nt; u++) {
            float s = warp_sum(acc[u]);
            if (lane == 0)
                st(y, (size_t)(t0 + u) * out + r, yt, s + (bias ? bias[r] : 0.0f));
        }
    }
}

/* Eight 16-bit values of one 16-byte vector as f32 (a bf16's bits are
 * an f32's high half, so that widening is a shift). */
__device__ __forceinline__ void unpack8(uint4 v, enum be_dtype dt, float f[8])
{
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (dt == BE_BF16) {
            f[2 * k] = __uint_as_float(u[k] << 16);
            f[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
        } else {
            __half2_raw h;
            h.x = (unsigned short)(u[k] & 0xffffu);
            h.y = (unsigned short)(u[k] >> 16);
            float2 g = __half22float2(__half2(h));
            f[2 * k] = g.x;
            f[2 * k + 1] = g.y;
        }
    }
}

/* Elements [i, i + 8) of x (f32 or 16-bit, 16-byte aligned there). */
__device__ __forceinline__ void load8(const void *x, size_t i, enum be_dtype xt, float f[8])
{
    if (xt == BE_F32) {
        float4 a = *(const float4 *)((const float *)x + i), b = *(const float4 *)((const float *)x + i + 4);
        f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
    } else {
        unpack8(*(const uint4 *)((const uint16_t *)x + i), xt, f);
    }
}

/* As k_matmul_rows, for 16-bit weights whose rows are whole 16-byte
 * vectors: each lane loads eight weights at once and two vectors per
 * pass, so a warp has 1 KiB of its row in flight where the element
 * kernel has 64 bytes, which one-token decode needs to stream W at HBM
 * bandwidth rather than at load-issue rate. */
__global__ void k_matmul_vec(void *y, enum be_dtype yt, const void *x, enum be_dtype xt, const uint4 *w,
                             enum be_dtype wt, const float *bias, int n, int in, int out)
{
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (r >= out)
        return;
    int nv = in / 8; /* vectors per row */
    const uint4 *row = w + (size_t)r * nv;
    for (int t0 = 0; t0 < n; t0 += ROW_TOKENS) {
        float acc[ROW_TOKENS] = {};
        int nt = n - t0 < ROW_TOKENS ? n - t0 : ROW_TOKENS;
        for (int v = lane; v < nv; v += 64) {
            bool two = v + 32 < nv;
            uint4 a = __ldg(row + v), b = two ? __ldg(row + v + 32) : make_uint4(0, 0, 0, 0);
            float fa[8], fb[8], xv[8];
            unpack8(a, wt, fa);
            unpack8(b, wt, fb);
#pragma unroll
            for (int u = 0; u < ROW_TOKENS; u++) {
                if (u >= nt)
                    break;
                size_t xi = (size_t)(t0 + u) * in + (size_t)v * 8;
                load8(x, xi, xt, xv);
#pragma unroll
                for (int k = 0; k < 8; k++)
                    acc[u] += fa[k] * xv[k];
                if (two) {
                    load8(x, xi + 256, xt, xv);
#pragma unroll
                    for (int k = 0; k < 8; k++)
                        acc[u] += fb[k] * xv[k];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < ROW_TOKENS; u++) {
            if (u >= nt)
                break;
            float s = warp_sum(acc[u]);
            if (lane == 0)
                st(y, (size_t)(t0 + u) * out + r, yt, s + (bias ? bias[r] : 0.0f));
        }
    }
}

/* An activation row's block of 32 rounded to int8, as the CPU backend
 * rounds it (cpu_q8_act_scalar): d = max|x| / 127, q = rint(x / d); a
 * block too small for 1 / d (max|x| below about 3.7e-37) gets d = 0 and
 * zero codes; a block with a NaN or an infinity gets d = NaN.  sum: of
 * the codes, what Q4_K's mins multiply. */
struct q8_act {
    float d;
    int sum;
    int8_t qs[32];
};

__device__ __forceinline__ int warp_isum(int v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float f16_bits(uint16_t h)
{
    __half_raw hr;
    hr.x = h;
    return __half2float(__half(hr));
}

/* One warp per block of 32: lane i holds element i. */
__global__ void k_q8_act(struct q8_act *q, const void *x, enum be_dtype xt, size_t n_blocks)
{
    size_t b = (size_t)blockIdx.x * ROW_WARPS + threadIdx.x / 32;
    int lane = threadIdx.x & 31;
    if (b >= n_blocks)
        return;
    float v = ld(x, b * 32 + lane, xt);
    bool finite = __all_sync(0xffffffffu, fabsf(v) < INFINITY);
    float d = warp_max(fabsf(v)) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    if (isinf(id)) /* max|x| too small for its reciprocal: zero, as the CPU levels */
        d = id = 0.0f;
    int8_t c = finite ? (int8_t)__float2int_rn(v * id) : 0; /* the sum is of the codes as stored */
    int sum = warp_isum(c);
    q[b].qs[lane] = c;
    if (lane == 0) {
        q[b].d = finite ? d : NAN;
        q[b].sum = sum;
    }
}

/* y[t, r] = sum over blocks of f16(wd) * xd * (integer dot of the codes),
 * GGUF's Q8_0 blocks of 34 bytes (f16 scale, 32 int8) along W's rows: a
 * warp per row, lane i multiplies code i of every block. */
__global__ void k_matmul_q8(void *y, enum be_dtype yt, const struct q8_act *xq, const uint8_t *w, const float *bias,
                            int n, int in, int out)
{
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (r >= out)
        return;
    int nb = in / 32;
    const uint8_t *row = w + (size_t)r * nb * 34;
    for (int t = 0; t < n; t++) {
        float acc = 0.0f;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * 34;
            int prod = warp_isum((int)(int8_t)blk[2 + lane] * (int)xq[(size_t)t * nb + b].qs[lane]);
            acc += f16_bits((uint16_t)(blk[0] | blk[1] << 8)) * xq[(size_t)t * nb + b].d * (float)prod;
        }
        if (lane == 0)
            st(y, (size_t)t * out + r, yt, acc + (bias ? bias[r] : 0.0f));
    }
}

/* The same for GGUF's Q4_K super-blocks (util/q4k.h), summed as the CPU
 * backend's oracle sums them: per sub-block j of 32 the integer dot
 * product of the 4-bit codes with the activation codes, then
 *     d sc_j dx isum_j - dmin m_j (dx xsum_j)
 * in sub-block order.  A warp per row, lane i takes element i of every
 * sub-block. */
__global__ void k_matmul_q4k(void *y, enum be_dtype yt, const struct q8_act *xq, const struct q4_k_block *w,
                             const float *bias, int n, int in, int out)
{
    int r = blockIdx.x * ROW_WARPS + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (r >= out)
        return;
    int nsb = in / Q4_K_BLOCK, nb = in / Q4_K_SUB;
    const struct q4_k_block *row = w + (size_t)r * nsb;
    for (int t = 0; t < n; t++) {
        const struct q8_act *x = xq + (size_t)t * nb;
        float acc = 0.0f;
        for (int b = 0; b < nsb; b++) {
            const struct q4_k_block *blk = &row[b];
            float d = f16_bits(blk->d), dmin = f16_bits(blk->dmin);
            for (int j = 0; j < Q4_K_BLOCK / Q4_K_SUB; j++) {
                const struct q8_act *xb = &x[b * (Q4_K_BLOCK / Q4_K_SUB) + j];
                uint8_t byte = blk->qs[j / 2 * Q4_K_SUB + lane];
                int isum = warp_isum((j % 2 ? byte >> 4 : byte & 0x0f) * (int)xb->qs[lane]), sc, m;
                q4_k_scale_min(blk->scales, j, &sc, &m);
                acc += d * (float)sc * xb->d * (float)isum - dmin * (float)m * (xb->d * (float)xb->sum);
            }
        }
        if (lane == 0)
            st(y, (size_t)t * out + r, yt, acc + (bias ? bias[r] : 0.0f));
    }
}

/* y[i] = x[i] converted */
__global__ void k_convert(void *y, enum be_dtype yt, const void *x, enum be_dtype xt, size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        st(y, i, yt, ld(x, i, xt));
}

/* y[t, r] = c[t, r] + bias[r] (bias may be NULL), f32 c to yt */
__global__ void k_bias(void *y, enum be_dtype yt, const float *c, const float *bias, size_t n, int out)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        st(y, i, yt, c[i] + (bias ? bias[i % (size_t)out] : 0.0f));
}

static cudaDataType blas_type(enum be_dtype dt)
{
    return dt == BE_F32 ? CUDA_R_32F : dt == BE_F16 ? CUDA_R_16F : CUDA_R_16BF;
}

/* Below this many tokens the row kernel streams W directly (decode); from
 * it on a cuBLAS GEMM reads W once for all of them. */
#define GEMM_MIN_TOKENS 8

/* y[n,out] = x[n,in] . W[out,in]^T through cuBLAS, column-major: C[out,n] =
 * op(A)[out,in] . B[in,n] with A = W as an (in x out) matrix, transposed,
 * and B = x as (in x n).  The operands must share a type: x is converted
 * to W's when they differ (bf16 activations with f16 weights). */
static enum be_status matmul_blas(struct cu_ctx *c, void *y, enum be_dtype yt, const void *x, const void *w,
                                  enum be_dtype wt, const float *bias, int n, int in, int out)
{
    size_t nx = (size_t)n * in, ny = (size_t)n * out;
    bool convert = c->act != wt;
    /* C straight into y where cuBLAS can write yt from these operands; the
     * bias then goes on in place (f32 y) or through an f32 copy */
    bool direct = yt == BE_F32 || (yt == wt && !bias);
    size_t xbytes = convert ? (nx * cu_esz(wt) + 255) / 256 * 256 : 0, cbytes = direct ? 0 : ny * 4;
    void *scratch = NULL;
    if (xbytes + cbytes)
        BE_TRY(cu_scratch(c, xbytes + cbytes, &scratch));
    const void *b = x;
    if (convert) {
        k_convert<<<blocks_for(nx), THREADS, 0, c->compute>>>(scratch, wt, x, c->act, nx);
        b = scratch;
    }
    void *cm = direct ? y : (char *)scratch + xbytes;
    enum be_dtype ct = direct ? yt : BE_F32;
    float one = 1.0f, zero = 0.0f;
    BE_TRY(cu_blas_check(c, cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w, blas_type(wt), in,
                                            b, blas_type(wt), in, &zero, cm, blas_type(ct), out, CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT),
                            "matmul"));
    if (!direct || bias)
        k_bias<<<blocks_for(ny), THREADS, 0, c->compute>>>(y, yt, (const float *)cm, bias, ny, out);
    return BE_OK;
}

enum be_status cu_matmul(void *ctx, void *y, enum be_dtype yt, const void *x, const void *w, enum be_dtype wt,
                         const float *bias, int n, int in, int out)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "matmul"));
    unsigned grid = (unsigned)((out + ROW_WARPS - 1) / ROW_WARPS);
    if (wt == BE_Q8_0 || wt == BE_Q4_K) { /* the activations rounded to int8 blocks first, as on the CPU */
        size_t nb = (size_t)n * in / 32;
        void *xq;
        BE_TRY(cu_scratch(c, nb * sizeof(struct q8_act), &xq));
        k_q8_act<<<(unsigned)((nb + ROW_WARPS - 1) / ROW_WARPS), THREADS, 0, c->compute>>>((struct q8_act *)xq, x,
                                                                                           c->act, nb);
        if (wt == BE_Q8_0)
            k_matmul_q8<<<grid, THREADS, 0, c->compute>>>(y, yt, (const struct q8_act *)xq, (const uint8_t *)w,
                                                          bias, n, in, out);
        else
            k_matmul_q4k<<<grid, THREADS, 0, c->compute>>>(y, yt, (const struct q8_act *)xq,
                                                           (const struct q4_k_block *)w, bias, n, in, out);
    } else if (n < GEMM_MIN_TOKENS || (c->act == BE_F32 && wt != BE_F32)) {
        /* f32 activations keep f32 products with 16-bit weights, which a
         * cuBLAS GEMM would only give by rounding x */
        bool vec = (wt == BE_BF16 || wt == BE_F16) && in % 8 == 0 && ((uintptr_t)w | (uintptr_t)x) % 16 == 0;
        if (vec)
            k_matmul_vec<<<grid, THREADS, 0, c->compute>>>(y, yt, x, c->act, (const uint4 *)w, wt, bias, n, in, out);
        else
            k_matmul_rows<<<grid, THREADS, 0, c->compute>>>(y, yt, x, c->act, w, wt, bias, n, in, out);
    } else {
        BE_TRY(matmul_blas(c, y, yt, x, w, wt, bias, n, in, out));
    }
    return cu_leave(c, "matmul");
}

/* ---- norms -------------------------------------------------------------- */

/* y[r, :] = (x[r, :] * (1 / sqrt(mean(x^2) + eps))) * w: one block per row,
 * each thread the same elements in both passes, so y may alias x. */
__global__ void k_rmsnorm(void *y, const void *x, enum be_dtype dt, const float *w, int dim, float eps)
{
    size_t r = blockIdx.x;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += THREADS) {
        float v = ld(x, r * dim + i, dt);
        ss += v * v;
    }
    float s = 1.0f / sqrtf(block_sum(ss) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += THREADS)
        st(y, r * dim + i, dt, (ld(x, r * dim + i, dt) * s) * w[i]);
}

enum be_status cu_rmsnorm(void *ctx, void *y, const void *x, const float *w, int n, int dim, float eps)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "rmsnorm"));
    k_rmsnorm<<<n, THREADS, 0, c->compute>>>(y, x, c->act, w, dim, eps);
    return cu_leave(c, "rmsnorm");
}

/* y[r, :] = (x - mean) / sqrt(var + eps) * w + b, two passes over the row
 * (no cancellation in E[x^2] - mean^2). */
__global__ void k_layernorm(void *y, const void *x, enum be_dtype dt, const float *w, const float *b, int dim,
                            float eps)
{
    size_t r = blockIdx.x;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += THREADS)
        s += ld(x, r * dim + i, dt);
    float mean = block_sum(s) / (float)dim, v = 0.0f;
    for (int i = threadIdx.x; i < dim; i += THREADS) {
        float d = ld(x, r * dim + i, dt) - mean;
        v += d * d;
    }
    float inv = 1.0f / sqrtf(block_sum(v) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += THREADS)
        st(y, r * dim + i, dt, (ld(x, r * dim + i, dt) - mean) * inv * w[i] + b[i]);
}

enum be_status cu_layernorm(void *ctx, void *y, const void *x, const float *w, const float *b, int n, int dim,
                            float eps)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "layernorm"));
    k_layernorm<<<n, THREADS, 0, c->compute>>>(y, x, c->act, w, b, dim, eps);
    return cu_leave(c, "layernorm");
}

/* ---- rope --------------------------------------------------------------- */

/* x[t, h, :] rotated in place: block (t, h), thread i < rot_dim/2 turns the
 * pair (i, i + rot_dim/2) (NeoX) or (2i, 2i+1) (interleaved) by pos[t] *
 * inv_freq[i], angles in f32 as Hugging Face computes them. */
__global__ void k_rope(void *x, enum be_dtype dt, int n_heads, int head_dim, const int64_t *pos,
                       const float *inv_freq, int rot_dim, float mscale, enum be_rope_layout layout)
{
    size_t t = blockIdx.x, h = blockIdx.y;
    int half = rot_dim / 2;
    size_t row = (t * n_heads + h) * head_dim;
    float fpos = (float)pos[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float ang = fpos * inv_freq[i], cs = cosf(ang) * mscale, sn = sinf(ang) * mscale;
        int a = layout == BE_ROPE_NEOX ? i : 2 * i, b = layout == BE_ROPE_NEOX ? i + half : a + 1;
        float x0 = ld(x, row + a, dt), x1 = ld(x, row + b, dt);
        st(x, row + a, dt, x0 * cs - x1 * sn);
        st(x, row + b, dt, x1 * cs + x0 * sn);
    }
}

enum be_status cu_rope(void *ctx, void *x, int n_tok, int n_heads, int head_dim, const int64_t *pos,
                       const float *inv_freq, int rot_dim, float mscale, enum be_rope_layout layout)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "rope"));
    size_t bytes = (size_t)n_tok * sizeof(int64_t);
    char *h, *d;
    BE_TRY(cu_meta_reserve(c, bytes, &h, &d));
    memcpy(h, pos, bytes);
    BE_TRY(cu_meta_upload(c, h, d, bytes));
    int threads = rot_dim / 2 < 128 ? 64 : 128;
    k_rope<<<dim3((unsigned)n_tok, (unsigned)n_heads), threads, 0, c->compute>>>(
        x, c->act, n_heads, head_dim, (const int64_t *)d, inv_freq, rot_dim, mscale, layout);
    return cu_leave(c, "rope");
}

/* ---- element-wise -------------------------------------------------------- */

enum elem_op { SILU_MUL, GELU_MUL, GELU, SCALE, ADD, RELU, GELU_ERF };

/* y[i] = op(a[i], b[i]) in f32 */
__global__ void k_elem(void *y, const void *a, const void *b, enum be_dtype dt, size_t n, float s, enum elem_op op)
{
    const float c = 0.7978845608028654f; /* sqrt(2/pi) */
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float g = ld(a, i, dt), v;
        switch (op) {
        case SILU_MUL: v = g / (1.0f + expf(-g)) * ld(b, i, dt); break;
        case GELU_MUL: v = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g))) * ld(b, i, dt); break;
        case GELU: v = 0.5f * g * (1.0f + tanhf(c * (g + 0.044715f * g * g * g))); break;
        case SCALE: v = g * s; break;
        case RELU: v = g > 0.0f ? g : 0.0f; break;
        case GELU_ERF: v = 0.5f * g * (1.0f + erff(g * 0.70710678118654752f)); break;
        default: v = ld(y, i, dt) + g; break; /* ADD: y += a */
        }
        st(y, i, dt, v);
    }
}

static enum be_status elem(void *ctx, const char *name, void *y, const void *a, const void *b, size_t n, float s,
                           enum elem_op op)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, name));
    k_elem<<<blocks_for(n), THREADS, 0, c->compute>>>(y, a, b, c->act, n, s, op);
    return cu_leave(c, name);
}

enum be_status cu_silu_mul(void *ctx, void *y, const void *gate, const void *up, size_t n)
{
    return elem(ctx, "silu_mul", y, gate, up, n, 0.0f, SILU_MUL);
}

enum be_status cu_gelu_mul(void *ctx, void *y, const void *gate, const void *up, size_t n)
{
    return elem(ctx, "gelu_mul", y, gate, up, n, 0.0f, up ? GELU_MUL : GELU);
}

enum be_status cu_scale(void *ctx, void *x, size_t n, float s)
{
    return elem(ctx, "scale", x, x, NULL, n, s, SCALE);
}

enum be_status cu_act(void *ctx, void *x, size_t n, enum be_act act)
{
    return elem(ctx, "act", x, x, NULL, n, 0.0f, act == BE_ACT_RELU ? RELU : GELU_ERF);
}

enum be_status cu_add(void *ctx, void *y, const void *x, size_t n)
{
    return elem(ctx, "add", y, x, NULL, n, 0.0f, ADD);
}

/* ---- row-wise ------------------------------------------------------------ */

/* x[r, :] = softmax in place, one block per row. */
__global__ void k_softmax(void *x, enum be_dtype dt, int cols)
{
    __shared__ float red[THREADS / 32];
    size_t r = blockIdx.x;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < cols; i += THREADS)
        m = fmaxf(m, ld(x, r * cols + i, dt));
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0)
        red[threadIdx.x / 32] = m;
    __syncthreads();
    for (int i = 0; i < THREADS / 32; i++)
        m = fmaxf(m, red[i]);
    float s = 0.0f;
    for (int i = threadIdx.x; i < cols; i += THREADS)
        s += expf(ld(x, r * cols + i, dt) - m);
    float inv = 1.0f / block_sum(s);
    for (int i = threadIdx.x; i < cols; i += THREADS)
        st(x, r * cols + i, dt, expf(ld(x, r * cols + i, dt) - m) * inv);
}

enum be_status cu_softmax(void *ctx, void *x, int rows, int cols)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "softmax"));
    k_softmax<<<rows, THREADS, 0, c->compute>>>(x, c->act, cols);
    return cu_leave(c, "softmax");
}

/* y[t, :] = table[ids[t], :] converted: block t */
__global__ void k_embed(void *y, enum be_dtype yt, const void *table, enum be_dtype dt, const int32_t *ids, int dim)
{
    size_t t = blockIdx.x, row = (size_t)ids[t] * dim;
    for (int i = threadIdx.x; i < dim; i += THREADS)
        st(y, t * dim + i, yt, ld(table, row + i, dt));
}

enum be_status cu_embed(void *ctx, void *y, const void *table, enum be_dtype dt, const int32_t *ids, int n, int dim)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "embed"));
    size_t bytes = (size_t)n * sizeof(int32_t);
    char *h, *d;
    BE_TRY(cu_meta_reserve(c, bytes, &h, &d));
    memcpy(h, ids, bytes);
    BE_TRY(cu_meta_upload(c, h, d, bytes));
    k_embed<<<n, THREADS, 0, c->compute>>>(y, c->act, table, dt, (const int32_t *)d, dim);
    return cu_leave(c, "embed");
}

/* Whether (v, i) beats (bv, bi) as the CPU's scan decides: numbers over
 * NaNs, the larger number, the first index among equals; among NaNs only,
 * the last index. */
__device__ bool better(float v, int i, float bv, int bi)
{
    bool n = v == v, bn = bv == bv;
    if (n != bn)
        return n;
    if (!n)
        return i > bi;
    return v > bv || (v == bv && i < bi);
}

/* out[r] = argmax of x[r, :], one block per row */
__global__ void k_argmax(const void *x, enum be_dtype dt, int cols, int32_t *out)
{
    __shared__ float sv[THREADS];
    __shared__ int si[THREADS];
    size_t r = blockIdx.x;
    float bv = NAN;
    int bi = -1;
    for (int i = threadIdx.x; i < cols; i += THREADS) {
        float v = ld(x, r * cols + i, dt);
        if (bi < 0 || better(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s && si[threadIdx.x + s] >= 0 &&
            (si[threadIdx.x] < 0 || better(sv[threadIdx.x + s], si[threadIdx.x + s], sv[threadIdx.x], si[threadIdx.x]))) {
            sv[threadIdx.x] = sv[threadIdx.x + s];
            si[threadIdx.x] = si[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0)
        out[r] = si[0];
}

enum be_status cu_argmax(void *ctx, const void *x, int rows, int cols, int32_t *out)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "argmax"));
    void *d;
    BE_TRY(cu_scratch(c, (size_t)rows * sizeof(int32_t), &d));
    k_argmax<<<rows, THREADS, 0, c->compute>>>(x, c->act, cols, (int32_t *)d);
    BE_TRY(cu_leave(c, "argmax"));
    CU_TRY(c, cudaMemcpyAsync(out, d, (size_t)rows * sizeof(int32_t), cudaMemcpyDeviceToHost, c->compute),
           "argmax");
    return cu_check(c, cudaStreamSynchronize(c->compute), "argmax");
}

/* ---- KV store ------------------------------------------------------------ */

/* Block (t, kv head h): k and v [t, h*D .. (h+1)*D) into the token's row of
 * its view's block, converted to the KV type. */
__global__ void k_kv_store(const struct cu_view *views, const struct be_tok *toks, const void *k, const void *v,
                           enum be_dtype at, enum be_dtype kt, int n_kv, int D)
{
    size_t t = blockIdx.x;
    int h = blockIdx.y;
    const struct cu_view *view = &views[toks[t].view];
    size_t esz = kt == BE_F32 ? 4 : 2, src = (t * n_kv + h) * D;
    char *dst = (char *)kv_row(view, toks[t].pos, h, D, esz);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        st(dst, i, kt, ld(k, src + i, at));
        st(dst + view->v_offset, i, kt, ld(v, src + i, at));
    }
}

enum be_status cu_kv_store(void *ctx, const struct be_kv_view *views, const struct be_tok *toks, int n_tok,
                           const void *k, const void *v, const struct be_attn_params *p)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "kv_store"));
    const struct cu_view *dv;
    const struct be_tok *dt;
    BE_TRY(cu_upload_views(c, views, cu_views_named(toks, n_tok), toks, n_tok, &dv, &dt));
    k_kv_store<<<dim3((unsigned)n_tok, (unsigned)p->n_kv_heads), 128, 0, c->compute>>>(
        dv, dt, k, v, c->act, p->kv_dtype, p->n_kv_heads, p->head_dim);
    return cu_leave(c, "kv_store");
}
