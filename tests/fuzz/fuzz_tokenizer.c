/* fuzz_tokenizer.c - loading tokenizer.json and tokenizer_config.json
 * (tokenizer_load, which reads a directory).  The input is tokenizer.json,
 * then optionally a NUL and tokenizer_config.json.
 *
 * Invariants: an error has a message naming the file; a loaded tokenizer
 * has a vocabulary, BOS/EOS inside it, and works: a few fixed texts encode
 * to ids inside the vocabulary (or are refused with a message), decoding
 * any id gives well-formed UTF-8, and its chat template is either
 * recognised or refused with a reason.  Sizes come from the file only
 * after they are checked (libFuzzer's -malloc_limit_mb). */
#include "text/chat.h"
#include "text/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

static const char *const TEXTS[] = {"Hello world", " leading  spaces\t\n", "caf\xc3\xa9 \xf0\x9f\x98\x80 \xe2\x96\x81x",
                                    "<s><|im_start|>user</s>", "12345 !?", ""};

static void check_tokenizer(const tokenizer *t)
{
    int vocab = tokenizer_vocab_size(t);
    FUZZ_CHECK(vocab >= 1, "vocabulary of %d", vocab);
    FUZZ_CHECK(tokenizer_bos_id(t) >= -1 && tokenizer_bos_id(t) < vocab, "bos %d", tokenizer_bos_id(t));
    FUZZ_CHECK(tokenizer_eos_id(t) >= -1 && tokenizer_eos_id(t) < vocab, "eos %d", tokenizer_eos_id(t));
    for (size_t k = 0; k < sizeof TEXTS / sizeof TEXTS[0]; k++) {
        for (int add = 0; add < 2; add++) {
            struct tok_ids ids = {0};
            char err[TEXT_ERR_LEN];
            err[0] = '\0';
            enum text_status st = tokenizer_encode(t, TEXTS[k], strlen(TEXTS[k]), add, &ids, err);
            if (st != TEXT_OK) {
                FUZZ_CHECK(err[0], "encode failed (%d) without a message", st);
                free(ids.ids);
                continue;
            }
            for (size_t i = 0; i < ids.n; i++)
                FUZZ_CHECK(ids.ids[i] >= 0 && ids.ids[i] < vocab, "ids[%zu] = %d", i, ids.ids[i]);
            char *out;
            size_t len;
            FUZZ_CHECK(tokenizer_decode(t, ids.ids, ids.n, add, &out, &len) == TEXT_OK, "decode");
            FUZZ_CHECK(fuzz_utf8_valid((const unsigned char *)out, len), "decoded text is not UTF-8");
            free(out);
            free(ids.ids);
        }
    }
    /* every id on its own (the first few thousand: a vocabulary may be 4M) */
    int n = vocab < 4096 ? vocab : 4096;
    for (int32_t id = 0; id < n; id++) {
        char *out;
        size_t len;
        FUZZ_CHECK(tokenizer_decode(t, &id, 1, false, &out, &len) == TEXT_OK, "decode %d", id);
        FUZZ_CHECK(fuzz_utf8_valid((const unsigned char *)out, len), "id %d decodes to invalid UTF-8", id);
        free(out);
    }
    /* the tokenizer accepted the chat_template's shape, so it loads (parsed, or sniffed) */
    chat_tpl *ct = NULL;
    char why[TEXT_ERR_LEN], terr[TEXT_ERR_LEN];
    enum text_status cst = chat_tpl_load(tokenizer_chat_template(t), &ct, why, terr);
    FUZZ_CHECK(cst == TEXT_OK || cst == TEXT_ENOMEM, "chat template refused: %s", terr);
    chat_tpl_free(ct);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 1 << 17)
        return 0;
    const char *dir = fuzz_dir("tokenizer");
    fuzz_write_pair(dir, data, size, "tokenizer.json", "tokenizer_config.json");
    tokenizer *t = NULL;
    char err[TEXT_ERR_LEN];
    err[0] = '\0';
    enum text_status st = tokenizer_load(dir, &t, err);
    if (getenv("KVTIER_FUZZ_VERBOSE")) /* say what each input did */
        fprintf(stderr, "status %d: %s\n", st, st ? err : "ok");
    if (st == TEXT_OK) {
        FUZZ_CHECK(t, "no tokenizer");
        check_tokenizer(t);
    } else {
        FUZZ_CHECK(!t, "a tokenizer left after an error");
        FUZZ_CHECK(st == TEXT_EFORMAT || st == TEXT_EUNSUPPORTED || st == TEXT_ENOMEM, "status %d (%s)", st, err);
        FUZZ_CHECK(strstr(err, "tokenizer.json") || strstr(err, "tokenizer_config.json"),
                   "message \"%s\" names no file", err);
    }
    tokenizer_free(t);
    return 0;
}
