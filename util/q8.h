/* q8.h - GGUF's Q8_0 block format for weights: 32 consecutive elements of
 * a row share one f16 scale d and are stored as int8 codes q, x ~ d * q.
 * The layout and the rounding are llama.cpp's reference quantizer
 * (quantize_row_q8_0_ref), so a row quantized here has the bytes a GGUF
 * file's Q8_0 tensor would hold.  tools/torchref.py repeats the same
 * arithmetic in numpy, byte for byte.
 */
#ifndef KVTIER_UTIL_Q8_H
#define KVTIER_UTIL_Q8_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define Q8_0_BLOCK 32    /* elements per block */
#define GGML_TYPE_Q8_0 8 /* the type id of these blocks in a GGUF file */

struct q8_0_block {
    uint16_t d;                /* f16 scale */
    int8_t qs[Q8_0_BLOCK];
};
_Static_assert(sizeof(struct q8_0_block) == 34, "Q8_0 blocks are 34 bytes, unpadded");

/* Quantizes n elements (a multiple of Q8_0_BLOCK) of x into n / 32 blocks:
 * d = max|x| / 127 (stored as f16), q = round(x / d), ties away from zero,
 * computed with the f32 d.  False (y partly written) when an element is
 * not finite: such a weight has no scale to share. */
bool q8_0_quantize(const float *x, struct q8_0_block *y, size_t n);
/* y[i] = f16(d) * q[i] for n elements (a multiple of Q8_0_BLOCK). */
void q8_0_dequantize(const struct q8_0_block *x, float *y, size_t n);

#endif
