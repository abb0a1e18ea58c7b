/* chat.h - chat templates of the families kvtier can render, recognised from
 * tokenizer_config.json's chat_template by the markers each family uses (as
 * llama.cpp does; there is no Jinja engine).  A template that matches no
 * family, or one whose extras kvtier would have to guess (Llama-3.1 dates,
 * Qwen3 thinking), is refused with a clear error.
 */
#ifndef KVTIER_IPC_CHAT_H
#define KVTIER_IPC_CHAT_H

#include "ipc/request.h"

enum ipc_chat_family {
    IPC_CHAT_NONE = 0, /* no template, or not one kvtier can render */
    IPC_CHAT_LLAMA2,
    IPC_CHAT_LLAMA3,
    IPC_CHAT_MISTRAL,
    IPC_CHAT_CHATML,
    IPC_CHAT_ZEPHYR,
};

struct ipc_chat_template {
    enum ipc_chat_family family;
    bool bos;                 /* ChatML/Zephyr: the template starts with bos_token */
    char default_system[256]; /* ChatML's system message when the conversation has none ("" = none) */
    char why[128];            /* for IPC_CHAT_NONE: why the template was refused */
};

void ipc_chat_detect(const char *jinja, struct ipc_chat_template *out);
const char *ipc_chat_family_name(enum ipc_chat_family f);

/* Renders msgs[0..n) as the family's prompt text (malloc'd, NUL-terminated)
 * with the assistant header appended when add_generation_prompt.  bos and
 * eos are the tokenizer's special-token texts ("<s>", "</s>").  Errors:
 * IPC_ENOTIMPL when the model has no usable template, IPC_EINVAL for a
 * conversation the template rejects (roles out of order), IPC_ENOMEM. */
enum ipc_status ipc_chat_render(const struct ipc_chat_template *t, const struct ipc_msg *msgs, size_t n,
                                bool add_generation_prompt, const char *bos, const char *eos, char **out, size_t *len,
                                struct ipc_error *err);

#endif
