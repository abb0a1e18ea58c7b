/* gguf_model.c - a GGUF file as the Hugging Face directory it stands for:
 * its metadata as config.json's fields (then parsed by config.c's one
 * parser), its tensors under the Hugging Face names (then bound by
 * safetensors.c's one binder), its vocabulary as a tokenizer.json (then
 * loaded by the text layer's one loader).
 *
 * Architectures: llama (Llama, Mistral and the others llama.cpp converts
 * as "llama"), qwen2, qwen3.  llama.cpp's converter permutes a llama
 * file's q and k rows per head from Hugging Face's rotate-half pairs to
 * interleaved ones; the rows are put back here (an owned copy of each),
 * so the forward pass and every KV format stay the Hugging Face ones.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "model/gguf.h"

struct gguf_arch {
    const char *name;  /* general.architecture */
    const char *hf;    /* the config.json class it maps to */
    bool permuted;     /* q/k rows interleaved by llama.cpp's converter */
};

static const struct gguf_arch ARCHS[] = {
    {"llama", "LlamaForCausalLM", true},
    {"qwen2", "Qwen2ForCausalLM", false},
    {"qwen3", "Qwen3ForCausalLM", false},
};

/* GGUF's tensor names and the Hugging Face ones the binder knows. */
static const struct name_map {
    const char *gguf, *hf;
} TOP_NAMES[] = {
    {"token_embd.weight", "model.embed_tokens.weight"},
    {"output_norm.weight", "model.norm.weight"},
    {"output.weight", "lm_head.weight"},
}, LAYER_NAMES[] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},
    {"attn_k.weight", "self_attn.k_proj.weight"},
    {"attn_v.weight", "self_attn.v_proj.weight"},
    {"attn_output.weight", "self_attn.o_proj.weight"},
    {"attn_q.bias", "self_attn.q_proj.bias"},
    {"attn_k.bias", "self_attn.k_proj.bias"},
    {"attn_v.bias", "self_attn.v_proj.bias"},
    {"attn_output.bias", "self_attn.o_proj.bias"},
    {"attn_q_norm.weight", "self_attn.q_norm.weight"},
    {"attn_k_norm.weight", "self_attn.k_norm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},
    {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
};

#define HF_NAME_MAX 96

/* The Hugging Face name of a GGUF tensor into out; false for a tensor the
 * binder does not read (it is then left alone, as extra safetensors
 * tensors are). */
static bool hf_name(const char *name, char out[HF_NAME_MAX])
{
    for (size_t i = 0; i < sizeof TOP_NAMES / sizeof TOP_NAMES[0]; i++)
        if (!strcmp(name, TOP_NAMES[i].gguf))
            return snprintf(out, HF_NAME_MAX, "%s", TOP_NAMES[i].hf) < HF_NAME_MAX;
    if (strncmp(name, "blk.", 4) != 0 || name[4] < '0' || name[4] > '9')
        return false;
    char *end;
    long l = strtol(name + 4, &end, 10);
    if (*end != '.' || l > 1 << 20)
        return false;
    for (size_t i = 0; i < sizeof LAYER_NAMES / sizeof LAYER_NAMES[0]; i++)
        if (!strcmp(end + 1, LAYER_NAMES[i].gguf)) {
            int n = snprintf(out, HF_NAME_MAX, "model.layers.%ld.%s", l, LAYER_NAMES[i].hf);
            return n > 0 && n < HF_NAME_MAX;
        }
    return false;
}

static enum model_status find_arch(const struct gguf *g, const struct gguf_arch **out, char *err)
{
    struct gguf_str a;
    enum model_status st = gguf_get_str(g, "general.architecture", true, &a, err);
    if (st != MODEL_OK)
        return st;
    for (size_t i = 0; i < sizeof ARCHS / sizeof ARCHS[0]; i++)
        if (a.n == strlen(ARCHS[i].name) && !memcmp(a.p, ARCHS[i].name, a.n)) {
            *out = &ARCHS[i];
            return MODEL_OK;
        }
    return model_errf(err, MODEL_EUNSUPPORTED,
                      "%s: general.architecture \"%.*s\" is not supported (llama, qwen2, qwen3)", g->name,
                      (int)(a.n > 64 ? 64 : a.n), a.p);
}

/* ---- config --------------------------------------------------------------- */

/* {arch}.suffix as an integer of config.json's key, when present. */
static enum model_status put_int(const struct gguf *g, json_t *root, const char *arch, const char *suffix,
                                 const char *key, bool required, int64_t *out, char *err)
{
    char name[128];
    snprintf(name, sizeof name, "%s.%s", arch, suffix);
    int64_t v = -1;
    enum model_status st = gguf_get_int(g, name, required, 1, INT32_MAX, &v, err);
    if (st == MODEL_OK && v >= 0 && key && json_object_set_new(root, key, json_integer(v)))
        st = model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    if (out)
        *out = v;
    return st;
}

static enum model_status put_float(const struct gguf *g, json_t *root, const char *arch, const char *suffix,
                                   const char *key, bool required, char *err)
{
    char name[128];
    snprintf(name, sizeof name, "%s.%s", arch, suffix);
    double v = -1.0;
    enum model_status st = gguf_get_float(g, name, required, &v, err);
    if (st == MODEL_OK && gguf_find(g, name) && json_object_set_new(root, key, json_real(v)))
        st = model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    return st;
}

/* A token id of the tokenizer.ggml metadata, or -1 when absent. */
static enum model_status token_key(const struct gguf *g, const char *key, int64_t vocab, int64_t *out, char *err)
{
    *out = -1;
    return gguf_get_int(g, key, false, 0, vocab - 1, out, err);
}

static enum model_status set(json_t *root, const char *key, json_t *v, const struct gguf *g, char *err)
{
    if (!v || json_object_set_new(root, key, v))
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    return MODEL_OK;
}

/* The config.json this file's metadata stands for. */
static enum model_status config_json(const struct gguf *g, json_t *root, char *err)
{
    const struct gguf_arch *ai;
    enum model_status st = find_arch(g, &ai, err);
    if (st != MODEL_OK)
        return st;
    const char *a = ai->name;
    int64_t dim, heads, key_len = -1, value_len = -1, rot = -1;
    if ((st = set(root, "architectures", json_pack("[s]", ai->hf), g, err)) ||
        (st = put_int(g, root, a, "embedding_length", "hidden_size", true, &dim, err)) ||
        (st = put_int(g, root, a, "feed_forward_length", "intermediate_size", true, NULL, err)) ||
        (st = put_int(g, root, a, "block_count", "num_hidden_layers", true, NULL, err)) ||
        (st = put_int(g, root, a, "attention.head_count", "num_attention_heads", true, &heads, err)) ||
        (st = put_int(g, root, a, "attention.head_count_kv", "num_key_value_heads", false, NULL, err)) ||
        (st = put_int(g, root, a, "context_length", "max_position_embeddings", true, NULL, err)) ||
        (st = put_int(g, root, a, "attention.key_length", NULL, false, &key_len, err)) ||
        (st = put_int(g, root, a, "attention.value_length", NULL, false, &value_len, err)) ||
        (st = put_int(g, root, a, "rope.dimension_count", NULL, false, &rot, err)) ||
        (st = put_float(g, root, a, "attention.layer_norm_rms_epsilon", "rms_norm_eps", true, err)) ||
        (st = put_float(g, root, a, "rope.freq_base", "rope_theta", false, err)))
        return st;
    /* head_dim always explicit: Qwen3's class default (128) is no GGUF's */
    int64_t head_dim = key_len > 0 ? key_len : dim / heads;
    if (key_len < 0 && dim % heads)
        return model_errf(err, MODEL_ECONFIG, "%s: %s.attention.head_count %lld does not divide embedding_length %lld",
                          g->name, a, (long long)heads, (long long)dim);
    if (value_len > 0 && value_len != head_dim)
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: %s.attention.value_length %lld differs from the key length %lld",
                          g->name, a, (long long)value_len, (long long)head_dim);
    if (rot > 0 && rot != head_dim)
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: %s.rope.dimension_count %lld: partial rotation of %lld is not supported",
                          g->name, a, (long long)rot, (long long)head_dim);
    if ((st = set(root, "head_dim", json_integer(head_dim), g, err)))
        return st;

    char key[128];
    struct gguf_str scaling = {"none", 4};
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    if ((st = gguf_get_str(g, key, false, &scaling, err)))
        return st;
    if (scaling.n == 6 && !memcmp(scaling.p, "linear", 6)) {
        double factor;
        snprintf(key, sizeof key, "%s.rope.scaling.factor", a);
        if ((st = gguf_get_float(g, key, true, &factor, err)) ||
            (st = set(root, "rope_scaling", json_pack("{s:s, s:f}", "rope_type", "linear", "factor", factor), g, err)))
            return st;
    } else if (!(scaling.n == 4 && !memcmp(scaling.p, "none", 4))) {
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: %s \"%.*s\" is not supported (none, linear)", g->name, key,
                          (int)(scaling.n > 32 ? 32 : scaling.n), scaling.p);
    }
    /* Llama 3.1's frequency scaling travels as a tensor of per-dimension
     * factors, not as the parameters the forward pass computes them from */
    if (gguf_tensor(g, "rope_freqs.weight"))
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: rope_freqs.weight (llama3 RoPE scaling factors) is not supported",
                          g->name);

    const struct gguf_tensor *embd = gguf_tensor(g, "token_embd.weight");
    if (!embd)
        return model_errf(err, MODEL_EFORMAT, "%s: missing tensor token_embd.weight", g->name);
    const struct gguf_kv *tokens;
    if ((st = gguf_get_arr(g, "tokenizer.ggml.tokens", false, GGUF_STR, &tokens, err)))
        return st;
    int64_t vocab = (int64_t)embd->ne[1];
    if ((st = set(root, "vocab_size", json_integer(vocab), g, err)))
        return st;
    /* the embedding's dtype, or f32 for the f32 copy a quantized one
     * becomes (gguf_files_open) */
    const char *dtype = embd->type->dt.be == BE_F16 ? "float16" : embd->type->dt.be == BE_BF16 ? "bfloat16" : "float32";
    bool bias = gguf_tensor(g, "blk.0.attn_q.bias") != NULL;
    if ((st = set(root, "torch_dtype", json_string(dtype), g, err)) ||
        (st = set(root, "hidden_act", json_string("silu"), g, err)) ||
        (st = set(root, "tie_word_embeddings", json_boolean(!gguf_tensor(g, "output.weight")), g, err)) ||
        (strcmp(a, "qwen2") && (st = set(root, "attention_bias", json_boolean(bias), g, err))))
        return st;

    int64_t bos, eos, eot, pad;
    if ((st = token_key(g, "tokenizer.ggml.bos_token_id", vocab, &bos, err)) ||
        (st = token_key(g, "tokenizer.ggml.eos_token_id", vocab, &eos, err)) ||
        (st = token_key(g, "tokenizer.ggml.eot_token_id", vocab, &eot, err)) ||
        (st = token_key(g, "tokenizer.ggml.padding_token_id", vocab, &pad, err)))
        return st;
    json_t *eos_ids = json_array();
    if (!eos_ids)
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    /* generation ends at the end-of-turn token too, as llama.cpp's does */
    if ((eos >= 0 && json_array_append_new(eos_ids, json_integer(eos))) ||
        (eot >= 0 && eot != eos && json_array_append_new(eos_ids, json_integer(eot))))
        st = model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    if (st == MODEL_OK)
        st = set(root, "eos_token_id", eos_ids, g, err);
    else
        json_decref(eos_ids);
    if (st == MODEL_OK && bos >= 0)
        st = set(root, "bos_token_id", json_integer(bos), g, err);
    if (st == MODEL_OK && pad >= 0)
        st = set(root, "pad_token_id", json_integer(pad), g, err);
    return st;
}

