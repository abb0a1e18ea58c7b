/* test_tokenizer.c - the tokenizer on small hand-built tokenizer.json files
 * (merges, ignore_merges, byte_fallback, added tokens, NFC, Split behaviours, BOS rules,
 * malformed files, invalid UTF-8, streaming decode; Unigram's Viterbi and the Precompiled charsmap).
 *
 * With KVTIER_TOKENIZER_ORACLE=expected.json (written by
 * tests/tokenizer/oracle.mjs, run by tests/tokenizer.test.sh) it instead
 * checks every corpus case against the real tokenizers' ids and decodes.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "text/tokenizer.h"
#include "text/tokenizer_internal.h"

/* ---- building tokenizer directories ---------------------------------------- */

static void write_file(const char *dir, const char *name, const char *text)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_int_equal(fputs(text, f) >= 0, 1);
    assert_int_equal(fclose(f), 0);
}

/* Loads a tokenizer from tokenizer.json text (and tokenizer_config.json
 * text unless NULL) written to a fresh temporary directory. */
static enum text_status load_text(const char *json, const char *config, tokenizer **t, char *err)
{
    char dir[] = "/tmp/kvtier-tok-XXXXXX";
    char path[256];
    assert_non_null(mkdtemp(dir));
    write_file(dir, "tokenizer.json", json);
    if (config)
        write_file(dir, "tokenizer_config.json", config);
    err[0] = '\0';
    enum text_status st = tokenizer_load(dir, t, err);
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    unlink(path);
    rmdir(dir);
    return st;
}

/* As load_text, from JSON objects (both consumed; config may be NULL). */
static tokenizer *load_json(json_t *root, json_t *config)
{
    char err[TEXT_ERR_LEN];
    tokenizer *t = NULL;
    /* ASCII-only output: every non-ASCII piece goes through \u escapes. */
    char *json = json_dumps(root, JSON_ENSURE_ASCII), *cfg = config ? json_dumps(config, 0) : NULL;
    assert_non_null(json);
    enum text_status st = load_text(json, cfg, &t, err);
    if (st != TEXT_OK)
        fail_msg("tokenizer_load: %s (%s)", text_strerror(st), err);
    free(json);
    free(cfg);
    json_decref(root);
    json_decref(config);
    return t;
}

/* A byte-level BPE: ids 0..255 are the byte symbols, 256 + i the result of
 * merges[i] (written in the byte-level alphabet, "Ġ" for a space). */
static json_t *byte_level_json(const char *const *merges, size_t n_merges)
{
    json_t *vocab = json_object(), *m = json_array();
    for (unsigned b = 0; b < 256; b++) {
        char s[5];
        s[tok_utf8_put(tok_byte_to_cp(b), s)] = '\0';
        json_object_set_new(vocab, s, json_integer(b));
    }
    for (size_t i = 0; i < n_merges; i++) {
        char joined[64];
        const char *sp = strchr(merges[i], ' ');
        snprintf(joined, sizeof joined, "%.*s%s", (int)(sp - merges[i]), merges[i], sp + 1);
        json_object_set_new(vocab, joined, json_integer((json_int_t)(256 + i)));
        json_array_append_new(m, json_string(merges[i]));
    }
    return json_pack("{s:{s:s, s:o, s:o}, s:{s:s, s:b, s:b}, s:{s:s}}", "model", "type", "BPE", "vocab", vocab,
                     "merges", m, "pre_tokenizer", "type", "ByteLevel", "add_prefix_space", 0, "use_regex", 1,
                     "decoder", "type", "ByteLevel");
}

static const char *const HELLO_MERGES[] = {"l l", "h e", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "a a"};
enum { M_LL = 256, M_HE, M_HELL, M_HELLO, M_GW, M_OR, M_GWOR, M_LD, M_AA, N_HELLO_MERGES = 9 };

/* A SentencePiece-style BPE in Llama-2's layout: <unk> <s> </s>, the 256
 * <0xNN> tokens (ids 3..258), then pieces[] from id 259. */
static json_t *sentencepiece_json(const char *const *pieces, size_t n, json_t *merges)
{
    json_t *vocab = json_pack("{s:i, s:i, s:i}", "<unk>", 0, "<s>", 1, "</s>", 2);
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        json_object_set_new(vocab, name, json_integer(3 + b));
    }
    for (size_t i = 0; i < n; i++)
        json_object_set_new(vocab, pieces[i], json_integer((json_int_t)(259 + i)));
    return json_pack(
        "{s:{s:s, s:o, s:o, s:s, s:b, s:b}, s:[{s:i, s:s, s:b}, {s:i, s:s, s:b}, {s:i, s:s, s:b}],"
        " s:{s:s, s:[{s:s, s:s}, {s:s, s:{s:s}, s:s}]},"
        " s:{s:s, s:[{s:{s:s, s:i}}, {s:{s:s, s:i}}], s:{s:{s:s, s:[i]}}},"
        " s:{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s}, {s:s}, {s:s, s:s, s:i, s:i}]}}",
        "model", "type", "BPE", "vocab", vocab, "merges", merges, "unk_token", "<unk>", "byte_fallback", 1, "fuse_unk",
        1, "added_tokens", "id", 0, "content", "<unk>", "special", 1, "id", 1, "content", "<s>", "special", 1, "id", 2,
        "content", "</s>", "special", 1, "normalizer", "type", "Sequence", "normalizers", "type", "Prepend",
        "prepend", "\u2581", "type", "Replace", "pattern", "String", " ", "content", "\u2581", "post_processor",
        "type", "TemplateProcessing", "single", "SpecialToken", "id", "<s>", "type_id", 0, "Sequence", "id", "A",
        "type_id", 0, "special_tokens", "<s>", "id", "<s>", "ids", 1, "decoder", "type", "Sequence", "decoders", "type",
        "Replace", "pattern", "String", "\u2581", "content", " ", "type", "ByteFallback", "type", "Fuse", "type",
        "Strip", "content", " ", "start", 1, "stop", 0);
}

static const char *const SP_PIECES[] = {"\u2581", "a", "b", "\u2581a", "ab", "\u2581ab", "\u2581\u2581", "\U0001F600"};
enum { SP_SPACE = 259, SP_A, SP_B, SP_SA, SP_AB, SP_SAB, SP_SS, SP_SMILE, N_SP_PIECES = 8 };

static json_t *sp_merges(void)
{
    return json_pack("[s, s, s, [s, s]]", "\u2581 a", "a b", "\u2581a b", "\u2581", "\u2581");
}

/* ---- encode / decode helpers ------------------------------------------------- */

static struct tok_ids encode(const tokenizer *t, const char *text, bool add_special)
{
    struct tok_ids ids = {0};
    char err[TEXT_ERR_LEN];
    enum text_status st = tokenizer_encode(t, text, strlen(text), add_special, &ids, err);
    if (st != TEXT_OK)
        fail_msg("encode \"%s\": %s (%s)", text, text_strerror(st), err);
    return ids;
}

