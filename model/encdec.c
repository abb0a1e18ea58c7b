/* encdec.c - T5 and BART: the encoder over a whole input and the decoder
 * a step at a time, with the decoder's self- and cross-attention KV in the
 * paged store (encdec.h says how the two sequences share it).
 *
 * T5, per block (pre-norm): x += attn(rms(x)) [+ cross(rms(x))] +
 *   ffn(rms(x)), ffn = wo(relu(wi x)) or wo(gelu_tanh(wi_0 x) * wi_1 x);
 *   scores unscaled plus the relative position bias of the stack (its
 *   first layer's table, buckets of key - query: split by sign in the
 *   encoder, causal in the decoder); no position embeddings; each stack
 *   ends in an RMS norm; a tied head reads x * d_model^-0.5.
 * BART, per block (post-norm): x = ln(x + attn(x)) [x = ln(x + cross(x))]
 *   x = ln(x + fc2(gelu(fc1 x))); every projection biased, scores scaled
 *   by head_dim^-0.5; embeddings (* sqrt(d_model) when scale_embedding) +
 *   positions[pos + 2], then layernorm_embedding; logits + final_logits_bias.
 *
 * The encoder's own K and V live, layer by layer, in the cross sequence's
 * blocks (positions [0, S) of one decoder layer) until the cross K and V
 * overwrite them: its input needs no scratch of its own beyond the (S, dim)
 * residual stream.
 */
#include "model/encdec.h"
#include "model/safetensors.h"
#include "util/half.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

struct ed_attn {
    struct model_mat q, k, v, o;      /* (H*hd, dim) x3, (dim, H*hd) */
    const float *bq, *bk, *bv, *bo;   /* BART: (H*hd) x3, (dim); T5: NULL */
};

struct ed_layer {
    struct ed_attn self, cross;       /* cross: decoder layers only */
    /* T5: the RMS norms before each sublayer; BART: the LayerNorms after
     * each residual add (with biases) */
    const float *self_norm, *self_norm_b, *cross_norm, *cross_norm_b, *ffn_norm, *ffn_norm_b;
    struct model_mat wi, wi_1, wo;    /* T5: wi or wi_0 + wi_1, wo; BART: fc1, (none), fc2 */
    const float *b_i, *b_o;           /* BART: fc1, fc2 biases */
};

struct ed_stack {
    struct ed_layer *layers;
    int n;
    struct model_mat rel_bias;        /* T5: (num_buckets, heads) */
    const float *final_norm;          /* T5 */
    struct model_mat pos;             /* BART: (max_positions + 2, dim) */
    const float *emb_norm, *emb_norm_b; /* BART: layernorm_embedding */
    be_buffer *bias_table;            /* T5: be_attn_params.rel_bias of this stack */
};

#define ED_BUFS 9
#define ED_LOGIT_ROWS 16

struct encdec {
    struct encdec_config cfg;
    be_backend *be;
    model_files *files;
    uint64_t header_hash;
    struct model_mat embed;           /* (vocab, dim) shared */
    struct model_mat lm_head;         /* = embed when tied */
    float *logits_bias;               /* BART: final_logits_bias (vocab), owned */
    struct ed_stack enc, dec;
    enum be_dtype kv_dtype;
    int cap;                          /* rows of the buffers below */
    enum be_dtype act;
    size_t esz;
    be_buffer *bufs[ED_BUFS];
    be_buffer **wbufs;                /* the weights' device copies (no unified memory) */
    int n_wbufs;
    void *x, *xb, *q, *k, *v, *att, *hb, *hb2; /* (cap, dim|H*hd|ffn) */
    void *logits;                     /* (logit_rows, vocab) f32 */
    int logit_rows;                   /* the head's rows at a time: min(ED_LOGIT_ROWS, cap) */
    struct be_tok *toks;              /* (cap) */
    int32_t *ids;                     /* (cap) BART's position rows */
    /* a decoder step's chunk, row by row (cap): its token, position and
     * sequence; and per sequence in it (at most cap) its views of a layer */
    int32_t *row_ids;
    int64_t *row_pos;
    int *row_seq;
    struct be_kvq_view *qviews;       /* self, as be_attention_quant reads it */
    struct be_kv_view *sviews, *cviews; /* self's dense part (where be_kv_store writes), cross */
    int64_t *start;                   /* (start_cap) each sequence's length before the step */
    int start_cap;
};

const struct encdec_config *encdec_get_config(const encdec *m)
{
    return &m->cfg;
}

int encdec_context(const struct encdec_config *c)
{
    return c->bart ? c->max_positions : ENCDEC_T5_CTX;
}

enum model_status encdec_model_config(const encdec *m, struct model_config *out)
{
    const struct encdec_config *c = &m->cfg;
    *out = (struct model_config){.arch_name = c->arch_name,
                                 .vocab_size = c->vocab_size,
                                 .hidden_size = c->d_model,
                                 .n_layers = c->n_dec_layers,
                                 .n_heads = c->n_heads,
                                 .n_kv_heads = c->n_heads,
                                 .head_dim = c->head_dim,
                                 .max_position_embeddings = encdec_context(c),
                                 .dtype = c->dtype,
                                 .n_eos = 1,
                                 .eos_token_ids = {c->eos_token_id},
                                 .config_hash = c->config_hash};
    out->layer_window = calloc((size_t)c->n_dec_layers, sizeof(*out->layer_window));
    return out->layer_window ? MODEL_OK : MODEL_ENOMEM;
}

struct kv_geom encdec_kv_geom(const encdec *m)
{
    return (struct kv_geom){.n_layers = m->cfg.n_dec_layers, .n_kv_heads = m->cfg.n_heads,
                            .head_dim = m->cfg.head_dim, .dtype = m->kv_dtype};
}

uint64_t encdec_fingerprint(const encdec *m)
{
    uint64_t h[2] = {m->cfg.config_hash, m->header_hash};
    return XXH3_64bits(h, sizeof h);
}

/* ---- config.json ---------------------------------------------------------- */

static const char *const ARCHS[2] = {"T5ForConditionalGeneration", "BartForConditionalGeneration"};

/* The index in ARCHS of root's architecture, or -1. */
static int arch_of(json_t *root)
{
    json_t *a = json_object_get(root, "architectures");
    for (size_t i = 0; json_is_array(a) && i < json_array_size(a); i++)
        for (int k = 0; k < 2; k++)
            if (json_is_string(json_array_get(a, i)) && !strcmp(json_string_value(json_array_get(a, i)), ARCHS[k]))
                return k;
    return -1;
}

bool encdec_is_encdec(const char *dir)
{
    json_t *root = NULL;
    bool yes = model_json_load(dir, "config.json", false, &root, NULL) == MODEL_OK && arch_of(root) >= 0;
    json_decref(root);
    return yes;
}

/* An integer field in [lo, hi]: def when absent (def < lo: required).  A
 * default is checked too: some depend on other fields (a token id against
 * vocab_size). */
static enum model_status get_int(json_t *root, const char *key, long long def, long long lo, long long hi, int *out,
                                 char *err)
{
    json_t *v = json_object_get(root, key);
    bool absent = !v || json_is_null(v);
    if (absent && def < lo)
        return model_errf(err, MODEL_ECONFIG, "config.json: %s is missing", key);
    if (!absent && !json_is_integer(v))
        return model_errf(err, MODEL_ECONFIG, "config.json: %s must be an integer in [%lld, %lld]", key, lo, hi);
    long long x = absent ? def : json_integer_value(v);
    if (absent && x > hi)
        return model_errf(err, MODEL_ECONFIG, "config.json: %s is absent and its default %lld is outside [%lld, %lld]",
                          key, x, lo, hi);
    if (x < lo || x > hi)
        return model_errf(err, MODEL_ECONFIG, "config.json: %s must be an integer in [%lld, %lld]", key, lo, hi);
    *out = (int)x;
    return MODEL_OK;
}