enum model_status gguf_config_load(const char *path, struct model_config *cfg, char *err)
{
    struct gguf *g;
    memset(cfg, 0, sizeof *cfg);
    enum model_status st = gguf_open(path, &g, err);
    if (st != MODEL_OK)
        return st;
    json_t *root = json_object();
    st = root ? config_json(g, root, err) : model_errf(err, MODEL_ENOMEM, "%s: out of memory", path);
    char label[PATH_MAX + 32];
    snprintf(label, sizeof label, "%s (metadata as config.json)", path);
    if (st == MODEL_OK)
        st = model_config_parse(root, NULL, label, cfg, err);
    json_decref(root);
    gguf_close(g);
    return st;
}

/* ---- weights -------------------------------------------------------------- */

/* Puts back Hugging Face's row order of a llama file's q or k projection
 * (and bias): llama.cpp's converter moved row h*hd + j*hd/2 + i of each
 * head of hd rows to h*hd + 2i + j. */
static void unpermute_rows(const char *src, char *dst, int rows, size_t row_bytes, int heads)
{
    int hd = rows / heads;
    for (int h = 0; h < heads; h++)
        for (int j = 0; j < 2; j++)
            for (int i = 0; i < hd / 2; i++)
                memcpy(dst + (size_t)(h * hd + j * hd / 2 + i) * row_bytes,
                       src + (size_t)(h * hd + 2 * i + j) * row_bytes, row_bytes);
}

