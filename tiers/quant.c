/* quant.c - quantized KV: parameters, formats and the KIVI layer (quant.h;
 * docs/quantization.md).  The codes themselves are written by the backend
 * (be_kvq_quantize), where the blocks live.
 *
 * NOTES
 * The KIVI layer keeps HF's counting exactly.  Where HF re-quantizes the
 * whole dequantized history at every flush, the layer quantizes only the new
 * tokens, plus the earlier tokens of a per-channel group row that a previous
 * flush left partly filled (decoded and quantized again with the new ones).
 */
#include "tiers/quant.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVQ_ALIGN 64

static enum tier_status fail(struct kvq_error *err, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static enum tier_status fail(struct kvq_error *err, const char *param, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        snprintf(err->param, sizeof(err->param), "%s", param);
        vsnprintf(err->msg, sizeof(err->msg), fmt, ap);
        va_end(ap);
    }
    return TIER_EINVAL;
}

/* ---- parameters --------------------------------------------------------- */

static const char *const backend_names[] = {[KVQ_QUANTO] = "quanto", [KVQ_HQQ] = "hqq", [KVQ_FP8] = "fp8"};

const char *kv_quant_backend_name(enum kv_quant_backend b)
{
    return (unsigned)b < sizeof(backend_names) / sizeof(backend_names[0]) ? backend_names[b] : "?";
}

struct kv_quant_params kv_quant_defaults(enum kv_quant_backend b)
{
    if (b == KVQ_FP8) /* e4m3 codes, no groups, no residual */
        return (struct kv_quant_params){.backend = b, .nbits = 8};
    return (struct kv_quant_params){
        .backend = b, .nbits = 4, .axis_key = 0, .axis_value = 0, .q_group_size = 64, .residual_length = 128};
}

static bool in_set(int v, const int *set, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (set[i] == v)
            return true;
    return false;
}

enum tier_status kv_quant_validate(const struct kv_quant_params *p, struct kvq_error *err)
{
    static const int quanto_bits[] = {2, 4, 8}, hqq_bits[] = {1, 2, 3, 4, 8};
    static const int quanto_axes[] = {0, -1}, hqq_axes[] = {0, 1};
    if (!p)
        return fail(err, "cache", "no quantized cache parameters");
    switch (p->backend) {
    case KVQ_FP8:
        return TIER_OK;
    case KVQ_QUANTO:
        if (!in_set(p->nbits, quanto_bits, 3))
            return fail(err, "cache.nbits",
                        "cache.nbits for the quanto backend has to be one of [2, 4] (8 is a kvtier extension) but got %d",
                        p->nbits);
        if (!in_set(p->axis_key, quanto_axes, 2))
            return fail(err, "cache.axis_key", "cache.axis_key for the quanto backend has to be one of [0, -1] but got %d",
                        p->axis_key);
        if (!in_set(p->axis_value, quanto_axes, 2))
            return fail(err, "cache.axis_value",
                        "cache.axis_value for the quanto backend has to be one of [0, -1] but got %d", p->axis_value);
        break;
    case KVQ_HQQ:
        if (!in_set(p->nbits, hqq_bits, 5))
            return fail(err, "cache.nbits", "cache.nbits for the hqq backend has to be one of [1, 2, 3, 4, 8] but got %d",
                        p->nbits);
        if (!in_set(p->axis_key, hqq_axes, 2))
            return fail(err, "cache.axis_key", "cache.axis_key for the hqq backend has to be one of [0, 1] but got %d",
                        p->axis_key);
        if (!in_set(p->axis_value, hqq_axes, 2))
            return fail(err, "cache.axis_value", "cache.axis_value for the hqq backend has to be one of [0, 1] but got %d",
                        p->axis_value);
        break;
    default:
        return fail(err, "cache.backend", "cache.backend: unknown quantization backend %d; valid values: quanto, hqq, fp8",
                    (int)p->backend);
    }
    if (p->q_group_size < 1 || p->q_group_size > KVQ_MAX_GROUP)
        return fail(err, "cache.q_group_size", "cache.q_group_size has to be between 1 and %d but got %d",
                    KVQ_MAX_GROUP, p->q_group_size);
    if (p->residual_length < 0 || p->residual_length > KVQ_MAX_RESIDUAL)
        return fail(err, "cache.residual_length", "cache.residual_length has to be between 0 and %d but got %d",
                    KVQ_MAX_RESIDUAL, p->residual_length);
    return TIER_OK;
}

