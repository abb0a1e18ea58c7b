/* gguf.c - a GGUF v3 file, mapped and checked (see gguf.h).
 *
 * Layout (llama.cpp's docs/gguf.md): "GGUF", u32 version, u64 tensor count,
 * u64 metadata count; the metadata (string key, u32 value type, value;
 * strings are a u64 length and bytes, arrays a u32 element type, a u64
 * count and the elements); the tensor infos (name, u32 rank, u64 ne[rank],
 * u32 ggml type, u64 offset in the data section); padding to the
 * alignment (general.alignment, else 32); the data section.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/gguf.h"
#include "util/file.h"
#include "util/q4k.h"
#include "util/q6k.h"
#include "util/q8.h"

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "GGUF files are read in place as little-endian");

#define GGUF_VERSION 3
#define GGUF_DEFAULT_ALIGNMENT 32
/* Bounds no real file comes near (llama.cpp's largest vocabularies put
 * ~260k strings in one array; a model has a few thousand tensors); they
 * keep a hostile count from sizing an allocation. */
#define MAX_KV 65536
#define MAX_TENSORS (1 << 20)
#define MAX_KEY 65535
#define MAX_NAME 255

static void q8_0_to_f32(const void *blocks, float *out, size_t n)
{
    q8_0_dequantize(blocks, out, n);
}

static void q4_k_to_f32(const void *blocks, float *out, size_t n)
{
    q4_k_dequantize(blocks, out, n);
}

static void q6_k_to_f32(const void *blocks, float *out, size_t n)
{
    q6_k_dequantize(blocks, out, n);
}

/* The tensor types the loader binds; others are refused by number and
 * tensor name.  One line adds a type the kernels take (a block format
 * with its dequantizer). */
static const struct gguf_type GGUF_TYPES[] = {
    {0, 1, 4, {"F32", 4, BE_F32}, NULL},
    {1, 1, 2, {"F16", 2, BE_F16}, NULL},
    {8, Q8_0_BLOCK, sizeof(struct q8_0_block), {"Q8_0", 0, BE_Q8_0}, q8_0_to_f32},
    {GGML_TYPE_Q4_K, Q4_K_BLOCK, sizeof(struct q4_k_block), {"Q4_K", 0, BE_Q4_K}, q4_k_to_f32},
    {30, 1, 2, {"BF16", 2, BE_BF16}, NULL},
    /* no kernel reads it (be -1): gguf_files_open requantizes it to Q8_0 */
    {GGML_TYPE_Q6_K, Q6_K_BLOCK, sizeof(struct q6_k_block), {"Q6_K", 0, -1}, q6_k_to_f32},
};

const struct gguf_type *gguf_block_type(int be)
{
    for (size_t i = 0; i < sizeof GGUF_TYPES / sizeof GGUF_TYPES[0]; i++)
        if (GGUF_TYPES[i].dt.be == be && GGUF_TYPES[i].to_f32)
            return &GGUF_TYPES[i];
    return NULL;
}

/* Bytes of one scalar metadata value; 0 for strings and arrays. */
static uint64_t scalar_size(uint32_t t)
{
    static const uint8_t size[] = {[GGUF_U8] = 1, [GGUF_I8] = 1, [GGUF_U16] = 2, [GGUF_I16] = 2, [GGUF_U32] = 4,
                                   [GGUF_I32] = 4, [GGUF_F32] = 4, [GGUF_BOOL] = 1, [GGUF_STR] = 0, [GGUF_ARR] = 0,
                                   [GGUF_U64] = 8, [GGUF_I64] = 8, [GGUF_F64] = 8};
    return t < sizeof size ? size[t] : 0;
}

bool model_is_gguf(const char *path)
{
    struct stat sb;
    if (stat(path, &sb) == 0)
        return !S_ISDIR(sb.st_mode);
    size_t n = strlen(path); /* a missing x.gguf is reported as that file */
    return n > 5 && !strcmp(path + n - 5, ".gguf");
}

/* ---- the cursor ---------------------------------------------------------- */

struct cur {
    const struct gguf *g;
    uint64_t pos;
    char *err;
};

