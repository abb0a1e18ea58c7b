/* pool.c - a persistent fork/join pool for the CPU kernels.
 *
 * Decode runs about ten kernels per layer per token, each a few
 * microseconds of work, so starting a job must cost far less than a
 * thread creation or even a condvar round trip.  Workers spin on a job
 * generation counter for a short while after each job and only then
 * sleep on a futex; the caller wakes sleepers only when there are any.
 * The caller takes part as thread 0 and waits for the rest the same way.
 */
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "backend/cpu/cpu.h"

/* Spin iterations before sleeping: about 20-50 us, longer than the gap
 * between two kernels of one decode step, shorter than a scheduler tick. */
#define SPIN_LIMIT 4000

struct cpu_worker {
    struct cpu_pool *pool;
    int ith;
    pthread_t th;
};

struct cpu_pool {
    int n;                     /* threads including the caller */
    struct cpu_worker *workers; /* [n - 1] */
    cpu_job_fn *fn;            /* current job, published by gen */
    void *arg;
    _Atomic uint32_t gen;      /* bumped once per job (futex word) */
    _Atomic uint32_t pending;  /* workers still in the current job (futex word) */
    _Atomic int sleepers;      /* workers asleep or about to sleep on gen */
    _Atomic int caller_asleep; /* the caller sleeps or is about to sleep on pending */
    _Atomic bool stop;
};

static void futex_wait(_Atomic uint32_t *word, uint32_t val)
{
    /* EAGAIN (word changed) and EINTR both mean "look again" */
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Waits until *word != val: spin first, then sleep announced via *sleeping
 * so that the writer knows to wake us. */
static uint32_t wait_change(_Atomic uint32_t *word, uint32_t val, _Atomic int *sleeping)
{
    uint32_t cur;
    for (int spin = 0; (cur = atomic_load_explicit(word, memory_order_acquire)) == val; spin++) {
        if (spin < SPIN_LIMIT) {
            cpu_relax();
            continue;
        }
        atomic_fetch_add(sleeping, 1);
        futex_wait(word, val);
        atomic_fetch_sub(sleeping, 1);
    }
    return cur;
}

static void *worker_main(void *p_)
{
    struct cpu_worker *w = p_;
    struct cpu_pool *p = w->pool;
    uint32_t seen = 0;
    for (;;) {
        seen = wait_change(&p->gen, seen, &p->sleepers);
        if (atomic_load(&p->stop))
            return NULL;
        p->fn(p->arg, w->ith, p->n);
        if (atomic_fetch_sub(&p->pending, 1) == 1 && atomic_load(&p->caller_asleep))
            futex_wake(&p->pending);
    }
}

/* Publishes a new generation and wakes the workers that went to sleep. */
static void kick(struct cpu_pool *p)
{
    atomic_fetch_add(&p->gen, 1);
    if (atomic_load(&p->sleepers))
        futex_wake(&p->gen);
}

static void stop_workers(struct cpu_pool *p, int started)
{
    atomic_store(&p->stop, true);
    kick(p);
    for (int i = 0; i < started; i++)
        pthread_join(p->workers[i].th, NULL);
}

enum be_status cpu_pool_create(int n_threads, struct cpu_pool **out)
{
    if (n_threads < 1 || !out)
        return BE_EINVAL;
    *out = NULL;
    struct cpu_pool *p = calloc(1, sizeof(*p));
    if (!p)
        return BE_ENOMEM_HOST;
    p->n = n_threads;
    if (n_threads > 1 && !(p->workers = calloc((size_t)n_threads - 1, sizeof(*p->workers)))) {
        free(p);
        return BE_ENOMEM_HOST;
    }
    for (int i = 0; i < n_threads - 1; i++) {
        p->workers[i] = (struct cpu_worker){.pool = p, .ith = i + 1};
        if (pthread_create(&p->workers[i].th, NULL, worker_main, &p->workers[i]) != 0) {
            stop_workers(p, i);
            free(p->workers);
            free(p);
            return BE_ENOMEM_HOST;
        }
    }
    *out = p;
    return BE_OK;
}

void cpu_pool_free(struct cpu_pool *p)
{
    if (!p)
        return;
    stop_workers(p, p->n - 1);
    free(p->workers);
    free(p);
}

int cpu_pool_size(const struct cpu_pool *p)
{
    return p->n;
}

void cpu_pool_run(struct cpu_pool *p, cpu_job_fn *fn, void *arg)
{
    if (p->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    atomic_store(&p->pending, (uint32_t)(p->n - 1));
    kick(p);
    fn(arg, 0, p->n);
    uint32_t left;
    while ((left = atomic_load_explicit(&p->pending, memory_order_acquire)) != 0)
        wait_change(&p->pending, left, &p->caller_asleep);
}
