/* model.h - a Hugging Face decoder-only model: its configuration, its
 * (mmapped, borrowed) weights, and the batched forward pass.
 *
 * Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
 * Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM,
 * GPT2LMHeadModel and MambaForCausalLM (a state per sequence instead of KV:
 * kv_geom.state_bytes).  Errors come back as enum model_status plus a message in
 * a caller buffer of MODEL_ERR_LEN bytes naming the file and the tensor or
 * field that was wrong.
 */
#ifndef KVTIER_MODEL_H
#define KVTIER_MODEL_H

#include "tiers/kvstore.h"
#include "backend/backend.h"

#define MODEL_ERR_LEN 512
#define MODEL_MAX_EOS 8
/* The widest attention head a config may give: the kernels' scratch is
 * sized for it. */
#define MODEL_MAX_HEAD_DIM 1024

enum model_status {
    MODEL_OK = 0,
    MODEL_ENOENT = 1,       /* a required file is missing */
    MODEL_EFORMAT = 2,      /* a file is malformed (truncated, bad header, offsets out of range) */
    MODEL_ECONFIG = 3,      /* a config field is missing or nonsensical */
    MODEL_EUNSUPPORTED = 4, /* architecture, dtype or feature not supported */
    MODEL_ENOMEM = 5,       /* host memory */
    MODEL_EDEVMEM = 6,      /* device memory budget (the request may continue offloaded) */
    MODEL_EIO = 7,
    MODEL_EINVAL = 8,       /* bad argument (token id out of range, empty input) */
    MODEL_EKVFULL = 9,      /* the KV strategy cannot take more tokens (static max_cache_len) */
    MODEL_EBACKEND = 10,    /* any other backend failure */
};
const char *model_strerror(enum model_status st);
/* The statuses of the layers below as this layer's: out of device memory
 * stays distinguishable (the offloaded continuation keys on it), a full
 * store is MODEL_EKVFULL, anything else the backend's failure. */
enum model_status model_from_tier(enum tier_status st);
enum model_status model_from_be(enum be_status st);

enum model_arch { ARCH_LLAMA = 0, ARCH_MISTRAL, ARCH_QWEN2, ARCH_QWEN3, ARCH_GEMMA2, ARCH_GEMMA3, ARCH_PHI3,
                  ARCH_GPT2, ARCH_MAMBA };
enum model_act { ACT_SILU = 0, ACT_GELU_TANH }; /* the gate's activation: SwiGLU or GeGLU */
enum rope_scaling { ROPE_SCALING_NONE = 0, ROPE_SCALING_LINEAR, ROPE_SCALING_LLAMA3, ROPE_SCALING_LONGROPE };

