/* Projections on weights kept quantized (kvtier.model.quant_linear, loaded by kvtier.model.native).
 *
 * A weight W [N, K] is stored in blocks of 32 consecutive elements of a row, each block b of row n
 * with a float16 scale d[n][b] and, for affine formats, a float16 offset m[n][b]:
 *
 *     W[n][32 b + i] = d[n][b] * q[n][32 b + i] + m[n][b]        (m = 0 where m is NULL)
 *
 *   KVT_Q8     q int8, one byte per element (GGUF Q8_0 as it is; Q5_*, and 8-bit weight-only
 *              quantization of a float checkpoint)
 *   KVT_Q4     q 0..15, two per byte (GGUF Q4_0 is m = -8 d; Q4_1 and the sub-blocks of Q4_K as they are)
 *   KVT_Q8S16  q int8 as KVT_Q8, and each 16-element half h of a block one more int8 scale s[n][b][h]:
 *              W = d s q + m. GGUF Q6_K as it is (d its super-block's scale, s its 16-element
 *              scales, q = its 6-bit value - 32); parts of fused projections beside a Q6_K one (s = 1)
 *
 * Layout. The kernels read a row's blocks in groups of GROUP = 8 (256 elements), interleaved so that
 * one vector of 16 int16 holds the same two neighbouring elements (2t, 2t+1) of each of the 8 blocks:
 * position p = 16 t + 2 j + e of a group holds element 2 t + e of its block j. An integer multiply-add
 * of such a vector with x in the same order (vpdpwssd / vpmaddwd: pairs of products summed into int32
 * lanes) leaves block j's partial sum in int32 lane j, so after the group's 16 vectors lane j is block
 * j's whole dot product, and the scales apply once per group as one vector multiply and FMA, with no
 * horizontal sums per block. KVT_Q8 stores the 256 positions as bytes in order; KVT_Q4 stores byte i
 * (0..127) of a group as position i in its low nibble and position i + 128 in its high nibble, so one
 * 16-byte load gives vectors t and t + 8. KVT_Q8S16 stores KVT_Q8's 256 bytes, then the 8 blocks'
 * scales of elements 0..15 and the 8 of elements 16..31 (272 bytes): vectors t < 8 hold the first
 * halves of the blocks and t >= 8 the second, so one int32 accumulator per half keeps them apart and
 * each gets its 8 lanes' scales d s. Blocks past the last whole group (nb % 8 of them) keep the GGUF
 * order of one block: Q8 bytes in element order, Q4 byte i holding elements i (low nibble) and
 * i + 16 (high), Q8S16 the 32 bytes in element order then its two scales (34 bytes).
 * quant_linear.QuantWeight.interleave() builds this layout at load.
 *
 *     out[r][n] = sum_b d[n][b] dx[r][b] (sum_i q[n][32 b + i] qx[r][32 b + i]) + m[n][b] xsum[r][b]  (+ bias[n])
 *
 * (KVT_Q8S16: the inner sum of each half h times s[n][b][h].)
 *
 * x meets the weights as int16 per block of 32 (qx = round(x / dx), dx = max|x| / 32767: a relative
 * step of 3e-5), so the products are exact integers (|q qx| <= 128 * 32767, 32 of them < 2^31);
 * xsum[r][b] is the float32 sum of x over the block. The output is rounded once to the caller's dtype.
 *
 * kvt_quant_linear: every weight byte is read from memory once per call. Threads (the process's
 * OpenMP team, torch's) take chunks of weight rows dynamically (a thread whose core another process
 * holds takes fewer). One row of x prefetches weight rows ahead; several rows meet each chunk of 32
 * weight rows in tiles of 8 (4 without AVX-512VL's 32 registers), 4, 2 and 1 rows of x that stay in
 * L1, so a weight vector decoded once serves a tile (KVT_Q8S16, with two accumulators a row, in tiles
 * of 4). kvt_quant_dequant writes W out (float32 or bfloat16; KVT_Q8S16 as (d s) q + m in float32,
 * where d s is exact, so a Q6_K weight's values are those of GGUF's dequantization bit for bit) for
 * callers that run a dense GEMM or check values.
 * Needs K % 32 == 0, AVX2, FMA and F16C; anything else is KVT_UNSUPPORTED and the caller runs
 * torch ops on the dequantized weight.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_common.h"

#ifndef KVT_UNITY /* decode_model_f32.c includes this file */
int kvt_abi_version(void) { return 1; }
#endif