static void expect_ids(const tokenizer *t, const char *text, bool add_special, const int32_t *want, size_t n)
{
    struct tok_ids ids = encode(t, text, add_special);
    if (ids.n != n || (n && memcmp(ids.ids, want, n * sizeof *want) != 0)) {
        char got[512];
        size_t k = 0;
        for (size_t i = 0; i < ids.n && k < sizeof got - 16; i++)
            k += (size_t)snprintf(got + k, sizeof got - k, " %d", ids.ids[i]);
        got[k] = '\0';
        fail_msg("encode \"%s\": got%s (%zu ids, want %zu)", text, got, ids.n, n);
    }
    free(ids.ids);
}
#define EXPECT_IDS(t, text, special, ...)                                                                          \
    do {                                                                                                             \
        const int32_t want_[] = {__VA_ARGS__};                                                                       \
        expect_ids(t, text, special, want_, sizeof want_ / sizeof want_[0]);                                         \
    } while (0)

static char *decode(const tokenizer *t, const int32_t *ids, size_t n, bool skip)
{
    char *s = NULL;
    size_t len = 0;
    assert_int_equal(tokenizer_decode(t, ids, n, skip, &s, &len), TEXT_OK);
    assert_int_equal(strlen(s), len);
    return s;
}

static void expect_decode(const tokenizer *t, const int32_t *ids, size_t n, bool skip, const char *want)
{
    char *s = decode(t, ids, n, skip);
    assert_string_equal(s, want);
    free(s);
}

static bool valid_utf8(const char *s, size_t n)
{
    uint32_t cp;
    for (size_t i = 0, l; i < n; i += l)
        if (!(l = tok_utf8_next((const unsigned char *)s + i, n - i, &cp)))
            return false;
    return true;
}

/* Feeds ids one at a time (64-byte buffer, retried larger when the decoder
 * asks), checks every chunk is whole UTF-8 and returns the concatenation. */
static char *decode_streamed(const tokenizer *t, const int32_t *ids, size_t n, bool skip)
{
    struct tok_stream st = {0};
    size_t len = 0, cap = 64;
    char *all = malloc(1), *chunk = malloc(cap);
    assert_non_null(all);
    assert_non_null(chunk);
    for (size_t i = 0; i < n; i++) {
        size_t k = tokenizer_decode_stream(t, &st, ids[i], skip, chunk, cap);
        if (k > cap) {
            cap = k;
            chunk = realloc(chunk, cap);
            assert_non_null(chunk);
            assert_int_equal(tokenizer_decode_stream(t, &st, ids[i], skip, chunk, cap), k);
        }
        if (!valid_utf8(chunk, k))
            fail_msg("stream chunk %zu (id %d) is not whole UTF-8", i, ids[i]);
        all = realloc(all, len + k + 1);
        assert_non_null(all);
        memcpy(all + len, chunk, k);
        len += k;
    }
    all = realloc(all, len + 4);
    assert_non_null(all);
    len += tokenizer_decode_flush(&st, all + len, 3);
    all[len] = '\0';
    free(chunk);
    return all;
}

/* decode(encode(text)) == want, whole and streamed. */
static void expect_round_trip(const tokenizer *t, const char *text, const char *want)
{
    struct tok_ids ids = encode(t, text, true);
    char *whole = decode(t, ids.ids, ids.n, true), *streamed = decode_streamed(t, ids.ids, ids.n, true);
    assert_string_equal(whole, want);
    assert_string_equal(streamed, want);
    free(whole);
    free(streamed);
    free(ids.ids);
}

/* ---- unit tests ---------------------------------------------------------------- */

static void test_byte_level_merges(void **state)
{
    (void)state;
    tokenizer *t = load_json(byte_level_json(HELLO_MERGES, N_HELLO_MERGES), NULL);
    assert_int_equal(tokenizer_vocab_size(t), 256 + N_HELLO_MERGES);
    assert_int_equal(tokenizer_bos_id(t), -1);
    EXPECT_IDS(t, "hello world", true, M_HELLO, M_GWOR, M_LD);
    /* Equal ranks merge leftmost first. */
    EXPECT_IDS(t, "aaa", true, M_AA, 'a');
    EXPECT_IDS(t, "aaaa", true, M_AA, M_AA);
    /* The GPT-2 regex splits " hello" from "!!" and keeps the space with the word. */
    EXPECT_IDS(t, "!! hello", true, '!', '!', ' ', M_HELLO);
    expect_round_trip(t, "hello world \n\t 日本 🤷\u200d♂️", "hello world \n\t 日本 🤷\u200d♂️");
    EXPECT_IDS(t, "hell", true, M_HELL);
    tokenizer_free(t);
}

static void test_ignore_merges(void **state)
{
    (void)state;
    /* "hellod" is a vocab entry no merge sequence reaches. */
    json_t *j = byte_level_json(HELLO_MERGES, N_HELLO_MERGES);
    json_object_set_new(json_object_get(json_object_get(j, "model"), "vocab"), "hellod", json_integer(300));
    tokenizer *plain = load_json(json_deep_copy(j), NULL);
    json_object_set_new(json_object_get(j, "model"), "ignore_merges", json_true());
    tokenizer *ignore = load_json(j, NULL);
    EXPECT_IDS(plain, "hellod", true, M_HELLO, 'd');
    EXPECT_IDS(ignore, "hellod", true, 300);
    EXPECT_IDS(ignore, "hello", true, M_HELLO);
    tokenizer_free(plain);
    tokenizer_free(ignore);
}

static void test_sentencepiece_byte_fallback(void **state)
{
    (void)state;
    tokenizer *t = load_json(sentencepiece_json(SP_PIECES, N_SP_PIECES, sp_merges()), NULL);
    assert_int_equal(tokenizer_bos_id(t), 1);
    /* "ü" is not in the vocabulary: its two UTF-8 bytes become <0xC3> <0xBC>. */
    EXPECT_IDS(t, "ab a\u00fc", true, 1, SP_SAB, SP_SA, 3 + 0xC3, 3 + 0xBC);
    EXPECT_IDS(t, "ab a\u00fc", false, SP_SAB, SP_SA, 3 + 0xC3, 3 + 0xBC);
    EXPECT_IDS(t, "  b", true, 1, SP_SS, SP_SPACE, SP_B);
    EXPECT_IDS(t, "a\U0001F600", true, 1, SP_SA, SP_SMILE); /* a surrogate pair in the file */
    expect_round_trip(t, "ab a\u00fc 日本", "ab a\u00fc 日本");
    expect_round_trip(t, "  leading", "  leading");
    /* Without skipping, <s> is printed and the first space still goes. */
    const int32_t ids[] = {1, SP_SA, SP_B};
    expect_decode(t, ids, 3, false, "<s> ab");
    expect_decode(t, ids, 3, true, "ab");
    tokenizer_free(t);
}

