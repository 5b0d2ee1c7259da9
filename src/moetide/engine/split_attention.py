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

Kernels. ``partial_attention`` is plain PyTorch (matmul, logsumexp, matmul) and runs anywhere; it is the reference
and the accelerator's path. ``cpu_partial_attention`` is the CPU's: torch's CPU flash attention
(``aten._scaled_dot_product_flash_attention_for_cpu``, the kernel ``moetide calibrate`` measures), which returns
the log-sum-exp itself. Two of its habits are handled here. It wants as many KV heads as query heads, so GQA runs
as one problem per KV head (the G query heads that share a KV head, times the Q queries, are its rows), or, for a
long prefill chunk with a mask, with the K/V heads repeated: whichever copies less. And a query row with no key to
attend comes back with lse = 0; it is set to -inf, so the row drops out of the merge like an empty range.
``lse_attention`` picks the kernel by device. ``cuda_partial_attention`` is torch's own fused kernel on CUDA
(``aten._scaled_dot_product_efficient_attention``, which also returns the log-sum-exp): the device partial a CUDA
host tier needs beside vLLM's attention, checked against full attention by ``benchmarks/gpu_checks.sh``.
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


def cpu_partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          mask: torch.Tensor | None = None, row_has_key: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial_attention`` on CPU tensors with torch's CPU flash kernel (module docstring); same shapes, same
    result to rounding; ``out`` in fp32 (or wider). Inputs of one dtype (the KV's); ``mask`` is bool.
    ``row_has_key`` ([B, 1, Q] bool, optional) says which query rows attend any key, when the caller knows it
    more cheaply than ``mask.any(-1)``."""
    batch, num_heads, num_queries, _ = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    out_shape = (batch, num_heads, num_queries, v.shape[-1])
    if num_keys == 0:
        return (q.new_zeros(out_shape, dtype=_widen(q).dtype),
                q.new_full((batch, num_heads, num_queries), float("-inf"), dtype=torch.float32))
    group = num_heads // num_kv_heads
    q = q.to(k.dtype)
    bias = None if mask is None else torch.where(mask, 0.0, float("-inf")).to(k.dtype)  # additive, [B, 1, Q, N]
    if bias is not None and group > 1 and num_queries * (group - 1) > 2 * group * k.shape[-1]:
        # a long chunk: G copies of its mask cost more than G copies of the keys and values (query head h reads
        # KV head h // G, transformers' repeat_kv)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        rows = q
    else:
        rows = q.reshape(batch, num_kv_heads, group * num_queries, q.shape[-1])  # row g·Q + j is query j's
        if bias is not None and group > 1:
            bias = bias.expand(batch, 1, num_queries, num_keys).repeat(1, 1, group, 1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(rows, k, v, attn_mask=bias, scale=scale)
    out, lse = _widen(out).reshape(out_shape), lse.reshape(batch, num_heads, num_queries).float()
    if mask is not None:
        empty = ~(row_has_key if row_has_key is not None else mask.any(dim=-1))  # [B, 1, Q]; kernel: lse = 0
        if bool(empty.any()):
            lse = lse.masked_fill(empty, float("-inf"))
            out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def cuda_partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial_attention`` on CUDA tensors with torch's memory-efficient attention kernel (module docstring);
    same shapes, ``out`` in fp32 (or wider). GQA repeats the KV heads (the kernel wants one per query head); a mask
    becomes an additive bias whose rows are padded to a multiple of 16 keys, the kernel's alignment (torch's SDPA
    front end pads the same way); rows with no key drop out of the merge as in ``cpu_partial_attention``."""
    batch, num_heads, num_queries, _ = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if num_keys == 0:
        return (q.new_zeros((batch, num_heads, num_queries, v.shape[-1]), dtype=_widen(q).dtype),
                q.new_full((batch, num_heads, num_queries), float("-inf"), dtype=torch.float32))
    group = num_heads // num_kv_heads
    q = q.to(k.dtype)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    bias = None
    if mask is not None:
        padded = q.new_full((batch, num_heads, num_queries, -(-num_keys // 16) * 16), float("-inf"))
        padded[..., :num_keys] = torch.where(mask, 0.0, float("-inf")).to(q.dtype)
        bias = padded[..., :num_keys]
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, scale=scale)[:2]
    out, lse = _widen(out), lse[..., :num_queries].float()  # the kernel may pad the queries of its lse
    if mask is not None:
        empty = ~mask.any(dim=-1).expand(batch, num_heads, num_queries)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse


def lse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  mask: torch.Tensor | None = None, row_has_key: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one KV range with the kernel of the tensors' device (module docstring)."""
    if q.device.type == "cpu" or k.shape[2] == 0:  # the CPU kernel also gives any device's empty result
        return cpu_partial_attention(q, k, v, scale, mask, row_has_key)
    return partial_attention(q, k, v, scale, mask)


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
