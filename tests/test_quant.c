/* Description: quantized KV - parameter parsing and every
 * validation error, block formats and their memory per token against bf16,
 * round-trip error bounds per backend, nbits and axis, the KIVI residual
 * counting of Hugging Face's QuantizedCache, all-or-nothing reserves, and
 * attention over quantized views (every SIMD level) against dense attention
 * over the dequantized cache.
 *
 * `test_quant --codec IN OUT` is the C side of tests/quant_oracle.py: it
 * quantizes one block read from IN and writes codes, parameters and the
 * dequantized rows to OUT for a bit-exact comparison with PyTorch.
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

#include "backend/cpu/cpu.h"
#include "backend/kvq_format.h"
#include "tiers/quant.h"
#include "tests/levels.h"

/* ---- helpers -------------------------------------------------------------- */

/* K/V-like rows: a few channels with a large offset and spread, as keys
 * have (the reason KIVI quantizes keys per channel). */
static void fill_rows(float *x, int n_tok, int H, int D)
{
    for (int t = 0; t < n_tok; t++)
        for (int h = 0; h < H; h++)
            for (int d = 0; d < D; d++) {
                float base = d % 7 == 3 ? 6.0f + 0.3f * (float)h : 0.0f;
                x[((size_t)t * (size_t)H + (size_t)h) * (size_t)D + (size_t)d] = base + frand() * (d % 5 ? 1.0f : 3.0f);
            }
}

static struct kv_quant_params params(enum kv_quant_backend b, int nbits, int ak, int av, int g, int r)
{
    struct kv_quant_params p = kv_quant_defaults(b);
    if (b != KVQ_FP8) {
        p.nbits = nbits;
        p.axis_key = ak;
        p.axis_value = av;
        p.q_group_size = g;
        p.residual_length = r;
    }
    return p;
}

/* ---- validation ----------------------------------------------------------- */

static enum tier_status parse_str(const char *js, struct kv_quant_params *p, struct kvq_error *e)
{
    json_error_t jerr;
    json_t *o = json_loads(js, 0, &jerr);
    assert_non_null(o);
    memset(e, 0, sizeof(*e));
    enum tier_status st = kv_quant_parse(o, p, e);
    json_decref(o);
    return st;
}

static void expect_error(const char *js, const char *param, const char *needle)
{
    struct kv_quant_params p;
    struct kvq_error e;
    if (parse_str(js, &p, &e) != TIER_EINVAL)
        fail_msg("%s: accepted", js);
    if (strcmp(e.param, param) != 0 || !strstr(e.msg, needle) || !strstr(e.msg, param))
        fail_msg("%s: got param %s, message \"%s\"; want %s and \"%s\"", js, e.param, e.msg, param, needle);
}

static void test_parse_defaults(void **state)
{
    (void)state;
    struct kv_quant_params p;
    struct kvq_error e;
    assert_int_equal(parse_str("{\"implementation\": \"quantized\"}", &p, &e), TIER_OK);
    assert_int_equal(p.backend, KVQ_QUANTO);
    assert_int_equal(p.nbits, 4);
    assert_int_equal(p.axis_key, 0);
    assert_int_equal(p.axis_value, 0);
    assert_int_equal(p.q_group_size, 64);
    assert_int_equal(p.residual_length, 128);
    assert_int_equal(kv_quant_parse(NULL, &p, &e), TIER_OK);
    assert_int_equal(p.backend, KVQ_QUANTO);
    assert_int_equal(parse_str("{\"backend\": \"hqq\", \"nbits\": 3, \"axis_key\": 0, \"axis_value\": 1, "
                               "\"q_group_size\": 32, \"residual_length\": 0}", &p, &e), TIER_OK);
    assert_int_equal(p.backend, KVQ_HQQ);
    assert_int_equal(p.nbits, 3);
    assert_int_equal(p.axis_value, 1);
    assert_int_equal(p.q_group_size, 32);
    assert_int_equal(p.residual_length, 0);
    /* the kvtier extension: quanto int8 */
    assert_int_equal(parse_str("{\"backend\": \"quanto\", \"nbits\": 8, \"axis_key\": -1}", &p, &e), TIER_OK);
    assert_int_equal(p.nbits, 8);
    assert_int_equal(p.axis_key, -1);
    assert_int_equal(parse_str("{\"backend\": \"fp8\"}", &p, &e), TIER_OK);
    assert_int_equal(p.backend, KVQ_FP8);
}

static void test_validation_errors(void **state)
{
    (void)state;
    expect_error("{\"backend\": \"Quanto\"}", "cache.backend", "quanto, hqq, fp8");
    expect_error("{\"backend\": \"int4\"}", "cache.backend", "quanto, hqq, fp8");
    expect_error("{\"backend\": 4}", "cache.backend", "quanto, hqq, fp8");
    expect_error("{\"nbits\": 3}", "cache.nbits", "[2, 4]");
    expect_error("{\"nbits\": 1}", "cache.nbits", "[2, 4]");
    expect_error("{\"axis_key\": 1}", "cache.axis_key", "[0, -1]");
    expect_error("{\"axis_value\": 2}", "cache.axis_value", "[0, -1]");
    expect_error("{\"backend\": \"hqq\", \"nbits\": 5}", "cache.nbits", "[1, 2, 3, 4, 8]");
    expect_error("{\"backend\": \"hqq\", \"axis_key\": -1}", "cache.axis_key", "[0, 1]");
    expect_error("{\"backend\": \"hqq\", \"axis_value\": -1}", "cache.axis_value", "[0, 1]");
    expect_error("{\"q_group_size\": 0}", "cache.q_group_size", "between 1 and");
    expect_error("{\"q_group_size\": 100000}", "cache.q_group_size", "between 1 and");
    expect_error("{\"residual_length\": -1}", "cache.residual_length", "between 0 and");
    expect_error("{\"nbits\": 4.5}", "cache.nbits", "integer");
    expect_error("{\"nbits\": \"4\"}", "cache.nbits", "integer");
    expect_error("{\"compute_dtype\": \"float16\"}", "cache", "axis_value, q_group_size");
    const char *fp8_keys[] = {"nbits", "axis_key", "axis_value", "q_group_size", "residual_length"};
    for (size_t i = 0; i < sizeof(fp8_keys) / sizeof(fp8_keys[0]); i++) {
        char js[128], param[64];
        snprintf(js, sizeof(js), "{\"backend\": \"fp8\", \"%s\": 0}", fp8_keys[i]);
        snprintf(param, sizeof(param), "cache.%s", fp8_keys[i]);
        expect_error(js, param, "none of nbits, axis_key, axis_value, q_group_size, residual_length");
    }
}

/* ---- formats and memory --------------------------------------------------- */

