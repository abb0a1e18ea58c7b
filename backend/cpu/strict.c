/* strict.c - the strict CPU backend ("cpu-strict"): the CPU backend's ops
 * with its device memory made unreadable to everyone else.
 *
 * A GPU's memory cannot be dereferenced by the host, but the CPU backend's
 * can, so a layer above the seam that reads or writes a device block by hand
 * works on the CPU and breaks on a GPU.  Here device memory is one arena
 * that no thread may touch except the backend's own: its pool workers, and
 * a caller while one of its ops runs (opened on op entry, closed on exit),
 * so any access from tiers/, model/ or the daemon faults at once.  Copies
 * run synchronously inside the op that asks for them, so nothing reads the
 * arena between ops; and the backend does not claim unified memory, so
 * weights are uploaded through the seam as on a GPU.
 *
 * The lock is a memory protection key where the CPU has them: opening is
 * then a write of the calling thread's PKRU register, a few cycles.
 * Elsewhere the arena is PROT_NONE between ops and every op pays two
 * mprotect calls over its used prefix (the arena is carved first-fit from
 * a free list kept in host memory, so allocations stay low); then any
 * thread may touch the arena while some op runs, a weaker check.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "backend/arena.h"
#include "backend/cpu/cpu.h"

#define ARENA_PAGE ((size_t)2 << 20) /* a huge page */

struct strict {
    const struct be_ops *in; /* the CPU backend */
    void *ictx;

    char *arena;        /* huge-page aligned, within map */
    size_t arena_size;
    void *map;
    size_t map_size;
    int pkey;           /* the arena's protection key, -1: mprotect instead */
    pthread_mutex_t mu; /* guards everything below */
    int open;           /* ops running: the arena is readable while > 0 */
    size_t top;         /* end of the highest allocation ever made, ARENA_PAGE-rounded (the map has room) */
    size_t opened;      /* bytes from the arena's start that are readable now */
    bool broken;        /* an mprotect failed: refuse every op */
    struct be_arena carve;    /* the arena's allocations, by offset */
};

/* ---- opening and closing the arena ---------------------------------------- */

/* An op that starts while another runs still opens what was allocated
 * since: its own buffers may be newer. */
static bool enter(struct strict *s)
{
    if (s->pkey >= 0)
        return pkey_set(s->pkey, 0) == 0;
    pthread_mutex_lock(&s->mu);
    if (s->top > s->opened && !s->broken) {
        if (mprotect(s->arena + s->opened, s->top - s->opened, PROT_READ | PROT_WRITE) != 0)
            s->broken = true;
        s->opened = s->top;
    }
    bool ok = !s->broken;
    if (ok)
        s->open++;
    pthread_mutex_unlock(&s->mu);
    return ok;
}

static void leave(struct strict *s)
{
    if (s->pkey >= 0) {
        pkey_set(s->pkey, PKEY_DISABLE_ACCESS);
        return;
    }
    pthread_mutex_lock(&s->mu);
    if (--s->open == 0 && s->opened) {
        if (mprotect(s->arena, s->opened, PROT_NONE) != 0)
            s->broken = true;
        s->opened = 0;
    }
    pthread_mutex_unlock(&s->mu);
}

/* ---- the arena's allocator ------------------------------------------------- */

static enum be_status strict_dev_alloc(void *ctx, size_t size, void **ptr)
{
    struct strict *s = ctx;
    size_t off;
    pthread_mutex_lock(&s->mu);
    enum be_status st = be_arena_take(&s->carve, size, &off);
    if (st == BE_OK) {
        *ptr = s->arena + off;
        size_t end = (off + size + ARENA_PAGE - 1) / ARENA_PAGE * ARENA_PAGE;
        s->top = end > s->top ? end : s->top;
    }
    pthread_mutex_unlock(&s->mu);
    return st;
}

static void strict_dev_free(void *ctx, void *ptr, size_t size)
{
    struct strict *s = ctx;
    pthread_mutex_lock(&s->mu);
    be_arena_give(&s->carve, (size_t)((char *)ptr - s->arena), size);
    pthread_mutex_unlock(&s->mu);
}

static enum be_status strict_host_alloc(void *ctx, size_t size, void **ptr)
{
    struct strict *s = ctx;
    return s->in->host_alloc(s->ictx, size, ptr);
}

static void strict_host_free(void *ctx, void *ptr, size_t size)
{
    struct strict *s = ctx;
    s->in->host_free(s->ictx, ptr, size);
}

/* ---- every other op: the CPU backend's, inside the open arena ------------ */

#define STRICT_OP(name, params, ...)                                                                           \
    static enum be_status strict_##name params                                                                  \
    {                                                                                                          \
        struct strict *s = ctx;                                                                                \
        if (!enter(s))                                                                                         \
            return BE_EIO;                                                                                     \
        enum be_status st = s->in->name(s->ictx, __VA_ARGS__);                                                  \
        leave(s);                                                                                              \
        return st;                                                                                             \
    }

