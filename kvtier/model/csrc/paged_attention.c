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
 * scales NULL, [2, Hkv, num_blocks] float32 (one per block, KVT_SCALE_BLOCK) or [2, Hkv, num_blocks,
 * block_size] float16 (one per token, KVT_SCALE_TOKEN); block_tables [B, max_blocks]; seq_lens [B].
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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
    const void *scales; /* NULL, float32 [2, Hkv, num_blocks] (KVT_SCALE_BLOCK) or float16 [2, Hkv, num_blocks,
                           block_size] (KVT_SCALE_TOKEN) */
    int kind;
    int64_t heads, num_blocks, block_size, dim, elem;
    int scale_mode;
} Layer;

static inline const char *kv_row(const Layer *L, int which, int64_t head, int64_t block, int64_t slot) {
    return L->pool + ((((which * L->heads + head) * L->num_blocks + block) * L->block_size + slot) * L->dim) * L->elem;
}

/* Ask for a block's K and V rows of one head ahead of use: a sequence's blocks are wherever the free
 * queue put them (after evictions and resets: reversed, interleaved with other sequences', random),
 * and the hardware prefetcher does not follow a block table, so without this every block boundary
 * stalls on memory (one layer's decode of 32 x 1,536 tokens: 1.7 ms on contiguous tables, 5.2 ms on random
 * ones without this, 2.9 ms with it). */
#define PREFETCH_BLOCKS 2 /* blocks ahead: 2 to 4 measured best (benchmarks/block_layout.py) */
/* always_inline: a separate function of prefetches only looks side-effect free to GCC, which then drops its calls */
static inline __attribute__((always_inline)) void prefetch_block(const Layer *L, int64_t head, int64_t block) {
    const int64_t bytes = L->block_size * L->dim * L->elem;
    const char *k = kv_row(L, 0, head, block, 0), *v = kv_row(L, 1, head, block, 0);
    for (int64_t off = 0; off < bytes; off += 64) {
        _mm_prefetch(k + off, _MM_HINT_T0);
        _mm_prefetch(v + off, _MM_HINT_T0);
    }
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
    const int64_t used_blocks = (seq_len + bs - 1) / bs;
    for (int64_t j = 0; j < PREFETCH_BLOCKS && j < used_blocks; j++) prefetch_block(L, head, table[j]);
    for (int64_t start = 0; start < seq_len;) {
        const int64_t block = table[start / bs], slot0 = start % bs;
        if (slot0 == 0 && start / bs + PREFETCH_BLOCKS < used_blocks) {
            const int64_t ahead = start / bs + PREFETCH_BLOCKS;
            if (table[ahead] != table[ahead - 1] + 1) /* the next block in memory: the hardware follows that */
                prefetch_block(L, head, table[ahead]);
        }
        int64_t count = seq_len - start < CHUNK ? seq_len - start : CHUNK;
        if (count > bs - slot0) count = bs - slot0; /* a chunk stays in one block */
        __m512 ksv, vsv; /* per token of the chunk: the K and V scales (times the fp8 unbias; K's times sm_scale) */
        if (L->scale_mode == KVT_SCALE_TOKEN) {
            const uint16_t *kt = (const uint16_t *)L->scales + (head * L->num_blocks + block) * bs + slot0;
            const uint16_t *vt = (const uint16_t *)L->scales + ((L->heads + head) * L->num_blocks + block) * bs + slot0;
            uint16_t kh[CHUNK] = {0}, vh[CHUNK] = {0};
            memcpy(kh, kt, (size_t)count * sizeof(uint16_t));
            memcpy(vh, vt, (size_t)count * sizeof(uint16_t));
            ksv = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)kh)),
                                _mm512_set1_ps(unbias(kind) * sm_scale));
            vsv = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)vh)), _mm512_set1_ps(unbias(kind)));
        } else {
            const float *fs = (const float *)L->scales;
            ksv = _mm512_set1_ps((fs ? fs[head * L->num_blocks + block] : 1.0f) * unbias(kind) * sm_scale);
            vsv = _mm512_set1_ps((fs ? fs[(L->heads + head) * L->num_blocks + block] : 1.0f) * unbias(kind));
        }
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
            const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), live, sum16(part[g]), ksv);
            const float m_new = fmaxf(m[g], _mm512_reduce_max_ps(s));
            const float correction = expf(m[g] - m_new); /* 0 for the first chunk (m = -inf) */
            const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
            l[g] = l[g] * correction + _mm512_reduce_add_ps(p);
            m[g] = m_new;
            if (correction != 1.0f)
                for (int64_t c = 0; c < nv; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(correction));
            _mm512_store_ps(weights[g], _mm512_mul_ps(p, vsv));
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