static enum model_status get_bool(json_t *root, const char *key, bool def, bool *out, char *err)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) {
        *out = def;
        return MODEL_OK;
    }
    if (!json_is_boolean(v))
        return model_errf(err, MODEL_ECONFIG, "config.json: %s must be true or false", key);
    *out = json_is_true(v);
    return MODEL_OK;
}

/* A string field that must be one of the values named (NULL-terminated;
 * the first is the default); *out its index. */
static enum model_status get_choice(json_t *root, const char *key, const char *const *values, int *out, char *err)
{
    json_t *v = json_object_get(root, key);
    *out = 0;
    if (!v || json_is_null(v))
        return MODEL_OK;
    for (int i = 0; json_is_string(v) && values[i]; i++)
        if (!strcmp(json_string_value(v), values[i])) {
            *out = i;
            return MODEL_OK;
        }
    return model_errf(err, MODEL_EUNSUPPORTED, "config.json: %s %s is not supported (%s%s%s)", key,
                      json_is_string(v) ? json_string_value(v) : "(not a string)", values[0],
                      values[1] ? ", " : "", values[1] ? values[1] : "");
}

#define BIG 1000000000LL

static enum model_status parse_config(json_t *root, struct encdec_config *c, char *err)
{
    int arch = arch_of(root);
    if (arch < 0)
        return model_errf(err, MODEL_EUNSUPPORTED, "config.json: not T5ForConditionalGeneration or "
                                                   "BartForConditionalGeneration");
    memset(c, 0, sizeof *c);
    c->bart = arch == 1;
    c->arch_name = ARCHS[arch];
    static const char *const dtypes[] = {"float32", "bfloat16", "float16", NULL};
    int dt, d_model;
    enum model_status st = get_choice(root, "torch_dtype", dtypes, &dt, err);
    if (!st)
        st = get_int(root, "vocab_size", -1, 1, BIG, &c->vocab_size, err);
    if (!st)
        st = get_int(root, "d_model", -1, 1, 1 << 16, &d_model, err);
    if (st)
        return st;
    c->dtype = dt == 0 ? BE_F32 : dt == 1 ? BE_BF16 : BE_F16;
    c->d_model = d_model;
    bool tie = true;
    if ((st = get_bool(root, "tie_word_embeddings", true, &tie, err)))
        return st;
    c->tie = tie;
    if (!c->bart) {
        static const char *const ffn[] = {"relu", "gated-gelu", NULL};
        int kind, dec;
        if ((st = get_int(root, "num_heads", -1, 1, 1024, &c->n_heads, err)) ||
            (st = get_int(root, "d_kv", -1, 1, MODEL_MAX_HEAD_DIM, &c->head_dim, err)) ||
            (st = get_int(root, "d_ff", -1, 1, 1 << 20, &c->ffn, err)) ||
            (st = get_int(root, "num_layers", -1, 1, 1024, &c->n_enc_layers, err)) ||
            (st = get_int(root, "num_decoder_layers", c->n_enc_layers, 1, 1024, &dec, err)) ||
            (st = get_int(root, "relative_attention_num_buckets", 32, 2, 1 << 16, &c->num_buckets, err)) ||
            (st = get_int(root, "relative_attention_max_distance", 128, 1, 1 << 20, &c->max_distance, err)) ||
            (st = get_choice(root, "feed_forward_proj", ffn, &kind, err)) ||
            (st = get_int(root, "decoder_start_token_id", 0, 0, c->vocab_size - 1, &c->decoder_start_token_id,
                          err)) ||
            (st = get_int(root, "eos_token_id", 1, 0, c->vocab_size - 1, &c->eos_token_id, err)))
            return st;
        c->n_dec_layers = dec;
        c->gated = kind == 1;
        json_t *eps = json_object_get(root, "layer_norm_epsilon");
        c->eps = json_is_number(eps) ? (float)json_number_value(eps) : 1e-6f;
        if (!(c->eps > 0.0f && c->eps < 1.0f))
            return model_errf(err, MODEL_ECONFIG, "config.json: layer_norm_epsilon must be in (0, 1)");
        /* the decoder's logarithmic buckets run from num_buckets / 2 to
         * max_distance: an empty range divides by log(1) = 0 */
        if (c->num_buckets < 4 || c->max_distance <= c->num_buckets / 2)
            return model_errf(err, MODEL_ECONFIG, "config.json: relative_attention_max_distance %d must pass half "
                              "of relative_attention_num_buckets %d (at least 4)", c->max_distance, c->num_buckets);
        return MODEL_OK;
    }
    static const char *const act[] = {"gelu", NULL};
    int kind, eh, dh, ef, df, ignored;
    bool pre, final_ln;
    if ((st = get_int(root, "encoder_layers", -1, 1, 1024, &c->n_enc_layers, err)) ||
        (st = get_int(root, "decoder_layers", -1, 1, 1024, &c->n_dec_layers, err)) ||
        (st = get_int(root, "encoder_attention_heads", -1, 1, 1024, &eh, err)) ||
        (st = get_int(root, "decoder_attention_heads", -1, 1, 1024, &dh, err)) ||
        (st = get_int(root, "encoder_ffn_dim", -1, 1, 1 << 20, &ef, err)) ||
        (st = get_int(root, "decoder_ffn_dim", -1, 1, 1 << 20, &df, err)) ||
        (st = get_int(root, "max_position_embeddings", -1, 1, 1 << 24, &c->max_positions, err)) ||
        (st = get_choice(root, "activation_function", act, &kind, err)) ||
        (st = get_bool(root, "scale_embedding", false, &c->scale_embedding, err)) ||
        (st = get_bool(root, "normalize_before", false, &pre, err)) ||
        (st = get_bool(root, "add_final_layer_norm", false, &final_ln, err)) ||
        (st = get_int(root, "decoder_start_token_id", 2, 0, c->vocab_size - 1, &c->decoder_start_token_id, err)) ||
        (st = get_int(root, "eos_token_id", 2, 0, c->vocab_size - 1, &c->eos_token_id, err)) ||
        (st = get_int(root, "pad_token_id", 1, 0, c->vocab_size - 1, &ignored, err)))
        return st;
    if (eh != dh || ef != df)
        return model_errf(err, MODEL_EUNSUPPORTED, "config.json: the encoder's and decoder's heads (%d, %d) and "
                          "ffn dims (%d, %d) must match", eh, dh, ef, df);
    if (pre || final_ln) /* mBART's layout */
        return model_errf(err, MODEL_EUNSUPPORTED, "config.json: normalize_before / add_final_layer_norm "
                          "(mBART's pre-norm layout) are not supported");
    if (d_model % eh)
        return model_errf(err, MODEL_ECONFIG, "config.json: d_model %d is not a multiple of the heads %d", d_model,
                          eh);
    if (d_model / eh > MODEL_MAX_HEAD_DIM)
        return model_errf(err, MODEL_ECONFIG, "config.json: d_model %d / encoder_attention_heads %d = %d exceeds the "
                          "widest head the kernels take (%d)", d_model, eh, d_model / eh, MODEL_MAX_HEAD_DIM);
    c->n_heads = eh;
    c->head_dim = d_model / eh;
    c->ffn = ef;
    c->eps = 1e-5f; /* nn.LayerNorm's default, which BART does not change */
    return MODEL_OK;
}

