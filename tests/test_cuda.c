/* test_cuda.c - the CUDA backend's conformance, op by op, with the CPU
 * backend as the oracle: the same inputs go through both backends' seam
 * (be_copy in, the op, be_copy out) and the results are compared.
 *
 * Shapes: fixed edge cases (one token, one row, lengths around a KV block
 * and past attention's split of keys, head_dim 64/128/256, GQA 1/4/8, each
 * KV dtype, both RoPE layouts, windows, softcaps, sinks) and a few random
 * ones from a seed (KVTIER_TEST_SEED, printed).
 *
 * Tolerances, as max |device - oracle| / max(1, max |oracle|) per case:
 *   f32 activations (KVTIER_CUDA_ACT=f32): 1e-4 (the sums' order differs);
 *   bf16 activations (the default): 2e-2 (the output is rounded to bf16,
 *   2^-9 relative, and a GEMM's or attention's sums are ordered otherwise).
 * The oracle gets the device's inputs: rounded to bf16 when it computes
 * in bf16.  argmax must agree exactly.
 *
 * The devices under test: "cpu-strict" always, so the harness itself runs
 * (and can fail) on every machine; then "cuda" with f32 and with bf16
 * activations.  Without a GPU, driver or plugin the CUDA half is skipped:
 * the test prints "no CUDA device (why)" and exits 77 after the rest ran.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "tiers/quant.h"
#include "util/half.h"
#include "util/q4k.h"
#include "util/q8.h"

struct dut {
    const char *name;
    be_backend *be;
    enum be_dtype act;
    double tol;
};

static be_backend *oracle;
static struct dut *cur; /* the device under test */
static int failures, cases;
static uint64_t rng;

static double urand(void) /* [-1, 1) */
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / (double)(1ull << 52) - 1.0;
}

static int irand(int lo, int hi) /* [lo, hi] */
{
    return lo + (int)((urand() + 1.0) / 2.0 * (hi - lo + 1)) % (hi - lo + 1);
}

static float *randv(size_t n, float scale)
{
    float *x = malloc(n * sizeof(float));
    if (!x)
        abort();
    for (size_t i = 0; i < n; i++)
        x[i] = (float)urand() * scale;
    return x;
}

/* x as dt stores it */
static void round_to(enum be_dtype dt, float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] = dt == BE_BF16 ? bf16_to_f32(f32_to_bf16(x[i])) : dt == BE_F16 ? f16_to_f32(f32_to_f16(x[i])) : x[i];
}

static void must(enum be_status st, const char *what)
{
    if (st != BE_OK) {
        fprintf(stderr, "%s: %s: %s\n", cur ? cur->name : "the oracle", what, be_strerror(st));
        exit(1);
    }
}

static be_buffer *put_bytes(be_backend *be, const void *x, size_t bytes)
{
    be_buffer *b;
    must(be_dev_alloc(be, bytes, &b), "dev_alloc");
    must(be_copy(be, be_buffer_data(b), x, bytes, BE_H2D), "copy in");
    return b;
}

/* n values of x into a new device buffer of be, as dt */
static be_buffer *put(be_backend *be, enum be_dtype dt, const float *x, size_t n)
{
    size_t esz = be_dtype_size(dt);
    char *h = malloc(n * esz);
    if (!h)
        abort();
    for (size_t i = 0; i < n; i++) {
        if (dt == BE_F32)
            memcpy(h + i * 4, &x[i], 4);
        else {
            uint16_t v = dt == BE_BF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
            memcpy(h + i * 2, &v, 2);
        }
    }
    be_buffer *b = put_bytes(be, h, n * esz);
    free(h);
    return b;
}

static be_buffer *zeros(be_backend *be, size_t bytes)
{
    void *z = calloc(1, bytes);
    if (!z)
        abort();
    be_buffer *b = put_bytes(be, z, bytes);
    free(z);
    return b;
}

/* n values of dt out of b */
static void get(be_backend *be, be_buffer *b, enum be_dtype dt, size_t n, float *out)
{
    size_t esz = be_dtype_size(dt);
    char *h = malloc(n * esz);
    if (!h)
        abort();
    must(be_copy(be, h, be_buffer_data(b), n * esz, BE_D2H), "copy out");
    for (size_t i = 0; i < n; i++) {
        if (dt == BE_F32) {
            memcpy(&out[i], h + i * 4, 4);
        } else {
            uint16_t v;
            memcpy(&v, h + i * 2, 2);
            out[i] = dt == BE_BF16 ? bf16_to_f32(v) : f16_to_f32(v);
        }
    }
    free(h);
}

static void compare(const char *what, const float *want, const float *got, size_t n)
{
    double mag = 1.0, err = 0.0;
    size_t worst = 0;
    for (size_t i = 0; i < n; i++)
        mag = fmax(mag, fabs(want[i]));
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]);
        if (!(e <= err)) { /* NaN counts as the worst */
            err = isnan(e) ? INFINITY : e;
            worst = i;
        }
    }
    cases++;
    if (err / mag > cur->tol) {
        failures++;
        printf("FAIL %s %s: max error %.3g (tolerance %.3g x %.3g) at %zu: got %g, want %g\n", cur->name, what, err,
               cur->tol, mag, worst, got[worst], want[worst]);
    }
}

/* ---- ops ---------------------------------------------------------------------- */

/* The two backends' results of one op: run(be, act, out) on each. */
struct pair {
    float *want, *got;
};

