/* h_text.c - the tokenizer's endpoints (tokenize, detokenize,
 * apply-template) and the prompt encoding the generation and session
 * handlers share.  Every function here but h_prepared runs on a worker
 * (workers.h): a template or a tokenizer pass over a large body must not
 * hold the event loop, and the tokenizer and the chat template are
 * read-only, so any thread may use them.  The prepare steps build their
 * whole reply body (r->prep.out) there too. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/http.h"

enum ipc_status unknown_field(const char *key, const char *known, struct ipc_error *err)
{
    return ipc_fail(err, IPC_EINVAL, key, "unknown field \"%.48s\" (known: %s)", key, known);
}

struct ipc_limits limits(const struct server *s)
{
    const engine *e = s->eng;
    int vocab = engine_model_config(e)->vocab_size;
    int tv = tokenizer_vocab_size(engine_tokenizer(e));
    return (struct ipc_limits){.vocab = tv < vocab ? tv : vocab, .max_context = engine_context(e),
                               .max_n = s->cfg->max_n, .max_messages = s->cfg->max_messages,
                               .sliding_window = engine_model_config(e)->sliding_window,
                               /* a sink cache shifts rotary positions: T5 and BART have none */
                               .no_sink = engine_encdec(e) ? "an encoder-decoder model's positions are not rotary"
                                                           : model_sink_refusal(engine_model_config(e)),
                               .model_id = engine_model_id(e), .model_dir = engine_model_dir(e)};
}

/* The tokenizer's ids of text, whatever the model (/tokenize). */
static enum ipc_status tokenize_text(struct server *s, const char *text, size_t len, bool add_special,
                                     const char *field, struct tok_ids *ids, struct ipc_error *err)
{
    char msg[TEXT_ERR_LEN];
    enum text_status ts = tokenizer_encode(engine_tokenizer(s->eng), text, len, add_special, ids, msg);
    if (ts == TEXT_OK)
        return IPC_OK;
    return ipc_fail(err, ts == TEXT_ENOMEM ? IPC_ENOMEM : IPC_EINVAL, field, "%s: %s", field, msg);
}

enum ipc_status encode(struct server *s, const char *text, size_t len, bool add_special, const char *field,
                       struct tok_ids *ids, struct ipc_error *err)
{
    enum ipc_status st = tokenize_text(s, text, len, add_special, field, ids, err);
    /* a tokenizer may name ids past the model's embedding rows */
    int vocab = engine_model_config(s->eng)->vocab_size;
    for (size_t i = 0; st == IPC_OK && i < ids->n; i++)
        if (ids->ids[i] >= vocab) {
            int32_t id = ids->ids[i];
            free(ids->ids);
            *ids = (struct tok_ids){0};
            return ipc_fail(err, IPC_EINVAL, field, "%s: token id %d has no embedding row in the model (vocab_size %d)",
                            field, id, vocab);
        }
    return st;
}

static enum ipc_status render_text(struct server *s, const json_t *messages, const json_t *tools,
                                   const json_t *documents, const json_t *kwargs, enum ipc_chat_end end, char **text,
                                   size_t *len, struct ipc_error *err)
{
    char msg[TEXT_ERR_LEN];
    enum text_status ts = chat_tpl_render(engine_chat_template(s->eng), messages, tools, documents, kwargs,
                                          end == IPC_CHAT_GENERATE, engine_bos_text(s->eng), engine_eos_text(s->eng),
                                          time(NULL), text, len, msg);
    const char *field = "messages";
    if (ts == TEXT_OK && end == IPC_CHAT_CONTINUE) {
        ts = chat_continue_final(messages, *text, len, msg);
        field = "continue_final_message";
        if (ts != TEXT_OK) {
            free(*text);
            *text = NULL;
        }
    }
    if (ts == TEXT_OK)
        return IPC_OK;
    enum ipc_status st = ts == TEXT_EUNSUPPORTED ? IPC_ENOTIMPL : ts == TEXT_ENOMEM ? IPC_ENOMEM : IPC_EINVAL;
    return ipc_fail(err, st, field, "%s", msg);
}

enum ipc_status render(struct server *s, const json_t *messages, const json_t *tools, const json_t *documents,
                       const json_t *kwargs, enum ipc_chat_end end, struct tok_ids *ids, struct ipc_error *err)
{
    char *text;
    size_t len;
    enum ipc_status st = render_text(s, messages, tools, documents, kwargs, end, &text, &len, err);
    if (st != IPC_OK)
        return st;
    /* the template spells the special tokens out, so none are added */
    st = encode(s, text, len, false, "messages", ids, err);
    free(text);
    return st;
}

