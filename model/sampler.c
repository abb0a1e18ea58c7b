/* sampler.c - next-token choice in the Hugging Face logits-processor order:
 * repetition_penalty -> temperature -> top_k -> top_p -> min_p -> sample.
 * All scratch is allocated once per sampler, never per token.
 */
#include "model/generate.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct sampler {
    struct sampler_params p;
    int vocab;
    uint64_t rng[4];  /* xoshiro256** state */
    int32_t *idx;     /* (vocab) candidate ids, sorted by logit descending */
    float *prob;      /* (vocab) */
    uint32_t *seen;   /* (vocab) epoch in which the repetition penalty last hit a token */
    uint32_t epoch;
};

void sampler_params_default(struct sampler_params *p)
{
    *p = (struct sampler_params){.temperature = 0, .top_k = 0, .top_p = 1, .min_p = 0, .repetition_penalty = 1};
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
    if (vocab <= 0 || p->temperature < 0 || p->top_k < 0 || !(p->top_p > 0 && p->top_p <= 1) ||
        !(p->min_p >= 0 && p->min_p <= 1) || !(p->repetition_penalty > 0) || !isfinite(p->temperature))
        return MODEL_EINVAL;
    sampler *s = calloc(1, sizeof(*s));
    if (!s)
        return MODEL_ENOMEM;
    s->idx = malloc((size_t)vocab * sizeof(*s->idx));
    s->prob = malloc((size_t)vocab * sizeof(*s->prob));
    s->seen = calloc((size_t)vocab, sizeof(*s->seen));
    if (!s->idx || !s->prob || !s->seen) {
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
    free(s->idx);
    free(s->prob);
    free(s->seen);
    free(s);
}

static int argmax(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

static const float *cmp_logits; /* qsort has no context argument in C11 */

static int by_logit_desc(const void *a, const void *b)
{
    float x = cmp_logits[*(const int32_t *)a], y = cmp_logits[*(const int32_t *)b];
    if (x != y)
        return x > y ? -1 : 1;
    return *(const int32_t *)a - *(const int32_t *)b; /* stable order for equal logits */
}

int32_t sampler_sample(sampler *s, float *logits, const int32_t *history, size_t n_hist)
{
    const struct sampler_params *p = &s->p;
    int V = s->vocab;
    if (p->repetition_penalty != 1) { /* HF: divide positive scores, multiply negative ones */
        if (++s->epoch == 0) { /* wrapped: forget every old mark */
            memset(s->seen, 0, (size_t)V * sizeof(*s->seen));
            s->epoch = 1;
        }
        for (size_t i = 0; i < n_hist; i++) {
            int32_t id = history[i];
            /* a token repeated in history is penalised once, as HF's gather/scatter does */
            if (id < 0 || id >= V || s->seen[id] == s->epoch)
                continue;
            s->seen[id] = s->epoch;
            float *x = &logits[id];
            *x = *x < 0 ? *x * p->repetition_penalty : *x / p->repetition_penalty;
        }
    }
    if (p->temperature == 0)
        return argmax(logits, V);

    /* Candidates sorted by logit, descending; filters shrink n. */
    for (int i = 0; i < V; i++)
        s->idx[i] = i;
    cmp_logits = logits;
    qsort(s->idx, (size_t)V, sizeof(*s->idx), by_logit_desc);
    int n = V;
    if (p->top_k > 0 && p->top_k < n) { /* keep ties with the k-th logit, as HF's `scores < kth` does */
        float kth = logits[s->idx[p->top_k - 1]];
        n = p->top_k;
        while (n < V && logits[s->idx[n]] == kth)
            n++;
    }
    /* softmax of logit / temperature over the candidates */
    double mx = logits[s->idx[0]] / p->temperature, sum = 0;
    for (int i = 0; i < n; i++) {
        s->prob[i] = (float)exp(logits[s->idx[i]] / p->temperature - mx);
        sum += s->prob[i];
    }
    if (p->top_p < 1) { /* smallest prefix whose mass reaches top_p (HF removes cum <= 1 - top_p from the tail) */
        double cum = 0;
        int keep = n;
        for (int i = 0; i < n; i++) {
            cum += s->prob[i] / sum;
            if (cum >= p->top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }
    if (p->min_p > 0) { /* drop tokens below min_p times the top probability */
        float floor_p = s->prob[0] * p->min_p;
        int keep = 1;
        while (keep < n && s->prob[keep] >= floor_p)
            keep++;
        n = keep;
    }
    sum = 0;
    for (int i = 0; i < n; i++)
        sum += s->prob[i];
    double u = next_unit(s->rng) * sum, acc = 0;
    for (int i = 0; i < n; i++) {
        acc += s->prob[i];
        if (u < acc)
            return s->idx[i];
    }
    return s->idx[n - 1];
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
