/* Description: the disk tier (tiers/disk.c) in a scratch directory on a
 * filesystem that takes O_DIRECT (/tmp) and on tmpfs (/dev/shm, buffered):
 * round trips of every size and codec, replace, remove, scan; every kind
 * of damage (a header, chunk-table, meta or chunk byte, truncation,
 * another object's file, zeros) quarantined with a message naming the
 * file while the other objects still read; files of another layout left
 * alone; the fault sweep over io_uring submissions (EIO and ENOSPC, once
 * and from N on); the budget; a writer killed with -9 mid-write.  Every
 * test runs with the callers' buffers as the daemon passes them (puts from
 * 4 KiB-aligned data, gets into an allocator's aligned buffers: raw chunks
 * in place) and, on /tmp, with unaligned ones (everything staged).
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <dirent.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "tiers/disk.h"
#include "tiers/disk_format.h"
#include "util/half.h"

#define MIB ((size_t)1 << 20)

static const struct kv_disk_layout LAYOUT = {0x1234abcd5678ef01ull, BE_BF16, 16, 2, 2, 64};

/* ---- helpers -------------------------------------------------------------- */

static int rm_one(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb, (void)type, (void)ftw;
    return remove(path);
}

/* How the helpers pass data buffers: as the test made them (malloc) with
 * kv_disk_get; 4 KiB-aligned copies and kv_disk_get_into an aligned
 * allocator; or copies and buffers 16 bytes off alignment. */
enum bufs { BUFS_PLAIN, BUFS_ALIGNED, BUFS_UNALIGNED };
static enum bufs g_bufs;
static atomic_int g_live; /* allocator buffers not freed yet */

/* Also checks that every buffer a get allocated was freed, failed gets'
 * included. */
static void rm_rf(const char *path)
{
    nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    assert_int_equal(atomic_load(&g_live), 0);
}

/* A fresh directory under the test's state: "/tmp" (O_DIRECT), or
 * "/dev/shm" with the buffered path forced (tmpfs takes O_DIRECT since
 * Linux 6.6); "+aligned" / "+unaligned" set g_bufs. */
static void scratch(void **state, char *out, size_t cap)
{
    const char *st = *state;
    char base[64];
    snprintf(base, sizeof base, "%.*s", (int)strcspn(st, "+"), st);
    g_bufs = strstr(st, "+unaligned") ? BUFS_UNALIGNED : strstr(st, "+aligned") ? BUFS_ALIGNED : BUFS_PLAIN;
    snprintf(out, cap, "%s/kvtier-disk-XXXXXX", base);
    assert_non_null(mkdtemp(out));
    if (!strcmp(base, "/dev/shm"))
        setenv("KVTIER_DISK_BUFFERED", "1", 1);
    else
        unsetenv("KVTIER_DISK_BUFFERED");
}

static bool on_shm(void **state)
{
    return !strncmp((const char *)*state, "/dev/shm", 8);
}

/* The allocator of the caller-buffer modes: arg NULL aligned, else 16
 * bytes off; a header before the data records the offset. */
static void *buf_alloc(void *arg, size_t len, void **data)
{
    size_t off = arg ? 16 : 0;
    uint8_t *p = NULL;
    if (posix_memalign((void **)&p, 4096, len + 4096) != 0)
        return NULL;
    *data = p + 4096 - off;
    atomic_fetch_add(&g_live, 1);
    return p;
}

static void buf_free(void *arg, void *buf)
{
    (void)arg;
    atomic_fetch_sub(&g_live, 1);
    free(buf);
}

static const int UNALIGNED_ARG = 1;

/* A copy of data laid out as g_bufs says (*base to free), or data itself. */
static const void *put_buffer(const void *data, size_t n, void **base)
{
    *base = NULL;
    if (g_bufs == BUFS_PLAIN || !n)
        return data;
    size_t off = g_bufs == BUFS_UNALIGNED ? 16 : 0;
    uint8_t *p = NULL;
    assert_int_equal(posix_memalign((void **)&p, 4096, n + 4096), 0);
    memcpy(p + off, data, n);
    *base = p;
    return p + off;
}

/* kv_disk_get, or kv_disk_get_into the test allocator. */
static enum tier_status start_get(kv_disk *d, const char *ns, const char *name, kv_disk_op **op)
{
    if (g_bufs == BUFS_PLAIN)
        return kv_disk_get(d, ns, name, op);
    struct kv_disk_alloc a = {buf_alloc, buf_free, g_bufs == BUFS_UNALIGNED ? (void *)&UNALIGNED_ARG : NULL};
    return kv_disk_get_into(d, ns, name, &a, op);
}

/* Takes a done get's meta and data; *buf to pass to drop_data. */
static void take(kv_disk_op *op, void **m, size_t *ml, void **buf, void **dd, size_t *dl)
{
    if (g_bufs == BUFS_PLAIN) {
        kv_disk_op_take(op, m, ml, dd, dl);
        *buf = *dd;
        return;
    }
    kv_disk_op_take_buf(op, m, ml, buf, dd, dl);
    assert_true(!*dl || *buf);
    if (*dl)
        assert_int_equal((uintptr_t)*dd % 4096, g_bufs == BUFS_UNALIGNED ? 4096 - 16 : 0);
}

static void drop_data(void *buf)
{
    if (g_bufs == BUFS_PLAIN)
        free(buf);
    else if (buf)
        buf_free(NULL, buf);
}

static atomic_int g_notified;

static void on_notify(void *arg)
{
    (void)arg;
    atomic_fetch_add(&g_notified, 1);
}

/* The tier wakes its caller after marking an op done, so a caller that
 * saw the op done may still be ahead of the last notification: wait for
 * it (at most 5 s). */
static int notified_at_least(int n)
{
    for (int i = 0; i < 1000 && atomic_load(&g_notified) < n; i++)
        usleep(5000);
    return atomic_load(&g_notified);
}

static kv_disk *open_tier(const char *dir, enum kv_disk_compress c, size_t budget, struct kv_disk_layout lay)
{
    struct kv_disk_params p = {.dir = dir, .budget = budget, .compress = c, .layout = lay,
                               .notify = on_notify};
    kv_disk *d = NULL;
    enum tier_status st = kv_disk_open(&p, &d);
    assert_int_equal(st, TIER_OK);
    assert_non_null(d);
    return d;
}

