/* http.h - what the files of the HTTP front end share: the server and
 * request state, and the functions each file offers the others.
 *
 *   server.c     the loop's sources (accept, signals, engine wake-ups,
 *                workers), libmicrohttpd's callbacks, suspend/resume
 *   route.c      the route table, path matching, dispatch
 *   render.c     replies: errors, OpenAI completion bodies, the kvtier object
 *   stream.c     SSE streams: snapshots of a job's output, events
 *   h_generate.c completions and chat
 *   h_text.c     tokenize, detokenize, apply-template; prompt encoding
 *   h_sessions.c sessions
 *   h_info.c     health, models, metrics
 *   h_ollama.c   the Ollama-compatible subset of its API
 *
 * Everything runs on the event loop thread except a route's prepare step
 * (route_prepare and the prep_* functions), which runs on a worker while
 * its request is suspended: it reads the request's body and writes only
 * r->root, r->prep and the reply flags, which the loop thread reads after
 * the worker handed the request back.
 */
#ifndef KVTIER_DAEMON_HTTP_H
#define KVTIER_DAEMON_HTTP_H

#include <microhttpd.h>
#include <time.h>

#include "daemon/engine.h"
#include "daemon/loop.h"
#include "daemon/server.h"
#include "daemon/workers.h"
#include "ipc/jsonw.h"
#include "ipc/request.h"
#include "ipc/toolcall.h"

enum reply_kind {
    REPLY_COMPLETION = 0,
    REPLY_CHAT,
    REPLY_SESSION,
    REPLY_SESSION_OP,
    REPLY_SESSION_IMPORT, /* 201 and the new session */
    REPLY_KV,             /* the export's safetensors bytes */
    REPLY_OLLAMA_GENERATE, /* Ollama's /api/generate: NDJSON or one object */
    REPLY_OLLAMA_CHAT,
};

/* Where a stream is after its choices: the events left to send. */
enum stream_phase {
    STREAM_CHOICES = 0, /* text, tokens and finish reasons of the choices */
    STREAM_USAGE,       /* the usage chunk (stream_options.include_usage) */
    STREAM_DONE,        /* "data: [DONE]" */
    STREAM_ENDED,       /* everything sent */
};

struct route;

/* A route's prepare output, written on a worker (see above). */
struct prep {
    struct ipc_error err;          /* st != IPC_OK: the reply */
    struct job *job;               /* completions, chat: ready for engine_submit */
    struct tok_ids ids;            /* session create: the prefix */
    struct ipc_cache_choice cache; /* session create */
    bool record;                   /* session create */
    size_t remote_shareable;       /* session create: job.remote_shareable */
    struct kvfile kvf;             /* session import: the body, checked */
    json_t *request;               /* session create: its "cache" and "use_cache", for its file on disk */
    struct jw out;                 /* tokenize, detokenize, apply-template: the 200 body */
};

/* A connection, from accept to close (MHD's socket context): who holds it
 * and since when it has been sending a request head. */
struct conn {
    struct server *srv;
    uid_t uid;
    pid_t pid;
    int fd;
    bool reserve;       /* past --max-clients: /health and /metrics only */
    bool tcp;           /* from --listen: the API key instead of peer credentials */
    double head_since;  /* clock_ms() of the head's first byte; 0: no head under way */
    struct req *req;    /* the request whose head arrived; NULL between requests */
    struct ev_io first; /* between requests: the next head's first byte */
    /* recv() follows the byte stream (server.c: head_scan) */
    bool in_head;       /* the bytes read belong to a request head */
    bool head_line;     /* the head's request line has begun */
    unsigned char line_len, line_last; /* the current head line: 0, 1 (its byte) or 2 = more */
    /* a header line read as Content-Length (server.c: cl_feed): how much of
     * the name matched (CL_NOT: another header), then its count */
    unsigned char cl_at;
    bool cl_digits, cl_cr, cl_bad, cl_over;
    uint64_t cl_val;
    size_t past_head;   /* bytes read after the head's blank line */
    size_t body_len;    /* the body those may be (Content-Length) */
    struct conn *prev, *next;
};

