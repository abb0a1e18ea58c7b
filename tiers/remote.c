/* remote.c - the remote tier (remote.h): a small Redis client over hiredis's
 * blocking API on two threads, with its own cluster routing (Debian 12's
 * hiredis 0.14 has neither a cluster client nor TLS).
 *
 * A link is one thread's view of the servers: its nodes (one for a single
 * server, the cluster's masters otherwise) with a connection each, and
 * for a cluster the slot -> node table.  run() sends a batch of commands,
 * each to its key's node, as one pipeline per node, then reads the
 * replies: a node that fails (timeout, closed, refused) is dropped with
 * every command still waiting on it (NULL replies: misses), and is not
 * tried again before its backoff ends, so a dead node costs one timeout,
 * not one per request.  MOVED and ASK are followed once per command, and
 * a MOVED, a failed node or an unknown slot reloads the slot table before
 * the next batch.
 */
#include "tiers/remote.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sys/mman.h>

#include <hiredis/hiredis.h>

#include "tiers/disk_format.h"
#include "util/clock.h"
#include "util/log.h"

#define N_SLOTS 16384
#define BATCH 32                /* keys per lookup round trip, at most */
/* values per round trip, at most: Redis buffers a batch's replies whole
 * before it writes them, and a server's first batches of a size it has
 * not served fault that buffer in (docs/remote.md, "A daemon's first
 * lookup") */
#define BATCH_BYTES ((size_t)4 << 20)
#define PUB_BATCH 16            /* blocks per publish round trip */
#define BACKOFF_MIN_MS 100.0
#define BACKOFF_MAX_MS 5000.0
#define HOST_MAX 256
#define IN_CAP ((size_t)64 << 10) /* a node's buffer of reply headers */

struct node {
    char host[HOST_MAX]; /* a Unix socket's path when port is 0 */
    int port;
    redisContext *c;
    double retry_at, backoff_ms;
    bool down; /* logged as unreachable, not back yet */
    int pending;
    /* the batches' replies, read here rather than by hiredis (reply_read) */
    char *in;
    size_t in_pos, in_len;
    double deadline; /* clock_ms() by which the reply being read must be in */
};

struct link {
    kv_remote *r;
    const char *role; /* for the log */
    struct node *nodes;
    int n_nodes, cap;
    uint16_t *slot; /* [N_SLOTS]: node index + 1, 0 unknown (cluster only) */
    bool stale;     /* the slot table needs a reload */
};

struct cmd {
    const char *argv[5];
    size_t len[5];
    int argc;
    int node;
    redisReply *reply; /* NULL: none came (the node failed or was skipped) */
    bool in_arena;     /* reply is a string whose bytes the batch's arena holds (reply_free) */
};

/* A lookup's values, in large anonymous mappings with transparent huge
 * pages asked for, freed together.  Values held until the engine takes
 * them would otherwise each be a fresh malloc'd mapping faulted in one
 * 4 KiB page at a time, which measured (docs/remote.md) as the lookup
 * thread's largest cost after the kernel's own copy.  Freed chunks are
 * kept for the next lookups, up to ARENA_KEEP: faulting a chunk in (and
 * the kernel's compaction for its huge pages) is paid once, not per
 * lookup. */
struct arena_chunk {
    struct arena_chunk *next;
    size_t size;
};

struct arena {
    struct arena_chunk *chunks;
    uint8_t *cur;
    size_t left;
};


/* kind: 'p' a prefix-cache block, 'x' a kept sequence (kv_remote_publish_seq) */
struct pub {
    struct kv_prefix_block b;
    char kind;
    struct pub *next;
};

struct kv_remote_fetch {
    kv_remote *r;
    uint64_t ns;
    char kind;        /* as struct pub's */
    size_t max_bytes; /* a value claiming more is corrupt; SIZE_MAX: no bound */
    int n, found;
    int ready; /* under r->mu: found as of the last batch taken */
    bool done; /* under r->mu */
    struct arena arena; /* the values */
    kv_remote_fetch *next;
    struct {
        uint64_t hash;
        redisReply *rep; /* holds data, when it was stored raw */
        bool in_arena;   /* rep's string is in the arena */
        void *owned;     /* holds data, when it was decompressed */
        const void *data;
        size_t len;
    } blk[];
};

struct kv_remote {
    struct kv_remote_params p;
    char *url, *cluster, *user, *password, *variant; /* owned copies */
    int db;
    char layout_key[96];
    bool is_cluster;
    struct link fl, pl; /* the lookup and the publish thread's */
    ZSTD_DCtx *dctx;    /* the lookup thread's: any value may be compressed */
    ZSTD_CCtx *cctx;    /* the publish thread's; NULL: values are published raw */
    pthread_t ft, pt;
    bool ft_started, pt_started;

    pthread_mutex_t mu;
    pthread_cond_t cv;       /* work for either thread, a fetch done */
    bool stop;
    kv_remote_fetch *fq, **fq_tail;
    struct pub *pq, **pq_tail;
    size_t pq_bytes;
    bool full; /* logged as full (OOM), no successful publish since */
    struct arena_chunk *spare; /* freed lookup arenas' chunks, for the next (arena_free) */
    size_t spare_bytes;
    struct kv_remote_stats st;
};

static const char *const err_names[KV_REMOTE_N_ERR] = {"connect", "timeout", "io",      "auth",   "oom",
                                                       "reply",   "corrupt", "foreign", "dropped"};

const char *kv_remote_err_name(enum kv_remote_err e)
{
    return (unsigned)e < KV_REMOTE_N_ERR ? err_names[e] : "?";
}

static void count(kv_remote *r, enum kv_remote_err e)
{
    pthread_mutex_lock(&r->mu);
    r->st.errors[e]++;
    pthread_mutex_unlock(&r->mu);
}

#define ARENA_CHUNK ((size_t)32 << 20)
#define ARENA_KEEP ((size_t)128 << 20)

static struct arena_chunk *chunk_map(size_t size)
{
    void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    madvise(m, size, MADV_HUGEPAGE); /* advice: refused or ignored, it is 4 KiB pages */
    struct arena_chunk *c = m;
    c->size = size;
    return c;
}

