/* backend.c - the generic side of the compute seam: opening a backend,
 * argument checks, device-pool accounting and fault injection, done once
 * here so that every implementation behind backend_impl.h gets them.
 */
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend_impl.h"
#include "util/clock.h"
#include "util/q4k.h"
#include "util/q8.h"


const char *be_strerror(enum be_status st)
{
    switch (st) {
    case BE_OK: return "ok";
    case BE_ENOMEM_DEV: return "device memory budget exhausted";
    case BE_ENOMEM_HOST: return "out of host memory";
    case BE_EINVAL: return "invalid argument";
    case BE_ENOTSUP: return "not supported by this backend";
    case BE_ENODEV: return "backend not available";
    case BE_EIO: return "device or driver error";
    }
    return "unknown backend status";
}

size_t be_dtype_size(enum be_dtype dt)
{
    switch (dt) {
    case BE_F32: return 4;
    case BE_F16: return 2;
    case BE_BF16: return 2;
    case BE_Q8_0: case BE_Q4_K: break;
    }
    return 0;
}

size_t be_row_bytes(enum be_dtype dt, size_t n)
{
    if (dt == BE_Q8_0)
        return n % Q8_0_BLOCK ? 0 : n / Q8_0_BLOCK * sizeof(struct q8_0_block);
    if (dt == BE_Q4_K)
        return q4_k_row_bytes(n);
    return n * be_dtype_size(dt);
}

const char *be_dtype_name(enum be_dtype dt)
{
    switch (dt) {
    case BE_F32: return "f32";
    case BE_F16: return "f16";
    case BE_BF16: return "bf16";
    case BE_Q8_0: return "q8_0";
    case BE_Q4_K: return "q4_k";
    }
    return "?";
}

/* ---- opening ------------------------------------------------------------ */

#define CUDA_PLUGIN_NAME "libkvtier-cuda.so"

static _Thread_local char open_error[512];

const char *be_open_error(void)
{
    return open_error;
}

/* dlopen, and when a file exists but does not load (its CUDA libraries
 * missing), the loader's words as the reason.  Never unmapped: the CUDA
 * runtime linked into the plugin holds the device context and its
 * registered kernels for the process's life, and the runtime's sizing
 * probe followed by the real open would otherwise tear them down and
 * build them again. */
static void *plugin_try(const char *path)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
    if (!h && access(path, F_OK) == 0)
        snprintf(open_error, sizeof(open_error), "the CUDA plugin does not load (%s)", dlerror());
    return h;
}

/* Candidates in order: $KVTIER_CUDA_PLUGIN (a file, or a directory holding
 * the plugin), then next to the running executable, and one level up for a
 * program in a tests/ directory (tests run from build/tests/, the plugin
 * sits in build/; a daemon in build/asan/ must not take build/'s). */
static void *open_cuda_plugin(void)
{
    char exe[PATH_MAX], path[PATH_MAX + sizeof(CUDA_PLUGIN_NAME) + 8];
    const char *env = getenv("KVTIER_CUDA_PLUGIN");
    void *h;

    if (env && *env) {
        if ((h = plugin_try(env)))
            return h;
        snprintf(path, sizeof(path), "%s/%s", env, CUDA_PLUGIN_NAME);
        if ((h = plugin_try(path)))
            return h;
    }
    ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (len <= 0)
        return NULL;
    exe[len] = '\0';
    for (int up = 0; up < 2; up++) {
        char *slash = strrchr(exe, '/');
        if (!slash || (up == 1 && strcmp(slash + 1, "tests") != 0))
            return NULL;
        *slash = '\0';
        snprintf(path, sizeof(path), "%s/%s", exe, CUDA_PLUGIN_NAME);
        if ((h = plugin_try(path)))
            return h;
    }
    return NULL;
}

static bool ops_complete(const struct be_ops *o)
{
    return o && o->api_version == BE_API_VERSION && o->name && o->free && o->caps && o->dev_alloc && o->dev_free &&
           o->host_alloc && o->host_free && o->copy_async && o->copy && o->event_create && o->event_free &&
           o->event_record && o->event_sync && o->sync && o->matmul && o->rmsnorm && o->rope && o->kv_store &&
           o->attention && o->silu_mul && o->gelu_mul && o->act && o->scale && o->layernorm && o->add && o->softmax && o->embed && o->argmax;
}

