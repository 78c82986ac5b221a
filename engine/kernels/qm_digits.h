/* Integer row products for a decode step and a small pass on CPUs with AVX-512 VNNI (AMD Zen 4
 * and later, Intel Xeons since Ice Lake), or AVX2 with AVX-VNNI (Intel desktop CPUs since Alder
 * Lake): included by qmatmul.c, which defines QM_VNNI or QM_VNNI256 for them.
 *
 * A step's rows are compute-bound on such a CPU (about 9 G weights/s a thread through the fp32
 * path, whether the codes sit in L2 or stream): every code is converted to fp32 and multiplied
 * by an fp32 activation, and the conversions set the pace. VNNI's dot instruction multiplies 64
 * unsigned bytes by 64 signed bytes and adds each four products into a 32-bit lane, in one
 * instruction. llama.cpp gets there by rounding activations to 8 bits (Q8_0), which changes the
 * model's arithmetic. Here they keep 22 bits:
 *
 * - Each block of 32 activations gets one power of two, its unit u, the smallest with
 *   max |x| < 2^22 u, and each value the integer v = round(x / u), |v| <= 2^22. So a value is
 *   off by at most u / 2 <= 2^-23 of its block's largest (fp32 itself rounds each value to
 *   2^-24 of its own size, and a sum of fp32 products to about that of its largest term).
 *   Measured: a product's error is a few times 1e-7 of the sum of its terms' sizes, against
 *   about 1e-7 through fp32 (tests/engine/kernels/test_qmatmul.py).
 * - v is written as three signed bytes, v = a * 65536 + b * 256 + c (b, c in -128..127, a in
 *   -64..64), and a group's sum of code * v is three dot instructions, exactly, in 32-bit lanes:
 *   a q4 code is at most 15, so a lane stays under 4 * 15 * 2^22 with two shifts between the
 *   dots; a q8 code is offset to 0..255 (code + 128, its share taken back with the group's sum
 *   of v) and keeps a's share in a lane of its own.
 * - Each group's integers are then turned into fp32 and times scale * u; the minimums' share is
 *   the fp32 group sum of x, as in the fp32 rows.
 *
 * Zero or tiny blocks (max |x| < 2^-105) count as zero; a block with an infinite or NaN value
 * gives NaN, as the fp32 product would. Rows whose input length is not a multiple of 64 take
 * the fp32 path.
 */
#define QM_FEW 4 /* tokens a small pass dots with each unpacked chunk (the VNNI rows below). Measured, a
                   * q4 1536x576 weight from L3, one thread, AVX-512 VNNI: 1-4 tokens 2.8 / 4.7 / 6.5 / 8.4
                   * ms for 60 of them, the fp32 tiles 2-4 tokens 15.3 / 11.6 / 9.9 and 8 tokens 13.4 (past
                   * 4, each further token's integer dot costs more than the tiles' shared decoding) */
/* QM_ROWS rows of a weight at once: they share each chunk's digit loads and the loop's
 * bookkeeping, which one row of a few hundred values could not hide (a row of 576 q4 codes:
 * 65-75 ns alone, 30-45 ns four at a time). And the codes QM_AHEAD blocks of rows ahead are
 * prefetched: a step's weights stream from L3 or memory, a row at a time too short for the
 * hardware's prefetcher to run ahead (four rows of 576 q4 codes from L3: 13.6 -> 18 G weights/s,
 * a C harness over this file, session of 2026-11-27). The fp32 rows take them one at a time.
 * Prefetched into L2 (QM_HINT), with the rows' scales and minimums (prefetch_params). */
#define QM_ROWS 4
#define QM_AHEAD 4
#define QM_HINT _MM_HINT_T1 /* into L2, not L1: a q4 step 1.55x faster than with T0 on an AMD EPYC (Zen 4),
                             * 75,968 x 2048 codes 5.15 -> 3.3 ms, 2 threads; AHEAD 1-8 alike with T1 */
#define QM_INLINE static inline __attribute__((always_inline))

#ifdef QM_VNNI

