/* tokenizer_internal.h - what the tokenizer files share; not a public API.
 *
 * Every string the tokenizer keeps (vocab pieces, added tokens, decoded
 * pieces, normaliser arguments) lives in one arena and is referred to by
 * (offset, length), so loading 150k pieces costs a handful of allocations.
 */
#ifndef KVTIER_TOKENIZER_INTERNAL_H
#define KVTIER_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/status.h"
#include "text/tokenizer.h"

/* Ids at or above this are refused at load: it bounds the per-id tables a
 * hostile file can make us allocate (the largest real vocabularies are ~260k). */
#define TOK_MAX_IDS (1 << 22)

enum { TOKF_VOCAB = 1, TOKF_ADDED = 2, TOKF_SPECIAL = 4 };

struct tok_span {
    uint32_t off, len;
};

/* A growable byte buffer (also used as uint32_t scratch: malloc aligns it). */
struct tok_buf {
    char *p;
    size_t n, cap;
};
bool tok_buf_reserve(struct tok_buf *b, size_t extra);
bool tok_buf_append(struct tok_buf *b, const void *data, size_t len);

struct tok_added {
    struct tok_span s;
    int32_t id;
    bool special, lstrip, rstrip, single_word;
};

enum tok_norm_op { TOK_NORM_NFC, TOK_NORM_PREPEND, TOK_NORM_REPLACE, TOK_NORM_PRECOMPILED, TOK_NORM_STRIP };
struct tok_norm {
    enum tok_norm_op op;
    struct tok_span from, to; /* Replace: from -> to; Prepend: to */
    pcre2_code *re;           /* Replace with a Regex pattern (from is its text) */
    bool left, right;         /* Strip: which ends lose their whitespace */
};

/* A SentencePiece precompiled_charsmap: a Darts double-array trie over
 * UTF-8 byte strings whose values are offsets of NUL-terminated
 * replacements in norm.  Validated at load: every unit a lookup can reach
 * is in range and every value names a terminated, valid UTF-8 string. */
struct tok_charsmap {
    uint32_t *units;
    uint32_t n_units;
    struct tok_span norm; /* in the arena */
};

/* The longest key of the charsmap that s[0..n) starts with, ending on a
 * character boundary: its length (0: none) and its replacement. */
size_t tok_charsmap_match(const tokenizer *t, const char *s, size_t n, struct tok_span *repl);

enum tok_prepend { TOK_PREPEND_NEVER, TOK_PREPEND_FIRST, TOK_PREPEND_ALWAYS };

/* What a Split pre-tokenizer does with the text its pattern matches (Hugging
 * Face's names): on "the-final--countdown" split at '-', Removed gives
 * the|final|countdown, Isolated the|-|final|-|-|countdown, MergedWithPrevious
 * the-|final-|-|countdown, MergedWithNext the|-final|-|-countdown and
 * Contiguous the|-|final|--|countdown. */
enum tok_split_behavior {
    TOK_SPLIT_REMOVED,
    TOK_SPLIT_ISOLATED,
    TOK_SPLIT_MERGED_WITH_PREVIOUS,
    TOK_SPLIT_MERGED_WITH_NEXT,
    TOK_SPLIT_CONTIGUOUS,
};

struct tok_split {
    pcre2_code *re;
    enum tok_split_behavior behavior;
    bool invert; /* the text between matches is the delimiter */
};

struct tok_merge_slot {
    uint64_t key; /* left id << 32 | right id; UINT64_MAX = empty */
    uint32_t rank;
    int32_t merged;
};

struct tokenizer {
    struct tok_buf str; /* the arena */
    int32_t n_ids;      /* highest id + 1 */
    struct tok_span *piece; /* [n_ids] model-vocab string (flags say if any) */
    struct tok_span *dec;   /* [n_ids] the bytes the token decodes to */
    uint8_t *flags;         /* [n_ids] TOKF_* */
    int32_t *vocab_tab;     /* string -> id, open addressing, -1 = empty */
    uint32_t vocab_mask;
    struct tok_merge_slot *merge_tab;
    uint32_t merge_mask;

