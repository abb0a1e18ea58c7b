/* q4k.c - the Q4_K weight quantizer and its reference decoding (see q4k.h). */
#include <math.h>

#include "util/half.h"
#include "util/q4k.h"

/* v rounded (halves up) into [0, hi]; compared before converting, so no
 * value overflows the int. */
static int clamp_code(float v, int hi)
{
    if (!(v > 0.0f))
        return 0;
    return v >= (float)hi ? hi : (int)(v + 0.5f);
}

/* Candidate code assignments per sub-block: the codes rounded against
 * (max - min) / (15 + t) for t in [-1, 1] by steps of 1/10, each refitted;
 * 15 itself (t = 0) is the plain min/max quantizer. */
#define FIT_STEPS 21

/* Fits x[i] ~ s * q[i] - mn (s, mn >= 0, q in [0, 15]) to the 32 elements
 * of a sub-block, minimising sum w[i] (s q[i] - mn - x[i])^2 over the
 * candidates; returns s, writes mn.  The min is never positive (mn >= 0)
 * because the format stores it as a subtrahend.  Each candidate's error
 * comes from the sums of its fit, not from a second pass. */
static float fit_sub(const float *x, const float *w, float *mn)
{
    float lo = 0.0f, hi = x[0], sw = 0.0f, sx = 0.0f, sxx = 0.0f;
    for (int i = 0; i < Q4_K_SUB; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
        sw += w[i], sx += w[i] * x[i], sxx += w[i] * x[i] * x[i];
    }
    *mn = -lo;
    if (!(hi > lo))
        return 0.0f;
    float best_s = (hi - lo) / 15.0f, best_b = lo, best_err = INFINITY;
    for (int step = 0; step < FIT_STEPS; step++) {
        float inv = (15.0f + 0.1f * (float)(step - FIT_STEPS / 2)) / (hi - lo);
        float sl = 0.0f, sll = 0.0f, slx = 0.0f;
        for (int i = 0; i < Q4_K_SUB; i++) {
            /* x - lo >= 0: rounding is adding a half and truncating */
            float v = (x[i] - lo) * inv + 0.5f, q = v >= 16.0f ? 15.0f : (float)(int)v;
            sl += w[i] * q, sll += w[i] * q * q, slx += w[i] * q * x[i];
        }
        float det = sw * sll - sl * sl, s, b;
        if (!(det > 0.0f))
            continue;
        s = (sw * slx - sl * sx) / det;
        b = (sll * sx - sl * slx) / det;
        if (b > 0.0f) { /* the best offset is above zero: the format cannot hold it */
            b = 0.0f;
            s = slx / sll;
        }
        if (s < 0.0f)
            continue;
        /* sum w (s q + b - x)^2, expanded */
        float err = s * s * sll + 2.0f * s * b * sl + b * b * sw - 2.0f * s * slx - 2.0f * b * sx + sxx;
        if (err < best_err) {
            best_err = err;
            best_s = s;
            best_b = b;
        }
    }
    *mn = -best_b;
    return best_s;
}

bool q4_k_quantize(const float *x, struct q4_k_block *y, size_t n)
{
    for (size_t b = 0; b < n / Q4_K_BLOCK; b++, x += Q4_K_BLOCK) {
        double ss = 0;
        for (int i = 0; i < Q4_K_BLOCK; i++) {
            if (!isfinite(x[i]))
                return false;
            ss += (double)x[i] * x[i];
        }
        /* importance: the error of a large weight costs more, and every
         * weight some (a sub-block of zeros and one outlier still fits) */
        float av = (float)sqrt(ss / Q4_K_BLOCK), w[Q4_K_SUB];
        float s[8], mn[8], smax = 0.0f, mmax = 0.0f;
        for (int j = 0; j < 8; j++) {
            const float *xs = x + j * Q4_K_SUB;
            for (int i = 0; i < Q4_K_SUB; i++)
                w[i] = av + fabsf(xs[i]);
            s[j] = fit_sub(xs, w, &mn[j]);
            smax = s[j] > smax ? s[j] : smax;
            mmax = mn[j] > mmax ? mn[j] : mmax;
        }
        float d = smax / 63.0f, dmin = mmax / 63.0f;
        int sc[8], m[8];
        for (int j = 0; j < 8; j++) {
            sc[j] = d > 0 ? clamp_code(s[j] / d, 63) : 0;
            m[j] = dmin > 0 ? clamp_code(mn[j] / dmin, 63) : 0;
        }
        struct q4_k_block *o = &y[b];
        o->d = f32_to_f16(d);
        o->dmin = f32_to_f16(dmin);
        for (int j = 0; j < 4; j++) {
            o->scales[j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
            o->scales[j + 4] = (uint8_t)(m[j] | (m[j + 4] >> 4) << 6);
            o->scales[j + 8] = (uint8_t)((sc[j + 4] & 0x0f) | (m[j + 4] & 0x0f) << 4);
        }
        /* the codes against what a reader decodes, not the fits */
        float d16 = f16_to_f32(o->d), dmin16 = f16_to_f32(o->dmin);
        if (!isfinite(d16) || !isfinite(dmin16))
            return false;
        for (int j = 0; j < 8; j++) {
            float step = d16 * (float)sc[j], off = dmin16 * (float)m[j];
            float inv = step > 0 ? 1.0f / step : 0.0f;
            for (int i = 0; i < Q4_K_SUB; i++) {
                int q = clamp_code((x[j * Q4_K_SUB + i] + off) * inv, 15);
                uint8_t *byte = &o->qs[(j / 2) * 32 + i];
                *byte = j % 2 ? (uint8_t)((*byte & 0x0f) | q << 4) : (uint8_t)q;
            }
        }
    }
    return true;
}

void q4_k_dequantize(const struct q4_k_block *x, float *y, size_t n)
{
    for (size_t b = 0; b < n / Q4_K_BLOCK; b++) {
        float d = f16_to_f32(x[b].d), dmin = f16_to_f32(x[b].dmin);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            q4_k_scale_min(x[b].scales, j, &sc, &m);
            float step = d * (float)sc, off = dmin * (float)m;
            for (int i = 0; i < Q4_K_SUB; i++) {
                uint8_t byte = x[b].qs[(j / 2) * 32 + i];
                int q = j % 2 ? byte >> 4 : byte & 0x0f;
                y[b * Q4_K_BLOCK + (size_t)j * Q4_K_SUB + (size_t)i] = step * (float)q - off;
            }
        }
    }
}

bool q4_k_check(const struct q4_k_block *x, size_t n)
{
    for (size_t b = 0; b < n; b++)
        if (!isfinite(f16_to_f32(x[b].d)) || !isfinite(f16_to_f32(x[b].dmin)))
            return false;
    return true;
}
