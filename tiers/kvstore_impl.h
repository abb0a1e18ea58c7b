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

struct kv_layer {
    enum kv_home home;
    int window; /* 0 = full attention */
    int keep;   /* sliding: tokens kept after a commit (W-1 dynamic, W static) */
    /* The view's block array.  Paged: the table itself.  Extent homes: the
     * ring's blocks in logical order, rebuilt by ext_view_refresh (or, for
     * a streamed layer during a step, pointers into its device slot). */
    void **blocks;
    int n_blocks, cap;
    int64_t base; /* block 0 of the view covers [base, base + bt) */
    int64_t lo;   /* oldest stored position */
    /* extent homes: logical block b lives in ring block b % ext_blocks */
    be_buffer *ext;
    int ext_blocks;
    bool ext_fixed; /* static full layer: sized for max_cache_len, never grows */
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
    int64_t chunk_from, chunk_to; /* positions the current chunk writes */
    struct kv_xfer_stats xfer;
    struct kv_layer *layers;
};

struct kv_store {
    be_backend *be;
    struct kv_geom g;
    int *layer_window;  /* owned copy of g.layer_window */
    int bt;             /* tokens per block */
    size_t block_bytes; /* K and V of one block */
    char err[KV_ERR_LEN];
    /* the device pool of paged blocks */
    be_buffer **chunks;
    size_t n_chunks, cap_chunks;
    void **free_blocks; /* stack of unused blocks */
    size_t n_free;
    size_t n_total;     /* blocks owned by the pool */
    /* extents */
    size_t host_budget, host_used, dev_ext_bytes;
    uint64_t fallbacks;
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

/* stream.c */
enum tier_status kv_stream_init(kv_store *s);
void kv_stream_release(kv_store *s);

/* kvstore.c helpers stream.c uses */
void ext_view_refresh(const kv_seq *q, struct kv_layer *L);
int64_t layer_view_lo(const kv_seq *q, const struct kv_layer *L);
void kv_store_trim(kv_store *s);
/* Records the message for kv_store_errmsg and returns st. */
enum tier_status kv_fail(kv_store *s, enum tier_status st, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
double kv_now(void);

#endif
