/* request.h - decoding and validating the JSON bodies of the generation
 * endpoints (/v1/completions, /v1/chat/completions, /v1/sessions).
 *
 * Every check that needs no model state happens here, before anything sized
 * by the client is allocated: types, ranges, unknown fields, token ids
 * against the vocabulary, array lengths against the context, response
 * schemas compiled into their grammar.  Fields kvtier knows but does not
 * implement (echo, logit_bias, ...) give 400 naming the field when they ask
 * for something, rather than being ignored; fields other local servers
 * accept that change nothing here (cache_prompt, keep_alive,
 * reasoning_effort) are checked for type and accepted.  Strings in a parsed
 * request are borrowed from the JSON tree, which must outlive it.
 */
#ifndef KVTIER_IPC_REQUEST_H
#define KVTIER_IPC_REQUEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "ipc/cache.h"
#include "ipc/status.h"
#include "text/grammar.h"
#include "model/beam.h"
#include "model/generate.h"

#define IPC_MAX_STOPS 16
#define IPC_MAX_STOP_LEN 256
#define IPC_MAX_TOP_LOGPROBS 20
/* max_tokens of a sink cache, which is bounded in memory and whose
 * positions stay below its window, so it may generate past the context;
 * the bound keeps the per-request token and text buffers finite */
#define IPC_MAX_SINK_TOKENS (1 << 20)
#define IPC_SESSION_ID_MAX 64

struct ipc_limits {
    int vocab;        /* token ids must be below it */
    int max_context;  /* bounds token arrays and max_tokens */
    int max_n;        /* choices per request */
    int max_messages; /* chat messages per request */
    int sliding_window; /* the model's, the "sliding_window" strategy's default window (0: none) */
    const char *no_sink; /* why the model refuses a sink cache (model_sink_refusal), NULL: it takes one */
    const char *model_id;  /* the served model's id; NULL: "model" is not checked */
    const char *model_dir; /* --model as given, an alias of the id */
};

/* A request's "model" field: absent or null, or a name the model answers
 * to (its id, the id with Ollama's ":latest" tag, or the model directory
 * as given to kvtierd); else IPC_ENOMODEL naming it. */
enum ipc_status ipc_check_model(const json_t *v, const struct ipc_limits *lim, struct ipc_error *err);

/* tool_choice: whether the model may, must, or must not call a tool. */
enum ipc_tool_choice { IPC_TOOLS_AUTO = 0, IPC_TOOLS_NONE, IPC_TOOLS_REQUIRED, IPC_TOOLS_NAMED };

/* Where a rendered chat ends: after the assistant's header, which starts
 * its turn (add_generation_prompt, the default); after the last message
 * (add_generation_prompt false); or inside the final message, cut right
 * after its text so the model continues it (continue_final_message). */
enum ipc_chat_end { IPC_CHAT_GENERATE = 0, IPC_CHAT_CLOSED, IPC_CHAT_CONTINUE };

#define IPC_MAX_TOOLS 64
#define IPC_MAX_DOCUMENTS 64
#define IPC_MAX_TEMPLATE_KWARGS 64

