/* status.h - the protocol layer's errors: one enum shared by kvtierd and the
 * kvtier client, mapped to an HTTP status and an OpenAI error "type" only at
 * the edge.  An ipc_error carries the request field at fault (param) and a
 * message that names it, so every 4xx tells the client what to fix.
 */
#ifndef KVTIER_IPC_STATUS_H
#define KVTIER_IPC_STATUS_H

#include <stdarg.h>

enum ipc_status {
    IPC_OK = 0,
    IPC_EINVAL = 1,     /* 400: malformed or invalid request */
    IPC_ECONTEXT = 2,   /* 400: prompt + max_tokens exceed the context */
    IPC_EFORBIDDEN = 3, /* 403: peer uid not allowed, or someone else's session */
    IPC_ENOTFOUND = 4,  /* 404: no such endpoint or session */
    IPC_EMETHOD = 5,    /* 405 */
    IPC_ECONFLICT = 6,  /* 409: the session is busy with another request */
    IPC_ETOOLARGE = 7,  /* 413: body over the configured limit */
    IPC_EBUSY = 8,      /* 429: queue or session table full */
    IPC_EINTERNAL = 9,  /* 500: a bug or a backend failure */
    IPC_ENOTIMPL = 10,  /* 400: a feature kvtier does not implement (the param names it); never
                         * 5xx, which clients retry as if the server might change its mind */
    IPC_EUNAVAIL = 11,  /* 503: loading, draining, out of KV memory, too many clients */
    IPC_ENOMEM = 12,    /* 503: host memory ran out for this request */
    IPC_EPROTO = 13,    /* client side: the daemon's reply could not be understood */
    IPC_EIO = 14,       /* client side: cannot reach the socket */
    IPC_ESTORAGE = 15,  /* 507: the KV fits neither tier's budget (the message names it) */
    IPC_ENOMODEL = 16,  /* 404: the request names a model this daemon does not serve */
    IPC_EAUTH = 17,     /* 401: a TCP client without the right API key */
};
#define IPC_N_STATUS (IPC_EAUTH + 1)
int ipc_http_status(enum ipc_status st);
/* The OpenAI envelope's error.type for st ("invalid_request_error", ...). */
const char *ipc_error_type(enum ipc_status st);
/* OpenAI's string error.code for st ("model_not_found", ...), NULL where
 * the envelope's code is the HTTP status. */
const char *ipc_error_code(enum ipc_status st);
/* A short stable name for metrics labels ("invalid", "busy", ...). */
const char *ipc_status_name(enum ipc_status st);

#define IPC_PARAM_LEN 64
#define IPC_MSG_LEN 320

struct ipc_error {
    enum ipc_status st;
    char param[IPC_PARAM_LEN]; /* the request field at fault, "" when none */
    char msg[IPC_MSG_LEN];
};

/* Sets *e and returns st, so callers can `return ipc_fail(e, ...)`. */
enum ipc_status ipc_fail(struct ipc_error *e, enum ipc_status st, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