static const char *const int_keys[] = {"nbits", "axis_key", "axis_value", "q_group_size", "residual_length"};
#define N_INT_KEYS (sizeof(int_keys) / sizeof(int_keys[0]))

static int *int_field(struct kv_quant_params *p, size_t i)
{
    int *fields[N_INT_KEYS] = {&p->nbits, &p->axis_key, &p->axis_value, &p->q_group_size, &p->residual_length};
    return fields[i];
}

bool kv_quant_is_param(const char *key)
{
    for (size_t i = 0; i < N_INT_KEYS; i++)
        if (!strcmp(key, int_keys[i]))
            return true;
    return !strcmp(key, "backend");
}

enum tier_status kv_quant_parse(const json_t *cache, struct kv_quant_params *out, struct kvq_error *err)
{
    enum kv_quant_backend b = KVQ_QUANTO; /* HF: cache_config.pop("backend", "quanto") */
    const json_t *jb = cache ? json_object_get(cache, "backend") : NULL;
    if (jb) {
        if (!json_is_string(jb))
            return fail(err, "cache.backend", "cache.backend must be a string: one of quanto, hqq, fp8");
        const char *name = json_string_value(jb);
        size_t i = 0;
        while (i < sizeof(backend_names) / sizeof(backend_names[0]) && strcmp(name, backend_names[i]) != 0)
            i++;
        if (i == sizeof(backend_names) / sizeof(backend_names[0]))
            return fail(err, "cache.backend", "cache.backend: unknown quantization backend \"%.40s\"; valid values: quanto, hqq, fp8",
                        name);
        b = (enum kv_quant_backend)i;
    }
    struct kv_quant_params p = kv_quant_defaults(b);
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)cache, key, v)
    {
        if (strcmp(key, "implementation") == 0 || strcmp(key, "backend") == 0)
            continue;
        size_t i = 0;
        while (i < N_INT_KEYS && strcmp(key, int_keys[i]) != 0)
            i++;
        if (i == N_INT_KEYS)
            return fail(err, "cache", "cache.%.40s is not a parameter of \"quantized\"; valid: " KV_QUANT_PARAM_NAMES,
                        key);
        char param[KVQ_PARAM_LEN];
        snprintf(param, sizeof(param), "cache.%s", int_keys[i]);
        if (b == KVQ_FP8)
            return fail(err, param, "%s is not a parameter of the fp8 backend (e4m3 with one scale per tensor takes "
                        "none of nbits, axis_key, axis_value, q_group_size, residual_length)", param);
        if (!json_is_integer(v) || json_integer_value(v) < INT32_MIN || json_integer_value(v) > INT32_MAX)
            return fail(err, param, "%s must be an integer", param);
        *int_field(&p, i) = (int)json_integer_value(v);
    }
    enum tier_status st = kv_quant_validate(&p, err);
    if (st == TIER_OK)
        *out = p;
    return st;
}

/* ---- formats -------------------------------------------------------------- */

/* Whether an axis value means per-channel groups (KIVI keys): quanto -1,
 * hqq 0.  The other value of each backend groups along one token's channels. */
static bool per_channel(enum kv_quant_backend b, int axis)
{
    return b == KVQ_QUANTO ? axis == -1 : b == KVQ_HQQ && axis == 0;
}

int kvq_block_tokens(const struct kv_quant_params *p, int store_bt)
{
    if (p->backend == KVQ_FP8 || (!per_channel(p->backend, p->axis_key) && !per_channel(p->backend, p->axis_value)))
        return store_bt;
    int g = p->q_group_size;
    if (g < 1 || g > KVQ_MAX_GROUP) /* unchecked yet (an image's header): kvq_format_init refuses it */
        return store_bt;
    return (store_bt + g - 1) / g * g;
}

