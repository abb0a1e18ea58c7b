/* httpc.h - the client side of kvtierd's protocol: one HTTP/1.1 request per
 * connection over the Unix socket, replies with Content-Length, chunked or
 * close-delimited bodies, and Server-Sent Events delivered one data payload
 * at a time.  Every size read from the daemon is bounded, so a confused or
 * hostile peer cannot make the client allocate without limit.
 */
#ifndef KVTIER_IPC_HTTPC_H
#define KVTIER_IPC_HTTPC_H

#include <stdbool.h>
#include <stddef.h>

#include "ipc/status.h"

#define IPC_MAX_REPLY (64u << 20) /* bytes of one reply body or SSE event */

/* Called with each SSE "data:" payload (NUL-terminated); return false to
 * stop reading (the connection is closed, which cancels the generation). */
typedef bool (*ipc_event_fn)(void *ud, const char *data, size_t len);

struct ipc_reply {
    int status; /* HTTP status */
    char *body; /* malloc'd, NUL-terminated; empty for an SSE stream */
    size_t len;
};

/* Sends method path with body (may be NULL) to the socket at sock_path.
 * With on_event, an event-stream reply is delivered through it.  Errors:
 * IPC_EIO (cannot connect or the connection broke), IPC_EPROTO (not HTTP,
 * or over IPC_MAX_REPLY), IPC_ENOMEM.  A non-2xx status is not an error
 * here: reply->status says it. */
enum ipc_status ipc_call(const char *sock_path, const char *method, const char *path, const char *body, size_t len,
                         ipc_event_fn on_event, void *ud, struct ipc_reply *reply, struct ipc_error *err);
/* The reply half of ipc_call: reads one reply from fd until it ends (the
 * connection closes after it), with the same bounds and errors. */
enum ipc_status ipc_read_reply(int fd, ipc_event_fn on_event, void *ud, struct ipc_reply *reply,
                               struct ipc_error *err);
void ipc_reply_free(struct ipc_reply *r); /* accepts a zeroed reply */

#endif
