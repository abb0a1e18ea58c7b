/* kvtier-bench-disk - the disk tier's throughput against the directory's
 * raw sequential bandwidth:
 *
 *   kvtier-bench-disk --dir DIR [--mib 256] [--repeat 2]
 *
 * First the raw figures: one file of --mib MiB written and read with
 * O_DIRECT (page cache bypassed; where the filesystem refuses O_DIRECT,
 * buffered with the cache dropped by fdatasync + POSIX_FADV_DONTNEED and
 * said so), 4 MiB requests, 8 in flight through io_uring, the write
 * including its fsync.  Then kv_disk put and get of --mib MiB of bf16
 * values of a KV-like distribution (normal, sigma 0.5, a few outliers),
 * stored raw (from and into 4 KiB-aligned buffers, so that the chunks
 * move in place, and from and into buffers 16 bytes off, so that every
 * chunk goes through the tier's staging buffers: the copy the aligned
 * path saves), and shuffled + zstd with 1 and 2 compress threads.  A get
 * allocates its buffer, as a restore does: from the CPU backend's host
 * memory (be_host_alloc: mapped and locked) when aligned, as the daemon
 * does.  Each
 * figure is the best of --repeat runs; MB/s are of the raw (logical)
 * bytes, 10^6 bytes per MB; "% raw" compares with the raw write (put) or
 * read (get) bandwidth; cpu is the CPU seconds of the whole process (every
 * thread) for the op, the least of --repeat: steadier than wall time on a
 * shared machine.  Files go to DIR/kvtier-bench-disk.*, removed at
 * the end.
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <getopt.h>
#include <liburing.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "backend/backend.h"
#include "tiers/disk.h"
#include "util/args.h"
#include "util/clock.h"
#include "util/half.h"
#include "util/version.h"

#define REQ ((size_t)4 << 20)
#define DEPTH 8

static const char *prog = "kvtier-bench-disk";

/* Writes (or reads) total bytes of fd sequentially, DEPTH requests of REQ
 * bytes in flight.  Seconds, or a negative value on failure. */
static double seq_io(int fd, bool wr, size_t total, uint8_t **bufs)
{
    struct io_uring ring;
    if (io_uring_queue_init(DEPTH, &ring, 0) < 0)
        return -1;
    double t0 = clock_s();
    size_t next = 0, done = 0;
    int inflight = 0, err = 0;
    while (done < total && !err) {
        while (inflight < DEPTH && next < total) {
            struct io_uring_sqe *s = io_uring_get_sqe(&ring);
            size_t len = total - next < REQ ? total - next : REQ;
            int slot = (int)((next / REQ) % DEPTH);
            if (wr)
                io_uring_prep_write(s, fd, bufs[slot], (unsigned)len, next);
            else
                io_uring_prep_read(s, fd, bufs[slot], (unsigned)len, next);
            io_uring_sqe_set_data64(s, len);
            next += len;
            inflight++;
        }
        io_uring_submit(&ring);
        struct io_uring_cqe *c;
        if (io_uring_wait_cqe(&ring, &c) < 0)
            break;
        if (c->res < 0 || (uint64_t)c->res != io_uring_cqe_get_data64(c))
            err = c->res < 0 ? -c->res : EIO;
        done += io_uring_cqe_get_data64(c);
        inflight--;
        io_uring_cqe_seen(&ring, c);
    }
    while (inflight > 0) {
        struct io_uring_cqe *c;
        if (io_uring_wait_cqe(&ring, &c) < 0)
            break;
        io_uring_cqe_seen(&ring, c);
        inflight--;
    }
    if (wr && !err && fsync(fd) != 0)
        err = errno;
    double t = clock_s() - t0;
    io_uring_queue_exit(&ring);
    if (err)
        fprintf(stderr, "%s: sequential %s: %s\n", prog, wr ? "write" : "read", strerror(err));
    return err ? -1 : t;
}

/* The raw bandwidths in MB/s. */
static int raw_bandwidth(const char *dir, size_t total, int repeat, double *wr_mbs, double *rd_mbs)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/kvtier-bench-disk.raw", dir);
    uint8_t *bufs[DEPTH];
    for (int i = 0; i < DEPTH; i++) {
        if (posix_memalign((void **)&bufs[i], 4096, REQ) != 0)
            return -1;
        for (size_t k = 0; k < REQ; k++)
            bufs[i][k] = (uint8_t)(k * 131 + (size_t)i);
    }
    int flags = O_DIRECT;
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EINVAL) {
        flags = 0;
        fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    }
    if (fd < 0) {
        fprintf(stderr, "%s: %s: %s\n", prog, path, strerror(errno));
        return -1;
    }
    printf("raw: %s, %zu MiB, %zu MiB requests, %d in flight, %s\n", dir, total >> 20, REQ >> 20, DEPTH,
           flags ? "O_DIRECT" : "buffered, cache dropped before reading (O_DIRECT refused)");
    double best_w = 1e30, best_r = 1e30;
    int rc = 0;
    for (int r = 0; r < repeat && !rc; r++) {
        double tw = seq_io(fd, true, total, bufs);
        if (!flags)
            posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        double tr = tw < 0 ? -1 : seq_io(fd, false, total, bufs);
        if (tw < 0 || tr < 0)
            rc = -1;
        best_w = tw < best_w ? tw : best_w;
        best_r = tr < best_r ? tr : best_r;
    }
    close(fd);
    unlink(path);
    for (int i = 0; i < DEPTH; i++)
        free(bufs[i]);
    *wr_mbs = (double)total / best_w / 1e6;
    *rd_mbs = (double)total / best_r / 1e6;
    return rc;
}

