"""Roofline step time: how long one engine step of a given shape takes on one GPU of a tensor-parallel group.

These are MODELED times from first principles (bytes moved and FLOPs done, each against a derated datasheet
rate), not measurements. Calibration replaces the efficiency factors with measured ones.

A step's shape (``StepShape``) is what the scheduler decided, in five integers:
T = num_tokens, S = num_seqs, kv_tokens_read (KV = sum_i c_i + n_i), attention_pairs (P = sum_i n_i (c_i + (n_i+1)/2)),
where sequence i computes n_i new tokens after c_i cached ones. The step time is a sum of terms; each term is one
kernel (or one group of identical kernels) and is its own roofline:

    term = max(FLOPs / (peak x eff_compute), bytes / (bandwidth x eff_memory))

Within a term compute and memory overlap (max); the terms of a layer run one after another on one stream, and
layers run one after another, so terms and layers *sum*. Because the layers of one kind are identical, summing
per-layer maxima equals one max over the layer totals, which is what the code evaluates. Per GPU, with tp-way
tensor parallelism (``perf.budget`` says what is split and what replicated), eff = ``Efficiency``:

  dense      max(2 T W_layers / (F e_mm),  B_layers / (M e_hbm))
             W_layers, B_layers: params and bytes of everything per layer except routed experts (attention and
             linear-attention projections, norms, routers, shared experts, dense MLPs), read once per step.
  experts    L_moe x max(2 T k W_e / (F e_mm),  D(T) B_e / (M e_hbm))
             W_e, B_e: one expert's params and bytes on this GPU (1/tp of it); D(T) = distinct experts a layer's
             T tokens touch. Uniform routing, each token picking k of E: D(T) = E (1 - (1 - k/E)^T) (exact in
             expectation: an expert is missed by one token with probability 1 - k/E). With per-layer routing
             probabilities p_e (sum_e p_e = k): D_l(T) = sum_e 1 - (1 - p_e)^T, and the term sums the per-layer maxima.
             D(1) = k; D(T) -> E as T grows. The grouped GEMM reaches e_moe m / (m + h) of peak at m = T k / D
             tokens per active expert (``moe_matmul``, ``moe_half_tokens``), so its compute is 2 W_e (T k + h D)
             / (F e_moe): each active expert costs h tokens more, as a kernel that tiles every expert's rows to a
             block of M rows pays for the padding. With 1-byte weights e_moe is ``moe_matmul_fp8``, still against
             the BF16 peak F.
  attention  max(P x L_full x 4 H d / (F e_att),  KV x b_kv / (M e_kv))           full-attention layers only
             H = query heads on this GPU, d = head_dim: QK^T and PV are 2 d FLOPs each per head and pair. MLA in
             the absorbed form (scores against the latent, W_UK folded into the query, W_UV applied after): 2 (r +
             r_rope) + 2 r FLOPs per head and pair, r = kv_lora_rank; its projections are in ``dense``.
             b_kv = KV bytes per token over full-attention layers on this GPU (MLA: latent + rope key, whole);
             e_kv = ``attention_memory`` (``hbm`` unless a device file sets it).
  linear     L_lin x max(T x f_lin / (F e_att),  2 S x b_state / (M e_hbm))      Gated DeltaNet layers
             The fixed state (conv + recurrent, b_state per layer and sequence) is read and written once per
             sequence per step; f_lin = (6 Hv dk dv + 2 conv_dim K) / tp per token (recurrent form: S^T k,
             the rank-1 update and S^T q are 2 dk dv each per value head; the depthwise conv 2 K per channel).
  lm_head    max(2 S V h / tp / (F e_mm),  B_lm / (M e_hbm))
             Logits for the sampled positions only: one row per sequence (S), not per token (vLLM's
             logits_indices), the head read once per step. The embedding lookup is a gather of T rows: left out.
  allreduce  2 L x allreduce(T h b)                                                 only when tp > 1
             Two all-reduces per layer (after attention, after the MLP) of a message of T x hidden activations
             (b = dtype bytes), by the algorithm vLLM picks for its size: up to ``custom_allreduce_max_bytes``
             vLLM's custom all-reduce, one-shot (every GPU reads each peer's whole message: (tp-1) S bytes) at
             tp = 2 or below 512 KiB (tp <= 4) / 256 KiB (tp 8), else two-shot (2 (tp-1)/tp S), plus
             ``allreduce_latency_s``; above it NCCL's ring, 2 (tp-1)/tp S, plus ``nccl_latency_s``; each over the
             GPU link N at ``allreduce``. The embedding's all-reduce and the logits gather are left out.
  floors     L_moe x moe_layer_s + L_full x attention_layer_s + L_lin x linear_layer_s: the kernels of a layer
             that no byte or FLOP term carries (norms, rotary, cache writes, router top-k, the MoE sort and
             reduction, launch gaps), a fixed time per layer of each kind.
  overhead   a fixed per-step time (host-side scheduling, input preparation, sampling) that no roofline term
             explains, plus a time per sequence in the batch (an engine's per-request bookkeeping).

The new-term defaults are neutral (zero floors, ring all-reduce, ``moe_matmul`` = ``matmul``), which is the plain
roofline; ``perf.engines`` holds each engine's fitted profile (docs/perf.md, "Against published measurements").

F = matmul_flops_per_s, M = hbm_bandwidth_bytes_per_s, N = gpu_link_bandwidth_bytes_per_s (``HardwareSpec``).
``num_decode_seqs`` is part of the shape for callers that key on it; no term depends on it yet.

``step_time_s`` is the hot path (the simulator calls it ~10^5-10^6 times): positional ints, every per-model
constant folded in ``__init__``, no allocation. ``breakdown`` evaluates the same formula term by term, for
``moetide perf`` and the tests; the two agree to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from moetide.perf.budget import (
    check_tp,
    kv_bytes_per_token_per_gpu,
    state_bytes_per_seq_per_gpu,
    weights_per_gpu,
)
from moetide.perf.efficiency import Efficiency
from moetide.specs import HardwareSpec, ModelSpec
from moetide.units import cdiv

FLOPS_PER_STATE_ELEMENT = 6  # Gated DeltaNet, recurrent form: S^T k, rank-1 update, S^T q (2 FLOPs each)


@dataclass(frozen=True, slots=True)
class StepShape:
    num_tokens: int  # tokens computed in this step, all sequences (T)
    num_seqs: int  # sequences in the batch (S)
    num_decode_seqs: int  # sequences computing exactly 1 token
    kv_tokens_read: int  # sum over sequences of (context before the step + new tokens)
    attention_pairs: int  # sum over sequences of n (c + (n + 1) / 2): causal query-key pairs

    @classmethod
    def decode(cls, num_seqs: int, context_tokens: int) -> StepShape:
        """num_seqs sequences with context_tokens cached each, computing one token each."""
        return cls(num_seqs, num_seqs, num_seqs, num_seqs * (context_tokens + 1), num_seqs * (context_tokens + 1))

    @classmethod
    def prefill(cls, num_tokens: int, context_tokens: int = 0) -> StepShape:
        """One sequence computing num_tokens new tokens after context_tokens cached ones."""
        pairs = num_tokens * context_tokens + num_tokens * (num_tokens + 1) // 2
        return cls(num_tokens, 1, 1 if num_tokens == 1 else 0, context_tokens + num_tokens, pairs)

    @classmethod
    def of_step(cls, chunks: Iterable[tuple[int, int]]) -> StepShape:
        """A step of sequences each given as (tokens computed before the step, tokens computed in it), as an
        engine's scheduler output lists them (moetide's engine and vLLM's are timed against this)."""
        num_tokens = num_seqs = num_decode = kv_read = pairs = 0
        for computed, n in chunks:
            num_tokens += n
            num_seqs += 1
            num_decode += n == 1
            kv_read += computed + n
            pairs += n * computed + n * (n + 1) // 2
        return cls(num_tokens, num_seqs, num_decode, kv_read, pairs)

    def as_args(self) -> tuple[int, int, int, int, int]:
        return (self.num_tokens, self.num_seqs, self.num_decode_seqs, self.kv_tokens_read, self.attention_pairs)


