/* Description: conformance of the compute seam (backend/backend.h) and the
 * CPU backend.  Every kernel runs on random inputs at every SIMD level the
 * CPU supports and is compared with dense computations written here, in
 * double, independent of the kernel code, and with the scalar level (the
 * in-tree reference).  Also: the device budget, peak tracking, fault
 * injection, async copies and events, the missing CUDA plugin, free(NULL).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <hwloc.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#include "tests/levels.h"

/* ---- fixtures ----------------------------------------------------------- */


static void fill(float *x, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++)
        x[i] = frand() * scale;
}

/* Buffers of the test live in device memory of the backend under test
 * (the CPU backend's device addresses are host addresses). */
static void *dev(be_backend *be, size_t bytes, be_buffer **keep)
{
    assert_int_equal(be_dev_alloc(be, bytes, keep), BE_OK);
    return be_buffer_data(*keep);
}

/* The test's own 16-bit conversions: the compiler's _Float16 for f16, and
 * truncation for bf16 applied to values that are exact in bf16. */
static float f16_value(uint16_t h)
{
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static uint16_t f16_bits(float f)
{
    _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}

static uint16_t bf16_bits_trunc(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static uint16_t bf16_bits_rne(float f) /* finite f */
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float bf16_value(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Fills n elements of dt at dst with random values and returns them as
 * the exact f32 values the kernels must see. */
static void random_typed(void *dst, enum be_dtype dt, float *exact, size_t n, float scale)
{
    for (size_t i = 0; i < n; i++) {
        float f = frand() * scale;
        switch (dt) {
        case BE_F32: ((float *)dst)[i] = exact[i] = f; break;
        case BE_F16: ((uint16_t *)dst)[i] = f16_bits(f); exact[i] = f16_value(f16_bits(f)); break;
        case BE_BF16: ((uint16_t *)dst)[i] = bf16_bits_trunc(f); exact[i] = bf16_value(bf16_bits_trunc(f)); break;
        case BE_Q8_0: case BE_Q4_K: break; /* blocks, not elements: their tests fill their own */
        }
    }
}

/* |got - want| <= tol, with tol a bound on the rounding of a sum whose
 * terms have absolute values summing to mag. */
static void assert_close(const char *what, const char *level, size_t i, double got, double want, double mag)
{
    double tol = 2e-6 * mag + 1e-6;
    if (!(fabs(got - want) <= tol))
        fail_msg("%s [%s] at %zu: got %.9g want %.9g (tol %.3g)", what, level, i, got, want, tol);
}

/* ---- matmul ------------------------------------------------------------- */

/* y = x W^T (+ bias) in double, with x as given or rounded to bf16 */
static void dense_matmul(double *ref, double *mag, const float *x, const float *wf, const float *bias, int n,
                         int in, int out, bool round_x)
{
    for (int t = 0; t < n; t++)
        for (int r = 0; r < out; r++) {
            double acc = bias ? bias[r] : 0.0, m = fabs(acc);
            for (int i = 0; i < in; i++) {
                float xv = x[(size_t)t * in + i];
                double p = (double)(round_x ? bf16_value(bf16_bits_rne(xv)) : xv) * wf[(size_t)r * in + i];
                acc += p;
                m += fabs(p);
            }
            ref[(size_t)t * out + r] = acc;
            mag[(size_t)t * out + r] = m;
        }
}

/* The avx512bf16 level multiplies bf16 weights by x rounded to bf16: it
 * is compared with the dense product of the rounded x, and with the scalar level (unrounded x) within what
 * rounding x can move a sum, |x - bf16(x)| <= 2^-8 |x| per term. */
static void check_matmul(enum be_dtype wt, int n, int in, int out, bool with_bias)
{
    size_t nw = (size_t)in * out, ny = (size_t)n * out;
    void *w = malloc(nw * be_dtype_size(wt));
    float *wf = malloc(nw * sizeof(float)), *x = malloc((size_t)n * in * sizeof(float));
    float *bias = malloc((size_t)out * sizeof(float)), *y_scalar = malloc(ny * sizeof(float));
    double *ref = malloc(ny * sizeof(double)), *mag = malloc(ny * sizeof(double));
    double *ref_r = malloc(ny * sizeof(double)), *mag_r = malloc(ny * sizeof(double));
    assert_non_null(w && wf && x && bias && y_scalar && ref && mag && ref_r && mag_r);
    random_typed(w, wt, wf, nw, 0.5f);
    fill(x, (size_t)n * in, 2.0f);
    fill(bias, (size_t)out, 1.0f);
    const float *b = with_bias ? bias : NULL;
    dense_matmul(ref, mag, x, wf, b, n, in, out, false);
    bool rounding = wt == BE_BF16;
    if (rounding)
        dense_matmul(ref_r, mag_r, x, wf, b, n, in, out, true);
    for (int l = 0; l < N_LEVELS; l++) {
        if (!levels[l])
            continue;
        bool rounds = rounding && strcmp(level_names[l], "avx512bf16") == 0;
        be_buffer *yb;
        float *y = dev(levels[l], ny * sizeof(float), &yb);
        assert_int_equal(be_matmul(levels[l], y, BE_F32, x, w, wt, b, n, in, out), BE_OK);
        if (l == 0)
            memcpy(y_scalar, y, ny * sizeof(float));
        for (size_t i = 0; i < ny; i++) {
            if (rounds) {
                assert_close("matmul vs dense of bf16 x", level_names[l], i, y[i], ref_r[i], mag_r[i]);
                assert_close("matmul vs scalar", level_names[l], i, y[i], y_scalar[i], (1 + 0x1p-8 / 2e-6) * mag[i]);
            } else {
                assert_close("matmul vs dense", level_names[l], i, y[i], ref[i], mag[i]);
                assert_close("matmul vs scalar", level_names[l], i, y[i], y_scalar[i], mag[i]);
            }
        }
        be_buffer_free(yb);
    }
    free(w), free(wf), free(x), free(bias), free(y_scalar), free(ref), free(mag), free(ref_r), free(mag_r);
}

static void test_matmul(void **state)
{
    (void)state;
    static const int shapes[][3] = {
        {1, 16, 16}, {1, 37, 19}, {1, 256, 70}, {1, 1000, 33}, {2, 64, 17},
        {3, 100, 33}, {5, 129, 48}, {16, 96, 130}, {64, 160, 96}, {70, 33, 21},
        /* the batched kernels' edges: token tiles and row panels cut short,
         * an odd column count, columns past one packed block, rows split
         * between threads */
        {CPU_BF16_GEMM_MIN_TOKENS, 33, 17}, {CPU_BF16_GEMM_MIN_TOKENS + 13, 1000, 70}, {37, 2 * 1024 + 50, 40},
        {CPU_BF16_GEMM_MIN_TOKENS + 2 * CPU_BF16_MR, 64, 200}, {50, 1, 3}, {CPU_BF16_GEMM_MIN_TOKENS - 1, 67, 9},
    };
    for (int dt = BE_F32; dt <= BE_BF16; dt++)
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
            check_matmul((enum be_dtype)dt, shapes[s][0], shapes[s][1], shapes[s][2], s % 2 == 0);
            check_matmul((enum be_dtype)dt, shapes[s][0], shapes[s][1], shapes[s][2], s % 2 == 1);
        }
    /* every length of the last token tile, each its own kernel */
    for (int n = CPU_BF16_GEMM_MIN_TOKENS; n < CPU_BF16_GEMM_MIN_TOKENS + CPU_BF16_MR; n++)
        check_matmul(BE_BF16, n, 67, 35, n % 2 == 0);
}

/* Below the batched kernels' thresholds a token's outputs do not depend
 * on the tokens beside it: every level sums each token's products in the
 * same order whatever the batch, so n sequences decoded in one step give
 * bit for bit what each gives alone (the daemon's batching relies on it).
 * The shape cuts row blocks short and ends the columns mid-vector. */
static void test_matmul_batch_invariance(void **state)
{
    (void)state;
    enum { IN = 2 * 64 + 37, OUT = 130, N = CPU_BF16_GEMM_MIN_TOKENS - 1 };
    _Static_assert(N < CPU_GEMM_MIN_TOKENS, "every level streams W below both thresholds");
    for (int dt = BE_F32; dt <= BE_BF16; dt++) {
        void *w = malloc((size_t)IN * OUT * be_dtype_size((enum be_dtype)dt));
        float *wf = malloc((size_t)IN * OUT * sizeof(float)), *x = malloc((size_t)N * IN * sizeof(float));
        assert_non_null(w && wf && x);
        random_typed(w, (enum be_dtype)dt, wf, (size_t)IN * OUT, 0.5f);
        fill(x, (size_t)N * IN, 2.0f);
        for (int l = 0; l < N_LEVELS; l++) {
            if (!levels[l])
                continue;
            be_buffer *ab, *bb;
            float *alone = dev(levels[l], (size_t)N * OUT * sizeof(float), &ab);
            float *batch = dev(levels[l], (size_t)N * OUT * sizeof(float), &bb);
            for (int t = 0; t < N; t++)
                assert_int_equal(be_matmul(levels[l], alone + (size_t)t * OUT, BE_F32, x + (size_t)t * IN, w,
                                           (enum be_dtype)dt, NULL, 1, IN, OUT),
                                 BE_OK);
            for (int n = 2; n <= N; n++) {
                assert_int_equal(be_matmul(levels[l], batch, BE_F32, x, w, (enum be_dtype)dt, NULL, n, IN, OUT), BE_OK);
                for (size_t i = 0; i < (size_t)n * OUT; i++)
                    if (memcmp(&batch[i], &alone[i], sizeof(float)))
                        fail_msg("matmul of %d tokens, %s [%s], token %zu row %zu: %.9g, alone %.9g", n,
                                 be_dtype_name((enum be_dtype)dt), level_names[l], i / OUT, i % OUT, batch[i],
                                 alone[i]);
            }
            be_buffer_free(ab);
            be_buffer_free(bb);
        }
        free(w), free(wf), free(x);
    }
}

/* ---- rmsnorm, rope, element-wise ---------------------------------------- */

static void test_rmsnorm(void **state)
{
    (void)state;
    static const int shapes[][2] = {{1, 16}, {1, 2048}, {3, 37}, {7, 100}, {40, 1000}};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int n = shapes[s][0], dim = shapes[s][1];
        size_t len = (size_t)n * dim;
        float *x = malloc(len * sizeof(float)), *w = malloc((size_t)dim * sizeof(float));
        float *y = malloc(len * sizeof(float));
        assert_non_null(x && w && y);
        fill(x, len, 3.0f);
        fill(w, (size_t)dim, 1.5f);
        for (int l = 0; l < N_LEVELS; l++) {
            if (!levels[l])
                continue;
            for (int alias = 0; alias < 2; alias++) {
                if (alias) /* y = x in place */
                    memcpy(y, x, len * sizeof(float));
                assert_int_equal(be_rmsnorm(levels[l], y, alias ? y : x, w, n, dim, 1e-5f), BE_OK);
                for (int r = 0; r < n; r++) {
                    double ss = 0;
                    for (int i = 0; i < dim; i++)
                        ss += (double)x[(size_t)r * dim + i] * x[(size_t)r * dim + i];
                    double inv = 1.0 / sqrt(ss / dim + 1e-5);
                    for (int i = 0; i < dim; i++) {
                        size_t k = (size_t)r * dim + i;
                        double want = x[k] * inv * w[i];
                        assert_close("rmsnorm", level_names[l], k, y[k], want, 4 * fabs(want));
                    }
                }
            }
        }
        free(x), free(w), free(y);
    }
}

/* mscale: be_rope's factor on cos and sin (only the rotated dimensions scale). */
static void check_rope(enum be_rope_layout layout, int n_tok, int n_heads, int head_dim, int rot_dim, float mscale)
{
    size_t len = (size_t)n_tok * n_heads * head_dim;
    float *x = malloc(len * sizeof(float)), *y = malloc(len * sizeof(float));
    float *inv_freq = malloc((size_t)rot_dim / 2 * sizeof(float));
    int64_t *pos = malloc((size_t)n_tok * sizeof(int64_t));
    assert_non_null(x && y && inv_freq && pos);
    fill(x, len, 2.0f);
    for (int i = 0; i < rot_dim / 2; i++)
        inv_freq[i] = (float)pow(10000.0, -2.0 * i / rot_dim);
    for (int t = 0; t < n_tok; t++)
        pos[t] = (t * 37 + 5) % 4099;
    int half = rot_dim / 2;
    for (int l = 0; l < N_LEVELS; l++) {
        if (!levels[l])
            continue;
        memcpy(y, x, len * sizeof(float));
        assert_int_equal(be_rope(levels[l], y, n_tok, n_heads, head_dim, pos, inv_freq, rot_dim, mscale, layout), BE_OK);
        for (int t = 0; t < n_tok; t++)
            for (int h = 0; h < n_heads; h++) {
                const float *xi = x + ((size_t)t * n_heads + h) * head_dim;
                const float *yo = y + ((size_t)t * n_heads + h) * head_dim;
                for (int d = 0; d < head_dim; d++) {
                    double want = xi[d];
                    if (d < rot_dim) {
                        int i = layout == BE_ROPE_NEOX ? d % half : d / 2;
                        bool first = layout == BE_ROPE_NEOX ? d < half : d % 2 == 0;
                        int partner = layout == BE_ROPE_NEOX ? (first ? d + half : d - half) : (first ? d + 1 : d - 1);
                        double a = (double)(float)((float)pos[t] * inv_freq[i]);
                        want = first ? xi[d] * cos(a) - xi[partner] * sin(a) : xi[d] * cos(a) + xi[partner] * sin(a);
                        want *= mscale;
                    }
                    assert_close("rope", level_names[l], (size_t)d, yo[d], want, 4.0 * mscale);
                }
            }
    }
    free(x), free(y), free(inv_freq), free(pos);
}

static void test_rope(void **state)
{
    (void)state;
    for (int layout = 0; layout < 2; layout++) {
        check_rope((enum be_rope_layout)layout, 1, 4, 64, 64, 1.0f);
        check_rope((enum be_rope_layout)layout, 3, 5, 80, 80, 1.0f);
        check_rope((enum be_rope_layout)layout, 9, 2, 128, 32, 1.0f);
        check_rope((enum be_rope_layout)layout, 2, 3, 96, 70, 1.0f);
        check_rope((enum be_rope_layout)layout, 5, 2, 96, 72, 1.19f); /* longrope's factor, partial rotary */
    }
}

static void test_elementwise(void **state)
{
    (void)state;
    static const size_t sizes[] = {1, 15, 16, 17, 1000, 70001};
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        size_t n = sizes[s];
        float *g = malloc(n * sizeof(float)), *u = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
        assert_non_null(g && u && y);
        fill(g, n, 8.0f);
        fill(u, n, 2.0f);
        for (int l = 0; l < N_LEVELS; l++) {
            if (!levels[l])
                continue;
            assert_int_equal(be_silu_mul(levels[l], y, g, u, n), BE_OK);
            for (size_t i = 0; i < n; i++) {
                double want = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
                assert_close("silu_mul", level_names[l], i, y[i], want, 4 * fabs(want));
            }
            memcpy(y, u, n * sizeof(float));
            assert_int_equal(be_add(levels[l], y, g, n), BE_OK);
            for (size_t i = 0; i < n; i++)
                assert_true(y[i] == u[i] + g[i]);
        }
        free(g), free(u), free(y);
    }
}

