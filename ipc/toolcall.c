/* toolcall.c - tool calls read back from the model's text (toolcall.h). */
#include "ipc/toolcall.h"

#include <stdlib.h>
#include <string.h>

static bool is_space(char c)
{
    return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

static size_t skip_space(const char *t, size_t at, size_t len)
{
    while (at < len && is_space(t[at]))
        at++;
    return at;
}

static bool starts(const char *t, size_t at, size_t len, const char *lit)
{
    size_t n = strlen(lit);
    return len - at >= n && !memcmp(t + at, lit, n);
}

static bool known_tool(const json_t *tools, const char *name)
{
    for (size_t i = 0; i < json_array_size(tools); i++)
        if (!strcmp(name, json_string_value(json_object_get(json_object_get(json_array_get(tools, i), "function"),
                                                              "name"))))
            return true;
    return false;
}

/* 1: a call appended; 0: obj is not a call of a known tool; -1: no memory */
static int add_call(struct ipc_tool_calls *out, const json_t *obj, const json_t *tools)
{
    const char *name = json_string_value(json_object_get(obj, "name"));
    const json_t *args = json_object_get(obj, "arguments");
    if (!args)
        args = json_object_get(obj, "parameters");
    json_t *parsed = json_is_string(args) ? json_loads(json_string_value(args), 0, NULL) : NULL;
    if (parsed)
        args = parsed; /* arguments written as a string holding the object */
    bool ok = json_is_object(obj) && name && known_tool(tools, name) && json_is_object(args);
    char *a = ok ? json_dumps(args, JSON_COMPACT) : NULL;
    json_decref(parsed);
    if (!ok)
        return 0;
    struct ipc_tool_call *c = realloc(out->calls, (out->n + 1) * sizeof(*c));
    char *n = strdup(name);
    if (c)
        out->calls = c;
    if (!c || !n || !a) {
        free(n);
        free(a);
        return -1;
    }
    c[out->n++] = (struct ipc_tool_call){n, a};
    return 1;
}

/* One JSON value at t[at, len): *end is where it stops. */
static json_t *load_at(const char *t, size_t at, size_t len, size_t *end)
{
    json_error_t e;
    json_t *v = json_loadb(t + at, len - at, JSON_DISABLE_EOF_CHECK | JSON_ALLOW_NUL, &e);
    if (v)
        *end = at + (size_t)e.position;
    return v;
}

/* <tool_call> blocks to the end of the text, the last one's closing tag
 * optional (generation may stop right after the object). */
static int parse_hermes(const char *t, size_t len, const json_t *tools, struct ipc_tool_calls *out)
{
    const char *open = "<tool_call>", *close = "</tool_call>";
    const char *first = memmem(t, len, open, strlen(open));
    if (!first)
        return 0;
    size_t at = (size_t)(first - t);
    size_t content = at;
    while (content > 0 && is_space(t[content - 1]))
        content--;
    out->content_len = content;
    while (at < len) {
        if (!starts(t, at, len, open))
            return 0;
        at = skip_space(t, at + strlen(open), len);
        size_t end;
        json_t *v = load_at(t, at, len, &end);
        int r = v ? add_call(out, v, tools) : 0;
        json_decref(v);
        if (r <= 0)
            return r;
        at = skip_space(t, end, len);
        if (starts(t, at, len, close))
            at = skip_space(t, at + strlen(close), len);
        else if (at < len)
            return 0;
    }
    return 1;
}

static int parse_llama(const char *t, size_t len, const json_t *tools, struct ipc_tool_calls *out)
{
    size_t at = skip_space(t, 0, len);
    if (starts(t, at, len, "<|python_tag|>"))
        at = skip_space(t, at + strlen("<|python_tag|>"), len);
    out->content_len = 0;
    if (at == len || t[at] != '{')
        return 0;
    while (at < len) {
        size_t end;
        json_t *v = load_at(t, at, len, &end);
        int r = v ? add_call(out, v, tools) : 0;
        json_decref(v);
        if (r <= 0)
            return r;
        at = skip_space(t, end, len);
        if (at < len && t[at] == ';')
            at = skip_space(t, at + 1, len);
    }
    return 1;
}

void ipc_tool_calls_free(struct ipc_tool_calls *c)
{
    for (size_t i = 0; i < c->n; i++) {
        free(c->calls[i].name);
        free(c->calls[i].arguments);
    }
    free(c->calls);
    memset(c, 0, sizeof(*c));
}

enum ipc_status ipc_tool_calls_parse(const char *text, size_t len, enum ipc_tool_format fmt, const json_t *tools,
                                     struct ipc_tool_calls *out)
{
    memset(out, 0, sizeof(*out));
    int r = fmt == IPC_TOOLFMT_HERMES ? parse_hermes(text, len, tools, out) : parse_llama(text, len, tools, out);
    if (r <= 0) {
        ipc_tool_calls_free(out);
        out->content_len = len;
    }
    return r < 0 ? IPC_ENOMEM : IPC_OK;
}
