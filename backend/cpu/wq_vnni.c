/* wq_vnni.c - the quantized-weight matmul (Q8_0, Q4_K; wq_rows.h) on
 * AVX-512 VNNI, compiled with the AVX-512 and VNNI flags and only called
 * after dispatch.c found both (levels avx512vnni and avx512bf16).  vpdpbusd multiplies
 * unsigned by signed bytes and adds each four into an int32 lane in one
 * instruction, where AVX2 takes two and an int16 step.
 *
 * Q4_K decode has a 512-bit loop of its own: the 32 bytes of codes that
 * hold sub-blocks 2i (low nibbles) and 2i+1 (high) are broadcast to both
 * halves of a register and shifted apart, so one vpdpbusd takes both
 * sub-blocks against 64 consecutive activation codes (wq_rows.h's
 * q4k_acts: one run of codes per token).
 *
 * Batches (CPU_WQ_GEMM_MIN_TOKENS tokens and more) take a blocked int8
 * GEMM instead, laid out as bf16_avx512.c's: per thread, a panel of NR
 * weight rows is packed once into the thread's scratch with every code
 * made unsigned (Q4_K's nibbles widened to bytes, Q8_0's codes + 128) and
 * the rows in the lanes: word s of group g holds elements 4s .. 4s+3 of
 * block g of one row, 16 rows a vector.  A tile of MR tokens then runs
 * through the panel with MR x 2 integer accumulators: per word, two
 * panel loads, MR broadcasts of the tokens' codes (straight from the
 * driver's blocks), 2 MR vpdpbusd.  At each block's end the integer sums
 * are scaled into f32 accumulators with the scalar oracle's products in
 * its order, so the result equals the scalar level's bit for bit.  Each
 * weight is read from memory and decoded once per call, and from cache
 * once per MR tokens.
 */
#include <immintrin.h>
#include <string.h>

static inline __attribute__((always_inline)) __m256i dot_u8s8(__m256i u, __m256i s)
{
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

#include "backend/cpu/transpose16.h"
#include "backend/cpu/wq_rows.h"

static inline __attribute__((always_inline)) void q4k_group512(const struct cpu_mm *a, const struct q4k_acts *x,
                                                               int r, const int ROWS)
{
    size_t nsb = (size_t)a->in / Q4_K_BLOCK, nb = (size_t)a->in / Q8_0_BLOCK;
    const struct q4_k_block *w0 = (const struct q4_k_block *)a->w + (size_t)r * nsb;
    const __m512i low4 = _mm512_set1_epi8(0x0f), shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    /* lanes 0..7 take sub-block 2i's scale, 8..15 sub-block 2i+1's */
    const __m512i pick[4] = {
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
        _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5),
        _mm512_setr_epi32(6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7),
    };
    for (int t = 0; t < a->n; t++) {
        const int8_t *xc = x->codes + (size_t)t * (size_t)a->in;
        const float *dx = x->dx + (size_t)t * nb, *xs = x->xs + (size_t)t * nb;
        __m512 acc[4];
        __m256 accm[4];
#pragma GCC unroll 4
        for (int k = 0; k < ROWS; k++) {
            acc[k] = _mm512_setzero_ps();
            accm[k] = _mm256_setzero_ps();
        }
        for (size_t sb = 0; sb < nsb; sb++) {
            __m512i xv[4];
            for (int i = 0; i < 4; i++)
                xv[i] = _mm512_loadu_si512(xc + sb * Q4_K_BLOCK + 64 * (size_t)i);
            __m256 dx8 = _mm256_loadu_ps(dx + sb * 8), xs8 = _mm256_loadu_ps(xs + sb * 8);
#pragma GCC unroll 4
            for (int k = 0; k < ROWS; k++) {
                const struct q4_k_block *wb = w0 + (size_t)k * nsb + sb;
                /* the next row group's 144 bytes, one group ahead */
                const char *next = (const char *)(wb + (size_t)ROWS * nsb);
                _mm_prefetch(next, _MM_HINT_T0);
                _mm_prefetch(next + 64, _MM_HINT_T0);
                _mm_prefetch(next + 128, _MM_HINT_T0);
                uint32_t u[4];
                q4_k_unpack(wb->scales, u);
                __m256 step = _mm256_mul_ps(_mm256_mul_ps(wq_bytes8(u[0], u[1]), _mm256_set1_ps(_cvtsh_ss(wb->d))), dx8);
                __m512 step16 = _mm512_castps256_ps512(step);
                for (int i = 0; i < 4; i++) {
                    __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wb->qs + 32 * i)));
                    q = _mm512_and_si512(_mm512_srlv_epi64(q, shift), low4);
                    __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv[i]);
                    acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(pick[i], step16), acc[k]);
                }
                __m256 off = _mm256_mul_ps(wq_bytes8(u[2], u[3]), _mm256_set1_ps(_cvtsh_ss(wb->dmin)));
                accm[k] = _mm256_fmadd_ps(off, xs8, accm[k]);
            }
        }
