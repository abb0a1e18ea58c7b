/* Description: the sampler against hand-computed Hugging Face processor
 * results (repetition penalty, top-k ties, top-p, min-p), sampling
 * frequencies against the softmax, seeding, and the stop-string matcher.
 */
#include <math.h>
#include <stdbool.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "model/sampler.h"

static sampler *make(float temp, int top_k, float top_p, float min_p, float rep, uint64_t seed, int vocab)
{
    struct sampler_params p;
    sampler_params_default(&p);
    p.temperature = temp;
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    p.repetition_penalty = rep;
    p.seed = seed;
    sampler *s;
    assert_int_equal(sampler_create(&p, vocab, &s), MODEL_OK);
    return s;
}

/* Frequencies of each token over n draws from fixed logits. */
static void draw(sampler *s, const float *logits, int vocab, int n, double *freq)
{
    float tmp[8];
    memset(freq, 0, (size_t)vocab * sizeof(double));
    for (int i = 0; i < n; i++) {
        memcpy(tmp, logits, (size_t)vocab * sizeof(float));
        freq[sampler_sample(s, tmp, NULL, 0, 0)] += 1.0 / n;
    }
}

static void test_greedy_first_of_ties(void **state)
{
    (void)state;
    sampler *s = make(0, 0, 1, 0, 1, 0, 4);
    float l[4] = {1, 3, 3, 2};
    assert_int_equal(sampler_sample(s, l, NULL, 0, 0), 1);
    sampler_free(s);
}

static void test_repetition_penalty(void **state)
{
    (void)state;
    sampler *s = make(0, 0, 1, 0, 2, 0, 3);
    float l[3] = {2, -2, 1.5f};
    int32_t hist[3] = {0, 1, 0}; /* token 0 twice: penalised once */
    assert_int_equal(sampler_sample(s, l, hist, 3, 3), 2);
    assert_float_equal(l[0], 1, 0);
    assert_float_equal(l[1], -4, 0);
    assert_float_equal(l[2], 1.5f, 0);
    sampler_free(s);
}

/* OpenAI's presence and frequency penalties count generated tokens only,
 * never the prompt's; greedy picks after them. */
static void test_presence_frequency(void **state)
{
    (void)state;
    struct sampler_params p;
    sampler_params_default(&p);
    p.frequency_penalty = 0.1f;
    sampler *s;
    assert_int_equal(sampler_create(&p, 4, &s), MODEL_OK);
    int32_t hist[6] = {0, 0, 0, 0, 0, 2}; /* prompt: three 0s; generated: 0, 0, 2 */
    float l[4] = {2, 1.9f, 0.5f, 0};
    assert_int_equal(sampler_sample(s, l, hist, 6, 3), 1);
    assert_float_equal(l[0], 1.8f, 1e-6);
    assert_float_equal(l[2], 0.4f, 1e-6);
    assert_float_equal(l[1], 1.9f, 0);
    sampler_free(s);
    sampler_params_default(&p);
    p.presence_penalty = 0.05f;
    assert_int_equal(sampler_create(&p, 4, &s), MODEL_OK);
    float m[4] = {2, 1.9f, 0.5f, 0};
    assert_int_equal(sampler_sample(s, m, hist, 6, 3), 0);
    assert_float_equal(m[0], 1.95f, 1e-6);
    assert_float_equal(m[2], 0.45f, 1e-6);
    /* nothing generated yet: no penalty at all */
    float q[4] = {2, 1.9f, 0.5f, 0};
    sampler_sample(s, q, hist, 3, 3);
    assert_float_equal(q[0], 2, 0);
    sampler_free(s);
}

/* llama.cpp's repeat_penalty window: only the last penalty_last_n tokens. */
static void test_penalty_window(void **state)
{
    (void)state;
    struct sampler_params p;
    sampler_params_default(&p);
    p.repetition_penalty = 2;
    p.penalty_last_n = 2;
    sampler *s;
    assert_int_equal(sampler_create(&p, 3, &s), MODEL_OK);
    int32_t hist[3] = {0, 1, 2};
    float l[3] = {2, 2, -1};
    assert_int_equal(sampler_sample(s, l, hist, 3, 1), 0);
    assert_float_equal(l[0], 2, 0);
    assert_float_equal(l[1], 1, 0);
    assert_float_equal(l[2], -2, 0);
    sampler_free(s);
}

