/* csvout.h - the CSV files the benchmark tools write with --csv for `make
 * plots`.  A file starts with comment lines a figure quotes (the command
 * with its arguments, the CPU, the date and the load average: the figures
 * come from a shared, noisy machine and must say which), then one header
 * line of column names, then rows written by the caller. */
#ifndef KVTIER_UTIL_CSVOUT_H
#define KVTIER_UTIL_CSVOUT_H

#include <stdbool.h>
#include <stdio.h>

/* Creates path (truncating it) and writes the preamble and header; NULL
 * with errno set when it cannot. */
FILE *csv_open(const char *path, int argc, char *const *argv, const char *header);
/* Closes f; false when any write to it failed (errno set). */
bool csv_close(FILE *f);

#endif
