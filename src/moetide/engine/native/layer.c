/* A decoder layer's two halves at decode sizes, each in one call of the kernels the engine's models otherwise call
   one by one: the attention half (input add + RMSNorm, the fused q/k/v projection, q/k norms with RoPE, the paged
   decode attention, o_proj, post-attention add + RMSNorm), in the same order, so the same bits; and the MoE half
   in fp32 (router gate, softmax + top-k, the grouped experts).
   Why: at decode sizes on the CPU each of those calls costs 10-40 us of Python and torch from caches that the
   experts' weights have just streamed through, more than some of the kernels themselves; one call pays it once. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

void moetide_linear(const void *x, int64_t T, int64_t K, int64_t bf16, const void *W, int64_t N, void *y,
                    float *scratch, int64_t *pscratch);
void moetide_rms_norm(const void *x, int64_t T, int64_t x_stride, int64_t D, int64_t bf16, float eps,
                      const void *w, int64_t zero_centered, const void *gate, int64_t gate_stride, void *residual,
                      void *out);
void moetide_rms_norm_rope(const void *x, int64_t T, int64_t x_stride, int64_t heads, int64_t D, int64_t norm,
                           float eps, const void *w1, int64_t split, const void *w2, const void *cos_t,
                           const void *sin_t, int64_t rotary, void *out, float *scratch, int64_t bf16);
void moetide_moe_route(const void *logits, int64_t T, int64_t E, int64_t ld, int64_t bf16, int64_t K, int64_t renorm,
                       float *weights, int64_t *ids);
int moetide_moe_grouped_f32(const float *x, int64_t T, int64_t K, const int64_t *ids, const float *weights,
                            const float *gate_up, int64_t gu_stride, const float *down, int64_t dn_stride,
                            int64_t E, int64_t H, int64_t I, float *out, int64_t *iscratch, float *fscratch);
int moetide_paged_decode_attention(const float *q, int64_t b, int64_t Hq, int64_t Hkv, int64_t D, void *k_base,
                                   void *v_base, int64_t num_rows, int64_t row_stride, int64_t head_stride,
                                   const int64_t *key_rows, const int64_t *lengths, int64_t L, float scale,
                                   const void *k_new, int64_t new_k_stride, const void *v_new,
                                   int64_t new_v_stride, float *out, float *lse, int64_t bf16,
                                   float *scratch);

/* 16 floats (64 bytes): every buffer carved from the scratch starts on a cache line */
static int64_t lines(int64_t floats) { return (floats + 15) / 16 * 16; }

/* The buffers of one call, in floats, in the order they are carved (moetide_attention_block_scratch is their sum). */
struct block_buffers {
    int64_t hn, qkv, q, qk, k, att, att16, o, linear, rope, attention;
};

static struct block_buffers buffers(int64_t T, int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t L) {
    const int64_t W = (Hq + 2 * Hkv) * D, A = Hq * D;
    struct block_buffers s;
    s.hn = lines(T * H);        /* the normed input, model dtype (bf16: half of it used) */
    s.qkv = lines(T * W);       /* the projection */
    s.q = lines(T * A);         /* q after norm and RoPE, fp32, contiguous [T, Hq, D] as the attention reads it */
    s.qk = lines(T * A);        /* bf16: q in bf16 before it is widened */
    s.k = lines(T * Hkv * D);   /* k after norm and RoPE */
    s.att = lines(T * A);       /* attention output, fp32 */
    s.att16 = lines(T * A);     /* bf16: it rounded to bf16, o_proj's input */
    s.o = lines(T * H);         /* o_proj's output */
    const int64_t qkv_lin = T * (H + W), o_lin = T * (A + H);
    s.linear = lines(qkv_lin > o_lin ? qkv_lin : o_lin);  /* the bf16 linears' widened rows and fp32 sums */
    s.rope = lines(2 * D);
    s.attention = lines(Hq * (L + D + 3) + 5 * Hkv * D);
    return s;
}

int64_t moetide_attention_block_scratch(int64_t T, int64_t H, int64_t Hq, int64_t Hkv, int64_t D, int64_t L) {
    const struct block_buffers s = buffers(T, H, Hq, Hkv, D, L);
    return s.hn + s.qkv + s.q + s.qk + s.k + s.att + s.att16 + s.o + s.linear + s.rope + s.attention;
}

/* T sequences, one decode token each. x [T, H] the layer input, or NULL in the first layer, where residual already
   is the input; residual [T, H] the running sum: x is added into it (rounded as torch's add), and later the
   attention output too. fp32, or bf16 throughout where bf16 != 0 (q and the attention's output fp32 between, as
   the engine's attention path widens and rounds them). in_w, post_w [H]: the plain RMSNorms' weights; qkv_w
   [(Hq + 2 Hkv) D, H] (q rows, k rows, v rows); with qk_norm, q_w and k_w [D] and qk_eps; cos_t, sin_t [T, rotary]
   (sign-folded sin). The attention reads the arena as moetide_paged_decode_attention does (k_base .. lengths, L),
   after the step's new K/V (views of the projection and of the normed k) are written into each sequence's last
   row. o_w [H, Hq D]. h_out [T, H]: the post-attention norm of the updated residual, the MLP's input. scratch:
   moetide_attention_block_scratch(T, H, Hq, Hkv, D, L) floats; pscratch T int64. Returns the attention's status
   (1, 2: a row index or length out of range, nothing written to the arena or the residual), else 0. */
