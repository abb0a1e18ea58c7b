/* tokenizer_text.c - text plumbing for the tokenizer: growable buffers,
 * strict UTF-8, GPT-2's byte <-> code point table and NFC normalisation. */
#include "text/tokenizer_internal.h"
#include "text/tokenizer_nfc_tables.h"

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

/* ---- NFC (UAX #15): canonical decomposition, canonical ordering, then
 * canonical composition.  Hangul syllables are arithmetic. */
enum { HANGUL_S = 0xAC00, HANGUL_L = 0x1100, HANGUL_V = 0x1161, HANGUL_T = 0x11A7,
       HANGUL_NV = 21, HANGUL_NT = 28, HANGUL_N = 21 * 28, HANGUL_COUNT = 19 * 21 * 28 };

static int ccc_of(uint32_t cp)
{
    size_t lo = 0, hi = sizeof nfc_ccc / sizeof nfc_ccc[0];
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < nfc_ccc[mid].lo)
            hi = mid;
        else if (cp > nfc_ccc[mid].hi)
            lo = mid + 1;
        else
            return nfc_ccc[mid].ccc;
    }
    return 0;
}

static size_t decompose(uint32_t cp, uint32_t *out)
{
    if (cp >= HANGUL_S && cp < HANGUL_S + HANGUL_COUNT) {
        uint32_t s = cp - HANGUL_S;
        out[0] = HANGUL_L + s / HANGUL_N;
        out[1] = HANGUL_V + s % HANGUL_N / HANGUL_NT;
        if (s % HANGUL_NT == 0)
            return 2;
        out[2] = HANGUL_T + s % HANGUL_NT;
        return 3;
    }
    size_t lo = 0, hi = sizeof nfc_decomp / sizeof nfc_decomp[0];
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < nfc_decomp[mid].cp) {
            hi = mid;
        } else if (cp > nfc_decomp[mid].cp) {
            lo = mid + 1;
        } else {
            size_t k = decompose(nfc_decomp[mid].first, out);
            if (nfc_decomp[mid].second)
                k += decompose(nfc_decomp[mid].second, out + k);
            return k;
        }
    }
    out[0] = cp;
    return 1;
}

static uint32_t compose(uint32_t a, uint32_t b)
{
    if (a >= HANGUL_L && a < HANGUL_L + 19 && b >= HANGUL_V && b < HANGUL_V + HANGUL_NV)
        return HANGUL_S + ((a - HANGUL_L) * HANGUL_NV + (b - HANGUL_V)) * HANGUL_NT;
    if (a >= HANGUL_S && a < HANGUL_S + HANGUL_COUNT && (a - HANGUL_S) % HANGUL_NT == 0 && b > HANGUL_T &&
        b < HANGUL_T + HANGUL_NT)
        return a + (b - HANGUL_T);
    uint64_t key = (uint64_t)a << 32 | b;
    size_t lo = 0, hi = sizeof nfc_comp / sizeof nfc_comp[0];
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        uint64_t k = (uint64_t)nfc_comp[mid].first << 32 | nfc_comp[mid].second;
        if (key < k)
            hi = mid;
        else if (key > k)
            lo = mid + 1;
        else
            return nfc_comp[mid].composite;
    }
    return 0;
}

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

    /* A UTF-8 byte never decomposes into more than 1.5 code points (U+01D5). */
    size_t max_cps = n + n / 2 + 4;
    scratch->n = 0;
    if (max_cps > SIZE_MAX / sizeof(uint32_t) || !tok_buf_reserve(scratch, max_cps * sizeof(uint32_t)))
        return TEXT_ENOMEM;
    uint32_t *cp = (uint32_t *)(void *)scratch->p;
    size_t m = 0;
    for (i = 0; i < n;) {
        uint32_t c;
        size_t len = tok_utf8_next((const unsigned char *)s + i, n - i, &c);
        i += len ? len : 1; /* the caller validated the text */
        m += decompose(c, cp + m);
    }
    /* Canonical ordering: a stable insertion sort of each run of non-starters. */
    for (size_t k = 1; k < m; k++) {
        int cc = ccc_of(cp[k]);
        if (cc == 0)
            continue;
        uint32_t c = cp[k];
        size_t j = k;
        while (j > 0 && ccc_of(cp[j - 1]) > cc) {
            cp[j] = cp[j - 1];
            j--;
        }
        cp[j] = c;
    }
    /* Composition: a character joins the last starter unless a character of
     * the same or higher class (or a starter) came between them. */
    size_t starter = 0, w = m ? 1 : 0;
    int last_cc = m && ccc_of(cp[0]) ? 256 : 0;
    for (size_t k = 1; k < m; k++) {
        int cc = ccc_of(cp[k]);
        uint32_t comp = last_cc == 256 ? 0 : compose(cp[starter], cp[k]);
        if (comp && (last_cc < cc || last_cc == 0)) {
            cp[starter] = comp;
            continue;
        }
        if (cc == 0)
            starter = w;
        last_cc = cc;
        cp[w++] = cp[k];
    }
    out->n = 0;
    if (!tok_buf_reserve(out, w * 4))
        return TEXT_ENOMEM;
    for (size_t k = 0; k < w; k++)
        out->n += tok_utf8_put(cp[k], out->p + out->n);
    *changed = true;
    return TEXT_OK;
}
