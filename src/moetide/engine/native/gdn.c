/* moetide's native Gated DeltaNet step (Qwen3-Next's linear attention: decode, and prefill token by token) and
   the model-dtype RMSNorm forms around it, called through ctypes (engine/native/__init__.py).

   Why: at decode the layer's torch path is a few dozen small ops per step — a depthwise conv1d over a stacked
   window (in bf16 alone a third of a Qwen3-Next step on the CPU), l2 norms, the recurrent delta rule over
   [Hv, Dk, Dv] states gathered into one tensor and copied back; at prefill the torch chunked rule pads each
   piece to a chunk of 64 and runs some thirty ops per chunk. Here each sequence's state is updated where it lies
   in its pool blocks (no gather, no scatter), streamed once per token per head. At Dk = Dv = 128 a chunk of the
   chunked rule costs about as many multiply-adds a token as the recurrent step, and the state stays in L2.

   Arithmetic as transformers' torch fallback (torch_causal_conv1d_update, torch_recurrent_gated_delta_rule):
   the conv sums in fp32 and rounds to the model dtype, SiLU rounds again; q and k are l2-normalized in fp32
   (eps 1e-6) and q is scaled by Dk^-0.5; state = state * exp(g); delta = (v - state^T k) * beta;
   state += k delta^T; out = state^T q; out rounds to the model dtype. Sums run in another order: equal to fp32
   round-off. A token's result does not depend on the other sequences of the step. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "simd.h"

static void l2norm_scaled(float *x, int64_t n, float scale) {
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.f / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * inv * scale;
}

/* One row of rms_norm; bf16 is a constant at each call, so each dtype's loops are compiled (and vectorized) on
   their own. */
static inline __attribute__((always_inline)) void rms_norm_row(const void *x, int64_t D, const int bf16, float eps,
                                                               const void *w, int64_t zero_centered,
                                                               const void *gate, void *out) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        for (int j = 0; j < 8; j++) {
            const float v = load_any(x, d + j, bf16);
            acc[j] += v * v;
        }
    float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < D; d++) {
        const float v = load_any(x, d, bf16);
        ss += v * v;
    }
    const float inv = 1.f / sqrtf(ss / (float)D + eps);
    if (zero_centered) {
        for (d = 0; d < D; d++) store_any(out, d, (load_any(x, d, bf16) * inv) * (1.f + load_any(w, d, bf16)), bf16);
    } else {
        for (d = 0; d < D; d++)
            store_any(out, d, load_any(w, d, bf16) * to_dtype(load_any(x, d, bf16) * inv, bf16), bf16);
    }
    if (gate != 0) {
        float act[64];  /* SiLU(gate) a chunk at a time, vectorized (simd.h) */
        for (int64_t c0 = 0; c0 < D; c0 += 64) {
            const int64_t n = D - c0 < 64 ? D - c0 : 64;
            for (d = 0; d < n; d++) act[d] = load_any(gate, c0 + d, bf16);
            silu_f32(act, n);
            for (d = 0; d < n; d++) store_any(out, c0 + d, load_any(out, c0 + d, bf16) * act[d], bf16);
        }
    }
}

/* r += x over D elements, each sum rounded to the dtype (bf16 != 0) as torch's add rounds */
static inline __attribute__((always_inline)) void add_row(void *r, const void *x, int64_t D, const int bf16) {
    for (int64_t d = 0; d < D; d++) store_any(r, d, load_any(r, d, bf16) + load_any(x, d, bf16), bf16);
}

