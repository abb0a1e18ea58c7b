/* cuda.cu - the CUDA backend plugin: its life cycle, device memory, copy
 * streams and events, and the be_ops table (the kernels are in kernels.cu
 * and attention.cu).  be_open("cuda") loads this file's library with
 * dlopen and calls kvtier_backend_init; the core never links CUDA.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "backend/cuda/cuda.h"

#include <hwloc/cudart.h>

/* Left free by the default budget: cuBLAS's workspace, the scratch of the
 * ops (a prefill's converted operands and attention partials), the
 * metadata buffers and the context's own growth. */
#define RESERVE_MIN ((size_t)1 << 30)
#define RESERVE_FRACTION 20 /* and 1/20 of what is free */
#define BLAS_WORKSPACE ((size_t)32 << 20)
#define META_HALF_MIN ((size_t)1 << 20)

/* Why the last init failed, for be_open_error(). */
static char init_error[512];

extern "C" __attribute__((visibility("default"))) const char *kvtier_backend_error(void)
{
    return init_error;
}

/* ---- errors --------------------------------------------------------------- */

static bool sticky(cudaError_t e)
{
    switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
    case cudaErrorContextIsDestroyed:
    case cudaErrorUnknown:
        return true;
    default:
        return false;
    }
}

enum be_status cu_check(struct cu_ctx *c, cudaError_t e, const char *op)
{
    if (e == cudaSuccess)
        return BE_OK;
    if (e == cudaErrorMemoryAllocation) {
        cudaGetLastError(); /* not sticky: clear it */
        return BE_ENOMEM_DEV;
    }
    if (sticky(e)) {
        if (!c->dead)
            fprintf(stderr, "kvtier: cuda: fatal: %s: %s (%s); the device context is lost, every later op fails\n",
                    op, cudaGetErrorName(e), cudaGetErrorString(e));
        c->dead = true;
        return BE_EIO;
    }
    cudaGetLastError();
    fprintf(stderr, "kvtier: cuda: %s: %s (%s)\n", op, cudaGetErrorName(e), cudaGetErrorString(e));
    return BE_EIO;
}

enum be_status cu_blas_check(struct cu_ctx *c, cublasStatus_t s, const char *op)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return BE_OK;
    if (s == CUBLAS_STATUS_ALLOC_FAILED)
        return BE_ENOMEM_DEV;
    /* cuBLAS reports a kernel fault as an execution failure: the runtime
     * knows whether it was sticky */
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return cu_check(c, e, op);
    fprintf(stderr, "kvtier: cuda: %s: %s\n", op, cublasGetStatusString(s));
    return BE_EIO;
}

enum be_status cu_enter(struct cu_ctx *c, const char *op)
{
    if (c->dead)
        return BE_EIO;
    return cu_check(c, cudaSetDevice(c->dev), op);
}

enum be_status cu_leave(struct cu_ctx *c, const char *op)
{
    BE_TRY(cu_check(c, cudaGetLastError(), op));
    return c->sync_each ? cu_check(c, cudaStreamSynchronize(c->compute), op) : BE_OK;
}

/* ---- scratch and metadata ---------------------------------------------------- */

enum be_status cu_scratch(struct cu_ctx *c, size_t bytes, void **out)
{
    if (bytes > c->scratch_size) {
        /* the old scratch may still be read by queued kernels */
        CU_TRY(c, cudaStreamSynchronize(c->compute), "scratch");
        cudaFree(c->scratch);
        c->scratch = NULL;
        c->scratch_size = 0;
        size_t size = bytes < ((size_t)1 << 20) ? (size_t)1 << 20 : bytes + bytes / 4;
        CU_TRY(c, cudaMalloc(&c->scratch, size), "scratch");
        c->scratch_size = size;
    }
    *out = c->scratch;
    return BE_OK;
}

static void meta_release(struct cu_ctx *c)
{
    cudaFreeHost(c->meta_host);
    cudaFree(c->meta_dev);
    c->meta_host = c->meta_dev = NULL;
    c->meta_half = c->meta_used = 0;
}

static enum be_status meta_alloc(struct cu_ctx *c, size_t half)
{
    CU_TRY(c, cudaMallocHost(&c->meta_host, 2 * half), "metadata");
    CU_TRY(c, cudaMalloc(&c->meta_dev, 2 * half), "metadata");
    c->meta_half = half;
    c->meta_used = 0;
    c->meta_side = 0;
    return BE_OK;
}