enum be_status be_open(const char *name, const struct be_params *p, be_backend **out)
{
    static const struct be_params defaults;
    be_init_fn init;
    void *plugin = NULL;

    open_error[0] = '\0';
    if (!name || !out)
        return BE_EINVAL;
    *out = NULL;
    if (!p)
        p = &defaults;
    if (p->n_threads < 0 || p->device_index < 0)
        return BE_EINVAL;
    /* The test suite runs once more with every "cpu" backend strict
     * (tests/run.sh), so no test has to name it. */
    const char *strict = getenv("KVTIER_BACKEND_STRICT");
    if (strcmp(name, "cpu") == 0 && strict && strcmp(strict, "1") == 0)
        name = "cpu-strict";
    /* ... and on a GPU machine once more with every "cpu" backend the
     * one named here (tools/gpu-check.sh: KVTIER_TEST_BACKEND=cuda). */
    const char *swap = getenv("KVTIER_TEST_BACKEND");
    if (strcmp(name, "cpu") == 0 && swap && *swap)
        name = swap;
    if (strcmp(name, "cpu") == 0) {
        init = be_cpu_init;
    } else if (strcmp(name, "cpu-strict") == 0) {
        init = be_strict_init;
    } else if (strcmp(name, "cuda") == 0) {
        if (!(plugin = open_cuda_plugin())) {
            if (!open_error[0])
                snprintf(open_error, sizeof(open_error), "no CUDA plugin (%s not built: make CUDA=1)",
                         CUDA_PLUGIN_NAME);
            return BE_ENODEV;
        }
        open_error[0] = '\0'; /* a candidate before it may have failed */
        const struct be_ops *(*table)(void);
        *(void **)&init = dlsym(plugin, BE_PLUGIN_INIT_SYMBOL);
        *(void **)&table = dlsym(plugin, BE_PLUGIN_OPS_SYMBOL);
        if (!init || !table) {
            snprintf(open_error, sizeof(open_error), "the CUDA plugin has no %s",
                     init ? BE_PLUGIN_OPS_SYMBOL : BE_PLUGIN_INIT_SYMBOL);
            dlclose(plugin);
            return BE_ENODEV;
        }
        if (!ops_complete(table())) {
            snprintf(open_error, sizeof(open_error), "the cuda backend is from another build of kvtier");
            dlclose(plugin);
            return BE_ENODEV;
        }
    } else {
        return BE_ENODEV;
    }

    be_backend *be = calloc(1, sizeof(*be));
    if (!be) {
        if (plugin)
            dlclose(plugin);
        return BE_ENOMEM_HOST;
    }
    size_t budget = 0;
    enum be_status st = init(p, &be->ops, &be->ctx, &budget);
    if (st == BE_OK && !ops_complete(be->ops)) {
        /* A plugin from another build: its ctx is still released through
         * its own free, which exists in every version of the table. */
        if (be->ops && be->ops->free)
            be->ops->free(be->ctx);
        snprintf(open_error, sizeof(open_error), "the %s backend is from another build of kvtier", name);
        st = BE_ENODEV;
    }
    if (st != BE_OK) {
        free(be);
        if (plugin) {
            const char *(*why)(void);
            *(void **)&why = dlsym(plugin, BE_PLUGIN_ERROR_SYMBOL);
            if (!open_error[0]) /* copied before the plugin goes */
                snprintf(open_error, sizeof(open_error), "%s", why && why() && why()[0] ? why() : be_strerror(st));
            dlclose(plugin);
        }
        return st;
    }
    pthread_mutex_init(&be->lock, NULL);
    be->plugin = plugin;
    be->stats.dev_budget = budget;
    *out = be;
    return BE_OK;
}

void be_free(be_backend *be)
{
    if (!be)
        return;
    be->ops->free(be->ctx);
    if (be->plugin)
        dlclose(be->plugin);
    pthread_mutex_destroy(&be->lock);
    free(be);
}

struct be_caps be_get_caps(const be_backend *be)
{
    if (!be)
        return (struct be_caps){.name = "none", .simd = "scalar"};
    return be->ops->caps(be->ctx);
}

/* ---- memory ------------------------------------------------------------ */

/* Charges size to the device pool, or says why not: the budget, or the
 * injected fault.  Both count as a failed attempt. */
