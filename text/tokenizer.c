/* tokenizer.c - loading a Hugging Face tokenizer.json (+ tokenizer_config.json)
 * into the tables tokenizer_encode.c and tokenizer_decode.c use.  One file
 * over 1,000 lines: every component of tokenizer.json is read through the
 * same loader state and checks, and reads top to bottom in file order.
 *
 * Everything read from the files is checked before use: ids against
 * TOK_MAX_IDS, merges against the vocabulary, every component type against
 * what the encoder implements (an unknown one is TEXT_EUNSUPPORTED rather
 * than a silently different tokenisation).
 */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "text/tokenizer_internal.h"
#include "util/file.h"

/* GPT-2's pre-tokenizer regex, used by ByteLevel when use_regex is true. */
static const char GPT2_REGEX[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* A loading session: the tokenizer being built, the file name for
 * messages and the caller's error buffer. */
enum dec_op_kind { DEC_BYTE_LEVEL, DEC_REPLACE, DEC_BYTE_FALLBACK };
struct dec_op {
    enum dec_op_kind kind;
    struct tok_span from, to; /* DEC_REPLACE */
};
#define MAX_DEC_OPS 8

struct loader {
    tokenizer *t;
    const char *file;
    char *err;
    bool has_template;    /* the post-processor decides BOS/EOS */
    struct dec_op ops[MAX_DEC_OPS]; /* per-token decoder steps, in order */
    int n_ops;
    bool fused;           /* a Fuse step was seen: later steps see the whole text */
};

#define LFAIL(L, st, ...) text_errf((L)->err, (st), __VA_ARGS__)
#define TRY(expr)                                                                                                    \
    do {                                                                                                             \
        enum text_status st_ = (expr);                                                                              \
        if (st_ != TEXT_OK)                                                                                         \
            return st_;                                                                                              \
    } while (0)

static enum text_status oom(struct loader *L)
{
    return LFAIL(L, TEXT_ENOMEM, "%s: out of memory", L->file);
}

/* Copies s[0..n) into the arena. */
static enum text_status intern(struct loader *L, const char *s, size_t n, struct tok_span *out)
{
    if (n > UINT32_MAX || L->t->str.n > UINT32_MAX - n)
        return LFAIL(L, TEXT_EFORMAT, "%s: strings exceed 4 GiB", L->file);
    out->off = (uint32_t)L->t->str.n;
    out->len = (uint32_t)n;
    return tok_buf_append(&L->t->str, s, n) ? TEXT_OK : oom(L);
}

static const char *span_str(const tokenizer *t, struct tok_span s)
{
    return t->str.p + s.off;
}

/* ---- JSON field access with messages naming the field ------------------ */

static enum text_status get_string(struct loader *L, json_t *obj, const char *key, const char *where, bool required,
                                    const char **out, size_t *len)
{
    json_t *v = json_object_get(obj, key);
    *out = NULL;
    *len = 0;
    if (!v || json_is_null(v)) {
        if (required)
            return LFAIL(L, TEXT_EFORMAT, "%s: %s.%s is missing", L->file, where, key);
        return TEXT_OK;
    }
    if (!json_is_string(v))
        return LFAIL(L, TEXT_EFORMAT, "%s: %s.%s is not a string", L->file, where, key);
    *out = json_string_value(v);
    *len = json_string_length(v);
    return TEXT_OK;
}

static enum text_status get_bool(struct loader *L, json_t *obj, const char *key, const char *where, bool dflt,
                                  bool *out)
{
    json_t *v = json_object_get(obj, key);
    *out = dflt;
    if (!v || json_is_null(v))
        return TEXT_OK;
    if (!json_is_boolean(v))
        return LFAIL(L, TEXT_EFORMAT, "%s: %s.%s is not a boolean", L->file, where, key);
    *out = json_is_true(v);
    return TEXT_OK;
}

static enum text_status get_type(struct loader *L, json_t *obj, const char *where, const char **type)
{
    size_t len;
    if (!json_is_object(obj))
        return LFAIL(L, TEXT_EFORMAT, "%s: %s is not an object", L->file, where);
    return get_string(L, obj, "type", where, true, type, &len);
}

static enum text_status get_id(struct loader *L, json_t *v, const char *where, size_t index, int32_t *out)
{
    if (!json_is_integer(v))
        return LFAIL(L, TEXT_EFORMAT, "%s: %s[%zu] is not an integer id", L->file, where, index);
    json_int_t id = json_integer_value(v);
    if (id < 0 || id >= TOK_MAX_IDS)
        return LFAIL(L, TEXT_EFORMAT, "%s: %s[%zu]: id %lld out of range [0, %d)", L->file, where, index,
                     (long long)id, TOK_MAX_IDS);
    *out = (int32_t)id;
    return TEXT_OK;
}

/* "String" or "Regex" pattern object of Split / Replace. */
static enum text_status get_pattern(struct loader *L, json_t *obj, const char *where, const char **s, size_t *len,
                                     bool *is_regex)
{
    json_t *p = json_object_get(obj, "pattern");
    if (!json_is_object(p))
        return LFAIL(L, TEXT_EFORMAT, "%s: %s.pattern is missing or not an object", L->file, where);
    *is_regex = json_object_get(p, "Regex") != NULL;
    TRY(get_string(L, p, *is_regex ? "Regex" : "String", where, true, s, len));
    return TEXT_OK;
}

/* ---- vocabulary and merges --------------------------------------------- */

static uint32_t hash_bytes(const char *s, size_t n)
{
    return (uint32_t)XXH3_64bits(s, n);
}

int32_t tok_vocab_find(const tokenizer *t, const char *s, size_t n)
{
    if (!t->vocab_tab)
        return -1;
    for (uint32_t h = hash_bytes(s, n) & t->vocab_mask;; h = (h + 1) & t->vocab_mask) {
        int32_t id = t->vocab_tab[h];
        if (id < 0)
            return -1;
        struct tok_span p = t->piece[id];
        if (p.len == n && memcmp(t->str.p + p.off, s, n) == 0)
            return id;
    }
}

static uint32_t table_mask(size_t n)
{
    uint32_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    return cap - 1;
}

/* A syntax error at the cursor, as "file:line:col: expected ...". */
static enum text_status syntax(struct loader *L, const struct tok_json *j, const char *member)
{
    int line, col;
    if (j->error && strcmp(j->error, "memory") == 0)
        return oom(L);
    tj_where(j, &line, &col);
    return LFAIL(L, TEXT_EFORMAT, "%s:%d:%d: %s: expected %s", L->file, line, col, member,
                 j->error ? j->error : "valid JSON");
}

struct vocab_entry {
    int32_t id;
    struct tok_span s;
};

/* Fills piece[] and the string -> id table from the entries e[0..n), whose
 * ids are at most max_id; a repeated id or string is an error. */
static enum text_status index_vocab(struct loader *L, const struct vocab_entry *e, size_t n, int32_t max_id)
{
    tokenizer *t = L->t;
    enum text_status st = TEXT_OK;
    if (n == 0)
        return LFAIL(L, TEXT_EFORMAT, "%s: model.vocab is empty", L->file);
    t->vocab_mask = table_mask(n);
    t->vocab_tab = malloc(((size_t)t->vocab_mask + 1) * sizeof *t->vocab_tab);
    t->piece = malloc(((size_t)max_id + 1) * sizeof *t->piece);
    if (!t->vocab_tab || !t->piece)
        return oom(L);
    memset(t->vocab_tab, 0xFF, ((size_t)t->vocab_mask + 1) * sizeof *t->vocab_tab);
    /* Until finish_tables() sizes the flags, off == UINT32_MAX marks an id
     * the vocabulary does not use. */
    for (int32_t i = 0; i <= max_id; i++)
        t->piece[i].off = UINT32_MAX;
    for (size_t i = 0; st == TEXT_OK && i < n; i++) {
        const char *str = span_str(t, e[i].s);
        if (t->piece[e[i].id].off != UINT32_MAX)
            st = LFAIL(L, TEXT_EFORMAT, "%s: model.vocab: id %d is given to both \"%.*s\" and \"%.*s\"", L->file,
                       e[i].id, (int)(t->piece[e[i].id].len > 64 ? 64 : t->piece[e[i].id].len),
                       span_str(t, t->piece[e[i].id]), (int)(e[i].s.len > 64 ? 64 : e[i].s.len), str);
        else if (tok_vocab_find(t, str, e[i].s.len) >= 0)
            st = LFAIL(L, TEXT_EFORMAT, "%s: model.vocab: \"%.*s\" appears twice", L->file,
                       (int)(e[i].s.len > 64 ? 64 : e[i].s.len), str);
        if (st != TEXT_OK)
            break;
        t->piece[e[i].id] = e[i].s;
        uint32_t h = hash_bytes(str, e[i].s.len) & t->vocab_mask;
        while (t->vocab_tab[h] >= 0)
            h = (h + 1) & t->vocab_mask;
        t->vocab_tab[h] = e[i].id;
    }
    return st;
}

/* model.vocab, an object of piece -> id, read straight from the text at
 * `at` (NULL: absent). */
static enum text_status load_vocab(struct loader *L, const struct tok_json *json, const char *at, int32_t *max_id)
{
    struct tok_json j = *json;
    struct tok_buf key = {0}, list = {0};
    enum text_status st = TEXT_OK;
    bool first = true;
    int r = 0;
    if (!at || *at != '{')
        return LFAIL(L, TEXT_EFORMAT, "%s: model.vocab is missing or not an object", L->file);
    j.p = at;
    *max_id = -1;
    while (st == TEXT_OK && (r = tj_member(&j, &first, &key)) == 1) {
        long long id;
        struct vocab_entry e;
        if (!tj_int(&j, &id) || id < 0 || id >= TOK_MAX_IDS) {
            st = LFAIL(L, TEXT_EFORMAT, "%s: model.vocab[\"%.*s\"] is not an id in [0, %d)", L->file,
                       (int)(key.n > 64 ? 64 : key.n), key.p, TOK_MAX_IDS);
        } else if ((st = intern(L, key.p, key.n, &e.s)) == TEXT_OK) {
            e.id = (int32_t)id;
            *max_id = e.id > *max_id ? e.id : *max_id;
            if (list.n / sizeof e >= TOK_MAX_IDS)
                st = LFAIL(L, TEXT_EFORMAT, "%s: model.vocab has more than %d entries", L->file, TOK_MAX_IDS);
            else if (!tok_buf_append(&list, &e, sizeof e))
                st = oom(L);
        }
    }
    if (st == TEXT_OK && r < 0)
        st = syntax(L, &j, "model.vocab");
    if (st == TEXT_OK)
        st = index_vocab(L, (const struct vocab_entry *)(void *)list.p, list.n / sizeof(struct vocab_entry), *max_id);
    free(key.p);
    free(list.p);
    return st;
}

/* A Unigram model.vocab: an array of [piece, log-probability], the index
 * being the id; also sets the unknown character's score and the longest
 * piece.  Scores are bounded so that no sum over a text overflows. */
#define UNIGRAM_MAX_SCORE 1e6
static enum text_status load_unigram_vocab(struct loader *L, const struct tok_json *json, const char *at,
                                            int32_t *max_id)
{
    tokenizer *t = L->t;
    struct tok_json j = *json;
    struct tok_buf piece = {0}, list = {0}, scores = {0};
    enum text_status st = TEXT_OK;
    bool first = true;
    int r = 0;
    if (!at || *at != '[')
        return LFAIL(L, TEXT_EFORMAT, "%s: model.vocab is missing or not an array", L->file);
    j.p = at;
    for (size_t i = 0; st == TEXT_OK && (r = tj_next(&j, '[', ']', &first)) == 1; i++) {
        bool inner = true;
        double score;
        struct vocab_entry e = {.id = (int32_t)i};
        tj_ws(&j);
        if (i >= TOK_MAX_IDS) {
            st = LFAIL(L, TEXT_EFORMAT, "%s: model.vocab has more than %d entries", L->file, TOK_MAX_IDS);
        } else if (j.p == j.end || *j.p != '[' || tj_next(&j, '[', ']', &inner) != 1 || !tj_string(&j, &piece) ||
                   tj_next(&j, '[', ']', &inner) != 1 || !tj_real(&j, &score) || tj_next(&j, '[', ']', &inner) != 0) {
            st = j.error && strcmp(j.error, "memory") == 0
                     ? oom(L)
                     : LFAIL(L, TEXT_EFORMAT, "%s: model.vocab[%zu] is not [piece, finite score]", L->file, i);
        } else if (piece.n == 0) {
            st = LFAIL(L, TEXT_EFORMAT, "%s: model.vocab[%zu]: the piece is empty", L->file, i);
        } else if (!(score >= -UNIGRAM_MAX_SCORE && score <= UNIGRAM_MAX_SCORE)) {
            st = LFAIL(L, TEXT_EFORMAT, "%s: model.vocab[%zu]: score %g is outside [-%g, %g]", L->file, i, score,
                       UNIGRAM_MAX_SCORE, UNIGRAM_MAX_SCORE);
        } else if ((st = intern(L, piece.p, piece.n, &e.s)) == TEXT_OK &&
                   (!tok_buf_append(&list, &e, sizeof e) || !tok_buf_append(&scores, &score, sizeof score))) {
            st = oom(L);
        }
        if (st == TEXT_OK && piece.n > t->max_piece)
            t->max_piece = (uint32_t)piece.n;
    }
    if (st == TEXT_OK && r < 0)
        st = syntax(L, &j, "model.vocab");
    size_t n = list.n / sizeof(struct vocab_entry);
    *max_id = (int32_t)n - 1;
    if (st == TEXT_OK)
        st = index_vocab(L, (const struct vocab_entry *)(void *)list.p, n, *max_id);
    if (st == TEXT_OK) {
        t->score = (double *)(void *)scores.p;
        scores.p = NULL;
        double lowest = t->score[0];
        for (size_t i = 1; i < n; i++)
            lowest = t->score[i] < lowest ? t->score[i] : lowest;
        t->unk_score = lowest - 10;
    }
    free(piece.p);
    free(list.p);
    free(scores.p);
    return st;
}

static struct tok_merge_slot *merge_slot(const tokenizer *t, uint64_t key)
{
    uint32_t h = (uint32_t)XXH3_64bits(&key, sizeof key) & t->merge_mask;
    while (t->merge_tab[h].key != UINT64_MAX && t->merge_tab[h].key != key)
        h = (h + 1) & t->merge_mask;
    return &t->merge_tab[h];
}

const struct tok_merge_slot *tok_merge_find(const tokenizer *t, int32_t left, int32_t right)
{
    if (!t->merge_tab)
        return NULL;
    const struct tok_merge_slot *s = merge_slot(t, (uint64_t)left << 32 | (uint32_t)right);
    return s->key == UINT64_MAX ? NULL : s;
}

/* One merge, "a b" or ["a", "b"], as the ids of its halves and result. */
static enum text_status read_merge(struct loader *L, struct tok_json *j, size_t i, struct tok_buf *a,
                                    struct tok_buf *b, int32_t ids[3])
{
    const tokenizer *t = L->t;
    tj_ws(j);
    if (j->p < j->end && *j->p == '"') {
        if (!tj_string(j, a))
            return syntax(L, j, "model.merges");
        char *sp = a->n ? memchr(a->p, ' ', a->n) : NULL; /* "" leaves a->p NULL */
        if (!sp || sp == a->p || sp == a->p + a->n - 1 || memchr(sp + 1, ' ', (size_t)(a->p + a->n - sp - 1)))
            return LFAIL(L, TEXT_EFORMAT, "%s: model.merges[%zu] \"%.*s\" is not two pieces separated by one space",
                         L->file, i, (int)(a->n > 64 ? 64 : a->n), a->p);
        b->n = 0;
        if (!tok_buf_append(b, sp + 1, (size_t)(a->p + a->n - sp - 1)))
            return oom(L);
        a->n = (size_t)(sp - a->p);
    } else {
        bool first = true;
        if (j->p == j->end || *j->p != '[' || tj_next(j, '[', ']', &first) != 1 || !tj_string(j, a) ||
            tj_next(j, '[', ']', &first) != 1 || !tj_string(j, b) || tj_next(j, '[', ']', &first) != 0)
            return LFAIL(L, TEXT_EFORMAT, "%s: model.merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", L->file,
                         i);
    }
    size_t na = a->n;
    ids[0] = tok_vocab_find(t, a->p, na);
    ids[1] = tok_vocab_find(t, b->p, b->n);
    if (!tok_buf_append(a, b->p, b->n))
        return oom(L);
    ids[2] = tok_vocab_find(t, a->p, a->n);
    if (ids[0] >= 0 && ids[1] >= 0 && ids[2] >= 0)
        return TEXT_OK;
    const char *missing = ids[1] < 0 && ids[0] >= 0 ? b->p : a->p;
    size_t len = ids[0] < 0 ? na : ids[1] < 0 ? b->n : a->n;
    return LFAIL(L, TEXT_EFORMAT, "%s: model.merges[%zu]: \"%.*s\" is not in model.vocab", L->file, i,
                 (int)(len > 64 ? 64 : len), missing);
}

/* model.merges from the text at `at` (NULL or null: none). */
static enum text_status load_merges(struct loader *L, const struct tok_json *json, const char *at)
{
    tokenizer *t = L->t;
    if (!at || (json->end - at >= 4 && memcmp(at, "null", 4) == 0))
        return TEXT_OK; /* a vocabulary of single characters */
    if (*at != '[')
        return LFAIL(L, TEXT_EFORMAT, "%s: model.merges is not an array", L->file);
    struct tok_json j = *json;
    struct tok_buf a = {0}, b = {0}, list = {0};
    enum text_status st = TEXT_OK;
    bool first = true;
    int r = 0;
    j.p = at;
    for (size_t i = 0; st == TEXT_OK && (r = tj_next(&j, '[', ']', &first)) == 1; i++) {
        int32_t ids[3];
        if (i >= TOK_MAX_IDS)
            st = LFAIL(L, TEXT_EFORMAT, "%s: model.merges has more than %d entries", L->file, TOK_MAX_IDS);
        else if ((st = read_merge(L, &j, i, &a, &b, ids)) == TEXT_OK && !tok_buf_append(&list, ids, sizeof ids))
            st = oom(L);
    }
    if (st == TEXT_OK && r < 0)
        st = syntax(L, &j, "model.merges");
    size_t n = list.n / (3 * sizeof(int32_t));
    if (st == TEXT_OK) {
        t->merge_mask = table_mask(n);
        if (!(t->merge_tab = malloc(((size_t)t->merge_mask + 1) * sizeof *t->merge_tab)))
            st = oom(L);
    }
    const int32_t *ids = (const int32_t *)(void *)list.p;
    for (size_t i = 0; st == TEXT_OK && i <= t->merge_mask; i++)
        t->merge_tab[i].key = UINT64_MAX;
    for (size_t i = 0; st == TEXT_OK && i < n; i++) {
        /* A repeated pair keeps its last rank, as Hugging Face's loader does. */
        uint64_t key = (uint64_t)ids[3 * i] << 32 | (uint32_t)ids[3 * i + 1];
        *merge_slot(t, key) = (struct tok_merge_slot){key, (uint32_t)i, ids[3 * i + 2]};
    }
    free(a.p);
    free(b.p);
    free(list.p);
    return st;
}

static void find_byte_tokens(tokenizer *t)
{
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        t->byte_token[b] = tok_vocab_find(t, name, 6);
    }
}

