/* Description: Q8_0 weights: the quantizer (util/q8.h) against its
 * definition and its error bound, and be_matmul with BE_Q8_0 weights at
 * every SIMD level the CPU supports, against the scalar level (the
 * reference) and against a dense product in double whose distance from the
 * kernels is bounded by the activations' rounding to int8.  Also the
 * shapes the seam refuses and the rounding ties of the activation
 * quantizer, which every level must break the same way, and its blocks
 * too small for their scale's reciprocal.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#include "tests/levels.h"
#include "util/q8.h"


/* The test's own f16 decoding: the compiler's _Float16. */
static double f16_value(uint16_t h)
{
    _Float16 v;
    memcpy(&v, &h, 2);
    return (double)v;
}

/* Weights whose blocks span magnitudes: scales from 1e-4 to 1e2, a block
 * of zeros, a block with one outlier. */
static void fill_weights(float *w, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        size_t b = i / Q8_0_BLOCK;
        float scale = b % 5 == 4 ? 0.0f : powf(10.0f, (float)(b % 7) - 4.0f);
        w[i] = frand() * scale;
        if (b % 11 == 3 && i % Q8_0_BLOCK == 7)
            w[i] = 50.0f * scale;
    }
}

/* ---- the quantizer -------------------------------------------------------- */

static void test_quantize_exact(void **state)
{
    (void)state;
    /* integers in [-127, 127] with 127 present: d is 1 and the codes are the values */
    float x[Q8_0_BLOCK];
    struct q8_0_block q;
    for (int i = 0; i < Q8_0_BLOCK; i++)
        x[i] = (float)(i * 8 - 127); /* -127, -119 .. 113, then 127 */
    x[31] = 127.0f;
    assert_true(q8_0_quantize(x, &q, Q8_0_BLOCK));
    assert_int_equal(q.d, 0x3c00); /* f16 1.0 */
    for (int i = 0; i < Q8_0_BLOCK; i++)
        assert_int_equal(q.qs[i], (int)x[i]);
    /* ties round away from zero, as llama.cpp's roundf: with d = 2 (max 254),
     * 1 -> 0.5 -> 1, -3 -> -1.5 -> -2, 5 -> 2.5 -> 3 */
    memset(x, 0, sizeof x);
    x[0] = 254.0f, x[1] = 1.0f, x[2] = -3.0f, x[3] = 5.0f;
    assert_true(q8_0_quantize(x, &q, Q8_0_BLOCK));
    assert_int_equal(q.d, 0x4000); /* f16 2.0 */
    assert_int_equal(q.qs[0], 127);
    assert_int_equal(q.qs[1], 1);
    assert_int_equal(q.qs[2], -2);
    assert_int_equal(q.qs[3], 3);
    assert_int_equal(q.qs[4], 0);
    /* all zeros: d 0, codes 0, nothing divided by zero */
    memset(x, 0, sizeof x);
    assert_true(q8_0_quantize(x, &q, Q8_0_BLOCK));
    assert_int_equal(q.d, 0);
    for (int i = 0; i < Q8_0_BLOCK; i++)
        assert_int_equal(q.qs[i], 0);
    /* a NaN or an infinity anywhere in a row is refused */
    float row[3 * Q8_0_BLOCK] = {0};
    struct q8_0_block qb[3];
    row[70] = NAN;
    assert_false(q8_0_quantize(row, qb, 3 * Q8_0_BLOCK));
    row[70] = -INFINITY;
    assert_false(q8_0_quantize(row, qb, 3 * Q8_0_BLOCK));
}

/* |w - deq(q(w))| <= d/2 with d = max|w| / 127, the scale the codes were
 * rounded with, plus what storing d as f16 moves a code of at most 127:
 * 127 |d - f16(d)|.  The largest |w| of a block maps to +-127. */
