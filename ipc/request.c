#include "ipc/request.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- typed field readers: each names the field in its error ---------------- */

static bool str_is(const json_t *v, const char *s)
{
    return json_is_string(v) && !strcmp(json_string_value(v), s);
}

static enum ipc_status get_int(const json_t *v, const char *field, long long lo, long long hi, long long *out,
                               struct ipc_error *err)
{
    if (!json_is_integer(v))
        return ipc_fail(err, IPC_EINVAL, field, "%s must be an integer", field);
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return ipc_fail(err, IPC_EINVAL, field, "%s must be between %lld and %lld (got %lld)", field, lo, hi, x);
    *out = x;
    return IPC_OK;
}

static enum ipc_status get_num(const json_t *v, const char *field, double lo, double hi, double *out,
                               struct ipc_error *err)
{
    if (!json_is_number(v))
        return ipc_fail(err, IPC_EINVAL, field, "%s must be a number", field);
    double x = json_number_value(v);
    if (!isfinite(x) || x < lo || x > hi)
        return ipc_fail(err, IPC_EINVAL, field, "%s must be between %g and %g", field, lo, hi);
    *out = x;
    return IPC_OK;
}

/* A sampling parameter: checked after the conversion to float, the type the
 * sampler reads, so that nothing the check passes (1e-300 rounding to 0)
 * is invalid below.  open_lo: the value must stay above lo. */
static enum ipc_status get_float(const json_t *v, const char *field, float lo, float hi, bool open_lo, float *out,
                                 struct ipc_error *err)
{
    double d = 0;
    enum ipc_status st = get_num(v, field, lo, hi, &d, err);
    if (st != IPC_OK)
        return st;
    float x = (float)d;
    if (open_lo && !(x > lo))
        return ipc_fail(err, IPC_EINVAL, field, "%s must be above %g (as a 32-bit float; got %g)", field, lo, d);
    *out = x;
    return IPC_OK;
}

static enum ipc_status get_bool(const json_t *v, const char *field, bool *out, struct ipc_error *err)
{
    if (!json_is_boolean(v))
        return ipc_fail(err, IPC_EINVAL, field, "%s must be true or false", field);
    *out = json_is_true(v);
    return IPC_OK;
}

enum ipc_status ipc_parse_ids(const json_t *arr, const char *field, const struct ipc_limits *lim, int32_t **out,
                              size_t *n, struct ipc_error *err)
{
    *out = NULL;
    *n = 0;
    if (!json_is_array(arr))
        return ipc_fail(err, IPC_EINVAL, field, "%s must be an array of token ids", field);
    size_t len = json_array_size(arr);
    if (len > (size_t)lim->max_context)
        return ipc_fail(err, IPC_ECONTEXT, field, "%s has %zu tokens; the context holds %d", field, len,
                        lim->max_context);
    for (size_t i = 0; i < len; i++) {
        const json_t *e = json_array_get(arr, i);
        if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) >= lim->vocab)
            return ipc_fail(err, IPC_EINVAL, field, "%s[%zu] must be a token id in [0, %d)", field, i, lim->vocab);
    }
    if (!len)
        return IPC_OK;
    int32_t *ids = malloc(len * sizeof(*ids));
    if (!ids)
        return ipc_fail(err, IPC_ENOMEM, field, "no memory for %zu token ids", len);
    for (size_t i = 0; i < len; i++)
        ids[i] = (int32_t)json_integer_value(json_array_get(arr, i));
    *out = ids;
    *n = len;
    return IPC_OK;
}

/* A prompt is text, token ids, or a one-element array of either (OpenAI's
 * batch form, which kvtier serves one prompt per request). */
static enum ipc_status parse_prompt(const json_t *v, const char *field, const struct ipc_limits *lim,
                                    const char **text, size_t *text_len, int32_t **ids, size_t *n_ids,
                                    struct ipc_error *err)
{
    if (json_is_string(v)) {
        *text = json_string_value(v);
        *text_len = json_string_length(v);
        return IPC_OK;
    }
    if (!json_is_array(v))
        return ipc_fail(err, IPC_EINVAL, field, "%s must be a string or an array of token ids", field);
    const json_t *first = json_array_get(v, 0);
    if (first && (json_is_string(first) || json_is_array(first))) {
        if (json_array_size(v) != 1)
            return ipc_fail(err, IPC_ENOTIMPL, field, "%s: several prompts in one request are not supported; send one "
                            "request per prompt", field);
        return parse_prompt(first, field, lim, text, text_len, ids, n_ids, err);
    }
    if (!first)
        return ipc_fail(err, IPC_EINVAL, field, "%s is an empty array", field);
    return ipc_parse_ids(v, field, lim, ids, n_ids, err);
}

static enum ipc_status parse_stops(const json_t *v, struct ipc_gen_req *r, struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    if (json_is_string(v)) {
        if (!json_string_length(v) || json_string_length(v) > IPC_MAX_STOP_LEN)
            return ipc_fail(err, IPC_EINVAL, "stop", "stop must be 1 to %d bytes", IPC_MAX_STOP_LEN);
        r->stops[r->n_stops++] = json_string_value(v);
        return IPC_OK;
    }
    if (!json_is_array(v))
        return ipc_fail(err, IPC_EINVAL, "stop", "stop must be a string or an array of strings");
    if (json_array_size(v) > IPC_MAX_STOPS)
        return ipc_fail(err, IPC_EINVAL, "stop", "stop has more than %d strings", IPC_MAX_STOPS);
    for (size_t i = 0; i < json_array_size(v); i++) {
        const json_t *s = json_array_get(v, i);
        if (!json_is_string(s) || !json_string_length(s) || json_string_length(s) > IPC_MAX_STOP_LEN)
            return ipc_fail(err, IPC_EINVAL, "stop", "stop[%zu] must be a string of 1 to %d bytes", i,
                            IPC_MAX_STOP_LEN);
        r->stops[r->n_stops++] = json_string_value(s);
    }
    return IPC_OK;
}

/* The roles chat templates know; developer is OpenAI's new name for system. */
static enum ipc_status parse_role(const json_t *v, size_t i, const char **role, struct ipc_error *err)
{
    static const char *roles[] = {"system", "user", "assistant", "tool"};
    const char *s = json_string_value(v);
    if (!s)
        return ipc_fail(err, IPC_EINVAL, "messages", "messages[%zu].role must be a string", i);
    if (!strcmp(s, "developer")) {
        *role = "system";
        return IPC_OK;
    }
    for (size_t k = 0; k < sizeof(roles) / sizeof(roles[0]); k++)
        if (!strcmp(s, roles[k])) {
            *role = roles[k];
            return IPC_OK;
        }
    if (!strcmp(s, "function"))
        return ipc_fail(err, IPC_ENOTIMPL, "messages", "messages[%zu]: role \"function\" (deprecated) is not "
                        "supported; use \"tool\"", i);
    return ipc_fail(err, IPC_EINVAL, "messages",
                    "messages[%zu].role \"%.32s\" is not one of system, developer, user, assistant, tool", i, s);
}

