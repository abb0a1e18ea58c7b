/* kvfile.c - the KV safetensors file (kvfile.h): the writer lays the
 * header out before the data exists, so the exporter reads each layer
 * straight into its place; the parser trusts nothing in an uploaded file
 * until every field has been checked against the model (sizes before
 * arithmetic, the header length before the JSON, the JSON before any
 * pointer into the data).
 */
#include "model/kvfile.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "model/safetensors.h"
#include "util/half.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian");

#define ALIGN 8
/* the metadata and one entry per tensor, without the token ids */
#define HEADER_BASE ((size_t)64 << 10)
#define HEADER_PER_LAYER 256
#define ID_CHARS 12 /* an int32 id and its comma */
#define MAX_LAYERS 4096

const char *kvfile_dtype_name(enum be_dtype dt)
{
    static const char *const name[] = {[BE_F32] = "F32", [BE_F16] = "F16", [BE_BF16] = "BF16"};
    return dt <= BE_BF16 ? name[dt] : NULL;
}

size_t kvfile_header_max(int64_t ctx)
{
    return HEADER_BASE + (size_t)MAX_LAYERS * 2 * HEADER_PER_LAYER + (size_t)ctx * ID_CHARS;
}

size_t kvfile_max_size(int n_layers, int n_kv_heads, int head_dim, int64_t ctx)
{
    size_t per, total;
    if (n_layers <= 0 || n_kv_heads <= 0 || head_dim <= 0 || ctx <= 0 || ctx > (int64_t)1 << 40 ||
        __builtin_mul_overflow((size_t)n_kv_heads * (size_t)head_dim, (size_t)ctx * sizeof(float), &per) ||
        __builtin_mul_overflow(per + ALIGN, 2 * (size_t)n_layers, &total) ||
        __builtin_add_overflow(total, kvfile_header_max(ctx) + 8, &total))
        return 0;
    return total;
}

static size_t round_up(size_t x)
{
    return (x + ALIGN - 1) / ALIGN * ALIGN;
}

/* A state file's header: kvfile_header_max's, and per checkpoint (at most
 * one per interval of the context) its position and two tensor entries per
 * layer. */
static size_t state_header_max(int n_layers, int64_t ctx, int interval)
{
    size_t c = interval > 0 ? (size_t)(ctx / interval) : 0;
    return kvfile_header_max(ctx) + c * ((size_t)n_layers * 2 * HEADER_PER_LAYER + ID_CHARS);
}

size_t kvfile_state_max_size(int n_layers, int d_inner, int d_state, int d_conv, int64_t ctx, int interval)
{
    size_t per, total;
    if (n_layers <= 0 || n_layers > MAX_LAYERS || d_inner <= 0 || d_state <= 0 || d_conv <= 1 || ctx <= 0 ||
        ctx > (int64_t)1 << 40 || interval < 0 ||
        __builtin_mul_overflow((size_t)d_inner, ((size_t)d_conv - 1 + (size_t)d_state) * sizeof(float), &per) ||
        __builtin_mul_overflow(per + 2 * ALIGN, (size_t)n_layers, &total) ||
        __builtin_mul_overflow(total, 1 + (interval ? (size_t)(ctx / interval) : 0), &total) ||
        __builtin_add_overflow(total, state_header_max(n_layers, ctx, interval) + 8, &total))
        return 0;
    return total;
}

/* Token ids (int32) or checkpoint positions (wide: int64) as the JSON
 * array string of the metadata. */
static char *ids_json(const void *v, int64_t n, bool wide)
{
    size_t cap = 3 + (size_t)n * (wide ? 21 : ID_CHARS), at = 0;
    char *s = malloc(cap);
    if (!s)
        return NULL;
    s[at++] = '[';
    for (int64_t i = 0; i < n; i++)
        at += (size_t)snprintf(s + at, cap - at, i ? ",%" PRId64 : "%" PRId64,
                               wide ? ((const int64_t *)v)[i] : (int64_t)((const int32_t *)v)[i]);
    s[at++] = ']';
    s[at] = '\0';
    return s;
}

static int set_str(json_t *o, const char *key, const char *val)
{
    return json_object_set_new(o, key, json_string(val));
}

static size_t dtype_size(const char *name)
{
    static const struct {
        const char *name;
        size_t size;
    } sizes[] = {{"F32", 4}, {"F16", 2}, {"BF16", 2}, {"U8", 1}};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
        if (!strcmp(name, sizes[i].name))
            return sizes[i].size;
    return 0;
}

/* The header JSON: the metadata, then every tensor at its data offset. */
static json_t *header_json(const struct kvfile_info *in, const char *const *meta_kv, const struct kvfile_tensor *t,
                           int n, const size_t *bytes, size_t *data_size)
{
    json_t *h = json_object(), *meta = json_object();
    char fp[17], ver[16], *toks = ids_json(in->tokens, in->n_tokens, false);
    snprintf(fp, sizeof(fp), "%016" PRIx64, in->fingerprint);
    snprintf(ver, sizeof(ver), "%d", KVFILE_VERSION);
    int bad = !h || !meta || !toks;
    char *input = in->n_input ? ids_json(in->input, in->n_input, false) : NULL;
    bad = bad || (in->n_input && !input) || set_str(meta, "format", KVFILE_FORMAT) || set_str(meta, "version", ver) ||
          set_str(meta, "model_fingerprint", fp) || set_str(meta, "tokens", toks) ||
          set_str(meta, "strategy", in->strategy) || set_str(meta, "dtype", be_dtype_name(in->dtype)) ||
          (input && set_str(meta, "encoder_input", input));
    free(input);
    for (int i = 0; meta_kv && meta_kv[i] && !bad; i += 2)
        bad = set_str(meta, meta_kv[i], meta_kv[i + 1]);
    free(toks);
    bad = bad || json_object_set(h, "__metadata__", meta);
    json_decref(meta);
    size_t off = 0;
    for (int i = 0; i < n && !bad; i++) {
        json_t *shape = json_array(), *e;
        for (int d = 0; d < t[i].ndim && shape; d++)
            if (json_array_append_new(shape, json_integer((json_int_t)t[i].shape[d]))) {
                json_decref(shape);
                shape = NULL;
            }
        e = shape ? json_pack("{s:s, s:o, s:[I,I]}", "dtype", t[i].dtype, "shape", shape, "data_offsets",
                              (json_int_t)off, (json_int_t)(off + bytes[i]))
                  : NULL;
        bad = !e || json_object_set_new(h, t[i].name, e);
        off = round_up(off + bytes[i]);
    }
    if (bad) {
        json_decref(h);
        return NULL;
    }
    *data_size = off;
    return h;
}