enum { KVT_Q8 = 0, KVT_Q4 = 1, KVT_Q8S16 = 2 };
enum { KVT_XF32 = 0, KVT_XBF16 = 1 };
enum { GROUP = 8, GROUP_ELEMS = 256 };
enum { NCHUNK = 32, PREFETCH_ROWS = 4 }; /* weight rows per chunk a thread takes; rows prefetched ahead */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

int kvt_has_quant_linear(void) { return 1; }

#if defined(__AVX512VL__)
#define KVT_TILE 8 /* rows of x per pass over a weight chunk: 8 int32 + 8 float accumulators */
#else
#define KVT_TILE 4 /* 16 vector registers */
#endif
/* KVT_Q8S16 keeps two int32 accumulators a row: in tiles of 4 it was 1.1-1.3x faster than in tiles
 * of 8 (16 + 8 accumulators) at 8 and 16 rows of SmolLM2's shapes (one thread, GCC 12, AVX-512) */
#define KVT_TILE_S16 4

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* Bytes of an interleaved group of 8 blocks, of a tail block and of a row of K elements. */
static inline int64_t group_bytes(int fmt) { return fmt == KVT_Q4 ? 128 : fmt == KVT_Q8 ? 256 : 272; }
static inline int64_t block_bytes(int fmt) { return fmt == KVT_Q4 ? 16 : fmt == KVT_Q8 ? 32 : 34; }
static inline int64_t row_bytes(int fmt, int64_t K) {
    const int64_t nb = K / 32;
    return nb / GROUP * group_bytes(fmt) + nb % GROUP * block_bytes(fmt);
}

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

/* acc + the pairwise products of w and x summed into int32 lanes (exact). */
static inline __attribute__((always_inline)) __m256i madd16(__m256i acc, __m256i w, const int16_t *x) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, w, xv);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(w, xv));
#endif
}

/* Vectors t and t + 8 (t < 8) of an interleaved group (see the layout above) as 16 int16 each. */
static inline __attribute__((always_inline)) void group_words(int fmt, const uint8_t *qg, int t, __m256i *lo,
                                                             __m256i *hi) {
    if (fmt != KVT_Q4) {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qg + 16 * t)));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qg + 16 * (t + 8))));
        return;
    }
    const __m128i bytes = _mm_loadu_si128((const __m128i *)(qg + 16 * t));
    const __m128i mask = _mm_set1_epi8(0x0f);
    *lo = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
    *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
}

/* A tail block (GGUF order) as two vectors of 16 int16: elements 0..15 and 16..31. */
static inline __attribute__((always_inline)) void block_words(int fmt, const uint8_t *q, __m256i *lo, __m256i *hi) {
    if (fmt != KVT_Q4) {
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
        return;
    }
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    const __m128i mask = _mm_set1_epi8(0x0f);
    *lo = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, mask));
    *hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
}

/* sum_b m[b] xsum[b], 8 blocks at a time. */
static inline float offset_sum(const uint16_t *mrow, const float *xs, int64_t nb) {
    if (mrow == NULL) return 0.0f;
    __m256 o = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8)
        o = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mrow + b))), _mm256_loadu_ps(xs + b), o);
    float total = hsum(o);
    for (; b < nb; b++) total += half_to_float(mrow[b]) * xs[b];
    return total;
}

/* R rows of x (qx[r], dx[r], xs[r]) against weight row n: sums[r] = out[r][n] without the bias. R is a
 * constant at each call, so every copy is specialised (fmt is for KVT_Q8S16: see linear_rows). Per
 * group: each weight vector is decoded once and multiplied into R int32 accumulators (lane j: block
 * j); then one float FMA per row applies the 8 blocks' scales d dx. KVT_Q8S16 keeps vectors t < 8
 * (first halves) and t >= 8 (second halves) in two accumulators a row and scales each by its d s. */
