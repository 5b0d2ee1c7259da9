/* moetide's native Gated DeltaNet decode step (Qwen3-Next's linear attention, one new token per sequence) and the
   model-dtype RMSNorm forms around it, called through ctypes (engine/native/__init__.py).

   Why: at decode the layer's torch path is a few dozen small ops per step — a depthwise conv1d over a stacked
   window (in bf16 alone a third of a Qwen3-Next step on the CPU), l2 norms, the recurrent delta rule over
   [Hv, Dk, Dv] states gathered into one tensor and copied back. Here each sequence's state is updated where it
   lies in its pool blocks (no gather, no scatter), in two passes over the recurrent state per head.

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

/* One sequence's causal conv over [state, x] before the SiLU: act[c] = sum_j w[c][j] state[c][j] + w[c][km1] x[c],
   rounded to the dtype, and the state [C, km1] shifted left by x. w [C, km1 + 1] fp32 (the weights widened
   once per call); bf16 and, at a call with a constant, km1 are constants, so each form is compiled on its own. */
static inline __attribute__((always_inline)) void conv_step(const void *xs, const float *w, void *cs, int64_t C,
                                                            const int64_t km1, const int bf16, float *act) {
    for (int64_t c = 0; c < C; c++) {
        const float x = load_any(xs, c, bf16);
        float acc = 0.f;
        for (int64_t j = 0; j < km1; j++) acc += w[c * (km1 + 1) + j] * load_any(cs, c * km1 + j, bf16);
        act[c] = to_dtype(acc + w[c * (km1 + 1) + km1] * x, bf16);
        for (int64_t j = 0; j + 1 < km1; j++) store_any(cs, c * km1 + j, load_any(cs, c * km1 + j + 1, bf16), bf16);
        if (km1 > 0) store_any(cs, c * km1 + km1 - 1, x, bf16);
    }
}

/* B sequences, one token each. mixed [B, C] (C = 2·Hk·Dk + Hv·Dv: q, k, v) in the model dtype (bf16 != 0: bf16,
   else fp32); conv_w [C, kernel] model dtype. Sequence s's state is read and updated where it lies: tables[s] holds
   the addresses of its table_len blocks of block_bytes, its conv state [C, kernel-1] (model dtype) starts at byte
   conv_off and its recurrent state [Hv, Dk, Dv] (fp32) at rec_off (zeros first where fresh[s]). The conv state is
   small and is worked on in a copy; a recurrent row is updated in its block unless it crosses into the next one.
   g, beta [B, Hv] fp32; value head h reads key head h / (Hv / Hk). out [B, Hv, Dv] model dtype. scratch holds
   C + 2 Dv + Dk Dv + C kernel floats and C (kernel-1) conv elements; rows holds Dk pointers. */
