/* backend.h - the compute seam: memory, copies, events and the kernels of the
 * forward pass, behind one small vtable (backend_impl.h).
 *
 * Every pointer a kernel takes is a *device address* returned by
 * be_buffer_data() of a device buffer, or weight memory the backend said it
 * can read (caps.unified_memory: the CPU backend reads mmapped weights in
 * place; any other backend gets the weights uploaded).  The exceptions are
 * host metadata, named as such below: the be_kv_view / be_kvq_view / be_tok
 * structs and the block tables they point to, be_rope's positions,
 * be_embed's token ids, be_argmax's and be_kv_absmax's results.  A backend
 * that needs them on the device uploads them itself.  Nothing above the
 * seam reads or writes device memory except through be_copy*: the strict
 * CPU backend ("cpu-strict") faults on any such access.
 *
 * Activations (the void pointers of the kernels) are of caps.act_dtype:
 * f32 on the CPU, bf16 or f16 where a GPU computes faster in them; a
 * matmul's output may instead be f32 (yt), which is how the logits reach
 * the host in full precision.  Weights are f32, f16, bf16 or, for
 * be_matmul only, Q8_0 blocks; norm weights, biases and the RoPE tables
 * are f32.
 *
 * Streams: kernels run on the backend's compute stream, in call order.
 * be_copy_async() runs on a separate copy stream; be_event_record() marks
 * the copy stream, be_event_wait() makes the compute stream wait for it and
 * be_event_sync() makes the host wait.  The CPU backend computes on the
 * calling thread (so "compute stream" = caller) and copies on its own thread.
 *
 * Device memory is a pool with a hard byte budget.  An allocation over budget
 * returns BE_ENOMEM_DEV and never aborts: every out-of-memory path above this
 * seam is real and testable on a machine without a GPU.
 */
#ifndef KVTIER_BACKEND_H
#define KVTIER_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum be_status {
    BE_OK = 0,
    BE_ENOMEM_DEV = 1,  /* device pool budget exhausted (or injected fault) */
    BE_ENOMEM_HOST = 2, /* host memory (pinned or plain) could not be had */
    BE_EINVAL = 3,      /* bad argument: a programming error above the seam */
    BE_ENOTSUP = 4,     /* the backend lacks this op / dtype / capability */
    BE_ENODEV = 5,      /* backend not available (no plugin, no device) */
    BE_EIO = 6,         /* device or driver error */
};
const char *be_strerror(enum be_status st);

/* Returns expr's status from the calling function unless it is BE_OK: for
 * callers whose kernel failures are device faults, not input errors. */
#define BE_TRY(expr)                                                                                           \
    do {                                                                                                       \
        enum be_status be_try_st_ = (expr);                                                                    \
        if (be_try_st_ != BE_OK)                                                                               \
            return be_try_st_;                                                                                 \
    } while (0)

/* BE_Q8_0 and BE_Q4_K are weight formats, not element types: GGUF's
 * blocks of 32 int8 codes and one f16 scale along a row (util/q8.h), and
 * its super-blocks of 256 4-bit codes with 6-bit scales and mins
 * (util/q4k.h), accepted only as be_matmul's wt, so no activation, KV or
 * embedding can be of them.  They share the enum because a weight
 * matrix's type travels where the other weight dtypes do (model_mat,
 * be_matmul). */
enum be_dtype { BE_F32 = 0, BE_F16 = 1, BE_BF16 = 2, BE_Q8_0 = 3, BE_Q4_K = 4 };
/* Bytes per element; 0 for the block formats, which have none (be_row_bytes). */
size_t be_dtype_size(enum be_dtype dt);
const char *be_dtype_name(enum be_dtype dt);
/* Bytes of a row of n elements of dt; 0 when no such row exists (a Q8_0
 * row of n not a multiple of 32, a Q4_K row not of 256, an unknown dtype). */
size_t be_row_bytes(enum be_dtype dt, size_t n);