/* Fails unless n more bytes are there; what names the field. */
static enum model_status need(struct cur *c, uint64_t n, const char *what)
{
    if (n > c->g->size - c->pos)
        return model_errf(c->err, MODEL_EFORMAT, "%s: truncated: %s at byte %llu needs %llu bytes, %llu left",
                          c->g->name, what, (unsigned long long)c->pos, (unsigned long long)n,
                          (unsigned long long)(c->g->size - c->pos));
    return MODEL_OK;
}

static enum model_status rd(struct cur *c, void *out, uint64_t n, const char *what)
{
    enum model_status st = need(c, n, what);
    if (st == MODEL_OK) {
        memcpy(out, c->g->map + c->pos, n);
        c->pos += n;
    }
    return st;
}

static enum model_status rd_str(struct cur *c, struct gguf_str *s, uint64_t max, const char *what)
{
    enum model_status st = rd(c, &s->n, 8, what);
    if (st != MODEL_OK)
        return st;
    if (s->n > max)
        return model_errf(c->err, MODEL_EFORMAT, "%s: %s at byte %llu: length %llu exceeds %llu", c->g->name, what,
                          (unsigned long long)(c->pos - 8), (unsigned long long)s->n, (unsigned long long)max);
    if ((st = need(c, s->n, what)))
        return st;
    s->p = (const char *)c->g->map + c->pos;
    c->pos += s->n;
    return MODEL_OK;
}

/* ---- metadata ------------------------------------------------------------ */

static enum model_status read_value(struct cur *c, struct gguf_kv *kv, char *what)
{
    enum model_status st;
    if (kv->type == GGUF_STR) {
        struct gguf_str s;
        return rd_str(c, &s, UINT64_MAX, what);
    }
    if (kv->type != GGUF_ARR) {
        uint64_t n = scalar_size(kv->type);
        if (!n)
            return model_errf(c->err, MODEL_EFORMAT, "%s: %s: unknown value type %u", c->g->name, what, kv->type);
        if ((st = need(c, n, what)))
            return st;
        c->pos += n;
        return MODEL_OK;
    }
    if ((st = rd(c, &kv->arr_type, 4, what)) || (st = rd(c, &kv->n, 8, what)))
        return st;
    kv->val = c->g->map + c->pos;
    uint64_t left = c->g->size - c->pos;
    if (kv->arr_type == GGUF_STR) {
        /* each string takes at least its 8-byte length */
        if (kv->n > left / 8)
            return model_errf(c->err, MODEL_EFORMAT, "%s: %s: %llu strings cannot fit the %llu bytes left",
                              c->g->name, what, (unsigned long long)kv->n, (unsigned long long)left);
        for (uint64_t i = 0; i < kv->n; i++) {
            struct gguf_str s;
            if ((st = rd_str(c, &s, UINT64_MAX, what)))
                return st;
        }
        return MODEL_OK;
    }
    uint64_t es = scalar_size(kv->arr_type);
    if (!es)
        return model_errf(c->err, MODEL_EFORMAT, "%s: %s: array of element type %u (nested arrays are not read)",
                          c->g->name, what, kv->arr_type);
    if (kv->n > left / es)
        return model_errf(c->err, MODEL_EFORMAT, "%s: %s: %llu elements of %llu bytes cannot fit the %llu bytes left",
                          c->g->name, what, (unsigned long long)kv->n, (unsigned long long)es,
                          (unsigned long long)left);
    c->pos += kv->n * es;
    return MODEL_OK;
}

static int kv_cmp_key(const struct gguf_str *a, const struct gguf_str *b)
{
    int r = memcmp(a->p, b->p, a->n < b->n ? a->n : b->n);
    return r ? r : (a->n > b->n) - (a->n < b->n);
}

static int kv_cmp(const void *a, const void *b)
{
    return kv_cmp_key(&((const struct gguf_kv *)a)->key, &((const struct gguf_kv *)b)->key);
}