/* model.type "Unigram": vocab, unk_id (required: Viterbi needs a piece for
 * a character no piece covers) and byte_fallback. */
static enum text_status load_unigram(struct loader *L, json_t *mj, const struct tok_json *json, const char *vocab,
                                      int32_t *max_id)
{
    tokenizer *t = L->t;
    t->unigram = true;
    TRY(get_bool(L, mj, "byte_fallback", "model", false, &t->byte_fallback));
    TRY(load_unigram_vocab(L, json, vocab, max_id));
    json_t *unk = json_object_get(mj, "unk_id");
    if (!json_is_integer(unk) || json_integer_value(unk) < 0 || json_integer_value(unk) > *max_id)
        return LFAIL(L, TEXT_EFORMAT, "%s: model.unk_id is missing or not an id in [0, %d]", L->file, *max_id);
    t->unk_id = (int32_t)json_integer_value(unk);
    find_byte_tokens(t);
    return TEXT_OK;
}

/* The model object: mj holds its small members; vocab and merges point at
 * those two members' text in json. */
static enum text_status load_model(struct loader *L, json_t *mj, const struct tok_json *json, const char *vocab,
                                    const char *merges, int32_t *max_id)
{
    tokenizer *t = L->t;
    const char *type, *s;
    size_t len;
    /* Old files leave out "type"; vocab + merges is then BPE. */
    TRY(get_string(L, mj, "type", "model", false, &type, &len));
    if (type && strcmp(type, "Unigram") == 0)
        return load_unigram(L, mj, json, vocab, max_id);
    if (type && strcmp(type, "BPE") != 0)
        return LFAIL(L, TEXT_EUNSUPPORTED, "%s: model.type \"%s\" (only BPE and Unigram are supported)", L->file,
                     type);
    json_t *dropout = json_object_get(mj, "dropout");
    if (dropout && !json_is_null(dropout) && !(json_is_number(dropout) && json_number_value(dropout) == 0))
        return LFAIL(L, TEXT_EUNSUPPORTED, "%s: model.dropout is set (BPE dropout is a training feature)", L->file);
    static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (size_t i = 0; i < 2; i++) {
        TRY(get_string(L, mj, affixes[i], "model", false, &s, &len));
        if (len)
            return LFAIL(L, TEXT_EUNSUPPORTED, "%s: model.%s \"%s\" is not supported", L->file, affixes[i], s);
    }
    TRY(get_bool(L, mj, "byte_fallback", "model", false, &t->byte_fallback));
    TRY(get_bool(L, mj, "ignore_merges", "model", false, &t->ignore_merges));
    TRY(get_bool(L, mj, "fuse_unk", "model", false, &t->fuse_unk));
    TRY(load_vocab(L, json, vocab, max_id));
    TRY(load_merges(L, json, merges));
    TRY(get_string(L, mj, "unk_token", "model", false, &s, &len));
    t->unk_id = -1;
    if (s && (t->unk_id = tok_vocab_find(t, s, len)) < 0)
        return LFAIL(L, TEXT_EFORMAT, "%s: model.unk_token \"%.64s\" is not in model.vocab", L->file, s);
    find_byte_tokens(t);
    return TEXT_OK;
}

