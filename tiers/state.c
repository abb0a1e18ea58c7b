/* state.c - the sequences of a state-space model (Mamba): per layer a
 * fixed-size state (conv window + SSM state, be_ssm_state_bytes) instead of
 * K and V, held in the store's device tier, and checkpoints of it in the
 * host tier.
 *
 * The step is a transaction as for KV: the state lives in `cur`; a step's
 * chunks read cur (the first chunk) or `next` (the later ones) and write
 * next; the commit swaps them, an abort leaves cur as it was.  Two copies
 * per sequence, whatever its length.
 *
 * A state cannot be cut back to an earlier position the way KV blocks
 * can.  Where a chunk ends on a multiple of checkpoint_interval (the
 * forward pass cuts its chunks there), the state is copied to the host
 * tier; an abort drops the step's copies.  Crop, reuse and forks go back
 * to the nearest checkpoint at or below where they want to be (position 0
 * is the zero state), and the caller feeds the tokens from there again: at
 * most one interval.
 */
#include "tiers/kvstore_impl.h"

#include <stdlib.h>
#include <string.h>

struct kv_ckpt {
    int64_t pos;
    void *host; /* n_layers * state_bytes in the host tier */
};

struct kv_state {
    be_buffer *cur, *next; /* n_layers * state_bytes each, device */
    struct kv_ckpt *ckpt;  /* ascending pos */
    int n_ckpt, cap_ckpt;
};

static size_t seq_state_bytes(const kv_store *s)
{
    return (size_t)s->g.n_layers * s->g.state_bytes;
}

size_t kv_store_state_bytes(const kv_store *s)
{
    return 2 * seq_state_bytes(s);
}

/* A refusal of p on a state store, naming why the strategy does not apply
 * to a state; TIER_OK for those that do (dynamic, static: a state's size
 * is fixed either way). */
enum tier_status state_check_params(kv_store *s, const struct kv_seq_params *p)
{
    if (p->sink)
        return kv_fail(s, TIER_ENOTSUP, "sink: a state-space model has no tokens to keep as sinks (its state is "
                                        "fixed in size and summarizes every token)");
    if (p->window_length)
        return kv_fail(s, TIER_ENOTSUP, "sliding_window (window_length): a state-space model's state already has a "
                                        "fixed size and cannot drop single old tokens");
    if (p->strategy == KV_QUANTIZED)
        return kv_fail(s, TIER_ENOTSUP, "quantized: the cache of a state-space model is a recurrent state, not KV; "
                                        "quantizing it would compound its error at every token");
    if (p->strategy == KV_OFFLOADED || p->strategy == KV_OFFLOADED_STATIC || p->offload)
        return kv_fail(s, TIER_ENOTSUP, "%s: a state-space model's state is not streamed layer by layer; it stays "
                                        "on the device (its checkpoints are in the host tier)",
                       kv_strategy_name(p->strategy));
    return TIER_OK;
}

static enum tier_status state_zero(kv_seq *q, be_buffer *b)
{
    size_t n = seq_state_bytes(q->s);
    void *zeros = calloc(1, n);
    if (!zeros)
        return kv_fail(q->s, TIER_ENOMEM_HOST, "host memory: zeroing a %zu-byte state", n);
    enum be_status st = be_copy(q->s->be, be_buffer_data(b), zeros, n, BE_H2D);
    free(zeros);
    return st == BE_OK ? TIER_OK : kv_fail(q->s, TIER_EIO, "zeroing a state: %s", be_strerror(st));
}

enum tier_status state_seq_init(kv_seq *q)
{
    kv_store *s = q->s;
    size_t n = seq_state_bytes(s);
    q->state = calloc(1, sizeof *q->state);
    if (!q->state)
        return kv_fail(s, TIER_ENOMEM_HOST, "host memory: a state sequence");
    enum tier_status st = kv_dev_alloc(s, n, "a sequence's state", &q->state->cur);
    if (st == TIER_OK)
        st = kv_dev_alloc(s, n, "a sequence's next state", &q->state->next);
    if (st == TIER_OK)
        st = state_zero(q, q->state->cur);
    return st;
}

static void ckpt_drop_from(kv_seq *q, int i)
{
    struct kv_state *x = q->state;
    for (int k = i; k < x->n_ckpt; k++)
        kv_host_free(q->s, x->ckpt[k].host, seq_state_bytes(q->s));
    if (i < x->n_ckpt)
        x->n_ckpt = i;
}

void state_seq_release(kv_seq *q)
{
    struct kv_state *x = q->state;
    if (!x)
        return;
    size_t n = seq_state_bytes(q->s);
    ckpt_drop_from(q, 0);
    free(x->ckpt);
    if (x->cur)
        kv_dev_free(q->s, x->cur, n);
    if (x->next)
        kv_dev_free(q->s, x->next, n);
    free(x);
    q->state = NULL;
}