static enum be_status dev_charge(be_backend *be, size_t size)
{
    enum be_status st = BE_OK;
    pthread_mutex_lock(&be->lock);
    struct be_mem_stats *s = &be->stats;
    s->dev_allocs++;
    if (be->fault_countdown && --be->fault_countdown == 0) {
        be->faulting = be->fault_repeat;
        st = BE_ENOMEM_DEV;
    } else if (be->faulting || size > s->dev_budget - s->dev_used) {
        st = BE_ENOMEM_DEV;
    }
    if (st == BE_OK) {
        s->dev_used += size;
        if (s->dev_used > s->dev_peak)
            s->dev_peak = s->dev_used;
    } else {
        s->dev_failures++;
    }
    pthread_mutex_unlock(&be->lock);
    return st;
}

static void uncharge(be_backend *be, size_t size, bool device)
{
    pthread_mutex_lock(&be->lock);
    if (device)
        be->stats.dev_used -= size;
    else
        be->stats.host_used -= size;
    pthread_mutex_unlock(&be->lock);
}

static void host_charge(be_backend *be, size_t size)
{
    pthread_mutex_lock(&be->lock);
    be->stats.host_used += size;
    if (be->stats.host_used > be->stats.host_peak)
        be->stats.host_peak = be->stats.host_used;
    pthread_mutex_unlock(&be->lock);
}

static enum be_status buffer_alloc(be_backend *be, size_t size, bool device, be_buffer **out)
{
    if (!be || !out || size == 0 || size > SIZE_MAX - BE_ALIGN)
        return BE_EINVAL;
    *out = NULL;
    size_t charged = (size + BE_ALIGN - 1) & ~(size_t)(BE_ALIGN - 1);
    be_buffer *buf = malloc(sizeof(*buf));
    if (!buf)
        return BE_ENOMEM_HOST;
    void *data = NULL;
    enum be_status st;
    if (device) {
        if ((st = dev_charge(be, charged)) == BE_OK && (st = be->ops->dev_alloc(be->ctx, charged, &data)) != BE_OK)
            uncharge(be, charged, true);
    } else {
        if ((st = be->ops->host_alloc(be->ctx, charged, &data)) == BE_OK)
            host_charge(be, charged);
    }
    if (st != BE_OK) {
        free(buf);
        return st;
    }
    *buf = (be_buffer){.be = be, .data = data, .size = size, .charged = charged, .device = device};
    *out = buf;
    return BE_OK;
}

enum be_status be_dev_alloc(be_backend *be, size_t size, be_buffer **out)
{
    return buffer_alloc(be, size, true, out);
}

enum be_status be_host_alloc(be_backend *be, size_t size, be_buffer **out)
{
    return buffer_alloc(be, size, false, out);
}

void be_buffer_free(be_buffer *buf)
{
    if (!buf)
        return;
    be_backend *be = buf->be;
    if (buf->device)
        be->ops->dev_free(be->ctx, buf->data, buf->charged);
    else
        be->ops->host_free(be->ctx, buf->data, buf->charged);
    uncharge(be, buf->charged, buf->device);
    free(buf);
}

void *be_buffer_data(const be_buffer *buf)
{
    return buf ? buf->data : NULL;
}

size_t be_buffer_size(const be_buffer *buf)
{
    return buf ? buf->size : 0;
}

struct be_mem_stats be_mem_stats(const be_backend *be)
{
    struct be_mem_stats s = {0};
    if (!be)
        return s;
    pthread_mutex_lock((pthread_mutex_t *)&be->lock);
    s = be->stats;
    pthread_mutex_unlock((pthread_mutex_t *)&be->lock);
    return s;
}

void be_reset_peak(be_backend *be)
{
    if (!be)
        return;
    pthread_mutex_lock(&be->lock);
    be->stats.dev_peak = be->stats.dev_used;
    be->stats.host_peak = be->stats.host_used;
    pthread_mutex_unlock(&be->lock);
}

void be_fault_dev_alloc(be_backend *be, uint64_t fail_at, bool repeat)
{
    if (!be)
        return;
    pthread_mutex_lock(&be->lock);
    be->fault_countdown = fail_at;
    be->fault_repeat = repeat;
    be->faulting = false;
    pthread_mutex_unlock(&be->lock);
}