static void test_quantize_bound(void **state)
{
    (void)state;
    enum { N = 64 * Q8_0_BLOCK };
    float *w = malloc(N * sizeof *w), *back = malloc(N * sizeof *back);
    struct q8_0_block *q = malloc(N / Q8_0_BLOCK * sizeof *q);
    assert_non_null(w);
    assert_non_null(back);
    assert_non_null(q);
    fill_weights(w, N);
    assert_true(q8_0_quantize(w, q, N));
    q8_0_dequantize(q, back, N);
    for (size_t b = 0; b < N / Q8_0_BLOCK; b++) {
        double amax = 0;
        size_t imax = 0;
        for (size_t i = 0; i < Q8_0_BLOCK; i++)
            if (fabs(w[b * Q8_0_BLOCK + i]) > amax)
                amax = fabs(w[b * Q8_0_BLOCK + i]), imax = i;
        double d = amax / 127.0, d16 = f16_value(q[b].d);
        /* f16 keeps 11 significant bits, fewer below 2^-14 (steps of 2^-24) */
        assert_true(fabs(d16 - d) <= fmax(d * 0x1p-11, 0x1p-25));
        double bound = d / 2 * (1 + 1e-6) + 127.0 * fabs(d - d16);
        for (size_t i = 0; i < Q8_0_BLOCK; i++) {
            size_t k = b * Q8_0_BLOCK + i;
            assert_true(q[b].qs[i] >= -127 && q[b].qs[i] <= 127);
            assert_true(back[k] == (float)(d16 * q[b].qs[i]));
            if (fabs((double)w[k] - (double)back[k]) > bound)
                fail_msg("block %zu element %zu: w %g back %g, bound %g", b, i, w[k], back[k], bound);
        }
        if (amax > 0)
            assert_int_equal(abs(q[b].qs[imax]), 127);
    }
    free(w);
    free(back);
    free(q);
}

static void test_row_bytes(void **state)
{
    (void)state;
    assert_int_equal(be_row_bytes(BE_Q8_0, 64), 68);
    assert_int_equal(be_row_bytes(BE_Q8_0, 2048), 2176);
    assert_int_equal(be_row_bytes(BE_Q8_0, 48), 0);
    assert_int_equal(be_row_bytes(BE_BF16, 48), 96);
    assert_int_equal(be_dtype_size(BE_Q8_0), 0);
    assert_string_equal(be_dtype_name(BE_Q8_0), "q8_0");
}

/* ---- the matmul ------------------------------------------------------------- */

/* y of every level for x [n, in] and Q8_0 weights q [out, in]. */
static void run_level(be_backend *be, float *y, const float *x, const struct q8_0_block *q, int n, int in, int out,
                      const float *bias)
{
    size_t wbytes = (size_t)out * be_row_bytes(BE_Q8_0, (size_t)in);
    be_buffer *bx, *bw, *by, *bb = NULL;
    assert_int_equal(be_dev_alloc(be, (size_t)n * in * sizeof(float), &bx), BE_OK);
    assert_int_equal(be_dev_alloc(be, wbytes, &bw), BE_OK);
    assert_int_equal(be_dev_alloc(be, (size_t)n * out * sizeof(float), &by), BE_OK);
    assert_int_equal(be_copy(be, be_buffer_data(bx), x, (size_t)n * in * sizeof(float), BE_H2D), BE_OK);
    assert_int_equal(be_copy(be, be_buffer_data(bw), q, wbytes, BE_H2D), BE_OK);
    const float *dbias = NULL;
    if (bias) {
        assert_int_equal(be_dev_alloc(be, (size_t)out * sizeof(float), &bb), BE_OK);
        assert_int_equal(be_copy(be, be_buffer_data(bb), bias, (size_t)out * sizeof(float), BE_H2D), BE_OK);
        dbias = be_buffer_data(bb);
    }
    assert_int_equal(be_matmul(be, be_buffer_data(by), BE_F32, be_buffer_data(bx), be_buffer_data(bw), BE_Q8_0,
                               dbias, n, in, out),
                     BE_OK);
    assert_int_equal(be_copy(be, y, be_buffer_data(by), (size_t)n * out * sizeof(float), BE_D2H), BE_OK);
    be_buffer_free(bx);
    be_buffer_free(bw);
    be_buffer_free(by);
    be_buffer_free(bb);
}

/* Activations: random rows, and in row 0 a block of ties for the int8
 * rounding (max 127 makes the scale 1: 0.5, 1.5, 2.5 ... round to even). */
static void fill_acts(float *x, int n, int in)
{
    for (size_t i = 0; i < (size_t)n * in; i++)
        x[i] = frand() * (1.0f + (float)(i % 97) / 10.0f);
    for (int i = 0; i < Q8_0_BLOCK; i++)
        x[i] = i == 0 ? 127.0f : (float)(i - 16) + 0.5f;
}

