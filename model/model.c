/* model.c - the forward pass of the Llama family (Llama, Mistral, Qwen2,
 * Qwen3), Gemma 2/3, Phi-3 and GPT-2, batched over sequences, reading its KV
 * from the paged store.
 *
 * Read it top to bottom like the maths: embed (Gemma: * sqrt(dim); GPT-2:
 * + wpe[position]) -> per layer [RMSNorm (GPT-2: LayerNorm) -> QKV (+bias)
 * -> (Qwen3, Gemma 3: per-head q/k RMSNorm) -> RoPE (Gemma 3's sliding
 * layers: their own base; Phi-3: partial, longrope; GPT-2: none) -> store
 * K,V -> attention (Gemma 2: soft-capped scores) -> output projection ->
 * (Gemma: RMSNorm) -> residual -> RMSNorm -> SwiGLU or GeGLU MLP (GPT-2:
 * ungated gelu) -> (Gemma: RMSNorm) -> residual] -> final norm -> lm_head
 * (Gemma 2: soft-capped logits).  The families differ only by switches of
 * model_config; every kernel runs on the backend (backend.h).
 *
 * Mamba has no attention: per layer [RMSNorm -> in_proj into x and z ->
 * causal depthwise conv + SiLU (be_ssm_conv, the window in the sequence's
 * state) -> x_proj into dt, B, C -> dt_proj -> selective scan, gated by
 * SiLU(z) (be_ssm_scan, the SSM state in the sequence's state) ->
 * out_proj -> residual] (mamba_layer_forward).
 *
 * Batching: one call feeds every sequence of the batch; the tokens of all
 * sequences are concatenated into chunks of at most max_batch_tokens rows,
 * so each weight matrix is read once per chunk, not once per sequence.
 */
#include "model/model.h"
#include "model/safetensors.h"
#include "util/half.h"
#include "util/q4k.h"
#include "util/q8.h"

#include <math.h>
#include <xxhash.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------
 * The model: config, borrowed weights, run state
 * ------------------------------------------------------------------------- */

#define RS_BUFS 12 /* device buffers of the run state */

struct run_state {
    int cap;             /* rows every buffer below holds (max_batch_tokens) */
    int logit_rows;      /* rows of the logits buffer */
    be_buffer *bufs[RS_BUFS]; /* owners of the device pointers below */
    enum be_dtype act;   /* the backend's activation type (caps.act_dtype) */
    size_t esz;          /* its size */
    /* device buffers, of act unless said otherwise */
    void *x;             /* (cap, dim)      residual stream */
    void *xb;            /* (cap, dim)      normed input of a block / gathered rows */
    void *q;             /* (cap, q_dim) */
    void *k;             /* (cap, kv_dim) */
    void *v;             /* (cap, kv_dim) */
    void *att;           /* (cap, q_dim)    attention output */
    void *hb;            /* (cap, ffn)      gate, then silu(gate) * up */
    void *hb2;           /* (cap, ffn)      up */
    void *logits;        /* (logit_rows, vocab) f32 */
    void *inv_freq;      /* (head_dim / 2)  f32 RoPE frequencies, scaling folded in */
    void *inv_freq_local;/* (head_dim / 2)  f32 the sliding layers' (rope_local_theta), else = inv_freq */
    void *inv_freq_long; /* (head_dim / 2)  f32 longrope's long_factor table, else = inv_freq */
    float embed_scale;   /* the config's, rounded to act */
    /* host-side chunk description (be_embed, be_rope and the views take
     * it as host metadata) */
    struct be_tok *toks; /* (cap) */
    int64_t *pos;        /* (cap)           absolute positions */
    int64_t *qpos, *kpos;/* (cap)           RoPE positions of queries and keys (kv_seq_rope_pos) */
    int *row_seq;        /* (cap)           which batch entry a row belongs to */
    int *row_tok;        /* (cap)           index of the row's token within its entry */
    bool *row_long;      /* (cap)           longrope: the row's sequence reaches past original_max_pos this step */
    int32_t *ids;        /* (cap)           token ids */
    int32_t *pos_ids;    /* (cap)           GPT-2: the rows of wpe (absolute positions) */
    int64_t *start;      /* (start_cap)     each batch entry's length before the step */
    int start_cap;
    struct be_kv_view *views; /* (cap)      one per sequence present in the chunk */
    struct be_kvq_view *qviews; /* (cap)    the same as be_attention_quant reads them */
    struct be_ssm_view *sviews; /* (cap)    Mamba: each sequence's state of the layer */
    bool any_quant;           /* a sequence of the chunk is quantized: attention reads qviews */
    enum be_dtype kv_dtype;   /* the store's dense KV type */
    /* the sink strategy's key rotation table (be_attn_params.key_rope) */
    be_buffer *key_rope_buf;
    int64_t key_rope_rows;
};

struct model {
    struct model_config cfg;
    struct model_weights w; /* where the kernels read them: the mmap, or device copies */
    model_files *files;
    be_backend *be;
    struct run_state rs;
    enum be_dtype kv_dtype; /* model_params.kv_dtype resolved */
    /* device copies of the weights when the backend cannot read host memory */
    be_buffer **wbufs;
    int n_wbufs;
    struct model_layer *dev_layers;
    /* model_params.weights q8_0 or q4_k: every layer matrix's blocks, and
     * the layer table pointing into them */
    enum model_weights_fmt wfmt;
    void *qblocks;
    struct model_layer *q_layers;
};

const struct model_config *model_get_config(const model *m)
{
    return &m->cfg;
}

const struct model_weights *model_get_weights(const model *m)
{
    return &m->w;
}

uint64_t model_fingerprint(const model *m)
{
    /* as-is weights keep the fingerprint they always had, so KV saved
     * before the quantized formats existed still loads */
    uint64_t h[3] = {m->cfg.config_hash, m->w.header_hash, (uint64_t)m->wfmt};
    return XXH3_64bits(h, m->wfmt == MODEL_WEIGHTS_AUTO ? 2 * sizeof h[0] : sizeof h);
}

struct kv_geom model_kv_geom(const model *m)
{
    return (struct kv_geom){
        .n_layers = m->cfg.n_layers,
        .n_kv_heads = m->cfg.n_kv_heads,
        .head_dim = m->cfg.head_dim,
        .layer_window = m->cfg.layer_window,
        .dtype = m->kv_dtype,
        .state_bytes = m->cfg.arch == ARCH_MAMBA ? be_ssm_state_bytes(m->cfg.intermediate_size, m->cfg.ssm_state,
                                                                       m->cfg.ssm_conv)
                                                 : 0,
    };
}

