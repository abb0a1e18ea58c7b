/* jinja.c - a Jinja interpreter for chat templates: a lexer and a parser
 * that follow @huggingface/jinja's (the reference the tests compare with,
 * itself written to match transformers' Python Jinja for chat templates),
 * a tree in one arena, and an evaluator over jansson values.  Undefined is
 * a NULL json_t; macros and builtins are resolved by name at the call. */
#include "text/jinja.h"
#include "text/casemap.h"

#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* Nesting of the parser's recursion (brackets, operators, blocks) and of the
 * evaluator's (the same, plus macro calls): far above any real template,
 * far below what the stack holds. */
#define MAX_PARSE_DEPTH 128
#define MAX_EVAL_DEPTH 256
#define MAX_RANGE 1000000

/* ---- arena ------------------------------------------------------------------ */

struct block {
    struct block *next;
    size_t used, cap;
    max_align_t data[];
};

struct arena {
    struct block *head;
};

static void *arena_alloc(struct arena *a, size_t n)
{
    n = (n + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        struct block *b = malloc(sizeof(*b) + cap);
        if (!b)
            return NULL;
        b->next = a->head;
        b->used = 0;
        b->cap = cap;
        a->head = b;
    }
    void *p = (char *)a->head->data + a->head->used;
    a->head->used += n;
    memset(p, 0, n);
    return p;
}

static void arena_free(struct arena *a)
{
    for (struct block *b = a->head, *next; b; b = next) {
        next = b->next;
        free(b);
    }
    a->head = NULL;
}

/* ---- growable strings ------------------------------------------------------- */

struct sbuf {
    char *p;
    size_t n, cap, limit;
    bool oom, over;
};

static bool sb_put(struct sbuf *b, const char *s, size_t n)
{
    if (b->oom || b->over)
        return false;
    if (n > b->limit || b->n > b->limit - n) {
        b->over = true;
        return false;
    }
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return false;
        }
        b->p = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
    return true;
}

static bool sb_puts(struct sbuf *b, const char *s)
{
    return sb_put(b, s, strlen(s));
}

/* ---- Unicode whitespace, as JavaScript's trim() sees it -------------------- */

static uint32_t utf8_at(const unsigned char *s, size_t n, size_t *len)
{
    if (s[0] < 0x80 || n < 2) {
        *len = 1;
        return s[0];
    }
    if ((s[0] & 0xe0) == 0xc0) {
        *len = 2;
        return (uint32_t)(s[0] & 0x1f) << 6 | (s[1] & 0x3f);
    }
    if ((s[0] & 0xf0) == 0xe0 && n >= 3) {
        *len = 3;
        return (uint32_t)(s[0] & 0x0f) << 12 | (uint32_t)(s[1] & 0x3f) << 6 | (s[2] & 0x3f);
    }
    if ((s[0] & 0xf8) == 0xf0 && n >= 4) {
        *len = 4;
        return (uint32_t)(s[0] & 0x07) << 18 | (uint32_t)(s[1] & 0x3f) << 12 | (uint32_t)(s[2] & 0x3f) << 6 |
               (s[3] & 0x3f);
    }
    *len = 1;
    return 0xfffd;
}

static bool is_ws_cp(uint32_t c)
{
    if (c <= 32)
        return c == 32 || (c >= 9 && c <= 13);
    return c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
           c == 0x205f || c == 0x3000 || c == 0xfeff;
}

/* Bytes of whitespace at the start of s[0..n). */
static size_t ws_lead(const char *s, size_t n)
{
    size_t i = 0, l;
    while (i < n && is_ws_cp(utf8_at((const unsigned char *)s + i, n - i, &l)))
        i += l;
    return i;
}

/* Bytes of whitespace at the end of s[0..n). */
static size_t ws_trail(const char *s, size_t n)
{
    size_t end = n;
    while (end) {
        size_t start = end - 1, l;
        while (start && end - start < 4 && ((unsigned char)s[start] & 0xc0) == 0x80)
            start--;
        uint32_t c = utf8_at((const unsigned char *)s + start, end - start, &l);
        if (start + l != end || !is_ws_cp(c))
            break;
        end = start;
    }
    return n - end;
}

/* ---- source, tokens --------------------------------------------------------- */

enum tok {
    T_EOF, T_TEXT, T_NUM, T_STR, T_NAME, T_OPEN_STMT, T_CLOSE_STMT, T_OPEN_EXPR, T_CLOSE_EXPR, T_LPAREN, T_RPAREN,
    T_LBRACE, T_RBRACE, T_LBRACK, T_RBRACK, T_COMMA, T_DOT, T_COLON, T_PIPE, T_CMP, T_ADD, T_MUL, T_POW, T_UNARY,
    T_ASSIGN, T_COMMENT,
};

struct token {
    enum tok type;
    const char *s; /* in the arena */
    size_t len;
    size_t pos;    /* offset in the original source */
};

struct jinja_tpl {
    struct arena arena;
    struct node *body;
    char *src;     /* the original, for line/column of runtime errors */
    size_t src_len;
};

static void line_col(const char *src, size_t len, size_t pos, unsigned *line, unsigned *col)
{
    *line = 1;
    *col = 1;
    for (size_t i = 0; i < pos && i < len; i++) {
        if (src[i] == '\n')
            ++*line, *col = 1;
        else if (((unsigned char)src[i] & 0xc0) != 0x80)
            ++*col;
    }
}

struct lexer {
    struct jinja_tpl *t;
    char *s;     /* preprocessed source */
    size_t *map; /* offset in s -> offset in the original */
    size_t n, i;
    struct token *toks;
    size_t ntok, cap;
    char *err;
    bool failed;
    enum text_status st; /* when failed */
};

