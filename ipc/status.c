#include "ipc/status.h"

#include <stdio.h>
#include <string.h>

static const struct {
    int http;
    const char *type;
    const char *name;
    const char *code; /* OpenAI's string code, NULL: the HTTP status */
} status_table[] = {
    [IPC_OK] = {200, "", "ok"},
    [IPC_EINVAL] = {400, "invalid_request_error", "invalid"},
    [IPC_ECONTEXT] = {400, "exceed_context_size_error", "context"},
    [IPC_EFORBIDDEN] = {403, "permission_error", "forbidden"},
    [IPC_ENOTFOUND] = {404, "not_found_error", "not_found"},
    [IPC_EMETHOD] = {405, "invalid_request_error", "method"},
    [IPC_ECONFLICT] = {409, "conflict_error", "conflict"},
    [IPC_ETOOLARGE] = {413, "invalid_request_error", "too_large"},
    [IPC_EBUSY] = {429, "rate_limit_error", "busy"},
    [IPC_EINTERNAL] = {500, "server_error", "internal"},
    [IPC_ENOTIMPL] = {400, "invalid_request_error", "unsupported"},
    [IPC_EUNAVAIL] = {503, "unavailable_error", "unavailable"},
    [IPC_ENOMEM] = {503, "unavailable_error", "no_memory"},
    [IPC_EPROTO] = {502, "server_error", "protocol"},
    [IPC_EIO] = {503, "unavailable_error", "io"},
    [IPC_ESTORAGE] = {507, "insufficient_storage_error", "kv_memory"},
    [IPC_ENOMODEL] = {404, "invalid_request_error", "model_not_found", "model_not_found"},
    [IPC_EAUTH] = {401, "invalid_request_error", "unauthorized", "invalid_api_key"},
};

static int valid(enum ipc_status st)
{
    return (unsigned)st < sizeof(status_table) / sizeof(status_table[0]);
}

int ipc_http_status(enum ipc_status st)
{
    return valid(st) ? status_table[st].http : 500;
}

const char *ipc_error_type(enum ipc_status st)
{
    return valid(st) ? status_table[st].type : "server_error";
}

const char *ipc_error_code(enum ipc_status st)
{
    return valid(st) ? status_table[st].code : NULL;
}

const char *ipc_status_name(enum ipc_status st)
{
    return valid(st) ? status_table[st].name : "unknown";
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