/* KV-like bytes: normal values as bf16 (a trailing odd byte random). */
static uint8_t *kv_bytes(size_t n, uint64_t seed)
{
    uint8_t *p = malloc(n ? n : 1);
    assert_non_null(p);
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i + 1 < n; i += 2) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        double u1 = ((s >> 11) + 1.0) / 9007199254740993.0;
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        double u2 = (s >> 11) / 9007199254740992.0;
        uint16_t b = f32_to_bf16((float)(0.5 * sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2)));
        memcpy(p + i, &b, 2);
    }
    if (n % 2)
        p[n - 1] = (uint8_t)(s >> 40);
    return p;
}

static enum tier_status put(kv_disk *d, const char *ns, const char *name, const void *meta, size_t meta_len,
                            const void *data, size_t n, bool cold)
{
    void *base;
    struct kv_disk_obj o = {.meta = meta, .meta_len = meta_len, .data = put_buffer(data, n, &base), .data_len = n,
                            .cold = cold};
    kv_disk_op *op = NULL;
    enum tier_status st = kv_disk_put(d, ns, name, &o, &op);
    if (st != TIER_OK) {
        assert_null(op);
        free(base);
        return st;
    }
    st = kv_disk_op_wait(op);
    kv_disk_op_free(op);
    free(base);
    return st;
}

/* Gets ns/name; on success compares with meta/data, else copies the
 * message to msg. */
static enum tier_status get_cmp(kv_disk *d, const char *ns, const char *name, const char *meta, const void *data,
                                size_t n, char *msg, size_t cap)
{
    kv_disk_op *op = NULL;
    assert_int_equal(start_get(d, ns, name, &op), TIER_OK);
    enum tier_status st = kv_disk_op_wait(op);
    assert_true(kv_disk_op_done(op));
    assert_int_equal(kv_disk_op_status(op), st);
    if (msg)
        snprintf(msg, cap, "%s", kv_disk_op_errmsg(op));
    if (st == TIER_OK) {
        void *m, *dd, *buf;
        size_t ml, dl;
        take(op, &m, &ml, &buf, &dd, &dl);
        assert_int_equal(ml, meta ? strlen(meta) : 0);
        if (ml)
            assert_memory_equal(m, meta, ml);
        assert_int_equal(dl, n);
        if (n)
            assert_memory_equal(dd, data, n);
        free(m);
        drop_data(buf);
    }
    kv_disk_op_free(op);
    return st;
}

/* Gets ns/name: TIER_OK when it reads as one of the two versions (meta
 * "v1" / "v2"), the status otherwise; any other content fails the test. */
static enum tier_status get_either(kv_disk *d, const char *ns, const char *name, const uint8_t *v1,
                                   const uint8_t *v2, size_t n, char *msg, size_t cap)
{
    kv_disk_op *op = NULL;
    assert_int_equal(start_get(d, ns, name, &op), TIER_OK);
    enum tier_status st = kv_disk_op_wait(op);
    snprintf(msg, cap, "%s", kv_disk_op_errmsg(op));
    if (st == TIER_OK) {
        void *m, *dd, *buf;
        size_t ml, dl;
        take(op, &m, &ml, &buf, &dd, &dl);
        assert_int_equal(ml, 2);
        assert_int_equal(dl, n);
        assert_true(!memcmp(m, "v1", 2) || !memcmp(m, "v2", 2));
        assert_memory_equal(dd, !memcmp(m, "v1", 2) ? v1 : v2, n);
        free(m);
        drop_data(buf);
    }
    kv_disk_op_free(op);
    return st;
}

static void get_ok(kv_disk *d, const char *ns, const char *name, const char *meta, const void *data, size_t n)
{
    char msg[640];
    enum tier_status st = get_cmp(d, ns, name, meta, data, n, msg, sizeof msg);
    if (st != TIER_OK)
        fail_msg("get %s/%s: %d %s", ns, name, st, msg);
}

/* Entries of a directory whose names start with prefix ("" = all). */
static int count_entries(const char *dir, const char *prefix)
{
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && !strncmp(e->d_name, prefix, strlen(prefix)))
            n++;
    closedir(d);
    return n;
}

static int count_quarantined(const char *dir)
{
    char q[512];
    snprintf(q, sizeof q, "%s/quarantine", dir);
    return count_entries(q, "");
}

static int count_tmp(const char *dir, const char *ns)
{
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, ns);
    return count_entries(p, ".");
}

static void obj_path(char *out, size_t cap, const char *dir, const char *ns, const char *name)
{
    snprintf(out, cap, "%s/%s/%s.kvt", dir, ns, name);
}

static off_t file_size(const char *path)
{
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    return sb.st_size;
}

static void flip_byte(const char *path, off_t off)
{
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    uint8_t b;
    assert_int_equal(pread(fd, &b, 1, off), 1);
    b ^= 0x5a;
    assert_int_equal(pwrite(fd, &b, 1, off), 1);
    close(fd);
}

static uint64_t read_u64(const char *path, off_t off)
{
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    uint8_t b[8];
    assert_int_equal(pread(fd, b, 8, off), 8);
    close(fd);
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)b[i] << (8 * i);
    return v;
}

static void copy_file(const char *from, const char *to)
{
    int a = open(from, O_RDONLY), b = open(to, O_WRONLY | O_TRUNC);
    assert_true(a >= 0 && b >= 0);
    char buf[65536];
    ssize_t n;
    while ((n = read(a, buf, sizeof buf)) > 0)
        assert_int_equal(write(b, buf, (size_t)n), n);
    close(a);
    close(b);
}

/* ---- round trips ------------------------------------------------------- */

