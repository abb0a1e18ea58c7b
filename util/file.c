#include "util/file.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

int file_open_regular(const char *path, struct stat *sb)
{
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return -1;
    if (fstat(fd, sb) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    if (!S_ISREG(sb->st_mode)) {
        close(fd);
        return FILE_NOT_REGULAR;
    }
    return fd;
}
