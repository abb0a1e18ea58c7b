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
/* Longest weight row that up to four tokens stream one row at a time
 * (TinyLlama's 2048 columns: yes; its down projection's 5632: no);
 * docs/benchmarks.md, "Kept: one token streams short rows one at a time". */
#define CPU_BF16_LONG_ROW 4096
#define NR 32
/* Column pairs per packed block: the panel (NR rows of KB pairs, 128 KiB)
 * stays in L2 while every token tile streams it. */
#define KB 1024
_Static_assert(NR * KB <= CPU_SCRATCH_FLOATS, "a packed block fits a thread's scratch");
_Static_assert(MR == 12, "gemm's switch has a tile for every token count up to MR");

void cpu_bf16_pack_act_avx512(uint32_t *xb, const float *x, int n, int in)
{
    size_t pairs = cpu_bf16_pairs(in);
    bool tiled = n >= CPU_BF16_GEMM_MIN_TOKENS;
    memset(xb, 0, cpu_bf16_act_words(n, in) * sizeof(*xb));
    for (int t = 0; t < n; t++) {
        /* word of pair 0 and the step between pairs */
        uint32_t *dst = tiled ? xb + (size_t)(t / MR) * pairs * MR + (size_t)(t % MR)
                              : xb + (size_t)t * cpu_bf16_row_words(in);
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
    size_t in = (size_t)a->in, rw = cpu_bf16_row_words(a->in), body = in / 32 * 32;
    __mmask32 tail = (__mmask32)((1ull << (in - body)) - 1);
    const uint16_t *x = (const uint16_t *)(a->xb + (size_t)t0 * rw);
    size_t xs = 2 * rw; /* elements from one token's row to the next */
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
            }
            transpose16(r);
            size_t n16 = np - p < 16 ? np - p : 16;
            for (size_t i = 0; i < n16; i++)
                _mm512_store_si512(bp + (p + i) * NR + (size_t)j0, r[i]);
        }
}

/* The weight rows of the block packed next, which the tiles of this one
 * prefetch a share each: rows [lo, hi) of w (row stride in elements),
 * pairs [0, np).  Fetching the block while the last is multiplied, a line
 * now and then, keeps the memory busy while the core computes; prefetched
 * in one burst as it was packed, the core waited on those prefetches for
 * over a quarter of a 64-token product. */
struct next_block {
    const uint16_t *w;
    size_t in, np;
    int lo, hi;
};

/* y[t][0..nr) (+)= the first MT tokens of tile a (MR tokens a pair, np
 * pairs) . panel b; add: y holds an earlier block's sums.  MT is a
 * constant after inlining, so a batch's last, partial tile does only its
 * own tokens' products (a 64-token prefill's sixth tile has 4 of 12). */
