#include "daemon/sock.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pwd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "util/args.h"
#include "util/log.h"

static int fail(char *err, size_t cap, int fd, const char *fmt, const char *path)
{
    int e = errno;
    snprintf(err, cap, fmt, path, strerror(e));
    if (fd >= 0)
        close(fd);
    return -1;
}

/* The parent must exist (created here when missing), belong to us or to
 * root, and be writable by no one but its owner: the socket's own mode is
 * not a reliable guard everywhere, and in a directory someone else made
 * (a /tmp fallback) that someone could swap the socket. */
static int check_dir(const char *path, gid_t gid, char *err, size_t cap)
{
    char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
    snprintf(dir, sizeof(dir), "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash)
        snprintf(dir, sizeof(dir), ".");
    else if (slash == dir)
        slash[1] = '\0';
    else
        *slash = '\0';
    mode_t mode = gid != (gid_t)-1 ? 0750 : 0700;
    if (mkdir(dir, mode) == 0) {
        if (gid != (gid_t)-1 && chown(dir, (uid_t)-1, gid) != 0)
            return fail(err, cap, -1, "cannot give %s to the allowed group: %s", dir);
    } else if (errno != EEXIST) {
        return fail(err, cap, -1, "cannot create the socket directory %s: %s", dir);
    }
    struct stat st;
    if (stat(dir, &st) != 0)
        return fail(err, cap, -1, "cannot stat %s: %s", dir);
    if (!S_ISDIR(st.st_mode) || (st.st_mode & S_IWOTH && !(st.st_mode & S_ISVTX))) {
        snprintf(err, cap, "%s is not a directory only its owner can write to", dir);
        return -1;
    }
    if (st.st_uid != geteuid() && st.st_uid != 0) {
        snprintf(err, cap, "%s belongs to uid %u, neither us (%u) nor root", dir, (unsigned)st.st_uid,
                 (unsigned)geteuid());
        return -1;
    }
    return 0;
}

int sock_listen(const char *path, gid_t gid, int backlog, char *err, size_t cap)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path)) {
        snprintf(err, cap, "socket path %s is longer than the %zu bytes a Unix socket path holds", path,
                 sizeof(sa.sun_path) - 1);
        return -1;
    }
    memcpy(sa.sun_path, path, strlen(path) + 1);
    if (check_dir(path, gid, err, cap) != 0)
        return -1;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return fail(err, cap, -1, "socket() for %s: %s", path);
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode)) {
            snprintf(err, cap, "%s exists and is not a socket", path);
            close(fd);
            return -1;
        }
        int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        int rc = probe < 0 ? -1 : connect(probe, (struct sockaddr *)&sa, sizeof(sa));
        int e = errno;
        if (probe >= 0)
            close(probe);
        if (rc == 0) {
            snprintf(err, cap, "another kvtierd is listening on %s", path);
            close(fd);
            return -1;
        }
        if (e != ECONNREFUSED) {
            errno = e;
            return fail(err, cap, fd, "cannot probe the existing socket %s: %s", path);
        }
        if (unlink(path) != 0)
            return fail(err, cap, fd, "cannot remove the stale socket %s: %s", path);
        log_msg(LOG_INFO, "removed stale socket %s", path);
    }
    /* the mode is right from the start: no window with a wider one */
    mode_t old = umask(gid != (gid_t)-1 ? 0117 : 0177);
    int rc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
    umask(old);
    if (rc != 0)
        return fail(err, cap, fd, "cannot bind %s: %s", path);
    if (gid != (gid_t)-1 && chown(path, (uid_t)-1, gid) != 0)
        return fail(err, cap, fd, "cannot give %s to the allowed group: %s", path);
    if (listen(fd, backlog) != 0)
        return fail(err, cap, fd, "cannot listen on %s: %s", path);
    return fd;
}

static bool is_loopback(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(a) || (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127);
}

int sock_listen_tcp(const char *hostport, int backlog, bool *loopback, char *err, size_t cap)
{
    char host[256];
    const char *port = strrchr(hostport, ':');
    if (!port) { /* a port alone */
        snprintf(host, sizeof(host), "127.0.0.1");
        port = hostport;
    } else {
        size_t hl = (size_t)(port - hostport);
        port++;
        if (hl >= 2 && hostport[0] == '[' && hostport[hl - 1] == ']') {
            hostport++;
            hl -= 2;
        }
        if (hl >= sizeof(host)) {
            snprintf(err, cap, "--listen %.64s: the host is too long", hostport);
            return -1;
        }
        memcpy(host, hostport, hl);
        host[hl] = '\0';
        if (!hl)
            snprintf(host, sizeof(host), "127.0.0.1");
    }
    char *end;
    long pn = strtol(port, &end, 10);
    if (!*port || *end || pn < 1 || pn > 65535) {
        snprintf(err, cap, "--listen %.64s: the port must be a number from 1 to 65535", port);
        return -1;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    int gai = getaddrinfo(host, port, &hints, &ai);
    if (gai != 0) {
        snprintf(err, cap, "--listen: cannot resolve %.128s: %s", host, gai_strerror(gai));
        return -1;
    }
    /* the first address only: a name that also resolves elsewhere is bound
     * where the resolver says first, and the log names it */
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    *loopback = is_loopback(ai->ai_addr);
    if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0 ||
        bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, backlog) != 0) {
        int e = errno;
        snprintf(err, cap, "cannot listen on %.128s port %s: %s", host, port, strerror(e));
        if (fd >= 0)
            close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    return fd;
}