static bool lex_fail(struct lexer *L, size_t at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool lex_fail(struct lexer *L, size_t at, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    unsigned line, col;
    line_col(L->t->src, L->t->src_len, at < L->n ? L->map[at] : L->t->src_len, &line, &col);
    L->st = text_errf(L->err, TEXT_EFORMAT, "chat template line %u, column %u: %s", line, col, msg);
    L->failed = true;
    return false;
}

/* The end of a {%-? (end)generation -?%} tag starting at s[i], or 0. */
static size_t generation_tag(const char *s, size_t n, size_t i, bool *lstrip, bool *rstrip)
{
    i += 2;
    *lstrip = i < n && s[i] == '-';
    i += *lstrip;
    i += ws_lead(s + i, n - i);
    if (i + 3 <= n && !memcmp(s + i, "end", 3))
        i += 3;
    if (i + 10 > n || memcmp(s + i, "generation", 10))
        return 0;
    i += 10;
    i += ws_lead(s + i, n - i);
    *rstrip = i < n && s[i] == '-';
    i += *rstrip;
    return i + 2 <= n && s[i] == '%' && s[i + 1] == '}' ? i + 2 : 0;
}

/* {% generation %} and {% endgeneration %} (training templates mark the
 * assistant's text with them) are dropped, with the whitespace their `-`
 * asks for, as @huggingface/jinja does.  In place: the text only shrinks. */
static size_t drop_generation(char *s, size_t *map, size_t n)
{
    size_t w = 0, last = 0;
    for (size_t i = 0; i < n;) {
        bool lstrip, rstrip;
        size_t end = s[i] == '{' && i + 1 < n && s[i + 1] == '%' ? generation_tag(s, n, i, &lstrip, &rstrip) : 0;
        if (!end) {
            s[w] = s[i];
            map[w++] = map[i++];
            continue;
        }
        while (lstrip && w > last && ws_trail(s + last, w - last))
            w -= ws_trail(s + last, w - last);
        size_t ws = ws_lead(s + end, n - end);
        for (size_t k = 0; !rstrip && k < ws; k++) {
            s[w] = s[end + k];
            map[w++] = map[end + k];
        }
        i = end + ws;
        last = w;
    }
    return w;
}

/* transformers' settings: the template's one trailing newline dropped,
 * lstrip_blocks (blanks before a tag at the start of a line) and
 * trim_blocks (the newline after a block or comment tag), applied to the
 * text as a whole as @huggingface/jinja does. */
static bool preprocess(struct lexer *L, const char *src, size_t n)
{
    if (n && src[n - 1] == '\n')
        n--;
    L->s = malloc(n + 1);
    L->map = malloc((n + 1) * sizeof(*L->map));
    if (!L->s || !L->map)
        return false;
    /* lstrip_blocks */
    char *tmp = malloc(n + 1);
    size_t *tmap = malloc((n + 1) * sizeof(*tmap));
    if (!tmp || !tmap) {
        free(tmp);
        free(tmap);
        return false;
    }
    size_t m = 0;
    for (size_t i = 0; i < n;) {
        if (i == 0 || src[i - 1] == '\n' || src[i - 1] == '\r') {
            size_t j = i;
            while (j < n && (src[j] == ' ' || src[j] == '\t'))
                j++;
            if (j > i && j + 1 < n && src[j] == '{' && strchr("#%-", src[j + 1]) && src[j + 1])
                i = j;
        }
        tmp[m] = src[i];
        tmap[m++] = i++;
    }
    /* trim_blocks */
    size_t k = 0;
    for (size_t i = 0; i < m; i++) {
        L->s[k] = tmp[i];
        L->map[k++] = tmap[i];
        if (i + 2 < m && tmp[i + 1] == '}' && tmp[i + 2] == '\n' && strchr("#%-", tmp[i]) &&
            tmp[i]) {
            L->s[k] = '}';
            L->map[k++] = tmap[i + 1];
            i += 2;
        }
    }
    free(tmp);
    free(tmap);
    k = drop_generation(L->s, L->map, k);
    L->s[k] = '\0';
    L->map[k] = n;
    L->n = k;
    return true;
}

static bool push_tok(struct lexer *L, enum tok type, const char *s, size_t len, size_t at)
{
    if (L->ntok == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        struct token *p = realloc(L->toks, cap * sizeof(*p));
        if (!p)
            return false;
        L->toks = p;
        L->cap = cap;
    }
    char *copy = arena_alloc(&L->t->arena, len + 1);
    if (!copy)
        return false;
    memcpy(copy, s, len);
    L->toks[L->ntok++] = (struct token){type, copy, len, at < L->n ? L->map[at] : L->t->src_len};
    return true;
}

static bool is_word(int c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

static bool is_digit(int c)
{
    return c >= '0' && c <= '9';
}

static enum tok last_type(const struct lexer *L)
{
    return L->ntok ? L->toks[L->ntok - 1].type : T_EOF;
}

/* `{%-` / `{{-` / `{#-`: the text before loses its trailing whitespace. */
static void strip_last_text(struct lexer *L)
{
    if (!L->ntok || L->toks[L->ntok - 1].type != T_TEXT)
        return;
    struct token *t = &L->toks[L->ntok - 1];
    t->len -= ws_trail(t->s, t->len);
    if (!t->len)
        L->ntok--;
}

static void skip_ws(struct lexer *L)
{
    L->i += ws_lead(L->s + L->i, L->n - L->i);
}

static bool lex_string(struct lexer *L, char quote)
{
    size_t start = L->i++;
    struct sbuf b = {.limit = SIZE_MAX / 2};
    for (;;) {
        if (L->i >= L->n) {
            free(b.p);
            return lex_fail(L, start, "unterminated string");
        }
        char c = L->s[L->i++];
        if (c == quote)
            break;
        if (c != '\\') {
            sb_put(&b, &c, 1);
            continue;
        }
        if (L->i >= L->n) {
            free(b.p);
            return lex_fail(L, start, "unterminated string");
        }
        char e = L->s[L->i++];
        const char *from = "ntrbfv'\"\\", *to = "\n\t\r\b\f\v'\"\\";
        const char *p = e ? strchr(from, e) : NULL;
        if (e == 'x' || e == 'u') {
            size_t hl = e == 'x' ? 2 : 4;
            unsigned cp = 0;
            for (size_t k = 0; k < hl; k++) {
                char h = L->i + k < L->n ? L->s[L->i + k] : 0;
                int v = is_digit(h) ? h - '0' : (h | 32) >= 'a' && (h | 32) <= 'f' ? (h | 32) - 'a' + 10 : -1;
                if (v < 0) {
                    free(b.p);
                    return lex_fail(L, L->i, "invalid \\%c escape", e);
                }
                cp = cp * 16 + (unsigned)v;
            }
            L->i += hl;
            char u[3];
            size_t ul = cp < 0x80 ? 1 : cp < 0x800 ? 2 : 3;
            if (ul == 1)
                u[0] = (char)cp;
            else if (ul == 2)
                u[0] = (char)(0xc0 | cp >> 6), u[1] = (char)(0x80 | (cp & 0x3f));
            else
                u[0] = (char)(0xe0 | cp >> 12), u[1] = (char)(0x80 | ((cp >> 6) & 0x3f)),
                u[2] = (char)(0x80 | (cp & 0x3f));
            sb_put(&b, u, ul);
        } else if (p) {
            sb_put(&b, to + (p - from), 1);
        } else {
            free(b.p);
            return lex_fail(L, L->i - 1, "unexpected escaped character");
        }
    }
    if (b.oom) {
        free(b.p);
        return false;
    }
    bool ok = push_tok(L, T_STR, b.p ? b.p : "", b.n, start);
    free(b.p);
    return ok;
}

static const struct {
    const char *seq;
    enum tok type;
} op_table[] = {
    {"{%", T_OPEN_STMT}, {"%}", T_CLOSE_STMT}, {"{{", T_OPEN_EXPR}, {"}}", T_CLOSE_EXPR}, {"(", T_LPAREN},
    {")", T_RPAREN}, {"{", T_LBRACE}, {"}", T_RBRACE}, {"[", T_LBRACK}, {"]", T_RBRACK}, {",", T_COMMA},
    {".", T_DOT}, {":", T_COLON}, {"|", T_PIPE}, {"<=", T_CMP}, {">=", T_CMP}, {"==", T_CMP}, {"!=", T_CMP},
    {"<", T_CMP}, {">", T_CMP}, {"+", T_ADD}, {"-", T_ADD}, {"~", T_ADD}, {"**", T_POW}, {"*", T_MUL},
    {"//", T_MUL}, {"/", T_MUL}, {"%", T_MUL}, {"=", T_ASSIGN},
};

static bool lex(struct lexer *L)
{
    int curly = 0;
    while (L->i < L->n) {
        enum tok last = last_type(L);
        if (last == T_EOF || last == T_CLOSE_STMT || last == T_CLOSE_EXPR || last == T_COMMENT) {
            size_t end = L->i;
            for (;;) {
                const char *b = memchr(L->s + end, '{', L->n - end);
                if (!b) {
                    end = L->n;
                    break;
                }
                end = (size_t)(b - L->s);
                if (end + 1 < L->n && (L->s[end + 1] == '%' || L->s[end + 1] == '{' || L->s[end + 1] == '#'))
                    break;
                end++;
            }
            if (end > L->i) {
                if (!push_tok(L, T_TEXT, L->s + L->i, end - L->i, L->i))
                    return false;
                L->i = end;
                continue;
            }
        }
        const char *s = L->s;
        size_t i = L->i;
        if (s[i] == '{' && i + 1 < L->n && s[i + 1] == '#') {
            size_t at = i;
            i += 2;
            bool strip_before = i < L->n && s[i] == '-';
            if (strip_before)
                i++;
            const char *end = NULL;
            for (size_t k = i; k + 1 < L->n; k++)
                if (s[k] == '#' && s[k + 1] == '}') {
                    end = s + k;
                    break;
                }
            if (!end)
                return lex_fail(L, at, "comment is not closed");
            bool strip_after = end > s + i && end[-1] == '-';
            if (strip_before)
                strip_last_text(L);
            if (!push_tok(L, T_COMMENT, "", 0, at))
                return false;
            L->i = (size_t)(end - s) + 2;
            if (strip_after)
                skip_ws(L);
            continue;
        }
        if (s[i] == '{' && i + 2 < L->n && s[i + 2] == '-' && (s[i + 1] == '%' || s[i + 1] == '{')) {
            strip_last_text(L);
            if (!push_tok(L, s[i + 1] == '%' ? T_OPEN_STMT : T_OPEN_EXPR, s + i, 2, i))
                return false;
            if (s[i + 1] == '{')
                curly = 0;
            L->i += 3;
            continue;
        }
        size_t w = ws_lead(s + i, L->n - i);
        if (i + w >= L->n)
            return lex_fail(L, i, "unexpected end of template");
        i = L->i = i + w;
        char c = s[i];
        if (c == '-' && i + 2 < L->n && s[i + 2] == '}' && (s[i + 1] == '%' || s[i + 1] == '}')) {
            if (!push_tok(L, s[i + 1] == '%' ? T_CLOSE_STMT : T_CLOSE_EXPR, s + i + 1, 2, i))
                return false;
            L->i += 3;
            skip_ws(L);
            continue;
        }
        if ((c == '-' || c == '+') && last != T_NAME && last != T_NUM && last != T_STR && last != T_RPAREN &&
            last != T_RBRACK) {
            if (last == T_TEXT || last == T_EOF)
                return lex_fail(L, i, "unexpected character '%c'", c);
            size_t j = i + 1;
            while (j < L->n && is_digit(s[j]))
                j++;
            if (j > i + 1 && j + 1 < L->n && s[j] == '.' && is_digit(s[j + 1])) {
                j++;
                while (j < L->n && is_digit(s[j]))
                    j++;
            }
            if (j >= L->n)
                return lex_fail(L, i, "unexpected end of template");
            if (!push_tok(L, j > i + 1 ? T_NUM : T_UNARY, s + i, j - i, i))
                return false;
            L->i = j;
            continue;
        }
        bool matched = false;
        for (size_t k = 0; k < sizeof op_table / sizeof op_table[0]; k++) {
            size_t ol = strlen(op_table[k].seq);
            if (op_table[k].type == T_CLOSE_EXPR && curly > 0)
                continue;
            if (i + ol <= L->n && memcmp(s + i, op_table[k].seq, ol) == 0) {
                enum tok ty = op_table[k].type;
                if (ty == T_OPEN_EXPR)
                    curly = 0;
                else if (ty == T_LBRACE)
                    curly++;
                else if (ty == T_RBRACE)
                    curly--;
                if (!push_tok(L, ty, s + i, ol, i))
                    return false;
                L->i += ol;
                matched = true;
                break;
            }
        }
        if (matched)
            continue;
        if (c == '\'' || c == '"') {
            if (!lex_string(L, c))
                return false;
            continue;
        }
        if (is_digit(c)) {
            size_t j = i;
            while (j < L->n && is_digit(s[j]))
                j++;
            if (last != T_DOT && j + 1 < L->n && s[j] == '.' && is_digit(s[j + 1])) {
                j++;
                while (j < L->n && is_digit(s[j]))
                    j++;
            }
            if (j >= L->n)
                return lex_fail(L, i, "unexpected end of template");
            if (!push_tok(L, T_NUM, s + i, j - i, i))
                return false;
            L->i = j;
            continue;
        }
        if (is_word(c)) {
            size_t j = i;
            while (j < L->n && is_word(s[j]))
                j++;
            if (j >= L->n)
                return lex_fail(L, i, "unexpected end of template");
            if (!push_tok(L, T_NAME, s + i, j - i, i))
                return false;
            L->i = j;
            continue;
        }
        return lex_fail(L, i, "unexpected character '%c'", c);
    }
    return push_tok(L, T_EOF, "", 0, L->n);
}

/* ---- the tree --------------------------------------------------------------- */

enum nkind {
    N_TEXT, N_OUT, N_IF, N_FOR, N_SET, N_MACRO, N_BREAK, N_CONTINUE, N_FILTERBLK,
    E_STR, E_INT, E_FLOAT, E_NAME, E_LIST, E_TUPLE, E_DICT, E_PAIR, E_ATTR, E_INDEX, E_SLICE, E_CALL, E_FILTER,
    E_TEST, E_BIN, E_AND, E_OR, E_NOT, E_NEG, E_POS, E_COND, E_KWARG,
};

enum binop { B_EQ, B_NE, B_LT, B_GT, B_LE, B_GE, B_IN, B_NOTIN, B_ADD, B_SUB, B_CAT, B_MUL, B_DIV, B_FDIV, B_MOD, B_POW };

/* Lists (bodies, arguments, items) are chained through next. */
struct node {
    enum nkind kind;
    int op;
    size_t pos;
    const char *s;
    size_t slen;
    long long i;
    double d;
    struct node *a, *b, *c;
    struct node *body, *alt;
    struct node *next;
};

struct parser {
    struct lexer *L;
    size_t k;
    unsigned depth;
};

static const struct token *peek(const struct parser *P)
{
    return &P->L->toks[P->k];
}

static bool tok_is(const struct parser *P, enum tok t)
{
    return peek(P)->type == t;
}

static bool name_is(const struct parser *P, size_t ahead, const char *name)
{
    if (P->k + ahead >= P->L->ntok)
        return false;
    const struct token *t = &P->L->toks[P->k + ahead];
    return t->type == T_NAME && t->len == strlen(name) && memcmp(t->s, name, t->len) == 0;
}

static void *perr(struct parser *P, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void *perr(struct parser *P, const char *fmt, ...)
{
    if (P->L->failed)
        return NULL;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    unsigned line, col;
    line_col(P->L->t->src, P->L->t->src_len, peek(P)->pos, &line, &col);
    P->L->st = text_errf(P->L->err, TEXT_EFORMAT, "chat template line %u, column %u: %s", line, col, msg);
    P->L->failed = true;
    return NULL;
}

static struct node *mk(struct parser *P, enum nkind kind, size_t pos)
{
    struct node *n = arena_alloc(&P->L->t->arena, sizeof(*n));
    if (!n) {
        P->L->st = text_errf(P->L->err, TEXT_ENOMEM, "no memory to parse the chat template");
        P->L->failed = true;
        return NULL;
    }
    n->kind = kind;
    n->pos = pos;
    return n;
}

static bool expect(struct parser *P, enum tok t, const char *what)
{
    if (!tok_is(P, t)) {
        perr(P, "expected %s", what);
        return false;
    }
    P->k++;
    return true;
}

static bool expect_name(struct parser *P, const char *name)
{
    if (!name_is(P, 0, name)) {
        perr(P, "expected '%s'", name);
        return false;
    }
    P->k++;
    return true;
}

static struct node *parse_expr(struct parser *P);
static struct node *parse_or(struct parser *P);
static struct node *parse_seq(struct parser *P, bool primary_only);
static struct node *parse_primary(struct parser *P);

/* (args): positional expressions and name=value keywords. */
static bool parse_args(struct parser *P, struct node **out)
{
    if (!expect(P, T_LPAREN, "'('"))
        return false;
    struct node **tail = out;
    while (!tok_is(P, T_RPAREN)) {
        struct node *arg;
        if (tok_is(P, T_NAME) && P->L->toks[P->k + 1].type == T_ASSIGN) {
            if (!(arg = mk(P, E_KWARG, peek(P)->pos)))
                return false;
            arg->s = peek(P)->s;
            arg->slen = peek(P)->len;
            P->k += 2;
            if (!(arg->a = parse_expr(P)))
                return false;
        } else if (!(arg = parse_expr(P))) {
            return false;
        }
        *tail = arg;
        tail = &arg->next;
        if (!tok_is(P, T_COMMA))
            break;
        P->k++;
    }
    return expect(P, T_RPAREN, "')'");
}

static struct node *parse_postfix(struct parser *P, struct node *n)
{
    while (n) {
        size_t pos = peek(P)->pos;
        if (tok_is(P, T_DOT)) {
            P->k++;
            if (!tok_is(P, T_NAME) && !tok_is(P, T_NUM))
                return perr(P, "expected a name after '.'");
            struct node *m = mk(P, tok_is(P, T_NAME) ? E_ATTR : E_INDEX, pos);
            if (!m)
                return NULL;
            m->a = n;
            if (tok_is(P, T_NAME)) {
                m->s = peek(P)->s;
                m->slen = peek(P)->len;
            } else {
                struct node *idx = mk(P, E_INT, pos);
                if (!idx)
                    return NULL;
                idx->i = strtoll(peek(P)->s, NULL, 10);
                m->b = idx;
            }
            P->k++;
            n = m;
        } else if (tok_is(P, T_LBRACK)) {
            P->k++;
            struct node *parts[3] = {NULL, NULL, NULL};
            int np = 0;
            bool slice = false;
            while (!tok_is(P, T_RBRACK)) {
                if (tok_is(P, T_COLON)) {
                    if (++np > 2)
                        return perr(P, "too many ':' in a slice");
                    slice = true;
                    P->k++;
                    continue;
                }
                if (parts[np])
                    return perr(P, "expected ']'");
                if (!(parts[np] = parse_expr(P)))
                    return NULL;
            }
            P->k++;
            struct node *m = mk(P, slice ? E_SLICE : E_INDEX, pos);
            if (!m)
                return NULL;
            if (!slice && !parts[0])
                return perr(P, "empty subscript");
            m->a = n;
            m->b = parts[0];
            m->c = parts[1];
            m->alt = parts[2];
            n = m;
        } else if (tok_is(P, T_LPAREN)) {
            struct node *m = mk(P, E_CALL, n->pos);
            if (!m)
                return NULL;
            m->a = n;
            if (!parse_args(P, &m->body))
                return NULL;
            n = m;
        } else {
            break;
        }
    }
    return n;
}

static struct node *parse_unary(struct parser *P)
{
    if ((tok_is(P, T_UNARY) || tok_is(P, T_ADD)) && (peek(P)->s[0] == '-' || peek(P)->s[0] == '+') &&
        peek(P)->len == 1) {
        struct node *n = mk(P, peek(P)->s[0] == '-' ? E_NEG : E_POS, peek(P)->pos);
        P->k++;
        if (!n || !(n->a = parse_unary(P)))
            return NULL;
        return n;
    }
    return parse_postfix(P, parse_primary(P));
}

static struct node *parse_filter(struct parser *P)
{
    struct node *n = parse_unary(P);
    while (n && tok_is(P, T_PIPE)) {
        P->k++;
        if (!tok_is(P, T_NAME))
            return perr(P, "expected a filter name");
        struct node *f = mk(P, E_FILTER, peek(P)->pos);
        if (!f)
            return NULL;
        f->a = n;
        f->s = peek(P)->s;
        f->slen = peek(P)->len;
        P->k++;
        if (tok_is(P, T_LPAREN) && !parse_args(P, &f->body))
            return NULL;
        n = f;
    }
    return n;
}

static bool test_takes_arg(const char *s, size_t n)
{
    static const char *names[] = {"equalto", "eq", "ne", "sameas", "divisibleby", "ge", "gt", "le", "lt", "in",
                                  "greaterthan", "lessthan"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i]) == n && !memcmp(names[i], s, n))
            return true;
    return false;
}

static struct node *parse_test(struct parser *P)
{
    struct node *n = parse_filter(P);
    while (n && name_is(P, 0, "is")) {
        P->k++;
        bool negate = name_is(P, 0, "not");
        if (negate)
            P->k++;
        if (!tok_is(P, T_NAME))
            return perr(P, "expected a test name");
        struct node *t = mk(P, E_TEST, peek(P)->pos);
        if (!t)
            return NULL;
        t->a = n;
        t->op = negate;
        t->s = peek(P)->s;
        t->slen = peek(P)->len;
        P->k++;
        if (tok_is(P, T_LPAREN)) {
            if (!parse_args(P, &t->body))
                return NULL;
        } else if (test_takes_arg(t->s, t->slen) &&
                   (tok_is(P, T_NUM) || tok_is(P, T_STR) || tok_is(P, T_LBRACK) ||
                    (tok_is(P, T_NAME) && !name_is(P, 0, "and") && !name_is(P, 0, "or") && !name_is(P, 0, "if") &&
                     !name_is(P, 0, "else") && !name_is(P, 0, "is") && !name_is(P, 0, "in") &&
                     !name_is(P, 0, "not")))) {
            if (!(t->body = parse_postfix(P, parse_primary(P))))
                return NULL;
        }
        n = t;
    }
    return n;
}

static struct node *bin(struct parser *P, int op, struct node *a, struct node *b, size_t pos)
{
    if (!a || !b)
        return NULL;
    struct node *n = mk(P, E_BIN, pos);
    if (n) {
        n->op = op;
        n->a = a;
        n->b = b;
    }
    return n;
}

static struct node *parse_pow(struct parser *P)
{
    struct node *n = parse_test(P);
    while (n && tok_is(P, T_POW)) {
        size_t pos = peek(P)->pos;
        P->k++;
        n = bin(P, B_POW, n, parse_test(P), pos);
    }
    return n;
}

static struct node *parse_mul(struct parser *P)
{
    struct node *n = parse_pow(P);
    while (n && tok_is(P, T_MUL)) {
        const struct token *t = peek(P);
        int op = t->len == 2 ? B_FDIV : t->s[0] == '*' ? B_MUL : t->s[0] == '/' ? B_DIV : B_MOD;
        P->k++;
        n = bin(P, op, n, parse_pow(P), t->pos);
    }
    return n;
}

static struct node *parse_add(struct parser *P)
{
    struct node *n = parse_mul(P);
    while (n && tok_is(P, T_ADD)) {
        const struct token *t = peek(P);
        int op = t->s[0] == '+' ? B_ADD : t->s[0] == '-' ? B_SUB : B_CAT;
        P->k++;
        n = bin(P, op, n, parse_mul(P), t->pos);
    }
    return n;
}

static struct node *parse_cmp(struct parser *P)
{
    struct node *n = parse_add(P);
    while (n) {
        size_t pos = peek(P)->pos;
        int op;
        if (name_is(P, 0, "not") && name_is(P, 1, "in")) {
            op = B_NOTIN;
            P->k += 2;
        } else if (name_is(P, 0, "in")) {
            op = B_IN;
            P->k++;
        } else if (tok_is(P, T_CMP)) {
            const char *s = peek(P)->s;
            op = s[0] == '=' ? B_EQ : s[0] == '!' ? B_NE : s[0] == '<' ? (s[1] ? B_LE : B_LT) : (s[1] ? B_GE : B_GT);
            P->k++;
        } else {
            break;
        }
        n = bin(P, op, n, parse_add(P), pos);
    }
    return n;
}

static struct node *parse_not(struct parser *P)
{
    if (name_is(P, 0, "not")) {
        struct node *n = mk(P, E_NOT, peek(P)->pos);
        P->k++;
        if (!n || !(n->a = parse_not(P)))
            return NULL;
        return n;
    }
    return parse_cmp(P);
}

static struct node *parse_logic(struct parser *P, const char *word, enum nkind kind, struct node *(*sub)(struct parser *))
{
    struct node *n = sub(P);
    while (n && name_is(P, 0, word)) {
        struct node *m = mk(P, kind, peek(P)->pos);
        P->k++;
        if (!m)
            return NULL;
        m->a = n;
        if (!(m->b = sub(P)))
            return NULL;
        n = m;
    }
    return n;
}

static struct node *parse_and(struct parser *P)
{
    return parse_logic(P, "and", E_AND, parse_not);
}

static struct node *parse_or(struct parser *P)
{
    return parse_logic(P, "or", E_OR, parse_and);
}

/* a if cond [else b]; without else, undefined when cond is false. */
static struct node *parse_expr(struct parser *P)
{
    if (++P->depth > MAX_PARSE_DEPTH)
        return perr(P, "expression nested too deeply");
    struct node *n = parse_or(P);
    if (n && name_is(P, 0, "if")) {
        struct node *c = mk(P, E_COND, peek(P)->pos);
        P->k++;
        if (!c || !(c->a = parse_or(P)))
            return NULL;
        c->b = n;
        if (name_is(P, 0, "else")) {
            P->k++;
            if (!(c->c = parse_expr(P)))
                return NULL;
        }
        n = c;
    }
    P->depth--;
    return n;
}

/* a, b, c (a tuple) or one expression; primary_only for loop targets. */
static struct node *parse_seq(struct parser *P, bool primary_only)
{
    size_t pos = peek(P)->pos;
    struct node *first = primary_only ? parse_primary(P) : parse_expr(P);
    if (!first || !tok_is(P, T_COMMA))
        return first;
    struct node *t = mk(P, E_TUPLE, pos);
    if (!t)
        return NULL;
    t->body = first;
    struct node **tail = &first->next;
    while (tok_is(P, T_COMMA)) {
        P->k++;
        if (tok_is(P, T_RPAREN))
            break;
        struct node *e = primary_only ? parse_primary(P) : parse_expr(P);
        if (!e)
            return NULL;
        *tail = e;
        tail = &e->next;
    }
    return t;
}

static struct node *parse_primary(struct parser *P)
{
    if (++P->depth > MAX_PARSE_DEPTH)
        return perr(P, "expression nested too deeply");
    const struct token *t = peek(P);
    struct node *n = NULL;
    switch (t->type) {
    case T_NUM:
        P->k++;
        if (memchr(t->s, '.', t->len)) {
            if ((n = mk(P, E_FLOAT, t->pos)))
                n->d = strtod(t->s, NULL);
        } else if ((n = mk(P, E_INT, t->pos))) {
            n->i = strtoll(t->s, NULL, 10);
        }
        break;
    case T_STR: {
        /* adjacent literals concatenate */
        size_t total = 0, k = P->k;
        while (P->L->toks[k].type == T_STR)
            total += P->L->toks[k++].len;
        char *s = arena_alloc(&P->L->t->arena, total + 1);
        if (!s) {
            P->L->st = text_errf(P->L->err, TEXT_ENOMEM, "no memory to parse the chat template");
            P->L->failed = true;
            return NULL;
        }
        if (!(n = mk(P, E_STR, t->pos)))
            return NULL;
        size_t off = 0;
        while (tok_is(P, T_STR)) {
            memcpy(s + off, peek(P)->s, peek(P)->len);
            off += peek(P)->len;
            P->k++;
        }
        n->s = s;
        n->slen = total;
        break;
    }
    case T_NAME:
        if ((n = mk(P, E_NAME, t->pos))) {
            n->s = t->s;
            n->slen = t->len;
        }
        P->k++;
        break;
    case T_LPAREN:
        P->k++;
        if (tok_is(P, T_RPAREN)) {
            n = mk(P, E_TUPLE, t->pos);
        } else if (!(n = parse_seq(P, false))) {
            return NULL;
        }
        if (!expect(P, T_RPAREN, "')'"))
            return NULL;
        break;
    case T_LBRACK:
    case T_LBRACE: {
        bool dict = t->type == T_LBRACE;
        P->k++;
        if (!(n = mk(P, dict ? E_DICT : E_LIST, t->pos)))
            return NULL;
        struct node **tail = &n->body;
        while (!tok_is(P, dict ? T_RBRACE : T_RBRACK)) {
            struct node *e = parse_expr(P);
            if (!e)
                return NULL;
            if (dict) {
                struct node *pair = mk(P, E_PAIR, e->pos);
                if (!pair || !expect(P, T_COLON, "':'"))
                    return NULL;
                pair->a = e;
                if (!(pair->b = parse_expr(P)))
                    return NULL;
                e = pair;
            }
            *tail = e;
            tail = &e->next;
            if (tok_is(P, T_COMMA))
                P->k++;
            else if (!tok_is(P, dict ? T_RBRACE : T_RBRACK))
                return perr(P, "expected ',' or '%c'", dict ? '}' : ']');
        }
        P->k++;
        break;
    }
    default:
        return perr(P, "unexpected %s", t->type == T_EOF ? "end of template" : "token");
    }
    P->depth--;
    return n;
}

/* ---- statements ------------------------------------------------------------- */

/* Parses nodes up to `{% <one of stops> ...` (left unconsumed) or the end of
 * the template when stops is NULL. */
static bool parse_body(struct parser *P, const char *const *stops, struct node **out);

static bool at_stop(const struct parser *P, const char *const *stops)
{
    if (!tok_is(P, T_OPEN_STMT))
        return false;
    for (; stops && *stops; stops++)
        if (name_is(P, 1, *stops))
            return true;
    return false;
}

static bool end_tag(struct parser *P, const char *name)
{
    return expect(P, T_OPEN_STMT, "'{%'") && expect_name(P, name) && expect(P, T_CLOSE_STMT, "'%}'");
}

static struct node *parse_if(struct parser *P, size_t pos)
{
    static const char *const stops[] = {"elif", "else", "endif", NULL};
    struct node *n = mk(P, N_IF, pos);
    if (!n || !(n->a = parse_expr(P)) || !expect(P, T_CLOSE_STMT, "'%}'") || !parse_body(P, stops, &n->body))
        return NULL;
    if (name_is(P, 1, "elif")) {
        size_t epos = peek(P)->pos;
        P->k += 2;
        return (n->alt = parse_if(P, epos)) ? n : NULL;
    }
    if (name_is(P, 1, "else")) {
        static const char *const end[] = {"endif", NULL};
        P->k += 2;
        if (!expect(P, T_CLOSE_STMT, "'%}'") || !parse_body(P, end, &n->alt))
            return NULL;
    }
    return end_tag(P, "endif") ? n : NULL;
}

static struct node *parse_for(struct parser *P, size_t pos)
{
    static const char *const stops[] = {"else", "endfor", NULL};
    struct node *n = mk(P, N_FOR, pos);
    if (!n || !(n->a = parse_seq(P, true)) || !expect_name(P, "in") || !(n->b = parse_or(P)))
        return NULL;
    if (name_is(P, 0, "if")) {
        P->k++;
        struct node *cond = parse_or(P);
        if (!cond)
            return NULL;
        if (name_is(P, 0, "else")) { /* a conditional expression, not a loop filter */
            struct node *c = mk(P, E_COND, cond->pos);
            P->k++;
            if (!c || !(c->c = parse_expr(P)))
                return NULL;
            c->a = cond;
            c->b = n->b;
            n->b = c;
        } else {
            n->c = cond;
        }
    }
    if (!expect(P, T_CLOSE_STMT, "'%}'") || !parse_body(P, stops, &n->body))
        return NULL;
    if (name_is(P, 1, "else")) {
        static const char *const end[] = {"endfor", NULL};
        P->k += 2;
        if (!expect(P, T_CLOSE_STMT, "'%}'") || !parse_body(P, end, &n->alt))
            return NULL;
    }
    return end_tag(P, "endfor") ? n : NULL;
}

static struct node *parse_stmt(struct parser *P)
{
    size_t pos = peek(P)->pos;
    P->k++; /* {% */
    if (!tok_is(P, T_NAME))
        return perr(P, "expected a statement name");
    if (++P->depth > MAX_PARSE_DEPTH)
        return perr(P, "blocks nested too deeply");
    struct node *n = NULL;
    if (name_is(P, 0, "if")) {
        P->k++;
        n = parse_if(P, pos);
    } else if (name_is(P, 0, "for")) {
        P->k++;
        n = parse_for(P, pos);
    } else if (name_is(P, 0, "set")) {
        P->k++;
        if (!(n = mk(P, N_SET, pos)) || !(n->a = parse_seq(P, false)))
            return NULL;
        if (tok_is(P, T_ASSIGN)) {
            P->k++;
            if (!(n->b = parse_seq(P, false)) || !expect(P, T_CLOSE_STMT, "'%}'"))
                return NULL;
        } else {
            static const char *const end[] = {"endset", NULL};
            if (!expect(P, T_CLOSE_STMT, "'%}'") || !parse_body(P, end, &n->body) || !end_tag(P, "endset"))
                return NULL;
        }
        if (n->a->kind != E_NAME && n->a->kind != E_ATTR && n->a->kind != E_TUPLE)
            return perr(P, "cannot assign to this expression");
    } else if (name_is(P, 0, "macro")) {
        static const char *const end[] = {"endmacro", NULL};
        P->k++;
        if (!tok_is(P, T_NAME))
            return perr(P, "expected a macro name");
        if (!(n = mk(P, N_MACRO, pos)))
            return NULL;
        n->s = peek(P)->s;
        n->slen = peek(P)->len;
        P->k++;
        if (!parse_args(P, &n->a))
            return NULL;
        for (struct node *p = n->a; p; p = p->next)
            if (p->kind != E_NAME && p->kind != E_KWARG)
                return perr(P, "a macro parameter must be a name");
        if (!expect(P, T_CLOSE_STMT, "'%}'") || !parse_body(P, end, &n->body) || !end_tag(P, "endmacro"))
            return NULL;
    } else if (name_is(P, 0, "break") || name_is(P, 0, "continue")) {
        n = mk(P, name_is(P, 0, "break") ? N_BREAK : N_CONTINUE, pos);
        P->k++;
        if (!n || !expect(P, T_CLOSE_STMT, "'%}'"))
            return NULL;
    } else if (name_is(P, 0, "filter")) {
        static const char *const end[] = {"endfilter", NULL};
        P->k++;
        if (!tok_is(P, T_NAME))
            return perr(P, "expected a filter name");
        if (!(n = mk(P, N_FILTERBLK, pos)))
            return NULL;
        struct node *f = mk(P, E_FILTER, peek(P)->pos);
        if (!f)
            return NULL;
        f->s = peek(P)->s;
        f->slen = peek(P)->len;
        P->k++;
        if (tok_is(P, T_LPAREN) && !parse_args(P, &f->body))
            return NULL;
        n->a = f;
        if (!expect(P, T_CLOSE_STMT, "'%}'") || !parse_body(P, end, &n->body) || !end_tag(P, "endfilter"))
            return NULL;
    } else {
        return perr(P, "unknown statement '%.*s'", (int)peek(P)->len, peek(P)->s);
    }
    P->depth--;
    return n;
}

static bool parse_body(struct parser *P, const char *const *stops, struct node **out)
{
    struct node **tail = out;
    for (;;) {
        if (P->L->failed)
            return false;
        struct node *n = NULL;
        switch (peek(P)->type) {
        case T_EOF:
            if (stops) {
                perr(P, "missing {%% %s %%}", stops[0] && stops[1] && stops[2] ? stops[2] : stops[1] ? stops[1]
                                                                                                 : stops[0]);
                return false;
            }
            return true;
        case T_TEXT:
            if (!(n = mk(P, N_TEXT, peek(P)->pos)))
                return false;
            n->s = peek(P)->s;
            n->slen = peek(P)->len;
            P->k++;
            break;
        case T_COMMENT:
            P->k++;
            continue;
        case T_OPEN_EXPR:
            if (!(n = mk(P, N_OUT, peek(P)->pos)))
                return false;
            P->k++;
            if (!(n->a = parse_expr(P)) || !expect(P, T_CLOSE_EXPR, "'}}'"))
                return false;
            break;
        case T_OPEN_STMT:
            if (at_stop(P, stops))
                return true;
            if (!(n = parse_stmt(P)))
                return false;
            break;
        default:
            perr(P, "unexpected token outside a tag");
            return false;
        }
        *tail = n;
        tail = &n->next;
    }
}

void jinja_free(jinja_tpl *t)
{
    if (!t)
        return;
    arena_free(&t->arena);
    free(t->src);
    free(t);
}

enum text_status jinja_parse(const char *src, size_t len, jinja_tpl **out, char *err)
{
    *out = NULL;
    if (len > JINJA_MAX_SOURCE)
        return text_errf(err, TEXT_EINVAL, "chat template is %zu bytes; the limit is %u", len, JINJA_MAX_SOURCE);
    jinja_tpl *t = calloc(1, sizeof(*t));
    struct lexer L = {.t = t, .err = err};
    if (!t || !(t->src = malloc(len + 1))) {
        free(t);
        return text_errf(err, TEXT_ENOMEM, "no memory to parse the chat template");
    }
    memcpy(t->src, src, len);
    t->src[len] = '\0';
    t->src_len = len;
    enum text_status st = TEXT_OK;
    if (!preprocess(&L, src, len)) {
        st = text_errf(err, TEXT_ENOMEM, "no memory to parse the chat template");
    } else if (!lex(&L)) {
        st = L.failed ? L.st : text_errf(err, TEXT_ENOMEM, "no memory to parse the chat template");
    } else {
        struct parser P = {.L = &L};
        if (!parse_body(&P, NULL, &t->body))
            st = L.st;
    }
    bool ok = st == TEXT_OK;
    free(L.s);
    free(L.map);
    free(L.toks);
    if (!ok) {
        jinja_free(t);
        return st;
    }
    *out = t;
    return TEXT_OK;
}

/* ---- the evaluator ---------------------------------------------------------- */

struct scope {
    struct scope *up;
    json_t *vars;
};

struct macro {
    const struct node *n;
    struct macro *next;
};

struct rt {
    const jinja_tpl *t;
    char *err;
    enum text_status st;
    bool failed;
    unsigned long steps, max_steps;
    size_t max_output;
    unsigned depth;
    time_t now;
    struct macro *macros;
    struct scope *root;
};

enum { X_OK, X_ERR, X_BREAK, X_CONT };

static bool rfail(struct rt *r, const struct node *n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool rfail(struct rt *r, const struct node *n, const char *fmt, ...)
{
    if (r->failed)
        return false;
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    unsigned line, col;
    line_col(r->t->src, r->t->src_len, n ? n->pos : 0, &line, &col);
    r->st = text_errf(r->err, TEXT_EINVAL, "chat template line %u, column %u: %s", line, col, msg);
    r->failed = true;
    return false;
}

static bool nomem(struct rt *r)
{
    if (!r->failed)
        r->st = text_errf(r->err, TEXT_ENOMEM, "no memory to render the chat template");
    r->failed = true;
    return false;
}

/* A failed sb_put: the output limit or no memory. */
static bool sb_fail(struct rt *r, const struct node *n, const struct sbuf *b)
{
    if (b->oom)
        return nomem(r);
    return rfail(r, n, "the rendered text exceeds %zu bytes", r->max_output);
}

static bool is_name(const struct node *n, const char *s)
{
    return n->slen == strlen(s) && memcmp(n->s, s, n->slen) == 0;
}

static bool streq(const char *s, size_t n, const char *lit)
{
    return n == strlen(lit) && memcmp(s, lit, n) == 0;
}

static json_t *str_new(const char *s, size_t n)
{
    return json_stringn_nocheck(s ? s : "", n);
}

static const char *sval(const json_t *v, size_t *n)
{
    *n = json_string_length(v);
    return json_string_value(v);
}

static bool truthy(const json_t *v)
{
    if (!v)
        return false;
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return json_object_size(v) > 0;
    case JSON_ARRAY:
        return json_array_size(v) > 0;
    case JSON_STRING:
        return json_string_length(v) > 0;
    case JSON_INTEGER:
        return json_integer_value(v) != 0;
    case JSON_REAL:
        return json_real_value(v) != 0 && !isnan(json_real_value(v));
    case JSON_TRUE:
        return true;
    default:
        return false;
    }
}

static const char *type_name(const json_t *v)
{
    static const char *names[] = {"mapping", "list", "string", "integer", "float", "boolean", "boolean", "none"};
    return v ? names[json_typeof(v)] : "undefined";
}

/* JavaScript's Number.prototype.toString: the shortest digits that read
 * back as d, positional unless the exponent is < -6 or > 20. */
static void js_num(double d, char out[40])
{
    if (isnan(d) || isinf(d)) {
        snprintf(out, 40, "%s", isnan(d) ? "NaN" : d > 0 ? "Infinity" : "-Infinity");
        return;
    }
    if (d == 0) {
        snprintf(out, 40, "0");
        return;
    }
    char e[40];
    for (int p = 1; p <= 17; p++) {
        snprintf(e, sizeof e, "%.*e", p - 1, d);
        if (strtod(e, NULL) == d)
            break;
    }
    bool neg = e[0] == '-';
    char digits[24];
    size_t nd = 0;
    const char *q = e + neg;
    for (; *q && *q != 'e'; q++)
        if (is_digit(*q) && nd < sizeof digits - 1)
            digits[nd++] = *q;
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = '\0';
    int exp = atoi(q + 1);
    char *o = out;
    if (neg)
        *o++ = '-';
    if (exp >= 21 || exp <= -7) {
        o += sprintf(o, "%c", digits[0]);
        if (nd > 1)
            o += sprintf(o, ".%s", digits + 1);
        sprintf(o, "e%c%d", exp < 0 ? '-' : '+', abs(exp));
    } else if (exp < 0) {
        o += sprintf(o, "0.");
        for (int k = -1; k > exp; k--)
            *o++ = '0';
        sprintf(o, "%s", digits);
    } else {
        for (int k = 0; k <= exp || k < (int)nd; k++) {
            if (k == exp + 1)
                *o++ = '.';
            *o++ = k < (int)nd ? digits[k] : '0';
        }
        *o = '\0';
    }
}

/* Python's float formatting as @huggingface/jinja prints it: 2.0, 0.5. */
static void float_text(double d, char out[40])
{
    if (d == 0 && signbit(d))
        snprintf(out, 40, "-0.0");
    else if (d == floor(d) && fabs(d) < 1e21)
        snprintf(out, 40, "%.1f", d);
    else
        js_num(d, out);
}

static bool put_json_str(struct sbuf *b, const char *s, size_t n)
{
    sb_put(b, "\"", 1);
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = c == '"' ? "\\\"" : c == '\\' ? "\\\\" : c == '\n' ? "\\n" : c == '\r' ? "\\r"
                        : c == '\t' ? "\\t" : c == '\b' ? "\\b" : c == '\f' ? "\\f" : NULL;
        if (!esc && c >= 0x20)
            continue;
        sb_put(b, s + run, i - run);
        run = i + 1;
        if (esc) {
            sb_puts(b, esc);
        } else {
            char u[8];
            snprintf(u, sizeof u, "\\u%04x", c);
            sb_puts(b, u);
        }
    }
    sb_put(b, s + run, n - run);
    return sb_put(b, "\"", 1);
}

