/* The elementwise steps of a Llama decode layer on the CPU, each one C call where torch runs
 * several small ops on a decode step's few rows (dispatch, not arithmetic, is their cost):
 *   lg_rms_norm      y = w * x / rms(x)
 *   lg_add_rms_norm  h' = h + delta, then y = w * h' / rms(h')
 *   lg_rope_store    rotate q and k in place (rotate-half, GPT-NeoX layout) and write k, v into
 *                    the paged cache at their slots
 * Rows are float32 or bf16. bf16 values follow torch's bf16 semantics step by step (float32
 * arithmetic, a rounding to bf16 after each op torch would round after); float32 values round
 * where torch's do (its addcmul's fused multiply-add included): the rotary embedding, the K/V write and the residual
 * sum equal torch's bit for bit (kernels/cpu_build.py compiles this file without FMA contraction
 * for that); the norms sum their squares in another order than torch, which can move a rare
 * element by a bf16 step or two. RMSNorm keeps
 * float32 statistics and rounds the normalized row before the weight multiplies it, as Hugging
 * Face's LlamaRMSNorm does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

enum { DT_F32 = 0, DT_BF16 = 1 };

static inline float bf(uint16_t h) { return bf16_to_f32(h); }

static inline uint16_t to_bf(float f) { return f32_to_bf16(f); }

static inline float rbf(float f) { return bf(to_bf(f)); } /* f rounded to bf16, as a float */

static float inv_rms_f32(const float *x, int n, float eps) {
    float ss = 0.0f;
    for (int j = 0; j < n; j++) ss += x[j] * x[j];
    return 1.0f / sqrtf(ss / n + eps);
}

static float inv_rms_bf16(const uint16_t *x, int n, float eps) {
    float ss = 0.0f;
    for (int j = 0; j < n; j++) ss += bf(x[j]) * bf(x[j]);
    return 1.0f / sqrtf(ss / n + eps);
}

static void norm_row(const void *x, const void *w, void *y, int n, float eps, int dtype) {
    if (dtype == DT_BF16) {
        const uint16_t *xb = x, *wb = w;
        uint16_t *yb = y;
        float r = inv_rms_bf16(xb, n, eps);
        for (int j = 0; j < n; j++) yb[j] = to_bf(bf(wb[j]) * rbf(bf(xb[j]) * r));
    } else {
        const float *xf = x, *wf = w;
        float *yf = y;
        float r = inv_rms_f32(xf, n, eps);
        for (int j = 0; j < n; j++) yf[j] = wf[j] * (xf[j] * r);
    }
}

/* x [rows, n] with row stride x_stride, w [n], y [rows, n] contiguous; one dtype (0 float32,
 * 1 bf16). Returns 0, or -1 for another dtype. */
int lg_rms_norm(const void *x, int64_t x_stride, const void *w, void *y, int rows, int n,
                float eps, int dtype, int threads) {
    if (dtype != DT_F32 && dtype != DT_BF16) return -1;
    const int elt = dtype == DT_BF16 ? 2 : 4;
    if (rows < 64) { /* a decode step: no parallel region to enter */
        for (int r = 0; r < rows; r++)
            norm_row((const char *)x + r * x_stride * elt, w, (char *)y + (int64_t)r * n * elt,
                     n, eps, dtype);
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < rows; r++)
        norm_row((const char *)x + r * x_stride * elt, w, (char *)y + (int64_t)r * n * elt, n,
                 eps, dtype);
    return 0;
}

/* h_out = h + delta, then y = rms_norm(h_out) * w; all [rows, n] contiguous of one dtype (0
 * float32, 1 bf16), w [n]. h_out may be delta (each element is read before it is written).
 * Returns 0, or -1 for another dtype. */
