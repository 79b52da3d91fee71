/* What drafting needs of an SSM pass's logit rows, in place in host memory (kernels/cpu_rows.py; its PyTorch
 * reference is cpu_rows.reference, which tests/kernels/test_cpu_rows.py holds this to):
 *
 *   idx [r, 0 .. k)   the k largest entries of row r, best first, equal values in index order (of equal values at
 *                     the k-th place, the lowest indices);
 *   probs [r, 0 .. k) where asked, the softmax of the row at those entries, in double precision:
 *                     exp(x_i - m) / sum_j exp(x_j - m), m the row's largest entry.
 *
 * PyTorch takes 3-5 reductions over the vocabulary for this (topk, two sorts, max, a float64 softmax), each a pass
 * with its own dispatch: on a small SSM they cost more than the SSM's forward. Here one pass finds the top k (8 lanes
 * compared with the k-th value so far; a lane above it inserted in order) and, where scored, a second sums the
 * exponentials in double (4 lanes of a degree-12 Taylor exp; a term below exp(-700) counts as 0: next to the largest
 * entry's 1 it is below double's precision). */
#include "cpu_kernels.h"

#define MAX_K 256 /* cpu_rows.MAX_K: most entries a row's top takes (an insertion moves up to k of them) */

/* 1 / i! for the exp polynomials */
static const double inv_fact[13] = {1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040,
                                    1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600};

/* exp(x) of 4 doubles, x in [-700, 0]: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, as Cephes' exp), a
 * degree-12 Taylor polynomial of r (truncation below 2e-16 relative), times 2^n built in the exponent bits. */
static inline __m256d exp4d(__m256d x) {
    const __m256d n = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634)), _MM_FROUND_TO_NEAREST_INT);
    __m256d r = _mm256_fnmadd_pd(n, _mm256_set1_pd(6.93145751953125e-1), x);
    r = _mm256_fnmadd_pd(n, _mm256_set1_pd(1.42860682030941723212e-6), r);
    __m256d y = _mm256_set1_pd(inv_fact[12]);
    for (int i = 11; i >= 0; i--) y = _mm256_fmadd_pd(y, r, _mm256_set1_pd(inv_fact[i]));
    const __m256i e = _mm256_slli_epi64(
        _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(n)), _mm256_set1_epi64x(1023)), 52);
    return _mm256_mul_pd(y, _mm256_castsi256_pd(e));
}

/* value x at index j into the k best so far (filled of them, best first): after every entry >= x, so that of equal
 * values the earlier index stays first. */
static inline void insert(float *val, int *idx, int *filled, int k, float x, int j) {
    int pos = *filled < k ? (*filled)++ : k - 1;
    while (pos > 0 && val[pos - 1] < x) {
        val[pos] = val[pos - 1];
        idx[pos] = idx[pos - 1];
        pos--;
    }
    val[pos] = x;
    idx[pos] = j;
}

static void top_k_row(const float *x, int v, int k, int *idx, float *val) {
    int filled = 0, j = 0;
    for (; j < k; j++) insert(val, idx, &filled, k, x[j], j);
    for (; j + 8 <= v; j += 8) {
        unsigned mask = (unsigned)_mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_loadu_ps(x + j), _mm256_set1_ps(val[k - 1]), _CMP_GT_OQ));
        while (mask) {  /* in index order; each insertion raises the bar for the lanes after it */
            const int lane = __builtin_ctz(mask);
            mask &= mask - 1;
            if (x[j + lane] > val[k - 1]) insert(val, idx, &filled, k, x[j + lane], j + lane);
        }
    }
    for (; j < v; j++)
        if (x[j] > val[k - 1]) insert(val, idx, &filled, k, x[j], j);
}

/* sum_j exp(x_j - m) in double (4 lanes, then the lanes in a fixed order, then the last v % 4 terms). AVX-512's 8
 * lanes measured no faster here. */
static double exp_sum(const float *x, int v, double m) {
    int j = 0;
    double s = 0.0;
    const __m256d mv = _mm256_set1_pd(m), lo = _mm256_set1_pd(-700.0);
    __m256d acc = _mm256_setzero_pd();
    for (; j + 4 <= v; j += 4) {
        const __m256d d = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + j)), mv);
        const __m256d keep = _mm256_cmp_pd(d, lo, _CMP_GE_OQ);
        acc = _mm256_add_pd(acc, _mm256_and_pd(exp4d(_mm256_max_pd(d, lo)), keep));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, acc);
    s += (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
    for (; j < v; j++) s += (double)x[j] - m >= -700.0 ? exp((double)x[j] - m) : 0.0;
    return s;
}

typedef struct {
    int rows, v, k, scored;
    const float *x;
    int64_t ld;
    int64_t *idx;
    double *probs;
} TopK;

/* A thread's share of row_top_k's rows. */
static void top_k_task(Team *team, void *arg) {
    const TopK *p = (const TopK *)arg;
    const int k = p->k, v = p->v;
    TEAM_FOR(team, r, p->rows) {
        const float *row = p->x + r * p->ld;
        int best[MAX_K];
        float val[MAX_K];
        top_k_row(row, v, k, best, val);
        for (int i = 0; i < k; i++) p->idx[(int64_t)r * k + i] = best[i];
        if (!p->scored) continue;
        const double m = val[0], s = exp_sum(row, v, m);
        for (int i = 0; i < k; i++) p->probs[(int64_t)r * k + i] = exp((double)val[i] - m) / s;
    }
}

/* Rows r of x (row r at x + r * ld, v entries each): their top k (idx [rows, k]) and, where scored, those entries'
 * softmax probabilities (probs [rows, k]). 1 <= k <= min(v, MAX_K). Threads only where the rows hold a million
 * entries (below that a wake-up costs more than it saves). */
void row_top_k(int rows, int v, const float *x, int64_t ld, int k, int scored, int64_t *idx, double *probs,
               int threads) {
    TopK p = {rows, v, k, scored, x, ld, idx, probs};
    team_run((int64_t)rows * v >= (1 << 20) ? threads : 1, top_k_task, &p);
}