/* ---- state-space scan ---------------------------------------------------- */

/* be_ssm_scan over three views (rows 0-2, 3-9, 10; the last with in ==
 * out) against the recurrence in double, at each level and against the
 * scalar level.  dt_raw spans +-30 so softplus meets its threshold (20)
 * and the inputs where 1 + exp(dt_raw) rounds to 1; the bound is
 * assert_close's over the magnitudes the state sums (exp(dt A) <= 1), tight
 * enough to see a relative change of 3e-4 in one coefficient of the vector
 * log. */
static void check_ssm_scan(int di, int N)
{
    enum { T = 11, V = 3 };
    static const int view_of[T] = {0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2};
    int K = 4;
    size_t nr = (size_t)T * di, nh = (size_t)di * N, win = (size_t)(K - 1) * di;
    size_t sb = be_ssm_state_bytes(di, N, K);
    assert_true(sb == (win + nh) * sizeof(float));
    float *x = malloc(nr * sizeof(float)), *dt = malloc(nr * sizeof(float)), *z = malloc(nr * sizeof(float));
    float *B = malloc((size_t)T * N * sizeof(float)), *C = malloc((size_t)T * N * sizeof(float));
    float *A = malloc(nh * sizeof(float)), *D = malloc((size_t)di * sizeof(float));
    float *conv_w = calloc((size_t)di * K, sizeof(float)); /* checked by the seam, not read by the scan */
    float *h0 = malloc(V * nh * sizeof(float)), *y_scalar = malloc(nr * sizeof(float));
    float *h_scalar = malloc(V * nh * sizeof(float));
    double *ref = malloc(nr * sizeof(double)), *mag = malloc(nr * sizeof(double));
    double *href = malloc(V * nh * sizeof(double)), *hmag = malloc(V * nh * sizeof(double));
    assert_non_null(x && dt && z && B && C && A && D && conv_w && h0 && y_scalar && h_scalar && ref && mag && href && hmag);
    fill(x, nr, 2.0f);
    fill(dt, nr, 30.0f);
    fill(z, nr, 8.0f);
    fill(B, (size_t)T * N, 1.0f);
    fill(C, (size_t)T * N, 1.0f);
    fill(D, (size_t)di, 1.0f);
    fill(h0, V * nh, 1.0f);
    for (size_t i = 0; i < nh; i++)
        A[i] = -expf(2.0f * frand()); /* -exp(A_log) */
    for (size_t i = 0; i < V * nh; i++)
        href[i] = h0[i], hmag[i] = fabs(h0[i]);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < di; i++) {
            size_t r = (size_t)t * di + i;
            double d = dt[r] > 20.0f ? dt[r] : log1p(exp((double)dt[r])), acc = 0, m = 0;
            double *h = href + (size_t)view_of[t] * nh + (size_t)i * N, *hm = hmag + (h - href);
            for (int s = 0; s < N; s++) {
                double u = d * B[t * N + s] * x[r];
                h[s] = exp(d * A[(size_t)i * N + s]) * h[s] + u;
                hm[s] += fabs(u);
                acc += C[t * N + s] * h[s];
                m += fabs(C[t * N + s]) * hm[s];
            }
            double g = z[r] / (1.0 + exp(-(double)z[r]));
            ref[r] = (acc + D[i] * (double)x[r]) * g;
            mag[r] = (m + fabs(D[i] * x[r])) * fabs(g);
        }
    struct be_ssm_params p = {.d_inner = di, .d_state = N, .d_conv = K, .conv_w = conv_w, .A = A, .D = D};
    struct be_tok toks[T];
    for (int t = 0; t < T; t++)
        toks[t] = (struct be_tok){.view = view_of[t], .pos = t};
    for (int l = 0; l < N_LEVELS; l++) {
        if (!levels[l])
            continue;
        be_buffer *yb, *sb_in, *sb_out;
        float *y = dev(levels[l], nr * sizeof(float), &yb);
        char *st_in = dev(levels[l], V * sb, &sb_in), *st_out = dev(levels[l], V * sb, &sb_out);
        struct be_ssm_view views[V];
        for (int v = 0; v < V; v++) {
            memcpy(st_in + v * sb + win * sizeof(float), h0 + v * nh, nh * sizeof(float));
            views[v] = (struct be_ssm_view){.in = st_in + v * sb, .out = v == V - 1 ? st_in + v * sb : st_out + v * sb};
        }
        assert_int_equal(be_ssm_scan(levels[l], y, x, dt, B, C, z, views, toks, T, &p), BE_OK);
        assert_int_equal(be_sync(levels[l]), BE_OK);
        for (size_t r = 0; r < nr; r++) {
            assert_close("ssm_scan y vs double", level_names[l], r, y[r], ref[r], mag[r]);
            if (l > 0)
                assert_close("ssm_scan y vs scalar", level_names[l], r, y[r], y_scalar[r], mag[r]);
        }
        for (int v = 0; v < V; v++) {
            const float *h = (const float *)((const char *)views[v].out + win * sizeof(float));
            for (size_t i = 0; i < nh; i++) {
                size_t k = (size_t)v * nh + i;
                assert_close("ssm_scan h vs double", level_names[l], k, h[i], href[k], hmag[k]);
                if (l > 0)
                    assert_close("ssm_scan h vs scalar", level_names[l], k, h[i], h_scalar[k], hmag[k]);
                else
                    h_scalar[k] = h[i];
            }
        }
        if (l == 0)
            memcpy(y_scalar, y, nr * sizeof(float));
        be_buffer_free(yb), be_buffer_free(sb_in), be_buffer_free(sb_out);
    }
    free(x), free(dt), free(z), free(B), free(C), free(A), free(D), free(conv_w), free(h0), free(y_scalar), free(h_scalar);
    free(ref), free(mag), free(href), free(hmag);
}