int kvt_decode_attention(const void *q, int q_kind, void *out, const void *pool, int kv_kind, const void *scales,
                         int scale_mode, const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens,
                         int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                         int64_t block_size, int64_t dim, float sm_scale) {
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP ||
        dim % 16 != 0 || dim > MAX_DIM || block_size <= 0 || kv_kind < KVS_E4M3 || kv_kind > KVS_BF16 ||
        (q_kind != KVT_F32 && q_kind != KVT_BF16) || ((kv_kind <= KVS_INT8) != (scales != NULL)) ||
        (scales != NULL && scale_mode != KVT_SCALE_BLOCK && scale_mode != KVT_SCALE_TOKEN))
        return KVT_UNSUPPORTED;
    for (int64_t b = 0; b < batch; b++) {
        if (seq_lens[b] <= 0 || seq_lens[b] > max_blocks * block_size) return KVT_BAD_INDEX;
        for (int64_t j = 0; j < (seq_lens[b] + block_size - 1) / block_size; j++)
            if (block_tables[b * max_blocks + j] < 0 || block_tables[b * max_blocks + j] >= num_blocks)
                return KVT_BAD_INDEX;
    }
    static const int64_t elem_of[] = {1, 1, 1, 4, 2};
    const Layer L = {(const char *)pool, scales, kv_kind, num_kv_heads, num_blocks, block_size, dim, elem_of[kv_kind],
                     scales != NULL ? scale_mode : KVT_SCALE_BLOCK};
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


/* ---- chunk attention: many query tokens of one sequence over its paged context (bfloat16) ----
 *
 * Query token i of the chunk sits at position start + i and sees keys 0 .. start + i, read straight
 * from the paged pool (no gathered copy, no mask tensor). One task per (KV head, tile of query
 * tokens): the tile's rows (token t, query head g of the group) share each step of 32 keys, whose
 * K is transposed once into key-major bfloat16 pairs so that one vdpbf16ps per pair of dims gives
 * 16 of a row's scores; the softmax is online per row in float32 (one max and one rescale per 32
 * keys), and P @ V runs as bfloat16 dot products over pairs of keys (P rounded to bfloat16, as
 * flash kernels do), accumulated in float32. Rows go in blocks of RB, with every accumulator of a
 * block in registers: 16 independent chains for the scores and 16 for P @ V, enough to keep both
 * vdpbf16ps pipes of a Zen 5 busy (one layer of 8 x 128 queries over 640 keys: 5.5 ms with 16 keys
 * per step and 4-8 chains, 3.5-4.1 ms now). Needs AVX512-BF16, a bfloat16 pool,
 * block_size % 16 == 0 and dim % 32 == 0. */
#if defined(__AVX512BF16__)
#define TILE_ROWS 60 /* query rows (tokens x group) per task */
enum { KVT_CHUNK_DPBF16 = 0, KVT_CHUNK_FMA = 1 };
#define RB 4         /* rows per register block */
#define KEYS 32      /* keys per step of a tile: two vectors of 16 scores per row */

int kvt_has_chunk_attention(void) { return 1; }

/* 16 rows of 16 int32 -> 16 columns (the usual unpack / shuffle ladder) */
static inline void transpose16x16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int a = 0; a < 4; a++) { /* rows 4a .. 4a+3: u[4a + j], 128-bit lane k = column 4k + j */
        u[4 * a + 0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
        u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
        u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), w0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
        const __m512i v1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
        r[j] = _mm512_shuffle_i32x4(v0, v1, 0x88);      /* column j      (128-bit lane 0) */
        r[8 + j] = _mm512_shuffle_i32x4(v0, v1, 0xDD);  /* column 8 + j  (lane 2) */
        r[4 + j] = _mm512_shuffle_i32x4(w0, w1, 0x88);  /* column 4 + j  (lane 1) */
        r[12 + j] = _mm512_shuffle_i32x4(w0, w1, 0xDD); /* column 12 + j (lane 3) */
    }
}

/* P @ V for RB rows and W of the nv output vectors from column group cg: all RB x W accumulators in
 * registers (RB * W independent vdpbf16ps chains, each V register used RB times), npairs pairs of keys. */