typedef struct be_backend be_backend; /* one device and its streams */
typedef struct be_buffer be_buffer;   /* one allocation, device or host */
typedef struct be_event be_event;     /* a fence on the copy stream */

struct be_params {
    int n_threads;        /* CPU threads for the math; 0 = physical cores (hwloc) */
    size_t device_mem;    /* device pool budget in bytes; 0 = backend default */
    size_t host_mem;      /* pinned-host budget in bytes; 0 = unlimited */
    int device_index;     /* which GPU (CUDA) */
};

struct be_caps {
    const char *name;     /* "cpu", "cuda" */
    bool async_copy;      /* copies overlap compute */
    bool pinned_host;     /* host buffers are page-locked */
    bool unified_memory;  /* kernels can read host memory (mmapped weights) directly */
    int n_threads;        /* compute threads (CPU) */
    const char *simd;     /* "avx512bf16", "avx512vnni", "avx512", "avx2", "scalar" (CPU) */
    enum be_dtype act_dtype; /* what activations are stored as */
    /* Device memory of its own (a GPU's): the default budget is what the
     * device has free, so the runtime sizes none from the model. */
    bool dedicated_memory;
};

/* Opens a backend by name: "cpu" is built in; "cuda" is loaded from the
 * plugin build/libkvtier-cuda.so when present (BE_ENODEV otherwise). */
enum be_status be_open(const char *name, const struct be_params *p, be_backend **out);
/* Why the calling thread's last be_open failed, in words: for "cuda",
 * "no CUDA device (cudaGetDeviceCount: ...)" from the plugin, or why the
 * plugin could not be loaded; "" after a success or with no reason known. */
const char *be_open_error(void);
void be_free(be_backend *be); /* accepts NULL */
struct be_caps be_get_caps(const be_backend *be);

/* ---- memory ------------------------------------------------------------ */
#define BE_ALIGN 64 /* every allocation is aligned to and charged in multiples of this */
/* The bytes an allocation of n is charged (for budgets sized ahead). */
static inline size_t be_charged(size_t n)
{
    return (n + BE_ALIGN - 1) / BE_ALIGN * BE_ALIGN;
}
enum be_status be_dev_alloc(be_backend *be, size_t size, be_buffer **out);
enum be_status be_host_alloc(be_backend *be, size_t size, be_buffer **out);
void be_buffer_free(be_buffer *buf); /* accepts NULL */
void *be_buffer_data(const be_buffer *buf);
size_t be_buffer_size(const be_buffer *buf);

struct be_mem_stats {
    size_t dev_budget, dev_used, dev_peak;
    size_t host_used, host_peak;
    uint64_t dev_allocs;  /* device allocations attempted so far */
    uint64_t dev_failures;
};
struct be_mem_stats be_mem_stats(const be_backend *be);
void be_reset_peak(be_backend *be);

/* Fault injection (tests): the device allocation with ordinal fail_at
 * (1-based, counted from this call) fails with BE_ENOMEM_DEV; with repeat,
 * every later one fails too.  fail_at = 0 disarms. */
void be_fault_dev_alloc(be_backend *be, uint64_t fail_at, bool repeat);

/* ---- copies and events ----------------------------------------------------- */
enum be_copy_dir { BE_H2D, BE_D2H, BE_D2D };
enum be_status be_copy_async(be_backend *be, void *dst, const void *src, size_t n, enum be_copy_dir dir);
enum be_status be_copy(be_backend *be, void *dst, const void *src, size_t n, enum be_copy_dir dir);
enum be_status be_event_create(be_backend *be, be_event **out);
void be_event_free(be_event *ev); /* accepts NULL */
enum be_status be_event_record(be_backend *be, be_event *ev); /* marks the copy stream */
enum be_status be_event_wait(be_backend *be, be_event *ev);   /* compute stream waits */
enum be_status be_event_sync(be_event *ev);                  /* host waits */
/* Seconds between the moments the copy stream reached start and end (end
 * recorded after start); waits for end.  BE_ENOTSUP where the backend
 * cannot time its copy stream. */