static void check_matmul(enum be_dtype wt, int n, int in, int out, bool bias, enum be_dtype yt_dev)
{
    char what[128];
    snprintf(what, sizeof(what), "matmul w=%s n=%d in=%d out=%d bias=%d y=%s", be_dtype_name(wt), n, in, out, bias,
             be_dtype_name(yt_dev));
    float *x = randv((size_t)n * in, 1.0f), *w = randv((size_t)out * in, 0.2f), *b = randv((size_t)out, 0.5f);
    round_to(cur->act, x, (size_t)n * in);
    void *q = NULL; /* the quantized blocks, as GGUF lays them out */
    size_t qbytes = be_row_bytes(wt, (size_t)in) * (size_t)out;
    if (wt == BE_Q8_0 && (!(q = malloc(qbytes)) || !q8_0_quantize(w, q, (size_t)out * in)))
        abort();
    else if (wt == BE_Q4_K && (!(q = malloc(qbytes)) || !q4_k_quantize(w, q, (size_t)out * in)))
        abort();
    else if (!q)
        round_to(wt, w, (size_t)out * in);
    float *want = malloc((size_t)n * out * 4), *got = malloc((size_t)n * out * 4);
    be_backend *bes[2] = {oracle, cur->be};
    for (int k = 0; k < 2; k++) {
        be_backend *be = bes[k];
        enum be_dtype at = k ? cur->act : BE_F32, yt = k ? yt_dev : BE_F32;
        be_buffer *bx = put(be, at, x, (size_t)n * in);
        be_buffer *bw = q ? put_bytes(be, q, qbytes) : put(be, wt, w, (size_t)out * in);
        be_buffer *bb = put(be, BE_F32, b, (size_t)out);
        be_buffer *by = zeros(be, (size_t)n * out * be_dtype_size(yt));
        must(be_matmul(be, be_buffer_data(by), yt, be_buffer_data(bx), be_buffer_data(bw), wt,
                       bias ? be_buffer_data(bb) : NULL, n, in, out), what);
        get(be, by, yt, (size_t)n * out, k ? got : want);
        be_buffer_free(bx);
        be_buffer_free(bw);
        be_buffer_free(bb);
        be_buffer_free(by);
    }
    compare(what, want, got, (size_t)n * out);
    free(x), free(w), free(b), free(q), free(want), free(got);
}

static void test_matmul(void)
{
    const enum be_dtype wts[] = {BE_F32, BE_F16, BE_BF16, BE_Q8_0};
    const int shapes[][3] = {{1, 32, 1}, {1, 256, 130}, {3, 96, 77}, {8, 128, 64}, {17, 256, 255}, {64, 512, 384}};
    for (int w = 0; w < 4; w++)
        for (int s = 0; s < 6; s++) {
            check_matmul(wts[w], shapes[s][0], shapes[s][1], shapes[s][2], s % 2, cur->act);
            if (s == 2 || s == 5) /* logits: f32 out whatever the activations */
                check_matmul(wts[w], shapes[s][0], shapes[s][1], shapes[s][2], false, BE_F32);
        }
    /* 16-bit rows that are not whole 16-byte vectors take the element kernel */
    check_matmul(BE_BF16, 2, 100, 33, true, cur->act);
    check_matmul(BE_F16, 5, 36, 70, false, cur->act);
    for (int r = 0; r < 3; r++)
        check_matmul(wts[irand(0, 3)], irand(1, 40), 32 * irand(1, 12), irand(1, 300), r & 1, cur->act);
    /* Q4_K rows are whole super-blocks of 256 */
    const int q4k[][3] = {{1, 256, 1}, {1, 512, 130}, {3, 256, 77}, {8, 768, 64}, {17, 1024, 255}, {64, 512, 384}};
    for (int s = 0; s < 6; s++)
        check_matmul(BE_Q4_K, q4k[s][0], q4k[s][1], q4k[s][2], s % 2, s == 2 ? BE_F32 : cur->act);
}

/* Unary row and element ops: op(be, act, y, x[, x2]) over n values. */
enum unop { RMSNORM, LAYERNORM, SILU, GELU, GELU1, SCALE, ADD, SOFTMAX, RELU, GELU_ERF };

static void check_unary(enum unop op, int rows, int cols)
{
    static const char *names[] = {"rmsnorm", "layernorm", "silu_mul", "gelu_mul", "gelu", "scale", "add", "softmax",
                                  "relu", "gelu_erf"};
    char what[96];
    snprintf(what, sizeof(what), "%s %dx%d", names[op], rows, cols);
    size_t n = (size_t)rows * cols;
    float *x = randv(n, 3.0f), *x2 = randv(n, 2.0f), *w = randv((size_t)cols, 1.0f), *b = randv((size_t)cols, 0.5f);
    round_to(cur->act, x, n);
    round_to(cur->act, x2, n);
    float *want = malloc(n * 4), *got = malloc(n * 4);
    be_backend *bes[2] = {oracle, cur->be};
    for (int k = 0; k < 2; k++) {
        be_backend *be = bes[k];
        enum be_dtype at = k ? cur->act : BE_F32;
        be_buffer *bx = put(be, at, x, n), *bx2 = put(be, at, x2, n), *bw = put(be, BE_F32, w, (size_t)cols),
                  *bb = put(be, BE_F32, b, (size_t)cols);
        void *px = be_buffer_data(bx), *px2 = be_buffer_data(bx2);
        float *pw = be_buffer_data(bw), *pb = be_buffer_data(bb);
        enum be_status st = BE_OK;
        switch (op) { /* the norms write in place: y aliases x */
        case RMSNORM: st = be_rmsnorm(be, px, px, pw, rows, cols, 1e-6f); break;
        case LAYERNORM: st = be_layernorm(be, px, px, pw, pb, rows, cols, 1e-5f); break;
        case SILU: st = be_silu_mul(be, px, px, px2, n); break;
        case GELU: st = be_gelu_mul(be, px, px, px2, n); break;
        case GELU1: st = be_gelu_mul(be, px, px, NULL, n); break;
        case SCALE: st = be_scale(be, px, n, 0.37f); break;
        case ADD: st = be_add(be, px, px2, n); break;
        case SOFTMAX: st = be_softmax(be, px, rows, cols); break;
        case RELU: st = be_act(be, px, n, BE_ACT_RELU); break;
        case GELU_ERF: st = be_act(be, px, n, BE_ACT_GELU_ERF); break;
        }
        must(st, what);
        get(be, bx, at, n, k ? got : want);
        be_buffer_free(bx), be_buffer_free(bx2), be_buffer_free(bw), be_buffer_free(bb);
    }
    compare(what, want, got, n);
    free(x), free(x2), free(w), free(b), free(want), free(got);
}

static void test_rows(void)
{
    const int shapes[][2] = {{1, 1}, {1, 64}, {5, 896}, {3, 4096}, {2, 257}};
    for (int op = RMSNORM; op <= GELU_ERF; op++) {
        for (int s = 0; s < 5; s++)
            check_unary((enum unop)op, shapes[s][0], shapes[s][1]);
        check_unary((enum unop)op, irand(1, 9), irand(1, 3000));
    }
}