static struct arena_chunk *chunk_new(kv_remote *r, size_t size)
{
    struct arena_chunk *c = NULL;
    if (size == ARENA_CHUNK) {
        pthread_mutex_lock(&r->mu);
        if ((c = r->spare)) {
            r->spare = c->next;
            r->spare_bytes -= c->size;
        }
        pthread_mutex_unlock(&r->mu);
        if (c)
            return c;
    }
    return chunk_map(size);
}

static void *arena_alloc(kv_remote *r, struct arena *a, size_t len)
{
    len = (len + 63) & ~(size_t)63;
    if (len > a->left) {
        struct arena_chunk *c = chunk_new(r, len + 64 > ARENA_CHUNK ? len + 64 : ARENA_CHUNK);
        if (!c)
            return NULL;
        c->next = a->chunks;
        a->chunks = c;
        a->cur = (uint8_t *)c + 64;
        a->left = c->size - 64;
    }
    void *p = a->cur;
    a->cur += len;
    a->left -= len;
    return p;
}

static void arena_free(kv_remote *r, struct arena *a)
{
    while (a->chunks) {
        struct arena_chunk *c = a->chunks;
        a->chunks = c->next;
        pthread_mutex_lock(&r->mu);
        bool keep = c->size == ARENA_CHUNK && r->spare_bytes + c->size <= ARENA_KEEP;
        if (keep) {
            c->next = r->spare;
            r->spare = c;
            r->spare_bytes += c->size;
        }
        pthread_mutex_unlock(&r->mu);
        if (!keep)
            munmap(c, c->size);
    }
    a->cur = NULL;
    a->left = 0;
}

/* Frees a reply whose string may be in an arena. */
static void reply_free(redisReply *r, bool in_arena)
{
    if (r && in_arena)
        r->str = NULL;
    freeReplyObject(r);
}

/* ---- keys and slots ---------------------------------------------------- */

static void key_of(const kv_remote *r, char kind, uint64_t ns, uint64_t hash, char out[160])
{
    snprintf(out, 160, "kvt:%016" PRIx64 ":%s:%c%" PRIx64 ":%016" PRIx64, r->p.layout.fingerprint, r->layout_key,
             kind, ns, hash);
}

void kv_remote_key(const kv_remote *r, uint64_t ns, uint64_t hash, char out[160])
{
    key_of(r, 'p', ns, hash, out);
}

static uint16_t crc16(const char *buf, size_t len)
{
    uint16_t crc = 0; /* CRC-16/XMODEM, as Redis Cluster's keyHashSlot */
    for (size_t i = 0; i < len; i++) {
        crc ^= (uint16_t)((uint8_t)buf[i] << 8);
        for (int b = 0; b < 8; b++)
            crc = crc & 0x8000 ? (uint16_t)((crc << 1) ^ 0x1021) : (uint16_t)(crc << 1);
    }
    return crc;
}

unsigned kv_remote_slot(const char *key, size_t len)
{
    const char *open = memchr(key, '{', len);
    if (open) {
        const char *close = memchr(open + 1, '}', len - (size_t)(open + 1 - key));
        if (close && close > open + 1)
            return crc16(open + 1, (size_t)(close - open - 1)) & (N_SLOTS - 1);
    }
    return crc16(key, len) & (N_SLOTS - 1);
}

/* ---- nodes ----------------------------------------------------------------- */

static int node_find(struct link *L, const char *host, int port)
{
    for (int i = 0; i < L->n_nodes; i++)
        if (L->nodes[i].port == port && !strcmp(L->nodes[i].host, host))
            return i;
    if (strlen(host) >= HOST_MAX || L->n_nodes >= 1024)
        return -1;
    if (L->n_nodes == L->cap) {
        int cap = L->cap ? 2 * L->cap : 4;
        struct node *n = realloc(L->nodes, (size_t)cap * sizeof(*n));
        if (!n)
            return -1;
        L->nodes = n;
        L->cap = cap;
    }
    struct node *n = &L->nodes[L->n_nodes];
    *n = (struct node){.port = port, .backoff_ms = BACKOFF_MIN_MS};
    snprintf(n->host, sizeof(n->host), "%s", host);
    return L->n_nodes++;
}

static void node_name(const struct node *n, char *out, size_t cap)
{
    if (n->port)
        snprintf(out, cap, "%s:%d", n->host, n->port);
    else
        snprintf(out, cap, "unix:%s", n->host);
}

static enum kv_remote_err io_kind(const redisContext *c)
{
    if (c->err == REDIS_ERR_IO && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ETIMEDOUT ||
                                   strstr(c->errstr, "temporarily unavailable") || strstr(c->errstr, "timed out")))
        return KV_REMOTE_E_TIMEOUT;
    return KV_REMOTE_E_IO;
}

/* n failed: dropped, left alone for its backoff, logged when it was up.
 * why may be the connection's errstr, which the free takes with it. */
static void node_fail(struct link *L, struct node *n, enum kv_remote_err kind, const char *why_in)
{
    char why[256];
    snprintf(why, sizeof(why), "%s", why_in);
    count(L->r, kind);
    if (n->c)
        redisFree(n->c);
    n->c = NULL;
    n->pending = 0;
    n->in_pos = n->in_len = 0;
    n->retry_at = clock_ms() + n->backoff_ms;
    n->backoff_ms = n->backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : n->backoff_ms * 2;
    L->stale = true;
    if (!n->down) {
        char name[HOST_MAX + 16];
        node_name(n, name, sizeof(name));
        log_msg(LOG_WARN, "remote tier (%s): redis %s unavailable (%s: %s); its blocks are misses, retrying with backoff",
                L->role, name, kv_remote_err_name(kind), why);
        n->down = true;
    }
}

/* One command on a fresh connection, for AUTH and SELECT; false on refusal. */
static bool setup_cmd(redisContext *c, int argc, const char **argv, char *why, size_t cap)
{
    redisReply *rep = redisCommandArgv(c, argc, argv, NULL);
    bool ok = rep && rep->type != REDIS_REPLY_ERROR;
    if (!ok)
        snprintf(why, cap, "%s: %s", argv[0], rep ? rep->str : c->errstr);
    freeReplyObject(rep);
    return ok;
}