typedef struct {
    int8_t *nat[3]; /* the digits a, b, c of v, in the activations' order */
    int8_t *q4[3];  /* the same, reordered as q4 codes unpack (see q4_rows_vnni): each 128 as x 0-15, 32-47,
                     * 64-79, 96-111 (low nibbles), then 16-31, 48-63, 80-95, 112-127 (high nibbles); a last
                     * 64 (n = 64 mod 128) as x 0-15, 32-47, 16-31, 48-63 */
    int8_t *q6[3];  /* the same, each whole 128 as groups-of-16 six-bit codes unpack (linear.pack6): the
                     * first 8 values of each of its 8 groups of 16, then their last 8 */
    float *u16, *u32; /* each group of 16 / 32's unit u (a block's, for both its groups of 16) */
    float *c16, *c32; /* -128 * u * (the group's sum of v): a q8 code offset's share, taken back */
    int ok;           /* digits were made (the length is a multiple of 64) */
} qm_digits;

/* Bytes of scratch for digits of n activations. */
static size_t digits_bytes(int64_t n) { return (size_t)n * 9 + (size_t)(n / 16 + n / 32) * 2 * sizeof(float) + 64; }

/* x (n values) -> d, in `mem` (digits_bytes(n)). */
static void make_digits(const float *x, int64_t n, char *mem, qm_digits *d) {
    d->ok = n % 64 == 0;
    if (!d->ok) return;
    float *f = (float *)mem;
    d->u16 = f, d->u32 = f + n / 16, d->c16 = d->u32 + n / 32, d->c32 = d->c16 + n / 16;
    int8_t *b = (int8_t *)(d->c32 + n / 32);
    for (int i = 0; i < 3; i++) d->nat[i] = b + i * n, d->q4[i] = b + (3 + i) * n, d->q6[i] = b + (6 + i) * n;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i k128 = _mm512_set1_epi32(128), k255 = _mm512_set1_epi32(255);
    for (int64_t blk = 0; blk < n / 32; blk++) {
        __m512 x0 = _mm512_loadu_ps(x + blk * 32), x1 = _mm512_loadu_ps(x + blk * 32 + 16);
        __m512 a0 = _mm512_andnot_ps(sign, x0), a1 = _mm512_andnot_ps(sign, x1);
        __m512 big = _mm512_set1_ps(3.40282347e38f);
        int bad = _mm512_cmp_ps_mask(a0, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(a1, big, _CMP_NLE_UQ);
        float top = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        uint32_t bits;
        memcpy(&bits, &top, sizeof bits);
        int e = (int)(bits >> 23) & 255; /* top < 2^(e - 126) */
        float unit, inv;
        if (bad) /* inf or NaN: the products are NaN */
            unit = NAN, inv = 0.0f;
        else if (e < 22) /* zero, or below 2^-105: counts as zero */
            unit = 0.0f, inv = 0.0f;
        else {
            uint32_t ub = (uint32_t)(e - 21) << 23, ib = (uint32_t)(275 - e) << 23; /* 2^(e-148), 2^(148-e) */
            memcpy(&unit, &ub, sizeof unit);
            memcpy(&inv, &ib, sizeof inv);
        }
        __m512 vi = _mm512_set1_ps(inv);
        int32_t sums[2];
        for (int h = 0; h < 2; h++) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(h ? x1 : x0, vi)); /* round to nearest */
            sums[h] = _mm512_reduce_add_epi32(v);
            __m512i c = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, k128), k255), k128);
            __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(v, c), 8);
            __m512i bb = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, k128), k255), k128);
            __m512i a = _mm512_srai_epi32(_mm512_sub_epi32(r, bb), 8);
            int64_t at = blk * 32 + h * 16;
            _mm_storeu_si128((__m128i *)(d->nat[0] + at), _mm512_cvtepi32_epi8(a));
            _mm_storeu_si128((__m128i *)(d->nat[1] + at), _mm512_cvtepi32_epi8(bb));
            _mm_storeu_si128((__m128i *)(d->nat[2] + at), _mm512_cvtepi32_epi8(c));
            d->u16[blk * 2 + h] = unit;
            d->c16[blk * 2 + h] = -128.0f * unit * (float)sums[h];
        }
        d->u32[blk] = unit;
        d->c32[blk] = -128.0f * unit * (float)(sums[0] + sums[1]);
    }
    const __m512i lo = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), hi = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
    for (int i = 0; i < 3; i++) {
        int64_t k = 0;
        for (; k + 128 <= n; k += 128) { /* 16-byte eighths 0..7 -> 0 2 4 6 | 1 3 5 7 */
            __m512i a = _mm512_loadu_si512(d->nat[i] + k), b = _mm512_loadu_si512(d->nat[i] + k + 64);
            _mm512_storeu_si512(d->q4[i] + k, _mm512_permutex2var_epi64(a, lo, b));
            _mm512_storeu_si512(d->q4[i] + k + 64, _mm512_permutex2var_epi64(a, hi, b));
        }
        const __m512i even = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), odd = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
        for (int64_t j = 0; j + 128 <= n; j += 128) { /* eighths of 8 values: even ones, then odd ones */
            __m512i a = _mm512_loadu_si512(d->nat[i] + j), b = _mm512_loadu_si512(d->nat[i] + j + 64);
            _mm512_storeu_si512(d->q6[i] + j, _mm512_permutex2var_epi64(a, even, b));
            _mm512_storeu_si512(d->q6[i] + j + 64, _mm512_permutex2var_epi64(a, odd, b));
        }
        if (k < n) /* quarters A B C D -> A C B D */
            _mm512_storeu_si512(d->q4[i] + k, _mm512_shuffle_i64x2(_mm512_loadu_si512(d->nat[i] + k),
                                                                   _mm512_loadu_si512(d->nat[i] + k), 0xD8));
    }
}