static bool dump(struct rt *r, const struct node *at, const json_t *v, struct sbuf *b, int indent, unsigned depth)
{
    if (depth > MAX_EVAL_DEPTH)
        return rfail(r, at, "value nested too deeply for tojson");
    char num[40];
    size_t n;
    const char *s;
    switch (v ? json_typeof(v) : JSON_NULL) {
    case JSON_STRING:
        s = sval(v, &n);
        put_json_str(b, s, n);
        break;
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        sb_puts(b, num);
        break;
    case JSON_REAL:
        if (isnan(json_real_value(v)) || isinf(json_real_value(v)))
            snprintf(num, sizeof num, "null");
        else
            js_num(json_real_value(v), num);
        sb_puts(b, num);
        break;
    case JSON_TRUE:
        sb_puts(b, "true");
        break;
    case JSON_FALSE:
        sb_puts(b, "false");
        break;
    case JSON_NULL:
        sb_puts(b, "null");
        break;
    case JSON_ARRAY:
    case JSON_OBJECT: {
        bool arr = json_is_array(v);
        size_t count = arr ? json_array_size(v) : json_object_size(v);
        sb_puts(b, arr ? "[" : "{");
        size_t i = 0;
        const char *key;
        json_t *val;
        void *it = arr ? NULL : json_object_iter((json_t *)v);
        for (i = 0; i < count; i++) {
            if (i)
                sb_puts(b, indent > 0 ? "," : ", ");
            if (indent > 0) {
                sb_puts(b, "\n");
                for (int k = 0; k < indent * (int)(depth + 1); k++)
                    sb_put(b, " ", 1);
            }
            if (arr) {
                val = json_array_get(v, i);
            } else {
                key = json_object_iter_key(it);
                val = json_object_iter_value(it);
                put_json_str(b, key, strlen(key));
                sb_puts(b, ": ");
                it = json_object_iter_next((json_t *)v, it);
            }
            if (!dump(r, at, val, b, indent, depth + 1))
                return false;
        }
        if (indent > 0 && count) {
            sb_puts(b, "\n");
            for (int k = 0; k < indent * (int)depth; k++)
                sb_put(b, " ", 1);
        }
        sb_puts(b, arr ? "]" : "}");
        break;
    }
    }
    return !b->oom && !b->over ? true : sb_fail(r, at, b);
}

