/* cuda.h - internals of the CUDA backend plugin (libkvtier-cuda.so) shared
 * by its files: the context, error handling, scratch and the metadata
 * upload, the kernel launchers.
 *
 * The plugin fills the same be_ops table as the CPU backend (cuda.cu) and
 * gets the same guarantees from backend.c: arguments were validated, the
 * device budget was charged before dev_alloc is asked.  Device memory is
 * one cudaMalloc arena carved first-fit (backend/arena.h); what the ops
 * need besides (cuBLAS workspace, converted operands, attention partials,
 * uploaded host metadata) comes from scratch outside the budget, the
 * reserve the default budget leaves.
 *
 * Element types are passed to the kernels as values (enum be_dtype) and
 * converted on load and store (ld/st below): activations are f32 or bf16
 * (KVTIER_CUDA_ACT), the KV blocks and weights f32, f16 or bf16, and every
 * sum is accumulated in f32.
 */
#ifndef KVTIER_CUDA_H
#define KVTIER_CUDA_H

#include <hwloc.h>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "backend/arena.h"
#include "backend/backend_impl.h"
}

struct cu_ctx {
    int dev;
    char name[256];                 /* the device, as the driver names it */
    int cc_major, cc_minor;
    enum be_dtype act;              /* BE_BF16 (default) or BE_F32 */
    bool sync_each;                 /* KVTIER_CUDA_SYNC=1: every op waits for its kernels */
    bool dead;                      /* a sticky error: every later op fails */

    /* kernels; copies, both directions in one stream: the store relies on
     * copies landing in the order they were queued (a slot's write-back is
     * read before the next layer's copy-in overwrites it), as backend.h
     * promises */
    cudaStream_t compute, copy;
    cudaEvent_t order;              /* the compute stream's tail, which copies wait for */
    cublasHandle_t blas;
    void *blas_ws;                  /* cuBLAS workspace */

    pthread_mutex_t mu;             /* guards the arena: buffers are freed from any thread */
    char *arena;
    struct be_arena carve;

    hwloc_topology_t topo;          /* NULL: host buffers are not bound */
    hwloc_nodeset_t near;           /* the NUMA nodes nearest the GPU */
    bool bind_warned;

    void *scratch;                  /* device scratch, grown on demand, compute-stream ordered */
    size_t scratch_size;

    /* Host metadata (views, block tables, positions, ids) goes up through
     * a pinned buffer in two halves: while the device copies out of one,
     * the host fills the other; entering a half waits for the event
     * recorded when it was last left. */
    char *meta_host, *meta_dev;
    size_t meta_half, meta_used;
    int meta_side;
    cudaEvent_t meta_left[2];
};

/* ---- errors --------------------------------------------------------------- */

/* The status for a CUDA result of op: BE_ENOMEM_DEV for an allocation that
 * failed, BE_EIO otherwise.  A sticky error (cudaErrorIllegalAddress and
 * the others that leave the context unusable) is reported once as fatal,
 * naming op, and marks the context dead: it is never retried. */
enum be_status cu_check(struct cu_ctx *c, cudaError_t e, const char *op);
enum be_status cu_blas_check(struct cu_ctx *c, cublasStatus_t s, const char *op);
/* Entry of every op: BE_EIO on a dead context; selects the device for
 * the calling thread. */
enum be_status cu_enter(struct cu_ctx *c, const char *op);
/* Exit of every op that launched kernels: the launch error, and with
 * KVTIER_CUDA_SYNC=1 the kernels' own, so a fault names its op. */
enum be_status cu_leave(struct cu_ctx *c, const char *op);

#define CU_TRY(c, call, op) BE_TRY(cu_check((c), (call), (op)))

/* ---- scratch and metadata ---------------------------------------------------- */

/* At least bytes of device scratch, valid until the next call (the compute
 * stream orders its uses). */
enum be_status cu_scratch(struct cu_ctx *c, size_t bytes, void **out);
/* Room for bytes of metadata: *host to fill now, *dev to hand the kernels
 * once cu_meta_upload has queued the copy on the compute stream. */
