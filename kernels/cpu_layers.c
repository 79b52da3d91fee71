/* Every decoder layer of a Llama-family model (RMSNorm, q/k/v with optional biases and per-head q/k norms, RoPE,
 * tree attention over the KV pool, o_proj, SwiGLU MLP) for one step's rows, in one call and one thread team
 * (cpu_team.c), on an x86-64 CPU with AVX2, FMA and F16C.
 *
 * Why: the same layer as PyTorch operations is about 60 dispatched operations, each a few microseconds of host work
 * whatever its size, so on a many-layer model a one-token step was mostly host work (BENCHMARKS.md, "Fused CPU
 * decoder layers"). Here a layer is nine parallel loops separated by barriers, none of which returns to Python.
 *
 * Every row is computed alone: products give each (row, output) one reduction in a fixed order (tiles share weight
 * loads, never sums), attention reads the row's own visible keys (attend_row_group: a KV head's query heads share
 * its key and value loads, each head's sums attend_row_head's), norms and the MLP act per row.
 * So a row's result depends on that row and what it attends to, not on the step's other rows or the threads: a tree
 * verified in one step gets, bit for bit, what one-token steps give the same tokens.
 *
 * Layouts: h [t, hidden] fp32 or bf16 (the residual stream, updated in place; computed in fp32 and rounded to bf16
 * where the model's dtype is bf16, at the points PyTorch's layer rounds); products per Weight.kind: dense fp32 or
 * bf16 [n, k] (k a multiple of 8), or our int4 / int8 block layouts (cpu_kernels.h, cpu_qgemm.c); q/k/v output
 * [q heads | kv heads | kv heads] x dim; K and V caches of a layer: rows of [kv_heads, dim] (fp32 or bf16), the row
 * of step row r at cache_rows[r]; RoPE of row r from positions[r] and inv_freq [rotary_dim / 2] (times rope_scale),
 * x * cos + [x2, x1] * signed_sin with sin's first half negated; a layer's visible keys: list Layer.keys of the
 * lists built_keys makes from the step's segments, one per distinct sliding window.
 *
 * Segments (one int32 array, `seg`): a header of nseg records {n, prefix, queries, parents_at, table_at, kv_start},
 * then the parent arrays and block tables they point at (offsets into the same array). Segment s holds n nodes after
 * `prefix` cached positions; its last `queries` nodes are the step's rows (segment after segment, in order). Node u
 * sits at logical position prefix + u and token (RoPE) position prefix + depth(u); its parent -1 is the context.
 * Logical position p is pool row table[p / block_size] * block_size + p % block_size (paged, block_size > 0), else
 * kv_start + p.
 */
#include "cpu_kernels.h"

enum { DENSE_F32 = 0, DENSE_BF16 = 1, INT4 = 4, INT8 = 8 };

typedef struct {
    int kind, n, k;     /* k: inputs (the block layouts: padded to whole blocks of 32) */
    const void *w;      /* dense [n, k]; int4 qs [n, k / 2]; int8 qs [n, k] */
    const uint16_t *s;  /* int4 dm [n, 2, k / 32]; int8 d [n, k / 32]; dense: unused */
    const float *bias;  /* [n] or NULL */
} Weight;

typedef struct {
    Weight qkv, o, up, down;
    const float *norm1, *norm2;    /* [hidden] */
    const float *q_norm, *k_norm;  /* [dim] or NULL */
    void *k_cache, *v_cache;
    int keys;                      /* which of the step's visible-key lists this layer reads (its window's) */
} Layer;

typedef struct {
    int hidden, heads, kv_heads, dim, inter, rotary_dim, h_bf16, kv_bf16;
    float eps, scale, softcap;
} Shape;

