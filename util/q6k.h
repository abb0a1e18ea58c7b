/* q6k.h - GGUF's Q6_K block format, read only: 256 elements of a row in
 * 16 groups of 16, each group an int8 scale times the super-block's f16
 * d, each element a 6-bit code (low 4 bits in ql, high 2 in qh) less 32:
 * x = d * scale * (q - 32).  llama.cpp's Q4_K_M and Q5_K_M files keep the
 * output head and some ffn_down and attn_v matrices so.  No kernel reads
 * it: the GGUF loader requantizes it to Q8_0 at load (model/gguf_model.c).
 */
#ifndef KVTIER_UTIL_Q6K_H
#define KVTIER_UTIL_Q6K_H

#include <stddef.h>
#include <stdint.h>

#define Q6_K_BLOCK 256     /* elements per super-block */
#define GGML_TYPE_Q6_K 14 /* the type id of these blocks in a GGUF file */

struct q6_k_block {
    uint8_t ql[Q6_K_BLOCK / 2]; /* low 4 bits of each code */
    uint8_t qh[Q6_K_BLOCK / 4]; /* high 2 bits */
    int8_t scales[Q6_K_BLOCK / 16];
    uint16_t d;                 /* f16 super-block scale */
};
_Static_assert(sizeof(struct q6_k_block) == 210, "Q6_K blocks are 210 bytes, unpadded");

/* y[i] = (f16(d) * scale) * (q - 32) in f32, in llama.cpp's
 * dequantize_row_q6_K's order, for n elements (a multiple of 256). */
void q6_k_dequantize(const struct q6_k_block *x, float *y, size_t n);

#endif