enum model_status encdec_config_load(const char *dir, struct encdec_config *c, char *err)
{
    json_t *root;
    enum model_status st = model_json_load(dir, "config.json", false, &root, err);
    if (st != MODEL_OK)
        return st;
    st = parse_config(root, c, err);
    char *canon = st == MODEL_OK ? json_dumps(root, JSON_SORT_KEYS | JSON_COMPACT) : NULL;
    if (canon)
        c->config_hash = XXH3_64bits(canon, strlen(canon));
    free(canon);
    json_decref(root);
    return st;
}

/* ---- weights -------------------------------------------------------------- */

struct bind_ctx {
    encdec *m;
    struct model_mat final_bias; /* BART: final_logits_bias as stored, (1, vocab) */
};

/* name = prefix + suffix in buf ("" when it does not fit: no tensor has that name) */
static const char *nm(char *buf, size_t size, const char *prefix, const char *suffix)
{
    return snprintf(buf, size, "%s%s", prefix, suffix) < (int)size ? buf : "";
}

static enum model_status bind_attn(struct binder *b, const struct encdec_config *c, const char *pre,
                                   struct ed_attn *a)
{
    char n[256];
    int qd = c->n_heads * c->head_dim, d = c->d_model;
    const char *names[4][2] = {{".q.weight", ".q_proj."}, {".k.weight", ".k_proj."}, {".v.weight", ".v_proj."},
                               {".o.weight", ".out_proj."}};
    struct model_mat *mats[4] = {&a->q, &a->k, &a->v, &a->o};
    const float **biases[4] = {&a->bq, &a->bk, &a->bv, &a->bo};
    enum model_status st = MODEL_OK;
    for (int i = 0; i < 4 && st == MODEL_OK; i++) {
        char full[256];
        snprintf(full, sizeof full, "%s%s%s", pre, names[i][c->bart], c->bart ? "weight" : "");
        st = model_bind_mat(b, full, i < 3 ? qd : d, i < 3 ? d : qd, mats[i]);
        if (st == MODEL_OK && c->bart) {
            snprintf(n, sizeof n, "%s%sbias", pre, names[i][1]);
            st = model_bind_vec(b, n, i < 3 ? qd : d, biases[i]);
        }
    }
    return st;
}

/* pre: "encoder.block.3." (T5) or "model.encoder.layers.3." (BART) */
static enum model_status bind_layer(struct binder *b, const struct encdec_config *c, const char *pre, bool decoder,
                                    struct ed_layer *L)
{
    char n[256], p[256];
    int d = c->d_model, f = c->ffn;
    enum model_status st;
    if (c->bart) {
        if ((st = bind_attn(b, c, nm(p, sizeof p, pre, "self_attn"), &L->self)) ||
            (st = model_bind_vec(b, nm(n, sizeof n, pre, "self_attn_layer_norm.weight"), d, &L->self_norm)) ||
            (st = model_bind_vec(b, nm(n, sizeof n, pre, "self_attn_layer_norm.bias"), d, &L->self_norm_b)) ||
            (st = model_bind_mat(b, nm(n, sizeof n, pre, "fc1.weight"), f, d, &L->wi)) ||
            (st = model_bind_vec(b, nm(n, sizeof n, pre, "fc1.bias"), f, &L->b_i)) ||
            (st = model_bind_mat(b, nm(n, sizeof n, pre, "fc2.weight"), d, f, &L->wo)) ||
            (st = model_bind_vec(b, nm(n, sizeof n, pre, "fc2.bias"), d, &L->b_o)) ||
            (st = model_bind_vec(b, nm(n, sizeof n, pre, "final_layer_norm.weight"), d, &L->ffn_norm)) ||
            (st = model_bind_vec(b, nm(n, sizeof n, pre, "final_layer_norm.bias"), d, &L->ffn_norm_b)))
            return st;
        if (!decoder)
            return MODEL_OK;
        if ((st = bind_attn(b, c, nm(p, sizeof p, pre, "encoder_attn"), &L->cross)) ||
            (st = model_bind_vec(b, nm(n, sizeof n, pre, "encoder_attn_layer_norm.weight"), d, &L->cross_norm)) ||
            (st = model_bind_vec(b, nm(n, sizeof n, pre, "encoder_attn_layer_norm.bias"), d, &L->cross_norm_b)))
            return st;
        return MODEL_OK;
    }
    int ffn_sub = decoder ? 2 : 1;
    char ff[256];
    snprintf(ff, sizeof ff, "%slayer.%d.", pre, ffn_sub);
    if ((st = bind_attn(b, c, nm(p, sizeof p, pre, "layer.0.SelfAttention"), &L->self)) ||
        (st = model_bind_vec(b, nm(n, sizeof n, pre, "layer.0.layer_norm.weight"), d, &L->self_norm)) ||
        (st = model_bind_mat(b, nm(n, sizeof n, ff, "DenseReluDense.wo.weight"), d, f, &L->wo)) ||
        (st = model_bind_vec(b, nm(n, sizeof n, ff, "layer_norm.weight"), d, &L->ffn_norm)))
        return st;
    if (c->gated) {
        if ((st = model_bind_mat(b, nm(n, sizeof n, ff, "DenseReluDense.wi_0.weight"), f, d, &L->wi)) ||
            (st = model_bind_mat(b, nm(n, sizeof n, ff, "DenseReluDense.wi_1.weight"), f, d, &L->wi_1)))
            return st;
    } else if ((st = model_bind_mat(b, nm(n, sizeof n, ff, "DenseReluDense.wi.weight"), f, d, &L->wi))) {
        return st;
    }
    if (!decoder)
        return MODEL_OK;
    if ((st = bind_attn(b, c, nm(p, sizeof p, pre, "layer.1.EncDecAttention"), &L->cross)) ||
        (st = model_bind_vec(b, nm(n, sizeof n, pre, "layer.1.layer_norm.weight"), d, &L->cross_norm)))
        return st;
    return MODEL_OK;
}

static enum model_status bind_stack(struct binder *b, const struct encdec_config *c, bool decoder,
                                    struct ed_stack *s)
{
    char n[256], pre[128];
    const char *stack = decoder ? "decoder" : "encoder";
    s->n = decoder ? c->n_dec_layers : c->n_enc_layers;
    s->layers = calloc((size_t)s->n, sizeof *s->layers);
    if (!s->layers)
        return model_errf(NULL, MODEL_ENOMEM, "out of memory");
    enum model_status st = MODEL_OK;
    for (int l = 0; l < s->n && st == MODEL_OK; l++) {
        snprintf(pre, sizeof pre, c->bart ? "model.%s.layers.%d." : "%s.block.%d.", stack, l);
        st = bind_layer(b, c, pre, decoder, &s->layers[l]);
    }
    if (st != MODEL_OK)
        return st;
    if (c->bart) {
        snprintf(n, sizeof n, "model.%s.embed_positions.weight", stack);
        if ((st = model_bind_mat(b, n, c->max_positions + 2, c->d_model, &s->pos)))
            return st;
        snprintf(n, sizeof n, "model.%s.layernorm_embedding.weight", stack);
        if ((st = model_bind_vec(b, n, c->d_model, &s->emb_norm)))
            return st;
        snprintf(n, sizeof n, "model.%s.layernorm_embedding.bias", stack);
        return model_bind_vec(b, n, c->d_model, &s->emb_norm_b);
    }
    snprintf(n, sizeof n, "%s.block.0.layer.0.SelfAttention.relative_attention_bias.weight", stack);
    if ((st = model_bind_mat(b, n, c->num_buckets, c->n_heads, &s->rel_bias)))
        return st;
    snprintf(n, sizeof n, "%s.final_layer_norm.weight", stack);
    return model_bind_vec(b, n, c->d_model, &s->final_norm);
}

