/* The small per-layer ops of a float32 decoder, fused (kvtier.model.layer_ops, loaded by
 * kvtier.model.native): residual add + RMSNorm, rotary embedding in place, SiLU(gate) * up.
 *
 * Used by models whose projections already sum in another order than transformers' (weights kept
 * quantized: kvtier.model.quant_linear), where a decode step's time is mostly these ops as torch
 * dispatches on a few rows; float32 models with dense weights keep the torch ops, which match
 * transformers bit for bit. Each value is computed as the torch ops of kvtier.model.llama compute
 * it (products and sums rounded one at a time: this file is compiled as ISO C, so no FMA
 * contraction), except the norm's mean (another summation order) and SiLU's exp (the C library's).
 * Plain C: the compiler vectorizes the elementwise loops for whatever CPU it builds for.
 */
#include <math.h>
#include <stdint.h>

#include "kv_common.h"

#ifndef KVT_UNITY /* decode_model_f32.c includes this file */
int kvt_abi_version(void) { return 1; }
#endif

int kvt_has_layer_ops_f32(void) { return 1; }

#define PARALLEL_MIN_ELEMS 32768 /* below this, one thread: the team's fork costs more */

/* out[r] = weight * (v / sqrt(mean(v^2) + eps)) with v = x[r] (+ residual[r], stored back). */
int kvt_add_rms_norm_f32(const float *x, int64_t ldx, float *residual, const float *weight, float *out, int64_t rows,
                         int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) if (rows * hidden >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *o = out + r * hidden;
        float *res = residual != NULL ? residual + r * hidden : NULL;
        float sum = 0.0f;
        if (res != NULL) {
            for (int64_t k = 0; k < hidden; k++) {
                const float v = res[k] + xr[k];
                res[k] = v;
                o[k] = v;
            }
        } else {
            for (int64_t k = 0; k < hidden; k++) o[k] = xr[k];
        }
        for (int64_t k = 0; k < hidden; k++) sum += o[k] * o[k];
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int64_t k = 0; k < hidden; k++) {
            const float t = o[k] * inv;
            o[k] = weight[k] * t;
        }
    }
    return 0;
}

/* x [tokens, heads, dim] (row stride ld per token, heads contiguous) rotated in place by cos, sin
 * [tokens, dim / 2]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). */
int kvt_rope_f32(float *x, int64_t tokens, int64_t heads, int64_t dim, int64_t ld, const float *cos_,
                 const float *sin_) {
    const int64_t half = dim / 2;
    if (dim % 2 != 0) return KVT_UNSUPPORTED;
#pragma omp parallel for schedule(static) if (tokens * heads * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_ + t * half, *s = sin_ + t * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * ld + h * dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i] * c[i] - x2[i] * s[i];
                const float b = x2[i] * c[i] + x1[i] * s[i];
                x1[i] = a;
                x2[i] = b;
            }
        }
    }
    return 0;
}

/* out [rows, inter] = silu(gate) * up, gate_up = [gate | up] [rows, 2 inter]. */
int kvt_silu_mul_f32(const float *gate_up, int64_t rows, int64_t inter, float *out) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float silu = g[i] / (1.0f + expf(-g[i]));
            o[i] = silu * u[i];
        }
    }
    return 0;
}