void kv_seq_state_view(const kv_seq *q, int layer, struct be_ssm_view *out)
{
    const struct kv_state *x = q->state;
    size_t off = (size_t)layer * q->s->g.state_bytes;
    /* the step's first chunk starts from the committed state */
    const be_buffer *in = q->chunk_from == q->len ? x->cur : x->next;
    out->in = (const char *)be_buffer_data(in) + off;
    out->out = (char *)be_buffer_data(x->next) + off;
}

/* A copy of the state in b, at position pos, in the host tier; a failure
 * (host budget) only costs the recomputation it would have saved. */
static void ckpt_take(kv_seq *q, const be_buffer *b, int64_t pos)
{
    kv_store *s = q->s;
    struct kv_state *x = q->state;
    if (x->n_ckpt == x->cap_ckpt) {
        int cap = x->cap_ckpt ? 2 * x->cap_ckpt : 8;
        struct kv_ckpt *c = realloc(x->ckpt, (size_t)cap * sizeof *c);
        if (!c)
            return;
        x->ckpt = c;
        x->cap_ckpt = cap;
    }
    void *host;
    if (kv_host_alloc(s, seq_state_bytes(s), &host) != TIER_OK) {
        s->err[0] = '\0';
        return;
    }
    if (be_copy(s->be, host, be_buffer_data(b), seq_state_bytes(s), BE_D2H) != BE_OK) {
        kv_host_free(s, host, seq_state_bytes(s));
        return;
    }
    x->ckpt[x->n_ckpt++] = (struct kv_ckpt){.pos = pos, .host = host};
}

void state_chunk_end(kv_store *s)
{
    for (int i = 0; i < s->n_active; i++) {
        kv_seq *q = s->active[i];
        if (!q->state || !q->chunk_live)
            continue;
        q->chunk_live = false;
        if (q->chunk_to % s->ckpt_interval == 0)
            ckpt_take(q, q->state->next, q->chunk_to);
    }
}

void state_seq_commit(kv_seq *q)
{
    struct kv_state *x = q->state;
    be_buffer *t = x->cur;
    x->cur = x->next;
    x->next = t;
}

void state_seq_abort(kv_seq *q)
{
    struct kv_state *x = q->state;
    int i = x->n_ckpt;
    while (i > 0 && x->ckpt[i - 1].pos > q->len)
        i--;
    ckpt_drop_from(q, i);
}

/* Goes back to the latest checkpoint at or below len (the zero state at
 * 0); q->len is then where the state is. */
enum tier_status state_seq_rewind(kv_seq *q, int64_t len)
{
    kv_store *s = q->s;
    struct kv_state *x = q->state;
    if (len >= q->len)
        return TIER_OK;
    int i = x->n_ckpt;
    while (i > 0 && x->ckpt[i - 1].pos > len)
        i--;
    enum tier_status st;
    if (i == 0) {
        st = state_zero(q, x->cur);
    } else {
        enum be_status bs = be_copy(s->be, be_buffer_data(x->cur), x->ckpt[i - 1].host, seq_state_bytes(s), BE_H2D);
        st = bs == BE_OK ? TIER_OK : kv_fail(s, TIER_EIO, "restoring a state checkpoint: %s", be_strerror(bs));
    }
    if (st != TIER_OK)
        return st;
    q->len = i ? x->ckpt[i - 1].pos : 0;
    ckpt_drop_from(q, i);
    return TIER_OK;
}

enum tier_status state_seq_fork(const kv_seq *q, kv_seq *c)
{
    kv_store *s = q->s;
    enum tier_status st = state_seq_init(c);
    if (st != TIER_OK)
        return st;
    size_t n = seq_state_bytes(s);
    enum be_status bs = be_copy(s->be, be_buffer_data(c->state->cur), be_buffer_data(q->state->cur), n, BE_D2D);
    if (bs != BE_OK)
        return kv_fail(s, TIER_EIO, "forking a state: %s", be_strerror(bs));
    c->copied_bytes += n;
    /* the child's rollbacks need the parent's checkpoints */
    for (int i = 0; i < q->state->n_ckpt; i++) {
        struct kv_state *x = c->state;
        if (x->n_ckpt == x->cap_ckpt) {
            int cap = x->cap_ckpt ? 2 * x->cap_ckpt : 8;
            struct kv_ckpt *p = realloc(x->ckpt, (size_t)cap * sizeof *p);
            if (!p)
                return kv_fail(s, TIER_ENOMEM_HOST, "host memory: forking a state's checkpoints");
            x->ckpt = p;
            x->cap_ckpt = cap;
        }
        void *host;
        if ((st = kv_host_alloc(s, n, &host)) != TIER_OK)
            return st;
        memcpy(host, q->state->ckpt[i].host, n);
        x->ckpt[x->n_ckpt++] = (struct kv_ckpt){.pos = q->state->ckpt[i].pos, .host = host};
    }
    return TIER_OK;
}

void state_seq_bytes(const kv_seq *q, size_t *dev, size_t *host)
{
    *dev = 2 * seq_state_bytes(q->s);
    *host = (size_t)q->state->n_ckpt * seq_state_bytes(q->s);
}
