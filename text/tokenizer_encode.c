/* tokenizer_encode.c - text to ids, in Hugging Face's order: added tokens
 * are cut out of the raw text first; each section between them is
 * normalised, pre-tokenized (the byte-level prefix, then the Split
 * pre-tokenizers in order with Metaspace where it stands among them) and
 * each piece goes through the model: BPE or Unigram. */
#include "text/tokenizer_internal.h"

struct bpe_sym {
    int32_t id, prev, next; /* id -1: merged into its left neighbour */
};

struct bpe_item {
    uint32_t rank;
    int32_t pos; /* left symbol of the pair */
};

/* Per-call state: encode allocates only these buffers, grown geometrically. */
struct work {
    const tokenizer *t;
    struct tok_ids *out;
    char *err;
    struct tok_buf a, b;     /* normalised text, alternating source/target */
    struct tok_buf scratch;  /* NFC code points */
    struct tok_buf mapped;   /* a piece in the byte-level alphabet */
    struct tok_buf sym, heap; /* BPE symbols and queue; Unigram lattice and path */
    struct tok_buf meta;      /* a piece after the Metaspace step */
    const char *section;      /* the normalised section being split */
    bool at_start;            /* it is the text's first */
    pcre2_match_data *md;
};

enum text_status tok_ids_push(struct tok_ids *o, int32_t id)
{
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 64;
        int32_t *p = cap <= SIZE_MAX / sizeof *p ? realloc(o->ids, cap * sizeof *p) : NULL;
        if (!p)
            return TEXT_ENOMEM;
        o->ids = p;
        o->cap = cap;
    }
    o->ids[o->n++] = id;
    return TEXT_OK;
}

/* ---- BPE ------------------------------------------------------------------ */

static bool item_before(const struct bpe_item *x, const struct bpe_item *y)
{
    return x->rank < y->rank || (x->rank == y->rank && x->pos < y->pos);
}

