/* moetide's native CPU kernels for decode-sized steps (fp32; decode attention also over a bf16 KV cache), called
   through ctypes (engine/native/__init__.py); the MoE experts and dense projections are in moe.c, the Gated
   DeltaNet step in gdn.c, all built into one library.

   Why: at decode sizes (a few tokens, hidden 256) each torch op costs a few microseconds of dispatch, and a MoE
   layer or a paged attention is tens of ops; these do the same arithmetic in one call, reading the arena in place
   (vLLM's CPU build does the same with its csrc/cpu kernels). Single-threaded; no allocation; no Python objects.

   All are batch-invariant: a token's result does not depend on which other tokens share the step. Accumulation
   orders differ from torch's kernels, so results equal torch's to fp32 round-off, not bit for bit (tested). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MOETIDE_AVX2 1
#endif

static float dot(const float *a, const float *b, int64_t n) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y[r] = W[r, :n] . x for r < rows; W's rows are ld elements apart. */
static void gemv(const float *W, int64_t ld, const float *x, int64_t n, int64_t rows, float *y) {
    int64_t r = 0;
#ifdef MOETIDE_AVX2
    int64_t n8 = n - n % 8;
    for (; r + 4 <= rows; r += 4) {
        const float *w0 = W + r * ld, *w1 = w0 + ld, *w2 = w1 + ld, *w3 = w2 + ld;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
               a3 = _mm256_setzero_ps();
        for (int64_t i = 0; i < n8; i += 8) {
            __m256 xv = _mm256_loadu_ps(x + i);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + i), xv, a3);
        }
        __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        __m128 sum = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        float out[4];
        _mm_storeu_ps(out, sum);
        for (int64_t i = n8; i < n; i++) {
            out[0] += w0[i] * x[i];
            out[1] += w1[i] * x[i];
            out[2] += w2[i] * x[i];
            out[3] += w3[i] * x[i];
        }
        y[r] = out[0];
        y[r + 1] = out[1];
        y[r + 2] = out[2];
        y[r + 3] = out[3];
    }
#endif
    for (; r < rows; r++) y[r] = dot(W + r * ld, x, n);
}

/* y += a * x over n floats */
static void axpy(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* Ask for the cache lines of one KV row (all heads) a few rows before they are read: a sequence's blocks lie
   anywhere in the cache, so the hardware prefetcher loses the stream at every block boundary. */
#define PREFETCH_ROWS 8
static void prefetch_row(const void *row, int64_t num_bytes) {
    for (int64_t o = 0; o < num_bytes; o += 64) __builtin_prefetch((const char *)row + o);
}

/* y += a[0] x0 + a[1] x1 + a[2] x2 + a[3] x3 over n floats: one pass over y for four rows */
static void axpy4(float *y, const float *a, const float *x0, const float *x1, const float *x2, const float *x3,
                  int64_t n) {
    const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    for (int64_t i = 0; i < n; i++) y[i] += ((a0 * x0[i] + a1 * x1[i]) + (a2 * x2[i] + a3 * x3[i]));
}

int moetide_abi_version(void) { return 17; }

/* Move n blocks of nbytes each between a contiguous scratch (block i at i * nbytes) and their own addresses:
   gather (to_blocks == 0) or scatter back. The engine's linear-attention states live in pool blocks that need
   not be adjacent (engine/state.py); one memcpy per block runs at the copy rate of the memory, where an indexed
   torch copy of 8-byte words reached a few GB/s and was a quarter of a Qwen3-Next decode step at batch 32. */
void moetide_copy_blocks(uint8_t *scratch, const int64_t *addrs, int64_t n, int64_t nbytes, int64_t to_blocks) {
    for (int64_t i = 0; i < n; i++) {
        uint8_t *block = (uint8_t *)(intptr_t)addrs[i];
        if (to_blocks)
            memcpy(block, scratch + i * nbytes, (size_t)nbytes);
        else
            memcpy(scratch + i * nbytes, block, (size_t)nbytes);
    }
}

/* A K or V row (all heads) of the arena's views as fp32: in place for fp32, widened into buf ([Hkv, D] packed)
   for bf16. */
static inline const void *kv_at(const void *base, int64_t row, int64_t row_stride, int64_t esz) {
    return (const char *)base + row * row_stride * esz;
}

static const float *kv_row(const void *base, int64_t row, int64_t row_stride, int64_t Hkv, int64_t head_stride,
                           int64_t D, int64_t bf16, float *buf) {
    if (!bf16) return (const float *)kv_at(base, row, row_stride, 4);
    const uint16_t *r = (const uint16_t *)kv_at(base, row, row_stride, 2);
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t d = 0; d < D; d++) {
            const uint32_t u = (uint32_t)r[h * head_stride + d] << 16;
            memcpy(buf + h * D + d, &u, 4);
        }
    return buf;
}

