/* runtime.c - opens and closes the backend, model, tokenizer and KV store
 * of one model directory as a unit. */
#include "model/runtime.h"
#include "model/gguf.h"

#include <stdio.h>
#include <string.h>

/* The budget for p's sequences from dir's config.json.  Whether the weights
 * count depends on the backend's caps, which only an open backend tells: a
 * probe is opened for them, with a budget too small to reserve anything.
 * An encoder-decoder model's sequence holds two caches: the decoder's of
 * ctx tokens and the cross-attention cache of an input of as many (and the
 * encoder's activations are sized for that input). */
static enum model_status size_budget(const char *dir, const char *name, const struct runtime_params *p, bool ed,
                                     struct runtime_budget *b, char *err)
{
    struct model_config cfg = {0};
    struct encdec_config ec;
    enum model_status st = ed ? encdec_config_load(dir, &ec, err) : model_config_load(dir, &cfg, err);
    if (st != MODEL_OK)
        return st;
    if (ed) /* model_context reads no more of it */
        cfg.max_position_embeddings = encdec_context(&ec);
    struct be_params bp = p->be;
    bp.device_mem = BE_ALIGN;
    be_backend *probe;
    enum be_status bs = be_open(name, &bp, &probe);
    if (bs != BE_OK) {
        model_config_release(&cfg);
        snprintf(err, MODEL_ERR_LEN, "backend %s: %s", name, *be_open_error() ? be_open_error() : be_strerror(bs));
        return bs == BE_ENOMEM_HOST ? MODEL_ENOMEM : MODEL_EBACKEND;
    }
    struct be_caps caps = be_get_caps(probe);
    be_free(probe);
    if (caps.dedicated_memory) { /* the backend's own default: its free memory */
        model_config_release(&cfg);
        return MODEL_OK;
    }
    b->seqs = p->size_seqs;
    b->ctx = model_context(&cfg, p->size_ctx);
    b->encdec = ed;
    struct model_device_bytes d = ed ? encdec_device_bytes(&ec, caps, &p->model, b->ctx)
                                     : model_device_bytes(&cfg, caps, &p->model);
    model_config_release(&cfg);
    b->weights = d.weights;
    b->activations = d.activations;
    b->kv = (size_t)b->seqs * ((size_t)b->ctx * (ed ? 2 : 1) * d.kv_per_token + d.state_per_seq);
    size_t sum = b->weights + b->activations + b->kv;
    b->margin = sum / 8;
    b->total = sum + b->margin > RUNTIME_MIN_DEVICE_MEM ? sum + b->margin : RUNTIME_MIN_DEVICE_MEM;
    return MODEL_OK;
}

enum model_status model_tokenizer_load(const char *path, tokenizer **out, char *err)
{
    if (model_is_gguf(path))
        return gguf_tokenizer_load(path, out, err);
    return model_from_text(tokenizer_load(path, out, err));
}

enum model_status runtime_open(const char *dir, const struct runtime_params *p, struct runtime *rt, char *err)
{
    memset(rt, 0, sizeof(*rt));
    const char *name = p && p->backend ? p->backend : "cpu";
    struct be_params bp = p ? p->be : (struct be_params){0};
    bool ed = p && p->allow_encdec && encdec_is_encdec(dir);
    if (p && !bp.device_mem && p->size_seqs > 0) {
        enum model_status st = size_budget(dir, name, p, ed, &rt->budget, err);
        if (st != MODEL_OK)
            return st;
        bp.device_mem = rt->budget.total;
    }
    enum be_status bs = be_open(name, &bp, &rt->be);
    if (bs != BE_OK) {
        snprintf(err, MODEL_ERR_LEN, "backend %s: %s", name, *be_open_error() ? be_open_error() : be_strerror(bs));
        return bs == BE_ENOMEM_HOST ? MODEL_ENOMEM : MODEL_EBACKEND;
    }
    enum model_status st = ed ? encdec_load(dir, rt->be, &p->model, &rt->ed, err)
                              : model_load(dir, rt->be, p ? &p->model : NULL, &rt->m, err);
    if (st == MODEL_OK)
        st = model_tokenizer_load(dir, &rt->tok, err);
    if (st == MODEL_OK) {
        struct kv_geom g = ed ? encdec_kv_geom(rt->ed) : model_kv_geom(rt->m);
        enum tier_status ts = kv_store_open(rt->be, &g, p ? &p->kv : NULL, &rt->store);
        if (ts != TIER_OK) {
            snprintf(err, MODEL_ERR_LEN, "KV store: %s", tier_strerror(ts));
            st = ts == TIER_ENOMEM_HOST ? MODEL_ENOMEM : MODEL_EBACKEND;
        }
    }
    if (st != MODEL_OK)
        runtime_close(rt);
    return st;
}

void runtime_close(struct runtime *rt)
{
    kv_store_free(rt->store);
    tokenizer_free(rt->tok);
    model_free(rt->m);
    encdec_free(rt->ed);
    be_free(rt->be);
    memset(rt, 0, sizeof(*rt));
}