/* The text of a value as {{ }} prints it (none and undefined print nothing). */
static bool to_text(struct rt *r, const struct node *at, const json_t *v, struct sbuf *b)
{
    char num[40];
    size_t n;
    const char *s;
    if (!v)
        return true;
    switch (json_typeof(v)) {
    case JSON_STRING:
        s = sval(v, &n);
        sb_put(b, s, n);
        break;
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        sb_puts(b, num);
        break;
    case JSON_REAL:
        float_text(json_real_value(v), num);
        sb_puts(b, num);
        break;
    case JSON_TRUE:
    case JSON_FALSE:
        sb_puts(b, json_is_true(v) ? "true" : "false");
        break;
    case JSON_NULL:
        break;
    default:
        return dump(r, at, v, b, 0, 0);
    }
    return !b->oom && !b->over ? true : sb_fail(r, at, b);
}

/* A new string value holding v's text. */
static bool stringify(struct rt *r, const struct node *at, const json_t *v, json_t **out)
{
    if (json_is_string(v)) {
        *out = json_incref((json_t *)v);
        return true;
    }
    struct sbuf b = {.limit = r->max_output};
    if (!to_text(r, at, v, &b)) {
        free(b.p);
        return false;
    }
    *out = str_new(b.p, b.n);
    free(b.p);
    return *out ? true : nomem(r);
}

static json_t *lookup(struct scope *s, const char *name)
{
    for (; s; s = s->up) {
        json_t *v = json_object_get(s->vars, name);
        if (v)
            return v;
    }
    return NULL;
}

static const struct macro *find_macro(const struct rt *r, const char *name, size_t n)
{
    for (const struct macro *m = r->macros; m; m = m->next)
        if (m->n->slen == n && !memcmp(m->n->s, name, n))
            return m;
    return NULL;
}

static bool is_num(const json_t *v)
{
    return json_is_integer(v) || json_is_real(v);
}

static bool num_like(const json_t *v)
{
    return is_num(v) || json_is_boolean(v);
}

static double num_of(const json_t *v)
{
    return json_is_boolean(v) ? json_is_true(v) : json_number_value(v);
}

/* ==: @huggingface/jinja compares primitives by value and containers by
 * identity; none and undefined are equal. */
static bool loose_eq(const json_t *a, const json_t *b)
{
    if ((!a || json_is_null(a)) && (!b || json_is_null(b)))
        return true;
    if (!a || !b)
        return false;
    if (num_like(a) && num_like(b))
        return num_of(a) == num_of(b);
    if (json_is_string(a) && json_is_string(b))
        return json_string_length(a) == json_string_length(b) &&
               !memcmp(json_string_value(a), json_string_value(b), json_string_length(a));
    return a == b;
}

/* Membership in a list: primitives of the same type by value. */
static bool strict_eq(const json_t *a, const json_t *b)
{
    if (!a || !b)
        return a == b;
    if (json_typeof(a) != json_typeof(b) && !(is_num(a) && is_num(b)))
        return false;
    return json_is_array(a) || json_is_object(a) ? a == b : loose_eq(a, b);
}

static bool str_contains(const json_t *hay, const json_t *needle)
{
    size_t hn, nn;
    const char *h = sval(hay, &hn), *n = sval(needle, &nn);
    return nn == 0 || (hn >= nn && memmem(h, hn, n, nn));
}

/* Number of code points (Python's len of a str). */
static size_t cp_count(const char *s, size_t n)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        c += ((unsigned char)s[i] & 0xc0) != 0x80;
    return c;
}

/* Byte offset of code point k (k <= count). */
static size_t cp_offset(const char *s, size_t n, size_t k)
{
    size_t i = 0;
    for (; i < n; i++)
        if (((unsigned char)s[i] & 0xc0) != 0x80 && k-- == 0)
            return i;
    return n;
}

#define MAX_ARGS 16

struct args {
    json_t *pos[MAX_ARGS];
    size_t npos;
    const struct node *kwn[MAX_ARGS];
    json_t *kw[MAX_ARGS];
    size_t nkw;
};

static bool eval(struct rt *r, const struct node *n, struct scope *s, json_t **out);
static bool step(struct rt *r, const struct node *n);
static int exec_list(struct rt *r, const struct node *n, struct scope *s, struct sbuf *out);

static void args_free(struct args *a)
{
    for (size_t i = 0; i < a->npos; i++)
        json_decref(a->pos[i]);
    for (size_t i = 0; i < a->nkw; i++)
        json_decref(a->kw[i]);
    a->npos = a->nkw = 0;
}

static bool eval_args(struct rt *r, const struct node *list, struct scope *s, struct args *a)
{
    memset(a, 0, sizeof(*a));
    for (const struct node *p = list; p; p = p->next) {
        if ((p->kind == E_KWARG ? a->nkw : a->npos) == MAX_ARGS) {
            args_free(a);
            return rfail(r, p, "more than %d arguments", MAX_ARGS);
        }
        json_t *v;
        if (!eval(r, p->kind == E_KWARG ? p->a : p, s, &v)) {
            args_free(a);
            return false;
        }
        if (p->kind == E_KWARG) {
            a->kwn[a->nkw] = p;
            a->kw[a->nkw++] = v;
        } else {
            a->pos[a->npos++] = v;
        }
    }
    return true;
}

/* Argument i, or the keyword `name` (NULL for none). */
static json_t *kwarg(const struct args *a, const char *name)
{
    for (size_t k = 0; name && k < a->nkw; k++)
        if (is_name(a->kwn[k], name))
            return a->kw[k];
    return NULL;
}

static json_t *arg(const struct args *a, size_t i, const char *name)
{
    return i < a->npos ? a->pos[i] : kwarg(a, name);
}

static bool int_arg(struct rt *r, const struct node *at, const json_t *v, long long dflt, long long *out)
{
    if (!v || json_is_null(v)) {
        *out = dflt;
        return true;
    }
    if (!json_is_integer(v))
        return rfail(r, at, "expected an integer argument, got %s", type_name(v));
    *out = json_integer_value(v);
    return true;
}

static bool set_out(struct rt *r, json_t **out, json_t *v)
{
    *out = v;
    return v ? true : nomem(r);
}

/* ---- strings ---------------------------------------------------------------- */

/* strip/lstrip/rstrip: JavaScript's whitespace, or Python's set of chars. */
static json_t *strip(const json_t *v, const json_t *chars, bool lead, bool trail)
{
    size_t n, cn = 0;
    const char *s = sval(v, &n), *cs = json_is_string(chars) ? sval(chars, &cn) : NULL;
    size_t a = 0, e = n;
    if (cs) {
        while (lead && a < e && memchr(cs, s[a], cn))
            a++;
        while (trail && e > a && memchr(cs, s[e - 1], cn))
            e--;
    } else {
        if (lead)
            a = ws_lead(s, n);
        if (trail && a < n)
            e = n - ws_trail(s + a, n - a);
    }
    return str_new(s + a, e - a);
}

/* upper, lower, title and capitalize as @huggingface/jinja's: upper and
 * lower are JavaScript's toUpperCase/toLowerCase (text/casemap.h);
 * capitalize uppercases charAt(0), the first UTF-16 unit, so the first
 * character unless it lies past the BMP, and leaves the rest as it is;
 * title's /\b\w/ is ASCII, so it uppercases the ASCII letters that follow
 * anything but an ASCII letter, digit or underscore. */
enum case_op { CASE_LOWER, CASE_UPPER, CASE_TITLE, CASE_CAPITALIZE };

static enum case_op case_op(const char *name)
{
    return name[0] == 'l' ? CASE_LOWER : name[0] == 'u' ? CASE_UPPER : name[0] == 't' ? CASE_TITLE : CASE_CAPITALIZE;
}

