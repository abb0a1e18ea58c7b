/* engine_impl.h - the engine's private structures, shared by engine.c
 * (submission, admission, the scheduler's step, the thread) and
 * sessions.c (the session table and the operations on a session).  Not
 * part of the API: only those two files include it; everything else goes
 * through daemon/engine.h.
 */
#ifndef KVTIER_DAEMON_ENGINE_IMPL_H
#define KVTIER_DAEMON_ENGINE_IMPL_H

#include <pthread.h>
#include <time.h>

#include "daemon/engine.h"
#include "model/runtime.h"
#include "tiers/disk.h"

/* An encoder input's cross-attention cache: written once by the encoder,
 * only read afterwards, so a session and its forks share it rather than
 * copy it; freed with its last reference (engine thread), or, when the
 * store keeps it (kept: the encoder cache), left there for later requests. */
struct cross_cache {
    kv_seq *kv;
    int refs;
    kv_kept *kept; /* the store's entry of kv, one reference held; NULL: kv is ours */
};

struct session {
    char id[IPC_SESSION_ID_MAX + 1];
    uid_t uid;
    time_t created;
    struct ipc_cache_choice cache;
    bool busy;
    bool record; /* activate_past_recording on every KV sequence it gets */
    bool private_kv; /* created with "private": none of its requests' blocks go to the remote tier */
    int32_t *toks; /* the ids whose KV is in kv */
    size_t n_toks;
    struct kv_seq_stats kvs; /* of kv, as of the last request (0 when none) */
    struct kv_seq *kv; /* engine thread only */
    /* an encoder-decoder model's: the encoder input (n_input under mu)
     * whose cross-attention cache kv's tokens attended to, kept while the
     * cache is on disk; the cache itself (engine thread; NULL: none, or on
     * disk), shared with the session's forks, and its figures (under mu) */
    int32_t *input;
    size_t n_input;
    struct cross_cache *cross;
    struct kv_seq_stats cross_kvs;
    char *request;     /* {"cache": ..., "use_cache": ...} as the client sent them: the file's meta */
    size_t disk_bytes; /* under mu: bytes of its file on disk (0: none) */
    /* ---- engine thread: the disk side (spill.c) ---- */
    uint64_t version;      /* bumped whenever its KV or ids change */
    uint64_t disk_version; /* the version its file holds; 0 = no file */
    double t_idle;         /* clock_ms() when it was last used */
    kv_disk_op *op;        /* a spill or restore in flight */
    bool op_restore;
    bool op_begun;         /* a restore's KV was begun layer by layer (or could not be) */
    bool op_layered;       /* it was: kv and cross (those still loading) fill from the op's data */
    size_t op_need;        /* the data's bytes a begin needs (an encoder-decoder's, from the meta; 0: not known) */
    size_t op_self;        /* where an encoder-decoder image's cross cache starts in the data */
    uint32_t op_early;     /* layers its steps asked for while that read was still in flight */
    uint64_t op_version;   /* the version a spill in flight writes */
    enum engine_spill_why op_why; /* why a spill in flight writes */
    size_t op_len;         /* the bytes it writes */
    bool op_cross;         /* a spill in flight writes the cross cache too */
    bool disk_cross;       /* the file at disk_version holds the cross cache of input */
    double spill_retry_at; /* clock_ms() before which no spill is tried (after a failed one) */
    void *op_img;          /* the op's buffers: a spill's image (spill.c's image_alloc) */
    char *op_meta;
    struct session *next;
};

struct engine {
    struct engine_config cfg;
    int wake_fd;
    pthread_t thread;
    bool thread_started;

