/* q6k.c - Q6_K super-blocks as f32 (q6k.h). */
#include "util/q6k.h"

#include "util/half.h"

void q6_k_dequantize(const struct q6_k_block *x, float *y, size_t n)
{
    for (size_t b = 0; b < n / Q6_K_BLOCK; b++, x++) {
        float d = f16_to_f32(x->d);
        /* two halves of 128: codes l, l + 32, l + 64, l + 96 share byte l
         * of qh and bytes l, l + 32 of ql */
        for (int h = 0; h < 2; h++, y += 128) {
            const uint8_t *ql = x->ql + 64 * h, *qh = x->qh + 32 * h;
            const int8_t *sc = x->scales + 8 * h;
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((ql[l] & 0xF) | ((qh[l] >> 0 & 3) << 4)) - 32;
                int q2 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2 & 3) << 4)) - 32;
                int q3 = ((ql[l] >> 4) | ((qh[l] >> 4 & 3) << 4)) - 32;
                int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6 & 3) << 4)) - 32;
                y[l] = d * sc[is] * q1;
                y[l + 32] = d * sc[is + 2] * q2;
                y[l + 64] = d * sc[is + 4] * q3;
                y[l + 96] = d * sc[is + 6] * q4;
            }
        }
    }
}
