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
 * row by them, so a tree pass over M tokens decodes each weight once, not M times; with AVX-512,
 * from 5 tokens, 16 rows at a time against the tokens transposed (the panels, below). Activations
 * stay fp32; only the order of the sums differs from a dense product.
 *
 * AVX2 + FMA where the compiler targets it, plain C otherwise (same results up to rounding).
 * On CPUs with AVX-512 VNNI, decode steps and passes of up to QM_FEW tokens take integer rows
 * instead (qm_digits.h): activations as 22-bit integers, a product within a few 1e-7 of the sum of
 * its terms' sizes against about 1e-7 in fp32, four weight rows at a time (the starter's Q4_1
 * step, one thread: layers 18 -> 9 ms, its Q8_0 head 5.5 -> 2.7 ms against one row at a time).
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
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QM_AVX512 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(QM_NO_VNNI)
#define QM_VNNI 1 /* integer rows for decode steps and small passes (qm_digits.h) */
#endif
#endif
#if !defined(QM_AVX512) && defined(__AVXVNNI__) && defined(__F16C__) && !defined(QM_NO_VNNI)
#define QM_VNNI256 1 /* the same with AVX2 + AVX-VNNI */
#endif
#if defined(QM_VNNI) || defined(QM_VNNI256)
#define QM_INT 1
#endif
#endif

#define NB 4 /* weight rows decoded together */
#define QM_HALF 256 /* in a kind code: scales and minimums are fp16, not fp32 */
/* in a kind code: scales and minimums as K-quants store them, per 8 groups one fp16 factor and 8
 * int8 multipliers (10 bytes; a row's groups a multiple of 8): d * sc, exact in fp32, expanded
 * to fp32 as each row is read (row_params) */
#define QM_KSC 512
#define QM_FLAGS (QM_HALF | QM_KSC) /* stripped where the scales are read; QM_OFF8 stays in the kind */
/* In a q4 kind code: no minimums stored, each value scale * (code - 8), GGUF's Q4_0 (its file's
 * 0.5625 bytes a weight, not 0.625 with a minimum of -8 scale kept beside each scale). */
#define QM_OFF8 1024
/* In a q4 kind code: each code indexes MXFP4's E2M1 values doubled (QM_E2M1_VALUES, -12..12),
 * value = scale * that, no minimums: MXFP4 at its file's nibbles (0.5625 bytes a weight with an
 * fp16 scale; as six-bit codes it took 0.8125). The integer rows read code + 12 (0..24) through a
 * byte shuffle and take the offset's share back as QM_OFF8's -8 is. */
#define QM_E2M1 2048
/* In a q8 kind code: the codes are nibbles packed as q4's (K / 2 bytes a row, groups of 32), each
 * indexing IQ4_NL's table (QM_IQ4_VALUES, -127..113), the q8 code: GGUF's IQ4_NL and IQ4_XS at
 * their file's nibbles (0.5625 / 0.54 bytes a weight; as int8 codes 1.06 / 1.04). The integer rows
 * shuffle each nibble to its value + 128, the offset q8's codes are read at. */
#define QM_IQ4 4096
#define QM_KIND(k) ((k) & 15) /* 2, 3, 4, 6 or 8 */
static const int8_t QM_E2M1_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static const int8_t QM_IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* a q4 row's offset mode for the integer rows: 0 none, 1 QM_OFF8, 2 QM_E2M1 */
#define QM_Q4_MODE(k) (((k) & QM_E2M1) ? 2 : ((k) & QM_OFF8) ? 1 : 0)

/* Scales and minimums are fp32, or fp16 where every one of a weight's is exactly an fp16 (GGUF's
 * Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 store them so: a step then reads 0.625 bytes per Q4_1 weight,
 * not 0.75). */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 31)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man) { /* subnormal: normalise */
        exp = 113;
        while (!(man & 1024)) man <<= 1, exp--;
        bits = sign | (exp << 23) | ((man & 1023) << 13);
    } else
        bits = sign;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline float scale_at(const void *p, int64_t i, int half) {
    return half ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline const void *row_at(const void *p, int64_t i, int half) {
    return p ? (const void *)((const char *)p + i * (half ? 2 : 4)) : NULL;
}

/* How a kind code's scales and minimums are stored: 0 fp32, 1 fp16, 2 K-scales. */
static inline int params_fmt(int64_t kind) { return (kind & QM_KSC) ? 2 : (kind & QM_HALF) ? 1 : 0; }

/* The scales (or minimums) of `rows` weight rows from row r on, `groups` a row, as the row
 * kernels read them: a pointer into fp32 (fmt 0) or fp16 (fmt 1) ones, or K-scales (fmt 2)
 * expanded into buf (rows x groups fp32, the values d * sc). NULL stays NULL. */
static const void *row_params(const void *p, int64_t r, int64_t rows, int64_t groups, int fmt, float *buf) {
    if (!p) return NULL;
    if (fmt < 2) return row_at(p, r * groups, fmt);
    const unsigned char *b = (const unsigned char *)p + r * (groups / 8) * 10;
    for (int64_t i = 0; i < rows * groups; i += 8, b += 10) {
        uint16_t h;
        memcpy(&h, b, sizeof h);
        float d = half_to_float(h);
#ifdef QM_AVX2 /* the 8 multipliers at once: the expansion is ~1 % of a row's work, not ~20 % */
        int64_t m8;
        memcpy(&m8, b + 2, sizeof m8);
        __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(m8)));
        _mm256_storeu_ps(buf + i, _mm256_mul_ps(_mm256_set1_ps(d), m));
#else
        for (int j = 0; j < 8; j++) buf[i + j] = d * (float)(int8_t)b[2 + j];
#endif
    }
    return buf;
}

/* Floats of expansion scratch for `rows` rows of `groups` (one where nothing is expanded). */
#define PARAMS_BUF(fmt, rows, groups) ((fmt) == 2 ? (rows) * (groups) : 1)

int qm_version(void) { return 15; }

int qm_simd(void) { /* 0 plain C, 2 AVX2, 3 AVX-512, 4 AVX-512 VNNI, 5 AVX2 + AVX-VNNI */
#if defined(QM_VNNI)
    return 4;
#elif defined(QM_VNNI256)
    return 5;
#elif defined(QM_AVX512)
    return 3;
#elif defined(QM_AVX2)
    return 2;
#else
    return 0;
#endif
}

/* One weight row -> fp32 values. */
static void decode_q8(const int8_t *codes, const void *scales, const void *mins, int half, int64_t K, int64_t group,
                      float *out) {
    int64_t groups = K / group;
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *c = codes + g * group;
        float *o = out + g * group;
        float s = scale_at(scales, g, half), m = mins ? scale_at(mins, g, half) : 0.0f;
#ifdef QM_AVX512
        if (group % 16 == 0) {
            __m512 vs = _mm512_set1_ps(s), vm = _mm512_set1_ps(m);
            for (int64_t k = 0; k < group; k += 16) {
                __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + k))));
                _mm512_storeu_ps(o + k, _mm512_fmadd_ps(v, vs, vm));
            }
            continue;
        }
#endif
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

/* off8 (QM_OFF8): no minimums stored, each -8 scale. */
static void decode_q4(const uint8_t *packed, const void *scales, const void *mins, int half, int64_t K, float *out,
                      int off8) {
    int64_t groups = K / 32;
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *p = packed + g * 16;
        float *o = out + g * 32;
        float s = scale_at(scales, g, half), m = mins ? scale_at(mins, g, half) : off8 ? -8.0f * s : 0.0f;
#ifdef QM_AVX512 /* 16 lanes: half the instructions (the decoding is ~35-40 % of an 8-token pass) */
        __m512 vs = _mm512_set1_ps(s), vm = _mm512_set1_ps(m);
        __m128i bytes = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(15);
        __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vs, vm));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vs, vm));
#elif defined(QM_AVX2)
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

/* kind 6: Q6_K's six-bit codes kept in six bits, c = code + 32 (0 .. 63), 48 bytes per 64 values
 * (linear.pack6). Each whole 128 values: 64 bytes of low nibbles (byte j: value lo(j)'s, and in
 * its high nibble value hi(j)'s), then 32 bytes of the top two bits (byte j: bits 0-1 value
 * lo(j)'s, 2-3 lo(j + 32)'s, 4-5 hi(j)'s, 6-7 hi(j + 32)'s); groups of 32: lo(j) = j, hi(j) =
 * j + 64; groups of 16: lo(j) = 16 (j / 8) + j % 8, hi(j) = lo(j) + 8. A last 64 (K = 64 mod
 * 128): 32 bytes of low nibbles (value j, value j + 32), then 16 bytes of top bits (byte j: value
 * j + 16 i's). */
static void expand_q6(const uint8_t *p, int64_t K, int64_t group, int8_t *out) {
    int64_t at = 0;
#ifdef QM_AVX512 /* a whole 128 at once (the scalar loop below made a panel of six-bit rows 4x slower than the
                    integer rows over 8 tokens): the top bits broadcast to both halves, each half's fields shifted
                    down per 64-bit lane; groups of 16 interleave lo's and hi's 8-byte runs */
    const __m512i m4 = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3), off = _mm512_set1_epi8(32);
    const __m512i sh_lo = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2), sh_hi = _mm512_setr_epi64(4, 4, 4, 4, 6, 6, 6, 6);
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (; at + 128 <= K; at += 128, p += 96, out += 128) {
        __m512i b = _mm512_loadu_si512(p), t = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 64)));
        __m512i flo = _mm512_and_si512(_mm512_srlv_epi64(t, sh_lo), three);
        __m512i fhi = _mm512_and_si512(_mm512_srlv_epi64(t, sh_hi), three);
        __m512i lo = _mm512_sub_epi8(_mm512_or_si512(_mm512_and_si512(b, m4), _mm512_slli_epi16(flo, 4)), off);
        __m512i hi = _mm512_sub_epi8(
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), m4), _mm512_slli_epi16(fhi, 4)), off);
        if (group == 16) {
            __m512i a = _mm512_unpacklo_epi64(lo, hi), c = _mm512_unpackhi_epi64(lo, hi);
            lo = _mm512_permutex2var_epi64(a, first, c), hi = _mm512_permutex2var_epi64(a, second, c);
        }
        _mm512_storeu_si512(out, lo);
        _mm512_storeu_si512(out + 64, hi);
    }
#endif
    for (; at + 128 <= K; at += 128, p += 96, out += 128)
        for (int j = 0; j < 64; j++) {
            int top = p[64 + (j & 31)], lo = group == 16 ? 16 * (j >> 3) + (j & 7) : j;
            int hi = group == 16 ? lo + 8 : j + 64, field = 2 * (j >> 5); /* 0 or 2: hi's fields are 2 on */
            out[lo] = (int8_t)(((p[j] & 15) | (((top >> field) & 3) << 4)) - 32);
            out[hi] = (int8_t)(((p[j] >> 4) | (((top >> (field + 4)) & 3) << 4)) - 32);
        }
    if (at < K)
        for (int j = 0; j < 32; j++) {
            int top = p[32 + (j & 15)];
            out[j] = (int8_t)(((p[j] & 15) | (((top >> (2 * (j >> 4))) & 3) << 4)) - 32);
            out[j + 32] = (int8_t)(((p[j] >> 4) | (((top >> (2 * ((j >> 4) + 2))) & 3) << 4)) - 32);
        }
}

/* The signed codes of a row that is not kept as bytes (codes_row), in this thread's buffer. */
static _Thread_local int8_t *six_buf = NULL;
static _Thread_local size_t six_len = 0;

/* Kinds 2 and 3 (groups of 16, K a multiple of 128): per 128 values, 32 bytes of two-bit fields
 * in kind 6's top-bit layout (byte j, bits 2i and 2i + 1: the value at place j + 32 i of its
 * order, lo(0..63) then hi(0..63), lo(j) the first 8 values of group j / 8, hi(j) its last 8);
 * kind 3 then 16 bytes of third bits (bit m of the 128: the value at place m). Kind 2's codes are
 * the fields (0..3, with minimums: Q2_K), kind 3's the three bits less 4 (-4..3: Q3_K). */
static void expand_low(const uint8_t *p, int64_t K, int bits, int8_t *out) {
    int64_t per = bits == 2 ? 32 : 48;
    for (int64_t at = 0; at + 128 <= K; at += 128, p += per, out += 128)
        for (int m = 0; m < 128; m++) {
            int j = m & 63, v = 16 * (j >> 3) + (j & 7) + (m >= 64 ? 8 : 0);
            int c = (p[m & 31] >> (2 * (m >> 5))) & 3;
            out[v] = (int8_t)(bits == 2 ? c : c + (((p[32 + (m >> 3)] >> (m & 7)) & 1) << 2) - 4);
        }
}

/* A kind-6, kind-2 or kind-3 row as signed codes, in this thread's buffer (kept between calls,
 * grown as needed); a kind-8 row as it is. */
static const int8_t *codes_row(int64_t kind, const void *p, int64_t K, int64_t group) {
    int k = QM_KIND(kind);
    if (k == 8) return (const int8_t *)p;
    if ((size_t)K > six_len) {
        int8_t *grown = (int8_t *)realloc(six_buf, (size_t)K);
        if (!grown) abort(); /* K bytes: a machine without them cannot have loaded the model */
        six_buf = grown, six_len = (size_t)K;
    }
    if (k == 6)
        expand_q6((const uint8_t *)p, K, group, six_buf);
    else
        expand_low((const uint8_t *)p, K, k, six_buf);
    return six_buf;
}

/* A row of nibbles that index a table (QM_E2M1's, QM_IQ4's) as signed codes, in this thread's
 * buffer: the fp32 rows and the decoding read it as a kind-8 row in groups of 32. */
static _Thread_local int8_t *table_buf = NULL;
static _Thread_local size_t table_len = 0;
static const int8_t *table_row(const void *row, int64_t K, const int8_t *values) {
    if ((size_t)K > table_len) {
        int8_t *grown = (int8_t *)realloc(table_buf, (size_t)K);
        if (!grown) abort(); /* as codes_row */
        table_buf = grown, table_len = (size_t)K;
    }
    const uint8_t *p = (const uint8_t *)row;
#ifdef QM_AVX2 /* a group's 16 bytes at once, the table looked up by byte shuffles (the loop below made a panel
                  of MXFP4 rows slower than the integer rows) */
    const __m128i lut = _mm_loadu_si128((const __m128i *)values), m4 = _mm_set1_epi8(15);
    for (int64_t g = 0; g < K / 32; g++) {
        __m128i b = _mm_loadu_si128((const __m128i *)(p + g * 16));
        _mm_storeu_si128((__m128i *)(table_buf + g * 32), _mm_shuffle_epi8(lut, _mm_and_si128(b, m4)));
        _mm_storeu_si128((__m128i *)(table_buf + g * 32 + 16),
                         _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), m4)));
    }
    return table_buf;
#endif
    for (int64_t g = 0; g < K / 32; g++)
        for (int k = 0; k < 16; k++) {
            table_buf[g * 32 + k] = values[p[g * 16 + k] & 15];
            table_buf[g * 32 + k + 16] = values[p[g * 16 + k] >> 4];
        }
    return table_buf;
}
#define QM_TABLE(k) ((k) & QM_E2M1 ? QM_E2M1_VALUES : (k) & QM_IQ4 ? QM_IQ4_VALUES : NULL)

static inline int64_t row_bytes_of(int64_t kind, int64_t K) {
    return QM_KIND(kind) == 4 || (kind & QM_IQ4) ? K / 2 : QM_KIND(kind) == 6 ? K / 64 * 48
           : QM_KIND(kind) == 2 ? K / 4 : QM_KIND(kind) == 3 ? K / 8 * 3 : K;
}

/* One weight row of any kind -> fp32 values. */
static void decode_row(int64_t kind, const void *row, const void *sc, const void *mn, int half, int64_t K,
                       int64_t group, float *out) {
    if (QM_TABLE(kind))
        decode_q8(table_row(row, K, QM_TABLE(kind)), sc, NULL, half, K, 32, out);
    else if (QM_KIND(kind) == 4)
        decode_q4((const uint8_t *)row, sc, mn, half, K, out, (kind & QM_OFF8) != 0);
    else
        decode_q8(codes_row(kind, row, K, group), sc, mn, half, K, group, out);
}

#include "qm_attend.h" /* hsum, dot, attend_group, heads_together, heads_in_part */

/* y[i, n0 + r] for r < rows (<= NB), from decoded weight rows w[r * K ..]: two activation
 * rows by four weight rows at a time (8 accumulators: 6 loads feed 8 FMAs). */
