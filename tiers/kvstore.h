/* kvstore.h - the memory-tiered paged KV store.
 *
 * Per layer and per sequence, keys and values live in fixed-size blocks of
 * tokens.  A layer's blocks sit in one of three homes:
 *   - paged: blocks from the store's device pool (dynamic strategy);
 *   - a device extent: one contiguous device buffer used as a ring of
 *     blocks (static strategy, and the resident layers of an adaptive one);
 *   - a host extent: the same, in the pinned-host tier (offloaded
 *     strategies).  Such a layer is streamed: during a forward step it is
 *     copied into one of two device slots while the previous layer
 *     computes, and only the blocks the step wrote go back.
 * Every cache strategy is a policy over this one store (docs/strategies.md).
 *
 * A forward step is a transaction: kv_seq_reserve(n) makes room for n new
 * tokens in every layer (all or nothing), the forward pass writes and reads
 * them through kv_seq_view(), then kv_seq_commit() makes them part of the
 * sequence or kv_seq_abort() returns the sequence exactly to its state
 * before the reserve.  Between reserve and commit the forward pass drives
 * the streaming with kv_store_step_begin / kv_store_layer_begin /
 * kv_store_layer_end / kv_store_step_end (model/model.c).
 *
 * Errors come back as enum tier_status; kv_store_errmsg() names what was
 * wrong (which budget, how many bytes) for the last failure.
 */
#ifndef KVTIER_KVSTORE_H
#define KVTIER_KVSTORE_H

#include "backend/backend.h"
#include "tiers/quant_params.h"

enum tier_status {
    TIER_OK = 0,
    TIER_ENOMEM_DEV = 1,  /* the device tier's budget is exhausted */
    TIER_ENOMEM_HOST = 2, /* the host tier's budget (or host memory) is exhausted */
    TIER_EINVAL = 3,      /* bad parameter (named in the error text) */
    TIER_EFULL = 4,       /* static cache: writing past max_cache_len */
    TIER_ENOTSUP = 5,     /* strategy or combination not available */
    TIER_EIO = 6,
    TIER_ECONFLICT = 7,   /* the cache's state forbids it (crop into dropped states); HTTP 409 */
};
const char *tier_strerror(enum tier_status st);

typedef struct kv_store kv_store;
typedef struct kv_seq kv_seq;

/* Shape of the model's KV, fixed for a store's lifetime. */
struct kv_geom {
    int n_layers;
    int n_kv_heads;
    int head_dim;
    const int *layer_window; /* [n_layers]: 0 = full attention, else sliding window W */
    enum be_dtype dtype;     /* storage type (f32 default) */
    /* > 0: a state-space model (Mamba): each layer of a sequence holds a
     * fixed-size state of this many bytes (be_ssm_state_bytes) instead of K
     * and V; n_kv_heads and head_dim are 0 (tiers/state.c). */
    size_t state_bytes;
};

/* Hugging Face's cache_implementation names, with the same semantics. */
enum kv_strategy {
    KV_DYNAMIC = 0,          /* device, grows block by block; sliding layers keep W-1 tokens */
    KV_STATIC = 1,           /* device, max_cache_len preallocated; sliding layers keep W */
    KV_OFFLOADED = 2,        /* dynamic, layers in the host tier, streamed per layer */
    KV_OFFLOADED_STATIC = 3, /* static, layers in the host tier, streamed per layer */
    KV_QUANTIZED = 4,        /* device, KIVI-quantized blocks + a full-precision residual (tiers/quant.h) */
};
const char *kv_strategy_name(enum kv_strategy s); /* "dynamic", "static", ... */

/* offload_only_non_sliding as a tri-state so that a zeroed struct means
 * HF's default: False for offloaded, True for offloaded_static. */
enum kv_offload_sliding {
    KV_OFFLOAD_SLIDING_DEFAULT = 0,
    KV_OFFLOAD_SLIDING_YES = 1, /* sliding layers are streamed too */
    KV_OFFLOAD_SLIDING_NO = 2,  /* sliding layers stay on the device (offload_only_non_sliding) */
};

struct kv_seq_params {
    enum kv_strategy strategy;
    /* Static strategies: the capacity in tokens (required).  Dynamic ones:
     * 0, or the length the request expects to reach; it sizes the request
     * up front (a dynamic request that cannot fit starts offloaded) and the
     * adaptive residency. */
    int64_t max_cache_len;
    enum kv_offload_sliding offload_sliding;
    /* Offloaded strategies: keep as many layers on the device as the budget
     * allows for max_cache_len tokens (chosen at creation, reported in the
     * stats) and stream only the rest. */
    bool adaptive;
    /* Fail with TIER_ENOMEM_DEV instead of continuing offloaded when the
     * device tier runs out (the request's allow_offload: false; docs/reliability.md). */
    bool no_fallback;
    /* The sliding_window strategy on top of any of the above: every layer
     * slides with this window (a layer the model already slides narrower
     * keeps its own).  0 = the model's layer windows.  The daemon passes
     * the request's window_length, else the model's sliding_window. */
    int window_length;
    /* Opt out of the store's prefix cache (see kv_seq_match_prefix). */
    bool no_prefix_cache;
    /* The prefix cache's namespace: blocks are shared only between
     * sequences of the same one (the daemon gives each uid its own, so
     * that cached_tokens and timing do not tell one user what another
     * sent).  0 is as good as any other value. */
    uint64_t prefix_ns;
    /* KV_QUANTIZED: the backend, nbits, axes, group and residual
     * (kv_quant_parse / kv_quant_defaults); validated at creation. */
    struct kv_quant_params quant;
    /* KV_QUANTIZED only: the blocks live in the host tier from the start
     * and every layer streams through the device slots as an offloaded
     * one does (quantized + offloaded; kv_seq_offload gets there later). */
    bool offload;
    /* The sink strategy (StreamingLLM attention sinks; docs/strategies.md
     * "Sinks"): every layer keeps the first num_sink_tokens tokens and the
     * most recent window_length - num_sink_tokens (window_length > 0, 0 <=
     * num_sink_tokens < window_length, at most a block).  RoPE positions
     * are indices in the cache, not in the text (kv_seq_rope_pos).  Dynamic
     * storage only, on a model without sliding layers; no past recording,
     * no host-tier fallback, no prefix cache; crop only until the first
     * token is evicted. */
    bool sink;
    int num_sink_tokens;
};

