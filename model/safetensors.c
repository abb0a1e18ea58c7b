/* safetensors.c - maps model.safetensors (or the shards that
 * model.safetensors.index.json names), validates every header against the
 * file before trusting it, and binds the tensors a config needs by their
 * Hugging Face names.
 *
 * File layout: u64 little-endian header length N, N bytes of JSON
 * {name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {...}},
 * then the data section the offsets are relative to.
 *
 * Alignment: the format promises none, but kernels read matrices in place
 * as typed f32/f16/bf16 arrays.  A matrix whose address in the map is not a
 * multiple of its element size is therefore copied into an owned buffer;
 * files written by the safetensors library pad the header to 8 bytes, so
 * real checkpoints are read in place.
 *
 * The maps are shared with the page cache: a checkpoint must not be rewritten
 * in place while a model uses it (a truncated mapping faults on access).
 */
#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <xxhash.h>

#include "util/half.h"
#include "util/q4k.h"
#include "util/q8.h"
#include "model/model.h"
#include "model/gguf.h"
#include "model/safetensors.h"
#include "util/file.h"

/* Tensor bytes are used in place as host numbers. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian");
_Static_assert(BE_F32 == 0 && BE_F16 == 1 && BE_BF16 == 2, "DTYPES starts in be_dtype order");

#define INDEX_NAME "model.safetensors.index.json"
#define SINGLE_NAME "model.safetensors"
/* The cap the safetensors library itself puts on the header. */
#define HEADER_MAX ((uint64_t)100 << 20)

/* Every dtype the format defines, so extra tensors we never bind still get
 * their sizes checked; be < 0 marks the ones we cannot compute with.  The
 * first three are indexed by enum be_dtype. */
static const struct st_dtype DTYPES[] = {
    {"F32", 4, BE_F32},   {"F16", 2, BE_F16},  {"BF16", 2, BE_BF16}, {"F64", 8, -1},    {"I64", 8, -1},
    {"U64", 8, -1},       {"I32", 4, -1},      {"U32", 4, -1},       {"I16", 2, -1},    {"U16", 2, -1},
    {"I8", 1, -1},        {"U8", 1, -1},       {"BOOL", 1, -1},      {"F8_E5M2", 1, -1}, {"F8_E4M3", 1, -1},
};

/* ---- one file ------------------------------------------------------------- */

static int cmp_by_offset(const void *a, const void *b)
{
    const struct st_tensor *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return (x->end > y->end) - (x->end < y->end);
}

static int cmp_by_name(const void *a, const void *b)
{
    return strcmp(((const struct st_tensor *)a)->name, ((const struct st_tensor *)b)->name);
}

static const struct st_tensor *st_find(const struct st_file *f, const char *name)
{
    struct st_tensor key = {.name = name};
    return bsearch(&key, f->tensors, f->n_tensors, sizeof key, cmp_by_name);
}

/* Reads a non-negative JSON integer as u64. */
static bool json_u64(json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

/* Parses one header entry and checks it against the data section. */
static enum model_status parse_tensor(const struct st_file *f, const char *name, json_t *v, struct st_tensor *t,
                                      char *err)
{
    t->name = name;
    const char *dt = json_string_value(json_object_get(v, "dtype"));
    json_t *shape = json_object_get(v, "shape");
    json_t *offs = json_object_get(v, "data_offsets");
    if (!json_is_object(v) || !dt || !json_is_array(shape) || json_array_size(offs) != 2)
        return model_errf(err, MODEL_EFORMAT, "%s: tensor %s: header entry needs dtype, shape and data_offsets",
                          f->name, name);
    t->dtype = NULL;
    for (size_t i = 0; i < sizeof DTYPES / sizeof DTYPES[0]; i++)
        if (strcmp(dt, DTYPES[i].name) == 0)
            t->dtype = &DTYPES[i];
    if (!t->dtype)
        return model_errf(err, MODEL_EUNSUPPORTED, "%s: tensor %s: unknown dtype \"%s\"", f->name, name, dt);
    if (json_array_size(shape) > MAX_RANK)
        return model_errf(err, MODEL_EFORMAT, "%s: tensor %s: rank %zu exceeds %d", f->name, name,
                          json_array_size(shape), MAX_RANK);
    t->rank = (int)json_array_size(shape);
    uint64_t bytes = t->dtype->size;
    for (int d = 0; d < t->rank; d++) {
        if (!json_u64(json_array_get(shape, (size_t)d), &t->shape[d]))
            return model_errf(err, MODEL_EFORMAT, "%s: tensor %s: shape[%d] is not a non-negative integer", f->name,
                              name, d);
        if (__builtin_mul_overflow(bytes, t->shape[d], &bytes))
            return model_errf(err, MODEL_EFORMAT, "%s: tensor %s: shape overflows 64 bits", f->name, name);
    }
    if (!json_u64(json_array_get(offs, 0), &t->begin) || !json_u64(json_array_get(offs, 1), &t->end))
        return model_errf(err, MODEL_EFORMAT, "%s: tensor %s: data_offsets are not non-negative integers", f->name,
                          name);
    if (t->begin > t->end || t->end > f->data_size)
        return model_errf(err, MODEL_EFORMAT,
                          "%s: tensor %s: data_offsets [%llu, %llu) out of range of the %llu-byte data section",
                          f->name, name, (unsigned long long)t->begin, (unsigned long long)t->end,
                          (unsigned long long)f->data_size);
    if (t->end - t->begin != bytes)
        return model_errf(err, MODEL_EFORMAT,
                          "%s: tensor %s: data_offsets span %llu bytes but its shape and dtype %s need %llu", f->name,
                          name, (unsigned long long)(t->end - t->begin), dt, (unsigned long long)bytes);
    return MODEL_OK;
}

/* Fills f->tensors from the header, rejecting overlapping data (gaps are
 * allowed: writers may pad tensors for alignment). */
static enum model_status parse_header(struct st_file *f, char *err)
{
    size_t n = json_object_size(f->header);
    f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
    if (!f->tensors)
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory for %zu tensor entries", f->name, n);
    const char *name;
    json_t *v;
    json_object_foreach(f->header, name, v)
    {
        if (strcmp(name, "__metadata__") == 0)
            continue;
        enum model_status st = parse_tensor(f, name, v, &f->tensors[f->n_tensors], err);
        if (st != MODEL_OK)
            return st;
        f->n_tensors++;
    }
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, cmp_by_offset);
    for (size_t i = 1; i < f->n_tensors; i++) {
        const struct st_tensor *a = &f->tensors[i - 1], *b = &f->tensors[i];
        if (b->begin < a->end)
            return model_errf(err, MODEL_EFORMAT, "%s: tensors %s [%llu, %llu) and %s [%llu, %llu) overlap", f->name,
                              a->name, (unsigned long long)a->begin, (unsigned long long)a->end, b->name,
                              (unsigned long long)b->begin, (unsigned long long)b->end);
    }
    qsort(f->tensors, f->n_tensors, sizeof *f->tensors, cmp_by_name);
    return MODEL_OK;
}

/* Maps dir/name read-only and parses its header.  f->name is set first so
 * the caller can close a half-opened file. */
