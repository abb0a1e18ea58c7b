/* Description: the remote tier's pure parts, without a Redis: a value
 * (disk_blob_encode) round-trips, one chunk and several, raw and
 * zstd-compressed; a value claiming more data than a block holds, and a
 * compressed chunk that does not decompress, are corrupt; each kind of
 * damage (a header byte, a data byte, truncation, extension, another
 * object's name) is DISK_CORRUPT and another layout DISK_FOREIGN; the
 * CRC16 hash slot matches Redis Cluster's (its reference vector, and
 * {hash tags}); a tier opened on an address nobody serves looks a chain
 * up as a miss within its timeout (nothing ready, done), and refuses
 * addresses that do not parse; a server that trickles a reply a byte
 * at a time is a miss within about the timeout, and one that answers SET
 * with a 100 GB bulk costs no allocation.  tests/daemon_remote.test.sh
 * runs it against real servers.
 */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
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

/* A server that is no Redis: each command it is sent gets the mode's
 * answer, on every connection, until the test closes its socket. */
struct fake {
    int lfd;
    const char *reply; /* written whole */
    bool trickle;      /* then a byte every 20 ms, forever */
    pthread_t th;
};

static void *fake_main(void *arg)
{
    struct fake *f = arg;
    int c;
    while ((c = accept(f->lfd, NULL, NULL)) >= 0) {
        char buf[65536];
        while (read(c, buf, sizeof(buf)) > 0) { /* one reply per burst of commands */
            if (send(c, f->reply, strlen(f->reply), MSG_NOSIGNAL) < 0)
                break;
            for (int i = 0; f->trickle && i < 500 && send(c, "x", 1, MSG_NOSIGNAL) == 1; i++)
                usleep(20 * 1000);
        }
        close(c);
    }
    return NULL;
}

/* Starts f on a socket of its own (path, 64 bytes) and a tier on it
 * whose timeout is 200 ms. */
static kv_remote *fake_tier(struct fake *f, char *path)
{
    snprintf(path, 64, "/tmp/kvtier-fake-%d.sock", (int)getpid());
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
    unlink(path);
    assert_true((f->lfd = socket(AF_UNIX, SOCK_STREAM, 0)) >= 0);
    assert_int_equal(bind(f->lfd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(f->lfd, 8), 0);
    assert_int_equal(pthread_create(&f->th, NULL, fake_main, f), 0);
    char url[80], err[256];
    snprintf(url, sizeof(url), "unix:%s", path);
    struct kv_remote_params p = {.url = url, .timeout_ms = 200, .layout = LAYOUT};
    kv_remote *r;
    assert_int_equal(kv_remote_open(&p, &r, err), TIER_OK);
    return r;
}

static void fake_stop(struct fake *f, const char *path)
{
    shutdown(f->lfd, SHUT_RDWR);
    close(f->lfd);
    pthread_join(f->th, NULL);
    unlink(path);
}

/* A server that answers a lookup one byte at a time, each byte sooner
 * than the timeout: the reply as a whole is bounded by it, so the lookup
 * ends as a miss within about that (and a stop is never held up). */
static void test_trickle(void **state)
{
    (void)state;
    char path[64];
    struct fake f = {.reply = "$100000\r\n", .trickle = true};
    kv_remote *r = fake_tier(&f, path);
    uint64_t h = 1;
    kv_remote_fetch *fe;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(kv_remote_fetch_start(r, 1, &h, 1, &fe), TIER_OK);
    kv_remote_fetch_wait(fe);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    assert_int_equal(kv_remote_fetch_found(fe), 0);
    kv_remote_fetch_free(fe);
    assert_true(kv_remote_stats(r).errors[KV_REMOTE_E_TIMEOUT] >= 1);
    assert_true(s < 3.0); /* unbounded, 500 bytes at 20 ms each would take 10 s */
    kv_remote_free(r);
    fake_stop(&f, path);
}

/* A server that answers SET with a bulk claiming 100 GB: the publish
 * reads past it without allocating it (sanitizers abort on the attempt). */
static void test_set_huge_bulk(void **state)
{
    (void)state;
    char path[64];
    struct fake f = {.reply = "$99999999999\r\n"};
    kv_remote *r = fake_tier(&f, path);
    struct kv_prefix_block b = {.buf = calloc(1, 64), .len = 64, .ns = 1, .hash = 2};
    assert_non_null(b.buf);
    assert_true(kv_remote_publish(r, &b));
    for (int i = 0; i < 300 && !(kv_remote_stats(r).errors[KV_REMOTE_E_TIMEOUT] +
                                 kv_remote_stats(r).errors[KV_REMOTE_E_IO]); i++)
        usleep(10 * 1000);
    struct kv_remote_stats st = kv_remote_stats(r);
    assert_int_equal(st.published, 0);
    assert_true(st.errors[KV_REMOTE_E_TIMEOUT] + st.errors[KV_REMOTE_E_IO] >= 1);
    kv_remote_free(r);
    fake_stop(&f, path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_blob),
        cmocka_unit_test(test_blob_bad_frame),
        cmocka_unit_test(test_slot),
        cmocka_unit_test(test_unreachable),
        cmocka_unit_test(test_trickle),
        cmocka_unit_test(test_set_huge_bulk),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
