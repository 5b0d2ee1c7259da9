/* moetide's native MoE kernels: the routed experts of a step, grouped by expert (fp32, and bf16 weights and
   activations with fp32 accumulation), called through ctypes (engine/native/__init__.py).

   Why grouped: a decode step of T tokens routes T·K (token, expert) pairs to E experts; computed pair by pair,
   an expert chosen by n tokens has its weights read n times from memory, and at real expert sizes (megabytes
   per layer) that traffic is the step. Here each expert's rows are read once per step and applied to all of its
   tokens while they sit in L1 or L2 (bf16 on AMX tiles where built and granted; AVX-512: the tokens in the lanes,
   for bf16 with AVX512-BF16; otherwise blocks of dot products, 4 rows × 6 tokens, and on AVX2 one row × 3
   tokens).

   Batch-invariant and order-fixed: every dot product sums in the same lanes and the same reduction whatever the
   number of tokens sharing the expert, and a token adds its experts' outputs in ascending expert id (the order
   transformers adds them), so a token's result never depends on the other tokens of the step. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define MOE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MOE_AVX2 1
#endif

#include "bf16.h"
#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define MOE_AMX 1
#endif

/* A weight row type: fp32 or bf16, loaded 8 lanes at a time as fp32. */
#ifdef MOE_AVX2
static inline __m256 load8_f32(const void *w, int64_t i) { return _mm256_loadu_ps((const float *)w + i); }
static inline __m256 load8_bf16(const void *w, int64_t i) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float hsum8(__m256 a) {
    __m128 l = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    l = _mm_hadd_ps(l, l);
    l = _mm_hadd_ps(l, l);
    return _mm_cvtss_f32(l);
}
#endif

static inline float wval(const void *w, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* Y[t * ldy + r] = W[r, :n] . xs[t][:n] for r < rows, t < m. W's rows are ldw elements apart, fp32 or bf16
   (bf16 != 0); xs are fp32 rows. One weight row at a time, front to back (one sequential stream, which the
   hardware prefetcher reads near the core's memory bandwidth: twice what interleaving four rows got), applied to
   three tokens per pass from L1; rows in ~16 KiB blocks, so past the first 12 tokens they come from L2. Every
   (r, t) sums alike for any m (see the file comment): four 8-lane accumulators taking 8-element chunks in turn,
   reduced as hsum((a0 + a1) + (a2 + a3)), then the last n % 8 elements one by one. */
#ifdef MOE_AVX2
#define FMA4(A, X, i)                                                                                         \
    A##0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps((X) + (i)), A##0);                                             \
    A##1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps((X) + (i) + 8), A##1);                                         \
    A##2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps((X) + (i) + 16), A##2);                                        \
    A##3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps((X) + (i) + 24), A##3);
#define FMA1(A, X, i) A = _mm256_fmadd_ps(w, _mm256_loadu_ps((X) + (i)), A);
#define ROW_BODY(LOAD)                                                                                        \
    for (int64_t t = t0; t < t1; t += 3) {                                                                    \
        const int64_t nt = t1 - t < 3 ? t1 - t : 3;                                                           \
        const float *x0 = xs[t], *x1 = xs[t + (nt > 1)], *x2 = xs[t + (nt > 2 ? 2 : 0)];                     \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0,       \
               c0 = a0, c1 = a0, c2 = a0, c3 = a0;                                                            \
        int64_t i = 0;                                                                                        \
        for (; i + 32 <= n8; i += 32) {                                                                       \
            const __m256 w0 = LOAD(wr, i), w1 = LOAD(wr, i + 8), w2 = LOAD(wr, i + 16), w3 = LOAD(wr, i + 24); \
            FMA4(a, x0, i)                                                                                    \
            FMA4(b, x1, i)                                                                                    \
            FMA4(c, x2, i)                                                                                    \
        }                                                                                                     \
        if (i + 8 <= n8) { /* the last chunks go to a0, a1, a2 in turn, as in a longer loop */                \
            const __m256 w = LOAD(wr, i);                                                                     \
            FMA1(a0, x0, i) FMA1(b0, x1, i) FMA1(c0, x2, i)                                                   \
        }                                                                                                     \
        if (i + 16 <= n8) {                                                                                   \
            const __m256 w = LOAD(wr, i + 8);                                                                 \
            FMA1(a1, x0, i + 8) FMA1(b1, x1, i + 8) FMA1(c1, x2, i + 8)                                       \
        }                                                                                                     \
        if (i + 24 <= n8) {                                                                                   \
            const __m256 w = LOAD(wr, i + 16);                                                                \
            FMA1(a2, x0, i + 16) FMA1(b2, x1, i + 16) FMA1(c2, x2, i + 16)                                    \
        }                                                                                                     \
        float s[3] = {hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))),                     \
                      hsum8(_mm256_add_ps(_mm256_add_ps(b0, b1), _mm256_add_ps(b2, b3))),                     \
                      hsum8(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)))};                    \
        for (int64_t j = 0; j < nt; j++) {                                                                    \
            for (int64_t k = n8; k < n; k++) s[j] += wval(wr, k, bf16) * xs[t + j][k];                        \
            Y[(t + j) * ldy + r] = s[j];                                                                      \
        }                                                                                                     \
    }
