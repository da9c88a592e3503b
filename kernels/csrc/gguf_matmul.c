/* y[m, n] = x[m, k] . W[n, k]^T with W kept in GGUF's own block layout: row r of W is
 * k / block_size blocks at raw + r * w_stride. Block layouts follow ggml's ggml-common.h (the
 * `gguf` Python package's gguf/quants.py decodes the same bytes). Two exceptions, T_Q4_K_X8 and
 * T_Q6_K_X8: Q4_K and Q6_K rows repacked 8 at a time at the same size (gguf_x8.h), whose
 * quantized-activation products meet 8 rows at once.
 *
 * The activation rows are quantized once per call to 8 bits, as llama.cpp does: per 32 values
 * (float scale, int8 values, float scale * sum) for the 32-value block types, per 256 values
 * (float scale, int8 values, int16 sums per 16) for the K-quants and IQ4_XS. A weight block then
 * meets its activation block in integer dot products (maddubs / VNNI dpbusd), scaled in float
 * once per block. Weight offsets and minimums are applied through the activation sums, so the
 * unsigned weight codes go into maddubs as they are.
 *
 * Threads take chunks of output rows, guided: long runs of consecutive chunks first, which the
 * hardware prefetcher streams, then single chunks, so a core slowed by another process does less;
 * each weight row is read from memory once per call: it meets up to 4 activation rows per
 * unpack (8 for the 32-value types where AVX-512 is), and the activation rows come in tiles
 * that stay in L2 while the chunk's weights do.
 * A single activation row (a decode step) meets four weight rows a call, each read front to back,
 * ended by one 4-way horizontal add. A matrix may come as segments of different types (a layer's
 * q/k/v, T_SEGMENTS), swept in one call.
 *
 * AVX2 (+FMA, F16C) is the fast path; AVX512-VNNI or AVX-VNNI replaces maddubs + madd in the
 * 32-value types, and AVX512BW + VL turns Q5_0/Q5_1's fifth bits into bytes with one masked
 * move; anything else runs the scalar path, which dequantizes a block to float and dots it with
 * the same quantized activations. lg_gguf_matmul's `scalar` argument forces that path (tests
 * compare both; tests/test_gguf_cpu_kernels_avx2.py builds the file with -mno-avx512f).
 *
 * One file over the house's 600 lines: cpu_build.py compiles each .c into its own library, and
 * the block decoders, the SIMD dot products and the threaded sweep share always-inline helpers
 * that must sit in one translation unit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#define LG_AVX2 1
#include <immintrin.h>
#elif defined(__F16C__)
#include <immintrin.h>
#endif

#define AI static inline __attribute__((always_inline))

/* ggml's type ids (gguf.GGMLQuantizationType). */
enum {
    T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11,
    T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20, T_IQ4_XS = 23,
    /* rows repacked 8 at a time: gguf_x8.h */
    T_Q4_K_X8 = 1012, T_Q6_K_X8 = 1014
};

/* Values per block and bytes per block, by type (0 where not implemented). */
static int block_values(int t) {
    switch (t) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: case T_IQ4_NL: return 32;
    case T_Q2_K: case T_Q3_K: case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS:
    case T_Q4_K_X8: case T_Q6_K_X8: return 256;
    default: return 0;
    }
}

static int block_bytes(int t) {
    switch (t) {
    case T_Q4_0: return 18;  case T_Q4_1: return 20;  case T_Q5_0: return 22;
    case T_Q5_1: return 24;  case T_Q8_0: return 34;  case T_IQ4_NL: return 18;
    case T_Q2_K: return 84;  case T_Q3_K: return 110; case T_Q4_K: case T_Q4_K_X8: return 144;
    case T_Q5_K: return 176; case T_Q6_K: case T_Q6_K_X8: return 210; case T_IQ4_XS: return 136;
    default: return 0;
    }
}

/* IQ4_NL / IQ4_XS code book (ggml-common.h kvalues_iq4nl). */
static const int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (e == 0) {
        const float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (e == 31 ? 0x7f800000u | (man << 13) : ((e + 112) << 23) | (man << 13));
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- Activation rows --------------------------------------------------------------------- */
/* A quantized activation row of k values, for blocks of B = 32 or 256:
 *   int8  q[k]            at 0
 *   B = 32:  float ds[2 k / 32]   at k (per block its scale d, x ~ d * q, then s = d * the
 *                                        block's sum of q: one 8-byte load gives both)
 *   B = 256: float d[k / 256]     at k
 *            int16 bsum[k / 16]   at k + 4 k/B (sums of q per 16 values)
 * The scale is amax / 127, the codes round(x * 127 / amax) to nearest even, in float32 (the
 * Python reference twin does the same arithmetic). */
static size_t xrow_bytes(int64_t k, int B) {
    const size_t raw = (size_t)k + 4 * (size_t)(k / B) + (B == 32 ? 4 * (size_t)(k / 32) : 2 * (size_t)(k / 16));
    return (raw + 63) & ~(size_t)63;
}

/* The largest |x| of n values (a NaN is passed over, as fmaxf would; the comparison, unlike a
 * call to fmaxf, vectorizes). */
static float block_amax(const float *x, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        const float v = fabsf(x[i]);
        amax = v > amax ? v : amax;
    }
    return amax;
}

/* q[0..31] = round(x * id); returns their sum, and the sums per 16 in s16[0..1]. */
static int quant32(const float *x, float id, int8_t *q, int *s16) {
#ifdef LG_AVX2
    const __m256 vid = _mm256_set1_ps(id);
    __m256i v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vid));
    const __m256i lo = _mm256_add_epi32(v[0], v[1]), hi = _mm256_add_epi32(v[2], v[3]);
    /* packs interleave the 128-bit lanes; the permute puts the values back in order */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    __m256i h = _mm256_hadd_epi32(lo, hi); /* lane0: lo0+lo1 lo2+lo3 hi0+hi1 hi2+hi3, lane1 the rest */
    h = _mm256_hadd_epi32(h, h);
    const int a = _mm256_extract_epi32(h, 0) + _mm256_extract_epi32(h, 4);
    const int b = _mm256_extract_epi32(h, 1) + _mm256_extract_epi32(h, 5);
    s16[0] = a;
    s16[1] = b;
    return a + b;
#else
    int s[2] = {0, 0};
    for (int i = 0; i < 32; i++) {
        const int v = (int)nearbyintf(x[i] * id);
        q[i] = (int8_t)v;
        s[i / 16] += v;
    }
    s16[0] = s[0];
    s16[1] = s[1];
    return s[0] + s[1];
#endif
}

static void quant_row32(const float *x, int64_t k, uint8_t *out) {
    const int64_t nb = k / 32;
    int8_t *q = (int8_t *)out;
    float *ds = (float *)(out + k);
    for (int64_t b = 0; b < nb; b++) {
        const float amax = block_amax(x + 32 * b, 32);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int s16[2];
        const int sum = quant32(x + 32 * b, id, q + 32 * b, s16);
        ds[2 * b] = amax / 127.0f;
        ds[2 * b + 1] = ds[2 * b] * (float)sum;
    }
}

static void quant_row256(const float *x, int64_t k, uint8_t *out) {
    const int64_t nb = k / 256;
    int8_t *q = (int8_t *)out;
    float *d = (float *)(out + k);
    int16_t *bs = (int16_t *)(d + nb);
    for (int64_t b = 0; b < nb; b++) {
        const float amax = block_amax(x + 256 * b, 256);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int c = 0; c < 8; c++) {
            int s16[2];
            quant32(x + 256 * b + 32 * c, id, q + 256 * b + 32 * c, s16);
            bs[16 * b + 2 * c] = (int16_t)s16[0];
            bs[16 * b + 2 * c + 1] = (int16_t)s16[1];
        }
        d[b] = amax / 127.0f;
    }
}

/* ---- Scalar block decoding (the reference layouts; also the non-AVX2 path) ----------------- */

/* Q4_K / Q5_K: the 12 packed bytes as 4 words of six-bit values, one per byte: scales 0..3,
 * scales 4..7, mins 0..3, mins 4..7. */
static inline void k4_words(const uint8_t *p, uint32_t v[4]) {
    const uint32_t u0 = rd32(p), u1 = rd32(p + 4), u2 = rd32(p + 8);
    v[0] = u0 & 0x3f3f3f3fu;
    v[1] = (u2 & 0x0f0f0f0fu) | ((u0 >> 2) & 0x30303030u);
    v[2] = u1 & 0x3f3f3f3fu;
    v[3] = ((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 2) & 0x30303030u);
}

/* Q4_K / Q5_K: 8 six-bit scales and mins from the 12 packed bytes. */
static void k4_scales(const uint8_t *p, uint8_t *sc, uint8_t *mn) {
    uint32_t v[4];
    k4_words(p, v);
    memcpy(sc, &v[0], 8);
    memcpy(mn, &v[2], 8);
}