/* Which of a block's 8 groups each 32-bit lane of a 64-value chunk c belongs to: q4 chunks hold
 * groups 2c and 2c+1 as (g x4, g+1 x4, g x4, g+1 x4) (see row_q4_vnni); q8 chunks hold them in
 * order, two groups of 32 or four of 16. */
static const int32_t LANES_Q4[4][16] = {{0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1},
                                        {2, 2, 2, 2, 3, 3, 3, 3, 2, 2, 2, 2, 3, 3, 3, 3},
                                        {4, 4, 4, 4, 5, 5, 5, 5, 4, 4, 4, 4, 5, 5, 5, 5},
                                        {6, 6, 6, 6, 7, 7, 7, 7, 6, 6, 6, 6, 7, 7, 7, 7}};
static const int32_t LANES_Q4W[2][16] = {{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
                                         {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7}};
static const int32_t LANES_Q6_16[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
static const int32_t LANES_Q8_32[4][16] = {{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
                                           {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
                                           {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
                                           {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7}};
static const int32_t LANES_Q8_16[2][16] = {{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
                                           {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7}};

/* The exact sum over 64 values of code * v (codes at most 15): w holds 64 unsigned codes, a/b/c
 * the digits. */
static inline __m512i dot_digits(__m512i w, const int8_t *a, const int8_t *b, const int8_t *c) {
    __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(a));
    t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), w, _mm512_loadu_si512(b));
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), w, _mm512_loadu_si512(c));
}

/* n (<= 8) fp32 or fp16 values from p + g, the rest zero. */
static inline __m256 load_params(const void *p, int half, int64_t g, int64_t n) {
    __mmask8 live = (__mmask8)((1u << n) - 1);
    if (half) return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(live, (const uint16_t *)p + g));
    return _mm256_maskz_loadu_ps(live, (const float *)p + g);
}

/* Prefetch the scales and minimums of the rows QM_AHEAD blocks of rows ahead, at group g: they are
 * streams of their own beside the codes (a q4 row of 2048 values with fp16 scales and minimums:
 * 1 KiB of codes, 256 bytes of these), and their misses stalled each 8 groups' set-up (perf: four
 * tenths of a step's samples). One line holds 32 fp16 or 16 fp32 values: once per line. */
QM_INLINE void prefetch_params(const void *sc, const void *mn, int64_t ps, int half, int64_t g, int R) {
    if ((g * (half ? 2 : 4)) % 64) return;
    for (int r = 0; r < R; r++) {
        _mm_prefetch((const char *)row_at(sc, (r + QM_AHEAD * QM_ROWS) * ps + g, half), QM_HINT);
        if (mn) _mm_prefetch((const char *)row_at(mn, (r + QM_AHEAD * QM_ROWS) * ps + g, half), QM_HINT);
    }
}

