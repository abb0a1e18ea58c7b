/* arena.h - first-fit carving of one contiguous range of device memory
 * into allocations, by offset: the strict CPU backend's protected arena
 * and the CUDA backend's one cudaMalloc both hand out their buffers
 * through it, while backend.c keeps the budget.  Not thread-safe: the
 * owner holds its own lock around each call.
 */
#ifndef KVTIER_ARENA_H
#define KVTIER_ARENA_H

#include <stddef.h>

#include "backend/backend.h"

struct be_extent {
    size_t off, size;
};

struct be_arena {
    size_t size;
    struct be_extent *free_list; /* sorted by offset, coalesced */
    int n_free, cap_free;
    int n_allocs;
};

/* An arena of size bytes, all free.  BE_ENOMEM_HOST when its list cannot
 * be had. */
enum be_status be_arena_init(struct be_arena *a, size_t size);
void be_arena_release(struct be_arena *a); /* accepts an arena never initialised (zeroed) */
/* *off = the start of size free bytes, the lowest that fit: BE_ENOMEM_DEV
 * when none do, BE_ENOMEM_HOST when the free list cannot grow. */
enum be_status be_arena_take(struct be_arena *a, size_t size, size_t *off);
/* Returns [off, off + size), taken earlier, to the free list.  Never fails:
 * the list was grown by the take. */
void be_arena_give(struct be_arena *a, size_t off, size_t size);

#endif