static enum model_status read_kvs(struct cur *c, struct gguf *g)
{
    enum model_status st;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        struct gguf_kv *kv = &g->kv[i];
        char what[160];
        snprintf(what, sizeof what, "metadata entry %llu's key", (unsigned long long)i);
        if ((st = rd_str(c, &kv->key, MAX_KEY, what)))
            return st;
        snprintf(what, sizeof what, "metadata \"%.*s\"", (int)(kv->key.n > 80 ? 80 : kv->key.n), kv->key.p);
        kv->at = c->pos;
        if ((st = rd(c, &kv->type, 4, what)))
            return st;
        kv->val = g->map + c->pos;
        if ((st = read_value(c, kv, what)))
            return st;
    }
    qsort(g->kv, g->n_kv, sizeof *g->kv, kv_cmp);
    for (uint64_t i = 1; i < g->n_kv; i++)
        if (!kv_cmp(&g->kv[i - 1], &g->kv[i]))
            return model_errf(c->err, MODEL_EFORMAT, "%s: metadata key \"%.*s\" appears twice", g->name,
                              (int)(g->kv[i].key.n > 80 ? 80 : g->kv[i].key.n), g->kv[i].key.p);
    return MODEL_OK;
}

const struct gguf_kv *gguf_find(const struct gguf *g, const char *key)
{
    struct gguf_kv k = {.key = {key, strlen(key)}};
    return bsearch(&k, g->kv, g->n_kv, sizeof k, kv_cmp);
}

/* ---- tensor infos -------------------------------------------------------- */

static const struct gguf_type *type_of(uint32_t id)
{
    for (size_t i = 0; i < sizeof GGUF_TYPES / sizeof GGUF_TYPES[0]; i++)
        if (GGUF_TYPES[i].id == id)
            return &GGUF_TYPES[i];
    return NULL;
}

static enum model_status read_tensor(struct cur *c, struct gguf *g, uint64_t i, char **names)
{
    struct gguf_tensor *t = &g->t[i];
    struct gguf_str name;
    char what[128];
    enum model_status st;
    snprintf(what, sizeof what, "tensor info %llu's name", (unsigned long long)i);
    if ((st = rd_str(c, &name, MAX_NAME, what)))
        return st;
    if (memchr(name.p, '\0', name.n) || !name.n)
        return model_errf(c->err, MODEL_EFORMAT, "%s: tensor info %llu: the name is empty or holds a NUL byte",
                          g->name, (unsigned long long)i);
    memcpy(*names, name.p, name.n);
    (*names)[name.n] = '\0';
    t->name = *names;
    *names += name.n + 1;
    uint32_t n_dims, type;
    snprintf(what, sizeof what, "tensor %s's rank", t->name);
    if ((st = rd(c, &n_dims, 4, what)))
        return st;
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return model_errf(c->err, MODEL_EFORMAT, "%s: tensor %s: rank %u outside [1, %d]", g->name, t->name, n_dims,
                          GGUF_MAX_DIMS);
    t->n_dims = (int)n_dims;
    uint64_t elems = 1;
    for (int d = 0; d < t->n_dims; d++) {
        snprintf(what, sizeof what, "tensor %s's ne[%d]", t->name, d);
        if ((st = rd(c, &t->ne[d], 8, what)))
            return st;
        if (t->ne[d] == 0 || t->ne[d] > INT32_MAX)
            return model_errf(c->err, MODEL_EFORMAT, "%s: tensor %s: ne[%d] = %llu outside [1, %d]", g->name,
                              t->name, d, (unsigned long long)t->ne[d], INT32_MAX);
        if (__builtin_mul_overflow(elems, t->ne[d], &elems))
            return model_errf(c->err, MODEL_EFORMAT, "%s: tensor %s: its element count overflows 64 bits", g->name,
                              t->name);
    }
    for (int d = t->n_dims; d < GGUF_MAX_DIMS; d++)
        t->ne[d] = 1;
    snprintf(what, sizeof what, "tensor %s's type", t->name);
    if ((st = rd(c, &type, 4, what)))
        return st;
    if (!(t->type = type_of(type)))
        return model_errf(c->err, MODEL_EUNSUPPORTED, "%s: tensor %s has unsupported type %u (supported: F32, F16, "
                          "BF16, Q8_0, Q4_K, Q6_K)", g->name, t->name, type);
    if (t->ne[0] % (uint64_t)t->type->block)
        return model_errf(c->err, MODEL_EFORMAT, "%s: tensor %s: rows of %llu elements are not whole %s blocks of %d",
                          g->name, t->name, (unsigned long long)t->ne[0], t->type->dt.name, t->type->block);
    if (__builtin_mul_overflow(elems / (uint64_t)t->type->block, (uint64_t)t->type->block_bytes, &t->bytes))
        return model_errf(c->err, MODEL_EFORMAT, "%s: tensor %s: its size overflows 64 bits", g->name, t->name);
    snprintf(what, sizeof what, "tensor %s's offset", t->name);
    if ((st = rd(c, &t->offset, 8, what)))
        return st;
    if (t->offset % g->alignment)
        return model_errf(c->err, MODEL_EFORMAT, "%s: tensor %s: offset %llu is not a multiple of the alignment %u",
                          g->name, t->name, (unsigned long long)t->offset, g->alignment);
    return MODEL_OK;
}

