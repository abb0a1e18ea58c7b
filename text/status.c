#include "text/status.h"

#include <stdarg.h>
#include <stdio.h>

const char *text_strerror(enum text_status st)
{
    switch (st) {
    case TEXT_OK: return "ok";
    case TEXT_ENOENT: return "required file missing";
    case TEXT_EFORMAT: return "malformed file";
    case TEXT_EUNSUPPORTED: return "not supported";
    case TEXT_ENOMEM: return "out of host memory";
    case TEXT_EIO: return "I/O error";
    case TEXT_EINVAL: return "invalid input";
    }
    return "unknown text status";
}

enum text_status text_errf(char *err, enum text_status st, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, TEXT_ERR_LEN, fmt, ap);
        va_end(ap);
    }
    return st;
}

enum text_status text_path(char path[PATH_MAX], const char *dir, const char *name, char *err)
{
    int n = snprintf(path, PATH_MAX, "%s/%s", dir, name);
    if (n < 0 || n >= PATH_MAX)
        return text_errf(err, TEXT_EINVAL, "%s/%s: path too long", dir, name);
    return TEXT_OK;
}
