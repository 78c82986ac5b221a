/* The integer rows of qm_digits.h on AVX2 CPUs with AVX-VNNI (Intel desktop CPUs since Alder
 * Lake): 32 codes a dot instruction, the same digits and the same sums. Included by qm_digits.h
 * where qmatmul.c defines QM_VNNI256. */
#ifdef QM_VNNI256
/* ---- The same on AVX2 CPUs with AVX-VNNI (Intel's since Alder Lake): 32 codes a dot ----
 * A group of 32 q4 codes unpacks in order (low nibbles: values 0-15, high: 16-31), so the digits
 * keep the activations' order (q4[] is nat[]). */
typedef struct {
    int8_t *nat[3], *q4[3];
    float *u16, *u32, *c16, *c32;
    int ok;
} qm_digits;

static size_t digits_bytes(int64_t n) { return (size_t)n * 3 + (size_t)(n / 16 + n / 32) * 2 * sizeof(float) + 64; }

/* Signed bytes of 8 int32 digits x 4 (32 values, in order). */
static inline __m256i bytes_of(__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(d0, d1), _mm256_packs_epi32(d2, d3));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static void make_digits(const float *x, int64_t n, char *mem, qm_digits *d) {
    d->ok = n % 64 == 0;
    if (!d->ok) return;
    float *f = (float *)mem;
    d->u16 = f, d->u32 = f + n / 16, d->c16 = d->u32 + n / 32, d->c32 = d->c16 + n / 16;
    int8_t *b = (int8_t *)(d->c32 + n / 32);
    for (int i = 0; i < 3; i++) d->nat[i] = d->q4[i] = b + i * n;
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(3.40282347e38f);
    const __m256i k128 = _mm256_set1_epi32(128), k255 = _mm256_set1_epi32(255);
    for (int64_t blk = 0; blk < n / 32; blk++) {
        __m256 xv[4], top = _mm256_setzero_ps();
        int bad = 0;
        for (int h = 0; h < 4; h++) {
            xv[h] = _mm256_loadu_ps(x + blk * 32 + h * 8);
            __m256 a = _mm256_andnot_ps(sign, xv[h]);
            bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_NLE_UQ));
            top = _mm256_max_ps(top, a);
        }
        float t8[8], tmax = 0.0f;
        _mm256_storeu_ps(t8, top);
        for (int j = 0; j < 8; j++) tmax = t8[j] > tmax ? t8[j] : tmax;
        uint32_t bits;
        memcpy(&bits, &tmax, sizeof bits);
        int e = (int)(bits >> 23) & 255;
        float unit, inv;
        if (bad)
            unit = NAN, inv = 0.0f;
        else if (e < 22)
            unit = 0.0f, inv = 0.0f;
        else {
            uint32_t ub = (uint32_t)(e - 21) << 23, ib = (uint32_t)(275 - e) << 23;
            memcpy(&unit, &ub, sizeof unit);
            memcpy(&inv, &ib, sizeof inv);
        }
        __m256 vi = _mm256_set1_ps(inv);
        __m256i da[4], db[4], dc[4];
        int32_t sums[2] = {0, 0};
        for (int h = 0; h < 4; h++) {
            __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(xv[h], vi));
            int32_t v8[8];
            _mm256_storeu_si256((__m256i *)v8, v);
            for (int j = 0; j < 8; j++) sums[h / 2] += v8[j];
            dc[h] = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(v, k128), k255), k128);
            __m256i r = _mm256_srai_epi32(_mm256_sub_epi32(v, dc[h]), 8);
            db[h] = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(r, k128), k255), k128);
            da[h] = _mm256_srai_epi32(_mm256_sub_epi32(r, db[h]), 8);
        }
        _mm256_storeu_si256((__m256i *)(d->nat[0] + blk * 32), bytes_of(da[0], da[1], da[2], da[3]));
        _mm256_storeu_si256((__m256i *)(d->nat[1] + blk * 32), bytes_of(db[0], db[1], db[2], db[3]));
        _mm256_storeu_si256((__m256i *)(d->nat[2] + blk * 32), bytes_of(dc[0], dc[1], dc[2], dc[3]));
        for (int h = 0; h < 2; h++) d->u16[blk * 2 + h] = unit, d->c16[blk * 2 + h] = -128.0f * unit * (float)sums[h];
        d->u32[blk] = unit;
        d->c32[blk] = -128.0f * unit * (float)(sums[0] + sums[1]);
    }
}

