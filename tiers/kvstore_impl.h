/* kvstore_impl.h - the store's private structures, shared by kvstore.c
 * (homes, strategies, transactions, migration) and stream.c (device slots,
 * prefetch, write-back, figures).  Not part of the API.
 */
#ifndef KVTIER_KVSTORE_IMPL_H
#define KVTIER_KVSTORE_IMPL_H

#include "tiers/kvstore.h"

#define KV_ERR_LEN 256

enum kv_home {
    KV_HOME_PAGED = 0, /* blocks from the device pool, through a table */
    KV_HOME_DEV = 1,   /* a device extent used as a ring of blocks */
    KV_HOME_HOST = 2,  /* a host-tier extent used as a ring of blocks; streamed */
};

/* An extent: a device buffer, or a range carved out of a host-pool slab
 * (dev NULL).  data == NULL: none. */
struct kv_ext {
    be_buffer *dev;
    void *data;
    size_t size;
};

/* hostpool.c: the host tier's slabs (its invariants are there).  A free
 * range of a slab, offsets in bytes. */
struct hp_range {
    size_t off, len;
};

struct hp_slab {
    be_buffer *buf;
    struct hp_range *free; /* sorted by offset, no two touching */
    size_t n_free, cap_free;
    size_t n_live; /* extents carved out of it */
};

struct kv_hostpool {
    be_backend *be;
    struct hp_slab *slabs;
    size_t n_slabs, cap_slabs;
    size_t slab_bytes;    /* sum of the slabs' sizes */
    uint64_t slab_allocs; /* slabs taken from the backend so far */
};

/* A pool block.  ref counts the sequence tables holding it (forks and
 * prefix matches share blocks); a block in the prefix cache (pub set) is
 * immutable and stays out of the free list while the cache keeps it. */
struct kv_block {
    void *data;
    int ref;
    struct kv_pentry *pub;
};

/* A prefix-cache entry (prefix.c): one full token block of a chain, with
 * the pool block of every layer holding its KV. */
struct kv_pentry {
    uint64_t hash;              /* xxh3(tokens, seed = parent's hash) */
    struct kv_pentry *parent;   /* the previous block of the chain, NULL for block 0 */
    struct kv_pentry *next;     /* hash bucket chain */
    struct kv_pentry *lru_prev, *lru_next; /* on the LRU list iff refs == 0 && children == 0 */
    int refs;                   /* sequence references to its blocks, all layers summed */
    int children;               /* cached entries whose parent this is */
    struct kv_block **blocks;   /* [n_layers] */
    int32_t *tokens;            /* [bt] */
    uint64_t ns;                /* kv_seq_params.prefix_ns of the sequence that published it */
    uint64_t check;             /* a second chain hash (prefix.c "On disk"), never masked */
    bool saved;                 /* read from disk or handed out already: not serialized again */
    bool shipped;               /* inserted, or handed out by kv_store_prefix_ship: not shipped again */
};

/* A serialized entry waiting for kv_store_prefix_take_evicted. */
struct kv_pqueued {
    struct kv_pqueued *next;
    struct kv_prefix_block b;
};

struct kv_layer {
    enum kv_home home;
    int window; /* 0 = full attention */
    int keep;   /* sliding: tokens kept after a commit (W-1 dynamic, W static) */
    /* The view's block array.  Paged: the table itself.  Extent homes: the
     * ring's blocks in logical order, rebuilt by ext_view_refresh (or, for
     * a streamed layer during a step, pointers into its device slot). */
    void **blocks;
    struct kv_block **pb; /* paged: the descriptors of blocks[] (same length) */
    int n_blocks, cap;
    int64_t base; /* block 0 of the view covers [base, base + bt) */
    int64_t lo;   /* oldest stored position */
    /* extent homes: logical block b lives in ring block b % ext_blocks */
    struct kv_ext ext;
    int ext_blocks;
    bool ext_fixed; /* static full layer: sized for max_cache_len, never grows */
    /* sink strategy: a reference to the block holding positions [0, S),
     * taken when the window leaves it (the table then starts later) */
    struct kv_block *sink_blk;
    /* this step's device slot region (streamed layers, stream.c) */
    size_t slot_off;
    int64_t slot_b0;
    int slot_nb;
};

