/* disk.h - the disk tier: self-describing, checksummed files under one
 * directory, written and read by one I/O thread through io_uring, so the
 * engine thread never blocks on the disk.
 *
 * An object is (ns, name) -> the file DIR/ns/name.kvt.  It holds a small
 * meta blob (the caller's: a session's JSON, a prefix block's tokens),
 * readable without the data, and a bulk data blob (a sequence image), cut
 * into chunks that are each checksummed and, when compression pays,
 * byte-shuffled and zstd-compressed.  A file is written whole under a
 * temporary name, fsynced, renamed into place and its directory fsynced,
 * so a crash leaves either the old object, the new one, or none; never a
 * file that reads as valid but wrong.  Every file records the layout it
 * was written for (model fingerprint, dtype, block size, heads, head_dim);
 * one written for another layout or format version is skipped with one
 * log line, one that fails its checks is moved to DIR/quarantine.
 *
 * Operations are asynchronous: kv_disk_put / kv_disk_get queue the work
 * and return an op; the caller polls kv_disk_op_done (the notify callback
 * fires from the I/O thread after every completion) or blocks in
 * kv_disk_op_wait.  Names: ns and name are [A-Za-z0-9_-]{1,64}.
 *
 * Data buffers: raw (uncompressed) chunks move between the file and the
 * caller's buffer itself, with no staging copy, whenever that buffer is
 * 4 KiB-aligned: a put's data (chunks whose length is a multiple of 4 KiB;
 * an unaligned tail goes through staging, so the caller's bytes past
 * data_len are never read or written), and a get's buffer, which the
 * caller's allocator (kv_disk_get_into) or the tier (kv_disk_get) sizes to
 * kv_disk_data_alloc_len so that even the tail chunk is read in place.  A
 * daemon whose KV lives on a device passes page-locked buffers
 * (be_host_alloc), so a restored image goes disk -> pinned memory ->
 * device with no copy in between.
 * Compressed chunks go through staging and are decoded into the buffer.
 */
#ifndef KVTIER_TIERS_DISK_H
#define KVTIER_TIERS_DISK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tiers/kvstore.h"

typedef struct kv_disk kv_disk;
typedef struct kv_disk_op kv_disk_op;

enum kv_disk_compress {
    KV_DISK_COMPRESS_AUTO = 0, /* cold writes compressed (in the background), hot ones raw */
    KV_DISK_COMPRESS_ALWAYS = 1,
    KV_DISK_COMPRESS_NEVER = 2,
};

/* What the data in a file was written for; a file whose layout differs
 * from the tier's is never handed out. */
struct kv_disk_layout {
    uint64_t fingerprint; /* the model's (model_fingerprint) */
    uint32_t dtype;       /* enum be_dtype of the KV */
    uint32_t block_tokens, n_layers, n_kv_heads, head_dim;
};

struct kv_disk_params {
    const char *dir;        /* created 0700 if missing (and its parents) */
    size_t budget;          /* bytes all files may take; 0 = a quarter of the free space at open */
    enum kv_disk_compress compress;
    struct kv_disk_layout layout;
    int compress_threads;   /* 0 = 2 */
    void (*notify)(void *arg); /* called on the I/O thread after each put or get completes; may be NULL */
    void *notify_arg;
};

/* Creates the directory, removes temporary files a crash left, and
 * quarantines files whose header does not check.  TIER_EIO naming the
 * path when the directory cannot be used. */
enum tier_status kv_disk_open(const struct kv_disk_params *p, kv_disk **out);
/* Waits for the ops in flight, then frees everything.  Accepts NULL. */
void kv_disk_free(kv_disk *d);
/* The last failure's text (which file, which check); "" if none. */
const char *kv_disk_errmsg(const kv_disk *d); /* accepts NULL */

struct kv_disk_obj {
    const void *meta;
    size_t meta_len;  /* at most 16 MiB */
    const void *data;
    size_t data_len;
    bool cold;        /* KV_DISK_COMPRESS_AUTO compresses cold objects only */
};

/* Queues the write of an object, replacing any of that name once it is
 * complete.  o's buffers must stay valid and unchanged until the op is
 * done.  TIER_EFULL when the budget cannot hold it (nothing is written),
 * TIER_EINVAL for a bad name, TIER_ENOMEM_HOST. */
enum tier_status kv_disk_put(kv_disk *d, const char *ns, const char *name, const struct kv_disk_obj *o,
                             kv_disk_op **op);
/* Queues the read of an object's meta and data; when done, kv_disk_op_take
 * hands them out.  A missing object is TIER_EINVAL from the op ("no such
 * object"); a corrupt one TIER_EIO, and its file is quarantined. */
enum tier_status kv_disk_get(kv_disk *d, const char *ns, const char *name, kv_disk_op **op);

/* The bytes a get's data buffer holds for data of len bytes: whole 4 KiB
 * pages, so the tail chunk is read in place too. */
size_t kv_disk_data_alloc_len(size_t len);
/* kv_disk_get's allocator (struct kv_disk_alloc's alloc; arg unused): ordinary
 * memory aligned so that raw chunks are read in place, freed with free(). */
void *kv_disk_heap_alloc(void *arg, size_t len, void **data);

