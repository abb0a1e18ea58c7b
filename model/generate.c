/* generate.c - the single-sequence generation loop used by the command-line
 * tools (the daemon runs its own batched loop with the same sampler).
 */
#include "model/generate.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util/clock.h"

enum model_status model_from_text(enum text_status st)
{
    switch (st) {
    case TEXT_OK: return MODEL_OK;
    case TEXT_ENOENT: return MODEL_ENOENT;
    case TEXT_EFORMAT: return MODEL_EFORMAT;
    case TEXT_EUNSUPPORTED: return MODEL_EUNSUPPORTED;
    case TEXT_ENOMEM: return MODEL_ENOMEM;
    case TEXT_EIO: return MODEL_EIO;
    case TEXT_EINVAL: return MODEL_EINVAL;
    }
    return MODEL_EINVAL;
}

void gen_params_default(struct gen_params *p)
{
    *p = (struct gen_params){.max_new_tokens = 0, .use_cache = true};
    sampler_params_default(&p->sampling);
}

bool gen_is_eos(const struct model_config *c, const tokenizer *tok, int32_t id)
{
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_token_ids[i] == id)
            return true;
    return id == tokenizer_eos_id(tok);
}

/* Text decoded but not yet emitted, held back while it could still turn
 * into a stop string. */
struct pending_text {
    char *buf;
    size_t len, cap;
};

static bool text_append(struct pending_text *t, const char *s, size_t n)
{
    if (t->len + n + 1 > t->cap) {
        size_t cap = t->cap ? t->cap : 256;
        while (cap < t->len + n + 1)
            cap *= 2;
        char *b = realloc(t->buf, cap);
        if (!b)
            return false;
        t->buf = b;
        t->cap = cap;
    }
    memcpy(t->buf + t->len, s, n);
    t->len += n;
    return true;
}

/* One forward step: feeds tokens[0..n) to seq and leaves the last row's
 * logits in logits.  Without a cache the whole history is recomputed on a
 * fresh sequence each step (HF use_cache=False). */
static enum model_status step(model *m, kv_store *store, kv_seq **seq, bool use_cache, const int32_t *hist,
                              size_t n_hist, size_t n_new, float *logits)
{
    if (!use_cache) {
        kv_seq_free(*seq);
        *seq = NULL;
        enum tier_status ts = kv_seq_create(store, NULL, seq);
        if (ts != TIER_OK)
            return ts == TIER_ENOMEM_HOST ? MODEL_ENOMEM : MODEL_EBACKEND;
        n_new = n_hist;
    }
    struct fw_seq f = {.kv = *seq, .tokens = hist + n_hist - n_new, .n_tokens = (int)n_new, .logits = logits};
    return model_forward(m, &f, 1);
}

enum model_status generate(model *m, const tokenizer *tok, kv_store *store, const int32_t *prompt, size_t n,
                           const struct gen_params *p, gen_text_cb cb, void *ud, struct gen_result *res, char *err)
{
    const struct model_config *c = model_get_config(m);
    char scratch[MODEL_ERR_LEN];
    if (!err)
        err = scratch;
    memset(res, 0, sizeof(*res));
    if (n == 0 || n >= (size_t)c->max_position_embeddings) {
        snprintf(err, MODEL_ERR_LEN, "prompt: %zu tokens; must be between 1 and %d", n,
                 c->max_position_embeddings - 1);
        return MODEL_EINVAL;
    }
    for (size_t i = 0; i < n; i++) {
        if (prompt[i] < 0 || prompt[i] >= c->vocab_size) {
            snprintf(err, MODEL_ERR_LEN, "prompt: token id %d at position %zu is outside the vocabulary [0, %d)",
                     prompt[i], i, c->vocab_size);
            return MODEL_EINVAL;
        }
    }
    size_t max_new = (size_t)c->max_position_embeddings - n;
    if (p->max_new_tokens > 0 && (size_t)p->max_new_tokens < max_new)
        max_new = (size_t)p->max_new_tokens;

    struct tok_ids hist = {0};
    struct pending_text text = {0};
    struct tok_stream ds = {0};
    struct stop_matcher sm = {.stops = p->stops, .n_stops = p->n_stops};
    sampler *smp = NULL;
    kv_seq *seq = NULL;
    float *logits = malloc((size_t)c->vocab_size * sizeof(float));
    enum model_status st = sampler_create(&p->sampling, c->vocab_size, &smp);
    if (st == MODEL_OK && (!logits || kv_seq_create(store, NULL, &seq) != TIER_OK))
        st = MODEL_ENOMEM;
    for (size_t i = 0; st == MODEL_OK && i < n; i++)
        if (tok_ids_push(&hist, prompt[i]) != TEXT_OK)
            st = MODEL_ENOMEM;
    if (st != MODEL_OK) {
        snprintf(err, MODEL_ERR_LEN, "%s", st == MODEL_EINVAL ? "invalid sampling parameters" : "out of memory");
        goto out;
    }

    double t0 = clock_ms();
    st = step(m, store, &seq, p->use_cache, hist.ids, hist.n, n, logits);
    res->prefill_ms = clock_ms() - t0;
    res->finish = GEN_FINISH_LENGTH;
    double t1 = clock_ms();
    for (size_t i = 0; st == MODEL_OK && i < max_new; i++) {
        if (p->on_logits)
            p->on_logits(p->logits_ud, logits, c->vocab_size);
        int32_t id = sampler_sample(smp, logits, hist.ids, hist.n);
        if (tok_ids_push(&hist, id) != TEXT_OK || tok_ids_push(&res->tokens, id) != TEXT_OK) {
            st = MODEL_ENOMEM;
            break;
        }
        if (!p->ignore_eos && gen_is_eos(c, tok, id)) {
            res->finish = GEN_FINISH_EOS;
            break;
        }
        char piece[1024];
        size_t len = tokenizer_decode_stream(tok, &ds, id, true, piece, sizeof(piece));
        if (len > sizeof(piece)) {
            st = MODEL_EINVAL; /* a single vocabulary entry over 1 KiB: a broken tokenizer */
            break;
        }
        if (!text_append(&text, piece, len)) {
            st = MODEL_ENOMEM;
            break;
        }
        size_t emit;
        bool stop = stop_check(&sm, text.buf, text.len, &emit);
        if (emit && cb && !cb(ud, text.buf, emit)) {
            res->finish = GEN_FINISH_CALLBACK;
            break;
        }
        memmove(text.buf, text.buf + emit, text.len - emit);
        text.len -= emit;
        if (stop) {
            res->finish = GEN_FINISH_STOP;
            text.len = 0;
            break;
        }
        if (i + 1 < max_new)
            st = step(m, store, &seq, p->use_cache, hist.ids, hist.n, 1, logits);
    }
    if (st == MODEL_OK && text.len && cb && res->finish != GEN_FINISH_CALLBACK)
        cb(ud, text.buf, text.len); /* held-back text that never became a stop string */
    res->decode_ms = clock_ms() - t1;
    if (st != MODEL_OK)
        snprintf(err, MODEL_ERR_LEN, "generation step %zu: %s", res->tokens.n, model_strerror(st));
out:
    kv_seq_free(seq);
    sampler_free(smp);
    free(logits);
    free(hist.ids);
    free(text.buf);
    return st;
}