struct kv_store_params {
    int block_tokens; /* tokens per block; 0 = 16 */
    size_t host_mem;  /* host-tier budget in bytes; 0 = unlimited */
    /* Automatic prefix cache: full blocks of dynamic sequences on
     * full-attention models are published by content hash at commit and
     * found again by kv_seq_match_prefix; unreferenced ones are evicted
     * LRU-first when the device budget runs out.  A state store shares its
     * sequences' checkpoints instead (tiers/state.c), evicted LRU-first
     * within kv_store_set_prefix_mem's budget and when the host tier runs
     * out. */
    bool prefix_cache;
    /* Tests only: the chain hash is and-ed with this (0 = all 64 bits), so
     * that a small mask forces collisions. */
    uint64_t prefix_hash_mask;
    /* A state store (kv_geom.state_bytes): a commit that reaches or passes
     * a multiple of this many tokens keeps a copy of the state in the host
     * tier, which crop, reuse and forks go back to.  0 = 256. */
    int checkpoint_interval;
};

/* The most tokens a sequence may see, and the largest |n| kv_seq_crop
 * takes: far beyond any context, and small enough that lengths, positions
 * and crop arguments add and negate in int64_t without overflow. */
#define KV_SEQ_MAX_LEN ((int64_t)1 << 40)

/* p = NULL means all defaults. */
enum tier_status kv_store_open(be_backend *be, const struct kv_geom *g, const struct kv_store_params *p,
                               kv_store **out);
void kv_store_free(kv_store *s); /* accepts NULL; all sequences must be freed first */
int kv_store_block_tokens(const kv_store *s);
enum be_dtype kv_store_dtype(const kv_store *s); /* kv_geom.dtype: how dense blocks store K and V */
/* What the last failing call on this store (or one of its sequences) was
 * refused for, e.g. "host tier budget 64.0 MiB exhausted: ..."; "" if none. */
const char *kv_store_errmsg(const kv_store *s);
/* The prefix cache's own budget: the bytes of cached blocks no sequence
 * references may not exceed it; past it the least recently used go first
 * (at once, down to the new budget).  0 (the default) sets none: they then
 * go only when the device budget needs room. */
void kv_store_set_prefix_mem(kv_store *s, size_t bytes);

/* Streaming figures.  Transfer time is the time the copy stream spent on
 * the step's copies (from the first issue to the last completion, measured
 * with events), stall the time compute waited for a copy, overlap =
 * 1 - stall / transfer. */
struct kv_xfer_stats {
    uint64_t steps;          /* forward steps that streamed at least one layer */
    uint64_t tokens;         /* tokens those steps fed */
    uint64_t bytes_h2d;      /* host tier -> device slots */
    uint64_t bytes_d2h;      /* written-back blocks */
    double transfer_s, stall_s, compute_s;
};

struct kv_store_stats {
    size_t dev_bytes;      /* device bytes held by KV (pool blocks in use, extents, slots) */
    size_t host_bytes;     /* host-tier bytes held by extents */
    size_t host_budget;    /* 0 = unlimited */
    size_t slot_bytes;     /* the two streaming slots */
    uint64_t blocks_used;  /* pool blocks referenced by some sequence */
    uint64_t fallbacks;    /* sequences moved to the host tier after a device OOM */
    uint64_t fallbacks_oom; /* of those, a step or a load ran out (KV_FALLBACK_OOM); the rest: at creation */
    /* a state store: its shared checkpoints, all evictable, in host bytes */
    uint64_t prefix_entries;   /* token blocks in the prefix cache (each one pool block per layer) */
    uint64_t prefix_evictable; /* of those, referenced by no sequence */
    size_t prefix_unref_bytes;  /* their device bytes, which kv_store_set_prefix_mem bounds */
    uint64_t prefix_hit_tokens;/* tokens attached by kv_seq_match_prefix so far */
    uint64_t prefix_evictions;
    uint64_t prefix_spill_dropped; /* evicted blocks not queued for the caller (bound, memory, device fault) */
    struct kv_xfer_stats xfer;      /* since the store was created */
    struct kv_xfer_stats last_step; /* the last step that streamed */
};
struct kv_store_stats kv_store_stats(const kv_store *s);

