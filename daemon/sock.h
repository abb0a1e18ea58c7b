/* sock.h - the listening socket (bound by kvtierd or passed by systemd),
 * peer credentials, and the sd_notify protocol.  The two systemd protocols
 * are written here instead of linking libsystemd, which on Debian 12 would
 * load liblzma, libgcrypt and three more libraries into the daemon for two
 * small, stable protocols (docs/operations.md, "Why kvtierd speaks
 * sd_notify itself"). */
#ifndef KVTIER_DAEMON_SOCK_H
#define KVTIER_DAEMON_SOCK_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/* Binds path (0600, or 0660 with group gid when gid != (gid_t)-1) and
 * listens.  The parent directory is created 0700 (0750 with a group) when
 * missing and must not be writable by others.  A stale socket is replaced
 * only after a connect() is refused; a live one is an error.  Returns the
 * non-blocking fd, or -1 with err filled. */
int sock_listen(const char *path, gid_t gid, int backlog, char *err, size_t cap);

/* Binds and listens on TCP HOST:PORT ("[v6]:PORT"; a bare PORT or ":PORT"
 * is 127.0.0.1).  *loopback: whether the address bound is a loopback one,
 * which only local processes reach.  Returns the non-blocking fd, or -1
 * with err filled. */
int sock_listen_tcp(const char *hostport, int backlog, bool *loopback, char *err, size_t cap);

/* Reads the API key from path: its first line, which must not be empty;
 * 0, or -1 with err filled.  A key file others may read is refused. */
int sock_read_key(const char *path, char *key, size_t cap, char *err, size_t errcap);

/* Whether the Authorization header value is "Bearer KEY" with the key,
 * in time that depends on the key's length only. */
bool sock_bearer_ok(const char *header, const char *key);

/* The socket systemd passed (LISTEN_PID/LISTEN_FDS), or -1 when none;
 * -2 with err filled when the passed fd is not a Unix stream socket. */
int sock_activated(char *err, size_t cap);

/* SO_PEERCRED allow rule: the daemon's uid, or a member of gid (primary or
 * supplementary) when gid != (gid_t)-1. */
bool sock_peer_allowed(uid_t uid, gid_t peer_gid, gid_t allow_gid);

/* Sends msg ("READY=1", ...) to $NOTIFY_SOCKET; a no-op without it. */
void sd_notify_msg(const char *msg);

#endif