static inline float rnd(float v, int bf) { return bf ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* y = x * (1 / sqrt(mean(x^2) + eps)), rounded, times w, rounded (as PyTorch's rms_norm in the model's dtype). */
static inline void rms_norm(const float *x, const float *w, int n, float eps, float *y, int bf) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = hsum8(acc);
    for (; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (i = 0; i < n; i++) y[i] = rnd(rnd(x[i] * inv, bf) * w[i], bf);
}

/* RoPE of one head x [rd leading values rotated] in place: x * cos + [x2, x1] * signed_sin. */
static inline void rope(float *x, const float *cos, const float *ssin, int rd, int bf) {
    const int half = rd / 2;
    float tmp[512];
    for (int i = 0; i < rd; i++) tmp[i] = x[i];
    for (int i = 0; i < rd; i++) x[i] = rnd(tmp[i] * cos[i] + tmp[i < half ? i + half : i - half] * ssin[i], bf);
}

#define OUTS 4   /* dense: weight rows per tile */
#define DROWS 2  /* dense: activation rows per tile */
/* Dense tiles read their weight rows (contiguous: a tile's OUTS rows, then the next tile's) and ask for the same
 * place AHEAD tiles on as they go: a one-row step streams the weights from memory, and the hardware's prefetchers
 * alone kept a core's misses too few (SmolLM2-135M in bf16 on a 2-core Xeon: the layers 15-18 ms a token without,
 * 9-12 with; BENCHMARKS.md). A prefetch changes no result. */
#define AHEAD 2
#define PREFETCH_NEXT_TILE(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)

/* Dense tile: rows r0 .. r0 + rows of x (fp32, ld ldx) against weight rows o0 .. o0 + outs; each (row, output) is
 * one 8-lane FMA chain over k in order, then hsum8, whatever the tile. out[r * OUTS + j]. */
static inline __attribute__((always_inline)) void dense_tile(const float *x, int ldx, int r0, const int rows,
                                                             const void *w, const int bf16, int o0, const int outs,
                                                             int k, float *out) {
    __m256 acc[DROWS][OUTS];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < outs; j++) acc[r][j] = _mm256_setzero_ps();
    for (int i = 0; i < k; i += 8) {
        __m256 wv[OUTS];
        for (int j = 0; j < outs; j++) {
            if (!(i & (bf16 ? 31 : 15))) PREFETCH_NEXT_TILE((const char *)w + ((size_t)(o0 + AHEAD * outs + j) * k + i) * (bf16 ? 2 : 4));
            wv[j] = load8(w, bf16, (size_t)(o0 + j) * k + i);
        }
        for (int r = 0; r < rows; r++) {
            __m256 xv = _mm256_loadu_ps(x + (size_t)(r0 + r) * ldx + i);
            for (int j = 0; j < outs; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < outs; j++) out[r * OUTS + j] = hsum8(acc[r][j]);
}

#ifdef __AVX512F__
#ifdef __AVX512BF16__
/* One 32-input chunk of a bf16 tile (mask m over the chunk's inputs: all 32, or the last chunk's). */
static inline __attribute__((always_inline)) void chunk_bf16(__m512 acc[DROWS][OUTS], const float *x, int ldx, int r0,
                                                             const int rows, const uint16_t *w, int o0, const int outs,
                                                             int k, int i, __mmask32 m) {
    __m512bh wv[OUTS];
    for (int j = 0; j < outs; j++) {
        PREFETCH_NEXT_TILE(w + (size_t)(o0 + AHEAD * outs + j) * k + i);
        wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + (size_t)(o0 + j) * k + i);
    }
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)(r0 + r) * ldx + i;
        const __m512 lo = _mm512_maskz_loadu_ps((__mmask16)m, xr), hi = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), xr + 16);
        const __m512bh xv = _mm512_cvtne2ps_pbh(hi, lo);
        for (int j = 0; j < outs; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
}
#endif

/* One 16-input chunk of an fp32-product tile (fp32 weights, or bf16 ones widened). */
static inline __attribute__((always_inline)) void chunk_f32(__m512 acc[DROWS][OUTS], const float *x, int ldx, int r0,
                                                            const int rows, const void *w, const int bf16, int o0,
                                                            const int outs, int k, int i, __mmask16 m) {
    __m512 wv[OUTS];
    for (int j = 0; j < outs; j++) {
        const size_t at = (size_t)(o0 + j) * k + i, ahead = (size_t)(o0 + AHEAD * outs + j) * k + i;
        PREFETCH_NEXT_TILE(bf16 ? (const void *)((const uint16_t *)w + ahead) : (const void *)((const float *)w + ahead));
        wv[j] = bf16 ? _mm512_castsi512_ps(
                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + at)), 16))
                     : _mm512_maskz_loadu_ps(m, (const float *)w + at);
    }
    for (int r = 0; r < rows; r++) {
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + (size_t)(r0 + r) * ldx + i);
        for (int j = 0; j < outs; j++) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
}

/* The dense tile on AVX-512 (the library is built with it where the CPU has it, cpu_qgemm.py): each (row, output) one
 * 16-lane chain over k in order (with AVX512-BF16 and bf16 weights, 16 lanes of bf16 pair products: the layers' bf16
 * inputs are bf16 values already, so converting them loses nothing), the last chunk masked, then a fixed-order lane
 * sum, whatever the tile. Same contract as dense_tile. */
static inline __attribute__((always_inline)) void dense_tile512(const float *x, int ldx, int r0, const int rows,
                                                                const void *w, const int bf16, int o0, const int outs,
                                                                int k, float *out) {
    __m512 acc[DROWS][OUTS];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < outs; j++) acc[r][j] = _mm512_setzero_ps();
