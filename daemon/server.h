/* server.h - kvtierd's event loop and HTTP front end.
 *
 * One thread runs the event loop (loop.h) over: the listening socket
 * (kvtierd accepts, checks SO_PEERCRED and the client limit, then hands the
 * fd to libmicrohttpd with MHD_add_connection) and the optional TCP one
 * (no peer credentials: each request carries the API key instead), the signal pipe, the
 * engine's eventfd, the workers' eventfd, libmicrohttpd's own epoll fd, and
 * the fds of suspended connections (EPOLLHUP: a client that hangs up
 * while its request waits cancels the generation).  libmicrohttpd runs in
 * "external polling" mode inside this thread, so every MHD call, suspend
 * and resume happens here.
 *
 * A request with a body is suspended while a worker (workers.h) parses its
 * JSON and tokenizes its prompt; the workers' eventfd resumes it.  A
 * request waiting for the engine is suspended too; the engine's eventfd
 * wakes the loop, which resumes the connections that have news.  Streams
 * are chunked responses whose reader formats SSE events straight into the
 * socket buffer and suspends when it has nothing to send.
 */
#ifndef KVTIER_DAEMON_SERVER_H
#define KVTIER_DAEMON_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "daemon/engine.h"

#define SERVER_MAX_N 64 /* choices per request */
/* Connections past --max-clients that may still ask /health and /metrics,
 * so a full daemon can say so; the listen backlog holds them too. */
#define HEALTH_RESERVE 8

struct server_config {
    int max_clients;      /* open connections */
    size_t max_body;      /* request body bytes (413 above) */
    size_t max_output;    /* generated text queued for a slow stream reader */
    int max_n;            /* choices per request, <= SERVER_MAX_N */
    int max_messages;     /* chat messages per request */
    int drain_timeout_s;  /* SIGTERM: how long in-flight requests may finish */
    int idle_timeout_s;   /* idle keep-alive connections are closed */
    int max_per_uid;      /* open connections of one uid, and of TCP's together, below max_clients */
    int max_per_pid;      /* open connections of one process */
    int header_timeout_s; /* a request head must arrive within this of its first byte */
    size_t body_rate;     /* bytes/s a body must average after a header_timeout_s grace */
    int stall_timeout_s;  /* work queued or running and no step completed: /health says "stalled" */
    gid_t allow_gid;      /* (gid_t)-1: only the daemon's uid */
    const char *sock_path;   /* unlinked at exit unless socket-activated */
    bool socket_activated;
    int tcp_fd;              /* --listen's socket, -1: none; its clients act as the daemon's uid */
    const char *api_key;     /* NULL: TCP clients need none (a loopback address only) */
};

enum server_exit { SERVER_OK = 0, SERVER_ELOAD = 3, SERVER_EFATAL = 1 };

/* Serves until SIGTERM/SIGINT (drain, then SERVER_OK) or a model load
 * failure (SERVER_ELOAD).  sig_fd is the read end of a pipe that carries
 * one byte per signal number; wake_fd is the engine's eventfd. */
enum server_exit server_run(engine *e, const struct server_config *cfg, int listen_fd, int sig_fd, int wake_fd);

#endif
