/* safetensors.h - private to the model loader (config.c, safetensors.c):
 * the helpers both halves use to name files and report errors, so that every
 * message has the same "file: what was wrong" shape.
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

/* Loaders with a layout of their own (model/encdec.c): maps dir's
 * checkpoint and calls bind(b, arg), which binds each tensor it needs with
 * model_bind_mat (rows x cols of cfg->dtype, the only field of cfg read)
 * and model_bind_vec (an f32 copy, at most vector_floats in all; matrices
 * that need an aligned copy: at most max_copies).  *header_hash: as
 * model_weights.header_hash. */
struct binder;
typedef enum model_status (*model_bind_fn)(struct binder *b, void *arg);
enum model_status model_files_open_with(const char *dir, const struct model_config *cfg, size_t vector_floats,
                                        size_t max_copies, model_bind_fn bind, void *arg, model_files **out,
                                        uint64_t *header_hash, char *err);
enum model_status model_bind_mat(struct binder *b, const char *name, int rows, int cols, struct model_mat *m);
enum model_status model_bind_vec(struct binder *b, const char *name, int len, const float **out);

#endif
