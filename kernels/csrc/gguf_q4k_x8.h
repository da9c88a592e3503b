/* Q4_K rows repacked 8 at a time for one-activation-row products (included by gguf_x8.h, which
 * gives X8_ROWS; gguf_matmul.c defines AI, dot_u8s8_acc, k4_scales, rd32, LG_AVX2 and the
 * activation row layout used here).
 *
 * The file's Q4_K block (ggml-common.h block_q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales
 * and mins, 128 bytes of nibbles) keeps one row's 256 values together, so a product with one
 * activation row ends each row in a horizontal sum and spreads each sub-block's scale over a
 * register. Repacked, the 8 blocks of rows 8g .. 8g+7 at block column b become one 1152-byte
 * group (8 x 144: the same bytes per weight, so a matrix keeps its shape [n, row bytes]):
 *
 *   bytes    0..15    d of rows 0..7 (fp16)
 *   bytes   16..31    dmin of rows 0..7 (fp16)
 *   bytes   32..63    low 4 bits of the scales, as nibbles: byte i holds index i (low nibble)
 *                     and index 32 + i (high), index = 8 sub-block + row
 *   bytes   64..95    low 4 bits of the mins, the same way
 *   bytes   96..127   high 2 bits: byte i holds those of scale i (bits 0-1), scale 32 + i (2-3),
 *                     min i (4-5), min 32 + i (6-7)
 *   bytes  128..1151  codes: pair p of sub-blocks (2p, 2p+1), 4-value group q (values 4q..4q+3
 *                     of each), row r: the 4 file bytes 32p + 4q .. 32p + 4q + 3 of row r at
 *                     128 + 256 p + 32 q + 4 r (low nibbles sub-block 2p, high 2p+1)
 *
 * so 32 code bytes hold 4 values of one sub-block for each of the 8 rows, one 32-bit lane a row:
 * a dot product instruction with 4 broadcast activation bytes gives each row's partial sum in
 * its own lane, a sub-block's 8 scales are one vector, and the 8 outputs need no horizontal sum.
 * The idea is llama.cpp's repacked CPU layouts (ggml-cpu/repack); this layout is this file's.
 */

#define Q4X8_GROUP_BYTES (X8_ROWS * 144)

/* The 8 Q4_K blocks at src (rows src_stride bytes apart) as one repacked group at dst. */
static void q4x8_pack_group(const uint8_t *src, int64_t src_stride, uint8_t *dst) {
    uint8_t sc[64], mn[64];
    memset(dst + 32, 0, 96);
    for (int r = 0; r < X8_ROWS; r++) {
        const uint8_t *blk = src + r * src_stride;
        memcpy(dst + 2 * r, blk, 2);
        memcpy(dst + 16 + 2 * r, blk + 2, 2);
        uint8_t s[8], m[8];
        k4_scales(blk + 4, s, m);
        for (int j = 0; j < 8; j++) {
            sc[8 * j + r] = s[j];
            mn[8 * j + r] = m[j];
        }
        for (int p = 0; p < 4; p++)
            for (int q = 0; q < 8; q++) memcpy(dst + 128 + 256 * p + 32 * q + 4 * r, blk + 16 + 32 * p + 4 * q, 4);
    }
    for (int i = 0; i < 32; i++) {
        dst[32 + i] = (uint8_t)((sc[i] & 15) | ((sc[32 + i] & 15) << 4));
        dst[64 + i] = (uint8_t)((mn[i] & 15) | ((mn[32 + i] & 15) << 4));
        dst[96 + i] = (uint8_t)((sc[i] >> 4) | ((sc[32 + i] >> 4) << 2) | ((mn[i] >> 4) << 4) | ((mn[32 + i] >> 4) << 6));
    }
}

/* Row r's block of the repacked group at src, back as the file's 144 bytes at blk. */
static void q4x8_unpack_block(const uint8_t *src, int r, uint8_t *blk) {
    uint8_t s[8], m[8];
    memcpy(blk, src + 2 * r, 2);
    memcpy(blk + 2, src + 16 + 2 * r, 2);
    for (int j = 0; j < 8; j++) {
        const int i = 8 * j + r, lo = i & 31, hi = i >= 32;
        s[j] = (uint8_t)(((src[32 + lo] >> (4 * hi)) & 15) | (((src[96 + lo] >> (2 * hi)) & 3) << 4));
        m[j] = (uint8_t)(((src[64 + lo] >> (4 * hi)) & 15) | (((src[96 + lo] >> (4 + 2 * hi)) & 3) << 4));
    }
    /* ggml's packing of 8 six-bit scales and mins into 12 bytes (k4_scales' inverse) */
    for (int j = 0; j < 4; j++) {
        blk[4 + j] = (uint8_t)((s[j] & 63) | ((s[4 + j] >> 4) << 6));
        blk[8 + j] = (uint8_t)((m[j] & 63) | ((m[4 + j] >> 4) << 6));
        blk[12 + j] = (uint8_t)((s[4 + j] & 15) | ((m[4 + j] & 15) << 4));
    }
    for (int p = 0; p < 4; p++)
        for (int q = 0; q < 8; q++) memcpy(blk + 16 + 32 * p + 4 * q, src + 128 + 256 * p + 32 * q + 4 * r, 4);
}

