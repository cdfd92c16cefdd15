/* Projections on weights kept quantized (kvtier.model.quant_linear, loaded by kvtier.model.native).
 *
 * A weight W [N, K] is stored in blocks of 32 consecutive elements of a row, each block b of row n
 * with a float16 scale d[n][b] and, for affine formats, a float16 offset m[n][b]:
 *
 *     W[n][32 b + i] = d[n][b] * q[n][32 b + i] + m[n][b]        (m = 0 where m is NULL)
 *
 *   KVT_Q8  q int8, one byte per element, [N, K] (GGUF Q8_0 as it is; Q5_*, and 8-bit weight-only
 *           quantization of a float checkpoint)
 *   KVT_Q4  q 0..15, two per byte, [N, K / 2]; byte i of a block holds element i in its low nibble
 *           and element i + 16 in its high nibble (GGUF's order: Q4_0 is m = -8 d, Q4_1 and the
 *           sub-blocks of Q4_K as they are)
 *
 *     out[r][n] = sum_b d[n][b] * (sum_i q[n][32 b + i] x[r][32 b + i]) + m[n][b] * xsum[r][b]  (+ bias[n])
 *
 * with xsum[r][b] the sum of x over block b, computed once per call in float32. x meets the
 * weights in one of three ways (x_mode):
 *   KVT_X_FLOAT  x widened to float32, float32 products and sums (FMA): the dequantized weight
 *                times x in float32, in another order
 *   KVT_X_INT16  x rounded to int16 per block of 32 (scale max|x| / 32767), exact integer products
 *                (vpmaddwd, or vpdpwssd with AVX512-VNNI), one float32 FMA per block: the default
 *   KVT_X_INT8   x rounded to int8 per block (llama.cpp's way), integer products (vpmaddubsw)
 * The output is rounded once to the caller's dtype.
 *
 * kvt_quant_linear serves few rows (a decode step): every weight byte is read from memory once per
 * call and decoded in registers. Threads (the process's OpenMP team, torch's) take chunks of weight
 * rows dynamically (a thread whose core another process holds takes fewer); one row of x (int16)
 * prefetches weight rows ahead; several rows meet each chunk of 32 weight rows in tiles of 8 (float;
 * 4 for int16 and int8) rows of x that stay in L1. For many rows (prefill) the caller dequantizes with
 * kvt_quant_dequant into a scratch weight and runs a dense GEMM.
 * Needs K % 32 == 0, AVX2, FMA and F16C; anything else is KVT_UNSUPPORTED and the caller runs
 * torch ops on the dequantized weight.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_common.h"

int kvt_abi_version(void) { return 1; }

enum { KVT_Q8 = 0, KVT_Q4 = 1 };
enum { KVT_XF32 = 0, KVT_XBF16 = 1 };
enum { KVT_X_FLOAT = 0, KVT_X_INT8 = 1, KVT_X_INT16 = 2 }; /* how x meets the weights: float32, int8 or int16 blocks */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

int kvt_has_quant_linear(void) { return 1; }

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

static inline float bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 elements of block b of one weight row as four float32 vectors (unscaled q). */
static inline __attribute__((always_inline)) void decode_block(int fmt, const uint8_t *q, __m256 w[4]) {
    if (fmt == KVT_Q8) {
        const __m128i lo = _mm_loadu_si128((const __m128i *)q);
        const __m128i hi = _mm_loadu_si128((const __m128i *)(q + 16));
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
        const __m128i mask = _mm_set1_epi8(0x0f);
        const __m128i lo = _mm_and_si128(bytes, mask);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    }
}

/* The offsets' part of out[r][n]: sum_b m[n][b] * xsum[r][b]. */
static inline float offset_sum(const uint16_t *mrow, const float *xsr, int64_t nb) {
    if (mrow == NULL) return 0.0f;
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++) total += half_to_float(mrow[b]) * xsr[b];
    return total;
}

/* One row of x against weight row n: the block's weights are scaled once (d q), then multiplied
 * into four independent accumulators, so consecutive blocks do not wait on one FMA chain. */
