/* Small-batch bfloat16 projections for CPUs with AVX512-BF16 (kvtier.model.linear, loaded by
 * kvtier.model.native).
 *
 *     out[m][n] = bf16( sum_k x[m][k] * w[n][k]  (+ bias[n]) )      m < M (a few rows), n < N
 *
 * x [M, K] (row stride ldx), w [N, K] and out [M, N] (row stride ldo) are bfloat16; the weight is
 * the model's own dense weight, read in place (no packed copy). A decode step streams every
 * weight of the model once, so at decode-sized M what counts is how fast the weights come from
 * memory and how many products each 64-byte weight load feeds: one per row of x, in a register
 * block of RB rows x CB weight rows (16 float32 accumulators, each summing 32 products per
 * step), the 16 accumulators then reduced across their lanes together by a shuffle tree (45
 * instructions for 16 outputs instead of 16 separate reductions). Two ways to multiply, chosen
 * per CPU by measurement (kvtier.model.linear):
 *
 *   KVT_GEMM_DPBF16  vdpbf16ps: 32 bf16 products per instruction (fast where the CPU runs it at
 *                    full rate, e.g. Zen 4);
 *   KVT_GEMM_FMA     each weight vector widened in registers (a shift for the even elements of
 *                    its bf16 pairs, a mask for the odd ones) into two float32 vectors and
 *                    multiplied by float32 FMAs against x split the same way once per call: for
 *                    CPUs whose FMA units outrun their bf16 dot products (Intel without AMX runs
 *                    vdpbf16ps at about half the FMA rate), with the same bf16 bytes read.
 *
 * Either way the products of bf16 values are exact in float32 and the sums accumulate in float32,
 * as in oneDNN's bf16 GEMM; the output is rounded to nearest even once.
 *
 * Threads (the process's OpenMP team, torch's) split N into tiles of TILE_N columns, so each
 * streams its own part of the weight; within a tile, each block of CB weight rows is read from
 * memory once (prefetched while the block before computes) and serves every row of x from L1. Needs K % 32 == 0; anything else is KVT_UNSUPPORTED and the caller runs oneDNN.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_common.h"

int kvt_abi_version(void) { return 1; }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define RB 4       /* rows of x per register block */
#define CB 4       /* weight rows (output columns) per register block */
#define TILE_N 64  /* output columns per task */
#ifndef PF_BLOCKS
#define PF_BLOCKS 2 /* prefetch the weight rows this many blocks ahead (into L2: more misses in flight than L1 takes) */
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif

enum { KVT_GEMM_DPBF16 = 0, KVT_GEMM_FMA = 1 };

int kvt_has_linear_bf16(void) { return 1; }

/* r[4 g + j] = sum of the 16 lanes of v[4 g + j] */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 c[4];
    for (int g = 0; g < 4; g++) {
        const __m512 *u = v + 4 * g;
        /* per 128-bit lane: (u0 a+c, u1 a+c, u0 b+d, u1 b+d) for lane elements (a, b, c, d) */
        const __m512 a = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
        const __m512 b = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
        /* per 128-bit lane: the lane's sum of u0, u1, u2, u3 */
        c[g] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))));
    }
    /* sum the four 128-bit lanes: (c0 0+1, c0 2+3, c1 0+1, c1 2+3), then across */
    const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

/* Round the block's 16 sums (+ bias) to bf16 and store rows 0 .. R - 1: lane 4 r + c is
 * out[r][c]; bias4 repeats bias[n .. n + 3] in every 128-bit lane. */
static inline __attribute__((always_inline)) void store_block(const __m512 acc[16], const __m512 bias4,
                                                               uint16_t *out, int64_t ldo, int R) {
    const __m256i packed = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(reduce16(acc), bias4));
    uint64_t rows[4];
    _mm256_storeu_si256((__m256i *)rows, packed);
    for (int r = 0; r < R; r++) memcpy(out + r * ldo, &rows[r], sizeof rows[r]);
}

/* vdpbf16ps: rows 0 .. R - 1 (R <= RB) of x against weight rows 0 .. CB - 1 of w */
static inline __attribute__((always_inline)) void block_dp(const uint16_t *x, int64_t ldx, const uint16_t *w,
                                                            int64_t K, const __m512 bias4, uint16_t *out,
                                                            int64_t ldo, int R, const uint16_t *pf) {
    __m512 acc[RB * CB];
    for (int i = 0; i < RB * CB; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[CB];
        for (int c = 0; c < CB; c++) {
            wv[c] = (__m512bh)_mm512_loadu_si512((const void *)(w + c * K + k));
            if (pf != NULL) _mm_prefetch((const char *)(pf + c * K + k), PF_HINT); /* a later block's rows */
        }
        for (int r = 0; r < R; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * ldx + k));
            for (int c = 0; c < CB; c++) acc[r * CB + c] = _mm512_dpbf16_ps(acc[r * CB + c], xv, wv[c]);
        }
    }
    store_block(acc, bias4, out, ldo, R);
}

/* float32 FMAs: xs holds x split per 32-element step into 16 even then 16 odd float32 values
 * (row stride K); a weight vector's bf16 pairs widen to (even << 16) and (odd & 0xFFFF0000) */