#if defined(__AVX512F__) && defined(__AVX512VL__)
#define MOETIDE_ATTN512 1

/* lane i of the result = the sum of v[i]'s 16 lanes (pairs within 128-bit lanes, then across them) */
static inline __attribute__((always_inline)) __m512 hsum16x16(const __m512 *v) {
    __m512 t[8], u[4];
    for (int k = 0; k < 8; k++)
        t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        const __m512d c = _mm512_castps_pd(t[2 * k]), d = _mm512_castps_pd(t[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

/* For the 4 heads a of a tile: oh[a][16 c] = inv[a] * sum_j ph[a][j] V_j[off + 16 c], c < NC, the sums kept in
   4 x NC registers over all n keys (only the first nh heads are stored; the others repeat one of them). */
static inline __attribute__((always_inline)) void pv_tile(const void *v_base, const int64_t *rows, int64_t n,
                                                         int64_t row_stride, int64_t off, const float *const *ph,
                                                         float *const *oh, const float *inv, int nh, const int NC,
                                                         const int bf16, int prefetch, int64_t row_bytes) {
    __m512 acc[4][4];
    for (int a = 0; a < 4; a++)
        for (int c = 0; c < NC; c++) acc[a][c] = _mm512_setzero_ps();
    const int64_t esz = bf16 ? 2 : 4;
    for (int64_t j = 0; j < n; j++) {
        if (prefetch && j + PREFETCH_ROWS < n)
            prefetch_row(kv_at(v_base, rows[j + PREFETCH_ROWS], row_stride, esz), row_bytes);
        const char *vr = (const char *)kv_at(v_base, rows[j], row_stride, esz) + off * esz;
        __m512 vv[4];
        for (int c = 0; c < NC; c++) vv[c] = load16(vr, 16 * c, bf16);
        for (int a = 0; a < 4; a++) {
            const __m512 pb = _mm512_set1_ps(ph[a][j]);
            for (int c = 0; c < NC; c++) acc[a][c] = _mm512_fmadd_ps(pb, vv[c], acc[a][c]);
        }
    }
    for (int a = 0; a < nh; a++)
        for (int c = 0; c < NC; c++)
            _mm512_storeu_ps(oh[a] + 16 * c, _mm512_mul_ps(acc[a][c], _mm512_set1_ps(inv[a])));
}

/* One sequence of moetide_paged_decode_attention with AVX-512, for D a multiple of 16: scores for 4 keys x 4
   heads of a group at a time (16 register accumulators, one horizontal reduction for the 16), a vector softmax
   per head, and p·V with each tile of the output in registers across all keys. Same arithmetic as the portable
   loop below, summed in another order. */
static inline __attribute__((always_inline)) void attend512(const float *qs, int64_t n, const int64_t *rows,
                                                           const void *k_base, const void *v_base, int64_t row_stride,
                                                           int64_t head_stride, int64_t Hq, int64_t Hkv, int64_t D,
                                                           int64_t L, float scale, float *scores, float *m,
                                                           float *sum, float *os, float *lse_s, const int bf16) {
    const int64_t group = Hq / Hkv, esz = bf16 ? 2 : 4, row_bytes = Hkv * head_stride * esz;
    for (int64_t j0 = 0; j0 < n; j0 += 4) {
        const int nk = n - j0 < 4 ? (int)(n - j0) : 4;
        const char *kr[4];
        for (int i = 0; i < 4; i++)  /* past the last key: the last key again, its scores not stored */
            kr[i] = (const char *)kv_at(k_base, rows[j0 + (i < nk ? i : nk - 1)], row_stride, esz);
        for (int64_t r = j0 + PREFETCH_ROWS; r < j0 + PREFETCH_ROWS + 4 && r < n; r++)
            prefetch_row(kv_at(k_base, rows[r], row_stride, esz), row_bytes);
        for (int64_t g = 0; g < Hkv; g++)
            for (int64_t h0 = 0; h0 < group; h0 += 4) {
                const int nh = group - h0 < 4 ? (int)(group - h0) : 4;
                const float *qh[4];
                for (int a = 0; a < 4; a++) qh[a] = qs + (g * group + h0 + (a < nh ? a : 0)) * D;
                __m512 acc[16];
                for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_ps();
                for (int64_t c = 0; c < D; c += 16) {
                    __m512 kv[4];
                    for (int i = 0; i < 4; i++) kv[i] = load16(kr[i] + g * head_stride * esz, c, bf16);
                    for (int a = 0; a < 4; a++) {
                        const __m512 qv = _mm512_loadu_ps(qh[a] + c);
                        for (int i = 0; i < 4; i++) acc[4 * a + i] = _mm512_fmadd_ps(qv, kv[i], acc[4 * a + i]);
                    }
                }
                float out[16];
                _mm512_storeu_ps(out, _mm512_mul_ps(hsum16x16(acc), _mm512_set1_ps(scale)));
                for (int a = 0; a < nh; a++)
                    memcpy(scores + (g * group + h0 + a) * L + j0, out + 4 * a, (size_t)nk * 4);
            }
    }
    for (int64_t h = 0; h < Hq; h++) {  /* softmax numerators in place; the max first */
        float *sh = scores + h * L;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, sh + j));
        }
        m[h] = _mm512_reduce_max_ps(mx);
        const __m512 mv = _mm512_set1_ps(m[h]);
        __m512 total = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
            const __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
            const __m512 p = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + j), mv)));
            _mm512_mask_storeu_ps(sh + j, k, p);
            total = _mm512_add_ps(total, p);
        }
        sum[h] = _mm512_reduce_add_ps(total);
        if (lse_s != 0) lse_s[h] = m[h] + logf(sum[h]);
    }
    for (int64_t g = 0; g < Hkv; g++)
        for (int64_t h0 = 0; h0 < group; h0 += 4) {
            const int nh = group - h0 < 4 ? (int)(group - h0) : 4;
            const float *ph[4];
            float *oh[4], inv[4];
            for (int a = 0; a < 4; a++) {
                const int64_t h = g * group + h0 + (a < nh ? a : 0);
                ph[a] = scores + h * L;
                oh[a] = os + h * D;
                inv[a] = 1.0f / sum[h];
            }
            for (int64_t c0 = 0; c0 < D; c0 += 64) {
                const int64_t off = g * head_stride + c0, left = (D - c0) / 16;
                const int pf = g == 0 && h0 == 0 && c0 == 0;  /* the first pass over the rows brings them in */
                if (left >= 4)
                    pv_tile(v_base, rows, n, row_stride, off, ph, oh, inv, nh, 4, bf16, pf, row_bytes);
                else if (left == 3)
                    pv_tile(v_base, rows, n, row_stride, off, ph, oh, inv, nh, 3, bf16, pf, row_bytes);
                else if (left == 2)
                    pv_tile(v_base, rows, n, row_stride, off, ph, oh, inv, nh, 2, bf16, pf, row_bytes);
                else
                    pv_tile(v_base, rows, n, row_stride, off, ph, oh, inv, nh, 1, bf16, pf, row_bytes);
                for (int a = 0; a < 4; a++) oh[a] += 64;
            }
        }
}
#endif

