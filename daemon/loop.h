/* loop.h - a small epoll event loop in the manner of Redis's ae: fd
 * events, timers and a hook that runs before every wait.  It knows
 * nothing of HTTP; the server registers its fds (listening socket, signal
 * pipe, engine and worker eventfds, libmicrohttpd's epoll fd, suspended
 * connections) and its deadlines (libmicrohttpd's timeout, the drain).
 *
 * Registrations are structs the owner embeds, so watching an fd or arming
 * a timer never allocates and cannot fail for want of memory.  One thread
 * runs the loop; nothing here is thread-safe.
 */
#ifndef KVTIER_DAEMON_LOOP_H
#define KVTIER_DAEMON_LOOP_H

#include <stdbool.h>

typedef struct ev_loop ev_loop;

/* Event bits: readable (or hung up), and hung up: the peer closed its
 * whole socket (EPOLLHUP, EPOLLERR), which epoll always reports.  A peer
 * that only shut down its writing side (shutdown(SHUT_WR)) is not hung up:
 * on a Unix socket it can still read the reply. */
enum { EV_READ = 1, EV_HUP = 2 };

typedef void (*ev_io_fn)(void *data, unsigned events);
typedef void (*ev_timer_fn)(void *data);

struct ev_io {
    int fd;
    ev_io_fn fn;
    void *data;
    bool active;
};

struct ev_timer {
    double at; /* clock_ms() deadline */
    ev_timer_fn fn;
    void *data;
    bool active;
    struct ev_timer *next;
};

/* 0, or -errno when epoll cannot be created. */
int ev_loop_create(ev_loop **out);
/* Accepts NULL. */
void ev_loop_free(ev_loop *l);

/* Watches fd for events (EV_ bits) until ev_io_stop; 0 or -errno. */
int ev_io_start(ev_loop *l, struct ev_io *io, int fd, unsigned events, ev_io_fn fn, void *data);
/* A no-op when io is not active.  A callback may stop another io of the
 * same round; its memory must then live until the round ends. */
void ev_io_stop(ev_loop *l, struct ev_io *io);

/* Calls fn(data) once, ms milliseconds from now; re-arms an active timer. */
void ev_timer_start(ev_loop *l, struct ev_timer *t, double ms, ev_timer_fn fn, void *data);
void ev_timer_stop(ev_loop *l, struct ev_timer *t);

/* fn(data) runs before each wait, after the previous round's events. */
void ev_set_before_sleep(ev_loop *l, void (*fn)(void *data), void *data);

/* Runs until ev_stop: 0, or -errno when epoll_wait fails. */
int ev_run(ev_loop *l);
/* The loop returns once the current round ends (safe from callbacks). */
void ev_stop(ev_loop *l);

#endif
