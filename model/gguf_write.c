/* gguf_write.c - a Hugging Face directory as a GGUF v3 file (`kvtier
 * quantize`): the model as the loader binds it (config.c, safetensors.c),
 * written under llama.cpp's names and keys, with its tokenizer.json
 * (byte-level BPE, or SentencePiece-style BPE with byte fallback) as
 * tokenizer.ggml metadata, so that kvtierd and llama.cpp
 * both load the file.
 *
 * The inverse of gguf_model.c and gguf_tokenizer.c, which tests check by
 * loading what this writes; tools/st2gguf.py is the independent writer
 * they are tested against.  Q8_0 covers the layer matrices (q, k, v, o,
 * gate, up, down), the split --weights q8_0 makes at load, so a quantized
 * file computes exactly what --weights q8_0 computes from the directory;
 * Q4_K likewise what --weights q4_k computes (Q8_0 for rows that are not
 * whole super-blocks); the embeddings and lm_head keep their type
 * (docs/quantization.md).  Every decoder-only architecture the loader
 * reads (gguf_model.c) is written as llama.cpp's converter writes it:
 * Gemma's norms as 1 + w (the binder's copy already is), Phi-3's and
 * GPT-2's fused projections fused again from the binder's row views,
 * GPT-2's Conv1D weights [out, in] (the binder's transposed copy), what
 * llama.cpp derives rather than reads checked instead of written.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "model/gguf.h"
#include "util/half.h"
#include "util/q4k.h"
#include "util/q8.h"

#define ALIGN 32

enum { TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_USER = 4, TT_BYTE = 6 };

/* One tensor to write: a matrix of the bound weights or an f32 vector. */
struct wt {
    char name[64];
    struct model_mat m;        /* no data: vec */
    const float *vec;
    int len;                   /* vec's */
    uint32_t type;             /* ggml type */
    int heads;                 /* > 0: rows (or elements) permuted for llama.cpp's rope, in heads groups */
    uint64_t bytes, off;
};

struct writer {
    FILE *f;
    const char *path;
    char *err;
    enum model_status st;
    bool dry;      /* counting the metadata entries only: nothing written */
    uint64_t n_kv; /* metadata entries begun */
};

static void wr(struct writer *w, const void *p, size_t n)
{
    if (!w->dry && w->st == MODEL_OK && n && fwrite(p, 1, n, w->f) != n)
        w->st = model_errf(w->err, MODEL_EIO, "%s: write: %s", w->path, strerror(errno));
}

static void wr_u32(struct writer *w, uint32_t v) { wr(w, &v, 4); }
static void wr_u64(struct writer *w, uint64_t v) { wr(w, &v, 8); }

static void wr_str(struct writer *w, const char *s, size_t n)
{
    wr_u64(w, n);
    wr(w, s, n);
}

static void kv_head(struct writer *w, const char *key, uint32_t type)
{
    w->n_kv++;
    wr_str(w, key, strlen(key));
    wr_u32(w, type);
}

static void kv_u32(struct writer *w, const char *key, uint32_t v)
{
    kv_head(w, key, GGUF_U32);
    wr_u32(w, v);
}

static void kv_f32(struct writer *w, const char *key, float v)
{
    kv_head(w, key, GGUF_F32);
    wr(w, &v, 4);
}

static void kv_str(struct writer *w, const char *key, const char *v)
{
    kv_head(w, key, GGUF_STR);
    wr_str(w, v, strlen(v));
}

/* ---- the tokenizer ---------------------------------------------------------- */

struct vocab {
    int n;
    const char **tok; /* [n] NULL: unnamed (written as [PADi]) */
    size_t *len;
    int32_t *type;
    json_t *merges;   /* borrowed from tj */
    const char *pre;  /* byte-level: tokenizer.ggml.pre */
    bool spm;         /* SentencePiece-style (byte_fallback): "llama", with scores */
    bool prefix;      /* its Prepend("▁") */
    int unk;
    float *score;     /* [n] spm */
    json_t *tj, *tc;  /* tokenizer.json, tokenizer_config.json (may be NULL) */
};

static void vocab_free(struct vocab *v)
{
    free(v->tok);
    free(v->len);
    free(v->type);
    free(v->score);
    json_decref(v->tj);
    json_decref(v->tc);
}

/* The Split regex of a byte-level pre-tokenizer, by the name llama.cpp
 * gives it (gguf_tokenizer.c's table). */
static enum model_status find_pre(const json_t *pt, bool ignore_merges, bool nfc, const char **out, char *err)
{
    const json_t *list = json_object_get(pt, "pretokenizers");
    const char *regex = NULL;
    bool byte_level = false;
    for (size_t i = 0; i < (list ? json_array_size(list) : 1); i++) {
        const json_t *p = list ? json_array_get(list, i) : pt;
        const char *type = json_string_value(json_object_get(p, "type"));
        if (type && !strcmp(type, "ByteLevel"))
            byte_level = true;
        if (type && !strcmp(type, "Split"))
            regex = json_string_value(json_object_get(json_object_get(p, "pattern"), "Regex"));
    }
    if (!byte_level || !regex)
        return model_errf(err, MODEL_EUNSUPPORTED,
                          "tokenizer.json: only byte-level BPE tokenizers with a Split regex are written to GGUF");
    *out = gguf_pre_name(regex, ignore_merges, nfc);
    if (!*out)
        return model_errf(err, MODEL_EUNSUPPORTED,
                          "tokenizer.json: its split regex (with ignore_merges %s, %s) is none GGUF names",
                          ignore_merges ? "true" : "false", nfc ? "NFC" : "no normalizer");
    return MODEL_OK;
}

