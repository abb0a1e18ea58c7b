/* disk.c - the disk tier (tiers/disk.h): one I/O thread that owns an
 * io_uring ring and runs the queued ops one at a time, each with several
 * chunk reads or writes in flight, and a pool of compress_threads workers
 * that shuffle + zstd (or copy) chunks into the staging buffers and check
 * and decode them back.
 *
 * File DIR/ns/name.kvt, little-endian, every section starting on a 4 KiB
 * boundary and zero-padded to one (O_DIRECT's unit):
 *
 *   offset  size  field
 *   0       8     magic "KVTDISK\0"
 *   8       4     format version (1)
 *   12      4     header size: 224 + 32 * chunk count + 8 (before padding)
 *   16      8     layout: model fingerprint
 *   24      4     layout: dtype (enum be_dtype)
 *   28      4     layout: block tokens
 *   32      4     layout: n_layers
 *   36      4     layout: kv heads
 *   40      4     layout: head_dim
 *   44      4     reserved, 0
 *   48      64    namespace, zero-padded (binds the file to its object)
 *   112     64    name, zero-padded
 *   176     8     meta offset: the header size rounded up to 4 KiB
 *   184     8     meta length (at most 16 MiB)
 *   192     8     xxh3-64 of the meta (0 when empty)
 *   200     8     data raw length (at most 2^40)
 *   208     4     chunk size: 1 MiB of raw data per chunk
 *   212     4     chunk count: data length / chunk size, rounded up
 *   216     8     reserved, 0
 *   224     32*n  chunk table, per chunk:
 *                   +0 8  file offset (the previous chunk's end, rounded
 *                         up; the first follows the padded meta)
 *                   +8 4  raw length (1 MiB, the last one the rest)
 *                   +12 4 stored length (= raw for codec 0, < raw else)
 *                   +16 4 codec: 0 raw, 1 shuffle by 2 + zstd, 2 shuffle
 *                         by 4 + zstd
 *                   +20 4 reserved, 0
 *                   +24 8 xxh3-64 of the stored bytes
 *   224+32n 8     xxh3-64 of every header byte before it
 * then the meta, then the chunks; the file ends at the last chunk's padded
 * end, exactly (a longer or shorter file is corrupt).  Each field has one
 * valid value given the others, so there is one valid encoding of each
 * object (tiers/disk_format.c checks them all).
 *
 * Files that fail a check are renamed into DIR/quarantine/ (a namespace
 * may therefore not be called "quarantine") with a log line naming the
 * file and the check.  Files of another format version or layout are
 * left in place, logged once at open, counted in the used bytes (they
 * take the same disk) and never handed out: another model sharing the
 * directory may own them, and a put of that name replaces them.  A read
 * error (as opposed to a checksum mismatch) fails the op and leaves the
 * file alone.  One process uses a directory at a time (DIR/.lock).
 *
 * Data path: a raw chunk moves between the file and the caller's buffer
 * itself (a put's data when 4 KiB-aligned, a get's buffer from the
 * allocator), with O_DIRECT where the filesystem takes it; its checksum
 * is computed or checked in place by a worker.  Compressed chunks, raw
 * chunks of an unaligned buffer and a put's unaligned tail go through
 * NSTAGE aligned 1 MiB staging buffers.  The ring has a sparse table of
 * NSTAGE + NREG fixed buffers (IORING_REGISTER_BUFFERS2, Linux 5.13): the
 * staging buffers stay registered, and an op's caller buffer is
 * registered in 1 GiB slices (the kernel's limit per buffer) while its
 * chunks are in flight, then unregistered, so READ_FIXED/WRITE_FIXED skip
 * the per-I/O page pinning.  Where the sparse table or an update is
 * refused (an older kernel, RLIMIT_MEMLOCK without CAP_IPC_LOCK) the
 * chunks go with plain READ/WRITE and one log line says so; the staging
 * buffers are then registered the old way when possible.  Measured on a
 * 2-core VM (Linux 6.18, docs/benchmarks.md) the registration cost and
 * saved about the same CPU as O_DIRECT's own pinning per I/O; it stays
 * because the pages are then pinned once per op rather than once per
 * chunk, which is what a page-locked image on a GPU host wants.  Writes of the
 * (small) header and meta, and all directory work,
 * go through the ring as single ops; only readdir and fstat, which the
 * ring of liburing 2.3 lacks, and the clean-up after a failed write,
 * which must not depend on the ring that just failed, are plain calls on
 * the I/O thread.
 *
 * Test hooks: kv_disk_fail_nth, and four environment variables read at
 * open: KVTIER_DISK_FAIL_NTH=n fails the nth submission after the start-up
 * scan with EIO (the daemon's fault sweep); KVTIER_DISK_PAUSE_AFTER_CHUNK=n
 * makes the I/O thread sleep for good once n chunks of one put are written
 * (for a kill -9 mid-write); KVTIER_DISK_READ_DELAY_MS=n makes it sleep n
 * ms before it checks each window of a get's chunks (a slow disk, for the
 * restore that computes while it reads);
 * KVTIER_DISK_BUFFERED forces the buffered path where O_DIRECT works
 * (tmpfs takes O_DIRECT since Linux 6.6).
 *
 * Over 1,000 lines, one file: the worker pool, the ring helpers, the
 * chunk pipelines and the ops all work on the private struct kv_disk; the
 * pure format code is already apart (tiers/disk_format.c), and a further
 * split would need an internal header for little gain.
 */
#include "tiers/disk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <liburing.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>
#include <zstd.h>

#include "tiers/disk_format.h"
#include "util/clock.h"
#include "util/log.h"

#define NSTAGE 8           /* staging buffers: two halves, one filling while the other is in flight */
#define HALF (NSTAGE / 2)
#define REG_SLICE ((size_t)1 << 30) /* the kernel's limit for one registered buffer */
#define NREG ((size_t)(DISK_MAX_DATA / REG_SLICE + 1)) /* fixed-buffer slots for a caller's buffer */
#define TAG_SYNC 0xffffu   /* a single op waited for on its own */
#define MSG_LEN 640
#define QUARANTINE "quarantine"

enum op_kind { OP_PUT, OP_GET, OP_REMOVE, OP_SCAN, OP_START, OP_DEFER };

struct scan_ent {
    char ns[DISK_NAME_MAX + 1], name[DISK_NAME_MAX + 1];
    void *meta;
    size_t meta_len, data_len;
};

struct kv_disk_op {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    enum op_kind kind;
    struct kv_disk_op *next;
    char ns[DISK_NAME_MAX + 1], name[DISK_NAME_MAX + 1];
    struct kv_disk_obj obj;
    uint64_t reserved; /* budget bytes a put holds until it is done */
    enum tier_status st;
    char msg[MSG_LEN];
    void *meta, *data;
    size_t meta_len, data_len;
    size_t ready;               /* get: the data's first bytes in place and checked (under mu) */
    struct kv_disk_alloc alloc; /* get: where the data goes */
    void *buf;                  /* get: alloc's handle of data, the op's from the allocation on */
    void (*defer_fn)(void *arg, void *p);
    void *defer_arg, *defer_p;
    struct scan_ent *ents;
    size_t n_ents, cap_ents;
};

/* The compress / decode workers: pool_run hands out items 0..count-1. */
struct worker {
    ZSTD_CCtx *cctx;
    ZSTD_DCtx *dctx;
    uint8_t *scratch; /* DISK_CHUNK bytes: the shuffled chunk */
};

struct pool {
    pthread_t *th;
    struct worker *w;
    int n, started;
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    void (*fn)(void *arg, struct worker *w, uint32_t i);
    void *arg;
    uint32_t next, count, finished;
    bool stop;
};

struct kv_disk {
    struct kv_disk_params p;
    char *dir;
    int dirfd, lockfd;
    struct io_uring ring;
    bool fixed, direct;
    bool reg_caller;      /* the sparse table is there: callers' buffers may be registered */
    bool reg_logged;      /* a refused registration was logged (I/O thread only) */
    uint8_t *stage[NSTAGE];
    struct pool pool;
    uint64_t pause_after;
    unsigned read_delay_ms;

    pthread_t io;
    pthread_mutex_t mu; /* everything below */
    pthread_cond_t cv;
    struct kv_disk_op *head, *tail;
    bool stop;
    uint64_t fail_n, submitted;
    int fail_err;
    bool fail_every;
    uint64_t reserved, tmp_seq;
    bool write_err_logged;
    bool injected; /* the last single op was failed by the fault hook (I/O thread only) */
    struct kv_disk_stats st;
    char errmsg[MSG_LEN];
};

/* ---- errors ------------------------------------------------------------ */

static void set_errmsg(kv_disk *d, const char *msg)
{
    pthread_mutex_lock(&d->mu);
    snprintf(d->errmsg, sizeof d->errmsg, "%s", msg);
    pthread_mutex_unlock(&d->mu);
}