static void test_roundtrip(void **state)
{
    char dir[256];
    scratch(state, dir, sizeof dir);
    static const size_t sizes[] = {0, 1, 4095, 4096, MIB + 1, 10 * MIB};
    static const enum kv_disk_compress modes[] = {KV_DISK_COMPRESS_NEVER, KV_DISK_COMPRESS_ALWAYS,
                                                  KV_DISK_COMPRESS_AUTO, KV_DISK_COMPRESS_AUTO};
    for (int m = 0; m < 4; m++) {
        atomic_store(&g_notified, 0);
        kv_disk *d = open_tier(dir, modes[m], 0, LAYOUT);
        bool cold = m == 2;
        bool compresses = modes[m] == KV_DISK_COMPRESS_ALWAYS || cold;
        struct kv_disk_stats s0 = kv_disk_stats(d);
        assert_true(s0.budget > 0); /* a quarter of the free space */
        assert_int_equal(s0.direct, !on_shm(state));
        for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
            char name[32], meta[64];
            snprintf(name, sizeof name, "obj%zu-%d", i, m);
            snprintf(meta, sizeof meta, "{\"size\": %zu, \"mode\": %d}", sizes[i], m);
            uint8_t *data = kv_bytes(sizes[i], i + 10 * (size_t)m);
            assert_int_equal(put(d, "ns1", name, meta, strlen(meta), data, sizes[i], cold), TIER_OK);
            get_ok(d, "ns1", name, meta, data, sizes[i]);
            free(data);
        }
        struct kv_disk_stats s = kv_disk_stats(d);
        assert_int_equal(s.puts, 6);
        assert_int_equal(s.gets, 6);
        assert_int_equal(s.failures, 0);
        assert_int_equal(s.files, s0.files + 6);
        if (compresses) {
            /* the bf16 exponents shrink: every chunk but the one-byte and tiny ones */
            assert_true(s.raw_compressed >= 11 * MIB);
            assert_true(s.stored_compressed < s.raw_compressed * 9 / 10);
            assert_true(s.compress_s > 0);
        } else {
            assert_int_equal(s.raw_compressed, 0);
            assert_int_equal(s.stored_compressed, 0);
            /* in place: the puts' whole-page chunks (sizes 4096, MIB + 1,
             * 10 MiB: 1 + 1 + 10; a tail goes staged) and every chunk of
             * the gets (1 + 1 + 1 + 2 + 10) */
            if (g_bufs == BUFS_ALIGNED)
                assert_int_equal(s.chunks_in_place, 12 + 15);
            else if (g_bufs == BUFS_UNALIGNED)
                assert_int_equal(s.chunks_in_place, 0);
            else
                assert_true(s.chunks_in_place >= 15); /* kv_disk_get's own buffers are aligned */
            /* registered with the ring while in flight, where it can be */
            if (s.register_caller && g_bufs == BUFS_ALIGNED)
                assert_int_equal(s.registered, 3 + 5);
            if (g_bufs == BUFS_UNALIGNED)
                assert_int_equal(s.registered, 0);
        }
        kv_disk_free(d);
        /* one per op done, and one per window of chunks a get checked */
        assert_true(atomic_load(&g_notified) >= 12 + 5);
        assert_int_equal(count_tmp(dir, "ns1"), 0);
    }
    /* a reopened tier counts the files it finds, and reads them */
    kv_disk *d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    struct kv_disk_stats s = kv_disk_stats(d);
    assert_int_equal(s.files, 24);
    uint64_t used = 0;
    char path[512];
    for (int m = 0; m < 4; m++)
        for (size_t i = 0; i < 6; i++) {
            char name[32];
            snprintf(name, sizeof name, "obj%zu-%d", i, m);
            obj_path(path, sizeof path, dir, "ns1", name);
            used += (uint64_t)file_size(path);
            assert_int_equal(file_size(path) % 4096, 0);
        }
    assert_int_equal(s.used, used);
    uint8_t *data = kv_bytes(10 * MIB, 5 + 10 * 2);
    get_ok(d, "ns1", "obj5-2", "{\"size\": 10485760, \"mode\": 2}", data, 10 * MIB);
    free(data);
    kv_disk_free(d);
    rm_rf(dir);
}

static void *no_alloc(void *arg, size_t len, void **data)
{
    (void)arg, (void)len, (void)data;
    return NULL;
}

struct deferred {
    atomic_int runs;
    pthread_t th;
    void *p;
};

static void on_defer(void *arg, void *p)
{
    struct deferred *df = arg;
    df->th = pthread_self();
    df->p = p;
    atomic_fetch_add(&df->runs, 1);
}

/* A get whose allocator fails is TIER_ENOMEM_HOST and leaves the file
 * alone; a buffer of a get that is freed untaken, or that fails its
 * checks, goes back to the allocator; a deferred call runs on the I/O
 * thread after the ops queued before it. */
static void test_caller_buffers(void **state)
{
    char dir[256];
    scratch(state, dir, sizeof dir);
    kv_disk *d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    size_t n = 3 * MIB + 100;
    uint8_t *data = kv_bytes(n, 41);
    assert_int_equal(put(d, "ns", "a", "m", 1, data, n, false), TIER_OK);
    kv_disk_op *op = NULL;
    assert_int_equal(kv_disk_get_into(d, "ns", "a", &(struct kv_disk_alloc){no_alloc, buf_free, NULL}, &op), TIER_OK);
    assert_int_equal(kv_disk_op_wait(op), TIER_ENOMEM_HOST);
    assert_non_null(strstr(kv_disk_op_errmsg(op), "ns/a.kvt"));
    kv_disk_op_free(op);
    assert_int_equal(kv_disk_get_into(d, "ns", "a", &(struct kv_disk_alloc){buf_alloc, NULL, NULL}, &op), TIER_EINVAL);
    assert_null(op);
    assert_int_equal(kv_disk_stats(d).quarantined, 0);
    /* freed untaken */
    assert_int_equal(kv_disk_get_into(d, "ns", "a", &(struct kv_disk_alloc){buf_alloc, buf_free, NULL}, &op), TIER_OK);
    assert_int_equal(kv_disk_op_wait(op), TIER_OK);
    assert_int_equal(atomic_load(&g_live), 1);
    kv_disk_op_free(op);
    assert_int_equal(atomic_load(&g_live), 0);
    get_ok(d, "ns", "a", "m", data, n);
    /* the tail's padding is read in place: past data_len, within the
     * allocation, zeros */
    assert_int_equal(kv_disk_get_into(d, "ns", "a", &(struct kv_disk_alloc){buf_alloc, buf_free, NULL}, &op), TIER_OK);
    assert_int_equal(kv_disk_op_wait(op), TIER_OK);
    void *m, *buf, *dd;
    size_t ml, dl;
    kv_disk_op_take_buf(op, &m, &ml, &buf, &dd, &dl);
    kv_disk_op_free(op);
    assert_int_equal(dl, n);
    assert_int_equal(kv_disk_data_alloc_len(n), 3 * MIB + 4096);
    assert_memory_equal(dd, data, n);
    for (size_t i = n; i < kv_disk_data_alloc_len(n); i++)
        assert_int_equal(((uint8_t *)dd)[i], 0);
    free(m);
    buf_free(NULL, buf);
    assert_int_equal(kv_disk_data_alloc_len(0), 0);
    assert_int_equal(kv_disk_data_alloc_len(4096), 4096);
    /* after a get of a damaged chunk, its buffer is freed too */
    char path[512];
    obj_path(path, sizeof path, dir, "ns", "a");
    flip_byte(path, file_size(path) - 4096 - 5); /* in the last full chunk's tail */
    char msg[640];
    assert_int_equal(get_cmp(d, "ns", "a", "m", data, n, msg, sizeof msg), TIER_EIO);
    assert_non_null(strstr(msg, "checksum mismatch"));
    assert_int_equal(atomic_load(&g_live), 0);
    /* deferred: after the put queued before it, on the I/O thread */
    struct deferred df = {0};
    kv_disk_op *pop = NULL;
    void *pbase;
    struct kv_disk_obj o = {.meta = "m", .meta_len = 1, .data = put_buffer(data, n, &pbase), .data_len = n};
    assert_int_equal(kv_disk_put(d, "ns", "b", &o, &pop), TIER_OK);
    kv_disk_defer(d, on_defer, &df, data);
    assert_int_equal(kv_disk_op_wait(pop), TIER_OK);
    kv_disk_op_free(pop);
    free(pbase);
    kv_disk_free(d); /* runs what is queued */
    assert_int_equal(atomic_load(&df.runs), 1);
    assert_ptr_equal(df.p, data);
    assert_false(pthread_equal(df.th, pthread_self()));
    free(data);
    rm_rf(dir);
}

