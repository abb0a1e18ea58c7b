/* jsonw.h - an append-only JSON text writer for replies and SSE events:
 * into a caller's fixed buffer (the stream's socket buffer, nothing
 * allocated per token) or a growing one (whole replies).  Strings are
 * escaped and invalid UTF-8 becomes U+FFFD, so the output is always valid
 * JSON whatever bytes a model emits.
 */
#ifndef KVTIER_IPC_JSONW_H
#define KVTIER_IPC_JSONW_H

#include <stdbool.h>
#include <stddef.h>

struct jw {
    char *p;
    size_t n, cap;
    bool grow;   /* p is malloc'd and may move */
    bool failed; /* a fixed buffer was too small, or memory ran out: output is incomplete */
};

void jw_fixed(struct jw *w, char *buf, size_t cap);
void jw_dynamic(struct jw *w); /* free w->p when done */
void jw_raw(struct jw *w, const char *s, size_t n);
void jw_lit(struct jw *w, const char *s);
void jw_fmt(struct jw *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* v with digits significant digits; null when v is not finite (JSON has
 * no infinities: a log-probability of -inf is one) */
void jw_real(struct jw *w, double v, int digits);
/* "s[0..n)" escaped */
void jw_str(struct jw *w, const char *s, size_t n);
/* The bytes of s[0..n) as a JSON array of numbers (OpenAI logprobs "bytes"). */
void jw_bytes(struct jw *w, const char *s, size_t n);
/* Longest prefix of s[0..n) that ends on a UTF-8 character boundary and
 * whose escaped form takes at most room bytes. */
size_t jw_fit(const char *s, size_t n, size_t room);

#endif
