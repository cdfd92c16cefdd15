/* Native CPU kernels of the quantized KV cache (kvtier.model.kv_quant, loaded by kvtier.model.native).
 *
 * Each kernel computes exactly what kv_quant's torch ops compute, bit for bit (the tests compare
 * the two on random data): it is a faster route to the same bytes, never a different result.
 *
 * One layer's pool, contiguous (the runner's kv_pool[layer]):
 *     data   [2 (K, V), heads, num_blocks, block_size, dim]   1 byte per value (fp8 e4m3 / e5m2, int8)
 *     scales [2, heads, num_blocks] float32                    value = data * scale
 *
 * gather: blocks `ids` [n] dequantized into out [2, heads, n, block_size, dim] (float32 or bfloat16),
 *         rows in parallel (OpenMP: the process's runtime, which is torch's, so one thread pool).
 * write:  new tokens' K and V quantized into their slots; a block whose scale must grow, or whose
 *         slot 0 is written (a block starting afresh), is rewritten whole with its new scale.
 *
 * fp8 -> float32 without a conversion instruction: the byte, sign-extended to 32 bits and shifted so
 * that its exponent and mantissa land in the low bits of float32's, is the fp8 value times
 * 2^-(127 - fp8 bias), exactly, subnormals included; the scale multiply puts 2^(127 - bias) back.
 * Since both factors are exact, the product rounds as value * scale does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_common.h"

#define KVT_MIN_SCALE 1e-30f  /* kv_quant.MIN_SCALE */
#define KVT_MAX_SCALE 128.0f  /* kv_quant.MAX_SCALE */
#define KVT_PARALLEL_MIN_ELEMS 65536

int kvt_abi_version(void) { return 1; }

/* ---- fp8 <-> float32 ----------------------------------------------------------------------- */

static inline float fp8_biased(int8_t x, int shift, uint32_t mask) {
    return bits_to_f32(((uint32_t)(int32_t)x << shift) & mask);
}

/* float32 -> fp8 with `mant` mantissa bits and exponent `bias`, round to nearest even; |f| is at
 * most the format's largest finite value (the callers clamp first) or NaN. Below the smallest
 * normal, 2^(1 - bias): |f| in units of the smallest subnormal, rounded (the top value, 2^mant, is
 * the smallest normal, whose byte it also is). Above: the float32 exponent rebiased, the mantissa
 * rounded to `mant` bits (a carry moves into the exponent). */
static inline uint8_t f32_to_fp8(float f, int bias, int mant) {
    const uint32_t bits = f32_to_bits(f), u = bits & 0x7FFFFFFFu;
    const int drop = 23 - mant;
    const uint32_t sub = (uint32_t)(int32_t)rintf(bits_to_f32(u) * (float)(1 << (bias - 1 + mant)));
    const uint32_t normal =
        (u + (uint32_t)(bias - 127) * (1u << 23) + ((1u << (drop - 1)) - 1u) + ((u >> drop) & 1u)) >> drop;
    uint32_t r = u < (uint32_t)(127 - bias + 1) << 23 ? sub : normal; /* selects, no branches: vectorises */
    r = u > 0x7F800000u ? 0x7Fu : r;                                    /* NaN */
    return (uint8_t)(((bits >> 24) & 0x80u) | (r & 0x7Fu));
}

/* max that keeps a NaN, as torch's amax does */
static inline float nan_max(float m, float a) { return (a != a || a > m) ? a : m; }

static inline float storage_qmax(int storage) {
    return storage == KVS_E4M3 ? 448.0f : storage == KVS_E5M2 ? 57344.0f : 127.0f;
}

/* dst = clamp(x / scale, -qmax, qmax) (int8: rounded), stored; as kv_quant.quantize. `storage` is a
 * constant at each call site (quantize_floats), so the loop specialises and vectorises. */
static inline __attribute__((always_inline)) void quantize_span(const float *restrict x, int64_t n, float scale,
                                                                 const int storage, uint8_t *restrict dst) {
    const float qmax = storage_qmax(storage);
    for (int64_t i = 0; i < n; i++) {
        float q = x[i] / scale;
        q = q < -qmax ? -qmax : (q > qmax ? qmax : q);
        dst[i] = storage == KVS_E4M3 ? f32_to_fp8(q, 7, 3)
                 : storage == KVS_E5M2 ? f32_to_fp8(q, 15, 2)
                                       : (uint8_t)(int8_t)rintf(q);
    }
}

