/* engine.h - the inference thread: it owns the model, the KV store and the
 * sessions' KV sequences, and runs continuous batching over every admitted
 * request.
 *
 * Threads: the event loop thread submits jobs and reads their output; the
 * engine thread does everything else.  They share one mutex (engine_lock).
 * The fields of a job that both threads touch are listed in struct job
 * with their owner, and the loop thread reaches them only through the
 * job_* and engine_* functions below, which take the lock or say that the
 * caller holds it.  The engine writes the wake fd (an eventfd) after every
 * step that published something, so the loop can resume suspended
 * connections.
 *
 * Scheduling: each step builds ONE model_forward batch from every active
 * sequence: one decode token for each running sequence, then chunks of
 * pending prefills (round-robin) until the step's token budget is spent,
 * so a long prompt never stalls the others' streams.  Admission is FIFO up
 * to max_seqs sequences; the queue beyond that is bounded (429).
 *
 * Memory: model_forward itself continues a sequence offloaded when the
 * device tier runs out, so the engine never pauses or sheds work for
 * device memory.  A step that still fails (host tier full too, static
 * cache full) changed no KV; it is redone one sequence at a time so only
 * the sequences whose tokens do not fit fail (507 / 400 naming the budget)
 * and a session keeps its KV for a retry.
 */
#ifndef KVTIER_DAEMON_ENGINE_H
#define KVTIER_DAEMON_ENGINE_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include <jansson.h>

#include "ipc/cache.h"
#include "model/beam.h"
#include "model/kvfile.h"
#include "text/chat.h"
#include "ipc/request.h"
#include "ipc/status.h"
#include "text/tokenizer.h"
#include "tiers/disk.h"
#include "util/hist.h"
#include "tiers/remote.h"

/* Which computed blocks go to the remote tier: every prompt block, only
 * those before a chat's first user message, or none (read only). */
enum engine_remote_share { REMOTE_SHARE_ALL = 0, REMOTE_SHARE_PREFIX_ONLY, REMOTE_SHARE_OFF };

struct engine_config {
    const char *model_dir;
    const char *backend;     /* "cpu" or "cuda" */
    int n_threads;           /* 0: physical cores */
    size_t device_mem;       /* 0: sized from the model for max_seqs sequences at the full context */
    size_t host_mem;         /* host-tier budget of the KV store; 0: unlimited */
    bool no_prefix_cache;    /* turn off sharing of identical prompt prefixes between requests */
    size_t prefix_mem;       /* bytes of blocks only the prefix cache holds; 0: a quarter of the device budget */
    bool share_prefix_cache; /* one prefix namespace for every uid instead of one per uid */
    bool verify_weights;     /* scan every weight for NaN and infinity at load */
    enum model_kv_dtype kv_dtype; /* how the KV store keeps K and V (default: the model's precision) */
    enum model_weights_fmt weights; /* how the linear layers' weights are held (default: as stored) */
    int ctx;                 /* 0: the model's max_position_embeddings */
    int max_seqs;            /* sequences decoded together */
    int batch_tokens;        /* tokens per forward step */
    int checkpoint_interval; /* a state model's checkpoints (kv_store_params); 0 = the store's default */
    int max_queue;           /* jobs waiting for admission */
    int max_sessions;
    /* The disk tier (docs/persistence.md); disk_dir NULL: sessions live in
     * memory only and a restart loses them. */
    const char *disk_dir;
    size_t disk_mem;         /* 0: a quarter of the free space */
    int spill_after_s;       /* idle sessions go to disk after this long */
    int session_ttl_s;       /* a session idle this long is spilled (disk tier) or dropped; 0: never */
    int disk_compress;       /* enum kv_disk_compress */
    int prefix_exit_s;       /* at exit, seconds the prefix cache's blocks may take to write; the rest are dropped */
    /* The remote tier (docs/remote.md): prefix-cache blocks shared through
     * Redis; remote_url and remote_cluster NULL: none. */
    const char *remote_url, *remote_cluster, *remote_user;
    const char *remote_password; /* NULL: no AUTH */
    int remote_timeout_ms;
    int remote_ttl_s;
    enum engine_remote_share remote_share;
    bool remote_compress; /* publish zstd-compressed values */
};

typedef struct engine engine;

struct tok_logprob {
    int32_t id;
    float logprob;
};