#ifdef __AVX512BF16__
    if (bf16) {
        int i = 0;
        for (; i + 32 <= k; i += 32) chunk_bf16(acc, x, ldx, r0, rows, w, o0, outs, k, i, 0xffffffffu);
        if (i < k) chunk_bf16(acc, x, ldx, r0, rows, w, o0, outs, k, i, (__mmask32)((1u << (k - i)) - 1));
    } else
#endif
    {
        int i = 0;
        for (; i + 16 <= k; i += 16) chunk_f32(acc, x, ldx, r0, rows, w, bf16, o0, outs, k, i, 0xffff);
        if (i < k) chunk_f32(acc, x, ldx, r0, rows, w, bf16, o0, outs, k, i, (__mmask16)((1u << (k - i)) - 1));
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < outs; j++) out[r * OUTS + j] = _mm512_reduce_add_ps(acc[r][j]);
}
#define DENSE_TILE dense_tile512
#else
#define DENSE_TILE dense_tile
#endif

/* The epilogue of output (r, o): + bias, rounded; with accumulate, added to y (the residual stream), rounded. */
static inline void emit(float *y, int n, int r, int o, float v, const float *bias, int accumulate, int bf) {
    v = rnd(bias ? v + bias[o] : v, bf);
    size_t i = (size_t)r * n + o;
    y[i] = accumulate ? rnd(y[i] + v, bf) : v;
}

#ifdef __AVX512F__  /* (AMX CPUs have AVX-512: cpu_qgemm.py builds AMX on top of it) */
/* rnd8's 16 lanes. */
static inline __m512 rnd16(__m512 v, int bf) {
    if (!bf) return v;
    __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    const __m512 r = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, v);  /* NaN stays NaN */
}

/* emit() of outputs o0 .. o0 + 16 of row r, their values at col[16 j] (a column of an AMX output tile), 16 lanes. */
static inline void emit16(float *y, int n, int r, int o0, const float *col, const float *bias, int accumulate, int bf) {
    const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(16));
    __m512 v = _mm512_i32gather_ps(at, col, 4);
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + o0));
    float *dst = y + (size_t)r * n + o0;
    v = rnd16(v, bf);
    if (accumulate) v = rnd16(_mm512_add_ps(_mm512_loadu_ps(dst), v), bf);
    _mm512_storeu_ps(dst, v);
}

/* product()'s dense bf16 weights on AMX (cpu_amx.c): the rows packed once (every thread a share, then the loop's
 * barrier), each whole 16 outputs by the tiles, the outputs past them by the AVX-512 tile (for every step alike). */
static void amx_product(Team *tm, const Weight *w, int t, const float *x, int ldx, uint32_t *xv, float *y,
                        int accumulate, int bf) {
    const int n = w->n, k = w->k, groups = (t + 15) / 16, chunks = (k + 31) / 32, whole = n / 16 * 16;
    TEAM_FOR(tm, gc, groups * chunks) amx_pack_chunk(x, ldx, t, k, gc / chunks, gc % chunks, xv);
    amx_begin();
    TEAM_FOR(tm, ob, whole / 16) {
        float out[AMX_GROUPS * 256];  /* [row groups][16 outputs][16 rows] */
        for (int g0 = 0; g0 < groups; g0 += AMX_GROUPS) {
            const int gs = groups - g0 < AMX_GROUPS ? groups - g0 : AMX_GROUPS;
            amx_block((const uint16_t *)w->w, k, 16 * ob, xv + (size_t)g0 * chunks * 256, gs, out);
            for (int g = 0; g < gs; g++)
                for (int m = 0; m < 16 && 16 * (g0 + g) + m < t; m++)
                    emit16(y, n, 16 * (g0 + g) + m, 16 * ob, out + g * 256 + m, w->bias, accumulate, bf);
        }
    }
    amx_end();
    TEAM_FOR(tm, j, n - whole)
        for (int r = 0; r < t; r++) {
            float v[DROWS * OUTS];
            DENSE_TILE(x, ldx, r, 1, w->w, 1, whole + j, 1, k, v);
            emit(y, n, r, whole + j, v[0], w->bias, accumulate, bf);
        }
}

#endif

/* y [t, n] (=, or += with accumulate) x [t, k] @ W^T, the output rows split across the team (every thread calls it;
 * it returns after the team's barrier). x: fp32 rows of ldx (dense), or `a`, the rows quantized (block layouts). */
