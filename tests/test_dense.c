/* Description: dense export and import of a sequence's KV (tiers/dense.c)
 * under a real forward pass: kv_seq_layer_dense returns the rows attention
 * reads (read back through the view's blocks), and a fresh dynamic
 * sequence filled by kv_seq_import_dense with an export continues with
 * bit-identical logits, on full and sliding models (Mistral all sliding,
 * Qwen2 hybrid) and under the sliding_window strategy; a quantized cache
 * exports dequantized (layer 0's residual rows equal a dense run's exactly,
 * its quantized rows stay within the int8 bound) and its import into a
 * dynamic sequence holds exactly the export; its stored form (the raw
 * export), decoded by the documented rule, is the dequantized export bit
 * for bit.  An import the device cannot take goes to the host tier and
 * continues the same.  Refusals leave the sequence fresh.  The models are
 * random ones from tools/mkmodel.py (skip without).
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

#include "model/model.h"
#include "tests/rig.h"
#include "tiers/quant.h"
#include "util/half.h"

#define N_PROMPT 20
#define N_GEN 24


enum { M_LLAMA, M_MISTRAL, M_QWEN2, N_MODELS };
static const char *const model_args[N_MODELS] = {[M_LLAMA] = RIG_LLAMA, [M_MISTRAL] = RIG_MISTRAL, [M_QWEN2] = RIG_QWEN2};

static void prompt(int32_t *ids)
{
    for (int i = 0; i < N_PROMPT; i++)
        ids[i] = (int32_t)((i * 37 + 3) % 300 + 4);
}

static size_t layer_elems(const struct rig *r, int64_t rows)
{
    return (size_t)r->g.n_kv_heads * (size_t)rows * (size_t)r->g.head_dim;
}

/* Every layer of q, f32: k[l], v[l] (caller frees), rows[l]. */
static void export_all(struct rig *r, kv_seq *q, float **k, float **v, int64_t *rows)
{
    for (int l = 0; l < r->g.n_layers; l++) {
        rows[l] = kv_seq_layer_rows(q, l);
        k[l] = malloc(layer_elems(r, rows[l]) * sizeof(float));
        v[l] = malloc(layer_elems(r, rows[l]) * sizeof(float));
        assert_true(k[l] && v[l]);
        assert_int_equal(kv_seq_layer_dense(q, l, BE_F32, k[l], v[l]), TIER_OK);
    }
}

static void free_all(struct rig *r, float **k, float **v)
{
    for (int l = 0; l < r->g.n_layers; l++) {
        free(k[l]);
        free(v[l]);
    }
}

/* After a prefill and a few decode steps, each layer's export is the view's
 * [lo, hi) rows read through the backend's copies (as attention reads
 * them), head by head; sliding layers hold W-1 rows. */
static void test_dense_is_the_view(void **state)
{
    (void)state;
    for (int which = 0; which < N_MODELS; which++) {
        struct rig r;
        rig_open(&r, which, NULL);
        kv_seq *q;
        assert_int_equal(kv_seq_create(r.store, NULL, &q), TIER_OK);
        float *row = malloc((size_t)r.V * sizeof(float));
        int32_t ids[N_PROMPT + 3];
        prompt(ids);
        feed(&r, q, ids, N_PROMPT, row);
        for (int i = 0; i < 3; i++) {
            ids[N_PROMPT + i] = argmax_f32(row, r.V);
            feed(&r, q, &ids[N_PROMPT + i], 1, row);
        }
        int bt = kv_store_block_tokens(r.store), D = r.g.head_dim;
        float *k[8], *v[8], *blk = malloc((size_t)bt * D * sizeof(float));
        int64_t rows[8];
        export_all(&r, q, k, v, rows);
        for (int l = 0; l < r.g.n_layers; l++) {
            struct be_kv_view view;
            kv_seq_view(q, l, &view);
            int w = r.g.layer_window[l];
            assert_int_equal(rows[l], w ? w - 1 : N_PROMPT + 3);
            assert_int_equal(rows[l], view.hi - view.lo);
            for (int64_t p = view.lo; p < view.hi; p++)
                for (int h = 0; h < r.g.n_kv_heads; h++)
                    for (int half = 0; half < 2; half++) {
                        int64_t rel = p - view.base;
                        const char *src = (const char *)view.blocks[rel / bt] + (half ? view.v_offset : 0) +
                                          ((size_t)h * bt + (size_t)(rel % bt)) * D * sizeof(float);
                        assert_int_equal(be_copy(r.be, blk, src, D * sizeof(float), BE_D2H), BE_OK);
                        const float *got = (half ? v[l] : k[l]) + ((size_t)h * rows[l] + (p - view.lo)) * D;
                        if (memcmp(got, blk, D * sizeof(float)))
                            fail_msg("model %d layer %d head %d pos %lld: export differs", which, l, h,
                                     (long long)p);
                    }
        }
        free_all(&r, k, v);
        free(blk);
        free(row);
        kv_seq_free(q);
        rig_close(&r);
    }
}

