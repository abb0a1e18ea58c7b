/* attention.cu - paged attention over the store's blocks, split along the
 * keys ("flash-decoding"): each (token, kv head) pair's keys are cut into
 * splits of at most SPLIT keys; one thread block folds a split into its
 * online-softmax state (max m, sum l, unnormalised output o) for the nq
 * query heads that share the kv head, and a second kernel merges a token's
 * splits in order.  A decode step's few pairs so spread over every SM; a
 * prefill's many tokens are items of the same kernel.
 *
 * Which keys a token reads is the CPU backend's rule (ops.c, dense_keys):
 * the view's sinks, then [k0, k1) with k1 = min(pos + 1, hi) and k0 = lo
 * raised to the window's start; keys of a key_rope view are rotated as
 * they are read, at their index in the cache.  Over quantized views
 * (be_attention_quant) the same kernels read the sinks, the quantized
 * positions and the full-precision rest in that order (kvq_keys), each
 * quantized element decoded in registers as it is loaded.  Encoder-decoder
 * models: a bidirectional view's tokens read every key of [lo, hi), and
 * T5's relative position bias is added to each scaled (and capped) score
 * by the key's distance from the query, as on the CPU.
 */
#include <math.h>
#include <string.h>

#include "backend/cuda/cuda.h"

extern "C" {
#include "backend/kvq_format.h"
}

#define ATTN_WARPS 4
#define ATTN_MAX_D 256 /* head_dim up to this: each lane holds D / 32 elements of a row */
#define ATTN_E (ATTN_MAX_D / 32)
/* Keys per split: few enough that a decode step of one sequence makes
 * hundreds of blocks at long context, many enough that a prefill's splits
 * stay a small multiple of its tokens. */
#define SPLIT_DECODE 256
#define SPLIT_PREFILL 1024
/* Partial states of one launch at most: a long prompt runs in token chunks. */
#define PART_BYTES_MAX ((size_t)256 << 20)

/* Where a token's keys come from, in cache order: n in all, the view's
 * sinks first, then nq quantized positions from q0, then full-precision
 * positions from k0. */
struct tok_keys {
    int64_t n, q0, nq, k0;
};

/* One split: keys [c0, c0 + n) of token tok's keys. */
struct item {
    int tok, n;
    int64_t c0;
    struct tok_keys keys;
};

/* A dense token's keys (ops.c's dense_keys). */
static void dense_keys(const struct be_attn_params *p, const void *views, const struct be_tok *t, struct tok_keys *k)
{
    const struct be_kv_view *v = (const struct be_kv_view *)views + t->view;
    int64_t lo = v->lo, k1 = t->pos + 1 < v->hi && !p->bidirectional ? t->pos + 1 : v->hi;
    int window = v->window ? v->window : p->window;
    if (window > 0 && t->pos - window + 1 > lo)
        lo = t->pos - window + 1;
    *k = (struct tok_keys){.n = v->sinks + (k1 > lo ? k1 - lo : 0), .q0 = 0, .nq = 0, .k0 = lo};
}

static void quant_keys(const struct be_attn_params *p, const void *views, const struct be_tok *t, struct tok_keys *k)
{
    struct kvq_keys kk;
    int64_t n = kvq_keys(p, (const struct be_kvq_view *)views + t->view, t->pos, &kk);
    *k = (struct tok_keys){.n = n, .q0 = kk.qlo, .nq = kk.qhi - kk.qlo, .k0 = kk.rlo};
}

typedef void (*keys_fn)(const struct be_attn_params *p, const void *views, const struct be_tok *t,
                        struct tok_keys *k);

/* Element d of a key whose elements load(i) gives, rotated at its cache
 * index for a key_rope view. */
template <class Load>
__device__ __forceinline__ float key_elem(const struct cu_view *v, const struct be_attn_params *p, int64_t pos,
                                          int d, Load load)
{
    float x = load(d);
    if (!v->key_rope)
        return x;
    /* out[a] = x[a] t[a] - x[b] t[b], out[b] = x[b] t[a] + x[a] t[b] over the
     * pairs (a, b) of the layout, t the table's row at the cache index */
    int D = p->head_dim, half = D / 2, a, b;
    if (p->key_rope_layout == BE_ROPE_NEOX) {
        a = d < half ? d : d - half;
        b = a + half;
    } else {
        a = d & ~1;
        b = a + 1;
    }
    const float *t = p->key_rope + (size_t)(pos < v->sinks ? pos : pos - v->shift) * (size_t)D;
    float xa = d == a ? x : load(a), xb = d == b ? x : load(b);
    return d == a ? xa * t[a] - xb * t[b] : xb * t[a] + xa * t[b];
}

