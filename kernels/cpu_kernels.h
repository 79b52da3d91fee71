/* Helpers shared by our CPU kernels (cpu_qgemm.c, cpu_attention.c, cpu_layers.c): bf16 conversions, 8-lane loads,
 * sums and exp, and the pieces of the weight-only int4/int8 product (see cpu_qgemm.c's comment for the scheme and
 * the weight layouts). Every function is static inline: each kernel file is its own translation unit. */
#ifndef SPECINFER_CPU_KERNELS_H
#define SPECINFER_CPU_KERNELS_H
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
static inline void quantize_row(const void *x, int bf16, int k_x, int k, int8_t *q, float *xd, float *xs) {
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

/* cpu_team.c: the thread team of the kernels' parallel loops (its top comment says how it runs). A task runs on each
 * thread that joins a call; its loops are TEAM_FOR loops, each shared by the threads joined when it begins, every
 * sharer a contiguous share (OpenMP's static schedule); a loop ends when every share is done (a barrier, as an omp
 * for's). The loop's body must not leave it (return, goto; break leaves the thread's share). */
typedef struct {
    int id, size;    /* the thread's rank (0: the caller) and the call's threads */
    unsigned phase;  /* the loop this thread is at */
    int share;       /* in the current loop: its sharers where this thread is one, else 0 */
    unsigned word;   /* the pool's phase word as the current loop began for this thread */
} Team;
typedef void (*TeamTask)(Team *team, void *arg);
void team_run(int threads, TeamTask task, void *arg);
void team_begin(Team *team);
void team_end(Team *team);
int team_workers(void);
void team_wake(void);
void team_rest(void);
double team_cpu_seconds(void);

/* Where this thread's share of n iterations begins (share `part` of its loop's `share` sharers; none: 0). */
static inline int team_bound(const Team *team, int n, int part) {
    return team->share ? (int)((int64_t)n * part / team->share) : 0;
}

#define TEAM_FOR(team, i, n)                                                                               \
    for (int i##_once = (team_begin(team), 1); i##_once; i##_once = 0, team_end(team))                     \
        for (int i = team_bound(team, n, (team)->id), i##_end = team_bound(team, n, (team)->id + 1); i < i##_end; \
             i++)

typedef struct {
    int8_t *q;
    float *xd, *xs;
    uint32_t *xv;  /* dense bf16 products on AMX: the rows packed as B tiles (cpu_amx.c), or NULL */
} Activations;

/* cpu_amx.c (its top comment says what each does) */
int amx_enable(void);
int amx_on(void);
void amx_begin(void);
void amx_end(void);
void amx_pack_chunk(const float *x, int ldx, int t, int k, int g, int c, uint32_t *xv);
void amx_block(const uint16_t *w, int k, int o0, const uint32_t *xv, int groups, float *out);

#define AMX_GROUPS 4  /* row groups of 16 a pass over the weights (one C tile each, at most 6: A and B take two more; 6
                       * measured no faster than 4 on 96 rows of a 1B shape, where the B tiles, read again per
                       * weight tile, bound the pass) */

/* Bytes of the B tiles of t rows of k inputs (amx_pack_chunk's layout). */
static inline size_t amx_packed_bytes(int t, int k) { return (size_t)((t + 15) / 16) * (size_t)((k + 31) / 32) * 1024; }

static inline int quantize_rows(const void *x, int bf16, int m, int k_x, int k, Activations *a, int threads) {
    int nb = k / QK;
    a->xv = NULL;
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

static inline void free_rows(Activations *a) {
    free(a->xv);
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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI_PASS 1
#define QPREFETCH 1024 /* bytes of the weight stream a pass asks for ahead of where it reads (one row streams from
                        * memory: the prefetchers alone kept too few misses in flight, as for the dense tiles) */

/* Chunk c (blocks 2c and 2c + 1) of a group's 8 per-block values v8: lanes 0-7 block 2c's, 8-15 block 2c + 1's. */
static inline __attribute__((always_inline)) __m512 expand_pair(__m256 v8, const int c) {
    const __m512i idx = _mm512_set_epi32(2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1, 2 * c + 1,
                                         2 * c + 1, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c, 2 * c);
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v8));
}

