/* Description: the Hugging Face model loader (model/config.c,
 * model/safetensors.c); one file over 1,000 lines, as every case writes
 * its model directory with the same small writer.  Each test writes a tiny model directory (config.json
 * and safetensors written by the small writer below) into a fresh temporary
 * directory: good Llama/Mistral/Qwen2/Qwen3/Gemma2/Gemma3 checkpoints bind with the right
 * pointers, shapes, dtypes, values and sliding windows; every bad file or
 * config field fails with the right status and a message naming the file and
 * the tensor or field.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <ftw.h>
#include <math.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/encdec.h"
#include "model/model.h"
#include "text/tokenizer.h"
#include "tiers/kvstore.h"
#include "util/q4k.h"
#include "util/q8.h"

/* ---- the temporary model directory ---------------------------------------- */

static char g_dir[64];

static int setup(void **state)
{
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/kvtier-loader-XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static int teardown(void **state)
{
    (void)state;
    return nftw(g_dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
}

static void write_file(const char *name, const void *buf, size_t len)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

static void write_json(const char *name, json_t *j)
{
    char *s = json_dumps(j, JSON_INDENT(1));
    assert_non_null(s);
    write_file(name, s, strlen(s));
    free(s);
}

/* Writes config c (taken) as config.json with key set to v (taken; NULL:
 * removed). */
static void write_config_with(json_t *c, const char *key, json_t *v)
{
    assert_non_null(c);
    if (v)
        json_object_set_new(c, key, v);
    else
        json_object_del(c, key);
    write_json("config.json", c);
    json_decref(c);
}

/* ---- tensor values ------------------------------------------------------- */

static uint32_t name_hash(const char *s)
{
    uint32_t h = 2166136261u;
    while (*s)
        h = (h ^ (uint8_t)*s++) * 16777619u;
    return h;
}

/* Element i of the tensor called name: multiples of 1/8 in [-1, 1], exact
 * in f16 and bf16, and different from tensor to tensor. */
static float expected(const char *name, size_t i)
{
    return (float)((int)((name_hash(name) + i) % 17) - 8) * 0.125f;
}

static size_t dtype_bytes(const char *dt)
{
    return strcmp(dt, "F32") == 0 ? 4 : strcmp(dt, "I8") == 0 || strcmp(dt, "U8") == 0 ? 1 : 2;
}

static void encode(const char *dt, float v, uint8_t *out)
{
    if (strcmp(dt, "F32") == 0) {
        memcpy(out, &v, 4);
    } else if (strcmp(dt, "F16") == 0) {
        _Float16 h = (_Float16)v;
        memcpy(out, &h, 2);
    } else if (strcmp(dt, "BF16") == 0) {
        uint32_t u;
        memcpy(&u, &v, 4);
        out[0] = (uint8_t)(u >> 16);
        out[1] = (uint8_t)(u >> 24);
    } else {
        memset(out, 0, dtype_bytes(dt));
    }
}

static float mat_at(const struct model_mat *m, size_t i)
{
    const uint8_t *p = m->data;
    switch (m->dtype) {
    case BE_F32: return ((const float *)p)[i];
    case BE_F16: return (float)((const _Float16 *)p)[i];
    case BE_BF16: {
        uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    case BE_Q8_0: case BE_Q4_K: break; /* the loader binds checkpoint dtypes only */
    }
    return 0;
}

/* ---- a safetensors writer ------------------------------------------------- */

struct stw {
    json_t *header;
    uint8_t *data;
    size_t size;
};

static void stw_init(struct stw *w)
{
    w->header = json_object();
    w->data = NULL;
    w->size = 0;
    assert_non_null(w->header);
}

/* Appends a tensor of expected() values; rank 1 when cols == 0. */
static void stw_add(struct stw *w, const char *name, const char *dt, long rows, long cols)
{
    size_t n = (size_t)rows * (size_t)(cols ? cols : 1), bytes = n * dtype_bytes(dt);
    w->data = realloc(w->data, w->size + bytes + 1);
    assert_non_null(w->data);
    for (size_t i = 0; i < n; i++)
        encode(dt, expected(name, i), w->data + w->size + i * dtype_bytes(dt));
    json_t *shape = cols ? json_pack("[I,I]", (json_int_t)rows, (json_int_t)cols) : json_pack("[I]", (json_int_t)rows);
    json_object_set_new(w->header, name,
                        json_pack("{s:s, s:o, s:[I,I]}", "dtype", dt, "shape", shape, "data_offsets",
                                  (json_int_t)w->size, (json_int_t)(w->size + bytes)));
    w->size += bytes;
}

static void set_offsets(struct stw *w, const char *name, long begin, long end)
{
    json_t *t = json_object_get(w->header, name);
    assert_non_null(t);
    json_object_set_new(t, "data_offsets", json_pack("[I,I]", (json_int_t)begin, (json_int_t)end));
}

/* Writes the file (header padded with spaces to 8 bytes, as the safetensors
 * library does) and frees w. */
static void stw_write(struct stw *w, const char *file)
{
    char *h = json_dumps(w->header, JSON_COMPACT | JSON_SORT_KEYS);
    assert_non_null(h);
    size_t hlen = strlen(h), padded = (hlen + 7) / 8 * 8, total = 8 + padded + w->size;
    uint8_t *buf = malloc(total);
    assert_non_null(buf);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, h, hlen);
    memset(buf + 8 + hlen, ' ', padded - hlen);
    if (w->size)
        memcpy(buf + 8 + padded, w->data, w->size);
    write_file(file, buf, total);
    free(buf);
    free(h);
    free(w->data);
    json_decref(w->header);
}

/* ---- a tiny model of each family ------------------------------------------ */

struct spec {
    const char *arch;
    const char *dtype; /* "F32", "F16", "BF16" */
    int vocab, dim, ffn, layers, heads, kv_heads, head_dim;
    bool tie, qkv_bias, o_bias, qk_norm;
    bool gemma; /* the four Gemma norms per layer, hidden_activation */
    bool fused; /* Phi-3: qkv_proj and gate_up_proj */
};

static struct spec spec_of(const char *arch)
{
    struct spec s = {.arch = arch, .dtype = "BF16", .vocab = 40, .dim = 16, .ffn = 24, .layers = 3, .heads = 4,
                     .kv_heads = 2, .head_dim = 4};
    s.qkv_bias = strcmp(arch, "Qwen2ForCausalLM") == 0;
    s.qk_norm = strcmp(arch, "Qwen3ForCausalLM") == 0 || strcmp(arch, "Gemma3ForCausalLM") == 0;
    s.gemma = strncmp(arch, "Gemma", 5) == 0;
    s.fused = strcmp(arch, "Phi3ForCausalLM") == 0;
    s.tie = s.gemma;
    return s;
}

static const char *torch_dtype(const char *dt)
{
    return strcmp(dt, "F32") == 0 ? "float32" : strcmp(dt, "F16") == 0 ? "float16" : "bfloat16";
}

static json_t *spec_config(const struct spec *s)
{
    json_t *c = json_pack("{s:[s], s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:f, s:b, s:s, s:s, s:i, s:i}",
                          "architectures", s->arch, "vocab_size", s->vocab, "hidden_size", s->dim,
                          "intermediate_size", s->ffn, "num_hidden_layers", s->layers, "num_attention_heads", s->heads,
                          "num_key_value_heads", s->kv_heads, "head_dim", s->head_dim, "max_position_embeddings", 256,
                          "rms_norm_eps", 1e-5, "rope_theta", 500000.0, "tie_word_embeddings", s->tie, "torch_dtype",
                          torch_dtype(s->dtype), "hidden_act", "silu", "bos_token_id", 1, "eos_token_id", 2);
    assert_non_null(c);
    if (s->o_bias)
        json_object_set_new(c, "attention_bias", json_true());
    if (s->gemma) {
        json_object_del(c, "hidden_act");
        json_object_set_new(c, "hidden_activation", json_string("gelu_pytorch_tanh"));
    }
    return c;
}

/* Every tensor of the spec, in HF order, plus one HF extra to ignore. */
static void spec_tensors(const struct spec *s, struct stw *w)
{
    char n[128];
    int q = s->heads * s->head_dim, kv = s->kv_heads * s->head_dim;
    stw_add(w, "model.embed_tokens.weight", s->dtype, s->vocab, s->dim);
    for (int l = 0; l < s->layers; l++) {
#define T(suffix, rows, cols)                                           \
    do {                                                                \
        snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);         \
        stw_add(w, n, s->dtype, rows, cols);                            \
    } while (0)
        T("input_layernorm.weight", s->dim, 0);
        if (s->fused) {
            T("self_attn.qkv_proj.weight", q + 2 * kv, s->dim);
        } else {
            T("self_attn.q_proj.weight", q, s->dim);
            T("self_attn.k_proj.weight", kv, s->dim);
            T("self_attn.v_proj.weight", kv, s->dim);
        }
        T("self_attn.o_proj.weight", s->dim, q);
        if (s->qkv_bias || s->o_bias) {
            T("self_attn.q_proj.bias", q, 0);
            T("self_attn.k_proj.bias", kv, 0);
            T("self_attn.v_proj.bias", kv, 0);
        }
        if (s->o_bias)
            T("self_attn.o_proj.bias", s->dim, 0);
        if (s->qk_norm) {
            T("self_attn.q_norm.weight", s->head_dim, 0);
            T("self_attn.k_norm.weight", s->head_dim, 0);
        }
        T("post_attention_layernorm.weight", s->dim, 0);
        if (s->gemma) {
            T("pre_feedforward_layernorm.weight", s->dim, 0);
            T("post_feedforward_layernorm.weight", s->dim, 0);
        }
        if (s->fused) {
            T("mlp.gate_up_proj.weight", 2 * s->ffn, s->dim);
        } else {
            T("mlp.gate_proj.weight", s->ffn, s->dim);
            T("mlp.up_proj.weight", s->ffn, s->dim);
        }
        T("mlp.down_proj.weight", s->dim, s->ffn);
        /* HF checkpoints of older releases carry this buffer; it is ignored. */
        T("self_attn.rotary_emb.inv_freq", s->head_dim / 2, 0);
#undef T
    }
    stw_add(w, "model.norm.weight", s->dtype, s->dim, 0);
    if (!s->tie)
        stw_add(w, "lm_head.weight", s->dtype, s->vocab, s->dim);
}

/* Writes config.json and model.safetensors for s. */
static void write_model(const struct spec *s)
{
    json_t *c = spec_config(s);
    write_json("config.json", c);
    json_decref(c);
    struct stw w;
    stw_init(&w);
    spec_tensors(s, &w);
    stw_write(&w, "model.safetensors");
}

/* A loaded directory; released by unload(). */
struct loaded {
    struct model_config cfg;
    model_files *files;
    struct model_weights w;
};

static void load_ok(struct loaded *m)
{
    char err[MODEL_ERR_LEN] = "";
    enum model_status st = model_config_load(g_dir, &m->cfg, err);
    if (st != MODEL_OK)
        fail_msg("config: %s: %s", model_strerror(st), err);
    st = model_files_open(g_dir, &m->cfg, &m->files, &m->w, err);
    if (st != MODEL_OK)
        fail_msg("files: %s: %s", model_strerror(st), err);
}

static void unload(struct loaded *m)
{
    model_files_close(m->files);
    model_config_release(&m->cfg);
}

/* Loads g_dir expecting status want with a message containing every one of
 * the NULL-terminated substrings. */
static void expect_fail(enum model_status want, ...)
{
    char err[MODEL_ERR_LEN] = "";
    struct model_config cfg;
    model_files *files = (model_files *)&files; /* must come back NULL */
    struct model_weights w;
    enum model_status st = model_config_load(g_dir, &cfg, err);
    if (st == MODEL_OK) {
        st = model_files_open(g_dir, &cfg, &files, &w, err);
        assert_true(st == MODEL_OK || files == NULL);
        assert_null(st == MODEL_OK ? NULL : w.layers);
        model_files_close(st == MODEL_OK ? files : NULL);
        model_config_release(&cfg);
    } else {
        assert_null(cfg.layer_window);
    }
    if (st != want)
        fail_msg("status %s, wanted %s (%s)", model_strerror(st), model_strerror(want), err);
    va_list ap;
    va_start(ap, want);
    for (const char *s; (s = va_arg(ap, const char *));)
        if (!strstr(err, s))
            fail_msg("message \"%s\" lacks \"%s\"", err, s);
    va_end(ap);
}

/* Checks a bound matrix against the tensor written under name. */
static void check_mat(const struct model_mat *m, const char *name, enum be_dtype dt, int rows, int cols)
{
    assert_non_null(m->data);
    assert_int_equal(m->dtype, dt);
    assert_int_equal(m->rows, rows);
    assert_int_equal(m->cols, cols);
    assert_int_equal((uintptr_t)m->data % (dt == BE_F32 ? 4 : 2), 0);
    size_t last = (size_t)rows * (size_t)cols - 1;
    const size_t at[] = {0, 1, 7, last};
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++)
        assert_float_equal(mat_at(m, at[i]), expected(name, at[i]), 0);
}

