/* levels.h - the fixtures the kernel tests share (test_backend, test_q8,
 * test_q4k, test_quant): the CPU backend opened at every SIMD level the CPU
 * supports, so each kernel runs at each and is compared with the scalar
 * level, and the random inputs they run on, and the --quantize mode of the
 * weight-format tests.  Include after cmocka.h. */
#ifndef KVTIER_TESTS_LEVELS_H
#define KVTIER_TESTS_LEVELS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend/backend.h"

static const char *const level_names[] = {"scalar", "avx2", "avx512", "avx512vnni", "avx512bf16"};
#define N_LEVELS 5
static be_backend *levels[N_LEVELS]; /* NULL where the CPU lacks the level */

/* The CPU backend at one SIMD level (KVTIER_SIMD), NULL where the CPU lacks
 * it; device_mem 0 = no budget. */
static be_backend *open_level(const char *simd, size_t device_mem)
{
    be_backend *be = NULL;
    struct be_params p = {.n_threads = 2, .device_mem = device_mem};
    setenv("KVTIER_SIMD", simd, 1);
    enum be_status st = be_open("cpu", &p, &be);
    unsetenv("KVTIER_SIMD");
    if (st == BE_ENOTSUP)
        return NULL;
    assert_int_equal(st, BE_OK);
    assert_string_equal(be_get_caps(be).simd, simd);
    return be;
}

static int setup_levels(void **state)
{
    (void)state;
    for (int i = 0; i < N_LEVELS; i++)
        levels[i] = open_level(level_names[i], 0);
    return levels[0] ? 0 : -1;
}

static int teardown_levels(void **state)
{
    (void)state;
    for (int i = 0; i < N_LEVELS; i++)
        be_free(levels[i]);
    return 0;
}

/* xorshift64: the tests' inputs, the same on every run (each test file
 * seeds it). */
static uint64_t rng_state;

static float frand(void) /* uniform in [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((double)(rng_state >> 11) * 0x1p-53 * 2.0 - 1.0);
}

/* TEST --quantize IN OUT: the float32 values of file IN (a multiple of
 * block) quantized by quantize into file OUT, for the Python references
 * to read kvtier's blocks (block_bytes each).  0, 1 when quantize refuses
 * the values, 2 on a bad file. */
static inline int quantize_file(const char *in, const char *out, size_t block, size_t block_bytes,
                                bool (*quantize)(const float *x, void *y, size_t n))
{
    FILE *f = fopen(in, "rb");
    if (!f)
        return 2;
    fseek(f, 0, SEEK_END);
    long bytes = ftell(f);
    rewind(f);
    size_t n = bytes > 0 ? (size_t)bytes / sizeof(float) : 0;
    float *x = malloc(n * sizeof *x + 1);
    void *q = malloc(n / block * block_bytes + 1);
    int rc = !x || !q || n % block || fread(x, sizeof *x, n, f) != n ? 2 : 0;
    fclose(f);
    if (rc == 0 && !quantize(x, q, n))
        rc = 1;
    FILE *o = rc == 0 ? fopen(out, "wb") : NULL;
    if (rc == 0 && (!o || fwrite(q, block_bytes, n / block, o) != n / block))
        rc = 2;
    if (o && fclose(o) != 0)
        rc = 2;
    free(x);
    free(q);
    return rc;
}

#endif
