/* Description: the remote tier's pure parts, without a Redis: a value
 * (disk_blob_encode) round-trips, one chunk and several, raw and
 * zstd-compressed; a value claiming more data than a block holds, and a
 * compressed chunk that does not decompress, are corrupt; each kind of
 * damage (a header byte, a data byte, truncation, extension, another
 * object's name) is DISK_CORRUPT and another layout DISK_FOREIGN; the
 * CRC16 hash slot matches Redis Cluster's (its reference vector, and
 * {hash tags}); a tier opened on an address nobody serves looks a chain
 * up as a miss within its timeout (nothing ready, done), and refuses
 * addresses that do not parse.  tests/daemon_remote.test.sh runs it against real servers.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <xxhash.h>
#include <zstd.h>

#include "tiers/disk_format.h"
#include "tiers/remote.h"

static const struct kv_disk_layout LAYOUT = {0x1234abcd5678ef01ull, BE_BF16, 16, 2, 2, 64};

static enum disk_check decode(const uint8_t *blob, size_t n, const struct kv_disk_layout *l, const char *ns,
                              const char *name, const void **out, size_t *out_len, void **owned)
{
    static ZSTD_DCtx *dctx;
    char why[DISK_WHY_LEN];
    if (!dctx)
        assert_non_null(dctx = ZSTD_createDCtx());
    free(*owned);
    return disk_blob_decode(blob, n, l, ns, name, (size_t)4 << 20, dctx, out, out_len, owned, why);
}

/* bytes that compress: a bf16 ramp with a noisy low byte */
static void roundtrip(size_t len, ZSTD_CCtx *cctx)
{
    uint8_t *data = malloc(len);
    assert_non_null(data);
    for (size_t i = 0; i < len; i++)
        data[i] = i % 2 ? (uint8_t)(0x3f + (i / 4096) % 2) : (uint8_t)(i * 31 + 7);
    size_t n = 0;
    uint8_t *blob = disk_blob_encode(&LAYOUT, "p3e9", "00000000deadbeef", data, len, cctx, &n);
    assert_non_null(blob);
    assert_int_equal(n % DISK_ALIGN, 0);
    /* compressed: smaller than the raw container, and the table says so */
    size_t raw_n = (size_t)(disk_data_off(disk_n_chunks(len), 0) + disk_align(len - DISK_CHUNK * (len > DISK_CHUNK)) +
                            (len > DISK_CHUNK ? DISK_CHUNK : 0));
    assert_true(cctx ? n < raw_n : n == raw_n);
    const void *out;
    size_t out_len;
    void *owned = NULL;
    assert_int_equal(decode(blob, n, &LAYOUT, "p3e9", "00000000deadbeef", &out, &out_len, &owned), DISK_VALID);
    assert_int_equal(out_len, len);
    assert_memory_equal(out, data, len);
    assert_true(cctx ? owned == out : owned == NULL);
    free(owned);
    owned = NULL;
    char why[DISK_WHY_LEN];
    assert_int_equal(disk_blob_decode(blob, n, &LAYOUT, "p3e9", "00000000deadbeef", len - 1, NULL, &out, &out_len,
                                      &owned, why),
                     DISK_CORRUPT); /* more than the caller expects: refused before it is allocated */
    assert_null(owned);

    struct kv_disk_layout other = LAYOUT;
    other.dtype = BE_F32;
    assert_int_equal(decode(blob, n, &other, "p3e9", "00000000deadbeef", &out, &out_len, &owned), DISK_FOREIGN);
    other = LAYOUT;
    other.fingerprint++;
    assert_int_equal(decode(blob, n, &other, "p3e9", "00000000deadbeef", &out, &out_len, &owned), DISK_FOREIGN);
    assert_int_equal(decode(blob, n, &LAYOUT, "p3e9", "00000000deadbeee", &out, &out_len, &owned), DISK_CORRUPT);
    assert_int_equal(decode(blob, n, &LAYOUT, "p3ea", "00000000deadbeef", &out, &out_len, &owned), DISK_CORRUPT);
    assert_int_equal(decode(blob, n - 1, &LAYOUT, "p3e9", "00000000deadbeef", &out, &out_len, &owned), DISK_CORRUPT);
    assert_int_equal(decode(blob, 100, &LAYOUT, "p3e9", "00000000deadbeef", &out, &out_len, &owned), DISK_CORRUPT);
    /* a header byte, a table byte, the first stored byte and the last */
    size_t first = (size_t)disk_data_off(disk_n_chunks(len), 0);
    size_t at[] = {20, 230, first, cctx ? first + 5 : first + len - 1};
    for (size_t k = 0; k < sizeof(at) / sizeof(at[0]); k++) {
        blob[at[k]] ^= 0x10;
        assert_int_equal(decode(blob, n, &LAYOUT, "p3e9", "00000000deadbeef", &out, &out_len, &owned), DISK_CORRUPT);
        blob[at[k]] ^= 0x10;
    }
    uint8_t *longer = calloc(1, n + DISK_ALIGN);
    assert_non_null(longer);
    memcpy(longer, blob, n);
    assert_int_equal(decode(longer, n + DISK_ALIGN, &LAYOUT, "p3e9", "00000000deadbeef", &out, &out_len, &owned),
                     DISK_CORRUPT);
    free(longer);
    free(owned);
    free(blob);
    free(data);
}