static void test_ssm_scan(void **state)
{
    (void)state;
    check_ssm_scan(1, 16);
    check_ssm_scan(40, 16);  /* a full vector of channels and a tail */
    check_ssm_scan(64, 8);   /* the tests' models' state size */
    check_ssm_scan(100, 5);  /* and one that fills no vector */
    check_ssm_scan(1536, 16); /* mamba-130m's channels: both threads */
}

static void test_gelu_scale(void **state)
{
    (void)state;
    static const size_t sizes[] = {1, 17, 1000, 70001};
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        size_t n = sizes[s];
        float *g = malloc(n * sizeof(float)), *u = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
        assert_non_null(g && u && y);
        fill(g, n, 6.0f);
        fill(u, n, 2.0f);
        for (int l = 0; l < N_LEVELS; l++) {
            if (!levels[l])
                continue;
            for (int gated = 0; gated < 2; gated++) {
                assert_int_equal(be_gelu_mul(levels[l], y, g, gated ? u : NULL, n), BE_OK);
                for (size_t i = 0; i < n; i++) {
                    double x = g[i];
                    double want = 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
                    want *= gated ? u[i] : 1.0;
                    assert_close("gelu_mul", level_names[l], i, y[i], want, 4 * fabs(want) + 1e-30);
                }
            }
            memcpy(y, g, n * sizeof(float));
            assert_int_equal(be_act(levels[l], y, n, BE_ACT_RELU), BE_OK);
            for (size_t i = 0; i < n; i++)
                assert_true(y[i] == (g[i] > 0.0f ? g[i] : 0.0f));
            memcpy(y, g, n * sizeof(float));
            assert_int_equal(be_act(levels[l], y, n, BE_ACT_GELU_ERF), BE_OK);
            for (size_t i = 0; i < n; i++) {
                double x = g[i], want = 0.5 * x * (1.0 + erf(x / sqrt(2.0)));
                assert_close("gelu_erf", level_names[l], i, y[i], want, 4 * fabs(want) + 1e-30);
            }
            memcpy(y, g, n * sizeof(float));
            assert_int_equal(be_scale(levels[l], y, n, 8.0f), BE_OK); /* a power of two: exact */
            for (size_t i = 0; i < n; i++)
                assert_true(y[i] == 8.0f * g[i]);
        }
        free(g), free(u), free(y);
    }
}

