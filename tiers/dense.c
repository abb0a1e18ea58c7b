/* dense.c - a sequence's KV as dense tensors and back: what the safetensors
 * export and import of a session read and write (kvstore.h "dense export
 * and import").
 *
 * NOTES
 * - Reading.  A layer's stored positions come in up to three parts, in the
 *   order attention reads them: the sinks (the sink strategy's sink block),
 *   the quantized blocks, the full-precision blocks.  kv_seq_qview describes
 *   all three for every strategy, so the reader walks that one view.  Device
 *   bytes reach the host only through be_copy (the strict backend faults on
 *   any other access); a streamed layer's blocks are host memory between
 *   steps and are read directly.  Quantized blocks are decoded by the
 *   backend (be_kvq_dequantize, the codec be_attention_quant reads with)
 *   one block at a time into a device buffer of one block, then read like
 *   a dense block.
 * - Writing.  The import is one step of the store's transaction: reserve
 *   every token, write each layer's rows through kv_seq_view exactly where
 *   the forward pass's be_kv_store would, commit.  The commit applies the
 *   sliding rule (kvstore.c invariant 1), so the positions of a sliding
 *   layer that the file does not hold are never written and dropped at
 *   once; a failure before the commit aborts, which returns the sequence to
 *   length 0 (all or nothing).  The peak is a one-step prefill's.  When the
 *   device budget refuses the step, the still empty sequence moves to the
 *   host tier (kv_seq_offload) and the step is redone there, as
 *   model_forward redoes a step; a streamed layer's view is host memory
 *   between steps and is written directly.
 * - The imported KV is never published in the prefix cache: it was computed
 *   elsewhere, so no other sequence's prompt may be served from it.  The
 *   step names no token ids (kv_seq_tokens), which stops the publishing.
 */
#include "tiers/kvstore_impl.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "util/half.h"

static float elem_get(const void *p, enum be_dtype dt, size_t i)
{
    switch (dt) {
    case BE_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    case BE_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case BE_F32: case BE_Q8_0: case BE_Q4_K: break; /* weight formats, never KV's */
    }
    return ((const float *)p)[i];
}

static void elem_put(void *p, enum be_dtype dt, size_t i, float x)
{
    switch (dt) {
    case BE_F16: ((uint16_t *)p)[i] = f32_to_f16(x); return;
    case BE_BF16: ((uint16_t *)p)[i] = f32_to_bf16(x); return;
    case BE_F32: case BE_Q8_0: case BE_Q4_K: break;
    }
    ((float *)p)[i] = x;
}

/* n elements from src (of st) into dst (of dt). */
static void convert(void *dst, enum be_dtype dt, const void *src, enum be_dtype st, size_t n)
{
    if (dt == st) {
        memcpy(dst, src, n * be_dtype_size(dt));
        return;
    }
    for (size_t i = 0; i < n; i++)
        elem_put(dst, dt, i, elem_get(src, st, i));
}

/* Where a run of stored rows lives: one block of bt tokens (K then V at
 * v_off), in host or device memory, of dtype dt. */
struct dense_blk {
    const char *data;
    int bt;
    size_t v_off;
    bool host;
    enum be_dtype dt;
};

/* The reader's state for one layer: the output [H, rows, D] halves and a
 * staging row run of the largest block. */
struct dense_out {
    kv_seq *q;
    char *k, *v;
    enum be_dtype dt;
    int64_t rows;
    void *stage;
};

/* Copies n stored rows of block b starting at its slot `slot` into output
 * rows [r, r + n) of every head, K and V. */
static enum tier_status read_run(struct dense_out *o, const struct dense_blk *b, int slot, int n, int64_t r)
{
    kv_store *s = o->q->s;
    int H = s->g.n_kv_heads, D = s->g.head_dim;
    size_t es = be_dtype_size(b->dt), oes = be_dtype_size(o->dt), elems = (size_t)n * (size_t)D;
    for (int half = 0; half < 2; half++)
        for (int h = 0; h < H; h++) {
            const char *src = b->data + (half ? b->v_off : 0) + ((size_t)h * (size_t)b->bt + (size_t)slot) * D * es;
            char *dst = (half ? o->v : o->k) + ((size_t)h * (size_t)o->rows + (size_t)r) * (size_t)D * oes;
            const void *from = src;
            if (!b->host) {
                enum be_status st = be_copy(s->be, o->stage, src, elems * es, BE_D2H);
                if (st != BE_OK)
                    return kv_fail(s, TIER_EIO, "reading KV rows from the device: %s", be_strerror(st));
                from = o->stage;
            }
            convert(dst, o->dt, from, b->dt, elems);
        }
    return TIER_OK;
}

