/* test_gguf.c - the GGUF reader (model/gguf.c) on files this test writes
 * byte by byte: a small valid llama file loads (config, weights, tokenizer);
 * the same file truncated at every byte, with each count, length, rank,
 * dimension, type, offset and the alignment made wrong, and with random
 * bytes of its header flipped, is refused with a message naming the field,
 * and never crashes (run it under ASan: make SANITIZE=1 BUILD=build/asan).
 *
 * With KVTIER_GGUF_TOK=FILE.gguf and KVTIER_GGUF_TOK_DIR=DIR (written by
 * tests/gguf.test.sh: tools/st2gguf.py's GGUF of DIR) it instead checks
 * that the tokenizer from the GGUF metadata encodes every line of the
 * built-in model's held-out text, the tokenizer oracle's corpus and some
 * special-token markup to the ids DIR/tokenizer.json gives, and decodes
 * every id to the same bytes.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/generate.h"
#include "model/gguf.h"
#include "model/runtime.h"
#include "util/half.h"
#include "util/q4k.h"
#include "util/q8.h"

/* ---- a writer ------------------------------------------------------------- */

#define MAX_FIELDS 512

/* A field of the header: where it is, its size and what it is. */
struct field {
    size_t off, size;
    char what[64];
};

struct file {
    unsigned char *p;
    size_t n, cap;
    struct field f[MAX_FIELDS];
    int n_f;
    size_t data_off;
};

static void put(struct file *w, const void *p, size_t n, const char *what)
{
    if (w->n + n > w->cap) {
        w->cap = (w->n + n) * 2;
        w->p = realloc(w->p, w->cap);
        assert_non_null(w->p);
    }
    if (what && w->n_f < MAX_FIELDS) {
        w->f[w->n_f] = (struct field){.off = w->n, .size = n};
        snprintf(w->f[w->n_f++].what, sizeof w->f[0].what, "%s", what);
    }
    memcpy(w->p + w->n, p, n);
    w->n += n;
}

static void put_u32(struct file *w, uint32_t v, const char *what) { put(w, &v, 4, what); }
static void put_u64(struct file *w, uint64_t v, const char *what) { put(w, &v, 8, what); }

static void put_str(struct file *w, const char *s, const char *what)
{
    put_u64(w, strlen(s), what);
    put(w, s, strlen(s), NULL);
}

static void kv_str(struct file *w, const char *key, const char *v)
{
    put_str(w, key, "key length");
    put_u32(w, GGUF_STR, "value type");
    put_str(w, v, "string length");
}

static void kv_u32(struct file *w, const char *key, uint32_t v)
{
    put_str(w, key, "key length");
    put_u32(w, GGUF_U32, "value type");
    put_u32(w, v, NULL);
}

static void kv_f32(struct file *w, const char *key, float v)
{
    put_str(w, key, "key length");
    put_u32(w, GGUF_F32, "value type");
    put(w, &v, 4, "f32 value");
}

/* The model: one llama layer of dim 32, 2 heads of 16, 1 KV head, ffn 256
 * (down's rows one Q4_K super-block), a byte-level vocabulary of the 256
 * byte symbols and one merge. */
enum { DIM = 32, FFN = 256, HEADS = 2, KV_HEADS = 1, HD = 16, VOCAB = 257 };

struct tensor {
    const char *name;
    uint32_t type;
    uint64_t rows, cols; /* rows 0: 1-D of cols */
};

static const struct tensor TENSORS[] = {
    {"token_embd.weight", 8, VOCAB, DIM},
    {"blk.0.attn_norm.weight", 0, 0, DIM},
    {"blk.0.attn_q.weight", 8, HEADS * HD, DIM},
    {"blk.0.attn_k.weight", 1, KV_HEADS * HD, DIM},
    {"blk.0.attn_v.weight", 30, KV_HEADS * HD, DIM},
    {"blk.0.attn_output.weight", 0, DIM, HEADS * HD},
    {"blk.0.ffn_norm.weight", 0, 0, DIM},
    {"blk.0.ffn_gate.weight", 8, FFN, DIM},
    {"blk.0.ffn_up.weight", 1, FFN, DIM},
    {"blk.0.ffn_down.weight", GGML_TYPE_Q4_K, DIM, FFN},
    {"output_norm.weight", 0, 0, DIM},
};
#define N_TENSORS (sizeof TENSORS / sizeof TENSORS[0])