#endif

#if defined(MOE_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define MOE_BF16_DOT 1
#endif

#ifdef MOE_AVX512
/* AVX-512 (32 registers): NR rows x NT tokens at a time, one 16-lane accumulator per (row, token) dot product,
   so each 16-element chunk of a weight row is loaded once for NT tokens and each chunk of a token once for NR
   rows (10 loads for 24 FMAs at 4 x 6, where one row at a time needs more loads than FMAs). Every dot product
   sums alike whatever the block (the file comment): its chunks in order into one accumulator, reduced by
   _mm512_reduce_add_ps, then the last n % 16 elements one by one. Four rows read from memory side by side come
   at about half the rate of one stream (the hardware prefetcher), so a block of rows is read one row at a time
   for its first MOE_TOKENS tokens and four at a time, from L1/L2, for the rest: from memory the 4 x 6 block is
   no faster below ~12 tokens per expert (measured on Zen 4), from cache 1.4-2x. */
#define MOE_TOKENS 6
/* The end of every dot product of a block: the accumulator reduced, then elements from..n one by one. */
static inline __attribute__((always_inline)) void finish_dots(__m512 acc[4][MOE_TOKENS], const char *W, int64_t ldb,
                                                              int bf16, const float *const *xs, int64_t t,
                                                              int64_t r, int64_t from, int64_t n, float *Y,
                                                              int64_t ldy, const int NR, const int NT) {
#pragma GCC unroll 4
    for (int a = 0; a < NR; a++) {
        const char *wr = W + (r + a) * ldb;
#pragma GCC unroll 6
        for (int b = 0; b < NT; b++) {
            float s = _mm512_reduce_add_ps(acc[a][b]);
            for (int64_t k = from; k < n; k++) s += wval(wr, k, bf16) * xs[t + b][k];
            Y[(t + b) * ldy + r + a] = s;
        }
    }
}

static inline __attribute__((always_inline)) void dot_block(const char *W, int64_t ldb, int bf16,
                                                            const float *const *xs, int64_t t, int64_t r,
                                                            int64_t n, float *Y, int64_t ldy, const int NR,
                                                            const int NT) {
    const int64_t n16 = n - n % 16;
    __m512 acc[4][MOE_TOKENS];
#pragma GCC unroll 4
    for (int a = 0; a < NR; a++)
#pragma GCC unroll 6
        for (int b = 0; b < NT; b++) acc[a][b] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n16; i += 16) {
        __m512 xv[MOE_TOKENS];
#pragma GCC unroll 6
        for (int b = 0; b < NT; b++) xv[b] = _mm512_loadu_ps(xs[t + b] + i);
#pragma GCC unroll 4
        for (int a = 0; a < NR; a++) {
            const __m512 w = load16(W + (r + a) * ldb, i, bf16);
#pragma GCC unroll 6
            for (int b = 0; b < NT; b++) acc[a][b] = _mm512_fmadd_ps(w, xv[b], acc[a][b]);
        }
    }
    finish_dots(acc, W, ldb, bf16, xs, t, r, n16, n, Y, ldy, NR, NT);
}

#define DOT_BLOCKS(NR)                                                                                        \
    switch (nt) {                                                                                             \
    case 6: dot_block(Wc, ldb, bf16, xs, t, r, n, Y, ldy, NR, 6); break;                                      \
    case 5: dot_block(Wc, ldb, bf16, xs, t, r, n, Y, ldy, NR, 5); break;                                      \
    case 4: dot_block(Wc, ldb, bf16, xs, t, r, n, Y, ldy, NR, 4); break;                                      \
    case 3: dot_block(Wc, ldb, bf16, xs, t, r, n, Y, ldy, NR, 3); break;                                      \
    case 2: dot_block(Wc, ldb, bf16, xs, t, r, n, Y, ldy, NR, 2); break;                                      \
    default: dot_block(Wc, ldb, bf16, xs, t, r, n, Y, ldy, NR, 1); break;                                     \
    }