/* bf16 values of a KV-like distribution: normal, sigma 0.5, one in 256 an
 * outlier eight times wider. */
static void kv_fill(uint16_t *p, size_t n)
{
    uint64_t s = 0x243F6A8885A308D3ull;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        double u1 = ((s >> 11) + 1.0) / 9007199254740993.0;
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        double u2 = (s >> 11) / 9007199254740992.0;
        double sigma = (s & 255) == 0 ? 4.0 : 0.5;
        p[i] = f32_to_bf16((float)(sigma * sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2)));
    }
}

static int rm_one(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb, (void)type, (void)ftw;
    return remove(path);
}

struct tier_run {
    const char *label;
    enum kv_disk_compress compress;
    int threads;
    size_t skew; /* bytes the data buffers are off 4 KiB alignment */
};

/* CPU seconds of the whole process (every thread) so far: on a shared
 * machine steadier than wall time for comparing data paths. */
static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
           ru.ru_stime.tv_usec / 1e6;
}

static be_backend *g_be; /* the aligned gets' host memory */

/* The gets' allocator: arg points at the skew; none is the daemon's
 * allocation, the backend's host memory. */
static void *buf_alloc(void *arg, size_t len, void **data)
{
    size_t skew = *(const size_t *)arg;
    if (!skew) {
        be_buffer *b = NULL;
        if (be_host_alloc(g_be, len, &b) != BE_OK)
            return NULL;
        *data = be_buffer_data(b);
        return b;
    }
    uint8_t *p = NULL;
    if (posix_memalign((void **)&p, 4096, len + skew) != 0)
        return NULL;
    *data = p + skew;
    return p;
}

static void buf_free(void *arg, void *buf)
{
    if (*(const size_t *)arg)
        free(buf);
    else
        be_buffer_free(buf);
}

static int tier_bench(const char *dir, const void *data, size_t total, int repeat, const struct tier_run *t,
                      double raw_w, double raw_r)
{
    char tdir[4096];
    snprintf(tdir, sizeof tdir, "%s/kvtier-bench-disk.tier", dir);
    struct kv_disk_params p = {.dir = tdir, .budget = 4 * total + ((size_t)64 << 20), .compress = t->compress,
                               .layout = {.fingerprint = 1, .dtype = BE_BF16, .block_tokens = 16, .n_layers = 32,
                                          .n_kv_heads = 8, .head_dim = 128},
                               .compress_threads = t->threads};
    kv_disk *d;
    if (kv_disk_open(&p, &d) != TIER_OK) {
        fprintf(stderr, "%s: cannot open the tier in %s\n", prog, tdir);
        return -1;
    }
    double best_put = 1e30, best_get = 1e30, cpu_put = 1e30, cpu_get = 1e30;
    int rc = 0;
    uint8_t *src = NULL;
    if (posix_memalign((void **)&src, 4096, total + t->skew) != 0) {
        fprintf(stderr, "%s: out of memory for the put's buffer\n", prog);
        kv_disk_free(d);
        return -1;
    }
    memcpy(src + t->skew, data, total);
    for (int r = 0; r < repeat && !rc; r++) {
        struct kv_disk_obj o = {.meta = "{}", .meta_len = 2, .data = src + t->skew, .data_len = total, .cold = true};
        kv_disk_op *op;
        double t0 = clock_s(), c0 = cpu_s();
        enum tier_status st = kv_disk_put(d, "bench", "obj", &o, &op);
        if (st == TIER_OK)
            st = kv_disk_op_wait(op);
        double tp = clock_s() - t0, cp = cpu_s() - c0;
        if (st != TIER_OK) {
            fprintf(stderr, "%s: put: %s\n", prog, op ? kv_disk_op_errmsg(op) : kv_disk_errmsg(d));
            kv_disk_op_free(op);
            rc = -1;
            break;
        }
        kv_disk_op_free(op);
        t0 = clock_s();
        c0 = cpu_s();
        st = kv_disk_get_into(d, "bench", "obj", &(struct kv_disk_alloc){buf_alloc, buf_free, (void *)&t->skew}, &op);
        if (st == TIER_OK)
            st = kv_disk_op_wait(op);
        double tg = clock_s() - t0, cg = cpu_s() - c0;
        void *meta = NULL, *buf = NULL, *back = NULL;
        size_t ml, dl = 0;
        if (st == TIER_OK)
            kv_disk_op_take_buf(op, &meta, &ml, &buf, &back, &dl);
        if (st != TIER_OK || dl != total || memcmp(back, data, total) != 0) {
            fprintf(stderr, "%s: get: %s\n", prog, st ? kv_disk_op_errmsg(op) : "data differs");
            rc = -1;
        }
        free(meta);
        if (buf)
            buf_free((void *)&t->skew, buf);
        kv_disk_op_free(op);
        best_put = tp < best_put ? tp : best_put;
        best_get = tg < best_get ? tg : best_get;
        cpu_put = cp < cpu_put ? cp : cpu_put;
        cpu_get = cg < cpu_get ? cg : cpu_get;
    }
    free(src);
    struct kv_disk_stats s = kv_disk_stats(d);
    kv_disk_free(d);
    nftw(tdir, rm_one, 8, FTW_DEPTH | FTW_PHYS);
    if (rc)
        return rc;
    double put_mbs = (double)total / best_put / 1e6, get_mbs = (double)total / best_get / 1e6;
    double ratio = s.stored_compressed ? (double)s.raw_compressed / (double)s.stored_compressed : 1.0;
    printf("%-18s put %8.1f MB/s (%5.1f%% raw, cpu %.2f s)   get %8.1f MB/s (%5.1f%% raw, cpu %.2f s)   ratio %.3f   "
           "stored %.1f%%%s\n",
           t->label, put_mbs, 100 * put_mbs / raw_w, cpu_put, get_mbs, 100 * get_mbs / raw_r, cpu_get, ratio,
           100.0 * (double)s.bytes_written / (double)s.puts / (double)total, s.direct ? "" : "   (buffered)");
    return 0;
}