static size_t align_up(size_t n)
{
    return (n + KVQ_ALIGN - 1) / KVQ_ALIGN * KVQ_ALIGN;
}

static enum tier_status half_init(struct be_kvq_half *h, const struct kv_quant_params *p, int axis, int head_dim,
                                  int block_tokens, const char *which, struct kvq_error *err)
{
    int g = p->q_group_size;
    if (per_channel(p->backend, axis)) {
        if (block_tokens % g)
            return fail(err, "cache.q_group_size",
                        "cache.q_group_size (%d) must divide the quantized block (%d tokens) for per-channel %s groups",
                        g, block_tokens, which);
        /* groups of one element are per-token groups of one as well, which
         * start each group's codes on a byte */
        if (g == 1 && p->nbits % 8)
            return fail(err, "cache.q_group_size",
                        "cache.q_group_size 1 makes per-channel %s groups of one element, whose %d-bit codes would "
                        "not start on a byte: use 2 or more, or nbits 8", which, p->nbits);
        h->gt = g;
        h->gd = 1;
    } else {
        h->gt = 1;
        h->gd = g < head_dim ? g : head_dim;
        if (head_dim % h->gd || (h->gd * p->nbits) % 8)
            return fail(err, "cache.q_group_size",
                        "cache.q_group_size (%d) must divide head_dim (%d) in groups of whole bytes of %d-bit codes, or "
                        "be at least head_dim, for per-token %s groups", g, head_dim, p->nbits, which);
    }
    return TIER_OK;
}

enum tier_status kvq_format_init(struct be_kvq_format *f, const struct kv_quant_params *p, int n_kv_heads,
                                 int head_dim, int block_tokens, struct kvq_error *err)
{
    enum tier_status st = kv_quant_validate(p, err);
    if (st != TIER_OK)
        return st;
    if (n_kv_heads <= 0 || head_dim <= 0 || head_dim % 8 || block_tokens <= 0)
        return fail(err, "head_dim", "quantized KV needs n_kv_heads > 0, head_dim a positive multiple of 8 and "
                    "blocks > 0 (got %d, %d, %d)", n_kv_heads, head_dim, block_tokens);
    memset(f, 0, sizeof(*f));
    f->kind = p->backend == KVQ_FP8 ? BE_KVQ_E4M3 : p->backend == KVQ_QUANTO ? BE_KVQ_AFFINE_SHIFT : BE_KVQ_AFFINE_ZERO;
    f->nbits = p->backend == KVQ_FP8 ? 8 : p->nbits;
    f->block_tokens = block_tokens;
    f->n_kv_heads = n_kv_heads;
    f->head_dim = head_dim;
    size_t codes = (size_t)n_kv_heads * (size_t)block_tokens * (size_t)head_dim * (size_t)f->nbits / 8;
    if (f->kind == BE_KVQ_E4M3) {
        f->k = (struct be_kvq_half){.gt = 1, .gd = head_dim, .codes = 0, .params = codes};
        f->v = (struct be_kvq_half){.gt = 1, .gd = head_dim, .codes = align_up(codes), .params = align_up(codes) + codes};
        f->block_bytes = align_up(f->v.params);
        return TIER_OK;
    }
    if ((st = half_init(&f->k, p, p->axis_key, head_dim, block_tokens, "key", err)) != TIER_OK ||
        (st = half_init(&f->v, p, p->axis_value, head_dim, block_tokens, "value", err)) != TIER_OK)
        return st;
    size_t off = 0;
    struct be_kvq_half *parts[2] = {&f->k, &f->v};
    for (int i = 0; i < 2; i++) {
        size_t groups = (size_t)n_kv_heads * (size_t)(block_tokens / parts[i]->gt) * (size_t)(head_dim / parts[i]->gd);
        parts[i]->codes = off;
        parts[i]->params = align_up(off + codes);
        off = align_up(parts[i]->params + groups * 2 * sizeof(uint16_t));
    }
    f->block_bytes = off;
    return TIER_OK;
}

/* max|x| / 448 maps the largest value onto the largest e4m3; an all-zero
 * tensor gets 1 so later tokens still quantize. */