/* Block (item i, kv head kvh), ATTN_WARPS warps; dynamic shared memory:
 * q[nq][D] as f32, then per warp m[nq], l[nq], o[nq][D].  Warp w takes keys
 * w, w + ATTN_WARPS, ...; lane holds elements lane + 32e of the K and V
 * rows.  part[(i * n_kv + kvh)] gets (m[nq], l[nq], o[nq][D]) of the split.
 * qviews (NULL: dense views) holds the quantized parts of the views, whose
 * rests are views. */
__global__ void k_attn_part(float *part, const void *q, enum be_dtype qt, const struct cu_view *views,
                            const struct cu_qview *qviews, const struct be_tok *toks, const struct item *items,
                            struct be_attn_params p)
{
    extern __shared__ float sm[];
    const struct item it = items[blockIdx.x];
    int kvh = blockIdx.y, n_kv = gridDim.y, D = p.head_dim, nq = p.n_heads / p.n_kv_heads;
    int w = threadIdx.x / 32, lane = threadIdx.x & 31;
    float *sq = sm, *wm = sq + nq * D + w * nq * (D + 2), *wl = wm + nq, *wo = wl + nq;
    const struct cu_view *v = &views[toks[it.tok].view];
    enum be_dtype kt = p.kv_dtype;
    size_t esz = kt == BE_F32 ? 4 : 2;

    /* q[tok, (kvh * nq + g) * D + d] */
    size_t qrow = ((size_t)it.tok * p.n_heads + (size_t)kvh * nq) * D;
    for (int i = threadIdx.x; i < nq * D; i += blockDim.x)
        sq[i] = ld(q, qrow + i, qt);
    for (int g = lane; g < nq; g += 32) {
        wm[g] = -INFINITY;
        wl[g] = 0.0f;
    }
    for (int i = lane; i < nq * D; i += 32)
        wo[i] = 0.0f;
    __syncthreads();

    for (int j = w; j < it.n; j += ATTN_WARPS) {
        int64_t c = it.c0 + j, after = c - v->sinks, pos;
        float kr[ATTN_E], vr[ATTN_E];
        if (c >= v->sinks && after < it.keys.nq) { /* a quantized key, decoded element by element */
            const struct cu_qview *qv = &qviews[toks[it.tok].view];
            const struct be_kvq_format *f = &qv->fmt;
            int t;
            pos = it.keys.q0 + after;
            const char *blk = cu_qblock(qv, pos, &t);
            auto load = [&](int i) { return kvq_decode(f, &f->k, blk, kvh, t, i, qv->scale_k); };
            for (int e = 0; e < ATTN_E; e++) {
                int d = lane + 32 * e;
                kr[e] = d < D ? key_elem(v, &p, pos, d, load) : 0.0f;
                vr[e] = d < D ? kvq_decode(f, &f->v, blk, kvh, t, d, qv->scale_v) : 0.0f;
            }
        } else {
            pos = c < v->sinks ? c : it.keys.k0 + (after - it.keys.nq);
            const char *row = pos < v->sinks
                                  ? v->sink_block + ((size_t)kvh * v->block_tokens + (size_t)pos) * D * esz
                                  : kv_row(v, pos, kvh, D, esz);
            auto load = [&](int i) { return ld(row, (size_t)i, kt); };
            for (int e = 0; e < ATTN_E; e++) {
                int d = lane + 32 * e;
                kr[e] = d < D ? key_elem(v, &p, pos, d, load) : 0.0f;
                vr[e] = d < D ? ld(row + v->v_offset, d, kt) : 0.0f;
            }
        }
        for (int g = 0; g < nq; g++) {
            float s = 0.0f;
            for (int e = 0; e < ATTN_E; e++)
                if (lane + 32 * e < D)
                    s += sq[g * D + lane + 32 * e] * kr[e];
            s = warp_sum(s) * p.scale;
            if (p.softcap > 0.0f)
                s = p.softcap * tanhf(s / p.softcap);
            if (p.rel_bias) { /* T5: the bias of the key's distance, per query head */
                int64_t dist = pos - toks[it.tok].pos, span = p.rel_span;
                dist = dist < -span ? -span : dist > span ? span : dist;
                s += p.rel_bias[(size_t)(kvh * nq + g) * (size_t)(2 * span + 1) + (size_t)(dist + span)];
            }
            float m = wm[g], mn = fmaxf(m, s);
            float f = m == -INFINITY ? 0.0f : expf(m - mn), pw = mn == -INFINITY ? 0.0f : expf(s - mn);
            for (int e = 0; e < ATTN_E; e++) {
                int d = lane + 32 * e;
                if (d < D)
                    wo[g * D + d] = wo[g * D + d] * f + pw * vr[e];
            }
            float l = wl[g] * f + pw;
            __syncwarp();
            if (lane == 0) {
                wm[g] = mn;
                wl[g] = l;
            }
            __syncwarp();
        }
    }
    __syncthreads();

