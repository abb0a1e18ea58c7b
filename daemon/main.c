/* kvtierd - the kvtier daemon: loads one model, owns the KV store, and
 * serves local programs over HTTP/1.1 on a Unix socket until SIGTERM.
 * Exit codes (docs/operations.md): 0 clean stop, 1 runtime failure,
 * 2 usage error, 3 model load failure, 4 socket error. */
#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <fcntl.h>
#include <unistd.h>

#include "backend/backend.h"
#include "daemon/engine.h"
#include "util/log.h"
#include "daemon/server.h"
#include "daemon/sock.h"
#include "util/args.h"
#include "util/version.h"
#include "ipc/sockpath.h"

enum { EXIT_USAGE = 2, EXIT_MODEL = 3, EXIT_SOCKET = 4 };

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvtierd [options]\n"
            "  --model DIR|FILE     Hugging Face model directory or GGUF file (default $KVTIER_MODEL, else the built-in model\n"
            "                       beside this binary: ../share/kvtier/builtin, or ../model/builtin in the source tree)\n"
            "  --socket PATH        listen here (default $KVTIER_SOCKET, else $XDG_RUNTIME_DIR/kvtier/kvtierd.sock,\n"
            "                       else /run/user/UID/kvtier/kvtierd.sock, else /run/kvtier/kvtierd.sock for root,\n"
            "                       else /tmp/kvtier-UID/kvtierd.sock)\n"
            "  --print-socket       print the socket path these options give, and exit\n"
            "  --system             default to " IPC_SYSTEM_SOCKET " (system service)\n"
            "  --allow-group NAME   also accept members of this group (socket mode 0660)\n"
            "  --listen HOST:PORT   also serve HTTP over TCP (off by default; a bare PORT is 127.0.0.1)\n"
            "  --api-key-file PATH  the key TCP clients send as Authorization: Bearer KEY (first line;\n"
            "                       required unless HOST is a loopback address)\n"
            "  --api-key KEY        the same on the command line (other local users can see it in ps)\n"
            "  --backend NAME       cpu (default), cpu-strict (tests) or cuda\n"
            "  --threads N          math threads (default: physical cores)\n"
            "  --device-mem BYTES   device memory budget, k/M/G suffixes (default: sized from the model, --parallel, --ctx-size)\n"
            "  --host-mem BYTES     host-tier budget of the KV cache, k/M/G suffixes (default: unlimited)\n"
            "  --no-prefix-cache    do not share the KV of identical prompt prefixes between requests\n"
            "                       (an encoder-decoder model: the cross-attention caches of identical inputs)\n"
            "  --prefix-cache-mem BYTES  blocks only the prefix cache holds, or cross-attention caches only the\n"
            "                       encoder cache holds (default: a quarter of --device-mem)\n"
            "  --share-prefix-cache share cached prefixes across uids (reveals to each user what others sent)\n"
            "  --verify-weights     read every weight at load and refuse NaN or infinity (slower start)\n"
            "  --kv-dtype T         KV cache element type: auto (the model's bf16/f16, else f32), f32, bf16 or f16\n"
            "                       (default auto; sessions on disk load only into the dtype they were saved in)\n"
            "  --weights F          linear layers' weights: auto (as stored), q8_0 or q4_k (quantized at load to\n"
            "                       GGUF's Q8_0 or Q4_K blocks: about 1/2 or 1/4 of the bytes of bf16 per decode\n"
            "                       step; KV saved under one does not load under another)\n"
            "  --ctx-size N         context tokens per sequence (default: the model's)\n"
            "  --parallel N         sequences decoded together (default 32)\n"
            "  --batch-tokens N     tokens per forward step (default 256)\n"
            "  --checkpoint-interval N  state-space models (Mamba): tokens between the state's checkpoints in the\n"
            "                       host tier, which crop and session reuse go back to (default 256)\n"
            "  --max-queue N        requests waiting for a slot before 429 (default 256)\n"
            "  --max-clients N      open connections before 503 (default 256; 8 more for /health and /metrics)\n"
            "  --max-clients-per-uid N  open connections of one uid, and of --listen's together (default: 7/8 of\n"
            "                       --max-clients)\n"
            "  --max-clients-per-pid N  open connections of one process (default: 1/4 of --max-clients)\n"
            "  --header-timeout S   a request head must arrive within S seconds of its first byte (default 10)\n"
            "  --body-rate BYTES    bytes per second a body must average after that grace (default 16k)\n"
            "  --max-body BYTES     request body limit before 413 (default 4M)\n"
            "  --max-output BYTES   text queued for a slow stream reader (default 1M)\n"
            "  --max-sessions N     sessions before 429 (default 64)\n"
            "  --disk-dir DIR       the disk tier: spilled and persisted sessions (default $KVTIER_DISK_DIR, else\n"
            "                       $XDG_STATE_HOME/kvtier or ~/.local/state/kvtier; /var/lib/kvtier with --system;\n"
            "                       \"none\": sessions live in memory only)\n"
            "  --disk-mem BYTES     bytes the disk tier may take (default: a quarter of the free space)\n"
            "  --spill-after S      idle sessions go to disk after S seconds (default 600)\n"
            "  --session-ttl S      a session idle S seconds goes to disk, or is dropped without a disk tier\n"
            "                       (default 3600; 0: never)\n"
            "  --disk-compress M    auto (idle spills compressed, others raw), always or never (default auto)\n"
            "  --prefix-exit-seconds S  at exit, write prefix-cache blocks to the disk tier for at most S seconds;\n"
            "                       the rest are dropped (default 20; 0: none)\n"
            "  --remote URL         share prefix-cache blocks through Redis: redis://host[:port][/db] or unix:PATH\n"
            "  --remote-cluster H:P,...  the same through a Redis Cluster, from these seed nodes\n"
            "  --remote-user NAME   Redis ACL user;  --remote-password-file FILE: AUTH with its first line\n"
            "  --remote-timeout MS  bound of every Redis connect, read, write and reply (default 500)\n"
            "  --remote-ttl S       expiry of published blocks, renewed on each hit (default 86400)\n"
            "  --remote-share M     all (every prompt block), prefix-only (a chat's blocks before its first\n"
            "                       user message, a completion's before its shared_prefix) or off (read only)\n"
            "                       (default all)\n"
            "  --remote-compress M  zstd (published values compressed) or none (default none)\n"
            "  --drain-timeout S    SIGTERM: seconds in-flight requests may finish (default 30)\n"
            "  --idle-timeout S     close idle connections after S seconds (default 300)\n"
            "  --stall-timeout S    /health says stalled when work waits and no step completes for S s (default 120)\n"
            "  --log FILE           log here instead of stderr (reopened on SIGHUP)\n"
            "  --verbose            debug log lines\n"
            "  --version\n"
            "  --help\n");
}