static enum model_status unpermute_mat(model_files *mf, struct model_mat *m, int heads, char *err)
{
    size_t row_bytes = be_row_bytes(m->dtype, (size_t)m->cols);
    char *dst = malloc((size_t)m->rows * row_bytes);
    if (!dst)
        return model_errf(err, MODEL_ENOMEM, "out of memory reordering %d rows of q/k", m->rows);
    unpermute_rows(m->data, dst, m->rows, row_bytes, heads);
    m->data = dst;
    return model_files_keep(mf, dst, err);
}

static enum model_status unpermute_vec(const float *v, int n, int heads, char *err)
{
    float *tmp = malloc((size_t)n * sizeof *tmp);
    if (!tmp)
        return model_errf(err, MODEL_ENOMEM, "out of memory reordering a q/k bias");
    unpermute_rows((const char *)v, (char *)tmp, n, sizeof *tmp, heads);
    memcpy((float *)v, tmp, (size_t)n * sizeof *tmp); /* the binder's own f32 copy */
    free(tmp);
    return MODEL_OK;
}

static enum model_status unpermute(model_files *mf, const struct model_config *c, struct model_weights *w, char *err)
{
    enum model_status st = MODEL_OK;
    for (int l = 0; l < c->n_layers && st == MODEL_OK; l++) {
        struct model_layer *L = &w->layers[l];
        if ((st = unpermute_mat(mf, &L->wq, c->n_heads, err)) || (st = unpermute_mat(mf, &L->wk, c->n_kv_heads, err)))
            break;
        if (L->bq && ((st = unpermute_vec(L->bq, c->n_heads * c->head_dim, c->n_heads, err)) ||
                      (st = unpermute_vec(L->bk, c->n_kv_heads * c->head_dim, c->n_kv_heads, err))))
            break;
    }
    return st;
}