static void check_q8_matmul(int n, int in, int out, bool with_bias)
{
    size_t nb = (size_t)in / Q8_0_BLOCK;
    float *x = malloc((size_t)n * in * sizeof *x), *w = malloc((size_t)out * in * sizeof *w);
    float *wd = malloc((size_t)out * in * sizeof *wd), *bias = malloc((size_t)out * sizeof *bias);
    float *ref = malloc((size_t)n * out * sizeof *ref), *y = malloc((size_t)n * out * sizeof *y);
    struct q8_0_block *q = malloc((size_t)out * nb * sizeof *q);
    double *bound = malloc((size_t)n * out * sizeof *bound), *exact = malloc((size_t)n * out * sizeof *exact);
    assert_true(x && w && wd && bias && ref && y && q && bound && exact);
    fill_acts(x, n, in);
    fill_weights(w, (size_t)out * in);
    for (int r = 0; r < out; r++)
        bias[r] = frand();
    assert_true(q8_0_quantize(w, q, (size_t)out * in));
    q8_0_dequantize(q, wd, (size_t)out * in);
    /* in double over the dequantized weights and x as given; the int8
     * kernels differ from it by at most sum over blocks of
     * d_w * sum|q_w| * d_x / 2 (each activation moves by at most half its
     * block's step d_x), and every level by f32 rounding */
    for (int t = 0; t < n; t++)
        for (int r = 0; r < out; r++) {
            double acc = with_bias ? bias[r] : 0, act = 0, mag = 0;
            for (size_t b = 0; b < nb; b++) {
                double amax = 0, qsum = 0;
                for (int i = 0; i < Q8_0_BLOCK; i++) {
                    size_t k = b * Q8_0_BLOCK + (size_t)i;
                    acc += (double)x[(size_t)t * in + k] * wd[(size_t)r * in + k];
                    mag += fabs((double)x[(size_t)t * in + k] * wd[(size_t)r * in + k]);
                    amax = fmax(amax, fabs((double)x[(size_t)t * in + k]));
                    qsum += abs(q[(size_t)r * nb + b].qs[i]);
                }
                act += f16_value(q[(size_t)r * nb + b].d) * qsum * (amax / 127.0) / 2;
            }
            exact[(size_t)t * out + r] = acc;
            bound[(size_t)t * out + r] = act * 1.0001 + (mag + act + fabs(acc)) * 1e-5 + 1e-30;
        }
    run_level(levels[0], ref, x, q, n, in, out, with_bias ? bias : NULL);
    for (int l = 0; l < N_LEVELS; l++) {
        if (!levels[l])
            continue;
        run_level(levels[l], y, x, q, n, in, out, with_bias ? bias : NULL);
        for (size_t i = 0; i < (size_t)n * out; i++) {
            if (fabs(y[i] - exact[i]) > bound[i])
                fail_msg("%s n=%d in=%d out=%d [%zu]: %.9g vs double %.9g, bound %g", level_names[l], n, in, out, i,
                         y[i], exact[i], bound[i]);
            /* every level and path (integers under 32 tokens, sgemm over
             * dequantized blocks from 32) multiplies the same rounded
             * activations: they differ from the scalar level in f32
             * summation order only, far inside the rounding itself */
            double tight = (fabs(exact[i]) + bound[i]) * 2e-5 + 1e-30;
            if (fabs((double)y[i] - ref[i]) > tight)
                fail_msg("%s n=%d in=%d out=%d [%zu]: %.9g vs scalar %.9g (tolerance %g)", level_names[l], n, in,
                         out, i, y[i], ref[i], tight);
            /* the VNNI levels' int8 GEMM rounds as the scalar level does */
            if (l >= 3 && n >= CPU_WQ_GEMM_MIN_TOKENS && in <= CPU_WQ_GEMM_MAX_IN &&
                memcmp(&y[i], &ref[i], sizeof y[i]) != 0)
                fail_msg("%s n=%d in=%d out=%d [%zu]: %.9g, scalar %.9g: not bit for bit", level_names[l], n, in,
                         out, i, y[i], ref[i]);
        }
    }
    free(x), free(w), free(wd), free(bias), free(ref), free(y), free(q), free(bound), free(exact);
}