/* content: a string, null (an assistant's turn that only calls tools), or
 * an array of {"type":"text","text":...} parts, joined into one string. */
static enum ipc_status parse_content(const json_t *v, size_t i, const char *role, json_t **out, struct ipc_error *err)
{
    if (json_is_string(v)) {
        *out = json_incref((json_t *)v);
        return IPC_OK;
    }
    if ((json_is_null(v) || !v) && !strcmp(role, "assistant")) {
        *out = json_null();
        return IPC_OK;
    }
    if (!json_is_array(v))
        return ipc_fail(err, IPC_EINVAL, "messages", "messages[%zu].content must be a string or an array of parts", i);
    size_t total = 0;
    for (size_t k = 0; k < json_array_size(v); k++) {
        const json_t *part = json_array_get(v, k);
        const char *type = json_string_value(json_object_get(part, "type"));
        if (!json_is_object(part) || !type)
            return ipc_fail(err, IPC_EINVAL, "messages", "messages[%zu].content[%zu] must be an object with a type", i,
                            k);
        if (strcmp(type, "text") != 0)
            return ipc_fail(err, IPC_ENOTIMPL, "messages", "messages[%zu].content[%zu]: part type \"%.32s\" is not "
                            "supported (text only)", i, k, type);
        const json_t *t = json_object_get(part, "text");
        if (!json_is_string(t))
            return ipc_fail(err, IPC_EINVAL, "messages", "messages[%zu].content[%zu].text must be a string", i, k);
        total += json_string_length(t);
    }
    char *joined = malloc(total + 1);
    if (!joined)
        return ipc_fail(err, IPC_ENOMEM, "messages", "no memory for messages[%zu]", i);
    size_t off = 0;
    for (size_t k = 0; k < json_array_size(v); k++) {
        const json_t *t = json_object_get(json_array_get(v, k), "text");
        memcpy(joined + off, json_string_value(t), json_string_length(t));
        off += json_string_length(t);
    }
    *out = json_stringn(joined, off);
    free(joined);
    return *out ? IPC_OK : ipc_fail(err, IPC_ENOMEM, "messages", "no memory for messages[%zu]", i);
}

/* tool_calls of an assistant message, OpenAI's shape.  Arguments arrive as
 * a JSON string; templates (Llama 3.x) expect the object, as transformers
 * documents, so one that parses is passed parsed. */
static enum ipc_status parse_tool_calls(const json_t *v, size_t i, json_t **out, struct ipc_error *err)
{
    if (!json_is_array(v))
        return ipc_fail(err, IPC_EINVAL, "messages", "messages[%zu].tool_calls must be an array", i);
    json_t *calls = json_array();
    if (!calls)
        return ipc_fail(err, IPC_ENOMEM, "messages", "no memory for messages[%zu]", i);
    for (size_t k = 0; k < json_array_size(v); k++) {
        const json_t *c = json_array_get(v, k), *f = json_object_get(c, "function");
        const json_t *args = json_object_get(f, "arguments");
        if (!json_is_object(c) || !json_is_object(f) || !json_is_string(json_object_get(f, "name")) ||
            (args && !json_is_string(args) && !json_is_object(args))) {
            json_decref(calls);
            return ipc_fail(err, IPC_EINVAL, "messages", "messages[%zu].tool_calls[%zu] must be {\"type\": "
                            "\"function\", \"function\": {\"name\": string, \"arguments\": string}}", i, k);
        }
        json_t *copy = json_deep_copy(c), *parsed = NULL;
        if (json_is_string(args))
            parsed = json_loadb(json_string_value(args), json_string_length(args), JSON_DECODE_ANY, NULL);
        if (copy && json_is_object(parsed))
            json_object_set(json_object_get(copy, "function"), "arguments", parsed);
        json_decref(parsed);
        if (!copy || json_array_append_new(calls, copy)) {
            json_decref(calls);
            return ipc_fail(err, IPC_ENOMEM, "messages", "no memory for messages[%zu]", i);
        }
    }
    *out = calls;
    return IPC_OK;
}

/* An assistant message's fields OpenAI defines that kvtier cannot render:
 * a null one is what the SDKs send back of a reply that had none (openai-node's
 * stream helpers write "refusal": null into every message they assemble), so it
 * is accepted and dropped; any other value is refused by name. */
static const char *const absent_ok[] = {"refusal", "audio", "function_call"};

/* One message as the chat template sees it: role, content and, when given,
 * name, tool_calls, tool_call_id and reasoning_content. */
static enum ipc_status parse_message(const json_t *m, size_t i, json_t *out, struct ipc_error *err)
{
    if (!json_is_object(m))
        return ipc_fail(err, IPC_EINVAL, "messages", "messages[%zu] must be an object", i);
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)m, key, val)
    {
        bool absent = false;
        for (size_t k = 0; k < sizeof(absent_ok) / sizeof(absent_ok[0]); k++)
            if (!strcmp(key, absent_ok[k])) {
                if (!json_is_null(val))
                    return ipc_fail(err, IPC_ENOTIMPL, "messages", "messages[%zu].%s is not supported by kvtier "
                                    "(only null)", i, key);
                absent = true;
            }
        if (absent)
            continue;
        if (strcmp(key, "role") && strcmp(key, "content") && strcmp(key, "name") && strcmp(key, "tool_calls") &&
            strcmp(key, "tool_call_id") && strcmp(key, "reasoning_content"))
            return ipc_fail(err, IPC_EINVAL, "messages", "messages[%zu]: field \"%.32s\" is not supported", i, key);
        if (strcmp(key, "role") && strcmp(key, "content") && strcmp(key, "tool_calls") && !json_is_string(val) &&
            !json_is_null(val))
            return ipc_fail(err, IPC_EINVAL, "messages", "messages[%zu].%s must be a string", i, key);
    }
    const char *role = "";
    json_t *content = NULL, *calls = NULL;
    enum ipc_status st = parse_role(json_object_get(m, "role"), i, &role, err);
    if (st == IPC_OK)
        st = parse_content(json_object_get(m, "content"), i, role, &content, err);
    const json_t *tc = json_object_get(m, "tool_calls");
    if (st == IPC_OK && tc && !json_is_null(tc)) {
        if (strcmp(role, "assistant"))
            st = ipc_fail(err, IPC_EINVAL, "messages", "messages[%zu]: only an assistant message has tool_calls", i);
        else
            st = parse_tool_calls(tc, i, &calls, err);
    }
    if (st != IPC_OK) {
        json_decref(content);
        json_decref(calls);
        return st;
    }
    /* json_object_set_new takes the value even when it fails */
    bool oom = json_object_set_new(out, "role", json_string(role)) != 0;
    oom |= json_object_set_new(out, "content", content) != 0;
    oom |= calls && json_object_set_new(out, "tool_calls", calls) != 0;
    if (oom)
        st = ipc_fail(err, IPC_ENOMEM, "messages", "no memory for messages[%zu]", i);
    static const char *copied[] = {"name", "tool_call_id", "reasoning_content"};
    for (size_t k = 0; st == IPC_OK && k < sizeof(copied) / sizeof(copied[0]); k++) {
        json_t *x = json_object_get(m, copied[k]);
        if (json_is_string(x) && json_object_set(out, copied[k], x))
            st = ipc_fail(err, IPC_ENOMEM, "messages", "no memory for messages[%zu]", i);
    }
    return st;
}