/* ---- added tokens -------------------------------------------------------- */

static int added_cmp(const void *pa, const void *pb, void *arena)
{
    const struct tok_added *a = pa, *b = pb;
    unsigned char fa = (unsigned char)((char *)arena)[a->s.off], fb = (unsigned char)((char *)arena)[b->s.off];
    if (fa != fb)
        return fa < fb ? -1 : 1;
    return a->s.len > b->s.len ? -1 : a->s.len < b->s.len ? 1 : 0;
}

static enum text_status load_added(struct loader *L, json_t *arr, int32_t *max_id)
{
    tokenizer *t = L->t;
    if (!arr || json_is_null(arr))
        return TEXT_OK;
    if (!json_is_array(arr))
        return LFAIL(L, TEXT_EFORMAT, "%s: added_tokens is not an array", L->file);
    size_t n = json_array_size(arr);
    if (n > UINT16_MAX)
        return LFAIL(L, TEXT_EFORMAT, "%s: added_tokens has %zu entries (limit %d)", L->file, n, UINT16_MAX);
    t->added = calloc(n ? n : 1, sizeof *t->added);
    if (!t->added)
        return oom(L);
    for (size_t i = 0; i < n; i++) {
        json_t *o = json_array_get(arr, i);
        struct tok_added *a = &t->added[i];
        char where[48];
        snprintf(where, sizeof where, "added_tokens[%zu]", i);
        if (!json_is_object(o))
            return LFAIL(L, TEXT_EFORMAT, "%s: %s is not an object", L->file, where);
        const char *content;
        size_t len;
        TRY(get_id(L, json_object_get(o, "id"), "added_tokens.id", i, &a->id));
        TRY(get_string(L, o, "content", where, true, &content, &len));
        if (len == 0)
            return LFAIL(L, TEXT_EFORMAT, "%s: %s.content is empty", L->file, where);
        TRY(get_bool(L, o, "special", where, false, &a->special));
        TRY(get_bool(L, o, "lstrip", where, false, &a->lstrip));
        TRY(get_bool(L, o, "rstrip", where, false, &a->rstrip));
        TRY(get_bool(L, o, "single_word", where, false, &a->single_word));
        TRY(intern(L, content, len, &a->s));
        if (a->id > *max_id)
            *max_id = a->id;
        t->n_added++;
    }
    /* Leftmost-longest matching looks at the tokens sharing the byte under
     * the cursor, longest first. */
    qsort_r(t->added, (size_t)t->n_added, sizeof *t->added, added_cmp, t->str.p);
    int k = 0;
    for (int b = 0; b <= 256; b++) {
        while (k < t->n_added && (unsigned char)t->str.p[t->added[k].s.off] < b)
            k++;
        t->added_first[b] = (uint16_t)k;
    }
    return TEXT_OK;
}