static void heap_push(struct bpe_item *h, size_t *n, struct bpe_item it)
{
    size_t i = (*n)++;
    while (i > 0 && item_before(&it, &h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = it;
}

static struct bpe_item heap_pop(struct bpe_item *h, size_t *n)
{
    struct bpe_item top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && item_before(&h[c + 1], &h[c]))
            c++;
        if (!item_before(&h[c], &last))
            break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

static void push_pair(const tokenizer *t, const struct bpe_sym *sym, int32_t l, struct bpe_item *h, size_t *nh)
{
    const struct tok_merge_slot *m = tok_merge_find(t, sym[l].id, sym[sym[l].next].id);
    if (m)
        heap_push(h, nh, (struct bpe_item){m->rank, l});
}

/* Merges the lowest-ranked adjacent pair (leftmost among equals) until
 * none is left.  A queued pair is stale when its left symbol was merged
 * away or its neighbours changed; ranks are unique per pair, so comparing
 * the rank of the pair now at pos with the queued one detects that. */
static void bpe_merge(const tokenizer *t, struct bpe_sym *sym, size_t n, struct bpe_item *h)
{
    size_t nh = 0;
    for (size_t i = 0; i + 1 < n; i++)
        push_pair(t, sym, (int32_t)i, h, &nh);
    while (nh) {
        struct bpe_item it = heap_pop(h, &nh);
        int32_t l = it.pos, r = sym[l].next;
        if (sym[l].id < 0 || r < 0)
            continue;
        const struct tok_merge_slot *m = tok_merge_find(t, sym[l].id, sym[r].id);
        if (!m || m->rank != it.rank)
            continue;
        sym[l].id = m->merged;
        sym[l].next = sym[r].next;
        if (sym[r].next >= 0)
            sym[sym[r].next].prev = l;
        sym[r].id = -1;
        if (sym[l].prev >= 0)
            push_pair(t, sym, sym[l].prev, h, &nh);
        if (sym[l].next >= 0)
            push_pair(t, sym, l, h, &nh);
    }
}

static void add_sym(struct bpe_sym *sym, size_t *n, int32_t id)
{
    sym[*n] = (struct bpe_sym){id, (int32_t)*n - 1, -1};
    if (*n)
        sym[*n - 1].next = (int32_t)*n;
    (*n)++;
}

/* One symbol per character: its vocab id, else its <0xNN> byte tokens
 * (byte_fallback), else unk (consecutive ones fused when fuse_unk), else
 * nothing - Hugging Face's BPE::merge_word. */
static size_t word_symbols(const tokenizer *t, const char *s, size_t n, struct bpe_sym *sym)
{
    size_t ns = 0;
    bool prev_unk = false;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t len = tok_utf8_next((const unsigned char *)s + i, n - i, &cp);
        len = len ? len : 1;
        int32_t id = tok_vocab_find(t, s + i, len);
        bool bytes_ok = t->byte_fallback;
        for (size_t k = 0; id < 0 && bytes_ok && k < len; k++)
            bytes_ok = t->byte_token[(unsigned char)s[i + k]] >= 0;
        if (id >= 0) {
            add_sym(sym, &ns, id);
        } else if (bytes_ok) {
            for (size_t k = 0; k < len; k++)
                add_sym(sym, &ns, t->byte_token[(unsigned char)s[i + k]]);
        } else if (t->unk_id >= 0 && !(t->fuse_unk && prev_unk)) {
            add_sym(sym, &ns, t->unk_id);
        }
        prev_unk = id < 0 && !bytes_ok;
        i += len;
    }
    return ns;
}

/* ---- Unigram --------------------------------------------------------------- */

/* The best segmentation of the text up to a position: its total score, and
 * the start and id of its last piece (id UNREACHED: none yet). */
struct lattice {
    double score;
    size_t start;
    int32_t id;
};
#define UNREACHED (-2)

static void relax(struct lattice *best, size_t from, size_t to, double score, int32_t id)
{
    double total = best[from].score + score;
    /* Strictly better only: among equal paths the first found stays, as in
     * Hugging Face's and SentencePiece's Viterbi. */
    if (best[to].id == UNREACHED || total > best[to].score)
        best[to] = (struct lattice){total, from, id};
}

/* A run of characters no piece covers, fused as Hugging Face does: its
 * <0xNN> byte pieces under byte_fallback when all exist, else unk. */
static enum text_status unknown_run(struct work *w, const char *s, size_t n)
{
    const tokenizer *t = w->t;
    int32_t id = tok_vocab_find(t, s, n); /* a lone match of the unk piece itself */
    bool bytes = id < 0 && t->byte_fallback;
    for (size_t k = 0; bytes && k < n; k++)
        bytes = t->byte_token[(unsigned char)s[k]] >= 0;
    if (!bytes)
        return tok_ids_push(w->out, id >= 0 ? id : t->unk_id);
    for (size_t k = 0; k < n; k++) {
        enum text_status st = tok_ids_push(w->out, t->byte_token[(unsigned char)s[k]]);
        if (st != TEXT_OK)
            return st;
    }
    return TEXT_OK;
}

/* Viterbi over the pieces that start at each character: at most
 * max_piece lookups per position.  A character that no one-character
 * piece covers also gets an unk edge, scored below every piece. */
static enum text_status unigram_word(struct work *w, const char *s, size_t n)
{
    const tokenizer *t = w->t;
    w->sym.n = w->heap.n = 0;
    if (n >= SIZE_MAX / sizeof(struct lattice) || !tok_buf_reserve(&w->sym, (n + 1) * sizeof(struct lattice)) ||
        !tok_buf_reserve(&w->heap, n * sizeof(size_t)))
        return TEXT_ENOMEM;
    struct lattice *best = (struct lattice *)(void *)w->sym.p;
    best[0] = (struct lattice){0, 0, -1};
    for (size_t i = 1; i <= n; i++)
        best[i].id = UNREACHED;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        /* Every character boundary is reached: the one before it was. */
        size_t clen = tok_utf8_next((const unsigned char *)s + i, n - i, &cp);
        clen = clen ? clen : 1; /* the normalisers keep UTF-8 valid; never loop */
        size_t len = clen;
        size_t lim = n - i < t->max_piece ? n - i : t->max_piece;
        bool single = false;
        while (len <= lim) {
            int32_t id = tok_vocab_find(t, s + i, len);
            if (id >= 0) {
                relax(best, i, i + len, t->score[id], id);
                single |= len == clen;
            }
            size_t next = len < n - i ? tok_utf8_next((const unsigned char *)s + i + len, n - i - len, &cp) : 0;
            if (!next)
                break;
            len += next;
        }
        if (!single)
            relax(best, i, i + clen, t->unk_score, t->unk_id);
        i += clen;
    }
    /* The path backwards (its end positions), then its pieces forwards,
     * consecutive unk edges fused into one run. */
    size_t *ends = (size_t *)(void *)w->heap.p, np = 0;
    for (size_t e = n; e > 0; e = best[e].start)
        ends[np++] = e;
    size_t run = SIZE_MAX, run_end = 0;
    enum text_status st = TEXT_OK;
    while (np && st == TEXT_OK) {
        size_t e = ends[--np], b = best[e].start;
        if (best[e].id == t->unk_id) {
            run = run == SIZE_MAX ? b : run;
            run_end = e;
            continue;
        }
        if (run != SIZE_MAX)
            st = unknown_run(w, s + run, run_end - run);
        run = SIZE_MAX;
        if (st == TEXT_OK)
            st = tok_ids_push(w->out, best[e].id);
    }
    if (st == TEXT_OK && run != SIZE_MAX)
        st = unknown_run(w, s + run, run_end - run);
    return st;
}

