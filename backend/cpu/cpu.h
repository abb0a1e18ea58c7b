/* cpu.h - internals of the CPU backend shared by its files: the thread
 * pool, the per-SIMD-level kernel tables and the op drivers.
 *
 * The ops in ops.c own threading and the loops over tokens, heads and
 * rows; the tables below hold only the inner loops that differ per
 * instruction set.  The scalar table is the reference every other level is
 * tested against (tests/test_backend.c).
 */
#ifndef KVTIER_CPU_H
#define KVTIER_CPU_H

#include <stddef.h>

#include "backend/backend_impl.h"

/* ---- thread pool (pool.c) ----------------------------------------------- */

/* A job: called once per thread with ith in [0, nth); ith 0 is the caller. */
typedef void cpu_job_fn(void *arg, int ith, int nth);

struct cpu_pool;
/* n_threads >= 1 counts the caller; n_threads - 1 workers are started. */
enum be_status cpu_pool_create(int n_threads, struct cpu_pool **out);
void cpu_pool_free(struct cpu_pool *p); /* accepts NULL */
int cpu_pool_size(const struct cpu_pool *p);
/* Runs fn on every thread and returns when all are done.  One job at a
 * time: calls must not overlap (the compute stream is one caller). */
void cpu_pool_run(struct cpu_pool *p, cpu_job_fn *fn, void *arg);

/* ---- kernel tables (kern_*.c) ------------------------------------------- */

/* An activation row's block of 32 rounded to int8 for a Q8_0 matmul: the
 * f32 scale keeps x's range exactly (GGUF's Q8_0 activations round it to
 * f16), and the codes pair with a weight block's in integer dot products. */
struct cpu_q8_act {
    float d;
    int8_t qs[32];
};

/* The weight formats multiplied by int8 activations (struct cpu_q8_act). */
static inline bool cpu_wq(enum be_dtype dt)
{
    return dt == BE_Q8_0 || dt == BE_Q4_K;
}

/* One matmul call, as the op driver hands it to a table. */
struct cpu_mm {
    float *y;        /* [n, out] */
    const float *x;  /* [n, in] */
    const void *w;   /* [out, in] of wt */
    enum be_dtype wt;
    int n, in, out;
    /* wt BE_Q8_0 or BE_Q4_K (cpu_wq): x as n * in / 32 blocks, quantized
     * once by the driver, and x itself is then those blocks dequantized
     * (d * q) where the level's wq_f32 asks for it, else NULL */
    const struct cpu_q8_act *xq;
    /* with xq: the sum of each block's 32 codes, which the products of
     * unsigned weight codes (Q4_K's, Q8_0's + 128) are corrected by */
    const int32_t *xsum;
    /* wt BE_BF16 on a level with bf16_pack_act: x rounded to bf16 and
     * packed by it, once by the driver */
    const uint32_t *xb;
};

/* One view's rows of a be_ssm_scan call, as the op driver hands them to a
 * table: rows t0..t1 of x, dt (before softplus), z and y (d_inner floats a
 * row) and of B and C (d_state), the state h (d_inner, d_state) read from
 * h_in before the first row and written to h_out after the last; h_in ==
 * h_out is allowed. */
struct cpu_ssm {
    float *y;
    const float *x, *dt, *B, *C, *z;
    const float *h_in;
    float *h_out;
    int t0, t1;
    const struct be_ssm_params *p;
};

/* Floats of scratch per thread: room for a panel of weight rows converted
 * to f32 (levels that use it size their panels to fit), or attention's
 * work area and its pieces' states (CPU_ATTN_WORK below). */
#define CPU_SCRATCH_FLOATS (256 * 1024)