/* Imports k/v (the export of a sequence after the prompt) into a fresh
 * dynamic sequence created with p; with no_device, every device
 * allocation fails meanwhile, so that the import goes to the host tier. */
static kv_seq *import(struct rig *r, const struct kv_seq_params *p, float **k, float **v, bool no_device)
{
    kv_seq *q;
    assert_int_equal(kv_seq_create(r->store, p, &q), TIER_OK);
    for (int l = 0; l < r->g.n_layers; l++)
        assert_int_equal(kv_seq_layer_rows(q, l), 0);
    if (no_device)
        be_fault_dev_alloc(r->be, 1, true);
    enum tier_status st = kv_seq_import_dense(q, N_PROMPT, BE_F32, (const void *const *)k, (const void *const *)v);
    be_fault_dev_alloc(r->be, 0, false);
    if (st != TIER_OK)
        fail_msg("import: %s: %s", tier_strerror(st), kv_store_errmsg(r->store));
    assert_int_equal(kv_seq_length(q), N_PROMPT);
    struct kv_seq_stats ks = kv_seq_stats(q);
    assert_int_equal(ks.fallback, no_device ? KV_FALLBACK_OOM : KV_FALLBACK_NONE);
    assert_int_equal(ks.strategy, no_device ? KV_OFFLOADED : KV_DYNAMIC);
    if (no_device)
        assert_int_equal(ks.dev_bytes, 0);
    return q;
}

/* The original continues greedily from its prompt; the import of its
 * export, fed the same tokens, gives bit-identical logits at every step.
 * into: NULL imports into r's store; else a fresh rig of the same model
 * whose device allocations all fail during the import (its pool has no
 * block yet), so that the import goes to the host tier and continues
 * from there. */
static void continue_identical(struct rig *r, const struct kv_seq_params *p, struct rig *into, const char *what)
{
    kv_seq *a;
    assert_int_equal(kv_seq_create(r->store, p, &a), TIER_OK);
    float *row = malloc((size_t)r->V * sizeof(float)), *row2 = malloc((size_t)r->V * sizeof(float));
    int32_t ids[N_PROMPT], toks[N_GEN];
    prompt(ids);
    feed(r, a, ids, N_PROMPT, row);
    float *k[8], *v[8];
    int64_t rows[8];
    export_all(r, a, k, v, rows);
    for (int l = 0; l < r->g.n_layers; l++)
        assert_int_equal(rows[l], kv_store_dense_rows(r->store, p, l, N_PROMPT));
    kv_seq *b = import(into ? into : r, p, k, v, into != NULL);
    for (int i = 0; i < N_GEN; i++) {
        toks[i] = argmax_f32(row, r->V);
        feed(r, a, &toks[i], 1, row);
        feed(into ? into : r, b, &toks[i], 1, row2);
        if (memcmp(row, row2, (size_t)r->V * sizeof(float)))
            fail_msg("%s%s: logits of the imported sequence differ at step %d", what, into ? " (host tier)" : "", i);
    }
    free_all(r, k, v);
    free(row);
    free(row2);
    kv_seq_free(a);
    kv_seq_free(b);
}