struct kv_seq {
    kv_store *s;
    struct kv_seq_params p;
    enum kv_strategy strategy; /* may differ from p.strategy after a fallback */
    enum kv_fallback fallback;
    int64_t len;  /* committed tokens (HF get_seq_length) */
    int pending;  /* reserved, not yet committed */
    bool more;    /* kv_seq_update_continues: for the next reserve */
    int64_t chunk_from, chunk_to; /* positions the current chunk writes */
    bool record_past; /* sliding layers keep every state until the next crop */
    /* prefix cache (prefix.c): the first pub_blocks blocks are published,
     * the last of them is pub_tail; ids[] holds the token ids of the
     * positions [pub_blocks * bt, len + pending) when `publish` is set */
    bool publish;
    int64_t pub_blocks;
    struct kv_pentry *pub_tail;
    int32_t *ids;
    int64_t ids_cap;
    bool ids_set; /* kv_seq_tokens was called for the pending step */
    struct kv_xfer_stats xfer;
    uint64_t copied_bytes; /* kv_seq_stats().copied_bytes */
    struct kv_layer *layers;
    struct kvq_seq *kvq; /* KV_QUANTIZED: the quantized layers (kvquant.c); NULL otherwise */
    struct kv_seq_loader *load; /* layers still to fill from an image (image.c); NULL once all are */
    struct kv_state *state; /* a state store's sequence (state.c); NULL otherwise */
    bool chunk_live; /* kv_seq_chunk named the current chunk; state.c has not checkpointed its end */
};

struct kv_store {
    be_backend *be;
    struct kv_geom g;
    int *layer_window;  /* owned copy of g.layer_window */
    int bt;             /* tokens per block */
    int64_t ckpt_interval; /* a state store's checkpoint_interval */
    size_t block_bytes; /* K and V of one block */
    char err[KV_ERR_LEN];
    /* the device pool of paged blocks */
    be_buffer **chunks;
    struct kv_block **chunk_desc; /* [n_chunks] the descriptors of each chunk's blocks */
    size_t n_chunks, cap_chunks;
    struct kv_block **free_blocks; /* stack of unused blocks */
    size_t n_free;
    size_t n_total;     /* blocks owned by the pool */
    /* extents */
    size_t host_budget, host_used, dev_ext_bytes;
    struct kv_hostpool hp; /* where host extents come from */
    /* the prefix cache (prefix.c) */
    bool prefix_on;
    uint64_t hash_mask;
    struct kv_pentry **buckets;
    size_t n_buckets, n_entries;
    struct kv_pentry *lru_head, *lru_tail; /* oldest first */
    size_t n_unref;
    size_t prefix_mem; /* budget of the n_unref entries' bytes; 0 = none */
    uint64_t prefix_hits, prefix_evictions;
    /* a state store's shared checkpoints (state.c "Shared checkpoints") */
    bool state_prefix;
    struct kv_sckpt *sc_old, *sc_new; /* LRU list, oldest first */
    size_t n_sckpt;
    /* kept sequences (keep.c): all, newest first; the unreferenced on an LRU list */
    struct kv_kept *kept, *kept_old, *kept_new;
    size_t n_kept, n_kept_unref, kept_unref_bytes;
    /* evicted entries serialized for the caller (prefix.c "On disk") */
    size_t spill_max, spill_bytes; /* spill_max 0: none are kept */
    struct kv_pqueued *spill_head, *spill_tail; /* oldest first */
    uint64_t spill_dropped;
    size_t export_at; /* the bucket kv_store_prefix_export looks at next */
    uint64_t fallbacks, fallbacks_oom;
    /* sequences with a reservation (the current step's batch) */
    kv_seq **active;
    int n_active, cap_active;
    /* streaming state (stream.c) */
    be_buffer *slot[2];
    size_t slot_cap;      /* bytes of each slot */
    bool streaming;       /* between step_begin and step_end, some layer streams */
    int *slot_of;         /* [n_layers] slot index of a streamed layer, -1 = resident this step */
    bool *issued;         /* [n_layers] copy-in started in this chunk */
    uint64_t n_rec;       /* event pairs recorded so far: orders them */
    uint64_t *in_rec;     /* [n_layers] ordinal of the layer's last copy-in */
    uint64_t *wb_rec;     /* [n_layers] ordinal of its write-back not yet timed, 0 = none */
    be_event **ev;        /* [n_layers * 4]: copy-in start/end, write-back start/end */
    double step_t0;
    struct kv_xfer_stats step, total;
};