/* Decode attention over paged KV, read in place: b sequences, one query each. q [b, Hq, D] contiguous; key j of
   sequence s is row key_rows[s*L + j] (j < lengths[s]) of the K and V views, whose rows are row_stride elements
   apart and whose heads are head_stride apart; query head h reads KV head h / (Hq / Hkv). Softmax in fp32 with the
   max subtracted. out [b, Hq, D] contiguous; scratch holds Hq (L + D + 3) + 5 Hkv D floats.
   A sequence of length 0 gets zeros.
   With k_new and v_new ([b, Hkv, D], else NULL; heads D apart, sequences new_k_stride and new_v_stride elements
   apart: views of the step's projection need no copy), every sequence's new key and value are first written
   into its last row, key_rows[s*L + lengths[s] - 1] (the decode token's own slot), before any sequence attends.
   With lse ([b, Hq], else NULL), each row's log-sum-exp of its scaled scores (natural log; -inf with no key),
   what a split merge needs. With bf16 != 0 the K/V views (and k_new, v_new) hold bf16: each row read is widened
   to fp32 (scratch) and the arithmetic is the same; q, out and lse stay fp32. Returns 1 if a row index used is
   outside [0, num_rows), 2 if a length is outside [0, L] — having touched nothing; else 0. */
int moetide_paged_decode_attention(const float *q, int64_t b, int64_t Hq, int64_t Hkv, int64_t D, void *k_base,
                                   void *v_base, int64_t num_rows, int64_t row_stride, int64_t head_stride,
                                   const int64_t *key_rows, const int64_t *lengths, int64_t L, float scale,
                                   const void *k_new, int64_t new_k_stride, const void *v_new,
                                   int64_t new_v_stride, float *out, float *lse, int64_t bf16,
                                   float *scratch) {
    for (int64_t s = 0; s < b; s++) {  /* checked before anything is read or written */
        if (lengths[s] < 0 || lengths[s] > L) return 2;
        for (int64_t j = 0; j < lengths[s]; j++)
            if (key_rows[s * L + j] < 0 || key_rows[s * L + j] >= num_rows) return 1;
    }
    const int64_t group = Hq / Hkv;
    float *scores = scratch, *acc = scratch + Hq * L, *m = acc + Hq * D, *sum = m + Hq, *pv = sum + Hq;
    float *wide = pv + Hq;  /* 5 widened rows (bf16): one K, four V */
    const int64_t esz = bf16 ? 2 : 4, hs = bf16 ? D : head_stride;  /* hs: head stride of a row as read */
    for (int64_t s = 0; k_new != 0 && s < b; s++) {  /* every new K/V first: one may be in another's context */
        const int64_t n = lengths[s];
        if (n == 0) continue;
        for (int64_t h = 0; h < Hkv; h++) {
            const int64_t at = (key_rows[s * L + n - 1] * row_stride + h * head_stride) * esz;
            memcpy((char *)k_base + at, (const char *)k_new + (s * new_k_stride + h * D) * esz, (size_t)(D * esz));
            memcpy((char *)v_base + at, (const char *)v_new + (s * new_v_stride + h * D) * esz, (size_t)(D * esz));
        }
    }
    const int64_t row_bytes = Hkv * head_stride * esz;
    for (int64_t s = 0; s < b; s++) {  /* key rows outer: each K and V row is read once, whole, for every head */
        const int64_t n = lengths[s];
        const int64_t *rows = key_rows + s * L;
        const float *qs = q + s * Hq * D;
#ifdef MOETIDE_ATTN512
        if (n > 0 && D % 16 == 0) {  /* bf16 a constant in each call: each dtype compiled on its own */
            float *os = out + s * Hq * D, *lse_s = lse == 0 ? 0 : lse + s * Hq;
            if (bf16)
                attend512(qs, n, rows, k_base, v_base, row_stride, head_stride, Hq, Hkv, D, L, scale, scores, m, sum,
                          os, lse_s, 1);
            else
                attend512(qs, n, rows, k_base, v_base, row_stride, head_stride, Hq, Hkv, D, L, scale, scores, m, sum,
                          os, lse_s, 0);
            continue;
        }
#endif
        for (int64_t i = 0; i < Hq * D; i++) acc[i] = 0.f;
        for (int64_t h = 0; h < Hq; h++) {
            m[h] = -INFINITY;
            sum[h] = 0.f;
        }
        for (int64_t j = 0; j < n; j++) {
            if (j + PREFETCH_ROWS < n) prefetch_row(kv_at(k_base, rows[j + PREFETCH_ROWS], row_stride, esz), row_bytes);
            const float *kj = kv_row(k_base, rows[j], row_stride, Hkv, head_stride, D, bf16, wide);
            for (int64_t g = 0; g < Hkv; g++)  /* the group's query heads are D apart: a 4-row gemv */
                gemv(qs + g * group * D, D, kj + g * hs, D, group, pv + g * group);
            for (int64_t h = 0; h < Hq; h++) {
                const float x = pv[h] * scale;
                scores[h * L + j] = x;
                if (x > m[h]) m[h] = x;
            }
        }
        int64_t j = 0;
        for (; j + 4 <= n; j += 4) {  /* four V rows at a time: each head's accumulator read once per four */
            for (int64_t r = j + PREFETCH_ROWS; r < j + PREFETCH_ROWS + 4 && r < n; r++)
                prefetch_row(kv_at(v_base, rows[r], row_stride, esz), row_bytes);
            const int64_t w = Hkv * D;
            const float *v0 = kv_row(v_base, rows[j], row_stride, Hkv, head_stride, D, bf16, wide + w),
                        *v1 = kv_row(v_base, rows[j + 1], row_stride, Hkv, head_stride, D, bf16, wide + 2 * w),
                        *v2 = kv_row(v_base, rows[j + 2], row_stride, Hkv, head_stride, D, bf16, wide + 3 * w),
                        *v3 = kv_row(v_base, rows[j + 3], row_stride, Hkv, head_stride, D, bf16, wide + 4 * w);
            for (int64_t h = 0; h < Hq; h++) {
                const int64_t off = (h / group) * hs;
                const float *sh = scores + h * L + j;
                float p4[4];
                for (int r = 0; r < 4; r++) p4[r] = expf(sh[r] - m[h]);
                sum[h] += (p4[0] + p4[1]) + (p4[2] + p4[3]);
                axpy4(acc + h * D, p4, v0 + off, v1 + off, v2 + off, v3 + off, D);
            }
        }
        for (; j < n; j++) {
            const float *vj = kv_row(v_base, rows[j], row_stride, Hkv, head_stride, D, bf16, wide + Hkv * D);
            for (int64_t h = 0; h < Hq; h++) {
                const float p = expf(scores[h * L + j] - m[h]);
                sum[h] += p;
                axpy(acc + h * D, p, vj + (h / group) * hs, D);
            }
        }
        for (int64_t h = 0; h < Hq; h++) {
            float *oh = out + (s * Hq + h) * D;
            for (int64_t d = 0; d < D; d++) oh[d] = n > 0 ? acc[h * D + d] / sum[h] : 0.f;
            if (lse != 0) lse[s * Hq + h] = n > 0 ? m[h] + logf(sum[h]) : -INFINITY;
        }
    }
    return 0;
}