/* The first line of path (without its newline): a password kept out of
 * the command line, where every user could read it. */
static bool read_password(const char *path, char *out, size_t cap)
{
    FILE *f = fopen(path, "r");
    bool ok = f && fgets(out, (int)cap, f);
    if (f)
        fclose(f);
    if (!ok) {
        fprintf(stderr, "kvtierd: --remote-password-file %s: cannot read it\n", path);
        return false;
    }
    out[strcspn(out, "\r\n")] = '\0';
    return out[0] != '\0';
}

/* Where sessions persist unless --disk-dir says: the XDG state directory
 * of the user, /var/lib for the system service; NULL when none is known. */
static const char *default_disk_dir(bool system, char *buf, size_t cap)
{
    const char *env = getenv("KVTIER_DISK_DIR"), *xdg = getenv("XDG_STATE_HOME"), *home = getenv("HOME");
    int n;
    if (env && *env)
        n = snprintf(buf, cap, "%s", env);
    else if (system)
        n = snprintf(buf, cap, "/var/lib/kvtier");
    else if (xdg && *xdg == '/')
        n = snprintf(buf, cap, "%s/kvtier", xdg);
    else if (home && *home == '/')
        n = snprintf(buf, cap, "%s/.local/state/kvtier", home);
    else
        return NULL;
    return n > 0 && (size_t)n < cap ? buf : NULL;
}

