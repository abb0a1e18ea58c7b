/* kvfile.h - a sequence's KV as a safetensors file: the format of a
 * session's export and import (docs/api.md "KV export and import").
 *
 * The file is Hugging Face's legacy cache made portable: for every layer l
 * the tensors past_key_values.{l}.key and past_key_values.{l}.value, shape
 * [1, n_kv_heads, rows_l, head_dim], dtype F32, F16 or BF16 (as stored),
 * rows_l the positions the layer holds (a sliding layer's last ones), and
 * string metadata: format "kvtier-kv", version, model_fingerprint (16 hex
 * digits), tokens (a JSON array of the token ids, as a string), strategy,
 * dtype.  The header is padded with spaces to a multiple of 8 bytes and
 * every tensor starts on an 8-byte boundary of the file, in the order
 * layer 0 key, layer 0 value, layer 1 key, ...
 * An encoder-decoder model's file (Hugging Face's EncoderDecoderCache,
 * whose legacy form is (key, value, cross key, cross value) per layer)
 * adds the encoder input as __metadata__.encoder_input (a JSON array of
 * ids, as a string) and, after each layer's value, the decoder's
 * cross-attention past_key_values.{l}.cross_key and .cross_value of shape
 * [1, n_kv_heads, input tokens, head_dim].
 * A state-space model's file (Mamba; __metadata__.layout "state", dtype
 * f32) holds its state instead, per layer conv_states.{l} [1, d_inner,
 * d_conv - 1], the convolution's last inputs oldest first (Hugging Face's
 * MambaCache.conv_states[l][..., 1:]: the oldest of its d_conv columns is
 * never read again), and ssm_states.{l} [1, d_inner, d_state].  The
 * session's checkpoints follow, each under the same names prefixed with
 * checkpoint.{i}. (checkpoint.{i}.conv_states.{l}, ...), and their
 * positions are __metadata__.checkpoint_positions (a JSON array as a
 * string, ascending multiples of the checkpoint interval, at most the
 * tokens; absent or empty: none): a client that knows MambaCache's names
 * only reads the state and ignores them.
 * A quantized cache's raw export (docs/api.md "Raw quantized export") is
 * laid out by the daemon with kvfile_build_tensors; the parser reads it
 * back when the caller says which formats it takes (kvfile_expect.quant).
 * Its residual is in the store's KV dtype, the file's dtype.
 * An encoder-decoder one adds the encoder input and, after each layer's
 * six tensors, its cross_key and cross_value as above (F32).
 */
#ifndef KVTIER_KVFILE_H
#define KVTIER_KVFILE_H

#include <stddef.h>
#include <stdint.h>

#include "model/model.h"

#define KVFILE_FORMAT "kvtier-kv"
#define KVFILE_VERSION 1

/* The safetensors name of a KV dtype: "F32", "F16" or "BF16". */
const char *kvfile_dtype_name(enum be_dtype dt);

/* What a file says about its KV. */
struct kvfile_info {
    uint64_t fingerprint; /* model_fingerprint of the model that computed it */
    const char *strategy; /* the cache strategy it was exported from (informative) */
    enum be_dtype dtype;
    int n_layers, n_kv_heads, head_dim;
    const int64_t *rows;     /* [n_layers] */
    const int32_t *tokens;   /* [n_tokens] */
    int64_t n_tokens;
    const int32_t *input;    /* an encoder-decoder cache's encoder input [n_input]; 0: none */
    int64_t n_input;
};

/* The largest header a file for a context of ctx tokens may have: the
 * token ids dominate it. */
size_t kvfile_header_max(int64_t ctx);
/* The largest file of a model's geometry and context: every layer holding
 * ctx f32 rows, plus the header and padding.  0 when it overflows. */
size_t kvfile_max_size(int n_layers, int n_kv_heads, int head_dim, int64_t ctx);

/* The largest file of a state-space model (layout "state") for a context
 * of ctx tokens, with a checkpoint every `interval` of them; 0 when it
 * overflows. */
size_t kvfile_state_max_size(int n_layers, int d_inner, int d_state, int d_conv, int64_t ctx, int interval);
/* A state file for info (its tokens, strategy, fingerprint) holding
 * `state`: n_layers states as be_ssm lays them out (the window as
 * (d_conv - 1, d_inner), then h as (d_inner, d_state)), f32, followed by
 * n_ckpt more, the checkpoints at ckpt_pos (not checked: the store's own).
 * MODEL_ENOMEM, or MODEL_EINVAL for sizes out of range. */
enum model_status kvfile_build_state(const struct kvfile_info *info, int d_inner, int d_state, int d_conv,
                                     const float *state, const int64_t *ckpt_pos, int n_ckpt, void **out,
                                     size_t *size, char *err);

/* Lays out a file for info: *out (malloc'ed, *size bytes) holds the header
 * and zeroed data; k_off[l], v_off[l] are where layer l's K and V start in
 * it, for the caller to fill ([n_kv_heads, rows_l, head_dim] each), and
 * with an encoder input k_off[n_layers + l], v_off[n_layers + l] its cross
 * K and V ([n_kv_heads, n_input, head_dim]).
 * MODEL_ENOMEM, or MODEL_EINVAL for sizes that overflow. */
