/* fuzz_remote.c - what a Redis reply goes through before a block of the
 * remote tier is loaded (docs/remote.md, "What is stored"): the tier's own
 * reply reader and its lookup thread's check of each value (tiers/remote.c,
 * disk_blob_decode), then the store's check of the serialized block
 * (kv_store_prefix_insert), in chain order as the daemon inserts them.
 *
 * The chain: three blocks of two tokens each, namespace 1, of a store of 2
 * layers, 1 KV head, head_dim 8, f16 KV, on a backend of plain host memory
 * (fuzz_mem.h); the harness computes it once (its KV a byte pattern) and
 * serializes it as a daemon would publish it.  The input's first byte
 * picks the path:
 *  - even: the rest is one value, the one Redis holds for block
 *    (byte >> 2) % 3, loaded into an empty store (so only block 0 can be
 *    taken).  Bit 1 first recomputes the value's chunk checksums and then
 *    its header's, so that mutations reach the checks behind them (layout,
 *    name, sizes, decompression, the block's own header and hashes).
 *  - odd: the rest is what a server answers to a lookup of the chain's
 *    first 1 + (byte >> 1) % 3 blocks: the tier connects to a fake Redis
 *    on a Unix socket, which reads the GETEX commands and sends the bytes.
 *
 * Invariants: a value refused by disk_blob_decode is DISK_CORRUPT,
 * DISK_FOREIGN or DISK_NOMEM with a reason and nothing allocated; one
 * accepted holds at most a block's bytes, inside the value (raw) or in a
 * buffer of its own (compressed), and re-encodes (raw) to a value that
 * decodes to the same bytes.  The store refuses a block with TIER_EINVAL
 * (TIER_ECONFLICT for a parent it does not hold, or out of memory) and a
 * message, holding nothing after it; a block it
 * takes is the chain's (kv_store_prefix_chain finds it in memory).  A
 * lookup ends (bounded by the tier's timeout), finds at most what it asked
 * for, each found block at most a block's bytes, counted in its stats.
 *
 * Seeds: KVTIER_FUZZ_REMOTE_SEEDS=DIR build/fuzz/fuzz_remote -runs=0
 * writes the committed ones (tests/fuzz/remote/seed). */
#include <inttypes.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <xxhash.h>

#include "tiers/disk_format.h"
#include "tiers/kvstore.h"
#include "tiers/remote.h"
#include "util/log.h"
#include "tests/fuzz/fuzz_mem.h"

#define BT 2
#define N_BLK 3
#define NS 1
#define FINGERPRINT 0x5eed5eed12345678ull

static const int32_t chain_ids[N_BLK * BT + 1] = {5, 6, 7, 8, 9, 10, 11};

static be_backend *be;
static struct kv_geom geom = {.n_layers = 2, .n_kv_heads = 1, .head_dim = 8, .dtype = BE_F16};
static struct kv_disk_layout layout;
static const struct kv_seq_params seq_params = {.strategy = KV_DYNAMIC, .prefix_ns = NS};
static size_t block_bytes;                /* a serialized block */
static uint64_t hashes[N_BLK];            /* the chain's */
static uint8_t *values[N_BLK];            /* as published (raw containers) */
static size_t value_len[N_BLK];
static ZSTD_DCtx *dctx;
static char sock_path[108];
static int listen_fd = -1;

static kv_store *store_open(void)
{
    kv_store *s;
    struct kv_store_params sp = {.block_tokens = BT, .host_mem = 4 << 20, .prefix_cache = true};
    FUZZ_CHECK(kv_store_open(be, &geom, &sp, &s) == TIER_OK, "kv_store_open");
    return s;
}

/* Blocks of the chain the store holds in memory, from its start. */
static int64_t chain_in_memory(kv_store *s)
{
    uint64_t h[N_BLK];
    int64_t n_mem = 0;
    FUZZ_CHECK(kv_store_prefix_chain(s, &seq_params, chain_ids, N_BLK * BT + 1, h, &n_mem) == N_BLK, "chain");
    return n_mem;
}

static void block_name(int i, char ns[24], char name[24])
{
    snprintf(ns, 24, "p%x", NS);
    snprintf(name, 24, "%016" PRIx64, hashes[i]);
}

