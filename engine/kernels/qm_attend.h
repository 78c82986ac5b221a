/* Attention of the query heads that share a K/V head over its cache entries (included by qmatmul.c).
 *
 * transformers' eager attention in fp32: scores q.k * scale, softmax (the largest score taken
 * off before exp), the values weighted by it. Only the order of the sums differs, and exp is a
 * vector polynomial (Cephes' expf: ~1 ulp) instead of libm's.
 *
 * Measured on the starter's decode step with 200 tokens of context (one thread, a -DQM_PROFILE
 * build, 2026-11-27): attention was 2.0-2.7 ms of a 16-21 ms step with one dot product, one
 * horizontal sum and one libm expf a key. Here eight keys share one horizontal sum (a tree of
 * hadds), exp runs on eight scores at once, and the value rows are summed with their
 * unnormalised weights in registers (one division a head, not one a key; the output is not read
 * and written back for each key).
 */

#ifdef QM_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

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

#ifdef QM_AVX2
/* q . k_r for the eight rows k0 + r * d (d a multiple of 8), as one vector. */
static inline __m256 dot8(const float *q, const float *k0, int64_t d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t i = 0; i < d; i += 8) {
        __m256 u = _mm256_loadu_ps(q + i);
        const float *k = k0 + i;
        a0 = _mm256_fmadd_ps(u, _mm256_loadu_ps(k), a0);
        a1 = _mm256_fmadd_ps(u, _mm256_loadu_ps(k + d), a1);
        a2 = _mm256_fmadd_ps(u, _mm256_loadu_ps(k + 2 * d), a2);
        a3 = _mm256_fmadd_ps(u, _mm256_loadu_ps(k + 3 * d), a3);
        a4 = _mm256_fmadd_ps(u, _mm256_loadu_ps(k + 4 * d), a4);
        a5 = _mm256_fmadd_ps(u, _mm256_loadu_ps(k + 5 * d), a5);
        a6 = _mm256_fmadd_ps(u, _mm256_loadu_ps(k + 6 * d), a6);
        a7 = _mm256_fmadd_ps(u, _mm256_loadu_ps(k + 7 * d), a7);
    }
    /* lane l of hadd(x, y) pairs: one tree gives [sum a0 .. sum a3 | sum a4 .. sum a7] in halves */
    __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* e^x on eight lanes (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r,
 * times 2^n). x below -87 gives e^-87 (the softmax's smallest weights, against a largest of 1);
 * NaN stays NaN. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x); /* a NaN x is the second operand: kept */
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

/* scores[j] for j < count: q . keys[j] * scale. */
static void scores_of(const float *q, const float *keys, int64_t count, int64_t d, float scale, float *scores) {
    int64_t j = 0;
#ifdef QM_AVX2
    if (d % 8 == 0)
        for (; j + 8 <= count; j += 8)
            _mm256_storeu_ps(scores + j, _mm256_mul_ps(dot8(q, keys + j * d, d), _mm256_set1_ps(scale)));
#endif
    for (; j < count; j++) scores[j] = dot(q, keys + j * d, d) * scale;
}

/* scores[j] = e^(scores[j] - top) for j < count. */
static void exp_shifted(float *scores, int64_t count, float top) {
    int64_t j = 0;
#ifdef QM_AVX2
    for (; j + 8 <= count; j += 8)
        _mm256_storeu_ps(scores + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(top))));
    if (j < count) { /* the tail through the same polynomial: every weight from one exp */
        float tail[8];
        int64_t r = count - j;
        for (int64_t i = 0; i < 8; i++) tail[i] = i < r ? scores[j + i] : top;
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), _mm256_set1_ps(top))));
        for (int64_t i = 0; i < r; i++) scores[j + i] = tail[i];
    }
#else
    for (; j < count; j++) scores[j] = expf(scores[j] - top);
#endif
}

/* out (d) = the sum over j < count of w[j] * rows[j * d .. + d] (added to what out holds where
 * `more`: a later tile of the same sum, in the same order); rows with a zero weight (masked
 * entries) are skipped. Eight registers of sums per 64 columns: out is not read and written
 * again for every row. */
static void weighted_rows(const float *w, const float *rows, int64_t count, int64_t d, int more, float *out) {
    int64_t c = 0;
#ifdef QM_AVX2
    for (; c + 64 <= d; c += 64) {
        float *o = out + c;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        if (more) {
            a0 = _mm256_loadu_ps(o), a1 = _mm256_loadu_ps(o + 8), a2 = _mm256_loadu_ps(o + 16);
            a3 = _mm256_loadu_ps(o + 24), a4 = _mm256_loadu_ps(o + 32), a5 = _mm256_loadu_ps(o + 40);
            a6 = _mm256_loadu_ps(o + 48), a7 = _mm256_loadu_ps(o + 56);
        }
        for (int64_t j = 0; j < count; j++) {
            if (w[j] == 0.0f) continue;
            __m256 b = _mm256_set1_ps(w[j]);
            const float *r = rows + j * d + c;
            a0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(r), a0);
            a1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(r + 8), a1);
            a2 = _mm256_fmadd_ps(b, _mm256_loadu_ps(r + 16), a2);
            a3 = _mm256_fmadd_ps(b, _mm256_loadu_ps(r + 24), a3);
            a4 = _mm256_fmadd_ps(b, _mm256_loadu_ps(r + 32), a4);
            a5 = _mm256_fmadd_ps(b, _mm256_loadu_ps(r + 40), a5);
            a6 = _mm256_fmadd_ps(b, _mm256_loadu_ps(r + 48), a6);
            a7 = _mm256_fmadd_ps(b, _mm256_loadu_ps(r + 56), a7);
        }
        _mm256_storeu_ps(o, a0), _mm256_storeu_ps(o + 8, a1), _mm256_storeu_ps(o + 16, a2);
        _mm256_storeu_ps(o + 24, a3), _mm256_storeu_ps(o + 32, a4), _mm256_storeu_ps(o + 40, a5);
        _mm256_storeu_ps(o + 48, a6), _mm256_storeu_ps(o + 56, a7);
    }
