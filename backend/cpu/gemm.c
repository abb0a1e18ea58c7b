/* gemm.c - matmul for a batch of tokens (prefill) on the SIMD levels:
 * convert a panel of weight rows to f32 once into the thread's scratch,
 * then let single-threaded OpenBLAS sgemm multiply every token by it.
 * Each weight is read from memory once per call however many tokens
 * there are, and the inner product runs at sgemm speed.
 */
#include <cblas.h>

#include "backend/cpu/cpu.h"

void cpu_matmul_panels(const struct cpu_mm *a, int r0, int r1, float *scratch,
                       void (*to_f32)(float *y, const void *x, enum be_dtype dt, size_t n))
{
    size_t row = be_row_bytes(a->wt, (size_t)a->in);
    int panel = CPU_SCRATCH_FLOATS / a->in;
    panel = panel > 16 ? panel / 16 * 16 : panel;
    for (int r = r0; r < r1; r += panel) {
        int rows = r1 - r < panel ? r1 - r : panel;
        const void *w = (const char *)a->w + (size_t)r * row;
        const float *wf = w;
        if (a->wt != BE_F32) {
            to_f32(scratch, w, a->wt, (size_t)rows * (size_t)a->in);
            wf = scratch;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, a->n, rows, a->in, 1.0f, a->x, a->in, wf, a->in,
                    0.0f, a->y + r, a->out);
    }
}
