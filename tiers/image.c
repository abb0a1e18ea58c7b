/* image.c - a sequence as bytes and back (kvstore.h "images"), for the disk
 * tier.
 *
 * FORMAT (version 2).  Every integer little-endian; i = signed, u =
 * unsigned; floats as their IEEE-754 bits.  No field is a pointer or a
 * capacity: an image is a function of the sequence's state alone.
 *
 *   off  size  field
 *     0     8  magic "KVTSEQ\r\n"
 *     8   u32  version (2)
 *    12   u32  n_layers         \
 *    16   u32  n_kv_heads        |  the store's geometry: must equal the
 *    20   u32  head_dim          |  loading store's
 *    24   u32  dtype (be_dtype)  |
 *    28   u32  block_tokens     /
 *    32   u32  strategy (requested, kv_seq_params)
 *    36   u32  offload_sliding
 *    40   i64  max_cache_len
 *    48   i32  window_length
 *    52   i32  num_sink_tokens
 *    56   u64  prefix_ns
 *    64   u32  param flags: 1 adaptive, 2 no_fallback, 4 no_prefix_cache,
 *              8 offload, 16 sink
 *    68   u32  quant.backend
 *    72   i32  quant.nbits, 76 axis_key, 80 axis_value, 84 q_group_size,
 *              88 residual_length
 *    92   u32  strategy now (differs after a fallback)
 *    96   u32  fallback (kv_fallback)
 *   100   u32  state flags: 1 past recording, 2 quantized blocks in the host tier
 *   104   i64  len (tokens seen)
 *   112   u64  size of the whole image in bytes
 *   120   u32  window of each layer [n_layers] (geometry too)
 *   then the layer table, 40 bytes per layer:
 *     +0  i64  lo       the oldest stored position
 *     +8  i64  nq       quantized: positions [0, nq) are quantized; else 0
 *    +16  i64  qoff     quantized: the first quantized block held; else 0
 *    +24  u32  home     dense: 0 paged, 1 device, 2 host; quantized: 0
 *    +28  u32  scale_k  quantized: the e4m3 tensor scales; else 0
 *    +32  u32  scale_v
 *    +36  u32  0
 *   then the blocks of layer 0, of layer 1, ...:
 *     dense:      the sinks' block where the layer keeps it apart (the
 *                 sink strategy once lo >= T), then blocks lo/T .. (len-1)/T
 *     quantized:  the sinks' block if there are sinks, the quantized
 *                 blocks qoff .. (nq-1)/Tq whole, then the residual's
 *                 blocks nq/T .. (len-1)/T
 *   A state-space model's sequence (kv_geom.state_bytes; n_kv_heads and
 *   head_dim 0, strategy dynamic, static or offloaded) has instead: each
 *   layer's table entry all 0 but lo, which holds state_bytes, then the
 *   state (n_layers x state_bytes, as the layers lay it out), then each
 *   checkpoint as u64 pos and its n_layers x state_bytes, pos ascending in
 *   (0, len] (tiers/state.c): a size that does not split so is refused, and
 *   so is (when the checkpoints load) a position out of line.
 *   A dense block b is the store's block as be_kv_view lays it out (K, then
 *   V, each [n_kv_heads][T][head_dim] of dtype) for positions [bT, bT+T).
 *   The layer stores [0, S) and [lo, len) (S sinks once a sink sequence
 *   evicted, lo > 0), the residual [nq, len); every other row is zero.  T
 *   is the store's block_tokens, Tq the quantized block's tokens
 *   (kvq_block_tokens).
 *
 * NOTES
 * - Everything a load allocates and checks before allocating follows from
 *   the first kv_image_head_size() bytes (header, windows, table), so a
 *   load can start before the blocks are in and fill each layer as its
 *   bytes arrive (kv_seq_load_begin): the disk tier's restores compute
 *   the first layers while the last are still being read.
 * - Blocks move whole, one copy each between the image and where the layer
 *   keeps them: no staging, no reordering, so a restore goes image ->
 *   device with nothing in between.  A load queues a layer's device blocks
 *   on the copy stream (be_copy_async) and fences them with an event the
 *   compute stream waits for, so the host goes on to the layer's kernels;
 *   it waits itself only when the load ends or fails, before the image and
 *   the blocks may go.  A save copies with be_copy: the bytes must be in
 *   the image before it is written.  The save
 *   zeroes the rows the layer does not store (whatever a recycled block
 *   held there); the load refuses an image whose such rows are not zero.
 *   Quantized blocks go whole, unused rows included as they were: their
 *   layout is the backend's.
 * - The load checks every field before it allocates: the geometry, the
 *   params (kv_store_check_params, and the quantized format), the state against
 *   the params, each layer's lo against the rule that produced it
 *   (kvstore.c invariants 1 and 8), the sizes the table implies against
 *   the image's; an image is accepted only if it is exactly what
 *   kv_seq_save writes for some state, so save(load(img)) == img unless the
 *   load fell back to the host tier.
 * - A state image loads layer by layer too: its state's layers come first,
 *   each filled as the forward pass reaches it; its checkpoints, most of
 *   the image at a small interval but read only by crops, forks and saves,
 *   are a last part that kv_seq_load_finish (or one of those) fills.  They
 *   are checked then, not before the allocation: a step may already have
 *   run, and its own checkpoints come after them.
 * - A loaded sequence holds private blocks and does not take part in the
 *   prefix cache (the image has no token ids to publish by).
 */
#include "tiers/kvstore_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tiers/quant.h"
#include "util/half.h"
#include "util/le.h"

#define IMG_MAGIC "KVTSEQ\r\n"
#define IMG_VERSION 2
#define IMG_HDR 120
#define LT_ENTRY 40 /* a layer's entry in the table */

enum { PF_ADAPTIVE = 1, PF_NO_FALLBACK = 2, PF_NO_PREFIX = 4, PF_OFFLOAD = 8, PF_SINK = 16, PF_ALL = 31 };
enum { SF_RECORD_PAST = 1, SF_KVQ_HOST = 2, SF_ALL = 3 };

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* Header, windows and layer table: what a load reads before it allocates. */
static size_t head_size(const kv_store *s)
{
    return IMG_HDR + (4 + LT_ENTRY) * (size_t)s->g.n_layers;
}

