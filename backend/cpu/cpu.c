/* cpu.c - the CPU backend: "device" memory is a separate pool of aligned
 * host memory whose budget backend.c enforces, host buffers are mlocked
 * when the system allows it, the copy stream is one thread draining a
 * ring of copies, and the compute stream is the calling thread helped by
 * a persistent pool (pool.c) running the kernels of ops.c.
 *
 * Events need no queue entry: copies complete in order, so an event is the
 * number of copies enqueued when it was recorded, and it has fired once
 * that many have completed.  The copier stamps each completion, so an
 * event's moment is the later of its recording and its last copy's end.
 */
#include <cblas.h>
#include <errno.h>
#include <hwloc.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "util/clock.h"
#include "backend/cpu/cpu.h"

/* Copies in flight before be_copy_async blocks the caller: deep enough to
 * queue every block of a long sequence's swap-in, small enough to be a
 * fixed array. */
#define COPY_RING 1024

/* Far above any machine we run on; keeps the scratch size from overflowing. */
#define CPU_MAX_THREADS 1024

struct copy_item {
    void *dst;
    const void *src;
    size_t n;
};

struct cpu_ctx {
    struct cpu_pool *pool;
    const struct cpu_kern *kern;
    float *scratch; /* [n_threads][CPU_SCRATCH_FLOATS] */
    float *rows;    /* cpu_ctx_rows */
    size_t rows_cap;

    pthread_t copier;
    pthread_mutex_t mu;
    pthread_cond_t has_work, progress;
    struct copy_item ring[COPY_RING];
    double done_at[COPY_RING];    /* when copy i finished, at i % COPY_RING */
    uint64_t enqueued, completed; /* copies ever queued / finished, under mu */
    bool stop;
    bool copier_started;

    _Atomic bool pinned; /* every host buffer so far could be locked */
    _Atomic bool bound;  /* every host buffer so far could be bound to `near` */
    hwloc_topology_t topo; /* NULL when hwloc could not load the machine */
    hwloc_nodeset_t near;  /* NUMA nodes local to the CPUs this process runs on */
};

struct cpu_pool *cpu_ctx_pool(struct cpu_ctx *c)
{
    return c->pool;
}

const struct cpu_kern *cpu_ctx_kern(struct cpu_ctx *c)
{
    return c->kern;
}

float *cpu_ctx_scratch(struct cpu_ctx *c, int ith)
{
    return c->scratch + (size_t)ith * CPU_SCRATCH_FLOATS;
}

float *cpu_ctx_rows(struct cpu_ctx *c, size_t n)
{
    if (n > c->rows_cap) {
        /* cache-line aligned: the matmuls load whole lines from it */
        void *p;
        if (posix_memalign(&p, 64, n * sizeof(float)) != 0)
            return NULL;
        free(c->rows);
        c->rows = p;
        c->rows_cap = n;
    }
    return c->rows;
}

/* ---- memory ------------------------------------------------------------- */

static enum be_status cpu_dev_alloc(void *ctx, size_t size, void **ptr)
{
    (void)ctx;
    /* the budget was charged already; running out of real memory is
     * still an out-of-device-memory condition for the caller */
    return (*ptr = aligned_alloc(64, size)) ? BE_OK : BE_ENOMEM_DEV;
}

static void cpu_dev_free(void *ctx, void *ptr, size_t size)
{
    (void)ctx;
    (void)size;
    free(ptr);
}

/* Host buffers are whole pages of their own so that munlock (implied by
 * munmap) never unlocks a neighbour's page. */
static enum be_status cpu_host_alloc(void *ctx, size_t size, void **ptr)
{
    struct cpu_ctx *c = ctx;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return BE_ENOMEM_HOST;
    /* Bound before mlock faults the pages in, so they land on the nodes
     * the compute threads read from (the host tier's pages are streamed by
     * those threads and by the copy thread, which shares their binding). */
    if (c->topo && hwloc_set_area_membind(c->topo, p, size, c->near, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET) != 0 &&
        atomic_exchange(&c->bound, false))
        fprintf(stderr, "kvtier: cpu backend: binding host buffers to their NUMA node failed (%s); pages go where "
                        "they are first touched\n", strerror(errno));
    if (mlock(p, size) != 0 && atomic_exchange(&c->pinned, false))
        fprintf(stderr, "kvtier: cpu backend: mlock of %zu bytes failed (%s); host buffers are not pinned\n", size,
                strerror(errno));
    *ptr = p;
    return BE_OK;
}

static void cpu_host_free(void *ctx, void *ptr, size_t size)
{
    (void)ctx;
    munmap(ptr, size);
}

/* ---- copy stream -------------------------------------------------------- */

/* A recorded event: the copies before it and when it was recorded. */
struct cpu_event {
    uint64_t target;
    double recorded;
};