enum model_status kvfile_build(const struct kvfile_info *info, void **out, size_t *size, size_t *k_off,
                               size_t *v_off, char *err);

/* One tensor of a file kvfile_build_tensors lays out: its name, its
 * safetensors dtype ("F32", "F16", "BF16", "U8") and shape; off is set to
 * where its data starts in the file. */
#define KVFILE_MAX_DIMS 5
#define KVFILE_MAX_TENSORS (1 << 24) /* a state file: two per layer and checkpoint */
struct kvfile_tensor {
    char name[64];
    const char *dtype;
    int ndim;
    int64_t shape[KVFILE_MAX_DIMS];
    size_t off;
};

/* kvfile_build with any tensors, in the order given, and metadata beyond
 * info's: meta_kv holds key, value, key, value, ..., NULL (or is NULL). */
enum model_status kvfile_build_tensors(const struct kvfile_info *info, const char *const *meta_kv,
                                       struct kvfile_tensor *t, int n, void **out, size_t *size, char *err);

/* What a file must match to be imported. */
struct kvfile_expect {
    uint64_t fingerprint;
    int n_layers, n_kv_heads, head_dim;
    int64_t max_tokens; /* the context */
    /* > 0: an encoder-decoder model's file, which must carry an encoder
     * input of at most this many ids and the cross K and V; 0: none may */
    int64_t max_input;
    int vocab_size;     /* token ids in [0, vocab_size) */
    /* rows_l a file of n tokens must have for layer l */
    int64_t (*rows)(void *ctx, int layer, int64_t n);
    void *rows_ctx;
    /* A raw quantized file (__metadata__.layout "quantized"): the layout of
     * the blocks its __metadata__.quantization names, or MODEL_EINVAL with
     * err saying why not; called with rows_ctx.  NULL: raw files are
     * refused. */
    enum model_status (*quant)(void *ctx, const char *quantization, struct be_kvq_format *fmt, char *err);
    /* A raw file's __metadata__.dtype and its residual tensors' dtype must
     * be this: the store's KV dtype, the residual's bytes as stored. */
    enum be_dtype raw_dtype;
    /* > 0: a state-space model's, whose files have layout "state" and
     * these dimensions (n_kv_heads, head_dim, rows are not read) */
    int ssm_inner, ssm_state, ssm_conv;
    int ssm_ckpt_interval; /* checkpoint positions are multiples of it; 0: none taken */
};

/* A raw file's layer l: the fields of its q_layers entry, the block count
 * they imply, and pointers into the buffer; index 0 is K, 1 is V. */
struct kvfile_qlayer {
    int64_t lo, nq, first_block, residual; /* residual = n_tokens - nq */
    int n_blocks;
    const void *codes[2];  /* [n_blocks, H, T, D*nbits/8] u8 */
    const void *params[2]; /* [n_blocks, H, T/gt, D/gd, 2] f16; NULL for e4m3 */
    float scale[2];        /* e4m3's tensor scales; 0 for the affine kinds */
    const void *res[2];    /* [H, residual, D] of dtype */
};

/* A parsed file: pointers into the caller's buffer, which must outlive it. */
struct kvfile {
    enum be_dtype dtype;
    int64_t n_tokens;
    int32_t *tokens;        /* owned */
    const void **k, **v;    /* [n_layers] into the buffer; owned arrays */
    int n_layers;
    /* a raw file: its layers (owned; NULL for a dense file, whose k, v
     * are then set), their format, and its quantization (owned) */
    struct kvfile_qlayer *q;
    struct be_kvq_format fmt;
    char *quantization;
    /* an encoder-decoder file's input (owned) and cross K and V [n_layers]
     * into the buffer (owned arrays; a raw file's too); NULL, 0 otherwise */
    int32_t *input;
    int64_t n_input;
    const void **ck, **cv;
    /* a state file's state, as be_ssm lays it out per layer, followed by
     * n_ckpt checkpoints' at ckpt_pos (both owned); NULL, 0 otherwise */
    float *state;
    int64_t *ckpt_pos;
    int n_ckpt;
};

/* Checks buf[0, len) completely against e before anything the KV needs is
 * allocated: the header length (at most kvfile_header_max), the JSON, the
 * metadata (format, version, fingerprint, tokens), exactly the expected
 * tensors with their dtype, shape and data offsets (in range, aligned, not
 * overlapping, the sizes their shapes need); for a raw file also its
 * quantization (e->quant), q_block_tokens and every q_layers entry against
 * the positions a quantized cache of the tokens holds, and the six tensors
 * per layer of the shapes they imply (and an encoder-decoder file's cross
 * K and V); for a state file its checkpoint positions (ascending multiples
 * of e->ssm_ckpt_interval in (0, tokens]) and the two tensors per layer of
 * e's dimensions for the state and each checkpoint, gathered into
 * out->state.  MODEL_ECONFIG when the file
 * was written for another model (model_fingerprint or the geometry),
 * MODEL_EINVAL for more tokens than the context or an id out of the
 * vocabulary, MODEL_EFORMAT for anything else malformed, MODEL_ENOMEM;
 * err names the tensor or field. */
enum model_status kvfile_parse(const void *buf, size_t len, const struct kvfile_expect *e, struct kvfile *out,
                               char *err);
void kvfile_release(struct kvfile *f); /* accepts a zeroed one */

#endif