STRICT_OP(copy, (void *ctx, void *dst, const void *src, size_t n, enum be_copy_dir dir), dst, src, n, dir)
STRICT_OP(matmul, (void *ctx, void *y, enum be_dtype yt, const void *x, const void *w, enum be_dtype wt, const float *bias, int n,
                   int in, int out), y, yt, x, w, wt, bias, n, in, out)
STRICT_OP(rmsnorm, (void *ctx, void *y, const void *x, const float *w, int n, int dim, float eps), y, x, w, n, dim,
          eps)
STRICT_OP(rope, (void *ctx, void *x, int n_tok, int n_heads, int head_dim, const int64_t *pos,
                 const float *inv_freq, int rot_dim, float mscale, enum be_rope_layout layout), x, n_tok, n_heads,
          head_dim, pos, inv_freq, rot_dim, mscale, layout)
STRICT_OP(kv_store, (void *ctx, const struct be_kv_view *views, const struct be_tok *toks, int n_tok, const void *k,
                     const void *v, const struct be_attn_params *p), views, toks, n_tok, k, v, p)
STRICT_OP(attention, (void *ctx, void *out, const void *q, const struct be_kv_view *views,
                      const struct be_tok *toks, int n_tok, const struct be_attn_params *p), out, q, views, toks,
          n_tok, p)
STRICT_OP(attention_quant, (void *ctx, void *out, const void *q, const struct be_kvq_view *views,
                            const struct be_tok *toks, int n_tok, const struct be_attn_params *p), out, q, views,
          toks, n_tok, p)
STRICT_OP(kvq_quantize, (void *ctx, const struct be_kvq_view *v, int64_t end), v, end)
STRICT_OP(kvq_dequantize, (void *ctx, const struct be_kvq_view *v, int64_t p0, int64_t p1,
                           const struct be_kv_view *dst), v, p0, p1, dst)
STRICT_OP(kv_absmax, (void *ctx, const struct be_kv_view *v, enum be_dtype dt, int n_kv_heads, int head_dim, int64_t p0,
                      int64_t p1, float amax[2]), v, dt, n_kv_heads, head_dim, p0, p1, amax)
STRICT_OP(kv_copy, (void *ctx, const struct be_kv_view *dst, const struct be_kv_view *src, int64_t p0, int64_t p1,
                    const struct be_attn_params *p), dst, src, p0, p1, p)
STRICT_OP(ssm_conv, (void *ctx, void *y, const void *x, const struct be_ssm_view *views, const struct be_tok *toks,
                     int n_tok, const struct be_ssm_params *p), y, x, views, toks, n_tok, p)
STRICT_OP(ssm_scan, (void *ctx, void *y, const void *x, const void *dt_raw, const void *B, const void *C,
                     const void *z, const struct be_ssm_view *views, const struct be_tok *toks, int n_tok,
                     const struct be_ssm_params *p), y, x, dt_raw, B, C, z, views, toks, n_tok, p)
STRICT_OP(silu_mul, (void *ctx, void *y, const void *gate, const void *up, size_t n), y, gate, up, n)
STRICT_OP(gelu_mul, (void *ctx, void *y, const void *gate, const void *up, size_t n), y, gate, up, n)
STRICT_OP(act, (void *ctx, void *x, size_t n, enum be_act a), x, n, a)
STRICT_OP(scale, (void *ctx, void *x, size_t n, float a), x, n, a)
STRICT_OP(layernorm, (void *ctx, void *y, const void *x, const float *w, const float *b, int n, int dim, float eps),
          y, x, w, b, n, dim, eps)
STRICT_OP(add, (void *ctx, void *y, const void *x, size_t n), y, x, n)
STRICT_OP(softmax, (void *ctx, void *x, int rows, int cols), x, rows, cols)
STRICT_OP(embed, (void *ctx, void *y, const void *table, enum be_dtype dt, const int32_t *ids, int n, int dim), y,
          table, dt, ids, n, dim)
STRICT_OP(argmax, (void *ctx, const void *x, int rows, int cols, int32_t *out), x, rows, cols, out)

/* An asynchronous copy would read the arena after its op returned: it runs
 * now, so every event has fired when it is recorded. */
static enum be_status strict_copy_async(void *ctx, void *dst, const void *src, size_t n, enum be_copy_dir dir)
{
    return strict_copy(ctx, dst, src, n, dir);
}

static enum be_status strict_event_create(void *ctx, void **ev)
{
    struct strict *s = ctx;
    return s->in->event_create(s->ictx, ev);
}

static void strict_event_free(void *ctx, void *ev)
{
    struct strict *s = ctx;
    s->in->event_free(s->ictx, ev);
}

static enum be_status strict_event_record(void *ctx, void *ev)
{
    struct strict *s = ctx;
    return s->in->event_record(s->ictx, ev);
}

static enum be_status strict_event_sync(void *ctx, void *ev)
{
    struct strict *s = ctx;
    return s->in->event_sync(s->ictx, ev);
}

