/* Description: Q4_K weights: the block layout (util/q4k.h) against its
 * definition, the quantizer's round-trip error bound, and be_matmul with
 * BE_Q4_K weights at every SIMD level the CPU supports (avx2's maddubs,
 * avx512vnni's vpdpbusd) against the scalar level (the reference) and
 * against a dense product in double over the dequantized weights, on
 * random shapes including one super-block, odd row counts (the 4-row
 * groups' tails) and the batch sizes around the panel threshold.
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
#include "util/q4k.h"

/* The test's own f16 decoding: the compiler's _Float16. */
static double f16_value(uint16_t h)
{
    _Float16 v;
    memcpy(&v, &h, 2);
    return (double)v;
}

/* Weights whose super-blocks span magnitudes (1e-3 .. 1e1), with a
 * sub-block of zeros, one of positives only (a min of 0), and outliers. */
static void fill_weights(float *w, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        size_t sb = i / Q4_K_BLOCK, sub = i / Q4_K_SUB;
        float scale = powf(10.0f, (float)(sb % 5) - 3.0f);
        w[i] = frand() * scale;
        if (sub % 13 == 5)
            w[i] = 0.0f;
        if (sub % 11 == 2)
            w[i] = fabsf(w[i]) + scale;
        if (sub % 7 == 3 && i % Q4_K_SUB == 9)
            w[i] = -8.0f * scale;
    }
}

/* ---- the layout --------------------------------------------------------------- */

/* Hand-packed scales and codes decode as the header's definition says. */
static void test_layout(void **state)
{
    (void)state;
    struct q4_k_block b;
    memset(&b, 0, sizeof b);
    b.d = 0x3c00;    /* 1.0 */
    b.dmin = 0x3800; /* 0.5 */
    int sc[8] = {1, 2, 63, 17, 33, 48, 5, 63}, m[8] = {0, 9, 40, 63, 62, 1, 31, 16};
    for (int j = 0; j < 4; j++) {
        b.scales[j] = (uint8_t)((sc[j] & 63) | (sc[j + 4] >> 4) << 6);
        b.scales[j + 4] = (uint8_t)((m[j] & 63) | (m[j + 4] >> 4) << 6);
        b.scales[j + 8] = (uint8_t)((sc[j + 4] & 15) | (m[j + 4] & 15) << 4);
    }
    for (int i = 0; i < 128; i++)
        b.qs[i] = (uint8_t)(i * 37 + 11);
    uint32_t u[4];
    q4_k_unpack(b.scales, u);
    for (int j = 0; j < 8; j++) {
        int s, mm;
        q4_k_scale_min(b.scales, j, &s, &mm);
        assert_int_equal(s, sc[j]);
        assert_int_equal(mm, m[j]);
        assert_int_equal((u[j / 4] >> (8 * (j % 4))) & 0xff, sc[j]);
        assert_int_equal((u[2 + j / 4] >> (8 * (j % 4))) & 0xff, m[j]);
    }
    float y[Q4_K_BLOCK];
    q4_k_dequantize(&b, y, Q4_K_BLOCK);
    for (int e = 0; e < Q4_K_BLOCK; e++) {
        int j = e / 32, l = e % 32;
        uint8_t byte = b.qs[32 * (j / 2) + l];
        int q = j % 2 ? byte >> 4 : byte & 15;
        assert_true(y[e] == (float)(1.0 * sc[j] * q - 0.5 * m[j]));
    }
    assert_int_equal(q4_k_row_bytes(512), 288);
    assert_int_equal(q4_k_row_bytes(96), 0);
    assert_int_equal(be_row_bytes(BE_Q4_K, 4096), 16 * 144);
    assert_int_equal(be_row_bytes(BE_Q4_K, 4000), 0);
    assert_int_equal(be_dtype_size(BE_Q4_K), 0);
    assert_string_equal(be_dtype_name(BE_Q4_K), "q4_k");
    assert_true(q4_k_check(&b, 1));
    b.dmin = 0x7c00; /* inf */
    assert_false(q4_k_check(&b, 1));
}

/* ---- the quantizer -------------------------------------------------------------- */

/* Every element within its sub-block's range [-dmin m, d sc 15 - dmin m]
 * decodes within half a step (d sc) of itself; one outside it by at most
 * its distance to the range plus that.  The weighted fit may give up the
 * extremes of a sub-block for a finer step (measured: 7 % of these
 * elements, by up to 1.6 steps when the scale rounds down to 6 bits),
 * never by more than 3 steps, and the whole error must be what 4 bits
 * give: RMS error under 10 % of the weights' RMS in each super-block
 * (uniform weights rounded to 16 levels give 6.7 %; a sub-block with an
 * outlier 8x its neighbours more: measured 4.1 % .. 9.3 % on these). */
