/* h_ollama.c - the Ollama-compatible subset: /api/generate and /api/chat
 * (NDJSON streams by default, one object with "stream": false), /api/tags,
 * /api/ps (with each session's KV per tier), /api/show and /api/version.
 *
 * A generation request is rewritten into the OpenAI form the other
 * endpoints take (options.* become the sampling fields of the same name,
 * num_predict max_tokens, format response_format), so it is checked,
 * tokenized and run by the same code; only the reply differs.  Ollama's
 * option defaults apply to what the request leaves out (temperature 0.8,
 * top_k 40, top_p 0.9, repeat_penalty 1.1 over the last 64 tokens), and
 * without num_predict a reply may run to the end of the context.  Errors
 * are Ollama's {"error": "..."}. */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "daemon/http.h"
#include "util/clock.h"

/* The Ollama API version whose subset this implements (clients compare it). */
#define OLLAMA_API_VERSION "0.6.0"

/* options that map onto a request field of the same name */
static const char *const same_name[] = {"temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty",
                                        "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "stop"};
/* options about the runner (memory, threads, batching) that do not change
 * the output; kvtierd's own flags decide those */
static const char *const runner[] = {"num_batch", "num_gpu", "main_gpu", "low_vram", "use_mmap", "use_mlock",
                                     "num_thread", "numa", "num_keep", "penalize_newline", "vocab_only",
                                     "mirostat_eta", "mirostat_tau"};

static bool in(const char *key, const char *const *set, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!strcmp(key, set[i]))
            return true;
    return false;
}

#define IN(key, set) in(key, set, sizeof(set) / sizeof(set[0]))

static bool off(const json_t *v)
{
    return !v || json_is_null(v) || json_is_false(v) || (json_is_string(v) && !json_string_length(v)) ||
           (json_is_array(v) && !json_array_size(v)) || (json_is_integer(v) && !json_integer_value(v)) ||
           (json_is_real(v) && json_real_value(v) == 0);
}

/* options into out; *param names what failed. */
static enum ipc_status put_options(const json_t *opts, json_t *out, int ctx, struct ipc_error *err)
{
    if (!opts || json_is_null(opts))
        return IPC_OK;
    if (!json_is_object(opts))
        return ipc_fail(err, IPC_EINVAL, "options", "options must be an object");
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)opts, key, v)
    {
        /* a known option that is null is left out, as Ollama's clients drop
         * unset ones: its Ollama default stays (temperature 0.8, not 1) */
        bool known = IN(key, same_name) || IN(key, runner) || !strcmp(key, "num_predict") ||
                     !strcmp(key, "num_ctx") || !strcmp(key, "mirostat");
        if (known && json_is_null(v))
            continue;
        if (IN(key, same_name)) {
            /* Ollama's seed -1 (and a null) is a random one */
            if (!strcmp(key, "seed") && json_is_integer(v) && json_integer_value(v) == -1)
                json_object_del(out, "seed");
            else if (json_object_set(out, key, v) != 0)
                return ipc_fail(err, IPC_ENOMEM, "options", "no memory for the options");
        } else if (!strcmp(key, "num_predict")) {
            if (!json_is_integer(v) || json_integer_value(v) < -2)
                return ipc_fail(err, IPC_EINVAL, "options.num_predict", "options.num_predict must be an integer: "
                                "-1 (until the end), -2 (until the context is full) or the tokens to generate");
            /* -1: until the end; -2: until the context is full; 0: no limit,
             * as Ollama's runner counts it; all three the default here */
            if (json_integer_value(v) > 0 && json_object_set_new(out, "max_tokens", json_integer(json_integer_value(v))))
                return ipc_fail(err, IPC_ENOMEM, "options", "no memory for the options");
        } else if (!strcmp(key, "num_ctx")) {
            /* no effect: kvtierd's context applies, as Ollama clamps a num_ctx
             * above the model's trained context to it (clients such as
             * editors send their own figure with every request) */
            if (!json_is_integer(v) || json_integer_value(v) < 1)
                return ipc_fail(err, IPC_EINVAL, "options.num_ctx", "options.num_ctx must be a positive integer "
                                "(kvtierd's context is %d tokens, --ctx-size)", ctx);
        } else if (IN(key, runner)) { /* ignored, but still of their type */
            if (!json_is_number(v) && !json_is_boolean(v) && !json_is_null(v))
                return ipc_fail(err, IPC_EINVAL, "options", "options.%.48s must be a number or a boolean", key);
        } else if (!strcmp(key, "mirostat")) {
            if (!off(v))
                return ipc_fail(err, IPC_ENOTIMPL, "options.mirostat", "options.mirostat is not supported by kvtier");
        } else {
            return ipc_fail(err, IPC_EINVAL, "options", "options.%.48s is not a known option", key);
        }
    }
    return IPC_OK;
}