/* Rows with the tokens in the lanes (fp32 weights, and bf16 with AVX512-BF16): a row is read in 16-byte units
   (4 fp32 or 8 bf16 elements), each unit broadcast to 4 tokens at once, so one 16-byte load feeds 16 fp32
   multiply-adds (bf16: 16 pairs by vdpbf16ps), where a dot product needs a 64-byte load for them, and the rows are
   read front to back, each element once per group of 16 tokens. Each 16-lane accumulator holds 4 tokens x 4
   lanes; lane i of a token takes element i of every unit (bf16: the pair 2i, 2i+1). So the block is multiply-add
   bound from 4 tokens up (measured on Zen 4, fp32: 95-106 GFLOP/s from L2 at 8-64 tokens against 75-83 for the
   4 x 6 dot block) and streams the rows at about DRAM rate from 1. Output (t, r) is the same sum whatever the
   block: each lane's chain over the units in order from zero, then (c0 + c1) + (c2 + c3), so a token's result
   does not depend on the step's other tokens. xt holds a group's tokens as [unit][v][token j of 4][16 bytes],
   zero past the last token and past n. The rows PF_TILES blocks ahead are prefetched into L2 while a block
   computes (without it memory and arithmetic take turns: at 8 tokens the time was their sum), front to back, one
   stream. bf16 products are exact in fp32 (vdpbf16ps reads denormal inputs as zero); the summation order is this
   block's. */
#define LANE_ROWS 8
#define LANE_VECS 4
#define LANE_TOKENS (4 * LANE_VECS)
#define PF_TILES 2
/* up to 2 tokens, fewer fp32 rows side by side: from memory 8 stream slower than 4 (Zen 4: one token 20% slower a
   layer), and 4 rows of 4-lane chains still multiply-add faster than DRAM delivers; bf16 rows are half as long,
   and 8 of them keep vdpbf16ps's chains covered (4: 15% slower a layer at 2 tokens) */
#define NARROW_MAX 2
#define NARROW_ROWS(bf16) ((bf16) ? 8 : 4)

/* line i of the block that starts at address ``ahead``, into L2 (a prefetch never faults: past the rows too) */
static inline __attribute__((always_inline)) void prefetch_line(uintptr_t ahead, int64_t i) {
    _mm_prefetch((const char *)(ahead + (uintptr_t)i * 64), _MM_HINT_T1);
}

/* the last `left` elements of a row as a unit, zero above: nothing past the row is read */
static inline __attribute__((always_inline)) __m128i tail_unit(const char *p, int64_t left, int bf16) {
    const __mmask8 mask = (__mmask8)((1u << left) - 1);
    return bf16 ? _mm_maskz_loadu_epi16(mask, p) : _mm_castps_si128(_mm_maskz_loadu_ps(mask, (const float *)p));
}

/* unit q of a row of n = units * per + left elements: a plain load, or for q == units the masked tail */
static inline __attribute__((always_inline)) __m128i row_unit(const char *row, int64_t q, int64_t units, int64_t left,
                                                              int bf16) {
    return q < units ? _mm_loadu_si128((const __m128i *)(row + 16 * q)) : tail_unit(row + 16 * q, left, bf16);
}

static inline __attribute__((always_inline)) __m512 madd16(__m512 acc, __m512i w, __m512i x, int bf16) {
#ifdef MOE_BF16_DOT
    if (bf16) return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
#endif
    return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_castsi512_ps(x), acc);
}
static inline __attribute__((always_inline)) __m256 madd8(__m256 acc, __m256i w, __m256i x, int bf16) {
#ifdef MOE_BF16_DOT
    if (bf16) return _mm256_dpbf16_ps(acc, (__m256bh)w, (__m256bh)x);
#endif
    return _mm256_fmadd_ps(_mm256_castsi256_ps(w), _mm256_castsi256_ps(x), acc);
}
static inline __attribute__((always_inline)) __m128 madd4(__m128 acc, __m128i w, __m128i x, int bf16) {
#ifdef MOE_BF16_DOT
    if (bf16) return _mm_dpbf16_ps(acc, (__m128bh)w, (__m128bh)x);
#endif
    return _mm_fmadd_ps(_mm_castsi128_ps(w), _mm_castsi128_ps(x), acc);
}

/* Rows r .. r+R-1 of a block; returns the address of the block PF_TILES blocks ahead (what to prefetch). */
static inline __attribute__((always_inline)) uintptr_t lane_rows(const char **wr, const char *W, int64_t ldb,
                                                                 int64_t r, const int R) {
#pragma GCC unroll 8
    for (int a = 0; a < R; a++) wr[a] = W + (r + a) * ldb;
    return (uintptr_t)W + (uintptr_t)((r + PF_TILES * R) * ldb);
}

