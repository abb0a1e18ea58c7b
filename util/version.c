#include "util/version.h"

#include <stdio.h>
#include <string.h>

/* KVTIER_VERSION comes from the Makefile (VERSION and git describe) */

const char *kvtier_version(void)
{
    return KVTIER_VERSION;
}

bool version_requested(int argc, char **argv, const char *prog)
{
    if (argc < 2 || strcmp(argv[1], "--version") != 0)
        return false;
    printf("%s %s\n", prog, KVTIER_VERSION);
    return true;
}
