/* fuzz_chat.c - recognising a chat template (chat_detect on
 * tokenizer_config.json's Jinja text) and rendering a conversation with it
 * (chat_render).  Input: the template, a NUL, then messages separated by
 * NULs, each a role byte (mod 3) and its content.
 *
 * Invariants: a refused template says why; rendering with a refused one is
 * TEXT_EUNSUPPORTED; Llama-2/Mistral accept exactly the conversations that
 * alternate user/assistant (after one system message for Llama-2), and a
 * refusal names the message; a rendered prompt is NUL-terminated at its
 * length, holds every message's text (trimmed where the template trims;
 * a Llama-2 system message with no user turn renders nothing, as in Jinja),
 * starts with BOS where the family adds it, and ends with the assistant
 * header when asked for the generation prompt. */
#include "text/chat.h"
#include "tests/fuzz/fuzz_util.h"

#define MAX_MSGS 64
static const char BOS[] = "<s>", EOS[] = "</s>";

static bool is_space(char c)
{
    return c && strchr(" \t\n\r\f\v", c);
}

/* Whether the roles alternate as Llama-2 / Mistral want. */
static bool alternates(const struct chat_msg *m, size_t n, bool llama2)
{
    size_t first = llama2 && n && m[0].role == CHAT_ROLE_SYSTEM ? 1 : 0;
    for (size_t i = first; i < n; i++)
        if (m[i].role != ((i - first) % 2 ? CHAT_ROLE_ASSISTANT : CHAT_ROLE_USER))
            return false;
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 1 << 16)
        return 0;
    size_t tpl_len, rest_len;
    const uint8_t *rest;
    fuzz_split(data, size, &tpl_len, &rest, &rest_len);
    char *jinja = malloc(tpl_len + 1);
    memcpy(jinja, data, tpl_len);
    jinja[tpl_len] = '\0';

    struct chat_template t;
    chat_detect(size ? jinja : NULL, &t);
    FUZZ_CHECK(t.family != CHAT_NONE || t.why[0], "refused without a reason");
    FUZZ_CHECK(strcmp(chat_family_name(t.family), "none") != 0 || t.family == CHAT_NONE, "family name");
    FUZZ_CHECK(strlen(t.default_system) < sizeof t.default_system, "default system prompt");

    struct chat_msg msgs[MAX_MSGS];
    size_t n = 0;
    while (rest && rest_len && n < MAX_MSGS) {
        size_t len, next_len;
        const uint8_t *next;
        fuzz_split(rest + 1, rest_len - 1, &len, &next, &next_len);
        msgs[n++] = (struct chat_msg){.role = (enum chat_role)(rest[0] % 3), .content = (const char *)rest + 1,
                                      .len = len};
        rest = next;
        rest_len = next_len;
    }
    for (int gen = 0; gen < 2; gen++) {
        char *out = NULL, err[TEXT_ERR_LEN];
        size_t len = 0;
        err[0] = '\0';
        enum text_status st = chat_render(&t, msgs, n, gen, BOS, EOS, &out, &len, err);
        bool inst = t.family == CHAT_LLAMA2 || t.family == CHAT_MISTRAL;
        if (t.family == CHAT_NONE) {
            FUZZ_CHECK(st == TEXT_EUNSUPPORTED && err[0], "rendered with a refused template (%d)", st);
        } else if (inst && (!alternates(msgs, n, t.family == CHAT_LLAMA2) ||
                            (t.family == CHAT_MISTRAL && n && msgs[0].role == CHAT_ROLE_SYSTEM))) {
            FUZZ_CHECK(st == TEXT_EINVAL && err[0], "a conversation out of order rendered (%d)", st);
        } else {
            FUZZ_CHECK(st == TEXT_OK, "refused: %s", err);
        }
        if (st != TEXT_OK) {
            FUZZ_CHECK(!out, "output left after an error");
            continue;
        }
        FUZZ_CHECK(out && out[len] == '\0', "not NUL-terminated");
        for (size_t i = 0; i < n; i++) {
            /* Llama-2 folds the system message into the first user turn: alone,
             * it renders nothing (as the Jinja template does) */
            if (t.family == CHAT_LLAMA2 && n == 1 && msgs[0].role == CHAT_ROLE_SYSTEM)
                break;
            const char *c = msgs[i].content;
            size_t cl = msgs[i].len;
            if (t.family == CHAT_LLAMA2 || t.family == CHAT_LLAMA3) { /* these trim */
                while (cl && is_space(c[0]))
                    c++, cl--;
                while (cl && is_space(c[cl - 1]))
                    cl--;
            }
            FUZZ_CHECK(!cl || memmem(out, len, c, cl), "messages[%zu] is missing from the prompt", i);
        }
        bool bos_first = t.family == CHAT_LLAMA3 || t.family == CHAT_MISTRAL ||
                         ((t.family == CHAT_CHATML || t.family == CHAT_ZEPHYR) && t.bos) ||
                         (t.family == CHAT_LLAMA2 && n > (size_t)(msgs[0].role == CHAT_ROLE_SYSTEM));
        if (bos_first)
            FUZZ_CHECK(len >= 3 && memcmp(out, BOS, 3) == 0, "no BOS first");
        const char *tail = !gen                          ? NULL
                           : t.family == CHAT_CHATML     ? "<|im_start|>assistant\n"
                           : t.family == CHAT_LLAMA3     ? "<|start_header_id|>assistant<|end_header_id|>\n\n"
                           : t.family == CHAT_ZEPHYR     ? "<|assistant|>\n"
                                                         : NULL;
        if (tail)
            FUZZ_CHECK(len >= strlen(tail) && !strcmp(out + len - strlen(tail), tail), "no generation prompt");
        free(out);
    }
    free(jinja);
    return 0;
}