/* Output rows from r on: positions [p0, p1) of a view's blocks, run by run. */
static enum tier_status read_view(struct dense_out *o, const struct be_kv_view *v, bool host, enum be_dtype dt,
                                  int64_t p0, int64_t p1, int64_t r)
{
    for (int64_t p = p0; p < p1;) {
        int64_t rel = p - v->base, bi = rel / v->block_tokens, slot = rel % v->block_tokens;
        int64_t n = v->block_tokens - slot < p1 - p ? v->block_tokens - slot : p1 - p;
        struct dense_blk b = {v->blocks[bi], v->block_tokens, v->v_offset, host, dt};
        enum tier_status st = read_run(o, &b, (int)slot, (int)n, r + (p - p0));
        if (st != TIER_OK)
            return st;
        p += n;
    }
    return TIER_OK;
}

/* The quantized positions [v->lo, v->hi), decoded block by block into a
 * device buffer of one block. */
static enum tier_status read_quant(struct dense_out *o, const struct be_kvq_view *v, int64_t r)
{
    kv_store *s = o->q->s;
    int64_t T = v->fmt->block_tokens;
    size_t half = (size_t)s->g.n_kv_heads * (size_t)T * (size_t)s->g.head_dim * sizeof(float);
    be_buffer *buf;
    enum tier_status st = kv_dev_alloc(s, 2 * half, "decoding quantized KV for an export", &buf);
    if (st != TIER_OK)
        return st;
    void *data = be_buffer_data(buf);
    for (int64_t b = v->lo / T; b * T < v->hi && st == TIER_OK; b++) {
        int64_t p0 = v->lo > b * T ? v->lo : b * T, p1 = v->hi < (b + 1) * T ? v->hi : (b + 1) * T;
        struct be_kv_view dst = {.blocks = &data, .n_blocks = 1, .block_tokens = (int)T, .v_offset = half,
                                 .base = b * T, .lo = p0, .hi = p1};
        enum be_status bs = be_kvq_dequantize(s->be, v, p0, p1, &dst);
        st = bs == BE_OK ? read_view(o, &dst, false, BE_F32, p0, p1, r + (p0 - v->lo))
                         : kv_fail(s, TIER_EIO, "decoding quantized KV: %s", be_strerror(bs));
    }
    kv_dev_free(s, buf, 2 * half);
    return st;
}

/* Rows of each part of a layer's view: sinks, quantized, full precision. */
static void layer_parts(const struct be_kvq_view *v, int64_t part[3])
{
    part[0] = v->rest.key_rope ? v->rest.sinks : 0;
    part[1] = v->fmt ? v->hi - v->lo : 0;
    part[2] = v->rest.hi - v->rest.lo;
}

int64_t kv_seq_layer_rows(const kv_seq *q, int layer)
{
    struct be_kvq_view v;
    int64_t part[3];
    kv_seq_qview(q, layer, &v);
    layer_parts(&v, part);
    return part[0] + part[1] + part[2];
}