static void test_import_continues(void **state)
{
    (void)state;
    static const char *const names[N_MODELS] = {"llama", "mistral (sliding)", "qwen2 (hybrid)"};
    for (int which = 0; which < N_MODELS; which++) {
        struct rig r, fresh;
        rig_open(&r, which, NULL);
        /* llama also under the sliding_window strategy */
        const struct kv_seq_params ps[2] = {{.strategy = KV_DYNAMIC}, {.strategy = KV_DYNAMIC, .window_length = 6}};
        const char *const what[2] = {names[which], "llama, window_length 6"};
        for (int i = 0; i < (which == M_LLAMA ? 2 : 1); i++) {
            continue_identical(&r, &ps[i], NULL, what[i]);
            rig_open(&fresh, which, NULL);
            continue_identical(&r, &ps[i], &fresh, what[i]);
            rig_close(&fresh);
        }
        rig_close(&r);
    }
}

/* A quantized cache (quanto int8, residual 8, so the prompt is mostly
 * quantized) exports dequantized: layer 0's K and V depend on the prompt
 * alone, so its residual rows equal a dense run's bit for bit and its
 * quantized rows are within int8's error (1% of the layer's largest
 * magnitude).  Imported into a dynamic sequence, the export reads back
 * bit for bit, and its next logits are close to the quantized sequence's
 * (attention over the same numbers, decoded in registers there). */
static void test_quantized_export(void **state)
{
    (void)state;
    struct rig r;
    rig_open(&r, M_LLAMA, NULL);
    struct kv_seq_params qp = {.strategy = KV_QUANTIZED, .quant = kv_quant_defaults(KVQ_QUANTO)};
    qp.quant.nbits = 8;
    qp.quant.residual_length = 8;
    qp.quant.q_group_size = 16;
    kv_seq *qq, *dq;
    assert_int_equal(kv_seq_create(r.store, &qp, &qq), TIER_OK);
    assert_int_equal(kv_seq_create(r.store, NULL, &dq), TIER_OK);
    float *row = malloc((size_t)r.V * sizeof(float)), *row2 = malloc((size_t)r.V * sizeof(float));
    int32_t ids[N_PROMPT];
    prompt(ids);
    feed(&r, qq, ids, N_PROMPT, row);
    feed(&r, dq, ids, N_PROMPT, row2);
    float *k[8], *v[8], *dk[8], *dv[8];
    int64_t rows[8], drows[8];
    export_all(&r, qq, k, v, rows);
    export_all(&r, dq, dk, dv, drows);
    struct be_kvq_view qv;
    kv_seq_qview(qq, 0, &qv);
    assert_true(qv.hi - qv.lo > 0); /* something is quantized */
    assert_int_equal(rows[0], N_PROMPT);
    float amax = 0, err = 0;
    for (size_t i = 0; i < layer_elems(&r, N_PROMPT); i++) {
        amax = fmaxf(amax, fmaxf(fabsf(dk[0][i]), fabsf(dv[0][i])));
        int64_t pos = (int64_t)(i / r.g.head_dim) % N_PROMPT;
        if (pos >= qv.hi) { /* the residual */
            assert_true(k[0][i] == dk[0][i] && v[0][i] == dv[0][i]);
            continue;
        }
        err = fmaxf(err, fmaxf(fabsf(k[0][i] - dk[0][i]), fabsf(v[0][i] - dv[0][i])));
    }
    assert_true(err > 0.0f);
    if (err > 0.01f * amax)
        fail_msg("dequantized layer 0 off by %g (largest magnitude %g)", (double)err, (double)amax);
    kv_seq *b = import(&r, NULL, k, v, false);
    float *bk[8], *bv[8];
    int64_t brows[8];
    export_all(&r, b, bk, bv, brows);
    for (int l = 0; l < r.g.n_layers; l++) {
        assert_int_equal(brows[l], rows[l]);
        assert_memory_equal(bk[l], k[l], layer_elems(&r, rows[l]) * sizeof(float));
        assert_memory_equal(bv[l], v[l], layer_elems(&r, rows[l]) * sizeof(float));
    }
    int32_t t = argmax_f32(row, r.V);
    feed(&r, qq, &t, 1, row);
    feed(&r, b, &t, 1, row2);
    float lmax = 0, ldiff = 0;
    for (int i = 0; i < r.V; i++) {
        lmax = fmaxf(lmax, fabsf(row[i]));
        ldiff = fmaxf(ldiff, fabsf(row[i] - row2[i]));
    }
    if (ldiff > 1e-4f * lmax)
        fail_msg("logits after the import off by %g (largest %g)", (double)ldiff, (double)lmax);
    free_all(&r, k, v);
    free_all(&r, dk, dv);
    free_all(&r, bk, bv);
    free(row);
    free(row2);
    kv_seq_free(b);
    kv_seq_free(qq);
    kv_seq_free(dq);
    rig_close(&r);
}