static void test_layernorm(void **state)
{
    (void)state;
    static const int shapes[][2] = {{1, 16}, {3, 37}, {40, 1000}};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int n = shapes[s][0], dim = shapes[s][1];
        size_t len = (size_t)n * dim;
        float *x = malloc(len * sizeof(float)), *w = malloc((size_t)dim * sizeof(float));
        float *b = malloc((size_t)dim * sizeof(float)), *y = malloc(len * sizeof(float));
        assert_non_null(x && w && b && y);
        fill(x, len, 3.0f);
        for (size_t i = 0; i < len; i++) /* an offset the mean must remove */
            x[i] += 5.0f;
        fill(w, (size_t)dim, 1.5f);
        fill(b, (size_t)dim, 0.5f);
        for (int l = 0; l < N_LEVELS; l++) {
            if (!levels[l])
                continue;
            assert_int_equal(be_layernorm(levels[l], y, x, w, b, n, dim, 1e-5f), BE_OK);
            for (int r = 0; r < n; r++) {
                double mean = 0, var = 0;
                for (int i = 0; i < dim; i++)
                    mean += x[(size_t)r * dim + i];
                mean /= dim;
                for (int i = 0; i < dim; i++)
                    var += (x[(size_t)r * dim + i] - mean) * (x[(size_t)r * dim + i] - mean);
                double inv = 1.0 / sqrt(var / dim + 1e-5);
                for (int i = 0; i < dim; i++) {
                    size_t k = (size_t)r * dim + i;
                    double term = (x[k] - mean) * inv * w[i], want = term + b[i];
                    /* an f32 mean of values around 5 is off by ulps of 5, whatever x - mean is */
                    assert_close("layernorm", level_names[l], k, y[k], want,
                                 16 * (fabs(x[k]) * inv * fabs(w[i]) + fabs(b[i])));
                }
            }
        }
        free(x), free(w), free(b), free(y);
    }
}

static void test_softmax_argmax(void **state)
{
    (void)state;
    static const int shapes[][2] = {{1, 1}, {1, 17}, {4, 32000}, {9, 33}};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        int rows = shapes[s][0], cols = shapes[s][1];
        size_t len = (size_t)rows * cols;
        float *x = malloc(len * sizeof(float)), *y = malloc(len * sizeof(float));
        int32_t *am = malloc((size_t)rows * sizeof(int32_t));
        assert_non_null(x && y && am);
        fill(x, len, 30.0f);
        if (cols > 3)
            x[cols - 1] = x[2] = 100.0f; /* a tie: the first index wins */
        for (int l = 0; l < N_LEVELS; l++) {
            if (!levels[l])
                continue;
            assert_int_equal(be_argmax(levels[l], x, rows, cols, am), BE_OK);
            memcpy(y, x, len * sizeof(float));
            assert_int_equal(be_softmax(levels[l], y, rows, cols), BE_OK);
            for (int r = 0; r < rows; r++) {
                const float *xr = x + (size_t)r * cols;
                double m = xr[0], sum = 0;
                int best = 0;
                for (int i = 1; i < cols; i++)
                    if (xr[i] > m)
                        m = xr[i], best = i;
                assert_int_equal(am[r], best);
                for (int i = 0; i < cols; i++)
                    sum += exp(xr[i] - m);
                for (int i = 0; i < cols; i++) {
                    double want = exp(xr[i] - m) / sum;
                    assert_close("softmax", level_names[l], (size_t)i, y[(size_t)r * cols + i], want, 8 * want);
                }
            }
        }
        free(x), free(y), free(am);
    }
}

static void test_embed(void **state)
{
    (void)state;
    enum { VOCAB = 50, DIM = 37, N = 6 };
    static const int32_t ids[N] = {0, 49, 3, 3, 17, 48};
    float exact[VOCAB * DIM], y[N * DIM];
    uint16_t table16[VOCAB * DIM];
    float table32[VOCAB * DIM];
    for (int dt = BE_F32; dt <= BE_BF16; dt++) {
        void *table = dt == BE_F32 ? (void *)table32 : (void *)table16;
        random_typed(table, (enum be_dtype)dt, exact, VOCAB * DIM, 4.0f);
        for (int l = 0; l < N_LEVELS; l++) {
            if (!levels[l])
                continue;
            assert_int_equal(be_embed(levels[l], y, table, (enum be_dtype)dt, ids, N, DIM), BE_OK);
            for (int t = 0; t < N; t++)
                assert_memory_equal(y + t * DIM, exact + ids[t] * DIM, DIM * sizeof(float));
        }
    }
}

/* ---- paged KV: store and attention --------------------------------------- */

struct kv_case {
    int n_heads, n_kv_heads, head_dim, block_tokens, window;
    enum be_dtype dt;
    int64_t base, lo, hi; /* one sequence's view; queries are its last n_q positions */
    int n_q;
};

/* Runs kv_store of positions [lo, hi) and attention for the last n_q
 * positions of two sequences (the second one shorter) at every level;
 * checks the stored bytes are identical across levels and the output
 * against a dense softmax(q k^T) v in double over the visible keys. */
/* softcap: be_attn_params.softcap (0: none).  rel_span > 0: an encoder's
 * attention (bidirectional, T5's relative bias of that span, random). */
