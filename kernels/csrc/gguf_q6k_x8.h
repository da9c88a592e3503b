/* Q6_K rows repacked 8 at a time for one-activation-row products (included by gguf_x8.h, which
 * gives X8_ROWS; gguf_matmul.c defines AI, dot_u8s8_acc, rd32, LG_AVX2 and the activation row
 * layout used here).
 *
 * The file's Q6_K block (ggml-common.h block_q6_K: 128 bytes ql of low 4 bits, 64 bytes qh of
 * high 2 bits, 16 int8 scales, fp16 d; value 128 h + 32 s + l has code
 * (ql[64 h + 32 (s % 2) + l] >> 4 (s / 2)) & 15 | ((qh[32 h + l] >> 2 s) & 3) << 4, minus 32, and
 * scale index value / 16) keeps one row's 256 values together. Repacked, the 8 blocks of rows
 * 8g .. 8g+7 at block column b become one 1680-byte group (8 x 210: the file's bytes per weight):
 *
 *   bytes     0..15     d of rows 0..7 (fp16)
 *   bytes    16..143    scales: byte 16 + 8 j + r holds scale j (values 16 j ..) of row r
 *   bytes   144..1679   codes, 96 bytes for each half h = 0, 1 and word column q = 0..7 in
 *                       that order, at 144 + 96 (8 h + q): the 4 file bytes ql[64 h + 4 q ..],
 *                       ql[64 h + 32 + 4 q ..] and qh[32 h + 4 q ..] of row r at + 4 r,
 *                       + 32 + 4 r and + 64 + 4 r
 *
 * in the order the kernel reads them (a group is read front to back, which the hardware
 * prefetchers follow; ql and qh kept apart would be streams that they follow worse). The repack
 * moves 4-byte words only, and 32 bytes hold 4 values of one 32-value group for each of the 8
 * rows, one 32-bit lane a row: with 4 broadcast activation bytes a dot product instruction
 * gives each row's partial sum in its own lane, a 16-value scale's 8 rows are one vector and
 * the 8 outputs need no horizontal sum. The idea is llama.cpp's repacked CPU layouts
 * (ggml-cpu/repack); this layout is this file's.
 */

#define Q6X8_GROUP_BYTES (X8_ROWS * 210)
/* Offsets in a group of the 32 bytes of word column q of ql quarter u (ql bytes 32 u ..) and of
 * qh half h (qh bytes 32 h ..). */
#define Q6X8_QL(u, q) (144 + 96 * (8 * ((u) / 2) + (q)) + 32 * ((u) % 2))
#define Q6X8_QH(h, q) (144 + 96 * (8 * (h) + (q)) + 64)

/* The 8 Q6_K blocks at src (rows src_stride bytes apart) as one repacked group at dst. */
static void q6x8_pack_group(const uint8_t *src, int64_t src_stride, uint8_t *dst) {
    for (int r = 0; r < X8_ROWS; r++) {
        const uint8_t *blk = src + r * src_stride;
        memcpy(dst + 2 * r, blk + 208, 2);
        for (int j = 0; j < 16; j++) dst[16 + 8 * j + r] = blk[192 + j];
        for (int q = 0; q < 8; q++) {
            for (int u = 0; u < 4; u++) memcpy(dst + Q6X8_QL(u, q) + 4 * r, blk + 32 * u + 4 * q, 4);
            for (int h = 0; h < 2; h++) memcpy(dst + Q6X8_QH(h, q) + 4 * r, blk + 128 + 32 * h + 4 * q, 4);
        }
    }
}

/* Row r's block of the repacked group at src, back as the file's 210 bytes at blk. */
static void q6x8_unpack_block(const uint8_t *src, int r, uint8_t *blk) {
    memcpy(blk + 208, src + 2 * r, 2);
    for (int j = 0; j < 16; j++) blk[192 + j] = src[16 + 8 * j + r];
    for (int q = 0; q < 8; q++) {
        for (int u = 0; u < 4; u++) memcpy(blk + 32 * u + 4 * q, src + Q6X8_QL(u, q) + 4 * r, 4);
        for (int h = 0; h < 2; h++) memcpy(blk + 128 + 32 * h + 4 * q, src + Q6X8_QH(h, q) + 4 * r, 4);
    }
}

#ifdef LG_AVX2
/* The high 2 bits of group s (0..3) of a qh vector, in bits 4..5 of each byte. */
AI __m256i q6x8_high(__m256i qh, const int s) {
    const __m256i m30 = _mm256_set1_epi8(0x30);
    switch (s) {
    case 0: return _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30);
    case 1: return _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30);
    case 2: return _mm256_and_si256(qh, m30);
    default: return _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30);
    }
}

/* acc + scale j's 8 lanes times d. */
AI __m256i q6x8_scaled(__m256i acc, __m256i d, const uint8_t *g, const int j) {
    const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + 16 + 8 * j)));
    return _mm256_add_epi32(acc, _mm256_mullo_epi32(d, sc));
}