static inline __attribute__((always_inline)) void dot_rows(int fmt, int R, const uint8_t *qrow, const uint16_t *drow,
                                                          const uint16_t *mrow, int64_t nb,
                                                          const int16_t *const *qx, const float *const *dx,
                                                          const float *const *xs, float *sums) {
    const int64_t groups = nb / GROUP;
    const int64_t gbytes = group_bytes(fmt), qstride = block_bytes(fmt);
    const int split = fmt == KVT_Q8S16; /* one accumulator per half block */
    __m256 acc[KVT_TILE];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *qg = qrow + g * gbytes;
        __m256i p[KVT_TILE], p2[KVT_TILE];
        for (int r = 0; r < R; r++) p[r] = p2[r] = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++) {
            __m256i lo, hi;
            group_words(fmt, qg, t, &lo, &hi);
            for (int r = 0; r < R; r++) {
                const int16_t *xg = qx[r] + g * GROUP_ELEMS;
                if (R == 1 || split) { /* R == 1: two chains, one row has nothing else to overlap with */
                    p[r] = madd16(p[r], lo, xg + 16 * t);
                    p2[r] = madd16(p2[r], hi, xg + 16 * (t + 8));
                } else {
                    p[r] = madd16(madd16(p[r], lo, xg + 16 * t), hi, xg + 16 * (t + 8));
                }
            }
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(drow + g * GROUP)));
        if (split) {
            const __m128i sc = _mm_loadu_si128((const __m128i *)(qg + GROUP_ELEMS)); /* 8 first, 8 second halves */
            const __m256 dlo = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
            const __m256 dhi = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc))));
            for (int r = 0; r < R; r++) {
                const __m256 both = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p2[r]), dhi,
                                                    _mm256_mul_ps(_mm256_cvtepi32_ps(p[r]), dlo));
                acc[r] = _mm256_fmadd_ps(both, _mm256_loadu_ps(dx[r] + g * GROUP), acc[r]);
            }
            continue;
        }
        for (int r = 0; r < R; r++) {
            const __m256i total = R == 1 ? _mm256_add_epi32(p[r], p2[r]) : p[r];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(dw, _mm256_loadu_ps(dx[r] + g * GROUP)),
                                     acc[r]);
        }
    }
    for (int64_t b = groups * GROUP; b < nb; b++) { /* the tail blocks, one at a time */
        __m256i lo, hi;
        const uint8_t *qb = qrow + groups * gbytes + (b - groups * GROUP) * qstride;
        block_words(fmt, qb, &lo, &hi);
        const float dwb = half_to_float(drow[b]);
        if (split) {
            const float dlo = dwb * (float)(int8_t)qb[32], dhi = dwb * (float)(int8_t)qb[33];
            for (int r = 0; r < R; r++) {
                const __m256i plo = madd16(_mm256_setzero_si256(), lo, qx[r] + 32 * b);
                const __m256i phi = madd16(_mm256_setzero_si256(), hi, qx[r] + 32 * b + 16);
                const __m256 both = _mm256_fmadd_ps(_mm256_cvtepi32_ps(phi), _mm256_set1_ps(dhi),
                                                    _mm256_mul_ps(_mm256_cvtepi32_ps(plo), _mm256_set1_ps(dlo)));
                acc[r] = _mm256_fmadd_ps(both, _mm256_set1_ps(dx[r][b]), acc[r]);
            }
            continue;
        }
        for (int r = 0; r < R; r++) {
            const __m256i pb = madd16(madd16(_mm256_setzero_si256(), lo, qx[r] + 32 * b), hi, qx[r] + 32 * b + 16);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pb), _mm256_set1_ps(dwb * dx[r][b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) sums[r] = hsum(acc[r]) + offset_sum(mrow, xs[r], nb);
}

static inline void store(void *out, int x_kind, int64_t at, float v) {
    if (x_kind == KVT_XF32)
        ((float *)out)[at] = v;
    else
        ((uint16_t *)out)[at] = float_to_bf16(v);
}

/* Rows r0 .. r0 + R - 1 of out for weight rows [n0, n1). */
static inline __attribute__((always_inline)) void tile_rows(int fmt, int R, int64_t r0, int64_t n0, int64_t n1,
                                                           const int16_t *qx, const float *dx, const float *xs,
                                                           int64_t K, const uint8_t *q, const uint16_t *d,
                                                           const uint16_t *m, const float *bias, void *out,
                                                           int64_t ldo, int x_kind) {
    const int64_t nb = K / 32;
    const int64_t qrow_bytes = row_bytes(fmt, K);
    const int16_t *qxs[KVT_TILE];
    const float *dxs[KVT_TILE], *xss[KVT_TILE];
    for (int r = 0; r < R; r++) {
        qxs[r] = qx + (r0 + r) * K;
        dxs[r] = dx + (r0 + r) * nb;
        xss[r] = xs + (r0 + r) * nb;
    }
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *qrow = q + n * qrow_bytes;
        const uint16_t *drow = d + n * nb;
        const uint16_t *mrow = m != NULL ? m + n * nb : NULL;
        if (R == 1 && n + PREFETCH_ROWS < n1) {
            /* one row reads each weight byte once: ask for the row PREFETCH_ROWS ahead (and its
             * scales), so that memory works while this one is computed */
            const uint8_t *ahead = qrow + PREFETCH_ROWS * qrow_bytes;
            for (int64_t at = 0; at < qrow_bytes; at += 64) _mm_prefetch((const char *)(ahead + at), _MM_HINT_T0);
            _mm_prefetch((const char *)(drow + PREFETCH_ROWS * nb), _MM_HINT_T0);
            if (mrow != NULL) _mm_prefetch((const char *)(mrow + PREFETCH_ROWS * nb), _MM_HINT_T0);
        }
        float sums[KVT_TILE];
        dot_rows(fmt, R, qrow, drow, mrow, nb, qxs, dxs, xss, sums);
        const float b = bias != NULL ? bias[n] : 0.0f;
        for (int r = 0; r < R; r++) store(out, x_kind, (r0 + r) * ldo + n, sums[r] + b);
    }
}