    struct tok_added *added; /* sorted by first byte, then longest first */
    int n_added;
    uint16_t added_first[257]; /* added[added_first[b] .. added_first[b+1]) start with byte b */

    struct tok_norm *norm;
    int n_norm;
    bool metaspace;           /* Metaspace pre-tokenizer: ' ' -> meta_repl */
    int meta_at;              /* it runs on the pieces of the splits before it */
    struct tok_span meta_repl;
    enum tok_prepend meta_prepend;
    bool byte_level;          /* ByteLevel pre-tokenizer: model sees mapped bytes */
    bool prefix_space;        /* its add_prefix_space */
    struct tok_split *splits; /* applied in order */
    int n_splits;

    bool byte_fallback, ignore_merges, fuse_unk;
    int32_t unk_id;
    /* Unigram: per-id log-probabilities, the score of an unknown
     * character (the lowest minus 10, as SentencePiece) and the longest
     * piece in bytes, which bounds the Viterbi prefix search. */
    bool unigram;
    double *score;
    double unk_score;
    uint32_t max_piece;
    struct tok_charsmap charsmap; /* the Precompiled normaliser's (units NULL: none) */
    int32_t byte_token[256]; /* <0xNN> ids for byte_fallback (-1 = absent) */

    int32_t *prefix_ids, *suffix_ids; /* added around the text when add_special */
    int n_prefix, n_suffix;
    bool strip_first_space; /* the decoder drops the output's leading space */

    int32_t bos_id, eos_id;
    json_t *chat_template; /* a string or a list of {name, template} */
};

/* Id of the model-vocab piece s[0..n), or -1. */
int32_t tok_vocab_find(const tokenizer *t, const char *s, size_t n);

/* The merge of the pair (left, right), or NULL. */
const struct tok_merge_slot *tok_merge_find(const tokenizer *t, int32_t left, int32_t right);

/* GPT-2's reversible byte <-> printable code point table. */
uint32_t tok_byte_to_cp(unsigned b);
int tok_cp_to_byte(uint32_t cp); /* -1 if cp is not one of the 256 */

/* Length of the valid UTF-8 character at s[0..n), 0 if invalid (overlong,
 * surrogate, > U+10FFFF or truncated); *cp receives the code point. */
size_t tok_utf8_next(const unsigned char *s, size_t n, uint32_t *cp);
size_t tok_utf8_put(uint32_t cp, char *out); /* writes 1..4 bytes */

/* A cursor over JSON text (tokenizer_json.c).  Calls return false
 * (or -1) on malformed input with error naming what was expected at p. */
struct tok_json {
    const char *s, *p, *end;
    const char *error;
};
void tj_ws(struct tok_json *j);
bool tj_string(struct tok_json *j, struct tok_buf *out); /* decoded, not NUL-terminated */
bool tj_int(struct tok_json *j, long long *v);
bool tj_real(struct tok_json *j, double *v); /* a finite JSON number */
bool tj_skip(struct tok_json *j);                        /* one value, any kind */
/* Steps through an array (open '[') or object ('{'): 1 when an element
 * follows, 0 after the closing bracket, -1 on error; *first starts true. */
int tj_next(struct tok_json *j, char open, char close, bool *first);
int tj_member(struct tok_json *j, bool *first, struct tok_buf *key); /* also reads "key": */
void tj_where(const struct tok_json *j, int *line, int *col);
int tok_hex_digit(char c); /* -1 if c is not one */

/* NFC: when s[0..n) (valid UTF-8) could change, writes its NFC form to out
 * (replacing its contents) and sets *changed; scratch is reused between
 * calls.  TEXT_ENOMEM, or TEXT_EINVAL if libutf8proc refuses the text. */
enum text_status tok_nfc(const char *s, size_t n, struct tok_buf *out, struct tok_buf *scratch, bool *changed);

/* Standard base64 (padding optional) into out; false if s is not base64
 * or memory ran out (*nomem tells which). */
bool tok_base64(const char *s, size_t n, struct tok_buf *out, bool *nomem);

#endif