static enum model_status st_open(const char *dir, const char *name, struct st_file *f, char *err)
{
    char path[PATH_MAX];
    enum model_status st = model_path(path, dir, name, err);
    if (st != MODEL_OK)
        return st;
    if (!(f->name = strdup(name)))
        return model_errf(err, MODEL_ENOMEM, "%s: out of memory", name);
    struct stat sb;
    int fd = file_open_regular(path, &sb);
    if (fd == FILE_NOT_REGULAR)
        return model_errf(err, MODEL_EFORMAT, "%s: not a regular file", name);
    if (fd < 0)
        return errno == ENOENT ? model_errf(err, MODEL_ENOENT, "%s: missing in %s", name, dir)
                               : model_errf(err, MODEL_EIO, "%s: %s", path, strerror(errno));
    if (sb.st_size < 8) {
        st = model_errf(err, MODEL_EFORMAT, "%s: truncated: %lld bytes, shorter than the 8-byte header length",
                        name, (long long)sb.st_size);
    } else {
        f->map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (f->map == MAP_FAILED) {
            f->map = NULL;
            st = model_errf(err, errno == ENOMEM ? MODEL_ENOMEM : MODEL_EIO, "%s: mmap: %s", name, strerror(errno));
        } else {
            f->map_size = (size_t)sb.st_size;
        }
    }
    close(fd);
    if (st != MODEL_OK)
        return st;
    /* Every byte will be read while the weights are bound or at the first
     * forward; start the read-ahead now.  Advice only: failure is harmless. */
    madvise(f->map, f->map_size, MADV_WILLNEED);

    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | f->map[i];
    if (hlen > f->map_size - 8)
        return model_errf(err, MODEL_EFORMAT, "%s: header length %llu runs past the end of the %zu-byte file", name,
                          (unsigned long long)hlen, f->map_size);
    if (hlen > HEADER_MAX)
        return model_errf(err, MODEL_EFORMAT, "%s: header length %llu exceeds the %llu-byte limit", name,
                          (unsigned long long)hlen, (unsigned long long)HEADER_MAX);
    f->data = f->map + 8 + hlen;
    f->data_size = f->map_size - 8 - hlen;
    json_error_t je;
    f->header = json_loadb((const char *)f->map + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!f->header)
        return json_error_code(&je) == json_error_out_of_memory
                   ? model_errf(err, MODEL_ENOMEM, "%s: out of memory parsing the header", name)
                   : model_errf(err, MODEL_EFORMAT, "%s: header JSON at byte %d: %s", name, je.position, je.text);
    if (!json_is_object(f->header))
        return model_errf(err, MODEL_EFORMAT, "%s: header is not a JSON object", name);
    return parse_header(f, err);
}

/* What binding needs no longer once it is done. */
static void st_drop_header(struct st_file *f)
{
    free(f->tensors);
    f->tensors = NULL;
    f->n_tensors = 0;
    json_decref(f->header);
    f->header = NULL;
}

static void st_close(struct st_file *f)
{
    st_drop_header(f);
    if (f->map)
        munmap(f->map, f->map_size);
    free(f->name);
}

/* ---- the files of a directory --------------------------------------------- */

void model_files_close(model_files *mf)
{
    if (!mf)
        return;
    for (int i = 0; i < mf->n_files; i++)
        st_close(&mf->files[i]);
    for (int i = 0; i < mf->n_copies; i++)
        free(mf->copies[i]);
    free(mf->files);
    free(mf->copies);
    free(mf->vectors);
    free(mf->layers);
    free(mf);
}

uint64_t model_files_bytes(const model_files *mf)
{
    uint64_t n = 0;
    for (int i = 0; mf && i < mf->n_files; i++)
        n += mf->files[i].map_size;
    return n;
}

/* One chunk of a mapping into memory and into the page tables.
 * MADV_POPULATE_READ (Linux 5.14) reports an unreadable page as an error;
 * on older kernels one load per page does the same, where an I/O error
 * would be a SIGBUS, as it would be in the forward pass. */
static int populate(const unsigned char *p, size_t n)
{
#ifdef MADV_POPULATE_READ
    if (madvise((void *)p, n, MADV_POPULATE_READ) == 0)
        return 0;
    if (errno != EINVAL)
        return -1;
#endif
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    unsigned sum = 0;
    for (size_t o = 0; o < n; o += page)
        sum += ((const volatile unsigned char *)p)[o];
    (void)sum;
    return 0;
}

enum model_status model_files_page_in(const model_files *mf, model_progress_fn progress, void *arg, char *err)
{
    uint64_t total = model_files_bytes(mf), done = 0;
    if (progress)
        progress(arg, 0, total);
    for (int i = 0; i < mf->n_files; i++) {
        const struct st_file *f = &mf->files[i];
        for (size_t o = 0; o < f->map_size; o += MODEL_PAGE_IN_CHUNK) {
            size_t n = f->map_size - o < MODEL_PAGE_IN_CHUNK ? f->map_size - o : MODEL_PAGE_IN_CHUNK;
            if (populate(f->map + o, n) != 0)
                return model_errf(err, MODEL_EIO, "%s: reading bytes %zu to %zu: %s", f->name, o, o + n,
                                  strerror(errno));
            done += n;
            if (progress)
                progress(arg, done, total);
        }
    }
    return MODEL_OK;
}

static struct st_file *file_named(model_files *mf, const char *name)
{
    for (int i = 0; i < mf->n_files; i++)
        if (strcmp(mf->files[i].name, name) == 0)
            return &mf->files[i];
    return NULL;
}

/* A shard name from the index must stay inside the model directory, and
 * be a name a file can have (open would say ENAMETOOLONG, an I/O error). */