static void check_attention_ed(const struct kv_case *c, float softcap, int rel_span)
{
    const int n_views = 2;
    int hd = c->head_dim, kvd = c->n_kv_heads * hd, qd = c->n_heads * hd;
    size_t esz = be_dtype_size(c->dt);
    int n_blocks = (int)((c->hi - c->base + c->block_tokens - 1) / c->block_tokens);
    size_t half_block = (size_t)c->n_kv_heads * c->block_tokens * hd * esz;
    int64_t hi[2] = {c->hi, c->hi - 3 > c->lo ? c->hi - 3 : c->hi};
    int n_store = (int)((hi[0] - c->lo) + (hi[1] - c->lo));
    int n_tok = 2 * c->n_q;

    float *k = malloc((size_t)n_store * kvd * sizeof(float)), *v = malloc((size_t)n_store * kvd * sizeof(float));
    float *q = malloc((size_t)n_tok * qd * sizeof(float)), *out0 = malloc((size_t)n_tok * qd * sizeof(float));
    struct be_tok *st = malloc((size_t)n_store * sizeof(*st)), *qt = malloc((size_t)n_tok * sizeof(*qt));
    void *kbits = malloc(esz), *blocks0 = malloc((size_t)n_views * n_blocks * 2 * half_block);
    int bias_w = 2 * rel_span + 1;
    float *bias = malloc((size_t)c->n_heads * (size_t)bias_w * sizeof(float));
    assert_non_null(k && v && q && out0 && st && qt && kbits && blocks0 && bias);
    fill(bias, (size_t)c->n_heads * (size_t)bias_w, 2.0f);
    /* keys and values exact in the storage dtype, so storing loses nothing */
    for (size_t i = 0; i < (size_t)n_store * kvd; i++) {
        random_typed(kbits, c->dt, &k[i], 1, 1.0f);
        random_typed(kbits, c->dt, &v[i], 1, 1.0f);
    }
    fill(q, (size_t)n_tok * qd, 1.0f);
    int s = 0;
    for (int vi = 0; vi < n_views; vi++)
        for (int64_t p = c->lo; p < hi[vi]; p++)
            st[s++] = (struct be_tok){.view = vi, .pos = p};
    for (int t = 0; t < n_tok; t++)
        qt[t] = (struct be_tok){.view = t / c->n_q, .pos = hi[t / c->n_q] - c->n_q + t % c->n_q};

    for (int l = 0; l < N_LEVELS; l++) {
        be_backend *be = levels[l];
        if (!be)
            continue;
        be_buffer *bufs[2 * 64], *ob;
        void *blocks[2][64];
        assert_true(n_blocks <= 64);
        struct be_kv_view views[2];
        for (int vi = 0; vi < n_views; vi++) {
            for (int b = 0; b < n_blocks; b++) {
                blocks[vi][b] = dev(be, 2 * half_block, &bufs[vi * n_blocks + b]);
                /* NaN everywhere: a read outside [lo, hi) poisons the output */
                memset(blocks[vi][b], 0xff, 2 * half_block);
            }
            views[vi] = (struct be_kv_view){.blocks = blocks[vi], .n_blocks = n_blocks,
                                            .block_tokens = c->block_tokens, .v_offset = half_block,
                                            .base = c->base, .lo = c->lo, .hi = hi[vi]};
        }
        be_buffer *bias_buf = NULL;
        float *dbias = rel_span ? dev(be, (size_t)c->n_heads * (size_t)bias_w * sizeof(float), &bias_buf) : NULL;
        if (dbias)
            memcpy(dbias, bias, (size_t)c->n_heads * (size_t)bias_w * sizeof(float));
        struct be_attn_params p = {.n_heads = c->n_heads, .n_kv_heads = c->n_kv_heads, .head_dim = hd,
                                   .scale = 1.0f / sqrtf((float)hd), .window = c->window, .kv_dtype = c->dt,
                                   .softcap = softcap, .bidirectional = rel_span > 0, .rel_bias = dbias,
                                   .rel_span = rel_span};
        assert_int_equal(be_kv_store(be, views, st, n_store, k, v, &p), BE_OK);
        for (int vi = 0; vi < n_views; vi++)
            for (int b = 0; b < n_blocks; b++) {
                if (l == 0)
                    memcpy((char *)blocks0 + (size_t)(vi * n_blocks + b) * 2 * half_block, blocks[vi][b],
                           2 * half_block);
                else
                    assert_memory_equal((char *)blocks0 + (size_t)(vi * n_blocks + b) * 2 * half_block,
                                        blocks[vi][b], 2 * half_block);
            }
        float *out = dev(be, (size_t)n_tok * qd * sizeof(float), &ob);
        assert_int_equal(be_attention(be, out, q, views, qt, n_tok, &p), BE_OK);
        if (l == 0)
            memcpy(out0, out, (size_t)n_tok * qd * sizeof(float));
        /* the bf16 dot products round the query and the softmax weights
         * of a bf16 cache to bf16 */
        bool rounds = c->dt == BE_BF16 && strcmp(level_names[l], "avx512bf16") == 0;

        for (int t = 0; t < n_tok; t++) {
            int vi = qt[t].view;
            int64_t qp = qt[t].pos;
            int first_store = vi == 0 ? 0 : (int)(hi[0] - c->lo);
            for (int h = 0; h < c->n_heads; h++) {
                int kvh = h / (c->n_heads / c->n_kv_heads);
                float qh[256];
                double m = -INFINITY, sum = 0, acc[256] = {0}, mag[256] = {0}, qkmag = 0;
                assert_true(hd <= 256);
                for (int d = 0; d < hd; d++) {
                    float x = q[(size_t)t * qd + (size_t)h * hd + (size_t)d];
                    qh[d] = rounds ? bf16_value(bf16_bits_rne(x)) : x;
                }
                for (int pass = 0; pass < 2; pass++)
                    for (int64_t kp = c->lo; kp < (rel_span ? hi[vi] : qp + 1); kp++) {
                        if (c->window && qp - kp >= c->window)
                            continue;
                        size_t row = (size_t)(first_store + (kp - c->lo)) * kvd + (size_t)kvh * hd;
                        double sc = 0, sm = 0;
                        for (int d = 0; d < hd; d++) {
                            sc += (double)qh[d] * k[row + d];
                            sm += fabs((double)qh[d] * k[row + d]);
                        }
                        sc *= 1.0 / sqrt((double)hd);
                        sm *= 1.0 / sqrt((double)hd);
                        qkmag = sm > qkmag ? sm : qkmag;
                        if (softcap > 0)
                            sc = softcap * tanh(sc / softcap);
                        if (rel_span) {
                            int64_t d = kp - qp < -rel_span ? -rel_span : kp - qp > rel_span ? rel_span : kp - qp;
                            sc += bias[(size_t)h * (size_t)bias_w + (size_t)(d + rel_span)];
                        }
                        if (pass == 0) {
                            m = sc > m ? sc : m;
                            continue;
                        }
                        double e = exp(sc - m);
                        sum += e;
                        for (int d = 0; d < hd; d++) {
                            acc[d] += e * v[row + d];
                            mag[d] += e * fabs(v[row + d]);
                        }
                    }
                const float *o = out + (size_t)t * qd + (size_t)h * hd;
                const float *o0 = out0 + (size_t)t * qd + (size_t)h * hd;
                for (int d = 0; d < hd; d++) {
                    /* scores carry an error of ~hd ulps each, which the
                     * softmax turns into a relative error of the weights */
                    double tolmag = 8.0 * hd * mag[d] / sum + 1.0;
                    if (rounds) {
                        /* each weight within 2^-8 of itself; against the
                         * scalar level's unrounded query, each score also
                         * within 2^-8 of its products' magnitude */
                        double w = 0x1p-8 / 2e-6 * mag[d] / sum;
                        assert_close("attention vs dense of bf16 q, p", level_names[l], (size_t)d, o[d], acc[d] / sum,
                                     tolmag + w);
                        assert_close("attention vs scalar", level_names[l], (size_t)d, o[d], o0[d],
                                     tolmag + w * (1 + 4 * qkmag));
                        continue;
                    }
                    assert_close("attention vs dense", level_names[l], (size_t)d, o[d], acc[d] / sum, tolmag);
                    assert_close("attention vs scalar", level_names[l], (size_t)d, o[d], o0[d], tolmag);
                }
            }
        }
        be_buffer_free(ob);
        be_buffer_free(bias_buf);
        for (int b = 0; b < n_views * n_blocks; b++)
            be_buffer_free(bufs[b]);
    }
    free(k), free(v), free(q), free(out0), free(st), free(qt), free(kbits), free(blocks0), free(bias);
}

static void check_attention(const struct kv_case *c, float softcap)
{
    check_attention_ed(c, softcap, 0);
}

