/* generate.c - the per-sequence generation logic (gen_seq) and, on top of
 * it, the single-sequence loop of the command-line tools; the daemon's
 * batched loop runs gen_seq too.
 */
#include "model/generate.h"
#include "model/sampler.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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


/* Whether id ends generation: one of the eos ids of config.json /
 * generation_config.json, or the tokenizer's own eos token. */
static bool is_eos(const struct model_config *c, const tokenizer *tok, int32_t id)
{
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_token_ids[i] == id)
            return true;
    return tok && id == tokenizer_eos_id(tok);
}

int gen_eos_ids(const struct model_config *c, const tokenizer *tok, int32_t *out)
{
    int n = 0;
    for (int i = 0; i < c->n_eos; i++)
        out[n++] = c->eos_token_ids[i];
    int32_t t = tokenizer_eos_id(tok);
    if (t >= 0 && !is_eos(c, NULL, t))
        out[n++] = t;
    return n;
}

enum model_status gen_seq_init(struct gen_seq *s, const struct model_config *c, const tokenizer *tok,
                               const struct gen_seq_params *p, const int32_t *prompt, size_t n)
{
    size_t room = n < (size_t)p->ctx ? (size_t)p->ctx - n : 0;
    size_t max_new = p->max_new > 0 ? (size_t)p->max_new : 0;
    *s = (struct gen_seq){.n_toks = n,
                          .n_prompt = n,
                          .text_cap = 256,
                          .max_new = (int)(max_new < room ? max_new : room),
                          .ignore_eos = p->ignore_eos,
                          .min_new = p->min_new,
                          .stops = p->stops,
                          .n_stops = p->n_stops,
                          .text_lock = p->text_lock,
                          .mc = c,
                          .tok = tok};
    s->toks = malloc((n + (size_t)s->max_new) * sizeof(*s->toks));
    s->text = malloc(s->text_cap);
    if (!s->toks || !s->text)
        return MODEL_ENOMEM;
    if (p->grammar) {
        s->gvocab = p->gvocab;
        s->gstate = malloc((1 + gram_vocab_depth(p->gvocab)) * sizeof(*s->gstate));
        s->allow = malloc((size_t)c->vocab_size * sizeof(*s->allow));
        s->gram_logits = malloc((size_t)c->vocab_size * sizeof(*s->gram_logits));
        if (!s->gstate || !s->allow || !s->gram_logits)
            return MODEL_ENOMEM;
        gram_start(p->grammar, s->gstate);
    }
    memcpy(s->toks, prompt, n * sizeof(*s->toks));
    return sampler_create(&p->sampling, c->vocab_size, &s->smp);
}

/* Whether the grammar takes id next with budget tokens left (id
 * included): as gram_mask would decide it for this one token. */
static bool grammar_allows(struct gen_seq *s, int32_t id, const int32_t *eos, int n_eos, int budget)
{
    for (int i = 0; i < n_eos; i++)
        if (eos[i] == id)
            return gram_can_end(s->gstate);
    size_t len;
    bool special;
    const char *p = tokenizer_token_bytes(s->tok, id, &len, &special);
    struct gram_state *t = s->gstate + 1;
    *t = *s->gstate;
    return p && len && !special && gram_feed(t, p, len) && (budget <= 0 || gram_min_close(t) <= (size_t)budget - 1);
}

/* Sampling under a grammar.  The token drawn from the unmasked logits is
 * kept when the grammar takes it; only otherwise is the whole vocabulary
 * masked and the draw made again.  For a plain temperature draw that is
 * exactly the masked distribution (a kept token has probability p, a
 * redraw adds (1 - Z) p / Z, Z the mass the mask keeps), and it spares the
 * mask on most steps; with top_k, top_p or min_p the filters see the
 * unmasked logits first. */