int lg_add_rms_norm(const void *h, const void *delta, const void *w, void *h_out, void *y,
                    int rows, int n, float eps, int dtype) {
    if (dtype != DT_F32 && dtype != DT_BF16) return -1;
    for (int r = 0; r < rows; r++) {
        const int64_t at = (int64_t)r * n;
        if (dtype == DT_BF16) {
            const uint16_t *hb = (const uint16_t *)h + at, *db = (const uint16_t *)delta + at;
            uint16_t *ob = (uint16_t *)h_out + at;
            for (int j = 0; j < n; j++) ob[j] = to_bf(bf(hb[j]) + bf(db[j]));
            norm_row(ob, w, (uint16_t *)y + at, n, eps, DT_BF16);
        } else {
            const float *hf = (const float *)h + at, *df = (const float *)delta + at;
            float *of = (float *)h_out + at;
            for (int j = 0; j < n; j++) of[j] = hf[j] + df[j];
            norm_row(of, w, (float *)y + at, n, eps, DT_F32);
        }
    }
    return 0;
}

/* One head x [d] rotated in place by cos c, sin s [d]: x cos + rotate_half(x) sin, the
 * rotate_half(x) = (-x2, x1) for the halves x1, x2, rounded as torch's
 * addcmul(x * cos, rotate_half(x), sin) rounds in each dtype (bf16: after the product and after
 * the sum; float32: ADDCMUL below). */
static void rope_head_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int half) {
    for (int j = 0; j < half; j++) {
        float x1 = bf(x[j]), x2 = bf(x[j + half]);
        float a = rbf(x1 * bf(c[j])) + x2 * -bf(s[j]);
        float b = rbf(x2 * bf(c[j + half])) + x1 * bf(s[j + half]);
        x[j] = to_bf(a);
        x[j + half] = to_bf(b);
    }
}

/* torch's float32 addcmul is one fused multiply-add a lane where the CPU has FMA (its AVX2 and
 * AVX-512 kernels, which it picks on such CPUs; -march=native defines __FMA__ there), a
 * multiply then an add elsewhere. */
#ifdef __FMA__
#define ADDCMUL(acc, t, u) fmaf((t), (u), (acc))
#else
#define ADDCMUL(acc, t, u) ((acc) + (t) * (u))
#endif

static void rope_head_f32(float *x, const float *c, const float *s, int half) {
    for (int j = 0; j < half; j++) {
        float x1 = x[j], x2 = x[j + half];
        float a = ADDCMUL(x1 * c[j], x2, -s[j]);
        float b = ADDCMUL(x2 * c[j + half], x1, s[j + half]);
        x[j] = a;
        x[j + half] = b;
    }
}

/* y [rows, (hq + 2 hk) d] with row stride y_stride (elements): each row holds q (hq heads),
 * k (hk), v (hk) of one token, of one dtype (0 float32, 1 bf16). Rotates q and k in place by
 * cos, sin [rows, d] (rope_head_*). Then writes k and v of row r to cache slot slots[r]:
 * k_cache, v_cache each [slots, hk, d] contiguous. Returns 0, or -1 for another dtype. */
int lg_rope_store(void *y, int64_t y_stride, const void *cos, const void *sin, void *k_cache,
                  void *v_cache, const int64_t *slots, int rows, int hq, int hk, int d,
                  int dtype) {
    if (dtype != DT_F32 && dtype != DT_BF16) return -1;
    const int half = d / 2, elt = dtype == DT_BF16 ? 2 : 4;
    for (int r = 0; r < rows; r++) {
        char *yr = (char *)y + r * y_stride * elt;
        const char *c = (const char *)cos + (int64_t)r * d * elt;
        const char *s = (const char *)sin + (int64_t)r * d * elt;
        for (int h = 0; h < hq + hk; h++) {
            char *x = yr + (int64_t)h * d * elt;
            if (dtype == DT_BF16)
                rope_head_bf16((uint16_t *)x, (const uint16_t *)c, (const uint16_t *)s, half);
            else
                rope_head_f32((float *)x, (const float *)c, (const float *)s, half);
        }
        const int64_t row = (int64_t)hk * d * elt, at = slots[r] * row;
        memcpy((char *)k_cache + at, yr + (int64_t)hq * d * elt, row);
        memcpy((char *)v_cache + at, yr + (int64_t)(hq + hk) * d * elt, row);
    }
    return 0;
}

