/* image.c - a sequence as bytes and back (kvstore.h "images"), for the disk
 * tier.
 *
 * FORMAT (version 1).  Every integer little-endian; i = signed, u =
 * unsigned; floats as their IEEE-754 bits.  No field is a pointer or a
 * capacity: an image is a function of the sequence's state alone.
 *
 *   off  size  field
 *     0     8  magic "KVTSEQ\r\n"
 *     8   u32  version (1)
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
 *   then one section per layer:
 *     dense strategies:  u32 home (0 paged, 1 device, 2 host), i64 lo,
 *                        rows of the stored positions
 *     quantized:         i64 lo, i64 nq, i64 qoff, u32 scale_k, u32 scale_v,
 *                        rows of the sinks [0, min(S, len)),
 *                        the quantized blocks qoff .. (nq-1)/T whole,
 *                        rows of the full-precision residual [nq, len)
 *   A row is one position: its K for heads 0..n_kv_heads-1 (head_dim
 *   elements of dtype each), then its V the same way.  The stored
 *   positions of a dense layer are [lo, len), and the sinks [0, S) before
 *   them once a sink sequence evicted (lo > 0), ascending.  T is the
 *   quantized block's tokens (kvq_block_tokens).
 *
 * NOTES
 * - Only stored positions travel, so a block's unused rows come back as
 *   zeros.  Quantized blocks go whole (codes and scales of their format,
 *   unused rows included as they were): their layout is the backend's.
 * - Device bytes move only through be_copy, through one staging block.
 * - The load checks every field before it allocates: the geometry, the
 *   params (kv_check_params, and the quantized format), the state against
 *   the params, each layer's lo against the rule that produced it
 *   (kvstore.c invariants 1 and 8), each section's size against the bytes
 *   left; an image is accepted only if it is exactly what kv_seq_save writes
 *   for some state, so save(load(img)) == img unless the load fell back to
 *   the host tier.
 * - A loaded sequence holds private blocks and does not take part in the
 *   prefix cache (the image has no token ids to publish by).
 */
#include "tiers/kvstore_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tiers/quant.h"
#include "util/le.h"

#define IMG_MAGIC "KVTSEQ\r\n"
#define IMG_VERSION 1
#define IMG_HDR 120
#define SEC_DENSE 12 /* home, lo */
#define SEC_QUANT 32 /* lo, nq, qoff, scales */

enum { PF_ADAPTIVE = 1, PF_NO_FALLBACK = 2, PF_NO_PREFIX = 4, PF_OFFLOAD = 8, PF_SINK = 16, PF_ALL = 31 };
enum { SF_RECORD_PAST = 1, SF_KVQ_HOST = 2, SF_ALL = 3 };

static uint32_t float_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static float bits_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* Bytes of one row: K and V of every head at one position. */
static size_t row_bytes(const kv_store *s)
{
    return 2 * (size_t)s->g.n_kv_heads * (size_t)s->g.head_dim * be_dtype_size(s->g.dtype);
}

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
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

/* ---- moving the stored positions ------------------------------------------- */

struct io {
    kv_store *s;
    uint8_t *p;   /* the image, at the next row */
    bool load;    /* image -> sequence; else sequence -> image */
    char *stage;  /* one block of host memory */
};

static enum tier_status stage_copy(struct io *io, void *blk, bool host, bool to_stage, size_t bytes)
{
    void *dst = to_stage ? io->stage : blk;
    const void *src = to_stage ? blk : io->stage;
    if (host) {
        memcpy(dst, src, bytes);
        return TIER_OK;
    }
    enum be_status st = be_copy(io->s->be, dst, src, bytes, to_stage ? BE_D2H : BE_H2D);
    return st == BE_OK ? TIER_OK
                       : kv_fail(io->s, TIER_EIO, "sequence image: copying a KV block %s the device: %s",
                                 to_stage ? "from" : "to", be_strerror(st));
}

/* The rows of the positions in r[0..1) and r[2..3) that fall into the
 * dense block blk, which holds [pos0, pos0 + bt) (be_kv_view's layout). */