size_t kv_image_head_size(const kv_store *s)
{
    return head_size(s);
}

/* The sinks a dense layer stores apart from [lo, len): all S once the
 * window left them (kvstore.c invariant 8). */
static int64_t dense_sink_rows(const struct kv_seq_params *p, int64_t lo)
{
    return p->sink && lo > 0 ? p->num_sink_tokens : 0;
}

static int64_t quant_sink_rows(const struct kv_seq_params *p, int64_t len)
{
    return p->sink ? min64(p->num_sink_tokens, len) : 0;
}

/* Quantized blocks a layer holds: from qoff to the one holding nq - 1. */
static int64_t quant_blocks(int64_t nq, int64_t qoff, int64_t T)
{
    return (nq + T - 1) / T - qoff;
}

/* The blocks of a layer's part of the image (FORMAT), from its state. */
struct plan {
    bool sink;      /* the sinks' block first */
    int64_t rs[4];  /* the positions it stores: [rs0, rs1) (rs2 = rs3 = 0) */
    int64_t nqb;    /* then this many quantized blocks */
    int64_t b0, nb; /* then the dense blocks b0 .. b0 + nb - 1 */
    int64_t rt[4];  /* the positions they store: [rt0, rt1) and [rt2, rt3) */
};

/* k: the quantized state of the layer (T its block's tokens), NULL for a
 * dense one.  The sinks' block of a dense layer is there exactly when
 * kv_seq_restore gives the layer one (its table starts past block 0). */
static struct plan plan_of(const kv_store *s, const struct kv_seq_params *p, int64_t len, int64_t lo,
                           const struct kvq_layer_state *k, int64_t T)
{
    struct plan pl = {0};
    int64_t from;
    if (k) {
        pl.rs[1] = quant_sink_rows(p, len);
        pl.sink = pl.rs[1] > 0;
        pl.nqb = quant_blocks(k->nq, k->qoff, T);
        from = pl.rt[0] = k->nq;
        pl.rt[1] = len;
    } else {
        pl.rs[1] = pl.rt[1] = dense_sink_rows(p, lo);
        pl.sink = p->sink && p->num_sink_tokens && lo >= s->bt;
        from = pl.rt[2] = lo;
        pl.rt[3] = len;
    }
    pl.b0 = from / s->bt;
    pl.nb = len > from ? (len - 1) / s->bt - pl.b0 + 1 : 0;
    return pl;
}

/* Layer l of q: its table entry's fields and its plan; *qbb the bytes of
 * its quantized blocks (0 for a dense layer). */
static struct plan seq_plan(const kv_seq *q, int l, struct kvq_layer_state *k, size_t *qbb)
{
    const struct kv_layer *L = &q->layers[l];
    *k = (struct kvq_layer_state){0};
    *qbb = 0;
    if (!q->kvq)
        return plan_of(q->s, &q->p, q->len, L->lo, NULL, 1);
    struct be_kvq_view v;
    kvq_layer_view(kvq_seq_layer(q, l), &v);
    int64_t T = v.fmt->block_tokens;
    *k = (struct kvq_layer_state){.nq = v.hi, .qoff = v.base / T, .scale_k = v.scale_k, .scale_v = v.scale_v};
    *qbb = v.fmt->block_bytes;
    return plan_of(q->s, &q->p, q->len, L->lo, k, T);
}

static size_t plan_bytes(const kv_store *s, const struct plan *pl, size_t qbb)
{
    return (size_t)(pl->sink + pl->nb) * s->block_bytes + (size_t)pl->nqb * qbb;
}

/* ---- moving blocks --------------------------------------------------------- */

struct io {
    kv_store *s;
    uint8_t *p;     /* the image, at the next block */
    bool load;      /* image -> sequence; else sequence -> image */
    bool async;     /* a load's device blocks go up on the copy stream (the loader fences them) */
    bool queued;    /* some did */
};

/* A block of bytes, whole, between where the layer keeps it (host: host
 * memory, else the device) and the image. */
static enum tier_status block_io(struct io *io, void *blk, bool host, size_t bytes)
{
    enum be_status st = BE_OK;
    if (host) {
        memcpy(io->load ? blk : (void *)io->p, io->load ? (void *)io->p : blk, bytes);
    } else if (io->load && io->async) {
        st = be_copy_async(io->s->be, blk, io->p, bytes, BE_H2D);
        io->queued = true;
    } else {
        st = io->load ? be_copy(io->s->be, blk, io->p, bytes, BE_H2D) : be_copy(io->s->be, io->p, blk, bytes, BE_D2H);
    }
    io->p += bytes;
    return st == BE_OK ? TIER_OK
                       : kv_fail(io->s, TIER_EIO, "sequence image: copying a KV block %s the device: %s",
                                 io->load ? "to" : "from", be_strerror(st));
}

static bool stored(int64_t pos, const int64_t r[4])
{
    return (pos >= r[0] && pos < r[1]) || (pos >= r[2] && pos < r[3]);
}

/* The rows of dense block img (positions [pos0, pos0 + T)) whose positions
 * r does not hold: zeroed (set), or checked to be zero. */
static bool unstored_rows(const kv_store *s, uint8_t *img, int64_t pos0, const int64_t r[4], bool set)
{
    size_t hrow = (size_t)s->g.head_dim * be_dtype_size(s->g.dtype);
    int64_t bt = s->bt;
    for (int64_t t = 0; t < bt;) {
        if (stored(pos0 + t, r)) {
            t++;
            continue;
        }
        int64_t e = t + 1;
        while (e < bt && !stored(pos0 + e, r))
            e++;
        size_t n = (size_t)(e - t) * hrow;
        /* K of every head, then V: [2 * n_kv_heads][T] rows */
        for (int hh = 0; hh < 2 * s->g.n_kv_heads; hh++) {
            uint8_t *x = img + ((size_t)hh * (size_t)bt + (size_t)t) * hrow;
            if (set)
                memset(x, 0, n);
            else if (x[0] || memcmp(x, x + 1, n - 1))
                return false;
        }
        t = e;
    }
    return true;
}