static void check_rope(enum be_rope_layout layout, int n_tok, int n_heads, int hd, int rot, float mscale)
{
    char what[128];
    snprintf(what, sizeof(what), "rope %s tok=%d heads=%d hd=%d rot=%d mscale=%g",
             layout == BE_ROPE_NEOX ? "neox" : "interleaved", n_tok, n_heads, hd, rot, mscale);
    size_t n = (size_t)n_tok * n_heads * hd;
    float *x = randv(n, 1.0f), *inv = malloc((size_t)rot / 2 * 4);
    int64_t *pos = malloc((size_t)n_tok * 8);
    round_to(cur->act, x, n);
    for (int i = 0; i < rot / 2; i++)
        inv[i] = powf(10000.0f, -2.0f * i / rot);
    for (int t = 0; t < n_tok; t++)
        pos[t] = t == 0 ? 0 : irand(0, 40000);
    float *want = malloc(n * 4), *got = malloc(n * 4);
    be_backend *bes[2] = {oracle, cur->be};
    for (int k = 0; k < 2; k++) {
        enum be_dtype at = k ? cur->act : BE_F32;
        be_buffer *bx = put(bes[k], at, x, n), *bi = put(bes[k], BE_F32, inv, (size_t)rot / 2);
        must(be_rope(bes[k], be_buffer_data(bx), n_tok, n_heads, hd, pos, be_buffer_data(bi), rot, mscale, layout),
             what);
        get(bes[k], bx, at, n, k ? got : want);
        be_buffer_free(bx), be_buffer_free(bi);
    }
    compare(what, want, got, n);
    free(x), free(inv), free(pos), free(want), free(got);
}

static void test_rope(void)
{
    const int hds[] = {64, 128, 256};
    for (int l = 0; l < 2; l++)
        for (int h = 0; h < 3; h++) {
            check_rope((enum be_rope_layout)l, 1, 1, hds[h], hds[h], 1.0f);
            check_rope((enum be_rope_layout)l, 7, 4, hds[h], hds[h] / 2, 1.2f);
        }
}

static void test_embed_argmax(void)
{
    const enum be_dtype dts[] = {BE_F32, BE_F16, BE_BF16};
    for (int d = 0; d < 3; d++) {
        int vocab = 50, dim = d == 2 ? 1 : 96, n = 5;
        float *table = randv((size_t)vocab * dim, 1.0f), *want = malloc((size_t)n * dim * 4),
              *got = malloc((size_t)n * dim * 4);
        int32_t ids[5] = {0, 49, 7, 7, 23};
        be_backend *bes[2] = {oracle, cur->be};
        for (int k = 0; k < 2; k++) {
            enum be_dtype at = k ? cur->act : BE_F32;
            be_buffer *bt = put(bes[k], dts[d], table, (size_t)vocab * dim), *by = zeros(bes[k], (size_t)n * dim * 4);
            must(be_embed(bes[k], be_buffer_data(by), be_buffer_data(bt), dts[d], ids, n, dim), "embed");
            get(bes[k], by, at, (size_t)n * dim, k ? got : want);
            be_buffer_free(bt), be_buffer_free(by);
        }
        char what[64];
        snprintf(what, sizeof(what), "embed %s dim=%d", be_dtype_name(dts[d]), dim);
        compare(what, want, got, (size_t)n * dim);
        free(table), free(want), free(got);
    }
    /* small integers, exact in bf16: ties, a NaN first, all NaN, one column */
    const int rows = 5, cols = 1000;
    float *x = malloc((size_t)rows * cols * 4);
    for (int i = 0; i < rows * cols; i++)
        x[i] = (float)irand(-50, 50);
    x[0] = NAN;
    x[1 * cols + 10] = x[1 * cols + 900] = 60.0f;
    for (int i = 0; i < cols; i++)
        x[2 * cols + i] = NAN;
    int32_t want[5], got[5];
    be_backend *bes[2] = {oracle, cur->be};
    for (int k = 0; k < 2; k++) {
        be_buffer *bx = put(bes[k], k ? cur->act : BE_F32, x, (size_t)rows * cols);
        must(be_argmax(bes[k], be_buffer_data(bx), rows, cols, k ? got : want), "argmax");
        must(be_argmax(bes[k], be_buffer_data(bx), 1, 1, k ? got + 4 : want + 4), "argmax");
        be_buffer_free(bx);
    }
    cases++;
    if (memcmp(want, got, sizeof(want)) != 0) {
        failures++;
        printf("FAIL %s argmax: got %d %d %d %d %d, want %d %d %d %d %d\n", cur->name, got[0], got[1], got[2], got[3],
               got[4], want[0], want[1], want[2], want[3], want[4]);
    }
    free(x);
}

static void fail_if(bool bad, const char *what)
{
    cases++;
    if (bad) {
        failures++;
        printf("FAIL %s %s\n", cur->name, what);
    }
}

/* ---- paged KV and attention ------------------------------------------------------ */

struct attn_case {
    int head_dim, n_kv, gqa;
    enum be_dtype kv;
    int lens[2];   /* two sequences in one batch */
    bool prefill;  /* every position queries (causal), else the last only */
    int window;
    float softcap;
    int sinks;     /* > 0: a key_rope view with this many sinks (f32 activations only) */
    bool bidir;    /* every key of the view visible to every query (an encoder) */
    int rel_span;  /* > 0: a T5 relative position bias of this span */
};

#define BT 16 /* tokens per block */

/* One backend's KV for the case: each sequence's blocks, filled by
 * be_kv_store from k, v [len, n_kv * D]. */
struct seq_kv {
    be_buffer *blocks[80], *sink;
    void *ptrs[80];
    int n_blocks;
    struct be_kv_view view;
};

static void fill_kv(be_backend *be, enum be_dtype at, const struct attn_case *c, const struct be_attn_params *p,
                    int s, const float *k, const float *v, struct seq_kv *q)
{
    int len = c->lens[s], D = c->head_dim;
    size_t esz = be_dtype_size(c->kv), half = (size_t)c->n_kv * BT * D * esz;
    int64_t base = c->sinks ? 20 + c->sinks : 0; /* with sinks: shift 20, the rest from index sinks on */
    q->n_blocks = (len + BT - 1) / BT;
    for (int b = 0; b < q->n_blocks; b++) {
        q->blocks[b] = zeros(be, 2 * half);
        q->ptrs[b] = be_buffer_data(q->blocks[b]);
    }
    q->view = (struct be_kv_view){.blocks = q->ptrs, .n_blocks = q->n_blocks, .block_tokens = BT, .v_offset = half,
                                  .base = base, .lo = base, .hi = base + len};
    struct be_tok toks[2048];
    for (int t = 0; t < len; t++)
        toks[t] = (struct be_tok){.view = 0, .pos = base + t};
    size_t row = (size_t)c->n_kv * D;
    be_buffer *bk = put(be, at, k, (size_t)len * row), *bv = put(be, at, v, (size_t)len * row);
    must(be_kv_store(be, &q->view, toks, len, be_buffer_data(bk), be_buffer_data(bv), p), "kv_store");
    be_buffer_free(bk), be_buffer_free(bv);
    q->sink = NULL;
    if (c->sinks) { /* the sinks' rows (the keys' first rows again) in a block of their own */
        q->sink = zeros(be, 2 * half);
        void *sp = be_buffer_data(q->sink);
        struct be_kv_view sv = {.blocks = &sp, .n_blocks = 1, .block_tokens = BT, .v_offset = half, .lo = 0,
                                .hi = c->sinks};
        for (int t = 0; t < c->sinks; t++)
            toks[t] = (struct be_tok){.view = 0, .pos = t};
        bk = put(be, at, k, (size_t)c->sinks * row);
        bv = put(be, at, v, (size_t)c->sinks * row);
        must(be_kv_store(be, &sv, toks, c->sinks, be_buffer_data(bk), be_buffer_data(bv), p), "kv_store sinks");
        be_buffer_free(bk), be_buffer_free(bv);
        q->view.key_rope = true;
        q->view.sinks = c->sinks;
        q->view.sink_block = sp;
        q->view.shift = 20;
    }
}

