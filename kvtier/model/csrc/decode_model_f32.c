/* A whole decode step of a float32 decoder with quantized projections in one call
 * (kvtier.model.fused_decode, loaded by kvtier.model.native).
 *
 * On a small model a decode step is mostly overhead: SmolLM2-135M runs 30 layers of 4 projections
 * and a handful of small ops on one row, and each op dispatched from Python (a torch op or a ctypes
 * call, its tensor allocations and views) costs a few microseconds where the op itself is a few
 * hundred nanoseconds. This file runs every layer of a step of decode rows (one new token per
 * sequence) in C, calling the same kernels the per-op path calls, in the same order, on the same
 * float32 values: the projections of quant_gemm.c, the norm, rope and SiLU of layer_ops_f32.c, and
 * the paged attention of decode_attention_f32.c (included below, one translation unit). So its
 * output equals the per-op path's where that path runs decode_attention_f32.c (CPUs without the
 * AVX-512 kernel of paged_attention.c), bit for bit; elsewhere the attention's sums are in another
 * order (float32 rounding). Per layer, for T rows with the residual stream res:
 *
 *     res += h (layer 0: res = embeddings); x = norm_in(res)
 *     qkv = x Wqkv^T (+ b); rope(q, k); K, V -> pool at slots; a = attention(q, pool)
 *     h = a Wo^T (+ b); res += h; x = norm_post(res)
 *     h = down(silu(gate) * up), [gate | up] = x Wgu^T (+ b)
 *
 * and after the last layer out = res + h (the stream before the final norm). The caller checks the
 * model fits (no per-head q/k norm, every projection quantized, a float32 pool) and falls back to
 * the per-op path where it does not.
 */
#define KVT_UNITY 1
#include "quant_gemm.c"
#include "layer_ops_f32.c"
#include "decode_attention_f32.c"

int kvt_abi_version(void) { return 1; }

/* One quantized projection: the arguments of kvt_quant_linear (int64 fields, so that the struct has
 * no padding and ctypes mirrors it field for field). */
typedef struct {
    const uint8_t *q;
    const uint16_t *d;
    const uint16_t *m; /* NULL: symmetric */
    const float *bias; /* NULL: none */
    int64_t fmt, n, k;
} kvt_qproj;

typedef struct {
    const float *in_norm, *post_norm; /* [hidden] */
    kvt_qproj qkv, o, gate_up, down;
    float *pool; /* [2, Hkv, num_blocks, block_size, D] float32 */
} kvt_layer;

int kvt_has_decode_model_f32(void) { return kvt_has_quant_linear(); }

static int project(const kvt_qproj *p, const float *x, int64_t rows, float *out) {
    return kvt_quant_linear(x, rows, p->k, KVT_XF32, p->q, (int)p->fmt, p->d, p->m, p->n, p->k, p->bias, out, p->n);
}

/* h [T, hidden]: the step's embeddings in, the residual stream after the last layer out. Rows are
 * the decode sequences in order (T == batch); slots [T] where each row's K/V goes; block_tables
 * [T, max_blocks], seq_lens [T] (lengths after this step). */
int kvt_decode_model_f32(const kvt_layer *layers, int64_t num_layers, float *h, int64_t T, int64_t hidden,
                         int64_t num_heads, int64_t num_kv_heads, int64_t dim, int64_t inter, float eps,
                         const float *cos_, const float *sin_, const int64_t *slots, const int64_t *block_tables,
                         int64_t max_blocks, const int64_t *seq_lens, int64_t num_blocks, int64_t block_size,
                         float sm_scale) {
    if (!kvt_has_quant_linear() || T <= 0 || num_layers <= 0 || num_kv_heads <= 0 || block_size <= 0 ||
        num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP || dim % 8 != 0 || dim > MAX_DIM)
        return KVT_UNSUPPORTED; /* what the attention kernel takes: checked before anything is written */
    const int64_t qk_heads = num_heads + num_kv_heads, qkv_n = (num_heads + 2 * num_kv_heads) * dim;
    const int64_t q_n = num_heads * dim, num_slots = num_blocks * block_size;
    for (int64_t l = 0; l < num_layers; l++) {
        const kvt_layer *L = layers + l;
        if (L->qkv.n != qkv_n || L->qkv.k != hidden || L->o.n != hidden || L->o.k != q_n ||
            L->gate_up.n != 2 * inter || L->gate_up.k != hidden || L->down.n != hidden || L->down.k != inter)
            return KVT_UNSUPPORTED;
    }
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0 || slots[t] >= num_slots || seq_lens[t] <= 0 || seq_lens[t] > max_blocks * block_size)
            return KVT_BAD_INDEX;
        for (int64_t j = 0; j < (seq_lens[t] + block_size - 1) / block_size; j++)
            if (block_tables[t * max_blocks + j] < 0 || block_tables[t * max_blocks + j] >= num_blocks)
                return KVT_BAD_INDEX;
    }
    const int64_t widest = qkv_n > 2 * inter ? qkv_n : 2 * inter;
    const size_t floats = (size_t)(T * (2 * hidden + widest + inter + 2 * q_n));
    float *buf = (float *)aligned_alloc(64, (floats + 15) / 16 * 16 * sizeof(float));
    if (buf == NULL) return KVT_UNSUPPORTED;
    float *res = buf, *x = res + T * hidden, *wide = x + T * hidden, *act = wide + T * widest;
    float *q = act + T * inter, *attn = q + T * q_n;
    int rc = 0;
    for (int64_t l = 0; l < num_layers && rc == 0; l++) {
        const kvt_layer *L = layers + l;
        if (l == 0) {
            memcpy(res, h, (size_t)(T * hidden) * sizeof(float));
            kvt_add_rms_norm_f32(h, hidden, NULL, L->in_norm, x, T, hidden, eps);
        } else {
            kvt_add_rms_norm_f32(h, hidden, res, L->in_norm, x, T, hidden, eps);
        }
        if ((rc = project(&L->qkv, x, T, wide)) != 0) break;
        kvt_rope_f32(wide, T, qk_heads, dim, qkv_n, cos_, sin_);
        const int64_t head_stride = num_slots * dim; /* one KV head of K (or of V) in the pool */
        for (int64_t t = 0; t < T; t++) {
            const float *row = wide + t * qkv_n;
            memcpy(q + t * q_n, row, (size_t)q_n * sizeof(float));
            for (int64_t g = 0; g < num_kv_heads; g++) {
                float *kdst = L->pool + g * head_stride + slots[t] * dim;
                float *vdst = kdst + num_kv_heads * head_stride;
                memcpy(kdst, row + q_n + g * dim, (size_t)dim * sizeof(float));
                memcpy(vdst, row + q_n + (num_kv_heads + g) * dim, (size_t)dim * sizeof(float));
            }
        }
        if ((rc = kvt_decode_attention_f32(q, attn, L->pool, block_tables, max_blocks, seq_lens, T, num_heads,
                                           num_kv_heads, num_blocks, block_size, dim, sm_scale)) != 0)
            break;
        if ((rc = project(&L->o, attn, T, h)) != 0) break;
        kvt_add_rms_norm_f32(h, hidden, res, L->post_norm, x, T, hidden, eps);
        if ((rc = project(&L->gate_up, x, T, wide)) != 0) break;
        kvt_silu_mul_f32(wide, T, inter, act);
        if ((rc = project(&L->down, act, T, h)) != 0) break;
    }
    if (rc == 0)
        for (int64_t i = 0; i < T * hidden; i++) h[i] = res[i] + h[i];
    free(buf);
    return rc;
}
