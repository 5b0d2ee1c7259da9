"""The CUDA side of a host KV tier, with torch alone: the device partial from torch's fused attention kernel and its
log-sum-exp (``engine.split_attention.cuda_partial_attention``), merged with a CPU partial over the host-resident
keys (``cpu_partial_attention``, on the CPU), equals full attention over all keys on the device. Decode rows and a
prefill chunk with its causal mask, GQA and MHA, three dtypes, several split points. ``benchmarks/gpu_checks.sh``
runs it where a GPU is lent; without one it skips."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from moetide.engine.split_attention import (  # noqa: E402
    cpu_partial_attention,
    cuda_partial_attention,
    merge_partials,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (gpu_checks.sh)")]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def causal_mask(num_queries: int, first_key: int, num_keys: int, context: int, device) -> torch.Tensor:
    """[1, 1, Q, N]: query j sits at position context - Q + j and sees keys at positions first_key + i up to it."""
    positions = torch.arange(context - num_queries, context, device=device).unsqueeze(-1)
    return (torch.arange(first_key, first_key + num_keys, device=device) <= positions)[None, None]


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("num_queries", [1, 37])
@pytest.mark.parametrize("split", [0, 1, 160, 299, 300])
def test_device_partial_merged_with_a_cpu_partial_equals_full_attention(dtype, heads, kv_heads, num_queries, split):
    context, dim, scale = 300, 64, 0.125
    g = torch.Generator().manual_seed(split * 7 + num_queries)
    q = torch.randn(2, heads, num_queries, dim, generator=g).to(dtype)
    k = torch.randn(2, kv_heads, context, dim, generator=g).to(dtype)
    v = torch.randn(2, kv_heads, context, dim, generator=g).to(dtype)
    mask = causal_mask(num_queries, 0, context, context, "cpu") if num_queries > 1 else None
    device_part = cuda_partial_attention(q.cuda(), k[:, :, :split].cuda(), v[:, :, :split].cuda(), scale,
                                         None if mask is None else mask[..., :split].cuda())
    host_part = cpu_partial_attention(q, k[:, :, split:], v[:, :, split:], scale,
                                      None if mask is None else mask[..., split:])
    out, _ = merge_partials([device_part, tuple(t.cuda() for t in host_part)])
    group = heads // kv_heads
    full = torch.nn.functional.scaled_dot_product_attention(
        q.cuda().float(), k.cuda().float().repeat_interleave(group, 1), v.cuda().float().repeat_interleave(group, 1),
        attn_mask=None if mask is None else mask.cuda(), scale=scale)
    torch.testing.assert_close(out, full, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_a_row_with_no_key_drops_out_of_the_merge():
    q, k, v = (torch.randn(1, 4, 3, 64, device="cuda") for _ in range(3))
    mask = torch.tensor([True, False, True], device="cuda")[None, None, :, None].expand(1, 1, 3, 64)
    out, lse = cuda_partial_attention(q, k, v, 0.125, mask)
    assert torch.isinf(lse[:, :, 1]).all() and (out[:, :, 1] == 0).all()
    assert torch.isfinite(lse[:, :, [0, 2]]).all()
