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

#endif
