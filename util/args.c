/* args.c - checked number parsing for command-line options. */
#include "util/args.h"

#include <errno.h>
#include <float.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool args_int(const char *s, int lo, int hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return false;
    *out = (int)v;
    return true;
}

bool args_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-')
        return false;
    *out = v;
    return true;
}

bool args_float(const char *s, float lo, float hi, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno == ERANGE && fabsf(v) <= FLT_MIN) /* an underflow is a number, rounded towards 0 */
        errno = 0;
    if (errno || end == s || *end || !isfinite(v) || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

bool args_size(const char *s, size_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    unsigned long long mul = 1;
    if (*end == 'k' || *end == 'K')
        mul = 1ull << 10, end++;
    else if (*end == 'm' || *end == 'M')
        mul = 1ull << 20, end++;
    else if (*end == 'g' || *end == 'G')
        mul = 1ull << 30, end++;
    if (errno || end == s || *end || s[0] == '-' || v > SIZE_MAX / mul)
        return false;
    *out = (size_t)(v * mul);
    return true;
}

bool args_int_list(const char *s, int lo, int hi, int *out, int max, int *n)
{
    int k = 0;
    for (;;) {
        char item[32];
        size_t len = strcspn(s, ",");
        if (k == max || len >= sizeof(item))
            return false;
        memcpy(item, s, len);
        item[len] = 0;
        if (!args_int(item, lo, hi, &out[k++]))
            return false;
        if (!s[len])
            break;
        s += len + 1;
    }
    *n = k;
    return true;
}

int args_invalid(const char *prog, const struct option *opts, int c, const char *val)
{
    for (; opts->name; opts++)
        if (opts->val == c && !opts->flag) {
            fprintf(stderr, "%s: invalid value '%s' for --%s\n", prog, val, opts->name);
            return 2;
        }
    fprintf(stderr, "%s: invalid value '%s' for -%c\n", prog, val, c);
    return 2;
}