/* ---- A float32 decode layer's runs of norm, matrix product and elementwise step ------------
 * The GGUF matmul is another library (gguf_matmul.c, built with reassociation, which the
 * roundings above must not get); these drivers take its entry point lg_gguf_matmul as a function
 * pointer and one lg_mat per matrix, so the steps between two attention calls take one call
 * each and no interpreter runs between them. Each step is the same code as its single call
 * (norm_row, lg_add_rms_norm, lg_rope_store, the matmul with the same work split), so the
 * results are those of the calls one by one. */
typedef int (*matmul_fn)(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                         int64_t w_stride, int qtype, float *y, int threads, int64_t m_tile,
                         int64_t n_chunk, int scalar);

/* One GGUF matrix of n rows of k values (row r at w + r * w_stride bytes) with its work split. */
typedef struct {
    const uint8_t *w;
    int64_t n, k, w_stride, m_tile, n_chunk;
    int qtype, threads;
} lg_mat;

static int mat_apply(void *fn, const lg_mat *a, const float *x, int m, float *y) {
    return ((matmul_fn)fn)(x, m, a->k, a->w, a->n, a->w_stride, a->qtype, y, a->threads,
                           a->m_tile, a->n_chunk, 0);
}

/* A scratch buffer of m rows of n floats for a normed row the next product reads (NULL when
 * there is no memory). */
static float *rows_buffer(int m, int64_t n) { return malloc(sizeof(float) * (size_t)m * n); }

/* y = rms_norm(h) * norm_w . W_qkv^T ([m, qkv->n], q, k, v of each row; h [m, hidden]), then
 * lg_rope_store on y. Returns 0, the matmul's nonzero code, or -3 without memory. */
int lg_decode_qkv(const float *h, const float *norm_w, float eps, int m, int hidden,
                  void *matmul, const lg_mat *qkv, float *y, const float *cos, const float *sin,
                  float *k_cache, float *v_cache, const int64_t *slots, int hq, int hk, int d) {
    float *x = rows_buffer(m, hidden);
    if (!x) return -3;
    for (int r = 0; r < m; r++)
        norm_row(h + (int64_t)r * hidden, norm_w, x + (int64_t)r * hidden, hidden, eps, DT_F32);
    const int rc = mat_apply(matmul, qkv, x, m, y);
    free(x);
    if (rc) return rc;
    return lg_rope_store(y, qkv->n, cos, sin, k_cache, v_cache, slots, m, hq, hk, d, DT_F32);
}

/* h_out = h + attn . W_o^T, then gu = rms_norm(h_out) * post_w . W_gate_up^T (h, h_out
 * [m, o->n]; attn [m, o->k]; gu [m, gate_up->n]). Returns 0, the matmul's nonzero code, or -3
 * without memory. */
int lg_decode_o_gate_up(const float *attn, int m, void *matmul, const lg_mat *o, const float *h,
                        float *h_out, const float *post_w, float eps, const lg_mat *gate_up,
                        float *gu) {
    int rc = mat_apply(matmul, o, attn, m, h_out);
    if (rc) return rc;
    float *x = rows_buffer(m, o->n);
    if (!x) return -3;
    lg_add_rms_norm(h, h_out, post_w, h_out, x, m, (int)o->n, eps, DT_F32);
    rc = mat_apply(matmul, gate_up, x, m, gu);
    free(x);
    return rc;
}

/* out = h + act . W_down^T (h, out [m, down->n]; act [m, down->k]). Returns 0 or the matmul's
 * nonzero code. */
int lg_decode_down(const float *act, int m, void *matmul, const lg_mat *down, const float *h,
                   float *out) {
    const int rc = mat_apply(matmul, down, act, m, out);
    if (rc) return rc;
    const int64_t size = (int64_t)m * down->n;
    for (int64_t i = 0; i < size; i++) out[i] = h[i] + out[i];
    return 0;
}