/* The end of every lane dot product: token j's four lanes c, summed (c0 + c1) + (c2 + c3). */
static inline __attribute__((always_inline)) float lane_sum(const float *c) { return (c[0] + c[1]) + (c[2] + c[3]); }

static inline __attribute__((always_inline)) void lane_block(const char *W, int64_t ldb, int bf16, const char *xt,
                                                             int64_t n, int64_t r, int64_t t0, int64_t mt,
                                                             float *Y, int64_t ldy, const int R, const int V) {
    const int64_t per = bf16 ? 8 : 4, units = n / per, left = n - units * per, vs = 64 * V;
    __m512 acc[LANE_ROWS][LANE_VECS];
    const char *wr[LANE_ROWS];
    const uintptr_t ahead = lane_rows(wr, W, ldb, r, R);
#pragma GCC unroll 8
    for (int a = 0; a < R; a++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) acc[a][v] = _mm512_setzero_ps();
    for (int64_t q = 0; q < units + (left > 0); q++) {
        if ((q & 3) == 0) {
#pragma GCC unroll 8
            for (int a = 0; a < R; a++) prefetch_line(ahead, (q / 4) * R + a);
        }
        __m512i xv[LANE_VECS];
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) xv[v] = _mm512_loadu_si512((const void *)(xt + q * vs + 64 * v));
#pragma GCC unroll 8
        for (int a = 0; a < R; a++) {
            const __m512i w = _mm512_broadcast_i32x4(row_unit(wr[a], q, units, left, bf16));
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[a][v] = madd16(acc[a][v], w, xv[v], bf16);
        }
    }
    float lanes[16];
#pragma GCC unroll 8
    for (int a = 0; a < R; a++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) {  /* lane_sum of all four tokens at once: lane 4j = (c0 + c1) + (c2 + c3) */
            const __m512 pairs = _mm512_add_ps(acc[a][v], _mm512_permute_ps(acc[a][v], 0xB1));
            _mm512_storeu_ps(lanes, _mm512_add_ps(pairs, _mm512_permute_ps(pairs, 0x4E)));
            for (int64_t j = 0; j < 4 && 4 * v + j < mt; j++) Y[(t0 + 4 * v + j) * ldy + r + a] = lanes[4 * j];
        }
}

/* lane_block for one or two tokens: the same lanes in a 4- or 8-lane register, so the same sums (one token in
   16 lanes would leave 12 idle and take a 16-lane multiply-add per 4 of its). Both read each row 64 bytes at a
   time and take the units apart in registers (16-byte loads of L3-resident rows came at 2/3 the rate for one
   token, half for two). */
static inline __attribute__((always_inline)) void lane_block1(const char *W, int64_t ldb, int bf16, const char *xt,
                                                              int64_t n, int64_t r, int64_t t0, float *Y,
                                                              int64_t ldy, const int R) {
    const int64_t per = bf16 ? 8 : 4, units = n / per, left = n - units * per, units4 = units & ~(int64_t)3;
    __m128 acc[LANE_ROWS];
    const char *wr[LANE_ROWS];
    const uintptr_t ahead = lane_rows(wr, W, ldb, r, R);
#pragma GCC unroll 8
    for (int a = 0; a < R; a++) acc[a] = _mm_setzero_ps();
    int64_t q = 0;
    for (; q < units4; q += 4) {
        const __m128i x0 = _mm_loadu_si128((const __m128i *)(xt + 64 * q)),
                      x1 = _mm_loadu_si128((const __m128i *)(xt + 64 * (q + 1))),
                      x2 = _mm_loadu_si128((const __m128i *)(xt + 64 * (q + 2))),
                      x3 = _mm_loadu_si128((const __m128i *)(xt + 64 * (q + 3)));
#pragma GCC unroll 8
        for (int a = 0; a < R; a++) {
            prefetch_line(ahead, (q / 4) * R + a);
            const __m512i w = _mm512_loadu_si512((const void *)(wr[a] + 16 * q));
            acc[a] = madd4(acc[a], _mm512_castsi512_si128(w), x0, bf16);
            acc[a] = madd4(acc[a], _mm512_extracti32x4_epi32(w, 1), x1, bf16);
            acc[a] = madd4(acc[a], _mm512_extracti32x4_epi32(w, 2), x2, bf16);
            acc[a] = madd4(acc[a], _mm512_extracti32x4_epi32(w, 3), x3, bf16);
        }
    }
    for (; q < units + (left > 0); q++) {
        const __m128i xv = _mm_loadu_si128((const __m128i *)(xt + 64 * q));
#pragma GCC unroll 8
        for (int a = 0; a < R; a++) acc[a] = madd4(acc[a], row_unit(wr[a], q, units, left, bf16), xv, bf16);
    }
    float lanes[4];
#pragma GCC unroll 8
    for (int a = 0; a < R; a++) {
        _mm_storeu_ps(lanes, acc[a]);
        Y[t0 * ldy + r + a] = lane_sum(lanes);
    }
}

