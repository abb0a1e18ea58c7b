/* log.h - kvtierd's log: one line per event on stderr (or --log FILE),
 * with the syslog priority prefix journald parses when stderr is the
 * journal ($JOURNAL_STREAM), human timestamps otherwise.  Prompt text is
 * never logged. */
#ifndef KVTIER_DAEMON_LOG_H
#define KVTIER_DAEMON_LOG_H

enum log_level { LOG_ERR = 3, LOG_WARN = 4, LOG_INFO = 6, LOG_DEBUG = 7 };

/* path NULL: stderr.  Returns -errno when the file cannot be opened. */
int log_open(const char *path, enum log_level max_level);
/* SIGHUP: reopen the file (after logrotate moved it). */
int log_reopen(void);
void log_msg(enum log_level lvl, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
