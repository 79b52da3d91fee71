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
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum8f(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 load8(const void *p, int bf16, size_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial, 2^n by the exponent). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* Returns 0, or -1 when out of memory (dim must be a multiple of 8, at most 512). */
int tree_attend(int rows, int heads, int kv_heads, int dim, const void *q, int q_bf16, const void *k, const void *v,
                int kv_bf16, const int64_t *offsets, const int32_t *keys, int max_keys, float scale, float softcap,
                void *out, int out_bf16, int threads) {
    const int group = heads / kv_heads, lanes = dim / 8;
    const size_t stride = (size_t)kv_heads * dim;
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
            const int r = task / heads, h = task % heads, kvh = h / group;
            const int64_t k0 = offsets[r], n = offsets[r + 1] - offsets[r];
            __m256 qv[64];
            for (int i = 0; i < lanes; i++) qv[i] = load8(q, q_bf16, ((size_t)r * heads + h) * dim + (size_t)i * 8);
            float m = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                size_t base = (size_t)keys[k0 + j] * stride + (size_t)kvh * dim;
                __m256 acc = _mm256_mul_ps(qv[0], load8(k, kv_bf16, base));
                for (int i = 1; i < lanes; i++) acc = _mm256_fmadd_ps(qv[i], load8(k, kv_bf16, base + (size_t)i * 8), acc);
                float sj = hsum8f(acc) * scale;
                if (softcap > 0.0f) sj = softcap * tanhf(sj / softcap);
                s[j] = sj;
                m = sj > m ? sj : m;
            }
            __m256 mv = _mm256_set1_ps(m), lsum = _mm256_setzero_ps();
            int64_t j = 0;
            for (; j + 8 <= n; j += 8) {
                __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
                _mm256_storeu_ps(s + j, p);
                lsum = _mm256_add_ps(lsum, p);
            }
            float tail = 0.0f;
            if (j < n) {  /* the last partial group through the same exp, padded lanes dropped */
                float pad[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int64_t t = j; t < n; t++) pad[t - j] = s[t] - m;
                _mm256_storeu_ps(pad, exp8(_mm256_loadu_ps(pad)));
                for (int64_t t = j; t < n; t++) {
                    s[t] = pad[t - j];
                    tail += pad[t - j];
                }
            }
            float l = hsum8f(lsum) + tail;
            __m256 o[64];
            for (int i = 0; i < lanes; i++) o[i] = _mm256_setzero_ps();
            for (int64_t t = 0; t < n; t++) {
                size_t base = (size_t)keys[k0 + t] * stride + (size_t)kvh * dim;
                __m256 p = _mm256_set1_ps(s[t]);
                for (int i = 0; i < lanes; i++) o[i] = _mm256_fmadd_ps(p, load8(v, kv_bf16, base + (size_t)i * 8), o[i]);
            }
            __m256 inv = _mm256_set1_ps(1.0f / l);
            size_t dst = ((size_t)r * heads + h) * dim;
            for (int i = 0; i < lanes; i++) {
                __m256 val = _mm256_mul_ps(o[i], inv);
                if (out_bf16) {
                    float tmp[8];
                    _mm256_storeu_ps(tmp, val);
                    for (int t = 0; t < 8; t++) ((uint16_t *)out)[dst + (size_t)i * 8 + t] = to_bf16(tmp[t]);
                } else {
                    _mm256_storeu_ps((float *)out + dst + (size_t)i * 8, val);
                }
            }
        }
        free(s);
    }
    return failed ? -1 : 0;
}
