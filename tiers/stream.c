/* stream.c - streaming host-tier layers through two device slots during a
 * forward step: copy layer l+1 in while layer l computes, write back only
 * the blocks the step wrote, and measure it.
 *
 * NOTES
 * States of the store's streaming: idle (streaming false) -> planned by
 * kv_store_step_begin (every reserved sequence's host layers have a
 * region in a slot, their views point there) -> per chunk, layer 0..L-1:
 * layer_begin(l) waits for l's copy-in and starts the next streamed
 * layer's; layer_end(l) queues l's write-back -> idle again after
 * kv_store_step_end has drained the copy stream.
 *
 * Streamed layers of a step alternate between slot 0 and slot 1 in layer
 * order; a slot holds, back to back, the region of every sequence of the
 * batch that streams that layer: the blocks its attention reads,
 * [floor(view lo / bt), ceil(end / bt)), in logical order (one copy per
 * sequence, two where its host ring wraps).  A quantized sequence in the
 * host tier (kvquant.c) streams every layer: its region is the layer's
 * quantized blocks then its residual blocks, one copy per block, and only
 * the residual blocks a chunk wrote go back.  A state in the host tier
 * (state.c) streams every layer too: its region is the layer's state,
 * copied in and written back whole by each chunk it is part of.
 *
 * Invariants:
 *   (1) copies run in order on the one copy stream, so the copy-in of the
 *       layer two streamed layers after l, which reuses l's slot, is queued
 *       after l's write-back (layer_end(l) precedes layer_begin(l+1)), and
 *       a later chunk's copy-in of l reads what the earlier chunk wrote
 *       back.  The CPU backend computes on the calling thread, so a
 *       write-back queued after layer_forward returns reads finished data.
 *   (2) only blocks holding positions of the current chunk go back; the
 *       host positions they overwrite beyond the committed length are not
 *       stored yet (kvstore.c invariant 3), so an aborted step leaves the
 *       host tier's stored positions as they were.
 *   (3) between steps the slots hold nothing of value: they may be freed
 *       and reallocated at any step_begin, and they are freed as soon as
 *       the last host extent is (kvstore.c ext_release).
 * Figures: the copy stream's busy time per batch of copies is measured
 * with a pair of events around it (be_event_elapsed), stall is the time
 * the compute stream waited for the copy-ins (be_event_stall: on a device
 * the compute stream's own wait, which the host only queues), compute the
 * rest of the step.
 */
#include "tiers/kvstore_impl.h"

#include <stdlib.h>
#include <string.h>

#include "util/clock.h"

/* Slots grow in steps of this many blocks so that a growing context
 * reallocates them every few hundred tokens, not every block. */
#define KV_SLOT_ROUND_BLOCKS 4

enum { EV_IN_START = 0, EV_IN_END, EV_WB_START, EV_WB_END, EV_PER_LAYER };

static be_event *ev(const kv_store *s, int layer, int which)
{
    return s->ev[layer * EV_PER_LAYER + which];
}

/* Adds to *stall the compute stream's waits for layer's copy-ins since the
 * last call (none: nothing); a backend that cannot time them adds none. */
static enum be_status add_stall(kv_store *s, int layer, double *stall)
{
    double t;
    enum be_status st = be_event_stall(ev(s, layer, EV_IN_END), &t);
    if (st == BE_OK)
        *stall += t;
    return st == BE_ENOTSUP ? BE_OK : st;
}

enum tier_status kv_stream_init(kv_store *s)
{
    int n = s->g.n_layers;
    s->slot_of = malloc((size_t)n * sizeof(*s->slot_of));
    s->issued = calloc((size_t)n, sizeof(*s->issued));
    s->in_rec = calloc((size_t)n, sizeof(*s->in_rec));
    s->wb_rec = calloc((size_t)n, sizeof(*s->wb_rec));
    s->ev = calloc((size_t)n * EV_PER_LAYER, sizeof(*s->ev));
    if (!s->slot_of || !s->issued || !s->in_rec || !s->wb_rec || !s->ev)
        return TIER_ENOMEM_HOST;
    for (int i = 0; i < n * EV_PER_LAYER; i++)
        if (be_event_create(s->be, &s->ev[i]) != BE_OK)
            return TIER_ENOMEM_HOST;
    return TIER_OK;
}