static enum text_status model_word(struct work *w, const char *s, size_t n)
{
    const tokenizer *t = w->t;
    if (t->byte_level) {
        w->mapped.n = 0;
        if (!tok_buf_reserve(&w->mapped, 2 * n))
            return TEXT_ENOMEM;
        for (size_t i = 0; i < n; i++)
            w->mapped.n += tok_utf8_put(tok_byte_to_cp((unsigned char)s[i]), w->mapped.p + w->mapped.n);
        s = w->mapped.p;
        n = w->mapped.n;
    }
    if (t->unigram)
        return unigram_word(w, s, n);
    if (t->ignore_merges) {
        int32_t id = tok_vocab_find(t, s, n);
        if (id >= 0)
            return tok_ids_push(w->out, id);
    }
    /* A character yields at most one symbol per byte; each merge queues at
     * most two pairs after the first n - 1. */
    w->sym.n = w->heap.n = 0;
    if (n > SIZE_MAX / (3 * sizeof(struct bpe_item)) || !tok_buf_reserve(&w->sym, n * sizeof(struct bpe_sym)) ||
        !tok_buf_reserve(&w->heap, 3 * n * sizeof(struct bpe_item)))
        return TEXT_ENOMEM;
    struct bpe_sym *sym = (struct bpe_sym *)(void *)w->sym.p;
    size_t ns = word_symbols(t, s, n, sym);
    if (ns == 0)
        return TEXT_OK;
    bpe_merge(t, sym, ns, (struct bpe_item *)(void *)w->heap.p);
    /* Symbol 0 absorbs its right neighbours and is never deleted. */
    for (int32_t i = 0; i >= 0; i = sym[i].next) {
        enum text_status st = tok_ids_push(w->out, sym[i].id);
        if (st != TEXT_OK)
            return st;
    }
    return TEXT_OK;
}

/* ---- pre-tokenizer ------------------------------------------------------- */

