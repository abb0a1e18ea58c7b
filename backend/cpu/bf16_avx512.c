/* bf16_avx512.c - bf16 weights times a batch of tokens on the bf16 dot
 * product instruction (AVX512_BF16 vdpbf16ps: 32 bf16 products summed in
 * pairs into 16 f32 lanes), compiled with kern_avx512.c's flags and only
 * called on CPUs dispatch.c found it on.
 *
 * The activations are rounded to bf16 once per call (bf16_pack_act, as
 * llama.cpp and PyTorch's bf16 matmul do); products of two bf16 are exact
 * in f32 and the sums are f32, so the only new rounding is that of x.
 * The instruction treats subnormal inputs as zero and flushes subnormal
 * results; the conversion flushes subnormal x the same way.
 *
 * The product is blocked as in BLIS: per thread, a panel of NR weight rows
 * is packed pair-major (word p * NR + j holds row j's elements 2p, 2p+1)
 * into the thread's scratch, then every tile of MR tokens (packed the same
 * way by the driver) multiplies it with MR x 2 accumulators in registers:
 * per column pair, two loads of the panel, MR broadcasts of the tokens'
 * pairs, 2 MR dot products.  Each weight is read from memory once per call
 * and the panel is read from cache once per MR tokens.
 */
#include <immintrin.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "backend/cpu/transpose16.h"

#define MR CPU_BF16_MR
#define NR 32
/* Column pairs per packed block: the panel (NR rows of KB pairs, 128 KiB)
 * stays in L2 while every token tile streams it. */
#define KB 1024
_Static_assert(NR * KB <= CPU_SCRATCH_FLOATS, "a packed block fits a thread's scratch");

void cpu_bf16_pack_act_avx512(uint32_t *xb, const float *x, int n, int in)
{
    size_t pairs = cpu_bf16_pairs(in);
    bool tiled = n >= CPU_BF16_GEMM_MIN_TOKENS;
    memset(xb, 0, cpu_bf16_act_words(n, in) * sizeof(*xb));
    for (int t = 0; t < n; t++) {
        /* word of pair 0 and the step between pairs */
        uint32_t *dst = tiled ? xb + (size_t)(t / MR) * pairs * MR + (size_t)(t % MR) : xb + (size_t)t * pairs;
        size_t step = tiled ? MR : 1;
        const float *row = x + (size_t)t * (size_t)in;
        for (int i = 0; i < in; i += 32) {
            int left = in - i;
            __mmask16 lo = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            __mmask16 hi = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
            /* round to nearest even; the zeros past in pad the last pair */
            __m512bh h = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, row + i + 16), _mm512_maskz_loadu_ps(lo, row + i));
            _Alignas(64) uint32_t w[16];
            _mm512_store_si512(w, (__m512i)h);
            int np = left >= 32 ? 16 : (left + 1) / 2;
            for (int p = 0; p < np; p++)
                dst[(size_t)(i / 2 + p) * step] = w[p];
        }
    }
}

/* Decode: y[t0 .. t0+TN) of rows [r, r+RN), TN <= 4 tokens whose pairs
 * are rows of xb: every 64-byte load of weights feeds TN dot products.  PF:
 * this call streams the rows from memory, so it prefetches the rows four
 * ahead (a row is often a page of its own, where the hardware prefetcher
 * starts over); later calls on the same rows find them in cache.  TN, RN
 * and PF are constants after inlining, so the TN x RN sums stay in
 * registers. */