void kv_stream_release(kv_store *s)
{
    if (s->ev)
        for (int i = 0; i < s->g.n_layers * EV_PER_LAYER; i++)
            be_event_free(s->ev[i]);
    free(s->ev);
    free(s->slot_of);
    free(s->issued);
    free(s->in_rec);
    free(s->wb_rec);
    be_buffer_free(s->slot[0]);
    be_buffer_free(s->slot[1]);
}

static void xfer_add(struct kv_xfer_stats *a, const struct kv_xfer_stats *b)
{
    a->steps += b->steps;
    a->tokens += b->tokens;
    a->bytes_h2d += b->bytes_h2d;
    a->bytes_d2h += b->bytes_d2h;
    a->transfer_s += b->transfer_s;
    a->stall_s += b->stall_s;
    a->compute_s += b->compute_s;
}

void kv_stream_slots_release(kv_store *s)
{
    be_buffer_free(s->slot[0]);
    be_buffer_free(s->slot[1]);
    s->slot[0] = s->slot[1] = NULL;
    s->slot_cap = 0;
}

/* Two slots of at least `need` bytes, rounded up when the budget allows,
 * exact when only that fits, after returning free pool chunks when even
 * that does not.  On failure the store holds none. */
static enum tier_status slots_alloc(kv_store *s, size_t need)
{
    /* a state store's slots hold whole states */
    size_t round = s->g.state_bytes ? s->g.state_bytes : KV_SLOT_ROUND_BLOCKS * s->block_bytes;
    size_t caps[2] = {(need + round - 1) / round * round, need};
    kv_stream_slots_release(s);
    enum be_status st = BE_ENOMEM_DEV;
    for (int attempt = 0; attempt < 4 && st == BE_ENOMEM_DEV; attempt++) {
        if (attempt == 2) /* unreferenced prefix-cache blocks and empty pool chunks go first */
            kv_store_reclaim(s);
        st = be_dev_alloc(s->be, caps[attempt % 2], &s->slot[0]);
        if (st == BE_OK)
            st = be_dev_alloc(s->be, caps[attempt % 2], &s->slot[1]);
        if (st == BE_OK) {
            s->slot_cap = caps[attempt % 2];
            return TIER_OK;
        }
        be_buffer_free(s->slot[0]);
        s->slot[0] = NULL;
    }
    if (st != BE_ENOMEM_DEV)
        return kv_fail(s, TIER_EIO, "streaming slots: %s", be_strerror(st));
    struct be_mem_stats ms = be_mem_stats(s->be);
    return kv_fail(s, TIER_ENOMEM_DEV,
                   "device tier budget of %zu bytes exhausted: %zu in use, two streaming slots of %zu bytes needed",
                   ms.dev_budget, ms.dev_used, need);
}

char *kv_slot_region(const kv_store *s, int layer, const struct kv_layer *L)
{
    return (char *)be_buffer_data(s->slot[s->slot_of[layer]]) + L->slot_off;
}