struct model_config {
    enum model_arch arch;
    const char *arch_name;   /* "LlamaForCausalLM", ... (static string) */
    int vocab_size;
    int hidden_size;         /* dim */
    int intermediate_size;
    int n_layers;
    int n_heads;
    int n_kv_heads;
    int head_dim;            /* explicit head_dim or hidden_size / n_heads */
    int max_position_embeddings;
    float rms_norm_eps;                /* the norms' epsilon (GPT-2: layer_norm_epsilon) */
    float rope_theta;
    enum rope_scaling rope_scaling;
    float rope_factor;                 /* linear and llama3 */
    float rope_low_freq_factor;        /* llama3 */
    float rope_high_freq_factor;       /* llama3 */
    int rope_original_max_pos;         /* llama3, longrope: original_max_position_embeddings */
    /* longrope (Phi-3): short_factor and long_factor, [rot_dim / 2] each,
     * in one allocation owned by rope_short_factor.  As in transformers,
     * a forward call rotates a sequence's new tokens with long_factor when
     * its last position + 1 passes rope_original_max_pos, else with
     * short_factor; cached keys keep the table they were rotated with. */
    float *rope_short_factor;
    float *rope_long_factor;
    int rot_dim;                       /* dimensions RoPE rotates: head_dim * partial_rotary_factor; 0: GPT-2 */
    float rope_attn_factor;            /* longrope's attention_factor (cos and sin times it), else 1 */
    enum be_rope_layout rope_layout;   /* NEOX for HF checkpoints */
    bool tie_word_embeddings;
    bool attention_bias;               /* q/k/v bias (Qwen2) */
    bool o_bias;                       /* o_proj bias too (attention_bias on Llama, Qwen3, Gemma) */
    bool qk_norm;                      /* per-head RMSNorm on q and k (Qwen3, Gemma 3) */
    bool fused_qkv;                    /* Phi-3: one qkv_proj, q rows then k then v (split at load) */
    bool fused_gate_up;                /* Phi-3: one gate_up_proj, gate rows then up (split at load) */
    enum model_act act;
    /* Gemma: every RMSNorm scales by 1 + weight; the loader folds the 1
     * into its f32 copy of the weight, so the kernels see a plain RMSNorm. */
    bool norm_plus_one;
    bool sandwich_norms;               /* Gemma 2/3: attention and MLP outputs normed before the residual add */
    /* GPT-2: LayerNorm with biases for RMSNorm, learned absolute positions
     * (wpe, no RoPE: sequences end at max_position_embeddings = n_positions),
     * and an ungated MLP down(act(up(x) + b)) + b. */
    bool layer_norm;
    bool learned_pos;
    bool ungated_mlp;
    float embed_scale;                 /* 0: none; Gemma: embeddings times sqrt(hidden_size) */
    float attn_scale;                  /* the scores' scale: 1/sqrt(head_dim), Gemma query_pre_attn_scalar^-1/2 */
    float attn_softcap;                /* 0: none; else attn_logit_softcapping (Gemma 2) */
    float final_softcap;               /* 0: none; else final_logit_softcapping (Gemma 2) */
    /* 0: every layer rotates with rope_theta and rope_scaling; Gemma 3:
     * the sliding layers' base (rope_local_base_freq), unscaled. */
    float rope_local_theta;
    /* Mamba (ARCH_MAMBA): no attention (n_heads, n_kv_heads, head_dim 0);
     * each layer mixes intermediate_size channels with a causal conv of
     * ssm_conv taps and a selective scan over ssm_state states per
     * channel; max_position_embeddings is the most any position may be. */
    int ssm_state;                     /* state_size */
    int ssm_conv;                      /* conv_kernel */
    int ssm_dt_rank;                   /* time_step_rank */
    bool ssm_bias;                     /* use_bias: in_proj and out_proj */
    bool ssm_conv_bias;                /* use_conv_bias */
    int sliding_window;                /* 0 = none */
    int *layer_window;                 /* [n_layers] 0 = full, else the window (owned) */
    enum be_dtype dtype;               /* torch_dtype */
    /* tokens (from config.json, overridden by generation_config.json) */
    int32_t bos_token_id;              /* -1 = none */
    int32_t pad_token_id;              /* -1 = none */
    int32_t eos_token_ids[MODEL_MAX_EOS];
    int n_eos;
    /* xxh3 of config.json re-serialized with sorted keys (model_fingerprint) */
    uint64_t config_hash;
};

/* A weight matrix (row-major [rows, cols]) as stored in the checkpoint. */
struct model_mat {
    const void *data; /* borrowed from the mmap (or owned conversion) */
    enum be_dtype dtype;
    int rows, cols;
};