/* be_embed reads float tables only: a quantized token_embd becomes an f32
 * copy (exact for Q8_0: an f16 scale times a small integer), the dtype
 * config_json gave the model; lm_head keeps the quantized rows. */
static enum model_status embed_f32(model_files *mf, struct model_weights *w, char *err)
{
    const struct gguf_type *t = gguf_block_type((int)w->tok_embed.dtype);
    if (!t)
        return MODEL_OK;
    size_t n = (size_t)w->tok_embed.rows * (size_t)w->tok_embed.cols;
    float *dst = malloc(n * sizeof *dst);
    if (!dst)
        return model_errf(err, MODEL_ENOMEM, "out of memory for the f32 copy of token_embd.weight (%zu bytes)",
                          n * sizeof *dst);
    t->to_f32(w->tok_embed.data, dst, n);
    w->tok_embed.data = dst;
    w->tok_embed.dtype = BE_F32;
    return model_files_keep(mf, dst, err);
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const struct st_tensor *)a)->name, ((const struct st_tensor *)b)->name);
}

/* mf's one file: g's map (moved there) and its tensors under their
 * Hugging Face names, in names[]. */
static enum model_status adopt(model_files *mf, struct gguf *g, char *names, char *err)
{
    struct st_file *f = &mf->files[0];
    mf->n_files = 1;
    if (!(f->name = strdup(g->name)) || !(f->tensors = calloc(g->n_t ? g->n_t : 1, sizeof *f->tensors)))
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory", g->name);
    f->map = g->map;
    f->map_size = g->size;
    g->map = NULL;
    f->data = f->map + g->data_off;
    f->data_size = f->map_size - g->data_off;
    for (uint64_t i = 0; i < g->n_t; i++) {
        const struct gguf_tensor *t = &g->t[i];
        char *name = names + i * HF_NAME_MAX;
        if (!hf_name(t->name, name))
            continue;
        struct st_tensor *s = &f->tensors[f->n_tensors++];
        *s = (struct st_tensor){.name = name, .dtype = &t->type->dt, .rank = t->n_dims, .begin = t->offset,
                                .end = t->offset + t->bytes};
        for (int d = 0; d < t->n_dims; d++) /* ggml's ne[0] is the row */
            s->shape[d] = t->ne[t->n_dims - 1 - d];
    }
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, by_name);
    return MODEL_OK;
}

