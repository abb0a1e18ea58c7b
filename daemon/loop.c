/* loop.c - the event loop of loop.h over epoll.  Timers are a short
 * unsorted list (the server arms two), scanned for the nearest deadline
 * before each wait. */
#include "daemon/loop.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <unistd.h>

#include "util/clock.h"

struct ev_loop {
    int ep;
    bool stop;
    struct ev_timer *timers;
    void (*before)(void *data);
    void *before_data;
};

int ev_loop_create(ev_loop **out)
{
    ev_loop *l = calloc(1, sizeof(*l));
    if (!l)
        return -ENOMEM;
    l->ep = epoll_create1(EPOLL_CLOEXEC);
    if (l->ep < 0) {
        int rc = -errno;
        free(l);
        return rc;
    }
    *out = l;
    return 0;
}

void ev_loop_free(ev_loop *l)
{
    if (!l)
        return;
    close(l->ep);
    free(l);
}

int ev_io_start(ev_loop *l, struct ev_io *io, int fd, unsigned events, ev_io_fn fn, void *data)
{
    struct epoll_event ev = {.events = (events & EV_READ) ? EPOLLIN : 0, .data.ptr = io};
    if (epoll_ctl(l->ep, EPOLL_CTL_ADD, fd, &ev) != 0)
        return -errno;
    *io = (struct ev_io){.fd = fd, .fn = fn, .data = data, .active = true};
    return 0;
}

void ev_io_stop(ev_loop *l, struct ev_io *io)
{
    if (!io->active)
        return;
    epoll_ctl(l->ep, EPOLL_CTL_DEL, io->fd, NULL);
    io->active = false;
}

void ev_timer_stop(ev_loop *l, struct ev_timer *t)
{
    if (!t->active)
        return;
    struct ev_timer **pp = &l->timers;
    while (*pp != t)
        pp = &(*pp)->next;
    *pp = t->next;
    t->active = false;
}

void ev_timer_start(ev_loop *l, struct ev_timer *t, double ms, ev_timer_fn fn, void *data)
{
    ev_timer_stop(l, t);
    *t = (struct ev_timer){.at = clock_ms() + ms, .fn = fn, .data = data, .active = true, .next = l->timers};
    l->timers = t;
}

void ev_set_before_sleep(ev_loop *l, void (*fn)(void *data), void *data)
{
    l->before = fn;
    l->before_data = data;
}

void ev_stop(ev_loop *l)
{
    l->stop = true;
}

/* Milliseconds until the nearest timer, rounded up so a wait never ends
 * before it is due; -1 without timers. */
static int next_timeout(const ev_loop *l)
{
    if (!l->timers)
        return -1;
    double now = clock_ms(), first = l->timers->at;
    for (const struct ev_timer *t = l->timers->next; t; t = t->next)
        first = t->at < first ? t->at : first;
    double left = ceil(first - now);
    return left <= 0 ? 0 : left > 3600e3 ? 3600 * 1000 : (int)left;
}

/* Fires every due timer; a callback may arm or stop timers, so the scan
 * starts over after each one. */
static void run_timers(ev_loop *l)
{
    double now = clock_ms();
    for (struct ev_timer *t = l->timers; t && !l->stop;) {
        if (t->at > now) {
            t = t->next;
            continue;
        }
        ev_timer_stop(l, t);
        t->fn(t->data);
        t = l->timers;
    }
}

int ev_run(ev_loop *l)
{
    l->stop = false;
    while (!l->stop) {
        if (l->before)
            l->before(l->before_data);
        if (l->stop)
            break;
        struct epoll_event evs[64];
        int n = epoll_wait(l->ep, evs, 64, next_timeout(l));
        if (n < 0 && errno != EINTR)
            return -errno;
        for (int i = 0; i < n && !l->stop; i++) {
            struct ev_io *io = evs[i].data.ptr;
            unsigned e = ((evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) ? EV_READ : 0) |
                         ((evs[i].events & (EPOLLERR | EPOLLHUP)) ? EV_HUP : 0);
            /* an earlier callback of this round may have stopped it */
            if (io->active)
                io->fn(io->data, e);
        }
        run_timers(l);
    }
    return 0;
}