/* RMSNorm over rows of D in the model dtype (bf16 != 0: bf16, else fp32), x rows x_stride elements apart, out
   [T, D] contiguous, w [D] model dtype; the sum of squares in fp32 over eight lanes. zero_centered (Qwen3-Next):
   out = x·inv·(1 + w) rounded once, as transformers' Qwen3NextRMSNorm; else out = w · round(x·inv), as
   Qwen3MoeRMSNorm; with gate (rows gate_stride apart, the gated norm of Gated DeltaNet) that rounded result is
   then multiplied by SiLU(gate) in fp32 and rounded again. With residual ([T, D] contiguous, else NULL), each
   row is first added into it (rounded to the dtype, as torch's add) and the sum is what is normalized: vLLM's
   fused_add_rms_norm, one call where the decoder layer had an add and a norm. */
void moetide_rms_norm(const void *x, int64_t T, int64_t x_stride, int64_t D, int64_t bf16, float eps,
                      const void *w, int64_t zero_centered, const void *gate, int64_t gate_stride, void *residual,
                      void *out) {
    const int64_t esz = bf16 ? 2 : 4;
    for (int64_t t = 0; t < T; t++) {
        const char *xt = (const char *)x + t * x_stride * esz;
        if (residual != 0) {
            char *rt = (char *)residual + t * D * esz;
            if (bf16)
                add_row(rt, xt, D, 1);
            else
                add_row(rt, xt, D, 0);
            xt = rt;
        }
        const char *gt = gate != 0 ? (const char *)gate + t * gate_stride * esz : 0;
        char *ot = (char *)out + t * D * esz;
        if (bf16)
            rms_norm_row(xt, D, 1, eps, w, zero_centered, gt, ot);
        else
            rms_norm_row(xt, D, 0, eps, w, zero_centered, gt, ot);
    }
}

/* A sequence's state bytes in place (models.StateBlocks): byte off lies at table[off / bb] + off % bb. */
static char *state_at(const int64_t *table, int64_t bb, int64_t off) {
    return (char *)(intptr_t)table[off / bb] + off % bb;
}

/* Copies n state bytes from byte off to buf (to_state == 0) or back, across block boundaries. */
static void copy_state(const int64_t *table, int64_t bb, int64_t off, char *buf, int64_t n, int to_state) {
    while (n > 0) {
        const int64_t piece = bb - off % bb < n ? bb - off % bb : n;
        char *at = state_at(table, bb, off);
        if (to_state) memcpy(at, buf, (size_t)piece);
        else memcpy(buf, at, (size_t)piece);
        off += piece, buf += piece, n -= piece;
    }
}

/* The causal conv of n tokens of one sequence before the SiLU, vectorized over the channels: hist [km1 + n, C]
   fp32 holds the km1 inputs before these tokens (the conv state, token-major), then the n tokens' inputs; wT
   [km1 + 1, C] the weights, fp32. act[t][c] = sum_{j<km1} wT[j][c] hist[t+j][c] + wT[km1][c] hist[t+km1][c]
   (summed in that order), rounded to the dtype. bf16 and, at a call with a constant, km1 are constants, so each
   form is compiled on its own. */
static inline __attribute__((always_inline)) void conv_rows(const float *hist, int64_t n, const float *wT, int64_t C,
                                                            const int64_t km1, const int bf16, float *act) {
    for (int64_t t = 0; t < n; t++) {
        float *a = act + t * C;
        for (int64_t c = 0; c < C; c++) a[c] = 0.f;
        for (int64_t j = 0; j < km1; j++) {
            const float *h = hist + (t + j) * C, *w = wT + j * C;
            for (int64_t c = 0; c < C; c++) a[c] += w[c] * h[c];
        }
        const float *x = hist + (t + km1) * C, *w = wT + km1 * C;
        for (int64_t c = 0; c < C; c++) a[c] = to_dtype(a[c] + w[c] * x[c], bf16);
    }
}

/* Sixteen floats as one value (GCC's vector extension): one AVX-512 register, two AVX2 ones, else as the target
   has. A pass over the state keeps the sums of up to GDN_VECS of them (GDN_VECS x 16 columns) in registers. */
typedef float v16f __attribute__((vector_size(64)));
#define GDN_VECS 4

static inline v16f ld16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void st16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