/* A key_rope table of rows rows (NEOX pairs): row j holds cos, sin of
 * j * inv_freq[i] at the pair's two slots. */
static float *rope_table(int64_t rows, int D)
{
    float *rope = malloc((size_t)rows * D * 4);
    if (!rope)
        abort();
    for (int64_t j = 0; j < rows; j++)
        for (int i = 0; i < D / 2; i++) {
            float a = (float)j * powf(10000.0f, -2.0f * i / D);
            rope[j * D + i] = cosf(a);
            rope[j * D + i + D / 2] = sinf(a);
        }
    return rope;
}

static void check_attention(const struct attn_case *c)
{
    char what[192];
    int D = c->head_dim, n_heads = c->n_kv * c->gqa;
    snprintf(what, sizeof(what),
             "attention hd=%d kv=%d gqa=%d %s lens=%d,%d %s window=%d softcap=%g sinks=%d bidir=%d rel_span=%d", D,
             c->n_kv, c->gqa, be_dtype_name(c->kv), c->lens[0], c->lens[1], c->prefill ? "prefill" : "decode",
             c->window, c->softcap, c->sinks, c->bidir, c->rel_span);
    size_t row = (size_t)c->n_kv * D;
    float *k[2], *v[2];
    struct be_tok toks[2048];
    int n_tok = 0;
    for (int s = 0; s < 2; s++) {
        k[s] = randv((size_t)c->lens[s] * row, 1.0f);
        v[s] = randv((size_t)c->lens[s] * row, 1.0f);
        round_to(cur->act, k[s], (size_t)c->lens[s] * row);
        round_to(cur->act, v[s], (size_t)c->lens[s] * row);
        int64_t base = c->sinks ? 20 + c->sinks : 0;
        for (int t = c->prefill ? 0 : c->lens[s] - 1; t < c->lens[s]; t++)
            toks[n_tok++] = (struct be_tok){.view = s, .pos = base + t};
    }
    size_t nq = (size_t)n_tok * n_heads * D;
    float *q = randv(nq, 1.0f), *want = malloc(nq * 4), *got = malloc(nq * 4);
    round_to(cur->act, q, nq);
    int64_t rows = c->lens[0] + c->lens[1] + c->sinks + 64;
    float *rope = rope_table(rows, D);
    size_t n_bias = (size_t)n_heads * (2 * (size_t)c->rel_span + 1);
    float *bias = randv(n_bias, 2.0f);
    be_backend *bes[2] = {oracle, cur->be};
    for (int b = 0; b < 2; b++) {
        be_backend *be = bes[b];
        enum be_dtype at = b ? cur->act : BE_F32;
        be_buffer *br = put(be, BE_F32, rope, (size_t)rows * D), *bb = put(be, BE_F32, bias, n_bias);
        struct be_attn_params p = {.n_heads = n_heads, .n_kv_heads = c->n_kv, .head_dim = D,
                                   .scale = 1.0f / sqrtf((float)D), .softcap = c->softcap, .window = c->window,
                                   .kv_dtype = c->kv, .key_rope = c->sinks ? be_buffer_data(br) : NULL,
                                   .key_rope_rows = rows, .key_rope_layout = BE_ROPE_NEOX, .bidirectional = c->bidir,
                                   .rel_bias = c->rel_span ? be_buffer_data(bb) : NULL, .rel_span = c->rel_span};
        struct seq_kv kv[2];
        struct be_kv_view views[2];
        for (int s = 0; s < 2; s++) {
            fill_kv(be, at, c, &p, s, k[s], v[s], &kv[s]);
            views[s] = kv[s].view;
        }
        be_buffer *bq = put(be, at, q, nq), *bo = zeros(be, nq * 4);
        must(be_attention(be, be_buffer_data(bo), be_buffer_data(bq), views, toks, n_tok, &p), what);
        get(be, bo, at, nq, b ? got : want);
        be_buffer_free(bq), be_buffer_free(bo), be_buffer_free(br), be_buffer_free(bb);
        for (int s = 0; s < 2; s++) {
            for (int i = 0; i < kv[s].n_blocks; i++)
                be_buffer_free(kv[s].blocks[i]);
            be_buffer_free(kv[s].sink);
        }
    }
    compare(what, want, got, nq);
    free(k[0]), free(k[1]), free(v[0]), free(v[1]), free(q), free(want), free(got), free(rope), free(bias);
}