enum model_status gguf_files_open(const char *path, const struct model_config *cfg, model_files **out,
                                  struct model_weights *w, char *err)
{
    *out = NULL;
    memset(w, 0, sizeof *w);
    struct gguf *g;
    const struct gguf_arch *ai = NULL;
    enum model_status st = gguf_open(path, &g, err);
    if (st != MODEL_OK)
        return st;
    model_files *mf = calloc(1, sizeof *mf);
    char *names = malloc((g->n_t ? g->n_t : 1) * HF_NAME_MAX);
    if (!mf || !names || !(mf->files = calloc(1, sizeof *mf->files)))
        st = model_errf(err, MODEL_ENOMEM, "%s: out of memory", path);
    if (st == MODEL_OK)
        st = find_arch(g, &ai, err);
    if (st == MODEL_OK) /* what changes when any tensor's name, type, shape or offset does */
        w->header_hash = XXH3_64bits(g->map, g->data_off);
    uint64_t hash = w->header_hash;
    if (st == MODEL_OK)
        st = adopt(mf, g, names, err);
    if (st == MODEL_OK)
        st = model_files_bind(mf, cfg, true, w, err);
    w->header_hash = hash;
    if (st == MODEL_OK && ai->permuted)
        st = unpermute(mf, cfg, w, err);
    if (st == MODEL_OK)
        st = embed_f32(mf, w, err);
    if (mf && mf->files)
        model_files_drop_tables(mf);
    free(names);
    gguf_close(g);
    if (st != MODEL_OK) {
        memset(w, 0, sizeof *w);
        model_files_close(mf);
        return st;
    }
    *out = mf;
    return MODEL_OK;
}