/* kv[d0 .. d0 + 16 nv) = sum_i (rows[i][d] * decay) * k[i], the rows in order (nv <= GDN_VECS, a constant at
   each call). */
static inline __attribute__((always_inline)) void state_t_k(float **rows, int64_t Dk, int64_t d0, const int nv,
                                                             float decay, const float *k, float *kv) {
    v16f acc[GDN_VECS] = {0};
    for (int64_t i = 0; i < Dk; i++) {
        const float ki = k[i], *row = rows[i] + d0;
        for (int u = 0; u < nv; u++) acc[u] += (ld16(row + 16 * u) * decay) * ki;
    }
    for (int u = 0; u < nv; u++) st16(kv + d0 + 16 * u, acc[u]);
}

/* Columns [d0, d0 + 16 nv) of one token's update: S = decay S + k delta^T (delta in kv), o = S^T q and, where
   k_next, kn = (decay_next S)^T k_next from the rows just written; the rows in order. */
static inline __attribute__((always_inline)) void state_update(float **rows, int64_t Dk, int64_t d0, const int nv,
                                                                float decay, const float *k, const float *kv,
                                                                const float *q, float *o, float decay_next,
                                                                const float *k_next, float *kn) {
    v16f dl[GDN_VECS], acc_o[GDN_VECS] = {0}, acc_n[GDN_VECS] = {0};
    for (int u = 0; u < nv; u++) dl[u] = ld16(kv + d0 + 16 * u);
    for (int64_t i = 0; i < Dk; i++) {
        const float ki = k[i], qi = q[i];
        float *row = rows[i] + d0;
        if (k_next != 0) {
            const float kni = k_next[i];
            for (int u = 0; u < nv; u++) {
                const v16f updated = ld16(row + 16 * u) * decay + ki * dl[u];
                st16(row + 16 * u, updated);
                acc_o[u] += updated * qi;
                acc_n[u] += (updated * decay_next) * kni;
            }
        } else {
            for (int u = 0; u < nv; u++) {
                const v16f updated = ld16(row + 16 * u) * decay + ki * dl[u];
                st16(row + 16 * u, updated);
                acc_o[u] += updated * qi;
            }
        }
    }
    for (int u = 0; u < nv; u++) st16(o + d0 + 16 * u, acc_o[u]);
    if (k_next != 0)
        for (int u = 0; u < nv; u++) st16(kn + d0 + 16 * u, acc_n[u]);
}

/* The same two passes for columns [d0, Dv) past the last whole 16 (fewer than 16), a column at a time. */
static void state_t_k_tail(float **rows, int64_t Dk, int64_t d0, int64_t Dv, float decay, const float *k,
                           float *kv) {
    for (int64_t d = d0; d < Dv; d++) {
        float acc = 0.f;
        for (int64_t i = 0; i < Dk; i++) acc += (rows[i][d] * decay) * k[i];
        kv[d] = acc;
    }
}

static void state_update_tail(float **rows, int64_t Dk, int64_t d0, int64_t Dv, float decay, const float *k,
                              const float *kv, const float *q, float *o, float decay_next, const float *k_next,
                              float *kn) {
    for (int64_t d = d0; d < Dv; d++) {
        float acc_o = 0.f, acc_n = 0.f;
        for (int64_t i = 0; i < Dk; i++) {
            const float updated = rows[i][d] * decay + k[i] * kv[d];
            rows[i][d] = updated;
            acc_o += updated * q[i];
            if (k_next != 0) acc_n += (updated * decay_next) * k_next[i];
        }
        o[d] = acc_o;
        if (k_next != 0) kn[d] = acc_n;
    }
}