static bool is_space(uint32_t c);
static size_t char_before(const char *s, size_t lo, size_t i, uint32_t *cp);

static int run_match(struct work *w, const pcre2_code *re, const char *s, size_t n, size_t pos)
{
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, w->md, NULL);
    /* JIT's fixed stack can run out on long runs; the interpreter uses the heap. */
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, w->md, NULL);
    return rc;
}

/* run_match's error rc (not NOMATCH) as a status: what failed, on how
 * many bytes, and PCRE2's words for it. */
static enum text_status match_failed(struct work *w, int rc, const char *what, size_t n)
{
    PCRE2_UCHAR msg[128];
    pcre2_get_error_message(rc, msg, sizeof msg);
    return text_errf(w->err, rc == PCRE2_ERROR_NOMEMORY ? TEXT_ENOMEM : TEXT_EINVAL,
                     "%s failed on a %zu-byte piece: %s", what, n, (const char *)msg);
}

static enum text_status split_level(struct work *w, int k, const char *s, size_t n);

static enum text_status rewrite(struct tok_buf *dst, const char *prefix, size_t np, const char *s, size_t n,
                                const char *from, size_t nfrom, const char *to, size_t nto);

/* The Metaspace step on one piece (the whole section when no split comes
 * before it): ' ' becomes the replacement, which is also put in front as
 * the prepend scheme says ("first": only the text's very first piece). */
static enum text_status metaspace(struct work *w, const char **s, size_t *n)
{
    const tokenizer *t = w->t;
    const char *r = t->str.p + t->meta_repl.off;
    size_t nr = t->meta_repl.len;
    bool first = w->at_start && *s == w->section;
    /* The piece starts with the replacement after replacing if it starts
     * with a space or with the replacement itself. */
    bool prepend = (t->meta_prepend == TOK_PREPEND_ALWAYS || (t->meta_prepend == TOK_PREPEND_FIRST && first)) &&
                   (*s)[0] != ' ' && !(*n >= nr && memcmp(*s, r, nr) == 0);
    enum text_status st = rewrite(&w->meta, r, prepend ? nr : 0, *s, *n, " ", 1, r, nr);
    *s = w->meta.p;
    *n = w->meta.n;
    return st;
}

/* The piece split k is building: the segments (matches and the text
 * between them) it has joined so far. */
struct piece {
    size_t start, end;
    bool open;
    bool last_match; /* whether the segment before was a delimiter */
};

static enum text_status flush(struct work *w, int k, const char *s, struct piece *p)
{
    if (!p->open)
        return TEXT_OK;
    p->open = false;
    return split_level(w, k + 1, s + p->start, p->end - p->start);
}

/* Adds the segment s[start..end) to the pieces of split k, joining it to
 * the open piece where the behaviour says so; Hugging Face decides each
 * join from the segment and the one just before it, never further back. */
static enum text_status segment(struct work *w, int k, const char *s, struct piece *p, size_t start, size_t end,
                                bool match)
{
    const struct tok_split *sp = &w->t->splits[k];
    match ^= sp->invert;
    bool join = false, keep = true;
    switch (sp->behavior) {
    case TOK_SPLIT_REMOVED: keep = !match; break;
    case TOK_SPLIT_ISOLATED: break;
    case TOK_SPLIT_MERGED_WITH_PREVIOUS: join = match && !p->last_match; break;
    case TOK_SPLIT_MERGED_WITH_NEXT: join = !match && p->last_match; break;
    case TOK_SPLIT_CONTIGUOUS: join = match == p->last_match; break;
    }
    p->last_match = match;
    if (join && p->open) {
        p->end = end;
        return TEXT_OK;
    }
    enum text_status st = flush(w, k, s, p);
    if (st == TEXT_OK && keep)
        *p = (struct piece){start, end, true, match};
    return st;
}

/* Splits s[0..n) with split k into segments, joins them into pieces as its
 * behaviour says and hands each piece to split k + 1, the last one to BPE.
 * Empty pieces vanish. */