/* kvstore.c: block references */
void blk_get(kv_store *s, struct kv_block *b);
void blk_put(kv_store *s, struct kv_block *b);
/* One block for a sequence's table (ref 1): the free list, a new chunk,
 * or an evicted prefix-cache entry's. */
enum tier_status pool_take(kv_store *s, struct kv_block **out);

/* prefix.c */
void prefix_release_all(kv_store *s);
bool prefix_evict_one(kv_store *s); /* frees the LRU unreferenced entry; false if none */
void prefix_hold(kv_store *s, struct kv_pentry *e);
void prefix_unhold(kv_store *s, struct kv_pentry *e);
void prefix_init(kv_seq *q);    /* at creation: does q take part? */
void prefix_stop(kv_seq *q);    /* q stops taking part (moved off paged device blocks) */
void prefix_reserve(kv_seq *q, int64_t end); /* room for the ids of [.., end) */
void prefix_publish(kv_seq *q); /* at commit: publishes q's newly full blocks */
void prefix_crop(kv_seq *q, int64_t new_len);
enum tier_status prefix_fork(const kv_seq *q, kv_seq *child);

/* state.c: a state store's sequences */
enum tier_status state_check_params(const struct kv_seq_params *p, char *why, size_t cap);
enum tier_status state_seq_init(kv_seq *q, bool host); /* host: the state starts in the host tier */
void state_seq_release(kv_seq *q); /* accepts q->state == NULL */
bool state_on_host(const kv_seq *q);
enum tier_status state_seq_reserve(kv_seq *q); /* a host state's second host copy for the step */
enum tier_status state_seq_commit(kv_seq *q);
void state_seq_abort(kv_seq *q);
enum tier_status state_seq_offload(kv_seq *q); /* to the host tier; all or nothing */
/* after a chunk's last layer (its write-backs queued): checkpoints at its sequences' ends */
enum be_status state_chunk_end(kv_store *s);
/* Streaming a host state (stream.c): layer l's copy into its slot region
 * and back, for a sequence in the current chunk. */
enum be_status state_copy_in(kv_seq *q, int layer, char *region, struct kv_xfer_stats *x);
enum be_status state_write_back(kv_seq *q, int layer, const char *region, struct kv_xfer_stats *x);
enum tier_status state_seq_rewind(kv_seq *q, int64_t len);
enum tier_status state_seq_fork(const kv_seq *q, kv_seq *child);
void state_seq_bytes(const kv_seq *q, size_t *dev, size_t *host);
/* A state sequence's part of its image (state.c "images") */
size_t state_image_bytes(const kv_seq *q);
/* At least state_image_bytes of any sequence of len tokens on s. */
size_t state_image_bound(const kv_store *s, int64_t len);
enum tier_status state_seq_save(const kv_seq *q, uint8_t *p);
enum tier_status state_image_check(kv_store *s, size_t size, int *n_ckpt);
enum tier_status state_fill_layer(kv_seq *q, int layer, const uint8_t *body);
enum tier_status state_fill_ckpts(kv_seq *q, const uint8_t *body, int n_ckpt, int64_t len);
/* state.c "Shared checkpoints": the prefix cache of a state store */
void state_seq_tokens(kv_seq *q, const int32_t *ids);
enum tier_status state_seq_match(kv_seq *q, const int32_t *tokens, int64_t n, int64_t *n_cached);
void state_shared_fit(kv_store *s); /* within prefix_mem */
bool state_shared_evict_one(kv_store *s); /* the LRU shared checkpoint; false if none */
void state_shared_release(kv_store *s);

