/* fuzz_safetensors.c - the safetensors header (u64 length + JSON tensor
 * table, checked against the file) and the shard index
 * model.safetensors.index.json, through model_files_open on a scratch
 * directory.
 *
 * Input: one mode byte, then the file.  Mode bit 0 picks the config the
 * tensors are bound against (a tied f32 Llama, or an untied f16 Qwen2 with
 * q/k/v biases); bit 1 makes the rest the shard index instead of
 * model.safetensors, next to two valid shards of the Llama written at start.
 *
 * Invariants: an error has a message naming a file or saying what ran out;
 * bound weights have the config's shapes and every byte of them can be read
 * (a tensor running past the map faults); no allocation is sized by a
 * declared shape before it is checked against the file (libFuzzer's
 * -malloc_limit_mb catches one that is). */
#include <sys/stat.h>

#include "model/model.h"
#include "tests/fuzz/fuzz_util.h"

static const struct model_config CONFIGS[2] = {
    {.arch = ARCH_LLAMA, .arch_name = "LlamaForCausalLM", .vocab_size = 4, .hidden_size = 2, .intermediate_size = 2,
     .n_layers = 1, .n_heads = 1, .n_kv_heads = 1, .head_dim = 2, .tie_word_embeddings = true, .dtype = BE_F32},
    {.arch = ARCH_QWEN2, .arch_name = "Qwen2ForCausalLM", .vocab_size = 4, .hidden_size = 2, .intermediate_size = 2,
     .n_layers = 1, .n_heads = 1, .n_kv_heads = 1, .head_dim = 2, .attention_bias = true, .dtype = BE_F16},
};

/* A safetensors file of the given tensors (name, rows, cols; cols 0 = 1-D),
 * all F32 and filled with 0.5. */
struct spec {
    const char *name;
    int rows, cols;
};