static void check_vec(const float *v, const char *name, int len)
{
    assert_non_null(v);
    for (int i = 0; i < len; i++)
        assert_float_equal(v[i], expected(name, (size_t)i), 0);
}

/* ---- good models ----------------------------------------------------------- */

static void test_llama_bf16(void **state)
{
    (void)state;
    struct spec s = spec_of("LlamaForCausalLM");
    write_model(&s);
    struct loaded m;
    load_ok(&m);
    const struct model_config *c = &m.cfg;
    assert_int_equal(c->arch, ARCH_LLAMA);
    assert_string_equal(c->arch_name, "LlamaForCausalLM");
    assert_int_equal(c->vocab_size, 40);
    assert_int_equal(c->n_layers, 3);
    assert_int_equal(c->n_kv_heads, 2);
    assert_int_equal(c->head_dim, 4);
    assert_int_equal(c->dtype, BE_BF16);
    assert_float_equal(c->rope_theta, 500000.0f, 0);
    assert_float_equal(c->rms_norm_eps, 1e-5f, 1e-12);
    assert_int_equal(c->rope_layout, BE_ROPE_NEOX);
    assert_false(c->attention_bias);
    assert_false(c->qk_norm);
    assert_int_equal(c->bos_token_id, 1);
    assert_int_equal(c->n_eos, 1);
    assert_int_equal(c->eos_token_ids[0], 2);
    for (int l = 0; l < 3; l++)
        assert_int_equal(c->layer_window[l], 0);

    check_mat(&m.w.tok_embed, "model.embed_tokens.weight", BE_BF16, 40, 16);
    check_mat(&m.w.lm_head, "lm_head.weight", BE_BF16, 40, 16);
    check_vec(m.w.final_norm, "model.norm.weight", 16);
    const struct model_layer *L = &m.w.layers[2];
    check_mat(&L->wq, "model.layers.2.self_attn.q_proj.weight", BE_BF16, 16, 16);
    check_mat(&L->wk, "model.layers.2.self_attn.k_proj.weight", BE_BF16, 8, 16);
    check_mat(&L->wv, "model.layers.2.self_attn.v_proj.weight", BE_BF16, 8, 16);
    check_mat(&L->wo, "model.layers.2.self_attn.o_proj.weight", BE_BF16, 16, 16);
    check_mat(&L->w_gate, "model.layers.2.mlp.gate_proj.weight", BE_BF16, 24, 16);
    check_mat(&L->w_up, "model.layers.2.mlp.up_proj.weight", BE_BF16, 24, 16);
    check_mat(&L->w_down, "model.layers.2.mlp.down_proj.weight", BE_BF16, 16, 24);
    check_vec(L->attn_norm, "model.layers.2.input_layernorm.weight", 16);
    check_vec(L->ffn_norm, "model.layers.2.post_attention_layernorm.weight", 16);
    assert_null(L->bq);
    assert_null(L->bo);
    assert_null(L->q_norm);
    unload(&m);
}

/* The fingerprint that binds saved KV to a model: stable across loads,
 * moved by a config change alone and by the tensors' metadata. */
static void test_fingerprint(void **state)
{
    (void)state;
    struct spec s = spec_of("LlamaForCausalLM");
    write_model(&s);
    struct loaded a, b;
    load_ok(&a);
    load_ok(&b);
    assert_true(a.cfg.config_hash != 0 && a.w.header_hash != 0);
    assert_true(a.cfg.config_hash == b.cfg.config_hash && a.w.header_hash == b.w.header_hash);
    unload(&b);
    json_t *c = spec_config(&s); /* the same weights, one config value changed */
    json_object_set_new(c, "rms_norm_eps", json_real(1e-6));
    write_json("config.json", c);
    json_decref(c);
    load_ok(&b);
    assert_true(a.cfg.config_hash != b.cfg.config_hash && a.w.header_hash == b.w.header_hash);
    unload(&b);
    s.dtype = "F16"; /* the same shapes in another dtype: the tensors' headers differ */
    write_model(&s);
    load_ok(&b);
    assert_true(a.w.header_hash != b.w.header_hash);
    unload(&b);
    unload(&a);
}

static void test_llama_attention_bias(void **state)
{
    (void)state;
    struct spec s = spec_of("LlamaForCausalLM");
    s.dtype = "F32";
    s.o_bias = true;
    write_model(&s);
    struct loaded m;
    load_ok(&m);
    assert_true(m.cfg.attention_bias);
    const struct model_layer *L = &m.w.layers[1];
    check_vec(L->bq, "model.layers.1.self_attn.q_proj.bias", 16);
    check_vec(L->bk, "model.layers.1.self_attn.k_proj.bias", 8);
    check_vec(L->bv, "model.layers.1.self_attn.v_proj.bias", 8);
    check_vec(L->bo, "model.layers.1.self_attn.o_proj.bias", 16);
    unload(&m);
}

static void test_mistral_f16_tied(void **state)
{
    (void)state;
    struct spec s = spec_of("MistralForCausalLM");
    s.dtype = "F16";
    s.tie = true;
    write_model(&s);
    json_t *c = spec_config(&s);
    json_object_set_new(c, "sliding_window", json_integer(8));
    write_json("config.json", c);
    struct loaded m;
    load_ok(&m);
    assert_int_equal(m.cfg.arch, ARCH_MISTRAL);
    assert_true(m.cfg.tie_word_embeddings);
    assert_int_equal(m.cfg.sliding_window, 8);
    for (int l = 0; l < 3; l++)
        assert_int_equal(m.cfg.layer_window[l], 8);
    check_mat(&m.w.tok_embed, "model.embed_tokens.weight", BE_F16, 40, 16);
    assert_ptr_equal(m.w.lm_head.data, m.w.tok_embed.data);
    /* f16 norms come back as f32 */
    check_vec(m.w.layers[0].attn_norm, "model.layers.0.input_layernorm.weight", 16);
    check_vec(m.w.final_norm, "model.norm.weight", 16);
    unload(&m);

    /* null: no window; absent: MistralConfig's default 4096 */
    json_object_set_new(c, "sliding_window", json_null());
    write_json("config.json", c);
    load_ok(&m);
    assert_int_equal(m.cfg.sliding_window, 0);
    assert_int_equal(m.cfg.layer_window[2], 0);
    unload(&m);
    json_object_del(c, "sliding_window");
    write_json("config.json", c);
    load_ok(&m);
    assert_int_equal(m.cfg.layer_window[0], 4096);
    unload(&m);
    json_decref(c);
}

static void test_qwen2_f32_windows(void **state)
{
    (void)state;
    struct spec s = spec_of("Qwen2ForCausalLM");
    s.dtype = "F32";
    write_model(&s);
    json_t *c = spec_config(&s);
    json_object_set_new(c, "use_sliding_window", json_true());
    json_object_set_new(c, "sliding_window", json_integer(16));
    json_object_set_new(c, "max_window_layers", json_integer(1));
    write_json("config.json", c);
    struct loaded m;
    load_ok(&m);
    assert_true(m.cfg.attention_bias);
    assert_int_equal(m.cfg.layer_window[0], 0);
    assert_int_equal(m.cfg.layer_window[1], 16);
    assert_int_equal(m.cfg.layer_window[2], 16);
    const struct model_layer *L = &m.w.layers[0];
    check_mat(&L->wq, "model.layers.0.self_attn.q_proj.weight", BE_F32, 16, 16);
    check_vec(L->bq, "model.layers.0.self_attn.q_proj.bias", 16);
    check_vec(L->bk, "model.layers.0.self_attn.k_proj.bias", 8);
    check_vec(L->bv, "model.layers.0.self_attn.v_proj.bias", 8);
    assert_null(L->bo);
    unload(&m);

    /* layer_types wins over max_window_layers */
    json_object_set_new(c, "layer_types", json_pack("[s,s,s]", "sliding_attention", "full_attention", "full_attention"));
    write_json("config.json", c);
    load_ok(&m);
    assert_int_equal(m.cfg.layer_window[0], 16);
    assert_int_equal(m.cfg.layer_window[1], 0);
    unload(&m);

    /* without use_sliding_window, sliding_window is dropped (Qwen2Config) */
    json_object_set_new(c, "use_sliding_window", json_false());
    write_json("config.json", c);
    load_ok(&m);
    assert_int_equal(m.cfg.sliding_window, 0);
    assert_int_equal(m.cfg.layer_window[0], 0);
    unload(&m);
    json_decref(c);
}

static void test_qwen3_qk_norm(void **state)
{
    (void)state;
    struct spec s = spec_of("Qwen3ForCausalLM");
    s.head_dim = 8; /* explicit, != hidden_size / heads */
    s.o_bias = true;
    write_model(&s);
    struct loaded m;
    load_ok(&m);
    assert_int_equal(m.cfg.arch, ARCH_QWEN3);
    assert_true(m.cfg.qk_norm);
    assert_int_equal(m.cfg.head_dim, 8);
    const struct model_layer *L = &m.w.layers[1];
    check_mat(&L->wq, "model.layers.1.self_attn.q_proj.weight", BE_BF16, 32, 16);
    check_mat(&L->wo, "model.layers.1.self_attn.o_proj.weight", BE_BF16, 16, 32);
    check_vec(L->q_norm, "model.layers.1.self_attn.q_norm.weight", 8);
    check_vec(L->k_norm, "model.layers.1.self_attn.k_norm.weight", 8);
    check_vec(L->bo, "model.layers.1.self_attn.o_proj.bias", 16);
    unload(&m);

    /* Qwen3Config defaults head_dim to 128, not hidden_size / heads */
    json_t *c = spec_config(&s);
    json_object_del(c, "head_dim");
    write_json("config.json", c);
    json_decref(c);
    char err[MODEL_ERR_LEN];
    assert_int_equal(model_config_load(g_dir, &m.cfg, err), MODEL_OK);
    assert_int_equal(m.cfg.head_dim, 128);
    model_config_release(&m.cfg);
}

/* A Gemma norm as bound: the stored offset plus 1. */
static void check_norm_plus_one(const float *v, const char *name, int len)
{
    assert_non_null(v);
    for (int i = 0; i < len; i++)
        assert_float_equal(v[i], expected(name, (size_t)i) + 1.0f, 0);
}