/* The chain computed in a store (KV a byte pattern, written through the
 * views as a step would), then serialized and wrapped as a publish does. */
static void chain_make(void)
{
    kv_store *s = store_open();
    block_bytes = kv_store_prefix_block_bytes(s);
    kv_seq *q;
    FUZZ_CHECK(kv_seq_create(s, &seq_params, &q) == TIER_OK, "kv_seq_create");
    FUZZ_CHECK(kv_seq_reserve(q, N_BLK * BT) == TIER_OK, "kv_seq_reserve");
    kv_seq_tokens(q, chain_ids);
    for (int l = 0; l < geom.n_layers; l++) {
        struct be_kv_view v;
        kv_seq_view(q, l, &v);
        FUZZ_CHECK(2 * v.v_offset * (size_t)geom.n_layers < block_bytes, "block of %zu bytes", 2 * v.v_offset);
        for (int b = 0; b < v.n_blocks; b++)
            for (size_t k = 0; k < 2 * v.v_offset; k++)
                ((uint8_t *)v.blocks[b])[k] = (uint8_t)(k * 7 + b * 13 + l * 29 + 1);
    }
    FUZZ_CHECK(kv_seq_commit(q) == TIER_OK, "kv_seq_commit");
    kv_seq_free(q);
    int64_t n_mem = 0;
    FUZZ_CHECK(kv_store_prefix_chain(s, &seq_params, chain_ids, N_BLK * BT + 1, hashes, &n_mem) == N_BLK &&
                   n_mem == N_BLK,
               "the chain is not cached (%lld blocks)", (long long)n_mem);
    struct kv_prefix_block blk[N_BLK];
    int64_t got = 0;
    bool done = false;
    FUZZ_CHECK(kv_store_prefix_ship(s, &seq_params, chain_ids, N_BLK, blk, N_BLK, &got, &done) == TIER_OK &&
                   got == N_BLK && done,
               "kv_store_prefix_ship: %lld blocks", (long long)got);
    layout = (struct kv_disk_layout){FINGERPRINT, geom.dtype, BT, (uint32_t)geom.n_layers,
                                     (uint32_t)geom.n_kv_heads, (uint32_t)geom.head_dim};
    for (int i = 0; i < N_BLK; i++) {
        char ns[24], name[24];
        block_name(i, ns, name);
        FUZZ_CHECK(blk[i].len == block_bytes && blk[i].hash == hashes[i], "block %d", i);
        FUZZ_CHECK((values[i] = disk_blob_encode(&layout, ns, name, blk[i].buf, blk[i].len, NULL, &value_len[i])),
                   "disk_blob_encode");
        free(blk[i].buf);
    }
    kv_store_free(s);
}

/* ---- seeds ---------------------------------------------------------------- */

static uint8_t *cat(uint8_t *p, size_t *n, const void *add, size_t len)
{
    p = realloc(p, *n + len);
    FUZZ_CHECK(p, "out of memory");
    memcpy(p + *n, add, len);
    *n += len;
    return p;
}

/* mode byte, then the value */
static void seed_value(const char *dir, const char *name, uint8_t mode, const uint8_t *v, size_t len)
{
    size_t n = 0;
    uint8_t *p = cat(NULL, &n, &mode, 1);
    p = cat(p, &n, v, len);
    fuzz_write(dir, name, p, n);
    free(p);
}

/* mode byte (a lookup of n_keys), then the replies: the chain's first
 * n_vals values as bulk strings, then tail */
static void seed_stream(const char *dir, const char *name, int n_keys, int n_vals, const char *tail)
{
    uint8_t mode = (uint8_t)(1 | (n_keys - 1) << 1);
    size_t n = 0;
    uint8_t *p = cat(NULL, &n, &mode, 1);
    for (int i = 0; i < n_vals; i++) {
        char h[32];
        int hl = snprintf(h, sizeof(h), "$%zu\r\n", value_len[i]);
        p = cat(p, &n, h, (size_t)hl);
        p = cat(p, &n, values[i], value_len[i]);
        p = cat(p, &n, "\r\n", 2);
    }
    p = cat(p, &n, tail, strlen(tail));
    fuzz_write(dir, name, p, n);
    free(p);
}