/* Code d of a little-endian bit string of nbits-wide codes. */
static unsigned code_at(const uint8_t *row, int nbits, int d)
{
    unsigned c = 0;
    for (int b = 0; b < nbits; b++) {
        int bit = d * nbits + b;
        c |= (unsigned)(row[bit / 8] >> (bit % 8) & 1) << b;
    }
    return c;
}

/* The stored form (kv_seq_layer_quant_read) decoded by the rule docs/api.md
 * gives for the raw export equals the dequantized export bit for bit, on
 * every layer of a sliding model, for quanto per token and hqq per channel;
 * a dense sequence has no stored quantized form. */
static void test_quantized_stored_form(void **state)
{
    (void)state;
    struct rig r;
    rig_open(&r, M_MISTRAL, NULL);
    struct kv_quant_params qps[2] = {kv_quant_defaults(KVQ_QUANTO), kv_quant_defaults(KVQ_HQQ)};
    qps[0].q_group_size = 8;
    qps[0].residual_length = 4;
    qps[1].nbits = 2;
    qps[1].axis_key = 0;
    qps[1].q_group_size = 8;
    qps[1].residual_length = 4;
    int H = r.g.n_kv_heads, D = r.g.head_dim;
    for (int i = 0; i < 2; i++) {
        kv_seq *q;
        assert_int_equal(kv_seq_create(r.store, &(struct kv_seq_params){.strategy = KV_QUANTIZED, .quant = qps[i]},
                                       &q), TIER_OK);
        float *row = malloc((size_t)r.V * sizeof(float));
        int32_t ids[N_PROMPT + 5];
        prompt(ids);
        feed(&r, q, ids, N_PROMPT, row);
        for (int t = 0; t < 5; t++) {
            ids[N_PROMPT + t] = argmax_f32(row, r.V);
            feed(&r, q, &ids[N_PROMPT + t], 1, row);
        }
        float *k[8], *v[8];
        int64_t rows[8];
        export_all(&r, q, k, v, rows);
        for (int l = 0; l < r.g.n_layers; l++) {
            struct kv_quant_layer ql;
            assert_int_equal(kv_seq_layer_quant(q, l, &ql), TIER_OK);
            const struct be_kvq_format *f = ql.fmt;
            int64_t T = f->block_tokens;
            assert_true(ql.nq > ql.lo && ql.lo >= ql.first_block * T && ql.nq <= (ql.first_block + ql.n_blocks) * T);
            assert_int_equal(rows[l], ql.nq - ql.lo + ql.residual);
            uint8_t *blocks = malloc((size_t)ql.n_blocks * f->block_bytes + 1);
            float *rk = malloc(layer_elems(&r, ql.residual) * sizeof(float) + 1);
            float *rv = malloc(layer_elems(&r, ql.residual) * sizeof(float) + 1);
            assert_int_equal(kv_seq_layer_quant_read(q, l, blocks, rk, rv), TIER_OK);
            for (int half = 0; half < 2; half++) {
                const struct be_kvq_half *hf = half ? &f->v : &f->k;
                const float *want = half ? v[l] : k[l], *res = half ? rv : rk;
                for (int h = 0; h < H; h++)
                    for (int64_t p = ql.lo; p < ql.nq + ql.residual; p++)
                        for (int d = 0; d < D; d++) {
                            float x;
                            if (p >= ql.nq) {
                                x = res[((size_t)h * ql.residual + (size_t)(p - ql.nq)) * D + d];
                            } else {
                                int64_t rel = p - ql.first_block * T, t = rel % T;
                                const uint8_t *blk = blocks + (size_t)(rel / T) * f->block_bytes;
                                const uint8_t *crow = blk + hf->codes + ((size_t)h * T + t) * D * f->nbits / 8;
                                unsigned c = code_at(crow, f->nbits, d);
                                size_t pair = ((size_t)h * (T / hf->gt) + t / hf->gt) * (D / hf->gd) + d / hf->gd;
                                uint16_t pr[2];
                                memcpy(pr, blk + hf->params + pair * 4, 4);
                                float sc = f16_to_f32(pr[0]), z = f16_to_f32(pr[1]);
                                x = f->kind == BE_KVQ_AFFINE_SHIFT ? (float)c * sc - z : ((float)c - z) * sc;
                            }
                            float y = want[((size_t)h * rows[l] + (size_t)(p - ql.lo)) * D + d];
                            if (memcmp(&x, &y, sizeof(x)))
                                fail_msg("format %d layer %d %s head %d pos %lld dim %d: %g, export %g", i, l,
                                         half ? "V" : "K", h, (long long)p, d, (double)x, (double)y);
                        }
            }
            free(blocks);
            free(rk);
            free(rv);
        }
        free_all(&r, k, v);
        free(row);
        kv_seq_free(q);
    }
    kv_seq *dq;
    struct kv_quant_layer ql;
    assert_int_equal(kv_seq_create(r.store, NULL, &dq), TIER_OK);
    assert_int_equal(kv_seq_layer_quant(dq, 0, &ql), TIER_EINVAL);
    kv_seq_free(dq);
    rig_close(&r);
}

