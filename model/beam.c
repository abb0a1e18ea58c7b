/* beam.c - beam search decisions and the KV permutation (beam.h). */
#include "model/beam.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/generate.h"

/* HF's "very large negative" mark for candidates that may not be chosen:
 * added, not assigned, so that the order among marked ones is kept. */
#define BEAM_NEG 1.0e9f

struct cand {
    float lp;   /* accumulated log-probability */
    int beam;
    int32_t tok;
};

struct beam_search {
    struct beam_params p;
    int32_t eos[MODEL_MAX_EOS + 1];
    int vocab, k;
    size_t n_prompt;
    int n_run, gen;
    int32_t **run, **spare; /* [num_beams] prompt + max_new ids each */
    float *score, *spare_score;
    /* the finished hypotheses of each group, best first: group g's are
     * the slots [g * gs, g * gs + n_fin[g]) */
    int32_t **fin;          /* [num_beams] max_new ids each */
    float *fin_score;
    int *fin_len;
    bool *fin_eos;
    int *n_fin;             /* [groups] */
    bool heur_unsat, done;
    /* group (diverse) beam search */
    int groups, gs;         /* groups of gs beams (1 group of num_beams: plain) */
    bool *gdone;            /* [groups] */
    int32_t *cur_tok;       /* [num_beams] the ids the groups chose this step */
    int *order;             /* [num_beams] the results: slots, best first */
    int n_order;
    float *lp;              /* [vocab] one beam's log-probabilities */
    struct cand *cands;     /* [k] the best candidates, best first */
    int n_cands;
};

static bool is_eos(const beam_search *b, int32_t id)
{
    for (int i = 0; i < b->p.n_eos; i++)
        if (b->eos[i] == id)
            return true;
    return false;
}

static int32_t **rows(int n, size_t len)
{
    int32_t **r = calloc((size_t)n, sizeof(*r));
    for (int i = 0; r && i < n; i++) {
        if (!(r[i] = malloc(len * sizeof(**r)))) {
            for (int j = 0; j < i; j++)
                free(r[j]);
            free(r);
            return NULL;
        }
    }
    return r;
}

static void rows_free(int32_t **r, int n)
{
    for (int i = 0; r && i < n; i++)
        free(r[i]);
    free(r);
}

void beam_free(beam_search *b)
{
    if (!b)
        return;
    int n = b->p.num_beams;
    rows_free(b->run, n);
    rows_free(b->spare, n);
    rows_free(b->fin, n);
    free(b->n_fin);
    free(b->gdone);
    free(b->cur_tok);
    free(b->order);
    free(b->score);
    free(b->spare_score);
    free(b->fin_score);
    free(b->fin_len);
    free(b->fin_eos);
    free(b->lp);
    free(b->cands);
    free(b);
}