static void test_metaspace_layout(void **state)
{
    (void)state;
    /* The older layout: no normaliser, a Metaspace pre-tokenizer. */
    json_t *j = sentencepiece_json(SP_PIECES, N_SP_PIECES, sp_merges());
    json_object_set_new(j, "normalizer", json_null());
    json_object_set_new(j, "pre_tokenizer", json_pack("{s:s, s:s, s:s, s:b}", "type", "Metaspace", "replacement",
                                                      "\u2581", "prepend_scheme", "first", "split", 0));
    json_t *split = json_deep_copy(j);
    json_object_set_new(json_object_get(split, "pre_tokenizer"), "split", json_true());
    tokenizer *t = load_json(j, NULL), *ts = load_json(split, NULL);
    EXPECT_IDS(t, "ab a\u00fc", true, 1, SP_SAB, SP_SA, 3 + 0xC3, 3 + 0xBC);
    /* Unlike Prepend, no "▁" is added to text that starts with a space. */
    EXPECT_IDS(t, "  b", true, 1, SP_SS, SP_B);
    /* Split before each "▁": "▁▁b" becomes "▁" "▁b", and "▁▁" cannot form. */
    EXPECT_IDS(ts, "  b", true, 1, SP_SPACE, SP_SPACE, SP_B);
    expect_round_trip(t, "a b  ab", "a b  ab");
    tokenizer_free(t);
    tokenizer_free(ts);
}

/* A BPE without merges that looks whole pieces up (ignore_merges): a piece
 * in vocab[] is one id (its index), anything else one id per character,
 * so the ids show where the Split pre-tokenizer cut the text. */
static tokenizer *split_tokenizer(const char *kind, const char *pattern, const char *behavior, bool invert,
                                  const char *const *vocab, size_t n)
{
    json_t *v = json_object();
    for (size_t i = 0; i < n; i++)
        json_object_set_new(v, vocab[i], json_integer((json_int_t)i));
    return load_json(json_pack("{s:{s:s, s:o, s:[], s:b}, s:{s:s, s:{s:s}, s:s, s:b}}", "model", "type", "BPE",
                               "vocab", v, "merges", "ignore_merges", 1, "pre_tokenizer", "type", "Split",
                               "pattern", kind, pattern, "behavior", behavior, "invert", invert),
                     NULL);
}

static void test_split_behaviors(void **state)
{
    (void)state;
    /* Hugging Face's own examples: "-" as a String delimiter ... */
    static const char *const dash[] = {"t", "h", "e", "-", "f", "i", "n", "a", "l", "c", "o", "u", "w",
                                       "the", "final", "countdown", "the-", "final-", "-final", "-countdown", "--"};
    enum { THE = 13, FINAL, COUNTDOWN, THE_, FINAL_, _FINAL, _COUNTDOWN, DASHES, DASH = 3 };
    const size_t nd = sizeof dash / sizeof dash[0];
    const char *text = "the-final--countdown";
    tokenizer *t = split_tokenizer("String", "-", "Removed", false, dash, nd);
    EXPECT_IDS(t, text, false, THE, FINAL, COUNTDOWN);
    tokenizer_free(t);
    t = split_tokenizer("String", "-", "Isolated", false, dash, nd);
    EXPECT_IDS(t, text, false, THE, DASH, FINAL, DASH, DASH, COUNTDOWN);
    tokenizer_free(t);
    t = split_tokenizer("String", "-", "MergedWithPrevious", false, dash, nd);
    EXPECT_IDS(t, text, false, THE_, FINAL_, DASH, COUNTDOWN);
    EXPECT_IDS(t, "-the", false, DASH, THE); /* nothing before the first delimiter */
    tokenizer_free(t);
    t = split_tokenizer("String", "-", "MergedWithNext", false, dash, nd);
    EXPECT_IDS(t, text, false, THE, _FINAL, DASH, _COUNTDOWN);
    EXPECT_IDS(t, "the-", false, THE, DASH); /* nothing after the last one */
    tokenizer_free(t);
    t = split_tokenizer("String", "-", "Contiguous", false, dash, nd);
    EXPECT_IDS(t, text, false, THE, DASH, FINAL, DASHES, COUNTDOWN);
    tokenizer_free(t);
    /* ... and an inverted regex: the words are the pattern, the spaces
     * between them the delimiters (and "doing?" two matches in a row). */
    static const char *const words[] = {" ",     "?",     "How",   "are",    "you",  "doing",   "How ",
                                        "are ",  "you ",  " are",  " you",   " doing", "doing?"};
    enum { SP, QM, HOW, ARE, YOU, DOING, HOW_, ARE_, YOU_, _ARE, _YOU, _DOING, DOINGQ };
    const size_t nw = sizeof words / sizeof words[0];
    const char *q = "How are you doing?", *re = "\\w+|[^\\w\\s]+";
    t = split_tokenizer("Regex", re, "Removed", true, words, nw);
    EXPECT_IDS(t, q, false, HOW, ARE, YOU, DOING, QM);
    tokenizer_free(t);
    t = split_tokenizer("Regex", re, "Isolated", true, words, nw);
    EXPECT_IDS(t, q, false, HOW, SP, ARE, SP, YOU, SP, DOING, QM);
    tokenizer_free(t);
    t = split_tokenizer("Regex", re, "MergedWithPrevious", true, words, nw);
    EXPECT_IDS(t, q, false, HOW_, ARE_, YOU_, DOING, QM);
    tokenizer_free(t);
    t = split_tokenizer("Regex", re, "MergedWithNext", true, words, nw);
    EXPECT_IDS(t, q, false, HOW, _ARE, _YOU, _DOING, QM);
    tokenizer_free(t);
    t = split_tokenizer("Regex", re, "Contiguous", true, words, nw);
    EXPECT_IDS(t, q, false, HOW, SP, ARE, SP, YOU, SP, DOINGQ);
    tokenizer_free(t);
}