static void test_memory_per_token(void **state)
{
    (void)state;
    /* a Llama-like layer: 8 kv heads of 128, store blocks of 32 tokens */
    const int H = 8, D = 128;
    struct {
        enum kv_quant_backend b;
        int nbits, ak, av;
        double limit;
    } cases[] = {
        {KVQ_QUANTO, 2, 0, 0, 0.18},  {KVQ_QUANTO, 2, -1, 0, 0.18}, {KVQ_QUANTO, 4, 0, 0, 0.30},
        {KVQ_QUANTO, 4, -1, 0, 0.30}, {KVQ_QUANTO, 8, -1, 0, 0.55}, {KVQ_HQQ, 2, 0, 1, 0.18},
        {KVQ_HQQ, 4, 1, 1, 0.30},     {KVQ_HQQ, 8, 0, 1, 0.55},     {KVQ_HQQ, 1, 0, 1, 0.18},
        {KVQ_HQQ, 3, 0, 0, 0.30},     {KVQ_FP8, 8, 0, 0, 0.55},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct kv_quant_params p = params(cases[i].b, cases[i].nbits, cases[i].ak, cases[i].av, 64, 128);
        struct be_kvq_format f;
        struct kvq_error e;
        int T = kvq_block_tokens(&p, 32);
        assert_int_equal(kvq_format_init(&f, &p, H, D, T, &e), TIER_OK);
        double bf16 = 2.0 * 2.0 * H * D; /* K and V, 2 bytes each */
        double ratio = (double)f.block_bytes / T / bf16;
        print_message("%-6s int%d axes %2d/%2d: %4d tokens/block, %.4f x bf16 (limit %.2f)\n",
                      kv_quant_backend_name(p.backend), f.nbits, p.axis_key, p.axis_value, T, ratio, cases[i].limit);
        assert_true(ratio <= cases[i].limit);
        assert_true(ratio >= f.nbits / 16.0); /* the codes alone: the ratio counts something real */
    }
}

static void test_format_errors(void **state)
{
    (void)state;
    struct be_kvq_format f;
    struct kvq_error e;
    struct kv_quant_params p = params(KVQ_QUANTO, 4, 0, 0, 48, 128); /* 48 does not divide 128 */
    assert_int_equal(kvq_format_init(&f, &p, 2, 128, 32, &e), TIER_EINVAL);
    assert_string_equal(e.param, "cache.q_group_size");
    assert_non_null(strstr(e.msg, "head_dim"));
    p = params(KVQ_QUANTO, 4, -1, 0, 64, 128); /* per-channel groups of 64 in blocks of 32 */
    assert_int_equal(kvq_format_init(&f, &p, 2, 128, 32, &e), TIER_EINVAL);
    assert_string_equal(e.param, "cache.q_group_size");
    assert_int_equal(kvq_block_tokens(&p, 32), 64);
    assert_int_equal(kvq_format_init(&f, &p, 2, 128, 64, &e), TIER_OK);
    p = params(KVQ_HQQ, 3, 1, 1, 4, 128); /* 4 codes of 3 bits are not whole bytes */
    assert_int_equal(kvq_format_init(&f, &p, 2, 64, 32, &e), TIER_EINVAL);
    p = params(KVQ_HQQ, 4, 1, 1, 256, 128); /* a group wider than head_dim is one head row */
    assert_int_equal(kvq_format_init(&f, &p, 2, 64, 32, &e), TIER_OK);
    assert_int_equal(f.k.gd, 64);
    /* per-channel groups of one element are per-token groups of one: whole
     * bytes only, else the backend could not read the format */
    p = params(KVQ_HQQ, 2, 0, 1, 1, 128);
    assert_int_equal(kvq_format_init(&f, &p, 2, 64, 32, &e), TIER_EINVAL);
    assert_string_equal(e.param, "cache.q_group_size");
    p = params(KVQ_HQQ, 8, 0, 0, 1, 128);
    assert_int_equal(kvq_format_init(&f, &p, 2, 64, 32, &e), TIER_OK);
    assert_true(f.k.gt == 1 && f.k.gd == 1 && f.v.gt == 1 && f.v.gd == 1);
}

/* ---- round trip ------------------------------------------------------------ */

/* Affine bound per group: half a step, plus what rounding the pair to f16
 * can move (relative 2^-11 of the extremes, twice, with margin). */
static void check_affine_group(const float *x, const float *y, size_t stride, int n, int nbits, double *worst)
{
    float mn = x[0], mx = x[0];
    for (int i = 1; i < n; i++) {
        mn = fminf(mn, x[(size_t)i * stride]);
        mx = fmaxf(mx, x[(size_t)i * stride]);
    }
    double step = fmax((mx - mn) / ((1 << nbits) - 1), 1.0 / 2e4);
    double bound = 0.5 * step * (1.0 + 0x1p-8) + 0x1p-9 * (fabs(mn) + fabs(mx)) + 1e-6;
    for (int i = 0; i < n; i++) {
        double err = fabs(x[(size_t)i * stride] - y[(size_t)i * stride]);
        if (err > bound)
            fail_msg("round trip error %g > bound %g (group [%g, %g], %d bits)", err, bound, mn, mx, nbits);
        *worst = fmax(*worst, err / step);
    }
}

static void round_trip(const struct kv_quant_params *p, int H, int D, int n_tok, double *worst, double *mean)
{
    struct be_kvq_format f;
    struct kvq_error e;
    int T = kvq_block_tokens(p, 64);
    assert_int_equal(kvq_format_init(&f, p, H, D, T, &e), TIER_OK);
    size_t rows = (size_t)n_tok * (size_t)H * (size_t)D, stride = (size_t)H * (size_t)D;
    float *k = malloc(rows * sizeof(float)), *v = malloc(rows * sizeof(float));
    float *k2 = malloc(rows * sizeof(float)), *v2 = malloc(rows * sizeof(float));
    void *blk = aligned_alloc(64, f.block_bytes);
    assert_true(k && v && k2 && v2 && blk);
    fill_rows(k, n_tok, H, D);
    fill_rows(v, n_tok, H, D);
    float sk = kvq_e4m3_scale(k, rows), sv = kvq_e4m3_scale(v, rows);
    kvq_quantize(&f, blk, 0, n_tok, k, v, stride, sk, sv);
    kvq_dequantize(&f, blk, 0, n_tok, k2, v2, stride, sk, sv);
    double sum = 0.0;
    for (size_t i = 0; i < rows; i++)
        sum += fabs(k[i] - k2[i]) + fabs(v[i] - v2[i]);
    *mean = sum / (2.0 * (double)rows);
    *worst = 0.0;
    const struct be_kvq_half *halves[2] = {&f.k, &f.v};
    const float *xs[2] = {k, v}, *ys[2] = {k2, v2};
    for (int part = 0; part < 2; part++) {
        const struct be_kvq_half *hf = halves[part];
        for (int h = 0; h < H; h++)
            for (int t = 0; t < n_tok; t++)
                for (int d = 0; d < D; d++) {
                    size_t at = (size_t)t * stride + (size_t)h * (size_t)D + (size_t)d;
                    if (f.kind == BE_KVQ_E4M3) {
                        float sc = part ? sv : sk, x = xs[part][at];
                        /* 3 mantissa bits: half an ulp is 2^-4 relative; subnormals step 2^-9 */
                        if (fabsf(x - ys[part][at]) > fabsf(x) * 0x1p-4f + sc * 0x1p-10f)
                            fail_msg("e4m3 round trip of %g gave %g", x, ys[part][at]);
                    } else if (t % hf->gt == 0 && d % hf->gd == 0) { /* first element of a group */
                        int n = hf->gt > 1 ? (n_tok - t < hf->gt ? n_tok - t : hf->gt) : hf->gd;
                        check_affine_group(xs[part] + at, ys[part] + at, hf->gt > 1 ? stride : 1, n, f.nbits, worst);
                    }
                }
    }
    free(k);
    free(v);
    free(k2);
    free(v2);
    free(blk);
}