#ifdef LG_AVX2
/* k4_scales in a register, k4_words' four words computed side by side: bytes 0..7 the scales,
 * 8..15 the mins. Reads 16 bytes at p (the 12 packed bytes and the 4 after them, which a Q4_K
 * or Q5_K block always has). */
static inline __m128i k4_scales_mins(const uint8_t *p) {
    const __m128i u = _mm_loadu_si128((const __m128i *)p); /* words u0 u1 u2 (u3 unused) */
    /* low bits: u0 & 0x3f.., u2 & 0x0f.., u1 & 0x3f.., (u2 >> 4) & 0x0f.. */
    const __m128i lo = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(u, 0x98), _mm_setr_epi32(0, 0, 0, 4)),
                                     _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    /* high bits of scales and mins 4..7: (u0 >> 2) & 0x30.., (u1 >> 2) & 0x30.. */
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(u, 0x50), 2),
                                     _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    return _mm_or_si128(lo, hi);
}
#endif

/* Q3_K: 16 six-bit scales (stored + 32) from the 12 packed bytes, as int8 minus 32. */
static void k3_scales(const uint8_t *p, int8_t *sc) {
    const uint32_t a0 = rd32(p), a1 = rd32(p + 4), t = rd32(p + 8), m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    const uint32_t v[4] = {(a0 & m4) | ((t & m2) << 4), (a1 & m4) | (((t >> 2) & m2) << 4),
                           ((a0 >> 4) & m4) | (((t >> 4) & m2) << 4),
                           ((a1 >> 4) & m4) | (((t >> 6) & m2) << 4)};
    uint8_t u[16];
    memcpy(u, v, 16);
    for (int i = 0; i < 16; i++) sc[i] = (int8_t)(u[i] - 32);
}

/* IQ4_XS: 8 six-bit scales (stored + 32), as int minus 32. */
static void xs_scales(const uint8_t *p, int8_t *sc) {
    const unsigned sh = p[0] | (p[1] << 8);
    for (int j = 0; j < 8; j++)
        sc[j] = (int8_t)((((p[2 + j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4)) - 32);
}

/* Element e = 128 h + 32 s + l of the 2-bit planes shared by Q2_K and Q3_K. */
#define PLANE(qs, h, s, l) (((qs)[32 * (h) + (l)] >> (2 * (s))) & 3)

/* One block of type t at b, as float32, in the same order of operations as gguf/quants.py. */
static void deq_block(int t, const uint8_t *b, float *o) {
    switch (t) {
    case T_Q4_0: case T_IQ4_NL: {
        const float d = h2f(b);
        for (int j = 0; j < 16; j++) {
            const int lo = b[2 + j] & 15, hi = b[2 + j] >> 4;
            o[j] = t == T_Q4_0 ? d * (float)(lo - 8) : d * (float)KVALUES[lo];
            o[j + 16] = t == T_Q4_0 ? d * (float)(hi - 8) : d * (float)KVALUES[hi];
        }
        break;
    }
    case T_Q4_1: {
        const float d = h2f(b), m = h2f(b + 2);
        for (int j = 0; j < 16; j++) {
            o[j] = d * (float)(b[4 + j] & 15) + m;
            o[j + 16] = d * (float)(b[4 + j] >> 4) + m;
        }
        break;
    }
    case T_Q5_0: case T_Q5_1: {
        const int one = t == T_Q5_1;
        const float d = h2f(b), m = one ? h2f(b + 2) : 0.0f;
        const uint32_t qh = rd32(b + 2 + 2 * one);
        const uint8_t *qs = b + 6 + 2 * one;
        for (int j = 0; j < 32; j++) {
            const int q = (j < 16 ? qs[j] & 15 : qs[j - 16] >> 4) | (((qh >> j) & 1) << 4);
            o[j] = one ? d * (float)q + m : d * (float)(q - 16);
        }
        break;
    }
    case T_Q8_0: {
        const float d = h2f(b);
        for (int j = 0; j < 32; j++) o[j] = (float)(int8_t)b[2 + j] * d;
        break;
    }
    case T_Q2_K: {
        const float d = h2f(b + 80), dmin = h2f(b + 82);
        for (int e = 0; e < 256; e++) {
            const int h = e / 128, s = (e / 32) % 4, l = e % 32, i = e / 16;
            o[e] = d * (float)(b[i] & 15) * (float)PLANE(b + 16, h, s, l) - dmin * (float)(b[i] >> 4);
        }
        break;
    }
    case T_Q3_K: {
        int8_t sc[16];
        k3_scales(b + 96, sc);
        const float d = h2f(b + 108);
        for (int e = 0; e < 256; e++) {
            const int h = e / 128, s = (e / 32) % 4, l = e % 32;
            const int q = PLANE(b + 32, h, s, l) - (((b[l] >> (4 * h + s)) & 1) ? 0 : 4);
            o[e] = d * (float)sc[e / 16] * (float)q;
        }
        break;
    }
    case T_Q4_K: case T_Q5_K: {
        uint8_t sc[8], mn[8];
        k4_scales(b + 4, sc, mn);
        const float d = h2f(b), dmin = h2f(b + 2);
        const int five = t == T_Q5_K;
        const uint8_t *qh = b + 16, *qs = b + 16 + 32 * five;
        for (int e = 0; e < 256; e++) {
            const int j = e / 32, l = e % 32;
            int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
            if (five) q |= ((qh[l] >> j) & 1) << 4;
            o[e] = d * (float)sc[j] * (float)q - dmin * (float)mn[j];
        }
        break;
    }
    case T_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = h2f(b + 208);
        for (int e = 0; e < 256; e++) {
            const int h = e / 128, s = (e / 32) % 4, l = e % 32;
            const int lo = (ql[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 15;
            const int q = (lo | (((qh[32 * h + l] >> (2 * s)) & 3) << 4)) - 32;
            o[e] = d * (float)sc[e / 16] * (float)q;
        }
        break;
    }
    case T_IQ4_XS: {
        int8_t sc[8];
        xs_scales(b + 2, sc);
        const float d = h2f(b);
        for (int j = 0; j < 8; j++) {
            const float dl = d * (float)sc[j];
            for (int l = 0; l < 16; l++) {
                o[32 * j + l] = dl * (float)KVALUES[b[8 + 16 * j + l] & 15];
                o[32 * j + 16 + l] = dl * (float)KVALUES[b[8 + 16 * j + l] >> 4];
            }
        }
        break;
    }
    }
}

/* Scalar kernel: one weight row against nx activation rows (stride xs), y[j * ys] = dot j. */
static void rows_scalar(int t, const uint8_t *w, const uint8_t *x, size_t xs, int64_t k, float *y,
                        int64_t ys, int nx) {
    const int B = block_values(t), bb = block_bytes(t);
    const int64_t nb = k / B;
    float wf[256];
    double acc[4] = {0, 0, 0, 0};
    for (int64_t b = 0; b < nb; b++) {
        deq_block(t, w + b * bb, wf);
        for (int j = 0; j < nx; j++) {
            const int8_t *q = (const int8_t *)(x + j * xs) + b * B;
            const float dx = ((const float *)(x + j * xs + k))[B == 32 ? 2 * b : b];
            float s = 0.0f;
            for (int i = 0; i < B; i++) s += wf[i] * (float)q[i];
            acc[j] += (double)(s * dx);
        }
    }
    for (int j = 0; j < nx; j++) y[j * ys] = (float)acc[j];
}

#ifdef LG_AVX2
/* ---- AVX2 kernels -------------------------------------------------------------------------- */

static inline float hsum_ps(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* acc + the sums of 4 adjacent u8 * s8 products, as int32 (VNNI's dpbusd; else maddubs, then
 * madd with ones: there the sum of a pair u * s must fit int16, which every caller's codes do). */
AI __m256i dot_u8s8_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Sums of 4 adjacent u8 * s8 products, as int32 (dot_u8s8_acc from zero). */
AI __m256i dot_u8s8(__m256i u, __m256i s) { return dot_u8s8_acc(_mm256_setzero_si256(), u, s); }

/* acc + the sums of adjacent int16 products of a and b, as int32 (VNNI's vpdpwssd: one
 * instruction, no saturation, the same integers as madd + add). */
AI __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, a, b);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high ones (the 32-value blocks'
 * element order). */
AI __m256i nibbles16(const uint8_t *p) {
    const __m128i q = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
}

/* Bit j of a 32-bit word -> byte j = 0x10 or 0 (AVX512BW + VL: the word is the byte mask of one
 * masked move; AVX2: broadcast, shuffle each byte's word byte into place, test its bit). */
AI __m256i bits_to_0x10(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10));
#endif
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_setr_epi64x(0, 0x0101010101010101LL,
                                                                  0x0202020202020202LL,
                                                                  0x0303030303030303LL));
    const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel),
                            _mm256_set1_epi8(0x10));
}