static void seeds_write(const char *dir)
{
    seed_value(dir, "value_raw", 0, values[0], value_len[0]);
    seed_value(dir, "value_raw_fix", 2, values[0], value_len[0]);
    seed_value(dir, "value_orphan", 2 | 1 << 2, values[1], value_len[1]); /* block 1: its parent is not cached */
    char ns[24], name[24];
    block_name(0, ns, name);
    uint8_t *blk = malloc(block_bytes);
    FUZZ_CHECK(blk, "out of memory");
    const void *data;
    size_t len;
    void *owned;
    char why[DISK_WHY_LEN];
    FUZZ_CHECK(disk_blob_decode(values[0], value_len[0], &layout, ns, name, block_bytes, dctx, &data, &len, &owned,
                                why) == DISK_VALID,
               "%s", why);
    memcpy(blk, data, len);
    memset(blk + len / 2, 0, len - len / 2); /* KV that compresses (KV is not hashed: the store takes it) */
    ZSTD_CCtx *cctx = ZSTD_createCCtx();
    FUZZ_CHECK(cctx, "out of memory");
    size_t zn;
    uint8_t *z = disk_blob_encode(&layout, ns, name, blk, len, cctx, &zn);
    FUZZ_CHECK(z && z[DISK_FIXED_LEN + 16] != DISK_CODEC_RAW, "a compressed seed");
    seed_value(dir, "value_zstd_fix", 2, z, zn);
    free(z);
    struct kv_disk_layout other = layout;
    other.fingerprint ^= 1;
    uint8_t *f = disk_blob_encode(&other, ns, name, blk, len, NULL, &zn);
    FUZZ_CHECK(f, "disk_blob_encode");
    seed_value(dir, "value_foreign", 2, f, zn);
    free(f);
    ZSTD_freeCCtx(cctx);
    free(blk);
    seed_stream(dir, "stream_chain", 3, 3, "");
    seed_stream(dir, "stream_two_then_nil", 3, 2, "$-1\r\n");
    seed_stream(dir, "stream_one", 1, 1, "");
    seed_stream(dir, "stream_error", 2, 1, "-ERR wrong\r\n");
    seed_stream(dir, "stream_oom_then_int", 3, 0, "-OOM command not allowed\r\n:1\r\n+OK\r\n");
    seed_stream(dir, "stream_long_bulk", 1, 0, "$999999999\r\nabc");
}

/* ---- the two paths ---------------------------------------------------------- */

/* kv_store_prefix_insert of a block, with the invariants above; true when taken. */
static bool insert(kv_store *s, const void *data, size_t len, int64_t held)
{
    enum tier_status st = kv_store_prefix_insert(s, data, len);
    if (st != TIER_OK) {
        FUZZ_CHECK(st == TIER_EINVAL || st == TIER_ECONFLICT || st == TIER_ENOMEM_DEV || st == TIER_ENOMEM_HOST,
                   "insert status %d", (int)st);
        FUZZ_CHECK(kv_store_errmsg(s)[0], "a refused block without a message");
        FUZZ_CHECK(kv_store_stats(s).prefix_entries == (uint64_t)held, "a refused block left an entry");
        return false;
    }
    FUZZ_CHECK(chain_in_memory(s) == held + 1, "a block taken that is not the chain's next (%lld in memory, %lld held)",
               (long long)chain_in_memory(s), (long long)held);
    return true;
}

static void fix_sums(uint8_t *v, size_t n)
{
    if (n < DISK_FIXED_LEN)
        return;
    uint32_t hdr_len = (uint32_t)v[12] | (uint32_t)v[13] << 8 | (uint32_t)v[14] << 16 | (uint32_t)v[15] << 24;
    if (hdr_len < DISK_FIXED_LEN + 8 || hdr_len > n)
        return;
    size_t n_chunks = (hdr_len - DISK_FIXED_LEN - 8) / DISK_ENTRY_LEN;
    for (size_t i = 0; i < n_chunks; i++) {
        uint8_t *e = v + DISK_FIXED_LEN + i * DISK_ENTRY_LEN;
        uint64_t off = 0, sum;
        uint32_t stored = 0;
        for (int b = 0; b < 8; b++)
            off |= (uint64_t)e[b] << (8 * b);
        for (int b = 0; b < 4; b++)
            stored |= (uint32_t)e[12 + b] << (8 * b);
        if (off > n || stored > n - off)
            continue;
        sum = XXH3_64bits(v + off, stored);
        for (int b = 0; b < 8; b++)
            e[24 + b] = (uint8_t)(sum >> (8 * b));
    }
    uint64_t sum = XXH3_64bits(v, hdr_len - 8);
    for (int b = 0; b < 8; b++)
        v[hdr_len - 8 + b] = (uint8_t)(sum >> (8 * b));
}

