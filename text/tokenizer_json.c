/* tokenizer_json.c - a small JSON cursor for the two big members of
 * tokenizer.json (model.vocab and model.merges: 150k-280k entries), which
 * building a jansson tree for would take most of the load time.  The rest of
 * the file is handed to jansson member by member. */
#include <limits.h>
#include <math.h>

#include "text/tokenizer_internal.h"

int tok_hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

static bool fail(struct tok_json *j, const char *what)
{
    if (!j->error)
        j->error = what;
    return false;
}

void tj_ws(struct tok_json *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t'))
        j->p++;
}

static bool expect(struct tok_json *j, char c, const char *what)
{
    tj_ws(j);
    if (j->p == j->end || *j->p != c)
        return fail(j, what);
    j->p++;
    return true;
}

static int hex4(const char *p)
{
    int v = 0;
    for (int i = 0; i < 4; i++) {
        int d = tok_hex_digit(p[i]);
        if (d < 0)
            return -1;
        v = v << 4 | d;
    }
    return v;
}

/* \uXXXX (a surrogate pair when it is one) at j->p, just after the 'u'. */
static bool unicode_escape(struct tok_json *j, uint32_t *cp)
{
    int hi = j->end - j->p >= 4 ? hex4(j->p) : -1;
    if (hi < 0)
        return fail(j, "four hex digits after \\u");
    j->p += 4;
    *cp = (uint32_t)hi;
    if (hi >= 0xDC00 && hi <= 0xDFFF)
        return fail(j, "a high surrogate before a low one");
    if (hi < 0xD800 || hi > 0xDBFF)
        return true;
    int lo = j->end - j->p >= 6 && j->p[0] == '\\' && j->p[1] == 'u' ? hex4(j->p + 2) : -1;
    if (lo < 0xDC00 || lo > 0xDFFF)
        return fail(j, "a low surrogate after a high one");
    j->p += 6;
    *cp = 0x10000 + (((uint32_t)hi - 0xD800) << 10) + ((uint32_t)lo - 0xDC00);
    return true;
}

bool tj_string(struct tok_json *j, struct tok_buf *out)
{
    out->n = 0;
    if (!expect(j, '"', "a string"))
        return false;
    for (;;) {
        const char *run = j->p;
        while (j->p < j->end && *j->p != '"' && *j->p != '\\' && (unsigned char)*j->p >= 0x20)
            j->p++;
        if (!tok_buf_append(out, run, (size_t)(j->p - run)))
            return fail(j, "memory");
        if (j->p == j->end)
            return fail(j, "the end of a string");
        char c = *j->p++;
        if (c == '"')
            break;
        if (c != '\\')
            return fail(j, "no control character in a string");
        if (j->p == j->end)
            return fail(j, "an escape");
        char e = *j->p++, lit;
        uint32_t cp;
        char utf8[4];
        switch (e) {
        case '"': case '\\': case '/': lit = e; break;
        case 'b': lit = '\b'; break;
        case 'f': lit = '\f'; break;
        case 'n': lit = '\n'; break;
        case 'r': lit = '\r'; break;
        case 't': lit = '\t'; break;
        case 'u':
            if (!unicode_escape(j, &cp) || !tok_buf_append(out, utf8, tok_utf8_put(cp, utf8)))
                return fail(j, "memory");
            continue;
        default:
            return fail(j, "a valid escape");
        }
        if (!tok_buf_append(out, &lit, 1))
            return fail(j, "memory");
    }
    uint32_t cp;
    for (size_t i = 0, l; i < out->n; i += l)
        if (!(l = tok_utf8_next((const unsigned char *)out->p + i, out->n - i, &cp)))
            return fail(j, "UTF-8 in a string");
    return true;
}

bool tj_int(struct tok_json *j, long long *v)
{
    tj_ws(j);
    const char *p = j->p;
    bool neg = p < j->end && *p == '-';
    p += neg;
    if (p == j->end || *p < '0' || *p > '9')
        return fail(j, "an integer");
    long long x = 0;
    while (p < j->end && *p >= '0' && *p <= '9') {
        if (x > (LLONG_MAX - 9) / 10)
            return fail(j, "an integer of at most 18 digits");
        x = x * 10 + (*p++ - '0');
    }
    if (p < j->end && (*p == '.' || *p == 'e' || *p == 'E'))
        return fail(j, "an integer");
    j->p = p;
    *v = neg ? -x : x;
    return true;
}

/* JSON's number grammar is checked here: strtod alone would also take
 * "inf", "nan", hex floats and leading '+'. */
bool tj_real(struct tok_json *j, double *v)
{
    tj_ws(j);
    const char *p = j->p;
    p += p < j->end && *p == '-';
    if (p == j->end || *p < '0' || *p > '9')
        return fail(j, "a number");
    while (p < j->end && ((*p >= '0' && *p <= '9') || *p == '.' || *p == 'e' || *p == 'E' || *p == '+' || *p == '-'))
        p++;
    char buf[64];
    size_t n = (size_t)(p - j->p);
    if (n >= sizeof buf)
        return fail(j, "a number of at most 63 characters");
    memcpy(buf, j->p, n);
    buf[n] = '\0';
    char *end;
    double x = strtod(buf, &end);
    if (end != buf + n || !isfinite(x))
        return fail(j, "a finite number");
    j->p = p;
    *v = x;
    return true;
}

bool tj_skip(struct tok_json *j)
{
    int depth = 0;
    do {
        tj_ws(j);
        if (j->p == j->end)
            return fail(j, "a value");
        char c = *j->p++;
        if (c == '"') {
            /* Only the extent: the members read later check their strings. */
            while (j->p < j->end && *j->p != '"')
                j->p += *j->p == '\\' ? 2 : 1;
            if (j->p >= j->end)
                return fail(j, "the end of a string");
            j->p++;
        } else if (c == '{' || c == '[') {
            depth++;
        } else if (c == '}' || c == ']') {
            if (--depth < 0)
                return fail(j, "a value");
        } else if (c != ',' && c != ':') {
            /* A number or literal; jansson checks its spelling later. */
            while (j->p < j->end && !strchr(" \t\r\n,:]}", *j->p))
                j->p++;
        }
    } while (depth > 0);
    return true;
}

int tj_next(struct tok_json *j, char open, char close, bool *first)
{
    tj_ws(j);
    if (*first) {
        *first = false;
        if (!expect(j, open, open == '{' ? "an object" : "an array"))
            return -1;
        tj_ws(j);
        if (j->p < j->end && *j->p == close) {
            j->p++;
            return 0;
        }
        return 1;
    }
    if (j->p < j->end && *j->p == close) {
        j->p++;
        return 0;
    }
    return expect(j, ',', open == '{' ? "',' or '}'" : "',' or ']'") ? 1 : -1;
}

int tj_member(struct tok_json *j, bool *first, struct tok_buf *key)
{
    int r = tj_next(j, '{', '}', first);
    if (r != 1)
        return r;
    return tj_string(j, key) && expect(j, ':', "':'") ? 1 : -1;
}

void tj_where(const struct tok_json *j, int *line, int *col)
{
    *line = 1;
    *col = 1;
    for (const char *p = j->s; p < j->p; p++) {
        if (*p == '\n')
            ++*line, *col = 1;
        else
            ++*col;
    }
}