struct cpu_kern {
    const char *name; /* "scalar", "avx2", "avx512", "avx512vnni" */
    /* y[:, r0:r1] for rows r0..r1 of W, all n tokens (the driver adds the bias);
     * scratch holds CPU_SCRATCH_FLOATS floats private to the thread */
    void (*matmul_rows)(const struct cpu_mm *a, int r0, int r1, float *scratch);
    /* s[g * nrows + r] = sum q[g * n + i] * rows[r][i] for nq queries (the
     * query heads that share a kv head), n elements stored as dt: a chunk
     * of keys per call, and each row read and widened once for all nq */
    void (*dot)(float *s, const float *q, int nq, const char *const *rows, enum be_dtype dt, int n, int nrows);
    /* y[g * n + i] += sum over r of a[g * nrows + r] * (rows[r] + off)[i]:
     * a chunk of values (off: V after K in a block) into nq outputs; odd:
     * rows[0] has an odd index in the source's key order (a level that
     * sums keys in pairs pairs them from even indices) */
    void (*axpy)(float *y, const float *a, int nq, const char *const *rows, size_t off, enum be_dtype dt, int n,
                 int nrows, bool odd);
    /* y[i] *= a */
    void (*scale)(float *y, float a, int n);
    /* the largest x[i] that is a number, -inf if none: a chunk's softmax max */
    float (*max)(const float *x, int n);
    /* s[i] = exp(s[i] - m); returns the sum: a chunk's softmax weights */
    float (*exp_sum)(float *s, float m, int n);
    /* sum x[i]^2 */
    float (*sumsq)(const float *x, int n);
    /* y[i] = (x[i] * s) * w[i]: the order Hugging Face's RMSNorm rounds in */
    void (*norm_mul)(float *y, const float *x, float s, const float *w, int n);
    /* y[i] += x[i] */
    void (*add)(float *y, const float *x, size_t n);
    /* y[i / 32] = x[i] in blocks of 32 (n a multiple of 32): d = max|x| /
     * 127, q = x * (1 / d) rounded to nearest even; a block whose 1 / d is
     * 0 or overflows (max|x| below about 3.7e-37) gets d = 0 and zero
     * codes, as an all-zero block; a block holding a NaN or an infinity
     * gets d = NaN so the products show it; sum[i / 32] = the sum of the
     * block's codes.  Every level writes identical bytes. */
    void (*q8_act)(struct cpu_q8_act *y, int32_t *sum, const float *x, size_t n);
    /* NULL, or whether matmul_rows multiplies n tokens of in columns by
     * quantized weights in f32 (a->x, gemm.c's panels) rather than from
     * a->xq: the driver makes a->x only then */
    bool (*wq_f32)(int n, int in);
    /* y[i] = x[i] converted from dt */
    void (*to_f32)(float *y, const void *x, enum be_dtype dt, size_t n);
    /* y[i] = x[i] converted to dt, round to nearest even */
    void (*from_f32)(void *y, enum be_dtype dt, const float *x, size_t n);
    /* NULL, or the level multiplies bf16 weights by batches of tokens on
     * bf16 dot products: packs the n rows of x, rounded to bf16, for
     * matmul_rows (cpu_bf16_act_words(n, in) words at xb) */
    void (*bf16_pack_act)(uint32_t *xb, const float *x, int n, int in);
    /* the selective scan (be_ssm_scan) of channels lo..hi through a's rows:
     * a channel's recurrence is its own, so the driver splits them */
    void (*ssm_scan)(const struct cpu_ssm *a, size_t lo, size_t hi);
};

extern const struct cpu_kern cpu_kern_scalar;
extern const struct cpu_kern cpu_kern_avx2;
extern const struct cpu_kern cpu_kern_avx512;
/* AVX-512 with VNNI: the avx512 table with the quantized-weight matmul on
 * vpdpbusd (wq_vnni.c). */
extern const struct cpu_kern cpu_kern_avx512vnni;
/* AVX-512 with VNNI and BF16: the avx512vnni table with bf16 weights on
 * vdpbf16ps (bf16_avx512.c). */