/* ---- copies and events --------------------------------------------------- */

static bool copy_args_ok(const be_backend *be, void *dst, const void *src, size_t n, enum be_copy_dir dir)
{
    if (!be || (n && (!dst || !src)) || (dir != BE_H2D && dir != BE_D2H && dir != BE_D2D))
        return false;
    const char *d = dst, *s = src;
    return n == 0 || d + n <= s || s + n <= d;
}

enum be_status be_copy_async(be_backend *be, void *dst, const void *src, size_t n, enum be_copy_dir dir)
{
    if (!copy_args_ok(be, dst, src, n, dir))
        return BE_EINVAL;
    return n ? be->ops->copy_async(be->ctx, dst, src, n, dir) : BE_OK;
}

enum be_status be_copy(be_backend *be, void *dst, const void *src, size_t n, enum be_copy_dir dir)
{
    if (!copy_args_ok(be, dst, src, n, dir))
        return BE_EINVAL;
    return n ? be->ops->copy(be->ctx, dst, src, n, dir) : BE_OK;
}

enum be_status be_event_create(be_backend *be, be_event **out)
{
    if (!be || !out)
        return BE_EINVAL;
    *out = NULL;
    be_event *ev = malloc(sizeof(*ev));
    if (!ev)
        return BE_ENOMEM_HOST;
    ev->be = be;
    ev->stall_s = 0;
    enum be_status st = be->ops->event_create(be->ctx, &ev->h);
    if (st != BE_OK) {
        free(ev);
        return st;
    }
    *out = ev;
    return BE_OK;
}

void be_event_free(be_event *ev)
{
    if (!ev)
        return;
    ev->be->ops->event_free(ev->be->ctx, ev->h);
    free(ev);
}

enum be_status be_event_record(be_backend *be, be_event *ev)
{
    if (!be || !ev || ev->be != be)
        return BE_EINVAL;
    return be->ops->event_record(be->ctx, ev->h);
}

enum be_status be_event_wait(be_backend *be, be_event *ev)
{
    if (!be || !ev || ev->be != be)
        return BE_EINVAL;
    if (be->ops->event_wait)
        return be->ops->event_wait(be->ctx, ev->h);
    double t0 = clock_s();
    enum be_status st = be->ops->event_sync(be->ctx, ev->h);
    ev->stall_s += clock_s() - t0;
    return st;
}

enum be_status be_event_stall(be_event *ev, double *seconds)
{
    if (!ev || !seconds)
        return BE_EINVAL;
    const struct be_ops *o = ev->be->ops;
    if (o->event_stall)
        return o->event_stall(ev->be->ctx, ev->h, seconds);
    if (o->event_wait) /* a device that cannot time its waits */
        return BE_ENOTSUP;
    *seconds = ev->stall_s;
    ev->stall_s = 0;
    return BE_OK;
}

enum be_status be_event_sync(be_event *ev)
{
    if (!ev)
        return BE_EINVAL;
    return ev->be->ops->event_sync(ev->be->ctx, ev->h);
}

enum be_status be_event_elapsed(be_event *start, be_event *end, double *seconds)
{
    if (!start || !end || !seconds || start->be != end->be)
        return BE_EINVAL;
    be_backend *be = end->be;
    if (!be->ops->event_elapsed)
        return BE_ENOTSUP;
    enum be_status st = be->ops->event_sync(be->ctx, end->h);
    return st == BE_OK ? be->ops->event_elapsed(be->ctx, start->h, end->h, seconds) : st;
}

enum be_status be_sync(be_backend *be)
{
    if (!be)
        return BE_EINVAL;
    return be->ops->sync(be->ctx);
}

/* ---- kernels ------------------------------------------------------------ */

static bool dtype_ok(enum be_dtype dt)
{
    return dt == BE_F32 || dt == BE_F16 || dt == BE_BF16;
}

enum be_status be_matmul(be_backend *be, void *y, enum be_dtype yt, const void *x, const void *w, enum be_dtype wt,
                         const float *bias, int n, int in, int out)
{
    if (!be || !y || !x || !w || !dtype_ok(yt) || n < 0 || in <= 0 || out <= 0 ||
        !(dtype_ok(wt) || (wt == BE_Q8_0 && in % Q8_0_BLOCK == 0) || (wt == BE_Q4_K && in % Q4_K_BLOCK == 0)))
        return BE_EINVAL;
    return n ? be->ops->matmul(be->ctx, y, yt, x, w, wt, bias, n, in, out) : BE_OK;
}