/* keep.c: kept sequences */
void kept_fit(kv_store *s);          /* within prefix_mem */
bool kept_evict_one(kv_store *s);    /* the LRU unreferenced one; false if none */
void kept_release_all(kv_store *s);
/* kv_store_prefix_export's part for kept sequences: the next one neither
 * read from the caller's disk nor handed out before */
enum tier_status kept_export(kv_store *s, struct kv_prefix_block *out, bool *got);
/* prefix.c: queues b (taking its buffer) for kv_store_prefix_take_evicted,
 * dropping the oldest past spill_max; b itself is dropped if larger */
void spill_push(kv_store *s, const struct kv_prefix_block *b);

/* kvquant.c: the KV_QUANTIZED sequence's side of creation, the step
 * transaction (all layers or none), release and size */
enum tier_status kvq_seq_init(kv_seq *q);
void kvq_seq_release(kv_seq *q); /* accepts q->kvq == NULL */
enum tier_status kvq_seq_reserve(kv_seq *q, int n_new, bool more);
enum tier_status kvq_seq_commit(kv_seq *q); /* after the store's commit set each layer's lo */
void kvq_seq_abort(kv_seq *q);
size_t kvq_seq_bytes(const kv_seq *q); /* bytes of its blocks in its tier, free ones included */
/* TIER_ENOTSUP naming `what` ("crop", "fork", ...) */
enum tier_status kvq_unsupported(kv_seq *q, const char *what);
/* Quantized + offloaded: moves every block to the host tier (all or
 * nothing; only between steps); from then on new blocks come from there
 * and each layer streams through the device slots. */
enum tier_status kvq_seq_offload(kv_seq *q);
bool kvq_seq_on_host(const kv_seq *q); /* false for a dense sequence */
/* Streaming a host-tier quantized sequence (stream.c), after its reserve:
 * the slot bytes a layer's step needs, room for the table of slot blocks
 * kv_seq_qview hands out, the copy of a layer's blocks into its slot
 * region, and the write-back of the full-precision blocks holding
 * positions [from, to). */
size_t kvq_seq_slot_bytes(const kv_seq *q, int layer);
enum tier_status kvq_seq_slot_table(kv_seq *q);
enum be_status kvq_seq_copy_in(kv_seq *q, int layer, char *region, struct kv_xfer_stats *x);
enum be_status kvq_seq_write_back(kv_seq *q, int layer, char *region, int64_t from, int64_t to,
                                  struct kv_xfer_stats *x);

/* What an image keeps of a quantized layer besides the sequence's length
 * (kvq_layer_view's base / T, hi and scales): the rest follows from them. */
struct kvq_layer_state {
    int64_t nq;   /* positions [0, nq) are quantized */
    int64_t qoff; /* quantized blocks dropped below a sliding window */
    float scale_k, scale_v;
};
/* image.c: layer l's KIVI layer, for kvq_layer_view */
struct kvq_layer *kvq_seq_layer(const kv_seq *q, int layer);
/* image.c: a quantized sequence just made by kvq_seq_init takes the state
 * of each layer (ls[n_layers]; q->len set) and the blocks it holds, in the
 * host tier when host; the blocks' contents are the caller's to write. */
enum tier_status kvq_seq_restore(kv_seq *q, bool host, const struct kvq_layer_state *ls);

/* hostpool.c.  hp_alloc carves bytes (rounded up to 64) out of a slab,
 * taking a new one when no free range fits: max(64 MiB, bytes rounded up
 * to 2 MiB), cut to what keeps the slabs within a non-zero budget but
 * never below bytes.  Failing, it leaves the pool's extents as they were
 * (BE_ENOMEM_HOST for its own tables, else the backend's status).
 * hp_free takes the size hp_alloc was given and never fails; a slab left
 * empty goes back to the backend unless it is the only one. */
