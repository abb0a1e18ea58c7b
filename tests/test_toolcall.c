/* Description: tool calls read back from model text (ipc/toolcall.c):
 * Hermes/Qwen <tool_call> blocks with content before them, Llama 3.1 bare
 * JSON (with <|python_tag|>, several calls, "parameters" or "arguments",
 * arguments as a string), and malformed or unknown calls left as content.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "ipc/toolcall.h"

static json_t *tools;

static int setup(void **state)
{
    (void)state;
    tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}},"
                       "{\"type\":\"function\",\"function\":{\"name\":\"get_time\"}}]", 0, NULL);
    return tools ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    json_decref(tools);
    return 0;
}

static size_t parse(const char *text, enum ipc_tool_format fmt, struct ipc_tool_calls *c)
{
    assert_int_equal(ipc_tool_calls_parse(text, strlen(text), fmt, tools, c), IPC_OK);
    return c->n;
}

static void test_hermes(void **state)
{
    (void)state;
    struct ipc_tool_calls c;
    const char *t = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
                    "\"days\": [1, 2]}}\n</tool_call>\n";
    assert_int_equal(parse(t, IPC_TOOLFMT_HERMES, &c), 1);
    assert_int_equal(c.content_len, strlen("Let me look."));
    assert_string_equal(c.calls[0].name, "get_weather");
    assert_string_equal(c.calls[0].arguments, "{\"city\":\"Paris\",\"days\":[1,2]}");
    ipc_tool_calls_free(&c);

    /* two calls, no content, the last closing tag cut off */
    t = "<tool_call>{\"name\":\"get_time\",\"arguments\":{}}</tool_call>\n<tool_call>\n"
        "{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\":\\\"Rome\\\"}\"}";
    assert_int_equal(parse(t, IPC_TOOLFMT_HERMES, &c), 2);
    assert_int_equal(c.content_len, 0);
    assert_string_equal(c.calls[0].name, "get_time");
    assert_string_equal(c.calls[0].arguments, "{}");
    assert_string_equal(c.calls[1].arguments, "{\"city\":\"Rome\"}");
    ipc_tool_calls_free(&c);
}

static void test_llama(void **state)
{
    (void)state;
    struct ipc_tool_calls c;
    assert_int_equal(parse(" {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}", IPC_TOOLFMT_LLAMA, &c),
                     1);
    assert_int_equal(c.content_len, 0);
    assert_string_equal(c.calls[0].arguments, "{\"city\":\"Oslo\"}");
    ipc_tool_calls_free(&c);
    assert_int_equal(parse("<|python_tag|>{\"name\":\"get_time\",\"parameters\":{}}; {\"name\":\"get_weather\","
                           "\"arguments\":{\"city\":\"x\"}}", IPC_TOOLFMT_LLAMA, &c), 2);
    assert_string_equal(c.calls[1].name, "get_weather");
    ipc_tool_calls_free(&c);
}

/* Anything that is not wholly calls of known tools is content. */
static void test_malformed_is_content(void **state)
{
    (void)state;
    static const struct {
        const char *text;
        enum ipc_tool_format fmt;
    } cases[] = {
        {"Just prose.", IPC_TOOLFMT_HERMES},
        {"Just prose.", IPC_TOOLFMT_LLAMA},
        {"<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>", IPC_TOOLFMT_HERMES},
        {"<tool_call>{\"name\": \"launch\", \"arguments\": {}}</tool_call>", IPC_TOOLFMT_HERMES},
        {"<tool_call>{\"name\": \"get_time\"}</tool_call>", IPC_TOOLFMT_HERMES},
        {"<tool_call>{\"name\": \"get_time\", \"arguments\": [1]}</tool_call>", IPC_TOOLFMT_HERMES},
        {"<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call> and more", IPC_TOOLFMT_HERMES},
        {"{\"name\": \"get_time\", \"parameters\": {}} is what I would call", IPC_TOOLFMT_LLAMA},
        {"{\"city\": \"Paris\"}", IPC_TOOLFMT_LLAMA},
        {"{\"name\": \"get_time\", \"parameters\": \"not json\"}", IPC_TOOLFMT_LLAMA},
        {"Here: {\"name\": \"get_time\", \"parameters\": {}}", IPC_TOOLFMT_LLAMA},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct ipc_tool_calls c;
        if (parse(cases[i].text, cases[i].fmt, &c) != 0)
            fail_msg("case %zu read as a call: %s", i, cases[i].text);
        assert_null(c.calls);
        assert_int_equal(c.content_len, strlen(cases[i].text));
        ipc_tool_calls_free(&c);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hermes),
        cmocka_unit_test(test_llama),
        cmocka_unit_test(test_malformed_is_content),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