extern const struct cpu_kern cpu_kern_avx512bf16;

/* The scalar inner loops, for SIMD tables that keep some of them. */
void cpu_matmul_rows_scalar(const struct cpu_mm *a, int r0, int r1, float *scratch);
void cpu_dot_scalar(float *s, const float *q, int nq, const char *const *rows, enum be_dtype dt, int n, int nrows);
void cpu_axpy_scalar(float *y, const float *a, int nq, const char *const *rows, size_t off, enum be_dtype dt, int n,
                     int nrows, bool odd);
void cpu_to_f32_scalar(float *y, const void *x, enum be_dtype dt, size_t n);
float cpu_max_scalar(const float *x, int n);
float cpu_exp_sum_scalar(float *s, float m, int n);
void cpu_from_f32_scalar(void *y, enum be_dtype dt, const float *x, size_t n);
void cpu_q8_act_scalar(struct cpu_q8_act *y, int32_t *sum, const float *x, size_t n);
void cpu_ssm_scan_scalar(const struct cpu_ssm *a, size_t lo, size_t hi);
/* The quantized-weight matmul (a->wt cpu_wq) for AVX2, which the avx512
 * level uses too, and for AVX-512 VNNI (q8_avx2.c, wq_vnni.c over
 * wq_rows.h); the activation quantizer of both AVX levels. */
void cpu_matmul_wq_avx2(const struct cpu_mm *a, int r0, int r1, float *scratch);
void cpu_matmul_wq_vnni(const struct cpu_mm *a, int r0, int r1, float *scratch);
bool cpu_wq_f32_avx2(int n, int in);
bool cpu_wq_f32_vnni(int n, int in);
void cpu_q8_act_avx2(struct cpu_q8_act *y, int32_t *sum, const float *x, size_t n);
/* From CPU_WQ_GEMM_MIN_TOKENS tokens, on rows of at most CPU_WQ_GEMM_MAX_IN
 * weights (a packed panel of them fits a thread's scratch), the VNNI level
 * multiplies quantized weights by a blocked int8 GEMM (wq_vnni.c) whose
 * result equals the scalar level's bit for bit; otherwise by the loops of
 * wq_rows.h. */
#define CPU_WQ_GEMM_MIN_TOKENS 16
#define CPU_WQ_GEMM_MAX_IN 16384

/* Batched matmul for the SIMD levels (gemm.c): panels of W converted to
 * f32 by to_f32 into scratch, multiplied by OpenBLAS sgemm.  Needs
 * a->in <= CPU_SCRATCH_FLOATS.  Worth it from CPU_GEMM_MIN_TOKENS tokens
 * (measured with kvtier-bench --prompt N on a TinyLlama bf16 shape: below
 * 32 tokens the conversion and small-M sgemm cost more than streaming W,
 * at 32 they tie, at 64 the panels win); below that the levels stream W
 * directly, once per 4 tokens. */
#define CPU_GEMM_MIN_TOKENS 32
void cpu_matmul_panels(const struct cpu_mm *a, int r0, int r1, float *scratch,
                       void (*to_f32)(float *y, const void *x, enum be_dtype dt, size_t n));

/* bf16 weights times tokens rounded to bf16 (bf16_avx512.c), on AVX512_BF16.
 * Tokens as 32-bit words of column pairs (elements 2p, 2p+1, the last
 * padded with zero): below CPU_BF16_GEMM_MIN_TOKENS tokens (decode) one
 * row of words per token (cpu_bf16_row_words apart), streamed against
 * every weight row; from there in tiles of CPU_BF16_MR tokens, pair-major
 * (word p * CPU_BF16_MR + t for token t of a tile, tokens past n zero), for
 * the blocked product.  The threshold is where the two cost the same: both
 * read W from memory once, and on 2048 x 5632 and 5632 x 2048 matmuls
 * streaming cost less CPU time than the blocked product (packing its
 * panels) up to 24 tokens, as much at 31-32, more from 48
 * (docs/benchmarks.md, "Batched decode"). */