enum be_status cu_meta_ensure(struct cu_ctx *c, size_t bytes)
{
    if (bytes <= c->meta_half)
        return BE_OK;
    /* a batch larger than any before: both halves anew, once the device
     * has copied out of the old ones */
    CU_TRY(c, cudaStreamSynchronize(c->compute), "metadata");
    meta_release(c);
    return meta_alloc(c, bytes * 2);
}

enum be_status cu_meta_reserve(struct cu_ctx *c, size_t bytes, char **host, char **dev)
{
    bytes = cu_meta_size(bytes);
    if (bytes > c->meta_half) {
        BE_TRY(cu_meta_ensure(c, bytes));
    } else if (c->meta_used + bytes > c->meta_half) {
        CU_TRY(c, cudaEventRecord(c->meta_left[c->meta_side], c->compute), "metadata");
        c->meta_side ^= 1;
        CU_TRY(c, cudaEventSynchronize(c->meta_left[c->meta_side]), "metadata");
        c->meta_used = 0;
    }
    size_t off = (size_t)c->meta_side * c->meta_half + c->meta_used;
    c->meta_used += bytes;
    *host = c->meta_host + off;
    *dev = c->meta_dev + off;
    return BE_OK;
}

enum be_status cu_meta_upload(struct cu_ctx *c, const char *host, const char *dev, size_t bytes)
{
    return cu_check(c, cudaMemcpyAsync((void *)dev, host, bytes, cudaMemcpyHostToDevice, c->compute), "metadata");
}

/* View i of a strided array: a plain one, or a be_kvq_view array's rests. */
static const struct be_kv_view *view_at(const struct be_kv_view *first, size_t stride, int i)
{
    return (const struct be_kv_view *)((const char *)first + (size_t)i * stride);
}

size_t cu_views_bytes_at(const struct be_kv_view *first, size_t stride, int n_views, int n_tok)
{
    size_t n_ptrs = 0;
    for (int i = 0; i < n_views; i++)
        n_ptrs += (size_t)view_at(first, stride, i)->n_blocks;
    return (size_t)n_views * sizeof(struct cu_view) + (size_t)n_tok * sizeof(struct be_tok) + n_ptrs * sizeof(void *);
}

enum be_status cu_upload_views_at(struct cu_ctx *c, const struct be_kv_view *first, size_t stride, int n_views,
                                  const struct be_tok *toks, int n_tok, const struct cu_view **dviews,
                                  const struct be_tok **dtoks)
{
    size_t vb = (size_t)n_views * sizeof(struct cu_view), tb = (size_t)n_tok * sizeof(struct be_tok);
    size_t bytes = cu_views_bytes_at(first, stride, n_views, n_tok);
    char *h, *d;
    BE_TRY(cu_meta_reserve(c, bytes, &h, &d));
    /* [views][toks][block tables] */
    struct cu_view *hv = (struct cu_view *)h;
    if (tb)
        memcpy(h + vb, toks, tb);
    size_t ptr_off = vb + tb;
    for (int i = 0; i < n_views; i++) {
        const struct be_kv_view *v = view_at(first, stride, i);
        if (v->n_blocks)
            memcpy(h + ptr_off, v->blocks, (size_t)v->n_blocks * sizeof(void *));
        hv[i] = (struct cu_view){
            .blocks = (const char *const *)(d + ptr_off),
            .sink_block = (const char *)v->sink_block,
            .base = v->base,
            .lo = v->lo,
            .hi = v->hi,
            .shift = v->shift,
            .v_offset = v->v_offset,
            .n_blocks = v->n_blocks,
            .block_tokens = v->block_tokens,
            .window = v->window,
            .sinks = v->sinks,
            .key_rope = v->key_rope,
        };
        ptr_off += (size_t)v->n_blocks * sizeof(void *);
    }
    *dviews = (const struct cu_view *)d;
    if (dtoks)
        *dtoks = (const struct be_tok *)(d + vb);
    return cu_meta_upload(c, h, d, bytes);
}

/* ---- memory --------------------------------------------------------------- */

static enum be_status cu_dev_alloc(void *ctx, size_t size, void **ptr)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    size_t off;
    pthread_mutex_lock(&c->mu);
    enum be_status st = be_arena_take(&c->carve, size, &off);
    pthread_mutex_unlock(&c->mu);
    if (st == BE_OK)
        *ptr = c->arena + off;
    return st;
}