static inline __attribute__((always_inline)) void lane_block2(const char *W, int64_t ldb, int bf16, const char *xt,
                                                              int64_t n, int64_t r, int64_t t0, float *Y,
                                                              int64_t ldy, const int R) {
    const int64_t per = bf16 ? 8 : 4, units = n / per, left = n - units * per, units4 = units & ~(int64_t)3;
    __m256 acc[LANE_ROWS];
    const char *wr[LANE_ROWS];
    const uintptr_t ahead = lane_rows(wr, W, ldb, r, R);
#pragma GCC unroll 8
    for (int a = 0; a < R; a++) acc[a] = _mm256_setzero_ps();
    int64_t q = 0;
    for (; q < units4; q += 4) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xt + 64 * q)),
                      x1 = _mm256_loadu_si256((const __m256i *)(xt + 64 * (q + 1))),
                      x2 = _mm256_loadu_si256((const __m256i *)(xt + 64 * (q + 2))),
                      x3 = _mm256_loadu_si256((const __m256i *)(xt + 64 * (q + 3)));
#pragma GCC unroll 8
        for (int a = 0; a < R; a++) {
            prefetch_line(ahead, (q / 4) * R + a);
            const __m512i w = _mm512_loadu_si512((const void *)(wr[a] + 16 * q));
            const __m512i lo = _mm512_shuffle_i64x2(w, w, 0x50), hi = _mm512_shuffle_i64x2(w, w, 0xfa);
            acc[a] = madd8(acc[a], _mm512_castsi512_si256(lo), x0, bf16);
            acc[a] = madd8(acc[a], _mm512_extracti64x4_epi64(lo, 1), x1, bf16);
            acc[a] = madd8(acc[a], _mm512_castsi512_si256(hi), x2, bf16);
            acc[a] = madd8(acc[a], _mm512_extracti64x4_epi64(hi, 1), x3, bf16);
        }
    }
    for (; q < units + (left > 0); q++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xt + 64 * q));
#pragma GCC unroll 8
        for (int a = 0; a < R; a++)
            acc[a] = madd8(acc[a], _mm256_broadcastsi128_si256(row_unit(wr[a], q, units, left, bf16)), xv, bf16);
    }
    float lanes[8];
#pragma GCC unroll 8
    for (int a = 0; a < R; a++) {
        _mm256_storeu_ps(lanes, acc[a]);
        Y[t0 * ldy + r + a] = lane_sum(lanes);
        Y[(t0 + 1) * ldy + r + a] = lane_sum(lanes + 4);
    }
}

#define LANE_BLOCKS(R)                                                                                        \
    if (mt == 1) {                                                                                            \
        lane_block1(Wc, ldb, bf16, xg, n, r, t0, Y, ldy, R);                                                  \
    } else if (mt == 2) {                                                                                     \
        lane_block2(Wc, ldb, bf16, xg, n, r, t0, Y, ldy, R);                                                  \
    } else {                                                                                                  \
        switch (V) {                                                                                          \
        case 1: lane_block(Wc, ldb, bf16, xg, n, r, t0, mt, Y, ldy, R, 1); break;                             \
        case 2: lane_block(Wc, ldb, bf16, xg, n, r, t0, mt, Y, ldy, R, 2); break;                             \
        case 3: lane_block(Wc, ldb, bf16, xg, n, r, t0, mt, Y, ldy, R, 3); break;                             \
        default: lane_block(Wc, ldb, bf16, xg, n, r, t0, mt, Y, ldy, R, 4); break;                            \
        }                                                                                                     \
    }

/* The tokens' lane copy: one buffer per thread, kept and grown, never given back. A fresh allocation per call
   (32 KiB for one token at K 512) came back from the heap's top as new pages each time, and their faults cost a
   batch-1 step more than the arithmetic. */
static char *lane_scratch(size_t bytes) {
    static __thread char *buffer;
    static __thread size_t capacity;
    if (bytes > capacity) {
        const size_t grown = (bytes + 65535) & ~(size_t)65535;
        char *fresh = (char *)aligned_alloc(64, grown);
        if (!fresh) return 0;
        free(buffer);
        buffer = fresh;
        capacity = grown;
    }
    return buffer;
}

