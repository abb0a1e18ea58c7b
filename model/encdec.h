/* encdec.h - encoder-decoder models: T5ForConditionalGeneration and
 * BartForConditionalGeneration, their configuration, weights and the two
 * forward passes (the encoder over a whole input, the decoder a step at a
 * time).
 *
 * The decoder's cache is two sequences of one KV store (model_kv_geom's
 * counterpart encdec_kv_geom: the decoder's layers): `self` grows by each
 * step's tokens as a decoder-only model's does, under any dense strategy;
 * `cross` is written once by encdec_encode (every decoder layer's K and V
 * of the encoder output) and only read afterwards.  So crop applies to
 * self alone, and forks of both share the cross blocks copy-on-write (a
 * cross sequence is never written again, so never copied).
 */
#ifndef KVTIER_ENCDEC_H
#define KVTIER_ENCDEC_H

#include "model/model.h"

#define ENCDEC_T5_CTX (1 << 16)

struct encdec_config {
    bool bart;                 /* else T5 */
    const char *arch_name;     /* "T5ForConditionalGeneration", ... (static) */
    int vocab_size;
    int d_model;
    int n_heads;               /* both stacks', every head its own K and V */
    int head_dim;              /* T5: d_kv; BART: d_model / heads */
    int ffn;                   /* T5: d_ff; BART: encoder_ffn_dim = decoder_ffn_dim */
    int n_enc_layers, n_dec_layers;
    float eps;                 /* T5: layer_norm_epsilon; BART: LayerNorm's 1e-5 */
    bool tie;                  /* tie_word_embeddings (T5: the head scales by d_model^-0.5) */
    /* T5 */
    bool gated;                /* feed_forward_proj gated-gelu (tanh GELU), else relu */
    int num_buckets, max_distance; /* relative_attention_num_buckets, _max_distance */
    /* BART */
    int max_positions;         /* max_position_embeddings (the table has 2 more rows) */
    bool scale_embedding;      /* embeddings times sqrt(d_model) */
    enum be_dtype dtype;       /* torch_dtype */
    int32_t decoder_start_token_id, eos_token_id;
    uint64_t config_hash;      /* as model_config's */
};

/* True when dir's config.json names an encoder-decoder architecture this
 * file runs (model_load refuses those: they need the calls below). */
bool encdec_is_encdec(const char *dir);

typedef struct encdec encdec;

/* dir's config.json, checked as encdec_load checks it. */
enum model_status encdec_config_load(const char *dir, struct encdec_config *c, char *err);
/* The decoder's positions: BART's max_position_embeddings, or
 * ENCDEC_T5_CTX for T5, whose relative positions have no end. */
int encdec_context(const struct encdec_config *c);
/* model_device_bytes' counterpart, from the config alone: what
 * encdec_load and the passes charge a backend of caps, with p's
 * max_batch_tokens and kv_dtype.  weights: the copies a backend without
 * unified memory gets, plus T5's two position bias tables, which every
 * backend holds; activations: the step's buffers and encdec_encode's
 * residual stream for an input of max_input tokens; kv_per_token: one
 * token of either cache (every decoder layer's K and V), a decoder
 * token's in the self cache, an input token's in the cross cache. */
struct model_device_bytes encdec_device_bytes(const struct encdec_config *c, struct be_caps caps,
                                              const struct model_params *p, int64_t max_input);

/* Loads dir on be; p's max_batch_tokens and kv_dtype apply (NULL:
 * defaults).  The weights are read from the mmap, or uploaded where the
 * backend cannot read host memory (cpu-strict).  The CPU backends only:
 * another is refused (MODEL_EUNSUPPORTED, err naming what it lacks). */
enum model_status encdec_load(const char *dir, be_backend *be, const struct model_params *p, encdec **out,
                              char *err);
void encdec_free(encdec *m); /* accepts NULL */
const struct encdec_config *encdec_get_config(const encdec *m);
/* The geometry of the store both sequences live in. */
struct kv_geom encdec_kv_geom(const encdec *m);
/* As model_fingerprint: a hash of config.json and the weights' names,
 * dtypes and shapes, which the disk tier's files record. */
uint64_t encdec_fingerprint(const encdec *m);

/* Runs the encoder over ids[0, n) and writes every decoder layer's
 * cross-attention K and V of its output into cross, an empty sequence of a
 * dense strategy that stays on the device (dynamic or static: it is the
 * encoder's scratch too).  Encoder attention reads its K and V in the
 * store's dtype, as the cache holds them.  BART's input, like its
 * decoder's tokens, ends at max_position_embeddings (MODEL_EINVAL past it).
 * On failure cross is empty. */
enum model_status encdec_encode(encdec *m, kv_seq *cross, const int32_t *ids, int n);

/* Feeds ids[0, n) to the decoder after self's tokens, attending to cross
 * (filled by encdec_encode; it may since have moved to the host tier,
 * kv_seq_offload, from where each step streams it layer by layer through
 * the device slots with self's streamed layers); logits (host, [vocab] f32,
 * may be NULL) of the last one.  Transactional as model_forward: on failure self is unchanged.
 * As model_forward, a step that runs out of device memory is redone with
 * the self cache, then the cross cache, moved to the host tier
 * (kv_seq_stats().fallback says so), nothing recomputed.
 * self: any strategy (a quantized one gets T5's position bias as a dense
 * one does), created without the prefix cache's publishing (the decoder's tokens say nothing
 * of the encoder input they attend to). */
enum model_status encdec_decode(encdec *m, kv_seq *self, kv_seq *cross, const int32_t *ids, int n,
                                float *logits);

/* One sequence of a batched decoder step: ids[0, n) after self's tokens,
 * attending to cross; logits (host, [vocab] f32, may be NULL) of ids[n - 1]. */
struct encdec_seq {
    kv_seq *self, *cross;
    const int32_t *ids;
    int n;
    float *logits;
};
/* encdec_decode over every entry of seqs in one decoder pass: the rows of
 * all of them go through each layer together, so the weights are read
 * once per step, not once per sequence; each row keeps its own position,
 * caches, T5 bias and BART position, and its kernels give the bits it
 * gets alone.  Entries may share a cross cache (a request's choices), not
 * a self cache; every self and cross in one store.  Transactional: on
 * failure no self cache changed.  Out of device memory, the self caches,
 * then the cross caches, move to the host tier one at a time and the step
 * is redone (encdec_decode's continuation). */
enum model_status encdec_decode_batch(encdec *m, const struct encdec_seq *seqs, int n_seqs);
/* The decoder as generation and the daemon see it (gen_seq_init's eos
 * and vocab, the context): the decoder's layers, all full, with
 * encdec_context's positions.  Release with model_config_release. */
enum model_status encdec_model_config(const encdec *m, struct model_config *out);

#endif