static void test_added_tokens(void **state)
{
    (void)state;
    json_t *j = byte_level_json(HELLO_MERGES, N_HELLO_MERGES);
    json_object_set_new(j, "added_tokens",
                        json_pack("[{s:i, s:s, s:b}, {s:i, s:s, s:b}, {s:i, s:s, s:b}, {s:i, s:s, s:b}, {s:i, s:s, "
                                  "s:b}]",
                                  "id", 300, "content", "<|x|>", "special", 1, "id", 301, "content", "<|x|>y",
                                  "special", 0, "id", 302, "content", "[L]", "lstrip", 1, "id", 303, "content", "[R]",
                                  "rstrip", 1, "id", 304, "content", "ab", "single_word", 1));
    tokenizer *t = load_json(j, json_pack("{s:s, s:s}", "bos_token", "<|x|>", "eos_token", "[R]"));
    assert_int_equal(tokenizer_vocab_size(t), 305);
    assert_int_equal(tokenizer_bos_id(t), 300);
    assert_int_equal(tokenizer_eos_id(t), 303);
    /* only the special one is skipped when decoding */
    const int32_t added[] = {300, 301, 'a'};
    expect_decode(t, added, 3, true, "<|x|>ya");
    expect_decode(t, added, 3, false, "<|x|><|x|>ya");
    /* Longest match first; text on both sides is encoded on its own. */
    EXPECT_IDS(t, "h<|x|>y<|x|>he", true, 'h', 301, 300, M_HE);
    EXPECT_IDS(t, "<|x|", true, '<', '|', 'x', '|');
    /* lstrip / rstrip swallow the whitespace beside the token. */
    EXPECT_IDS(t, "a  [L]", true, 'a', 302);
    EXPECT_IDS(t, "[R] \n b", true, 303, 'b');
    EXPECT_IDS(t, "a [R]", true, 'a', tok_cp_to_byte(0x120), 303);
    /* single_word: only where no word character touches it. */
    EXPECT_IDS(t, "ab", true, 304);
    EXPECT_IDS(t, "cab", true, 'c', 'a', 'b');
    const int32_t ids[] = {'h', 300, 301, 'o'};
    expect_decode(t, ids, 4, true, "h<|x|>yo");
    expect_decode(t, ids, 4, false, "h<|x|><|x|>yo");
    tokenizer_free(t);
}

static void test_nfc(void **state)
{
    (void)state;
    json_t *j = byte_level_json(HELLO_MERGES, N_HELLO_MERGES);
    json_object_set_new(j, "normalizer", json_pack("{s:s}", "type", "NFC"));
    tokenizer *t = load_json(j, NULL);
    static const char *const same[][2] = {
        {"e\u0301", "\u00e9"},                    /* composition */
        {"a\u0323\u0302", "\u1ead"},              /* ordered marks compose in order */
        {"a\u0302\u0323", "\u1ead"},              /* canonical reordering first */
        {"\u212b \u2126", "\u00c5 \u03a9"},       /* singletons */
        {"\u1100\u1161\u11a8", "\uac01"},         /* Hangul LVT */
        {"q\u0307\u0323", "q\u0323\u0307"},       /* no composite: reorder only */
    };
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        struct tok_ids a = encode(t, same[i][0], true), b = encode(t, same[i][1], true);
        assert_int_equal(a.n, b.n);
        assert_memory_equal(a.ids, b.ids, a.n * sizeof *a.ids);
        free(a.ids);
        free(b.ids);
    }
    tokenizer_free(t);
}

static void test_bos_rules(void **state)
{
    (void)state;
    json_t *j = byte_level_json(HELLO_MERGES, N_HELLO_MERGES);
    json_object_set_new(j, "added_tokens", json_pack("[{s:i, s:s, s:b}, {s:i, s:s, s:b}]", "id", 300, "content",
                                                     "<bos>", "special", 1, "id", 301, "content", "<eos>", "special",
                                                     1));
    json_t *bare = json_deep_copy(j);
    json_object_set_new(j, "post_processor",
                        json_pack("{s:s, s:[{s:{s:s}}, {s:{s:s}}, {s:{s:s}}], s:{s:{s:[i]}, s:{s:[i]}}}", "type",
                                  "TemplateProcessing", "single", "SpecialToken", "id", "<bos>", "Sequence", "id", "A",
                                  "SpecialToken", "id", "<eos>", "special_tokens", "<bos>", "ids", 300, "<eos>", "ids",
                                  301));
    tokenizer *tpl = load_json(j, NULL);
    EXPECT_IDS(tpl, "he", true, 300, M_HE, 301);
    EXPECT_IDS(tpl, "he", false, M_HE);
    assert_int_equal(tokenizer_bos_id(tpl), 300);
    /* No template: tokenizer_config.json's add_bos_token decides. */
    tokenizer *cfg = load_json(json_deep_copy(bare), json_pack("{s:b, s:s, s:s, s:s}", "add_bos_token", 1,
                                                               "bos_token", "<bos>", "eos_token", "<eos>",
                                                               "chat_template", "{{ messages }}"));
    EXPECT_IDS(cfg, "he", true, 300, M_HE);
    assert_string_equal(json_string_value(tokenizer_chat_template(cfg)), "{{ messages }}");
    /* a list of named templates is kept whole: the chat layer picks default or tool_use */
    tokenizer *named = load_json(json_deep_copy(bare), json_pack("{s:[{s:s,s:s},{s:s,s:s}]}", "chat_template", "name",
                                                                 "default", "template", "D", "name", "tool_use",
                                                                 "template", "T"));
    assert_int_equal(json_array_size(tokenizer_chat_template(named)), 2);
    tokenizer_free(named);
    tokenizer *none = load_json(bare, NULL);
    EXPECT_IDS(none, "he", true, M_HE);
    assert_null(tokenizer_chat_template(none));
    tokenizer_free(tpl);
    tokenizer_free(cfg);
    tokenizer_free(none);
}

/* Each malformed file gives the status and names the field. */
/* ---- Unigram ------------------------------------------------------------------ */

/* A Unigram model over pieces[i] with scores[i] (unk_id 0), no other
 * components. */
static json_t *unigram_json(const char *const *pieces, const double *scores, size_t n, bool byte_fallback)
{
    json_t *vocab = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(vocab, json_pack("[s, f]", pieces[i], scores[i]));
    return json_pack("{s:{s:s, s:i, s:b, s:o}}", "model", "type", "Unigram", "unk_id", 0, "byte_fallback",
                     byte_fallback, "vocab", vocab);
}

static void test_unigram_viterbi(void **state)
{
    (void)state;
    static const char *const pieces[] = {"<unk>", "a", "b", "ab", "abc", "c", "aa", "de", "<0x78>"};
    static const double scores[] = {0, -1, -1, -1.5, -10, -3, -2, -1, -1};
    enum { UNK, A, B, AB, ABC, C, AA, DE, X78 };
    tokenizer *t = load_json(unigram_json(pieces, scores, 9, false), NULL);
    EXPECT_IDS(t, "ab", true, AB);
    /* ab + c (-4.5) beats a + b + c (-5) and abc (-10) */
    EXPECT_IDS(t, "abc", true, AB, C);
    /* Equal totals keep the path found first, as Hugging Face's and
     * SentencePiece's Viterbi: "aa" before a + a; for "aaa", a + aa. */
    EXPECT_IDS(t, "aa", true, AA);
    EXPECT_IDS(t, "aaa", true, A, AA);
    /* Characters no piece covers: one unk per run, however long. */
    EXPECT_IDS(t, "x\u2603yab", true, UNK, AB);
    EXPECT_IDS(t, "axb\u2603\u2603", true, A, UNK, B, UNK);
    /* "d" starts a piece but is no piece: it still gets its unk edge. */
    EXPECT_IDS(t, "dd", true, UNK);
    EXPECT_IDS(t, "dde", true, UNK, DE);
    /* "x" has its byte piece, but byte_fallback is off. */
    EXPECT_IDS(t, "x", true, UNK);
    expect_ids(t, "", true, NULL, 0);
    tokenizer_free(t);

    /* byte_fallback: an unknown run becomes its bytes when every one has a
     * piece; "x\u2603" lacks <0xE2> <0x98> <0x83>, so it stays one unk. */
    t = load_json(unigram_json(pieces, scores, 9, true), NULL);
    EXPECT_IDS(t, "xx", true, X78, X78);
    EXPECT_IDS(t, "axxb", true, A, X78, X78, B);
    EXPECT_IDS(t, "x\u2603", true, UNK);
    tokenizer_free(t);
}