static enum model_status bind_encdec(struct binder *b, void *arg)
{
    struct bind_ctx *bc = arg;
    encdec *m = bc->m;
    const struct encdec_config *c = &m->cfg;
    enum model_status st = model_bind_mat(b, c->bart ? "model.shared.weight" : "shared.weight", c->vocab_size,
                                          c->d_model, &m->embed);
    if (st == MODEL_OK)
        st = bind_stack(b, c, false, &m->enc);
    if (st == MODEL_OK)
        st = bind_stack(b, c, true, &m->dec);
    if (st == MODEL_OK && c->bart)
        st = model_bind_mat(b, "final_logits_bias", 1, c->vocab_size, &bc->final_bias);
    if (st != MODEL_OK)
        return st;
    if (c->tie)
        m->lm_head = m->embed;
    else
        st = model_bind_mat(b, "lm_head.weight", c->vocab_size, c->d_model, &m->lm_head);
    return st;
}

/* ---- load ----------------------------------------------------------------- */

/* Per layer at most: 8 attention matrices and 8 of their biases, 6 norm
 * vectors, 3 FFN matrices and 2 biases. */
#define ED_LAYER_TENSORS 27

static enum model_status upload_attn(encdec *m, struct ed_attn *a, char *err)
{
    const struct encdec_config *c = &m->cfg;
    int qd = c->n_heads * c->head_dim;
    struct model_mat *mats[4] = {&a->q, &a->k, &a->v, &a->o};
    const float **vecs[4] = {&a->bq, &a->bk, &a->bv, &a->bo};
    enum model_status st = MODEL_OK;
    for (int i = 0; i < 4 && st == MODEL_OK; i++)
        st = model_upload_mat(m->be, mats[i], m->wbufs, &m->n_wbufs, err);
    for (int i = 0; i < 4 && st == MODEL_OK; i++)
        st = model_upload_vec(m->be, vecs[i], i < 3 ? qd : c->d_model, m->wbufs, &m->n_wbufs, err);
    return st;
}

static enum model_status upload_stack(encdec *m, struct ed_stack *s, bool decoder, char *err)
{
    const struct encdec_config *c = &m->cfg;
    int d = c->d_model;
    enum model_status st = MODEL_OK;
    for (int l = 0; l < s->n && st == MODEL_OK; l++) {
        struct ed_layer *L = &s->layers[l];
        st = upload_attn(m, &L->self, err);
        if (st == MODEL_OK && decoder)
            st = upload_attn(m, &L->cross, err);
        struct model_mat *mats[3] = {&L->wi, &L->wi_1, &L->wo};
        for (int i = 0; i < 3 && st == MODEL_OK; i++)
            st = model_upload_mat(m->be, mats[i], m->wbufs, &m->n_wbufs, err);
        const float **vecs[8] = {&L->self_norm, &L->self_norm_b, &L->cross_norm, &L->cross_norm_b,
                                 &L->ffn_norm, &L->ffn_norm_b, &L->b_i, &L->b_o};
        for (int i = 0; i < 8 && st == MODEL_OK; i++)
            st = model_upload_vec(m->be, vecs[i], i == 6 ? c->ffn : d, m->wbufs, &m->n_wbufs, err);
    }
    const float **vecs[3] = {&s->final_norm, &s->emb_norm, &s->emb_norm_b};
    for (int i = 0; i < 3 && st == MODEL_OK; i++)
        st = model_upload_vec(m->be, vecs[i], d, m->wbufs, &m->n_wbufs, err);
    if (st == MODEL_OK && s->pos.data)
        st = model_upload_mat(m->be, &s->pos, m->wbufs, &m->n_wbufs, err);
    return st;
}

/* A backend that cannot read the mapped weights gets a copy of each one
 * the passes read (T5's relative bias tables are built from the mapped
 * ones and uploaded on their own). */
static enum model_status weights_upload(encdec *m, char *err)
{
    const struct encdec_config *c = &m->cfg;
    /* and the embeddings, the head, each stack's 3 vectors and positions */
    size_t n = ((size_t)c->n_enc_layers + (size_t)c->n_dec_layers) * ED_LAYER_TENSORS + 10;
    if (!(m->wbufs = calloc(n, sizeof(*m->wbufs))))
        return model_errf(err, MODEL_ENOMEM, "out of host memory for the weight table");
    bool tied = m->lm_head.data == m->embed.data;
    enum model_status st = model_upload_mat(m->be, &m->embed, m->wbufs, &m->n_wbufs, err);
    if (st == MODEL_OK)
        st = tied ? MODEL_OK : model_upload_mat(m->be, &m->lm_head, m->wbufs, &m->n_wbufs, err);
    if (tied)
        m->lm_head = m->embed;
    if (st == MODEL_OK)
        st = upload_stack(m, &m->enc, false, err);
    if (st == MODEL_OK)
        st = upload_stack(m, &m->dec, true, err);
    return st;
}

