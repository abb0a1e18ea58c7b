/* Description: the protocol pieces kvtierd and kvtier share (ipc/): chat
 * templates against renders by @huggingface/jinja of the canonical
 * templates, the cache strategy table, request validation, the JSON writer,
 * and the client's HTTP/SSE reply parser under hostile input. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>

#include "util/args.h"
#include "ipc/cache.h"
#include "text/chat.h"
#include "ipc/httpc.h"
#include "ipc/jsonw.h"
#include "ipc/request.h"

/* family, template, render of `sys`, render of `nosys` (NULL: the template raises) */
static const struct {
    const char *family, *jinja, *with_system, *without_system;
} goldens[] = {
    {"llama2", "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}", "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n Hi there [/INST] Hello! </s><s>[INST] Bye [/INST]", "<s>[INST] Hi [/INST] Yo </s><s>[INST] Bye [/INST]"},
    {"mistral", "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}", NULL, "<s>[INST] Hi [/INST]Yo</s>[INST] Bye [/INST]"},
    {"llama3", "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}", "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"},
    {"chatml", "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}", "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi there <|im_end|>\n<|im_start|>assistant\nHello! <|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"},
    {"zephyr", "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n{% endfor %}", "<|system|>\nBe brief.</s>\n<|user|>\n Hi there </s>\n<|assistant|>\nHello! </s>\n<|user|>\nBye</s>\n<|assistant|>\n", "<|user|>\nHi</s>\n<|assistant|>\nYo</s>\n<|user|>\nBye</s>\n<|assistant|>\n"},
};

static const char *bos_of(const char *f)
{
    return !strcmp(f, "llama3") ? "<|begin_of_text|>" : !strcmp(f, "chatml") ? "" : "<s>";
}

static const char *eos_of(const char *f)
{
    return !strcmp(f, "llama3") ? "<|eot_id|>" : !strcmp(f, "chatml") ? "<|im_end|>" : "</s>";
}

static void test_chat_goldens(void **state)
{
    (void)state;
    const struct chat_msg sys[] = {{CHAT_ROLE_SYSTEM, "Be brief.", 9, NULL},
                                  {CHAT_ROLE_USER, " Hi there ", 10, NULL},
                                  {CHAT_ROLE_ASSISTANT, "Hello! ", 7, NULL},
                                  {CHAT_ROLE_USER, "Bye", 3, NULL}};
    const struct chat_msg nosys[] = {{CHAT_ROLE_USER, "Hi", 2, NULL},
                                    {CHAT_ROLE_ASSISTANT, "Yo", 2, NULL},
                                    {CHAT_ROLE_USER, "Bye", 3, NULL}};
    for (size_t i = 0; i < sizeof(goldens) / sizeof(goldens[0]); i++) {
        struct chat_template t;
        chat_detect(goldens[i].jinja, &t);
        assert_string_equal(chat_family_name(t.family), goldens[i].family);
        const char *want[2] = {goldens[i].with_system, goldens[i].without_system};
        const struct chat_msg *conv[2] = {sys, nosys};
        size_t n[2] = {4, 3};
        for (int k = 0; k < 2; k++) {
            char *out = NULL;
            size_t len;
            char err[TEXT_ERR_LEN];
            enum text_status st = chat_render(&t, conv[k], n[k], true, bos_of(goldens[i].family),
                                                 eos_of(goldens[i].family), &out, &len,  err);
            if (!want[k]) {
                assert_int_equal(st, TEXT_EINVAL);
                assert_non_null(strstr(err, "system"));
                continue;
            }
            assert_int_equal(st, TEXT_OK);
            assert_string_equal(out, want[k]);
            assert_int_equal(len, strlen(want[k]));
            free(out);
        }
    }
}

