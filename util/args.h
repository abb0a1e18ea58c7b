/* args.h - checked number parsing for command-line options, shared by
 * kvtierd and the tools: the whole string must be a number in range, so
 * "abc" or "-5" is a usage error instead of a silent 0 or default. */
#ifndef KVTIER_ARGS_H
#define KVTIER_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

bool args_int(const char *s, int lo, int hi, int *out);
bool args_u64(const char *s, uint64_t *out);
/* A finite float in [lo, hi]. */
bool args_float(const char *s, float lo, float hi, float *out);
/* A byte count with an optional K/M/G suffix (powers of 1024). */
bool args_size(const char *s, size_t *out);
/* A comma-separated list of 1 to max ints, each in [lo, hi]; *n = how many. */
bool args_int_list(const char *s, int lo, int hi, int *out, int max, int *n);

struct option;
/* The usage error for a value the parsers above refused: prints "PROG:
 * invalid value 'VAL' for --NAME" (NAME found by c in opts, else -c) and
 * returns 2, the tools' exit status for a usage error. */
int args_invalid(const char *prog, const struct option *opts, int c, const char *val);

#endif