static enum ipc_status parse_messages(const json_t *v, const struct ipc_limits *lim, struct ipc_gen_req *r,
                                      struct ipc_error *err)
{
    if (!json_is_array(v) || !json_array_size(v))
        return ipc_fail(err, IPC_EINVAL, "messages", "messages must be a non-empty array");
    size_t n = json_array_size(v);
    if (n > (size_t)lim->max_messages)
        return ipc_fail(err, IPC_EINVAL, "messages", "messages has %zu entries; the limit is %d", n, lim->max_messages);
    if (!(r->messages = json_array()))
        return ipc_fail(err, IPC_ENOMEM, "messages", "no memory for %zu messages", n);
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_object();
        if (!m || json_array_append_new(r->messages, m))
            return ipc_fail(err, IPC_ENOMEM, "messages", "no memory for %zu messages", n);
        enum ipc_status st = parse_message(json_array_get(v, i), i, m, err);
        if (st != IPC_OK)
            return st;
    }
    return IPC_OK;
}

/* ---- the field table -------------------------------------------------------- */

static bool given(const json_t *root, const char *key);

enum { F_COMPL = 1, F_CHAT = 2, F_BOTH = 3 };

struct field_ctx {
    struct ipc_gen_req *r;
    const struct ipc_limits *lim;
    const json_t *root;
};

typedef enum ipc_status (*field_fn)(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err);

static enum ipc_status f_ignore(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    (void)v, (void)name, (void)c, (void)err;
    return IPC_OK;
}

static enum ipc_status f_string(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    (void)c;
    if (!json_is_string(v) && !json_is_null(v))
        return ipc_fail(err, IPC_EINVAL, name, "%s must be a string", name);
    return IPC_OK;
}

static bool model_matches(const char *name, const struct ipc_limits *lim)
{
    const char *id = lim->model_id;
    size_t n = strlen(id);
    return !strcmp(name, id) || (!strncmp(name, id, n) && !strcmp(name + n, ":latest")) ||
           (lim->model_dir && !strcmp(name, lim->model_dir));
}

enum ipc_status ipc_check_model(const json_t *v, const struct ipc_limits *lim, struct ipc_error *err)
{
    if (!v || json_is_null(v))
        return IPC_OK;
    if (!json_is_string(v))
        return ipc_fail(err, IPC_EINVAL, "model", "model must be a string");
    if (!lim->model_id || model_matches(json_string_value(v), lim))
        return IPC_OK;
    return ipc_fail(err, IPC_ENOMODEL, "model", "the model \"%.64s\" does not exist; this daemon serves \"%.64s\"",
                    json_string_value(v), lim->model_id);
}

static enum ipc_status f_model(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    (void)name;
    return ipc_check_model(v, c->lim, err);
}

/* A duration as Go's time.ParseDuration reads it, which Ollama parses a
 * keep_alive string with: an optional sign, then "0" or one or more
 * numbers (digits, a fraction or both) each with a unit. */
static bool go_duration(const char *s)
{
    static const char *const units[] = {"ns", "us", "\u00b5s", "\u03bcs", "ms", "s", "m", "h"};
    if (*s == '-' || *s == '+')
        s++;
    if (!strcmp(s, "0"))
        return true;
    if (!*s)
        return false;
    while (*s) {
        const char *d = s;
        while (*s >= '0' && *s <= '9')
            s++;
        bool whole = s > d;
        if (*s == '.') {
            const char *f = ++s;
            while (*s >= '0' && *s <= '9')
                s++;
            if (!whole && s == f)
                return false;
        } else if (!whole) {
            return false;
        }
        size_t best = 0; /* the longest unit that matches: "ms", not "m" then "s" */
        for (size_t i = 0; i < sizeof(units) / sizeof(units[0]); i++) {
            size_t n = strlen(units[i]);
            if (n > best && !strncmp(s, units[i], n))
                best = n;
        }
        if (!best)
            return false;
        s += best;
    }
    return true;
}

/* Fields other servers accept that change nothing here: the type is
 * checked, the value documented as having no effect. */
static enum ipc_status f_noop(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    (void)c;
    static const char *const efforts[] = {"none", "minimal", "low", "medium", "high"};
    if (json_is_null(v))
        return IPC_OK;
    if (!strcmp(name, "cache_prompt"))
        return json_is_boolean(v) ? IPC_OK : ipc_fail(err, IPC_EINVAL, name, "%s must be true or false", name);
    if (!strcmp(name, "keep_alive"))
        return (json_is_string(v) && go_duration(json_string_value(v))) || json_is_number(v)
                   ? IPC_OK
                   : ipc_fail(err, IPC_EINVAL, name, "%s must be a duration (\"5m\", \"1h30m\", \"-1s\") or a "
                              "number of seconds", name);
    for (size_t i = 0; i < sizeof(efforts) / sizeof(efforts[0]); i++)
        if (str_is(v, efforts[i]))
            return IPC_OK;
    return ipc_fail(err, IPC_EINVAL, name, "%s must be one of none, minimal, low, medium, high", name);
}

static enum ipc_status f_input(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    c->r->has_input = true;
    return parse_prompt(v, name, c->lim, &c->r->input_text, &c->r->input_text_len, &c->r->input_ids,
                        &c->r->n_input_ids, err);
}

static enum ipc_status f_prompt(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    /* a sink session's whole conversation may be longer than the context:
     * the bound here is the sink's, the context's is checked once the
     * session's cache is known */
    struct ipc_limits wide = *c->lim;
    if (wide.max_context < IPC_MAX_SINK_TOKENS)
        wide.max_context = IPC_MAX_SINK_TOKENS;
    enum ipc_status st = parse_prompt(v, name, &wide, &c->r->text, &c->r->text_len, &c->r->ids, &c->r->n_ids, err);
    if (st == IPC_ECONTEXT)
        st = ipc_fail(err, st, name, "%s has more than %d tokens; the context holds %d (a sink session's whole "
                      "conversation, %d)", name, wide.max_context, c->lim->max_context, wide.max_context);
    return st;
}

static enum ipc_status f_messages(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    (void)name;
    return parse_messages(v, c->lim, c->r, err);
}

static enum ipc_status f_max_tokens(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    long long x = 0;
    /* a sink cache may go past the context: ipc_gen_req_parse checks the
     * context bound once the cache is known */
    int hi = c->lim->max_context > IPC_MAX_SINK_TOKENS ? c->lim->max_context : IPC_MAX_SINK_TOKENS;
    enum ipc_status st = get_int(v, name, 1, hi, &x, err);
    c->r->max_tokens = (int)x;
    c->r->max_tokens_field = name;
    return st;
}