/* A SentencePiece-style tokenizer.json: spaces replaced by "▁", perhaps
 * one prepended (transformers' Llama files). */
static enum model_status spm_normalizer(const json_t *norm, bool *prefix, char *err)
{
    const json_t *list = json_object_get(norm, "normalizers"), *n;
    bool replace = false;
    size_t i;
    *prefix = false;
    json_array_foreach(list, i, n) {
        const char *type = json_string_value(json_object_get(n, "type"));
        const char *s = json_string_value(json_object_get(json_object_get(n, "pattern"), "String"));
        const char *c = json_string_value(json_object_get(n, "content"));
        const char *p = json_string_value(json_object_get(n, "prepend"));
        if (type && !strcmp(type, "Replace") && s && c && !strcmp(s, " ") && !strcmp(c, "\xe2\x96\x81"))
            replace = true;
        else if (type && !strcmp(type, "Prepend") && p && !strcmp(p, "\xe2\x96\x81"))
            *prefix = true;
        else
            return model_errf(err, MODEL_EUNSUPPORTED, "tokenizer.json: normalizers[%zu] is not written to GGUF", i);
    }
    if (!replace)
        return model_errf(err, MODEL_EUNSUPPORTED,
                          "tokenizer.json: byte_fallback without the normalizer Replace(\" \", \"\xe2\x96\x81\")");
    return MODEL_OK;
}

/* GGUF's SentencePiece scores, which a loader turns back into merges: a
 * token's is minus the rank of the first merge that makes it (-1e9 when
 * none does), so the merges come back in tokenizer.json's order; the
 * unknown token, <0xNN> bytes and control tokens get their types. */
static enum model_status spm_scores(struct vocab *v, const json_t *vocab, const char *unk, char *err)
{
    if (!(v->score = malloc((size_t)v->n * sizeof *v->score)))
        return model_errf(err, MODEL_ENOMEM, "tokenizer.json: out of memory");
    for (int i = 0; i < v->n; i++)
        v->score[i] = -1e9f;
    char buf[512];
    for (size_t r = json_array_size(v->merges); r-- > 0;) { /* the first merge wins: set last */
        const json_t *x = json_array_get(v->merges, r);
        const char *a = json_string_value(json_is_string(x) ? x : json_array_get(x, 0));
        const char *b = json_is_string(x) ? NULL : json_string_value(json_array_get(x, 1));
        int n = a ? snprintf(buf, sizeof buf, "%s%s", a, b ? b : "") : -1;
        if (n < 0 || n >= (int)sizeof buf)
            continue;
        if (json_is_string(x)) { /* "a b": drop the separating space */
            char *sp = strchr(buf, ' ');
            if (!sp)
                continue;
            memmove(sp, sp + 1, strlen(sp));
        }
        json_int_t id = json_integer_value(json_object_get(vocab, buf));
        if (json_object_get(vocab, buf) && id >= 0 && id < v->n)
            v->score[id] = -(float)r;
    }
    json_int_t u = unk ? json_integer_value(json_object_get(vocab, unk)) : -1;
    v->unk = unk && json_object_get(vocab, unk) && u >= 0 && u < v->n ? (int)u : -1;
    for (int i = 0; i < v->n; i++) {
        bool byte = v->tok[i] && v->len[i] == 6 && !memcmp(v->tok[i], "<0x", 3) && v->tok[i][5] == '>';
        if (i == v->unk)
            v->type[i] = TT_UNKNOWN;
        else if (byte && v->type[i] == TT_NORMAL)
            v->type[i] = TT_BYTE;
        if (v->type[i] != TT_NORMAL)
            v->score[i] = 0.0f;
    }
    return MODEL_OK;
}

