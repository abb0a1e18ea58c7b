/* runtime.h - the bundle every program that runs a model opens: a backend,
 * the model, its tokenizer and a KV store, created and released together.
 */
#ifndef KVTIER_RUNTIME_H
#define KVTIER_RUNTIME_H

#include "model/generate.h"

struct runtime_params {
    const char *backend;       /* "cpu" (NULL) or "cuda" */
    struct be_params be;
    struct model_params model;
    struct kv_store_params kv; /* zeroed: the store's defaults (no host-tier budget) */
};

struct runtime {
    be_backend *be;
    model *m;
    tokenizer *tok;
    kv_store *store;
};

/* Opens everything for the model directory dir; on failure nothing is left
 * open and err names what was wrong. */
enum model_status runtime_open(const char *dir, const struct runtime_params *p, struct runtime *rt, char *err);
void runtime_close(struct runtime *rt); /* accepts a zeroed or partly opened runtime */

#endif