static void test_attention(void)
{
    const int hds[] = {64, 128, 256}, gqas[] = {1, 4, 8};
    const enum be_dtype kvs[] = {BE_F32, BE_F16, BE_BF16};
    for (int h = 0; h < 3; h++)
        for (int g = 0; g < 3; g++) {
            struct attn_case c = {.head_dim = hds[h], .n_kv = 2, .gqa = gqas[g], .kv = kvs[(h + g) % 3],
                                  .lens = {1, 17}, .prefill = true};
            check_attention(&c);
            c.lens[0] = 15, c.lens[1] = 600, c.prefill = false; /* decode past a split of keys */
            check_attention(&c);
        }
    struct attn_case edge[] = {
        {.head_dim = 128, .n_kv = 1, .gqa = 4, .kv = BE_BF16, .lens = {16, 100}, .prefill = true, .window = 32},
        {.head_dim = 64, .n_kv = 4, .gqa = 1, .kv = BE_F16, .lens = {300, 33}, .prefill = false, .softcap = 30.0f},
        {.head_dim = 128, .n_kv = 2, .gqa = 8, .kv = BE_F32, .lens = {1100, 1}, .prefill = false, .window = 700},
        {.head_dim = 64, .n_kv = 2, .gqa = 4, .kv = BE_F32, .lens = {40, 70}, .prefill = true, .sinks = 4},
        /* encoder-decoder: an encoder's bidirectional self-attention with T5's
         * bias, a decoder's causal one with it, cross-attention without */
        {.head_dim = 64, .n_kv = 4, .gqa = 1, .kv = BE_F32, .lens = {20, 300}, .prefill = true, .bidir = true,
         .rel_span = 12},
        {.head_dim = 64, .n_kv = 2, .gqa = 2, .kv = BE_BF16, .lens = {17, 40}, .prefill = true, .rel_span = 8},
        {.head_dim = 128, .n_kv = 2, .gqa = 1, .kv = BE_F16, .lens = {33, 600}, .prefill = false, .bidir = true},
    };
    for (size_t i = 0; i < sizeof(edge) / sizeof(edge[0]); i++)
        if (!edge[i].sinks || cur->act == BE_F32) /* the sinks' table is f32: f32 activations only, as in model.c */
            check_attention(&edge[i]);
    struct attn_case r = {.head_dim = 32 * irand(1, 4), .n_kv = irand(1, 3), .gqa = gqas[irand(0, 2)],
                          .kv = kvs[irand(0, 2)], .lens = {irand(1, 200), irand(1, 200)}, .prefill = irand(0, 1),
                          .window = irand(0, 1) * irand(1, 64)};
    check_attention(&r);
}

/* ---- quantized KV ---------------------------------------------------------------- */

struct kvq_case {
    enum kv_quant_backend backend;
    int nbits, axis_key, axis_value, group;
    enum be_dtype kv; /* the full-precision rest's */
    int head_dim, n_kv, gqa, window;
    bool rope;        /* keys stored before RoPE (f32 activations only) */
};

/* One backend's quantized sequence: the rest (every position written by
 * be_kv_store, the view reading [hi, n) of it) and the quantized blocks. */
struct qseq {
    be_buffer *rest[16], *qblocks[16];
    void *rest_ptrs[16], *qptrs[16];
    int n_rest, n_q;
    struct be_kvq_view view;
};

static void qseq_free(struct qseq *s)
{
    for (int i = 0; i < s->n_rest; i++)
        be_buffer_free(s->rest[i]);
    for (int i = 0; i < s->n_q; i++)
        be_buffer_free(s->qblocks[i]);
}

/* The bytes of the quantized blocks, one after the other. */
static unsigned char *qseq_bytes(be_backend *be, const struct qseq *s, size_t block_bytes)
{
    unsigned char *h = malloc((size_t)s->n_q * block_bytes);
    if (!h)
        abort();
    for (int i = 0; i < s->n_q; i++)
        must(be_copy(be, h + (size_t)i * block_bytes, s->qptrs[i], block_bytes, BE_D2H), "copy out");
    return h;
}

/* The same K, V through both backends: be_kv_absmax (fp8's scales), two
 * flushes (the second reopening a per-channel group row the first left
 * part filled), the blocks compared byte for byte, be_kvq_dequantize
 * compared exactly, be_kv_copy, and be_attention_quant over the quantized
 * part and the rest, beside a dense sequence in the same batch. */