static void test_round_trip_bounds(void **state)
{
    (void)state;
    struct {
        enum kv_quant_backend b;
        int nbits, ak, av;
    } cases[] = {
        {KVQ_QUANTO, 2, 0, 0}, {KVQ_QUANTO, 2, -1, -1}, {KVQ_QUANTO, 4, 0, 0}, {KVQ_QUANTO, 4, -1, 0},
        {KVQ_QUANTO, 8, -1, 0}, {KVQ_HQQ, 1, 1, 1},     {KVQ_HQQ, 2, 0, 1},   {KVQ_HQQ, 3, 0, 1},
        {KVQ_HQQ, 4, 1, 0},    {KVQ_HQQ, 8, 0, 0},      {KVQ_FP8, 8, 0, 0},
    };
    double prev_mean[9] = {0};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct kv_quant_params p = params(cases[i].b, cases[i].nbits, cases[i].ak, cases[i].av, 32, 128);
        double worst, mean;
        /* 50 tokens: the last per-channel group row is partial */
        round_trip(&p, 2, 64, 50, &worst, &mean);
        print_message("%-6s int%d axes %2d/%2d: worst |err| %.3f steps, mean |err| %.5f\n",
                      kv_quant_backend_name(p.backend), cases[i].nbits, p.axis_key, p.axis_value, worst, mean);
        /* quanto quantizes with the stored f16 pair: half a step; hqq quantizes
         * with its f32 pair and only decodes with the f16 one, which costs up
         * to ~0.4 step more at 8 bits on offset channels (its real behaviour
         * with a half-precision compute_dtype) */
        if (p.backend == KVQ_QUANTO)
            assert_true(worst <= 0.5 + 0x1p-8);
        if (p.backend == KVQ_HQQ)
            assert_true(worst <= 1.0);
        /* more bits, less error: a wrong packing breaks this ordering */
        if (p.backend == KVQ_HQQ && cases[i].ak == 0 && cases[i].nbits > 1 && prev_mean[1] > 0)
            assert_true(mean < prev_mean[1]);
        if (p.backend == KVQ_HQQ)
            prev_mean[1] = mean;
    }
}

/* ---- the KIVI layer --------------------------------------------------------- */

struct test_alloc {
    size_t bytes[2];
    int live[2];
    int fail_in; /* > 0: the fail_in-th get from now returns NULL */
};

static void *ta_get(void *ctx, enum kvq_block_kind kind)
{
    struct test_alloc *a = ctx;
    if (a->fail_in > 0 && --a->fail_in == 0)
        return NULL;
    void *b = aligned_alloc(64, a->bytes[kind]);
    if (b) {
        memset(b, 0xa5, a->bytes[kind]); /* garbage, as a recycled block would hold */
        a->live[kind]++;
    }
    return b;
}

static void ta_put(void *ctx, enum kvq_block_kind kind, void *block)
{
    struct test_alloc *a = ctx;
    a->live[kind]--;
    free(block);
}

struct layer_fixture {
    struct test_alloc ta;
    kvq_ctx *c;
    kvq_layer *l;
    be_backend *be; /* writes the codes into the test's host blocks */
    int H, D, bt;
};

static void layer_open(struct layer_fixture *fx, const struct kv_quant_params *p, int H, int D, int bt)
{
    memset(fx, 0, sizeof(*fx));
    fx->H = H;
    fx->D = D;
    fx->bt = bt;
    struct kvq_alloc a = {.ctx = &fx->ta, .get = ta_get, .put = ta_put};
    struct kvq_error e;
    assert_int_equal(be_open("cpu", &(struct be_params){.n_threads = 1}, &fx->be), BE_OK);
    assert_int_equal(kvq_ctx_create(fx->be, p, BE_F32, H, D, bt, &a, &fx->c, &e), TIER_OK);
    fx->ta.bytes[KVQ_BLOCK_QUANT] = kvq_ctx_format(fx->c)->block_bytes;
    fx->ta.bytes[KVQ_BLOCK_FULL] = kvq_full_block_bytes(fx->c);
    assert_int_equal(kvq_layer_create(fx->c, &fx->l), TIER_OK);
}

static void layer_close(struct layer_fixture *fx)
{
    kvq_layer_free(fx->l);
    assert_int_equal(fx->ta.live[0], 0);
    assert_int_equal(fx->ta.live[1], 0);
    kvq_ctx_free(fx->c);
    be_free(fx->be);
}

/* Writes rows k, v (n tokens) into the reserved positions as be_kv_store does. */
static void write_rest(struct layer_fixture *fx, const float *k, const float *v, int n)
{
    struct be_kvq_view view;
    kvq_layer_view(fx->l, &view);
    const struct be_kv_view *r = &view.rest;
    for (int i = 0; i < n; i++) {
        int64_t pos = kvq_layer_length(fx->l) + i, rel = pos - r->base;
        assert_true(rel >= 0 && rel < (int64_t)r->n_blocks * r->block_tokens);
        char *blk = r->blocks[rel / r->block_tokens];
        for (int h = 0; h < fx->H; h++) {
            size_t off = (((size_t)h * (size_t)r->block_tokens + (size_t)(rel % r->block_tokens)) * (size_t)fx->D) *
                         sizeof(float);
            size_t src = ((size_t)i * (size_t)fx->H + (size_t)h) * (size_t)fx->D;
            memcpy(blk + off, k + src, (size_t)fx->D * sizeof(float));
            memcpy(blk + r->v_offset + off, v + src, (size_t)fx->D * sizeof(float));
        }
    }
}

static void step(struct layer_fixture *fx, const float *k, const float *v, int n)
{
    assert_int_equal(kvq_layer_reserve(fx->l, n, false), TIER_OK);
    write_rest(fx, k, v, n);
    assert_int_equal(kvq_layer_commit(fx->l), BE_OK);
}

/* HF's residual counting: R = 4, prefill 5; the first update leaves the residual empty, after
 * decode step k the residual holds k mod 4 and get_seq_length is 5 + k. */