static inline __attribute__((always_inline)) float dot_row1(int fmt, const uint8_t *qrow, const uint16_t *drow,
                                                           int64_t nb, const float *x) {
    const int64_t qstride = fmt == KVT_Q8 ? 32 : 16;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        decode_block(fmt, qrow + b * qstride, w);
        const __m256 d = _mm256_set1_ps(half_to_float(drow[b]));
        const float *xb = x + 32 * b;
        a0 = _mm256_fmadd_ps(_mm256_mul_ps(w[0], d), _mm256_loadu_ps(xb), a0);
        a1 = _mm256_fmadd_ps(_mm256_mul_ps(w[1], d), _mm256_loadu_ps(xb + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_mul_ps(w[2], d), _mm256_loadu_ps(xb + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_mul_ps(w[3], d), _mm256_loadu_ps(xb + 24), a3);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* Four rows of x (x0 .. x3, which may repeat a row to fill the tile) against weight row n: the
 * block is decoded once for all four, two accumulators per row. */
static inline __attribute__((always_inline)) void dot_row4(int fmt, const uint8_t *qrow, const uint16_t *drow,
                                                          int64_t nb, const float *x0, const float *x1,
                                                          const float *x2, const float *x3, float sums[4]) {
    const int64_t qstride = fmt == KVT_Q8 ? 32 : 16;
    __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a10 = _mm256_setzero_ps(), a11 = _mm256_setzero_ps();
    __m256 a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps(), a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        decode_block(fmt, qrow + b * qstride, w);
        const __m256 d = _mm256_set1_ps(half_to_float(drow[b]));
        for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(w[j], d);
        const int64_t o = 32 * b;
#define KVT_ROW(X, A0, A1)                                              \
    A0 = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(X + o), A0);             \
    A1 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(X + o + 8), A1);         \
    A0 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(X + o + 16), A0);        \
    A1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(X + o + 24), A1);
        KVT_ROW(x0, a00, a01)
        KVT_ROW(x1, a10, a11)
        KVT_ROW(x2, a20, a21)
        KVT_ROW(x3, a30, a31)
#undef KVT_ROW
    }
    sums[0] = hsum(_mm256_add_ps(a00, a01));
    sums[1] = hsum(_mm256_add_ps(a10, a11));
    sums[2] = hsum(_mm256_add_ps(a20, a21));
    sums[3] = hsum(_mm256_add_ps(a30, a31));
}

/* Eight rows of x against weight row n: the block is decoded and scaled once for all eight, one
 * accumulator per row (eight independent FMA chains keep both FMA pipes busy). */
static inline __attribute__((always_inline)) void dot_row8(int fmt, const uint8_t *qrow, const uint16_t *drow,
                                                          int64_t nb, const float *x, int64_t ldx,
                                                          float sums[8]) {
    const int64_t qstride = fmt == KVT_Q8 ? 32 : 16;
    __m256 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        decode_block(fmt, qrow + b * qstride, w);
        const __m256 d = _mm256_set1_ps(half_to_float(drow[b]));
        for (int j = 0; j < 4; j++) w[j] = _mm256_mul_ps(w[j], d);
        const float *xb = x + 32 * b;
        for (int r = 0; r < 8; r++) {
            const float *xr = xb + r * ldx;
            a[r] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), a[r]);
            a[r] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), a[r]);
            a[r] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), a[r]);
            a[r] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), a[r]);
        }
    }
    for (int r = 0; r < 8; r++) sums[r] = hsum(a[r]);
}

static inline void store(void *out, int x_kind, int64_t at, float v) {
    if (x_kind == KVT_XF32)
        ((float *)out)[at] = v;
    else
        ((uint16_t *)out)[at] = float_to_bf16(v);
}

/* The rows of out for weight rows [0, N), one format (a constant, so each copy is specialised).
 * Several rows of x: the weight rows are taken in chunks of NCHUNK (a few KB of blocks, which stay
 * in L1/L2), and each chunk meets x in tiles of 8 rows (then 4), so that a tile of x (8 K floats)
 * stays in L1 across the chunk's weight rows instead of all M rows streaming through for each.
 * Threads take chunks dynamically: where another process holds one of the cores, the thread on the
 * free core takes the larger share instead of waiting at the end for an even split. */