enum model_status beam_create(const struct beam_params *p, int vocab, const int32_t *prompt, size_t n_prompt,
                              beam_search **out, char *err)
{
    *out = NULL;
    const char *bad = NULL;
    if (p->num_beams < 2 || p->num_beams > BEAM_MAX_BEAMS)
        bad = "num_beams must be between 2 and 256";
    else if (p->num_return < 1 || p->num_return > p->num_beams)
        bad = "num_return_sequences must be between 1 and num_beams";
    else if (p->max_new < 1 || p->min_new < 0 || p->no_repeat_ngram < 0)
        bad = "max_tokens, min_tokens and no_repeat_ngram_size must not be negative";
    else if (p->n_eos < 0 || p->n_eos > MODEL_MAX_EOS + 1)
        bad = "too many eos ids";
    else if (!isfinite(p->length_penalty) || n_prompt < 1)
        bad = "length_penalty must be finite";
    else if (p->num_groups > 1 && (p->num_beams % p->num_groups || !(p->diversity_penalty > 0) ||
                                   !isfinite(p->diversity_penalty)))
        bad = "num_beam_groups must divide num_beams, with diversity_penalty > 0";
    if (bad) {
        snprintf(err, MODEL_ERR_LEN, "%s", bad);
        return MODEL_EINVAL;
    }
    int groups = p->num_groups > 1 ? p->num_groups : 1, gs = p->num_beams / groups;
    int k = (p->n_eos + 1 > 2 ? p->n_eos + 1 : 2) * gs;
    /* the first beam must offer K finite candidates even when the eos ids
     * and an n-gram's ids are banned (see beam.h) */
    if ((long long)vocab < (long long)k + p->n_eos + 1) {
        snprintf(err, MODEL_ERR_LEN, "num_beams %d needs %d candidates per step; the vocabulary has %d tokens",
                 p->num_beams, k, vocab);
        return MODEL_EINVAL;
    }
    beam_search *b = calloc(1, sizeof(*b));
    if (!b)
        return MODEL_ENOMEM;
    b->p = *p;
    memcpy(b->eos, p->eos, (size_t)p->n_eos * sizeof(*b->eos));
    b->p.eos = b->eos;
    b->vocab = vocab;
    b->k = k;
    b->groups = groups;
    b->gs = gs;
    b->n_prompt = n_prompt;
    b->n_run = 1;
    b->heur_unsat = true;
    int n = p->num_beams;
    size_t len = n_prompt + (size_t)p->max_new;
    b->run = rows(n, len);
    b->spare = rows(n, len);
    b->fin = rows(n, (size_t)p->max_new);
    b->score = calloc((size_t)n, sizeof(*b->score));
    b->spare_score = calloc((size_t)n, sizeof(*b->spare_score));
    b->fin_score = calloc((size_t)n, sizeof(*b->fin_score));
    b->fin_len = calloc((size_t)n, sizeof(*b->fin_len));
    b->fin_eos = calloc((size_t)n, sizeof(*b->fin_eos));
    b->lp = malloc((size_t)vocab * sizeof(*b->lp));
    b->cands = malloc((size_t)k * sizeof(*b->cands));
    b->n_fin = calloc((size_t)groups, sizeof(*b->n_fin));
    b->gdone = calloc((size_t)groups, sizeof(*b->gdone));
    b->cur_tok = calloc((size_t)n, sizeof(*b->cur_tok));
    b->order = calloc((size_t)n, sizeof(*b->order));
    if (!b->run || !b->spare || !b->fin || !b->score || !b->spare_score || !b->fin_score || !b->fin_len ||
        !b->fin_eos || !b->lp || !b->cands || !b->n_fin || !b->gdone || !b->cur_tok || !b->order) {
        beam_free(b);
        return MODEL_ENOMEM;
    }
    memcpy(b->run[0], prompt, n_prompt * sizeof(*prompt));
    /* groups: every group's first beam starts from the prompt, the others
     * score -1e9 (HF); all are beam 0 until the first step */
    for (int i = 0; i < n && groups > 1; i++)
        b->score[i] = i % gs ? -BEAM_NEG : 0;
    *out = b;
    return MODEL_OK;
}

int beam_running(const beam_search *b)
{
    return b->done ? 0 : b->n_run;
}

const int32_t *beam_tokens(const beam_search *b, int i, size_t *n)
{
    *n = b->n_prompt + (size_t)b->gen;
    return b->run[i];
}

int beam_generated(const beam_search *b)
{
    return b->gen;
}

int beam_results(const beam_search *b)
{
    return b->n_order < b->p.num_return ? b->n_order : b->p.num_return;
}

struct beam_hyp beam_result(const beam_search *b, int i)
{
    int s = b->order[i];
    return (struct beam_hyp){b->fin_score[s], b->fin_len[s], b->fin[s], b->fin_eos[s]};
}

/* The search ended: every group's hypotheses, best first (a plain search
 * has one group, already in order).  Group search's equal scores come
 * last-added first, as HF pops them from the end of a stable sort of the
 * groups' lists one after the other. */
static void beam_order(beam_search *b)
{
    b->n_order = 0;
    for (int g = 0; g < b->groups; g++) {
        for (int i = 0; i < b->n_fin[g]; i++) {
            int s = g * b->gs + i, at = b->n_order++;
            while (at > 0 && (b->fin_score[s] > b->fin_score[b->order[at - 1]] ||
                              (b->groups > 1 && b->fin_score[s] == b->fin_score[b->order[at - 1]]))) {
                b->order[at] = b->order[at - 1];
                at--;
            }
            b->order[at] = s;
        }
    }
}

