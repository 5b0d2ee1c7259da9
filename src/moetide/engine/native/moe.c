/* moetide's native MoE kernels: the routed experts of a step, grouped by expert (fp32, and bf16 weights and
   activations with fp32 accumulation), called through ctypes (engine/native/__init__.py).

   Why grouped: a decode step of T tokens routes T·K (token, expert) pairs to E experts; computed pair by pair,
   an expert chosen by n tokens has its weights read n times from memory, and at real expert sizes (megabytes
   per layer) that traffic is the step. Here each expert's rows are read once per step and applied to all of its
   tokens while they sit in L1 (a 4-row × 3-token register block).

   Batch-invariant and order-fixed: every dot product sums in the same lanes and the same reduction whatever the
   number of tokens sharing the expert, and a token adds its experts' outputs in ascending expert id (the order
   transformers adds them), so a token's result never depends on the other tokens of the step. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MOE_AVX2 1
#endif

static float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, as torch's bf16 conversion (NaN stays NaN) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* A weight row type: fp32 (WT_F32) or bf16 (WT_BF16), loaded 8 lanes at a time as fp32. */
#ifdef MOE_AVX2
static inline __m256 load8_f32(const void *w, int64_t i) { return _mm256_loadu_ps((const float *)w + i); }
static inline __m256 load8_bf16(const void *w, int64_t i) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* the four rows' sums as gemv reduces them: hadd(hadd(a0, a1), hadd(a2, a3)), then the two halves */
static inline void hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float out[4]) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
#endif