static int by_offset(const void *a, const void *b)
{
    const struct gguf_tensor *x = *(const struct gguf_tensor *const *)a, *y = *(const struct gguf_tensor *const *)b;
    return (x->offset > y->offset) - (x->offset < y->offset);
}

static int by_name(const void *a, const void *b)
{
    return strcmp((*(const struct gguf_tensor *const *)a)->name, (*(const struct gguf_tensor *const *)b)->name);
}

/* Every tensor inside the data section, none overlapping another, no name
 * twice. */
static enum model_status check_tensors(struct gguf *g, char *err)
{
    uint64_t data_size = g->size - g->data_off;
    for (uint64_t i = 0; i < g->n_t; i++) {
        const struct gguf_tensor *t = &g->t[i];
        if (t->offset > data_size || t->bytes > data_size - t->offset)
            return model_errf(err, MODEL_EFORMAT,
                              "%s: tensor %s: bytes [%llu, +%llu) run past the %llu-byte data section", g->name,
                              t->name, (unsigned long long)t->offset, (unsigned long long)t->bytes,
                              (unsigned long long)data_size);
    }
    const struct gguf_tensor **v = malloc((g->n_t ? g->n_t : 1) * sizeof *v);
    if (!v)
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory for %llu tensor infos", g->name,
                          (unsigned long long)g->n_t);
    for (uint64_t i = 0; i < g->n_t; i++)
        v[i] = &g->t[i];
    enum model_status st = MODEL_OK;
    qsort(v, g->n_t, sizeof *v, by_offset);
    for (uint64_t i = 1; i < g->n_t && st == MODEL_OK; i++)
        if (v[i]->offset < v[i - 1]->offset + v[i - 1]->bytes)
            st = model_errf(err, MODEL_EFORMAT, "%s: tensors %s and %s overlap", g->name, v[i - 1]->name, v[i]->name);
    qsort(v, g->n_t, sizeof *v, by_name);
    for (uint64_t i = 1; i < g->n_t && st == MODEL_OK; i++)
        if (!strcmp(v[i]->name, v[i - 1]->name))
            st = model_errf(err, MODEL_EFORMAT, "%s: tensor %s appears twice", g->name, v[i]->name);
    free(v);
    return st;
}

const struct gguf_tensor *gguf_tensor(const struct gguf *g, const char *name)
{
    for (uint64_t i = 0; i < g->n_t; i++)
        if (!strcmp(g->t[i].name, name))
            return &g->t[i];
    return NULL;
}

/* ---- the file ------------------------------------------------------------ */