/* null keeps the default (ipc_gen_req_parse set it) */
static enum ipc_status f_temperature(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    return json_is_null(v) ? IPC_OK : get_float(v, name, 0, 2, false, &c->r->sampling.temperature, err);
}

static enum ipc_status f_top_p(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    return json_is_null(v) ? IPC_OK : get_float(v, name, 0, 1, true, &c->r->sampling.top_p, err);
}

static enum ipc_status f_min_p(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    return json_is_null(v) ? IPC_OK : get_float(v, name, 0, 1, false, &c->r->sampling.min_p, err);
}

static enum ipc_status f_top_k(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    long long x = 0;
    /* -1 is vLLM's "off", 0 is HF's */
    enum ipc_status st = json_is_null(v) ? IPC_OK : get_int(v, name, -1, c->lim->vocab, &x, err);
    c->r->sampling.top_k = x < 0 ? 0 : (int)x;
    return st;
}

static enum ipc_status f_rep_penalty(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    return json_is_null(v) ? IPC_OK : get_float(v, name, 0.01f, 10, false, &c->r->sampling.repetition_penalty, err);
}

/* OpenAI's range for both */
static enum ipc_status f_count_penalty(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    return get_float(v, name, -2, 2, false,
                     !strcmp(name, "presence_penalty") ? &c->r->sampling.presence_penalty
                                                       : &c->r->sampling.frequency_penalty,
                     err);
}

static enum ipc_status f_typical_p(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    return json_is_null(v) ? IPC_OK : get_float(v, name, 0, 1, true, &c->r->sampling.typical_p, err);
}

/* llama.cpp's repeat_penalty is repetition_penalty over the last
 * repeat_last_n tokens (64 unless given; -1: all, 0: none); both are read
 * once the walk is done, so only the types are checked here. */
static enum ipc_status f_repeat(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    (void)c;
    if (json_is_null(v) || (!strcmp(name, "repeat_penalty") ? json_is_number(v) : json_is_integer(v)))
        return IPC_OK;
    return ipc_fail(err, IPC_EINVAL, name, "%s must be %s", name,
                    !strcmp(name, "repeat_penalty") ? "a number" : "an integer");
}

static enum ipc_status read_repeat(const json_t *root, struct ipc_gen_req *r, const struct ipc_limits *lim,
                                   struct ipc_error *err)
{
    const json_t *pen = json_object_get(root, "repeat_penalty"), *last = json_object_get(root, "repeat_last_n");
    if (!pen || json_is_null(pen))
        return IPC_OK;
    if (given(root, "repetition_penalty"))
        return ipc_fail(err, IPC_EINVAL, "repeat_penalty", "give one of repeat_penalty and repetition_penalty");
    enum ipc_status st = get_float(pen, "repeat_penalty", 0.01f, 10, false, &r->sampling.repetition_penalty, err);
    long long n = 64;
    if (st == IPC_OK && last && !json_is_null(last))
        st = get_int(last, "repeat_last_n", -1, lim->max_context, &n, err);
    if (st != IPC_OK)
        return st;
    if (n == 0)
        r->sampling.repetition_penalty = 1;
    r->sampling.penalty_last_n = n < 0 ? 0 : (int)n;
    return IPC_OK;
}

static enum ipc_status f_seed(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    if (!json_is_integer(v))
        return ipc_fail(err, IPC_EINVAL, name, "%s must be an integer", name);
    c->r->sampling.seed = (uint64_t)json_integer_value(v);
    c->r->has_seed = true;
    return IPC_OK;
}

static enum ipc_status f_stop(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    (void)name;
    return parse_stops(v, c->r, err);
}

static enum ipc_status f_n(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    long long x = 1;
    enum ipc_status st = json_is_null(v) ? IPC_OK : get_int(v, name, 1, c->lim->max_n, &x, err);
    c->r->n = (int)x;
    return st;
}

/* Positive counts bounded by the choices a request may have; min_tokens
 * and no_repeat_ngram_size by the context. */
static enum ipc_status f_count(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    struct ipc_gen_req *r = c->r;
    bool ctx = !strcmp(name, "min_tokens") || !strcmp(name, "no_repeat_ngram_size");
    long long x = 0;
    enum ipc_status st = get_int(v, name, ctx ? 0 : 1, ctx ? c->lim->max_context : c->lim->max_n, &x, err);
    int *dst = !strcmp(name, "best_of") ? &r->best_of
               : !strcmp(name, "num_beams") ? &r->num_beams
               : !strcmp(name, "num_beam_groups") ? &r->num_beam_groups
               : !strcmp(name, "num_return_sequences") ? &r->num_return_sequences
               : !strcmp(name, "min_tokens") ? &r->min_tokens : &r->no_repeat_ngram_size;
    if (st == IPC_OK)
        *dst = (int)x;
    return st;
}

static enum ipc_status f_length_penalty(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    return json_is_null(v) ? IPC_OK : get_float(v, name, -100, 100, false, &c->r->length_penalty, err);
}

/* Hugging Face's early_stopping: true, false or "never". */
static enum ipc_status f_early_stopping(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    if (json_is_null(v) || json_is_false(v))
        c->r->early_stopping = BEAM_EARLY_FALSE;
    else if (json_is_true(v))
        c->r->early_stopping = BEAM_EARLY_TRUE;
    else if (str_is(v, "never"))
        c->r->early_stopping = BEAM_EARLY_NEVER;
    else
        return ipc_fail(err, IPC_EINVAL, name, "early_stopping must be true, false or \"never\"");
    return IPC_OK;
}

static enum ipc_status f_diversity_penalty(const json_t *v, const char *name, struct field_ctx *c,
                                           struct ipc_error *err)
{
    return json_is_null(v) ? IPC_OK : get_float(v, name, 0, 1000, false, &c->r->diversity_penalty, err);
}

static enum ipc_status f_flag(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    bool x = false;
    enum ipc_status st = json_is_null(v) ? IPC_OK : get_bool(v, name, &x, err);
    if (!strcmp(name, "stream"))
        c->r->stream = x;
    else if (!strcmp(name, "ignore_eos"))
        c->r->ignore_eos = x;
    else if (!strcmp(name, "private"))
        c->r->private_kv = x;
    else
        c->r->return_tokens = x;
    return st;
}

static enum ipc_status f_shared_prefix(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    if (json_is_string(v)) {
        c->r->shared_text = json_string_value(v);
        c->r->shared_text_len = json_string_length(v);
        return IPC_OK;
    }
    if (!json_is_integer(v))
        return ipc_fail(err, IPC_EINVAL, name, "%s must be a number of prompt tokens or the text the prompt starts with",
                        name);
    return get_int(v, name, 0, c->lim->max_context, &c->r->shared_tokens, err);
}

static enum ipc_status f_stream_options(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    if (!json_is_object(v))
        return ipc_fail(err, IPC_EINVAL, name, "stream_options must be an object");
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)v, key, val)
    {
        if (strcmp(key, "include_usage") != 0)
            return ipc_fail(err, IPC_EINVAL, name, "stream_options.%.32s is not a known option (include_usage)", key);
        enum ipc_status st = get_bool(val, "stream_options.include_usage", &c->r->include_usage, err);
        if (st != IPC_OK)
            return st;
    }
    return IPC_OK;
}