/* Files are 0600 in 0700 directories, and replace / remove keep the
 * used bytes exact. */
static void test_replace_remove(void **state)
{
    char dir[256], path[512];
    scratch(state, dir, sizeof dir);
    kv_disk *d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    uint8_t *a = kv_bytes(3 * MIB, 1), *b = kv_bytes(5000, 2);
    assert_int_equal(put(d, "s", "x", "A", 1, a, 3 * MIB, false), TIER_OK);
    get_ok(d, "s", "x", "A", a, 3 * MIB);
    assert_int_equal(put(d, "s", "x", "BB", 2, b, 5000, false), TIER_OK);
    get_ok(d, "s", "x", "BB", b, 5000);
    obj_path(path, sizeof path, dir, "s", "x");
    struct kv_disk_stats s = kv_disk_stats(d);
    assert_int_equal(s.used, (uint64_t)file_size(path));
    assert_int_equal(s.files, 1);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0600);
    snprintf(path, sizeof path, "%s/s", dir);
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0700);

    kv_disk_remove(d, "s", "x");
    kv_disk_remove(d, "s", "never-there");
    char msg[640];
    assert_int_equal(get_cmp(d, "s", "x", NULL, NULL, 0, msg, sizeof msg), TIER_EINVAL);
    assert_non_null(strstr(msg, "no such object"));
    assert_non_null(strstr(msg, "s/x.kvt"));
    s = kv_disk_stats(d);
    assert_int_equal(s.used, 0);
    assert_int_equal(s.files, 0);

    /* names outside [A-Za-z0-9_-]{1,64}, and the quarantine's */
    kv_disk_op *op = (kv_disk_op *)1;
    struct kv_disk_obj o = {0};
    assert_int_equal(kv_disk_put(d, "s", "a/b", &o, &op), TIER_EINVAL);
    assert_null(op);
    assert_non_null(strstr(kv_disk_errmsg(d), "bad name"));
    assert_int_equal(kv_disk_put(d, "", "a", &o, &op), TIER_EINVAL);
    assert_int_equal(kv_disk_put(d, "quarantine", "a", &o, &op), TIER_EINVAL);
    assert_int_equal(kv_disk_get(d, "s", "..", &op), TIER_EINVAL);
    char long_name[80];
    memset(long_name, 'a', 65);
    long_name[65] = '\0';
    assert_int_equal(kv_disk_get(d, "s", long_name, &op), TIER_EINVAL);
    long_name[64] = '\0';
    assert_int_equal(put(d, "s", long_name, NULL, 0, NULL, 0, false), TIER_OK);
    get_ok(d, "s", long_name, NULL, NULL, 0);
    o.meta_len = 16 * MIB + 1;
    o.meta = a;
    assert_int_equal(kv_disk_put(d, "s", "m", &o, &op), TIER_EINVAL);
    kv_disk_free(d);
    free(a);
    free(b);
    rm_rf(dir);
}

struct seen {
    int n;
    char keys[8][140];
    char metas[8][32];
    size_t data_len[8];
};

static void on_obj(void *arg, const char *ns, const char *name, const void *meta, size_t meta_len, size_t data_len)
{
    struct seen *s = arg;
    assert_true(s->n < 8);
    snprintf(s->keys[s->n], sizeof s->keys[0], "%s/%s", ns, name);
    snprintf(s->metas[s->n], sizeof s->metas[0], "%.*s", (int)meta_len, (const char *)meta);
    s->data_len[s->n] = data_len;
    s->n++;
}

static int find_key(const struct seen *s, const char *key)
{
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->keys[i], key))
            return i;
    return -1;
}

