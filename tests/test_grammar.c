/* Description: the JSON grammar automaton (text/grammar.c): byte strings it
 * accepts and refuses for json_object, schemas and forced calls; refused
 * schema keywords; that its minimum closing length is exact (a greedy walk
 * that shortens it by one byte a step always ends in a complete document
 * that jansson parses); and the vocabulary mask over the built-in model's
 * tokenizer (eos only when complete).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "text/grammar.h"

static gram *compile_str(const char *schema)
{
    json_t *j = NULL;
    if (schema) {
        j = json_loads(schema, 0, NULL);
        assert_non_null(j);
    }
    gram *g = NULL;
    const char *bad;
    char err[TEXT_ERR_LEN];
    enum text_status st = gram_compile(j, &g, &bad, err);
    if (st != TEXT_OK)
        fail_msg("gram_compile(%s): %s", schema, err);
    json_decref(j);
    return g;
}

/* 1: complete, 0: a valid prefix, -1: refused */
static int run(const gram *g, const char *text)
{
    struct gram_state s;
    gram_start(g, &s);
    if (!gram_feed(&s, text, strlen(text)))
        return -1;
    return gram_can_end(&s) ? 1 : 0;
}

#define ACCEPT(g, t) assert_int_equal(run(g, t), 1)
#define PREFIX(g, t) assert_int_equal(run(g, t), 0)
#define REFUSE(g, t) assert_int_equal(run(g, t), -1)

static void test_json_object(void **state)
{
    (void)state;
    gram *g = compile_str(NULL);
    ACCEPT(g, "{}");
    REFUSE(g, " {}");
    ACCEPT(g, "{\"a\": [1, -2.5e+3, 0, \"x\\u00e9\\n\xc3\xa9\", true, null, {\"b\": false}], \"\": {}}");
    PREFIX(g, "{\"a\":");
    PREFIX(g, "{\"a\":[1,2");
    REFUSE(g, "[1]");
    REFUSE(g, "\"x\"");
    REFUSE(g, "{\"a\":1,}");
    REFUSE(g, "{\"a\" 1}");
    REFUSE(g, "{\"a\":01}");
    REFUSE(g, "{\"a\":1.}");
    REFUSE(g, "{}x");
    REFUSE(g, "{} ");
    REFUSE(g, "{\"a\":tru}");
    REFUSE(g, "{\"a\":\"\x01\"}");          /* control character */
    REFUSE(g, "{\"a\":\"\xc3\"}");          /* truncated UTF-8 */
    REFUSE(g, "{\"a\":\"\xed\xa0\x80\"}");  /* a surrogate in UTF-8 */
    REFUSE(g, "{\"a\":\"\\ud800\"}");       /* a surrogate escaped */
    REFUSE(g, "{\"a\":\"\\x\"}");
    PREFIX(g, "{\"a\":[\"x\\\",1]");      /* an escaped quote does not end the string */
    REFUSE(g, "{\"a\":[\"x\\\",1]\"b");
    REFUSE(g, "{\"a\\n\":1}");              /* no escapes in unknown keys */
    REFUSE(g, "{   \"a\":1}");              /* whitespace runs are bounded */
    REFUSE(g, "{\"a\":1234567890123456}");  /* so are numbers */
    ACCEPT(g, "{\"a\":123456789012345}");
    gram_free(g);
}

static const char *person = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\",\"maxLength\":3},"
                            "\"age\":{\"type\":\"integer\"},\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\","
                            "\"b\",1]},\"minItems\":1,\"maxItems\":2},\"n\":{\"type\":[\"number\",\"null\"]}},"
                            "\"required\":[\"name\",\"age\"],\"additionalProperties\":false}";