static inline __attribute__((always_inline)) void pv_group(__m512 (*acc)[MAX_DIM / 16], int64_t r0, int64_t nr,
                                                           const uint32_t (*pp)[KEYS / 2], const __m512i *vp,
                                                           const int64_t nv, int64_t cg, const int W, int64_t npairs) {
    __m512 a[RB][4];
    for (int rr = 0; rr < RB; rr++)
        for (int c = 0; c < W; c++) a[rr][c] = acc[r0 + (rr < nr ? rr : 0)][cg + c];
    for (int64_t j = 0; j < npairs; j++) {
        __m512bh v[4];
        for (int c = 0; c < W; c++) v[c] = (__m512bh)vp[j * nv + cg + c];
        for (int rr = 0; rr < RB; rr++) {
            const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[rr][j]);
            for (int c = 0; c < W; c++) a[rr][c] = _mm512_dpbf16_ps(a[rr][c], v[c], p);
        }
    }
    for (int rr = 0; rr < nr; rr++)
        for (int c = 0; c < W; c++) acc[r0 + rr][cg + c] = a[rr][c];
}

static inline __attribute__((always_inline)) void pv_rows(__m512 (*acc)[MAX_DIM / 16], int64_t r0, int64_t nr,
                                                          const uint32_t (*pp)[KEYS / 2], const __m512i *vp,
                                                          const int64_t nv, int64_t npairs) {
    int64_t cg = 0;
    for (; cg + 4 <= nv; cg += 4) pv_group(acc, r0, nr, pp, vp, nv, cg, 4, npairs);
    if (cg < nv) pv_group(acc, r0, nr, pp, vp, nv, cg, 2, npairs); /* dim % 32 == 0: nv is even */
}

/* One step of KEYS keys from c0 of one KV head, ready for the dot products: kt[h * pairs + d2] lane k
 * = key 16 h + k's dims (2 d2, 2 d2 + 1) (K transposed to key-major bfloat16 pairs), vp[j * nv + c]
 * lane d = (v_2j[16c + d], v_2j+1[16c + d]) (V in pairs of keys); keys at `end` and past are 0. */
static inline __attribute__((always_inline)) void prep_step(const Layer *L, const int64_t *table, int64_t head,
                                                            int64_t c0, int64_t end, const int64_t dim, __m512i *kt,
                                                            __m512i *vp) {
    const int64_t pairs = dim / 2, nv = dim / 16, bs = L->block_size;
    const int64_t live_keys = end - c0 < KEYS ? end - c0 : KEYS; /* rows past the context are never read */
    const uint16_t *vb[2] = {NULL, NULL};
    for (int h = 0; h < 2; h++) { /* each half of 16 keys lies in one block (block_size % 16 == 0) */
        const int64_t lk = live_keys - 16 * h;
        if (lk <= 0) {
            for (int64_t d = 0; d < pairs; d++) kt[h * pairs + d] = _mm512_setzero_si512();
            continue;
        }
        const int64_t block = table[(c0 + 16 * h) / bs], slot = (c0 + 16 * h) % bs;
        const uint16_t *kb = (const uint16_t *)kv_row(L, 0, head, block, slot);
        vb[h] = (const uint16_t *)kv_row(L, 1, head, block, slot);
        for (int64_t s16 = 0; s16 < pairs; s16 += 16) {
            __m512i r16[16];
            for (int k = 0; k < 16; k++)
                r16[k] = k < lk ? _mm512_loadu_si512((const void *)(kb + k * dim + 2 * s16)) : _mm512_setzero_si512();
            transpose16x16(r16);
            for (int d = 0; d < 16; d++) kt[h * pairs + s16 + d] = r16[d];
        }
    }
    for (int j = 0; j < KEYS / 2; j++) {
        const uint16_t *v0 = 2 * j < live_keys ? vb[j / 8] + (2 * j % 16) * dim : NULL;
        const uint16_t *v1 = 2 * j + 1 < live_keys ? vb[j / 8] + ((2 * j + 1) % 16) * dim : NULL;
        for (int64_t c = 0; c < nv; c++) {
            const __m512i a = v0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + 16 * c))) : _mm512_setzero_si512();
            const __m512i b = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + 16 * c))) : _mm512_setzero_si512();
            vp[j * nv + c] = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
        }
    }
}

/* __m512i vectors of one prepared step (prep_step's kt, then vp) */
static inline int64_t step_vectors(int64_t dim) { return dim + KEYS / 2 * (dim / 16); }

/* One task: a tile of query rows of one KV head over keys 0 .. the tile's last position, KEYS keys
 * per step. `dim` is a constant where the wrappers below pass one, so that the loops unroll.
 * `steps`: the head's steps prepared beforehand (prep_step), shared by the sequence's tiles; NULL:
 * each step is prepared here. */