static enum model_status read_vocab(const char *dir, int vocab_size, struct vocab *v, char *err)
{
    enum model_status st = model_json_load(dir, "tokenizer.json", false, &v->tj, err);
    char path[PATH_MAX];
    if (st == MODEL_OK)
        st = model_path(path, dir, "tokenizer_config.json", err);
    if (st != MODEL_OK)
        return st;
    /* as the tokenizer reads it: model_max_length may be 1e30 written as an integer */
    json_error_t je;
    if (access(path, F_OK) == 0 && !(v->tc = json_load_file(path, JSON_DECODE_INT_AS_REAL, &je)))
        return model_errf(err, MODEL_EFORMAT, "tokenizer_config.json: line %d column %d: %s", je.line, je.column,
                          je.text);
    const json_t *m = json_object_get(v->tj, "model");
    const char *type = json_string_value(json_object_get(m, "type"));
    json_t *vocab = json_object_get(m, "vocab");
    if (!type || strcmp(type, "BPE") || !json_is_object(vocab))
        return model_errf(err, MODEL_EUNSUPPORTED, "tokenizer.json: model.type must be BPE with a vocab object");
    const json_t *normalizer = json_object_get(v->tj, "normalizer");
    const char *norm = json_string_value(json_object_get(normalizer, "type"));
    v->spm = json_is_true(json_object_get(m, "byte_fallback"));
    v->unk = -1;
    if (v->spm)
        st = spm_normalizer(normalizer, &v->prefix, err);
    else if (norm && strcmp(norm, "NFC"))
        return model_errf(err, MODEL_EUNSUPPORTED, "tokenizer.json: normalizer %s is not written to GGUF (none, NFC)",
                          norm);
    if (st == MODEL_OK && !v->spm)
        st = find_pre(json_object_get(v->tj, "pre_tokenizer"), json_is_true(json_object_get(m, "ignore_merges")),
                      norm != NULL, &v->pre, err);
    if (st != MODEL_OK)
        return st;
    v->merges = json_object_get(m, "merges");
    v->n = vocab_size;
    v->tok = calloc((size_t)v->n, sizeof *v->tok);
    v->len = calloc((size_t)v->n, sizeof *v->len);
    v->type = malloc((size_t)v->n * sizeof *v->type);
    if (!v->tok || !v->len || !v->type)
        return model_errf(err, MODEL_ENOMEM, "tokenizer.json: out of memory");
    for (int i = 0; i < v->n; i++)
        v->type[i] = TT_CONTROL;
    const char *key;
    json_t *id;
    json_object_foreach(vocab, key, id) {
        json_int_t i = json_integer_value(id);
        if (!json_is_integer(id) || i < 0 || i >= vocab_size)
            return model_errf(err, MODEL_EFORMAT, "tokenizer.json: model.vocab[\"%.64s\"] is not an id below vocab_size %d",
                              key, vocab_size);
        v->tok[i] = key;
        v->len[i] = strlen(key);
        v->type[i] = TT_NORMAL;
    }
    json_t *added = json_object_get(v->tj, "added_tokens"), *a;
    size_t k;
    json_array_foreach(added, k, a) {
        json_int_t i = json_integer_value(json_object_get(a, "id"));
        const char *content = json_string_value(json_object_get(a, "content"));
        if (!content || i < 0 || i >= vocab_size)
            return model_errf(err, MODEL_EFORMAT, "tokenizer.json: added_tokens[%zu] is not a token below vocab_size %d", k,
                              vocab_size);
        v->tok[i] = content;
        v->len[i] = strlen(content);
        v->type[i] = json_is_true(json_object_get(a, "special")) ? TT_CONTROL : TT_USER;
    }
    return v->spm ? spm_scores(v, vocab, json_string_value(json_object_get(m, "unk_token")), err) : MODEL_OK;
}

static int n_merges(const struct vocab *v)
{
    return (int)json_array_size(v->merges);
}

static void write_tokenizer(struct writer *w, const struct model_config *c, const struct vocab *v)
{
    kv_str(w, "tokenizer.ggml.model", v->spm ? "llama" : "gpt2");
    if (v->spm) {
        kv_head(w, "tokenizer.ggml.add_space_prefix", GGUF_BOOL);
        uint8_t b = v->prefix;
        wr(w, &b, 1);
        kv_head(w, "tokenizer.ggml.scores", GGUF_ARR);
        wr_u32(w, GGUF_F32);
        wr_u64(w, (uint64_t)v->n);
        wr(w, v->score, (size_t)v->n * 4);
        if (v->unk >= 0)
            kv_u32(w, "tokenizer.ggml.unknown_token_id", (uint32_t)v->unk);
    } else {
        kv_str(w, "tokenizer.ggml.pre", v->pre);
    }
    kv_head(w, "tokenizer.ggml.tokens", GGUF_ARR);
    wr_u32(w, GGUF_STR);
    wr_u64(w, (uint64_t)v->n);
    for (int i = 0; i < v->n; i++) {
        char pad[32];
        /* the embedding has rows no token names: GGUF names every id */
        if (!v->tok[i])
            snprintf(pad, sizeof pad, "[PAD%d]", i);
        wr_str(w, v->tok[i] ? v->tok[i] : pad, v->tok[i] ? v->len[i] : strlen(pad));
    }
    kv_head(w, "tokenizer.ggml.token_type", GGUF_ARR);
    wr_u32(w, GGUF_I32);
    wr_u64(w, (uint64_t)v->n);
    wr(w, v->type, (size_t)v->n * 4);
    kv_head(w, "tokenizer.ggml.merges", GGUF_ARR);
    wr_u32(w, GGUF_STR);
    wr_u64(w, (uint64_t)n_merges(v));
    for (int i = 0; i < n_merges(v); i++) { /* also SentencePiece's: llama.cpp reads neither */
        const json_t *m = json_array_get(v->merges, (size_t)i);
        if (json_is_string(m)) {
            wr_str(w, json_string_value(m), json_string_length(m));
            continue;
        }
        /* ["a", "b"] as "a b" */
        const char *a = json_string_value(json_array_get(m, 0)), *b = json_string_value(json_array_get(m, 1));
        size_t la = a ? strlen(a) : 0, lb = b ? strlen(b) : 0;
        wr_u64(w, la + 1 + lb);
        wr(w, a, la);
        wr(w, " ", 1);
        wr(w, b, lb);
    }
    if (c->bos_token_id >= 0)
        kv_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)c->bos_token_id);
    if (c->n_eos > 0)
        kv_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)c->eos_token_ids[0]);
    if (c->n_eos > 1)
        kv_u32(w, "tokenizer.ggml.eot_token_id", (uint32_t)c->eos_token_ids[1]);
    if (c->pad_token_id >= 0)
        kv_u32(w, "tokenizer.ggml.padding_token_id", (uint32_t)c->pad_token_id);
    kv_head(w, "tokenizer.ggml.add_bos_token", GGUF_BOOL);
    uint8_t add_bos = json_is_true(json_object_get(v->tc, "add_bos_token"));
    wr(w, &add_bos, 1);
    const char *tpl = json_string_value(json_object_get(v->tc, "chat_template"));
    if (tpl)
        kv_str(w, "tokenizer.chat_template", tpl);
}