static enum tier_status dense_io(struct io *io, void *blk, bool host, int64_t pos0, const int64_t r[4])
{
    kv_store *s = io->s;
    uint8_t *img = io->p;
    if (io->load && !unstored_rows(s, img, pos0, r, false))
        return kv_fail(s, TIER_EINVAL,
                       "sequence image: the block of positions %lld.. has rows it does not store that are not zero "
                       "(field blocks)",
                       (long long)pos0);
    enum tier_status st = block_io(io, blk, host, s->block_bytes);
    if (st == TIER_OK && !io->load)
        unstored_rows(s, img, pos0, r, true);
    return st;
}

static enum tier_status mismatch(kv_store *s, int l)
{
    return kv_fail(s, TIER_EINVAL, "sequence image: layer %d: its storage does not match its state", l);
}

/* Layer l's blocks (plan pl), between q's storage and the image. */
static enum tier_status layer_io(struct io *io, kv_seq *q, int l, const struct plan *pl)
{
    kv_store *s = io->s;
    const struct kv_layer *L = &q->layers[l];
    enum tier_status st = TIER_OK;
    if (pl->sink) /* a device pool block (kvstore.c invariant 8) */
        st = L->sink_blk ? dense_io(io, L->sink_blk->data, false, 0, pl->rs) : mismatch(s, l);
    void *const *blocks = L->blocks;
    int n = L->n_blocks;
    int64_t base = L->base;
    bool host = L->home == KV_HOME_HOST;
    if (q->kvq) {
        struct be_kvq_view v;
        kvq_layer_view(kvq_seq_layer(q, l), &v);
        host = kvq_seq_on_host(q);
        if (st == TIER_OK && v.n_blocks != pl->nqb)
            st = mismatch(s, l);
        for (int i = 0; i < v.n_blocks && st == TIER_OK; i++)
            st = block_io(io, v.blocks[i], host, v.fmt->block_bytes);
        blocks = v.rest.blocks;
        n = v.rest.n_blocks;
        base = v.rest.base;
    }
    for (int64_t b = pl->b0; b < pl->b0 + pl->nb && st == TIER_OK; b++) {
        int64_t i = b - base / s->bt;
        if (i < 0 || i >= n)
            st = mismatch(s, l);
        else /* an extent's through its ring: a streamed layer's view is its slot during a step */
            st = dense_io(io, q->kvq || L->home == KV_HOME_PAGED ? blocks[i] : kv_layer_block(s, L, b), host,
                          b * s->bt, pl->rt);
    }
    return st;
}

/* ---- saving ---------------------------------------------------------------- */

size_t kv_seq_image_size(const kv_seq *q)
{
    size_t n = head_size(q->s), qbb;
    if (q->state)
        return n + state_image_bytes(q);
    struct kvq_layer_state k;
    for (int l = 0; l < q->s->g.n_layers; l++) {
        struct plan pl = seq_plan(q, l, &k, &qbb);
        n += plan_bytes(q->s, &pl, qbb);
    }
    return n;
}

size_t kv_seq_image_bound(const kv_store *s, const struct kv_seq_params *p, int64_t n)
{
    if (n < 0)
        return 0;
    if (s->g.state_bytes) /* the state, and a checkpoint every interval at most */
        return head_size(s) + state_image_bound(s, n);
    /* a layer: its sinks' block, and the blocks its n positions span, one
     * more where they start inside a block; quantized ones as many again,
     * of the format's blocks, past a residual of dense blocks */
    size_t dense = (size_t)(n / s->bt + 2) + 1, per_layer = dense * s->block_bytes;
    if (p->strategy == KV_QUANTIZED) {
        struct be_kvq_format f;
        struct kvq_error ke;
        if (kvq_store_format(s, &p->quant, &f, &ke) != TIER_OK)
            return 0;
        per_layer += (size_t)(n / f.block_tokens + 2) * f.block_bytes;
    }
    return head_size(s) + (size_t)s->g.n_layers * per_layer;
}

static void put_header(const kv_seq *q, uint8_t *b, size_t size)
{
    const kv_store *s = q->s;
    const struct kv_seq_params *p = &q->p;
    memcpy(b, IMG_MAGIC, 8);
    put32(b + 8, IMG_VERSION);
    put32(b + 12, (uint32_t)s->g.n_layers);
    put32(b + 16, (uint32_t)s->g.n_kv_heads);
    put32(b + 20, (uint32_t)s->g.head_dim);
    put32(b + 24, (uint32_t)s->g.dtype);
    put32(b + 28, (uint32_t)s->bt);
    put32(b + 32, (uint32_t)p->strategy);
    put32(b + 36, (uint32_t)p->offload_sliding);
    put64(b + 40, (uint64_t)p->max_cache_len);
    put32(b + 48, (uint32_t)p->window_length);
    put32(b + 52, (uint32_t)p->num_sink_tokens);
    put64(b + 56, p->prefix_ns);
    put32(b + 64, (p->adaptive ? PF_ADAPTIVE : 0) | (p->no_fallback ? PF_NO_FALLBACK : 0) |
                      (p->no_prefix_cache ? PF_NO_PREFIX : 0) | (p->offload ? PF_OFFLOAD : 0) |
                      (p->sink ? PF_SINK : 0));
    put32(b + 68, (uint32_t)p->quant.backend);
    put32(b + 72, (uint32_t)p->quant.nbits);
    put32(b + 76, (uint32_t)p->quant.axis_key);
    put32(b + 80, (uint32_t)p->quant.axis_value);
    put32(b + 84, (uint32_t)p->quant.q_group_size);
    put32(b + 88, (uint32_t)p->quant.residual_length);
    put32(b + 92, (uint32_t)q->strategy);
    put32(b + 96, (uint32_t)q->fallback);
    put32(b + 100, (q->record_past ? SF_RECORD_PAST : 0) | (kvq_seq_on_host(q) ? SF_KVQ_HOST : 0));
    put64(b + 104, (uint64_t)q->len);
    put64(b + 112, size);
    for (int l = 0; l < s->g.n_layers; l++)
        put32(b + IMG_HDR + 4 * (size_t)l, (uint32_t)s->layer_window[l]);
}

/* Layer l's table entry. */
static void put_entry(const kv_store *s, uint8_t *b, int l, enum kv_home home, int64_t lo,
                      const struct kvq_layer_state *k);