static inline __attribute__((always_inline)) void chunk_tile(const Layer *L, const uint16_t *q, uint16_t *out,
                                                             const int64_t *table, int64_t start, int64_t t0,
                                                             int64_t tokens, int64_t head, int64_t group,
                                                             int64_t num_heads, float sm_scale, const int64_t dim,
                                                             const __m512i *steps) {
    const int64_t pairs = dim / 2, nv = dim / 16;
    const int64_t rows = tokens * group;
    float m[TILE_ROWS];
    __m512 acc[TILE_ROWS][MAX_DIM / 16], lsum[TILE_ROWS];
    const uint32_t *qrow[TILE_ROWS];
    int64_t limit[TILE_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r / group, g = r % group;
        qrow[r] = (const uint32_t *)(q + ((t0 + t) * num_heads + head * group + g) * dim);
        limit[r] = start + t0 + t + 1;
        m[r] = -INFINITY;
        lsum[r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < nv; c++) acc[r][c] = _mm512_setzero_ps();
    }
    const int64_t end = start + t0 + tokens; /* keys the tile's last row sees */
    __m512i own[MAX_DIM + KEYS / 2 * (MAX_DIM / 16)];
    const __m512 scale = _mm512_set1_ps(sm_scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t c0 = 0; c0 < end; c0 += KEYS) {
        const __m512i *kt = own;
        if (steps != NULL)
            kt = steps + c0 / KEYS * step_vectors(dim);
        else
            prep_step(L, table, head, c0, end, dim, own, own + dim);
        const __m512i *vp = kt + dim;
        /* RB rows at a time: 4 * RB independent dot-product chains for the scores (two halves of
         * 16 keys, even and odd pairs of dims), each K register reused RB times */
        for (int64_t r0 = 0; r0 < rows; r0 += RB) {
            const int64_t nr = rows - r0 < RB ? rows - r0 : RB;
            if (c0 >= limit[r0 + nr - 1]) continue; /* limits grow with the row: all in the future */
            const uint32_t *qr[RB];
            for (int rr = 0; rr < RB; rr++) qr[rr] = qrow[r0 + (rr < nr ? rr : nr - 1)];
            __m512 s0a[RB], s0b[RB], s1a[RB], s1b[RB];
            for (int rr = 0; rr < RB; rr++) s0a[rr] = s0b[rr] = s1a[rr] = s1b[rr] = _mm512_setzero_ps();
            for (int64_t d2 = 0; d2 < pairs; d2 += 2) {
                const __m512bh k00 = (__m512bh)kt[d2], k01 = (__m512bh)kt[d2 + 1];
                const __m512bh k10 = (__m512bh)kt[pairs + d2], k11 = (__m512bh)kt[pairs + d2 + 1];
                for (int rr = 0; rr < RB; rr++) {
                    const __m512bh b0 = (__m512bh)_mm512_set1_epi32((int)qr[rr][d2]);
                    const __m512bh b1 = (__m512bh)_mm512_set1_epi32((int)qr[rr][d2 + 1]);
                    s0a[rr] = _mm512_dpbf16_ps(s0a[rr], k00, b0);
                    s0b[rr] = _mm512_dpbf16_ps(s0b[rr], k01, b1);
                    s1a[rr] = _mm512_dpbf16_ps(s1a[rr], k10, b0);
                    s1b[rr] = _mm512_dpbf16_ps(s1b[rr], k11, b1);
                }
            }
            uint32_t pp[RB][KEYS / 2] __attribute__((aligned(64)));
            int64_t pairs_live = 0;
            for (int rr = 0; rr < RB; rr++) {
                const int64_t r = r0 + rr;
                if (rr >= nr || c0 >= limit[r]) { /* padding row, or a row that sees none of these keys */
                    _mm512_store_si512((void *)pp[rr], _mm512_setzero_si512());
                    continue;
                }
                const int64_t visible = limit[r] - c0 < KEYS ? limit[r] - c0 : KEYS;
                const __mmask16 live0 = visible >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << visible) - 1u);
                const __mmask16 live1 = visible <= 16 ? (__mmask16)0 : (__mmask16)((1u << (visible - 16)) - 1u);
                const __m512 sc0 = _mm512_mask_mul_ps(ninf, live0, _mm512_add_ps(s0a[rr], s0b[rr]), scale);
                const __m512 sc1 = _mm512_mask_mul_ps(ninf, live1, _mm512_add_ps(s1a[rr], s1b[rr]), scale);
                const float chunk_max = _mm512_reduce_max_ps(_mm512_max_ps(sc0, sc1));
                if (chunk_max > m[r]) { /* the running max moved: rescale what was summed under the old */
                    const __m512 correction = _mm512_set1_ps(expf(m[r] - chunk_max)); /* 0 at the first step */
                    lsum[r] = _mm512_mul_ps(lsum[r], correction);
                    for (int64_t c = 0; c < nv; c++) acc[r][c] = _mm512_mul_ps(acc[r][c], correction);
                    m[r] = chunk_max;
                }
                const __m512 mv = _mm512_set1_ps(m[r]);
                const __m512 p0 = _mm512_maskz_mov_ps(live0, exp16(_mm512_sub_ps(sc0, mv)));
                const __m512 p1 = _mm512_maskz_mov_ps(live1, exp16(_mm512_sub_ps(sc1, mv)));
                lsum[r] = _mm512_add_ps(lsum[r], _mm512_add_ps(p0, p1)); /* summed across lanes once, at the end */
                /* (p_2j, p_2j+1) bfloat16 pairs: the low 16 from p0, the high 16 from p1 */
                _mm512_store_si512((void *)pp[rr], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
                if ((visible + 1) / 2 > pairs_live) pairs_live = (visible + 1) / 2;
            }
            const uint32_t (*ppc)[KEYS / 2] = (const uint32_t (*)[KEYS / 2])pp;
            if (pairs_live == KEYS / 2) /* every step but a diagonal one: a constant trip count */
                pv_rows(acc, r0, nr, ppc, vp, nv, KEYS / 2);
            else
                pv_rows(acc, r0, nr, ppc, vp, nv, pairs_live);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r / group, g = r % group;
        uint16_t *o = out + ((t0 + t) * num_heads + head * group + g) * dim;
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lsum[r]));
        for (int64_t c = 0; c < nv; c++)
            _mm256_storeu_si256((__m256i *)(o + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv)));
    }
}