/* Weight rows [n0, n1) against every row of x: tiles of `tile` rows of x (a constant), then 4, 2, 1
 * for what is left. */
static inline __attribute__((always_inline)) void chunk_rows(int fmt, int tile, int64_t n0, int64_t n1,
                                                            const int16_t *qx, const float *dx, const float *xs,
                                                            int64_t M, int64_t K, const uint8_t *q, const uint16_t *d,
                                                            const uint16_t *m, const float *bias, void *out,
                                                            int64_t ldo, int x_kind) {
    int64_t r0 = 0;
    for (; r0 + tile <= M; r0 += tile) tile_rows(fmt, tile, r0, n0, n1, qx, dx, xs, K, q, d, m, bias, out, ldo, x_kind);
#if KVT_TILE > 4
    for (; r0 + 4 <= M; r0 += 4) tile_rows(fmt, 4, r0, n0, n1, qx, dx, xs, K, q, d, m, bias, out, ldo, x_kind);
#endif
    for (; r0 + 2 <= M; r0 += 2) tile_rows(fmt, 2, r0, n0, n1, qx, dx, xs, K, q, d, m, bias, out, ldo, x_kind);
    for (; r0 < M; r0++) tile_rows(fmt, 1, r0, n0, n1, qx, dx, xs, K, q, d, m, bias, out, ldo, x_kind);
}

/* out for weight rows [0, N): chunks of weight rows taken dynamically by the threads. One row of x:
 * chunks as long as an even split into 16 allows (prefetch streams). A parallel region is outlined
 * before inlining, so a format passed in reaches its inner loops as a variable: KVT_Q8S16 has a
 * region of its own (its two accumulators a row and its tile); KVT_Q8 and KVT_Q4 share one that
 * tests the format per vector (a branch always taken the same way), where the body learns that the
 * format is one of those two, so that none of KVT_Q8S16's code is left in their loops (left there,
 * it cost them 5% at 8 and 16 rows). */