/* ---- tensors ------------------------------------------------------------------- */

/* A layer matrix's ggml type under t: q4_k's Q4_K where the rows are whole
 * super-blocks and Q8_0 elsewhere, the split --weights q4_k makes at load
 * (model_weights_mat_dtype). */
static uint32_t ggml_type(enum model_gguf_type t, int cols)
{
    switch (t) {
    case MODEL_GGUF_F32: return 0;
    case MODEL_GGUF_F16: return 1;
    case MODEL_GGUF_BF16: return 30;
    case MODEL_GGUF_Q8_0: return 8;
    case MODEL_GGUF_Q4_K: return model_weights_mat_dtype(MODEL_WEIGHTS_Q4_K, cols) == BE_Q4_K ? GGML_TYPE_Q4_K : 8;
    }
    return 0;
}

static uint64_t mat_bytes(uint32_t type, const struct model_mat *m)
{
    uint64_t row = type == 8 ? (uint64_t)m->cols / Q8_0_BLOCK * sizeof(struct q8_0_block)
                   : type == GGML_TYPE_Q4_K ? q4_k_row_bytes((size_t)m->cols)
                                            : (uint64_t)m->cols * (type == 0 ? 4 : 2);
    return row * (uint64_t)m->rows;
}

/* The tensors of the file, in order, as plan() lists them. */
struct plan {
    struct wt *t;
    int n, cap;
    enum model_gguf_type type;
    uint32_t embed_type; /* token_embd, position_embd and output */
    char *err;
    enum model_status st;
};

static struct wt *plan_add(struct plan *p, const char *name, int layer)
{
    if (p->st != MODEL_OK) /* the first error is the one reported */
        return NULL;
    if (p->n == p->cap) { /* plan()'s bound is wrong: a bug, not an input */
        p->st = model_errf(p->err, MODEL_EINVAL, "%s: more tensors than planned", name);
        return NULL;
    }
    struct wt *x = &p->t[p->n++];
    *x = (struct wt){0};
    if (layer >= 0)
        snprintf(x->name, sizeof x->name, "blk.%d.%s", layer, name);
    else
        snprintf(x->name, sizeof x->name, "%s", name);
    return x;
}

/* A 1-D tensor, unless the model lacks it (v NULL). */
static void plan_vec(struct plan *p, const char *name, int layer, const float *v, int len, int heads)
{
    struct wt *x = v ? plan_add(p, name, layer) : NULL;
    if (x) {
        x->vec = v;
        x->len = len;
        x->heads = heads;
    }
}

/* A matrix, unless the model lacks it; a layer matrix is quantized under
 * q8_0 and q4_k, the others keep the embeddings' type. */
static void plan_mat(struct plan *p, const char *name, int layer, const struct model_mat *m, int heads)
{
    struct wt *x = m->data ? plan_add(p, name, layer) : NULL;
    if (!x)
        return;
    x->m = *m;
    x->heads = heads;
    x->type = layer >= 0 ? ggml_type(p->type, m->cols) : p->embed_type;
    if (x->type == 8 && m->cols % Q8_0_BLOCK)
        p->st = model_errf(p->err, MODEL_EUNSUPPORTED, "%s: %d columns, not a multiple of %d (Q8_0 blocks)", x->name,
                           m->cols, Q8_0_BLOCK);
}

/* Row views the binder made of one fused tensor (Phi-3's qkv_proj and
 * gate_up_proj, GPT-2's c_attn) as that tensor again: the parts are
 * consecutive rows of one buffer. */
static struct model_mat fused(const struct model_mat *a, const struct model_mat *b, const struct model_mat *c)
{
    struct model_mat m = *a;
    m.rows += b->rows + (c ? c->rows : 0);
    return m;
}

/* Names plan() may give one layer's tensors, so a bound on any family's
 * count; and the names outside the layers. */
#define LAYER_TENSORS 21
#define TOP_TENSORS 7

/* The tensors in file order, under llama.cpp's names: what its converter
 * writes for each architecture (tools/st2gguf.py lists the same). */