/* completions: logprobs is the number of alternatives (0..20); chat: a
 * boolean with top_logprobs beside it. */
static enum ipc_status f_logprobs(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    if (c->r->chat)
        return get_bool(v, name, &c->r->logprobs, err);
    long long x = 0;
    enum ipc_status st = get_int(v, name, 0, IPC_MAX_TOP_LOGPROBS, &x, err);
    c->r->logprobs = true;
    c->r->top_logprobs = (int)x;
    return st;
}

static enum ipc_status f_top_logprobs(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    long long x = 0;
    enum ipc_status st = get_int(v, name, 0, IPC_MAX_TOP_LOGPROBS, &x, err);
    c->r->top_logprobs = (int)x;
    if (st == IPC_OK && !json_is_true(json_object_get(c->root, "logprobs")))
        return ipc_fail(err, IPC_EINVAL, name, "top_logprobs needs \"logprobs\": true");
    return st;
}

static enum ipc_status f_session(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    if (!json_is_string(v) || !json_string_length(v) || json_string_length(v) > IPC_SESSION_ID_MAX)
        return ipc_fail(err, IPC_EINVAL, name, "session must be a session id string");
    c->r->session = json_string_value(v);
    return IPC_OK;
}

static enum ipc_status f_cache(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    (void)v, (void)name, (void)err;
    c->r->cache_given = true;
    return IPC_OK; /* both cache fields are read together once the walk is done */
}

/* A grammar's compile error as the request's 400, naming the keyword. */
static enum ipc_status gram_error(enum text_status ts, const char *field, const char *msg, struct ipc_error *err)
{
    return ipc_fail(err, ts == TEXT_ENOMEM ? IPC_ENOMEM : IPC_EINVAL, field, "%s: %s", field, msg);
}

/* response_format: text, json_object, or json_schema {name, description,
 * schema, strict}.  The output is constrained to the schema whatever
 * strict says. */
static enum ipc_status f_response_format(const json_t *v, const char *name, struct field_ctx *c,
                                         struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    const char *type = json_string_value(json_object_get(v, "type"));
    if (!json_is_object(v) || !type)
        return ipc_fail(err, IPC_EINVAL, name, "response_format must be an object with a type");
    const json_t *js = json_object_get(v, "json_schema");
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)v, key, val)
    {
        if (strcmp(key, "type") && !(js && !strcmp(key, "json_schema")))
            return ipc_fail(err, IPC_EINVAL, name, "response_format: unknown field \"%.48s\"", key);
    }
    if (!strcmp(type, "text"))
        return IPC_OK;
    char msg[TEXT_ERR_LEN];
    const char *bad;
    enum text_status ts;
    if (!strcmp(type, "json_object")) {
        ts = gram_compile(NULL, &c->r->grammar, &bad, msg);
    } else if (!strcmp(type, "json_schema")) {
        if (!json_is_object(js) || !json_is_object(json_object_get(js, "schema")))
            return ipc_fail(err, IPC_EINVAL, name, "response_format json_schema needs \"json_schema\": {\"schema\": "
                            "{...}}");
        json_object_foreach((json_t *)js, key, val)
        {
            if (strcmp(key, "name") && strcmp(key, "description") && strcmp(key, "schema") && strcmp(key, "strict"))
                return ipc_fail(err, IPC_EINVAL, name, "response_format.json_schema: unknown field \"%.48s\"", key);
        }
        ts = gram_compile(json_object_get(js, "schema"), &c->r->grammar, &bad, msg);
    } else {
        return ipc_fail(err, IPC_EINVAL, name, "response_format type \"%.32s\" is not one of text, json_object, "
                        "json_schema", type);
    }
    return ts == TEXT_OK ? IPC_OK : gram_error(ts, name, msg, err);
}

/* A tool's name: OpenAI's rule, which also keeps it plain in a prompt. */
static bool tool_name_ok(const char *s)
{
    size_t n = strlen(s);
    if (!n || n > 64)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') ||
              s[i] == '_' || s[i] == '-'))
            return false;
    return true;
}

static enum ipc_status f_tools(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    if (!json_is_array(v) || json_array_size(v) > IPC_MAX_TOOLS)
        return ipc_fail(err, IPC_EINVAL, name, "tools must be an array of at most %d tools", IPC_MAX_TOOLS);
    for (size_t i = 0; i < json_array_size(v); i++) {
        const json_t *t = json_array_get(v, i), *f = json_object_get(t, "function");
        const char *fname = json_string_value(json_object_get(f, "name"));
        const json_t *params = json_object_get(f, "parameters");
        if (!str_is(json_object_get(t, "type"), "function") || !json_is_object(f) || !fname)
            return ipc_fail(err, IPC_EINVAL, name, "tools[%zu] must be {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}", i);
        if (!tool_name_ok(fname))
            return ipc_fail(err, IPC_EINVAL, name, "tools[%zu].function.name must be 1 to 64 letters, digits, _ or -",
                            i);
        if (params && !json_is_object(params))
            return ipc_fail(err, IPC_EINVAL, name, "tools[%zu].function.parameters must be a JSON schema object", i);
        for (size_t k = 0; k < i; k++)
            if (!strcmp(fname, json_string_value(json_object_get(json_object_get(json_array_get(v, k), "function"),
                                                                 "name"))))
                return ipc_fail(err, IPC_EINVAL, name, "tools[%zu]: the name \"%s\" is given twice", i, fname);
    }
    c->r->tools = json_array_size(v) ? v : NULL;
    return IPC_OK;
}

static enum ipc_status f_documents(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    if (!json_is_array(v) || json_array_size(v) > IPC_MAX_DOCUMENTS)
        return ipc_fail(err, IPC_EINVAL, name, "documents must be an array of at most %d objects", IPC_MAX_DOCUMENTS);
    for (size_t i = 0; i < json_array_size(v); i++) {
        const json_t *d = json_array_get(v, i), *val;
        const char *key;
        if (!json_is_object(d))
            return ipc_fail(err, IPC_EINVAL, name, "documents[%zu] must be an object of strings", i);
        json_object_foreach((json_t *)d, key, val)
        {
            if (!json_is_string(val))
                return ipc_fail(err, IPC_EINVAL, name, "documents[%zu].%.64s must be a string", i, key);
        }
    }
    c->r->documents = json_array_size(v) ? v : NULL;
    return IPC_OK;
}

/* The variables a chat template sees already, which the client's own
 * cannot replace. */
static const char *const template_vars[] = {"messages", "tools", "documents", "add_generation_prompt",
                                            "continue_final_message", "bos_token", "eos_token"};

