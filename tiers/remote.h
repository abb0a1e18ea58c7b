/* remote.h - the remote tier: prefix-cache blocks in Redis (one server
 * over TCP or a Unix socket, or a Redis Cluster), shared by every daemon
 * that serves the same model, so that a fleet computes a prefix once.
 *
 * A block is one key, "kvt:<model fingerprint>:<layout>:p<namespace>:<chain
 * hash>" (the layout: KV dtype, block tokens, layers, KV heads, head_dim
 * and the weights' variant), whose value is the block serialized by the
 * store (kv_store_prefix_ship) in the disk tier's checksummed container
 * (disk_blob_encode).  A value is checked on the lookup's thread (the
 * container, its layout, namespace and name) before the caller sees it;
 * the caller's kv_store_prefix_insert checks the rest.  Anything that
 * does not check is a miss, counted by kind, never an error.
 *
 * Two threads, each with its own connections: one publishes (a bounded
 * queue: past its bytes a block is dropped and counted), one looks up
 * (a chain's keys in pipelined batches, one round trip per batch, up to
 * the first miss).  Every read and write is bounded by the timeout; a
 * node that fails is left alone for a backoff that doubles up to 5 s, its
 * keys are misses meanwhile, and the log says so once per change of
 * state.  In a cluster the keys go to their hash slot's node (CLUSTER
 * SLOTS, CRC16), following MOVED and ASK once per command.
 */
#ifndef KVTIER_TIERS_REMOTE_H
#define KVTIER_TIERS_REMOTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tiers/disk.h"

typedef struct kv_remote kv_remote;
typedef struct kv_remote_fetch kv_remote_fetch;

struct kv_remote_params {
    /* "redis://host[:port][/db]" or "unix:PATH"; or NULL and cluster */
    const char *url;
    const char *cluster;  /* "host:port,host:port,...": seed nodes of a Redis Cluster */
    const char *user;     /* ACL user; NULL: AUTH with the password alone */
    const char *password; /* NULL: no AUTH */
    int timeout_ms;       /* every connect, read and write; 0 = 500 */
    int ttl_s;            /* set on publish, refreshed on every hit; 0 = 86400 */
    size_t queue_bytes;   /* blocks waiting to be published; 0 = 64 MiB */
    bool compress;        /* publish values with zstd-compressed chunks (any value read may be) */
    size_t warm_bytes;    /* memory for lookups faulted in at start, not by the first ones (at most 128 MiB) */
    size_t block_bytes;   /* a serialized block's size: a value claiming more is corrupt; 0 = no bound */
    struct kv_disk_layout layout;
    const char *variant;  /* what else changes the KV values (the weights' format): part of the key */
    void (*notify)(void *arg); /* a fetch is done, a publish batch sent (on those threads); may be NULL */
    void *notify_arg;
};

enum kv_remote_err {
    KV_REMOTE_E_CONNECT = 0, /* connect refused or timed out */
    KV_REMOTE_E_TIMEOUT,     /* a read or write past the timeout */
    KV_REMOTE_E_IO,          /* the connection broke */
    KV_REMOTE_E_AUTH,        /* AUTH or SELECT refused */
    KV_REMOTE_E_OOM,         /* "OOM command not allowed": Redis is full */
    KV_REMOTE_E_REPLY,       /* another error reply (CLUSTERDOWN, a redirection loop, ...) */
    KV_REMOTE_E_CORRUPT,     /* a value that fails its checks */
    KV_REMOTE_E_FOREIGN,     /* a value written for another model or layout */
    KV_REMOTE_E_DROPPED,     /* a block not published: the queue was full */
    KV_REMOTE_N_ERR
};
const char *kv_remote_err_name(enum kv_remote_err e);

struct kv_remote_stats {
    uint64_t lookups;       /* fetches run */
    uint64_t hit_blocks;    /* blocks found (and checked) */
    uint64_t miss_lookups;  /* fetches that stopped before the chain's end */
    uint64_t bytes_in, bytes_out; /* values fetched and published */
    uint64_t published;     /* blocks stored */
    double fetch_ms;        /* time the fetches took, summed */
    uint64_t errors[KV_REMOTE_N_ERR];
};

/* Starts the threads: the lookup thread connects at once (and warms its
 * memory if asked), the publish thread at its first block.  TIER_EINVAL
 * with err when the address does not parse, TIER_ENOMEM_HOST. */
enum tier_status kv_remote_open(const struct kv_remote_params *p, kv_remote **out, char err[256]);
/* Stops the threads (a lookup in flight ends as a miss); every fetch must
 * have been freed.  Accepts NULL. */
void kv_remote_free(kv_remote *r);
struct kv_remote_stats kv_remote_stats(kv_remote *r);

/* Bytes the publish queue takes before it drops. */
size_t kv_remote_publish_room(kv_remote *r);
/* Queues b for publishing and takes b->buf (freed in any case); false
 * when the queue was full (counted as dropped).  The notify callback
 * fires after each batch sent, so a caller holding more blocks back
 * (kv_remote_publish_room) hears when there is room. */
bool kv_remote_publish(kv_remote *r, struct kv_prefix_block *b);

/* Looks up the chain hashes[0, n) of namespace ns in the background. */
enum tier_status kv_remote_fetch_start(kv_remote *r, uint64_t ns, const uint64_t *hashes, int n,
                                       kv_remote_fetch **out);
/* How many leading blocks are found and checked so far (the notify
 * callback fires after each batch), and *done once there will be no
 * more: a caller can take blocks [0, ready) while the rest is read. */
int kv_remote_fetch_ready(kv_remote_fetch *f, bool *done);
void kv_remote_fetch_wait(kv_remote_fetch *f);
/* After done: how many leading blocks were found; block i's serialized
 * entry, for i below what ready or found said (valid until the fetch is
 * freed). */
int kv_remote_fetch_found(const kv_remote_fetch *f);
void kv_remote_fetch_block(const kv_remote_fetch *f, int i, const void **data, size_t *len);
/* Waits for it if needed, then frees it; accepts NULL. */
void kv_remote_fetch_free(kv_remote_fetch *f);

/* Whole sequences (the store's kept ones, kv_store_keep: an
 * encoder-decoder model's cross-attention caches), one key each,
 * "kvt:<model fingerprint>:<layout>:x<namespace>:<hash>", in the same
 * container, queue, TTL and checks as blocks: publish_seq queues buf[0,
 * len) (taken, freed in any case; false when the queue was full), and
 * fetch_seq_start looks one up, a value claiming more than max_bytes (0:
 * no bound) being corrupt; kv_remote_fetch_found says 1 when it was
 * found, kv_remote_fetch_block(f, 0) gives it.  What the bytes hold is
 * the caller's to check. */
bool kv_remote_publish_seq(kv_remote *r, uint64_t ns, uint64_t hash, void *buf, size_t len);
enum tier_status kv_remote_fetch_seq_start(kv_remote *r, uint64_t ns, uint64_t hash, size_t max_bytes,
                                           kv_remote_fetch **out);

/* Test and tool hook: the key of block (ns, hash). */
void kv_remote_key(const kv_remote *r, uint64_t ns, uint64_t hash, char out[160]);
/* The CRC16 hash slot of a key (Redis Cluster's, with {hash tags}). */
unsigned kv_remote_slot(const char *key, size_t len);

#endif