#pragma GCC unroll 4
        for (int k = 0; k < ROWS; k++)
            a->y[(size_t)t * a->out + r + k] = _mm512_reduce_add_ps(acc[k]) - wq_hsum(accm[k]);
    }
}

static void q4k_rows512(const struct cpu_mm *a, const struct q4k_acts *x, int r0, int r1)
{
    int r = r0;
    for (; r + 4 <= r1; r += 4)
        q4k_group512(a, x, r, 4);
    for (; r < r1; r++)
        q4k_group512(a, x, r, 1);
}

/* ---- batches: the blocked GEMM -------------------------------------------------- */

#define MR 6  /* tokens per tile */
#define NR 32 /* weight rows per panel: two vectors of lanes */

/* Bytes of a packed group (a Q8_0 block or a Q4_K sub-block, 32 elements
 * of NR rows): 8 words of codes per row, then the rows' f32 factors, one
 * (Q8_0: d) or two (Q4_K: d * sc, dmin * m). */
static size_t group_bytes(enum be_dtype wt)
{
    return 8 * NR * sizeof(int32_t) + (wt == BE_Q4_K ? 2 : 1) * NR * sizeof(float);
}

/* Rows [n0, n0 + nr) of a Q8_0 W as a panel (rows past nr zero). */
static void pack_q8(char *panel, const struct cpu_mm *a, int n0, int nr)
{
    size_t nb = (size_t)a->in / Q8_0_BLOCK, gb = group_bytes(BE_Q8_0);
    const struct q8_0_block *w = (const struct q8_0_block *)a->w + (size_t)n0 * nb;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int j0 = 0; j0 < NR; j0 += 16)
        for (size_t b = 0; b < nb; b += 2) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                if (j0 + j >= nr) {
                    r[j] = _mm512_setzero_si512();
                    continue;
                }
                const struct q8_0_block *row = w + (size_t)(j0 + j) * nb + b;
                /* the same blocks NR rows on: the next panel's */
                _mm_prefetch((const char *)(row + (size_t)NR * nb), _MM_HINT_T1);
                __m256i lo = _mm256_loadu_si256((const __m256i *)row[0].qs);
                __m256i hi = b + 1 < nb ? _mm256_loadu_si256((const __m256i *)row[1].qs) : _mm256_setzero_si256();
                r[j] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), bias);
            }
            transpose16(r);
            for (size_t g = b; g < b + 2 && g < nb; g++)
                for (int s = 0; s < 8; s++)
                    _mm512_store_si512(panel + g * gb + (size_t)s * NR * 4 + (size_t)j0 * 4, r[8 * (g - b) + (size_t)s]);
        }
    for (size_t b = 0; b < nb; b++) {
        float *d = (float *)(panel + b * gb + 8 * NR * 4);
        for (int j = 0; j < NR; j++)
            d[j] = j < nr ? _cvtsh_ss(w[(size_t)j * nb + b].d) : 0.0f;
    }
}