enum model_status kvfile_build_tensors(const struct kvfile_info *in, const char *const *meta_kv,
                                       struct kvfile_tensor *t, int n, void **out, size_t *size, char *err)
{
    *out = NULL;
    if (n <= 0 || n > KVFILE_MAX_TENSORS || in->n_tokens <= 0 || in->n_tokens > INT32_MAX ||
        !be_dtype_size(in->dtype))
        return model_errf(err, MODEL_EINVAL, "KV file: %d tensors, %" PRId64 " tokens", n, in->n_tokens);
    size_t *bytes = malloc((size_t)n * sizeof(*bytes));
    if (!bytes)
        return model_errf(err, MODEL_ENOMEM, "KV file: out of memory");
    for (int i = 0; i < n; i++) {
        bytes[i] = dtype_size(t[i].dtype);
        bool ok = bytes[i] && t[i].ndim > 0 && t[i].ndim <= KVFILE_MAX_DIMS;
        for (int d = 0; d < t[i].ndim && ok; d++)
            ok = t[i].shape[d] >= 0 && !__builtin_mul_overflow(bytes[i], (size_t)t[i].shape[d], &bytes[i]);
        if (!ok) {
            free(bytes);
            return model_errf(err, MODEL_EINVAL, "KV file: tensor %s: bad dtype or shape", t[i].name);
        }
    }
    size_t data_size = 0;
    json_t *h = header_json(in, meta_kv, t, n, bytes, &data_size);
    char *text = h ? json_dumps(h, JSON_COMPACT) : NULL;
    json_decref(h);
    if (!text) {
        free(bytes);
        return model_errf(err, MODEL_ENOMEM, "KV file: out of memory for the header");
    }
    size_t hlen = round_up(strlen(text)), total = 8 + hlen + data_size;
    char *buf = calloc(1, total);
    if (buf) {
        for (int i = 0; i < 8; i++)
            buf[i] = (char)((uint64_t)hlen >> (8 * i));
        memset(buf + 8, ' ', hlen);
        memcpy(buf + 8, text, strlen(text));
        size_t off = 8 + hlen;
        for (int i = 0; i < n; i++) {
            t[i].off = off;
            off = round_up(off + bytes[i]);
        }
    }
    free(text);
    free(bytes);
    if (!buf)
        return model_errf(err, MODEL_ENOMEM, "KV file: out of memory for %zu bytes", total);
    *out = buf;
    *size = total;
    return MODEL_OK;
}

enum model_status kvfile_build(const struct kvfile_info *in, void **out, size_t *size, size_t *k_off, size_t *v_off,
                               char *err)
{
    *out = NULL;
    if (in->n_layers <= 0 || in->n_layers > MAX_LAYERS || in->n_tokens <= 0 || !be_dtype_size(in->dtype))
        return model_errf(err, MODEL_EINVAL, "KV file: %d layers, %" PRId64 " tokens", in->n_layers, in->n_tokens);
    for (int l = 0; l < in->n_layers; l++)
        if (in->rows[l] < 0 || in->rows[l] > in->n_tokens)
            return model_errf(err, MODEL_EINVAL, "KV file: layer %d: %" PRId64 " rows", l, in->rows[l]);
    if (in->n_input < 0 || in->n_input > INT32_MAX)
        return model_errf(err, MODEL_EINVAL, "KV file: %" PRId64 " encoder input tokens", in->n_input);
    int per = in->n_input ? 4 : 2, L = in->n_layers;
    struct kvfile_tensor *t = calloc((size_t)per * (size_t)L, sizeof(*t));
    if (!t)
        return model_errf(err, MODEL_ENOMEM, "KV file: out of memory");
    for (int i = 0; i < per * L; i++) {
        static const char *const kind[4] = {"key", "value", "cross_key", "cross_value"};
        snprintf(t[i].name, sizeof(t[i].name), "past_key_values.%d.%s", i / per, kind[i % per]);
        t[i].dtype = kvfile_dtype_name(in->dtype);
        t[i].ndim = 4;
        int64_t rows = i % per < 2 ? in->rows[i / per] : in->n_input;
        memcpy(t[i].shape, (int64_t[]){1, in->n_kv_heads, rows, in->head_dim}, 4 * sizeof(int64_t));
    }
    enum model_status st = kvfile_build_tensors(in, NULL, t, per * L, out, size, err);
    for (int i = 0; i < per * L && st == MODEL_OK; i++)
        (i % 2 ? v_off : k_off)[i % per / 2 * L + i / per] = t[i].off;
    free(t);
    return st;
}

/* A state file's tensors: conv_states.{l} then ssm_states.{l}, per layer,
 * then the same for each of n_ckpt checkpoints, prefixed checkpoint.{i}. */