static enum model_status plan(const struct model_config *c, const struct model_weights *w, enum model_gguf_type t,
                              struct wt *out, int cap, int *n, char *err)
{
    /* embeddings and lm_head: as stored under q8_0 and q4_k, else the chosen float type */
    bool quant = t == MODEL_GGUF_Q8_0 || t == MODEL_GGUF_Q4_K;
    struct plan p = {.t = out, .cap = cap, .type = t, .err = err,
                     .embed_type = quant ? (c->dtype == BE_F16 ? 1 : c->dtype == BE_BF16 ? 30 : 0) : ggml_type(t, 0)};
    /* llama.cpp's llama rope reads q and k rows in interleaved pairs */
    bool permute = c->arch == ARCH_LLAMA || c->arch == ARCH_MISTRAL;
    int qh = permute ? c->n_heads : 0, kh = permute ? c->n_kv_heads : 0;
    int dim = c->hidden_size, q_dim = c->n_heads * c->head_dim, kv_dim = c->n_kv_heads * c->head_dim;
    bool gpt2 = c->arch == ARCH_GPT2;
    plan_mat(&p, "token_embd.weight", -1, &w->tok_embed, 0);
    plan_mat(&p, "position_embd.weight", -1, &w->pos_embed, 0);
    for (int l = 0; l < c->n_layers && p.st == MODEL_OK; l++) {
        const struct model_layer *L = &w->layers[l];
        plan_vec(&p, "attn_norm.weight", l, L->attn_norm, dim, 0);
        plan_vec(&p, "attn_norm.bias", l, L->attn_norm_b, dim, 0);
        if (c->fused_qkv || gpt2) {
            struct model_mat qkv = fused(&L->wq, &L->wk, &L->wv);
            plan_mat(&p, "attn_qkv.weight", l, &qkv, 0);
            plan_vec(&p, "attn_qkv.bias", l, L->bq, q_dim + 2 * kv_dim, 0); /* GPT-2's: one buffer too */
        } else {
            plan_mat(&p, "attn_q.weight", l, &L->wq, qh);
            plan_vec(&p, "attn_q.bias", l, L->bq, q_dim, qh);
            plan_mat(&p, "attn_k.weight", l, &L->wk, kh);
            plan_vec(&p, "attn_k.bias", l, L->bk, kv_dim, kh);
            plan_mat(&p, "attn_v.weight", l, &L->wv, 0);
            plan_vec(&p, "attn_v.bias", l, L->bv, kv_dim, 0);
        }
        plan_mat(&p, "attn_output.weight", l, &L->wo, 0);
        plan_vec(&p, "attn_output.bias", l, L->bo, dim, 0);
        /* Gemma's norms are 1 + w here already (the binder's copy), as
         * llama.cpp's converter stores them */
        plan_vec(&p, "post_attention_norm.weight", l, L->post_attn_norm, dim, 0);
        plan_vec(&p, "attn_q_norm.weight", l, L->q_norm, c->head_dim, 0);
        plan_vec(&p, "attn_k_norm.weight", l, L->k_norm, c->head_dim, 0);
        plan_vec(&p, "ffn_norm.weight", l, L->ffn_norm, dim, 0);
        plan_vec(&p, "ffn_norm.bias", l, L->ffn_norm_b, dim, 0);
        if (c->fused_gate_up) {
            struct model_mat gate_up = fused(&L->w_gate, &L->w_up, NULL);
            plan_mat(&p, "ffn_up.weight", l, &gate_up, 0);
        } else {
            plan_mat(&p, "ffn_gate.weight", l, &L->w_gate, 0);
            plan_mat(&p, "ffn_up.weight", l, &L->w_up, 0);
        }
        plan_vec(&p, "ffn_up.bias", l, L->b_up, c->intermediate_size, 0);
        plan_mat(&p, "ffn_down.weight", l, &L->w_down, 0);
        plan_vec(&p, "ffn_down.bias", l, L->b_down, dim, 0);
        plan_vec(&p, "post_ffw_norm.weight", l, L->post_ffn_norm, dim, 0);
    }
    plan_vec(&p, "output_norm.weight", -1, w->final_norm, dim, 0);
    plan_vec(&p, "output_norm.bias", -1, w->final_norm_b, dim, 0);
    if (!c->tie_word_embeddings)
        plan_mat(&p, "output.weight", -1, &w->lm_head, 0);
    if (c->rope_scaling == ROPE_SCALING_LONGROPE) { /* Phi-3's factors travel as tensors */
        plan_vec(&p, "rope_factors_long.weight", -1, c->rope_long_factor, c->rot_dim / 2, 0);
        plan_vec(&p, "rope_factors_short.weight", -1, c->rope_short_factor, c->rot_dim / 2, 0);
    }
    uint64_t off = 0;
    for (int i = 0; i < p.n; i++) {
        out[i].bytes = out[i].m.data ? mat_bytes(out[i].type, &out[i].m) : (uint64_t)out[i].len * 4;
        out[i].off = off;
        off += (out[i].bytes + ALIGN - 1) / ALIGN * ALIGN;
    }
    *n = p.n;
    return p.st;
}

/* Row r of the file: Hugging Face's row of it when permuted for llama.cpp's
 * rope (head h's row 2i + j is its row j * hd/2 + i). */
