/* Decode attention on the CPU over the paged KV cache: one query token per sequence, read
 * through the block table with no gather, GQA heads of one KV head sharing each K/V row.
 *
 * Work items are (sequence, KV head, context split): a batch of one with a few KV heads still
 * fills every thread (split-KV, FlashDecoding). Each item runs the online softmax over tiles of
 * TILE tokens and leaves a partial (running max m, sum l, unnormalized accumulator); the
 * partials of a (sequence, KV head) are combined after the parallel loop. Arithmetic is float32
 * whatever the cache dtype (bf16 is widened on load and the output rounded to nearest even).
 *
 * Built at first use by kernels/cpu_build.py (cc -O3 -march=native -fopenmp); it shares torch's
 * OpenMP runtime (same soname), so the thread count is torch.get_num_threads().
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define TILE 128
#define MAX_GROUP 16
#define MAX_DIM 256
#define PREFETCH 16 /* rows ahead */

enum { DT_F32 = 0, DT_BF16 = 1 };

/* exp(x) for x <= 0 (scores minus their max): 2^(x log2 e) as 2^n, n the nearest integer,
 * times the degree-6 Taylor polynomial of e^f, |f| <= ln2 / 2; branch-free so loops over it
 * vectorize. Relative error under 7e-7 for x > -10 and under 2e-6 down to -30 (float64 check of
 * this float32 arithmetic). Inputs below -87 are taken as -87 (e^-87 ~ 1.6e-38). */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = floorf(t + 0.5f);
    float f = (t - n) * 0.69314718055994531f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (0.16666667f + f * (0.041666668f +
              f * (0.0083333338f + f * 0.0013888889f)))));
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}

/* Row `tok` of one KV head as float32 into dst[d]. */
static inline __attribute__((always_inline)) void load_row(float *restrict dst, const void *base, int64_t off, int d, int dtype) {
    if (dtype == DT_BF16) {
        const uint16_t *src = (const uint16_t *)base + off;
        for (int j = 0; j < d; j++) dst[j] = bf16_to_f32(src[j]);
    } else {
        const float *src = (const float *)base + off;
        for (int j = 0; j < d; j++) dst[j] = src[j];
    }
}

typedef struct {
    const void *k, *v;
    int64_t blk_stride, tok_stride, head_stride; /* elements; the same for K and V */
    const int64_t *block_tables;
    int64_t bt_stride;
    int block_size, d, dtype;
} Cache;

/* Prefetch the row at element offset `off` (d elements of `elt` bytes) into cache: a row is read
 * right after its load is issued, so without this a cold cache (the step's weights evicted the
 * layer's K/V) leaves only a few misses in flight and the loop runs far below the memory's
 * bandwidth. */
static inline void prefetch_row(const void *base, int64_t off, int bytes, int elt) {
    const char *p = (const char *)base + off * elt;
    for (int b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

/* Element offsets of KV head h's rows for tokens [a, a + n) (no division per token). */
static void row_offsets(const Cache *c, const int64_t *bt, int h, int a, int n, int64_t *off) {
    int blk = a / c->block_size, pos = a % c->block_size;
    int64_t base = bt[blk] * c->blk_stride + h * c->head_stride;
    for (int t = 0; t < n; t++) {
        off[t] = base + pos * c->tok_stride;
        if (++pos == c->block_size && t + 1 < n) {
            pos = 0;
            base = bt[++blk] * c->blk_stride + h * c->head_stride;
        }
    }
}

/* One work item: queries qf[g][d] (already scaled) of KV head `h` over tokens [t0, t1) of the
 * sequence whose block table row is `bt`. Writes m[g], l[g], acc[g][d]. */
static inline __attribute__((always_inline)) void attend_range(
    const Cache *c, const int64_t *bt, int h, int g, const float *qf, int t0, int t1, float *m,
    float *l, float *acc, const int d) {
    float s[MAX_GROUP][TILE];
    float row[MAX_DIM];
    for (int i = 0; i < g; i++) { m[i] = -INFINITY; l[i] = 0.0f; }
    memset(acc, 0, sizeof(float) * g * d);
    for (int a = t0; a < t1; a += TILE) {
        int n = t1 - a < TILE ? t1 - a : TILE;
        int64_t off[TILE];
        row_offsets(c, bt, h, a, n, off);
        const int elt = c->dtype == DT_BF16 ? 2 : 4, bytes = d * elt;
        for (int t = 0; t < n && t < PREFETCH; t++) prefetch_row(c->k, off[t], bytes, elt);
        for (int t = 0; t < n; t++) {  /* scores of this tile; V's rows fetched meanwhile */
            if (t + PREFETCH < n) prefetch_row(c->k, off[t + PREFETCH], bytes, elt);
            prefetch_row(c->v, off[t], bytes, elt);
            load_row(row, c->k, off[t], d, c->dtype);
            for (int i = 0; i < g; i++) {
                const float *qi = qf + i * d;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int j = 0; j < d; j++) dot += qi[j] * row[j];
                s[i][t] = dot;
            }
        }
        for (int i = 0; i < g; i++) {  /* online softmax: rescale what came before */
            float mt = m[i];
            for (int t = 0; t < n; t++) mt = s[i][t] > mt ? s[i][t] : mt;
            float r = exp_nonpos(m[i] - mt), sum = 0.0f;
            if (m[i] == -INFINITY) r = 0.0f; /* nothing before this tile */
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < n; t++) { s[i][t] = exp_nonpos(s[i][t] - mt); sum += s[i][t]; }
            l[i] = l[i] * r + sum;
            m[i] = mt;
            for (int j = 0; j < d; j++) acc[i * d + j] *= r;
        }
        for (int t = 0; t < n; t++) {  /* acc += p v */
            load_row(row, c->v, off[t], d, c->dtype);
            for (int i = 0; i < g; i++) {
                float p = s[i][t];
                float *ai = acc + i * d;
#pragma omp simd
                for (int j = 0; j < d; j++) ai[j] += p * row[j];
            }
        }
    }
}