/* A state sequence's table (FORMAT): state_bytes in each entry's lo. */
static void put_state_table(const kv_store *s, uint8_t *b)
{
    for (int l = 0; l < s->g.n_layers; l++)
        put_entry(s, b, l, KV_HOME_PAGED, (int64_t)s->g.state_bytes, &(struct kvq_layer_state){0});
}

static void put_entry(const kv_store *s, uint8_t *b, int l, enum kv_home home, int64_t lo,
                      const struct kvq_layer_state *k)
{
    uint8_t *e = b + IMG_HDR + 4 * (size_t)s->g.n_layers + LT_ENTRY * (size_t)l;
    put64(e, (uint64_t)lo);
    put64(e + 8, (uint64_t)k->nq);
    put64(e + 16, (uint64_t)k->qoff);
    put32(e + 24, (uint32_t)home);
    put32(e + 28, f32_bits(k->scale_k));
    put32(e + 32, f32_bits(k->scale_v));
    put32(e + 36, 0);
}

enum tier_status kv_seq_save(kv_seq *q, void *buf, size_t size)
{
    kv_store *s = q->s;
    s->err[0] = '\0';
    if (q->pending)
        return kv_fail(s, TIER_EINVAL, "kv_seq_save during a step");
    enum tier_status st = kv_seq_load_finish(q);
    if (st != TIER_OK)
        return st;
    size_t need = kv_seq_image_size(q);
    if (!buf || size != need)
        return kv_fail(s, TIER_EINVAL, "kv_seq_save: a buffer of %zu bytes for an image of %zu", size, need);
    struct io io = {.s = s, .p = (uint8_t *)buf + head_size(s)};
    put_header(q, buf, size);
    if (q->state) {
        put_state_table(s, buf);
        return state_seq_save(q, io.p);
    }
    for (int l = 0; l < s->g.n_layers && st == TIER_OK; l++) {
        struct kvq_layer_state k;
        size_t qbb;
        struct plan pl = seq_plan(q, l, &k, &qbb);
        put_entry(s, buf, l, q->kvq ? KV_HOME_PAGED : q->layers[l].home, q->layers[l].lo, &k);
        st = layer_io(&io, q, l, &pl);
    }
    return st;
}

/* ---- loading --------------------------------------------------------------- */

#define BAD(...) kv_fail(s, TIER_EINVAL, "sequence image: " __VA_ARGS__)

/* *acc += n * unit, false on overflow. */
static bool add_rows(size_t *acc, uint64_t n, size_t unit)
{
    size_t m;
    return !__builtin_mul_overflow(n, unit, &m) && !__builtin_add_overflow(*acc, m, acc);
}

static enum tier_status parse_geometry(kv_store *s, const uint8_t *b, size_t size)
{
    if (size < IMG_HDR)
        return BAD("%zu bytes, shorter than the %d-byte header (field header)", size, IMG_HDR);
    if (memcmp(b, IMG_MAGIC, 8))
        return BAD("bad magic: not a kvtier sequence image (field magic)");
    if (get32(b + 8) != IMG_VERSION)
        return BAD("field version is %u, this build reads %d", get32(b + 8), IMG_VERSION);
    static const char *const names[] = {"n_layers", "n_kv_heads", "head_dim", "dtype", "block_tokens"};
    const uint32_t want[] = {(uint32_t)s->g.n_layers, (uint32_t)s->g.n_kv_heads, (uint32_t)s->g.head_dim,
                             (uint32_t)s->g.dtype, (uint32_t)s->bt};
    for (int i = 0; i < 5; i++)
        if (get32(b + 12 + 4 * i) != want[i])
            return BAD("field %s is %u, the store's is %u", names[i], get32(b + 12 + 4 * i), want[i]);
    size_t n = (size_t)s->g.n_layers;
    if (size < head_size(s))
        return BAD("%zu bytes, shorter than the header, %zu layer windows and the layer table (field header)", size,
                   n);
    for (size_t l = 0; l < n; l++)
        if (get32(b + IMG_HDR + 4 * l) != (uint32_t)s->layer_window[l])
            return BAD("field layer_window[%zu] is %u, the store's is %d", l, get32(b + IMG_HDR + 4 * l),
                       s->layer_window[l]);
    if (get64(b + 112) != size)
        return BAD("field size is %llu, the image has %zu bytes", (unsigned long long)get64(b + 112), size);
    return TIER_OK;
}

static enum tier_status parse_params(kv_store *s, const uint8_t *b, struct kv_seq_params *p, size_t *qbb,
                                     int64_t *T)
{
    uint32_t strategy = get32(b + 32), osl = get32(b + 36), flags = get32(b + 64), qb = get32(b + 68);
    if (strategy > KV_QUANTIZED)
        return BAD("field strategy is %u", strategy);
    if (osl > KV_OFFLOAD_SLIDING_NO)
        return BAD("field offload_sliding is %u", osl);
    if (flags & ~(uint32_t)PF_ALL)
        return BAD("field param_flags is %#x", flags);
    if (qb > KVQ_FP8)
        return BAD("field quant.backend is %u", qb);
    *p = (struct kv_seq_params){
        .strategy = (enum kv_strategy)strategy,
        .max_cache_len = (int64_t)get64(b + 40),
        .offload_sliding = (enum kv_offload_sliding)osl,
        .adaptive = flags & PF_ADAPTIVE,
        .no_fallback = flags & PF_NO_FALLBACK,
        .window_length = (int32_t)get32(b + 48),
        .no_prefix_cache = flags & PF_NO_PREFIX,
        .prefix_ns = get64(b + 56),
        .quant = {.backend = (enum kv_quant_backend)qb,
                  .nbits = (int32_t)get32(b + 72),
                  .axis_key = (int32_t)get32(b + 76),
                  .axis_value = (int32_t)get32(b + 80),
                  .q_group_size = (int32_t)get32(b + 84),
                  .residual_length = (int32_t)get32(b + 88)},
        .offload = flags & PF_OFFLOAD,
        .sink = flags & PF_SINK,
        .num_sink_tokens = (int32_t)get32(b + 52),
    };
    char why[KV_ERR_LEN];
    if (kv_store_check_params(s, p, why, sizeof(why)) != TIER_OK)
        return BAD("params: %s", why);
    if (p->strategy != KV_QUANTIZED)
        return TIER_OK;
    struct kvq_error e;
    struct be_kvq_format f;
    if (kvq_store_format(s, &p->quant, &f, &e) != TIER_OK)
        return BAD("params: %s", e.msg);
    *qbb = f.block_bytes;
    *T = f.block_tokens;
    return TIER_OK;
}