static void test_residual_counting(void **state)
{
    (void)state;
    struct kv_quant_params p = params(KVQ_QUANTO, 4, 0, 0, 16, 4);
    struct layer_fixture fx;
    layer_open(&fx, &p, 1, 16, 4);
    float k[5 * 16], v[5 * 16];
    fill_rows(k, 5, 1, 16);
    fill_rows(v, 5, 1, 16);
    assert_int_equal(kvq_layer_reserve(fx.l, 5, false), TIER_OK);
    struct be_kvq_view view;
    kvq_layer_view(fx.l, &view);
    /* the prefill's own attention reads it in full precision */
    assert_int_equal(view.hi, 0);
    assert_int_equal(view.rest.lo, 0);
    assert_int_equal(view.rest.hi, 5);
    write_rest(&fx, k, v, 5);
    assert_int_equal(kvq_layer_commit(fx.l), BE_OK);
    assert_int_equal(kvq_layer_length(fx.l), 5);
    assert_int_equal(kvq_layer_residual(fx.l), 0);
    assert_int_equal(kvq_layer_quantized(fx.l), 5);
    for (int s = 1; s <= 12; s++) {
        step(&fx, k, v, 1);
        assert_int_equal(kvq_layer_length(fx.l), 5 + s);
        assert_int_equal(kvq_layer_residual(fx.l), s % 4);
        assert_int_equal(kvq_layer_quantized(fx.l), 5 + s - s % 4);
    }
    layer_close(&fx);

    /* R = 0 and 1: HF's test skips the empty (1-D) residual, so one token
     * stays in full precision every other step */
    for (int R = 0; R <= 1; R++) {
        p = params(KVQ_HQQ, 4, 1, 1, 16, R);
        layer_open(&fx, &p, 1, 16, 4);
        step(&fx, k, v, 3);
        for (int s = 1; s <= 6; s++) {
            step(&fx, k, v, 1);
            assert_int_equal(kvq_layer_residual(fx.l), s % 2);
        }
        layer_close(&fx);
    }

    /* chunked updates: the test uses +1, so the residual can pass R - 1 */
    p = params(KVQ_QUANTO, 4, 0, 0, 16, 4);
    layer_open(&fx, &p, 1, 16, 4);
    step(&fx, k, v, 2);
    step(&fx, k, v, 5); /* residual empty: joins it */
    assert_int_equal(kvq_layer_residual(fx.l), 5);
    step(&fx, k, v, 2); /* 5 + 1 >= 4: everything is quantized */
    assert_int_equal(kvq_layer_residual(fx.l), 0);
    assert_int_equal(kvq_layer_length(fx.l), 9);
    layer_close(&fx);

    /* fp8: no residual after any commit */
    p = params(KVQ_FP8, 8, 0, 0, 0, 0);
    layer_open(&fx, &p, 1, 16, 4);
    for (int s = 0; s < 4; s++) {
        step(&fx, k, v, s + 1);
        assert_int_equal(kvq_layer_residual(fx.l), 0);
    }
    assert_int_equal(kvq_layer_length(fx.l), 10);
    layer_close(&fx);
}

/* Feeds rows [from, from + n) of k, v as one part of an update. */
static void part(struct layer_fixture *fx, const float *k, const float *v, int from, int n, bool more)
{
    size_t off = (size_t)from * (size_t)fx->H * (size_t)fx->D;
    assert_int_equal(kvq_layer_reserve(fx->l, n, more), TIER_OK);
    write_rest(fx, k + off, v + off, n);
    assert_int_equal(kvq_layer_commit(fx->l), BE_OK);
}

/* Two layers hold the same state: lengths, scales, the quantized blocks'
 * bytes and the residual's rows. */
static void assert_same_layer(struct layer_fixture *a, struct layer_fixture *b)
{
    assert_int_equal(kvq_layer_length(a->l), kvq_layer_length(b->l));
    assert_int_equal(kvq_layer_quantized(a->l), kvq_layer_quantized(b->l));
    assert_int_equal(kvq_layer_residual(a->l), kvq_layer_residual(b->l));
    struct be_kvq_view va, vb;
    kvq_layer_view(a->l, &va);
    kvq_layer_view(b->l, &vb);
    assert_true(va.scale_k == vb.scale_k && va.scale_v == vb.scale_v);
    assert_int_equal(va.n_blocks, vb.n_blocks);
    for (int i = 0; i < va.n_blocks; i++)
        assert_memory_equal(va.blocks[i], vb.blocks[i], va.fmt->block_bytes);
    size_t row = (size_t)a->D * sizeof(float);
    for (int64_t pos = va.rest.lo; pos < va.rest.hi; pos++)
        for (int h = 0; h < a->H; h++)
            for (int kv = 0; kv < 2; kv++) {
                const struct be_kv_view *r[2] = {&va.rest, &vb.rest};
                const char *p[2];
                for (int x = 0; x < 2; x++) {
                    int64_t rel = pos - r[x]->base;
                    p[x] = (const char *)r[x]->blocks[rel / r[x]->block_tokens] + (kv ? r[x]->v_offset : 0) +
                           ((size_t)h * (size_t)r[x]->block_tokens + (size_t)(rel % r[x]->block_tokens)) * row;
                }
                assert_memory_equal(p[0], p[1], row);
            }
}

/* An update fed in parts (a prompt over several steps) leaves the state
 * one reserve of all its tokens leaves, for the first update and a later
 * one, whatever the parts: the parts wait in the residual unquantized. */
static void test_update_in_parts(void **state)
{
    (void)state;
    struct kv_quant_params ps[] = {params(KVQ_QUANTO, 4, 0, 0, 16, 4), params(KVQ_HQQ, 2, 1, 1, 8, 8),
                                   params(KVQ_QUANTO, 8, -1, 0, 8, 0), params(KVQ_FP8, 8, 0, 0, 0, 0)};
    enum { H = 2, D = 16, N = 13 + 9 + 5 };
    float k[N * H * D], v[N * H * D];
    fill_rows(k, N, H, D);
    fill_rows(v, N, H, D);
    for (size_t i = 0; i < sizeof(ps) / sizeof(ps[0]); i++) {
        struct layer_fixture whole, parts;
        layer_open(&whole, &ps[i], H, D, 4);
        layer_open(&parts, &ps[i], H, D, 4);
        part(&whole, k, v, 0, 13, false);
        part(&parts, k, v, 0, 5, true);
        /* a part in waiting is residual, read in full precision */
        assert_int_equal(kvq_layer_quantized(parts.l), 0);
        assert_int_equal(kvq_layer_residual(parts.l), 5);
        part(&parts, k, v, 5, 1, true);
        part(&parts, k, v, 6, 7, false);
        assert_same_layer(&whole, &parts);
        for (int t = 13; t < 16; t++) { /* a residual of 3 (1 for R = 0, none for fp8) */
            part(&whole, k, v, t, 1, false);
            part(&parts, k, v, t, 1, false);
        }
        assert_same_layer(&whole, &parts);
        part(&whole, k, v, 16, 9, false);
        part(&parts, k, v, 16, 4, true);
        part(&parts, k, v, 20, 5, false);
        assert_same_layer(&whole, &parts);
        for (int t = 25; t < N; t++) {
            part(&whole, k, v, t, 1, false);
            part(&parts, k, v, t, 1, false);
            assert_same_layer(&whole, &parts);
        }
        layer_close(&whole);
        layer_close(&parts);
    }
}