static bool shard_name_ok(const char *s)
{
    return s[0] && strlen(s) <= NAME_MAX && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

/* Opens every shard the weight map names, each once. */
static enum model_status open_shards(model_files *mf, const char *dir, json_t *map, char *err)
{
    if (!json_is_object(map))
        return model_errf(err, MODEL_EFORMAT, INDEX_NAME ": missing weight_map object");
    mf->files = calloc(json_object_size(map) ? json_object_size(map) : 1, sizeof *mf->files);
    if (!mf->files)
        return model_errf(err, MODEL_ENOMEM, INDEX_NAME ": out of memory for the shard table");
    const char *tensor;
    json_t *v;
    json_object_foreach(map, tensor, v)
    {
        const char *shard = json_string_value(v);
        if (!shard || !shard_name_ok(shard))
            return model_errf(err, MODEL_EFORMAT, INDEX_NAME ": weight_map[%s] is not a file name in the directory",
                              tensor);
        if (file_named(mf, shard))
            continue;
        enum model_status st = st_open(dir, shard, &mf->files[mf->n_files++], err);
        if (st != MODEL_OK)
            return st;
    }
    return MODEL_OK;
}

/* model.safetensors when present (transformers prefers it too), else the
 * shards of model.safetensors.index.json. */
static enum model_status open_files(model_files *mf, const char *dir, json_t **weight_map, char *err)
{
    char path[PATH_MAX];
    enum model_status st = model_path(path, dir, SINGLE_NAME, err);
    *weight_map = NULL;
    if (st != MODEL_OK)
        return st;
    if (access(path, F_OK) == 0 || errno != ENOENT) {
        if (!(mf->files = calloc(1, sizeof *mf->files)))
            return model_errf(err, MODEL_ENOMEM, SINGLE_NAME ": out of memory");
        mf->n_files = 1;
        return st_open(dir, SINGLE_NAME, &mf->files[0], err);
    }
    json_t *index;
    if ((st = model_json_load(dir, INDEX_NAME, true, &index, err)))
        return st;
    if (!index)
        return model_errf(err, MODEL_ENOENT, SINGLE_NAME " and " INDEX_NAME ": both missing in %s", dir);
    *weight_map = json_incref(json_object_get(index, "weight_map"));
    json_decref(index);
    return open_shards(mf, dir, *weight_map, err);
}

/* ---- binding --------------------------------------------------------------- */

struct binder {
    model_files *mf;
    const struct model_config *cfg;
    json_t *weight_map; /* NULL: the single model.safetensors */
    float *next_vector; /* where the next 1-D tensor's f32 copy goes */
    bool gguf;          /* model_files_bind's: llama.cpp's layout */
    char *err;
};

static enum model_status locate(const struct binder *b, const char *name, const struct st_file **file,
                                const struct st_tensor **t)
{
    const struct st_file *f = &b->mf->files[0];
    if (b->weight_map) {
        const char *shard = json_string_value(json_object_get(b->weight_map, name));
        if (!shard)
            return model_errf(b->err, MODEL_EFORMAT, INDEX_NAME ": weight_map has no tensor %s", name);
        f = file_named(b->mf, shard);
    }
    /* a GGUF's requantized tensors are a second table (gguf_files_open) */
    for (int i = 1; !b->weight_map && i < b->mf->n_files && !st_find(f, name); i++)
        f = &b->mf->files[i];
    *file = f;
    *t = st_find(f, name);
    if (!*t)
        return model_errf(b->err, MODEL_EFORMAT, "%s: missing tensor %s", f->name, name);
    return MODEL_OK;
}

static void format_shape(const struct st_tensor *t, char *buf, size_t size)
{
    size_t len = (size_t)snprintf(buf, size, "[");
    for (int d = 0; d < t->rank && len < size; d++)
        len += (size_t)snprintf(buf + len, size - len, "%s%llu", d ? ", " : "", (unsigned long long)t->shape[d]);
    if (len < size)
        snprintf(buf + len, size - len, "]");
}

/* Finds a tensor and checks that it has a computable dtype and the shape
 * (rows[, cols]) the config implies. */
static enum model_status find_checked(const struct binder *b, const char *name, int rows, int cols,
                                      const struct st_file **file, const struct st_tensor **t)
{
    enum model_status st = locate(b, name, file, t);
    if (st != MODEL_OK)
        return st;
    const struct st_tensor *x = *t;
    if (x->dtype->be < 0)
        return model_errf(b->err, MODEL_EUNSUPPORTED, "%s: tensor %s has dtype %s (supported: F32, F16, BF16)",
                          (*file)->name, name, x->dtype->name);
    if (!cols && !x->dtype->size)
        return model_errf(b->err, MODEL_EUNSUPPORTED, "%s: tensor %s is %s; a vector must be F32, F16 or BF16",
                          (*file)->name, name, x->dtype->name);
    bool ok = cols ? x->rank == 2 && x->shape[0] == (uint64_t)rows && x->shape[1] == (uint64_t)cols
                   : x->rank == 1 && x->shape[0] == (uint64_t)rows;
    if (!ok) {
        char shape[160], want[48];
        format_shape(x, shape, sizeof shape);
        if (cols)
            snprintf(want, sizeof want, "[%d, %d]", rows, cols);
        else
            snprintf(want, sizeof want, "[%d]", rows);
        return model_errf(b->err, MODEL_EFORMAT, "%s: tensor %s has shape %s, config.json implies %s", (*file)->name,
                          name, shape, want);
    }
    return MODEL_OK;
}

static enum model_status bind_mat(struct binder *b, const char *name, int rows, int cols, struct model_mat *m)
{
    const struct st_file *f;
    const struct st_tensor *t;
    enum model_status st = find_checked(b, name, rows, cols, &f, &t);
    if (st != MODEL_OK)
        return st;
    /* One dtype per checkpoint: the kernels, the memory budget and the
     * reference all take torch_dtype at its word. */
    if (!b->gguf && t->dtype->be != (int)b->cfg->dtype)
        return model_errf(b->err, MODEL_EFORMAT, "%s: tensor %s has dtype %s but config.json says %s", f->name, name,
                          t->dtype->name, DTYPES[b->cfg->dtype].name);
    const uint8_t *p = f->data + t->begin;
    size_t bytes = (size_t)(t->end - t->begin);
    /* a block format's rows need the 2-byte alignment of their f16
     * scales, which GGUF's alignment (gguf.c: a multiple of 8) gives */
    if (t->dtype->size && (uintptr_t)p % t->dtype->size != 0) {
        void *copy = malloc(bytes);
        if (!copy)
            return model_errf(b->err, MODEL_ENOMEM, "%s: out of memory for an aligned copy of %s (%zu bytes)",
                              f->name, name, bytes);
        memcpy(copy, p, bytes);
        if ((st = model_files_keep(b->mf, copy, b->err)))
            return st;
        p = copy;
    }
    *m = (struct model_mat){.data = p, .dtype = (enum be_dtype)t->dtype->be, .rows = rows, .cols = cols};
    return MODEL_OK;
}

/* The index of the first NaN or infinity of n elements of dtype dt, or n:
 * an all-ones exponent, read from the bits so the scan is one pass of
 * integer tests.  For the block formats (matrices a GGUF file holds as
 * they are), the first element of the first block whose f16 factors are
 * not finite: its codes cannot be. */
static size_t first_non_finite(const void *data, enum be_dtype dt, size_t n)
{
    if (dt == BE_Q4_K) {
        const struct q4_k_block *b = data;
        for (size_t i = 0; i < n / Q4_K_BLOCK; i++)
            if (!q4_k_check(&b[i], 1))
                return i * Q4_K_BLOCK;
        return n;
    }
    if (dt == BE_Q8_0) {
        const struct q8_0_block *b = data;
        for (size_t i = 0; i < n / Q8_0_BLOCK; i++)
            if ((b[i].d & 0x7C00u) == 0x7C00u)
                return i * Q8_0_BLOCK;
        return n;
    }
    if (dt == BE_F32) {
        const uint32_t *u = data;
        for (size_t i = 0; i < n; i++)
            if ((u[i] & 0x7F800000u) == 0x7F800000u)
                return i;
        return n;
    }
    const uint16_t *h = data; /* bound matrices are aligned to their element */
    uint16_t exp = dt == BE_F16 ? 0x7C00u : 0x7F80u;
    for (size_t i = 0; i < n; i++)
        if ((h[i] & exp) == exp)
            return i;
    return n;
}

/* Norm weights and biases are small and read by every token: they are kept
 * as f32 whatever the checkpoint's dtype, and checked for NaN and infinity
 * at every load (a few thousand values). */
static enum model_status vec_f32(struct binder *b, const struct st_file *f, const struct st_tensor *t, const char *name,
                                 int len, const float **out);

static enum model_status bind_vec(struct binder *b, const char *name, int len, const float **out)
{
    const struct st_file *f;
    const struct st_tensor *t;
    enum model_status st = find_checked(b, name, len, 0, &f, &t);
    return st != MODEL_OK ? st : vec_f32(b, f, t, name, len, out);
}

/* A small tensor of any shape (Mamba's conv1d.weight [inner, 1, kernel],
 * A_log [inner, state]) as an f32 copy of its len elements, shape[] of
 * rank dimensions checked as find_checked checks a vector's. */
static enum model_status bind_small(struct binder *b, const char *name, const int *shape, int rank, const float **out)
{
    const struct st_file *f;
    const struct st_tensor *t;
    enum model_status st = locate(b, name, &f, &t);
    if (st != MODEL_OK)
        return st;
    if (t->dtype->be < 0)
        return model_errf(b->err, MODEL_EUNSUPPORTED, "%s: tensor %s has dtype %s (supported: F32, F16, BF16)",
                          f->name, name, t->dtype->name);
    bool ok = t->rank == rank;
    int len = 1;
    for (int d = 0; d < rank && ok; d++) {
        ok = t->shape[d] == (uint64_t)shape[d];
        len *= shape[d];
    }
    if (!ok) {
        char have[160];
        format_shape(t, have, sizeof have);
        return model_errf(b->err, MODEL_EFORMAT, "%s: tensor %s has shape %s, config.json implies %d dimensions "
                          "[%d, ...]", f->name, name, have, rank, shape[0]);
    }
    return vec_f32(b, f, t, name, len, out);
}

/* The f32 copy of a bound tensor, checked for NaN and infinity. */
static enum model_status vec_f32(struct binder *b, const struct st_file *f, const struct st_tensor *t, const char *name,
                                 int len, const float **out)
{
    const uint8_t *src = f->data + t->begin;
    float *dst = b->next_vector;
    for (int i = 0; i < len; i++) {
        if (t->dtype->be == BE_F32) {
            memcpy(&dst[i], src + 4 * (size_t)i, 4);
        } else if (t->dtype->be == BE_F16) {
            uint16_t h;
            memcpy(&h, src + 2 * (size_t)i, 2);
            dst[i] = f16_to_f32(h);
        } else {
            /* bf16 is the top half of an f32. */
            uint32_t u = (uint32_t)(src[2 * (size_t)i] | src[2 * (size_t)i + 1] << 8) << 16;
            memcpy(&dst[i], &u, 4);
        }
    }
    size_t bad = first_non_finite(dst, BE_F32, (size_t)len);
    if (bad < (size_t)len)
        return model_errf(b->err, MODEL_EFORMAT, "%s: tensor %s has a non-finite value (%g) at index %zu", f->name,
                          name, dst[bad], bad);
    /* Gemma's RMSNorm scales by 1 + weight, in f32 as here; every norm's
     * name ends so, no bias's does.  llama.cpp's converter stores the sum. */
    size_t nl = strlen(name), sl = strlen("norm.weight");
    if (b->cfg->norm_plus_one && !b->gguf && nl >= sl && strcmp(name + nl - sl, "norm.weight") == 0)
        for (int i = 0; i < len; i++)
            dst[i] += 1.0f;
    b->next_vector += len;
    *out = dst;
    return MODEL_OK;
}

/* The sizes a per-layer tensor's dimensions come from. */
enum dim { D_DIM, D_QDIM, D_KVDIM, D_FFN, D_HEAD };

/* When a per-layer vector exists. */
enum need { ALWAYS, QKV_BIAS, O_BIAS, QK_NORM, PLAIN_NORMS, SANDWICH_NORMS, SPLIT_QKV, SPLIT_GATE_UP, FUSED_QKV,
            FUSED_GATE_UP };

static const struct layer_mat {
    const char *suffix;
    size_t off;
    enum dim rows, cols;
    enum need need;
} LAYER_MATS[] = {
    {"self_attn.q_proj.weight", offsetof(struct model_layer, wq), D_QDIM, D_DIM, SPLIT_QKV},
    {"self_attn.k_proj.weight", offsetof(struct model_layer, wk), D_KVDIM, D_DIM, SPLIT_QKV},
    {"self_attn.v_proj.weight", offsetof(struct model_layer, wv), D_KVDIM, D_DIM, SPLIT_QKV},
    {"self_attn.o_proj.weight", offsetof(struct model_layer, wo), D_DIM, D_QDIM, ALWAYS},
    {"mlp.gate_proj.weight", offsetof(struct model_layer, w_gate), D_FFN, D_DIM, SPLIT_GATE_UP},
    {"mlp.up_proj.weight", offsetof(struct model_layer, w_up), D_FFN, D_DIM, SPLIT_GATE_UP},
    {"mlp.down_proj.weight", offsetof(struct model_layer, w_down), D_DIM, D_FFN, ALWAYS},
};

/* Phi-3's fused projections: one tensor whose rows are the parts in
 * order; each part is bound as a view of its rows (no copy). */
static const struct layer_fused {
    const char *suffix;
    enum need need;
    int n;
    size_t off[3];
    enum dim rows[3];
} LAYER_FUSED[] = {
    {"self_attn.qkv_proj.weight", FUSED_QKV, 3,
     {offsetof(struct model_layer, wq), offsetof(struct model_layer, wk), offsetof(struct model_layer, wv)},
     {D_QDIM, D_KVDIM, D_KVDIM}},
    {"mlp.gate_up_proj.weight", FUSED_GATE_UP, 2,
     {offsetof(struct model_layer, w_gate), offsetof(struct model_layer, w_up)}, {D_FFN, D_FFN}},
};

static const struct layer_vec {
    const char *suffix;
    size_t off;
    enum dim len;
    enum need need;
} LAYER_VECS[] = {
    {"input_layernorm.weight", offsetof(struct model_layer, attn_norm), D_DIM, ALWAYS},
    {"post_attention_layernorm.weight", offsetof(struct model_layer, ffn_norm), D_DIM, PLAIN_NORMS},
    /* Gemma: the same name is the attention output's norm; the MLP's input
     * norm is pre_feedforward_layernorm */
    {"post_attention_layernorm.weight", offsetof(struct model_layer, post_attn_norm), D_DIM, SANDWICH_NORMS},
    {"pre_feedforward_layernorm.weight", offsetof(struct model_layer, ffn_norm), D_DIM, SANDWICH_NORMS},
    {"post_feedforward_layernorm.weight", offsetof(struct model_layer, post_ffn_norm), D_DIM, SANDWICH_NORMS},
    {"self_attn.q_proj.bias", offsetof(struct model_layer, bq), D_QDIM, QKV_BIAS},
    {"self_attn.k_proj.bias", offsetof(struct model_layer, bk), D_KVDIM, QKV_BIAS},
    {"self_attn.v_proj.bias", offsetof(struct model_layer, bv), D_KVDIM, QKV_BIAS},
    {"self_attn.o_proj.bias", offsetof(struct model_layer, bo), D_DIM, O_BIAS},
    {"self_attn.q_norm.weight", offsetof(struct model_layer, q_norm), D_HEAD, QK_NORM},
    {"self_attn.k_norm.weight", offsetof(struct model_layer, k_norm), D_HEAD, QK_NORM},
};

static int dim_of(const struct model_config *c, enum dim d)
{
    switch (d) {
    case D_DIM: return c->hidden_size;
    case D_QDIM: return c->n_heads * c->head_dim;
    case D_KVDIM: return c->n_kv_heads * c->head_dim;
    case D_FFN: return c->intermediate_size;
    case D_HEAD: return c->head_dim;
    }
    return 0;
}

static bool needed(const struct model_config *c, enum need n)
{
    switch (n) {
    case ALWAYS: return true;
    case QKV_BIAS: return c->attention_bias;
    case O_BIAS: return c->o_bias;
    case QK_NORM: return c->qk_norm;
    case PLAIN_NORMS: return !c->sandwich_norms;
    case SANDWICH_NORMS: return c->sandwich_norms;
    case SPLIT_QKV: return !c->fused_qkv;
    case SPLIT_GATE_UP: return !c->fused_gate_up;
    case FUSED_QKV: return c->fused_qkv;
    case FUSED_GATE_UP: return c->fused_gate_up;
    }
    return false;
}

/* Floats of f32 copies one layer's vectors take. */
static size_t layer_vector_floats(const struct model_config *c)
{
    if (c->arch == ARCH_MAMBA) { /* norm, in_proj and out_proj biases; conv, dt bias, A, D */
        size_t inner = (size_t)c->intermediate_size;
        return 2 * (size_t)c->hidden_size + 2 * inner + inner * ((size_t)c->ssm_conv + 3 + (size_t)c->ssm_state);
    }
    if (c->arch == ARCH_GPT2) /* ln_1, ln_2 (weight, bias), c_attn, c_proj, c_fc, mlp c_proj biases */
        return 9 * (size_t)c->hidden_size + (size_t)c->intermediate_size;
    size_t n = 0;
    for (size_t i = 0; i < sizeof LAYER_VECS / sizeof LAYER_VECS[0]; i++)
        if (needed(c, LAYER_VECS[i].need))
            n += (size_t)dim_of(c, LAYER_VECS[i].len);
    return n;
}

static enum model_status bind_layer(struct binder *b, int l, struct model_layer *L)
{
    char name[128];
    enum model_status st;
    for (size_t i = 0; i < sizeof LAYER_MATS / sizeof LAYER_MATS[0]; i++) {
        const struct layer_mat *m = &LAYER_MATS[i];
        if (!needed(b->cfg, m->need))
            continue;
        snprintf(name, sizeof name, "model.layers.%d.%s", l, m->suffix);
        st = bind_mat(b, name, dim_of(b->cfg, m->rows), dim_of(b->cfg, m->cols),
                      (struct model_mat *)((char *)L + m->off));
        if (st != MODEL_OK)
            return st;
    }
    for (size_t i = 0; i < sizeof LAYER_FUSED / sizeof LAYER_FUSED[0]; i++) {
        const struct layer_fused *f = &LAYER_FUSED[i];
        if (!needed(b->cfg, f->need))
            continue;
        int rows = 0, cols = b->cfg->hidden_size;
        for (int p = 0; p < f->n; p++)
            rows += dim_of(b->cfg, f->rows[p]); /* at most 3 * MAX_QDIM: an int */
        struct model_mat whole;
        snprintf(name, sizeof name, "model.layers.%d.%s", l, f->suffix);
        if ((st = bind_mat(b, name, rows, cols, &whole)))
            return st;
        size_t row_bytes = be_row_bytes(whole.dtype, (size_t)cols); /* a GGUF's may be blocks */
        for (int p = 0, r0 = 0; p < f->n; r0 += dim_of(b->cfg, f->rows[p]), p++)
            *(struct model_mat *)((char *)L + f->off[p]) =
                (struct model_mat){.data = (const char *)whole.data + (size_t)r0 * row_bytes, .dtype = whole.dtype,
                                   .rows = dim_of(b->cfg, f->rows[p]), .cols = cols};
    }
    for (size_t i = 0; i < sizeof LAYER_VECS / sizeof LAYER_VECS[0]; i++) {
        const struct layer_vec *v = &LAYER_VECS[i];
        if (!needed(b->cfg, v->need))
            continue;
        snprintf(name, sizeof name, "model.layers.%d.%s", l, v->suffix);
        st = bind_vec(b, name, dim_of(b->cfg, v->len), (const float **)((char *)L + v->off));
        if (st != MODEL_OK)
            return st;
    }
    return MODEL_OK;
}

/* The output head, tied to the embeddings or its own tensor; last, so
 * w->layers is set only once every layer is bound. */
static enum model_status bind_head(struct binder *b, struct model_weights *w)
{
    const struct model_config *c = b->cfg;
    enum model_status st;
    if (c->tie_word_embeddings)
        w->lm_head = w->tok_embed;
    else if ((st = bind_mat(b, "lm_head.weight", c->vocab_size, c->hidden_size, &w->lm_head)))
        return st;
    w->layers = b->mf->layers;
    return MODEL_OK;
}

/* Embeddings, n_layers blocks bound by bind_block, the final norm (no
 * bias) and the head: Llama's and Mamba's layout, under their names. */
static enum model_status bind_stack(struct binder *b, struct model_weights *w, const char *embed,
                                    enum model_status (*bind_block)(struct binder *, int, struct model_layer *),
                                    const char *final_norm)
{
    const struct model_config *c = b->cfg;
    enum model_status st = bind_mat(b, embed, c->vocab_size, c->hidden_size, &w->tok_embed);
    for (int l = 0; l < c->n_layers && st == MODEL_OK; l++)
        st = bind_block(b, l, &b->mf->layers[l]);
    if (st == MODEL_OK)
        st = bind_vec(b, final_norm, c->hidden_size, &w->final_norm);
    return st == MODEL_OK ? bind_head(b, w) : st;
}

/* ---- GPT-2 ---------------------------------------------------------------- */

static bool has_tensor(const struct binder *b, const char *name)
{
    if (b->weight_map)
        return json_object_get(b->weight_map, name) != NULL;
    for (int i = 0; i < b->mf->n_files; i++)
        if (st_find(&b->mf->files[i], name))
            return true;
    return false;
}

/* A GPT-2 Conv1D weight, stored [in, out] (x W, not x W^T), bound as an
 * owned transposed copy [out, in], the layout the matmul reads; llama.cpp's
 * converter stores it so already (and perhaps quantized by rows). */
static enum model_status bind_conv1d(struct binder *b, const char *name, int in, int out, struct model_mat *m)
{
    if (b->gguf)
        return bind_mat(b, name, out, in, m);
    struct model_mat src;
    enum model_status st = bind_mat(b, name, in, out, &src);
    if (st != MODEL_OK)
        return st;
    size_t esz = be_dtype_size(src.dtype);
    char *dst = malloc((size_t)in * (size_t)out * esz);
    if (!dst)
        return model_errf(b->err, MODEL_ENOMEM, "out of memory transposing %s (%d x %d)", name, in, out);
    const char *p = src.data;
    for (size_t o = 0; o < (size_t)out; o++)
        for (size_t i = 0; i < (size_t)in; i++)
            memcpy(dst + (o * (size_t)in + i) * esz, p + (i * (size_t)out + o) * esz, esz);
    if ((st = model_files_keep(b->mf, dst, b->err)))
        return st;
    *m = (struct model_mat){.data = dst, .dtype = src.dtype, .rows = out, .cols = in};
    return MODEL_OK;
}

/* One GPT-2 block: h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
 * mlp.c_proj}; c_attn's rows are q, then k, then v. */
static enum model_status bind_gpt2_layer(struct binder *b, const char *pre, int l, struct model_layer *L)
{
    int dim = b->cfg->hidden_size, ffn = b->cfg->intermediate_size;
    char n[160];
    enum model_status st;
    struct model_mat qkv;
    const float *bqkv;
#define NAME(suffix) (snprintf(n, sizeof n, "%sh.%d.%s", pre, l, suffix), n)
    if ((st = bind_vec(b, NAME("ln_1.weight"), dim, &L->attn_norm)) ||
        (st = bind_vec(b, NAME("ln_1.bias"), dim, &L->attn_norm_b)) ||
        (st = bind_conv1d(b, NAME("attn.c_attn.weight"), dim, 3 * dim, &qkv)) ||
        (st = bind_vec(b, NAME("attn.c_attn.bias"), 3 * dim, &bqkv)) ||
        (st = bind_conv1d(b, NAME("attn.c_proj.weight"), dim, dim, &L->wo)) ||
        (st = bind_vec(b, NAME("attn.c_proj.bias"), dim, &L->bo)) ||
        (st = bind_vec(b, NAME("ln_2.weight"), dim, &L->ffn_norm)) ||
        (st = bind_vec(b, NAME("ln_2.bias"), dim, &L->ffn_norm_b)) ||
        (st = bind_conv1d(b, NAME("mlp.c_fc.weight"), dim, ffn, &L->w_up)) ||
        (st = bind_vec(b, NAME("mlp.c_fc.bias"), ffn, &L->b_up)) ||
        (st = bind_conv1d(b, NAME("mlp.c_proj.weight"), ffn, dim, &L->w_down)) ||
        (st = bind_vec(b, NAME("mlp.c_proj.bias"), dim, &L->b_down)))
        return st;
#undef NAME
    size_t part = (size_t)dim * be_row_bytes(qkv.dtype, (size_t)dim); /* a GGUF's may be blocks */
    struct model_mat *parts[] = {&L->wq, &L->wk, &L->wv};
    const float **biases[] = {&L->bq, &L->bk, &L->bv};
    for (int p = 0; p < 3; p++) {
        *parts[p] = (struct model_mat){.data = (const char *)qkv.data + (size_t)p * part, .dtype = qkv.dtype,
                                       .rows = dim, .cols = dim};
        *biases[p] = bqkv + (size_t)p * (size_t)dim;
    }
    return MODEL_OK;
}

/* GPT2LMHeadModel saves its tensors under "transformer."; the original
 * checkpoints (GPT2Model's) have no prefix. */
static const char *gpt2_prefix(const struct binder *b)
{
    return has_tensor(b, "transformer.wte.weight") ? "transformer." : "";
}

static enum model_status bind_gpt2(struct binder *b, struct model_weights *w)
{
    const struct model_config *c = b->cfg;
    const char *pre = gpt2_prefix(b);
    char n[160];
    enum model_status st;
    snprintf(n, sizeof n, "%swte.weight", pre);
    if ((st = bind_mat(b, n, c->vocab_size, c->hidden_size, &w->tok_embed)))
        return st;
    snprintf(n, sizeof n, "%swpe.weight", pre);
    if ((st = bind_mat(b, n, c->max_position_embeddings, c->hidden_size, &w->pos_embed)))
        return st;
    for (int l = 0; l < c->n_layers; l++)
        if ((st = bind_gpt2_layer(b, pre, l, &b->mf->layers[l])))
            return st;
    snprintf(n, sizeof n, "%sln_f.weight", pre);
    if ((st = bind_vec(b, n, c->hidden_size, &w->final_norm)))
        return st;
    snprintf(n, sizeof n, "%sln_f.bias", pre);
    if ((st = bind_vec(b, n, c->hidden_size, &w->final_norm_b)))
        return st;
    return bind_head(b, w);
}

/* One Mamba block: layers.N.{norm, mixer.{in_proj, conv1d, x_proj, dt_proj,
 * A_log, D, out_proj}}.  in_proj's rows are x then z and x_proj's dt, B,
 * then C: bound as row views, so each product is its own matmul. */
static enum model_status bind_mamba_layer(struct binder *b, int l, struct model_layer *L)
{
    const struct model_config *c = b->cfg;
    int dim = c->hidden_size, inner = c->intermediate_size, N = c->ssm_state, R = c->ssm_dt_rank;
    char n[160];
    enum model_status st;
    struct model_mat in, xp;
    const float *in_b = NULL, *A_log;
#define NAME(suffix) (snprintf(n, sizeof n, "backbone.layers.%d.%s", l, suffix), n)
    if ((st = bind_vec(b, NAME("norm.weight"), dim, &L->attn_norm)) ||
        (st = bind_mat(b, NAME("mixer.in_proj.weight"), 2 * inner, dim, &in)) ||
        (c->ssm_bias && (st = bind_vec(b, NAME("mixer.in_proj.bias"), 2 * inner, &in_b))) ||
        (st = bind_small(b, NAME("mixer.conv1d.weight"), (int[]){inner, 1, c->ssm_conv}, 3, &L->ssm_conv_w)) ||
        (c->ssm_conv_bias && (st = bind_vec(b, NAME("mixer.conv1d.bias"), inner, &L->ssm_conv_b))) ||
        (st = bind_mat(b, NAME("mixer.x_proj.weight"), R + 2 * N, inner, &xp)) ||
        (st = bind_mat(b, NAME("mixer.dt_proj.weight"), inner, R, &L->ssm_dt)) ||
        (st = bind_vec(b, NAME("mixer.dt_proj.bias"), inner, &L->ssm_dt_b)) ||
        (st = bind_small(b, NAME("mixer.A_log"), (int[]){inner, N}, 2, &A_log)) ||
        (st = bind_vec(b, NAME("mixer.D"), inner, &L->ssm_D)) ||
        (st = bind_mat(b, NAME("mixer.out_proj.weight"), dim, inner, &L->ssm_out)) ||
        (c->ssm_bias && (st = bind_vec(b, NAME("mixer.out_proj.bias"), dim, &L->ssm_out_b))))
        return st;
#undef NAME
    float *A = (float *)A_log; /* our own f32 copy: A = -exp(A_log) in place, as the reference forms it */
    for (size_t i = 0; i < (size_t)inner * (size_t)N; i++)
        A[i] = -expf(A[i]);
    L->ssm_A = A;
    size_t row = be_row_bytes(in.dtype, (size_t)dim), xrow = be_row_bytes(xp.dtype, (size_t)inner);
    L->ssm_in_x = (struct model_mat){.data = in.data, .dtype = in.dtype, .rows = inner, .cols = dim};
    L->ssm_in_z = (struct model_mat){.data = (const char *)in.data + (size_t)inner * row, .dtype = in.dtype,
                                     .rows = inner, .cols = dim};
    L->ssm_in_bx = in_b;
    L->ssm_in_bz = in_b ? in_b + inner : NULL;
    L->ssm_x_dt = (struct model_mat){.data = xp.data, .dtype = xp.dtype, .rows = R, .cols = inner};
    L->ssm_x_B = (struct model_mat){.data = (const char *)xp.data + (size_t)R * xrow, .dtype = xp.dtype, .rows = N,
                                    .cols = inner};
    L->ssm_x_C = (struct model_mat){.data = (const char *)xp.data + (size_t)(R + N) * xrow, .dtype = xp.dtype,
                                    .rows = N, .cols = inner};
    return MODEL_OK;
}

/* MambaForCausalLM's tensors are under "backbone."; the original
 * checkpoints name the embeddings "embedding" (transformers renames them
 * at load too). */
static enum model_status bind_mamba(struct binder *b, struct model_weights *w)
{
    const char *emb = has_tensor(b, "backbone.embedding.weight") ? "backbone.embedding.weight"
                                                                 : "backbone.embeddings.weight";
    return bind_stack(b, w, emb, bind_mamba_layer, "backbone.norm_f.weight");
}

static enum model_status bind_all(struct binder *b, struct model_weights *w)
{
    const struct model_config *c = b->cfg;
    model_files *mf = b->mf;
    size_t floats = (size_t)c->n_layers * layer_vector_floats(c) + (size_t)c->hidden_size * (c->layer_norm ? 2 : 1);
    mf->vectors = malloc(floats * sizeof *mf->vectors);
    mf->layers = calloc((size_t)c->n_layers, sizeof *mf->layers);
    if (!mf->vectors || !mf->layers)
        return model_errf(b->err, MODEL_ENOMEM, "out of memory binding %d layers", c->n_layers);
    b->next_vector = mf->vectors;
    if (c->arch == ARCH_GPT2)
        return bind_gpt2(b, w);
    if (c->arch == ARCH_MAMBA)
        return bind_mamba(b, w);
    return bind_stack(b, w, "model.embed_tokens.weight", bind_layer, "model.norm.weight");
}

enum model_status model_files_keep(model_files *mf, void *p, char *err)
{
    if (mf->n_copies == mf->cap_copies) {
        int cap = mf->cap_copies ? 2 * mf->cap_copies : 16;
        void **c = realloc(mf->copies, (size_t)cap * sizeof *c);
        if (!c) {
            free(p);
            return model_errf(err, MODEL_ENOMEM, "out of memory for the table of weight copies");
        }
        mf->copies = c;
        mf->cap_copies = cap;
    }
    mf->copies[mf->n_copies++] = p;
    return MODEL_OK;
}

enum model_status model_files_bind(model_files *mf, const struct model_config *cfg, bool gguf,
                                   struct model_weights *w, char *err)
{
    struct binder b = {.mf = mf, .cfg = cfg, .gguf = gguf, .err = err};
    return bind_all(&b, w);
}

void model_files_drop_tables(model_files *mf)
{
    for (int i = 0; i < mf->n_files; i++)
        st_drop_header(&mf->files[i]);
}

/* Maps dir's files, binds them with bind(b, arg) and hashes their headers. */
static enum model_status open_bound(const char *dir, const struct model_config *cfg, model_bind_fn bind, void *arg,
                                   model_files **out, uint64_t *header_hash, char *err)
{
    *out = NULL;
    *header_hash = 0;
    model_files *mf = calloc(1, sizeof *mf);
    if (!mf)
        return model_errf(err, MODEL_ENOMEM, "out of memory opening the weights of %s", dir);
    struct binder b = {.mf = mf, .cfg = cfg, .err = err};
    enum model_status st = open_files(mf, dir, &b.weight_map, err);
    if (st == MODEL_OK)
        st = bind(&b, arg);
    json_decref(b.weight_map);
    for (int i = 0; i < mf->n_files; i++) {
        const struct st_file *f = &mf->files[i];
        if (st == MODEL_OK) /* the raw header bytes: what changes when any tensor's name, dtype or shape does */
            *header_hash = XXH3_64bits_withSeed((const char *)f->map + 8,
                                                (size_t)((const char *)f->data - (const char *)f->map - 8),
                                                *header_hash);
    }
    model_files_drop_tables(mf);
    if (st != MODEL_OK) {
        model_files_close(mf);
        return st;
    }
    *out = mf;
    return MODEL_OK;
}

static enum model_status bind_weights(struct binder *b, void *w)
{
    return bind_all(b, w);
}

enum model_status model_files_open(const char *dir, const struct model_config *cfg, model_files **out,
                                   struct model_weights *w, char *err)
{
    if (model_is_gguf(dir))
        return gguf_files_open(dir, cfg, out, w, err);
    memset(w, 0, sizeof *w);
    uint64_t hash;
    enum model_status st = open_bound(dir, cfg, bind_weights, w, out, &hash, err);
    if (st != MODEL_OK)
        memset(w, 0, sizeof *w);
    else
        w->header_hash = hash;
    return st;
}

struct custom_bind {
    size_t vector_floats;
    model_bind_fn bind;
    void *arg;
};

static enum model_status bind_custom(struct binder *b, void *arg)
{
    const struct custom_bind *cb = arg;
    b->mf->vectors = malloc((cb->vector_floats ? cb->vector_floats : 1) * sizeof *b->mf->vectors);
    if (!b->mf->vectors)
        return model_errf(b->err, MODEL_ENOMEM, "out of memory binding the weights");
    b->next_vector = b->mf->vectors;
    return cb->bind(b, cb->arg);
}

enum model_status model_files_open_with(const char *dir, const struct model_config *cfg, size_t vector_floats,
                                        model_bind_fn bind, void *arg, model_files **out, uint64_t *header_hash,
                                        char *err)
{
    struct custom_bind cb = {vector_floats, bind, arg};
    return open_bound(dir, cfg, bind_custom, &cb, out, header_hash, err);
}

enum model_status model_bind_mat(struct binder *b, const char *name, int rows, int cols, struct model_mat *m)
{
    return bind_mat(b, name, rows, cols, m);
}

enum model_status model_bind_vec(struct binder *b, const char *name, int len, const float **out)
{
    return bind_vec(b, name, len, out);
}

/* Whether a row of cols weights of block format dt has finite scales: the
 * codes are integers, so only the scales can be NaN or infinite. */
static bool row_scales_finite(enum be_dtype dt, const void *row, int cols)
{
    if (dt == BE_Q4_K)
        return q4_k_check(row, (size_t)cols / Q4_K_BLOCK);
    const struct q8_0_block *q = row;
    for (int i = 0; i < cols / Q8_0_BLOCK; i++)
        if ((q[i].d & 0x7C00u) == 0x7C00u)
            return false;
    return true;
}

static enum model_status verify_mat(const struct model_mat *m, const char *name, char *err)
{
    if (!be_dtype_size(m->dtype)) { /* a block format, each alike */
        size_t row = be_row_bytes(m->dtype, (size_t)m->cols);
        for (int r = 0; r < m->rows; r++)
            if (!row_scales_finite(m->dtype, (const uint8_t *)m->data + (size_t)r * row, m->cols))
                return model_errf(err, MODEL_EFORMAT, "tensor %s has a non-finite %s scale in row %d", name,
                                  be_dtype_name(m->dtype), r);
        return MODEL_OK;
    }
    size_t n = (size_t)m->rows * (size_t)m->cols, bad = first_non_finite(m->data, m->dtype, n);
    if (bad < n)
        return model_errf(err, MODEL_EFORMAT, "tensor %s has a non-finite value (NaN or infinity) at row %zu, column %zu",
                          name, bad / (size_t)m->cols, bad % (size_t)m->cols);
    return MODEL_OK;
}

/* GPT-2's matrices as bound: q, k, v are consecutive rows of one copy. */
static enum model_status verify_gpt2(const struct model_config *cfg, const struct model_weights *w, char *err)
{
    enum model_status st = verify_mat(&w->tok_embed, "wte.weight", err);
    if (st == MODEL_OK)
        st = verify_mat(&w->pos_embed, "wpe.weight", err);
    if (st == MODEL_OK && !cfg->tie_word_embeddings)
        st = verify_mat(&w->lm_head, "lm_head.weight", err);
    for (int l = 0; l < cfg->n_layers && st == MODEL_OK; l++) {
        const struct model_layer *L = &w->layers[l];
        struct model_mat qkv = L->wq;
        qkv.rows *= 3;
        const struct model_mat *mats[] = {&qkv, &L->wo, &L->w_up, &L->w_down};
        static const char *const names[] = {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"};
        for (int i = 0; i < 4 && st == MODEL_OK; i++) {
            char name[128];
            snprintf(name, sizeof name, "h.%d.%s.weight (transposed)", l, names[i]);
            st = verify_mat(mats[i], name, err);
        }
    }
    return st;
}

/* Mamba's matrices as bound: in_proj and x_proj are whole tensors whose
 * parts are consecutive rows. */
static enum model_status verify_mamba(const struct model_config *cfg, const struct model_weights *w, char *err)
{
    enum model_status st = verify_mat(&w->tok_embed, "backbone.embeddings.weight", err);
    if (st == MODEL_OK && !cfg->tie_word_embeddings)
        st = verify_mat(&w->lm_head, "lm_head.weight", err);
    for (int l = 0; l < cfg->n_layers && st == MODEL_OK; l++) {
        const struct model_layer *L = &w->layers[l];
        struct model_mat in = L->ssm_in_x, xp = L->ssm_x_dt;
        in.rows *= 2;
        xp.rows += 2 * L->ssm_x_B.rows;
        const struct model_mat *mats[] = {&in, &xp, &L->ssm_dt, &L->ssm_out};
        static const char *const names[] = {"in_proj", "x_proj", "dt_proj", "out_proj"};
        for (int i = 0; i < 4 && st == MODEL_OK; i++) {
            char name[128];
            snprintf(name, sizeof name, "backbone.layers.%d.mixer.%s.weight", l, names[i]);
            st = verify_mat(mats[i], name, err);
        }
    }
    return st;
}

enum model_status model_weights_verify(const struct model_config *cfg, const struct model_weights *w, char *err)
{
    if (cfg->arch == ARCH_GPT2)
        return verify_gpt2(cfg, w, err);
    if (cfg->arch == ARCH_MAMBA)
        return verify_mamba(cfg, w, err);
    enum model_status st = verify_mat(&w->tok_embed, "model.embed_tokens.weight", err);
    if (st == MODEL_OK && !cfg->tie_word_embeddings)
        st = verify_mat(&w->lm_head, "lm_head.weight", err);
    for (int l = 0; l < cfg->n_layers && st == MODEL_OK; l++) {
        char name[128];
        for (size_t k = 0; k < sizeof LAYER_MATS / sizeof LAYER_MATS[0] && st == MODEL_OK; k++) {
            if (!needed(cfg, LAYER_MATS[k].need))
                continue;
            snprintf(name, sizeof name, "model.layers.%d.%s", l, LAYER_MATS[k].suffix);
            st = verify_mat((const struct model_mat *)((const char *)&w->layers[l] + LAYER_MATS[k].off), name, err);
        }
        for (size_t k = 0; k < sizeof LAYER_FUSED / sizeof LAYER_FUSED[0] && st == MODEL_OK; k++) {
            const struct layer_fused *f = &LAYER_FUSED[k];
            if (!needed(cfg, f->need))
                continue;
            /* the parts are consecutive rows of the one tensor */
            struct model_mat whole = *(const struct model_mat *)((const char *)&w->layers[l] + f->off[0]);
            for (int p = 1; p < f->n; p++)
                whole.rows += ((const struct model_mat *)((const char *)&w->layers[l] + f->off[p]))->rows;
            snprintf(name, sizeof name, "model.layers.%d.%s", l, f->suffix);
            st = verify_mat(&whole, name, err);
        }
    }
    return st;
}

/* Row r of m as f32: m's own row when it is f32, else converted into buf. */
static const float *row_f32(const struct model_mat *m, int r, float *buf)
{
    size_t n = (size_t)m->cols, esz = be_dtype_size(m->dtype);
    const uint8_t *src = (const uint8_t *)m->data + (size_t)r * n * esz;
    if (m->dtype == BE_F32)
        return (const float *)src;
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2); /* the mmap does not promise 2-byte alignment */
        buf[i] = m->dtype == BE_F16 ? f16_to_f32(h) : bf16_to_f32(h);
    }
    return buf;
}