/* One generated sequence of a job (OpenAI's "choice").  The engine thread
 * owns every field.  Those above the marker are its published output,
 * written under the engine lock and read by the loop thread through
 * job_progress(); tokens and logprobs below n_gen never change once
 * published, and seq.text moves only under the lock
 * (gen_seq_params.text_lock).  The rest is engine-private. */struct job_choice {
    size_t n_text;        /* visible text: seq.text[0, n_text) never shows a partial stop string */
    int n_gen;            /* generated tokens published: seq.toks[n_prompt .. n_prompt + n_gen) */
    struct tok_logprob *lps; /* per generated token: [1 + top_logprobs] entries, chosen first */
    enum gen_finish finish;
    float score;          /* beam search: the hypothesis' sequence_score (once done) */
    /* ---- engine-private ---- */
    struct gen_seq seq;   /* prompt + generated ids, text and finish as of the last step */
    size_t n_fed;         /* ids whose KV is in kv */
    struct kv_seq *kv;    /* NULL: waits for choice 0's prefill, whose KV it forks */
    double lp_sum;        /* best_of: the log-probabilities of its tokens, summed */
    const float *beam_logits; /* beam search: this step's logits, until the beams' decision */
    double t_last;        /* clock_ms() of its last token (0: none yet), for the inter-token histogram */
    bool refeeding;       /* use_cache=false: its history is being fed again, until its next token */
};

/* JOB_CROP and later are operations on the job's session that the engine
 * thread performs at admission (the store belongs to it), without a
 * forward step. */
enum job_kind { JOB_GENERATE = 0, JOB_PREFILL, JOB_CROP, JOB_FORK, JOB_RECORD, JOB_EXPORT, JOB_IMPORT };

/* What a job ends with.  The engine thread owns it and writes it under the
 * engine lock (err also by engine_abort_all, under the lock, from the loop
 * thread); it is final once job_done() returned true, and read through
 * job_result(). */
struct job_result {
    struct ipc_error err; /* err.st != IPC_OK: failed */
    int n_cached;         /* prompt tokens reused from the session's KV or the prefix cache */
    /* an encoder-decoder model's encoder input, and those of its tokens
     * whose cross-attention cache was found (the session's, or the encoder
     * cache's: not encoded again) */
    size_t n_encoder, n_encoder_cached;
    char reply_id[IPC_SESSION_ID_MAX + 1]; /* JOB_FORK: the new session */
    void *blob; /* JOB_EXPORT: the safetensors file (owned; the reply takes it) */
    size_t n_blob;
    double prefill_ms, decode_ms;
    /* The KV at the end: choice 0's strategy, fallback and layer split;
     * bytes and transfer figures summed over the choices (copied_bytes:
     * over every sequence the job had, beams dropped on the way too). */
    struct kv_seq_stats kv;
    /* beam search: decode steps, and the bytes reordering the whole
     * cache by beam after each would have copied */
    int beam_steps;
    uint64_t whole_reorder_bytes;
};

struct session;
struct encdec_config;