/* A reserve that cannot get a block leaves the layer as it was. */
static void test_reserve_all_or_nothing(void **state)
{
    (void)state;
    struct kv_quant_params p = params(KVQ_QUANTO, 2, -1, 0, 8, 4);
    struct layer_fixture fx;
    layer_open(&fx, &p, 2, 16, 4);
    float k[40 * 32], v[40 * 32];
    fill_rows(k, 40, 2, 16);
    fill_rows(v, 40, 2, 16);
    step(&fx, k, v, 13);
    size_t bytes = kvq_layer_bytes(fx.l);
    int live0 = fx.ta.live[0], live1 = fx.ta.live[1];
    for (int fail_in = 1; fail_in <= 3; fail_in++) {
        fx.ta.fail_in = fail_in;
        enum tier_status st = kvq_layer_reserve(fx.l, 20, false);
        if (st == TIER_OK) {
            kvq_layer_abort(fx.l);
        } else {
            assert_int_equal(st, TIER_ENOMEM_DEV);
        }
        assert_int_equal(fx.ta.live[0], live0);
        assert_int_equal(fx.ta.live[1], live1);
        assert_int_equal(kvq_layer_bytes(fx.l), bytes);
        assert_int_equal(kvq_layer_length(fx.l), 13);
    }
    fx.ta.fail_in = 0;
    step(&fx, k, v, 20);
    assert_int_equal(kvq_layer_length(fx.l), 33);
    layer_close(&fx);
}

/* ---- attention ---------------------------------------------------------------- */

/* Query q's scaled score of key t of rows K, plus bias[clamp(t - qpos,
 * -span, span)] (bias NULL: none), in double. */
static double dense_score(const float *q, const float *K, int64_t t, int64_t qpos, int H, int D, int kvh,
                          float scale, const float *bias, int span)
{
    double s = 0.0;
    for (int d = 0; d < D; d++)
        s += (double)q[d] * K[((size_t)t * (size_t)H + (size_t)kvh) * (size_t)D + (size_t)d];
    int64_t r = t - qpos < -span ? -span : t - qpos > span ? span : t - qpos;
    return s * scale + (bias ? bias[r] : 0.0);
}

/* Dense reference in double over keys [k0, k1) of rows K, V for the query
 * at qpos, each score biased as dense_score biases it. */
static void dense_attention(const float *q, const float *K, const float *V, int64_t k0, int64_t k1, int64_t qpos,
                            int H, int D, int kvh, float scale, const float *bias, int span, double *o)
{
    double m = -INFINITY, l = 0.0;
    for (int64_t t = k0; t < k1; t++)
        m = fmax(m, dense_score(q, K, t, qpos, H, D, kvh, scale, bias, span));
    for (int d = 0; d < D; d++)
        o[d] = 0.0;
    for (int64_t t = k0; t < k1; t++) {
        double e = exp(dense_score(q, K, t, qpos, H, D, kvh, scale, bias, span) - m);
        l += e;
        for (int d = 0; d < D; d++)
            o[d] += e * V[((size_t)t * (size_t)H + (size_t)kvh) * (size_t)D + (size_t)d];
    }
    for (int d = 0; d < D; d++)
        o[d] /= l;
}

/* The layer's first n positions as attention sees them: the quantized part
 * decoded by the host codec, the rest as written. */
static void layer_contents(struct layer_fixture *fx, const float *k, const float *v, int64_t n, float *K, float *V)
{
    struct be_kvq_view view;
    kvq_layer_view(fx->l, &view);
    const struct be_kvq_format *f = view.fmt;
    size_t stride = (size_t)fx->H * (size_t)fx->D;
    memcpy(K, k, (size_t)n * stride * sizeof(float));
    memcpy(V, v, (size_t)n * stride * sizeof(float));
    for (int b = 0; (int64_t)b * f->block_tokens < view.hi; b++) {
        int n_in = view.hi - (int64_t)b * f->block_tokens < f->block_tokens ? (int)(view.hi - (int64_t)b * f->block_tokens)
                                                                           : f->block_tokens;
        size_t at = (size_t)b * (size_t)f->block_tokens * stride;
        kvq_dequantize(f, view.blocks[b], 0, n_in, K + at, V + at, stride, view.scale_k, view.scale_v);
    }
}

/* Key x (head_dim D) rotated as be_rope would at the cache index of table
 * row t (NEOX pairs: cos in the first half, sin in the second). */
static void rope_row(const float *t, const float *x, int D, float *out)
{
    for (int i = 0; i < D / 2; i++) {
        double c = t[i], sn = t[i + D / 2];
        out[i] = (float)(x[i] * c - x[i + D / 2] * sn);
        out[i + D / 2] = (float)(x[i + D / 2] * c + x[i] * sn);
    }
}

/* rope: the sink strategy's view (keys stored before RoPE, rotated at
 * read time): 3 full-precision sinks in a sink block, then the window from
 * position 30 on, quantized and rest, at cache indices 3, 4, ...  The
 * reference is the dense attention over the same keys decoded, rotated.
 * t5: a relative position bias (T5's, rel_span 7: both the clamped and
 * the exact distances), with T5_BIDIRECTIONAL every query reading every
 * key, the 3 queries' own included.
 * N_TOK tokens: a prompt, then 59 decode steps, then 3 queries; past
 * 1024 keys the attention runs in pieces, spread over the threads. */