static enum model_status parse(struct gguf *g, char *err)
{
    struct cur c = {.g = g, .err = err};
    char magic[4];
    uint32_t version;
    uint64_t n_t, n_kv;
    enum model_status st;
    if ((st = rd(&c, magic, 4, "the magic")))
        return st;
    if (memcmp(magic, "GGUF", 4))
        return model_errf(err, MODEL_EFORMAT, "%s: not a GGUF file (magic %02x %02x %02x %02x, \"GGUF\" expected)",
                          g->name, (unsigned char)magic[0], (unsigned char)magic[1], (unsigned char)magic[2],
                          (unsigned char)magic[3]);
    if ((st = rd(&c, &version, 4, "the version")))
        return st;
    if (version != GGUF_VERSION)
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: GGUF version %u (only version %d is read)", g->name, version,
                          GGUF_VERSION);
    if ((st = rd(&c, &n_t, 8, "the tensor count")) || (st = rd(&c, &n_kv, 8, "the metadata count")))
        return st;
    /* a metadata entry takes at least 13 bytes, a tensor info 28 */
    if (n_kv > MAX_KV || n_kv > (g->size - c.pos) / 13)
        return model_errf(err, MODEL_EFORMAT, "%s: metadata count %llu: more than the file or the limit of %d holds",
                          g->name, (unsigned long long)n_kv, MAX_KV);
    if (n_t > MAX_TENSORS || n_t > (g->size - c.pos) / 28)
        return model_errf(err, MODEL_EFORMAT, "%s: tensor count %llu: more than the file or the limit of %d holds",
                          g->name, (unsigned long long)n_t, MAX_TENSORS);
    g->n_kv = n_kv;
    if (!(g->kv = calloc(n_kv ? n_kv : 1, sizeof *g->kv)))
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory for %llu metadata entries", g->name,
                          (unsigned long long)n_kv);
    if ((st = read_kvs(&c, g)))
        return st;
    g->kv_end = c.pos;

    int64_t align = GGUF_DEFAULT_ALIGNMENT;
    if ((st = gguf_get_int(g, "general.alignment", false, 1, 1 << 30, &align, err)))
        return st;
    /* the spec's multiple of 8, and a power of two, as ggml's padding
     * arithmetic assumes; it is what keeps every tensor aligned in the map */
    if (align % 8 || (align & (align - 1)))
        return model_errf(err, MODEL_EFORMAT, "%s: general.alignment %lld is not a power of two of at least 8",
                          g->name, (long long)align);
    g->alignment = (uint32_t)align;

    g->n_t = n_t;
    g->t = calloc(n_t ? n_t : 1, sizeof *g->t);
    g->names = malloc(n_t * (MAX_NAME + 1) + 1); /* each name's bytes and its NUL */
    if (!g->t || !g->names)
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory for %llu tensor infos", g->name,
                          (unsigned long long)n_t);
    char *names = g->names;
    for (uint64_t i = 0; i < n_t; i++)
        if ((st = read_tensor(&c, g, i, &names)))
            return st;
    g->data_off = (c.pos + g->alignment - 1) / g->alignment * g->alignment;
    if (g->data_off > g->size)
        return model_errf(err, MODEL_EFORMAT, "%s: truncated: the data section would start at byte %llu of %zu",
                          g->name, (unsigned long long)g->data_off, g->size);
    return check_tensors(g, err);
}

enum model_status gguf_open(const char *path, struct gguf **out, char *err)
{
    *out = NULL;
    struct gguf *g = calloc(1, sizeof *g);
    if (!g || !(g->name = strdup(path))) {
        free(g);
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory", path);
    }
    struct stat sb;
    int fd = file_open_regular(path, &sb);
    enum model_status st = MODEL_OK;
    if (fd == FILE_NOT_REGULAR)
        st = model_errf(err, MODEL_EFORMAT, "%s: not a regular file", path);
    else if (fd < 0)
        st = model_errf(err, errno == ENOENT ? MODEL_ENOENT : MODEL_EIO, "%s: %s", path, strerror(errno));
    else if (sb.st_size < 24)
        st = model_errf(err, MODEL_EFORMAT, "%s: truncated: %lld bytes, shorter than the 24-byte GGUF header", path,
                        (long long)sb.st_size);
    if (st == MODEL_OK) {
        g->map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (g->map == MAP_FAILED) {
            g->map = NULL;
            st = model_errf(err, errno == ENOMEM ? MODEL_ENOMEM : MODEL_EIO, "%s: mmap: %s", path, strerror(errno));
        } else {
            g->size = (size_t)sb.st_size;
        }
    }
    if (fd >= 0)
        close(fd);
    if (st == MODEL_OK)
        st = parse(g, err);
    if (st != MODEL_OK) {
        gguf_close(g);
        return st;
    }
    *out = g;
    return MODEL_OK;
}

void gguf_close(struct gguf *g)
{
    if (!g)
        return;
    if (g->map)
        munmap(g->map, g->size);
    free(g->kv);
    free(g->t);
    free(g->names);
    free(g->name);
    free(g);
}

/* ---- typed reads --------------------------------------------------------- */

static enum model_status lookup(const struct gguf *g, const char *key, bool required, const struct gguf_kv **kv,
                                char *err)
{
    *kv = gguf_find(g, key);
    if (!*kv && required)
        return model_errf(err, MODEL_ECONFIG, "%s: metadata %s is missing", g->name, key);
    return MODEL_OK;
}