static void linear_rows(int fmt, const int16_t *qx, const float *dx, const float *xs, int64_t M, int64_t K,
                        const uint8_t *q, const uint16_t *d, const uint16_t *m, int64_t N, const float *bias, void *out,
                        int64_t ldo, int x_kind) {
    const int64_t step = M == 1 && (N + 15) / 16 > NCHUNK ? (N + 15) / 16 : NCHUNK;
    const int64_t chunks = (N + step - 1) / step;
    if (fmt == KVT_Q8S16) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * step, n1 = (c + 1) * step < N ? (c + 1) * step : N;
            chunk_rows(KVT_Q8S16, KVT_TILE_S16, n0, n1, qx, dx, xs, M, K, q, d, m, bias, out, ldo, x_kind);
        }
        return;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * step, n1 = (c + 1) * step < N ? (c + 1) * step : N;
        const int q8_or_q4 = fmt == KVT_Q4 ? KVT_Q4 : KVT_Q8; /* here, inside the outlined body */
        chunk_rows(q8_or_q4, KVT_TILE, n0, n1, qx, dx, xs, M, K, q, d, m, bias, out, ldo, x_kind);
    }
}

/* Position of element i (0..31) of block j (0..7) within an interleaved group. */
static inline int group_pos(int j, int i) { return (i >> 1) * 16 + 2 * j + (i & 1); }

/* x row (float32, K) -> int16 in the weights' layout, dx and xsum per block. */
static void quantize_row(const float *x, int64_t nb, int16_t *qx, float *dx, float *xs) {
    const int64_t grouped = nb / GROUP * GROUP;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.0f, s = 0.0f;
        for (int i = 0; i < 32; i++) {
            const float v = xb[i] < 0 ? -xb[i] : xb[i];
            amax = v > amax ? v : amax;
            s += xb[i];
        }
        xs[b] = s;
        const float scale = amax / 32767.0f;
        const float inv = scale > 0 ? 1.0f / scale : 0.0f;
        dx[b] = scale;
        if (b < grouped) {
            int16_t *g = qx + (b / GROUP) * GROUP_ELEMS;
            const int j = (int)(b % GROUP);
            for (int i = 0; i < 32; i++) g[group_pos(j, i)] = (int16_t)__builtin_lrintf(xb[i] * inv);
        } else {
            for (int i = 0; i < 32; i++) qx[32 * b + i] = (int16_t)__builtin_lrintf(xb[i] * inv);
        }
    }
}

int kvt_quant_linear(const void *x, int64_t M, int64_t ldx, int x_kind, const uint8_t *q, int fmt, const uint16_t *d,
                     const uint16_t *m, int64_t N, int64_t K, const float *bias, void *out, int64_t ldo) {
    if (K % 32 != 0 || M <= 0 || N <= 0 || (fmt != KVT_Q8 && fmt != KVT_Q4 && fmt != KVT_Q8S16) ||
        (x_kind != KVT_XF32 && x_kind != KVT_XBF16))
        return KVT_UNSUPPORTED;
    const int64_t nb = K / 32;
    /* scratch: int16 x [M, K], then dx and xsum [M, nb] each and one float32 row (bfloat16 x) */
    int16_t *qx = (int16_t *)aligned_alloc(64, (size_t)((M * K * 2 + (2 * M * nb + K) * 4 + 63) / 64 * 64));
    if (qx == NULL) return KVT_UNSUPPORTED;
    float *dx = (float *)(qx + M * K), *xs = dx + M * nb, *row = xs + M * nb;
    for (int64_t r = 0; r < M; r++) {
        const float *xr = (const float *)x + r * ldx;
        if (x_kind == KVT_XBF16) {
            const uint16_t *src = (const uint16_t *)x + r * ldx;
            for (int64_t k = 0; k < K; k++) row[k] = bf16_to_float(src[k]);
            xr = row;
        }
        quantize_row(xr, nb, qx + r * K, dx + r * nb, xs + r * nb);
    }
    linear_rows(fmt, qx, dx, xs, M, K, q, d, m, N, bias, out, ldo, x_kind);
    free(qx);
    return 0;
}