static enum tier_status rows_io(struct io *io, void *blk, bool host, int64_t pos0, const int64_t r[4])
{
    kv_store *s = io->s;
    int64_t bt = s->bt, a[2], b[2];
    bool any = false;
    for (int k = 0; k < 2; k++) {
        a[k] = r[2 * k] > pos0 ? r[2 * k] : pos0;
        b[k] = min64(r[2 * k + 1], pos0 + bt);
        any = any || a[k] < b[k];
    }
    if (!any)
        return TIER_OK;
    enum tier_status st = TIER_OK;
    if (io->load)
        memset(io->stage, 0, s->block_bytes);
    else
        st = stage_copy(io, blk, host, true, s->block_bytes);
    size_t hrow = (size_t)s->g.head_dim * be_dtype_size(s->g.dtype);
    for (int k = 0; k < 2 && st == TIER_OK; k++) {
        for (int64_t pos = a[k]; pos < b[k]; pos++) {
            for (int half = 0; half < 2; half++) {
                for (int h = 0; h < s->g.n_kv_heads; h++) {
                    char *x = io->stage + (size_t)half * (s->block_bytes / 2) +
                              ((size_t)h * (size_t)bt + (size_t)(pos - pos0)) * hrow;
                    memcpy(io->load ? (void *)x : (void *)io->p, io->load ? (void *)io->p : (void *)x, hrow);
                    io->p += hrow;
                }
            }
        }
    }
    if (st == TIER_OK && io->load)
        st = stage_copy(io, blk, host, false, s->block_bytes);
    return st;
}

/* A quantized block, whole. */
static enum tier_status raw_io(struct io *io, void *blk, bool host, size_t bytes)
{
    enum be_status st = BE_OK;
    if (host)
        memcpy(io->load ? blk : (void *)io->p, io->load ? (void *)io->p : blk, bytes);
    else
        st = io->load ? be_copy(io->s->be, blk, io->p, bytes, BE_H2D) : be_copy(io->s->be, io->p, blk, bytes, BE_D2H);
    io->p += bytes;
    return st == BE_OK ? TIER_OK
                       : kv_fail(io->s, TIER_EIO, "sequence image: copying a quantized KV block: %s", be_strerror(st));
}

/* Layer l's stored positions, between q's storage and the image (the
 * section's header excluded). */
static enum tier_status layer_io(struct io *io, kv_seq *q, int l)
{
    const struct kv_layer *L = &q->layers[l];
    enum tier_status st = TIER_OK;
    if (q->kvq) {
        struct be_kvq_view v;
        kvq_layer_view(kvq_seq_layer(q, l), &v);
        bool host = kvq_seq_on_host(q);
        const int64_t sinks[4] = {0, quant_sink_rows(&q->p, q->len), 0, 0};
        if (sinks[1]) /* a device pool block (kvstore.c invariant 8) */
            st = rows_io(io, L->sink_blk->data, false, 0, sinks);
        for (int i = 0; i < v.n_blocks && st == TIER_OK; i++)
            st = raw_io(io, v.blocks[i], host, v.fmt->block_bytes);
        const int64_t rest[4] = {v.rest.lo, v.rest.hi, 0, 0};
        for (int i = 0; i < v.rest.n_blocks && st == TIER_OK; i++)
            st = rows_io(io, v.rest.blocks[i], host, v.rest.base + (int64_t)i * io->s->bt, rest);
        return st;
    }
    bool host = L->home == KV_HOME_HOST;
    const int64_t r[4] = {0, dense_sink_rows(&q->p, L->lo), L->lo, q->len};
    if (L->sink_blk) /* sinks apart: the table starts at a later block */
        st = rows_io(io, L->sink_blk->data, false, 0, r);
    for (int i = 0; i < L->n_blocks && st == TIER_OK; i++)
        st = rows_io(io, L->blocks[i], host, L->base + (int64_t)i * io->s->bt, r);
    return st;
}

/* ---- saving ---------------------------------------------------------------- */

static size_t section_bytes(const kv_seq *q, int l)
{
    const kv_store *s = q->s;
    const struct kv_layer *L = &q->layers[l];
    if (!q->kvq)
        return SEC_DENSE + (size_t)(dense_sink_rows(&q->p, L->lo) + q->len - L->lo) * row_bytes(s);
    struct be_kvq_view v;
    kvq_layer_view(kvq_seq_layer(q, l), &v);
    return SEC_QUANT + (size_t)(quant_sink_rows(&q->p, q->len) + v.rest.hi - v.rest.lo) * row_bytes(s) +
           (size_t)v.n_blocks * v.fmt->block_bytes;
}

