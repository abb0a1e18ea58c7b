/* fuzz_gguf.c - a GGUF file (model/gguf.c) through every loader a
 * `--model FILE.gguf` path takes: model_config_load, model_files_open
 * against the config it gave, model_tokenizer_load.
 *
 * Input: the file.
 *
 * Invariants: an error has a message naming the file; an accepted config
 * binds weights whose every byte can be read (a tensor running past the
 * map faults); an accepted tokenizer encodes a fixed text to ids inside
 * its vocabulary; nothing is allocated from a declared count before it is
 * checked against the file (libFuzzer's -malloc_limit_mb catches one). */
#include "model/gguf.h"
#include "model/runtime.h"
#include "tests/fuzz/fuzz_util.h"

static void check_mat(const struct model_mat *m, const char *what)
{
    FUZZ_CHECK(m->data && m->rows > 0 && m->cols > 0, "%s: %dx%d", what, m->rows, m->cols);
    size_t row = be_row_bytes(m->dtype, (size_t)m->cols);
    FUZZ_CHECK(row > 0, "%s: dtype %d", what, (int)m->dtype);
    fuzz_touch(m->data, row * (size_t)m->rows);
}

static void check_weights(const struct model_weights *w, const struct model_config *c)
{
    check_mat(&w->tok_embed, "embed");
    FUZZ_CHECK(be_dtype_size(w->tok_embed.dtype) > 0, "a block-format embedding reached be_embed");
    check_mat(&w->lm_head, "lm_head");
    fuzz_touch(w->final_norm, (size_t)c->hidden_size * 4);
    for (int l = 0; l < c->n_layers; l++) {
        const struct model_layer *L = &w->layers[l];
        const struct model_mat *m[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof m / sizeof m[0]; i++)
            check_mat(m[i], "layer matrix");
        fuzz_touch(L->attn_norm, (size_t)c->hidden_size * 4);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 1 << 17) /* the seeds: a 300-token vocabulary and one layer */
        return 0;
    const char *dir = fuzz_dir("gguf");
    char path[256];
    snprintf(path, sizeof path, "%s/m.gguf", dir);
    fuzz_write(dir, "m.gguf", data, size);
    char err[MODEL_ERR_LEN];
    err[0] = '\0';
    struct model_config cfg;
    enum model_status st = model_config_load(path, &cfg, err);
    if (st == MODEL_OK) {
        model_files *mf = NULL;
        struct model_weights w;
        st = model_files_open(path, &cfg, &mf, &w, err);
        if (st == MODEL_OK)
            check_weights(&w, &cfg);
        else
            FUZZ_CHECK(!mf, "files left after an error");
        model_files_close(mf);
        model_config_release(&cfg);
    }
    if (st != MODEL_OK)
        FUZZ_CHECK(strstr(err, path) || strstr(err, "out of memory") || strstr(err, "tensor "),
                   "message \"%s\" names no file", err);
    tokenizer *tok = NULL;
    err[0] = '\0';
    st = model_tokenizer_load(path, &tok, err);
    if (st == MODEL_OK) {
        struct tok_ids ids = {0};
        if (tokenizer_encode(tok, "Hello world <s>", 15, true, &ids, err) == TEXT_OK)
            for (size_t i = 0; i < ids.n; i++)
                FUZZ_CHECK(ids.ids[i] >= 0 && ids.ids[i] < tokenizer_vocab_size(tok), "id %d", ids.ids[i]);
        free(ids.ids);
    } else {
        FUZZ_CHECK(err[0], "no message");
    }
    tokenizer_free(tok);
    return 0;
}
