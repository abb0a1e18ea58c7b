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
            amax = fmaxf(amax, fabsf(x[i]));
        }
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        y[b].d = f32_to_f16(d);
        for (int i = 0; i < Q8_0_BLOCK; i++)
            y[b].qs[i] = (int8_t)roundf(x[i] * id);
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