/* One row (t, h) of moetide_rms_norm_rope; bf16 is a constant at each call, so each dtype is compiled apart. */
static inline __attribute__((always_inline)) void norm_rope_row(const void *xr, int64_t D, int64_t norm, float eps,
                                                                const void *w, const void *c, const void *sn,
                                                                int64_t rotary, void *restrict o,
                                                                float *restrict wide, float *restrict y, const int b) {
    const int64_t half = rotary / 2;
    const float *row = (const float *)xr;
    if (b) {
        for (int64_t d = 0; d < D; d++) wide[d] = bf16_to_f32(((const uint16_t *)xr)[d]);
        row = wide;
    }
    if (norm) {
        const float inv = 1.f / sqrtf(dot(row, row, D) / (float)D + eps);
        if (w != 0) {
            for (int64_t d = 0; d < D; d++) y[d] = to_dtype(load_any(w, d, b) * to_dtype(row[d] * inv, b), b);
        } else {
            for (int64_t d = 0; d < D; d++) y[d] = to_dtype(row[d] * inv, b);
        }
        row = y;
    }
    for (int64_t d = 0; d < half; d++) {
        const float lo = to_dtype(row[d] * load_any(c, d, b), b) + to_dtype(row[d + half] * load_any(sn, d, b), b);
        const float hi = to_dtype(row[d + half] * load_any(c, d + half, b), b)
                         + to_dtype(row[d] * load_any(sn, d + half, b), b);
        store_any(o, d, lo, b);
        store_any(o, d + half, hi, b);
    }
    for (int64_t d = rotary; d < D; d++) store_any(o, d, row[d], b);
}