enum be_status be_rmsnorm(be_backend *be, void *y, const void *x, const float *w, int n, int dim, float eps)
{
    if (!be || !y || !x || !w || n < 0 || dim <= 0 || !(eps >= 0.0f))
        return BE_EINVAL;
    return n ? be->ops->rmsnorm(be->ctx, y, x, w, n, dim, eps) : BE_OK;
}

enum be_status be_layernorm(be_backend *be, void *y, const void *x, const float *w, const float *b, int n, int dim,
                            float eps)
{
    if (!be || !y || !x || !w || !b || n < 0 || dim <= 0 || !(eps >= 0.0f))
        return BE_EINVAL;
    return n ? be->ops->layernorm(be->ctx, y, x, w, b, n, dim, eps) : BE_OK;
}

enum be_status be_rope(be_backend *be, void *x, int n_tok, int n_heads, int head_dim, const int64_t *pos,
                       const float *inv_freq, int rot_dim, float mscale, enum be_rope_layout layout)
{
    if (!be || !x || !pos || !inv_freq || n_tok < 0 || n_heads <= 0 || head_dim <= 0 || rot_dim <= 0 ||
        rot_dim % 2 || rot_dim > head_dim || !isfinite(mscale) ||
        (layout != BE_ROPE_NEOX && layout != BE_ROPE_INTERLEAVED))
        return BE_EINVAL;
    return n_tok ? be->ops->rope(be->ctx, x, n_tok, n_heads, head_dim, pos, inv_freq, rot_dim, mscale, layout)
                 : BE_OK;
}

static bool attn_params_ok(const struct be_attn_params *p)
{
    return p && p->n_heads > 0 && p->n_kv_heads > 0 && p->n_heads % p->n_kv_heads == 0 && p->head_dim > 0 &&
           p->window >= 0 && dtype_ok(p->kv_dtype) && p->softcap >= 0.0f && isfinite(p->softcap) &&
           p->rel_span >= 0 && (!p->rel_bias || p->rel_span > 0);
}

/* Every token names a view whose blocks cover [lo, hi) and, for a store,
 * its own position.  The views array has no length in the API, so a view
 * index is only checked for sign; the caller sizes the array. */
static bool toks_ok(const struct be_kv_view *views, const struct be_tok *toks, int n_tok, bool storing)
{
    for (int t = 0; t < n_tok; t++) {
        if (toks[t].view < 0)
            return false;
        const struct be_kv_view *v = &views[toks[t].view];
        if ((!v->blocks && v->n_blocks) || v->n_blocks < 0 || v->block_tokens <= 0)
            return false;
        int64_t end = v->base + (int64_t)v->n_blocks * v->block_tokens;
        if (v->lo > v->hi || v->lo < v->base || v->hi > end)
            return false;
        if (storing && (toks[t].pos < v->base || toks[t].pos >= end))
            return false;
        if (!storing && toks[t].pos < 0)
            return false;
        if (!v->key_rope && v->sinks)
            return false;
    }
    return true;
}

/* A view whose keys attention rotates: its sinks lie in sink_block, the
 * rest sit after them in the cache, and the table covers every index. */
static bool key_rope_ok(const struct be_kv_view *v, const struct be_attn_params *p)
{
    if (!v->key_rope)
        return true;
    if (!p->key_rope || (p->key_rope_layout != BE_ROPE_NEOX && p->key_rope_layout != BE_ROPE_INTERLEAVED) ||
        p->head_dim % 2 || v->sinks < 0 || v->sinks > v->block_tokens || (v->sinks && !v->sink_block) || v->shift < 0)
        return false;
    int64_t rows = v->hi - v->shift > v->sinks ? v->hi - v->shift : v->sinks;
    return (v->sinks == 0 || v->lo - v->shift >= v->sinks) && rows <= p->key_rope_rows;
}

enum be_status be_kv_store(be_backend *be, const struct be_kv_view *views, const struct be_tok *toks, int n_tok,
                           const void *k, const void *v, const struct be_attn_params *p)
{
    if (!be || !views || !toks || !k || !v || n_tok < 0 || !attn_params_ok(p) || !toks_ok(views, toks, n_tok, true))
        return BE_EINVAL;
    return n_tok ? be->ops->kv_store(be->ctx, views, toks, n_tok, k, v, p) : BE_OK;
}