/* The built-in model, found from the binary's own path so the daemon starts
 * from any directory: installed as PREFIX/bin/kvtierd with the model in
 * PREFIX/share/kvtier/builtin, or built in the source tree as build/kvtierd
 * (build/asan/kvtierd) beside model/builtin.  Without one that exists, the
 * first candidate, so the load error names where it was looked for. */
static const char *default_model_dir(char *buf, size_t cap)
{
    static const char *const rel[] = {"../share/kvtier/builtin", "../model/builtin", "../../model/builtin"};
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0)
        return "model/builtin";
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (!slash)
        return "model/builtin";
    *slash = '\0';
    static const char cfg[] = "/config.json";
    for (size_t i = 0; i < sizeof(rel) / sizeof(rel[0]); i++) {
        int k = snprintf(buf, cap, "%s/%s%s", exe, rel[i], cfg);
        if (k > 0 && (size_t)k < cap && access(buf, R_OK) == 0) {
            buf[(size_t)k - strlen(cfg)] = '\0';
            char real[PATH_MAX]; /* the log names the model without "bin/.." */
            if (realpath(buf, real) && strlen(real) < cap)
                memcpy(buf, real, strlen(real) + 1);
            return buf;
        }
    }
    int k = snprintf(buf, cap, "%s/%s%s", exe, rel[0], cfg);
    if (k <= 0 || (size_t)k >= cap)
        return "model/builtin";
    buf[(size_t)k - strlen(cfg)] = '\0';
    return buf;
}

static int sig_write_fd = -1;

static void on_signal(int sig)
{
    int saved = errno;
    unsigned char b = (unsigned char)sig;
    /* a full pipe already holds enough wake-ups */
    if (write(sig_write_fd, &b, 1) < 0)
        (void)0;
    errno = saved;
}