static enum text_status split_level(struct work *w, int k, const char *s, size_t n)
{
    if (n == 0)
        return TEXT_OK;
    if (w->t->metaspace && k == w->t->meta_at) {
        enum text_status st = metaspace(w, &s, &n);
        if (st != TEXT_OK)
            return st;
    }
    if (k == w->t->n_splits)
        return model_word(w, s, n);
    struct piece p = {0, 0, false, false};
    size_t pos = 0, gap = 0;
    enum text_status st = TEXT_OK;
    while (pos < n && st == TEXT_OK) {
        int rc = run_match(w, w->t->splits[k].re, s, n, pos);
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc < 0) {
            char what[40];
            snprintf(what, sizeof what, "pre_tokenizer split %d", k);
            return match_failed(w, rc, what, n);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(w->md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { /* an empty match splits nothing: step one character */
            uint32_t cp;
            size_t len = tok_utf8_next((const unsigned char *)s + ms, n - ms, &cp);
            pos = ms + (len ? len : 1);
            continue;
        }
        if (ms > gap)
            st = segment(w, k, s, &p, gap, ms, false);
        if (st == TEXT_OK)
            st = segment(w, k, s, &p, ms, me, true);
        gap = pos = me;
    }
    if (st == TEXT_OK && gap < n)
        st = segment(w, k, s, &p, gap, n, false);
    return st == TEXT_OK ? flush(w, k, s, &p) : st;
}

/* The buffer of the two that does not hold s (which may start inside it). */
static struct tok_buf *target(struct work *w, const char *s)
{
    return w->a.p && s >= w->a.p && s <= w->a.p + w->a.n ? &w->b : &w->a;
}

/* The Precompiled normaliser: SentencePiece's rule, the longest key of the
 * charsmap at each position, else the character unchanged. */
static enum text_status precompiled(const tokenizer *t, const char *s, size_t n, struct tok_buf *dst)
{
    dst->n = 0;
    size_t run = 0, i = 0;
    while (i < n) {
        struct tok_span r;
        size_t m = tok_charsmap_match(t, s + i, n - i, &r);
        if (!m) {
            uint32_t cp;
            i += tok_utf8_next((const unsigned char *)s + i, n - i, &cp);
            continue;
        }
        if (!tok_buf_append(dst, s + run, i - run) || !tok_buf_append(dst, t->str.p + r.off, r.len))
            return TEXT_ENOMEM;
        i += m;
        run = i;
    }
    return tok_buf_append(dst, s + run, n - run) ? TEXT_OK : TEXT_ENOMEM;
}

/* Replace with a Regex: every match (an empty one replaces nothing) becomes
 * the content. */
static enum text_status replace_regex(struct work *w, const struct tok_norm *nm, const char *s, size_t n,
                                      struct tok_buf *dst)
{
    size_t pos = 0, run = 0;
    dst->n = 0;
    while (pos < n) {
        int rc = run_match(w, nm->re, s, n, pos);
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc < 0)
            return match_failed(w, rc, "normalizer Replace", n);
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(w->md);
        if (ov[1] == ov[0]) {
            uint32_t cp;
            size_t len = tok_utf8_next((const unsigned char *)s + ov[0], n - ov[0], &cp);
            pos = ov[0] + (len ? len : 1);
            continue;
        }
        if (!tok_buf_append(dst, s + run, ov[0] - run) ||
            !tok_buf_append(dst, w->t->str.p + nm->to.off, nm->to.len))
            return TEXT_ENOMEM;
        run = pos = ov[1];
    }
    return tok_buf_append(dst, s + run, n - run) ? TEXT_OK : TEXT_ENOMEM;
}