enum be_status be_attention(be_backend *be, void *out, const void *q, const struct be_kv_view *views,
                            const struct be_tok *toks, int n_tok, const struct be_attn_params *p)
{
    if (!be || !out || !q || !views || !toks || n_tok < 0 || !attn_params_ok(p) ||
        !toks_ok(views, toks, n_tok, false))
        return BE_EINVAL;
    for (int t = 0; t < n_tok; t++)
        if (!key_rope_ok(&views[toks[t].view], p))
            return BE_EINVAL;
    return n_tok ? be->ops->attention(be->ctx, out, q, views, toks, n_tok, p) : BE_OK;
}

/* Quantized views: a format consistent with p, and the same
 * coverage rules as a be_kv_view for the quantized blocks and for the
 * full-precision rest that follows them. */
static bool kvq_half_ok(const struct be_kvq_format *f, const struct be_kvq_half *h)
{
    if (f->kind == BE_KVQ_E4M3)
        return true; /* no groups: one scale per tensor */
    /* per-channel: gt x 1; per-token: 1 x gd, each group's codes on whole bytes */
    if (h->gt > 1)
        return h->gd == 1 && f->block_tokens % h->gt == 0;
    return h->gt == 1 && h->gd > 0 && f->head_dim % h->gd == 0 && (h->gd * f->nbits) % 8 == 0;
}

/* A format whose groups tile its blocks. */
static bool kvq_format_ok(const struct be_kvq_format *f)
{
    return f->block_tokens > 0 && f->n_kv_heads > 0 && f->head_dim > 0 && f->nbits >= 1 && f->nbits <= 8 &&
           (f->head_dim * f->nbits) % 8 == 0 &&
           (f->kind == BE_KVQ_AFFINE_SHIFT || f->kind == BE_KVQ_AFFINE_ZERO || f->kind == BE_KVQ_E4M3) &&
           (f->kind != BE_KVQ_E4M3 || f->nbits == 8) && kvq_half_ok(f, &f->k) && kvq_half_ok(f, &f->v) &&
           !(f->k.gt > 1 && f->v.gt > 1 && f->k.gt != f->v.gt); /* a chunk of keys is one group row of each */
}

static bool kvq_view_ok(const struct be_kvq_view *v, const struct be_attn_params *p)
{
    const struct be_kvq_format *f = v->fmt;
    if (f && (f->n_kv_heads != p->n_kv_heads || f->head_dim != p->head_dim || !kvq_format_ok(f)))
        return false;
    if ((!v->blocks && v->n_blocks) || v->n_blocks < 0 || (!f && v->n_blocks))
        return false;
    /* no format: a dense sequence of a mixed batch, nothing quantized */
    int64_t end = f ? v->base + (int64_t)v->n_blocks * f->block_tokens : v->hi;
    if (v->lo > v->hi || v->lo < v->base || v->hi > end)
        return false;
    const struct be_kv_view *r = &v->rest;
    if (r->lo < v->hi || (r->lo > v->hi && v->lo != v->hi) || r->lo > r->hi || (!r->blocks && r->n_blocks) ||
        r->n_blocks < 0)
        return false;
    if (!r->key_rope && r->sinks)
        return false;
    /* the first position past the sinks that attention reads, for the
     * key_rope rules of a be_kv_view */
    struct be_kv_view first = *r;
    first.lo = v->lo < v->hi ? v->lo : r->lo;
    if (!key_rope_ok(&first, p))
        return false;
    return r->hi == r->lo || (r->block_tokens > 0 && r->lo >= r->base &&
                              r->hi <= r->base + (int64_t)r->n_blocks * r->block_tokens);
}

enum be_status be_attention_quant(be_backend *be, void *out, const void *q, const struct be_kvq_view *views,
                                  const struct be_tok *toks, int n_tok, const struct be_attn_params *p)
{
    if (!be || !out || !q || !views || !toks || n_tok < 0 || !attn_params_ok(p))
        return BE_EINVAL;
    for (int t = 0; t < n_tok; t++)
        if (toks[t].view < 0 || toks[t].pos < 0 || !kvq_view_ok(&views[toks[t].view], p))
            return BE_EINVAL;
    if (!be->ops->attention_quant)
        return BE_ENOTSUP;
    return n_tok ? be->ops->attention_quant(be->ctx, out, q, views, toks, n_tok, p) : BE_OK;
}