static void multiply(const float *x, int64_t M, int64_t K, const float *w, int rows, float *y, int64_t N, int64_t n0) {
    int64_t i = 0;
#ifdef QM_AVX512
    if (rows == NB && K % 16 == 0) {  /* four activation rows by four weight rows: 16 accumulators */
        const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
        for (; i + 4 <= M; i += 4) {
            const float *x0 = x + i * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
            __m512 a[4][4];
            for (int p = 0; p < 4; p++)
                for (int r = 0; r < 4; r++) a[p][r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 16) {
                __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k);
                __m512 v2 = _mm512_loadu_ps(w2 + k), v3 = _mm512_loadu_ps(w3 + k);
                __m512 u;
                u = _mm512_loadu_ps(x0 + k);
                a[0][0] = _mm512_fmadd_ps(u, v0, a[0][0]), a[0][1] = _mm512_fmadd_ps(u, v1, a[0][1]);
                a[0][2] = _mm512_fmadd_ps(u, v2, a[0][2]), a[0][3] = _mm512_fmadd_ps(u, v3, a[0][3]);
                u = _mm512_loadu_ps(x1 + k);
                a[1][0] = _mm512_fmadd_ps(u, v0, a[1][0]), a[1][1] = _mm512_fmadd_ps(u, v1, a[1][1]);
                a[1][2] = _mm512_fmadd_ps(u, v2, a[1][2]), a[1][3] = _mm512_fmadd_ps(u, v3, a[1][3]);
                u = _mm512_loadu_ps(x2 + k);
                a[2][0] = _mm512_fmadd_ps(u, v0, a[2][0]), a[2][1] = _mm512_fmadd_ps(u, v1, a[2][1]);
                a[2][2] = _mm512_fmadd_ps(u, v2, a[2][2]), a[2][3] = _mm512_fmadd_ps(u, v3, a[2][3]);
                u = _mm512_loadu_ps(x3 + k);
                a[3][0] = _mm512_fmadd_ps(u, v0, a[3][0]), a[3][1] = _mm512_fmadd_ps(u, v1, a[3][1]);
                a[3][2] = _mm512_fmadd_ps(u, v2, a[3][2]), a[3][3] = _mm512_fmadd_ps(u, v3, a[3][3]);
            }
            for (int p = 0; p < 4; p++) {
                float *yp = y + (i + p) * N + n0;
                for (int r = 0; r < 4; r++) yp[r] = _mm512_reduce_add_ps(a[p][r]);
            }
        }
        for (; i < M; i++) {  /* the rows left over: one activation row by four weight rows */
            const float *x0 = x + i * K;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k += 16) {
                __m512 u = _mm512_loadu_ps(x0 + k);
                a0 = _mm512_fmadd_ps(u, _mm512_loadu_ps(w0 + k), a0);
                a1 = _mm512_fmadd_ps(u, _mm512_loadu_ps(w1 + k), a1);
                a2 = _mm512_fmadd_ps(u, _mm512_loadu_ps(w2 + k), a2);
                a3 = _mm512_fmadd_ps(u, _mm512_loadu_ps(w3 + k), a3);
            }
            float *y0 = y + i * N + n0;
            y0[0] = _mm512_reduce_add_ps(a0), y0[1] = _mm512_reduce_add_ps(a1);
            y0[2] = _mm512_reduce_add_ps(a2), y0[3] = _mm512_reduce_add_ps(a3);
        }
    }
#endif
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

/* ---- Products over several tokens: panels (AVX-512) ----
 *
 * From QM_PANEL_MIN tokens, a product takes QM_PANEL weight rows at a time, decoded to fp32 as the
 * tiles decode them, and holds the tokens transposed: per block of QM_TB tokens, k-major, 16 tokens
 * a vector (transpose_tokens). Each decoded weight value is broadcast once and multiplies up to
 * 48 tokens, and each token vector multiplies QM_KR rows: 24 accumulators, no horizontal sums,
 * and the tokens' values are read once for 16 rows, not for 4 as the tiles read them. Each output
 * is the sum of its products in k order, in fp32. Measured, a 2048 x 2048 q4 weight, 2 threads
 * (AMD EPYC, Zen 4), GMAC/s for 16 / 64 / 128 / 256 tokens: tiles 54 / 58 / 58 / 58, panels in a C
 * harness over the same decoding 61 / 81 / 86 / 92 (torch's fp32 GEMM on the de-quantised weight
 * 41 / 71 / 84 / 92). A block of up to 8 tokens (a pass of 5-8, or a product's last block) takes
 * 256-bit vectors, all 16 rows at once: 5 / 8 / 12 / 15 tokens 38 / 63 / 64 / 77 GMAC/s against the
 * tiles' 37 / 39 / 48 / 47 (same weight). 1-4 tokens keep the integer rows where the CPU has them. */
#ifdef QM_AVX512
#define QM_PANEL 16     /* weight rows decoded together */
#define QM_PANEL_MIN 5  /* tokens from which a product takes the panels (below: the integer rows, or the tiles) */
/* The same for a routed expert's tokens in a pass (routed_pass). Below it the integer rows, ceil(c / 4) calls over
 * the expert's rows, measured faster: an expert of 1536 x 2048 (Q4_K, Q4_0), panels / integer rows time at
 * 5 / 8 / 9 / 12 / 16 tokens 1.3 / 0.85 / 1.1 / 0.85 / 0.65. Whole prefills of the synthetic MoEs (the routing
 * is uneven: most pairs are in experts of 9+ tokens at 32): from 13, Q4_0's 32-token chunk lost 8 % (192 tokens:
 * +17 %); from 17 none lost (Q4_0 +8 %, Q4_K_M +45 % at 192). */
#define QM_EXPERT_PANEL_MIN 17
#define QM_KR 8         /* rows a kernel call multiplies */
#define QM_TB 48        /* tokens a block holds (three vectors) */
#define QM_PAD 16       /* a decoded row's stride is K + QM_PAD floats: rows 2^k floats apart share L1 sets */

/* A block of cnt tokens' row width in xt: 8 (one 256-bit vector) up to 8 tokens, else 16 a vector. */
static inline int64_t panel_width(int64_t cnt) { return cnt <= 8 ? 8 : (cnt + 15) / 16 * 16; }

/* Floats of transposed blocks for n tokens of k values. */
static size_t panel_input_floats(int64_t n, int64_t k) { return (size_t)((n + QM_TB - 1) / QM_TB) * QM_TB * (size_t)k; }

/* Floats of c tokens of k values in blocks (transpose_tokens), the last block only as wide as its
 * tokens need: an expert's share of a routed pass's transposed inputs. */
static size_t panel_floats(int64_t c, int64_t k) {
    int64_t full = (c - 1) / QM_TB;
    return (size_t)(full * QM_TB + panel_width(c - full * QM_TB)) * (size_t)k;
}

/* Columns k0 .. k1 - 1 of one block of cnt tokens (rows[i]) into d, the block (k, width): the
 * lanes past its tokens zero. */
static void transpose_slice(const float *const *rows, int64_t cnt, int64_t k0, int64_t k1, float *d) {
    int64_t width = panel_width(cnt);
    for (int64_t j = k0; j < k1; j++)
        for (int64_t i = cnt; i < width; i++) d[j * width + i] = 0.0f;
    for (int64_t i = 0; i < cnt; i++) {
        const float *xi = rows[i];
        for (int64_t j = k0; j < k1; j++) d[j * width + i] = xi[j];
    }
}

/* x (n, k) -> xt: block b (tokens b * QM_TB ..) at xt + b * QM_TB * k as (k, Z * 16), Z its vectors
 * (its tokens / 16 rounded up), the lanes past its tokens zero. Called by every thread of a
 * region: a worksharing loop, so every thread waits for the whole of xt. */
static void transpose_tokens(const float *x, int64_t n, int64_t k, float *xt) {
    int64_t blocks = (n + QM_TB - 1) / QM_TB, slices = (k + 255) / 256;
#pragma omp for schedule(static)
    for (int64_t s = 0; s < blocks * slices; s++) {
        int64_t b = s / slices, k0 = (s % slices) * 256, k1 = k0 + 256 < k ? k0 + 256 : k;
        int64_t t0 = b * QM_TB, cnt = n - t0 < QM_TB ? n - t0 : QM_TB;
        const float *rows[QM_TB];
        for (int64_t i = 0; i < cnt; i++) rows[i] = x + (t0 + i) * k;
        transpose_slice(rows, cnt, k0, k1, xt + b * QM_TB * k);
    }
}

/* y[t * N + r] (t < tokens, r < rows) = the sum over k of xt's token t times w[r * ws + k]; xt one
 * block, (K, Z * 16). w holds QM_KR rows (those past `rows` are read, not written out). Always
 * inlined: each Z gets its own code, its accumulators in registers. */
static inline __attribute__((always_inline)) void panel_kernel(const float *xt, int64_t K, const float *w, int64_t ws,
                                                               float *y, int64_t N, int64_t tokens, int rows,
                                                               const int Z) {
    __m512 a[QM_KR][3];
    for (int r = 0; r < QM_KR; r++)
        for (int z = 0; z < Z; z++) a[r][z] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 u[3];
        for (int z = 0; z < Z; z++) u[z] = _mm512_loadu_ps(xt + k * Z * 16 + z * 16);
        for (int r = 0; r < QM_KR; r++) {
            __m512 b = _mm512_set1_ps(w[r * ws + k]);
            for (int z = 0; z < Z; z++) a[r][z] = _mm512_fmadd_ps(u[z], b, a[r][z]);
        }
    }
    float lanes[16];
    for (int r = 0; r < rows; r++)
        for (int z = 0; z < Z; z++) {
            _mm512_storeu_ps(lanes, a[r][z]);
            for (int64_t j = 0; j < 16 && z * 16 + j < tokens; j++) y[(z * 16 + j) * N + r] = lanes[j];
        }
}

/* panel_kernel for a block of up to 8 tokens (xt rows 8 wide): 256-bit vectors, all QM_PANEL rows
 * at once (16 accumulators). */
static void panel_kernel8(const float *xt, int64_t K, const float *w, int64_t ws, float *y, int64_t N, int64_t tokens,
                          int rows) {
    __m256 a[QM_PANEL];
    for (int r = 0; r < QM_PANEL; r++) a[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 u = _mm256_loadu_ps(xt + k * 8);
        for (int r = 0; r < QM_PANEL; r++) a[r] = _mm256_fmadd_ps(u, _mm256_set1_ps(w[r * ws + k]), a[r]);
    }
    float lanes[8];
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(lanes, a[r]);
        for (int64_t j = 0; j < tokens; j++) y[j * N + r] = lanes[j];
    }
}

/* y[i * N + r] (i < n, r < rows <= QM_PANEL) from decoded rows w (stride ws) and the tokens'
 * transposed blocks xt (transpose_tokens). */
static void panel_rows(const float *xt, int64_t n, int64_t K, const float *w, int64_t ws, int rows, float *y,
                       int64_t N) {
    for (int64_t t0 = 0; t0 < n; t0 += QM_TB) {
        int64_t cnt = n - t0 < QM_TB ? n - t0 : QM_TB;
        const float *xb = xt + t0 * K;
        if (cnt <= 8) { /* a block of up to 8 tokens (a small pass, or a last block) */
            panel_kernel8(xb, K, w, ws, y + t0 * N, N, cnt, rows);
            continue;
        }
        for (int h = 0; h < rows; h += QM_KR) {
            int r = rows - h < QM_KR ? rows - h : QM_KR;
            float *yy = y + t0 * N + h;
            if (cnt > 32)
                panel_kernel(xb, K, w + h * ws, ws, yy, N, cnt, r, 3);
            else if (cnt > 16)
                panel_kernel(xb, K, w + h * ws, ws, yy, N, cnt, r, 2);
            else
                panel_kernel(xb, K, w + h * ws, ws, yy, N, cnt, r, 1);
        }
    }
}

/* Rows n0 .. n0 + rows - 1 of a weight decoded to fp32 at w (stride K + QM_PAD); the rows up to
 * QM_PANEL after them zero (a kernel reads QM_KR rows at a time). */
static void decode_panel(int64_t kind, int fmt, const char *codes, const void *scales, const void *mins, int64_t n0,
                         int rows, int64_t K, int64_t group, float *w) {
    int64_t groups = K / group, rb = row_bytes_of(kind, K), ws = K + QM_PAD;
    int half = fmt == 1;
    for (int r = 0; r < rows; r++) {
        float sb[PARAMS_BUF(fmt, 1, groups)], mb[PARAMS_BUF(fmt, 1, groups)];
        const void *sc = row_params(scales, n0 + r, 1, groups, fmt, sb);
        const void *mn = row_params(mins, n0 + r, 1, groups, fmt, mb);
        decode_row(kind, codes + (n0 + r) * rb, sc, mn, half, K, group, w + r * ws);
    }
    for (int r = rows; r < QM_PANEL; r++) memset(w + r * ws, 0, sizeof(float) * (size_t)K);
}
#else
#define QM_PANEL 4
#define QM_PAD 0
#endif

#ifdef QM_AVX2
/* One activation row (M = 1, a decode step): codes are converted and multiplied in registers,
 * nothing is stored, so the step runs at the speed the codes are read. y[n] for one row n:
 * sum over groups of scale * (x . codes) + minimum * (sum of x over the group). */
/* The scales of groups g .. g + n - 1 (n <= 8) as fp32: a pointer into fp32 scales, or `out`
 * filled from fp16 ones (8 at a time: one conversion, not one a group, which cost a compute-bound
 * row 20-30 %); their minimums' share of the row's product (minimum times the group sum of x) is
 * added to *ext, 8 lanes of partial sums. */
static inline const float *scale_block(const void *sc, const void *mn, int half, const float *xsum, int64_t g,
                                       int64_t n, float *out, __m256 *ext) {
    if (n == 8 && !half) {
        if (mn) *ext = _mm256_fmadd_ps(_mm256_loadu_ps((const float *)mn + g), _mm256_loadu_ps(xsum + g), *ext);
        return (const float *)sc + g;
    }
#if defined(__F16C__)
    if (n == 8) {
        _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)sc + g))));
        if (mn)
            *ext = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)mn + g))),
                                   _mm256_loadu_ps(xsum + g), *ext);
        return out;
    }
#endif
    float tail = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        out[j] = scale_at(sc, g + j, half);
        if (mn) tail += scale_at(mn, g + j, half) * xsum[g + j];
    }
    *ext = _mm256_add_ps(*ext, _mm256_setr_ps(tail, 0, 0, 0, 0, 0, 0, 0));
    return out;
}

static float row_q8(const float *x, const int8_t *c, const void *sc, const void *mn, int half, const float *xsum,
                    int64_t K, int64_t group) {
    __m256 acc = _mm256_setzero_ps(), ext = _mm256_setzero_ps();
    float s8[8];
    int64_t groups = K / group;
    for (int64_t g = 0, k = 0; g < groups;) {
        int64_t n = groups - g < 8 ? groups - g : 8;
        const float *s = scale_block(sc, mn, half, xsum, g, n, s8, &ext);
        for (int64_t j = 0; j < n; j++, g++) {
            __m256 d = _mm256_setzero_ps();
            for (int64_t e = k + group; k < e; k += 8) {
                __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + k))));
                d = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), v, d);
            }
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(s + j), d, acc);
        }
    }
    return hsum(acc) + hsum(ext);
}

#ifdef QM_AVX512
/* row_q8 with 16 lanes (groups of 16 or 32: one or two vectors of codes); two accumulators
 * (even and odd groups) so consecutive groups do not wait on each other. A Q8_0 step: 17.8 -> 14.0 ms on a
 * starter-shaped model (AVX-512 machine, /work/notes/step_bench.py). */
static float row_q8_512(const float *x, const int8_t *c, const void *sc, const void *mn, int half, const float *xsum,
                        int64_t K, int64_t group) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 ext = _mm256_setzero_ps();
    float s8[8];
    int64_t groups = K / group;
    for (int64_t g = 0; g < groups;) {
        int64_t n = groups - g < 8 ? groups - g : 8;
        const float *s = scale_block(sc, mn, half, xsum, g, n, s8, &ext);
        for (int64_t j = 0; j < n; j++, g++) {
            const int8_t *cg = c + g * group;
            const float *xg = x + g * group;
            __m512 d = _mm512_mul_ps(_mm512_loadu_ps(xg),
                                     _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)cg))));
            for (int64_t k = 16; k < group; k += 16)
                d = _mm512_fmadd_ps(_mm512_loadu_ps(xg + k),
                                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(cg + k)))), d);
            acc[g & 1] = _mm512_fmadd_ps(_mm512_set1_ps(s[j]), d, acc[g & 1]);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + hsum(ext);
}

#define ROW_Q8(x, c, sc, mn, half, xs, K, group) \
    ((group) % 16 == 0 ? row_q8_512(x, c, sc, mn, half, xs, K, group) : row_q8(x, c, sc, mn, half, xs, K, group))
#else
#define ROW_Q8 row_q8
#endif
#define ROW_Q4 row_q4 /* 16 lanes measured slower for nibbles: the conversions, not the FMAs, set its pace */

static float row_q4(const float *x, const uint8_t *p, const void *sc, const void *mn, int half, const float *xsum,
                    int64_t K) {
    __m256 acc = _mm256_setzero_ps(), ext = _mm256_setzero_ps();
    const __m128i mask = _mm_set1_epi8(15);
    float s8[8];
    int64_t groups = K / 32;
    for (int64_t g = 0; g < groups;) {
        int64_t n = groups - g < 8 ? groups - g : 8;
        const float *s = scale_block(sc, mn, half, xsum, g, n, s8, &ext);
        for (int64_t j = 0; j < n; j++, g++) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(p + g * 16));
            __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
            const float *xg = x + g * 32;
            __m256 d = _mm256_mul_ps(_mm256_loadu_ps(xg), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
            d = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 8), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d);
            d = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 16), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d);
            d = _mm256_fmadd_ps(_mm256_loadu_ps(xg + 24), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d);
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(s + j), d, acc);
        }
    }
    return hsum(acc) + hsum(ext);
}

/* One row of any kind times x through the fp32 rows. */
static float row_fp32(int64_t kind, const float *x, const void *row, const void *sc, const void *mn, int half,
                      const float *xsum, int64_t K, int64_t group) {
    if (QM_TABLE(kind)) return ROW_Q8(x, table_row(row, K, QM_TABLE(kind)), sc, NULL, half, xsum, K, 32);
    if ((kind & QM_OFF8) && QM_KIND(kind) == 4) { /* as decode_row: the minimums -8 scale in fp32 */
        float s2[K / 32 + 1], m2[K / 32 + 1];
        for (int64_t g = 0; g < K / 32; g++) s2[g] = scale_at(sc, g, half), m2[g] = -8.0f * s2[g];
        return ROW_Q4(x, (const uint8_t *)row, s2, m2, 0, xsum, K);
    }
    if (QM_KIND(kind) == 4) return ROW_Q4(x, (const uint8_t *)row, sc, mn, half, xsum, K);
    return ROW_Q8(x, codes_row(kind, row, K, group), sc, mn, half, xsum, K, group);
}
#endif
#include "qm_digits.h"
_Static_assert(NB == QM_ROWS, "a small pass's tile of NB rows goes through the integer rows as one block");

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