/* A SentencePiece charsmap built by its trainer from the rules A -> a,
 * U+FB01 -> fi, "ab" -> X and c -> "" (a removal). */
static const char RULE_CHARSMAP[] =
    "AAQAAAAAAQBBDQAAAwAAgGIdAAABAACAAAAAgKwAAgCBPQAABQAAgAgAAAALAAAACgAAAA0AAAAMAAAADwAAAA4AAAARAAAAEAAA"
    "ABMAAAASAAAAFQAAABQAAAAXAAAAFgAAABkAAAAYAAAAGwAAABoAAAAdAAAAHAAAAB8AAAAeAAAAIQAAAGEAAQAjAAAAY5kAACUA"
    "AAAkAAAAJwAAACYAAAApAAAAKAAAACsAAAAqAAAALQAAACwAAAAvAAAALgAAADEAAAAwAAAAMwAAADIAAAA1AAAANAAAADcAAAA2"
    "AAAAOQAAADgAAAA7AAAAOgAAAD0AAAA8AAAAPwAAAD4AAABBAAAAQAAAAEMAAABCAAAARQAAAEQAAABHAAAARgAAAEkAAABIAAAA"
    "SwAAAEoAAABNAAAATAAAAE8AAABOAAAAUQAAAFAAAABTAAAAUgAAAFUAAABUAAAAVwAAAFYAAABZAAAAWAAAAFsAAABaAAAAXQAA"
    "AFwAAABfAAAAXgAAAGEAAABgAAAAYwAAAGIAAABlAAAAZAAAAGcAAABmAAAAaQAAAGgAAABrAAAAagAAAG0AAABsAAAAbwAAAG4A"
    "AABxAAAAcAAAAHMAAAByAAAAdQAAAHQAAAB3AAAAdgAAAHkAAAB4AAAAewAAAHoAAAB9AAAAfAAAAH8AAAB+AAAAgQAAAIAAAACD"
    "AAAAggAAAIUAAACEAAAAhwAAAIYAAACJAAAAiAAAAIsAAACKAAAAjQAAAIwAAACPAAAAjgAAAJEAAACQAAAAkwAAAJIAAACVAAAA"
    "lAAAAJcAAACWAAAAmQAAAJgAAACbAAAAmgAAAJ0AAACcAAAAnwAAAJ4AAAChAAAAoAAAAKMAAACiAAAApQAAAKQAAACnAAAApgAA"
    "AKkAAACoAAAAqwAAAKoAAACtAAAArAAAAK8AAADvFAAAsQAAALAAAACzAAAAsgAAALUAAAC0AAAAtwAAALYAAAC5AAAAuAAAALsA"
    "AAC6AAAAvQAAALwAAAC/AAAAvgAAAMEAAADAAAAAwwAAAMIAAADFAAAAxAAAAMcAAADGAAAAyQAAAMgAAADLAAAAygAAAM0AAADM"
    "AAAAzwAAAM4AAADRAAAA0AAAANMAAADSAAAA1QAAANQAAADXAAAA1gAAANkAAADYAAAA2wAAANoAAADdAAAA3AAAAN8AAADeAAAA"
    "4QAAAOAAAADjAAAA4gAAAOUAAADkAAAA5wAAAOYAAADpAAAA6AAAAOsAAADqAAAA7QAAAOwAAADvAAAA7gAAAPEAAADwAAAA8wAA"
    "APIAAAD1AAAA9AAAAPcAAAD2AAAA+QAAAPgAAAD7AAAA+gAAAP0AAAD8AAAA/wAAAP4AAAAAWABhAGZpAA==";

static void test_unigram_precompiled(void **state)
{
    (void)state;
    static const char *const pieces[] = {"<unk>", "a", "b", "X", "f", "i", "\u2581", "\u2581X", "</s>"};
    static const double scores[] = {0, -1, -1, -1, -1, -1, -2, -1, 0};
    enum { UNK, A, B, X, F, I, META, META_X, EOS };
    json_t *j = unigram_json(pieces, scores, 9, false);
    json_object_set_new(j, "normalizer",
                        json_pack("{s:s, s:s}", "type", "Precompiled", "precompiled_charsmap", RULE_CHARSMAP));
    tokenizer *t = load_json(json_deep_copy(j), NULL);
    /* The longest rule at each position of the input, never re-applied to
     * its own output: "Ab" is a + b, not X. */
    EXPECT_IDS(t, "Ab", true, A, B);
    EXPECT_IDS(t, "abc", true, X);
    EXPECT_IDS(t, "aab", true, A, X);
    EXPECT_IDS(t, "\ufb01", true, F, I);
    expect_ids(t, "ccc", true, NULL, 0); /* all removed */
    EXPECT_IDS(t, "a\u00e9", true, A, UNK);
    tokenizer_free(t);

    /* T5's layout: WhitespaceSplit, then Metaspace on each word, "</s>"
     * appended, the Metaspace decoder. */
    json_object_set_new(j, "pre_tokenizer",
                        json_pack("{s:s, s:[{s:s}, {s:s, s:s, s:b}]}", "type", "Sequence", "pretokenizers", "type",
                                  "WhitespaceSplit", "type", "Metaspace", "replacement", "\u2581", "add_prefix_space",
                                  1));
    json_object_set_new(j, "post_processor",
                        json_pack("{s:s, s:[{s:{s:s}}, {s:{s:s}}], s:{s:{s:[i]}}}", "type", "TemplateProcessing",
                                  "single", "Sequence", "id", "A", "SpecialToken", "id", "</s>", "special_tokens",
                                  "</s>", "ids", EOS));
    json_object_set_new(j, "added_tokens", json_pack("[{s:i, s:s, s:b}]", "id", EOS, "content", "</s>", "special", 1));
    json_object_set_new(j, "decoder",
                        json_pack("{s:s, s:s, s:b}", "type", "Metaspace", "replacement", "\u2581",
                                  "add_prefix_space", 1));
    t = load_json(json_deep_copy(j), NULL);
    EXPECT_IDS(t, "  abc \t Ab  ", true, META_X, META, A, B, EOS);
    EXPECT_IDS(t, "abc</s>", false, META_X, EOS);
    expect_round_trip(t, " abc\t\tab ", "X X");
    tokenizer_free(t);

    /* The converter's later layout: Strip and a Regex Replace of space
     * runs after the charsmap, Metaspace alone.  A text the charsmap
     * empties stays empty through the rest. */
    json_t *later = json_deep_copy(j);
    json_object_set_new(later, "normalizer",
                        json_pack("{s:s, s:[{s:s, s:s}, {s:s, s:b, s:b}, {s:s, s:{s:s}, s:s}]}", "type", "Sequence",
                                  "normalizers", "type", "Precompiled", "precompiled_charsmap", RULE_CHARSMAP, "type",
                                  "Strip", "strip_left", 0, "strip_right", 1, "type", "Replace", "pattern", "Regex",
                                  " {2,}", "content", "\u2581"));
    json_object_set_new(later, "pre_tokenizer",
                        json_pack("{s:s, s:s, s:s, s:b}", "type", "Metaspace", "replacement", "\u2581",
                                  "prepend_scheme", "always", "split", 1));
    t = load_json(later, NULL);
    EXPECT_IDS(t, "abc   Ab  ", false, META_X, META, A, B);
    expect_ids(t, "c", false, NULL, 0);
    expect_ids(t, "cc  ", false, NULL, 0);
    tokenizer_free(t);

    /* "first": only the text's first word gets the replacement. */
    json_object_set_new(json_array_get(json_object_get(json_object_get(j, "pre_tokenizer"), "pretokenizers"), 1),
                        "prepend_scheme", json_string("first"));
    t = load_json(j, NULL);
    EXPECT_IDS(t, "abc abc", false, META_X, X);
    tokenizer_free(t);
}