/* Stream-ordered reuse: a later user of the bytes is a kernel or a copy
 * that waits for the compute stream, which runs after the kernels that
 * read them before. */
static void cu_dev_free(void *ctx, void *ptr, size_t size)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    pthread_mutex_lock(&c->mu);
    be_arena_give(&c->carve, (size_t)((char *)ptr - c->arena), size);
    pthread_mutex_unlock(&c->mu);
}

/* Page-locked, so the copy streams' DMA runs at the bus's speed, and on
 * the NUMA nodes nearest the GPU, so it does not cross the socket link:
 * whole pages of their own, bound with hwloc before they are touched,
 * then registered.  Where binding fails the pages go where they are first
 * touched (said once); where registering fails, cudaHostAlloc. */
static enum be_status cu_host_alloc(void *ctx, size_t size, void **ptr)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    if (c->dead || cudaSetDevice(c->dev) != cudaSuccess)
        return BE_EIO;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) {
        if (c->topo &&
            hwloc_set_area_membind(c->topo, p, size, c->near, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET) != 0 &&
            !c->bind_warned) {
            c->bind_warned = true;
            fprintf(stderr, "kvtier: cuda: binding host buffers to the GPU's NUMA node failed (%s); pages go where "
                            "they are first touched\n", strerror(errno));
        }
        if (cudaHostRegister(p, size, cudaHostRegisterPortable) == cudaSuccess) {
            *ptr = p;
            return BE_OK;
        }
        cudaGetLastError();
        munmap(p, size);
    }
    if (cudaHostAlloc(ptr, size, cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError();
        return BE_ENOMEM_HOST;
    }
    return BE_OK;
}

/* A registered mapping, or else cudaHostAlloc's. */
static void cu_host_free(void *ctx, void *ptr, size_t size)
{
    (void)ctx;
    if (cudaHostUnregister(ptr) == cudaSuccess) {
        munmap(ptr, size);
        return;
    }
    cudaGetLastError();
    cudaFreeHost(ptr);
}

/* ---- copies and events ------------------------------------------------------ */

/* A copy queued now must see what the kernels queued before it wrote, as
 * on the CPU backend, where they ran before the call returned. */
static enum be_status cu_copy_async(void *ctx, void *dst, const void *src, size_t n, enum be_copy_dir dir)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    (void)dir;
    BE_TRY(cu_enter(c, "copy_async"));
    CU_TRY(c, cudaEventRecord(c->order, c->compute), "copy_async");
    CU_TRY(c, cudaStreamWaitEvent(c->copy, c->order, 0), "copy_async");
    return cu_check(c, cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, c->copy), "copy_async");
}

/* On the compute stream, so it follows the kernels before it; a copy that
 * involves the host returns when it is done. */
static enum be_status cu_copy(void *ctx, void *dst, const void *src, size_t n, enum be_copy_dir dir)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "copy"));
    CU_TRY(c, cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, c->compute), "copy");
    return dir == BE_D2D ? BE_OK : cu_check(c, cudaStreamSynchronize(c->compute), "copy");
}

/* An event marks the copy stream: a fence for every copy queued before.
 * A wait on it is bracketed by two events on the compute stream, whose
 * interval is the time the compute stream stood still there (the host
 * only queued the wait), summed in stall_s for be_event_stall. */
struct cu_event {
    cudaEvent_t e, before, after;
    bool recorded, waited;
    double stall_s;
};

static enum be_status cu_event_create(void *ctx, void **ev)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "event_create"));
    struct cu_event *e = (struct cu_event *)calloc(1, sizeof(*e));
    if (!e)
        return BE_ENOMEM_HOST;
    enum be_status st = cu_check(c, cudaEventCreate(&e->e), "event_create");
    if (st == BE_OK && (st = cu_check(c, cudaEventCreate(&e->before), "event_create")) != BE_OK)
        cudaEventDestroy(e->e);
    if (st == BE_OK && (st = cu_check(c, cudaEventCreate(&e->after), "event_create")) != BE_OK) {
        cudaEventDestroy(e->e);
        cudaEventDestroy(e->before);
    }
    if (st != BE_OK) {
        free(e);
        return st;
    }
    *ev = e;
    return BE_OK;
}

static void cu_event_free(void *ctx, void *ev)
{
    (void)ctx;
    struct cu_event *e = (struct cu_event *)ev;
    cudaEventDestroy(e->e);
    cudaEventDestroy(e->before);
    cudaEventDestroy(e->after);
    free(e);
}

