/* test_jinja.c - the Jinja engine and the chat templates on top of it:
 * whitespace control, filters, tests, macros, errors with their line and
 * column, the limits on output, steps and nesting, named templates
 * (default / tool_use), and the fallback to the families for a template
 * that does not parse.
 *
 * With KVTIER_JINJA_ORACLE=expected.json (written by tests/jinja/oracle.mjs,
 * run by tests/jinja.test.sh) it instead renders every case of the corpus
 * and compares the bytes with @huggingface/jinja's, and the case mapping of
 * every code point with JavaScript's (KVTIER_JINJA_CASING=casing.json,
 * written by tests/jinja/casing.mjs).
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

#include <utf8proc.h>

#include "text/casemap.h"
#include "text/chat.h"
#include "text/jinja.h"

/* Renders src over vars (JSON text); returns the output (malloc'd) or NULL
 * with the error in err. */
static const struct jinja_opts *opts;

static char *render(const char *src, const char *vars_json, enum text_status *st, char *err)
{
    jinja_tpl *t = NULL;
    err[0] = '\0';
    *st = jinja_parse(src, strlen(src), &t, err);
    if (*st != TEXT_OK)
        return NULL;
    json_t *vars = vars_json ? json_loads(vars_json, 0, NULL) : NULL;
    assert_true(!vars_json || vars);
    char *out = NULL;
    size_t len = 0;
    struct jinja_opts o = {.now = 1721997296 /* 26 Jul 2024 12:34:56 UTC */};
    *st = jinja_render(t, vars, opts ? opts : &o, &out, &len, err);
    if (*st == TEXT_OK)
        assert_int_equal(strlen(out), len);
    json_decref(vars);
    jinja_free(t);
    return out;
}

static void expect_text(const char *src, const char *vars, const char *want)
{
    enum text_status st;
    char err[TEXT_ERR_LEN];
    char *out = render(src, vars, &st, err);
    if (st != TEXT_OK)
        fail_msg("%s: %s", src, err);
    assert_string_equal(out, want);
    free(out);
}

static void expect_error(const char *src, const char *vars, enum text_status want, const char *msg)
{
    enum text_status st;
    char err[TEXT_ERR_LEN];
    char *out = render(src, vars, &st, err);
    assert_null(out);
    assert_int_equal(st, want);
    if (!strstr(err, msg))
        fail_msg("error \"%s\" does not say \"%s\"", err, msg);
}

static void test_basics(void **state)
{
    (void)state;
    expect_text("", NULL, "");
    expect_text("a\n", NULL, "a"); /* one trailing newline is dropped */
    expect_text("{{ x }}|{{ y }}|{{ 1.0 }}|{{ none }}|{{ true }}", "{\"x\": 5, \"y\": \"s\"}", "5|s|1.0||true");
    /* trim_blocks and lstrip_blocks, and the explicit - markers */
    expect_text("  {% if 1 %}\nyes\n  {% endif %}\nend", NULL, "yes\nend");
    expect_text("a  {{- 'b' -}}  c {#- c -#} d", NULL, "abcd");
    expect_text("{% for m in messages %}{{ loop.index }}{{ m.role[0] }}{{ ',' if not loop.last }}{% endfor %}",
                "{\"messages\": [{\"role\": \"user\"}, {\"role\": \"assistant\"}]}", "1u,2a");
    expect_text("{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}",
                NULL, "6");
    expect_text("{% macro m(a, b='x') %}{{ a }}{{ b }}{% endmacro %}{{ m(1) }}{{ m(2, b='y') }}", NULL, "1x2y");
    expect_text("{{ 'a b'.split() | map('upper') | join('-') }}", NULL, "A-B");
    expect_text("{{ {'a': 1, 'b': [1, 'x']} | tojson }}", NULL, "{\"a\": 1, \"b\": [1, \"x\"]}");
    expect_text("{{ 'é😀\\n\"' | tojson }}", NULL, "\"é😀\\n\\\"\"");
    expect_text("{{ strftime_now('%d %b %Y %H:%M') }}", NULL, "26 Jul 2024 12:34");
    expect_text("{{ 'abc'[::-1] }}{{ [1, 2, 3][-1] }}{{ 'x' if false }}", NULL, "cba3");
    expect_text("{{ x is defined }}{{ x is not defined }}{{ strftime_now is defined }}", NULL, "falsetruetrue");
    /* training templates' generation markers are dropped */
    expect_text("a {%- generation -%} b {% endgeneration %} c", NULL, "ab  c"); /* as @huggingface/jinja */
}

