/* file.h - opening the files of a model directory without blocking. */
#ifndef KVTIER_UTIL_FILE_H
#define KVTIER_UTIL_FILE_H

#include <sys/stat.h>

#define FILE_NOT_REGULAR (-2)

/* Opens path read-only with O_NONBLOCK, so that a FIFO or a device put in
 * a model directory fails here instead of hanging the loader in open() or
 * read(), and requires a regular file.  Returns the descriptor (close on
 * exec) with *sb filled; -1 with errno set when open or fstat fails;
 * FILE_NOT_REGULAR when it is something else (nothing stays open). */
int file_open_regular(const char *path, struct stat *sb);

#endif