#ifdef LG_AVX2
/* A group's 64 scales and 64 mins as bytes, index 8 sub-block + row. */
AI void q4x8_scales(const uint8_t *g, uint8_t sc[64], uint8_t mn[64]) {
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    const __m256i ls = _mm256_loadu_si256((const __m256i *)(g + 32));
    const __m256i lm = _mm256_loadu_si256((const __m256i *)(g + 64));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(g + 96));
    _mm256_storeu_si256((__m256i *)sc, _mm256_or_si256(_mm256_and_si256(ls, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30)));
    _mm256_storeu_si256((__m256i *)(sc + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ls, 4), m4),
                                                              _mm256_and_si256(_mm256_slli_epi16(h, 2), m30)));
    _mm256_storeu_si256((__m256i *)mn, _mm256_or_si256(_mm256_and_si256(lm, m4), _mm256_and_si256(h, m30)));
    _mm256_storeu_si256((__m256i *)(mn + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lm, 4), m4),
                                                              _mm256_and_si256(_mm256_srli_epi16(h, 2), m30)));
}

/* 8 repacked rows (group row w, its groups 1152 bytes apart) against R (1, 2 or 4) activation
 * rows x[0..R-1] of 256-value blocks: y[r][0..7]. Per block, each row's sum of scale x
 * (codes . q) and of min x (sum of q per 32) are exact int32 in its lane, then scaled by d dx
 * and dmin dx. A group's scales are decoded and each code vector split into its nibbles once for
 * all R rows, and each row's sums run in the same order whatever R is, so a row's output is the
 * same bits at every R. Each sub-block sums in two chains (even and odd code vectors), added at
 * the end, so four dot-product chains per row overlap their latency. */
AI void q4x8_rows_r(const uint8_t *w, const uint8_t *const x[4], int64_t k, float *const y[4],
                    const int R) {
    const int64_t nb = k / 256;
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc[4], accm[4];
    for (int r = 0; r < R; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = w + b * Q4X8_GROUP_BYTES;
        uint8_t sc[64], mn[64];
        q4x8_scales(g, sc, mn);
        __m256i isum[4];
        for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            __m256i e0[4], e1[4], o0[4], o1[4];
            for (int r = 0; r < R; r++) e0[r] = e1[r] = o0[r] = o1[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int q = 0; q < 8; q += 2) {
                const __m256i c = _mm256_loadu_si256((const __m256i *)(g + 128 + 256 * p + 32 * q));
                const __m256i n = _mm256_loadu_si256((const __m256i *)(g + 128 + 256 * p + 32 * q + 32));
                const __m256i cl = _mm256_and_si256(c, m4), ch = _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
                const __m256i nl = _mm256_and_si256(n, m4), nh = _mm256_and_si256(_mm256_srli_epi16(n, 4), m4);
                for (int r = 0; r < R; r++) {
                    const uint8_t *xp = x[r] + 256 * b + 64 * p + 4 * q;
                    e0[r] = dot_u8s8_acc(e0[r], cl, _mm256_set1_epi32((int)rd32(xp)));
                    e1[r] = dot_u8s8_acc(e1[r], ch, _mm256_set1_epi32((int)rd32(xp + 32)));
                    o0[r] = dot_u8s8_acc(o0[r], nl, _mm256_set1_epi32((int)rd32(xp + 4)));
                    o1[r] = dot_u8s8_acc(o1[r], nh, _mm256_set1_epi32((int)rd32(xp + 36)));
                }
            }
            const __m256i s0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 16 * p)));
            const __m256i s1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 16 * p + 8)));
            for (int r = 0; r < R; r++) {
                isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(_mm256_add_epi32(e0[r], o0[r]), s0));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(_mm256_add_epi32(e1[r], o1[r]), s1));
            }
        }
        const __m256 dh = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        const __m256 dmh = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));
        __m256i mn2[8]; /* sub-block j's mins, each in both int16 halves of its row's lane */
        for (int j = 0; j < 8; j++) {
            const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn + 8 * j)));
            mn2[j] = _mm256_or_si256(m, _mm256_slli_epi32(m, 16));
        }
        for (int r = 0; r < R; r++) {
            /* sum over j of min j x (the activation sums of its two 16-value halves): one
             * int16 pair product a sub-block, the halves' sums read as one 32-bit word */
            const uint8_t *bs = x[r] + k + 4 * nb + 32 * b;
            __m256i msum = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) msum = madd_acc(msum, mn2[j], _mm256_set1_epi32((int)rd32(bs + 4 * j)));
            const __m256 dx = _mm256_set1_ps(((const float *)(x[r] + k))[b]);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dh, dx), _mm256_cvtepi32_ps(isum[r]), acc[r]);
            accm[r] = _mm256_fmadd_ps(_mm256_mul_ps(dmh, dx), _mm256_cvtepi32_ps(msum), accm[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y[r], _mm256_sub_ps(acc[r], accm[r]));
}

X8_ENTRIES(q4x8)
#endif
