/* fuzz_tokenize.c - tokenizer_encode on arbitrary bytes and
 * tokenizer_decode / tokenizer_decode_stream on arbitrary ids, with three
 * real tokenizers: the built-in model's byte-level BPE (model/builtin), a
 * SentencePiece-style BPE with byte_fallback (tests/fuzz/tokenize/sp) and a
 * T5-style Unigram with byte_fallback, a Precompiled charsmap, Strip and a
 * Regex Replace (tests/fuzz/tokenize/unigram, written by tools/spm2hf.py).
 * Paths are relative to the repository root, or to $KVTIER_SRC.
 *
 * Input: one mode byte, then the text (or, with mode bit 1, little-endian
 * 16-bit ids).  Bit 3 picks the Unigram, else bit 0 picks between the two
 * BPEs; bit 2 is add_special / skip_special.
 *
 * Invariants:
 *   - encode accepts exactly the well-formed UTF-8 texts; a refused one
 *     gets TEXT_EINVAL with a message giving the byte offset;
 *   - every id is inside the vocabulary; add_special starts with BOS;
 *   - decode(encode(x)) == x (byte-level: always; SentencePiece BPE: when x
 *     has no U+2581, which its normaliser turns into a space, and no added
 *     token, after which Prepend adds a space as Hugging Face's does; never
 *     for the Unigram, whose normalisers rewrite the text);
 *   - decoding arbitrary ids gives well-formed UTF-8, the same whether done
 *     at once or token by token through tokenizer_decode_stream (which
 *     writes nothing when the buffer is short and says what it needs);
 *     re-encoding that text and decoding again gives it back (byte-level);
 *   - an id out of range is TEXT_EINVAL. */
#include "text/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

enum kind { BYTE_LEVEL, SP_BPE, UNIGRAM };
static tokenizer *toks[3];

static tokenizer *load(const char *rel)
{
    char dir[1024], err[TEXT_ERR_LEN];
    const char *root = getenv("KVTIER_SRC");
    snprintf(dir, sizeof dir, "%s%s%s", root ? root : "", root ? "/" : "", rel);
    tokenizer *t = NULL;
    if (tokenizer_load(dir, &t, err) != TEXT_OK) {
        fprintf(stderr, "fuzz_tokenize: cannot load %s: %s (run from the repository root or set KVTIER_SRC)\n", dir,
                err);
        exit(1);
    }
    return t;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    toks[0] = load("model/builtin");
    toks[1] = load("tests/fuzz/tokenize/sp");
    toks[2] = load("tests/fuzz/tokenize/unigram");
    return 0;
}

static char *decode(const tokenizer *t, const int32_t *ids, size_t n, bool skip, size_t *len)
{
    char *out = NULL;
    enum text_status st = tokenizer_decode(t, ids, n, skip, &out, len);
    FUZZ_CHECK(st == TEXT_OK && out, "decode failed: %d", st);
    FUZZ_CHECK(out[*len] == '\0', "decode output not NUL-terminated");
    FUZZ_CHECK(fuzz_utf8_valid((const unsigned char *)out, *len), "decode output is not UTF-8");
    return out;
}

/* Token by token with tokenizer_decode_stream: the same text as decode,
 * except that a character left incomplete at the end is not emitted. */
static void check_stream(const tokenizer *t, const int32_t *ids, size_t n, bool skip, const char *whole, size_t len)
{
    struct tok_stream st = {0};
    char *acc = malloc(3 * 64 * (n + 1) + 1), buf[1024];
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        struct tok_stream before = st;
        size_t need = tokenizer_decode_stream(t, &st, ids[i], skip, buf, 0);
        if (need > 0) {
            FUZZ_CHECK(memcmp(&before, &st, sizeof st) == 0, "a short buffer changed the stream state");
            FUZZ_CHECK(need <= sizeof buf, "one token needs %zu bytes", need);
            size_t got = tokenizer_decode_stream(t, &st, ids[i], skip, buf, sizeof buf);
            FUZZ_CHECK(got == need, "needed %zu, wrote %zu", need, got);
        }
        memcpy(acc + at, buf, need);
        at += need;
    }
    FUZZ_CHECK(at <= len && memcmp(acc, whole, at) == 0, "streamed %zu bytes differ from decode's %zu", at, len);
    /* what decode adds at the end is only the flushed incomplete character */
    FUZZ_CHECK(len - at <= 3 * 4, "decode has %zu bytes more than the stream", len - at);
    free(acc);
}