/* A group's 8 weight blocks as 4 chunks of 64 bytes for vpdpbusd's unsigned operand: int4 values in block order
 * (bytes j = value j | value j + 16 << 4 unpacked to [lo 16, hi 16] a block); int8 magnitudes, their signs in neg[]
 * to move onto the activations. */
static inline __attribute__((always_inline)) void load_group512(const uint8_t *wq, const int bits, int b, __m512i *u,
                                                                __mmask64 *neg) {
    if (bits == 4) {
        const __m256i low = _mm256_set1_epi8(0x0f);
        _mm_prefetch((const char *)(wq + (size_t)b * 16 + QPREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(wq + (size_t)b * 16 + QPREFETCH + 64), _MM_HINT_T0);
        for (int c = 0; c < 4; c++) {
            __m256i raw = _mm256_loadu_si256((const __m256i *)(wq + (size_t)(b + 2 * c) * 16));
            __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, low)),
                                           _mm256_and_si256(_mm256_srli_epi16(raw, 4), low), 1);  /* Alo Blo Ahi Bhi */
            u[c] = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));                        /* Alo Ahi Blo Bhi */
        }
    } else {
        for (int c = 0; c < 4; c++) {
            _mm_prefetch((const char *)(wq + (size_t)(b + 2 * c) * QK + QPREFETCH), _MM_HINT_T0);
            __m512i raw = _mm512_loadu_si512((const void *)(wq + (size_t)(b + 2 * c) * QK));
            neg[c] = _mm512_movepi8_mask(raw);
            u[c] = _mm512_abs_epi8(raw);
        }
    }
}
#endif

/* Rows r0 .. r0 + rows - 1 of x against one weight row (bits 4: qs [K / 2], d and m [K / 32] each; bits 8: qs [K],
 * d [K / 32]) into out[0 .. rows). Per row: for each group of 8 blocks, the blocks' integer sums scaled by d * xd are
 * added to a float accumulator lane-wise (AVX2: the 8 sums reduced into 8 lanes first; AVX512-VNNI: each pair of
 * blocks' 16 partial sums, in 16 lanes) and, int4, macc += m * xs; the blocks past the last whole group add
 * d * xd * sum (+ m * xs) to a scalar tail in block order; the result is (hsum(acc) + hsum(macc)) + tail. A row's
 * result depends on nothing but that row and the weight. Inlined with rows and bits constant. */
static inline __attribute__((always_inline)) void pass(const Activations *a, int r0, const int rows, const int bits,
                                                       int k, const uint8_t *wq, const uint16_t *wd,
                                                       const uint16_t *wm, float *out) {
    const int nb = k / QK, whole = nb / GROUP * GROUP;
    __m256 macc[ROWS];
    float tail[ROWS];
#ifdef VNNI_PASS
    __m512 acc[ROWS];
    for (int r = 0; r < rows; r++) {
        acc[r] = _mm512_setzero_ps();
        macc[r] = _mm256_setzero_ps();
        tail[r] = 0.0f;
    }
    __m512i u[4];
    __mmask64 neg[4] = {0, 0, 0, 0};
    for (int b = 0; b < whole; b += GROUP) {
        load_group512(wq, bits, b, u, neg);
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wd + b)));
        __m256 mm = bits == 4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(wm + b))) : d;
        for (int r = 0; r < rows; r++) {
            size_t row = (size_t)(r0 + r);
            const int8_t *xq = a->q + row * k + (size_t)b * QK;
            __m256 scale = _mm256_mul_ps(d, _mm256_loadu_ps(a->xd + row * nb + b));
            for (int c = 0; c < 4; c++) {
                __m512i xv = _mm512_loadu_si512((const void *)(xq + c * 2 * QK));
                if (bits == 8) xv = _mm512_mask_sub_epi8(xv, neg[c], _mm512_setzero_si512(), xv);
                __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[c], xv);  /* [16] int32: 2 blocks */
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), expand_pair(scale, c), acc[r]);
            }
            if (bits == 4) macc[r] = _mm256_fmadd_ps(mm, _mm256_loadu_ps(a->xs + row * nb + b), macc[r]);
        }
    }
