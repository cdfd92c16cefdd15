/* Paged decode attention for a float32 model and a float32 pool, in plain C (kvtier.model.attention,
 * loaded by kvtier.model.native): one new query token per sequence against its cached tokens,
 * read in place from the paged pool (no gather into a contiguous copy, no mask).
 *
 *     out[b, h] = softmax(q[b, h] . K[b, kv(h)]^T * sm_scale) V[b, kv(h)]
 *
 * pool [2, Hkv, num_blocks, block_size, D] (K then V), block_tables [B, max_blocks] and seq_lens
 * [B] int64, q and out [B, Hq, D]. Query heads g*G .. g*G+G-1 share KV head g (G = Hq / Hkv).
 * Two passes per (sequence, KV head): the G heads' scores of every cached token, then their
 * softmax and the weighted sum of V, all in float32 (the dot products as 8 interleaved partial
 * sums, which the compiler vectorizes without reassociating). Used by models whose projections
 * already sum in another order than transformers' (weights kept quantized), on CPUs without the
 * AVX-512 kernel of paged_attention.c; it agrees with SDPA to float32 rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kv_common.h"

#ifndef KVT_UNITY /* decode_model_f32.c includes this file */
int kvt_abi_version(void) { return 1; }
#endif

#define MAX_GROUP 16
#define MAX_DIM 256

static inline float dot(const float *a, const float *b, int64_t dim) {
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t d = 0; d < dim; d += 8)
        for (int j = 0; j < 8; j++) part[j] += a[d + j] * b[d + j];
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

int kvt_decode_attention_f32(const float *q, float *out, const float *pool, const int64_t *block_tables,
                             int64_t max_blocks, const int64_t *seq_lens, int64_t batch, int64_t num_heads,
                             int64_t num_kv_heads, int64_t num_blocks, int64_t block_size, int64_t dim,
                             float sm_scale) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP ||
        dim % 8 != 0 || dim > MAX_DIM || block_size <= 0)
        return KVT_UNSUPPORTED;
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++) {
        if (seq_lens[b] <= 0 || seq_lens[b] > max_blocks * block_size) return KVT_BAD_INDEX;
        for (int64_t j = 0; j < (seq_lens[b] + block_size - 1) / block_size; j++)
            if (block_tables[b * max_blocks + j] < 0 || block_tables[b * max_blocks + j] >= num_blocks)
                return KVT_BAD_INDEX;
        longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    }
    const int64_t group = num_heads / num_kv_heads;
    const int64_t head_stride = num_blocks * block_size * dim; /* one KV head of K (or of V) */
    const float *keys = pool, *values = pool + num_kv_heads * head_stride;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = (float *)malloc((size_t)(group * longest) * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t h = 0; h < num_kv_heads; h++) {
                if (scores == NULL) continue;
                const int64_t len = seq_lens[b];
                const int64_t *table = block_tables + b * max_blocks;
                const float *kh = keys + h * head_stride, *vh = values + h * head_stride;
                const float *qh = q + (b * num_heads + h * group) * dim;
                float *oh = out + (b * num_heads + h * group) * dim;
                float maxs[MAX_GROUP], sums[MAX_GROUP];
                for (int64_t g = 0; g < group; g++) maxs[g] = -INFINITY, sums[g] = 0.0f;
                for (int64_t t = 0; t < len; t++) {
                    const float *k = kh + (table[t / block_size] * block_size + t % block_size) * dim;
                    for (int64_t g = 0; g < group; g++) {
                        const float s = dot(qh + g * dim, k, dim) * sm_scale;
                        scores[g * len + t] = s;
                        maxs[g] = s > maxs[g] ? s : maxs[g];
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    float *sg = scores + g * len;
                    for (int64_t t = 0; t < len; t++) {
                        sg[t] = expf(sg[t] - maxs[g]);
                        sums[g] += sg[t];
                    }
                    for (int64_t d = 0; d < dim; d++) oh[g * dim + d] = 0.0f;
                }
                for (int64_t t = 0; t < len; t++) {
                    const float *v = vh + (table[t / block_size] * block_size + t % block_size) * dim;
                    for (int64_t g = 0; g < group; g++) {
                        const float p = scores[g * len + t];
                        float *o = oh + g * dim;
                        for (int64_t d = 0; d < dim; d++) o[d] += p * v[d];
                    }
                }
                for (int64_t g = 0; g < group; g++) {
                    const float inv = 1.0f / sums[g];
                    for (int64_t d = 0; d < dim; d++) oh[g * dim + d] *= inv;
                }
            }
        }
        free(scores);
    }
    return failed ? KVT_UNSUPPORTED : 0;
}