struct req {
    struct server *srv;
    struct conn *c;
    double started; /* clock_ms() when the head was complete */
    struct MHD_Connection *conn;
    const struct route *route;
    char arg[IPC_SESSION_ID_MAX + 1]; /* the path segment the route's '*' matched */
    const char *url;
    uid_t uid;
    pid_t pid;
    char *body;
    size_t n_body, cap_body;
    size_t over;    /* bytes past max_body, read and dropped until the 413 can go out */
    size_t max_body; /* 413 above: --max-body, or the KV import's own limit (body_limit) */
    json_t *root;
    struct work work; /* route_prepare on a worker */
    struct prep prep;
    /* a request waiting for the engine */
    struct job *job;
    enum reply_kind kind;
    bool stream, include_usage, return_tokens, logprobs;
    bool suspended, hup, overflow, wake;
    bool close; /* the reply closes the connection: the request's framing cannot be trusted */
    bool last; /* the reply ends the connection: bytes after this request were read unchecked (server.c) */
    int fd;
    struct ev_io io;         /* the hang-up watch while suspended */
    struct req *prev, *next; /* server.waiting */
    char id[48];
    time_t created;
    /* stream progress */
    bool role_sent[SERVER_MAX_N], fin_sent[SERVER_MAX_N];
    size_t sent_text[SERVER_MAX_N], text_offset[SERVER_MAX_N];
    /* each choice's text decoded as far as text_offset counts it, as the
     * generation decodes it (render.c text_chars) */
    struct tok_stream text_ts[SERVER_MAX_N];
    int sent_gen[SERVER_MAX_N];
    enum stream_phase phase;
    char *snap; /* STREAM_BLOCK bytes: unsent text copied under the engine lock */
    /* tools given and tool_choice not none: each choice's text is read
     * back as tool calls once the job is done (a stream holds it back) */
    const json_t *tools; /* in root */
    enum ipc_tool_format tool_fmt;
    bool calls_read[SERVER_MAX_N];
    struct ipc_tool_calls calls[SERVER_MAX_N];
};

/* A client's 4xx log lines: one a second, the rest counted. */
#define LOG_GATES 16
struct log_gate {
    uid_t uid;
    pid_t pid;
    long sec;           /* the monotonic second of the last line written */
    unsigned suppressed; /* lines not written since */
};

/* A refused connection kept open after its answer (server.c, refuse): its
 * request is read and dropped until the client closes or the deadline. */
struct refused {
    struct server *srv;
    int fd; /* -1: free */
    size_t dropped;
    struct ev_io io;
    struct ev_timer t;
};
#define LINGER_SLOTS 32

struct server {
    engine *eng;
    const struct server_config *cfg;
    struct MHD_Daemon *mhd;
    ev_loop *loop;
    workers *workers;
    int listen_fd, tcp_fd, sig_fd, wake_fd;
    struct ev_io io_listen, io_tcp, io_sig, io_wake, io_mhd, io_workers;
    struct ev_timer t_mhd, t_drain, t_sweep;
    struct conn *conns;     /* every open connection */
    struct conn *accepting; /* handed to MHD_add_connection's notify */
    struct req *waiting; /* requests holding a job */
    bool ready, draining, aborted, stopping;
    bool stalled;        /* work waits and no step completed for --stall-timeout */
    uint64_t last_steps; /* the engine's step count at progress_at */
    uint64_t load_seen;  /* the load's bytes_done at the last sweep (systemd's start timeout) */
    double progress_at;  /* clock_ms() of the last step seen, or of idleness */
    enum server_exit rc;
    time_t started;
    uint64_t ids, http_requests, refused, timed_out;
    double tcp_refused_log_ms; /* when the last TCP refusal was logged */
    unsigned tcp_refused_quiet; /* TCP refusals since, not logged */
    struct log_gate gates[LOG_GATES]; /* render.c: 4xx log lines per client */
    char *piece; /* one token's text for logprobs: engine_max_piece bytes */
    size_t piece_cap;
    struct refused lingering[LINGER_SLOTS];
};

/* ---- server.c ---- */
void suspend(struct req *r);
/* Hands the request to a worker for route_prepare; route_resume continues it. */
enum MHD_Result req_offload(struct req *r);
/* Hands j to the engine and parks the request until it has output; a
 * stream gets its chunked response now. */
enum MHD_Result req_submit(struct req *r, struct job *j);
void track(struct req *r, struct job *j);

/* ---- route.c ---- */
enum MHD_Result dispatch(struct req *r, const char *method);
void route_prepare(struct req *r);
enum MHD_Result route_resume(struct req *r);

/* ---- render.c ---- */
enum MHD_Result queue(struct req *r, unsigned code, char *body, size_t len, const char *type);
enum MHD_Result reply_jw(struct req *r, unsigned code, struct jw *w);
enum MHD_Result reply_json(struct req *r, unsigned code, json_t *obj);
enum MHD_Result reply_error(struct req *r, const struct ipc_error *e);
enum MHD_Result fail(struct req *r, enum ipc_status st, const char *param, const char *msg);
enum MHD_Result reply_done(struct req *r);
void write_error_body(struct jw *w, const struct ipc_error *e);
void write_head(struct jw *w, struct req *r, const char *object);
/* One choice: text[0, n) and generated tokens [g0, g1); with tool calls
 * read (read_calls), their content and calls instead of the text. */
void write_choice(struct jw *w, struct req *r, int i, const char *text, size_t n, int g0, int g1, const char *finish,
                  bool delta, bool role);