enum tier_status kv_seq_create(kv_store *s, const struct kv_seq_params *p, kv_seq **out);
void kv_seq_free(kv_seq *q); /* accepts NULL; returns its memory to the store */
kv_store *kv_seq_store(const kv_seq *q);

/* Tokens seen by the sequence (HF get_seq_length(): absolute, sliding layers included). */
int64_t kv_seq_length(const kv_seq *q);
/* Bytes this sequence's KV occupies, both tiers. */
size_t kv_seq_bytes(const kv_seq *q);

enum kv_fallback {
    KV_FALLBACK_NONE = 0,
    KV_FALLBACK_SIZED = 1, /* would not fit the device at creation: started offloaded */
    KV_FALLBACK_OOM = 2,   /* a step ran out of device memory: KV moved to the host tier */
};

struct kv_seq_stats {
    enum kv_strategy requested, strategy; /* strategy differs after a fallback */
    enum kv_fallback fallback;
    int resident_layers;  /* layers whose KV stays on the device */
    int streamed_layers;  /* layers streamed from the host tier */
    size_t dev_bytes, host_bytes;
    struct kv_xfer_stats xfer; /* the steps this sequence streamed in (whole-step figures) */
    /* KV bytes copied to give this sequence storage of its own: shared
     * blocks copied before a step wrote into them (a fork's partly filled
     * block, a published prefix block) and, at its fork, the extents
     * copied from the parent (static and offloaded layers). */
    uint64_t copied_bytes;
};
struct kv_seq_stats kv_seq_stats(const kv_seq *q);

/* Moves every device-resident layer of a sequence to the host tier and
 * makes it offloaded (static -> offloaded_static; a quantized one keeps
 * its strategy, its blocks move); nothing is recomputed.  All or nothing:
 * on TIER_ENOMEM_HOST the sequence is untouched.  Only between steps;
 * TIER_ENOTSUP for a KV_FALLBACK_OOM of a no_fallback one. */
enum tier_status kv_seq_offload(kv_seq *q, enum kv_fallback why);

/* ---- cache surgery (docs/strategies.md "Crop, forks, prefix cache") ----
 * Only between steps.
 *
 * kv_seq_crop: Hugging Face v5.15+ crop(tokens_to_remove).  n < 0 removes
 * -n tokens (more than the length empties the sequence); n == 0 is a no-op
 * on full layers and shrinks sliding layers' recorded states back to what
 * they will read (keep); n > 0 is the deprecated absolute length (n >= len:
 * no-op), refused once a sliding layer has seen its window.  Once a
 * sliding layer has seen its window, every crop needs past recording:
 * TIER_ECONFLICT with the reference's message; removing more than was
 * recorded since the last crop is TIER_ECONFLICT too (the reference loses
 * states silently there).  |n| > KV_SEQ_MAX_LEN is TIER_EINVAL.  All or
 * nothing. */
enum tier_status kv_seq_crop(kv_seq *q, int64_t n);
/* Sliding layers keep every state until the next crop (HF
 * activate_past_recording).  TIER_ENOTSUP on a static strategy with
 * sliding layers (their capacity is fixed). */
enum tier_status kv_seq_activate_past_recording(kv_seq *q);
/* Whether a sequence opened with p could record its past (why not, in
 * why, when it cannot): what kv_seq_activate_past_recording checks, before
 * any sequence exists.  Reads only what the store fixed at creation, so
 * any thread may ask. */
bool kv_store_past_recording_ok(const kv_store *s, const struct kv_seq_params *p, char *why, size_t cap);
/* kv_seq_create's checks of p: TIER_EINVAL or TIER_ENOTSUP with a message
 * naming the field in why.  Reads only what the store fixed at creation,
 * so any thread may ask (an empty session is checked before it exists). */
enum tier_status kv_store_check_params(const kv_store *s, const struct kv_seq_params *p, char *why, size_t cap);
/* A new input[0, n_input) for a sequence that holds the KV of held[0,
 * kv_seq_length(q)): crops q to the longest common prefix of the two and
 * sets *n_keep to its length, the tokens that need not be fed again.  At
 * most n_input - 1 tokens are kept, so the last input token is always
 * recomputed and yields logits (an input re-sent whole).  Unlike
 * kv_seq_crop, the rewind keeps every state past recording kept.  On
 * failure (the crop's, e.g. TIER_ECONFLICT where a sliding layer dropped
 * the states) q is unchanged and *n_keep is 0. */
enum tier_status kv_seq_reuse(kv_seq *q, const int32_t *held, const int32_t *input, int64_t n_input,
                              int64_t *n_keep);
/* The length of the common prefix kv_seq_reuse would keep, q unchanged. */
int64_t kv_seq_common(const kv_seq *q, const int32_t *held, const int32_t *input, int64_t n_input);

/* A new sequence equal to q that shares q's device blocks copy-on-write:
 * nothing is copied until one of them writes into a shared block (the
 * partly filled last block, on the first step).  Extent layers (static,
 * offloaded) are copied: a ring has no blocks to share.  Where the device
 * budget cannot hold the copy of q's device extents, the fork starts in
 * the host tier as kv_seq_create's would (every layer streamed, static ->
 * offloaded_static, fallback KV_FALLBACK_SIZED) unless q has no_fallback:
 * then TIER_ENOMEM_DEV.  q is never changed. */