static void product(Team *tm, const Weight *w, int t, const float *x, int ldx, const Activations *a, float *y,
                    int accumulate, int bf) {
    const int n = w->n, k = w->k;
    if (w->kind == INT4 || w->kind == INT8) {
        const int bits = w->kind, nb = k / QK;
        const size_t row_bytes = bits == 4 ? (size_t)k / 2 : (size_t)k, scales = bits == 4 ? 2 * (size_t)nb : (size_t)nb;
        TEAM_FOR(tm, o, n) {
            const uint8_t *wq = (const uint8_t *)w->w + (size_t)o * row_bytes;
            const uint16_t *wd = w->s + (size_t)o * scales, *wm = wd + nb;
#ifndef VNNI_PASS /* the AVX-512 pass prefetches its own stream (QPREFETCH); rows ahead on top of it streamed 15 % slower */
            for (size_t b = 0; b < row_bytes; b += 64) PREFETCH_NEXT_TILE(wq + AHEAD * OUTS * row_bytes + b);
            PREFETCH_NEXT_TILE(wd + AHEAD * OUTS * scales);
#endif
            for (int r0 = 0; r0 < t; r0 += ROWS) {
                int rows = t - r0 < ROWS ? t - r0 : ROWS;
                float out[ROWS];
                if (rows == 1 && bits == 4)
                    pass(a, r0, 1, 4, k, wq, wd, wm, out);
                else if (rows == 1)
                    pass(a, r0, 1, 8, k, wq, wd, wm, out);
                else if (bits == 4)
                    pass(a, r0, rows, 4, k, wq, wd, wm, out);
                else
                    pass(a, r0, rows, 8, k, wq, wd, wm, out);
                for (int r = 0; r < rows; r++) emit(y, n, r0 + r, o, out[r], w->bias, accumulate, bf);
            }
        }
        return;
    }
    const int bf16 = w->kind == DENSE_BF16;
#ifdef __AVX512F__
    if (bf16 && a && a->xv && n >= 16) {
        amx_product(tm, w, t, x, ldx, a->xv, y, accumulate, bf);
        return;
    }
#endif
    TEAM_FOR(tm, ob, (n + OUTS - 1) / OUTS) {
        const int o0 = ob * OUTS, outs = n - o0 < OUTS ? n - o0 : OUTS;
        for (int r0 = 0; r0 < t; r0 += DROWS) {
            const int rows = t - r0 < DROWS ? t - r0 : DROWS;
            float out[DROWS * OUTS];
            if (outs == OUTS && rows == DROWS)
                DENSE_TILE(x, ldx, r0, DROWS, w->w, bf16, o0, OUTS, k, out);
            else if (outs == OUTS)
                DENSE_TILE(x, ldx, r0, 1, w->w, bf16, o0, OUTS, k, out);
            else
                for (int j = 0; j < outs; j++)
                    for (int r = 0; r < rows; r++) DENSE_TILE(x, ldx, r0 + r, 1, w->w, bf16, o0 + j, 1, k, out + r * OUTS + j);
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < outs; j++) emit(y, n, r0 + r, o0 + j, out[r * OUTS + j], w->bias, accumulate, bf);
        }
    }
}

/* Row r of x (fp32, `cols` values) as the product's input: quantized into a (block layouts), else read as it is. */
static inline void prepare(const Weight *w, const float *x, int cols, int r, Activations *a) {
    if (w->kind == INT4 || w->kind == INT8)
        quantize_row(x, 0, cols, w->k, a->q + (size_t)r * w->k, a->xd + (size_t)r * (w->k / QK),
                     a->xs + (size_t)r * (w->k / QK));
}

/* y = (each row of res RMS-normed with `norm` into x, and for the block layouts quantized into a) @ W^T. */
static void norm_product(Team *tm, const Shape *sh, const float *norm, const Weight *w, int t, const float *res,
                         float *x, int ldx, Activations *a, float *y) {
    TEAM_FOR(tm, r, t) {
        rms_norm(res + (size_t)r * sh->hidden, norm, sh->hidden, sh->eps, x + (size_t)r * ldx, sh->h_bf16);
        prepare(w, x + (size_t)r * ldx, sh->hidden, r, a);
    }
    product(tm, w, t, x, ldx, a, y, 0, sh->h_bf16);
}

static inline int maxi(int a, int b) { return a > b ? a : b; }

/* Eight lanes rounded to bf16 and back (nearest even, as f32_to_bf16). */
static inline __m256 rnd8(__m256 v, int bf) {
    if (!bf) return v;
    __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    const __m256 r = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
    return _mm256_blendv_ps(r, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));  /* NaN stays NaN */
}