#define CPU_BF16_MR 12
#define CPU_BF16_GEMM_MIN_TOKENS 32
static inline size_t cpu_bf16_pairs(int in)
{
    return ((size_t)in + 1) / 2;
}
/* An odd number of 64-byte lines: token rows a multiple of 4 KiB apart
 * would share L1 sets with each other and with the weight rows streamed
 * against them (themselves often 4 KiB), and evict one another. */
static inline size_t cpu_bf16_row_words(int in)
{
    return ((cpu_bf16_pairs(in) + 15) / 16 | 1) * 16;
}
static inline size_t cpu_bf16_act_words(int n, int in)
{
    if (n < CPU_BF16_GEMM_MIN_TOKENS)
        return (size_t)n * cpu_bf16_row_words(in);
    return ((size_t)n + CPU_BF16_MR - 1) / CPU_BF16_MR * CPU_BF16_MR * cpu_bf16_pairs(in);
}
void cpu_bf16_pack_act_avx512(uint32_t *xb, const float *x, int n, int in);
void cpu_matmul_bf16_avx512(const struct cpu_mm *a, int r0, int r1, float *scratch);
/* The avx512bf16 level's dot and axpy for a bf16 cache (bf16_avx512.c):
 * queries and weights rounded to bf16, products on vdpbf16ps. */
void cpu_attn_dot_bf16_avx512(float *s, const float *q, int nq, const char *const *rows, int n, int nrows);
void cpu_attn_axpy_bf16_avx512(float *y, const float *a, int nq, const char *const *rows, size_t off, int n,
                               int nrows, bool odd);

/* AVX-512 tiles, shared by the dense and the quantized kernels: rows are
 * widened 16 at a time, up to CPU_ROWS16_COLS columns each, into an f32
 * tile (row r at w + r * CPU_ROWS16_COLS, 64-byte aligned; zero past nc)
 * that every one of the nq query heads then reads.  widen fills a tile
 * from rows r0 .. r0+nr, columns c0 .. c0+nc of src, whatever src holds. */
#define CPU_ROWS16_COLS 128
typedef void cpu_widen16_fn(float *w, const void *src, int r0, int nr, int c0, int nc);
/* dot:  out[g * rows + r] = sum_i in[g * is + i] * row r [i]
 * axpy: out[g * os + i] += sum over r of in[g * rows + r] * row r [i]
 * for g < nq over rows rows of n columns. */
void cpu_tiles_avx512(bool dot, float *out, size_t os, const float *in, size_t is, int nq, cpu_widen16_fn *widen,
                      const void *src, int n, int rows);

/* Picks the table: $KVTIER_SIMD (scalar|avx2|avx512|avx512vnni|avx512bf16) when set and the CPU
 * can run it, else the best the CPU supports.  NULL when $KVTIER_SIMD
 * names a level this CPU cannot run or an unknown one. */
const struct cpu_kern *cpu_kern_select(void);

/* ---- op drivers (ops.c) ------------------------------------------------- */

struct cpu_ctx;
struct cpu_pool *cpu_ctx_pool(struct cpu_ctx *c);
const struct cpu_kern *cpu_ctx_kern(struct cpu_ctx *c);
float *cpu_ctx_scratch(struct cpu_ctx *c, int ith); /* CPU_SCRATCH_FLOATS floats */
/* A caller-thread work area of at least n floats, 64-byte aligned, grown
 * (never shrunk, its contents not kept) on demand: NULL when host memory
 * runs out. */
float *cpu_ctx_rows(struct cpu_ctx *c, size_t n);

enum be_status cpu_matmul(void *ctx, void *y, enum be_dtype yt, const void *x, const void *w, enum be_dtype wt, const float *bias,
                          int n, int in, int out);