static enum tier_status disk_fail(kv_disk *d, enum tier_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static enum tier_status disk_fail(kv_disk *d, enum tier_status st, const char *fmt, ...)
{
    char msg[MSG_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    set_errmsg(d, msg);
    return st;
}

static enum tier_status op_fail(kv_disk_op *op, enum tier_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static enum tier_status op_fail(kv_disk_op *op, enum tier_status st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(op->msg, sizeof op->msg, fmt, ap);
    va_end(ap);
    op->st = st;
    return st;
}

const char *kv_disk_errmsg(const kv_disk *d)
{
    return d ? d->errmsg : "";
}

/* ---- worker pool --------------------------------------------------------- */

static void *pool_main(void *arg)
{
    struct pool *p = ((void **)arg)[0];
    struct worker *w = ((void **)arg)[1];
    free(arg);
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->next >= p->count)
            pthread_cond_wait(&p->go, &p->mu);
        if (p->stop)
            break;
        uint32_t i = p->next++;
        pthread_mutex_unlock(&p->mu);
        p->fn(p->arg, w, i);
        pthread_mutex_lock(&p->mu);
        if (++p->finished == p->count)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void pool_run(struct pool *p, void (*fn)(void *, struct worker *, uint32_t), void *arg, uint32_t count)
{
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->next = p->finished = 0;
    p->count = count;
    pthread_cond_broadcast(&p->go);
    while (p->finished < count)
        pthread_cond_wait(&p->done, &p->mu);
    p->count = 0;
    pthread_mutex_unlock(&p->mu);
}

static void pool_stop(struct pool *p)
{
    if (!p->th)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->started; i++)
        pthread_join(p->th[i], NULL);
    for (int i = 0; i < p->n; i++) {
        ZSTD_freeCCtx(p->w[i].cctx);
        ZSTD_freeDCtx(p->w[i].dctx);
        free(p->w[i].scratch);
    }
    free(p->w);
    free(p->th);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->go);
    pthread_cond_destroy(&p->done);
    p->th = NULL;
}

static bool pool_start(struct pool *p, int n)
{
    *p = (struct pool){.n = n};
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->go, NULL);
    pthread_cond_init(&p->done, NULL);
    p->th = calloc((size_t)n, sizeof *p->th);
    p->w = calloc((size_t)n, sizeof *p->w);
    if (!p->th || !p->w) {
        pool_stop(p);
        return false;
    }
    for (int i = 0; i < n; i++) {
        struct worker *w = &p->w[i];
        w->cctx = ZSTD_createCCtx();
        w->dctx = ZSTD_createDCtx();
        w->scratch = malloc(DISK_CHUNK);
        void **arg = malloc(2 * sizeof *arg);
        if (!w->cctx || !w->dctx || !w->scratch || !arg) {
            free(arg);
            pool_stop(p);
            return false;
        }
        arg[0] = p;
        arg[1] = w;
        if (pthread_create(&p->th[i], NULL, pool_main, arg) != 0) {
            free(arg);
            pool_stop(p);
            return false;
        }
        p->started++;
    }
    return true;
}

/* ---- the ring ------------------------------------------------------------ */

static struct io_uring_sqe *sqe_get(kv_disk *d)
{
    struct io_uring_sqe *s;
    while (!(s = io_uring_get_sqe(&d->ring)))
        io_uring_submit(&d->ring);
    return s;
}

/* Tags a prepared SQE; the fault hook turns it into a NOP whose completion
 * reads as -err. */
static void sqe_tag(kv_disk *d, struct io_uring_sqe *s, uint32_t tag)
{
    int err = 0;
    pthread_mutex_lock(&d->mu);
    d->submitted++;
    if (d->fail_n && (d->submitted == d->fail_n || (d->fail_every && d->submitted > d->fail_n)))
        err = d->fail_err;
    pthread_mutex_unlock(&d->mu);
    if (err)
        io_uring_prep_nop(s);
    io_uring_sqe_set_data64(s, tag | (uint64_t)(uint32_t)err << 32);
}

/* The ring refuses a submission only for a transient shortage of
 * completion space or a signal; anything else means it is unusable and
 * the I/O thread cannot honour a single op, so it stops the process. */
static void ring_submit(kv_disk *d)
{
    int rc;
    while ((rc = io_uring_submit(&d->ring)) < 0) {
        if (rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
            log_msg(LOG_ERR, "disk tier: io_uring_submit: %s", strerror(-rc));
            abort();
        }
    }
}

static void ring_reap(kv_disk *d, uint32_t *tag, int *res, bool *injected)
{
    struct io_uring_cqe *c;
    int rc;
    while ((rc = io_uring_wait_cqe(&d->ring, &c)) < 0) {
        if (rc != -EINTR && rc != -EAGAIN && rc != -ETIME) {
            log_msg(LOG_ERR, "disk tier: io_uring_wait_cqe: %s", strerror(-rc));
            abort();
        }
    }
    uint64_t ud = io_uring_cqe_get_data64(c);
    *tag = (uint32_t)ud;
    *res = (ud >> 32) ? -(int)(ud >> 32) : c->res;
    *injected = (ud >> 32) != 0;
    io_uring_cqe_seen(&d->ring, c);
}

/* Runs one prepared SQE alone; its result (or -errno). */
static int ring_sync(kv_disk *d, struct io_uring_sqe *s)
{
    uint32_t tag;
    int res;
    sqe_tag(d, s, TAG_SYNC);
    ring_submit(d);
    ring_reap(d, &tag, &res, &d->injected);
    return res;
}

static int r_openat(kv_disk *d, const char *path, int flags, mode_t mode)
{
    struct io_uring_sqe *s = sqe_get(d);
    io_uring_prep_openat(s, d->dirfd, path, flags | O_CLOEXEC, mode);
    return ring_sync(d, s);
}

static int r_close(kv_disk *d, int fd)
{
    struct io_uring_sqe *s = sqe_get(d);
    io_uring_prep_close(s, fd);
    int rc = ring_sync(d, s);
    if (d->injected)
        close(fd); /* the op never reached the kernel: do not leak the descriptor */
    return rc;
}

static int r_fsync(kv_disk *d, int fd)
{
    struct io_uring_sqe *s = sqe_get(d);
    io_uring_prep_fsync(s, fd, 0);
    return ring_sync(d, s);
}

static int r_rename(kv_disk *d, const char *from, const char *to, unsigned flags)
{
    struct io_uring_sqe *s = sqe_get(d);
    io_uring_prep_renameat(s, d->dirfd, from, d->dirfd, to, flags);
    return ring_sync(d, s);
}

static int r_unlink(kv_disk *d, const char *path)
{
    struct io_uring_sqe *s = sqe_get(d);
    io_uring_prep_unlinkat(s, d->dirfd, path, 0);
    return ring_sync(d, s);
}

static int r_mkdir(kv_disk *d, const char *path)
{
    struct io_uring_sqe *s = sqe_get(d);
    io_uring_prep_mkdirat(s, d->dirfd, path, 0700);
    return ring_sync(d, s);
}

/* Reads or writes len bytes at off from an aligned buffer: 0, or -errno
 * (a short write is -ENOSPC, a short read -EIO).  Reads may be allowed
 * short (want < len). */
static int r_rw(kv_disk *d, bool wr, int fd, void *buf, size_t len, uint64_t off, size_t want)
{
    struct io_uring_sqe *s = sqe_get(d);
    if (wr)
        io_uring_prep_write(s, fd, buf, (unsigned)len, off);
    else
        io_uring_prep_read(s, fd, buf, (unsigned)len, off);
    int rc = ring_sync(d, s);
    return rc < 0 ? rc : (size_t)rc < want ? (wr ? -ENOSPC : -EIO) : rc;
}

/* fsyncs the directory at path (relative to the tier's). */
static int r_fsync_dir(kv_disk *d, const char *path)
{
    int fd = r_openat(d, path, O_RDONLY | O_DIRECTORY, 0);
    if (fd < 0)
        return fd;
    int rc = r_fsync(d, fd);
    int rc2 = r_close(d, fd);
    return rc < 0 ? rc : rc2 < 0 ? rc2 : 0;
}

/* ---- chunk pipelines ----------------------------------------------------- */

struct xfer {
    kv_disk *d;
    kv_disk_op *op;     /* get: told how far the data is in (NULL: nobody asks) */
    int fd;
    struct disk_hdr *h;
    const uint8_t *src; /* put: the object's data */
    uint8_t *dst;       /* get: the data handed out, kv_disk_data_alloc_len bytes */
    bool in_place;      /* src / dst is 4 KiB-aligned: raw chunks move straight from / into it */
    const uint8_t *reg_base; /* the registered part of src / dst (reg_n slices from NSTAGE on) */
    size_t reg_len;
    uint32_t reg_n;
    uint64_t n_in_place; /* chunks that did (I/O thread only) */
    enum disk_codec codec; /* put: the codec to try, DISK_CODEC_RAW = none */
    uint32_t first, slot0; /* the window being prepared or decoded */
    int inflight[2];
    uint8_t *io[NSTAGE]; /* per slot: where its transfer reads or writes */
    uint32_t expect[NSTAGE];
    int err;            /* the first failed transfer's errno */
    bool half_err[2];   /* a transfer of that half of the slots failed */
    bool wr;
    uint32_t written;   /* chunks, for the pause hook */
    int bad[HALF];      /* get: per chunk of the window, 0 ok, 1 checksum, 2 decode */
};