static int src_row(int r, int rows, int heads)
{
    if (!heads)
        return r;
    int hd = rows / heads, h = r / hd, i = r % hd / 2, j = r % 2;
    return h * hd + j * hd / 2 + i;
}

static void write_tensor(struct writer *w, const struct wt *t, float *buf, void *out)
{
    static const unsigned char zero[ALIGN];
    if (!t->m.data) {
        for (int r = 0; r < t->len; r++)
            wr(w, &t->vec[src_row(r, t->len, t->heads)], 4);
        wr(w, zero, (size_t)(-t->bytes % ALIGN));
        return;
    }
    const struct model_mat *m = &t->m;
    size_t cols = (size_t)m->cols, esz = be_dtype_size(m->dtype);
    size_t row_out = (size_t)(t->bytes / (uint64_t)m->rows);
    for (int r = 0; r < m->rows && w->st == MODEL_OK; r++) {
        const uint8_t *src = (const uint8_t *)m->data + (size_t)src_row(r, m->rows, t->heads) * cols * esz;
        bool same = (t->type == 0 && m->dtype == BE_F32) || (t->type == 1 && m->dtype == BE_F16) ||
                    (t->type == 30 && m->dtype == BE_BF16);
        if (same) {
            wr(w, src, row_out);
            continue;
        }
        for (size_t i = 0; i < cols; i++) {
            uint16_t h;
            if (m->dtype == BE_F32) {
                memcpy(&buf[i], src + 4 * i, 4);
                continue;
            }
            memcpy(&h, src + 2 * i, 2);
            buf[i] = m->dtype == BE_F16 ? f16_to_f32(h) : bf16_to_f32(h);
        }
        if (t->type == 8 || t->type == GGML_TYPE_Q4_K) {
            bool ok = t->type == 8 ? q8_0_quantize(buf, out, cols) : q4_k_quantize(buf, out, cols);
            if (!ok)
                w->st = model_errf(w->err, MODEL_EFORMAT, "%s: row %d has a NaN or an infinity%s", t->name, r,
                                   t->type == 8 ? "" : ", or is too large for Q4_K's f16 factors");
        } else if (t->type == 0) {
            memcpy(out, buf, cols * 4);
        } else {
            for (size_t i = 0; i < cols; i++)
                ((uint16_t *)out)[i] = t->type == 1 ? f32_to_f16(buf[i]) : f32_to_bf16(buf[i]);
        }
        wr(w, out, row_out);
    }
    wr(w, zero, (size_t)(-t->bytes % ALIGN));
}

static const char *arch_name(const struct model_config *c)
{
    switch (c->arch) {
    case ARCH_LLAMA: return "llama";
    case ARCH_MISTRAL: return c->sliding_window ? NULL : "llama"; /* llama.cpp's llama has no window */
    case ARCH_QWEN2: return "qwen2";
    case ARCH_QWEN3: return "qwen3";
    case ARCH_GEMMA2: return "gemma2";
    case ARCH_GEMMA3: return "gemma3";
    case ARCH_PHI3: return "phi3";
    case ARCH_GPT2: return "gpt2";
    case ARCH_MAMBA: return NULL; /* the GGUF loader reads no state-space model */
    }
    return NULL;
}

/* llama.cpp's period of Gemma's sliding layers, when not the default */
static int gemma_period_default(const struct model_config *c)
{
    return c->arch == ARCH_GEMMA2 ? 2 : 6;
}

/* The period P of Gemma's layers (layer i slides unless i % P = P - 1),
 * the one form GGUF holds them in; 0 when no period gives c's layers.
 * P = 1 is every layer full, P > n_layers every layer sliding. */
static int gemma_period(const struct model_config *c)
{
    int def = gemma_period_default(c);
    for (int k = 0; k <= c->n_layers + 1; k++) {
        int p = k ? k : def, i = 0; /* the default first: then no key is written */
        while (i < c->n_layers && (c->layer_window[i] != 0) == (i % p < p - 1) &&
               (!c->layer_window[i] || c->layer_window[i] == c->sliding_window))
            i++;
        if (i == c->n_layers)
            return p;
    }
    return 0;
}