/* One row of cols weights into dt's blocks at out; false on a non-finite weight. */
static bool quantize_row(enum be_dtype dt, const float *x, void *out, int cols)
{
    return dt == BE_Q4_K ? q4_k_quantize(x, out, (size_t)cols) : q8_0_quantize(x, out, (size_t)cols);
}

/* The layer matrices --weights quantizes: Mamba's mixer (its in_proj and
 * x_proj row views quantized row by row, as the whole tensors would be),
 * else LAYER_MATS. */
static const struct layer_mat MAMBA_MATS[] = {
    {"mixer.in_proj.weight", offsetof(struct model_layer, ssm_in_x), D_DIM, D_DIM, ALWAYS},
    {"mixer.in_proj.weight", offsetof(struct model_layer, ssm_in_z), D_DIM, D_DIM, ALWAYS},
    {"mixer.x_proj.weight", offsetof(struct model_layer, ssm_x_dt), D_DIM, D_DIM, ALWAYS},
    {"mixer.x_proj.weight", offsetof(struct model_layer, ssm_x_B), D_DIM, D_DIM, ALWAYS},
    {"mixer.x_proj.weight", offsetof(struct model_layer, ssm_x_C), D_DIM, D_DIM, ALWAYS},
    {"mixer.dt_proj.weight", offsetof(struct model_layer, ssm_dt), D_DIM, D_DIM, ALWAYS},
    {"mixer.out_proj.weight", offsetof(struct model_layer, ssm_out), D_DIM, D_DIM, ALWAYS},
};

