/* chat.h - chat templates of the families kvtier can render, recognised from
 * tokenizer_config.json's chat_template by the markers each family uses (as
 * llama.cpp does; there is no Jinja engine).  A template that matches no
 * family, or one whose extras kvtier would have to guess (Llama-3.1 dates,
 * Qwen3 thinking), is refused with a clear error.
 */
#ifndef KVTIER_TEXT_CHAT_H
#define KVTIER_TEXT_CHAT_H

#include <stdbool.h>
#include <stddef.h>

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

#endif
