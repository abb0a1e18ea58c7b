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