static inline __attribute__((always_inline)) void block_fma(const float *xs, const uint16_t *w, int64_t K,
                                                             const __m512 bias4, uint16_t *out, int64_t ldo,
                                                             int R, const uint16_t *pf) {
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 acc[RB * CB];
    for (int i = 0; i < RB * CB; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512 we[CB], wo[CB];
        for (int c = 0; c < CB; c++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(w + c * K + k));
            if (pf != NULL) _mm_prefetch((const char *)(pf + c * K + k), PF_HINT); /* a later block's rows */
            we[c] = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
            wo[c] = _mm512_castsi512_ps(_mm512_and_si512(wv, hi));
        }
        for (int r = 0; r < R; r++) {
            const __m512 xe = _mm512_loadu_ps(xs + r * K + k), xo = _mm512_loadu_ps(xs + r * K + k + 16);
            for (int c = 0; c < CB; c++)
                acc[r * CB + c] = _mm512_fmadd_ps(wo[c], xo, _mm512_fmadd_ps(we[c], xe, acc[r * CB + c]));
        }
    }
    store_block(acc, bias4, out, ldo, R);
}

/* x [M, K] bf16 -> xs as block_fma reads it */
static void split_rows(const uint16_t *x, int64_t ldx, int64_t m, int64_t K, float *xs) {
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t k = 0; k < K; k += 32) {
        const __m512i xv = _mm512_loadu_si512((const void *)(x + m * ldx + k));
        _mm512_storeu_ps(xs + m * K + k, _mm512_castsi512_ps(_mm512_slli_epi32(xv, 16)));
        _mm512_storeu_ps(xs + m * K + k + 16, _mm512_castsi512_ps(_mm512_and_si512(xv, hi)));
    }
}

int kvt_linear_bf16(const void *x_, int64_t M, int64_t ldx, const void *w_, int64_t N, int64_t K,
                    const void *bias_, void *out_, int64_t ldo, int variant) {
    if (M <= 0 || N <= 0 || K <= 0 || K % 32 != 0 || N % CB != 0 || ldx < K || ldo < N ||
        (variant != KVT_GEMM_DPBF16 && variant != KVT_GEMM_FMA))
        return KVT_UNSUPPORTED;
    const uint16_t *x = (const uint16_t *)x_, *w = (const uint16_t *)w_, *bias = (const uint16_t *)bias_;
    uint16_t *out = (uint16_t *)out_;
    float *xs = NULL;
    if (variant == KVT_GEMM_FMA) {
        xs = (float *)aligned_alloc(64, (size_t)(M * K) * sizeof(float));
        if (xs == NULL) return KVT_UNSUPPORTED;
    }
    const int64_t tiles = (N + TILE_N - 1) / TILE_N;
#pragma omp parallel
    {
        if (xs != NULL) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) split_rows(x, ldx, m, K, xs);
        } /* the implied barrier: every row is split before any tile starts */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n_end = (t + 1) * TILE_N < N ? (t + 1) * TILE_N : N;
            /* each block of CB weight rows comes from memory once (prefetched during the block
             * before) and serves every row of x from L1 */
            for (int64_t n = t * TILE_N; n < n_end; n += CB) {
                __m512 bias4 = _mm512_setzero_ps();
                if (bias != NULL) {
                    float b[4];
                    for (int c = 0; c < CB; c++) b[c] = bits_to_f32((uint32_t)bias[n + c] << 16);
                    bias4 = _mm512_broadcast_f32x4(_mm_loadu_ps(b));
                }
                const uint16_t *wr = w + n * K;
                for (int64_t m0 = 0; m0 < M; m0 += RB) {
                    const int R = M - m0 < RB ? (int)(M - m0) : RB;
                    /* the first pass over the block fetches a later block's rows ahead of use */
                    const uint16_t *pf = m0 == 0 && n + PF_BLOCKS * CB < N ? wr + PF_BLOCKS * CB * K : NULL;
                    uint16_t *o = out + m0 * ldo + n;
                    if (xs != NULL) {
                        const float *xr = xs + m0 * K;
                        switch (R) { /* constant R: each case unrolled for its row count */
                        case 4: block_fma(xr, wr, K, bias4, o, ldo, 4, pf); break;
                        case 3: block_fma(xr, wr, K, bias4, o, ldo, 3, pf); break;
                        case 2: block_fma(xr, wr, K, bias4, o, ldo, 2, pf); break;
                        default: block_fma(xr, wr, K, bias4, o, ldo, 1, pf); break;
                        }
                    } else {
                        const uint16_t *xr = x + m0 * ldx;
                        switch (R) {
                        case 4: block_dp(xr, ldx, wr, K, bias4, o, ldo, 4, pf); break;
                        case 3: block_dp(xr, ldx, wr, K, bias4, o, ldo, 3, pf); break;
                        case 2: block_dp(xr, ldx, wr, K, bias4, o, ldo, 2, pf); break;
                        default: block_dp(xr, ldx, wr, K, bias4, o, ldo, 1, pf); break;
                        }
                    }
                }
            }
        }
    }
    free(xs);
    return KVT_OK;
}

#else /* no AVX512-BF16: oneDNN serves */

int kvt_has_linear_bf16(void) { return 0; }

int kvt_linear_bf16(const void *x, int64_t M, int64_t ldx, const void *w, int64_t N, int64_t K, const void *bias,
                    void *out, int64_t ldo, int variant) {
    (void)x; (void)M; (void)ldx; (void)w; (void)N; (void)K; (void)bias; (void)out; (void)ldo; (void)variant;
    return KVT_UNSUPPORTED;
}
#endif
