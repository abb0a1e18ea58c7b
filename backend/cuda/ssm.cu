/* ssm.cu - the state-space ops of a Mamba layer (be_ssm_conv, be_ssm_scan)
 * on the device, in the CPU backend's arithmetic: a thread per (run of a
 * view's rows, channel), which keeps the channel's conv window or SSM
 * state in registers and walks the run's rows in order, as the CPU's
 * threads walk theirs.  The states are f32 in device memory; activations
 * are loaded and stored in the context's type.
 */
#include "backend/cuda/cuda.h"

#define THREADS 128

/* A view's rows [t0, t1) of the batch, in and out its state. */
struct ssm_run {
    int t0, t1;
    const float *in;
    float *out;
};

/* The runs of a batch: a view's rows are consecutive (backend.h). */
static int count_runs(const struct be_tok *toks, int n_tok)
{
    int n = 0;
    for (int t = 0; t < n_tok; t++)
        n += t == 0 || toks[t].view != toks[t - 1].view;
    return n;
}

static enum be_status upload_runs(struct cu_ctx *c, const struct be_ssm_view *views, const struct be_tok *toks,
                                  int n_tok, int *n_runs, const struct ssm_run **druns)
{
    int n = count_runs(toks, n_tok);
    char *h, *d;
    BE_TRY(cu_meta_reserve(c, (size_t)n * sizeof(struct ssm_run), &h, &d));
    struct ssm_run *r = (struct ssm_run *)h;
    for (int t0 = 0, k = 0; t0 < n_tok; k++) {
        int t1 = t0, v = toks[t0].view;
        while (t1 < n_tok && toks[t1].view == v)
            t1++;
        r[k] = (struct ssm_run){.t0 = t0, .t1 = t1, .in = (const float *)views[v].in, .out = (float *)views[v].out};
        t0 = t1;
    }
    *n_runs = n;
    *druns = (const struct ssm_run *)d;
    return cu_meta_upload(c, h, d, (size_t)n * sizeof(struct ssm_run));
}

/* Block (channels, run): y[t, i] = silu(conv_b[i] + sum_k w[i, k] x[t - K + 1 + k, i]),
 * the first K - 1 inputs from the run's window, which then gets the last. */
__global__ void k_ssm_conv(void *y, const void *x, enum be_dtype at, const struct ssm_run *runs,
                           struct be_ssm_params p)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x, di = p.d_inner, K = p.d_conv;
    if (i >= di)
        return;
    struct ssm_run r = runs[blockIdx.y];
    const float *w = p.conv_w + (size_t)i * K;
    float buf[BE_SSM_MAX_CONV]; /* the last K inputs, oldest first */
    for (int k = 0; k < K - 1; k++)
        buf[k] = r.in[(size_t)k * di + i];
    for (int t = r.t0; t < r.t1; t++) {
        buf[K - 1] = ld(x, (size_t)t * di + i, at);
        float acc = p.conv_b ? p.conv_b[i] : 0.0f;
        for (int k = 0; k < K; k++)
            acc += w[k] * buf[k];
        st(y, (size_t)t * di + i, at, acc / (1.0f + expf(-acc)));
        for (int k = 0; k < K - 1; k++)
            buf[k] = buf[k + 1];
    }
    for (int k = 0; k < K - 1; k++)
        r.out[(size_t)k * di + i] = buf[k];
}

/* softplus as torch computes it (threshold 20: x itself above) */
__device__ __forceinline__ float softplus(float x)
{
    return x > 20.0f ? x : log1pf(expf(x));
}

/* Block (channels, run): the selective scan of channel i through the run's
 * rows, its state h (after the window in the state) in registers. */
__global__ void k_ssm_scan(void *y, const void *x, const void *dt_raw, const void *B, const void *C, const void *z,
                           enum be_dtype at, const struct ssm_run *runs, struct be_ssm_params p)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x, di = p.d_inner, N = p.d_state;
    if (i >= di)
        return;
    struct ssm_run r = runs[blockIdx.y];
    size_t h_off = (size_t)(p.d_conv - 1) * di + (size_t)i * N; /* floats: h follows the window */
    const float *A = p.A + (size_t)i * N;
    float h[BE_SSM_MAX_STATE];
    for (int s = 0; s < N; s++)
        h[s] = r.in[h_off + s];
    for (int t = r.t0; t < r.t1; t++) {
        size_t row = (size_t)t * di + i;
        float dt = softplus(ld(dt_raw, row, at)), xv = ld(x, row, at), acc = 0.0f;
        for (int s = 0; s < N; s++) {
            h[s] = expf(dt * A[s]) * h[s] + dt * ld(B, (size_t)t * N + s, at) * xv;
            acc += ld(C, (size_t)t * N + s, at) * h[s];
        }
        float zv = ld(z, row, at);
        st(y, row, at, (acc + p.D[i] * xv) * (zv / (1.0f + expf(-zv))));
    }
    for (int s = 0; s < N; s++)
        r.out[h_off + s] = h[s];
}

enum be_status cu_ssm_conv(void *ctx, void *y, const void *x, const struct be_ssm_view *views,
                           const struct be_tok *toks, int n_tok, const struct be_ssm_params *p)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "ssm_conv"));
    int n_runs;
    const struct ssm_run *runs;
    BE_TRY(upload_runs(c, views, toks, n_tok, &n_runs, &runs));
    dim3 grid((unsigned)((p->d_inner + THREADS - 1) / THREADS), (unsigned)n_runs);
    k_ssm_conv<<<grid, THREADS, 0, c->compute>>>(y, x, c->act, runs, *p);
    return cu_leave(c, "ssm_conv");
}

enum be_status cu_ssm_scan(void *ctx, void *y, const void *x, const void *dt_raw, const void *B, const void *C,
                           const void *z, const struct be_ssm_view *views, const struct be_tok *toks, int n_tok,
                           const struct be_ssm_params *p)
{
    struct cu_ctx *c = (struct cu_ctx *)ctx;
    BE_TRY(cu_enter(c, "ssm_scan"));
    int n_runs;
    const struct ssm_run *runs;
    BE_TRY(upload_runs(c, views, toks, n_tok, &n_runs, &runs));
    dim3 grid((unsigned)((p->d_inner + THREADS - 1) / THREADS), (unsigned)n_runs);
    k_ssm_scan<<<grid, THREADS, 0, c->compute>>>(y, x, dt_raw, B, C, z, c->act, runs, *p);
    return cu_leave(c, "ssm_scan");
}