static void test_scan(void **state)
{
    char dir[256];
    scratch(state, dir, sizeof dir);
    kv_disk *d = open_tier(dir, KV_DISK_COMPRESS_AUTO, 0, LAYOUT);
    uint8_t *data = kv_bytes(2 * MIB, 3);
    const char *keys[] = {"a/one", "a/two", "a/three", "b/one"};
    for (int i = 0; i < 4; i++) {
        char ns[8], name[16], meta[32];
        sscanf(keys[i], "%7[^/]/%15s", ns, name);
        snprintf(meta, sizeof meta, "meta of %s", keys[i]);
        assert_int_equal(put(d, ns, name, meta, strlen(meta), data, (size_t)(i + 1) * 1000, i % 2), TIER_OK);
    }
    struct seen s = {0};
    assert_int_equal(kv_disk_scan(d, "", on_obj, &s), TIER_OK);
    assert_int_equal(s.n, 4);
    for (int i = 0; i < 4; i++) {
        int k = find_key(&s, keys[i]);
        assert_true(k >= 0);
        char meta[32];
        snprintf(meta, sizeof meta, "meta of %s", keys[i]);
        assert_string_equal(s.metas[k], meta);
        assert_int_equal(s.data_len[k], (size_t)(i + 1) * 1000);
    }
    s = (struct seen){0};
    assert_int_equal(kv_disk_scan(d, "a", on_obj, &s), TIER_OK);
    assert_int_equal(s.n, 3);
    assert_true(find_key(&s, "b/one") < 0);
    kv_disk_remove(d, "a", "two");
    s = (struct seen){0};
    assert_int_equal(kv_disk_scan(d, "a", on_obj, &s), TIER_OK);
    assert_int_equal(s.n, 2);
    assert_true(find_key(&s, "a/two") < 0);
    s = (struct seen){0};
    assert_int_equal(kv_disk_scan(d, "nothing", on_obj, &s), TIER_OK);
    assert_int_equal(s.n, 0);
    assert_int_equal(kv_disk_scan(d, "bad/ns", on_obj, &s), TIER_EINVAL);
    kv_disk_free(d);
    free(data);
    rm_rf(dir);
}

/* ---- damage ----------------------------------------------------------------- */

enum damage { D_HEADER, D_TABLE, D_META, D_CHUNK, D_LAST_CHUNK, D_TRUNC0, D_TRUNC100, D_TRUNC4095, D_TRUNC4096,
              D_TRUNC_PAGE, D_TRUNC_1, D_EXTEND, D_SWAP, D_ZERO, N_DAMAGE };
static const char *const damage_name[N_DAMAGE] = {
    "header byte", "chunk table byte", "meta byte", "chunk byte", "last chunk byte", "truncated to 0",
    "truncated to 100", "truncated to 4095", "truncated to 4096", "a page short", "a byte short",
    "a page longer", "another object's file", "zero-filled"};
/* what the message says */
static const char *const damage_why[N_DAMAGE] = {
    "header checksum", "header checksum", "meta checksum", "chunk 0 checksum", "chunk 2 checksum", "truncated",
    "truncated", "truncated", "truncated", "truncated", "truncated", "extended", "another object", "bad magic"};

static void apply_damage(const char *dir, enum damage k)
{
    char path[512], other[512];
    obj_path(path, sizeof path, dir, "ns", "victim");
    off_t size = file_size(path);
    switch (k) {
    case D_HEADER: flip_byte(path, 20); break;
    case D_TABLE: flip_byte(path, 224 + 32 + 12); break;
    case D_META: flip_byte(path, 4096 + 3); break;
    case D_CHUNK: flip_byte(path, (off_t)read_u64(path, 224) + 777); break;
    case D_LAST_CHUNK: flip_byte(path, (off_t)read_u64(path, 224 + 2 * 32) + 5); break;
    case D_TRUNC0: assert_int_equal(truncate(path, 0), 0); break;
    case D_TRUNC100: assert_int_equal(truncate(path, 100), 0); break;
    case D_TRUNC4095: assert_int_equal(truncate(path, 4095), 0); break;
    case D_TRUNC4096: assert_int_equal(truncate(path, 4096), 0); break;
    case D_TRUNC_PAGE: assert_int_equal(truncate(path, size - 4096), 0); break;
    case D_TRUNC_1: assert_int_equal(truncate(path, size - 1), 0); break;
    case D_EXTEND: assert_int_equal(truncate(path, size + 4096), 0); break;
    case D_SWAP:
        obj_path(other, sizeof other, dir, "ns", "keep");
        copy_file(other, path);
        break;
    case D_ZERO: {
        assert_int_equal(truncate(path, 0), 0);
        assert_int_equal(truncate(path, size), 0);
        break;
    }
    case N_DAMAGE: break;
    }
}

/* Each kind of damage made while the tier is open: the get fails with a
 * message naming the file and the check, the file goes to the quarantine,
 * the other object still reads, and a get after it finds nothing. */