/* A raw chunk of len bytes at p in the caller's buffer may be transferred
 * from there: the buffer is aligned, and a put's unaligned tail would
 * make O_DIRECT write bytes past its data (a get's buffer has them). */
static bool chunk_in_place(const struct xfer *x, uint32_t len)
{
    return x->in_place && (!x->wr || len % DISK_ALIGN == 0);
}

static void put_chunk(void *arg, struct worker *w, uint32_t i)
{
    struct xfer *x = arg;
    struct disk_chunk *c = &x->h->chunks[x->first + i];
    const uint8_t *raw = x->src + (size_t)(x->first + i) * DISK_CHUNK;
    uint8_t *out = x->d->stage[x->slot0 + i];
    c->codec = DISK_CODEC_RAW;
    c->stored_len = c->raw_len;
    size_t packed = x->codec != DISK_CODEC_RAW ? disk_chunk_pack(w->cctx, x->codec, raw, c->raw_len, w->scratch, out) : 0;
    if (packed) {
        c->codec = x->codec;
        c->stored_len = (uint32_t)packed;
    }
    if (c->codec == DISK_CODEC_RAW && chunk_in_place(x, c->raw_len)) {
        /* the write only reads it: the caller keeps it unchanged until done */
        out = (uint8_t *)(uintptr_t)raw;
    } else {
        if (c->codec == DISK_CODEC_RAW)
            memcpy(out, raw, c->raw_len);
        memset(out + c->stored_len, 0, disk_align(c->stored_len) - c->stored_len);
    }
    x->io[x->slot0 + i] = out;
    c->sum = XXH3_64bits(out, c->stored_len);
}

static void get_chunk(void *arg, struct worker *w, uint32_t i)
{
    struct xfer *x = arg;
    const struct disk_chunk *c = &x->h->chunks[x->first + i];
    const uint8_t *in = x->io[x->slot0 + i];
    uint8_t *out = x->dst + (size_t)(x->first + i) * DISK_CHUNK;
    x->bad[i] = 0;
    if (XXH3_64bits(in, c->stored_len) != c->sum) {
        x->bad[i] = 1;
    } else if (c->codec == DISK_CODEC_RAW) {
        if (in != out)
            memcpy(out, in, c->raw_len);
    } else if (!disk_chunk_unpack(w->dctx, c->codec, in, c->stored_len, w->scratch, out, c->raw_len)) {
        x->bad[i] = 2;
    }
}

static const struct iovec no_iov[NREG]; /* empties slots of the table */

/* Registers the caller's buffer [base, base + len) with the ring in
 * REG_SLICE slices, where the sparse table is there; a refusal is logged
 * once and the chunks go unregistered. */
static void reg_caller(struct xfer *x, const uint8_t *base, size_t len)
{
    kv_disk *d = x->d;
    if (!d->reg_caller || !x->in_place || !len)
        return;
    struct iovec iov[NREG];
    uint32_t n = 0;
    for (size_t off = 0; off < len; off += REG_SLICE, n++)
        iov[n] = (struct iovec){(void *)(uintptr_t)(base + off), len - off < REG_SLICE ? len - off : REG_SLICE};
    int rc = io_uring_register_buffers_update_tag(&d->ring, NSTAGE, iov, NULL, n);
    if (rc != (int)n) {
        if (!d->reg_logged)
            log_msg(LOG_INFO, "disk tier: %s: registering a %zu-byte buffer with the ring failed (%s); plain reads and "
                    "writes for callers' buffers", d->dir, len, strerror(rc < 0 ? -rc : EAGAIN));
        d->reg_logged = true;
        if (rc > 0)
            io_uring_register_buffers_update_tag(&d->ring, NSTAGE, no_iov, NULL, (unsigned)rc);
        return;
    }
    x->reg_base = base;
    x->reg_len = len;
    x->reg_n = n;
    pthread_mutex_lock(&d->mu);
    d->st.registered++;
    pthread_mutex_unlock(&d->mu);
}

/* Drops the registration: the kernel holds the pages until then. */
static void unreg_caller(struct xfer *x)
{
    if (!x->reg_n)
        return;
    io_uring_register_buffers_update_tag(&x->d->ring, NSTAGE, no_iov, NULL, x->reg_n);
    x->reg_n = 0;
}

static void xfer_submit(struct xfer *x, bool wr, uint32_t first, uint32_t count, uint32_t slot0)
{
    kv_disk *d = x->d;
    for (uint32_t i = 0; i < count; i++) {
        const struct disk_chunk *c = &x->h->chunks[first + i];
        uint32_t slot = slot0 + i, len = (uint32_t)disk_align(c->stored_len);
        if (!wr)
            x->io[slot] = c->codec == DISK_CODEC_RAW && chunk_in_place(x, c->raw_len)
                              ? x->dst + (size_t)(first + i) * DISK_CHUNK
                              : d->stage[slot];
        uint8_t *buf = x->io[slot];
        int idx = -1;
        if (buf == d->stage[slot]) {
            idx = d->fixed ? (int)slot : -1;
        } else {
            x->n_in_place++;
            /* chunks start on 1 MiB and slices on 1 GiB: one never straddles two */
            size_t off = x->reg_n ? (size_t)(buf - x->reg_base) : 0;
            if (x->reg_n && off + len <= x->reg_len)
                idx = NSTAGE + (int)(off / REG_SLICE);
        }
        struct io_uring_sqe *s = sqe_get(d);
        if (idx >= 0 && wr)
            io_uring_prep_write_fixed(s, x->fd, buf, len, c->off, idx);
        else if (idx >= 0)
            io_uring_prep_read_fixed(s, x->fd, buf, len, c->off, idx);
        else if (wr)
            io_uring_prep_write(s, x->fd, buf, len, c->off);
        else
            io_uring_prep_read(s, x->fd, buf, len, c->off);
        x->expect[slot] = len;
        sqe_tag(d, s, slot);
    }
    x->inflight[slot0 / HALF] += (int)count;
    ring_submit(d);
}

static void xfer_reap(struct xfer *x)
{
    uint32_t slot;
    int res;
    bool injected;
    ring_reap(x->d, &slot, &res, &injected);
    x->inflight[slot / HALF]--;
    if (res < 0 || (uint32_t)res != x->expect[slot]) {
        if (!x->err) /* a write cut short: the file system is full (the next one would say so) */
            x->err = res < 0 ? -res : x->wr ? ENOSPC : EIO;
        x->half_err[slot / HALF] = true;
        return;
    }
    if (x->wr && ++x->written == x->d->pause_after)
        for (;;)
            pause();
}

static void xfer_drain(struct xfer *x, int half)
{
    while (half < 0 ? x->inflight[0] + x->inflight[1] : x->inflight[half])
        xfer_reap(x);
}

/* Prepares and writes every chunk after data_off; fills the chunk table.
 * 0 or an errno. */
static int write_chunks(struct xfer *x, double *compress_s)
{
    uint64_t off = disk_data_off(x->h->n_chunks, x->h->meta_len);
    uint32_t n = x->h->n_chunks;
    for (uint32_t first = 0, w = 0; first < n; first += HALF, w++) {
        uint32_t count = n - first < HALF ? n - first : HALF;
        xfer_drain(x, (int)(w & 1));
        if (x->err)
            break;
        x->first = first;
        x->slot0 = (w & 1) * HALF;
        double t0 = clock_s();
        pool_run(&x->d->pool, put_chunk, x, count);
        if (x->codec != DISK_CODEC_RAW)
            *compress_s += clock_s() - t0;
        for (uint32_t i = 0; i < count; i++) {
            x->h->chunks[first + i].off = off;
            off += disk_align(x->h->chunks[first + i].stored_len);
        }
        xfer_submit(x, true, first, count, x->slot0);
    }
    xfer_drain(x, -1);
    return x->err;
}

/* The data's first n bytes (at most all of it) are in and checked: a
 * caller computing from a restore as it arrives may go on. */
static void xfer_progress(struct xfer *x, uint64_t n)
{
    kv_disk_op *op = x->op;
    if (!op)
        return;
    pthread_mutex_lock(&op->mu);
    op->ready = n < op->data_len ? (size_t)n : op->data_len;
    pthread_cond_broadcast(&op->cv);
    pthread_mutex_unlock(&op->mu);
    if (x->d->p.notify)
        x->d->p.notify(x->d->p.notify_arg);
}

/* Reads, checks and decodes every chunk into x->dst.  0, an errno (x->err),
 * or -1 - the chunk that failed its checks (*why). */