enum tier_status kv_seq_fork(kv_seq *q, kv_seq **child);
/* As kv_seq_fork, into *child, which held a sequence of the same store (or
 * NULL) that is no longer wanted: it becomes the fork, keeping its own
 * layer array, block tables and token ids where it can, so that beam
 * search, which re-forks beams every step, allocates nothing per token.
 * Its blocks go back first, and its kv_seq_stats start over (read its
 * copied_bytes before).  On failure *child is freed and NULL, except that
 * *child == q is TIER_EINVAL and changes nothing. */
enum tier_status kv_seq_refork(kv_seq *q, kv_seq **child);
/* Whether a fork of q that keeps its first keep tokens, then grows by
 * n_more, shares all of q's KV (paged layers: at most a partly filled
 * block per layer is copied, where extents or a state would be copied
 * whole and a quantized cache cannot fork) and finds device room for the
 * blocks it writes while q keeps all of its own: what a caller that keeps
 * q as a fallback while the fork computes needs. */
bool kv_seq_fork_fits(const kv_seq *q, int64_t keep, int64_t n_more);

/* Attaches to a fresh sequence (length 0) the longest chain of cached full
 * blocks equal to tokens[0, n) and sets *n_cached to the tokens attached
 * (a multiple of the block size, at most n - 1 so the caller still feeds
 * one token and gets logits; 0 when the sequence does not take part).
 * A state store's sequence takes a copy of the deepest shared checkpoint
 * instead (a multiple of checkpoint_interval, at most n - 1).
 * Matches compare the token ids, never only the hash. */
enum tier_status kv_seq_match_prefix(kv_seq *q, const int32_t *tokens, int64_t n, int64_t *n_cached);
/* ---- the prefix cache on disk (tiers/prefix.c "On disk") ---------------
 * A cache entry as bytes: the block's chain hash (the one the cache keys
 * it by) and a second, independent one, those of its parent, its
 * namespace, its token ids and every layer's K and V as stored.  The
 * caller keeps them (the daemon in the disk tier) and hands them back with
 * kv_store_prefix_insert; the store never touches a file. */
struct kv_prefix_block {
    void *buf; /* the serialized entry; the caller owns it (free()) */
    size_t len;
    uint64_t ns, hash;
    bool has_parent; /* false for a chain's first block */
    uint64_t parent; /* the parent's hash */
    bool kept;       /* a kept sequence's image (kv_store_kept_image) instead: ns and hash its key's */
};
/* From now on every entry the cache evicts (budget, device pressure) is
 * serialized (device bytes through be_copy) and queued, at most max_bytes
 * of them: past that the oldest are dropped and counted in
 * prefix_spill_dropped.  0 (the default) serializes none and frees the
 * queue.  Entries that came from kv_store_prefix_insert are not queued.
 * Kept sequences (below) the store evicts are queued the same way, as
 * their images, unless they came from kv_store_kept_insert with on_disk;
 * one whose image alone passes max_bytes is dropped. */
void kv_store_set_prefix_spill(kv_store *s, size_t max_bytes);
/* Hands out the oldest queued entry; false when none is. */
bool kv_store_prefix_take_evicted(kv_store *s, struct kv_prefix_block *out);
/* Serializes the next cached entry neither handed out before (evicted or
 * exported) nor inserted from disk, for a caller that keeps every entry
 * at exit, then the kept sequences the same way, referenced or not; *got
 * false when none is left.  Only between steps.
 * TIER_ENOMEM_HOST / TIER_EIO (device copy) leave that entry for the next
 * call. */
enum tier_status kv_store_prefix_export(kv_store *s, struct kv_prefix_block *out, bool *got);
/* The chain hashes of the full blocks of tokens[0, n) that
 * kv_seq_match_prefix could attach for a sequence created with p
 * (hashes[] has room for (n - 1) / block_tokens), and in *n_mem how many
 * leading ones the cache holds now.  Returns the number of blocks worth
 * reading in: at most *n_mem plus as many as the prefix-cache budget
 * (kv_store_set_prefix_mem) holds unreferenced; 0 when such a sequence
 * would not take part in the cache (strategy, sliding layers,
 * no_prefix_cache, a store without one). */
int64_t kv_store_prefix_chain(const kv_store *s, const struct kv_seq_params *p, const int32_t *tokens, int64_t n,
                              uint64_t *hashes, int64_t *n_mem);
/* The length of one serialized prefix-cache block (kv_prefix_block.len). */
size_t kv_store_prefix_block_bytes(const kv_store *s);
/* Grows the pool by free blocks of up to bytes in all (as far as the
 * device budget allows, evicting nothing) and writes each new block once
 * through the backend, so that the first blocks a lookup inserts do not
 * fault their memory in on its critical path (docs/remote.md, "A
 * daemon's first lookup").  The bytes grown. */