static float e4m3_scale_of(float amax)
{
    return amax > 0.0f ? amax / BE_E4M3_MAX : 1.0f;
}

float kvq_e4m3_scale(const float *x, size_t n)
{
    float amax = 0.0f;
    for (size_t i = 0; i < n; i++)
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    return e4m3_scale_of(amax);
}

/* ---- the KIVI layer ------------------------------------------------------- */

struct kvq_ctx {
    struct kv_quant_params p;
    struct be_kvq_format fmt;
    struct kvq_alloc a;
    be_backend *be;       /* writes the codes */
    int fbt;              /* tokens per full-precision block */
    enum be_dtype dtype;  /* of the full-precision blocks: the store's */
    size_t fblock_bytes;  /* K then V, each (n_kv_heads, fbt, head_dim) of dtype */
};

/* A growable table of blocks of one kind; `mark` is its length before the
 * pending reserve, so abort knows what to return. */
struct blocks {
    void **b;
    int n, cap, mark;
};

struct kvq_layer {
    kvq_ctx *c;
    int64_t len;       /* committed tokens (HF cumulative_length) */
    int64_t nq;        /* positions [0, nq) are quantized */
    int pending;       /* reserved, not yet committed */
    bool reserved;
    bool started;      /* the first update is committed */
    bool flush;        /* the pending commit quantizes [nq, len + pending) */
    bool more;         /* the pending commit is not the update's last */
    bool open;         /* an update's earlier parts are committed, its last is not */
    int64_t res0;      /* the residual when the open update began */
    float scale_k, scale_v;
    struct blocks q;   /* quantized blocks from block qoff (position qoff * T) */
    int64_t qoff;      /* blocks dropped below a sliding window (kvq_layer_drop) */
    struct blocks f;   /* full-precision blocks from position fbase */
    int64_t fbase;
};

enum tier_status kvq_ctx_create(be_backend *be, const struct kv_quant_params *p, enum be_dtype dtype, int n_kv_heads, int head_dim,
                                int store_bt, const struct kvq_alloc *a, kvq_ctx **out, struct kvq_error *err)
{
    *out = NULL;
    if (!be || !a || !a->get || !a->put || store_bt <= 0 || !be_dtype_size(dtype))
        return fail(err, "cache", "quantized KV needs a block allocator, a block size > 0 and a KV dtype");
    kvq_ctx *c = calloc(1, sizeof(*c));
    if (!c)
        return TIER_ENOMEM_HOST;
    enum tier_status st = kvq_format_init(&c->fmt, p, n_kv_heads, head_dim, kvq_block_tokens(p, store_bt), err);
    if (st != TIER_OK) {
        free(c);
        return st;
    }
    c->p = *p;
    c->a = *a;
    c->be = be;
    c->fbt = store_bt;
    c->dtype = dtype;
    c->fblock_bytes = 2 * (size_t)n_kv_heads * (size_t)store_bt * (size_t)head_dim * be_dtype_size(dtype);
    *out = c;
    return TIER_OK;
}

void kvq_ctx_free(kvq_ctx *c)
{
    free(c);
}

const struct be_kvq_format *kvq_ctx_format(const kvq_ctx *c)
{
    return &c->fmt;
}

size_t kvq_full_block_bytes(const kvq_ctx *c)
{
    return c->fblock_bytes;
}

enum tier_status kvq_layer_create(kvq_ctx *c, kvq_layer **out)
{
    *out = calloc(1, sizeof(**out));
    if (!*out)
        return TIER_ENOMEM_HOST;
    (*out)->c = c;
    (*out)->scale_k = (*out)->scale_v = 1.0f;
    return TIER_OK;
}

static void put_from(kvq_ctx *c, enum kvq_block_kind kind, struct blocks *t, int from)
{
    while (t->n > from)
        c->a.put(c->a.ctx, kind, t->b[--t->n]);
}

void kvq_layer_free(kvq_layer *l)
{
    if (!l)
        return;
    put_from(l->c, KVQ_BLOCK_QUANT, &l->q, 0);
    put_from(l->c, KVQ_BLOCK_FULL, &l->f, 0);
    free(l->q.b);
    free(l->f.b);
    free(l);
}

