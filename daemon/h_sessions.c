/* h_sessions.c - the /v1/sessions endpoints: create (its prefix is
 * tokenized by prep_session_create on a worker, then prefilled by the
 * engine), list, get, delete, and crop, fork, past recording and the KV
 * export and import, which run on the engine thread as jobs naming the
 * session. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/http.h"

/* POST /v1/sessions on a worker: the prefix as ids (a system prompt goes
 * through the chat template), checked against the context. */
enum ipc_status prep_session_create(struct req *r)
{
    struct server *s = r->srv;
    struct ipc_limits lim = limits(s);
    struct ipc_session_req q;
    struct ipc_error *err = &r->prep.err;
    struct tok_ids *ids = &r->prep.ids;
    enum ipc_status st = ipc_session_req_parse(r->root, &lim, &q, err);
    /* its first completion's input is encoded into it, the decoder's cache
     * grows over that: nothing to start it with */
    if (st == IPC_OK && engine_encdec(s->eng) && (q.system || q.prefix || q.ids || q.record))
        st = ipc_fail(err, IPC_EINVAL, q.record ? "activate_past_recording" : q.field,
                      "an encoder-decoder model's session starts empty%s", q.record ? " and does not record" : "");
    if (st == IPC_OK && engine_encdec(s->eng))
        st = encdec_cache_check(&q.cache.params, err);
    if (st == IPC_OK && q.system) {
        json_t *m = json_pack("[{s:s,s:s%}]", "role", "system", "content", q.system, q.system_len);
        st = m ? render(s, m, NULL, NULL, NULL, IPC_CHAT_CLOSED, ids, err)
               : ipc_fail(err, IPC_ENOMEM, "system", "no memory");
        json_decref(m);
    } else if (st == IPC_OK && q.prefix) {
        st = encode(s, q.prefix, q.prefix_len, true, "prefix", ids, err);
    } else if (st == IPC_OK && q.ids) {
        ids->ids = q.ids;
        ids->n = q.n_ids;
        q.ids = NULL;
    }
    if (st == IPC_OK && ids->n >= (size_t)engine_context(s->eng))
        st = ipc_fail(err, IPC_ECONTEXT, q.field, "%s has %zu tokens; a session's start must be shorter than the context (%d)",
                      q.field, ids->n, engine_context(s->eng));
    else if (st == IPC_OK && (int64_t)ids->n > engine_static_limit(s->eng, &q.cache.params))
        st = ipc_fail(err, IPC_EINVAL, "cache.max_cache_len", "cache.max_cache_len (%lld) cannot hold the %s (%zu "
                      "tokens)", (long long)q.cache.params.max_cache_len, q.field, ids->n);
    r->prep.cache = q.cache;
    r->prep.record = q.record;
    /* a system prompt is what prefix-only shares; a raw prefix is not */
    bool remote;
    enum engine_remote_share share = engine_remote_share(s->eng, &remote);
    r->prep.remote_shareable =
        remote && !q.private_kv && (share == REMOTE_SHARE_ALL || (share == REMOTE_SHARE_PREFIX_ONLY && q.system))
            ? SIZE_MAX
            : 0;
    if (st == IPC_OK && !(r->prep.request = json_pack("{s:O?, s:O?, s:b}", "cache", json_object_get(r->root, "cache"),
                                                      "use_cache", json_object_get(r->root, "use_cache"), "private",
                                                      q.private_kv)))
        st = ipc_fail(err, IPC_ENOMEM, "", "no memory for the request");
    ipc_session_req_release(&q);
    return st;
}

/* Submits j, which fills the new session id; the reply waits for it.  A
 * refused submission deletes the session, which nobody was handed yet. */
static enum MHD_Result submit_filling(struct req *r, struct job *j, const char *id, enum reply_kind kind)
{
    struct server *s = r->srv;
    snprintf(j->session_id, sizeof(j->session_id), "%s", id);
    r->kind = kind;
    struct ipc_error serr, derr;
    if (engine_submit(s->eng, j, &serr) != IPC_OK) {
        job_release(s->eng, j);
        engine_session_delete(s->eng, r->uid, id, &derr);
        return reply_error(r, &serr);
    }
    track(r, j);
    suspend(r);
    return MHD_YES;
}

/* Registers the session; a prefix is prefilled by a JOB_PREFILL job before
 * the reply. */
enum MHD_Result h_session_create(struct req *r, const char *arg)
{
    (void)arg;
    struct server *s = r->srv;
    struct ipc_error err;
    struct tok_ids ids = r->prep.ids;
    char id[IPC_SESSION_ID_MAX + 1];
    r->prep.ids = (struct tok_ids){0};
    enum ipc_status st = engine_session_create(s->eng, r->uid, &r->prep.cache, r->prep.record, r->prep.request, id,
                                               sizeof(id), &err);
    struct job *j = NULL;
    if (st == IPC_OK && ids.n && !(j = job_new(1, NULL, 0))) {
        st = ipc_fail(&err, IPC_ENOMEM, "", "no memory for the request");
        engine_session_delete(s->eng, r->uid, id, &err);
    }
    if (st != IPC_OK) {
        free(ids.ids);
        return reply_error(r, &err);
    }
    if (!j) {
        json_t *o;
        if (engine_session_json(s->eng, r->uid, id, &o, &err) != IPC_OK)
            return reply_error(r, &err);
        return reply_json(r, 200, o);
    }
    j->kind = JOB_PREFILL;
    j->uid = r->uid;
    j->prompt = ids.ids;
    j->n_prompt = ids.n;
    j->remote_shareable = r->prep.remote_shareable;
    sampler_params_default(&j->sampling);
    return submit_filling(r, j, id, REPLY_SESSION);
}