static void test_attention(void **state)
{
    (void)state;
    static const struct kv_case cases[] = {
        /* heads, kv heads, head_dim, block, window, dtype, base, lo, hi, n_q */
        {4, 4, 64, 16, 0, BE_F32, 0, 0, 40, 1},       /* GQA 1, decode */
        {8, 2, 64, 16, 0, BE_F32, 0, 0, 50, 7},       /* GQA 4, prefill tail, partial block */
        {16, 2, 40, 8, 0, BE_F32, 0, 5, 37, 3},       /* GQA 8, odd head_dim, lo > base */
        {8, 1, 80, 32, 13, BE_F32, 32, 40, 130, 20},  /* window < sequence, base > 0 */
        {4, 2, 64, 16, 0, BE_F16, 0, 0, 70, 5},
        {4, 2, 64, 16, 9, BE_BF16, 16, 20, 90, 4},
        {2, 2, 33, 5, 0, BE_F16, 0, 3, 23, 2},        /* tiny odd blocks */
        {4, 4, 64, 16, 0, BE_F32, 0, 0, 200, 1},      /* several softmax chunks */
        {4, 2, 64, 64, 0, BE_BF16, 0, 0, 2600, 1},    /* 3 pieces each, spread over the threads */
        {9, 3, 64, 64, 0, BE_BF16, 0, 0, 2600, 3},    /* GQA 3 (smollm), enough pairs for every thread */
        {4, 1, 64, 64, 1500, BE_F16, 0, 0, 3000, 2},  /* a window of 2 pieces */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        check_attention(&cases[i], 0.0f);
    /* Gemma 2's soft cap, below the scores' spread so it bends them */
    check_attention(&cases[1], 1.5f);
    check_attention(&cases[5], 1.5f);
    check_attention(&cases[8], 0.5f);
    /* encoder-decoder: every key of the view, T5's bias clamped past its
     * span (queries 6 and more positions from the ends reach both clamps) */
    check_attention_ed(&cases[1], 0.0f, 4);
    check_attention_ed(&cases[2], 0.0f, 1);
    check_attention_ed(&cases[8], 0.0f, 128);
}

/* A token's attention is the same to the bit alone (a decode step, its
 * pieces spread over the threads), in a batch of a sequence's tokens (which
 * share tiles), and on one thread or three: keys are cut into pieces and
 * chunks at fixed positions, whatever the tile, batch or thread count.
 * Checked for causal attention, a sliding window with a soft cap, and an
 * encoder's bidirectional attention with T5's bias; the batch is a run of
 * consecutive positions (a prompt) and positions far apart. */
static void test_attention_invariance(void **state)
{
    (void)state;
    enum { H = 6, KVH = 2, HD = 64, T = 64, N = 2500, NB = (N + T - 1) / T, BATCH = 90, SPAN = 8 };
    size_t half = (size_t)KVH * T * HD * sizeof(uint16_t), qd = (size_t)H * HD;
    float *k = malloc((size_t)N * KVH * HD * sizeof(float)), *v = malloc((size_t)N * KVH * HD * sizeof(float));
    float *q = malloc((size_t)BATCH * qd * sizeof(float)), *ref = malloc((size_t)BATCH * qd * sizeof(float));
    float bias[H * (2 * SPAN + 1)];
    struct be_tok *st = malloc(N * sizeof(*st)), qt[BATCH];
    assert_non_null(k && v && q && ref && st);
    fill(k, (size_t)N * KVH * HD, 1.0f);
    fill(v, (size_t)N * KVH * HD, 1.0f);
    fill(q, (size_t)BATCH * qd, 1.0f);
    fill(bias, sizeof(bias) / sizeof(bias[0]), 2.0f);
    for (int t = 0; t < N; t++)
        st[t] = (struct be_tok){.view = 0, .pos = t};
    for (int t = 0; t < BATCH; t++) /* a prompt's last 70 positions, then earlier ones far apart */
        qt[t] = (struct be_tok){.view = 0, .pos = t < 70 ? N - 70 + t : N - 1 - 113 * (t - 69)};
    for (int mode = 0; mode < 3; mode++) {
        struct be_attn_params p = {.n_heads = H, .n_kv_heads = KVH, .head_dim = HD, .scale = 0.125f,
                                   .kv_dtype = BE_BF16, .window = mode == 1 ? 700 : 0,
                                   .softcap = mode == 1 ? 1.5f : 0.0f, .bidirectional = mode == 2,
                                   .rel_span = mode == 2 ? SPAN : 0};
        /* alone on 2 threads (the reference), then the batch on 1 and 3 */
        const int threads[3] = {2, 1, 3};
        for (int run = 0; run < 3; run++) {
            be_backend *be;
            assert_int_equal(be_open("cpu", &(struct be_params){.n_threads = threads[run]}, &be), BE_OK);
            be_buffer *bufs[NB], *ob, *bb;
            void *blocks[NB];
            for (int b = 0; b < NB; b++)
                blocks[b] = dev(be, 2 * half, &bufs[b]);
            float *db = dev(be, sizeof(bias), &bb);
            memcpy(db, bias, sizeof(bias));
            p.rel_bias = mode == 2 ? db : NULL;
            struct be_kv_view view = {.blocks = blocks, .n_blocks = NB, .block_tokens = T, .v_offset = half, .hi = N};
            assert_int_equal(be_kv_store(be, &view, st, N, k, v, &p), BE_OK);
            float *o = dev(be, (size_t)BATCH * qd * sizeof(float), &ob);
            if (run == 0) {
                for (int t = 0; t < BATCH; t++)
                    assert_int_equal(be_attention(be, o + t * qd, q + t * qd, &view, &qt[t], 1, &p), BE_OK);
                memcpy(ref, o, (size_t)BATCH * qd * sizeof(float));
            } else {
                assert_int_equal(be_attention(be, o, q, &view, qt, BATCH, &p), BE_OK);
                for (int t = 0; t < BATCH; t++)
                    if (memcmp(ref + t * qd, o + t * qd, qd * sizeof(float)))
                        fail_msg("mode %d, %d threads: token %d (position %lld) differs from its attention alone",
                                 mode, threads[run], t, (long long)qt[t].pos);
            }
            be_buffer_free(ob);
            be_buffer_free(bb);
            for (int b = 0; b < NB; b++)
                be_buffer_free(bufs[b]);
            be_free(be);
        }
    }
    free(k), free(v), free(q), free(ref), free(st);
}

/* Keys whose scores are -inf weigh nothing, even when a whole piece of
 * them comes first: that piece's state stays empty and the merge takes
 * the later pieces as they are (it gave NaN before). */
static void test_attention_inf_piece(void **state)
{
    (void)state;
    enum { HD = 16, T = 64, N = 2600, NB = (N + T - 1) / T, DEAD = 1500 };
    size_t half = (size_t)T * HD * sizeof(float);
    float *k = malloc((size_t)N * HD * sizeof(float)), *v = malloc((size_t)N * HD * sizeof(float));
    float q[HD], out[HD];
    struct be_tok *st = malloc(N * sizeof(*st));
    assert_true(k && v && st);
    fill(v, (size_t)N * HD, 1.0f);
    fill(k, (size_t)N * HD, 1.0f);
    for (int t = 0; t < N; t++) {
        st[t] = (struct be_tok){.view = 0, .pos = t};
        for (int d = 0; d < HD && t < DEAD; d++) /* q > 0: q.k = -inf for the first DEAD keys */
            k[(size_t)t * HD + d] = -INFINITY;
    }
    for (int d = 0; d < HD; d++)
        q[d] = 0.5f + 0.03f * (float)d;
    struct be_attn_params p = {.n_heads = 1, .n_kv_heads = 1, .head_dim = HD, .scale = 0.25f, .kv_dtype = BE_F32};
    for (int l = 0; l < N_LEVELS; l++) {
        be_backend *be = levels[l];
        if (!be)
            continue;
        be_buffer *bufs[NB];
        void *blocks[NB];
        for (int b = 0; b < NB; b++)
            blocks[b] = dev(be, 2 * half, &bufs[b]);
        struct be_kv_view view = {.blocks = blocks, .n_blocks = NB, .block_tokens = T, .v_offset = half, .hi = N};
        assert_int_equal(be_kv_store(be, &view, st, N, k, v, &p), BE_OK);
        struct be_tok qt = {.view = 0, .pos = N - 1};
        assert_int_equal(be_attention(be, out, q, &view, &qt, 1, &p), BE_OK);
        /* reference: softmax over the live keys only */
        static double sc[N];
        double m = -INFINITY, sum = 0.0, o[HD] = {0};
        for (int t = DEAD; t < N; t++) {
            sc[t] = 0.0;
            for (int d = 0; d < HD; d++)
                sc[t] += (double)q[d] * k[(size_t)t * HD + d];
            sc[t] *= p.scale;
            m = sc[t] > m ? sc[t] : m;
        }
        for (int t = DEAD; t < N; t++) {
            double e = exp(sc[t] - m);
            sum += e;
            for (int d = 0; d < HD; d++)
                o[d] += e * v[(size_t)t * HD + d];
        }
        for (int d = 0; d < HD; d++)
            assert_close("attention after a -inf piece", level_names[l], (size_t)d, out[d], o[d] / sum, 8.0 * HD);
        for (int b = 0; b < NB; b++)
            be_buffer_free(bufs[b]);
    }
    free(k), free(v), free(st);
}

/* ---- memory, faults, copies --------------------------------------------- */

static void test_device_budget(void **state)
{
    (void)state;
    be_backend *be = open_level("scalar", 1 << 20);
    be_buffer *a, *b, *c;
    assert_int_equal(be_dev_alloc(be, 600000, &a), BE_OK);
    assert_int_equal(be_dev_alloc(be, 600000, &b), BE_ENOMEM_DEV);
    assert_null(b);
    struct be_mem_stats s = be_mem_stats(be);
    assert_int_equal(s.dev_budget, 1 << 20);
    assert_true(s.dev_used >= 600000 && s.dev_used < 600064 + 64);
    assert_int_equal(s.dev_allocs, 2);
    assert_int_equal(s.dev_failures, 1);
    be_buffer_free(a);
    assert_int_equal(be_mem_stats(be).dev_used, 0);
    assert_int_equal(be_dev_alloc(be, 1 << 20, &b), BE_OK); /* the whole budget, once restored */
    assert_int_equal(be_buffer_size(b), 1 << 20);
    assert_int_equal(be_dev_alloc(be, 1, &c), BE_ENOMEM_DEV);
    be_buffer_free(b);
    s = be_mem_stats(be);
    assert_int_equal(s.dev_peak, 1 << 20);
    be_reset_peak(be);
    assert_int_equal(be_mem_stats(be).dev_peak, 0);
    assert_int_equal(be_dev_alloc(be, 1000, &a), BE_OK);
    assert_int_equal(be_mem_stats(be).dev_peak, 1024);
    assert_int_equal(((uintptr_t)be_buffer_data(a)) % 64, 0);
    assert_int_equal(be_host_alloc(be, 5000, &b), BE_OK); /* host memory is outside the device budget */
    s = be_mem_stats(be);
    assert_int_equal(s.dev_used, 1024);
    assert_true(s.host_used >= 5000 && s.host_peak >= 5000);
    be_buffer_free(b);
    be_buffer_free(a);
    assert_int_equal(be_dev_alloc(be, 0, &a), BE_EINVAL);
    assert_int_equal(be_dev_alloc(be, SIZE_MAX, &a), BE_EINVAL);
    be_free(be);
}

static void test_fault_injection(void **state)
{
    (void)state;
    be_backend *be = open_level("scalar", 1 << 20);
    be_buffer *b[4];
    be_fault_dev_alloc(be, 2, false);
    assert_int_equal(be_dev_alloc(be, 64, &b[0]), BE_OK);
    assert_int_equal(be_dev_alloc(be, 64, &b[1]), BE_ENOMEM_DEV);
    assert_int_equal(be_dev_alloc(be, 64, &b[2]), BE_OK);
    assert_int_equal(be_mem_stats(be).dev_failures, 1);
    assert_int_equal(be_mem_stats(be).dev_used, 128);
    be_fault_dev_alloc(be, 1, true);
    assert_int_equal(be_dev_alloc(be, 64, &b[1]), BE_ENOMEM_DEV);
    assert_int_equal(be_dev_alloc(be, 64, &b[1]), BE_ENOMEM_DEV);
    assert_int_equal(be_dev_alloc(be, 64, &b[1]), BE_ENOMEM_DEV);
    be_fault_dev_alloc(be, 0, false);
    assert_int_equal(be_dev_alloc(be, 64, &b[1]), BE_OK);
    assert_int_equal(be_host_alloc(be, 64, &b[3]), BE_OK); /* host allocations are not device ordinals */
    struct be_mem_stats s = be_mem_stats(be);
    assert_int_equal(s.dev_failures, 4);
    assert_int_equal(s.dev_allocs, 7);
    assert_int_equal(s.dev_used, 192);
    for (int i = 0; i < 4; i++)
        be_buffer_free(b[i]);
    be_free(be);
}

/* Host-tier buffers are bound to the NUMA nodes near the CPUs the process
 * runs on, whatever the first touch would have chosen. */
static void test_host_numa_binding(void **state)
{
    (void)state;
    be_backend *be;
    assert_int_equal(be_open("cpu", &(struct be_params){.n_threads = 1}, &be), BE_OK);
    be_buffer *buf;
    assert_int_equal(be_host_alloc(be, 1 << 20, &buf), BE_OK);
    hwloc_topology_t topo;
    hwloc_bitmap_t cpus = hwloc_bitmap_alloc(), near = hwloc_bitmap_alloc(), got = hwloc_bitmap_alloc();
    assert_int_equal(hwloc_topology_init(&topo), 0);
    assert_int_equal(hwloc_topology_load(topo), 0);
    assert_int_equal(hwloc_get_cpubind(topo, cpus, HWLOC_CPUBIND_PROCESS), 0);
    hwloc_cpuset_to_nodeset(topo, cpus, near);
    hwloc_membind_policy_t policy;
    assert_int_equal(hwloc_get_area_membind(topo, be_buffer_data(buf), 1 << 20, got, &policy, HWLOC_MEMBIND_BYNODESET),
                     0);
    assert_int_equal(policy, HWLOC_MEMBIND_BIND);
    assert_true(hwloc_bitmap_isequal(got, near));
    hwloc_bitmap_free(cpus);
    hwloc_bitmap_free(near);
    hwloc_bitmap_free(got);
    hwloc_topology_destroy(topo);
    be_buffer_free(buf);
    be_free(be);
}

static void test_copies_events(void **state)
{
    (void)state;
    be_backend *be = levels[0];
    enum { N = 1 << 20, CHUNKS = 64 };
    be_buffer *hb, *db, *db2, *hb2;
    assert_int_equal(be_host_alloc(be, N, &hb), BE_OK);
    assert_int_equal(be_host_alloc(be, N, &hb2), BE_OK);
    assert_int_equal(be_dev_alloc(be, N, &db), BE_OK);
    assert_int_equal(be_dev_alloc(be, N, &db2), BE_OK);
    unsigned char *h = be_buffer_data(hb), *h2 = be_buffer_data(hb2), *d = be_buffer_data(db);
    unsigned char *d2 = be_buffer_data(db2);
    be_event *ev, *never;
    assert_int_equal(be_event_create(be, &ev), BE_OK);
    assert_int_equal(be_event_create(be, &never), BE_OK);
    assert_int_equal(be_event_sync(never), BE_OK); /* never recorded: already complete */
    double stall = -1, again = -1;
    assert_int_equal(be_event_stall(ev, &stall), BE_OK); /* never waited on: no stall */
    assert_true(stall == 0);
    for (int round = 0; round < 3; round++) {
        for (size_t i = 0; i < N; i++)
            h[i] = (unsigned char)(i * 7 + round);
        memset(h2, 0, N);
        /* chained in stream order: H2D in chunks, then D2D, then D2H */
        for (int c = 0; c < CHUNKS; c++)
            assert_int_equal(be_copy_async(be, d + c * (N / CHUNKS), h + c * (N / CHUNKS), N / CHUNKS, BE_H2D),
                             BE_OK);
        assert_int_equal(be_copy_async(be, d2, d, N, BE_D2D), BE_OK);
        assert_int_equal(be_event_record(be, ev), BE_OK);
        assert_int_equal(be_copy_async(be, h2, d2, N, BE_D2H), BE_OK);
        assert_int_equal(be_event_wait(be, ev), BE_OK);
        assert_memory_equal(d2, h, N);
        assert_int_equal(be_sync(be), BE_OK);
        assert_memory_equal(h2, h, N);
        /* the wait's time, once: read, it starts over */
        assert_int_equal(be_event_stall(ev, &stall), BE_OK);
        assert_int_equal(be_event_stall(ev, &again), BE_OK);
        assert_true(stall >= 0 && stall < 60 && again == 0);
    }
    /* more copies than the ring holds, all to one place: the last wins */
    for (int i = 0; i < 3000; i++) {
        h[i] = (unsigned char)i;
        assert_int_equal(be_copy_async(be, d, h + i, 1, BE_H2D), BE_OK);
    }
    assert_int_equal(be_event_record(be, ev), BE_OK);
    assert_int_equal(be_event_sync(ev), BE_OK);
    assert_int_equal(d[0], (unsigned char)2999);
    assert_int_equal(be_copy(be, d, h + 5, 1, BE_H2D), BE_OK);
    assert_int_equal(d[0], 5);
    assert_int_equal(be_copy_async(be, d, d + 2, 2, BE_D2D), BE_OK);
    assert_int_equal(be_copy_async(be, d, d + 1, 0, BE_D2D), BE_OK);
    assert_int_equal(be_copy_async(be, d, d + 1, 4, (enum be_copy_dir)9), BE_EINVAL);
    assert_int_equal(be_copy(be, d, d + 1, 2, BE_D2D), BE_EINVAL); /* overlap */
    assert_int_equal(be_sync(be), BE_OK);
    be_event_free(ev);
    be_event_free(never);
    be_buffer_free(hb);
    be_buffer_free(hb2);
    be_buffer_free(db);
    be_buffer_free(db2);
    assert_int_equal(be_mem_stats(be).host_used, 0);
}

static void test_open_and_nulls(void **state)
{
    (void)state;
    be_backend *be = (be_backend *)1;
    setenv("KVTIER_CUDA_PLUGIN", "/nonexistent/libkvtier-cuda.so", 1);
    assert_int_equal(be_open("cuda", NULL, &be), BE_ENODEV);
    assert_null(be);
    unsetenv("KVTIER_CUDA_PLUGIN");
    assert_int_equal(be_open("tpu", NULL, &be), BE_ENODEV);
    assert_int_equal(be_open(NULL, NULL, &be), BE_EINVAL);
    setenv("KVTIER_SIMD", "mmx", 1);
    assert_int_equal(be_open("cpu", NULL, &be), BE_ENOTSUP);
    unsetenv("KVTIER_SIMD");
    struct be_params bad = {.n_threads = -1};
    assert_int_equal(be_open("cpu", &bad, &be), BE_EINVAL);

    assert_int_equal(be_open("cpu", NULL, &be), BE_OK);
    struct be_caps caps = be_get_caps(be);
    bool strict = getenv("KVTIER_BACKEND_STRICT") != NULL; /* tests/run.sh's second pass */
    assert_string_equal(caps.name, strict ? "cpu-strict" : "cpu");
    assert_true(caps.n_threads >= 1 && caps.unified_memory == !strict && caps.async_copy == !strict);
    assert_true(be_mem_stats(be).dev_budget > 0);
    const char *best = NULL; /* unforced, the backend runs the widest level this CPU has */
    for (int l = 0; l < N_LEVELS; l++)
        best = levels[l] ? level_names[l] : best;
    assert_string_equal(caps.simd, best);
    be_free(be);

    be_free(NULL);
    be_buffer_free(NULL);
    be_event_free(NULL);
    assert_null(be_buffer_data(NULL));
    assert_int_equal(be_buffer_size(NULL), 0);
    assert_int_equal(be_event_sync(NULL), BE_EINVAL);
    assert_int_equal(be_sync(NULL), BE_EINVAL);
    for (int st = BE_OK; st <= BE_EIO; st++)
        assert_non_null(be_strerror((enum be_status)st));
    assert_string_equal(be_dtype_name(BE_BF16), "bf16");
    assert_int_equal(be_dtype_size(BE_F16), 2);
}

/* Runs poke(ptr) in a child; true when the child died of SIGSEGV. */
static bool faults(void (*poke)(volatile float *), volatile float *ptr)
{
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGSEGV, SIG_DFL); /* not cmocka's handler: the child must die of it */
        poke(ptr);
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV;
}