static enum be_status cu_event_record(void *ctx, void *ev)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    struct cu_event *e = (struct cu_event *)ev;
    BE_TRY(cu_enter(c, "event_record"));
    CU_TRY(c, cudaEventRecord(e->e, c->copy), "event_record");
    e->recorded = true;
    return BE_OK;
}

/* Adds the last wait's interval to stall_s, before its events are reused
 * (it waits for the compute stream to pass that wait). */
static enum be_status take_stall(struct cu_ctx *c, struct cu_event *e)
{
    if (!e->waited)
        return BE_OK;
    float ms;
    CU_TRY(c, cudaEventSynchronize(e->after), "event_stall");
    CU_TRY(c, cudaEventElapsedTime(&ms, e->before, e->after), "event_stall");
    e->stall_s += ms > 0 ? ms / 1e3 : 0.0;
    e->waited = false;
    return BE_OK;
}

static enum be_status cu_event_wait(void *ctx, void *ev)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    struct cu_event *e = (struct cu_event *)ev;
    BE_TRY(cu_enter(c, "event_wait"));
    if (!e->recorded)
        return BE_OK;
    BE_TRY(take_stall(c, e));
    CU_TRY(c, cudaEventRecord(e->before, c->compute), "event_wait");
    CU_TRY(c, cudaStreamWaitEvent(c->compute, e->e, 0), "event_wait");
    CU_TRY(c, cudaEventRecord(e->after, c->compute), "event_wait");
    e->waited = true;
    return BE_OK;
}

static enum be_status cu_event_stall(void *ctx, void *ev, double *seconds)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    struct cu_event *e = (struct cu_event *)ev;
    BE_TRY(cu_enter(c, "event_stall"));
    BE_TRY(take_stall(c, e));
    *seconds = e->stall_s;
    e->stall_s = 0;
    return BE_OK;
}

static enum be_status cu_event_sync(void *ctx, void *ev)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    struct cu_event *e = (struct cu_event *)ev;
    BE_TRY(cu_enter(c, "event_sync"));
    if (!e->recorded)
        return BE_OK;
    return cu_check(c, cudaEventSynchronize(e->e), "event_sync");
}

static enum be_status cu_event_elapsed(void *ctx, void *start, void *end, double *seconds)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    struct cu_event *a = (struct cu_event *)start, *b = (struct cu_event *)end;
    if (!a->recorded || !b->recorded)
        return BE_EINVAL;
    float ms;
    CU_TRY(c, cudaEventElapsedTime(&ms, a->e, b->e), "event_elapsed");
    *seconds = ms > 0 ? ms / 1e3 : 0.0;
    return BE_OK;
}

static enum be_status cu_sync(void *ctx)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "sync"));
    CU_TRY(c, cudaStreamSynchronize(c->copy), "sync");
    return cu_check(c, cudaStreamSynchronize(c->compute), "sync");
}

/* ---- life cycle --------------------------------------------------------------- */

static struct be_caps cu_caps(void *ctx)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    struct be_caps caps = {};
    caps.name = "cuda";
    caps.async_copy = true;
    caps.pinned_host = true;
    caps.unified_memory = false; /* weights are uploaded through the seam */
    caps.n_threads = 1;
    caps.simd = "cuda";
    caps.act_dtype = c->act;
    caps.dedicated_memory = true;
    return caps;
}