/* RMSNorm and RoPE over T x heads rows of D: row (t, h) starts at element t*x_stride + h*D of x; out [T, heads, D]
   contiguous; x, w1, w2, the tables and out all fp32, or all bf16 where bf16 != 0. With norm,
   y = w * (x / sqrt(mean(x^2) + eps)) (transformers' plain RMSNorm), w = w1 for the first `split` heads of a token
   and w2 for the rest (q and k heads of one projection), no weight where NULL; else y = x. With rotary > 0, the
   first `rotary` dims of y are rotated, halves convention: out = y*cos + swap(y)*sin with cos and a sign-folded
   sin ([T, rotary] each, sin's first half negated: engine.models.common's tables); the other dims pass through.
   In bf16 every product and sum is rounded where torch's bf16 ops round (x / rms, then * w; y * cos, swap(y) *
   sin, their sum), so only the fp32 sum of squares is in another order. scratch holds 2 D floats. */
void moetide_rms_norm_rope(const void *x, int64_t T, int64_t x_stride, int64_t heads, int64_t D, int64_t norm,
                           float eps, const void *w1, int64_t split, const void *w2, const void *cos_t,
                           const void *sin_t, int64_t rotary, void *out, float *scratch, int64_t bf16) {
    const int64_t esz = bf16 ? 2 : 4;
    for (int64_t t = 0; t < T; t++) {
        const char *c = (const char *)cos_t + t * rotary * esz, *sn = (const char *)sin_t + t * rotary * esz;
        for (int64_t h = 0; h < heads; h++) {
            const char *xr = (const char *)x + (t * x_stride + h * D) * esz;
            char *o = (char *)out + (t * heads + h) * D * esz;
            const void *w = h < split ? w1 : w2;
            if (bf16)
                norm_rope_row(xr, D, norm, eps, w, c, sn, rotary, o, scratch, scratch + D, 1);
            else
                norm_rope_row(xr, D, norm, eps, w, c, sn, rotary, o, scratch, scratch + D, 0);
        }
    }
}