static void state_tensors(int L, int d_inner, int d_state, int d_conv, int n_ckpt, struct kvfile_tensor *t)
{
    for (int c = -1; c < n_ckpt; c++)
        for (int l = 0; l < L; l++, t += 2) {
            char pre[32] = "";
            if (c >= 0)
                snprintf(pre, sizeof(pre), "checkpoint.%d.", c);
            t[0] = (struct kvfile_tensor){.dtype = "F32", .ndim = 3, .shape = {1, d_inner, d_conv - 1}};
            snprintf(t[0].name, sizeof(t[0].name), "%sconv_states.%d", pre, l);
            t[1] = (struct kvfile_tensor){.dtype = "F32", .ndim = 3, .shape = {1, d_inner, d_state}};
            snprintf(t[1].name, sizeof(t[1].name), "%sssm_states.%d", pre, l);
        }
}

/* Between one layer's state as be_ssm lays it out (the window (K - 1,
 * inner) then h (inner, N)) and the file's conv (inner, K - 1) and ssm
 * (inner, N); to_file picks the direction.  The file's bytes may sit at
 * any 4-byte boundary: memcpy. */
static void state_move(float *st, char *conv, char *ssm, int inner, int N, int K, bool to_file)
{
    for (int k = 0; k < K - 1; k++)
        for (int i = 0; i < inner; i++) {
            float *w = st + (size_t)k * inner + i;
            char *c = conv + ((size_t)i * (K - 1) + k) * sizeof(float);
            memcpy(to_file ? (void *)c : (void *)w, to_file ? (void *)w : (void *)c, sizeof(float));
        }
    size_t hb = (size_t)inner * N * sizeof(float);
    char *h = (char *)(st + (size_t)(K - 1) * inner);
    memcpy(to_file ? ssm : h, to_file ? h : ssm, hb);
}

enum model_status kvfile_build_state(const struct kvfile_info *in, int d_inner, int d_state, int d_conv,
                                     const float *state, const int64_t *ckpt_pos, int n_ckpt, void **out,
                                     size_t *size, char *err)
{
    *out = NULL;
    int L = in->n_layers;
    if (!kvfile_state_max_size(L, d_inner, d_state, d_conv, in->n_tokens > 0 ? in->n_tokens : 1, 0) ||
        n_ckpt < 0 || (size_t)n_ckpt >= KVFILE_MAX_TENSORS / 2 / (size_t)L)
        return model_errf(err, MODEL_EINVAL, "KV file: a state of %d layers (%d, %d, %d), %d checkpoints", L,
                          d_inner, d_state, d_conv, n_ckpt);
    size_t n = 2 * (size_t)L * (1 + (size_t)n_ckpt);
    struct kvfile_tensor *t = calloc(n, sizeof(*t));
    char *pos = n_ckpt ? ids_json(ckpt_pos, n_ckpt, true) : NULL;
    if (!t || (n_ckpt && !pos)) {
        free(t);
        free(pos);
        return model_errf(err, MODEL_ENOMEM, "KV file: out of memory");
    }
    state_tensors(L, d_inner, d_state, d_conv, n_ckpt, t);
    const char *meta[] = {"layout", "state", n_ckpt ? "checkpoint_positions" : NULL, pos, NULL};
    enum model_status st = kvfile_build_tensors(in, meta, t, (int)n, out, size, err);
    size_t per = (size_t)d_inner * ((size_t)d_conv - 1 + (size_t)d_state);
    for (size_t i = 0; i < n / 2 && st == MODEL_OK; i++)
        state_move((float *)(uintptr_t)(state + i * per), (char *)*out + t[2 * i].off, (char *)*out + t[2 * i + 1].off,
                   d_inner, d_state, d_conv, true);
    free(pos);
    free(t);
    return st;
}

/* ---- the parser ------------------------------------------------------------ */

static const char *meta_str(json_t *meta, const char *key)
{
    return json_string_value(json_object_get(meta, key));
}

/* __metadata__.key: a non-empty JSON array of at most max ids (what, in
 * messages) in the vocabulary, into *ids (malloc'ed) and *n. */
static enum model_status parse_ids(json_t *meta, const char *key, int64_t max, const char *what,
                                   const struct kvfile_expect *e, int32_t **ids, int64_t *n_ids, char *err)
{
    const char *s = meta_str(meta, key);
    if (!s)
        return model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.%s is missing", key);
    json_error_t je;
    json_t *a = json_loads(s, JSON_DECODE_ANY, &je);
    if (!json_is_array(a) || !json_array_size(a)) {
        json_decref(a);
        return model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.%s is not a non-empty JSON array of ids", key);
    }
    size_t n = json_array_size(a);
    if ((int64_t)n > max) {
        json_decref(a);
        return model_errf(err, MODEL_EINVAL, "KV file: __metadata__.%s holds %zu tokens; the %s allows at most "
                          "%" PRId64, key, n, what, max);
    }
    *ids = malloc(n * sizeof(int32_t));
    if (!*ids) {
        json_decref(a);
        return model_errf(err, MODEL_ENOMEM, "KV file: out of memory for %zu token ids", n);
    }
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(a, i);
        json_int_t id = json_integer_value(t);
        if (!json_is_integer(t) || id < 0 || id >= e->vocab_size) {
            json_decref(a);
            return model_errf(err, MODEL_EINVAL, "KV file: __metadata__.%s[%zu] is not a token id in [0, %d)", key, i,
                              e->vocab_size);
        }
        (*ids)[i] = (int32_t)id;
    }
    json_decref(a);
    *n_ids = (int64_t)n;
    return MODEL_OK;
}

