/* fuzz_kvfile.c - the KV safetensors file a session import uploads,
 * through kvfile_parse against a fixed small model: 2 layers, 1 kv head,
 * head_dim 2, a context of 16, vocabulary 100, layer 1 sliding with 3 rows
 * kept (a dynamic window of 4).
 *
 * Raw quantized files name one of two formats of 4-token blocks: "q4"
 * (4-bit affine, per-token groups of 2) or "fp8".  Each input is parsed
 * three times: for that model, for an encoder-decoder one of the same
 * geometry (an encoder input of up to 15 ids, each layer's cross K and V),
 * and for a state-space model of 2 layers (3 channels, state 2, conv
 * kernel 3) with a checkpoint every 4 tokens.
 *
 * Invariants: an error has a message; an accepted file has 1..15 tokens,
 * all in the vocabulary, and every layer's K and V lie wholly inside the
 * input, aligned to their element size, with the rows the model needs for
 * that many tokens, and an encoder-decoder file's input and cross K and V
 * likewise (a raw file: lo <= nq <= tokens, its blocks cover
 * [first*T, nq), the residual is the rest, and the codes, parameters and
 * residual of that many blocks and rows lie inside the input, aligned;
 * a state file: its state and no K or V, and its checkpoints at ascending
 * multiples of 4 within its tokens, each a whole state);
 * no allocation is sized by a declared number before it is checked
 * (libFuzzer's -malloc_limit_mb catches one that is). */
#include "model/kvfile.h"
#include "tests/fuzz/fuzz_util.h"

enum {
    LAYERS = 2,
    HEADS = 1,
    HEAD_DIM = 2,
    CTX = 16,
    VOCAB = 100,
    KEEP = 3,
    T = 4,
    INNER = 3,
    NSTATE = 2,
    KCONV = 3,
    CKPT = 4
};

static int64_t rows(void *ctx, int layer, int64_t n)
{
    (void)ctx;
    return layer == 1 && n > KEEP ? KEEP : n;
}

static enum model_status quant(void *ctx, const char *quantization, struct be_kvq_format *f, char *err)
{
    (void)ctx;
    /* per half: T*D*nbits/8 bytes of codes, then (T/gt)*(D/gd) f16 pairs */
    static const struct be_kvq_format q4 = {.kind = BE_KVQ_AFFINE_SHIFT, .nbits = 4, .block_tokens = T,
                                            .n_kv_heads = HEADS, .head_dim = HEAD_DIM,
                                            .k = {.gt = 1, .gd = 2, .codes = 0, .params = 4},
                                            .v = {.gt = 1, .gd = 2, .codes = 20, .params = 24}, .block_bytes = 40},
                                     fp8 = {.kind = BE_KVQ_E4M3, .nbits = 8, .block_tokens = T,
                                            .n_kv_heads = HEADS, .head_dim = HEAD_DIM,
                                            .k = {.codes = 0}, .v = {.codes = 8}, .block_bytes = 16};
    if (strcmp(quantization, "q4") && strcmp(quantization, "fp8")) {
        snprintf(err, MODEL_ERR_LEN, "not q4 or fp8");
        return MODEL_EINVAL;
    }
    *f = strcmp(quantization, "q4") ? fp8 : q4;
    return MODEL_OK;
}

/* p[0, bytes) inside buf[0, size) and aligned to a. */
static bool inside(const uint8_t *buf, size_t size, const void *p, size_t bytes, size_t a)
{
    const uint8_t *x = p;
    return x >= buf + 8 && x <= buf + size && bytes <= (size_t)(buf + size - x) && (uintptr_t)x % a == 0;
}

