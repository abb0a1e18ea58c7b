/* q8.c - the Q8_0 weight quantizer (see q8.h). */
#include <math.h>

#include "util/half.h"
#include "util/q8.h"

bool q8_0_quantize(const float *x, struct q8_0_block *y, size_t n)
{
    for (size_t b = 0; b < n / Q8_0_BLOCK; b++, x += Q8_0_BLOCK) {
        float amax = 0.0f;
        for (int i = 0; i < Q8_0_BLOCK; i++) {
            if (!isfinite(x[i]))
                return false;
            amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        }
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = f32_to_f16(d);
        for (int i = 0; i < Q8_0_BLOCK; i++) {
            /* roundf without its library call (a model's worth of them is
             * most of the load time): |v| <= 127 makes v +- 0.5 exact in
             * double, so truncating it rounds halves away from zero */
            double v = (double)(x[i] * id);
            y[b].qs[i] = (int8_t)(v + copysign(0.5, v));
        }
    }
    return true;
}

void q8_0_dequantize(const struct q8_0_block *x, float *y, size_t n)
{
    for (size_t b = 0; b < n / Q8_0_BLOCK; b++) {
        float d = f16_to_f32(x[b].d);
        for (int i = 0; i < Q8_0_BLOCK; i++)
            y[b * Q8_0_BLOCK + i] = d * (float)x[b].qs[i];
    }
}