/* Layer l's stored form (kv_seq_layer_quant and _read), into in[l]. */
static void read_stored(kv_seq *q, int layers, struct kv_quant_layer_in *in)
{
    for (int l = 0; l < layers; l++) {
        struct kv_quant_layer *d = &in[l].d;
        assert_int_equal(kv_seq_layer_quant(q, l, d), TIER_OK);
        size_t res = (size_t)d->residual * (size_t)d->fmt->n_kv_heads * (size_t)d->fmt->head_dim * sizeof(float);
        void *b = malloc((size_t)d->n_blocks * d->fmt->block_bytes + 1), *k = malloc(res + 1), *v = malloc(res + 1);
        assert_non_null(b);
        assert_non_null(k);
        assert_non_null(v);
        assert_int_equal(kv_seq_layer_quant_read(q, l, b, k, v), TIER_OK);
        in[l].blocks = b;
        in[l].k = k;
        in[l].v = v;
    }
}

static void free_stored(int layers, struct kv_quant_layer_in *in)
{
    for (int l = 0; l < layers; l++) {
        free((void *)in[l].blocks);
        free((void *)in[l].k);
        free((void *)in[l].v);
    }
}

/* The stored form loaded back (kv_seq_load_quant) continues exactly as the
 * original: the logits of the next steps are bit-identical, for quanto, hqq
 * and fp8 on a model with sliding layers; damaged descriptions and params
 * are refused naming the field, creating nothing. */
