/* fuzz_image.c - kv_seq_load of a sequence image (tiers/image.c), which the
 * disk tier reads back from files: a truncated, stale or damaged file must
 * be refused, never trusted.
 *
 * The input's first byte picks the store: even, the geometry of
 * test_image's full-attention model (2 layers, 2 KV heads, head_dim 16,
 * f32, blocks of 4 tokens); odd, the same with every layer sliding by 8;
 * with bit 1 set, a state-space model's store instead (2 layers of a
 * 64-byte state, a checkpoint every 4 tokens; seed image-state).
 * The rest is the image; with bit 2 set, a kept sequence's image instead
 * (tiers/keep.c "FORMAT": the encoder cache's file on the disk tier and
 * value on the remote tier), loaded by kv_store_kept_insert for the input
 * 1, 2, ... of namespace 1, as long as the image claims when its ids fit
 * in it (seeds kept-NN).  The harness links no CPU backend, so the store
 * sits on a backend of plain host memory with copies only (fuzz_mem.h:
 * enough for a load, no kernel runs), a 1 MiB device budget and a 4 MiB
 * host tier.
 * Seeds: images test_image writes with KVTIER_IMAGE_SEEDS=dir.
 *
 * Invariants: a refusal is TIER_EINVAL (or out of memory) with a message
 * and no sequence, leaving no block or host byte in use; a load that
 * succeeds without falling back to the host tier gives a sequence whose
 * image is the input, byte for byte.  A kept image is refused the same
 * way (or TIER_ECONFLICT), keeping nothing; one taken is kept under the
 * input, as long as it. */
#include "tiers/kvstore.h"
#include "util/le.h"
#include "tests/fuzz/fuzz_mem.h"

static void kept(kv_store *s, const uint8_t *img, size_t size)
{
    uint64_t n = size >= 32 ? get64(img + 24) : 1;
    n = n && n <= (size - 32) / 4 ? n : 1;
    int32_t *ids = malloc(n * sizeof(*ids));
    FUZZ_CHECK(ids, "out of memory");
    for (uint64_t i = 0; i < n; i++)
        ids[i] = (int32_t)i + 1;
    kv_kept *k = (kv_kept *)1;
    enum tier_status st = kv_store_kept_insert(s, img, size, 1, ids, (int64_t)n, true, &k);
    struct kv_store_stats ss = kv_store_stats(s);
    if (st != TIER_OK) {
        FUZZ_CHECK(!k, "a refused kept image gave an entry");
        FUZZ_CHECK(st == TIER_EINVAL || st == TIER_ECONFLICT || st == TIER_ENOMEM_DEV || st == TIER_ENOMEM_HOST,
                   "status %d", (int)st);
        FUZZ_CHECK(kv_store_errmsg(s)[0], "a refusal without a message");
        FUZZ_CHECK(ss.blocks_used == 0 && ss.host_bytes == 0 && ss.prefix_entries == 0,
                   "a refused kept image left %llu blocks, %zu host bytes, %llu entries",
                   (unsigned long long)ss.blocks_used, ss.host_bytes, (unsigned long long)ss.prefix_entries);
    } else {
        FUZZ_CHECK(kv_seq_length(kv_kept_seq(k)) == (int64_t)n && kv_store_kept_held(s, 1, ids, (int64_t)n),
                   "a kept image of %lld positions taken for %llu ids", (long long)kv_seq_length(kv_kept_seq(k)),
                   (unsigned long long)n);
        kv_kept_unref(k);
    }
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    static be_backend *be;
    if (!be)
        be = mem_backend(1 << 20);
    int windows[2] = {data[0] & 1 ? 8 : 0, data[0] & 1 ? 8 : 0};
    struct kv_geom g = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 16, .layer_window = windows, .dtype = BE_F32};
    if (data[0] & 2)
        g = (struct kv_geom){.n_layers = 2, .state_bytes = be_ssm_state_bytes(4, 2, 3), .dtype = BE_F32};
    kv_store *s;
    FUZZ_CHECK(kv_store_open(be, &g,
                             &(struct kv_store_params){.block_tokens = 4, .host_mem = 4 << 20, .checkpoint_interval = 4},
                             &s) == TIER_OK,
               "kv_store_open");
    if (data[0] & 4) {
        kept(s, data + 1, size - 1);
        kv_store_free(s);
        return 0;
    }
    kv_seq *q = (kv_seq *)1;
    enum tier_status st = kv_seq_load(s, data + 1, size - 1, &q);
    if (st != TIER_OK) {
        FUZZ_CHECK(!q, "a refused load gave a sequence");
        FUZZ_CHECK(st == TIER_EINVAL || st == TIER_ENOMEM_DEV || st == TIER_ENOMEM_HOST, "status %d", (int)st);
        FUZZ_CHECK(kv_store_errmsg(s)[0], "a refusal without a message");
        struct kv_store_stats ss = kv_store_stats(s);
        FUZZ_CHECK(ss.blocks_used == 0 && ss.host_bytes == 0, "a refused load left %llu blocks, %zu host bytes",
                   (unsigned long long)ss.blocks_used, ss.host_bytes);
    } else {
        size_t n = kv_seq_image_size(q);
        if (!kv_store_stats(s).fallbacks) { /* a fallback changes the strategy and homes */
            FUZZ_CHECK(n == size - 1, "re-saved image of %zu bytes for an input of %zu", n, size - 1);
            uint8_t *again = malloc(n);
            FUZZ_CHECK(again, "out of memory");
            FUZZ_CHECK(kv_seq_save(q, again, n) == TIER_OK, "kv_seq_save: %s", kv_store_errmsg(s));
            FUZZ_CHECK(!memcmp(again, data + 1, n), "the re-saved image differs from the input");
            free(again);
        }
        kv_seq_free(q);
    }
    kv_store_free(s);
    return 0;
}