static void test_damage(void **state)
{
    char dir[256];
    scratch(state, dir, sizeof dir);
    uint8_t *keep = kv_bytes(2 * MIB + 3, 7), *victim = kv_bytes(3 * MIB - 5, 8);
    for (int k = 0; k < N_DAMAGE; k++) {
        kv_disk *d = open_tier(dir, k % 2 ? KV_DISK_COMPRESS_ALWAYS : KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
        assert_int_equal(put(d, "ns", "keep", "k", 1, keep, 2 * MIB + 3, false), TIER_OK);
        assert_int_equal(put(d, "ns", "victim", "victim meta", 11, victim, 3 * MIB - 5, false), TIER_OK);
        int q0 = count_quarantined(dir);
        apply_damage(dir, (enum damage)k);
        char msg[640];
        enum tier_status st = get_cmp(d, "ns", "victim", "victim meta", victim, 3 * MIB - 5, msg, sizeof msg);
        if (st != TIER_EIO || !strstr(msg, "ns/victim.kvt") || !strstr(msg, damage_why[k]))
            fail_msg("%s: status %d, message \"%s\"", damage_name[k], st, msg);
        assert_int_equal(count_quarantined(dir), q0 + 1);
        assert_int_equal(kv_disk_stats(d).quarantined, 1);
        assert_int_equal(get_cmp(d, "ns", "victim", NULL, NULL, 0, msg, sizeof msg), TIER_EINVAL);
        get_ok(d, "ns", "keep", "k", keep, 2 * MIB + 3);
        kv_disk_free(d);
    }
    free(keep);
    free(victim);
    rm_rf(dir);
}

/* Damage to the header, the table or the length is found at open: those
 * files are quarantined there (with a log line) and not counted; a chunk
 * is checked only when read. */
static void test_damage_at_open(void **state)
{
    char dir[256], path[512];
    scratch(state, dir, sizeof dir);
    uint8_t *data = kv_bytes(3 * MIB, 9);
    kv_disk *d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    const char *names[] = {"h", "t", "c", "ok", "z"};
    for (int i = 0; i < 5; i++)
        assert_int_equal(put(d, "ns", names[i], "m", 1, data, 3 * MIB, false), TIER_OK);
    kv_disk_free(d);
    obj_path(path, sizeof path, dir, "ns", "h");
    flip_byte(path, 30);
    obj_path(path, sizeof path, dir, "ns", "t");
    assert_int_equal(truncate(path, file_size(path) - 4096), 0);
    obj_path(path, sizeof path, dir, "ns", "c");
    flip_byte(path, (off_t)read_u64(path, 224 + 32) + 1);
    obj_path(path, sizeof path, dir, "ns", "z");
    assert_int_equal(truncate(path, 0), 0);
    /* a leftover temporary file and a stray file */
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s/ns/.ok.tmp.1.2", dir);
    FILE *f = fopen(tmp, "w");
    assert_non_null(f);
    fclose(f);
    d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    struct kv_disk_stats s = kv_disk_stats(d);
    assert_int_equal(s.quarantined, 3);
    assert_int_equal(count_quarantined(dir), 3);
    assert_int_equal(count_tmp(dir, "ns"), 0);
    assert_int_equal(s.files, 2);
    struct seen seen = {0};
    assert_int_equal(kv_disk_scan(d, "", on_obj, &seen), TIER_OK);
    assert_int_equal(seen.n, 2);
    char msg[640];
    assert_int_equal(get_cmp(d, "ns", "c", "m", data, 3 * MIB, msg, sizeof msg), TIER_EIO);
    assert_non_null(strstr(msg, "chunk 1 checksum mismatch"));
    assert_int_equal(count_quarantined(dir), 4);
    get_ok(d, "ns", "ok", "m", data, 3 * MIB);
    kv_disk_free(d);
    free(data);
    rm_rf(dir);
}

/* A file written for another layout is neither handed out nor
 * quarantined; the layout that wrote it reads it again. */
static void test_layout_mismatch(void **state)
{
    char dir[256], path[512];
    scratch(state, dir, sizeof dir);
    uint8_t *data = kv_bytes(100000, 11);
    kv_disk *d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    assert_int_equal(put(d, "ns", "x", "m", 1, data, 100000, false), TIER_OK);
    kv_disk_free(d);
    struct kv_disk_layout other[3] = {LAYOUT, LAYOUT, LAYOUT};
    other[0].fingerprint ^= 1;
    other[1].dtype = BE_F32;
    other[2].head_dim = 128;
    for (int i = 0; i < 3; i++) {
        d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, other[i]);
        struct seen s = {0};
        assert_int_equal(kv_disk_scan(d, "", on_obj, &s), TIER_OK);
        assert_int_equal(s.n, 0);
        char msg[640];
        assert_int_equal(get_cmp(d, "ns", "x", NULL, NULL, 0, msg, sizeof msg), TIER_EINVAL);
        assert_non_null(strstr(msg, "another layout"));
        struct kv_disk_stats st = kv_disk_stats(d);
        assert_int_equal(st.quarantined, 0);
        assert_int_equal(st.files, 0);
        obj_path(path, sizeof path, dir, "ns", "x");
        assert_int_equal(st.used, (uint64_t)file_size(path)); /* it takes the disk all the same */
        kv_disk_free(d);
    }
    assert_int_equal(count_quarantined(dir), 0);
    d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    get_ok(d, "ns", "x", "m", data, 100000);
    kv_disk_free(d);
    free(data);
    rm_rf(dir);
}

/* ---- faults ---------------------------------------------------------------- */

/* Fails the Nth io_uring submission of a replacing put and a get, for N =
 * 1, 2, ... until three N in a row touch nothing (the get's final close
 * may fail harmlessly): every op succeeds with the right bytes or fails
 * cleanly, nothing is quarantined, no temporary file stays, and the store
 * works afterwards. */
static void sweep(void **state, int err, bool every)
{
    char dir[256];
    scratch(state, dir, sizeof dir);
    kv_disk *d = open_tier(dir, KV_DISK_COMPRESS_ALWAYS, 0, LAYOUT);
    size_t n = 5 * MIB + 1234;
    uint8_t *v1 = kv_bytes(n, 21), *v2 = kv_bytes(n, 22);
    assert_int_equal(put(d, "ns", "obj", "v1", 2, v1, n, true), TIER_OK);
    int clean = 0, hit = 0, N;
    for (N = 1; clean < 3 && N < 200; N++) {
        kv_disk_fail_nth(d, (uint64_t)N, err, every);
        enum tier_status sp = put(d, "ns", "obj", "v2", 2, v2, n, true);
        assert_true(sp == TIER_OK || sp == (err == ENOSPC ? TIER_EFULL : TIER_EIO));
        char msg[640];
        /* v2 when the put succeeded; after a failed one v1, or v2 when only
         * the directory fsync after the rename failed */
        enum tier_status sg = get_either(d, "ns", "obj", sp == TIER_OK ? v2 : v1, v2, n, msg, sizeof msg);
        if (sg != TIER_OK) {
            assert_int_equal(sg, TIER_EIO);
            assert_non_null(strstr(msg, "obj.kvt"));
        }
        clean = sp == TIER_OK && sg == TIER_OK ? clean + 1 : 0;
        hit += sp != TIER_OK || sg != TIER_OK;
        kv_disk_fail_nth(d, 0, 0, false);
        assert_int_equal(count_tmp(dir, "ns"), 0);
        assert_int_equal(kv_disk_stats(d).quarantined, 0);
        /* whichever version is there reads whole */
        assert_int_equal(get_either(d, "ns", "obj", v1, v2, n, msg, sizeof msg), TIER_OK);
        assert_int_equal(put(d, "ns", "obj", "v1", 2, v1, n, true), TIER_OK);
        get_ok(d, "ns", "obj", "v1", v1, n);
    }
    assert_true(N < 200);
    assert_true(hit >= 10); /* a put and a get take more than ten submissions */
    char path[512];
    obj_path(path, sizeof path, dir, "ns", "obj");
    assert_int_equal(kv_disk_stats(d).used, (uint64_t)file_size(path));
    kv_disk_free(d);
    free(v1);
    free(v2);
    rm_rf(dir);
}

static void test_fault_sweep_eio(void **state)
{
    sweep(state, EIO, false);
}

