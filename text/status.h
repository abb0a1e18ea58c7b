/* status.h - the errors of the text layer (tokenizer, chat templates): one
 * enum, its strerror, and the message helper every text file reports with (the model
 * layer's model_from_text reads the enum for the programs above).
 * A message goes into a caller buffer of TEXT_ERR_LEN bytes (NULL = none)
 * and names the file and field or the byte offset at fault. */
#ifndef KVTIER_TEXT_STATUS_H
#define KVTIER_TEXT_STATUS_H

#include <limits.h>

#define TEXT_ERR_LEN 512

enum text_status {
    TEXT_OK = 0,
    TEXT_ENOENT = 1,      /* a required file is missing */
    TEXT_EFORMAT = 2,     /* a file is malformed */
    TEXT_EUNSUPPORTED = 3,/* a tokenizer feature or template kvtier does not implement */
    TEXT_ENOMEM = 4,
    TEXT_EIO = 5,
    TEXT_EINVAL = 6,      /* bad input: invalid UTF-8, a conversation the template rejects */
};

const char *text_strerror(enum text_status st);

/* Writes the message into err and returns st, so a failure reads
 * `return text_errf(err, TEXT_EFORMAT, ...)`. */
enum text_status text_errf(char *err, enum text_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* path = dir/name; TEXT_EINVAL when it does not fit PATH_MAX. */
enum text_status text_path(char path[PATH_MAX], const char *dir, const char *name, char *err);

#endif
