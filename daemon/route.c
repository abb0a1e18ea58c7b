/* route.c - the route table and dispatch.  A route names what must hold
 * before its handler runs (the model loaded, a JSON object body) and, for
 * requests with a body, the prepare step that decodes it: the body's JSON
 * and a route's prepare (chat templates, tokenizing) grow with the body, so
 * they run on a worker (req_offload) and the handler continues on the loop
 * thread when the worker is done (route_resume). */
#include <string.h>

#include "daemon/http.h"

enum route_needs {
    NEEDS_NOTHING = 0,
    NEEDS_MODEL = 1,              /* 503 until the model is loaded */
    NEEDS_BODY = 2 | NEEDS_MODEL, /* a JSON object body, parsed into r->root on a worker */
    NEEDS_ANY_BODY = 4 | NEEDS_BODY, /* ... or an empty one */
    NEEDS_RAW_BODY = 8 | NEEDS_MODEL, /* the body as bytes, for the prepare step */
};

struct route {
    const char *method;
    const char *path; /* a '*' matches one path segment (a session id): the handler's arg */
    prepare_fn prepare; /* on a worker after the body is parsed (NEEDS_BODY only); NULL: none */
    handler_fn fn;
    enum route_needs needs; /* checked before the handler runs: model loaded, JSON object body (or none) */
};

/* HEAD, which monitors probe with, where the GET is cheap: libmicrohttpd
 * leaves the body out.  Not on the GETs that run work (a session's export). */
static const struct route routes[] = {
    {"GET", "/health", NULL, h_health, NEEDS_NOTHING},
    {"HEAD", "/health", NULL, h_health, NEEDS_NOTHING},
    {"GET", "/v1/health", NULL, h_health, NEEDS_NOTHING},
    {"HEAD", "/v1/health", NULL, h_health, NEEDS_NOTHING},
    {"GET", "/v1/models", NULL, h_models, NEEDS_MODEL},
    {"HEAD", "/v1/models", NULL, h_models, NEEDS_MODEL},
    {"GET", "/v1/models/*", NULL, h_model, NEEDS_MODEL},
    {"GET", "/metrics", NULL, h_metrics, NEEDS_NOTHING},
    {"HEAD", "/metrics", NULL, h_metrics, NEEDS_NOTHING},
    {"POST", "/v1/completions", prep_completions, h_generate, NEEDS_BODY},
    {"POST", "/v1/chat/completions", prep_chat, h_generate, NEEDS_BODY},
    {"POST", "/tokenize", prep_tokenize, h_prepared, NEEDS_BODY},
    {"POST", "/detokenize", prep_detokenize, h_prepared, NEEDS_BODY},
    {"POST", "/apply-template", prep_apply_template, h_prepared, NEEDS_BODY},
    {"POST", "/v1/sessions", prep_session_create, h_session_create, NEEDS_ANY_BODY},
    {"POST", "/v1/sessions/import", prep_session_import, h_session_import, NEEDS_RAW_BODY},
    {"GET", "/v1/sessions", NULL, h_session_list, NEEDS_NOTHING},
    {"GET", "/v1/sessions/*", NULL, h_session_get, NEEDS_NOTHING},
    {"DELETE", "/v1/sessions/*", NULL, h_session_delete, NEEDS_NOTHING},
    {"GET", "/v1/sessions/*/kv", NULL, h_session_export, NEEDS_MODEL},
    {"POST", "/v1/sessions/*/crop", NULL, h_session_crop, NEEDS_BODY},
    {"POST", "/v1/sessions/*/fork", NULL, h_session_fork, NEEDS_ANY_BODY},
    {"POST", "/v1/sessions/*/activate_past_recording", NULL, h_session_record, NEEDS_ANY_BODY},
    {"POST", "/api/generate", prep_ollama_generate, h_ollama_generate, NEEDS_BODY},
    {"POST", "/api/chat", prep_ollama_chat, h_ollama_generate, NEEDS_BODY},
    {"GET", "/", NULL, h_ollama_root, NEEDS_NOTHING},
    {"HEAD", "/", NULL, h_ollama_root, NEEDS_NOTHING},
    {"GET", "/api/tags", NULL, h_ollama_tags, NEEDS_MODEL},
    {"HEAD", "/api/tags", NULL, h_ollama_tags, NEEDS_MODEL},
    {"GET", "/api/ps", NULL, h_ollama_ps, NEEDS_MODEL},
    {"POST", "/api/show", NULL, h_ollama_show, NEEDS_BODY},
    {"GET", "/api/version", NULL, h_ollama_version, NEEDS_NOTHING},
    {"HEAD", "/api/version", NULL, h_ollama_version, NEEDS_NOTHING},
    {"GET", "/v1/requests", NULL, h_request_list, NEEDS_NOTHING},
};