/* Connects n unless it is in its backoff; false when it is not usable now. */
static bool node_ready(struct link *L, struct node *n)
{
    if (n->c)
        return true;
    if (clock_ms() < n->retry_at)
        return false;
    const kv_remote *r = L->r;
    struct timeval tv = {r->p.timeout_ms / 1000, (r->p.timeout_ms % 1000) * 1000};
    redisContext *c = n->port ? redisConnectWithTimeout(n->host, n->port, tv) : redisConnectUnixWithTimeout(n->host, tv);
    if (!c || c->err) {
        node_fail(L, n, c && io_kind(c) == KV_REMOTE_E_TIMEOUT ? KV_REMOTE_E_TIMEOUT : KV_REMOTE_E_CONNECT,
                  c ? c->errstr : "out of memory");
        if (c)
            redisFree(c);
        return false;
    }
    n->c = c;
    char why[256] = "";
    char db[16];
    snprintf(db, sizeof(db), "%d", r->db);
    const char *auth[3] = {"AUTH"}, *sel[] = {"SELECT", db};
    int n_auth = 1;
    if (r->user)
        auth[n_auth++] = r->user;
    auth[n_auth++] = r->password;
    if (redisSetTimeout(c, tv) != REDIS_OK || (r->password && !setup_cmd(c, n_auth, auth, why, sizeof(why))) ||
        (r->db && !setup_cmd(c, 2, sel, why, sizeof(why)))) {
        node_fail(L, n, why[0] && !c->err ? KV_REMOTE_E_AUTH : io_kind(c), why[0] ? why : c->errstr);
        return false;
    }
    if (n->down || L->r->p.url) {
        char name[HOST_MAX + 16];
        node_name(n, name, sizeof(name));
        log_msg(n->down ? LOG_WARN : LOG_INFO, "remote tier (%s): redis %s %s", L->role, name,
                n->down ? "is back" : "connected");
    }
    n->down = false;
    n->backoff_ms = BACKOFF_MIN_MS;
    return true;
}

/* ---- cluster routing ------------------------------------------------------- */

/* Reloads the slot table from the first node that answers CLUSTER SLOTS. */
static void slots_load(struct link *L)
{
    for (int i = 0; i < L->n_nodes; i++) {
        if (!node_ready(L, &L->nodes[i]))
            continue;
        redisContext *c = L->nodes[i].c;
        redisReply *rep = redisCommand(c, "CLUSTER SLOTS");
        if (!rep) {
            node_fail(L, &L->nodes[i], io_kind(c), c->errstr);
            continue;
        }
        if (rep->type != REDIS_REPLY_ARRAY) {
            freeReplyObject(rep);
            count(L->r, KV_REMOTE_E_REPLY);
            continue;
        }
        char asked[HOST_MAX];
        snprintf(asked, sizeof(asked), "%s", L->nodes[i].host);
        memset(L->slot, 0, N_SLOTS * sizeof(*L->slot));
        for (size_t k = 0; k < rep->elements; k++) {
            const redisReply *e = rep->element[k];
            if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 || e->element[0]->type != REDIS_REPLY_INTEGER ||
                e->element[1]->type != REDIS_REPLY_INTEGER || e->element[2]->type != REDIS_REPLY_ARRAY ||
                e->element[2]->elements < 2 || e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
                e->element[2]->element[1]->type != REDIS_REPLY_INTEGER)
                continue;
            long long lo = e->element[0]->integer, hi = e->element[1]->integer;
            long long port = e->element[2]->element[1]->integer;
            const char *host = e->element[2]->element[0]->str;
            if (lo < 0 || hi >= N_SLOTS || lo > hi || port <= 0 || port > 65535)
                continue;
            /* an empty host is the node we asked */
            int ni = node_find(L, host[0] ? host : asked, (int)port);
            for (long long s = lo; ni >= 0 && s <= hi; s++)
                L->slot[s] = (uint16_t)(ni + 1);
        }
        freeReplyObject(rep);
        L->stale = false;
        return;
    }
}

static int node_of_key(struct link *L, const char *key, size_t len)
{
    if (!L->r->is_cluster)
        return 0;
    unsigned s = kv_remote_slot(key, len);
    if (!L->slot[s])
        L->stale = true;
    return L->slot[s] ? L->slot[s] - 1 : -1;
}

/* "MOVED 3999 127.0.0.1:6381" / "ASK ...": the node it names, -1 if none. */
static int redirect_node(struct link *L, const redisReply *rep, bool *ask, unsigned *slot)
{
    char host[HOST_MAX];
    unsigned s;
    int port;
    *ask = !strncmp(rep->str, "ASK ", 4);
    if ((strncmp(rep->str, "MOVED ", 6) && !*ask) ||
        sscanf(rep->str + (*ask ? 4 : 6), "%u %255[^:]:%d", &s, host, &port) != 3 || s >= N_SLOTS || port <= 0 ||
        port > 65535)
        return -1;
    *slot = s;
    return node_find(L, host, port);
}

/* One command on node ni, after ASKING for a redirection by ASK. */
static redisReply *run_one(struct link *L, int ni, struct cmd *c, bool ask)
{
    struct node *n = &L->nodes[ni];
    if (!node_ready(L, n))
        return NULL;
    if (ask) {
        redisReply *a = redisCommand(n->c, "ASKING");
        freeReplyObject(a);
    }
    redisReply *rep = n->c->err ? NULL : redisCommandArgv(n->c, c->argc, c->argv, c->len);
    if (!rep)
        node_fail(L, n, io_kind(n->c), n->c->errstr);
    return rep;
}

/* ---- replies ---------------------------------------------------------------- */