static bool json_u64(json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

/* A raw file's quantization, q_block_tokens and q_layers (the positions
 * each layer's blocks and residual hold, as kv_seq_layer_quant describes
 * them), checked against the tokens before any tensor is looked at. */
static enum model_status parse_quant_meta(json_t *meta, const struct kvfile_expect *e, struct kvfile *f, char *err)
{
    const char *qz = meta_str(meta, "quantization"), *bt = meta_str(meta, "q_block_tokens"),
               *ql = meta_str(meta, "q_layers");
    if (!qz || !bt || !ql)
        return model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.%s is missing",
                          !qz ? "quantization" : !bt ? "q_block_tokens" : "q_layers");
    if (f->dtype != e->raw_dtype)
        return model_errf(err, MODEL_EFORMAT,
                          "KV file: __metadata__.dtype %s of a quantized file is not this store's KV dtype %s "
                          "(a raw file holds its residual as stored)", be_dtype_name(f->dtype),
                          be_dtype_name(e->raw_dtype));
    char why[MODEL_ERR_LEN];
    if (e->quant(e->rows_ctx, qz, &f->fmt, why) != MODEL_OK)
        return model_errf(err, MODEL_EINVAL, "KV file: __metadata__.quantization: %s", why);
    char want[16];
    int64_t T = f->fmt.block_tokens, n = f->n_tokens;
    snprintf(want, sizeof(want), "%" PRId64, T);
    if (strcmp(bt, want))
        return model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.q_block_tokens \"%.16s\" is not %s for this "
                          "quantization", bt, want);
    f->quantization = strdup(qz);
    f->q = calloc((size_t)e->n_layers, sizeof(*f->q));
    if (!f->quantization || !f->q)
        return model_errf(err, MODEL_ENOMEM, "KV file: out of memory");
    json_error_t je;
    json_t *a = json_loads(ql, 0, &je);
    enum model_status st = MODEL_OK;
    if (!json_is_array(a) || json_array_size(a) != (size_t)e->n_layers)
        st = model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.q_layers is not a JSON array of %d entries",
                        e->n_layers);
    for (int l = 0; l < e->n_layers && st == MODEL_OK; l++) {
        json_t *x = json_array_get(a, (size_t)l);
        uint64_t v[3];
        bool ok = json_array_size(x) == 3;
        for (int i = 0; i < 3 && ok; i++)
            ok = json_u64(json_array_get(x, (size_t)i), &v[i]) && v[i] <= (uint64_t)n;
        /* lo <= nq; the blocks start at first, at most at the one holding
         * lo; nq 0 < n: a first update's parts, nothing quantized yet */
        ok = ok && v[0] <= v[1] && v[2] * (uint64_t)T <= v[0];
        if (!ok) {
            st = model_errf(err, MODEL_EFORMAT,
                            "KV file: __metadata__.q_layers[%d] is not [lo, nq, first] with first*%" PRId64
                            " <= lo <= nq <= %" PRId64 " tokens",
                            l, T, n);
            break;
        }
        struct kvfile_qlayer *q = &f->q[l];
        q->lo = (int64_t)v[0];
        q->nq = (int64_t)v[1];
        q->first_block = (int64_t)v[2];
        q->residual = n - q->nq;
        q->n_blocks = (int)((q->nq + T - 1) / T - q->first_block);
    }
    json_decref(a);
    return st;
}

static enum model_status parse_meta(json_t *h, const struct kvfile_expect *e, struct kvfile *f, char *err)
{
    json_t *meta = json_object_get(h, "__metadata__");
    if (!json_is_object(meta))
        return model_errf(err, MODEL_EFORMAT, "KV file: __metadata__ is missing");
    const char *key;
    json_t *v;
    json_object_foreach(meta, key, v)
    {
        if (!json_is_string(v))
            return model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.%s is not a string", key);
    }
    const char *fmt = meta_str(meta, "format"), *ver = meta_str(meta, "version");
    if (!fmt || strcmp(fmt, KVFILE_FORMAT))
        return model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.format is not \"%s\"", KVFILE_FORMAT);
    char want[16];
    snprintf(want, sizeof(want), "%d", KVFILE_VERSION);
    if (!ver || strcmp(ver, want))
        return model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.version \"%s\" is not %s", ver ? ver : "",
                          want);
    const char *fp = meta_str(meta, "model_fingerprint");
    char have[17];
    snprintf(have, sizeof(have), "%016" PRIx64, e->fingerprint);
    if (!fp)
        return model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.model_fingerprint is missing");
    if (strcmp(fp, have))
        return model_errf(err, MODEL_ECONFIG,
                          "KV file: model_fingerprint %.16s is not this model's %s (the KV was computed by another "
                          "model)",
                          fp, have);
    const char *dt = meta_str(meta, "dtype");
    f->dtype = BE_F32;
    while (dt && f->dtype <= BE_BF16 && strcmp(dt, be_dtype_name(f->dtype)))
        f->dtype++;
    if (!dt || f->dtype > BE_BF16)
        return model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.dtype is not f32, f16 or bf16");
    /* a session holds fewer tokens than the context: the next one needs a position */
    enum model_status st = parse_ids(meta, "tokens", e->max_tokens, "context", e, &f->tokens, &f->n_tokens, err);
    if (st == MODEL_OK && e->max_input)
        st = parse_ids(meta, "encoder_input", e->max_input, "encoder's limit", e, &f->input, &f->n_input, err);
    else if (st == MODEL_OK && meta_str(meta, "encoder_input"))
        return model_errf(err, MODEL_ECONFIG, "KV file: __metadata__.encoder_input: an encoder-decoder model's cache, "
                          "and this model is decoder-only");
    const char *layout = meta_str(meta, "layout");
    if (st == MODEL_OK && e->ssm_inner && (!layout || strcmp(layout, "state")))
        return model_errf(err, MODEL_ECONFIG, "KV file: __metadata__.layout is not \"state\": a cache of K and V, "
                          "and this model is a state-space model");
    if (st == MODEL_OK && e->ssm_inner && f->dtype != BE_F32)
        return model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.dtype of a state file must be f32");
    if (st == MODEL_OK && layout && !strcmp(layout, "state") && !e->ssm_inner)
        return model_errf(err, MODEL_ECONFIG, "KV file: __metadata__.layout \"state\": a state-space model's "
                          "state, and this model's cache is K and V");
    if (st != MODEL_OK || !layout || e->ssm_inner)
        return st;
    if (strcmp(layout, "quantized") || !e->quant)
        return model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.layout \"%.32s\" is not %s", layout,
                          e->quant ? "\"quantized\" (or absent)" : "accepted here (only the dense layout)");
    return parse_quant_meta(meta, e, f, err);
}

