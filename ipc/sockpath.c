#include "ipc/sockpath.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

/* A directory of ours that no one else can write to. */
static bool dir_is_ours(const char *dir)
{
    struct stat st;
    return lstat(dir, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid() && !(st.st_mode & (S_IWGRP | S_IWOTH));
}

enum ipc_status ipc_socket_path(const char *flag, bool system, char *out, size_t cap, struct ipc_error *err)
{
    const char *env = getenv("KVTIER_SOCKET");
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    unsigned uid = (unsigned)geteuid();
    char run_user[64];
    snprintf(run_user, sizeof(run_user), "/run/user/%u", uid);
    int n;
    if (flag || (env && *env)) {
        n = snprintf(out, cap, "%s", flag ? flag : env);
    } else if (system) {
        n = snprintf(out, cap, "%s", IPC_SYSTEM_SOCKET);
    } else if (xdg && *xdg) {
        n = snprintf(out, cap, "%s/kvtier/kvtierd.sock", xdg);
    } else if (dir_is_ours(run_user)) {
        n = snprintf(out, cap, "%s/kvtier/kvtierd.sock", run_user);
    } else if (uid == 0) {
        n = snprintf(out, cap, "%s", IPC_SYSTEM_SOCKET);
    } else {
        char dir[64];
        snprintf(dir, sizeof(dir), "/tmp/kvtier-%u", uid);
        struct stat st;
        if (lstat(dir, &st) == 0 && !dir_is_ours(dir))
            return ipc_fail(err, IPC_EINVAL, "socket",
                            "%s is not a directory of uid %u that only it can write to: give --socket PATH or "
                            "KVTIER_SOCKET", dir, uid);
        n = snprintf(out, cap, "%s/kvtierd.sock", dir);
    }
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