static inline __m256 load_params(const void *p, int half, int64_t g, int64_t n, float *tmp) {
    if (n == 8) return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + g)))
                            : _mm256_loadu_ps((const float *)p + g);
    for (int64_t j = 0; j < 8; j++) tmp[j] = j < n ? scale_at(p, g + j, half) : 0.0f;
    return _mm256_loadu_ps(tmp);
}

static inline __m256 load_some(const float *p, int64_t n, float *tmp) {
    if (n == 8) return _mm256_loadu_ps(p);
    for (int64_t j = 0; j < 8; j++) tmp[j] = j < n ? p[j] : 0.0f;
    return _mm256_loadu_ps(tmp);
}

/* Rows 0 .. R-1 times the digits of tokens 0 .. few-1 into out[r * os + i], as the AVX-512 rows
 * (qm_digits.h) do: a group of 32 q4 codes unpacks in order (low nibbles: values 0-15, high:
 * 16-31), so the digits keep the activations' order. */
QM_INLINE void q4_rows_vnni(const qm_digits *d, const float *const *xsum, const int few, const uint8_t *p,
                            int64_t rb, const void *sc, const void *mn, int64_t ps, int half, int64_t K, const int R,
                            float *out, int64_t os, const int mode) {
    const __m128i m4 = _mm_set1_epi8(15);
    const int off8 = mode != 0; /* as qm_digits.h: mode 1 QM_OFF8, 2 QM_E2M1 */
    const float share = mode == 2 ? 12.0f / 128.0f : 1.0f / 16.0f;
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    __m256 acc[QM_ROWS][QM_FEW], f[QM_ROWS][QM_FEW], ext[QM_ROWS][QM_FEW];
    float tmp[8];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < few; i++) acc[r][i] = _mm256_setzero_ps(), ext[r][i] = _mm256_setzero_ps();
    int64_t groups = K / 32;
    for (int64_t g = 0; g < groups; g += 8) {
        int64_t n = groups - g < 8 ? groups - g : 8;
        __m256 u[QM_FEW], xs[QM_FEW];
        for (int i = 0; i < few; i++) {
            u[i] = load_some(d[i].u32 + g, n, tmp), xs[i] = mn ? load_some(xsum[i] + g, n, tmp) : u[i];
            if (off8) xs[i] = _mm256_mul_ps(load_some(d[i].c32 + g, n, tmp), _mm256_set1_ps(share)); /* as qm_digits.h */
        }
        for (int r = 0; r < R; r++) {
            __m256 s = load_params(row_at(sc, r * ps, half), half, g, n, tmp);
            __m256 m = mn ? load_params(row_at(mn, r * ps, half), half, g, n, tmp) : s;
            for (int i = 0; i < few; i++) {
                f[r][i] = _mm256_mul_ps(s, u[i]);
                if (mn) ext[r][i] = _mm256_fmadd_ps(m, xs[i], ext[r][i]);
                if (off8) ext[r][i] = _mm256_fmadd_ps(s, xs[i], ext[r][i]);
            }
        }
        for (int64_t c = 0; c < n; c++) {
            int64_t at = (g + c) * 32;
            __m256i w[QM_ROWS];
            for (int r = 0; r < R; r++) {
                const uint8_t *row = p + r * rb + at / 2;
                _mm_prefetch((const char *)(row + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                __m128i bytes = _mm_loadu_si128((const __m128i *)row);
                w[r] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4), _mm_and_si128(bytes, m4));
                if (mode == 2) w[r] = _mm256_shuffle_epi8(lut, w[r]);
            }
            __m256i idx = _mm256_set1_epi32((int)c);
            for (int i = 0; i < few; i++) {
                __m256i da = _mm256_loadu_si256((const __m256i *)(d[i].nat[0] + at)),
                        db = _mm256_loadu_si256((const __m256i *)(d[i].nat[1] + at)),
                        dc = _mm256_loadu_si256((const __m256i *)(d[i].nat[2] + at));
                for (int r = 0; r < R; r++) {
                    __m256i t = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w[r], da);
                    t = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(t, 8), w[r], db);
                    t = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(t, 8), w[r], dc);
                    acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_permutevar8x32_ps(f[r][i], idx), acc[r][i]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < few; i++) out[r * os + i] = hsum(acc[r][i]) + hsum(ext[r][i]);
}

