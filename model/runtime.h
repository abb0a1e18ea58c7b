/* runtime.h - the bundle every program that runs a model opens: a backend,
 * the model, its tokenizer and a KV store, created and released together.
 */
#ifndef KVTIER_RUNTIME_H
#define KVTIER_RUNTIME_H

#include "model/encdec.h"
#include "model/generate.h"

#define RUNTIME_MIN_DEVICE_MEM ((size_t)64 << 20) /* the floor of a budget sized from the model */

struct runtime_params {
    const char *backend;       /* "cpu" (NULL) or "cuda" */
    struct be_params be;
    struct model_params model;
    struct kv_store_params kv; /* zeroed: the store's defaults (no host-tier budget) */
    /* With be.device_mem 0 and size_seqs > 0, the device budget is sized
     * from the model (struct runtime_budget) instead of the backend's
     * default, which may be half the machine's memory: size_seqs sequences
     * of size_ctx tokens (0: the model's context). */
    int size_seqs, size_ctx;
    /* An encoder-decoder directory (encdec_is_encdec) opens as rt->ed, its
     * store laid out by encdec_kv_geom, rt->m NULL; without it such a
     * directory is refused as model_load refuses it. */
    bool allow_encdec;
};

/* A device budget sized from the model: the sum of the parts and an eighth
 * on top (the KV pool grows in chunks of blocks, offloaded sequences stream
 * through slots), at least RUNTIME_MIN_DEVICE_MEM.  All zero when the
 * budget was given or left to the backend (one with dedicated memory). */
struct runtime_budget {
    size_t weights;     /* uploaded weights; 0 where the backend reads the mmap */
    size_t activations; /* the forward pass's buffers */
    size_t kv;          /* KV (model_params.kv_dtype) of seqs sequences at ctx tokens each */
    size_t margin;
    size_t total;
    int seqs, ctx;
    bool encdec;        /* each sequence also holds the cross cache of an input of ctx tokens */
};

struct runtime {
    be_backend *be;
    model *m;
    encdec *ed; /* instead of m: allow_encdec */
    tokenizer *tok;
    kv_store *store;
    struct runtime_budget budget;
};

/* The tokenizer of a model: dir/tokenizer.json (+ tokenizer_config.json),
 * or a GGUF file's tokenizer metadata. */
enum model_status model_tokenizer_load(const char *path, tokenizer **out, char *err);

/* Opens everything for the model directory dir (or GGUF file); on failure nothing is left
 * open and err names what was wrong. */
enum model_status runtime_open(const char *dir, const struct runtime_params *p, struct runtime *rt, char *err);
void runtime_close(struct runtime *rt); /* accepts a zeroed or partly opened runtime */

#endif
