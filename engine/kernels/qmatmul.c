/* Matrix products with group-quantised weights, for SpecChat's CPU path (engine/kernels).
 *
 * y[i, n] = sum_j x[i, j] * w[n, j],  w[n, j] = scale[n, g] * code[n, j] (+ minimum[n, g]),
 * g = j / group: the values a GGUF block type stores (engine/offload/gguf_blocks.affine), kept
 * in 1 byte per weight (q8: int8 codes, groups of 16 or 32) or half a byte (q4: codes 0..15,
 * groups of 32, byte k of a group holding value k in its low nibble and value k + 16 in its
 * high nibble, as GGUF's Q4_0/Q4_1 blocks hold them).
 *
 * A decode step multiplies one row of activations by every weight of a layer, so its speed is
 * the speed at which weights are read: 1 or 0.5 bytes each here against 4 for fp32. The work is
 * split over output rows (OpenMP). Each thread decodes NB weight rows at a time into fp32
 * scratch (the exact values: scale * code + minimum, in fp32) and multiplies every activation
 * row by them, so a tree pass over M tokens decodes each weight once, not M times. Activations
 * stay fp32; only the order of the sums differs from a dense product.
 *
 * AVX2 + FMA where the compiler targets it, plain C otherwise (same results up to rounding).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QM_AVX2 1
#endif

#define NB 4 /* weight rows decoded together */

int qm_version(void) { return 1; }

int qm_simd(void) {
#ifdef QM_AVX2
    return 2;
#else
    return 0;
#endif
}

/* One weight row -> fp32 values. */
static void decode_q8(const int8_t *codes, const float *scales, const float *mins, int64_t K, int64_t group,
                      float *out) {
    int64_t groups = K / group;
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *c = codes + g * group;
        float *o = out + g * group;
        float s = scales[g], m = mins ? mins[g] : 0.0f;
#ifdef QM_AVX2
        if (group % 8 == 0) {
            __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
            for (int64_t k = 0; k < group; k += 8) {
                __m128i b = _mm_loadl_epi64((const __m128i *)(c + k));
                __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
                _mm256_storeu_ps(o + k, _mm256_fmadd_ps(v, vs, vm));
            }
            continue;
        }
#endif
        for (int64_t k = 0; k < group; k++) o[k] = s * (float)c[k] + m;
    }
}

static void decode_q4(const uint8_t *packed, const float *scales, const float *mins, int64_t K, float *out) {
    int64_t groups = K / 32;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = packed + g * 16;
        float *o = out + g * 32;
        float s = scales[g], m = mins ? mins[g] : 0.0f;
#ifdef QM_AVX2
        __m256 vs = _mm256_set1_ps(s), vm = _mm256_set1_ps(m);
        __m128i bytes = _mm_loadu_si128((const __m128i *)p);
        __m128i mask = _mm_set1_epi8(15);
        __m128i lo = _mm_and_si128(bytes, mask);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        __m256 v0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        __m256 v1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        __m256 v2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        __m256 v3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        _mm256_storeu_ps(o, _mm256_fmadd_ps(v0, vs, vm));
        _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(v1, vs, vm));
        _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(v2, vs, vm));
        _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(v3, vs, vm));
#else
        for (int k = 0; k < 16; k++) {
            o[k] = s * (float)(p[k] & 15) + m;
            o[k + 16] = s * (float)(p[k] >> 4) + m;
        }
#endif
    }
}

#ifdef QM_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

/* y[i, n0 + r] for r < rows (<= NB), from decoded weight rows w[r * K ..]: two activation
 * rows by four weight rows at a time (8 accumulators: 6 loads feed 8 FMAs). */
static void multiply(const float *x, int64_t M, int64_t K, const float *w, int rows, float *y, int64_t N, int64_t n0) {
    int64_t i = 0;
#ifdef QM_AVX2
    if (rows == NB && K % 8 == 0) {
        for (; i + 2 <= M; i += 2) {
            const float *x0 = x + i * K, *x1 = x0 + K;
            __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
            __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
            for (int64_t k = 0; k < K; k += 8) {
                __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k);
                __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k);
                a00 = _mm256_fmadd_ps(v0, w0, a00), a10 = _mm256_fmadd_ps(v1, w0, a10);
                a01 = _mm256_fmadd_ps(v0, w1, a01), a11 = _mm256_fmadd_ps(v1, w1, a11);
                __m256 w2 = _mm256_loadu_ps(w + 2 * K + k), w3 = _mm256_loadu_ps(w + 3 * K + k);
                a02 = _mm256_fmadd_ps(v0, w2, a02), a12 = _mm256_fmadd_ps(v1, w2, a12);
                a03 = _mm256_fmadd_ps(v0, w3, a03), a13 = _mm256_fmadd_ps(v1, w3, a13);
            }
            float *y0 = y + i * N + n0, *y1 = y0 + N;
            y0[0] = hsum(a00), y0[1] = hsum(a01), y0[2] = hsum(a02), y0[3] = hsum(a03);
            y1[0] = hsum(a10), y1[1] = hsum(a11), y1[2] = hsum(a12), y1[3] = hsum(a13);
        }
        for (; i < M; i++) {  /* the odd row: one activation row by four weight rows */
            const float *x0 = x + i * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k += 8) {
                __m256 v = _mm256_loadu_ps(x0 + k);
                a0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(w + k), a0);
                a1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(w + K + k), a1);
                a2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(w + 2 * K + k), a2);
                a3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(w + 3 * K + k), a3);
            }
            float *y0 = y + i * N + n0;
            y0[0] = hsum(a0), y0[1] = hsum(a1), y0[2] = hsum(a2), y0[3] = hsum(a3);
        }
    }