/* Choice i's tool calls from its whole text, read once (the job is
 * done); NULL when it has none or the request gave no tools. */
const struct ipc_tool_calls *read_calls(struct req *r, int i);
void write_usage(struct jw *w, const struct job *j);
void write_kvtier(struct jw *w, const struct job *j);
const char *finish_name(enum gen_finish f);
/* The text of one token as the tokenizer decodes it alone, into buf (of at
 * least engine_max_piece bytes, so it always fits; else nothing, 0); its
 * length.  A part of
 * a character is U+FFFD, as transformers' decode of that one id gives it;
 * *whole (if not NULL): the text is the token's own bytes, whole
 * characters, not a U+FFFD standing for some. */
size_t token_piece(const engine *e, int32_t id, char *buf, size_t cap, bool *whole);

/* ---- stream.c ---- */
#define STREAM_BLOCK (64 * 1024)
ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max);
/* both under the engine lock */
bool has_news(const struct req *r);
bool over_limit(const struct req *r, size_t max);

/* ---- h_text.c: request decoding on a worker ---- */
struct ipc_limits limits(const struct server *s);
enum ipc_status encode(struct server *s, const char *text, size_t len, bool add_special, const char *field,
                       struct tok_ids *ids, struct ipc_error *err);
/* kwargs: the template's other variables (chat_template_kwargs), or NULL;
 * end: where the prompt ends (continuing the final message, a failed cut
 * is a 400 naming continue_final_message) */
enum ipc_status render(struct server *s, const json_t *messages, const json_t *tools, const json_t *documents,
                       const json_t *kwargs, enum ipc_chat_end end, struct tok_ids *ids, struct ipc_error *err);
enum ipc_status unknown_field(const char *key, const char *known, struct ipc_error *err);

/* ---- prepare steps (on a worker) and handlers (loop thread) ---- */
typedef enum ipc_status (*prepare_fn)(struct req *r);
typedef enum MHD_Result (*handler_fn)(struct req *r, const char *arg);

/* Completions and chat from r->root; rest: without max_tokens, to the end
 * of the context (chat's default, Ollama's for both). */
enum ipc_status prepare_generate(struct req *r, bool chat, bool rest);
/* 400 for a cache strategy an encoder-decoder model's decoder cannot take. */
enum ipc_status encdec_cache_check(const struct kv_seq_params *cp, struct ipc_error *err);
void new_id(struct req *r, const char *prefix);
enum ipc_status prep_completions(struct req *r);
enum ipc_status prep_chat(struct req *r);
enum ipc_status prep_tokenize(struct req *r);
enum ipc_status prep_detokenize(struct req *r);
enum ipc_status prep_apply_template(struct req *r);
enum ipc_status prep_session_create(struct req *r);
enum ipc_status prep_session_import(struct req *r);
enum MHD_Result h_generate(struct req *r, const char *arg);
enum MHD_Result h_prepared(struct req *r, const char *arg);
enum MHD_Result h_health(struct req *r, const char *arg);
enum MHD_Result h_models(struct req *r, const char *arg);
enum MHD_Result h_model(struct req *r, const char *arg);
enum MHD_Result h_metrics(struct req *r, const char *arg);
enum MHD_Result h_session_create(struct req *r, const char *arg);
enum MHD_Result h_session_list(struct req *r, const char *arg);
enum MHD_Result h_request_list(struct req *r, const char *arg);
enum MHD_Result h_session_get(struct req *r, const char *arg);
enum MHD_Result h_session_delete(struct req *r, const char *arg);
enum MHD_Result h_session_crop(struct req *r, const char *arg);
enum MHD_Result h_session_fork(struct req *r, const char *arg);
enum MHD_Result h_session_record(struct req *r, const char *arg);
enum MHD_Result h_session_export(struct req *r, const char *arg);
enum MHD_Result h_session_import(struct req *r, const char *arg);

/* ---- h_ollama.c ---- */
enum ipc_status prep_ollama_generate(struct req *r);
enum ipc_status prep_ollama_chat(struct req *r);
enum MHD_Result h_ollama_generate(struct req *r, const char *arg);
enum MHD_Result h_ollama_tags(struct req *r, const char *arg);
enum MHD_Result h_ollama_ps(struct req *r, const char *arg);
enum MHD_Result h_ollama_show(struct req *r, const char *arg);
enum MHD_Result h_ollama_version(struct req *r, const char *arg);
enum MHD_Result h_ollama_root(struct req *r, const char *arg);
/* One NDJSON object's head (model, created_at, the text) up to "done";
 * the final object with its statistics; the whole stream:false reply. */
void ollama_write_chunk(struct jw *w, struct req *r, const char *text, size_t n);
void ollama_write_final(struct jw *w, struct req *r, const char *text, size_t n);
enum MHD_Result ollama_reply_done(struct req *r);

#endif