struct ipc_gen_req {
    bool chat;
    /* the prompt: text (borrowed) or token ids (owned), or messages (chat) */
    const char *text;
    size_t text_len;
    int32_t *ids;
    size_t n_ids;
    json_t *messages;     /* owned: role, content (a string or null), tool_calls, ... */
    /* completions' "input": an encoder-decoder model's encoder input, text
     * (borrowed) or token ids (owned); the prompt is then optional (the
     * decoder's, default its start token) */
    bool has_input;
    const char *input_text;
    size_t input_text_len;
    int32_t *input_ids;
    size_t n_input_ids;
    int max_tokens; /* -1: not given */
    const char *max_tokens_field; /* the name it was given under (max_completion_tokens is an alias) */
    struct sampler_params sampling;
    bool has_seed;
    const char *stops[IPC_MAX_STOPS];
    int n_stops;
    int n;
    int best_of; /* completions: choices generated, the n best by logprob sum returned; >= n */
    /* beam search (Hugging Face's names): num_beams 1 = none; the rest
     * only with num_beams > 1 (min_tokens: the eos ids are banned before) */
    int num_beams, num_return_sequences, min_tokens, no_repeat_ngram_size;
    int num_beam_groups; /* group (diverse) beam search when > 1, with diversity_penalty > 0 */
    float length_penalty, diversity_penalty;
    enum beam_early early_stopping;
    bool stream, include_usage, ignore_eos, return_tokens;
    bool private_kv; /* "private": none of its blocks go to a shared (remote) tier */
    /* completions' "shared_prefix": how much of the prompt may go to a
     * shared tier, in tokens (-1: not given) or as the text the prompt
     * starts with (borrowed; NULL: not given) */
    long long shared_tokens;
    const char *shared_text;
    size_t shared_text_len;
    bool logprobs;
    int top_logprobs;
    const char *session; /* NULL: none */
    bool cache_given;    /* "cache" or "use_cache" was in the request */
    struct ipc_cache_choice cache;
    /* constrained output (owned): response_format json_object/json_schema,
     * or the call tool_choice required/named forces; NULL: free text */
    gram *grammar;
    const json_t *tools; /* borrowed: the tools array; NULL: none, an empty list, or tool_choice none */
    enum ipc_tool_choice tool_choice;
    /* borrowed: chat's documents (objects of strings) for the template's
     * `documents`, as transformers passes them to RAG templates; NULL: none */
    const json_t *documents;
    /* borrowed: chat_template_kwargs, the template's other variables (as
     * vLLM and transformers pass them: Qwen3's enable_thinking); NULL: none */
    const json_t *template_kwargs;
    enum ipc_chat_end chat_end; /* from add_generation_prompt and continue_final_message */
};

enum ipc_status ipc_gen_req_parse(const json_t *root, bool chat, const struct ipc_limits *lim, struct ipc_gen_req *out,
                                  struct ipc_error *err);
void ipc_gen_req_release(struct ipc_gen_req *r); /* accepts a zeroed or released request */
/* max_tokens against the context: only a sink cache generates past it.
 * ipc_gen_req_parse checks it against the request's cache; a request on a
 * session is checked by the caller against the session's (sink). */
enum ipc_status ipc_max_tokens_check(const struct ipc_gen_req *r, bool sink, int max_context, struct ipc_error *err);

/* POST /v1/sessions: an optional prefix (text or ids, prefilled at once) or
 * system prompt (rendered by the chat template), and the cache strategy. */
struct ipc_session_req {
    const char *prefix;
    size_t prefix_len;
    int32_t *ids;
    size_t n_ids;
    const char *system;
    size_t system_len;
    const char *field; /* the key that gave the start ("prefix", "prompt", "system"), for errors */
    bool record; /* "activate_past_recording": true */
    bool private_kv; /* "private": the start's blocks go to no shared (remote) tier */
    struct ipc_cache_choice cache;
};
enum ipc_status ipc_session_req_parse(const json_t *root, const struct ipc_limits *lim, struct ipc_session_req *out,
                                      struct ipc_error *err);
void ipc_session_req_release(struct ipc_session_req *r);

/* POST /v1/sessions/{id}/crop: {"n": N}, Hugging Face's crop() argument
 * (negative: tokens to remove), |N| <= KV_SEQ_MAX_LEN; the store checks
 * the rest. */
enum ipc_status ipc_crop_req_parse(const json_t *root, int64_t *n, struct ipc_error *err);

/* Decodes an array of token ids (checked against lim before allocating);
 * *out is malloc'd (NULL when the array is empty). */
enum ipc_status ipc_parse_ids(const json_t *arr, const char *field, const struct ipc_limits *lim, int32_t **out,
                              size_t *n, struct ipc_error *err);

#endif