/* upper, lower, capitalize, title and the case tests as @huggingface/jinja
 * (JavaScript) has them; jinja.test.sh compares every code point */
static void test_case(void **state)
{
    (void)state;
    expect_text("{{ 'straße' | upper }} {{ 'ǰ'.upper() }} {{ 'ﬃ' | upper }}", NULL, "STRASSE J̌ FFI");
    expect_text("{{ 'İI' | lower }} {{ 'ıi'.upper() }}", NULL, "i̇i II"); /* no Turkish rules */
    expect_text("{{ 'ΟΔΥΣΣΕΥΣ ΣΑ Σ' | lower }} {{ 'ΑΣ.' | lower }} {{ 'ΑΣ\\'Α' | lower }}", NULL,
                "οδυσσευς σα σ ας. ασ'α");
    /* capitalize: the first UTF-16 unit, the rest untouched; title: ASCII */
    expect_text("{{ 'ßa' | capitalize }} {{ '𐐨a' | capitalize }} {{ 'éLAN' | capitalize }}", NULL, "SSa 𐐨a ÉLAN");
    expect_text("{{ 'élan vital' | title }} {{ 'ǆ' | title }}", NULL, "éLan Vital ǆ");
    expect_text("{{ 'ÉTÉ' is upper }} {{ 'été' is lower }} {{ 'ß' is upper }} {{ '日本' is lower }}", NULL,
                "true true false true");
    /* bytes that are not UTF-8 pass through; the characters around them map */
    const char *src = "{{ s | upper }}|{{ s | capitalize }}|{{ t | capitalize }}";
    jinja_tpl *t;
    char err[TEXT_ERR_LEN], *out;
    size_t len;
    assert_int_equal(jinja_parse(src, strlen(src), &t, err), TEXT_OK);
    json_t *vars = json_pack("{s:o,s:o}", "s", json_stringn_nocheck("\xff" "a\xc3\xc3\xa9", 5), "t",
                             json_stringn_nocheck("\xc3" "a", 2));
    assert_non_null(vars);
    assert_int_equal(jinja_render(t, vars, &(struct jinja_opts){0}, &out, &len, err), TEXT_OK);
    assert_int_equal(len, 5 + 1 + 5 + 1 + 2);
    assert_memory_equal(out, "\xff" "A\xc3\xc3\x89|\xff" "a\xc3\xc3\xa9|\xc3" "a", len);
    free(out);
    json_decref(vars);
    jinja_free(t);
}

static void test_errors(void **state)
{
    (void)state;
    expect_error("ab\n  {{ 1 +", NULL, TEXT_EFORMAT, "line 2");
    expect_error("{% if x %}", NULL, TEXT_EFORMAT, "endif");
    expect_error("{% frobnicate %}", NULL, TEXT_EFORMAT, "unknown statement");
    expect_error("{{ 'unterminated }}", NULL, TEXT_EFORMAT, "line 1, column 4");
    expect_error("x\n{{ raise_exception('roles must alternate') }}", NULL, TEXT_EINVAL,
                 "line 2, column 4: raise_exception: roles must alternate");
    expect_error("{{ 1 // 0 }}", NULL, TEXT_EINVAL, "division by zero");
    expect_error("{{ x | nosuchfilter }}", "{\"x\": \"s\"}", TEXT_EINVAL, "unknown filter");
    expect_error("{{ none + 1 }}", NULL, TEXT_EINVAL, "none");
}