static int matmul_few(int kind, const float *x, int64_t M, int64_t K, const void *codes, const void *scales,
                      const void *mins, int64_t N, int64_t group, float *y, int threads);

/* kind 8: codes int8 (N x K), groups of `group`; kind 4: packed nibbles (N x K/2), groups of 32;
 * kind 6: six-bit codes (N x K/64*48, expand_q6), groups of 16 or 32; any + QM_HALF: scales and minimums in fp16, or + QM_KSC: as K-quants (row_params). scales and mins: N x K/group (mins may be NULL). Returns 0, or -1 when scratch memory
 * could not be had. */
int qm_matmul(int kind, const float *x, int64_t M, int64_t K, const void *codes, const void *scales,
              const void *mins, int64_t N, int64_t group, float *y, int threads) {
    int fmt = params_fmt(kind), half = fmt == 1;
    int flags = kind & QM_FLAGS;
    kind &= ~QM_FLAGS;
    int64_t tiles = (N + NB - 1) / NB;
    int failed = 0;
    int64_t row_bytes = row_bytes_of(kind, K);
    int64_t groups = K / group;
    if (threads < 1) threads = 1;
    if (M > 1 && M <= QM_FEW) { /* a few tokens (an MoE expert's share of a tree): the integer rows, once */
        int done = matmul_few(kind | flags, x, M, K, codes, scales, mins, N, group, y, threads);
        if (done) return done < 0 ? -1 : 0;
    }
#ifdef QM_AVX2
    if (M == 1 && group % 8 == 0 && K % 8 == 0) {
        float *xsum = NULL;
        if (mins || (kind & QM_OFF8)) {  /* the sum of x over each group, for the minimums */
            xsum = (float *)malloc(sizeof(float) * (size_t)groups);
            if (!xsum) return -1;
            for (int64_t g = 0; g < groups; g++) {
                float t = 0.0f;
                for (int64_t k = g * group; k < (g + 1) * group; k++) t += x[k];
                xsum[g] = t;
            }
        }
        qm_digits dg;
        char *mem = (char *)malloc(digits_bytes(K) + 1);
        if (!mem) {
            free(xsum);
            return -1;
        }
        make_digits(x, K, mem, &dg);
        int done = 0;
#ifdef QM_INT
        if (takes_digits(&dg, kind, K, group)) {
            done = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t b = 0; b < (N + QM_ROWS - 1) / QM_ROWS; b++) {
                int64_t n = b * QM_ROWS;
                int rows = (int)(N - n < QM_ROWS ? N - n : QM_ROWS);
                const float *xs = xsum;
                float sb[PARAMS_BUF(fmt, QM_ROWS, groups)], mb[PARAMS_BUF(fmt, QM_ROWS, groups)];
                rows_vnni(&dg, &xs, 1, kind, (const char *)codes + n * row_bytes, row_bytes,
                          row_params(scales, n, rows, groups, fmt, sb), row_params(mins, n, rows, groups, fmt, mb),
                          groups, half, K, group, rows, y + n, 1);
            }
        }
#endif
        if (!done) {
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int64_t n = 0; n < N; n++) {
                float sb[PARAMS_BUF(fmt, 1, groups)], mb[PARAMS_BUF(fmt, 1, groups)];
                const void *sc = row_params(scales, n, 1, groups, fmt, sb), *mn = row_params(mins, n, 1, groups, fmt, mb);
                y[n] = row_fp32(kind, x, (const char *)codes + n * row_bytes, sc, mn, half, xsum, K, group);
            }
        }
        free(mem);
        free(xsum);
        return 0;
    }
#endif
#ifdef QM_AVX512
    if (M >= QM_PANEL_MIN) { /* many tokens: the panels */
        float *xt = (float *)malloc(sizeof(float) * panel_input_floats(M, K));
        if (!xt) return -1;
        int64_t panels = (N + QM_PANEL - 1) / QM_PANEL;
#pragma omp parallel num_threads(threads)
        {
            float *w = scratch((size_t)QM_PANEL * (size_t)(K + QM_PAD));
            if (!w) {
#pragma omp atomic write
                failed = 1;
            }
            transpose_tokens(x, M, K, xt);
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                if (!w) continue;
                int64_t n0 = p * QM_PANEL;
                int rows = (int)(N - n0 < QM_PANEL ? N - n0 : QM_PANEL);
                decode_panel(kind, fmt, (const char *)codes, scales, mins, n0, rows, K, group, w);
                panel_rows(xt, M, K, w, K + QM_PAD, rows, y + n0, N);
            }
        }
        free(xt);
        return failed ? -1 : 0;
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
                float sb[PARAMS_BUF(fmt, 1, groups)], mb[PARAMS_BUF(fmt, 1, groups)];
                const void *sc = row_params(scales, n, 1, groups, fmt, sb), *mn = row_params(mins, n, 1, groups, fmt, mb);
                decode_row(kind, (const char *)codes + n * row_bytes, sc, mn, half, K, group, w + r * K);
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
 * the cache at `length`, attention of the token over the length + 1 entries or a sliding
 * window's (grouped heads, fp32 softmax, gpt-oss's sinks), o product (+ bias), residual;
 * RMSNorm, SiLU(gate) * up, down product, residual (or an MoE layer's router and routed
 * experts). The arithmetic is transformers' (LlamaDecoderLayer and its modules) in fp32; only
 * the order of the sums differs. One parallel region for the whole step: the products split their output
 * rows over the threads, attention its heads, and every thread computes the small parts between
 * them (norms, group sums) for itself, so a step starts the threads once and waits at five
 * barriers a layer (the general path starts them for each of ~210 products). */

typedef struct {
    const void *codes;    /* q8: int8 (n, k); q4: uint8 (n, k / 2); q6: uint8 (n, k / 64 * 48) */
    const void *scales;   /* (n, k / group), fp32, or fp16 where kind has QM_HALF, or K-scales (QM_KSC) */
    const void *mins;     /* (n, k / group) or NULL, the same type */
    const float *bias;    /* (n) or NULL */
    int64_t kind, n, k, group;  /* kind 8, 6 or 4 (+ QM_HALF or QM_KSC); group 16 or 32 where there are minimums */
} qm_linear;

/* An experts module's gate where it is not SiLU(gate) * up without biases: gpt-oss's (engine.model.
 * gpt_oss_experts.RowExperts): biases (E x 2I, E x H fp32) added to gate_up's and down's outputs,
 * gate = min(g, limit), up = clamp(u, -limit, limit), act = (up + 1) * gate * sigmoid(alpha * gate),
 * gate and up the halves of gate_up's outputs or (interleaved) its even and odd ones; or, with
 * gelu (Gemma 4's), GELU (tanh) of gate times up, without biases (both NULL). */
typedef struct {
    const float *gate_up_bias, *down_bias;
    float alpha, limit;
    int interleaved, gelu;
} qm_gate;

typedef struct {
    qm_linear q, k, v, o, gate, up, down;
    const float *attn_norm, *mlp_norm;  /* (hidden) */
    const float *q_norm, *k_norm;       /* (head_dim) per-head norms, or NULL */
    float attn_eps, mlp_eps, q_eps, k_eps;
    /* an MoE layer (experts > 0; gate/up/down unused): the router's fp32 weight (experts x hidden),
     * each expert's gate_up (2I x hidden) and down (hidden x I), top_k routed a token, their
     * probabilities renormalised to sum 1 where norm_topk; routed tokens counted into hits (experts) */
    const float *router;
    const qm_linear *expert_gate_up, *expert_down;
    int64_t *hits;
    int64_t experts, top_k, norm_topk;
    /* gpt-oss: attention sinks (heads: a logit per head that takes its share of the softmax and
     * adds nothing), the router's bias (experts), its order (topk_softmax: the top_k logits, then a
     * softmax over them), the experts' gate (NULL: SiLU(gate) * up) */
    const float *sinks, *router_bias;
    const qm_gate *expert_gate;
    int64_t topk_softmax;
    /* Gemma 3: the norms of the attention's and the MLP's outputs before each residual add (NULL:
     * none; mlp_norm is then its pre-feedforward norm), and the MLP's gate: 0 SiLU, 1 GELU (tanh) */
    const float *post_attn_norm, *post_mlp_norm;
    float post_attn_eps, post_mlp_eps;
    int64_t act;
    /* GLM-4.5: rotary on a head's first rotary_dim values (0: all); its router (sigmoid_router):
     * sigmoid scores, the top_k of scores + score_bias, weighted by their scores (renormalised
     * where norm_topk) times routed_scale; a shared expert in gate/up/down beside the routed ones */
    int64_t rotary_dim, sigmoid_router;
    const float *score_bias;
    float routed_scale;
    /* Qwen3.5: gated attention (attn_gate: q's rows are, per head, its query then its gate; the
     * head's output is multiplied by sigmoid(gate)); an MoE layer's shared expert (gate/up/down)
     * scaled by sigmoid(shared_gate . x) (NULL: unscaled) */
    int64_t attn_gate;
    const float *shared_gate;
    /* A Gated DeltaNet layer (Qwen3.5: lin_vh > 0; q/k/v unused, o its out_proj): in_proj_qkv
     * (conv_dim rows: the q, k and v channels) and in_proj_z (lin_vh x lin_dv rows) packed; b's
     * and a's fp32 rows (2 lin_vh x hidden: b's, then a's); the depthwise causal conv (conv_dim x
     * kernel, and its bias or NULL); -exp(A_log) and dt_bias (lin_vh); the gated norm's weight
     * (lin_dv) and eps. Value head h reads key head h / (lin_vh / lin_kh), or, where lin_tiled (the
     * heads in llama.cpp's order), h % lin_kh. */
    qm_linear lin_qkv, lin_z;
    const float *lin_ba, *conv_w, *conv_b, *neg_a, *dt_bias, *gnorm;
    float gnorm_eps;
    int64_t lin_kh, lin_vh, lin_dk, lin_dv, kernel, lin_tiled;
    /* Gemma 4: the layer's head width and K/V heads where they differ from the call's (0: the
     * call's); kv_same: no v rows, a head's values are its keys' projection (before k_norm and
     * the rotation); v_norm: values RMS-normed without a weight (v_eps); rope_width: the rotary
     * tables' row width where wider than the rotated values (0: the rotated width); layer_scale:
     * the hidden state's factor after the layer (0: none). Its MoE block beside the MLP (where
     * pre_experts_norm): the router reads the residual RMS-normed without a weight (router_eps),
     * times router_scale (hidden) times router_root, each routed weight then times
     * expert_scale[e]; the experts read the residual normed by pre_experts_norm; the MLP's output
     * normed by post_mlp1_norm plus the experts' normed by post_experts_norm, that sum normed by
     * post_mlp_norm, is added to the residual. */
    int64_t layer_head_dim, layer_kv_heads, kv_same, v_norm, rope_width;
    float v_eps, layer_scale, router_root, router_eps, pre_experts_eps, post_experts_eps, post_mlp1_eps;
    const float *router_scale, *expert_scale, *pre_experts_norm, *post_experts_norm, *post_mlp1_norm;
    /* Gemma 4's small models: kv_reuse, a layer with no K/V of its own (its view's buffers are an
     * earlier layer's, written earlier in the same call); a per-layer input (ple_dim > 0): after
     * the MLP, x += ple_norm(ple_proj (GELU(ple_gate x) * the token's input for this layer)), the
     * inputs the call's `ple` (tokens x ple_stride floats: this layer's ple_dim at l * ple_dim,
     * l counted from the call's first layer), ple_proj packed (ple_out, where n > 0) or fp32 rows
     * (hidden x ple_dim). */
    int64_t kv_reuse, ple_dim, ple_stride;
    qm_linear ple_gate, ple_out;
    const float *ple_proj, *ple_norm;
    float ple_eps;
} qm_layer;

/* A layer's head width, K/V heads and query heads per K/V head (the call's where it names none). */
static inline int64_t dim_of(const qm_layer *L, int64_t call) { return L->layer_head_dim ? L->layer_head_dim : call; }
static inline int64_t kvh_of(const qm_layer *L, int64_t call) { return L->layer_kv_heads ? L->layer_kv_heads : call; }

/* The widest head, most K/V heads and most query heads per K/V head of the layers. */
static void head_widths(const qm_layer *layers, int64_t count, int64_t heads, int64_t kv_heads, int64_t head_dim,
                        int64_t *D, int64_t *KV, int64_t *G) {
    *D = head_dim, *KV = kv_heads, *G = heads / kv_heads;
    for (int64_t l = 0; l < count; l++) {
        int64_t d = dim_of(layers + l, head_dim), kv = kvh_of(layers + l, kv_heads);
        *D = d > *D ? d : *D, *KV = kv > *KV ? kv : *KV, *G = heads / kv > *G ? heads / kv : *G;
    }
}

/* Where a layer's K/V live: buffers (kv_heads, capacity, head_dim), and window: -1 for a layer
 * that holds every entry (buffer column j is entry j), else which of the call's windows (spans)
 * its layers hold from: their column 0 is entry base, and a query reads the columns from lo on
 * (engine.model.window_cache). */
typedef struct {
    float *keys, *values;
    int64_t capacity, window;
    int64_t rope; /* which of the call's rotary tables the layer reads (Gemma 3: local or global) */
    /* a Gated DeltaNet layer's state, updated in place by a step: the conv's last kernel - 1
     * inputs per channel (conv_dim x (kernel - 1), oldest first) and the recurrent state
     * (lin_vh x lin_dk x lin_dv); and where a pass reads a tree, what it hands back per node for
     * the cache to keep until the accepted path is known (engine.model.linear_state.NodeInputs),
     * the state left as it was: pend_x the pre-conv inputs (n x conv_dim), pend_mix the conv's
     * outputs (n x conv_dim), pend_bg each value head's beta, then g (n x 2 lin_vh) */
    float *conv, *rec;
    float *pend_x, *pend_mix, *pend_bg;
} qm_view;

/* Layer l's columns: base (the entry of column 0) and lo (the first a decode step reads). */
static inline void span_of(const qm_view *v, const int64_t *spans, int64_t *base, int64_t *lo) {
    *base = v->window < 0 ? 0 : spans[2 * v->window];
    *lo = v->window < 0 ? 0 : spans[2 * v->window + 1];
}

/* out = x * rsqrt(mean(x^2) + eps) * weight, as LlamaRMSNorm computes it in fp32. */
static void rms_norm(const float *x, const float *weight, float eps, int64_t n, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] * r) * weight[i];
}

/* 1 / rms(y) as rms_norm takes it. */
static float rms_scale(const float *y, float eps, int64_t n) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += y[i] * y[i];
    return 1.0f / sqrtf(ss / (float)n + eps);
}

/* out = x * rsqrt(mean(x^2) + eps): an RMSNorm without a weight (Gemma 4's values and router). */
static void rms_plain(const float *x, float eps, int64_t n, float *out) {
    float r = rms_scale(x, eps, n);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r;
}

/* x[i] += y[i] for i in [a, b), or, with a norm (Gemma 3's post-norms), its rms_norm of all of
 * y (r = rms_scale(y)): x[i] += (y[i] * r) * norm[i]. */
static inline void add_out(float *x, const float *y, const float *norm, float r, int64_t a, int64_t b) {
    if (norm)
        for (int64_t i = a; i < b; i++) x[i] += (y[i] * r) * norm[i];
    else
        for (int64_t i = a; i < b; i++) x[i] += y[i];
}

/* x += w times `in` (its group sums s16/s32 and digits dg) times mul (1, or Qwen3.5's shared
 * expert's gate), or, with a norm (Gemma 3's
 * post-norms), x += that product rms-normed: the whole product first into `out` (w->n + a
 * block), its scale taken by every thread alike, then added. Called by every thread of a
 * parallel region (orphaned loops: two barriers, three with a norm). */
static void residual_product(const qm_linear *w, const float *in, const float *s16, const float *s32,
                             const qm_digits *dg, float *tmp, const float *norm, float eps, float *out, float *x,
                             float mul);

/* e^x, branch-free so that loops of it vectorise (libm's expf does not): x clamped to [-87.3,
 * 88.3] (the result's exponent stays normal; a gate's e^-g only ever feeds 1 / (1 + e^-g)), x = n
 * ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, Cody-Waite), e^r by Cephes' polynomial, 2^n
 * through the exponent bits: within 1.33 ulp of exp over that range. The scalar twin of
 * qm_attend.h's exp8 (the same polynomial), for loops the compiler vectorises in every build. */
static inline float qm_expf(float x) {
    x = x < -87.3f ? -87.3f : x > 88.3f ? 88.3f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two = {.i = ((int32_t)n + 127) << 23};
    return p * two.f;
}

/* The MLP's gate of g times up: SiLU (act 0), g / (1 + e^-g), or GELU with tanh (act 1,
 * gelu_pytorch_tanh), 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), computed as
 * g / (1 + e^-2u) (the same function: 1 + tanh(u) = 2 / (1 + e^-2u)), so both are one branch-free
 * form that vectorises. */