static inline __attribute__((always_inline)) void tile(float *y, size_t ys, const uint32_t *a, const uint32_t *b,
                                                       size_t np, const int MT, int nr, bool add,
                                                       const struct next_block *nb)
{
    __m512 c0[MR], c1[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MT; r++)
        c0[r] = c1[r] = _mm512_setzero_ps();
    for (size_t p = 0; p < np; p++, a += MR, b += NR) {
        if (p % 16 == 0 && p < nb->np) /* 16 pairs: a line of each row */
            for (int j = nb->lo; j < nb->hi; j++)
                _mm_prefetch((const char *)(nb->w + (size_t)j * nb->in + 2 * p), _MM_HINT_T1);
        __m512bh b0 = (__m512bh)_mm512_load_si512(b), b1 = (__m512bh)_mm512_load_si512(b + 16);
#pragma GCC unroll 16
        for (int r = 0; r < MT; r++) {
            __m512bh ar = (__m512bh)_mm512_set1_epi32((int)a[r]);
            c0[r] = _mm512_dpbf16_ps(c0[r], b0, ar);
            c1[r] = _mm512_dpbf16_ps(c1[r], b1, ar);
        }
    }
    __mmask16 m0 = nr >= 16 ? 0xffff : (__mmask16)((1u << nr) - 1);
    __mmask16 m1 = nr >= 32 ? 0xffff : nr <= 16 ? 0 : (__mmask16)((1u << (nr - 16)) - 1);
    for (int r = 0; r < MT; r++, y += ys) {
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
    int tiles = (a->n + MR - 1) / MR;
    for (int n0 = r0; n0 < r1; n0 += NR) {
        int nr = r1 - n0 < NR ? r1 - n0 : NR;
        const uint16_t *w = (const uint16_t *)a->w + (size_t)n0 * in;
        for (size_t p0 = 0; p0 < pairs; p0 += KB) {
            size_t np = pairs - p0 < KB ? pairs - p0 : KB;
            pack_panel(bp, w, in, nr, p0, np);
            /* the next block: the next pairs of these rows, else the next rows */
            struct next_block nb = {.w = w, .in = in};
            int nnr = 0;
            if (p0 + np < pairs) {
                nb.w = w + 2 * (p0 + np);
                nb.np = pairs - p0 - np;
                nnr = nr;
            } else if (n0 + NR < r1) {
                nb.w = w + (size_t)NR * in;
                nb.np = pairs;
                nnr = r1 - n0 - NR < NR ? r1 - n0 - NR : NR;
            }
            if (nb.np > KB)
                nb.np = KB;
            for (int t = 0; t < a->n; t += MR) {
                const uint32_t *xt = a->xb + (size_t)(t / MR) * pairs * MR + p0 * MR;
                float *yt = a->y + (size_t)t * ys + (size_t)n0;
                nb.lo = nnr * (t / MR) / tiles;
                nb.hi = nnr * (t / MR + 1) / tiles;
                switch (a->n - t < MR ? a->n - t : MR) {
#define TILE(k) case k: tile(yt, ys, xt, bp, np, k, nr, p0 > 0, &nb); break;
                TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)
#undef TILE
                }
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
    /* Up to four tokens read rows of up to CPU_BF16_LONG_ROW elements one
     * at a time: blocks of four rows a page apart share L1 sets with each
     * other and with the four rows prefetched ahead, and evict lines
     * before they are read; one row streams faster, and the out-of-order
     * core overlaps one short row's chain of sums with the next's.  A
     * longer row's single chain is bound by the latency of its sums, and
     * more tokens by the loads of their pairs, so they keep blocks of
     * four rows (each load of a token's pairs then feeds four rows).
     * Either way a row's sums run in one order. */
    int r = r0;
    if (a->n > 4 || a->in > CPU_BF16_LONG_ROW)
        for (; r + 4 <= r1; r += 4)
            matvec_rows(a, r, 4);
    for (; r < r1; r++)
        matvec_rows(a, r, 1);
}

/* ---- attention over bf16 keys and values ----
 *
 * A bf16 cache is read by the same instruction: the scores are dot
 * products of the query, rounded to bf16, with the keys, and the output
 * adds the values weighted by the softmax weights, rounded to bf16 (as a
 * bf16 model's attention in PyTorch rounds its query and its weights).
 * Nothing is widened: keys are transposed as pairs (a word holds two
 * elements of one key), values interleaved as pairs of keys, so an
 * instruction does 32 products where an f32 multiply-add does 16.
 * Every score and every output element is one chain over its pairs in
 * order, whatever rows or heads share a call, so a token's result does not
 * depend on its tile. */

/* Query rows or weights packed at once: a stack area of this many words. */
#define ATTN_PAIRS_WORDS 4096

/* Rows [0, nr) of x (row stride xs floats, n floats each) rounded to bf16
 * as pairs after s (0 or 1) zeros: word p of row g at xb[g * pairs + p],
 * pairs = (n + s + 1) / 2, zero past the row. */
static void pack_pairs_from(uint32_t *xb, const float *x, size_t xs, int nr, int n, int s)
{
    int len = n + s;
    size_t pairs = cpu_bf16_pairs(len);
    for (int g = 0; g < nr; g++)
        for (int i = 0; i < len; i += 32) {
            const float *row = x + (size_t)g * xs + i; /* element i of the shifted row is row[-s] */
            int left = len - i;
            __mmask16 lo = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            __mmask16 hi = left >= 32 ? 0xffff : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1);
            __m512 l = i == 0 && s ? _mm512_maskz_expandloadu_ps(lo & 0xfffe, row) /* the zero first */
                                   : _mm512_maskz_loadu_ps(lo, row - s);
            __m512bh h = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, row + 16 - s), l);
            int np = left >= 32 ? 16 : (left + 1) / 2;
            _mm512_mask_storeu_epi32(xb + (size_t)g * pairs + i / 2, (__mmask16)((1u << np) - 1), (__m512i)h);
        }
}

/* GN heads (a constant after inlining) against np pairs of a tile of 16
 * keys transposed into kt (pair i of every key in kt[i]), adding to acc:
 * per pair, one dot product per head with the pair broadcast. */
static inline __attribute__((always_inline)) void dot_pairs_heads(__m512 *acc, const uint32_t *qb, size_t pairs,
                                                                   const int GN, const __m512i *kt, size_t np)
{
    for (size_t i = 0; i < np; i++)
#pragma GCC unroll 8
        for (int h = 0; h < GN; h++)
            acc[h] = _mm512_dpbf16_ps(acc[h], (__m512bh)kt[i],
                                      (__m512bh)_mm512_set1_epi32((int)qb[(size_t)h * pairs + i]));
}

/* Pairs [p, p + 16) of keys rows[0, nr) (zero past nr and past n
 * elements) transposed: r[i] holds pair p + i of the 16 keys. */
