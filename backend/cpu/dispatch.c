/* dispatch.c - picks the kernel table for this CPU once, at backend
 * creation.  $KVTIER_SIMD forces a level so tests and benchmarks can
 * compare them on one machine.
 */
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"

static bool can_avx2(void)
{
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

static bool can_avx512(void)
{
    return can_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

static bool can_avx512vnni(void)
{
    return can_avx512() && __builtin_cpu_supports("avx512vnni");
}

/* Every CPU with AVX512_BF16 (Cooper Lake, Sapphire Rapids, Zen 4) has
 * VNNI too, so the levels form one chain and avx512bf16 is the avx512vnni
 * table plus the bf16 kernels; both flags are checked, neither assumed. */
static bool can_avx512bf16(void)
{
    return can_avx512vnni() && __builtin_cpu_supports("avx512bf16");
}

const struct cpu_kern *cpu_kern_select(void)
{
    __builtin_cpu_init();
    const char *want = getenv("KVTIER_SIMD");
    if (!want || !*want)
        return can_avx512bf16()   ? &cpu_kern_avx512bf16
               : can_avx512vnni() ? &cpu_kern_avx512vnni
               : can_avx512()     ? &cpu_kern_avx512
               : can_avx2()       ? &cpu_kern_avx2
                                  : &cpu_kern_scalar;
    if (strcmp(want, "scalar") == 0)
        return &cpu_kern_scalar;
    if (strcmp(want, "avx2") == 0)
        return can_avx2() ? &cpu_kern_avx2 : NULL;
    if (strcmp(want, "avx512") == 0)
        return can_avx512() ? &cpu_kern_avx512 : NULL;
    if (strcmp(want, "avx512vnni") == 0)
        return can_avx512vnni() ? &cpu_kern_avx512vnni : NULL;
    if (strcmp(want, "avx512bf16") == 0)
        return can_avx512bf16() ? &cpu_kern_avx512bf16 : NULL;
    return NULL;
}
