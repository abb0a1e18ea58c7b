/* fuzz_kvfile.c - the KV safetensors file a session import uploads,
 * through kvfile_parse against a fixed small model: 2 layers, 1 kv head,
 * head_dim 2, a context of 16, vocabulary 100, layer 1 sliding with 3 rows
 * kept (a dynamic window of 4).
 *
 * Invariants: an error has a message; an accepted file has 1..15 tokens,
 * all in the vocabulary, and every layer's K and V lie wholly inside the
 * input, aligned to their element size, with the rows the model needs for
 * that many tokens; no allocation is sized by a declared number before it
 * is checked (libFuzzer's -malloc_limit_mb catches one that is). */
#include "model/kvfile.h"
#include "tests/fuzz/fuzz_util.h"

enum { LAYERS = 2, HEADS = 1, HEAD_DIM = 2, CTX = 16, VOCAB = 100, KEEP = 3 };

static int64_t rows(void *ctx, int layer, int64_t n)
{
    (void)ctx;
    return layer == 1 && n > KEEP ? KEEP : n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* an aligned copy, as the daemon's body buffer is */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf)
        return 0;
    memcpy(buf, data, size);
    struct kvfile_expect e = {.fingerprint = 0x0123456789abcdefull, .n_layers = LAYERS, .n_kv_heads = HEADS,
                              .head_dim = HEAD_DIM, .max_tokens = CTX - 1, .vocab_size = VOCAB, .rows = rows};
    struct kvfile f;
    char err[MODEL_ERR_LEN] = "";
    enum model_status st = kvfile_parse(buf, size, &e, &f, err);
    if (st != MODEL_OK) {
        FUZZ_CHECK(err[0], "status %d without a message", st);
    } else {
        FUZZ_CHECK(f.n_tokens >= 1 && f.n_tokens < CTX, "%lld tokens", (long long)f.n_tokens);
        for (int64_t i = 0; i < f.n_tokens; i++)
            FUZZ_CHECK(f.tokens[i] >= 0 && f.tokens[i] < VOCAB, "token %lld is %d", (long long)i, f.tokens[i]);
        size_t esz = be_dtype_size(f.dtype);
        FUZZ_CHECK(esz, "dtype %d", (int)f.dtype);
        for (int l = 0; l < LAYERS; l++) {
            size_t bytes = (size_t)HEADS * (size_t)rows(NULL, l, f.n_tokens) * HEAD_DIM * esz;
            const uint8_t *p[2] = {f.k[l], f.v[l]};
            for (int h = 0; h < 2; h++) {
                FUZZ_CHECK(p[h] >= buf + 8 && p[h] + bytes <= buf + size, "layer %d half %d outside the input", l, h);
                FUZZ_CHECK((uintptr_t)p[h] % esz == 0, "layer %d half %d unaligned", l, h);
            }
        }
        kvfile_release(&f);
    }
    free(buf);
    return 0;
}