/* ---- normaliser and pre-tokenizer ---------------------------------------- */

static enum text_status push_norm(struct loader *L, enum tok_norm_op op, struct tok_span from, struct tok_span to)
{
    tokenizer *t = L->t;
    struct tok_norm *n = realloc(t->norm, ((size_t)t->n_norm + 1) * sizeof *n);
    if (!n)
        return oom(L);
    t->norm = n;
    n[t->n_norm++] = (struct tok_norm){.op = op, .from = from, .to = to};
    return TEXT_OK;
}

/* Walks a component that may be a "Sequence" of components (listed under
 * list_key), calling one() on each leaf with a path naming it. */
typedef enum text_status (*component_fn)(struct loader *L, json_t *obj, const char *type, const char *where);

static enum text_status walk(struct loader *L, json_t *obj, const char *where, const char *list_key,
                              component_fn one)
{
    if (!obj || json_is_null(obj))
        return TEXT_OK;
    const char *type;
    TRY(get_type(L, obj, where, &type));
    if (strcmp(type, "Sequence") != 0)
        return one(L, obj, type, where);
    json_t *list = json_object_get(obj, list_key);
    if (!json_is_array(list))
        return LFAIL(L, TEXT_EFORMAT, "%s: %s.%s is missing or not an array", L->file, where, list_key);
    for (size_t i = 0; i < json_array_size(list); i++) {
        char sub[160];
        snprintf(sub, sizeof sub, "%s.%s[%zu]", where, list_key, i);
        TRY(walk(L, json_array_get(list, i), sub, list_key, one));
    }
    return TEXT_OK;
}

static enum text_status unsupported(struct loader *L, const char *where, const char *type)
{
    return LFAIL(L, TEXT_EUNSUPPORTED, "%s: %s.type \"%s\" is not supported", L->file, where, type);
}

static enum text_status compile_regex(struct loader *L, const char *pattern, size_t len, uint32_t extra_flags,
                                       const char *where, pcre2_code **out)
{
    int code;
    PCRE2_SIZE at;
    /* PCRE2 refuses UCP beside LITERAL, where it would change nothing. */
    uint32_t flags = PCRE2_UTF | extra_flags | (extra_flags & PCRE2_LITERAL ? 0 : PCRE2_UCP);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, len, flags, &code, &at, NULL);
    if (!re) {
        PCRE2_UCHAR msg[128];
        pcre2_get_error_message(code, msg, sizeof msg);
        return LFAIL(L, TEXT_EUNSUPPORTED, "%s: %s.pattern: regex does not compile at offset %zu: %s", L->file,
                     where, (size_t)at, (const char *)msg);
    }
    /* The interpreter is the fallback where JIT is unavailable. */
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    *out = re;
    return TEXT_OK;
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Precompiled: a base64 SentencePiece charsmap, [u32 LE trie bytes][the
 * Darts units][NUL-terminated replacements]. */
static enum text_status load_charsmap(struct loader *L, json_t *o, const char *where)
{
    tokenizer *t = L->t;
    const char *s;
    size_t len;
    if (t->charsmap.units)
        return LFAIL(L, TEXT_EUNSUPPORTED, "%s: %s: a second Precompiled normalizer", L->file, where);
    TRY(get_string(L, o, "precompiled_charsmap", where, true, &s, &len));
    struct tok_buf blob = {0};
    bool nomem;
    if (!tok_base64(s, len, &blob, &nomem)) {
        free(blob.p);
        return nomem ? oom(L) : LFAIL(L, TEXT_EFORMAT, "%s: %s.precompiled_charsmap is not base64", L->file, where);
    }
    const unsigned char *b = (const unsigned char *)blob.p;
    uint32_t trie = blob.n >= 4 ? le32(b) : 0;
    enum text_status st = TEXT_OK;
    if (blob.n < 8 || trie < 4 || trie % 4 || trie > blob.n - 4)
        st = LFAIL(L, TEXT_EFORMAT,
                   "%s: %s.precompiled_charsmap: the trie size %u does not fit the %zu-byte blob (or is not a "
                   "positive multiple of 4)",
                   L->file, where, trie, blob.n);
    const char *norm = blob.p + 4 + (st == TEXT_OK ? trie : 0);
    size_t nn = st == TEXT_OK ? blob.n - 4 - trie : 0;
    if (st == TEXT_OK && nn && norm[nn - 1] != '\0')
        st = LFAIL(L, TEXT_EFORMAT, "%s: %s.precompiled_charsmap: the replacements do not end with NUL", L->file,
                   where);
    for (size_t i = 0; st == TEXT_OK && i < nn;) {
        uint32_t cp;
        size_t k = norm[i] ? tok_utf8_next((const unsigned char *)norm + i, nn - i, &cp) : 1;
        if (!k)
            st = LFAIL(L, TEXT_EFORMAT, "%s: %s.precompiled_charsmap: replacement byte %zu is not UTF-8", L->file,
                       where, i);
        i += k;
    }
    if (st == TEXT_OK)
        st = intern(L, norm, nn, &t->charsmap.norm);
    if (st == TEXT_OK && !(t->charsmap.units = malloc(trie)))
        st = oom(L);
    for (uint32_t i = 0; st == TEXT_OK && i < trie / 4; i++) {
        t->charsmap.units[i] = le32(b + 4 + 4 * (size_t)i);
    }
    if (st == TEXT_OK)
        t->charsmap.n_units = trie / 4;
    free(blob.p);
    return st == TEXT_OK ? push_norm(L, TOK_NORM_PRECOMPILED, (struct tok_span){0, 0}, (struct tok_span){0, 0}) : st;
}

