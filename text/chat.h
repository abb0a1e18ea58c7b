/* chat.h - chat templates: the model's own Jinja chat_template from
 * tokenizer_config.json, rendered by text/jinja over the request's messages
 * and tools (struct chat_tpl).  A template the Jinja engine cannot parse
 * falls back to the families kvtier recognises by their markers (as
 * llama.cpp does): struct chat_template and chat_render below, which a
 * template that matches no family, or one whose extras kvtier would have
 * to guess (Llama-3.1 dates, Qwen3 thinking), refuses with a clear error.
 */
#ifndef KVTIER_TEXT_CHAT_H
#define KVTIER_TEXT_CHAT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <time.h>

#include "text/status.h"

enum chat_role { CHAT_ROLE_SYSTEM = 0, CHAT_ROLE_USER, CHAT_ROLE_ASSISTANT };

struct chat_msg {
    enum chat_role role;
    const char *content; /* borrowed, or `owned` when joined from content parts */
    size_t len;
    char *owned;         /* freed by whoever built the message */
};

enum chat_family {
    CHAT_NONE = 0, /* no template, or not one kvtier can render */
    CHAT_LLAMA2,
    CHAT_LLAMA3,
    CHAT_MISTRAL,
    CHAT_CHATML,
    CHAT_ZEPHYR,
};

struct chat_template {
    enum chat_family family;
    bool bos;                 /* ChatML/Zephyr: the template starts with bos_token */
    char default_system[256]; /* ChatML's system message when the conversation has none ("" = none) */
    char why[128];            /* for CHAT_NONE: why the template was refused */
};

void chat_detect(const char *jinja, struct chat_template *out);
const char *chat_family_name(enum chat_family f);

/* Renders msgs[0..n) as the family's prompt text (malloc'd, NUL-terminated)
 * with the assistant header appended when add_generation_prompt.  bos and
 * eos are the tokenizer's special-token texts ("<s>", "</s>").  Errors:
 * TEXT_EUNSUPPORTED when the model has no usable template, TEXT_EINVAL for
 * a conversation the template rejects (roles out of order), TEXT_ENOMEM;
 * err (TEXT_ERR_LEN bytes) says which message. */
enum text_status chat_render(const struct chat_template *t, const struct chat_msg *msgs, size_t n,
                             bool add_generation_prompt, const char *bos, const char *eos, char **out, size_t *len,
                             char *err);

/* ---- the model's template ---------------------------------------------------- */

typedef struct chat_tpl chat_tpl;

/* value: tokenizer_config.json's chat_template (a string, or a list of
 * {"name", "template"} of which "default" and "tool_use" are used), or NULL.
 * A template that does not parse as Jinja is logged by the caller (why says
 * why) and falls back to family sniffing; a missing one loads as a template
 * that refuses to render.  Errors: TEXT_EFORMAT for a malformed value,
 * TEXT_ENOMEM. */
enum text_status chat_tpl_load(const json_t *value, chat_tpl **out, char *why, char *err);
void chat_tpl_free(chat_tpl *t);
/* "jinja", a fallback family's name ("chatml", ...), or "none" (also for NULL). */
const char *chat_tpl_kind(const chat_tpl *t);
/* How the model writes a tool call: true for Llama 3's templates (bare JSON,
 * {"name", "parameters"}), false for the rest (Hermes/Qwen <tool_call>
 * blocks).  The template's header markers say which. */
bool chat_tpl_bare_tool_calls(const chat_tpl *t);

/* The variables a template sees: messages, tools and documents (each only
 * when an array; templates test `tools is defined`/`if documents`),
 * add_generation_prompt, bos_token and eos_token, then the client's
 * kwargs (NULL or an object: chat_template_kwargs, Qwen3's
 * enable_thinking) where they name none of those.  NULL when out of memory. */
json_t *chat_vars(const json_t *messages, const json_t *tools, const json_t *documents, const json_t *kwargs,
                  bool add_generation_prompt, const char *bos, const char *eos);

/* Renders messages (a JSON array of {role, content, tool_calls, ...}) and
 * tools (NULL or a JSON array) and documents (NULL or a JSON array of
 * objects, RAG templates' `documents`) and kwargs (chat_vars) as the prompt text (malloc'd, NUL-terminated)
 * with the template named "tool_use" when there are tools and the model has
 * one, else its default.  now is what strftime_now() formats.  Errors:
 * TEXT_EUNSUPPORTED when the model has no usable template (or only a
 * family's, which cannot render documents), TEXT_EINVAL for a
 * conversation the template rejects (raise_exception's message, roles out of
 * order), TEXT_ENOMEM; err says why. */
enum text_status chat_tpl_render(const chat_tpl *t, const json_t *messages, const json_t *tools,
                                 const json_t *documents, const json_t *kwargs, bool add_generation_prompt,
                                 const char *bos, const char *eos, time_t now, char **out, size_t *len, char *err);

/* transformers' apply_chat_template(continue_final_message=True) on text,
 * the messages as rendered without the generation prompt: cut right after
 * the final message's content (*len shortened, text NUL-terminated again),
 * so the model continues that message instead of starting a new one.  The
 * content is found as the last occurrence of it stripped (the whitespace
 * of Python's str.strip(), which transformers calls), and its trailing
 * whitespace stays when the template printed the content whole.  Whatever
 * the final message's role; one whose content is empty or all whitespace
 * cuts nothing, as in transformers.  Errors: TEXT_EINVAL when the final
 * message has no text content, or when the template changed it so that
 * the text does not hold it; TEXT_ENOMEM.  err says which. */
enum text_status chat_continue_final(const json_t *messages, char *text, size_t *len, char *err);

#endif