/* W [N, K] = d q + m (KVT_Q8S16: (d s) q + m) in float32 (or bfloat16), from the interleaved layout. */
int kvt_quant_dequant(const uint8_t *q, int fmt, const uint16_t *d, const uint16_t *m, int64_t N, int64_t K,
                      void *out, int out_kind) {
    if (K % 32 != 0 || (fmt != KVT_Q8 && fmt != KVT_Q4 && fmt != KVT_Q8S16) ||
        (out_kind != KVT_XF32 && out_kind != KVT_XBF16))
        return KVT_UNSUPPORTED;
    const int64_t nb = K / 32, groups = nb / GROUP;
    const int64_t qrow_bytes = row_bytes(fmt, K), gbytes = group_bytes(fmt);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *qrow = q + n * qrow_bytes;
        int16_t vals[GROUP_ELEMS]; /* one group (or tail block) in element order */
        for (int64_t b0 = 0; b0 < nb; b0 += (b0 < groups * GROUP ? GROUP : 1)) {
            const int grouped = b0 < groups * GROUP;
            const int8_t *sc = NULL; /* KVT_Q8S16: the halves' scales, first halves then second */
            if (grouped) {
                int16_t pos[GROUP_ELEMS];
                const uint8_t *qg = qrow + (b0 / GROUP) * gbytes;
                if (fmt == KVT_Q8S16) sc = (const int8_t *)(qg + GROUP_ELEMS);
                for (int t = 0; t < 8; t++) {
                    __m256i lo, hi;
                    group_words(fmt, qg, t, &lo, &hi);
                    _mm256_storeu_si256((__m256i *)(pos + 16 * t), lo);
                    _mm256_storeu_si256((__m256i *)(pos + 16 * (t + 8)), hi);
                }
                for (int j = 0; j < GROUP; j++)
                    for (int i = 0; i < 32; i++) vals[32 * j + i] = pos[group_pos(j, i)];
            } else {
                __m256i lo, hi;
                const uint8_t *qb = qrow + groups * gbytes + (b0 - groups * GROUP) * block_bytes(fmt);
                block_words(fmt, qb, &lo, &hi);
                if (fmt == KVT_Q8S16) sc = (const int8_t *)(qb + 32);
                _mm256_storeu_si256((__m256i *)vals, lo);
                _mm256_storeu_si256((__m256i *)(vals + 16), hi);
            }
            for (int j = 0; j < (grouped ? GROUP : 1); j++) {
                const int64_t b = b0 + j;
                const float dv = half_to_float(d[n * nb + b]), mv = m != NULL ? half_to_float(m[n * nb + b]) : 0.0f;
                /* d s: a float16 times an int8, exact in float32 (GGUF's Q6_K multiplies the same) */
                const float dlo = sc != NULL ? dv * (float)sc[grouped ? j : 0] : dv;
                const float dhi = sc != NULL ? dv * (float)sc[grouped ? GROUP + j : 1] : dv;
                const int64_t at = n * K + 32 * b;
                for (int i = 0; i < 32; i++) {
                    const float v = (i < 16 ? dlo : dhi) * (float)vals[32 * j + i] + mv;
                    if (out_kind == KVT_XF32)
                        ((float *)out)[at + i] = v;
                    else
                        ((uint16_t *)out)[at + i] = float_to_bf16(v);
                }
            }
        }
    }
    return 0;
}

#else

int kvt_has_quant_linear(void) { return 0; }

int kvt_quant_linear(const void *x, int64_t M, int64_t ldx, int x_kind, const uint8_t *q, int fmt, const uint16_t *d,
                     const uint16_t *m, int64_t N, int64_t K, const float *bias, void *out, int64_t ldo) {
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