static void test_gemma2(void **state)
{
    (void)state;
    struct spec s = spec_of("Gemma2ForCausalLM");
    s.layers = 4;
    write_model(&s);
    struct loaded m;
    load_ok(&m);
    assert_int_equal(m.cfg.arch, ARCH_GEMMA2);
    assert_int_equal(m.cfg.act, ACT_GELU_TANH);
    assert_true(m.cfg.tie_word_embeddings && m.cfg.norm_plus_one && m.cfg.sandwich_norms);
    assert_false(m.cfg.qk_norm);
    /* Gemma2Config's defaults: caps 50 and 30, query_pre_attn_scalar 256,
     * window 4096 on the even layers */
    assert_float_equal(m.cfg.attn_softcap, 50.0f, 0);
    assert_float_equal(m.cfg.final_softcap, 30.0f, 0);
    assert_float_equal(m.cfg.attn_scale, 1.0f / 16.0f, 0);
    assert_float_equal(m.cfg.embed_scale, 4.0f, 0); /* sqrt(16) */
    assert_float_equal(m.cfg.rope_local_theta, 0.0f, 0);
    const int windows[] = {4096, 0, 4096, 0};
    for (int l = 0; l < 4; l++)
        assert_int_equal(m.cfg.layer_window[l], windows[l]);
    const struct model_layer *L = &m.w.layers[2];
    check_norm_plus_one(L->attn_norm, "model.layers.2.input_layernorm.weight", 16);
    check_norm_plus_one(L->post_attn_norm, "model.layers.2.post_attention_layernorm.weight", 16);
    check_norm_plus_one(L->ffn_norm, "model.layers.2.pre_feedforward_layernorm.weight", 16);
    check_norm_plus_one(L->post_ffn_norm, "model.layers.2.post_feedforward_layernorm.weight", 16);
    check_norm_plus_one(m.w.final_norm, "model.norm.weight", 16);
    assert_ptr_equal(m.w.lm_head.data, m.w.tok_embed.data);
    unload(&m);

    /* explicit values, null caps, layer_types */
    json_t *c = spec_config(&s);
    json_object_set_new(c, "query_pre_attn_scalar", json_integer(64));
    json_object_set_new(c, "attn_logit_softcapping", json_null());
    json_object_set_new(c, "final_logit_softcapping", json_real(15.0));
    json_object_set_new(c, "sliding_window", json_integer(8));
    json_object_set_new(c, "layer_types", json_pack("[s,s,s,s]", "full_attention", "sliding_attention",
                                                    "sliding_attention", "full_attention"));
    write_json("config.json", c);
    load_ok(&m);
    assert_float_equal(m.cfg.attn_scale, 0.125f, 0);
    assert_float_equal(m.cfg.attn_softcap, 0.0f, 0);
    assert_float_equal(m.cfg.final_softcap, 15.0f, 0);
    const int typed[] = {0, 8, 8, 0};
    for (int l = 0; l < 4; l++)
        assert_int_equal(m.cfg.layer_window[l], typed[l]);
    unload(&m);

    /* refused, naming the field */
    json_object_set_new(c, "sliding_window", json_null());
    write_json("config.json", c);
    expect_fail(MODEL_ECONFIG, "config.json", "sliding_window must be set", NULL);
    json_object_set_new(c, "sliding_window", json_integer(8));
    json_object_set_new(c, "hidden_activation", json_string("gelu"));
    write_json("config.json", c);
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "hidden_activation", "gelu_pytorch_tanh", NULL);
    json_object_set_new(c, "hidden_activation", json_string("gelu_pytorch_tanh"));
    json_object_set_new(c, "final_logit_softcapping", json_real(-1.0));
    write_json("config.json", c);
    expect_fail(MODEL_ECONFIG, "config.json", "final_logit_softcapping", NULL);
    json_decref(c);
}

static void test_gemma3(void **state)
{
    (void)state;
    struct spec s = spec_of("Gemma3ForCausalLM");
    s.layers = 7;
    write_model(&s);
    struct loaded m;
    load_ok(&m);
    assert_int_equal(m.cfg.arch, ARCH_GEMMA3);
    assert_true(m.cfg.qk_norm);
    /* Gemma3TextConfig: no caps, local base 1e4, sliding_window_pattern 6 */
    assert_float_equal(m.cfg.attn_softcap, 0.0f, 0);
    assert_float_equal(m.cfg.final_softcap, 0.0f, 0);
    assert_float_equal(m.cfg.rope_local_theta, 10000.0f, 0);
    assert_float_equal(m.cfg.rope_theta, 500000.0f, 0);
    for (int l = 0; l < 7; l++)
        assert_int_equal(m.cfg.layer_window[l], l == 5 ? 0 : 4096);
    check_norm_plus_one(m.w.layers[1].q_norm, "model.layers.1.self_attn.q_norm.weight", 4);
    check_norm_plus_one(m.w.layers[1].k_norm, "model.layers.1.self_attn.k_norm.weight", 4);
    unload(&m);

    /* transformers 5: one rope_parameters object per layer type */
    json_t *c = spec_config(&s);
    json_object_del(c, "rope_theta");
    json_object_set_new(c, "sliding_window_pattern", json_integer(2));
    json_object_set_new(c, "rope_parameters",
                        json_pack("{s:{s:s, s:f, s:f}, s:{s:s, s:f}}", "full_attention", "rope_type", "linear",
                                  "factor", 8.0, "rope_theta", 1e6, "sliding_attention", "rope_type", "default",
                                  "rope_theta", 20000.0));
    write_json("config.json", c);
    load_ok(&m);
    assert_int_equal(m.cfg.rope_scaling, ROPE_SCALING_LINEAR);
    assert_float_equal(m.cfg.rope_factor, 8.0f, 0);
    assert_float_equal(m.cfg.rope_theta, 1e6f, 0);
    assert_float_equal(m.cfg.rope_local_theta, 20000.0f, 0);
    for (int l = 0; l < 7; l++)
        assert_int_equal(m.cfg.layer_window[l], l % 2 ? 0 : 4096);
    unload(&m);
    json_object_set_new(c, "rope_parameters",
                        json_pack("{s:{s:s}, s:{s:s, s:f}}", "full_attention", "rope_type", "default",
                                  "sliding_attention", "rope_type", "linear", "factor", 2.0));
    write_json("config.json", c);
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "rope_parameters.sliding_attention.rope_type", NULL);
    json_object_set_new(c, "rope_parameters",
                        json_pack("{s:{s:s, s:f}, s:{s:s}}", "full_attention", "rope_type", "dynamic", "factor", 2.0,
                                  "sliding_attention", "rope_type", "default"));
    write_json("config.json", c);
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "rope_parameters", "dynamic", NULL);
    json_decref(c);

    /* per-type RoPE is Gemma 3's alone */
    s = spec_of("LlamaForCausalLM");
    c = spec_config(&s);
    json_object_set_new(c, "rope_parameters", json_pack("{s:{s:s}, s:{s:s}}", "full_attention", "rope_type",
                                                        "default", "sliding_attention", "rope_type", "default"));
    write_json("config.json", c);
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "rope_parameters per layer type", NULL);
    json_decref(c);
}

/* Checks that part m of a fused tensor holds its rows [r0, r0 + rows). */
static void check_part(const struct model_mat *m, const char *name, int r0, int rows, int cols)
{
    assert_int_equal(m->rows, rows);
    assert_int_equal(m->cols, cols);
    const size_t at[] = {0, 1, (size_t)rows * (size_t)cols - 1};
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++)
        assert_float_equal(mat_at(m, at[i]), expected(name, (size_t)r0 * (size_t)cols + at[i]), 0);
}

static void test_phi3(void **state)
{
    (void)state;
    struct spec s = spec_of("Phi3ForCausalLM");
    write_model(&s);
    json_t *c = spec_config(&s);
    json_object_set_new(c, "partial_rotary_factor", json_real(0.5));
    json_object_set_new(c, "max_position_embeddings", json_integer(256));
    json_object_set_new(c, "original_max_position_embeddings", json_integer(64));
    json_object_set_new(c, "rope_scaling", json_pack("{s:s, s:[f], s:[f]}", "type", "longrope", "short_factor", 1.5,
                                                     "long_factor", 4.0));
    write_json("config.json", c);
    struct loaded m;
    load_ok(&m);
    assert_int_equal(m.cfg.arch, ARCH_PHI3);
    assert_true(m.cfg.fused_qkv && m.cfg.fused_gate_up);
    assert_false(m.cfg.tie_word_embeddings);
    assert_int_equal(m.cfg.rot_dim, 2); /* head_dim 4 * 0.5 */
    assert_int_equal(m.cfg.rope_scaling, ROPE_SCALING_LONGROPE);
    assert_int_equal(m.cfg.rope_original_max_pos, 64);
    assert_float_equal(m.cfg.rope_short_factor[0], 1.5f, 0);
    assert_float_equal(m.cfg.rope_long_factor[0], 4.0f, 0);
    /* sqrt(1 + ln(256 / 64) / ln(64)) */
    assert_float_equal(m.cfg.rope_attn_factor, (float)sqrt(1.0 + log(4.0) / log(64.0)), 1e-6);
    assert_int_equal(model_context(&m.cfg, 0), 256); /* long_factor past 64 */
    assert_int_equal(model_context(&m.cfg, 100), 100);
    for (int l = 0; l < 3; l++) /* Phi3Config: no window unless set */
        assert_int_equal(m.cfg.layer_window[l], 0);
    assert_non_null(model_sink_refusal(&m.cfg));
    const struct model_layer *L = &m.w.layers[1];
    const char *qkv = "model.layers.1.self_attn.qkv_proj.weight", *gu = "model.layers.1.mlp.gate_up_proj.weight";
    check_part(&L->wq, qkv, 0, 16, 16);
    check_part(&L->wk, qkv, 16, 8, 16);
    check_part(&L->wv, qkv, 24, 8, 16);
    check_part(&L->w_gate, gu, 0, 24, 16);
    check_part(&L->w_up, gu, 24, 24, 16);
    assert_int_equal(model_weights_verify(&m.cfg, &m.w, (char[MODEL_ERR_LEN]){0}), MODEL_OK);
    unload(&m);

    /* a window on every layer */
    json_object_set_new(c, "sliding_window", json_integer(8));
    json_object_del(c, "partial_rotary_factor");
    json_object_set_new(c, "rope_scaling", json_pack("{s:s, s:[f,f], s:[f,f], s:f}", "rope_type", "longrope",
                                                     "short_factor", 1.0, 1.0, "long_factor", 2.0, 2.0,
                                                     "attention_factor", 1.25));
    write_json("config.json", c);
    load_ok(&m);
    for (int l = 0; l < 3; l++)
        assert_int_equal(m.cfg.layer_window[l], 8);
    assert_float_equal(m.cfg.rope_attn_factor, 1.25f, 0);
    assert_float_equal(m.cfg.rope_long_factor[1], 2.0f, 0);
    /* full rotary, but the tables mix past original_max_position_embeddings */
    assert_non_null(strstr(model_sink_refusal(&m.cfg), "longrope"));
    unload(&m);

    /* refused, naming the field */
    json_object_set_new(c, "rope_scaling", json_pack("{s:s, s:[f], s:[f,f]}", "type", "longrope", "short_factor", 1.0,
                                                     "long_factor", 2.0, 2.0));
    write_json("config.json", c);
    expect_fail(MODEL_ECONFIG, "config.json", "rope_scaling.short_factor must be a list of 2 numbers", NULL);
    json_object_set_new(c, "rope_scaling", json_pack("{s:s, s:[f,f]}", "type", "longrope", "short_factor", 1.0, 1.0));
    write_json("config.json", c);
    expect_fail(MODEL_ECONFIG, "config.json", "missing field rope_scaling.long_factor", NULL);
    json_object_set_new(c, "rope_scaling", json_pack("{s:s, s:[f,f], s:[f,f]}", "type", "longrope", "short_factor", 1.0,
                                                     1.0, "long_factor", 2.0, 2.0));
    json_object_set_new(c, "original_max_position_embeddings", json_integer(1)); /* ln(1) = 0 divides */
    write_json("config.json", c);
    expect_fail(MODEL_ECONFIG, "config.json", "original_max_position_embeddings=1", NULL);
    json_object_set_new(c, "original_max_position_embeddings", json_integer(64));
    json_object_set_new(c, "rope_scaling", json_pack("{s:s, s:f}", "type", "yarn", "factor", 4.0));
    write_json("config.json", c);
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "yarn", "longrope", NULL);
    json_object_set_new(c, "rope_scaling", json_null());
    json_object_set_new(c, "partial_rotary_factor", json_real(0.1));
    write_json("config.json", c);
    expect_fail(MODEL_ECONFIG, "config.json", "partial_rotary_factor", NULL);
    json_decref(c);

    /* the tensors are fused: a split checkpoint lacks qkv_proj */
    s.fused = false;
    write_model(&s);
    expect_fail(MODEL_EFORMAT, "qkv_proj", NULL);
}

/* A GPT-2 directory: n_embd 8, 2 heads, 2 layers, n_inner 12, 10
 * positions, tensors under prefix ("transformer." or ""). */
static void write_gpt2(const char *prefix, json_t *extra)
{
    json_t *c = json_pack("{s:[s], s:i, s:i, s:i, s:i, s:i, s:i, s:s}", "architectures", "GPT2LMHeadModel",
                          "vocab_size", 40, "n_embd", 8, "n_layer", 2, "n_head", 2, "n_positions", 10, "n_inner", 12,
                          "activation_function", "gelu_new");
    assert_non_null(c);
    if (extra)
        json_object_update(c, extra);
    write_json("config.json", c);
    json_decref(c);
    struct stw w;
    stw_init(&w);
    char n[128];
#define G(suffix, rows, cols)                               \
    do {                                                    \
        snprintf(n, sizeof n, "%s%s", prefix, suffix);      \
        stw_add(&w, n, "F32", rows, cols);                  \
    } while (0)
    G("wte.weight", 40, 8);
    G("wpe.weight", 10, 8);
    for (int l = 0; l < 2; l++) {
        char b[64];
#define GL(suffix, rows, cols)                          \
    do {                                                \
        snprintf(b, sizeof b, "h.%d.%s", l, suffix);    \
        G(b, rows, cols);                               \
    } while (0)
        GL("ln_1.weight", 8, 0);
        GL("ln_1.bias", 8, 0);
        GL("attn.c_attn.weight", 8, 24);
        GL("attn.c_attn.bias", 24, 0);
        GL("attn.c_proj.weight", 8, 8);
        GL("attn.c_proj.bias", 8, 0);
        GL("ln_2.weight", 8, 0);
        GL("ln_2.bias", 8, 0);
        GL("mlp.c_fc.weight", 8, 12);
        GL("mlp.c_fc.bias", 12, 0);
        GL("mlp.c_proj.weight", 12, 8);
        GL("mlp.c_proj.bias", 8, 0);
#undef GL
    }
    G("ln_f.weight", 8, 0);
    G("ln_f.bias", 8, 0);
#undef G
    stw_write(&w, "model.safetensors");
}

