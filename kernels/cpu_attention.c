/* Tree attention on an x86-64 CPU with AVX2 and FMA, one query row at a time: each row (and head) reads exactly its
 * visible keys, in the order given, and reduces them in a fixed order, so a row's output depends on that row's
 * query and keys alone: a token verified in a tree gets, bit for bit, the attention an incremental step gives it.
 *
 * q [rows, heads, dim] and out [rows, heads, dim] (fp32 or bf16); the K and V caches are rows of
 * [kv_heads, dim] (fp32 or bf16; a paged pool's [blocks, block_size, ...] flattened); keys[offsets[r] ..
 * offsets[r + 1]) are the cache rows row r sees, in logical order. Query head h reads KV head h / (heads / kv_heads).
 * Per (row, head): s_j = (q . k_j) * scale (8 lanes, then a fixed horizontal sum), optionally softcap * tanh(s_j /
 * softcap); m = max s_j; p_j = exp(s_j - m); l = sum p_j (8 lanes over j, then horizontal); out = (sum_j p_j v_j) / l.
 */
#include "cpu_kernels.h"

/* Returns 0, or -1 when out of memory (dim must be a multiple of 8, at most 512). */
int tree_attend(int rows, int heads, int kv_heads, int dim, const void *q, int q_bf16, const void *k, const void *v,
                int kv_bf16, const int64_t *offsets, const int32_t *keys, int max_keys, float scale, float softcap,
                void *out, int out_bf16, int threads) {
    const int group = heads / kv_heads, lanes = dim / 8;
    const size_t stride = (size_t)kv_heads * dim, esize = q_bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *s = (float *)malloc(sizeof(float) * ((size_t)max_keys + 8));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int task = 0; task < rows * heads; task++) {
            if (!s) continue;
            const int r = task / heads, h = task % heads;
            const size_t at = ((size_t)r * heads + h) * dim;
            float o[512];
            attend_row_head((const char *)q + at * esize, q_bf16, k, v, kv_bf16, stride, (size_t)(h / group) * dim,
                            keys + offsets[r], offsets[r + 1] - offsets[r], lanes, scale, softcap, s, o);
            for (int i = 0; i < dim; i++) store(out, out_bf16, at + i, o[i]);
        }
        free(s);
    }
    return failed ? -1 : 0;
}