/* log_softmax of x into b->lp, then the logits processors of beam.h. */
static void beam_logprobs(beam_search *b, const float *x, const int32_t *seq, size_t n)
{
    int V = b->vocab;
    float lse = (float)gen_log_sum_exp(x, V);
    for (int v = 0; v < V; v++)
        b->lp[v] = x[v] - lse;
    if (b->gen < b->p.min_new)
        for (int i = 0; i < b->p.n_eos; i++)
            b->lp[b->eos[i]] = -INFINITY;
    int ng = b->p.no_repeat_ngram;
    if (ng > 0 && n + 1 >= (size_t)ng) {
        /* every earlier n-gram whose first ng - 1 ids equal the last ng - 1 */
        const int32_t *tail = seq + n - (size_t)(ng - 1);
        for (size_t s = 0; s + (size_t)ng <= n; s++)
            if (!memcmp(seq + s, tail, (size_t)(ng - 1) * sizeof(*seq)))
                b->lp[seq[s + (size_t)ng - 1]] = -INFINITY;
    }
}

/* Whether candidate a ranks before b: higher score, then the lower flat
 * index (beam * vocab + token), as a stable top-k orders ties. */
static bool cand_before(const struct cand *a, const struct cand *c)
{
    if (a->lp != c->lp)
        return a->lp > c->lp;
    return a->beam != c->beam ? a->beam < c->beam : a->tok < c->tok;
}

/* Offers one candidate to the sorted top-K list. */
static void cand_offer(beam_search *b, struct cand c)
{
    int n = b->n_cands;
    if (n == b->k && !cand_before(&c, &b->cands[n - 1]))
        return;
    int i = n < b->k ? n++ : n - 1;
    while (i > 0 && cand_before(&c, &b->cands[i - 1])) {
        b->cands[i] = b->cands[i - 1];
        i--;
    }
    b->cands[i] = c;
    b->n_cands = n;
}

static void fin_copy(beam_search *b, int to, int from)
{
    b->fin[to] = b->fin[from];
    b->fin_score[to] = b->fin_score[from];
    b->fin_len[to] = b->fin_len[from];
    b->fin_eos[to] = b->fin_eos[from];
}

/* Adds a finished hypothesis to group g, keeping its best gs, best first,
 * equal scores in the order they came: the ids gen[0, n), then last unless
 * it is -1; eos: it ended in an eos id.  A better one arriving when the
 * group is full pushes out one of the equally worst: in a plain search the
 * last to come (HF merges the finished ones with a top-k that keeps those
 * it had first), in group search the first to come (BeamHypotheses.add
 * drops the lowest (score, position) of its list). */
static void fin_add(beam_search *b, int g, float score, const int32_t *gen, int n_gen, int32_t last, bool eos)
{
    int len = n_gen + (last >= 0);
    int n = b->n_fin[g], cap = b->gs, o = g * b->gs;
    if (n == cap && !(score > b->fin_score[o + n - 1]))
        return;
    if (n == cap) {
        int drop = o + n - 1;
        while (b->groups > 1 && drop > o && b->fin_score[drop - 1] == b->fin_score[o + n - 1])
            drop--;
        int32_t *freed = b->fin[drop];
        for (int k = drop; k < o + n - 1; k++)
            fin_copy(b, k, k + 1);
        b->fin[o + n - 1] = freed;
        n--;
    }
    int i = o + n++;
    int32_t *row = b->fin[i]; /* the free slot */
    while (i > o && score > b->fin_score[i - 1]) {
        fin_copy(b, i, i - 1);
        i--;
    }
    b->fin[i] = row;
    memcpy(row, gen, (size_t)n_gen * sizeof(*gen));
    if (last >= 0)
        row[n_gen] = last;
    b->fin_score[i] = score;
    b->fin_len[i] = len;
    b->fin_eos[i] = eos;
    b->n_fin[g] = n;
}

/* Whether group g is done, after a step from gen tokens whose best
 * candidate scored best (BeamHypotheses.is_done of the scorer that group
 * beam search keeps: its lengths exclude the new token). */
static bool group_is_done(const beam_search *b, int g, float best)
{
    if (b->n_fin[g] < b->gs)
        return false;
    if (b->p.early_stopping == BEAM_EARLY_TRUE)
        return true;
    int len = b->p.early_stopping == BEAM_EARLY_NEVER && b->p.length_penalty > 0 ? b->p.max_new : b->gen;
    float reach = (float)(best / pow((double)len, (double)b->p.length_penalty));
    return b->fin_score[g * b->gs + b->gs - 1] >= reach;
}