/* The common head sizes with `dim` known at compile time; any other dim % 32 == 0 at run time. */
static void chunk_task_64(const Layer *L, const uint16_t *q, uint16_t *out, const int64_t *table, int64_t start,
                          int64_t t0, int64_t tokens, int64_t head, int64_t group, int64_t num_heads, float sm_scale,
                          const __m512i *steps) {
    chunk_tile(L, q, out, table, start, t0, tokens, head, group, num_heads, sm_scale, 64, steps);
}
static void chunk_task_128(const Layer *L, const uint16_t *q, uint16_t *out, const int64_t *table, int64_t start,
                           int64_t t0, int64_t tokens, int64_t head, int64_t group, int64_t num_heads, float sm_scale,
                           const __m512i *steps) {
    chunk_tile(L, q, out, table, start, t0, tokens, head, group, num_heads, sm_scale, 128, steps);
}
static void chunk_task(const Layer *L, const uint16_t *q, uint16_t *out, const int64_t *table, int64_t start,
                       int64_t t0, int64_t tokens, int64_t head, int64_t group, int64_t num_heads, float sm_scale,
                       const __m512i *steps) {
    chunk_tile(L, q, out, table, start, t0, tokens, head, group, num_heads, sm_scale, L->dim, steps);
}

/* The same tile and online softmax in float32 FMAs (KVT_CHUNK_FMA), for CPUs whose FMA units outrun
 * their bf16 dot products: per 16-key chunk, K is widened once into dim-major float32 vectors (lane
 * = key) and V into key-major float32 rows; a row's 16 scores are dim FMAs of a broadcast query
 * value against a K vector, and P @ V takes 16 x dim / 16 FMAs of a broadcast probability against a
 * V vector. RBF rows share each K and V load; P stays float32. */
#define RBF 8 /* rows per register block */