static enum ipc_status f_template_kwargs(const json_t *v, const char *name, struct field_ctx *c,
                                         struct ipc_error *err)
{
    if (json_is_null(v))
        return IPC_OK;
    if (!json_is_object(v) || json_object_size(v) > IPC_MAX_TEMPLATE_KWARGS)
        return ipc_fail(err, IPC_EINVAL, name, "chat_template_kwargs must be an object of at most %d variables",
                        IPC_MAX_TEMPLATE_KWARGS);
    for (size_t i = 0; i < sizeof template_vars / sizeof template_vars[0]; i++)
        if (json_object_get(v, template_vars[i]))
            return ipc_fail(err, IPC_EINVAL, name, "chat_template_kwargs.%s is set by the request itself",
                            template_vars[i]);
    c->r->template_kwargs = json_object_size(v) ? v : NULL;
    return IPC_OK;
}

/* add_generation_prompt and continue_final_message: checked here, read
 * together once the walk is done (chat_end). */
static enum ipc_status f_chat_end(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    (void)c;
    if (!json_is_null(v) && !json_is_boolean(v))
        return ipc_fail(err, IPC_EINVAL, name, "%s must be true or false", name);
    return IPC_OK;
}

/* Continuing the final message leaves the assistant's header out:
 * add_generation_prompt defaults to false then, and true with it is
 * refused, as vLLM and transformers refuse it. */
static enum ipc_status chat_end(const json_t *root, struct ipc_gen_req *r, struct ipc_error *err)
{
    const json_t *gen = json_object_get(root, "add_generation_prompt");
    if (!json_is_true(json_object_get(root, "continue_final_message"))) {
        r->chat_end = json_is_false(gen) ? IPC_CHAT_CLOSED : IPC_CHAT_GENERATE;
        return IPC_OK;
    }
    if (json_is_true(gen))
        return ipc_fail(err, IPC_EINVAL, "continue_final_message", "continue_final_message and "
                        "add_generation_prompt cannot both be true: the first continues the final message, the "
                        "second starts a new assistant message after it");
    r->chat_end = IPC_CHAT_CONTINUE;
    return IPC_OK;
}