static size_t tensor_bytes(const struct tensor *t)
{
    uint64_t elems = (t->rows ? t->rows : 1) * t->cols;
    if (t->type == GGML_TYPE_Q4_K)
        return elems / Q4_K_BLOCK * sizeof(struct q4_k_block);
    return t->type == 8 ? elems / 32 * 34 : elems * (t->type == 0 ? 4 : 2);
}

/* Where tensor name's data starts in the file build writes. */
static size_t data_of(const struct file *w, const char *name)
{
    size_t off = w->data_off;
    for (size_t i = 0; i < N_TENSORS && strcmp(TENSORS[i].name, name); i++)
        off += (tensor_bytes(&TENSORS[i]) + 31) / 32 * 32;
    return off;
}

static void byte_symbol(unsigned b, char out[5])
{
    /* GPT-2's printable-byte alphabet (text/tokenizer_text.c has the table) */
    unsigned cp = b;
    if (!((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))) {
        unsigned k = 0;
        for (unsigned i = 0; i < b; i++)
            k += !((i >= 0x21 && i <= 0x7E) || (i >= 0xA1 && i <= 0xAC) || (i >= 0xAE && i <= 0xFF));
        cp = 0x100 + k;
    }
    if (cp < 0x80) {
        out[0] = (char)cp, out[1] = 0;
    } else {
        out[0] = (char)(0xC0 | cp >> 6), out[1] = (char)(0x80 | (cp & 0x3F)), out[2] = 0;
    }
}

