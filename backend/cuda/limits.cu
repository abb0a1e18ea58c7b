/* kvtier-cuda-limits - what this GPU can do, measured now, for the figures
 * of tools/gpu-check.sh to be ratios against (the GPU counterpart of
 * kvtier-bench's read bandwidth and sgemm):
 *
 *   hbm_copy_gbs    device-to-device cudaMemcpy of a 2 GiB buffer, bytes
 *                   read plus bytes written per second (decode streams its
 *                   weights at a rate this bounds)
 *   h2d_pinned_gbs  host-to-device copy from page-locked memory, 1 GiB
 *                   (what the offloaded KV's prefetch can reach)
 *   d2h_pinned_gbs  the other way
 *   gemm_bf16_tflops  cuBLAS bf16 GEMM, f32 accumulation, 8192^3
 *
 * Each the best of --passes (default 5) timed with CUDA events, one
 * "name value" line each on stdout.  Exit 77 without a device.
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                                           \
    do {                                                                                                      \
        cudaError_t e_ = (call);                                                                              \
        if (e_ != cudaSuccess) {                                                                              \
            fprintf(stderr, "kvtier-cuda-limits: %s: %s\n", #call, cudaGetErrorString(e_));                  \
            exit(1);                                                                                          \
        }                                                                                                     \
    } while (0)

/* Seconds of the fastest of passes runs of fn. */
template <typename F> static double best_of(int passes, F fn)
{
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    fn(); /* warm-up */
    double best = 1e30;
    for (int i = 0; i < passes; i++) {
        CHECK(cudaEventRecord(a));
        fn();
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        best = ms / 1e3 < best ? ms / 1e3 : best;
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    return best;
}

/* n bf16 values in [-1, 1) from a hash of their index */
__global__ void fill_bf16(uint16_t *p, size_t n)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        float f = (float)(h >> 8) / 8388608.0f - 1.0f;
        p[i] = (uint16_t)(__float_as_uint(f) >> 16);
    }
}

int main(int argc, char **argv)
{
    int passes = 5;
    if (argc == 3 && strcmp(argv[1], "--passes") == 0)
        passes = atoi(argv[2]) > 0 ? atoi(argv[2]) : 5;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        printf("no CUDA device (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "none reported");
        return 77;
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("device %s sm_%d%d %.0fMiB\n", prop.name, prop.major, prop.minor, prop.totalGlobalMem / 1048576.0);

    size_t big = (size_t)2 << 30;
    void *d0, *d1;
    CHECK(cudaMalloc(&d0, big));
    CHECK(cudaMalloc(&d1, big));
    double t = best_of(passes, [&] { CHECK(cudaMemcpyAsync(d1, d0, big, cudaMemcpyDeviceToDevice, 0)); });
    printf("hbm_copy_gbs %.1f\n", 2.0 * big / t / 1e9);

    size_t hb = (size_t)1 << 30;
    void *h;
    CHECK(cudaMallocHost(&h, hb));
    memset(h, 1, hb);
    t = best_of(passes, [&] { CHECK(cudaMemcpyAsync(d0, h, hb, cudaMemcpyHostToDevice, 0)); });
    printf("h2d_pinned_gbs %.1f\n", hb / t / 1e9);
    t = best_of(passes, [&] { CHECK(cudaMemcpyAsync(h, d0, hb, cudaMemcpyDeviceToHost, 0)); });
    printf("d2h_pinned_gbs %.1f\n", hb / t / 1e9);
    CHECK(cudaFreeHost(h));

    /* A, B: 8192 x 8192 bf16 (128 MiB each) inside d0; C: f32 in d1 */
    const int m = 8192;
    /* random values: a product of zeros runs faster than any model's */
    fill_bf16<<<4096, 256>>>((uint16_t *)d0, (size_t)2 * m * m);
    CHECK(cudaGetLastError());
    cublasHandle_t blas;
    if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "kvtier-cuda-limits: cublasCreate failed\n");
        return 1;
    }
    float one = 1.0f, zero = 0.0f;
    const char *a = (const char *)d0, *b = a + (size_t)m * m * 2;
    cublasStatus_t bs = CUBLAS_STATUS_SUCCESS;
    t = best_of(passes, [&] {
        bs = cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, m, m, m, &one, a, CUDA_R_16BF, m, b, CUDA_R_16BF, m, &zero,
                          d1, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    });
    if (bs != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "kvtier-cuda-limits: cublasGemmEx: %s\n", cublasGetStatusString(bs));
        return 1;
    }
    printf("gemm_bf16_tflops %.1f\n", 2.0 * m * m * m / t / 1e12);
    cublasDestroy(blas);
    cudaFree(d0);
    cudaFree(d1);
    return 0;
}