static void check_raw(const uint8_t *buf, size_t size, const struct kvfile *f)
{
    bool e4m3 = f->fmt.kind == BE_KVQ_E4M3;
    size_t codes = (size_t)HEADS * T * HEAD_DIM * (size_t)f->fmt.nbits / 8, params = e4m3 ? 0 : HEADS * T * 4;
    for (int l = 0; l < LAYERS; l++) {
        const struct kvfile_qlayer *q = &f->q[l];
        FUZZ_CHECK(q->lo >= q->first_block * T && q->lo <= q->nq && q->nq <= f->n_tokens &&
                       q->residual == f->n_tokens - q->nq && q->n_blocks >= 0 &&
                       (q->first_block + q->n_blocks) * T >= q->nq &&
                       (q->first_block + q->n_blocks - 1) * T < q->nq + (q->n_blocks ? 0 : T),
                   "layer %d: lo %lld nq %lld first %lld blocks %d residual %lld", l, (long long)q->lo,
                   (long long)q->nq, (long long)q->first_block, q->n_blocks, (long long)q->residual);
        for (int h = 0; h < 2; h++) {
            FUZZ_CHECK(inside(buf, size, q->codes[h], (size_t)q->n_blocks * codes, 1), "layer %d codes", l);
            FUZZ_CHECK(e4m3 ? !q->params[h] : inside(buf, size, q->params[h], (size_t)q->n_blocks * params, 2),
                       "layer %d params", l);
            FUZZ_CHECK(inside(buf, size, q->res[h], (size_t)q->residual * HEADS * HEAD_DIM * 4, 4),
                       "layer %d residual", l);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* an aligned copy, as the daemon's body buffer is */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf)
        return 0;
    memcpy(buf, data, size);
    for (int kind = 0; kind < 3; kind++) {
        bool enc = kind == 1, state = kind == 2;
        struct kvfile_expect e = {.fingerprint = 0x0123456789abcdefull, .n_layers = LAYERS, .n_kv_heads = HEADS,
                                  .head_dim = HEAD_DIM, .max_tokens = CTX - 1, .vocab_size = VOCAB, .rows = rows,
                                  .max_input = enc ? CTX - 1 : 0, .quant = kind ? NULL : quant,
                                  .ssm_inner = state ? INNER : 0, .ssm_state = state ? NSTATE : 0,
                                  .ssm_conv = state ? KCONV : 0, .ssm_ckpt_interval = state ? CKPT : 0};
        struct kvfile f;
        char err[MODEL_ERR_LEN] = "";
        enum model_status st = kvfile_parse(buf, size, &e, &f, err);
        if (st != MODEL_OK) {
            FUZZ_CHECK(err[0], "status %d without a message", st);
        } else {
            FUZZ_CHECK(enc ? f.n_input >= 1 && f.n_input < CTX && !f.q : !f.n_input && !f.input && !f.ck,
                       "%lld input tokens", (long long)f.n_input);
            for (int64_t i = 0; i < f.n_input; i++)
                FUZZ_CHECK(f.input[i] >= 0 && f.input[i] < VOCAB, "input %lld is %d", (long long)i, f.input[i]);
            FUZZ_CHECK(f.n_tokens >= 1 && f.n_tokens < CTX, "%lld tokens", (long long)f.n_tokens);
            for (int64_t i = 0; i < f.n_tokens; i++)
                FUZZ_CHECK(f.tokens[i] >= 0 && f.tokens[i] < VOCAB, "token %lld is %d", (long long)i, f.tokens[i]);
            size_t esz = be_dtype_size(f.dtype);
            FUZZ_CHECK(esz, "dtype %d", (int)f.dtype);
            FUZZ_CHECK(state == !!f.state && (!state || (!f.k && !f.q && f.dtype == BE_F32)),
                       "a state file's state and nothing else");
            FUZZ_CHECK(f.n_ckpt >= 0 && f.n_ckpt <= f.n_tokens / CKPT && (state || !f.n_ckpt) &&
                           !f.ckpt_pos == !f.n_ckpt,
                       "%d checkpoints of %lld tokens", f.n_ckpt, (long long)f.n_tokens);
            for (int i = 0; i < f.n_ckpt; i++)
                FUZZ_CHECK(f.ckpt_pos[i] > (i ? f.ckpt_pos[i - 1] : 0) && f.ckpt_pos[i] <= f.n_tokens &&
                               f.ckpt_pos[i] % CKPT == 0,
                           "checkpoint %d at %lld", i, (long long)f.ckpt_pos[i]);
            volatile float sum = 0; /* every float of the gathered states is there (ASan) */
            for (size_t i = 0; state && i < (1 + (size_t)f.n_ckpt) * LAYERS * INNER * (KCONV - 1 + NSTATE); i++)
                sum += f.state[i];
            if (f.q)
                check_raw(buf, size, &f);
            for (int l = 0; l < LAYERS && !f.q && !state; l++) {
                size_t bytes = (size_t)HEADS * (size_t)rows(NULL, l, f.n_tokens) * HEAD_DIM * esz;
                size_t cross = (size_t)HEADS * (size_t)f.n_input * HEAD_DIM * esz;
                const uint8_t *p[4] = {f.k[l], f.v[l], enc ? f.ck[l] : NULL, enc ? f.cv[l] : NULL};
                for (int h = 0; h < (enc ? 4 : 2); h++) {
                    FUZZ_CHECK(p[h] >= buf + 8 && p[h] + (h < 2 ? bytes : cross) <= buf + size,
                               "layer %d part %d outside the input", l, h);
                    FUZZ_CHECK((uintptr_t)p[h] % esz == 0, "layer %d part %d unaligned", l, h);
                }
            }
            kvfile_release(&f);
        }
    }
    free(buf);
    return 0;
}
