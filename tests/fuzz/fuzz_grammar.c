/* fuzz_grammar.c - response schemas compiled into the JSON automaton
 * (gram_compile) and bytes run through it (gram_step).  Input: the schema
 * (empty: json_object), a NUL, then the output bytes.
 *
 * Invariants: a refused schema says why (and names the keyword when it is
 * one, by its first 64 bytes); a refused byte leaves the state as it was; the bytes accepted so
 * far always have a finite shortest completion, and completing them one
 * byte at a time, each byte lowering gram_min_close by one, reaches a
 * complete document in exactly that many bytes; every complete document
 * jansson reads as JSON. */
#include <jansson.h>

#include "text/grammar.h"
#include "tests/fuzz/fuzz_util.h"

#define MAX_OUT 4096

static void check_parses(const char *p, size_t n)
{
    json_error_t e;
    json_t *v = json_loadb(p, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, &e);
    FUZZ_CHECK(v, "a complete document jansson refuses (%s): %.*s", e.text, (int)n, p);
    json_decref(v);
}

/* The greedy shortest completion from s, appended to out[0, n). */
static void check_close(struct gram_state s, char *out, size_t n)
{
    size_t need = gram_min_close(&s);
    if (need > MAX_OUT - n)
        return; /* a schema whose shortest value is long: valid, too slow to walk */
    for (size_t left = need; left > 0; left--) {
        int c = 0;
        for (; c < 256; c++) {
            struct gram_state t = s;
            if (gram_step(&t, (unsigned char)c) && gram_min_close(&t) == left - 1)
                break;
        }
        FUZZ_CHECK(c < 256, "no byte brings the completion from %zu to %zu bytes after %.*s", left, left - 1,
                   (int)n, out);
        gram_step(&s, (unsigned char)c);
        out[n++] = (char)c;
    }
    FUZZ_CHECK(gram_can_end(&s), "not complete after the %zu closing bytes: %.*s", need, (int)n, out);
    check_parses(out, n);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t slen = nul ? (size_t)(nul - data) : size;
    json_t *schema = NULL;
    if (slen) {
        schema = json_loadb((const char *)data, slen, JSON_REJECT_DUPLICATES, NULL);
        if (!schema)
            return 0;
    }
    gram *g;
    const char *bad;
    char err[TEXT_ERR_LEN] = "";
    enum text_status st = gram_compile(schema, &g, &bad, err);
    if (st != TEXT_OK) {
        FUZZ_CHECK(err[0] && !g, "a refused schema without a reason");
        char head[65]; /* the message quotes a keyword's first 64 bytes */
        snprintf(head, sizeof(head), "%s", bad ? bad : "");
        FUZZ_CHECK(strstr(err, head), "the message \"%s\" does not name the keyword \"%s\"", err, head);
        json_decref(schema);
        return 0;
    }
    static char out[2 * MAX_OUT];
    struct gram_state s;
    gram_start(g, &s);
    size_t n = 0;
    const uint8_t *p = nul ? nul + 1 : data + size, *end = data + size;
    for (; p < end && n < MAX_OUT; p++) {
        struct gram_state before;
        memcpy(&before, &s, sizeof(s));
        if (!gram_step(&s, *p)) {
            FUZZ_CHECK(!memcmp(&before, &s, sizeof(s)), "a refused byte changed the state");
            continue; /* the rest of the input may still go on */
        }
        out[n++] = (char)*p;
        FUZZ_CHECK(gram_min_close(&s) < ((size_t)1 << 40), "no finite completion after %.*s", (int)n, out);
        if (gram_can_end(&s))
            check_parses(out, n);
    }
    check_close(s, out, n);
    gram_free(g);
    json_decref(schema);
    return 0;
}