size_t kv_store_pool_warm(kv_store *s, size_t bytes);
/* Serializes the cached entries of the chain of tokens[0, n_blocks *
 * block_tokens) under p, from its first block on and up to the first one
 * not cached, into out[] (at most max_out), skipping those shipped
 * before and those that came from kv_store_prefix_insert; *n_out how
 * many, and *done whether the walk reached the chain's end or the first
 * block not cached (false: max_out stopped it).  For a caller that publishes computed blocks elsewhere (the
 * remote tier); independent of the eviction queue and of export.  Only
 * between steps.  TIER_ENOMEM_HOST / TIER_EIO stop there: the caller owns
 * the *n_out entries before. */
enum tier_status kv_store_prefix_ship(kv_store *s, const struct kv_seq_params *p, const int32_t *tokens,
                                      int64_t n_blocks, struct kv_prefix_block *out, int64_t max_out, int64_t *n_out,
                                      bool *done);
/* Puts a serialized entry back into the cache, unreferenced (evictable
 * as any other; the prefix-cache budget applies at once).  It is checked
 * first: format and version, the store's geometry, the size, and both
 * hashes equal to what the chain gives for its tokens under the parent
 * hashes it carries; TIER_EINVAL naming the field otherwise.  Then its
 * parent must be cached (same namespace, both hashes): TIER_ECONFLICT if
 * not, a sound block the cache cannot hang now (its parent was evicted or
 * never read in).  An entry already cached is TIER_OK.  TIER_ENOMEM_DEV
 * when no pool block is free, TIER_EIO on a device fault; the cache is
 * then as it was. */
enum tier_status kv_store_prefix_insert(kv_store *s, const void *buf, size_t len);

/* ---- kept sequences (tiers/keep.c) -------------------------------------
 * Whole sequences, written once and only read afterwards, that the store
 * shares by the ids they were computed from: an encoder-decoder model's
 * cross-attention cache, a function of its encoder input alone.  A kept
 * sequence is never written, cropped or forked again; any number of
 * holders read it at once.  The entries no holder references follow the
 * prefix cache's rules: within kv_store_set_prefix_mem's budget (their
 * bytes in both tiers), least recently used first, and evicted before a
 * device or host allocation fails; kv_store_stats counts them with the
 * prefix cache's entries, evictions and hit tokens.
 *
 * kv_store_keep: hands q (of s, between steps) to the store under (ns,
 *   ids[0, n)), with a reference for the caller in *out; the store frees
 *   q when the entry goes.  TIER_ENOMEM_HOST (the ids' copy) leaves q the
 *   caller's.
 * kv_store_kept_find: the most recent entry whose namespace and ids equal
 *   (ns, ids[0, n)), compared id by id (a hash collision only misses),
 *   with a reference taken for the caller; NULL if none.
 * kv_kept_unref: drops a reference (NULL: none); the entry stays, evictable.
 * kv_kept_seq: the sequence, valid while the caller's reference is.
 * kv_store_kept_held: whether kv_store_kept_find would find one, with no
 *   reference taken and nothing counted.
 * kv_store_kept_hash: the hash entries are looked up by: xxh3 of the ids
 *   (as int32 in host order) seeded with ns, the same in every process
 *   (the remote and disk tiers' key).
 *
 * Kept sequences elsewhere (the remote and disk tiers) travel as images
 * that carry their key, so that one found under a key is checked against
 * the input it is looked up for, id by id, as in memory.
 * kv_store_kept_image: q (between steps; kept or not) as the image of an
 *   entry under (ns, ids[0, n)), in out (buf the caller's, kept set).
 *   TIER_ENOMEM_HOST, TIER_EIO (a device copy).
 * kv_store_kept_insert: such an image buf[0, len), looked up for (ns,
 *   ids[0, n)), kept under that key with a reference for the caller in
 *   *out.  Checked first: TIER_EINVAL naming the field for one that is not
 *   a kept image of this version, whose sequence image does not load
 *   (kv_seq_load's checks) or is not as long as its ids, or whose key is
 *   not the input's and does not hash as it (not what was stored under
 *   that hash); TIER_ECONFLICT for an image of another key of the same
 *   hash (a collision: a miss, the rest of the image not looked at).  Memory as kv_seq_load.  on_disk:
 *   the caller holds the image already, so the entry's eviction does not
 *   queue it again.
 * kv_store_kept_image_bound: the most bytes an image of n ids may take
 *   (twice its blocks and their tables): a value that claims more is
 *   corrupt. */
typedef struct kv_kept kv_kept;
enum tier_status kv_store_keep(kv_store *s, uint64_t ns, const int32_t *ids, int64_t n, kv_seq *q, kv_kept **out);
kv_kept *kv_store_kept_find(kv_store *s, uint64_t ns, const int32_t *ids, int64_t n);
void kv_kept_unref(kv_kept *k);
kv_seq *kv_kept_seq(const kv_kept *k);
uint64_t kv_store_kept_hash(uint64_t ns, const int32_t *ids, int64_t n);
bool kv_store_kept_held(const kv_store *s, uint64_t ns, const int32_t *ids, int64_t n);
enum tier_status kv_store_kept_image(kv_seq *q, uint64_t ns, const int32_t *ids, int64_t n,
                                     struct kv_prefix_block *out);
enum tier_status kv_store_kept_insert(kv_store *s, const void *buf, size_t len, uint64_t ns, const int32_t *ids,
                                      int64_t n, bool on_disk, kv_kept **out);