static void write_shard(const char *dir, const char *file, const struct spec *t, size_t n)
{
    char hdr[4096];
    size_t at = 0, off = 0;
    at += (size_t)snprintf(hdr + at, sizeof hdr - at, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (size_t i = 0; i < n; i++) {
        size_t bytes = 4 * (size_t)t[i].rows * (size_t)(t[i].cols ? t[i].cols : 1);
        if (t[i].cols)
            at += (size_t)snprintf(hdr + at, sizeof hdr - at,
                                   ",\"%s\":{\"dtype\":\"F32\",\"shape\":[%d,%d],\"data_offsets\":[%zu,%zu]}",
                                   t[i].name, t[i].rows, t[i].cols, off, off + bytes);
        else
            at += (size_t)snprintf(hdr + at, sizeof hdr - at,
                                   ",\"%s\":{\"dtype\":\"F32\",\"shape\":[%d],\"data_offsets\":[%zu,%zu]}", t[i].name,
                                   t[i].rows, off, off + bytes);
        off += bytes;
    }
    at += (size_t)snprintf(hdr + at, sizeof hdr - at, "}");
    while (at % 8)
        hdr[at++] = ' ';
    size_t total = 8 + at + off;
    unsigned char *buf = malloc(total);
    uint64_t len = at;
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(len >> (8 * i));
    memcpy(buf + 8, hdr, at);
    float half = 0.5f;
    for (size_t i = 0; i < off / 4; i++)
        memcpy(buf + 8 + at + 4 * i, &half, 4);
    fuzz_write(dir, file, buf, total);
    free(buf);
}

static const char *index_dir(void)
{
    static char dir[256];
    if (dir[0])
        return dir;
    snprintf(dir, sizeof dir, "%s/index", fuzz_dir("safetensors"));
    mkdir(dir, 0700);
    static const struct spec one[] = {
        {"model.embed_tokens.weight", 4, 2},
        {"model.layers.0.self_attn.q_proj.weight", 2, 2},
        {"model.layers.0.self_attn.k_proj.weight", 2, 2},
        {"model.layers.0.self_attn.v_proj.weight", 2, 2},
        {"model.layers.0.self_attn.o_proj.weight", 2, 2},
    };
    static const struct spec two[] = {
        {"model.layers.0.mlp.gate_proj.weight", 2, 2},  {"model.layers.0.mlp.up_proj.weight", 2, 2},
        {"model.layers.0.mlp.down_proj.weight", 2, 2},  {"model.layers.0.input_layernorm.weight", 2, 0},
        {"model.layers.0.post_attention_layernorm.weight", 2, 0}, {"model.norm.weight", 2, 0},
    };
    write_shard(dir, "model-00001-of-00002.safetensors", one, sizeof one / sizeof one[0]);
    write_shard(dir, "model-00002-of-00002.safetensors", two, sizeof two / sizeof two[0]);
    return dir;
}

static size_t dtype_size(enum be_dtype d)
{
    return d == BE_F32 ? 4 : 2;
}

static void check_mat(const struct model_mat *m, int rows, int cols, const struct model_config *c, const char *what)
{
    FUZZ_CHECK(m->data && m->rows == rows && m->cols == cols && m->dtype == c->dtype, "%s: %dx%d dtype %d", what,
               m->rows, m->cols, (int)m->dtype);
    FUZZ_CHECK((uintptr_t)m->data % dtype_size(m->dtype) == 0, "%s is misaligned", what);
    fuzz_touch(m->data, (size_t)rows * (size_t)cols * dtype_size(m->dtype));
}

static void check_vec(const float *v, int len, const char *what)
{
    FUZZ_CHECK(v, "%s missing", what);
    fuzz_touch(v, (size_t)len * sizeof *v);
}

static void check_weights(const struct model_weights *w, const struct model_config *c)
{
    int dim = c->hidden_size, q = c->n_heads * c->head_dim, kv = c->n_kv_heads * c->head_dim;
    int ffn = c->intermediate_size;
    check_mat(&w->tok_embed, c->vocab_size, dim, c, "embed");
    check_mat(&w->lm_head, c->vocab_size, dim, c, "lm_head");
    check_vec(w->final_norm, dim, "final norm");
    FUZZ_CHECK(w->layers, "no layers");
    for (int l = 0; l < c->n_layers; l++) {
        const struct model_layer *L = &w->layers[l];
        check_mat(&L->wq, q, dim, c, "wq");
        check_mat(&L->wk, kv, dim, c, "wk");
        check_mat(&L->wv, kv, dim, c, "wv");
        check_mat(&L->wo, dim, q, c, "wo");
        check_mat(&L->w_gate, ffn, dim, c, "w_gate");
        check_mat(&L->w_up, ffn, dim, c, "w_up");
        check_mat(&L->w_down, dim, ffn, c, "w_down");
        check_vec(L->attn_norm, dim, "attn norm");
        check_vec(L->ffn_norm, dim, "ffn norm");
        FUZZ_CHECK(!c->attention_bias == !L->bq && !c->attention_bias == !L->bk && !c->attention_bias == !L->bv,
                   "q/k/v bias presence");
        if (L->bq) {
            check_vec(L->bq, q, "bq");
            check_vec(L->bk, kv, "bk");
            check_vec(L->bv, kv, "bv");
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 1 << 16)
        return 0;
    unsigned mode = data[0];
    const struct model_config *cfg = &CONFIGS[mode & 1];
    const char *dir;
    if (mode & 2) {
        dir = index_dir();
        fuzz_write(dir, "model.safetensors.index.json", data + 1, size - 1);
    } else {
        dir = fuzz_dir("safetensors");
        fuzz_write(dir, "model.safetensors", data + 1, size - 1);
    }
    model_files *mf = NULL;
    struct model_weights w;
    char err[MODEL_ERR_LEN];
    err[0] = '\0';
    enum model_status st = model_files_open(dir, cfg, &mf, &w, err);
    if (getenv("KVTIER_FUZZ_VERBOSE")) /* say what each input did */
        fprintf(stderr, "status %d: %s\n", st, st ? err : "ok");
    if (st == MODEL_OK) {
        FUZZ_CHECK(mf, "no files");
        check_weights(&w, cfg);
    } else {
        FUZZ_CHECK(!mf && !w.layers && !w.tok_embed.data, "weights left after an error");
        FUZZ_CHECK(st == MODEL_EFORMAT || st == MODEL_EUNSUPPORTED || st == MODEL_ENOENT || st == MODEL_ENOMEM,
                   "status %d (%s)", st, err);
        FUZZ_CHECK(strstr(err, "safetensors") || strstr(err, "out of memory"),
                   "message \"%s\" names no file", err);
    }
    model_files_close(mf);
    return 0;
}