/* Rows 0 .. R-1 of a q4 weight times the digits of tokens 0 .. few-1 (d[i], their group sums
 * xsum[i]) into out[r * os + i]: codes at p + r * rb, scales and minimums at sc/mn + r * ps (fp16
 * where half). Each 64 values are groups g, g + 1, whose 32 code bytes unpack to (low nibbles:
 * g 0-15, g+1 0-15 | high nibbles: g 16-31, g+1 16-31), lanes g g g g, g+1 x4, g x4, g+1 x4; the
 * digits were laid out (q4[]) to match. A row's codes are unpacked once for all the tokens, a
 * token's digits loaded once for all the rows. */
QM_INLINE void q4_rows_vnni(const qm_digits *d, const float *const *xsum, const int few, const uint8_t *p,
                            int64_t rb, const void *sc, const void *mn, int64_t ps, int half, int64_t K, const int R,
                            float *out, int64_t os, const int mode) {
    /* mode 1 (QM_OFF8, no minimums): each value scale * (code - 8); the offset's share, -8 u (the
     * group's sum of v), is c32 / 16. Mode 2 (QM_E2M1): each code shuffled to its E2M1 value + 12
     * (0..24: a lane's 8 products stay under 2^30 after the shifts), the share -12 u (sum of v) */
    const int off8 = mode != 0;
    const float share = mode == 2 ? 12.0f / 128.0f : 1.0f / 16.0f;
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    __m512i lanes[4];
    for (int c = 0; c < 4; c++) lanes[c] = _mm512_loadu_si512(LANES_Q4[c]);
    const __m512i wide[2] = {_mm512_loadu_si512(LANES_Q4W[0]), _mm512_loadu_si512(LANES_Q4W[1])};
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m512i m4w = _mm512_set1_epi8(15);
    __m512 acc[QM_ROWS][QM_FEW], f[QM_ROWS][QM_FEW];
    __m256 ext[QM_ROWS][QM_FEW];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < few; i++) acc[r][i] = _mm512_setzero_ps(), ext[r][i] = _mm256_setzero_ps();
    int64_t groups = K / 32;
    for (int64_t g = 0; g < groups; g += 8) {
        int64_t n = groups - g < 8 ? groups - g : 8; /* even: K is a multiple of 64 */
        __mmask8 live = (__mmask8)((1u << n) - 1);
        __m256 u[QM_FEW], xs[QM_FEW];
        for (int i = 0; i < few; i++) {
            u[i] = _mm256_maskz_loadu_ps(live, d[i].u32 + g), xs[i] = mn ? _mm256_maskz_loadu_ps(live, xsum[i] + g) : u[i];
            if (off8) xs[i] = _mm256_mul_ps(_mm256_maskz_loadu_ps(live, d[i].c32 + g), _mm256_set1_ps(share));
        }
        prefetch_params(sc, mn, ps, half, g, R);
        for (int r = 0; r < R; r++) {
            __m256 s = load_params(row_at(sc, r * ps, half), half, g, n);
            __m256 m = mn ? load_params(row_at(mn, r * ps, half), half, g, n) : s;
            for (int i = 0; i < few; i++) {
                f[r][i] = _mm512_castps256_ps512(_mm256_mul_ps(s, u[i]));
                if (mn) ext[r][i] = _mm256_fmadd_ps(m, xs[i], ext[r][i]);
                if (off8) ext[r][i] = _mm256_fmadd_ps(s, xs[i], ext[r][i]);
            }
        }
        for (int64_t c = 0; c < n / 4; c++) { /* 128 values: groups g + 4c .. g + 4c + 3 */
            int64_t at = (g + 4 * c) * 32;
            __m512i lo[QM_ROWS], hi[QM_ROWS];
            for (int r = 0; r < R; r++) {
                const uint8_t *row = p + r * rb + at / 2;
                _mm_prefetch((const char *)(row + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                __m512i bytes = _mm512_loadu_si512(row);
                lo[r] = _mm512_and_si512(bytes, m4w), hi[r] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), m4w);
                if (mode == 2) lo[r] = _mm512_shuffle_epi8(lut, lo[r]), hi[r] = _mm512_shuffle_epi8(lut, hi[r]);
            }
            for (int i = 0; i < few; i++) {
                const int8_t *da = d[i].q4[0] + at, *db = d[i].q4[1] + at, *dc = d[i].q4[2] + at;
                __m512i a0 = _mm512_loadu_si512(da), a1 = _mm512_loadu_si512(da + 64);
                __m512i b0 = _mm512_loadu_si512(db), b1 = _mm512_loadu_si512(db + 64);
                __m512i c0 = _mm512_loadu_si512(dc), c1 = _mm512_loadu_si512(dc + 64);
                for (int r = 0; r < R; r++) { /* a lane sums 8 products: under 2^29 after the shifts */
                    __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], a0), hi[r], a1);
                    t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), lo[r], b0), hi[r], b1);
                    t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), lo[r], c0), hi[r], c1);
                    acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_permutexvar_ps(wide[c], f[r][i]),
                                                acc[r][i]);
                }
            }
        }
        if (n % 4) { /* the row's last 64 values: groups g + n - 2, g + n - 1 */
            const int64_t c = (n - 2) / 2, at = (g + 2 * c) * 32;
            __m512i w[QM_ROWS];
            for (int r = 0; r < R; r++) {
                const uint8_t *row = p + r * rb + at / 2;
                _mm_prefetch((const char *)(row + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                __m256i bytes = _mm256_loadu_si256((const __m256i *)row);
                w[r] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, m4)),
                                          _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4), 1);
                if (mode == 2) w[r] = _mm512_shuffle_epi8(lut, w[r]);
            }
            for (int i = 0; i < few; i++) {
                __m512i da = _mm512_loadu_si512(d[i].q4[0] + at), db = _mm512_loadu_si512(d[i].q4[1] + at),
                        dc = _mm512_loadu_si512(d[i].q4[2] + at);
                for (int r = 0; r < R; r++) {
                    __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], da);
                    t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), w[r], db);
                    t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), w[r], dc);
                    acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_permutexvar_ps(lanes[c], f[r][i]),
                                                acc[r][i]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < few; i++) out[r * os + i] = _mm512_reduce_add_ps(acc[r][i]) + hsum(ext[r][i]);
}