static void test_limits(void **state)
{
    (void)state;
    /* nesting: deep brackets are refused by the parser, not the stack */
    char deep[4096];
    size_t n = 0;
    n += (size_t)snprintf(deep + n, sizeof deep - n, "{{ ");
    for (int i = 0; i < 1000; i++)
        deep[n++] = '(';
    deep[n] = '\0';
    expect_error(deep, NULL, TEXT_EFORMAT, "nested too deeply");
    expect_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL, TEXT_EINVAL, "deeper than");
    /* output and steps: a template that would run for ever stops */
    const struct jinja_opts few = {.max_steps = 100000, .max_output = 20000};
    opts = &few;
    expect_error("{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}", NULL,
                 TEXT_EINVAL, "100000 steps");
    expect_error("{% for i in range(1000) %}{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}{% endfor %}", NULL,
                 TEXT_EINVAL, "exceeds 20000 bytes");
    expect_error("{% set ns = namespace(s='x') %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 NULL, TEXT_EINVAL, "exceeds 20000 bytes");
    opts = NULL;
    expect_error("{{ range(100000000) }}", NULL, TEXT_EINVAL, "range() longer");
    jinja_tpl *t;
    char err[TEXT_ERR_LEN];
    const char *hundred = "{% for i in range(100) %}xxxxxxxxxx{% endfor %}";
    assert_int_equal(jinja_parse(hundred, strlen(hundred), &t, err), TEXT_OK);
    char *out = NULL;
    size_t len;
    struct jinja_opts small = {.max_output = 500};
    assert_int_equal(jinja_render(t, NULL, &small, &out, &len, err), TEXT_EINVAL);
    assert_null(out);
    small.max_output = 1000;
    assert_int_equal(jinja_render(t, NULL, &small, &out, &len, err), TEXT_OK);
    assert_int_equal(len, 1000);
    free(out);
    jinja_free(t);
}