static float elem_f32(const struct model_mat *w, size_t i)
{
    if (w->dtype == BE_F32)
        return ((const float *)w->data)[i];
    uint16_t h = ((const uint16_t *)w->data)[i];
    return w->dtype == BE_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

/* T5's bucket of relative position rel = key - query, in f32 steps as
 * transformers computes it (the log ratio scaled, then truncated). */
static int t5_bucket(const struct encdec_config *c, int rel, bool bidirectional)
{
    int nb = c->num_buckets, bucket = 0;
    if (bidirectional) {
        nb /= 2;
        bucket = rel > 0 ? nb : 0;
        rel = rel < 0 ? -rel : rel;
    } else {
        rel = rel < 0 ? -rel : 0;
    }
    int max_exact = nb / 2;
    if (rel < max_exact)
        return bucket + rel;
    float scale = (float)log((double)c->max_distance / max_exact);
    int large = max_exact + (int)(logf((float)rel / (float)max_exact) / scale * (float)(nb - max_exact));
    return bucket + (large < nb - 1 ? large : nb - 1);
}

/* The stack's be_attn_params.rel_bias: [heads][2 * max_distance + 1]. */
static enum model_status bias_table(encdec *m, struct ed_stack *s, bool bidirectional, char *err)
{
    const struct encdec_config *c = &m->cfg;
    int span = c->max_distance, width = 2 * span + 1;
    size_t bytes = (size_t)c->n_heads * (size_t)width * sizeof(float);
    float *t = malloc(bytes);
    if (!t)
        return model_errf(err, MODEL_ENOMEM, "out of memory for the position bias");
    for (int r = -span; r <= span; r++) {
        int b = t5_bucket(c, r, bidirectional);
        for (int h = 0; h < c->n_heads; h++)
            t[(size_t)h * (size_t)width + (size_t)(r + span)] = elem_f32(&s->rel_bias, (size_t)b * c->n_heads + h);
    }
    enum be_status st = be_dev_alloc(m->be, bytes, &s->bias_table);
    if (st == BE_OK)
        st = be_copy(m->be, be_buffer_data(s->bias_table), t, bytes, BE_H2D);
    free(t);
    if (st != BE_OK)
        return model_errf(err, st == BE_ENOMEM_DEV ? MODEL_EDEVMEM : MODEL_EBACKEND, "position bias: %s",
                          be_strerror(st));
    return MODEL_OK;
}

/* The head's rows at a time for a step of cap rows. */
static int logit_rows(int cap)
{
    return cap < ED_LOGIT_ROWS ? cap : ED_LOGIT_ROWS;
}

/* The bytes of each step buffer (the order of encdec.bufs) for cap rows
 * of e-byte activations, shared with encdec_device_bytes. */
static void buffer_sizes(const struct encdec_config *c, size_t e, int cap, size_t sizes[ED_BUFS])
{
    size_t rows = (size_t)cap, qd = (size_t)c->n_heads * c->head_dim;
    size_t s[ED_BUFS] = {rows * c->d_model * e, rows * c->d_model * e, rows * qd * e, rows * qd * e,
                         rows * qd * e, rows * qd * e, rows * c->ffn * e, rows * c->ffn * e,
                         (size_t)logit_rows(cap) * c->vocab_size * 4};
    memcpy(sizes, s, sizeof(s));
}

/* The step's rows: max_batch_tokens, 256 by default. */
static int batch_rows(const struct model_params *p)
{
    return p && p->max_batch_tokens > 0 ? p->max_batch_tokens : 256;
}

/* What weights_upload charges: every matrix as stored (torch_dtype, which
 * the binder checks), every vector f32. */
static size_t uploads_bytes(const struct encdec_config *c)
{
    size_t d = (size_t)c->d_model, f = (size_t)c->ffn, qd = (size_t)c->n_heads * c->head_dim, vec = be_charged(d * 4);
    size_t attn = 3 * be_charged(qd * be_row_bytes(c->dtype, d)) + be_charged(d * be_row_bytes(c->dtype, qd)) +
                  (c->bart ? 3 * be_charged(qd * 4) + vec : 0);
    size_t ffn = (c->gated ? 2 : 1) * be_charged(f * be_row_bytes(c->dtype, d)) +
                 be_charged(d * be_row_bytes(c->dtype, f)) + (c->bart ? be_charged(f * 4) + vec : 0);
    size_t norm = (c->bart ? 2 : 1) * vec; /* T5's weight; BART's weight and bias */
    size_t enc_layer = attn + ffn + 2 * norm, dec_layer = enc_layer + attn + norm; /* + cross-attention */
    /* T5: the final norm; BART: layernorm_embedding and the positions */
    size_t stack = c->bart ? 2 * vec + be_charged((size_t)(c->max_positions + 2) * be_row_bytes(c->dtype, d)) : vec;
    size_t embed = be_charged((size_t)c->vocab_size * be_row_bytes(c->dtype, d));
    return (c->tie ? 1 : 2) * embed + 2 * stack + (size_t)c->n_enc_layers * enc_layer +
           (size_t)c->n_dec_layers * dec_layer;
}

struct model_device_bytes encdec_device_bytes(const struct encdec_config *c, struct be_caps caps,
                                              const struct model_params *p, int64_t max_input)
{
    size_t sizes[ED_BUFS], esz = be_dtype_size(caps.act_dtype), act = 0;
    buffer_sizes(c, esz, batch_rows(p), sizes);
    for (int i = 0; i < ED_BUFS; i++)
        act += be_charged(sizes[i]);
    size_t tables = c->bart ? 0 : 2 * be_charged((size_t)c->n_heads * (2 * (size_t)c->max_distance + 1) * 4);
    enum be_dtype kv = model_kv_dtype_resolve(p ? p->kv_dtype : MODEL_KV_AUTO, c->dtype);
    return (struct model_device_bytes){
        .weights = (caps.unified_memory ? 0 : uploads_bytes(c)) + tables,
        .activations = act + be_charged((size_t)max_input * c->d_model * esz), /* encode's residual stream */
        .kv_per_token = (size_t)c->n_dec_layers * 2 * (size_t)c->n_heads * (size_t)c->head_dim * be_dtype_size(kv),
    };
}

static enum model_status buffers_alloc(encdec *m, char *err)
{
    const struct encdec_config *c = &m->cfg;
    size_t rows = (size_t)m->cap, sizes[ED_BUFS];
    m->logit_rows = logit_rows(m->cap);
    buffer_sizes(c, m->esz, m->cap, sizes);
    void **ptrs[ED_BUFS] = {&m->x, &m->xb, &m->q, &m->k, &m->v, &m->att, &m->hb, &m->hb2, &m->logits};
    for (int i = 0; i < ED_BUFS; i++) {
        enum be_status st = be_dev_alloc(m->be, sizes[i], &m->bufs[i]);
        if (st != BE_OK)
            return model_errf(err, st == BE_ENOMEM_DEV ? MODEL_EDEVMEM : MODEL_ENOMEM,
                              "cannot allocate %zu bytes of activations: %s", sizes[i], be_strerror(st));
        *ptrs[i] = be_buffer_data(m->bufs[i]);
    }
    m->toks = malloc(rows * sizeof *m->toks);
    m->ids = malloc(rows * sizeof *m->ids);
    m->row_ids = malloc(rows * sizeof *m->row_ids);
    m->row_pos = malloc(rows * sizeof *m->row_pos);
    m->row_seq = malloc(rows * sizeof *m->row_seq);
    m->qviews = malloc(rows * sizeof *m->qviews);
    m->sviews = malloc(rows * sizeof *m->sviews);
    m->cviews = malloc(rows * sizeof *m->cviews);
    if (!m->toks || !m->ids || !m->row_ids || !m->row_pos || !m->row_seq || !m->qviews || !m->sviews || !m->cviews)
        return model_errf(err, MODEL_ENOMEM, "out of host memory");
    return MODEL_OK;
}

static enum model_status load(encdec *m, const char *dir, const struct model_params *p, char *err)
{
    enum model_status st = encdec_config_load(dir, &m->cfg, err);
    if (st != MODEL_OK)
        return st;
    const struct encdec_config *c = &m->cfg;
    m->kv_dtype = model_kv_dtype_resolve(p ? p->kv_dtype : MODEL_KV_AUTO, c->dtype);
    m->cap = batch_rows(p);
    m->act = be_get_caps(m->be).act_dtype;
    m->esz = be_dtype_size(m->act);
    /* vectors: per layer at most 10 (norms, biases) of at most max(dim, ffn) floats */
    int widest = c->d_model > c->ffn ? c->d_model : c->ffn;
    if (c->n_heads * c->head_dim > widest)
        widest = c->n_heads * c->head_dim;
    size_t layers = (size_t)c->n_enc_layers + (size_t)c->n_dec_layers;
    size_t floats = (layers * 16 + 8) * (size_t)widest;
    struct model_config mc = {.dtype = c->dtype}; /* the binder reads only the dtype */
    struct bind_ctx bc = {.m = m};
    st = model_files_open_with(dir, &mc, floats, bind_encdec, &bc, &m->files, &m->header_hash,
                               err);
    if (st == MODEL_OK && c->bart) {
        if (!(m->logits_bias = malloc((size_t)c->vocab_size * sizeof(float))))
            return model_errf(err, MODEL_ENOMEM, "out of memory for final_logits_bias");
        for (int i = 0; i < c->vocab_size; i++)
            m->logits_bias[i] = elem_f32(&bc.final_bias, (size_t)i);
    }
    if (st == MODEL_OK && !c->bart)
        st = bias_table(m, &m->enc, true, err);
    if (st == MODEL_OK && !c->bart)
        st = bias_table(m, &m->dec, false, err);
    if (st == MODEL_OK && !be_get_caps(m->be).unified_memory)
        st = weights_upload(m, err);
    if (st == MODEL_OK)
        st = buffers_alloc(m, err);
    return st;
}

enum model_status encdec_load(const char *dir, be_backend *be, const struct model_params *p, encdec **out,
                              char *err)
{
    char scratch[MODEL_ERR_LEN];
    if (!err)
        err = scratch;
    err[0] = '\0';
    *out = NULL;
    encdec *m = calloc(1, sizeof *m);
    if (!m)
        return model_errf(err, MODEL_ENOMEM, "out of host memory");
    m->be = be;
    enum model_status st = load(m, dir, p, err);
    if (st != MODEL_OK) {
        encdec_free(m);
        return st;
    }
    *out = m;
    return MODEL_OK;
}

void encdec_free(encdec *m)
{
    if (!m)
        return;
    for (int i = 0; i < ED_BUFS; i++)
        be_buffer_free(m->bufs[i]);
    for (int i = 0; i < m->n_wbufs; i++)
        be_buffer_free(m->wbufs[i]);
    free(m->wbufs);
    be_buffer_free(m->enc.bias_table);
    be_buffer_free(m->dec.bias_table);
    free(m->enc.layers);
    free(m->dec.layers);
    free(m->logits_bias);
    free(m->toks);
    free(m->ids);
    free(m->row_ids);
    free(m->row_pos);
    free(m->row_seq);
    free(m->qviews);
    free(m->sviews);
    free(m->cviews);
    free(m->start);
    model_files_close(m->files);
    free(m);
}

/* ---- the forward passes --------------------------------------------------- */

static enum be_status matmul(encdec *m, void *y, const void *x, const struct model_mat *w, const float *bias, int n)
{
    return be_matmul(m->be, y, m->act, x, w->data, w->dtype, bias, n, w->cols, w->rows);
}

/* T5: RMS norm; BART: LayerNorm with bias b. */
static enum be_status norm(encdec *m, void *y, const void *x, const float *w, const float *b, int n)
{
    return b ? be_layernorm(m->be, y, x, w, b, n, m->cfg.d_model, m->cfg.eps)
             : be_rmsnorm(m->be, y, x, w, n, m->cfg.d_model, m->cfg.eps);
}

static struct be_attn_params attn_params(const encdec *m, const struct ed_stack *s, bool bidirectional)
{
    const struct encdec_config *c = &m->cfg;
    return (struct be_attn_params){
        .n_heads = c->n_heads, .n_kv_heads = c->n_heads, .head_dim = c->head_dim,
        .scale = c->bart ? 1.0f / sqrtf((float)c->head_dim) : 1.0f, /* T5 scales at init, not here */
        .kv_dtype = m->kv_dtype, .bidirectional = bidirectional,
        .rel_bias = s && s->bias_table ? be_buffer_data(s->bias_table) : NULL,
        .rel_span = s && s->bias_table ? c->max_distance : 0,
    };
}

/* Rows [0, n) of x (n, dim): one sublayer's residual step.  T5: x +=
 * out; BART: x = ln(x + out).  out is in xb. */
static enum be_status residual(encdec *m, void *x, const float *nw, const float *nb, int n)
{
    BE_TRY(be_add(m->be, m->xb, x, (size_t)n * m->cfg.d_model)); /* xb = x + out */
    if (m->cfg.bart)
        return norm(m, x, m->xb, nw, nb, n);
    return be_copy(m->be, x, m->xb, (size_t)n * m->cfg.d_model * m->esz, BE_D2D);
}

/* What a sublayer reads from x (n, dim): T5 its normed copy in xb, BART x
 * itself. */
static enum be_status sub_input(encdec *m, const void *x, const float *nw, int n, const void **in)
{
    if (m->cfg.bart) {
        *in = x;
        return BE_OK;
    }
    *in = m->xb;
    return be_rmsnorm(m->be, m->xb, x, nw, n, m->cfg.d_model, m->cfg.eps);
}

/* x (n, dim) += ffn(x), in the block's layout. */
static enum be_status ffn(encdec *m, void *x, const struct ed_layer *L, int n)
{
    const void *in;
    size_t nf = (size_t)n * m->cfg.ffn;
    BE_TRY(sub_input(m, x, L->ffn_norm, n, &in));
    BE_TRY(matmul(m, m->hb, in, &L->wi, L->b_i, n));                         /* hb (n, ffn) */
    if (m->cfg.bart) {
        BE_TRY(be_act(m->be, m->hb, nf, BE_ACT_GELU_ERF));
    } else if (m->cfg.gated) {
        BE_TRY(matmul(m, m->hb2, in, &L->wi_1, NULL, n));                    /* hb2 (n, ffn) */
        BE_TRY(be_gelu_mul(m->be, m->hb, m->hb, m->hb2, nf));
    } else {
        BE_TRY(be_act(m->be, m->hb, nf, BE_ACT_RELU));
    }
    BE_TRY(matmul(m, m->xb, m->hb, &L->wo, L->b_o, n));                      /* xb (n, dim) */
    return residual(m, x, L->ffn_norm, L->ffn_norm_b, n);
}

/* x (n, dim) = embed(ids) of positions pos[0, n) in stack s. */
static enum be_status embed(encdec *m, const struct ed_stack *s, void *x, const int32_t *ids, int n,
                            const int64_t *pos)
{
    const struct encdec_config *c = &m->cfg;
    size_t nd = (size_t)n * c->d_model;
    BE_TRY(be_embed(m->be, x, m->embed.data, m->embed.dtype, ids, n, c->d_model));
    if (!c->bart)
        return BE_OK;
    if (c->scale_embedding)
        BE_TRY(be_scale(m->be, x, nd, sqrtf((float)c->d_model)));
    for (int i = 0; i < n; i++) /* BART's learned positions start at row 2 */
        m->ids[i] = (int32_t)(pos[i] + 2);
    BE_TRY(be_embed(m->be, m->xb, s->pos.data, s->pos.dtype, m->ids, n, c->d_model));
    BE_TRY(be_add(m->be, x, m->xb, nd));
    return be_layernorm(m->be, x, x, s->emb_norm, s->emb_norm_b, n, c->d_model, c->eps);
}

/* The encoder's rows: n tokens of view 0 at positions [p0, p0 + n), in
 * toks and row_pos. */
static void encoder_rows(encdec *m, int64_t p0, int n)
{
    for (int i = 0; i < n; i++) {
        m->row_pos[i] = p0 + i;
        m->toks[i] = (struct be_tok){.view = 0, .pos = p0 + i};
    }
}

/* K and V of rows x (n, dim) into views, where toks place them. */
static enum be_status store_kv(encdec *m, const struct ed_attn *a, const void *x, const struct be_kv_view *views,
                               int n, const struct be_attn_params *ap)
{
    BE_TRY(matmul(m, m->k, x, &a->k, a->bk, n));                             /* k (n, H*hd) */
    BE_TRY(matmul(m, m->v, x, &a->v, a->bv, n));                             /* v (n, H*hd) */
    return be_kv_store(m->be, views, m->toks, n, m->k, m->v, ap);
}

/* xb (n, dim) = attention of queries from rows in (n, dim) over the views
 * toks name, or over qviews (NULL: none) for a sequence with quantized
 * blocks.  A row reads its view with the kernel it would read it alone:
 * the runs of rows of quantized and of dense sequences attend apart. */
static enum be_status attend(encdec *m, const struct ed_attn *a, const void *in, const struct be_kv_view *views,
                             const struct be_kvq_view *qviews, int n, const struct be_attn_params *ap)
{
    BE_TRY(matmul(m, m->q, in, &a->q, a->bq, n));                            /* q (n, H*hd) */
    size_t row = (size_t)m->cfg.n_heads * m->cfg.head_dim * m->esz;
    for (int r0 = 0, r; r0 < n; r0 = r) {
        bool quant = qviews && qviews[m->toks[r0].view].fmt;
        for (r = r0 + 1; r < n && (qviews && qviews[m->toks[r].view].fmt) == quant; r++)
            ;
        void *att = (char *)m->att + (size_t)r0 * row;
        const void *q = (const char *)m->q + (size_t)r0 * row;
        BE_TRY(quant ? be_attention_quant(m->be, att, q, qviews, m->toks + r0, r - r0, ap)
                     : be_attention(m->be, att, q, views, m->toks + r0, r - r0, ap)); /* att (n, H*hd) */
    }
    return matmul(m, m->xb, m->att, &a->o, a->bo, n);                        /* xb (n, dim) */
}

/* The encoder over xs (S, dim) (embedded), then every decoder layer's
 * cross K and V of its output into cross's views (S reserved tokens). */
static enum be_status encode(encdec *m, kv_seq *cross, void *xs, const int32_t *ids, int S)
{
    const struct encdec_config *c = &m->cfg;
    size_t row = (size_t)c->d_model * m->esz;
    struct be_attn_params ap = attn_params(m, &m->enc, true);
    for (int r0 = 0; r0 < S; r0 += m->cap) {
        int n = S - r0 < m->cap ? S - r0 : m->cap;
        encoder_rows(m, r0, n);
        BE_TRY(embed(m, &m->enc, (char *)xs + (size_t)r0 * row, ids + r0, n, m->row_pos));
    }
    for (int l = 0; l < c->n_enc_layers; l++) {
        const struct ed_layer *L = &m->enc.layers[l];
        struct be_kv_view view; /* scratch: a decoder layer's blocks, overwritten below */
        kv_seq_view(cross, l % c->n_dec_layers, &view);
        const void *in;
        for (int r0 = 0; r0 < S; r0 += m->cap) { /* every key first: each query sees them all */
            int n = S - r0 < m->cap ? S - r0 : m->cap;
            encoder_rows(m, r0, n);
            BE_TRY(sub_input(m, (char *)xs + (size_t)r0 * row, L->self_norm, n, &in));
            BE_TRY(store_kv(m, &L->self, in, &view, n, &ap));
        }
        for (int r0 = 0; r0 < S; r0 += m->cap) {
            int n = S - r0 < m->cap ? S - r0 : m->cap;
            void *x = (char *)xs + (size_t)r0 * row;
            encoder_rows(m, r0, n);
            BE_TRY(sub_input(m, x, L->self_norm, n, &in));
            BE_TRY(attend(m, &L->self, in, &view, NULL, n, &ap));
            BE_TRY(residual(m, x, L->self_norm, L->self_norm_b, n));
            BE_TRY(ffn(m, x, L, n));
        }
    }
    if (!c->bart)
        BE_TRY(be_rmsnorm(m->be, xs, xs, m->enc.final_norm, S, c->d_model, c->eps));
    struct be_attn_params cp = attn_params(m, NULL, true);
    for (int l = 0; l < c->n_dec_layers; l++) {
        BE_TRY(kv_store_layer_begin(kv_seq_store(cross), l));
        struct be_kv_view view;
        kv_seq_view(cross, l, &view);
        for (int r0 = 0; r0 < S; r0 += m->cap) {
            int n = S - r0 < m->cap ? S - r0 : m->cap;
            encoder_rows(m, r0, n);
            BE_TRY(store_kv(m, &m->dec.layers[l].cross, (char *)xs + (size_t)r0 * row, &view, n, &cp));
        }
        BE_TRY(kv_store_layer_end(kv_seq_store(cross), l));
    }
    return BE_OK;
}

static bool ids_ok(const encdec *m, const int32_t *ids, int n)
{
    if (n <= 0 || !ids)
        return false;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->cfg.vocab_size)
            return false;
    return true;
}

