/* argmax.h - greedy decoding's pick, shared by the sampler and the tools
 * that decode greedily on their own, so that they pick the same token. */
#ifndef KVTIER_ARGMAX_H
#define KVTIER_ARGMAX_H

/* The index of x[0..n)'s largest value, n >= 1; the first one on ties. */
static inline int argmax_f32(const float *x, int n)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return best;
}

#endif
