/* no_cpu.c - the harnesses link the library without the CPU backend (no
 * parser reaches a kernel, and clang 14 cannot build every SIMD file), so
 * be_open's table of built-in backends resolves here: none is available. */
#include "backend/backend_impl.h"

enum be_status be_cpu_init(const struct be_params *p, const struct be_ops **ops, void **ctx, size_t *dev_budget)
{
    (void)p, (void)ops, (void)ctx, (void)dev_budget;
    return BE_ENODEV;
}

enum be_status be_strict_init(const struct be_params *p, const struct be_ops **ops, void **ctx, size_t *dev_budget)
{
    return be_cpu_init(p, ops, ctx, dev_budget);
}