/* Ollama's messages as the OpenAI ones: a message's images and tool_calls
 * are Ollama fields kvtier cannot use (no vision, no tools on this API), so
 * an empty one is dropped and any other refused by name.  What is not an
 * array of objects goes on as it is, for the request's checks to refuse. */
static enum ipc_status put_messages(const json_t *msgs, json_t *out, struct ipc_error *err)
{
    json_t *copy = json_is_array(msgs) ? json_array() : json_incref((json_t *)msgs);
    if (msgs && !copy)
        return ipc_fail(err, IPC_ENOMEM, "messages", "no memory for messages");
    for (size_t i = 0; json_is_array(msgs) && i < json_array_size(msgs); i++) {
        const json_t *m = json_array_get(msgs, i);
        json_t *c = json_is_object(m) ? json_copy((json_t *)m) : json_incref((json_t *)m);
        static const char *const drop[] = {"images", "tool_calls"};
        for (size_t k = 0; c && json_is_object(m) && k < 2; k++) {
            if (!off(json_object_get(m, drop[k]))) {
                json_decref(c);
                json_decref(copy);
                return ipc_fail(err, IPC_ENOTIMPL, "messages", "messages[%zu].%s is not supported by kvtier", i,
                                drop[k]);
            }
            json_object_del(c, drop[k]);
        }
        if (json_array_append_new(copy, c)) {
            json_decref(copy);
            return ipc_fail(err, IPC_ENOMEM, "messages", "no memory for messages");
        }
    }
    int bad = copy && json_object_set_new(out, "messages", copy);
    return bad ? ipc_fail(err, IPC_ENOMEM, "messages", "no memory for messages") : IPC_OK;
}