/* Scales 2i and 2i+1 of each row as an int16 pair in its lane, i = 0..7. */
AI void q6x8_scale_pairs(const uint8_t *g, __m256i sc2[8]) {
    for (int i = 0; i < 8; i++) {
        const __m256i a = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + 16 + 16 * i)));
        const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + 24 + 16 * i)));
        sc2[i] = _mm256_blend_epi16(a, _mm256_slli_epi32(b, 16), 0xAA);
    }
}

/* acc - 32 x the sum over the 16 scales of scale x the activation sum of its 16 values (bs,
 * which the block's 16 int16 sums hold in order): the codes' offset of 32, one int16 pair
 * product per two scales. */
AI __m256i q6x8_offset(__m256i acc, const __m256i sc2[8], const int16_t *bs) {
    __m256i c = _mm256_setzero_si256();
    for (int i = 0; i < 8; i++) c = madd_acc(c, sc2[i], _mm256_set1_epi32((int)rd32((const uint8_t *)(bs + 2 * i))));
    return _mm256_sub_epi32(acc, _mm256_slli_epi32(c, 5));
}

/* The codes 0..63 of 4-value group q of the 32-value groups 4h .. 4h+3 (code[s]: group 4h + s),
 * from ql bytes 64 h + 32 (s % 2) (nibble s / 2) and qh bytes 32 h (bits 2 s): one qh load and
 * two ql loads serve the 4 groups. */
AI void q6x8_codes(const uint8_t *g, const int h, const int q, __m256i code[4]) {
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(g + Q6X8_QH(h, q)));
    const __m256i c0 = _mm256_loadu_si256((const __m256i *)(g + Q6X8_QL(2 * h, q)));
    const __m256i c1 = _mm256_loadu_si256((const __m256i *)(g + Q6X8_QL(2 * h + 1, q)));
    code[0] = _mm256_or_si256(_mm256_and_si256(c0, m4), q6x8_high(qh, 0));
    code[1] = _mm256_or_si256(_mm256_and_si256(c1, m4), q6x8_high(qh, 1));
    code[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c0, 4), m4), q6x8_high(qh, 2));
    code[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c1, 4), m4), q6x8_high(qh, 3));
}

/* isum[r] + the quarter (h, half) of a block against activation row r (its bytes xq[r]), r < R,
 * each 16 values' sum times its scale: values 16 half .. 16 half + 15 of the 32-value groups
 * 4h .. 4h+3 (q6x8_codes, built once for all R rows), 4 independent sums a row. The codes'
 * offset of 32 comes off once a block (q6x8_offset). */
AI void q6x8_quarter(__m256i isum[4], const uint8_t *g, const uint8_t *const xq[4], const int h,
                     const int half, const int R) {
    __m256i d[4][4];
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 4; s++) d[r][s] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int q = 4 * half; q < 4 * half + 4; q++) {
        __m256i code[4];
        q6x8_codes(g, h, q, code);
        for (int r = 0; r < R; r++)
            for (int s = 0; s < 4; s++)
                d[r][s] = dot_u8s8_acc(d[r][s], code[s], _mm256_set1_epi32((int)rd32(xq[r] + 32 * (4 * h + s) + 4 * q)));
    }
    for (int r = 0; r < R; r++)
        for (int s = 0; s < 4; s++) isum[r] = q6x8_scaled(isum[r], d[r][s], g, 2 * (4 * h + s) + half);
}

/* 8 repacked rows (group row w, its groups 1680 bytes apart) against R (1, 2 or 4) activation rows
 * x[0..R-1] of 256-value blocks: y[r][0..7]. Per block, each row's sum over its 16 scales of
 * scale x (codes . q - 32 sum q) is exact int32 in its lane (below 16 x 128 x 16 x 32 x 127 in
 * magnitude), then scaled by d dx; a row's sums run in the same order whatever R is. Codes
 * 0..63 keep maddubs' int16 pairs below 2 x 63 x 127. */
AI void q6x8_rows_r(const uint8_t *w, const uint8_t *const x[4], int64_t k, float *const y[4],
                    const int R) {
    const int64_t nb = k / 256;
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = w + b * Q6X8_GROUP_BYTES;
        const uint8_t *xq[4];
        const int16_t *bs[4];
        __m256i isum[4];
        for (int r = 0; r < R; r++) {
            xq[r] = x[r] + 256 * b;
            bs[r] = (const int16_t *)(x[r] + k + 4 * nb) + 16 * b;
            isum[r] = _mm256_setzero_si256();
        }
        q6x8_quarter(isum, g, xq, 0, 0, R);
        q6x8_quarter(isum, g, xq, 0, 1, R);
        q6x8_quarter(isum, g, xq, 1, 0, R);
        q6x8_quarter(isum, g, xq, 1, 1, R);
        __m256i sc2[8];
        q6x8_scale_pairs(g, sc2);
        const __m256 dh = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        for (int r = 0; r < R; r++) {
            isum[r] = q6x8_offset(isum[r], sc2, bs[r]);
            const __m256 d = _mm256_mul_ps(dh, _mm256_set1_ps(((const float *)(x[r] + k))[b]));
            acc[r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(isum[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y[r], acc[r]);
}

X8_ENTRIES(q6x8)
#endif