/* ---- A whole float32 decode layer in two calls ----------------------------------------------
 * lg_decode_layer_attention runs lg_decode_qkv, the paged attention (paged_decode_cpu.c's
 * lg_paged_decode, reached through a pointer as the matmul is) and lg_decode_o_gate_up;
 * lg_decode_layer_mlp multiplies SiLU(gate) by up and runs lg_decode_down. Between the two the
 * caller applies torch's SiLU to the gate half of gu in place: its exp is not one this file
 * reproduces, and the product after it is one correctly rounded multiply, as torch's mul_. A
 * layer's weights and cache sit in an lg_layer made once; what changes each step (rows, rotary
 * tables, slots, block tables, scratch rows) sits in one lg_step that every layer reads. */
typedef int (*attention_fn)(const void *q, int64_t q_stride, const void *k, const void *v,
                            int64_t blk_stride, int64_t tok_stride, int64_t head_stride,
                            const int64_t *block_tables, int64_t bt_stride,
                            const int64_t *context_lens, void *out, int num_seqs, int num_heads,
                            int num_kv_heads, int d, int block_size, float scale, int dtype,
                            int splits, int threads);

/* One layer: its four matrices, its norms, the cache halves rotary writes into (store_k,
 * store_v: [slots, hk, d]) and the K/V views attention reads (k, v with element strides per
 * block, token and head). */
typedef struct {
    const lg_mat *qkv, *o, *gate_up, *down;
    const float *input_norm, *post_norm;
    float *store_k, *store_v;
    const float *k, *v;
    int64_t blk_stride, tok_stride, head_stride;
} lg_layer;

/* One step of m rows: h [m, hidden] is the residual stream, read by the attention half and
 * overwritten by the MLP half; h_mid [m, hidden], y [m, qkv->n], attn [m, hq d], gu
 * [m, gate_up->n] and act [m, gate_up->n / 2] are scratch rows. */
typedef struct {
    void *matmul, *attention;
    const float *cos, *sin;
    const int64_t *slots, *block_tables, *context_lens;
    float *h, *h_mid, *y, *attn, *gu, *act;
    int64_t bt_stride;
    int m, hidden, hq, hk, d, block_size, splits, threads;
    float eps, scale;
} lg_step;

/* h -> (h_mid, gu) of one layer. Returns 0, the matmul's nonzero code, -3 without memory, or
 * -4 when the attention kernel rejects the shapes. */
int lg_decode_layer_attention(const lg_step *s, const lg_layer *l) {
    int rc = lg_decode_qkv(s->h, l->input_norm, s->eps, s->m, s->hidden, s->matmul, l->qkv, s->y,
                           s->cos, s->sin, l->store_k, l->store_v, s->slots, s->hq, s->hk, s->d);
    if (rc) return rc;
    if (((attention_fn)s->attention)(s->y, l->qkv->n, l->k, l->v, l->blk_stride, l->tok_stride,
                                     l->head_stride, s->block_tables, s->bt_stride,
                                     s->context_lens, s->attn, s->m, s->hq, s->hk, s->d,
                                     s->block_size, s->scale, DT_F32, s->splits, s->threads))
        return -4;
    return lg_decode_o_gate_up(s->attn, s->m, s->matmul, l->o, s->h, s->h_mid, l->post_norm,
                               s->eps, l->gate_up, s->gu);
}

/* (h_mid, gu with SiLU applied to its gate half) -> h. Returns 0 or the matmul's nonzero code. */
int lg_decode_layer_mlp(const lg_step *s, const lg_layer *l) {
    const int64_t inter = l->gate_up->n / 2;
    for (int r = 0; r < s->m; r++) {
        const float *g = s->gu + r * 2 * inter, *u = g + inter;
        float *a = s->act + r * inter;
        for (int64_t j = 0; j < inter; j++) a[j] = g[j] * u[j];
    }
    return lg_decode_down(s->act, s->m, s->matmul, l->down, s->h_mid, s->h);
}