/* A batch's replies are read here, not by hiredis: hiredis 0.14 reads 16
 * KiB per read() into a stack buffer, appends that to its reader's
 * buffer, frees that buffer whenever it empties (so it regrows for every
 * value) and copies each value into its reply: three copies of every
 * byte and a syscall per 16 KiB.  Here a value is read from the socket
 * straight into its reply's string, once; only reply headers and short
 * replies go through the node's buffer.  The replies are hiredis's own
 * objects (freeReplyObject frees them), and the connection stays
 * hiredis's for everything else: a batch reads exactly its replies, so
 * neither reader ever holds the other's bytes. */

/* Whether n's reply is overdue: each read waits at most the timeout, and
 * this bounds a reply that trickles in a byte at a time. */
static bool in_late(const struct node *n, enum kv_remote_err *kind, char *why, size_t cap)
{
    if (clock_ms() <= n->deadline)
        return false;
    *kind = KV_REMOTE_E_TIMEOUT;
    snprintf(why, cap, "a reply not in within the timeout");
    return true;
}

/* Reads more of n's stream into its buffer; false with *kind and why. */
static bool in_fill(struct node *n, enum kv_remote_err *kind, char *why, size_t cap)
{
    if (in_late(n, kind, why, cap))
        return false;
    if (n->in_pos == n->in_len)
        n->in_pos = n->in_len = 0;
    if (n->in_len == IN_CAP) { /* a header longer than the buffer: not Redis */
        *kind = KV_REMOTE_E_IO;
        snprintf(why, cap, "a reply header over %zu bytes", IN_CAP);
        return false;
    }
    if (n->in_pos) {
        memmove(n->in, n->in + n->in_pos, n->in_len - n->in_pos);
        n->in_len -= n->in_pos;
        n->in_pos = 0;
    }
    ssize_t got = read(n->c->fd, n->in + n->in_len, IN_CAP - n->in_len);
    if (got > 0) {
        n->in_len += (size_t)got;
        return true;
    }
    *kind = got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? KV_REMOTE_E_TIMEOUT : KV_REMOTE_E_IO;
    snprintf(why, cap, "%s", got ? strerror(errno) : "connection closed by the server");
    return false;
}

/* Fills dst[0, len) from the buffer, then from the socket itself. */
static bool in_take(struct node *n, char *dst, size_t len, enum kv_remote_err *kind, char *why, size_t cap)
{
    size_t have = n->in_len - n->in_pos < len ? n->in_len - n->in_pos : len;
    if (dst)
        memcpy(dst, n->in + n->in_pos, have);
    n->in_pos += have;
    while (have < len) {
        if (in_late(n, kind, why, cap))
            return false;
        char sink[4096];
        size_t want = len - have;
        ssize_t got = dst ? read(n->c->fd, dst + have, want)
                          : read(n->c->fd, sink, want < sizeof(sink) ? want : sizeof(sink));
        if (got <= 0) {
            *kind = got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? KV_REMOTE_E_TIMEOUT : KV_REMOTE_E_IO;
            snprintf(why, cap, "%s", got ? strerror(errno) : "connection closed by the server");
            return false;
        }
        have += (size_t)got;
    }
    return true;
}

/* One reply of n: a status, an error, an integer, a bulk string or nil
 * (what GETEX, SET and their errors answer).  NULL with *kind and why on
 * a failed read or a reply of another kind (the stream cannot be trusted
 * after it).  A bulk longer than max_bulk is read past and given as an
 * empty string: a miss, counted as corrupt, without holding it. */
static redisReply *reply_read(kv_remote *rr, struct node *n, size_t max_bulk, struct arena *a,
                              enum kv_remote_err *kind, char *why, size_t cap)
{
    if (!n->in && !(n->in = malloc(IN_CAP))) {
        *kind = KV_REMOTE_E_IO;
        snprintf(why, cap, "out of memory for a read buffer");
        return NULL;
    }
    n->deadline = clock_ms() + rr->p.timeout_ms;
    char *eol;
    while (!(eol = memchr(n->in + n->in_pos, '\n', n->in_len - n->in_pos)))
        if (!in_fill(n, kind, why, cap))
            return NULL;
    const char *line = n->in + n->in_pos;
    size_t line_len = (size_t)(eol - line);
    n->in_pos += line_len + 1;
    if (line_len < 2 || line[line_len - 1] != '\r') {
        *kind = KV_REMOTE_E_IO;
        snprintf(why, cap, "not a Redis reply");
        return NULL;
    }
    line_len--; /* without the \r */
    redisReply *r = calloc(1, sizeof(*r));
    if (!r) {
        *kind = KV_REMOTE_E_IO;
        snprintf(why, cap, "out of memory for a reply");
        return NULL;
    }
    char *end;
    long long v = 0;
    if (line[0] == ':' || line[0] == '$') {
        errno = 0;
        v = strtoll(line + 1, &end, 10);
        if (errno || end != line + line_len || end == line + 1)
            line = "?"; /* falls to the refusal below */
    }
    switch (line[0]) {
    case '+':
    case '-':
        r->type = line[0] == '+' ? REDIS_REPLY_STATUS : REDIS_REPLY_ERROR;
        r->len = line_len - 1;
        if ((r->str = malloc(r->len + 1))) {
            memcpy(r->str, line + 1, r->len);
            r->str[r->len] = '\0';
            return r;
        }
        break;
    case ':':
        r->type = REDIS_REPLY_INTEGER;
        r->integer = v;
        return r;
    case '$':
        if (v == -1) {
            r->type = REDIS_REPLY_NIL;
            return r;
        }
        if (v < 0)
            break;
        r->type = REDIS_REPLY_STRING;
        bool keep = (unsigned long long)v <= max_bulk;
        a = keep && v > 0 ? a : NULL; /* the arena holds exactly the non-empty strings (in_arena) */
        r->len = keep ? (size_t)v : 0;
        if (!(r->str = a ? arena_alloc(rr, a, r->len + 1) : malloc(r->len + 1)))
            break;
        char crlf[2];
        if (!in_take(n, keep ? r->str : NULL, (size_t)v, kind, why, cap) || !in_take(n, crlf, 2, kind, why, cap)) {
            reply_free(r, a);
            return NULL;
        }
        r->str[r->len] = '\0';
        if (crlf[0] == '\r' && crlf[1] == '\n')
            return r;
        reply_free(r, a);
        *kind = KV_REMOTE_E_IO;
        snprintf(why, cap, "a bulk reply not ended by CRLF");
        return NULL;
    }
    freeReplyObject(r);
    *kind = KV_REMOTE_E_IO;
    snprintf(why, cap, "a reply this client does not read (\"%.16s\")", line);
    return NULL;
}

