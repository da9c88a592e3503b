/* Rows repacked 8 at a time (Q4_K: gguf_q4k_x8.h, Q6_K: gguf_q6k_x8.h), included by
 * gguf_matmul.c after its row kernels: the 8 rows' blocks at one block column become one group
 * of the same bytes, so one quantized activation row meets 8 rows per dot product instruction
 * (gguf_matmul.c's dot_u8s8_acc), one row a 32-bit lane. Here is what the types share: the
 * group size and the dispatch from a repacked type (T_Q4_K_X8, T_Q6_K_X8) to its file type and
 * its functions.
 */

#define X8_ROWS 8
/* Longest row a repacked matrix may have (the slow paths unpack a row into a stack buffer). */
#define X8_MAX_ROW_BYTES (64 * 1024)

/* A type's entry points NAME_rows1, NAME_rows2 and, where AVX-512's 32 vector registers hold
 * their 16 accumulators, NAME_rows4: one compiled body each of its NAME_rows_r (R rows a visit),
 * the signature of x8_rows_fn. */
#define X8_ROWS_FN(NAME, R)                                                                       \
    static void NAME##_rows##R(const uint8_t *w, const uint8_t *const x[4], int64_t k,           \
                               float *const y[4]) { NAME##_rows_r(w, x, k, y, R); }
#ifdef __AVX512VL__
#define X8_ROWS4_FN(NAME) X8_ROWS_FN(NAME, 4)
#else
#define X8_ROWS4_FN(NAME)
#endif
#define X8_ENTRIES(NAME) X8_ROWS_FN(NAME, 1) X8_ROWS_FN(NAME, 2) X8_ROWS4_FN(NAME)

#include "gguf_q4k_x8.h"
#include "gguf_q6k_x8.h"

/* The file type whose blocks repacked type t holds, or 0 where t is no repacked type. */
static int x8_file_type(int t) { return t == T_Q4_K_X8 ? T_Q4_K : t == T_Q6_K_X8 ? T_Q6_K : 0; }

/* The repacked type of file type t, or 0 where t has no repacked layout. */
static int x8_type(int t) { return t == T_Q4_K ? T_Q4_K_X8 : t == T_Q6_K ? T_Q6_K_X8 : 0; }

/* The 8 blocks of file type t at src (rows src_stride bytes apart) as one group at dst. */
static void x8_pack_group(int t, const uint8_t *src, int64_t src_stride, uint8_t *dst) {
    if (t == T_Q4_K) q4x8_pack_group(src, src_stride, dst);
    else q6x8_pack_group(src, src_stride, dst);
}

/* Row r's block of the group at src of repacked type t, back as the file's bytes at blk. */
static void x8_unpack_block(int t, const uint8_t *src, int r, uint8_t *blk) {
    if (t == T_Q4_K_X8) q4x8_unpack_block(src, r, blk);
    else q6x8_unpack_block(src, r, blk);
}

/* Row r of a matrix w of repacked type t (row stride ws, the file's) as the file's blocks. */
static void x8_unpack_row(int t, const uint8_t *w, int64_t ws, int64_t r, int64_t k, uint8_t *out) {
    const int bb = block_bytes(t);
    const uint8_t *g = w + (r & ~(int64_t)(X8_ROWS - 1)) * ws;
    for (int64_t b = 0; b < k / 256; b++) x8_unpack_block(t, g + b * X8_ROWS * bb, (int)(r & (X8_ROWS - 1)), out + b * bb);
}

#ifdef LG_AVX2
/* 8 repacked rows (group row w) against R quantized activation rows x[0..R-1]: y[r][0..7]. */
typedef void (*x8_rows_fn)(const uint8_t *w, const uint8_t *const x[4], int64_t k, float *const y[4]);

/* Type t's kernel for R activation rows a visit (each output the same bits at every R), or NULL
 * where t has none for R: 1, 2 and, with AVX-512's 32 vector registers, 4. */
static x8_rows_fn x8_kernel(int t, int R) {
    const int q4 = t == T_Q4_K_X8;
    switch (R) {
    case 1: return q4 ? q4x8_rows1 : q6x8_rows1;
    case 2: return q4 ? q4x8_rows2 : q6x8_rows2;
#ifdef __AVX512VL__
    case 4: return q4 ? q4x8_rows4 : q6x8_rows4;
#endif
    default: return NULL;
    }
}

/* Activation rows i0 .. i1-1 (row i at xa + i * xs) against the 8 repacked rows of group row wg
 * of type t, as many rows a visit as a kernel takes (4, then 2, then 1): codes unpacked once a
 * visit. Output row i's 8 values at y + i * ldy. */
static void x8_group_rows(int t, const uint8_t *wg, const uint8_t *xa, size_t xs, int64_t i0,
                          int64_t i1, int64_t k, float *y, int64_t ldy) {
    int64_t i = i0;
    for (int R = 4; R >= 1; R /= 2) {
        const x8_rows_fn fn = x8_kernel(t, R);
        for (; fn && i + R <= i1; i += R) {
            const uint8_t *x[4] = {NULL, NULL, NULL, NULL};
            float *yr[4] = {NULL, NULL, NULL, NULL};
            for (int r = 0; r < R; r++) {
                x[r] = xa + (i + r) * xs;
                yr[r] = y + (i + r) * ldy;
            }
            fn(wg, x, k, yr);
        }
    }
}
#endif