struct range {
    uint64_t begin, end;
    const char *name;
};

static int cmp_range(const void *a, const void *b)
{
    const struct range *x = a, *y = b;
    return (x->begin > y->begin) - (x->begin < y->begin);
}

/* One tensor's entry: exactly dtype and shape want[ndim], its bytes inside
 * the data section and aligned to its element; *at is where they start in
 * buf.  The expected shapes are bounded by the model and the context, so
 * their product cannot overflow. */
/* What a tensor's values may be: NaN or an infinite key or value poisons
 * every attention that reads it, and so does a finite one too large for
 * the sums over it (3e38 overflows the first dot product).  Keys, values
 * and states are held to +-1e9: a product of two such values summed over
 * any head or hidden vector stays below 1e24, far inside f32, while no
 * sound model comes near (an f16 cache cannot hold more than 65504, and
 * the models served in bf16 alone stay within a few thousand).  A
 * quantized cache's group parameters are checked only where attention
 * reads them (check_read_groups): a block's unused rows were written as
 * the memory was by earlier builds. */
enum values { V_ANY, V_FINITE, V_CACHE };
#define CACHE_MAX 1e9f
#define E4M3_CODE_MAX 480.0f /* the largest e4m3 code reads as 480 (0x7f, never written, decoded as is) */

/* The first of bytes' elements of dtype that v refuses, or -1. */
static int64_t first_refused(const uint8_t *p, uint64_t bytes, const char *dtype, enum values v)
{
    if (v == V_ANY)
        return -1;
    if (!strcmp(dtype, "F32")) {
        for (uint64_t i = 0; i < bytes / 4; i++) {
            float x;
            memcpy(&x, p + 4 * i, 4);
            if (!isfinite(x) || (v == V_CACHE && fabsf(x) > CACHE_MAX))
                return (int64_t)i;
        }
    } else if (!strcmp(dtype, "F16")) {
        for (uint64_t i = 0; i < bytes / 2; i++) {
            uint16_t x;
            memcpy(&x, p + 2 * i, 2);
            if ((x & 0x7c00) == 0x7c00) /* all ones: infinity or NaN */
                return (int64_t)i;
        }
    } else if (!strcmp(dtype, "BF16")) {
        for (uint64_t i = 0; i < bytes / 2; i++) {
            uint16_t x;
            memcpy(&x, p + 2 * i, 2);
            float f = bf16_to_f32(x);
            if (!isfinite(f) || (v == V_CACHE && fabsf(f) > CACHE_MAX))
                return (int64_t)i;
        }
    }
    return -1;
}

/* The (scale, zero) pairs of the groups holding a position attention reads
 * ([lo, nq) of blocks from first_block on) are finite. */
static enum model_status check_read_groups(const struct kvfile_qlayer *q, const struct be_kvq_half *hf, uint64_t T,
                                           uint64_t H, uint64_t D, const uint8_t *params, const char *name, char *err)
{
    uint64_t gt = (uint64_t)hf->gt, rows = T / gt, row = D / (uint64_t)hf->gd * 2; /* f16 per group row */
    for (uint64_t b = 0; b < (uint64_t)q->n_blocks; b++)
        for (uint64_t g = 0; g < rows; g++) {
            int64_t p0 = ((int64_t)b + q->first_block) * (int64_t)T + (int64_t)(g * gt);
            if (p0 + (int64_t)gt <= q->lo || p0 >= q->nq)
                continue;
            for (uint64_t k = 0; k < H; k++) {
                uint64_t at = ((b * H + k) * rows + g) * row;
                int64_t bad = first_refused(params + 2 * at, 2 * row, "F16", V_FINITE);
                if (bad >= 0)
                    return model_errf(err, MODEL_EFORMAT, "KV file: tensor %s: element %" PRIu64 ", a group "
                                      "parameter attention reads, is not finite (NaN or infinity)", name,
                                      at + (uint64_t)bad);
            }
        }
    return MODEL_OK;
}