static json_t *change_case(const json_t *v, enum case_op op)
{
    size_t n, len;
    const char *s = sval(v, &n);
    if (op == CASE_TITLE) {
        char *p = malloc(n + 1);
        if (!p)
            return NULL;
        for (size_t i = 0; i < n; i++)
            p[i] = s[i] >= 'a' && s[i] <= 'z' && (!i || !is_word((unsigned char)s[i - 1])) ? (char)(s[i] - 32) : s[i];
        json_t *out = str_new(p, n);
        free(p);
        return out;
    }
    /* capitalize: the first character when it is in the BMP; none when
     * the string starts with a byte that is not UTF-8 */
    size_t head = n;
    if (op == CASE_CAPITALIZE) {
        utf8proc_int32_t c;
        utf8proc_ssize_t l = n ? utf8proc_iterate((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &c) : 0;
        head = l > 0 && c < 0x10000 ? (size_t)l : 0;
    }
    char *p = casemap(s, head, op == CASE_LOWER ? CASEMAP_LOWER : CASEMAP_UPPER, &len);
    if (!p)
        return NULL;
    json_t *out = NULL;
    if (head == n) {
        out = str_new(p, len);
    } else { /* capitalize: the mapped head, then the rest as it was */
        struct sbuf b = {.limit = SIZE_MAX / 4};
        sb_put(&b, p, len);
        sb_put(&b, s + head, n - head);
        out = b.oom ? NULL : str_new(b.p, b.n);
        free(b.p);
    }
    free(p);
    return out;
}

static json_t *replace(const json_t *v, const json_t *from, const json_t *to, long long count)
{
    size_t n, fn, tn;
    const char *s = sval(v, &n), *f = sval(from, &fn), *t = sval(to, &tn);
    struct sbuf b = {.limit = SIZE_MAX / 4};
    size_t i = 0;
    if (!fn) { /* an empty pattern matches between every code point */
        for (size_t k = 0; k <= n; k++) {
            if (k == n || ((unsigned char)s[k] & 0xc0) != 0x80) {
                if (count != 0) {
                    sb_put(&b, t, tn);
                    count--;
                }
            }
            if (k < n)
                sb_put(&b, s + k, 1);
        }
    } else {
        while (i < n) {
            const char *hit = count != 0 ? memmem(s + i, n - i, f, fn) : NULL;
            if (!hit)
                break;
            sb_put(&b, s + i, (size_t)(hit - s) - i);
            sb_put(&b, t, tn);
            i = (size_t)(hit - s) + fn;
            count--;
        }
        sb_put(&b, s + i, n - i);
    }
    json_t *out = b.oom ? NULL : str_new(b.p, b.n);
    free(b.p);
    return out;
}

/* str.split(sep=None, maxsplit=-1), Python's rules. */
static json_t *split(const json_t *v, const json_t *sep, long long maxsplit)
{
    size_t n, sn = 0;
    const char *s = sval(v, &n), *sp = json_is_string(sep) ? sval(sep, &sn) : NULL;
    json_t *out = json_array();
    if (!out)
        return NULL;
    size_t i = 0;
    if (!sp) {
        i = ws_lead(s, n);
        while (i < n) {
            if (maxsplit >= 0 && (long long)json_array_size(out) >= maxsplit) {
                if (json_array_append_new(out, str_new(s + i, n - i)))
                    goto fail;
                break;
            }
            size_t j = i, l;
            while (j < n && !is_ws_cp(utf8_at((const unsigned char *)s + j, n - j, &l)))
                j += l;
            if (json_array_append_new(out, str_new(s + i, j - i)))
                goto fail;
            i = j + ws_lead(s + j, n - j);
        }
        return out;
    }
    for (;;) {
        const char *hit = maxsplit < 0 || (long long)json_array_size(out) < maxsplit ? memmem(s + i, n - i, sp, sn)
                                                                                     : NULL;
        size_t end = hit ? (size_t)(hit - s) : n;
        if (json_array_append_new(out, str_new(s + i, end - i)))
            goto fail;
        if (!hit)
            return out;
        i = end + sn;
    }
fail:
    json_decref(out);
    return NULL;
}

static bool starts_ends(struct rt *r, const struct node *at, const json_t *v, const json_t *pat, bool end, json_t **out)
{
    size_t n;
    const char *s = sval(v, &n);
    size_t np = json_is_array(pat) ? json_array_size(pat) : 1;
    for (size_t i = 0; i < np; i++) {
        const json_t *p = json_is_array(pat) ? json_array_get(pat, i) : pat;
        if (!json_is_string(p))
            return rfail(r, at, "%s() needs a string or a tuple of strings", end ? "endswith" : "startswith");
        size_t pn;
        const char *ps = sval(p, &pn);
        if (pn <= n && !memcmp(end ? s + n - pn : s, ps, pn))
            return set_out(r, out, json_true());
    }
    return set_out(r, out, json_false());
}

/* ---- methods, filters, tests ------------------------------------------------ */

static json_t *items_of(const json_t *obj)
{
    json_t *out = json_array();
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)obj, k, v)
    {
        json_t *pair = json_pack("[sO]", k, v);
        if (!out || json_array_append_new(out, pair)) {
            json_decref(out);
            return NULL;
        }
    }
    return out;
}

static bool method(struct rt *r, const struct node *at, json_t *self, const char *m, size_t ml, struct args *a,
                   json_t **out)
{
    *out = NULL;
    if (json_is_string(self)) {
        if (streq(m, ml, "strip") || streq(m, ml, "lstrip") || streq(m, ml, "rstrip"))
            return set_out(r, out, strip(self, arg(a, 0, "chars"), m[0] != 'r', m[0] != 'l'));
        if (streq(m, ml, "upper") || streq(m, ml, "lower") || streq(m, ml, "title") || streq(m, ml, "capitalize"))
            return set_out(r, out, change_case(self, case_op(m)));
        if (streq(m, ml, "startswith") || streq(m, ml, "endswith")) {
            if (!arg(a, 0, NULL))
                return rfail(r, at, "%.*s() needs an argument", (int)ml, m);
            return starts_ends(r, at, self, arg(a, 0, NULL), m[0] == 'e', out);
        }
        if (streq(m, ml, "split")) {
            long long max = -1;
            const json_t *sep = arg(a, 0, "sep");
            if (json_is_string(sep) && !json_string_length(sep))
                return rfail(r, at, "split(): empty separator");
            if (sep && !json_is_null(sep) && !json_is_string(sep))
                return rfail(r, at, "split(): the separator must be a string or none");
            return int_arg(r, at, arg(a, 1, "maxsplit"), -1, &max) && set_out(r, out, split(self, sep, max));
        }
        if (streq(m, ml, "replace")) {
            long long count;
            if (!json_is_string(arg(a, 0, NULL)) || !json_is_string(arg(a, 1, NULL)))
                return rfail(r, at, "replace() needs two strings");
            return int_arg(r, at, arg(a, 2, "count"), -1, &count) &&
                   set_out(r, out, replace(self, arg(a, 0, NULL), arg(a, 1, NULL), count));
        }
    } else if (json_is_object(self)) {
        if (streq(m, ml, "get")) {
            const json_t *k = arg(a, 0, "key");
            json_t *v = json_is_string(k) ? json_object_get(self, json_string_value(k)) : NULL;
            json_t *d = arg(a, 1, "default");
            *out = json_incref(v ? v : d ? d : json_null());
            return true;
        }
        if (streq(m, ml, "items"))
            return set_out(r, out, items_of(self));
        if (streq(m, ml, "keys") || streq(m, ml, "values")) {
            json_t *arr = json_array();
            const char *k;
            json_t *v;
            json_object_foreach(self, k, v)
            {
                if (!arr || json_array_append_new(arr, m[0] == 'k' ? json_string(k) : json_incref(v))) {
                    json_decref(arr);
                    return nomem(r);
                }
            }
            return set_out(r, out, arr);
        }
    }
    return rfail(r, at, "%s has no method %.*s()", type_name(self), (int)ml, m);
}

static bool apply_test(struct rt *r, const struct node *at, const char *t, size_t tl, const json_t *v,
                       const struct args *a, bool *res)
{
    const json_t *x = arg(a, 0, NULL);
    if (streq(t, tl, "defined"))
        *res = v != NULL;
    else if (streq(t, tl, "undefined"))
        *res = v == NULL;
    else if (streq(t, tl, "none"))
        *res = json_is_null(v);
    else if (streq(t, tl, "string"))
        *res = json_is_string(v);
    else if (streq(t, tl, "number"))
        *res = is_num(v);
    else if (streq(t, tl, "integer"))
        *res = json_is_integer(v);
    else if (streq(t, tl, "float"))
        *res = json_is_real(v);
    else if (streq(t, tl, "boolean"))
        *res = json_is_boolean(v);
    else if (streq(t, tl, "true"))
        *res = json_is_true(v);
    else if (streq(t, tl, "false"))
        *res = json_is_false(v);
    else if (streq(t, tl, "mapping"))
        *res = json_is_object(v);
    else if (streq(t, tl, "iterable") || streq(t, tl, "sequence"))
        *res = json_is_array(v) || json_is_object(v) || json_is_string(v);
    else if (streq(t, tl, "callable"))
        *res = false;
    else if (streq(t, tl, "odd") || streq(t, tl, "even") || streq(t, tl, "divisibleby")) {
        long long d = 2;
        if (!json_is_integer(v))
            return rfail(r, at, "'%.*s' needs an integer", (int)tl, t);
        if (t[0] == 'd' && (!int_arg(r, at, x, 1, &d) || d == 0))
            return r->failed ? false : rfail(r, at, "divisibleby(0)");
        long long m = json_integer_value(v) % d;
        *res = t[0] == 'o' ? m != 0 : m == 0;
    } else if (streq(t, tl, "equalto") || streq(t, tl, "eq") || streq(t, tl, "sameas"))
        *res = loose_eq(v, x);
    else if (streq(t, tl, "ne"))
        *res = !loose_eq(v, x);
    else if (streq(t, tl, "lt") || streq(t, tl, "gt") || streq(t, tl, "le") || streq(t, tl, "ge") ||
             streq(t, tl, "lessthan") || streq(t, tl, "greaterthan")) {
        if (!num_like(v) || !num_like(x))
            return rfail(r, at, "'%.*s' compares numbers", (int)tl, t);
        double p = num_of(v), q = num_of(x);
        *res = t[0] == 'l' ? (tl == 2 && t[1] == 'e' ? p <= q : p < q) : (tl == 2 && t[1] == 'e' ? p >= q : p > q);
    } else if (streq(t, tl, "in")) {
        if (json_is_string(x) && json_is_string(v))
            *res = str_contains(x, v);
        else if (json_is_object(x) && json_is_string(v))
            *res = json_object_get(x, json_string_value(v)) != NULL;
        else if (json_is_array(x)) {
            *res = false;
            for (size_t i = 0; i < json_array_size(x) && !*res; i++)
                *res = strict_eq(json_array_get(x, i), v);
        } else
            return rfail(r, at, "'in' needs a string, list or mapping");
    } else if (streq(t, tl, "lower") || streq(t, tl, "upper")) {
        if (!json_is_string(v))
            return rfail(r, at, "'%.*s' needs a string", (int)tl, t);
        /* as @huggingface/jinja: the string is its own lowercase (uppercase) */
        size_t n, len;
        const char *s = sval(v, &n);
        char *p = casemap(s, n, t[0] == 'l' ? CASEMAP_LOWER : CASEMAP_UPPER, &len);
        if (!p)
            return nomem(r);
        *res = len == n && !memcmp(p, s, n);
        free(p);
    } else
        return rfail(r, at, "unknown test '%.*s'", (int)tl, t);
    return true;
}

static bool filter(struct rt *r, const struct node *at, const char *f, size_t fl, json_t *v, struct args *a,
                   struct scope *s, json_t **out);

/* Attribute paths as selectattr/map take them: "a.b.0". */
static json_t *attr_path(json_t *v, const json_t *path)
{
    if (!json_is_string(path))
        return NULL;
    size_t n;
    const char *p = sval(path, &n), *end = p + n;
    while (v && p <= end) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        size_t l = dot ? (size_t)(dot - p) : (size_t)(end - p);
        if (json_is_object(v)) {
            char key[256];
            if (l >= sizeof key)
                return NULL;
            memcpy(key, p, l);
            key[l] = '\0';
            v = json_object_get(v, key);
        } else if (json_is_array(v) && l && l < 10 && strspn(p, "0123456789") >= l) {
            v = json_array_get(v, strtoul(p, NULL, 10));
        } else {
            return NULL;
        }
        if (!dot)
            break;
        p = dot + 1;
    }
    return v;
}

static int cmp_vals(const json_t *x, const json_t *y, bool case_sensitive)
{
    if (num_like(x) && num_like(y))
        return num_of(x) < num_of(y) ? -1 : num_of(x) > num_of(y);
    if (json_is_string(x) && json_is_string(y)) {
        const char *p = json_string_value(x), *q = json_string_value(y);
        size_t pn = json_string_length(x), qn = json_string_length(y);
        for (size_t i = 0; i < pn && i < qn; i++) {
            int c = (unsigned char)p[i], d = (unsigned char)q[i];
            if (!case_sensitive) {
                c = c >= 'A' && c <= 'Z' ? c + 32 : c;
                d = d >= 'A' && d <= 'Z' ? d + 32 : d;
            }
            if (c != d)
                return c < d ? -1 : 1;
        }
        return pn < qn ? -1 : pn > qn;
    }
    return 0;
}

struct sort_item {
    json_t *key, *val;
    size_t idx;
    bool reverse, cs;
};

static int sort_cmp(const void *p, const void *q)
{
    const struct sort_item *x = p, *y = q;
    int c = cmp_vals(x->key, y->key, x->cs);
    if (x->reverse)
        c = -c;
    return c ? c : x->idx < y->idx ? -1 : 1;
}

static bool check_comparable(struct rt *r, const struct node *at, struct sort_item *it, size_t n)
{
    for (size_t i = 1; i < n; i++)
        if (!((num_like(it[0].key) && num_like(it[i].key)) || (json_is_string(it[0].key) && json_is_string(it[i].key))))
            return rfail(r, at, "cannot sort %s with %s", type_name(it[0].key), type_name(it[i].key));
    return true;
}