/* Element (r, c) of a bound GPT-2 matrix is element (c, r0 + r) of the
 * stored Conv1D weight [in, out]. */
static void check_transposed(const struct model_mat *m, const char *name, int r0, int out)
{
    assert_int_equal(m->dtype, BE_F32);
    for (int r = 0; r < m->rows; r++)
        for (int c = 0; c < m->cols; c++)
            assert_float_equal(mat_at(m, (size_t)r * (size_t)m->cols + (size_t)c),
                               expected(name, (size_t)c * (size_t)out + (size_t)(r0 + r)), 0);
}

static void test_gpt2(void **state)
{
    (void)state;
    static const char *const prefixes[] = {"transformer.", ""}; /* save_pretrained's, the original checkpoints' */
    for (int p = 0; p < 2; p++) {
        write_gpt2(prefixes[p], NULL);
        struct loaded m;
        load_ok(&m);
        char n[128];
        assert_int_equal(m.cfg.arch, ARCH_GPT2);
        assert_int_equal(m.cfg.dtype, BE_F32); /* no torch_dtype: GPT-2's checkpoints are f32 */
        assert_true(m.cfg.layer_norm && m.cfg.learned_pos && m.cfg.ungated_mlp && m.cfg.tie_word_embeddings);
        assert_int_equal(m.cfg.head_dim, 4);
        assert_int_equal(m.cfg.intermediate_size, 12);
        assert_int_equal(m.cfg.max_position_embeddings, 10);
        assert_int_equal(model_context(&m.cfg, 0), 10);
        assert_float_equal(m.cfg.rms_norm_eps, 1e-5f, 0);
        assert_int_equal(m.cfg.bos_token_id, -1); /* 50256 is past this vocabulary */
        assert_non_null(model_sink_refusal(&m.cfg));
        snprintf(n, sizeof n, "%swpe.weight", prefixes[p]);
        check_mat(&m.w.pos_embed, n, BE_F32, 10, 8);
        const struct model_layer *L = &m.w.layers[1];
        snprintf(n, sizeof n, "%sh.1.attn.c_attn.weight", prefixes[p]);
        check_transposed(&L->wq, n, 0, 24);
        check_transposed(&L->wk, n, 8, 24);
        check_transposed(&L->wv, n, 16, 24);
        snprintf(n, sizeof n, "%sh.1.mlp.c_fc.weight", prefixes[p]);
        check_transposed(&L->w_up, n, 0, 12);
        snprintf(n, sizeof n, "%sh.1.mlp.c_proj.weight", prefixes[p]);
        check_transposed(&L->w_down, n, 0, 8);
        assert_null(L->w_gate.data);
        snprintf(n, sizeof n, "%sh.1.attn.c_attn.bias", prefixes[p]);
        for (int i = 0; i < 8; i++)
            assert_float_equal(L->bv[i], expected(n, (size_t)(16 + i)), 0);
        snprintf(n, sizeof n, "%sh.1.ln_2.bias", prefixes[p]);
        check_vec(L->ffn_norm_b, n, 8);
        snprintf(n, sizeof n, "%sln_f.bias", prefixes[p]);
        check_vec(m.w.final_norm_b, n, 8);
        assert_ptr_equal(m.w.lm_head.data, m.w.tok_embed.data);
        assert_int_equal(model_weights_verify(&m.cfg, &m.w, (char[MODEL_ERR_LEN]){0}), MODEL_OK);
        unload(&m);
    }

    /* refused, naming the field */
    json_t *x = json_pack("{s:s}", "activation_function", "relu");
    write_gpt2("", x);
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "activation_function", NULL);
    json_decref(x);
    x = json_pack("{s:b}", "scale_attn_by_inverse_layer_idx", 1);
    write_gpt2("", x);
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "scale_attn_by_inverse_layer_idx", NULL);
    json_decref(x);
    x = json_pack("{s:i}", "n_head", 3);
    write_gpt2("", x);
    expect_fail(MODEL_ECONFIG, "config.json", "n_head=3", NULL);
    json_decref(x);
    x = json_pack("{s:i}", "n_positions", 11); /* wpe has 10 rows */
    write_gpt2("", x);
    expect_fail(MODEL_EFORMAT, "wpe.weight", NULL);
    json_decref(x);
}

/* A Mamba directory: hidden 8, 2 layers, state 4, conv 3, expand 2 (16
 * channels), time_step_rank "auto" (1), tied head; extra fields replace
 * the config's.  conv1d.weight is [16, 1, 3], as PyTorch's Conv1d keeps it. */
static void write_mamba(json_t *extra)
{
    json_t *c = json_pack("{s:[s], s:i, s:i, s:i, s:i, s:i, s:i, s:s, s:s}", "architectures", "MambaForCausalLM",
                          "vocab_size", 40, "hidden_size", 8, "num_hidden_layers", 2, "state_size", 4, "conv_kernel",
                          3, "expand", 2, "time_step_rank", "auto", "torch_dtype", "float32");
    assert_non_null(c);
    if (extra)
        json_object_update(c, extra);
    write_json("config.json", c);
    json_decref(c);
    struct stw w;
    stw_init(&w);
    stw_add(&w, "backbone.embeddings.weight", "F32", 40, 8);
    for (int l = 0; l < 2; l++) {
        char n[96];
#define M(suffix, rows, cols)                                          \
    do {                                                               \
        snprintf(n, sizeof n, "backbone.layers.%d.%s", l, suffix);     \
        stw_add(&w, n, "F32", rows, cols);                             \
    } while (0)
        M("norm.weight", 8, 0);
        M("mixer.in_proj.weight", 32, 8);
        M("mixer.conv1d.weight", 16, 3);
        json_object_set_new(json_object_get(w.header, n), "shape", json_pack("[i,i,i]", 16, 1, 3));
        M("mixer.conv1d.bias", 16, 0);
        M("mixer.x_proj.weight", 1 + 2 * 4, 16);
        M("mixer.dt_proj.weight", 16, 1);
        M("mixer.dt_proj.bias", 16, 0);
        M("mixer.A_log", 16, 4);
        M("mixer.D", 16, 0);
        M("mixer.out_proj.weight", 8, 16);
#undef M
    }
    stw_add(&w, "backbone.norm_f.weight", "F32", 8, 0);
    stw_write(&w, "model.safetensors");
}

static void test_mamba(void **state)
{
    (void)state;
    write_mamba(NULL);
    struct loaded m;
    load_ok(&m);
    assert_int_equal(m.cfg.arch, ARCH_MAMBA);
    assert_int_equal(m.cfg.intermediate_size, 16);
    assert_int_equal(m.cfg.ssm_state, 4);
    assert_int_equal(m.cfg.ssm_conv, 3);
    assert_int_equal(m.cfg.ssm_dt_rank, 1);
    assert_true(m.cfg.tie_word_embeddings && m.cfg.ssm_conv_bias && !m.cfg.ssm_bias);
    assert_int_equal(m.cfg.n_heads, 0);
    assert_float_equal(m.cfg.rms_norm_eps, 1e-5f, 0);
    const struct model_layer *L = &m.w.layers[1];
    check_mat(&L->ssm_in_x, "backbone.layers.1.mixer.in_proj.weight", BE_F32, 16, 8);
    assert_float_equal(mat_at(&L->ssm_in_z, 0), expected("backbone.layers.1.mixer.in_proj.weight", 16 * 8), 0);
    assert_float_equal(mat_at(&L->ssm_x_B, 0), expected("backbone.layers.1.mixer.x_proj.weight", 1 * 16), 0);
    assert_float_equal(mat_at(&L->ssm_x_C, 5), expected("backbone.layers.1.mixer.x_proj.weight", 5 * 16 + 5), 0);
    assert_int_equal(L->ssm_x_C.rows, 4);
    check_vec(L->ssm_conv_w, "backbone.layers.1.mixer.conv1d.weight", 48);
    for (int i = 0; i < 64; i++)
        assert_float_equal(L->ssm_A[i], -expf(expected("backbone.layers.1.mixer.A_log", (size_t)i)), 0);
    check_vec(L->ssm_D, "backbone.layers.1.mixer.D", 16);
    assert_null(L->ssm_in_bx);
    assert_ptr_equal(m.w.lm_head.data, m.w.tok_embed.data);
    assert_int_equal(model_weights_verify(&m.cfg, &m.w, (char[MODEL_ERR_LEN]){0}), MODEL_OK);
    unload(&m);

    /* every field range-checked, refused naming it */
    static const struct {
        const char *json, *what;
        enum model_status st;
    } bad[] = {
        {"{\"state_size\": 0}", "state_size=0", MODEL_ECONFIG},
        {"{\"state_size\": 257}", "state_size=257", MODEL_ECONFIG},
        {"{\"conv_kernel\": 17}", "conv_kernel=17", MODEL_ECONFIG},
        {"{\"expand\": 0}", "expand=0", MODEL_ECONFIG},
        {"{\"intermediate_size\": 0}", "intermediate_size=0", MODEL_ECONFIG},
        {"{\"time_step_rank\": 17}", "time_step_rank=17", MODEL_ECONFIG},
        {"{\"time_step_rank\": \"all\"}", "time_step_rank", MODEL_ECONFIG},
        {"{\"hidden_size\": 0}", "hidden_size=0", MODEL_ECONFIG},
        {"{\"layer_norm_epsilon\": 0}", "layer_norm_epsilon", MODEL_ECONFIG},
        {"{\"hidden_act\": \"gelu\"}", "hidden_act", MODEL_EUNSUPPORTED},
        {"{\"use_conv_bias\": 1}", "use_conv_bias", MODEL_ECONFIG},
        {"{\"torch_dtype\": \"int8\"}", "torch_dtype", MODEL_EUNSUPPORTED},
        /* the tensors the config then implies are not there */
        {"{\"use_bias\": true}", "in_proj.bias", MODEL_EFORMAT},
        {"{\"conv_kernel\": 4}", "conv1d.weight", MODEL_EFORMAT},
        {"{\"tie_word_embeddings\": false}", "lm_head.weight", MODEL_EFORMAT},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_t *x = json_loads(bad[i].json, 0, NULL);
        assert_non_null(x);
        write_mamba(x);
        json_decref(x);
        expect_fail(bad[i].st, bad[i].what, NULL);
    }
}

/* What model_device_bytes predicts from the config is what model_load
 * charges on a backend that cannot read the mmap (weights uploaded), for
 * every family's extra tensors (biases, sandwich norms, fused views, GPT-2's
 * wpe and LayerNorm biases). */
static void check_charged(const char *what)
{
    be_backend *be;
    struct be_params bp = {.n_threads = 1};
    assert_int_equal(be_open("cpu-strict", &bp, &be), BE_OK);
    struct model_config cfg;
    char err[MODEL_ERR_LEN];
    assert_int_equal(model_config_load(g_dir, &cfg, err), MODEL_OK);
    struct model_params mp = {.max_batch_tokens = 8};
    struct model_device_bytes want = model_device_bytes(&cfg, be_get_caps(be), &mp);
    model_config_release(&cfg);
    size_t before = be_mem_stats(be).dev_used;
    model *m;
    enum model_status st = model_load(g_dir, be, &mp, &m, err);
    if (st != MODEL_OK)
        fail_msg("%s: %s", what, err);
    size_t used = be_mem_stats(be).dev_used - before;
    if (used != want.weights + want.activations)
        fail_msg("%s: model_load charged %zu bytes, model_device_bytes says %zu + %zu", what, used, want.weights,
                 want.activations);
    model_free(m);
    be_free(be);
}