/* A 32-value block's weights as bytes: unsigned codes (Q4_0/Q4_1/Q5_0/Q5_1) or signed values
 * (Q8_0, IQ4_NL). */
AI __m256i w32(int t, const uint8_t *b) {
    switch (t) {
    case T_Q4_0: return nibbles16(b + 2);
    case T_Q4_1: return nibbles16(b + 4);
    case T_Q5_0: return _mm256_or_si256(nibbles16(b + 6), bits_to_0x10(rd32(b + 2)));
    case T_Q5_1: return _mm256_or_si256(nibbles16(b + 8), bits_to_0x10(rd32(b + 4)));
    case T_Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
    default: { /* IQ4_NL */
        const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES));
        return _mm256_shuffle_epi8(kv, nibbles16(b + 2));
    }
    }
}

/* The two fp16 values at p as lanes 0 and 1 (one conversion where F16C is). */
AI __m128 h2f_pair(const uint8_t *p) {
#ifdef __F16C__
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)rd32(p)));
#else
    return _mm_setr_ps(h2f(p), h2f(p + 2), 0.0f, 0.0f);
#endif
}

/* A 32-value block's weight scales: lane 0 its scale dw, lane 1 what multiplies the activation
 * block's sum s = dx sum(q) (Q4_0 -8 dw, Q5_0 -16 dw, Q4_1/Q5_1 the minimum m, read with dw in
 * one conversion; 0 for the signed types). */
AI __m128 wscales32(const int t, const uint8_t *blk) {
    if (t == T_Q4_1 || t == T_Q5_1) return h2f_pair(blk);
    const float dw = h2f(blk);
    const float off = t == T_Q4_0 ? -8.0f * dw : t == T_Q5_0 ? -16.0f * dw
                    : (t == T_Q4_1 || t == T_Q5_1) ? h2f(blk + 2) : 0.0f;
    return _mm_setr_ps(dw, off, 0.0f, 0.0f);
}

/* wscales32 times activation block b's (dx, s), one 8-byte load: lane 0 dw dx, the scale of
 * the block's integer dot product; lane 1 the offset or minimum's term. */
AI __m128 scales32(const __m128 wd, const float *ds, int64_t b) {
    return _mm_mul_ps(wd, _mm_castpd_ps(_mm_load_sd((const double *)(ds + 2 * b))));
}

/* The 32-value types: sum over blocks of dw dx (w . q) plus the offset or minimum through the
 * activation sum s = dx sum(q) (scales32); acs[j]'s lane 1 sums the latter. */
AI void block32(const int t, const uint8_t *w, const uint8_t *x, size_t xs, int64_t k, int64_t b,
                const int nx, __m256 *acc, __m128 *acs) {
    const int sgn = t == T_Q8_0 || t == T_IQ4_NL;
    const uint8_t *blk = w + b * block_bytes(t);
    const __m128 wd = wscales32(t, blk);
    const __m256i wv = w32(t, blk);
    const __m256i wu = sgn ? _mm256_abs_epi8(wv) : wv;
    for (int j = 0; j < nx; j++) {
        const uint8_t *xr = x + j * xs;
        const __m128 sc = scales32(wd, (const float *)(xr + k), b);
        __m256i xv = _mm256_loadu_si256((const __m256i *)(xr + 32 * b));
        if (sgn) xv = _mm256_sign_epi8(xv, wv);
        const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(wu, xv));
        acc[j] = _mm256_fmadd_ps(_mm256_broadcastss_ps(sc), p, acc[j]);
        if (!sgn) acs[j] = _mm_add_ps(acs[j], sc);
    }
}

AI float lane1(__m128 v) { return _mm_cvtss_f32(_mm_movehdup_ps(v)); }

/* y[0..3] = the four sums of 4 accumulators each (a 4-way horizontal add). */
AI __m128 hsum4_ps(const __m256 a[4]) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* One activation row alternates two sets of accumulators between blocks, so a block's FMA does
 * not wait on the previous one's (several rows interleave their chains anyway). */
AI void rows32(const int t, const uint8_t *w, const uint8_t *x, size_t xs, int64_t k, float *y,
               int64_t ys, const int nx) {
    const int64_t nb = k / 32;
    __m256 acc[2][8];
    __m128 acs[2][8];
    for (int a = 0; a < 2; a++)
        for (int j = 0; j < nx; j++) {
            acc[a][j] = _mm256_setzero_ps();
            acs[a][j] = _mm_setzero_ps();
        }
    int64_t b = 0;
    if (nx == 1)
        for (; b + 1 < nb; b += 2) {
            block32(t, w, x, xs, k, b, 1, acc[0], acs[0]);
            block32(t, w, x, xs, k, b + 1, 1, acc[1], acs[1]);
        }
    for (; b < nb; b++) block32(t, w, x, xs, k, b, nx, acc[0], acs[0]);
    for (int j = 0; j < nx; j++) {
        /* rows32_w4's order of additions, so a row's bits do not depend on which kernel took it */
        const __m256 a = _mm256_add_ps(acc[0][j], acc[1][j]), four[4] = {a, a, a, a};
        y[j * ys] = _mm_cvtss_f32(hsum4_ps(four)) + lane1(_mm_add_ps(acs[0][j], acs[1][j]));
    }
}

/* Four weight rows (ws bytes apart) of a 32-value type against one activation row, the decode
 * step's case, as one call: each row is read front to back (one sequential stream, as the
 * prefetchers like it) with two alternating accumulator chains, and one 4-way horizontal add
 * ends all four. Each row's additions are rows32's for one row. */
AI void rows32_w4(const int t, const uint8_t *w, int64_t ws, const uint8_t *x, int64_t k,
                  float *y) {
    const int bb = block_bytes(t);
    const int64_t nb = k / 32;
    __m256 acc[4];
    float acs[4];
    for (int r = 0; r < 4; r++) {
        const uint8_t *wr = w + r * ws;
        __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        __m128 s[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) {
            block32(t, wr, x, 0, k, b, 1, &a[0], &s[0]);
            block32(t, wr, x, 0, k, b + 1, 1, &a[1], &s[1]);
        }
        if (b < nb) block32(t, wr, x, 0, k, b, 1, &a[0], &s[0]);
        acc[r] = _mm256_add_ps(a[0], a[1]);
        acs[r] = lane1(_mm_add_ps(s[0], s[1]));
    }
    _mm_storeu_ps(y, _mm_add_ps(hsum4_ps(acc), _mm_setr_ps(acs[0], acs[1], acs[2], acs[3])));
}

#define ROWS32_W4(T, NAME) \
    static void NAME(const uint8_t *w, int64_t ws, const uint8_t *x, int64_t k, float *y) { \
        rows32_w4(T, w, ws, x, k, y); }
ROWS32_W4(T_Q4_0, w4_q4_0)
ROWS32_W4(T_Q4_1, w4_q4_1)
ROWS32_W4(T_Q5_0, w4_q5_0)
ROWS32_W4(T_Q5_1, w4_q5_1)
ROWS32_W4(T_Q8_0, w4_q8_0)
ROWS32_W4(T_IQ4_NL, w4_iq4_nl)

/* int16 element i of each 128-bit lane of v, broadcast over the lane (lanes may differ). */
AI __m256i pick16(__m256i v, int i_lo, int i_hi) {
    const __m128i lo = _mm_set1_epi16((short)((2 * i_lo) | ((2 * i_lo + 1) << 8)));
    const __m128i hi = _mm_set1_epi16((short)((2 * i_hi) | ((2 * i_hi + 1) << 8)));
    return _mm256_shuffle_epi8(v, _mm256_set_m128i(hi, lo));
}

/* 4 int32 -> float, in the low half of a vector whose high half is 0. */
AI __m256 low4_ps(__m128i v) { return _mm256_zextps128_ps256(_mm_cvtepi32_ps(v)); }

/* The codes of sub-blocks 2c, 2c+1 of a Q4_K, Q5_K or IQ4_XS block from its 32 code bytes at qs:
 * low nibbles to *lo, high to *hi; Q5_K's fifth bits from *qh (shifted on by two bits per call);
 * IQ4_XS's codes mapped through its value table kv (16 bytes per sub-block: the low nibbles are
 * its first 16 values), so *lo and *hi then hold signed values. */
AI void k32_pair_codes(const int t, const uint8_t *qs, __m256i *qh, const __m256i kv, __m256i *lo,
                       __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i q = _mm256_loadu_si256((const __m256i *)qs);
    __m256i l = _mm256_and_si256(q, m4), h = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if (t == T_Q5_K) {
        l = _mm256_or_si256(l, _mm256_and_si256(_mm256_slli_epi16(*qh, 4), _mm256_set1_epi8(0x10)));
        h = _mm256_or_si256(h, _mm256_and_si256(_mm256_slli_epi16(*qh, 3), _mm256_set1_epi8(0x10)));
        *qh = _mm256_srli_epi16(*qh, 2);
    }
    if (t == T_IQ4_XS) {
        const __m256i a = _mm256_permute2x128_si256(l, h, 0x20);
        const __m256i b = _mm256_permute2x128_si256(l, h, 0x31);
        l = _mm256_shuffle_epi8(kv, a);
        h = _mm256_shuffle_epi8(kv, b);
    }
    *lo = l;
    *hi = h;
}