/* y [n] = silu(gate) * up, rounded as PyTorch's layer rounds, of one row's gu = [gate | up] (each n): silu(g) =
 * g * sigmoid(g), sigmoid from e = exp(-|g|) (1 / (1 + e), or e / (1 + e) below 0), eight lanes at a time (a scalar
 * expf per value was most of a verify row's cost), the last n % 8 values alone. */
static inline void swiglu(const float *gu, int n, float *y, int bf) {
    const float *g = gu, *u = gu + n;
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j), one = _mm256_set1_ps(1.0f);
        const __m256 e = exp8(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), gv) * _mm256_set1_ps(-1.0f));
        const __m256 pos = _mm256_cmp_ps(gv, _mm256_setzero_ps(), _CMP_GE_OQ);
        const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(e, one, pos), _mm256_add_ps(one, e));
        const __m256 silu = rnd8(_mm256_mul_ps(gv, sig), bf);
        _mm256_storeu_ps(y + j, rnd8(_mm256_mul_ps(silu, _mm256_loadu_ps(u + j)), bf));
    }
    for (; j < n; j++) {
        const float e = expf(-fabsf(g[j])), sig = (g[j] >= 0.0f ? 1.0f : e) / (1.0f + e);
        y[j] = rnd(rnd(g[j] * sig, bf) * u[j], bf);
    }
}

/* Query heads an attention task takes (attend_row_group): the divisor g <= 4 of the group (heads / kv_heads) whose
 * longest thread share is shortest, a head costing 0.6 of a lone head's time where a task takes two or more (each key
 * and value row converted once for them: 1.6-1.7x on AVX-512, BENCHMARKS.md). The result is the same for any g. */
static int heads_per_task(int t, int heads, int kv_heads, int threads) {
    const int group = heads / kv_heads;
    int best = 1;
    double best_time = 1e300;
    for (int g = 1; g <= 4 && g <= group; g++) {
        if (group % g) continue;
        const int64_t tasks = (int64_t)t * (heads / g), share = (tasks + threads - 1) / threads;
        const double time = (double)share * g * (g > 1 ? 0.6 : 1.0);
        if (time < best_time) best = g, best_time = time;
    }
    return best;
}

/* One layer over the step's rows, run by every thread of the team (every loop a share, then the team's barrier). */
static void layer(Team *tm, const Shape *sh, const Layer *L, int t, float *res, float *x, int ldx, float *qkv, float *att,
                  float *gu, Activations *a, const float *cos, const float *sin, const int64_t *cache_rows,
                  const int64_t *offsets, const int32_t *keys, float *s) {
    const int H = sh->heads, KV = sh->kv_heads, D = sh->dim, I = sh->inter, bf = sh->h_bf16;
    const int nqkv = L->qkv.n, rd = sh->rotary_dim;
    const size_t stride = (size_t)KV * D;
    norm_product(tm, sh, L->norm1, &L->qkv, t, res, x, ldx, a, qkv);
    TEAM_FOR(tm, task, t * (H + KV)) {  /* query and key heads: norms, RoPE; keys and values cached */
        const int r = task / (H + KV), hh = task % (H + KV);
        float *head = qkv + (size_t)r * nqkv + (size_t)hh * D;
        const float *norm = hh < H ? L->q_norm : L->k_norm;
        if (norm) rms_norm(head, norm, D, sh->eps, head, bf);
        if (rd) rope(head, cos + (size_t)r * rd, sin + (size_t)r * rd, rd, bf);
        if (hh < H) continue;
        const float *value = qkv + (size_t)r * nqkv + (size_t)(H + KV) * D + (size_t)(hh - H) * D;
        const size_t at = (size_t)cache_rows[r] * stride + (size_t)(hh - H) * D;
        for (int i = 0; i < D; i++) {
            if (sh->kv_bf16) {
                ((uint16_t *)L->k_cache)[at + i] = f32_to_bf16(head[i]);
                ((uint16_t *)L->v_cache)[at + i] = f32_to_bf16(value[i]);
            } else {
                ((float *)L->k_cache)[at + i] = head[i];
                ((float *)L->v_cache)[at + i] = value[i];
            }
        }
    }
    const int gh = heads_per_task(t, H, KV, tm->size), tasks = H / gh;
    TEAM_FOR(tm, task, t * tasks) {  /* each task: gh query heads of one row that read one KV head */
        const int r = task / tasks, h0 = task % tasks * gh;
        float *out = att + ((size_t)r * H + h0) * D;
        attend_row_group(qkv + (size_t)r * nqkv + (size_t)h0 * D, gh, L->k_cache, L->v_cache, sh->kv_bf16, stride,
                         (size_t)(h0 / (H / KV)) * D, keys + offsets[r], offsets[r + 1] - offsets[r], D / 8, sh->scale,
                         sh->softcap, s, out);
        if (bf)
            for (int i = 0; i < gh * D; i++) out[i] = rnd(out[i], 1);
    }
    TEAM_FOR(tm, r, t) prepare(&L->o, att + (size_t)r * H * D, H * D, r, a);
    product(tm, &L->o, t, att, H * D, a, res, 1, bf);
    norm_product(tm, sh, L->norm2, &L->up, t, res, x, ldx, a, gu);
    TEAM_FOR(tm, r, t) {
        float *y = x + (size_t)r * ldx;
        swiglu(gu + (size_t)r * 2 * I, I, y, bf);
        prepare(&L->down, y, I, r, a);
    }
    product(tm, &L->down, t, x, ldx, a, res, 1, bf);
}