static enum text_status one_normalizer(struct loader *L, json_t *o, const char *type, const char *where)
{
    const char *s;
    size_t len;
    struct tok_span from = {0, 0}, to = {0, 0};
    if (strcmp(type, "NFC") == 0)
        return push_norm(L, TOK_NORM_NFC, from, to);
    if (strcmp(type, "Prepend") == 0) {
        TRY(get_string(L, o, "prepend", where, true, &s, &len));
        TRY(intern(L, s, len, &to));
        return push_norm(L, TOK_NORM_PREPEND, from, to);
    }
    if (strcmp(type, "Replace") == 0) {
        bool is_regex;
        pcre2_code *re = NULL;
        TRY(get_pattern(L, o, where, &s, &len, &is_regex));
        if (len == 0)
            return LFAIL(L, TEXT_EFORMAT, "%s: %s.pattern.%s is empty", L->file, where, is_regex ? "Regex" : "String");
        TRY(intern(L, s, len, &from));
        TRY(get_string(L, o, "content", where, true, &s, &len));
        TRY(intern(L, s, len, &to));
        if (is_regex)
            TRY(compile_regex(L, span_str(L->t, from), from.len, 0, where, &re));
        enum text_status st = push_norm(L, TOK_NORM_REPLACE, from, to);
        if (st != TEXT_OK)
            pcre2_code_free(re);
        else
            L->t->norm[L->t->n_norm - 1].re = re;
        return st;
    }
    if (strcmp(type, "Strip") == 0) {
        bool left, right;
        TRY(get_bool(L, o, "strip_left", where, false, &left));
        TRY(get_bool(L, o, "strip_right", where, false, &right));
        TRY(push_norm(L, TOK_NORM_STRIP, from, to));
        L->t->norm[L->t->n_norm - 1].left = left;
        L->t->norm[L->t->n_norm - 1].right = right;
        return TEXT_OK;
    }
    if (strcmp(type, "Precompiled") == 0)
        return load_charsmap(L, o, where);
    return unsupported(L, where, type);
}

static enum text_status push_split(struct loader *L, const char *pattern, size_t len, uint32_t extra_flags,
                                    enum tok_split_behavior behavior, bool invert, const char *where)
{
    tokenizer *t = L->t;
    pcre2_code *re;
    TRY(compile_regex(L, pattern, len, extra_flags, where, &re));
    struct tok_split *s = realloc(t->splits, ((size_t)t->n_splits + 1) * sizeof *s);
    if (!s) {
        pcre2_code_free(re);
        return oom(L);
    }
    t->splits = s;
    s[t->n_splits++] = (struct tok_split){re, behavior, invert};
    return TEXT_OK;
}

static enum text_status get_split_behavior(struct loader *L, json_t *o, const char *where,
                                            enum tok_split_behavior *out)
{
    static const char *const names[] = {
        [TOK_SPLIT_REMOVED] = "Removed",
        [TOK_SPLIT_ISOLATED] = "Isolated",
        [TOK_SPLIT_MERGED_WITH_PREVIOUS] = "MergedWithPrevious",
        [TOK_SPLIT_MERGED_WITH_NEXT] = "MergedWithNext",
        [TOK_SPLIT_CONTIGUOUS] = "Contiguous",
    };
    const char *behavior;
    size_t len;
    TRY(get_string(L, o, "behavior", where, true, &behavior, &len));
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(behavior, names[i]) == 0) {
            *out = (enum tok_split_behavior)i;
            return TEXT_OK;
        }
    return LFAIL(L, TEXT_EUNSUPPORTED,
                 "%s: %s.behavior \"%s\" is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, "
                 "Contiguous",
                 L->file, where, behavior);
}

static enum text_status one_pretokenizer(struct loader *L, json_t *o, const char *type, const char *where)
{
    tokenizer *t = L->t;
    const char *s;
    size_t len;
    if (strcmp(type, "Split") == 0) {
        bool is_regex, invert;
        enum tok_split_behavior behavior = TOK_SPLIT_ISOLATED;
        TRY(get_pattern(L, o, where, &s, &len, &is_regex));
        TRY(get_bool(L, o, "invert", where, false, &invert));
        TRY(get_split_behavior(L, o, where, &behavior));
        return push_split(L, s, len, is_regex ? 0 : PCRE2_LITERAL, behavior, invert, where);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        bool use_regex;
        if (t->byte_level || t->metaspace)
            return LFAIL(L, TEXT_EUNSUPPORTED, "%s: %s: a second ByteLevel/Metaspace pre-tokenizer", L->file, where);
        t->byte_level = true;
        TRY(get_bool(L, o, "add_prefix_space", where, true, &t->prefix_space));
        TRY(get_bool(L, o, "use_regex", where, true, &use_regex));
        /* The prefix space is added per piece; only before any split is
         * that the same as once per text section. */
        if (t->prefix_space && t->n_splits)
            return LFAIL(L, TEXT_EUNSUPPORTED, "%s: %s: add_prefix_space after a Split is not supported", L->file,
                         where);
        return use_regex ? push_split(L, GPT2_REGEX, sizeof GPT2_REGEX - 1, 0, TOK_SPLIT_ISOLATED, false, where) : TEXT_OK;
    }
    if (strcmp(type, "WhitespaceSplit") == 0) {
        /* Unicode White_Space, as Rust's char::is_whitespace */
        static const char ws[] = "[\\t-\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
                                 "\\x{205F}\\x{3000}]+";
        return push_split(L, ws, sizeof ws - 1, 0, TOK_SPLIT_REMOVED, false, where);
    }
    if (strcmp(type, "Metaspace") == 0) {
        if (t->byte_level || t->metaspace)
            return LFAIL(L, TEXT_EUNSUPPORTED, "%s: %s: a second ByteLevel/Metaspace pre-tokenizer", L->file, where);
        t->metaspace = true;
        t->meta_at = t->n_splits;
        uint32_t cp;
        TRY(get_string(L, o, "replacement", where, true, &s, &len));
        if (len == 0 || tok_utf8_next((const unsigned char *)s, len, &cp) != len)
            return LFAIL(L, TEXT_EFORMAT, "%s: %s.replacement is not one character", L->file, where);
        TRY(intern(L, s, len, &t->meta_repl));
        const char *scheme;
        TRY(get_string(L, o, "prepend_scheme", where, false, &scheme, &len));
        if (scheme) {
            if (strcmp(scheme, "always") == 0)
                t->meta_prepend = TOK_PREPEND_ALWAYS;
            else if (strcmp(scheme, "first") == 0)
                t->meta_prepend = TOK_PREPEND_FIRST;
            else if (strcmp(scheme, "never") == 0)
                t->meta_prepend = TOK_PREPEND_NEVER;
            else
                return LFAIL(L, TEXT_EFORMAT, "%s: %s.prepend_scheme \"%s\" is unknown", L->file, where, scheme);
        } else {
            bool add;
            TRY(get_bool(L, o, "add_prefix_space", where, true, &add));
            t->meta_prepend = add ? TOK_PREPEND_ALWAYS : TOK_PREPEND_NEVER;
        }
        bool split;
        TRY(get_bool(L, o, "split", where, true, &split));
        if (!split)
            return TEXT_OK;
        /* Splitting before each replacement character, which stays at the
         * start of its piece, is an Isolated split on "R[^R]*". */
        char re[64];
        int n = snprintf(re, sizeof re, "\\x{%X}[^\\x{%X}]*", (unsigned)cp, (unsigned)cp);
        return push_split(L, re, (size_t)n, 0, TOK_SPLIT_ISOLATED, false, where);
    }
    return unsupported(L, where, type);
}

/* ---- post-processor ------------------------------------------------------- */

static enum text_status ids_push(struct loader *L, int32_t **ids, int *n, int32_t id)
{
    if (id < 0 || id >= L->t->n_ids)
        return LFAIL(L, TEXT_EFORMAT, "%s: post_processor: id %d out of range [0, %d)", L->file, id, L->t->n_ids);
    int32_t *p = realloc(*ids, ((size_t)*n + 1) * sizeof *p);
    if (!p)
        return oom(L);
    *ids = p;
    p[(*n)++] = id;
    return TEXT_OK;
}