static inline float gated(float g, float up, int64_t act) {
    float z = act == 1 ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
    return (g / (1.0f + qm_expf(-z))) * up;
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

/* Row r of w times x (+ bias), through the fp32 rows. `tmp`: k floats of scratch (the plain C
 * build decodes into it). */
static float row_product(const qm_linear *w, int64_t r, const float *x, const float *s16, const float *s32,
                         float *tmp) {
    int64_t groups = w->k / w->group, kind = w->kind & ~QM_FLAGS;
    int fmt = params_fmt(w->kind), half = fmt == 1;
    float sb[PARAMS_BUF(fmt, 1, groups)], mb[PARAMS_BUF(fmt, 1, groups)];
    const void *sc = row_params(w->scales, r, 1, groups, fmt, sb), *mn = row_params(w->mins, r, 1, groups, fmt, mb);
    float y;
#ifdef QM_AVX2
    const float *xs = w->group == 16 ? s16 : s32;
    (void)tmp;
    y = row_fp32(kind, x, (const char *)w->codes + r * row_bytes_of(kind, w->k), sc, mn, half, xs, w->k, w->group);
#else
    (void)s16, (void)s32;
    decode_row(kind, (const char *)w->codes + r * row_bytes_of(kind, w->k), sc, mn, half, w->k, w->group, tmp);
    y = 0.0f;
    for (int64_t k = 0; k < w->k; k++) y += x[k] * tmp[k];
#endif
    return w->bias ? y + w->bias[r] : y;
}

/* Rows r .. r + rows - 1 (rows <= QM_ROWS) of w times x (+ bias) into out: the integer rows
 * where x was made digits, else one fp32 row at a time. */
static void rows_product(const qm_linear *w, int64_t r, int64_t rows, const float *x, const float *s16,
                         const float *s32, const qm_digits *dg, float *tmp, float *out) {
    if (rows > QM_ROWS) rows = QM_ROWS;
#ifdef QM_INT
    int64_t kind = w->kind & ~QM_FLAGS;
    if (takes_digits(dg, kind, w->k, w->group)) {
        int64_t groups = w->k / w->group, rb = row_bytes_of(kind, w->k);
        int fmt = params_fmt(w->kind), half = fmt == 1;
        const float *xs = w->group == 16 ? s16 : s32;
        float sb[PARAMS_BUF(fmt, QM_ROWS, groups)], mb[PARAMS_BUF(fmt, QM_ROWS, groups)];
        rows_vnni(dg, &xs, 1, kind, (const char *)w->codes + r * rb, rb, row_params(w->scales, r, rows, groups, fmt, sb),
                  row_params(w->mins, r, rows, groups, fmt, mb), groups, half, w->k, w->group, (int)rows, out, 1);
        if (w->bias)
            for (int64_t i = 0; i < rows; i++) out[i] += w->bias[r + i];
        return;
    }
#else
    (void)dg;
#endif
    for (int64_t i = 0; i < rows; i++) out[i] = row_product(w, r + i, x, s16, s32, tmp);
}

static void residual_product(const qm_linear *w, const float *in, const float *s16, const float *s32,
                             const qm_digits *dg, float *tmp, const float *norm, float eps, float *out, float *x,
                             float mul) {
    int64_t n = w->n;
    if (norm) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r += QM_ROWS) rows_product(w, r, n - r, in, s16, s32, dg, tmp, out + r);
        float rs = rms_scale(out, eps, n);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n; r += QM_ROWS) add_out(x, out, norm, rs, r, r + QM_ROWS < n ? r + QM_ROWS : n);
        return;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n; r += QM_ROWS) {
        float o[QM_ROWS];
        rows_product(w, r, n - r, in, s16, s32, dg, tmp, o);
        if (mul == 1.0f)
            for (int64_t i = 0; i < QM_ROWS && r + i < n; i++) x[r + i] += o[i];
        else
            for (int64_t i = 0; i < QM_ROWS && r + i < n; i++) x[r + i] += mul * o[i];
    }
}

/* One head in place: the optional per-head RMSNorm, then the rotary embedding of its first rd
 * values (the rest pass: GLM-4.5's partial rotary), x * cos + rotate_half(x) * sin,
 * rotate_half(x) = (-x[rd/2:rd], x[:rd/2]); cos, sin: rd wide. */
static void norm_and_rotate(float *x, const float *norm, float eps, const float *cos, const float *sin, int64_t d,
                            int64_t rd, float *tmp) {
    if (norm) rms_norm(x, norm, eps, d, x);
    int64_t h = rd / 2;
    memcpy(tmp, x, sizeof(float) * (size_t)rd);
    for (int64_t i = 0; i < h; i++) x[i] = tmp[i] * cos[i] + (-tmp[i + h]) * sin[i];
    for (int64_t i = h; i < rd; i++) x[i] = tmp[i] * cos[i] + tmp[i - h] * sin[i];
}

/* Gemma 4's MoE block, one token: sv = post_mlp1_norm(mlp) + post_experts_norm(experts) (every
 * thread its own copy); returns 1 / rms(sv) for block_add. */
static float block_sum(const float *mlp, const float *experts, const qm_layer *L, int64_t H, float *sv) {
    float r1 = rms_scale(mlp, L->post_mlp1_eps, H), r2 = rms_scale(experts, L->post_experts_eps, H);
    for (int64_t i = 0; i < H; i++) sv[i] = (mlp[i] * r1) * L->post_mlp1_norm[i] + (experts[i] * r2) * L->post_experts_norm[i];
    return rms_scale(sv, L->post_mlp_eps, H);
}

/* x += post_mlp_norm(sv) over rows [a, b); r: block_sum's. */
static inline void block_add(float *x, const float *sv, const qm_layer *L, float r, int64_t a, int64_t b) {
    for (int64_t i = a; i < b; i++) x[i] = x[i] + (sv[i] * r) * L->post_mlp_norm[i];
}

/* Gemma 4's per-layer input, one token (every thread): pg (ple_dim) = GELU(ple_gate x) * input,
 * then out (hidden) = ple_proj pg, then x += ple_norm(out). s16, s32, mine, dg: the calling
 * thread's scratch for x's sums and digits; tmp a row. */
static void ple_token(const qm_layer *L, float *x, int64_t H, const float *input, float *pg, float *out, float *s16,
                      float *s32, char *mine, qm_digits *dg, float *tmp) {
    int64_t P = L->ple_dim;
    group_sums(x, H, s16, s32);
    make_digits(x, H, mine, dg);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < P; r += QM_ROWS) {
        float g[QM_ROWS];
        rows_product(&L->ple_gate, r, P - r, x, s16, s32, dg, tmp, g);
        for (int64_t i = 0; i < QM_ROWS && r + i < P; i++) pg[r + i] = gated(g[i], input[r + i], 1);
    }
    if (L->ple_out.n) { /* the projection packed: its rows, normed, added */
        group_sums(pg, P, s16, s32);
        make_digits(pg, P, mine, dg);
        residual_product(&L->ple_out, pg, s16, s32, dg, tmp, L->ple_norm, L->ple_eps, out, x, 1.0f);
        return;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < H; r++) out[r] = dot(L->ple_proj + r * P, pg, P);
    float rs = rms_scale(out, L->ple_eps, H);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < H; r += QM_ROWS) add_out(x, out, L->ple_norm, rs, r, r + QM_ROWS < H ? r + QM_ROWS : H);
}

/* x: the token's hidden state (hidden), updated in place through every layer. cos, sin:
 * (head_dim) for the token's position. views[l]: layer l's cache buffers, the new entry (entry
 * `length`) going to column length - base, the token reading its columns from lo on; spans:
 * (base, lo) for each window (NULL where no layer has one). Returns 0, or -1 when scratch memory
 * could not be had.
 *
 * Five barriers a layer (after the q/k/v, attention, o, gate/up and down products): whatever
 * lies between two products (a norm, the group sums of a product's input) each thread computes
 * for itself, and each query head rotates its K/V head's new key itself. */
/* An expert's activation a (I) from its gate/up outputs g (2I): SiLU(gate) * up where gate is
 * NULL, GELU (tanh) of gate times up where gate->gelu, else gpt-oss's gate on them plus expert
 * e's gate_up bias. */
static void activate(const float *g, int64_t I, const qm_gate *gate, int64_t e, float *a) {
    if (gate == NULL || gate->gelu) {
        for (int64_t i = 0; i < I; i++) a[i] = gated(g[i], g[I + i], gate != NULL);
        return;
    }
    const float *b = gate->gate_up_bias + e * 2 * I;
    for (int64_t i = 0; i < I; i++) {
        int64_t gi = gate->interleaved ? 2 * i : i, ui = gate->interleaved ? 2 * i + 1 : I + i;
        float gt = g[gi] + b[gi], up = g[ui] + b[ui];
        gt = gt > gate->limit ? gate->limit : gt;
        up = up > gate->limit ? gate->limit : up < -gate->limit ? -gate->limit : up;
        a[i] = (up + 1.0f) * (gt / (1.0f + expf(-gate->alpha * gt)));
    }
}

static void experts_region(const qm_linear *gate_up, const qm_linear *down, const int64_t *ids, const float *w,
                           int64_t k, const float *x, const float *xs16, const float *xs32, const qm_digits *xd,
                           float *gu, float *act, float *asum, char *dig, size_t dig_bytes, qm_digits *ad,
                           float *tmp, float *y, int acc_into, const qm_gate *gate);
static void route_one(const qm_layer *L, const float *logits, int64_t *ids, float *w, int64_t *hits);

/* The dense layers' widest MLP (inter) and the MoE layers' most experts, top_k and expert width. */
static void widths(const qm_layer *layers, int64_t count, int64_t *inter, int64_t *E, int64_t *K, int64_t *I) {
    for (int64_t l = 0; l < count; l++) {
        const qm_layer *L = layers + l;
        if (L->experts > 0) {
            *E = L->experts > *E ? L->experts : *E, *K = L->top_k > *K ? L->top_k : *K;
            *I = L->expert_down[0].k > *I ? L->expert_down[0].k : *I;
        }
        *inter = L->gate.n > *inter ? L->gate.n : *inter; /* a dense MLP, or an MoE layer's shared expert */
    }
}

/* The widest Gated DeltaNet layer: its conv channels, value width and value heads. */
static void linear_widths(const qm_layer *layers, int64_t count, int64_t *C, int64_t *VD, int64_t *VH) {
    for (int64_t l = 0; l < count; l++) {
        const qm_layer *L = layers + l;
        if (L->lin_vh > 0) {
            *C = L->lin_qkv.n > *C ? L->lin_qkv.n : *C, *VD = L->lin_z.n > *VD ? L->lin_z.n : *VD;
            *VH = L->lin_vh > *VH ? L->lin_vh : *VH;
        }
    }
}

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* x * rsqrt(sum(x^2) + 1e-6) in place: the Gated DeltaNet's q/k norm (transformers' l2norm). */
static void l2_normalise(float *x, int64_t n, float mul) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) x[i] = (x[i] * r) * mul;
}

/* The delta rule for one value head and one token: S_out = d S_in + k u^T with u = beta (v -
 * d S_in^T k), d = exp(g) (S_out may be S_in: updated in place), and, with q, o = S_out^T q.
 * k normalised; u: dv floats of scratch. The step, the tree pass and the replay of an accepted
 * path (qm_delta_replay) all run it, so a path replayed gives the states the pass gave. */
static void delta_rule(const float *S_in, float *S_out, const float *k, const float *v, float decay, float beta,
                       const float *q, float *o, float *u, int64_t dk, int64_t dv) {
    for (int64_t j = 0; j < dv; j++) u[j] = 0.0f;
    for (int64_t r = 0; r < dk; r++) {
        const float *row = S_in + r * dv;
        float kr = k[r];
        for (int64_t j = 0; j < dv; j++) u[j] += row[j] * kr;
    }
    for (int64_t j = 0; j < dv; j++) u[j] = (v[j] - u[j] * decay) * beta;
    if (q)
        for (int64_t j = 0; j < dv; j++) o[j] = 0.0f;
    for (int64_t r = 0; r < dk; r++) {
        const float *row = S_in + r * dv;
        float *out = S_out + r * dv, kr = k[r];
        if (!q) {
            for (int64_t j = 0; j < dv; j++) out[j] = row[j] * decay + kr * u[j];
            continue;
        }
        float qr = q[r];
        for (int64_t j = 0; j < dv; j++) {
            out[j] = row[j] * decay + kr * u[j];
            o[j] += out[j] * qr;
        }
    }
}

/* Value head h's key head: grouped (transformers' order) or tiled (llama.cpp's). */
static inline int64_t key_head_of(int64_t h, int64_t vh, int64_t kh, int tiled) { return tiled ? h % kh : h / (vh / kh); }

/* One token through value head h of a Gated DeltaNet layer: its key head's q and k from the
 * conv's outputs `mix` l2-normalised (q times dk^-1/2), g = -exp(A_log) * softplus(a + dt_bias)
 * and beta = sigmoid(b) from `ba` (b's, then a's, per value head), the delta rule from S_in to
 * S_out, o = S_out^T q gated-normed with z (RMSNorm * weight * SiLU(z)). bg (or NULL): beta
 * and g kept at h and lin_vh + h. tmp: 2 dk + dv floats. */
static void delta_head(const qm_layer *L, int64_t h, const float *mix, const float *ba, const float *z,
                       const float *S_in, float *S_out, float *tmp, float *o, float *bg) {
    int64_t vh = L->lin_vh, dk = L->lin_dk, dv = L->lin_dv, kd = L->lin_kh * dk;
    int64_t kh = key_head_of(h, vh, L->lin_kh, L->lin_tiled);
    float *q = tmp, *k = tmp + dk, *u = tmp + 2 * dk;
    const float *v = mix + 2 * kd + h * dv, *zh = z + h * dv;
    memcpy(q, mix + kh * dk, sizeof(float) * (size_t)dk);
    memcpy(k, mix + kd + kh * dk, sizeof(float) * (size_t)dk);
    l2_normalise(q, dk, 1.0f / sqrtf((float)dk));
    l2_normalise(k, dk, 1.0f);
    float a = ba[vh + h] + L->dt_bias[h];
    float g = L->neg_a[h] * (a > 20.0f ? a : log1pf(expf(a))), beta = sigmoidf(ba[h]);
    if (bg) bg[h] = beta, bg[vh + h] = g;
    delta_rule(S_in, S_out, k, v, expf(g), beta, q, o, u, dk, dv);
    float rs = rms_scale(o, L->gnorm_eps, dv);
    for (int64_t j = 0; j < dv; j++) o[j] = ((o[j] * rs) * L->gnorm[j]) * (zh[j] * sigmoidf(zh[j]));
}

/* A Gated DeltaNet layer's recurrent state `rec` (vh, dk, dv) advanced in place along an
 * accepted path of L nodes, one at a time, from the inputs a pass kept for them (HybridCache.keep,
 * through engine/model/linear_attention.advance): k (L, kh, dk) post-conv, not normalised, v
 * (L, vh, dv), beta and g (L, vh). The same delta rule as the pass, so the states are the ones it
 * computed for those nodes; the block form in PyTorch costs ~1 ms a layer for a path of a few
 * tokens on 2 cores (its solves and per-operation overhead), this ~0.05 ms. Returns 0, or -1
 * without scratch memory. */
int qm_delta_replay(float *rec, int64_t vh, int64_t kh, int64_t dk, int64_t dv, int tiled, int64_t L,
                    const float *k, const float *v, const float *beta, const float *g, int threads) {
    if (threads < 1) threads = 1;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(threads * (dk + dv)));
    if (!scratch) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < vh; h++) {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float *kn = scratch + (size_t)t * (size_t)(dk + dv), *u = kn + dk, *S = rec + h * dk * dv;
        int64_t key = key_head_of(h, vh, kh, tiled);
        for (int64_t j = 0; j < L; j++) {
            memcpy(kn, k + (j * kh + key) * dk, sizeof(float) * (size_t)dk);
            l2_normalise(kn, dk, 1.0f);
            delta_rule(S, S, kn, v + (j * vh + h) * dv, expf(g[j * vh + h]), beta[j * vh + h], NULL, NULL, u, dk, dv);
        }
    }
    free(scratch);
    return 0;
}

/* One token through a Gated DeltaNet layer's mixer (engine/model/linear_attention.py computes
 * the same for trees), called by every thread of a parallel region (three barriers): xn's
 * products (qkv into raw, z, and b's and a's rows into ba); the causal conv of each channel over
 * its state and the new input, then SiLU (raw becomes the conv's output; the state shifts); per
 * value head h, with its key head's q and k l2-normalised (q times dk^-1/2), g = -exp(A_log) *
 * softplus(a + dt_bias), beta = sigmoid(b): S = exp(g) S, delta = beta (v - S^T k), S += k
 * delta^T, o = S^T q, then the gated RMSNorm o * rms * weight * SiLU(z) into core (lin_vh x
 * lin_dv). tmp: 2 lin_dk + lin_dv floats of the thread's own. */
static void delta_mix(const qm_layer *L, const qm_view *V, const float *xn, int64_t hidden, const float *s16,
                      const float *s32, const qm_digits *dg, float *tmp, float *raw, float *z, float *ba,
                      float *core) {
    const qm_linear *qkv = &L->lin_qkv, *zl = &L->lin_z;
    int64_t C = qkv->n, VD = zl->n, vh = L->lin_vh, dk = L->lin_dk, dv = L->lin_dv;
    int64_t b1 = (C + QM_ROWS - 1) / QM_ROWS, b2 = (VD + QM_ROWS - 1) / QM_ROWS, K = L->kernel;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < b1 + b2 + 2 * vh; b++) {
        if (b < b1)
            rows_product(qkv, b * QM_ROWS, C - b * QM_ROWS, xn, s16, s32, dg, tmp, raw + b * QM_ROWS);
        else if (b < b1 + b2)
            rows_product(zl, (b - b1) * QM_ROWS, VD - (b - b1) * QM_ROWS, xn, s16, s32, dg, tmp, z + (b - b1) * QM_ROWS);
        else
            ba[b - b1 - b2] = dot(L->lin_ba + (b - b1 - b2) * hidden, xn, hidden);
    }
