/* fuzz_mem.h - a backend of plain host memory with copies only, for the
 * harnesses that need a store (the harnesses link no CPU backend): enough
 * to load, insert and read KV, no kernel runs. */
#ifndef KVTIER_FUZZ_MEM_H
#define KVTIER_FUZZ_MEM_H

#include "backend/backend_impl.h"
#include "tests/fuzz/fuzz_util.h"

static void mem_free_ctx(void *ctx)
{
    (void)ctx;
}

static struct be_caps mem_caps(void *ctx)
{
    (void)ctx;
    return (struct be_caps){.name = "fuzz-mem", .simd = "scalar"};
}

static enum be_status mem_alloc(void *ctx, size_t size, void **ptr)
{
    (void)ctx;
    *ptr = aligned_alloc(BE_ALIGN, size);
    return *ptr ? BE_OK : BE_ENOMEM_HOST;
}

static void mem_release(void *ctx, void *ptr, size_t size)
{
    (void)ctx, (void)size;
    free(ptr);
}

static enum be_status mem_copy(void *ctx, void *dst, const void *src, size_t n, enum be_copy_dir dir)
{
    (void)ctx, (void)dir;
    memcpy(dst, src, n);
    return BE_OK;
}

static enum be_status mem_event_create(void *ctx, void **ev)
{
    (void)ctx;
    *ev = malloc(1);
    return *ev ? BE_OK : BE_ENOMEM_HOST;
}

static void mem_event_free(void *ctx, void *ev)
{
    (void)ctx;
    free(ev);
}

static enum be_status mem_event_op(void *ctx, void *ev)
{
    (void)ctx, (void)ev;
    return BE_OK;
}

static enum be_status mem_sync(void *ctx)
{
    (void)ctx;
    return BE_OK;
}

static const struct be_ops mem_ops = {
    .api_version = BE_API_VERSION,
    .name = "fuzz-mem",
    .free = mem_free_ctx,
    .caps = mem_caps,
    .dev_alloc = mem_alloc,
    .dev_free = mem_release,
    .host_alloc = mem_alloc,
    .host_free = mem_release,
    .copy_async = mem_copy,
    .copy = mem_copy,
    .event_create = mem_event_create,
    .event_free = mem_event_free,
    .event_record = mem_event_op,
    .event_sync = mem_event_op,
    .sync = mem_sync,
};

static be_backend *mem_backend(size_t dev_budget)
{
    be_backend *be = calloc(1, sizeof(*be));
    FUZZ_CHECK(be, "out of memory");
    be->ops = &mem_ops;
    pthread_mutex_init(&be->lock, NULL);
    be->stats.dev_budget = dev_budget;
    return be;
}

#endif