static void fuzz_encode(const tokenizer *t, enum kind kind, const char *text, size_t n, bool add_special)
{
    struct tok_ids ids = {0};
    char err[TEXT_ERR_LEN];
    err[0] = '\0';
    enum text_status st = tokenizer_encode(t, text, n, add_special, &ids, err);
    bool valid = fuzz_utf8_valid((const unsigned char *)text, n);
    if (!valid) {
        FUZZ_CHECK(st == TEXT_EINVAL, "invalid UTF-8 accepted (%d)", st);
        FUZZ_CHECK(strstr(err, "offset"), "message \"%s\" gives no offset", err);
        free(ids.ids);
        return;
    }
    FUZZ_CHECK(st == TEXT_OK, "valid UTF-8 refused: %s", err);
    int vocab = tokenizer_vocab_size(t);
    for (size_t i = 0; i < ids.n; i++)
        FUZZ_CHECK(ids.ids[i] >= 0 && ids.ids[i] < vocab, "ids[%zu] = %d", i, ids.ids[i]);
    if (add_special && tokenizer_bos_id(t) >= 0)
        FUZZ_CHECK(ids.n && ids.ids[0] == tokenizer_bos_id(t), "add_special without BOS first");
    size_t len;
    char *back = decode(t, ids.ids, ids.n, false, &len);
    check_stream(t, ids.ids, ids.n, false, back, len);
    bool plain = !memmem(text, n, "\xe2\x96\x81", 3) && !memmem(text, n, "<s>", 3) && !memmem(text, n, "</s>", 4) &&
                 !memmem(text, n, "<unk>", 5);
    if (!add_special && (kind == BYTE_LEVEL || (kind == SP_BPE && plain)))
        FUZZ_CHECK(len == n && memcmp(back, text, n) == 0, "decode(encode(x)) != x (%zu vs %zu bytes)", len, n);
    free(back);
    free(ids.ids);
}

static void fuzz_decode(const tokenizer *t, enum kind kind, const uint8_t *data, size_t size, bool skip)
{
    size_t n = size / 2;
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    int vocab = tokenizer_vocab_size(t);
    bool in_range = true;
    for (size_t i = 0; i < n; i++) {
        unsigned v = data[2 * i] | (unsigned)data[2 * i + 1] << 8;
        /* mostly inside the vocabulary, sometimes just past it or negative */
        ids[i] = v < 0xFF00 ? (int32_t)(v % (unsigned)(vocab + 2)) : -(int32_t)(v & 0xFF);
        in_range &= ids[i] >= 0 && ids[i] < vocab;
    }
    char *out = NULL;
    size_t len = 0;
    enum text_status st = tokenizer_decode(t, ids, n, skip, &out, &len);
    if (!in_range) {
        FUZZ_CHECK(st == TEXT_EINVAL && !out, "an id out of range decoded (%d)", st);
        free(ids);
        return;
    }
    free(out);
    out = decode(t, ids, n, skip, &len);
    check_stream(t, ids, n, skip, out, len);
    if (kind == BYTE_LEVEL && !skip) {
        struct tok_ids again = {0};
        char err[TEXT_ERR_LEN];
        FUZZ_CHECK(tokenizer_encode(t, out, len, false, &again, err) == TEXT_OK, "decoded text refused: %s", err);
        size_t len2;
        char *out2 = decode(t, again.ids, again.n, false, &len2);
        FUZZ_CHECK(len2 == len && memcmp(out, out2, len) == 0, "decode(encode(decode(ids))) != decode(ids)");
        free(out2);
        free(again.ids);
    }
    free(out);
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > 1 << 14)
        return 0;
    unsigned mode = data[0];
    enum kind kind = mode & 8 ? UNIGRAM : mode & 1 ? SP_BPE : BYTE_LEVEL;
    if (mode & 2)
        fuzz_decode(toks[kind], kind, data + 1, size - 1, mode & 4);
    else
        fuzz_encode(toks[kind], kind, (const char *)data + 1, size - 1, mode & 4);
    return 0;
}