/* Y[t, r] by lane_block: row blocks of ~256 KiB (L2) outside, groups of 16 tokens inside, so past 16 tokens a
   row block is read from memory once. Returns 0 where the scratch cannot be had. */
static int gemm_rows_lanes(const void *W, int64_t ldw, int bf16, const float *const *xs, int64_t m, int64_t n,
                           int64_t rows, float *Y, int64_t ldy) {
    const int64_t esz = bf16 ? 2 : 4, per = bf16 ? 8 : 4, units = (n + per - 1) / per;
    const int64_t groups = (m + LANE_TOKENS - 1) / LANE_TOKENS, group_bytes = units * 64 * LANE_VECS;
    char *xt = lane_scratch((size_t)(groups * group_bytes));
    if (!xt) return 0;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t t0 = g * LANE_TOKENS, mt = m - t0 < LANE_TOKENS ? m - t0 : LANE_TOKENS;
        const int64_t V = (mt + 3) / 4;
        char *xg = xt + g * group_bytes;
        for (int64_t q = 0; q < units; q++)
            for (int64_t v = 0; v < V; v++)
                for (int64_t j = 0; j < 4; j++)
                    for (int64_t i = 0; i < per; i++) {
                        const int64_t t = 4 * v + j, k = per * q + i;
                        const float x = t < mt && k < n ? xs[t0 + t][k] : 0.f;
                        char *slot = xg + q * 64 * V + 64 * v + 16 * j + esz * i;
                        if (bf16) {
                            const uint16_t h = f32_to_bf16(x);
                            memcpy(slot, &h, 2);
                        } else {
                            memcpy(slot, &x, 4);
                        }
                    }
    }
    const char *Wc = (const char *)W;
    const int64_t ldb = ldw * esz, fit = 262144 / (n * esz), block = fit >= 24 ? fit / 24 * 24 : 24;
    for (int64_t r0 = 0; r0 < rows; r0 += block) {
        const int64_t r1 = r0 + block < rows ? r0 + block : rows;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t t0 = g * LANE_TOKENS, mt = m - t0 < LANE_TOKENS ? m - t0 : LANE_TOKENS;
            const int V = (int)((mt + 3) / 4), R = mt <= NARROW_MAX ? NARROW_ROWS(bf16) : V <= 2 ? 8 : 6;
            const char *xg = xt + g * group_bytes;
            int64_t r = r0;
            if (R == 8) {
                for (; r + 8 <= r1; r += 8) LANE_BLOCKS(8)
            } else if (R == 4) {
                for (; r + 4 <= r1; r += 4) LANE_BLOCKS(4)
            } else {
                for (; r + 6 <= r1; r += 6) LANE_BLOCKS(6)
            }
            for (; r < r1; r++) LANE_BLOCKS(1)
        }
    }
    return 1;
}
#endif

#ifdef MOE_AMX
/* bf16 rows on AMX tiles (Sapphire Rapids and later): per block of 16 weight rows and group of up to 16 tokens,
   C[r][t] += W[r, 32 k] . x[t, 32 k] by tdpbf16ps, the weight rows loaded into a tile as they lie and the tokens
   packed once into pairs (VNNI: tile row kk holds each token's elements 2kk and 2kk+1). Each sum is a column of
   its own, so a token's result does not depend on the others. Linux hands out the tile state on request
   (arch_prctl); where it refuses, or the scratch cannot be had, the caller takes the other paths. */
#define AMX_REQ_PERM 0x1023  /* ARCH_REQ_XCOMP_PERM */
#define AMX_XTILEDATA 18     /* XFEATURE_XTILEDATA */

static int amx_granted(void) {
    static int state = -1;  /* a race here only asks twice */
    if (state < 0) state = syscall(SYS_arch_prctl, AMX_REQ_PERM, AMX_XTILEDATA) == 0;
    return state;
}

struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* tile 0: C [nr rows x nt fp32]; 1: A [nr rows x 32 bf16]; 2: B [16 pair rows x nt pairs] */
static void amx_configure(int nr, int nt) {
    struct amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = (uint8_t)nr, cfg.colsb[0] = (uint16_t)(4 * nt);
    cfg.rows[1] = (uint8_t)nr, cfg.colsb[1] = 64;
    cfg.rows[2] = 16, cfg.colsb[2] = (uint16_t)(4 * nt);
    _tile_loadconfig(&cfg);
}

/* The tokens of one group, as bf16 pairs: pk[c][kk][t] = (x_t[32 c + 2 kk], x_t[32 c + 2 kk + 1]), zeros past n
   (the tile reads only the group's nt columns). */