static enum text_status template_item(struct loader *L, json_t *specials, json_t *item, const char *where,
                                       bool *seen_a)
{
    tokenizer *t = L->t;
    json_t *seq = json_object_get(item, "Sequence"), *sp = json_object_get(item, "SpecialToken");
    if (json_is_object(seq)) {
        const char *id;
        size_t len;
        TRY(get_string(L, seq, "id", where, true, &id, &len));
        if (strcmp(id, "A") != 0 || *seen_a)
            return LFAIL(L, TEXT_EFORMAT, "%s: %s: the single template must hold sequence A once", L->file, where);
        *seen_a = true;
        return TEXT_OK;
    }
    if (!json_is_object(sp))
        return LFAIL(L, TEXT_EFORMAT, "%s: %s is neither Sequence nor SpecialToken", L->file, where);
    const char *name;
    size_t len;
    TRY(get_string(L, sp, "id", where, true, &name, &len));
    json_t *ids = json_object_get(json_object_get(specials, name), "ids");
    if (!json_is_array(ids))
        return LFAIL(L, TEXT_EFORMAT, "%s: post_processor.special_tokens[\"%.64s\"].ids is missing", L->file, name);
    for (size_t k = 0; k < json_array_size(ids); k++) {
        int32_t id;
        TRY(get_id(L, json_array_get(ids, k), "post_processor.special_tokens.ids", k, &id));
        TRY(*seen_a ? ids_push(L, &t->suffix_ids, &t->n_suffix, id) : ids_push(L, &t->prefix_ids, &t->n_prefix, id));
    }
    return TEXT_OK;
}

static enum text_status one_postprocessor(struct loader *L, json_t *o, const char *type, const char *where)
{
    if (strcmp(type, "ByteLevel") == 0)
        return TEXT_OK; /* offsets only */
    if (strcmp(type, "TemplateProcessing") != 0)
        return unsupported(L, where, type);
    json_t *single = json_object_get(o, "single"), *specials = json_object_get(o, "special_tokens");
    if (!json_is_array(single))
        return LFAIL(L, TEXT_EFORMAT, "%s: %s.single is missing or not an array", L->file, where);
    if (L->t->n_prefix || L->t->n_suffix)
        return LFAIL(L, TEXT_EUNSUPPORTED, "%s: %s: a second TemplateProcessing", L->file, where);
    bool seen_a = false;
    for (size_t i = 0; i < json_array_size(single); i++) {
        char sub[160];
        snprintf(sub, sizeof sub, "%s.single[%zu]", where, i);
        TRY(template_item(L, specials, json_array_get(single, i), sub, &seen_a));
    }
    if (!seen_a)
        return LFAIL(L, TEXT_EFORMAT, "%s: %s.single has no sequence A", L->file, where);
    L->has_template = true;
    return TEXT_OK;
}

/* ---- decoder: per-token steps are applied once at load (tok_span dec) ---- */

static enum text_status push_dec(struct loader *L, enum dec_op_kind kind, const char *from, size_t nfrom,
                                  const char *to, size_t nto, const char *where)
{
    struct dec_op *op = &L->ops[L->n_ops];
    if (L->n_ops == MAX_DEC_OPS)
        return LFAIL(L, TEXT_EUNSUPPORTED, "%s: %s: more than %d decoder steps", L->file, where, MAX_DEC_OPS);
    if (L->fused)
        return LFAIL(L, TEXT_EUNSUPPORTED, "%s: %s: per-token decoder step after Fuse", L->file, where);
    op->kind = kind;
    if (kind == DEC_REPLACE) {
        TRY(intern(L, from, nfrom, &op->from));
        TRY(intern(L, to, nto, &op->to));
    }
    L->n_ops++;
    return TEXT_OK;
}

static enum text_status one_decoder(struct loader *L, json_t *o, const char *type, const char *where)
{
    const char *s, *c;
    size_t len, clen;
    if (strcmp(type, "ByteLevel") == 0)
        return push_dec(L, DEC_BYTE_LEVEL, NULL, 0, NULL, 0, where);
    if (strcmp(type, "ByteFallback") == 0)
        return push_dec(L, DEC_BYTE_FALLBACK, NULL, 0, NULL, 0, where);
    if (strcmp(type, "Fuse") == 0) {
        L->fused = true;
        return TEXT_OK;
    }
    if (strcmp(type, "Replace") == 0) {
        bool is_regex;
        TRY(get_pattern(L, o, where, &s, &len, &is_regex));
        TRY(get_string(L, o, "content", where, true, &c, &clen));
        if (is_regex || len == 0)
            return LFAIL(L, TEXT_EUNSUPPORTED, "%s: %s.pattern: only a non-empty String is supported", L->file,
                         where);
        return push_dec(L, DEC_REPLACE, s, len, c, clen, where);
    }
    if (strcmp(type, "Metaspace") == 0) {
        const char *scheme;
        bool add;
        TRY(get_string(L, o, "replacement", where, true, &s, &len));
        TRY(get_string(L, o, "prepend_scheme", where, false, &scheme, &clen));
        TRY(get_bool(L, o, "add_prefix_space", where, true, &add));
        if (len == 0)
            return LFAIL(L, TEXT_EFORMAT, "%s: %s.replacement is empty", L->file, where);
        L->t->strip_first_space = scheme ? strcmp(scheme, "never") != 0 : add;
        return push_dec(L, DEC_REPLACE, s, len, " ", 1, where);
    }
    if (strcmp(type, "Strip") == 0) {
        json_t *start = json_object_get(o, "start"), *stop = json_object_get(o, "stop");
        TRY(get_string(L, o, "content", where, true, &c, &clen));
        /* Streaming can only drop the very first space of the output. */
        if (!L->fused || clen != 1 || c[0] != ' ' || !json_is_integer(start) || json_integer_value(start) > 1 ||
            json_integer_value(start) < 0 || !json_is_integer(stop) || json_integer_value(stop) != 0)
            return LFAIL(L, TEXT_EUNSUPPORTED,
                         "%s: %s: only Strip(content \" \", start 0 or 1, stop 0) after Fuse is supported", L->file,
                         where);
        L->t->strip_first_space = json_integer_value(start) == 1;
        return TEXT_OK;
    }
    return unsupported(L, where, type);
}

/* Applies the per-token decoder steps to one piece, into out.  An added
 * token's text goes through every step but ByteLevel, which passes added
 * tokens through whole (transformers.js does; so "▁▁" added to a
 * SentencePiece-style vocabulary still decodes to two spaces). */
static enum text_status decode_piece(struct loader *L, const char *p, size_t n, bool added, struct tok_buf *out,
                                      struct tok_buf *tmp)
{
    const tokenizer *t = L->t;
    out->n = 0;
    if (!tok_buf_append(out, p, n))
        return oom(L);
    for (int k = 0; k < L->n_ops; k++) {
        const struct dec_op *op = &L->ops[k];
        if (added && op->kind == DEC_BYTE_LEVEL)
            continue;
        tmp->n = 0;
        if (op->kind == DEC_BYTE_FALLBACK) {
            int hi = out->n == 6 ? tok_hex_digit(out->p[3]) : -1, lo = out->n == 6 ? tok_hex_digit(out->p[4]) : -1;
            if (hi >= 0 && lo >= 0 && memcmp(out->p, "<0x", 3) == 0 && out->p[5] == '>') {
                out->p[0] = (char)(hi << 4 | lo);
                out->n = 1;
            }
            continue;
        }
        if (op->kind == DEC_BYTE_LEVEL) {
            /* A piece with a character outside the byte table (an added
             * token's text) stays as it is, as in Hugging Face's decoder. */
            size_t i = 0;
            while (i < out->n) {
                uint32_t cp;
                size_t len = tok_utf8_next((const unsigned char *)out->p + i, out->n - i, &cp);
                int b = len ? tok_cp_to_byte(cp) : -1;
                if (b < 0)
                    break;
                char c = (char)b;
                if (!tok_buf_append(tmp, &c, 1))
                    return oom(L);
                i += len;
            }
            if (i < out->n)
                continue;
        } else {
            const char *from = span_str(t, op->from), *to = span_str(t, op->to);
            for (size_t i = 0; i < out->n;) {
                bool hit = out->n - i >= op->from.len && memcmp(out->p + i, from, op->from.len) == 0;
                if (!(hit ? tok_buf_append(tmp, to, op->to.len) : tok_buf_append(tmp, out->p + i, 1)))
                    return oom(L);
                i += hit ? op->from.len : 1;
            }
        }
        struct tok_buf swap = *out;
        *out = *tmp;
        *tmp = swap;
    }
    return TEXT_OK;
}