size_t kv_store_kept_image_bound(const kv_store *s, int64_t n);

/* The token ids of the reserved positions (after kv_seq_reserve, before
 * the commit); a step without them stops the sequence publishing (blocks,
 * or a state's checkpoints). */
void kv_seq_tokens(kv_seq *q, const int32_t *ids);

/* The next kv_seq_reserve's tokens are a part of one update that a later
 * step's tokens complete: an input fed over several steps, which
 * transformers would run as one forward call.  A quantized cache keeps
 * them in its residual and applies its rule once, at the last part, so
 * that neither the step size nor the other sequences of a step change
 * what it quantizes (full-attention layers: a windowed one quantizes
 * every part, keeping its memory a window's); the other caches store the
 * same either way.  The reserve consumes the mark. */
void kv_seq_update_continues(kv_seq *q);
/* n_new == 0: the step only reads q (an encoder-decoder model's
 * cross-attention cache): q joins the step's batch, so that its layers in
 * the host tier stream through the device slots with the others' (the same
 * prefetch), nothing of it goes back, and its commit or abort ends that.
 * Dense sequences only (TIER_ENOTSUP), once per step (TIER_EINVAL). */
enum tier_status kv_seq_reserve(kv_seq *q, int n_new);
/* The view of layer l covering committed tokens plus the reserved ones
 * (positions [length, length + n_new)).  Between kv_store_step_begin and
 * kv_store_step_end a streamed layer's view points into its device slot;
 * otherwise it is where the KV lives (host memory for a streamed layer).
 * Valid until the next reserve, commit, abort or layer_begin. */
void kv_seq_view(const kv_seq *q, int layer, struct be_kv_view *out);
/* The RoPE positions of the reserved token at absolute position pos:
 * *q_pos for its query, *k_pos for the key it stores.  pos and pos for
 * every strategy but sink, whose query sits at its index in the cache and
 * whose key is stored unrotated (*k_pos = 0: RoPE at 0 is the identity)
 * for attention to rotate at its index in the cache of each later step. */
void kv_seq_rope_pos(const kv_seq *q, int64_t pos, int64_t *q_pos, int64_t *k_pos);
/* The same as be_attention_quant reads it (tiers/kvquant.c): a quantized
 * sequence's quantized blocks and full-precision rest; any other sequence
 * as a view with no quantized part (fmt NULL) whose rest is kv_seq_view, so
 * one call serves a mixed batch.  kv_seq_view of a quantized sequence is
 * this view's rest (where the step's tokens are written). */
void kv_seq_qview(const kv_seq *q, int layer, struct be_kvq_view *out);
/* TIER_EIO only on a device fault while writing the step's KV (quantized
 * codes, kept sinks); kv_store_errmsg() names it. */
enum tier_status kv_seq_commit(kv_seq *q);
void kv_seq_abort(kv_seq *q);

/* ---- images (tiers/image.c): a sequence as bytes, for the disk tier ----
 * An image is a sequence's complete state in the form it is stored:
 * parameters, strategy (after any fallback), lengths, past recording, and
 * every stored position of every layer (dense blocks, quantized codes and
 * their residual, kept sinks); a state store's sequence, its state and
 * its checkpoints.  Little-endian, versioned, self-checking sizes; it
 * names no pointer.  Only between steps.
 *
 * kv_seq_image_size: the bytes kv_seq_save needs for q.
 * kv_seq_save: writes q's image into buf[0, size) (device bytes come
 *   through the backend's copies); q is unchanged.  TIER_EINVAL if size is
 *   not kv_seq_image_size(q).
 * kv_seq_load: a new sequence on s equal to the saved one: it continues
 *   with the same tokens and logits as the saved one would have.  The
 *   image is checked before anything is allocated (the store's geometry
 *   and block size, the version, every length, position and size in
 *   range): TIER_EINVAL with kv_store_errmsg naming the field.  Memory as
 *   kv_seq_create and kv_seq_offload: a device-resident image that does not
 *   fit the device budget loads offloaded (fallback KV_FALLBACK_OOM),
 *   unless it was saved with no_fallback; TIER_ENOMEM_* otherwise.
 * kv_seq_image_bound: at least the bytes of the image of any sequence of
 *   n tokens with parameters p on s, whatever its layers hold (a stored
 *   image that claims more is not one: its size is checked with this
 *   before memory is taken for it).  0 for parameters s refuses. */
size_t kv_seq_image_size(const kv_seq *q);
size_t kv_seq_image_bound(const kv_store *s, const struct kv_seq_params *p, int64_t n);
enum tier_status kv_seq_save(kv_seq *q, void *buf, size_t size);
enum tier_status kv_seq_load(kv_store *s, const void *buf, size_t size, kv_seq **out);