static void test_fault_sweep_enospc(void **state)
{
    sweep(state, ENOSPC, false);
}

static void test_fault_from_n(void **state)
{
    char dir[256];
    scratch(state, dir, sizeof dir);
    kv_disk *d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    uint8_t *v = kv_bytes(2 * MIB, 31);
    for (int N = 1; N < 12; N++) {
        kv_disk_fail_nth(d, (uint64_t)N, ENOSPC, true);
        assert_int_equal(put(d, "ns", "x", "m", 1, v, 2 * MIB, false), TIER_EFULL);
        assert_non_null(strstr(kv_disk_errmsg(d), "ns/x.kvt"));
        kv_disk_fail_nth(d, 0, 0, false);
        assert_int_equal(count_tmp(dir, "ns"), 0);
    }
    assert_int_equal(put(d, "ns", "x", "m", 1, v, 2 * MIB, false), TIER_OK);
    get_ok(d, "ns", "x", "m", v, 2 * MIB);
    kv_disk_free(d);
    free(v);
    rm_rf(dir);
}

/* A get's data as it arrives: the bytes kv_disk_op_wait_ready hands out
 * are the object's and stay put (its meta is in before them), the notify
 * callback fires as they grow, and a read that fails part-way keeps its
 * checked bytes readable until the op is freed, hands out no buffer, and
 * says NULL to a wait for the rest.  Raw and compressed chunks. */
static void test_progress(void **state)
{
    char dir[256];
    scratch(state, dir, sizeof dir);
    size_t n = 6 * MIB + 100;
    uint8_t *v = kv_bytes(n, 41);
    for (int c = 0; c < 2; c++) {
        kv_disk *d = open_tier(dir, c ? KV_DISK_COMPRESS_ALWAYS : KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
        assert_int_equal(put(d, "ns", "big", "m", 1, v, n, true), TIER_OK);
        kv_disk_op *op;
        atomic_store(&g_notified, 0);
        assert_int_equal(start_get(d, "ns", "big", &op), TIER_OK);
        uint8_t *first = kv_disk_op_wait_ready(op, MIB);
        assert_non_null(first);
        assert_memory_equal(first, v, MIB);
        size_t early_len; /* the meta is in before the data */
        const void *early = kv_disk_op_meta(op, &early_len);
        assert_int_equal(early_len, 1);
        assert_memory_equal(early, "m", 1);
        uint8_t *all = kv_disk_op_wait_ready(op, n);
        assert_ptr_equal(all, first);
        assert_memory_equal(all, v, n);
        assert_int_equal(kv_disk_op_wait(op), TIER_OK);
        void *data;
        size_t len;
        assert_int_equal(kv_disk_op_ready(op, &data, &len), n);
        assert_ptr_equal(data, first);
        assert_int_equal(len, n);
        /* one for each window of chunks checked (7 chunks, 4 a window), one at the end */
        assert_true(notified_at_least(3) >= 3);
        void *m, *dd, *buf;
        size_t ml, dl;
        take(op, &m, &ml, &buf, &dd, &dl);
        assert_ptr_equal(dd, first);
        assert_ptr_equal(m, early);
        free(m);
        drop_data(buf);
        kv_disk_op_free(op);

        int partial = 0;
        for (int N = 1; N < 40; N++) {
            kv_disk_fail_nth(d, (uint64_t)N, EIO, false);
            assert_int_equal(start_get(d, "ns", "big", &op), TIER_OK);
            uint8_t *got = kv_disk_op_wait_ready(op, n);
            enum tier_status st = kv_disk_op_wait(op);
            kv_disk_fail_nth(d, 0, 0, false);
            size_t ready = kv_disk_op_ready(op, &data, &len);
            if (st == TIER_OK) {
                assert_non_null(got);
            } else {
                assert_null(got);
                assert_true(ready < n);
                if (ready) {
                    partial++;
                    assert_non_null(data);
                    assert_memory_equal(data, v, ready);
                }
                take(op, &m, &ml, &buf, &dd, &dl);
                assert_null(dd);
                assert_null(buf);
                assert_int_equal(dl, 0);
            }
            kv_disk_op_free(op);
        }
        assert_true(partial >= 1);
        kv_disk_free(d);
        rm_rf(dir);
        scratch(state, dir, sizeof dir);
    }
    free(v);
    rm_rf(dir);
}

static void test_budget(void **state)
{
    char dir[256];
    scratch(state, dir, sizeof dir);
    kv_disk *d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 64 * 1024, LAYOUT);
    uint8_t *v = kv_bytes(MIB, 41);
    kv_disk_op *op = (kv_disk_op *)1;
    struct kv_disk_obj o = {.data = v, .data_len = MIB};
    assert_int_equal(kv_disk_put(d, "ns", "big", &o, &op), TIER_EFULL);
    assert_null(op);
    assert_non_null(strstr(kv_disk_errmsg(d), "budget"));
    assert_int_equal(count_entries(dir, "ns"), 0); /* nothing written */
    assert_int_equal(put(d, "ns", "a", NULL, 0, v, 20000, false), TIER_OK);
    assert_int_equal(put(d, "ns", "b", NULL, 0, v, 20000, false), TIER_OK);
    /* 2 x 24 KiB used (a 4 KiB header, 20 KiB of data): a third does not fit */
    assert_int_equal(put(d, "ns", "c", NULL, 0, v, 20000, false), TIER_EFULL);
    kv_disk_remove(d, "ns", "a");
    /* the remove frees its bytes when the I/O thread has run it: an op
     * queued after it waits for that */
    assert_int_equal(get_cmp(d, "ns", "a", NULL, NULL, 0, NULL, 0), TIER_EINVAL);
    assert_int_equal(put(d, "ns", "c", NULL, 0, v, 20000, false), TIER_OK);
    get_ok(d, "ns", "c", NULL, v, 20000);
    assert_int_equal(kv_disk_stats(d).used, 2 * 24 * 1024);
    kv_disk_free(d);
    free(v);
    rm_rf(dir);
}

/* ---- crash ----------------------------------------------------------------- */

/* A child writes v_old (unless NULL), then starts writing a 10 MiB
 * object and is killed with -9 after 3 of its chunks are on disk. */