/* Locally typical sampling by hand: p = {.5 .3 .15 .05}, entropy 1.1422;
 * |surprisal - entropy| orders the tokens 1, 0, 2, 3 with cumulative mass
 * .3 .8 .95 1. */
static void test_typical(void **state)
{
    (void)state;
    float l[4] = {logf(0.5f), logf(0.3f), logf(0.15f), logf(0.05f)};
    double f[4];
    struct sampler_params p;
    sampler_params_default(&p);
    p.temperature = 1;
    p.seed = 5;
    sampler *s;
    p.typical_p = 0.2f; /* the most typical token alone, which is not the most likely */
    assert_int_equal(sampler_create(&p, 4, &s), MODEL_OK);
    draw(s, l, 4, 2000, f);
    assert_float_equal(f[1], 1, 1e-9);
    sampler_free(s);
    p.typical_p = 0.5f; /* {1, 0}, renormalised 3:5 */
    assert_int_equal(sampler_create(&p, 4, &s), MODEL_OK);
    draw(s, l, 4, 30000, f);
    assert_true(f[2] == 0 && f[3] == 0);
    assert_true(fabs(f[0] - 0.625) < 0.02);
    sampler_free(s);
    p.typical_p = 0.9f; /* {1, 0, 2} */
    assert_int_equal(sampler_create(&p, 4, &s), MODEL_OK);
    draw(s, l, 4, 30000, f);
    assert_true(f[3] == 0 && fabs(f[2] - 0.15 / 0.95) < 0.02);
    sampler_free(s);
}

static void test_distribution_matches_softmax(void **state)
{
    (void)state;
    float l[3] = {logf(0.5f), logf(0.3f), logf(0.2f)};
    double f[3];
    sampler *s = make(1, 0, 1, 0, 1, 42, 3);
    draw(s, l, 3, 40000, f);
    assert_true(fabs(f[0] - 0.5) < 0.015 && fabs(f[1] - 0.3) < 0.015 && fabs(f[2] - 0.2) < 0.015);
    sampler_free(s);
    /* temperature 2 flattens: p ~ sqrt(p) normalised */
    double z = sqrt(0.5) + sqrt(0.3) + sqrt(0.2);
    s = make(2, 0, 1, 0, 1, 7, 3);
    draw(s, l, 3, 40000, f);
    assert_true(fabs(f[0] - sqrt(0.5) / z) < 0.015 && fabs(f[2] - sqrt(0.2) / z) < 0.015);
    sampler_free(s);
}

static void test_filters(void **state)
{
    (void)state;
    float l[4] = {logf(0.4f), logf(0.3f), logf(0.2f), logf(0.1f)};
    double f[4];
    /* top_p 0.6: keep the smallest prefix reaching 0.6 -> {0,1}, renormalised 4:3 */
    sampler *s = make(1, 0, 0.6f, 0, 1, 1, 4);
    draw(s, l, 4, 30000, f);
    assert_true(f[2] == 0 && f[3] == 0);
    assert_true(fabs(f[0] - 4.0 / 7) < 0.02);
    sampler_free(s);
    /* min_p 0.4: keep p >= 0.16 -> {0,1,2} */
    s = make(1, 0, 1, 0.4f, 1, 2, 4);
    draw(s, l, 4, 30000, f);
    assert_true(f[3] == 0 && fabs(f[2] - 0.2 / 0.9) < 0.02);
    sampler_free(s);
    /* top_k 2 keeps the k-th logit's ties (HF: remove scores < kth) */
    float t[4] = {3, 1, 1, 0};
    s = make(1, 2, 1, 0, 1, 3, 4);
    draw(s, t, 4, 20000, f);
    assert_true(f[1] > 0 && f[2] > 0 && f[3] == 0);
    sampler_free(s);
}

/* A vocabulary whose kept set runs far past the first sorted prefix: the
 * filters sort only as many candidates as they need, growing the prefix,
 * and must keep what a whole sort keeps, ties in vocabulary order. */
