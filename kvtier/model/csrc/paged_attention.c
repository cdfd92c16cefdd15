/* Paged decode attention for CPUs with AVX-512 (kvtier.model.attention, loaded by kvtier.model.native).
 *
 * One query token per sequence attends over its sequence's blocks straight from the paged pool, in
 * any KV storage (float32, bfloat16, fp8 e4m3 / e5m2, int8 with per-block scales): no gathered copy
 * of the context, no dequantized copy, and K/V bytes are read once. Per (sequence, KV head) task,
 * the G query heads that share the KV head go together, so each K and V row is converted once:
 *
 *     for each block of the sequence, each chunk of up to 16 tokens:
 *         s[g][t] = (q_g . k_t) * k_scale * sm_scale              (float32 dot products)
 *         online softmax: m_g' = max(m_g, max_t s), c = exp(m_g - m_g'),
 *                         l_g = l_g * c + sum_t exp(s - m_g'),  acc_g = acc_g * c + sum_t p * v_scale * v_t
 *     out_g = acc_g / l_g
 *
 * Tasks run in parallel on the process's OpenMP runtime (torch's). Without AVX-512 the entry
 * point reports KVT_UNSUPPORTED and the caller uses torch's SDPA.
 *
 * Layouts: q, out [B, Hq, D] contiguous; one layer's pool [2, Hkv, num_blocks, block_size, D];
 * scales [2, Hkv, num_blocks] float32 or NULL; block_tables [B, max_blocks]; seq_lens [B].
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kv_common.h"

#define MAX_GROUP 16 /* query heads per KV head */
#define MAX_DIM 256
#define CHUNK 16 /* tokens per softmax update: one vector of scores */

int kvt_abi_version(void) { return 1; }

#if defined(__AVX512F__)
#include <immintrin.h>

int kvt_has_decode_attention(void) { return 1; }

/* 16 values of a K or V row as float32; fp8 as value * 2^-(127 - bias), exactly (see unbias()) */
static inline __attribute__((always_inline)) __m512 load16(const void *row, int64_t c, int kind) {
    switch (kind) {
    case KVS_F32: return _mm512_loadu_ps((const float *)row + c);
    case KVS_BF16: {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + c)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
    case KVS_INT8:
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)row + c))));
    case KVS_E4M3: {
        __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)row + c)));
        return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(w, E4M3_SHIFT), _mm512_set1_epi32((int)E4M3_MASK)));
    }
    default: { /* KVS_E5M2 */
        __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)row + c)));
        return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(w, E5M2_SHIFT), _mm512_set1_epi32((int)E5M2_MASK)));
    }
    }
}

/* The factor load16 leaves out, folded into the block's scales: 2^(127 - bias) for fp8. */
static inline float unbias(int kind) { return kind == KVS_E4M3 ? E4M3_UNBIAS : kind == KVS_E5M2 ? E5M2_UNBIAS : 1.0f; }

/* r[t] = sum of the 16 lanes of a[t], t < 16: a transpose-and-add tree (45 shuffles and adds for
 * 16 sums, against ~10 operations for each sum on its own), then the tree's lane order undone. */
static inline __m512 sum16(const __m512 *a) {
    __m512 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane j of r holds token (j % 4) * 4 + j / 4, a 4 x 4 transpose: its own inverse */
    return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), r);
}