#endif
    if (!more)
        for (int64_t i = c; i < d; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < count && c < d; j++) {
        if (w[j] == 0.0f) continue;
        for (int64_t i = c; i < d; i++) out[i] += w[j] * rows[j * d + i];
    }
}

/* Query heads of a K/V head taken together: all of them, or fewer where that leaves threads idle
 * (kv_heads K/V heads for `tokens` tokens; a decoding step's few). */
static int64_t heads_together(int64_t group, int64_t units, int threads) {
    int64_t per = group;
    while (per > 1 && units * ((group + per - 1) / per) < threads) per = (per + 1) / 2;
    return per;
}

/* The query heads in part `part` of a group, `per` a part (the last part may hold fewer). */
static inline int64_t heads_in_part(int64_t group, int64_t per, int64_t part) {
    return group - part * per < per ? group - part * per : per;
}

/* Keys (and values) a tile: 64 rows of a head of 128 are 32 KB, read from L1/L2 by every query
 * of the group once one query has brought them from L3 or memory. */
#define QM_KEYS 64

/* Attention of G query heads (head i: q + i * qs, rotated) that share one K/V head, over its
 * `total` cache entries, those allowed: allow[j] where allow is given, else j <= limit; and,
 * where nk is given, the new entry (nk, nv), which the cache does not need to hold yet (every
 * entry before it allowed). scores: G * (total + 2). sinks: NULL, or the G heads' sink logits
 * (gpt-oss): a score in the softmax whose value is zero. Head i's output: out + i * os.
 *
 * Per head the same sums in the same order as one head alone (bit for bit); the keys and values
 * are read a tile of QM_KEYS entries at a time for all G heads. With a long cache one head's K
 * and V outgrow L2: eight heads each reading them whole crossed from L3 or memory eight times. */
static void attend_group(const float *q, int64_t qs, int64_t G, const float *keys, const float *values,
                         int64_t total, const uint8_t *allow, int64_t limit, const float *nk, const float *nv,
                         int64_t d, float scale, const float *sinks, float *scores, float *out, int64_t os) {
    int64_t count = allow ? total : (limit + 1 < total ? limit + 1 : total);
    if (allow) { /* only the span from the first allowed entry to the last (a window's, a chain's) */
        int64_t first = 0;
        while (count > 0 && !allow[count - 1]) count--;
        while (first < count && !allow[first]) first++;
        keys += first * d, values += first * d, allow += first, count -= first;
    }
    int64_t stride = count + 2, all = count + (nk != NULL); /* a head's scores (then 1 / their sum); the entries */
    for (int64_t j0 = 0; j0 < count; j0 += QM_KEYS) { /* a masked entry's score is computed and not used */
        int64_t c = count - j0 < QM_KEYS ? count - j0 : QM_KEYS;
        for (int64_t i = 0; i < G; i++) scores_of(q + i * qs, keys + j0 * d, c, d, scale, scores + i * stride + j0);
    }
    for (int64_t i = 0; i < G; i++) {
        float *s = scores + i * stride, top = sinks ? sinks[i] : -INFINITY, sum = 0.0f;
        if (nk) s[count] = dot(q + i * qs, nk, d) * scale;
        for (int64_t j = 0; j < all; j++)
            if (!allow || j == count || allow[j]) top = s[j] > top ? s[j] : top;
        exp_shifted(s, all, top);
        if (sinks) sum = expf(sinks[i] - top);
        for (int64_t j = 0; j < all; j++) {
            if (allow && j < count && !allow[j]) s[j] = 0.0f; /* skipped by weighted_rows */
            sum += s[j];
        }
        s[count + 1] = 1.0f / sum; /* s[count]: the new entry's weight, where there is one */
    }
    for (int64_t j0 = 0; j0 < count || j0 == 0; j0 += QM_KEYS) { /* an empty span still zeroes out */
        int64_t c = count - j0 < QM_KEYS ? count - j0 : QM_KEYS;
        for (int64_t i = 0; i < G; i++)
            weighted_rows(scores + i * stride + j0, values + j0 * d, c, d, j0 > 0, out + i * os);
    }
    for (int64_t i = 0; i < G; i++) {
        const float *s = scores + i * stride;
        float inv = s[count + 1], last = nk ? s[count] : 0.0f, *o = out + i * os;
        if (nk)
            for (int64_t k = 0; k < d; k++) o[k] = (o[k] + last * nv[k]) * inv;
        else
            for (int64_t k = 0; k < d; k++) o[k] *= inv;
    }
}
