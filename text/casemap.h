/* casemap.h - Unicode case mapping as JavaScript's String toUpperCase()
 * and toLowerCase() do it, which @huggingface/jinja's upper and lower
 * call: full mappings (ß uppercases to SS, İ lowercases to i + U+0307) and
 * the final sigma, without locale rules (no Turkish dotless i), from
 * libutf8proc's tables, so of its Unicode version.
 *
 * Bytes that are not UTF-8 pass through unchanged: a template never sees
 * them from JSON, which is checked UTF-8, and no character they might have
 * been is guessed at.
 */
#ifndef KVTIER_TEXT_CASEMAP_H
#define KVTIER_TEXT_CASEMAP_H

#include <stddef.h>

enum casemap { CASEMAP_UPPER, CASEMAP_LOWER };

/* s[0..n) mapped (malloc'd, NUL-terminated, its length in *len); NULL
 * when out of memory. */
char *casemap(const char *s, size_t n, enum casemap how, size_t *len);

#endif