int main(int argc, char **argv)
{
    const char *env_model = getenv("KVTIER_MODEL");
    struct engine_config ec = {.model_dir = env_model && *env_model ? env_model : NULL, .backend = "cpu",
                               .max_seqs = 32, .batch_tokens = 256, .max_queue = 256, .max_sessions = 64,
                               .spill_after_s = 600, .session_ttl_s = 3600, .prefix_exit_s = 20,
                               .remote_timeout_ms = 500, .remote_ttl_s = 86400};
    static char password[1024];
    struct server_config sc = {.max_clients = 256, .max_body = 4u << 20, .max_output = 1u << 20, .max_n = SERVER_MAX_N,
                               .max_messages = 1024, .drain_timeout_s = 30, .idle_timeout_s = 300,
                               .header_timeout_s = 10, .body_rate = 16u << 10, .stall_timeout_s = 120,
                               .allow_gid = (gid_t)-1};
    const char *sock_flag = NULL, *log_path = NULL, *group = NULL, *disk_dir = NULL;
    const char *listen_flag = NULL, *key_file = NULL;
    static char key_buf[512];
    bool system = false, verbose = false, print_socket = false;
    enum {
        O_MODEL = 256, O_SOCKET, O_SYSTEM, O_GROUP, O_BACKEND, O_THREADS, O_DEVMEM, O_HOSTMEM, O_NOPREFIX, O_PREFIXMEM, O_SHAREPREFIX, O_VERIFY, O_CTX, O_PARALLEL, O_BATCH, O_CKPT,
        O_QUEUE, O_CLIENTS, O_PER_UID, O_PER_PID, O_HEADER, O_RATE, O_STALL, O_BODY, O_OUTPUT, O_SESSIONS, O_DRAIN, O_IDLE, O_LOG, O_VERBOSE, O_HELP,
        O_DISKDIR, O_DISKMEM, O_SPILL, O_COMPRESS, O_KVDTYPE, O_WEIGHTS, O_LISTEN, O_APIKEY, O_KEYFILE,
        O_SESSIONTTL, O_VERSION, O_PRINTSOCK, O_PREFIXEXIT,
        O_REMOTE, O_RCLUSTER, O_RUSER, O_RPASS, O_RTIMEOUT, O_RTTL, O_RSHARE, O_RCOMPRESS
    };
    static const struct option opts[] = {
        {"model", required_argument, 0, O_MODEL}, {"socket", required_argument, 0, O_SOCKET},
        {"system", no_argument, 0, O_SYSTEM}, {"allow-group", required_argument, 0, O_GROUP},
        {"backend", required_argument, 0, O_BACKEND}, {"threads", required_argument, 0, O_THREADS},
        {"device-mem", required_argument, 0, O_DEVMEM}, {"host-mem", required_argument, 0, O_HOSTMEM},
        {"no-prefix-cache", no_argument, 0, O_NOPREFIX}, {"verify-weights", no_argument, 0, O_VERIFY},
        {"prefix-cache-mem", required_argument, 0, O_PREFIXMEM}, {"share-prefix-cache", no_argument, 0, O_SHAREPREFIX},
        {"ctx-size", required_argument, 0, O_CTX},
        {"parallel", required_argument, 0, O_PARALLEL}, {"batch-tokens", required_argument, 0, O_BATCH},
        {"checkpoint-interval", required_argument, 0, O_CKPT},
        {"max-queue", required_argument, 0, O_QUEUE}, {"max-clients", required_argument, 0, O_CLIENTS},
        {"max-clients-per-uid", required_argument, 0, O_PER_UID}, {"max-clients-per-pid", required_argument, 0, O_PER_PID},
        {"header-timeout", required_argument, 0, O_HEADER}, {"body-rate", required_argument, 0, O_RATE},
        {"stall-timeout", required_argument, 0, O_STALL},
        {"max-body", required_argument, 0, O_BODY}, {"max-output", required_argument, 0, O_OUTPUT},
        {"max-sessions", required_argument, 0, O_SESSIONS}, {"drain-timeout", required_argument, 0, O_DRAIN},
        {"idle-timeout", required_argument, 0, O_IDLE}, {"log", required_argument, 0, O_LOG},
        {"verbose", no_argument, 0, O_VERBOSE}, {"help", no_argument, 0, O_HELP},
        {"disk-dir", required_argument, 0, O_DISKDIR}, {"disk-mem", required_argument, 0, O_DISKMEM},
        {"spill-after", required_argument, 0, O_SPILL}, {"disk-compress", required_argument, 0, O_COMPRESS},
        {"kv-dtype", required_argument, 0, O_KVDTYPE}, {"weights", required_argument, 0, O_WEIGHTS},
        {"listen", required_argument, 0, O_LISTEN}, {"api-key", required_argument, 0, O_APIKEY},
        {"api-key-file", required_argument, 0, O_KEYFILE},
        {"session-ttl", required_argument, 0, O_SESSIONTTL}, {"prefix-exit-seconds", required_argument, 0, O_PREFIXEXIT},
        {"version", no_argument, 0, O_VERSION}, {"print-socket", no_argument, 0, O_PRINTSOCK},
        {"remote", required_argument, 0, O_REMOTE}, {"remote-cluster", required_argument, 0, O_RCLUSTER},
        {"remote-user", required_argument, 0, O_RUSER}, {"remote-password-file", required_argument, 0, O_RPASS},
        {"remote-timeout", required_argument, 0, O_RTIMEOUT}, {"remote-ttl", required_argument, 0, O_RTTL},
        {"remote-share", required_argument, 0, O_RSHARE}, {"remote-compress", required_argument, 0, O_RCOMPRESS},
        {0, 0, 0, 0}};
    int c;
    bool ok = true;
    while (ok && (c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case O_MODEL: ec.model_dir = optarg; break;
        case O_REMOTE: ec.remote_url = optarg; break;
        case O_RCLUSTER: ec.remote_cluster = optarg; break;
        case O_RUSER: ec.remote_user = optarg; break;
        case O_RPASS: ok = read_password(optarg, password, sizeof(password)); ec.remote_password = password; break;
        case O_RTIMEOUT: ok = args_int(optarg, 1, 600000, &ec.remote_timeout_ms); break;
        case O_RTTL: ok = args_int(optarg, 1, 1 << 30, &ec.remote_ttl_s); break;
        case O_RSHARE:
            ok = !strcmp(optarg, "all") || !strcmp(optarg, "prefix-only") || !strcmp(optarg, "off");
            ec.remote_share = !strcmp(optarg, "off") ? REMOTE_SHARE_OFF
                              : !strcmp(optarg, "prefix-only") ? REMOTE_SHARE_PREFIX_ONLY : REMOTE_SHARE_ALL;
            break;
        case O_RCOMPRESS:
            ok = !strcmp(optarg, "zstd") || !strcmp(optarg, "none");
            ec.remote_compress = !strcmp(optarg, "zstd");
            break;
        case O_DISKDIR: disk_dir = optarg; break;
        case O_DISKMEM: ok = args_size(optarg, &ec.disk_mem) && ec.disk_mem > 0; break;
        case O_SPILL: ok = args_int(optarg, 0, 1 << 30, &ec.spill_after_s); break;
        case O_SESSIONTTL: ok = args_int(optarg, 0, 1 << 30, &ec.session_ttl_s); break;
        case O_PREFIXEXIT: ok = args_int(optarg, 0, 86400, &ec.prefix_exit_s); break;
        case O_COMPRESS:
            ok = !strcmp(optarg, "auto") || !strcmp(optarg, "always") || !strcmp(optarg, "never");
            ec.disk_compress = !strcmp(optarg, "always") ? KV_DISK_COMPRESS_ALWAYS
                               : !strcmp(optarg, "never") ? KV_DISK_COMPRESS_NEVER : KV_DISK_COMPRESS_AUTO;
            break;
        case O_SOCKET: sock_flag = optarg; break;
        case O_LISTEN: listen_flag = optarg; break;
        case O_APIKEY: ok = *optarg != '\0'; sc.api_key = optarg; break;
        case O_KEYFILE: key_file = optarg; break;
        case O_SYSTEM: system = true; break;
        case O_GROUP: group = optarg; break;
        case O_BACKEND: ec.backend = optarg; break;
        case O_THREADS: ok = args_int(optarg, 0, 1024, &ec.n_threads); break;
        case O_DEVMEM: ok = args_size(optarg, &ec.device_mem); break;
        case O_HOSTMEM: ok = args_size(optarg, &ec.host_mem); break;
        case O_NOPREFIX: ec.no_prefix_cache = true; break;
        case O_VERIFY: ec.verify_weights = true; break;
        case O_KVDTYPE: ok = model_kv_dtype_parse(optarg, &ec.kv_dtype); break;
        case O_WEIGHTS: ok = model_weights_parse(optarg, &ec.weights); break;
        case O_PREFIXMEM: ok = args_size(optarg, &ec.prefix_mem) && ec.prefix_mem > 0; break;
        case O_SHAREPREFIX: ec.share_prefix_cache = true; break;
        case O_CTX: ok = args_int(optarg, 16, 1 << 24, &ec.ctx); break;
        case O_PARALLEL: ok = args_int(optarg, 1, 1024, &ec.max_seqs); break;
        case O_BATCH: ok = args_int(optarg, 16, 65536, &ec.batch_tokens); break;
        case O_CKPT: ok = args_int(optarg, 1, 1 << 24, &ec.checkpoint_interval); break;
        case O_QUEUE: ok = args_int(optarg, 1, 1 << 20, &ec.max_queue); break; /* 0 would refuse every request: each one queues first */
        case O_CLIENTS: ok = args_int(optarg, 1, 1 << 16, &sc.max_clients); break;
        case O_PER_UID: ok = args_int(optarg, 1, 1 << 16, &sc.max_per_uid); break;
        case O_PER_PID: ok = args_int(optarg, 1, 1 << 16, &sc.max_per_pid); break;
        case O_HEADER: ok = args_int(optarg, 1, 86400, &sc.header_timeout_s); break;
        case O_RATE: ok = args_size(optarg, &sc.body_rate); break;
        case O_STALL: ok = args_int(optarg, 1, 86400, &sc.stall_timeout_s); break;
        case O_BODY: ok = args_size(optarg, &sc.max_body) && sc.max_body > 0; break;
        case O_OUTPUT: ok = args_size(optarg, &sc.max_output); break;
        case O_SESSIONS: ok = args_int(optarg, 0, 1 << 20, &ec.max_sessions); break;
        case O_DRAIN: ok = args_int(optarg, 0, 86400, &sc.drain_timeout_s); break;
        case O_IDLE: ok = args_int(optarg, 1, 86400, &sc.idle_timeout_s); break;
        case O_LOG: log_path = optarg; break;
        case O_VERBOSE: verbose = true; break;
        case O_HELP: usage(stdout); return 0;
        case O_VERSION: printf("kvtierd %s\n", kvtier_version()); return 0;
        case O_PRINTSOCK: print_socket = true; break;
        default: ok = false;
        }
        if (!ok && c >= O_MODEL)
            args_invalid("kvtierd", opts, c, optarg);
    }
    if (ok && ec.remote_url && ec.remote_cluster) {
        fprintf(stderr, "kvtierd: --remote and --remote-cluster exclude each other\n");
        ok = false;
    }
    if (!ok || optind != argc) {
        usage(stderr);
        return EXIT_USAGE;
    }
    char path[256];
    if (print_socket) {
        struct ipc_error ie;
        if (ipc_socket_path(sock_flag, system, path, sizeof(path), &ie) != IPC_OK) {
            fprintf(stderr, "kvtierd: %s\n", ie.msg);
            return EXIT_SOCKET;
        }
        printf("%s\n", path);
        return 0;
    }
    char model_buf[PATH_MAX];
    if (!ec.model_dir)
        ec.model_dir = default_model_dir(model_buf, sizeof(model_buf));
    /* below --max-clients, so that one user or one process cannot take every slot */
    if (!sc.max_per_uid)
        sc.max_per_uid = sc.max_clients > 1 ? sc.max_clients - (sc.max_clients + 7) / 8 : 1;
    if (!sc.max_per_pid)
        sc.max_per_pid = sc.max_clients >= 4 ? sc.max_clients / 4 : 1;
    if (sc.max_n > ec.max_seqs)
        sc.max_n = ec.max_seqs;
    if (group) {
        struct group *gr = getgrnam(group);
        if (!gr) {
            fprintf(stderr, "kvtierd: no group \"%s\"\n", group);
            return EXIT_USAGE;
        }
        sc.allow_gid = gr->gr_gid;
    }
    if (sc.api_key && key_file) {
        fprintf(stderr, "kvtierd: give one of --api-key and --api-key-file\n");
        return EXIT_USAGE;
    }
    if ((sc.api_key || key_file) && !listen_flag) {
        fprintf(stderr, "kvtierd: an API key is for --listen's TCP clients; the Unix socket checks peer credentials\n");
        return EXIT_USAGE;
    }
    if (key_file) {
        char kerr[512];
        if (sock_read_key(key_file, key_buf, sizeof(key_buf), kerr, sizeof(kerr)) != 0) {
            fprintf(stderr, "kvtierd: %s\n", kerr);
            return EXIT_USAGE;
        }
        sc.api_key = key_buf;
    }
    char disk_buf[PATH_MAX];
    if (!disk_dir || !*disk_dir)
        disk_dir = default_disk_dir(system, disk_buf, sizeof(disk_buf));
    ec.disk_dir = disk_dir && strcmp(disk_dir, "none") != 0 ? disk_dir : NULL;
    int rc = log_open(log_path, verbose ? LOG_DEBUG : LOG_INFO);
    if (rc) {
        fprintf(stderr, "kvtierd: cannot open the log %s: %s\n", log_path, strerror(-rc));
        return EXIT_FAILURE;
    }
    /* A backend that cannot open (no GPU, no driver, no plugin) is known
     * before the socket is taken: one clear line and the model's exit code,
     * not a daemon that listens and then fails its load. */
    if (strcmp(ec.backend, "cpu") != 0) {
        be_backend *probe;
        enum be_status bs = be_open(ec.backend, &(struct be_params){.device_mem = BE_ALIGN}, &probe);
        if (bs != BE_OK) {
            log_msg(LOG_ERR, "--backend %s: %s", ec.backend, *be_open_error() ? be_open_error() : be_strerror(bs));
            return EXIT_MODEL;
        }
        be_free(probe);
    }

    /* Signals reach the loop through a pipe written by the handler: libraries
     * start threads before main (OpenBLAS), so blocking them for a
     * signalfd would leave a thread where SIGTERM still kills. */
    int sig_pipe[2];
    int wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (pipe2(sig_pipe, O_NONBLOCK | O_CLOEXEC) != 0 || wake_fd < 0) {
        log_msg(LOG_ERR, "pipe/eventfd: %s", strerror(errno));
        return EXIT_FAILURE;
    }
    sig_write_fd = sig_pipe[1];
    struct sigaction sa = {.sa_handler = on_signal, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    signal(SIGPIPE, SIG_IGN);
    if (sigaction(SIGTERM, &sa, NULL) || sigaction(SIGINT, &sa, NULL) || sigaction(SIGHUP, &sa, NULL)) {
        log_msg(LOG_ERR, "sigaction: %s", strerror(errno));
        return EXIT_FAILURE;
    }
    int sig_fd = sig_pipe[0];

    char err[512];
    int listen_fd = sock_activated(err, sizeof(err));
    sc.socket_activated = listen_fd >= 0;
    if (listen_fd == -1) {
        struct ipc_error ie;
        if (ipc_socket_path(sock_flag, system, path, sizeof(path), &ie) != IPC_OK) {
            log_msg(LOG_ERR, "%s", ie.msg);
            return EXIT_SOCKET;
        }
        listen_fd = sock_listen(path, sc.allow_gid, sc.max_clients + HEALTH_RESERVE, err, sizeof(err));
        sc.sock_path = path;
    }
    if (listen_fd < 0) {
        log_msg(LOG_ERR, "%s", err);
        return EXIT_SOCKET;
    }
    sc.tcp_fd = -1;
    if (listen_flag) {
        bool loopback = false;
        sc.tcp_fd = sock_listen_tcp(listen_flag, sc.max_clients + HEALTH_RESERVE, &loopback, err, sizeof(err));
        if (sc.tcp_fd < 0)
            log_msg(LOG_ERR, "%s", err);
        /* off the loopback, anyone who can route a packet here is a client:
         * the peer-credential checks of the Unix socket do not exist there */
        else if (!loopback && !sc.api_key)
            log_msg(LOG_ERR, "--listen %s is not a loopback address: it needs --api-key-file (or --api-key), "
                    "since TCP has no peer credentials to check", listen_flag);
        if (sc.tcp_fd < 0 || (!loopback && !sc.api_key)) {
            if (sc.tcp_fd >= 0)
                close(sc.tcp_fd);
            close(listen_fd);
            if (!sc.socket_activated)
                unlink(path);
            return sc.tcp_fd < 0 ? EXIT_SOCKET : EXIT_USAGE;
        }
        log_msg(loopback && !sc.api_key ? LOG_WARN : LOG_INFO, "listening on TCP %s%s", listen_flag,
                sc.api_key ? " (API key required)" : ": no API key, every local user may use it as this uid");
    }
    log_msg(LOG_INFO, "listening on %s; loading %s", sc.socket_activated ? "the socket systemd passed" : path,
            ec.model_dir);
    sd_notify_msg("STATUS=Loading model");

    engine *e;
    struct ipc_error ie;
    if (engine_create(&ec, wake_fd, &e, &ie) != IPC_OK) {
        log_msg(LOG_ERR, "%s", ie.msg);
        return EXIT_FAILURE;
    }
    enum server_exit se = server_run(e, &sc, listen_fd, sig_fd, wake_fd);
    engine_free(e);
    close(sig_pipe[0]);
    close(sig_pipe[1]);
    close(wake_fd);
    log_msg(se == SERVER_OK ? LOG_INFO : LOG_ERR, "kvtierd exits (%d)", (int)se);
    return se == SERVER_ELOAD ? EXIT_MODEL : se == SERVER_OK ? 0 : EXIT_FAILURE;
}
