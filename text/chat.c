#include "text/chat.h"
#include "text/jinja.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

static const char *role_names[] = {[CHAT_ROLE_SYSTEM] = "system", [CHAT_ROLE_USER] = "user",
                                   [CHAT_ROLE_ASSISTANT] = "assistant"};

const char *chat_family_name(enum chat_family f)
{
    static const char *names[] = {"none", "llama2", "llama3", "mistral", "chatml", "zephyr"};
    return (unsigned)f < sizeof(names) / sizeof(names[0]) ? names[f] : "none";
}

/* Qwen2-style ChatML templates insert a default system message when the
 * conversation has none; it is the text between the first system header and
 * its end marker. */
static void chatml_default_system(const char *jinja, char *out, size_t cap)
{
    out[0] = '\0';
    const char *hdr = "<|im_start|>system\\n";
    const char *p = strstr(jinja, hdr);
    if (!p || !strstr(jinja, "!= 'system'"))
        return;
    p += strlen(hdr);
    const char *end = strstr(p, "<|im_end|>");
    if (end && (size_t)(end - p) < cap)
        snprintf(out, cap, "%.*s", (int)(end - p), p);
}

void chat_detect(const char *jinja, struct chat_template *out)
{
    memset(out, 0, sizeof(*out));
    if (!jinja) {
        snprintf(out->why, sizeof(out->why), "the model has no chat_template in tokenizer_config.json");
        return;
    }
    out->bos = strstr(jinja, "bos_token") != NULL;
    if (strstr(jinja, "<|start_header_id|>")) {
        if (strstr(jinja, "Cutting Knowledge"))
            snprintf(out->why, sizeof(out->why), "Llama-3.1-style templates (date and tool preamble) are not supported");
        else
            out->family = CHAT_LLAMA3;
    } else if (strstr(jinja, "<|im_start|>")) {
        if (strstr(jinja, "<think>"))
            snprintf(out->why, sizeof(out->why), "ChatML templates with thinking blocks (Qwen3) are not supported");
        else
            out->family = CHAT_CHATML;
        chatml_default_system(jinja, out->default_system, sizeof(out->default_system));
    } else if (strstr(jinja, "[INST]")) {
        out->family = strstr(jinja, "<<SYS>>") ? CHAT_LLAMA2 : CHAT_MISTRAL;
    } else if (strstr(jinja, "<|user|>") && strstr(jinja, "<|assistant|>")) {
        out->family = CHAT_ZEPHYR;
    } else {
        snprintf(out->why, sizeof(out->why), "the chat_template matches no family kvtier renders (llama2, llama3, "
                 "mistral, chatml, zephyr)");
    }
}

struct sbuf {
    char *p;
    size_t n, cap;
    bool oom;
};

