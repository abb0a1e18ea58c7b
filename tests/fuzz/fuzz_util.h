/* fuzz_util.h - what the libFuzzer harnesses share: an invariant check that
 * aborts (so libFuzzer keeps the input), a scratch directory for the loaders
 * that read files, a read of every byte of a bound weight, and a UTF-8
 * validator independent of the tokenizer's. */
#ifndef KVTIER_FUZZ_UTIL_H
#define KVTIER_FUZZ_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ftw.h>
#include <unistd.h>

/* A broken invariant: say which, then abort so libFuzzer saves the input. */
#define FUZZ_CHECK(cond, ...)                                                                                        \
    do {                                                                                                             \
        if (!(cond)) {                                                                                               \
            fprintf(stderr, "%s:%d: invariant failed: %s: ", __FILE__, __LINE__, #cond);                             \
            fprintf(stderr, __VA_ARGS__);                                                                            \
            fputc('\n', stderr);                                                                                     \
            abort();                                                                                                 \
        }                                                                                                            \
    } while (0)

/* Reads every byte of p[0..bytes) so a bound weight that points past its
 * mapping faults under the sanitizer. */
static inline unsigned fuzz_touch(const void *p, size_t bytes)
{
    const volatile unsigned char *b = p;
    unsigned sum = 0;
    for (size_t i = 0; i < bytes; i++)
        sum += b[i];
    return sum;
}

static char fuzz_dir_path[128];

static inline int fuzz_rm_one(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb, (void)type, (void)ftw;
    return remove(path);
}

static inline void fuzz_rm_dir(void)
{
    nftw(fuzz_dir_path, fuzz_rm_one, 8, FTW_DEPTH | FTW_PHYS);
}

/* A fresh directory for the whole run, in /dev/shm when there is one (the
 * loaders read files: memory keeps that cheap); removed when the run ends
 * normally (a crashing run leaves it for a look). */
static inline const char *fuzz_dir(const char *tag)
{
    char *dir = fuzz_dir_path;
    if (dir[0])
        return dir;
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(dir, sizeof fuzz_dir_path, "%s/kvtier-fuzz-%s-XXXXXX", base, tag);
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        abort();
    }
    atexit(fuzz_rm_dir);
    return dir;
}

/* Writes data[0..n) to dir/name (replacing it). */
static inline void fuzz_write(const char *dir, const char *name, const void *data, size_t n)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || (n && fwrite(data, 1, n, f) != n) || fclose(f) != 0) {
        perror(path);
        abort();
    }
}

static inline void fuzz_unlink(const char *dir, const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    unlink(path);
}

/* Whether s[0..n) is well-formed UTF-8 (RFC 3629: no overlongs, no
 * surrogates, nothing above U+10FFFF). */
static inline bool fuzz_utf8_valid(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        size_t len;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xC2 && c <= 0xDF) {
            len = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            len = 3;
            lo = c == 0xE0 ? 0xA0 : 0x80;
            hi = c == 0xED ? 0x9F : 0xBF;
        } else if (c >= 0xF0 && c <= 0xF4) {
            len = 4;
            lo = c == 0xF0 ? 0x90 : 0x80;
            hi = c == 0xF4 ? 0x8F : 0xBF;
        } else {
            return false;
        }
        if (n - i < len || s[i + 1] < lo || s[i + 1] > hi)
            return false;
        for (size_t k = 2; k < len; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF)
                return false;
        i += len;
    }
    return true;
}

/* Splits data at its first NUL: *a is before it, *b after (NULL when there
 * is no NUL).  Harnesses that take two files use it. */
static inline void fuzz_split(const uint8_t *data, size_t n, size_t *a_len, const uint8_t **b, size_t *b_len)
{
    const uint8_t *z = memchr(data, 0, n);
    *a_len = z ? (size_t)(z - data) : n;
    *b = z ? z + 1 : NULL;
    *b_len = z ? n - *a_len - 1 : 0;
}

/* The two-file inputs of the loaders: data up to its first NUL becomes
 * dir/first, the rest dir/second (removed when there is no NUL). */
static inline void fuzz_write_pair(const char *dir, const uint8_t *data, size_t n, const char *first,
                                   const char *second)
{
    size_t a_len, b_len;
    const uint8_t *b;
    fuzz_split(data, n, &a_len, &b, &b_len);
    fuzz_write(dir, first, data, a_len);
    if (b)
        fuzz_write(dir, second, b, b_len);
    else
        fuzz_unlink(dir, second);
}

#endif