/* Both passes over all Dv columns: whole blocks of GDN_VECS x 16, then one of fewer 16s, then the tail. */
static void pass_t_k(float **rows, int64_t Dk, int64_t Dv, float decay, const float *k, float *kv) {
    const int64_t block = 16 * GDN_VECS, whole = Dv - Dv % block, sixteens = (Dv - whole) / 16;
    for (int64_t d0 = 0; d0 < whole; d0 += block) state_t_k(rows, Dk, d0, GDN_VECS, decay, k, kv);
    for (int64_t u = 0; u < sixteens; u++) state_t_k(rows, Dk, whole + 16 * u, 1, decay, k, kv);
    state_t_k_tail(rows, Dk, whole + 16 * sixteens, Dv, decay, k, kv);
}

static void pass_update(float **rows, int64_t Dk, int64_t Dv, float decay, const float *k, const float *kv,
                        const float *q, float *o, float decay_next, const float *k_next, float *kn) {
    const int64_t block = 16 * GDN_VECS, whole = Dv - Dv % block, sixteens = (Dv - whole) / 16;
    for (int64_t d0 = 0; d0 < whole; d0 += block)
        state_update(rows, Dk, d0, GDN_VECS, decay, k, kv, q, o, decay_next, k_next, kn);
    for (int64_t u = 0; u < sixteens; u++)
        state_update(rows, Dk, whole + 16 * u, 1, decay, k, kv, q, o, decay_next, k_next, kn);
    state_update_tail(rows, Dk, whole + 16 * sixteens, Dv, decay, k, kv, q, o, decay_next, k_next, kn);
}

/* The delta rule for one value head of one sequence over n tokens, on its state rows (rows[i]: row i of the
   [Dk, Dv] fp32 state, wherever it lies): per token t, S = decay S; delta = (v - S^T k) beta; S += k delta^T;
   out = S^T q. A first pass over S gives token 0's S^T k; then one pass per token updates S, sums its output
   and, from the rows just written, the next token's (decay S)^T k, so S is streamed once per token (the sums are
   the same as a second pass would make). Each pass keeps its column sums in registers (pass_update).
   q, k, v of token t lie at act + t * C (+ the head's offsets); g, beta of token t at [t * Hv]; out of token t at
   out_row + t * Hv * Dv. Before the last token's pass the rows at `ahead` (the next head's, or NULL) are
   prefetched into L2, so that head's first pass does not wait on memory. kv, kn, o: Dv floats each. */
static void delta_rule_head(float **rows, int64_t n, const float *act, int64_t C, int64_t q_off, int64_t k_off,
                            int64_t v_off, const float *g, const float *beta, int64_t Hv, int64_t Dk, int64_t Dv,
                            void *out_row, int bf16, float *kv, float *kn, float *o, const int64_t *ahead_table,
                            int64_t bb, int64_t ahead_off) {
    const int64_t row_bytes = Dv * (int64_t)sizeof(float);
    float decay = expf(g[0]);
    pass_t_k(rows, Dk, Dv, decay, act + k_off, kv);
    for (int64_t t = 0; t < n; t++) {
        const float *q = act + t * C + q_off, *k = act + t * C + k_off, *v = act + t * C + v_off;
        const float b = beta[t * Hv];
        for (int64_t d = 0; d < Dv; d++) kv[d] = (v[d] - kv[d]) * b;  /* delta */
        const int next = t + 1 < n;
        const float decay_next = next ? expf(g[(t + 1) * Hv]) : 0.f, *k_next = next ? k + C : 0;
        if (!next && ahead_table != 0)
            for (int64_t i = 0; i < Dk; i++) {
                const char *ahead = state_at(ahead_table, bb, ahead_off + i * row_bytes);
                for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(ahead + line, 0, 2);
            }
        pass_update(rows, Dk, Dv, decay, k, kv, q, o, decay_next, k_next, kn);
        for (int64_t d = 0; d < Dv; d++) store_any(out_row, t * Hv * Dv + d, o[d], bf16);
        float *swap = kv;
        kv = kn, kn = swap, decay = decay_next;
    }
}