static void poke_read(volatile float *p)
{
    _exit(p[1] == 12345.0f ? 3 : 4);
}

static void poke_write(volatile float *p)
{
    p[0] = 1.0f;
}

/* The strict backend's device memory works through the seam and faults
 * on any host access outside its ops, so a layer that touches a device
 * block by hand fails the test suite's strict pass. */
static void test_strict_device_memory(void **state)
{
    (void)state;
    be_backend *be;
    assert_int_equal(be_open("cpu-strict", &(struct be_params){.n_threads = 2, .device_mem = 1 << 20}, &be), BE_OK);
    struct be_caps caps = be_get_caps(be);
    assert_string_equal(caps.name, "cpu-strict");
    assert_false(caps.unified_memory);
    be_buffer *a, *b;
    assert_int_equal(be_dev_alloc(be, 1024 * sizeof(float), &a), BE_OK);
    assert_int_equal(be_dev_alloc(be, 1024 * sizeof(float), &b), BE_OK);
    float x[1024], y[1024];
    for (int i = 0; i < 1024; i++)
        x[i] = (float)i;
    assert_int_equal(be_copy(be, be_buffer_data(a), x, sizeof(x), BE_H2D), BE_OK);
    assert_int_equal(be_copy_async(be, be_buffer_data(b), x, sizeof(x), BE_H2D), BE_OK);
    assert_int_equal(be_add(be, be_buffer_data(a), be_buffer_data(b), 1024), BE_OK); /* on the pool */
    assert_int_equal(be_copy(be, y, be_buffer_data(a), sizeof(y), BE_D2H), BE_OK);
    for (int i = 0; i < 1024; i++)
        assert_true(y[i] == 2.0f * (float)i);
    assert_true(faults(poke_read, be_buffer_data(a)));
    assert_true(faults(poke_write, be_buffer_data(b)));
    /* freed and allocated again: still locked, and the budget holds */
    be_buffer_free(a);
    assert_int_equal(be_dev_alloc(be, 512 * sizeof(float), &a), BE_OK);
    assert_true(faults(poke_write, be_buffer_data(a)));
    be_buffer *big;
    assert_int_equal(be_dev_alloc(be, 2 << 20, &big), BE_ENOMEM_DEV);
    be_buffer_free(a);
    be_buffer_free(b);
    be_free(be);
}