static void chunk_task_fma(const Layer *L, const uint16_t *q, uint16_t *out, const int64_t *table, int64_t start,
                           int64_t t0, int64_t tokens, int64_t head, int64_t group, int64_t num_heads,
                           float sm_scale) {
    const int64_t dim = L->dim, nv = dim / 16, bs = L->block_size, pairs = dim / 2;
    const int64_t rows = tokens * group;
    float m[TILE_ROWS];
    __m512 acc[TILE_ROWS][MAX_DIM / 16], lsum[TILE_ROWS];
    float qf[TILE_ROWS][MAX_DIM] __attribute__((aligned(64)));
    int64_t limit[TILE_ROWS];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r / group, g = r % group;
        const uint16_t *qr = q + ((t0 + t) * num_heads + head * group + g) * dim;
        for (int64_t d = 0; d < dim; d++) qf[r][d] = bits_to_f32((uint32_t)qr[d] << 16) * sm_scale;
        limit[r] = start + t0 + t + 1;
        m[r] = -INFINITY;
        lsum[r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < nv; c++) acc[r][c] = _mm512_setzero_ps();
    }
    const int64_t end = start + t0 + tokens;
    __m512 kf[MAX_DIM];                 /* kf[d] lane k = k_k[d] */
    __m512 vf[16][MAX_DIM / 16];        /* vf[k][c] = v_k[16 c .. 16 c + 15] */
    float pw[RBF][16] __attribute__((aligned(64)));
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t c0 = 0; c0 < end; c0 += 16) {
        const int64_t block = table[c0 / bs], slot0 = c0 % bs;
        const uint16_t *kb = (const uint16_t *)kv_row(L, 0, head, block, slot0);
        const uint16_t *vb = (const uint16_t *)kv_row(L, 1, head, block, slot0);
        const int64_t live_keys = end - c0 < 16 ? end - c0 : 16;
        for (int64_t s16 = 0; s16 < pairs; s16 += 16) {
            __m512i r16[16];
            for (int k = 0; k < 16; k++)
                r16[k] = k < live_keys ? _mm512_loadu_si512((const void *)(kb + k * dim + 2 * s16)) : _mm512_setzero_si512();
            transpose16x16(r16); /* r16[d] lane k = (k_k[2 (s16 + d)], k_k[2 (s16 + d) + 1]) */
            for (int d = 0; d < 16; d++) {
                kf[2 * (s16 + d)] = _mm512_castsi512_ps(_mm512_slli_epi32(r16[d], 16));
                kf[2 * (s16 + d) + 1] = _mm512_castsi512_ps(_mm512_and_si512(r16[d], hi));
            }
        }
        for (int k = 0; k < 16; k++)
            for (int64_t c = 0; c < nv; c++)
                vf[k][c] = k < live_keys ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                               _mm256_loadu_si256((const __m256i *)(vb + k * dim + 16 * c))), 16)) : _mm512_setzero_ps();
        for (int64_t r0 = 0; r0 < rows; r0 += RBF) {
            const int64_t nr = rows - r0 < RBF ? rows - r0 : RBF;
            if (c0 >= limit[r0 + nr - 1]) continue; /* limits grow with the row: all in the future */
            const float *qr[RBF];
            for (int rr = 0; rr < RBF; rr++) qr[rr] = qf[r0 + (rr < nr ? rr : nr - 1)];
            __m512 sa[RBF], sb[RBF];
            for (int rr = 0; rr < RBF; rr++) sa[rr] = sb[rr] = _mm512_setzero_ps();
            for (int64_t d = 0; d < dim; d += 2) {
                for (int rr = 0; rr < RBF; rr++) {
                    sa[rr] = _mm512_fmadd_ps(_mm512_set1_ps(qr[rr][d]), kf[d], sa[rr]);
                    sb[rr] = _mm512_fmadd_ps(_mm512_set1_ps(qr[rr][d + 1]), kf[d + 1], sb[rr]);
                }
            }
            int64_t keys_live = 0;
            for (int rr = 0; rr < RBF; rr++) {
                const int64_t r = r0 + rr;
                if (rr >= nr || c0 >= limit[r]) { /* padding row, or a row that sees none of these keys */
                    _mm512_store_ps(pw[rr], _mm512_setzero_ps());
                    continue;
                }
                const int64_t visible = limit[r] - c0 < 16 ? limit[r] - c0 : 16;
                const __mmask16 live = (__mmask16)((1u << visible) - 1u);
                const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, _mm512_add_ps(sa[rr], sb[rr]));
                const float chunk_max = _mm512_reduce_max_ps(sc);
                if (chunk_max > m[r]) {
                    const __m512 correction = _mm512_set1_ps(expf(m[r] - chunk_max));
                    lsum[r] = _mm512_mul_ps(lsum[r], correction);
                    for (int64_t c = 0; c < nv; c++) acc[r][c] = _mm512_mul_ps(acc[r][c], correction);
                    m[r] = chunk_max;
                }
                const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m[r]))));
                lsum[r] = _mm512_add_ps(lsum[r], p);
                _mm512_store_ps(pw[rr], p);
                if (visible > keys_live) keys_live = visible;
            }
            for (int64_t c = 0; c < nv; c++) {
                __m512 a[RBF];
                for (int rr = 0; rr < RBF; rr++) a[rr] = acc[r0 + (rr < nr ? rr : 0)][c];
                for (int64_t k = 0; k < keys_live; k++) {
                    const __m512 v = vf[k][c];
                    for (int rr = 0; rr < RBF; rr++) a[rr] = _mm512_fmadd_ps(_mm512_set1_ps(pw[rr][k]), v, a[rr]);
                }
                for (int rr = 0; rr < nr; rr++) acc[r0 + rr][c] = a[rr];
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t t = r / group, g = r % group;
        uint16_t *o = out + ((t0 + t) * num_heads + head * group + g) * dim;
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lsum[r]));
        for (int64_t c = 0; c < nv; c++)
            _mm256_storeu_si256((__m256i *)(o + 16 * c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv)));
    }
}

