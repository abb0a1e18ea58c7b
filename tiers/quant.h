/* quant.h - quantized KV: the "quantized" cache strategy's parameters, the
 * packed block formats (backend.h's be_kvq_format), and the KIVI layer -
 * one layer of one sequence as Hugging Face's QuantizedLayer keeps it, over
 * paged blocks whose codes the backend writes (be_kvq_quantize).
 * docs/quantization.md explains the formats and every deviation from the
 * reference.
 *
 * The layer follows the store's transaction: kvq_layer_reserve(n) takes
 * every block the step could need (all or nothing), the forward pass writes
 * the new tokens with be_kv_store into view.rest and reads with
 * be_attention_quant, then kvq_layer_commit() applies the KIVI rule (only a
 * device error can fail it) or kvq_layer_abort() undoes the reserve.
 */
#ifndef KVTIER_QUANT_H
#define KVTIER_QUANT_H

#include <jansson.h>

#include "backend/backend.h"
#include "tiers/kvstore.h"
#include "tiers/quant_params.h"

#define KVQ_PARAM_LEN 40
#define KVQ_MSG_LEN 240

/* An invalid parameter: the request field ("cache.nbits") and a message
 * naming it and its allowed values. */
struct kvq_error {
    char param[KVQ_PARAM_LEN];
    char msg[KVQ_MSG_LEN];
};

/* Bounds kvtier adds to the reference's "> 0" / ">= 0" so that sizes stay
 * small: a group is at most one block's scratch, the residual at most what
 * a long prompt holds anyway. */
#define KVQ_MAX_GROUP 1024
#define KVQ_MAX_RESIDUAL 65536

const char *kv_quant_backend_name(enum kv_quant_backend b);
/* The reference defaults for backend b: nbits 4, axes 0, group 64, residual 128. */
struct kv_quant_params kv_quant_defaults(enum kv_quant_backend b);
/* TIER_EINVAL with *err filled when p breaks the reference validation (plus
 * the kvtier extension quanto nbits 8). */
enum tier_status kv_quant_validate(const struct kv_quant_params *p, struct kvq_error *err);
/* Reads a request's "cache" object ({"implementation": "quantized",
 * "backend": ..., ...}; NULL: all defaults) into *out and validates it.
 * Unknown keys, wrong JSON types and, for fp8, any of nbits, axis_key,
 * axis_value, q_group_size, residual_length are errors. */
enum tier_status kv_quant_parse(const json_t *cache, struct kv_quant_params *out, struct kvq_error *err);
/* The format's parameters kv_quant_parse reads, for messages that list
 * them, and whether key is one of them. */
#define KV_QUANT_PARAM_NAMES "backend, nbits, axis_key, axis_value, q_group_size, residual_length"
bool kv_quant_is_param(const char *key);

/* ---- formats -------------------------------------------------------------- */

/* Tokens per quantized block for a store whose blocks hold store_bt tokens:
 * store_bt, rounded up to whole per-channel groups when an axis is per
 * channel. */
int kvq_block_tokens(const struct kv_quant_params *p, int store_bt);
/* Resolves p's packed layout for n_kv_heads x head_dim and blocks of
 * block_tokens tokens.  TIER_EINVAL naming q_group_size (or head_dim) when
 * the groups do not tile the block: per-token groups must divide head_dim
 * (a group larger than head_dim is one whole head row) and hold a whole
 * number of bytes of codes; per-channel groups must divide block_tokens. */
enum tier_status kvq_format_init(struct be_kvq_format *f, const struct kv_quant_params *p, int n_kv_heads,
                                 int head_dim, int block_tokens, struct kvq_error *err);
/* kvq_format_init for a sequence of store s: its geometry and its blocks
 * (kvq_block_tokens of its block size), the format every quantized
 * sequence of s is built with.  It reads only what s fixed when it opened
 * and keeps no message in s, so any thread may ask, before a sequence
 * exists: a cache refused here is refused by kv_seq_create. */
enum tier_status kvq_store_format(const kv_store *s, const struct kv_quant_params *p, struct be_kvq_format *f,
                                  struct kvq_error *err);

/* The fp8 tensor scale of x[n]: max|x| / 448, or 1 when x is all zeros. */
float kvq_e4m3_scale(const float *x, size_t n);

/* ---- the KIVI layer ------------------------------------------------------- */