static void test_q8_matmul(void **state)
{
    (void)state;
    static const int shapes[][3] = {
        {1, 32, 1}, {1, 32, 7}, {1, 96, 63}, {1, 2048, 33}, {2, 64, 17}, {3, 160, 130},
        {5, 544, 48}, {31, 96, 21}, {32, 64, 19}, {40, 256, 70}, {70, 96, 130},
        /* the int8 GEMM: its first batch, tiles of 6 tokens with tails, panels of 32 rows with tails, an odd
         * block count */
        {16, 96, 45}, {17, 800, 33}, {23, 64, 70}, {64, 2048, 37},
        {33, 16416, 3}, /* rows too long for its panels: gemm.c's sgemm at every SIMD level */
    };
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
        check_q8_matmul(shapes[s][0], shapes[s][1], shapes[s][2], s % 2 == 1);
}

/* A NaN in x shows in every output of the rows it reaches, at every level
 * (the int8 rounding has no code for it). */
static void test_q8_nan(void **state)
{
    (void)state;
    enum { IN = 64, OUT = 9 };
    float x[IN], w[OUT * IN], y[OUT];
    struct q8_0_block q[OUT * IN / Q8_0_BLOCK];
    for (int i = 0; i < IN; i++)
        x[i] = frand();
    x[40] = NAN;
    fill_weights(w, OUT * IN);
    assert_true(q8_0_quantize(w, q, OUT * IN));
    for (int l = 0; l < N_LEVELS; l++) {
        if (!levels[l])
            continue;
        run_level(levels[l], y, x, q, 1, IN, OUT, NULL);
        for (int r = 0; r < OUT; r++)
            if (!isnan(y[r]))
                fail_msg("%s row %d: %g, not NaN", level_names[l], r, y[r]);
    }
}

/* The activation quantizer of each level, for the byte-level checks. */
static const struct cpu_kern *const level_kerns[N_LEVELS] = {&cpu_kern_scalar, &cpu_kern_avx2, &cpu_kern_avx512,
                                                            &cpu_kern_avx512vnni, &cpu_kern_avx512bf16};

/* Activation blocks so small that 1 / (max|x| / 127) overflows f32 (max|x|
 * below about 3.7e-37: 1e-38, subnormals, one tiny value among zeros)
 * round as an all-zero block does, d 0 and every code 0, where the
 * reciprocal would make the codes garbage; at every level byte for byte,
 * and beside ordinary blocks (one just above the bound) that keep theirs.
 * A product over them is finite and the scalar level's. */
