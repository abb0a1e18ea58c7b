/* kern_scalar.c - the portable inner loops: the fallback on CPUs without
 * AVX2 and the reference the SIMD levels are tested against, so they are
 * written for obviousness, not speed.
 */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "util/half.h"
#include "util/q4k.h"
#include "util/q8.h"

static inline float load_as_f32(const void *p, enum be_dtype dt, size_t i)
{
    switch (dt) {
    case BE_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    case BE_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case BE_Q8_0: {
        const struct q8_0_block *b = (const struct q8_0_block *)p + i / Q8_0_BLOCK;
        return f16_to_f32(b->d) * (float)b->qs[i % Q8_0_BLOCK];
    }
    case BE_Q4_K: {
        const struct q4_k_block *b = (const struct q4_k_block *)p + i / Q4_K_BLOCK;
        int j = (int)(i % Q4_K_BLOCK / Q4_K_SUB), sc, m;
        q4_k_scale_min(b->scales, j, &sc, &m);
        uint8_t byte = b->qs[j / 2 * Q4_K_SUB + i % Q4_K_SUB];
        return f16_to_f32(b->d) * (float)sc * (float)(j % 2 ? byte >> 4 : byte & 0x0f) -
               f16_to_f32(b->dmin) * (float)m;
    }
    case BE_F32: break;
    }
    return ((const float *)p)[i];
}

/* The Q8_0 oracle: per block, the integer dot product of the codes, scaled
 * by both blocks' scales and summed in block order. */
static void matmul_q8_0_scalar(const struct cpu_mm *a, int r0, int r1)
{
    size_t nb = (size_t)a->in / Q8_0_BLOCK;
    for (int t = 0; t < a->n; t++) {
        const struct cpu_q8_act *x = a->xq + (size_t)t * nb;
        for (int r = r0; r < r1; r++) {
            const struct q8_0_block *w = (const struct q8_0_block *)a->w + (size_t)r * nb;
            float acc = 0.0f;
            for (size_t b = 0; b < nb; b++) {
                int32_t isum = 0;
                for (int i = 0; i < Q8_0_BLOCK; i++)
                    isum += (int32_t)w[b].qs[i] * (int32_t)x[b].qs[i];
                acc += f16_to_f32(w[b].d) * x[b].d * (float)isum;
            }
            a->y[(size_t)t * a->out + r] = acc;
        }
    }
}

/* The Q4_K oracle: per sub-block j of 32, the integer dot product of the
 * 4-bit codes with the activation codes and the sum of the latter, as
 *     d sc_j dx isum_j - dmin m_j (dx xsum_j)
 * summed in sub-block order (the SIMD levels group the same products). */
static void matmul_q4_k_scalar(const struct cpu_mm *a, int r0, int r1)
{
    size_t nsb = (size_t)a->in / Q4_K_BLOCK;
    for (int t = 0; t < a->n; t++) {
        const struct cpu_q8_act *x = a->xq + (size_t)t * nsb * 8;
        for (int r = r0; r < r1; r++) {
            const struct q4_k_block *w = (const struct q4_k_block *)a->w + (size_t)r * nsb;
            float acc = 0.0f;
            for (size_t b = 0; b < nsb; b++) {
                float d = f16_to_f32(w[b].d), dmin = f16_to_f32(w[b].dmin);
                for (int j = 0; j < 8; j++) {
                    const struct cpu_q8_act *xb = &x[b * 8 + (size_t)j];
                    int sc, m;
                    int32_t isum = 0, xsum = 0;
                    q4_k_scale_min(w[b].scales, j, &sc, &m);
                    for (int i = 0; i < Q4_K_SUB; i++) {
                        uint8_t byte = w[b].qs[j / 2 * Q4_K_SUB + i];
                        isum += (j % 2 ? byte >> 4 : byte & 0x0f) * (int32_t)xb->qs[i];
                        xsum += xb->qs[i];
                    }
                    acc += d * (float)sc * xb->d * (float)isum - dmin * (float)m * (xb->d * (float)xsum);
                }
            }
            a->y[(size_t)t * a->out + r] = acc;
        }
    }
}

void cpu_matmul_rows_scalar(const struct cpu_mm *a, int r0, int r1, float *scratch)
{
    (void)scratch;
    if (a->wt == BE_Q8_0) {
        matmul_q8_0_scalar(a, r0, r1);
        return;
    }
    if (a->wt == BE_Q4_K) {
        matmul_q4_k_scalar(a, r0, r1);
        return;
    }
    size_t row_bytes = be_row_bytes(a->wt, (size_t)a->in);
    for (int t = 0; t < a->n; t++) {
        const float *x = a->x + (size_t)t * a->in;
        for (int r = r0; r < r1; r++) {
            const char *w = (const char *)a->w + (size_t)r * row_bytes;
            cpu_dot_scalar(&a->y[(size_t)t * a->out + r], x, 1, &w, a->wt, a->in, 1);
        }
    }
}