static void check_kvq(const struct kvq_case *c)
{
    struct kv_quant_params qp = kv_quant_defaults(c->backend);
    if (c->backend != KVQ_FP8) {
        qp.nbits = c->nbits;
        qp.axis_key = c->axis_key;
        qp.axis_value = c->axis_value;
        qp.q_group_size = c->group;
    }
    int D = c->head_dim, H = c->n_kv, n_heads = H * c->gqa, T = kvq_block_tokens(&qp, BT);
    struct be_kvq_format f;
    struct kvq_error e;
    if (kvq_format_init(&f, &qp, H, D, T, &e) != TIER_OK) {
        printf("FAIL %s kvq case: %s\n", cur->name, e.msg);
        failures++;
        return;
    }
    char what[192];
    snprintf(what, sizeof(what), "kvq %s int%d gt=%d/%d gd=%d/%d hd=%d kv=%d gqa=%d %s window=%d rope=%d",
             kv_quant_backend_name(c->backend), f.nbits, f.k.gt, f.v.gt, f.k.gd, f.v.gd, D, H, c->gqa,
             be_dtype_name(c->kv), c->window, c->rope);
    int n = 3 * T + 5, n1 = T + 3, n2 = n - 7; /* flushes [0, n1) and [n1, n2); [n2, n) stays full precision */
    size_t row = (size_t)H * D, esz = be_dtype_size(c->kv), half = (size_t)H * BT * D * esz;
    float *k = randv((size_t)n * row, 1.0f), *v = randv((size_t)n * row, 1.0f);
    round_to(cur->act, k, (size_t)n * row);
    round_to(cur->act, v, (size_t)n * row);
    struct be_tok toks[64];
    int n_tok = 0;
    for (int64_t pos = n2 - 3; pos < n; pos++) /* queries on both sides of the quantized part's end */
        toks[n_tok++] = (struct be_tok){.view = 0, .pos = pos};
    toks[n_tok++] = (struct be_tok){.view = 1, .pos = n - 1}; /* the dense sequence */
    size_t nq = (size_t)n_tok * n_heads * D;
    float *q = randv(nq, 1.0f), *out[2], *deq[2];
    round_to(cur->act, q, nq);
    int64_t rows = n + 64;
    float *rope = rope_table(rows, D);
    unsigned char *bytes[2];
    float amax[2][2] = {{0}}, copied[2][2 * BT * 256]; /* H * D <= 256 in every case */
    be_backend *bes[2] = {oracle, cur->be};
    for (int b = 0; b < 2; b++) {
        be_backend *be = bes[b];
        enum be_dtype at = b ? cur->act : BE_F32;
        be_buffer *br = put(be, BE_F32, rope, (size_t)rows * D);
        struct be_attn_params p = {.n_heads = n_heads, .n_kv_heads = H, .head_dim = D,
                                   .scale = 1.0f / sqrtf((float)D), .window = c->window, .kv_dtype = c->kv,
                                   .key_rope = c->rope ? be_buffer_data(br) : NULL, .key_rope_rows = rows,
                                   .key_rope_layout = BE_ROPE_NEOX};
        struct qseq s = {.n_rest = (n + BT - 1) / BT, .n_q = (n + T - 1) / T};
        for (int i = 0; i < s.n_rest; i++) {
            s.rest[i] = zeros(be, 2 * half);
            s.rest_ptrs[i] = be_buffer_data(s.rest[i]);
        }
        for (int i = 0; i < s.n_q; i++) {
            s.qblocks[i] = zeros(be, f.block_bytes);
            s.qptrs[i] = be_buffer_data(s.qblocks[i]);
        }
        struct be_kv_view rest = {.blocks = s.rest_ptrs, .n_blocks = s.n_rest, .block_tokens = BT,
                                  .v_offset = half, .lo = 0, .hi = n, .key_rope = c->rope};
        struct be_tok st[256];
        for (int t = 0; t < n; t++)
            st[t] = (struct be_tok){.view = 0, .pos = t};
        be_buffer *bk = put(be, at, k, (size_t)n * row), *bv = put(be, at, v, (size_t)n * row);
        must(be_kv_store(be, &rest, st, n, be_buffer_data(bk), be_buffer_data(bv), &p), "kv_store");
        be_buffer_free(bk), be_buffer_free(bv);
        must(be_kv_absmax(be, &rest, c->kv, H, D, 0, n, amax[b]), "kv_absmax");

        s.view = (struct be_kvq_view){.fmt = &f, .blocks = s.qptrs, .n_blocks = s.n_q, .rest = rest,
                                      .rest_dtype = c->kv, .scale_k = 1.0f, .scale_v = 1.0f};
        if (f.kind == BE_KVQ_E4M3) { /* the oracle's scales on both, so the codes can agree */
            s.view.scale_k = amax[0][0] / BE_E4M3_MAX;
            s.view.scale_v = amax[0][1] / BE_E4M3_MAX;
        }
        s.view.rest.lo = 0;
        must(be_kvq_quantize(be, &s.view, n1), "kvq_quantize");
        s.view.hi = s.view.rest.lo = n1;
        must(be_kvq_quantize(be, &s.view, n2), "kvq_quantize again");
        s.view.hi = s.view.rest.lo = n2;
        bytes[b] = qseq_bytes(be, &s, f.block_bytes);

        /* the quantized part decoded into an f32 view */
        struct qseq d = {.n_rest = (n2 + BT - 1) / BT};
        size_t half32 = (size_t)H * BT * D * 4;
        for (int i = 0; i < d.n_rest; i++) {
            d.rest[i] = zeros(be, 2 * half32);
            d.rest_ptrs[i] = be_buffer_data(d.rest[i]);
        }
        struct be_kv_view dv = {.blocks = d.rest_ptrs, .n_blocks = d.n_rest, .block_tokens = BT, .v_offset = half32,
                                .lo = 0, .hi = n2};
        must(be_kvq_dequantize(be, &s.view, 0, n2, &dv), "kvq_dequantize");
        deq[b] = malloc((size_t)d.n_rest * 2 * half32);
        if (!deq[b])
            abort();
        for (int i = 0; i < d.n_rest; i++)
            get(be, d.rest[i], BE_F32, 2 * half32 / 4, deq[b] + (size_t)i * 2 * half32 / 4);

        /* rows [3, 9) of the rest copied into the first block of the decoded view (f32 when the rest is) */
        if (c->kv == BE_F32) {
            must(be_kv_copy(be, &dv, &rest, 3, 9, &p), "kv_copy");
            get(be, d.rest[0], BE_F32, 2 * half32 / 4, copied[b]);
        }
        qseq_free(&d);

        struct be_kvq_view views[2] = {s.view, {.rest = rest, .rest_dtype = c->kv}};
        be_buffer *bq = put(be, at, q, nq), *bo = zeros(be, nq * 4);
        must(be_attention_quant(be, be_buffer_data(bo), be_buffer_data(bq), views, toks, n_tok, &p), what);
        out[b] = malloc(nq * 4);
        if (!out[b])
            abort();
        get(be, bo, at, nq, out[b]);
        be_buffer_free(bq), be_buffer_free(bo), be_buffer_free(br);
        qseq_free(&s);
    }
    char sub[256];
    snprintf(sub, sizeof(sub), "%s: kv_absmax", what);
    fail_if(memcmp(amax[0], amax[1], sizeof(amax[0])) != 0, sub);
    snprintf(sub, sizeof(sub), "%s: kvq_quantize's blocks byte for byte", what);
    fail_if(memcmp(bytes[0], bytes[1], (size_t)((n + T - 1) / T) * f.block_bytes) != 0, sub);
    snprintf(sub, sizeof(sub), "%s: kvq_dequantize exactly", what);
    fail_if(memcmp(deq[0], deq[1], (size_t)((n2 + BT - 1) / BT) * 2 * H * BT * D * 4) != 0, sub);
    if (c->kv == BE_F32) {
        snprintf(sub, sizeof(sub), "%s: kv_copy", what);
        fail_if(memcmp(copied[0], copied[1], 2 * (size_t)H * BT * D * 4) != 0, sub);
    }
    compare(what, out[0], out[1], nq);
    for (int b = 0; b < 2; b++)
        free(bytes[b]), free(deq[b]), free(out[b]);
    free(k), free(v), free(q), free(rope);
}

static void test_kvq(void)
{
    const struct kvq_case all[] = {
        /* quanto: per-token groups of 64; K per channel, V per token; 2 bits */
        {.backend = KVQ_QUANTO, .nbits = 4, .axis_key = 0, .axis_value = 0, .group = 64, .kv = BE_BF16,
         .head_dim = 128, .n_kv = 2, .gqa = 4},
        {.backend = KVQ_QUANTO, .nbits = 2, .axis_key = -1, .axis_value = 0, .group = 32, .kv = BE_F32,
         .head_dim = 64, .n_kv = 2, .gqa = 1, .window = 40},
        /* hqq: 3 bits per token (codes across bytes), per channel both, 8 bits per token */
        {.backend = KVQ_HQQ, .nbits = 3, .axis_key = 1, .axis_value = 1, .group = 64, .kv = BE_F16,
         .head_dim = 64, .n_kv = 1, .gqa = 8},
        {.backend = KVQ_HQQ, .nbits = 4, .axis_key = 0, .axis_value = 0, .group = 16, .kv = BE_F32,
         .head_dim = 128, .n_kv = 2, .gqa = 4},
        {.backend = KVQ_HQQ, .nbits = 8, .axis_key = 1, .axis_value = 1, .group = 128, .kv = BE_BF16,
         .head_dim = 256, .n_kv = 1, .gqa = 4},
        {.backend = KVQ_HQQ, .nbits = 1, .axis_key = 1, .axis_value = 0, .group = 64, .kv = BE_F32,
         .head_dim = 64, .n_kv = 2, .gqa = 2},
        /* fp8 with its tensor scales */
        {.backend = KVQ_FP8, .kv = BE_F32, .head_dim = 64, .n_kv = 4, .gqa = 2},
        /* keys stored before RoPE (the sink strategy), rotated as they are read */
        {.backend = KVQ_QUANTO, .nbits = 4, .axis_key = 0, .axis_value = 0, .group = 32, .kv = BE_F32,
         .head_dim = 64, .n_kv = 2, .gqa = 2, .rope = true},
        {.backend = KVQ_HQQ, .nbits = 2, .axis_key = 0, .axis_value = 1, .group = 32, .kv = BE_F32,
         .head_dim = 128, .n_kv = 1, .gqa = 4, .rope = true},
    };
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        if (!all[i].rope || cur->act == BE_F32) /* the rotation table is f32: f32 activations only, as in model.c */
            check_kvq(&all[i]);
}

