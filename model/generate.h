/* generate.h - the per-sequence generation logic (gen_seq) that the tools'
 * loop and the daemon's batched loop share, and the single-sequence loop.
 *
 * The sampler (model/sampler.h) follows the Hugging Face logits-processor
 * order: repetition_penalty -> presence/frequency penalties -> temperature
 * -> top_k -> top_p -> min_p -> typical_p -> sample.  temperature == 0 is
 * greedy (argmax, first index on ties) after the penalties.
 */
#ifndef KVTIER_GENERATE_H
#define KVTIER_GENERATE_H

#include <pthread.h>

#include "model/model.h"
#include "text/grammar.h"
#include "text/tokenizer.h"

/* The ids that end a sequence: the eos ids of config.json /
 * generation_config.json and the tokenizer's own eos token, each once,
 * into out[MODEL_MAX_EOS + 1]; returns how many. */
int gen_eos_ids(const struct model_config *c, const tokenizer *tok, int32_t *out);

/* The model layer's reading of a tokenizer failure. */
enum model_status model_from_text(enum text_status st);

struct sampler_params {
    float temperature;        /* 0 = greedy */
    int top_k;                /* 0 = off */
    float top_p;              /* 1 = off */
    float min_p;              /* 0 = off */
    float repetition_penalty; /* 1 = off */
    int penalty_last_n;       /* repetition_penalty sees the last n tokens of the history; 0 = all of it */
    float presence_penalty;   /* OpenAI's: subtracted once from every token the sequence generated; 0 = off */
    float frequency_penalty;  /* ... times the number of times it generated it; 0 = off */
    float typical_p;          /* locally typical sampling's mass (HF TypicalLogitsWarper); 1 = off */
    uint64_t seed;
};
void sampler_params_default(struct sampler_params *p); /* greedy, everything off, seed 0 */

typedef struct sampler sampler;

/* Why a sequence ended; GEN_FINISH_NONE while it goes on. */
enum gen_finish { GEN_FINISH_NONE = 0, GEN_FINISH_LENGTH, GEN_FINISH_EOS, GEN_FINISH_STOP, GEN_FINISH_CALLBACK };

struct gen_seq_params {
    struct sampler_params sampling;
    int max_new;              /* generated tokens at most; the context bounds them too */
    int ctx;                  /* prompt + generated tokens at most */
    bool ignore_eos;
    int min_new;              /* the eos ids cannot be sampled before this many generated tokens */
    const char *const *stops; /* stop strings, borrowed for the sequence's lifetime */
    int n_stops;
    /* Held while the text buffer moves, so that another thread may read
     * text[0, vis) under it (the daemon's event loop); NULL: no reader. */
    pthread_mutex_t *text_lock;
    /* Constrained output (borrowed, both or neither): each step samples
     * only tokens that keep the text a prefix of a document the grammar
     * accepts and that leave room to complete it within max_new; the eos
     * ids only once it is complete.  A document nothing may follow ends
     * the sequence as eos would. */
    const gram *grammar;
    const gram_vocab *gvocab;
};

/* One generated sequence, the per-token logic every generation loop
 * shares: sampling, end of sequence, the length limit, streaming decode
 * and stop strings.  The caller runs the forward passes and feeds
 * toks[fed, n_toks) to its KV. */
struct gen_seq {
    int32_t *toks;          /* prompt + generated ids; allocated once, never moves */
    size_t n_toks, n_prompt;
    int gen;                /* generated ids */
    char *text;             /* decoded text of the generated ids (text_lock held when it moves) */
    size_t vis;             /* text[0, vis) is final: it never holds part of a stop string */
    enum gen_finish finish; /* the caller may set it for a sequence it ends itself */
    /* ---- private ---- */
    size_t raw, scan, text_cap; /* decoded bytes; where stop matching resumes */
    int max_new, min_new;
    bool ignore_eos;
    const char *const *stops;
    int n_stops;
    pthread_mutex_t *text_lock;
    const struct model_config *mc;
    const tokenizer *tok;
    sampler *smp;
    struct tok_stream ts;
    const gram_vocab *gvocab;
    struct gram_state *gstate; /* [1 + gram_vocab_depth] the state, then the mask's scratch */
    bool *allow;               /* [vocab] */
    float *gram_logits;        /* [vocab] the logits before a draw the grammar may refuse */
    bool gram_end;             /* the grammar allows nothing more: the next accept ends */
};

/* Sets s up for prompt[0, n) (copied; n >= 1).  On failure s is left so
 * that gen_seq_free accepts it: MODEL_EINVAL for sampling parameters the
 * sampler refuses, MODEL_ENOMEM. */
enum model_status gen_seq_init(struct gen_seq *s, const struct model_config *c, const tokenizer *tok,
                               const struct gen_seq_params *p, const int32_t *prompt, size_t n);
/* The next id from the logits of toks[n_toks - 1], which are penalised,
 * scaled and filtered (and masked by the grammar) in place. */
int32_t gen_seq_sample(struct gen_seq *s, float *logits);
/* Appends id and decides whether the sequence ends (s->finish).  The text
 * grows by what id decodes to; what can no longer become a stop string is
 * visible (vis), and on any end but a stop string the held-back rest is
 * too.  MODEL_ENOMEM when the text cannot grow. */
enum model_status gen_seq_accept(struct gen_seq *s, int32_t id);
/* Frees the sampler's scratch once no more ids come; ids and text stay. */
void gen_seq_end(struct gen_seq *s);
void gen_seq_free(struct gen_seq *s); /* accepts a zeroed one */

struct gen_params {
    struct sampler_params sampling;
    int max_new_tokens;       /* 0 = until eos or the context is full */
    bool ignore_eos;
    bool use_cache;           /* false: recompute the whole prefix every step (HF use_cache=False) */
    const struct kv_seq_params *kv; /* the sequence's strategy and its parameters; NULL: dynamic */
    const char *const *stops; /* stop strings */
    int n_stops;
    /* (optional) sees each step's raw logits before sampling (tests, dumps) */
    void (*on_logits)(void *ud, const float *logits, int vocab);
    void *logits_ud;
};
void gen_params_default(struct gen_params *p);

/* log(sum(exp(x[i]))) over n > 0 logits, in double, the max taken out
 * first so that exp cannot overflow whatever their scale: what turns
 * logits into log-probabilities (x[i] - it). */
double gen_log_sum_exp(const float *x, int n);

/* Called for each piece of text ready to emit; return false to stop. */
typedef bool (*gen_text_cb)(void *ud, const char *text, size_t len);

struct gen_result {
    struct gen_seq seq;       /* ids, text and finish; the caller frees it with gen_seq_free */
    double prefill_ms, decode_ms;
};

/* Generates from prompt[0..n) with a fresh KV sequence in store (of p->kv). */
enum model_status generate(model *m, const tokenizer *tok, kv_store *store, const int32_t *prompt, size_t n,
                           const struct gen_params *p, gen_text_cb cb, void *ud, struct gen_result *res,
                           char *err);

#endif