enum ipc_status prep_tokenize(struct req *r)
{
    struct ipc_error *err = &r->prep.err;
    /* llama.cpp's {"content", "add_special"} and vLLM's {"prompt", "add_special_tokens"} */
    const json_t *text = NULL;
    bool add = false, pieces = false, vllm = false;
    const char *key;
    json_t *v;
    json_object_foreach(r->root, key, v)
    {
        bool *flag = !strcmp(key, "add_special") || !strcmp(key, "add_special_tokens") ? &add
                     : !strcmp(key, "with_pieces")                                    ? &pieces
                                                                                      : NULL;
        if (!strcmp(key, "content") || !strcmp(key, "prompt")) {
            if (!json_is_string(v))
                return ipc_fail(err, IPC_EINVAL, key, "%s must be a string", key);
            if (text)
                return ipc_fail(err, IPC_EINVAL, key, "send content (llama.cpp's) or prompt (vLLM's), not both");
            text = v;
            vllm = !strcmp(key, "prompt");
        } else if (flag) {
            if (!json_is_boolean(v))
                return ipc_fail(err, IPC_EINVAL, key, "this field must be true or false");
            *flag = json_is_true(v);
        } else if (!strcmp(key, "model")) {
            struct ipc_limits lim = limits(r->srv);
            if (ipc_check_model(v, &lim, err) != IPC_OK)
                return err->st;
        } else {
            return unknown_field(key, "content or prompt, add_special or add_special_tokens, with_pieces, model",
                                 err);
        }
    }
    if (!text)
        return ipc_fail(err, IPC_EINVAL, "content", "content is required");
    if (vllm && !json_object_get(r->root, "add_special_tokens") && !json_object_get(r->root, "add_special"))
        add = true; /* vLLM's default */
    /* the loop thread's piece buffer is not this thread's to use */
    size_t cap = engine_max_piece(r->srv->eng);
    char *buf = pieces ? malloc(cap + 1) : NULL;
    if (pieces && !buf)
        return ipc_fail(err, IPC_ENOMEM, "", "no memory for a token text buffer");
    struct tok_ids ids = {0};
    if (tokenize_text(r->srv, json_string_value(text), json_string_length(text), add, "content", &ids, err) != IPC_OK) {
        free(buf);
        return err->st;
    }
    struct jw w;
    jw_dynamic(&w);
    jw_lit(&w, "{\"tokens\":[");
    for (size_t i = 0; i < ids.n; i++) {
        if (i)
            jw_lit(&w, ",");
        if (!pieces) {
            jw_fmt(&w, "%d", ids.ids[i]);
            continue;
        }
        bool whole;
        size_t n = token_piece(r->srv->eng, ids.ids[i], buf, cap, &whole), len;
        bool special;
        const char *raw = tokenizer_token_bytes(engine_tokenizer(r->srv->eng), ids.ids[i], &len, &special);
        jw_fmt(&w, "{\"id\":%d,\"piece\":", ids.ids[i]);
        if (whole || !raw)
            jw_str(&w, buf, n);
        else /* part of a character: its bytes, as llama.cpp's server gives them */
            jw_bytes(&w, raw, len);
        jw_lit(&w, "}");
    }
    jw_fmt(&w, "],\"count\":%zu,\"max_model_len\":%d}", ids.n, engine_context(r->srv->eng));
    free(ids.ids);
    free(buf);
    r->prep.out = w;
    return IPC_OK;
}

/* {"<key1>": text[, "<key2>": text]} (keys given with their punctuation)
 * as the reply body; frees text. */
static enum ipc_status reply_text(struct req *r, const char *key1, const char *key2, char *text, size_t len)
{
    struct jw w;
    jw_dynamic(&w);
    for (int i = 0; i < 2; i++) {
        const char *key = i ? key2 : key1;
        if (key) {
            jw_lit(&w, key);
            jw_str(&w, text, len);
        }
    }
    jw_lit(&w, "}");
    free(text);
    r->prep.out = w;
    return IPC_OK;
}

enum ipc_status prep_detokenize(struct req *r)
{
    struct ipc_error *err = &r->prep.err;
    const char *key;
    json_t *v;
    json_object_foreach(r->root, key, v)
    {
        if (strcmp(key, "tokens") && strcmp(key, "model"))
            return unknown_field(key, "tokens", err);
    }
    struct ipc_limits lim = limits(r->srv);
    if (ipc_check_model(json_object_get(r->root, "model"), &lim, err) != IPC_OK)
        return err->st;
    int32_t *ids;
    size_t n;
    const json_t *toks = json_object_get(r->root, "tokens");
    if (!toks)
        return ipc_fail(err, IPC_EINVAL, "tokens", "tokens is required");
    if (ipc_parse_ids(toks, "tokens", &lim, &ids, &n, err) != IPC_OK)
        return err->st;
    char *text = NULL;
    size_t len = 0;
    enum text_status ms = tokenizer_decode(engine_tokenizer(r->srv->eng), ids, n, false, &text, &len);
    free(ids);
    if (ms != TEXT_OK)
        return ipc_fail(err, IPC_ENOMEM, "tokens", "cannot decode the tokens");
    return reply_text(r, "{\"content\":", ",\"prompt\":", text, len); /* llama.cpp's and vLLM's names */
}

enum ipc_status prep_apply_template(struct req *r)
{
    struct ipc_limits lim = limits(r->srv);
    struct ipc_gen_req g;
    char *text = NULL;
    size_t len = 0;
    enum ipc_status st = ipc_gen_req_parse(r->root, true, &lim, &g, &r->prep.err);
    if (st == IPC_OK)
        st = render_text(r->srv, g.messages, g.tools, g.documents, g.template_kwargs, g.chat_end, &text, &len,
                         &r->prep.err);
    ipc_gen_req_release(&g);
    if (st != IPC_OK)
        return st;
    return reply_text(r, "{\"prompt\":", NULL, text, len);
}

/* The reply a prepare step built (tokenize, detokenize, apply-template). */
enum MHD_Result h_prepared(struct req *r, const char *arg)
{
    (void)arg;
    struct jw w = r->prep.out;
    r->prep.out = (struct jw){0};
    return reply_jw(r, 200, &w);
}

