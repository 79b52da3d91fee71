/* The fused CPU layers' attention kernel alone: attend_row_head (one query head at a time) against attend_row_group
 * (a KV head's query heads together), kernels/cpu_kernels.h, on 64-wide heads over bf16 keys and values, for several
 * key counts and query heads a KV head; ns per key and query head, best of 7 alternated rounds, and whether the two
 * gave the same bits. Build and run (the flags of kernels/cpu_qgemm.py for this CPU: drop the AVX-512 ones on AVX2):
 *
 *     gcc -O3 -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -Ikernels \
 *         -o /tmp/attention_group bench/attention_group.c -lm && /tmp/attention_group
 */
#include <stdio.h>
#include <time.h>

#include "cpu_kernels.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    const int D = 64, KV = 2, keys_list[4] = {13, 40, 120, 600};
    printf("| keys | query heads a KV head | one head at a time, ns | grouped, ns | speed-up | equal |\n");
    printf("|---:|---:|---:|---:|---:|---|\n");
    for (int c = 0; c < 4; c++) {
        const int n = keys_list[c];
        const size_t stride = (size_t)KV * D;
        uint16_t *k = malloc(2 * stride * (n + 8)), *v = malloc(2 * stride * (n + 8));
        for (size_t i = 0; i < stride * (n + 8); i++) k[i] = f32_to_bf16(sinf(i * 0.37f) * 0.5f), v[i] = f32_to_bf16(cosf(i * 0.11f));
        int32_t *keys = malloc(sizeof(int32_t) * n);
        for (int i = 0; i < n; i++) keys[i] = (i * 7) % n;  /* visited out of order, as a paged pool's rows */
        float q[4 * 64], one[4 * 64], grouped[4 * 64], *s = malloc(sizeof(float) * 4 * (n + 8));
        for (int i = 0; i < 4 * 64; i++) q[i] = sinf(i * 1.3f);
        for (int g = 1; g <= 4; g++) {
            const int reps = 4000000 / (n * g) + 1;
            double best_one = 1e9, best_grouped = 1e9;
            for (int round = 0; round < 7; round++) {
                const double t0 = now();
                for (int r = 0; r < reps; r++)
                    for (int h = 0; h < g; h++)
                        attend_row_head(q + h * D, 0, k, v, 1, stride, 0, keys, n, D / 8, 0.125f, 0.0f, s, one + h * D);
                const double t1 = now();
                for (int r = 0; r < reps; r++) attend_row_group(q, g, k, v, 1, stride, 0, keys, n, D / 8, 0.125f, 0.0f, s, grouped);
                const double t2 = now();
                best_one = t1 - t0 < best_one ? t1 - t0 : best_one;
                best_grouped = t2 - t1 < best_grouped ? t2 - t1 : best_grouped;
            }
            const double per = 1e9 / ((double)reps * n * g);
            printf("| %d | %d | %.1f | %.1f | %.2fx | %s |\n", n, g, best_one * per, best_grouped * per,
                   best_one / best_grouped, memcmp(one, grouped, sizeof(float) * g * D) ? "no" : "yes");
        }
        free(k), free(v), free(keys), free(s);
    }
    return 0;
}