struct model_layer {
    const float *attn_norm;  /* (dim)            input_layernorm */
    const float *attn_norm_b, *ffn_norm_b; /* (dim) or NULL: GPT-2's LayerNorm biases */
    struct model_mat wq;     /* (n_heads*head_dim, dim) */
    struct model_mat wk;     /* (n_kv_heads*head_dim, dim) */
    struct model_mat wv;     /* (n_kv_heads*head_dim, dim) */
    struct model_mat wo;     /* (dim, n_heads*head_dim) */
    const float *bq, *bk, *bv; /* (q_dim), (kv_dim), (kv_dim) or NULL */
    const float *bo;         /* (dim) or NULL: o_proj bias (attention_bias on Llama/Qwen3) */
    const float *q_norm, *k_norm; /* (head_dim) or NULL (Qwen3) */
    const float *post_attn_norm; /* (dim) or NULL: Gemma's post_attention_layernorm, on the attention output */
    const float *ffn_norm;   /* (dim)            post_attention_layernorm (Gemma: pre_feedforward_layernorm) */
    const float *post_ffn_norm; /* (dim) or NULL: Gemma's post_feedforward_layernorm, on the MLP output */
    struct model_mat w_gate; /* (hidden, dim), no data for GPT-2 (ungated) */
    struct model_mat w_up;   /* (hidden, dim) */
    struct model_mat w_down; /* (dim, hidden) */
    const float *b_up, *b_down; /* (hidden), (dim) or NULL: GPT-2's MLP biases */
    /* Mamba's mixer (its block norm is attn_norm); inner = intermediate_size */
    struct model_mat ssm_in_x, ssm_in_z; /* (inner, dim) each: in_proj's two halves of rows */
    const float *ssm_in_bx, *ssm_in_bz;  /* (inner) or NULL: in_proj.bias */
    const float *ssm_conv_w;             /* (inner, ssm_conv): conv1d.weight */
    const float *ssm_conv_b;             /* (inner) or NULL */
    struct model_mat ssm_x_dt, ssm_x_B, ssm_x_C; /* (rank | state | state, inner): x_proj's row blocks */
    struct model_mat ssm_dt;             /* (inner, rank): dt_proj */
    const float *ssm_dt_b;               /* (inner) */
    const float *ssm_A;                  /* (inner, state): -exp(A_log), formed at load in f32 */
    const float *ssm_D;                  /* (inner) */
    struct model_mat ssm_out;            /* (dim, inner): out_proj */
    const float *ssm_out_b;              /* (dim) or NULL */
};

struct model_weights {
    struct model_mat tok_embed;  /* (vocab, dim) */
    struct model_mat pos_embed;  /* (max_position_embeddings, dim): GPT-2's wpe, else no data */
    const float *final_norm;     /* (dim) */
    const float *final_norm_b;   /* (dim) or NULL: GPT-2's ln_f bias */
    struct model_mat lm_head;    /* (vocab, dim), = tok_embed when tied */
    struct model_layer *layers;  /* [n_layers] */
    /* xxh3 over the safetensors headers (names, dtypes, shapes, offsets) */
    uint64_t header_hash;
};

/* Parses config.json (+ generation_config.json when present) of dir. */
enum model_status model_config_load(const char *dir, struct model_config *cfg, char *err);
void model_config_release(struct model_config *cfg); /* frees layer_window, the longrope factors */

typedef struct model_files model_files; /* the mmapped safetensors of a directory */

/* Maps model.safetensors or the shards named by model.safetensors.index.json
 * and binds every tensor the config needs, checking dtype and shape.  The 1-D
 * tensors (norms, biases) are converted to f32 copies owned by files. */
enum model_status model_files_open(const char *dir, const struct model_config *cfg, model_files **out,
                                   struct model_weights *w, char *err);
void model_files_close(model_files *f); /* accepts NULL */
/* Reads every weight matrix once and refuses a NaN or an infinity, naming
 * the tensor and the element.  Not part of model_files_open: the matrices
 * are mapped, not read, so a full scan costs a read of the whole checkpoint
 * before the first request (model_params.verify_weights, kvtierd
 * --verify-weights); the 1-D tensors are always checked. */
enum model_status model_weights_verify(const struct model_config *cfg, const struct model_weights *w, char *err);

/* Progress of model_files_page_in: bytes of the mapped files read so far
 * and their total, after each chunk. */
typedef void (*model_progress_fn)(void *arg, uint64_t done, uint64_t total);
/* Reads every page of the mapped files into memory and maps it, so that no
 * forward pass waits for the disk or takes a page fault on the weights;
 * progress (may be NULL) follows each MODEL_PAGE_IN_CHUNK.  MODEL_EIO names
 * the file and offset the kernel could not read. */