enum { T5_NONE, T5_BIAS, T5_BIDIRECTIONAL };
static void attention_shape(be_backend *be, const struct kv_quant_params *p, int window, bool rope, int t5,
                            const int N_TOK, const int H, const int NH, const int D)
{
    const int BT = 8, N_Q = 3;
    struct layer_fixture fx;
    layer_open(&fx, p, H, D, BT);
    size_t stride = (size_t)H * D;
    float *k = malloc((size_t)N_TOK * stride * sizeof(float)), *v = malloc((size_t)N_TOK * stride * sizeof(float));
    float *K = malloc((size_t)N_TOK * stride * sizeof(float)), *V = malloc((size_t)N_TOK * stride * sizeof(float));
    float *q = malloc((size_t)N_Q * NH * D * sizeof(float)), *out = malloc((size_t)N_Q * NH * D * sizeof(float));
    assert_true(q && out);
    assert_true(k && v && K && V);
    fill_rows(k, N_TOK, H, D);
    fill_rows(v, N_TOK, H, D);
    for (int i = 0; i < N_Q * NH * D; i++)
        q[i] = frand();
    /* a prompt, then single decodes (flushes every R), then a chunk of 3
     * whose queries are checked */
    int at = N_TOK - N_Q - 59;
    step(&fx, k, v, at);
    for (; at < N_TOK - N_Q; at++)
        step(&fx, k + (size_t)at * stride, v + (size_t)at * stride, 1);
    assert_int_equal(kvq_layer_reserve(fx.l, N_Q, false), TIER_OK);
    write_rest(&fx, k + (size_t)at * stride, v + (size_t)at * stride, N_Q);
    struct be_kvq_view view;
    kvq_layer_view(fx.l, &view);
    assert_true(view.hi > 0 || p->backend == KVQ_FP8);
    struct be_tok toks[N_Q];
    for (int i = 0; i < N_Q; i++)
        toks[i] = (struct be_tok){.view = 0, .pos = at + i};
    struct be_attn_params ap = {.n_heads = NH, .n_kv_heads = H, .head_dim = D, .scale = 1.0f / sqrtf((float)D),
                                .window = window, .kv_dtype = BE_F32};
    const int S = 3, L0 = 30;
    float *table = malloc((size_t)N_TOK * D * sizeof(float)), *sink_kv = malloc((size_t)2 * H * BT * D * sizeof(float));
    assert_true(table && sink_kv);
    if (rope) {
        for (int j = 0; j < N_TOK; j++)
            for (int i = 0; i < D / 2; i++) {
                double a = j * pow(10000.0, -2.0 * i / D);
                table[j * D + i] = (float)cos(a);
                table[j * D + i + D / 2] = (float)sin(a);
            }
        fill_rows(sink_kv, 2 * BT, H, D); /* any rows: (H, BT, D) K then V */
        view.rest.key_rope = true;
        view.rest.sinks = S;
        view.rest.sink_block = sink_kv;
        view.rest.shift = L0 - S;
        view.lo = view.lo > L0 ? view.lo : L0 < view.hi ? L0 : view.hi;
        view.rest.lo = view.rest.lo > L0 ? view.rest.lo : L0;
        ap.key_rope = table;
        ap.key_rope_rows = N_TOK;
        ap.key_rope_layout = BE_ROPE_NEOX;
    }
    const int SPAN = 7;
    float bias[4 * (2 * SPAN + 1)];
    assert_true(NH <= 4);
    for (int i = 0; i < NH * (2 * SPAN + 1); i++)
        bias[i] = 2.0f * frand();
    if (t5 != T5_NONE) {
        ap.rel_bias = bias;
        ap.rel_span = SPAN;
        ap.bidirectional = t5 == T5_BIDIRECTIONAL;
    }
    assert_int_equal(be_attention_quant(be, out, q, &view, toks, N_Q, &ap), BE_OK);
    if (view.fmt && view.fmt->k.gt > 1 && view.fmt->v.gt > 1) { /* per-channel K and V of different heights */
        struct be_kvq_format odd = *view.fmt;
        const struct be_kvq_format *fmt = view.fmt;
        odd.v.gt = odd.k.gt / 2;
        view.fmt = &odd;
        assert_int_equal(be_attention_quant(be, out, q, &view, toks, N_Q, &ap), BE_EINVAL);
        view.fmt = fmt;
    }
    /* reference: the contents attention saw, decoded, dense (before the
     * commit, which may quantize a reopened group row again) */
    layer_contents(&fx, k, v, at + N_Q, K, V);
    assert_int_equal(kvq_layer_commit(fx.l), BE_OK);
    if (rope) { /* in cache order: the sinks, then the window, rotated */
        float *Kc = malloc((size_t)N_TOK * stride * sizeof(float)), *Vc = malloc((size_t)N_TOK * stride * sizeof(float));
        assert_true(Kc && Vc);
        for (int c = 0; c < S + at + N_Q - L0; c++)
            for (int h = 0; h < H; h++) {
                size_t dst = ((size_t)c * H + (size_t)h) * D;
                const float *kr = c < S ? sink_kv + ((size_t)h * BT + (size_t)c) * D : K + ((size_t)(L0 + c - S) * H + (size_t)h) * D;
                const float *vr = c < S ? sink_kv + ((size_t)(H + h) * BT + (size_t)c) * D : V + ((size_t)(L0 + c - S) * H + (size_t)h) * D;
                rope_row(table + (size_t)c * D, kr, D, Kc + dst);
                memcpy(Vc + dst, vr, (size_t)D * sizeof(float));
            }
        memcpy(K, Kc, (size_t)N_TOK * stride * sizeof(float));
        memcpy(V, Vc, (size_t)N_TOK * stride * sizeof(float));
        free(Kc);
        free(Vc);
    }
    double o[256], worst = 0.0;
    assert_true(D <= 256);
    for (int i = 0; i < N_Q; i++)
        for (int h = 0; h < NH; h++) {
            int64_t qpos = rope ? at + i - (L0 - S) : at + i, k0 = window ? (qpos - window + 1 > 0 ? qpos - window + 1 : 0) : 0;
            int64_t k1 = ap.bidirectional ? at + N_Q : qpos + 1;
            dense_attention(q + ((size_t)i * NH + (size_t)h) * D, K, V, k0, k1, qpos, H, D, h / (NH / H), ap.scale,
                            ap.rel_bias ? bias + h * (2 * SPAN + 1) + SPAN : NULL, SPAN, o);
            for (int d = 0; d < D; d++)
                worst = fmax(worst, fabs(o[d] - out[((size_t)i * NH + (size_t)h) * D + (size_t)d]) / (1.0 + fabs(o[d])));
        }
    if (worst > 2e-5)
        fail_msg("%s int%d axes %d/%d window %d%s%s: quantized attention differs from dense by %g",
                 kv_quant_backend_name(p->backend), p->nbits, p->axis_key, p->axis_value, window,
                 rope ? " key_rope" : "", (const char *[]){"", " rel_bias", " rel_bias bidirectional"}[t5], worst);
    free(k);
    free(v);
    free(K);
    free(V);
    free(table);
    free(sink_kv);
    free(q);
    free(out);
    layer_close(&fx);
}

/* 2 kv heads of 32 read by 4 query heads */
static void attention_case(be_backend *be, const struct kv_quant_params *p, int window, bool rope, int n_tok)
{
    attention_shape(be, p, window, rope, T5_NONE, n_tok, 2, 4, 32);
}

static void attention_all(be_backend *be)
{
    struct {
        enum kv_quant_backend b;
        int nbits, ak, av, g, r;
    } cases[] = {
        {KVQ_QUANTO, 4, 0, 0, 32, 16}, {KVQ_QUANTO, 2, -1, 0, 8, 16}, {KVQ_QUANTO, 8, -1, -1, 16, 5},
        {KVQ_HQQ, 3, 0, 1, 16, 16},    {KVQ_HQQ, 1, 1, 1, 16, 0},     {KVQ_HQQ, 8, 1, 0, 8, 3},
        {KVQ_HQQ, 4, 0, 0, 8, 128},    {KVQ_FP8, 8, 0, 0, 0, 0},
        /* per-token keys of 8 groups a row, per-channel values of 4-row groups: more key groups
         * than rows in a chunk */
        {KVQ_HQQ, 4, 1, 0, 4, 16},     {KVQ_QUANTO, 4, 0, -1, 4, 16},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct kv_quant_params p = params(cases[i].b, cases[i].nbits, cases[i].ak, cases[i].av, cases[i].g, cases[i].r);
        attention_case(be, &p, 0, false, 83);
        attention_case(be, &p, 19, false, 83);
        attention_case(be, &p, 0, true, 83);
        attention_shape(be, &p, 0, false, T5_BIAS, 83, 2, 4, 32);
        attention_shape(be, &p, 0, false, T5_BIDIRECTIONAL, 83, 2, 4, 32);
        if (i % 3 == 0 || cases[i].b == KVQ_FP8) { /* every third case and fp8, in pieces */
            attention_case(be, &p, 0, false, 2600);
            attention_case(be, &p, 1500, false, 2600);
            attention_case(be, &p, 0, true, 2600);
        }
    }
    /* the largest group (1024 tokens, per channel) on 128-wide heads: the
     * scratch holds it, keys rotated at read time included */
    for (int b = KVQ_QUANTO; b <= KVQ_HQQ; b++) {
        struct kv_quant_params p = params((enum kv_quant_backend)b, 4, b == KVQ_QUANTO ? -1 : 0,
                                          b == KVQ_QUANTO ? -1 : 0, 1024, 16);
        attention_shape(be, &p, 0, false, T5_NONE, 1200, 1, 4, 128);
        attention_shape(be, &p, 0, true, T5_NONE, 1200, 1, 4, 128);
    }
}