enum be_status be_event_elapsed(be_event *start, be_event *end, double *seconds);
/* Seconds the compute stream spent waiting at be_event_wait on ev since
 * the last call, summed; read after be_sync.  On a device the host only
 * queues the wait, so the backend times the compute stream itself; where
 * the host computes, it is the host's wait.  BE_ENOTSUP where the backend
 * cannot tell. */
enum be_status be_event_stall(be_event *ev, double *seconds);
enum be_status be_sync(be_backend *be);                      /* all streams drained */

/* ---- kernels ------------------------------------------------------------ */
/* y[n,out] = x[n,in] . W[out,in]^T (+ bias[out] when bias != NULL).
 * W is row-major as in a Hugging Face Linear, rows of be_row_bytes(wt,
 * in) bytes; bias is f32; y is of yt (caps.act_dtype or f32: BE_ENOTSUP
 * for one the backend cannot write).  With wt BE_Q8_0, in must be a
 * multiple of 32, with BE_Q4_K of 256 (BE_EINVAL otherwise); the CPU
 * backend then rounds each row of x to int8 blocks of 32 with an f32
 * scale (round to nearest even) and multiplies by those, in integers as
 * llama.cpp does, so y carries x's rounding error too, the same for any
 * number of rows. */
enum be_status be_matmul(be_backend *be, void *y, enum be_dtype yt, const void *x, const void *w, enum be_dtype wt,
                         const float *bias, int n, int in, int out);

/* y[n,dim] = x / rms(x) * w ; w is f32. y may alias x. */
enum be_status be_rmsnorm(be_backend *be, void *y, const void *x, const float *w, int n, int dim, float eps);
/* y[n,dim] = (x - mean(x)) / sqrt(var(x) + eps) * w + b, the statistics
 * in f32 over each row (torch.nn.LayerNorm); w and b are f32. y may alias x. */
enum be_status be_layernorm(be_backend *be, void *y, const void *x, const float *w, const float *b, int n, int dim,
                            float eps);

enum be_rope_layout {
    BE_ROPE_NEOX = 0,        /* HF rotate_half: pairs (i, i + rot_dim/2) */
    BE_ROPE_INTERLEAVED = 1, /* GPT-J / Meta: pairs (2i, 2i+1) */
};
/* Rotates x[n_tok, n_heads, head_dim] in place; token t is at absolute
 * position pos[t] (host metadata); angle = pos * inv_freq[i] for i <
 * rot_dim/2 (the caller folds rope_theta and rope_scaling into inv_freq,
 * a device table).  cos and sin are multiplied by mscale (longrope's
 * attention factor; 1 for plain RoPE), so the rotated dimensions scale by
 * it and the rest do not. */
enum be_status be_rope(be_backend *be, void *x, int n_tok, int n_heads, int head_dim, const int64_t *pos,
                       const float *inv_freq, int rot_dim, float mscale, enum be_rope_layout layout);

/* One sequence's KV for one layer, as attention reads it.  Block b holds the
 * positions [base + b*block_tokens, base + (b+1)*block_tokens); within a
 * block K is (n_kv_heads, block_tokens, head_dim) at the block's start and V
 * the same at +v_offset bytes.  Positions in [lo, hi) are valid. */
struct be_kv_view {
    void *const *blocks; /* [n_blocks] device addresses */
    int n_blocks;
    int block_tokens;
    size_t v_offset;
    int64_t base, lo, hi;
    /* 0: be_attn_params.window applies; else this sequence's own window
     * (the sliding_window strategy gives each sequence its own). */
    int window;
    /* The sink strategy (StreamingLLM): keys are stored before RoPE and
     * rotated as attention reads them, at their index in the cache (the
     * table be_attn_params.key_rope).  A key at position p < sinks is read
     * from sink_block (laid out as block 0) at index p, any other from the
     * blocks at index p - shift.  key_rope false: keys are stored rotated,
     * sinks must be 0. */
    bool key_rope;
    int sinks;
    const void *sink_block;
    int64_t shift;
};

