/* generate.h - sampling and the single-sequence generation loop.
 *
 * The sampler follows the Hugging Face logits-processor order:
 * repetition_penalty -> temperature -> top_k -> top_p -> min_p -> sample.
 * temperature == 0 is greedy (argmax, first index on ties).
 */
#ifndef KVTIER_GENERATE_H
#define KVTIER_GENERATE_H

#include "model/model.h"
#include "text/tokenizer.h"

/* The model layer's reading of a tokenizer failure. */
enum model_status model_from_text(enum text_status st);

struct sampler_params {
    float temperature;        /* 0 = greedy */
    int top_k;                /* 0 = off */
    float top_p;              /* 1 = off */
    float min_p;              /* 0 = off */
    float repetition_penalty; /* 1 = off */
    uint64_t seed;
};
void sampler_params_default(struct sampler_params *p); /* greedy, everything off, seed 0 */

typedef struct sampler sampler;
enum model_status sampler_create(const struct sampler_params *p, int vocab, sampler **out);
void sampler_free(sampler *s); /* accepts NULL */
/* Picks the next token.  logits[vocab] is modified in place (penalised,
 * scaled, filtered).  history: tokens seen so far (prompt + generated), for
 * the repetition penalty. */
int32_t sampler_sample(sampler *s, float *logits, const int32_t *history, size_t n_hist);

/* Stop-string matcher over streamed text: reports how many bytes of the text
 * so far are safe to emit (cannot be the start of a stop string) and whether
 * a stop string was completed. */
struct stop_matcher {
    const char *const *stops;
    int n_stops;
};
/* Returns true when text[0..len) contains a stop string; *emit_len is then
 * the length of the text before it.  Otherwise *emit_len is the length that
 * can be emitted without risking a partial stop string. */
bool stop_check(const struct stop_matcher *m, const char *text, size_t len, size_t *emit_len);

/* Whether id ends generation: one of the eos ids of config.json /
 * generation_config.json, or the tokenizer's own eos token. */
bool gen_is_eos(const struct model_config *c, const tokenizer *tok, int32_t id);

enum gen_finish { GEN_FINISH_LENGTH = 0, GEN_FINISH_EOS, GEN_FINISH_STOP, GEN_FINISH_CALLBACK };

struct gen_params {
    struct sampler_params sampling;
    int max_new_tokens;       /* 0 = until eos or the context is full */
    bool ignore_eos;
    bool use_cache;           /* false: recompute the whole prefix every step (HF use_cache=False) */
    const char *const *stops; /* stop strings */
    int n_stops;
    /* (optional) sees each step's raw logits before sampling (tests, dumps) */
    void (*on_logits)(void *ud, const float *logits, int vocab);
    void *logits_ud;
};
void gen_params_default(struct gen_params *p);

/* Called for each piece of text ready to emit; return false to stop. */
typedef bool (*gen_text_cb)(void *ud, const char *text, size_t len);

struct gen_result {
    struct tok_ids tokens;    /* generated ids (caller frees tokens.ids) */
    enum gen_finish finish;
    double prefill_ms, decode_ms;
};

/* Generates from prompt[0..n) with a fresh dynamic KV sequence in store. */
enum model_status generate(model *m, const tokenizer *tok, kv_store *store, const int32_t *prompt, size_t n,
                           const struct gen_params *p, gen_text_cb cb, void *ud, struct gen_result *res,
                           char *err);

#endif