/* y[0..3] = hsum of each acc[r] - accm[r] (the 4-way horizontal add of hsum4_ps). */
AI void store4(const __m256 acc[4], const __m256 accm[4], float *y) {
    const __m256 v[4] = {_mm256_sub_ps(acc[0], accm[0]), _mm256_sub_ps(acc[1], accm[1]),
                         _mm256_sub_ps(acc[2], accm[2]), _mm256_sub_ps(acc[3], accm[3])};
    _mm_storeu_ps(y, hsum4_ps(v));
}

/* The end of a K-quant row sweep over nw weight rows (1 or 4): y[0..nw-1]. One row goes through
 * the four-row horizontal add as four copies, so a row's bits do not depend on which kernel took
 * it. */
AI void store_rows(const __m256 acc[4], const __m256 accm[4], float *y, const int nw) {
    if (nw == 4) {
        store4(acc, accm, y);
        return;
    }
    const __m256 a[4] = {acc[0], acc[0], acc[0], acc[0]}, m[4] = {accm[0], accm[0], accm[0], accm[0]};
    float out[4];
    store4(a, m, out);
    y[0] = out[0];
}

/* Q4_K, Q5_K, IQ4_XS, block b of one weight row against activation row x: for each 64 values
 * c, the block's bytes give two sub-blocks (2c, 2c+1) of codes; the row adds sc * (codes . q) in
 * int32, then d dx (that sum) to *acc and dmin dx (mins . sums of q per 32) to *accm. */
AI void k32_block(const int t, const uint8_t *blk, const uint8_t *x, int64_t k, int64_t b,
                  __m256 *acc, __m256 *accm) {
    const int five = t == T_Q5_K, iq = t == T_IQ4_XS;
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES));
    const float dx = ((const float *)(x + k))[b];
    const int8_t *xq = (const int8_t *)x + 256 * b;
    /* lane 0 d dx, lane 1 dmin dx (Q4_K/Q5_K: d and dmin in one conversion) */
    const __m128 ddx = _mm_mul_ps(iq ? _mm_set_ss(h2f(blk)) : h2f_pair(blk), _mm_set1_ps(dx));
    /* scales as int16 (signed for IQ4_XS, unsigned otherwise), the minimums the same */
    __m128i sc8, mn16 = _mm_setzero_si128();
    if (iq) {
        int8_t sc[8];
        xs_scales(blk + 2, sc);
        sc8 = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)sc));
    } else {
        const __m128i sm = k4_scales_mins(blk + 4);
        sc8 = _mm_cvtepu8_epi16(sm);
        mn16 = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
    }
    const __m256i sc16 = _mm256_broadcastsi128_si256(sc8);
    const uint8_t *qs = blk + (iq ? 8 : 16 + 32 * five);
    __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
    __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}; /* two chains */
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        k32_pair_codes(t, qs + 32 * c, &qh, kv, &lo, &hi);
        const __m256i ulo = iq ? _mm256_abs_epi8(lo) : lo, uhi = iq ? _mm256_abs_epi8(hi) : hi;
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + 64 * c));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + 64 * c + 32));
        if (iq) {
            x0 = _mm256_sign_epi8(x0, lo);
            x1 = _mm256_sign_epi8(x1, hi);
        }
        isum[0] = madd_acc(isum[0], _mm256_maddubs_epi16(ulo, x0), pick16(sc16, 2 * c, 2 * c));
        isum[1] = madd_acc(isum[1], _mm256_maddubs_epi16(uhi, x1), pick16(sc16, 2 * c + 1, 2 * c + 1));
    }
    *acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(ddx), _mm256_cvtepi32_ps(_mm256_add_epi32(isum[0], isum[1])), *acc);
    if (!iq) {
        const int16_t *bs = (const int16_t *)(x + k + 4 * (k / 256)) + 16 * b;
        const __m128i s32 = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)bs),
                                           _mm_loadu_si128((const __m128i *)(bs + 8)));
        *accm = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(ddx)),
                                low4_ps(_mm_madd_epi16(s32, mn16)), *accm);
    }
}

/* Q4_K, Q5_K, IQ4_XS (one scale per 32 values): nw weight rows (1, or 4 at ws bytes apart: the
 * decode step's case) against one activation row x, each row read front to back (one sequential
 * stream) into its own accumulators, and one horizontal add ends the four. */
AI void rows_k32(const int t, const uint8_t *w, int64_t ws, const uint8_t *x, int64_t k, float *y,
                 const int nw) {
    const int bb = block_bytes(t);
    __m256 acc[4], accm[4]; /* accm: the minimums' term, a chain of its own */
    for (int r = 0; r < nw; r++) {
        acc[r] = accm[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < k / 256; b++) k32_block(t, w + r * ws + b * bb, x, k, b, &acc[r], &accm[r]);
    }
    store_rows(acc, accm, y, nw);
}

/* The codes of half h of a Q2_K, Q3_K or Q6_K block as unsigned bytes, group s (values
 * 128 h + 32 s ..) in g[s]. Q3_K's high bits come from *hm (the block's hmask, shifted on by one
 * bit per group), Q6_K's from its qh bytes. */
AI void k16_half_codes(const int t, const uint8_t *blk, const int h, __m256i *hm, __m256i g[4]) {
    const __m256i m2 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    if (t == T_Q6_K) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        g[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        g[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        g[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
        g[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
        return;
    }
    const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + (t == T_Q3_K ? 32 : 16) + 32 * h));
    for (int s = 0; s < 4; s++) {
        g[s] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m2);
        if (t == T_Q3_K) { /* the high bit of group (h, s) is bit 4h + s of hmask */
            g[s] = _mm256_or_si256(g[s], _mm256_and_si256(_mm256_slli_epi16(*hm, 2), _mm256_set1_epi8(4)));
            *hm = _mm256_srli_epi16(*hm, 1);
        }
    }
}

/* Q2_K, Q3_K, Q6_K, block b of one weight row against activation row x. The block is two
 * halves h of four 32-value groups s (value 128 h + 32 s + l); a group's low 16 values take
 * scale 8h + 2s, its high 16 the next. Codes are unsigned (Q3_K: 0..7 meaning -4..3, Q6_K: 0..63
 * meaning -32..31, Q2_K: 0..3 with a minimum); the offset comes off the int32 sum and the
 * minimum (to *accm) through the sums of q per 16. */
AI void k16_block(const int t, const uint8_t *blk, const uint8_t *x, int64_t k, int64_t b,
                  __m256 *acc, __m256 *accm) {
    const float dx = ((const float *)(x + k))[b];
    const int8_t *xq = (const int8_t *)x + 256 * b;
    const __m256i bs = _mm256_loadu_si256((const __m256i *)((const int16_t *)(x + k + 4 * (k / 256)) + 16 * b));
    float d, dmin = 0.0f;
    __m128i sc8, mn8 = _mm_setzero_si128(); /* 16 scales (int8), 16 minimums (Q2_K) */
    if (t == T_Q2_K) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)blk);
        sc8 = _mm_and_si128(raw, _mm_set1_epi8(15));
        mn8 = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
        d = h2f(blk + 80);
        dmin = h2f(blk + 82);
    } else if (t == T_Q3_K) {
        int8_t s[16];
        k3_scales(blk + 96, s);
        sc8 = _mm_loadu_si128((const __m128i *)s);
        d = h2f(blk + 108);
    } else {
        sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        d = h2f(blk + 208);
    }
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8); /* scale i at int16 i */
    __m256i hm = t == T_Q3_K ? _mm256_loadu_si256((const __m256i *)blk) : _mm256_setzero_si256();
    __m256i isum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}; /* two chains */
    for (int h = 0; h < 2; h++) {
        const __m256i sch = _mm256_permute4x64_epi64(sc16, h ? 0xEE : 0x44); /* scales 8h.. in both lanes */
        __m256i g[4];
        k16_half_codes(t, blk, h, &hm, g);
        for (int s = 0; s < 4; s++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 128 * h + 32 * s));
            isum[s & 1] = madd_acc(isum[s & 1], _mm256_maddubs_epi16(g[s], xv), pick16(sch, 2 * s, 2 * s + 1));
        }
    }
    __m256i is = _mm256_add_epi32(isum[0], isum[1]);
    if (t != T_Q2_K) /* offsets 32 (Q6_K) and 4 (Q3_K), as shifts */
        is = _mm256_sub_epi32(is, _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), t == T_Q6_K ? 5 : 2));
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(is), *acc);
    if (t == T_Q2_K)
        *accm = _mm256_fmadd_ps(_mm256_set1_ps(dmin * dx),
                                _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, _mm256_cvtepu8_epi16(mn8))), *accm);
}