struct be_attn_params {
    int n_heads, n_kv_heads, head_dim; /* GQA: query head h reads kv head h / (n_heads/n_kv_heads) */
    float scale;                       /* usually 1/sqrt(head_dim) */
    float softcap;                     /* 0: none; else each scaled score s becomes softcap * tanh(s / softcap) */
    int window;                        /* 0: full causal; else key k visible to query q iff q - k < window */
    enum be_dtype kv_dtype;            /* storage type of the blocks */
    /* For views with key_rope: row j (head_dim activations) of key_rope holds
     * what be_rope makes of (1, 0) pairs at position j, i.e. cos and sin in
     * the two slots of each rotated pair; key_rope_rows rows, at least the
     * largest cache index a view reads. */
    const float *key_rope;
    int64_t key_rope_rows;
    enum be_rope_layout key_rope_layout;
    /* Encoder-decoder models.  bidirectional: every key of a view's
     * [lo, hi) is visible to every query (an encoder's self-attention,
     * cross-attention), not only those at or before the query's position.
     * rel_bias (T5's relative position buckets, device f32 [n_heads,
     * 2 * rel_span + 1], NULL: none): row h, column clamp(k - q, -rel_span,
     * rel_span) + rel_span is added to query head h's scaled score of the
     * key at position k for the query at position q; past rel_span the
     * bucket no longer changes, so the clamp is exact.  be_attention_quant
     * reads both as be_attention does; a backend without them answers
     * BE_ENOTSUP. */
    bool bidirectional;
    const float *rel_bias;
    int rel_span;
};

/* Where token t of a batch lives: which view and which absolute position. */
struct be_tok {
    int view;
    int64_t pos;
};

/* Scatters k, v [n_tok, n_kv_heads*head_dim] into the blocks at each token's
 * position (the caller has reserved the blocks). */
enum be_status be_kv_store(be_backend *be, const struct be_kv_view *views, const struct be_tok *toks, int n_tok,
                           const void *k, const void *v, const struct be_attn_params *p);

/* out[n_tok, n_heads*head_dim] = softmax(q k^T * scale + mask) v over each
 * token's view, causal (k_pos <= q_pos), windowed, restricted to [lo, hi). */
enum be_status be_attention(be_backend *be, void *out, const void *q, const struct be_kv_view *views,
                            const struct be_tok *toks, int n_tok, const struct be_attn_params *p);

/* ---- quantized KV (the formats are laid out by tiers/quant.c) -------------- */

/* How a block's codes turn back into numbers. */
enum be_kvq_codes {
    BE_KVQ_AFFINE_SHIFT = 0, /* quanto:  x = c * scale - shift   (c unsigned, nbits wide) */
    BE_KVQ_AFFINE_ZERO = 1,  /* hqq:     x = (c - zero) * scale */
    BE_KVQ_E4M3 = 2,         /* fp8:     x = e4m3(c) * tensor scale (one per layer and K/V) */
};
#define BE_E4M3_MAX 448.0f /* the largest finite e4m3 (torch.float8_e4m3fn) */

/* One half (K or V) of a quantized block of T = block_tokens tokens, H =
 * n_kv_heads, D = head_dim.  Codes: code (h, t, d) is element (h*T + t)*D + d
 * of a little-endian bit string of nbits-wide codes starting `codes` bytes
 * into the block (code i occupies bits [i*nbits, (i+1)*nbits)), so a token's
 * row of one head is contiguous and starts on a byte.  Affine parameters:
 * the group holding (h, t, d) spans gt tokens x gd channels (per-token
 * groups 1 x G, per-channel groups G x 1), and its (scale, zero) pair of f16
 * is pair number (h*(T/gt) + t/gt)*(D/gd) + d/gd at `params` bytes.  When
 * both halves are per-channel their gt is the same. */
