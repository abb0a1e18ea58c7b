/* tokenizer_decode.c - ids to text.  Each id's bytes were worked out at load
 * (tok_span dec); what is left is the decoder's leading-space strip and
 * reassembling UTF-8 across tokens: a character split over byte tokens is
 * held back until complete, and bytes that cannot form one become U+FFFD
 * (one per maximal invalid subsequence, as the WHATWG decoder does), a
 * character still incomplete at the end included. */
#include "text/tokenizer_internal.h"

struct utf8_state {
    unsigned char cur[4];
    int n, need;
    unsigned char lo, hi; /* range of the next continuation byte */
};

static size_t emit(char *out, size_t at, const void *p, size_t n)
{
    if (out)
        memcpy(out + at, p, n);
    return n;
}

static const unsigned char fffd[3] = {0xEF, 0xBF, 0xBD};

static size_t feed(struct utf8_state *s, unsigned char b, char *out, size_t at)
{
    if (s->n > 0) {
        if (b >= s->lo && b <= s->hi) {
            s->cur[s->n++] = b;
            s->lo = 0x80, s->hi = 0xBF;
            if (s->n < s->need)
                return 0;
            s->n = 0;
            return emit(out, at, s->cur, (size_t)s->need);
        }
        s->n = 0; /* the broken prefix becomes one U+FFFD; b starts afresh */
        size_t k = emit(out, at, fffd, 3);
        return k + feed(s, b, out, at + k);
    }
    if (b < 0x80)
        return emit(out, at, &b, 1);
    s->lo = 0x80, s->hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
        s->need = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
        s->need = 3;
        s->lo = b == 0xE0 ? 0xA0 : 0x80;
        s->hi = b == 0xED ? 0x9F : 0xBF;
    } else if (b >= 0xF0 && b <= 0xF4) {
        s->need = 4;
        s->lo = b == 0xF0 ? 0x90 : 0x80;
        s->hi = b == 0xF4 ? 0x8F : 0xBF;
    } else {
        return emit(out, at, fffd, 3);
    }
    s->cur[s->n++] = b;
    return 0;
}

/* Runs the pending bytes and then p[0..n) through the decoder; returns the
 * bytes produced (written to out unless NULL) and the new pending bytes. */
static size_t assemble(const struct tok_stream *st, const char *p, size_t n, char *out, struct utf8_state *s)
{
    size_t at = 0;
    memset(s, 0, sizeof *s);
    for (int i = 0; i < st->n_pending; i++)
        at += feed(s, st->pending[i], out, at);
    for (size_t i = 0; i < n; i++)
        at += feed(s, (unsigned char)p[i], out, at);
    return at;
}

size_t tokenizer_decode_stream(const tokenizer *t, struct tok_stream *st, int32_t id, bool skip_special, char *out,
                               size_t cap)
{
    if (id < 0 || id >= t->n_ids || (skip_special && (t->flags[id] & TOKF_SPECIAL)))
        return 0;
    const char *p = t->str.p + t->dec[id].off;
    size_t n = t->dec[id].len;
    if (n == 0)
        return 0;
    bool strip = t->strip_first_space && !st->started && p[0] == ' ';
    struct utf8_state s;
    size_t need = assemble(st, p + strip, n - strip, NULL, &s);
    if (need > cap)
        return need;
    assemble(st, p + strip, n - strip, out, &s);
    memcpy(st->pending, s.cur, (size_t)s.n);
    st->n_pending = s.n;
    st->started = true;
    return need;
}

size_t tokenizer_decode_flush(struct tok_stream *st, char *out, size_t cap)
{
    if (!st->n_pending)
        return 0;
    if (cap >= sizeof fffd) {
        memcpy(out, fffd, sizeof fffd);
        st->n_pending = 0;
    }
    return sizeof fffd;
}

const char *tokenizer_token_bytes(const tokenizer *t, int32_t id, size_t *len, bool *special)
{
    if (id < 0 || id >= t->n_ids)
        return NULL;
    *len = t->dec[id].len;
    *special = (t->flags[id] & TOKF_SPECIAL) != 0;
    return t->str.p + t->dec[id].off;
}

enum text_status tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n, bool skip_special, char **out,
                                   size_t *len)
{
    struct tok_stream st = {0};
    struct tok_buf b = {0};
    *out = NULL;
    if (len)
        *len = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_ids) {
            free(b.p);
            return TEXT_EINVAL;
        }
        /* Each byte yields at most 3 (U+FFFD), pending ones included. */
        size_t room = 3 * ((size_t)t->dec[ids[i]].len + sizeof st.pending);
        if (!tok_buf_reserve(&b, room)) {
            free(b.p);
            return TEXT_ENOMEM;
        }
        b.n += tokenizer_decode_stream(t, &st, ids[i], skip_special, b.p + b.n, room);
    }
    if (!tok_buf_reserve(&b, sizeof fffd + 1)) {
        free(b.p);
        return TEXT_ENOMEM;
    }
    b.n += tokenizer_decode_flush(&st, b.p + b.n, sizeof fffd);
    b.p[b.n] = '\0';
    *out = b.p;
    if (len)
        *len = b.n;
    return TEXT_OK;
}