int64_t kvq_layer_length(const kvq_layer *l)
{
    return l->len;
}

int64_t kvq_layer_quantized(const kvq_layer *l)
{
    return l->nq;
}

int64_t kvq_layer_residual(const kvq_layer *l)
{
    return l->len - l->nq;
}

size_t kvq_layer_bytes(const kvq_layer *l)
{
    return (size_t)l->q.n * l->c->fmt.block_bytes + (size_t)l->f.n * l->c->fblock_bytes;
}

/* Takes blocks until t holds `want`; on failure returns what this call took. */
static enum tier_status take(kvq_ctx *c, enum kvq_block_kind kind, struct blocks *t, int64_t want)
{
    if (want > INT32_MAX / 2)
        return TIER_ENOMEM_HOST;
    if (want > t->cap) {
        int cap = t->cap ? t->cap : 8;
        while (cap < want)
            cap *= 2;
        void **nb = realloc(t->b, (size_t)cap * sizeof(*nb));
        if (!nb)
            return TIER_ENOMEM_HOST;
        t->b = nb;
        t->cap = cap;
    }
    int from = t->n;
    while (t->n < want) {
        void *b = c->a.get(c->a.ctx, kind);
        if (!b) {
            put_from(c, kind, t, from);
            return TIER_ENOMEM_DEV;
        }
        t->b[t->n++] = b;
    }
    return TIER_OK;
}

enum tier_status kvq_layer_reserve(kvq_layer *l, int n_new, bool more)
{
    kvq_ctx *c = l->c;
    if (n_new < 0 || l->reserved)
        return TIER_EINVAL;
    int64_t res = l->open ? l->res0 : l->len - l->nq, end = l->len + n_new;
    /* HF's QuantizedLayer.update: the first update quantizes everything;
     * later the residual is flushed when it is non-empty and one short of
     * residual_length (keys.dim() == 4 is false for the empty residual).
     * An update's earlier parts wait in the residual, unquantized, as the
     * whole input of one HF forward call would be: the rule then acts once,
     * at the last part, with the residual the update began with. */
    l->more = more;
    l->flush = !more && (!l->started || c->p.backend == KVQ_FP8 || (res > 0 && res + 1 >= c->p.residual_length));
    l->q.mark = l->q.n;
    l->f.mark = l->f.n;
    int64_t T = c->fmt.block_tokens;
    enum tier_status st = take(c, KVQ_BLOCK_FULL, &l->f, (end - l->fbase + c->fbt - 1) / c->fbt);
    if (st == TIER_OK && l->flush)
        st = take(c, KVQ_BLOCK_QUANT, &l->q, (end + T - 1) / T - l->qoff);
    if (st != TIER_OK) {
        put_from(c, KVQ_BLOCK_FULL, &l->f, l->f.mark);
        return st;
    }
    l->pending = n_new;
    l->reserved = true;
    return TIER_OK;
}

void kvq_layer_view(const kvq_layer *l, struct be_kvq_view *out)
{
    const kvq_ctx *c = l->c;
    *out = (struct be_kvq_view){
        .fmt = &c->fmt,
        .blocks = l->q.b,
        .n_blocks = l->q.n,
        .base = l->qoff * c->fmt.block_tokens,
        .lo = l->qoff * c->fmt.block_tokens,
        .hi = l->nq,
        .scale_k = l->scale_k,
        .scale_v = l->scale_v,
        .rest = {.blocks = l->f.b,
                 .n_blocks = l->f.n,
                 .block_tokens = c->fbt,
                 .v_offset = c->fblock_bytes / 2,
                 .base = l->fbase,
                 .lo = l->nq,
                 .hi = l->len + l->pending},
        .rest_dtype = c->dtype,
    };
}

/* The fp8 tensor scales from the first update's tokens [0, end). */
static enum be_status calibrate_e4m3(kvq_layer *l, int64_t end)
{
    struct be_kvq_view v;
    kvq_layer_view(l, &v);
    float amax[2];
    enum be_status st = be_kv_absmax(l->c->be, &v.rest, v.rest_dtype, l->c->fmt.n_kv_heads, l->c->fmt.head_dim, 0, end, amax);
    l->scale_k = e4m3_scale_of(amax[0]);
    l->scale_v = e4m3_scale_of(amax[1]);
    return st;
}