/* e^x for x <= 0 (down to -inf): 2^n * e^r, |r| <= ln2 / 2, degree-6 polynomial (~2 ulp) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static void store_row(void *out, int out_kind, const float *x, int64_t dim) {
    if (out_kind == KVT_F32) {
        memcpy(out, x, (size_t)dim * sizeof(float));
        return;
    }
    uint16_t *o = (uint16_t *)out;
    for (int64_t d = 0; d < dim; d++) o[d] = f32_to_bf16(x[d]);
}

typedef struct {
    const char *pool;
    const float *scales;
    int kind;
    int64_t heads, num_blocks, block_size, dim, elem;
} Layer;

static inline const char *kv_row(const Layer *L, int which, int64_t head, int64_t block, int64_t slot) {
    return L->pool + ((((which * L->heads + head) * L->num_blocks + block) * L->block_size + slot) * L->dim) * L->elem;
}

/* `kind` is a constant at each call site below: the loads specialise, no switch in the loops */
static inline __attribute__((always_inline)) void attend_kind(const Layer *L, const int kind, const float *q,
                                                               int64_t group, const int64_t *table, int64_t seq_len,
                                                               int64_t head, float sm_scale, float *out) {
    const int64_t dim = L->dim, nv = dim / 16, bs = L->block_size;
    __m512 qv[MAX_GROUP][MAX_DIM / 16], acc[MAX_GROUP][MAX_DIM / 16];
    float m[MAX_GROUP], l[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {
        for (int64_t c = 0; c < nv; c++) {
            qv[g][c] = _mm512_loadu_ps(q + g * dim + 16 * c);
            acc[g][c] = _mm512_setzero_ps();
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    float weights[MAX_GROUP][CHUNK] __attribute__((aligned(64)));
    __m512 part[MAX_GROUP][CHUNK]; /* per query head and token: 16 partial sums of q . k */
    for (int64_t g = 0; g < group; g++)
        for (int t = 0; t < CHUNK; t++) part[g][t] = _mm512_setzero_ps();
    for (int64_t start = 0; start < seq_len;) {
        const int64_t block = table[start / bs], slot0 = start % bs;
        int64_t count = seq_len - start < CHUNK ? seq_len - start : CHUNK;
        if (count > bs - slot0) count = bs - slot0; /* a chunk stays in one block */
        const float ks = (L->scales ? L->scales[head * L->num_blocks + block] : 1.0f) * unbias(kind) * sm_scale;
        const float vs = (L->scales ? L->scales[(L->heads + head) * L->num_blocks + block] : 1.0f) * unbias(kind);
        for (int64_t t = 0; t < count; t++) {
            const char *krow = kv_row(L, 0, head, block, slot0 + t);
            __m512 k[MAX_DIM / 16];
            for (int64_t c = 0; c < nv; c++) k[c] = load16(krow, 16 * c, kind);
            for (int64_t g = 0; g < group; g++) {
                __m512 s = _mm512_mul_ps(qv[g][0], k[0]);
                for (int64_t c = 1; c < nv; c++) s = _mm512_fmadd_ps(qv[g][c], k[c], s);
                part[g][t] = s;
            }
        }
        const __mmask16 live = (__mmask16)((1u << count) - 1u);
        for (int64_t g = 0; g < group; g++) {
            const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live, sum16(part[g]), _mm512_set1_ps(ks));
            const float m_new = fmaxf(m[g], _mm512_reduce_max_ps(s));
            const float correction = expf(m[g] - m_new); /* 0 for the first chunk (m = -inf) */
            const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
            l[g] = l[g] * correction + _mm512_reduce_add_ps(p);
            m[g] = m_new;
            if (correction != 1.0f)
                for (int64_t c = 0; c < nv; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(correction));
            _mm512_store_ps(weights[g], _mm512_mul_ps(p, _mm512_set1_ps(vs)));
            for (int64_t t = count; t < CHUNK; t++) part[g][t] = _mm512_setzero_ps(); /* stale past count */
        }
        for (int64_t t = 0; t < count; t++) {
            const char *vrow = kv_row(L, 1, head, block, slot0 + t);
            for (int64_t c = 0; c < nv; c++) {
                const __m512 v = load16(vrow, 16 * c, kind);
                for (int64_t g = 0; g < group; g++)
                    acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(weights[g][t]), v, acc[g][c]);
            }
        }
        start += count;
    }
    for (int64_t g = 0; g < group; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[g]);
        for (int64_t c = 0; c < nv; c++) _mm512_storeu_ps(out + g * dim + 16 * c, _mm512_mul_ps(acc[g][c], inv));
    }
}

