/* backend_impl.h - the private side of the compute seam: the vtable every
 * backend fills and the base objects the generic wrappers (backend.c) hang
 * it on.  Only backend/backend.c, backend/cpu/ and backend/cuda/ include this.
 *
 * Division of labour: the wrappers validate arguments once (NULL, bounds,
 * dtype), keep the device-pool budget, peak and fault-injection counters,
 * and turn an empty call into a no-op, so an implementation only moves
 * bytes and does maths on arguments it may trust.
 */
#ifndef KVTIER_BACKEND_IMPL_H
#define KVTIER_BACKEND_IMPL_H

#include <pthread.h>

#include "backend/backend.h"

/* Bumped whenever a slot is added, removed or changes meaning; be_open()
 * refuses a plugin built against another version. */
#define BE_API_VERSION 9

/* The symbols a backend plugin (libkvtier-cuda.so) exports: its init, and
 * const struct be_ops *kvtier_backend_ops(void), its table, which be_open()
 * checks for every required slot before init, so a table with a hole is
 * refused on every machine, not only on one where init succeeds. */
#define BE_PLUGIN_INIT_SYMBOL "kvtier_backend_init"
#define BE_PLUGIN_OPS_SYMBOL "kvtier_backend_ops"
/* And, optionally, const char *kvtier_backend_error(void): why its init
 * last failed, which be_open_error() then repeats. */
#define BE_PLUGIN_ERROR_SYMBOL "kvtier_backend_error"

struct be_ops {
    int api_version; // initialize to BE_API_VERSION
    const char *name; // "cpu", "cuda"

    void (*free)(void *ctx);        // releases ctx and everything it owns; outstanding copies are drained first
    struct be_caps (*caps)(void *ctx); // capabilities; the strings are static

    // device memory: size > 0, a multiple of 64; the wrapper has already charged the budget
    enum be_status (*dev_alloc)(void *ctx, size_t size, void **ptr);
    void (*dev_free)(void *ctx, void *ptr, size_t size); // ptr is never NULL
    // host memory for staging copies (pinned when the backend can): size > 0, a multiple of 64
    enum be_status (*host_alloc)(void *ctx, size_t size, void **ptr);
    void (*host_free)(void *ctx, void *ptr, size_t size); // ptr is never NULL

    // n > 0; dst and src do not overlap
    enum be_status (*copy_async)(void *ctx, void *dst, const void *src, size_t n, enum be_copy_dir dir);
    enum be_status (*copy)(void *ctx, void *dst, const void *src, size_t n, enum be_copy_dir dir);

    enum be_status (*event_create)(void *ctx, void **ev);
    void (*event_free)(void *ctx, void *ev); // ev is never NULL
    enum be_status (*event_record)(void *ctx, void *ev);
    enum be_status (*event_wait)(void *ctx, void *ev); // (optional) NULL: the compute stream is the host, so event_sync
    enum be_status (*event_sync)(void *ctx, void *ev);
    enum be_status (*event_elapsed)(void *ctx, void *start, void *end, double *seconds); // (optional) both fired
    // (optional, with event_wait) the seconds the compute stream waited at
    // its event_waits on ev since the last call, summed; NULL: be_event_wait
    // times the host's event_sync itself
    enum be_status (*event_stall)(void *ctx, void *ev, double *seconds);
    enum be_status (*sync)(void *ctx);