/* {arch}.* as llama.cpp's converter writes them for c's family. */
static void write_hparams(struct writer *w, const struct model_config *c, const char *a)
{
    char key[96];
#define KEY(s) (snprintf(key, sizeof key, "%s.%s", a, s), key)
    kv_u32(w, KEY("context_length"), (uint32_t)c->max_position_embeddings);
    kv_u32(w, KEY("embedding_length"), (uint32_t)c->hidden_size);
    kv_u32(w, KEY("block_count"), (uint32_t)c->n_layers);
    kv_u32(w, KEY("feed_forward_length"), (uint32_t)c->intermediate_size);
    kv_u32(w, KEY("attention.head_count"), (uint32_t)c->n_heads);
    if (c->arch == ARCH_GPT2) { /* LayerNorm, learned positions: no RoPE keys */
        kv_f32(w, KEY("attention.layer_norm_epsilon"), c->rms_norm_eps);
        return;
    }
    bool gemma = c->arch == ARCH_GEMMA2 || c->arch == ARCH_GEMMA3;
    kv_u32(w, KEY("vocab_size"), (uint32_t)c->vocab_size);
    kv_u32(w, KEY("rope.dimension_count"), (uint32_t)c->rot_dim);
    kv_u32(w, KEY("attention.head_count_kv"), (uint32_t)c->n_kv_heads);
    kv_f32(w, KEY("attention.layer_norm_rms_epsilon"), c->rms_norm_eps);
    kv_f32(w, KEY("rope.freq_base"), c->rope_theta);
    if (gemma || c->head_dim * c->n_heads != c->hidden_size) {
        kv_u32(w, KEY("attention.key_length"), (uint32_t)c->head_dim);
        kv_u32(w, KEY("attention.value_length"), (uint32_t)c->head_dim);
    }
    if (c->rope_scaling == ROPE_SCALING_LINEAR) {
        kv_str(w, KEY("rope.scaling.type"), "linear");
        kv_f32(w, KEY("rope.scaling.factor"), c->rope_factor);
    }
    if (gemma) {
        int period = gemma_period(c);
        kv_u32(w, KEY("attention.sliding_window"), (uint32_t)c->sliding_window);
        if (period != gemma_period_default(c))
            kv_u32(w, KEY("attention.sliding_window_pattern"), (uint32_t)period);
        if (c->arch == ARCH_GEMMA2)
            kv_f32(w, KEY("attn_logit_softcapping"), c->attn_softcap);
        if (c->final_softcap > 0)
            kv_f32(w, KEY("final_logit_softcapping"), c->final_softcap);
        if (c->arch == ARCH_GEMMA3)
            kv_f32(w, KEY("rope.freq_base_swa"), c->rope_local_theta);
    }
    if (c->arch == ARCH_PHI3) {
        kv_u32(w, KEY("rope.scaling.original_context_length"),
               (uint32_t)(c->rope_original_max_pos > 0 ? c->rope_original_max_pos : c->max_position_embeddings));
        kv_u32(w, KEY("attention.sliding_window"), (uint32_t)c->sliding_window);
        if (c->rope_scaling == ROPE_SCALING_LONGROPE)
            kv_f32(w, KEY("rope.scaling.attn_factor"), c->rope_attn_factor);
    }
#undef KEY
}

static void write_meta(struct writer *w, const struct model_config *c, const struct vocab *v, const char *name,
                       enum model_gguf_type type)
{
    static const uint32_t FILE_TYPE[] = {[MODEL_GGUF_F32] = 0, [MODEL_GGUF_F16] = 1, [MODEL_GGUF_BF16] = 32,
                                         [MODEL_GGUF_Q8_0] = 7, [MODEL_GGUF_Q4_K] = 15};
    const char *a = arch_name(c);
    kv_str(w, "general.architecture", a);
    kv_str(w, "general.name", name);
    kv_u32(w, "general.file_type", FILE_TYPE[type]);
    kv_u32(w, "general.alignment", ALIGN);
    write_hparams(w, c, a);
    write_tokenizer(w, c, v);
}

static void write_file(struct writer *w, const struct model_config *c, const struct vocab *v, const char *name,
                       enum model_gguf_type type, const struct wt *t, int n)
{
    /* the entry count comes first: a dry pass counts them */
    w->dry = true;
    w->n_kv = 0;
    write_meta(w, c, v, name, type);
    w->dry = false;
    wr(w, "GGUF", 4);
    wr_u32(w, 3);
    wr_u64(w, (uint64_t)n);
    wr_u64(w, w->n_kv);
    write_meta(w, c, v, name, type);
    for (int i = 0; i < n; i++) {
        const struct wt *x = &t[i];
        wr_str(w, x->name, strlen(x->name));
        wr_u32(w, x->m.data ? 2 : 1);
        wr_u64(w, x->m.data ? (uint64_t)x->m.cols : (uint64_t)x->len);
        if (x->m.data)
            wr_u64(w, (uint64_t)x->m.rows);
        wr_u32(w, x->type);
        wr_u64(w, x->off);
    }
    long pos = ftell(w->f);
    static const unsigned char zero[ALIGN];
    if (pos >= 0)
        wr(w, zero, (size_t)(-(unsigned long)pos % ALIGN));
}

/* Gemma as llama.cpp derives it: the attention scale from the shape
 * (no key holds query_pre_attn_scalar), Gemma 2 always capped, Gemma 3
 * never capped in attention, the sliding layers in one period. */
static enum model_status check_gemma(const struct model_config *c, char *err)
{
    bool big = c->n_layers == (c->arch == ARCH_GEMMA2 ? 46 : 62);
    int want = big ? c->hidden_size / c->n_heads : c->head_dim;
    if (c->attn_scale != (float)(1.0 / sqrt((double)want)))
        return model_errf(err, MODEL_EUNSUPPORTED,
                          "%s: query_pre_attn_scalar other than %d, which llama.cpp takes for this shape, is not "
                          "written to GGUF", c->arch_name, want);
    if (c->arch == ARCH_GEMMA2 && (c->attn_softcap <= 0 || c->final_softcap <= 0))
        return model_errf(err, MODEL_EUNSUPPORTED, "%s without a soft cap is not written to GGUF (llama.cpp always caps)",
                          c->arch_name);
    if (c->arch == ARCH_GEMMA3 && c->attn_softcap > 0)
        return model_errf(err, MODEL_EUNSUPPORTED,
                          "%s with attn_logit_softcapping is not written to GGUF (llama.cpp has none)", c->arch_name);
    if (!gemma_period(c))
        return model_errf(err, MODEL_EUNSUPPORTED,
                          "%s: layer_types that no period of sliding layers gives are not written to GGUF", c->arch_name);
    return MODEL_OK;
}

