/* runtime.c - opens and closes the backend, model, tokenizer and KV store
 * of one model directory as a unit. */
#include "model/runtime.h"

#include <stdio.h>
#include <string.h>

enum model_status runtime_open(const char *dir, const struct runtime_params *p, struct runtime *rt, char *err)
{
    memset(rt, 0, sizeof(*rt));
    const char *name = p && p->backend ? p->backend : "cpu";
    enum be_status bs = be_open(name, p ? &p->be : NULL, &rt->be);
    if (bs != BE_OK) {
        snprintf(err, MODEL_ERR_LEN, "backend %s: %s", name, be_strerror(bs));
        return bs == BE_ENOMEM_HOST ? MODEL_ENOMEM : MODEL_EBACKEND;
    }
    enum model_status st = model_load(dir, rt->be, p ? &p->model : NULL, &rt->m, err);
    if (st == MODEL_OK)
        st = model_from_text(tokenizer_load(dir, &rt->tok, err));
    if (st == MODEL_OK) {
        struct kv_geom g = model_kv_geom(rt->m);
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
    be_free(rt->be);
    memset(rt, 0, sizeof(*rt));
}