#define MODEL_PAGE_IN_CHUNK ((size_t)1 << 20)
enum model_status model_files_page_in(const model_files *mf, model_progress_fn progress, void *arg, char *err);
/* The bytes model_files_page_in reads: every mapped file, whole. */
uint64_t model_files_bytes(const model_files *mf);


/* Why the sink strategy cannot run this model (its keys are rotated at
 * their index in the cache as attention reads them), or NULL when it can.
 * A model with sliding layers is refused by the store. */
const char *model_sink_refusal(const struct model_config *c);

/* The context of a sequence: want tokens (0: the model's), at most the
 * model's max_position_embeddings. */
int model_context(const struct model_config *c, int want);

/* Whether some layer attends to every token, so that a static cache fills
 * (sliding layers keep a ring of their window). */
bool model_has_full_layer(const struct model_config *c);

/* How the KV store keeps K and V (model_params.kv_dtype).  The default
 * keeps them in the checkpoint's precision, as Hugging Face's cache does:
 * f32 KV of a 16-bit model would double every sequence's bytes and the
 * bytes offloaded decode moves, for precision the weights never had. */
enum model_kv_dtype {
    MODEL_KV_AUTO = 0, /* torch_dtype when it is bf16 or f16, else f32 */
    MODEL_KV_F32,
    MODEL_KV_F16,
    MODEL_KV_BF16,
};
/* "auto", "f32", "f16" or "bf16"; false (and *out unchanged) otherwise. */
bool model_kv_dtype_parse(const char *s, enum model_kv_dtype *out);
/* The element type choice stands for with a checkpoint of torch_dtype dt. */
enum be_dtype model_kv_dtype_resolve(enum model_kv_dtype choice, enum be_dtype dt);

/* How the linear layers' weights are held (model_params.weights). */
enum model_weights_fmt {
    MODEL_WEIGHTS_AUTO = 0, /* as the checkpoint stores them, read from the mmap */
    /* every layer's matrices (q, k, v, o, gate, up, down) quantized at load to Q8_0 blocks
     * (util/q8.h) in host memory: half the bytes of bf16 for decode to
     * stream.  The embeddings, the norms, the biases and lm_head stay as
     * stored (docs/architecture.md says why). */
    MODEL_WEIGHTS_Q8_0,
    /* the same matrices as GGUF's Q4_K super-blocks (util/q4k.h), 0.5625
     * bytes per weight; a matrix whose rows are not whole super-blocks of
     * 256 (but are of 32) takes Q8_0 instead, as llama.cpp's quantizer
     * falls back to a block type that fits */
    MODEL_WEIGHTS_Q4_K,
};
/* "auto", "q8_0" or "q4_k"; false (and *out unchanged) otherwise. */
bool model_weights_parse(const char *s, enum model_weights_fmt *out);
/* The block type fmt (Q8_0 or Q4_K) gives a matrix of rows of cols
 * weights: Q4_K's fallback to Q8_0 for rows that are not whole
 * super-blocks.  BE_F32 when fmt is not a quantized one. */
enum be_dtype model_weights_mat_dtype(enum model_weights_fmt fmt, int cols);
/* Quantizes every layer's matrices (those it has) to fmt's blocks
 * (model_weights_mat_dtype) in host memory: *blocks holds all of them and
 * *layers a copy of w->layers that points into them; w->layers becomes
 * *layers, and the caller frees both after w's last use.  Refuses, naming
 * the tensor, a matrix whose columns are not a multiple of 32 and a NaN
 * or an infinity; w is unchanged then. */
enum model_status model_weights_quantize(const struct model_config *cfg, struct model_weights *w,
                                         enum model_weights_fmt fmt, void **blocks, struct model_layer **layers,
                                         char *err);

/* GGUF files (model/gguf*.c): a model path that names a file rather than a
 * directory is read as GGUF v3 by model_config_load, model_files_open and
 * model_tokenizer_load (runtime.h).  model_gguf_write writes one from a
 * Hugging Face directory (`kvtier quantize`): q8_0 and q4_k quantize the
 * layer matrices as --weights q8_0 and q4_k do and keep the embeddings and
 * lm_head as stored; the float types convert every matrix.  Llama, Mistral without a
 * sliding window, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3 and GPT-2 with a
 * byte-level or SentencePiece-style BPE tokenizer. */