/* Ends the store's step after a pass that returned st: q keeps what the
 * pass wrote (committed once the write-backs landed) or, on any failure,
 * is as it was before. */
static enum model_status step_end(kv_store *store, kv_seq *q, enum model_status st)
{
    enum be_status drained = kv_store_step_end(store);
    if (st == MODEL_OK)
        st = model_from_be(drained);
    if (st == MODEL_OK)
        return model_from_tier(kv_seq_commit(q));
    kv_seq_abort(q);
    return st;
}

enum model_status encdec_encode(encdec *m, kv_seq *cross, const int32_t *ids, int n)
{
    if (!m || !cross || !ids_ok(m, ids, n) || kv_seq_length(cross) != 0)
        return MODEL_EINVAL;
    if (m->cfg.bart && n > m->cfg.max_positions) /* learned positions end there */
        return MODEL_EINVAL;
    /* the encoder's scratch is the cross blocks of the device, as they are */
    struct kv_seq_stats qs = kv_seq_stats(cross);
    if (qs.strategy != KV_DYNAMIC && qs.strategy != KV_STATIC)
        return MODEL_EUNSUPPORTED;
    be_buffer *buf = NULL; /* the residual stream of the whole input */
    enum model_status st = model_from_be(be_dev_alloc(m->be, (size_t)n * m->cfg.d_model * m->esz, &buf));
    if (st == MODEL_OK)
        st = model_from_tier(kv_seq_reserve(cross, n));
    if (st != MODEL_OK) {
        be_buffer_free(buf);
        return st;
    }
    kv_store *store = kv_seq_store(cross);
    st = model_from_tier(kv_store_step_begin(store));
    if (st == MODEL_OK)
        st = model_from_be(encode(m, cross, be_buffer_data(buf), ids, n));
    st = step_end(store, cross, st);
    be_buffer_free(buf);
    return st;
}

