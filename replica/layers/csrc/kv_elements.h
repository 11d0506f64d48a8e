/* Elements of q, out and the KV cache: fp32, or bf16 held as uint16 bit patterns (widened to
 * fp32 on load, rounded to nearest even on store, as torch does). Shared by the attention
 * kernels. */
#ifndef STEPSERVE_KV_ELEMENTS_H
#define STEPSERVE_KV_ELEMENTS_H

#include <stdint.h>
#include <string.h>

static inline float load(const void *base, int64_t i, int bf16) {
    if (bf16) {
        uint32_t bits = ((uint32_t)((const uint16_t *)base)[i]) << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)base)[i];
}

static inline void store(void *base, int64_t i, float x, int bf16) {
    if (bf16) {
        uint32_t bits;
        memcpy(&bits, &x, sizeof bits);
        bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even, as torch does */
        ((uint16_t *)base)[i] = (uint16_t)(bits >> 16);
        return;
    }
    ((float *)base)[i] = x;
}

/* widen one row of n elements to fp32 */
static inline void row_f32(const void *base, int64_t offset, int n, int bf16, float *dst) {
    if (!bf16) {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
        return;
    }
    for (int i = 0; i < n; i++) dst[i] = load(base, offset + i, 1);
}

#endif