/* Q2_K, Q3_K, Q6_K (one scale per 16 values): nw weight rows against one activation row, as
 * rows_k32. */
AI void rows_k16(const int t, const uint8_t *w, int64_t ws, const uint8_t *x, int64_t k, float *y,
                 const int nw) {
    const int bb = block_bytes(t);
    __m256 acc[4], accm[4];
    for (int r = 0; r < nw; r++) {
        acc[r] = accm[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < k / 256; b++) k16_block(t, w + r * ws + b * bb, x, k, b, &acc[r], &accm[r]);
    }
    store_rows(acc, accm, y, nw);
}

/* Four weight rows of a K-quant or IQ4_XS against one activation row (sweep's decode case). */
#define ROWSK_W4(T, KERNEL, NAME) \
    static void NAME(const uint8_t *w, int64_t ws, const uint8_t *x, int64_t k, float *y) { \
        KERNEL(T, w, ws, x, k, y, 4); }
ROWSK_W4(T_Q4_K, rows_k32, w4_q4_k)
ROWSK_W4(T_Q5_K, rows_k32, w4_q5_k)
ROWSK_W4(T_IQ4_XS, rows_k32, w4_iq4_xs)
ROWSK_W4(T_Q2_K, rows_k16, w4_q2_k)
ROWSK_W4(T_Q3_K, rows_k16, w4_q3_k)
ROWSK_W4(T_Q6_K, rows_k16, w4_q6_k)

typedef void (*w4_fn)(const uint8_t *, int64_t, const uint8_t *, int64_t, float *);

/* The four-row kernel for type t. */
static w4_fn w4_kernel(int t) {
    switch (t) {
    case T_Q4_0: return w4_q4_0;
    case T_Q4_1: return w4_q4_1;
    case T_Q5_0: return w4_q5_0;
    case T_Q5_1: return w4_q5_1;
    case T_Q8_0: return w4_q8_0;
    case T_IQ4_NL: return w4_iq4_nl;
    case T_Q4_K: return w4_q4_k;
    case T_Q5_K: return w4_q5_k;
    case T_IQ4_XS: return w4_iq4_xs;
    case T_Q2_K: return w4_q2_k;
    case T_Q3_K: return w4_q3_k;
    default: return w4_q6_k;
    }
}

/* A 256-value block laid out for the per-row loop of several activation rows: 8 groups of 32
 * values (group i meets activation values 32 i .. 32 i + 31), each with its codes as maddubs takes
 * them (|w| where the values are signed, IQ4_XS, whose signs go in w), its scale as int16 over
 * each 16-value half, and corr, 16 int16 multiplying the row's sums per 16: the minimums (Q2_K;
 * Q4_K/Q5_K's per-32 ones twice), or the scales (Q3_K, Q6_K: their offsets 4 and 32). */
typedef struct {
    __m256i u[8], w[8], sc[8], corr;
    float d, dmin;
} kblock;

AI void unpack_k32(const int t, const uint8_t *blk, kblock *kb) {
    const int five = t == T_Q5_K, iq = t == T_IQ4_XS;
    uint8_t sc[8], mn[8];
    kb->d = h2f(blk);
    if (iq) xs_scales(blk + 2, (int8_t *)sc);
    else {
        k4_scales(blk + 4, sc, mn);
        kb->dmin = h2f(blk + 2);
        const __m128i mn8 = _mm_loadl_epi64((const __m128i *)mn);
        kb->corr = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
    }
    const __m128i sc8 = _mm_loadl_epi64((const __m128i *)sc);
    const __m256i sc16 = _mm256_broadcastsi128_si256(iq ? _mm_cvtepi8_epi16(sc8) : _mm_cvtepu8_epi16(sc8));
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES));
    const uint8_t *qs = blk + (iq ? 8 : 16 + 32 * five);
    __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i lo, hi;
        k32_pair_codes(t, qs + 32 * c, &qh, kv, &lo, &hi);
        if (iq) {
            kb->w[2 * c] = lo;
            kb->w[2 * c + 1] = hi;
            kb->u[2 * c] = _mm256_abs_epi8(kb->w[2 * c]);
            kb->u[2 * c + 1] = _mm256_abs_epi8(kb->w[2 * c + 1]);
        } else {
            kb->u[2 * c] = lo;
            kb->u[2 * c + 1] = hi;
        }
        kb->sc[2 * c] = pick16(sc16, 2 * c, 2 * c);
        kb->sc[2 * c + 1] = pick16(sc16, 2 * c + 1, 2 * c + 1);
    }
}

AI void unpack_k16(const int t, const uint8_t *blk, kblock *kb) {
    __m128i sc8;
    if (t == T_Q2_K) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)blk);
        sc8 = _mm_and_si128(raw, _mm_set1_epi8(15));
        kb->corr = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15)));
        kb->d = h2f(blk + 80);
        kb->dmin = h2f(blk + 82);
    } else if (t == T_Q3_K) {
        int8_t s[16];
        k3_scales(blk + 96, s);
        sc8 = _mm_loadu_si128((const __m128i *)s);
        kb->d = h2f(blk + 108);
    } else {
        sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        kb->d = h2f(blk + 208);
    }
    const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
    if (t != T_Q2_K) kb->corr = sc16;
    __m256i hm = t == T_Q3_K ? _mm256_loadu_si256((const __m256i *)blk) : _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const __m256i sch = _mm256_permute4x64_epi64(sc16, h ? 0xEE : 0x44);
        k16_half_codes(t, blk, h, &hm, kb->u + 4 * h);
        for (int s = 0; s < 4; s++) kb->sc[4 * h + s] = pick16(sch, 2 * s, 2 * s + 1);
    }
}

/* The K-quants and IQ4_XS against several activation rows: each block unpacked once (kblock),
 * then per row 8 maddubs + madd and one float update. */
AI void rows_kmulti(const int t, const uint8_t *w, const uint8_t *x, size_t xs, int64_t k, float *y,
                    int64_t ys, const int nx) {
    const int bb = block_bytes(t), k16 = t == T_Q2_K || t == T_Q3_K || t == T_Q6_K;
    const int sgn = t == T_IQ4_XS, offs = t == T_Q6_K ? 5 : 2, minimum = t != T_IQ4_XS && t != T_Q3_K && t != T_Q6_K;
    const int64_t nb = k / 256;
    __m256 acc[4];
    kblock kb;
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (k16) unpack_k16(t, w + b * bb, &kb); else unpack_k32(t, w + b * bb, &kb);
        for (int j = 0; j < nx; j++) {
            const uint8_t *xr = x + j * xs;
            const int8_t *xq = (const int8_t *)xr + 256 * b;
            __m256i is = _mm256_setzero_si256();
            for (int i = 0; i < 8; i++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * i));
                if (sgn) xv = _mm256_sign_epi8(xv, kb.w[i]);
                is = madd_acc(is, _mm256_maddubs_epi16(kb.u[i], xv), kb.sc[i]);
            }
            const float dx = ((const float *)(xr + k))[b];
            const __m256i bs = _mm256_loadu_si256((const __m256i *)((const int16_t *)(xr + k + 4 * nb) + 16 * b));
            if (t == T_Q3_K || t == T_Q6_K) is = _mm256_sub_epi32(is, _mm256_slli_epi32(_mm256_madd_epi16(bs, kb.corr), offs));
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(kb.d * dx), _mm256_cvtepi32_ps(is), acc[j]);
            if (minimum)
                acc[j] = _mm256_fnmadd_ps(_mm256_set1_ps(kb.dmin * dx), _mm256_cvtepi32_ps(_mm256_madd_epi16(bs, kb.corr)), acc[j]);
        }
    }
    for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc[j]);
}

/* ---- float activations: codes to float in registers, no rounding of x ------------------------
 * The same block unpacking as above; each 16 values' dot of codes and x is taken in float32 and
 * scaled by that half's float scale, so the result differs from the dequantized float matrix's
 * product only by float32 rounding. */

/* Eight signed int8 codes (the low 8 bytes of v) as floats. */
AI __m256 codes8_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* 32 signed codes against x[0..31]: the dot of each 16-value half, as 8 partial sums each; xs
 * gets x's sums per half the same way (for minimums). */
AI void dot32_ps(__m256i c, const float *x, __m256 *h0, __m256 *h1, __m256 *s0, __m256 *s1) {
    const __m128i lo = _mm256_castsi256_si128(c), hi = _mm256_extracti128_si256(c, 1);
    const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8);
    const __m256 x2 = _mm256_loadu_ps(x + 16), x3 = _mm256_loadu_ps(x + 24);
    *h0 = _mm256_fmadd_ps(codes8_ps(lo), x0, _mm256_mul_ps(codes8_ps(_mm_srli_si128(lo, 8)), x1));
    *h1 = _mm256_fmadd_ps(codes8_ps(hi), x2, _mm256_mul_ps(codes8_ps(_mm_srli_si128(hi, 8)), x3));
    *s0 = _mm256_add_ps(x0, x1);
    *s1 = _mm256_add_ps(x2, x3);
}