/* ---- state-space layers ---------------------------------------------------------- */

/* be_ssm_conv then be_ssm_scan over a batch of views (runs of lens[v] rows;
 * view 0 writes its state elsewhere, the others in place), as a Mamba
 * layer calls them: the outputs and the states after. */
static void check_ssm(int di, int N, int K, const int *lens, int n_views)
{
    char what[128];
    snprintf(what, sizeof(what), "ssm d_inner=%d d_state=%d d_conv=%d views=%d", di, N, K, n_views);
    int n_tok = 0;
    struct be_tok toks[64];
    for (int v = 0; v < n_views; v++)
        for (int i = 0; i < lens[v]; i++)
            toks[n_tok++] = (struct be_tok){.view = v, .pos = i};
    size_t sf = be_ssm_state_bytes(di, N, K) / sizeof(float), nx = (size_t)n_tok * di, nb = (size_t)n_tok * N;
    float *x = randv(nx, 1.0f), *dt = randv(nx, 2.0f), *B = randv(nb, 1.0f), *C = randv(nb, 1.0f);
    float *z = randv(nx, 1.0f), *cw = randv((size_t)di * K, 0.5f), *cb = randv((size_t)di, 0.5f);
    float *A = randv((size_t)di * N, 1.0f), *D = randv((size_t)di, 1.0f), *st0 = randv((size_t)n_views * sf, 0.5f);
    for (size_t i = 0; i < (size_t)di * N; i++)
        A[i] = -1.0f - fabsf(A[i]); /* -exp(A_log) */
    float *in[5] = {x, dt, B, C, z};
    size_t len[5] = {nx, nx, nb, nb, nx};
    for (int i = 0; i < 5; i++)
        round_to(cur->act, in[i], len[i]);
    size_t nout = 2 * nx + (size_t)n_views * sf;
    float *res[2];
    be_backend *bes[2] = {oracle, cur->be};
    for (int b = 0; b < 2; b++) {
        be_backend *be = bes[b];
        enum be_dtype at = b ? cur->act : BE_F32;
        be_buffer *bin[5], *bp[4], *bst[8], *bout = zeros(be, sf * sizeof(float));
        for (int i = 0; i < 5; i++)
            bin[i] = put(be, at, in[i], len[i]);
        bp[0] = put(be, BE_F32, cw, (size_t)di * K), bp[1] = put(be, BE_F32, cb, (size_t)di);
        bp[2] = put(be, BE_F32, A, (size_t)di * N), bp[3] = put(be, BE_F32, D, (size_t)di);
        struct be_ssm_view views[8];
        for (int v = 0; v < n_views; v++) {
            bst[v] = put(be, BE_F32, st0 + (size_t)v * sf, sf);
            views[v] = (struct be_ssm_view){.in = be_buffer_data(bst[v]),
                                            .out = v ? be_buffer_data(bst[v]) : be_buffer_data(bout)};
        }
        struct be_ssm_params p = {.d_inner = di, .d_state = N, .d_conv = K, .conv_w = be_buffer_data(bp[0]),
                                  .conv_b = be_buffer_data(bp[1]), .A = be_buffer_data(bp[2]),
                                  .D = be_buffer_data(bp[3])};
        be_buffer *yc = zeros(be, nx * 4), *ys = zeros(be, nx * 4);
        must(be_ssm_conv(be, be_buffer_data(yc), be_buffer_data(bin[0]), views, toks, n_tok, &p), "ssm_conv");
        must(be_ssm_scan(be, be_buffer_data(ys), be_buffer_data(yc), be_buffer_data(bin[1]), be_buffer_data(bin[2]),
                         be_buffer_data(bin[3]), be_buffer_data(bin[4]), views, toks, n_tok, &p),
             "ssm_scan");
        res[b] = malloc(nout * sizeof(float));
        if (!res[b])
            abort();
        get(be, yc, at, nx, res[b]);
        get(be, ys, at, nx, res[b] + nx);
        for (int v = 0; v < n_views; v++)
            get(be, v ? bst[v] : bout, BE_F32, sf, res[b] + 2 * nx + (size_t)v * sf);
        for (int i = 0; i < 5; i++)
            be_buffer_free(bin[i]);
        for (int i = 0; i < 4; i++)
            be_buffer_free(bp[i]);
        for (int v = 0; v < n_views; v++)
            be_buffer_free(bst[v]);
        be_buffer_free(bout), be_buffer_free(yc), be_buffer_free(ys);
    }
    compare(what, res[0], res[1], nout);
    free(res[0]), free(res[1]);
    for (int i = 0; i < 5; i++)
        free(in[i]);
    free(cw), free(cb), free(A), free(D), free(st0);
}

static void test_ssm(void)
{
    check_ssm(96, 16, 4, (const int[]){5, 1, 3}, 3); /* a prefill, a decode, another prefill */
    check_ssm(1536, 16, 4, (const int[]){1, 1}, 2);  /* mamba-130m's channels, two decodes */
    check_ssm(64, 8, 2, (const int[]){17}, 1);
}

/* ---- copies, events, memory ---------------------------------------------------------- */

/* A copy queued behind a kernel sees what the kernel wrote; an event
 * fences the copy streams; the budget and the injected fault refuse with
 * BE_ENOMEM_DEV, as the store's continuation expects. */