/* At every level the CPU has (the scalar code loops under the AVX2 dense
 * loops, the AVX-512 ones from avx512 up). */
static void test_attention_levels(void **state)
{
    (void)state;
    for (int l = 0; l < N_LEVELS; l++) {
        if (levels[l])
            attention_all(levels[l]);
        else
            print_message("no %s on this CPU\n", level_names[l]);
    }
}

/* The SIMD code loops against the scalar ones on every width and tail,
 * for one query head and for several (rows widened once for all), over
 * chunks of rows that end inside and past a 16-row tile and rows wider
 * than one 128-column tile.  The two sum in different orders, so each
 * result is allowed 1e-5 of the sum of its terms' magnitudes (float
 * rounding over 200 terms stays below that; a wrong code or row does not). */
static void test_code_loops(void **state)
{
    (void)state;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw"))
        skip();
    enum { ROWS = 21, STRIDE = 200, NQ = 3, XS = 211 };
    static uint8_t c[ROWS * STRIDE];
    static float x[NQ * XS], y0[NQ * XS], y1[NQ * XS], w[NQ * ROWS], s0[NQ * ROWS], s1[NQ * ROWS];
    static float ax[NQ * XS], aw[NQ * ROWS], ms[NQ * ROWS], my[NQ * XS]; /* |x|, |w|, magnitudes */
    for (int i = 0; i < ROWS * STRIDE; i++)
        c[i] = (uint8_t)(frand() * 128.0f + 128.0f);
    for (int i = 0; i < NQ * XS; i++)
        ax[i] = fabsf(x[i] = frand());
    for (int r = 0; r < NQ * ROWS; r++)
        aw[r] = fabsf(w[r] = frand());
    const int row_counts[] = {1, 5, 16, 21};
    for (int nq = 1; nq <= NQ; nq += NQ - 1)
        for (int ri = 0; ri < 4; ri++)
            for (int nbits = 1; nbits <= 8; nbits++)
                for (int n = 8; n <= 200; n += 8) {
                    int rows = row_counts[ri];
                    /* one row; else rows STRIDE bytes apart (one group of each token row) */
                    size_t stride = rows == 1 ? (size_t)n * (size_t)nbits / 8 : STRIDE;
                    cpu_qkern_scalar.qdot(s0, x, XS, nq, c, stride, nbits, n, rows);
                    cpu_qkern_avx512.qdot(s1, x, XS, nq, c, stride, nbits, n, rows);
                    cpu_qkern_scalar.qdot(ms, ax, XS, nq, c, stride, nbits, n, rows); /* codes are >= 0 */
                    for (int r = 0; r < nq * rows; r++)
                        assert_true(fabsf(s0[r] - s1[r]) <= 1e-5f * ms[r]);
                    memcpy(y0, x, sizeof(x));
                    memcpy(y1, x, sizeof(x));
                    memcpy(my, ax, sizeof(ax));
                    cpu_qkern_scalar.qaxpy(y0, XS, w, nq, c, stride, nbits, n, rows);
                    cpu_qkern_avx512.qaxpy(y1, XS, w, nq, c, stride, nbits, n, rows);
                    cpu_qkern_scalar.qaxpy(my, XS, aw, nq, c, stride, nbits, n, rows);
                    for (int i = 0; i < NQ * XS; i++) /* and nothing outside the n columns of each head */
                        assert_true(fabsf(y0[i] - y1[i]) <= 1e-5f * my[i]);
                }
    /* a row is not a shifted copy of another: the chunk reads each row's codes */
    cpu_qkern_scalar.qdot(s0, x, XS, 1, c, 64, 8, 64, 2);
    assert_true(s0[0] != s0[1]);
    /* each head uses its own x and its own weights */
    cpu_qkern_avx512.qdot(s1, x, XS, 2, c, 64, 8, 64, 2);
    assert_true(s1[0] != s1[2]);
    for (int nq = 1; nq <= NQ; nq += NQ - 1)
        for (int ri = 0; ri < 4; ri++)
            for (int n = 1; n <= 200; n += n % 16 ? 13 : 16) { /* tails, and 144 .. 192 */
                int rows = row_counts[ri];
                cpu_qkern_scalar.e4m3_dot(s0, x, nq, c, STRIDE, n, rows);
                cpu_qkern_avx512.e4m3_dot(s1, x, nq, c, STRIDE, n, rows);
                memcpy(my, ax, sizeof(ax));
                for (int g = 0; g < nq; g++)
                    for (int r = 0; r < rows; r++) {
                        ms[g * rows + r] = 0.0f;
                        for (int i = 0; i < n; i++) {
                            float e = fabsf(e4m3_to_f32(c[r * STRIDE + i]));
                            ms[g * rows + r] += ax[g * n + i] * e;
                            my[g * n + i] += aw[g * rows + r] * e;
                        }
                    }
                for (int r = 0; r < nq * rows; r++)
                    assert_true(fabsf(s0[r] - s1[r]) <= 1e-5f * ms[r]);
                memcpy(y0, x, sizeof(x));
                memcpy(y1, x, sizeof(x));
                cpu_qkern_scalar.e4m3_axpy(y0, w, nq, c, STRIDE, n, rows);
                cpu_qkern_avx512.e4m3_axpy(y1, w, nq, c, STRIDE, n, rows);
                for (int i = 0; i < NQ * XS; i++)
                    assert_true(fabsf(y0[i] - y1[i]) <= 1e-5f * my[i]);
            }
}

/* The AVX-512 softmax loops against the scalar ones: the max ignores
 * NaN, exp is within a few ulp of expf over the whole range down to
 * underflow, a NaN score stays NaN; and the group parameters convert the
 * same to the bit, consecutive or strided. */