/* The Ollama request r->root as the OpenAI one (*out), chat or raw prompt. */
static enum ipc_status translate(struct req *r, bool chat_api, json_t *out, bool *chat, struct ipc_error *err)
{
    const json_t *root = r->root;
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)root, key, v)
    {
        bool known = !strcmp(key, "model") || !strcmp(key, "options") || !strcmp(key, "stream") ||
                     !strcmp(key, "keep_alive") || !strcmp(key, "format") || !strcmp(key, "think") ||
                     (chat_api ? !strcmp(key, "messages") || !strcmp(key, "tools")
                               : !strcmp(key, "prompt") || !strcmp(key, "system") || !strcmp(key, "raw") ||
                                     !strcmp(key, "suffix") || !strcmp(key, "images") || !strcmp(key, "template") ||
                                     !strcmp(key, "context"));
        if (!known)
            return ipc_fail(err, IPC_EINVAL, key, "unknown field \"%.48s\"", key);
        /* what kvtier cannot do yet is refused by name, never ignored */
        bool unsupported = !strcmp(key, "think") || !strcmp(key, "tools") ||
                           !strcmp(key, "suffix") || !strcmp(key, "images") || !strcmp(key, "template") ||
                           !strcmp(key, "context");
        if (unsupported && !off(v))
            return ipc_fail(err, IPC_ENOTIMPL, key, "%s is not supported by kvtier", key);
    }
    const json_t *stream = json_object_get(root, "stream");
    if (stream && !json_is_boolean(stream) && !json_is_null(stream))
        return ipc_fail(err, IPC_EINVAL, "stream", "stream must be true or false");
    int bad = json_object_set_new(out, "stream", json_boolean(!stream || !json_is_false(stream)));
    /* Ollama's defaults, where the request does not say */
    bad |= json_object_set_new(out, "temperature", json_real(0.8));
    bad |= json_object_set_new(out, "top_k", json_integer(40));
    bad |= json_object_set_new(out, "top_p", json_real(0.9));
    bad |= json_object_set_new(out, "repeat_penalty", json_real(1.1));
    if (json_object_get(root, "model"))
        bad |= json_object_set(out, "model", json_object_get(root, "model"));
    if (json_object_get(root, "keep_alive"))
        bad |= json_object_set(out, "keep_alive", json_object_get(root, "keep_alive"));
    /* format is Ollama's constrained output: "json" an object, an object a
     * JSON schema; both are response_format's, so the same grammar runs */
    const json_t *format = json_object_get(root, "format");
    if (json_is_string(format) && !strcmp(json_string_value(format), "json"))
        bad |= json_object_set_new(out, "response_format", json_pack("{s:s}", "type", "json_object"));
    else if (json_is_object(format))
        bad |= json_object_set_new(out, "response_format", json_pack("{s:s,s:{s:s,s:O}}", "type", "json_schema",
                                                                     "json_schema", "name", "format", "schema",
                                                                     format));
    else if (!off(format))
        return ipc_fail(err, IPC_EINVAL, "format", "format must be \"json\" or a JSON schema (an object)");
    if (bad)
        return ipc_fail(err, IPC_ENOMEM, "", "no memory for the request");
    enum ipc_status st = put_options(json_object_get(root, "options"), out, engine_context(r->srv->eng), err);
    if (st != IPC_OK)
        return st;
    *chat = true;
    if (chat_api)
        return put_messages(json_object_get(root, "messages"), out, err);
    const json_t *prompt = json_object_get(root, "prompt"), *system = json_object_get(root, "system"),
                 *raw = json_object_get(root, "raw");
    if (prompt && !json_is_string(prompt) && !json_is_null(prompt))
        return ipc_fail(err, IPC_EINVAL, "prompt", "prompt must be a string");
    if (system && !json_is_string(system) && !json_is_null(system))
        return ipc_fail(err, IPC_EINVAL, "system", "system must be a string");
    if (raw && !json_is_boolean(raw) && !json_is_null(raw))
        return ipc_fail(err, IPC_EINVAL, "raw", "raw must be true or false");
    /* load_only() answers a request without a prompt before this is used */
    if (!json_is_string(prompt))
        return IPC_OK;
    if (json_is_true(raw)) { /* the prompt as it is, no template */
        *chat = false;
        return json_object_set(out, "prompt", (json_t *)prompt) ? ipc_fail(err, IPC_ENOMEM, "", "no memory")
                                                                : IPC_OK;
    }
    /* Ollama adds a system turn only for a non-empty system text */
    json_t *msgs = json_string_length(system) ? json_pack("[{s:s,s:O}]", "role", "system", "content", system)
                                              : json_array();
    bad |= json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "user", "content", prompt));
    bad |= json_object_set_new(out, "messages", msgs);
    return bad ? ipc_fail(err, IPC_ENOMEM, "", "no memory for the request") : IPC_OK;
}

/* The load-only request: Ollama answers an empty prompt (or no messages)
 * with done_reason "load" once the model is in memory, as it is here.  A
 * value of another type is not "empty": the request's checks refuse it. */
static bool load_only(const json_t *root, bool chat_api)
{
    const json_t *v = json_object_get(root, chat_api ? "messages" : "prompt");
    return !v || json_is_null(v) || (chat_api ? json_is_array(v) && !json_array_size(v)
                                              : json_is_string(v) && !json_string_length(v));
}