static bool filter_seq(struct rt *r, const struct node *at, const char *f, size_t fl, json_t *v, struct args *a,
                       struct scope *s, json_t **out)
{
    size_t n = json_array_size(v);
    if (streq(f, fl, "selectattr") || streq(f, fl, "rejectattr") || streq(f, fl, "select") ||
        streq(f, fl, "reject")) {
        bool attr = fl == 10, keep_true = f[0] == 's';
        size_t first = attr ? 1 : 0;
        const json_t *tname = arg(a, first, NULL);
        if (attr && !json_is_string(arg(a, 0, NULL)))
            return rfail(r, at, "%.*s needs an attribute name", (int)fl, f);
        if (tname && !json_is_string(tname))
            return rfail(r, at, "%.*s: the test must be a name", (int)fl, f);
        struct args targs = {0};
        for (size_t i = first + 1; i < a->npos; i++)
            targs.pos[targs.npos++] = a->pos[i];
        json_t *res = json_array();
        if (!res)
            return nomem(r);
        for (size_t i = 0; i < n; i++) {
            json_t *item = json_array_get(v, i), *x = attr ? attr_path(item, arg(a, 0, NULL)) : item;
            bool ok;
            if (tname) {
                if (!apply_test(r, at, json_string_value(tname), json_string_length(tname), x, &targs, &ok)) {
                    json_decref(res);
                    return false;
                }
            } else {
                ok = truthy(x);
            }
            if (ok == keep_true && json_array_append(res, item)) {
                json_decref(res);
                return nomem(r);
            }
        }
        return set_out(r, out, res);
    }
    if (streq(f, fl, "map")) {
        const json_t *attr = kwarg(a, "attribute"), *dflt = kwarg(a, "default");
        const json_t *fname = a->npos ? a->pos[0] : NULL;
        if (!attr && !json_is_string(fname))
            return rfail(r, at, "map needs attribute= or a filter name");
        json_t *res = json_array();
        if (!res)
            return nomem(r);
        for (size_t i = 0; i < n; i++) {
            json_t *item = json_array_get(v, i), *x;
            if (attr) {
                x = json_incref(attr_path(item, attr));
                if (!x && dflt)
                    x = json_incref((json_t *)dflt);
                if (!x)
                    x = json_null();
            } else {
                struct args fargs = {0};
                for (size_t k = 1; k < a->npos; k++)
                    fargs.pos[fargs.npos++] = a->pos[k];
                if (!filter(r, at, json_string_value(fname), json_string_length(fname), item, &fargs, s, &x)) {
                    json_decref(res);
                    return false;
                }
            }
            if (json_array_append_new(res, x ? x : json_null())) {
                json_decref(res);
                return nomem(r);
            }
        }
        return set_out(r, out, res);
    }
    if (streq(f, fl, "join")) {
        const json_t *sep = arg(a, 0, "d"), *attr = arg(a, 1, "attribute");
        struct sbuf b = {.limit = r->max_output};
        for (size_t i = 0; i < n; i++) {
            if (i && json_is_string(sep))
                sb_put(&b, json_string_value(sep), json_string_length(sep));
            json_t *item = json_array_get(v, i);
            if (!to_text(r, at, attr ? attr_path(item, attr) : item, &b)) {
                free(b.p);
                return false;
            }
        }
        if (b.oom || b.over) {
            free(b.p);
            return sb_fail(r, at, &b);
        }
        *out = str_new(b.p, b.n);
        free(b.p);
        return *out ? true : nomem(r);
    }
    if (streq(f, fl, "first") || streq(f, fl, "last")) {
        *out = n ? json_incref(json_array_get(v, f[0] == 'f' ? 0 : n - 1)) : NULL;
        return true;
    }
    if (streq(f, fl, "reverse") || streq(f, fl, "list")) {
        json_t *res = json_array();
        for (size_t i = 0; res && i < n; i++)
            if (json_array_append(res, json_array_get(v, f[0] == 'r' ? n - 1 - i : i))) {
                json_decref(res);
                res = NULL;
            }
        return set_out(r, out, res);
    }
    if (streq(f, fl, "sort") || streq(f, fl, "unique")) {
        bool reverse = truthy(arg(a, 0, "reverse")), cs = truthy(arg(a, 1, "case_sensitive"));
        const json_t *attr = arg(a, 2, "attribute");
        struct sort_item *it = calloc(n ? n : 1, sizeof(*it));
        json_t *res = json_array();
        if (!it || !res) {
            free(it);
            json_decref(res);
            return nomem(r);
        }
        for (size_t i = 0; i < n; i++)
            it[i] = (struct sort_item){attr ? attr_path(json_array_get(v, i), attr) : json_array_get(v, i),
                                       json_array_get(v, i), i, reverse, cs};
        bool ok = true;
        if (f[0] == 's') {
            ok = check_comparable(r, at, it, n);
            if (ok)
                qsort(it, n, sizeof(*it), sort_cmp);
        }
        for (size_t i = 0; ok && i < n; i++) {
            bool dup = false;
            for (size_t k = 0; f[0] == 'u' && k < i && !dup; k++)
                dup = strict_eq(it[k].key, it[i].key) ||
                      (!cs && json_is_string(it[k].key) && json_is_string(it[i].key) && !cmp_vals(it[k].key, it[i].key, false));
            if (!dup && json_array_append(res, it[i].val))
                ok = nomem(r);
        }
        free(it);
        if (!ok) {
            json_decref(res);
            return false;
        }
        *out = res;
        return true;
    }
    return rfail(r, at, "unknown filter '%.*s' for a list", (int)fl, f);
}

static bool indent_filter(struct rt *r, const struct node *at, const json_t *v, struct args *a, json_t **out)
{
    const json_t *w = arg(a, 0, "width");
    bool first = truthy(arg(a, 1, "first")), blank = truthy(arg(a, 2, "blank"));
    struct sbuf pad = {.limit = 4096}, b = {.limit = r->max_output};
    if (json_is_string(w))
        sb_put(&pad, json_string_value(w), json_string_length(w));
    else {
        long long k = 0;
        if (!int_arg(r, at, w, 4, &k))
            return false;
        if (k < 0 || k > 1024)
            return rfail(r, at, "indent width %lld is out of range", k);
        for (long long i = 0; i < k; i++)
            sb_put(&pad, " ", 1);
    }
    size_t n;
    const char *s = sval(v, &n);
    for (size_t i = 0, line = 0; i <= n; line++) {
        const char *nl = memchr(s + i, '\n', n - i);
        size_t end = nl ? (size_t)(nl - s) : n;
        bool empty = end == i || ws_lead(s + i, end - i) == end - i;
        if ((line > 0 || first) && (blank || !empty))
            sb_put(&b, pad.p, pad.n);
        sb_put(&b, s + i, end - i);
        if (!nl)
            break;
        sb_put(&b, "\n", 1);
        i = end + 1;
    }
    free(pad.p);
    if (b.oom || b.over || pad.oom) {
        free(b.p);
        return b.over ? sb_fail(r, at, &b) : nomem(r);
    }
    *out = str_new(b.p, b.n);
    free(b.p);
    return *out ? true : nomem(r);
}

static bool filter(struct rt *r, const struct node *at, const char *f, size_t fl, json_t *v, struct args *a,
                   struct scope *s, json_t **out)
{
    *out = NULL;
    if (streq(f, fl, "default") || streq(f, fl, "d")) {
        bool use = !v || (truthy(arg(a, 1, "boolean")) && !truthy(v));
        json_t *d = arg(a, 0, "default_value");
        if (!use) {
            *out = json_incref(v);
            return true;
        }
        return set_out(r, out, d ? json_incref(d) : json_string(""));
    }
    if (streq(f, fl, "safe") || streq(f, fl, "string")) {
        if (f[1] == 'a') {
            *out = json_incref(v);
            return true;
        }
        return v ? stringify(r, at, v, out) : set_out(r, out, json_string(""));
    }
    if (streq(f, fl, "tojson")) {
        long long indent = 0;
        if (!int_arg(r, at, arg(a, 0, "indent"), 0, &indent))
            return false;
        if (indent < 0 || indent > 64)
            return rfail(r, at, "tojson indent %lld is out of range", indent);
        struct sbuf b = {.limit = r->max_output};
        if (!dump(r, at, v, &b, (int)indent, 0)) {
            free(b.p);
            return false;
        }
        *out = str_new(b.p, b.n);
        free(b.p);
        return *out ? true : nomem(r);
    }
    if (streq(f, fl, "length") || streq(f, fl, "count")) {
        size_t n = json_is_string(v) ? cp_count(json_string_value(v), json_string_length(v))
                   : json_is_array(v) ? json_array_size(v) : json_is_object(v) ? json_object_size(v) : SIZE_MAX;
        if (n == SIZE_MAX)
            return rfail(r, at, "%s has no length", type_name(v));
        return set_out(r, out, json_integer((json_int_t)n));
    }
    if (!v)
        return rfail(r, at, "filter '%.*s' applied to an undefined value", (int)fl, f);
    if (json_is_array(v))
        return filter_seq(r, at, f, fl, v, a, s, out);
    if (json_is_string(v)) {
        if (streq(f, fl, "trim"))
            return set_out(r, out, strip(v, arg(a, 0, "chars"), true, true));
        if (streq(f, fl, "upper") || streq(f, fl, "lower") || streq(f, fl, "title") || streq(f, fl, "capitalize"))
            return set_out(r, out, change_case(v, case_op(f)));
        if (streq(f, fl, "replace")) {
            long long count;
            if (!json_is_string(arg(a, 0, NULL)) || !json_is_string(arg(a, 1, NULL)))
                return rfail(r, at, "replace needs two strings");
            return int_arg(r, at, arg(a, 2, "count"), -1, &count) &&
                   set_out(r, out, replace(v, arg(a, 0, NULL), arg(a, 1, NULL), count));
        }
        if (streq(f, fl, "indent"))
            return indent_filter(r, at, v, a, out);
        if (streq(f, fl, "int") || streq(f, fl, "float")) {
            const char *p = json_string_value(v);
            return set_out(r, out, f[0] == 'i' ? json_integer(strtoll(p, NULL, 10)) : json_real(strtod(p, NULL)));
        }
        if (streq(f, fl, "first") || streq(f, fl, "last") || streq(f, fl, "list") || streq(f, fl, "reverse")) {
            size_t n;
            const char *p = sval(v, &n);
            json_t *chars = json_array();
            for (size_t i = 0; chars && i < n;) {
                size_t l;
                utf8_at((const unsigned char *)p + i, n - i, &l);
                if (json_array_append_new(chars, str_new(p + i, l)))
                    json_decref(chars), chars = NULL;
                i += l;
            }
            if (!chars)
                return nomem(r);
            if (f[0] == 'r') {
                struct sbuf b = {.limit = SIZE_MAX / 4};
                for (size_t i = json_array_size(chars); i-- > 0;)
                    sb_put(&b, json_string_value(json_array_get(chars, i)),
                           json_string_length(json_array_get(chars, i)));
                json_decref(chars);
                *out = b.oom ? NULL : str_new(b.p, b.n);
                free(b.p);
                return *out ? true : nomem(r);
            }
            bool ok = filter_seq(r, at, f, fl, chars, a, s, out);
            json_decref(chars);
            return ok;
        }
    }
    if (json_is_object(v)) {
        if (streq(f, fl, "items") || streq(f, fl, "dictsort")) {
            json_t *items = items_of(v);
            if (!items)
                return nomem(r);
            if (f[0] == 'i') {
                *out = items;
                return true;
            }
            size_t n = json_array_size(items);
            struct sort_item *it = calloc(n ? n : 1, sizeof(*it));
            bool by_value = json_is_string(arg(a, 1, "by")) && !strcmp(json_string_value(arg(a, 1, "by")), "value");
            json_t *res = json_array();
            if (!it || !res) {
                free(it);
                json_decref(res);
                json_decref(items);
                return nomem(r);
            }
            for (size_t i = 0; i < n; i++)
                it[i] = (struct sort_item){json_array_get(json_array_get(items, i), by_value),
                                           json_array_get(items, i), i, truthy(arg(a, 2, "reverse")),
                                           truthy(arg(a, 0, "case_sensitive"))};
            bool ok = check_comparable(r, at, it, n);
            if (ok)
                qsort(it, n, sizeof(*it), sort_cmp);
            for (size_t i = 0; ok && i < n; i++)
                if (json_array_append(res, it[i].val))
                    ok = nomem(r);
            free(it);
            json_decref(items);
            if (!ok) {
                json_decref(res);
                return false;
            }
            *out = res;
            return true;
        }
        if (streq(f, fl, "list") || streq(f, fl, "first")) {
            json_t *keys;
            struct args none = {0};
            if (!method(r, at, v, "keys", 4, &none, &keys))
                return false;
            bool ok = filter_seq(r, at, f, fl, keys, a, s, out);
            json_decref(keys);
            return ok;
        }
    }
    if (num_like(v) || json_is_string(v)) {
        double d = json_is_string(v) ? 0 : num_of(v);
        if (streq(f, fl, "int"))
            return set_out(r, out, json_integer(json_is_integer(v) ? json_integer_value(v)
                                                : d > -9.2e18 && d < 9.2e18 ? (json_int_t)d : 0));
        if (streq(f, fl, "float"))
            return set_out(r, out, json_real(d));
        if (streq(f, fl, "abs"))
            return set_out(r, out, json_is_integer(v) ? json_integer(json_integer_value(v) < 0 &&
                                                                     json_integer_value(v) > LLONG_MIN
                                                                         ? -json_integer_value(v)
                                                                         : json_integer_value(v))
                                                      : json_real(fabs(d)));
        if (streq(f, fl, "round")) {
            long long prec;
            if (!int_arg(r, at, arg(a, 0, "precision"), 0, &prec))
                return false;
            if (prec < 0 || prec > 15)
                return rfail(r, at, "round precision %lld is out of range", prec);
            const json_t *m = arg(a, 1, "method");
            double scale = pow(10, (double)prec), x = d * scale;
            const char *how = json_is_string(m) ? json_string_value(m) : "common";
            x = !strcmp(how, "floor") ? floor(x) : !strcmp(how, "ceil") ? ceil(x) : round(x);
            return set_out(r, out, json_real(x / scale));
        }
        if (streq(f, fl, "bool"))
            return set_out(r, out, json_boolean(truthy(v)));
    }
    return rfail(r, at, "unknown filter '%.*s' for a %s", (int)fl, f, type_name(v));
}

/* ---- calls ------------------------------------------------------------------ */

static bool call_macro(struct rt *r, const struct node *at, const struct macro *m, struct args *a, json_t **out)
{
    struct scope sc = {r->root, json_object()};
    if (!sc.vars)
        return nomem(r);
    size_t i = 0;
    bool ok = true;
    for (const struct node *p = m->n->a; ok && p; p = p->next, i++) {
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)p->slen, p->s);
        json_t *v = arg(a, i, name);
        if (v)
            ok = !json_object_set(sc.vars, name, v) || nomem(r);
        else if (p->kind == E_KWARG) {
            ok = eval(r, p->a, &sc, &v) && (!v || !json_object_set_new(sc.vars, name, v) || nomem(r));
        }
    }
    struct sbuf b = {.limit = r->max_output};
    if (ok) {
        r->depth++;
        ok = r->depth <= MAX_EVAL_DEPTH ? exec_list(r, m->n->body, &sc, &b) == X_OK
                                        : rfail(r, at, "macros nested deeper than %d", MAX_EVAL_DEPTH);
        r->depth--;
    }
    json_decref(sc.vars);
    if (ok)
        ok = set_out(r, out, str_new(b.p, b.n));
    free(b.p);
    return ok;
}

/* strftime_now: %Y %m %d %b %B %H %M %% as @huggingface/jinja formats them;
 * anything else stays as written. */