typedef struct {
    int64_t *offsets;  /* [t + 1] */
    int32_t *keys;     /* each row's visible pool rows, row after row */
    int longest;
} KeyLists;

static inline int32_t pool_row(const int32_t *table, int block_size, int kv_start, int p) {
    return block_size ? table[p / block_size] * block_size + p % block_size : kv_start + p;
}

/* Every row's visible keys under `window` (0: none): the cached prefix positions within the window, then the row's
 * ancestors and itself, root first, within the window (a key is visible when its token position is above the row's
 * minus window). The order is the one the attention sums in, so it is the same whatever else the step holds.
 * Returns 0, -1 when out of memory, -2 when the segments' rows are not t. */
static int build_keys(const int32_t *seg, int nseg, int block_size, int window, int t, KeyLists *out) {
    int max_n = 1, rows = 0;
    for (int s = 0; s < nseg; s++) {
        max_n = maxi(max_n, seg[6 * s]);
        rows += seg[6 * s + 2];
    }
    if (rows != t) return -2;
    int *depth = malloc(sizeof(int) * (size_t)max_n), *path = malloc(sizeof(int) * (size_t)max_n);
    out->offsets = malloc(sizeof(int64_t) * ((size_t)t + 1));
    out->keys = NULL;
    out->longest = 0;
    if (!depth || !path || !out->offsets) {
        free(depth), free(path);
        return -1;
    }
    for (int pass = 0; pass < 2; pass++) {  /* count, then fill */
        int64_t at = 0;
        int r = 0;
        for (int s = 0; s < nseg; s++) {
            const int32_t *h = seg + 6 * s, *parents = seg + h[3], *table = seg + h[4];
            const int n = h[0], prefix = h[1], queries = h[2], kv_start = h[5];
            for (int u = 0; u < n; u++) depth[u] = parents[u] < 0 ? 0 : depth[parents[u]] + 1;
            for (int u = n - queries; u < n; u++, r++) {
                const int lo = window ? maxi(0, prefix + depth[u] - window + 1) : 0;
                int m = 0;
                for (int v = u; v >= 0; v = parents[v]) path[m++] = v;  /* u up to its root */
                int count = prefix > lo ? prefix - lo : 0;
                for (int i = 0; i < m; i++) count += !window || depth[path[i]] > depth[u] - window;
                if (pass) {
                    int32_t *k = out->keys + at;
                    for (int p = lo; p < prefix; p++) *k++ = pool_row(table, block_size, kv_start, p);
                    for (int i = m - 1; i >= 0; i--)
                        if (!window || depth[path[i]] > depth[u] - window)
                            *k++ = pool_row(table, block_size, kv_start, prefix + path[i]);
                } else {
                    out->offsets[r] = at;
                    out->longest = maxi(out->longest, count);
                }
                at += count;
            }
        }
        if (!pass) {
            out->offsets[t] = at;
            out->keys = malloc(sizeof(int32_t) * ((size_t)at + 1));
            if (!out->keys) break;
        }
    }
    free(depth), free(path);
    return out->keys ? 0 : -1;
}

/* What a decoder_layers call's team shares: the model, the step's buffers and its visible keys. */
typedef struct {
    const Shape *sh;
    const Layer *layers;
    int n_layers, t, ldx, max_keys;
    float *res, *x, *qkv, *att, *gu;
    Activations *a;
    const float *cos, *sin;
    const int64_t *cache_rows;
    const KeyLists *lists;
    float *scores;  /* [threads, group, max_keys + 8]: each thread's attention scores, a KV head's query heads */
} Stack;