/* v's blocks hold every position of [p0, p1). */
static bool view_covers(const struct be_kv_view *v, int64_t p0, int64_t p1)
{
    return v && v->block_tokens > 0 && v->n_blocks >= 0 && (v->blocks || !v->n_blocks) && p0 <= p1 &&
           (p0 == p1 || (p0 >= v->base && p1 <= v->base + (int64_t)v->n_blocks * v->block_tokens));
}

enum be_status be_kvq_quantize(be_backend *be, const struct be_kvq_view *v, int64_t end)
{
    if (!be || !v || !v->fmt || !kvq_format_ok(v->fmt) || v->lo > v->hi || v->hi > end || v->n_blocks < 0 ||
        (!v->blocks && v->n_blocks) || !view_covers(&v->rest, v->hi, end))
        return BE_EINVAL;
    int64_t T = v->fmt->block_tokens;
    /* the blocks from the one holding hi (a reopened group row starts in it) to end's */
    if (v->hi < end && (v->base % T || v->hi / T * T < v->base || (end - 1 - v->base) / T >= v->n_blocks))
        return BE_EINVAL;
    if (!be->ops->kvq_quantize)
        return BE_ENOTSUP;
    return v->hi < end ? be->ops->kvq_quantize(be->ctx, v, end) : BE_OK;
}

enum be_status be_kvq_dequantize(be_backend *be, const struct be_kvq_view *v, int64_t p0, int64_t p1,
                                 const struct be_kv_view *dst)
{
    if (!be || !v || !v->fmt || !kvq_format_ok(v->fmt) || v->n_blocks < 0 || (!v->blocks && v->n_blocks) ||
        p0 < v->lo || p0 > p1 || p1 > v->hi || !view_covers(dst, p0, p1))
        return BE_EINVAL;
    int64_t T = v->fmt->block_tokens;
    if (p0 < p1 && (v->base % T || p0 < v->base || (p1 - 1 - v->base) / T >= v->n_blocks))
        return BE_EINVAL;
    if (!be->ops->kvq_dequantize)
        return BE_ENOTSUP;
    return p0 < p1 ? be->ops->kvq_dequantize(be->ctx, v, p0, p1, dst) : BE_OK;
}

enum be_status be_kv_absmax(be_backend *be, const struct be_kv_view *v, enum be_dtype dt, int n_kv_heads,
                            int head_dim, int64_t p0, int64_t p1, float amax[2])
{
    if (!be || !amax || n_kv_heads <= 0 || head_dim <= 0 || !be_dtype_size(dt) || !view_covers(v, p0, p1))
        return BE_EINVAL;
    if (!be->ops->kv_absmax)
        return BE_ENOTSUP;
    amax[0] = amax[1] = 0.0f;
    return p0 < p1 ? be->ops->kv_absmax(be->ctx, v, dt, n_kv_heads, head_dim, p0, p1, amax) : BE_OK;
}

enum be_status be_kv_copy(be_backend *be, const struct be_kv_view *dst, const struct be_kv_view *src, int64_t p0,
                          int64_t p1, const struct be_attn_params *p)
{
    if (!be || !attn_params_ok(p) || !view_covers(dst, p0, p1) || !view_covers(src, p0, p1))
        return BE_EINVAL;
    if (!be->ops->kv_copy)
        return BE_ENOTSUP;
    return p0 < p1 ? be->ops->kv_copy(be->ctx, dst, src, p0, p1, p) : BE_OK;
}

size_t be_ssm_state_bytes(int d_inner, int d_state, int d_conv)
{
    if (d_inner <= 0 || d_inner > (1 << 20) || d_state <= 0 || d_state > BE_SSM_MAX_STATE || d_conv <= 0 ||
        d_conv > BE_SSM_MAX_CONV)
        return 0;
    return ((size_t)(d_conv - 1) + (size_t)d_state) * (size_t)d_inner * sizeof(float);
}

/* The views of toks: each row names one, and a view's rows are
 * consecutive (a scan runs through them in order). */
