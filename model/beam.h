/* beam.h - beam search decisions with Hugging Face transformers' semantics
 * (the vectorized _beam_search of generation/utils.py, v4.5x), and the
 * permutation of the beams' KV that follows each step.
 *
 * The decisions (beam_search) know nothing of KV: after each forward step
 * the caller hands over the logits of every running beam and gets back,
 * for each new running beam, the beam it continues (its parent) and the
 * token it appends.  beam_reorder then gives each new beam its parent's
 * KV sequence: the first child of a parent takes it over, the others fork
 * it (kv_seq_fork: shared blocks, copy-on-write of the partly filled
 * one), parents without a child are freed.  A whole-cache reorder is never
 * made.
 *
 * Per step, with K = max(2, 1 + n_eos) * num_beams:
 *   - each running beam's logits become log_softmax, then min_new (eos
 *     ids -inf while fewer tokens were generated) and no_repeat_ngram
 *     (tokens that would repeat an n-gram of prompt + beam -inf) apply;
 *   - the running score is added and the K best (beam, token) pairs of
 *     all beams are taken, best first;
 *   - of those, the ones ending in an eos id among the first num_beams
 *     become finished hypotheses scored sum_logprobs / generated **
 *     length_penalty (generated tokens, the eos included, the prompt not),
 *     unless early_stopping is true and num_beams hypotheses are already
 *     finished, or the early-stop heuristic said no improvement is left;
 *     the best num_beams finished hypotheses are kept;
 *   - the first num_beams candidates that did not end continue;
 *   - the search ends when the heuristic finds that the best running beam
 *     cannot beat the worst kept hypothesis (its length: the generated one,
 *     or max_new for early_stopping "never" with length_penalty > 0), when
 *     early_stopping is true and num_beams hypotheses are finished, or at
 *     max_new tokens (every candidate then finishes).
 * Group (diverse) beam search (num_groups > 1) decides as transformers'
 * group beam search with its older scorer instead (beam_step_groups in
 * beam.c; docs/api.md "Beam search").
 * Before the first step one beam runs (the prompt's); HF's other initial
 * beams score -1e9 and can only win when the first one has fewer than K
 * finite candidates, which beam_create rules out (vocab >= K + the banned
 * ids).
 */
#ifndef KVTIER_BEAM_H
#define KVTIER_BEAM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

#define BEAM_MAX_BEAMS 256

enum beam_early {
    BEAM_EARLY_FALSE = 0, /* HF's default: stop by the heuristic at the current length */
    BEAM_EARLY_TRUE = 1,  /* stop as soon as num_beams hypotheses are finished */
    BEAM_EARLY_NEVER = 2, /* the heuristic at the longest possible length */
};

struct beam_params {
    int num_beams;       /* 1 < num_beams <= BEAM_MAX_BEAMS */
    int num_return;      /* 1 <= num_return <= num_beams */
    float length_penalty;
    enum beam_early early_stopping;
    int max_new;         /* >= 1 */
    int min_new;         /* 0 = off */
    int no_repeat_ngram; /* 0 = off */
    const int32_t *eos;  /* the ids that finish a beam (copied); none: only max_new ends one */
    int n_eos;
    /* group (diverse) beam search when num_groups > 1: it divides
     * num_beams, and diversity_penalty > 0 (beam_step_groups in beam.c) */
    int num_groups;
    float diversity_penalty;
};

struct beam_hyp {
    float score;          /* sum_logprobs / n_gen ** length_penalty */
    int n_gen;
    const int32_t *toks;  /* the generated ids, the eos included */
    bool eos;             /* ended by an eos id (else by max_new) */
};

typedef struct beam_search beam_search;

/* MODEL_EINVAL (the message in err) for parameters out of range or a
 * vocabulary too small for K candidates; MODEL_ENOMEM. */
enum model_status beam_create(const struct beam_params *p, int vocab, const int32_t *prompt, size_t n_prompt,
                              beam_search **out, char *err);
void beam_free(beam_search *b); /* accepts NULL */

/* Beams whose logits the next step needs: 1 before the first step, then num_beams. */
int beam_running(const beam_search *b);
/* Running beam i's ids: prompt + generated (*n of them). */
const int32_t *beam_tokens(const beam_search *b, int i, size_t *n);
/* Generated tokens of every running beam (0 before the first step). */
int beam_generated(const beam_search *b);

/* One step: logits[i] is running beam i's next-token logits (not
 * modified).  Afterwards beam_running() beams run; parent[k] (room for
 * num_beams) is the beam new beam k continues.  Sets *done when the
 * search ended (parent[] is then unset).  MODEL_EINVAL once done. */
enum model_status beam_step(beam_search *b, const float *const *logits, int *parent, bool *done);
/* The finished hypotheses, best first: at most num_return. */
int beam_results(const beam_search *b);
struct beam_hyp beam_result(const beam_search *b, int i);

/* kv[0, n_old) are the old running beams' sequences; afterwards kv[k]
 * for k < n_new is new beam k's (parent[k]'s KV), old ones without a
 * child are freed.  tmp has room for BEAM_MAX_BEAMS entries.  On failure
 * (a fork's TIER_ENOMEM_HOST) every sequence is still in kv[0, n_new)
 * or freed, none leaks, and the caller ends the search: kv[k] may be
 * NULL.  *freed_copied is increased by the copied_bytes of the freed
 * sequences. */
enum tier_status beam_reorder(kv_seq **kv, int n_old, const int *parent, int n_new, kv_seq **tmp,
                              uint64_t *freed_copied);

/* What a whole-cache reorder (HF's reorder_cache: every layer's K and V
 * gathered by beam index) would copy for n_beams beams of len tokens:
 * each layer's stored rows (a sliding layer at most its window; window >
 * 0 bounds every layer, as a sliding_window or sink cache does). */
uint64_t beam_whole_reorder_bytes(const struct model_config *c, enum be_dtype dtype, int n_beams, int64_t len,
                                  int window);

/* The KV figures of one search: forward steps after the prefill, bytes
 * copied (kv_seq_stats().copied_bytes of every beam's sequence, forks and
 * copy-on-write) and what whole-cache reorders would have copied. */
struct beam_kv_stats {
    int steps;
    uint64_t copied_bytes, whole_reorder_bytes;
};

/* The single-request loop of the tools: prompt[0, n) prefilled once on a
 * new sequence of kp (NULL: dynamic), then beam_step and beam_reorder until
 * the search ends; the results stay in *out (beam_free). */
enum model_status beam_generate(model *m, kv_store *store, const struct kv_seq_params *kp, const int32_t *prompt,
                                size_t n, const struct beam_params *p, beam_search **out, struct beam_kv_stats *ks,
                                char *err);

#endif
