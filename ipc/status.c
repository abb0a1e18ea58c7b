#include "ipc/status.h"

#include <stdio.h>
#include <string.h>

static const struct {
    int http;
    const char *type;
    const char *name;
    const char *text;
} status_table[] = {
    [IPC_OK] = {200, "", "ok", "ok"},
    [IPC_EINVAL] = {400, "invalid_request_error", "invalid", "invalid request"},
    [IPC_ECONTEXT] = {400, "exceed_context_size_error", "context", "request exceeds the context size"},
    [IPC_EFORBIDDEN] = {403, "permission_error", "forbidden", "forbidden"},
    [IPC_ENOTFOUND] = {404, "not_found_error", "not_found", "not found"},
    [IPC_EMETHOD] = {405, "invalid_request_error", "method", "method not allowed"},
    [IPC_ECONFLICT] = {409, "conflict_error", "conflict", "resource busy"},
    [IPC_ETOOLARGE] = {413, "invalid_request_error", "too_large", "request too large"},
    [IPC_EBUSY] = {429, "rate_limit_error", "busy", "too many requests"},
    [IPC_EINTERNAL] = {500, "server_error", "internal", "internal error"},
    [IPC_ENOTIMPL] = {501, "not_supported_error", "not_implemented", "not implemented"},
    [IPC_EUNAVAIL] = {503, "unavailable_error", "unavailable", "service unavailable"},
    [IPC_ENOMEM] = {503, "unavailable_error", "no_memory", "out of memory"},
    [IPC_EPROTO] = {502, "server_error", "protocol", "malformed reply from the daemon"},
    [IPC_EIO] = {503, "unavailable_error", "io", "cannot reach the daemon"},
    [IPC_ESTORAGE] = {507, "insufficient_storage_error", "kv_memory", "the KV cache does not fit the memory budgets"},
};

static int valid(enum ipc_status st)
{
    return (unsigned)st < sizeof(status_table) / sizeof(status_table[0]);
}

const char *ipc_strerror(enum ipc_status st)
{
    return valid(st) ? status_table[st].text : "unknown error";
}

int ipc_http_status(enum ipc_status st)
{
    return valid(st) ? status_table[st].http : 500;
}

const char *ipc_error_type(enum ipc_status st)
{
    return valid(st) ? status_table[st].type : "server_error";
}

const char *ipc_status_name(enum ipc_status st)
{
    return valid(st) ? status_table[st].name : "unknown";
}

enum ipc_status ipc_status_from_http(int code)
{
    if (code >= 200 && code < 300)
        return IPC_OK;
    switch (code) {
    case 400: return IPC_EINVAL;
    case 403: return IPC_EFORBIDDEN;
    case 404: return IPC_ENOTFOUND;
    case 405: return IPC_EMETHOD;
    case 409: return IPC_ECONFLICT;
    case 413: return IPC_ETOOLARGE;
    case 429: return IPC_EBUSY;
    case 501: return IPC_ENOTIMPL;
    case 503: return IPC_EUNAVAIL;
    case 507: return IPC_ESTORAGE;
    default: return code >= 400 && code < 500 ? IPC_EINVAL : IPC_EINTERNAL;
    }
}

enum ipc_status ipc_fail(struct ipc_error *e, enum ipc_status st, const char *param, const char *fmt, ...)
{
    e->st = st;
    snprintf(e->param, sizeof(e->param), "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
    va_end(ap);
    return st;
}