def expected_distinct_experts(num_tokens: int, num_experts: int, top_k: int) -> float:
    """E (1 - (1 - k/E)^T): distinct experts T tokens touch under uniform top-k routing."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def expected_distinct_experts_from_probs(num_tokens: int, probs: Sequence[float]) -> float:
    """sum_e 1 - (1 - p_e)^T, p_e = probability that one token routes to expert e (sum_e p_e = top_k)."""
    return sum(1.0 - (1.0 - p) ** num_tokens for p in probs)


def _check_routing_probs(model: ModelSpec, routing_probs: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    if len(routing_probs) != model.num_moe_layers:
        raise ValueError(f"routing_probs needs one vector per MoE layer ({model.num_moe_layers}), "
                         f"got {len(routing_probs)}")
    checked = []
    for layer, probs in enumerate(routing_probs):
        probs = tuple(float(p) for p in probs)
        if len(probs) != model.num_experts or any(not 0.0 <= p <= 1.0 for p in probs):
            raise ValueError(f"routing_probs[{layer}] must hold {model.num_experts} probabilities in [0, 1]")
        if not math.isclose(sum(probs), model.num_experts_per_tok, rel_tol=1e-3):
            raise ValueError(f"routing_probs[{layer}] sums to {sum(probs):.6g}; per-token routing "
                             f"probabilities sum to top_k ({model.num_experts_per_tok})")
        checked.append(probs)
    return tuple(checked)


def allreduce_s(gpu: HardwareSpec, tp: int, efficiency: Efficiency, message_bytes: float) -> float:
    """One all-reduce of ``message_bytes`` over a tp-way group, by the algorithm vLLM picks for its size (module
    docstring); 0 at tp = 1."""
    e = efficiency
    if tp == 1:
        return 0.0
    link = gpu.gpu_link_bandwidth_bytes_per_s * e.allreduce
    if message_bytes <= e.custom_allreduce_max_bytes:
        one_shot = tp == 2 or message_bytes < (512 if tp <= 4 else 256) * 1024
        moved = (tp - 1) * message_bytes if one_shot else 2 * (tp - 1) / tp * message_bytes
        return e.allreduce_latency_s + moved / link
    latency = e.allreduce_latency_s if e.nccl_latency_s is None else e.nccl_latency_s
    return latency + 2 * (tp - 1) / tp * message_bytes / link


def _roofline(flops: float, num_bytes: float, flops_rate: float, bytes_rate: float) -> tuple[float, float, float]:
    compute_s, memory_s = flops / flops_rate, num_bytes / bytes_rate
    return compute_s, memory_s, max(compute_s, memory_s)


class StepTimeModel:
    """Modeled time of one engine step on one GPU of a tp-way group (formula: module docstring)."""

    __slots__ = ("model", "gpu", "tp", "dtype_bytes", "kv_dtype_bytes", "efficiency", "weights", "_rates",
                 "_per_token_flops", "_per_step_bytes", "_dense_c", "_dense_m", "_expert_c", "_expert_m",
                 "_num_experts", "_miss", "_layer_probs", "_memo", "_attn_c", "_attn_m", "_lin_c", "_lin_m",
                 "_lm_c", "_lm_m", "_pad", "_ar_memo", "_fixed_s", "_seq_s")

    def __init__(self, model: ModelSpec, gpu: HardwareSpec, *, tp: int = 1, dtype_bytes: int = 2,
                 kv_dtype_bytes: int = 2, state_dtype_bytes: int | None = None,
                 efficiency: Efficiency = Efficiency(),
                 routing_probs: Sequence[Sequence[float]] | None = None) -> None:
        check_tp(model, tp)
        self.model, self.gpu, self.tp, self.efficiency = model, gpu, tp, efficiency
        self.dtype_bytes, self.kv_dtype_bytes = dtype_bytes, kv_dtype_bytes
        self.weights = weights_per_gpu(model, tp=tp, dtype_bytes=dtype_bytes)
        self._layer_probs = None if routing_probs is None else _check_routing_probs(model, routing_probs)
        self._memo: dict[int, float] = {}
        self._ar_memo: dict[int, float] = {}
        self._fold_constants(state_dtype_bytes or dtype_bytes)

    def _fold_constants(self, state_dtype_bytes: int) -> None:
        m, w, e, tp = self.model, self.weights, self.efficiency, self.tp
        mm = self.gpu.matmul_flops_per_s * e.matmul
        moe_eff = e.matmul if e.moe_matmul is None else e.moe_matmul
        if self.dtype_bytes == 1 and e.moe_matmul_fp8 is not None:
            moe_eff = e.moe_matmul_fp8
        moe = self.gpu.matmul_flops_per_s * moe_eff
        att = self.gpu.matmul_flops_per_s * e.attention
        mem = self.gpu.hbm_bandwidth_bytes_per_s * e.hbm
        kv_mem = mem if e.attention_memory is None else self.gpu.hbm_bandwidth_bytes_per_s * e.attention_memory
        self._rates = {"matmul": mm, "moe_matmul": moe, "attention": att, "hbm": mem, "kv_read": kv_mem}
        num_moe, num_lin = m.num_moe_layers, len(m.linear_attention_layer_ids)
        # per-token FLOPs (per pair for attention, per row for lm_head) and per-step bytes of each term, this GPU
        self._per_token_flops = {
            "dense": 2 * w.layer_bytes / w.dtype_bytes,
            "expert": 2 * m.num_experts_per_tok * w.expert_shard_bytes / w.dtype_bytes,  # one MoE layer
            "attention": len(m.full_attention_layer_ids) * (m.num_attention_heads // tp) * self._pair_flops_per_head(),
            "linear": num_lin * self._linear_flops_per_token() / tp,
            "lm_head": 2 * cdiv(m.vocab_size, tp) * m.hidden_size,
        }
        self._per_step_bytes = {
            "dense": w.layer_bytes, "expert": w.expert_shard_bytes, "lm_head": w.lm_head_read_bytes,
            "kv_per_token": kv_bytes_per_token_per_gpu(m, tp=tp, kv_dtype_bytes=self.kv_dtype_bytes),
            "state_per_seq": 2 * state_bytes_per_seq_per_gpu(m, tp=tp, state_dtype_bytes=state_dtype_bytes),
        }
        f, b = self._per_token_flops, self._per_step_bytes
        self._dense_c, self._dense_m = f["dense"] / mm, b["dense"] / mem
        self._expert_c, self._expert_m = num_moe * f["expert"] / moe, num_moe * b["expert"] / mem
        self._num_experts, self._miss = float(m.num_experts), 1.0 - m.num_experts_per_tok / m.num_experts
        self._pad = e.moe_half_tokens / m.num_experts_per_tok  # padding, in tokens, per active expert and top-k
        self._attn_c, self._attn_m = f["attention"] / att, b["kv_per_token"] / kv_mem
        self._lin_c, self._lin_m = f["linear"] / att, b["state_per_seq"] / mem
        self._lm_c, self._lm_m = f["lm_head"] / mm, b["lm_head"] / mem
        self._fixed_s = e.step_overhead_s + self.layer_floors_s()
        self._seq_s = e.seq_overhead_s

    def layer_floors_s(self) -> float:
        """The fixed kernel time of one step's layers: per MoE, full-attention and linear-attention layer."""
        m, e = self.model, self.efficiency
        return (m.num_moe_layers * e.moe_layer_s + len(m.full_attention_layer_ids) * e.attention_layer_s
                + len(m.linear_attention_layer_ids) * e.linear_layer_s)

    def _step_allreduce_s(self, num_tokens: int) -> float:
        """The step's two all-reduces per layer of T hidden vectors each, memoized by T."""
        cached = self._ar_memo.get(num_tokens)
        if cached is None:
            m = self.model
            cached = 2 * m.num_layers * allreduce_s(self.gpu, self.tp, self.efficiency,
                                                    num_tokens * m.hidden_size * self.dtype_bytes)
            self._ar_memo[num_tokens] = cached
        return cached

    def request_overhead_s(self, num_prompt_tokens: int) -> float:
        """Device seconds one arriving request costs besides its steps (``Efficiency``)."""
        e = self.efficiency
        return e.request_overhead_s + num_prompt_tokens * e.request_overhead_s_per_token

    def _pair_flops_per_head(self) -> int:
        mla = self.model.mla
        if mla is not None:  # absorbed: scores over latent + rope key, values over the latent
            return 2 * (mla.kv_lora_rank + mla.qk_rope_head_dim) + 2 * mla.kv_lora_rank
        return 4 * self.model.head_dim

    def _linear_flops_per_token(self) -> int:
        la = self.model.linear_attention
        if la is None:
            return 0
        state = FLOPS_PER_STATE_ELEMENT * la.num_value_heads * la.key_head_dim * la.value_head_dim
        return state + 2 * la.conv_dim * la.conv_kernel_size

    # ---- hot path -------------------------------------------------------------------------------------------

    def step_time_s(self, num_tokens: int, num_seqs: int, num_decode_seqs: int, kv_tokens_read: int,
                    attention_pairs: int) -> float:
        """Modeled seconds of one step; 0.0 for a step with no tokens."""
        if num_tokens <= 0:
            return 0.0
        t = self._fixed_s + num_seqs * self._seq_s
        if self.tp > 1:
            t += self._step_allreduce_s(num_tokens)
        c, m = num_tokens * self._dense_c, self._dense_m
        t += c if c > m else m
        if self._layer_probs is None:
            distinct = self._num_experts * (1.0 - self._miss ** num_tokens)
            c = (num_tokens + self._pad * distinct) * self._expert_c
            m = distinct * self._expert_m
            t += c if c > m else m
        else:
            t += self._expert_s_from_probs(num_tokens)
        c, m = attention_pairs * self._attn_c, kv_tokens_read * self._attn_m
        t += c if c > m else m
        c, m = num_tokens * self._lin_c, num_seqs * self._lin_m
        t += c if c > m else m
        c, m = num_seqs * self._lm_c, self._lm_m
        return t + (c if c > m else m)

    def _expert_s_from_probs(self, num_tokens: int) -> float:
        """Sum over MoE layers of each layer's roofline, memoized by T (a step's T is at most the token budget)."""
        cached = self._memo.get(num_tokens)
        if cached is None:
            assert self._layer_probs is not None
            cached = sum(self._expert_layer_s(num_tokens, expected_distinct_experts_from_probs(num_tokens, probs))
                         for probs in self._layer_probs)
            self._memo[num_tokens] = cached
        return cached

    def _expert_layer_s(self, num_tokens: int, distinct: float) -> float:
        """One MoE layer's routed-expert roofline when its T tokens touch ``distinct`` experts (the padded grouped
        GEMM against the distinct experts' bytes); ``step_time_s`` inlines the same for uniform routing."""
        num_moe = self.model.num_moe_layers
        c = (num_tokens + self._pad * distinct) * self._expert_c / num_moe
        m = distinct * self._expert_m / num_moe
        return c if c > m else m

    # ---- explanation --------------------------------------------------------------------------------------

    def moe_layer_terms(self, num_tokens: int) -> dict[str, float]:
        """One MoE layer under uniform routing: its routed experts' roofline and its fixed time, in seconds (what
        vLLM's ``benchmark_moe.py`` times as one fused-MoE call)."""
        distinct = self._num_experts * (1.0 - self._miss ** num_tokens)
        return {"experts_s": self._expert_layer_s(num_tokens, distinct), "moe_layer_s": self.efficiency.moe_layer_s}

    def distinct_experts_per_layer(self, num_tokens: int) -> list[float]:
        m = self.model
        if self._layer_probs is None:
            return [expected_distinct_experts(num_tokens, m.num_experts, m.num_experts_per_tok)] * m.num_moe_layers
        return [expected_distinct_experts_from_probs(num_tokens, p) for p in self._layer_probs]

    def breakdown(self, shape: StepShape) -> dict[str, float]:
        """Every term's FLOPs, bytes, compute and memory seconds and roofline seconds; ``total_s`` equals
        ``step_time_s`` of the same shape. FLOPs and bytes are per GPU."""
        T, S = shape.num_tokens, shape.num_seqs
        if T <= 0:
            return {"total_s": 0.0}
        f, b, r = self._per_token_flops, self._per_step_bytes, self._rates
        distinct = self.distinct_experts_per_layer(T)
        out: dict[str, float] = {"distinct_experts_per_layer": sum(distinct) / len(distinct)}
        terms = {
            "dense": (T * f["dense"], b["dense"], r["matmul"]),
            "attention": (shape.attention_pairs * f["attention"], shape.kv_tokens_read * b["kv_per_token"],
                          r["attention"]),
            "linear_attention": (T * f["linear"], S * b["state_per_seq"], r["attention"]),
            "lm_head": (S * f["lm_head"], b["lm_head"], r["matmul"]),
        }
        for name, (flops, num_bytes, rate) in terms.items():
            memory_rate = r["kv_read"] if name == "attention" else r["hbm"]
            self._put_term(out, name, flops, num_bytes, *_roofline(flops, num_bytes, rate, memory_rate))
        layers = [_roofline((T + self._pad * d) * f["expert"], d * b["expert"], r["moe_matmul"], r["hbm"])
                  for d in distinct]
        self._put_term(out, "experts", sum((T + self._pad * d) * f["expert"] for d in distinct),
                       sum(distinct) * b["expert"], sum(x[0] for x in layers), sum(x[1] for x in layers),
                       sum(x[2] for x in layers))
        m, e = self.model, self.efficiency
        out["allreduce_bytes"] = 2 * m.num_layers * T * m.hidden_size * self.dtype_bytes if self.tp > 1 else 0.0
        out["allreduce_s"] = self._step_allreduce_s(T) if self.tp > 1 else 0.0
        out["floors_s"] = self.layer_floors_s()
        out["overhead_s"] = e.step_overhead_s + S * e.seq_overhead_s
        out["total_s"] = sum(out[f"{n}_s"] for n in (*terms, "experts", "allreduce", "floors", "overhead"))
        return out

    @staticmethod
    def _put_term(out: dict[str, float], name: str, flops: float, num_bytes: float, compute_s: float,
                  memory_s: float, term_s: float) -> None:
        out[f"{name}_flops"], out[f"{name}_bytes"] = float(flops), float(num_bytes)
        out[f"{name}_compute_s"], out[f"{name}_memory_s"], out[f"{name}_s"] = compute_s, memory_s, term_s