static void crash_writer(const char *dir, const uint8_t *v_old, const uint8_t *v_new)
{
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        setenv("KVTIER_DISK_PAUSE_AFTER_CHUNK", "3", 1);
        struct kv_disk_params p = {.dir = dir, .compress = KV_DISK_COMPRESS_NEVER, .layout = LAYOUT};
        kv_disk *d;
        if (kv_disk_open(&p, &d) != TIER_OK)
            _exit(2);
        if (v_old && put(d, "ns", "obj", "old", 3, v_old, MIB, false) != TIER_OK)
            _exit(3);
        if (write(fds[1], "x", 1) != 1)
            _exit(4);
        put(d, "ns", "obj", "new", 3, v_new, 10 * MIB, false);
        _exit(5); /* not reached: the I/O thread sleeps in the put */
    }
    close(fds[1]);
    char c;
    assert_int_equal(read(fds[0], &c, 1), 1);
    close(fds[0]);
    /* wait for the temporary file to hold 3 chunks */
    char ns_dir[512];
    snprintf(ns_dir, sizeof ns_dir, "%s/ns", dir);
    bool paused = false;
    for (int i = 0; i < 2000 && !paused; i++) {
        DIR *dd = opendir(ns_dir);
        struct dirent *e;
        while (dd && (e = readdir(dd)))
            if (e->d_name[0] == '.' && strstr(e->d_name, ".tmp.")) {
                char p[1024];
                struct stat sb;
                snprintf(p, sizeof p, "%s/%s", ns_dir, e->d_name);
                paused = stat(p, &sb) == 0 && sb.st_size >= (off_t)(3 * MIB);
            }
        if (dd)
            closedir(dd);
        if (!paused)
            usleep(5000);
    }
    assert_true(paused);
    usleep(20000);
    int status;
    assert_int_equal(waitpid(pid, &status, WNOHANG), 0); /* still in the put */
    kill(pid, SIGKILL);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status));
    assert_true(count_tmp(dir, "ns") == 1);
}

static void test_crash(void **state)
{
    char dir[256];
    scratch(state, dir, sizeof dir);
    uint8_t *v_old = kv_bytes(MIB, 51), *v_new = kv_bytes(10 * MIB, 52);
    crash_writer(dir, v_old, v_new);
    kv_disk *d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    assert_int_equal(count_tmp(dir, "ns"), 0);
    get_ok(d, "ns", "obj", "old", v_old, MIB);
    assert_int_equal(kv_disk_stats(d).quarantined, 0);
    kv_disk_free(d);

    crash_writer(dir, NULL, v_new);
    d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    assert_int_equal(count_tmp(dir, "ns"), 0);
    get_ok(d, "ns", "obj", "old", v_old, MIB); /* the second child did not write the old one again */
    kv_disk_remove(d, "ns", "obj");
    kv_disk_free(d);

    crash_writer(dir, NULL, v_new);
    d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    char msg[640];
    assert_int_equal(get_cmp(d, "ns", "obj", NULL, NULL, 0, msg, sizeof msg), TIER_EINVAL);
    assert_int_equal(count_tmp(dir, "ns"), 0);
    kv_disk_free(d);
    free(v_old);
    free(v_new);
    rm_rf(dir);
}

/* One process per directory. */
static void test_lock(void **state)
{
    char dir[256];
    scratch(state, dir, sizeof dir);
    kv_disk *d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    struct kv_disk_params p = {.dir = dir, .layout = LAYOUT};
    kv_disk *e = (kv_disk *)1;
    assert_int_equal(kv_disk_open(&p, &e), TIER_EIO);
    assert_null(e);
    kv_disk_free(d);
    kv_disk_free(NULL);
    kv_disk_op_free(NULL);
    rm_rf(dir);
}

/* Directories of the tier that are links elsewhere are never written
 * through: a namespace one fails the put (nothing lands at its target),
 * a quarantine one fails the open. */
static void test_symlinked_dirs(void **state)
{
    char dir[256], elsewhere[300], path[300];
    scratch(state, dir, sizeof dir);
    snprintf(elsewhere, sizeof elsewhere, "%s-elsewhere", dir);
    assert_int_equal(mkdir(elsewhere, 0700), 0);
    kv_disk *d = open_tier(dir, KV_DISK_COMPRESS_NEVER, 0, LAYOUT);
    snprintf(path, sizeof path, "%s/u7", dir);
    assert_int_equal(symlink(elsewhere, path), 0);
    uint8_t *data = kv_bytes(4096, 7);
    assert_int_equal(put(d, "u7", "obj", "{}", 2, data, 4096, false), TIER_EIO);
    assert_int_equal(put(d, "u8", "obj", "{}", 2, data, 4096, false), TIER_OK);
    free(data);
    kv_disk_free(d);
    DIR *e = opendir(elsewhere);
    assert_non_null(e);
    int n = 0;
    for (struct dirent *x; (x = readdir(e));)
        n += x->d_name[0] != '.';
    closedir(e);
    assert_int_equal(n, 0);
    snprintf(path, sizeof path, "%s/quarantine", dir);
    rm_rf(path);
    assert_int_equal(symlink(elsewhere, path), 0);
    struct kv_disk_params p = {.dir = dir, .layout = LAYOUT};
    assert_int_equal(kv_disk_open(&p, &d), TIER_EIO);
    rm_rf(dir);
    rm_rf(elsewhere);
}

#define BOTH(fn)                                                                                                  \
    cmocka_unit_test_prestate(fn, "/tmp"), cmocka_unit_test_prestate(fn, "/dev/shm"),                           \
        cmocka_unit_test_prestate(fn, "/tmp+aligned"), cmocka_unit_test_prestate(fn, "/dev/shm+aligned"),       \
        cmocka_unit_test_prestate(fn, "/tmp+unaligned")

int main(void)
{
    const struct CMUnitTest tests[] = {
        BOTH(test_roundtrip),       BOTH(test_caller_buffers),   BOTH(test_replace_remove),   BOTH(test_scan),
        BOTH(test_damage),          BOTH(test_damage_at_open),   BOTH(test_layout_mismatch),
        BOTH(test_fault_sweep_eio), BOTH(test_fault_sweep_enospc), BOTH(test_fault_from_n),    BOTH(test_progress),
        BOTH(test_budget),          BOTH(test_crash),            BOTH(test_lock),             BOTH(test_symlinked_dirs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