#else
    __m256 acc[ROWS];
    for (int r = 0; r < rows; r++) {
        acc[r] = macc[r] = _mm256_setzero_ps();
        tail[r] = 0.0f;
    }
    __m256i p[GROUP];
    for (int b = 0; b < whole; b += GROUP) {
        __m256i w[GROUP], sign[GROUP];
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
#endif
    __m256i w[GROUP], sign[GROUP];
    for (int b = whole; b < nb; b++) {
        load_blocks(wq, bits, b, 1, w, sign);
        float d = _cvtsh_ss(wd[b]), mm = bits == 4 ? _cvtsh_ss(wm[b]) : 0.0f;
        for (int r = 0; r < rows; r++) {
            size_t row = (size_t)(r0 + r);
            int sum = hsum_i32(block_sums(w[0], sign[0], a->q + row * k + (size_t)b * QK, bits));
            tail[r] += d * a->xd[row * nb + b] * (float)sum + (bits == 4 ? mm * a->xs[row * nb + b] : 0.0f);
        }
    }
#ifdef VNNI_PASS
    for (int r = 0; r < rows; r++) out[r] = (_mm512_reduce_add_ps(acc[r]) + hsum8(macc[r])) + tail[r];
#else
    for (int r = 0; r < rows; r++) out[r] = (hsum8(acc[r]) + hsum8(macc[r])) + tail[r];
#endif
}


static inline __m256 load8(const void *p, int bf16, size_t i) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
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


/* Attention of one query row and head over its n visible keys (cache rows keys[0 .. n), in order) into out [dim]
 * fp32: s_j = (q . k_j) * scale (8 lanes, then a fixed horizontal sum), optionally softcap * tanh(s_j / softcap);
 * m = max s_j; p_j = exp(s_j - m); l = sum p_j (8 lanes over j, then horizontal); out = (sum_j p_j v_j) / l.
 * q: the row's head (fp32 or bf16); base: the KV head's offset within a cache row of `stride` values; s: scratch of
 * n + 8 floats. The result depends on the query, the keys and their order alone. */
static inline void attend_row_head(const void *q, int q_bf16, const void *k, const void *v, int kv_bf16, size_t stride,
                                   size_t base, const int32_t *keys, int64_t n, int lanes, float scale, float softcap,
                                   float *s, float *out) {
    __m256 qv[64];
    for (int i = 0; i < lanes; i++) qv[i] = load8(q, q_bf16, (size_t)i * 8);
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        size_t row = (size_t)keys[j] * stride + base;
        __m256 acc = _mm256_mul_ps(qv[0], load8(k, kv_bf16, row));
        for (int i = 1; i < lanes; i++) acc = _mm256_fmadd_ps(qv[i], load8(k, kv_bf16, row + (size_t)i * 8), acc);
        float sj = hsum8(acc) * scale;
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
    float l = hsum8(lsum) + tail;
    __m256 o[64];
    for (int i = 0; i < lanes; i++) o[i] = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        size_t row = (size_t)keys[t] * stride + base;
        __m256 p = _mm256_set1_ps(s[t]);
        for (int i = 0; i < lanes; i++) o[i] = _mm256_fmadd_ps(p, load8(v, kv_bf16, row + (size_t)i * 8), o[i]);
    }
    __m256 inv = _mm256_set1_ps(1.0f / l);
    for (int i = 0; i < lanes; i++) _mm256_storeu_ps(out + (size_t)i * 8, _mm256_mul_ps(o[i], inv));
}

/* hsum8 of each of a[0 .. 8), bit for bit (the same three rounds of additions of the same operands), as one vector:
 * eight keys' dot products reduced together where eight hsum8 calls took about five operations each. */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 t[2];
    for (int h = 0; h < 2; h++) {  /* keys 4h .. 4h + 3: each key's lanes i + (i + 4), then (0 + 2), (1 + 3) */
        const __m256 *b = a + 4 * h;
        const __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20),
                                         _mm256_permute2f128_ps(b[0], b[1], 0x31));
        const __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(b[2], b[3], 0x20),
                                         _mm256_permute2f128_ps(b[2], b[3], 0x31));
        t[h] = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    /* per 128-bit lane, t holds (key: t0, t1) pairs; the sums t0 + t1 come out as keys 0 2 4 6 | 1 3 5 7 */
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* The scores of 8 keys (cache rows rows[0 .. 8)) for G query heads q [G][lanes * 8] into s_h[0 .. 8) (s + h * ns),
 * each bit for bit attend_row_head's: per key and head one product then multiply-adds over the lanes in order, the
 * fixed horizontal sum, times scale. The 8 keys' sums run side by side (8 independent chains where one key's was a
 * chain of 8 dependent multiply-adds) and each key row is converted from the cache once for the G heads. */