static void test_quantized_load(void **state)
{
    (void)state;
    struct rig r;
    rig_open(&r, M_MISTRAL, NULL);
    struct kv_quant_params qps[3] = {kv_quant_defaults(KVQ_QUANTO), kv_quant_defaults(KVQ_HQQ),
                                     kv_quant_defaults(KVQ_FP8)};
    qps[0].q_group_size = 8;
    qps[0].residual_length = 4;
    qps[1].nbits = 2;
    qps[1].axis_key = 0;
    qps[1].q_group_size = 8;
    qps[1].residual_length = 4;
    int L = r.g.n_layers;
    assert_true(L <= 8);
    for (int i = 0; i < 3; i++) {
        struct kv_seq_params p = {.strategy = KV_QUANTIZED, .quant = qps[i]};
        kv_seq *q, *c;
        assert_int_equal(kv_seq_create(r.store, &p, &q), TIER_OK);
        float *row = malloc((size_t)r.V * sizeof(float)), *row2 = malloc((size_t)r.V * sizeof(float));
        int32_t ids[N_PROMPT + 10];
        prompt(ids);
        feed(&r, q, ids, N_PROMPT, row);
        for (int t = 0; t < 5; t++) {
            ids[N_PROMPT + t] = argmax_f32(row, r.V);
            feed(&r, q, &ids[N_PROMPT + t], 1, row);
        }
        int64_t len = N_PROMPT + 5;
        struct kv_quant_layer_in in[8];
        read_stored(q, L, in);
        assert_int_equal(kv_seq_load_quant(r.store, &p, len, in, &c), TIER_OK);
        struct kv_quant_layer_in back[8];
        read_stored(c, L, back);
        for (int l = 0; l < L; l++) {
            assert_int_equal(back[l].d.nq, in[l].d.nq);
            assert_memory_equal(back[l].blocks, in[l].blocks, (size_t)in[l].d.n_blocks * in[l].d.fmt->block_bytes);
        }
        free_stored(L, back);
        for (int t = 5; t < 10; t++) {
            ids[N_PROMPT + t] = argmax_f32(row, r.V);
            feed(&r, q, &ids[N_PROMPT + t], 1, row);
            feed(&r, c, &ids[N_PROMPT + t], 1, row2);
            if (memcmp(row, row2, (size_t)r.V * sizeof(float)))
                fail_msg("format %d step %d: the loaded sequence's logits differ", i, t);
        }
        kv_seq_free(c);

        /* damage: each refused with the field named, nothing created */
        static const struct {
            int layer, nq, first, res, nb, lo; /* added to the field */
            const char *field;
        } dmg[] = {{0, 100, 0, 0, 0, 0, "field nq"},       {1, 0, 0, -1, 0, 0, "field residual"},
                   {1, 0, 1, 0, 0, 0, "field n_blocks"}, {1, 0, 1, 0, -1, 0, "field qoff"},
                   {1, 0, 0, 0, 0, 1, "field lo"},       {1, 0, -1000, 0, 0, 0, "field first_block"}};
        for (size_t k = 0; k < sizeof(dmg) / sizeof(dmg[0]); k++) {
            struct kv_quant_layer *d = &in[dmg[k].layer].d, keep = *d;
            d->nq += dmg[k].nq;
            d->first_block += dmg[k].first;
            d->residual += dmg[k].res;
            d->n_blocks += dmg[k].nb;
            d->lo += dmg[k].lo;
            c = NULL;
            assert_int_equal(kv_seq_load_quant(r.store, &p, len, in, &c), TIER_EINVAL);
            assert_null(c);
            if (!strstr(kv_store_errmsg(r.store), dmg[k].field))
                fail_msg("format %d damage %zu: \"%s\" does not name %s", i, k, kv_store_errmsg(r.store),
                         dmg[k].field);
            *d = keep;
        }
        assert_int_equal(kv_seq_load_quant(r.store, &p, len + 1, in, &c), TIER_EINVAL);
        assert_non_null(strstr(kv_store_errmsg(r.store), "field residual"));
        struct kv_seq_params bad = p; /* blocks of another layout than the params' */
        bad.quant = qps[i == 2 ? 0 : i];
        bad.quant.nbits = bad.quant.nbits == 2 ? 4 : 2;
        assert_int_equal(kv_seq_load_quant(r.store, &bad, len, in, &c), TIER_EINVAL);
        assert_null(c);
        assert_non_null(strstr(kv_store_errmsg(r.store), "field fmt"));
        bad = p;
        bad.strategy = KV_DYNAMIC;
        assert_int_equal(kv_seq_load_quant(r.store, &bad, len, in, &c), TIER_EINVAL);
        assert_non_null(strstr(kv_store_errmsg(r.store), "params"));
        /* a device OOM that kv_seq_load would answer in the host tier */
        be_fault_dev_alloc(r.be, 1, false);
        assert_int_equal(kv_seq_load_quant(r.store, &p, len, in, &c), TIER_ENOMEM_DEV);
        be_fault_dev_alloc(r.be, 0, false);
        assert_null(c);
        assert_non_null(strstr(kv_store_errmsg(r.store), "does not fit the device budget"));
        assert_int_equal(kv_seq_load_quant(r.store, &p, len, in, &c), TIER_OK);
        kv_seq_free(c);
        free_stored(L, in);
        free(row);
        free(row2);
        kv_seq_free(q);
    }
    rig_close(&r);
}

