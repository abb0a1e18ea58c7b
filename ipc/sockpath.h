/* sockpath.h - where kvtierd listens, resolved the same way by the daemon
 * and the client: --socket PATH, else $KVTIER_SOCKET, else
 * /run/kvtier/kvtierd.sock for a system service, else
 * $XDG_RUNTIME_DIR/kvtier/kvtierd.sock.  Abstract sockets are refused. */
#ifndef KVTIER_IPC_SOCKPATH_H
#define KVTIER_IPC_SOCKPATH_H

#include <stdbool.h>
#include <stddef.h>

#include "ipc/status.h"

#define IPC_SYSTEM_SOCKET "/run/kvtier/kvtierd.sock"

/* Writes the path to out (cap bytes).  Errors: IPC_EINVAL when no path can
 * be derived (no XDG_RUNTIME_DIR), the path is empty or abstract ("@..."),
 * or longer than sockaddr_un.sun_path allows. */
enum ipc_status ipc_socket_path(const char *flag, bool system, char *out, size_t cap, struct ipc_error *err);

#endif