static void quantize_floats(const float *x, int64_t n, float scale, int storage, uint8_t *dst) {
    if (storage == KVS_E4M3) quantize_span(x, n, scale, KVS_E4M3, dst);
    else if (storage == KVS_E5M2) quantize_span(x, n, scale, KVS_E5M2, dst);
    else quantize_span(x, n, scale, KVS_INT8, dst);
}

/* n values of a new token's row (bfloat16 or float32) as float32 */
static void load_floats(const void *x, int kind, int64_t n, float *restrict out) {
    if (kind == KVT_BF16) {
        const uint16_t *h = (const uint16_t *)x;
        for (int64_t i = 0; i < n; i++) out[i] = bits_to_f32((uint32_t)h[i] << 16);
    } else {
        memcpy(out, x, (size_t)n * sizeof(float));
    }
}

static float abs_max(const float *x, int64_t n) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++) m = nan_max(m, fabsf(x[i]));
    return m;
}

/* ---- gather + dequantize --------------------------------------------------------------------- */

/* one block row of `count` values: out = value * scale; `unbias` folds the fp8 exponent offset */
#define DEQUANT_ROW(EXPR, OUT_T, STORE)                                                    \
    do {                                                                                    \
        OUT_T *restrict o = (OUT_T *)dst;                                                   \
        for (int64_t i = 0; i < count; i++) {                                               \
            float value = (EXPR);                                                           \
            o[i] = STORE(value * mult);                                                     \
        }                                                                                   \
    } while (0)
#define AS_IS(x) (x)

static void dequant_row(const int8_t *restrict src, float scale, int storage, int out_kind, void *restrict dst,
                        int64_t count) {
    if (storage == KVS_E4M3) {
        const float mult = scale * E4M3_UNBIAS;
        if (out_kind == KVT_BF16) DEQUANT_ROW(fp8_biased(src[i], E4M3_SHIFT, E4M3_MASK), uint16_t, f32_to_bf16);
        else DEQUANT_ROW(fp8_biased(src[i], E4M3_SHIFT, E4M3_MASK), float, AS_IS);
    } else if (storage == KVS_E5M2) {
        const float mult = scale * E5M2_UNBIAS;
        if (out_kind == KVT_BF16) DEQUANT_ROW(fp8_biased(src[i], E5M2_SHIFT, E5M2_MASK), uint16_t, f32_to_bf16);
        else DEQUANT_ROW(fp8_biased(src[i], E5M2_SHIFT, E5M2_MASK), float, AS_IS);
    } else {
        const float mult = scale;
        if (out_kind == KVT_BF16) DEQUANT_ROW((float)src[i], uint16_t, f32_to_bf16);
        else DEQUANT_ROW((float)src[i], float, AS_IS);
    }
}

int kvt_gather(const int8_t *data, const float *scales, int64_t heads, int64_t num_blocks, int64_t block_elems,
               int storage, const int64_t *ids, int64_t n, int out_kind, void *out) {
    if (storage < KVS_E4M3 || storage > KVS_INT8 || (out_kind != KVT_F32 && out_kind != KVT_BF16))
        return KVT_UNSUPPORTED;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_blocks) return KVT_BAD_INDEX;
    const int64_t rows = 2 * heads * n;
    const size_t out_elem = out_kind == KVT_BF16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows * block_elems >= KVT_PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t row = r / n, i = r % n; /* row = kv * heads + head */
        const int64_t b = ids[i];
        dequant_row(data + (row * num_blocks + b) * block_elems, scales[row * num_blocks + b], storage, out_kind,
                    (char *)out + (size_t)r * block_elems * out_elem, block_elems);
    }
    return KVT_OK;
}

/* ---- write ------------------------------------------------------------------------------------- */

typedef struct {
    int8_t *data;
    float *scales;
    int64_t heads, num_blocks, block_size, dim;
    int storage;
    float qmax;
} Pool;

static inline uint8_t *slot_row(const Pool *p, int64_t row, int64_t slot) {
    return (uint8_t *)p->data + (row * p->num_blocks * p->block_size + slot) * p->dim;
}