enum { NCHUNK = 32, PREFETCH_ROWS = 4 };
static inline __attribute__((always_inline)) void linear_rows(int fmt, const float *xf, const float *xs, int64_t M,
                                                             int64_t K, const uint8_t *q, const uint16_t *d,
                                                             const uint16_t *m, int64_t N, const float *bias,
                                                             void *out, int64_t ldo, int x_kind) {
    const int64_t nb = K / 32;
    const int64_t qrow_bytes = fmt == KVT_Q8 ? K : K / 2;
    if (M == 1) { /* nothing to reuse: chunks as long as an even split into 16 allows (prefetch streams) */
        const int64_t step = (N + 15) / 16 > NCHUNK ? (N + 15) / 16 : NCHUNK;
        const int64_t runs = (N + step - 1) / step;
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t c = 0; c < runs; c++) {
            const int64_t n_end = (c + 1) * step < N ? (c + 1) * step : N;
            for (int64_t n = c * step; n < n_end; n++) {
                const uint16_t *mrow = m != NULL ? m + n * nb : NULL;
                const float b = bias != NULL ? bias[n] : 0.0f;
                store(out, x_kind, n,
                      dot_row1(fmt, q + n * qrow_bytes, d + n * nb, nb, xf) + offset_sum(mrow, xs, nb) + b);
            }
        }
        return;
    }
    const int64_t chunks = (N + NCHUNK - 1) / NCHUNK;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n_end = (c + 1) * NCHUNK < N ? (c + 1) * NCHUNK : N;
        int64_t r0 = 0;
        for (; r0 + 8 <= M; r0 += 8) {
            for (int64_t n = c * NCHUNK; n < n_end; n++) {
                const uint16_t *mrow = m != NULL ? m + n * nb : NULL;
                const float b = bias != NULL ? bias[n] : 0.0f;
                float sums[8];
                dot_row8(fmt, q + n * qrow_bytes, d + n * nb, nb, xf + r0 * K, K, sums);
                for (int r = 0; r < 8; r++)
                    store(out, x_kind, (r0 + r) * ldo + n, sums[r] + offset_sum(mrow, xs + (r0 + r) * nb, nb) + b);
            }
        }
        for (; r0 < M; r0 += 4) {
            const int64_t last = M - 1;
            const int64_t r1 = r0 + 1 < M ? r0 + 1 : last, r2 = r0 + 2 < M ? r0 + 2 : last,
                          r3 = r0 + 3 < M ? r0 + 3 : last;
            for (int64_t n = c * NCHUNK; n < n_end; n++) {
                const uint16_t *mrow = m != NULL ? m + n * nb : NULL;
                const float b = bias != NULL ? bias[n] : 0.0f;
                float sums[4];
                dot_row4(fmt, q + n * qrow_bytes, d + n * nb, nb, xf + r0 * K, xf + r1 * K, xf + r2 * K, xf + r3 * K,
                         sums);
                for (int r = 0; r < 4 && r0 + r < M; r++)
                    store(out, x_kind, (r0 + r) * ldo + n, sums[r] + offset_sum(mrow, xs + (r0 + r) * nb, nb) + b);
            }
        }
    }
}

/* ---- int8 activations (KVT_X_INT8): x quantized per block of 32 to int8 with a float scale, as
 * llama.cpp does for its quantized dot products, then 32 integer products per instruction pair
 * (vpmaddubsw + vpmaddwd) instead of 32 float FMAs on weights widened to float32. */

/* The block's 32 weights as bytes in element order: q8 as int8, q4 as 0..15. */
static inline __attribute__((always_inline)) __m256i block_bytes(int fmt, const uint8_t *q) {
    if (fmt == KVT_Q8) return _mm256_loadu_si256((const __m256i *)q);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    const __m128i mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
}

/* sum_i w[i] x[i] of one block as 8 int32 lanes, exact (|products| <= 128 * 127 * 2 per int16 pair). */
static inline __attribute__((always_inline)) __m256i block_dot8(int fmt, __m256i w, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (fmt == KVT_Q8) /* vpmaddubsw multiplies unsigned by signed: move w's sign onto x */
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
}