static inline float wval(const void *w, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* Y[t * ldy + r] = W[r, :n] . xs[t][:n] for r < rows, t < m. W's rows are ldw elements apart, fp32 or bf16
   (bf16 != 0); xs are fp32 rows. Each (r, t) sums alike for any m (see the file comment). */
#define GEMM_BODY(LOAD)                                                                                       \
    for (; r + 4 <= rows; r += 4) {                                                                           \
        const char *w0 = (const char *)W + r * ldw * esz, *w1 = w0 + ldw * esz, *w2 = w1 + ldw * esz,         \
                   *w3 = w2 + ldw * esz;                                                                      \
        int64_t t = 0;                                                                                        \
        for (; t + 3 <= m; t += 3) {                                                                          \
            const float *x0 = xs[t], *x1 = xs[t + 1], *x2 = xs[t + 2];                                        \
            __m256 a00 = _mm256_setzero_ps(), a10 = a00, a20 = a00, a30 = a00, a01 = a00, a11 = a00,          \
                   a21 = a00, a31 = a00, a02 = a00, a12 = a00, a22 = a00, a32 = a00;                          \
            for (int64_t i = 0; i < n8; i += 8) {                                                             \
                __m256 v0 = _mm256_loadu_ps(x0 + i), v1 = _mm256_loadu_ps(x1 + i), v2 = _mm256_loadu_ps(x2 + i); \
                __m256 w = LOAD(w0, i);                                                                       \
                a00 = _mm256_fmadd_ps(w, v0, a00); a01 = _mm256_fmadd_ps(w, v1, a01);                         \
                a02 = _mm256_fmadd_ps(w, v2, a02);                                                            \
                w = LOAD(w1, i);                                                                              \
                a10 = _mm256_fmadd_ps(w, v0, a10); a11 = _mm256_fmadd_ps(w, v1, a11);                         \
                a12 = _mm256_fmadd_ps(w, v2, a12);                                                            \
                w = LOAD(w2, i);                                                                              \
                a20 = _mm256_fmadd_ps(w, v0, a20); a21 = _mm256_fmadd_ps(w, v1, a21);                         \
                a22 = _mm256_fmadd_ps(w, v2, a22);                                                            \
                w = LOAD(w3, i);                                                                              \
                a30 = _mm256_fmadd_ps(w, v0, a30); a31 = _mm256_fmadd_ps(w, v1, a31);                         \
                a32 = _mm256_fmadd_ps(w, v2, a32);                                                            \
            }                                                                                                 \
            hsum4(a00, a10, a20, a30, Y + t * ldy + r);                                                       \
            hsum4(a01, a11, a21, a31, Y + (t + 1) * ldy + r);                                                 \
            hsum4(a02, a12, a22, a32, Y + (t + 2) * ldy + r);                                                 \
        }                                                                                                     \
        for (; t < m; t++) {                                                                                  \
            const float *x0 = xs[t];                                                                          \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                       \
            for (int64_t i = 0; i < n8; i += 8) {                                                             \
                __m256 v0 = _mm256_loadu_ps(x0 + i);                                                          \
                a0 = _mm256_fmadd_ps(LOAD(w0, i), v0, a0);                                                    \
                a1 = _mm256_fmadd_ps(LOAD(w1, i), v0, a1);                                                    \
                a2 = _mm256_fmadd_ps(LOAD(w2, i), v0, a2);                                                    \
                a3 = _mm256_fmadd_ps(LOAD(w3, i), v0, a3);                                                    \
            }                                                                                                 \
            hsum4(a0, a1, a2, a3, Y + t * ldy + r);                                                           \
        }                                                                                                     \
        for (t = 0; t < m; t++)                                                                               \
            for (int64_t i = n8; i < n; i++) {                                                                \
                const float xi = xs[t][i];                                                                    \
                Y[t * ldy + r] += wval(w0, i, bf16) * xi;                                                     \
                Y[t * ldy + r + 1] += wval(w1, i, bf16) * xi;                                                 \
                Y[t * ldy + r + 2] += wval(w2, i, bf16) * xi;                                                 \
                Y[t * ldy + r + 3] += wval(w3, i, bf16) * xi;                                                 \
            }                                                                                                 \
    }

static void gemm_rows(const void *W, int64_t ldw, int bf16, const float *const *xs, int64_t m, int64_t n,
                      int64_t rows, float *Y, int64_t ldy) {
    const int64_t esz = bf16 ? 2 : 4;
    int64_t r = 0;
#ifdef MOE_AVX2
    const int64_t n8 = n - n % 8;
    if (bf16) {
        GEMM_BODY(load8_bf16)
    } else {
        GEMM_BODY(load8_f32)
    }
#endif
    for (; r < rows; r++) {  /* the last rows, and every row without AVX2 */
        const char *wr = (const char *)W + r * ldw * esz;
        for (int64_t t = 0; t < m; t++) {
            if (!bf16) {
                Y[t * ldy + r] = dot_f32((const float *)wr, xs[t], n);
                continue;
            }
            float s = 0.f;
            for (int64_t i = 0; i < n; i++) s += wval(wr, i, 1) * xs[t][i];
            Y[t * ldy + r] = s;
        }
    }
}

int moetide_moe_abi_version(void) { return 1; }

/* Group the T·K pairs by expert, ascending, (token, rank) order within an expert: pair_of[order[e]..order[e+1])
   lists expert e's pairs p = t*K + k. order holds E+1 entries. Returns 1 if an id is outside [0, E). */
static int group_pairs(const int64_t *ids, int64_t P, int64_t E, int64_t *order, int64_t *pair_of) {
    for (int64_t p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return 1;
    for (int64_t e = 0; e <= E; e++) order[e] = 0;
    for (int64_t p = 0; p < P; p++) order[ids[p] + 1]++;
    for (int64_t e = 0; e < E; e++) order[e + 1] += order[e];
    for (int64_t p = 0; p < P; p++) pair_of[order[ids[p]]++] = p;
    for (int64_t e = E; e > 0; e--) order[e] = order[e - 1];  /* the fill moved each start to the next's */
    order[0] = 0;
    return 0;
}

/* The routed experts of T tokens, K each: out[t] = sum over t's K (expert e, weight w), in ascending e, of
   w * down_e(silu(gate_e x_t) * up_e x_t); gate_up_e = gate_up + e*gu_stride is [2I, H] (gate rows first, rows H
   apart), down_e = down + e*dn_stride is [H, I] (rows I apart). x [T, H] and out [T, H] contiguous; ids [T, K]
   int64, weights [T, K] fp32. iscratch holds E + 1 + 2*T*K int64, fscratch T*K*(2I + H) floats. Returns 1,
   having touched nothing, if an id is outside [0, E); else 0. */
int moetide_moe_grouped_f32(const float *x, int64_t T, int64_t K, const int64_t *ids, const float *weights,
                            const float *gate_up, int64_t gu_stride, const float *down, int64_t dn_stride,
                            int64_t E, int64_t H, int64_t I, float *out, int64_t *iscratch, float *fscratch) {
    const int64_t P = T * K;
    int64_t *order = iscratch, *pair_of = iscratch + E + 1;
    if (group_pairs(ids, P, E, order, pair_of)) return 1;
    float *h = fscratch, *y = h + P * 2 * I;
    const float **xs = (const float **)(pair_of + P);
    for (int64_t i = 0; i < T * H; i++) out[i] = 0.f;
    for (int64_t e = 0; e < E; e++) {
        const int64_t first = order[e], n = order[e + 1] - first;
        if (n == 0) continue;
        for (int64_t j = 0; j < n; j++) xs[j] = x + (pair_of[first + j] / K) * H;
        gemm_rows(gate_up + e * gu_stride, H, 0, xs, n, H, 2 * I, h, 2 * I);
        for (int64_t j = 0; j < n; j++) {
            float *hj = h + j * 2 * I;
            for (int64_t i = 0; i < I; i++) hj[i] = hj[i] / (1.f + expf(-hj[i])) * hj[I + i];
            xs[j] = hj;
        }
        gemm_rows(down + e * dn_stride, I, 0, xs, n, I, H, y, H);
        for (int64_t j = 0; j < n; j++) {
            const int64_t p = pair_of[first + j];
            const float w = weights[p], *yj = y + j * H;
            float *ot = out + (p / K) * H;
            for (int64_t r = 0; r < H; r++) ot[r] += yj[r] * w;
        }
    }
    return 0;
}

/* The same in bf16 as torch computes it: each projection accumulates in fp32 and rounds to bf16; silu(gate) and
   silu * up round to bf16; the product by the routing weight (fp32 here, holding bf16 values where the model
   casts them: Qwen3) rounds to bf16; each expert's output is added into the token's bf16 sum, rounding after
   each add. x, out [T, H] bf16. fscratch as above plus T*H floats for the fp32 copy of x. */
int moetide_moe_grouped_bf16(const uint16_t *x, int64_t T, int64_t K, const int64_t *ids, const float *weights,
                             const uint16_t *gate_up, int64_t gu_stride, const uint16_t *down,
                             int64_t dn_stride, int64_t E, int64_t H, int64_t I, uint16_t *out, int64_t *iscratch,
                             float *fscratch) {
    const int64_t P = T * K;
    int64_t *order = iscratch, *pair_of = iscratch + E + 1;
    if (group_pairs(ids, P, E, order, pair_of)) return 1;
    float *h = fscratch, *y = h + P * 2 * I, *xf = y + P * H;
    const float **xs = (const float **)(pair_of + P);
    for (int64_t i = 0; i < T * H; i++) xf[i] = bf16_to_f32(x[i]);
    for (int64_t i = 0; i < T * H; i++) out[i] = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t first = order[e], n = order[e + 1] - first;
        if (n == 0) continue;
        for (int64_t j = 0; j < n; j++) xs[j] = xf + (pair_of[first + j] / K) * H;
        gemm_rows(gate_up + e * gu_stride, H, 1, xs, n, H, 2 * I, h, 2 * I);
        for (int64_t j = 0; j < n; j++) {
            float *hj = h + j * 2 * I;
            for (int64_t i = 0; i < I; i++) {
                const float g = round_bf16(hj[i]), u = round_bf16(hj[I + i]);
                hj[i] = round_bf16(round_bf16(g / (1.f + expf(-g))) * u);
            }
            xs[j] = hj;
        }
        gemm_rows(down + e * dn_stride, I, 1, xs, n, I, H, y, H);
        for (int64_t j = 0; j < n; j++) {
            const int64_t p = pair_of[first + j];
            const float w = weights[p], *yj = y + j * H;
            uint16_t *ot = out + (p / K) * H;
            for (int64_t r = 0; r < H; r++) {
                ot[r] = f32_to_bf16(bf16_to_f32(ot[r]) + round_bf16(round_bf16(yj[r]) * w));
            }
        }
    }
    return 0;
}