enum tier_status kv_store_step_begin(kv_store *s)
{
    size_t need = 0;
    int ordinal = 0;
    for (int i = 0; i < s->n_active; i++) {
        if (kvq_seq_on_host(s->active[i])) {
            enum tier_status st = kvq_seq_slot_table(s->active[i]);
            if (st != TIER_OK)
                return st;
        }
    }
    for (int l = 0; l < s->g.n_layers; l++) {
        size_t off = 0;
        for (int i = 0; i < s->n_active; i++) {
            kv_seq *q = s->active[i];
            struct kv_layer *L = &q->layers[l];
            if (kvq_seq_on_host(q) || (q->state && state_on_host(q))) {
                L->slot_off = off;
                off += q->state ? s->g.state_bytes : kvq_seq_slot_bytes(q, l);
                continue;
            }
            if (L->home != KV_HOME_HOST)
                continue;
            L->slot_b0 = layer_view_lo(q, L) / s->bt;
            L->slot_nb = (int)((q->len + q->pending + s->bt - 1) / s->bt - L->slot_b0);
            L->slot_off = off;
            off += (size_t)L->slot_nb * s->block_bytes;
        }
        s->slot_of[l] = off ? ordinal++ % 2 : -1;
        if (off > need)
            need = off;
    }
    s->streaming = need > 0;
    if (!s->streaming)
        return TIER_OK;
    if (need > s->slot_cap) {
        enum tier_status st = slots_alloc(s, need);
        if (st != TIER_OK) {
            s->streaming = false;
            return st;
        }
    }
    /* waits of a step that failed before its end are not this step's */
    double before = 0;
    for (int l = 0; l < s->g.n_layers; l++)
        if (add_stall(s, l, &before) != BE_OK)
            return kv_fail(s, TIER_EIO, "reading the copy-in waits of a failed step");
    s->step = (struct kv_xfer_stats){.steps = 1};
    for (int i = 0; i < s->n_active; i++) {
        kv_seq *q = s->active[i];
        s->step.tokens += (uint64_t)q->pending;
        for (int l = 0; l < s->g.n_layers; l++) {
            struct kv_layer *L = &q->layers[l];
            if (L->home != KV_HOME_HOST)
                continue;
            char *region = kv_slot_region(s, l, L);
            L->base = L->slot_b0 * s->bt;
            L->n_blocks = L->slot_nb;
            for (int b = 0; b < L->slot_nb; b++)
                L->blocks[b] = region + (size_t)b * s->block_bytes;
        }
    }
    memset(s->wb_rec, 0, (size_t)s->g.n_layers * sizeof(*s->wb_rec));
    s->step_t0 = clock_s();
    return TIER_OK;
}

void kv_seq_chunk(kv_seq *q, int64_t from, int64_t to)
{
    q->chunk_from = from;
    q->chunk_to = to;
    q->chunk_live = true;
}

/* Copies logical blocks [b0, b1) between a layer's host ring and its slot
 * region, in at most two runs (the ring may wrap). */
static enum be_status ring_copy(kv_store *s, const struct kv_layer *L, int64_t b0, int64_t b1, enum be_copy_dir dir)
{
    char *ring = L->ext.data;
    char *slot = (char *)L->blocks[0];
    for (int64_t b = b0; b < b1;) {
        int64_t r = b % L->ext_blocks, run = b1 - b < L->ext_blocks - r ? b1 - b : L->ext_blocks - r;
        char *h = ring + (size_t)r * s->block_bytes, *d = slot + (size_t)(b - L->slot_b0) * s->block_bytes;
        size_t n = (size_t)run * s->block_bytes;
        enum be_status st = dir == BE_H2D ? be_copy_async(s->be, d, h, n, dir) : be_copy_async(s->be, h, d, n, dir);
        if (st != BE_OK)
            return st;
        if (dir == BE_H2D)
            s->step.bytes_h2d += n;
        else
            s->step.bytes_d2h += n;
        b += run;
    }
    return BE_OK;
}

/* Adds the copy-stream time between two fired events to the step. */
static enum be_status add_transfer(kv_store *s, int layer, int start)
{
    double t;
    enum be_status st = be_event_elapsed(ev(s, layer, start), ev(s, layer, start + 1), &t);
    if (st == BE_OK)
        s->step.transfer_s += t;
    return st;
}

static enum be_status record(kv_store *s, int layer, int which, uint64_t *rec)
{
    if (rec)
        *rec = ++s->n_rec;
    return be_event_record(s->be, ev(s, layer, which));
}

static enum be_status copy_in(kv_store *s, int l)
{
    enum be_status st = record(s, l, EV_IN_START, &s->in_rec[l]);
    for (int i = 0; i < s->n_active && st == BE_OK; i++) {
        kv_seq *q = s->active[i];
        const struct kv_layer *L = &q->layers[l];
        if (q->state && state_on_host(q))
            st = state_copy_in(q, l, kv_slot_region(s, l, L), &s->step);
        else if (kvq_seq_on_host(q))
            st = kvq_seq_copy_in(q, l, kv_slot_region(s, l, L), &s->step);
        else if (L->home == KV_HOME_HOST)
            st = ring_copy(s, L, L->slot_b0, L->slot_b0 + L->slot_nb, BE_H2D);
    }
    if (st == BE_OK)
        st = record(s, l, EV_IN_END, NULL);
    s->issued[l] = st == BE_OK;
    return st;
}

/* The step's sequences still loading from an image (kv_seq_load_begin)
 * get their layers up to `upto` filled before anything reads them. */