static void one_value(const uint8_t *in, size_t n, bool fix, int k)
{
    uint8_t *v = malloc(n ? n : 1);
    FUZZ_CHECK(v, "out of memory");
    memcpy(v, in, n);
    if (fix)
        fix_sums(v, n);
    char ns[24], name[24], why[DISK_WHY_LEN] = "";
    block_name(k, ns, name);
    const void *data = NULL;
    size_t len = 0;
    void *owned = (void *)1;
    enum disk_check dc = disk_blob_decode(v, n, &layout, ns, name, block_bytes, dctx, &data, &len, &owned, why);
    if (dc != DISK_VALID && getenv("KVTIER_FUZZ_VERBOSE"))
        fprintf(stderr, "value refused: %s\n", why);
    if (dc != DISK_VALID) {
        FUZZ_CHECK(dc == DISK_CORRUPT || dc == DISK_FOREIGN || dc == DISK_NOMEM, "decode status %d", dc);
        FUZZ_CHECK(why[0], "a refused value without a reason");
        FUZZ_CHECK(!owned, "a refused value left a buffer");
        free(v);
        return;
    }
    FUZZ_CHECK(len <= block_bytes, "%zu bytes accepted, a block is %zu", len, block_bytes);
    FUZZ_CHECK(owned ? data == owned : (const uint8_t *)data >= v && len <= n - (size_t)((const uint8_t *)data - v),
               "the data is neither in the value nor in its own buffer");
    size_t again_n;
    uint8_t *again = disk_blob_encode(&layout, ns, name, data, len, NULL, &again_n);
    FUZZ_CHECK(again, "disk_blob_encode");
    const void *data2;
    size_t len2;
    void *owned2;
    FUZZ_CHECK(disk_blob_decode(again, again_n, &layout, ns, name, block_bytes, dctx, &data2, &len2, &owned2, why) ==
                       DISK_VALID &&
                   !owned2 && len2 == len && !memcmp(data2, data, len),
               "re-encoded, the value does not decode to the same bytes");
    free(again);
    kv_store *s = store_open();
    bool taken = insert(s, data, len, 0);
    if (getenv("KVTIER_FUZZ_VERBOSE"))
        fprintf(stderr, "value of %zu bytes: %s\n", len, taken ? "taken" : kv_store_errmsg(s));
    kv_store_free(s);
    free(owned);
    free(v);
}

/* poll for input on fd; libFuzzer's -timeout alarm interrupts it (EINTR),
 * which is not the end of the wait. */
static int wait_in(int fd, int ms)
{
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int r;
    while ((r = poll(&pfd, 1, ms)) < 0 && errno == EINTR)
        ;
    return r;
}

/* The fake server's side of one connection: reads commands until it has
 * seen want GETEX (or the tier stops sending), then answers with out. */