int kvt_chunk_attention_batch(const void *q, void *out, const void *pool, const int64_t *block_tables,
                              int64_t max_blocks, const int64_t *starts, const int64_t *row_starts,
                              const int64_t *num_tokens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t num_blocks, int64_t block_size, int64_t dim, float sm_scale, int variant);

/* One sequence's chunk: the batch entry with one sequence (same tasks, same order). */
int kvt_chunk_attention(const void *q, void *out, const void *pool, const int64_t *table, int64_t table_len,
                        int64_t start, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t num_blocks, int64_t block_size, int64_t dim, float sm_scale, int variant) {
    const int64_t row0 = 0;
    return kvt_chunk_attention_batch(q, out, pool, table, table_len, &start, &row0, &num_tokens, 1, num_heads,
                                     num_kv_heads, num_blocks, block_size, dim, sm_scale, variant);
}

/* Every prefill chunk of a step in one call: one parallel region over all (sequence, tile, KV
 * head) tasks instead of one region per sequence (fewer fork/join barriers, each of which waits
 * for a descheduled thread when another process takes a core). Sequence s owns query rows
 * row_starts[s] .. row_starts[s] + num_tokens[s] of q and out, starts at position starts[s] and
 * reads block_tables[s * max_blocks ..]; the last tiles of each sequence (most keys) go first. */
int kvt_chunk_attention_batch(const void *q, void *out, const void *pool, const int64_t *block_tables,
                              int64_t max_blocks, const int64_t *starts, const int64_t *row_starts,
                              const int64_t *num_tokens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t num_blocks, int64_t block_size, int64_t dim, float sm_scale, int variant) {
    if ((variant != KVT_CHUNK_DPBF16 && variant != KVT_CHUNK_FMA) || num_kv_heads <= 0 ||
        num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > TILE_ROWS || dim % 32 != 0 || dim > MAX_DIM ||
        block_size <= 0 || block_size % 16 != 0 || num_seqs <= 0 || num_seqs > 4096)
        return KVT_UNSUPPORTED;
    const int64_t group = num_heads / num_kv_heads, tile = TILE_ROWS / group;
    int64_t first_task[4097];
    first_task[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t end = starts[s] + num_tokens[s];
        if (starts[s] < 0 || num_tokens[s] <= 0 || row_starts[s] < 0) return KVT_UNSUPPORTED;
        if (max_blocks * block_size < end) return KVT_BAD_INDEX;
        for (int64_t j = 0; j < (end + block_size - 1) / block_size; j++)
            if (block_tables[s * max_blocks + j] < 0 || block_tables[s * max_blocks + j] >= num_blocks)
                return KVT_BAD_INDEX;
        first_task[s + 1] = first_task[s] + (num_tokens[s] + tile - 1) / tile * num_kv_heads;
    }
    const Layer L = {(const char *)pool, NULL, KVS_BF16, num_kv_heads, num_blocks, block_size, dim, 2, KVT_SCALE_BLOCK};
    /* A sequence cut into several tiles gets its steps prepared once per head, before the tiles run,
     * instead of once per tile (K transposed, V paired: about a fifth of a tile's work otherwise). */
    int64_t first_step[4097]; /* prepared steps before sequence s (all heads) */
    first_step[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t tiles = (num_tokens[s] + tile - 1) / tile, end = starts[s] + num_tokens[s];
        first_step[s + 1] = first_step[s] + (variant == KVT_CHUNK_DPBF16 && tiles > 1 ? (end + KEYS - 1) / KEYS * num_kv_heads : 0);
    }
    const int64_t vecs = step_vectors(dim);
    __m512i *steps = NULL;
    if (first_step[num_seqs] > 0) {
        steps = (__m512i *)aligned_alloc(64, (size_t)(first_step[num_seqs] * vecs) * sizeof(__m512i));
        if (steps == NULL) /* no room: every tile prepares its own */
            for (int64_t s = 0; s <= num_seqs; s++) first_step[s] = 0;
    }
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 4)
        for (int64_t step = 0; step < first_step[num_seqs]; step++) {
            int64_t s = 0;
            while (first_step[s + 1] <= step) s++;
            const int64_t local = step - first_step[s], per_head = (first_step[s + 1] - first_step[s]) / num_kv_heads;
            const int64_t head = local / per_head, c0 = local % per_head * KEYS, end = starts[s] + num_tokens[s];
            __m512i *kt = steps + step * vecs;
            prep_step(&L, block_tables + s * max_blocks, head, c0, end, dim, kt, kt + dim);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < first_task[num_seqs]; task++) {
            int64_t s = 0;
            while (first_task[s + 1] <= task) s++;
            const int64_t local = task - first_task[s], tiles = (num_tokens[s] + tile - 1) / tile;
            const int64_t i = tiles - 1 - local / num_kv_heads, head = local % num_kv_heads; /* last tiles first */
            const int64_t t0 = i * tile, n = num_tokens[s] - t0 < tile ? num_tokens[s] - t0 : tile;
            const uint16_t *qs = (const uint16_t *)q + row_starts[s] * num_heads * dim;
            uint16_t *os = (uint16_t *)out + row_starts[s] * num_heads * dim;
            const int64_t *table = block_tables + s * max_blocks;
            const int64_t per_head = (first_step[s + 1] - first_step[s]) / num_kv_heads;
            const __m512i *own = per_head ? steps + (first_step[s] + head * per_head) * vecs : NULL;
            if (variant == KVT_CHUNK_FMA)
                chunk_task_fma(&L, qs, os, table, starts[s], t0, n, head, group, num_heads, sm_scale);
            else if (dim == 64)
                chunk_task_64(&L, qs, os, table, starts[s], t0, n, head, group, num_heads, sm_scale, own);
            else if (dim == 128)
                chunk_task_128(&L, qs, os, table, starts[s], t0, n, head, group, num_heads, sm_scale, own);
            else
                chunk_task(&L, qs, os, table, starts[s], t0, n, head, group, num_heads, sm_scale, own);
        }
    }
    free(steps);
    return KVT_OK;
}
#endif /* __AVX512BF16__ */