    /* ---- under mu ---- */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    enum engine_state state;
    char state_msg[MODEL_ERR_LEN];
    struct engine_load load; /* seconds: clock_ms() at the start until the load is over */
    double load_t0;
    int load_delay_ms; /* test hook KVTIER_TEST_LOAD_DELAY_MS: a pause per chunk of weights read */
    int fail_token;    /* test hook KVTIER_TEST_FAIL_TOKEN: a step feeding this id fails as a backend fault; -1 none */
    bool stopping, draining;
    struct job *queue, **queue_tail; /* waiting for admission */
    int n_queued;
    struct job *active;              /* admitted, in admission order */
    int active_seqs;
    struct session *sessions, *dead; /* dead: deleted, KV to free on the engine thread */
    int n_sessions;
    struct engine_stats st;
    uint64_t order;
    uint64_t pub_round; /* engine thread: publish() calls, so a job's KV is summed once per step */

    /* ---- lock-free: the engine thread records, any thread reads ---- */
    struct engine_hists hists;

    /* ---- set before READY, read-only afterwards ---- */
    struct runtime rt;
    model *m;
    encdec *ed; /* instead of m: an encoder-decoder model (the jobs' input, cross) */
    bool enc_cache; /* ed's cross caches are kept in the store by input (kv_store_keep) */
    struct model_config edmc; /* ed's decoder, which mc points to */
    tokenizer *tok;
    kv_store *store;
    const struct model_config *mc;
    int ctx, vocab;
    size_t max_piece;
    char model_id[128];
    char bos[64], eos[64];
    chat_tpl *chat; /* loaded with the model */
    gram_vocab *gvocab; /* the tokenizer's token bytes, for constrained output */

    /* ---- engine thread: per-step scratch, sized once at load ---- */
    struct fw_seq *batch;
    struct job_choice **batch_ch;
    struct job **batch_job;
    struct encdec_seq *ed_batch; /* an encoder-decoder model's view of batch */
    int passes;     /* forward passes of this step (st.steps counts them) */
    float *logits;  /* [max_seqs, vocab] */
    float *scratch; /* [vocab]: raw logits kept for logprobs */
    float *share, *share_tmp; /* [vocab] each: a shared prefill's logits, a copy to sample from */
    unsigned rr;    /* round-robin start among prefills; unsigned so it wraps after 2^32 steps */

    /* ---- the disk tier (spill.c); NULL: none ---- */
    kv_disk *disk;
    bool io_event;   /* under mu: an op completed since the engine last looked */
    int n_ops;       /* engine thread: spills and restores in flight */
    int n_spilling;
    struct prefix_disk *pd; /* prefix_disk.c; NULL: no prefix blocks on disk */

    /* ---- the remote tier (prefix_remote.c); NULL: none ---- */
    kv_remote *remote;
    struct remote_fetch *rfetches; /* engine thread: lookups in flight */
    struct remote_pub *rpubs;      /* engine thread: prompts whose blocks wait for room to be published */
    int n_rpubs;
    size_t rblk_len;               /* a serialized block's bytes, once one was */
};

/* ---- sessions.c, for engine.c ---- */

/* Owner check shared by every session endpoint: 404 unknown, 403 not yours (caller holds mu). */
enum ipc_status session_get(engine *e, uid_t uid, const char *id, struct session **out, struct ipc_error *err);
/* What a session's cache choice and past recording must pass at creation,
 * and again when a session is read back from its file at start. */
enum ipc_status session_choice_check(engine *e, const struct ipc_cache_choice *cache, bool record,
                                     struct ipc_error *err);
/* A session not in the table yet, with a fresh random id; request is the
 * client's {"cache", "use_cache"} (NULL: none), kept for its file. */
struct session *session_new(uid_t uid, const struct ipc_cache_choice *cache, bool record, const json_t *request,
                            struct ipc_error *err);
/* Puts s in the table (429 when full, 503 while draining); on failure the
 * caller still owns s. */
enum ipc_status session_insert(engine *e, struct session *s, struct ipc_error *err);
/* Frees a list of sessions and their KV (engine thread, or after it ended). */
void free_dead_sessions(struct session *s);
/* Drops a reference to c (NULL: none); the last one frees it. */
void cross_unref(struct cross_cache *c);
/* s's cross cache goes (spilled, or another input comes); its input's ids
 * stay for the disk side unless drop_input. */