static inline __attribute__((always_inline)) void key_pairs16(__m512i r[16], const char *const *rows, int nr, int n,
                                                               size_t p)
{
    __mmask32 m = 2 * p + 32 <= (size_t)n ? 0xffffffffu : (__mmask32)((1ull << (n - 2 * p)) - 1);
    for (int j = 0; j < 16; j++)
        r[j] = j < nr ? _mm512_maskz_loadu_epi16(m, (const uint16_t *)rows[j] + 2 * p) : _mm512_setzero_si512();
    transpose16(r);
}

/* The scores of GN query rows (packed in qb) against a tile of keys:
 * transposed as they are needed (kt NULL; a decode step's 8 or fewer
 * heads per KV head), or already in kt (a prompt's many rows). */
static inline __attribute__((always_inline)) void dot_pairs_rows(float *s, size_t ss, const uint32_t *qb,
                                                                  const int GN, const char *const *rows, int nr,
                                                                  int n, const __m512i *kt)
{
    size_t pairs = cpu_bf16_pairs(n);
    __m512 acc[8];
#pragma GCC unroll 8
    for (int h = 0; h < GN; h++)
        acc[h] = _mm512_setzero_ps();
    for (size_t p = 0; p < pairs; p += 16) {
        size_t np = pairs - p < 16 ? pairs - p : 16;
        __m512i r[16];
        if (!kt)
            key_pairs16(r, rows, nr, n, p);
        dot_pairs_heads(acc, qb + p, pairs, GN, kt ? kt + p : r, np);
    }
    __mmask16 keep = (__mmask16)((1u << nr) - 1);
#pragma GCC unroll 8
    for (int h = 0; h < GN; h++)
        _mm512_mask_storeu_ps(s + (size_t)h * ss, keep, acc[h]);
}

void cpu_attn_dot_bf16_avx512(float *s, const float *q, int nq, const char *const *rows, int n, int nrows)
{
    size_t pairs = cpu_bf16_pairs(n);
    int group = (int)(ATTN_PAIRS_WORDS / pairs) / 8 * 8; /* query rows packed at once; pairs <= 512 */
    _Alignas(64) uint32_t qb[ATTN_PAIRS_WORDS];
    __m512i kt[512]; /* a transposed tile, when more than 8 rows read it */
    for (int g0 = 0; g0 < nq; g0 += group) {
        int gn = nq - g0 < group ? nq - g0 : group;
        pack_pairs_from(qb, q + (size_t)g0 * (size_t)n, (size_t)n, gn, n, 0);
        for (int r0 = 0; r0 < nrows; r0 += 16) {
            int nr = nrows - r0 < 16 ? nrows - r0 : 16, g = 0;
            float *sr = s + (size_t)g0 * (size_t)nrows + r0;
            const __m512i *tile = NULL;
            if (gn > 8) {
                for (size_t p = 0; p < pairs; p += 16)
                    key_pairs16(kt + p, rows + r0, nr, n, p);
                tile = kt;
            }
            for (; g + 8 <= gn; g += 8)
                dot_pairs_rows(sr + (size_t)g * (size_t)nrows, (size_t)nrows, qb + (size_t)g * pairs, 8, rows + r0, nr,
                               n, tile);
            for (; g < gn; g++)
                dot_pairs_rows(sr + (size_t)g * (size_t)nrows, (size_t)nrows, qb + (size_t)g * pairs, 1, rows + r0, nr,
                               n, tile);
        }
    }
}

/* Keys r and r + 1 of a strip of 32 columns as pairs: lo holds columns
 * 0-15 (word i: key r's column i, then key r + 1's), hi columns 16-31. */
static inline void interleave_pairs(__m512i a, __m512i b, __m512i *lo, __m512i *hi)
{
    const __m512i ilo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
    *lo = _mm512_permutex2var_epi16(a, ilo, b);
    *hi = _mm512_permutex2var_epi16(a, ihi, b);
}

/* GN heads by NS strips of 16 columns (constants after inlining): the
 * sums of every pair of keys, in order, held in registers. */
static inline __attribute__((always_inline)) void axpy_pairs_block(float *y, size_t ys, const uint32_t *ab,
                                                                    size_t as, const int GN, const int NS,
                                                                    const uint32_t *vt, size_t kp, int n)
{
    __m512 acc[4][4];
    __mmask16 m[4];
#pragma GCC unroll 4
    for (int j = 0; j < NS; j++)
        m[j] = n - 16 * j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - 16 * j)) - 1);
#pragma GCC unroll 4
    for (int g = 0; g < GN; g++)