static int read_chunks(struct xfer *x, char why[DISK_WHY_LEN])
{
    uint32_t n = x->h->n_chunks;
    for (uint32_t w = 0; w < 2 && w * HALF < n; w++)
        xfer_submit(x, false, w * HALF, n - w * HALF < HALF ? n - w * HALF : HALF, w * HALF);
    int rc = 0;
    for (uint32_t first = 0, w = 0; first < n; first += HALF, w++) {
        uint32_t count = n - first < HALF ? n - first : HALF;
        xfer_drain(x, (int)(w & 1));
        /* a later window's failure still lets this one's bytes count */
        if (x->half_err[w & 1])
            break;
        if (x->d->read_delay_ms)
            usleep(x->d->read_delay_ms * 1000u);
        x->first = first;
        x->slot0 = (w & 1) * HALF;
        pool_run(&x->d->pool, get_chunk, x, count);
        for (uint32_t i = 0; i < count && !rc; i++)
            if (x->bad[i]) {
                snprintf(why, DISK_WHY_LEN, "chunk %u %s", first + i,
                         x->bad[i] == 1 ? "checksum mismatch" : "does not decompress");
                rc = -1;
            }
        if (rc)
            break;
        xfer_progress(x, (uint64_t)(first + count) * DISK_CHUNK);
        uint32_t next = first + 2 * HALF;
        if (next < n && !x->err)
            xfer_submit(x, false, next, n - next < HALF ? n - next : HALF, x->slot0);
    }
    xfer_drain(x, -1);
    return rc ? rc : x->err;
}

/* ---- loading a file ------------------------------------------------------ */

enum load_res { L_OK, L_MISSING, L_FOREIGN, L_CORRUPT, L_IOERR, L_NOMEM };

struct loaded {
    struct disk_hdr h;
    uint64_t size;
    uint64_t stored; /* stored_bytes: what it takes of --disk-mem */
    void *meta, *data;
    const struct kv_disk_alloc *alloc; /* where data came from */
    void *buf;                         /* its handle */
    char why[DISK_WHY_LEN];
    int err; /* L_IOERR, L_MISSING */
};

/* The bytes a file takes on the disk, for the budget, the same measure
 * when it is written, found at start, replaced or removed: its length, or
 * its allocated blocks where fewer (a sparse file claims any length for
 * nothing and must not fill the budget; a compressing filesystem stores
 * less than the length). */
static uint64_t stored_bytes(const struct stat *sb)
{
    uint64_t blocks = (uint64_t)sb->st_blocks * 512;
    return blocks < (uint64_t)sb->st_size ? blocks : (uint64_t)sb->st_size;
}

static void *aligned_alloc_zero(uint64_t len)
{
    void *p = NULL;
    if (len > SIZE_MAX || posix_memalign(&p, DISK_ALIGN, len ? (size_t)len : DISK_ALIGN) != 0)
        return NULL;
    memset(p, 0, len ? (size_t)len : DISK_ALIGN);
    return p;
}

static void loaded_release(struct loaded *l)
{
    disk_hdr_release(&l->h);
    free(l->meta);
    if (l->buf)
        l->alloc->free(l->alloc->arg, l->buf);
    l->meta = l->data = l->buf = NULL;
}

/* Whether DIR/name is a directory of its own, not a link to one
 * elsewhere: the scan never follows one, so no write may either (it would
 * put files where the daemon neither finds nor should write them). */