struct job {
    /* ---- set by the submitter before engine_submit, read-only afterwards ---- */
    enum job_kind kind;
    uid_t uid;
    int32_t *prompt; /* owned; an encoder-decoder model's: the decoder's */
    size_t n_prompt;
    int32_t *input; /* owned: an encoder-decoder model's encoder input (NULL: a decoder-only model) */
    size_t n_input;
    int max_new;
    struct sampler_params sampling;
    const char *stops[IPC_MAX_STOPS]; /* into stop_buf */
    int n_stops;
    char *stop_buf;
    bool ignore_eos, logprobs;
    int min_new; /* no eos before this many generated tokens (sampling; beams use beam.min_new) */
    int top_logprobs;
    gram *grammar; /* owned: constrained output, NULL: none */
    /* beam search when beam.num_beams > 1 (n = num_beams; eos filled in at
     * admission); n_out: the choices returned (num_return_sequences, or
     * best_of's n: the n of the job's choices with the highest logprob
     * sums; job_new sets n) */
    struct beam_params beam;
    int n_out;
    /* prompt tokens whose blocks may be published to the remote tier
     * (SIZE_MAX: all; 0, job_new's: none) */
    size_t remote_shareable;
    char session_id[IPC_SESSION_ID_MAX + 1]; /* "" = none */
    int64_t op_n;                            /* JOB_CROP: kv_seq_crop's n */
    bool raw;                                /* JOB_EXPORT: the stored form (?raw=1) */
    void *blob;                              /* JOB_IMPORT: the file (owned), which kvf points into */
    struct kvfile kvf;                       /* JOB_IMPORT: checked by engine_kv_parse (owned) */
    /* ---- set by the submitter, replaced by engine_submit with the session's ---- */
    struct ipc_cache_choice cache;
    /* ---- shared, under the engine lock; owner and functions per field ---- */
    int refs;        /* both threads: job_new, engine_submit, job_release */
    bool cancelled;  /* the loop thread's: engine_cancel, engine_cancel_locked */
    bool done;       /* the engine thread's: job_done, job_done_locked */
    struct job_result res; /* the engine thread's: job_result */
    /* the engine thread's (publish): its choices' KV as of the last step it
     * took part in, summed like res.kv, for GET /v1/requests */
    struct kv_seq_stats kv_now;
    /* ---- engine-private (engine_submit links it in, under the lock) ---- */
    struct job *next;
    struct session *sess;
    double t_submit, t_admit, t_first;
    bool kill; /* cancelled or failed, seen under the lock at the step's start */
    bool io_wait;  /* its session's KV is being read back from disk */
    bool mem_wait; /* its step found the memory tiers full: waits for a spill to free them */
    bool pfetched; /* its prompt's prefix blocks on disk were looked for */
    struct prefix_fetch *pfetch; /* their reads, or its input's cross cache's, in flight (io_wait) */
    bool rfetched; /* the remote tier was asked for the blocks after those */
    int xlooked; /* where its input's cross-attention cache was looked for: 1 the disk tier, 2 the remote tier too */
    struct remote_fetch *rfetch; /* that lookup in flight (io_wait) */
    int64_t rpub_blocks;         /* its prompt's blocks handed to prefix_remote_publish */
    uint64_t order;
    beam_search *bs;         /* beam search's decisions */
    int32_t eos[MODEL_MAX_EOS + 1];
    uint64_t freed_copied;   /* copied_bytes of the beams' sequences freed so far */
    uint64_t kv_round;       /* the publish() round kv_step was summed in */
    struct kv_seq_stats kv_step; /* kv_now's next value, summed outside the lock */
    struct kv_seq *cross;    /* an encoder-decoder model's: the encoder output's K and V, every choice's */
    struct kv_kept *cross_kept; /* the store's entry holding cross, a reference of the job's (NULL: none) */
    struct kv_seq *skv; /* a session's: the KV the session holds after the job (retire), choice 0's at setup */
    int n;
    struct job_choice ch[];
};

/* Allocates a job with n choices and a copy of stops (borrowed strings). */
struct job *job_new(int n, const char *const *stops, int n_stops);

enum ipc_status engine_create(const struct engine_config *cfg, int wake_fd, engine **out, struct ipc_error *err);
/* Cancels everything, joins the thread, frees models and sessions.  Accepts NULL. */
void engine_free(engine *e);

enum engine_state { ENGINE_LOADING = 0, ENGINE_READY, ENGINE_FAILED };
enum engine_state engine_state(engine *e, char *msg, size_t cap);

/* How far the load is.  Phases, in order: "model" (config, tokenizer, the
 * files mapped), "weights" (every page of the files read into memory and
 * mapped: bytes_done of bytes_total), "warmup" (one forward pass of one
 * token, so the first request pays no first-call costs), then "ready" (or
 * "failed").  seconds: since the load began, or what it took once over. */
struct engine_load {
    const char *phase;
    uint64_t bytes_done, bytes_total;
    double seconds;
};
struct engine_load engine_load_progress(engine *e);

/* Valid once ENGINE_READY; the tokenizer is read-only and safe from any thread. */
const tokenizer *engine_tokenizer(const engine *e);
const struct model_config *engine_model_config(const engine *e);
/* An encoder-decoder model's configuration, NULL for a decoder-only one
 * (whose engine_model_config is its own; an encoder-decoder model's is its
 * decoder's, encdec_model_config). */
const struct encdec_config *engine_encdec(const engine *e);
int engine_context(const engine *e);
/* The most tokens a sequence of p may hold: max_cache_len for a static
 * cache whose full-attention layers fill up, else INT64_MAX (a sliding
 * ring never fills).  A generation stores all but its last token. */
