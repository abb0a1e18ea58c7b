/* dispatch.c - picks the kernel table for this CPU once, at backend
 * creation.  $KVTIER_SIMD forces a level so tests and benchmarks can
 * compare them on one machine.
 */
#include <stdlib.h>
#include <string.h>

#include "model/cpu/cpu.h"

const struct cpu_kern *cpu_kern_select(void)
{
    const char *want = getenv("KVTIER_SIMD");
    if (!want || !*want || strcmp(want, "scalar") == 0)
        return &cpu_kern_scalar;
    return NULL;
}