static enum be_status fill_loading(kv_store *s, int upto)
{
    for (int i = 0; i < s->n_active; i++)
        if (s->active[i]->load && kv_seq_fill(s->active[i], upto) != TIER_OK)
            return BE_EIO;
    return BE_OK;
}

enum be_status kv_store_layer_begin(kv_store *s, int layer)
{
    int next = layer + 1; /* the streamed layer this one's copy-in is for */
    while (s->streaming && next < s->g.n_layers && s->slot_of[next] < 0)
        next++;
    enum be_status st = fill_loading(s, s->streaming && next < s->g.n_layers ? next : layer);
    if (!s->streaming || st != BE_OK)
        return st;
    if (layer == 0) /* a new chunk: every streamed layer is copied in again */
        memset(s->issued, 0, (size_t)s->g.n_layers * sizeof(*s->issued));
    if (s->slot_of[layer] >= 0) {
        if (!s->issued[layer])
            st = copy_in(s, layer);
        if (st == BE_OK)
            st = be_event_wait(s->be, ev(s, layer, EV_IN_END));
        if (st == BE_OK)
            st = add_transfer(s, layer, EV_IN_START);
        /* write-backs queued before this copy-in have finished too */
        for (int m = 0; m < s->g.n_layers && st == BE_OK; m++) {
            if (s->wb_rec[m] && s->wb_rec[m] < s->in_rec[layer]) {
                st = add_transfer(s, m, EV_WB_START);
                s->wb_rec[m] = 0;
            }
        }
    }
    if (st == BE_OK && next < s->g.n_layers && !s->issued[next])
        st = copy_in(s, next);
    return st;
}

/* The write-back of a streamed layer l (NOTES). */
static enum be_status write_back(kv_store *s, int layer)
{
    /* layer_begin timed the previous chunk's write-back of this layer */
    enum be_status st = record(s, layer, EV_WB_START, &s->wb_rec[layer]);
    for (int i = 0; i < s->n_active && st == BE_OK; i++) {
        kv_seq *q = s->active[i];
        const struct kv_layer *L = &q->layers[layer];
        if (q->chunk_to <= q->chunk_from)
            continue;
        if (q->state && state_on_host(q))
            st = state_write_back(q, layer, kv_slot_region(s, layer, L), &s->step);
        else if (kvq_seq_on_host(q))
            st = kvq_seq_write_back(q, layer, kv_slot_region(s, layer, L), q->chunk_from, q->chunk_to, &s->step);
        else if (L->home == KV_HOME_HOST)
            st = ring_copy(s, L, q->chunk_from / s->bt, (q->chunk_to + s->bt - 1) / s->bt, BE_D2H);
    }
    if (st == BE_OK)
        st = record(s, layer, EV_WB_END, NULL);
    return st;
}

enum be_status kv_store_layer_end(kv_store *s, int layer)
{
    enum be_status st = s->streaming && s->slot_of[layer] >= 0 ? write_back(s, layer) : BE_OK;
    /* a host state's checkpoint reads what the write-backs put in the host tier */
    if (st == BE_OK && s->g.state_bytes && layer == s->g.n_layers - 1)
        st = state_chunk_end(s);
    return st;
}

enum be_status kv_store_step_end(kv_store *s)
{
    if (!s->streaming)
        return BE_OK;
    enum be_status st = be_sync(s->be);
    for (int m = 0; m < s->g.n_layers && st == BE_OK; m++)
        if (s->wb_rec[m])
            st = add_transfer(s, m, EV_WB_START);
    for (int m = 0; m < s->g.n_layers && st == BE_OK; m++)
        st = add_stall(s, m, &s->step.stall_s);
    s->step.compute_s = clock_s() - s->step_t0 - s->step.stall_s;
    xfer_add(&s->total, &s->step);
    for (int i = 0; i < s->n_active; i++) {
        kv_seq *q = s->active[i];
        bool streamed = kvq_seq_on_host(q) || (q->state && state_on_host(q));
        for (int l = 0; l < s->g.n_layers; l++) {
            if (q->layers[l].home == KV_HOME_HOST) {
                streamed = true;
                ext_view_refresh(q, &q->layers[l]);
            }
        }
        if (streamed)
            xfer_add(&q->xfer, &s->step);
    }
    s->streaming = false;
    return st;
}