/* Also unwinds a context init built only partly (its fields zeroed). */
static void cu_free(void *ctx)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    cudaSetDevice(c->dev);
    if (!c->dead && c->compute)
        cudaDeviceSynchronize();
    if (c->blas)
        cublasDestroy(c->blas);
    cudaFree(c->blas_ws);
    cudaFree(c->scratch);
    meta_release(c);
    for (int i = 0; i < 2; i++)
        if (c->meta_left[i])
            cudaEventDestroy(c->meta_left[i]);
    if (c->order)
        cudaEventDestroy(c->order);
    cudaStream_t *streams[] = {&c->compute, &c->copy};
    for (int i = 0; i < 2; i++)
        if (*streams[i])
            cudaStreamDestroy(*streams[i]);
    cudaFree(c->arena);
    be_arena_release(&c->carve);
    if (c->topo)
        hwloc_topology_destroy(c->topo);
    hwloc_bitmap_free(c->near);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static const struct be_ops cu_ops = {
    .api_version = BE_API_VERSION,
    .name = "cuda",
    .free = cu_free,
    .caps = cu_caps,
    .dev_alloc = cu_dev_alloc,
    .dev_free = cu_dev_free,
    .host_alloc = cu_host_alloc,
    .host_free = cu_host_free,
    .copy_async = cu_copy_async,
    .copy = cu_copy,
    .event_create = cu_event_create,
    .event_free = cu_event_free,
    .event_record = cu_event_record,
    .event_wait = cu_event_wait,
    .event_sync = cu_event_sync,
    .event_elapsed = cu_event_elapsed,
    .event_stall = cu_event_stall,
    .sync = cu_sync,
    .matmul = cu_matmul,
    .rmsnorm = cu_rmsnorm,
    .rope = cu_rope,
    .kv_store = cu_kv_store,
    .attention = cu_attention,
    .silu_mul = cu_silu_mul,
    .gelu_mul = cu_gelu_mul,
    .scale = cu_scale,
    .act = cu_act,
    .layernorm = cu_layernorm,
    .add = cu_add,
    .softmax = cu_softmax,
    .embed = cu_embed,
    .argmax = cu_argmax,
    .attention_quant = cu_attention_quant,
    .kvq_quantize = cu_kvq_quantize,
    .kvq_dequantize = cu_kvq_dequantize,
    .kv_absmax = cu_kv_absmax,
    .ssm_conv = cu_ssm_conv,
    .ssm_scan = cu_ssm_scan,
    .kv_copy = cu_kv_copy,
};

static enum be_status fail(enum be_status st, const char *fmt, const char *a, const char *b)
{
    snprintf(init_error, sizeof(init_error), fmt, a, b);
    return st;
}

/* The device and the activation type, before anything is allocated: a
 * machine without a GPU or driver ends here, with the runtime's reason. */
static enum be_status pick_device(const struct be_params *p, struct cu_ctx *c)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
        return fail(BE_ENODEV, "no CUDA device (cudaGetDeviceCount: %s: %s)", cudaGetErrorName(e),
                    cudaGetErrorString(e));
    if (n == 0)
        return fail(BE_ENODEV, "no CUDA device (%s%s)", "the driver reports none", "");
    char idx[32];
    snprintf(idx, sizeof(idx), "%d", p->device_index);
    if (p->device_index >= n)
        return fail(BE_ENODEV, "no CUDA device (device %s requested, %s present)", idx,
                    n == 1 ? "one" : "fewer");
    c->dev = p->device_index;
    cudaDeviceProp prop;
    if ((e = cudaSetDevice(c->dev)) != cudaSuccess || (e = cudaGetDeviceProperties(&prop, c->dev)) != cudaSuccess)
        return fail(BE_ENODEV, "no CUDA device (%s: %s)", cudaGetErrorName(e), cudaGetErrorString(e));
    snprintf(c->name, sizeof(c->name), "%s", prop.name);
    c->cc_major = prop.major;
    c->cc_minor = prop.minor;
    if (prop.major < 8) { /* bf16 compute, and the oldest code the plugin is built for */
        char cc[16];
        snprintf(cc, sizeof(cc), "%d.%d", prop.major, prop.minor);
        return fail(BE_ENODEV, "no CUDA device (%s has compute capability %s; 8.0 or newer is needed)", prop.name,
                    cc);
    }
    const char *act = getenv("KVTIER_CUDA_ACT");
    if (!act || !*act || strcmp(act, "bf16") == 0)
        c->act = BE_BF16;
    else if (strcmp(act, "f32") == 0)
        c->act = BE_F32;
    else
        return fail(BE_EINVAL, "KVTIER_CUDA_ACT=%s: expected bf16 or f32%s", act, "");
    const char *sync = getenv("KVTIER_CUDA_SYNC");
    c->sync_each = sync && strcmp(sync, "1") == 0;
    return BE_OK;
}

/* params->device_mem, or what is free less the reserve (said on stderr:
 * it decides how much KV stays on the device). */