static enum ipc_status prep_ollama(struct req *r, bool chat_api)
{
    struct ipc_error *err = &r->prep.err;
    r->kind = chat_api ? REPLY_OLLAMA_CHAT : REPLY_OLLAMA_GENERATE;
    json_t *out = json_object();
    bool chat = true;
    enum ipc_status st = out ? translate(r, chat_api, out, &chat, err)
                             : ipc_fail(err, IPC_ENOMEM, "", "no memory for the request");
    struct ipc_limits lim = limits(r->srv);
    if (st == IPC_OK)
        st = ipc_check_model(json_object_get(out, "model"), &lim, err);
    if (st == IPC_OK && load_only(r->root, chat_api)) {
        json_decref(out);
        return IPC_OK; /* no job: h_ollama_generate answers "load" */
    }
    if (st != IPC_OK) {
        json_decref(out);
        return st;
    }
    json_decref(r->root);
    r->root = out;
    st = prepare_generate(r, chat, true);
    /* name the field as the client wrote it, in the message too: Ollama's
     * error envelope carries only the message */
    const char *as = !strcmp(err->param, "max_tokens") ? "num_predict" : IN(err->param, same_name) ? err->param : NULL;
    if (st != IPC_OK && !strcmp(err->param, "response_format")) {
        /* the schema's refusals name the field the client sent */
        char m[IPC_MSG_LEN];
        const char *rest = !strncmp(err->msg, "response_format", 15) ? err->msg + 15 : NULL;
        if (rest)
            snprintf(m, sizeof(m), "format%s", rest);
        else
            snprintf(m, sizeof(m), "format: %.*s", (int)(sizeof(m) - 9), err->msg);
        snprintf(err->param, sizeof(err->param), "format");
        memcpy(err->msg, m, sizeof(m));
    } else if (st != IPC_OK && as) {
        char p[IPC_PARAM_LEN], m[IPC_MSG_LEN];
        snprintf(p, sizeof(p), "options.%.40s", as);
        /* the length's message names max_tokens, which the client never sent */
        const char *mt = strstr(err->msg, "max_tokens");
        if (mt && as != err->param)
            snprintf(m, sizeof(m), "%s: %.*snum_predict%.*s", p, (int)(mt - err->msg), err->msg,
                     (int)(sizeof(m) - sizeof(p) - 40), mt + 10);
        else
            snprintf(m, sizeof(m), "%s: %.*s", p, (int)(sizeof(m) - sizeof(p) - 3), err->msg);
        memcpy(err->param, p, sizeof(p));
        memcpy(err->msg, m, sizeof(m));
    }
    r->kind = chat_api ? REPLY_OLLAMA_CHAT : REPLY_OLLAMA_GENERATE;
    return st;
}

enum ipc_status prep_ollama_generate(struct req *r)
{
    return prep_ollama(r, false);
}

enum ipc_status prep_ollama_chat(struct req *r)
{
    return prep_ollama(r, true);
}

/* Ollama's name of the model: the id with its tag. */
static void write_model_name(struct jw *w, const struct server *s)
{
    char name[300];
    snprintf(name, sizeof(name), "%s:latest", engine_model_id(s->eng));
    jw_str(w, name, strlen(name));
}

static void write_time(struct jw *w, const struct timespec *ts)
{
    struct tm tm;
    gmtime_r(&ts->tv_sec, &tm);
    char buf[64];
    strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
    jw_fmt(w, "\"%s.%09ldZ\"", buf, ts->tv_nsec);
}

static void write_now(struct jw *w)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    write_time(w, &ts);
}

void ollama_write_chunk(struct jw *w, struct req *r, const char *text, size_t n)
{
    jw_lit(w, "{\"model\":");
    write_model_name(w, r->srv);
    jw_lit(w, ",\"created_at\":");
    write_now(w);
    jw_lit(w, r->kind == REPLY_OLLAMA_CHAT ? ",\"message\":{\"role\":\"assistant\",\"content\":" : ",\"response\":");
    jw_str(w, text, n);
    jw_lit(w, r->kind == REPLY_OLLAMA_CHAT ? "}," : ",");
}