/* The head over the chunk's rows [0, n) that end a sequence asking for
 * logits, logit_rows at a time: each row gathered into xb, normed (T5), and
 * multiplied with the head as it would be alone. */
static enum be_status chunk_logits(encdec *m, const struct encdec_seq *seqs, int n)
{
    const struct encdec_config *c = &m->cfg;
    size_t row = (size_t)c->d_model * m->esz, vocab = (size_t)c->vocab_size;
    int sel[ED_LOGIT_ROWS];
    for (int r = 0; r < n;) {
        int n_sel = 0;
        for (; r < n && n_sel < m->logit_rows; r++) {
            const struct encdec_seq *q = &seqs[m->row_seq[r]];
            if (q->logits && m->row_pos[r] == m->start[m->row_seq[r]] + q->n - 1)
                sel[n_sel++] = r;
        }
        if (!n_sel)
            continue;
        for (int i = 0; i < n_sel; i++)
            BE_TRY(be_copy(m->be, (char *)m->xb + (size_t)i * row, (char *)m->x + (size_t)sel[i] * row, row,
                           BE_D2D));
        if (!c->bart) {
            BE_TRY(be_rmsnorm(m->be, m->xb, m->xb, m->dec.final_norm, n_sel, c->d_model, c->eps));
            if (c->tie) /* T5 rescales before a head it shares with the input */
                BE_TRY(be_scale(m->be, m->xb, (size_t)n_sel * c->d_model, 1.0f / sqrtf((float)c->d_model)));
        }
        BE_TRY(be_matmul(m->be, m->logits, BE_F32, m->xb, m->lm_head.data, m->lm_head.dtype, NULL, n_sel,
                         m->lm_head.cols, m->lm_head.rows));
        for (int i = 0; i < n_sel; i++) {
            float *dst = seqs[m->row_seq[sel[i]]].logits;
            BE_TRY(be_copy(m->be, dst, (float *)m->logits + (size_t)i * vocab, vocab * sizeof(float), BE_D2H));
            for (size_t j = 0; m->logits_bias && j < vocab; j++)
                dst[j] += m->logits_bias[j];
        }
    }
    return BE_OK;
}

/* The decoder over the next n rows of the step's token stream (each
 * sequence's ids in turn, from token *t of entry *s, both advanced past
 * them): a sequence's rows store their self K and V at its positions and
 * read its own self and cross caches; the weights are read once for all. */