static inline __attribute__((always_inline)) float dot8_row1(int fmt, const uint8_t *qrow, const uint16_t *drow,
                                                            int64_t nb, const int8_t *qx, const float *dx) {
    const int64_t qstride = fmt == KVT_Q8 ? 32 : 16;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m256i p0 = block_dot8(fmt, block_bytes(fmt, qrow + b * qstride), _mm256_loadu_si256((const __m256i *)(qx + 32 * b)));
        const __m256i p1 = block_dot8(fmt, block_bytes(fmt, qrow + (b + 1) * qstride),
                                      _mm256_loadu_si256((const __m256i *)(qx + 32 * (b + 1))));
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(drow[b]) * dx[b]), _mm256_cvtepi32_ps(p0), a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(drow[b + 1]) * dx[b + 1]), _mm256_cvtepi32_ps(p1), a1);
    }
    if (b < nb) {
        const __m256i p0 = block_dot8(fmt, block_bytes(fmt, qrow + b * qstride), _mm256_loadu_si256((const __m256i *)(qx + 32 * b)));
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(drow[b]) * dx[b]), _mm256_cvtepi32_ps(p0), a0);
    }
    return hsum(_mm256_add_ps(a0, a1));
}

static inline __attribute__((always_inline)) void dot8_row4(int fmt, const uint8_t *qrow, const uint16_t *drow,
                                                           int64_t nb, const int8_t *const qx[4],
                                                           const float *const dx[4], float sums[4]) {
    const int64_t qstride = fmt == KVT_Q8 ? 32 : 16;
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const __m256i w = block_bytes(fmt, qrow + b * qstride);
        const float dw = half_to_float(drow[b]);
        for (int r = 0; r < 4; r++) {
            const __m256i p = block_dot8(fmt, w, _mm256_loadu_si256((const __m256i *)(qx[r] + 32 * b)));
            a[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx[r][b]), _mm256_cvtepi32_ps(p), a[r]);
        }
    }
    for (int r = 0; r < 4; r++) sums[r] = hsum(a[r]);
}

/* ---- int16 activations (KVT_X_INT16): x quantized per block of 32 to int16 with a float scale
 * (dx = max|x| / 32767: a relative step of 3e-5, 256 times finer than int8), the weights widened to
 * int16, and 16 exact integer products per vpmaddwd: about half the instructions of the float path
 * per block, where one decode row is bound by instructions rather than by memory. */

/* The block's 32 weights as two vectors of 16 int16: elements 0..15 and 16..31. */
static inline __attribute__((always_inline)) void block_words(int fmt, const uint8_t *q, __m256i w[2]) {
    if (fmt == KVT_Q8) {
        w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
        return;
    }
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    const __m128i mask = _mm_set1_epi8(0x0f);
    w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
    w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
}

/* sum_i w[i] x[i] of one block as 8 int32 lanes, exact (|w x| <= 128 * 32767, 32 terms < 2^31);
 * one vpdpwssd per half where the CPU has AVX512-VNNI (its 256-bit form). */
static inline __attribute__((always_inline)) __m256i block_dot16(const __m256i w[2], const int16_t *x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i p = _mm256_dpwssd_epi32(_mm256_setzero_si256(), w[0], _mm256_loadu_si256((const __m256i *)x));
    return _mm256_dpwssd_epi32(p, w[1], _mm256_loadu_si256((const __m256i *)(x + 16)));
#else
    return _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(w[1], _mm256_loadu_si256((const __m256i *)(x + 16))));
#endif
}

/* One row of x against weight row n, offsets included: the blocks' scales d dx (and the offsets'
 * sum m xsum) are formed 8 blocks at a time in vectors, so the per-block work is the integer dot
 * product, one conversion and one FMA. */