/* A block of any type as 256 / 32 groups of 32 signed codes with a float scale and minimum per
 * 16 values: value = sc[h] * code - mn[h] (h = 16-value half, 2 per group). */
typedef struct {
    __m256i c[8];
    float sc[16], mn[16];
    int groups, minimum;
} fblock;

AI void unpack_f(const int t, const uint8_t *blk, fblock *fb) {
    if (block_values(t) == 32) {
        const float d = h2f(blk);
        __m256i c = w32(t, blk);
        if (t == T_Q4_0) c = _mm256_sub_epi8(c, _mm256_set1_epi8(8));
        if (t == T_Q5_0) c = _mm256_sub_epi8(c, _mm256_set1_epi8(16));
        fb->c[0] = c;
        fb->groups = 1;
        fb->minimum = t == T_Q4_1 || t == T_Q5_1;
        fb->sc[0] = fb->sc[1] = d;
        fb->mn[0] = fb->mn[1] = fb->minimum ? -h2f(blk + 2) : 0.0f;
        return;
    }
    kblock kb;
    kb.dmin = 0.0f; /* types without minimums leave it unset */
    fb->groups = 8;
    if (t == T_Q2_K || t == T_Q3_K || t == T_Q6_K) {
        unpack_k16(t, blk, &kb);
        int8_t s[16];
        if (t == T_Q6_K) memcpy(s, blk + 192, 16);
        else if (t == T_Q3_K) k3_scales(blk + 96, s);
        else for (int i = 0; i < 16; i++) s[i] = (int8_t)(blk[i] & 15);
        const __m256i off = _mm256_set1_epi8(t == T_Q6_K ? 32 : t == T_Q3_K ? 4 : 0);
        for (int i = 0; i < 8; i++) fb->c[i] = _mm256_sub_epi8(kb.u[i], off);
        fb->minimum = t == T_Q2_K;
        for (int i = 0; i < 16; i++) {
            fb->sc[i] = kb.d * (float)s[i];
            fb->mn[i] = fb->minimum ? kb.dmin * (float)(blk[i] >> 4) : 0.0f;
        }
        return;
    }
    unpack_k32(t, blk, &kb);
    uint8_t sc[8], mn[8];
    const int iq = t == T_IQ4_XS;
    if (iq) xs_scales(blk + 2, (int8_t *)sc); else k4_scales(blk + 4, sc, mn);
    fb->minimum = !iq;
    for (int i = 0; i < 8; i++) {
        fb->c[i] = iq ? kb.w[i] : kb.u[i];
        fb->sc[2 * i] = fb->sc[2 * i + 1] = kb.d * (float)(iq ? (int8_t)sc[i] : sc[i]);
        fb->mn[2 * i] = fb->mn[2 * i + 1] = iq ? 0.0f : kb.dmin * (float)mn[i];
    }
}

/* One weight row against nx <= 4 float activation rows (stride k). */
AI void rowsf_avx2(const int t, const uint8_t *w, const float *x, int64_t k, float *y, int64_t ys,
                   const int nx) {
    const int B = block_values(t), bb = block_bytes(t);
    const int64_t nb = k / B;
    __m256 acc[4];
    fblock fb;
    for (int j = 0; j < nx; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        unpack_f(t, w + b * bb, &fb);
        for (int j = 0; j < nx; j++) {
            const float *xr = x + j * k + b * B;
            for (int i = 0; i < fb.groups; i++) {
                __m256 h0, h1, s0, s1;
                dot32_ps(fb.c[i], xr + 32 * i, &h0, &h1, &s0, &s1);
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(fb.sc[2 * i]), h0, acc[j]);
                acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(fb.sc[2 * i + 1]), h1, acc[j]);
                if (fb.minimum) {
                    acc[j] = _mm256_fnmadd_ps(_mm256_set1_ps(fb.mn[2 * i]), s0, acc[j]);
                    acc[j] = _mm256_fnmadd_ps(_mm256_set1_ps(fb.mn[2 * i + 1]), s1, acc[j]);
                }
            }
        }
    }
    for (int j = 0; j < nx; j++) y[j * ys] = hsum_ps(acc[j]);
}

#define ROWSF_N(N) \
    static void rowsf_avx2_##N(int t, const uint8_t *w, const float *x, int64_t k, float *y, \
                               int64_t ys) { rowsf_avx2(t, w, x, k, y, ys, N); }
ROWSF_N(1)
ROWSF_N(2)
ROWSF_N(3)
ROWSF_N(4)

/* One activation row: the direct kernels; several: rows_kmulti. */
#define KROWS(T, ONE) \
    do { if (nx == 1) ONE(T, w, 0, x, k, y, 1); else rows_kmulti(T, w, x, xs, k, y, ys, nx); } while (0)

AI void rows_avx2(const int t, const uint8_t *w, const uint8_t *x, size_t xs, int64_t k, float *y,
                  int64_t ys, const int nx) {
    switch (t) {
    case T_Q4_0: rows32(T_Q4_0, w, x, xs, k, y, ys, nx); break;
    case T_Q4_1: rows32(T_Q4_1, w, x, xs, k, y, ys, nx); break;
    case T_Q5_0: rows32(T_Q5_0, w, x, xs, k, y, ys, nx); break;
    case T_Q5_1: rows32(T_Q5_1, w, x, xs, k, y, ys, nx); break;
    case T_Q8_0: rows32(T_Q8_0, w, x, xs, k, y, ys, nx); break;
    case T_IQ4_NL: rows32(T_IQ4_NL, w, x, xs, k, y, ys, nx); break;
    case T_Q4_K: KROWS(T_Q4_K, rows_k32); break;
    case T_Q5_K: KROWS(T_Q5_K, rows_k32); break;
    case T_IQ4_XS: KROWS(T_IQ4_XS, rows_k32); break;
    case T_Q2_K: KROWS(T_Q2_K, rows_k16); break;
    case T_Q3_K: KROWS(T_Q3_K, rows_k16); break;
    case T_Q6_K: KROWS(T_Q6_K, rows_k16); break;
    }
}

/* One variant per row count, so each has its accumulators in registers. */
#define ROWS_N(N) \
    static void rows_avx2_##N(int t, const uint8_t *w, const uint8_t *x, size_t xs, int64_t k, \
                              float *y, int64_t ys) { rows_avx2(t, w, x, xs, k, y, ys, N); }
ROWS_N(1)
ROWS_N(2)
ROWS_N(3)
ROWS_N(4)

#ifdef __AVX512VL__
/* Eight activation rows a weight-row visit for the 32-value types, whose 16 accumulators AVX-512's
 * 32 vector registers hold: a block's weights are unpacked once for the eight. Each row's sums
 * are those of rows32 at any nx above 1, so the outputs are the same bits as four a visit. */
#define ROWS_PER_VISIT_32 8
static void rows32_8(int t, const uint8_t *w, const uint8_t *x, size_t xs, int64_t k, float *y,
                     int64_t ys) {
    switch (t) {
    case T_Q4_0: rows32(T_Q4_0, w, x, xs, k, y, ys, 8); break;
    case T_Q4_1: rows32(T_Q4_1, w, x, xs, k, y, ys, 8); break;
    case T_Q5_0: rows32(T_Q5_0, w, x, xs, k, y, ys, 8); break;
    case T_Q5_1: rows32(T_Q5_1, w, x, xs, k, y, ys, 8); break;
    case T_Q8_0: rows32(T_Q8_0, w, x, xs, k, y, ys, 8); break;
    case T_IQ4_NL: rows32(T_IQ4_NL, w, x, xs, k, y, ys, 8); break;
    }
}
#endif
#endif /* LG_AVX2 */

#ifndef ROWS_PER_VISIT_32
#define ROWS_PER_VISIT_32 4
#endif

/* How many activation rows one weight row of qtype meets a visit of the quantized path: 8 for
 * the 32-value types with AVX-512, else 4. */
static int rows_per_visit(int qtype) { return block_values(qtype) == 32 ? ROWS_PER_VISIT_32 : 4; }

/* One weight row against nx activation rows: up to 4, or rows_per_visit(t). */
static void rows(int t, const uint8_t *w, const uint8_t *x, size_t xs, int64_t k, float *y,
                 int64_t ys, int nx, int scalar) {
#ifdef LG_AVX2
    if (!scalar) {
        switch (nx) {
#if ROWS_PER_VISIT_32 == 8
        case 8: rows32_8(t, w, x, xs, k, y, ys); return;
#endif
        case 1: rows_avx2_1(t, w, x, xs, k, y, ys); return;
        case 2: rows_avx2_2(t, w, x, xs, k, y, ys); return;
        case 3: rows_avx2_3(t, w, x, xs, k, y, ys); return;
        default: rows_avx2_4(t, w, x, xs, k, y, ys); return;
        }
    }
#endif
    (void)scalar;
    rows_scalar(t, w, x, xs, k, y, ys, nx);
}

