#include "ipc/jsonw.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void jw_fixed(struct jw *w, char *buf, size_t cap)
{
    *w = (struct jw){.p = buf, .cap = cap};
}

void jw_dynamic(struct jw *w)
{
    *w = (struct jw){.grow = true};
}

static bool room(struct jw *w, size_t n)
{
    if (w->failed)
        return false;
    if (w->n + n + 1 <= w->cap)
        return true;
    if (w->grow) {
        size_t cap = w->cap ? w->cap : 1024;
        while (cap < w->n + n + 1)
            cap *= 2;
        char *p = realloc(w->p, cap);
        if (p) {
            w->p = p;
            w->cap = cap;
            return true;
        }
    }
    w->failed = true;
    return false;
}

void jw_raw(struct jw *w, const char *s, size_t n)
{
    if (!room(w, n))
        return;
    memcpy(w->p + w->n, s, n);
    w->n += n;
    w->p[w->n] = '\0';
}

void jw_lit(struct jw *w, const char *s)
{
    jw_raw(w, s, strlen(s));
}

void jw_fmt(struct jw *w, const char *fmt, ...)
{
    char buf[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof(buf)) {
        w->failed = true;
        return;
    }
    jw_raw(w, buf, (size_t)n);
}

void jw_real(struct jw *w, double v, int digits)
{
    if (isfinite(v))
        jw_fmt(w, "%.*g", digits, v);
    else
        jw_lit(w, "null");
}

/* Length of the valid UTF-8 character at s[0..n), or 0 when invalid
 * (overlong forms, surrogates and values above U+10FFFF included). */
static size_t utf8_len(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    if (!len || len > n)
        return 0;
    unsigned cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    static const unsigned min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return len;
}

/* Escaped size of one character (len 0 = an invalid byte, written as U+FFFD). */
static size_t esc_size(const unsigned char *s, size_t len)
{
    if (!len)
        return 3;
    if (len > 1)
        return len;
    if (s[0] == '"' || s[0] == '\\' || s[0] == '\n' || s[0] == '\r' || s[0] == '\t')
        return 2;
    return s[0] < 0x20 || s[0] == 0x7F ? 6 : 1;
}

size_t jw_fit(const char *s, size_t n, size_t cap)
{
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, used = 0;
    while (i < n) {
        size_t len = utf8_len(u + i, n - i);
        size_t sz = esc_size(u + i, len);
        if (used + sz > cap)
            break;
        used += sz;
        i += len ? len : 1;
    }
    return i;
}

void jw_str(struct jw *w, const char *s, size_t n)
{
    const unsigned char *u = (const unsigned char *)s;
    jw_raw(w, "\"", 1);
    size_t i = 0;
    while (i < n && !w->failed) {
        size_t run = i; /* copy plain bytes in runs */
        while (run < n && u[run] >= 0x20 && u[run] < 0x7F && u[run] != '"' && u[run] != '\\')
            run++;
        jw_raw(w, s + i, run - i);
        i = run;
        if (i == n)
            break;
        size_t len = utf8_len(u + i, n - i);
        if (!len) {
            jw_raw(w, "\xEF\xBF\xBD", 3);
            i++;
        } else if (len > 1) {
            jw_raw(w, s + i, len);
            i += len;
        } else {
            const char *e = u[i] == '"' ? "\\\"" : u[i] == '\\' ? "\\\\" : u[i] == '\n' ? "\\n" : u[i] == '\r' ? "\\r"
                            : u[i] == '\t' ? "\\t" : NULL;
            if (e)
                jw_lit(w, e);
            else
                jw_fmt(w, "\\u%04x", u[i]);
            i++;
        }
    }
    jw_raw(w, "\"", 1);
}

void jw_bytes(struct jw *w, const char *s, size_t n)
{
    jw_raw(w, "[", 1);
    for (size_t i = 0; i < n; i++)
        jw_fmt(w, i ? ",%u" : "%u", (unsigned char)s[i]);
    jw_raw(w, "]", 1);
}