/* Rows [n0, n0 + nr) of a Q4_K W as a panel (rows past nr zero). */
static void pack_q4k(char *panel, const struct cpu_mm *a, int n0, int nr)
{
    size_t nsb = (size_t)a->in / Q4_K_BLOCK, gb = group_bytes(BE_Q4_K);
    const struct q4_k_block *w = (const struct q4_k_block *)a->w + (size_t)n0 * nsb;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int j0 = 0; j0 < NR; j0 += 16)
        for (size_t sb = 0; sb < nsb; sb++)
            for (int i = 0; i < 4; i++) { /* the bytes of sub-blocks 2i (low nibbles) and 2i+1 */
                __m512i r[16];
                for (int j = 0; j < 16; j++) {
                    if (j0 + j >= nr) {
                        r[j] = _mm512_setzero_si512();
                        continue;
                    }
                    const struct q4_k_block *blk = w + (size_t)(j0 + j) * nsb + sb;
                    _mm_prefetch((const char *)(blk + (size_t)NR * nsb) + 32 * i, _MM_HINT_T1);
                    __m256i q = _mm256_loadu_si256((const __m256i *)(blk->qs + 32 * i));
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
                    r[j] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, low4)), hi, 1);
                }
                transpose16(r);
                for (int h = 0; h < 2; h++)
                    for (int s = 0; s < 8; s++)
                        _mm512_store_si512(panel + (sb * 8 + 2 * (size_t)i + (size_t)h) * gb + (size_t)s * NR * 4 +
                                               (size_t)j0 * 4,
                                           r[8 * h + s]);
            }
    for (size_t sb = 0; sb < nsb; sb++)
        for (int j = 0; j < NR; j++) {
            const struct q4_k_block *blk = w + (size_t)j * nsb + sb;
            uint32_t u[4];
            if (j < nr)
                q4_k_unpack(blk->scales, u);
            float d = j < nr ? _cvtsh_ss(blk->d) : 0.0f, dmin = j < nr ? _cvtsh_ss(blk->dmin) : 0.0f;
            for (int k = 0; k < 8; k++) {
                float *f = (float *)(panel + (sb * 8 + (size_t)k) * gb + 8 * NR * 4);
                /* the scalar oracle's d * sc and dmin * m */
                f[j] = j < nr ? d * (float)((u[k / 4] >> (8 * (k % 4))) & 0xff) : 0.0f;
                f[NR + j] = j < nr ? dmin * (float)((u[2 + k / 4] >> (8 * (k % 4))) & 0xff) : 0.0f;
            }
        }
}

/* y[t][0..nr) for the MR tokens from xq (their blocks, ng a token) and
 * sums xsum, against a packed panel of ng groups.  The f32 steps are the
 * scalar oracle's, per block in block order:
 *     Q8_0: acc += (d * dx) * isum, isum = codes . (w + 128) - 128 * xsum
 *     Q4_K: acc += (d sc * dx) * isum - dmin m * (dx * xsum)
 * Q4K is a constant after inlining. */
static inline __attribute__((always_inline)) void tile(float *y, size_t ys, const struct cpu_q8_act *xq,
                                                       const int32_t *xsum, size_t ng, const char *panel, size_t gb,
                                                       __mmask16 m0, __mmask16 m1, const bool Q4K)
{
    __m512 f0[MR], f1[MR];
    for (int t = 0; t < MR; t++)
        f0[t] = f1[t] = _mm512_setzero_ps();
    for (size_t g = 0; g < ng; g++, panel += gb) {
        __m512i i0[MR], i1[MR];
#pragma GCC unroll 8
        for (int t = 0; t < MR; t++)
            i0[t] = i1[t] = Q4K ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * xsum[(size_t)t * ng + g]);
        const __m512i *wv = (const __m512i *)panel;
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) {
            __m512i w0 = _mm512_load_si512(wv + 2 * s), w1 = _mm512_load_si512(wv + 2 * s + 1);
#pragma GCC unroll 8
            for (int t = 0; t < MR; t++) {
                int32_t word;
                memcpy(&word, xq[(size_t)t * ng + g].qs + 4 * s, sizeof word);
                __m512i xv = _mm512_set1_epi32(word);
                i0[t] = _mm512_dpbusd_epi32(i0[t], w0, xv);
                i1[t] = _mm512_dpbusd_epi32(i1[t], w1, xv);
            }
        }
        const float *fw = (const float *)(panel + 8 * NR * 4);
        __m512 d0 = _mm512_load_ps(fw), d1 = _mm512_load_ps(fw + 16);