/* Where a get's data goes.  alloc runs on the I/O thread once the header
 * has checked, for data_len > 0 only: it returns a buffer handle of at
 * least len = kv_disk_data_alloc_len(data_len) bytes with *data its first
 * byte, or NULL (the op fails with TIER_ENOMEM_HOST).  free releases a
 * handle alloc returned; the tier calls it for a get that fails after the
 * allocation or whose buffer was never taken, on whichever thread frees
 * the op.  Both must be safe to call from any thread. */
struct kv_disk_alloc {
    void *(*alloc)(void *arg, size_t len, void **data);
    void (*free)(void *arg, void *buf);
    void *arg;
};
/* kv_disk_get with the data in a buffer from a (copied; a->arg must stay
 * valid until the op is freed).  Take it with kv_disk_op_take_buf. */
enum tier_status kv_disk_get_into(kv_disk *d, const char *ns, const char *name, const struct kv_disk_alloc *a,
                                  kv_disk_op **op);
/* Removes an object (queued; nothing to wait for).  A missing one is fine.
 * Its bytes count against the budget until the I/O thread has run it (an
 * op queued after it, e.g. a get, is done only after it). */
void kv_disk_remove(kv_disk *d, const char *ns, const char *name);
/* Runs fn(arg, p) on the I/O thread after the ops queued before it: for
 * freeing a large buffer (a restored image) off the caller's thread.  Runs
 * it at once when there is no host memory for the op. */
void kv_disk_defer(kv_disk *d, void (*fn)(void *arg, void *p), void *arg, void *p);

bool kv_disk_op_done(kv_disk_op *op);
/* Blocks until op is done; returns its status. */
enum tier_status kv_disk_op_wait(kv_disk_op *op);
/* The status of a done op, and its message (names the file and reason). */
enum tier_status kv_disk_op_status(const kv_disk_op *op);
const char *kv_disk_op_errmsg(const kv_disk_op *op);
/* A get's data as it arrives: *data its first byte (NULL until the file's
 * header has checked and the buffer is allocated), *data_len its length;
 * returns how many of its first bytes are in place and checked.  Chunks
 * complete in order, and the notify callback fires each time the count
 * grows.  Those bytes stay put until the buffer is taken or the op freed,
 * a failed op's too.  For a restore that computes with the first layers
 * while the last are still being read. */
size_t kv_disk_op_ready(kv_disk_op *op, void **data, size_t *data_len);
/* A get's meta as soon as it has checked, before its data is read (so
 * whenever kv_disk_op_ready's *data is not NULL): NULL until then, or for
 * an object without one.  It stays the op's, in place, until
 * kv_disk_op_take_buf takes it or the op is freed. */
const void *kv_disk_op_meta(kv_disk_op *op, size_t *meta_len);
/* Blocks until the first n bytes of a get's data are in or the op is done;
 * the data's first byte if they are, NULL if the op ended without them. */
void *kv_disk_op_wait_ready(kv_disk_op *op, size_t n);
/* A done kv_disk_get's meta and data; the caller takes ownership (free()).
 * A failed one hands out none (NULL, 0). */
void kv_disk_op_take(kv_disk_op *op, void **meta, size_t *meta_len, void **data, size_t *data_len);
/* A done get's meta (free()) and data: *buf the allocator's handle (the
 * caller frees it), *data its first byte.  NULL, NULL for no data. */
void kv_disk_op_take_buf(kv_disk_op *op, void **meta, size_t *meta_len, void **buf, void **data, size_t *data_len);
/* Waits if still in flight, then frees.  Accepts NULL. */
void kv_disk_op_free(kv_disk_op *op);

/* Calls fn for every valid object of namespace ns ("" = every namespace)
 * with its meta; files that do not check are quarantined and skipped.  For
 * start-up: it blocks the caller until the scan is done. */
typedef void (*kv_disk_scan_fn)(void *arg, const char *ns, const char *name, const void *meta, size_t meta_len,
                                size_t data_len);
enum tier_status kv_disk_scan(kv_disk *d, const char *ns, kv_disk_scan_fn fn, void *arg);

struct kv_disk_stats {
    size_t budget, used;         /* bytes of files (stored sizes) */
    uint64_t files;
    uint64_t puts, gets, failures, quarantined;
    uint64_t bytes_written, bytes_read;  /* stored bytes */
    uint64_t raw_compressed, stored_compressed; /* of compressed chunks: the ratio */
    double compress_s, write_s, read_s;  /* time spent */
    bool direct;                 /* O_DIRECT in use (else buffered) */
    bool register_caller;        /* callers' buffers are registered with the ring when an op runs */
    uint64_t chunks_in_place;    /* raw chunks moved straight from or into a caller's buffer */
    uint64_t registered;         /* ops whose caller's buffer was registered with the ring */
};
struct kv_disk_stats kv_disk_stats(kv_disk *d);

/* Tests: make the nth io_uring submission from now (1-based) complete
 * with -err (e.g. EIO, ENOSPC); 0 turns it off.  every: fail from n on. */
void kv_disk_fail_nth(kv_disk *d, uint64_t n, int err, bool every);

#endif