static void test_schema_object(void **state)
{
    (void)state;
    gram *g = compile_str(person);
    ACCEPT(g, "{\"name\":\"Bob\",\"age\":3}");
    ACCEPT(g, "{\"age\":-3, \"name\":\"\", \"tags\":[\"a\",1], \"n\":null}");
    ACCEPT(g, "{\"age\":0,\"name\":\"x\",\"n\":1.5}");
    REFUSE(g, "{\"name\":\"Bobby\"");       /* maxLength */
    REFUSE(g, "{\"name\":\"B\"}");          /* age is required */
    REFUSE(g, "{\"name\":\"B\",\"name\"");  /* twice */
    REFUSE(g, "{\"nam\":");                 /* unknown key */
    REFUSE(g, "{\"x\"");
    REFUSE(g, "{\"age\":3.5");              /* integer */
    REFUSE(g, "{\"age\":3e2");
    REFUSE(g, "{\"tags\":[]");              /* minItems */
    REFUSE(g, "{\"tags\":[\"a\",\"b\",");   /* maxItems */
    REFUSE(g, "{\"tags\":[\"c\"");          /* enum */
    REFUSE(g, "{\"tags\":[2");
    REFUSE(g, "{\"n\":\"x\"");
    REFUSE(g, "{\"name\":\"a\",\"age\":1,\"tags\":[\"a\"],\"n\":1,"); /* no key is left */
    PREFIX(g, "{\"name\":\"a\",\"age\":1");
    gram_free(g);

    g = compile_str("{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"array\",\"items\":{\"type\":\"boolean\"}},"
                    "{\"type\":\"null\"}]}");
    ACCEPT(g, "\"s\"");
    ACCEPT(g, "[true,false]");
    ACCEPT(g, "null");
    REFUSE(g, "[1]");
    REFUSE(g, "1");
    gram_free(g);

    g = compile_str("{\"type\":\"integer\"}");
    ACCEPT(g, "12");
    ACCEPT(g, "-0");
    REFUSE(g, "12 ");
    PREFIX(g, "-");
    gram_free(g);

    g = compile_str("{\"const\":{\"k\":[1,\"x\"]}}");
    ACCEPT(g, "{\"k\":[1,\"x\"]}");
    REFUSE(g, "{\"k\": [1,\"x\"]}");
    gram_free(g);
}