static void test_device_bytes(void **state)
{
    (void)state;
    static const char *const archs[] = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Gemma2ForCausalLM",
                                        "Gemma3ForCausalLM", "Phi3ForCausalLM"};
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++) {
        struct spec s = spec_of(archs[i]);
        s.o_bias = strcmp(archs[i], "LlamaForCausalLM") == 0;
        write_model(&s);
        check_charged(archs[i]);
    }
    write_gpt2("transformer.", NULL);
    check_charged("GPT2LMHeadModel");
    write_mamba(NULL); /* row views uploaded as copies of their own, A, conv weights */
    check_charged("MambaForCausalLM");
}

/* A tiny T5 (untied, relu or gated-gelu) or BART (tied) of 2 encoder and
 * 3 decoder layers; head_dim 8 over 4 heads, not dim / heads, for T5. */
static void write_encdec(bool bart, bool gated)
{
    const char *dt = "BF16";
    int vocab = 40, d = 16, f = 24, H = 4, hd = bart ? 4 : 8, qd = H * hd, enc = 2, dec = 3, maxpos = 64;
    json_t *c = bart ? json_pack("{s:[s], s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:s, s:s}", "architectures",
                                 "BartForConditionalGeneration", "vocab_size", vocab, "d_model", d, "encoder_layers",
                                 enc, "decoder_layers", dec, "encoder_attention_heads", H, "decoder_attention_heads",
                                 H, "encoder_ffn_dim", f, "decoder_ffn_dim", f, "max_position_embeddings", maxpos,
                                 "activation_function", "gelu", "torch_dtype", "bfloat16")
                     : json_pack("{s:[s], s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:s, s:s, s:b}",
                                 "architectures", "T5ForConditionalGeneration", "vocab_size", vocab, "d_model", d,
                                 "num_heads", H, "d_kv", hd, "d_ff", f, "num_layers", enc, "num_decoder_layers", dec,
                                 "relative_attention_num_buckets", 8, "relative_attention_max_distance", 20,
                                 "feed_forward_proj", gated ? "gated-gelu" : "relu", "torch_dtype", "bfloat16",
                                 "tie_word_embeddings", false);
    assert_non_null(c);
    write_json("config.json", c);
    json_decref(c);
    struct stw w;
    stw_init(&w);
    char n[160];
#define T(rows, cols, ...)                          \
    do {                                            \
        snprintf(n, sizeof n, __VA_ARGS__);         \
        stw_add(&w, n, dt, rows, cols);             \
    } while (0)
    T(vocab, d, bart ? "model.shared.weight" : "shared.weight");
    for (int s = 0; s < 2; s++) {
        const char *stack = s ? "decoder" : "encoder";
        for (int l = 0; l < (s ? dec : enc); l++) {
            for (int a = 0; a < 1 + s; a++) { /* self-attention, then the decoder's cross-attention */
                const char *pre = bart ? (a ? "encoder_attn" : "self_attn")
                                       : a  ? "1.EncDecAttention"
                                            : "0.SelfAttention";
                for (int i = 0; i < 4; i++) {
                    const char *proj = (const char *[]){"q", "k", "v", bart ? "out" : "o"}[i];
                    if (bart) {
                        T(i < 3 ? qd : d, i < 3 ? d : qd, "model.%s.layers.%d.%s.%s_proj.weight", stack, l, pre, proj);
                        T(i < 3 ? qd : d, 0, "model.%s.layers.%d.%s.%s_proj.bias", stack, l, pre, proj);
                    } else {
                        T(i < 3 ? qd : d, i < 3 ? d : qd, "%s.block.%d.layer.%s.%s.weight", stack, l, pre, proj);
                    }
                }
                if (bart) {
                    T(d, 0, "model.%s.layers.%d.%s_layer_norm.weight", stack, l, pre);
                    T(d, 0, "model.%s.layers.%d.%s_layer_norm.bias", stack, l, pre);
                } else {
                    T(d, 0, "%s.block.%d.layer.%d.layer_norm.weight", stack, l, a);
                }
            }
            if (bart) {
                T(f, d, "model.%s.layers.%d.fc1.weight", stack, l);
                T(f, 0, "model.%s.layers.%d.fc1.bias", stack, l);
                T(d, f, "model.%s.layers.%d.fc2.weight", stack, l);
                T(d, 0, "model.%s.layers.%d.fc2.bias", stack, l);
                T(d, 0, "model.%s.layers.%d.final_layer_norm.weight", stack, l);
                T(d, 0, "model.%s.layers.%d.final_layer_norm.bias", stack, l);
                continue;
            }
            int ff = 1 + s;
            if (gated) {
                T(f, d, "%s.block.%d.layer.%d.DenseReluDense.wi_0.weight", stack, l, ff);
                T(f, d, "%s.block.%d.layer.%d.DenseReluDense.wi_1.weight", stack, l, ff);
            } else {
                T(f, d, "%s.block.%d.layer.%d.DenseReluDense.wi.weight", stack, l, ff);
            }
            T(d, f, "%s.block.%d.layer.%d.DenseReluDense.wo.weight", stack, l, ff);
            T(d, 0, "%s.block.%d.layer.%d.layer_norm.weight", stack, l, ff);
        }
        if (bart) {
            T(maxpos + 2, d, "model.%s.embed_positions.weight", stack);
            T(d, 0, "model.%s.layernorm_embedding.weight", stack);
            T(d, 0, "model.%s.layernorm_embedding.bias", stack);
        } else {
            T(8, H, "%s.block.0.layer.0.SelfAttention.relative_attention_bias.weight", stack);
            T(d, 0, "%s.final_layer_norm.weight", stack);
        }
    }
    if (bart)
        T(1, vocab, "final_logits_bias");
    else
        T(vocab, d, "lm_head.weight");
#undef T
    stw_write(&w, "model.safetensors");
}

/* What encdec_device_bytes predicts from the config is what encdec_load
 * charges a backend that cannot read the mmap, what encoding S tokens
 * adds for the encoder's residual stream while it runs, and the bytes per
 * token of the cross cache it writes and of the self cache a decode
 * writes. */
static void check_encdec_charged(const char *what)
{
    be_backend *be;
    struct be_params bp = {.n_threads = 1};
    assert_int_equal(be_open("cpu-strict", &bp, &be), BE_OK);
    struct encdec_config ec;
    char err[MODEL_ERR_LEN];
    assert_int_equal(encdec_config_load(g_dir, &ec, err), MODEL_OK);
    enum { S = 32, N = 16 }; /* whole blocks of the store's 16 tokens */
    struct model_params mp = {.max_batch_tokens = 8};
    struct model_device_bytes idle = encdec_device_bytes(&ec, be_get_caps(be), &mp, 0),
                              full = encdec_device_bytes(&ec, be_get_caps(be), &mp, S);
    size_t before = be_mem_stats(be).dev_used;
    encdec *m;
    if (encdec_load(g_dir, be, &mp, &m, err) != MODEL_OK)
        fail_msg("%s: %s", what, err);
    size_t used = be_mem_stats(be).dev_used - before;
    if (used != idle.weights + idle.activations)
        fail_msg("%s: encdec_load charged %zu bytes, encdec_device_bytes says %zu + %zu", what, used, idle.weights,
                 idle.activations);
    struct kv_geom g = encdec_kv_geom(m);
    kv_store *st;
    assert_int_equal(kv_store_open(be, &g, &(struct kv_store_params){.block_tokens = 16}, &st), TIER_OK);
    kv_seq *cross, *self;
    assert_int_equal(kv_seq_create(st, &(struct kv_seq_params){.no_prefix_cache = true}, &cross), TIER_OK);
    assert_int_equal(kv_seq_create(st, &(struct kv_seq_params){.no_prefix_cache = true}, &self), TIER_OK);
    int32_t ids[S];
    for (int i = 0; i < S; i++)
        ids[i] = 3 + i % 30;
    be_reset_peak(be);
    assert_int_equal(encdec_encode(m, cross, ids, S), MODEL_OK);
    struct be_mem_stats ms = be_mem_stats(be);
    if (ms.dev_peak - ms.dev_used != full.activations - idle.activations)
        fail_msg("%s: encoding %d tokens took %zu bytes more while it ran, encdec_device_bytes says %zu", what, S,
                 ms.dev_peak - ms.dev_used, full.activations - idle.activations);
    assert_int_equal(encdec_decode(m, self, cross, ids, N, NULL), MODEL_OK);
    assert_int_equal(kv_seq_stats(cross).dev_bytes, (size_t)S * full.kv_per_token);
    assert_int_equal(kv_seq_stats(self).dev_bytes, (size_t)N * full.kv_per_token);
    kv_seq_free(self);
    kv_seq_free(cross);
    kv_store_free(st);
    encdec_free(m);
    be_free(be);
}

static void test_encdec_device_bytes(void **state)
{
    (void)state;
    write_encdec(false, false);
    check_encdec_charged("T5 relu");
    write_encdec(false, true);
    check_encdec_charged("T5 gated-gelu");
    write_encdec(true, false);
    check_encdec_charged("BART");
}

/* write_encdec's config.json with key set to v (NULL: removed), then
 * encdec_config_load must fail naming want. */
static void encdec_config_fails(bool bart, const char *key, json_t *v, const char *want)
{
    write_encdec(bart, false);
    char path[128], err[MODEL_ERR_LEN];
    snprintf(path, sizeof path, "%s/config.json", g_dir);
    write_config_with(json_load_file(path, 0, NULL), key, v);
    struct encdec_config ec;
    if (encdec_config_load(g_dir, &ec, err) != MODEL_ECONFIG)
        fail_msg("%s: loaded (%s)", key, err);
    if (!strstr(err, want))
        fail_msg("%s: \"%s\" does not say \"%s\"", key, err, want);
}

/* Heads wider than the attention kernels take, and defaults that do not fit
 * the fields they depend on, are refused at load with the field named. */
static void test_encdec_bad_config(void **state)
{
    (void)state;
    encdec_config_fails(false, "d_kv", json_integer(2048), "d_kv must be an integer in [1, 1024]");
    encdec_config_fails(true, "d_model", json_integer(8192), "exceeds the widest head the kernels take (1024)");
    /* T5's eos_token_id defaults to 1, BART's decoder_start_token_id to 2 */
    json_t *tiny = json_integer(1);
    encdec_config_fails(false, "vocab_size", json_incref(tiny), "eos_token_id is absent and its default 1");
    encdec_config_fails(true, "vocab_size", tiny, "decoder_start_token_id is absent and its default 2");
}

static void test_defaults_and_generation_config(void **state)
{
    (void)state;
    struct spec s = spec_of("LlamaForCausalLM");
    json_t *c = spec_config(&s);
    json_object_del(c, "num_key_value_heads");
    json_object_del(c, "head_dim");
    json_object_del(c, "rope_theta");
    json_object_del(c, "bos_token_id");
    json_object_set_new(c, "eos_token_id", json_pack("[i,i]", 2, 7));
    write_json("config.json", c);
    char err[MODEL_ERR_LEN];
    struct model_config cfg;
    assert_int_equal(model_config_load(g_dir, &cfg, err), MODEL_OK);
    assert_int_equal(cfg.n_kv_heads, 4);
    assert_int_equal(cfg.head_dim, 4);
    assert_float_equal(cfg.rope_theta, 10000.0f, 0);
    assert_int_equal(cfg.bos_token_id, 1); /* LlamaConfig default */
    assert_int_equal(cfg.n_eos, 2);
    assert_int_equal(cfg.eos_token_ids[1], 7);
    assert_int_equal(cfg.pad_token_id, -1);
    model_config_release(&cfg);

    json_t *g = json_pack("{s:[i,i,i], s:i, s:i}", "eos_token_id", 3, 5, 9, "bos_token_id", 4, "pad_token_id", 0);
    write_json("generation_config.json", g);
    json_decref(g);
    assert_int_equal(model_config_load(g_dir, &cfg, err), MODEL_OK);
    assert_int_equal(cfg.bos_token_id, 4);
    assert_int_equal(cfg.pad_token_id, 0);
    assert_int_equal(cfg.n_eos, 3);
    assert_int_equal(cfg.eos_token_ids[0], 3);
    assert_int_equal(cfg.eos_token_ids[2], 9);
    model_config_release(&cfg);

    /* a single id replaces the whole list */
    g = json_pack("{s:i}", "eos_token_id", 6);
    write_json("generation_config.json", g);
    json_decref(g);
    assert_int_equal(model_config_load(g_dir, &cfg, err), MODEL_OK);
    assert_int_equal(cfg.n_eos, 1);
    assert_int_equal(cfg.eos_token_ids[0], 6);
    assert_int_equal(cfg.bos_token_id, 1);
    model_config_release(&cfg);
    json_decref(c);
}