/* The token's row of (kv, head): k or v [T, heads, dim] with `tok_stride` elements between tokens. */
typedef struct {
    const void *k, *v;
    int64_t k_stride, v_stride;
    int kind;
} NewKV;

static inline const void *token_row(const NewKV *kv, int64_t row, int64_t heads, int64_t t, int64_t dim) {
    const size_t elem = kv->kind == KVT_BF16 ? 2 : 4;
    const int64_t which = row / heads, head = row % heads;
    const char *base = which == 0 ? (const char *)kv->k : (const char *)kv->v;
    const int64_t stride = which == 0 ? kv->k_stride : kv->v_stride;
    return base + (size_t)(t * stride + head * dim) * elem;
}

/* Rewrite block b (every kv, head) with tokens t0..t1 placed: earlier tokens dequantized at their old
 * scale (zero when the block starts afresh), new scale = clamp(amax / qmax), requantized. */
static void rewrite_block(const Pool *p, const NewKV *kv, const int64_t *slots, int64_t t0, int64_t t1, int64_t b,
                          int fresh, float *tmp) {
    const int64_t bs = p->block_size, dim = p->dim, elems = bs * dim;
    for (int64_t row = 0; row < 2 * p->heads; row++) {
        float *scale = &p->scales[row * p->num_blocks + b];
        const float old = *scale * (fresh ? 0.0f : 1.0f);
        uint8_t *block = slot_row(p, row, b * bs);
        dequant_row((const int8_t *)block, old, p->storage, KVT_F32, tmp, elems);
        for (int64_t t = t0; t < t1; t++)
            load_floats(token_row(kv, row, p->heads, t, dim), kv->kind, dim, tmp + (slots[t] % bs) * dim);
        float s = abs_max(tmp, elems) / p->qmax;
        s = s < KVT_MIN_SCALE ? KVT_MIN_SCALE : (s > KVT_MAX_SCALE ? KVT_MAX_SCALE : s);
        quantize_floats(tmp, elems, s, p->storage, block);
        *scale = s;
    }
}

static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Runs of consecutive tokens in one block: a block must not come back in a later run (the torch
 * path treats a step's tokens of a block together) and a run holds at most a block of tokens
 * (no slot twice). 0 = not so: the caller leaves the step to the torch ops. */
static int runs_are_distinct(const int64_t *slots, int64_t num_tokens, int64_t bs) {
    int64_t *blocks = malloc(sizeof(int64_t) * (size_t)num_tokens);
    if (blocks == NULL) return 0;
    int64_t num_runs = 0, run_start = 0;
    int ok = 1;
    for (int64_t t = 0; t < num_tokens; t++) {
        if (t == 0 || slots[t] / bs != slots[t - 1] / bs) {
            blocks[num_runs++] = slots[t] / bs;
            run_start = t;
        }
        if (t - run_start >= bs) ok = 0;
    }
    qsort(blocks, (size_t)num_runs, sizeof(int64_t), cmp_i64);
    for (int64_t r = 1; r < num_runs; r++)
        if (blocks[r] == blocks[r - 1]) ok = 0;
    free(blocks);
    return ok;
}

int kvt_write(int8_t *data, float *scales, int64_t heads, int64_t num_blocks, int64_t block_size, int64_t dim,
              int storage, int static_scales, const void *k, int64_t k_stride, const void *v, int64_t v_stride,
              int in_kind, const int64_t *slots, int64_t num_tokens) {
    if (storage < KVS_E4M3 || storage > KVS_INT8 || (in_kind != KVT_F32 && in_kind != KVT_BF16))
        return KVT_UNSUPPORTED;
    const int64_t num_slots = num_blocks * block_size, rows = 2 * heads;
    for (int64_t t = 0; t < num_tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return KVT_BAD_INDEX;
    if (!static_scales && !runs_are_distinct(slots, num_tokens, block_size)) return KVT_REGROUP;
    const Pool p = {data, scales, heads, num_blocks, block_size, dim, storage, storage_qmax(storage)};
    const NewKV kv = {k, v, k_stride, v_stride, in_kind};
    /* one run's new rows as float32 ([token][row][dim]), then the rewrite scratch (a block row) */
    float *x = malloc(sizeof(float) * (size_t)(block_size * rows * dim + block_size * dim));
    if (x == NULL) return KVT_REGROUP;
    float *tmp = x + block_size * rows * dim;
    for (int64_t t0 = 0, t1; t0 < num_tokens; t0 = t1) {
        const int64_t b = slots[t0] / block_size;
        int fresh = 0;
        for (t1 = t0; t1 < num_tokens && slots[t1] / block_size == b && (static_scales ? t1 == t0 : 1); t1++)
            fresh |= slots[t1] % block_size == 0;
        for (int64_t t = t0; t < t1; t++)
            for (int64_t row = 0; row < rows; row++)
                load_floats(token_row(&kv, row, heads, t, dim), in_kind, dim, x + ((t - t0) * rows + row) * dim);
        if (static_scales) { /* one scale per (kv, head), kept in every block: block 0's */
            for (int64_t row = 0; row < rows; row++)
                quantize_floats(x + row * dim, dim, scales[row * num_blocks], storage, slot_row(&p, row, slots[t0]));
            continue;
        }
        int fits = !fresh;
        for (int64_t i = 0; i < (t1 - t0) * rows && fits; i++)
            fits = abs_max(x + i * dim, dim) <= scales[(i % rows) * num_blocks + b] * p.qmax;
        if (!fits) {
            rewrite_block(&p, &kv, slots, t0, t1, b, fresh, tmp);
            continue;
        }
        for (int64_t t = t0; t < t1; t++)
            for (int64_t row = 0; row < rows; row++)
                quantize_floats(x + ((t - t0) * rows + row) * dim, dim, scales[row * num_blocks + b], storage,
                                slot_row(&p, row, slots[t]));
    }
    free(x);
    return KVT_OK;
}

/* ---- whole blocks in and out of the pool (tier stores and restores) --------------------------- */

/* The pool of every layer: [rows, num_blocks, row_bytes] with rows = layers * 2 * heads, plus, when
 * quantized, scales [rows, num_blocks, scale_bytes] (scale_bytes: 4 for one float32 per block, 2 *
 * block_size for one float16 per token). A block outside the pool is packed as rows * row_bytes data
 * bytes followed (quantized) by its rows * scale_bytes scale bytes: what ModelRunner.read_block
 * returns. */
typedef struct {
    char *pool;
    char *scales; /* NULL: unquantized */
    int64_t rows, num_blocks, row_bytes, scale_bytes;
} BlockPool;

static int check_ids(const int64_t *ids, int64_t n, int64_t num_blocks) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= num_blocks) return 0;
    return 1;
}

