#include "text/casemap.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* The longest full case folding, and so the longest full case mapping, is
 * three characters (ΐ). */
#define MAX_MAP 3

/* c's full case folding (CaseFolding.txt's C and F entries), or c alone. */
static int fold(utf8proc_int32_t c, utf8proc_int32_t out[MAX_MAP])
{
    int bound = 0;
    utf8proc_ssize_t n = utf8proc_decompose_char(c, out, MAX_MAP, UTF8PROC_CASEFOLD, &bound);
    if (n < 1 || n > MAX_MAP) {
        out[0] = c;
        return 1;
    }
    return (int)n;
}

/* utf8proc has the simple (one character) mappings only.  The full ones
 * JavaScript applies, SpecialCasing.txt's unconditional entries, are the
 * characters whose full folding is several: ß folds to ss and uppercases
 * to SS, ŉ to ʼN, ǰ to J + U+030C, ᾳ to ΑΙ, ﬃ to FFI.  A capital among them
 * (ẞ, İ) is its own uppercase. */
static int upper(utf8proc_int32_t c, utf8proc_int32_t out[MAX_MAP])
{
    int n = fold(c, out);
    if (n > 1 && utf8proc_get_property(c)->category != UTF8PROC_CATEGORY_LU) {
        for (int i = 0; i < n; i++)
            out[i] = utf8proc_toupper(out[i]);
        return n;
    }
    out[0] = utf8proc_toupper(c);
    return 1;
}

/* Of the lowercasings, only İ's is longer than the simple one (i + U+0307,
 * where the simple mapping drops the dot): the character whose simple
 * lowercase folds to something else than itself does. */
static int lower(utf8proc_int32_t c, utf8proc_int32_t out[MAX_MAP])
{
    utf8proc_int32_t l = utf8proc_tolower(c), f[MAX_MAP];
    int n = fold(c, out), m = fold(l, f);
    if (m == n && !memcmp(f, out, (size_t)n * sizeof(*f)))
        return out[0] = l, 1;
    return n;
}

enum sigma_ctx { CTX_OTHER, CTX_CASED, CTX_IGNORABLE };

/* What a character is to the final sigma rule, as ICU (JavaScript's case
 * mapping) decides it: case-ignorable (marks, format characters, modifier
 * letters and symbols, and Word_Break's MidLetter, MidNumLet and
 * Single_Quote), else cased (a letter with case, or one with a case mapping,
 * or one of the Other_Lowercase and Other_Uppercase characters without a
 * mapping that utf8proc does not mark: ª, º and the squared and circled
 * capitals U+1F130..U+1F189). */
static enum sigma_ctx sigma_ctx(utf8proc_int32_t c)
{
    static const utf8proc_int32_t mid[] = {0x27,   0x2e,   0x3a,   0xb7,   0x387,  0x55f,  0x5f4,  0x2018, 0x2019,
                                           0x2024, 0x2027, 0xfe13, 0xfe52, 0xfe55, 0xff07, 0xff0e, 0xff1a};
    switch (utf8proc_get_property(c)->category) {
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_SK:
        return CTX_IGNORABLE;
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
        return CTX_CASED;
    default:
        break;
    }
    for (size_t i = 0; i < sizeof(mid) / sizeof(mid[0]); i++)
        if (c == mid[i])
            return CTX_IGNORABLE;
    bool other = c == 0xaa || c == 0xba || (c >= 0x1f130 && c <= 0x1f149) || (c >= 0x1f150 && c <= 0x1f169) ||
                 (c >= 0x1f170 && c <= 0x1f189);
    return other || utf8proc_toupper(c) != c || utf8proc_tolower(c) != c ? CTX_CASED : CTX_OTHER;
}

/* Whether a cased character follows, past case-ignorable ones. */
static bool cased_after(const utf8proc_uint8_t *s, size_t n)
{
    utf8proc_int32_t c;
    utf8proc_ssize_t l;
    for (size_t i = 0; i < n; i += (size_t)l) {
        l = utf8proc_iterate(s + i, (utf8proc_ssize_t)(n - i), &c);
        enum sigma_ctx x = l > 0 ? sigma_ctx(c) : CTX_OTHER;
        if (x != CTX_IGNORABLE)
            return x == CTX_CASED;
    }
    return false;
}

/* Maps s[0..n) into dst, or only measures it when dst is NULL; the
 * length. */
static size_t map(const char *s, size_t n, enum casemap how, char *dst)
{
    const utf8proc_uint8_t *u = (const utf8proc_uint8_t *)s;
    utf8proc_uint8_t scratch[4];
    size_t i = 0, o = 0;
    /* the last character before s[i] that is not case-ignorable is cased:
     * a capital sigma there ends a word (Final_Sigma) unless another cased
     * one follows */
    bool cased_before = false;
    while (i < n) {
        utf8proc_int32_t c, m[MAX_MAP];
        utf8proc_ssize_t l = utf8proc_iterate(u + i, (utf8proc_ssize_t)(n - i), &c);
        if (l < 1) {
            if (dst)
                dst[o] = s[i];
            o++, i++;
            cased_before = false;
            continue;
        }
        int k = 1;
        if (how == CASEMAP_UPPER)
            k = upper(c, m);
        else if (c == 0x3a3)
            m[0] = cased_before && !cased_after(u + i + l, n - i - (size_t)l) ? 0x3c2 : 0x3c3;
        else
            k = lower(c, m);
        if (how == CASEMAP_LOWER) {
            enum sigma_ctx x = sigma_ctx(c);
            if (x != CTX_IGNORABLE)
                cased_before = x == CTX_CASED;
        }
        for (int j = 0; j < k; j++)
            o += (size_t)utf8proc_encode_char(m[j], dst ? (utf8proc_uint8_t *)dst + o : scratch);
        i += (size_t)l;
    }
    return o;
}

char *casemap(const char *s, size_t n, enum casemap how, size_t *len)
{
    size_t need = map(s, n, how, NULL);
    char *p = malloc(need + 1);
    if (!p)
        return NULL;
    *len = map(s, n, how, p);
    p[*len] = '\0';
    return p;
}