static void test_rope_scaling(void **state)
{
    (void)state;
    struct spec s = spec_of("LlamaForCausalLM");
    json_t *c = spec_config(&s);
    json_object_set_new(c, "rope_scaling",
                        json_pack("{s:s, s:f, s:f, s:f, s:i}", "rope_type", "llama3", "factor", 8.0, "low_freq_factor",
                                  1.0, "high_freq_factor", 4.0, "original_max_position_embeddings", 64));
    write_json("config.json", c);
    char err[MODEL_ERR_LEN];
    struct model_config cfg;
    assert_int_equal(model_config_load(g_dir, &cfg, err), MODEL_OK);
    assert_int_equal(cfg.rope_scaling, ROPE_SCALING_LLAMA3);
    assert_float_equal(cfg.rope_factor, 8.0f, 0);
    assert_float_equal(cfg.rope_low_freq_factor, 1.0f, 0);
    assert_float_equal(cfg.rope_high_freq_factor, 4.0f, 0);
    assert_int_equal(cfg.rope_original_max_pos, 64);
    model_config_release(&cfg);

    /* the old "type" key */
    json_object_set_new(c, "rope_scaling", json_pack("{s:s, s:f}", "type", "linear", "factor", 2.0));
    write_json("config.json", c);
    assert_int_equal(model_config_load(g_dir, &cfg, err), MODEL_OK);
    assert_int_equal(cfg.rope_scaling, ROPE_SCALING_LINEAR);
    assert_float_equal(cfg.rope_factor, 2.0f, 0);
    model_config_release(&cfg);

    /* transformers 5: rope_parameters carries rope_theta, over the top level's */
    json_object_del(c, "rope_scaling");
    json_object_set_new(c, "rope_parameters", json_pack("{s:s, s:f}", "rope_type", "default", "rope_theta", 1e6));
    write_json("config.json", c);
    assert_int_equal(model_config_load(g_dir, &cfg, err), MODEL_OK);
    assert_int_equal(cfg.rope_scaling, ROPE_SCALING_NONE);
    assert_float_equal(cfg.rope_theta, 1e6f, 0);
    model_config_release(&cfg);

    json_object_set_new(c, "rope_scaling", json_pack("{s:s, s:f}", "rope_type", "yarn", "factor", 4.0));
    write_json("config.json", c);
    json_decref(c);
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "rope_scaling", "yarn", NULL);
}

struct page_in_log {
    uint64_t last, total;
    int calls;
    bool backwards, total_changed;
};

static void on_page_in(void *arg, uint64_t done, uint64_t total)
{
    struct page_in_log *l = arg;
    if (l->calls++ == 0)
        l->total = total;
    l->backwards |= done < l->last;
    l->total_changed |= total != l->total;
    l->last = done;
}

/* model_files_page_in reads every byte of every file (both shards here),
 * reports from 0 to the total in MODEL_PAGE_IN_CHUNK steps, never back. */
static void check_page_in(model_files *files, const char *const *names, int n)
{
    uint64_t want = 0, chunks = 0;
    for (int i = 0; i < n; i++) {
        char path[128];
        struct stat st;
        snprintf(path, sizeof(path), "%s/%s", g_dir, names[i]);
        assert_int_equal(stat(path, &st), 0);
        want += (uint64_t)st.st_size;
        chunks += ((uint64_t)st.st_size + MODEL_PAGE_IN_CHUNK - 1) / MODEL_PAGE_IN_CHUNK;
    }
    assert_int_equal(model_files_bytes(files), want);
    struct page_in_log l = {0};
    char err[MODEL_ERR_LEN] = "";
    assert_int_equal(model_files_page_in(files, on_page_in, &l, err), MODEL_OK);
    assert_int_equal(l.total, want);
    assert_int_equal(l.last, want);
    assert_int_equal(l.calls, 1 + chunks);
    assert_false(l.backwards);
    assert_false(l.total_changed);
    assert_int_equal(model_files_page_in(files, NULL, NULL, err), MODEL_OK); /* no callback: still reads */
}

static void test_sharded(void **state)
{
    (void)state;
    struct spec s = spec_of("Qwen2ForCausalLM");
    json_t *c = spec_config(&s);
    write_json("config.json", c);
    json_decref(c);
    /* every tensor into one of two shards, alternating, through the index */
    struct stw all, shard[2];
    stw_init(&all);
    spec_tensors(&s, &all);
    stw_init(&shard[0]);
    stw_init(&shard[1]);
    json_t *map = json_object();
    const char *names[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
    const char *key;
    json_t *v;
    int i = 0;
    json_object_foreach(all.header, key, v)
    {
        json_t *shape = json_object_get(v, "shape");
        stw_add(&shard[i % 2], key, json_string_value(json_object_get(v, "dtype")),
                (long)json_integer_value(json_array_get(shape, 0)),
                json_array_size(shape) == 2 ? (long)json_integer_value(json_array_get(shape, 1)) : 0);
        json_object_set_new(map, key, json_string(names[i % 2]));
        i++;
    }
    free(all.data);
    json_decref(all.header);
    stw_write(&shard[0], names[0]);
    stw_write(&shard[1], names[1]);
    json_t *index = json_pack("{s:{s:i}, s:o}", "metadata", "total_size", 0, "weight_map", map);
    write_json("model.safetensors.index.json", index);

    struct loaded m;
    load_ok(&m);
    check_mat(&m.w.tok_embed, "model.embed_tokens.weight", BE_BF16, 40, 16);
    check_mat(&m.w.lm_head, "lm_head.weight", BE_BF16, 40, 16);
    check_mat(&m.w.layers[2].w_down, "model.layers.2.mlp.down_proj.weight", BE_BF16, 16, 24);
    check_vec(m.w.layers[1].bk, "model.layers.1.self_attn.k_proj.bias", 8);
    check_vec(m.w.final_norm, "model.norm.weight", 16);
    check_page_in(m.files, names, 2);
    unload(&m);

    /* a tensor the map does not list */
    json_object_del(map, "model.layers.1.mlp.up_proj.weight");
    write_json("model.safetensors.index.json", index);
    expect_fail(MODEL_EFORMAT, "model.safetensors.index.json", "model.layers.1.mlp.up_proj.weight", NULL);

    /* a shard that is not there */
    json_object_set_new(map, "model.layers.1.mlp.up_proj.weight", json_string("model-00003-of-00002.safetensors"));
    write_json("model.safetensors.index.json", index);
    expect_fail(MODEL_ENOENT, "model-00003-of-00002.safetensors", NULL);

    /* a shard outside the directory */
    json_object_set_new(map, "model.layers.1.mlp.up_proj.weight", json_string(".." "/config.json")); /* a parent-directory path */
    write_json("model.safetensors.index.json", index);
    expect_fail(MODEL_EFORMAT, "model.safetensors.index.json", "model.layers.1.mlp.up_proj.weight", NULL);

    /* the map points at a shard that lacks the tensor */
    json_object_set_new(map, "model.layers.1.mlp.up_proj.weight", json_string(names[0]));
    json_object_set_new(map, "model.embed_tokens.weight", json_string(names[1]));
    write_json("model.safetensors.index.json", index);
    expect_fail(MODEL_EFORMAT, names[1], "missing tensor model.embed_tokens.weight", NULL);

    json_object_del(index, "weight_map");
    write_json("model.safetensors.index.json", index);
    expect_fail(MODEL_EFORMAT, "model.safetensors.index.json", "weight_map", NULL);
    json_decref(index);

    /* model.safetensors, when present, is used and the index not read */
    write_model(&s);
    load_ok(&m);
    check_mat(&m.w.tok_embed, "model.embed_tokens.weight", BE_BF16, 40, 16);
    unload(&m);
}

/* A leading odd-sized tensor shifts every matrix off its alignment: they
 * must come back as aligned copies with the same values. */
static void test_unaligned_copied(void **state)
{
    (void)state;
    struct spec s = spec_of("LlamaForCausalLM");
    s.dtype = "F32";
    json_t *c = spec_config(&s);
    write_json("config.json", c);
    json_decref(c);
    struct stw w;
    stw_init(&w);
    stw_add(&w, "a.odd.byte", "U8", 1, 0);
    spec_tensors(&s, &w);
    stw_write(&w, "model.safetensors");
    struct loaded m;
    load_ok(&m);
    check_mat(&m.w.tok_embed, "model.embed_tokens.weight", BE_F32, 40, 16);
    check_mat(&m.w.layers[1].w_up, "model.layers.1.mlp.up_proj.weight", BE_F32, 24, 16);
    check_vec(m.w.layers[1].ffn_norm, "model.layers.1.post_attention_layernorm.weight", 16);
    unload(&m);
}

/* ---- bad weights files ---------------------------------------------------- */

static void write_config(const struct spec *s)
{
    json_t *c = spec_config(s);
    write_json("config.json", c);
    json_decref(c);
}

static void test_missing_files(void **state)
{
    (void)state;
    expect_fail(MODEL_ENOENT, "config.json", NULL);
    struct spec s = spec_of("LlamaForCausalLM");
    write_config(&s);
    expect_fail(MODEL_ENOENT, "model.safetensors", NULL);
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors", g_dir);
    assert_int_equal(mkdir(path, 0700), 0);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "not a regular file", NULL);
}

static void test_truncated(void **state)
{
    (void)state;
    struct spec s = spec_of("LlamaForCausalLM");
    write_model(&s);
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors", g_dir);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fclose(f);
    /* cut into the data: the last tensor (by offset) runs past the end */
    assert_int_equal(truncate(path, size - 10), 0);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "out of range", "lm_head.weight", NULL);
    assert_int_equal(truncate(path, 5), 0);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "truncated", NULL);
    assert_int_equal(truncate(path, 0), 0);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "truncated", NULL);
}

static void write_raw_header(uint64_t hlen, const char *text)
{
    uint8_t buf[256] = {0};
    size_t n = strlen(text);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(hlen >> (8 * i));
    memcpy(buf + 8, text, n);
    write_file("model.safetensors", buf, 8 + n);
}

static void test_bad_header(void **state)
{
    (void)state;
    struct spec s = spec_of("LlamaForCausalLM");
    write_config(&s);
    write_raw_header(1000, "{}");
    expect_fail(MODEL_EFORMAT, "model.safetensors", "header length 1000 runs past the end", NULL);
    write_raw_header((uint64_t)1 << 62, "{}");
    expect_fail(MODEL_EFORMAT, "model.safetensors", "header length 4611686018427387904", NULL);
    write_raw_header(UINT64_MAX, "{}");
    expect_fail(MODEL_EFORMAT, "model.safetensors", "runs past the end", NULL);
    write_raw_header(9, "{\"a\": [1,");
    expect_fail(MODEL_EFORMAT, "model.safetensors", "header JSON", NULL);
    write_raw_header(4, "[1] ");
    expect_fail(MODEL_EFORMAT, "model.safetensors", "not a JSON object", NULL);
    const char *dup = "{\"x\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},"
                      "\"x\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}";
    write_raw_header(strlen(dup), dup);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "header JSON", NULL);
    const char *noshape = "{\"x\":{\"dtype\":\"F32\",\"data_offsets\":[0,0]}}";
    write_raw_header(strlen(noshape), noshape);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "tensor x", NULL);
    const char *neg = "{\"x\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,0]}}";
    write_raw_header(strlen(neg), neg);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "tensor x", "shape[0]", NULL);
    const char *big = "{\"x\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,0]}}";
    write_raw_header(strlen(big), big);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "tensor x", "overflows", NULL);
}

/* Builds the good Llama file, lets edit() damage its header, writes it. */
static void write_damaged(const struct spec *s, void (*edit)(struct stw *))
{
    write_config(s);
    struct stw w;
    stw_init(&w);
    spec_tensors(s, &w);
    edit(&w);
    stw_write(&w, "model.safetensors");
}

static long offset_of(struct stw *w, const char *name, int which)
{
    json_t *t = json_object_get(w->header, name);
    return (long)json_integer_value(json_array_get(json_object_get(t, "data_offsets"), (size_t)which));
}

static void past_end(struct stw *w)
{
    set_offsets(w, "model.norm.weight", (long)w->size, (long)w->size + 32);
}