bool model_kv_dtype_parse(const char *s, enum model_kv_dtype *out)
{
    static const char *const names[] = {
        [MODEL_KV_AUTO] = "auto", [MODEL_KV_F32] = "f32", [MODEL_KV_F16] = "f16", [MODEL_KV_BF16] = "bf16"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (!strcmp(s, names[i])) {
            *out = (enum model_kv_dtype)i;
            return true;
        }
    return false;
}

bool model_weights_parse(const char *s, enum model_weights_fmt *out)
{
    static const char *const names[] = {
        [MODEL_WEIGHTS_AUTO] = "auto", [MODEL_WEIGHTS_Q8_0] = "q8_0", [MODEL_WEIGHTS_Q4_K] = "q4_k"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (!strcmp(s, names[i])) {
            *out = (enum model_weights_fmt)i;
            return true;
        }
    return false;
}

enum be_dtype model_weights_mat_dtype(enum model_weights_fmt fmt, int cols)
{
    switch (fmt) {
    case MODEL_WEIGHTS_Q4_K: return cols % Q4_K_BLOCK ? BE_Q8_0 : BE_Q4_K;
    case MODEL_WEIGHTS_Q8_0: return BE_Q8_0;
    case MODEL_WEIGHTS_AUTO: break;
    }
    return BE_F32;
}

enum be_dtype model_kv_dtype_resolve(enum model_kv_dtype choice, enum be_dtype dt)
{
    switch (choice) {
    case MODEL_KV_F32: return BE_F32;
    case MODEL_KV_F16: return BE_F16;
    case MODEL_KV_BF16: return BE_BF16;
    case MODEL_KV_AUTO: break;
    }
    return dt == BE_BF16 || dt == BE_F16 ? dt : BE_F32;
}

/* RoPE inverse frequencies as Hugging Face computes them (f32 maths, as in
 * modeling_rope_utils.py) for base theta, with the config's linear or
 * llama3 scaling folded in when scaled; longrope's long_factor table when
 * long, else its short_factor one. */
static void rope_inv_freq(const struct model_config *c, float theta, bool scaled, bool long_table, float *inv_freq)
{
    int half = c->rot_dim / 2;
    const float *ext = long_table ? c->rope_long_factor : c->rope_short_factor;
    for (int i = 0; i < half; i++) {
        float p = powf(theta, (float)(2 * i) / (float)c->rot_dim);
        /* longrope divides base^(2i/d) itself, before the reciprocal */
        float f = 1.0f / (scaled && c->rope_scaling == ROPE_SCALING_LONGROPE ? ext[i] * p : p);
        if (!scaled) {
            inv_freq[i] = f;
            continue;
        }
        if (c->rope_scaling == ROPE_SCALING_LINEAR) {
            f /= c->rope_factor;
        } else if (c->rope_scaling == ROPE_SCALING_LLAMA3) {
            float old = (float)c->rope_original_max_pos;
            float low_wavelen = old / c->rope_low_freq_factor;
            float high_wavelen = old / c->rope_high_freq_factor;
            float wavelen = 2.0f * (float)M_PI / f;
            if (wavelen > low_wavelen) {
                f /= c->rope_factor;
            } else if (wavelen >= high_wavelen) {
                float smooth = (old / wavelen - c->rope_low_freq_factor) /
                               (c->rope_high_freq_factor - c->rope_low_freq_factor);
                f = (1.0f - smooth) * f / c->rope_factor + smooth * f;
            }
        }
        inv_freq[i] = f;
    }
}

static void run_state_free(struct run_state *rs)
{
    for (size_t i = 0; i < sizeof(rs->bufs) / sizeof(rs->bufs[0]); i++)
        be_buffer_free(rs->bufs[i]);
    free(rs->toks);
    free(rs->pos);
    free(rs->qpos);
    free(rs->kpos);
    be_buffer_free(rs->key_rope_buf);
    free(rs->row_seq);
    free(rs->row_tok);
    free(rs->row_long);
    free(rs->ids);
    free(rs->pos_ids);
    free(rs->start);
    free(rs->views);
    free(rs->qviews);
    free(rs->sviews);
    memset(rs, 0, sizeof(*rs));
}

/* The bytes of each device buffer of the run state (the order of
 * run_state.bufs), shared with model_device_bytes so that the budget sized
 * from a config is what the load then charges. */
static int logit_rows(int cap)
{
    return cap < 16 ? cap : 16; /* lm_head runs in slices: vocab can be 150k */
}

static void run_state_sizes(const struct model_config *c, size_t e, int cap, size_t sizes[RS_BUFS])
{
    size_t q_dim = (size_t)c->n_heads * c->head_dim, kv_dim = (size_t)c->n_kv_heads * c->head_dim;
    size_t rows = (size_t)cap, xb_dim = (size_t)c->hidden_size;
    /* the RoPE tables; Mamba has no heads, and a buffer is never empty */
    size_t rope = c->head_dim ? (size_t)c->head_dim / 2 * 4 : 4;
    if (c->arch == ARCH_MAMBA) { /* mamba_layer_forward: every buffer but x and xb has inner columns */
        q_dim = kv_dim = (size_t)c->intermediate_size;
        if (xb_dim < 2 * (size_t)c->ssm_state) /* xb holds B and C */
            xb_dim = 2 * (size_t)c->ssm_state;
    }
    size_t s[RS_BUFS] = {
        rows * c->hidden_size * e, rows * xb_dim * e, rows * q_dim * e,
        rows * kv_dim * e, rows * kv_dim * e, rows * q_dim * e,
        rows * c->intermediate_size * e, rows * c->intermediate_size * e,
        (size_t)logit_rows(cap) * c->vocab_size * 4, rope, rope, rope,
    };
    memcpy(sizes, s, sizeof(s));
}

static enum model_status run_state_alloc(model *m, int cap, char *err)
{
    const struct model_config *c = &m->cfg;
    struct run_state *rs = &m->rs;
    rs->cap = cap;
    rs->act = be_get_caps(m->be).act_dtype;
    rs->esz = be_dtype_size(rs->act);
    rs->logit_rows = logit_rows(cap);
    size_t sizes[RS_BUFS];
    run_state_sizes(c, rs->esz, cap, sizes);
    void **ptrs[RS_BUFS] = {&rs->x, &rs->xb, &rs->q, &rs->k, &rs->v, &rs->att, &rs->hb, &rs->hb2, &rs->logits,
                            &rs->inv_freq, &rs->inv_freq_local, &rs->inv_freq_long};
    for (int i = 0; i < RS_BUFS; i++) {
        enum be_status st = be_dev_alloc(m->be, sizes[i], &rs->bufs[i]);
        if (st != BE_OK) {
            snprintf(err, MODEL_ERR_LEN, "run state: cannot allocate %zu bytes of activations: %s", sizes[i],
                     be_strerror(st));
            return st == BE_ENOMEM_DEV ? MODEL_EDEVMEM : MODEL_ENOMEM;
        }
        *ptrs[i] = be_buffer_data(rs->bufs[i]);
    }
    rs->toks = malloc((size_t)cap * sizeof(*rs->toks));
    rs->pos = malloc((size_t)cap * sizeof(*rs->pos));
    rs->qpos = malloc((size_t)cap * sizeof(*rs->qpos));
    rs->kpos = malloc((size_t)cap * sizeof(*rs->kpos));
    rs->row_seq = malloc((size_t)cap * sizeof(*rs->row_seq));
    rs->row_tok = malloc((size_t)cap * sizeof(*rs->row_tok));
    rs->row_long = malloc((size_t)cap * sizeof(*rs->row_long));
    rs->ids = malloc((size_t)cap * sizeof(*rs->ids));
    rs->pos_ids = malloc((size_t)cap * sizeof(*rs->pos_ids));
    rs->views = malloc((size_t)cap * sizeof(*rs->views));
    rs->qviews = malloc((size_t)cap * sizeof(*rs->qviews));
    rs->sviews = malloc((size_t)cap * sizeof(*rs->sviews));
    if (!rs->sviews || !rs->toks || !rs->pos || !rs->qpos || !rs->kpos || !rs->row_seq || !rs->row_tok || !rs->row_long ||
        !rs->ids || !rs->pos_ids || !rs->views || !rs->qviews) {
        snprintf(err, MODEL_ERR_LEN, "run state: out of host memory");
        return MODEL_ENOMEM;
    }
    float *inv = calloc((size_t)c->head_dim / 2 + 1, sizeof(float)); /* zeros past rot_dim / 2 (GPT-2: all) */
    if (!inv) {
        snprintf(err, MODEL_ERR_LEN, "run state: out of host memory");
        return MODEL_ENOMEM;
    }
    size_t inv_bytes = (size_t)c->head_dim / 2 * sizeof(float);
    rope_inv_freq(c, c->rope_theta, true, false, inv);
    enum be_status st = be_copy(m->be, rs->inv_freq, inv, inv_bytes, BE_H2D);
    if (c->rope_local_theta > 0.0f)
        rope_inv_freq(c, c->rope_local_theta, false, false, inv);
    if (st == BE_OK)
        st = be_copy(m->be, rs->inv_freq_local, inv, inv_bytes, BE_H2D);
    if (c->rope_scaling == ROPE_SCALING_LONGROPE)
        rope_inv_freq(c, c->rope_theta, true, true, inv);
    if (st == BE_OK)
        st = be_copy(m->be, rs->inv_freq_long, inv, inv_bytes, BE_H2D);
    free(inv);
    /* Gemma multiplies the embeddings by sqrt(hidden_size) cast to their dtype */
    rs->embed_scale = c->embed_scale;
    if (rs->act == BE_BF16)
        rs->embed_scale = bf16_to_f32(f32_to_bf16(rs->embed_scale));
    else if (rs->act == BE_F16)
        rs->embed_scale = f16_to_f32(f32_to_f16(rs->embed_scale));
    if (st != BE_OK) {
        snprintf(err, MODEL_ERR_LEN, "run state: %s", be_strerror(st));
        return MODEL_EBACKEND;
    }
    return MODEL_OK;
}

enum model_status model_upload(be_backend *be, const void **p, size_t n, be_buffer **bufs, int *n_bufs, char *err)
{
    if (!*p)
        return MODEL_OK;
    be_buffer *buf = NULL;
    enum be_status st = be_dev_alloc(be, n, &buf);
    if (st == BE_OK)
        st = be_copy(be, be_buffer_data(buf), *p, n, BE_H2D);
    if (st != BE_OK) {
        be_buffer_free(buf);
        snprintf(err, MODEL_ERR_LEN, "uploading %zu bytes of weights: %s", n, be_strerror(st));
        return st == BE_ENOMEM_DEV ? MODEL_EDEVMEM : st == BE_ENOMEM_HOST ? MODEL_ENOMEM : MODEL_EBACKEND;
    }
    bufs[(*n_bufs)++] = buf;
    *p = be_buffer_data(buf);
    return MODEL_OK;
}

enum model_status model_upload_mat(be_backend *be, struct model_mat *w, be_buffer **bufs, int *n_bufs, char *err)
{
    return model_upload(be, &w->data, (size_t)w->rows * be_row_bytes(w->dtype, (size_t)w->cols), bufs, n_bufs, err);
}

enum model_status model_upload_vec(be_backend *be, const float **v, int n, be_buffer **bufs, int *n_bufs, char *err)
{
    return model_upload(be, (const void **)v, (size_t)n * sizeof(float), bufs, n_bufs, err);
}

static enum model_status upload_mat(model *m, struct model_mat *w, char *err)
{
    return model_upload_mat(m->be, w, m->wbufs, &m->n_wbufs, err);
}

static enum model_status upload_vec(model *m, const float **v, int n, char *err)
{
    return model_upload_vec(m->be, v, n, m->wbufs, &m->n_wbufs, err);
}

/* Mamba's mixer: its matrices are row views (in_proj, x_proj), each
 * uploaded as its own copy. */
static enum model_status mamba_upload(model *m, struct model_layer *L, char *err)
{
    const struct model_config *c = &m->cfg;
    int inner = c->intermediate_size, dim = c->hidden_size;
    struct model_mat *mats[] = {&L->ssm_in_x, &L->ssm_in_z, &L->ssm_x_dt, &L->ssm_x_B, &L->ssm_x_C, &L->ssm_dt,
                                &L->ssm_out};
    const float **vecs[] = {&L->ssm_in_bx, &L->ssm_in_bz, &L->ssm_conv_w, &L->ssm_conv_b, &L->ssm_dt_b, &L->ssm_A,
                            &L->ssm_D, &L->ssm_out_b};
    int lens[] = {inner, inner, inner * c->ssm_conv, inner, inner, inner * c->ssm_state, inner, dim};
    enum model_status st = MODEL_OK;
    for (size_t i = 0; i < sizeof(mats) / sizeof(mats[0]) && st == MODEL_OK; i++)
        st = upload_mat(m, mats[i], err);
    for (size_t i = 0; i < sizeof(vecs) / sizeof(vecs[0]) && st == MODEL_OK; i++)
        st = upload_vec(m, vecs[i], lens[i], err);
    return st;
}

/* A backend that cannot read host memory gets its own copy of every
 * weight, charged to its device budget like any other allocation. */
static enum model_status weights_upload(model *m, char *err)
{
    const struct model_config *c = &m->cfg;
    struct model_weights *w = &m->w;
    int per_layer = 36; /* 7 matrices, at most 14 vectors; Mamba: 7 and 8 more */
    m->wbufs = calloc((size_t)c->n_layers * per_layer + 5, sizeof(*m->wbufs));
    m->dev_layers = malloc((size_t)c->n_layers * sizeof(*m->dev_layers));
    if (!m->wbufs || !m->dev_layers) {
        snprintf(err, MODEL_ERR_LEN, "out of host memory for the weight table");
        return MODEL_ENOMEM;
    }
    bool tied = w->lm_head.data == w->tok_embed.data;
    int q_dim = c->n_heads * c->head_dim, kv_dim = c->n_kv_heads * c->head_dim, dim = c->hidden_size;
    enum model_status st = upload_mat(m, &w->tok_embed, err);
    if (st == MODEL_OK)
        st = tied ? MODEL_OK : upload_mat(m, &w->lm_head, err);
    if (tied)
        w->lm_head = w->tok_embed;
    if (st == MODEL_OK)
        st = upload_mat(m, &w->pos_embed, err);
    if (st == MODEL_OK)
        st = upload_vec(m, &w->final_norm, dim, err);
    if (st == MODEL_OK)
        st = upload_vec(m, &w->final_norm_b, dim, err);
    for (int l = 0; l < c->n_layers && st == MODEL_OK; l++) {
        struct model_layer *L = &m->dev_layers[l];
        *L = w->layers[l];
        struct model_mat *mats[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof(mats) / sizeof(mats[0]) && st == MODEL_OK; i++)
            st = upload_mat(m, mats[i], err);
        const float **vecs[] = {&L->attn_norm, &L->ffn_norm, &L->bq, &L->bk, &L->bv, &L->bo, &L->q_norm, &L->k_norm,
                                &L->post_attn_norm, &L->post_ffn_norm, &L->attn_norm_b, &L->ffn_norm_b, &L->b_up,
                                &L->b_down};
        int lens[] = {dim, dim, q_dim, kv_dim, kv_dim, dim, c->head_dim, c->head_dim, dim, dim, dim, dim,
                      c->intermediate_size, dim};
        for (size_t i = 0; i < sizeof(vecs) / sizeof(vecs[0]) && st == MODEL_OK; i++)
            st = upload_vec(m, vecs[i], lens[i], err);
        if (c->arch == ARCH_MAMBA && st == MODEL_OK)
            st = mamba_upload(m, L, err);
    }
    if (st == MODEL_OK)
        w->layers = m->dev_layers;
    return st;
}

static size_t charged(size_t n)
{
    return be_charged(n);
}

/* What weights_upload charges, from the config alone: every matrix is of
 * torch_dtype (safetensors.c refuses others) or, for a layer's matrices
 * under q8_0 or q4_k, of their blocks; every vector f32. */
static size_t weights_bytes(const struct model_config *c, enum model_weights_fmt wf)
{
    size_t dsz = be_dtype_size(c->dtype), dim = (size_t)c->hidden_size, ffn = (size_t)c->intermediate_size;
    size_t q_dim = (size_t)c->n_heads * c->head_dim, kv_dim = (size_t)c->n_kv_heads * c->head_dim;
    size_t embed = charged((size_t)c->vocab_size * dim * dsz);
    bool ln = c->layer_norm;
    size_t total = (c->tie_word_embeddings ? 1 : 2) * embed + charged(dim * 4) + (ln ? charged(dim * 4) : 0);
    if (c->learned_pos)
        total += charged((size_t)c->max_position_embeddings * dim * dsz);
    size_t rows[] = {q_dim, kv_dim, kv_dim, dim, c->ungated_mlp ? 0 : ffn, ffn, dim};
    size_t cols[] = {dim, dim, dim, q_dim, dim, dim, ffn};
    size_t vecs[] = {dim, dim, c->attention_bias ? q_dim : 0, c->attention_bias ? kv_dim : 0,
                     c->attention_bias ? kv_dim : 0, c->o_bias ? dim : 0, c->qk_norm ? (size_t)c->head_dim : 0,
                     c->qk_norm ? (size_t)c->head_dim : 0, c->sandwich_norms ? dim : 0, c->sandwich_norms ? dim : 0,
                     ln ? dim : 0, ln ? dim : 0, c->ungated_mlp ? ffn : 0, c->ungated_mlp ? dim : 0};
    size_t layer = 0;
    if (c->arch == ARCH_MAMBA) { /* mamba_upload's copies: as stored, or quantized where the rows are whole Q8_0 blocks */
        size_t inner = (size_t)c->intermediate_size, N = (size_t)c->ssm_state, R = (size_t)c->ssm_dt_rank;
        size_t mr[] = {inner, inner, R, N, N, inner, dim}, mc[] = {dim, dim, inner, inner, inner, R, inner};
        size_t mv[] = {dim, c->ssm_bias ? inner : 0, c->ssm_bias ? inner : 0, inner * (size_t)c->ssm_conv,
                       c->ssm_conv_bias ? inner : 0, inner, inner * N, inner, c->ssm_bias ? dim : 0};
        for (size_t i = 0; i < sizeof(mr) / sizeof(mr[0]); i++) {
            enum be_dtype mt = wf == MODEL_WEIGHTS_AUTO || mc[i] % Q8_0_BLOCK ? c->dtype
                                                                             : model_weights_mat_dtype(wf, (int)mc[i]);
            layer += charged(mr[i] * be_row_bytes(mt, mc[i]));
        }
        for (size_t i = 0; i < sizeof(mv) / sizeof(mv[0]); i++)
            layer += charged(mv[i] * 4);
        return total + (size_t)c->n_layers * layer;
    }
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        enum be_dtype mt = wf == MODEL_WEIGHTS_AUTO ? c->dtype : model_weights_mat_dtype(wf, (int)cols[i]);
        layer += charged(rows[i] * be_row_bytes(mt, cols[i]));
    }
    for (size_t i = 0; i < sizeof(vecs) / sizeof(vecs[0]); i++)
        layer += charged(vecs[i] * 4);
    return total + (size_t)c->n_layers * layer;
}

struct model_device_bytes model_device_bytes(const struct model_config *c, struct be_caps caps,
                                             const struct model_params *p)
{
    size_t sizes[RS_BUFS], act = 0;
    int cap = p && p->max_batch_tokens > 0 ? p->max_batch_tokens : 256;
    enum be_dtype kv = model_kv_dtype_resolve(p ? p->kv_dtype : MODEL_KV_AUTO, c->dtype);
    run_state_sizes(c, be_dtype_size(caps.act_dtype), cap, sizes);
    for (int i = 0; i < RS_BUFS; i++)
        act += charged(sizes[i]);
    return (struct model_device_bytes){
        .weights = caps.unified_memory ? 0 : weights_bytes(c, p ? p->weights : MODEL_WEIGHTS_AUTO),
        .activations = act,
        .kv_per_token = (size_t)c->n_layers * 2 * (size_t)c->n_kv_heads * (size_t)c->head_dim * be_dtype_size(kv),
        .state_per_seq = c->arch == ARCH_MAMBA ? 2 * (size_t)c->n_layers *
                                                     be_ssm_state_bytes(c->intermediate_size, c->ssm_state, c->ssm_conv)
                                               : 0,
    };
}

const char *model_sink_refusal(const struct model_config *c)
{
    if (c->learned_pos)
        return "this model has learned absolute positions (n_positions), which a sink cache would re-rotate";
    /* attention rotates a sink cache's keys whole, with one table */
    if (c->rot_dim != c->head_dim)
        return "this model rotates part of each head (partial_rotary_factor)";
    if (c->rope_local_theta > 0.0f)
        return "this model rotates its layers with two RoPE bases";
    /* whose keys were rotated with short_factor and whose with long_factor
     * depends on the step that computed them, not on the cache index */
    if (c->rope_scaling == ROPE_SCALING_LONGROPE)
        return "this model's longrope rotates with long_factor past original_max_position_embeddings";
    return NULL;
}

int model_context(const struct model_config *c, int want)
{
    int max_pos = c->max_position_embeddings; /* config.c guarantees >= 1 */
    return want > 0 && want < max_pos ? want : max_pos;
}

bool model_has_full_layer(const struct model_config *c)
{
    for (int l = 0; l < c->n_layers; l++)
        if (!c->layer_window[l])
            return true;
    return false;
}

static void weights_free(model *m)
{
    for (int i = 0; i < m->n_wbufs; i++)
        be_buffer_free(m->wbufs[i]);
    free(m->wbufs);
    free(m->dev_layers);
    free(m->q_layers);
    free(m->qblocks);
}

enum model_status model_load(const char *dir, be_backend *be, const struct model_params *p, model **out, char *err)
{
    char scratch[MODEL_ERR_LEN];
    if (!err)
        err = scratch;
    err[0] = '\0';
    *out = NULL;
    model *m = calloc(1, sizeof(*m));
    if (!m) {
        snprintf(err, MODEL_ERR_LEN, "out of host memory");
        return MODEL_ENOMEM;
    }
    m->be = be;
    enum model_status st = model_config_load(dir, &m->cfg, err);
    if (st == MODEL_OK) {
        m->kv_dtype = model_kv_dtype_resolve(p ? p->kv_dtype : MODEL_KV_AUTO, m->cfg.dtype);
        st = model_files_open(dir, &m->cfg, &m->files, &m->w, err);
    }
    /* before the passes below read the weights, so they read memory */
    if (st == MODEL_OK && p && p->page_in)
        st = model_files_page_in(m->files, p->page_in, p->page_in_arg, err);
    if (st == MODEL_OK && p && p->verify_weights)
        st = model_weights_verify(&m->cfg, &m->w, err);
    m->wfmt = p ? p->weights : MODEL_WEIGHTS_AUTO;
    if (st == MODEL_OK && m->wfmt != MODEL_WEIGHTS_AUTO)
        st = model_weights_quantize(&m->cfg, &m->w, m->wfmt, &m->qblocks, &m->q_layers, err);
    if (st == MODEL_OK && !be_get_caps(be).unified_memory)
        st = weights_upload(m, err);
    int cap = p && p->max_batch_tokens > 0 ? p->max_batch_tokens : 256; /* model_device_bytes assumes it too */
    if (st == MODEL_OK)
        st = run_state_alloc(m, cap, err);
    if (st != MODEL_OK) {
        model_free(m);
        return st;
    }
    *out = m;
    return MODEL_OK;
}

void model_free(model *m)
{
    if (!m)
        return;
    run_state_free(&m->rs);
    weights_free(m);
    model_files_close(m->files);
    model_config_release(&m->cfg);
    free(m);
}

/* ---------------------------------------------------------------------------
 * The forward pass
 * ------------------------------------------------------------------------- */

/* Failures of the kernels below are programming errors or device faults,
 * not input errors: the inputs were validated before the first kernel. */
static enum be_status matmul(model *m, void *y, const void *x, const struct model_mat *w, const float *bias, int n)
{
    return be_matmul(m->be, y, m->rs.act, x, w->data, w->dtype, bias, n, w->cols, w->rows);
}

/* The block norm of rows [n, dim]: LayerNorm with bias b (GPT-2), else RMSNorm. */
static enum be_status norm(model *m, void *y, const void *x, const float *w, const float *b, int n)
{
    const struct model_config *c = &m->cfg;
    return b ? be_layernorm(m->be, y, x, w, b, n, c->hidden_size, c->rms_norm_eps)
             : be_rmsnorm(m->be, y, x, w, n, c->hidden_size, c->rms_norm_eps);
}

/* One transformer block over the chunk's n rows, in place on rs->x. */
static enum be_status layer_forward(model *m, int l, int n)
{
    const struct model_config *c = &m->cfg;
    const struct model_layer *L = &m->w.layers[l];
    struct run_state *rs = &m->rs;
    be_backend *be = m->be;
    int dim = c->hidden_size, hd = c->head_dim;
    struct be_attn_params ap = {
        .n_heads = c->n_heads,
        .n_kv_heads = c->n_kv_heads,
        .head_dim = hd,
        .scale = c->attn_scale,
        .softcap = c->attn_softcap,
        .window = c->layer_window[l],
        .kv_dtype = rs->kv_dtype,
        .key_rope = rs->key_rope_buf ? be_buffer_data(rs->key_rope_buf) : NULL,
        .key_rope_rows = rs->key_rope_rows,
        .key_rope_layout = c->rope_layout,
    };

    /* Gemma 3's sliding layers rotate with their own base */
    const float *inv_freq = c->layer_window[l] ? rs->inv_freq_local : rs->inv_freq;

    /* attention */
    BE_TRY(norm(m, rs->xb, rs->x, L->attn_norm, L->attn_norm_b, n));          /* xb (n, dim) */
    BE_TRY(matmul(m, rs->q, rs->xb, &L->wq, L->bq, n));                          /* q (n, n_heads*hd) */
    BE_TRY(matmul(m, rs->k, rs->xb, &L->wk, L->bk, n));                          /* k (n, n_kv*hd) */
    BE_TRY(matmul(m, rs->v, rs->xb, &L->wv, L->bv, n));                          /* v (n, n_kv*hd) */
    if (L->q_norm) { /* Qwen3, Gemma 3: RMSNorm over each head's vector, before RoPE */
        BE_TRY(be_rmsnorm(be, rs->q, rs->q, L->q_norm, n * c->n_heads, hd, c->rms_norm_eps));
        BE_TRY(be_rmsnorm(be, rs->k, rs->k, L->k_norm, n * c->n_kv_heads, hd, c->rms_norm_eps));
    }
    if (!c->learned_pos) { /* GPT-2 added its positions to the embeddings */
        float ms = c->rope_attn_factor;
        size_t q_row = (size_t)c->n_heads * hd * rs->esz, k_row = (size_t)c->n_kv_heads * hd * rs->esz;
        /* one call per run of rows sharing a table: a single one unless the
         * chunk holds longrope sequences on both sides of the threshold */
        for (int r0 = 0, r = 1; r <= n; r++) {
            if (r < n && rs->row_long[r] == rs->row_long[r0])
                continue;
            const float *tab = rs->row_long[r0] ? rs->inv_freq_long : inv_freq;
            int cnt = r - r0;
            BE_TRY(be_rope(be, (char *)rs->q + (size_t)r0 * q_row, cnt, c->n_heads, hd, rs->qpos + r0, tab, c->rot_dim,
                           ms, c->rope_layout));
            BE_TRY(be_rope(be, (char *)rs->k + (size_t)r0 * k_row, cnt, c->n_kv_heads, hd, rs->kpos + r0, tab,
                           c->rot_dim, ms, c->rope_layout));
            r0 = r;
        }
    }
    BE_TRY(be_kv_store(be, rs->views, rs->toks, n, rs->k, rs->v, &ap));      /* paged KV += k, v */
    BE_TRY(rs->any_quant ? be_attention_quant(be, rs->att, rs->q, rs->qviews, rs->toks, n, &ap) /* codes read in place */
                         : be_attention(be, rs->att, rs->q, rs->views, rs->toks, n, &ap)); /* att (n, n_heads*hd) */
    BE_TRY(matmul(m, rs->xb, rs->att, &L->wo, L->bo, n));                    /* xb (n, dim) */
    if (L->post_attn_norm) /* Gemma: the block's output is normed too */
        BE_TRY(be_rmsnorm(be, rs->xb, rs->xb, L->post_attn_norm, n, dim, c->rms_norm_eps));
    BE_TRY(be_add(be, rs->x, rs->xb, (size_t)n * dim));                      /* x += attn */

    /* MLP: down(act(gate(x)) * up(x)), act silu (SwiGLU) or gelu_tanh
     * (GeGLU); GPT-2: down(gelu_tanh(up(x) + b)) + b */
    size_t nf = (size_t)n * c->intermediate_size;
    BE_TRY(norm(m, rs->xb, rs->x, L->ffn_norm, L->ffn_norm_b, n));
    if (c->ungated_mlp) {
        BE_TRY(matmul(m, rs->hb, rs->xb, &L->w_up, L->b_up, n));             /* hb (n, ffn) */
        BE_TRY(be_gelu_mul(be, rs->hb, rs->hb, NULL, nf));
    } else {
        BE_TRY(matmul(m, rs->hb, rs->xb, &L->w_gate, NULL, n));              /* hb (n, ffn) */
        BE_TRY(matmul(m, rs->hb2, rs->xb, &L->w_up, NULL, n));               /* hb2 (n, ffn) */
        BE_TRY(c->act == ACT_GELU_TANH ? be_gelu_mul(be, rs->hb, rs->hb, rs->hb2, nf)
                                       : be_silu_mul(be, rs->hb, rs->hb, rs->hb2, nf));
    }
    BE_TRY(matmul(m, rs->xb, rs->hb, &L->w_down, L->b_down, n));             /* xb (n, dim) */
    if (L->post_ffn_norm)
        BE_TRY(be_rmsnorm(be, rs->xb, rs->xb, L->post_ffn_norm, n, dim, c->rms_norm_eps));
    BE_TRY(be_add(be, rs->x, rs->xb, (size_t)n * dim));                      /* x += mlp */
    return BE_OK;
}

/* One Mamba block over the chunk's n rows, in place on rs->x; each
 * sequence's state of layer l is in rs->sviews. */
static enum be_status mamba_layer_forward(model *m, int l, int n)
{
    const struct model_config *c = &m->cfg;
    const struct model_layer *L = &m->w.layers[l];
    struct run_state *rs = &m->rs;
    be_backend *be = m->be;
    int inner = c->intermediate_size;
    struct be_ssm_params sp = {.d_inner = inner, .d_state = c->ssm_state, .d_conv = c->ssm_conv,
                               .conv_w = L->ssm_conv_w, .conv_b = L->ssm_conv_b, .A = L->ssm_A, .D = L->ssm_D};
    void *B = rs->xb, *C = (char *)rs->xb + (size_t)rs->cap * c->ssm_state * rs->esz;
    BE_TRY(norm(m, rs->xb, rs->x, L->attn_norm, NULL, n));                   /* xb (n, dim) */
    BE_TRY(matmul(m, rs->hb, rs->xb, &L->ssm_in_x, L->ssm_in_bx, n));         /* hb = x (n, inner) */
    BE_TRY(matmul(m, rs->hb2, rs->xb, &L->ssm_in_z, L->ssm_in_bz, n));        /* hb2 = z (n, inner) */
    BE_TRY(be_ssm_conv(be, rs->q, rs->hb, rs->sviews, rs->toks, n, &sp));    /* q = silu(conv(x)) (n, inner) */
    BE_TRY(matmul(m, rs->v, rs->q, &L->ssm_x_dt, NULL, n));                   /* v (n, rank) */
    BE_TRY(matmul(m, B, rs->q, &L->ssm_x_B, NULL, n));                        /* B (n, state) */
    BE_TRY(matmul(m, C, rs->q, &L->ssm_x_C, NULL, n));                        /* C (n, state) */
    BE_TRY(matmul(m, rs->k, rs->v, &L->ssm_dt, L->ssm_dt_b, n));              /* k = dt before softplus (n, inner) */
    BE_TRY(be_ssm_scan(be, rs->att, rs->q, rs->k, B, C, rs->hb2, rs->sviews, rs->toks, n, &sp)); /* att (n, inner) */
    BE_TRY(matmul(m, rs->xb, rs->att, &L->ssm_out, L->ssm_out_b, n));         /* xb (n, dim) */
    BE_TRY(be_add(be, rs->x, rs->xb, (size_t)n * c->hidden_size));           /* x += mixer */
    return BE_OK;
}

/* Writes the logits of the chunk rows that asked for them into each
 * entry's host buffer.  Rows are gathered into xb so lm_head runs once per
 * slice of logit_rows rows. */
static enum be_status chunk_logits(model *m, struct fw_seq *seqs, int n)
{
    const struct model_config *c = &m->cfg;
    struct run_state *rs = &m->rs;
    size_t dim = (size_t)c->hidden_size, vocab = (size_t)c->vocab_size;
    BE_TRY(norm(m, rs->x, rs->x, m->w.final_norm, m->w.final_norm_b, n));
    int r = 0;
    while (r < n) {
        int sel[64], n_sel = 0; /* rows of this slice; logit_rows <= 16 */
        for (; r < n && n_sel < rs->logit_rows; r++) {
            const struct fw_seq *s = &seqs[rs->row_seq[r]];
            if (s->logits && (s->want_all_logits || rs->row_tok[r] == s->n_tokens - 1))
                sel[n_sel++] = r;
        }
        if (!n_sel)
            continue;
        size_t row = dim * rs->esz;
        for (int i = 0; i < n_sel; i++)
            BE_TRY(be_copy(m->be, (char *)rs->xb + i * row, (char *)rs->x + sel[i] * row, row, BE_D2D));
        const struct model_mat *head = &m->w.lm_head; /* logits (n_sel, vocab), f32 whatever act is */
        BE_TRY(be_matmul(m->be, rs->logits, BE_F32, rs->xb, head->data, head->dtype, NULL, n_sel, head->cols,
                         head->rows));
        for (int i = 0; i < n_sel; i++) {
            const struct fw_seq *s = &seqs[rs->row_seq[sel[i]]];
            float *dst = s->logits + (s->want_all_logits ? (size_t)rs->row_tok[sel[i]] * vocab : 0);
            BE_TRY(be_copy(m->be, dst, (float *)rs->logits + i * vocab, vocab * 4, BE_D2H));
            if (c->final_softcap > 0.0f) /* Gemma 2: cap * tanh(logit / cap), in f32 on the host copy */
                for (size_t j = 0; j < vocab; j++)
                    dst[j] = c->final_softcap * tanhf(dst[j] / c->final_softcap);
        }
    }
    return BE_OK;
}

enum model_status model_from_tier(enum tier_status st)
{
    switch (st) {
    case TIER_OK: return MODEL_OK;
    case TIER_ENOMEM_DEV: return MODEL_EDEVMEM;
    case TIER_ENOMEM_HOST: return MODEL_ENOMEM;
    case TIER_EFULL: return MODEL_EKVFULL;
    case TIER_EINVAL: return MODEL_EINVAL;
    case TIER_ENOTSUP: return MODEL_EUNSUPPORTED;
    default: return MODEL_EBACKEND;
    }
}

enum model_status model_from_be(enum be_status st)
{
    switch (st) {
    case BE_OK: return MODEL_OK;
    case BE_ENOMEM_DEV: return MODEL_EDEVMEM;
    case BE_ENOMEM_HOST: return MODEL_ENOMEM;
    default: return MODEL_EBACKEND;
    }
}

/* Runs the next n rows of the batch's token stream through the whole
 * model; (*s, *t) is the entry and token the chunk starts at and is
 * advanced past it. */
static enum be_status chunk_forward(model *m, struct fw_seq *seqs, int *s, int *t, int n, const int64_t *start)
{
    const struct model_config *c = &m->cfg;
    struct run_state *rs = &m->rs;
    int n_views = 0;
    for (int r = 0; r < n; r++) {
        while (*t == seqs[*s].n_tokens) {
            (*s)++;
            *t = 0;
        }
        if (r == 0 || rs->row_seq[r - 1] != *s)
            n_views++;
        rs->row_seq[r] = *s;
        rs->row_tok[r] = *t;
        /* transformers picks the table per forward call from its last
         * position; kvtier's call for this sequence is its step, or the
         * whole prefill the step is a part of */
        int64_t end = start[*s] + seqs[*s].n_tokens;
        if (seqs[*s].call_len > end)
            end = seqs[*s].call_len;
        rs->row_long[r] = c->rope_scaling == ROPE_SCALING_LONGROPE && end > c->rope_original_max_pos;
        rs->ids[r] = seqs[*s].tokens[*t];
        rs->pos[r] = start[*s] + *t;
        if (c->learned_pos) /* model_forward kept them below n_positions */
            rs->pos_ids[r] = (int32_t)rs->pos[r];
        kv_seq_rope_pos(seqs[*s].kv, rs->pos[r], &rs->qpos[r], &rs->kpos[r]); /* sink: cache indices */
        rs->toks[r] = (struct be_tok){.view = n_views - 1, .pos = rs->pos[r]};
        (*t)++;
    }
    for (int r = 0, first = 0; r < n; r++) {
        if (r + 1 == n || rs->row_seq[r + 1] != rs->row_seq[r]) {
            kv_seq_chunk(seqs[rs->row_seq[r]].kv, rs->pos[first], rs->pos[r] + 1);
            first = r + 1;
        }
    }
    BE_TRY(be_embed(m->be, rs->x, m->w.tok_embed.data, m->w.tok_embed.dtype, rs->ids, n, c->hidden_size));
    if (c->embed_scale > 0.0f) /* Gemma */
        BE_TRY(be_scale(m->be, rs->x, (size_t)n * c->hidden_size, rs->embed_scale));
    if (c->learned_pos) { /* GPT-2: x += wpe[position] */
        BE_TRY(be_embed(m->be, rs->xb, m->w.pos_embed.data, m->w.pos_embed.dtype, rs->pos_ids, n, c->hidden_size));
        BE_TRY(be_add(m->be, rs->x, rs->xb, (size_t)n * c->hidden_size));
    }
    kv_store *store = kv_seq_store(seqs[0].kv);
    rs->kv_dtype = kv_store_dtype(store);
    for (int l = 0; l < c->n_layers; l++) {
        BE_TRY(kv_store_layer_begin(store, l)); /* a streamed layer l is in its slot, the next is on its way */
        if (c->arch == ARCH_MAMBA) {
            for (int r = 0, v = 0; r < n; r++)
                if (r == 0 || rs->row_seq[r - 1] != rs->row_seq[r])
                    kv_seq_state_view(seqs[rs->row_seq[r]].kv, l, &rs->sviews[v++]);
            BE_TRY(mamba_layer_forward(m, l, n));
            BE_TRY(kv_store_layer_end(store, l));
            continue;
        }
        rs->any_quant = false;
        for (int r = 0, v = 0; r < n; r++)
            if (r == 0 || rs->row_seq[r - 1] != rs->row_seq[r]) {
                kv_seq_qview(seqs[rs->row_seq[r]].kv, l, &rs->qviews[v]);
                rs->views[v] = rs->qviews[v].rest; /* where be_kv_store writes */
                rs->any_quant |= rs->qviews[v++].fmt != NULL;
            }
        BE_TRY(layer_forward(m, l, n));
        BE_TRY(kv_store_layer_end(store, l)); /* the blocks this chunk wrote go back to the host tier */
    }
    return chunk_logits(m, seqs, n);
}

/* Makes the key rotation table of the sink strategy cover cache index
 * rows - 1: row j is be_rope applied to (1, 0) pairs at position j, so
 * attention rotates a key with the very cos and sin be_rope would use.  It
 * doubles, so steady decoding (rows bounded by the window) never
 * allocates; a failure leaves the old table. */
static enum model_status key_rope_reserve(model *m, int64_t rows)
{
    struct run_state *rs = &m->rs;
    if (rows <= rs->key_rope_rows)
        return MODEL_OK;
    if (model_sink_refusal(&m->cfg))
        return MODEL_EUNSUPPORTED;
    /* the (1, 0) pairs are written on the host, as f32 */
    if (rs->act != BE_F32)
        return MODEL_EUNSUPPORTED;
    int64_t n = rs->key_rope_rows ? 2 * rs->key_rope_rows : 64;
    while (n < rows)
        n *= 2;
    int hd = m->cfg.head_dim;
    size_t bytes = (size_t)n * (size_t)hd * sizeof(float);
    float *ones = malloc(bytes);
    int64_t *pos = malloc((size_t)n * sizeof(*pos));
    be_buffer *buf = NULL;
    enum be_status st = ones && pos ? be_dev_alloc(m->be, bytes, &buf) : BE_ENOMEM_HOST;
    if (st == BE_OK) {
        for (int64_t j = 0; j < n; j++) {
            pos[j] = j;
            for (int i = 0; i < hd; i++) /* 1 in the first slot of each rotated pair */
                ones[j * hd + i] = (m->cfg.rope_layout == BE_ROPE_NEOX ? i < hd / 2 : i % 2 == 0) ? 1.0f : 0.0f;
        }
        st = be_copy(m->be, be_buffer_data(buf), ones, bytes, BE_H2D);
    }
    if (st == BE_OK)
        st = be_rope(m->be, be_buffer_data(buf), (int)n, 1, hd, pos, rs->inv_freq, hd, m->cfg.rope_attn_factor,
                     m->cfg.rope_layout);
    free(ones);
    free(pos);
    if (st != BE_OK) {
        be_buffer_free(buf);
        return model_from_be(st);
    }
    be_buffer_free(rs->key_rope_buf);
    rs->key_rope_buf = buf;
    rs->key_rope_rows = n;
    return MODEL_OK;
}

/* The cache indices this step's sink sequences read (0 when none). */
static int64_t key_rope_rows_needed(const struct fw_seq *seqs, int n_seqs)
{
    int64_t rows = 0;
    for (int i = 0; i < n_seqs; i++) {
        struct be_kv_view v;
        kv_seq_view(seqs[i].kv, 0, &v);
        if (v.key_rope && v.hi - v.shift > rows)
            rows = v.hi - v.shift;
    }
    return rows;
}

/* A state store checkpoints where a chunk ends on a multiple of its
 * interval: the chunk of n rows starting at token t of entry s ends
 * earlier if one of its sequences would pass a multiple inside it. */
static int checkpoint_cut(const struct fw_seq *seqs, int n_seqs, const int64_t *start, int interval, int s, int t,
                          int n)
{
    if (!interval)
        return n;
    for (int rows = 0; s < n_seqs && rows < n; s++, t = 0) {
        int64_t pos = start[s] + t, end = start[s] + seqs[s].n_tokens;
        int64_t next = (pos / interval + 1) * interval; /* the first multiple past pos */
        if (next < end && rows + (next - pos) < n)
            return rows + (int)(next - pos);
        rows += (int)(end - pos);
    }
    return n;
}

/* One attempt at the step: reserve every sequence's new tokens up front
 * and commit only at the end, so a failure anywhere leaves every KV
 * exactly as it was.  *culprit: the sequence whose reserve failed, or -1. */
static enum model_status forward_step(model *m, struct fw_seq *seqs, int n_seqs, int64_t total, int64_t *start,
                                      int *culprit)
{
    kv_store *store = kv_seq_store(seqs[0].kv);
    enum model_status st = MODEL_OK;
    int reserved = 0;
    *culprit = -1;
    for (; reserved < n_seqs; reserved++) {
        start[reserved] = kv_seq_length(seqs[reserved].kv);
        if (seqs[reserved].call_len > start[reserved] + seqs[reserved].n_tokens)
            kv_seq_update_continues(seqs[reserved].kv); /* a prefill's part */
        st = model_from_tier(kv_seq_reserve(seqs[reserved].kv, seqs[reserved].n_tokens));
        if (st != MODEL_OK) {
            *culprit = reserved;
            break;
        }
        kv_seq_tokens(seqs[reserved].kv, seqs[reserved].tokens); /* the prefix cache publishes by token ids */
    }
    if (st == MODEL_OK && m->cfg.arch != ARCH_MAMBA)
        st = key_rope_reserve(m, key_rope_rows_needed(seqs, n_seqs));
    if (st == MODEL_OK)
        st = model_from_tier(kv_store_step_begin(store)); /* device slots for the streamed layers */
    int s = 0, t = 0;
    for (int64_t done = 0; st == MODEL_OK && done < total;) {
        int n = total - done < m->rs.cap ? (int)(total - done) : m->rs.cap;
        n = checkpoint_cut(seqs, n_seqs, start, kv_store_checkpoint_interval(store), s, t, n);
        st = model_from_be(chunk_forward(m, seqs, &s, &t, n, start));
        done += n;
    }
    enum be_status drained = kv_store_step_end(store); /* write-backs land before the commit */
    if (st == MODEL_OK)
        st = model_from_be(drained);
    /* A commit fails only on a device fault, which no retry mends: the
     * step reports it, the other sequences commit as computed. */
    enum model_status committed = MODEL_OK;
    for (int i = 0; i < reserved; i++) {
        if (st != MODEL_OK)
            kv_seq_abort(seqs[i].kv);
        else if (kv_seq_commit(seqs[i].kv) != TIER_OK)
            committed = MODEL_EBACKEND;
    }
    return st == MODEL_OK ? committed : st;
}

/* After a step ran out of device memory: moves one sequence's KV to the
 * host tier (the one whose reserve failed first, else the first holding
 * device KV that may fall back) so the step can be redone.  False when
 * nothing could move; *st is then MODEL_ENOMEM if the host tier is full
 * too (kv_store_errmsg names the budget). */
static bool continue_offloaded(struct fw_seq *seqs, int n_seqs, int culprit, enum model_status *st)
{
    for (int k = -1; k < n_seqs; k++) {
        int i = k < 0 ? culprit : k;
        if (i < 0 || (k >= 0 && i == culprit) || !kv_seq_stats(seqs[i].kv).resident_layers)
            continue;
        enum tier_status ts = kv_seq_offload(seqs[i].kv, KV_FALLBACK_OOM);
        if (ts == TIER_OK)
            return true;
        if (ts != TIER_ENOTSUP) { /* no_fallback sequences refuse; try the next */
            *st = model_from_tier(ts);
            return false;
        }
    }
    return false;
}

enum model_status model_forward(model *m, struct fw_seq *seqs, int n_seqs)
{
    const struct model_config *c = &m->cfg;
    int64_t total = 0;
    if (n_seqs <= 0)
        return MODEL_EINVAL;
    for (int i = 0; i < n_seqs; i++) {
        if (!seqs[i].kv || seqs[i].n_tokens <= 0 || !seqs[i].tokens ||
            kv_seq_store(seqs[i].kv) != kv_seq_store(seqs[0].kv))
            return MODEL_EINVAL;
        for (int t = 0; t < seqs[i].n_tokens; t++)
            if (seqs[i].tokens[t] < 0 || seqs[i].tokens[t] >= c->vocab_size)
                return MODEL_EINVAL;
        /* learned positions end at n_positions (model_context keeps the
         * daemon's requests inside) */
        if (c->learned_pos && kv_seq_length(seqs[i].kv) + seqs[i].n_tokens > c->max_position_embeddings)
            return MODEL_EINVAL;
        total += seqs[i].n_tokens;
    }
    struct run_state *rs = &m->rs;
    if (n_seqs > rs->start_cap) { /* grows with the largest batch seen, not per call */
        int64_t *p = realloc(rs->start, (size_t)n_seqs * sizeof(*p));
        if (!p)
            return MODEL_ENOMEM;
        rs->start = p;
        rs->start_cap = n_seqs;
    }
    /* Out of device memory is not the end of the request: the step is
     * redone with KV moved to the host tier, nothing recomputed,
     * until it fits or nothing is left to move.  Each round moves one
     * more sequence, so this ends. */
    enum model_status st;
    int culprit;
    while ((st = forward_step(m, seqs, n_seqs, total, rs->start, &culprit)) == MODEL_EDEVMEM &&
           continue_offloaded(seqs, n_seqs, culprit, &st))
        ;
    return st;
}