#pragma omp for schedule(static)
    for (int64_t c = 0; c < C; c++) {
        float *st = V->conv + c * (K - 1);
        const float *w = L->conv_w + c * K;
        float y = L->conv_b ? L->conv_b[c] : 0.0f;
        for (int64_t j = 0; j < K - 1; j++) y += w[j] * st[j];
        y += w[K - 1] * raw[c];
        for (int64_t j = 0; j + 1 < K - 1; j++) st[j] = st[j + 1];
        if (K > 1) st[K - 2] = raw[c];
        raw[c] = y * sigmoidf(y);
    }
#pragma omp for schedule(static)
    for (int64_t h = 0; h < vh; h++) {
        float *S = V->rec + h * dk * dv;
        delta_head(L, h, raw, ba, z, S, S, tmp, core + h * dv, NULL);
    }
}

/* A tree pass through a Gated DeltaNet layer's mixer (called by every thread; the products
 * done: V->pend_x holds each node's pre-conv inputs, z and ba its z and b/a rows): each node's
 * conv over its path (chains[i]: the nodes before it, oldest first, kernel - 1 of them, -1 - j
 * the committed state's j-th newest input), then per value head the delta rule from its parent's
 * state (the committed one for a root) into states (n x dk x dv per thread: `st`), the output
 * gated-normed into core. The committed state is left as it was. */
static void delta_tree(const qm_layer *L, const qm_view *V, int64_t n, const int64_t *parents, const int64_t *chains,
                       int64_t chain_len, const float *z, const float *ba, float *st, float *tmp, float *core) {
    int64_t C = L->lin_qkv.n, VD = L->lin_z.n, vh = L->lin_vh, dk = L->lin_dk, dv = L->lin_dv;
    int64_t K = L->kernel;
    const float *raw = V->pend_x;
    float *mix = V->pend_mix, *bg = V->pend_bg;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < C; c++) {
        const float *w = L->conv_w + c * K, *state = V->conv + c * (K - 1);
        for (int64_t i = 0; i < n; i++) {
            const int64_t *before = chains + i * chain_len + chain_len - (K - 1);
            float y = L->conv_b ? L->conv_b[c] : 0.0f;
            for (int64_t j = 0; j < K - 1; j++)
                y += w[j] * (before[j] >= 0 ? raw[before[j] * C + c] : state[K - 1 + before[j]]);
            y += w[K - 1] * raw[i * C + c];
            mix[i * C + c] = y * sigmoidf(y);
        }
    }
#pragma omp for schedule(static)
    for (int64_t h = 0; h < vh; h++)
        for (int64_t i = 0; i < n; i++) {
            const float *S = parents[i] < 0 ? V->rec + h * dk * dv : st + parents[i] * dk * dv;
            delta_head(L, h, mix + i * C, ba + i * 2 * vh, z + i * VD, S, st + i * dk * dv, tmp, core + i * VD + h * dv,
                       bg + i * 2 * vh);
        }
}

/* A chain of committed text through a Gated DeltaNet layer's mixer (a prompt's chunk; called by
 * every thread; the products done: V->pend_x holds each token's pre-conv inputs, z and ba its z
 * and b/a rows): each channel's causal conv over its state and the chunk, the state then holding
 * the chunk's last kernel - 1 inputs; per value head the delta rule token after token on the
 * committed state, in place, each output gated-normed into core. The sums run in the order of n
 * steps (delta_mix), so the states and outputs are those n steps give from the same products.
 * tmp: 2 lin_dk + lin_dv floats of the thread's own. */
static void delta_chain(const qm_layer *L, const qm_view *V, int64_t n, const float *z, const float *ba, float *tmp,
                        float *core) {
    int64_t C = L->lin_qkv.n, VD = L->lin_z.n, vh = L->lin_vh, dk = L->lin_dk, dv = L->lin_dv, K = L->kernel;
    const float *raw = V->pend_x;
    float *mix = V->pend_mix;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < C; c++) {
        float *st = V->conv + c * (K - 1);
        const float *w = L->conv_w + c * K;
        for (int64_t i = 0; i < n; i++) {
            float y = L->conv_b ? L->conv_b[c] : 0.0f;
            for (int64_t j = 0; j < K - 1; j++) { /* the input K - 1 - j places back: the chunk's, or the state's */
                int64_t at = i - (K - 1) + j;
                y += w[j] * (at >= 0 ? raw[at * C + c] : st[K - 1 + at]);
            }
            y += w[K - 1] * raw[i * C + c];
            mix[i * C + c] = y * sigmoidf(y);
        }
        for (int64_t j = 0; j < K - 1; j++) { /* oldest first; a kept entry is read from a later slot */
            int64_t at = n - (K - 1) + j;
            st[j] = at >= 0 ? raw[at * C + c] : st[K - 1 + at];
        }
    }
#pragma omp for schedule(static)
    for (int64_t h = 0; h < vh; h++) {
        float *S = V->rec + h * dk * dv;
        for (int64_t i = 0; i < n; i++)
            delta_head(L, h, mix + i * C, ba + i * 2 * vh, z + i * VD, S, S, tmp, core + i * VD + h * dv, NULL);
    }
}

int qm_decode_layers(const qm_layer *layers, const qm_view *views, int64_t count, int64_t hidden, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, int64_t length, const int64_t *spans, float scale,
                     const float *cos, const float *sin, float *x, const float *ple, int threads) {
    int64_t DM, KVM, GM; /* the widest head, most K/V heads, most query heads per K/V head */
    head_widths(layers, count, heads, kv_heads, head_dim, &DM, &KVM, &GM);
    int64_t nq = heads * DM, nkv = KVM * DM, gemma4 = 0;
    for (int64_t l = 0; l < count; l++) gemma4 |= layers[l].pre_experts_norm != NULL;
    int64_t inter = 0, widest = hidden > nq ? hidden : nq;
    int64_t E = 0, K = 0, I = 0; /* the MoE layers' most experts, top_k and expert width */
    int64_t LC = 0, LV = 0, LH = 0; /* the Gated DeltaNet layers' widest conv, values and value heads */
    widths(layers, count, &inter, &E, &K, &I);
    linear_widths(layers, count, &LC, &LV, &LH);
    widest = inter > widest ? inter : widest;
    widest = I > widest ? I : widest;
    widest = LV > widest ? LV : widest;
    for (int64_t l = 0; l < count; l++) /* a Gated DeltaNet head's scratch (2 dk + dv) */
        if (layers[l].lin_vh > 0 && 2 * layers[l].lin_dk + layers[l].lin_dv > widest)
            widest = 2 * layers[l].lin_dk + layers[l].lin_dv;
    if (threads < 1) threads = 1;
    /* shared: q, k, v | attention output | SiLU(gate) * up | an MoE layer's router logits, routed
     * weights (+ E of scratch), gate/up outputs, activations and their group sums; per thread:
     * scores, the normed input, group sums of 16 and of 32, a decoded row or a head */
    int64_t sums = I / 16 + I / 32 + 2;
    size_t moe = (size_t)(E + K + E + K * 3 * I + K * sums);
    /* (Gemma 4's MoE block: per thread the router's and the experts' inputs and the outputs' sum) */
    size_t per_thread = (size_t)GM * (size_t)(length + 2) + 4 * (size_t)widest + (gemma4 ? 3 * (size_t)hidden : 0);
    size_t lin = (size_t)(LC + 2 * LV + 2 * LH); /* a Gated DeltaNet layer's raw/conv outputs, z, b and a, core */
    size_t eouts = gemma4 ? (size_t)(hidden + QM_ROWS) : 0; /* Gemma 4's experts' output (shared) */
    int64_t PD = 0; /* the widest per-layer input */
    for (int64_t l = 0; l < count; l++) PD = layers[l].ple_dim > PD ? layers[l].ple_dim : PD;
    eouts += (size_t)(PD ? PD + QM_ROWS : 0); /* its gated inputs (shared) */
    size_t total = (size_t)(3 * nq + 2 * nkv + inter + hidden + QM_ROWS) + moe + lin + eouts +
                   (size_t)threads * per_thread;
    float *buf = (float *)malloc(sizeof(float) * total);
    if (!buf) return -1;
    /* q: 2 nq (a gated attention's queries and gates) */
    float *q = buf, *k = q + 2 * nq, *v = k + nkv, *attn = v + nkv, *act = attn + nq, *logits = act + inter;
    float *wts = logits + E, *gu = wts + K + E, *eact = gu + K * 2 * I, *asum = eact + K * I;
    float *out = asum + K * sums; /* a product's whole output, where a post-norm reads it (hidden + a block) */
    float *lraw = out + hidden + QM_ROWS, *lz = lraw + LC, *lba = lz + LV, *core = lba + 2 * LH;
    float *eout = core + LV, *pg = eout + (gemma4 ? hidden + QM_ROWS : 0), *own = eout + eouts;
    size_t dig_bytes = digits_bytes(widest), edig_bytes = digits_bytes(I > 0 ? I : 1);
    char *dig = (char *)malloc(dig_bytes * (size_t)threads + edig_bytes * (size_t)K + 1); /* each thread's digits
                                                        * of a product's input, then each routed expert's */
    int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)(K + 1));
    qm_digits *ad = (qm_digits *)malloc(sizeof(qm_digits) * (size_t)(K + 1));
    if (!dig || !ids || !ad) {
        free(buf), free(dig), free(ids), free(ad);
        return -1;
    }
    char *edig = dig + dig_bytes * (size_t)threads;

#pragma omp parallel num_threads(threads)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float *scores = own + (size_t)t * per_thread, *xn = scores + GM * (length + 2), *s16 = xn + widest;
        float *s32 = s16 + widest / 16 + 1, *tmp = s16 + widest;
        float *rn = tmp + 2 * widest, *xe = rn + hidden, *sv = xe + hidden; /* Gemma 4's MoE block */
        char *mine = dig + dig_bytes * (size_t)t;
        qm_digits dg;
        for (int64_t l = 0; l < count; l++) {
            const qm_layer *L = layers + l;
            const qm_view *V = views + l;
            int64_t base, lo, capacity = V->capacity;
            span_of(V, spans, &base, &lo);
            int64_t at = length - base; /* the new entry's column */
            int64_t D = dim_of(L, head_dim), KVH = kvh_of(L, kv_heads), group_size = heads / KVH;
            int64_t per = heads_together(group_size, KVH, threads), parts = (group_size + per - 1) / per;
            int64_t bkv = (KVH * D + QM_ROWS - 1) / QM_ROWS; /* blocks of K (and V) rows */
            int64_t RD = L->rotary_dim ? L->rotary_dim : D; /* the rotated values of a head */
            int64_t RW = L->rope_width ? L->rope_width : RD; /* a rotary table's row */
            int64_t QS = L->attn_gate ? 2 * D : D, bq = (L->q.n + QM_ROWS - 1) / QM_ROWS; /* a head's q rows */
            float *lk = V->keys, *lv = V->values;
            rms_norm(x, L->attn_norm, L->attn_eps, hidden, xn);
            group_sums(xn, hidden, s16, s32);
            make_digits(xn, hidden, mine, &dg);
            if (L->lin_vh > 0) { /* a Gated DeltaNet layer: its mixer, then out_proj */
                delta_mix(L, V, xn, hidden, s16, s32, &dg, tmp, lraw, lz, lba, core);
                group_sums(core, L->lin_z.n, s16, s32);
                make_digits(core, L->lin_z.n, mine, &dg);
                residual_product(&L->o, core, s16, s32, &dg, tmp, L->post_attn_norm, L->post_attn_eps, out, x, 1.0f);
            } else { /* attention */
#pragma omp for schedule(static)
                for (int64_t b = 0; b < bq + (L->kv_reuse ? 0 : L->kv_same ? 1 : 2) * bkv; b++) { /* q, k and v rows */
                    const qm_linear *w = b < bq ? &L->q : b < bq + bkv ? &L->k : &L->v;
                    float *dst = b < bq ? q : b < bq + bkv ? k : v;
                    int64_t r = (b < bq ? b : b < bq + bkv ? b - bq : b - bq - bkv) * QM_ROWS;
                    rows_product(w, r, w->n - r, xn, s16, s32, &dg, tmp, dst + r);
                }
                if ((L->kv_same || L->v_norm) && !L->kv_reuse) { /* Gemma 4's values: the keys' projection, normed */
#pragma omp for schedule(static)
                    for (int64_t g = 0; g < KVH; g++) {
                        if (L->kv_same) memcpy(v + g * D, k + g * D, sizeof(float) * (size_t)D);
                        if (L->v_norm) rms_plain(v + g * D, L->v_eps, D, v + g * D);
                    }
                }
#pragma omp for schedule(static)
                for (int64_t u = 0; u < KVH * parts; u++) { /* a K/V head's query heads, or a part of them */
                    int64_t g = u / parts, h0 = g * group_size + u % parts * per;
                    int64_t G = heads_in_part(group_size, per, u % parts);
                    float *kh = xn, *vh = v + g * D;  /* xn is free until the next norm */
                    if (L->kv_reuse) /* the new entry is in the buffers already (an earlier layer's) */
                        kh = vh = NULL;
                    else {
                        memcpy(kh, k + g * D, sizeof(float) * (size_t)D);
                        norm_and_rotate(kh, L->k_norm, L->k_eps, cos + V->rope * RW, sin + V->rope * RW, D, RD, tmp);
                    }
                    if (u % parts == 0 && kh) {  /* the K/V head's first part stores its entry */
                        memcpy(lk + (g * capacity + at) * D, kh, sizeof(float) * (size_t)D);
                        memcpy(lv + (g * capacity + at) * D, vh, sizeof(float) * (size_t)D);
                    }
                    for (int64_t h = h0; h < h0 + G; h++)
                        norm_and_rotate(q + h * QS, L->q_norm, L->q_eps, cos + V->rope * RW, sin + V->rope * RW, D, RD,
                                        tmp);
                    attend_group(q + h0 * QS, QS, G, lk + (g * capacity + lo) * D, lv + (g * capacity + lo) * D,
                                 at - lo + !kh, NULL, at - lo - !!kh, kh, vh, D, scale, L->sinks ? L->sinks + h0 : NULL,
                                 scores, attn + h0 * D, D);
                    for (int64_t h = h0; L->attn_gate && h < h0 + G; h++)
                        for (int64_t i = 0; i < D; i++) attn[h * D + i] *= sigmoidf(q[h * QS + D + i]);
                }
                group_sums(attn, heads * D, s16, s32);
                make_digits(attn, heads * D, mine, &dg);
                residual_product(&L->o, attn, s16, s32, &dg, tmp, L->post_attn_norm, L->post_attn_eps, out, x, 1.0f);
            }
            int block = L->pre_experts_norm != NULL; /* Gemma 4's MoE block: its router and experts, then the MLP */
            if (block) {
                rms_plain(x, L->router_eps, hidden, rn);
                for (int64_t i = 0; i < hidden; i++) rn[i] = (rn[i] * L->router_scale[i]) * L->router_root;
                rms_norm(x, L->pre_experts_norm, L->pre_experts_eps, hidden, xe);
                group_sums(xe, hidden, s16, s32);
                make_digits(xe, hidden, mine, &dg);
#pragma omp for schedule(static)
                for (int64_t e = 0; e < L->experts; e++) logits[e] = dot(L->router + e * hidden, rn, hidden);
#pragma omp single
                route_one(L, logits, ids, wts, L->hits);
                experts_region(L->expert_gate_up, L->expert_down, ids, wts, L->top_k, xe, s16, s32, &dg, gu, eact,
                               asum, edig, edig_bytes, ad, tmp, eout, 0, L->expert_gate);
            }
            rms_norm(x, L->mlp_norm, L->mlp_eps, hidden, xn);
            group_sums(xn, hidden, s16, s32);
            make_digits(xn, hidden, mine, &dg);
            /* Qwen3.5's shared expert: scaled by the sigmoid of its gate on the normed input */
            float shared = L->shared_gate ? sigmoidf(dot(L->shared_gate, xn, hidden)) : 1.0f;
            if (L->experts > 0 && !block) { /* routed experts: the router, one thread routing, the experts' rows */
#pragma omp for schedule(static)
                for (int64_t e = 0; e < L->experts; e++)
                    logits[e] = dot(L->router + e * hidden, xn, hidden) + (L->router_bias ? L->router_bias[e] : 0.0f);
#pragma omp single
                route_one(L, logits, ids, wts, L->hits);
                experts_region(L->expert_gate_up, L->expert_down, ids, wts, L->top_k, xn, s16, s32, &dg, gu, eact,
                               asum, edig, edig_bytes, ad, tmp, x, 1, L->expert_gate);
                if (!L->gate.n) continue; /* else its shared expert, as a dense MLP of the same input */
            }
#pragma omp for schedule(static)
            for (int64_t r = 0; r < L->gate.n; r += QM_ROWS) {
                float gate[QM_ROWS], up[QM_ROWS];
                rows_product(&L->gate, r, L->gate.n - r, xn, s16, s32, &dg, tmp, gate);
                rows_product(&L->up, r, L->gate.n - r, xn, s16, s32, &dg, tmp, up);
                for (int64_t i = 0; i < QM_ROWS && r + i < L->gate.n; i++) act[r + i] = gated(gate[i], up[i], L->act);
            }
            group_sums(act, L->gate.n, s16, s32);
            make_digits(act, L->gate.n, mine, &dg);
            if (block) { /* the MLP's and the experts' outputs, each normed, summed, normed, added */
#pragma omp for schedule(static)
                for (int64_t r = 0; r < hidden; r += QM_ROWS)
                    rows_product(&L->down, r, hidden - r, act, s16, s32, &dg, tmp, out + r);
                float rs = block_sum(out, eout, L, hidden, sv);
#pragma omp for schedule(static)
                for (int64_t r = 0; r < hidden; r += QM_ROWS)
                    block_add(x, sv, L, rs, r, r + QM_ROWS < hidden ? r + QM_ROWS : hidden);
            } else
                residual_product(&L->down, act, s16, s32, &dg, tmp, L->post_mlp_norm, L->post_mlp_eps, out, x, shared);
            if (L->ple_dim) ple_token(L, x, hidden, ple + l * L->ple_dim, pg, out, s16, s32, mine, &dg, tmp);
            if (L->layer_scale != 0.0f) {
#pragma omp for schedule(static)
                for (int64_t i = 0; i < hidden; i++) x[i] = x[i] * L->layer_scale;
            }
        }
    }
    free(ids);
    free(ad);
    free(dig);
    free(buf);
    return 0;
}