enum tier_status kv_seq_layer_dense(kv_seq *q, int layer, enum be_dtype dtype, void *k, void *v)
{
    kv_store *s = q->s;
    s->err[0] = '\0';
    if (q->state)
        return kv_fail(s, TIER_ENOTSUP, "kv_seq_layer_dense: a state-space model has no K and V");
    if (layer < 0 || layer >= s->g.n_layers || !k || !v || (dtype != BE_F32 && dtype != s->g.dtype))
        return kv_fail(s, TIER_EINVAL, "kv_seq_layer_dense: layer %d of %d, dtype %s (f32 or the store's %s)",
                       layer, s->g.n_layers, be_dtype_name(dtype), be_dtype_name(s->g.dtype));
    if (q->pending)
        return kv_fail(s, TIER_EINVAL, "kv_seq_layer_dense inside a step");
    enum tier_status lst = kv_seq_fill(q, layer);
    if (lst != TIER_OK)
        return lst;
    if (kvq_seq_on_host(q))
        return kv_fail(s, TIER_ENOTSUP, "exporting a quantized sequence offloaded to the host tier");
    struct be_kvq_view qv;
    int64_t part[3];
    kv_seq_qview(q, layer, &qv);
    layer_parts(&qv, part);
    int64_t T = qv.fmt ? qv.fmt->block_tokens : 0, bt = s->bt > T ? s->bt : T;
    enum be_dtype rest_dt = s->g.dtype;
    struct dense_out o = {.q = q, .k = k, .v = v, .dt = dtype, .rows = part[0] + part[1] + part[2]};
    o.stage = malloc((size_t)bt * (size_t)s->g.head_dim * sizeof(float));
    if (!o.stage)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: staging a KV export");
    bool host = q->layers[layer].home == KV_HOME_HOST;
    enum tier_status st = TIER_OK;
    if (part[0]) {
        struct be_kv_view sv = {.blocks = (void *const *)&qv.rest.sink_block, .n_blocks = 1,
                                .block_tokens = qv.rest.block_tokens, .v_offset = qv.rest.v_offset};
        st = read_view(&o, &sv, false, rest_dt, 0, part[0], 0);
    }
    if (st == TIER_OK && part[1])
        st = read_quant(&o, &qv, part[0]);
    if (st == TIER_OK)
        st = read_view(&o, &qv.rest, host, rest_dt, qv.rest.lo, qv.rest.hi, part[0] + part[1]);
    free(o.stage);
    return st;
}

enum tier_status kv_seq_layer_quant(const kv_seq *q, int layer, struct kv_quant_layer *out)
{
    kv_store *s = q->s;
    s->err[0] = '\0';
    if (layer < 0 || layer >= s->g.n_layers || !q->kvq)
        return kv_fail(s, TIER_EINVAL, "kv_seq_layer_quant: layer %d of %d of a %s sequence", layer, s->g.n_layers,
                       kv_strategy_name(q->strategy));
    if (q->p.sink || kvq_seq_on_host(q))
        return kv_fail(s, TIER_ENOTSUP, "the stored form of a quantized sequence %s",
                       q->p.sink ? "with sinks" : "offloaded to the host tier");
    struct be_kvq_view v;
    kv_seq_qview(q, layer, &v);
    *out = (struct kv_quant_layer){.fmt = v.fmt, .lo = v.lo, .nq = v.hi,
                                   .first_block = v.base / v.fmt->block_tokens,
                                   .residual = v.rest.hi - v.rest.lo, .n_blocks = v.n_blocks,
                                   .scale_k = v.scale_k, .scale_v = v.scale_v};
    return TIER_OK;
}

enum tier_status kv_seq_layer_quant_read(kv_seq *q, int layer, void *blocks, void *k, void *v)
{
    kv_store *s = q->s;
    struct kv_quant_layer ql;
    enum tier_status st = kv_seq_layer_quant(q, layer, &ql);
    if (st != TIER_OK)
        return st;
    if (q->pending || !blocks || !k || !v)
        return kv_fail(s, TIER_EINVAL, "kv_seq_layer_quant_read %s", q->pending ? "inside a step" : "without buffers");
    if ((st = kv_seq_fill(q, layer)) != TIER_OK)
        return st;
    struct be_kvq_view qv;
    kv_seq_qview(q, layer, &qv);
    for (int i = 0; i < qv.n_blocks; i++) {
        enum be_status bs = be_copy(s->be, (char *)blocks + (size_t)i * qv.fmt->block_bytes, qv.blocks[i],
                                    qv.fmt->block_bytes, BE_D2H);
        if (bs != BE_OK)
            return kv_fail(s, TIER_EIO, "reading quantized KV blocks from the device: %s", be_strerror(bs));
    }
    struct dense_out o = {.q = q, .k = k, .v = v, .dt = s->g.dtype, .rows = ql.residual};
    o.stage = malloc((size_t)s->bt * (size_t)s->g.head_dim * be_dtype_size(s->g.dtype));
    if (!o.stage)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: staging a KV export");
    st = read_view(&o, &qv.rest, false, s->g.dtype, qv.rest.lo, qv.rest.hi, 0);
    free(o.stage);
    return st;
}

int64_t kv_store_dense_rows(const kv_store *s, const struct kv_seq_params *p, int layer, int64_t n)
{
    int w, keep; /* what the layer keeps (kvstore.c invariant 1) */
    kv_layer_shape(s, p, layer, &w, &keep);
    return keep && n > keep ? keep : n;
}

/* Writes rows [0, rows) of one layer's [H, rows, D] K and V (of dt) to the
 * positions [n - rows, n) of its reserved view. */