static int32_t sample_grammar(struct gen_seq *s, float *logits)
{
    int32_t eos[MODEL_MAX_EOS + 1];
    int n_eos = gen_eos_ids(s->mc, s->tok, eos);
    int V = s->mc->vocab_size, budget = s->max_new - s->gen;
    memcpy(s->gram_logits, logits, (size_t)V * sizeof(*logits));
    int32_t id = sampler_sample(s->smp, logits, s->toks, s->n_toks, s->n_prompt);
    if (grammar_allows(s, id, eos, n_eos, budget))
        return id;
    memcpy(logits, s->gram_logits, (size_t)V * sizeof(*logits));
    if (!gram_mask(s->gvocab, s->gstate, budget, eos, n_eos, s->allow, V, s->gstate + 1)) {
        s->gram_end = true; /* complete, and the model has no eos to say so */
        return id;
    }
    for (int i = 0; i < V; i++)
        if (!s->allow[i])
            logits[i] = -INFINITY;
    return sampler_sample(s->smp, logits, s->toks, s->n_toks, s->n_prompt);
}

int32_t gen_seq_sample(struct gen_seq *s, float *logits)
{
    if (s->gen < s->min_new && !s->ignore_eos) {
        int32_t eos[MODEL_MAX_EOS + 1];
        for (int i = gen_eos_ids(s->mc, s->tok, eos) - 1; i >= 0; i--)
            if (eos[i] >= 0 && eos[i] < s->mc->vocab_size)
                logits[eos[i]] = -INFINITY;
    }
    if (s->gstate)
        return sample_grammar(s, logits);
    return sampler_sample(s->smp, logits, s->toks, s->n_toks, s->n_prompt);
}

/* Grows the text buffer to hold need bytes, under text_lock: a reader on
 * another thread holds it while it reads. */
static bool text_reserve(struct gen_seq *s, size_t need)
{
    if (need <= s->text_cap)
        return true;
    size_t cap = s->text_cap * 2;
    while (cap < need)
        cap *= 2;
    if (s->text_lock)
        pthread_mutex_lock(s->text_lock);
    char *p = realloc(s->text, cap);
    if (p) {
        s->text = p;
        s->text_cap = cap;
    }
    if (s->text_lock)
        pthread_mutex_unlock(s->text_lock);
    return p != NULL;
}

/* Appends id's text and applies the stop strings.  False on out-of-memory. */
static bool append_text(struct gen_seq *s, int32_t id)
{
    /* a piece almost always fits this slack, so it is decoded once */
    if (!text_reserve(s, s->raw + 65))
        return false;
    size_t room = s->text_cap - s->raw - 1;
    size_t n = tokenizer_decode_stream(s->tok, &s->ts, id, true, s->text + s->raw, room);
    if (n > room) { /* one very long piece: nothing was written, make room and redo */
        if (!text_reserve(s, s->raw + n + 1))
            return false;
        n = tokenizer_decode_stream(s->tok, &s->ts, id, true, s->text + s->raw, s->text_cap - s->raw - 1);
    }
    s->raw += n;
    struct stop_matcher m = {s->stops, s->n_stops};
    size_t emit;
    if (stop_check(&m, s->text + s->scan, s->raw - s->scan, &emit)) {
        s->raw = s->vis = s->scan + emit;
        s->finish = GEN_FINISH_STOP;
    } else {
        /* text before vis cannot start a stop string, so matching resumes there */
        s->vis = s->scan = s->scan + emit;
    }
    return true;
}

enum model_status gen_seq_accept(struct gen_seq *s, int32_t id)
{
    enum model_status st = MODEL_OK;
    s->toks[s->n_toks++] = id;
    s->gen++;
    if (s->gram_end) {
        s->finish = GEN_FINISH_EOS;
    } else if (!s->ignore_eos && is_eos(s->mc, s->tok, id)) {
        s->finish = GEN_FINISH_EOS;
    } else {
        if (s->gstate) {
            size_t len;
            bool special;
            const char *p = tokenizer_token_bytes(s->tok, id, &len, &special);
            /* only a token the caller chose past the mask gets here: the
             * document cannot go on, so the sequence ends before it */
            if (!p || special || !gram_feed(s->gstate, p, len))
                s->gram_end = true;
        }
        if (s->gram_end)
            s->finish = GEN_FINISH_STOP;
        else if (!append_text(s, id))
            st = MODEL_ENOMEM;
        else if (s->gstate && gram_complete(s->gstate) && s->finish == GEN_FINISH_NONE)
            s->finish = GEN_FINISH_EOS; /* nothing may follow the document: eos would be the only token */
    }
    if (s->finish == GEN_FINISH_NONE && s->gen >= s->max_new)
        s->finish = GEN_FINISH_LENGTH;
    if (s->finish != GEN_FINISH_NONE && s->finish != GEN_FINISH_STOP) {
        /* a character the last tokens left incomplete ends the text as U+FFFD */
        if (st == MODEL_OK && text_reserve(s, s->raw + 4))
            s->raw += tokenizer_decode_flush(&s->ts, s->text + s->raw, s->text_cap - s->raw - 1);
        else
            st = MODEL_ENOMEM;
        s->vis = s->raw; /* text held back for a stop string that can no longer come */
    }
    return st;
}