/* The same for q8 rows (groups of 16 or 32): codes + 128 as unsigned bytes; the offset's share
 * (128 * the group's sum of v) comes back through c16/c32. */
QM_INLINE void q8_rows_vnni(const qm_digits *d, const float *const *xsum, const int few, const int8_t *codes,
                            int64_t rb, const void *sc, const void *mn, int64_t ps, int half, int64_t K,
                            int64_t group, const int R, float *out, int64_t os, const int six, const int iq4,
                            const int low) {
    /* six: kind-6 codes (see expand_q6), c = code + 32 made in registers: a whole 128 from its 96
     * bytes at once (the low nibbles give values 0-63 and 64-127 in order; the top bits of four
     * values a byte, each 32 shifted to bits 4-5 within their 64-bit lanes and masked), kept for
     * its second 64; a last 64 from its 48; the offset's share is a quarter of q8's */
    const __m512i shifts = _mm512_setr_epi64(0, 0, 2, 2, 4, 4, 6, 6), three = _mm512_set1_epi8(3);
    const __m512i up_lo = _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2), down_hi = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2);
    const __m512i m4w = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m512i pairs = _mm512_loadu_si512(LANES_Q6_16);
    __m512i second[QM_ROWS]; /* a whole 128's values 64-127, for its second chunk (groups of 32) */
    for (int r = 0; r < QM_ROWS; r++) second[r] = _mm512_setzero_si512();
    __m512i lanes32[4], lanes16[2];
    for (int c = 0; c < 4; c++) lanes32[c] = _mm512_loadu_si512(LANES_Q8_32[c]);
    for (int c = 0; c < 2; c++) lanes16[c] = _mm512_loadu_si512(LANES_Q8_16[c]);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    /* low (kinds 2 and 3, groups of 16, whole 128s): the two-bit fields of 32 bytes, broadcast to
     * both halves, shifted per 64-bit lane to bits 0-1 (lo: fields 0 and 1, hi: 2 and 3); kind 3's
     * third bits from two 64-bit masks, adding 4 (c = code + 4: the share is 4/128 of q8's) */
    const __m512i low_lo = _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2), low_hi = _mm512_setr_epi64(4, 4, 4, 4, 6, 6, 6, 6);
    const __m512i four = _mm512_set1_epi8(4);
    const int64_t low_bytes = low == 2 ? 32 : 48; /* a 128's bytes */
    /* iq4 (QM_IQ4, groups of 32): each 64 values' 32 bytes of nibbles, shuffled to value + 128 */
    const __m512i iq4_lut = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141,
                                                                 (char)153, (char)166, (char)181, (char)197, (char)217, (char)241));
    const __m512 k65536 = _mm512_set1_ps(65536.0f);
    int per = (int)(64 / group); /* groups in 64 values */
    __m512 acc[QM_ROWS][QM_FEW], f[QM_ROWS][QM_FEW];
    __m256 ext[QM_ROWS][QM_FEW];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < few; i++) acc[r][i] = _mm512_setzero_ps(), ext[r][i] = _mm256_setzero_ps();
    int64_t groups = K / group;
    for (int64_t g = 0; g < groups; g += 8) {
        int64_t n = groups - g < 8 ? groups - g : 8; /* a multiple of `per` */
        __mmask8 live = (__mmask8)((1u << n) - 1);
        __m256 u[QM_FEW], bk[QM_FEW], xs[QM_FEW];
        for (int i = 0; i < few; i++) {
            u[i] = _mm256_maskz_loadu_ps(live, (group == 16 ? d[i].u16 : d[i].u32) + g);
            bk[i] = _mm256_maskz_loadu_ps(live, (group == 16 ? d[i].c16 : d[i].c32) + g);
            if (six || low) bk[i] = _mm256_mul_ps(bk[i], _mm256_set1_ps(six ? 0.25f : low == 3 ? 1.0f / 32.0f : 0.0f));
            xs[i] = mn ? _mm256_maskz_loadu_ps(live, xsum[i] + g) : u[i];
        }
        prefetch_params(sc, mn, ps, half, g, R);
        for (int r = 0; r < R; r++) {
            __m256 s = load_params(row_at(sc, r * ps, half), half, g, n);
            __m256 m = mn ? load_params(row_at(mn, r * ps, half), half, g, n) : s;
            for (int i = 0; i < few; i++) {
                ext[r][i] = _mm256_fmadd_ps(s, bk[i], ext[r][i]);
                if (mn) ext[r][i] = _mm256_fmadd_ps(m, xs[i], ext[r][i]);
                f[r][i] = _mm512_castps256_ps512(_mm256_mul_ps(s, u[i]));
            }
        }
        if ((six || low) && group == 16 && n == 8) { /* a whole 128 of groups of 16: both halves' dots in one lane */
            int64_t at = g * 16;
            __m512i lo[QM_ROWS], hi[QM_ROWS];
            for (int r = 0; r < R; r++) {
                if (low) {
                    const uint8_t *row = (const uint8_t *)codes + r * rb + at / 128 * low_bytes;
                    _mm_prefetch((const char *)(row + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                    __m512i top = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)row));
                    lo[r] = _mm512_and_si512(_mm512_srlv_epi64(top, low_lo), three);
                    hi[r] = _mm512_and_si512(_mm512_srlv_epi64(top, low_hi), three);
                    if (low == 3) {
                        uint64_t m[2];
                        memcpy(m, row + 32, sizeof m);
                        lo[r] = _mm512_mask_add_epi8(lo[r], (__mmask64)m[0], lo[r], four);
                        hi[r] = _mm512_mask_add_epi8(hi[r], (__mmask64)m[1], hi[r], four);
                    }
                    continue;
                }
                const uint8_t *row = (const uint8_t *)codes + r * rb + at / 128 * 96;
                _mm_prefetch((const char *)(row + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                _mm_prefetch((const char *)(row + 64 + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                __m512i bytes = _mm512_loadu_si512(row);
                __m512i top = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 64)));
                lo[r] = _mm512_or_si512(_mm512_and_si512(bytes, m4w), _mm512_and_si512(_mm512_sllv_epi64(top, up_lo), m30));
                hi[r] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), m4w),
                                        _mm512_and_si512(_mm512_srlv_epi64(top, down_hi), m30));
            }
            for (int i = 0; i < few; i++) {
                const int8_t *da = d[i].q6[0] + at, *db = d[i].q6[1] + at, *dc = d[i].q6[2] + at;
                __m512i a0 = _mm512_loadu_si512(da), a1 = _mm512_loadu_si512(da + 64);
                __m512i b0 = _mm512_loadu_si512(db), b1 = _mm512_loadu_si512(db + 64);
                __m512i c0 = _mm512_loadu_si512(dc), c1 = _mm512_loadu_si512(dc + 64);
                for (int r = 0; r < R; r++) { /* 8 products a lane, codes <= 63: under 2^31 (2,130,508,800) */
                    __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], a0), hi[r], a1);
                    t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), lo[r], b0), hi[r], b1);
                    t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), lo[r], c0), hi[r], c1);
                    acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_permutexvar_ps(pairs, f[r][i]), acc[r][i]);
                }
            }
            continue;
        }
        for (int64_t c = 0; c < n / per; c++) {
            int64_t at = g * group + c * 64;
            __m512i idx = group == 16 ? lanes16[c] : lanes32[c];
            __m512i w[QM_ROWS];
            for (int r = 0; r < R; r++) {
                if (six && at + 128 - at % 128 <= K) { /* in a whole 128 */
                    if (at % 128) {
                        w[r] = second[r];
                        continue;
                    }
                    const uint8_t *row = (const uint8_t *)codes + r * rb + at / 128 * 96;
                    _mm_prefetch((const char *)(row + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                    _mm_prefetch((const char *)(row + 64 + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                    __m512i bytes = _mm512_loadu_si512(row);
                    __m512i top = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 64)));
                    w[r] = _mm512_or_si512(_mm512_and_si512(bytes, m4w),
                                           _mm512_and_si512(_mm512_sllv_epi64(top, up_lo), m30));
                    second[r] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), m4w),
                                                _mm512_and_si512(_mm512_srlv_epi64(top, down_hi), m30));
                    continue;
                }
                if (six) {
                    const uint8_t *row = (const uint8_t *)codes + r * rb + at / 64 * 48;
                    _mm_prefetch((const char *)(row + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                    __m256i bytes = _mm256_loadu_si256((const __m256i *)row);
                    __m512i nib = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, m4)),
                                                     _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4), 1);
                    __m512i top = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(row + 32)));
                    top = _mm512_and_si512(_mm512_srlv_epi64(top, shifts), three);
                    w[r] = _mm512_or_si512(nib, _mm512_slli_epi16(top, 4));
                    continue;
                }
                if (iq4) { /* groups g, g+1: (low nibbles, high nibbles) each, in order */
                    const uint8_t *row = (const uint8_t *)codes + r * rb + at / 2;
                    _mm_prefetch((const char *)(row + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                    __m256i bytes = _mm256_loadu_si256((const __m256i *)row);
                    __m512i nib = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, m4)),
                                                     _mm256_and_si256(_mm256_srli_epi16(bytes, 4), m4), 1);
                    w[r] = _mm512_shuffle_epi8(iq4_lut, _mm512_shuffle_i64x2(nib, nib, 0xD8));
                    continue;
                }
                const int8_t *row = codes + r * rb + at;
                _mm_prefetch((const char *)(row + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                w[r] = _mm512_xor_si512(_mm512_loadu_si512(row), flip);
            }
            for (int i = 0; i < few; i++) {
                __m512i da = _mm512_loadu_si512(d[i].nat[0] + at), db = _mm512_loadu_si512(d[i].nat[1] + at),
                        dc = _mm512_loadu_si512(d[i].nat[2] + at);
                for (int r = 0; r < R; r++) {
                    if (six) { /* codes up to 63: the three dots in one lane, as q4's (under 2^31) */
                        __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], da);
                        t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), w[r], db);
                        t = _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), w[r], dc);
                        acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_permutexvar_ps(idx, f[r][i]),
                                                    acc[r][i]);
                        continue;
                    }
                    /* codes up to 255: a's share apart, b's and c's together (each fits 32 bits) */
                    __m512i ta = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], da);
                    __m512i tb = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], db);
                    tb = _mm512_dpbusd_epi32(_mm512_slli_epi32(tb, 8), w[r], dc);
                    __m512 fl = _mm512_permutexvar_ps(idx, f[r][i]);
                    acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ta), _mm512_mul_ps(fl, k65536), acc[r][i]);
                    acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tb), fl, acc[r][i]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < few; i++) out[r * os + i] = _mm512_reduce_add_ps(acc[r][i]) + hsum(ext[r][i]);
}

