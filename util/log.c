#include "util/log.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static struct {
    pthread_mutex_t mu;
    const char *path;
    enum log_level max;
    int journal; /* stderr is journald: priority prefixes, no timestamps */
} lg = {PTHREAD_MUTEX_INITIALIZER, NULL, LOG_INFO, 0};

/* The log file replaces stderr, so anything a library prints lands there too. */
static int open_onto_stderr(const char *path)
{
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
    if (fd < 0)
        return -errno;
    int rc = dup2(fd, STDERR_FILENO) < 0 ? -errno : 0;
    close(fd);
    return rc;
}

int log_open(const char *path, enum log_level max_level)
{
    lg.path = path;
    lg.max = max_level;
    lg.journal = !path && getenv("JOURNAL_STREAM") != NULL;
    return path ? open_onto_stderr(path) : 0;
}

int log_reopen(void)
{
    return lg.path ? open_onto_stderr(lg.path) : 0;
}

void log_msg(enum log_level lvl, const char *fmt, ...)
{
    if (lvl > lg.max)
        return;
    static const char *names[] = {[LOG_ERR] = "error", [LOG_WARN] = "warning", [LOG_INFO] = "info",
                                  [LOG_DEBUG] = "debug"};
    char line[1024];
    int n;
    if (lg.journal) {
        n = snprintf(line, sizeof(line), "<%d>", (int)lvl);
    } else {
        struct timespec ts;
        struct tm tm;
        clock_gettime(CLOCK_REALTIME, &ts);
        localtime_r(&ts.tv_sec, &tm);
        n = (int)strftime(line, sizeof(line), "%Y-%m-%d %H:%M:%S", &tm);
        n += snprintf(line + n, sizeof(line) - (size_t)n, ".%03ld kvtierd %s: ", ts.tv_nsec / 1000000L,
                      names[lvl] ? names[lvl] : "log");
    }
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
    va_end(ap);
    n = m < 0 ? n : n + m < (int)sizeof(line) - 1 ? n + m : (int)sizeof(line) - 2;
    line[n++] = '\n';
    /* one write per line keeps lines whole between threads */
    pthread_mutex_lock(&lg.mu);
    ssize_t w = write(STDERR_FILENO, line, (size_t)n);
    pthread_mutex_unlock(&lg.mu);
    (void)w;
}
