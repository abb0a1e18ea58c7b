/* tokenizer_text.c - text plumbing for the tokenizer: growable buffers,
 * strict UTF-8, GPT-2's byte <-> code point table and NFC normalisation. */
#include "text/tokenizer_internal.h"
#include <utf8proc.h>

bool tok_buf_reserve(struct tok_buf *b, size_t extra)
{
    if (b->cap - b->n >= extra)
        return true;
    if (extra > SIZE_MAX / 2 - b->n)
        return false;
    size_t cap = b->cap ? b->cap : 64;
    while (cap - b->n < extra)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p)
        return false;
    b->p = p;
    b->cap = cap;
    return true;
}

bool tok_buf_append(struct tok_buf *b, const void *data, size_t len)
{
    if (!tok_buf_reserve(b, len))
        return false;
    if (len)
        memcpy(b->p + b->n, data, len);
    b->n += len;
    return true;
}

size_t tok_utf8_next(const unsigned char *s, size_t n, uint32_t *cp)
{
    unsigned c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    size_t len;
    uint32_t v, min;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2, v = c & 0x1F, min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3, v = c & 0x0F, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4, v = c & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        v = v << 6 | (s[i] & 0x3F);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
        return 0;
    *cp = v;
    return len;
}

size_t tok_utf8_put(uint32_t cp, char *out)
{
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | cp >> 6);
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | cp >> 12);
        o[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | cp >> 18);
    o[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
    o[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Printable Latin-1 bytes stand for themselves; the other 68 bytes take
 * the code points from U+0100 on, in byte order, so that no piece contains
 * whitespace or control characters. */
static bool byte_is_printable(unsigned b)
{
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

uint32_t tok_byte_to_cp(unsigned b)
{
    if (byte_is_printable(b))
        return b;
    uint32_t k = 0;
    for (unsigned i = 0; i < b; i++)
        k += !byte_is_printable(i);
    return 0x100 + k;
}

int tok_cp_to_byte(uint32_t cp)
{
    if (cp < 0x100)
        return byte_is_printable(cp) ? (int)cp : -1;
    uint32_t k = 0;
    for (unsigned b = 0; b < 256; b++) {
        if (byte_is_printable(b))
            continue;
        if (0x100 + k == cp)
            return (int)b;
        k++;
    }
    return -1;
}

/* ---- NFC: libutf8proc's canonical decomposition, ordering and
 * composition, into the caller's scratch instead of a fresh allocation. */

enum text_status tok_nfc(const char *s, size_t n, struct tok_buf *out, struct tok_buf *scratch, bool *changed)
{
    /* Below U+0300 (lead bytes < 0xCC) nothing decomposes into something
     * that recomposes differently and nothing combines: already NFC. */
    size_t i = 0;
    while (i < n && (unsigned char)s[i] < 0xCC)
        i++;
    *changed = false;
    if (i == n)
        return TEXT_OK;
    if (n > (size_t)PTRDIFF_MAX / sizeof(utf8proc_int32_t))
        return TEXT_ENOMEM;

    const utf8proc_option_t opt = UTF8PROC_STABLE | UTF8PROC_COMPOSE;
    /* Most text decomposes into at most one code point per byte; the
     * rare longer result is retried with the size utf8proc asks for. */
    size_t cap = n + 4;
    utf8proc_ssize_t m;
    for (;;) {
        scratch->n = 0;
        if (cap > SIZE_MAX / sizeof(utf8proc_int32_t) ||
            !tok_buf_reserve(scratch, cap * sizeof(utf8proc_int32_t)))
            return TEXT_ENOMEM;
        m = utf8proc_decompose((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n,
                               (utf8proc_int32_t *)(void *)scratch->p, (utf8proc_ssize_t)cap, opt);
        if (m < 0)
            return m == UTF8PROC_ERROR_NOMEM || m == UTF8PROC_ERROR_OVERFLOW ? TEXT_ENOMEM : TEXT_EINVAL;
        if ((size_t)m <= cap)
            break;
        cap = (size_t)m;
    }
    /* Composes, then writes UTF-8 over the code points (4 bytes each is room). */
    m = utf8proc_reencode((utf8proc_int32_t *)(void *)scratch->p, m, opt);
    if (m < 0)
        return TEXT_EINVAL;
    out->n = 0;
    if (!tok_buf_append(out, scratch->p, (size_t)m))
        return TEXT_ENOMEM;
    *changed = true;
    return TEXT_OK;
}

/* ---- base64 and the SentencePiece charsmap -------------------------------- */

bool tok_base64(const char *s, size_t n, struct tok_buf *out, bool *nomem)
{
    *nomem = false;
    out->n = 0;
    while (n && s[n - 1] == '=')
        n--;
    if (n % 4 == 1 || !tok_buf_reserve(out, n / 4 * 3 + 3)) {
        *nomem = n % 4 != 1;
        return false;
    }
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int v = c >= 'A' && c <= 'Z'   ? c - 'A'
                : c >= 'a' && c <= 'z' ? c - 'a' + 26
                : c >= '0' && c <= '9' ? c - '0' + 52
                : c == '+'             ? 62
                : c == '/'             ? 63
                                       : -1;
        if (v < 0)
            return false;
        acc = acc << 6 | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out->p[out->n++] = (char)(acc >> bits & 0xFF);
        }
    }
    return true;
}

/* Darts-clone's unit layout: bit 8 says a leaf (a value) hangs below the
 * node, the low 8 bits hold the label (bit 31 set on value units, so they
 * never match one), and the offset to the children is bits 10..30,
 * shifted 8 further when bit 9 is set. */
static uint32_t unit_offset(uint32_t u)
{
    return (u >> 10) << ((u & (1u << 9)) >> 6);
}

size_t tok_charsmap_match(const tokenizer *t, const char *s, size_t n, struct tok_span *repl)
{
    const struct tok_charsmap *cm = &t->charsmap;
    const unsigned char *norm = (const unsigned char *)t->str.p + cm->norm.off;
    size_t best = 0;
    uint32_t pos = unit_offset(cm->units[0]);
    /* The load checked the blob's layout; a lookup that leaves the array,
     * or would end inside a character, is no match. */
    for (size_t i = 0; i < n && s[i]; i++) {
        unsigned char c = (unsigned char)s[i];
        pos ^= c;
        if (pos >= cm->n_units || (cm->units[pos] & (1u << 31 | 0xFF)) != c)
            break;
        uint32_t u = cm->units[pos];
        pos ^= unit_offset(u);
        if (pos >= cm->n_units)
            break;
        uint32_t v = cm->units[pos] & 0x7FFFFFFF;
        if ((u >> 8 & 1) && (i + 1 == n || ((unsigned char)s[i + 1] & 0xC0) != 0x80) && v < cm->norm.len &&
            (norm[v] & 0xC0) != 0x80) {
            best = i + 1;
            const unsigned char *end = memchr(norm + v, 0, cm->norm.len - v);
            *repl = (struct tok_span){cm->norm.off + v, (uint32_t)(end - (norm + v))};
        }
    }
    return best;
}