static enum model_status check_tensor(json_t *h, const char *name, const char *dtype, int ndim, const uint64_t *want,
                                      enum values values, const uint8_t *buf, uint64_t data_at, uint64_t data_size,
                                      struct range *r, char *err)
{
    json_t *t = json_object_get(h, name);
    if (!json_is_object(t))
        return model_errf(err, MODEL_EFORMAT, "KV file: tensor %s is missing", name);
    const char *dt = json_string_value(json_object_get(t, "dtype"));
    if (!dt || strcmp(dt, dtype))
        return model_errf(err, MODEL_EFORMAT, "KV file: tensor %s: dtype %s, this file needs %s", name,
                          dt ? dt : "(none)", dtype);
    json_t *shape = json_object_get(t, "shape");
    uint64_t got, bytes = dtype_size(dtype);
    bool ok = json_array_size(shape) == (size_t)ndim;
    for (int d = 0; d < ndim && ok; d++)
        ok = json_u64(json_array_get(shape, (size_t)d), &got) && got == want[d];
    if (!ok) {
        char txt[160];
        size_t at = 0;
        for (int d = 0; d < ndim; d++)
            at += (size_t)snprintf(txt + at, sizeof(txt) - at, d ? ", %" PRIu64 : "%" PRIu64, want[d]);
        return model_errf(err, MODEL_EFORMAT, "KV file: tensor %s: shape must be [%s] for this model and file", name,
                          txt);
    }
    for (int d = 0; d < ndim; d++)
        bytes *= want[d];
    json_t *offs = json_object_get(t, "data_offsets");
    if (json_array_size(offs) != 2 || !json_u64(json_array_get(offs, 0), &r->begin) ||
        !json_u64(json_array_get(offs, 1), &r->end))
        return model_errf(err, MODEL_EFORMAT, "KV file: tensor %s: data_offsets are not two integers", name);
    if (r->begin > r->end || r->end > data_size || r->end - r->begin != bytes)
        return model_errf(err, MODEL_EFORMAT,
                          "KV file: tensor %s: data_offsets [%" PRIu64 ", %" PRIu64 ") must span %" PRIu64
                          " bytes inside the %" PRIu64 "-byte data section",
                          name, r->begin, r->end, bytes, data_size);
    if ((data_at + r->begin) % dtype_size(dtype))
        return model_errf(err, MODEL_EFORMAT, "KV file: tensor %s: data at byte %" PRIu64 " is not aligned to %zu",
                          name, data_at + r->begin, dtype_size(dtype));
    int64_t bad = first_refused(buf + data_at + r->begin, bytes, dtype, values);
    if (bad >= 0)
        return model_errf(err, MODEL_EFORMAT, "KV file: tensor %s: element %" PRId64 " is not finite (NaN or infinity)%s",
                          name, bad, values == V_CACHE ? " or beyond +-1e9" : "");
    r->name = json_object_iter_key(json_object_iter_at(h, name));
    return MODEL_OK;
}

/* No two tensors' bytes overlap (r is sorted). */
static enum model_status check_overlap(struct range *r, size_t n, char *err)
{
    qsort(r, n, sizeof(*r), cmp_range);
    for (size_t i = 1; i < n; i++)
        if (r[i].begin < r[i - 1].end)
            return model_errf(err, MODEL_EFORMAT, "KV file: tensors %s and %s overlap", r[i - 1].name, r[i].name);
    return MODEL_OK;
}

static enum model_status parse_tensors(json_t *h, const uint8_t *buf, uint64_t data_at, uint64_t data_size,
                                       const struct kvfile_expect *e, struct kvfile *f, char *err)
{
    size_t per = f->n_input ? 4 : 2, n = per * (size_t)e->n_layers;
    if (json_object_size(h) != n + 1)
        return model_errf(err, MODEL_EFORMAT,
                          "KV file: %zu tensors, but this model needs exactly %zu (past_key_values.{0..%d}.key and "
                          ".value%s)",
                          json_object_size(h) - 1, n, e->n_layers - 1, f->n_input ? ", .cross_key, .cross_value" : "");
    struct range *r = malloc(n * sizeof(*r));
    size_t L = (size_t)e->n_layers;
    f->k = calloc(L, sizeof(*f->k));
    f->v = calloc(L, sizeof(*f->v));
    f->ck = f->n_input ? calloc(L, sizeof(*f->ck)) : NULL;
    f->cv = f->n_input ? calloc(L, sizeof(*f->cv)) : NULL;
    if (!r || !f->k || !f->v || (f->n_input && (!f->ck || !f->cv))) {
        free(r);
        return model_errf(err, MODEL_ENOMEM, "KV file: out of memory");
    }
    f->n_layers = e->n_layers;
    enum model_status st = MODEL_OK;
    static const char *const kind[4] = {"key", "value", "cross_key", "cross_value"};
    for (size_t i = 0; i < n && st == MODEL_OK; i++) {
        int l = (int)(i / per);
        char name[64];
        snprintf(name, sizeof(name), "past_key_values.%d.%s", l, kind[i % per]);
        uint64_t rows = i % per < 2 ? (uint64_t)e->rows(e->rows_ctx, l, f->n_tokens) : (uint64_t)f->n_input;
        const uint64_t want[4] = {1, (uint64_t)e->n_kv_heads, rows, (uint64_t)e->head_dim};
        st = check_tensor(h, name, kvfile_dtype_name(f->dtype), 4, want, V_CACHE, buf, data_at, data_size, &r[i], err);
        const void **dst = ((const void **[]){f->k, f->v, f->ck, f->cv})[i % per];
        if (st == MODEL_OK)
            dst[l] = buf + data_at + r[i].begin;
    }
    if (st == MODEL_OK)
        st = check_overlap(r, n, err);
    free(r);
    return st;
}

/* A state file's __metadata__.checkpoint_positions (absent: none) into
 * f->ckpt_pos, f->n_ckpt: ascending multiples of the interval in (0,
 * tokens], counted before anything is allocated for them. */
