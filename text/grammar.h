/* grammar.h - constrained JSON output: a JSON schema (a documented subset)
 * compiled into a byte-level pushdown automaton, and the vocabulary mask it
 * gives at each sampling step.
 *
 * The automaton accepts exactly the byte strings that are a prefix of a
 * JSON document matching the schema, written without whitespace before
 * the document or after it and at most GRAM_MAX_WS bytes of it in a row, numbers of bounded length, object keys without
 * escapes (known names are matched as json-encoded) and no duplicate known
 * keys.  Besides "is this byte allowed" it answers "how many bytes at least
 * until the document is complete" (gram_min_close), so that a generator with
 * a token budget can steer to a complete document before it runs out.
 *
 * Supported schema keywords: type (one or a list), properties, required,
 * additionalProperties (false, true or a schema), items, minItems,
 * maxItems, minLength, maxLength, enum, const, anyOf (alternatives of
 * different types); title, description, $schema, $comment, default and
 * examples are ignored.  Any other keyword is refused by name.
 */
#ifndef KVTIER_TEXT_GRAMMAR_H
#define KVTIER_TEXT_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "text/status.h"
#include "text/tokenizer.h"

#define GRAM_DEPTH 24      /* nesting of the output's values: a container in the last level stays empty */
#define GRAM_MAX_WS 2      /* whitespace bytes in a row */
#define GRAM_MAX_PROPS 64  /* properties of one object schema */
#define GRAM_MAX_LITS 64   /* values of one enum */

typedef struct gram gram;

/* schema NULL: any JSON object (response_format json_object).  Errors:
 * TEXT_EUNSUPPORTED naming the keyword (*bad_key, borrowed from the
 * schema, else NULL), TEXT_EINVAL for a malformed schema, TEXT_ENOMEM; err
 * says where (a JSON pointer into the schema). */
enum text_status gram_compile(const json_t *schema, gram **out, const char **bad_key, char *err);

/* A forced function call: {"name": <one of names>, "arguments": <its
 * params schema>}, in that key order.  params[i] NULL: any object. */
enum text_status gram_compile_calls(const char *const *names, const json_t *const *params, int n, gram **out,
                                    const char **bad_key, char *err);
void gram_free(gram *g); /* accepts NULL */

struct gram_frame {
    uint16_t node, child;
    uint8_t kind, phase, a, b;
    uint32_t n;
    uint64_t m, m2;
};

/* Where the automaton is; copy it freely (only depth frames matter). */
struct gram_state {
    const gram *g;
    int depth;
    int ws; /* whitespace bytes in a row */
    struct gram_frame f[GRAM_DEPTH];
};

void gram_start(const gram *g, struct gram_state *s);
/* Feeds one byte; false (s unchanged) when no valid document continues so. */
bool gram_step(struct gram_state *s, unsigned char c);
/* Feeds p[0, n); false (s then undefined) at the first byte refused. */
bool gram_feed(struct gram_state *s, const char *p, size_t n);
/* The document is complete and nothing may follow it. */
bool gram_complete(const struct gram_state *s);
/* The document is complete: nothing more is needed (a number or literal
 * at the top may still go on). */
bool gram_can_end(const struct gram_state *s);
/* The least number of bytes that complete the document. */
size_t gram_min_close(const struct gram_state *s);

/* The tokenizer's tokens as a trie of their bytes, built once. */
typedef struct gram_vocab gram_vocab;
enum text_status gram_vocab_create(const tokenizer *t, gram_vocab **out);
void gram_vocab_free(gram_vocab *v); /* accepts NULL */

/* States gram_mask needs as scratch: the longest token's bytes + 1. */
size_t gram_vocab_depth(const gram_vocab *v);

/* allow[0, n_allow) = whether each token keeps the output a valid prefix and
 * leaves at most budget - 1 bytes to complete it (budget: tokens left,
 * this one included; <= 0: no limit).  eos[0, n_eos) are allowed only
 * when the document is complete, and then alone.  When the budget leaves
 * nothing, the tokens are those the grammar alone allows (the length limit
 * then cuts the document).  scratch: gram_vocab_depth(v) states.  Returns
 * how many are allowed (0: none, not even an eos). */
int gram_mask(const gram_vocab *v, const struct gram_state *s, int budget, const int32_t *eos, int n_eos,
              bool *allow, int n_allow, struct gram_state *scratch);

#endif
