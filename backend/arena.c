/* arena.c - first-fit carving of a device range (arena.h). */
#include <stdlib.h>
#include <string.h>

#include "backend/arena.h"

enum be_status be_arena_init(struct be_arena *a, size_t size)
{
    memset(a, 0, sizeof(*a));
    a->cap_free = 16;
    if (!(a->free_list = malloc((size_t)a->cap_free * sizeof(*a->free_list))))
        return BE_ENOMEM_HOST;
    a->size = size;
    a->free_list[0] = (struct be_extent){0, size};
    a->n_free = 1;
    return BE_OK;
}

void be_arena_release(struct be_arena *a)
{
    free(a->free_list);
    memset(a, 0, sizeof(*a));
}

/* Free extents never outnumber the allocations plus one (each lies before
 * an allocation or at the end), so the list is grown here, where failing
 * is allowed, and be_arena_give never has to. */
enum be_status be_arena_take(struct be_arena *a, size_t size, size_t *off)
{
    if (a->n_allocs + 2 > a->cap_free) {
        int cap = a->cap_free * 2;
        struct be_extent *fl = cap > 0 ? realloc(a->free_list, (size_t)cap * sizeof(*fl)) : NULL;
        if (!fl)
            return BE_ENOMEM_HOST;
        a->free_list = fl;
        a->cap_free = cap;
    }
    for (int i = 0; i < a->n_free; i++) {
        struct be_extent *e = &a->free_list[i];
        if (e->size < size)
            continue;
        *off = e->off;
        e->off += size;
        e->size -= size;
        if (e->size == 0) {
            memmove(e, e + 1, (size_t)(a->n_free - i - 1) * sizeof(*e));
            a->n_free--;
        }
        a->n_allocs++;
        return BE_OK;
    }
    return BE_ENOMEM_DEV;
}

void be_arena_give(struct be_arena *a, size_t off, size_t size)
{
    int i = 0;
    while (i < a->n_free && a->free_list[i].off < off)
        i++;
    bool left = i > 0 && a->free_list[i - 1].off + a->free_list[i - 1].size == off;
    bool right = i < a->n_free && off + size == a->free_list[i].off;
    if (left && right) {
        a->free_list[i - 1].size += size + a->free_list[i].size;
        memmove(&a->free_list[i], &a->free_list[i + 1], (size_t)(a->n_free - i - 1) * sizeof(struct be_extent));
        a->n_free--;
    } else if (left) {
        a->free_list[i - 1].size += size;
    } else if (right) {
        a->free_list[i].off = off;
        a->free_list[i].size += size;
    } else {
        memmove(&a->free_list[i + 1], &a->free_list[i], (size_t)(a->n_free - i) * sizeof(struct be_extent));
        a->free_list[i] = (struct be_extent){off, size};
        a->n_free++;
    }
    a->n_allocs--;
}
