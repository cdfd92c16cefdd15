/* The small per-layer ops of a bfloat16 decoder, fused (kvtier.model.layer_ops, loaded by
 * kvtier.model.native): residual add + RMSNorm, rotary embedding in place, SiLU(gate) * up.
 *
 * A decode step runs a few dozen of these per layer on a handful of rows, and as torch ops each
 * is a dispatch, an allocation and a pass over memory; here each is one pass. They round to
 * bfloat16 exactly where the torch ops of kvtier.model.llama do (an add, a multiply, the norm's
 * cast), computing each value in float32 in between, so they agree with them except where a
 * float32 result of another summation order (the norm's mean) or exp approximation (SiLU) sits
 * within an ulp of a bf16 rounding boundary.
 *
 * Rows run in parallel on the process's OpenMP team (torch's) when there are enough of them.
 * Needs AVX-512; sizes must be multiples of 16 (hidden, intermediate, head_dim / 2), else the
 * entry points return KVT_UNSUPPORTED and the caller runs the torch ops.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kv_common.h"

int kvt_abi_version(void) { return 1; }

#define PARALLEL_MIN_ELEMS 32768 /* below this, one thread: the team's fork costs more */

#if defined(__AVX512F__)
#include <immintrin.h>

int kvt_has_layer_ops(void) { return 1; }

static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* round to the nearest bfloat16 (ties to even), kept as float32 with the low 16 bits zero */
static inline __m512 round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* store 16 values already rounded by round_bf16 */
static inline void store_bf16(uint16_t *p, __m512 rounded) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}

/* e^x, float32, about 2 ulp (the polynomial of paged_attention.c's exp16) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.5f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* residual != NULL: h = bf16(x + residual), written back to residual; then, with h = x without
 * one: out = bf16(weight * bf16(h * 1/sqrt(mean(h^2) + eps))). x rows have stride ldx. */
int kvt_add_rms_norm_bf16(const void *x_, int64_t ldx, void *residual_, const void *weight_, void *out_,
                          int64_t rows, int64_t hidden, float eps) {
    if (rows <= 0 || hidden <= 0 || hidden % 16 != 0 || ldx < hidden) return KVT_UNSUPPORTED;
    const uint16_t *x = (const uint16_t *)x_, *weight = (const uint16_t *)weight_;
    uint16_t *residual = (uint16_t *)residual_, *out = (uint16_t *)out_;
#pragma omp parallel for schedule(static) if (rows * hidden >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * ldx;
        uint16_t *res = residual != NULL ? residual + r * hidden : NULL;
        const uint16_t *h = res != NULL ? res : xr;
        __m512 sq = _mm512_setzero_ps();
        for (int64_t i = 0; i < hidden; i += 16) {
            __m512 v = load_bf16(xr + i);
            if (res != NULL) {
                v = round_bf16(_mm512_add_ps(v, load_bf16(res + i)));
                store_bf16(res + i, v);
            }
            sq = _mm512_fmadd_ps(v, v, sq);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)hidden + eps);
        const __m512 scale = _mm512_set1_ps(inv);
        uint16_t *o = out + r * hidden;
        for (int64_t i = 0; i < hidden; i += 16) {
            const __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(h + i), scale));
            store_bf16(o + i, round_bf16(_mm512_mul_ps(load_bf16(weight + i), normed)));
        }
    }
    return KVT_OK;
}

/* In place, per token t and head: (x1, x2) -> (bf16(bf16(x1 c) - bf16(x2 s)), bf16(bf16(x2 c) + bf16(x1 s)))
 * with x1, x2 the halves of the head and c, s = cos[t], sin[t] ([tokens, dim / 2] bf16); token
 * rows have stride ld, heads follow each other within a row. */
int kvt_rope_bf16(void *x_, int64_t tokens, int64_t heads, int64_t dim, int64_t ld, const void *cos_,
                  const void *sin_) {
    const int64_t half = dim / 2;
    if (tokens <= 0 || heads <= 0 || dim % 2 != 0 || half % 16 != 0 || ld < heads * dim) return KVT_UNSUPPORTED;
    uint16_t *x = (uint16_t *)x_;
    const uint16_t *cs = (const uint16_t *)cos_, *sn = (const uint16_t *)sin_;
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        for (int64_t i = 0; i < half; i += 16) {
            const __m512 c = load_bf16(cs + t * half + i), s = load_bf16(sn + t * half + i);
            for (int64_t h = 0; h < heads; h++) {
                uint16_t *p = x + t * ld + h * dim;
                const __m512 x1 = load_bf16(p + i), x2 = load_bf16(p + half + i);
                const __m512 y1 = round_bf16(_mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, c)), round_bf16(_mm512_mul_ps(x2, s))));
                const __m512 y2 = round_bf16(_mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c)), round_bf16(_mm512_mul_ps(x1, s))));
                store_bf16(p + i, y1);
                store_bf16(p + half + i, y2);
            }
        }
    }
    return KVT_OK;
}

/* out[r] = bf16(bf16(silu(gate)) * up) with gate = gate_up[r][0:inter], up = gate_up[r][inter:2 inter] */
int kvt_silu_mul_bf16(const void *gate_up_, int64_t rows, int64_t inter, void *out_) {
    if (rows <= 0 || inter <= 0 || inter % 16 != 0) return KVT_UNSUPPORTED;
    const uint16_t *gu = (const uint16_t *)gate_up_;
    uint16_t *out = (uint16_t *)out_;
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        for (int64_t i = 0; i < inter; i += 16) {
            const __m512 v = load_bf16(g + i);
            const __m512 silu = round_bf16(_mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), v)))));
            store_bf16(o + i, round_bf16(_mm512_mul_ps(silu, load_bf16(u + i))));
        }
    }
    return KVT_OK;
}

#else /* no AVX-512: the torch ops serve */

int kvt_has_layer_ops(void) { return 0; }
int kvt_add_rms_norm_bf16(const void *x, int64_t ldx, void *residual, const void *weight, void *out, int64_t rows,
                          int64_t hidden, float eps) {
    (void)x; (void)ldx; (void)residual; (void)weight; (void)out; (void)rows; (void)hidden; (void)eps;
    return KVT_UNSUPPORTED;
}
int kvt_rope_bf16(void *x, int64_t tokens, int64_t heads, int64_t dim, int64_t ld, const void *cos, const void *sin) {
    (void)x; (void)tokens; (void)heads; (void)dim; (void)ld; (void)cos; (void)sin;
    return KVT_UNSUPPORTED;
}
int kvt_silu_mul_bf16(const void *gate_up, int64_t rows, int64_t inter, void *out) {
    (void)gate_up; (void)rows; (void)inter; (void)out;
    return KVT_UNSUPPORTED;
}
#endif