/* attend_range with head_dim a constant for the sizes models use: each row's loops then unroll
 * into a few vector instructions instead of a vectorized loop's setup per row. */
static void attend(const Cache *c, const int64_t *bt, int h, int g, const float *qf, int t0,
                   int t1, float *m, float *l, float *acc) {
    switch (c->d) {
    case 64: attend_range(c, bt, h, g, qf, t0, t1, m, l, acc, 64); break;
    case 80: attend_range(c, bt, h, g, qf, t0, t1, m, l, acc, 80); break;
    case 96: attend_range(c, bt, h, g, qf, t0, t1, m, l, acc, 96); break;
    case 128: attend_range(c, bt, h, g, qf, t0, t1, m, l, acc, 128); break;
    default: attend_range(c, bt, h, g, qf, t0, t1, m, l, acc, c->d);
    }
}

/* Combine the `splits` partials of one (sequence, KV head) and write its g output rows. */
static void combine(const float *part, int splits, int g, int d, void *out, int64_t out_off,
                    int dtype) {
    const int stride = g * (d + 2); /* one split's partial: m[g], l[g], acc[g][d] */
    for (int i = 0; i < g; i++) {
        float mx = -INFINITY;
        for (int p = 0; p < splits; p++) {
            float mp = part[p * stride + i];
            mx = mp > mx ? mp : mx;
        }
        float row[MAX_DIM] = {0}, den = 0.0f;
        for (int p = 0; p < splits; p++) {
            const float *base = part + p * stride;
            if (base[i] == -INFINITY) continue; /* an empty split */
            float w = exp_nonpos(base[i] - mx);
            den += w * base[g + i];
            const float *ai = base + 2 * g + i * d;
            for (int j = 0; j < d; j++) row[j] += w * ai[j];
        }
        float inv = 1.0f / den;
        if (dtype == DT_BF16) {
            uint16_t *o = (uint16_t *)out + out_off + i * d;
            for (int j = 0; j < d; j++) o[j] = f32_to_bf16(row[j] * inv);
        } else {
            float *o = (float *)out + out_off + i * d;
            for (int j = 0; j < d; j++) o[j] = row[j] * inv;
        }
    }
}

/* q [S, Hq, d] with sequence stride q_stride (heads and head_dim contiguous), out [S, Hq, d]
 * contiguous, both of the cache's dtype; K/V at k, v with the given element strides per block,
 * token and head (unit stride along d); block_tables [S, >= max blocks] int64 with row
 * stride bt_stride; context_lens [S] int64 (>= 1 each). `splits` context splits per
 * (sequence, KV head), on `threads` threads. Returns 0, or -1 on an unsupported shape. */
int lg_paged_decode(const void *q, int64_t q_stride, const void *k, const void *v,
                    int64_t blk_stride, int64_t tok_stride, int64_t head_stride,
                    const int64_t *block_tables, int64_t bt_stride, const int64_t *context_lens,
                    void *out, int num_seqs, int num_heads, int num_kv_heads, int d,
                    int block_size, float scale, int dtype, int splits, int threads) {
    if (num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP || d > MAX_DIM ||
        splits < 1 || (dtype != DT_F32 && dtype != DT_BF16))
        return -1;
    const int g = num_heads / num_kv_heads;
    const Cache c = {k, v, blk_stride, tok_stride, head_stride, block_tables, bt_stride,
                     block_size, d, dtype};
    const int items = num_seqs * num_kv_heads * splits, stride = g * (d + 2);
    float *part = malloc(sizeof(float) * (size_t)items * stride);
    if (!part) return -1;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int it = 0; it < items; it++) {
        int p = it % splits, h = (it / splits) % num_kv_heads, s = it / splits / num_kv_heads;
        int len = (int)context_lens[s], chunk = (len + splits - 1) / splits;
        int t0 = p * chunk, t1 = t0 + chunk < len ? t0 + chunk : len;
        float qf[MAX_GROUP * MAX_DIM];
        load_row(qf, q, s * q_stride + (int64_t)h * g * d, g * d, dtype);
        for (int j = 0; j < g * d; j++) qf[j] *= scale;
        float *mine = part + (size_t)it * stride;
        attend(&c, block_tables + s * bt_stride, h, g, qf, t0, t0 < t1 ? t1 : t0, mine,
               mine + g, mine + 2 * g);
    }
    for (int sh = 0; sh < num_seqs * num_kv_heads; sh++)
        combine(part + (size_t)sh * splits * stride, splits, g, d, out,
                (int64_t)sh * g * d, dtype);
    free(part);
    return 0;
}