enum model_gguf_type { MODEL_GGUF_Q8_0 = 0, MODEL_GGUF_BF16, MODEL_GGUF_F16, MODEL_GGUF_F32, MODEL_GGUF_Q4_K };
/* "q8_0", "q4_k", "bf16", "f16" or "f32"; false (and *out unchanged) otherwise. */
bool model_gguf_type_parse(const char *s, enum model_gguf_type *out);
enum model_status model_gguf_write(const char *dir, const char *out, enum model_gguf_type type, char *err);

/* ---- the model: config + weights + run state on a backend --------------- */
typedef struct model model;

struct model_params {
    int max_batch_tokens; /* tokens per forward chunk (activations sized for it); 0 = 256 */
    bool verify_weights;  /* model_weights_verify at load */
    /* Set: model_load pages the files in (model_files_page_in) before it
     * returns, reporting here, instead of leaving the first forward pass
     * to fault the weights in. */
    model_progress_fn page_in;
    void *page_in_arg;
    enum model_kv_dtype kv_dtype; /* model_kv_geom's dtype */
    enum model_weights_fmt weights;
};

/* The device bytes a model of config c loaded with p (NULL: defaults)
 * charges to a backend of caps: its weights when the backend cannot read
 * the mmap (caps.unified_memory false; 0 otherwise), the forward pass's
 * activations for p's max_batch_tokens rows, and the KV (of p's kv_dtype)
 * of one token over every layer; a state model (Mamba) instead keeps
 * state_per_seq bytes per sequence (kv_store_state_bytes), whatever its
 * length, and kv_per_token is 0. */
struct model_device_bytes {
    size_t weights, activations, kv_per_token, state_per_seq;
};
struct model_device_bytes model_device_bytes(const struct model_config *c, struct be_caps caps,
                                             const struct model_params *p);

enum model_status model_load(const char *dir, be_backend *be, const struct model_params *p, model **out, char *err);
void model_free(model *m); /* accepts NULL */
const struct model_config *model_get_config(const model *m);
const struct model_weights *model_get_weights(const model *m);
/* The KV geometry a kv_store for this model needs, of the dtype
 * model_params.kv_dtype resolved to at load. */
struct kv_geom model_kv_geom(const model *m);
/* What KV computed by this model is valid for: a hash of its config and
 * of its weights' metadata (tensor names, dtypes, shapes, offsets; the
 * weights themselves are not read), and of model_params.weights when it
 * is not auto (quantized weights compute other KV).  KV saved under
 * another fingerprint is never loaded. */
uint64_t model_fingerprint(const model *m);

/* One entry of a batched forward: feed tokens[0..n_tokens) to a sequence at
 * its current length.  logits: host buffer; when want_all_logits it receives
 * [n_tokens, vocab], else [1, vocab] for the last token; NULL = no logits.
 * call_len: the length transformers' forward call for these tokens would
 * reach: a prefill fed over several steps passes its whole prompt's, so
 * that longrope picks its table and a quantized cache applies its rule
 * (kv_seq_update_continues) as that one call would; 0 (or less than the
 * sequence's length after this entry): that length. */
struct fw_seq {
    kv_seq *kv;
    const int32_t *tokens;
    int n_tokens;
    float *logits;
    bool want_all_logits;
    int64_t call_len;
};

/* Runs the forward pass for every entry in one batch (weights read once per
 * chunk).  Transactional: on failure no sequence's KV changes.  When the
 * device tier runs out, sequences are moved to the host tier and the step is
 * redone (kv_seq_stats().fallback reports it), so MODEL_EDEVMEM means that
 * even the streaming slots did not fit, and MODEL_ENOMEM that the host tier
 * is exhausted too (kv_store_errmsg() names the budget). */
enum model_status model_forward(model *m, struct fw_seq *seqs, int n_seqs);

#endif
