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
#include <math.h>
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

/* ---- A whole decode step of llama-family decoder layers (engine/kernels/fused_layer.py) ----
 *
 * One token through `count` layers, each: RMSNorm, q/k/v products (+ biases), per-head q/k
 * RMSNorm (Qwen3, optional), rotary embedding from the model's own cos/sin, K/V written into
 * the cache at `length`, attention of the token over the length + 1 entries (grouped heads,
 * fp32 softmax), o product, residual; RMSNorm, SiLU(gate) * up, down product, residual. The
 * arithmetic is transformers' (LlamaDecoderLayer and its modules) in fp32; only the order of
 * the sums differs. One parallel region for the whole step: the products split their output
 * rows over the threads, attention its heads, and every thread computes the small parts between
 * them (norms, group sums) for itself, so a step starts the threads once and waits at five
 * barriers a layer (the general path starts them for each of ~210 products). */

typedef struct {
    const void *codes;    /* q8: int8 (n, k); q4: uint8 (n, k / 2) */
    const float *scales;  /* (n, k / group) */
    const float *mins;    /* (n, k / group) or NULL */
    const float *bias;    /* (n) or NULL */
    int64_t kind, n, k, group;  /* kind 8 or 4; group 16 or 32 where there are minimums */
} qm_linear;

typedef struct {
    qm_linear q, k, v, o, gate, up, down;
    const float *attn_norm, *mlp_norm;  /* (hidden) */
    const float *q_norm, *k_norm;       /* (head_dim) per-head norms, or NULL */
    float attn_eps, mlp_eps, q_eps, k_eps;
} qm_layer;

/* out = x * rsqrt(mean(x^2) + eps) * weight, as LlamaRMSNorm computes it in fp32. */
static void rms_norm(const float *x, const float *weight, float eps, int64_t n, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] * r) * weight[i];
}

/* Sums of x over each group of 16 and of 32 (the minimums' share of a row's product). */
static void group_sums(const float *x, int64_t n, float *s16, float *s32) {
    for (int64_t g = 0; g < n / 16; g++) {
        float t = 0.0f;
        for (int64_t k = g * 16; k < (g + 1) * 16; k++) t += x[k];
        s16[g] = t;
    }
    for (int64_t g = 0; g < n / 32; g++) {
        float t = 0.0f;
        for (int64_t k = g * 32; k < (g + 1) * 32; k++) t += x[k];
        s32[g] = t;
    }
}

/* Row r of w times x (+ bias). `tmp`: k floats of scratch (the plain C build decodes into it). */
static float row_product(const qm_linear *w, int64_t r, const float *x, const float *s16, const float *s32,
                         float *tmp) {
    int64_t groups = w->k / w->group;
    const float *sc = w->scales + r * groups, *mn = w->mins ? w->mins + r * groups : NULL;
    float y;
#ifdef QM_AVX2
    const float *xs = w->group == 16 ? s16 : s32;
    (void)tmp;
    if (w->kind == 4)
        y = row_q4(x, (const uint8_t *)w->codes + r * (w->k / 2), sc, mn, xs, w->k);
    else
        y = row_q8(x, (const int8_t *)w->codes + r * w->k, sc, mn, xs, w->k, w->group);
#else
    (void)s16, (void)s32;
    if (w->kind == 4)
        decode_q4((const uint8_t *)w->codes + r * (w->k / 2), sc, mn, w->k, tmp);
    else
        decode_q8((const int8_t *)w->codes + r * w->k, sc, mn, w->k, w->group, tmp);
    y = 0.0f;
    for (int64_t k = 0; k < w->k; k++) y += x[k] * tmp[k];
#endif
    return w->bias ? y + w->bias[r] : y;
}

static float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float out = 0.0f;
#ifdef QM_AVX2
    if (n % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        return hsum(acc);
    }
#endif
    for (; i < n; i++) out += a[i] * b[i];
    return out;
}

/* One head in place: the optional per-head RMSNorm, then the rotary embedding
 * x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]). */
static void norm_and_rotate(float *x, const float *norm, float eps, const float *cos, const float *sin, int64_t d,
                            float *tmp) {
    if (norm) rms_norm(x, norm, eps, d, x);
    int64_t h = d / 2;
    memcpy(tmp, x, sizeof(float) * (size_t)d);
    for (int64_t i = 0; i < h; i++) x[i] = tmp[i] * cos[i] + (-tmp[i + h]) * sin[i];
    for (int64_t i = h; i < d; i++) x[i] = tmp[i] * cos[i] + tmp[i - h] * sin[i];
}

/* Attention of one query head q (rotated) over a cache's `length` entries of its K/V head
 * and the new entry (k, v), which the cache does not need to hold yet. scores: length + 1. */