/* a Unigram tokenizer.json with this vocab, or with a Precompiled normaliser
 * whose members follow "type" */
#define UNIGRAM_VOCAB(v) "{\"model\": {\"type\": \"Unigram\", \"unk_id\": 0, \"vocab\": " v "}}"
#define PRECOMPILED(m) UNIGRAM_VOCAB("[[\"a\", 0]]}, \"normalizer\": {\"type\": \"Precompiled\"" m)

static void test_malformed(void **state)
{
    (void)state;
    static const struct {
        const char *json, *config;
        enum text_status st;
        const char *msg;
    } cases[] = {
        {"{}", NULL, TEXT_EFORMAT, "model is missing"},
        {"[1, 2]", NULL, TEXT_EFORMAT, "not a JSON object"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0", NULL, TEXT_EFORMAT, "tokenizer.json:1:"},
        {"{\"model\": {\"type\": \"BPE\"}}", NULL, TEXT_EFORMAT, "model.vocab is missing"},
        {"{\"model\": {\"vocab\": {\"a\": -1}}}", NULL, TEXT_EFORMAT, "model.vocab[\"a\"]"},
        {"{\"model\": {\"vocab\": {\"a\": 99999999}}}", NULL, TEXT_EFORMAT, "model.vocab[\"a\"]"},
        {"{\"model\": {\"vocab\": {\"a\": \"0\"}}}", NULL, TEXT_EFORMAT, "model.vocab[\"a\"]"},
        {"{\"model\": {\"vocab\": {\"a\": 0, \"b\": 0}}}", NULL, TEXT_EFORMAT, "id 0 is given to both"},
        {"{\"model\": {\"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b c\"]}}", NULL, TEXT_EFORMAT,
         "model.merges[0]"},
        {"{\"model\": {\"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\", \"a z\"]}}", NULL,
         TEXT_EFORMAT, "model.merges[1]: \"z\""},
        {"{\"model\": {\"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [\"a b\"]}}", NULL, TEXT_EFORMAT,
         "model.merges[0]: \"ab\""},
        {"{\"model\": {\"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [[\"a\"]]}}", NULL, TEXT_EFORMAT,
         "model.merges[0]"},
        {"{\"model\": {\"vocab\": {\"a\": 0}, \"merges\": 5}}", NULL, TEXT_EFORMAT, "model.merges is not an array"},
        {"{\"model\": {\"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"\", \"a b\"]}}", NULL,
         TEXT_EFORMAT, "model.merges[0] \"\" is not two pieces"},
        {"{\"model\": {\"vocab\": {\"a\": 0}, \"unk_token\": \"<unk>\"}}", NULL, TEXT_EFORMAT, "model.unk_token"},
        {"{\"model\": {\"type\": \"WordPiece\", \"vocab\": {\"a\": 0}}}", NULL, TEXT_EUNSUPPORTED, "model.type"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}, \"added_tokens\": [{\"id\": 99999999, \"content\": \"x\"}]}", NULL,
         TEXT_EFORMAT, "added_tokens.id[0]"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}, \"added_tokens\": [{\"id\": 1}]}", NULL, TEXT_EFORMAT,
         "added_tokens[0].content is missing"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}, \"normalizer\": {\"type\": \"NFKC\"}}", NULL, TEXT_EUNSUPPORTED,
         "normalizer.type \"NFKC\""},
        {"{\"model\": {\"vocab\": {\"a\": 0}}, \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": "
         "\"Lowercase\"}]}}",
         NULL, TEXT_EUNSUPPORTED, "normalizer.normalizers[0].type"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}, \"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": "
         "\"(\"}, \"behavior\": \"Isolated\"}}",
         NULL, TEXT_EUNSUPPORTED, "pre_tokenizer.pattern"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}, \"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": "
         "\"a\"}, \"behavior\": \"Merged\"}}",
         NULL, TEXT_EUNSUPPORTED, "behavior \"Merged\" is not one of"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}, \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": "
         "[{\"SpecialToken\": {\"id\": \"<s>\"}}, {\"Sequence\": {\"id\": \"A\"}}], \"special_tokens\": {}}}",
         NULL, TEXT_EFORMAT, "special_tokens[\"<s>\"]"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}, \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": "
         "[{\"SpecialToken\": {\"id\": \"<s>\"}}, {\"Sequence\": {\"id\": \"A\"}}], \"special_tokens\": {\"<s>\": "
         "{\"ids\": [7]}}}}",
         NULL, TEXT_EFORMAT, "id 7 out of range"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}, \"decoder\": {\"type\": \"Strip\", \"content\": \" \", \"start\": 2, "
         "\"stop\": 0}}",
         NULL, TEXT_EUNSUPPORTED, "decoder"},
        {"{\"model\": {\"vocab\": {\"a\x01\": 0}}}", NULL, TEXT_EFORMAT, "model.vocab: expected no control character"},
        {"{\"model\": {\"vocab\": {\"\\ud800\": 0}}}", NULL, TEXT_EFORMAT, "expected a low surrogate"},
        {"{\"model\": {\"vocab\": {\"\\q\": 0}}}", NULL, TEXT_EFORMAT, "expected a valid escape"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}} x", NULL, TEXT_EFORMAT, "text after the top-level object"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}, \"decoder\": {\"type\": }}", NULL, TEXT_EFORMAT, "decoder:"},
        {"{\"model\": {\"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\" \"a b\"]}}", NULL,
         TEXT_EFORMAT, "tokenizer.json:1:"},
        {"{\"model\": {\"type\": \"Unigram\", \"vocab\": [[\"a\", 0]]}}", NULL, TEXT_EFORMAT,
         "model.unk_id is missing"},
        {"{\"model\": {\"type\": \"Unigram\", \"unk_id\": 1, \"vocab\": [[\"a\", 0]]}}", NULL, TEXT_EFORMAT,
         "model.unk_id is missing or not an id in [0, 0]"},
        {UNIGRAM_VOCAB("{\"a\": 0}"), NULL, TEXT_EFORMAT, "model.vocab is missing or not an array"},
        {UNIGRAM_VOCAB("[[\"a\"]]"), NULL, TEXT_EFORMAT, "model.vocab[0] is not [piece, finite score]"},
        {UNIGRAM_VOCAB("[[\"a\", 0], [\"b\", 1e400]]"), NULL,
         TEXT_EFORMAT, "model.vocab[1] is not [piece, finite score]"},
        {UNIGRAM_VOCAB("[[\"a\", \"0\"]]"), NULL, TEXT_EFORMAT, "model.vocab[0] is not [piece, finite score]"},
        {UNIGRAM_VOCAB("[[\"a\", 0, 1]]"), NULL, TEXT_EFORMAT, "model.vocab[0] is not [piece, finite score]"},
        {UNIGRAM_VOCAB("[[\"a\", -1e7]]"), NULL, TEXT_EFORMAT, "model.vocab[0]: score -1e+07 is outside"},
        {UNIGRAM_VOCAB("[[\"\", 0]]"), NULL, TEXT_EFORMAT, "model.vocab[0]: the piece is empty"},
        {UNIGRAM_VOCAB("[[\"a\", 0], [\"a\", -1]]"), NULL, TEXT_EFORMAT, "model.vocab: \"a\" appears twice"},
        {UNIGRAM_VOCAB("[]"), NULL, TEXT_EFORMAT, "model.vocab is empty"},
        {PRECOMPILED(""), NULL, TEXT_EFORMAT, "normalizer.precompiled_charsmap is missing"},
        {PRECOMPILED(", \"precompiled_charsmap\": \"!!!!\""), NULL, TEXT_EFORMAT, "precompiled_charsmap is not base64"},
        {PRECOMPILED(", \"precompiled_charsmap\": \"AAAA\""), NULL, TEXT_EFORMAT, "the trie size 0 does not fit"},
        {PRECOMPILED(", \"precompiled_charsmap\": \"CAAAAAAAAAA=\""), NULL,
         TEXT_EFORMAT, "the trie size 8 does not fit"},
        {PRECOMPILED(", \"precompiled_charsmap\": \"BgAAAAAAAAAAAAAA\""), NULL, TEXT_EFORMAT, "the trie size 6"},
        {PRECOMPILED(", \"precompiled_charsmap\": \"BAAAAAAAAABhYg==\""), NULL, TEXT_EFORMAT, "do not end with NUL"},
        {PRECOMPILED(", \"precompiled_charsmap\": \"BAAAAAAAAAD/AA==\""), NULL,
         TEXT_EFORMAT, "replacement byte 0 is not UTF-8"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}}", "{\"bos_token\": \"<s>\"}", TEXT_EFORMAT,
         "tokenizer_config.json: bos_token \"<s>\""},
        {"{\"model\": {\"vocab\": {\"a\": 0}}}", "{\"bos_token\": 5}", TEXT_EFORMAT,
         "tokenizer_config.json: bos_token is not a string"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}}", "{\"add_bos_token\": ", TEXT_EFORMAT, "tokenizer_config.json:1:"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}}", "{\"chat_template\": [{\"name\": \"default\"}]}", TEXT_EFORMAT,
         "chat_template is neither"},
        {"{\"model\": {\"vocab\": {\"a\": 0}}}", "{\"chat_template\": 7}", TEXT_EFORMAT,
         "tokenizer_config.json: chat_template is neither"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char err[TEXT_ERR_LEN];
        tokenizer *t = (tokenizer *)&err; /* must come back NULL */
        enum text_status st = load_text(cases[i].json, cases[i].config, &t, err);
        if (st != cases[i].st || !strstr(err, cases[i].msg) || t)
            fail_msg("case %zu: got %s \"%s\", want %s \"%s\"", i, text_strerror(st), err, text_strerror(cases[i].st), cases[i].msg);
    }
    char err[TEXT_ERR_LEN];
    tokenizer *t;
    assert_int_equal(tokenizer_load("/nonexistent/kvtier", &t, err), TEXT_ENOENT);
    assert_non_null(strstr(err, "/nonexistent/kvtier/tokenizer.json"));
    assert_null(t);
    tokenizer_free(NULL);
}

