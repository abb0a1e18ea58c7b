/* python.h - the Python that runs tools/mkmodel.py for the C tests:
 * $KVTIER_PYTHON, else Debian's /usr/bin/python3 (the one with
 * python3-torch, which another python3 earlier in PATH may lack).  A GPU
 * machine's image keeps torch in a python3 of its own and names it there. */
#ifndef KVTIER_TESTS_PYTHON_H
#define KVTIER_TESTS_PYTHON_H

#include <stdlib.h>

static inline const char *test_python(void)
{
    const char *p = getenv("KVTIER_PYTHON");
    return p && *p ? p : "/usr/bin/python3";
}

#endif