void session_drop_cross(engine *e, struct session *s, bool drop_input);
/* Another session of uid's cross cache of ids[0, n), with a reference
 * taken for the caller, or NULL (engine thread).  Only the same uid's: a
 * cache found would tell a user what another one sent. */
struct cross_cache *cross_find(engine *e, uid_t uid, const int32_t *ids, size_t n);
/* Takes s out of the table; the engine thread frees its KV (caller holds mu). */
void session_unlink_locked(engine *e, struct session *s);
/* Runs a JOB_CROP, JOB_FORK, JOB_RECORD, JOB_EXPORT or JOB_IMPORT job on its session (engine thread). */
void session_run_op(engine *e, struct job *j);

/* ---- spill.c: sessions on disk (engine thread unless noted) ---- */

/* Whether what the disk tier reads goes to the backend's page-locked host
 * memory (a device apart from the host), or to ordinary memory (unified). */
bool image_pinned(const engine *e);

/* Opens the disk tier (cfg.disk_dir) and lists the sessions a previous run
 * left there; without one the engine runs in memory alone.  At load. */
void disk_open(engine *e);
/* Writes every session whose file is not current, waits, closes. */
void disk_close(engine *e);
/* Handles completed ops: a spill frees the KV it wrote (if the session was
 * not used meanwhile), a restore gives the session its KV back.  True when
 * one finished (what the metrics show changed). */
bool disk_poll(engine *e);
/* Starts spilling sessions idle for cfg.spill_after_s; returns the
 * clock_ms() at which the next one becomes due (0: none). */
double disk_spill_idle(engine *e, double now);
/* Drops the sessions idle for cfg.session_ttl_s when there is no disk tier
 * to spill them to; returns when the next one is due (clock_ms), 0: none. */
double session_expire_idle(engine *e, double now);
/* How long a session may sit idle before its KV goes to disk (ms): the
 * spill delay, or the session TTL when that is shorter. */
double spill_idle_ms(const engine *e);
/* The host or device tier is full: starts spilling the least recently used
 * idle session.  False when there is none to spill and none in flight. */
bool disk_spill_for_memory(engine *e);
/* Whether j's session has its KV on disk; disk_restore starts reading it
 * (the job waits until disk_poll has it back). */
bool disk_needs_restore(const engine *e, const struct session *s);
void disk_restore(engine *e, struct session *s);
/* A step found a layer of s's KV missing (its restore's read failed
 * part-way): the KV is dropped and its tokens will be computed again; the
 * caller gives its job a fresh KV. */
void disk_restore_lost(engine *e, struct session *s);
/* A deleted session: its op is waited for and its file removed. */
void disk_forget(engine *e, struct session *s);
/* Counts one event in a counter of e->st (takes the lock). */
void engine_count(engine *e, uint64_t *counter);

/* ---- prefix_disk.c: the prefix cache's blocks on disk (engine thread) ---- */

/* After the disk tier opened (with the prefix or the encoder cache on):
 * evicted blocks and cross caches are queued for prefix_disk_poll from now
 * on.  The scan hands each prefix object ("p..." namespaces) and encoder-
 * cache object ("x...") to prefix_disk_file; prefix_disk_opened logs the
 * count. */
void prefix_disk_open(engine *e);
void prefix_disk_file(engine *e, const char *ns, const char *name, const void *meta, size_t meta_len,
                      size_t data_len);
void prefix_disk_opened(engine *e);
/* Every cached block or cross cache not on disk yet is written; then the index goes.
 * Before the disk tier closes. */
void prefix_disk_close(engine *e);
/* Each loop iteration: finished writes and reads (the jobs whose blocks
 * are in start), and writes of the blocks the store evicted. */
void prefix_disk_poll(engine *e);
/* At admission: when j's prompt goes on on disk past the blocks in memory,
 * starts reading them and returns true (j waits: io_wait, j->pfetch). */