static void build(struct file *w)
{
    memset(w, 0, sizeof *w);
    put(w, "GGUF", 4, "magic");
    put_u32(w, 3, "version");
    put_u64(w, N_TENSORS, "tensor count");
    put_u64(w, 16, "metadata count");
    kv_str(w, "general.architecture", "llama");
    kv_u32(w, "general.alignment", 32);
    kv_u32(w, "llama.embedding_length", DIM);
    kv_u32(w, "llama.feed_forward_length", FFN);
    kv_u32(w, "llama.block_count", 1);
    kv_u32(w, "llama.attention.head_count", HEADS);
    kv_u32(w, "llama.attention.head_count_kv", KV_HEADS);
    kv_u32(w, "llama.context_length", 64);
    kv_f32(w, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
    kv_str(w, "tokenizer.ggml.model", "gpt2");
    kv_str(w, "tokenizer.ggml.pre", "gpt-2");
    put_str(w, "tokenizer.ggml.tokens", "key length");
    put_u32(w, GGUF_ARR, "value type");
    put_u32(w, GGUF_STR, "array element type");
    put_u64(w, VOCAB, "array count");
    for (unsigned b = 0; b < 256; b++) {
        char s[5];
        byte_symbol(b, s);
        put_str(w, s, b == 7 ? "string length" : NULL);
    }
    put_str(w, "he", NULL);
    put_str(w, "tokenizer.ggml.merges", "key length");
    put_u32(w, GGUF_ARR, "value type");
    put_u32(w, GGUF_STR, "array element type");
    put_u64(w, 1, "array count");
    put_str(w, "h e", "string length");
    put_str(w, "tokenizer.ggml.token_type", "key length");
    put_u32(w, GGUF_ARR, "value type");
    put_u32(w, GGUF_I32, "array element type");
    put_u64(w, VOCAB, "array count");
    for (int i = 0; i < VOCAB; i++)
        put_u32(w, 1, NULL);
    kv_u32(w, "tokenizer.ggml.bos_token_id", 1);
    kv_u32(w, "tokenizer.ggml.eos_token_id", 2);
    uint64_t off = 0;
    for (size_t i = 0; i < N_TENSORS; i++) {
        const struct tensor *t = &TENSORS[i];
        put_str(w, t->name, "tensor name length");
        put_u32(w, t->rows ? 2 : 1, "tensor rank");
        put_u64(w, t->cols, "tensor ne[0]");
        if (t->rows)
            put_u64(w, t->rows, "tensor ne[1]");
        put_u32(w, t->type, "tensor type");
        put_u64(w, off, "tensor offset");
        off += (tensor_bytes(t) + 31) / 32 * 32;
    }
    static const unsigned char zero[32];
    put(w, zero, (32 - w->n % 32) % 32, NULL);
    w->data_off = w->n;
    /* data: small values; a Q8_0 block's scale is an f16, a Q4_K block's
     * factors f16 and its scales and codes any bytes */
    for (size_t i = 0; i < N_TENSORS; i++) {
        const struct tensor *t = &TENSORS[i];
        size_t n = tensor_bytes(t), start = w->n;
        unsigned char *buf = calloc(1, n + 32);
        assert_non_null(buf);
        if (t->type == GGML_TYPE_Q4_K) {
            for (size_t b = 0; b < n / sizeof(struct q4_k_block); b++) {
                struct q4_k_block q = {.d = f32_to_f16(0.002f), .dmin = f32_to_f16(0.01f)};
                for (size_t k = 0; k < sizeof q.scales; k++)
                    q.scales[k] = (uint8_t)(b * 31 + k * 17);
                for (size_t k = 0; k < sizeof q.qs; k++)
                    q.qs[k] = (uint8_t)(b * 7 + k * 13);
                memcpy(buf + b * sizeof q, &q, sizeof q);
            }
        } else if (t->type == 8) {
            for (size_t b = 0; b < n / 34; b++) {
                uint16_t d = f32_to_f16(0.01f);
                memcpy(buf + b * 34, &d, 2);
                for (int k = 0; k < 32; k++)
                    buf[b * 34 + 2 + k] = (unsigned char)(int8_t)((int)(b * 7 + (size_t)k * 3) % 41 - 20);
            }
        } else if (t->type == 0) {
            for (size_t k = 0; k < n / 4; k++) {
                float v = t->rows ? (float)((int)((k * 13 + i) % 29) - 14) / 100.0f : 1.0f;
                memcpy(buf + 4 * k, &v, 4);
            }
        } else {
            for (size_t k = 0; k < n / 2; k++) {
                float v = (float)((int)((k * 11 + i) % 23) - 11) / 100.0f;
                uint16_t h = t->type == 1 ? f32_to_f16(v) : f32_to_bf16(v);
                memcpy(buf + 2 * k, &h, 2);
            }
        }
        put(w, buf, n, NULL);
        put(w, buf + n, (32 - (w->n - start) % 32) % 32, NULL);
        free(buf);
    }
}

/* in memory where it can be: the test writes the file thousands of times */
static char g_path[64];

static void save(const struct file *w, size_t n)
{
    FILE *f = fopen(g_path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(w->p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

/* Every loader a GGUF path goes through; the first failure's status. */
static enum model_status load_all(char *err)
{
    struct model_config cfg;
    struct model_weights w;
    model_files *mf = NULL;
    tokenizer *tok = NULL;
    err[0] = '\0';
    enum model_status st = model_config_load(g_path, &cfg, err);
    if (st == MODEL_OK) {
        st = model_files_open(g_path, &cfg, &mf, &w, err);
        model_files_close(mf);
        model_config_release(&cfg);
    }
    if (st == MODEL_OK)
        st = model_tokenizer_load(g_path, &tok, err);
    tokenizer_free(tok);
    return st;
}

static int setup(void **state)
{
    (void)state;
    snprintf(g_path, sizeof g_path, "/dev/shm/kvtier-gguf-test-XXXXXX");
    int fd = mkstemp(g_path);
    if (fd < 0) {
        snprintf(g_path, sizeof g_path, "/tmp/kvtier-gguf-test-XXXXXX");
        fd = mkstemp(g_path);
    }
    assert_true(fd >= 0);
    close(fd);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    unlink(g_path);
    return 0;
}

/* ---- the valid file ------------------------------------------------------ */

static void test_valid(void **state)
{
    (void)state;
    struct file w;
    char err[MODEL_ERR_LEN];
    build(&w);
    save(&w, w.n);
    assert_int_equal(load_all(err), MODEL_OK);

    struct model_config cfg;
    struct model_weights wt;
    model_files *mf;
    assert_int_equal(model_config_load(g_path, &cfg, err), MODEL_OK);
    assert_int_equal(cfg.arch, ARCH_LLAMA);
    assert_int_equal(cfg.hidden_size, DIM);
    assert_int_equal(cfg.head_dim, HD);
    assert_int_equal(cfg.n_kv_heads, KV_HEADS);
    assert_int_equal(cfg.vocab_size, VOCAB);
    assert_true(cfg.tie_word_embeddings);
    assert_int_equal(cfg.bos_token_id, 1);
    assert_int_equal(cfg.n_eos, 1);
    assert_int_equal(cfg.eos_token_ids[0], 2);
    assert_int_equal(model_files_open(g_path, &cfg, &mf, &wt, err), MODEL_OK);
    /* Q8_0 rows are read in place, the type the file gives each matrix */
    assert_int_equal(wt.layers[0].w_gate.dtype, BE_Q8_0);
    assert_int_equal(wt.layers[0].wv.dtype, BE_BF16);
    assert_int_equal(wt.layers[0].wk.dtype, BE_F16);
    const unsigned char *gate = w.p + w.data_off;
    uint64_t off = 0;
    for (size_t i = 0; i < N_TENSORS; i++) {
        if (!strcmp(TENSORS[i].name, "blk.0.ffn_gate.weight"))
            gate += off;
        off += (tensor_bytes(&TENSORS[i]) + 31) / 32 * 32;
    }
    assert_memory_equal(wt.layers[0].w_gate.data, gate, (size_t)FFN * DIM / 32 * 34);
    /* Q4_K rows too: the file's bytes, not a requantization */
    assert_int_equal(wt.layers[0].w_down.dtype, BE_Q4_K);
    assert_memory_equal(wt.layers[0].w_down.data, w.p + data_of(&w, "blk.0.ffn_down.weight"),
                        (size_t)DIM * q4_k_row_bytes(FFN));
    assert_int_equal(model_weights_verify(&cfg, &wt, err), MODEL_OK);
    /* what a Q4_K token_embd is read through: the format's definition,
     * element by element */
    const struct gguf_type *q4 = gguf_block_type(BE_Q4_K);
    assert_non_null(q4);
    assert_int_equal(q4->block_bytes, sizeof(struct q4_k_block));
    float *dec = malloc((size_t)DIM * FFN * sizeof *dec);
    assert_non_null(dec);
    q4->to_f32(wt.layers[0].w_down.data, dec, (size_t)DIM * FFN);
    for (size_t i = 0; i < (size_t)DIM * FFN; i++) {
        const struct q4_k_block *b = (const struct q4_k_block *)wt.layers[0].w_down.data + i / Q4_K_BLOCK;
        int j = (int)(i % Q4_K_BLOCK / Q4_K_SUB), sc, m;
        q4_k_scale_min(b->scales, j, &sc, &m);
        uint8_t byte = b->qs[(j / 2) * 32 + (int)(i % Q4_K_SUB)];
        float q = (float)(j % 2 ? byte >> 4 : byte & 15);
        float want = f16_to_f32(b->d) * (float)sc * q - f16_to_f32(b->dmin) * (float)m;
        assert_true(dec[i] == want);
    }
    free(dec);
    /* a Q8_0 token_embd: be_embed reads an exact f32 copy; the tied lm_head
     * the Q8_0 rows */
    assert_int_equal(cfg.dtype, BE_F32);
    assert_int_equal(wt.tok_embed.dtype, BE_F32);
    assert_int_equal(wt.lm_head.dtype, BE_Q8_0);
    assert_memory_equal(wt.lm_head.data, w.p + w.data_off, (size_t)VOCAB * DIM / 32 * 34);
    for (size_t i = 0; i < (size_t)VOCAB * DIM; i++) {
        const struct q8_0_block *b = (const struct q8_0_block *)(w.p + w.data_off) + i / 32;
        assert_true(((const float *)wt.tok_embed.data)[i] == f16_to_f32(b->d) * (float)b->qs[i % 32]);
    }
    /* q: head h's row 2i + j is Hugging Face's row j * HD/2 + i */
    const struct q8_0_block *q = wt.layers[0].wq.data;
    const unsigned char *raw = w.p + w.data_off + (tensor_bytes(&TENSORS[0]) + 31) / 32 * 32 +
                               (tensor_bytes(&TENSORS[1]) + 31) / 32 * 32;
    for (int h = 0; h < HEADS; h++)
        for (int j = 0; j < 2; j++)
            for (int i = 0; i < HD / 2; i++)
                assert_memory_equal(&q[(h * HD + j * HD / 2 + i) * (DIM / 32)], raw + (size_t)(h * HD + 2 * i + j) * 34,
                                    34);
    model_files_close(mf);
    model_config_release(&cfg);

    tokenizer *tok;
    struct tok_ids ids = {0};
    assert_int_equal(model_tokenizer_load(g_path, &tok, err), MODEL_OK);
    assert_int_equal(tokenizer_encode(tok, "hehe", 4, false, &ids, err), TEXT_OK);
    assert_int_equal(ids.n, 2);
    assert_int_equal(ids.ids[0], 256);
    free(ids.ids);
    tokenizer_free(tok);
    free(w.p);
}

/* ---- broken files ------------------------------------------------------- */

/* Each prefix of the file short of its end is refused. */
static void test_truncated(void **state)
{
    (void)state;
    struct file w;
    char err[MODEL_ERR_LEN];
    build(&w);
    for (size_t n = 0; n < w.n; n += n < w.data_off ? 1 : 61) {
        save(&w, n);
        enum model_status st = load_all(err);
        if (st == MODEL_OK)
            fail_msg("the file cut at byte %zu of %zu loaded", n, w.n);
        assert_true(strstr(err, g_path) != NULL);
    }
    free(w.p);
}

/* The file with bytes [off, off + size) set to v; the loaders' status. */
static enum model_status with(const struct file *w, size_t off, const void *v, size_t size, char *err)
{
    struct file c = *w;
    c.p = malloc(w->n);
    assert_non_null(c.p);
    memcpy(c.p, w->p, w->n);
    memcpy(c.p + off, v, size);
    save(&c, c.n);
    free(c.p);
    return load_all(err);
}

/* Every count and length set to huge values, every rank, dimension, type
 * and offset made wrong: an error each time, none a crash. */
static void test_fields(void **state)
{
    (void)state;
    struct file w;
    char err[MODEL_ERR_LEN];
    build(&w);
    static const uint64_t huge[] = {UINT64_MAX, UINT64_MAX / 2, (uint64_t)1 << 40, 1u << 24, 100000};
    for (int i = 0; i < w.n_f; i++) {
        const struct field *f = &w.f[i];
        if (f->size != 8 || strstr(f->what, "offset") || strstr(f->what, "ne["))
            continue;
        for (size_t k = 0; k < sizeof huge / sizeof huge[0]; k++) {
            if (with(&w, f->off, &huge[k], 8, err) == MODEL_OK)
                fail_msg("%s at byte %zu = %llu loaded", f->what, f->off, (unsigned long long)huge[k]);
        }
    }
    for (int i = 0; i < w.n_f; i++) {
        const struct field *f = &w.f[i];
        uint32_t v32;
        uint64_t v64, old64;
        enum model_status st = MODEL_OK;
        if (!strcmp(f->what, "tensor rank")) {
            v32 = 0;
            assert_int_not_equal(with(&w, f->off, &v32, 4, err), MODEL_OK);
            assert_non_null(strstr(err, "rank"));
            v32 = 5;
            st = with(&w, f->off, &v32, 4, err);
            assert_non_null(strstr(err, "rank"));
        } else if (strstr(f->what, "ne[")) {
            v64 = 0;
            assert_int_not_equal(with(&w, f->off, &v64, 8, err), MODEL_OK);
            assert_non_null(strstr(err, "ne["));
            v64 = (uint64_t)1 << 40;
            st = with(&w, f->off, &v64, 8, err);
        } else if (!strcmp(f->what, "tensor type")) {
            v32 = 2; /* Q4_0 */
            assert_int_equal(with(&w, f->off, &v32, 4, err), MODEL_EUNSUPPORTED);
            assert_non_null(strstr(err, "has unsupported type 2 (supported: "));
            v32 = 0xFFFFFFFF;
            st = with(&w, f->off, &v32, 4, err);
        } else if (!strcmp(f->what, "tensor offset")) {
            memcpy(&old64, w.p + f->off, 8);
            v64 = old64 + 1;
            assert_int_not_equal(with(&w, f->off, &v64, 8, err), MODEL_OK);
            assert_non_null(strstr(err, "alignment"));
            v64 = (uint64_t)1 << 50;
            assert_int_not_equal(with(&w, f->off, &v64, 8, err), MODEL_OK);
            assert_non_null(strstr(err, "data section"));
            if (old64 == 0)
                continue;
            v64 = old64 - 32; /* onto the tensor before it */
            st = with(&w, f->off, &v64, 8, err);
            assert_non_null(strstr(err, "overlap"));
        } else if (!strcmp(f->what, "f32 value")) {
            /* a hyperparameter that arithmetic and the config need finite */
            float bad = NAN;
            assert_int_equal(with(&w, f->off, &bad, 4, err), MODEL_EFORMAT);
            assert_non_null(strstr(err, "is not finite"));
            bad = INFINITY;
            st = with(&w, f->off, &bad, 4, err);
            assert_non_null(strstr(err, "is not finite"));
        } else if (!strcmp(f->what, "value type") || !strcmp(f->what, "array element type")) {
            v32 = 13;
            st = with(&w, f->off, &v32, 4, err);
        } else {
            continue;
        }
        if (st == MODEL_OK)
            fail_msg("%s at byte %zu made wrong loaded", f->what, f->off);
    }
    free(w.p);
}

/* The alignment, version and magic, and keys and tensors given twice. */
static void test_header(void **state)
{
    (void)state;
    struct file w;
    char err[MODEL_ERR_LEN];
    build(&w);
    const char *al = "general.alignment";
    unsigned char *p = memmem(w.p, w.n, al, strlen(al));
    assert_non_null(p);
    size_t val = (size_t)(p - w.p) + strlen(al) + 4;
    static const uint32_t bad_align[] = {0, 1, 4, 12, 48};
    for (size_t k = 0; k < sizeof bad_align / sizeof bad_align[0]; k++) {
        assert_int_not_equal(with(&w, val, &bad_align[k], 4, err), MODEL_OK);
        assert_non_null(strstr(err, "general.alignment"));
    }
    uint32_t v = 2;
    assert_int_equal(with(&w, 4, &v, 4, err), MODEL_EUNSUPPORTED);
    assert_non_null(strstr(err, "version 2"));
    assert_int_equal(with(&w, 0, "GGML", 4, err), MODEL_EFORMAT);
    assert_non_null(strstr(err, "magic"));
    /* a key given twice: "general.alignment" renamed to "llama.block_count"
     * (17 bytes each) */
    assert_int_equal(with(&w, (size_t)(p - w.p), "llama.block_count", 17, err), MODEL_EFORMAT);
    assert_non_null(strstr(err, "appears twice"));
    const char *t = "blk.0.attn_k.weight";
    p = memmem(w.p, w.n, t, strlen(t));
    assert_non_null(p);
    assert_int_equal(with(&w, (size_t)(p - w.p), "blk.0.attn_q.weight", strlen(t), err), MODEL_EFORMAT);
    assert_non_null(strstr(err, "twice"));
    /* a metadata value of the wrong type names its key */
    const char *k = "llama.block_count";
    p = memmem(w.p, w.n, k, strlen(k));
    v = GGUF_F32;
    assert_int_equal(with(&w, (size_t)(p - w.p) + strlen(k), &v, 4, err), MODEL_ECONFIG);
    assert_non_null(strstr(err, "llama.block_count"));
    free(w.p);
}

/* The loaders and model_weights_verify on the file with bytes [off, off +
 * size) set to v: the first failure's status. */
static enum model_status verify_with(const struct file *w, size_t off, const void *v, size_t size, char *err)
{
    enum model_status st = with(w, off, v, size, err);
    struct model_config cfg;
    struct model_weights wt;
    model_files *mf = NULL;
    if (st != MODEL_OK || (st = model_config_load(g_path, &cfg, err)) != MODEL_OK)
        return st;
    if ((st = model_files_open(g_path, &cfg, &mf, &wt, err)) == MODEL_OK)
        st = model_weights_verify(&cfg, &wt, err);
    model_files_close(mf);
    model_config_release(&cfg);
    return st;
}

/* Q4_K rows of the wrong size and with non-finite factors: an error naming
 * the tensor each time (and the row for the factors), never a crash. */
static void test_q4k_rows(void **state)
{
    (void)state;
    struct file w;
    char err[MODEL_ERR_LEN];
    build(&w);
    const char *down = "blk.0.ffn_down.weight", *gate = "blk.0.ffn_gate.weight";
    unsigned char *p = memmem(w.p, w.data_off, down, strlen(down));
    assert_non_null(p);
    size_t ne0 = (size_t)(p - w.p) + strlen(down) + 4, type = ne0 + 16;
    /* rows that are not whole super-blocks */
    static const uint64_t bad_ne0[] = {255, 32, 257, 128};
    for (size_t k = 0; k < sizeof bad_ne0 / sizeof bad_ne0[0]; k++) {
        assert_int_equal(with(&w, ne0, &bad_ne0[k], 8, err), MODEL_EFORMAT);
        assert_non_null(strstr(err, down));
        assert_non_null(strstr(err, "not whole Q4_K blocks of 256"));
    }
    /* rows of two super-blocks: more bytes than the tensor has room for
     * before the next one */
    uint64_t wide = 2 * FFN;
    assert_int_not_equal(with(&w, ne0, &wide, 8, err), MODEL_OK);
    assert_non_null(strstr(err, down));
    /* a matrix of 32-element rows declared Q4_K */
    p = memmem(w.p, w.data_off, gate, strlen(gate));
    assert_non_null(p);
    uint32_t q4k = GGML_TYPE_Q4_K;
    assert_int_equal(with(&w, (size_t)(p - w.p) + strlen(gate) + 4 + 16, &q4k, 4, err), MODEL_EFORMAT);
    assert_non_null(strstr(err, gate));
    /* down as Q8_0 with the Q4_K bytes: the size no longer matches the gap */
    uint32_t q8 = 8;
    assert_int_not_equal(with(&w, type, &q8, 4, err), MODEL_OK);
    assert_non_null(strstr(err, "ffn_down"));
    /* a non-finite d or dmin in a row: loads (the rows are mapped, not
     * read), refused by the scan with the tensor and the row */
    size_t data = data_of(&w, down), row = q4_k_row_bytes(FFN);
    assert_int_equal(verify_with(&w, data, &(uint16_t){0}, 2, err), MODEL_OK);
    static const uint16_t bad[] = {0x7C00, 0xFC00, 0x7E00, 0x7C01};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        int r = (int)(k * 9 % DIM);
        size_t at = data + (size_t)r * row + (k % 2 ? offsetof(struct q4_k_block, dmin) : 0);
        assert_int_equal(verify_with(&w, at, &bad[k], 2, err), MODEL_EFORMAT);
        assert_non_null(strstr(err, "model.layers.0.mlp.down_proj.weight"));
        char want[48];
        snprintf(want, sizeof want, "non-finite q4_k scale in row %d", r);
        assert_non_null(strstr(err, want));
    }
    free(w.p);
}

/* Random bytes of the header replaced, 500 times: whatever the loaders
 * say, they say it without a crash (ASan checks every read). */
static void test_flips(void **state)
{
    (void)state;
    struct file w;
    char err[MODEL_ERR_LEN];
    build(&w);
    uint64_t s = 0x9E3779B97F4A7C15u;
    int loaded = 0;
    for (int it = 0; it < 500; it++) {
        struct file c = w;
        c.p = malloc(w.n);
        assert_non_null(c.p);
        memcpy(c.p, w.p, w.n);
        for (int k = 0; k < 1 + it % 4; k++) {
            s = s * 6364136223846793005u + 1442695040888963407u;
            size_t at = (size_t)(s >> 33) % w.data_off;
            c.p[at] = (unsigned char)(s >> 20);
        }
        save(&c, c.n);
        loaded += load_all(err) == MODEL_OK;
        free(c.p);
    }
    print_message("%d of 500 altered files still loaded (bytes that change only values)\n", loaded);
    free(w.p);
}

/* ---- the tokenizer against tokenizer.json (tests/gguf.test.sh) ---------- */

static void same_ids(const tokenizer *a, const tokenizer *b, const char *text, size_t len, bool special)
{
    struct tok_ids x = {0}, y = {0};
    char err[TEXT_ERR_LEN];
    assert_int_equal(tokenizer_encode(a, text, len, special, &x, err), TEXT_OK);
    assert_int_equal(tokenizer_encode(b, text, len, special, &y, err), TEXT_OK);
    if (x.n != y.n || (x.n && memcmp(x.ids, y.ids, x.n * sizeof *x.ids)))
        fail_msg("\"%.*s\": %zu ids from tokenizer.json, %zu from GGUF (or different ids)", (int)(len > 60 ? 60 : len),
                 text, x.n, y.n);
    free(x.ids);
    free(y.ids);
}

static void test_tokenizer_vs_json(void **state)
{
    (void)state;
    const char *gguf = getenv("KVTIER_GGUF_TOK"), *dir = getenv("KVTIER_GGUF_TOK_DIR");
    tokenizer *a, *b;
    char err[MODEL_ERR_LEN];
    assert_int_equal(model_tokenizer_load(dir, &a, err), MODEL_OK);
    if (model_tokenizer_load(gguf, &b, err) != MODEL_OK)
        fail_msg("%s", err);
    assert_int_equal(tokenizer_vocab_size(a), tokenizer_vocab_size(b));
    assert_int_equal(tokenizer_bos_id(a), tokenizer_bos_id(b));
    assert_int_equal(tokenizer_eos_id(a), tokenizer_eos_id(b));
    const json_t *ta = tokenizer_chat_template(a), *tb = tokenizer_chat_template(b);
    assert_true(ta ? tb && json_equal(ta, tb) : !tb);
    FILE *f = fopen("model/builtin/validation.txt", "r");
    assert_non_null(f);
    char *line = NULL;
    size_t cap = 0, lines = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, f)) > 0) {
        same_ids(a, b, line, (size_t)n, lines % 2 == 0);
        lines++;
    }
    free(line);
    fclose(f);
    static const char *const extra[] = {"<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
                                        "<|begin_of_text|>x<|end_of_text|>", "x <s> and  two  spaces</s>",
                                        "<unk> and <0x41>"};
    for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++) {
        same_ids(a, b, extra[i], strlen(extra[i]), true);
        same_ids(a, b, extra[i], strlen(extra[i]), false);
    }
    /* the tokenizer oracle's corpus: whitespace runs, code, scripts, emoji */
    json_t *corpus = json_load_file("tests/tokenizer/corpus.json", 0, NULL);
    assert_true(json_is_array(corpus));
    size_t k;
    json_t *c;
    json_array_foreach(corpus, k, c) {
        same_ids(a, b, json_string_value(c), json_string_length(c), true);
        same_ids(a, b, json_string_value(c), json_string_length(c), false);
    }
    json_decref(corpus);
    for (int32_t id = 0; id < tokenizer_vocab_size(a); id++) {
        size_t la, lb;
        bool sa, sb;
        const char *pa = tokenizer_token_bytes(a, id, &la, &sa), *pb = tokenizer_token_bytes(b, id, &lb, &sb);
        if (!pa) /* an id tokenizer.json leaves unnamed: GGUF names every one */
            continue;
        assert_non_null(pb);
        assert_int_equal(la, lb);
        assert_memory_equal(pa, pb, la);
        if (sa != sb)
            fail_msg("token %d \"%.*s\": special %d from tokenizer.json, %d from GGUF", id, (int)la, pa, sa, sb);
    }
    print_message("%zu lines, %zu corpus cases and every token's bytes agree\n", lines, k);
    tokenizer_free(a);
    tokenizer_free(b);
}

int main(void)
{
    if (getenv("KVTIER_GGUF_TOK")) {
        const struct CMUnitTest tests[] = {cmocka_unit_test(test_tokenizer_vs_json)};
        return cmocka_run_group_tests(tests, NULL, NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_valid),   cmocka_unit_test(test_truncated), cmocka_unit_test(test_fields),
        cmocka_unit_test(test_header),  cmocka_unit_test(test_flips), cmocka_unit_test(test_q4k_rows),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