static void test_quantize_bound(void **state)
{
    (void)state;
    enum { N = 40 * Q4_K_BLOCK };
    float *w = malloc(N * sizeof *w), *back = malloc(N * sizeof *back);
    struct q4_k_block *q = malloc(N / Q4_K_BLOCK * sizeof *q);
    assert_true(w && back && q);
    fill_weights(w, N);
    assert_true(q4_k_quantize(w, q, N));
    q4_k_dequantize(q, back, N);
    size_t outside = 0;
    for (size_t b = 0; b < N / Q4_K_BLOCK; b++) {
        double d = f16_value(q[b].d), dmin = f16_value(q[b].dmin), se = 0, sx = 0;
        assert_true(d >= 0 && dmin >= 0);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            q4_k_scale_min(q[b].scales, j, &sc, &m);
            double step = d * sc, lo = -dmin * m, hi = step * 15 + lo;
            for (int i = 0; i < Q4_K_SUB; i++) {
                size_t k = b * Q4_K_BLOCK + (size_t)j * Q4_K_SUB + (size_t)i;
                double x = w[k], e = fabs(x - back[k]);
                double dist = x < lo ? lo - x : x > hi ? x - hi : 0;
                outside += dist > 0;
                if (dist > step * 3)
                    fail_msg("block %zu sub %d element %d: w %g is %g outside [%g, %g]", b, j, i, x, dist, lo, hi);
                double bound = step / 2 * (1 + 1e-5) + dist + 1e-6 * (fabs(x) + fabs(lo));
                if (e > bound)
                    fail_msg("block %zu sub %d element %d: w %g back %g, bound %g", b, j, i, x, back[k], bound);
                se += e * e, sx += x * x;
            }
        }
        if (sx > 0 && sqrt(se / sx) > 0.1)
            fail_msg("block %zu: relative RMS error %g", b, sqrt(se / sx));
    }
    if (outside > N / 10)
        fail_msg("%zu of %d elements outside their sub-block's range", outside, N);
    /* all zeros: factors 0, every element decodes to 0 */
    memset(w, 0, Q4_K_BLOCK * sizeof *w);
    assert_true(q4_k_quantize(w, q, Q4_K_BLOCK));
    q4_k_dequantize(q, back, Q4_K_BLOCK);
    for (int i = 0; i < Q4_K_BLOCK; i++)
        assert_true(back[i] == 0.0f);
    /* a NaN or an infinity is refused, as are factors beyond f16 */
    w[77] = NAN;
    assert_false(q4_k_quantize(w, q, Q4_K_BLOCK));
    w[77] = INFINITY;
    assert_false(q4_k_quantize(w, q, Q4_K_BLOCK));
    w[77] = 1e30f;
    assert_false(q4_k_quantize(w, q, Q4_K_BLOCK));
    free(w);
    free(back);
    free(q);
}

/* ---- the matmul ------------------------------------------------------------------- */

static void run_level(be_backend *be, float *y, const float *x, const struct q4_k_block *q, int n, int in, int out,
                      const float *bias)
{
    size_t wbytes = (size_t)out * be_row_bytes(BE_Q4_K, (size_t)in);
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
    assert_int_equal(be_matmul(be, be_buffer_data(by), BE_F32, be_buffer_data(bx), be_buffer_data(bw), BE_Q4_K,
                               dbias, n, in, out),
                     BE_OK);
    assert_int_equal(be_copy(be, y, be_buffer_data(by), (size_t)n * out * sizeof(float), BE_D2H), BE_OK);
    be_buffer_free(bx);
    be_buffer_free(bw);
    be_buffer_free(by);
    be_buffer_free(bb);
}

/* The double product over the dequantized weights differs from the int8
 * kernels by at most sum over sub-blocks of sum|w| * d_x / 2 (each
 * activation moves by at most half its block's step d_x); every level
 * then differs from the scalar one by f32 summation order only. */
