/* readbw.c - threads, buffer and dispatch for the read bandwidth ceiling. */
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "util/clock.h"
#include "util/readbw.h"

#define MAX_THREADS 256
#define HUGE_PAGE ((size_t)2 << 20)

struct readbw {
    uint64_t *buf;
    size_t words_per_thread; /* a multiple of 32: the kernels read 256 bytes a step */
    int threads;
};

/* One stream keeps the hardware prefetcher on a single sequence; a
 * matrix-vector product reads several rows at once, and on some CPUs that
 * pulls more bytes per second than any single stream. */
const int readbw_ceiling_streams[] = {1, 4, 16};
const int readbw_n_ceiling_streams = (int)(sizeof(readbw_ceiling_streams) / sizeof(readbw_ceiling_streams[0]));

/* The portable kernel, for CPUs without AVX2; four sums so the adds overlap. */
static uint64_t sum_scalar(const uint64_t *p, size_t n, int streams)
{
    size_t per = n / 32 / (size_t)streams * 32;
    uint64_t s[4] = {0};
    /* as the vector kernels: 256 bytes of every part in turn, then the rest */
    for (size_t i = 0; i < per; i += 32)
        for (int k = 0; k < streams; k++)
            for (int w = 0; w < 32; w++)
                s[w % 4] += p[(size_t)k * per + i + (size_t)w];
    for (size_t i = per * (size_t)streams; i < n; i++)
        s[i % 4] += p[i];
    return s[0] + s[1] + s[2] + s[3];
}

static int can_avx2(void)
{
    return __builtin_cpu_supports("avx2");
}

static int can_avx512(void)
{
    return can_avx2() && __builtin_cpu_supports("avx512f");
}

int readbw_isa_ok(enum readbw_isa isa)
{
    __builtin_cpu_init();
    switch (isa) {
    case READBW_SCALAR: return 1;
    case READBW_AVX2: return can_avx2();
    case READBW_AVX512: return can_avx512();
    default: return 0;
    }
}

enum readbw_isa readbw_best_isa(void)
{
    return readbw_isa_ok(READBW_AVX512) ? READBW_AVX512 : readbw_isa_ok(READBW_AVX2) ? READBW_AVX2 : READBW_SCALAR;
}

const char *readbw_isa_name(enum readbw_isa isa)
{
    static const char *const names[READBW_N_ISA] = {"scalar", "avx2", "avx512"};
    return (unsigned)isa < READBW_N_ISA ? names[isa] : "?";
}

const char *readbw_load_name(enum readbw_load load)
{
    static const char *const names[READBW_N_LOAD] = {"plain", "non-temporal"};
    return (unsigned)load < READBW_N_LOAD ? names[load] : "?";
}

/* The last-level cache, or 0 when the C library does not know it. */
static size_t llc_bytes(void)
{
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE), l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l3 > 0 ? (size_t)l3 : l2 > 0 ? (size_t)l2 : 0;
}

readbw *readbw_create(size_t min_bytes, int threads)
{
    size_t want = 8 * llc_bytes() > min_bytes ? 8 * llc_bytes() : min_bytes;
    if (threads < 1 || threads > MAX_THREADS || want > ((size_t)1 << 40))
        return NULL;
    size_t per = (want / 8 / (size_t)threads + 31) / 32 * 32;
    if (per == 0)
        per = 32;
    size_t bytes = per * (size_t)threads * 8;
    size_t alloc = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    readbw *rb = malloc(sizeof(*rb));
    uint64_t *buf = aligned_alloc(HUGE_PAGE, alloc);
    if (!rb || !buf) {
        free(rb);
        free(buf);
        return NULL;
    }
    /* huge pages spare the stream TLB misses; only a hint, so its failure
     * just leaves the ceiling a little lower */
    (void)madvise(buf, alloc, MADV_HUGEPAGE);
    size_t n = per * (size_t)threads;
    for (size_t i = 0; i < n; i++)
        buf[i] = i;
    *rb = (struct readbw){.buf = buf, .words_per_thread = per, .threads = threads};
    return rb;
}

void readbw_free(readbw *rb)
{
    if (!rb)
        return;
    free(rb->buf);
    free(rb);
}

size_t readbw_bytes(const readbw *rb)
{
    return rb->words_per_thread * (size_t)rb->threads * 8;
}

/* Threads start together: each says it is ready and waits for go, so that
 * the clock starts once every thread exists and none has read yet. */
struct pass {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int ready, go, abort;
    enum readbw_isa isa;
    enum readbw_load load;
    int streams;
};

struct job {
    struct pass *ps;
    const uint64_t *p;
    size_t n;
    uint64_t sum;
};

static void *job_run(void *arg)
{
    struct job *j = arg;
    struct pass *ps = j->ps;
    pthread_mutex_lock(&ps->mu);
    ps->ready++;
    pthread_cond_broadcast(&ps->cv);
    while (!ps->go)
        pthread_cond_wait(&ps->cv, &ps->mu);
    int abort = ps->abort;
    pthread_mutex_unlock(&ps->mu);
    if (abort)
        return NULL;
    switch (ps->isa) {
    case READBW_AVX512: j->sum = readbw_sum_avx512(j->p, j->n, ps->streams, ps->load); break;
    case READBW_AVX2: j->sum = readbw_sum_avx2(j->p, j->n, ps->streams, ps->load); break;
    default: j->sum = sum_scalar(j->p, j->n, ps->streams); break;
    }
    return NULL;
}

double readbw_pass(readbw *rb, enum readbw_isa isa, enum readbw_load load, int streams, uint64_t *sum)
{
    if (!readbw_isa_ok(isa) || (unsigned)load >= READBW_N_LOAD || streams < 1 || streams > READBW_MAX_STREAMS)
        return 0;
    struct pass ps = {
        .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .isa = isa, .load = load, .streams = streams};
    struct job jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started = 0;
    for (; started < rb->threads; started++) {
        jobs[started] = (struct job){
            .ps = &ps, .p = rb->buf + rb->words_per_thread * (size_t)started, .n = rb->words_per_thread};
        if (pthread_create(&tid[started], NULL, job_run, &jobs[started]) != 0)
            break;
    }
    pthread_mutex_lock(&ps.mu);
    while (ps.ready < started)
        pthread_cond_wait(&ps.cv, &ps.mu);
    ps.abort = started < rb->threads;
    ps.go = 1;
    double t0 = clock_s();
    pthread_cond_broadcast(&ps.cv);
    pthread_mutex_unlock(&ps.mu);
    uint64_t total = 0;
    for (int t = 0; t < started; t++) {
        pthread_join(tid[t], NULL);
        total += jobs[t].sum;
    }
    double dt = clock_s() - t0;
    if (ps.abort)
        return 0;
    if (sum)
        *sum = total;
    return (double)readbw_bytes(rb) / dt / 1e9;
}

double readbw_ceiling(readbw *rb, int passes, enum readbw_load *load, int *streams)
{
    enum readbw_isa isa = readbw_best_isa();
    double best = 0;
    /* the kinds alternate pass by pass, so a disturbance does not favour one */
    for (int i = 0; i < passes; i++)
        for (int s = 0; s < readbw_n_ceiling_streams; s++)
            for (int k = 0; k < READBW_N_LOAD; k++) {
                double g = readbw_pass(rb, isa, (enum readbw_load)k, readbw_ceiling_streams[s], NULL);
                if (g > best) {
                    best = g;
                    if (load)
                        *load = (enum readbw_load)k;
                    if (streams)
                        *streams = readbw_ceiling_streams[s];
                }
            }
    return best;
}
