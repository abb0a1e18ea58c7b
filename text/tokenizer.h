/* tokenizer.h - Hugging Face tokenizer.json BPE and Unigram tokenizers.
 *
 * Three families: byte-level BPE (GPT-2 / Llama-3 / Qwen: ByteLevel
 * pre-tokenizer with the model's Split regex, run through PCRE2),
 * SentencePiece-style BPE (Llama-2 / Mistral / TinyLlama: "▁" normalisation,
 * byte_fallback) and SentencePiece Unigram (T5: Viterbi over scored pieces,
 * the Precompiled charsmap normaliser, WhitespaceSplit + Metaspace).
 * Added and special tokens are matched before the model runs.  Decoding
 * streams: it never emits half a UTF-8 character.
 */
#ifndef KVTIER_TOKENIZER_H
#define KVTIER_TOKENIZER_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "text/status.h"

typedef struct tokenizer tokenizer;

/* A growable id array owned by the caller (free ids with free()). */
struct tok_ids {
    int32_t *ids;
    size_t n, cap;
};

/* Appends id to v, growing it; TEXT_ENOMEM leaves v as it was. */
enum text_status tok_ids_push(struct tok_ids *v, int32_t id);

/* Loads dir/tokenizer.json and dir/tokenizer_config.json (the latter for
 * add_bos_token / add_eos_token / bos and eos tokens / chat_template). */
enum text_status tokenizer_load(const char *dir, tokenizer **out, char *err);
/* The same from memory: json[0..len) is a tokenizer.json's text, config
 * (NULL: none) what tokenizer_config.json would hold; name stands for the
 * file in messages.  How other model formats (GGUF) bring their vocabulary:
 * written as the tokenizer.json it stands for, loaded by the one loader. */
enum text_status tokenizer_load_json(const char *name, const char *json, size_t len, json_t *config,
                                     tokenizer **out, char *err);
void tokenizer_free(tokenizer *t); /* accepts NULL */

int tokenizer_vocab_size(const tokenizer *t);
int32_t tokenizer_bos_id(const tokenizer *t); /* -1 when none */
int32_t tokenizer_eos_id(const tokenizer *t); /* -1 when none */
/* tokenizer_config.json's chat_template (a string or a list of {name,
 * template}), or NULL. */
const json_t *tokenizer_chat_template(const tokenizer *t);

/* Appends the ids of text[0..len) to out.  add_special: add BOS/EOS as the
 * tokenizer's post-processor / tokenizer_config.json say (add_bos_token).
 * Special-token text in the input ("<|im_start|>") becomes its id.
 * Errors: TEXT_ENOMEM (out unchanged beyond its old n), TEXT_EINVAL for
 * invalid UTF-8 (err names the byte offset). */
enum text_status tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_special,
                                   struct tok_ids *out, char *err);

/* Streaming decoder state; zero-initialise it before the first token. */
struct tok_stream {
    unsigned char pending[8]; /* bytes of an incomplete UTF-8 character */
    int n_pending;
    bool started;             /* a token was emitted (SentencePiece strips the first space) */
};

/* Decodes one token, writing only complete UTF-8 characters to out
 * (at most cap bytes; 64 is always enough for one token plus pending bytes
 * unless a single piece is longer, in which case the return value is the
 * size needed and nothing is written).  skip_special drops special tokens.
 * Returns the number of bytes written. */
size_t tokenizer_decode_stream(const tokenizer *t, struct tok_stream *st, int32_t id, bool skip_special, char *out,
                               size_t cap);

/* Ends a stream: a character it left incomplete becomes one U+FFFD, as a
 * UTF-8 decoder makes of a truncated sequence (transformers decodes with
 * errors="replace").  Returns the bytes it makes, 0 or 3, written to out
 * when cap holds them (else nothing changes). */
size_t tokenizer_decode_flush(struct tok_stream *st, char *out, size_t cap);

/* The raw bytes id decodes to, before UTF-8 reassembly and the decoder's
 * leading-space strip (NULL when id is out of range); *special: a special
 * token, which skip_special drops. */
const char *tokenizer_token_bytes(const tokenizer *t, int32_t id, size_t *len, bool *special);

/* Decodes ids to a NUL-terminated malloc'd string (*out); invalid bytes at
 * the very end are dropped. */
enum text_status tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n, bool skip_special, char **out,
                                   size_t *len);

#endif