static void test_softmax_and_param_loops(void **state)
{
    (void)state;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw"))
        skip();
    enum { N = 1000 };
    static float x[N], s0[N], s1[N], ps0[N], pb0[N], ps1[N], pb1[N];
    static uint16_t pr[4 * N];
    for (int i = 0; i < N; i++)
        x[i] = -110.0f * (frand() * 0.5f + 0.5f) + (i % 7 == 0 ? 100.0f : 0.0f);
    x[3] = NAN;
    for (int n = 1; n <= N; n += n < 40 ? 1 : 97) {
        float m0 = cpu_max_scalar(x, n), m1 = cpu_kern_avx512.max(x, n);
        assert_true(m0 == m1);
        memcpy(s0, x, sizeof(x));
        memcpy(s1, x, sizeof(x));
        float l0 = cpu_exp_sum_scalar(s0, m0, n), l1 = cpu_kern_avx512.exp_sum(s1, m1, n);
        for (int i = 0; i < n; i++) {
            if (i == 3) {
                assert_true(isnan(s0[i]) && isnan(s1[i]));
                continue;
            }
            assert_true(fabsf(s0[i] - s1[i]) <= 4e-7f * s0[i] + 1e-45f);
        }
        assert_true(n > 3 ? isnan(l1) : fabsf(l0 - l1) <= 1e-6f * l0);
        for (int i = n; i < N; i++) /* nothing past n */
            assert_true(s1[i] == x[i] || (isnan(s1[i]) && isnan(x[i])));
    }
    for (int i = 0; i < 4 * N; i++)
        pr[i] = f32_to_f16(frand() * (i % 2 ? 8.0f : 0.5f));
    for (int kind = BE_KVQ_AFFINE_SHIFT; kind <= BE_KVQ_AFFINE_ZERO; kind++)
        for (size_t step = 2; step <= 4; step += 2)
            for (int n = 1; n <= 2 * N / (int)step; n += 37) {
                cpu_qkern_scalar.params(ps0, pb0, pr, step, n, (enum be_kvq_codes)kind);
                cpu_qkern_avx512.params(ps1, pb1, pr, step, n, (enum be_kvq_codes)kind);
                assert_memory_equal(ps0, ps1, (size_t)n * sizeof(float));
                assert_memory_equal(pb0, pb1, (size_t)n * sizeof(float));
            }
}

/* e4m3: every code decodes to the value its fields say, and encoding is
 * round-to-nearest-even with saturation. */
static void test_e4m3_codec(void **state)
{
    (void)state;
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        if ((c & 0x7f) == 0x7f)
            continue; /* NaN: never written */
        double want = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
        if (c & 0x80)
            want = -want;
        assert_true(e4m3_to_f32((uint8_t)c) == (float)want);
        assert_int_equal(f32_to_e4m3((float)want), (c == 0x80) ? 0x80 : c);
    }
    assert_int_equal(f32_to_e4m3(1000.0f), 0x7e);
    assert_int_equal(f32_to_e4m3(-1000.0f), 0xfe);
    assert_int_equal(f32_to_e4m3(1.0625f), 0x38);  /* tie between 1 and 1.125: even mantissa */
    assert_int_equal(f32_to_e4m3(1.1875f), 0x3a);  /* tie between 1.125 and 1.25: even */
    assert_int_equal(f32_to_e4m3(0x1p-10f), 0x00); /* half the smallest subnormal: even (zero) */
    assert_int_equal(f32_to_e4m3(0x1.8p-10f), 0x01);
}

/* ---- the oracle's C side ------------------------------------------------------ */

/* IN: int32 backend, nbits, axis_key, axis_value, group, H, D, T, n; then
 * f32 k[n][H*D], v[n][H*D].  OUT: f32 dequantized k, v rows; u8 codes k, v
 * [H][n][D]; f32 (scale, zero) pairs of k, v in layout order (for fp8 the
 * two tensor scales). */
static int codec_main(const char *in_path, const char *out_path)
{
    FILE *in = fopen(in_path, "rb"), *out = fopen(out_path, "wb");
    int32_t h[9];
    if (!in || !out || fread(h, sizeof(h), 1, in) != 1) {
        fprintf(stderr, "test_quant --codec: cannot read %s or write %s\n", in_path, out_path);
        return 2;
    }
    struct kv_quant_params p = params((enum kv_quant_backend)h[0], h[1], h[2], h[3], h[4], 128);
    int H = h[5], D = h[6], T = h[7], n = h[8];
    struct be_kvq_format f;
    struct kvq_error e;
    if (kvq_format_init(&f, &p, H, D, T, &e) != TIER_OK || n < 1 || n > T) {
        fprintf(stderr, "test_quant --codec: %s: %s\n", e.param, e.msg);
        return 2;
    }
    size_t rows = (size_t)n * (size_t)H * (size_t)D;
    float *k = malloc(rows * sizeof(float)), *v = malloc(rows * sizeof(float));
    float *k2 = malloc(rows * sizeof(float)), *v2 = malloc(rows * sizeof(float));
    void *blk = calloc(1, f.block_bytes);
    if (!k || !v || !k2 || !v2 || !blk || fread(k, sizeof(float), rows, in) != rows ||
        fread(v, sizeof(float), rows, in) != rows)
        return 2;
    float sk = kvq_e4m3_scale(k, rows), sv = kvq_e4m3_scale(v, rows);
    kvq_quantize(&f, blk, 0, n, k, v, (size_t)H * (size_t)D, sk, sv);
    kvq_dequantize(&f, blk, 0, n, k2, v2, (size_t)H * (size_t)D, sk, sv);
    fwrite(k2, sizeof(float), rows, out);
    fwrite(v2, sizeof(float), rows, out);
    const struct be_kvq_half *halves[2] = {&f.k, &f.v};
    for (int part = 0; part < 2; part++)
        for (int kvh = 0; kvh < H; kvh++)
            for (int t = 0; t < n; t++)
                for (int d = 0; d < D; d++) {
                    const uint8_t *row = kvq_code_row(&f, halves[part], blk, kvh, t);
                    uint8_t c = (uint8_t)kvq_code_get(row, f.nbits, d);
                    fwrite(&c, 1, 1, out);
                }
    for (int part = 0; part < 2; part++) {
        const struct be_kvq_half *hf = halves[part];
        if (f.kind == BE_KVQ_E4M3) {
            float s = part ? sv : sk;
            fwrite(&s, sizeof(float), 1, out);
            continue;
        }
        for (int kvh = 0; kvh < H; kvh++)
            for (int gr = 0; gr < (n + hf->gt - 1) / hf->gt; gr++)
                for (int gc = 0; gc < D / hf->gd; gc++) {
                    const uint16_t *pr = kvq_group_params(&f, hf, blk, kvh, gr, gc);
                    float sz[2] = {f16_to_f32(pr[0]), f16_to_f32(pr[1])};
                    fwrite(sz, sizeof(float), 2, out);
                }
    }
    free(k);
    free(v);
    free(k2);
    free(v2);
    free(blk);
    fclose(in);
    return fclose(out) == 0 ? 0 : 2;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "--codec") == 0)
        return codec_main(argv[2], argv[3]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_defaults),
        cmocka_unit_test(test_validation_errors),
        cmocka_unit_test(test_memory_per_token),
        cmocka_unit_test(test_format_errors),
        cmocka_unit_test(test_round_trip_bounds),
        cmocka_unit_test(test_e4m3_codec),
        cmocka_unit_test(test_residual_counting),
        cmocka_unit_test(test_update_in_parts),
        cmocka_unit_test(test_reserve_all_or_nothing),
        cmocka_unit_test(test_code_loops),
        cmocka_unit_test(test_softmax_and_param_loops),
        cmocka_unit_test(test_attention_levels),
    };
    rng_state = 0x9e3779b97f4a7c15ull;
    return cmocka_run_group_tests(tests, setup_levels, teardown_levels);
}