enum be_status cpu_rmsnorm(void *ctx, void *y, const void *x, const float *w, int n, int dim, float eps);
enum be_status cpu_rope(void *ctx, void *x, int n_tok, int n_heads, int head_dim, const int64_t *pos,
                        const float *inv_freq, int rot_dim, float mscale, enum be_rope_layout layout);
enum be_status cpu_kv_store(void *ctx, const struct be_kv_view *views, const struct be_tok *toks, int n_tok,
                            const void *k, const void *v, const struct be_attn_params *p);
enum be_status cpu_attention(void *ctx, void *out, const void *q, const struct be_kv_view *views,
                             const struct be_tok *toks, int n_tok, const struct be_attn_params *p);
enum be_status cpu_silu_mul(void *ctx, void *y, const void *gate, const void *up, size_t n);
enum be_status cpu_ssm_conv(void *ctx, void *y, const void *x, const struct be_ssm_view *views,
                            const struct be_tok *toks, int n_tok, const struct be_ssm_params *p);
enum be_status cpu_ssm_scan(void *ctx, void *y, const void *x, const void *dt_raw, const void *B, const void *C,
                            const void *z, const struct be_ssm_view *views, const struct be_tok *toks, int n_tok,
                            const struct be_ssm_params *p);
enum be_status cpu_gelu_mul(void *ctx, void *y, const void *gate, const void *up, size_t n);
enum be_status cpu_act(void *ctx, void *x, size_t n, enum be_act act);
enum be_status cpu_scale(void *ctx, void *x, size_t n, float s);
enum be_status cpu_layernorm(void *ctx, void *y, const void *x, const float *w, const float *b, int n, int dim,
                             float eps);
enum be_status cpu_add(void *ctx, void *y, const void *x, size_t n);
enum be_status cpu_softmax(void *ctx, void *x, int rows, int cols);
enum be_status cpu_embed(void *ctx, void *y, const void *table, enum be_dtype dt, const int32_t *ids, int n,
                         int dim);
enum be_status cpu_argmax(void *ctx, const void *x, int rows, int cols, int32_t *out);

/* Address of the K row of (kv head, position) in a view; V is at
 * + v_offset.  The caller checked that pos lies inside the blocks. */
char *cpu_kv_row(const struct be_kv_view *v, int64_t pos, int kvh, int head_dim, size_t esz);
/* The same for a key_rope view: a sink (pos < sinks) is in the sink block,
 * laid out as block 0; any other position through the view's blocks. */
const char *cpu_key_row(const struct be_kv_view *v, int64_t pos, int kvh, int head_dim, size_t esz);
/* Rotates x, the f32 key stored before RoPE at pos, into out at its index
 * in the cache (pos for a sink, else pos - shift) with the same products as
 * cpu_rope, so out equals the key be_rope would have stored there. */
void cpu_key_rope(const struct be_attn_params *p, const struct be_kv_view *v, int64_t pos, const float *x,
                  float *out);

/* Asks for the cache lines of [p, p + bytes) ahead of their use: attention
 * reads each block's rows once, a few kilobytes at a time, too little for
 * the hardware prefetcher to get ahead of. */
static inline void cpu_prefetch(const void *p, size_t bytes)
{
    for (size_t i = 0; i < bytes; i += 64)
        __builtin_prefetch((const char *)p + i);
}

/* How many keys attention prefetches past the chunk it computes: a chunk
 * of quantized codes computes in less time than memory takes to answer. */
#define CPU_PREFETCH_KEYS 192

/* ---- attention driver (ops.c), for the dense and the quantized caches ---- */