static void test_refused_keywords(void **state)
{
    (void)state;
    static const struct {
        const char *schema, *bad;
    } cases[] = {
        {"{\"type\":\"string\",\"pattern\":\"^a\"}", "pattern"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"$ref\":\"#/x\"}}}", "$ref"},
        {"{\"type\":\"integer\",\"minimum\":3}", "minimum"},
        {"{\"oneOf\":[]}", "oneOf"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        json_t *j = json_loads(cases[i].schema, 0, NULL);
        gram *g = (gram *)1;
        const char *bad = NULL;
        char err[TEXT_ERR_LEN];
        assert_int_equal(gram_compile(j, &g, &bad, err), TEXT_EUNSUPPORTED);
        assert_null(g);
        assert_non_null(bad);
        assert_string_equal(bad, cases[i].bad);
        assert_non_null(strstr(err, cases[i].bad));
        json_decref(j);
    }
    json_t *j = json_loads("{\"anyOf\":[{\"type\":\"object\"},{\"type\":\"object\"}]}", 0, NULL);
    gram *g;
    const char *bad;
    char err[TEXT_ERR_LEN];
    assert_int_equal(gram_compile(j, &g, &bad, err), TEXT_EUNSUPPORTED);
    json_decref(j);
    /* 64 objects of 64 integers: 4,161 nodes, past the limit, which is the
     * schema's fault (a 400), not a lack of memory */
    json_t *props = json_object();
    for (int i = 0; i < 64; i++) {
        json_t *inner = json_object();
        for (int k = 0; k < 64; k++) {
            char key[16];
            snprintf(key, sizeof(key), "q%d", k);
            json_object_set_new(inner, key, json_pack("{s:s}", "type", "integer"));
        }
        char key[16];
        snprintf(key, sizeof(key), "p%d", i);
        json_object_set_new(props, key, json_pack("{s:s, s:o}", "type", "object", "properties", inner));
    }
    j = json_pack("{s:s, s:o}", "type", "object", "properties", props);
    assert_int_equal(gram_compile(j, &g, &bad, err), TEXT_EUNSUPPORTED);
    assert_null(g);
    assert_non_null(strstr(err, "4096 nodes"));
    json_decref(j);
    /* 17 objects of 64 enums of 64 values: 1,106 nodes, but more values
     * than frames index */
    json_t *vals = json_array();
    for (int k = 0; k < 64; k++)
        json_array_append_new(vals, json_integer(k));
    props = json_object();
    for (int i = 0; i < 17; i++) {
        json_t *inner = json_object();
        for (int k = 0; k < 64; k++) {
            char key[16];
            snprintf(key, sizeof(key), "e%d", k);
            json_object_set_new(inner, key, json_pack("{s:O}", "enum", vals));
        }
        char key[16];
        snprintf(key, sizeof(key), "o%d", i);
        json_object_set_new(props, key, json_pack("{s:s, s:o}", "type", "object", "properties", inner));
    }
    json_decref(vals);
    j = json_pack("{s:s, s:o}", "type", "object", "properties", props);
    assert_int_equal(gram_compile(j, &g, &bad, err), TEXT_EUNSUPPORTED);
    assert_non_null(strstr(err, "65535"));
    json_decref(j);
}

static void test_calls(void **state)
{
    (void)state;
    json_t *p = json_loads("{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},"
                           "\"required\":[\"city\"],\"additionalProperties\":false}", 0, NULL);
    const char *names[] = {"get_weather", "get_time"};
    const json_t *params[] = {p, NULL};
    gram *g;
    const char *bad;
    char err[TEXT_ERR_LEN];
    assert_int_equal(gram_compile_calls(names, params, 2, &g, &bad, err), TEXT_OK);
    ACCEPT(g, "{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}");
    ACCEPT(g, "{\"name\":\"get_time\",\"arguments\":{}}");
    REFUSE(g, "{\"name\":\"get_weather\",\"arguments\":{}}");
    REFUSE(g, "{\"name\":\"get_other\"");
    REFUSE(g, "{\"arguments\"");
    gram_free(g);
    json_decref(p);
}

/* xorshift, for reproducible walks */
static uint32_t rnd(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return (uint32_t)(*x >> 11);
}

/* Random valid prefixes, then the shortest completion one byte at a time:
 * each step must find a byte that lowers gram_min_close by exactly one,
 * and the end is a complete document jansson reads. */
static void walk_and_close(const gram *g, uint64_t seed)
{
    struct gram_state s;
    gram_start(g, &s);
    char buf[4096];
    size_t n = 0;
    int len = (int)(rnd(&seed) % 120);
    for (int i = 0; i < len; i++) {
        unsigned char opts[256];
        int k = 0;
        for (int c = 0; c < 256; c++) {
            struct gram_state t = s;
            if (gram_step(&t, (unsigned char)c))
                opts[k++] = (unsigned char)c;
        }
        if (!k)
            break;
        unsigned char c = opts[rnd(&seed) % (unsigned)k];
        assert_true(gram_step(&s, c));
        buf[n++] = (char)c;
    }
    size_t need = gram_min_close(&s);
    assert_true(need < sizeof(buf) - n);
    for (size_t left = need; left > 0; left--) {
        int c = 0;
        for (; c < 256; c++) {
            struct gram_state t = s;
            if (gram_step(&t, (unsigned char)c) && gram_min_close(&t) == left - 1)
                break;
        }
        if (c == 256)
            fail_msg("no byte closes %.*s (needs %zu)", (int)n, buf, left);
        gram_step(&s, (unsigned char)c);
        buf[n++] = (char)c;
    }
    if (!gram_can_end(&s))
        fail_msg("not complete after the closing bytes: %.*s", (int)n, buf);
    json_error_t e;
    json_t *j = json_loadb(buf, n, JSON_DECODE_ANY | JSON_ALLOW_NUL, &e);
    if (!j)
        fail_msg("jansson refuses %.*s: %s", (int)n, buf, e.text);
    json_decref(j);
}

static void test_min_close_exact(void **state)
{
    (void)state;
    const char *schemas[] = {NULL, person, "{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":"
                                           "{\"k\":{\"type\":\"string\",\"minLength\":2}},\"required\":[\"k\"]},"
                                           "\"minItems\":2}"};
    for (size_t i = 0; i < sizeof(schemas) / sizeof(schemas[0]); i++) {
        gram *g = compile_str(schemas[i]);
        for (uint64_t seed = 1; seed <= 300; seed++)
            walk_and_close(g, seed * 0x9e3779b97f4a7c15ull);
        gram_free(g);
    }
    gram *g = compile_str(person);
    struct gram_state s;
    gram_start(g, &s);
    assert_int_equal(gram_min_close(&s), strlen("{\"name\":\"\",\"age\":0}"));
    assert_true(gram_feed(&s, "{\"name\":\"xy", 11));
    assert_int_equal(gram_min_close(&s), strlen("\",\"age\":0}"));
    gram_free(g);
}

/* A key that spells a quote: the escaped quote is part of it, not its end. */
static void test_escaped_keys(void **state)
{
    (void)state;
    gram *g = compile_str("{\"type\":\"object\",\"properties\":{\"a\\\"b\":{\"type\":\"null\"},"
                          "\"a\":{\"type\":\"null\"}},\"required\":[\"a\\\"b\"],\"additionalProperties\":false}");
    ACCEPT(g, "{\"a\\\"b\":null}");
    ACCEPT(g, "{\"a\":null,\"a\\\"b\":null}");
    REFUSE(g, "{\"a\\\"c");
    REFUSE(g, "{\"a\\\"\"");
    PREFIX(g, "{\"a\\\"");
    for (uint64_t seed = 1; seed <= 64; seed++)
        walk_and_close(g, seed);
    gram_free(g);
}

/* The output nests at most GRAM_DEPTH values: in the last frame an object
 * or array may open but take no value, a schema whose shortest value is
 * deeper is refused, and the closing length stays exact at the limit. */
static void test_depth_limit(void **state)
{
    (void)state;
    gram *g = compile_str(NULL);
    char doc[4 * GRAM_DEPTH + 8];
    size_t n = 0;
    doc[n++] = '{';
    for (int i = 1; i < GRAM_DEPTH - 1; i++)
        doc[n++] = '"', doc[n++] = '"', doc[n++] = ':', doc[n++] = '{';
    memcpy(doc + n, "\"\":", 3);
    n += 3;
    doc[n] = '\0';
    struct gram_state s;
    gram_start(g, &s);
    assert_true(gram_feed(&s, doc, n)); /* GRAM_DEPTH - 1 objects, a key */
    struct gram_state t = s;
    assert_true(gram_step(&t, '{'));     /* the last frame: empty only */
    assert_false(gram_step(&t, '"'));
    assert_true(gram_step(&t, '}'));
    t = s;
    assert_true(gram_step(&t, '['));
    assert_false(gram_step(&t, '1'));
    assert_true(gram_step(&t, ']'));
    t = s;
    assert_true(gram_step(&t, '1'));
    assert_int_equal(gram_min_close(&t), GRAM_DEPTH - 1);
    /* a key whose value cannot open: the closing count skips it */
    t = s;
    assert_true(gram_feed(&t, "{}", 2));
    assert_false(gram_step(&t, ',') && gram_step(&t, '"') && gram_step(&t, '"') && gram_step(&t, ':') &&
                 gram_step(&t, '{') && gram_step(&t, '"'));
    for (uint64_t seed = 1; seed <= 100; seed++)
        walk_and_close(g, seed * 0x9e3779b97f4a7c15ull);
    gram_free(g);

    /* required keys 30 deep: no document fits */
    char sch[2048];
    n = 0;
    for (int i = 0; i < 30; i++)
        n += (size_t)snprintf(sch + n, sizeof(sch) - n, "{\"type\":\"object\",\"required\":[\"a\"],\"properties\":{\"a\":");
    n += (size_t)snprintf(sch + n, sizeof(sch) - n, "{\"type\":\"integer\"}");
    for (int i = 0; i < 30; i++)
        n += (size_t)snprintf(sch + n, sizeof(sch) - n, "}}");
    json_t *j = json_loads(sch, 0, NULL);
    assert_non_null(j);
    const char *bad;
    char err[TEXT_ERR_LEN];
    g = NULL;
    assert_int_equal(gram_compile(j, &g, &bad, err), TEXT_EUNSUPPORTED);
    assert_null(g);
    assert_non_null(strstr(err, "deeper than 24 levels"));
    json_decref(j);
}

static void test_vocab_mask(void **state)
{
    (void)state;
    tokenizer *t;
    char err[TEXT_ERR_LEN];
    assert_int_equal(tokenizer_load("model/builtin", &t, err), TEXT_OK);
    gram_vocab *v;
    assert_int_equal(gram_vocab_create(t, &v), TEXT_OK);
    int V = tokenizer_vocab_size(t);
    bool *allow = calloc((size_t)V, sizeof(*allow));
    struct gram_state *scratch = malloc(gram_vocab_depth(v) * sizeof(*scratch));
    assert_non_null(allow);
    assert_non_null(scratch);
    gram *g = compile_str(NULL);
    struct gram_state s;
    gram_start(g, &s);
    int32_t eos[2] = {tokenizer_eos_id(t), 2047};
    int n = gram_mask(v, &s, 0, eos, 2, allow, V, scratch);
    assert_true(n > 0);
    int counted = 0;
    for (int id = 0; id < V; id++) {
        if (!allow[id])
            continue;
        counted++;
        size_t len;
        bool special;
        const char *p = tokenizer_token_bytes(t, id, &len, &special);
        struct gram_state c = s;
        assert_false(special);
        assert_true(gram_feed(&c, p, len));
    }
    assert_int_equal(counted, n);
    assert_false(allow[eos[0]]);
    /* the single-byte token "{" is there; "}" is not yet */
    struct tok_ids ids = {0};
    assert_int_equal(tokenizer_encode(t, "{", 1, false, &ids, err), TEXT_OK);
    assert_int_equal(ids.n, 1);
    assert_true(allow[ids.ids[0]]);
    /* a complete document: eos alone */
    assert_true(gram_feed(&s, "{}", 2));
    n = gram_mask(v, &s, 0, eos, 2, allow, V, scratch);
    assert_int_equal(n, 2);
    assert_true(allow[eos[0]] && allow[eos[1]]);
    /* after {"a": with 3 tokens left, every token allowed leaves at most
     * 2 bytes to close: "t" (then "rue}") is out, though the grammar takes it */
    gram_start(g, &s);
    assert_true(gram_feed(&s, "{\"a\":", 5));
    ids.n = 0;
    assert_int_equal(tokenizer_encode(t, "t", 1, false, &ids, err), TEXT_OK);
    assert_int_equal(ids.n, 1);
    assert_true(gram_mask(v, &s, 0, eos, 2, allow, V, scratch) > 0);
    assert_true(allow[ids.ids[0]]);
    n = gram_mask(v, &s, 3, eos, 2, allow, V, scratch);
    assert_true(n > 0);
    assert_false(allow[ids.ids[0]]);
    free(ids.ids);
    for (int id = 0; id < V; id++) {
        if (!allow[id])
            continue;
        size_t len;
        bool special;
        const char *p = tokenizer_token_bytes(t, id, &len, &special);
        struct gram_state c = s;
        assert_true(gram_feed(&c, p, len));
        assert_true(gram_min_close(&c) <= 2);
    }
    gram_free(g);
    free(allow);
    free(scratch);
    gram_vocab_free(v);
    tokenizer_free(t);
}

/* gram_mask against every token fed one by one: the same set, for states
 * inside and outside strings, with and without a budget. */
static void test_mask_is_exact(void **state)
{
    (void)state;
    tokenizer *t;
    char err[TEXT_ERR_LEN];
    assert_int_equal(tokenizer_load("model/builtin", &t, err), TEXT_OK);
    gram_vocab *v;
    assert_int_equal(gram_vocab_create(t, &v), TEXT_OK);
    int V = tokenizer_vocab_size(t);
    bool *allow = calloc((size_t)V, sizeof(*allow));
    struct gram_state *scratch = malloc(gram_vocab_depth(v) * sizeof(*scratch));
    assert_non_null(allow);
    assert_non_null(scratch);
    static const struct {
        const char *schema, *prefix;
        int budget;
    } cases[] = {
        {NULL, "", 0},
        {NULL, "{\"a\": \"xy", 0},
        {NULL, "{\"a\": \"xy", 3},
        {NULL, "{\"a\":[1,2", 4},
        {NULL, "{\"ab", 0},
        {"{\"type\":\"string\",\"minLength\":3,\"maxLength\":5}", "\"a", 0},
        {"{\"type\":\"string\",\"minLength\":3,\"maxLength\":5}", "\"a", 4},
        {"{\"type\":\"string\",\"minLength\":3,\"maxLength\":5}", "\"a\\", 0},
    };
    int32_t eos = tokenizer_eos_id(t);
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        gram *g = compile_str(cases[i].schema);
        struct gram_state s;
        gram_start(g, &s);
        assert_true(gram_feed(&s, cases[i].prefix, strlen(cases[i].prefix)));
        int n = gram_mask(v, &s, cases[i].budget, &eos, 1, allow, V, scratch);
        int want = 0;
        for (int id = 0; id < V; id++) {
            size_t len;
            bool special;
            const char *p = tokenizer_token_bytes(t, id, &len, &special);
            struct gram_state c = s;
            bool ok = id == eos ? gram_can_end(&s)
                                : !special && len && gram_feed(&c, p, len) &&
                                      (cases[i].budget <= 0 || gram_min_close(&c) <= (size_t)cases[i].budget - 1);
            want += ok;
            if (ok != allow[id])
                fail_msg("case %zu, token %d (%.*s): mask %d, fed %d", i, id, (int)len, p, allow[id], ok);
        }
        assert_int_equal(n, want);
        assert_true(n > 0);
        gram_free(g);
    }
    free(allow);
    free(scratch);
    gram_vocab_free(v);
    tokenizer_free(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_object),      cmocka_unit_test(test_schema_object),
        cmocka_unit_test(test_refused_keywords), cmocka_unit_test(test_calls),
        cmocka_unit_test(test_min_close_exact),
        cmocka_unit_test(test_escaped_keys),  cmocka_unit_test(test_vocab_mask),
        cmocka_unit_test(test_mask_is_exact),    cmocka_unit_test(test_depth_limit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