static void test_chat_refusals(void **state)
{
    (void)state;
    struct chat_template t;
    const char *bad[] = {NULL, "{{ 'Cutting Knowledge Date' }}<|start_header_id|>", "<|im_start|>{% if x %}<think>",
                         "{{ messages }}"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        chat_detect(bad[i], &t);
        assert_int_equal(t.family, CHAT_NONE);
        assert_true(t.why[0]);
        struct chat_msg m = {CHAT_ROLE_USER, "x", 1, NULL};
        char *out;
        size_t len;
        char err[TEXT_ERR_LEN];
        assert_int_equal(chat_render(&t, &m, 1, true, "", "", &out, &len,  err), TEXT_EUNSUPPORTED);
        assert_null(out);
    }
    /* Llama-2 needs user/assistant alternation */
    chat_detect("[INST] <<SYS>>", &t);
    struct chat_msg two_users[] = {{CHAT_ROLE_USER, "a", 1, NULL}, {CHAT_ROLE_USER, "b", 1, NULL}};
    char *out;
    size_t len;
    char err[TEXT_ERR_LEN];
    assert_int_equal(chat_render(&t, two_users, 2, true, "<s>", "</s>", &out, &len,  err), TEXT_EINVAL);
}

static enum ipc_status cache_of(const char *json, struct ipc_cache_choice *c, struct ipc_error *err)
{
    json_t *o = json_loads(json, 0, NULL);
    enum ipc_status st = ipc_cache_parse(json_object_get(o, "cache"), json_object_get(o, "use_cache"),
                                         &(struct ipc_cache_model){.max_len = 4096}, c, err);
    json_decref(o);
    return st;
}

static void test_cache_table(void **state)
{
    (void)state;
    struct ipc_cache_choice c;
    struct ipc_error err;
    assert_int_equal(cache_of("{}", &c, &err), IPC_OK);
    assert_string_equal(c.name, "dynamic");
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"dynamic\"},\"use_cache\":true}", &c, &err), IPC_OK);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"quantized\",\"nbits\":8}}", &c, &err), IPC_OK);
    assert_int_equal(c.params.strategy, KV_QUANTIZED);
    assert_int_equal(c.params.quant.nbits, 8);
    assert_false(c.params.no_fallback); /* allow_offload defaults to true */
    assert_false(c.params.offload);
    assert_true(c.use_cache);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"quantized\",\"nbits\":3}}", &c, &err), IPC_EINVAL);
    assert_string_equal(err.param, "cache.nbits");
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"quantized\",\"offload\":true,"
                              "\"allow_offload\":false}}", &c, &err), IPC_OK);
    assert_true(c.params.offload && c.params.no_fallback);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"quantized\",\"adaptive\":true}}", &c, &err),
                     IPC_EINVAL);
    assert_non_null(strstr(err.msg, "cache.adaptive is not a parameter of \"quantized\"; valid: backend, nbits"));
    assert_non_null(strstr(err.msg, "residual_length, allow_offload, window_length, num_sink_tokens, offload"));
    /* sinks + quantized: num_sink_tokens turns the sinks on (window 256 by default) */
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"quantized\",\"nbits\":2,\"num_sink_tokens\":4}}", &c,
                              &err), IPC_OK);
    assert_true(c.params.sink);
    assert_int_equal(c.params.window_length, 256);
    assert_int_equal(c.params.num_sink_tokens, 4);
    assert_int_equal(c.params.quant.nbits, 2);
    /* window_length alone: a sliding window over the quantized cache */
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"quantized\",\"window_length\":64}}", &c, &err),
                     IPC_OK);
    assert_false(c.params.sink);
    assert_int_equal(c.params.window_length, 64);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"quantized\",\"window_length\":0}}", &c, &err),
                     IPC_EINVAL);
    assert_string_equal(err.param, "cache.window_length");
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"dynamic\",\"offload\":true}}", &c, &err),
                     IPC_EINVAL);
    assert_non_null(strstr(err.msg, "offload is not a parameter of \"dynamic\""));
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"warp\"}}", &c, &err), IPC_EINVAL);
    assert_non_null(strstr(err.msg, "dynamic, static, offloaded"));
    assert_string_equal(err.param, "cache.implementation");
    assert_int_equal(cache_of("{\"use_cache\":false}", &c, &err), IPC_OK);
    assert_false(c.use_cache);
    assert_true(c.params.no_prefix_cache); /* each step starts from nothing */
    assert_int_equal(cache_of("{\"use_cache\":0}", &c, &err), IPC_EINVAL);
    assert_string_equal(err.param, "use_cache");
    assert_int_equal(cache_of("{\"cache\":[]}", &c, &err), IPC_EINVAL);
}