static void serve(int fd, int want, const uint8_t *out, size_t n)
{
    static const char cmd[] = "$5\r\nGETEX\r\n";
    char buf[4096], carry[sizeof(cmd)] = "";
    int seen = 0;
    while (seen < want) {
        if (wait_in(fd, 2000) <= 0)
            break;
        ssize_t got = read(fd, buf + 0, sizeof(buf) - 1);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        buf[got] = '\0';
        /* a command split over reads: keep the last bytes for the next */
        char joined[sizeof(carry) + sizeof(buf)];
        int jl = snprintf(joined, sizeof(joined), "%s%s", carry, buf);
        for (const char *p = joined; (p = strstr(p, cmd)); p += sizeof(cmd) - 1)
            seen++;
        size_t keep = (size_t)jl < sizeof(cmd) - 1 ? (size_t)jl : sizeof(cmd) - 1;
        memcpy(carry, joined + jl - keep, keep);
        carry[keep] = '\0';
    }
    for (size_t off = 0; off < n;) {
        ssize_t w = send(fd, out + off, n - off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            break;
        off += (size_t)w;
    }
}

/* Closes the connections left waiting by earlier inputs' tiers (one that
 * reconnected before it was freed): unaccepted, they fill the backlog and
 * the next tier's connect is refused, then retried only after a backoff. */
static void drain(void)
{
    int fd;
    while ((fd = accept(listen_fd, NULL, NULL)) >= 0)
        close(fd);
}

static void one_lookup(int n_keys, const uint8_t *out, size_t n)
{
    drain();
    char url[128];
    snprintf(url, sizeof(url), "unix:%s", sock_path);
    struct kv_remote_params p = {.url = url, .timeout_ms = 2000, .block_bytes = block_bytes, .layout = layout,
                                 .variant = "w"};
    kv_remote *r;
    char err[256];
    FUZZ_CHECK(kv_remote_open(&p, &r, err) == TIER_OK, "kv_remote_open: %s", err);
    FUZZ_CHECK(wait_in(listen_fd, 5000) == 1, "the lookup thread did not connect");
    int fd = accept(listen_fd, NULL, NULL);
    FUZZ_CHECK(fd >= 0, "accept");
    kv_remote_fetch *f;
    FUZZ_CHECK(kv_remote_fetch_start(r, NS, hashes, n_keys, &f) == TIER_OK, "kv_remote_fetch_start");
    serve(fd, n_keys, out, n);
    close(fd);
    kv_remote_fetch_wait(f);
    bool done;
    int found = kv_remote_fetch_found(f);
    FUZZ_CHECK(found >= 0 && found <= n_keys && kv_remote_fetch_ready(f, &done) == found && done,
               "%d blocks found of %d asked", found, n_keys);
    struct kv_remote_stats st = kv_remote_stats(r);
    FUZZ_CHECK(st.lookups == 1 && st.hit_blocks == (uint64_t)found && st.miss_lookups == (found < n_keys),
               "stats: %llu lookups, %llu hits, %llu misses for %d of %d", (unsigned long long)st.lookups,
               (unsigned long long)st.hit_blocks, (unsigned long long)st.miss_lookups, found, n_keys);
    kv_store *s = store_open();
    int64_t held = 0;
    for (int i = 0; i < found; i++) {
        const void *data;
        size_t len;
        kv_remote_fetch_block(f, i, &data, &len);
        FUZZ_CHECK(data && len <= block_bytes, "block %d: %zu bytes", i, len);
        fuzz_touch(data, len);
        if (!insert(s, data, len, held))
            break;
        held++;
    }
    if (getenv("KVTIER_FUZZ_VERBOSE"))
        fprintf(stderr, "lookup of %d: %d found, %lld taken\n", n_keys, found, (long long)held);
    kv_store_free(s);
    kv_remote_fetch_free(f);
    kv_remote_free(r);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    signal(SIGPIPE, SIG_IGN);
    log_open(NULL, LOG_ERR); /* the tier logs each refused value and lost connection */
    be = mem_backend(4 << 20);
    FUZZ_CHECK((dctx = ZSTD_createDCtx()), "out of memory");
    chain_make();
    snprintf(sock_path, sizeof(sock_path), "%s/redis.sock", fuzz_dir("remote"));
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", sock_path);
    listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
    FUZZ_CHECK(listen_fd >= 0 && bind(listen_fd, (struct sockaddr *)&a, sizeof(a)) == 0 && listen(listen_fd, 4) == 0,
               "the fake server's socket %s", sock_path);
    const char *seeds = getenv("KVTIER_FUZZ_REMOTE_SEEDS");
    if (seeds)
        seeds_write(seeds);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1 || size > (4 << 20))
        return 0;
    if (data[0] & 1)
        one_lookup(1 + (data[0] >> 1) % N_BLK, data + 1, size - 1);
    else
        one_value(data + 1, size - 1, data[0] & 2, (data[0] >> 2) % N_BLK);
    return 0;
}