static void strip(const struct tok_norm *nm, const char **s, size_t *n)
{
    uint32_t cp;
    size_t k;
    while (nm->left && *n && (k = tok_utf8_next((const unsigned char *)*s, *n, &cp)) && is_space(cp)) {
        *s += k;
        *n -= k;
    }
    while (nm->right && *n && (k = char_before(*s, 0, *n, &cp)) && is_space(cp))
        *n -= k;
}

/* dst = prefix + s[0..n) with every `from` replaced by `to` (from may be empty). */
static enum text_status rewrite(struct tok_buf *dst, const char *prefix, size_t np, const char *s, size_t n,
                                 const char *from, size_t nfrom, const char *to, size_t nto)
{
    dst->n = 0;
    if (!tok_buf_append(dst, prefix, np))
        return TEXT_ENOMEM;
    size_t i = 0, run = 0;
    while (i < n) {
        if (nfrom && n - i >= nfrom && memcmp(s + i, from, nfrom) == 0) {
            if (!tok_buf_append(dst, s + run, i - run) || !tok_buf_append(dst, to, nto))
                return TEXT_ENOMEM;
            i += nfrom;
            run = i;
        } else {
            i++;
        }
    }
    return tok_buf_append(dst, s + run, n - run) ? TEXT_OK : TEXT_ENOMEM;
}

static enum text_status encode_section(struct work *w, const char *s, size_t n, bool at_start)
{
    const tokenizer *t = w->t;
    const char *str = t->str.p;
    enum text_status st = TEXT_OK;
    if (n == 0)
        return TEXT_OK;
    /* Every normaliser leaves an empty text empty (and may have no buffer for it). */
    for (int k = 0; k < t->n_norm && st == TEXT_OK && n; k++) {
        const struct tok_norm *nm = &t->norm[k];
        struct tok_buf *dst = target(w, s);
        bool changed = true;
        if (nm->op == TOK_NORM_NFC) {
            st = tok_nfc(s, n, dst, &w->scratch, &changed);
            if (st == TEXT_EINVAL)
                text_errf(w->err, st, "normalizer NFC: libutf8proc refused a %zu-byte piece", n);
        } else if (nm->op == TOK_NORM_PRECOMPILED) {
            st = precompiled(t, s, n, dst);
        } else if (nm->op == TOK_NORM_STRIP) {
            /* No copy: the next step writes to the buffer that does not hold s. */
            strip(nm, &s, &n);
            changed = false;
        } else if (nm->op == TOK_NORM_PREPEND)
            st = rewrite(dst, str + nm->to.off, nm->to.len, s, n, NULL, 0, NULL, 0);
        else if (nm->re)
            st = replace_regex(w, nm, s, n, dst);
        else
            st = rewrite(dst, NULL, 0, s, n, str + nm->from.off, nm->from.len, str + nm->to.off, nm->to.len);
        if (changed) {
            s = dst->p;
            n = dst->n;
        }
    }
    if (st != TEXT_OK || n == 0)
        return st;
    if (t->prefix_space && s[0] != ' ') {
        struct tok_buf *dst = target(w, s);
        st = rewrite(dst, " ", 1, s, n, NULL, 0, NULL, 0);
        s = dst->p;
        n = dst->n;
    }
    w->section = s;
    w->at_start = at_start;
    return st == TEXT_OK ? split_level(w, 0, s, n) : st;
}

/* ---- added tokens ---------------------------------------------------------- */

