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
#include "cpu_kernels.h"

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
            float out[ROWS];
            if (rows == 1 && bits == 4)  /* one row (a decode step): code of its own */
                pass(&a, r0, 1, 4, k, wq, wd, wm, out);
            else if (rows == 1)
                pass(&a, r0, 1, 8, k, wq, wd, wm, out);
            else if (bits == 4)
                pass(&a, r0, rows, 4, k, wq, wd, wm, out);
            else
                pass(&a, r0, rows, 8, k, wq, wd, wm, out);
            for (int r = 0; r < rows; r++) store(y, y_bf16, (size_t)(r0 + r) * n + o, out[r]);
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