static inline __attribute__((always_inline)) float dot16_row1(int fmt, const uint8_t *qrow, const uint16_t *drow,
                                                             const uint16_t *mrow, int64_t nb, const int16_t *qx,
                                                             const float *dx, const float *xs) {
    const int64_t qstride = fmt == KVT_Q8 ? 32 : 16;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), off = _mm256_setzero_ps();
    float offset = 0.0f;
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int64_t count = nb - b0 < 8 ? nb - b0 : 8;
        float sc[8];
        if (count == 8) {
            _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(drow + b0))),
                                               _mm256_loadu_ps(dx + b0)));
            if (mrow != NULL)
                off = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mrow + b0))),
                                      _mm256_loadu_ps(xs + b0), off);
        } else {
            for (int64_t j = 0; j < count; j++) {
                sc[j] = half_to_float(drow[b0 + j]) * dx[b0 + j];
                if (mrow != NULL) offset += half_to_float(mrow[b0 + j]) * xs[b0 + j];
            }
        }
        int64_t j = 0;
        for (; j + 1 < count; j += 2) {
            __m256i w0[2], w1[2];
            block_words(fmt, qrow + (b0 + j) * qstride, w0);
            block_words(fmt, qrow + (b0 + j + 1) * qstride, w1);
            const __m256i p0 = block_dot16(w0, qx + 32 * (b0 + j)), p1 = block_dot16(w1, qx + 32 * (b0 + j + 1));
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + j), _mm256_cvtepi32_ps(p0), a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + j + 1), _mm256_cvtepi32_ps(p1), a1);
        }
        if (j < count) {
            __m256i w0[2];
            block_words(fmt, qrow + (b0 + j) * qstride, w0);
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + j), _mm256_cvtepi32_ps(block_dot16(w0, qx + 32 * (b0 + j))), a0);
        }
    }
    return hsum(_mm256_add_ps(a0, a1)) + hsum(off) + offset;
}

static inline __attribute__((always_inline)) void dot16_row4(int fmt, const uint8_t *qrow, const uint16_t *drow,
                                                            int64_t nb, const int16_t *const qx[4],
                                                            const float *const dx[4], float sums[4]) {
    const int64_t qstride = fmt == KVT_Q8 ? 32 : 16;
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        __m256i w[2];
        block_words(fmt, qrow + b * qstride, w);
        const float dw = half_to_float(drow[b]);
        for (int r = 0; r < 4; r++)
            a[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * dx[r][b]), _mm256_cvtepi32_ps(block_dot16(w, qx[r] + 32 * b)), a[r]);
    }
    for (int r = 0; r < 4; r++) sums[r] = hsum(a[r]);
}

/* The rows of out for integer x (bits 8 or 16, a constant, so each copy is specialised): chunks of
 * weight rows taken dynamically as in linear_rows, x in tiles of 4 rows. */
static inline __attribute__((always_inline)) void linear_rows_int(int fmt, int bits, const void *qx, const float *dx,
                                                                 const float *xs, int64_t M, int64_t K,
                                                                 const uint8_t *q, const uint16_t *d,
                                                                 const uint16_t *m, int64_t N, const float *bias,
                                                                 void *out, int64_t ldo, int x_kind) {
    const int64_t nb = K / 32;
    const int64_t qrow_bytes = fmt == KVT_Q8 ? K : K / 2;
    const int64_t xrow_bytes = K * (bits / 8);
    const int64_t step = M == 1 && (N + 15) / 16 > NCHUNK ? (N + 15) / 16 : NCHUNK;
    const int64_t chunks = (N + step - 1) / step;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n_end = (c + 1) * step < N ? (c + 1) * step : N;
        for (int64_t r0 = 0; r0 < M; r0 += M == 1 ? 1 : 4) {
            const void *qxs[4];
            const float *dxs[4];
            for (int r = 0; r < 4; r++) {
                const int64_t row = r0 + r < M ? r0 + r : M - 1;
                qxs[r] = (const char *)qx + row * xrow_bytes;
                dxs[r] = dx + row * nb;
            }
            for (int64_t n = c * step; n < n_end; n++) {
                const uint8_t *qrow = q + n * qrow_bytes;
                const uint16_t *drow = d + n * nb;
                const uint16_t *mrow = m != NULL ? m + n * nb : NULL;
                const float b = bias != NULL ? bias[n] : 0.0f;
                if (M == 1) {
                    /* one row reads each weight byte once: ask for the row PREFETCH_ROWS ahead (and
                     * its scales), so that memory works while this one is computed */
                    if (n + PREFETCH_ROWS < n_end) {
                        const uint8_t *ahead = qrow + PREFETCH_ROWS * qrow_bytes;
                        for (int64_t at = 0; at < qrow_bytes; at += 64) _mm_prefetch((const char *)(ahead + at), _MM_HINT_T0);
                        _mm_prefetch((const char *)(drow + PREFETCH_ROWS * nb), _MM_HINT_T0);
                        if (mrow != NULL) _mm_prefetch((const char *)(mrow + PREFETCH_ROWS * nb), _MM_HINT_T0);
                    }
                    const float v = bits == 16 ? dot16_row1(fmt, qrow, drow, mrow, nb, (const int16_t *)qx, dx, xs)
                                               : dot8_row1(fmt, qrow, drow, nb, (const int8_t *)qx, dx) +
                                                     offset_sum(mrow, xs, nb);
                    store(out, x_kind, n, v + b);
                    continue;
                }
                float sums[4];
                if (bits == 16)
                    dot16_row4(fmt, qrow, drow, nb, (const int16_t *const *)qxs, dxs, sums);
                else
                    dot8_row4(fmt, qrow, drow, nb, (const int8_t *const *)qxs, dxs, sums);
                for (int r = 0; r < 4 && r0 + r < M; r++)
                    store(out, x_kind, (r0 + r) * ldo + n, sums[r] + offset_sum(mrow, xs + (r0 + r) * nb, nb) + b);
            }
        }
    }
}