static void check_q4k_matmul(int n, int in, int out, bool with_bias)
{
    size_t nsb = (size_t)in / Q4_K_BLOCK;
    float *x = malloc((size_t)n * in * sizeof *x), *w = malloc((size_t)out * in * sizeof *w);
    float *wd = malloc((size_t)out * in * sizeof *wd), *bias = malloc((size_t)out * sizeof *bias);
    float *ref = malloc((size_t)n * out * sizeof *ref), *y = malloc((size_t)n * out * sizeof *y);
    struct q4_k_block *q = malloc((size_t)out * nsb * sizeof *q);
    double *bound = malloc((size_t)n * out * sizeof *bound), *exact = malloc((size_t)n * out * sizeof *exact);
    assert_true(x && w && wd && bias && ref && y && q && bound && exact);
    for (size_t i = 0; i < (size_t)n * in; i++)
        x[i] = frand() * (1.0f + (float)(i % 97) / 10.0f);
    fill_weights(w, (size_t)out * in);
    for (int r = 0; r < out; r++)
        bias[r] = frand();
    assert_true(q4_k_quantize(w, q, (size_t)out * in));
    q4_k_dequantize(q, wd, (size_t)out * in);
    for (int t = 0; t < n; t++)
        for (int r = 0; r < out; r++) {
            double acc = with_bias ? bias[r] : 0, act = 0, mag = 0;
            for (int b = 0; b < in / 32; b++) {
                double amax = 0, wsum = 0;
                for (int i = 0; i < 32; i++) {
                    size_t k = (size_t)b * 32 + (size_t)i;
                    double xv = x[(size_t)t * in + k], wv = wd[(size_t)r * in + k];
                    acc += xv * wv;
                    mag += fabs(xv * wv);
                    amax = fmax(amax, fabs(xv));
                    wsum += fabs(wv);
                }
                act += wsum * (amax / 127.0) / 2;
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

static void test_q4k_matmul(void **state)
{
    (void)state;
    static const int shapes[][3] = {
        {1, 256, 1}, {1, 256, 7}, {1, 768, 63}, {1, 2048, 33}, {2, 512, 17}, {3, 1280, 130},
        {5, 256, 48}, {31, 512, 21}, {32, 256, 19}, {40, 768, 70},
        {31, 28672, 5}, /* the activations of 29 tokens fill a thread's scratch: two runs */
        /* the int8 GEMM: its first batch, tiles of 6 tokens with tails, panels of 32 rows with tails */
        {16, 512, 45}, {17, 256, 33}, {23, 768, 70}, {64, 2048, 37},
    };
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
        check_q4k_matmul(shapes[s][0], shapes[s][1], shapes[s][2], s % 2 == 1);
    /* random shapes on top of the fixed ones */
    for (int s = 0; s < 6; s++) {
        int n = 1 + (int)((frand() + 1.0f) * 3.0f), in = 256 * (1 + (int)((frand() + 1.0f) * 2.0f));
        int out = 1 + (int)((frand() + 1.0f) * 40.0f);
        check_q4k_matmul(n, in, out, s % 2 == 0);
    }
}

/* A NaN in x shows in every output of the rows it reaches, at every level. */
static void test_q4k_nan(void **state)
{
    (void)state;
    enum { IN = 512, OUT = 9 };
    static float x[IN], w[OUT * IN], y[OUT];
    static struct q4_k_block q[OUT * IN / Q4_K_BLOCK];
    for (int i = 0; i < IN; i++)
        x[i] = frand();
    x[300] = NAN;
    fill_weights(w, OUT * IN);
    assert_true(q4_k_quantize(w, q, OUT * IN));
    for (int l = 0; l < N_LEVELS; l++) {
        if (!levels[l])
            continue;
        run_level(levels[l], y, x, q, 1, IN, OUT, NULL);
        for (int r = 0; r < OUT; r++)
            if (!isnan(y[r]))
                fail_msg("%s row %d: %g, not NaN", level_names[l], r, y[r]);
    }
}

static void test_q4k_bad_args(void **state)
{
    (void)state;
    static float x[512], y[4];
    static struct q4_k_block q[8];
    /* a row that is not whole super-blocks has no Q4_K layout */
    assert_int_equal(be_matmul(levels[0], y, BE_F32, x, q, BE_Q4_K, NULL, 1, 288, 2), BE_EINVAL);
    assert_int_equal(be_matmul(levels[0], y, BE_F32, x, q, BE_Q4_K, NULL, 1, 512, 4), BE_OK);
    assert_int_equal(be_matmul(levels[0], y, BE_Q4_K, x, q, BE_Q4_K, NULL, 1, 256, 1), BE_EINVAL);
    int32_t id = 0;
    assert_int_equal(be_embed(levels[0], y, q, BE_Q4_K, &id, 1, 256), BE_EINVAL);
}

/* test_q4k --quantize IN OUT: the float32 values of file IN (a multiple of
 * 256) quantized into file OUT as q4_k_quantize writes them, for
 * tests/ref_compare.py's reference of --weights q4_k to decode. */
static bool quantize_blocks(const float *x, void *y, size_t n)
{
    return q4_k_quantize(x, y, n);
}

int main(int argc, char **argv)
{
    rng_state = 0x13198a2e03707344u; /* the inputs the tolerances were set on */
    if (argc == 4 && strcmp(argv[1], "--quantize") == 0)
        return quantize_file(argv[2], argv[3], Q4_K_BLOCK, sizeof(struct q4_k_block), quantize_blocks);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout),
        cmocka_unit_test(test_quantize_bound),
        cmocka_unit_test(test_q4k_matmul),
        cmocka_unit_test(test_q4k_nan),
        cmocka_unit_test(test_q4k_bad_args),
    };
    return cmocka_run_group_tests(tests, setup_levels, teardown_levels);
}