/* The router's choice for T tokens, as engine.models.moe.SparseMoE.route computes it with torch: a softmax of
   each row of E logits in fp32 (max subtracted, the sum in index order), the K largest probabilities in
   descending order (of equal ones the lower expert id first), divided by their sum (p0 + p1 + ...) when renorm.
   logits [T, E] fp32 or (bf16 != 0) bf16, rows ld elements apart; weights [T, K] fp32 and ids [T, K] out.
   Why: torch spends five ops on this per MoE layer (softmax, topk, sum, divide, cast), a few microseconds each at
   decode sizes, for a few hundred flops. */
void moetide_moe_route(const void *logits, int64_t T, int64_t E, int64_t ld, int64_t bf16, int64_t K, int64_t renorm,
                       float *weights, int64_t *ids) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t base = t * ld;
        float m = -INFINITY, s = 0.f;
        for (int64_t e = 0; e < E; e++) {
            const float l = load_any(logits, base + e, (int)bf16);
            if (l > m) m = l;
        }
        float *w = weights + t * K;
        int64_t *id = ids + t * K;
        int64_t kept = 0;
        for (int64_t e = 0; e < E; e++) {
            const float p = expf(load_any(logits, base + e, (int)bf16) - m);
            s += p;
            if (kept == K && !(p > w[K - 1])) continue;
            int64_t at = kept < K ? kept++ : K - 1;  /* insert p, keeping the list descending; later ids after ties */
            for (; at > 0 && p > w[at - 1]; at--) {
                w[at] = w[at - 1];
                id[at] = id[at - 1];
            }
            w[at] = p;
            id[at] = e;
        }
        float total = 0.f;
        for (int64_t k = 0; k < K; k++) {
            w[k] = w[k] / s;
            total += w[k];
        }
        if (renorm)
            for (int64_t k = 0; k < K; k++) w[k] = w[k] / total;
    }
}