static enum model_status wrong_type(const struct gguf *g, const char *key, const struct gguf_kv *kv,
                                    const char *want, char *err)
{
    return model_errf(err, MODEL_ECONFIG, "%s: metadata %s (byte %llu) has value type %u, %s expected", g->name, key,
                      (unsigned long long)kv->at, kv->type, want);
}

enum model_status gguf_get_int(const struct gguf *g, const char *key, bool required, int64_t lo, int64_t hi,
                               int64_t *out, char *err)
{
    const struct gguf_kv *kv;
    enum model_status st = lookup(g, key, required, &kv, err);
    if (st != MODEL_OK || !kv)
        return st;
    int64_t v;
    const uint8_t *p = kv->val;
    uint64_t u;
    switch (kv->type) {
    case GGUF_U8: v = p[0]; break;
    case GGUF_I8: v = (int8_t)p[0]; break;
    case GGUF_U16: { uint16_t x; memcpy(&x, p, 2); v = x; break; }
    case GGUF_I16: { int16_t x; memcpy(&x, p, 2); v = x; break; }
    case GGUF_U32: { uint32_t x; memcpy(&x, p, 4); v = x; break; }
    case GGUF_I32: { int32_t x; memcpy(&x, p, 4); v = x; break; }
    case GGUF_I64: memcpy(&v, p, 8); break;
    case GGUF_U64:
        memcpy(&u, p, 8);
        v = u > INT64_MAX ? INT64_MAX : (int64_t)u;
        break;
    default: return wrong_type(g, key, kv, "an integer", err);
    }
    if (v < lo || v > hi)
        return model_errf(err, MODEL_ECONFIG, "%s: metadata %s = %lld out of range [%lld, %lld]", g->name, key,
                          (long long)v, (long long)lo, (long long)hi);
    *out = v;
    return MODEL_OK;
}

enum model_status gguf_get_float(const struct gguf *g, const char *key, bool required, double *out, char *err)
{
    const struct gguf_kv *kv;
    enum model_status st = lookup(g, key, required, &kv, err);
    if (st != MODEL_OK || !kv)
        return st;
    if (kv->type == GGUF_F32) {
        float f;
        memcpy(&f, kv->val, 4);
        *out = f;
    } else if (kv->type == GGUF_F64) {
        memcpy(out, kv->val, 8);
    } else {
        return wrong_type(g, key, kv, "a float", err);
    }
    /* every float key is a hyperparameter, which arithmetic and the config's JSON need finite */
    if (!isfinite(*out))
        return model_errf(err, MODEL_EFORMAT, "%s: %s is not finite (%g)", g->name, key, *out);
    return MODEL_OK;
}

enum model_status gguf_get_bool(const struct gguf *g, const char *key, bool required, bool *out, char *err)
{
    const struct gguf_kv *kv;
    enum model_status st = lookup(g, key, required, &kv, err);
    if (st != MODEL_OK || !kv)
        return st;
    if (kv->type != GGUF_BOOL)
        return wrong_type(g, key, kv, "a bool", err);
    *out = kv->val[0] != 0;
    return MODEL_OK;
}

enum model_status gguf_get_str(const struct gguf *g, const char *key, bool required, struct gguf_str *out,
                               char *err)
{
    const struct gguf_kv *kv;
    enum model_status st = lookup(g, key, required, &kv, err);
    if (st != MODEL_OK || !kv)
        return st;
    if (kv->type != GGUF_STR)
        return wrong_type(g, key, kv, "a string", err);
    const uint8_t *p = kv->val;
    *out = gguf_next_str(&p);
    return MODEL_OK;
}

enum model_status gguf_get_arr(const struct gguf *g, const char *key, bool required, uint32_t elem_type,
                               const struct gguf_kv **out, char *err)
{
    enum model_status st = lookup(g, key, required, out, err);
    if (st != MODEL_OK || !*out)
        return st;
    if ((*out)->type != GGUF_ARR || (*out)->arr_type != elem_type) {
        char want[48];
        snprintf(want, sizeof want, "an array of value type %u", elem_type);
        st = wrong_type(g, key, *out, want, err);
        *out = NULL;
    }
    return st;
}

struct gguf_str gguf_next_str(const uint8_t **pos)
{
    struct gguf_str s;
    memcpy(&s.n, *pos, 8);
    s.p = (const char *)*pos + 8;
    *pos += 8 + s.n;
    return s;
}