static void attend(const float *q, const float *keys, const float *values, const float *k, const float *v,
                   int64_t length, int64_t d, float scale, float *scores, float *out) {
    float top = -INFINITY, sum = 0.0f;
    for (int64_t j = 0; j <= length; j++) {
        scores[j] = dot(q, j < length ? keys + j * d : k, d) * scale;
        top = scores[j] > top ? scores[j] : top;
    }
    for (int64_t j = 0; j <= length; j++) sum += scores[j] = expf(scores[j] - top);
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t j = 0; j <= length; j++) {
        float p = scores[j] / sum;
        const float *vj = j < length ? values + j * d : v;
        for (int64_t i = 0; i < d; i++) out[i] += p * vj[i];
    }
}

/* x: the token's hidden state (hidden), updated in place through every layer. cos, sin:
 * (head_dim) for the token's position. keys[l], values[l]: layer l's cache buffers,
 * (kv_heads, capacity, head_dim), the new entry going to index `length`. Returns 0, or -1
 * when scratch memory could not be had.
 *
 * Five barriers a layer (after the q/k/v, attention, o, gate/up and down products): whatever
 * lies between two products (a norm, the group sums of a product's input) each thread computes
 * for itself, and each query head rotates its K/V head's new key itself. */
int qm_decode_layers(const qm_layer *layers, float *const *keys, float *const *values, int64_t count, int64_t hidden,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t capacity, int64_t length,
                     float scale, const float *cos, const float *sin, float *x, int threads) {
    int64_t D = head_dim, nq = heads * D, nkv = kv_heads * D, group_size = heads / kv_heads;
    int64_t inter = 0, widest = hidden > nq ? hidden : nq;
    for (int64_t l = 0; l < count; l++) inter = layers[l].gate.n > inter ? layers[l].gate.n : inter;
    widest = inter > widest ? inter : widest;
    if (threads < 1) threads = 1;
    /* shared: q, k, v | attention output | SiLU(gate) * up; per thread: scores, the normed
     * input, group sums of 16 and of 32, a decoded row or a head */
    size_t per_thread = (size_t)(length + 1) + 4 * (size_t)widest;
    size_t total = (size_t)(2 * nq + 2 * nkv + inter) + (size_t)threads * per_thread;
    float *buf = (float *)malloc(sizeof(float) * total);
    if (!buf) return -1;
    float *q = buf, *k = q + nq, *v = k + nkv, *attn = v + nkv, *act = attn + nq, *own = act + inter;

#pragma omp parallel num_threads(threads)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float *scores = own + (size_t)t * per_thread, *xn = scores + length + 1, *s16 = xn + widest;
        float *s32 = s16 + widest / 16 + 1, *tmp = s16 + widest;
        for (int64_t l = 0; l < count; l++) {
            const qm_layer *L = layers + l;
            float *lk = keys[l], *lv = values[l];
            rms_norm(x, L->attn_norm, L->attn_eps, hidden, xn);
            group_sums(xn, hidden, s16, s32);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < nq + 2 * nkv; r++) {
                if (r < nq)
                    q[r] = row_product(&L->q, r, xn, s16, s32, tmp);
                else if (r < nq + nkv)
                    k[r - nq] = row_product(&L->k, r - nq, xn, s16, s32, tmp);
                else
                    v[r - nq - nkv] = row_product(&L->v, r - nq - nkv, xn, s16, s32, tmp);
            }
#pragma omp for schedule(static)
            for (int64_t h = 0; h < heads; h++) {
                int64_t g = h / group_size;
                float *kh = xn, *vh = v + g * D;  /* xn is free until the next norm */
                memcpy(kh, k + g * D, sizeof(float) * (size_t)D);
                norm_and_rotate(kh, L->k_norm, L->k_eps, cos, sin, D, tmp);
                if (h % group_size == 0) {  /* the K/V head's first query head stores its entry */
                    memcpy(lk + (g * capacity + length) * D, kh, sizeof(float) * (size_t)D);
                    memcpy(lv + (g * capacity + length) * D, vh, sizeof(float) * (size_t)D);
                }
                norm_and_rotate(q + h * D, L->q_norm, L->q_eps, cos, sin, D, tmp);
                attend(q + h * D, lk + g * capacity * D, lv + g * capacity * D, kh, vh, length, D, scale,
                       scores, attn + h * D);
            }
            group_sums(attn, nq, s16, s32);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < hidden; r++) x[r] += row_product(&L->o, r, attn, s16, s32, tmp);
            rms_norm(x, L->mlp_norm, L->mlp_eps, hidden, xn);
            group_sums(xn, hidden, s16, s32);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < L->gate.n; r++) {
                float gate = row_product(&L->gate, r, xn, s16, s32, tmp);
                float up = row_product(&L->up, r, xn, s16, s32, tmp);
                act[r] = (gate / (1.0f + expf(-gate))) * up;
            }
            group_sums(act, L->gate.n, s16, s32);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < hidden; r++) x[r] += row_product(&L->down, r, act, s16, s32, tmp);
        }
    }
    free(buf);
    return 0;
}