/* Conv, SiLU and the q/k l2 norms of n tokens of one sequence: act [n, C] fp32 from mixed rows xs [n, C]; hist
   (conv_rows) has the inputs before them in its first km1 rows, and the last km1 inputs there after. */
static void conv_tokens(const char *xs, int64_t n, const float *wT, float *hist, int64_t C, int64_t km1, int bf16,
                        int64_t Hk, int64_t Dk, float *act) {
    const int64_t esz = bf16 ? 2 : 4, key_dim = Hk * Dk;
    const float scale = 1.f / sqrtf((float)Dk);
    for (int64_t t = 0; t < n; t++)
        for (int64_t c = 0; c < C; c++) hist[(km1 + t) * C + c] = load_any(xs + t * C * esz, c, bf16);
    if (bf16 && km1 == 3) conv_rows(hist, n, wT, C, 3, 1, act);  /* each form's loops compiled on their own */
    else if (km1 == 3) conv_rows(hist, n, wT, C, 3, 0, act);
    else if (bf16) conv_rows(hist, n, wT, C, km1, 1, act);
    else conv_rows(hist, n, wT, C, km1, 0, act);
    memmove(hist, hist + n * C, (size_t)(km1 * C) * sizeof(float));
    for (int64_t t = 0; t < n; t++) {
        float *a = act + t * C;
        silu_f32(a, C);
        if (bf16)
            for (int64_t c = 0; c < C; c++) a[c] = round_bf16(a[c]);
        for (int64_t h = 0; h < Hk; h++) {
            l2norm_scaled(a + h * Dk, Dk, scale);  /* q */
            l2norm_scaled(a + key_dim + h * Dk, Dk, 1.f);  /* k */
        }
    }
}

/* The conv state [C, km1] (model dtype) to the first km1 rows of hist (token-major fp32), or back. */
static void conv_state_rows(char *cs, float *hist, int64_t C, int64_t km1, int bf16, int to_state) {
    for (int64_t c = 0; c < C; c++)
        for (int64_t j = 0; j < km1; j++) {
            if (to_state) store_any(cs, c * km1 + j, hist[j * C + c], bf16);
            else hist[j * C + c] = load_any(cs, c * km1 + j, bf16);
        }
}

/* The rows of head h's recurrent state: in its block, or (a row crossing into the next block) in a copy in
   crossing, copied back by put_rows. Zeroed first where zero. */
static void get_rows(float **rows, const int64_t *table, int64_t bb, int64_t head_off, int64_t Dk, int64_t Dv,
                     float *crossing, int zero) {
    const int64_t row_bytes = Dv * (int64_t)sizeof(float);
    for (int64_t i = 0; i < Dk; i++) {
        const int64_t off = head_off + i * row_bytes;
        if (off % bb + row_bytes <= bb) {
            rows[i] = (float *)state_at(table, bb, off);
        } else {
            rows[i] = crossing + i * Dv;
            copy_state(table, bb, off, (char *)rows[i], row_bytes, 0);
        }
        if (zero) memset(rows[i], 0, (size_t)row_bytes);
    }
}

static void put_rows(float **rows, const int64_t *table, int64_t bb, int64_t head_off, int64_t Dk, int64_t Dv,
                     const float *crossing) {
    const int64_t row_bytes = Dv * (int64_t)sizeof(float);
    for (int64_t i = 0; i < Dk; i++)
        if (rows[i] == crossing + i * Dv) copy_state(table, bb, head_off + i * row_bytes, (char *)rows[i], row_bytes, 1);
}