static void amx_pack(const float *const *xs, int64_t nt, int64_t n, int64_t chunks, uint16_t *pk) {
    uint32_t *pairs = (uint32_t *)pk;
    for (int64_t t = 0; t < nt; t++)
        for (int64_t c = 0; c < chunks; c++) {
            const float *x = xs[t] + 32 * c;
            const int64_t left = n - 32 * c;
            uint32_t *dst = pairs + c * 256 + t;
            if (left >= 32) {
                for (int kk = 0; kk < 16; kk++)
                    dst[16 * kk] = (uint32_t)f32_to_bf16(x[2 * kk]) | (uint32_t)f32_to_bf16(x[2 * kk + 1]) << 16;
            } else {
                for (int kk = 0; kk < 16; kk++) {
                    const uint32_t lo = 2 * kk < left ? f32_to_bf16(x[2 * kk]) : 0;
                    const uint32_t hi = 2 * kk + 1 < left ? f32_to_bf16(x[2 * kk + 1]) : 0;
                    dst[16 * kk] = lo | hi << 16;
                }
            }
        }
}

static int gemm_rows_amx(const uint16_t *W, int64_t ldw, const float *const *xs, int64_t m, int64_t n, int64_t rows,
                         float *Y, int64_t ldy) {
    const int64_t chunks = (n + 31) / 32, whole = n / 32, groups = (m + 15) / 16;
    char *scratch = lane_scratch((size_t)(groups * chunks * 1024 + 1024 + 1024));
    if (!amx_granted() || scratch == 0) return 0;
    uint16_t *packed = (uint16_t *)scratch, *tail = packed + groups * chunks * 512;  /* tail: [16][32] bf16 */
    float *cbuf = (float *)(tail + 512);
    for (int64_t g = 0; g < groups; g++)
        amx_pack(xs + 16 * g, m - 16 * g < 16 ? m - 16 * g : 16, n, chunks, packed + g * chunks * 512);
    int configured_nr = 0, configured_nt = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int nr = rows - r0 < 16 ? (int)(rows - r0) : 16;
        /* the rows two blocks ahead, into L2: tile loads take 64 bytes from each of 16 rows, a pattern the
           hardware prefetcher does not follow from memory */
        for (int64_t r = r0 + 32; r < r0 + 48 && r < rows; r++)
            for (int64_t b = 0; b < n * 2; b += 64) __builtin_prefetch((const char *)(W + r * ldw) + b, 0, 2);
        if (whole < chunks) {  /* the last, partial chunk of the block's rows, zero-padded to 32 */
            memset(tail, 0, 1024);
            for (int r = 0; r < nr; r++) memcpy(tail + r * 32, W + (r0 + r) * ldw + whole * 32, (size_t)(n - whole * 32) * 2);
        }
        for (int64_t g = 0; g < groups; g++) {
            const int nt = m - 16 * g < 16 ? (int)(m - 16 * g) : 16;
            if (nr != configured_nr || nt != configured_nt) amx_configure(nr, nt), configured_nr = nr, configured_nt = nt;
            _tile_zero(0);
            const uint16_t *pk = packed + g * chunks * 512;
            for (int64_t c = 0; c < chunks; c++) {
                if (c < whole) _tile_loadd(1, W + r0 * ldw + c * 32, ldw * 2);
                else _tile_loadd(1, tail, 64);
                _tile_loadd(2, pk + c * 512, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, cbuf, 64);
            for (int r = 0; r < nr; r++)
                for (int t = 0; t < nt; t++) Y[(16 * g + t) * ldy + r0 + r] = cbuf[r * 16 + t];
        }
    }
    _tile_release();
    return 1;
}
#endif