static void *copier_main(void *arg)
{
    struct cpu_ctx *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (c->completed == c->enqueued && !c->stop)
            pthread_cond_wait(&c->has_work, &c->mu);
        if (c->completed == c->enqueued)
            break;
        struct copy_item it = c->ring[c->completed % COPY_RING];
        pthread_mutex_unlock(&c->mu);
        memcpy(it.dst, it.src, it.n);
        double t = clock_s();
        pthread_mutex_lock(&c->mu);
        c->done_at[c->completed % COPY_RING] = t;
        c->completed++;
        pthread_cond_broadcast(&c->progress);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

static enum be_status cpu_copy_async(void *ctx, void *dst, const void *src, size_t n, enum be_copy_dir dir)
{
    struct cpu_ctx *c = ctx;
    (void)dir;
    pthread_mutex_lock(&c->mu);
    while (c->enqueued - c->completed == COPY_RING)
        pthread_cond_wait(&c->progress, &c->mu);
    c->ring[c->enqueued++ % COPY_RING] = (struct copy_item){.dst = dst, .src = src, .n = n};
    pthread_cond_signal(&c->has_work);
    pthread_mutex_unlock(&c->mu);
    return BE_OK;
}

static enum be_status cpu_copy(void *ctx, void *dst, const void *src, size_t n, enum be_copy_dir dir)
{
    (void)ctx;
    (void)dir;
    memcpy(dst, src, n);
    return BE_OK;
}

static void wait_completed(struct cpu_ctx *c, uint64_t target)
{
    pthread_mutex_lock(&c->mu);
    while (c->completed < target)
        pthread_cond_wait(&c->progress, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

static enum be_status cpu_event_create(void *ctx, void **ev)
{
    (void)ctx;
    /* target 0 = never recorded, which has always fired */
    return (*ev = calloc(1, sizeof(struct cpu_event))) ? BE_OK : BE_ENOMEM_HOST;
}

static void cpu_event_free(void *ctx, void *ev)
{
    (void)ctx;
    free(ev);
}

static enum be_status cpu_event_record(void *ctx, void *ev)
{
    struct cpu_ctx *c = ctx;
    struct cpu_event *e = ev;
    pthread_mutex_lock(&c->mu);
    e->target = c->enqueued;
    e->recorded = clock_s();
    pthread_mutex_unlock(&c->mu);
    return BE_OK;
}

static enum be_status cpu_event_sync(void *ctx, void *ev)
{
    struct cpu_ctx *c = ctx;
    pthread_mutex_lock(&c->mu);
    uint64_t target = ((struct cpu_event *)ev)->target;
    pthread_mutex_unlock(&c->mu);
    wait_completed(c, target);
    return BE_OK;
}

/* When the copy stream reached a fired event; false once its last copy's
 * stamp has been overwritten (COPY_RING copies later). */
static bool event_moment(struct cpu_ctx *c, const struct cpu_event *e, double *t)
{
    *t = e->recorded;
    if (e->target == 0)
        return true;
    if (c->completed - (e->target - 1) > COPY_RING)
        return false;
    double done = c->done_at[(e->target - 1) % COPY_RING];
    if (done > *t)
        *t = done;
    return true;
}

static enum be_status cpu_event_elapsed(void *ctx, void *start, void *end, double *seconds)
{
    struct cpu_ctx *c = ctx;
    double t0, t1;
    pthread_mutex_lock(&c->mu);
    bool ok = event_moment(c, start, &t0) && event_moment(c, end, &t1);
    pthread_mutex_unlock(&c->mu);
    if (!ok)
        return BE_EINVAL;
    *seconds = t1 > t0 ? t1 - t0 : 0.0;
    return BE_OK;
}

static enum be_status cpu_sync(void *ctx)
{
    struct cpu_ctx *c = ctx;
    pthread_mutex_lock(&c->mu);
    uint64_t target = c->enqueued;
    pthread_mutex_unlock(&c->mu);
    wait_completed(c, target);
    return BE_OK;
}

/* ---- life cycle --------------------------------------------------------- */

static struct be_caps cpu_caps(void *ctx)
{
    struct cpu_ctx *c = ctx;
    return (struct be_caps){
        .name = "cpu",
        .async_copy = true,
        .pinned_host = atomic_load(&c->pinned),
        .unified_memory = true,
        .n_threads = cpu_pool_size(c->pool),
        .simd = c->kern->name,
        .act_dtype = BE_F32,
    };
}

/* Loads the machine's topology and the NUMA nodes near the CPUs this
 * process may run on; without hwloc the backend still works, unbound. */
static void load_topology(struct cpu_ctx *c)
{
    hwloc_bitmap_t cpus = hwloc_bitmap_alloc();
    c->near = hwloc_bitmap_alloc();
    if (!cpus || !c->near || hwloc_topology_init(&c->topo) != 0) {
        c->topo = NULL;
    } else if (hwloc_topology_load(c->topo) != 0 || hwloc_get_cpubind(c->topo, cpus, HWLOC_CPUBIND_PROCESS) != 0) {
        hwloc_topology_destroy(c->topo);
        c->topo = NULL;
    } else {
        hwloc_cpuset_to_nodeset(c->topo, cpus, c->near);
    }
    hwloc_bitmap_free(cpus);
}

static int physical_cores(const struct cpu_ctx *c)
{
    int n = c->topo ? hwloc_get_nbobjs_by_type(c->topo, HWLOC_OBJ_CORE) : 0;
    if (n <= 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        n = online > 0 ? (int)online : 1;
    }
    return n;
}

/* Also unwinds a context be_cpu_init built only partly. */
static void cpu_free(void *ctx)
{
    struct cpu_ctx *c = ctx;
    if (c->copier_started) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_signal(&c->has_work);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->copier, NULL);
    }
    pthread_cond_destroy(&c->progress);
    pthread_cond_destroy(&c->has_work);
    pthread_mutex_destroy(&c->mu);
    cpu_pool_free(c->pool);
    free(c->scratch);
    free(c->rows);
    if (c->topo)
        hwloc_topology_destroy(c->topo);
    hwloc_bitmap_free(c->near);
    free(c);
}

static const struct be_ops cpu_ops = {
    .api_version = BE_API_VERSION,
    .name = "cpu",
    .free = cpu_free,
    .caps = cpu_caps,
    .dev_alloc = cpu_dev_alloc,
    .dev_free = cpu_dev_free,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_host_free,
    .copy_async = cpu_copy_async,
    .copy = cpu_copy,
    .event_create = cpu_event_create,
    .event_free = cpu_event_free,
    .event_record = cpu_event_record,
    .event_wait = NULL, /* the compute stream is the calling thread: waiting is a host sync */
    .event_sync = cpu_event_sync,
    .event_elapsed = cpu_event_elapsed,
    .sync = cpu_sync,
    .matmul = cpu_matmul,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .silu_mul = cpu_silu_mul,
    .gelu_mul = cpu_gelu_mul,
    .act = cpu_act,
    .scale = cpu_scale,
    .layernorm = cpu_layernorm,
    .add = cpu_add,
    .softmax = cpu_softmax,
    .embed = cpu_embed,
    .argmax = cpu_argmax,
    .attention_quant = cpu_attention_quant,
    .kvq_quantize = cpu_kvq_quantize,
    .kvq_dequantize = cpu_kvq_dequantize,
    .kv_absmax = cpu_kv_absmax,
    .kv_copy = cpu_kv_copy,
    .ssm_conv = cpu_ssm_conv,
    .ssm_scan = cpu_ssm_scan,
};

enum be_status be_cpu_init(const struct be_params *p, const struct be_ops **ops, void **ctx, size_t *dev_budget)
{
    const struct cpu_kern *kern = cpu_kern_select();
    if (!kern)
        return BE_ENOTSUP;
    if (p->n_threads > CPU_MAX_THREADS)
        return BE_EINVAL;
    struct cpu_ctx *c = calloc(1, sizeof(*c));
    if (!c)
        return BE_ENOMEM_HOST;
    c->kern = kern;
    atomic_init(&c->pinned, true);
    atomic_init(&c->bound, true);
    load_topology(c);
    int n_threads = p->n_threads ? p->n_threads : physical_cores(c);
    if (n_threads > CPU_MAX_THREADS)
        n_threads = CPU_MAX_THREADS;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->has_work, NULL);
    pthread_cond_init(&c->progress, NULL);
    c->scratch = aligned_alloc(64, (size_t)n_threads * CPU_SCRATCH_FLOATS * sizeof(float));
    enum be_status st = c->scratch ? cpu_pool_create(n_threads, &c->pool) : BE_ENOMEM_HOST;
    if (st == BE_OK && pthread_create(&c->copier, NULL, copier_main, c) != 0)
        st = BE_ENOMEM_HOST;
    c->copier_started = st == BE_OK;
    if (st != BE_OK) {
        cpu_free(c);
        return st;
    }
    /* our pool already splits every matmul across the cores; a second
     * level of OpenBLAS threads would only fight it */
    openblas_set_num_threads(1);

    size_t budget = p->device_mem;
    if (!budget) {
        long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
        budget = pages > 0 && page > 0 ? (size_t)pages * (size_t)page / 2 : (size_t)1 << 30;
    }
    *ops = &cpu_ops;
    *ctx = c;
    *dev_budget = budget;
    return BE_OK;
}