static enum tier_status parse_state(kv_store *s, const uint8_t *b, struct kv_seq_state *x)
{
    const struct kv_seq_params *p = &x->p;
    uint32_t cur = get32(b + 92), fb = get32(b + 96), flags = get32(b + 100);
    if (cur > KV_QUANTIZED)
        return BAD("field state.strategy is %u", cur);
    bool moved = (p->strategy == KV_DYNAMIC && cur == KV_OFFLOADED) ||
                 (p->strategy == KV_STATIC && cur == KV_OFFLOADED_STATIC);
    if (cur != p->strategy && (!moved || p->sink))
        return BAD("field state.strategy is %s for a requested %s", kv_strategy_name(cur),
                   kv_strategy_name(p->strategy));
    if (fb > KV_FALLBACK_OOM)
        return BAD("field fallback is %u", fb);
    if (flags & ~(uint32_t)SF_ALL)
        return BAD("field state_flags is %#x", flags);
    x->strategy = (enum kv_strategy)cur;
    x->fallback = (enum kv_fallback)fb;
    x->record_past = flags & SF_RECORD_PAST;
    x->kvq_host = flags & SF_KVQ_HOST;
    if (x->kvq_host && (p->strategy != KV_QUANTIZED || p->sink))
        return BAD("field state_flags: quantized blocks in the host tier for a %s%s sequence",
                   p->sink ? "sink " : "", kv_strategy_name(p->strategy));
    if (p->offload && !x->kvq_host)
        return BAD("field state_flags: an offloaded quantized sequence on the device");
    bool fixed_sliding = false, full = false;
    for (int l = 0; l < s->g.n_layers; l++) {
        int w, keep;
        kv_layer_shape(s, p, l, &w, &keep);
        fixed_sliding = fixed_sliding || (w && (cur == KV_STATIC || cur == KV_OFFLOADED_STATIC));
        full = full || !w;
    }
    if (x->record_past && (p->sink || p->strategy == KV_QUANTIZED || fixed_sliding))
        return BAD("field state_flags: past recording on a sequence that cannot record");
    x->len = (int64_t)get64(b + 104);
    if (x->len < 0 || x->len > KV_SEQ_MAX_LEN)
        return BAD("field len is %lld, out of [0, %lld]", (long long)x->len, (long long)KV_SEQ_MAX_LEN);
    if ((cur == KV_STATIC || cur == KV_OFFLOADED_STATIC) && full && x->len > p->max_cache_len)
        return BAD("field len is %lld, over max_cache_len %lld", (long long)x->len, (long long)p->max_cache_len);
    return TIER_OK;
}

/* Layer l's lo against the rule that set it. */
static enum tier_status check_lo(kv_store *s, const struct kv_seq_state *x, int l, int64_t lo)
{
    const struct kv_seq_params *p = &x->p;
    int w, keep;
    kv_layer_shape(s, p, l, &w, &keep);
    int64_t floor = x->len > keep ? x->len - keep : 0, want = 0;
    if (p->sink)
        want = x->len > p->window_length ? x->len - (p->window_length - p->num_sink_tokens) : 0;
    else if (w)
        want = floor;
    bool ok = x->record_past && w && !p->sink ? lo >= 0 && lo <= floor : lo == want;
    return ok ? TIER_OK : BAD("layer %d: field lo is %lld (%lld tokens seen, window %d)", l, (long long)lo,
                              (long long)x->len, w);
}

/* The layer table: each layer's state, checked, its plan, and where its
 * blocks end in the image against the image's size. */
static enum tier_status parse_table(kv_store *s, const uint8_t *b, size_t size, struct kv_seq_state *x,
                                    enum kv_home *home, int64_t *lo, struct kvq_layer_state *kq, size_t qbb,
                                    int64_t T, struct plan *plan, size_t *end)
{
    size_t off = head_size(s);
    bool quant = x->p.strategy == KV_QUANTIZED;
    for (int l = 0; l < s->g.n_layers; l++) {
        const uint8_t *h = b + IMG_HDR + 4 * (size_t)s->g.n_layers + LT_ENTRY * (size_t)l;
        lo[l] = (int64_t)get64(h);
        int64_t nq = (int64_t)get64(h + 8), qoff = (int64_t)get64(h + 16);
        uint32_t hm = get32(h + 24), sk = get32(h + 28), sv = get32(h + 32);
        if (lo[l] < 0 || lo[l] > x->len)
            return BAD("layer %d: field lo is %lld, out of [0, len %lld]", l, (long long)lo[l], (long long)x->len);
        if (check_lo(s, x, l, lo[l]) != TIER_OK)
            return TIER_EINVAL;
        if (get32(h + 36))
            return BAD("layer %d: field reserved is %u", l, get32(h + 36));
        if (quant) {
            struct kvq_layer_state *k = &kq[l];
            *k = (struct kvq_layer_state){.nq = nq, .qoff = qoff, .scale_k = f32_from_bits(sk), .scale_v = f32_from_bits(sv)};
            if (hm != KV_HOME_PAGED)
                return BAD("layer %d: field home is %u for a quantized sequence", l, hm);
            /* nq == 0 < len: the parts of a first update, not quantized yet */
            if (k->nq < 0 || k->nq > x->len)
                return BAD("layer %d: field nq is %lld (len %lld)", l, (long long)k->nq, (long long)x->len);
            if (k->qoff != min64(lo[l] / T, k->nq / T)) /* kvq_layer_drop after every commit */
                return BAD("layer %d: field qoff is %lld (lo %lld, nq %lld, %lld-token blocks)", l,
                           (long long)k->qoff, (long long)lo[l], (long long)k->nq, (long long)T);
        } else {
            bool paged = x->strategy == KV_DYNAMIC;
            if (paged ? hm != KV_HOME_PAGED : hm != KV_HOME_DEV && hm != KV_HOME_HOST)
                return BAD("layer %d: field home is %u for a %s sequence", l, hm, kv_strategy_name(x->strategy));
            if (nq || qoff || sk || sv)
                return BAD("layer %d: fields nq, qoff, scale_k and scale_v of a dense layer are not 0", l);
            home[l] = (enum kv_home)hm;
        }
        plan[l] = plan_of(s, &x->p, x->len, lo[l], quant ? &kq[l] : NULL, T);
        size_t bytes = 0;
        if (!add_rows(&bytes, (uint64_t)(plan[l].sink + plan[l].nb), s->block_bytes) ||
            !add_rows(&bytes, (uint64_t)plan[l].nqb, qbb))
            return BAD("layer %d: its blocks' size overflows", l);
        if (bytes > size - off)
            return BAD("layer %d: its blocks need %zu bytes, %zu are left (field size)", l, bytes, size - off);
        off += bytes;
        end[l] = off;
    }
    if (off != size)
        return BAD("%zu bytes after the last layer's blocks (field size)", size - off);
    return TIER_OK;
}