    /* the warps' states into one: out = sum_w o_w e^(m_w - M), l likewise */
    float *out = part + ((size_t)blockIdx.x * n_kv + kvh) * (size_t)nq * (D + 2);
    int stride = nq * (D + 2);
    for (int i = threadIdx.x; i < nq * D + nq; i += blockDim.x) {
        int g = i < nq * D ? i / D : i - nq * D;
        float M = -INFINITY;
        for (int u = 0; u < ATTN_WARPS; u++)
            M = fmaxf(M, sm[nq * D + u * stride + g]);
        float acc = 0.0f;
        for (int u = 0; u < ATTN_WARPS; u++) {
            const float *um = sm + nq * D + u * stride;
            float f = M == -INFINITY ? 0.0f : expf(um[g] - M);
            acc += f * (i < nq * D ? um[2 * nq + i] : um[nq + g]);
        }
        if (i < nq * D) {
            out[2 * nq + i] = acc;
        } else {
            out[g] = M;
            out[nq + g] = acc;
        }
    }
}

/* Block (token t, query head h): token t's splits [first[t], first[t+1])
 * merged in order, normalised, written to out[t, h * D ..] as act; a head
 * that saw no key gets zeros, as on the CPU. */
__global__ void k_attn_merge(void *out, enum be_dtype ot, const float *part, const int *first, int t0,
                             struct be_attn_params p)
{
    int t = blockIdx.x, h = blockIdx.y, D = p.head_dim, nq = p.n_heads / p.n_kv_heads;
    int kvh = h / nq, g = h % nq, n_kv = p.n_kv_heads;
    size_t stride = (size_t)nq * (D + 2);
    float M = -INFINITY;
    for (int i = first[t]; i < first[t + 1]; i++)
        M = fmaxf(M, part[((size_t)i * n_kv + kvh) * stride + g]);
    float L = 0.0f;
    for (int i = first[t]; i < first[t + 1]; i++) {
        const float *s = part + ((size_t)i * n_kv + kvh) * stride;
        L += M == -INFINITY ? 0.0f : s[nq + g] * expf(s[g] - M);
    }
    size_t orow = ((size_t)(t0 + t) * p.n_heads + h) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int i = first[t]; i < first[t + 1]; i++) {
            const float *s = part + ((size_t)i * n_kv + kvh) * stride;
            acc += M == -INFINITY ? 0.0f : s[2 * nq + g * D + d] * expf(s[g] - M);
        }
        st(out, orow + d, ot, L > 0.0f ? acc / L : 0.0f);
    }
}

/* One op's keys: the host views and how a token's keys are found in
 * them, and the views uploaded (dq NULL: dense). */
struct attn_src {
    const void *views;
    keys_fn keys;
    const struct cu_view *dv;
    const struct cu_qview *dq;
    const struct be_tok *dt;
};

/* Tokens [t0, t1) in one launch pair: their items and firsts uploaded,
 * their partial states in scratch. */
static enum be_status attend_chunk(struct cu_ctx *c, void *out, const void *q, const struct attn_src *src,
                                   const struct be_tok *toks, int t0, int t1, int n_items, int split,
                                   const struct be_attn_params *p, size_t smem)
{
    int nt = t1 - t0;
    size_t ib = (size_t)n_items * sizeof(struct item), fb = (size_t)(nt + 1) * sizeof(int);
    char *h, *d;
    BE_TRY(cu_meta_reserve(c, ib + fb, &h, &d));
    struct item *hi = (struct item *)h;
    int *hf = (int *)(h + ib), k = 0;
    for (int t = t0; t < t1; t++) {
        struct tok_keys kk;
        src->keys(p, src->views, &toks[t], &kk);
        hf[t - t0] = k;
        for (int64_t c0 = 0; c0 < kk.n || c0 == 0; c0 += split) /* a token with no key: one empty split */
            hi[k++] = (struct item){.tok = t, .n = (int)(kk.n - c0 < split ? kk.n - c0 : split), .c0 = c0, .keys = kk};
    }
    hf[nt] = k;
    BE_TRY(cu_meta_upload(c, h, d, ib + fb));
    int nq = p->n_heads / p->n_kv_heads;
    void *part;
    BE_TRY(cu_scratch(c, (size_t)n_items * p->n_kv_heads * nq * (p->head_dim + 2) * sizeof(float), &part));
    k_attn_part<<<dim3((unsigned)n_items, (unsigned)p->n_kv_heads), ATTN_WARPS * 32, smem, c->compute>>>(
        (float *)part, q, c->act, src->dv, src->dq, src->dt, (const struct item *)d, *p);
    k_attn_merge<<<dim3((unsigned)nt, (unsigned)p->n_heads), 128, 0, c->compute>>>(
        out, c->act, (const float *)part, (const int *)(d + ib), t0, *p);
    return BE_OK;
}