static void test_invalid_utf8(void **state)
{
    (void)state;
    tokenizer *t = load_json(byte_level_json(HELLO_MERGES, N_HELLO_MERGES), NULL);
    static const struct {
        const char *text;
        size_t len, offset;
    } cases[] = {
        {"\xff", 1, 0},              {"ab\xc3", 3, 2},          /* truncated */
        {"a\xed\xa0\x80", 4, 1},     /* surrogate */           {"\xc0\xaf", 2, 0}, /* overlong */
        {"xyz\xf4\x90\x80\x80", 7, 3}, /* above U+10FFFF */     {"ok\x80", 3, 2},   /* stray continuation */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char err[TEXT_ERR_LEN], want[64];
        struct tok_ids ids = {0};
        assert_int_equal(tokenizer_encode(t, "he", 2, false, &ids, err), TEXT_OK);
        assert_int_equal(tokenizer_encode(t, cases[i].text, cases[i].len, true, &ids, err), TEXT_EINVAL);
        snprintf(want, sizeof want, "offset %zu", cases[i].offset);
        if (!strstr(err, want))
            fail_msg("case %zu: \"%s\" does not name %s", i, err, want);
        assert_int_equal(ids.n, 1); /* unchanged beyond its old length */
        free(ids.ids);
    }
    /* Embedded NUL is a character like any other. */
    struct tok_ids ids = {0};
    char err[TEXT_ERR_LEN];
    assert_int_equal(tokenizer_encode(t, "a\0b", 3, true, &ids, err), TEXT_OK);
    assert_int_equal(ids.n, 3);
    free(ids.ids);
    tokenizer_free(t);
}