#else /* no AVX-512: torch's SDPA serves */

int kvt_has_decode_attention(void) { return 0; }

int kvt_decode_attention(const void *q, int q_kind, void *out, const void *pool, int kv_kind, const void *scales,
                         int scale_mode, const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens,
                         int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                         int64_t block_size, int64_t dim, float sm_scale) {
    (void)scale_mode; (void)q; (void)q_kind; (void)out; (void)pool; (void)kv_kind; (void)scales; (void)block_tables;
    (void)max_blocks; (void)seq_lens; (void)batch; (void)num_heads; (void)num_kv_heads; (void)num_blocks;
    (void)block_size; (void)dim; (void)sm_scale;
    return KVT_UNSUPPORTED;
}
#endif

#if !defined(__AVX512F__) || !defined(__AVX512BF16__) /* no chunk kernel: SDPA serves */
int kvt_has_chunk_attention(void) { return 0; }
int kvt_chunk_attention(const void *q, void *out, const void *pool, const int64_t *table, int64_t table_len,
                        int64_t start, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                        int64_t num_blocks, int64_t block_size, int64_t dim, float sm_scale, int variant) {
    (void)variant; (void)q; (void)out; (void)pool; (void)table; (void)table_len; (void)start; (void)num_tokens; (void)num_heads;
    (void)num_kv_heads; (void)num_blocks; (void)block_size; (void)dim; (void)sm_scale;
    return KVT_UNSUPPORTED;
}
int kvt_chunk_attention_batch(const void *q, void *out, const void *pool, const int64_t *block_tables,
                              int64_t max_blocks, const int64_t *starts, const int64_t *row_starts,
                              const int64_t *num_tokens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                              int64_t num_blocks, int64_t block_size, int64_t dim, float sm_scale, int variant) {
    (void)q; (void)out; (void)pool; (void)block_tables; (void)max_blocks; (void)starts; (void)row_starts;
    (void)num_tokens; (void)num_seqs; (void)num_heads; (void)num_kv_heads; (void)num_blocks; (void)block_size;
    (void)dim; (void)sm_scale; (void)variant;
    return KVT_UNSUPPORTED;
}
#endif