enum be_status cu_meta_reserve(struct cu_ctx *c, size_t bytes, char **host, char **dev);
enum be_status cu_meta_upload(struct cu_ctx *c, const char *host, const char *dev, size_t bytes);
/* An op that reserves more than once first makes sure its total fits a
 * half: growing replaces the buffers, which must not happen under
 * reservations the op has yet to launch its kernels on. */
enum be_status cu_meta_ensure(struct cu_ctx *c, size_t bytes);
static inline size_t cu_meta_size(size_t bytes)
{
    return (bytes + 15) & ~(size_t)15;
}

/* ---- element types -------------------------------------------------------- */

static inline size_t cu_esz(enum be_dtype dt)
{
    return dt == BE_F32 ? 4 : 2;
}

__device__ __forceinline__ float ld(const void *p, size_t i, enum be_dtype dt)
{
    switch (dt) {
    case BE_F16: return __half2float(((const __half *)p)[i]);
    case BE_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

/* round to nearest even, as the CPU backend's conversions */
__device__ __forceinline__ void st(void *p, size_t i, enum be_dtype dt, float v)
{
    switch (dt) {
    case BE_F16: ((__half *)p)[i] = __float2half_rn(v); break;
    case BE_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v); break;
    default: ((float *)p)[i] = v; break;
    }
}

__device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* ---- ops (kernels.cu, attention.cu), with the be_ops signatures ------------- */

enum be_status cu_matmul(void *ctx, void *y, enum be_dtype yt, const void *x, const void *w, enum be_dtype wt,
                         const float *bias, int n, int in, int out);
enum be_status cu_rmsnorm(void *ctx, void *y, const void *x, const float *w, int n, int dim, float eps);
enum be_status cu_layernorm(void *ctx, void *y, const void *x, const float *w, const float *b, int n, int dim,
                            float eps);
enum be_status cu_rope(void *ctx, void *x, int n_tok, int n_heads, int head_dim, const int64_t *pos,
                       const float *inv_freq, int rot_dim, float mscale, enum be_rope_layout layout);
enum be_status cu_silu_mul(void *ctx, void *y, const void *gate, const void *up, size_t n);
enum be_status cu_gelu_mul(void *ctx, void *y, const void *gate, const void *up, size_t n);
enum be_status cu_scale(void *ctx, void *x, size_t n, float s);
enum be_status cu_act(void *ctx, void *x, size_t n, enum be_act act);
enum be_status cu_add(void *ctx, void *y, const void *x, size_t n);
enum be_status cu_softmax(void *ctx, void *x, int rows, int cols);
enum be_status cu_embed(void *ctx, void *y, const void *table, enum be_dtype dt, const int32_t *ids, int n, int dim);
enum be_status cu_argmax(void *ctx, const void *x, int rows, int cols, int32_t *out);
enum be_status cu_kv_store(void *ctx, const struct be_kv_view *views, const struct be_tok *toks, int n_tok,
                           const void *k, const void *v, const struct be_attn_params *p);
enum be_status cu_attention(void *ctx, void *out, const void *q, const struct be_kv_view *views,
                            const struct be_tok *toks, int n_tok, const struct be_attn_params *p);

/* ---- paged KV on the device (attention.cu) ------------------------------------ */

/* A be_kv_view as the kernels read it: the block table uploaded with it. */
struct cu_view {
    const char *const *blocks;
    const char *sink_block;
    int64_t base, lo, hi, shift;
    size_t v_offset;
    int n_blocks, block_tokens, window, sinks;
    bool key_rope;
};

/* The views a batch names: [0, the largest index + 1) (the API gives the
 * views array no length). */
static inline int cu_views_named(const struct be_tok *toks, int n_tok)
{
    int n = 0;
    for (int t = 0; t < n_tok; t++)
        n = toks[t].view + 1 > n ? toks[t].view + 1 : n;
    return n;
}

/* The metadata bytes cu_upload_views_at reserves for n_views views, the
 * first at `first` and each `stride` bytes after the one before (a plain
 * array, or a be_kvq_view array's rests), and n_tok tokens. */
size_t cu_views_bytes_at(const struct be_kv_view *first, size_t stride, int n_views, int n_tok);
/* Uploads those views and their block tables, and toks: *dviews and
 * *dtoks (NULL: not wanted) are device addresses valid for this op's
 * kernels. */
enum be_status cu_upload_views_at(struct cu_ctx *c, const struct be_kv_view *first, size_t stride, int n_views,
                                  const struct be_tok *toks, int n_tok, const struct cu_view **dviews,
                                  const struct be_tok **dtoks);

static inline size_t cu_views_bytes(const struct be_kv_view *views, int n_views, int n_tok)
{
    return cu_views_bytes_at(views, sizeof(*views), n_views, n_tok);
}

static inline enum be_status cu_upload_views(struct cu_ctx *c, const struct be_kv_view *views, int n_views,
                                             const struct be_tok *toks, int n_tok, const struct cu_view **dviews,
                                             const struct be_tok **dtoks)
{
    return cu_upload_views_at(c, views, sizeof(*views), n_views, toks, n_tok, dviews, dtoks);
}

/* The K row of (position, kv head) in v (V at + v_offset), as cpu_kv_row. */
__device__ __forceinline__ const char *kv_row(const struct cu_view *v, int64_t pos, int kvh, int D, size_t esz)
{
    int64_t rel = pos - v->base;
    int64_t blk = rel / v->block_tokens, slot = rel % v->block_tokens;
    return v->blocks[blk] + ((size_t)kvh * (size_t)v->block_tokens + (size_t)slot) * (size_t)D * esz;
}

/* ---- state-space layers (ssm.cu) ---------------------------------------------- */

enum be_status cu_ssm_conv(void *ctx, void *y, const void *x, const struct be_ssm_view *views,
                           const struct be_tok *toks, int n_tok, const struct be_ssm_params *p);
enum be_status cu_ssm_scan(void *ctx, void *y, const void *x, const void *dt_raw, const void *B, const void *C,
                           const void *z, const struct be_ssm_view *views, const struct be_tok *toks, int n_tok,
                           const struct be_ssm_params *p);

/* ---- quantized KV on the device (kvq.cu) ------------------------------------ */

/* The quantized part of a be_kvq_view as the kernels read it (its rest is
 * uploaded as a cu_view beside it): quantized false for a dense sequence
 * of a mixed batch. */
struct cu_qview {
    struct be_kvq_format fmt;
    const char *const *blocks;
    int64_t base;
    float scale_k, scale_v;
    bool quantized;
};

/* The metadata bytes cu_upload_qviews reserves. */
size_t cu_qviews_bytes(const struct be_kvq_view *views, int n_views);
/* Uploads the quantized parts of views [0, n_views) and their block
 * tables: *dq is valid for this op's kernels. */
enum be_status cu_upload_qviews(struct cu_ctx *c, const struct be_kvq_view *views, int n_views,
                                const struct cu_qview **dq);

/* The block holding quantized position pos, and the position's row in it. */
__device__ __forceinline__ const char *cu_qblock(const struct cu_qview *q, int64_t pos, int *t)
{
    int64_t rel = pos - q->base, T = q->fmt.block_tokens;
    *t = (int)(rel % T);
    return q->blocks[rel / T];
}

enum be_status cu_attention_quant(void *ctx, void *out, const void *q, const struct be_kvq_view *views,
                                  const struct be_tok *toks, int n_tok, const struct be_attn_params *p);
enum be_status cu_kvq_quantize(void *ctx, const struct be_kvq_view *v, int64_t end);
enum be_status cu_kvq_dequantize(void *ctx, const struct be_kvq_view *v, int64_t p0, int64_t p1,
                                 const struct be_kv_view *dst);
enum be_status cu_kv_absmax(void *ctx, const struct be_kv_view *v, enum be_dtype dt, int n_kv_heads, int head_dim,
                            int64_t p0, int64_t p1, float amax[2]);
enum be_status cu_kv_copy(void *ctx, const struct be_kv_view *dst, const struct be_kv_view *src, int64_t p0,
                          int64_t p1, const struct be_attn_params *p);

#endif