enum model_status model_weights_quantize(const struct model_config *cfg, struct model_weights *w,
                                         enum model_weights_fmt fmt, void **blocks, struct model_layer **layers,
                                         char *err)
{
    bool mamba = cfg->arch == ARCH_MAMBA;
    const struct layer_mat *mats = mamba ? MAMBA_MATS : LAYER_MATS;
    size_t n_mats = mamba ? sizeof MAMBA_MATS / sizeof MAMBA_MATS[0] : sizeof LAYER_MATS / sizeof LAYER_MATS[0];
    const char *prefix = mamba ? "backbone" : "model";
    size_t total = 0;
    int max_cols = 0;
    char name[128];
    for (int l = 0; l < cfg->n_layers; l++)
        for (size_t k = 0; k < n_mats; k++) {
            const struct model_mat *m = (const struct model_mat *)((const char *)&w->layers[l] + mats[k].off);
            /* a matrix the architecture lacks (GPT-2's gate), or one a GGUF
             * file holds in a block format already, kept as it is; so is
             * Mamba's dt_proj when its dt_rank columns are not whole blocks
             * (48 in mamba-130m: a small matrix) */
            if (!m->data || !be_dtype_size(m->dtype) || (mamba && m->cols % Q8_0_BLOCK))
                continue;
            if (m->cols % Q8_0_BLOCK)
                return model_errf(err, MODEL_EUNSUPPORTED,
                                  "tensor model.layers.%d.%s: %d columns, not a multiple of %d (Q8_0 blocks)", l,
                                  mats[k].suffix, m->cols, Q8_0_BLOCK);
            total += (size_t)m->rows * be_row_bytes(model_weights_mat_dtype(fmt, m->cols), (size_t)m->cols);
            max_cols = m->cols > max_cols ? m->cols : max_cols;
        }
    /* every block type's rows are a multiple of its alignment (2 bytes);
     * total is 0 for a GGUF file's weights, all quantized already */
    char *q = malloc(total ? total : 1);
    struct model_layer *ls = malloc((size_t)cfg->n_layers * sizeof *ls);
    float *buf = malloc((size_t)max_cols * sizeof *buf);
    enum model_status st = MODEL_OK;
    if (!q || !ls || !buf)
        st = model_errf(err, MODEL_ENOMEM, "out of host memory for %zu bytes of quantized weights", total);
    char *next = q;
    for (int l = 0; l < cfg->n_layers && st == MODEL_OK; l++) {
        ls[l] = w->layers[l];
        for (size_t k = 0; k < n_mats && st == MODEL_OK; k++) {
            struct model_mat *m = (struct model_mat *)((char *)&ls[l] + mats[k].off);
            if (!m->data || !be_dtype_size(m->dtype) || (mamba && m->cols % Q8_0_BLOCK))
                continue;
            enum be_dtype dt = model_weights_mat_dtype(fmt, m->cols);
            size_t row = be_row_bytes(dt, (size_t)m->cols);
            for (int r = 0; r < m->rows && st == MODEL_OK; r++)
                if (!quantize_row(dt, row_f32(m, r, buf), next + (size_t)r * row, m->cols)) {
                    snprintf(name, sizeof name, "%s.layers.%d.%s", prefix, l, mats[k].suffix);
                    st = model_errf(err, MODEL_EFORMAT,
                                    "tensor %s has a non-finite value (NaN or infinity) or one too large for "
                                    "%s's f16 scales in row %d",
                                    name, be_dtype_name(dt), r);
                }
            *m = (struct model_mat){.data = next, .dtype = dt, .rows = m->rows, .cols = m->cols};
            next += (size_t)m->rows * row;
        }
    }
    free(buf);
    if (st != MODEL_OK) {
        free(q);
        free(ls);
        return st;
    }
    w->layers = ls;
    *blocks = q;
    *layers = ls;
    return MODEL_OK;
}