struct be_kvq_half {
    int gt, gd;
    size_t codes, params;
};

struct be_kvq_format {
    enum be_kvq_codes kind;
    int nbits; /* 1..8; 8 for e4m3 */
    int block_tokens, n_kv_heads, head_dim;
    struct be_kvq_half k, v;
    size_t block_bytes;
};

/* One sequence's quantized KV for one layer: quantized block b holds the
 * positions [base + b*T, base + (b+1)*T) and [lo, hi) of them are valid;
 * the positions [hi, rest.hi) that follow are full precision in `rest`
 * (rest.lo == hi; an empty rest has rest.lo == rest.hi).  fmt NULL: nothing
 * is quantized (lo == hi == rest.lo), a dense sequence batched with
 * quantized ones.  rest carries the sink strategy's fields for both parts
 * (key_rope, sinks, sink_block, shift: quantized keys are stored before
 * RoPE too, and the sinks are full precision in sink_block); with nothing
 * quantized to read (lo == hi), rest.lo may lie past hi: a sink window
 * that starts inside the residual. */
struct be_kvq_view {
    const struct be_kvq_format *fmt;
    void *const *blocks;
    int n_blocks;
    int64_t base, lo, hi;
    float scale_k, scale_v; /* e4m3 tensor scales (unused by the affine kinds) */
    struct be_kv_view rest;
    enum be_dtype rest_dtype; /* of rest and the sinks: the store's KV dtype */
};

/* be_attention over quantized views: the quantized blocks are decoded in
 * registers, block by block (never into a full-precision copy), then the
 * full-precision rest (p->kv_dtype) is read as be_attention reads a view.
 * BE_ENOTSUP when the backend has no quantized attention. */
enum be_status be_attention_quant(be_backend *be, void *out, const void *q, const struct be_kvq_view *views,
                                  const struct be_tok *toks, int n_tok, const struct be_attn_params *p);

/* Quantizes positions [v->hi, end) of v's full-precision rest into v's
 * quantized blocks (block i holds [base + i*T, base + (i+1)*T)), with the
 * e4m3 scales in v.  A per-channel group row that v->hi leaves partly
 * filled is decoded and quantized again with the new tokens, so groups are
 * computed over whole rows.  BE_ENOTSUP without quantized KV. */
enum be_status be_kvq_quantize(be_backend *be, const struct be_kvq_view *v, int64_t end);

/* Decodes the quantized positions [p0, p1) of v (inside [v->lo, v->hi))
 * into dst, an f32 view covering them, as be_attention_quant reads them
 * (keys as stored: before RoPE for a key_rope view).  How a quantized
 * cache is exported dense.  BE_ENOTSUP without quantized KV. */
enum be_status be_kvq_dequantize(be_backend *be, const struct be_kvq_view *v, int64_t p0, int64_t p1,
                                 const struct be_kv_view *dst);

/* amax[0], amax[1] (host) = max |K|, max |V| over positions [p0, p1) of an
 * f32 view: what the e4m3 tensor scales are computed from. */
enum be_status be_kv_absmax(be_backend *be, const struct be_kv_view *v, enum be_dtype dt, int n_kv_heads,
                            int head_dim, int64_t p0, int64_t p1, float amax[2]);

/* Copies the K and V rows of positions [p0, p1) from view src to view dst
 * (p->n_kv_heads, p->head_dim, p->kv_dtype): how the sink strategy keeps
 * its sinks' full-precision rows.  BE_ENOTSUP where the backend lacks it. */
enum be_status be_kv_copy(be_backend *be, const struct be_kv_view *dst, const struct be_kv_view *src, int64_t p0,
                          int64_t p1, const struct be_attn_params *p);

/* ---- state-space layers (Mamba) ------------------------------------------
 * A layer's state per sequence, f32, fixed in size: the conv window, the
 * last d_conv - 1 inputs of the depthwise convolution as (d_conv - 1,
 * d_inner), oldest first (zeros before the first token), then the SSM
 * state h as (d_inner, d_state). */
