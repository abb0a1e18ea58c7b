/* kvtier/client.h - libkvtier-client, the C client of kvtierd.
 *
 * A client holds one connection to the daemon's Unix socket (reused across
 * calls) and is used by one thread at a time; open one per thread.  Every
 * call returns an enum kvtier_status; kvtier_strerror names it and
 * kvtier_errmsg gives the details of the client's last failure (the
 * daemon's own message when it answered with an error).
 *
 * Link with -lkvtier-client (pkg-config: kvtier).  Nothing here needs
 * other kvtier headers.
 */
#ifndef KVTIER_CLIENT_H
#define KVTIER_CLIENT_H

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVTIER_CLIENT_VERSION "1.0"
#define KVTIER_MAX_REPLY (64u << 20) /* bytes of one reply body or one stream event */

enum kvtier_status {
    KVTIER_OK = 0,
    KVTIER_EINVAL,      /* a bad argument (NULL where a value is needed, a bad socket path) */
    KVTIER_ENOMEM,      /* no memory in this process */
    KVTIER_EUNREACHABLE,/* no daemon listens on the socket */
    KVTIER_EIO,         /* the connection broke during the call */
    KVTIER_EPROTO,      /* the reply is not what kvtierd sends, or over KVTIER_MAX_REPLY */
    KVTIER_EHTTP,       /* the daemon answered with an error (kvtier_http_status says which) */
    KVTIER_ELOADING,    /* 503: the daemon is still loading its model; kvtier_health shows progress */
    KVTIER_ECANCELLED,  /* kvtier_cancel or the callback stopped the call; a generation is cancelled */
};

const char *kvtier_strerror(enum kvtier_status st);

typedef struct kvtier_client kvtier_client;

/* Opens a client for the socket at socket_path, or when it is NULL for
 * kvtierd's default socket (the rule kvtierd itself uses: $KVTIER_SOCKET,
 * else the per-user runtime directory).  Nothing is sent yet: a daemon that
 * is not running shows as KVTIER_EUNREACHABLE on the first call. */
enum kvtier_status kvtier_open(const char *socket_path, kvtier_client **out);
void kvtier_close(kvtier_client *c); /* accepts NULL */

const char *kvtier_socket(const kvtier_client *c);          /* the path in use */
const char *kvtier_errmsg(const kvtier_client *c);          /* the last failure's message, "" if none */
int kvtier_http_status(const kvtier_client *c);             /* the last reply's HTTP status, 0 if none */

/* Stops the call in progress on c (from a signal handler or another
 * thread: it only sets a flag, which the transfer checks at least once a
 * second; each call starts with it clear).  The connection is closed,
 * which makes the daemon cancel the generation; the call returns
 * KVTIER_ECANCELLED. */
void kvtier_cancel(kvtier_client *c);

/* ---- generation --------------------------------------------------------- */

struct kvtier_params {
    int max_tokens;            /* 0: the daemon's default */
    double temperature;        /* < 0: the daemon's default */
    long long seed;            /* used when has_seed */
    bool has_seed;
    const char *const *stop;   /* n_stop stop strings */
    size_t n_stop;
    const char *session;       /* continue in this session (kvtier_session_create), or NULL */
    const char *extra_json;    /* a JSON object whose fields are added to the request, or NULL */
};
#define KVTIER_PARAMS_INIT {.temperature = -1.0}

struct kvtier_message {
    const char *role; /* "system", "user", "assistant" */
    const char *content;
};

struct kvtier_result {
    char *text;                  /* the generated text (malloc'd, NUL-terminated) */
    size_t len;
    char finish_reason[32];      /* "stop", "length", ... ("" when the daemon sent none) */
    long long prompt_tokens, completion_tokens, cached_tokens;
};
void kvtier_result_free(struct kvtier_result *r); /* accepts a zeroed result */

/* Called with each piece of text as it is generated (not NUL-terminated);
 * return false to stop, which cancels the generation. */
typedef bool (*kvtier_token_fn)(void *ud, const char *text, size_t len);

/* A completion of prompt.  kvtier_complete waits for the whole reply;
 * kvtier_stream delivers it piece by piece through fn as well. */
enum kvtier_status kvtier_complete(kvtier_client *c, const char *prompt, const struct kvtier_params *p,
                                   struct kvtier_result *res);
enum kvtier_status kvtier_stream(kvtier_client *c, const char *prompt, const struct kvtier_params *p,
                                 kvtier_token_fn fn, void *ud, struct kvtier_result *res);
/* A chat completion of msgs[0, n) with the model's chat template; fn NULL
 * waits for the whole reply. */
enum kvtier_status kvtier_chat(kvtier_client *c, const struct kvtier_message *msgs, size_t n,
                               const struct kvtier_params *p, kvtier_token_fn fn, void *ud,
                               struct kvtier_result *res);

/* ---- sessions ----------------------------------------------------------- */

#define KVTIER_SESSION_ID_MAX 64

/* A new session (its KV stays in the daemon between requests), system
 * prompt optional; its id goes to id (KVTIER_SESSION_ID_MAX + 1 bytes). */
enum kvtier_status kvtier_session_create(kvtier_client *c, const char *system, char *id);
enum kvtier_status kvtier_session_delete(kvtier_client *c, const char *id);

/* ---- health and status -------------------------------------------------- */

struct kvtier_health {
    bool ready;                     /* 200 from /health */
    char status[32];                /* "ok", "loading", "failed", "draining", "stalled" */
    long long loaded_bytes, total_bytes; /* loading progress; -1 when the daemon does not say */
};
/* KVTIER_OK whenever the daemon answered, ready or not. */
enum kvtier_status kvtier_health(kvtier_client *c, struct kvtier_health *h);

/* ---- any endpoint ------------------------------------------------------- */

struct kvtier_reply {
    int status;  /* HTTP status */
    char *body;  /* malloc'd, NUL-terminated */
    size_t len;
};
void kvtier_reply_free(struct kvtier_reply *r); /* accepts a zeroed reply */

/* method path with body[0, len) (body NULL: none).  A non-2xx status is not
 * an error here: reply->status says it. */
enum kvtier_status kvtier_request(kvtier_client *c, const char *method, const char *path, const char *body,
                                  size_t len, struct kvtier_reply *reply);

#ifdef __cplusplus
}
#endif

#endif