#endif

#include "qm_digits256.h"

#if defined(QM_VNNI) || defined(QM_VNNI256)
/* Whether a row of w's kind, group and length takes the digits. */
static inline int takes_digits(const qm_digits *d, int64_t kind, int64_t K, int64_t group) {
#ifdef QM_VNNI
    const int six = 1;
#else
    const int six = 0; /* the AVX-VNNI build reads kind 6 through the fp32 rows */
#endif
    kind = QM_KIND(kind);
    int low = kind == 2 || kind == 3; /* whole 128s of groups of 16 only (the fp32 rows read the rest) */
    return d->ok && K % 64 == 0 && (kind == 4 || group == 16 || group == 32) && (kind != 6 || six)
           && (!low || (six && group == 16 && K % 128 == 0));
}

/* Rows 0 .. rows - 1 (rows <= QM_ROWS) of a kind-4 or kind-8 weight times the digits of tokens
 * 0 .. few - 1 (few <= QM_FEW) into out[r * os + i]: codes at codes + r * rb bytes, scales and
 * minimums at sc/mn + r * ps entries. */
static void rows_vnni(const qm_digits *d, const float *const *xsum, int few, int64_t kind, const void *codes,
                      int64_t rb, const void *sc, const void *mn, int64_t ps, int half, int64_t K, int64_t group,
                      int rows, float *out, int64_t os) {
/* (six and iq4 constants in each copy: Q8_0's rows keep no test of them in their loop) */
#define QM_BLOCK(F)                                                                                              \
    (QM_KIND(kind) == 4 ? q4_rows_vnni(d, xsum, F, (const uint8_t *)codes, rb, sc, mn, ps, half, K, QM_ROWS, out, os, \
                                       QM_Q4_MODE(kind))                                                        \
     : kind == 6 ? q8_rows_vnni(d, xsum, F, (const int8_t *)codes, rb, sc, mn, ps, half, K, group, QM_ROWS, out, os, 1, 0, 0) \
     : kind == 2 ? q8_rows_vnni(d, xsum, F, (const int8_t *)codes, rb, sc, mn, ps, half, K, group, QM_ROWS, out, os, 0, 0, 2) \
     : kind == 3 ? q8_rows_vnni(d, xsum, F, (const int8_t *)codes, rb, sc, mn, ps, half, K, group, QM_ROWS, out, os, 0, 0, 3) \
     : (kind & QM_IQ4) ? q8_rows_vnni(d, xsum, F, (const int8_t *)codes, rb, sc, mn, ps, half, K, group, QM_ROWS, out, os, 0, 1, 0) \
                       : q8_rows_vnni(d, xsum, F, (const int8_t *)codes, rb, sc, mn, ps, half, K, group, QM_ROWS, out, os, 0, 0, 0))
    if (rows == QM_ROWS) { /* the token count a constant: its loops unrolled, its accumulators in registers */
        if (few == 1)
            QM_BLOCK(1);
        else if (few == 2)
            QM_BLOCK(2);
        else if (few == 3)
            QM_BLOCK(3);
        else
            QM_BLOCK(QM_FEW);
        return;
    }
#undef QM_BLOCK
    for (int r = 0; r < rows; r++) {
        const void *c = (const char *)codes + r * rb, *s = row_at(sc, r * ps, half), *m = row_at(mn, r * ps, half);
        if (QM_KIND(kind) == 4)
            q4_rows_vnni(d, xsum, few, (const uint8_t *)c, rb, s, m, ps, half, K, 1, out + r * os, os, QM_Q4_MODE(kind));
        else
            q8_rows_vnni(d, xsum, few, (const int8_t *)c, rb, s, m, ps, half, K, group, 1, out + r * os, os, kind == 6,
                         (kind & QM_IQ4) != 0, kind == 2 || kind == 3 ? (int)kind : 0);
    }
}
#else
typedef struct {
    int ok;
} qm_digits;
static size_t digits_bytes(int64_t n) { return (void)n, 0; }
static void make_digits(const float *x, int64_t n, char *mem, qm_digits *d) { (void)x, (void)n, (void)mem, d->ok = 0; }
#endif
