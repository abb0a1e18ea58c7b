/* sampler.c - next-token choice in the Hugging Face logits-processor order:
 * repetition_penalty -> presence/frequency penalties -> temperature ->
 * top_k -> top_p -> min_p -> typical_p -> sample.
 * All scratch is allocated once per sampler, never per token.
 */
#include "model/sampler.h"
#include "util/argmax.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct cand {
    float logit;
    float prob; /* exp((logit - max) / temperature), unnormalised */
    int32_t id;
};

struct sampler {
    struct sampler_params p;
    int vocab;
    uint64_t rng[4];  /* xoshiro256** state */
    struct cand *cand; /* (vocab) the candidates still in the running */
    float *heap;       /* (vocab) min-heap of the top_k largest logits */
    uint32_t *seen;   /* (vocab) epoch in which a penalty pass last hit a token */
    uint32_t *count;  /* (vocab) a generated token's occurrences, valid where seen is this epoch */
    uint32_t epoch;
};

void sampler_params_default(struct sampler_params *p)
{
    *p = (struct sampler_params){.temperature = 0, .top_k = 0, .top_p = 1, .min_p = 0, .repetition_penalty = 1,
                                 .typical_p = 1};
}

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t next_u64(uint64_t s[4])
{
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

/* Uniform in [0, 1) with 53 random bits. */
static double next_unit(uint64_t s[4])
{
    return (double)(next_u64(s) >> 11) * 0x1.0p-53;
}

enum model_status sampler_create(const struct sampler_params *p, int vocab, sampler **out)
{
    *out = NULL;
    /* written so that NaN fails every test */
    if (vocab <= 0 || !(p->temperature >= 0 && isfinite(p->temperature)) || p->top_k < 0 ||
        !(p->top_p > 0 && p->top_p <= 1) || !(p->min_p >= 0 && p->min_p <= 1) ||
        !(p->repetition_penalty > 0 && isfinite(p->repetition_penalty)) || p->penalty_last_n < 0 ||
        !isfinite(p->presence_penalty) || !isfinite(p->frequency_penalty) || !(p->typical_p > 0 && p->typical_p <= 1))
        return MODEL_EINVAL;
    sampler *s = calloc(1, sizeof(*s));
    if (!s)
        return MODEL_ENOMEM;
    s->cand = malloc((size_t)vocab * sizeof(*s->cand));
    s->heap = malloc((size_t)vocab * sizeof(*s->heap));
    s->seen = calloc((size_t)vocab, sizeof(*s->seen));
    s->count = malloc((size_t)vocab * sizeof(*s->count));
    if (!s->cand || !s->heap || !s->seen || !s->count) {
        sampler_free(s);
        return MODEL_ENOMEM;
    }
    s->p = *p;
    s->vocab = vocab;
    uint64_t seed = p->seed;
    for (int i = 0; i < 4; i++)
        s->rng[i] = splitmix64(&seed);
    *out = s;
    return MODEL_OK;
}

void sampler_free(sampler *s)
{
    if (!s)
        return;
    free(s->cand);
    free(s->heap);
    free(s->seen);
    free(s->count);
    free(s);
}

/* The candidates' order: the higher logit first, equal logits in
 * vocabulary order (a total order: candidates are never NaN). */
static bool better(const struct cand *x, const struct cand *y)
{
    return x->logit != y->logit ? x->logit > y->logit : x->id < y->id;
}

/* Sift c[i] down the heap c[0, n) whose root is its worst candidate. */
static void sift_worst(struct cand *c, int n, int i)
{
    for (;;) {
        int l = 2 * i + 1, m = i;
        if (l < n && better(&c[m], &c[l]))
            m = l;
        if (l + 1 < n && better(&c[m], &c[l + 1]))
            m = l + 1;
        if (m == i)
            return;
        struct cand t = c[i];
        c[i] = c[m];
        c[m] = t;
        i = m;
    }
}

/* Puts the k best of c[0, n) in better's order at c[0, k), the rest
 * after them in no order: a heap of k with the worst at its root, then
 * heap sort, O(n log k) and nothing allocated (glibc's qsort allocates a
 * buffer for arrays over 1 KiB).  The filters below want the shortest
 * sorted prefix that holds some mass, which is usually a few tokens:
 * sorting the whole vocabulary per token would cost more than that. */
static void sort_best(struct cand *c, int n, int k)
{
    for (int i = k / 2 - 1; i >= 0; i--)
        sift_worst(c, k, i);
    for (int i = k; i < n; i++) {
        if (better(&c[i], &c[0])) {
            struct cand t = c[0];
            c[0] = c[i];
            c[i] = t;
            sift_worst(c, k, 0);
        }
    }
    for (int end = k - 1; end > 0; end--) {
        struct cand t = c[0];
        c[0] = c[end];
        c[end] = t;
        sift_worst(c, end, 0);
    }
}

/* The next prefix length to sort when the k best of n candidates held
 * too little of the mass a filter wants: four times as many, or all of
 * them when they held under half of it (a flat distribution keeps most of
 * the vocabulary, and growing a prefix there would sort it several times). */
static int more_sorted(int k, int n, double held, double want)
{
    return held < want / 2 || k > n / 4 ? n : 4 * k;
}

#define SORT_FIRST 64

static void sift_down(float *h, int n, int i)
{
    for (;;) {
        int l = 2 * i + 1, m = i;
        if (l < n && h[l] < h[m])
            m = l;
        if (l + 1 < n && h[l + 1] < h[m])
            m = l + 1;
        if (m == i)
            return;
        float t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

/* The k-th largest of x[0..n) with a size-k min-heap: O(n log k). */
static float kth_largest(float *heap, const float *x, int n, int k)
{
    memcpy(heap, x, (size_t)k * sizeof(*heap));
    for (int i = k / 2 - 1; i >= 0; i--)
        sift_down(heap, k, i);
    for (int i = k; i < n; i++) {
        if (x[i] > heap[0]) {
            heap[0] = x[i];
            sift_down(heap, k, 0);
        }
    }
    return heap[0];
}

/* A fresh mark for a penalty pass over the history. */
static void next_epoch(sampler *s)
{
    if (++s->epoch == 0) { /* wrapped: forget every old mark */
        memset(s->seen, 0, (size_t)s->vocab * sizeof(*s->seen));
        s->epoch = 1;
    }
}

/* OpenAI's presence and frequency penalties over the generated tokens
 * history[from, n): logit -= count * frequency + (count > 0) * presence. */
static void count_penalties(sampler *s, float *logits, const int32_t *history, size_t from, size_t n)
{
    next_epoch(s);
    for (size_t i = from; i < n; i++) {
        int32_t id = history[i];
        if (id < 0 || id >= s->vocab)
            continue;
        if (s->seen[id] != s->epoch) {
            s->seen[id] = s->epoch;
            s->count[id] = 0;
        }
        s->count[id]++;
    }
    for (size_t i = from; i < n; i++) {
        int32_t id = history[i];
        if (id < 0 || id >= s->vocab || !s->count[id])
            continue;
        logits[id] -= (float)s->count[id] * s->p.frequency_penalty + s->p.presence_penalty;
        s->count[id] = 0; /* once per token */
    }
}

/* Locally typical sampling (HF TypicalLogitsWarper) over cand[0, n):
 * keeps the tokens whose surprisal is closest to the entropy, the fewest
 * whose mass reaches typical_p.  Returns the candidates kept. */
static int typical_filter(sampler *s, int n)
{
    double sum = 0, ent = 0;
    for (int i = 0; i < n; i++)
        sum += s->cand[i].prob;
    for (int i = 0; i < n; i++) {
        double q = s->cand[i].prob / sum;
        if (q > 0)
            ent -= q * log(q);
    }
    /* the logits are no longer needed: they carry minus the shift, so the
     * descending sort puts the most typical token first */
    for (int i = 0; i < n; i++) {
        double q = s->cand[i].prob / sum;
        s->cand[i].logit = q > 0 ? (float)-fabs(-log(q) - ent) : -INFINITY;
    }
    /* HF keeps every token whose shift is at most that of the first one at
     * which the cumulative mass reaches typical_p: a sorted prefix that
     * holds that token and the ties after it */
    double cum = 0;
    for (int k = n < SORT_FIRST ? n : SORT_FIRST;; k = more_sorted(k, n, cum, s->p.typical_p)) {
        sort_best(s->cand, n, k);
        cum = 0;
        int last = -1;
        for (int i = 0; i < k; i++) {
            cum += s->cand[i].prob / sum;
            if (!(cum < s->p.typical_p)) {
                last = i;
                break;
            }
        }
        if (last < 0 && k < n)
            continue;
        if (last < 0)
            last = n - 1;
        int keep = last + 1;
        while (keep < k && s->cand[keep].logit == s->cand[last].logit)
            keep++;
        if (keep < k || k == n)
            return keep;
    }
}

int32_t sampler_sample(sampler *s, float *logits, const int32_t *history, size_t n_hist, size_t n_prompt)
{
    const struct sampler_params *p = &s->p;
    int V = s->vocab;
    if (p->repetition_penalty != 1) { /* HF: divide positive scores, multiply negative ones */
        next_epoch(s);
        size_t from = p->penalty_last_n && (size_t)p->penalty_last_n < n_hist ? n_hist - (size_t)p->penalty_last_n : 0;
        for (size_t i = from; i < n_hist; i++) {
            int32_t id = history[i];
            /* a token repeated in history is penalised once, as HF's gather/scatter does */
            if (id < 0 || id >= V || s->seen[id] == s->epoch)
                continue;
            s->seen[id] = s->epoch;
            float *x = &logits[id];
            *x = *x < 0 ? *x * p->repetition_penalty : *x / p->repetition_penalty;
        }
    }
    if ((p->presence_penalty != 0 || p->frequency_penalty != 0) && n_prompt < n_hist)
        count_penalties(s, logits, history, n_prompt, n_hist);
    if (p->temperature == 0)
        return argmax_f32(logits, V);

    /* Candidates in vocabulary order.  top_k keeps every logit >= the k-th
     * (HF removes `scores < kth`, so ties stay); only top_p needs them
     * sorted, so a plain temperature draw costs O(vocab), not a sort. */
    float floor_logit = -INFINITY;
    if (p->top_k > 0 && p->top_k < V)
        floor_logit = kth_largest(s->heap, logits, V, p->top_k);
    int n = 0;
    float mx = -INFINITY;
    for (int i = 0; i < V; i++) {
        if (logits[i] >= floor_logit) {
            s->cand[n++] = (struct cand){.logit = logits[i], .id = i};
            if (logits[i] > mx)
                mx = logits[i];
        }
    }
    if (n == 0) /* every logit NaN or -inf */
        return argmax_f32(logits, V);
    double sum = 0;
    for (int i = 0; i < n; i++) {
        s->cand[i].prob = (float)exp((s->cand[i].logit - mx) / p->temperature);
        sum += s->cand[i].prob;
    }
    if (p->top_p < 1) { /* smallest prefix whose mass reaches top_p (HF removes cum <= 1 - top_p from the tail) */
        double cum = 0;
        for (int k = n < SORT_FIRST ? n : SORT_FIRST;; k = more_sorted(k, n, cum, p->top_p)) {
            sort_best(s->cand, n, k);
            cum = 0;
            int cut = 0;
            for (int i = 0; i < k && !cut; i++) {
                cum += s->cand[i].prob / sum;
                if (cum >= p->top_p)
                    cut = i + 1;
            }
            if (cut || k == n) {
                n = cut ? cut : n;
                break;
            }
        }
    }
    if (p->min_p > 0) { /* drop tokens below min_p times the top probability (which is exp(0) = 1) */
        int keep = 0;
        for (int i = 0; i < n; i++)
            if (s->cand[i].prob >= p->min_p)
                s->cand[keep++] = s->cand[i];
        n = keep;
    }
    if (p->typical_p < 1 && n > 1)
        n = typical_filter(s, n);
    sum = 0;
    for (int i = 0; i < n; i++)
        sum += s->cand[i].prob;
    double u = next_unit(s->rng) * sum, acc = 0;
    for (int i = 0; i < n; i++) {
        acc += s->cand[i].prob;
        if (u < acc)
            return s->cand[i].id;
    }
    return s->cand[n - 1].id;
}

bool stop_check(const struct stop_matcher *m, const char *text, size_t len, size_t *emit_len)
{
    size_t safe = len;
    for (int i = 0; i < m->n_stops; i++) {
        const char *st = m->stops[i];
        size_t sl = strlen(st);
        if (!sl)
            continue;
        const char *hit = memmem(text, len, st, sl);
        if (hit) {
            *emit_len = (size_t)(hit - text);
            return true;
        }
        /* hold back the longest tail that is a prefix of this stop string */
        for (size_t k = sl - 1 < len ? sl - 1 : len; k > 0; k--) {
            if (memcmp(text + len - k, st, k) == 0) {
                if (len - k < safe)
                    safe = len - k;
                break;
            }
        }
    }
    *emit_len = safe;
    return false;
}