/* Unicode White_Space. */
static bool is_space(uint32_t c)
{
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

/* Word characters for single_word: ASCII letters, digits and '_', and any
 * non-ASCII character that is not whitespace or general punctuation (an
 * approximation of \w that avoids Unicode tables). */
static bool is_word(uint32_t c)
{
    if (c < 0x80)
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    return !is_space(c) && !(c >= 0x2010 && c <= 0x2E7F) && !(c >= 0x3000 && c <= 0x303F);
}

/* The character ending right before s[i] (s[lo..i) is valid UTF-8). */
static size_t char_before(const char *s, size_t lo, size_t i, uint32_t *cp)
{
    size_t j = i - 1;
    while (j > lo && ((unsigned char)s[j] & 0xC0) == 0x80)
        j--;
    return tok_utf8_next((const unsigned char *)s + j, i - j, cp);
}

static bool at_word_edge(const char *s, size_t n, size_t start, size_t end)
{
    uint32_t cp;
    if (start > 0 && char_before(s, 0, start, &cp) && is_word(cp))
        return false;
    return !(end < n && tok_utf8_next((const unsigned char *)s + end, n - end, &cp) && is_word(cp));
}

/* The longest added token starting at s[i], or NULL. */
static const struct tok_added *added_at(const tokenizer *t, const char *s, size_t n, size_t i)
{
    unsigned char b = (unsigned char)s[i];
    for (int k = t->added_first[b]; k < t->added_first[b + 1]; k++) {
        const struct tok_added *a = &t->added[k];
        if (a->s.len <= n - i && memcmp(t->str.p + a->s.off, s + i, a->s.len) == 0 &&
            (!a->single_word || at_word_edge(s, n, i, i + a->s.len)))
            return a;
    }
    return NULL;
}

static enum text_status encode_text(struct work *w, const char *text, size_t len)
{
    const tokenizer *t = w->t;
    size_t sec = 0, i = 0;
    while (i < len) {
        const struct tok_added *a = t->n_added ? added_at(t, text, len, i) : NULL;
        if (!a) {
            i++;
            continue;
        }
        /* lstrip / rstrip: the token swallows the whitespace beside it. */
        size_t ms = i, me = i + a->s.len, cl;
        uint32_t cp;
        while (a->lstrip && ms > sec && (cl = char_before(text, sec, ms, &cp)) && is_space(cp))
            ms -= cl;
        while (a->rstrip && me < len && (cl = tok_utf8_next((const unsigned char *)text + me, len - me, &cp)) &&
               is_space(cp))
            me += cl;
        enum text_status st = encode_section(w, text + sec, ms - sec, sec == 0);
        if (st == TEXT_OK)
            st = tok_ids_push(w->out, a->id);
        if (st != TEXT_OK)
            return st;
        i = sec = me;
    }
    return encode_section(w, text + sec, len - sec, sec == 0);
}

enum text_status tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_special,
                                   struct tok_ids *out, char *err)
{
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        size_t l = tok_utf8_next((const unsigned char *)text + i, len - i, &cp);
        if (!l)
            return text_errf(err, TEXT_EINVAL, "text: invalid UTF-8 at byte offset %zu", i);
        i += l;
    }
    size_t old_n = out->n;
    struct work w = {.t = t, .out = out, .err = err};
    enum text_status st = TEXT_OK;
    bool regex = t->n_splits > 0;
    for (int k = 0; k < t->n_norm; k++)
        regex |= t->norm[k].re != NULL;
    if (regex && !(w.md = pcre2_match_data_create(1, NULL)))
        st = TEXT_ENOMEM;
    for (int k = 0; add_special && st == TEXT_OK && k < t->n_prefix; k++)
        st = tok_ids_push(w.out, t->prefix_ids[k]);
    if (st == TEXT_OK)
        st = encode_text(&w, text, len);
    for (int k = 0; add_special && st == TEXT_OK && k < t->n_suffix; k++)
        st = tok_ids_push(w.out, t->suffix_ids[k]);
    pcre2_match_data_free(w.md);
    free(w.a.p);
    free(w.b.p);
    free(w.scratch.p);
    free(w.mapped.p);
    free(w.meta.p);
    free(w.sym.p);
    free(w.heap.p);
    if (st != TEXT_OK) {
        out->n = old_n;
        if (st == TEXT_ENOMEM)
            text_errf(err, st, "tokenizer_encode: out of memory on a %zu-byte text", len);
    }
    return st;
}
