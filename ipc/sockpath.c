#include "ipc/sockpath.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>

enum ipc_status ipc_socket_path(const char *flag, bool system, char *out, size_t cap, struct ipc_error *err)
{
    const char *env = getenv("KVTIER_SOCKET");
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    int n;
    if (flag || (env && *env))
        n = snprintf(out, cap, "%s", flag ? flag : env);
    else if (system)
        n = snprintf(out, cap, "%s", IPC_SYSTEM_SOCKET);
    else if (xdg && *xdg)
        n = snprintf(out, cap, "%s/kvtier/kvtierd.sock", xdg);
    else
        return ipc_fail(err, IPC_EINVAL, "socket", "XDG_RUNTIME_DIR is not set: give --socket PATH or KVTIER_SOCKET");
    if (n <= 0)
        return ipc_fail(err, IPC_EINVAL, "socket", "the socket path is empty");
    if (out[0] == '@' || out[0] == '\0')
        return ipc_fail(err, IPC_EINVAL, "socket", "abstract sockets are not supported (no filesystem permissions)");
    size_t max = sizeof(((struct sockaddr_un *)0)->sun_path) - 1;
    if ((size_t)n > max || (size_t)n >= cap)
        return ipc_fail(err, IPC_EINVAL, "socket", "socket path is %d bytes; a Unix socket path holds at most %zu", n,
                        max);
    return IPC_OK;
}
