/* A decoder layer's two halves at decode sizes, each in one call of the kernels the engine's models otherwise call
   one by one: the attention half (input add + RMSNorm, the fused q/k/v projection, q/k norms with RoPE, the paged
   decode attention, o_proj, post-attention add + RMSNorm), in the same order, so the same bits; and the MoE half
   in fp32 (router gate, softmax + top-k, the grouped experts); and, where every layer takes both, all the layers
   of a decode step in one call.
   Why: at decode sizes on the CPU each of those calls costs 10-40 us of Python and torch from caches that the
   experts' weights have just streamed through, more than some of the kernels themselves; one call pays it once.
   A layer's arguments come as a struct (moetide_attention_args, moetide_moe_args; mirrored by ctypes Structures
   in native/layer.py, field for field). */
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

/* A layer's attention half: its weights (model dtype), the step's RoPE tables [T, rotary] (sign-folded sin) and
   where the step's keys lie (as moetide_paged_decode_attention reads them: k_base .. lengths, L). */
struct moetide_attention_args {
    const void *in_w, *qkv_w, *q_w, *k_w, *o_w, *post_w, *cos_t, *sin_t;
    void *k_base, *v_base;
    const int64_t *key_rows, *lengths;
    int64_t Hq, Hkv, D, qk_norm, rotary, num_rows, row_stride, head_stride, L;
    float in_eps, qk_eps, scale, post_eps;
};

/* A layer's MoE half in fp32: gate_w [E, H], the top K (renormalized where renorm), the stacked experts
   (gate_up + e gu_stride [2I, H], down + e dn_stride [H, I]). */
struct moetide_moe_args {
    const float *gate_w, *gate_up, *down;
    int64_t E, K, renorm, gu_stride, dn_stride, I;
};

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

/* The attention's own checks, before anything is written: 1, 2 where a row index or a length is out of range. */
static int rows_status(const struct moetide_attention_args *a, int64_t T) {
    for (int64_t s = 0; s < T; s++) {
        if (a->lengths[s] < 0 || a->lengths[s] > a->L) return 2;
        for (int64_t j = 0; j < a->lengths[s]; j++)
            if (a->key_rows[s * a->L + j] < 0 || a->key_rows[s * a->L + j] >= a->num_rows) return 1;
    }
    return 0;
}

/* T sequences, one decode token each. x [T, H] the layer input, or NULL in the first layer, where residual already
   is the input; residual [T, H] the running sum: x is added into it (rounded as torch's add), and later the
   attention output too. fp32, or bf16 throughout where bf16 != 0 (q and the attention's output fp32 between, as
   the engine's attention path widens and rounds them). a: in_w, post_w [H], the plain RMSNorms' weights; qkv_w
   [(Hq + 2 Hkv) D, H] (q rows, k rows, v rows); with qk_norm, q_w and k_w [D] and qk_eps. The attention runs
   after the step's new K/V (views of the projection and of the normed k) are written into each sequence's last
   row. o_w [H, Hq D]. h_out [T, H]: the post-attention norm of the updated residual, the MLP's input. scratch:
   moetide_attention_block_scratch(T, H, Hq, Hkv, D, L) floats; pscratch T int64. The key rows must have passed
   rows_status; returns the attention's own status. */