static void move_rows(const BlockPool *p, const int64_t *ids, char *const *packed, int64_t n, int into_pool) {
    const int64_t total = n * p->rows;
#pragma omp parallel for schedule(static) if (total * p->row_bytes >= 4 * KVT_PARALLEL_MIN_ELEMS)
    for (int64_t j = 0; j < total; j++) {
        const int64_t row = j / n, i = j % n; /* row-major: a row of consecutive blocks is contiguous */
        char *in_pool = p->pool + (row * p->num_blocks + ids[i]) * p->row_bytes;
        char *outside = packed[i] + row * p->row_bytes;
        if (into_pool) memcpy(in_pool, outside, (size_t)p->row_bytes);
        else memcpy(outside, in_pool, (size_t)p->row_bytes);
    }
    if (p->scales == NULL) return;
    for (int64_t i = 0; i < n; i++) {
        char *tail = packed[i] + p->rows * p->row_bytes;
        for (int64_t row = 0; row < p->rows; row++) {
            char *in_pool = p->scales + (row * p->num_blocks + ids[i]) * p->scale_bytes;
            if (into_pool) memcpy(in_pool, tail + row * p->scale_bytes, (size_t)p->scale_bytes);
            else memcpy(tail + row * p->scale_bytes, in_pool, (size_t)p->scale_bytes);
        }
    }
}

/* into_pool = 1: packed[i] -> pool block ids[i] (a restore); 0: the other way (a store) */
int kvt_move_blocks(char *pool, char *scales, int64_t scale_bytes, int64_t rows, int64_t num_blocks,
                    int64_t row_bytes, const int64_t *ids, char *const *packed, int64_t n, int into_pool) {
    if (!check_ids(ids, n, num_blocks)) return KVT_BAD_INDEX;
    const BlockPool p = {pool, scales, rows, num_blocks, row_bytes, scale_bytes};
    move_rows(&p, ids, packed, n, into_pool);
    return KVT_OK;
}
