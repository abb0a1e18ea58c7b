/* version.h - the one version string every binary prints for --version:
 * the release in the VERSION file, plus `git describe` of the tree it was
 * built from when there is one (the Makefile defines KVTIER_VERSION for
 * util/version.c alone, so a new commit recompiles one file). */
#ifndef KVTIER_VERSION_H
#define KVTIER_VERSION_H

#include <stdbool.h>

const char *kvtier_version(void);

/* When argv[1] is "--version": prints "PROG VERSION" on stdout and returns
 * true, so a tool's main starts with
 * `if (version_requested(argc, argv, "kvtier-run")) return 0;`. */
bool version_requested(int argc, char **argv, const char *prog);

#endif
