/* A KV pool's row moves on the CPU (kernels/cpu_pool.py): after a verify step, the accepted tree nodes' K and V rows
 * move to where the context goes on. A plain copy of a few rows a layer, done here by the calling thread: PyTorch's
 * indexing (k[:, dst] = k[:, src]) ran as two parallel regions of OpenMP's team, whose worker then busy-waited for
 * milliseconds beside the kernels' own team (cpu_team.c) and took the core it needed (BENCHMARKS.md, "The kernels'
 * own thread team").
 *
 * k and v: [layers, rows, row_bytes] bytes (the pool flattened; layer l's row r at l * layer_bytes + r * row_bytes);
 * rows src[i] go to rows dst[i] (each in [0, rows)), all read before any is written (so src and dst may overlap).
 * Returns 0, -1 when out of memory, -2 for a row outside the pool (nothing moved). */
#include "cpu_kernels.h"

int pool_move(void *k, void *v, int layers, int64_t rows, int64_t row_bytes, const int64_t *src, const int64_t *dst,
              int n) {
    for (int i = 0; i < n; i++)
        if (src[i] < 0 || src[i] >= rows || dst[i] < 0 || dst[i] >= rows) return -2;
    const size_t layer_bytes = (size_t)rows * (size_t)row_bytes;
    char *held = malloc((size_t)n * (size_t)row_bytes + 1);  /* one layer's source rows */
    if (!held) return -1;
    char *pools[2] = {(char *)k, (char *)v};
    for (int p = 0; p < 2; p++)
        for (int l = 0; l < layers; l++) {
            char *layer = pools[p] + (size_t)l * layer_bytes;
            for (int i = 0; i < n; i++) memcpy(held + (size_t)i * row_bytes, layer + (size_t)src[i] * row_bytes, row_bytes);
            for (int i = 0; i < n; i++) memcpy(layer + (size_t)dst[i] * row_bytes, held + (size_t)i * row_bytes, row_bytes);
        }
    free(held);
    return 0;
}