/* ---- One token through an MoE layer's routed experts (engine/kernels/experts.py) ----
 *
 * y = the sum over j = 0 .. k - 1, in that order, of w[j] * down_j(SiLU(g_j) * u_j), where g_j
 * and u_j are the two halves of gate_up_j x, expert e = ids[j] having gate_up[e] (2I x H: its I
 * gate rows, then its I up rows) and down[e] (H x I). One parallel region, three barriers: the
 * gate/up rows of all k experts split over the threads; each expert's activation, group sums
 * and digits (one expert a thread); the output rows, each summing its k products. A Python loop
 * over the experts started the threads twice an expert. Returns 0, or -1 when scratch memory
 * could not be had. */
/* The work of qm_experts_one, called by every thread of a parallel region (three barriers):
 * x's group sums and digits given (xs16/xs32/xd: the calling thread's own or shared copies),
 * scratch gu (k x 2I), act (k x I), asum (k x sums), dig (k digit buffers), ad (k); tmp a row per
 * thread. acc_into: add the sum into y instead of writing it. gate: NULL for SiLU(gate) * up. */
static void experts_region(const qm_linear *gate_up, const qm_linear *down, const int64_t *ids, const float *w,
                           int64_t k, const float *x, const float *xs16, const float *xs32, const qm_digits *xd,
                           float *gu, float *act, float *asum, char *dig, size_t dig_bytes, qm_digits *ad,
                           float *tmp, float *y, int acc_into, const qm_gate *gate) {
    int64_t H = down[ids[0]].n, I = down[ids[0]].k;
    int64_t sums = I / 16 + I / 32 + 2, bgu = (2 * I + QM_ROWS - 1) / QM_ROWS;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < k * bgu; b++) {
        int64_t j = b / bgu, r = (b % bgu) * QM_ROWS;
        rows_product(&gate_up[ids[j]], r, 2 * I - r, x, xs16, xs32, xd, tmp, gu + j * 2 * I + r);
    }
#pragma omp for schedule(static)
    for (int64_t j = 0; j < k; j++) {
        float *a = act + j * I, *s16 = asum + j * sums;
        activate(gu + j * 2 * I, I, gate, ids[j], a);
        group_sums(a, I, s16, s16 + I / 16 + 1);
        make_digits(a, I, dig + dig_bytes * (size_t)j, &ad[j]);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < H; r += QM_ROWS) {
        float acc[QM_ROWS] = {0}, o[QM_ROWS];
        int64_t rows = H - r < QM_ROWS ? H - r : QM_ROWS;
        for (int64_t j = 0; j < k; j++) {
            const float *s16 = asum + j * sums;
            rows_product(&down[ids[j]], r, rows, act + j * I, s16, s16 + I / 16 + 1, &ad[j], tmp, o);
            if (gate != NULL && gate->down_bias != NULL) {
                const float *b = gate->down_bias + ids[j] * H + r;
                for (int64_t i = 0; i < rows; i++) o[i] += b[i];
            }
            for (int64_t i = 0; i < rows; i++) acc[i] += w[j] * o[i];
        }
        for (int64_t i = 0; i < rows; i++) y[r + i] = acc_into ? y[r + i] + acc[i] : acc[i];
    }
}

/* One token through its k experts (ids ascending, w their routing weights): y = the weighted sum.
 * gate: NULL for SiLU(gate) * up, else gpt-oss's (qm_gate). Returns 0, or -1 without scratch memory. */
int qm_experts_one(const qm_linear *gate_up, const qm_linear *down, const int64_t *ids, const float *w, int64_t k,
                   const float *x, float *y, int threads, const qm_gate *gate) {
    int64_t H = down[ids[0]].n, I = down[ids[0]].k, wide = H > I ? H : I;
    int64_t sums = I / 16 + I / 32 + 2;
    if (threads < 1) threads = 1;
    /* gate/up outputs (k x 2I) | activations (k x I) | their group sums | x's group sums | a row per thread */
    size_t floats = (size_t)(k * 3 * I + k * sums + H / 16 + H / 32 + 2) + (size_t)threads * (size_t)wide;
    float *buf = (float *)malloc(sizeof(float) * floats);
    size_t dig_bytes = digits_bytes(wide);
    char *dig = (char *)malloc(dig_bytes * (size_t)(k + 1) + 1);
    qm_digits *ad = (qm_digits *)malloc(sizeof(qm_digits) * (size_t)(k + 1));
    if (!buf || !dig || !ad) {
        free(buf), free(dig), free(ad);
        return -1;
    }
    float *gu = buf, *act = gu + k * 2 * I, *asum = act + k * I, *x16 = asum + k * sums, *x32 = x16 + H / 16 + 1;
    float *tmps = x32 + H / 32 + 1;
    qm_digits *xd = ad + k;
    group_sums(x, H, x16, x32);
    make_digits(x, H, dig + dig_bytes * (size_t)k, xd);

#pragma omp parallel num_threads(threads)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        experts_region(gate_up, down, ids, w, k, x, x16, x32, xd, gu, act, asum, dig, dig_bytes, ad,
                       tmps + (size_t)t * (size_t)wide, y, 0, gate);
    }
    free(ad);
    free(dig);
    free(buf);
    return 0;
}

/* A token's routing from the router's logits (one thread): softmax in fp32, the top_k largest
 * (the lower expert on ties), renormalised where norm_topk; or, where topk_softmax (gpt-oss), the
 * top_k largest logits and a softmax over them. Then sorted by expert (the order the experts'
 * sums are taken in); counted into hits (unless NULL). w: top_k weights, then E floats of
 * scratch. */
static void route_one(const qm_layer *L, const float *logits, int64_t *ids, float *w, int64_t *hits) {
    int64_t E = L->experts, K = L->top_k;
    float mx = -INFINITY, total = 0.0f;
    float *p = (float *)w + K; /* E floats of scratch after the K weights */
    if (L->topk_softmax) { /* gpt-oss: the top_k logits, then the softmax of those */
        memcpy(p, logits, sizeof(float) * (size_t)E);
    } else if (L->sigmoid_router) { /* GLM-4.5: chosen by score + bias, weighted by the score */
        for (int64_t e = 0; e < E; e++) p[e] = 1.0f / (1.0f + expf(-logits[e])) + L->score_bias[e];
    } else {
        for (int64_t e = 0; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
        for (int64_t e = 0; e < E; e++) total += (p[e] = expf(logits[e] - mx));
        for (int64_t e = 0; e < E; e++) p[e] /= total;
    }
    float picked = 0.0f;
    for (int64_t j = 0; j < K; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        ids[j] = best, w[j] = p[best], picked += p[best];
    }
    if (L->sigmoid_router) { /* the chosen experts' scores, without the bias */
        picked = 0.0f;
        for (int64_t j = 0; j < K; j++) picked += (w[j] = 1.0f / (1.0f + expf(-logits[ids[j]])));
        for (int64_t j = 0; j < K; j++) w[j] = (L->norm_topk ? w[j] / (picked + 1e-20f) : w[j]) * L->routed_scale;
    } else if (L->topk_softmax) { /* the first picked is the largest */
        float top = w[0];
        picked = 0.0f;
        for (int64_t j = 0; j < K; j++) picked += (w[j] = expf(w[j] - top));
        for (int64_t j = 0; j < K; j++) w[j] /= picked;
    } else if (L->norm_topk) {
        for (int64_t j = 0; j < K; j++) w[j] /= picked;
    }
    if (L->expert_scale) /* Gemma 4: each expert's own factor on its weight */
        for (int64_t j = 0; j < K; j++) w[j] = w[j] * L->expert_scale[ids[j]];
    for (int64_t j = 1; j < K; j++) /* insertion sort by expert */
        for (int64_t i = j; i > 0 && ids[i - 1] > ids[i]; i--) {
            int64_t ti = ids[i]; ids[i] = ids[i - 1]; ids[i - 1] = ti;
            float tw = w[i]; w[i] = w[i - 1]; w[i - 1] = tw;
        }
    if (hits)
        for (int64_t j = 0; j < K; j++) hits[ids[j]]++;
}

/* ---- Several tokens through the same layers: a tree pass, or a chain (engine/kernels/fused_layer.py) ----
 *
 * n tokens at once, each as in qm_decode_layers, with two differences. The products decode each
 * tile of NB weight rows once into fp32 scratch and multiply every token's row by it
 * (multiply()), so a pass of n tokens reads the weights once. And token i attends to the
 * cache's `length` entries and to the pass's own entries that its mask row allows:
 * allowed[i * (length + n) + j] for j < length + n (NULL: a chain, j <= length + i). The pass's
 * K/V go to the cache at length .. length + n - 1 before anyone attends, so a node reads its
 * ancestors where the cache holds them. Eight barriers a layer (norms, q/k/v, rotation,
 * attention, o, norm, gate/up, down). */

/* Tile t of w (rows t * NB ..) times the n rows of x (n, w->k) into y (n, w->n) (+ bias). */
static void tile_product(const qm_linear *w, int64_t t, const float *x, int64_t n, float *y, float *wbuf) {
    int64_t n0 = t * NB, groups = w->k / w->group, kind = w->kind & ~QM_FLAGS;
    int fmt = params_fmt(w->kind), half = fmt == 1;
    int rows = (int)(w->n - n0 < NB ? w->n - n0 : NB);
    for (int r = 0; r < rows; r++) {
        int64_t row = n0 + r;
        float sb[PARAMS_BUF(fmt, 1, groups)], mb[PARAMS_BUF(fmt, 1, groups)];
        const void *sc = row_params(w->scales, row, 1, groups, fmt, sb), *mn = row_params(w->mins, row, 1, groups, fmt, mb);
        decode_row(kind, (const char *)w->codes + row * row_bytes_of(kind, w->k), sc, mn, half, w->k, w->group,
                   wbuf + r * w->k);
    }
    multiply(x, n, w->k, wbuf, rows, y, w->n, n0);
    if (w->bias)
        for (int64_t i = 0; i < n; i++)
            for (int r = 0; r < rows; r++) y[i * w->n + n0 + r] += w->bias[n0 + r];
}


/* A small pass's inputs as digits (qm_digits.h): each token's digits and group sums. */
typedef struct {
    qm_digits d[QM_FEW];
    const float *s16[QM_FEW], *s32[QM_FEW];
    int few;         /* tokens, or 0: the pass takes the fp32 tiles, or the panels */
    const float *xt; /* the tokens transposed for the panels (transpose_tokens), or NULL */
} qm_few;

/* Bytes of one token's share of a qm_few of k-wide inputs (64-byte aligned). */
static size_t few_bytes(int64_t k) {
    return ((digits_bytes(k) + (size_t)(k / 16 + k / 32 + 2) * sizeof(float)) + 63) / 64 * 64;
}

/* The n rows of x (n, k) as digits in `mem` (n * few_bytes(k)); none where the CPU has no
 * integer rows, n > QM_FEW or k is not a multiple of 64. */
static void make_few(const float *x, int64_t n, int64_t k, char *mem, qm_few *f) {
    f->few = 0;
    f->xt = NULL;
#ifdef QM_INT
    if (n > QM_FEW || k % 64) return;
    for (int64_t i = 0; i < n; i++) {
        char *m = mem + (size_t)i * few_bytes(k);
        float *s16 = (float *)m, *s32 = s16 + k / 16 + 1;
        make_digits(x + i * k, k, (char *)(s32 + k / 32 + 1), &f->d[i]);
        group_sums(x + i * k, k, s16, s32);
        f->s16[i] = s16, f->s32[i] = s32;
    }
    f->few = (int)n;
#else
    (void)x, (void)n, (void)k, (void)mem;
#endif
}

/* make_few, and from QM_PANEL_MIN tokens the tokens transposed into xt for the panels (NULL: none
 * allocated). Called by every thread of the region: it waits for the whole transposition. */
static void make_inputs(const float *x, int64_t n, int64_t k, char *mem, float *xt, qm_few *f) {
    make_few(x, n, k, mem, f);
#ifdef QM_AVX512
    if (xt && n >= QM_PANEL_MIN) {
        transpose_tokens(x, n, k, xt);
        f->xt = xt;
    }
#else
    (void)xt;
#endif
}

/* The rows a unit of a pass's product covers (product's t): a panel's or a tile's. */
static int64_t unit_rows(const qm_few *f) { return f->xt ? QM_PANEL : NB; }
static int64_t units_of(const qm_linear *w, const qm_few *f) { return (w->n + unit_rows(f) - 1) / unit_rows(f); }

#ifdef QM_AVX512
/* Rows r .. r + rows - 1 (rows <= QM_PANEL) of w times cnt tokens transposed in xt (blocks of
 * transpose_tokens) into y[i * N + j] (+ bias), through a panel decoded in wbuf. */
static void panel_for(const qm_linear *w, int64_t r, int64_t rows, int64_t cnt, const float *xt, float *wbuf, float *y,
                      int64_t N) {
    decode_panel(w->kind & ~QM_FLAGS, params_fmt(w->kind), (const char *)w->codes, w->scales, w->mins, r, (int)rows,
                 w->k, w->group, wbuf);
    panel_rows(xt, cnt, w->k, wbuf, w->k + QM_PAD, (int)rows, y, N);
    if (w->bias)
        for (int64_t i = 0; i < cnt; i++)
            for (int64_t j = 0; j < rows; j++) y[i * N + j] += w->bias[r + j];
}
#endif

/* tile_product, through the integer rows where the pass's inputs were made digits. */
static void product(const qm_linear *w, int64_t t, const float *x, int64_t n, float *y, float *wbuf, const qm_few *f) {
#ifdef QM_AVX512
    if (f->xt) { /* panel t: its rows decoded, times every token (bias added) */
        int64_t n0 = t * QM_PANEL;
        panel_for(w, n0, w->n - n0 < QM_PANEL ? w->n - n0 : QM_PANEL, n, f->xt, wbuf, y + n0, w->n);
        return;
    }
#endif
#ifdef QM_INT
    int64_t kind = w->kind & ~QM_FLAGS;
    if (f->few == n && takes_digits(&f->d[0], kind, w->k, w->group)) {
        int64_t groups = w->k / w->group, n0 = t * NB;
        int fmt = params_fmt(w->kind), half = fmt == 1;
        const float *xs[QM_FEW];
        for (int64_t i = 0; i < n; i++) xs[i] = w->group == 16 ? f->s16[i] : f->s32[i];
        int rows = (int)(w->n - n0 < NB ? w->n - n0 : NB), rb = (int)row_bytes_of(kind, w->k);
        float out[NB * QM_FEW];
        float sb[PARAMS_BUF(fmt, NB, groups)], mb[PARAMS_BUF(fmt, NB, groups)];
        rows_vnni(f->d, xs, (int)n, kind, (const char *)w->codes + n0 * rb, rb,
                  row_params(w->scales, n0, rows, groups, fmt, sb), row_params(w->mins, n0, rows, groups, fmt, mb),
                  groups, half, w->k, w->group, rows, out, QM_FEW);
        for (int r = 0; r < rows; r++)
            for (int64_t i = 0; i < n; i++)
                y[i * w->n + n0 + r] = w->bias ? out[r * QM_FEW + i] + w->bias[n0 + r] : out[r * QM_FEW + i];
        return;
    }
#else
    (void)f;
#endif
    tile_product(w, t, x, n, y, wbuf);
}

/* qm_matmul for 2 .. QM_FEW rows of x through the integer rows, each weight row read once for all
 * of them (the fp32 tiles decode every row to fp32 first: an expert of 1536 x 2048 q4 took 2.1x
 * one token's time for two tokens). Returns 1 done, 0 not taken (no integer rows here, or a
 * width or type they do not take), -1 out of memory. */
static int matmul_few(int kind, const float *x, int64_t M, int64_t K, const void *codes, const void *scales,
                      const void *mins, int64_t N, int64_t group, float *y, int threads) {
#ifdef QM_INT
    int fmt = params_fmt(kind), half = fmt == 1;
    kind &= ~QM_FLAGS;
    if (M > QM_FEW || K % 64 || (group != 16 && group != 32)) return 0;
    char *mem = (char *)malloc((size_t)M * few_bytes(K) + 64);
    if (!mem) return -1;
    qm_few f;
    make_few(x, M, K, mem, &f);
    if (f.few != M || !takes_digits(&f.d[0], kind, K, group)) {
        free(mem);
        return 0;
    }
    const float *xs[QM_FEW];
    for (int64_t i = 0; i < M; i++) xs[i] = group == 16 ? f.s16[i] : f.s32[i];
    int64_t groups = K / group, rb = row_bytes_of(kind, K);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < (N + QM_ROWS - 1) / QM_ROWS; b++) {
        int64_t n0 = b * QM_ROWS;
        int rows = (int)(N - n0 < QM_ROWS ? N - n0 : QM_ROWS);
        float out[QM_ROWS * QM_FEW];
        float sb[PARAMS_BUF(fmt, QM_ROWS, groups)], mb[PARAMS_BUF(fmt, QM_ROWS, groups)];
        rows_vnni(f.d, xs, (int)M, kind, (const char *)codes + n0 * rb, rb, row_params(scales, n0, rows, groups, fmt, sb),
                  row_params(mins, n0, rows, groups, fmt, mb), groups, half, K, group, rows, out, QM_FEW);
        for (int r = 0; r < rows; r++)
            for (int64_t i = 0; i < M; i++) y[i * N + n0 + r] = out[r * QM_FEW + i];
    }
    free(mem);
    return 1;
#else
    (void)kind, (void)x, (void)M, (void)K, (void)codes, (void)scales, (void)mins, (void)N, (void)group, (void)y,
        (void)threads;
    return 0;
#endif
}