/* tool_choice is read once the walk is done: it needs the tools. */
static enum ipc_status tool_choice(const json_t *root, struct ipc_gen_req *r, struct ipc_error *err)
{
    const json_t *v = json_object_get(root, "tool_choice");
    const char *field = "tool_choice";
    const char *want = NULL;
    if (!v || json_is_null(v) || str_is(v, "auto")) {
        r->tool_choice = IPC_TOOLS_AUTO;
    } else if (str_is(v, "none")) {
        r->tool_choice = IPC_TOOLS_NONE;
    } else if (str_is(v, "required")) {
        r->tool_choice = IPC_TOOLS_REQUIRED;
    } else if (json_is_object(v) && str_is(json_object_get(v, "type"), "function") &&
               (want = json_string_value(json_object_get(json_object_get(v, "function"), "name")))) {
        r->tool_choice = IPC_TOOLS_NAMED;
    } else {
        return ipc_fail(err, IPC_EINVAL, field, "tool_choice must be \"none\", \"auto\", \"required\" or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
    if (r->tool_choice < IPC_TOOLS_REQUIRED)
        return IPC_OK;
    if (!r->tools)
        return ipc_fail(err, IPC_EINVAL, field, "tool_choice asks for a call but tools is empty or missing");
    if (r->grammar)
        return ipc_fail(err, IPC_EINVAL, field, "a forced tool_choice and response_format both constrain the "
                        "output; give one of them");
    const char *names[IPC_MAX_TOOLS];
    const json_t *params[IPC_MAX_TOOLS];
    int n = 0;
    for (size_t i = 0; i < json_array_size(r->tools); i++) {
        const json_t *f = json_object_get(json_array_get(r->tools, i), "function");
        const char *fname = json_string_value(json_object_get(f, "name"));
        if (want && strcmp(want, fname))
            continue;
        names[n] = fname;
        params[n++] = json_object_get(f, "parameters");
    }
    if (!n)
        return ipc_fail(err, IPC_EINVAL, field, "tool_choice names \"%.64s\", which is not in tools", want);
    char msg[TEXT_ERR_LEN];
    const char *bad;
    enum text_status ts = gram_compile_calls(names, params, n, &r->grammar, &bad, msg);
    return ts == TEXT_OK ? IPC_OK : gram_error(ts, "tools", msg, err);
}

/* Known fields that would change the output: accepted only with the value
 * that means "off", so nothing is silently ignored. */
static enum ipc_status f_must_be_off(const json_t *v, const char *name, struct field_ctx *c, struct ipc_error *err)
{
    (void)c;
    bool off = json_is_null(v) || json_is_false(v) || (json_is_number(v) && json_number_value(v) == 0) ||
               (json_is_string(v) && !json_string_length(v)) || (json_is_object(v) && !json_object_size(v)) ||
               (json_is_array(v) && !json_array_size(v));
    if (off)
        return IPC_OK;
    return ipc_fail(err, IPC_ENOTIMPL, name, "%s is not supported by kvtier", name);
}

static const struct {
    const char *name;
    int where;
    field_fn fn;
} fields[] = {
    {"model", F_BOTH, f_model},
    {"user", F_BOTH, f_string},
    {"prompt", F_COMPL, f_prompt},
    {"input", F_COMPL, f_input},
    {"messages", F_CHAT, f_messages},
    {"max_tokens", F_BOTH, f_max_tokens},
    {"max_completion_tokens", F_CHAT, f_max_tokens},
    {"temperature", F_BOTH, f_temperature},
    {"top_p", F_BOTH, f_top_p},
    {"top_k", F_BOTH, f_top_k},
    {"min_p", F_BOTH, f_min_p},
    {"repetition_penalty", F_BOTH, f_rep_penalty},
    {"seed", F_BOTH, f_seed},
    {"stop", F_BOTH, f_stop},
    {"n", F_BOTH, f_n},
    {"stream", F_BOTH, f_flag},
    {"ignore_eos", F_BOTH, f_flag},
    {"return_tokens", F_BOTH, f_flag},
    {"private", F_BOTH, f_flag},
    {"shared_prefix", F_COMPL, f_shared_prefix},
    {"stream_options", F_BOTH, f_stream_options},
    {"logprobs", F_BOTH, f_logprobs},
    {"top_logprobs", F_CHAT, f_top_logprobs},
    {"session", F_BOTH, f_session},
    {"cache", F_BOTH, f_cache},
    {"use_cache", F_BOTH, f_cache},
    {"metadata", F_BOTH, f_ignore},
    {"store", F_BOTH, f_ignore},
    {"service_tier", F_BOTH, f_ignore},
    {"parallel_tool_calls", F_CHAT, f_ignore},
    {"presence_penalty", F_BOTH, f_count_penalty},
    {"frequency_penalty", F_BOTH, f_count_penalty},
    {"repeat_penalty", F_BOTH, f_repeat},
    {"repeat_last_n", F_BOTH, f_repeat},
    {"typical_p", F_BOTH, f_typical_p},
    {"cache_prompt", F_BOTH, f_noop},
    {"keep_alive", F_BOTH, f_noop},
    {"reasoning_effort", F_BOTH, f_noop},
    {"logit_bias", F_BOTH, f_must_be_off},
    {"echo", F_COMPL, f_must_be_off},
    {"suffix", F_COMPL, f_must_be_off},
    {"best_of", F_COMPL, f_count},
    {"num_beams", F_BOTH, f_count},
    {"num_return_sequences", F_BOTH, f_count},
    {"min_tokens", F_BOTH, f_count},
    {"no_repeat_ngram_size", F_BOTH, f_count},
    {"length_penalty", F_BOTH, f_length_penalty},
    {"early_stopping", F_BOTH, f_early_stopping},
    {"num_beam_groups", F_BOTH, f_count},
    {"diversity_penalty", F_BOTH, f_diversity_penalty},
    {"tools", F_CHAT, f_tools},
    {"documents", F_CHAT, f_documents},
    {"chat_template_kwargs", F_CHAT, f_template_kwargs},
    {"add_generation_prompt", F_CHAT, f_chat_end},
    {"continue_final_message", F_CHAT, f_chat_end},
    {"functions", F_CHAT, f_must_be_off},
    {"tool_choice", F_CHAT, f_ignore},
    {"response_format", F_BOTH, f_response_format},
};

/* A field of the request that is there and not null. */
static bool given(const json_t *root, const char *key)
{
    const json_t *v = json_object_get(root, key);
    return v && !json_is_null(v);
}

/* Beam search is deterministic and returns its choices at the end: what
 * samples, streams or asks for per-token alternatives does not combine
 * with it, and is refused naming the field rather than ignored. */
static enum ipc_status check_beams(const json_t *root, struct ipc_gen_req *r, struct ipc_error *err)
{
    if (!r->num_return_sequences)
        r->num_return_sequences = 1;
    if (r->num_return_sequences > r->num_beams)
        return ipc_fail(err, IPC_EINVAL, "num_return_sequences",
                        "num_return_sequences (%d) must be at most num_beams (%d)", r->num_return_sequences,
                        r->num_beams);
    if (r->stream)
        return ipc_fail(err, IPC_EINVAL, "stream",
                        "stream is not available with num_beams > 1: the beams are reordered and replaced "
                        "until the search ends, so no token is final before then");
    static const char *const refused[] = {"n", "best_of", "logprobs", "top_logprobs", "stop"};
    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
        const json_t *v = json_object_get(root, refused[i]);
        bool off = !v || json_is_null(v) || json_is_false(v) || (json_is_integer(v) && json_integer_value(v) == 1 &&
                                                                  strcmp(refused[i], "logprobs") != 0) ||
                   (json_is_array(v) && !json_array_size(v));
        if (!off)
            return ipc_fail(err, IPC_EINVAL, refused[i], "%s is not available with num_beams > 1%s", refused[i],
                            !strcmp(refused[i], "n") ? " (the beams returned are num_return_sequences)" : "");
    }
    if (r->num_beam_groups > 1 && (r->num_beams % r->num_beam_groups || !(r->diversity_penalty > 0)))
        return ipc_fail(err, IPC_EINVAL, "num_beam_groups",
                        "num_beam_groups (%d) must divide num_beams (%d), with diversity_penalty > 0 (got %g)",
                        r->num_beam_groups, r->num_beams, (double)r->diversity_penalty);
    if (r->num_beam_groups <= 1 && r->diversity_penalty != 0)
        return ipc_fail(err, IPC_EINVAL, "diversity_penalty", "diversity_penalty needs num_beam_groups > 1");
    const struct sampler_params *s = &r->sampling;
    const char *warper = s->top_k ? "top_k" : s->top_p < 1 ? "top_p" : s->min_p > 0 ? "min_p"
                         : s->typical_p < 1 ? "typical_p"
                         : s->presence_penalty != 0 ? "presence_penalty"
                         : s->frequency_penalty != 0 ? "frequency_penalty"
                         : s->repetition_penalty != 1 ? (given(root, "repeat_penalty") ? "repeat_penalty"
                                                                                        : "repetition_penalty")
                                                      : NULL;
    if (warper)
        return ipc_fail(err, IPC_EINVAL, warper,
                        "%s is not available with num_beams > 1: beam search takes the most likely tokens "
                        "(temperature and seed do not change it)", warper);
    return IPC_OK;
}

static enum ipc_status check_no_beams(const json_t *root, struct ipc_gen_req *r, struct ipc_error *err)
{
    static const char *const beam_only[] = {"num_return_sequences", "length_penalty", "early_stopping",
                                            "no_repeat_ngram_size", "num_beam_groups", "diversity_penalty"};
    for (size_t i = 0; i < sizeof(beam_only) / sizeof(beam_only[0]); i++) {
        const json_t *v = json_object_get(root, beam_only[i]);
        /* the values that mean "one sequence, one group" say nothing */
        bool one = json_is_integer(v) && json_integer_value(v) == 1 &&
                   (!strcmp(beam_only[i], "num_return_sequences") || !strcmp(beam_only[i], "num_beam_groups"));
        if (given(root, beam_only[i]) && !one)
            return ipc_fail(err, IPC_EINVAL, beam_only[i], "%s needs num_beams > 1", beam_only[i]);
    }
    if (!r->best_of)
        r->best_of = r->n;
    if (r->best_of < r->n)
        return ipc_fail(err, IPC_EINVAL, "best_of", "best_of (%d) must be at least n (%d)", r->best_of, r->n);
    if (r->best_of > r->n && r->stream)
        return ipc_fail(err, IPC_EINVAL, "best_of",
                        "best_of > n cannot stream: the n choices returned are known only at the end");
    if (r->best_of > 1 && r->session)
        return ipc_fail(err, IPC_EINVAL, "best_of", "best_of must be 1 with a session");
    return IPC_OK;
}

enum ipc_status ipc_gen_req_parse(const json_t *root, bool chat, const struct ipc_limits *lim, struct ipc_gen_req *out,
                                  struct ipc_error *err)
{
    memset(out, 0, sizeof(*out));
    out->chat = chat;
    out->max_tokens = -1;
    out->n = 1;
    out->num_beams = 1;
    out->length_penalty = 1;
    out->shared_tokens = -1;
    sampler_params_default(&out->sampling);
    out->sampling.temperature = 1; /* OpenAI's default; greedy needs temperature 0 */
    if (!json_is_object(root))
        return ipc_fail(err, IPC_EINVAL, "", "the request body must be a JSON object");
    struct field_ctx c = {out, lim, root};
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)root, key, v)
    {
        size_t i = 0;
        while (i < sizeof(fields) / sizeof(fields[0]) &&
               !(strcmp(fields[i].name, key) == 0 && (fields[i].where & (chat ? F_CHAT : F_COMPL))))
            i++;
        if (i == sizeof(fields) / sizeof(fields[0]))
            return ipc_fail(err, IPC_EINVAL, key, "unknown field \"%.48s\"", key);
        enum ipc_status st = fields[i].fn(v, fields[i].name, &c, err);
        if (st != IPC_OK)
            return st;
    }
    enum ipc_status rst = read_repeat(root, out, lim, err);
    if (rst != IPC_OK)
        return rst;
    /* completions' prompt is checked by the prepare step, which knows the
     * model: an encoder-decoder model needs "input" (or a session's)
     * instead, a decoder-only one the prompt */
    if (chat && !out->messages)
        return ipc_fail(err, IPC_EINVAL, "messages", "messages is required");
    if (out->session && out->n != 1)
        return ipc_fail(err, IPC_EINVAL, "n", "n must be 1 with a session");
    /* a text that is not where the prompt starts marks nothing: refused
     * rather than read as "share nothing" or "share it all" */
    if (out->shared_text && (!out->text || out->text_len < out->shared_text_len ||
                             memcmp(out->text, out->shared_text, out->shared_text_len)))
        return ipc_fail(err, IPC_EINVAL, "shared_prefix", "shared_prefix as text must be the start of prompt (a string "
                        "prompt); give a number of tokens for a prompt of token ids");
    enum ipc_status tst = chat ? chat_end(root, out, err) : IPC_OK;
    if (tst == IPC_OK && chat)
        tst = tool_choice(root, out, err);
    if (tst != IPC_OK)
        return tst;
    if (out->tool_choice == IPC_TOOLS_NONE)
        out->tools = NULL; /* hidden from the template, so no call is read back either */
    /* a grammar masks what gen_seq samples: beams pick their own tokens,
     * a document that never ends has no grammar, and a complete document
     * ends the choice whatever min_tokens asks */
    const char *why = out->num_beams > 1  ? "num_beams"
                      : out->ignore_eos    ? "ignore_eos"
                      : out->min_tokens > 0 ? "min_tokens"
                                            : NULL;
    if (out->grammar && why)
        return ipc_fail(err, IPC_EINVAL, why, "%s cannot be combined with constrained output (response_format or a "
                        "forced tool_choice)", why);
    enum ipc_status bst = out->num_beams > 1 ? check_beams(root, out, err) : check_no_beams(root, out, err);
    if (bst != IPC_OK)
        return bst;
    enum ipc_status st = ipc_cache_parse(json_object_get(root, "cache"), json_object_get(root, "use_cache"),
                                         &(struct ipc_cache_model){.max_len = lim->max_context,
                                                                   .sliding_window = lim->sliding_window,
                                                                   .no_sink = lim->no_sink},
                                         &out->cache, err);
    /* one length, named once: both may be sent only with one value */
    const json_t *mt = json_object_get(root, "max_tokens"), *mct = json_object_get(root, "max_completion_tokens");
    if (st == IPC_OK && json_is_integer(mt) && json_is_integer(mct) && !json_equal(mt, mct))
        return ipc_fail(err, IPC_EINVAL, "max_completion_tokens", "max_tokens (%lld) and max_completion_tokens (%lld) "
                        "disagree; send one", (long long)json_integer_value(mt), (long long)json_integer_value(mct));
    if (st == IPC_OK && !out->session) /* a session's own cache decides (ipc_max_tokens_check) */
        st = ipc_max_tokens_check(out, out->cache.params.sink, lim->max_context, err);
    return st;
}