static void attend_one(const Layer *L, const float *q, int64_t group, const int64_t *table, int64_t seq_len,
                       int64_t head, float sm_scale, float *out) {
    switch (L->kind) {
    case KVS_E4M3: attend_kind(L, KVS_E4M3, q, group, table, seq_len, head, sm_scale, out); break;
    case KVS_E5M2: attend_kind(L, KVS_E5M2, q, group, table, seq_len, head, sm_scale, out); break;
    case KVS_INT8: attend_kind(L, KVS_INT8, q, group, table, seq_len, head, sm_scale, out); break;
    case KVS_F32: attend_kind(L, KVS_F32, q, group, table, seq_len, head, sm_scale, out); break;
    default: attend_kind(L, KVS_BF16, q, group, table, seq_len, head, sm_scale, out); break;
    }
}

static inline void load_row_f32(const void *src, int kind, int64_t n, float *dst, float scale) {
    for (int64_t i = 0; i < n; i++) {
        float x;
        if (kind == KVT_BF16) {
            const uint32_t u = (uint32_t)((const uint16_t *)src)[i] << 16;
            memcpy(&x, &u, sizeof x);
        } else {
            x = ((const float *)src)[i];
        }
        dst[i] = x * scale;
    }
}

int kvt_decode_attention(const void *q, int q_kind, void *out, const void *pool, int kv_kind, const float *scales,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, int64_t batch,
                         int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                         int64_t dim, float sm_scale) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP ||
        dim % 16 != 0 || dim > MAX_DIM || block_size <= 0 || kv_kind < KVS_E4M3 || kv_kind > KVS_BF16 ||
        (q_kind != KVT_F32 && q_kind != KVT_BF16) || ((kv_kind <= KVS_INT8) != (scales != NULL)))
        return KVT_UNSUPPORTED;
    for (int64_t b = 0; b < batch; b++) {
        if (seq_lens[b] <= 0 || seq_lens[b] > max_blocks * block_size) return KVT_BAD_INDEX;
        for (int64_t j = 0; j < (seq_lens[b] + block_size - 1) / block_size; j++)
            if (block_tables[b * max_blocks + j] < 0 || block_tables[b * max_blocks + j] >= num_blocks)
                return KVT_BAD_INDEX;
    }
    static const int64_t elem_of[] = {1, 1, 1, 4, 2};
    const Layer L = {(const char *)pool, scales, kv_kind, num_kv_heads, num_blocks, block_size, dim, elem_of[kv_kind]};
    const int64_t group = num_heads / num_kv_heads, q_elem = q_kind == KVT_BF16 ? 2 : 4;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * num_kv_heads; task++) {
        const int64_t b = task / num_kv_heads, head = task % num_kv_heads;
        float qf[MAX_GROUP * MAX_DIM], of[MAX_GROUP * MAX_DIM];
        const int64_t first = (b * num_heads + head * group) * dim; /* query heads head*G .. head*G+G-1 */
        load_row_f32((const char *)q + first * q_elem, q_kind, group * dim, qf, 1.0f);
        attend_one(&L, qf, group, block_tables + b * max_blocks, seq_lens[b], head, sm_scale, of);
        for (int64_t g = 0; g < group; g++)
            store_row((char *)out + (first + g * dim) * q_elem, q_kind, of + g * dim, dim);
    }
    return KVT_OK;
}

#else /* no AVX-512: torch's SDPA serves */

int kvt_has_decode_attention(void) { return 0; }

int kvt_decode_attention(const void *q, int q_kind, void *out, const void *pool, int kv_kind, const float *scales,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, int64_t batch,
                         int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks, int64_t block_size,
                         int64_t dim, float sm_scale) {
    (void)q; (void)q_kind; (void)out; (void)pool; (void)kv_kind; (void)scales; (void)block_tables;
    (void)max_blocks; (void)seq_lens; (void)batch; (void)num_heads; (void)num_kv_heads; (void)num_blocks;
    (void)block_size; (void)dim; (void)sm_scale;
    return KVT_UNSUPPORTED;
}
#endif