int moetide_attention_block(const void *x, void *residual, int64_t T, int64_t H, int64_t bf16, const void *in_w,
                            float in_eps, const void *qkv_w, int64_t Hq, int64_t Hkv, int64_t D, int64_t qk_norm,
                            float qk_eps, const void *q_w, const void *k_w, const void *cos_t, const void *sin_t,
                            int64_t rotary, void *k_base, void *v_base, int64_t num_rows, int64_t row_stride,
                            int64_t head_stride, const int64_t *key_rows, const int64_t *lengths, int64_t L,
                            float scale, const void *o_w, const void *post_w, float post_eps, void *h_out,
                            float *scratch, int64_t *pscratch) {
    for (int64_t s = 0; s < T; s++) {  /* the attention's own checks, before the residual is touched */
        if (lengths[s] < 0 || lengths[s] > L) return 2;
        for (int64_t j = 0; j < lengths[s]; j++)
            if (key_rows[s * L + j] < 0 || key_rows[s * L + j] >= num_rows) return 1;
    }
    const struct block_buffers n = buffers(T, H, Hq, Hkv, D, L);
    const int64_t W = (Hq + 2 * Hkv) * D, A = Hq * D, esz = bf16 ? 2 : 4;
    float *hn = scratch, *qkv = hn + n.hn, *q = qkv + n.qkv, *qk = q + n.q, *k = qk + n.qk, *att = k + n.k;
    float *att16 = att + n.att, *o = att16 + n.att16, *lin = o + n.o, *rope = lin + n.linear;
    float *attn_scratch = rope + n.rope;

    if (x != 0)
        moetide_rms_norm(x, T, H, H, bf16, in_eps, in_w, 0, 0, 0, residual, hn);
    else
        moetide_rms_norm(residual, T, H, H, bf16, in_eps, in_w, 0, 0, 0, 0, hn);
    moetide_linear(hn, T, H, bf16, qkv_w, W, qkv, lin, pscratch);
    /* q heads and k heads as rms_norm_rope does them together ([T, Hq + Hkv, D] with split Hq): each row on its
       own, so two calls give the same bits. fp32 q lands where the attention reads it; bf16 q is widened there. */
    moetide_rms_norm_rope(qkv, T, W, Hq, D, qk_norm, qk_eps, q_w, Hq, q_w, cos_t, sin_t, rotary, bf16 ? qk : q,
                          rope, bf16);
    moetide_rms_norm_rope((const char *)qkv + A * esz, T, W, Hkv, D, qk_norm, qk_eps, k_w, 0, k_w, cos_t, sin_t,
                          rotary, k, rope, bf16);
    if (bf16)
        for (int64_t i = 0; i < T * A; i++) q[i] = bf16_to_f32(((const uint16_t *)qk)[i]);
    const int status = moetide_paged_decode_attention(q, T, Hq, Hkv, D, k_base, v_base, num_rows, row_stride,
                                                      head_stride, key_rows, lengths, L, scale, k, Hkv * D,
                                                      (const char *)qkv + (A + Hkv * D) * esz, W, att, 0, bf16,
                                                      attn_scratch);
    if (status) return status;
    if (bf16)
        for (int64_t i = 0; i < T * A; i++) ((uint16_t *)att16)[i] = f32_to_bf16(att[i]);
    moetide_linear(bf16 ? (const void *)att16 : (const void *)att, T, A, bf16, o_w, H, o, lin, pscratch);
    moetide_rms_norm(o, T, H, H, bf16, post_eps, post_w, 0, 0, 0, residual, h_out);
    return 0;
}

int64_t moetide_moe_block_scratch(int64_t T, int64_t H, int64_t E, int64_t K, int64_t I) {
    return lines(T * E) + T * K * (2 * I + H);
}

/* The MoE half in fp32 for T tokens: logits = x gate_w^T (gate_w [E, H]), then moetide_moe_route (top K of the
   softmax, renormalized where renorm) into weights [T, K] and ids [T, K], then moetide_moe_grouped_f32 over the
   stacked experts into out [T, H]. scratch: moetide_moe_block_scratch(T, H, E, K, I) floats; iscratch
   E + 1 + 2 T K int64 (T of them first hold the gate's row pointers). */
void moetide_moe_block(const float *x, int64_t T, int64_t H, const float *gate_w, int64_t E, int64_t K,
                       int64_t renorm, const float *gate_up, int64_t gu_stride, const float *down, int64_t dn_stride,
                       int64_t I, float *out, float *weights, int64_t *ids, float *scratch, int64_t *iscratch) {
    float *logits = scratch;
    moetide_linear(x, T, H, 0, gate_w, E, logits, 0, iscratch);
    moetide_moe_route(logits, T, E, E, 0, K, renorm, weights, ids);
    moetide_moe_grouped_f32(x, T, K, ids, weights, gate_up, gu_stride, down, dn_stride, E, H, I, out, iscratch,
                            scratch + lines(T * E));  /* the ids are the router's: always in range */
}