static enum tier_status write_layer(kv_seq *q, int layer, int64_t n, int64_t rows, enum be_dtype dt, const char *k,
                                    const char *v, void *stage)
{
    kv_store *s = q->s;
    int H = s->g.n_kv_heads, D = s->g.head_dim;
    size_t es = be_dtype_size(dt), ses = be_dtype_size(s->g.dtype);
    struct be_kv_view view;
    kv_seq_view(q, layer, &view);
    bool host = q->layers[layer].home == KV_HOME_HOST; /* no streamed step runs: its view is host memory */
    for (int64_t p = n - rows; p < n;) {
        int64_t rel = p - view.base, bi = rel / view.block_tokens, slot = rel % view.block_tokens;
        int64_t cnt = view.block_tokens - slot < n - p ? view.block_tokens - slot : n - p;
        size_t elems = (size_t)cnt * (size_t)D;
        for (int half = 0; half < 2; half++)
            for (int h = 0; h < H; h++) {
                const char *src =
                    (half ? v : k) + ((size_t)h * (size_t)rows + (size_t)(p - (n - rows))) * (size_t)D * es;
                char *dst = (char *)view.blocks[bi] + (half ? view.v_offset : 0) +
                            ((size_t)h * (size_t)view.block_tokens + (size_t)slot) * (size_t)D * ses;
                if (host) {
                    convert(dst, s->g.dtype, src, dt, elems);
                    continue;
                }
                convert(stage, s->g.dtype, src, dt, elems);
                enum be_status st = be_copy(s->be, dst, stage, elems * ses, BE_H2D);
                if (st != BE_OK)
                    return kv_fail(s, TIER_EIO, "writing imported KV to the device: %s", be_strerror(st));
            }
        p += cnt;
    }
    return TIER_OK;
}

/* The import's one step: every layer's rows, then the commit; a failure
 * aborts it. */
static enum tier_status import_step(kv_seq *q, int64_t n, enum be_dtype dtype, const void *const *k,
                                    const void *const *v, void *stage)
{
    kv_store *s = q->s;
    enum tier_status st = kv_seq_reserve(q, (int)n);
    for (int l = 0; l < s->g.n_layers && st == TIER_OK; l++)
        st = write_layer(q, l, n, kv_store_dense_rows(s, &q->p, l, n), dtype, k[l], v[l], stage);
    if (st != TIER_OK) {
        if (q->pending)
            kv_seq_abort(q);
        return st;
    }
    return kv_seq_commit(q);
}

enum tier_status kv_seq_import_dense(kv_seq *q, int64_t n, enum be_dtype dtype, const void *const *k,
                                     const void *const *v)
{
    kv_store *s = q->s;
    s->err[0] = '\0';
    /* the requested strategy: a dynamic sequence fallen back to the host
     * tier keeps the same rows (kvstore.c invariant 1) */
    if (q->p.strategy != KV_DYNAMIC || q->kvq || q->state || q->p.sink || q->len || q->pending)
        return kv_fail(s, TIER_EINVAL, "kv_seq_import_dense: needs a fresh dynamic sequence (%s, length %lld)",
                       kv_strategy_name(q->strategy), (long long)q->len);
    /* one step: its length is an int (kv_seq_reserve) */
    if (n <= 0 || n > INT_MAX || !be_dtype_size(dtype) || !k || !v)
        return kv_fail(s, TIER_EINVAL, "kv_seq_import_dense: %lld tokens (1 to %d), dtype %d", (long long)n,
                       INT_MAX, (int)dtype);
    for (int l = 0; l < s->g.n_layers; l++)
        if (!k[l] || !v[l])
            return kv_fail(s, TIER_EINVAL, "kv_seq_import_dense: layer %d has no keys or values", l);
    void *stage = malloc((size_t)s->bt * (size_t)s->g.head_dim * sizeof(float));
    if (!stage)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: staging a KV import");
    enum tier_status st = import_step(q, n, dtype, k, v, stage);
    /* KV computed elsewhere arrives as a restored image does (kv_seq_load):
     * what the device cannot hold goes to the host tier */
    if (st == TIER_ENOMEM_DEV && !q->p.no_fallback && (st = kv_seq_offload(q, KV_FALLBACK_OOM)) == TIER_OK)
        st = import_step(q, n, dtype, k, v, stage);
    free(stage);
    return st;
}