/* The beams built into spare (ids and scores) become the running ones. */
static void next_run(beam_search *b, int n)
{
    int32_t **t = b->run;
    b->run = b->spare;
    b->spare = t;
    float *f = b->score;
    b->score = b->spare_score;
    b->spare_score = f;
    b->n_run = n;
}

/* Group (diverse) beam search, one step: the groups choose in turn, each
 * among its own beams, its scores lowered by diversity_penalty for every
 * beam of an earlier group that chose the same id this step (Hamming
 * diversity).  As transformers' group beam search (BeamSearchScorer): a
 * candidate ending in eos among the group's first gs becomes a hypothesis
 * without the eos in its length (the first eos id is appended to it), a
 * group that is done continues with padding (the first eos id, score 0)
 * from its first beam, and at max_new every open group adds its running
 * beams; the results are the best of all groups. */
static enum model_status beam_step_groups(beam_search *b, const float *const *logits, int *parent, bool *done)
{
    int gs = b->gs, nb = b->p.num_beams;
    bool first = b->n_run == 1; /* every beam is still the prompt: beam 0 */
    size_t n = b->n_prompt + (size_t)b->gen;
    int32_t pad = b->p.n_eos ? b->eos[0] : 0;
    for (int g = 0; g < b->groups; g++) {
        int o = g * gs;
        if (b->gdone[g]) {
            for (int k = 0; k < gs; k++) {
                memcpy(b->spare[o + k], b->run[first ? 0 : o], n * sizeof(**b->run));
                b->spare[o + k][n] = pad;
                b->spare_score[o + k] = 0;
                parent[o + k] = first ? 0 : o;
                b->cur_tok[o + k] = pad;
            }
            continue;
        }
        b->n_cands = 0;
        for (int i = 0; i < gs; i++) {
            int src = first ? 0 : o + i;
            beam_logprobs(b, logits[src], b->run[src], n);
            for (int j = 0; j < o; j++) { /* each id once, by how many earlier beams chose it */
                int same = 0, seen = 0;
                for (int q = 0; q < o; q++) {
                    same += b->cur_tok[q] == b->cur_tok[j];
                    seen += q < j && b->cur_tok[q] == b->cur_tok[j];
                }
                if (!seen)
                    b->lp[b->cur_tok[j]] -= b->p.diversity_penalty * (float)same;
            }
            for (int v = 0; v < b->vocab; v++) {
                float a = b->lp[v] + b->score[o + i];
                if (b->n_cands < b->k || a > b->cands[b->n_cands - 1].lp)
                    cand_offer(b, (struct cand){a, i, v});
            }
        }
        int r = 0;
        for (int c = 0; c < b->n_cands && r < gs; c++) {
            const struct cand *x = &b->cands[c];
            int src = first ? 0 : o + x->beam;
            if (is_eos(b, x->tok)) {
                if (c < gs)
                    fin_add(b, g, (float)(x->lp / pow((double)b->gen, (double)b->p.length_penalty)),
                            b->run[src] + b->n_prompt, b->gen, pad, true);
                continue;
            }
            memcpy(b->spare[o + r], b->run[src], n * sizeof(**b->run));
            b->spare[o + r][n] = x->tok;
            b->spare_score[o + r] = x->lp;
            parent[o + r] = src;
            b->cur_tok[o + r] = x->tok;
            r++;
        }
        if (r < gs) /* beam_create's vocabulary check rules it out */
            return MODEL_EINVAL;
        b->gdone[g] = b->gdone[g] || group_is_done(b, g, b->cands[0].lp);
    }
    next_run(b, nb);
    b->gen++;
    bool all_done = true;
    for (int g = 0; g < b->groups; g++)
        all_done = all_done && b->gdone[g];
    b->done = all_done || b->gen >= b->p.max_new;
    for (int g = 0; g < b->groups && b->done; g++) {
        if (b->gdone[g])
            continue;
        double denom = pow((double)b->gen, (double)b->p.length_penalty);
        for (int k = 0; k < gs; k++)
            fin_add(b, g, (float)(b->score[g * gs + k] / denom), b->run[g * gs + k] + b->n_prompt, b->gen, -1,
                    false);
    }
    if (b->done)
        beam_order(b);
    *done = b->done;
    return MODEL_OK;
}