static void test_streams_memory(void)
{
    be_backend *be = cur->be;
    size_t n = 100000;
    float *x = randv(n, 1.0f), *want = malloc(n * 4), *got = malloc(n * 4);
    round_to(cur->act, x, n);
    for (size_t i = 0; i < n; i++)
        want[i] = x[i] * 0.5f; /* exact in bf16 too */
    size_t bytes = n * be_dtype_size(cur->act);
    be_buffer *d = put(be, cur->act, x, n), *h, *d2;
    must(be_host_alloc(be, bytes, &h), "host_alloc");
    must(be_dev_alloc(be, bytes, &d2), "dev_alloc");
    be_event *e0, *e1;
    must(be_event_create(be, &e0), "event_create");
    must(be_event_create(be, &e1), "event_create");
    must(be_scale(be, be_buffer_data(d), n, 0.5f), "scale");
    must(be_event_record(be, e0), "event_record");
    must(be_copy_async(be, be_buffer_data(h), be_buffer_data(d), bytes, BE_D2H), "copy_async d2h");
    must(be_event_record(be, e1), "event_record");
    must(be_event_sync(e1), "event_sync");
    double s = -1;
    enum be_status st = be_event_elapsed(e0, e1, &s);
    fail_if(!(st == BE_OK && s >= 0) && st != BE_ENOTSUP, "event_elapsed");
    /* back up through the other direction's stream, the compute stream waiting for it */
    must(be_copy_async(be, be_buffer_data(d2), be_buffer_data(h), bytes, BE_H2D), "copy_async h2d");
    must(be_event_record(be, e0), "event_record");
    must(be_event_wait(be, e0), "event_wait");
    must(be_scale(be, be_buffer_data(d2), n, 2.0f), "scale");
    get(be, d2, cur->act, n, got);
    for (size_t i = 0; i < n; i++)
        want[i] *= 2.0f;
    compare("scale, copy_async d2h, h2d, event_wait, scale", want, got, n);
    /* the compute stream's wait was timed: a figure once, then zero */
    double stall = -1, again = -1;
    must(be_sync(be), "sync");
    must(be_event_stall(e0, &stall), "event_stall");
    must(be_event_stall(e0, &again), "event_stall");
    fail_if(!(stall >= 0 && stall < 60 && again == 0), "event_stall: the wait's seconds, then 0");
    be_event_free(e0), be_event_free(e1), be_buffer_free(d), be_buffer_free(d2), be_buffer_free(h);

    be_buffer *b = NULL;
    fail_if(be_dev_alloc(be, be_mem_stats(be).dev_budget + 4096, &b) != BE_ENOMEM_DEV || b,
            "an allocation over the budget is BE_ENOMEM_DEV");
    be_fault_dev_alloc(be, 1, false);
    fail_if(be_dev_alloc(be, 4096, &b) != BE_ENOMEM_DEV, "the injected fault is BE_ENOMEM_DEV");
    fail_if(be_dev_alloc(be, 4096, &b) != BE_OK, "the allocation after the fault succeeds");
    be_buffer_free(b);
    free(x), free(want), free(got);
}

/* ---- driver ------------------------------------------------------------------- */

static void run_all(struct dut *d)
{
    cur = d;
    int before = failures, cases_before = cases;
    test_matmul();
    test_rows();
    test_rope();
    test_embed_argmax();
    test_attention();
    test_kvq();
    test_ssm();
    test_streams_memory();
    printf("%s (%s activations): %d cases, %d failed\n", d->name, be_dtype_name(d->act), cases - cases_before,
           failures - before);
}

int main(void)
{
    const char *seed = getenv("KVTIER_TEST_SEED");
    rng = seed && *seed ? strtoull(seed, NULL, 10) : 20261204;
    if (!rng)
        rng = 1;
    printf("seed %llu (KVTIER_TEST_SEED)\n", (unsigned long long)rng);
    struct be_params bp = {.n_threads = 2, .device_mem = (size_t)256 << 20};
    /* The oracle computes in f32 throughout: the avx512bf16 level rounds a
     * matmul's x and attention's q and weights to bf16, which the CUDA
     * backend's f32 activations do not.  The strict backend below runs at
     * the same level. */
    static const char *const exact[] = {"avx512vnni", "avx512", "avx2", "scalar"};
    for (int i = 0; i < 4 && !oracle; i++) {
        setenv("KVTIER_SIMD", exact[i], 1);
        if (be_open("cpu", &bp, &oracle) == BE_OK)
            printf("oracle: the CPU backend at its %s level\n", exact[i]);
    }
    if (!oracle) {
        fprintf(stderr, "the CPU oracle does not open\n");
        return 1;
    }
    /* the harness against the strict CPU backend: the same seam, host
     * access to its device memory faulting, so a copy the harness forgot
     * shows here, without a GPU */
    struct dut strict = {.name = "cpu-strict", .act = BE_F32, .tol = 1e-4};
    if (be_open("cpu-strict", &bp, &strict.be) != BE_OK) {
        fprintf(stderr, "cpu-strict does not open\n");
        return 1;
    }
    run_all(&strict);
    be_free(strict.be);

    char why[512] = "";
    static const char *const acts[] = {"f32", "bf16"};
    for (int a = 0; a < 2 && !why[0]; a++) {
        struct dut d = {.name = "cuda", .act = a ? BE_BF16 : BE_F32, .tol = a ? 2e-2 : 1e-4};
        setenv("KVTIER_CUDA_ACT", acts[a], 1);
        enum be_status st = be_open("cuda", &bp, &d.be);
        if (st != BE_OK) {
            snprintf(why, sizeof(why), "%s", *be_open_error() ? be_open_error() : be_strerror(st));
            break;
        }
        if (be_get_caps(d.be).act_dtype != d.act) {
            printf("FAIL cuda: KVTIER_CUDA_ACT=%s gave %s activations\n", acts[a],
                   be_dtype_name(be_get_caps(d.be).act_dtype));
            failures++;
        }
        run_all(&d);
        be_free(d.be);
    }
    be_free(oracle);
    printf("%d cases, %d failed\n", cases, failures);
    if (failures)
        return 1;
    /* skipped only where there is no GPU or no plugin: a plugin that loads
     * and then fails to open is a failure */
    if (why[0] && strncmp(why, "no CUDA device", 14) && strncmp(why, "no CUDA plugin", 14)) {
        printf("FAIL cuda: does not open: %s\n", why);
        return 1;
    }
    if (why[0]) {
        printf("%s: the CUDA half skipped\n", why);
        return 77;
    }
    return 0;
}