static void test_large_vocab_filters(void **state)
{
    (void)state;
    enum { V = 1000, DRAWS = 20000 };
    float *l = malloc(V * sizeof(*l)), *tmp = malloc(V * sizeof(*tmp));
    int *hits = calloc(V, sizeof(*hits));
    assert_non_null(l);
    assert_non_null(tmp);
    assert_non_null(hits);
    /* equal logits (the odd ids below -inf): top_p 0.5 keeps the first half
     * of the 900 finite ones in id order, 450 tokens */
    for (int i = 0; i < V; i++)
        l[i] = i % 10 == 9 ? -INFINITY : 0.25f;
    sampler *s = make(1, 0, 0.5f, 0, 1, 11, V);
    for (int d = 0; d < DRAWS; d++) {
        memcpy(tmp, l, V * sizeof(*l));
        hits[sampler_sample(s, tmp, NULL, 0, 0)]++;
    }
    int distinct = 0, last = 0;
    for (int i = 0; i < V; i++)
        if (hits[i]) {
            distinct++;
            last = i;
            assert_true(i % 10 != 9);
        }
    /* the 450th finite id is 498 */
    assert_int_equal(last, 498);
    assert_true(distinct > 440);
    sampler_free(s);
    /* 32 tokens ten times as likely as 200 others, both after the rest in
     * id order: the best 64 hold 68 % of the mass, so the sorted prefix
     * grows fourfold, to 256, and top_p 0.9 keeps the 32 (ids 968..999)
     * and the first 148 of the others (ids 500..647) */
    memset(hits, 0, V * sizeof(*hits));
    for (int i = 0; i < V; i++)
        l[i] = i >= 968 ? logf(10) : i >= 500 && i < 700 ? 0 : -INFINITY;
    s = make(1, 0, 0.9f, 0, 1, 14, V);
    for (int d = 0; d < DRAWS; d++) {
        memcpy(tmp, l, V * sizeof(*l));
        hits[sampler_sample(s, tmp, NULL, 0, 0)]++;
    }
    last = 0;
    for (int i = 0; i < 968; i++)
        if (hits[i]) {
            assert_true(i >= 500);
            last = i;
        }
    assert_int_equal(last, 647);
    sampler_free(s);
    /* a falling staircase of 100 steps of 10 equal logits: top_p keeps
     * whole steps up to the one that reaches the mass, then that step's
     * first tokens in id order; check against the mass directly */
    memset(hits, 0, V * sizeof(*hits));
    double mass = 0, total = 0;
    for (int i = 0; i < V; i++) {
        l[i] = -0.01f * (float)(i / 10);
        total += exp((double)l[i]);
    }
    int cut = 0;
    for (; cut < V && mass / total < 0.9; cut++)
        mass += exp((double)l[cut]);
    s = make(1, 0, 0.9f, 0, 1, 12, V);
    for (int d = 0; d < DRAWS; d++) {
        memcpy(tmp, l, V * sizeof(*l));
        hits[sampler_sample(s, tmp, NULL, 0, 0)]++;
    }
    last = 0;
    for (int i = 0; i < V; i++)
        if (hits[i])
            last = i;
    assert_true(last < cut && last >= cut - 20);
    sampler_free(s);
    /* typical_p over the same staircase: the set a whole sort by the
     * distance of each surprisal from the entropy gives (ties kept), built
     * here by definition; every token drawn is in it and most of it shows */
    struct sampler_params p;
    sampler_params_default(&p);
    p.temperature = 1;
    p.typical_p = 0.9f;
    p.seed = 13;
    assert_int_equal(sampler_create(&p, V, &s), MODEL_OK);
    memset(hits, 0, V * sizeof(*hits));
    for (int d = 0; d < DRAWS; d++) {
        memcpy(tmp, l, V * sizeof(*l));
        hits[sampler_sample(s, tmp, NULL, 0, 0)]++;
    }
    double ent = 0;
    for (int i = 0; i < V; i++) {
        double q = exp((double)l[i]) / total;
        ent -= q * log(q);
    }
    /* the staircase's steps are whole ties, so the kept set is whole steps:
     * those nearest the entropy, added until their mass reaches 0.9 */
    bool kept[V / 10] = {false};
    double got = 0;
    while (got < 0.9) {
        int best = -1;
        double bd = INFINITY;
        for (int st = 0; st < V / 10; st++) {
            double d = fabs(-log(exp((double)l[st * 10]) / total) - ent);
            if (!kept[st] && d < bd)
                bd = d, best = st;
        }
        kept[best] = true;
        got += 10 * exp((double)l[best * 10]) / total;
    }
    int in_set = 0, shown = 0;
    for (int i = 0; i < V; i++) {
        in_set += kept[i / 10];
        shown += hits[i] > 0;
        assert_true(!hits[i] || kept[i / 10]);
    }
    assert_true(in_set > 500 && shown > in_set * 9 / 10);
    sampler_free(s);
    free(l);
    free(tmp);
    free(hits);
}