/* ---- An MoE layer's routed experts in a pass of n tokens (qm_pass_layers) ----
 *
 * Every token routed as a decode step routes it (route_one); the pairs (token, expert) grouped by
 * expert, experts in ascending order; each woken expert's rows read once for all its tokens: the
 * integer rows, up to QM_FEW tokens a call, each token's bits those it gets alone, for an expert of
 * fewer than QM_EXPERT_PANEL_MIN tokens; else the panels, its rows decoded to fp32 once for all
 * its tokens (its tokens' outputs then differ from a step's in the last bits, as a dense product's
 * of 5+ tokens does). A token's sum adds its experts' weighted outputs in expert order, as a
 * step does. Barriers after the routing: the panel experts' inputs transposed, gate/up rows of
 * all woken experts, the pairs' activations, those transposed, the output rows. */
typedef struct {
    int64_t *ids;    /* (n, top_k) each token's experts, ascending */
    float *wts;      /* (n, top_k) their weights */
    int64_t *order;  /* (n * top_k) pairs p = i * top_k + j, grouped by expert, tokens ascending */
    int64_t *woken;  /* the experts woken, ascending; their first pair in order[]: start[], count[] */
    int64_t *start, *count, used;
    float *gu, *act, *asum; /* per pair (in order[]'s order): gate/up (2I), activation (I), its sums */
    char *dig;              /* per pair: digits of its activation (dig_bytes each) */
    qm_digits *ad;
    size_t dig_bytes;
    float *pxt;            /* the panel experts' inputs transposed (their tokens', then their activations) */
    size_t pxt_cap;        /* its floats (grown as a layer needs, kept for the next; freed by the caller) */
    int64_t *poff, *panel; /* each woken expert's offset in pxt in tokens (-1: the integer rows); the panel experts */
    int64_t panels;
} qm_routed;

/* Rows r .. r + rows - 1 of w times `cnt` inputs (x[i], their sums s16[i]/s32[i] and digits
 * dg[i]) into out[i * QM_ROWS + row]: the integer rows QM_FEW inputs at a time where they take
 * digits, else each input's rows (rows_product). tmp: a row of scratch. (fp32 tiles for an
 * expert's 9 or more tokens measured no faster for a pass of 128-256 tokens and 1.2x slower for
 * 16; the panels are faster from QM_EXPERT_PANEL_MIN tokens: routed_pass takes them there.) */
static void rows_for(const qm_linear *w, int64_t r, int64_t rows, int64_t cnt, const float *const *x,
                     const float *const *s16, const float *const *s32, const qm_digits *const *dg, float *tmp,
                     float *out) {
    if (rows > QM_ROWS) rows = QM_ROWS;
#ifdef QM_INT
    int64_t kind = w->kind & ~QM_FLAGS;
    if (takes_digits(dg[0], kind, w->k, w->group)) {
        int64_t groups = w->k / w->group, rb = row_bytes_of(kind, w->k);
        int fmt = params_fmt(w->kind), half = fmt == 1;
        float sb[PARAMS_BUF(fmt, QM_ROWS, groups)], mb[PARAMS_BUF(fmt, QM_ROWS, groups)];
        const void *sc = row_params(w->scales, r, rows, groups, fmt, sb), *mn = row_params(w->mins, r, rows, groups, fmt, mb);
        for (int64_t i0 = 0; i0 < cnt; i0 += QM_FEW) {
            int f = (int)(cnt - i0 < QM_FEW ? cnt - i0 : QM_FEW);
            qm_digits d[QM_FEW];
            const float *xs[QM_FEW];
            float o[QM_ROWS * QM_FEW];
            for (int i = 0; i < f; i++) d[i] = *dg[i0 + i], xs[i] = w->group == 16 ? s16[i0 + i] : s32[i0 + i];
            rows_vnni(d, xs, f, kind, (const char *)w->codes + r * rb, rb, sc, mn, groups, half, w->k, w->group,
                      (int)rows, o, QM_FEW);
            for (int i = 0; i < f; i++)
                for (int64_t j = 0; j < rows; j++)
                    out[(i0 + i) * QM_ROWS + j] = w->bias ? o[j * QM_FEW + i] + w->bias[r + j] : o[j * QM_FEW + i];
        }
        return;
    }
#endif
    for (int64_t i = 0; i < cnt; i++) rows_product(w, r, rows, x[i], s16[i], s32[i], dg[i], tmp, out + i * QM_ROWS);
}

/* rows_for over rows r .. r + rows - 1 (rows <= U), QM_ROWS at a time, into out[i * U + j];
 * piece: cnt * QM_ROWS floats of scratch. */
static void unit_for(const qm_linear *w, int64_t r, int64_t rows, int64_t U, int64_t cnt, const float *const *x,
                     const float *const *s16, const float *const *s32, const qm_digits *const *dg, float *tmp,
                     float *piece, float *out) {
    for (int64_t h = 0; h < rows; h += QM_ROWS) {
        int64_t m = rows - h < QM_ROWS ? rows - h : QM_ROWS;
        rows_for(w, r + h, m, cnt, x, s16, s32, dg, tmp, piece);
        for (int64_t i = 0; i < cnt; i++)
            for (int64_t j = 0; j < m; j++) out[i * U + h + j] = piece[i * QM_ROWS + j];
    }
}

#ifdef QM_AVX512
/* The panel experts' inputs transposed into R->pxt (expert e's at poff[e] * k): for its q-th pair,
 * the row of k values at base of its token (by_token) or of the pair itself (its activation). A
 * worksharing loop over (expert, 256 columns). */
static void transpose_experts(const qm_routed *R, int64_t k, const float *base, int64_t by_token, int64_t top_k) {
    int64_t slices = (k + 255) / 256;
#pragma omp for schedule(static)
    for (int64_t s = 0; s < R->panels * slices; s++) {
        int64_t e = R->panel[s / slices], k0 = (s % slices) * 256, k1 = k0 + 256 < k ? k0 + 256 : k;
        int64_t c = R->count[e], first = R->start[e];
        const float *rows[QM_TB];
        for (int64_t b0 = 0; b0 < c; b0 += QM_TB) {
            int64_t cnt = c - b0 < QM_TB ? c - b0 : QM_TB;
            for (int64_t i = 0; i < cnt; i++) /* the token's input, or the pair's own (its activation) */
                rows[i] = base + (by_token ? R->order[first + b0 + i] / top_k : first + b0 + i) * k;
            transpose_slice(rows, cnt, k0, k1, R->pxt + (R->poff[e] + b0) * k);
        }
    }
}
#endif

/* Called by every thread of qm_pass_layers' region. xn: (n, H) the tokens' normed states, their
 * sums and digits tok16/tok32 (stride tsum) and tokd; x: (n, H) += the experts' sums. logits: n x E
 * scratch; route: n x (top_k + E) scratch; ptrs: per thread 4 x n * top_k pointers; mine: per
 * thread n * (2 * QM_PANEL + QM_ROWS) floats; tmp: a decoded panel (QM_PANEL rows, stride
 * widest + QM_PAD). An expert with QM_EXPERT_PANEL_MIN tokens or more (where R->pxt is given) takes
 * the panels, as a dense product of as many tokens does; the others the integer rows. */
static void routed_pass(const qm_layer *L, int64_t n, int64_t H, const float *xn, const float *rin,
                        const float *tok16, const float *tok32, int64_t tsum, const qm_digits *tokd, float *logits,
                        float *route, qm_routed *R, const void **ptrs, float *mine, float *tmp, float *x, int add) {
    int64_t E = L->experts, K = L->top_k, P = n * K;
    int64_t I = L->expert_down[0].k, sums = I / 16 + I / 32 + 2;
#pragma omp for schedule(static)
    for (int64_t s = 0; s < n * E; s++)
        logits[s] = dot(L->router + (s % E) * H, rin + (s / E) * H, H) + (L->router_bias ? L->router_bias[s % E] : 0.0f);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float *w = route + i * (K + E);
        route_one(L, logits + i * E, R->ids + i * K, w, NULL);
        memcpy(R->wts + i * K, w, sizeof(float) * (size_t)K);
    }
#pragma omp single
    { /* counted, and the pairs grouped by expert (a counting sort: tokens stay ascending) */
        memset(R->count, 0, sizeof(int64_t) * (size_t)E);
        for (int64_t p = 0; p < P; p++) R->count[R->ids[p]]++;
        if (L->hits)
            for (int64_t e = 0; e < E; e++) L->hits[e] += R->count[e];
        int64_t at = 0;
        R->used = R->panels = 0;
        for (int64_t e = 0; e < E; e++) {
            R->start[e] = at, at += R->count[e], R->poff[e] = -1;
            if (R->count[e]) R->woken[R->used++] = e;
        }
#ifdef QM_AVX512
        int64_t pt = 0; /* the panel experts' room in pxt, in tokens */
        for (int64_t u = 0; u < R->used; u++)
            if (R->count[R->woken[u]] >= QM_EXPERT_PANEL_MIN) pt += (int64_t)panel_floats(R->count[R->woken[u]], 1);
        size_t need = (size_t)pt * (size_t)(H > I ? H : I);
        if (need > R->pxt_cap) { /* grown for this layer; none to be had: its experts take the integer rows */
            free(R->pxt);
            R->pxt = (float *)malloc(sizeof(float) * need);
            R->pxt_cap = R->pxt ? need : 0;
        }
        pt = 0;
        for (int64_t u = 0; R->pxt && u < R->used; u++) {
            int64_t e = R->woken[u];
            if (R->count[e] >= QM_EXPERT_PANEL_MIN)
                R->poff[e] = pt, pt += (int64_t)panel_floats(R->count[e], 1), R->panel[R->panels++] = e;
        }
#endif
        int64_t *next = R->woken + E; /* E more: each expert's next free slot */
        memcpy(next, R->start, sizeof(int64_t) * (size_t)E);
        for (int64_t p = 0; p < P; p++) R->order[next[R->ids[p]]++] = p;
    }
    const float **xin = (const float **)ptrs, **s16 = xin + P, **s32 = s16 + P;
    const qm_digits **dg = (const qm_digits **)(s32 + P);
    int64_t U = R->panels ? QM_PANEL : QM_ROWS, bgu = (2 * I + U - 1) / U; /* U: the rows of a unit of work */
    float *out = mine, *acc = mine + n * U, *piece = acc + n * U;
#ifdef QM_AVX512
    if (R->panels) transpose_experts(R, H, xn, 1, K); /* (every thread sees the same R->panels) */
#endif
#pragma omp for schedule(static)
    for (int64_t b = 0; b < R->used * bgu; b++) {
        int64_t e = R->woken[b / bgu], r = (b % bgu) * U, c = R->count[e], first = R->start[e];
        int64_t rows = 2 * I - r < U ? 2 * I - r : U;
#ifdef QM_AVX512
        if (R->poff[e] >= 0) {
            panel_for(&L->expert_gate_up[e], r, rows, c, R->pxt + R->poff[e] * H, tmp, R->gu + first * 2 * I + r, 2 * I);
            continue;
        }
#endif
        for (int64_t q = 0; q < c; q++) {
            int64_t i = R->order[first + q] / K;
            xin[q] = xn + i * H, s16[q] = tok16 + i * tsum, s32[q] = tok32 + i * tsum, dg[q] = tokd + i;
        }
        unit_for(&L->expert_gate_up[e], r, rows, U, c, xin, s16, s32, dg, tmp, piece, out);
        for (int64_t q = 0; q < c; q++)
            for (int64_t j = 0; j < rows; j++) R->gu[(first + q) * 2 * I + r + j] = out[q * U + j];
    }
#pragma omp for schedule(static)
    for (int64_t q = 0; q < P; q++) {
        const float *g = R->gu + q * 2 * I;
        float *a = R->act + q * I, *a16 = R->asum + q * sums;
        int64_t e = R->ids[R->order[q]];
        activate(g, I, L->expert_gate, e, a);
        if (R->poff[e] < 0) { /* the integer rows' inputs (a panel expert's are transposed below) */
            group_sums(a, I, a16, a16 + I / 16 + 1);
            make_digits(a, I, R->dig + R->dig_bytes * (size_t)q, &R->ad[q]);
        }
    }
#ifdef QM_AVX512
    if (R->panels) transpose_experts(R, I, R->act, 0, K);
#endif
#pragma omp for schedule(static)
    for (int64_t r = 0; r < H; r += U) {
        int64_t rows = H - r < U ? H - r : U;
        memset(acc, 0, sizeof(float) * (size_t)(n * U));
        for (int64_t u = 0; u < R->used; u++) { /* experts ascending: each token's sum in the step's order */
            int64_t e = R->woken[u], c = R->count[e], first = R->start[e];
#ifdef QM_AVX512
            if (R->poff[e] >= 0)
                panel_for(&L->expert_down[e], r, rows, c, R->pxt + R->poff[e] * I, tmp, out, U);
            else
#endif
            {
                for (int64_t q = 0; q < c; q++) {
                    const float *a16 = R->asum + (first + q) * sums;
                    xin[q] = R->act + (first + q) * I, s16[q] = a16, s32[q] = a16 + I / 16 + 1, dg[q] = R->ad + first + q;
                }
                unit_for(&L->expert_down[e], r, rows, U, c, xin, s16, s32, dg, tmp, piece, out);
            }
            const float *db = L->expert_gate && L->expert_gate->down_bias ? L->expert_gate->down_bias + e * H + r : NULL;
            for (int64_t q = 0; q < c; q++) {
                int64_t p = R->order[first + q], i = p / K;
                for (int64_t j = 0; j < rows; j++)
                    acc[i * U + j] += R->wts[p] * (db ? out[q * U + j] + db[j] : out[q * U + j]);
            }
        }
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < rows; j++) x[i * H + r + j] = add ? x[i * H + r + j] + acc[i * U + j] : acc[i * U + j];
    }
}

/* x: (n, hidden), updated in place. cos, sin: (n, head_dim), each token's own. views[l]: layer
 * l's buffers with room for the pass's n entries after its columns; spans: (base, lo) for each
 * window (NULL where no layer has one). allowed: (n, length + n), what a full layer's token
 * reads (NULL: a chain); masks[w]: the same for the layers of window w over their own columns,
 * (n, length - base + n). parents (n; -1: the committed state): each node's parent, for the
 * Gated DeltaNet layers' tree (delta_tree); NULL: a chain of committed text, folded into their
 * states in place (delta_chain). Returns 0, or -1 when scratch memory could not be had. */