void cpu_dot_scalar(float *s, const float *q, int nq, const char *const *rows, enum be_dtype dt, int n, int nrows)
{
    for (int g = 0; g < nq; g++)
        for (int r = 0; r < nrows; r++) {
            float acc = 0.0f;
            for (int i = 0; i < n; i++)
                acc += q[(size_t)g * (size_t)n + (size_t)i] * load_as_f32(rows[r], dt, (size_t)i);
            s[(size_t)g * (size_t)nrows + (size_t)r] = acc;
        }
}

void cpu_axpy_scalar(float *y, const float *a, int nq, const char *const *rows, size_t off, enum be_dtype dt, int n,
                     int nrows, bool odd)
{
    (void)odd; /* one key at a time */
    for (int g = 0; g < nq; g++)
        for (int r = 0; r < nrows; r++)
            for (int i = 0; i < n; i++)
                y[(size_t)g * (size_t)n + (size_t)i] +=
                    a[(size_t)g * (size_t)nrows + (size_t)r] * load_as_f32(rows[r] + off, dt, (size_t)i);
}

static void scale_scalar(float *y, float a, int n)
{
    for (int i = 0; i < n; i++)
        y[i] *= a;
}

float cpu_max_scalar(const float *x, int n)
{
    float m = -INFINITY;
    for (int i = 0; i < n; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}

float cpu_exp_sum_scalar(float *s, float m, int n)
{
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    return sum;
}

static float sumsq_scalar(const float *x, int n)
{
    float acc = 0.0f;
    for (int i = 0; i < n; i++)
        acc += x[i] * x[i];
    return acc;
}

static void norm_mul_scalar(float *y, const float *x, float s, const float *w, int n)
{
    for (int i = 0; i < n; i++)
        y[i] = (x[i] * s) * w[i];
}

static void add_scalar(float *y, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] += x[i];
}

void cpu_to_f32_scalar(float *y, const void *x, enum be_dtype dt, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] = load_as_f32(x, dt, i);
}

void cpu_from_f32_scalar(void *y, enum be_dtype dt, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        switch (dt) {
        case BE_F32: ((float *)y)[i] = x[i]; break;
        case BE_F16: ((uint16_t *)y)[i] = f32_to_f16(x[i]); break;
        case BE_BF16: ((uint16_t *)y)[i] = f32_to_bf16(x[i]); break;
        case BE_Q8_0: case BE_Q4_K: return; /* weight formats: never a destination */
        }
    }
}

void cpu_q8_act_scalar(struct cpu_q8_act *y, int32_t *sum, const float *x, size_t n)
{
    for (size_t b = 0; b < n / 32; b++, x += 32) {
        float amax = 0.0f;
        bool finite = true;
        for (int i = 0; i < 32; i++) {
            finite = finite && fabsf(x[i]) < INFINITY;
            amax = fmaxf(amax, fabsf(x[i]));
        }
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        /* below max|x| of about 3.7e-37 the reciprocal overflows and the
         * codes would be inf times x: such a block rounds as an all-zero
         * one does, its contribution being far below any product's ulp */
        if (isinf(id))
            d = id = 0.0f;
        y[b].d = finite ? d : NAN;
        sum[b] = 0;
        for (int i = 0; i < 32; i++) {
            y[b].qs[i] = finite ? (int8_t)nearbyintf(x[i] * id) : 0;
            sum[b] += y[b].qs[i];
        }
    }
}

/* softplus as torch computes it (threshold 20: x itself above) */
static float softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

void cpu_ssm_scan_scalar(const struct cpu_ssm *a, size_t lo, size_t hi)
{
    const struct be_ssm_params *p = a->p;
    size_t di = (size_t)p->d_inner;
    int N = p->d_state;
    for (size_t i = lo; i < hi; i++) {
        float h[BE_SSM_MAX_STATE];
        const float *A = p->A + i * (size_t)N;
        memcpy(h, a->h_in + i * (size_t)N, (size_t)N * sizeof(float));
        for (int t = a->t0; t < a->t1; t++) {
            size_t r = (size_t)t * di + i;
            float dt = softplus(a->dt[r]), xv = a->x[r];
            const float *B = a->B + (size_t)t * N, *C = a->C + (size_t)t * N;
            float acc = 0.0f;
            for (int s = 0; s < N; s++) {
                h[s] = expf(dt * A[s]) * h[s] + dt * B[s] * xv;
                acc += C[s] * h[s];
            }
            float z = a->z[r];
            a->y[r] = (acc + p->D[i] * xv) * (z / (1.0f + expf(-z)));
        }
        memcpy(a->h_out + i * (size_t)N, h, (size_t)N * sizeof(float));
    }
}

const struct cpu_kern cpu_kern_scalar = {
    .name = "scalar",
    .matmul_rows = cpu_matmul_rows_scalar,
    .dot = cpu_dot_scalar,
    .axpy = cpu_axpy_scalar,
    .scale = scale_scalar,
    .max = cpu_max_scalar,
    .exp_sum = cpu_exp_sum_scalar,
    .sumsq = sumsq_scalar,
    .norm_mul = norm_mul_scalar,
    .add = add_scalar,
    .q8_act = cpu_q8_act_scalar,
    .to_f32 = cpu_to_f32_scalar,
    .from_f32 = cpu_from_f32_scalar,
    .ssm_scan = cpu_ssm_scan_scalar,
};