int64_t engine_static_limit(const engine *e, const struct kv_seq_params *p);
/* --remote-share, and whether a remote tier is configured at all. */
enum engine_remote_share engine_remote_share(const engine *e, bool *on);
const char *engine_model_id(const engine *e);
const char *engine_model_dir(const engine *e); /* --model as given */
/* Bytes of the tokenizer's longest single-token text (a logprobs piece never needs more). */
size_t engine_max_piece(const engine *e);
/* Special-token texts for chat templates ("" when the model has none). */
const char *engine_bos_text(const engine *e);
const char *engine_eos_text(const engine *e);
const chat_tpl *engine_chat_template(const engine *e);

void engine_lock(engine *e);
void engine_unlock(engine *e);

/* Queues j (the engine takes a reference).  Resolves j->session_id: 404
 * unknown, 403 another uid's, 409 busy.  429 when the queue is full, 503
 * while draining. */
enum ipc_status engine_submit(engine *e, struct job *j, struct ipc_error *err);
/* The client went away or cannot keep up: stop generating; the KV is freed
 * unless a session holds it.  engine_cancel takes the lock; the _locked
 * form is for a caller that holds it. */
void engine_cancel(engine *e, struct job *j);
void engine_cancel_locked(engine *e, struct job *j);
/* Drops the caller's reference (takes the lock); accepts NULL. */
void job_release(engine *e, struct job *j);

/* Whether the engine is through with j: nothing in it changes any more.
 * job_done takes the lock; the _locked form is for a caller that holds it. */
bool job_done(engine *e, const struct job *j);
bool job_done_locked(const struct job *j);

/* Choice i's published output.  The caller holds the lock (text may move
 * when it is released), or job_done returned true (nothing moves). */
struct job_progress {
    const char *text; /* NULL until the first piece of text */
    size_t n_text;
    int n_gen;
    const int32_t *toks;           /* prompt + generated ids; those published never change */
    const struct tok_logprob *lps; /* [1 + top_logprobs] per published token */
    enum gen_finish finish;
    float score; /* beam search: sequence_score */
};
struct job_progress job_progress(const struct job *j, int i);

/* What j ended with; valid once job_done returned true. */
const struct job_result *job_result(const struct job *j);

/* JOB_EXPORT's file (res.blob), which the caller then owns; once job_done
 * returned true. */
void *job_take_blob(struct job *j, size_t *n);

/* Refuse new jobs from now on (SIGTERM). */
void engine_drain(engine *e);
/* Jobs queued or running. */
int engine_pending(engine *e);
/* Fail every job with st and message (drain timeout). */
void engine_abort_all(engine *e, enum ipc_status st, const char *msg);

/* Sessions.  create: registers an empty session owned by uid (429 when the
 * table is full), keeping request ({"cache", "use_cache"} as the client
 * sent them, or NULL) for its file on disk; its prefix, if any, is prefilled by a JOB_PREFILL job the
 * caller submits with session_id set.  A quantized cache whose format the
 * store refuses is the 400 a request with that cache gets, and no session.
 * record: activate_past_recording on its KV.  Crop, fork and recording later are JOB_CROP / JOB_FORK /
 * JOB_RECORD jobs naming the session. */
enum ipc_status engine_session_create(engine *e, uid_t uid, const struct ipc_cache_choice *cache, bool record,
                                      const json_t *request, char *id, size_t cap, struct ipc_error *err);
enum ipc_status engine_session_delete(engine *e, uid_t uid, const char *id, struct ipc_error *err);
/* {"id","object":"session","created","tokens","bytes":{"device","host","disk"},
 *  "strategy" (in use),"requested_strategy","fallback","busy"} */
enum ipc_status engine_session_json(engine *e, uid_t uid, const char *id, json_t **out, struct ipc_error *err);
/* The cache parameters session id was created with (fixed for its life),
 * for checks a request must pass before its reply starts. */
enum ipc_status engine_session_cache(engine *e, uid_t uid, const char *id, struct kv_seq_params *out,
                                     struct ipc_error *err);
/* The caller's sessions as a JSON array (NULL on allocation failure). */
json_t *engine_session_list(engine *e, uid_t uid);
/* uid's generation requests, queued and running, for GET /v1/requests;
 * NULL when out of memory. */
json_t *engine_request_list(engine *e, uid_t uid);