#pragma GCC unroll 8
        for (int t = 0; t < MR; t++) {
            float dxs = xq[(size_t)t * ng + g].d;
            __m512 dx = _mm512_set1_ps(dxs);
            __m512 p0 = _mm512_mul_ps(_mm512_mul_ps(d0, dx), _mm512_cvtepi32_ps(i0[t]));
            __m512 p1 = _mm512_mul_ps(_mm512_mul_ps(d1, dx), _mm512_cvtepi32_ps(i1[t]));
            if (Q4K) {
                __m512 xs = _mm512_set1_ps(dxs * (float)xsum[(size_t)t * ng + g]);
                p0 = _mm512_sub_ps(p0, _mm512_mul_ps(_mm512_load_ps(fw + NR), xs));
                p1 = _mm512_sub_ps(p1, _mm512_mul_ps(_mm512_load_ps(fw + NR + 16), xs));
            }
            f0[t] = _mm512_add_ps(f0[t], p0);
            f1[t] = _mm512_add_ps(f1[t], p1);
        }
    }
    for (int t = 0; t < MR; t++, y += ys) {
        _mm512_mask_storeu_ps(y, m0, f0[t]);
        _mm512_mask_storeu_ps(y + 16, m1, f1[t]);
    }
}

/* Rows [r0, r1) of every token, a->n >= MR: panels of NR rows, tiles of
 * MR tokens, the last tile ending at the last token (it may overlap the
 * one before, which then writes the same values twice). */
static void wq_gemm(const struct cpu_mm *a, int r0, int r1, char *panel)
{
    size_t ng = (size_t)a->in / 32, gb = group_bytes(a->wt), ys = (size_t)a->out;
    for (int n0 = r0; n0 < r1; n0 += NR) {
        int nr = r1 - n0 < NR ? r1 - n0 : NR;
        __mmask16 m0 = nr >= 16 ? 0xffff : (__mmask16)((1u << nr) - 1);
        __mmask16 m1 = nr >= 32 ? 0xffff : nr <= 16 ? 0 : (__mmask16)((1u << (nr - 16)) - 1);
        if (a->wt == BE_Q4_K)
            pack_q4k(panel, a, n0, nr);
        else
            pack_q8(panel, a, n0, nr);
        for (int t0 = 0; t0 < a->n; t0 += MR) {
            int t = a->n - t0 < MR ? a->n - MR : t0;
            float *y = a->y + (size_t)t * ys + (size_t)n0;
            const struct cpu_q8_act *xq = a->xq + (size_t)t * ng;
            const int32_t *xsum = a->xsum + (size_t)t * ng;
            if (a->wt == BE_Q4_K)
                tile(y, ys, xq, xsum, ng, panel, gb, m0, m1, true);
            else
                tile(y, ys, xq, xsum, ng, panel, gb, m0, m1, false);
        }
    }
}

static bool wq_gemm_takes(int n, int in)
{
    return n >= CPU_WQ_GEMM_MIN_TOKENS && in <= CPU_WQ_GEMM_MAX_IN;
}

bool cpu_wq_f32_vnni(int n, int in)
{
    return !wq_gemm_takes(n, in) && wq_panels(n, in);
}

void cpu_matmul_wq_vnni(const struct cpu_mm *a, int r0, int r1, float *scratch)
{
    _Static_assert(CPU_WQ_GEMM_MIN_TOKENS >= MR, "a batch fills at least one tile");
    _Static_assert(CPU_WQ_GEMM_MAX_IN / 32 * (8 * NR * 4 + 2 * NR * 4) <= CPU_SCRATCH_FLOATS * sizeof(float),
                   "a panel fits a thread's scratch");
    if (wq_gemm_takes(a->n, a->in)) {
        wq_gemm(a, r0, r1, (char *)scratch);
        return;
    }
    wq_matmul(a, r0, r1, scratch, q4k_rows512);
}