/* The parameters of the built strategies land in kv_seq_params with HF's
 * meaning; everything else is a 400 that lists what is valid. */
static void test_cache_params(void **state)
{
    (void)state;
    struct ipc_cache_choice c;
    struct ipc_error err;
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"static\",\"max_cache_len\":100}}", &c, &err), IPC_OK);
    assert_int_equal(c.params.strategy, KV_STATIC);
    assert_int_equal(c.params.max_cache_len, 100);
    assert_false(c.params.no_fallback);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"static\",\"max_cache_len\":8,"
                              "\"allow_offload\":false}}", &c, &err), IPC_OK);
    assert_true(c.params.no_fallback);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"offloaded\"}}", &c, &err), IPC_OK);
    assert_int_equal(c.params.strategy, KV_OFFLOADED);
    assert_int_equal(c.params.offload_sliding, KV_OFFLOAD_SLIDING_DEFAULT);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"offloaded\",\"offload_only_non_sliding\":true}}",
                              &c, &err), IPC_OK);
    assert_int_equal(c.params.offload_sliding, KV_OFFLOAD_SLIDING_NO);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"offloaded_static\",\"max_cache_len\":64,"
                              "\"offload_only_non_sliding\":false,\"adaptive\":true}}", &c, &err), IPC_OK);
    assert_int_equal(c.params.strategy, KV_OFFLOADED_STATIC);
    assert_int_equal(c.params.offload_sliding, KV_OFFLOAD_SLIDING_YES);
    assert_true(c.params.adaptive);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"dynamic\",\"max_cache_len\":4}}", &c, &err), IPC_OK);
    assert_int_equal(c.params.max_cache_len, 4);

    /* static without its capacity: names the parameter */
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"static\"}}", &c, &err), IPC_EINVAL);
    assert_non_null(strstr(err.msg, "needs cache.max_cache_len"));
    /* a parameter of another strategy: lists this one's */
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"static\",\"max_cache_len\":8,\"adaptive\":true}}",
                              &c, &err), IPC_EINVAL);
    assert_non_null(strstr(err.msg, "valid: max_cache_len, allow_offload, window_length"));
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"dynamic\",\"offload_only_non_sliding\":true}}",
                              &c, &err), IPC_EINVAL);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"offloaded\",\"windows\":1}}", &c, &err),
                     IPC_EINVAL);
    assert_non_null(strstr(err.msg, "max_cache_len, offload_only_non_sliding, adaptive, allow_offload, window_length"));
    /* lengths are bounded by the context before anything is sized by them */
    const char *bad_len[] = {"0", "-1", "4097", "1e3", "\"8\"", "true", "99999999999999"};
    for (size_t i = 0; i < sizeof(bad_len) / sizeof(bad_len[0]); i++) {
        char json[128];
        snprintf(json, sizeof(json), "{\"cache\":{\"implementation\":\"static\",\"max_cache_len\":%s}}", bad_len[i]);
        assert_int_equal(cache_of(json, &c, &err), IPC_EINVAL);
        assert_string_equal(err.param, "cache.max_cache_len");
        assert_non_null(strstr(err.msg, "from 1 to 4096"));
    }
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"offloaded\",\"adaptive\":1}}", &c, &err),
                     IPC_EINVAL);
    assert_string_equal(err.param, "cache.adaptive");
    assert_non_null(strstr(err.msg, "true or false"));
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"offloaded\",\"adaptive\":true}}", &c, &err),
                     IPC_EINVAL);
    assert_non_null(strstr(err.msg, "needs cache.max_cache_len"));
    /* sliding_window: the window from the request, else the model's; none at all is a 400 */
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"sliding_window\"}}", &c, &err), IPC_EINVAL);
    assert_string_equal(err.param, "cache.window_length");
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"sliding_window\",\"window_length\":64}}", &c, &err),
                     IPC_OK);
    assert_int_equal(c.params.strategy, KV_DYNAMIC);
    assert_int_equal(c.params.window_length, 64);
    json_t *o = json_loads("{\"implementation\":\"sliding_window\"}", 0, NULL);
    assert_int_equal(
        ipc_cache_parse(o, NULL, &(struct ipc_cache_model){.max_len = 4096, .sliding_window = 128}, &c, &err), IPC_OK);
    assert_int_equal(c.params.window_length, 128);
    json_decref(o);
    /* a model that cannot take sinks (learned positions) refuses them, naming the field */
    struct ipc_cache_model nosink = {.max_len = 4096, .no_sink = "learned absolute positions"};
    o = json_loads("{\"implementation\":\"sink\"}", 0, NULL);
    assert_int_equal(ipc_cache_parse(o, NULL, &nosink, &c, &err), IPC_EINVAL);
    assert_string_equal(err.param, "cache.implementation");
    assert_non_null(strstr(err.msg, "learned absolute positions"));
    json_decref(o);
    o = json_loads("{\"implementation\":\"quantized\",\"num_sink_tokens\":4,\"window_length\":64}", 0, NULL);
    assert_int_equal(ipc_cache_parse(o, NULL, &nosink, &c, &err), IPC_EINVAL);
    assert_string_equal(err.param, "cache.num_sink_tokens");
    json_decref(o);
    o = json_loads("{\"implementation\":\"quantized\"}", 0, NULL);
    assert_int_equal(ipc_cache_parse(o, NULL, &nosink, &c, &err), IPC_OK); /* no sinks: fine */
    json_decref(o);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"offloaded\",\"window_length\":16}}", &c, &err),
                     IPC_OK);
    assert_int_equal(c.params.strategy, KV_OFFLOADED);
    assert_int_equal(c.params.window_length, 16);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"sliding_window\",\"window_length\":0}}", &c, &err),
                     IPC_EINVAL);
    /* sink: HF SinkCache's defaults, or the request's; a window of 0 is refused here, the rest by the store */
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"sink\"}}", &c, &err), IPC_OK);
    assert_true(c.params.sink);
    assert_int_equal(c.params.strategy, KV_DYNAMIC);
    assert_int_equal(c.params.window_length, 256);
    assert_int_equal(c.params.num_sink_tokens, 4);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"sink\",\"window_length\":64,\"num_sink_tokens\":0}}",
                              &c, &err), IPC_OK);
    assert_int_equal(c.params.window_length, 64);
    assert_int_equal(c.params.num_sink_tokens, 0);
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"sink\",\"num_sink_tokens\":-1}}", &c, &err),
                     IPC_EINVAL);
    assert_non_null(strstr(err.msg, "from 0 to 4096"));
    assert_int_equal(cache_of("{\"cache\":{\"implementation\":\"sink\",\"max_cache_len\":64}}", &c, &err),
                     IPC_EINVAL);
    assert_non_null(strstr(err.msg, "valid: window_length, num_sink_tokens"));
}