static void gemm_rows(const void *W, int64_t ldw, int bf16, const float *const *xs, int64_t m, int64_t n,
                      int64_t rows, float *Y, int64_t ldy) {
    const int64_t esz = bf16 ? 2 : 4;
#ifdef MOE_AMX
    if (bf16 && gemm_rows_amx((const uint16_t *)W, ldw, xs, m, n, rows, Y, ldy)) return;
#endif
#if defined(MOE_AVX512)
#ifdef MOE_BF16_DOT
    if (gemm_rows_lanes(W, ldw, bf16, xs, m, n, rows, Y, ldy)) return;
#else
    if (!bf16 && gemm_rows_lanes(W, ldw, 0, xs, m, n, rows, Y, ldy)) return;
#endif
    /* bf16 rows without AVX512-BF16, or no scratch: dot products, 4 rows x 6 tokens once the rows are cached, in
       blocks of rows (~16 KiB, a multiple of 4) x blocks of MOE_TOKENS tokens */
    const int64_t ldb = ldw * esz;
    const char *Wc = (const char *)W;
    const int64_t fit = 16384 / (n * esz), row_block = fit >= 4 ? fit & ~(int64_t)3 : 4;
    for (int64_t r0 = 0; r0 < rows; r0 += row_block) {
        const int64_t r1 = r0 + row_block < rows ? r0 + row_block : rows;
        for (int64_t t = 0; t < m; t += MOE_TOKENS) {
            const int64_t nt = m - t < MOE_TOKENS ? m - t : MOE_TOKENS;
            int64_t r = r0;
            if (t > 0) { /* the block's rows are in L1/L2 now: four at a time */
                for (; r + 4 <= r1; r += 4) DOT_BLOCKS(4)
            }
            for (; r < r1; r++) {
                DOT_BLOCKS(1)
            }
        }
    }
#elif defined(MOE_AVX2)
    const int64_t n8 = n - n % 8;
    /* blocks of rows (~16 KiB, streamed from memory once, then read from L2) x blocks of 12 tokens (L1) */
    const int64_t row_block = 16384 / (n * esz) > 1 ? 16384 / (n * esz) : 1;
    for (int64_t r0 = 0; r0 < rows; r0 += row_block) {
        const int64_t r1 = r0 + row_block < rows ? r0 + row_block : rows;
        for (int64_t t0 = 0; t0 < m; t0 += 12) {
            const int64_t t1 = t0 + 12 < m ? t0 + 12 : m;
            for (int64_t r = r0; r < r1; r++) {
                const char *wr = (const char *)W + r * ldw * esz;
                if (bf16) {
                    ROW_BODY(load8_bf16)
                } else {
                    ROW_BODY(load8_f32)
                }
            }
        }
    }
#else
    for (int64_t r = 0; r < rows; r++) {
        const char *wr = (const char *)W + r * ldw * esz;
        for (int64_t t = 0; t < m; t++) {
            float s = 0.f;
            for (int64_t i = 0; i < n; i++) s += wval(wr, i, bf16) * xs[t][i];
            Y[t * ldy + r] = s;
        }
    }
#endif
}

int moetide_moe_abi_version(void) { return 1; }

/* The vector path gemm_rows runs: 4 AMX tiles for bf16 (built for them and granted by the OS) beside AVX-512 for
   fp32, 3 AVX-512 with AVX512-BF16 dot products, 2 AVX-512, 1 AVX2, 0 plain C. Where the native linear beats
   torch's GEMM depends on it (engine/models/ops.py). */
int moetide_linear_isa(void) {
#ifdef MOE_AMX
    if (amx_granted()) return 4;
#endif
#if defined(MOE_AVX512) && defined(MOE_BF16_DOT)
    return 3;
#elif defined(MOE_AVX512)
    return 2;
#elif defined(MOE_AVX2)
    return 1;
#else
    return 0;
#endif
}

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
            silu_f32(hj, I);
            for (int64_t i = 0; i < I; i++) hj[i] = hj[i] * hj[I + i];
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
            for (int64_t i = 0; i < I; i++) hj[i] = round_bf16(hj[i]);
            silu_f32(hj, I);
            for (int64_t i = 0; i < I; i++) hj[i] = round_bf16(round_bf16(hj[i]) * round_bf16(hj[I + i]));
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

/* y [T, N] = x [T, K] W^T for W [N, K] (rows K apart), fp32 or bf16 (bf16 != 0: x, W and y bf16, the sums in
   fp32 rounded once, as torch's bf16 linear). scratch holds T*K + T*N floats (bf16) or nothing (fp32); xs T
   pointers. */
void moetide_linear(const void *x, int64_t T, int64_t K, int64_t bf16, const void *W, int64_t N, void *y,
                    float *scratch, int64_t *pscratch) {
    const float **xs = (const float **)pscratch;
    float *yf = bf16 ? scratch + T * K : (float *)y;
    for (int64_t t = 0; t < T; t++) {
        if (bf16) {
            for (int64_t i = 0; i < K; i++) scratch[t * K + i] = bf16_to_f32(((const uint16_t *)x)[t * K + i]);
            xs[t] = scratch + t * K;
        } else {
            xs[t] = (const float *)x + t * K;
        }
    }
    gemm_rows(W, K, (int)bf16, xs, T, K, N, yf, N);
    if (bf16)
        for (int64_t i = 0; i < T * N; i++) ((uint16_t *)y)[i] = f32_to_bf16(yf[i]);
}
