/* Weight-only int4 and int8 products on an x86-64 CPU with AVX2, FMA and F16C: y = x @ W^T for activations x
 * [M, K_x] (fp32 or bf16) and a quantized weight W [N, K] (K: K_x padded to whole blocks of 32).
 *
 * The scheme is llama.cpp's Q4_1 x Q8_1 / Q8_0 x Q8_0 dot product: each row of x is quantized on the fly to int8
 * in blocks of 32 (scale xd = max|x| / 127, and xs = xd * sum(xq)), so that a block's dot product is 32 integer
 * multiply-adds (vpmaddubsw) instead of 32 unpacks, conversions and float FMAs. A row's result depends only on
 * that row and the weight, never on M, the other rows or the threads (output rows are split between threads,
 * the inputs never are), so a verify step's rows equal one-row steps' bit for bit.
 *
 * Weight layouts (packed by kernels/cpu_qgemm.py, whose PyTorch reference defines the arithmetic):
 *   int4: qs  uint8 [N, K / 2]: per block of 32 inputs 16 bytes, byte j = value j | value (j + 16) << 4,
 *                               values q in [0, 15];
 *         dm  fp16  [N, 2, K / 32]: each row's block scales d, then its block offsets m; the weight is q * d + m;
 *         block dot = d * xd * sum(q * xq) + m * xs.
 *   int8: qs  int8  [N, K]: values in [-127, 127] (llama.cpp's Q8_0);
 *         d   fp16  [N, K / 32]: each block's scale; the weight is q * d;
 *         block dot = d * xd * sum(q * xq).
 * Block sums are exact int32; the scaled sums are fp32 in a fixed order (at pass()).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as PyTorch's conversion */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float hsum8(__m256 v) {  /* ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One row of x (k_x values, zero beyond) as int8 blocks: q [K], xd [K / 32], xs [K / 32]. */
static void quantize_row(const void *x, int bf16, int k_x, int k, int8_t *q, float *xd, float *xs) {
    float buf[QK];
    for (int b = 0; b < k / QK; b++) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) {
            int i = b * QK + j;
            float v = i >= k_x ? 0.0f : bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
            buf[j] = v;
            amax = fmaxf(amax, fabsf(v));
        }
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int v = (int)nearbyintf(buf[j] * id);  /* round half to even (the default rounding mode) */
            q[b * QK + j] = (int8_t)v;
            sum += v;
        }
        xd[b] = d;
        xs[b] = d * (float)sum;
    }
}

typedef struct {
    int8_t *q;
    float *xd, *xs;
} Activations;

static int quantize_rows(const void *x, int bf16, int m, int k_x, int k, Activations *a, int threads) {
    int nb = k / QK;
    a->q = (int8_t *)malloc((size_t)m * k);
    a->xd = (float *)malloc(sizeof(float) * (size_t)m * nb);
    a->xs = (float *)malloc(sizeof(float) * (size_t)m * nb);
    if (!a->q || !a->xd || !a->xs) return -1;
    size_t esize = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (m > 1)
    for (int r = 0; r < m; r++)
        quantize_row((const char *)x + (size_t)r * k_x * esize, bf16, k_x, k, a->q + (size_t)r * k, a->xd + (size_t)r * nb,
                     a->xs + (size_t)r * nb);
    return 0;
}

static void free_rows(Activations *a) {
    free(a->q);
    free(a->xd);
    free(a->xs);
}

static inline void store(void *y, int bf16, size_t i, float v) {
    if (bf16)
        ((uint16_t *)y)[i] = f32_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

#define ROWS 8  /* rows of x per pass over a weight row: each weight block is unpacked once for them */
#define GROUP 8 /* blocks whose integer sums are reduced together, then scaled by one vector multiply-add */

/* Lane i of the result is the sum of the eight int32 lanes of p[i] (integer sums: exact in any order). */
static inline __m256i reduce8(const __m256i *p) {
    __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

static inline int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* Weight row o's blocks b0 .. b0 + count - 1 as vpmaddubsw's unsigned operand: int4 values as they are; int8 values'
 * magnitudes, their signs kept in sign[] to move onto the activations. */
static inline __attribute__((always_inline)) void load_blocks(const uint8_t *wq, const int bits, int b0, int count,
                                                              __m256i *w, __m256i *sign) {
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int i = 0; i < count; i++) {
        if (bits == 4) {
            __m128i raw = _mm_loadu_si128((const __m128i *)(wq + (size_t)(b0 + i) * 16));
            w[i] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low), _mm_and_si128(raw, low));
        } else {
            sign[i] = _mm256_loadu_si256((const __m256i *)(wq + (size_t)(b0 + i) * QK));
            w[i] = _mm256_sign_epi8(sign[i], sign[i]);
        }
    }
}

/* The exact integer sum of a weight block's products with row xq's block (int8: x takes the weight's signs). */
static inline __attribute__((always_inline)) __m256i block_sums(__m256i w, __m256i sign, const int8_t *xq,
                                                                const int bits) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
    if (bits == 8) xv = _mm256_sign_epi8(xv, sign);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));  /* [8] int32 */
}