static const struct ipc_limits lim = {.vocab = 100, .max_context = 64, .max_n = 4, .max_messages = 8};

static enum ipc_status parse(const char *json, bool chat, struct ipc_gen_req *r, struct ipc_error *err, json_t **root)
{
    *root = json_loads(json, JSON_REJECT_DUPLICATES, NULL);
    assert_non_null(*root);
    return ipc_gen_req_parse(*root, chat, &lim, r, err);
}

static void test_request(void **state)
{
    (void)state;
    struct ipc_gen_req r;
    struct ipc_error err;
    json_t *root;
    assert_int_equal(parse("{\"prompt\":\"hi\",\"stop\":[\"a\",\"b\"],\"seed\":5,\"n\":2}", false, &r, &err, &root),
                     IPC_OK);
    assert_int_equal(r.n_stops, 2);
    assert_true(r.has_seed);
    assert_int_equal(r.sampling.seed, 5);
    assert_float_equal(r.sampling.temperature, 1, 0);
    assert_int_equal(r.max_tokens, -1);
    ipc_gen_req_release(&r);
    json_decref(root);
    static const struct {
        const char *json;
        bool chat;
        enum ipc_status st;
        const char *param;
    } bad[] = {
        {"{\"prompt\":[1,100]}", false, IPC_EINVAL, "prompt"},
        {"{\"prompt\":[1],\"max_tokens\":65}", false, IPC_EINVAL, "max_tokens"},
        {"{\"prompt\":\"x\",\"n\":5}", false, IPC_EINVAL, "n"},
        {"{\"prompt\":\"x\",\"bogus\":1}", false, IPC_EINVAL, "bogus"},
        {"{\"prompt\":\"x\",\"messages\":[]}", false, IPC_EINVAL, "messages"},
        {"{\"prompt\":\"x\",\"session\":\"s\",\"n\":2}", false, IPC_EINVAL, "n"},
        {"{\"prompt\":\"x\",\"echo\":true}", false, IPC_ENOTIMPL, "echo"},
        {"{\"prompt\":\"x\",\"num_beams\":5}", false, IPC_EINVAL, "num_beams"},
        {"{\"prompt\":\"x\",\"num_beams\":2,\"num_return_sequences\":3}", false, IPC_EINVAL,
         "num_return_sequences"},
        {"{\"prompt\":\"x\",\"num_beams\":2,\"stream\":true}", false, IPC_EINVAL, "stream"},
        {"{\"prompt\":\"x\",\"num_beams\":2,\"n\":2}", false, IPC_EINVAL, "n"},
        {"{\"prompt\":\"x\",\"num_beams\":2,\"top_k\":5}", false, IPC_EINVAL, "top_k"},
        {"{\"prompt\":\"x\",\"num_beams\":2,\"early_stopping\":\"always\"}", false, IPC_EINVAL,
         "early_stopping"},
        {"{\"prompt\":\"x\",\"num_beams\":2,\"num_beam_groups\":2}", false, IPC_EINVAL, "num_beam_groups"},
        {"{\"prompt\":\"x\",\"num_beams\":4,\"num_beam_groups\":3,\"diversity_penalty\":1}", false, IPC_EINVAL,
         "num_beam_groups"},
        {"{\"prompt\":\"x\",\"num_beams\":4,\"diversity_penalty\":1}", false, IPC_EINVAL, "diversity_penalty"},
        {"{\"prompt\":\"x\",\"num_beam_groups\":2,\"diversity_penalty\":1}", false, IPC_EINVAL, "num_beam_groups"},
        {"{\"prompt\":\"x\",\"no_repeat_ngram_size\":2}", false, IPC_EINVAL, "no_repeat_ngram_size"},
        {"{\"prompt\":\"x\",\"min_tokens\":65}", false, IPC_EINVAL, "min_tokens"},
        {"{\"prompt\":\"x\",\"n\":2,\"best_of\":1}", false, IPC_EINVAL, "best_of"},
        {"{\"prompt\":\"x\",\"best_of\":5}", false, IPC_EINVAL, "best_of"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"best_of\":2}", true, IPC_EINVAL, "best_of"},
        {"{\"prompt\":[\"a\",\"b\"]}", false, IPC_ENOTIMPL, "prompt"},
        {"{\"prompt\":\"x\",\"logprobs\":21}", false, IPC_EINVAL, "logprobs"},
        {"{\"messages\":[{\"role\":\"function\",\"content\":\"x\"}]}", true, IPC_ENOTIMPL, "messages"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"tool_calls\":[]}]}", true, IPC_EINVAL,
         "messages"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"function\":{}}]}]}", true,
         IPC_EINVAL, "messages"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\"}]}", true,
         IPC_EINVAL, "tools"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"required\"}", true,
         IPC_ENOTIMPL, "tool_choice"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":1}", true, IPC_EINVAL,
         "top_logprobs"},
        {"{\"messages\":[1,2,3,4,5,6,7,8,9]}", true, IPC_EINVAL, "messages"},
        {"{\"prompt\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,"
         "35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,58,59,60,61,62,63,64,65]}",
         false, IPC_ECONTEXT, "prompt"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        enum ipc_status st = parse(bad[i].json, bad[i].chat, &r, &err, &root);
        if (st != bad[i].st || strcmp(err.param, bad[i].param))
            fail_msg("%s: got %d param %s (%s)", bad[i].json, st, err.param, err.msg);
        ipc_gen_req_release(&r);
        json_decref(root);
    }
    /* beam search with Hugging Face's names and defaults */
    assert_int_equal(parse("{\"prompt\":\"x\",\"num_beams\":4,\"num_return_sequences\":2,\"length_penalty\":0.5,"
                           "\"early_stopping\":\"never\",\"min_tokens\":3,\"no_repeat_ngram_size\":2,"
                           "\"num_beam_groups\":1,\"diversity_penalty\":0,\"temperature\":0.7}", false, &r, &err, &root),
                     IPC_OK);
    assert_int_equal(r.num_beams, 4);
    assert_int_equal(r.num_return_sequences, 2);
    assert_float_equal(r.length_penalty, 0.5, 0);
    assert_int_equal(r.early_stopping, BEAM_EARLY_NEVER);
    assert_int_equal(r.min_tokens, 3);
    assert_int_equal(r.no_repeat_ngram_size, 2);
    ipc_gen_req_release(&r);
    json_decref(root);
    assert_int_equal(parse("{\"prompt\":\"x\",\"num_beams\":2,\"early_stopping\":true}", false, &r, &err, &root),
                     IPC_OK);
    assert_int_equal(r.num_return_sequences, 1);
    assert_int_equal(r.early_stopping, BEAM_EARLY_TRUE);
    assert_true(r.num_beam_groups <= 1);
    assert_float_equal(r.length_penalty, 1, 0);
    ipc_gen_req_release(&r);
    json_decref(root);
    assert_int_equal(parse("{\"prompt\":\"x\",\"num_beams\":4,\"num_beam_groups\":2,\"diversity_penalty\":0.5}", false,
                           &r, &err, &root), IPC_OK);
    assert_int_equal(r.num_beam_groups, 2);
    assert_float_equal(r.diversity_penalty, 0.5, 0);
    ipc_gen_req_release(&r);
    json_decref(root);
    assert_int_equal(parse("{\"prompt\":\"x\",\"n\":2,\"best_of\":4}", false, &r, &err, &root), IPC_OK);
    assert_int_equal(r.n, 2);
    assert_int_equal(r.best_of, 4);
    assert_int_equal(r.num_beams, 1);
    ipc_gen_req_release(&r);
    json_decref(root);
    /* content parts are joined */
    assert_int_equal(parse("{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"ab\"},"
                           "{\"type\":\"text\",\"text\":\"cd\"}]}]}", true, &r, &err, &root), IPC_OK);
    assert_string_equal(json_string_value(json_object_get(json_array_get(r.messages, 0), "content")), "abcd");
    ipc_gen_req_release(&r);
    json_decref(root);
    /* tools reach the template as given; a tool call's JSON arguments are parsed; developer is system */
    assert_int_equal(parse("{\"messages\":[{\"role\":\"developer\",\"content\":\"s\"},"
                           "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\","
                           "\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\": 1}\"}}]},"
                           "{\"role\":\"tool\",\"tool_call_id\":\"c\",\"content\":\"1\"}],"
                           "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"auto\"}",
                           true, &r, &err, &root), IPC_OK);
    char *dump = json_dumps(r.messages, JSON_COMPACT);
    assert_string_equal(dump, "[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"assistant\",\"content\":null,"
                              "\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\",\"function\":{\"name\":\"f\","
                              "\"arguments\":{\"a\":1}}}]},{\"role\":\"tool\",\"content\":\"1\",\"tool_call_id\":\"c\"}]");
    free(dump);
    assert_int_equal(json_array_size(r.tools), 1);
    ipc_gen_req_release(&r);
    json_decref(root);
    assert_int_equal(parse("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":"
                           "\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"none\"}", true, &r, &err, &root),
                     IPC_OK);
    assert_null(r.tools);
    ipc_gen_req_release(&r);
    json_decref(root);
}

static void test_jsonw(void **state)
{
    (void)state;
    struct jw w;
    jw_dynamic(&w);
    jw_str(&w, "a\"b\\c\n\x01\xC3\xA9\xFF\xED\xA0\x80z", 14);
    assert_false(w.failed);
    /* é kept, 0xFF and the encoded surrogate become U+FFFD */
    assert_string_equal(w.p, "\"a\\\"b\\\\c\\n\\u0001\xC3\xA9\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBDz\"");
    json_t *back = json_loads(w.p, JSON_DECODE_ANY, NULL);
    assert_non_null(back); /* valid JSON whatever the bytes */
    json_decref(back);
    free(w.p);
    assert_int_equal(jw_fit("ab\xC3\xA9", 4, 3), 2); /* never splits a character */
    assert_int_equal(jw_fit("ab\xC3\xA9", 4, 4), 4);
    assert_int_equal(jw_fit("\n\n", 2, 3), 1);
    char buf[8];
    jw_fixed(&w, buf, sizeof(buf));
    jw_lit(&w, "1234567");
    assert_false(w.failed);
    jw_lit(&w, "8");
    assert_true(w.failed);
}

struct events {
    int n;
    char last[64];
};

static bool on_event(void *ud, const char *data, size_t len)
{
    struct events *e = ud;
    e->n++;
    snprintf(e->last, sizeof(e->last), "%.*s", (int)len, data);
    return true;
}

/* A stand-in for kvtierd that answers each request with its own body, so
 * a test sends through ipc_call the raw reply it wants parsed. */
static void *echo_server(void *arg)
{
    int lfd = *(int *)arg, fd;
    while ((fd = accept(lfd, NULL, NULL)) >= 0) {
        char buf[4096];
        size_t n = 0;
        const char *head_end = NULL;
        ssize_t got;
        long body = 0;
        /* the head, then Content-Length bytes of body */
        while (n < sizeof(buf) && (got = recv(fd, buf + n, sizeof(buf) - n, 0)) > 0) {
            n += (size_t)got;
            if (!head_end && (head_end = memmem(buf, n, "\r\n\r\n", 4))) {
                const char *cl = memmem(buf, (size_t)(head_end - buf), "Content-Length: ", 16);
                body = cl ? strtol(cl + 16, NULL, 10) : 0;
            }
            if (head_end && n >= (size_t)(head_end + 4 - buf) + (size_t)body)
                break;
        }
        if (head_end)
            send(fd, head_end + 4, (size_t)body, MSG_NOSIGNAL);
        close(fd);
    }
    return NULL;
}

/* Parses reply[0, n) as ipc_call reads a reply from the daemon. */
static enum ipc_status call_echo(const char *sock, const char *reply, size_t n, ipc_event_fn cb, void *ud,
                                 struct ipc_reply *r, struct ipc_error *err)
{
    return ipc_call(sock, "POST", "/", reply, n, cb, ud, r, err);
}

static void test_reply_parser(void **state)
{
    (void)state;
    struct ipc_reply r;
    struct ipc_error err;
    char dir[] = "/tmp/kvtier-ipc.XXXXXX", sock[64];
    assert_non_null(mkdtemp(dir));
    snprintf(sock, sizeof(sock), "%s/s", dir);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock);
    int lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(lfd >= 0);
    assert_int_equal(bind(lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(lfd, 16), 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, echo_server, &lfd), 0);
    const char *plain = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 404 Not Found\r\nContent-Length: 5\r\n\r\nhello";
    assert_int_equal(call_echo(sock, plain, strlen(plain), NULL, NULL, &r, &err), IPC_OK);
    assert_int_equal(r.status, 404);
    assert_string_equal(r.body, "hello");
    ipc_reply_free(&r);
    const char *sse = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                      "a\r\ndata: {}\n\n\r\n1\r\nd\r\n5\r\nata: \r\n8\r\n[DONE]\n\n\r\n0\r\n\r\n";
    struct events ev = {0};
    assert_int_equal(call_echo(sock, sse, strlen(sse), on_event, &ev, &r, &err), IPC_OK);
    assert_int_equal(ev.n, 2);
    assert_string_equal(ev.last, "[DONE]");
    ipc_reply_free(&r);
    const char *bad[] = {"", "SSH-2.0\r\n", "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
                         "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                         "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffff\r\n",
                         "HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\nab", "HTTP/1.1 200 OK\r\nNoColon\r\n\r\n"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_not_equal(call_echo(sock, bad[i], strlen(bad[i]), NULL, NULL, &r, &err), IPC_OK);
        assert_null(r.body);
    }
    /* mutations of a valid stream: any result is fine, a crash or leak is not */
    size_t n = strlen(sse);
    char *m = malloc(n);
    uint64_t x = 88172645463325252ull;
    for (int it = 0; it < 20000; it++) {
        memcpy(m, sse, n);
        for (int k = 0; k < 3; k++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            m[x % n] = (char)(x >> 32);
        }
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        if (call_echo(sock, m, x % (n + 1), on_event, &ev, &r, &err) == IPC_OK)
            ipc_reply_free(&r);
    }
    free(m);
    shutdown(lfd, SHUT_RDWR); /* accept fails: the server thread ends */
    pthread_join(th, NULL);
    close(lfd);
    unlink(sock);
    rmdir(dir);
}