static enum be_status decode_chunk(encdec *m, const struct encdec_seq *seqs, int *s, int *t, int n)
{
    const struct encdec_config *c = &m->cfg;
    kv_store *store = kv_seq_store(seqs[0].self);
    struct be_attn_params sp = attn_params(m, &m->dec, false), cp = attn_params(m, NULL, true);
    int n_views = 0;
    for (int r = 0; r < n; r++) {
        while (*t == seqs[*s].n) {
            (*s)++;
            *t = 0;
        }
        if (r == 0 || m->row_seq[r - 1] != *s)
            n_views++;
        m->row_seq[r] = *s;
        m->row_ids[r] = seqs[*s].ids[*t];
        m->row_pos[r] = m->start[*s] + *t;
        /* cross attention reads every encoder position whatever the query's */
        m->toks[r] = (struct be_tok){.view = n_views - 1, .pos = m->row_pos[r]};
        (*t)++;
    }
    BE_TRY(embed(m, &m->dec, m->x, m->row_ids, n, m->row_pos));
    for (int l = 0; l < c->n_dec_layers; l++) {
        const struct ed_layer *L = &m->dec.layers[l];
        const void *in;
        BE_TRY(kv_store_layer_begin(store, l));
        for (int r = 0, v = 0; r < n; r++) {
            if (r && m->row_seq[r - 1] == m->row_seq[r])
                continue;
            const struct encdec_seq *q = &seqs[m->row_seq[r]];
            kv_seq_qview(q->self, l, &m->qviews[v]); /* a quantized self cache: codes and the rest */
            m->sviews[v] = m->qviews[v].rest;         /* where this step's K and V go */
            kv_seq_view(q->cross, l, &m->cviews[v++]);
        }
        BE_TRY(sub_input(m, m->x, L->self_norm, n, &in));
        BE_TRY(store_kv(m, &L->self, in, m->sviews, n, &sp)); /* in (xb) is left as it was */
        BE_TRY(attend(m, &L->self, in, m->sviews, m->qviews, n, &sp));
        BE_TRY(residual(m, m->x, L->self_norm, L->self_norm_b, n));
        BE_TRY(sub_input(m, m->x, L->cross_norm, n, &in));
        BE_TRY(attend(m, &L->cross, in, m->cviews, NULL, n, &cp));
        BE_TRY(residual(m, m->x, L->cross_norm, L->cross_norm_b, n));
        BE_TRY(ffn(m, m->x, L, n));
        BE_TRY(kv_store_layer_end(store, l));
    }
    return chunk_logits(m, seqs, n);
}

/* Whether entry i is the first of seqs to read its cross cache (a job's
 * choices and beams share one): each joins the step once. */
static bool first_cross(const struct encdec_seq *seqs, int i)
{
    for (int k = 0; k < i; k++)
        if (seqs[k].cross == seqs[i].cross)
            return false;
    return true;
}

/* One attempt at a decoder step over every entry: each self cache is as
 * it was unless it succeeds.  The cross caches join the step only to be
 * read: in the host tier, their layers stream through the device slots
 * with the self caches' streamed layers, each copied in while the layer
 * before computes. */
static enum model_status decode_step(encdec *m, const struct encdec_seq *seqs, int n_seqs, int64_t total)
{
    kv_store *store = kv_seq_store(seqs[0].self);
    enum model_status st = MODEL_OK;
    int n_self = 0, n_cross = 0; /* entries whose self, whose cross, joined the step */
    for (; n_self < n_seqs; n_self++) {
        m->start[n_self] = kv_seq_length(seqs[n_self].self);
        if ((st = model_from_tier(kv_seq_reserve(seqs[n_self].self, seqs[n_self].n))) != MODEL_OK)
            break;
    }
    for (; st == MODEL_OK && n_cross < n_seqs; n_cross++)
        if (first_cross(seqs, n_cross) &&
            (st = model_from_tier(kv_seq_reserve(seqs[n_cross].cross, 0))) != MODEL_OK)
            break;
    if (st == MODEL_OK)
        st = model_from_tier(kv_store_step_begin(store));
    int s = 0, t = 0;
    for (int64_t done = 0; st == MODEL_OK && done < total;) {
        int n = total - done < m->cap ? (int)(total - done) : m->cap;
        st = model_from_be(decode_chunk(m, seqs, &s, &t, n));
        done += n;
    }
    enum be_status drained = kv_store_step_end(store); /* write-backs land before the commit */
    if (st == MODEL_OK)
        st = model_from_be(drained);
    /* a commit fails only on a device fault, which no retry mends: the
     * step reports it, the other sequences commit as computed */
    enum model_status committed = MODEL_OK;
    for (int i = 0; i < n_self; i++) {
        if (st != MODEL_OK)
            kv_seq_abort(seqs[i].self);
        else if (kv_seq_commit(seqs[i].self) != TIER_OK)
            committed = MODEL_EBACKEND;
    }
    for (int i = 0; i < n_cross; i++) /* after the step's figures; nothing of them was written */
        if (first_cross(seqs, i))
            kv_seq_abort(seqs[i].cross);
    return st == MODEL_OK ? committed : st;
}

/* After a step ran out of device memory: moves a self cache, else a cross
 * cache, of the step to the host tier so it can be redone.  False when
 * nothing could move (*st is then the offload's failure, if any). */
static bool continue_offloaded(const struct encdec_seq *seqs, int n_seqs, enum model_status *st)
{
    for (int k = 0; k < 2 * n_seqs; k++) {
        kv_seq *q = k < n_seqs ? seqs[k].self : seqs[k - n_seqs].cross;
        struct kv_seq_stats qs = kv_seq_stats(q);
        if (k < n_seqs ? !qs.resident_layers : !qs.dev_bytes)
            continue;
        enum tier_status ts = kv_seq_offload(q, KV_FALLBACK_OOM);
        if (ts == TIER_OK)
            return true;
        if (ts != TIER_ENOTSUP) { /* no_fallback sequences refuse; try the next */
            *st = model_from_tier(ts);
            return false;
        }
    }
    return false;
}

enum model_status encdec_decode_batch(encdec *m, const struct encdec_seq *seqs, int n_seqs)
{
    if (!m || !seqs || n_seqs <= 0)
        return MODEL_EINVAL;
    int64_t total = 0;
    for (int i = 0; i < n_seqs; i++) {
        const struct encdec_seq *q = &seqs[i];
        if (!q->self || !q->cross || !ids_ok(m, q->ids, q->n) || kv_seq_length(q->cross) == 0 ||
            kv_seq_store(q->self) != kv_seq_store(q->cross) || kv_seq_store(q->self) != kv_seq_store(seqs[0].self))
            return MODEL_EINVAL;
        for (int k = 0; k < i; k++)
            if (seqs[k].self == q->self) /* a sequence takes one place in a step */
                return MODEL_EINVAL;
        if (m->cfg.bart && kv_seq_length(q->self) + q->n > m->cfg.max_positions) /* learned positions end there */
            return MODEL_EINVAL;
        total += q->n;
    }
    if (n_seqs > m->start_cap) { /* grows with the largest batch seen, not per call */
        int64_t *p = realloc(m->start, (size_t)n_seqs * sizeof(*p));
        if (!p)
            return MODEL_ENOMEM;
        m->start = p;
        m->start_cap = n_seqs;
    }
    /* Out of device memory is not the end of the generation, as for
     * model_forward: the step is redone with the self caches, then the
     * cross caches, moved to the host tier one at a time (nothing
     * recomputed) until it fits or nothing is left to move. */
    enum model_status st;
    while ((st = decode_step(m, seqs, n_seqs, total)) == MODEL_EDEVMEM && continue_offloaded(seqs, n_seqs, &st))
        ;
    return st;
}

enum model_status encdec_decode(encdec *m, kv_seq *self, kv_seq *cross, const int32_t *ids, int n, float *logits)
{
    struct encdec_seq q = {.self = self, .cross = cross, .ids = ids, .n = n, .logits = logits};
    return encdec_decode_batch(m, &q, 1);
}