static bool strftime_now(struct rt *r, const struct node *at, const json_t *fmt, json_t **out)
{
    static const char *months[] = {"January", "February", "March", "April", "May", "June", "July", "August",
                                   "September", "October", "November", "December"};
    if (!json_is_string(fmt))
        return rfail(r, at, "strftime_now() needs a format string");
    struct tm tm;
    if (!localtime_r(&r->now, &tm))
        return rfail(r, at, "strftime_now(): the clock is out of range");
    size_t n;
    const char *s = sval(fmt, &n);
    struct sbuf b = {.limit = r->max_output};
    for (size_t i = 0; i < n; i++) {
        char tmp[32];
        if (s[i] != '%' || i + 1 == n || !strchr("YmdbBHM%", s[i + 1]) || !s[i + 1]) {
            sb_put(&b, s + i, 1);
            continue;
        }
        switch (s[++i]) {
        case 'Y': snprintf(tmp, sizeof tmp, "%d", tm.tm_year + 1900); break;
        case 'm': snprintf(tmp, sizeof tmp, "%02d", tm.tm_mon + 1); break;
        case 'd': snprintf(tmp, sizeof tmp, "%02d", tm.tm_mday); break;
        case 'b': snprintf(tmp, sizeof tmp, "%.3s", months[tm.tm_mon]); break;
        case 'B': snprintf(tmp, sizeof tmp, "%s", months[tm.tm_mon]); break;
        case 'H': snprintf(tmp, sizeof tmp, "%02d", tm.tm_hour); break;
        case 'M': snprintf(tmp, sizeof tmp, "%02d", tm.tm_min); break;
        default: snprintf(tmp, sizeof tmp, "%%"); break;
        }
        sb_puts(&b, tmp);
    }
    bool ok = b.oom || b.over ? sb_fail(r, at, &b) : set_out(r, out, str_new(b.p, b.n));
    free(b.p);
    return ok;
}

static bool call_builtin(struct rt *r, const struct node *at, const char *f, size_t fl, struct args *a, json_t **out)
{
    if (streq(f, fl, "raise_exception")) {
        struct sbuf b = {.limit = 256};
        to_text(r, at, arg(a, 0, NULL), &b);
        bool ok = rfail(r, at, "raise_exception: %s", b.p ? b.p : "");
        free(b.p);
        return ok;
    }
    if (streq(f, fl, "namespace") || streq(f, fl, "dict")) {
        json_t *ns = json_object();
        if (!ns)
            return nomem(r);
        if (a->npos && json_is_object(a->pos[0]) && json_object_update(ns, a->pos[0])) {
            json_decref(ns);
            return nomem(r);
        }
        for (size_t i = 0; i < a->nkw; i++) {
            char name[128];
            snprintf(name, sizeof name, "%.*s", (int)a->kwn[i]->slen, a->kwn[i]->s);
            if (json_object_set(ns, name, a->kw[i] ? a->kw[i] : json_null())) {
                json_decref(ns);
                return nomem(r);
            }
        }
        *out = ns;
        return true;
    }
    if (streq(f, fl, "range")) {
        long long x = 0, y = 0, z = 1;
        if (!a->npos || a->npos > 3 || !int_arg(r, at, a->pos[0], 0, &x) ||
            !int_arg(r, at, arg(a, 1, NULL), 0, &y) || !int_arg(r, at, arg(a, 2, NULL), 1, &z))
            return r->failed ? false : rfail(r, at, "range() takes 1 to 3 integers");
        if (a->npos == 1)
            y = x, x = 0;
        if (z == 0)
            return rfail(r, at, "range() step must not be zero");
        json_t *arr = json_array();
        for (long long i = x; arr && (z > 0 ? i < y : i > y); i += z) {
            if (json_array_size(arr) >= MAX_RANGE) {
                json_decref(arr);
                return rfail(r, at, "range() longer than %d", MAX_RANGE);
            }
            if (json_array_append_new(arr, json_integer(i)))
                json_decref(arr), arr = NULL;
            if (z > 0 ? i > LLONG_MAX - z : i < LLONG_MIN - z)
                break;
        }
        return set_out(r, out, arr);
    }
    if (streq(f, fl, "strftime_now"))
        return strftime_now(r, at, arg(a, 0, NULL), out);
    return rfail(r, at, "'%.*s' is not a function", (int)fl, f);
}

static bool eval_call(struct rt *r, const struct node *n, struct scope *s, json_t **out)
{
    const struct node *callee = n->a;
    json_t *self = NULL;
    if (callee->kind == E_ATTR && !eval(r, callee->a, s, &self))
        return false;
    struct args a;
    if (!eval_args(r, n->body, s, &a)) {
        json_decref(self);
        return false;
    }
    bool ok;
    if (callee->kind == E_ATTR) {
        ok = method(r, n, self, callee->s, callee->slen, &a, out);
    } else if (callee->kind == E_NAME) {
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)callee->slen, callee->s);
        const struct macro *m = find_macro(r, callee->s, callee->slen);
        ok = m && !lookup(s, name) ? call_macro(r, n, m, &a, out) : call_builtin(r, n, callee->s, callee->slen, &a, out);
    } else {
        ok = rfail(r, n, "this expression cannot be called");
    }
    args_free(&a);
    json_decref(self);
    return ok;
}

/* ---- expressions ------------------------------------------------------------ */

static bool index_of(struct rt *r, const struct node *at, json_t *obj, json_t *key, json_t **out)
{
    *out = NULL;
    if (json_is_object(obj)) {
        if (!json_is_string(key))
            return rfail(r, at, "a mapping's key must be a string, not %s", type_name(key));
        *out = json_incref(json_object_get(obj, json_string_value(key)));
        return true;
    }
    if ((json_is_array(obj) || json_is_string(obj)) && json_is_integer(key)) {
        long long i = json_integer_value(key);
        if (json_is_array(obj)) {
            long long n = (long long)json_array_size(obj);
            if (i < 0)
                i += n;
            *out = i >= 0 && i < n ? json_incref(json_array_get(obj, (size_t)i)) : NULL;
            return true;
        }
        size_t bn;
        const char *p = sval(obj, &bn);
        long long n = (long long)cp_count(p, bn);
        if (i < 0)
            i += n;
        if (i < 0 || i >= n)
            return true;
        size_t off = cp_offset(p, bn, (size_t)i), l;
        utf8_at((const unsigned char *)p + off, bn - off, &l);
        return set_out(r, out, str_new(p + off, l));
    }
    if ((json_is_array(obj) || json_is_string(obj)) && json_is_string(key) &&
        !strcmp(json_string_value(key), "length"))
        return set_out(r, out, json_integer((json_int_t)(json_is_array(obj) ? json_array_size(obj)
                                                          : cp_count(json_string_value(obj), json_string_length(obj)))));
    return true;
}

static bool eval_slice(struct rt *r, const struct node *n, json_t *obj, struct scope *s, json_t **out)
{
    long long v[3];
    const struct node *parts[3] = {n->b, n->c, n->alt};
    long long dflt[3] = {LLONG_MIN, LLONG_MIN, 1};
    for (int k = 0; k < 3; k++) {
        json_t *x = NULL;
        if (parts[k] && !eval(r, parts[k], s, &x))
            return false;
        bool ok = int_arg(r, n, x, dflt[k], &v[k]);
        json_decref(x);
        if (!ok)
            return false;
    }
    if (v[2] == 0)
        return rfail(r, n, "slice step cannot be zero");
    bool str = json_is_string(obj);
    if (!str && !json_is_array(obj))
        return rfail(r, n, "cannot slice %s", type_name(obj));
    size_t bn = 0;
    const char *p = str ? sval(obj, &bn) : NULL;
    long long len = str ? (long long)cp_count(p, bn) : (long long)json_array_size(obj);
    long long start = v[0], stop = v[1], step = v[2];
    if (step > 0) {
        start = start == LLONG_MIN ? 0 : start < 0 ? (start + len < 0 ? 0 : start + len) : (start > len ? len : start);
        stop = stop == LLONG_MIN ? len : stop < 0 ? (stop + len < 0 ? 0 : stop + len) : (stop > len ? len : stop);
    } else {
        start = start == LLONG_MIN ? len - 1 : start < 0 ? (start + len < -1 ? -1 : start + len)
                                                         : (start > len - 1 ? len - 1 : start);
        stop = stop == LLONG_MIN ? -1 : stop < 0 ? (stop + len < -1 ? -1 : stop + len) : (stop > len - 1 ? len - 1 : stop);
    }
    json_t *arr = str ? NULL : json_array();
    struct sbuf b = {.limit = SIZE_MAX / 4};
    for (long long i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (str) {
            size_t off = cp_offset(p, bn, (size_t)i), l;
            utf8_at((const unsigned char *)p + off, bn - off, &l);
            sb_put(&b, p + off, l);
        } else if (!arr || json_array_append(arr, json_array_get(obj, (size_t)i))) {
            json_decref(arr);
            return nomem(r);
        }
        if (step > 0 ? i > LLONG_MAX - step : i < LLONG_MIN - step)
            break;
    }
    if (str) {
        *out = b.oom ? NULL : str_new(b.p, b.n);
        free(b.p);
        return *out ? true : nomem(r);
    }
    *out = arr;
    return true;
}

static bool arith(struct rt *r, const struct node *n, json_t *x, json_t *y, json_t **out)
{
    int op = n->op;
    bool both_int = json_is_integer(x) && json_is_integer(y);
    double p = json_number_value(x), q = json_number_value(y);
    long long a = json_is_integer(x) ? json_integer_value(x) : 0, b = json_is_integer(y) ? json_integer_value(y) : 0;
    long long res;
    switch (op) {
    case B_ADD:
    case B_SUB:
    case B_MUL:
        if (both_int && !(op == B_ADD   ? __builtin_add_overflow(a, b, &res)
                          : op == B_SUB ? __builtin_sub_overflow(a, b, &res)
                                        : __builtin_mul_overflow(a, b, &res)))
            return set_out(r, out, json_integer(res));
        return set_out(r, out, json_real(op == B_ADD ? p + q : op == B_SUB ? p - q : p * q));
    case B_DIV:
        if (q == 0)
            return rfail(r, n, "division by zero");
        return set_out(r, out, json_real(p / q));
    case B_FDIV:
    case B_MOD:
        if (q == 0)
            return rfail(r, n, "division by zero");
        if (both_int && !(a == LLONG_MIN && b == -1)) {
            long long d = a / b, m = a % b;
            if (m && ((m < 0) != (b < 0)))
                d--, m += b;
            return set_out(r, out, json_integer(op == B_FDIV ? d : m));
        }
        return set_out(r, out, json_real(op == B_FDIV ? floor(p / q) : p - q * floor(p / q)));
    case B_LT:
        return set_out(r, out, json_boolean(p < q));
    case B_GT:
        return set_out(r, out, json_boolean(p > q));
    case B_LE:
        return set_out(r, out, json_boolean(p <= q));
    case B_GE:
        return set_out(r, out, json_boolean(p >= q));
    }
    return rfail(r, n, "bad operator");
}

static bool concat(struct rt *r, const struct node *n, const json_t *x, const json_t *y, json_t **out)
{
    struct sbuf b = {.limit = r->max_output};
    bool ok = to_text(r, n, x, &b) && to_text(r, n, y, &b);
    if (ok)
        ok = set_out(r, out, str_new(b.p, b.n));
    free(b.p);
    return ok;
}

/* A value's text where + joins it to a string: @huggingface/jinja uses
 * JavaScript's toString there (2.0 is "2", a list is its items' texts
 * joined by commas). */
static bool plus_text(struct rt *r, const struct node *at, const json_t *v, struct sbuf *b)
{
    char num[40];
    if (json_is_real(v)) {
        js_num(json_real_value(v), num);
        sb_puts(b, num);
    } else if (json_is_array(v)) {
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i)
                sb_puts(b, ",");
            if (json_is_null(json_array_get(v, i)))
                sb_puts(b, "null");
            else if (!to_text(r, at, json_array_get(v, i), b))
                return false;
        }
    } else if (json_is_object(v)) {
        sb_puts(b, "[object Map]");
    } else {
        return to_text(r, at, v, b);
    }
    return !b->oom && !b->over ? true : sb_fail(r, at, b);
}

static bool eval_bin(struct rt *r, const struct node *n, json_t *x, json_t *y, json_t **out)
{
    int op = n->op;
    if (op == B_EQ || op == B_NE)
        return set_out(r, out, json_boolean(loose_eq(x, y) == (op == B_EQ)));
    if (is_num(x) && is_num(y) && op != B_CAT && op != B_POW && op != B_IN && op != B_NOTIN)
        return arith(r, n, x, y, out);
    if (!x || !y) {
        if (!y && (op == B_IN || op == B_NOTIN))
            return set_out(r, out, json_boolean(op == B_NOTIN));
        if (op == B_CAT && !json_is_null(x) && !json_is_null(y))
            return concat(r, n, x, y, out);
        return rfail(r, n, "operation on an undefined value");
    }
    if (json_is_null(x) || json_is_null(y))
        return rfail(r, n, "operation on none");
    if (op == B_CAT)
        return concat(r, n, x, y, out);
    if (op == B_POW && num_like(x) && num_like(y)) {
        double p = num_of(x), q = num_of(y), v = pow(p, q);
        if ((p == 0 && q < 0) || !isfinite(v))
            return rfail(r, n, "power out of range");
        bool fl = json_is_real(x) || json_is_real(y) || q < 0 || fabs(v) >= 9e15;
        return set_out(r, out, fl ? json_real(v) : json_integer((json_int_t)v));
    }
    if (json_is_array(x) && json_is_array(y) && op == B_ADD) {
        json_t *arr = json_copy(x);
        if (!arr || json_array_extend(arr, y)) {
            json_decref(arr);
            return nomem(r);
        }
        *out = arr;
        return true;
    }
    if (json_is_array(y) && (op == B_IN || op == B_NOTIN)) {
        bool found = false;
        for (size_t i = 0; i < json_array_size(y) && !found; i++)
            found = strict_eq(json_array_get(y, i), x);
        return set_out(r, out, json_boolean(found == (op == B_IN)));
    }
    if ((json_is_string(x) || json_is_string(y)) && op == B_ADD) {
        struct sbuf b = {.limit = r->max_output};
        bool ok = plus_text(r, n, x, &b) && plus_text(r, n, y, &b) && set_out(r, out, str_new(b.p, b.n));
        free(b.p);
        return ok;
    }
    if (json_is_string(x) && json_is_string(y)) {
        if (op == B_IN || op == B_NOTIN)
            return set_out(r, out, json_boolean(str_contains(y, x) == (op == B_IN)));
        if (op == B_LT || op == B_GT || op == B_LE || op == B_GE) {
            int c = cmp_vals(x, y, true);
            return set_out(r, out, json_boolean(op == B_LT ? c < 0 : op == B_GT ? c > 0 : op == B_LE ? c <= 0 : c >= 0));
        }
    }
    if (json_is_string(x) && json_is_object(y) && (op == B_IN || op == B_NOTIN))
        return set_out(r, out, json_boolean((json_object_get(y, json_string_value(x)) != NULL) == (op == B_IN)));
    return rfail(r, n, "unsupported operation between %s and %s", type_name(x), type_name(y));
}

/* A name that calls a macro or a builtin function: defined, though not a value. */
static bool is_callable(const struct rt *r, const struct node *name, struct scope *s)
{
    static const char *builtins[] = {"raise_exception", "namespace", "range", "strftime_now", "dict"};
    char buf[128];
    snprintf(buf, sizeof buf, "%.*s", (int)name->slen, name->s);
    if (lookup(s, buf))
        return false;
    if (find_macro(r, name->s, name->slen))
        return true;
    for (size_t i = 0; i < sizeof builtins / sizeof builtins[0]; i++)
        if (!strcmp(buf, builtins[i]))
            return true;
    return false;
}