static inline __attribute__((always_inline)) void matvec_block(const struct cpu_mm *a, int t0, const int TN, int r,
                                                               const int RN, const bool PF)
{
    size_t in = (size_t)a->in, pairs = cpu_bf16_pairs(a->in), body = in / 32 * 32;
    __mmask32 tail = (__mmask32)((1ull << (in - body)) - 1);
    const uint16_t *x = (const uint16_t *)(a->xb + (size_t)t0 * pairs);
    size_t xs = 2 * pairs; /* elements from one token's row to the next */
    const uint16_t *w0 = (const uint16_t *)a->w + (size_t)r * in;
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int t = 0; t < TN; t++)
#pragma GCC unroll 4
        for (int k = 0; k < RN; k++)
            acc[t][k] = _mm512_setzero_ps();
    for (size_t i = 0; i <= body; i += 32) {
        __mmask32 m = i < body ? 0xffffffffu : tail;
        if (!m)
            break;
        __m512bh xv[4];
#pragma GCC unroll 4
        for (int t = 0; t < TN; t++)
            xv[t] = (__m512bh)_mm512_maskz_loadu_epi16(m, x + (size_t)t * xs + i);
#pragma GCC unroll 4
        for (int k = 0; k < RN; k++) {
            const uint16_t *wk = w0 + (size_t)k * in + i;
            if (PF)
                _mm_prefetch((const char *)(wk + 4 * in), _MM_HINT_T0);
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, wk);
#pragma GCC unroll 4
            for (int t = 0; t < TN; t++)
                acc[t][k] = _mm512_dpbf16_ps(acc[t][k], wv, xv[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < TN; t++)
#pragma GCC unroll 4
        for (int k = 0; k < RN; k++)
            a->y[(size_t)(t0 + t) * (size_t)a->out + (size_t)(r + k)] = _mm512_reduce_add_ps(acc[t][k]);
}

/* Rows [r, r+RN) times every token, four at a time: the first four stream
 * the rows from memory, the rest read them from cache, so W is read from
 * memory once whatever the batch below CPU_BF16_GEMM_MIN_TOKENS.  Each
 * token's sums run in the same order whatever the batch, so a token's
 * output does not depend on the others beside it. */
static inline __attribute__((always_inline)) void matvec_rows(const struct cpu_mm *a, int r, const int RN)
{
    int n = a->n, t = n >= 4 ? 4 : n;
    switch (t) { /* the streaming call */
    case 4: matvec_block(a, 0, 4, r, RN, true); break;
    case 3: matvec_block(a, 0, 3, r, RN, true); break;
    case 2: matvec_block(a, 0, 2, r, RN, true); break;
    case 1: matvec_block(a, 0, 1, r, RN, true); break;
    }
    for (; t + 4 <= n; t += 4)
        matvec_block(a, t, 4, r, RN, false);
    switch (n - t) {
    case 3: matvec_block(a, t, 3, r, RN, false); break;
    case 2: matvec_block(a, t, 2, r, RN, false); break;
    case 1: matvec_block(a, t, 1, r, RN, false); break;
    }
}

/* Rows [0, nr) of w (row stride in elements), pairs [p0, p0 + np), into
 * bp[p * NR + j]; rows past nr and elements past in are zero. */
static void pack_panel(uint32_t *bp, const uint16_t *w, size_t in, int nr, size_t p0, size_t np)
{
    for (int j0 = 0; j0 < NR; j0 += 16)
        for (size_t p = 0; p < np; p += 16) {
            size_t e = 2 * (p0 + p), left = in - e < 32 ? in - e : 32;
            __mmask32 m = left >= 32 ? 0xffffffffu : (__mmask32)((1u << left) - 1);
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                const uint16_t *row = w + (size_t)(j0 + j) * in + e;
                r[j] = j0 + j < nr ? _mm512_maskz_loadu_epi16(m, row) : _mm512_setzero_si512();
                /* the same pairs NR rows on: rows are pages apart, and the
                 * hardware prefetcher starts over on every page */
                if (j0 + j < nr)
                    _mm_prefetch((const char *)(row + (size_t)NR * in), _MM_HINT_T1);
            }
            transpose16(r);
            size_t n16 = np - p < 16 ? np - p : 16;
            for (size_t i = 0; i < n16; i++)
                _mm512_store_si512(bp + (p + i) * NR + (size_t)j0, r[i]);
        }
}

/* y[t][0..nr) (+)= tile a (MR tokens, np pairs) . panel b, for the rows of
 * the tile below mr; add: y holds an earlier block's sums. */
static inline void tile(float *y, size_t ys, const uint32_t *a, const uint32_t *b, size_t np, int mr, int nr, bool add)
{
    __m512 c0[MR], c1[MR];
    for (int r = 0; r < MR; r++)
        c0[r] = c1[r] = _mm512_setzero_ps();
    for (size_t p = 0; p < np; p++, a += MR, b += NR) {
        __m512bh b0 = (__m512bh)_mm512_load_si512(b), b1 = (__m512bh)_mm512_load_si512(b + 16);
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            __m512bh ar = (__m512bh)_mm512_set1_epi32((int)a[r]);
            c0[r] = _mm512_dpbf16_ps(c0[r], b0, ar);
            c1[r] = _mm512_dpbf16_ps(c1[r], b1, ar);
        }
    }
    __mmask16 m0 = nr >= 16 ? 0xffff : (__mmask16)((1u << nr) - 1);
    __mmask16 m1 = nr >= 32 ? 0xffff : nr <= 16 ? 0 : (__mmask16)((1u << (nr - 16)) - 1);
    for (int r = 0; r < mr; r++, y += ys) {
        if (add) {
            c0[r] = _mm512_add_ps(c0[r], _mm512_maskz_loadu_ps(m0, y));
            c1[r] = _mm512_add_ps(c1[r], _mm512_maskz_loadu_ps(m1, y + 16));
        }
        _mm512_mask_storeu_ps(y, m0, c0[r]);
        _mm512_mask_storeu_ps(y + 16, m1, c1[r]);
    }
}

/* The batch as tiles of MR tokens against panels of NR rows. */
static void gemm(const struct cpu_mm *a, int r0, int r1, float *scratch)
{
    uint32_t *bp = (uint32_t *)scratch;
    size_t in = (size_t)a->in, pairs = cpu_bf16_pairs(a->in), ys = (size_t)a->out;
    for (int n0 = r0; n0 < r1; n0 += NR) {
        int nr = r1 - n0 < NR ? r1 - n0 : NR;
        const uint16_t *w = (const uint16_t *)a->w + (size_t)n0 * in;
        for (size_t p0 = 0; p0 < pairs; p0 += KB) {
            size_t np = pairs - p0 < KB ? pairs - p0 : KB;
            pack_panel(bp, w, in, nr, p0, np);
            for (int t = 0; t < a->n; t += MR) {
                const uint32_t *xt = a->xb + (size_t)(t / MR) * pairs * MR + p0 * MR;
                int mr = a->n - t < MR ? a->n - t : MR;
                tile(a->y + (size_t)t * ys + (size_t)n0, ys, xt, bp, np, mr, nr, p0 > 0);
            }
        }
    }
}

void cpu_matmul_bf16_avx512(const struct cpu_mm *a, int r0, int r1, float *scratch)
{
    if (a->n >= CPU_BF16_GEMM_MIN_TOKENS) {
        gemm(a, r0, r1, scratch);
        return;
    }
    int r = r0;
    for (; r + 4 <= r1; r += 4)
        matvec_rows(a, r, 4);
    for (; r < r1; r++)
        matvec_rows(a, r, 1);
}
