/* alloc_count.c - an LD_PRELOAD shim for tests/daemon_alloc.py: counts
 * the process's malloc, calloc and realloc calls and prints them on stderr
 * at exit, as "alloc_count: malloc N calloc N realloc N".  It forwards to
 * glibc's own entry points, so it needs no dlsym (which itself allocates).
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

void *__libc_malloc(size_t n);
void *__libc_calloc(size_t k, size_t n);
void *__libc_realloc(void *p, size_t n);

static atomic_long n_malloc, n_calloc, n_realloc;

void *malloc(size_t n)
{
    atomic_fetch_add_explicit(&n_malloc, 1, memory_order_relaxed);
    return __libc_malloc(n);
}

void *calloc(size_t k, size_t n)
{
    atomic_fetch_add_explicit(&n_calloc, 1, memory_order_relaxed);
    return __libc_calloc(k, n);
}

void *realloc(void *p, size_t n)
{
    atomic_fetch_add_explicit(&n_realloc, 1, memory_order_relaxed);
    return __libc_realloc(p, n);
}

__attribute__((destructor)) static void report(void)
{
    fprintf(stderr, "alloc_count: malloc %ld calloc %ld realloc %ld\n", atomic_load(&n_malloc),
            atomic_load(&n_calloc), atomic_load(&n_realloc));
}