/* The chunk of tokens that starts at t0: it ends before the token whose
 * splits would take the partial states past PART_BYTES_MAX (one token at
 * least); *n_items = its splits. */
static int chunk_end(const struct be_attn_params *p, const struct attn_src *src, const struct be_tok *toks,
                     int n_tok, int t0, int split, int *n_items)
{
    int nq = p->n_heads / p->n_kv_heads, t = t0;
    size_t per_item = (size_t)p->n_kv_heads * nq * (p->head_dim + 2) * sizeof(float);
    *n_items = 0;
    for (; t < n_tok; t++) {
        struct tok_keys kk;
        src->keys(p, src->views, &toks[t], &kk);
        int items = kk.n > split ? (int)((kk.n + split - 1) / split) : 1;
        if (*n_items && (size_t)(*n_items + items) * per_item > PART_BYTES_MAX)
            break;
        *n_items += items;
    }
    return t;
}

/* Both ops: views are be_kv_views, or be_kvq_views when quant. */
static enum be_status attend(struct cu_ctx *c, void *out, const void *q, const void *views, bool quant,
                             const struct be_tok *toks, int n_tok, const struct be_attn_params *p)
{
    int nq = p->n_heads / p->n_kv_heads, D = p->head_dim;
    size_t smem = ((size_t)nq * D + (size_t)ATTN_WARPS * nq * (D + 2)) * sizeof(float);
    int max_smem = 0;
    CU_TRY(c, cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, c->dev), "attention");
    if (D > ATTN_MAX_D || smem > (size_t)max_smem)
        return BE_ENOTSUP; /* beyond every supported model: head_dim over 256, or ~40 query heads per kv head */
    if (smem > 48 * 1024)
        CU_TRY(c, cudaFuncSetAttribute(k_attn_part, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
               "attention");
    int split = (size_t)n_tok * p->n_kv_heads >= 256 ? SPLIT_PREFILL : SPLIT_DECODE;
    int n_views = cu_views_named(toks, n_tok);
    struct attn_src src = {.views = views, .keys = quant ? quant_keys : dense_keys, .dv = NULL, .dq = NULL, .dt = NULL};
    const struct be_kvq_view *qv = (const struct be_kvq_view *)views;
    /* the rests of quantized views are views of their own */
    const struct be_kv_view *first = quant ? &qv[0].rest : (const struct be_kv_view *)views;
    size_t stride = quant ? sizeof(*qv) : sizeof(*first);

    /* the metadata of the whole op first: it may only grow before any of
     * it is reserved */
    size_t meta = cu_meta_size(cu_views_bytes_at(first, stride, n_views, n_tok));
    if (quant)
        meta += cu_meta_size(cu_qviews_bytes(qv, n_views));
    for (int t0 = 0, t1, n_items; t0 < n_tok; t0 = t1) {
        t1 = chunk_end(p, &src, toks, n_tok, t0, split, &n_items);
        meta += cu_meta_size((size_t)n_items * sizeof(struct item) + (size_t)(t1 - t0 + 1) * sizeof(int));
    }
    BE_TRY(cu_meta_ensure(c, meta));

    BE_TRY(cu_upload_views_at(c, first, stride, n_views, toks, n_tok, &src.dv, &src.dt));
    if (quant)
        BE_TRY(cu_upload_qviews(c, qv, n_views, &src.dq));
    for (int t0 = 0, t1, n_items; t0 < n_tok; t0 = t1) {
        t1 = chunk_end(p, &src, toks, n_tok, t0, split, &n_items);
        BE_TRY(attend_chunk(c, out, q, &src, toks, t0, t1, n_items, split, p, smem));
    }
    return cu_leave(c, "attention");
}

enum be_status cu_attention(void *ctx, void *out, const void *q, const struct be_kv_view *views,
                            const struct be_tok *toks, int n_tok, const struct be_attn_params *p)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "attention"));
    return attend(c, out, q, views, false, toks, n_tok, p);
}

enum be_status cu_attention_quant(void *ctx, void *out, const void *q, const struct be_kvq_view *views,
                                  const struct be_tok *toks, int n_tok, const struct be_attn_params *p)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "attention_quant"));
    return attend(c, out, q, views, true, toks, n_tok, p);
}