void ollama_write_final(struct jw *w, struct req *r, const char *text, size_t n)
{
    const struct job *j = r->job;
    const struct job_result *res = job_result(j);
    struct job_progress p = job_progress(j, 0);
    ollama_write_chunk(w, r, text, n);
    jw_fmt(w, "\"done\":true,\"done_reason\":\"%s\",", p.finish == GEN_FINISH_LENGTH ? "length" : "stop");
    jw_fmt(w, "\"total_duration\":%.0f,\"load_duration\":0,\"prompt_eval_count\":%zu,\"prompt_eval_duration\":%.0f,",
           (clock_ms() - r->started) * 1e6, j->n_prompt, res->prefill_ms * 1e6);
    jw_fmt(w, "\"eval_count\":%d,\"eval_duration\":%.0f,", p.n_gen, res->decode_ms * 1e6);
    write_kvtier(w, j);
    jw_lit(w, "}");
}

enum MHD_Result ollama_reply_done(struct req *r)
{
    struct job_progress p = job_progress(r->job, 0);
    struct jw w;
    jw_dynamic(&w);
    ollama_write_final(&w, r, p.text ? p.text : "", p.n_text);
    return reply_jw(r, 200, &w);
}

enum MHD_Result h_ollama_generate(struct req *r, const char *arg)
{
    (void)arg;
    struct job *j = r->prep.job;
    r->prep.job = NULL;
    if (!j) {
        struct jw w;
        jw_dynamic(&w);
        ollama_write_chunk(&w, r, "", 0);
        jw_lit(&w, "\"done\":true,\"done_reason\":\"load\"}");
        return reply_jw(r, 200, &w);
    }
    new_id(r, "ollama");
    return req_submit(r, j);
}

/* ---- what the daemon serves ---- */

/* Bytes of the model's weight files. */
/* --model names a directory, or a GGUF file: then its size */
static bool model_is_file(const char *dir, long long *size)
{
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISREG(st.st_mode))
        return false;
    *size = (long long)st.st_size;
    return true;
}

static long long weight_bytes(const char *dir)
{
    long long size;
    if (model_is_file(dir, &size))
        return size;
    DIR *d = opendir(dir);
    long long total = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        size_t n = strlen(e->d_name);
        struct stat st;
        if (n > 12 && !strcmp(e->d_name + n - 12, ".safetensors") && fstatat(dirfd(d), e->d_name, &st, 0) == 0)
            total += st.st_size;
    }
    if (d)
        closedir(d);
    return total;
}

static void write_details(struct jw *w, const struct server *s)
{
    const char *arch = engine_model_config(s->eng)->arch_name;
    long long size;
    jw_lit(w, "\"details\":{\"parent_model\":\"\",\"format\":\"");
    jw_lit(w, model_is_file(engine_model_dir(s->eng), &size) ? "gguf" : "safetensors");
    jw_lit(w, "\",\"family\":");
    jw_str(w, arch, strlen(arch));
    jw_lit(w, ",\"families\":[");
    jw_str(w, arch, strlen(arch));
    jw_lit(w, "],\"parameter_size\":\"\",\"quantization_level\":\"\"}");
}

/* The fields /api/tags and /api/ps share. */
static void write_model_head(struct jw *w, const struct server *s)
{
    jw_lit(w, "{\"name\":");
    write_model_name(w, s);
    jw_lit(w, ",\"model\":");
    write_model_name(w, s);
    jw_fmt(w, ",\"size\":%lld,\"digest\":\"\",", weight_bytes(engine_model_dir(s->eng)));
    write_details(w, s);
}