static int attention_half(const struct moetide_attention_args *a, const void *x, void *residual, int64_t T,
                          int64_t H, int64_t bf16, void *h_out, float *scratch, int64_t *pscratch) {
    const int64_t Hq = a->Hq, Hkv = a->Hkv, D = a->D, L = a->L;
    const struct block_buffers n = buffers(T, H, Hq, Hkv, D, L);
    const int64_t W = (Hq + 2 * Hkv) * D, A = Hq * D, esz = bf16 ? 2 : 4;
    float *hn = scratch, *qkv = hn + n.hn, *q = qkv + n.qkv, *qk = q + n.q, *k = qk + n.qk, *att = k + n.k;
    float *att16 = att + n.att, *o = att16 + n.att16, *lin = o + n.o, *rope = lin + n.linear;
    float *attn_scratch = rope + n.rope;

    if (x != 0)
        moetide_rms_norm(x, T, H, H, bf16, a->in_eps, a->in_w, 0, 0, 0, residual, hn);
    else
        moetide_rms_norm(residual, T, H, H, bf16, a->in_eps, a->in_w, 0, 0, 0, 0, hn);
    moetide_linear(hn, T, H, bf16, a->qkv_w, W, qkv, lin, pscratch);
    /* q heads and k heads as rms_norm_rope does them together ([T, Hq + Hkv, D] with split Hq): each row on its
       own, so two calls give the same bits. fp32 q lands where the attention reads it; bf16 q is widened there. */
    moetide_rms_norm_rope(qkv, T, W, Hq, D, a->qk_norm, a->qk_eps, a->q_w, Hq, a->q_w, a->cos_t, a->sin_t, a->rotary,
                          bf16 ? qk : q, rope, bf16);
    moetide_rms_norm_rope((const char *)qkv + A * esz, T, W, Hkv, D, a->qk_norm, a->qk_eps, a->k_w, 0, a->k_w,
                          a->cos_t, a->sin_t, a->rotary, k, rope, bf16);
    if (bf16)
        for (int64_t i = 0; i < T * A; i++) q[i] = bf16_to_f32(((const uint16_t *)qk)[i]);
    const int attended = moetide_paged_decode_attention(q, T, Hq, Hkv, D, a->k_base, a->v_base, a->num_rows,
                                                      a->row_stride, a->head_stride, a->key_rows, a->lengths,
                                                      L, a->scale, k, Hkv * D,
                                                      (const char *)qkv + (A + Hkv * D) * esz, W, att, 0, bf16,
                                                      attn_scratch);
    if (attended) return attended;
    if (bf16)
        for (int64_t i = 0; i < T * A; i++) ((uint16_t *)att16)[i] = f32_to_bf16(att[i]);
    moetide_linear(bf16 ? (const void *)att16 : (const void *)att, T, A, bf16, a->o_w, H, o, lin, pscratch);
    moetide_rms_norm(o, T, H, H, bf16, a->post_eps, a->post_w, 0, 0, 0, residual, h_out);
    return 0;
}

/* attention_half after rows_status: a status other than 0 (a row index or a length out of range) means nothing
   was written to the arena or the residual. */
int moetide_attention_block(const struct moetide_attention_args *a, const void *x, void *residual, int64_t T,
                            int64_t H, int64_t bf16, void *h_out, float *scratch, int64_t *pscratch) {
    const int status = rows_status(a, T);
    return status ? status : attention_half(a, x, residual, T, H, bf16, h_out, scratch, pscratch);
}

int64_t moetide_moe_block_scratch(int64_t T, int64_t H, int64_t E, int64_t K, int64_t I) {
    return lines(T * E) + T * K * (2 * I + H);
}

/* The MoE half in fp32 for T tokens: logits = x gate_w^T, then moetide_moe_route into weights [T, K] and ids
   [T, K], then moetide_moe_grouped_f32 over the stacked experts into out [T, H]. scratch:
   moetide_moe_block_scratch(T, H, E, K, I) floats; iscratch E + 1 + 2 T K int64 (T of them first hold the gate's
   row pointers). */
void moetide_moe_block(const struct moetide_moe_args *m, const float *x, int64_t T, int64_t H, float *out,
                       float *weights, int64_t *ids, float *scratch, int64_t *iscratch) {
    float *logits = scratch;
    moetide_linear(x, T, H, 0, m->gate_w, m->E, logits, 0, iscratch);
    moetide_moe_route(logits, T, m->E, m->E, 0, m->K, m->renorm, weights, ids);
    moetide_moe_grouped_f32(x, T, m->K, ids, weights, m->gate_up, m->gu_stride, m->down, m->dn_stride, m->E, H,
                            m->I, out, iscratch, scratch + lines(T * m->E));  /* the router's ids: in range */
}

/* n decoder layers of a pure decode step in fp32, each the attention half then moetide_moe_block: x [T, H]
   the first layer's input, or NULL where residual already is (as there); layer l + 1 reads layer l's MoE output.
   h [T, H] the attention halves' outputs; out [T, H] the last layer's MoE output; weights, ids: each layer's
   [T, K_l] routing, layer after layer. scratch, iscratch: the largest layer's. Every layer's key rows are checked
   before any layer runs: a status other than 0 (rows_status) means nothing was written. */
int moetide_decode_layers(int64_t n, const struct moetide_attention_args *attn, const struct moetide_moe_args *moe,
                          const float *x, float *residual, int64_t T, int64_t H, float *h, float *out,
                          float *weights, int64_t *ids, float *scratch, int64_t *iscratch, int64_t *pscratch) {
    for (int64_t l = 0; l < n; l++) {
        const int status = rows_status(&attn[l], T);
        if (status) return status;
    }
    for (int64_t l = 0; l < n; l++) {
        attention_half(&attn[l], l == 0 ? x : out, residual, T, H, 0, h, scratch, pscratch);  /* rows checked */
        moetide_moe_block(&moe[l], h, T, H, out, weights, ids, scratch, iscratch);
        weights += T * moe[l].K, ids += T * moe[l].K;
    }
    return 0;
}