#endif
    for (; i < M; i++) {
        const float *xi = x + i * K;
        for (int r = 0; r < rows; r++) {
            const float *wr = w + r * K;
            float out = 0.0f;
            for (int64_t k = 0; k < K; k++) out += xi[k] * wr[k];
            y[i * N + n0 + r] = out;
        }
    }
}

#ifdef QM_AVX2
/* One activation row (M = 1, a decode step): codes are converted and multiplied in registers,
 * nothing is stored, so the step runs at the speed the codes are read. y[n] for one row n:
 * sum over groups of scale * (x . codes) + minimum * (sum of x over the group). */
static float row_q8(const float *x, const int8_t *c, const float *sc, const float *mn, const float *xsum, int64_t K,
                    int64_t group) {
    __m256 acc = _mm256_setzero_ps();
    float extra = 0.0f;
    for (int64_t g = 0, k = 0; k < K; g++) {
        __m256 d = _mm256_setzero_ps();
        for (int64_t e = k + group; k < e; k += 8) {
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + k))));
            d = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), v, d);
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[g]), d, acc);
        if (mn) extra += mn[g] * xsum[g];
    }
    return hsum(acc) + extra;
}

static float row_q4(const float *x, const uint8_t *p, const float *sc, const float *mn, const float *xsum, int64_t K) {
    __m256 acc = _mm256_setzero_ps();
    const __m128i mask = _mm_set1_epi8(15);
    float extra = 0.0f;
    for (int64_t g = 0; g < K / 32; g++) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(p + g * 16));
        __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        const float *xg = x + g * 32;
        __m256 d = _mm256_mul_ps(_mm256_loadu_ps(xg), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
        d = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d);
        d = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d);
        d = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(sc[g]), d, acc);
        if (mn) extra += mn[g] * xsum[g];
    }
    return hsum(acc) + extra;
}
#endif

/* Each thread's decoded-weight scratch, kept between calls and grown as needed. */
static _Thread_local float *scratch_buf = NULL;
static _Thread_local size_t scratch_len = 0;

static float *scratch(size_t n) {
    if (n > scratch_len) {
        float *grown = (float *)realloc(scratch_buf, n * sizeof(float));
        if (!grown) return NULL;
        scratch_buf = grown, scratch_len = n;
    }
    return scratch_buf;
}

/* kind 8: codes int8 (N x K), groups of `group`; kind 4: packed nibbles (N x K/2), groups of 32.
 * scales and mins: N x K/group fp32 (mins may be NULL). Returns 0, or -1 when scratch memory
 * could not be had. */
int qm_matmul(int kind, const float *x, int64_t M, int64_t K, const void *codes, const float *scales,
              const float *mins, int64_t N, int64_t group, float *y, int threads) {
    int64_t tiles = (N + NB - 1) / NB;
    int failed = 0;
    int64_t row_bytes = kind == 4 ? K / 2 : K;
    int64_t groups = K / group;
    if (threads < 1) threads = 1;
#ifdef QM_AVX2
    if (M == 1 && group % 8 == 0 && K % 8 == 0) {
        float *xsum = NULL;
        if (mins) {  /* the sum of x over each group, for the minimums */
            xsum = (float *)malloc(sizeof(float) * (size_t)groups);
            if (!xsum) return -1;
            for (int64_t g = 0; g < groups; g++) {
                float t = 0.0f;
                for (int64_t k = g * group; k < (g + 1) * group; k++) t += x[k];
                xsum[g] = t;
            }
        }
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *sc = scales + n * groups, *mn = mins ? mins + n * groups : NULL;
            y[n] = kind == 4 ? row_q4(x, (const uint8_t *)codes + n * row_bytes, sc, mn, xsum, K)
                             : row_q8(x, (const int8_t *)codes + n * row_bytes, sc, mn, xsum, K, group);
        }
        free(xsum);
        return 0;
    }
#endif
#pragma omp parallel num_threads(threads)
    {
        float *w = scratch((size_t)NB * (size_t)K);
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!w) continue;
            int64_t n0 = t * NB;
            int rows = (int)(N - n0 < NB ? N - n0 : NB);
            for (int r = 0; r < rows; r++) {
                int64_t n = n0 + r;
                const float *sc = scales + n * groups;
                const float *mn = mins ? mins + n * groups : NULL;
                if (kind == 4)
                    decode_q4((const uint8_t *)codes + n * row_bytes, sc, mn, K, w + r * K);
                else
                    decode_q8((const int8_t *)codes + n * row_bytes, sc, mn, K, group, w + r * K);
            }
            multiply(x, M, K, w, rows, y, N, n0);
        }
    }
    return failed ? -1 : 0;
}
