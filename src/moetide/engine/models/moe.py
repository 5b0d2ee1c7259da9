"""The feed-forward blocks: SwiGLU MLP, and the sparse MoE block with its ways of running the routed experts.

Routing is transformers 5.19's (see ``SparseMoE``). What differs from transformers is how the selected experts
run. The torch paths compute, for every (token, rank) pair, ``down(silu(gate) * up) * weight`` and add the pairs of a
token into its output in ascending expert order — the order transformers' loop adds them — so they give the same
bits (tested):

* **grouped** (``grouped_experts``): sort the step's T·K (token, rank) pairs by expert, gather their inputs once,
  and run every expert's GEMM in one ``torch._grouped_mm`` call per projection over the stacked ``[E, ...]``
  weights, with per-expert row offsets (an expert no token chose is an empty group: its weights are not read).
  A fixed number of torch ops per layer, no host read-back. Needs the provider's ``stacked_weights``: views of all
  E experts of the layer (the arena's strided expert views, or the module's parameters), which exist only while
  every routed expert is resident. Used on the CPU, where ``_grouped_mm`` runs any dtype (in 16-bit ones, strides
  of whole 16 bytes: ``grouped_mm_takes``); on CUDA it needs bf16
  and 16-byte-aligned shapes and has not been run here, so CUDA takes the loop for now.
* **native** (``engine.native.moe_experts``): one C call on the CPU in fp32 or bf16, straight from the stacked
  views: the pairs grouped by expert, each expert's weights read once for all its tokens (at real expert sizes the
  step is that traffic), a token's experts added in the same ascending order. Equal to the others to fp32
  round-off (bf16: to one rounding of a sum), not bit for bit (its dot products sum in another order), and
  independent of the step's other tokens. It yields to the grouped path past ``NATIVE_PAIRS_PER_EXPERT`` pairs
  per expert (a prefill), where torch's GEMMs are faster. Where the native
  kernels cannot be built, the torch paths run.
* **loop** (``looped_experts``): one Python iteration per selected expert, fetching each expert's weights from
  the provider (``expert_weights``): the path that serves staged (offloaded) experts, and the reference.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moetide.engine import native
from moetide.engine.models.hooks import ExpertProvider, ExpertWeights
from moetide.engine.models.ops import linear


class MLP(nn.Module):
    """SwiGLU feed-forward (dense layers and Qwen3-Next's shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor, experts: ExpertProvider | None = None) -> Tensor:
        gate, up = linear(x, self.gate_proj.weight), linear(x, self.up_proj.weight)
        return linear(F.silu(gate) * up, self.down_proj.weight)


class Experts(nn.Module):
    """The routed experts' weights, stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here (probed once per device type and dtype; CPU only, see above). The
    probe's rows are 16 bytes in every dtype: in 16-bit dtypes torch refuses strides that are not multiples of 16
    bytes (``grouped_mm_takes``)."""
    if device_type != "cpu" or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a, b = torch.ones(3, 8, dtype=dtype), torch.ones(2, 8, 8, dtype=dtype).transpose(1, 2)
        out = torch._grouped_mm(a, b, offs=torch.tensor([1, 3], dtype=torch.int32))
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return tuple(out.shape) == (3, 8) and bool((out == 8).all())


def grouped_mm_takes(x: Tensor, gate_up: Tensor, down: Tensor) -> bool:
    """Whether ``grouped_experts`` can run these tensors: ``_grouped_mm`` runs here in their dtype, and in a 16-bit
    dtype every stride and row it is handed (x's rows, the weights' strides, the [P, I] activations) is a
    multiple of 16 bytes."""
    if not grouped_mm_supported(x.device.type, x.dtype):
        return False
    if x.element_size() >= 4:
        return True
    width = down.shape[2]
    strides = (*gate_up.stride(), *down.stride(), x.shape[1], width, 2 * width)
    return all(s == 1 or s * x.element_size() % 16 == 0 for s in strides)


@functools.cache
def _expert_range(num_experts: int, device: torch.device) -> Tensor:
    with torch.inference_mode(False):  # a normal tensor, usable in and out of inference mode
        return torch.arange(num_experts, device=device)


def grouped_experts(x: Tensor, weights: Tensor, expert_ids: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """x [T, H]; weights, expert_ids [T, K]; gate_up [E, 2I, H], down [E, H, I] (any strides) -> [T, H]."""
    K = expert_ids.shape[1]
    # P = T·K pairs, pair p = (token p // K, rank p % K); sorted by expert, then token (stable), so a token's
    # pairs are added in ascending expert order
    sorted_ids, order = expert_ids.reshape(-1).sort(stable=True)  # [P]
    ends = torch.searchsorted(sorted_ids, _expert_range(gate_up.shape[0], x.device), right=True,
                              out_int32=True)  # [E] where each expert's rows end
    token_idx = torch.div(order, K, rounding_mode="floor")  # [P]
    h = torch._grouped_mm(x.index_select(0, token_idx), gate_up.transpose(1, 2), offs=ends)  # [P, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends)  # [P, H]
    y = y * weights.reshape(-1).index_select(0, order)[:, None]
    return torch.zeros_like(x).index_add_(0, token_idx, y.to(x.dtype))


def single_token_experts(x: Tensor, weights: Tensor, expert_ids: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """The same as ``grouped_experts`` for one token (decoding one sequence), where ``_grouped_mm``'s cost per
    expert (all E groups, chosen or not) dominates: K GEMVs straight from the stacked views. Every expert sees
    one row, as in the other paths, so the bits are the same."""
    row, out = expert_ids[0].tolist(), torch.zeros_like(x)  # [1, H]
    for rank in sorted(range(len(row)), key=row.__getitem__):  # ascending expert, like the other paths
        gate, up = F.linear(x, gate_up[row[rank]]).chunk(2, dim=-1)  # [1, I] each
        out += (F.linear(F.silu(gate) * up, down[row[rank]]) * weights[:, rank : rank + 1]).to(out.dtype)
    return out


def looped_experts(x: Tensor, weights: Tensor, expert_ids: Tensor, experts: ExpertProvider,
                   layer_id: int) -> Tensor:
    """The same as ``grouped_experts``, one selected expert at a time, weights from ``experts.expert_weights``.
    An expert whose weights lie on another device (an offloaded expert computed from its host copy) is computed
    there: its rows go to it and its output comes back."""
    out = torch.zeros_like(x)  # [T, H]
    for expert_id in expert_ids.unique().tolist():  # ascending, like transformers
        token_idx, rank = torch.where(expert_ids == expert_id)  # tokens routed here, and at which of their k
        w = experts.expert_weights(layer_id, expert_id)
        y = expert_mlp(x.index_select(0, token_idx), w) * weights[token_idx, rank, None]  # [t, H]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def expert_mlp(rows: Tensor, w: ExpertWeights) -> Tensor:
    """One expert's SwiGLU over ``rows`` [t, H], computed where its weights lie (rows there and back)."""
    device = rows.device
    if w.down.device != device:
        rows = rows.to(w.down.device)
    gate, up = F.linear(rows, w.gate_up).chunk(2, dim=-1)  # [t, I] each
    return F.linear(F.silu(gate) * up, w.down).to(device)


# above this many (token, expert) pairs per expert (a prefill), torch's grouped GEMMs beat the native kernel, by
# dtype (measured at hidden 512, 16 experts of width 256 and 8 of 512, one thread on Zen 4: fp32 native 0.30-0.89x
# torch's time from 4 to 128 pairs per expert; bf16 0.54-0.82x at 8-16, 0.85-1.07x at 32, 1.08-1.24x at 64)
NATIVE_PAIRS_PER_EXPERT = {torch.float32: 128, torch.bfloat16: 16}
# with AMX tiles (``native.linear_isa()`` "amx") the bf16 kernel takes 0.4-0.6x the time of torch's grouped GEMMs
# from 1 to 32 pairs per expert and 0.8-0.9x at 128-256 (hidden 512, 16 experts of width 256, one thread on such a
# core); capped at 128 as fp32 is, which bounds its scratch (pairs x (2I + H) floats)
NATIVE_PAIRS_PER_EXPERT_AMX_BF16 = 128


def native_pairs_per_expert(dtype: torch.dtype) -> int:
    """Most (token, expert) pairs per expert the native kernel takes in this dtype here (see above)."""
    if dtype == torch.bfloat16 and native.linear_isa() == "amx":
        return NATIVE_PAIRS_PER_EXPERT_AMX_BF16
    return NATIVE_PAIRS_PER_EXPERT.get(dtype, 0)


def native_takes(x: Tensor, num_pairs: int, gate_up: Tensor, down: Tensor) -> bool:
    """Whether the native grouped kernel runs the step's experts (see the module docstring)."""
    E, two_i, H = gate_up.shape
    if num_pairs > native_pairs_per_expert(x.dtype) * E:
        return False
    return (native.worth_it(x, num_pairs * 3 * H * two_i // 2, native.EXPERT_DTYPES) and gate_up.dtype == x.dtype
            and native.experts_readable(gate_up, down))


class SparseMoE(nn.Module):
    """Router, then only the experts the step selected (grouped or looped, see the module docstring). Routing is
    transformers 5.19's: softmax over all experts in fp32, top-k, optional renormalization of the k weights
    (``norm_topk_prob``; Mixtral always, which equals its original top-k-then-softmax). ``cast_weights`` casts
    the k weights to the activation dtype before use (Qwen3); Mixtral keeps them fp32 until the product is added.
    Optional shared expert with a sigmoid gate."""

    def __init__(self, config: Any, layer_id: int, *, norm_topk_prob: bool, cast_weights: bool,
                 shared_intermediate_size: int = 0) -> None:
        super().__init__()
        self.layer_id, self.top_k = layer_id, config.num_experts_per_tok
        self.norm_topk_prob, self.cast_weights = norm_topk_prob, cast_weights
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.has_shared_expert = shared_intermediate_size > 0
        self.native_weights: native.KeptArgs | None = None  # native_args' own
        if self.has_shared_expert:
            self.shared_expert = MLP(config.hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def native_routes(self, x: Tensor) -> bool:
        """Whether the router's softmax and top-k for x's rows take ``native.moe_route``: fp32 only (the five torch
        ops of ``route`` in one call). Not bf16, whose logits tie often (8 bits of mantissa), and of tied experts
        torch.topk's pick is its own: transformers' choice there is kept by keeping its ops."""
        return native.worth_it(x, x.numel() // x.shape[-1] * self.gate.weight.shape[0])

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = linear(x, self.gate.weight)  # [T, E]
        if self.native_routes(x):
            weights, expert_ids = native.moe_route(logits, self.top_k, self.norm_topk_prob)
            return (weights.to(logits.dtype) if self.cast_weights else weights), expert_ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K], [T, K]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(logits.dtype) if self.cast_weights else weights), expert_ids

    def forward(self, x: Tensor, experts: ExpertProvider) -> Tensor:
        out = self.native_block(x, experts)
        if out is None:
            out = self.routed_experts(x, experts)
        if self.has_shared_expert:
            out = out + torch.sigmoid(linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return out

    def native_args(self, x: Tensor, experts: ExpertProvider) -> native.MoEArgs | None:
        """The router and the routed experts as ``native.moe_args`` for inputs like x, in fp32 where the router's
        top-k and the experts would each take their native kernel and every expert is resident
        (``resident_weights``: the routing is announced after); else None. Checked once while nothing moves
        (``native.keep_checked``)."""
        stacked = experts.resident_weights(self.layer_id)
        if stacked is None or x.dim() != 2 or not x.is_contiguous():
            return None
        return native.keep_checked(self, (x.device, x.dtype, *x.shape), stacked,
                                   lambda: self.checked_args(x, stacked))

    def checked_args(self, x: Tensor, stacked: tuple[Tensor, Tensor]) -> native.MoEArgs | None:
        """``native_args`` without keeping: the checks, then ``native.moe_args``."""
        if not self.native_routes(x) or not native_takes(x, x.shape[0] * self.top_k, *stacked):
            return None
        return native.moe_args(x.shape[1], self.gate.weight, self.top_k, self.norm_topk_prob, *stacked)

    def native_block(self, x: Tensor, experts: ExpertProvider) -> Tensor | None:
        """The router and the routed experts in one call (``native_args``, ``native.run_moe``), the routing
        announced after; else None. The gate's sums are the native kernel's, so the output equals
        ``routed_experts``' to fp32 round-off."""
        args = self.native_args(x, experts)
        if args is None:
            return None
        out, expert_ids = native.run_moe(args, x)
        experts.route(self.layer_id, expert_ids)
        return out

    def routed_experts(self, x: Tensor, experts: ExpertProvider) -> Tensor:
        """The router, the routing announced (``experts.route``), then the selected experts (module docstring)."""
        weights, expert_ids = self.route(x)  # [T, K], [T, K]
        experts.route(self.layer_id, expert_ids)
        stacked = experts.stacked_weights(self.layer_id)
        T, K = expert_ids.shape
        if stacked is not None and native_takes(x, T * K, *stacked):
            out = native.moe_experts(x, weights, expert_ids, *stacked)
        elif stacked is not None and T == 1 and x.device.type == "cpu":
            out = single_token_experts(x, weights, expert_ids, *stacked)
        elif stacked is not None and grouped_mm_takes(x, *stacked):
            out = grouped_experts(x, weights, expert_ids, *stacked)
        else:
            out = looped_experts(x, weights, expert_ids, experts, self.layer_id)
        return out