int sock_read_key(const char *path, char *key, size_t cap, char *err, size_t errcap)
{
    FILE *f = fopen(path, "re");
    if (!f)
        return fail(err, errcap, -1, "cannot open the API key file %s: %s", path);
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || (st.st_mode & 0007)) {
        fclose(f);
        snprintf(err, errcap, "the API key file %s must not be readable by others (chmod 600)", path);
        return -1;
    }
    bool got = fgets(key, (int)cap, f) != NULL;
    fclose(f);
    size_t n = got ? strcspn(key, "\r\n") : 0;
    if (got && !key[n] && n == cap - 1) {
        snprintf(err, errcap, "the API key in %s is longer than %zu bytes", path, cap - 2);
        return -1;
    }
    if (got)
        key[n] = '\0';
    if (!n) {
        snprintf(err, errcap, "the API key file %s is empty", path);
        return -1;
    }
    return 0;
}

bool sock_bearer_ok(const char *header, const char *key)
{
    if (!header || strncasecmp(header, "Bearer ", 7) != 0)
        return false;
    const char *got = header + 7;
    size_t gl = strlen(got), kl = strlen(key);
    unsigned char diff = gl != kl;
    /* every byte of the key is compared whatever the header holds */
    for (size_t i = 0; i < kl; i++)
        diff |= (unsigned char)((i < gl ? got[i] : 0) ^ key[i]);
    return !diff;
}

int sock_activated(char *err, size_t cap)
{
    const char *pid = getenv("LISTEN_PID"), *fds = getenv("LISTEN_FDS");
    uint64_t p;
    int n;
    if (!pid || !fds || !args_u64(pid, &p) || p != (uint64_t)getpid() || !args_int(fds, 1, 1 << 16, &n))
        return -1;
    unsetenv("LISTEN_PID");
    unsetenv("LISTEN_FDS");
    unsetenv("LISTEN_FDNAMES");
    int fd = 3; /* SD_LISTEN_FDS_START; only the first socket is used */
    int type = 0;
    socklen_t tl = sizeof(type);
    struct sockaddr_un sa;
    socklen_t sl = sizeof(sa);
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 || type != SOCK_STREAM ||
        getsockname(fd, (struct sockaddr *)&sa, &sl) != 0 || sa.sun_family != AF_UNIX) {
        snprintf(err, cap, "the socket systemd passed (fd 3) is not a Unix stream socket");
        return -2;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) {
        snprintf(err, cap, "cannot configure the passed socket: %s", strerror(errno));
        return -2;
    }
    return fd;
}

bool sock_peer_allowed(uid_t uid, gid_t peer_gid, gid_t allow_gid)
{
    if (uid == geteuid())
        return true;
    if (allow_gid == (gid_t)-1)
        return false;
    if (peer_gid == allow_gid)
        return true;
    char buf[4096];
    struct passwd pw, *res = NULL;
    if (getpwuid_r(uid, &pw, buf, sizeof(buf), &res) != 0 || !res)
        return false;
    gid_t groups[256];
    int n = 256;
    if (getgrouplist(pw.pw_name, pw.pw_gid, groups, &n) < 0)
        return false;
    for (int i = 0; i < n; i++)
        if (groups[i] == allow_gid)
            return true;
    return false;
}

void sd_notify_msg(const char *msg)
{
    const char *path = getenv("NOTIFY_SOCKET");
    if (!path || !*path)
        return;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    size_t len = strlen(path);
    if (len >= sizeof(sa.sun_path))
        return;
    memcpy(sa.sun_path, path, len);
    if (sa.sun_path[0] == '@') /* systemd's notation for its abstract socket */
        sa.sun_path[0] = '\0';
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return;
    socklen_t sl = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len);
    if (sendto(fd, msg, strlen(msg), MSG_NOSIGNAL, (struct sockaddr *)&sa, sl) < 0)
        log_msg(LOG_WARN, "sd_notify to %s failed: %s", path, strerror(errno));
    close(fd);
}