static void test_seed_reproducible(void **state)
{
    (void)state;
    float l[8] = {0, 0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f};
    int32_t a[64], b[64], c[64];
    sampler *s1 = make(1, 0, 1, 0, 1, 99, 8), *s2 = make(1, 0, 1, 0, 1, 99, 8), *s3 = make(1, 0, 1, 0, 1, 100, 8);
    for (int i = 0; i < 64; i++) {
        float t1[8], t2[8], t3[8];
        memcpy(t1, l, sizeof(l));
        memcpy(t2, l, sizeof(l));
        memcpy(t3, l, sizeof(l));
        a[i] = sampler_sample(s1, t1, NULL, 0, 0);
        b[i] = sampler_sample(s2, t2, NULL, 0, 0);
        c[i] = sampler_sample(s3, t3, NULL, 0, 0);
    }
    assert_memory_equal(a, b, sizeof(a));
    assert_memory_not_equal(a, c, sizeof(a));
    sampler_free(s1);
    sampler_free(s2);
    sampler_free(s3);
}

static void test_bad_params(void **state)
{
    (void)state;
    struct sampler_params p;
    sampler *s = NULL;
    sampler_params_default(&p);
    p.top_p = 0;
    assert_int_equal(sampler_create(&p, 4, &s), MODEL_EINVAL);
    sampler_params_default(&p);
    p.temperature = -1;
    assert_int_equal(sampler_create(&p, 4, &s), MODEL_EINVAL);
    sampler_params_default(&p);
    p.repetition_penalty = 0;
    assert_int_equal(sampler_create(&p, 4, &s), MODEL_EINVAL);
    /* non-finite values are invalid parameters, never a memory failure */
    float odd[] = {NAN, INFINITY, -INFINITY};
    for (int i = 0; i < 3; i++) {
        float *fields[] = {&p.temperature, &p.top_p, &p.min_p, &p.repetition_penalty};
        for (int k = 0; k < 4; k++) {
            sampler_params_default(&p);
            *fields[k] = odd[i];
            assert_int_equal(sampler_create(&p, 4, &s), MODEL_EINVAL);
        }
    }
    assert_null(s);
    sampler_free(NULL);
}

static void test_stop_strings(void **state)
{
    (void)state;
    const char *stops[] = {"world", "\n\n"};
    struct stop_matcher m = {.stops = stops, .n_stops = 2};
    size_t emit;
    assert_false(stop_check(&m, "hello wor", 9, &emit));
    assert_int_equal(emit, 6); /* "wor" may still become "world" */
    assert_true(stop_check(&m, "hello world!", 12, &emit));
    assert_int_equal(emit, 6);
    assert_false(stop_check(&m, "a\n", 2, &emit));
    assert_int_equal(emit, 1);
    assert_false(stop_check(&m, "plain", 5, &emit));
    assert_int_equal(emit, 5);
    struct stop_matcher none = {0};
    assert_false(stop_check(&none, "x", 1, &emit));
    assert_int_equal(emit, 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_first_of_ties), cmocka_unit_test(test_repetition_penalty),
        cmocka_unit_test(test_distribution_matches_softmax), cmocka_unit_test(test_filters),
        cmocka_unit_test(test_seed_reproducible), cmocka_unit_test(test_bad_params),
        cmocka_unit_test(test_stop_strings), cmocka_unit_test(test_presence_frequency),
        cmocka_unit_test(test_penalty_window), cmocka_unit_test(test_typical),
        cmocka_unit_test(test_large_vocab_filters),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