/* x row -> integer blocks of `bits` (8 or 16): dx = max|x| / (2^(bits-1) - 1) per block, qx = round(x / dx). */
static void quantize_row(const float *x, int64_t nb, int bits, void *qx, float *dx) {
    const float top = bits == 16 ? 32767.0f : 127.0f;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float v = xb[i] < 0 ? -xb[i] : xb[i];
            amax = v > amax ? v : amax;
        }
        const float scale = amax / top;
        const float inv = scale > 0 ? 1.0f / scale : 0.0f;
        dx[b] = scale;
        for (int i = 0; i < 32; i++) {
            const long v = __builtin_lrintf(xb[i] * inv);
            if (bits == 16)
                ((int16_t *)qx)[32 * b + i] = (int16_t)v;
            else
                ((int8_t *)qx)[32 * b + i] = (int8_t)v;
        }
    }
}

int kvt_quant_linear(const void *x, int64_t M, int64_t ldx, int x_kind, int x_mode, const uint8_t *q, int fmt,
                     const uint16_t *d, const uint16_t *m, int64_t N, int64_t K, const float *bias, void *out,
                     int64_t ldo) {
    if (K % 32 != 0 || M <= 0 || N <= 0 || (fmt != KVT_Q8 && fmt != KVT_Q4) ||
        (x_kind != KVT_XF32 && x_kind != KVT_XBF16) || (x_mode != KVT_X_FLOAT && x_mode != KVT_X_INT8 && x_mode != KVT_X_INT16))
        return KVT_UNSUPPORTED;
    const int64_t nb = K / 32;
    float *xf = (float *)aligned_alloc(64, (size_t)((M * K + M * nb + 15) / 16 * 16) * sizeof(float));
    if (xf == NULL) return KVT_UNSUPPORTED;
    float *xs = xf + M * K;
    for (int64_t r = 0; r < M; r++) {
        float *dst = xf + r * K;
        if (x_kind == KVT_XF32) {
            memcpy(dst, (const float *)x + r * ldx, (size_t)K * sizeof(float));
        } else {
            const uint16_t *src = (const uint16_t *)x + r * ldx;
            for (int64_t k = 0; k < K; k++) dst[k] = bf16_to_float(src[k]);
        }
        for (int64_t b = 0; b < nb; b++) {
            float s = 0.0f;
            for (int i = 0; i < 32; i++) s += dst[32 * b + i];
            xs[r * nb + b] = s;
        }
    }
    if (x_mode == KVT_X_INT8) {
        int8_t *qx = (int8_t *)aligned_alloc(64, (size_t)((M * K + M * nb * 4 + 63) / 64 * 64));
        if (qx == NULL) {
            free(xf);
            return KVT_UNSUPPORTED;
        }
        float *dx = (float *)(qx + M * K); /* M K is a multiple of 32: aligned */
        for (int64_t r = 0; r < M; r++) quantize_row(xf + r * K, nb, 8, qx + r * K, dx + r * nb);
        if (fmt == KVT_Q8)
            linear_rows_int(KVT_Q8, 8, qx, dx, xs, M, K, q, d, m, N, bias, out, ldo, x_kind);
        else
            linear_rows_int(KVT_Q4, 8, qx, dx, xs, M, K, q, d, m, N, bias, out, ldo, x_kind);
        free(qx);
    } else if (x_mode == KVT_X_INT16) {
        int16_t *qx = (int16_t *)aligned_alloc(64, (size_t)((M * K * 2 + M * nb * 4 + 63) / 64 * 64));
        if (qx == NULL) {
            free(xf);
            return KVT_UNSUPPORTED;
        }
        float *dx = (float *)(qx + M * K); /* M K is a multiple of 32: aligned */
        for (int64_t r = 0; r < M; r++) quantize_row(xf + r * K, nb, 16, qx + r * K, dx + r * nb);
        if (fmt == KVT_Q8)
            linear_rows_int(KVT_Q8, 16, qx, dx, xs, M, K, q, d, m, N, bias, out, ldo, x_kind);
        else
            linear_rows_int(KVT_Q4, 16, qx, dx, xs, M, K, q, d, m, N, bias, out, ldo, x_kind);
        free(qx);
    } else if (fmt == KVT_Q8) {
        linear_rows(KVT_Q8, xf, xs, M, K, q, d, m, N, bias, out, ldo, x_kind);
    } else {
        linear_rows(KVT_Q4, xf, xs, M, K, q, d, m, N, bias, out, ldo, x_kind);
    }
    free(xf);
    return 0;
}