/* Refusals: a sequence that is not fresh or not dynamic, 0 tokens; the
 * sequence is unchanged after each, and a failed reserve (device budget,
 * a sequence that may not fall back to the host tier) leaves it fresh. */
static void test_import_refusals(void **state)
{
    (void)state;
    struct rig r;
    rig_open(&r, M_LLAMA, NULL);
    size_t n = layer_elems(&r, N_PROMPT);
    float *k[2], *v[2];
    for (int l = 0; l < 2; l++) {
        k[l] = calloc(n, sizeof(float));
        v[l] = calloc(n, sizeof(float));
        assert_true(k[l] && v[l]);
    }
    const void *const *K = (const void *const *)k, *const *Vv = (const void *const *)v;
    kv_seq *q;
    assert_int_equal(kv_seq_create(r.store, &(struct kv_seq_params){.strategy = KV_STATIC, .max_cache_len = 64}, &q),
                     TIER_OK);
    assert_int_equal(kv_seq_import_dense(q, N_PROMPT, BE_F32, K, Vv), TIER_EINVAL);
    assert_non_null(strstr(kv_store_errmsg(r.store), "fresh dynamic"));
    kv_seq_free(q);
    assert_int_equal(kv_seq_create(r.store, &(struct kv_seq_params){.no_fallback = true}, &q), TIER_OK);
    assert_int_equal(kv_seq_import_dense(q, 0, BE_F32, K, Vv), TIER_EINVAL);
    assert_int_equal(kv_seq_length(q), 0);
    be_fault_dev_alloc(r.be, 1, true);
    assert_int_equal(kv_seq_import_dense(q, N_PROMPT, BE_F32, K, Vv), TIER_ENOMEM_DEV);
    be_fault_dev_alloc(r.be, 0, false);
    assert_int_equal(kv_seq_length(q), 0);
    assert_int_equal(kv_seq_stats(q).strategy, KV_DYNAMIC);
    assert_int_equal(kv_store_stats(r.store).fallbacks, 0);
    assert_int_equal(kv_seq_import_dense(q, N_PROMPT, BE_F32, K, Vv), TIER_OK);
    assert_int_equal(kv_seq_import_dense(q, N_PROMPT, BE_F32, K, Vv), TIER_EINVAL); /* not fresh */
    assert_int_equal(kv_seq_length(q), N_PROMPT);
    kv_seq_free(q);
    for (int l = 0; l < 2; l++) {
        free(k[l]);
        free(v[l]);
    }
    rig_close(&r);
}


int main(void)
{
    if (make_models(model_args, N_MODELS) != 0) {
        fprintf(stderr, "test_dense: tools/mkmodel.py failed (no torch?): skipping\n");
        cleanup();
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dense_is_the_view),
        cmocka_unit_test(test_import_continues),
        cmocka_unit_test(test_quantized_export),
        cmocka_unit_test(test_quantized_stored_form),
        cmocka_unit_test(test_quantized_load),
        cmocka_unit_test(test_import_refusals),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    cleanup();
    return rc;
}
