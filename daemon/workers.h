/* workers.h - a small pool of threads for the request work that grows
 * with the body: JSON parsing, chat templates, tokenizing.  Done on the
 * event loop thread, a 4 MiB prompt held every other client's stream for
 * the half second it takes to tokenize; on a worker, the loop only moves
 * bytes.  Finished work comes back to the loop thread through an eventfd
 * (workers_fd), where its done callback resumes the connection.
 */
#ifndef KVTIER_DAEMON_WORKERS_H
#define KVTIER_DAEMON_WORKERS_H

#include <stdbool.h>

struct work {
    void (*run)(void *data);            /* on a worker thread */
    void (*done)(void *data, bool ran); /* on the loop thread; ran is false after workers_stop */
    void *data;
    /* ---- the pool's ---- */
    bool ran;
    struct work *next;
};

typedef struct workers workers;

/* n threads; 0 or -errno. */
int workers_start(int n, workers **out);
/* Readable while finished work waits for workers_complete. */
int workers_fd(const workers *w);
/* Queues w (loop thread); its done callback runs later, exactly once. */
void workers_submit(workers *w, struct work *item);
/* Runs the done callback of every finished item (loop thread). */
void workers_complete(workers *w);
/* Items submitted whose done callback has not run yet. */
int workers_pending(const workers *w);
/* Joins the threads after the items they are running; the ones not
 * started are finished with ran == false by the next workers_complete. */
void workers_stop(workers *w);
/* Stops the threads if still running; accepts NULL. */
void workers_free(workers *w);

#endif
