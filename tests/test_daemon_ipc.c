/* Description: the protocol pieces kvtierd and kvtier share (ipc/): chat
 * templates against renders by @huggingface/jinja of the canonical
 * templates, the cache strategy table, request validation and the JSON
 * writer.  (The client side, libkvtier-client, has test_client.) */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "util/args.h"
#include "ipc/cache.h"
#include "text/chat.h"
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
    assert_string_equal(err.param, "cache.adaptive");
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
    assert_non_null(strstr(err.msg, "cache.offload is not a parameter of \"dynamic\""));
    assert_string_equal(err.param, "cache.offload");
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
    assert_string_equal(err.param, "cache.max_cache_len");
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

static const struct ipc_limits lim = {.vocab = 100, .max_context = 64, .max_n = 4, .max_messages = 8,
                                     .model_id = "builtin", .model_dir = "model/builtin"};

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
        {"{\"prompt\":\"x\",\"model\":\"gpt-4o\"}", false, IPC_ENOMODEL, "model"},
        {"{\"prompt\":\"x\",\"model\":\"builtin:7b\"}", false, IPC_ENOMODEL, "model"},
        {"{\"prompt\":\"x\",\"presence_penalty\":2.5}", false, IPC_EINVAL, "presence_penalty"},
        {"{\"prompt\":\"x\",\"repeat_penalty\":1.1,\"repetition_penalty\":1.1}", false, IPC_EINVAL,
         "repeat_penalty"},
        {"{\"prompt\":\"x\",\"repeat_penalty\":1.1,\"repeat_last_n\":-2}", false, IPC_EINVAL, "repeat_last_n"},
        {"{\"prompt\":\"x\",\"typical_p\":0}", false, IPC_EINVAL, "typical_p"},
        {"{\"prompt\":\"x\",\"num_beams\":2,\"frequency_penalty\":1}", false, IPC_EINVAL, "frequency_penalty"},
        {"{\"prompt\":\"x\",\"reasoning_effort\":\"extreme\"}", false, IPC_EINVAL, "reasoning_effort"},
        {"{\"prompt\":\"x\",\"cache_prompt\":1}", false, IPC_EINVAL, "cache_prompt"},
        {"{\"prompt\":\"x\",\"logit_bias\":{\"5\":1}}", false, IPC_ENOTIMPL, "logit_bias"},
        {"{\"messages\":[{\"role\":\"function\",\"content\":\"x\"}]}", true, IPC_ENOTIMPL, "messages"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"tool_calls\":[]}]}", true, IPC_EINVAL, "messages"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":{\"type\":\"json_schema\","
         "\"json_schema\":{\"schema\":{\"type\":\"string\",\"format\":\"date\"}}}}", true, IPC_EINVAL, "response_format"},
        {"{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_object\"},\"ignore_eos\":true}", false, IPC_EINVAL,
         "ignore_eos"},
        {"{\"prompt\":\"x\",\"response_format\":{\"type\":\"yaml\"}}", false, IPC_EINVAL, "response_format"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"required\"}", true, IPC_EINVAL,
         "tool_choice"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\",\"function\":"
         "{\"name\":\"a b\"}}]}", true, IPC_EINVAL, "tools"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\",\"function\":"
         "{\"name\":\"f\",\"parameters\":{\"type\":\"object\",\"oneOf\":[]}}}],\"tool_choice\":\"required\"}", true,
         IPC_EINVAL, "tools"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":\"function\"}]}", true,
         IPC_EINVAL, "tools"},
        {"{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"function\":{}}]}]}", true,
         IPC_EINVAL, "messages"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":1}", true, IPC_EINVAL,
         "top_logprobs"},
        {"{\"messages\":[1,2,3,4,5,6,7,8,9]}", true, IPC_EINVAL, "messages"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"documents\":{}}", true, IPC_EINVAL,
         "documents"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"documents\":[\"d\"]}", true, IPC_EINVAL,
         "documents"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"documents\":[{\"text\":1}]}", true,
         IPC_EINVAL, "documents"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"continue_final_message\":1}", true,
         IPC_EINVAL, "continue_final_message"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"add_generation_prompt\":true,"
         "\"continue_final_message\":true}", true, IPC_EINVAL, "continue_final_message"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template_kwargs\":"
         "{\"continue_final_message\":true}}", true, IPC_EINVAL, "chat_template_kwargs"},
        {"{\"prompt\":\"x\",\"continue_final_message\":true}", false, IPC_EINVAL, "continue_final_message"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        enum ipc_status st = parse(bad[i].json, bad[i].chat, &r, &err, &root);
        if (st != bad[i].st || strcmp(err.param, bad[i].param))
            fail_msg("%s: got %d param %s (%s)", bad[i].json, st, err.param, err.msg);
        ipc_gen_req_release(&r);
        json_decref(root);
    }
    /* token ids past the context parse: a sink session's whole conversation
     * may be longer, and the daemon checks the context once it knows the
     * session's cache; the bound here is the sink's */
    assert_int_equal(parse("{\"prompt\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,"
                           "28,29,30,31,32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47,48,49,50,51,52,53,54,55,56,57,"
                           "58,59,60,61,62,63,64,65]}",
                           false, &r, &err, &root),
                     IPC_OK);
    assert_int_equal(r.n_ids, 65);
    ipc_gen_req_release(&r);
    json_decref(root);
    size_t big_len = 16 + 2 * ((size_t)IPC_MAX_SINK_TOKENS + 1);
    char *big = malloc(big_len);
    assert_non_null(big);
    size_t at = (size_t)sprintf(big, "{\"prompt\":[");
    for (int i = 0; i <= IPC_MAX_SINK_TOKENS; i++)
        at += (size_t)sprintf(big + at, i ? ",1" : "1");
    sprintf(big + at, "]}");
    assert_int_equal(parse(big, false, &r, &err, &root), IPC_ECONTEXT);
    assert_string_equal(err.param, "prompt");
    ipc_gen_req_release(&r);
    json_decref(root);
    free(big);
    /* what other local servers accept: effects into the sampler, no-ops checked and accepted */
    assert_int_equal(parse("{\"prompt\":\"x\",\"model\":\"builtin:latest\",\"presence_penalty\":0.5,"
                           "\"frequency_penalty\":-1,\"typical_p\":0.9,\"repeat_penalty\":1.3,\"min_tokens\":4,"
                           "\"cache_prompt\":false,\"keep_alive\":\"5m\",\"reasoning_effort\":\"low\"}",
                           false, &r, &err, &root),
                     IPC_OK);
    assert_float_equal(r.sampling.presence_penalty, 0.5, 0);
    assert_float_equal(r.sampling.frequency_penalty, -1, 0);
    assert_float_equal(r.sampling.typical_p, 0.9f, 0);
    assert_float_equal(r.sampling.repetition_penalty, 1.3f, 0);
    assert_int_equal(r.sampling.penalty_last_n, 64);
    assert_int_equal(r.min_tokens, 4);
    ipc_gen_req_release(&r);
    json_decref(root);
    /* keep_alive: what Ollama (Go's time.ParseDuration) reads, or seconds */
    static const char *const alive_ok[] = {"\"5m\"", "\"1h30m\"", "\"-1s\"", "\"0\"", "\".5s\"", "\"1.5ms\"",
                                           "\"300us\"", "\"2\u00b5s\"", "-1", "300", "1.5"};
    static const char *const alive_bad[] = {"\"xyz\"", "\"5\"", "\"\"", "\"-\"", "\"5mx\"", "\".s\"", "\"1d\"",
                                            "\"5 m\"", "true", "[1]"};
    for (size_t i = 0; i < sizeof(alive_ok) / sizeof(alive_ok[0]) + sizeof(alive_bad) / sizeof(alive_bad[0]); i++) {
        bool ok = i < sizeof(alive_ok) / sizeof(alive_ok[0]);
        const char *v = ok ? alive_ok[i] : alive_bad[i - sizeof(alive_ok) / sizeof(alive_ok[0])];
        char body[96];
        snprintf(body, sizeof(body), "{\"prompt\":\"x\",\"keep_alive\":%s}", v);
        enum ipc_status st = parse(body, false, &r, &err, &root);
        if (ok ? st != IPC_OK : st != IPC_EINVAL || strcmp(err.param, "keep_alive"))
            fail_msg("keep_alive %s: got %d (%s)", v, st, err.msg);
        ipc_gen_req_release(&r);
        json_decref(root);
    }
    assert_int_equal(parse("{\"prompt\":\"x\",\"model\":\"model/builtin\",\"repeat_penalty\":1.3,"
                           "\"repeat_last_n\":0}", false, &r, &err, &root), IPC_OK);
    assert_float_equal(r.sampling.repetition_penalty, 1, 0);
    ipc_gen_req_release(&r);
    json_decref(root);
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
    /* where the prompt ends: continuing the final message leaves the
     * generation prompt out (both true is refused, above) */
    static const struct {
        const char *fields;
        enum ipc_chat_end end;
    } ends[] = {
        {"", IPC_CHAT_GENERATE},
        {",\"add_generation_prompt\":false", IPC_CHAT_CLOSED},
        {",\"add_generation_prompt\":null,\"continue_final_message\":null", IPC_CHAT_GENERATE},
        {",\"continue_final_message\":true", IPC_CHAT_CONTINUE},
        {",\"continue_final_message\":true,\"add_generation_prompt\":false", IPC_CHAT_CONTINUE},
        {",\"continue_final_message\":false,\"add_generation_prompt\":true", IPC_CHAT_GENERATE},
        {",\"continue_final_message\":false,\"add_generation_prompt\":false", IPC_CHAT_CLOSED},
    };
    for (size_t i = 0; i < sizeof(ends) / sizeof(ends[0]); i++) {
        char body[160];
        snprintf(body, sizeof(body), "{\"messages\":[{\"role\":\"assistant\",\"content\":\"x\"}]%s}", ends[i].fields);
        assert_int_equal(parse(body, true, &r, &err, &root), IPC_OK);
        if (r.chat_end != ends[i].end)
            fail_msg("%s: chat_end %d, want %d", body, r.chat_end, ends[i].end);
        ipc_gen_req_release(&r);
        json_decref(root);
    }
    /* documents reach the template as given */
    assert_int_equal(parse("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"documents\":[{\"title\":\"t\","
                           "\"text\":\"d\"}]}", true, &r, &err, &root), IPC_OK);
    assert_int_equal(json_array_size(r.documents), 1);
    assert_string_equal(json_string_value(json_object_get(json_array_get(r.documents, 0), "text")), "d");
    ipc_gen_req_release(&r);
    json_decref(root);
    assert_int_equal(parse("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{\"type\":"
                           "\"function\",\"function\":{\"name\":\"f\"}}],\"tool_choice\":\"none\"}", true, &r, &err, &root),
                     IPC_OK);
    assert_null(r.tools);
    ipc_gen_req_release(&r);
    json_decref(root);
    /* tool turns stay messages for the template; a forced call compiles a grammar */
    assert_int_equal(parse("{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"assistant\","
                           "\"content\":null,\"tool_calls\":[{\"id\":\"c\",\"type\":\"function\",\"function\":"
                           "{\"name\":\"f\",\"arguments\":\"{\\\"a\\\":1}\"}}]},{\"role\":\"tool\",\"tool_call_id\":\"c\","
                           "\"content\":\"ok\"}],\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}],"
                           "\"tool_choice\":\"required\"}", true, &r, &err, &root), IPC_OK);
    assert_string_equal(json_string_value(json_object_get(json_array_get(r.messages, 2), "role")), "tool");
    assert_int_equal(json_array_size(json_object_get(json_array_get(r.messages, 1), "tool_calls")), 1);
    assert_int_equal(r.tool_choice, IPC_TOOLS_REQUIRED);
    assert_non_null(r.tools);
    assert_non_null(r.grammar);
    ipc_gen_req_release(&r);
    assert_null(r.grammar);
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
    /* no infinities in JSON: a -inf log-probability is null */
    jw_dynamic(&w);
    jw_lit(&w, "[");
    jw_real(&w, -0.8123456789, 6);
    jw_lit(&w, ",");
    jw_real(&w, -INFINITY, 6);
    jw_lit(&w, ",");
    jw_real(&w, NAN, 9);
    jw_lit(&w, "]");
    assert_false(w.failed);
    assert_string_equal(w.p, "[-0.812346,null,null]");
    free(w.p);
    char buf[8];
    jw_fixed(&w, buf, sizeof(buf));
    jw_lit(&w, "1234567");
    assert_false(w.failed);
    jw_lit(&w, "8");
    assert_true(w.failed);
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
    assert_true(args_float("1e-50", 0, 1, &f) && f == 0.0f); /* an underflow rounds to 0, in range */
    assert_false(args_float("1e50", 0, 1e30f, &f));
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
        cmocka_unit_test(test_request),      cmocka_unit_test(test_jsonw),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