static inline __attribute__((always_inline)) void scores8(const float *q, const int G, const void *k, int kv_bf16,
                                                          const size_t *rows, int lanes, float scale, float *s,
                                                          size_t ns) {
    __m256 acc[4][8];
    for (int i = 0; i < lanes; i++)
        for (int r = 0; r < 8; r++) {
            const __m256 kv = load8(k, kv_bf16, rows[r] + (size_t)i * 8);
            for (int h = 0; h < G; h++) {
                const __m256 qh = _mm256_loadu_ps(q + (size_t)h * lanes * 8 + (size_t)i * 8);
                acc[h][r] = i ? _mm256_fmadd_ps(qh, kv, acc[h][r]) : _mm256_mul_ps(qh, kv);
            }
        }
    for (int h = 0; h < G; h++) _mm256_storeu_ps(s + h * ns, _mm256_mul_ps(hsum8x8(acc[h]), _mm256_set1_ps(scale)));
}

/* out_h += sum over the keys t of [0, n) of p_h[t] v_t (values at cache rows rows[t]), for G heads (o: G heads of
 * lanes * 8 floats; p_h = p + h * ns), each lane's sum in key order as attend_row_head's; each value row converted
 * once for the G heads, 8 lanes of every head at a time (8 G independent chains). */
static inline __attribute__((always_inline)) void values_into(float *o, const int G, const void *v, int kv_bf16,
                                                              const size_t *rows, int n, int lanes, const float *p,
                                                              size_t ns) {
    for (int i0 = 0; i0 < lanes; i0 += 8) {
        const int w = lanes - i0 < 8 ? lanes - i0 : 8;
        __m256 acc[4][8];
        for (int h = 0; h < G; h++)
            for (int i = 0; i < w; i++) acc[h][i] = _mm256_loadu_ps(o + ((size_t)h * lanes + i0 + i) * 8);
        for (int t = 0; t < n; t++) {
            __m256 pt[4];
            for (int h = 0; h < G; h++) pt[h] = _mm256_set1_ps(p[h * ns + t]);
            if (w == 8) {  /* the common widths (head_dim a multiple of 64): unrolled, the chains in registers */
                for (int i = 0; i < 8; i++) {
                    const __m256 vv = load8(v, kv_bf16, rows[t] + (size_t)(i0 + i) * 8);
                    for (int h = 0; h < G; h++) acc[h][i] = _mm256_fmadd_ps(pt[h], vv, acc[h][i]);
                }
            } else {
                for (int i = 0; i < w; i++) {
                    const __m256 vv = load8(v, kv_bf16, rows[t] + (size_t)(i0 + i) * 8);
                    for (int h = 0; h < G; h++) acc[h][i] = _mm256_fmadd_ps(pt[h], vv, acc[h][i]);
                }
            }
        }
        for (int h = 0; h < G; h++)
            for (int i = 0; i < w; i++) _mm256_storeu_ps(o + ((size_t)h * lanes + i0 + i) * 8, acc[h][i]);
    }
}

/* attend_row_head for G (1 to 4) query heads of one row that read the same KV head (q: G heads of lanes * 8 fp32
 * values, out: the same layout), each head's result bit for bit attend_row_head's: the same products, sums and order.
 * What differs is how the work is laid out: 8 keys' dot products side by side (scores8), each key and value row
 * converted from the cache once for the G heads. s: scratch of G * (n + 8) floats. */