/* KV export and import (docs/api.md "KV export and import").  The file an
 * import may send is at most engine_kv_max_size bytes (every layer holding
 * the context in f32; an encoder-decoder model's, twice that: the cross K
 * and V of an input as long).  engine_kv_parse checks a file against the model
 * (kvfile_parse) from any thread once READY: IPC_ECONFLICT for another
 * model's KV (model_fingerprint), IPC_EINVAL naming what else is wrong.
 * A JOB_IMPORT job then fills its (new, empty) session with the file's KV
 * and tokens (an encoder-decoder file's cross cache and input too; a raw
 * file's session is created with engine_kv_cache's choice, and its KV
 * loaded as stored: kv_seq_load_quant); a JOB_EXPORT job leaves the
 * session's KV as a file in res.blob. */
size_t engine_kv_max_size(const engine *e);
enum ipc_status engine_kv_parse(const engine *e, const void *buf, size_t len, struct kvfile *out,
                                struct ipc_error *err);
/* The cache choice a raw file's quantization metadata (the request's
 * "cache" object as a JSON string) names, read by ipc_cache_parse: a
 * quantized cache without sinks or offload.  IPC_EINVAL naming the
 * parameter. */
enum ipc_status engine_kv_cache(const engine *e, const char *quantization, struct ipc_cache_choice *out,
                                struct ipc_error *err);

/* The kvtier object's "fallback" value for f: "offloaded", or NULL (none). */
const char *engine_fallback_name(enum kv_fallback f);

/* Why a session was written to the disk tier. */
enum engine_spill_why {
    ENGINE_SPILL_IDLE = 0, /* idle for --spill-after */
    ENGINE_SPILL_MEMORY,   /* a step found the memory tiers full */
    ENGINE_SPILL_EXIT,     /* the daemon stopped */
    ENGINE_N_SPILL_WHY
};
/* "idle", "memory", "exit": the reason label of /metrics. */
const char *engine_spill_why_name(enum engine_spill_why why);

/* The engine's counters and gauges, copied under the lock. */
struct engine_stats {
    uint64_t requests, prompt_tokens, cached_tokens, gen_tokens, steps;
    uint64_t errors[IPC_N_STATUS]; /* by ipc_status */
    int queued, running, sessions;
    size_t kv_dev_bytes, kv_host_bytes;
    size_t kv_host_budget; /* --host-mem; 0: unlimited */
    uint64_t kv_fallbacks; /* sequences moved to the host tier (kv_store_stats().fallbacks) */
    uint64_t kv_fallbacks_oom; /* of those, after a step or restore ran out of device memory */
    uint64_t prefix_hit_tokens, prefix_entries, prefix_evictions; /* the store's prefix cache */
    size_t dev_budget, dev_used; /* the backend's device memory: weights, activations, KV, slots */
    /* the disk tier: sessions spilled, restored and their failures; files and bytes */
    uint64_t spills[ENGINE_N_SPILL_WHY], restores, disk_errors;
    uint64_t restore_early_layers; /* layers a step filled from a restore's read still in flight */
    /* prefix-cache blocks written to and read from disk, and the requests
     * whose prompt found blocks there */
    uint64_t prefix_disk_written, prefix_disk_read, prefix_disk_hits;
    /* the encoder cache's cross-attention caches written to and read from disk */
    uint64_t encoder_disk_written, encoder_disk_read;
    struct kv_disk_stats disk;
    /* the remote tier (remote_on), and the requests that got blocks from it */
    bool remote_on;
    struct kv_remote_stats remote;
    uint64_t remote_hits, remote_refused;
};
struct engine_stats engine_get_stats(engine *e);

/* Latency histograms, recorded by the engine thread without the lock (a
 * relaxed atomic add per observation) and read by any thread with
 * hist_snapshot.  Seconds:
 *   queue_wait     submission to admission, per admitted job;
 *   ttft           submission to the first generated token, per request;
 *   inter_token    between consecutive tokens of one choice (beam search:
 *                  between the search's steps), per token after the first;
 *   prefill_token  admission to the first token (a prefill-only job: to
 *                  its end) over the prompt tokens computed, not cached;
 *   decode_token   first token to the end over the tokens after the first
 *                  (the longest choice's), per request with two or more.
 * prefill_token and decode_token count successful requests only. */
struct engine_hists {
    struct hist queue_wait, ttft, inter_token, prefill_token, decode_token;
};
const struct engine_hists *engine_hists(const engine *e);
void engine_count_error(engine *e, enum ipc_status st);

#endif
