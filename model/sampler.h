/* sampler.h - private to model/ (generate.c, sampler.c) and its unit
 * tests: the sampler and the stop-string matcher behind gen_seq.  Not part
 * of the API.
 */
#ifndef KVTIER_SAMPLER_H
#define KVTIER_SAMPLER_H

#include "model/generate.h"

enum model_status sampler_create(const struct sampler_params *p, int vocab, sampler **out);
void sampler_free(sampler *s); /* accepts NULL */
/* Picks the next token.  logits[vocab] is modified in place (penalised,
 * scaled, filtered).  history: tokens seen so far, the prompt's n_prompt
 * first, for the repetition penalty (all of them) and the presence and
 * frequency penalties (the generated ones after the prompt). */
int32_t sampler_sample(sampler *s, float *logits, const int32_t *history, size_t n_hist, size_t n_prompt);

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

#endif