/* Every layer, on each thread of the team. */
static void stack_task(Team *tm, void *arg) {
    const Stack *p = (const Stack *)arg;
    float *s = p->scores + (size_t)tm->id * (p->sh->heads / p->sh->kv_heads) * ((size_t)p->max_keys + 8);
    for (int l = 0; l < p->n_layers; l++) {
        const KeyLists *keys = &p->lists[p->layers[l].keys];
        layer(tm, p->sh, &p->layers[l], p->t, p->res, p->x, p->ldx, p->qkv, p->att, p->gu, p->a, p->cos, p->sin,
              p->cache_rows, keys->offsets, keys->keys, s);
    }
}

/* Runs layers[0 .. n_layers) over h [t, hidden] in place. The step's segments (see the top) give each row's visible
 * keys, one list per window of windows[0 .. n_windows) (0: none; a layer reads list Layer.keys). Returns 0, -1 when
 * out of memory, -2 when the segments' query rows are not t. */
int decoder_layers(const Shape *sh, const Layer *layers, int n_layers, int t, void *h, const int64_t *positions,
                   const float *inv_freq, float rope_scale, const int64_t *cache_rows, const int32_t *seg, int nseg,
                   int block_size, const int32_t *windows, int n_windows, int threads) {
    const int hid = sh->hidden, qd = sh->heads * sh->dim;
    const int ldx = maxi(maxi(hid, sh->inter), qd);
    int kmax = 0, nqkv = 0;
    for (int l = 0; l < n_layers; l++) {
        const Weight *ws[4] = {&layers[l].qkv, &layers[l].o, &layers[l].up, &layers[l].down};
        for (int i = 0; i < 4; i++) kmax = maxi(kmax, ws[i]->k);
        nqkv = maxi(nqkv, layers[l].qkv.n);
    }
    float *res = malloc(sizeof(float) * (size_t)t * hid), *x = malloc(sizeof(float) * (size_t)t * ldx);
    float *qkv = malloc(sizeof(float) * (size_t)t * nqkv), *att = malloc(sizeof(float) * (size_t)t * qd);
    float *gu = malloc(sizeof(float) * (size_t)t * 2 * sh->inter);
    Activations a = {malloc((size_t)t * kmax), malloc(sizeof(float) * (size_t)t * (kmax / QK + 1)),
                     malloc(sizeof(float) * (size_t)t * (kmax / QK + 1)), NULL};
    if (amx_on()) a.xv = malloc(amx_packed_bytes(t, kmax));
    const int rd = sh->rotary_dim, half = rd / 2;
    float *cos = malloc(sizeof(float) * ((size_t)t * rd + 1)), *sin = malloc(sizeof(float) * ((size_t)t * rd + 1));
    int failed = !res || !x || !qkv || !att || !gu || !a.q || !a.xd || !a.xs || !cos || !sin || (amx_on() && !a.xv);
    KeyLists lists[8] = {{0}};  /* a model has at most a few distinct windows (fused.py checks <= 8) */
    int max_keys = 0, bad = n_windows < 1 || n_windows > 8;
    for (int i = 0; i < n_windows && !failed && !bad; i++) {
        const int e = build_keys(seg, nseg, block_size, windows[i], t, &lists[i]);
        failed = e == -1, bad = e == -2;
        max_keys = maxi(max_keys, lists[i].longest);
    }
    const size_t per_thread = (size_t)(sh->heads / sh->kv_heads) * ((size_t)max_keys + 8);
    float *scores = failed || bad ? NULL : malloc(sizeof(float) * (size_t)maxi(threads, 1) * per_thread);
    failed = failed || (!bad && !scores);
    if (!failed && !bad) {
        for (int r = 0; r < t; r++)  /* each row's RoPE from its position alone (a table op's lanes would not be) */
            for (int i = 0; i < half; i++) {
                const float f = (float)positions[r] * inv_freq[i], c = cosf(f) * rope_scale, sn = sinf(f) * rope_scale;
                cos[(size_t)r * rd + i] = cos[(size_t)r * rd + half + i] = c;
                sin[(size_t)r * rd + i] = -sn;
                sin[(size_t)r * rd + half + i] = sn;
            }
        for (size_t i = 0; i < (size_t)t * hid; i++)
            res[i] = sh->h_bf16 ? bf16_to_f32(((const uint16_t *)h)[i]) : ((const float *)h)[i];
        Stack stack = {sh, layers, n_layers, t, ldx, max_keys, res, x, qkv, att, gu, &a, cos, sin, cache_rows, lists,
                       scores};
        team_run(threads, stack_task, &stack);
        for (size_t i = 0; i < (size_t)t * hid; i++) {
            if (sh->h_bf16)
                ((uint16_t *)h)[i] = f32_to_bf16(res[i]);
            else
                ((float *)h)[i] = res[i];
        }
    }
    free(scores), free(res), free(x), free(qkv), free(att), free(gu), free(cos), free(sin), free_rows(&a);
    for (int i = 0; i < 8; i++) free(lists[i].offsets), free(lists[i].keys);
    return bad ? -2 : failed ? -1 : 0;
}