size_t kv_seq_image_size(const kv_seq *q)
{
    size_t n = IMG_HDR + 4 * (size_t)q->s->g.n_layers;
    for (int l = 0; l < q->s->g.n_layers; l++)
        n += section_bytes(q, l);
    return n;
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

enum tier_status kv_seq_save(kv_seq *q, void *buf, size_t size)
{
    kv_store *s = q->s;
    s->err[0] = '\0';
    if (q->pending)
        return kv_fail(s, TIER_EINVAL, "kv_seq_save during a step");
    size_t need = kv_seq_image_size(q);
    if (!buf || size != need)
        return kv_fail(s, TIER_EINVAL, "kv_seq_save: a buffer of %zu bytes for an image of %zu", size, need);
    struct io io = {.s = s, .p = buf, .stage = malloc(s->block_bytes)};
    if (!io.stage)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: a %zu-byte staging block", s->block_bytes);
    put_header(q, io.p, size);
    io.p += IMG_HDR + 4 * (size_t)s->g.n_layers;
    enum tier_status st = TIER_OK;
    for (int l = 0; l < s->g.n_layers && st == TIER_OK; l++) {
        const struct kv_layer *L = &q->layers[l];
        if (q->kvq) {
            struct be_kvq_view v;
            kvq_layer_view(kvq_seq_layer(q, l), &v);
            put64(io.p, (uint64_t)L->lo);
            put64(io.p + 8, (uint64_t)v.hi);
            put64(io.p + 16, (uint64_t)(v.base / v.fmt->block_tokens));
            put32(io.p + 24, float_bits(v.scale_k));
            put32(io.p + 28, float_bits(v.scale_v));
            io.p += SEC_QUANT;
        } else {
            put32(io.p, (uint32_t)L->home);
            put64(io.p + 4, (uint64_t)L->lo);
            io.p += SEC_DENSE;
        }
        st = layer_io(&io, q, l);
    }
    free(io.stage);
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
    if (size < IMG_HDR + 4 * n)
        return BAD("%zu bytes, shorter than the header and %zu layer windows (field layer_window)", size, n);
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
    if (kv_check_params(s, p) != TIER_OK) {
        char why[KV_ERR_LEN];
        snprintf(why, sizeof(why), "%s", s->err);
        return BAD("params: %s", why);
    }
    if (p->strategy != KV_QUANTIZED)
        return TIER_OK;
    struct kvq_error e;
    struct be_kvq_format f;
    if (s->g.dtype != BE_F32)
        return BAD("field strategy: a quantized image on a %s store", be_dtype_name(s->g.dtype));
    if (kv_quant_validate(&p->quant, &e) != TIER_OK ||
        kvq_format_init(&f, &p->quant, s->g.n_kv_heads, s->g.head_dim, kvq_block_tokens(&p->quant, s->bt), &e) !=
            TIER_OK)
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

/* Every layer section: its fields, and its size against the bytes left. */
static enum tier_status parse_sections(kv_store *s, const uint8_t *b, size_t size, struct kv_seq_state *x,
                                       enum kv_home *home, int64_t *lo, struct kvq_layer_state *kq, size_t qbb,
                                       int64_t T)
{
    size_t off = IMG_HDR + 4 * (size_t)s->g.n_layers, rb = row_bytes(s);
    bool quant = x->p.strategy == KV_QUANTIZED;
    for (int l = 0; l < s->g.n_layers; l++) {
        size_t hdr = quant ? SEC_QUANT : SEC_DENSE, bytes = hdr;
        if (size - off < hdr)
            return BAD("layer %d: truncated section header (%zu bytes left)", l, size - off);
        const uint8_t *h = b + off;
        lo[l] = (int64_t)get64(h + (quant ? 0 : 4));
        if (lo[l] < 0 || lo[l] > x->len || check_lo(s, x, l, lo[l]) != TIER_OK)
            return lo[l] < 0 || lo[l] > x->len ? BAD("layer %d: field lo is %lld, out of [0, len %lld]", l,
                                                     (long long)lo[l], (long long)x->len)
                                               : TIER_EINVAL;
        if (quant) {
            struct kvq_layer_state *k = &kq[l];
            k->nq = (int64_t)get64(h + 8);
            k->qoff = (int64_t)get64(h + 16);
            k->scale_k = bits_float(get32(h + 24));
            k->scale_v = bits_float(get32(h + 28));
            if (k->nq < 0 || k->nq > x->len || (k->nq == 0) != (x->len == 0))
                return BAD("layer %d: field nq is %lld (len %lld)", l, (long long)k->nq, (long long)x->len);
            if (k->qoff != min64(lo[l] / T, k->nq / T)) /* kvq_layer_drop after every commit */
                return BAD("layer %d: field qoff is %lld (lo %lld, nq %lld, %lld-token blocks)", l,
                           (long long)k->qoff, (long long)lo[l], (long long)k->nq, (long long)T);
            if (!add_rows(&bytes, (uint64_t)(quant_sink_rows(&x->p, x->len) + x->len - k->nq), rb) ||
                !add_rows(&bytes, (uint64_t)quant_blocks(k->nq, k->qoff, T), qbb))
                return BAD("layer %d: section size overflows", l);
        } else {
            uint32_t hm = get32(h);
            bool paged = x->strategy == KV_DYNAMIC;
            if (paged ? hm != KV_HOME_PAGED : hm != KV_HOME_DEV && hm != KV_HOME_HOST)
                return BAD("layer %d: field home is %u for a %s sequence", l, hm, kv_strategy_name(x->strategy));
            home[l] = (enum kv_home)hm;
            if (!add_rows(&bytes, (uint64_t)(dense_sink_rows(&x->p, lo[l]) + x->len - lo[l]), rb))
                return BAD("layer %d: section size overflows", l);
        }
        if (bytes > size - off)
            return BAD("layer %d: the section needs %zu bytes, %zu are left (field size)", l, bytes, size - off);
        off += bytes;
    }
    if (off != size)
        return BAD("%zu bytes after the last layer's section (field size)", size - off);
    return TIER_OK;
}

enum tier_status kv_seq_load(kv_store *s, const void *buf, size_t size, kv_seq **out)
{
    *out = NULL;
    s->err[0] = '\0';
    if (!buf)
        return BAD("no buffer");
    const uint8_t *b = buf;
    size_t n = (size_t)s->g.n_layers;
    enum kv_home *home = calloc(n, sizeof(*home));
    int64_t *lo = calloc(n, sizeof(*lo));
    struct kvq_layer_state *kq = calloc(n, sizeof(*kq));
    struct io io = {.s = s, .load = true, .stage = malloc(s->block_bytes)};
    enum tier_status st = TIER_OK;
    if (!home || !lo || !kq || !io.stage)
        st = kv_fail(s, TIER_ENOMEM_HOST, "host memory: loading a sequence image");
    struct kv_seq_state x = {.home = home, .lo = lo, .kvq = kq};
    size_t qbb = 0;
    int64_t T = 1;
    if (st == TIER_OK && (st = parse_geometry(s, b, size)) == TIER_OK &&
        (st = parse_params(s, b, &x.p, &qbb, &T)) == TIER_OK && (st = parse_state(s, b, &x)) == TIER_OK)
        st = parse_sections(s, b, size, &x, home, lo, kq, qbb, T);
    kv_seq *q = NULL;
    if (st == TIER_OK)
        st = kv_seq_restore(s, &x, false, &q);
    /* as kv_seq_offload after a device OOM; a sink sequence stays on the device */
    if (st == TIER_ENOMEM_DEV && !x.p.no_fallback && !x.p.sink) {
        s->err[0] = '\0';
        st = kv_seq_restore(s, &x, true, &q);
    }
    io.p = (uint8_t *)b + IMG_HDR + 4 * n;
    for (int l = 0; l < s->g.n_layers && st == TIER_OK; l++) {
        io.p += q->kvq ? SEC_QUANT : SEC_DENSE;
        st = layer_io(&io, q, l);
    }
    if (st == TIER_OK)
        *out = q;
    else
        kv_seq_free(q);
    free(io.stage);
    free(kq);
    free(lo);
    free(home);
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

/* Layer l's section as kv_seq_save writes it, from in (checked sizes). */
static uint8_t *put_quant_section(const kv_store *s, uint8_t *o, int64_t lo, const struct kv_quant_layer_in *in,
                                  size_t qbb)
{
    const struct kv_quant_layer *d = &in->d;
    put64(o, (uint64_t)lo);
    put64(o + 8, (uint64_t)d->nq);
    put64(o + 16, (uint64_t)d->first_block);
    put32(o + 24, float_bits(d->scale_k));
    put32(o + 28, float_bits(d->scale_v));
    o += SEC_QUANT;
    memcpy(o, in->blocks, (size_t)d->n_blocks * qbb);
    o += (size_t)d->n_blocks * qbb;
    /* [H, residual, D] per half into rows of K then V for every head */
    size_t hrow = (size_t)s->g.head_dim * be_dtype_size(s->g.dtype);
    for (int64_t t = 0; t < d->residual; t++)
        for (int half = 0; half < 2; half++)
            for (int h = 0; h < s->g.n_kv_heads; h++) {
                const char *src = half ? in->v : in->k;
                memcpy(o, src + ((size_t)h * (size_t)d->residual + (size_t)t) * hrow, hrow);
                o += hrow;
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
    enum tier_status st = kv_check_params(s, p);
    if (st != TIER_OK)
        return st;
    if (kv_quant_validate(&p->quant, &e) != TIER_OK ||
        kvq_format_init(&f, &p->quant, s->g.n_kv_heads, s->g.head_dim, kvq_block_tokens(&p->quant, s->bt), &e) !=
            TIER_OK)
        return kv_fail(s, TIER_EINVAL, "raw import: field params: %s", e.msg);
    size_t size = IMG_HDR + 4 * (size_t)s->g.n_layers, rb = row_bytes(s);
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
        size += SEC_QUANT;
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
        else if (!add_rows(&size, (uint64_t)d->n_blocks, f.block_bytes) || !add_rows(&size, (uint64_t)d->residual, rb))
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
    uint8_t *o = img + IMG_HDR + 4 * (size_t)s->g.n_layers;
    for (int l = 0; l < s->g.n_layers; l++)
        o = put_quant_section(s, o, lo[l], &in[l], f.block_bytes);
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