QM_INLINE void q8_rows_vnni(const qm_digits *d, const float *const *xsum, const int few, const int8_t *codes,
                            int64_t rb, const void *sc, const void *mn, int64_t ps, int half, int64_t K,
                            int64_t group, const int R, float *out, int64_t os, const int six, const int iq4,
                            const int low) {
    (void)six, (void)low; /* kinds 6, 2 and 3 take the fp32 rows in this build (takes_digits) */
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    const __m128i m4 = _mm_set1_epi8(15); /* iq4: as qm_digits.h, a group's 16 bytes to value + 128 */
    const __m256i iq4_lut = _mm256_broadcastsi128_si256(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141,
                                                                      (char)153, (char)166, (char)181, (char)197, (char)217, (char)241));
    const __m256 k65536 = _mm256_set1_ps(65536.0f);
    int per = (int)(32 / group);
    __m256 acc[QM_ROWS][QM_FEW], f[QM_ROWS][QM_FEW], ext[QM_ROWS][QM_FEW];
    float tmp[8];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < few; i++) acc[r][i] = _mm256_setzero_ps(), ext[r][i] = _mm256_setzero_ps();
    int64_t groups = K / group;
    for (int64_t g = 0; g < groups; g += 8) {
        int64_t n = groups - g < 8 ? groups - g : 8;
        __m256 u[QM_FEW], bk[QM_FEW], xs[QM_FEW];
        for (int i = 0; i < few; i++) {
            u[i] = load_some((group == 16 ? d[i].u16 : d[i].u32) + g, n, tmp);
            bk[i] = load_some((group == 16 ? d[i].c16 : d[i].c32) + g, n, tmp);
            xs[i] = mn ? load_some(xsum[i] + g, n, tmp) : u[i];
        }
        for (int r = 0; r < R; r++) {
            __m256 s = load_params(row_at(sc, r * ps, half), half, g, n, tmp);
            __m256 m = mn ? load_params(row_at(mn, r * ps, half), half, g, n, tmp) : s;
            for (int i = 0; i < few; i++) {
                ext[r][i] = _mm256_fmadd_ps(s, bk[i], ext[r][i]);
                if (mn) ext[r][i] = _mm256_fmadd_ps(m, xs[i], ext[r][i]);
                f[r][i] = _mm256_mul_ps(s, u[i]);
            }
        }
        for (int64_t c = 0; c < n / per; c++) {
            int64_t at = g * group + c * 32;
            __m256i idx = per == 1 ? _mm256_set1_epi32((int)c)
                                   : _mm256_setr_epi32((int)(2 * c), (int)(2 * c), (int)(2 * c), (int)(2 * c),
                                                       (int)(2 * c + 1), (int)(2 * c + 1), (int)(2 * c + 1),
                                                       (int)(2 * c + 1));
            __m256i w[QM_ROWS];
            for (int r = 0; r < R; r++) {
                if (iq4) {
                    const uint8_t *row = (const uint8_t *)codes + r * rb + at / 2;
                    _mm_prefetch((const char *)(row + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                    __m128i bytes = _mm_loadu_si128((const __m128i *)row);
                    w[r] = _mm256_shuffle_epi8(iq4_lut, _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), m4),
                                                                         _mm_and_si128(bytes, m4)));
                    continue;
                }
                const int8_t *row = codes + r * rb + at;
                _mm_prefetch((const char *)(row + QM_AHEAD * QM_ROWS * rb), QM_HINT);
                w[r] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)row), flip);
            }
            for (int i = 0; i < few; i++) {
                __m256i da = _mm256_loadu_si256((const __m256i *)(d[i].nat[0] + at)),
                        db = _mm256_loadu_si256((const __m256i *)(d[i].nat[1] + at)),
                        dc = _mm256_loadu_si256((const __m256i *)(d[i].nat[2] + at));
                for (int r = 0; r < R; r++) {
                    __m256i ta = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w[r], da);
                    __m256i tb = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w[r], db);
                    tb = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(tb, 8), w[r], dc);
                    __m256 fl = _mm256_permutevar8x32_ps(f[r][i], idx);
                    acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ta), _mm256_mul_ps(fl, k65536), acc[r][i]);
                    acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tb), fl, acc[r][i]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < few; i++) out[r * os + i] = hsum(acc[r][i]) + hsum(ext[r][i]);
}
#endif