static enum model_status check_model(const struct model_config *c, char *err)
{
    if (!arch_name(c))
        return model_errf(err, MODEL_EUNSUPPORTED,
                          "%s%s is not written to GGUF (Llama, Mistral without a sliding window, Qwen2, Qwen3, Gemma 2, "
                          "Gemma 3, Phi-3 and GPT-2 are)",
                          c->arch_name, c->arch == ARCH_MISTRAL ? " with a sliding window" : "");
    if (c->arch == ARCH_GEMMA2 || c->arch == ARCH_GEMMA3) {
        enum model_status st = check_gemma(c, err);
        if (st != MODEL_OK)
            return st;
    } else if (c->arch != ARCH_PHI3) { /* Phi-3's window is every layer's, one key */
        for (int l = 0; l < c->n_layers; l++)
            if (c->layer_window[l])
                return model_errf(err, MODEL_EUNSUPPORTED, "layer %d has a sliding window, which GGUF's %s does not carry",
                                  l, arch_name(c));
    }
    bool ok = c->rope_scaling == ROPE_SCALING_NONE || c->rope_scaling == ROPE_SCALING_LINEAR ||
              (c->rope_scaling == ROPE_SCALING_LONGROPE && c->arch == ARCH_PHI3);
    if (!ok)
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: rope_scaling other than linear%s is not written to GGUF",
                          c->arch_name, c->arch == ARCH_PHI3 ? " and longrope" : "");
    return MODEL_OK;
}

bool model_gguf_type_parse(const char *s, enum model_gguf_type *out)
{
    static const char *const names[] = {[MODEL_GGUF_Q8_0] = "q8_0", [MODEL_GGUF_BF16] = "bf16",
                                        [MODEL_GGUF_F16] = "f16", [MODEL_GGUF_F32] = "f32",
                                        [MODEL_GGUF_Q4_K] = "q4_k"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i])) {
            *out = (enum model_gguf_type)i;
            return true;
        }
    return false;
}

enum model_status model_gguf_write(const char *dir, const char *out, enum model_gguf_type type, char *err)
{
    struct model_config c;
    struct model_weights w;
    model_files *mf = NULL;
    struct vocab v = {0};
    struct wt *t = NULL;
    float *buf = NULL;
    void *row = NULL;
    char tmp[PATH_MAX];
    int n = 0;
    if (snprintf(tmp, sizeof tmp, "%s.tmp", out) >= (int)sizeof tmp)
        return model_errf(err, MODEL_EINVAL, "%s: path too long", out);
    enum model_status st = model_config_load(dir, &c, err);
    if (st != MODEL_OK)
        return st;
    if ((st = check_model(&c, err)) == MODEL_OK)
        st = model_files_open(dir, &c, &mf, &w, err);
    if (st == MODEL_OK)
        st = read_vocab(dir, c.vocab_size, &v, err);
    int cap = c.n_layers * LAYER_TENSORS + TOP_TENSORS;
    if (st == MODEL_OK) {
        t = calloc((size_t)cap, sizeof *t);
        buf = malloc((size_t)(c.intermediate_size > c.vocab_size ? c.intermediate_size : c.vocab_size) * 4 +
                     (size_t)c.n_heads * (size_t)c.head_dim * 4 + (size_t)c.hidden_size * 4);
        row = malloc((size_t)(c.intermediate_size + c.hidden_size + c.n_heads * c.head_dim) * 4);
        if (!t || !buf || !row)
            st = model_errf(err, MODEL_ENOMEM, "out of memory");
    }
    if (st == MODEL_OK)
        st = plan(&c, &w, type, t, cap, &n, err);
    struct writer wr_ = {.path = out, .err = err, .st = st};
    if (st == MODEL_OK && !(wr_.f = fopen(tmp, "wb")))
        st = wr_.st = model_errf(err, MODEL_EIO, "%s: %s", tmp, strerror(errno));
    if (st == MODEL_OK) {
        const char *slash = strrchr(dir, '/');
        write_file(&wr_, &c, &v, slash && slash[1] ? slash + 1 : dir, type, t, n);
        for (int i = 0; i < n && wr_.st == MODEL_OK; i++)
            write_tensor(&wr_, &t[i], buf, row);
        if (fclose(wr_.f) != 0 && wr_.st == MODEL_OK)
            wr_.st = model_errf(err, MODEL_EIO, "%s: %s", tmp, strerror(errno));
        st = wr_.st;
        if (st == MODEL_OK && rename(tmp, out) != 0)
            st = model_errf(err, MODEL_EIO, "%s: %s", out, strerror(errno));
        if (st != MODEL_OK)
            unlink(tmp);
    }
    free(t);
    free(buf);
    free(row);
    vocab_free(&v);
    model_files_close(mf);
    model_config_release(&c);
    return st;
}