/* y [m, w->n] (fp32) = x [m, k_x] (fp32) @ W^T for a weight record of any kind, by the layers' own products on the
 * team: each output one reduction in a fixed order, whatever m (the LM head of a model the layers run, so that its
 * logits are row-invariant too). Dense: k_x = w->k; int4/int8: x's rows are quantized to int8 blocks first (zero past
 * k_x), as the layers' own inputs are. Returns 0, -1 without memory, -3 where k_x does not fit the weight. */
typedef struct {
    const Weight *w;
    int m;
    const float *x;
    const Activations *a;
    float *y;
} Dense;

static void dense_task(Team *tm, void *arg) {
    const Dense *p = (const Dense *)arg;
    product(tm, p->w, p->m, p->x, p->w->k, p->a, p->y, 0, 0);
}

int weight_gemm(int m, int k_x, const float *x, const Weight *w, float *y, int threads) {
    const int blocks = w->kind == INT4 || w->kind == INT8;
    if (blocks ? k_x > w->k : k_x != w->k) return -3;
    Activations a = {NULL, NULL, NULL, NULL};
    int failed = 0;
    if (blocks) {
        const int nb = w->k / QK;
        a.q = malloc((size_t)m * w->k);
        a.xd = malloc(sizeof(float) * (size_t)m * nb);
        a.xs = malloc(sizeof(float) * (size_t)m * nb);
        failed = !a.q || !a.xd || !a.xs;
        for (int r = 0; !failed && r < m; r++) prepare(w, x + (size_t)r * k_x, k_x, r, &a);  /* a few rows: here */
    } else if (w->kind == DENSE_BF16 && amx_on()) {
        a.xv = malloc(amx_packed_bytes(m, w->k));
        failed = !a.xv;
    }
    if (!failed) {
        Dense p = {w, m, x, &a, y};
        team_run(threads, dense_task, &p);
    }
    free_rows(&a);
    return failed ? -1 : 0;
}

/* weight_gemm of a dense fp32 or bf16 weight [n, k] (k a multiple of 8). */
void dense_gemm(int m, int n, int k, const float *x, const void *w, int w_bf16, float *y, int threads) {
    const Weight weight = {w_bf16 ? DENSE_BF16 : DENSE_F32, n, k, w, NULL, NULL};
    weight_gemm(m, k, x, &weight, y, threads);
}

/* y [m, n] = each row of x [m, n] (fp32) RMS-normed with w [n], rounded to bf16 where bf (the model's final norm,
 * as the layers' norms: a fused model's every path normalizes its last hidden states here, so the logits of a row
 * do not depend on which path, per step or per operation, computed them). */
void rms_norm_rows(int m, int n, const float *x, const float *w, float eps, int bf, float *y) {
    for (int r = 0; r < m; r++) rms_norm(x + (size_t)r * n, w, n, eps, y + (size_t)r * n, bf);
}

/* y [n_rows, head->n] (fp32) = the logits of the rows `rows` [n_rows] of h [t, hid] (fp32, or bf16 where h_bf16): the
 * model's final norm w [hid] then the LM head (a weight record of any kind), exactly as rms_norm_rows then
 * weight_gemm compute them on h's rows converted to fp32 (one call a step where those two and the row gather were
 * about ten dispatched operations). Returns -2 for a row outside [0, t), else as weight_gemm. */
int final_logits(int t, int hid, const void *h, int h_bf16, const int64_t *rows, int n_rows, const float *w, float eps,
                 const Weight *head, float *y, int threads) {
    for (int r = 0; r < n_rows; r++)
        if (rows[r] < 0 || rows[r] >= t) return -2;
    float *x = malloc(sizeof(float) * (size_t)n_rows * hid), *xn = malloc(sizeof(float) * (size_t)n_rows * hid);
    if (!x || !xn) {
        free(x), free(xn);
        return -1;
    }
    for (int r = 0; r < n_rows; r++) {
        const size_t from = (size_t)rows[r] * hid;
        for (int i = 0; i < hid; i++)
            x[(size_t)r * hid + i] = h_bf16 ? bf16_to_f32(((const uint16_t *)h)[from + i]) : ((const float *)h)[from + i];
    }
    rms_norm_rows(n_rows, hid, x, w, eps, h_bf16, xn);
    const int failed = weight_gemm(n_rows, hid, xn, head, y, threads);
    free(x), free(xn);
    return failed;
}