/* Rows r0 .. r0 + rows - 1 of x against weight row o (bits 4: qs [K / 2], d and m [K / 32] each; bits 8: qs [K],
 * d [K / 32]). Per row: for each group of 8 blocks, acc += float(the 8 blocks' integer sums) * (d * xd) and, int4,
 * macc += m * xs, lane-wise; the blocks past the last whole group add d * xd * sum (+ m * xs) to a scalar tail in
 * block order; the result is (hsum(acc) + hsum(macc)) + tail. Inlined with rows and bits constant. */
static inline __attribute__((always_inline)) void pass(const Activations *a, int r0, const int rows, const int bits,
                                                       int o, int n, int k, const uint8_t *wq, const uint16_t *wd,
                                                       const uint16_t *wm, void *y, int y_bf16) {
    const int nb = k / QK, whole = nb / GROUP * GROUP;
    __m256 acc[ROWS], macc[ROWS];
    float tail[ROWS];
    for (int r = 0; r < rows; r++) {
        acc[r] = macc[r] = _mm256_setzero_ps();
        tail[r] = 0.0f;
    }
    __m256i w[GROUP], sign[GROUP], p[GROUP];
    for (int b = 0; b < whole; b += GROUP) {
        load_blocks(wq, bits, b, GROUP, w, sign);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + b)));
        __m256 mm = bits == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + b))) : d;
        for (int r = 0; r < rows; r++) {
            size_t row = (size_t)(r0 + r);
            const int8_t *xq = a->q + row * k + (size_t)b * QK;
            for (int i = 0; i < GROUP; i++) p[i] = block_sums(w[i], sign[i], xq + i * QK, bits);
            __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(a->xd + row * nb + b));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(p)), scale, acc[r]);
            if (bits == 4) macc[r] = _mm256_fmadd_ps(mm, _mm256_loadu_ps(a->xs + row * nb + b), macc[r]);
        }
    }
    for (int b = whole; b < nb; b++) {
        load_blocks(wq, bits, b, 1, w, sign);
        float d = _cvtsh_ss(wd[b]), mm = bits == 4 ? _cvtsh_ss(wm[b]) : 0.0f;
        for (int r = 0; r < rows; r++) {
            size_t row = (size_t)(r0 + r);
            int sum = hsum_i32(block_sums(w[0], sign[0], a->q + row * k + (size_t)b * QK, bits));
            tail[r] += d * a->xd[row * nb + b] * (float)sum + (bits == 4 ? mm * a->xs[row * nb + b] : 0.0f);
        }
    }
    for (int r = 0; r < rows; r++)
        store(y, y_bf16, (size_t)(r0 + r) * n + o, (hsum8(acc[r]) + hsum8(macc[r])) + tail[r]);
}

/* y = x @ W^T for a weight of `bits` (4 or 8) in its layout (top of the file): x quantized per block first, then
 * output rows split between `threads`. Returns 0, or -1 when out of memory. */
static int gemm(const int bits, int m, int n, int k_x, int k, const void *x, int x_bf16, const uint8_t *qs,
                const uint16_t *dm, void *y, int y_bf16, int threads) {
    Activations a;
    if (quantize_rows(x, x_bf16, m, k_x, k, &a, threads)) {
        free_rows(&a);
        return -1;
    }
    const int nb = k / QK;
    const size_t row_bytes = bits == 4 ? (size_t)k / 2 : (size_t)k, scales = bits == 4 ? 2 * (size_t)nb : (size_t)nb;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int o = 0; o < n; o++) {
        const uint8_t *wq = qs + (size_t)o * row_bytes;
        const uint16_t *wd = dm + (size_t)o * scales, *wm = wd + nb;
        for (int r0 = 0; r0 < m; r0 += ROWS) {
            int rows = m - r0 < ROWS ? m - r0 : ROWS;
            if (rows == 1 && bits == 4)  /* one row (a decode step): code of its own */
                pass(&a, r0, 1, 4, o, n, k, wq, wd, wm, y, y_bf16);
            else if (rows == 1)
                pass(&a, r0, 1, 8, o, n, k, wq, wd, wm, y, y_bf16);
            else if (bits == 4)
                pass(&a, r0, rows, 4, o, n, k, wq, wd, wm, y, y_bf16);
            else
                pass(&a, r0, rows, 8, o, n, k, wq, wd, wm, y, y_bf16);
        }
    }
    free_rows(&a);
    return 0;
}

int q4_gemm(int m, int n, int k_x, int k, const void *x, int x_bf16, const uint8_t *qs, const uint16_t *dm, void *y,
            int y_bf16, int threads) {
    return gemm(4, m, n, k_x, k, x, x_bf16, qs, dm, y, y_bf16, threads);
}

int q8_gemm(int m, int n, int k_x, int k, const void *x, int x_bf16, const int8_t *qs, const uint16_t *d, void *y,
            int y_bf16, int threads) {
    return gemm(8, m, n, k_x, k, x, x_bf16, (const uint8_t *)qs, d, y, y_bf16, threads);
}