enum MHD_Result h_ollama_tags(struct req *r, const char *arg)
{
    (void)arg;
    struct jw w;
    jw_dynamic(&w);
    jw_lit(&w, "{\"models\":[");
    write_model_head(&w, r->srv);
    jw_lit(&w, ",\"modified_at\":");
    write_time(&w, &(struct timespec){.tv_sec = r->srv->started});
    jw_lit(&w, "}]}");
    return reply_jw(r, 200, &w);
}

/* /api/ps: the model stays loaded (expires_at is never reached), the
 * device bytes in use, and kvtier's own object: the caller's sessions,
 * each with its KV bytes in the device, host and disk tiers, and the
 * daemon's totals per tier. */
enum MHD_Result h_ollama_ps(struct req *r, const char *arg)
{
    (void)arg;
    struct server *s = r->srv;
    struct engine_stats st = engine_get_stats(s->eng);
    json_t *sessions = engine_session_list(s->eng, r->uid);
    char *list = sessions ? json_dumps(sessions, JSON_COMPACT) : NULL;
    json_decref(sessions);
    if (!list)
        return MHD_NO;
    struct jw w;
    jw_dynamic(&w);
    jw_lit(&w, "{\"models\":[");
    write_model_head(&w, s);
    jw_fmt(&w, ",\"expires_at\":\"9999-12-31T23:59:59Z\",\"size_vram\":%zu,\"context_length\":%d,", st.dev_used,
           engine_context(s->eng));
    jw_fmt(&w, "\"kvtier\":{\"kv_bytes\":{\"device\":%zu,\"host\":%zu,\"disk\":%llu},\"sessions\":", st.kv_dev_bytes,
           st.kv_host_bytes, (unsigned long long)st.disk.used);
    jw_raw(&w, list, strlen(list));
    free(list);
    jw_lit(&w, "}}]}");
    return reply_jw(r, 200, &w);
}

enum MHD_Result h_ollama_show(struct req *r, const char *arg)
{
    (void)arg;
    struct server *s = r->srv;
    struct ipc_limits lim = limits(s);
    const json_t *name = json_object_get(r->root, "model");
    if (!name)
        name = json_object_get(r->root, "name"); /* the older spelling */
    if (!json_is_string(name))
        return fail(r, IPC_EINVAL, "model", "model is required");
    struct ipc_error e;
    if (ipc_check_model(name, &lim, &e) != IPC_OK)
        return reply_error(r, &e);
    const struct model_config *mc = engine_model_config(s->eng);
    const char *arch = mc->arch_name;
    struct jw w;
    jw_dynamic(&w);
    jw_lit(&w, "{\"modelfile\":\"\",\"parameters\":\"\",\"template\":\"\",");
    write_details(&w, s);
    jw_lit(&w, ",\"model_info\":{\"general.architecture\":");
    jw_str(&w, arch, strlen(arch));
    jw_fmt(&w, ",\"%s.context_length\":%d,\"%s.embedding_length\":%d,\"%s.block_count\":%d,\"%s.vocab_size\":%d}",
           arch, mc->max_position_embeddings, arch, mc->hidden_size, arch, mc->n_layers, arch, mc->vocab_size);
    jw_lit(&w, ",\"capabilities\":[\"completion\"],\"modified_at\":");
    write_time(&w, &(struct timespec){.tv_sec = s->started});
    jw_lit(&w, "}");
    return reply_jw(r, 200, &w);
}

/* GET / is the probe Ollama's clients and scripts send to see whether a
 * server is up; Ollama answers it with this text. */
enum MHD_Result h_ollama_root(struct req *r, const char *arg)
{
    (void)arg;
    static const char text[] = "Ollama is running";
    char *body = strdup(text);
    return body ? queue(r, 200, body, sizeof(text) - 1, "text/plain; charset=utf-8") : MHD_NO;
}

enum MHD_Result h_ollama_version(struct req *r, const char *arg)
{
    (void)arg;
    return reply_json(r, 200, json_pack("{s:s}", "version", OLLAMA_API_VERSION));
}