/* ---- batches --------------------------------------------------------------- */

/* Sends cmds[0, n) and reads their replies; a's arena (NULL: malloc)
 * holds the strings reply_read reads.  max_value: the longest value that
 * can check (SIZE_MAX: no bound). */
static void run(struct link *L, struct cmd *cmds, int n, struct arena *a, size_t max_value)
{
    if (L->r->is_cluster && L->stale)
        slots_load(L);
    for (int i = 0; i < n; i++) {
        cmds[i].reply = NULL;
        cmds[i].in_arena = false;
        cmds[i].node = node_of_key(L, cmds[i].argv[1], cmds[i].len[1]);
    }
    for (int i = 0; i < n; i++) {
        struct cmd *c = &cmds[i];
        if (c->node < 0)
            continue;
        struct node *nd = &L->nodes[c->node];
        if (!node_ready(L, nd) || redisAppendCommandArgv(nd->c, c->argc, c->argv, c->len) != REDIS_OK) {
            c->node = -1;
            continue;
        }
        nd->pending++;
    }
    for (int i = 0; i < L->n_nodes; i++) {
        struct node *nd = &L->nodes[i];
        int done = 0;
        while (nd->c && nd->pending && !done)
            if (redisBufferWrite(nd->c, &done) != REDIS_OK)
                node_fail(L, nd, io_kind(nd->c), nd->c->errstr);
    }
    /* a value that would not check anyway (longer than its container) is not kept */
    size_t max_bulk = max_value < SIZE_MAX / 2 ? 2 * max_value + ((size_t)64 << 10) : SIZE_MAX;
    for (int i = 0; i < n; i++) {
        struct cmd *c = &cmds[i];
        if (c->node < 0)
            continue;
        struct node *nd = &L->nodes[c->node];
        if (!nd->c || !nd->pending)
            continue; /* failed with an earlier reply of this batch */
        enum kv_remote_err kind;
        char why[128];
        if (!(c->reply = reply_read(L->r, nd, max_bulk, a, &kind, why, sizeof(why)))) {
            node_fail(L, nd, kind, why);
            continue;
        }
        c->in_arena = a && c->reply->type == REDIS_REPLY_STRING && c->reply->len;
        nd->pending--;
    }
    /* redirections, once each */
    for (int i = 0; L->r->is_cluster && i < n; i++) {
        struct cmd *c = &cmds[i];
        bool ask;
        unsigned slot;
        int to;
        if (!c->reply || c->reply->type != REDIS_REPLY_ERROR || (to = redirect_node(L, c->reply, &ask, &slot)) < 0)
            continue;
        if (!ask) {
            L->slot[slot] = (uint16_t)(to + 1);
            L->stale = true;
        }
        freeReplyObject(c->reply);
        c->reply = run_one(L, to, c, ask);
        c->in_arena = false;
    }
}

/* ---- the lookup thread ----------------------------------------------------- */

/* Checks the replies of a batch in order; false at the first miss. */
static bool take_batch(kv_remote *r, kv_remote_fetch *f, int from, struct cmd *cmds, int n)
{
    bool going = true;
    for (int i = 0; i < n; i++) {
        redisReply *rep = cmds[i].reply;
        bool in_arena = cmds[i].in_arena;
        cmds[i].reply = NULL;
        int k = from + i;
        enum kv_remote_err bad = KV_REMOTE_N_ERR;
        if (going && rep && rep->type == REDIS_REPLY_STRING) {
            char ns[24], name[24], why[DISK_WHY_LEN];
            snprintf(ns, sizeof(ns), "%c%" PRIx64, f->kind, f->ns);
            snprintf(name, sizeof(name), "%016" PRIx64, f->blk[k].hash);
            enum disk_check dc = disk_blob_decode(rep->str, rep->len, &r->p.layout, ns, name, f->max_bytes, r->dctx,
                                                  &f->blk[k].data, &f->blk[k].len, &f->blk[k].owned, why);
            if (dc == DISK_VALID) {
                f->blk[k].rep = f->blk[k].owned ? NULL : rep;
                f->blk[k].in_arena = in_arena;
                f->found++;
                pthread_mutex_lock(&r->mu);
                r->st.bytes_in += rep->len;
                pthread_mutex_unlock(&r->mu);
                if (f->blk[k].owned)
                    reply_free(rep, in_arena);
                continue;
            }
            /* out of memory: a miss, not the value's fault */
            bad = dc == DISK_NOMEM ? KV_REMOTE_N_ERR : dc == DISK_FOREIGN ? KV_REMOTE_E_FOREIGN : KV_REMOTE_E_CORRUPT;
            log_msg(LOG_DEBUG, "remote tier: block %s/%s not used: %s", ns, name, why);
        } else if (going && rep && rep->type == REDIS_REPLY_ERROR) {
            bad = !strncmp(rep->str, "OOM", 3) ? KV_REMOTE_E_OOM : KV_REMOTE_E_REPLY;
        } else if (going && rep && rep->type != REDIS_REPLY_NIL) {
            bad = KV_REMOTE_E_CORRUPT;
        }
        if (bad != KV_REMOTE_N_ERR)
            count(r, bad);
        going = false;
        reply_free(rep, in_arena);
    }
    return going;
}