static bool real_dir(const kv_disk *d, const char *name)
{
    struct stat sb;
    return fstatat(d->dirfd, name, &sb, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(sb.st_mode);
}

/* Moves DIR/ns/name.kvt into the quarantine with a log line. */
static void quarantine(kv_disk *d, const char *ns, const char *name, const char *why, uint64_t stored, bool counted)
{
    char from[2 * DISK_NAME_MAX + 8], to[2 * DISK_NAME_MAX + 64];
    snprintf(from, sizeof from, "%s/%s.kvt", ns, name);
    int rc;
    /* never over an earlier quarantined file: the operator wants them all */
    for (uint64_t seq = 0;; seq++) {
        snprintf(to, sizeof to, QUARANTINE "/%s.%s.%lld-%" PRIu64 ".kvt", ns, name, (long long)time(NULL), seq);
        if ((rc = r_rename(d, from, to, RENAME_NOREPLACE)) != -EEXIST || seq == 1000)
            break;
    }
    if (rc < 0) {
        log_msg(LOG_ERR, "disk tier: %s/%s: %s; moving it to %s/%s failed: %s", d->dir, from, why, d->dir, to,
                strerror(-rc));
        return;
    }
    log_msg(LOG_WARN, "disk tier: %s/%s: %s; moved to %s/%s", d->dir, from, why, d->dir, to);
    pthread_mutex_lock(&d->mu);
    d->st.quarantined++;
    if (counted) {
        d->st.used -= stored < d->st.used ? stored : d->st.used;
        d->st.files -= d->st.files > 0;
    }
    pthread_mutex_unlock(&d->mu);
}

static bool layout_eq(const struct kv_disk_layout *a, const struct kv_disk_layout *b)
{
    return a->fingerprint == b->fingerprint && a->dtype == b->dtype && a->block_tokens == b->block_tokens &&
           a->n_layers == b->n_layers && a->n_kv_heads == b->n_kv_heads && a->head_dim == b->head_dim;
}

/* Reads the header of DIR/ns/name.kvt, then the meta (want >= 1) and the
 * data into a buffer from a (want >= 2), checking each.  With op, the
 * buffer is the op's from its allocation on (op->data, op->buf), whatever
 * happens after: a caller may be reading its checked part (op->ready).  A corrupt file is
 * left for the caller to quarantine; the descriptor is closed on return. */
static enum load_res load(kv_disk *d, const char *ns, const char *name, int want, const struct kv_disk_alloc *a,
                          kv_disk_op *op, struct loaded *l)
{
    char path[2 * DISK_NAME_MAX + 8];
    snprintf(path, sizeof path, "%s/%s.kvt", ns, name);
    *l = (struct loaded){0};
    int fd = r_openat(d, path, O_RDONLY | (d->direct ? O_DIRECT : 0), 0);
    if (fd < 0) {
        l->err = -fd;
        snprintf(l->why, sizeof l->why, "%s", fd == -ENOENT ? "no such object" : strerror(-fd));
        return fd == -ENOENT ? L_MISSING : L_IOERR;
    }
    enum load_res res = L_OK;
    struct stat sb;
    uint8_t *hbuf = NULL;
    if (fstat(fd, &sb) != 0) {
        l->err = errno;
        res = L_IOERR;
        goto out;
    }
    l->size = (uint64_t)sb.st_size;
    l->stored = stored_bytes(&sb);
    uint64_t first = l->size < DISK_ALIGN ? disk_align(l->size) : DISK_ALIGN;
    if (!(hbuf = aligned_alloc_zero(first))) {
        res = L_NOMEM;
        goto out;
    }
    int rc = first ? r_rw(d, false, fd, hbuf, first, 0, l->size < first ? l->size : first) : 0;
    if (rc < 0) {
        l->err = -rc;
        res = L_IOERR;
        goto out;
    }
    uint32_t hdr_len = 0;
    enum disk_check ck = disk_hdr_peek(hbuf, (size_t)(l->size < first ? l->size : first), &hdr_len, l->why);
    if (ck == DISK_VALID && hdr_len > l->size) {
        snprintf(l->why, sizeof l->why, "truncated: %" PRIu64 " bytes, the header alone is %u", l->size, hdr_len);
        ck = DISK_CORRUPT;
    } else if (ck == DISK_VALID && hdr_len > first) {
        {
            free(hbuf);
            if (!(hbuf = aligned_alloc_zero(disk_align(hdr_len)))) {
                res = L_NOMEM;
                goto out;
            }
            rc = r_rw(d, false, fd, hbuf, disk_align(hdr_len), 0, hdr_len);
            if (rc < 0) {
                l->err = -rc;
                res = L_IOERR;
                goto out;
            }
        }
    }
    if (ck == DISK_VALID)
        ck = disk_hdr_decode(hbuf, hdr_len, l->size, &l->h, l->why);
    if (ck == DISK_VALID && !layout_eq(&l->h.layout, &d->p.layout)) {
        const struct kv_disk_layout *y = &l->h.layout;
        snprintf(l->why, sizeof l->why,
                 "written for another layout (fingerprint %016" PRIx64 ", dtype %u, block %u, %u layers, %u kv "
                 "heads, head_dim %u)",
                 y->fingerprint, y->dtype, y->block_tokens, y->n_layers, y->n_kv_heads, y->head_dim);
        ck = DISK_FOREIGN;
    }
    if (ck == DISK_VALID && (strcmp(l->h.ns, ns) != 0 || strcmp(l->h.name, name) != 0)) {
        snprintf(l->why, sizeof l->why, "the header names another object (%s/%s)", l->h.ns, l->h.name);
        ck = DISK_CORRUPT;
    }
    if (ck != DISK_VALID) {
        res = ck == DISK_FOREIGN ? L_FOREIGN : ck == DISK_NOMEM ? L_NOMEM : L_CORRUPT;
        goto out;
    }
    if (want >= 1 && l->h.meta_len) {
        if (!(l->meta = aligned_alloc_zero(disk_align(l->h.meta_len)))) {
            res = L_NOMEM;
            goto out;
        }
        rc = r_rw(d, false, fd, l->meta, disk_align(l->h.meta_len), l->h.meta_off, disk_align(l->h.meta_len));
        if (rc < 0) {
            l->err = -rc;
            res = L_IOERR;
            goto out;
        }
        if (XXH3_64bits(l->meta, l->h.meta_len) != l->h.meta_sum) {
            snprintf(l->why, sizeof l->why, "meta checksum mismatch");
            res = L_CORRUPT;
            goto out;
        }
        if (op) { /* the op's from here on: a caller may read it before the data is in */
            pthread_mutex_lock(&op->mu);
            op->meta = l->meta;
            op->meta_len = l->h.meta_len;
            pthread_mutex_unlock(&op->mu);
            l->meta = NULL;
        }
    }
    if (want >= 2 && l->h.data_len) {
        size_t cap = kv_disk_data_alloc_len(l->h.data_len);
        l->alloc = a;
        if (!(l->buf = a->alloc(a->arg, cap, &l->data)) || !l->data) {
            res = L_NOMEM;
            goto out;
        }
        if (op) {
            pthread_mutex_lock(&op->mu);
            op->buf = l->buf;
            op->data = l->data;
            op->data_len = l->h.data_len;
            pthread_mutex_unlock(&op->mu);
            l->buf = NULL;
        }
        struct xfer x = {.d = d, .op = op, .fd = fd, .h = &l->h, .dst = l->data,
                         .in_place = (uintptr_t)l->data % DISK_ALIGN == 0};
        reg_caller(&x, l->data, cap);
        rc = read_chunks(&x, l->why);
        unreg_caller(&x);
        pthread_mutex_lock(&d->mu);
        d->st.chunks_in_place += x.n_in_place;
        pthread_mutex_unlock(&d->mu);
        if (rc > 0) {
            l->err = rc;
            res = L_IOERR;
        } else if (rc < 0) {
            res = L_CORRUPT;
        }
    }
out:
    free(hbuf);
    if (res == L_IOERR)
        snprintf(l->why, sizeof l->why, "read failed: %s", strerror(l->err));
    else if (res == L_NOMEM)
        snprintf(l->why, sizeof l->why, "out of host memory");
    if (res != L_OK)
        loaded_release(l);
    r_close(d, fd);
    return res;
}

/* ---- the ops ------------------------------------------------------------- */

static void do_get(kv_disk *d, kv_disk_op *op)
{
    struct loaded l;
    double t0 = clock_s();
    enum load_res r = load(d, op->ns, op->name, 2, &op->alloc, op, &l);
    pthread_mutex_lock(&d->mu);
    d->st.gets++;
    d->st.read_s += clock_s() - t0;
    if (r == L_OK)
        d->st.bytes_read += l.size;
    pthread_mutex_unlock(&d->mu);
    switch (r) {
    case L_OK: /* its meta is the op's already */
        disk_hdr_release(&l.h);
        op->st = TIER_OK;
        return;
    case L_MISSING:
        op_fail(op, TIER_EINVAL, "%s/%s/%s.kvt: no such object", d->dir, op->ns, op->name);
        return;
    case L_FOREIGN:
        op_fail(op, TIER_EINVAL, "%s/%s/%s.kvt: %s", d->dir, op->ns, op->name, l.why);
        return;
    case L_CORRUPT:
        quarantine(d, op->ns, op->name, l.why, l.stored, true);
        op_fail(op, TIER_EIO, "%s/%s/%s.kvt: %s (moved to %s/" QUARANTINE ")", d->dir, op->ns, op->name, l.why,
                d->dir);
        return;
    case L_IOERR:
        op_fail(op, TIER_EIO, "%s/%s/%s.kvt: %s", d->dir, op->ns, op->name, l.why);
        return;
    case L_NOMEM:
        op_fail(op, TIER_ENOMEM_HOST, "%s/%s/%s.kvt: host memory for the object", d->dir, op->ns, op->name);
        return;
    }
}

static void put_failed(kv_disk *d, kv_disk_op *op, const char *step, int err)
{
    bool log;
    pthread_mutex_lock(&d->mu);
    log = !d->write_err_logged;
    d->write_err_logged = true;
    pthread_mutex_unlock(&d->mu);
    op_fail(op, err == ENOSPC || err == EDQUOT ? TIER_EFULL : TIER_EIO, "%s/%s/%s.kvt: %s failed: %s", d->dir,
            op->ns, op->name, step, strerror(err));
    if (log)
        log_msg(LOG_ERR, "disk tier: %s (further write failures are not logged until a write succeeds)", op->msg);
}

static void do_put(kv_disk *d, kv_disk_op *op)
{
    double t0 = clock_s(), compress_s = 0;
    const struct kv_disk_obj *o = &op->obj;
    struct disk_hdr h = {
        .layout = d->p.layout,
        .meta_len = o->meta_len,
        .meta_sum = o->meta_len ? XXH3_64bits(o->meta, o->meta_len) : 0,
        .data_len = o->data_len,
        .chunk_size = DISK_CHUNK,
        .n_chunks = disk_n_chunks(o->data_len),
    };
    snprintf(h.ns, sizeof h.ns, "%s", op->ns);
    snprintf(h.name, sizeof h.name, "%s", op->name);
    h.meta_off = disk_meta_off(h.n_chunks);
    char tmp[2 * DISK_NAME_MAX + 64], path[2 * DISK_NAME_MAX + 8];
    pthread_mutex_lock(&d->mu);
    uint64_t seq = d->tmp_seq++;
    pthread_mutex_unlock(&d->mu);
    snprintf(tmp, sizeof tmp, "%s/.%s.tmp.%ld.%" PRIu64, op->ns, op->name, (long)getpid(), seq);
    snprintf(path, sizeof path, "%s/%s.kvt", op->ns, op->name);

    uint8_t *meta = NULL, *hbuf = NULL;
    int fd = -1, err = 0;
    const char *step = "";
    if (h.n_chunks && !(h.chunks = calloc(h.n_chunks, sizeof *h.chunks))) {
        op_fail(op, TIER_ENOMEM_HOST, "%s/%s: host memory for a table of %u chunks", d->dir, path, h.n_chunks);
        return;
    }
    uint64_t left = h.data_len;
    for (uint32_t i = 0; i < h.n_chunks; i++, left -= DISK_CHUNK)
        h.chunks[i].raw_len = (uint32_t)(left < DISK_CHUNK ? left : DISK_CHUNK);
    if ((o->meta_len && !(meta = aligned_alloc_zero(disk_align(o->meta_len)))) ||
        !(hbuf = aligned_alloc_zero(disk_align(disk_hdr_size(h.n_chunks))))) {
        op_fail(op, TIER_ENOMEM_HOST, "%s/%s: host memory for the header and meta", d->dir, path);
        goto out;
    }
    int rc = r_mkdir(d, op->ns);
    if (rc == 0)
        rc = r_fsync_dir(d, ".");
    if (rc < 0 && rc != -EEXIST) {
        step = "creating the namespace directory", err = -rc;
        goto fail;
    }
    if (!real_dir(d, op->ns)) {
        step = "the namespace directory (a symbolic link or not a directory)", err = ENOTDIR;
        goto fail;
    }
    fd = r_openat(d, tmp, O_WRONLY | O_CREAT | O_EXCL | (d->direct ? O_DIRECT : 0), 0600);
    if (fd < 0) {
        step = "creating the temporary file", err = -fd;
        fd = -1;
        goto fail;
    }
    if (o->meta_len) {
        memcpy(meta, o->meta, o->meta_len);
        rc = r_rw(d, true, fd, meta, disk_align(o->meta_len), h.meta_off, disk_align(o->meta_len));
        if (rc < 0) {
            step = "writing the meta", err = -rc;
            goto fail;
        }
    }
    bool compress = d->p.compress == KV_DISK_COMPRESS_ALWAYS || (d->p.compress == KV_DISK_COMPRESS_AUTO && o->cold);
    struct xfer x = {.d = d, .fd = fd, .h = &h, .src = o->data, .wr = true,
                     .in_place = (uintptr_t)o->data % DISK_ALIGN == 0,
                     .codec = compress ? disk_codec_for(d->p.layout.dtype) : DISK_CODEC_RAW};
    /* only the whole pages: a registration pins them, and the caller's
     * buffer may end mid-page */
    reg_caller(&x, o->data, o->data_len / DISK_ALIGN * DISK_ALIGN);
    err = write_chunks(&x, &compress_s);
    unreg_caller(&x);
    pthread_mutex_lock(&d->mu);
    d->st.chunks_in_place += x.n_in_place;
    pthread_mutex_unlock(&d->mu);
    if (err) {
        step = "writing the data";
        goto fail;
    }
    disk_hdr_encode(&h, hbuf);
    uint64_t size = disk_file_size(&h);
    if ((rc = r_rw(d, true, fd, hbuf, disk_align(h.hdr_len), 0, disk_align(h.hdr_len))) < 0) {
        step = "writing the header", err = -rc;
        goto fail;
    }
    if ((rc = r_fsync(d, fd)) < 0) {
        step = "fsync", err = -rc;
        goto fail;
    }
    /* charged as its removal will be: what it takes, which a compressing
     * filesystem makes less than its length */
    struct stat sb;
    uint64_t charged = fstat(fd, &sb) == 0 ? stored_bytes(&sb) : size;
    rc = r_close(d, fd);
    fd = -1;
    if (rc < 0) {
        step = "close", err = -rc;
        goto fail;
    }
    struct stat old;
    bool replaced = fstatat(d->dirfd, path, &old, 0) == 0;
    if ((rc = r_rename(d, tmp, path, 0)) < 0) {
        step = "renaming into place", err = -rc;
        goto fail;
    }
    rc = r_fsync_dir(d, op->ns);
    pthread_mutex_lock(&d->mu);
    d->st.used += charged;
    if (replaced)
        d->st.used -= stored_bytes(&old) < d->st.used ? stored_bytes(&old) : d->st.used;
    else
        d->st.files++;
    d->st.puts++;
    d->st.bytes_written += size;
    d->st.compress_s += compress_s;
    d->st.write_s += clock_s() - t0;
    for (uint32_t i = 0; i < h.n_chunks; i++)
        if (h.chunks[i].codec != DISK_CODEC_RAW) {
            d->st.raw_compressed += h.chunks[i].raw_len;
            d->st.stored_compressed += h.chunks[i].stored_len;
        }
    if (rc == 0)
        d->write_err_logged = false;
    pthread_mutex_unlock(&d->mu);
    if (rc < 0) {
        /* In place, but a crash may still undo the rename. */
        put_failed(d, op, "fsync of the directory", -rc);
        goto out;
    }
    op->st = TIER_OK;
    goto out;
fail:
    put_failed(d, op, step, err);
    if (fd >= 0)
        close(fd);
    unlinkat(d->dirfd, tmp, 0);
out:
    free(meta);
    free(hbuf);
    disk_hdr_release(&h);
}

static void do_remove(kv_disk *d, kv_disk_op *op)
{
    char path[2 * DISK_NAME_MAX + 8];
    snprintf(path, sizeof path, "%s/%s.kvt", op->ns, op->name);
    struct stat sb;
    if (fstatat(d->dirfd, path, &sb, 0) != 0)
        return;
    int rc = r_unlink(d, path);
    if (rc < 0) {
        op_fail(op, TIER_EIO, "%s/%s: unlink failed: %s", d->dir, path, strerror(-rc));
        log_msg(LOG_WARN, "disk tier: %s", op->msg);
        return;
    }
    pthread_mutex_lock(&d->mu);
    d->st.used -= stored_bytes(&sb) < d->st.used ? stored_bytes(&sb) : d->st.used;
    d->st.files -= d->st.files > 0;
    pthread_mutex_unlock(&d->mu);
}

static bool is_tmp_name(const char *s)
{
    return s[0] == '.' && strstr(s, ".tmp.") != NULL;
}

/* The stem of "NAME.kvt" when NAME is a valid name. */
static bool kvt_stem(const char *s, char out[DISK_NAME_MAX + 1])
{
    size_t n = strlen(s);
    if (n < 5 || n - 4 > DISK_NAME_MAX || strcmp(s + n - 4, ".kvt") != 0)
        return false;
    memcpy(out, s, n - 4);
    out[n - 4] = '\0';
    return disk_name_ok(out);
}

static bool scan_push(kv_disk_op *op, const char *ns, const char *name, struct loaded *l)
{
    if (op->n_ents == op->cap_ents) {
        size_t cap = op->cap_ents ? 2 * op->cap_ents : 16;
        struct scan_ent *e = realloc(op->ents, cap * sizeof *e);
        if (!e)
            return false;
        op->ents = e;
        op->cap_ents = cap;
    }
    struct scan_ent *e = &op->ents[op->n_ents++];
    snprintf(e->ns, sizeof e->ns, "%s", ns);
    snprintf(e->name, sizeof e->name, "%s", name);
    e->meta = l->meta;
    e->meta_len = l->h.meta_len;
    e->data_len = l->h.data_len;
    l->meta = NULL;
    return true;
}

/* One namespace directory: at start-up, remove temporary files and count
 * the rest; in a scan, collect the objects with their meta. */
static void walk_ns(kv_disk *d, kv_disk_op *op, const char *ns)
{
    bool start = op->kind == OP_START;
    int fd = openat(d->dirfd, ns, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
    if (!dir) {
        if (fd >= 0)
            close(fd);
        else if (errno == ENOENT)
            return; /* a namespace nothing was written to yet */
        log_msg(LOG_WARN, "disk tier: %s/%s: cannot read the directory: %s", d->dir, ns, strerror(errno));
        return;
    }
    struct dirent *e;
    char name[DISK_NAME_MAX + 1];
    while ((e = readdir(dir))) {
        if (start && is_tmp_name(e->d_name)) {
            if (unlinkat(fd, e->d_name, 0) == 0)
                log_msg(LOG_INFO, "disk tier: removed %s/%s/%s, left by an interrupted write", d->dir, ns,
                        e->d_name);
            continue;
        }
        if (!kvt_stem(e->d_name, name))
            continue;
        struct loaded l;
        enum load_res r = load(d, ns, name, start ? 0 : 1, NULL, NULL, &l);
        if (r == L_CORRUPT) {
            quarantine(d, ns, name, l.why, l.stored, !start);
        } else if (r == L_FOREIGN && start) {
            log_msg(LOG_INFO, "disk tier: %s/%s/%s.kvt: %s; left alone", d->dir, ns, name, l.why);
        } else if (r == L_IOERR || r == L_NOMEM) {
            log_msg(LOG_WARN, "disk tier: %s/%s/%s.kvt: skipped: %s", d->dir, ns, name, l.why);
        } else if (r == L_OK && !start && !scan_push(op, ns, name, &l)) {
            op_fail(op, TIER_ENOMEM_HOST, "host memory for the scan of %s", d->dir);
        }
        if (start && (r == L_OK || r == L_FOREIGN)) {
            pthread_mutex_lock(&d->mu);
            d->st.used += l.stored;
            d->st.files += r == L_OK;
            pthread_mutex_unlock(&d->mu);
        }
        loaded_release(&l);
        if (op->st != TIER_OK)
            break;
    }
    closedir(dir);
}

static void do_walk(kv_disk *d, kv_disk_op *op)
{
    if (op->ns[0]) {
        walk_ns(d, op, op->ns);
        return;
    }
    int fd = openat(d->dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
    if (!dir) {
        if (fd >= 0)
            close(fd);
        op_fail(op, TIER_EIO, "%s: cannot read the directory: %s", d->dir, strerror(errno));
        return;
    }
    struct dirent *e;
    while ((e = readdir(dir)) && op->st == TIER_OK) {
        struct stat sb;
        if (!disk_name_ok(e->d_name) || strcmp(e->d_name, QUARANTINE) == 0 ||
            fstatat(d->dirfd, e->d_name, &sb, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISDIR(sb.st_mode))
            continue;
        walk_ns(d, op, e->d_name);
    }
    closedir(dir);
}

/* ---- the I/O thread and the queue ---------------------------------------- */

/* The op belongs to its caller once done is set: nothing reads it after. */
static void op_complete(kv_disk *d, kv_disk_op *op)
{
    bool notify = d->p.notify && (op->kind == OP_PUT || op->kind == OP_GET);
    pthread_mutex_lock(&d->mu);
    if (op->kind == OP_PUT)
        d->reserved -= op->reserved;
    if (op->st != TIER_OK) {
        d->st.failures++;
        snprintf(d->errmsg, sizeof d->errmsg, "%s", op->msg);
    }
    pthread_mutex_unlock(&d->mu);
    if (op->kind == OP_REMOVE || op->kind == OP_DEFER) {
        free(op);
    } else {
        pthread_mutex_lock(&op->mu);
        op->done = true;
        pthread_cond_broadcast(&op->cv);
        pthread_mutex_unlock(&op->mu);
    }
    if (notify)
        d->p.notify(d->p.notify_arg);
}

static void *io_main(void *arg)
{
    kv_disk *d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (!d->head && !d->stop)
            pthread_cond_wait(&d->cv, &d->mu);
        kv_disk_op *op = d->head;
        if (!op)
            break;
        d->head = op->next;
        if (!d->head)
            d->tail = NULL;
        pthread_mutex_unlock(&d->mu);
        switch (op->kind) {
        case OP_PUT: do_put(d, op); break;
        case OP_GET: do_get(d, op); break;
        case OP_REMOVE: do_remove(d, op); break;
        case OP_DEFER: op->defer_fn(op->defer_arg, op->defer_p); break;
        case OP_SCAN:
        case OP_START: do_walk(d, op); break;
        }
        op_complete(d, op);
        pthread_mutex_lock(&d->mu);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

static kv_disk_op *op_new(enum op_kind kind, const char *ns, const char *name)
{
    kv_disk_op *op = calloc(1, sizeof *op);
    if (!op)
        return NULL;
    op->kind = kind;
    pthread_mutex_init(&op->mu, NULL);
    pthread_cond_init(&op->cv, NULL);
    snprintf(op->ns, sizeof op->ns, "%s", ns ? ns : "");
    snprintf(op->name, sizeof op->name, "%s", name ? name : "");
    return op;
}

static void scan_free(kv_disk_op *op)
{
    for (size_t i = 0; i < op->n_ents; i++)
        free(op->ents[i].meta);
    free(op->ents);
}

static void op_destroy(kv_disk_op *op)
{
    free(op->meta);
    if (op->buf)
        op->alloc.free(op->alloc.arg, op->buf);
    scan_free(op);
    pthread_mutex_destroy(&op->mu);
    pthread_cond_destroy(&op->cv);
    free(op);
}

static void op_queue(kv_disk *d, kv_disk_op *op)
{
    pthread_mutex_lock(&d->mu);
    if (d->tail)
        d->tail->next = op;
    else
        d->head = op;
    d->tail = op;
    pthread_cond_signal(&d->cv);
    pthread_mutex_unlock(&d->mu);
}

static enum tier_status check_names(kv_disk *d, const char *ns, const char *name)
{
    if (!ns || !disk_name_ok(ns) || strcmp(ns, QUARANTINE) == 0)
        return disk_fail(d, TIER_EINVAL, "disk tier: bad namespace \"%.80s\" (want [A-Za-z0-9_-]{1,64}, not \"%s\")",
                         ns ? ns : "(null)", QUARANTINE);
    if (!name || !disk_name_ok(name))
        return disk_fail(d, TIER_EINVAL, "disk tier: bad name \"%.80s\" (want [A-Za-z0-9_-]{1,64})",
                         name ? name : "(null)");
    return TIER_OK;
}

enum tier_status kv_disk_put(kv_disk *d, const char *ns, const char *name, const struct kv_disk_obj *o,
                             kv_disk_op **op)
{
    *op = NULL;
    enum tier_status st = check_names(d, ns, name);
    if (st != TIER_OK)
        return st;
    if (o->meta_len > DISK_MAX_META || o->data_len > DISK_MAX_DATA || (o->meta_len && !o->meta) ||
        (o->data_len && !o->data))
        return disk_fail(d, TIER_EINVAL, "disk tier: %s/%s: meta of %zu bytes (at most %zu) or data of %zu bytes",
                         ns, name, o->meta_len, DISK_MAX_META, o->data_len);
    uint32_t n = disk_n_chunks(o->data_len);
    uint64_t need = disk_data_off(n, o->meta_len) + (n ? (uint64_t)(n - 1) * DISK_CHUNK : 0) +
                    disk_align(o->data_len - (n ? (uint64_t)(n - 1) * DISK_CHUNK : 0));
    kv_disk_op *p = op_new(OP_PUT, ns, name);
    if (!p)
        return disk_fail(d, TIER_ENOMEM_HOST, "disk tier: host memory for an op");
    pthread_mutex_lock(&d->mu);
    /* Counts the whole raw size and not what it replaces: a conservative
     * bound that needs no disk access on this thread. */
    bool fits = d->st.used + d->reserved + need <= d->st.budget;
    if (fits)
        d->reserved += need;
    pthread_mutex_unlock(&d->mu);
    if (!fits) {
        op_destroy(p);
        struct kv_disk_stats s = kv_disk_stats(d);
        return disk_fail(d, TIER_EFULL, "disk tier: %s/%s: %" PRIu64 " bytes do not fit the budget (%zu of %zu used)",
                         ns, name, need, s.used, s.budget);
    }
    p->obj = *o;
    p->reserved = need;
    op_queue(d, p);
    *op = p;
    return TIER_OK;
}

size_t kv_disk_data_alloc_len(size_t len)
{
    return len > SIZE_MAX - DISK_ALIGN ? SIZE_MAX : (size_t)disk_align(len);
}

void *kv_disk_heap_alloc(void *arg, size_t len, void **data)
{
    (void)arg;
    void *p = NULL;
    if (posix_memalign(&p, DISK_ALIGN, len) != 0)
        return NULL;
    *data = p;
    return p;
}

static void heap_free(void *arg, void *buf)
{
    (void)arg;
    free(buf);
}

enum tier_status kv_disk_get_into(kv_disk *d, const char *ns, const char *name, const struct kv_disk_alloc *a,
                                  kv_disk_op **op)
{
    *op = NULL;
    enum tier_status st = check_names(d, ns, name);
    if (st != TIER_OK)
        return st;
    if (!a || !a->alloc || !a->free)
        return disk_fail(d, TIER_EINVAL, "disk tier: %s/%s: a get needs an allocator and its free", ns, name);
    kv_disk_op *p = op_new(OP_GET, ns, name);
    if (!p)
        return disk_fail(d, TIER_ENOMEM_HOST, "disk tier: host memory for an op");
    p->alloc = *a;
    op_queue(d, p);
    *op = p;
    return TIER_OK;
}

enum tier_status kv_disk_get(kv_disk *d, const char *ns, const char *name, kv_disk_op **op)
{
    return kv_disk_get_into(d, ns, name, &(struct kv_disk_alloc){kv_disk_heap_alloc, heap_free, NULL}, op);
}

void kv_disk_defer(kv_disk *d, void (*fn)(void *arg, void *p), void *arg, void *p)
{
    kv_disk_op *op = op_new(OP_DEFER, NULL, NULL);
    if (!op) {
        fn(arg, p);
        return;
    }
    op->defer_fn = fn;
    op->defer_arg = arg;
    op->defer_p = p;
    op_queue(d, op);
}

void kv_disk_remove(kv_disk *d, const char *ns, const char *name)
{
    if (check_names(d, ns, name) != TIER_OK)
        return;
    kv_disk_op *p = op_new(OP_REMOVE, ns, name);
    if (!p) {
        disk_fail(d, TIER_ENOMEM_HOST, "disk tier: host memory for an op: %s/%s not removed", ns, name);
        return;
    }
    op_queue(d, p);
}

bool kv_disk_op_done(kv_disk_op *op)
{
    pthread_mutex_lock(&op->mu);
    bool done = op->done;
    pthread_mutex_unlock(&op->mu);
    return done;
}

enum tier_status kv_disk_op_wait(kv_disk_op *op)
{
    pthread_mutex_lock(&op->mu);
    while (!op->done)
        pthread_cond_wait(&op->cv, &op->mu);
    pthread_mutex_unlock(&op->mu);
    return op->st;
}

size_t kv_disk_op_ready(kv_disk_op *op, void **data, size_t *data_len)
{
    pthread_mutex_lock(&op->mu);
    size_t n = op->ready;
    *data = op->data;
    *data_len = op->data_len;
    pthread_mutex_unlock(&op->mu);
    return n;
}

const void *kv_disk_op_meta(kv_disk_op *op, size_t *meta_len)
{
    pthread_mutex_lock(&op->mu);
    const void *meta = op->meta;
    *meta_len = op->meta_len;
    pthread_mutex_unlock(&op->mu);
    return meta;
}

void *kv_disk_op_wait_ready(kv_disk_op *op, size_t n)
{
    pthread_mutex_lock(&op->mu);
    while (op->ready < n && !op->done)
        pthread_cond_wait(&op->cv, &op->mu);
    void *data = op->ready >= n ? op->data : NULL;
    pthread_mutex_unlock(&op->mu);
    return data;
}

enum tier_status kv_disk_op_status(const kv_disk_op *op)
{
    return op->st;
}

const char *kv_disk_op_errmsg(const kv_disk_op *op)
{
    return op->msg;
}

void kv_disk_op_take_buf(kv_disk_op *op, void **meta, size_t *meta_len, void **buf, void **data, size_t *data_len)
{
    if (op->st != TIER_OK) { /* a failed get's buffer is freed with the op */
        *meta = *buf = *data = NULL;
        *meta_len = *data_len = 0;
        return;
    }
    *meta = op->meta;
    *meta_len = op->meta_len;
    *buf = op->buf;
    *data = op->data;
    *data_len = op->data_len;
    op->meta = op->data = op->buf = NULL;
    op->meta_len = op->data_len = 0;
}

void kv_disk_op_take(kv_disk_op *op, void **meta, size_t *meta_len, void **data, size_t *data_len)
{
    void *buf;
    kv_disk_op_take_buf(op, meta, meta_len, &buf, data, data_len);
}

void kv_disk_op_free(kv_disk_op *op)
{
    if (!op)
        return;
    kv_disk_op_wait(op);
    op_destroy(op);
}

/* Queues a walk of the directory and waits for it. */
static enum tier_status run_walk(kv_disk *d, enum op_kind kind, const char *ns, kv_disk_op **out)
{
    kv_disk_op *op = op_new(kind, ns, NULL);
    *out = op;
    if (!op)
        return disk_fail(d, TIER_ENOMEM_HOST, "disk tier: host memory for an op");
    op_queue(d, op);
    return kv_disk_op_wait(op);
}

enum tier_status kv_disk_scan(kv_disk *d, const char *ns, kv_disk_scan_fn fn, void *arg)
{
    if (ns && ns[0] && (!disk_name_ok(ns) || strcmp(ns, QUARANTINE) == 0))
        return disk_fail(d, TIER_EINVAL, "disk tier: bad namespace \"%.80s\"", ns);
    kv_disk_op *op;
    enum tier_status st = run_walk(d, OP_SCAN, ns, &op);
    if (st == TIER_OK)
        for (size_t i = 0; i < op->n_ents; i++) {
            const struct scan_ent *e = &op->ents[i];
            fn(arg, e->ns, e->name, e->meta, e->meta_len, e->data_len);
        }
    kv_disk_op_free(op);
    return st;
}

struct kv_disk_stats kv_disk_stats(kv_disk *d)
{
    pthread_mutex_lock(&d->mu);
    struct kv_disk_stats s = d->st;
    pthread_mutex_unlock(&d->mu);
    return s;
}

void kv_disk_fail_nth(kv_disk *d, uint64_t n, int err, bool every)
{
    pthread_mutex_lock(&d->mu);
    d->fail_n = n ? d->submitted + n : 0;
    d->fail_err = err;
    d->fail_every = every;
    pthread_mutex_unlock(&d->mu);
}

/* ---- open and free ------------------------------------------------------- */

/* mkdir -p with mode 0700 for what it creates. */
static int mkdir_p(const char *path)
{
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf)
        return -ENAMETOOLONG;
    for (char *s = buf + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = '\0';
        if (mkdir(buf, 0700) != 0 && errno != EEXIST)
            return -errno;
        *s = '/';
    }
    return mkdir(buf, 0700) != 0 && errno != EEXIST ? -errno : 0;
}

/* Whether the directory's filesystem takes O_DIRECT: tmpfs refuses the
 * open, some others the first aligned write. */
static bool probe_direct(kv_disk *d, char *why, size_t cap)
{
    char name[64];
    snprintf(name, sizeof name, ".probe.tmp.%ld", (long)getpid());
    int fd = openat(d->dirfd, name, O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
    if (fd < 0) {
        snprintf(why, cap, "O_DIRECT refused: %s", strerror(errno));
        return false;
    }
    bool ok = pwrite(fd, d->stage[0], DISK_ALIGN, 0) == (ssize_t)DISK_ALIGN;
    if (!ok)
        snprintf(why, cap, "O_DIRECT write refused: %s", strerror(errno));
    close(fd);
    unlinkat(d->dirfd, name, 0);
    return ok;
}

enum tier_status kv_disk_open(const struct kv_disk_params *p, kv_disk **out)
{
    *out = NULL;
    if (!p->dir || !p->dir[0] || p->compress_threads < 0 || p->compress_threads > 64 ||
        (unsigned)p->compress > KV_DISK_COMPRESS_NEVER)
        return TIER_EINVAL;
    kv_disk *d = calloc(1, sizeof *d);
    if (!d)
        return TIER_ENOMEM_HOST;
    d->p = *p;
    d->dirfd = d->lockfd = -1;
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
    enum tier_status st = TIER_OK;
    char why[128];
    int rc;
    bool ring = false;
    if (!(d->dir = strdup(p->dir))) {
        st = TIER_ENOMEM_HOST;
        goto fail;
    }
    d->p.dir = d->dir;
    if ((rc = mkdir_p(d->dir)) < 0 || (d->dirfd = open(d->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0 ||
        (mkdirat(d->dirfd, QUARANTINE, 0700) != 0 && errno != EEXIST)) {
        st = disk_fail(d, TIER_EIO, "disk tier: %s: cannot use the directory: %s", d->dir,
                       strerror(rc < 0 ? -rc : errno));
        goto fail;
    }
    if (!real_dir(d, QUARANTINE)) {
        st = disk_fail(d, TIER_EIO, "disk tier: %s/" QUARANTINE " is a symbolic link or not a directory", d->dir);
        goto fail;
    }
    d->lockfd = openat(d->dirfd, ".lock", O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (d->lockfd < 0 || flock(d->lockfd, LOCK_EX | LOCK_NB) != 0) {
        st = disk_fail(d, TIER_EIO, "disk tier: %s: %s", d->dir,
                       errno == EWOULDBLOCK ? "in use by another process" : strerror(errno));
        goto fail;
    }
    for (int i = 0; i < NSTAGE; i++)
        if (!(d->stage[i] = aligned_alloc_zero(DISK_CHUNK))) {
            st = disk_fail(d, TIER_ENOMEM_HOST, "disk tier: host memory for the staging buffers");
            goto fail;
        }
    if ((rc = io_uring_queue_init(4 * NSTAGE, &d->ring, 0)) < 0) {
        st = disk_fail(d, TIER_EIO, "disk tier: io_uring_queue_init: %s", strerror(-rc));
        goto fail;
    }
    ring = true;
    /* The kernel runs ops that can block (open, fsync, buffered I/O) on
     * worker threads of the process ("iou-wrk-*"), one of which stays once
     * started; as many as the chunks in flight is enough, and bounds them. */
    unsigned max_workers[2] = {NSTAGE, NSTAGE};
    if ((rc = io_uring_register_iowq_max_workers(&d->ring, max_workers)) < 0)
        log_msg(LOG_DEBUG, "disk tier: io_uring_register_iowq_max_workers: %s", strerror(-rc));
    struct iovec iov[NSTAGE];
    for (int i = 0; i < NSTAGE; i++)
        iov[i] = (struct iovec){d->stage[i], DISK_CHUNK};
    rc = io_uring_register_buffers_sparse(&d->ring, NSTAGE + NREG);
    if (rc == 0 && (rc = io_uring_register_buffers_update_tag(&d->ring, 0, iov, NULL, NSTAGE)) == NSTAGE)
        d->fixed = d->reg_caller = true;
    if (!d->reg_caller) {
        log_msg(LOG_INFO, "disk tier: %s: no sparse buffer table (%s); callers' buffers go with plain reads and writes",
                d->dir, strerror(rc < 0 ? -rc : EAGAIN));
        io_uring_unregister_buffers(&d->ring);
        rc = io_uring_register_buffers(&d->ring, iov, NSTAGE);
        d->fixed = rc == 0;
        if (!d->fixed)
            log_msg(LOG_INFO, "disk tier: %s: staging buffers not registered (%s); plain reads and writes",
                    d->dir, strerror(-rc));
    }
    d->st.register_caller = d->reg_caller;
    d->direct = !getenv("KVTIER_DISK_BUFFERED") && probe_direct(d, why, sizeof why);
    if (getenv("KVTIER_DISK_BUFFERED"))
        snprintf(why, sizeof why, "KVTIER_DISK_BUFFERED is set");
    if (d->direct)
        log_msg(LOG_INFO, "disk tier: %s: O_DIRECT", d->dir);
    else
        log_msg(LOG_INFO, "disk tier: %s: buffered I/O (%s)", d->dir, why);
    d->st.direct = d->direct;
    d->st.budget = p->budget;
    if (!p->budget) {
        struct statvfs vfs;
        if (fstatvfs(d->dirfd, &vfs) != 0) {
            st = disk_fail(d, TIER_EIO, "disk tier: %s: statvfs: %s", d->dir, strerror(errno));
            goto fail;
        }
        d->st.budget = (size_t)((uint64_t)vfs.f_bavail * vfs.f_frsize / 4);
    }
    const char *pause_env = getenv("KVTIER_DISK_PAUSE_AFTER_CHUNK"), *delay_env = getenv("KVTIER_DISK_READ_DELAY_MS");
    if (pause_env)
        d->pause_after = strtoull(pause_env, NULL, 10);
    if (delay_env) { /* a test hook: at most 10 s a window */
        unsigned long ms = strtoul(delay_env, NULL, 10);
        d->read_delay_ms = ms > 10000 ? 10000u : (unsigned)ms;
    }
    if (!pool_start(&d->pool, p->compress_threads ? p->compress_threads : 2)) {
        st = disk_fail(d, TIER_ENOMEM_HOST, "disk tier: starting the compress threads");
        goto fail;
    }
    if (pthread_create(&d->io, NULL, io_main, d) != 0) {
        st = disk_fail(d, TIER_ENOMEM_HOST, "disk tier: starting the I/O thread");
        pool_stop(&d->pool);
        goto fail;
    }
    kv_disk_op *op;
    st = run_walk(d, OP_START, "", &op);
    if (op && st != TIER_OK)
        set_errmsg(d, op->msg);
    kv_disk_op_free(op);
    if (st != TIER_OK) {
        kv_disk_free(d);
        return st;
    }
    /* the daemon's fault sweep: KVTIER_DISK_FAIL_NTH=n fails the nth
     * submission after the start-up scan with EIO */
    const char *fail_env = getenv("KVTIER_DISK_FAIL_NTH");
    if (fail_env && strtoull(fail_env, NULL, 10))
        kv_disk_fail_nth(d, strtoull(fail_env, NULL, 10), EIO, false);
    *out = d;
    return TIER_OK;
fail:
    /* the caller reads why from the log: there is no tier to ask */
    log_msg(LOG_ERR, "%s", d->errmsg);
    if (ring)
        io_uring_queue_exit(&d->ring);
    for (int i = 0; i < NSTAGE; i++)
        free(d->stage[i]);
    if (d->lockfd >= 0)
        close(d->lockfd);
    if (d->dirfd >= 0)
        close(d->dirfd);
    free(d->dir);
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    free(d);
    return st;
}

void kv_disk_free(kv_disk *d)
{
    if (!d)
        return;
    pthread_mutex_lock(&d->mu);
    d->stop = true;
    pthread_cond_signal(&d->cv);
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->io, NULL);
    pool_stop(&d->pool);
    io_uring_queue_exit(&d->ring);
    for (int i = 0; i < NSTAGE; i++)
        free(d->stage[i]);
    close(d->lockfd);
    close(d->dirfd);
    free(d->dir);
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    free(d);
}
