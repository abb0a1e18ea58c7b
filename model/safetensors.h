/* safetensors.h - private to the model loader (config.c, safetensors.c,
 * gguf*.c): the helpers its parts use to name files and report errors, so
 * that every message has the same "file: what was wrong" shape, and the
 * mapped-file tables the binder reads, which a GGUF file fills in too.
 */
#ifndef KVTIER_SAFETENSORS_H
#define KVTIER_SAFETENSORS_H

#include <jansson.h>
#include <limits.h>
#include <stdbool.h>

#include "model/model.h"

/* Writes the message into err (MODEL_ERR_LEN bytes; NULL = no message) and
 * returns st, so a failure reads `return model_errf(err, MODEL_EFORMAT, ...)`. */
enum model_status model_errf(char *err, enum model_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* path = dir/name; MODEL_EINVAL when it does not fit PATH_MAX. */
enum model_status model_path(char path[PATH_MAX], const char *dir, const char *name, char *err);

/* Loads dir/name as a JSON object (duplicate keys rejected).  A missing file
 * is MODEL_ENOENT, or MODEL_OK with *out = NULL when optional; a file that is
 * not a JSON object, or is implausibly large, is MODEL_EFORMAT.  The caller
 * json_decref()s *out. */
enum model_status model_json_load(const char *dir, const char *name, bool optional, json_t **out, char *err);

/* Parses the config.json object root (generation_config.json of dir
 * overriding its tokens when dir is not NULL) into cfg, with file naming
 * it in messages, and sets cfg->config_hash. */
enum model_status model_config_parse(json_t *root, const char *dir, const char *file, struct model_config *cfg,
                                     char *err);

#define MAX_RANK 8

/* A tensor element type; size is bytes per element, 0 for a block format
 * (Q8_0), whose rows be_row_bytes sizes.  be < 0: none we compute with. */
struct st_dtype {
    const char *name;
    unsigned size;
    int be;
};

struct st_tensor {
    const char *name; /* a key of the file's header (lives as long as it) */
    const struct st_dtype *dtype;
    int rank;
    uint64_t shape[MAX_RANK]; /* row-major: shape[rank - 1] is the row */
    uint64_t begin, end; /* [begin, end) in the data section */
};

struct st_file {
    char *name;            /* as in the directory, for messages */
    uint8_t *map;
    size_t map_size;
    const uint8_t *data;   /* the data section */
    uint64_t data_size;
    json_t *header;        /* released once the weights are bound */
    struct st_tensor *tensors; /* sorted by name */
    size_t n_tensors;
};

struct model_files {
    struct st_file *files;
    int n_files;
    struct model_layer *layers; /* weights->layers */
    float *vectors;             /* f32 copies of every 1-D tensor */
    void **copies;              /* owned copies of matrices (unaligned, transposed, GGUF's reordered) */
    int n_copies, cap_copies;
};

/* Binds the tensors of mf's one file (its tensors table filled by another
 * format's reader, under the Hugging Face names) as model_files_open binds
 * a safetensors file.  gguf: the tensors as llama.cpp's converter writes
 * them: a matrix may be of any type the kernels take (GGUF keeps some
 * matrices quantized, the others in a float type), not only the config's
 * dtype; Gemma's norm weights hold 1 + w already; GPT-2's projections are
 * [out, in], not Conv1D's [in, out]. */
enum model_status model_files_bind(model_files *mf, const struct model_config *cfg, bool gguf,
                                   struct model_weights *w, char *err);
/* Hands p (malloc'd) to mf, which frees it on close; frees p and fails
 * when the table cannot grow. */
enum model_status model_files_keep(model_files *mf, void *p, char *err);
/* The tensor table a binding no longer needs. */
void model_files_drop_tables(model_files *mf);

/* Loaders with a layout of their own (model/encdec.c): maps dir's
 * checkpoint and calls bind(b, arg), which binds each tensor it needs with
 * model_bind_mat (rows x cols of cfg->dtype, the only field of cfg read)
 * and model_bind_vec (an f32 copy, at most vector_floats in all).
 * *header_hash: as model_weights.header_hash. */
struct binder;
typedef enum model_status (*model_bind_fn)(struct binder *b, void *arg);
enum model_status model_files_open_with(const char *dir, const struct model_config *cfg, size_t vector_floats,
                                        model_bind_fn bind, void *arg, model_files **out, uint64_t *header_hash,
                                        char *err);
enum model_status model_bind_mat(struct binder *b, const char *name, int rows, int cols, struct model_mat *m);
enum model_status model_bind_vec(struct binder *b, const char *name, int len, const float **out);

/* A backend that cannot read host memory (caps.unified_memory false) gets
 * its own copy of every weight, charged to its device budget: *p (n bytes
 * of host memory) is copied into a new device buffer, stored at
 * bufs[(*n_bufs)++] (the caller sized bufs), and *p then names the copy.
 * NULL stays NULL (an absent bias; a matrix without data, as GPT-2's
 * gate).  The _mat and _vec forms size a matrix by its rows and an f32
 * vector of n floats. */
enum model_status model_upload(be_backend *be, const void **p, size_t n, be_buffer **bufs, int *n_bufs, char *err);
enum model_status model_upload_mat(be_backend *be, struct model_mat *w, be_buffer **bufs, int *n_bufs, char *err);
enum model_status model_upload_vec(be_backend *be, const float **v, int n, be_buffer **bufs, int *n_bufs, char *err);

#endif