/* One weight row against nx <= 4 float activation rows: the dequantized block times x. */
static void rowsf(int t, const uint8_t *w, const float *x, int64_t k, float *y, int64_t ys, int nx,
                  int scalar) {
#ifdef LG_AVX2
    if (!scalar) {
        switch (nx) {
        case 1: rowsf_avx2_1(t, w, x, k, y, ys); return;
        case 2: rowsf_avx2_2(t, w, x, k, y, ys); return;
        case 3: rowsf_avx2_3(t, w, x, k, y, ys); return;
        default: rowsf_avx2_4(t, w, x, k, y, ys); return;
        }
    }
#endif
    (void)scalar;
    const int B = block_values(t), bb = block_bytes(t);
    float wf[256];
    double acc[4] = {0, 0, 0, 0};
    for (int64_t b = 0; b < k / B; b++) {
        deq_block(t, w + b * bb, wf);
        for (int j = 0; j < nx; j++) {
            float s = 0.0f;
            for (int i = 0; i < B; i++) s += wf[i] * x[j * k + b * B + i];
            acc[j] += (double)s;
        }
    }
    for (int j = 0; j < nx; j++) y[j * ys] = (float)acc[j];
}

#include "gguf_x8.h"

/* ---- Entry points -------------------------------------------------------------------------- */

/* 1 for the types this file implements (ggml type ids), else 0. */
int lg_gguf_supported(int qtype) { return block_values(qtype) != 0; }

/* 1 where the AVX2 kernels are compiled in, 0 where the scalar path is all there is. */
int lg_gguf_simd(void) {
#ifdef LG_AVX2
    return 1;
#else
    return 0;
#endif
}

/* Activation values below which lg_gguf_matmul quantizes on the calling thread. */
#define SERIAL_QUANT_VALUES (64 * 1024)

static void quant_rows(const float *x, int64_t i0, int64_t i1, int64_t k, int ablock, uint8_t *xq,
                       size_t xs) {
    for (int64_t i = i0; i < i1; i++) {
        if (ablock == 32) quant_row32(x + i * k, k, xq + i * xs);
        else quant_row256(x + i * k, k, xq + i * xs);
    }
}

/* 0 when w's rows hold k values of qtype; -1 for a type not implemented, -2 for k not a multiple
 * of the block or a row stride shorter than a row. */
static int check_rows(int qtype, int64_t k, int64_t w_stride) {
    const int B = block_values(qtype);
    if (!B) return -1;
    if (k <= 0 || k % B || w_stride < k / B * block_bytes(qtype)) return -2;
    return 0;
}

/* check_rows for n rows; a repacked matrix also needs whole 8-row groups, rows back to back
 * and rows no longer than X8_MAX_ROW_BYTES (else -2). */
static int check_matrix(int qtype, int64_t k, int64_t w_stride, int64_t n) {
    const int rc = check_rows(qtype, k, w_stride);
    if (rc || !x8_file_type(qtype)) return rc;
    const int64_t bytes = k / 256 * block_bytes(qtype);
    return n % X8_ROWS || w_stride != bytes || bytes > X8_MAX_ROW_BYTES ? -2 : 0;
}

/* sweep() for a matrix of repacked type t (n a multiple of 8): chunks of whole 8-row groups;
 * a tile's quantized activation rows meet a group's 8 rows up to 4 at a visit (x8_group_rows: the
 * group's bytes stay in cache across the tile); float activations and the scalar path unpack
 * each row to the file's blocks in a stack buffer and take the file type's kernels. */
static void sweep_x8(int t, const uint8_t *w, int64_t ws, int64_t n, const uint8_t *xa, size_t xs,
                     int64_t m, int64_t k, float *y, int64_t ldy, int64_t m_tile, int64_t n_chunk,
                     int f32, int scalar) {
    const int64_t chunk = (n_chunk + X8_ROWS - 1) / X8_ROWS * X8_ROWS, chunks = (n + chunk - 1) / chunk;
    const int ft = x8_file_type(t);
#ifdef LG_AVX2
    const int direct = !f32 && !scalar;
#else
    const int direct = 0; /* activation tiles serve the 8-row kernel only */
    (void)m_tile;
#endif
#pragma omp for schedule(guided, 1) nowait
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t r0 = c * chunk, r1 = r0 + chunk < n ? r0 + chunk : n;
        if (direct) {
#ifdef LG_AVX2
            for (int64_t i0 = 0; i0 < m; i0 += m_tile) {
                const int64_t i1 = i0 + m_tile < m ? i0 + m_tile : m;
                for (int64_t g = r0; g < r1; g += X8_ROWS)
                    x8_group_rows(t, w + g * ws, xa, xs, i0, i1, k, y + g, ldy);
            }
#endif
            continue;
        }
        uint8_t row[X8_MAX_ROW_BYTES] __attribute__((aligned(64)));
        for (int64_t r = r0; r < r1; r++) {
            x8_unpack_row(t, w, ws, r, k, row);
            for (int64_t i = 0; i < m; i += 4) {
                const int nx = (int)(m - i < 4 ? m - i : 4);
                if (f32) rowsf(ft, row, (const float *)(xa + i * xs), k, y + i * ldy + r, ldy, nx, scalar);
                else rows(ft, row, xa + i * xs, xs, k, y + i * ldy + r, ldy, nx, scalar);
            }
        }
    }
}

/* The shared work split, run inside a parallel region (its loop is an orphaned omp for, nowait:
 * the caller's region ends in a barrier, and consecutive sweeps write apart): threads take
 * chunks of n_chunk output rows, guided; within a chunk, activation rows go m_tile at a time, 4
 * (rows_per_visit) per weight-row visit. Activation row i is at xa + i * xs bytes: quantized rows for rows(), float32
 * rows (xs = 4 k) for rowsf() when f32. Output row i starts at y + i * ldy. */
static void sweep(int qtype, const uint8_t *w, int64_t w_stride, int64_t n, const uint8_t *xa,
                  size_t xs, int64_t m, int64_t k, float *y, int64_t ldy, int64_t m_tile,
                  int64_t n_chunk, int f32, int scalar) {
    if (x8_file_type(qtype)) {
        sweep_x8(qtype, w, w_stride, n, xa, xs, m, k, y, ldy, m_tile, n_chunk, f32, scalar);
        return;
    }
    const int64_t chunks = (n + n_chunk - 1) / n_chunk;
    const int visit = f32 || scalar ? 4 : rows_per_visit(qtype);
#ifdef LG_AVX2
    const w4_fn w4 = m == 1 && !f32 && !scalar ? w4_kernel(qtype) : NULL;
#endif
#pragma omp for schedule(guided, 1) nowait
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t r0 = c * n_chunk, r1 = r0 + n_chunk < n ? r0 + n_chunk : n;
        int64_t r4 = r0;
#ifdef LG_AVX2
        if (w4) /* one activation row: four weight rows a visit */
            for (; r4 + 4 <= r1; r4 += 4) w4(w + r4 * w_stride, w_stride, xa, k, y + r4);
#endif
        for (int64_t i0 = 0; i0 < m; i0 += m_tile) {
            const int64_t i1 = i0 + m_tile < m ? i0 + m_tile : m;
            for (int64_t r = r4; r < r1; r++)
                for (int64_t i = i0, nx; i < i1; i += nx) {
                    nx = i1 - i >= visit ? visit : i1 - i < 4 ? i1 - i : 4;
                    if (f32) rowsf(qtype, w + r * w_stride, (const float *)(xa + i * xs), k,
                                   y + i * ldy + r, ldy, (int)nx, scalar);
                    else rows(qtype, w + r * w_stride, xa + i * xs, xs, k, y + i * ldy + r, ldy,
                              (int)nx, scalar);
                }
        }
    }
}

/* A matrix whose rows come in segments of different types (Q4_K_M's q, k and v stacked), which
 * the entry points take as one matrix: qtype T_SEGMENTS, w the address of an lg_segments (the
 * segments' rows in order, n their sum; w_stride unused). One call quantizes x once per
 * activation block size and sweeps every segment in one parallel region; each output equals
 * its segment's own call bit for bit. */
#define T_SEGMENTS 1000
#define MAX_SEGMENTS 4
typedef struct {
    const uint8_t *w;
    int64_t n, w_stride;
    int qtype;
} lg_segment;
typedef struct {
    int count;
    lg_segment seg[MAX_SEGMENTS];
} lg_segments;

/* The segments a call names in *s: the table at w for T_SEGMENTS, else the one matrix. Returns
 * check_rows' code for the first bad segment, -4 for a table of no or too many segments, of a
 * negative row count, or whose rows do not add up to n. */