/* Attention runs per (tile, kv head): the nq = n_heads / n_kv_heads query
 * heads of up to CPU_ATTN_TILE tokens of one sequence (at most
 * CPU_ATTN_TILE_ROWS query rows) read each K and V row once, widened once
 * for all of them, so a long prompt reads its keys once per tile rather
 * than once per token.  A source's keys are in one order (the positions,
 * for a dense view without sinks), cut into pieces at the multiples of
 * CPU_ATTN_PIECE and into chunks at the multiples of a chunk size: the
 * same cuts whatever the tile, the batch or the thread count, so a token's
 * result does not depend on them.  Each piece has its own softmax state,
 * merged in order: a decode step's few (token, kv head) pairs then spread
 * their pieces over every thread. */
#define CPU_ATTN_PIECE 1024
#define CPU_ATTN_TILE 64
#define CPU_ATTN_TILE_ROWS 128

/* The softmax state of a piece for some query rows: running max m[r] and
 * sum l[r], and the unnormalised output o[r * head_dim + i]. */
struct cpu_attn_part {
    float *m, *l, *o;
};

/* The queries of a tile: n tokens of one sequence, q[n][nq][head_dim];
 * token j, at position pos[j], reads the keys [from[j], to[j]) (none when
 * from[j] >= to[j]). */
struct cpu_attn_tile {
    int n;
    const float *q;
    int64_t pos[CPU_ATTN_TILE], from[CPU_ATTN_TILE], to[CPU_ATTN_TILE];
};

/* Caps n scaled scores in place: s -> cap * tanh(s / cap); cap 0 leaves
 * them as they are. */
void cpu_attn_softcap(float *s, int n, float cap);
/* Adds p->rel_bias (none: nothing) to the scores s[a, b) of the keys at
 * positions u0 + a.. for the query at qpos, query head h: as be_attention
 * and be_attention_quant both bias their scaled, capped scores. */
void cpu_attn_rel_bias(const struct be_attn_params *p, int h, int64_t qpos, float *s, int64_t u0, int a, int b);

/* Folds the raw scores of keys [a, b) of a chunk, row g's at s + g * ss,
 * into nq rows of pt: each row's max and sum, rescaling its o when the max
 * grows; leaves each key's unnormalised weight in s, 0 outside [a, b). */
void cpu_attn_fold(const struct cpu_kern *k, struct cpu_attn_part *pt, float *s, size_t ss, int nq, int a, int b,
                   int head_dim);

/* Floats of scratch a piece may use (the rest holds the pieces' states). */
#define CPU_ATTN_WORK (CPU_SCRATCH_FLOATS / 2)

/* The keys a tile's tokens read from a full-precision view (positions;
 * below v->sinks: its sink block) of kv head kvh, folded into pt (t->n * nq
 * rows). */
void cpu_attend_span(const struct cpu_kern *k, const struct be_attn_params *p, const struct be_kv_view *v, int kvh,
                     const struct cpu_attn_tile *t, struct cpu_attn_part *pt, float *scratch);
/* Floats of scratch cpu_attend_span uses for a tile of n_tok tokens. */
size_t cpu_attend_span_work(const struct be_attn_params *p, int n_tok);

/* What the dense and the quantized caches differ in: which keys a token
 * reads, whether a sequence's tokens share tiles, and attending keys
 * [c0, c1) of them into pt, which the driver has reset. */
struct cpu_attn_src {
    const struct be_attn_params *p;
    const void *views;
    /* token t reads the keys [*c0, *c1) of the source's order */
    void (*keys)(const struct cpu_attn_src *s, const struct be_tok *t, int64_t *c0, int64_t *c1);
    /* NULL (never), or whether the tokens of view v may share a tile */
    bool (*tiles)(const struct cpu_attn_src *s, int view);
    /* the n tokens toks (one view; one unless tiles) with queries
     * q[n][nq][head_dim], each reading its keys within [c0, c1), into pt
     * (n * nq rows) */
    void (*piece)(const struct cpu_attn_src *s, const struct cpu_kern *k, const struct be_tok *toks, int n, int kvh,
                  const float *q, int64_t c0, int64_t c1, struct cpu_attn_part *pt, float *scratch);
};