/* ---- tokenizer_config.json ----------------------------------------------- */

/* A token's id by its exact string (vocab or added token); -1 if absent. */
static int32_t piece_id(const tokenizer *t, const char *piece)
{
    size_t n = strlen(piece);
    if (n == 0)
        return -1;
    unsigned char b = (unsigned char)piece[0];
    for (int k = t->added_first[b]; k < t->added_first[b + 1]; k++) {
        const struct tok_added *a = &t->added[k];
        if (a->s.len == n && memcmp(t->str.p + a->s.off, piece, n) == 0)
            return a->id;
    }
    return tok_vocab_find(t, piece, n);
}

/* bos_token / eos_token: a string, {"content": ...} (AddedToken) or null. */
static enum text_status config_token(struct loader *L, json_t *cfg, const char *key, int32_t *id)
{
    json_t *v = json_object_get(cfg, key);
    if (json_is_object(v))
        v = json_object_get(v, "content");
    *id = -1;
    if (!v || json_is_null(v))
        return TEXT_OK;
    if (!json_is_string(v))
        return LFAIL(L, TEXT_EFORMAT, "%s: %s is not a string", L->file, key);
    *id = piece_id(L->t, json_string_value(v));
    if (*id < 0)
        return LFAIL(L, TEXT_EFORMAT, "%s: %s \"%.64s\" is not a token of tokenizer.json", L->file, key,
                     json_string_value(v));
    return TEXT_OK;
}

static enum text_status load_config(struct loader *L, json_t *cfg)
{
    tokenizer *t = L->t;
    bool add_bos, add_eos;
    if (!json_is_object(cfg))
        return LFAIL(L, TEXT_EFORMAT, "%s: not a JSON object", L->file);
    TRY(config_token(L, cfg, "bos_token", &t->bos_id));
    TRY(config_token(L, cfg, "eos_token", &t->eos_id));
    TRY(get_bool(L, cfg, "add_bos_token", "tokenizer_config", false, &add_bos));
    TRY(get_bool(L, cfg, "add_eos_token", "tokenizer_config", false, &add_eos));
    /* Without a TemplateProcessing post-processor these flags decide. */
    if (!L->has_template && add_bos && t->bos_id >= 0)
        TRY(ids_push(L, &t->prefix_ids, &t->n_prefix, t->bos_id));
    if (!L->has_template && add_eos && t->eos_id >= 0)
        TRY(ids_push(L, &t->suffix_ids, &t->n_suffix, t->eos_id));

    /* a string, or a list of named templates (chat_tpl_load picks among them) */
    json_t *tpl = json_object_get(cfg, "chat_template");
    if (tpl && !json_is_null(tpl)) {
        bool ok = json_is_string(tpl) || (json_is_array(tpl) && json_array_size(tpl));
        for (size_t i = 0; ok && json_is_array(tpl) && i < json_array_size(tpl); i++)
            ok = json_is_string(json_object_get(json_array_get(tpl, i), "name")) &&
                 json_is_string(json_object_get(json_array_get(tpl, i), "template"));
        if (!ok)
            return LFAIL(L, TEXT_EFORMAT, "%s: chat_template is neither a string nor a list of {name, template}",
                         L->file);
        t->chat_template = json_incref(tpl);
    }
    return TEXT_OK;
}

/* ---- the whole load -------------------------------------------------------- */

/* tokenizer_config.json, absent (*out NULL) or parsed; it holds integers
 * beyond 64 bits (model_max_length 1e30), read as reals. */
static enum text_status read_config(struct loader *L, const char *path, json_t **out)
{
    struct stat sb;
    *out = NULL;
    if (stat(path, &sb) != 0)
        return errno == ENOENT ? TEXT_OK : LFAIL(L, TEXT_EIO, "%s: %s", path, strerror(errno));
    json_error_t je;
    *out = json_load_file(path, JSON_DECODE_INT_AS_REAL, &je);
    if (!*out)
        return LFAIL(L, TEXT_EFORMAT, "%s:%d:%d: %s", path, je.line, je.column, je.text);
    return TEXT_OK;
}

static enum text_status finish_tables(struct loader *L, int32_t max_id)
{
    tokenizer *t = L->t;
    /* piece[] was sized for the vocab; added tokens may reach beyond it. */
    struct tok_span *p = realloc(t->piece, ((size_t)max_id + 1) * sizeof *p);
    if (!p)
        return oom(L);
    t->piece = p;
    for (int32_t i = t->n_ids; i <= max_id; i++)
        p[i].off = UINT32_MAX;
    t->n_ids = max_id + 1;
    t->flags = calloc((size_t)t->n_ids, 1);
    t->dec = calloc((size_t)t->n_ids, sizeof *t->dec);
    if (!t->flags || !t->dec)
        return oom(L);
    for (int32_t i = 0; i < t->n_ids; i++) {
        if (p[i].off != UINT32_MAX)
            t->flags[i] = TOKF_VOCAB;
        else
            p[i] = (struct tok_span){0, 0};
    }
    for (int k = 0; k < t->n_added; k++) {
        const struct tok_added *a = &t->added[k];
        t->flags[a->id] |= TOKF_ADDED | (a->special ? TOKF_SPECIAL : 0);
        t->dec[a->id] = a->s;
    }
    return TEXT_OK;
}

static enum text_status build_decoded(struct loader *L)
{
    tokenizer *t = L->t;
    struct tok_buf out = {0}, tmp = {0};
    enum text_status st = TEXT_OK;
    for (int32_t i = 0; i < t->n_ids && st == TEXT_OK; i++) {
        bool added = t->flags[i] & TOKF_ADDED;
        if (!added && !(t->flags[i] & TOKF_VOCAB))
            continue;
        /* finish_tables() left an added token's own text in dec. */
        struct tok_span p = added ? t->dec[i] : t->piece[i];
        st = decode_piece(L, span_str(t, p), p.len, added, &out, &tmp);
        if (st != TEXT_OK)
            break;
        /* Most pieces decode to themselves: share the bytes. */
        if (out.n == p.len && memcmp(out.p, span_str(t, p), p.len) == 0)
            t->dec[i] = p;
        else
            st = intern(L, out.p, out.n, &t->dec[i]);
    }
    free(out.p);
    free(tmp.p);
    return st;
}

/* Reads the members of the object at j's cursor; the ones named in big[]
 * are only located (*at), the others parsed by jansson into obj. */