/* Loading layer by layer, for an image still arriving (a disk read):
 * kv_image_head_size: the bytes at an image's start that hold everything
 *   a load checks and allocates by (header, windows, layer table).
 * kv_seq_load_begin: kv_seq_load from head, the first min(size,
 *   kv_image_head_size(s)) bytes of an image of size bytes: the same
 *   checks, storage and fallback, the layers' contents not there yet.
 *   Layer l is filled when something first needs it: the forward pass's
 *   kv_store_layer_begin for l (or for the layer before a streamed l, whose
 *   copy-in it starts), or any call that reads or copies the KV (save,
 *   crop, fork, offload, the dense and raw exports), which fills them all.
 *   A state store's image fills its state layer by layer the same way, and
 *   its checkpoints last, with everything (kv_seq_load_finish, a crop, a
 *   fork, a save); their positions are checked then (TIER_EINVAL).
 *   A fill calls src->wait(src->arg, n), which blocks until the image's
 *   first n bytes are in and returns its first byte, or NULL if they never
 *   will be; a layer whose blocks do not check (rows that must be zero)
 *   fails too.  A failure is the sequence's for good: that call and every
 *   later one that fills returns it (kv_store_layer_begin as BE_EIO), and
 *   the caller frees the sequence.  src is not called once every layer is
 *   filled.
 * kv_seq_load_finish: fills every layer left.
 * kv_seq_loading: layers are left to fill and none failed.
 * kv_seq_load_status: TIER_OK, or the failure that stopped the fill. */
struct kv_image_src {
    const void *(*wait)(void *arg, size_t n);
    void *arg;
};
size_t kv_image_head_size(const kv_store *s);
enum tier_status kv_seq_load_begin(kv_store *s, const void *head, size_t size, const struct kv_image_src *src,
                                   kv_seq **out);
enum tier_status kv_seq_load_finish(kv_seq *q);
bool kv_seq_loading(const kv_seq *q);
enum tier_status kv_seq_load_status(const kv_seq *q);

/* ---- dense export and import (tiers/dense.c) ----------------------------
 * kv_seq_layer_rows: the positions layer l holds, in attention order (the
 *   sink strategy's sinks first, then the window); what a dense K or V of
 *   the layer has as its sequence axis.
 * kv_seq_layer_dense: layer l's keys and values as [n_kv_heads, rows,
 *   head_dim] each, in dtype (BE_F32, or the store's dtype), quantized
 *   layers dequantized (be_kvq_dequantize); k and v hold rows * n_kv_heads
 *   * head_dim elements.  Keys as stored (the sink strategy stores them
 *   unrotated).  Only between steps; TIER_ENOTSUP for a quantized sequence
 *   offloaded to the host tier.
 * kv_store_dense_rows: rows_l below for a dynamic sequence created with p
 *   and n tokens, so that a caller checks a file before creating anything.
 * kv_seq_import_dense: fills a fresh dynamic sequence (length 0; not sink;
 *   one fallen back to offloaded is filled in the host tier) with n tokens
 *   of KV computed elsewhere:
 *   k[l], v[l] are layer l's [n_kv_heads, rows_l, head_dim] in dtype,
 *   rows_l = n for a full layer and min(n, what the layer keeps) for a
 *   sliding one, its last rows (kv_store_dense_rows).  One step of n
 *   tokens (n <= INT_MAX): it then continues exactly as if it had computed
 *   those tokens, and never publishes them in the prefix cache.  As
 *   kv_seq_load: KV the device budget cannot hold moves q to the host tier
 *   (kv_seq_offload, fallback KV_FALLBACK_OOM) and goes there, unless q
 *   has no_fallback.  All or nothing (on failure q is fresh again, in the
 *   host tier if it moved); TIER_EINVAL for a sequence that is not fresh
 *   or dynamic, TIER_ENOMEM_* as kv_seq_reserve and kv_seq_offload. */
int64_t kv_seq_layer_rows(const kv_seq *q, int layer);
/* A quantized layer's stored form (the raw export):
 * kv_seq_layer_quant: describes layer l of a quantized sequence: n_blocks
 *   quantized blocks of fmt (block_bytes each, as the backend wrote them,
 *   unused rows included), block i holding the positions [(first_block +
 *   i) * T, (first_block + i + 1) * T) of which attention reads [lo, nq),
 *   then the full-precision residual [nq, nq + residual).  TIER_EINVAL for a
 *   dense sequence; TIER_ENOTSUP for a sink one or one offloaded to the host
 *   tier (as kv_seq_layer_dense).
 * kv_seq_layer_quant_read: copies what it describes: blocks[n_blocks *
 *   block_bytes], and the residual's k and v as [n_kv_heads, residual,
 *   head_dim] of the store's dtype.  Only between steps. */
struct kv_quant_layer {
    const struct be_kvq_format *fmt;
    int64_t lo, nq, first_block, residual;
    int n_blocks;
    float scale_k, scale_v; /* e4m3 tensor scales */
};
enum tier_status kv_seq_layer_quant(const kv_seq *q, int layer, struct kv_quant_layer *out);
enum tier_status kv_seq_layer_quant_read(kv_seq *q, int layer, void *blocks, void *k, void *v);
/* kv_seq_load_quant: the way back (the raw import): a new quantized
 *   sequence of p (strategy KV_QUANTIZED, no sinks, no offload) and len
 *   tokens whose layer l is in[l]: in[l].d as kv_seq_layer_quant describes
 *   it, in[l].blocks, k, v as kv_seq_layer_quant_read copies them.  d.fmt
 *   is the layout the caller's blocks are in, and must be p's (the blocks
 *   are read by it: fmt->block_bytes each).  It rebuilds the sequence's image and loads it (kv_seq_load), so
 *   every check of the image loader applies, then checks that the loaded
 *   sequence describes each layer exactly as in[l] did: TIER_EINVAL with
 *   kv_store_errmsg naming the field (params, len, a layer's lo, nq,
 *   first_block, n_blocks, residual, fmt), TIER_ENOMEM_* as
 *   kv_seq_load, and TIER_ENOMEM_DEV where kv_seq_load would fall back to
 *   the host tier (the stored form is described on the device only). */