enum model_status beam_step(beam_search *b, const float *const *logits, int *parent, bool *done)
{
    *done = b->done;
    if (b->done)
        return MODEL_EINVAL;
    if (b->groups > 1)
        return beam_step_groups(b, logits, parent, done);
    size_t n = b->n_prompt + (size_t)b->gen;
    b->n_cands = 0;
    for (int i = 0; i < b->n_run; i++) {
        beam_logprobs(b, logits[i], b->run[i], n);
        for (int v = 0; v < b->vocab; v++) {
            float a = b->lp[v] + b->score[i];
            if (b->n_cands < b->k || a > b->cands[b->n_cands - 1].lp)
                cand_offer(b, (struct cand){a, i, v});
        }
    }
    int nb = b->p.num_beams, gen1 = b->gen + 1;
    bool at_max = gen1 >= b->p.max_new; /* every candidate stops (HF's max_length criterion) */
    /* the finished ones among the first num_beams candidates */
    double denom = pow((double)gen1, (double)b->p.length_penalty);
    bool full_stop = b->n_fin[0] == nb && b->p.early_stopping == BEAM_EARLY_TRUE;
    if (!full_stop && b->heur_unsat) {
        for (int c = 0; c < nb && c < b->n_cands; c++) {
            const struct cand *x = &b->cands[c];
            bool eos = is_eos(b, x->tok);
            if (!eos && !at_max)
                continue;
            fin_add(b, 0, (float)(x->lp / denom), b->run[x->beam] + b->n_prompt, b->gen, x->tok, eos);
        }
    }
    /* the running beams of the next step: the first num_beams that go on */
    int r = 0;
    for (int c = 0; c < b->n_cands && r < nb && !at_max; c++) {
        const struct cand *x = &b->cands[c];
        if (is_eos(b, x->tok))
            continue;
        memcpy(b->spare[r], b->run[x->beam], n * sizeof(**b->run));
        b->spare[r][n] = x->tok;
        b->spare_score[r] = x->lp;
        parent[r++] = x->beam;
    }
    if (!at_max) {
        next_run(b, r);
        b->gen = gen1;
        /* can the best running beam still beat the worst kept hypothesis? */
        int hyp_len = b->p.early_stopping == BEAM_EARLY_NEVER && b->p.length_penalty > 0 ? b->p.max_new : b->gen;
        float best = (float)(b->score[0] / pow((double)hyp_len, (double)b->p.length_penalty));
        if (b->n_fin[0] == nb && !(best > b->fin_score[nb - 1]))
            b->heur_unsat = false;
    }
    b->done = at_max || r < nb || !b->heur_unsat || (b->n_fin[0] == nb && b->p.early_stopping == BEAM_EARLY_TRUE);
    if (b->done)
        beam_order(b);
    *done = b->done;
    return MODEL_OK;
}

enum tier_status beam_reorder(kv_seq **kv, int n_old, const int *parent, int n_new, kv_seq **tmp,
                              uint64_t *freed_copied)
{
    enum tier_status st = TIER_OK;
    bool taken[BEAM_MAX_BEAMS] = {false};
    /* the first child of each parent takes its sequence over */
    for (int k = 0; k < n_new; k++) {
        tmp[k] = NULL;
        if (!taken[parent[k]]) {
            taken[parent[k]] = true;
            tmp[k] = kv[parent[k]];
        }
    }
    /* the other children fork it, while every parent is still alive, each
     * into a sequence no child took (none is a parent), whose memory the
     * fork reuses */
    for (int k = 0, spare = 0; k < n_new; k++) {
        if (tmp[k] || st != TIER_OK)
            continue;
        while (spare < n_old && taken[spare])
            spare++;
        if (spare == n_old) {
            st = kv_seq_fork(kv[parent[k]], &tmp[k]);
            continue;
        }
        *freed_copied += kv_seq_stats(kv[spare]).copied_bytes;
        taken[spare] = true;
        tmp[k] = kv[spare];
        st = kv_seq_refork(kv[parent[k]], &tmp[k]);
    }
    for (int i = 0; i < n_old; i++) {
        if (!taken[i]) {
            *freed_copied += kv_seq_stats(kv[i]).copied_bytes;
            kv_seq_free(kv[i]);
        }
    }
    memcpy(kv, tmp, (size_t)n_new * sizeof(*kv));
    return st;
}