static enum text_status scan_object(struct loader *L, struct tok_json *j, const char *where, json_t *obj,
                                     const char *const *big, const char **at, int n_big)
{
    struct tok_buf key = {0};
    enum text_status st = TEXT_OK;
    bool first = true;
    int r;
    while (st == TEXT_OK && (r = tj_member(j, &first, &key)) == 1) {
        tj_ws(j);
        const char *start = j->p;
        if (!tok_buf_append(&key, "", 1) || !tj_skip(j)) {
            st = syntax(L, j, where);
            break;
        }
        int k = 0;
        while (k < n_big && strcmp(key.p, big[k]) != 0)
            k++;
        if (k < n_big) {
            at[k] = start;
            continue;
        }
        json_error_t je;
        json_t *v = json_loadb(start, (size_t)(j->p - start), JSON_DECODE_ANY, &je);
        if (!v)
            st = LFAIL(L, TEXT_EFORMAT, "%s: %s%s%s: %s", L->file, where, *where ? "." : "", key.p, je.text);
        else if (json_object_set_new(obj, key.p, v) != 0)
            st = oom(L);
    }
    if (st == TEXT_OK && r < 0)
        st = syntax(L, j, *where ? where : "top level");
    free(key.p);
    return st;
}

static enum text_status load_tokenizer_json(struct loader *L, const char *text, size_t len)
{
    tokenizer *t = L->t;
    int32_t max_id = -1;
    struct tok_json j = {text, text, text + len, NULL};
    static const char *const model_key[] = {"model"}, *const big[] = {"vocab", "merges"};
    const char *model_at = NULL, *big_at[2] = {NULL, NULL};
    json_t *root = json_object(), *mj = json_object();
    enum text_status st = root && mj ? TEXT_OK : oom(L);
    tj_ws(&j);
    if (st == TEXT_OK && (j.p == j.end || *j.p != '{'))
        st = LFAIL(L, TEXT_EFORMAT, "%s: not a JSON object", L->file);
    if (st == TEXT_OK)
        st = scan_object(L, &j, "", root, model_key, &model_at, 1);
    tj_ws(&j);
    if (st == TEXT_OK && j.p != j.end)
        st = LFAIL(L, TEXT_EFORMAT, "%s: text after the top-level object", L->file);
    if (st == TEXT_OK && (!model_at || *model_at != '{'))
        st = LFAIL(L, TEXT_EFORMAT, "%s: model is missing or not an object", L->file);
    if (st == TEXT_OK) {
        j.p = model_at;
        st = scan_object(L, &j, "model", mj, big, big_at, 2);
    }
    if (st == TEXT_OK)
        st = load_model(L, mj, &j, big_at[0], big_at[1], &max_id);
    if (st == TEXT_OK) {
        t->n_ids = max_id + 1;
        st = load_added(L, json_object_get(root, "added_tokens"), &max_id);
    }
    if (st == TEXT_OK)
        st = finish_tables(L, max_id);
    if (st == TEXT_OK)
        st = walk(L, json_object_get(root, "normalizer"), "normalizer", "normalizers", one_normalizer);
    if (st == TEXT_OK)
        st = walk(L, json_object_get(root, "pre_tokenizer"), "pre_tokenizer", "pretokenizers", one_pretokenizer);
    if (st == TEXT_OK)
        st = walk(L, json_object_get(root, "post_processor"), "post_processor", "processors", one_postprocessor);
    if (st == TEXT_OK)
        st = walk(L, json_object_get(root, "decoder"), "decoder", "decoders", one_decoder);
    if (st == TEXT_OK)
        st = build_decoded(L);
    json_decref(root);
    json_decref(mj);
    return st;
}

/* The whole of a file, NUL-terminated, in *data. */
static enum text_status read_file(struct loader *L, const char *path, char **data, size_t *len)
{
    *data = NULL;
    struct stat sb;
    int fd = file_open_regular(path, &sb);
    if (fd == FILE_NOT_REGULAR)
        return LFAIL(L, TEXT_EIO, "%s: not a regular file", path);
    if (fd < 0)
        return LFAIL(L, errno == ENOENT ? TEXT_ENOENT : TEXT_EIO, "%s: %s", path, strerror(errno));
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return oom(L);
    }
    enum text_status st = TEXT_OK;
    if ((uint64_t)sb.st_size >= UINT32_MAX)
        st = LFAIL(L, TEXT_EFORMAT, "%s: %lld bytes is too large for a tokenizer", path, (long long)sb.st_size);
    else if (!(*data = malloc((size_t)sb.st_size + 1)))
        st = oom(L);
    else if (fread(*data, 1, (size_t)sb.st_size, f) != (size_t)sb.st_size)
        st = LFAIL(L, TEXT_EIO, "%s: read error", path);
    fclose(f);
    if (st != TEXT_OK) {
        free(*data);
        *data = NULL;
        return st;
    }
    (*data)[sb.st_size] = '\0';
    *len = (size_t)sb.st_size;
    return TEXT_OK;
}

/* The load both entry points share: the tokenizer.json text, then the
 * parsed tokenizer_config.json (NULL: none); file and config_file name
 * them in messages. */
static enum text_status load_both(const char *file, const char *config_file, const char *text, size_t len,
                                  json_t *config, tokenizer **out, char *err)
{
    *out = NULL;
    tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return text_errf(err, TEXT_ENOMEM, "tokenizer: out of memory");
    t->unk_id = t->bos_id = t->eos_id = -1;
    struct loader L = {.t = t, .file = file, .err = err};
    enum text_status st = load_tokenizer_json(&L, text, len);
    if (st == TEXT_OK && config) {
        L.file = config_file;
        st = load_config(&L, config);
    } else if (st == TEXT_OK) {
        /* No tokenizer_config.json: the template's tokens are the best guess. */
        t->bos_id = t->n_prefix ? t->prefix_ids[0] : -1;
        t->eos_id = t->n_suffix ? t->suffix_ids[t->n_suffix - 1] : -1;
    }
    if (st != TEXT_OK) {
        tokenizer_free(t);
        return st;
    }
    *out = t;
    return TEXT_OK;
}

enum text_status tokenizer_load(const char *dir, tokenizer **out, char *err)
{
    char path[PATH_MAX], cpath[PATH_MAX], *text = NULL;
    size_t len = 0;
    json_t *root = NULL;
    *out = NULL;
    struct loader L = {.file = path, .err = err};
    enum text_status st = text_path(path, dir, "tokenizer.json", err);
    if (st == TEXT_OK)
        st = text_path(cpath, dir, "tokenizer_config.json", err);
    if (st == TEXT_OK)
        st = read_file(&L, path, &text, &len);
    if (st == TEXT_OK)
        st = read_config(&L, cpath, &root);
    if (st == TEXT_OK)
        st = load_both(path, cpath, text, len, root, out, err);
    free(text);
    json_decref(root);
    return st;
}

enum text_status tokenizer_load_json(const char *name, const char *json, size_t len, json_t *config,
                                     tokenizer **out, char *err)
{
    if (config && !json_is_object(config))
        return text_errf(err, TEXT_EFORMAT, "%s: the tokenizer configuration is not a JSON object", name);
    return load_both(name, name, json, len, config, out, err);
}

void tokenizer_free(tokenizer *t)
{
    if (!t)
        return;
    for (int i = 0; i < t->n_splits; i++)
        pcre2_code_free(t->splits[i].re);
    for (int i = 0; i < t->n_norm; i++)
        pcre2_code_free(t->norm[i].re);
    free(t->splits);
    free(t->str.p);
    free(t->piece);
    free(t->dec);
    free(t->flags);
    free(t->vocab_tab);
    free(t->merge_tab);
    free(t->score);
    free(t->charsmap.units);
    free(t->added);
    free(t->norm);
    free(t->prefix_ids);
    free(t->suffix_ids);
    json_decref(t->chat_template);
    free(t);
}

int tokenizer_vocab_size(const tokenizer *t)
{
    return t->n_ids;
}

int32_t tokenizer_bos_id(const tokenizer *t)
{
    return t->bos_id;
}

int32_t tokenizer_eos_id(const tokenizer *t)
{
    return t->eos_id;
}

const json_t *tokenizer_chat_template(const tokenizer *t)
{
    return t->chat_template;
}