static void overlapping(struct stw *w)
{
    const char *n = "model.layers.0.post_attention_layernorm.weight";
    long b = offset_of(w, "model.layers.0.input_layernorm.weight", 0);
    set_offsets(w, n, b + 2, b + 2 + 32);
}

static void size_mismatch(struct stw *w)
{
    const char *n = "model.layers.1.mlp.up_proj.weight";
    set_offsets(w, n, offset_of(w, n, 0), offset_of(w, n, 1) - 2);
}

static void reversed(struct stw *w)
{
    const char *n = "model.layers.1.mlp.up_proj.weight";
    set_offsets(w, n, offset_of(w, n, 1), offset_of(w, n, 0));
}

static void dtype_i8(struct stw *w)
{
    json_t *t = json_object_get(w->header, "model.layers.0.self_attn.k_proj.weight");
    json_object_set_new(t, "dtype", json_string("I8"));
    json_object_set_new(t, "shape", json_pack("[i,i]", 16, 16)); /* same 256 bytes */
}

static void dtype_unknown(struct stw *w)
{
    json_object_set_new(json_object_get(w->header, "model.norm.weight"), "dtype", json_string("Q4_K"));
}

static void dtype_f16(struct stw *w)
{
    json_t *t = json_object_get(w->header, "model.layers.2.mlp.down_proj.weight");
    json_object_set_new(t, "dtype", json_string("F16")); /* same bytes as BF16 */
}

static void wrong_shape(struct stw *w)
{
    json_t *t = json_object_get(w->header, "model.layers.1.self_attn.v_proj.weight");
    json_object_set_new(t, "shape", json_pack("[i,i]", 16, 8)); /* transposed, same size */
}

static void wrong_rank(struct stw *w)
{
    json_t *t = json_object_get(w->header, "model.layers.0.input_layernorm.weight");
    json_object_set_new(t, "shape", json_pack("[i,i]", 4, 4));
}

static void intact(struct stw *w)
{
    (void)w;
}

static void no_gate(struct stw *w)
{
    json_object_del(w->header, "model.layers.2.mlp.gate_proj.weight");
}

static void test_bad_tensors(void **state)
{
    (void)state;
    struct spec s = spec_of("LlamaForCausalLM");
    write_damaged(&s, past_end);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "model.norm.weight", "out of range", NULL);
    write_damaged(&s, overlapping);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "model.layers.0.post_attention_layernorm.weight", "overlap", NULL);
    write_damaged(&s, size_mismatch);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "model.layers.1.mlp.up_proj.weight", "span 766 bytes", "768",
                NULL);
    write_damaged(&s, reversed);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "model.layers.1.mlp.up_proj.weight", "out of range", NULL);
    write_damaged(&s, dtype_i8);
    expect_fail(MODEL_EUNSUPPORTED, "model.safetensors", "model.layers.0.self_attn.k_proj.weight", "I8", NULL);
    write_damaged(&s, dtype_unknown);
    expect_fail(MODEL_EUNSUPPORTED, "model.safetensors", "model.norm.weight", "Q4_K", NULL);
    write_damaged(&s, dtype_f16);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "model.layers.2.mlp.down_proj.weight", "F16", "BF16", NULL);
    write_damaged(&s, wrong_shape);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "model.layers.1.self_attn.v_proj.weight", "[16, 8]", "[8, 16]",
                NULL);
    write_damaged(&s, wrong_rank);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "model.layers.0.input_layernorm.weight", "[4, 4]", "[16]", NULL);
    write_damaged(&s, no_gate);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "missing tensor model.layers.2.mlp.gate_proj.weight", NULL);

    /* untied config, no lm_head in the file */
    s.tie = true;
    write_damaged(&s, intact);
    s.tie = false;
    write_config(&s);
    expect_fail(MODEL_EFORMAT, "model.safetensors", "missing tensor lm_head.weight", NULL);
}

/* ---- bad config.json ------------------------------------------------------- */

/* Writes the good Llama config with key set to v (NULL: removed). */
static void config_with(const char *key, json_t *v)
{
    struct spec s = spec_of("LlamaForCausalLM");
    write_config_with(spec_config(&s), key, v);
}

static void test_bad_config(void **state)
{
    (void)state;
    write_file("config.json", "{\"architectures\": [", 19);
    expect_fail(MODEL_EFORMAT, "config.json", "line", NULL);
    write_file("config.json", "[]", 2);
    expect_fail(MODEL_EFORMAT, "config.json", "not a JSON object", NULL);

    config_with("architectures", json_pack("[s]", "BloomForCausalLM"));
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "BloomForCausalLM", "GPT2LMHeadModel", NULL);
    config_with("architectures", json_array());
    expect_fail(MODEL_ECONFIG, "config.json", "architectures", NULL);
    config_with("architectures", NULL);
    expect_fail(MODEL_ECONFIG, "config.json", "missing field architectures", NULL);

    config_with("hidden_size", NULL);
    expect_fail(MODEL_ECONFIG, "config.json", "missing field hidden_size", NULL);
    config_with("hidden_size", json_integer(-16));
    expect_fail(MODEL_ECONFIG, "config.json", "hidden_size=-16", NULL);
    config_with("vocab_size", json_integer(0));
    expect_fail(MODEL_ECONFIG, "config.json", "vocab_size=0", NULL);
    config_with("vocab_size", json_integer((1 << 24) + 1));
    expect_fail(MODEL_ECONFIG, "config.json", "vocab_size=16777217", NULL);
    config_with("num_hidden_layers", json_string("3"));
    expect_fail(MODEL_ECONFIG, "config.json", "num_hidden_layers must be an integer", NULL);
    config_with("num_key_value_heads", json_integer(3));
    expect_fail(MODEL_ECONFIG, "config.json", "num_key_value_heads=3 does not divide num_attention_heads=4", NULL);
    config_with("head_dim", json_integer(5));
    expect_fail(MODEL_ECONFIG, "config.json", "head_dim=5 is odd", NULL);
    config_with("intermediate_size", json_integer(1 << 30));
    expect_fail(MODEL_ECONFIG, "config.json", "intermediate_size", NULL);
    config_with("rms_norm_eps", json_real(-1e-5));
    expect_fail(MODEL_ECONFIG, "config.json", "rms_norm_eps", NULL);
    config_with("rms_norm_eps", json_real(1e-300)); /* 0 as the float the model reads */
    expect_fail(MODEL_ECONFIG, "config.json", "rms_norm_eps", NULL);
    config_with("max_position_embeddings", json_integer(0));
    expect_fail(MODEL_ECONFIG, "config.json", "max_position_embeddings=0", NULL);
    config_with("num_attention_heads", json_integer(-4));
    expect_fail(MODEL_ECONFIG, "config.json", "num_attention_heads=-4", NULL);
    config_with("rope_theta", json_real(0));
    expect_fail(MODEL_ECONFIG, "config.json", "rope_theta", NULL);
    config_with("torch_dtype", json_string("int8"));
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "torch_dtype", "int8", NULL);
    config_with("torch_dtype", NULL);
    expect_fail(MODEL_ECONFIG, "config.json", "torch_dtype", NULL);
    config_with("hidden_act", json_string("gelu"));
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "hidden_act", NULL);
    config_with("tie_word_embeddings", json_integer(1));
    expect_fail(MODEL_ECONFIG, "config.json", "tie_word_embeddings", NULL);
    config_with("eos_token_id", json_integer(40));
    expect_fail(MODEL_ECONFIG, "config.json", "eos_token_id", NULL);
    config_with("eos_token_id", json_pack("[i,i,i,i,i,i,i,i,i]", 1, 2, 3, 4, 5, 6, 7, 8, 9));
    expect_fail(MODEL_ECONFIG, "config.json", "eos_token_id", NULL);
    config_with("quantization_config", json_pack("{s:s}", "quant_method", "gptq"));
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "quantization_config", NULL);
    config_with("rope_scaling", json_pack("{s:s}", "rope_type", "linear"));
    expect_fail(MODEL_ECONFIG, "config.json", "missing field rope_scaling.factor", NULL);
    config_with("rope_scaling", json_pack("{s:s, s:f, s:f, s:f, s:i}", "rope_type", "llama3", "factor", 8.0,
                                          "low_freq_factor", 4.0, "high_freq_factor", 4.0,
                                          "original_max_position_embeddings", 64));
    expect_fail(MODEL_ECONFIG, "config.json", "high_freq_factor", NULL);

    /* head_dim absent and heads not dividing hidden_size */
    struct spec s = spec_of("LlamaForCausalLM");
    s.heads = 3;
    s.kv_heads = 3;
    json_t *c = spec_config(&s);
    json_object_del(c, "head_dim");
    write_json("config.json", c);
    json_decref(c);
    expect_fail(MODEL_ECONFIG, "config.json", "hidden_size=16", NULL);

    /* a derived default is range-checked as a field is: head_dim absent,
     * hidden_size / num_attention_heads wider than the kernels take */
    s = spec_of("LlamaForCausalLM");
    c = spec_config(&s);
    json_object_del(c, "head_dim");
    json_object_set_new(c, "hidden_size", json_integer(2048));
    json_object_set_new(c, "num_attention_heads", json_integer(1));
    json_object_set_new(c, "num_key_value_heads", json_integer(1));
    write_json("config.json", c);
    json_decref(c);
    expect_fail(MODEL_ECONFIG, "config.json", "head_dim=2048 (its default", "[1, 1024]", NULL);

    /* a broken generation_config.json names itself */
    config_with("eos_token_id", json_integer(2));
    write_file("generation_config.json", "{\"eos_token_id\": -3}", 20);
    expect_fail(MODEL_ECONFIG, "generation_config.json", "eos_token_id", NULL);
    write_file("generation_config.json", "{", 1);
    expect_fail(MODEL_EFORMAT, "generation_config.json", NULL);
}

static void test_bad_windows(void **state)
{
    (void)state;
    struct spec s = spec_of("Qwen2ForCausalLM");
    json_t *c = spec_config(&s);
    json_object_set_new(c, "layer_types", json_pack("[s,s]", "full_attention", "full_attention"));
    write_json("config.json", c);
    expect_fail(MODEL_ECONFIG, "config.json", "layer_types", NULL);
    json_object_set_new(c, "layer_types", json_pack("[s,s,s]", "full_attention", "local", "full_attention"));
    write_json("config.json", c);
    expect_fail(MODEL_ECONFIG, "config.json", "layer_types[1]", NULL);
    json_object_del(c, "layer_types");
    json_object_set_new(c, "use_sliding_window", json_true());
    json_object_set_new(c, "sliding_window", json_integer(0));
    write_json("config.json", c);
    expect_fail(MODEL_ECONFIG, "config.json", "sliding_window=0", NULL);
    json_decref(c);
    s = spec_of("MistralForCausalLM");
    c = spec_config(&s);
    json_object_set_new(c, "sliding_window", json_integer(-5));
    write_json("config.json", c);
    expect_fail(MODEL_ECONFIG, "config.json", "sliding_window=-5", NULL);
    json_object_set_new(c, "sliding_window", json_real(4.5));
    write_json("config.json", c);
    expect_fail(MODEL_ECONFIG, "config.json", "sliding_window must be an integer", NULL);
    json_decref(c);
}

/* A FIFO (or any non-regular file) in the model directory is refused at
 * once: open() without O_NONBLOCK waited for a writer forever. */
static void test_fifo(void **state)
{
    (void)state;
    alarm(20); /* a hang fails the test instead of the whole run */
    const char *names[] = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"};
    struct spec s = spec_of("LlamaForCausalLM");
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char path[256];
        snprintf(path, sizeof path, "%s/%s", g_dir, names[i]);
        write_model(&s);
        unlink(path);
        assert_int_equal(mkfifo(path, 0600), 0);
        if (i < 3) {
            expect_fail(MODEL_EFORMAT, names[i], "not a regular file", NULL);
        } else {
            char err[MODEL_ERR_LEN] = "";
            tokenizer *t = NULL;
            assert_int_equal(tokenizer_load(g_dir, &t, err), TEXT_EIO);
            assert_non_null(strstr(err, "not a regular file"));
        }
        unlink(path);
    }
    alarm(0);
}