static void test_bad_kernel_args(void **state)
{
    (void)state;
    be_backend *be = levels[0];
    float x[64] = {0}, y[64];
    int64_t pos[1] = {0};
    int32_t ids[1] = {-1}, am[1];
    assert_int_equal(be_matmul(be, y, BE_F32, x, x, (enum be_dtype)7, NULL, 1, 8, 8), BE_EINVAL);
    assert_int_equal(be_matmul(be, y, BE_F32, x, NULL, BE_F32, NULL, 1, 8, 8), BE_EINVAL);
    assert_int_equal(be_matmul(be, y, BE_F32, x, x, BE_F32, NULL, 0, 8, 8), BE_OK);
    assert_int_equal(be_matmul(be, y, BE_F32, x, x, BE_F32, NULL, 1, 0, 8), BE_EINVAL);
    assert_int_equal(be_rope(be, x, 1, 1, 8, pos, x, 9, 1.0f, BE_ROPE_NEOX), BE_EINVAL);
    assert_int_equal(be_rope(be, x, 1, 1, 8, pos, x, 3, 1.0f, BE_ROPE_NEOX), BE_EINVAL);
    assert_int_equal(be_rope(be, x, 1, 1, 8, pos, x, 8, NAN, BE_ROPE_NEOX), BE_EINVAL);
    assert_int_equal(be_embed(be, y, x, BE_F32, ids, 1, 8), BE_EINVAL);
    assert_int_equal(be_argmax(be, x, 1, 0, am), BE_EINVAL);
    assert_int_equal(be_softmax(be, x, -1, 4), BE_EINVAL);

    void *blocks[1] = {y};
    struct be_kv_view view = {.blocks = blocks, .n_blocks = 1, .block_tokens = 4, .v_offset = 64, .lo = 0, .hi = 4};
    struct be_attn_params p = {.n_heads = 3, .n_kv_heads = 2, .head_dim = 4, .scale = 0.5f};
    struct be_tok tok = {.view = 0, .pos = 4};
    assert_int_equal(be_attention(be, y, x, &view, &tok, 1, &p), BE_EINVAL); /* 3 heads over 2 kv heads */
    p.n_heads = 2;
    assert_int_equal(be_kv_store(be, &view, &tok, 1, x, x, &p), BE_EINVAL); /* past the blocks */
    view.hi = 5;
    tok.pos = 3;
    assert_int_equal(be_attention(be, y, x, &view, &tok, 1, &p), BE_EINVAL); /* hi past the blocks */
    view.hi = 4;
    view.lo = -1;
    assert_int_equal(be_attention(be, y, x, &view, &tok, 1, &p), BE_EINVAL);
    /* keys rotated at read time: a valid view, then an odd head_dim, which has no rotation pairs */
    float table[4 * 5] = {0};
    view.lo = 0;
    view.key_rope = true;
    p.key_rope = table;
    p.key_rope_rows = 4;
    p.key_rope_layout = BE_ROPE_NEOX;
    assert_int_equal(be_attention(be, y, x, &view, &tok, 1, &p), BE_OK);
    p.head_dim = 3;
    assert_int_equal(be_attention(be, y, x, &view, &tok, 1, &p), BE_EINVAL);
}

int main(void)
{
    rng_state = 0x9e3779b97f4a7c15u; /* the inputs the tolerances were set on */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_matmul_batch_invariance),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_elementwise),
        cmocka_unit_test(test_ssm_scan),
        cmocka_unit_test(test_gelu_scale),
        cmocka_unit_test(test_layernorm),
        cmocka_unit_test(test_softmax_argmax),
        cmocka_unit_test(test_embed),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_attention_invariance),
        cmocka_unit_test(test_attention_inf_piece),
        cmocka_unit_test(test_device_budget),
        cmocka_unit_test(test_fault_injection),
        cmocka_unit_test(test_copies_events),
        cmocka_unit_test(test_host_numa_binding),
        cmocka_unit_test(test_open_and_nulls),
        cmocka_unit_test(test_bad_kernel_args),
        cmocka_unit_test(test_strict_device_memory),
    };
    return cmocka_run_group_tests(tests, setup_levels, teardown_levels);
}