/* A compressed chunk whose checksum is right but whose bytes are not a
 * zstd frame of its length (written by another program, or a bug) is
 * corrupt: the checksum alone does not make it loadable. */
static void test_blob_bad_frame(void **state)
{
    (void)state;
    ZSTD_CCtx *cctx = ZSTD_createCCtx();
    assert_non_null(cctx);
    size_t len = 20000, n = 0;
    uint8_t *data = calloc(1, len);
    assert_non_null(data);
    uint8_t *blob = disk_blob_encode(&LAYOUT, "p1", "0000000000000001", data, len, cctx, &n);
    assert_non_null(blob);
    size_t first = (size_t)disk_data_off(1, 0);
    uint32_t stored;
    memcpy(&stored, blob + DISK_FIXED_LEN + 12, 4);
    assert_true(stored > 8 && stored < len);
    blob[first + stored - 1] ^= 0x01; /* the frame's last byte, then the checksums re-made */
    uint64_t sum = XXH3_64bits(blob + first, stored);
    memcpy(blob + DISK_FIXED_LEN + 24, &sum, 8);
    size_t hl = disk_hdr_size(1);
    sum = XXH3_64bits(blob, hl - 8);
    memcpy(blob + hl - 8, &sum, 8);
    const void *out;
    size_t out_len;
    void *owned = NULL;
    assert_int_equal(decode(blob, n, &LAYOUT, "p1", "0000000000000001", &out, &out_len, &owned), DISK_CORRUPT);
    assert_null(owned);
    free(blob);
    free(data);
    ZSTD_freeCCtx(cctx);
}

static void test_blob(void **state)
{
    (void)state;
    ZSTD_CCtx *cctx = ZSTD_createCCtx();
    assert_non_null(cctx);
    roundtrip(5000, NULL);
    roundtrip(DISK_CHUNK + 12345, NULL); /* two chunks: the data stays contiguous */
    roundtrip(5000, cctx);
    roundtrip(DISK_CHUNK + 12345, cctx);
    ZSTD_freeCCtx(cctx);
}

static void test_slot(void **state)
{
    (void)state;
    /* the CRC16 of Redis Cluster's specification: "123456789" -> 0x31c3 */
    assert_int_equal(kv_remote_slot("123456789", 9), 0x31c3);
    assert_int_equal(kv_remote_slot("{user1000}.following", 20), kv_remote_slot("user1000", 8));
    assert_true(kv_remote_slot("kvt:0123:d2:p1:ffff", 19) < 16384);
}

static void test_unreachable(void **state)
{
    (void)state;
    struct kv_remote_params p = {.url = "unix:/nonexistent/kvtier-test.sock", .timeout_ms = 100, .layout = LAYOUT};
    kv_remote *r;
    char err[256];
    assert_int_equal(kv_remote_open(&p, &r, err), TIER_OK);
    uint64_t h[3] = {1, 2, 3};
    kv_remote_fetch *f;
    assert_int_equal(kv_remote_fetch_start(r, 1, h, 3, &f), TIER_OK);
    kv_remote_fetch_wait(f);
    assert_int_equal(kv_remote_fetch_found(f), 0);
    bool done = false;
    assert_int_equal(kv_remote_fetch_ready(f, &done), 0);
    assert_true(done);
    kv_remote_fetch_free(f);
    struct kv_remote_stats st = kv_remote_stats(r);
    assert_int_equal(st.lookups, 1);
    assert_int_equal(st.miss_lookups, 1);
    /* the lookup thread connects as it starts; the lookup retries only
     * if it came after the first backoff (a loaded machine) */
    assert_true(st.errors[KV_REMOTE_E_CONNECT] >= 1 && st.errors[KV_REMOTE_E_CONNECT] <= 2);
    char key[160];
    kv_remote_key(r, 0x3e9, 0xdeadbeef, key);
    assert_string_equal(key, "kvt:1234abcd5678ef01:d2.b16.l2.h2.k64.:p3e9:00000000deadbeef");
    kv_remote_free(r);

    static const char *const bad[] = {"http://x", "redis://", "redis://h:0", "redis://h:99999", "redis://u@h",
                                      "redis://h/x", "unix:"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        p.url = bad[i];
        assert_int_equal(kv_remote_open(&p, &r, err), TIER_EINVAL);
        assert_true(err[0] != '\0');
    }
    p.url = NULL;
    /* addresses, not names: the lookup thread connects at open, and a
     * name would wait on the resolver */
    p.cluster = "127.0.0.1:1,127.0.0.1";
    assert_int_equal(kv_remote_open(&p, &r, err), TIER_OK);
    kv_remote_free(r);
    p.cluster = "a:1,:2";
    assert_int_equal(kv_remote_open(&p, &r, err), TIER_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_blob),
        cmocka_unit_test(test_blob_bad_frame),
        cmocka_unit_test(test_slot),
        cmocka_unit_test(test_unreachable),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