int kvt_quant_dequant(const uint8_t *q, int fmt, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K,
                      void *out, int out_kind) {
    if (K % 32 != 0 || (fmt != KVT_Q8 && fmt != KVT_Q4) || (out_kind != KVT_XF32 && out_kind != KVT_XBF16))
        return KVT_UNSUPPORTED;
    const int64_t nb = K / 32;
    const int64_t qstride = fmt == KVT_Q8 ? 32 : 16;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < nb; b++) {
            __m256 w[4];
            decode_block(fmt, q + n * nb * qstride + b * qstride, w);
            const __m256 dv = _mm256_set1_ps(half_to_float(d[n * nb + b]));
            const __m256 mv = _mm256_set1_ps(m != NULL ? half_to_float(m[n * nb + b]) : 0.0f);
            float vals[32];
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(vals + 8 * j, _mm256_fmadd_ps(w[j], dv, mv));
            const int64_t at = n * K + 32 * b;
            if (out_kind == KVT_XF32) {
                memcpy((float *)out + at, vals, sizeof vals);
            } else {
                uint16_t *o = (uint16_t *)out + at;
                for (int i = 0; i < 32; i++) o[i] = float_to_bf16(vals[i]);
            }
        }
    }
    return 0;
}

#else

int kvt_has_quant_linear(void) { return 0; }

int kvt_quant_linear(const void *x, int64_t M, int64_t ldx, int x_kind, int x_mode, const uint8_t *q, int fmt,
                     const uint16_t *d, const uint16_t *m, int64_t N, int64_t K, const float *bias, void *out,
                     int64_t ldo) {
    (void)x, (void)M, (void)ldx, (void)x_kind, (void)q, (void)fmt, (void)d, (void)m, (void)N, (void)K;
    (void)bias, (void)out, (void)ldo;
    return KVT_UNSUPPORTED;
}

int kvt_quant_dequant(const uint8_t *q, int fmt, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K,
                      void *out, int out_kind) {
    (void)q, (void)fmt, (void)d, (void)m, (void)N, (void)K, (void)out, (void)out_kind;
    return KVT_UNSUPPORTED;
}

#endif