static void put(struct sbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void puts_(struct sbuf *b, const char *s)
{
    put(b, s, strlen(s));
}

/* Jinja's |trim / .strip(): ASCII whitespace at the end, and at the start
 * when lead (false where the text is not the start of the stripped string). */
static void put_trimmed(struct sbuf *b, const char *s, size_t n, bool lead)
{
    while (lead && n && strchr(" \t\n\r\f\v", s[0]))
        s++, n--;
    while (n && strchr(" \t\n\r\f\v", s[n - 1]))
        n--;
    put(b, s, n);
}

/* Llama-2 and Mistral demand user/assistant alternation starting with user
 * (after an optional leading system message for Llama-2). */
static enum text_status check_alternation(const struct chat_msg *m, size_t n, size_t first, char *err)
{
    for (size_t i = first; i < n; i++) {
        enum chat_role want = (i - first) % 2 == 0 ? CHAT_ROLE_USER : CHAT_ROLE_ASSISTANT;
        if (m[i].role != want)
            return text_errf(err, TEXT_EINVAL, "messages[%zu] is %s; this model's template needs roles to "
                            "alternate user/assistant", i, role_names[m[i].role]);
    }
    return TEXT_OK;
}

static enum text_status render_inst(const struct chat_template *t, const struct chat_msg *m, size_t n,
                                   const char *bos, const char *eos, struct sbuf *b, char *err)
{
    bool llama2 = t->family == CHAT_LLAMA2;
    size_t first = llama2 && n && m[0].role == CHAT_ROLE_SYSTEM ? 1 : 0;
    if (!llama2 && n && m[0].role == CHAT_ROLE_SYSTEM)
        return text_errf(err, TEXT_EINVAL, "this model's template (mistral) has no system role");
    enum text_status st = check_alternation(m, n, first, err);
    if (st != TEXT_OK)
        return st;
    if (!llama2)
        puts_(b, bos);
    for (size_t i = first; i < n; i++) {
        if (m[i].role == CHAT_ROLE_USER) {
            if (llama2)
                puts_(b, bos);
            puts_(b, "[INST] ");
            if (llama2 && i == first && first) {
                puts_(b, "<<SYS>>\n");
                put(b, m[0].content, m[0].len);
                puts_(b, "\n<</SYS>>\n\n");
                /* Llama-2 strips the joined system+user content: only its end is trimmed */
                put_trimmed(b, m[i].content, m[i].len, false);
            } else if (llama2) {
                put_trimmed(b, m[i].content, m[i].len, true);
            } else {
                put(b, m[i].content, m[i].len);
            }
            puts_(b, " [/INST]");
        } else {
            if (llama2) {
                puts_(b, " ");
                put_trimmed(b, m[i].content, m[i].len, true);
                puts_(b, " ");
            } else {
                put(b, m[i].content, m[i].len);
            }
            puts_(b, eos);
        }
    }
    return TEXT_OK;
}

enum text_status chat_render(const struct chat_template *t, const struct chat_msg *m, size_t n,
                                bool add_generation_prompt, const char *bos, const char *eos, char **out, size_t *len,
                                char *err)
{
    *out = NULL;
    *len = 0;
    struct sbuf b = {0};
    enum text_status st = TEXT_OK;
    switch (t->family) {
    case CHAT_NONE:
        return text_errf(err, TEXT_EUNSUPPORTED, "cannot render chat: %s", t->why);
    case CHAT_LLAMA2:
    case CHAT_MISTRAL:
        /* the [/INST] closing the last user turn is the generation prompt */
        st = render_inst(t, m, n, bos, eos, &b, err);
        break;
    case CHAT_LLAMA3:
        puts_(&b, bos);
        for (size_t i = 0; i < n; i++) {
            puts_(&b, "<|start_header_id|>");
            puts_(&b, role_names[m[i].role]);
            puts_(&b, "<|end_header_id|>\n\n");
            put_trimmed(&b, m[i].content, m[i].len, true);
            puts_(&b, "<|eot_id|>");
        }
        if (add_generation_prompt)
            puts_(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    case CHAT_CHATML:
        if (t->bos)
            puts_(&b, bos);
        if (t->default_system[0] && (!n || m[0].role != CHAT_ROLE_SYSTEM)) {
            puts_(&b, "<|im_start|>system\n");
            puts_(&b, t->default_system);
            puts_(&b, "<|im_end|>\n");
        }
        for (size_t i = 0; i < n; i++) {
            puts_(&b, "<|im_start|>");
            puts_(&b, role_names[m[i].role]);
            puts_(&b, "\n");
            put(&b, m[i].content, m[i].len);
            puts_(&b, "<|im_end|>\n");
        }
        if (add_generation_prompt)
            puts_(&b, "<|im_start|>assistant\n");
        break;
    case CHAT_ZEPHYR:
        if (t->bos)
            puts_(&b, bos);
        for (size_t i = 0; i < n; i++) {
            puts_(&b, "<|");
            puts_(&b, role_names[m[i].role]);
            puts_(&b, "|>\n");
            put(&b, m[i].content, m[i].len);
            puts_(&b, eos);
            puts_(&b, "\n");
        }
        if (add_generation_prompt)
            puts_(&b, "<|assistant|>\n");
        break;
    }
    if (st == TEXT_OK && !b.p)
        put(&b, "", 0);
    if (st == TEXT_OK && b.oom)
        st = text_errf(err, TEXT_ENOMEM, "no memory to render the chat template");
    if (st != TEXT_OK) {
        free(b.p);
        return st;
    }
    *out = b.p;
    *len = b.n;
    return TEXT_OK;
}

/* ---- the model's template ---------------------------------------------------- */

struct chat_tpl {
    jinja_tpl *dflt, *tool_use;  /* NULL when the fallback renders */
    struct chat_template family; /* the fallback */
    bool bare_calls;             /* Llama 3 headers: calls are written as bare JSON */
};

void chat_tpl_free(chat_tpl *t)
{
    if (!t)
        return;
    jinja_free(t->dflt);
    jinja_free(t->tool_use);
    free(t);
}

const char *chat_tpl_kind(const chat_tpl *t)
{
    return !t ? "none" : t->dflt ? "jinja" : chat_family_name(t->family.family);
}

bool chat_tpl_bare_tool_calls(const chat_tpl *t)
{
    return t && t->bare_calls;
}

enum text_status chat_tpl_load(const json_t *value, chat_tpl **out, char *why, char *err)
{
    *out = NULL;
    why[0] = '\0';
    const char *dflt = json_string_value(value), *tool_use = NULL;
    if (json_is_array(value)) {
        size_t i;
        const json_t *e;
        json_array_foreach(value, i, e)
        {
            const char *name = json_string_value(json_object_get(e, "name"));
            const char *src = json_string_value(json_object_get(e, "template"));
            if (!name || !src)
                return text_errf(err, TEXT_EFORMAT, "chat_template[%zu] is not a {name, template} object", i);
            if (!strcmp(name, "default"))
                dflt = src;
            else if (!strcmp(name, "tool_use"))
                tool_use = src;
        }
        if (!dflt) /* a list without "default": transformers then needs a name, the first one will do */
            dflt = json_string_value(json_object_get(json_array_get(value, 0), "template"));
    } else if (value && !json_is_null(value) && !dflt) {
        return text_errf(err, TEXT_EFORMAT, "chat_template is neither a string nor a list of named templates");
    }
    chat_tpl *t = calloc(1, sizeof(*t));
    if (!t)
        return text_errf(err, TEXT_ENOMEM, "no memory for the chat template");
    /* why says what did not parse: for the default the families may still
     * know the template; without tool_use the default renders tools too */
    enum text_status st = dflt ? jinja_parse(dflt, strlen(dflt), &t->dflt, why) : TEXT_OK;
    if (st == TEXT_OK && tool_use)
        st = jinja_parse(tool_use, strlen(tool_use), &t->tool_use, why);
    if (st == TEXT_ENOMEM) {
        chat_tpl_free(t);
        return text_errf(err, TEXT_ENOMEM, "no memory for the chat template");
    }
    if (!t->dflt)
        chat_detect(dflt, &t->family);
    t->bare_calls = (dflt && strstr(dflt, "<|start_header_id|>")) || (tool_use && strstr(tool_use, "<|start_header_id|>"));
    *out = t;
    return TEXT_OK;
}

static json_t *str_or_empty(const char *s)
{
    return json_string(s ? s : "");
}

json_t *chat_vars(const json_t *messages, const json_t *tools, const json_t *documents, const json_t *kwargs,
                  bool add_generation_prompt, const char *bos, const char *eos)
{
    json_t *v = json_pack("{sosbsoso}", "messages", messages ? json_incref((json_t *)messages) : json_array(),
                          "add_generation_prompt", add_generation_prompt, "bos_token", str_or_empty(bos),
                          "eos_token", str_or_empty(eos));
    if (v && ((json_is_array(tools) && json_object_set(v, "tools", (json_t *)tools)) ||
              (json_is_array(documents) && json_object_set(v, "documents", (json_t *)documents)) ||
              (json_is_object(kwargs) && json_object_update_missing(v, (json_t *)kwargs)))) {
        json_decref(v);
        return NULL;
    }
    return v;
}

/* The fallback families take roles and texts only. */
static enum text_status to_msgs(const json_t *messages, struct chat_msg **out, size_t *n, char *err)
{
    *n = json_array_size(messages);
    *out = calloc(*n ? *n : 1, sizeof(**out));
    if (!*out)
        return text_errf(err, TEXT_ENOMEM, "no memory for the messages");
    for (size_t i = 0; i < *n; i++) {
        const json_t *m = json_array_get(messages, i);
        const char *role = json_string_value(json_object_get(m, "role"));
        const json_t *c = json_object_get(m, "content");
        size_t k = 0;
        while (k < 3 && (!role || strcmp(role, role_names[k])))
            k++;
        if (k == 3 || (!json_is_string(c) && !json_is_null(c) && c) || json_object_get(m, "tool_calls")) {
            free(*out);
            *out = NULL;
            return text_errf(err, TEXT_EUNSUPPORTED, "messages[%zu]: this model's template (%s, recognised by its "
                             "markers) renders text messages of the system, user and assistant roles only", i,
                             role ? role : "no role");
        }
        (*out)[i] = (struct chat_msg){(enum chat_role)k, json_is_string(c) ? json_string_value(c) : "",
                                      json_string_length(c), NULL};
    }
    return TEXT_OK;
}

/* messages with every null content replaced by "", or NULL when none is null. */
static json_t *with_empty_content(const json_t *messages)
{
    bool any = false;
    for (size_t i = 0; i < json_array_size(messages); i++)
        any |= json_is_null(json_object_get(json_array_get(messages, i), "content"));
    json_t *copy = any ? json_deep_copy(messages) : NULL;
    for (size_t i = 0; copy && i < json_array_size(copy); i++) {
        json_t *m = json_array_get(copy, i);
        if (json_is_null(json_object_get(m, "content")) && json_object_set_new(m, "content", json_string(""))) {
            json_decref(copy);
            copy = NULL;
        }
    }
    return copy;
}

enum text_status chat_tpl_render(const chat_tpl *t, const json_t *messages, const json_t *tools,
                                 const json_t *documents, const json_t *kwargs, bool add_generation_prompt,
                                 const char *bos, const char *eos, time_t now, char **out, size_t *len, char *err)
{
    *out = NULL;
    *len = 0;
    if (!t)
        return text_errf(err, TEXT_EUNSUPPORTED, "cannot render chat: the model is not loaded");
    if (!t->dflt) {
        struct chat_msg *m;
        size_t n;
        if (t->family.family == CHAT_NONE)
            return text_errf(err, TEXT_EUNSUPPORTED, "cannot render chat: %s", t->family.why);
        /* dropping them would answer without the documents asked about */
        if (json_array_size(documents))
            return text_errf(err, TEXT_EUNSUPPORTED, "this model's template (%s, recognised by its markers) "
                             "renders no documents", chat_tpl_kind(t));
        enum text_status st = to_msgs(messages, &m, &n, err);
        if (st == TEXT_OK)
            st = chat_render(&t->family, m, n, add_generation_prompt, bos, eos, out, len, err);
        free(m);
        return st;
    }
    bool with_tools = json_array_size(tools) > 0;
    json_t *vars = chat_vars(messages, with_tools ? tools : NULL, documents, kwargs, add_generation_prompt, bos, eos);
    if (!vars)
        return text_errf(err, TEXT_ENOMEM, "no memory to render the chat template");
    struct jinja_opts o = {.now = now};
    const jinja_tpl *tpl = with_tools && t->tool_use ? t->tool_use : t->dflt;
    enum text_status st = jinja_render(tpl, vars, &o, out, len, err);
    json_decref(vars);
    /* OpenAI clients send an assistant turn that only calls tools with
     * content null; templates written for strings (Qwen3's `in
     * message.content`) fail on it.  Such a template gets "" instead, as
     * llama.cpp does, while one that tests `content is none` keeps null. */
    json_t *copy = st == TEXT_EINVAL ? with_empty_content(messages) : NULL;
    if (copy) {
        /* failing again, the template says what else is wrong: its own
         * message, not the null content's */
        char err2[TEXT_ERR_LEN];
        vars = chat_vars(copy, with_tools ? tools : NULL, documents, kwargs, add_generation_prompt, bos, eos);
        enum text_status st2 = vars ? jinja_render(tpl, vars, &o, out, len, err2) : TEXT_ENOMEM;
        if (st2 == TEXT_OK || st2 == TEXT_EINVAL) {
            st = st2;
            if (st2 == TEXT_EINVAL)
                snprintf(err, TEXT_ERR_LEN, "%s", err2);
        }
        json_decref(vars);
        json_decref(copy);
    }
    return st;
}

/* Python's str.isspace(): a space separator, or a character of the bidi
 * classes WS, B or S (which adds U+001C..U+001F and U+0085 to JavaScript's
 * trim() set, and leaves out U+FEFF). */
static bool py_space(utf8proc_int32_t c)
{
    const utf8proc_property_t *p = utf8proc_get_property(c);
    return p->category == UTF8PROC_CATEGORY_ZS || p->bidi_class == UTF8PROC_BIDI_CLASS_WS ||
           p->bidi_class == UTF8PROC_BIDI_CLASS_B || p->bidi_class == UTF8PROC_BIDI_CLASS_S;
}

/* Where s[0..n).strip() starts and ends (*a == *e when it is empty). */
static void py_strip(const char *s, size_t n, size_t *a, size_t *e)
{
    const utf8proc_uint8_t *u = (const utf8proc_uint8_t *)s;
    bool found = false;
    *a = *e = n;
    for (size_t i = 0; i < n;) {
        utf8proc_int32_t c;
        utf8proc_ssize_t l = utf8proc_iterate(u + i, (utf8proc_ssize_t)(n - i), &c);
        size_t step = l > 0 ? (size_t)l : 1;
        if (l < 1 || !py_space(c)) {
            if (!found)
                *a = i;
            found = true;
            *e = i + step;
        }
        i += step;
    }
}

/* The offset of the last occurrence of needle in hay (hn when needle is
 * empty, as Python's rindex), or -1 (ENOMEM: -2).  Reversed, it is the
 * first occurrence, which memmem finds in linear time: scanning backwards
 * compares up to the needle's length at every offset. */
static long long last_occurrence(const char *hay, size_t hn, const char *needle, size_t nn)
{
    if (!nn)
        return (long long)hn;
    if (nn > hn)
        return -1;
    char *rh = malloc(hn + nn);
    if (!rh)
        return -2;
    char *rn = rh + hn;
    for (size_t i = 0; i < hn; i++)
        rh[i] = hay[hn - 1 - i];
    for (size_t i = 0; i < nn; i++)
        rn[i] = needle[nn - 1 - i];
    const char *hit = memmem(rh, hn, rn, nn);
    long long at = hit ? (long long)(hn - (size_t)(hit - rh) - nn) : -1;
    free(rh);
    return at;
}

enum text_status chat_continue_final(const json_t *messages, char *text, size_t *len, char *err)
{
    size_t count = json_array_size(messages);
    const json_t *content = count ? json_object_get(json_array_get(messages, count - 1), "content") : NULL;
    if (!json_is_string(content))
        return text_errf(err, TEXT_EINVAL, "continue_final_message: the final message has no text content to "
                         "continue");
    size_t n = json_string_length(content), a, e;
    const char *c = json_string_value(content);
    py_strip(c, n, &a, &e);
    long long at = last_occurrence(text, *len, c + a, e - a);
    if (at == -2)
        return text_errf(err, TEXT_ENOMEM, "no memory to find the final message");
    if (at < 0)
        return text_errf(err, TEXT_EINVAL, "continue_final_message: the final message's text is not in the "
                         "prompt the chat template rendered (the template changed it), so there is no place to cut");
    /* the content printed whole (no leading whitespace the template could
     * have dropped): the prompt keeps its trailing whitespace too */
    bool whole = a == 0 && (size_t)at + n <= *len && !memcmp(text + at, c, n);
    *len = (size_t)at + (whole ? n : e - a);
    text[*len] = '\0';
    return TEXT_OK;
}