/* B sequences, T new tokens each (rows sequence-major: decode is T = 1, a prefill chunk T > 1). mixed [B T, C]
   (C = 2·Hk·Dk + Hv·Dv: q, k, v) in the model dtype (bf16 != 0: bf16, else fp32); conv_w [C, kernel] model dtype.
   Sequence s's state is read and updated where it lies: tables[s] holds the addresses of its table_len blocks of
   block_bytes, its conv state [C, kernel-1] (model dtype) starts at byte conv_off and its recurrent state
   [Hv, Dk, Dv] (fp32) at rec_off (zeros first where fresh[s]). The conv state is small and is worked on in a copy;
   a recurrent row is updated in its block unless it crosses into the next one. g, beta [B T, Hv] fp32; value head
   h reads key head h / (Hv / Hk). out [B T, Hv, Dv] model dtype. Tokens go through in pieces of up to `piece`:
   conv and norms for the piece, then each head runs the piece's tokens while its state is hot in cache. scratch
   holds piece C + 3 Dv + Dk Dv + C kernel + (kernel-1 + piece) C floats and C (kernel-1) conv elements; rows holds Dk pointers. */
void moetide_gdn_forward(const void *mixed, int64_t B, int64_t T, int64_t piece, int64_t C, int64_t bf16,
                         const void *conv_w, int64_t kernel, const int64_t *tables, int64_t table_len, int64_t bb,
                         int64_t conv_off, int64_t rec_off, const int64_t *fresh, const float *g, const float *beta,
                         int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, void *out, float *scratch, float **rows) {
    const int64_t km1 = kernel - 1, esz = bf16 ? 2 : 4, group = Hv / Hk, key_dim = Hk * Dk;
    const int64_t conv_bytes = C * km1 * esz, row_bytes = Dv * (int64_t)sizeof(float);
    float *act = scratch, *kv = scratch + piece * C, *kn = kv + Dv, *o = kn + Dv, *crossing = o + Dv;
    float *wT = crossing + Dk * Dv, *hist = wT + C * kernel;
    char *cs = (char *)(hist + (km1 + piece) * C);
    for (int64_t c = 0; c < C; c++)
        for (int64_t j = 0; j < kernel; j++) wT[j * C + c] = load_any(conv_w, c * kernel + j, (int)bf16);
    for (int64_t s = 0; s < B; s++) {
        const int64_t *table = tables + s * table_len;
        if (fresh[s]) memset(cs, 0, (size_t)conv_bytes);
        else copy_state(table, bb, conv_off, cs, conv_bytes, 0);
        conv_state_rows(cs, hist, C, km1, (int)bf16, 0);
        for (int64_t t0 = 0; t0 < T; t0 += piece) {
            const int64_t n = T - t0 < piece ? T - t0 : piece, r0 = s * T + t0;
            conv_tokens((const char *)mixed + r0 * C * esz, n, wT, hist, C, km1, (int)bf16, Hk, Dk, act);
            const int last_piece = t0 + n == T;
            for (int64_t h = 0; h < Hv; h++) {
                const int64_t head_off = rec_off + h * Dk * row_bytes;
                get_rows(rows, table, bb, head_off, Dk, Dv, crossing, fresh[s] && t0 == 0);
                /* the next head's rows (this sequence's, or the next one's first) */
                const int64_t *ahead = h + 1 < Hv ? table : last_piece && s + 1 < B ? table + table_len : 0;
                const int64_t ahead_off = rec_off + (h + 1 < Hv ? h + 1 : 0) * Dk * row_bytes;
                char *out_row = (char *)out + (r0 * Hv + h) * Dv * esz;
                const int64_t qo = (h / group) * Dk, ko = key_dim + (h / group) * Dk, vo = 2 * key_dim + h * Dv;
                delta_rule_head(rows, n, act, C, qo, ko, vo, g + r0 * Hv + h, beta + r0 * Hv + h, Hv, Dk, Dv,
                                out_row, (int)bf16, kv, kn, o, ahead, bb, ahead_off);
                put_rows(rows, table, bb, head_off, Dk, Dv, crossing);
            }
        }
        conv_state_rows(cs, hist, C, km1, (int)bf16, 1);
        copy_state(table, bb, conv_off, cs, conv_bytes, 1);
    }
}