static enum model_status parse_ckpt_pos(json_t *h, const struct kvfile_expect *e, struct kvfile *f, char *err)
{
    const char *s = meta_str(json_object_get(h, "__metadata__"), "checkpoint_positions");
    if (!s)
        return MODEL_OK;
    int64_t iv = e->ssm_ckpt_interval, max = iv > 0 ? f->n_tokens / iv : 0;
    json_error_t je;
    json_t *a = json_loads(s, JSON_DECODE_ANY, &je);
    enum model_status st = MODEL_OK;
    if (!json_is_array(a))
        st = model_errf(err, MODEL_EFORMAT, "KV file: __metadata__.checkpoint_positions is not a JSON array");
    else if ((int64_t)json_array_size(a) > max)
        st = model_errf(err, MODEL_EINVAL,
                        "KV file: __metadata__.checkpoint_positions holds %zu positions, more than the %" PRId64
                        " multiples of the checkpoint interval %" PRId64 " within its %" PRId64 " tokens",
                        json_array_size(a), max, iv, f->n_tokens);
    else if (json_array_size(a) && !(f->ckpt_pos = malloc(json_array_size(a) * sizeof(*f->ckpt_pos))))
        st = model_errf(err, MODEL_ENOMEM, "KV file: out of memory for %zu checkpoints", json_array_size(a));
    for (size_t i = 0; i < json_array_size(a) && st == MODEL_OK; i++) {
        json_t *v = json_array_get(a, i);
        json_int_t p = json_integer_value(v), prev = i ? f->ckpt_pos[i - 1] : 0;
        if (!json_is_integer(v) || p <= prev || p > f->n_tokens || p % iv)
            st = model_errf(err, MODEL_EINVAL,
                            "KV file: __metadata__.checkpoint_positions[%zu] is not a multiple of the checkpoint "
                            "interval %" PRId64 " in (%" PRId64 ", %" PRId64 "] (ascending, at most the tokens)",
                            i, iv, (int64_t)prev, f->n_tokens);
        else
            f->ckpt_pos[f->n_ckpt++] = (int64_t)p;
    }
    json_decref(a);
    return st;
}

/* A state file's conv_states and ssm_states per layer, and its
 * checkpoints', gathered into f->state once all are checked. */
static enum model_status parse_state_tensors(json_t *h, const uint8_t *buf, uint64_t data_at, uint64_t data_size,
                                             const struct kvfile_expect *e, struct kvfile *f, char *err)
{
    enum model_status st = parse_ckpt_pos(h, e, f, err);
    if (st != MODEL_OK)
        return st;
    size_t L = (size_t)e->n_layers, n = 2 * L * (1 + (size_t)f->n_ckpt);
    if (json_object_size(h) != n + 1)
        return model_errf(err, MODEL_EFORMAT,
                          "KV file: %zu tensors, but a state file of this model with %d checkpoints needs exactly %zu "
                          "(conv_states.{0..%d} and ssm_states.{0..%d}, and checkpoint.{i}. before each per "
                          "checkpoint_positions)",
                          json_object_size(h) - 1, f->n_ckpt, n, e->n_layers - 1, e->n_layers - 1);
    struct range *r = malloc(n * sizeof(*r));
    struct kvfile_tensor *t = calloc(n, sizeof(*t));
    if (!r || !t) {
        free(r);
        free(t);
        return model_errf(err, MODEL_ENOMEM, "KV file: out of memory");
    }
    int inner = e->ssm_inner, N = e->ssm_state, K = e->ssm_conv;
    state_tensors(e->n_layers, inner, N, K, f->n_ckpt, t);
    for (size_t i = 0; i < n && st == MODEL_OK; i++) {
        const uint64_t want[3] = {1, (uint64_t)t[i].shape[1], (uint64_t)t[i].shape[2]};
        st = check_tensor(h, t[i].name, "F32", 3, want, V_CACHE, buf, data_at, data_size, &r[i], err);
        t[i].off = (size_t)(data_at + r[i].begin);
    }
    if (st == MODEL_OK)
        st = check_overlap(r, n, err);
    size_t per = (size_t)inner * ((size_t)K - 1 + (size_t)N);
    if (st == MODEL_OK && !(f->state = malloc(n / 2 * per * sizeof(float))))
        st = model_errf(err, MODEL_ENOMEM, "KV file: out of memory for a %zu-layer state and %d checkpoints", L,
                        f->n_ckpt);
    for (size_t l = 0; l < n / 2 && st == MODEL_OK; l++)
        state_move(f->state + l * per, (char *)(uintptr_t)buf + t[2 * l].off,
                   (char *)(uintptr_t)buf + t[2 * l + 1].off, inner, N, K, false);
    free(t);
    free(r);
    return st;
}

/* A raw file's tensors: per layer, K then V, its codes and scales, then
 * the residual's K and V (the daemon's export order), then an
 * encoder-decoder file's cross K and V, dense. */
#define RAW_PER_LAYER 6