static void fetch_run(kv_remote *r, kv_remote_fetch *f)
{
    double t0 = clock_ms();
    char ttl[16], keys[BATCH][160];
    snprintf(ttl, sizeof(ttl), "%d", r->p.ttl_s);
    struct cmd cmds[BATCH];
    bool going = true;
    size_t fit = f->max_bytes < SIZE_MAX ? BATCH_BYTES / (f->max_bytes + 1) : BATCH;
    int batch = fit < 1 ? 1 : fit < BATCH ? (int)fit : BATCH;
    for (int from = 0; going && from < f->n; from += batch) {
        int n = f->n - from < batch ? f->n - from : batch;
        for (int i = 0; i < n; i++) {
            key_of(r, f->kind, f->ns, f->blk[from + i].hash, keys[i]);
            /* GETEX refreshes the TTL of a hit in the same round trip */
            cmds[i] = (struct cmd){.argv = {"GETEX", keys[i], "EX", ttl}, .argc = 4};
            for (int a = 0; a < 4; a++)
                cmds[i].len[a] = strlen(cmds[i].argv[a]);
        }
        run(&r->fl, cmds, n, &f->arena, f->max_bytes);
        going = take_batch(r, f, from, cmds, n);
        /* the caller inserts these while the next batch is read */
        pthread_mutex_lock(&r->mu);
        f->ready = f->found;
        pthread_mutex_unlock(&r->mu);
        if (going && from + n < f->n && r->p.notify)
            r->p.notify(r->p.notify_arg);
    }
    pthread_mutex_lock(&r->mu);
    r->st.lookups++;
    r->st.hit_blocks += (uint64_t)f->found;
    r->st.miss_lookups += f->found < f->n;
    r->st.fetch_ms += clock_ms() - t0;
    pthread_mutex_unlock(&r->mu);
}

/* A link's connections (and a cluster's slot map), made before the first
 * batch needs them. */
static void link_connect(struct link *L)
{
    if (L->r->is_cluster)
        slots_load(L);
    for (int i = 0; i < L->n_nodes; i++)
        node_ready(L, &L->nodes[i]);
}

/* Faults in warm_bytes of the arena chunks lookups keep, before the first
 * lookup: faulting a chunk in (and zeroing its huge pages) was a large
 * part of a daemon's first lookup (docs/remote.md). */
static void arenas_warm(kv_remote *r)
{
    for (size_t kept = 0; kept < r->p.warm_bytes && kept + ARENA_CHUNK <= ARENA_KEEP; kept += ARENA_CHUNK) {
        pthread_mutex_lock(&r->mu);
        bool stop = r->stop || r->fq;
        pthread_mutex_unlock(&r->mu);
        struct arena_chunk *c = stop ? NULL : chunk_map(ARENA_CHUNK);
        if (!c)
            return;
        for (size_t off = 64; off < ARENA_CHUNK; off += 4096)
            ((volatile uint8_t *)c)[off] = 0;
        c->next = NULL;
        struct arena a = {.chunks = c};
        arena_free(r, &a);
    }
}

static void *fetch_main(void *arg)
{
    kv_remote *r = arg;
    link_connect(&r->fl);
    arenas_warm(r);
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && !r->fq)
            pthread_cond_wait(&r->cv, &r->mu);
        kv_remote_fetch *f = r->fq;
        if (!f)
            break;
        r->fq = f->next;
        if (!r->fq)
            r->fq_tail = &r->fq;
        bool stop = r->stop;
        pthread_mutex_unlock(&r->mu);
        if (!stop)
            fetch_run(r, f);
        pthread_mutex_lock(&r->mu);
        f->ready = f->found;
        f->done = true;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        if (r->p.notify)
            r->p.notify(r->p.notify_arg);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* ---- the publish thread ---------------------------------------------------- */

static void publish_batch(kv_remote *r, struct pub **items, int n)
{
    char ttl[16], keys[PUB_BATCH][160];
    snprintf(ttl, sizeof(ttl), "%d", r->p.ttl_s);
    struct cmd cmds[PUB_BATCH];
    void *blobs[PUB_BATCH];
    int m = 0;
    for (int i = 0; i < n; i++) {
        const struct kv_prefix_block *b = &items[i]->b;
        char ns[24], name[24];
        size_t len = 0;
        snprintf(ns, sizeof(ns), "%c%" PRIx64, items[i]->kind, b->ns);
        snprintf(name, sizeof(name), "%016" PRIx64, b->hash);
        if (!(blobs[m] = disk_blob_encode(&r->p.layout, ns, name, b->buf, b->len, r->cctx, &len))) {
            count(r, KV_REMOTE_E_DROPPED);
            continue;
        }
        key_of(r, items[i]->kind, b->ns, b->hash, keys[m]);
        cmds[m] = (struct cmd){.argv = {"SET", keys[m], blobs[m], "EX", ttl}, .argc = 5};
        for (int a = 0; a < 5; a++)
            cmds[m].len[a] = a == 2 ? len : strlen(cmds[m].argv[a]);
        m++;
    }
    run(&r->pl, cmds, m, NULL, 0); /* SET answers a status: a bulk is read past, never held */
    uint64_t ok = 0, bytes = 0;
    bool oom = false;
    for (int i = 0; i < m; i++) {
        redisReply *rep = cmds[i].reply;
        if (rep && rep->type == REDIS_REPLY_STATUS) {
            ok++;
            bytes += cmds[i].len[2];
        } else if (rep && rep->type == REDIS_REPLY_ERROR) {
            bool is_oom = !strncmp(rep->str, "OOM", 3);
            count(r, is_oom ? KV_REMOTE_E_OOM : KV_REMOTE_E_REPLY);
            oom = oom || is_oom;
            if (!is_oom)
                log_msg(LOG_DEBUG, "remote tier: SET refused: %s", rep->str);
        }
        freeReplyObject(rep);
        free(blobs[i]);
    }
    pthread_mutex_lock(&r->mu);
    r->st.published += ok;
    r->st.bytes_out += bytes;
    bool was_full = r->full;
    r->full = oom ? true : ok ? false : r->full;
    bool now_full = r->full;
    pthread_mutex_unlock(&r->mu);
    if (now_full && !was_full)
        log_msg(LOG_WARN, "remote tier: redis is full (OOM command not allowed): blocks are not published until it "
                          "takes them again (set maxmemory-policy allkeys-lru)");
    else if (was_full && !now_full)
        log_msg(LOG_INFO, "remote tier: redis takes blocks again");
}

