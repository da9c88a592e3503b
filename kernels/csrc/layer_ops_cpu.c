/* The elementwise steps of a Llama decode layer on the CPU, each one C call where torch runs
 * several small ops on a decode step's few rows (dispatch, not arithmetic, is their cost):
 *   lg_rms_norm      y = w * x / rms(x)
 *   lg_add_rms_norm  h' = h + delta, then y = w * h' / rms(h')
 *   lg_rope_store    rotate q and k in place (rotate-half, GPT-NeoX layout) and write k, v into
 *                    the paged cache at their slots
 * Values follow torch's bf16 semantics step by step (float32 arithmetic, a rounding to bf16
 * after each op torch would round after): the rotary embedding, the K/V write and the residual
 * sum equal torch's bit for bit (kernels/cpu_build.py compiles this file without FMA contraction
 * for that); the norms sum their squares in another order than torch, which can move a rare
 * element by a bf16 step or two. RMSNorm keeps
 * float32 statistics and rounds the normalized row before the weight multiplies it, as Hugging
 * Face's LlamaRMSNorm does.
 */
#include <math.h>
#include <stdint.h>
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

/* h_out = h + delta, then y = rms_norm(h_out) * w; all [rows, n] contiguous bf16 (the CPU decode
 * layer's dtype), w [n]. h_out may be delta (each element is read before it is written). */
int lg_add_rms_norm(const uint16_t *h, const uint16_t *delta, const uint16_t *w, uint16_t *h_out,
                    uint16_t *y, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++) {
        const int64_t at = (int64_t)r * n;
        for (int j = 0; j < n; j++) h_out[at + j] = to_bf(bf(h[at + j]) + bf(delta[at + j]));
        norm_row(h_out + at, w, y + at, n, eps, DT_BF16);
    }
    return 0;
}

/* y [rows, (hq + 2 hk) d] with row stride y_stride: each row holds q (hq heads), k (hk), v (hk)
 * of one token, bf16. Rotates q and k in place: x cos + rotate_half(x) sin with cos, sin
 * [rows, d] (rotate_half(x) = (-x2, x1) for the halves x1, x2), rounded as torch's
 * addcmul(x * cos, rotate_half(x), sin) rounds. Then writes k and v of row r to cache slot
 * slots[r]: k_cache, v_cache each [slots, hk, d] contiguous. */
int lg_rope_store(uint16_t *y, int64_t y_stride, const uint16_t *cos, const uint16_t *sin,
                  uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int rows, int hq,
                  int hk, int d) {
    const int half = d / 2;
    for (int r = 0; r < rows; r++) {
        uint16_t *yr = y + r * y_stride;
        const uint16_t *c = cos + (int64_t)r * d, *s = sin + (int64_t)r * d;
        for (int h = 0; h < hq + hk; h++) {
            uint16_t *x = yr + (int64_t)h * d;
            for (int j = 0; j < half; j++) {
                float x1 = bf(x[j]), x2 = bf(x[j + half]);
                float a = rbf(x1 * bf(c[j])) + x2 * -bf(s[j]);
                float b = rbf(x2 * bf(c[j + half])) + x1 * bf(s[j + half]);
                x[j] = to_bf(a);
                x[j + half] = to_bf(b);
            }
        }
        const int64_t row = (int64_t)hk * d, at = slots[r] * row;
        memcpy(k_cache + at, yr + (int64_t)hq * d, row * 2);
        memcpy(v_cache + at, yr + (int64_t)(hq + hk) * d, row * 2);
    }
    return 0;
}