enum be_status kvq_layer_commit(kvq_layer *l)
{
    if (!l->reserved)
        return BE_OK;
    kvq_ctx *c = l->c;
    int64_t end = l->len + l->pending;
    if (l->flush) {
        enum be_status st = !l->started && c->p.backend == KVQ_FP8 ? calibrate_e4m3(l, end) : BE_OK;
        struct be_kvq_view v;
        kvq_layer_view(l, &v);
        if (st == BE_OK)
            st = be_kvq_quantize(c->be, &v, end);
        if (st != BE_OK)
            return st;
        l->nq = end;
        /* the residual is empty: every full-precision block goes back */
        put_from(c, KVQ_BLOCK_FULL, &l->f, 0);
        l->fbase = end / c->fbt * c->fbt;
    }
    if (!l->open)
        l->res0 = l->len - l->nq;
    l->open = l->more;
    l->len = end;
    l->started |= !l->more;
    l->pending = 0;
    l->reserved = false;
    return BE_OK;
}

void kvq_layer_drop(kvq_layer *l, int64_t lo)
{
    if (l->reserved)
        return;
    int64_t T = l->c->fmt.block_tokens;
    /* the block holding nq stays: the next flush may reopen its partial
     * group row */
    int64_t keep_from = lo / T < l->nq / T ? lo / T : l->nq / T;
    int drop = (int)(keep_from - l->qoff);
    if (drop <= 0)
        return;
    for (int i = 0; i < drop; i++)
        l->c->a.put(l->c->a.ctx, KVQ_BLOCK_QUANT, l->q.b[i]);
    memmove(l->q.b, l->q.b + drop, (size_t)(l->q.n - drop) * sizeof(*l->q.b));
    l->q.n -= drop;
    l->qoff = keep_from;
}

enum tier_status kvq_layer_restore(kvq_layer *l, int64_t len, int64_t nq, int64_t qoff, float scale_k,
                                   float scale_v)
{
    kvq_ctx *c = l->c;
    int64_t T = c->fmt.block_tokens;
    if (l->started || l->reserved || nq < 0 || nq > len || qoff < 0 || qoff > nq / T)
        return TIER_EINVAL;
    /* as the last flush left them: the residual's blocks start at the
     * block holding nq, the quantized ones at qoff (kvq_layer_drop) */
    int64_t fbase = nq / c->fbt * c->fbt;
    enum tier_status st = take(c, KVQ_BLOCK_QUANT, &l->q, (nq + T - 1) / T - qoff);
    if (st == TIER_OK && nq < len && (st = take(c, KVQ_BLOCK_FULL, &l->f, (len - fbase + c->fbt - 1) / c->fbt)) != TIER_OK)
        put_from(c, KVQ_BLOCK_QUANT, &l->q, 0);
    if (st != TIER_OK)
        return st;
    l->len = len;
    l->nq = nq;
    l->qoff = qoff;
    l->fbase = fbase;
    l->started = nq > 0; /* nothing quantized: a first update's parts, which the next update completes */
    l->scale_k = scale_k;
    l->scale_v = scale_v;
    return TIER_OK;
}

void kvq_layer_remap(kvq_layer *l, void *(*map)(void *ctx, enum kvq_block_kind kind, void *block), void *ctx)
{
    for (int i = 0; i < l->q.n; i++)
        l->q.b[i] = map(ctx, KVQ_BLOCK_QUANT, l->q.b[i]);
    for (int i = 0; i < l->f.n; i++)
        l->f.b[i] = map(ctx, KVQ_BLOCK_FULL, l->f.b[i]);
}

void kvq_layer_abort(kvq_layer *l)
{
    if (!l->reserved)
        return;
    put_from(l->c, KVQ_BLOCK_QUANT, &l->q, l->q.mark);
    put_from(l->c, KVQ_BLOCK_FULL, &l->f, l->f.mark);
    l->pending = 0;
    l->reserved = false;
}