uint64_t beam_whole_reorder_bytes(const struct model_config *c, enum be_dtype dtype, int n_beams, int64_t len,
                                  int window)
{
    uint64_t rows = 0;
    for (int l = 0; l < c->n_layers; l++) {
        int64_t w = c->layer_window[l];
        if (window > 0 && (!w || window < w))
            w = window;
        rows += (uint64_t)(w && w < len ? w : len);
    }
    return rows * 2u * (uint64_t)c->n_kv_heads * (uint64_t)c->head_dim * be_dtype_size(dtype) * (uint64_t)n_beams;
}

static enum model_status kv_status(enum tier_status ts)
{
    return ts == TIER_ENOMEM_HOST ? MODEL_ENOMEM : ts == TIER_ENOMEM_DEV ? MODEL_EDEVMEM : MODEL_EBACKEND;
}

enum model_status beam_generate(model *m, kv_store *store, const struct kv_seq_params *kp, const int32_t *prompt,
                                size_t n, const struct beam_params *p, beam_search **out, struct beam_kv_stats *ks,
                                char *err)
{
    const struct model_config *c = model_get_config(m);
    *ks = (struct beam_kv_stats){0};
    beam_search *b = NULL;
    enum model_status st = beam_create(p, c->vocab_size, prompt, n, &b, err);
    if (st != MODEL_OK)
        return st;
    int nb = p->num_beams;
    kv_seq **kv = calloc((size_t)nb, sizeof(*kv));
    kv_seq **tmp = calloc(BEAM_MAX_BEAMS, sizeof(*tmp));
    struct fw_seq *fw = calloc((size_t)nb, sizeof(*fw));
    float *logits = malloc((size_t)nb * (size_t)c->vocab_size * sizeof(*logits));
    const float **rowp = calloc((size_t)nb, sizeof(*rowp));
    int *parent = calloc((size_t)nb, sizeof(*parent));
    enum tier_status ts = TIER_OK;
    if (!kv || !tmp || !fw || !logits || !rowp || !parent)
        st = MODEL_ENOMEM;
    else if ((ts = kv_seq_create(store, kp, &kv[0])) != TIER_OK)
        st = kv_status(ts);
    if (st == MODEL_OK) {
        fw[0] = (struct fw_seq){kv[0], prompt, (int)n, logits, false, 0};
        st = model_forward(m, fw, 1);
    }
    bool done = false;
    while (st == MODEL_OK) {
        int nr = beam_running(b);
        for (int i = 0; i < nr; i++)
            rowp[i] = logits + (size_t)i * (size_t)c->vocab_size;
        st = beam_step(b, rowp, parent, &done);
        if (st != MODEL_OK || done)
            break;
        int nn = beam_running(b);
        ts = beam_reorder(kv, nr, parent, nn, tmp, &ks->copied_bytes);
        if (ts != TIER_OK) {
            st = kv_status(ts);
            break;
        }
        size_t len;
        for (int i = 0; i < nn; i++) {
            const int32_t *t = beam_tokens(b, i, &len);
            fw[i] = (struct fw_seq){kv[i], t + len - 1, 1, logits + (size_t)i * (size_t)c->vocab_size, false, 0};
        }
        ks->whole_reorder_bytes += beam_whole_reorder_bytes(c, kv_store_dtype(store), nn, (int64_t)len - 1,
                                                            kp ? kp->window_length : 0);
        ks->steps++;
        st = model_forward(m, fw, nn);
    }
    for (int i = 0; kv && i < nb; i++) {
        if (kv[i]) /* a failed fork leaves NULL */
            ks->copied_bytes += kv_seq_stats(kv[i]).copied_bytes;
        kv_seq_free(kv[i]);
    }
    if (st != MODEL_OK && !err[0])
        snprintf(err, MODEL_ERR_LEN, "beam search step %d: %s", ks->steps, model_strerror(st));
    free(kv);
    free(tmp);
    free(fw);
    free(logits);
    free(rowp);
    free(parent);
    if (st != MODEL_OK) {
        beam_free(b);
        return st;
    }
    *out = b;
    return MODEL_OK;
}