static enum model_status parse_raw_tensors(json_t *h, const uint8_t *buf, uint64_t data_at, uint64_t data_size,
                                           const struct kvfile_expect *e, struct kvfile *f, char *err)
{
    size_t L = (size_t)e->n_layers, n = (RAW_PER_LAYER + (f->n_input ? 2 : 0)) * L;
    if (json_object_size(h) != n + 1)
        return model_errf(err, MODEL_EFORMAT,
                          "KV file: %zu tensors, but a quantized file of this model needs exactly %zu%s",
                          json_object_size(h) - 1, n,
                          f->n_input ? " (six per layer, then its .cross_key and .cross_value)" : "");
    struct range *r = malloc(n * sizeof(*r));
    f->ck = f->n_input ? calloc(L, sizeof(*f->ck)) : NULL;
    f->cv = f->n_input ? calloc(L, sizeof(*f->cv)) : NULL;
    if (!r || (f->n_input && (!f->ck || !f->cv))) {
        free(r);
        return model_errf(err, MODEL_ENOMEM, "KV file: out of memory");
    }
    const struct be_kvq_format *fm = &f->fmt;
    bool e4m3 = fm->kind == BE_KVQ_E4M3;
    uint64_t H = (uint64_t)e->n_kv_heads, D = (uint64_t)e->head_dim, T = (uint64_t)fm->block_tokens;
    enum model_status st = MODEL_OK;
    size_t i = 0;
    for (int l = 0; l < e->n_layers && st == MODEL_OK; l++) {
        struct kvfile_qlayer *q = &f->q[l];
        for (int half = 0; half < 2 && st == MODEL_OK; half++) {
            const struct be_kvq_half *hf = half ? &fm->v : &fm->k;
            const char *kv = half ? "value" : "key";
            char name[64];
            uint64_t B = (uint64_t)q->n_blocks;
            const uint64_t codes[4] = {B, H, T, D * (uint64_t)fm->nbits / 8}, one[1] = {1},
                           res[4] = {1, H, (uint64_t)q->residual, D};
            uint64_t params[5] = {B, H, 0, 0, 2};
            if (!e4m3) { /* e4m3 has no groups */
                params[2] = T / (uint64_t)hf->gt;
                params[3] = D / (uint64_t)hf->gd;
            }
            snprintf(name, sizeof(name), "past_key_values.%d.%s.qdata", l, kv);
            st = check_tensor(h, name, "U8", 4, codes, V_ANY, buf, data_at, data_size, &r[i], err);
            if (st != MODEL_OK)
                break;
            q->codes[half] = buf + data_at + r[i++].begin;
            snprintf(name, sizeof(name), "past_key_values.%d.%s.%s", l, kv, e4m3 ? "qscale" : "qparams");
            st = e4m3 ? check_tensor(h, name, "F32", 1, one, V_FINITE, buf, data_at, data_size, &r[i], err)
                      : check_tensor(h, name, "F16", 5, params, V_ANY, buf, data_at, data_size, &r[i], err);
            if (st != MODEL_OK)
                break;
            const uint8_t *sc = buf + data_at + r[i++].begin;
            if (e4m3) {
                memcpy(&q->scale[half], sc, sizeof(float));
                /* the values it decodes to, code times scale, held as a dense cache's are */
                if (!(fabsf(q->scale[half]) * E4M3_CODE_MAX <= CACHE_MAX))
                    st = model_errf(err, MODEL_EFORMAT, "KV file: tensor %s: scale %g decodes values beyond +-1e9",
                                    name, (double)q->scale[half]);
            }
            else if ((st = check_read_groups(q, hf, T, H, D, sc, name, err)) == MODEL_OK)
                q->params[half] = sc;
            if (st != MODEL_OK)
                break;
            snprintf(name, sizeof(name), "past_key_values.%d.%s", l, kv);
            st = check_tensor(h, name, kvfile_dtype_name(f->dtype), 4, res, V_CACHE, buf, data_at, data_size, &r[i],
                              err);
            if (st == MODEL_OK)
                q->res[half] = buf + data_at + r[i++].begin;
        }
        for (int half = 0; half < 2 && f->n_input && st == MODEL_OK; half++) {
            const uint64_t cross[4] = {1, H, (uint64_t)f->n_input, D};
            char name[64];
            snprintf(name, sizeof(name), "past_key_values.%d.%s", l, half ? "cross_value" : "cross_key");
            st = check_tensor(h, name, "F32", 4, cross, V_CACHE, buf, data_at, data_size, &r[i], err);
            if (st == MODEL_OK)
                (half ? f->cv : f->ck)[l] = buf + data_at + r[i++].begin;
        }
    }
    if (st == MODEL_OK)
        st = check_overlap(r, n, err);
    free(r);
    return st;
}

enum model_status kvfile_parse(const void *buf_, size_t len, const struct kvfile_expect *e, struct kvfile *f,
                               char *err)
{
    const uint8_t *buf = buf_;
    *f = (struct kvfile){0};
    if (len < 8)
        return model_errf(err, MODEL_EFORMAT, "KV file: truncated: %zu bytes, shorter than the header length", len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | buf[i];
    /* an encoder-decoder file's header holds its input and twice the tensors */
    size_t hmax = e->ssm_inner ? state_header_max(e->n_layers, e->max_tokens, e->ssm_ckpt_interval)
                               : kvfile_header_max(e->max_tokens) + (e->max_input ? kvfile_header_max(e->max_input) : 0);
    if (hlen > hmax)
        return model_errf(err, MODEL_EFORMAT, "KV file: header length %" PRIu64 " exceeds the %zu-byte limit", hlen,
                          hmax);
    if (hlen > len - 8)
        return model_errf(err, MODEL_EFORMAT, "KV file: truncated: header length %" PRIu64 " runs past the %zu bytes",
                          hlen, len);
    json_error_t je;
    json_t *h = json_loadb((const char *)buf + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!json_is_object(h)) {
        json_decref(h);
        return model_errf(err, MODEL_EFORMAT, "KV file: header is not a JSON object (byte %d: %s)", je.position,
                          h ? "not an object" : je.text);
    }
    enum model_status st = parse_meta(h, e, f, err);
    if (st == MODEL_OK)
        st = (e->ssm_inner ? parse_state_tensors : f->q ? parse_raw_tensors : parse_tensors)(h, buf, 8 + hlen,
                                                                                          len - 8 - hlen, e, f, err);
    json_decref(h);
    if (st != MODEL_OK)
        kvfile_release(f);
    return st;
}

void kvfile_release(struct kvfile *f)
{
    free(f->tokens);
    free(f->input);
    free(f->k);
    free(f->v);
    free(f->ck);
    free(f->cv);
    free(f->q);
    free(f->quantization);
    free(f->state);
    free(f->ckpt_pos);
    *f = (struct kvfile){0};
}