static void test_q8_tiny(void **state)
{
    (void)state;
    enum { NB = 8, IN = NB * Q8_0_BLOCK, OUT = 9, MAXN = 40 };
    static const bool tiny[NB] = {true, true, true, false, true, false, true, false};
    float row[IN];
    for (int i = 0; i < IN; i++) {
        int b = i / Q8_0_BLOCK, k = i % Q8_0_BLOCK;
        switch (b) {
        case 0: row[i] = frand() * 1e-38f; break;                    /* normal floats, 1 / d is inf */
        case 1: row[i] = k == 5 ? 0x1p-149f : frand() * 1e-40f; break; /* subnormals, the smallest among them */
        case 2: row[i] = k == 17 ? -3.6e-37f : 0.0f; break;         /* one value just below the bound */
        case 4: row[i] = k % 2 ? -0.0f : 1e-39f; break;
        case 6: row[i] = k == 0 ? 0x1p-149f : 0.0f; break;          /* d rounds to 0 itself */
        case 7: row[i] = k == 3 ? 4e-37f : frand() * 1e-37f; break;  /* just above: codes as usual */
        default: row[i] = frand() * 3.0f; break;
        }
    }
    struct cpu_q8_act ref[NB], q[NB];
    int32_t rsum[NB], sum[NB];
    cpu_kern_scalar.q8_act(ref, rsum, row, IN);
    for (int b = 0; b < NB; b++) {
        assert_true(isfinite(ref[b].d));
        if (!tiny[b]) {
            assert_true(ref[b].d > 0.0f);
            continue;
        }
        assert_true(ref[b].d == 0.0f);
        assert_int_equal(rsum[b], 0);
        for (int i = 0; i < Q8_0_BLOCK; i++)
            assert_int_equal(ref[b].qs[i], 0);
    }
    assert_int_equal(abs(ref[7].qs[3]), 127);
    for (int l = 1; l < N_LEVELS; l++) {
        if (!levels[l])
            continue;
        memset(q, 0x55, sizeof q);
        level_kerns[l]->q8_act(q, sum, row, IN);
        for (int b = 0; b < NB; b++)
            if (memcmp(&q[b].d, &ref[b].d, sizeof q[b].d) || memcmp(q[b].qs, ref[b].qs, sizeof q[b].qs) ||
                sum[b] != rsum[b])
                fail_msg("%s block %d: d %g sum %d, scalar d %g sum %d", level_names[l], b, q[b].d, sum[b], ref[b].d,
                         rsum[b]);
    }
    /* through be_matmul: one token and a batch past the int8 GEMM's and
     * sgemm's thresholds; odd tokens hold only the tiny blocks */
    float x[MAXN * IN], w[OUT * IN], y0[MAXN * OUT], y[MAXN * OUT];
    struct q8_0_block wq[OUT * IN / Q8_0_BLOCK];
    fill_weights(w, OUT * IN);
    assert_true(q8_0_quantize(w, wq, OUT * IN));
    for (int t = 0; t < MAXN; t++)
        for (int i = 0; i < IN; i++)
            x[t * IN + i] = t % 2 && !tiny[i / Q8_0_BLOCK] ? 0.0f : row[i];
    static const int ns[] = {1, 2, MAXN};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
        int n = ns[k];
        run_level(levels[0], y0, x, wq, n, IN, OUT, NULL);
        for (int l = 0; l < N_LEVELS; l++) {
            if (!levels[l])
                continue;
            run_level(levels[l], y, x, wq, n, IN, OUT, NULL);
            for (int i = 0; i < n * OUT; i++) {
                if (!isfinite(y[i]) || fabsf(y[i] - y0[i]) > fabsf(y0[i]) * 2e-5f)
                    fail_msg("%s n=%d [%d]: %.9g, scalar %.9g", level_names[l], n, i, y[i], y0[i]);
                if (i / OUT % 2 && y[i] != 0.0f)
                    fail_msg("%s n=%d [%d]: %.9g from tiny activations alone, not 0", level_names[l], n, i, y[i]);
            }
        }
    }
}

static void test_q8_bad_args(void **state)
{
    (void)state;
    float x[96] = {0}, y[4];
    struct q8_0_block q[12] = {{0}};
    /* a row that is not whole blocks has no Q8_0 layout */
    assert_int_equal(be_matmul(levels[0], y, BE_F32, x, q, BE_Q8_0, NULL, 1, 48, 2), BE_EINVAL);
    assert_int_equal(be_matmul(levels[0], y, BE_F32, x, q, BE_Q8_0, NULL, 1, 96, 4), BE_OK);
    /* a weight format, never an activation, KV or embedding type */
    assert_int_equal(be_matmul(levels[0], y, BE_Q8_0, x, q, BE_Q8_0, NULL, 1, 32, 1), BE_EINVAL);
    int32_t id = 0;
    assert_int_equal(be_embed(levels[0], y, q, BE_Q8_0, &id, 1, 32), BE_EINVAL);
}

/* test_q8 --quantize IN OUT: the float32 values of file IN (a multiple of
 * 32) quantized into file OUT as q8_0_quantize writes them, for
 * tests/q8_oracle.py to compare with its own quantizer byte for byte. */
static bool quantize_blocks(const float *x, void *y, size_t n)
{
    return q8_0_quantize(x, y, n);
}

int main(int argc, char **argv)
{
    rng_state = 0x243f6a8885a308d3u; /* the inputs the tolerances were set on */
    if (argc == 4 && strcmp(argv[1], "--quantize") == 0)
        return quantize_file(argv[2], argv[3], Q8_0_BLOCK, sizeof(struct q8_0_block), quantize_blocks);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_quantize_exact),
        cmocka_unit_test(test_quantize_bound),
        cmocka_unit_test(test_row_bytes),
        cmocka_unit_test(test_q8_matmul),
        cmocka_unit_test(test_q8_nan),
        cmocka_unit_test(test_q8_tiny),
        cmocka_unit_test(test_q8_bad_args),
    };
    return cmocka_run_group_tests(tests, setup_levels, teardown_levels);
}