static int segments_of(const uint8_t *w, int64_t n, int64_t w_stride, int qtype, int64_t k,
                       lg_segments *s) {
    if (qtype != T_SEGMENTS) {
        s->count = 1;
        s->seg[0] = (lg_segment){w, n, w_stride, qtype};
        return check_matrix(qtype, k, w_stride, n);
    }
    const lg_segments *t = (const lg_segments *)w;
    if (!t || t->count < 1 || t->count > MAX_SEGMENTS) return -4;
    int64_t rows = 0;
    for (int j = 0; j < t->count; j++) {
        if (t->seg[j].n < 0) return -4;
        const int rc = check_matrix(t->seg[j].qtype, k, t->seg[j].w_stride, t->seg[j].n);
        if (rc) return rc;
        rows += t->seg[j].n;
    }
    if (rows != n) return -4;
    *s = *t;
    return 0;
}

/* The checks of lg_gguf_matmul*: segments_of's error code, 0 when there is nothing to compute,
 * else 1 with the unset work-split arguments (below 1) made one M tile, one N chunk, one
 * thread. */
static int prepare(const uint8_t *w, int64_t n, int64_t w_stride, int qtype, int64_t k, int64_t m,
                   lg_segments *s, int64_t *m_tile, int64_t *n_chunk, int *threads) {
    const int rc = segments_of(w, n, w_stride, qtype, k, s);
    if (rc) return rc;
    if (m <= 0 || n <= 0) return 0;
    if (*m_tile < 1) *m_tile = m;
    if (*n_chunk < 1) *n_chunk = n;
    if (*threads < 1) *threads = 1;
    return 1;
}

/* Values per activation block for weights of qtype: 256 for the K-quants and IQ4_XS. */
static int act_block(int qtype) { return block_values(qtype) == 256 ? 256 : 32; }

/* Every segment swept, inside a parallel region: segment j's activation rows at xa[a] (a = 1
 * for 256-value activation blocks), xs[a] bytes apart, its outputs the next columns of y. */
static void sweep_segments(const lg_segments *s, uint8_t *const xa[2], const size_t xs[2],
                           int64_t m, int64_t k, float *y, int64_t n, int64_t m_tile,
                           int64_t n_chunk, int f32, int scalar) {
    int64_t col = 0;
    for (int j = 0; j < s->count; j++) {
        const lg_segment *g = &s->seg[j];
        const int a = act_block(g->qtype) == 256;
        sweep(g->qtype, g->w, g->w_stride, g->n, xa[a], xs[a], m, k, y + col, n, m_tile, n_chunk,
              f32, scalar);
        col += g->n;
    }
}

/* y [m, n] float32 = x [m, k] float32 (contiguous) . W^T, W's row r at w + r * w_stride (bytes)
 * holding k / block_values blocks of qtype (or the segments of T_SEGMENTS), the activations
 * rounded to 8 bits per block first. Work split as sweep(); scalar != 0 forces the scalar path.
 * Returns 0; -1 for a type not implemented; -2 for k not a multiple of the block or a row stride
 * shorter than a row; -3 when the activation buffer cannot be allocated; -4 for a bad segment
 * table. */
int lg_gguf_matmul(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                   int64_t w_stride, int qtype, float *y, int threads, int64_t m_tile,
                   int64_t n_chunk, int scalar) {
    lg_segments s;
    const int go = prepare(w, n, w_stride, qtype, k, m, &s, &m_tile, &n_chunk, &threads);
    if (go <= 0) return go;
    int need[2] = {0, 0};
    for (int j = 0; j < s.count; j++) need[act_block(s.seg[j].qtype) == 256] = 1;
    const int blocks[2] = {32, 256};
    const size_t xs[2] = {xrow_bytes(k, 32), xrow_bytes(k, 256)};
    uint8_t *xq[2] = {NULL, NULL};
    for (int a = 0; a < 2; a++)
        if (need[a] && !(xq[a] = aligned_alloc(64, xs[a] * (size_t)m))) {
            free(xq[0]);
            return -3;
        }
    /* A few rows quantize faster than a barrier waits for a thread that has no core yet. */
    const int serial_quant = m * k < SERIAL_QUANT_VALUES;
    if (serial_quant)
        for (int a = 0; a < 2; a++)
            if (need[a]) quant_rows(x, 0, m, k, blocks[a], xq[a], xs[a]);
#pragma omp parallel num_threads(threads)
    {
        if (!serial_quant)
            for (int a = 0; a < 2; a++) {
                if (!need[a]) continue;
#pragma omp for schedule(static)
                for (int64_t i = 0; i < m; i++) quant_rows(x, i, i + 1, k, blocks[a], xq[a], xs[a]);
            }
        sweep_segments(&s, xq, xs, m, k, y, n, m_tile, n_chunk, 0, scalar);
    }
    free(xq[0]);
    free(xq[1]);
    return 0;
}

/* lg_gguf_matmul with x kept in float32: each block's codes are converted to float in registers
 * (no 8-bit rounding of x), so y equals x . dequantized(W)^T up to float32 rounding. Same
 * arguments and return codes (no buffer: -3 never happens). */
int lg_gguf_matmul_f32(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n,
                       int64_t w_stride, int qtype, float *y, int threads, int64_t m_tile,
                       int64_t n_chunk, int scalar) {
    lg_segments s;
    const int go = prepare(w, n, w_stride, qtype, k, m, &s, &m_tile, &n_chunk, &threads);
    if (go <= 0) return go;
    uint8_t *const xa[2] = {(uint8_t *)x, (uint8_t *)x};
    const size_t xs[2] = {4 * (size_t)k, 4 * (size_t)k};
#pragma omp parallel num_threads(threads)
    sweep_segments(&s, xa, xs, m, k, y, n, m_tile, n_chunk, 1, scalar);
    return 0;
}

/* out [n, k] float32 = W dequantized (the scalar block decoding above; rows split over threads).
 * Returns 0, -1 for a type not implemented, -2 for a bad k or stride. */
int lg_gguf_dequant(const uint8_t *w, int64_t n, int64_t w_stride, int qtype, int64_t k, float *out,
                    int threads) {
    const int rc = check_matrix(qtype, k, w_stride, n);
    if (rc) return rc;
    const int B = block_values(qtype), bb = block_bytes(qtype);
    if (threads < 1) threads = 1;
    if (x8_file_type(qtype)) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t r = 0; r < n; r++) {
            uint8_t row[X8_MAX_ROW_BYTES];
            x8_unpack_row(qtype, w, w_stride, r, k, row);
            for (int64_t b = 0; b < k / B; b++) deq_block(x8_file_type(qtype), row + b * bb, out + r * k + b * B);
        }
        return 0;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < n; r++)
        for (int64_t b = 0; b < k / B; b++) deq_block(qtype, w + r * w_stride + b * bb, out + r * k + b * B);
    return 0;
}

/* Bytes of one quantized activation row of k values for qtype (what lg_gguf_matmul allocates
 * per row of x), or 0 for a type not implemented. */
int64_t lg_gguf_xrow_bytes(int qtype, int64_t k) {
    const int B = block_values(qtype);
    if (!B) return 0;
    return (int64_t)xrow_bytes(k, B);
}

/* Rows w [n, k / 256 * block bytes, rows back to back] of file type qtype (Q4_K or Q6_K)
 * repacked 8 at a time into out (gguf_x8.h's layout of that type, the same size), or, when
 * unpack != 0, rows of its repacked type back to the file's blocks; out may be w (a group's 8
 * rows are copied aside before they are written). Returns 0, -1 for a type without a repacked
 * layout, -2 for n not a multiple of 8 or a bad k, -3 when a group's copy cannot be allocated. */
int lg_gguf_repack(int qtype, const uint8_t *w, int64_t n, int64_t k, uint8_t *out, int unpack,
                   int threads) {
    const int xt = x8_type(qtype);
    if (!xt) return -1;
    if (k <= 0 || k % 256 || n % X8_ROWS) return -2;
    const int bb = block_bytes(qtype);
    const int64_t ws = k / 256 * bb, nb = k / 256;
    int failed = 0;
    if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        uint8_t *tmp = malloc((size_t)(X8_ROWS * ws)); /* one group's rows, per thread */
        /* dynamic: a core that another process slows takes fewer groups */
#pragma omp for schedule(dynamic, 16)
        for (int64_t g = 0; g < n; g += X8_ROWS) {
            if (!tmp) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            memcpy(tmp, w + g * ws, (size_t)(X8_ROWS * ws));
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *grp = tmp + b * X8_ROWS * bb;
                if (unpack)
                    for (int r = 0; r < X8_ROWS; r++) x8_unpack_block(xt, grp, r, out + (g + r) * ws + b * bb);
                else x8_pack_group(qtype, tmp + b * bb, ws, out + g * ws + b * X8_ROWS * bb);
            }
        }
        free(tmp);
    }
    return failed ? -3 : 0;
}