/* A state image's table and body size (FORMAT). */
static enum tier_status parse_state_body(kv_store *s, const uint8_t *b, size_t size, struct kv_seq_state *x)
{
    if (x->record_past)
        return BAD("field state_flags: past recording on a state-space model's sequence");
    for (int l = 0; l < s->g.n_layers; l++) {
        const uint8_t *e = b + IMG_HDR + 4 * (size_t)s->g.n_layers + LT_ENTRY * (size_t)l;
        if (get64(e) != s->g.state_bytes)
            return BAD("layer %d: field state_bytes is %llu, the store's is %zu", l, (unsigned long long)get64(e),
                       s->g.state_bytes);
        for (int i = 8; i < LT_ENTRY; i += 4)
            if (get32(e + i))
                return BAD("layer %d: a state layer's entry has %u at +%d, not 0", l, get32(e + i), i);
    }
    return state_image_check(s, size - head_size(s), &x->n_ckpt);
}

/* ---- a load, layer by layer ------------------------------------------------- */

struct kv_seq_loader {
    struct kv_image_src src;
    be_event *ev;            /* after the copies queued so far; NULL: blocks go up with be_copy */
    bool in_flight;          /* copies were queued since the host last waited for ev */
    int parts;               /* the layers, and a state's checkpoints after them */
    int next;                /* the first part not filled yet */
    enum tier_status failed; /* TIER_OK, or why no layer is filled any more */
    char why[KV_ERR_LEN];
    struct plan *plan;       /* [n_layers] */
    size_t *end;             /* [parts] where part l's bytes end in the image */
    int n_ckpt;              /* a state's checkpoints */
    int64_t len;             /* the sequence's length at the load: its checkpoints' bound */
};

/* The host waits for every upload the loader queued: before the image or
 * the blocks they touch may go. */
static void loader_drain(struct kv_seq_loader *ld)
{
    if (ld->in_flight)
        be_event_sync(ld->ev);
    ld->in_flight = false;
}

void kv_seq_loader_free(struct kv_seq_loader *ld)
{
    if (!ld)
        return;
    loader_drain(ld);
    be_event_free(ld->ev);
    free(ld->plan);
    free(ld->end);
    free(ld);
}

enum tier_status kv_seq_fill(kv_seq *q, int layer)
{
    struct kv_seq_loader *ld = q->load;
    if (!ld)
        return TIER_OK;
    kv_store *s = q->s;
    if (ld->failed != TIER_OK)
        return kv_fail(s, ld->failed, "%s", ld->why);
    if (layer >= ld->parts)
        layer = ld->parts - 1;
    for (; ld->next <= layer; ld->next++) {
        int l = ld->next;
        const uint8_t *img = ld->src.wait(ld->src.arg, ld->end[l]);
        enum tier_status st;
        if (!img) {
            st = kv_fail(s, TIER_EIO, "sequence image: %s %d's bytes never arrived (the image's read failed)",
                         l < s->g.n_layers ? "layer" : "part", l);
        } else if (s->g.state_bytes) {
            st = l < s->g.n_layers ? state_fill_layer(q, l, img + head_size(s))
                                   : state_fill_ckpts(q, img + head_size(s), ld->n_ckpt, ld->len);
        } else {
            struct io io = {.s = s, .p = (uint8_t *)(uintptr_t)img + (l ? ld->end[l - 1] : head_size(s)), .load = true,
                            .async = ld->ev != NULL};
            st = layer_io(&io, q, l, &ld->plan[l]);
            /* the layer's compute waits for its blocks on the device, not the host */
            enum be_status bs = BE_OK;
            ld->in_flight |= io.queued;
            if (io.queued && ((bs = be_event_record(s->be, ld->ev)) != BE_OK || (bs = be_event_wait(s->be, ld->ev)))) {
                be_sync(s->be); /* no fence: wait for everything instead */
                ld->in_flight = false;
                st = kv_fail(s, TIER_EIO, "sequence image: fencing layer %d's upload: %s", l, be_strerror(bs));
            }
        }
        if (st != TIER_OK) {
            loader_drain(ld);
            ld->failed = st;
            snprintf(ld->why, sizeof(ld->why), "%s", s->err);
            return st;
        }
    }
    if (ld->next == ld->parts) {
        kv_seq_loader_free(ld);
        q->load = NULL;
    }
    return TIER_OK;
}

enum tier_status kv_seq_load_finish(kv_seq *q)
{
    return kv_seq_fill(q, INT32_MAX);
}

bool kv_seq_loading(const kv_seq *q)
{
    return q->load && q->load->failed == TIER_OK;
}

enum tier_status kv_seq_load_status(const kv_seq *q)
{
    return q->load ? q->load->failed : TIER_OK;
}