/* Option numbers: the whole string, in range, or a usage error. */
static void test_args(void **state)
{
    (void)state;
    int i = 7;
    assert_true(args_int("12", 0, 100, &i) && i == 12);
    assert_false(args_int("abc", 0, 100, &i));
    assert_false(args_int("-5", 0, 100, &i));
    assert_false(args_int("5x", 0, 100, &i));
    assert_false(args_int("", 0, 100, &i));
    assert_false(args_int("99999999999999999999", 0, 100, &i));
    assert_int_equal(i, 12); /* untouched by the failures */
    float f;
    assert_true(args_float("0.5", 0, 1, &f) && f == 0.5f);
    assert_false(args_float("nan", 0, 1, &f));
    assert_false(args_float("1.5", 0, 1, &f));
    size_t z;
    assert_true(args_size("3K", &z) && z == 3072);
    assert_true(args_size("2G", &z) && z == (size_t)2 << 30);
    assert_false(args_size("-1", &z));
    assert_false(args_size("1T", &z));
    uint64_t u;
    assert_true(args_u64("18446744073709551615", &u) && u == UINT64_MAX);
    assert_false(args_u64("-1", &u));
    int l[3] = {0}, n = 0;
    assert_true(args_int_list("1,4,16", 1, 1024, l, 3, &n) && n == 3 && l[0] == 1 && l[1] == 4 && l[2] == 16);
    assert_true(args_int_list("7", 1, 1024, l, 3, &n) && n == 1 && l[0] == 7);
    assert_false(args_int_list("1,2,3,4", 1, 1024, l, 3, &n)); /* more than max */
    assert_false(args_int_list("1,,2", 1, 1024, l, 3, &n));
    assert_false(args_int_list("1,", 1, 1024, l, 3, &n));
    assert_false(args_int_list("", 1, 1024, l, 3, &n));
    assert_false(args_int_list("1,abc", 1, 1024, l, 3, &n));
    assert_false(args_int_list("0", 1, 1024, l, 3, &n));
    assert_int_equal(n, 1); /* untouched by the failures */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_goldens), cmocka_unit_test(test_chat_refusals), cmocka_unit_test(test_cache_table),
        cmocka_unit_test(test_cache_params), cmocka_unit_test(test_args),
        cmocka_unit_test(test_request),      cmocka_unit_test(test_jsonw),         cmocka_unit_test(test_reply_parser),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