enum MHD_Result h_session_list(struct req *r, const char *arg)
{
    (void)arg;
    json_t *arr = engine_session_list(r->srv->eng, r->uid);
    return reply_json(r, 200, arr ? json_pack("{s:s,s:o}", "object", "list", "data", arr) : NULL);
}

enum MHD_Result h_request_list(struct req *r, const char *arg)
{
    (void)arg;
    json_t *arr = engine_request_list(r->srv->eng, r->uid);
    return reply_json(r, 200, arr ? json_pack("{s:s,s:o}", "object", "list", "data", arr) : NULL);
}

enum MHD_Result h_session_get(struct req *r, const char *id)
{
    json_t *o;
    struct ipc_error err;
    if (engine_session_json(r->srv->eng, r->uid, id, &o, &err) != IPC_OK)
        return reply_error(r, &err);
    return reply_json(r, 200, o);
}

/* Crop, fork and past recording run on the engine thread as jobs naming
 * the session (404, 403 and 409 busy come from engine_submit). */
static enum MHD_Result session_op(struct req *r, const char *id, enum job_kind kind, int64_t n)
{
    struct job *j = job_new(1, NULL, 0);
    if (!j)
        return fail(r, IPC_ENOMEM, "", "no memory for the request");
    j->kind = kind;
    j->uid = r->uid;
    j->op_n = n;
    snprintf(j->session_id, sizeof(j->session_id), "%s", id);
    r->kind = REPLY_SESSION_OP;
    return req_submit(r, j);
}

enum MHD_Result h_session_crop(struct req *r, const char *id)
{
    int64_t n;
    struct ipc_error err;
    if (ipc_crop_req_parse(r->root, &n, &err) != IPC_OK)
        return reply_error(r, &err);
    return session_op(r, id, JOB_CROP, n);
}

enum MHD_Result h_session_fork(struct req *r, const char *id)
{
    if (json_object_size(r->root))
        return fail(r, IPC_EINVAL, json_object_iter_key(json_object_iter(r->root)), "fork takes no fields");
    return session_op(r, id, JOB_FORK, 0);
}

enum MHD_Result h_session_record(struct req *r, const char *id)
{
    if (json_object_size(r->root))
        return fail(r, IPC_EINVAL, json_object_iter_key(json_object_iter(r->root)),
                    "activate_past_recording takes no fields");
    return session_op(r, id, JOB_RECORD, 0);
}

/* GET /v1/sessions/{id}/kv: the session's KV as safetensors, built on the
 * engine thread (?raw=1: the stored form). */
enum MHD_Result h_session_export(struct req *r, const char *id)
{
    const char *raw = MHD_lookup_connection_value(r->conn, MHD_GET_ARGUMENT_KIND, "raw");
    if (raw && strcmp(raw, "0") && strcmp(raw, "1"))
        return fail(r, IPC_EINVAL, "raw", "raw must be 0 or 1");
    struct job *j = job_new(1, NULL, 0);
    if (!j)
        return fail(r, IPC_ENOMEM, "", "no memory for the request");
    j->kind = JOB_EXPORT;
    j->uid = r->uid;
    j->raw = raw && !strcmp(raw, "1");
    snprintf(j->session_id, sizeof(j->session_id), "%s", id);
    r->kind = REPLY_KV;
    return req_submit(r, j);
}

/* POST /v1/sessions/import on a worker: the whole file checked against the
 * model before anything is allocated for its KV. */
enum ipc_status prep_session_import(struct req *r)
{
    return engine_kv_parse(r->srv->eng, r->body ? r->body : "", r->n_body, &r->prep.kvf, &r->prep.err);
}

/* A new session of the caller's (dynamic, or a raw file's quantized cache),
 * filled by a JOB_IMPORT job from the checked file (which the job takes
 * with the body it points into). */
enum MHD_Result h_session_import(struct req *r, const char *arg)
{
    (void)arg;
    struct server *s = r->srv;
    struct ipc_error err;
    struct ipc_cache_choice cache;
    struct ipc_cache_model cm = {.max_len = engine_context(s->eng),
                                 .sliding_window = engine_model_config(s->eng)->sliding_window,
                                 .no_sink = model_sink_refusal(engine_model_config(s->eng))};
    char id[IPC_SESSION_ID_MAX + 1];
    /* a raw file's session is of the cache it was exported from */
    enum ipc_status cs = r->prep.kvf.quantization
                             ? engine_kv_cache(s->eng, r->prep.kvf.quantization, &cache, &err)
                             : ipc_cache_parse(NULL, NULL, &cm, &cache, &err);
    if (cs != IPC_OK ||
        engine_session_create(s->eng, r->uid, &cache, false, NULL, id, sizeof(id), &err) != IPC_OK)
        return reply_error(r, &err);
    struct job *j = job_new(1, NULL, 0);
    if (!j) {
        engine_session_delete(s->eng, r->uid, id, &err);
        return fail(r, IPC_ENOMEM, "", "no memory for the request");
    }
    j->kind = JOB_IMPORT;
    j->uid = r->uid;
    j->kvf = r->prep.kvf;
    r->prep.kvf = (struct kvfile){0};
    j->blob = r->body;
    r->body = NULL;
    r->n_body = r->cap_body = 0;
    return submit_filling(r, j, id, REPLY_SESSION_IMPORT);
}

enum MHD_Result h_session_delete(struct req *r, const char *id)
{
    struct ipc_error err;
    if (engine_session_delete(r->srv->eng, r->uid, id, &err) != IPC_OK)
        return reply_error(r, &err);
    return reply_json(r, 200, json_pack("{s:s,s:s,s:b}", "id", id, "object", "session", "deleted", 1));
}