enum tier_status kv_seq_load_begin(kv_store *s, const void *head, size_t size, const struct kv_image_src *src,
                                   kv_seq **out)
{
    *out = NULL;
    s->err[0] = '\0';
    if (!head || !src || !src->wait)
        return BAD("no image");
    const uint8_t *b = head;
    size_t n = (size_t)s->g.n_layers;
    enum kv_home *home = calloc(n, sizeof(*home));
    int64_t *lo = calloc(n, sizeof(*lo));
    struct kvq_layer_state *kq = calloc(n, sizeof(*kq));
    struct kv_seq_loader *ld = calloc(1, sizeof(*ld));
    if (ld) {
        if (be_event_create(s->be, &ld->ev) != BE_OK) /* uploads with be_copy then */
            ld->ev = NULL;
        ld->parts = (int)n + (s->g.state_bytes > 0);
        ld->plan = calloc(n, sizeof(*ld->plan));
        ld->end = calloc((size_t)ld->parts, sizeof(*ld->end));
    }
    enum tier_status st = TIER_OK;
    if (!home || !lo || !kq || !ld || !ld->plan || !ld->end)
        st = kv_fail(s, TIER_ENOMEM_HOST, "host memory: loading a sequence image");
    struct kv_seq_state x = {.home = home, .lo = lo, .kvq = kq};
    size_t qbb = 0;
    int64_t T = 1;
    if (st == TIER_OK && (st = parse_geometry(s, b, size)) == TIER_OK &&
        (st = parse_params(s, b, &x.p, &qbb, &T)) == TIER_OK && (st = parse_state(s, b, &x)) == TIER_OK)
        st = s->g.state_bytes ? parse_state_body(s, b, size, &x)
                              : parse_table(s, b, size, &x, home, lo, kq, qbb, T, ld->plan, ld->end);
    /* a state's layers one after the other, then its checkpoints */
    for (size_t l = 0; st == TIER_OK && s->g.state_bytes && l < n; l++)
        ld->end[l] = head_size(s) + (l + 1) * s->g.state_bytes;
    if (st == TIER_OK && s->g.state_bytes) {
        ld->end[n] = size;
        ld->n_ckpt = x.n_ckpt;
        ld->len = x.len;
    }
    kv_seq *q = NULL;
    if (st == TIER_OK)
        st = kv_seq_restore(s, &x, false, &q);
    /* as kv_seq_offload after a device OOM; a sink sequence stays on the device */
    if (st == TIER_ENOMEM_DEV && !x.p.no_fallback && !x.p.sink) {
        s->err[0] = '\0';
        st = kv_seq_restore(s, &x, true, &q);
    }
    if (st == TIER_OK) {
        ld->src = *src;
        q->load = ld;
        ld = NULL;
    }
    if (st == TIER_OK)
        *out = q;
    kv_seq_loader_free(ld);
    free(kq);
    free(lo);
    free(home);
    return st;
}

/* The source of an image that is all there. */
static const void *whole(void *arg, size_t n)
{
    (void)n;
    return arg;
}

enum tier_status kv_seq_load(kv_store *s, const void *buf, size_t size, kv_seq **out)
{
    kv_seq *q;
    *out = NULL;
    enum tier_status st = kv_seq_load_begin(s, buf, size, &(struct kv_image_src){whole, (void *)(uintptr_t)buf}, &q);
    if (st == TIER_OK && (st = kv_seq_load_finish(q)) != TIER_OK) {
        kv_seq_free(q);
        return st;
    }
    *out = q;
    return st;
}

/* ---- a state from its values (the state import) --------------------------- */

enum tier_status kv_seq_load_state(kv_store *s, const struct kv_seq_params *p, int64_t len, const void *state,
                                   const int64_t *ckpt_pos, int n_ckpt, kv_seq **out)
{
    *out = NULL;
    s->err[0] = '\0';
    if (!s->g.state_bytes)
        return kv_fail(s, TIER_EINVAL, "state import: this store holds KV, not states");
    if (len < 0 || len > KV_SEQ_MAX_LEN)
        return kv_fail(s, TIER_EINVAL, "state import: a length of %lld tokens is not in [0, %lld]", (long long)len,
                       (long long)KV_SEQ_MAX_LEN);
    size_t one = (size_t)s->g.n_layers * s->g.state_bytes, n;
    if (n_ckpt < 0 || __builtin_mul_overflow((size_t)n_ckpt, 8 + one, &n) ||
        __builtin_add_overflow(n, head_size(s) + one, &n))
        return kv_fail(s, TIER_EINVAL, "state import: %d checkpoints", n_ckpt);
    uint8_t *img = malloc(n);
    if (!img)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: a %zu-byte sequence image", n);
    /* the image kv_seq_save writes for such a sequence: no fallback; the
     * checkpoints' positions are checked as it loads */
    struct kv_seq hdr = {.s = s, .p = *p, .strategy = p->strategy, .len = len};
    put_header(&hdr, img, n);
    put_state_table(s, img);
    uint8_t *o = img + head_size(s);
    memcpy(o, state, one);
    for (int i = 0; i < n_ckpt; i++) {
        o += i ? 8 + one : one;
        put64(o, (uint64_t)ckpt_pos[i]);
        memcpy(o + 8, (const uint8_t *)state + (1 + (size_t)i) * one, one);
    }
    enum tier_status st = kv_seq_load(s, img, n, out);
    free(img);
    return st;
}

/* ---- a quantized sequence from its stored form (the raw import) ------------- */

static bool same_half(const struct be_kvq_half *a, const struct be_kvq_half *b)
{
    return a->gt == b->gt && a->gd == b->gd && a->codes == b->codes && a->params == b->params;
}

static bool same_format(const struct be_kvq_format *a, const struct be_kvq_format *b)
{
    return a->kind == b->kind && a->nbits == b->nbits && a->block_tokens == b->block_tokens &&
           a->n_kv_heads == b->n_kv_heads && a->head_dim == b->head_dim && same_half(&a->k, &b->k) &&
           same_half(&a->v, &b->v) && a->block_bytes == b->block_bytes;
}

/* Layer l's blocks as kv_seq_save writes them, from in (checked sizes):
 * the quantized blocks, then the residual [nq, len) of in's [H, residual,
 * D] halves in dense blocks (K then V, [H][T][D] each), other rows zero.
 * Its table entry too. */
