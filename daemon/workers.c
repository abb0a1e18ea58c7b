/* workers.c - the pool of workers.h: one mutex, a FIFO of queued items and
 * a list of finished ones that the loop thread collects on the eventfd. */
#include "daemon/workers.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "util/log.h"

struct workers {
    int fd;
    int n_threads;
    int pending; /* loop thread only */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* ---- under mu ---- */
    bool stopping;
    struct work *queue, **queue_tail;
    struct work *finished;
    pthread_t threads[];
};

static void notify(workers *w)
{
    uint64_t one = 1;
    /* a full counter still reads as readable, so EAGAIN loses nothing */
    if (write(w->fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
        log_msg(LOG_WARN, "workers: wake-up write failed: %s", strerror(errno));
}

static void *worker_main(void *arg)
{
    workers *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->stopping && !w->queue)
            pthread_cond_wait(&w->cv, &w->mu);
        if (w->stopping)
            break;
        struct work *it = w->queue;
        w->queue = it->next;
        if (!w->queue)
            w->queue_tail = &w->queue;
        pthread_mutex_unlock(&w->mu);
        it->run(it->data);
        pthread_mutex_lock(&w->mu);
        it->ran = true;
        it->next = w->finished;
        w->finished = it;
        notify(w);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

int workers_start(int n, workers **out)
{
    workers *w = calloc(1, sizeof(*w) + (size_t)n * sizeof(w->threads[0]));
    if (!w)
        return -ENOMEM;
    w->fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->fd < 0) {
        int rc = -errno;
        free(w);
        return rc;
    }
    w->queue_tail = &w->queue;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    for (; w->n_threads < n; w->n_threads++) {
        int rc = pthread_create(&w->threads[w->n_threads], NULL, worker_main, w);
        if (rc) {
            workers_free(w);
            return -rc;
        }
    }
    *out = w;
    return 0;
}

int workers_fd(const workers *w)
{
    return w->fd;
}

void workers_submit(workers *w, struct work *item)
{
    item->ran = false;
    item->next = NULL;
    w->pending++;
    pthread_mutex_lock(&w->mu);
    *w->queue_tail = item;
    w->queue_tail = &item->next;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void workers_complete(workers *w)
{
    uint64_t v;
    if (read(w->fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
        log_msg(LOG_WARN, "workers: eventfd read: %s", strerror(errno));
    pthread_mutex_lock(&w->mu);
    struct work *it = w->finished;
    w->finished = NULL;
    pthread_mutex_unlock(&w->mu);
    while (it) {
        struct work *next = it->next;
        w->pending--;
        it->done(it->data, it->ran);
        it = next;
    }
}

int workers_pending(const workers *w)
{
    return w->pending;
}

void workers_stop(workers *w)
{
    pthread_mutex_lock(&w->mu);
    bool running = !w->stopping;
    w->stopping = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (!running)
        return;
    for (int i = 0; i < w->n_threads; i++)
        pthread_join(w->threads[i], NULL);
    /* what no thread took is handed back unrun */
    while (w->queue) {
        struct work *it = w->queue;
        w->queue = it->next;
        it->next = w->finished;
        w->finished = it;
    }
    w->queue_tail = &w->queue;
    notify(w);
}

void workers_free(workers *w)
{
    if (!w)
        return;
    workers_stop(w);
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    close(w->fd);
    free(w);
}