#define BE_SSM_MAX_STATE 256 /* far above any checkpoint (Mamba: d_state 16, d_conv 4); */
#define BE_SSM_MAX_CONV 16   /* a kernel keeps one channel's window and state on its stack */
struct be_ssm_params {
    int d_inner, d_state, d_conv;
    const float *conv_w; /* (d_inner, d_conv) f32: conv1d.weight[:, 0, :] */
    const float *conv_b; /* (d_inner) f32 or NULL */
    const float *A;      /* (d_inner, d_state) f32: -exp(A_log) */
    const float *D;      /* (d_inner) f32 */
};
/* One sequence's state of one layer for a call: in holds it before the
 * sequence's first row of the call, out receives it after its last row;
 * in == out is allowed (the state is read before it is written). */
struct be_ssm_view {
    const void *in;
    void *out;
};
/* The bytes of one layer's state; 0 when a size is out of range. */
size_t be_ssm_state_bytes(int d_inner, int d_state, int d_conv);
/* y[n_tok, d_inner] = silu(causal depthwise conv(x) + conv_b): row t of a
 * view (toks[t].view; a view's rows are consecutive and in order, pos is
 * not read) sees its d_conv - 1 predecessors, the first ones from the
 * view's window; the window after the last row goes to out. */
enum be_status be_ssm_conv(be_backend *be, void *y, const void *x, const struct be_ssm_view *views,
                           const struct be_tok *toks, int n_tok, const struct be_ssm_params *p);
/* The selective scan, per row t and channel i of its view's state h:
 *   dt = softplus(dt_raw[t, i])
 *   h[i, :] = exp(dt * A[i, :]) * h[i, :] + dt * B[t, :] * x[t, i]
 *   y[t, i] = (sum_j C[t, j] h[i, j] + D[i] x[t, i]) * silu(z[t, i])
 * x, dt_raw, z, y: (n_tok, d_inner); B, C: (n_tok, d_state); h is read
 * from and written to the views as be_ssm_conv does the window. */
enum be_status be_ssm_scan(be_backend *be, void *y, const void *x, const void *dt_raw, const void *B, const void *C,
                           const void *z, const struct be_ssm_view *views, const struct be_tok *toks, int n_tok,
                           const struct be_ssm_params *p);

/* y[n] = silu(gate[n]) * up[n] */
enum be_status be_silu_mul(be_backend *be, void *y, const void *gate, const void *up, size_t n);
/* y[n] = gelu_tanh(gate[n]) * up[n], or gelu_tanh(gate[n]) when up is NULL;
 * gelu_tanh(x) = x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), the
 * "gelu_pytorch_tanh" / "gelu_new" of transformers. */
enum be_status be_gelu_mul(be_backend *be, void *y, const void *gate, const void *up, size_t n);
/* x[n] = act(x[n]) in place: ReLU (T5 v1.0's FFN) or the exact erf GELU
 * (BART's "gelu", not gelu_tanh). */
enum be_act { BE_ACT_RELU = 0, BE_ACT_GELU_ERF };
enum be_status be_act(be_backend *be, void *x, size_t n, enum be_act act);
/* x[n] *= s */
enum be_status be_scale(be_backend *be, void *x, size_t n, float s);
/* y[n] += x[n] */
enum be_status be_add(be_backend *be, void *y, const void *x, size_t n);
/* Row-wise softmax of x[rows, cols] in place. */
enum be_status be_softmax(be_backend *be, void *x, int rows, int cols);
/* y[n, dim] = table[ids[t], :] converted to the activation type; ids is
 * host metadata (checked against 0 here, against the table by the caller) */
enum be_status be_embed(be_backend *be, void *y, const void *table, enum be_dtype dt, const int32_t *ids, int n,
                        int dim);
/* out[r] (host) = argmax over x[r, :] (first index on ties) */
enum be_status be_argmax(be_backend *be, const void *x, int rows, int cols, int32_t *out);

#endif