static inline __attribute__((always_inline)) void attend_row_group_g(const float *q, const int G, const void *k,
                                                                     const void *v, int kv_bf16, size_t stride,
                                                                     size_t base, const int32_t *keys, int64_t n,
                                                                     int lanes, float scale, float softcap, float *s,
                                                                     float *out) {
    const size_t dim = (size_t)lanes * 8, ns = (size_t)n + 8;
    float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, l[4];
    size_t rows[8];
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        for (int r = 0; r < 8; r++) rows[r] = (size_t)keys[j + r] * stride + base;
        scores8(q, G, k, kv_bf16, rows, lanes, scale, s + j, ns);
    }
    for (; j < n; j++) {  /* the last keys one at a time, as attend_row_head takes every key */
        const size_t row = (size_t)keys[j] * stride + base;
        for (int h = 0; h < G; h++) {
            const float *qh = q + h * dim;
            __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qh), load8(k, kv_bf16, row));
            for (int i = 1; i < lanes; i++)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + (size_t)i * 8), load8(k, kv_bf16, row + (size_t)i * 8), acc);
            s[h * ns + j] = hsum8(acc) * scale;
        }
    }
    for (int h = 0; h < G; h++) {  /* attend_row_head's cap, maximum, exponentials and their sum, head by head */
        float *sh = s + h * ns;
        int64_t t = 0;
        if (softcap > 0.0f)
            for (; t < n; t++) sh[t] = softcap * tanhf(sh[t] / softcap);
        __m256 mx = _mm256_set1_ps(-INFINITY);  /* the maximum is exact in any order */
        for (t = 0; t + 8 <= n; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sh + t));
        float mxs[8];
        _mm256_storeu_ps(mxs, mx);
        for (int i = 0; i < 8; i++) m[h] = mxs[i] > m[h] ? mxs[i] : m[h];
        for (; t < n; t++) m[h] = sh[t] > m[h] ? sh[t] : m[h];
        __m256 mv = _mm256_set1_ps(m[h]), lsum = _mm256_setzero_ps();
        int64_t e = 0;
        for (; e + 8 <= n; e += 8) {
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + e), mv));
            _mm256_storeu_ps(sh + e, p);
            lsum = _mm256_add_ps(lsum, p);
        }
        float tail = 0.0f;
        if (e < n) {
            float pad[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t t = e; t < n; t++) pad[t - e] = sh[t] - m[h];
            _mm256_storeu_ps(pad, exp8(_mm256_loadu_ps(pad)));
            for (int64_t t = e; t < n; t++) {
                sh[t] = pad[t - e];
                tail += pad[t - e];
            }
        }
        l[h] = hsum8(lsum) + tail;
    }
    for (size_t i = 0; i < (size_t)G * dim; i++) out[i] = 0.0f;
    for (int64_t t0 = 0; t0 < n; t0 += 64) {  /* values 64 keys at a time (their rows' addresses first) */
        const int count = n - t0 < 64 ? (int)(n - t0) : 64;
        size_t vrows[64];
        for (int t = 0; t < count; t++) vrows[t] = (size_t)keys[t0 + t] * stride + base;
        values_into(out, G, v, kv_bf16, vrows, count, lanes, s + t0, ns);
    }
    for (int h = 0; h < G; h++) {
        const __m256 inv = _mm256_set1_ps(1.0f / l[h]);
        float *oh = out + h * dim;
        for (size_t i = 0; i < dim; i += 8) _mm256_storeu_ps(oh + i, _mm256_mul_ps(_mm256_loadu_ps(oh + i), inv));
    }
}

/* attend_row_group_g for g = 1 to 4 heads, each count compiled apart (its chains in registers); one head over a few
 * keys by attend_row_head itself (there the side-by-side sums did not pay: bench/attention_group.c). */
static inline void attend_row_group(const float *q, int g, const void *k, const void *v, int kv_bf16, size_t stride,
                                    size_t base, const int32_t *keys, int64_t n, int lanes, float scale, float softcap,
                                    float *s, float *out) {
    if (g == 1 && n < 64) {
        attend_row_head(q, 0, k, v, kv_bf16, stride, base, keys, n, lanes, scale, softcap, s, out);
        return;
    }
    switch (g) {
        case 1: attend_row_group_g(q, 1, k, v, kv_bf16, stride, base, keys, n, lanes, scale, softcap, s, out); break;
        case 2: attend_row_group_g(q, 2, k, v, kv_bf16, stride, base, keys, n, lanes, scale, softcap, s, out); break;
        case 3: attend_row_group_g(q, 3, k, v, kv_bf16, stride, base, keys, n, lanes, scale, softcap, s, out); break;
        default: attend_row_group_g(q, 4, k, v, kv_bf16, stride, base, keys, n, lanes, scale, softcap, s, out); break;
    }
}
#endif
