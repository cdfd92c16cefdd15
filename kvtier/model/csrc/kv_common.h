/* What the native kernels share: dtype and error codes (mirrored in kvtier.model.native), float32
 * bit views, bfloat16 rounding, and the fp8 -> float32 bit trick. */
#ifndef KVTIER_KV_COMMON_H
#define KVTIER_KV_COMMON_H

#include <stdint.h>
#include <string.h>

/* KV storage: the first three carry per-block scales */
enum { KVS_E4M3 = 0, KVS_E5M2 = 1, KVS_INT8 = 2, KVS_F32 = 3, KVS_BF16 = 4 };
/* float formats of queries, new K/V rows and outputs */
enum { KVT_F32 = 0, KVT_BF16 = 1 };
/* KV scales: one float32 per (K/V, head, block), or one float16 per (K/V, head, block, token) */
enum { KVT_SCALE_BLOCK = 0, KVT_SCALE_TOKEN = 1 };
/* return codes; KVT_REGROUP: the caller leaves this call to the torch ops */
enum { KVT_OK = 0, KVT_REGROUP = 1, KVT_BAD_INDEX = -1, KVT_UNSUPPORTED = -2 };

static inline float bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }

/* round to nearest even, as torch; the values here are finite */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t u = f32_to_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* fp8 -> float32 without a conversion instruction: the byte, sign-extended to 32 bits, shifted left
 * by FP8_SHIFT and masked to sign + 7 magnitude bits, puts the fp8 exponent and mantissa in the
 * low bits of float32's: it is the fp8 value times 2^-(127 - bias), exactly, subnormals included.
 * Multiplying by FP8_UNBIAS (or folding it into a scale) restores the value. */
#define E4M3_SHIFT 20
#define E4M3_MASK 0x87F00000u
#define E4M3_UNBIAS 0x1p120f /* 2^(127 - 7) */
#define E5M2_SHIFT 21
#define E5M2_MASK 0x8FE00000u
#define E5M2_UNBIAS 0x1p112f /* 2^(127 - 15) */

#endif