/* Named templates, the tools variable, and the fallback to a family. */
static void test_chat_tpl(void **state)
{
    (void)state;
    char why[TEXT_ERR_LEN], err[TEXT_ERR_LEN];
    json_t *list = json_loads("[{\"name\": \"default\", \"template\": \"D{{ messages | length }}{{ tools is defined }}\"},"
                              " {\"name\": \"tool_use\", \"template\": \"T{{ tools | length }}\"}]", 0, NULL);
    json_t *msgs = json_loads("[{\"role\": \"user\", \"content\": \"hi\"}]", 0, NULL);
    json_t *tools = json_loads("[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]", 0, NULL);
    json_t *empty = json_array();
    chat_tpl *t;
    char *out;
    size_t len;
    assert_int_equal(chat_tpl_load(list, &t, why, err), TEXT_OK);
    assert_string_equal(chat_tpl_kind(t), "jinja");
    assert_int_equal(chat_tpl_render(t, msgs, NULL, NULL, NULL, true, "", "", 0, &out, &len, err), TEXT_OK);
    assert_string_equal(out, "D1false");
    free(out);
    assert_int_equal(chat_tpl_render(t, msgs, empty, NULL, NULL, true, "", "", 0, &out, &len, err), TEXT_OK);
    assert_string_equal(out, "D1false");
    free(out);
    assert_int_equal(chat_tpl_render(t, msgs, tools, NULL, NULL, true, "", "", 0, &out, &len, err), TEXT_OK);
    assert_string_equal(out, "T1");
    free(out);
    chat_tpl_free(t);

    /* documents: the RAG variable, as transformers passes it */
    json_t *rag = json_string("{% if documents is defined %}{% for d in documents %}[{{ d.title }}: {{ d.text }}]"
                              "{% endfor %}{% else %}none{% endif %}");
    json_t *docs = json_loads("[{\"title\": \"a\", \"text\": \"x\"}, {\"title\": \"b\", \"text\": \"y\"}]", 0, NULL);
    assert_int_equal(chat_tpl_load(rag, &t, why, err), TEXT_OK);
    assert_int_equal(chat_tpl_render(t, msgs, NULL, docs, NULL, true, "", "", 0, &out, &len, err), TEXT_OK);
    assert_string_equal(out, "[a: x][b: y]");
    free(out);
    assert_int_equal(chat_tpl_render(t, msgs, NULL, NULL, NULL, true, "", "", 0, &out, &len, err), TEXT_OK);
    assert_string_equal(out, "none");
    free(out);
    chat_tpl_free(t);
    json_decref(rag);

    /* a tool_use that does not parse leaves the default for every request */
    json_t *half = json_loads("[{\"name\": \"default\", \"template\": \"D\"},"
                              " {\"name\": \"tool_use\", \"template\": \"{% bogus %}\"}]", 0, NULL);
    assert_int_equal(chat_tpl_load(half, &t, why, err), TEXT_OK);
    assert_non_null(strstr(why, "bogus"));
    assert_int_equal(chat_tpl_render(t, msgs, tools, NULL, NULL, true, "", "", 0, &out, &len, err), TEXT_OK);
    assert_string_equal(out, "D");
    free(out);
    chat_tpl_free(t);
    json_decref(half);

    /* a template that needs string content gets "" for a tool-calling turn's null */
    json_t *str_only = json_string("{% for m in messages %}{{ 'x' in m.content }}{% endfor %}");
    json_t *calls = json_loads("[{\"role\": \"assistant\", \"content\": null, \"tool_calls\": []}]", 0, NULL);
    assert_int_equal(chat_tpl_load(str_only, &t, why, err), TEXT_OK);
    assert_int_equal(chat_tpl_render(t, calls, NULL, NULL, NULL, false, "", "", 0, &out, &len, err), TEXT_OK);
    assert_string_equal(out, "false");
    free(out);
    chat_tpl_free(t);
    json_decref(str_only);
    /* failing with "" too, the template's own message, not the null's */
    json_t *strict = json_string("{% for m in messages %}{{ 'x' in m.content }}{% endfor %}"
                                 "{{ raise_exception('roles must alternate') }}");
    assert_int_equal(chat_tpl_load(strict, &t, why, err), TEXT_OK);
    assert_int_equal(chat_tpl_render(t, calls, NULL, NULL, NULL, false, "", "", 0, &out, &len, err), TEXT_EINVAL);
    assert_non_null(strstr(err, "roles must alternate"));
    chat_tpl_free(t);
    json_decref(strict);
    json_decref(calls);

    /* unparsable, but with ChatML's markers: the family renders it */
    json_t *bad = json_string("{% call m() %}{% endcall %}<|im_start|>{{ x }}");
    assert_int_equal(chat_tpl_load(bad, &t, why, err), TEXT_OK);
    assert_non_null(strstr(why, "unknown statement"));
    assert_string_equal(chat_tpl_kind(t), "chatml");
    assert_int_equal(chat_tpl_render(t, msgs, NULL, NULL, NULL, true, "", "", 0, &out, &len, err), TEXT_OK);
    assert_string_equal(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    /* a family renders no documents: refused, not dropped */
    assert_int_equal(chat_tpl_render(t, msgs, NULL, docs, NULL, true, "", "", 0, &out, &len, err), TEXT_EUNSUPPORTED);
    assert_null(out);
    chat_tpl_free(t);
    json_decref(docs);

    /* none at all */
    assert_int_equal(chat_tpl_load(NULL, &t, why, err), TEXT_OK);
    assert_string_equal(chat_tpl_kind(t), "none");
    assert_int_equal(chat_tpl_render(t, msgs, NULL, NULL, NULL, true, "", "", 0, &out, &len, err), TEXT_EUNSUPPORTED);
    chat_tpl_free(t);
    json_t *num = json_integer(3);
    assert_int_equal(chat_tpl_load(num, &t, why, err), TEXT_EFORMAT);
    json_decref(num);
    json_decref(bad);
    json_decref(list);
    json_decref(msgs);
    json_decref(tools);
    json_decref(empty);
}

/* chat_continue_final over text: want, or NULL for TEXT_EINVAL naming
 * continue_final_message. */
static void expect_cut(const char *messages, const char *text, const char *want)
{
    json_t *m = json_loads(messages, 0, NULL);
    assert_non_null(m);
    char *buf = strdup(text), err[TEXT_ERR_LEN] = "";
    assert_non_null(buf);
    size_t len = strlen(buf);
    enum text_status st = chat_continue_final(m, buf, &len, err);
    if (want && (st != TEXT_OK || len != strlen(want) || strcmp(buf, want)))
        fail_msg("%s over \"%s\": \"%s\" (%s), want \"%s\"", messages, text, buf, err, want);
    if (!want && (st != TEXT_EINVAL || !strstr(err, "continue_final_message")))
        fail_msg("%s over \"%s\": %d \"%s\", want an error", messages, text, st, err);
    free(buf);
    json_decref(m);
}

/* transformers' cut: after the last occurrence of the stripped content,
 * keeping its trailing whitespace only where the template printed it whole */
static void test_continue_final(void **state)
{
    (void)state;
    const char *chat = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer is<|im_end|>\n";
    expect_cut("[{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"The answer is\"}]",
               chat, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe answer is");
    /* any role, as transformers allows */
    expect_cut("[{\"role\": \"user\", \"content\": \"Hi\"}]", "<u>Hi</u>", "<u>Hi");
    expect_cut("[{\"role\": \"assistant\", \"content\": \"Sure, \"}]", "<a>Sure, </a>", "<a>Sure, ");
    expect_cut("[{\"role\": \"assistant\", \"content\": \"Sure, \"}]", "<a>Sure,</a>", "<a>Sure,");
    /* leading whitespace: the trailing whitespace goes even when printed */
    expect_cut("[{\"role\": \"assistant\", \"content\": \" Sure \"}]", "<a> Sure </a>", "<a> Sure");
    /* Python's whitespace: U+0085 and U+3000 are stripped, U+FEFF is not */
    expect_cut("[{\"role\": \"assistant\", \"content\": \"ok\\u0085\\u3000\"}]", "<a>ok</a>", "<a>ok");
    expect_cut("[{\"role\": \"assistant\", \"content\": \"ok\\ufeff\"}]", "<a>ok</a>", NULL);
    expect_cut("[{\"role\": \"user\", \"content\": \"yes\"}, {\"role\": \"assistant\", \"content\": \"yes\"}]",
               "<u>yes</u><a>yes</a><a>", "<u>yes</u><a>yes");
    /* nothing to find is found at the end: nothing is cut */
    expect_cut("[{\"role\": \"assistant\", \"content\": \"\"}]", "<a></a>", "<a></a>");
    expect_cut("[{\"role\": \"assistant\", \"content\": \" \\n\"}]", "<a></a>", "<a></a>");
    /* a template that changed the message, a message without text */
    expect_cut("[{\"role\": \"assistant\", \"content\": \"a\\nb\"}]", "<a>a b</a>", NULL);
    expect_cut("[{\"role\": \"assistant\", \"content\": \"longer than the text\"}]", "<a>", NULL);
    expect_cut("[{\"role\": \"assistant\", \"content\": null, \"tool_calls\": []}]", "<a></a>", NULL);
    expect_cut("[]", "", NULL);
}

/* Every case of the oracle's corpus, byte for byte. */
static void test_oracle(void **state)
{
    (void)state;
    const char *path = getenv("KVTIER_JINJA_ORACLE");
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root)
        fail_msg("%s: %s", path, jerr.text);
    time_t now = (time_t)json_integer_value(json_object_get(root, "now"));
    json_t *cases = json_object_get(root, "cases");
    assert_true(json_array_size(cases) > 100);
    size_t i, failed = 0, rendered = 0;
    json_t *c;
    json_array_foreach(cases, i, c)
    {
        const char *src = json_string_value(json_object_get(c, "source"));
        const char *name = json_string_value(json_object_get(c, "template"));
        const char *cname = json_string_value(json_object_get(c, "case"));
        const json_t *want = json_object_get(c, "text");
        char err[TEXT_ERR_LEN] = "";
        jinja_tpl *t = NULL;
        enum text_status st = jinja_parse(src, strlen(src), &t, err);
        char *out = NULL;
        size_t len = 0;
        if (st == TEXT_OK) {
            json_t *tools = json_object_get(c, "tools");
            json_t *vars = chat_vars(json_object_get(c, "messages"), json_is_array(tools) ? tools : NULL, NULL,
                                     json_object_get(c, "kwargs"),
                                     json_is_true(json_object_get(c, "add_generation_prompt")),
                                     json_string_value(json_object_get(c, "bos")),
                                     json_string_value(json_object_get(c, "eos")));
            assert_non_null(vars);
            struct jinja_opts o = {.now = now};
            st = jinja_render(t, vars, &o, &out, &len, err);
            json_decref(vars);
            if (st == TEXT_OK && json_is_true(json_object_get(c, "continue_final_message")))
                st = chat_continue_final(json_object_get(c, "messages"), out, &len, err);
        }
        jinja_free(t);
        if (json_is_string(want)) {
            rendered++;
            if (st != TEXT_OK || len != json_string_length(want) || memcmp(out, json_string_value(want), len)) {
                failed++;
                fprintf(stderr, "%s / %s: %s\n--- want\n%s\n--- got\n%s\n", name, cname,
                        st == TEXT_OK ? "differs" : err, json_string_value(want), out ? out : "");
            }
        } else if (st == TEXT_OK) {
            failed++;
            fprintf(stderr, "%s / %s: rendered, but the reference raised: %s\n", name, cname,
                    json_string_value(json_object_get(c, "error")));
        }
        free(out);
    }
    fprintf(stderr, "jinja oracle: %zu cases (%zu rendered by the reference), %zu differ\n", json_array_size(cases),
            rendered, failed);
    json_decref(root);
    assert_int_equal(failed, 0);
}

/* Marks the code points of ranges ([[first, last], ...]) in set. */
static void mark(unsigned char *set, const json_t *ranges)
{
    size_t i;
    const json_t *r;
    json_array_foreach(ranges, i, r)
    {
        json_int_t last = json_integer_value(json_array_get(r, 1));
        for (json_int_t c = json_integer_value(json_array_get(r, 0)); c <= last; c++)
            set[c] = 1;
    }
}

/* Whether s[0..n) maps to want[0..wn), else says how it differs. */
static bool maps_to(const char *what, int32_t c, const char *s, size_t n, enum casemap how, const char *want,
                    size_t wn)
{
    size_t len;
    char *out = casemap(s, n, how, &len);
    assert_non_null(out);
    bool ok = len == wn && !memcmp(out, want, len);
    if (!ok)
        fprintf(stderr, "U+%04X %s: \"%s\", JavaScript \"%.*s\"\n", (unsigned)c, what, out, (int)wn, want);
    free(out);
    return ok;
}

/* The code points whose case Unicode changed after 15.0, the version of
 * Debian 12's libutf8proc: ƛ, ɤ, ꟓ and ꟕ got capitals, ʕ stopped being a
 * cased letter and U+1171E a mark.  A JavaScript of a later Unicode maps
 * them otherwise; every other code point both versions assign must agree. */
static const int32_t changed_after_15[] = {0x19b, 0x264, 0x295, 0xa7d3, 0xa7d5, 0x1171e};

/* text/casemap.c against JavaScript's toUpperCase/toLowerCase for every
 * code point assigned in both Unicode versions: alone, and around a
 * capital sigma (whether it makes the sigma final). */
static void test_casing(void **state)
{
    (void)state;
    const char *path = getenv("KVTIER_JINJA_CASING");
    if (!path)
        fail_msg("KVTIER_JINJA_CASING is not set (tests/jinja.test.sh sets it)");
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root)
        fail_msg("%s: %s", path, jerr.text);
    unsigned char *skip = calloc(0x110000, 1), *cased = calloc(0x110000, 1), *ign = calloc(0x110000, 1);
    const json_t **want = calloc(0x110000, sizeof(*want));
    assert_true(skip && cased && ign && want);
    mark(skip, json_object_get(root, "unassigned"));
    mark(cased, json_object_get(root, "cased"));
    mark(ign, json_object_get(root, "ignorable"));
    for (size_t i = 0; i < sizeof(changed_after_15) / sizeof(changed_after_15[0]); i++)
        skip[changed_after_15[i]] = 1;
    size_t i;
    const json_t *e;
    json_array_foreach(json_object_get(root, "map"), i, e)
    {
        want[json_integer_value(json_array_get(e, 0))] = e;
    }
    size_t failed = 0, checked = 0;
    for (int32_t c = 0; c <= 0x10ffff; c++) {
        if ((c >= 0xd800 && c <= 0xdfff) || skip[c] || utf8proc_get_property(c)->category == UTF8PROC_CATEGORY_CN)
            continue;
        checked++;
        char s[8], w[2][16], probe[16];
        size_t n = (size_t)utf8proc_encode_char(c, (utf8proc_uint8_t *)s), wn[2] = {0, 0};
        for (int k = 0; k < 2; k++) {
            const json_t *cps = want[c] ? json_array_get(want[c], (size_t)k + 1) : NULL;
            for (size_t j = 0; j < json_array_size(cps); j++)
                wn[k] += (size_t)utf8proc_encode_char((int32_t)json_integer_value(json_array_get(cps, j)),
                                                      (utf8proc_uint8_t *)w[k] + wn[k]);
            if (!cps) {
                memcpy(w[k], s, n);
                wn[k] = n;
            }
        }
        bool ok = maps_to("upper", c, s, n, CASEMAP_UPPER, w[0], wn[0]) &&
                  maps_to("lower", c, s, n, CASEMAP_LOWER, w[1], wn[1]);
        /* x + Σ: final after a cased x; A + x + Σ: after an ignorable one
         * too; A + Σ + x: final unless x is cased (x lowercased alone, so
         * not a sigma itself, which ends the word there) */
        char wsig[16];
        memcpy(probe, s, n);
        memcpy(probe + n, "Σ", 2);
        memcpy(wsig, w[1], wn[1]);
        memcpy(wsig + wn[1], cased[c] ? "ς" : "σ", 2);
        ok = ok && maps_to("before a sigma", c, probe, n + 2, CASEMAP_LOWER, wsig, wn[1] + 2);
        probe[0] = 'A';
        memcpy(probe + 1, s, n);
        memcpy(probe + 1 + n, "Σ", 2);
        wsig[0] = 'a';
        memcpy(wsig + 1, w[1], wn[1]);
        memcpy(wsig + 1 + wn[1], cased[c] || ign[c] ? "ς" : "σ", 2);
        ok = ok && maps_to("between A and a sigma", c, probe, n + 3, CASEMAP_LOWER, wsig, wn[1] + 3);
        memcpy(probe, "AΣ", 3);
        memcpy(probe + 3, s, n);
        memcpy(wsig, cased[c] ? "aσ" : "aς", 3);
        memcpy(wsig + 3, w[1], wn[1]);
        ok = ok && (c == 0x3a3 || maps_to("after A and a sigma", c, probe, n + 3, CASEMAP_LOWER, wsig, wn[1] + 3));
        failed += !ok;
    }
    fprintf(stderr, "casing: %zu code points against JavaScript's Unicode %s, %zu differ\n", checked,
            json_string_value(json_object_get(root, "unicode")), failed);
    free(skip);
    free(cased);
    free(ign);
    free(want);
    json_decref(root);
    assert_true(checked > 250000);
    assert_int_equal(failed, 0);
}

int main(void)
{
    setenv("TZ", "UTC", 1);
    tzset();
    if (getenv("KVTIER_JINJA_ORACLE")) {
        const struct CMUnitTest oracle[] = {cmocka_unit_test(test_oracle), cmocka_unit_test(test_casing)};
        return cmocka_run_group_tests(oracle, NULL, NULL);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_basics),
        cmocka_unit_test(test_case),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_chat_tpl),
        cmocka_unit_test(test_continue_final),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