static uint8_t *put_quant_layer(const kv_store *s, uint8_t *img, uint8_t *o, int l, int64_t lo,
                                const struct kv_quant_layer_in *in, size_t qbb)
{
    const struct kv_quant_layer *d = &in->d;
    put_entry(s, img, l, KV_HOME_PAGED, lo,
              &(struct kvq_layer_state){.nq = d->nq, .qoff = d->first_block, .scale_k = d->scale_k,
                                        .scale_v = d->scale_v});
    memcpy(o, in->blocks, (size_t)d->n_blocks * qbb);
    o += (size_t)d->n_blocks * qbb;
    size_t hrow = (size_t)s->g.head_dim * be_dtype_size(s->g.dtype);
    int64_t bt = s->bt, len = d->nq + d->residual;
    for (int64_t b = d->nq / bt; d->residual && b <= (len - 1) / bt; b++) {
        memset(o, 0, s->block_bytes);
        for (int64_t pos = b * bt > d->nq ? b * bt : d->nq; pos < len && pos < (b + 1) * bt; pos++)
            for (int half = 0; half < 2; half++)
                for (int h = 0; h < s->g.n_kv_heads; h++) {
                    const char *src = half ? in->v : in->k;
                    memcpy(o + (((size_t)half * (size_t)s->g.n_kv_heads + (size_t)h) * (size_t)bt +
                                (size_t)(pos - b * bt)) * hrow,
                           src + ((size_t)h * (size_t)d->residual + (size_t)(pos - d->nq)) * hrow, hrow);
                }
        o += s->block_bytes;
    }
    return o;
}

enum tier_status kv_seq_load_quant(kv_store *s, const struct kv_seq_params *p, int64_t len,
                                   const struct kv_quant_layer_in *in, kv_seq **out)
{
    *out = NULL;
    s->err[0] = '\0';
    if (!p || p->strategy != KV_QUANTIZED || p->sink || p->offload || !in)
        return kv_fail(s, TIER_EINVAL, "raw import: field params: needs a quantized cache without sinks or offload");
    if (len <= 0 || len > KV_SEQ_MAX_LEN)
        return kv_fail(s, TIER_EINVAL, "raw import: field len is %lld, out of [1, %lld]", (long long)len,
                       (long long)KV_SEQ_MAX_LEN);
    struct kvq_error e;
    struct be_kvq_format f;
    enum tier_status st = kv_store_check_params(s, p, s->err, sizeof(s->err));
    if (st != TIER_OK)
        return st;
    if (kvq_store_format(s, &p->quant, &f, &e) != TIER_OK)
        return kv_fail(s, TIER_EINVAL, "raw import: field params: %s", e.msg);
    size_t size = head_size(s);
    int64_t *lo = malloc((size_t)s->g.n_layers * sizeof(*lo));
    if (!lo)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: a raw import");
    for (int l = 0; l < s->g.n_layers; l++) {
        const struct kv_quant_layer *d = &in[l].d;
        int w, keep;
        kv_layer_shape(s, p, l, &w, &keep);
        /* the image's lo is the layer's window start (kvstore.c invariant 1),
         * which the export shows only clamped to the quantized part */
        lo[l] = w && len > keep ? len - keep : 0;
        /* what the section's size follows from, checked here so that a bad
         * one is named rather than misplacing every later section */
        const char *bad = NULL;
        if (!d->fmt || !same_format(d->fmt, &f))
            bad = "fmt";
        else if (d->nq < 0 || d->nq > len)
            bad = "nq";
        else if (d->residual != len - d->nq || (d->residual && (!in[l].k || !in[l].v)))
            bad = "residual";
        else if (d->first_block < 0 || d->first_block > d->nq)
            bad = "first_block";
        else if (d->n_blocks != quant_blocks(d->nq, d->first_block, f.block_tokens) ||
                 (d->n_blocks && !in[l].blocks))
            bad = "n_blocks";
        /* a length near KV_SEQ_MAX_LEN overflows the image size */
        else if (!add_rows(&size, (uint64_t)d->n_blocks, f.block_bytes) ||
                 !add_rows(&size, (uint64_t)(d->residual ? (len - 1) / s->bt - d->nq / s->bt + 1 : 0),
                           s->block_bytes))
            bad = "size";
        if (bad) {
            free(lo);
            return kv_fail(s, TIER_EINVAL,
                           "raw import: layer %d: field %s is out of line (nq %lld, first block %lld, %d blocks, "
                           "%lld residual rows for %lld tokens of %lld-token blocks)",
                           l, bad, (long long)d->nq, (long long)d->first_block, d->n_blocks, (long long)d->residual,
                           (long long)len, (long long)f.block_tokens);
        }
    }
    uint8_t *img = malloc(size);
    if (!img) {
        free(lo);
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: a %zu-byte sequence image", size);
    }
    /* a state as kv_seq_save writes it: no fallback, no past recording */
    struct kv_seq hdr = {.s = s, .p = *p, .strategy = KV_QUANTIZED, .len = len};
    put_header(&hdr, img, size);
    uint8_t *o = img + head_size(s);
    for (int l = 0; l < s->g.n_layers; l++)
        o = put_quant_layer(s, img, o, l, lo[l], &in[l], f.block_bytes);
    free(lo);
    kv_seq *q = NULL;
    st = kv_seq_load(s, img, size, &q);
    free(img);
    /* kv_seq_layer_quant cannot describe a sequence in the host tier */
    if (st == TIER_OK && kvq_seq_on_host(q))
        st = kv_fail(s, TIER_ENOMEM_DEV, "device memory: the imported quantized KV does not fit the device budget");
    for (int l = 0; l < s->g.n_layers && st == TIER_OK; l++) {
        struct kv_quant_layer got;
        const struct kv_quant_layer *d = &in[l].d;
        st = kv_seq_layer_quant(q, l, &got);
        if (st == TIER_OK && (got.lo != d->lo || got.nq != d->nq || got.first_block != d->first_block ||
                              got.n_blocks != d->n_blocks || got.residual != d->residual))
            st = kv_fail(s, TIER_EINVAL,
                         "raw import: layer %d: field lo: %lld, nq %lld, first block %lld is not what %lld tokens "
                         "of this cache store (%lld, %lld, %lld)",
                         l, (long long)d->lo, (long long)d->nq, (long long)d->first_block, (long long)len,
                         (long long)got.lo, (long long)got.nq, (long long)got.first_block);
    }
    if (st != TIER_OK) {
        kv_seq_free(q);
        return st;
    }
    *out = q;
    return TIER_OK;
}