bool prefix_disk_fetch(engine *e, struct job *j);
/* j retires: its reads finish without it. */
void prefix_disk_forget_job(struct job *j);
/* At admission: when j's input ids[0, n) of namespace ns is in no memory
 * and its encoder-cache key is on disk, starts reading that cross cache
 * and returns true (j waits: io_wait, j->pfetch); a cache that checks is
 * kept in the store, j holding a reference (j->cross_kept). */
bool encoder_disk_fetch(engine *e, struct job *j, uint64_t ns, const int32_t *ids, size_t n);

/* The layout the disk and remote tiers record with every object. */
struct kv_disk_layout engine_kv_layout(const engine *e);
/* The model's fingerprint (model_fingerprint, encdec_fingerprint). */
uint64_t engine_fingerprint(const engine *e);
/* An I/O thread finished something: the engine loop looks (io_event). */
void engine_io_notify(void *arg);

/* ---- prefix_remote.c: the prefix cache's blocks on the remote tier (engine thread) ---- */

/* At load, after the store (cfg.remote_url / remote_cluster); logs why not. */
void prefix_remote_open(engine *e);
/* Waits for the lookups in flight, then closes the tier. */
void prefix_remote_close(engine *e);
/* Each loop iteration: the jobs whose lookups finished get their blocks and start. */
void prefix_remote_poll(engine *e);
/* At admission, after the disk's blocks: when j's prompt goes on past the
 * blocks in memory, asks the remote tier and returns true (j waits:
 * io_wait, j->rfetch). */
bool prefix_remote_fetch(engine *e, struct job *j);
/* j retires: its lookup finishes without it, its blocks waiting to be
 * published go on without it. */
void prefix_remote_forget_job(engine *e, struct job *j);
/* j's prompt is computed up to n_done tokens (its KV still held): its
 * shareable whole blocks in that not handed over before are queued for
 * the remote tier, as the publish queue has room.  Cheap when there are
 * none: called after every prefill chunk. */
void prefix_remote_publish(engine *e, struct job *j, size_t n_done);

/* An encoder-decoder model's cross caches on the remote tier (the encoder
 * cache's, docs/remote.md): at admission, when j's input ids[0, n) of
 * namespace ns is in no memory, asks the remote tier for its cross cache
 * and returns true (j waits: io_wait, j->rfetch); the cache found is kept
 * in the store, j holding a reference (j->cross_kept).  After j encoded
 * an input, its cross cache q is published under the same key. */
bool encoder_remote_fetch(engine *e, struct job *j, uint64_t ns, const int32_t *ids, size_t n);
void encoder_remote_publish(engine *e, const struct job *j, uint64_t ns, const int32_t *ids, size_t n, kv_seq *q);

/* ---- engine.c, for spill.c and prefix_disk.c ---- */
void start_job(engine *e, struct job *j);
/* j's prefix fetch (disk or remote) is done: it goes on unless killed meanwhile. */
void resume_job(engine *e, struct job *j);
/* The prefix-cache namespace of uid's sequences. */
uint64_t prefix_ns_of(const engine *e, uid_t uid);
/* The block hashes of j's prompt for a prefix fetch (malloc'd; NULL: none
 * to fetch, a session with KV, or no memory), its namespace in *ns, and
 * how many of the *n_blocks are in memory already (*n_mem). */
uint64_t *prefix_chain_of(engine *e, const struct job *j, uint64_t *ns, int64_t *n_mem, int64_t *n_blocks);

/* ---- engine.c, for sessions.c ---- */

/* The store's refusal ts as a client error naming param: its message
 * why (kv_error: the store's last one). */
enum ipc_status kv_error(engine *e, enum tier_status ts, const char *param, struct ipc_error *err);
enum ipc_status tier_error(enum tier_status ts, const char *param, const char *why, struct ipc_error *err);
/* Records err as j's failure (first one wins); the engine retires it at the next step. */
void job_fail(engine *e, struct job *j, const struct ipc_error *err);

#endif