/* Whether url matches pattern; a '*' matches one non-empty segment of at
 * most IPC_SESSION_ID_MAX bytes, copied into seg. */
static bool path_match(const char *pattern, const char *url, char *seg)
{
    const char *star = strchr(pattern, '*');
    if (!star)
        return !strcmp(url, pattern);
    size_t pre = (size_t)(star - pattern);
    if (strncmp(url, pattern, pre) != 0)
        return false;
    const char *a = url + pre, *b = strchrnul(a, '/');
    size_t len = (size_t)(b - a);
    if (!len || len > IPC_SESSION_ID_MAX || strcmp(b, star + 1) != 0)
        return false;
    memcpy(seg, a, len);
    seg[len] = '\0';
    return true;
}

/* The route for method+url; *path_ok tells a wrong method (405) from an
 * unknown path (404). */
static const struct route *route_find(const char *method, const char *url, bool *path_ok, char *seg)
{
    *path_ok = false;
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++) {
        const struct route *rt = &routes[i];
        if (!path_match(rt->path, url, seg))
            continue;
        *path_ok = true;
        if (!strcmp(method, rt->method))
            return rt;
    }
    return NULL;
}

static enum MHD_Result need_ready(struct req *r, bool *ok)
{
    char msg[256];
    enum engine_state st = engine_state(r->srv->eng, msg, sizeof(msg));
    /* ready once the loop has seen it too: it sizes s->piece then */
    *ok = st == ENGINE_READY && r->srv->ready;
    if (*ok)
        return MHD_YES;
    return fail(r, IPC_EUNAVAIL, "", st != ENGINE_FAILED ? "the model is loading" : "the model failed to load");
}

enum MHD_Result dispatch(struct req *r, const char *method)
{
    bool path_ok;
    const struct route *rt = route_find(method, r->url, &path_ok, r->arg);
    if (!rt) {
        struct ipc_error e;
        ipc_fail(&e, path_ok ? IPC_EMETHOD : IPC_ENOTFOUND, "", path_ok ? "method %.16s is not allowed on %.128s"
                                                                        : "no endpoint %.16s %.128s", method, r->url);
        return reply_error(r, &e);
    }
    if (rt->needs & NEEDS_MODEL) {
        bool ok;
        enum MHD_Result res = need_ready(r, &ok);
        if (!ok)
            return res;
    }
    r->route = rt;
    if ((rt->needs & NEEDS_BODY) == NEEDS_BODY || (rt->needs & NEEDS_RAW_BODY) == NEEDS_RAW_BODY)
        return req_offload(r);
    return rt->fn(r, r->arg);
}

static enum ipc_status parse_body(struct req *r, bool empty_ok, struct ipc_error *err)
{
    if (!r->n_body && empty_ok)
        return IPC_OK;
    json_error_t je;
    r->root = json_loadb(r->body ? r->body : "", r->n_body, JSON_REJECT_DUPLICATES, &je);
    /* jansson names its flag for a NUL: the client is told what to change
     * (strings here are C strings, which end at a NUL) */
    if (!r->root && json_error_code(&je) == json_error_null_character)
        return ipc_fail(err, IPC_EINVAL, "", "invalid JSON body at line %d column %d: a string holds \\u0000 (NUL), "
                        "which kvtierd does not accept", je.line, je.column);
    if (!r->root)
        return ipc_fail(err, IPC_EINVAL, "", "invalid JSON body at line %d column %d: %s", je.line, je.column,
                        je.text);
    if (!json_is_object(r->root))
        return ipc_fail(err, IPC_EINVAL, "", "the request body must be a JSON object");
    return IPC_OK;
}

void route_prepare(struct req *r)
{
    const struct route *rt = r->route;
    if ((rt->needs & NEEDS_RAW_BODY) == NEEDS_RAW_BODY)
        rt->prepare(r);
    else if (parse_body(r, rt->needs == NEEDS_ANY_BODY, &r->prep.err) == IPC_OK && rt->prepare)
        rt->prepare(r);
}

enum MHD_Result route_resume(struct req *r)
{
    if (r->prep.err.st != IPC_OK)
        return reply_error(r, &r->prep.err);
    return r->route->fn(r, r->arg);
}