/* out = attention of every token of toks over src, on the pool.
 * BE_ENOTSUP when a piece's state does not fit the scratch. */
enum be_status cpu_attn_run(struct cpu_ctx *c, const struct cpu_attn_src *src, float *out, const float *q,
                            const struct be_tok *toks, int n_tok);

/* ---- quantized KV (attn_quant*.c) ------------------------------------------ */

/* Inner loops over the codes of backend.h's quantized blocks: rows of n
 * codes nbits wide (1..8), packed little-endian from the first bit of c,
 * row r at c + r * stride bytes (a kv head's token rows in a block, or one
 * group of them).  Taking a chunk of rows per call keeps a call per key out
 * of the attention's inner loop. */
struct cpu_qkern {
    const char *name;
    /* s[g * rows + r] = sum x[g * xs + i] * code_i of row r, for nq vectors
     * x (the query heads of a kv head): each row is widened once for all */
    void (*qdot)(float *s, const float *x, size_t xs, int nq, const uint8_t *c, size_t stride, int nbits, int n,
                 int rows);
    /* y[g * ys + i] += sum over rows of a[g * rows + r] * code_i of row r */
    void (*qaxpy)(float *y, size_t ys, const float *a, int nq, const uint8_t *c, size_t stride, int nbits, int n,
                  int rows);
    /* s[i], b[i]: group i's f16 (scale, zero) pair at pr + i * step as the
     * c*s + b of codes of kind (affine) */
    void (*params)(float *s, float *b, const uint16_t *pr, size_t step, int n, enum be_kvq_codes kind);
    /* the same for rows of n e4m3 codes, x and y rows n apart */
    void (*e4m3_dot)(float *s, const float *x, int nq, const uint8_t *c, size_t stride, int n, int rows);
    void (*e4m3_axpy)(float *y, const float *a, int nq, const uint8_t *c, size_t stride, int n, int rows);
};

extern const struct cpu_qkern cpu_qkern_scalar;
extern const struct cpu_qkern cpu_qkern_avx512;

/* The scalar loops, for the bit widths and tails a SIMD table leaves. */
void cpu_qdot_scalar(float *s, const float *x, size_t xs, int nq, const uint8_t *c, size_t stride, int nbits, int n,
                     int rows);
void cpu_qaxpy_scalar(float *y, size_t ys, const float *a, int nq, const uint8_t *c, size_t stride, int nbits, int n,
                      int rows);
void cpu_params_scalar(float *s, float *b, const uint16_t *pr, size_t step, int n, enum be_kvq_codes kind);
void cpu_e4m3_dot_scalar(float *s, const float *x, int nq, const uint8_t *c, size_t stride, int n, int rows);
void cpu_e4m3_axpy_scalar(float *y, const float *a, int nq, const uint8_t *c, size_t stride, int n, int rows);

/* The quantized table of the same level as k (scalar below AVX-512). */
const struct cpu_qkern *cpu_qkern_for(const struct cpu_kern *k);

enum be_status cpu_attention_quant(void *ctx, void *out, const void *q, const struct be_kvq_view *views,
                                   const struct be_tok *toks, int n_tok, const struct be_attn_params *p);

/* The block writer (kvq_codec.c). */
enum be_status cpu_kvq_quantize(void *ctx, const struct be_kvq_view *v, int64_t end);
enum be_status cpu_kvq_dequantize(void *ctx, const struct be_kvq_view *v, int64_t p0, int64_t p1,
                                  const struct be_kv_view *dst);
enum be_status cpu_kv_absmax(void *ctx, const struct be_kv_view *v, enum be_dtype dt, int n_kv_heads, int head_dim,
                             int64_t p0, int64_t p1, float amax[2]);
enum be_status cpu_kv_copy(void *ctx, const struct be_kv_view *dst, const struct be_kv_view *src, int64_t p0,
                           int64_t p1, const struct be_attn_params *p);

#endif
