/* sockpath.h - where kvtierd listens, resolved by one rule that the daemon,
 * the kvtier CLI and `make run` (through `kvtierd --print-socket`) share:
 *
 *   1. --socket PATH, else $KVTIER_SOCKET;
 *   2. with --system (kvtier: $KVTIER_SYSTEM): /run/kvtier/kvtierd.sock;
 *   3. $XDG_RUNTIME_DIR/kvtier/kvtierd.sock;
 *   4. /run/user/UID/kvtier/kvtierd.sock when /run/user/UID is a directory
 *      of ours (a login session without the variable: su, cron, ssh);
 *   5. root: /run/kvtier/kvtierd.sock;
 *   6. /tmp/kvtier-UID/kvtierd.sock.
 *
 * /tmp is writable by everyone, so in case 6 a directory that exists must
 * be ours and writable by no one else: otherwise another user could have
 * made it and would receive our prompts.  Abstract sockets are refused. */
#ifndef KVTIER_IPC_SOCKPATH_H
#define KVTIER_IPC_SOCKPATH_H

#include <stdbool.h>
#include <stddef.h>

#include "ipc/status.h"

#define IPC_SYSTEM_SOCKET "/run/kvtier/kvtierd.sock"

/* Writes the path to out (cap bytes).  Errors: IPC_EINVAL when the path is
 * empty or abstract ("@..."), longer than sockaddr_un.sun_path allows, or
 * the /tmp fallback's directory belongs to someone else or is writable by
 * others. */
enum ipc_status ipc_socket_path(const char *flag, bool system, char *out, size_t cap, struct ipc_error *err);

#endif