static enum be_status pick_budget(const struct be_params *p, struct cu_ctx *c, size_t *budget)
{
    size_t free_b = 0, total_b = 0;
    cudaError_t e = cudaMemGetInfo(&free_b, &total_b);
    if (e != cudaSuccess)
        return fail(BE_EIO, "cudaMemGetInfo: %s: %s", cudaGetErrorName(e), cudaGetErrorString(e));
    if (p->device_mem) {
        *budget = p->device_mem;
        return BE_OK;
    }
    size_t reserve = RESERVE_MIN + free_b / RESERVE_FRACTION;
    *budget = free_b > 2 * reserve ? free_b - reserve : free_b / 2;
    *budget &= ~(size_t)(BE_ALIGN - 1);
    fprintf(stderr, "kvtier: cuda: %s (sm_%d%d): %.0f MiB free of %.0f; device pool %.0f MiB, %.0f MiB left for "
            "cuBLAS workspaces and activation scratch (--device-mem overrides)\n", c->name, c->cc_major, c->cc_minor,
            free_b / 1048576.0, total_b / 1048576.0, *budget / 1048576.0, (free_b - *budget) / 1048576.0);
    return BE_OK;
}

/* The NUMA nodes of the CPUs next to the GPU (its PCI device's local_cpus);
 * without hwloc's answer the host buffers are left unbound. */
static void load_topology(struct cu_ctx *c)
{
    hwloc_bitmap_t cpus = hwloc_bitmap_alloc();
    c->near = hwloc_bitmap_alloc();
    if (!cpus || !c->near || hwloc_topology_init(&c->topo) != 0) {
        c->topo = NULL;
    } else if (hwloc_topology_load(c->topo) != 0 || hwloc_cudart_get_device_cpuset(c->topo, c->dev, cpus) != 0) {
        hwloc_topology_destroy(c->topo);
        c->topo = NULL;
    } else {
        hwloc_cpuset_to_nodeset(c->topo, cpus, c->near);
    }
    hwloc_bitmap_free(cpus);
}

static enum be_status setup(const struct be_params *p, struct cu_ctx *c, size_t *budget)
{
    BE_TRY(pick_device(p, c));
    load_topology(c);
    BE_TRY(pick_budget(p, c, budget));
    size_t arena = (*budget + 4095) & ~(size_t)4095;
    cudaError_t e = cudaMalloc(&c->arena, arena);
    if (e != cudaSuccess) {
        cudaGetLastError();
        c->arena = NULL;
        char mib[32];
        snprintf(mib, sizeof(mib), "%.0f", arena / 1048576.0);
        return fail(BE_ENOMEM_DEV, "cudaMalloc of the %s MiB device pool: %s", mib, cudaGetErrorString(e));
    }
    if (be_arena_init(&c->carve, arena) != BE_OK)
        return BE_ENOMEM_HOST;
    const char *op = "init";
    CU_TRY(c, cudaStreamCreateWithFlags(&c->compute, cudaStreamNonBlocking), op);
    CU_TRY(c, cudaStreamCreateWithFlags(&c->copy, cudaStreamNonBlocking), op);
    CU_TRY(c, cudaEventCreateWithFlags(&c->order, cudaEventDisableTiming), op);
    for (int i = 0; i < 2; i++)
        CU_TRY(c, cudaEventCreateWithFlags(&c->meta_left[i], cudaEventDisableTiming), op);
    BE_TRY(meta_alloc(c, META_HALF_MIN));
    BE_TRY(cu_blas_check(c, cublasCreate(&c->blas), op));
    BE_TRY(cu_blas_check(c, cublasSetStream(c->blas, c->compute), op));
    CU_TRY(c, cudaMalloc(&c->blas_ws, BLAS_WORKSPACE), op);
    return cu_blas_check(c, cublasSetWorkspace(c->blas, c->blas_ws, BLAS_WORKSPACE), op);
}

extern "C" __attribute__((visibility("default"))) const struct be_ops *kvtier_backend_ops(void)
{
    return &cu_ops;
}

extern "C" __attribute__((visibility("default"))) enum be_status
kvtier_backend_init(const struct be_params *p, const struct be_ops **ops, void **ctx, size_t *dev_budget)
{
    init_error[0] = '\0';
    struct cu_ctx *c = (struct cu_ctx *)calloc(1, sizeof(*c));
    if (!c)
        return BE_ENOMEM_HOST;
    pthread_mutex_init(&c->mu, NULL);
    size_t budget = 0;
    enum be_status st = setup(p, c, &budget);
    if (st != BE_OK) {
        if (!init_error[0])
            snprintf(init_error, sizeof(init_error), "cuda: %s", st == BE_ENOMEM_DEV ? "out of device memory"
                                                                                      : "initialisation failed");
        cu_free(c);
        return st;
    }
    *ops = &cu_ops;
    *ctx = c;
    *dev_budget = budget;
    return BE_OK;
}
