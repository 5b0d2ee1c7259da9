"""Split attention: attend disjoint KV ranges separately (device-resident, CPU in place, streamed through the
ring), then merge the partial results exactly by log-sum-exp.

Invariant: for any partition of the keys, ``merge_partials([partial_attention(q, k_i, v_i) ...])`` equals
softmax(q k^T * scale) v over all keys, up to floating-point rounding (the merge is exact arithmetic, not an
approximation: each partial carries its own max-shifted normaliser). This is what lets the WriteScope planner move
the split point every step: where a block is attended changes nothing in the result.

Each partial is (out, lse): out = softmax over that range's keys applied to its values, in fp32 (or the input
dtype if wider); lse = log sum_j exp(s_j) over the range's scores s. An empty range gives lse = -inf and out = 0 and
drops out of the merge. Merge: lse = logsumexp_i(lse_i); out = sum_i exp(lse_i - lse) out_i.

Shapes: q [B, H, Q, Dk]; k [B, Hkv, N, Dk]; v [B, Hkv, N, Dv]; H a multiple of Hkv (GQA: query head h reads KV head
h // (H / Hkv)). ``mask`` (optional, broadcastable to [B, H, Q, N], True = attend) serves the causal part of a
prefill chunk; host KV precedes the chunk and needs none. MLA in the absorbed form is the case Hkv = 1, Dk = r +
r_rope, Dv = r.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _widen(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, Q, Dv], lse [B, H, Q]) of q attending one KV range (module docstring)."""
    q, k, v = _widen(q), _widen(k), _widen(v)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # B, H, N, Dk
    v = v.repeat_interleave(group, dim=1).to(q.dtype)  # B, H, N, Dv
    scores = torch.matmul(q, k.to(q.dtype).transpose(-1, -2)) * scale  # B, H, Q, N
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # B, H, Q; -inf where nothing is attended
    weights = torch.exp(scores - lse.unsqueeze(-1).clamp_min(torch.finfo(q.dtype).min))
    weights = torch.nan_to_num(weights, nan=0.0)  # rows with no keys: exp(-inf - (-inf))
    return torch.matmul(weights, v), lse


def merge_partials(partials: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact log-sum-exp merge of partial results over disjoint KV ranges; returns (out, lse)."""
    if not partials:
        raise ValueError("merge_partials needs at least one partial")
    lses = torch.stack([lse for _, lse in partials])  # P, B, H, Q
    total = torch.logsumexp(lses, dim=0)  # B, H, Q
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    out = torch.zeros_like(partials[0][0])
    for part_out, lse in partials:
        out = out + torch.exp(lse - safe).unsqueeze(-1) * part_out  # exp(-inf) = 0 for empty ranges
    return out, total


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    boundaries: Sequence[int]) -> torch.Tensor:
    """Attention over k, v cut at ``boundaries`` (token positions, non-decreasing, within [0, N]) into
    contiguous ranges — e.g. [device end, CPU end] for device / host in-place / host streamed — merged."""
    num_keys = k.shape[2]
    cuts = [0, *boundaries, num_keys]
    if any(b < a for a, b in zip(cuts, cuts[1:])) or cuts[-2] > num_keys:
        raise ValueError(f"boundaries must be non-decreasing within [0, {num_keys}], got {list(boundaries)}")
    parts = [partial_attention(q, k[:, :, a:b], v[:, :, a:b], scale) for a, b in zip(cuts, cuts[1:])]
    return merge_partials(parts)[0]
