/* gguf.h - private to the model loader: GGUF v3 files (llama.cpp's format),
 * read as the Hugging Face directory they stand for.
 *
 * gguf.c maps a file and checks every header field against the file before
 * anything is sized by it: counts against the bytes left, string and array
 * lengths, the alignment, each tensor's rank, shape, type, offset and size,
 * and that no two tensors overlap; a bad file is MODEL_EFORMAT with a
 * message naming the field and its byte offset, never a crash.
 * gguf_model.c maps its metadata onto config.json's fields, its tensor
 * names onto the Hugging Face ones the binder knows and its vocabulary onto
 * a tokenizer.json, so that the one config parser, weight binder and
 * tokenizer loader read both formats.
 */
#ifndef KVTIER_GGUF_H
#define KVTIER_GGUF_H

#include <stdbool.h>
#include <stdint.h>

#include "model/model.h"
#include "model/safetensors.h"
#include "text/tokenizer.h"

#define GGUF_MAX_DIMS 4

/* GGUF metadata value types (gguf_type in llama.cpp's gguf.h). */
enum gguf_vtype {
    GGUF_U8 = 0, GGUF_I8, GGUF_U16, GGUF_I16, GGUF_U32, GGUF_I32, GGUF_F32, GGUF_BOOL, GGUF_STR, GGUF_ARR,
    GGUF_U64, GGUF_I64, GGUF_F64,
};

/* A string in the map: not NUL-terminated. */
struct gguf_str {
    const char *p;
    uint64_t n;
};

struct gguf_kv {
    struct gguf_str key;
    uint32_t type;      /* enum gguf_vtype */
    uint32_t arr_type;  /* an array's element type */
    uint64_t n;         /* an array's element count */
    const uint8_t *val; /* the value (an array's first element) in the map */
    uint64_t at;        /* its byte offset in the file, for messages */
};

/* A tensor type the loader reads: elements come in blocks of `block`
 * taking block_bytes (1 and the element size for the float types).  One
 * line of gguf.c's GGUF_TYPES adds one. */
struct gguf_type {
    uint32_t id;        /* ggml_type */
    int block, block_bytes;
    struct st_dtype dt; /* its name, element size (0: a block format) and be_dtype */
    /* a block format's n elements (whole blocks) as f32: how a quantized
     * token_embd is read (be_embed takes float tables only) */
    void (*to_f32)(const void *blocks, float *out, size_t n);
};
/* The entry of a block format's be_dtype, or NULL. */
const struct gguf_type *gguf_block_type(int be);

struct gguf_tensor {
    const char *name;   /* NUL-terminated, in the file's names arena */
    int n_dims;
    uint64_t ne[GGUF_MAX_DIMS]; /* ne[0]: elements of a row */
    const struct gguf_type *type;
    uint64_t offset, bytes; /* in the data section */
};

struct gguf {
    char *name;         /* the path, for messages */
    uint8_t *map;
    size_t size;
    uint32_t alignment;
    struct gguf_kv *kv; /* sorted by key */
    uint64_t n_kv;
    struct gguf_tensor *t; /* in file order */
    uint64_t n_t;
    char *names;        /* the tensors' names */
    uint64_t data_off;  /* the data section's offset */
    uint64_t kv_end;    /* where the metadata ends (the tensor infos start) */
};

/* True when path names a file rather than a directory (or, missing, ends
 * in .gguf): the model loader's sign for GGUF (gguf_open checks the magic). */
bool model_is_gguf(const char *path);

enum model_status gguf_open(const char *path, struct gguf **out, char *err);
void gguf_close(struct gguf *g); /* accepts NULL */

const struct gguf_kv *gguf_find(const struct gguf *g, const char *key);
const struct gguf_tensor *gguf_tensor(const struct gguf *g, const char *name);

/* Typed metadata reads; an absent key is an error only when required (the
 * outputs then keep what they held), a value of another type always, both
 * naming the key. */
enum model_status gguf_get_int(const struct gguf *g, const char *key, bool required, int64_t lo, int64_t hi,
                               int64_t *out, char *err);
enum model_status gguf_get_float(const struct gguf *g, const char *key, bool required, double *out, char *err);
enum model_status gguf_get_bool(const struct gguf *g, const char *key, bool required, bool *out, char *err);
enum model_status gguf_get_str(const struct gguf *g, const char *key, bool required, struct gguf_str *out,
                               char *err);
/* An array of elem_type (GGUF_STR, GGUF_I32, GGUF_F32, ...); *out NULL
 * when absent. */
enum model_status gguf_get_arr(const struct gguf *g, const char *key, bool required, uint32_t elem_type,
                               const struct gguf_kv **out, char *err);
/* The next string of a string array at *pos (gguf_open checked them all). */
struct gguf_str gguf_next_str(const uint8_t **pos);

/* gguf_model.c: what model_config_load, model_files_open and
 * model_tokenizer_load do for a GGUF path. */
enum model_status gguf_config_load(const char *path, struct model_config *cfg, char *err);
enum model_status gguf_files_open(const char *path, const struct model_config *cfg, model_files **out,
                                  struct model_weights *w, char *err);
enum model_status gguf_tokenizer_load(const char *path, tokenizer **out, char *err);
/* tokenizer.ggml.pre's name for a byte-level tokenizer.json's split regex,
 * ignore_merges and NFC normaliser, or NULL (gguf_write.c writes it). */
const char *gguf_pre_name(const char *regex, bool ignore_merges, bool nfc);

#endif