void gen_seq_end(struct gen_seq *s)
{
    sampler_free(s->smp);
    s->smp = NULL;
    free(s->gstate);
    free(s->allow);
    free(s->gram_logits);
    s->gstate = NULL;
    s->allow = NULL;
    s->gram_logits = NULL;
}

void gen_seq_free(struct gen_seq *s)
{
    gen_seq_end(s);
    free(s->toks);
    free(s->text);
    memset(s, 0, sizeof(*s));
}

/* One forward step: feeds tokens[0..n) to seq and leaves the last row's
 * logits in logits.  Without a cache the whole history is recomputed on a
 * fresh sequence each step (HF use_cache=False). */
static enum model_status step(model *m, kv_store *store, kv_seq **seq, const struct gen_params *p,
                              const int32_t *hist, size_t n_hist, size_t n_new, float *logits)
{
    if (!p->use_cache) {
        kv_seq_free(*seq);
        *seq = NULL;
        enum tier_status ts = kv_seq_create(store, p->kv, seq);
        if (ts != TIER_OK)
            return model_from_tier(ts);
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
    struct gen_seq_params gp = {.sampling = p->sampling,
                                .max_new = p->max_new_tokens > 0 ? p->max_new_tokens : c->max_position_embeddings,
                                .ctx = c->max_position_embeddings,
                                .ignore_eos = p->ignore_eos,
                                .stops = p->stops,
                                .n_stops = p->n_stops};
    struct gen_seq *gs = &res->seq;
    kv_seq *seq = NULL;
    float *logits = malloc((size_t)c->vocab_size * sizeof(float));
    enum model_status st = gen_seq_init(gs, c, tok, &gp, prompt, n);
    if (st == MODEL_OK && !logits)
        st = MODEL_ENOMEM;
    if (st != MODEL_OK) {
        snprintf(err, MODEL_ERR_LEN, "%s", st == MODEL_EINVAL ? "invalid sampling parameters" : "out of memory");
        goto out;
    }
    enum tier_status ts = kv_seq_create(store, p->kv, &seq);
    if (ts != TIER_OK) { /* p->kv may name a strategy the model refuses: the store says why */
        st = model_from_tier(ts);
        snprintf(err, MODEL_ERR_LEN, "%s", *kv_store_errmsg(store) ? kv_store_errmsg(store) : "out of memory");
        goto out;
    }

    double t0 = clock_ms();
    st = step(m, store, &seq, p, gs->toks, n, n, logits);
    res->prefill_ms = clock_ms() - t0;
    double t1 = clock_ms();
    size_t shown = 0;
    while (st == MODEL_OK) {
        if (p->on_logits)
            p->on_logits(p->logits_ud, logits, c->vocab_size);
        st = gen_seq_accept(gs, gen_seq_sample(gs, logits));
        if (st != MODEL_OK)
            break;
        bool more = gs->vis == shown || !cb || cb(ud, gs->text + shown, gs->vis - shown);
        shown = gs->vis;
        if (gs->finish != GEN_FINISH_NONE)
            break;
        if (!more) {
            gs->finish = GEN_FINISH_CALLBACK;
            break;
        }
        st = step(m, store, &seq, p, gs->toks, gs->n_toks, 1, logits);
    }
    res->decode_ms = clock_ms() - t1;
    if (st != MODEL_OK)
        snprintf(err, MODEL_ERR_LEN, "generation step %d: %s", gs->gen, model_strerror(st));
out:
    gen_seq_end(gs);
    kv_seq_free(seq);
    free(logits);
    return st;
}

double gen_log_sum_exp(const float *x, int n)
{
    float mx = x[0];
    for (int i = 1; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += exp((double)x[i] - mx);
    return mx + log(sum);
}