int qm_pass_layers(const qm_layer *layers, const qm_view *views, int64_t count, int64_t hidden, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, int64_t length, int64_t n, const int64_t *spans,
                   const uint8_t *const *masks, float scale, const float *cos, const float *sin,
                   const uint8_t *allowed, const int64_t *parents, float *x, const float *ple, int threads) {
    int64_t DM, KVM, GM, gemma4 = 0; /* the widest head, most K/V heads, most query heads per K/V head */
    head_widths(layers, count, heads, kv_heads, head_dim, &DM, &KVM, &GM);
    for (int64_t l = 0; l < count; l++) gemma4 |= layers[l].pre_experts_norm != NULL;
    int64_t H = hidden, nq = heads * DM, nkv = KVM * DM;
    int64_t inter = 0, total = length + n;
    int64_t E = 0, K = 0, I = 0; /* the MoE layers' most experts, top_k and expert width */
    int64_t LC = 0, LV = 0, LH = 0, LS = 0, KM = 1; /* Gated DeltaNet: widest conv, values, heads; a head's state */
    widths(layers, count, &inter, &E, &K, &I);
    linear_widths(layers, count, &LC, &LV, &LH);
    for (int64_t l = 0; l < count; l++)
        if (layers[l].lin_vh > 0) {
            const qm_layer *L = layers + l;
            LS = L->lin_dk * L->lin_dv > LS ? L->lin_dk * L->lin_dv : LS;
            KM = L->kernel > KM ? L->kernel : KM;
            if (2 * L->lin_dk + L->lin_dv > LS) LS = 2 * L->lin_dk + L->lin_dv; /* (a head's scratch, too) */
        }
    int fold = LH && !parents; /* no parents: a chain of committed text, folded into the states (delta_chain) */
    int64_t widest = H > nq ? H : nq;
    widest = inter > widest ? inter : widest;
    widest = I > widest ? I : widest;
    widest = LV > widest ? LV : widest;
    if (threads < 1) threads = 1;
    /* the routed experts' scratch (routed_pass), where a layer has them */
    int64_t P = n * K, sums = I / 16 + I / 32 + 2;
    size_t tok_bytes = few_bytes(H), edig = digits_bytes(I > 0 ? I : 1);
    size_t mine_floats = (size_t)(n * (2 * QM_PANEL + QM_ROWS)); /* routed_pass's `mine` */
    size_t routed_floats = (size_t)(n * E + n * (K + E) + P + P * 3 * I + P * sums) + (size_t)threads * mine_floats;
    size_t routed_bytes = E ? sizeof(float) * routed_floats + sizeof(int64_t) * (size_t)(2 * P + 6 * E) +
                                  tok_bytes * (size_t)n + edig * (size_t)P + sizeof(qm_digits) * (size_t)(n + P) +
                                  sizeof(void *) * (size_t)(4 * P) * (size_t)threads + 64
                            : 1;
    char *routed_mem = (char *)malloc(routed_bytes);
    if (!routed_mem) return -1;
    qm_routed R;
    memset(&R, 0, sizeof R);
    float *logits = NULL, *route = NULL, *mines = NULL, *tok16 = NULL, *tok32 = NULL;
    qm_digits *tokd = NULL;
    const void **ptrs = NULL;
    int64_t tsum = (int64_t)(tok_bytes / sizeof(float));
    if (E) {
        char *m = routed_mem;
        tok16 = (float *)m, tok32 = tok16 + H / 16 + 1, m += tok_bytes * (size_t)n; /* few_bytes: 64-byte multiples */
        R.dig = m, R.dig_bytes = edig, m += edig * (size_t)P;
        logits = (float *)m, route = logits + n * E, R.wts = route + n * (K + E), R.gu = R.wts + P;
        R.act = R.gu + P * 2 * I, R.asum = R.act + P * I, mines = R.asum + P * sums;
        m = (char *)(mines + (size_t)threads * mine_floats);
        m = (char *)(((uintptr_t)m + 7) & ~(uintptr_t)7); /* int64 after floats: kept aligned */
        R.ids = (int64_t *)m, R.order = R.ids + P, R.woken = R.order + P, R.start = R.woken + 2 * E;
        R.count = R.start + E, R.poff = R.count + E, R.panel = R.poff + E, m = (char *)(R.panel + E);
        tokd = (qm_digits *)m, R.ad = tokd + n, m = (char *)(R.ad + P);
        ptrs = (const void **)m;
    }
    /* shared: xn | q (a gated attention's queries and gates) | k | v | attn | gate (then the activation) |
     * up | a product's output | Gated DeltaNet: z, b and a, core | shared experts' gates | each node's
     * path (KM - 1 entries); per thread: a decoded tile, scores, a head, a Gated DeltaNet head's states */
    int64_t PD = 0; /* the widest per-layer input (Gemma 4's small models) */
    for (int64_t l = 0; l < count; l++) PD = layers[l].ple_dim > PD ? layers[l].ple_dim : PD;
    /* (Gemma 4: the router's and experts' inputs, their output; the gated per-layer inputs) */
    size_t shared = (size_t)n * (size_t)(H + 2 * nq + 2 * nkv + nq + 2 * inter + H + 2 * LV + 2 * LH + 1 + 2 * KM +
                                         (gemma4 ? 3 * H : 0) + PD);
    size_t tile = (size_t)NB * (size_t)widest, panel = (size_t)QM_PANEL * (size_t)(widest + QM_PAD);
    if (panel > tile) tile = panel; /* a decoded tile, or panel */
    size_t per_thread = tile + (size_t)GM * (size_t)(total + 2) + (size_t)DM + (size_t)(fold ? 1 : n + 1) * (size_t)LS;
    float *buf = (float *)malloc(sizeof(float) * (shared + (size_t)threads * per_thread));
    if (!buf) {
        free(routed_mem);
        return -1;
    }
    float *xn = buf, *q = xn + n * H, *k = q + 2 * n * nq, *v = k + n * nkv, *attn = v + n * nkv;
    float *gate = attn + n * nq, *up = gate + n * inter, *out = up + n * inter, *lz = out + n * H;
    float *lba = lz + n * LV, *core = lba + 2 * n * LH, *sgate = core + n * LV;
    int64_t *chains = (int64_t *)(sgate + n); /* (n, KM - 1): int64 in the room of 2 n KM floats */
    float *rn = sgate + n + 2 * n * KM, *xe = rn + (gemma4 ? n * H : 0), *eout = xe + (gemma4 ? n * H : 0);
    float *pgs = eout + (gemma4 ? n * H : 0), *own = pgs + n * PD;
    for (int64_t i = 0; LH && !fold && i < n; i++) { /* each node's inputs before it along its path, oldest first */
        int64_t a = parents[i], back = 0;
        for (int64_t j = KM - 2; j >= 0; j--) {
            if (a >= 0) chains[i * (KM - 1) + j] = a, a = parents[a];
            else chains[i * (KM - 1) + j] = -1 - back++;
        }
    }
    size_t few_per = n <= QM_FEW ? (size_t)n * few_bytes(widest) : 0; /* each thread's digits of a product's input */
    char *fewmem = (char *)malloc(few_per * (size_t)threads + 64);
    float *xt = NULL; /* a product's input transposed for the panels (shared) */
#ifdef QM_AVX512
    if (n >= QM_PANEL_MIN) xt = (float *)malloc(sizeof(float) * panel_input_floats(n, widest));
    if (n >= QM_PANEL_MIN && !xt) {
        free(fewmem), free(buf), free(routed_mem);
        return -1;
    }
#endif
    if (!fewmem) {
        free(xt), free(buf), free(routed_mem);
        return -1;
    }

#pragma omp parallel num_threads(threads)
    {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        float *wbuf = own + (size_t)t * per_thread, *scores = wbuf + tile, *tmp = scores + GM * (total + 2);
        float *states = tmp + DM; /* (n + 1) x LS: a Gated DeltaNet head's scratch, then its nodes' states */
        char *mine = fewmem + few_per * (size_t)t;
        qm_few few;
        const int64_t U = xt ? QM_PANEL : NB; /* the rows of a product's unit: a panel or a tile (unit_rows) */
        for (int64_t l = 0; l < count; l++) {
            const qm_layer *L = layers + l;
            const qm_view *V = views + l;
            int64_t base, lo, capacity = V->capacity;
            span_of(V, spans, &base, &lo);
            int64_t at = length - base, seen = at + n; /* the pass's first column; the columns it reads */
            (void)lo; /* a windowed layer's mask says what each token reads */
            int64_t D = dim_of(L, head_dim), KVH = kvh_of(L, kv_heads), group_size = heads / KVH;
            int64_t nkv_l = KVH * D, nq_l = heads * D;
            int64_t per = heads_together(group_size, n * KVH, threads), parts = (group_size + per - 1) / per;
            int64_t RD = L->rotary_dim ? L->rotary_dim : D; /* the rotated values of a head */
            int64_t RW = L->rope_width ? L->rope_width : RD; /* a rotary table's row */
            const uint8_t *allow = V->window < 0 ? allowed : masks[V->window]; /* (n, seen) */
            float *lk = V->keys, *lv = V->values;
            int64_t QS = L->attn_gate ? 2 * D : D, qn = L->q.n; /* a head's and a token's q rows */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++) rms_norm(x + i * H, L->attn_norm, L->attn_eps, H, xn + i * H);
            make_inputs(xn, n, H, mine, xt, &few);
            if (L->lin_vh > 0) { /* a Gated DeltaNet layer: its products, its tree, out_proj */
                int64_t VD = L->lin_z.n, vh = L->lin_vh;
#pragma omp for schedule(static) nowait
                for (int64_t s = 0; s < units_of(&L->lin_qkv, &few); s++)
                    product(&L->lin_qkv, s, xn, n, V->pend_x, wbuf, &few);
#pragma omp for schedule(static) nowait
                for (int64_t s = 0; s < units_of(&L->lin_z, &few); s++) product(&L->lin_z, s, xn, n, lz, wbuf, &few);
#pragma omp for schedule(static)
                for (int64_t s = 0; s < n * 2 * vh; s++)
                    lba[s] = dot(L->lin_ba + (s % (2 * vh)) * H, xn + (s / (2 * vh)) * H, H);
                if (fold)
                    delta_chain(L, V, n, lz, lba, states, core);
                else
                    delta_tree(L, V, n, parents, chains, KM - 1, lz, lba, states + LS, states, core);
                make_inputs(core, n, VD, mine, xt, &few);
#pragma omp for schedule(static)
                for (int64_t s = 0; s < units_of(&L->o, &few); s++) {
                    product(&L->o, s, core, n, out, wbuf, &few);
                    for (int64_t i = 0; i < n; i++)
                        for (int64_t r = s * U; r < H && r < (s + 1) * U; r++) x[i * H + r] += out[i * H + r];
                }
            } else { /* attention */
#pragma omp for schedule(static) nowait
                for (int64_t s = 0; s < units_of(&L->q, &few); s++) product(&L->q, s, xn, n, q, wbuf, &few);
#pragma omp for schedule(static) nowait
                for (int64_t s = 0; s < units_of(&L->k, &few); s++) product(&L->k, s, xn, n, k, wbuf, &few);
                if (L->kv_same || L->kv_reuse) { /* Gemma 4's values: its keys' projection (below), or none */
#pragma omp barrier
                } else {
#pragma omp for schedule(static)
                    for (int64_t s = 0; s < units_of(&L->v, &few); s++) product(&L->v, s, xn, n, v, wbuf, &few);
                }
                /* rotate every query head; rotate each token's K/V heads into the cache */
#pragma omp for schedule(static) nowait
                for (int64_t s = 0; s < n * heads; s++) {
                    int64_t i = s / heads;
                    norm_and_rotate(q + i * qn + (s % heads) * QS, L->q_norm, L->q_eps, cos + (V->rope * n + i) * RW,
                                    sin + (V->rope * n + i) * RW, D, RD, tmp);
                }
#pragma omp for schedule(static)
                for (int64_t s = 0; s < (L->kv_reuse ? 0 : n * KVH); s++) { /* (a reusing layer's are there) */
                    int64_t i = s / KVH, g = s % KVH;
                    float *kh = k + i * nkv_l + g * D, *vh = v + i * nkv_l + g * D;
                    if (L->kv_same) memcpy(vh, kh, sizeof(float) * (size_t)D);
                    if (L->v_norm) rms_plain(vh, L->v_eps, D, vh);
                    norm_and_rotate(kh, L->k_norm, L->k_eps, cos + (V->rope * n + i) * RW, sin + (V->rope * n + i) * RW, D,
                                    RD, tmp);
                    memcpy(lk + (g * capacity + at + i) * D, kh, sizeof(float) * (size_t)D);
                    memcpy(lv + (g * capacity + at + i) * D, vh, sizeof(float) * (size_t)D);
                }
#pragma omp for schedule(static)
                for (int64_t s = 0; s < n * KVH * parts; s++) { /* a token's K/V head's query heads, or a part */
                    int64_t i = s / (KVH * parts), g = s / parts % KVH, h0 = g * group_size + s % parts * per;
                    int64_t G = heads_in_part(group_size, per, s % parts);
                    attend_group(q + i * qn + h0 * QS, QS, G, lk + g * capacity * D, lv + g * capacity * D, seen,
                                 allow ? allow + i * seen : NULL, at + i, NULL, NULL, D, scale,
                                 L->sinks ? L->sinks + h0 : NULL, scores, attn + i * nq_l + h0 * D, D);
                    for (int64_t h = h0; L->attn_gate && h < h0 + G; h++)
                        for (int64_t j = 0; j < D; j++) attn[i * nq_l + h * D + j] *= sigmoidf(q[i * qn + h * QS + D + j]);
                }
                make_inputs(attn, n, nq_l, mine, xt, &few);
#pragma omp for schedule(static)
                for (int64_t s = 0; s < units_of(&L->o, &few); s++) {
                    product(&L->o, s, attn, n, out, wbuf, &few);
                    if (!L->post_attn_norm)
                        for (int64_t i = 0; i < n; i++)
                            for (int64_t r = s * U; r < H && r < (s + 1) * U; r++) x[i * H + r] += out[i * H + r];
                }
                if (L->post_attn_norm) { /* each token's whole output normed, then added */
#pragma omp for schedule(static)
                    for (int64_t i = 0; i < n; i++)
                        add_out(x + i * H, out + i * H, L->post_attn_norm, rms_scale(out + i * H, L->post_attn_eps, H), 0, H);
                }
            }
            const float *ein = L->pre_experts_norm ? xe : xn; /* the routed experts' input */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n; i++) {
                rms_norm(x + i * H, L->mlp_norm, L->mlp_eps, H, xn + i * H);
                /* Qwen3.5's shared expert: scaled by the sigmoid of its gate on the token's normed input */
                sgate[i] = L->shared_gate ? sigmoidf(dot(L->shared_gate, xn + i * H, H)) : 1.0f;
                if (L->pre_experts_norm) { /* Gemma 4: the router's and the experts' own inputs */
                    float *r = rn + i * H;
                    rms_plain(x + i * H, L->router_eps, H, r);
                    for (int64_t j = 0; j < H; j++) r[j] = (r[j] * L->router_scale[j]) * L->router_root;
                    rms_norm(x + i * H, L->pre_experts_norm, L->pre_experts_eps, H, xe + i * H);
                }
            }
            if (L->experts > 0) { /* routed experts: each token's sums and digits, then routed_pass */
#pragma omp for schedule(static)
                for (int64_t i = 0; i < n; i++) {
                    float *t16 = tok16 + i * tsum, *t32 = tok32 + i * tsum;
                    group_sums(ein + i * H, H, t16, t32);
                    make_digits(ein + i * H, H, (char *)(t32 + H / 32 + 1), &tokd[i]);
                }
                routed_pass(L, n, H, ein, L->pre_experts_norm ? rn : xn, tok16, tok32, tsum, tokd, logits, route, &R,
                            ptrs + (size_t)t * (size_t)(4 * P), mines + (size_t)t * mine_floats, wbuf,
                            L->pre_experts_norm ? eout : x, !L->pre_experts_norm);
                if (!L->gate.n) continue; /* else its shared expert, as a dense MLP of the same input */
            }
            int64_t I = L->gate.n;
            make_inputs(xn, n, H, mine, xt, &few);
#pragma omp for schedule(static)
            for (int64_t s = 0; s < units_of(&L->gate, &few); s++) {
                product(&L->gate, s, xn, n, gate, wbuf, &few);
                product(&L->up, s, xn, n, up, wbuf, &few);
                for (int64_t i = 0; i < n; i++)
                    for (int64_t r = s * U; r < I && r < (s + 1) * U; r++)
                        gate[i * I + r] = gated(gate[i * I + r], up[i * I + r], L->act);
            }
            make_inputs(gate, n, I, mine, xt, &few);
            if (L->pre_experts_norm) { /* Gemma 4's MoE block: the MLP's and the experts' outputs, normed, summed */
#pragma omp for schedule(static)
                for (int64_t s = 0; s < units_of(&L->down, &few); s++) product(&L->down, s, gate, n, out, wbuf, &few);
#pragma omp for schedule(static)
                for (int64_t i = 0; i < n; i++) { /* (rn: the sum, the router being done) */
                    float r = block_sum(out + i * H, eout + i * H, L, H, rn + i * H);
                    block_add(x + i * H, rn + i * H, L, r, 0, H);
                }
            } else {
#pragma omp for schedule(static)
                for (int64_t s = 0; s < units_of(&L->down, &few); s++) {
                    product(&L->down, s, gate, n, out, wbuf, &few);
                    if (!L->post_mlp_norm)
                        for (int64_t i = 0; i < n; i++)
                            for (int64_t r = s * U; r < H && r < (s + 1) * U; r++)
                                x[i * H + r] += sgate[i] * out[i * H + r];
                }
                if (L->post_mlp_norm) {
#pragma omp for schedule(static)
                    for (int64_t i = 0; i < n; i++)
                        add_out(x + i * H, out + i * H, L->post_mlp_norm, rms_scale(out + i * H, L->post_mlp_eps, H), 0, H);
                }
            }
            if (L->ple_dim) { /* Gemma 4's per-layer input: x += norm(proj(GELU(gate x) * input)) */
                int64_t PL = L->ple_dim;
                make_inputs(x, n, H, mine, xt, &few);
#pragma omp for schedule(static)
                for (int64_t s = 0; s < units_of(&L->ple_gate, &few); s++) {
                    product(&L->ple_gate, s, x, n, pgs, wbuf, &few);
                    for (int64_t i = 0; i < n; i++)
                        for (int64_t r = s * U; r < PL && r < (s + 1) * U; r++)
                            pgs[i * PL + r] = gated(pgs[i * PL + r], ple[i * L->ple_stride + l * PL + r], 1);
                }
                if (L->ple_out.n) { /* the projection packed */
                    make_inputs(pgs, n, PL, mine, xt, &few);
#pragma omp for schedule(static)
                    for (int64_t s = 0; s < units_of(&L->ple_out, &few); s++)
                        product(&L->ple_out, s, pgs, n, out, wbuf, &few);
                } else {
#pragma omp for schedule(static)
                    for (int64_t s = 0; s < n * H; s++) out[s] = dot(L->ple_proj + (s % H) * PL, pgs + (s / H) * PL, PL);
                }
#pragma omp for schedule(static)
                for (int64_t i = 0; i < n; i++)
                    add_out(x + i * H, out + i * H, L->ple_norm, rms_scale(out + i * H, L->ple_eps, H), 0, H);
            }
            if (L->layer_scale != 0.0f) {
#pragma omp for schedule(static)
                for (int64_t i = 0; i < n * H; i++) x[i] = x[i] * L->layer_scale;
            }
        }
    }
    free(R.pxt);
    free(xt);
    free(fewmem);
    free(buf);
    free(routed_mem);
    return 0;
}