int main(int argc, char **argv)
{
    if (version_requested(argc, argv, "kvtier-bench-disk"))
        return 0;
    static const struct option opts[] = {
        {"dir", required_argument, NULL, 'd'},
        {"mib", required_argument, NULL, 'n'},
        {"repeat", required_argument, NULL, 'r'},
        {"help", no_argument, NULL, 'h'},
        {0},
    };
    const char *dir = NULL;
    int mib = 256, repeat = 2, c;
    while ((c = getopt_long(argc, argv, "d:n:r:h", opts, NULL)) != -1) {
        switch (c) {
        case 'd': dir = optarg; break;
        case 'n':
            if (!args_int(optarg, 1, 1 << 16, &mib))
                return args_invalid(prog, opts, c, optarg);
            break;
        case 'r':
            if (!args_int(optarg, 1, 100, &repeat))
                return args_invalid(prog, opts, c, optarg);
            break;
        case 'h':
            printf("usage: %s --dir DIR [--mib 256] [--repeat 2]\n", prog);
            return 0;
        default: return 2;
        }
    }
    if (!dir) {
        fprintf(stderr, "usage: %s --dir DIR [--mib 256] [--repeat 2]\n", prog);
        return 2;
    }
    size_t total = (size_t)mib << 20;
    double raw_w, raw_r;
    if (raw_bandwidth(dir, total, repeat, &raw_w, &raw_r) != 0)
        return 1;
    printf("raw: write %.1f MB/s, read %.1f MB/s\n", raw_w, raw_r);
    uint16_t *data = malloc(total);
    if (!data) {
        fprintf(stderr, "%s: out of memory for %d MiB\n", prog, mib);
        return 1;
    }
    kv_fill(data, total / 2);
    if (be_open("cpu", &(struct be_params){.n_threads = 1}, &g_be) != BE_OK) {
        fprintf(stderr, "%s: cannot open the CPU backend\n", prog);
        free(data);
        return 1;
    }
    static const struct tier_run runs[] = {
        {"raw, in place", KV_DISK_COMPRESS_NEVER, 2, 0},
        {"raw, staged", KV_DISK_COMPRESS_NEVER, 2, 16},
        {"zstd, 1 thread", KV_DISK_COMPRESS_ALWAYS, 1, 0},
        {"zstd, 2 threads", KV_DISK_COMPRESS_ALWAYS, 2, 0},
    };
    printf("kv_disk: %d MiB of bf16 (normal, sigma 0.5, 1/256 outliers), best of %d\n", mib, repeat);
    int rc = 0;
    for (size_t i = 0; i < sizeof runs / sizeof *runs && !rc; i++)
        rc = tier_bench(dir, data, total, repeat, &runs[i], raw_w, raw_r);
    free(data);
    be_free(g_be);
    return rc ? 1 : 0;
}