#pragma GCC unroll 4
        for (int j = 0; j < NS; j++)
            acc[g][j] = _mm512_maskz_loadu_ps(m[j], y + (size_t)g * ys + 16 * j);
    for (size_t p = 0; p < kp; p++) {
        __m512bh v[4];
#pragma GCC unroll 4
        for (int j = 0; j < NS; j++)
            v[j] = (__m512bh)_mm512_load_si512(vt + (p * 4 + (size_t)j) * 16);
#pragma GCC unroll 4
        for (int g = 0; g < GN; g++) {
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)ab[(size_t)g * as + p]);
#pragma GCC unroll 4
            for (int j = 0; j < NS; j++)
                acc[g][j] = _mm512_dpbf16_ps(acc[g][j], v[j], w);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GN; g++)
#pragma GCC unroll 4
        for (int j = 0; j < NS; j++)
            _mm512_mask_storeu_ps(y + (size_t)g * ys + 16 * j, m[j], acc[g][j]);
}

static inline __attribute__((always_inline)) void axpy_pairs_strips(float *y, size_t ys, const uint32_t *ab,
                                                                     size_t as, const int GN, const uint32_t *vt,
                                                                     size_t kp, int n)
{
    switch ((n + 15) / 16) {
    case 4: axpy_pairs_block(y, ys, ab, as, GN, 4, vt, kp, n); break;
    case 3: axpy_pairs_block(y, ys, ab, as, GN, 3, vt, kp, n); break;
    case 2: axpy_pairs_block(y, ys, ab, as, GN, 2, vt, kp, n); break;
    case 1: axpy_pairs_block(y, ys, ab, as, GN, 1, vt, kp, n); break;
    }
}

/* Keys pair up from even indices of the source's order, so the sums of a
 * key do not depend on where its chunk began: odd says rows[0] is the
 * second of its pair (the first reads as zero).  Keys go 64 at a time
 * (y holds the sums between batches, exactly as registers would). */
void cpu_attn_axpy_bf16_avx512(float *y, const float *a, int nq, const char *const *rows, size_t off, int n,
                               int nrows, bool odd)
{
    enum { BATCH = 64 }; /* keys interleaved at once */
    _Alignas(64) uint32_t ab[ATTN_PAIRS_WORDS];
    _Alignas(64) uint32_t vt[BATCH / 2 * 4 * 16]; /* pair p's strip j at vt[(p * 4 + j) * 16] */
    int s = odd ? 1 : 0;
    for (int k0 = 0; k0 < nrows; k0 += BATCH - s, s = 0) {
        int nk = nrows - k0 < BATCH - s ? nrows - k0 : BATCH - s; /* keys of the batch, after s zero ones */
        size_t kp = cpu_bf16_pairs(nk + s);
        int group = (int)(ATTN_PAIRS_WORDS / kp) / 4 * 4;
        const char *const *rk = rows + k0;
        for (int g0 = 0; g0 < nq; g0 += group) {
            int gn = nq - g0 < group ? nq - g0 : group;
            /* weights shifted by s: pair p holds keys 2p - s and 2p + 1 - s */
            pack_pairs_from(ab, a + (size_t)g0 * (size_t)nrows + k0, (size_t)nrows, gn, nk, s);
            for (int c0 = 0; c0 < n; c0 += 64) {
                int nc = n - c0 < 64 ? n - c0 : 64;
                for (size_t p = 0; p < kp; p++) {
                    int ka = (int)(2 * p) - s, kb = ka + 1;
                    for (int h = 0; h < nc; h += 32) {
                        __mmask32 m = nc - h >= 32 ? 0xffffffffu : (__mmask32)((1u << (nc - h)) - 1);
                        __m512i va = ka >= 0 ? _mm512_maskz_loadu_epi16(m, (const uint16_t *)(rk[ka] + off) + c0 + h)
                                             : _mm512_setzero_si512();
                        __m512i vb = kb < nk ? _mm512_maskz_loadu_epi16(m, (const uint16_t *)(rk[kb] + off) + c0 + h)
                                             : _mm512_setzero_si512();
                        __m512i lo, hi;
                        interleave_pairs(va, vb, &lo, &hi);
                        _mm512_store_si512(vt + (p * 4 + (size_t)h / 16) * 16, lo);
                        _mm512_store_si512(vt + (p * 4 + (size_t)h / 16 + 1) * 16, hi);
                    }
                }
                float *yg = y + (size_t)g0 * (size_t)n + c0;
                int g = 0;
                for (; g + 4 <= gn; g += 4)
                    axpy_pairs_strips(yg + (size_t)g * (size_t)n, (size_t)n, ab + (size_t)g * kp, kp, 4, vt, kp, nc);
                for (; g < gn; g++)
                    axpy_pairs_strips(yg + (size_t)g * (size_t)n, (size_t)n, ab + (size_t)g * kp, kp, 1, vt, kp, nc);
            }
        }
    }
}