static bool ssm_args_ok(const struct be_ssm_view *views, const struct be_tok *toks, int n_tok,
                        const struct be_ssm_params *p)
{
    if (!views || !toks || n_tok < 0 || !p || !be_ssm_state_bytes(p->d_inner, p->d_state, p->d_conv) || !p->conv_w ||
        !p->A || !p->D)
        return false;
    for (int t = 0; t < n_tok; t++) {
        int v = toks[t].view;
        if (v < 0 || (t > 0 && v != toks[t - 1].view && v != toks[t - 1].view + 1) || (t == 0 && v != 0) ||
            !views[v].in || !views[v].out)
            return false;
    }
    return true;
}

enum be_status be_ssm_conv(be_backend *be, void *y, const void *x, const struct be_ssm_view *views,
                           const struct be_tok *toks, int n_tok, const struct be_ssm_params *p)
{
    if (!be || !y || !x || !ssm_args_ok(views, toks, n_tok, p))
        return BE_EINVAL;
    if (!be->ops->ssm_conv)
        return BE_ENOTSUP;
    return n_tok ? be->ops->ssm_conv(be->ctx, y, x, views, toks, n_tok, p) : BE_OK;
}

enum be_status be_ssm_scan(be_backend *be, void *y, const void *x, const void *dt_raw, const void *B, const void *C,
                           const void *z, const struct be_ssm_view *views, const struct be_tok *toks, int n_tok,
                           const struct be_ssm_params *p)
{
    if (!be || !y || !x || !dt_raw || !B || !C || !z || !ssm_args_ok(views, toks, n_tok, p))
        return BE_EINVAL;
    if (!be->ops->ssm_scan)
        return BE_ENOTSUP;
    return n_tok ? be->ops->ssm_scan(be->ctx, y, x, dt_raw, B, C, z, views, toks, n_tok, p) : BE_OK;
}

enum be_status be_silu_mul(be_backend *be, void *y, const void *gate, const void *up, size_t n)
{
    if (!be || !y || !gate || !up)
        return BE_EINVAL;
    return n ? be->ops->silu_mul(be->ctx, y, gate, up, n) : BE_OK;
}

enum be_status be_gelu_mul(be_backend *be, void *y, const void *gate, const void *up, size_t n)
{
    if (!be || !y || !gate)
        return BE_EINVAL;
    return n ? be->ops->gelu_mul(be->ctx, y, gate, up, n) : BE_OK;
}

enum be_status be_act(be_backend *be, void *x, size_t n, enum be_act act)
{
    if (!be || !x || (act != BE_ACT_RELU && act != BE_ACT_GELU_ERF))
        return BE_EINVAL;
    if (!be->ops->act)
        return BE_ENOTSUP;
    return n ? be->ops->act(be->ctx, x, n, act) : BE_OK;
}

enum be_status be_scale(be_backend *be, void *x, size_t n, float s)
{
    if (!be || !x || !isfinite(s))
        return BE_EINVAL;
    return n ? be->ops->scale(be->ctx, x, n, s) : BE_OK;
}

enum be_status be_add(be_backend *be, void *y, const void *x, size_t n)
{
    if (!be || !y || !x)
        return BE_EINVAL;
    return n ? be->ops->add(be->ctx, y, x, n) : BE_OK;
}

enum be_status be_softmax(be_backend *be, void *x, int rows, int cols)
{
    if (!be || !x || rows < 0 || cols <= 0)
        return BE_EINVAL;
    return rows ? be->ops->softmax(be->ctx, x, rows, cols) : BE_OK;
}

enum be_status be_embed(be_backend *be, void *y, const void *table, enum be_dtype dt, const int32_t *ids, int n,
                        int dim)
{
    if (!be || !y || !table || !ids || !dtype_ok(dt) || n < 0 || dim <= 0)
        return BE_EINVAL;
    for (int t = 0; t < n; t++)
        if (ids[t] < 0)
            return BE_EINVAL;
    return n ? be->ops->embed(be->ctx, y, table, dt, ids, n, dim) : BE_OK;
}

enum be_status be_argmax(be_backend *be, const void *x, int rows, int cols, int32_t *out)
{
    if (!be || !x || !out || rows < 0 || cols <= 0)
        return BE_EINVAL;
    return rows ? be->ops->argmax(be->ctx, x, rows, cols, out) : BE_OK;
}