void moetide_gdn_decode(const void *mixed, int64_t B, int64_t C, int64_t bf16, const void *conv_w, int64_t kernel,
                        const int64_t *tables, int64_t table_len, int64_t bb, int64_t conv_off, int64_t rec_off,
                        const int64_t *fresh, const float *g, const float *beta, int64_t Hk, int64_t Hv, int64_t Dk,
                        int64_t Dv, void *out, float *scratch, float **rows) {
    const int64_t km1 = kernel - 1, esz = bf16 ? 2 : 4, group = Hv / Hk, key_dim = Hk * Dk;
    const int64_t conv_bytes = C * km1 * esz, row_bytes = Dv * (int64_t)sizeof(float);
    float *act = scratch, *kv = scratch + C, *o = kv + Dv, *crossing = o + Dv, *wf = crossing + Dk * Dv;
    char *cs = (char *)(wf + C * kernel);
    for (int64_t i = 0; i < C * kernel; i++) wf[i] = load_any(conv_w, i, (int)bf16);
    for (int64_t s = 0; s < B; s++) {
        const int64_t *table = tables + s * table_len;
        if (fresh[s]) memset(cs, 0, (size_t)conv_bytes);
        else copy_state(table, bb, conv_off, cs, conv_bytes, 0);
        const char *xs = (const char *)mixed + s * C * esz;
        if (bf16 && km1 == 3) conv_step(xs, wf, cs, C, 3, 1, act);  /* each form's loops compiled on their own */
        else if (km1 == 3) conv_step(xs, wf, cs, C, 3, 0, act);
        else if (bf16) conv_step(xs, wf, cs, C, km1, 1, act);
        else conv_step(xs, wf, cs, C, km1, 0, act);
        silu_f32(act, C);
        if (bf16)
            for (int64_t c = 0; c < C; c++) act[c] = round_bf16(act[c]);
        copy_state(table, bb, conv_off, cs, conv_bytes, 1);
        const float scale = 1.f / sqrtf((float)Dk);
        for (int64_t h = 0; h < Hk; h++) {
            l2norm_scaled(act + h * Dk, Dk, scale);  /* q */
            l2norm_scaled(act + key_dim + h * Dk, Dk, 1.f);  /* k */
        }
        for (int64_t h = 0; h < Hv; h++) {
            const float *q = act + (h / group) * Dk, *k = act + key_dim + (h / group) * Dk;
            const float *v = act + 2 * key_dim + h * Dv;
            const float decay = expf(g[s * Hv + h]), b = beta[s * Hv + h];
            for (int64_t i = 0; i < Dk; i++) {
                const int64_t off = rec_off + (h * Dk + i) * row_bytes;
                if (off % bb + row_bytes <= bb) {
                    rows[i] = (float *)state_at(table, bb, off);
                } else {
                    rows[i] = crossing + i * Dv;
                    copy_state(table, bb, off, (char *)rows[i], row_bytes, 0);
                }
                if (fresh[s]) memset(rows[i], 0, (size_t)row_bytes);
            }
            for (int64_t d = 0; d < Dv; d++) kv[d] = 0.f;
            for (int64_t i = 0; i < Dk; i++) {  /* pass 1: kv = (decay S)^T k, S not yet written */
                const float ki = k[i], *row = rows[i];
                for (int64_t d = 0; d < Dv; d++) kv[d] += (row[d] * decay) * ki;
            }
            for (int64_t d = 0; d < Dv; d++) kv[d] = (v[d] - kv[d]) * b;  /* delta */
            for (int64_t d = 0; d < Dv; d++) o[d] = 0.f;
            /* the next head's state (this sequence's or the next one's first) streams into L2 during pass 2, so
               its pass 1 does not wait on memory (without it the two passes took turns with the DRAM reads) */
            const int64_t *next_table = h + 1 < Hv ? table : s + 1 < B ? table + table_len : 0;
            const int64_t next_head = h + 1 < Hv ? h + 1 : 0;
            for (int64_t i = 0; i < Dk; i++) {  /* pass 2: S = decay S + k delta^T; out = S^T q */
                if (next_table != 0) {
                    const char *ahead = state_at(next_table, bb, rec_off + (next_head * Dk + i) * row_bytes);
                    for (int64_t line = 0; line < row_bytes; line += 64) __builtin_prefetch(ahead + line, 0, 2);
                }
                const float ki = k[i], qi = q[i];
                float *row = rows[i];
                for (int64_t d = 0; d < Dv; d++) {
                    const float updated = row[d] * decay + ki * kv[d];
                    row[d] = updated;
                    o[d] += updated * qi;
                }
            }
            for (int64_t i = 0; i < Dk; i++) {
                if (rows[i] == crossing + i * Dv)
                    copy_state(table, bb, rec_off + (h * Dk + i) * row_bytes, (char *)rows[i], row_bytes, 1);
            }
            for (int64_t d = 0; d < Dv; d++) store_any(out, (s * Hv + h) * Dv + d, o[d], (int)bf16);
        }
    }
}