    // kernels: shapes > 0, pointers non-NULL (bias may be NULL), dtypes valid (matmul's wt may be
    // BE_Q8_0 with in a multiple of 32 or BE_Q4_K with in a multiple of 256: a backend without
    // them returns BE_ENOTSUP),
    // every token's position inside its view's blocks (see backend.h)
    enum be_status (*matmul)(void *ctx, void *y, enum be_dtype yt, const void *x, const void *w, enum be_dtype wt, const float *bias,
                             int n, int in, int out);
    enum be_status (*rmsnorm)(void *ctx, void *y, const void *x, const float *w, int n, int dim, float eps);
    enum be_status (*rope)(void *ctx, void *x, int n_tok, int n_heads, int head_dim, const int64_t *pos,
                           const float *inv_freq, int rot_dim, float mscale, enum be_rope_layout layout);
    enum be_status (*kv_store)(void *ctx, const struct be_kv_view *views, const struct be_tok *toks, int n_tok,
                               const void *k, const void *v, const struct be_attn_params *p);
    enum be_status (*attention)(void *ctx, void *out, const void *q, const struct be_kv_view *views,
                                const struct be_tok *toks, int n_tok, const struct be_attn_params *p);
    enum be_status (*silu_mul)(void *ctx, void *y, const void *gate, const void *up, size_t n);
    enum be_status (*gelu_mul)(void *ctx, void *y, const void *gate, const void *up, size_t n); // up may be NULL
    enum be_status (*scale)(void *ctx, void *x, size_t n, float s);
    enum be_status (*act)(void *ctx, void *x, size_t n, enum be_act act);
    enum be_status (*layernorm)(void *ctx, void *y, const void *x, const float *w, const float *b, int n, int dim,
                                float eps);
    enum be_status (*add)(void *ctx, void *y, const void *x, size_t n);
    enum be_status (*softmax)(void *ctx, void *x, int rows, int cols);
    enum be_status (*embed)(void *ctx, void *y, const void *table, enum be_dtype dt, const int32_t *ids, int n,
                            int dim);
    enum be_status (*argmax)(void *ctx, const void *x, int rows, int cols, int32_t *out);
    // (optional) NULL: no quantized KV on this backend; views checked by be_attention_quant
    enum be_status (*attention_quant)(void *ctx, void *out, const void *q, const struct be_kvq_view *views,
                                      const struct be_tok *toks, int n_tok, const struct be_attn_params *p);
    // (optional, with attention_quant) the quantized block writer; arguments checked by the wrappers
    enum be_status (*kvq_quantize)(void *ctx, const struct be_kvq_view *v, int64_t end);
    // (optional, with attention_quant) the reader of the codes into f32 rows; arguments checked by the wrapper
    enum be_status (*kvq_dequantize)(void *ctx, const struct be_kvq_view *v, int64_t p0, int64_t p1,
                                     const struct be_kv_view *dst);
    enum be_status (*kv_absmax)(void *ctx, const struct be_kv_view *v, enum be_dtype dt, int n_kv_heads, int head_dim,
                                int64_t p0, int64_t p1, float amax[2]);
    // (optional) NULL: no state-space models on this backend; views and params checked by the wrappers
    enum be_status (*ssm_conv)(void *ctx, void *y, const void *x, const struct be_ssm_view *views,
                               const struct be_tok *toks, int n_tok, const struct be_ssm_params *p);
    enum be_status (*ssm_scan)(void *ctx, void *y, const void *x, const void *dt_raw, const void *B, const void *C,
                               const void *z, const struct be_ssm_view *views, const struct be_tok *toks, int n_tok,
                               const struct be_ssm_params *p);
    // (optional) NULL: no sink strategy over quantized KV
    enum be_status (*kv_copy)(void *ctx, const struct be_kv_view *dst, const struct be_kv_view *src, int64_t p0,
                              int64_t p1, const struct be_attn_params *p);
};

/* What a backend's init returns: its table, its context and the device
 * budget it will enforce (params->device_mem, or its own default for 0). */
typedef enum be_status (*be_init_fn)(const struct be_params *p, const struct be_ops **ops, void **ctx,
                                     size_t *dev_budget);

/* The built-in CPU backend (backend/cpu/cpu.c). */
enum be_status be_cpu_init(const struct be_params *p, const struct be_ops **ops, void **ctx, size_t *dev_budget);
/* The CPU backend with its device memory unreadable outside its ops (strict.c). */
enum be_status be_strict_init(const struct be_params *p, const struct be_ops **ops, void **ctx, size_t *dev_budget);

struct be_backend {
    const struct be_ops *ops;
    void *ctx;            // owned by ops, released by ops->free
    void *plugin;         // dlopen handle of a plugin backend, NULL for built-ins

    pthread_mutex_t lock; // guards the accounting below; buffers are freed from any thread
    struct be_mem_stats stats;
    uint64_t fault_countdown; // device allocations left before the injected failure; 0 = disarmed
    bool fault_repeat;        // keep failing once the countdown hit zero
    bool faulting;            // repeat mode has fired
};

struct be_buffer {
    be_backend *be;
    void *data;
    size_t size;    // as asked for
    size_t charged; // rounded size charged to the pool it came from
    bool device;
};

struct be_event {
    be_backend *be;
    void *h;        // backend's handle
    double stall_s; // where the host is the compute stream: its waits since be_event_stall
};

#endif