enum ipc_status ipc_max_tokens_check(const struct ipc_gen_req *r, bool sink, int max_context, struct ipc_error *err)
{
    if (sink || r->max_tokens <= max_context)
        return IPC_OK;
    const char *field = r->max_tokens_field ? r->max_tokens_field : "max_tokens";
    return ipc_fail(err, IPC_EINVAL, field, "%s must be between 1 and %d (got %d); only a sink cache generates past "
                    "the context", field, max_context, r->max_tokens);
}

void ipc_gen_req_release(struct ipc_gen_req *r)
{
    gram_free(r->grammar);
    r->grammar = NULL;
    free(r->ids);
    free(r->input_ids);
    json_decref(r->messages);
    r->ids = NULL;
    r->input_ids = NULL;
    r->messages = NULL;
}

enum ipc_status ipc_session_req_parse(const json_t *root, const struct ipc_limits *lim, struct ipc_session_req *out,
                                      struct ipc_error *err)
{
    memset(out, 0, sizeof(*out));
    if (root && !json_is_object(root))
        return ipc_fail(err, IPC_EINVAL, "", "the request body must be a JSON object");
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)root, key, v)
    {
        enum ipc_status st = IPC_OK;
        if (!strcmp(key, "prefix") || !strcmp(key, "prompt")) {
            if (out->prefix || out->ids)
                return ipc_fail(err, IPC_EINVAL, key, "give one of prefix and prompt");
            st = parse_prompt(v, key, lim, &out->prefix, &out->prefix_len, &out->ids, &out->n_ids, err);
            out->field = key;
        } else if (!strcmp(key, "system")) {
            if (!json_is_string(v))
                return ipc_fail(err, IPC_EINVAL, key, "system must be a string");
            out->system = json_string_value(v);
            out->system_len = json_string_length(v);
            out->field = key;
        } else if (!strcmp(key, "activate_past_recording") || !strcmp(key, "private")) {
            if (!json_is_boolean(v))
                return ipc_fail(err, IPC_EINVAL, key, "%s must be true or false", key);
            *(key[0] == 'p' ? &out->private_kv : &out->record) = json_is_true(v);
        } else if (!strcmp(key, "model")) {
            st = ipc_check_model(v, lim, err);
        } else if (strcmp(key, "cache") && strcmp(key, "use_cache")) {
            return ipc_fail(err, IPC_EINVAL, key,
                            "unknown field \"%.48s\" (prefix, prompt, system, cache, use_cache, "
                            "activate_past_recording, private, model)",
                            key);
        }
        if (st != IPC_OK)
            return st;
    }
    if (out->system && (out->prefix || out->ids))
        return ipc_fail(err, IPC_EINVAL, "system", "give either system or prefix, not both");
    enum ipc_status st = ipc_cache_parse(json_object_get(root, "cache"), json_object_get(root, "use_cache"),
                                         &(struct ipc_cache_model){.max_len = lim->max_context,
                                                                   .sliding_window = lim->sliding_window,
                                                                   .no_sink = lim->no_sink},
                                         &out->cache, err);
    if (st == IPC_OK && !out->cache.use_cache)
        return ipc_fail(err, IPC_EINVAL, "use_cache", "a session is its KV cache: use_cache=false cannot create one");
    return st;
}

void ipc_session_req_release(struct ipc_session_req *r)
{
    free(r->ids);
    r->ids = NULL;
}

enum ipc_status ipc_crop_req_parse(const json_t *root, int64_t *n, struct ipc_error *err)
{
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)root, key, v)
    {
        if (strcmp(key, "n") != 0)
            return ipc_fail(err, IPC_EINVAL, key, "unknown field \"%.48s\" (n)", key);
    }
    const json_t *jn = json_object_get(root, "n");
    if (!json_is_integer(jn))
        return ipc_fail(err, IPC_EINVAL, "n",
                        "n must be an integer: negative removes that many tokens, 0 frees what sliding layers "
                        "will not read");
    long long x = 0;
    enum ipc_status st = get_int(jn, "n", -KV_SEQ_MAX_LEN, KV_SEQ_MAX_LEN, &x, err);
    *n = x;
    return st;
}