void hp_init(struct kv_hostpool *p, be_backend *be);
enum be_status hp_alloc(struct kv_hostpool *p, size_t bytes, size_t budget, void **out);
void hp_free(struct kv_hostpool *p, void *ptr, size_t bytes);
void hp_release(struct kv_hostpool *p); /* every slab back to the backend */

/* stream.c */
enum tier_status kv_stream_init(kv_store *s);
void kv_stream_release(kv_store *s);
void kv_stream_slots_release(kv_store *s); /* only between steps (invariant 3) */
/* During a step: where a streamed layer's region of this sequence starts
 * in the layer's slot. */
char *kv_slot_region(const kv_store *s, int layer, const struct kv_layer *L);

/* kvstore.c helpers stream.c uses */
void ext_view_refresh(const kv_seq *q, struct kv_layer *L);
int64_t layer_view_lo(const kv_seq *q, const struct kv_layer *L);
/* The sink strategy's part of a layer's view (kvstore.c invariant 8):
 * key_rope, shift, the sinks and their block; raises out->lo past them. */
void sink_view(const kv_seq *q, const struct kv_layer *L, struct be_kv_view *out);
bool kv_store_reclaim(kv_store *s);
/* Host-tier memory charged to the host budget (invariant 5 of kvstore.c);
 * kv_host_free returns the slots once no host bytes are left. */
enum tier_status kv_host_alloc(kv_store *s, size_t bytes, void **out);
void kv_host_free(kv_store *s, void *ptr, size_t bytes);
/* A device buffer outside the block pool (counted in dev_ext_bytes): over
 * budget, unreferenced prefix-cache blocks go first; then TIER_ENOMEM_DEV
 * with a message naming the budget and `what` the bytes were for. */
enum tier_status kv_dev_alloc(kv_store *s, size_t bytes, const char *what, be_buffer **out);
void kv_dev_free(kv_store *s, be_buffer *b, size_t bytes);
/* Layer l's window and keep (struct kv_layer) in a sequence with params p. */
void kv_layer_shape(const kv_store *s, const struct kv_seq_params *p, int l, int *window, int *keep);

/* image.c: a saved sequence's state, checked against the store. */
struct kv_seq_state {
    struct kv_seq_params p;
    enum kv_strategy strategy;
    enum kv_fallback fallback;
    int64_t len;
    bool record_past;
    bool kvq_host;                    /* quantized: its blocks are in the host tier */
    const enum kv_home *home;         /* [n_layers] (dense strategies) */
    const int64_t *lo;                /* [n_layers] each layer's oldest stored position */
    const struct kvq_layer_state *kvq;/* [n_layers] (quantized) */
    int n_ckpt;                       /* a state store's: its image's checkpoints (state.c) */
};
/* A new sequence in state x with storage for every stored position, the
 * contents not written yet.  all_host: every layer in the host tier
 * instead (the out-of-memory fallback of kv_seq_offload: the strategy
 * becomes offloaded, the fallback KV_FALLBACK_OOM).  All or nothing. */
enum tier_status kv_seq_restore(kv_store *s, const struct kv_seq_state *x, bool all_host, kv_seq **out);

/* kvstore.c: the address of logical block b of layer L (b must be live in
 * it): where the layer keeps it, also while a step streams the layer
 * through a device slot (its view then points into the slot). */
char *kv_layer_block(const kv_store *s, const struct kv_layer *L, int64_t b);

/* image.c: fills the layers [.., layer] of a sequence loading layer by
 * layer (kv_seq_load_begin) that are not yet; TIER_OK at once for one
 * that is not loading.  The loader's free accepts NULL. */
enum tier_status kv_seq_fill(kv_seq *q, int layer);
void kv_seq_loader_free(struct kv_seq_loader *ld);

/* Records the message for kv_store_errmsg and returns st. */
enum tier_status kv_fail(kv_store *s, enum tier_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* kv_fail into a caller's buffer: for checks any thread may run */
enum tier_status why_fail(char *why, size_t cap, enum tier_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#endif