struct kv_quant_layer_in {
    struct kv_quant_layer d;
    const void *blocks, *k, *v;
};
enum tier_status kv_seq_load_quant(kv_store *s, const struct kv_seq_params *p, int64_t len,
                                   const struct kv_quant_layer_in *in, kv_seq **out);
enum tier_status kv_seq_layer_dense(kv_seq *q, int layer, enum be_dtype dtype, void *k, void *v);
int64_t kv_store_dense_rows(const kv_store *s, const struct kv_seq_params *p, int layer, int64_t n);
enum tier_status kv_seq_import_dense(kv_seq *q, int64_t n, enum be_dtype dtype, const void *const *k,
                                     const void *const *v);

/* ---- state-space models (tiers/state.c) ----------------------------------
 * A sequence of a store opened with kv_geom.state_bytes > 0 holds one
 * state per layer: fixed in size, whatever its length, on the device or
 * in the host tier (an offloaded strategy, a fallback at creation,
 * kv_seq_offload; its steps then stream it layer by layer through the
 * device slots, kv_store_step_begin and the layer hooks).  The
 * strategies that act on single tokens (sliding_window, sink, quantized)
 * are refused by kv_seq_create with TIER_ENOTSUP and a kv_store_errmsg
 * naming why.  kv_seq_crop and kv_seq_reuse go back
 * to the nearest checkpoint at or below the length they would leave
 * (kv_seq_length says where), and the caller feeds the tokens from there;
 * the dense exports do not apply (TIER_ENOTSUP; kv_seq_state_read below).
 *
 * kv_store_state_bytes: the device bytes of one sequence's state (both of
 *   its copies: the step's transaction writes the second).
 * kv_seq_state_view: layer l's state for the current chunk, between
 *   kv_seq_reserve and the commit (the store knows the chunk from
 *   kv_seq_chunk). */
size_t kv_store_state_bytes(const kv_store *s);
/* A state store's checkpoint_interval (0 for a KV store).  A checkpoint is
 * taken where a chunk ends (kv_seq_chunk's `to`) on a multiple of it: the
 * forward pass ends a chunk at every multiple that falls inside a
 * sequence's tokens of the step. */
int kv_store_checkpoint_interval(const kv_store *s);
void kv_seq_state_view(const kv_seq *q, int layer, struct be_ssm_view *out);
/* The state as values, for the session export and import (a state is
 * kv_store_state_bytes(s) / 2 bytes: each layer's as be_ssm lays it out,
 * in layer order):
 * kv_seq_state_checkpoints: how many checkpoints q holds (a sequence
 *   loading from an image has its own in first).
 * kv_seq_state_read: q's state (between steps), then its first n_ckpt
 *   checkpoints, into dst[0, size), size (1 + n_ckpt) states; their
 *   positions (ascending) into ckpt_pos[0, n_ckpt).  TIER_EINVAL for a KV
 *   sequence, another size or more checkpoints than q holds.
 * kv_seq_load_state: a new sequence with params p that has seen len
 *   tokens and holds `state` followed by n_ckpt checkpoints at ckpt_pos
 *   (as kv_seq_state_read gives them; its crops go back to those, else to
 *   the zero state, or to checkpoints its own steps take): kv_seq_load of
 *   that image, with its checks (positions ascending in (0, len]), memory
 *   and fallback. */
enum tier_status kv_seq_state_checkpoints(kv_seq *q, int *n_ckpt);
enum tier_status kv_seq_state_read(kv_seq *q, void *dst, size_t size, int64_t *ckpt_pos, int n_ckpt);
enum tier_status kv_seq_load_state(kv_store *s, const struct kv_seq_params *p, int64_t len, const void *state,
                                   const int64_t *ckpt_pos, int n_ckpt, kv_seq **out);

/* ---- streaming hooks of the forward pass (tiers/stream.c) ---------------
 * After every sequence of the step is reserved: plan the device slots for
 * the step's streamed layers (may allocate them: TIER_ENOMEM_DEV). */
enum tier_status kv_store_step_begin(kv_store *s);
/* Before a chunk: the positions [from, to) of q this chunk writes; a
 * streamed layer writes back exactly the blocks they touch. */
void kv_seq_chunk(kv_seq *q, int64_t from, int64_t to);
/* Around layer l of each chunk (layer 0 starts a chunk): begin waits for
 * l's slot and starts copying the next streamed layer in; end starts the
 * write-back of l's new blocks.  The status is the backend's. */
enum be_status kv_store_layer_begin(kv_store *s, int layer);
enum be_status kv_store_layer_end(kv_store *s, int layer);
/* Waits for the write-backs and records the step's figures; before the
 * commit or abort of the step's sequences. */
enum be_status kv_store_step_end(kv_store *s);

#endif
