/* fuzz_jinja.c - the Jinja engine on arbitrary templates and variables.
 * Input: the template, a NUL, then the variables as JSON (an object; else
 * a small default conversation is used).
 *
 * Invariants: parsing either succeeds or fails with a message that names
 * the line and column; rendering (under small step and output limits, so
 * no input runs long) either succeeds with text NUL-terminated at its
 * length and within the output limit, or fails with a message; a second
 * render of the same template and variables gives the same bytes (no state
 * leaks between renders, the variables are not modified); continuing the
 * final message (continue_final_message) then cuts the text to a prefix of
 * itself or refuses with a message.
 *
 * Seeds: the templates tests/jinja renders (its committed ones, the
 * tokenizer packages' and the built-in model's), kept with -merge=1. */
#include "text/chat.h"
#include "text/jinja.h"
#include "tests/fuzz/fuzz_util.h"

static const char CONVERSATION[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": "
    "\" Hi \"}, {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"type\": \"function\", "
    "\"function\": {\"name\": \"f\", \"arguments\": {\"a\": 1}}}]}, {\"role\": \"tool\", \"content\": \"42\"}], "
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}}}], "
    "\"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 1 << 16)
        return 0;
    size_t tpl_len, rest_len;
    const uint8_t *rest;
    fuzz_split(data, size, &tpl_len, &rest, &rest_len);
    jinja_tpl *t = NULL;
    char err[TEXT_ERR_LEN];
    err[0] = '\0';
    enum text_status st = jinja_parse((const char *)data, tpl_len, &t, err);
    if (st != TEXT_OK) {
        FUZZ_CHECK(!t, "a template left after a failed parse");
        FUZZ_CHECK(st == TEXT_ENOMEM || strstr(err, "line "), "parse error without a line: %s", err);
        return 0;
    }
    json_t *vars = rest ? json_loadb((const char *)rest, rest_len, 0, NULL) : NULL;
    if (!json_is_object(vars)) {
        json_decref(vars);
        vars = json_loads(CONVERSATION, 0, NULL);
    }
    char *before = json_dumps(vars, JSON_SORT_KEYS | JSON_ENCODE_ANY);
    const struct jinja_opts o = {.max_steps = 200000, .max_output = 1 << 20, .now = 1721997296};
    char *out[2] = {NULL, NULL};
    size_t len[2] = {0, 0};
    enum text_status rs[2];
    for (int k = 0; k < 2; k++) {
        err[0] = '\0';
        rs[k] = jinja_render(t, vars, &o, &out[k], &len[k], err);
        if (rs[k] != TEXT_OK) {
            FUZZ_CHECK(!out[k], "output left after an error");
            FUZZ_CHECK(err[0], "an error without a message");
            continue;
        }
        FUZZ_CHECK(out[k] && out[k][len[k]] == '\0', "not NUL-terminated at its length");
        FUZZ_CHECK(len[k] <= o.max_output, "%zu bytes past the %zu limit", len[k], o.max_output);
    }
    FUZZ_CHECK(rs[0] == rs[1], "two renders disagree: %d then %d", rs[0], rs[1]);
    if (rs[0] == TEXT_OK) {
        FUZZ_CHECK(len[0] == len[1] && !memcmp(out[0], out[1], len[0]), "two renders give different text");
        size_t cut = len[1];
        err[0] = '\0';
        enum text_status cs = chat_continue_final(json_object_get(vars, "messages"), out[1], &cut, err);
        FUZZ_CHECK(cs == TEXT_OK ? cut <= len[0] && out[1][cut] == '\0' && !memcmp(out[1], out[0], cut)
                                 : cs != TEXT_EINVAL || strstr(err, "continue_final_message"),
                   "continuing the final message: %d, %zu of %zu bytes (%s)", cs, cut, len[0], err);
    }
    char *after = json_dumps(vars, JSON_SORT_KEYS | JSON_ENCODE_ANY);
    FUZZ_CHECK(!before || !after || !strcmp(before, after), "rendering changed the variables");
    free(before);
    free(after);
    free(out[0]);
    free(out[1]);
    json_decref(vars);
    jinja_free(t);
    return 0;
}
