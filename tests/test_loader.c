/* Description: the Hugging Face model loader (model/config.c,
 * model/safetensors.c); one file over 1,000 lines, as every case writes
 * its model directory with the same small writer.  Each test writes a tiny model directory (config.json
 * and safetensors written by the small writer below) into a fresh temporary
 * directory: good Llama/Mistral/Qwen2/Qwen3 checkpoints bind with the right
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

#include "model/model.h"
#include "text/tokenizer.h"
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
    case BE_Q8_0: break; /* the loader binds checkpoint dtypes only */
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
};

static struct spec spec_of(const char *arch)
{
    struct spec s = {.arch = arch, .dtype = "BF16", .vocab = 40, .dim = 16, .ffn = 24, .layers = 3, .heads = 4,
                     .kv_heads = 2, .head_dim = 4};
    s.qkv_bias = strcmp(arch, "Qwen2ForCausalLM") == 0;
    s.qk_norm = strcmp(arch, "Qwen3ForCausalLM") == 0;
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
        T("self_attn.q_proj.weight", q, s->dim);
        T("self_attn.k_proj.weight", kv, s->dim);
        T("self_attn.v_proj.weight", kv, s->dim);
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
        T("mlp.gate_proj.weight", s->ffn, s->dim);
        T("mlp.up_proj.weight", s->ffn, s->dim);
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
    json_t *c = spec_config(&s);
    if (v)
        json_object_set_new(c, key, v);
    else
        json_object_del(c, key);
    write_json("config.json", c);
    json_decref(c);
}

static void test_bad_config(void **state)
{
    (void)state;
    write_file("config.json", "{\"architectures\": [", 19);
    expect_fail(MODEL_EFORMAT, "config.json", "line", NULL);
    write_file("config.json", "[]", 2);
    expect_fail(MODEL_EFORMAT, "config.json", "not a JSON object", NULL);

    config_with("architectures", json_pack("[s]", "GPT2LMHeadModel"));
    expect_fail(MODEL_EUNSUPPORTED, "config.json", "GPT2LMHeadModel", NULL);
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
    struct q8_0_block *blocks = NULL;
    char err[MODEL_ERR_LEN] = "";
    if (model_weights_quantize(&m.cfg, &m.w, &blocks, &ls, err) != MODEL_OK)
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
    assert_int_equal(model_weights_quantize(&m.cfg, &m.w, &blocks, &ls, err), MODEL_EFORMAT);
    assert_non_null(strstr(err, "model.layers.1.mlp.up_proj.weight"));
    assert_non_null(strstr(err, "row 2"));
    assert_ptr_equal(m.w.layers, before);
    unload(&m);

    s = spec_of("LlamaForCausalLM"); /* dim 16: half a block per row */
    write_model(&s);
    load_ok(&m);
    before = m.w.layers;
    assert_int_equal(model_weights_quantize(&m.cfg, &m.w, &blocks, &ls, err), MODEL_EUNSUPPORTED);
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
        T(test_strerror),
    };
#undef T
    return cmocka_run_group_tests(tests, NULL, NULL);
}