/* Writes a NaN over element i of tensor name in model.safetensors. */
static void poke_nan(const char *name, size_t i)
{
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors", g_dir);
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    uint8_t len[8];
    assert_int_equal(fread(len, 1, 8, f), 8);
    uint64_t hlen = 0;
    for (int k = 7; k >= 0; k--)
        hlen = hlen << 8 | len[k];
    char *h = malloc(hlen + 1);
    assert_non_null(h);
    assert_int_equal(fread(h, 1, hlen, f), hlen);
    json_t *root = json_loadb(h, hlen, 0, NULL);
    free(h);
    json_t *t = json_object_get(root, name);
    assert_non_null(t);
    const char *dt = json_string_value(json_object_get(t, "dtype"));
    size_t at = 8 + hlen + (size_t)json_integer_value(json_array_get(json_object_get(t, "data_offsets"), 0)) +
                i * dtype_bytes(dt);
    uint8_t nan[4];
    encode(dt, NAN, nan);
    assert_int_equal(fseek(f, (long)at, SEEK_SET), 0);
    assert_int_equal(fwrite(nan, 1, dtype_bytes(dt), f), dtype_bytes(dt));
    assert_int_equal(fclose(f), 0);
    json_decref(root);
}

/* NaN and infinity: always refused in the 1-D tensors (converted at load),
 * in the matrices by model_weights_verify (kvtierd --verify-weights). */
static void test_non_finite_weights(void **state)
{
    (void)state;
    const char *dtypes[] = {"F32", "F16", "BF16"};
    for (int d = 0; d < 3; d++) {
        struct spec s = spec_of("LlamaForCausalLM");
        s.dtype = dtypes[d];
        write_model(&s);
        poke_nan("model.layers.1.post_attention_layernorm.weight", 3);
        expect_fail(MODEL_EFORMAT, "model.layers.1.post_attention_layernorm.weight", "non-finite", "index 3", NULL);

        write_model(&s);
        poke_nan("model.layers.2.mlp.down_proj.weight", 30);
        struct loaded m;
        load_ok(&m); /* the matrices are mapped, not read */
        char err[MODEL_ERR_LEN] = "";
        assert_int_equal(model_weights_verify(&m.cfg, &m.w, err), MODEL_EFORMAT);
        assert_non_null(strstr(err, "model.layers.2.mlp.down_proj.weight"));
        assert_non_null(strstr(err, "row 1, column 6")); /* down_proj is (dim 16, ffn 24) */
        unload(&m);

        write_model(&s);
        load_ok(&m);
        assert_int_equal(model_weights_verify(&m.cfg, &m.w, err), MODEL_OK);
        unload(&m);
    }
}

/* --weights q8_0: every layer matrix becomes Q8_0 blocks of its values
 * (the test's multiples of 1/8 with max 1 quantize to d = 1/127 and codes
 * within half a step), the rest stays bound to the mmap; a matrix whose
 * rows are not whole blocks, or that holds a NaN, is refused by name; and
 * quantized weights give the model another fingerprint. */
static void test_q8_weights(void **state)
{
    (void)state;
    struct spec s = spec_of("LlamaForCausalLM");
    s.dim = 32, s.ffn = 64, s.heads = 4, s.head_dim = 8; /* every matrix's rows are whole blocks */
    write_model(&s);
    struct loaded m;
    load_ok(&m);
    struct model_layer *orig = m.w.layers, *ls = NULL;
    void *blocks = NULL;
    char err[MODEL_ERR_LEN] = "";
    if (model_weights_quantize(&m.cfg, &m.w, MODEL_WEIGHTS_Q8_0, &blocks, &ls, err) != MODEL_OK)
        fail_msg("%s", err);
    assert_ptr_equal(m.w.layers, ls);
    assert_ptr_not_equal(ls, orig);
    check_mat(&m.w.tok_embed, "model.embed_tokens.weight", BE_BF16, s.vocab, s.dim);
    float back[64];
    for (int l = 0; l < s.layers; l++) {
        const struct model_mat *mats[] = {&ls[l].wq, &ls[l].w_down};
        const char *names[] = {"self_attn.q_proj.weight", "mlp.down_proj.weight"};
        for (int k = 0; k < 2; k++) {
            char name[128];
            snprintf(name, sizeof name, "model.layers.%d.%s", l, names[k]);
            assert_int_equal(mats[k]->dtype, BE_Q8_0);
            assert_int_equal(orig[l].wq.dtype, BE_BF16);
            size_t per_row = (size_t)mats[k]->cols / Q8_0_BLOCK;
            for (int r = 0; r < mats[k]->rows; r++) {
                q8_0_dequantize((const struct q8_0_block *)mats[k]->data + (size_t)r * per_row, back,
                                (size_t)mats[k]->cols);
                for (int c = 0; c < mats[k]->cols; c++) {
                    float want = expected(name, (size_t)r * mats[k]->cols + c);
                    if (fabsf(back[c] - want) > 0.51f / 127)
                        fail_msg("%s [%d, %d]: %g, wanted %g", name, r, c, back[c], want);
                }
            }
        }
    }
    free(blocks);
    free(ls);

    be_backend *be;
    struct be_params bp = {.n_threads = 1};
    assert_int_equal(be_open("cpu", &bp, &be), BE_OK);
    model *plain, *q8;
    struct model_params mp = {.max_batch_tokens = 4};
    assert_int_equal(model_load(g_dir, be, &mp, &plain, err), MODEL_OK);
    mp.weights = MODEL_WEIGHTS_Q8_0;
    assert_int_equal(model_load(g_dir, be, &mp, &q8, err), MODEL_OK);
    assert_int_equal(model_get_weights(q8)->layers[2].w_up.dtype, BE_Q8_0);
    assert_int_equal(model_get_weights(plain)->layers[2].w_up.dtype, BE_BF16);
    assert_true(model_fingerprint(plain) != model_fingerprint(q8));
    model_free(plain);
    model_free(q8);
    unload(&m);

    poke_nan("model.layers.1.mlp.up_proj.weight", 70); /* up_proj is (ffn 64, dim 32) */
    load_ok(&m);
    struct model_layer *before = m.w.layers;
    assert_int_equal(model_weights_quantize(&m.cfg, &m.w, MODEL_WEIGHTS_Q8_0, &blocks, &ls, err), MODEL_EFORMAT);
    assert_non_null(strstr(err, "model.layers.1.mlp.up_proj.weight"));
    assert_non_null(strstr(err, "row 2"));
    assert_ptr_equal(m.w.layers, before);
    unload(&m);

    s = spec_of("LlamaForCausalLM"); /* dim 16: half a block per row */
    write_model(&s);
    load_ok(&m);
    before = m.w.layers;
    assert_int_equal(model_weights_quantize(&m.cfg, &m.w, MODEL_WEIGHTS_Q8_0, &blocks, &ls, err), MODEL_EUNSUPPORTED);
    assert_non_null(strstr(err, "model.layers.0.self_attn.q_proj.weight"));
    assert_non_null(strstr(err, "multiple of 32"));
    assert_ptr_equal(m.w.layers, before);
    unload(&m);
    mp.weights = MODEL_WEIGHTS_Q8_0;
    assert_int_equal(model_load(g_dir, be, &mp, &q8, err), MODEL_EUNSUPPORTED);
    assert_null(q8);
    be_free(be);

    enum model_weights_fmt f = MODEL_WEIGHTS_AUTO;
    assert_true(model_weights_parse("q8_0", &f) && f == MODEL_WEIGHTS_Q8_0);
    assert_false(model_weights_parse("q4_0", &f));
    assert_int_equal(f, MODEL_WEIGHTS_Q8_0);
    assert_true(model_weights_parse("q4_k", &f) && f == MODEL_WEIGHTS_Q4_K);
}

/* --weights q4_k: a matrix whose rows are whole super-blocks of 256
 * (down_proj, ffn 256 columns) becomes Q4_K blocks of its values (the
 * test's multiples of 1/8 in [-1, 1] within two 4-bit steps of 2/15: the
 * fit may clip a sub-block's extremes, measured 0.13), the others (32
 * columns) Q8_0;
 * and the model gets a fingerprint of its own. */
static void test_q4k_weights(void **state)
{
    (void)state;
    struct spec s = spec_of("LlamaForCausalLM");
    s.dim = 32, s.ffn = 256, s.heads = 4, s.head_dim = 8;
    write_model(&s);
    struct loaded m;
    load_ok(&m);
    struct model_layer *ls = NULL;
    void *blocks = NULL;
    char err[MODEL_ERR_LEN] = "";
    if (model_weights_quantize(&m.cfg, &m.w, MODEL_WEIGHTS_Q4_K, &blocks, &ls, err) != MODEL_OK)
        fail_msg("%s", err);
    float back[256];
    for (int l = 0; l < s.layers; l++) {
        assert_int_equal(ls[l].wq.dtype, BE_Q8_0);
        assert_int_equal(ls[l].w_up.dtype, BE_Q8_0);
        const struct model_mat *d = &ls[l].w_down;
        assert_int_equal(d->dtype, BE_Q4_K);
        char name[128];
        snprintf(name, sizeof name, "model.layers.%d.mlp.down_proj.weight", l);
        for (int r = 0; r < d->rows; r++) {
            q4_k_dequantize((const struct q4_k_block *)d->data + r, back, 256);
            for (int c = 0; c < d->cols; c++) {
                float want = expected(name, (size_t)r * d->cols + c);
                if (fabsf(back[c] - want) > 0.27f)
                    fail_msg("%s [%d, %d]: %g, wanted %g", name, r, c, back[c], want);
            }
        }
    }
    /* the verify pass reads blocks as blocks (a GGUF file's tensors are
     * bound so): finite factors pass, an infinite one names its tensor,
     * its format's scale and the row (one block a row here) */
    assert_int_equal(model_weights_verify(&m.cfg, &m.w, err), MODEL_OK);
    ((struct q4_k_block *)ls[1].w_down.data)[3].dmin = 0x7c00;
    assert_int_equal(model_weights_verify(&m.cfg, &m.w, err), MODEL_EFORMAT);
    assert_non_null(strstr(err, "model.layers.1.mlp.down_proj.weight"));
    assert_non_null(strstr(err, "non-finite q4_k scale in row 3"));
    ((struct q8_0_block *)ls[0].wq.data)[1].d = 0xfc00;
    assert_int_equal(model_weights_verify(&m.cfg, &m.w, err), MODEL_EFORMAT);
    assert_non_null(strstr(err, "model.layers.0.self_attn.q_proj.weight"));
    assert_non_null(strstr(err, "non-finite q8_0 scale in row 1"));
    free(blocks);
    free(ls);
    unload(&m);
    be_backend *be;
    struct be_params bp = {.n_threads = 1};
    assert_int_equal(be_open("cpu", &bp, &be), BE_OK);
    model *q8, *q4;
    struct model_params mp = {.max_batch_tokens = 4, .weights = MODEL_WEIGHTS_Q8_0};
    assert_int_equal(model_load(g_dir, be, &mp, &q8, err), MODEL_OK);
    mp.weights = MODEL_WEIGHTS_Q4_K;
    assert_int_equal(model_load(g_dir, be, &mp, &q4, err), MODEL_OK);
    assert_int_equal(model_get_weights(q4)->layers[1].w_down.dtype, BE_Q4_K);
    assert_true(model_fingerprint(q8) != model_fingerprint(q4));
    model_free(q8);
    model_free(q4);
    be_free(be);
}

static void test_strerror(void **state)
{
    (void)state;
    for (int st = MODEL_OK; st <= MODEL_EBACKEND; st++)
        assert_string_not_equal(model_strerror((enum model_status)st), "unknown model status");
    assert_string_equal(model_strerror((enum model_status)99), "unknown model status");
    model_files_close(NULL);
    model_config_release(NULL);
}

int main(void)
{
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
    const struct CMUnitTest tests[] = {
        T(test_llama_bf16),
        T(test_fingerprint),
        T(test_llama_attention_bias),
        T(test_mistral_f16_tied),
        T(test_qwen2_f32_windows),
        T(test_qwen3_qk_norm),
        T(test_gemma2),
        T(test_gemma3),
        T(test_phi3),
        T(test_gpt2),
        T(test_mamba),
        T(test_device_bytes),
        T(test_encdec_device_bytes),
        T(test_encdec_bad_config),
        T(test_defaults_and_generation_config),
        T(test_rope_scaling),
        T(test_sharded),
        T(test_unaligned_copied),
        T(test_missing_files),
        T(test_truncated),
        T(test_bad_header),
        T(test_bad_tensors),
        T(test_bad_config),
        T(test_bad_windows),
        T(test_fifo),
        T(test_non_finite_weights),
        T(test_q8_weights),
        T(test_q4k_weights),
        T(test_strerror),
    };
#undef T
    return cmocka_run_group_tests(tests, NULL, NULL);
}