static bool eval_inner(struct rt *r, const struct node *n, struct scope *s, json_t **out)
{
    json_t *x = NULL, *y = NULL;
    bool ok;
    char name[128];
    switch (n->kind) {
    case E_STR:
        return set_out(r, out, str_new(n->s, n->slen));
    case E_INT:
        return set_out(r, out, json_integer(n->i));
    case E_FLOAT:
        return set_out(r, out, json_real(n->d));
    case E_NAME:
        snprintf(name, sizeof name, "%.*s", (int)n->slen, n->s);
        if ((x = lookup(s, name))) {
            *out = json_incref(x);
            return true;
        }
        if (!strcmp(name, "true") || !strcmp(name, "True"))
            return set_out(r, out, json_true());
        if (!strcmp(name, "false") || !strcmp(name, "False"))
            return set_out(r, out, json_false());
        if (!strcmp(name, "none") || !strcmp(name, "None"))
            return set_out(r, out, json_null());
        return true;
    case E_LIST:
    case E_TUPLE:
    case E_DICT: {
        json_t *c = n->kind == E_DICT ? json_object() : json_array();
        if (!c)
            return nomem(r);
        for (const struct node *p = n->body; p; p = p->next) {
            if (!eval(r, n->kind == E_DICT ? p->a : p, s, &x)) {
                json_decref(c);
                return false;
            }
            if (n->kind == E_DICT) {
                if (!json_is_string(x)) {
                    json_decref(x);
                    json_decref(c);
                    return rfail(r, p, "a mapping's key must be a string");
                }
                if (!eval(r, p->b, s, &y)) {
                    json_decref(x);
                    json_decref(c);
                    return false;
                }
                ok = !json_object_set_new(c, json_string_value(x), y ? y : json_null());
                json_decref(x);
            } else {
                ok = !json_array_append_new(c, x ? x : json_null());
            }
            if (!ok) {
                json_decref(c);
                return nomem(r);
            }
        }
        *out = c;
        return true;
    }
    case E_ATTR:
        if (!eval(r, n->a, s, &x))
            return false;
        y = str_new(n->s, n->slen);
        ok = y ? index_of(r, n, x, y, out) : nomem(r);
        json_decref(x);
        json_decref(y);
        return ok;
    case E_INDEX:
        if (!eval(r, n->a, s, &x))
            return false;
        ok = eval(r, n->b, s, &y) && index_of(r, n, x, y, out);
        json_decref(x);
        json_decref(y);
        return ok;
    case E_SLICE:
        if (!eval(r, n->a, s, &x))
            return false;
        ok = eval_slice(r, n, x, s, out);
        json_decref(x);
        return ok;
    case E_CALL:
        return eval_call(r, n, s, out);
    case E_FILTER:
    case E_TEST: {
        struct args a;
        if (n->kind == E_TEST && n->a->kind == E_NAME && is_callable(r, n->a, s) &&
            (streq(n->s, n->slen, "defined") || streq(n->s, n->slen, "callable")))
            return set_out(r, out, json_boolean(n->op == 0));
        if (!eval(r, n->a, s, &x))
            return false;
        if (!eval_args(r, n->body, s, &a)) {
            json_decref(x);
            return false;
        }
        bool res = false;
        ok = n->kind == E_FILTER ? filter(r, n, n->s, n->slen, x, &a, s, out)
                                 : apply_test(r, n, n->s, n->slen, x, &a, &res) &&
                                       set_out(r, out, json_boolean(res != (n->op != 0)));
        args_free(&a);
        json_decref(x);
        return ok;
    }
    case E_BIN:
        if (!eval(r, n->a, s, &x))
            return false;
        ok = eval(r, n->b, s, &y) && eval_bin(r, n, x, y, out);
        json_decref(x);
        json_decref(y);
        return ok;
    case E_AND:
    case E_OR:
        if (!eval(r, n->a, s, &x))
            return false;
        if (truthy(x) == (n->kind == E_OR)) {
            *out = x;
            return true;
        }
        json_decref(x);
        return eval(r, n->b, s, out);
    case E_NOT:
        if (!eval(r, n->a, s, &x))
            return false;
        ok = set_out(r, out, json_boolean(!truthy(x)));
        json_decref(x);
        return ok;
    case E_NEG:
    case E_POS:
        if (!eval(r, n->a, s, &x))
            return false;
        if (!is_num(x))
            ok = rfail(r, n, "unary %c on %s", n->kind == E_NEG ? '-' : '+', type_name(x));
        else if (n->kind == E_POS)
            ok = set_out(r, out, json_incref(x));
        else if (json_is_integer(x) && json_integer_value(x) != LLONG_MIN)
            ok = set_out(r, out, json_integer(-json_integer_value(x)));
        else
            ok = set_out(r, out, json_real(-json_number_value(x)));
        json_decref(x);
        return ok;
    case E_COND:
        if (!eval(r, n->a, s, &x))
            return false;
        ok = truthy(x);
        json_decref(x);
        if (ok)
            return eval(r, n->b, s, out);
        return n->c ? eval(r, n->c, s, out) : true;
    default:
        return rfail(r, n, "not an expression");
    }
}

static bool step(struct rt *r, const struct node *n)
{
    if (++r->steps > r->max_steps)
        return rfail(r, n, "the template ran more than %lu steps", r->max_steps);
    return true;
}

static bool eval(struct rt *r, const struct node *n, struct scope *s, json_t **out)
{
    *out = NULL;
    if (!step(r, n))
        return false;
    if (++r->depth > MAX_EVAL_DEPTH) {
        r->depth--;
        return rfail(r, n, "expression nested deeper than %d", MAX_EVAL_DEPTH);
    }
    bool ok = eval_inner(r, n, s, out);
    r->depth--;
    if (!ok) {
        json_decref(*out);
        *out = NULL;
    }
    return ok;
}

/* ---- statements ------------------------------------------------------------- */

static bool set_name(struct rt *r, struct scope *s, const struct node *target, json_t *v)
{
    char name[128];
    if (target->slen >= sizeof name)
        return rfail(r, target, "name too long");
    snprintf(name, sizeof name, "%.*s", (int)target->slen, target->s);
    if (!v) { /* undefined: the name is unset here */
        json_object_del(s->vars, name);
        return true;
    }
    return !json_object_set(s->vars, name, v) || nomem(r);
}

static bool assign(struct rt *r, struct scope *s, const struct node *target, json_t *v)
{
    if (target->kind == E_NAME)
        return set_name(r, s, target, v);
    if (target->kind == E_TUPLE) {
        size_t n = 0;
        for (const struct node *p = target->body; p; p = p->next)
            n++;
        if (!json_is_array(v) || json_array_size(v) != n)
            return rfail(r, target, "cannot unpack %s into %zu names", type_name(v), n);
        size_t i = 0;
        for (const struct node *p = target->body; p; p = p->next, i++) {
            if (p->kind != E_NAME)
                return rfail(r, p, "can only unpack into names");
            if (!set_name(r, s, p, json_array_get(v, i)))
                return false;
        }
        return true;
    }
    if (target->kind == E_ATTR) {
        json_t *obj;
        if (!eval(r, target->a, s, &obj))
            return false;
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)target->slen, target->s);
        bool ok = json_is_object(obj) ? !json_object_set(obj, name, v ? v : json_null()) || nomem(r)
                                      : rfail(r, target, "cannot set an attribute of %s", type_name(obj));
        json_decref(obj);
        return ok;
    }
    return rfail(r, target, "cannot assign to this expression");
}

static json_t *loop_obj(size_t i, size_t n, json_t *items)
{
    json_t *o = json_pack("{sIsIsIsIsbsbsI}", "index", (json_int_t)i + 1, "index0", (json_int_t)i, "revindex",
                          (json_int_t)(n - i), "revindex0", (json_int_t)(n - i - 1), "first", i == 0, "last",
                          i + 1 == n, "length", (json_int_t)n);
    if (o && i > 0 && json_object_set(o, "previtem", json_array_get(items, i - 1)))
        json_decref(o), o = NULL;
    if (o && i + 1 < n && json_object_set(o, "nextitem", json_array_get(items, i + 1)))
        json_decref(o), o = NULL;
    return o;
}

static int exec_for(struct rt *r, const struct node *n, struct scope *s, struct sbuf *out)
{
    struct scope ls = {s, json_object()};
    json_t *it = NULL, *items = json_array();
    int rc = X_ERR;
    if (!ls.vars || !items) {
        nomem(r);
        goto done;
    }
    if (!eval(r, n->b, &ls, &it))
        goto done;
    json_t *cands = NULL;
    if (json_is_array(it)) {
        cands = json_incref(it);
    } else if (json_is_object(it)) {
        struct args none = {0};
        if (!method(r, n, it, "keys", 4, &none, &cands))
            goto done;
    } else if (json_is_string(it)) {
        struct args none = {0};
        if (!filter(r, n, "list", 4, it, &none, s, &cands))
            goto done;
    } else if (it && !json_is_null(it)) {
        rfail(r, n->b, "cannot loop over %s", type_name(it));
        goto done;
    } else {
        cands = json_array(); /* undefined loops zero times, as in Python's Jinja */
        if (!cands) {
            nomem(r);
            goto done;
        }
    }
    for (size_t i = 0; i < json_array_size(cands); i++) {
        json_t *c = json_array_get(cands, i);
        if (n->c) {
            struct scope ts = {&ls, json_object()};
            json_t *keep = NULL;
            bool ok = ts.vars && assign(r, &ts, n->a, c) && eval(r, n->c, &ts, &keep);
            if (!ts.vars)
                nomem(r);
            json_decref(ts.vars);
            bool t = truthy(keep);
            json_decref(keep);
            if (!ok) {
                json_decref(cands);
                goto done;
            }
            if (!t)
                continue;
        }
        if (json_array_append(items, c)) {
            json_decref(cands);
            nomem(r);
            goto done;
        }
    }
    json_decref(cands);
    size_t count = json_array_size(items);
    rc = X_OK;
    for (size_t i = 0; i < count && rc != X_ERR; i++) {
        if (!step(r, n)) {
            rc = X_ERR;
            break;
        }
        json_t *loop = loop_obj(i, count, items);
        if (!loop || json_object_set_new(ls.vars, "loop", loop)) {
            rc = X_ERR;
            nomem(r);
            break;
        }
        if (!assign(r, &ls, n->a, json_array_get(items, i))) {
            rc = X_ERR;
            break;
        }
        rc = exec_list(r, n->body, &ls, out);
        if (rc == X_BREAK) {
            rc = X_OK;
            break;
        }
        if (rc == X_CONT)
            rc = X_OK;
    }
    if (rc == X_OK && !count)
        rc = exec_list(r, n->alt, &ls, out);
done:
    json_decref(it);
    json_decref(items);
    json_decref(ls.vars);
    return rc;
}

static int exec_one(struct rt *r, const struct node *n, struct scope *s, struct sbuf *out)
{
    json_t *v = NULL;
    int rc = X_OK;
    if (!step(r, n))
        return X_ERR;
    switch (n->kind) {
    case N_TEXT:
        return sb_put(out, n->s, n->slen) ? X_OK : (sb_fail(r, n, out), X_ERR);
    case N_OUT:
        if (!eval(r, n->a, s, &v))
            return X_ERR;
        rc = to_text(r, n->a, v, out) ? X_OK : X_ERR;
        json_decref(v);
        return rc;
    case N_IF:
        if (!eval(r, n->a, s, &v))
            return X_ERR;
        rc = exec_list(r, truthy(v) ? n->body : n->alt, s, out);
        json_decref(v);
        return rc;
    case N_FOR:
        if (++r->depth > MAX_EVAL_DEPTH)
            rc = rfail(r, n, "loops nested deeper than %d", MAX_EVAL_DEPTH) ? X_OK : X_ERR;
        else
            rc = exec_for(r, n, s, out);
        r->depth--;
        return rc;
    case N_SET:
    case N_FILTERBLK:
        if (n->kind == N_SET && n->b) {
            if (!eval(r, n->b, s, &v))
                return X_ERR;
        } else {
            struct sbuf b = {.limit = r->max_output};
            rc = exec_list(r, n->body, s, &b);
            if (rc == X_OK && !(v = str_new(b.p, b.n)))
                rc = nomem(r) ? X_OK : X_ERR;
            free(b.p);
            if (rc != X_OK)
                return X_ERR;
        }
        if (n->kind == N_SET) {
            rc = assign(r, s, n->a, v) ? X_OK : X_ERR;
        } else {
            struct args a;
            json_t *res = NULL;
            rc = X_ERR;
            if (eval_args(r, n->a->body, s, &a)) {
                if (filter(r, n->a, n->a->s, n->a->slen, v, &a, s, &res) && to_text(r, n, res, out))
                    rc = X_OK;
                args_free(&a);
            }
            json_decref(res);
        }
        json_decref(v);
        return rc;
    case N_MACRO: {
        struct macro *m = malloc(sizeof(*m));
        if (!m)
            return nomem(r) ? X_OK : X_ERR;
        m->n = n;
        m->next = r->macros;
        r->macros = m;
        return X_OK;
    }
    case N_BREAK:
        return X_BREAK;
    case N_CONTINUE:
        return X_CONT;
    default:
        return rfail(r, n, "not a statement") ? X_OK : X_ERR;
    }
}

static int exec_list(struct rt *r, const struct node *n, struct scope *s, struct sbuf *out)
{
    for (; n; n = n->next) {
        int rc = exec_one(r, n, s, out);
        if (rc != X_OK)
            return rc;
    }
    return X_OK;
}

enum text_status jinja_render(const jinja_tpl *t, const json_t *vars, const struct jinja_opts *opts, char **out,
                              size_t *len, char *err)
{
    *out = NULL;
    *len = 0;
    struct rt r = {.t = t, .err = err, .max_output = JINJA_DEFAULT_OUTPUT, .max_steps = JINJA_DEFAULT_STEPS};
    if (opts) {
        if (opts->max_output)
            r.max_output = opts->max_output;
        if (opts->max_steps)
            r.max_steps = opts->max_steps;
        r.now = opts->now;
    }
    if (vars && !json_is_object(vars))
        return text_errf(err, TEXT_EINVAL, "chat template variables must be a JSON object");
    /* a deep copy: set ns.x and the like must not reach the caller's values */
    struct scope root = {NULL, vars ? json_deep_copy(vars) : json_object()};
    if (!root.vars)
        return text_errf(err, TEXT_ENOMEM, "no memory to render the chat template");
    r.root = &root;
    struct sbuf b = {.limit = r.max_output};
    int rc = exec_list(&r, t->body, &root, &b);
    if (rc == X_BREAK || rc == X_CONT)
        rc = rfail(&r, NULL, "break or continue outside a loop") ? X_OK : X_ERR;
    if (rc == X_OK && !b.p && !sb_put(&b, "", 0))
        rc = nomem(&r) ? X_OK : X_ERR;
    while (r.macros) {
        struct macro *next = r.macros->next;
        free(r.macros);
        r.macros = next;
    }
    json_decref(root.vars);
    if (rc != X_OK) {
        free(b.p);
        return r.st ? r.st : text_errf(err, TEXT_EINVAL, "chat template failed");
    }
    *out = b.p;
    *len = b.n;
    return TEXT_OK;
}