enum kvq_block_kind {
    KVQ_BLOCK_QUANT = 0, /* fmt->block_bytes */
    KVQ_BLOCK_FULL = 1,  /* f32 K and V of store_bt tokens, the store's layout (be_kv_view) */
};

/* Where blocks come from (the store's tiers, later).  get returns NULL when
 * out of memory; blocks are returned with put. */
struct kvq_alloc {
    void *ctx;
    void *(*get)(void *ctx, enum kvq_block_kind kind);
    void (*put)(void *ctx, enum kvq_block_kind kind, void *block);
};

typedef struct kvq_ctx kvq_ctx;     /* per store: format, allocator, scratch */
typedef struct kvq_layer kvq_layer; /* one layer of one sequence */

/* store_bt: tokens per full-precision block (the store's block size); be
 * writes the codes into the blocks a hands out. */
enum tier_status kvq_ctx_create(be_backend *be, const struct kv_quant_params *p, enum be_dtype dtype, int n_kv_heads, int head_dim,
                                int store_bt, const struct kvq_alloc *a, kvq_ctx **out, struct kvq_error *err);
void kvq_ctx_free(kvq_ctx *c); /* accepts NULL; every layer must be freed first */
const struct be_kvq_format *kvq_ctx_format(const kvq_ctx *c);
size_t kvq_full_block_bytes(const kvq_ctx *c);

enum tier_status kvq_layer_create(kvq_ctx *c, kvq_layer **out);
void kvq_layer_free(kvq_layer *l); /* accepts NULL; returns its blocks */

/* HF get_seq_length(): every committed token. */
int64_t kvq_layer_length(const kvq_layer *l);
/* Committed tokens held quantized / in the full-precision residual. */
int64_t kvq_layer_quantized(const kvq_layer *l);
int64_t kvq_layer_residual(const kvq_layer *l);
/* Bytes of the blocks the layer holds. */
size_t kvq_layer_bytes(const kvq_layer *l);

/* Room for n_new tokens at positions [length, length + n_new) in view.rest,
 * plus the quantized blocks the commit may fill.  more: these tokens are
 * not the last part of their update (one forward call of HF's over an
 * input fed here in several steps), so the commit keeps them in the
 * residual and the rule below acts at the last part.  TIER_ENOMEM_DEV
 * leaves the layer as it was. */
enum tier_status kvq_layer_reserve(kvq_layer *l, int n_new, bool more);
/* The view attention reads; valid until the next reserve, commit or abort. */
void kvq_layer_view(const kvq_layer *l, struct be_kvq_view *out);
/* Makes the reserved tokens part of the layer.  The first update quantizes
 * everything; after it, when the residual is non-empty and residual + 1 >=
 * residual_length, the residual and the new tokens are quantized (HF's test),
 * else the new tokens join the residual.  fp8 quantizes at every commit.
 * A backend failure is a device fault: the layer is then not usable. */
enum be_status kvq_layer_commit(kvq_layer *l);
void kvq_layer_abort(kvq_layer *l);
/* Between steps: returns the quantized blocks wholly below position lo (a
 * sliding layer's oldest kept position), except the block a later flush
 * reopens.  The view then starts at the first block kept. */
void kvq_layer_drop(kvq_layer *l, int64_t lo);
/* A fresh layer (never reserved) takes the state of one whose view had
 * hi = nq, base = qoff * block_tokens, rest.hi = len and these scales
 * (tiers/image.c), with the blocks that state holds: the quantized ones
 * from block qoff to the one holding nq - 1 and, when nq < len, the
 * full-precision ones from the block holding nq to the one holding len - 1.
 * Their contents are the caller's to write through kvq_layer_view.  nq ==
 * 0 < len is a first update whose parts were committed and nothing yet
 * quantized: the next update completes it.
 * TIER_EINVAL unless 0 <= nq <= len and 0 <= qoff <= nq / block_tokens;
 * TIER_ENOMEM_DEV (any failed get) leaves the layer fresh. */
enum tier_status kvq_layer_restore(kvq_layer *l, int64_t len, int64_t nq, int64_t qoff, float scale_k,
                                   float scale_v);
/* Between steps: replaces every block pointer b the layer holds by
 * map(ctx, kind, b) (moving its blocks to another tier). */
void kvq_layer_remap(kvq_layer *l, void *(*map)(void *ctx, enum kvq_block_kind kind, void *block), void *ctx);

#endif