static void *publish_main(void *arg)
{
    kv_remote *r = arg;
    struct pub *items[PUB_BATCH];
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (!r->stop && !r->pq)
            pthread_cond_wait(&r->cv, &r->mu);
        if (r->stop)
            break;
        int n = 0;
        while (r->pq && n < PUB_BATCH) {
            items[n] = r->pq;
            r->pq = r->pq->next;
            r->pq_bytes -= items[n]->b.len;
            n++;
        }
        if (!r->pq)
            r->pq_tail = &r->pq;
        pthread_mutex_unlock(&r->mu);
        publish_batch(r, items, n);
        for (int i = 0; i < n; i++) {
            free(items[i]->b.buf);
            free(items[i]);
        }
        if (r->p.notify)
            r->p.notify(r->p.notify_arg);
        pthread_mutex_lock(&r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

size_t kv_remote_publish_room(kv_remote *r)
{
    pthread_mutex_lock(&r->mu);
    size_t room = r->p.queue_bytes - r->pq_bytes;
    pthread_mutex_unlock(&r->mu);
    return room;
}

static bool publish(kv_remote *r, struct kv_prefix_block *b, char kind)
{
    struct pub *p = malloc(sizeof(*p));
    pthread_mutex_lock(&r->mu);
    bool ok = p && r->pq_bytes + b->len <= r->p.queue_bytes;
    if (ok) {
        p->b = *b;
        p->kind = kind;
        p->next = NULL;
        *r->pq_tail = p;
        r->pq_tail = &p->next;
        r->pq_bytes += b->len;
        pthread_cond_broadcast(&r->cv);
    } else {
        r->st.errors[KV_REMOTE_E_DROPPED]++;
    }
    pthread_mutex_unlock(&r->mu);
    if (!ok) {
        free(p);
        free(b->buf);
    }
    b->buf = NULL;
    return ok;
}

bool kv_remote_publish(kv_remote *r, struct kv_prefix_block *b)
{
    return publish(r, b, 'p');
}

bool kv_remote_publish_seq(kv_remote *r, uint64_t ns, uint64_t hash, void *buf, size_t len)
{
    return publish(r, &(struct kv_prefix_block){.buf = buf, .len = len, .ns = ns, .hash = hash}, 'x');
}

/* ---- fetches --------------------------------------------------------------- */

static enum tier_status fetch_start(kv_remote *r, char kind, uint64_t ns, const uint64_t *hashes, int n,
                                    size_t max_bytes, kv_remote_fetch **out)
{
    *out = NULL;
    if (n <= 0)
        return TIER_EINVAL;
    kv_remote_fetch *f = calloc(1, sizeof(*f) + (size_t)n * sizeof(f->blk[0]));
    if (!f)
        return TIER_ENOMEM_HOST;
    f->r = r;
    f->ns = ns;
    f->kind = kind;
    f->max_bytes = max_bytes;
    f->n = n;
    for (int i = 0; i < n; i++)
        f->blk[i].hash = hashes[i];
    pthread_mutex_lock(&r->mu);
    *r->fq_tail = f;
    r->fq_tail = &f->next;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    *out = f;
    return TIER_OK;
}

enum tier_status kv_remote_fetch_start(kv_remote *r, uint64_t ns, const uint64_t *hashes, int n,
                                       kv_remote_fetch **out)
{
    return fetch_start(r, 'p', ns, hashes, n, r->p.block_bytes, out);
}

enum tier_status kv_remote_fetch_seq_start(kv_remote *r, uint64_t ns, uint64_t hash, size_t max_bytes,
                                           kv_remote_fetch **out)
{
    return fetch_start(r, 'x', ns, &hash, 1, max_bytes ? max_bytes : SIZE_MAX, out);
}

int kv_remote_fetch_ready(kv_remote_fetch *f, bool *done)
{
    pthread_mutex_lock(&f->r->mu);
    int n = f->ready;
    *done = f->done;
    pthread_mutex_unlock(&f->r->mu);
    return n;
}

void kv_remote_fetch_wait(kv_remote_fetch *f)
{
    pthread_mutex_lock(&f->r->mu);
    while (!f->done)
        pthread_cond_wait(&f->r->cv, &f->r->mu);
    pthread_mutex_unlock(&f->r->mu);
}

int kv_remote_fetch_found(const kv_remote_fetch *f)
{
    return f->found;
}

void kv_remote_fetch_block(const kv_remote_fetch *f, int i, const void **data, size_t *len)
{
    *data = f->blk[i].data;
    *len = f->blk[i].len;
}

void kv_remote_fetch_free(kv_remote_fetch *f)
{
    if (!f)
        return;
    kv_remote_fetch_wait(f);
    for (int i = 0; i < f->n; i++) {
        reply_free(f->blk[i].rep, f->blk[i].in_arena);
        free(f->blk[i].owned);
    }
    arena_free(f->r, &f->arena);
    free(f);
}

struct kv_remote_stats kv_remote_stats(kv_remote *r)
{
    pthread_mutex_lock(&r->mu);
    struct kv_remote_stats s = r->st;
    pthread_mutex_unlock(&r->mu);
    return s;
}

/* ---- open and close -------------------------------------------------------- */

static char *dup_or_null(const char *s, bool *ok)
{
    char *d = s ? strdup(s) : NULL;
    *ok = *ok && (!s || d);
    return d;
}

/* "host[:port]" into a new node of L; false when it does not parse. */
static bool add_hostport(struct link *L, const char *s, size_t len)
{
    char host[HOST_MAX];
    int port = 6379;
    if (!len || len >= sizeof(host))
        return false;
    memcpy(host, s, len);
    host[len] = '\0';
    char *colon = strrchr(host, ':');
    if (colon) {
        char *end;
        long v = strtol(colon + 1, &end, 10);
        if (*end || end == colon + 1 || v <= 0 || v > 65535)
            return false;
        port = (int)v;
        *colon = '\0';
    }
    return host[0] && node_find(L, host, port) >= 0;
}

static bool parse_addr(kv_remote *r, struct link *L, char err[256])
{
    if (r->cluster) {
        for (const char *s = r->cluster; *s;) {
            size_t len = strcspn(s, ",");
            if (!add_hostport(L, s, len)) {
                snprintf(err, 256, "--remote-cluster: \"%.*s\" is not host:port", (int)len, s);
                return false;
            }
            s += len + (s[len] == ',');
        }
        return true;
    }
    const char *u = r->url;
    if (!strncmp(u, "unix:", 5)) {
        if (!u[5] || strlen(u + 5) >= HOST_MAX || node_find(L, u + 5, 0) < 0) {
            snprintf(err, 256, "--remote: \"%s\" is not unix:PATH", u);
            return false;
        }
        return true;
    }
    if (strncmp(u, "redis://", 8)) {
        snprintf(err, 256, "--remote: \"%s\" is not redis://host[:port][/db] or unix:PATH", u);
        return false;
    }
    const char *hp = u + 8, *slash = strchr(hp, '/');
    size_t len = slash ? (size_t)(slash - hp) : strlen(hp);
    if (memchr(hp, '@', len)) {
        snprintf(err, 256, "--remote: credentials go in --remote-user and --remote-password-file, not the URL");
        return false;
    }
    if (slash && slash[1]) {
        char *end;
        long db = strtol(slash + 1, &end, 10);
        if (*end || db < 0 || db > 1 << 20) {
            snprintf(err, 256, "--remote: database \"%s\" is not a number", slash + 1);
            return false;
        }
        r->db = (int)db;
    }
    if (!add_hostport(L, hp, len)) {
        snprintf(err, 256, "--remote: \"%s\" is not redis://host[:port][/db]", u);
        return false;
    }
    return true;
}

static void link_free(struct link *L)
{
    for (int i = 0; i < L->n_nodes; i++) {
        if (L->nodes[i].c)
            redisFree(L->nodes[i].c);
        free(L->nodes[i].in);
    }
    free(L->nodes);
    free(L->slot);
}

enum tier_status kv_remote_open(const struct kv_remote_params *p, kv_remote **out, char err[256])
{
    *out = NULL;
    err[0] = '\0';
    if (!p->url == !p->cluster) {
        snprintf(err, 256, "the remote tier takes one of --remote and --remote-cluster");
        return TIER_EINVAL;
    }
    kv_remote *r = calloc(1, sizeof(*r));
    if (!r)
        return TIER_ENOMEM_HOST;
    bool ok = true;
    r->p = *p;
    r->url = dup_or_null(p->url, &ok);
    r->cluster = dup_or_null(p->cluster, &ok);
    r->user = dup_or_null(p->user, &ok);
    r->password = dup_or_null(p->password, &ok);
    r->variant = dup_or_null(p->variant ? p->variant : "", &ok);
    r->p.url = r->url;
    r->p.cluster = r->cluster;
    r->p.user = r->user;
    r->p.password = r->password;
    r->p.variant = r->variant;
    r->p.timeout_ms = p->timeout_ms > 0 ? p->timeout_ms : 500;
    r->p.ttl_s = p->ttl_s > 0 ? p->ttl_s : 86400;
    r->p.queue_bytes = p->queue_bytes ? p->queue_bytes : (size_t)64 << 20;
    r->p.block_bytes = p->block_bytes ? p->block_bytes : SIZE_MAX;
    r->is_cluster = p->cluster != NULL;
    const struct kv_disk_layout *l = &p->layout;
    snprintf(r->layout_key, sizeof(r->layout_key), "d%u.b%u.l%u.h%u.k%u.%s", l->dtype, l->block_tokens, l->n_layers,
             l->n_kv_heads, l->head_dim, r->variant ? r->variant : "");
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->fq_tail = &r->fq;
    r->pq_tail = &r->pq;
    r->fl = (struct link){.r = r, .role = "lookups", .stale = true};
    r->pl = (struct link){.r = r, .role = "publishing", .stale = true};
    r->dctx = ok ? ZSTD_createDCtx() : NULL;
    r->cctx = ok && p->compress ? ZSTD_createCCtx() : NULL;
    ok = ok && r->dctx && (!p->compress || r->cctx);
    if (ok && r->is_cluster) {
        r->fl.slot = calloc(N_SLOTS, sizeof(*r->fl.slot));
        r->pl.slot = calloc(N_SLOTS, sizeof(*r->pl.slot));
        ok = r->fl.slot && r->pl.slot;
    }
    enum tier_status st = ok ? TIER_OK : TIER_ENOMEM_HOST;
    if (ok && (!parse_addr(r, &r->fl, err) || !parse_addr(r, &r->pl, err)))
        st = err[0] ? TIER_EINVAL : TIER_ENOMEM_HOST;
    if (st == TIER_OK && !(r->ft_started = pthread_create(&r->ft, NULL, fetch_main, r) == 0))
        st = TIER_ENOMEM_HOST;
    if (st == TIER_OK && !(r->pt_started = pthread_create(&r->pt, NULL, publish_main, r) == 0))
        st = TIER_ENOMEM_HOST;
    if (st != TIER_OK) {
        kv_remote_free(r);
        return st;
    }
    *out = r;
    return TIER_OK;
}

void kv_remote_free(kv_remote *r)
{
    if (!r)
        return;
    pthread_mutex_lock(&r->mu);
    r->stop = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    if (r->ft_started)
        pthread_join(r->ft, NULL);
    if (r->pt_started)
        pthread_join(r->pt, NULL);
    while (r->pq) {
        struct pub *p = r->pq;
        r->pq = p->next;
        free(p->b.buf);
        free(p);
    }
    link_free(&r->fl);
    link_free(&r->pl);
    while (r->spare) {
        struct arena_chunk *c = r->spare;
        r->spare = c->next;
        munmap(c, c->size);
    }
    ZSTD_freeDCtx(r->dctx);
    ZSTD_freeCCtx(r->cctx);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r->url);
    free(r->cluster);
    free(r->user);
    if (r->password)
        memset(r->password, 0, strlen(r->password));
    free(r->password);
    free(r->variant);
    free(r);
}