static enum be_status strict_event_elapsed(void *ctx, void *start, void *end, double *seconds)
{
    struct strict *s = ctx;
    return s->in->event_elapsed(s->ictx, start, end, seconds);
}

static enum be_status strict_sync(void *ctx)
{
    struct strict *s = ctx;
    return s->in->sync(s->ictx);
}

static struct be_caps strict_caps(void *ctx)
{
    struct strict *s = ctx;
    struct be_caps c = s->in->caps(s->ictx);
    c.name = "cpu-strict";
    c.async_copy = false;
    c.unified_memory = false;
    return c;
}

static void strict_free(void *ctx)
{
    struct strict *s = ctx;
    if (s->in)
        s->in->free(s->ictx);
    if (s->map)
        munmap(s->map, s->map_size);
    if (s->pkey >= 0)
        pkey_free(s->pkey);
    be_arena_release(&s->carve);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static const struct be_ops strict_ops = {
    .api_version = BE_API_VERSION,
    .name = "cpu-strict",
    .free = strict_free,
    .caps = strict_caps,
    .dev_alloc = strict_dev_alloc,
    .dev_free = strict_dev_free,
    .host_alloc = strict_host_alloc,
    .host_free = strict_host_free,
    .copy_async = strict_copy_async,
    .copy = strict_copy,
    .event_create = strict_event_create,
    .event_free = strict_event_free,
    .event_record = strict_event_record,
    .event_wait = NULL,
    .event_sync = strict_event_sync,
    .event_elapsed = strict_event_elapsed,
    .sync = strict_sync,
    .matmul = strict_matmul,
    .rmsnorm = strict_rmsnorm,
    .rope = strict_rope,
    .kv_store = strict_kv_store,
    .attention = strict_attention,
    .silu_mul = strict_silu_mul,
    .gelu_mul = strict_gelu_mul,
    .act = strict_act,
    .scale = strict_scale,
    .layernorm = strict_layernorm,
    .add = strict_add,
    .softmax = strict_softmax,
    .embed = strict_embed,
    .argmax = strict_argmax,
    .attention_quant = strict_attention_quant,
    .kvq_quantize = strict_kvq_quantize,
    .kvq_dequantize = strict_kvq_dequantize,
    .kv_absmax = strict_kv_absmax,
    .kv_copy = strict_kv_copy,
    .ssm_conv = strict_ssm_conv,
    .ssm_scan = strict_ssm_scan,
};

/* A pool job: every worker may touch the arena from now on (the caller,
 * thread 0, is closed again by be_strict_init). */
static void grant_workers(void *arg, int ith, int nth)
{
    (void)ith;
    (void)nth;
    pkey_set(*(int *)arg, 0);
}

/* Tags the arena with a protection key that only the pool's workers and
 * an op's caller open; false where the CPU or kernel has no keys left. */
static bool use_pkey(struct strict *s)
{
    s->pkey = pkey_alloc(0, 0);
    if (s->pkey < 0)
        return false;
    if (pkey_mprotect(s->arena, s->arena_size, PROT_READ | PROT_WRITE, s->pkey) != 0) {
        pkey_free(s->pkey);
        s->pkey = -1;
        return false;
    }
    cpu_pool_run(cpu_ctx_pool(s->ictx), grant_workers, &s->pkey);
    pkey_set(s->pkey, PKEY_DISABLE_ACCESS);
    return true;
}

enum be_status be_strict_init(const struct be_params *p, const struct be_ops **ops, void **ctx, size_t *dev_budget)
{
    struct strict *s = calloc(1, sizeof(*s));
    if (!s)
        return BE_ENOMEM_HOST;
    s->pkey = -1;
    pthread_mutex_init(&s->mu, NULL);
    size_t budget = 0;
    enum be_status st = be_cpu_init(p, &s->in, &s->ictx, &budget);
    if (st != BE_OK) {
        s->in = NULL;
        strict_free(s);
        return st;
    }
    /* whole pages, so the last allocation's page is protected too; huge
     * ones where the kernel gives them, so that the two mprotect calls of
     * every op change one entry per 2 MiB rather than per 4 KiB (the
     * weights live in the arena: the calls would cost more than the op) */
    size_t page = 4096, huge = (budget + ARENA_PAGE - 1) / ARENA_PAGE * ARENA_PAGE;
    s->arena_size = (budget + page - 1) / page * page;
    s->map_size = huge + ARENA_PAGE;
    s->map = mmap(NULL, s->map_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s->map == MAP_FAILED || be_arena_init(&s->carve, s->arena_size) != BE_OK) {
        if (s->map == MAP_FAILED)
            s->map = NULL;
        strict_free(s);
        return BE_ENOMEM_HOST;
    }
    s->arena = (char *)(((uintptr_t)s->map + ARENA_PAGE - 1) / ARENA_PAGE * ARENA_PAGE);
    madvise(s->arena, huge, MADV_HUGEPAGE); /* a hint: 4 KiB pages work too */
    use_pkey(s);
    *ops = &strict_ops;
    *ctx = s;
    *dev_budget = budget;
    return BE_OK;
}