static void test_stream_decode(void **state)
{
    (void)state;
    tokenizer *t = load_json(byte_level_json(HELLO_MERGES, N_HELLO_MERGES), NULL);
    /* Byte symbols only: every multi-byte character is split over tokens. */
    const char *text = "\u65e5\u00e9\U0001F937\u200d\u2642\ufe0f!";
    struct tok_ids ids = encode(t, text, true);
    assert_int_equal(ids.n, strlen(text));
    char *s = decode_streamed(t, ids.ids, ids.n, true);
    assert_string_equal(s, text);
    free(s);

    /* The first byte of 日 gives nothing and is held back... */
    struct tok_stream st = {0};
    char out[64];
    assert_int_equal(tokenizer_decode_stream(t, &st, ids.ids[0], true, out, sizeof out), 0);
    assert_int_equal(tokenizer_decode_stream(t, &st, ids.ids[1], true, out, sizeof out), 0);
    assert_int_equal(st.n_pending, 2);
    /* ...a buffer too small is told the size and nothing changes... */
    assert_int_equal(tokenizer_decode_stream(t, &st, ids.ids[2], true, out, 2), 3);
    assert_int_equal(st.n_pending, 2);
    /* ...and the third byte completes it. */
    assert_int_equal(tokenizer_decode_stream(t, &st, ids.ids[2], true, out, sizeof out), 3);
    assert_memory_equal(out, "\u65e5", 3);
    assert_int_equal(st.n_pending, 0);
    assert_int_equal(tokenizer_decode_stream(t, &st, -5, true, out, sizeof out), 0);
    free(ids.ids);

    /* A broken sequence becomes one U+FFFD, and so does a character left
     * incomplete at the end (held back by the stream until it ends). */
    const int32_t bad[] = {0xE6, 0x97, 'A', 0xFF, 0xE6};
    expect_decode(t, bad, 5, true, "\ufffdA\ufffd\ufffd");
    char *streamed = decode_streamed(t, bad, 5, true);
    assert_string_equal(streamed, "\ufffdA\ufffd\ufffd");
    free(streamed);
    const int32_t cut[] = {0xE6, 0x97};
    expect_decode(t, cut, 2, true, "\ufffd");
    struct tok_stream fs = {0};
    assert_int_equal(tokenizer_decode_stream(t, &fs, 0xE6, true, out, sizeof out), 0);
    assert_int_equal(tokenizer_decode_flush(&fs, out, 2), 3); /* too small: told, nothing changes */
    assert_int_equal(fs.n_pending, 1);
    assert_int_equal(tokenizer_decode_flush(&fs, out, sizeof out), 3);
    assert_memory_equal(out, "\ufffd", 3);
    assert_int_equal(tokenizer_decode_flush(&fs, out, sizeof out), 0);
    const int32_t out_of_range[] = {'a', 4000};
    char *never = NULL;
    assert_int_equal(tokenizer_decode(t, out_of_range, 2, true, &never, NULL), TEXT_EINVAL);
    assert_null(never);
    expect_decode(t, NULL, 0, true, "");
    tokenizer_free(t);
}

/* ---- the oracle: real tokenizers' ids and decodes -------------------------- */

static json_t *oracle;

static void check_oracle_tokenizer(void **state)
{
    json_t *tj = *state, *corpus = json_object_get(oracle, "corpus");
    const char *name = json_string_value(json_object_get(tj, "name"));
    char err[TEXT_ERR_LEN];
    tokenizer *t;
    enum text_status st = tokenizer_load(json_string_value(json_object_get(tj, "dir")), &t, err);
    if (st != TEXT_OK)
        fail_msg("%s: %s (%s)", name, text_strerror(st), err);
    size_t i, failures = 0, round_trips = 0, skipped = 0;
    json_t *c;
    json_array_foreach(json_object_get(tj, "cases"), i, c) {
        const char *text = json_string_value(json_array_get(corpus, i));
        /* a case the reference is known to get differently (its script says why) */
        if (json_is_true(json_object_get(c, "skip"))) {
            skipped++;
            continue;
        }
        json_t *want = json_object_get(c, "ids");
        struct tok_ids ids = encode(t, text, true);
        bool same = ids.n == json_array_size(want);
        for (size_t k = 0; same && k < ids.n; k++)
            same = ids.ids[k] == json_integer_value(json_array_get(want, k));
        char *skip = decode(t, ids.ids, ids.n, true), *all = decode(t, ids.ids, ids.n, false);
        char *streamed = decode_streamed(t, ids.ids, ids.n, true);
        /* A reference that gives ids only (SentencePiece's decoder renders
         * unk differently) leaves the decodes out. */
        const char *want_skip = json_string_value(json_object_get(c, "decoded_skip"));
        const char *want_all = json_string_value(json_object_get(c, "decoded_all"));
        want_skip = want_skip ? want_skip : skip;
        want_all = want_all ? want_all : all;
        if (!same || strcmp(skip, want_skip) || strcmp(all, want_all) || strcmp(streamed, skip)) {
            failures++;
            print_message("%s case %zu \"%s\":%s%s%s%s\n", name, i, text, same ? "" : " ids differ",
                          strcmp(skip, want_skip) ? " decode differs" : "",
                          strcmp(all, want_all) ? " decode (specials kept) differs" : "",
                          strcmp(streamed, skip) ? " streamed decode differs" : "");
        }
        round_trips += strcmp(skip, text) == 0;
        free(skip);
        free(all);
        free(streamed);
        free(ids.ids);
    }
    print_message("%s: %zu cases, %zu identical, %zu left out, %zu exact round trips\n", name, i,
                  i - failures - skipped, skipped, round_trips);
    tokenizer_free(t);
    assert_int_equal(failures, 0);
}

static int run_oracle(const char *path)
{
    json_error_t je;
    oracle = json_load_file(path, 0, &je);
    if (!oracle) {
        fprintf(stderr, "%s:%d: %s\n", path, je.line, je.text);
        return 1;
    }
    json_t *toks = json_object_get(oracle, "tokenizers");
    size_t n = json_array_size(toks);
    struct CMUnitTest *tests = calloc(n ? n : 1, sizeof *tests);
    if (!tests || n == 0 || json_array_size(json_object_get(oracle, "corpus")) < 60) {
        fprintf(stderr, "%s: no tokenizers or fewer than 60 cases\n", path);
        return 1;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *tj = json_array_get(toks, i);
        tests[i] = (struct CMUnitTest){.name = json_string_value(json_object_get(tj, "name")),
                                       .test_func = check_oracle_tokenizer, .initial_state = tj};
    }
    int rc = _cmocka_run_group_tests("tokenizer_oracle", tests, n, NULL, NULL);
    free(tests);
    json_decref(oracle);
    return rc;
}

int main(void)
{
    const char *oracle_path = getenv("KVTIER_TOKENIZER_ORACLE");
    if (oracle_path)
        return run_oracle(oracle_path);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_byte_level_merges),  cmocka_unit_test(test_ignore_merges),
        cmocka_unit_test(test_sentencepiece_byte_fallback), cmocka_unit_test(test_metaspace_layout),
        cmocka_unit_test(test_added_tokens),       cmocka_unit_test(test_nfc),
        cmocka_unit_test(test_split_behaviors),
        cmocka_unit_test(test_bos_rules),          cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_invalid_utf8),       cmocka_unit_test(test_stream_decode),
        cmocka_unit_test(test_unigram_viterbi),    cmocka_unit_test(test_unigram_precompiled),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
