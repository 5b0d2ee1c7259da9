"""engine.split_attention: partial attention + log-sum-exp merge equals full attention, for any split."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from moetide.engine.split_attention import merge_partials, partial_attention, split_attention  # noqa: E402


def reference(q, k, v, scale, mask=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def tensors(seed, batch=2, heads=8, kv_heads=2, queries=1, keys=97, dk=16, dv=12, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, queries, dk, generator=g, dtype=dtype)
    k = torch.randn(batch, kv_heads, keys, dk, generator=g, dtype=dtype)
    v = torch.randn(batch, kv_heads, keys, dv, generator=g, dtype=dtype)
    return q, k, v


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31), st.integers(0, 97), st.integers(0, 97), st.sampled_from([(8, 2), (4, 4), (6, 1)]))
def test_any_two_split_points_are_exact(seed, a, b, heads):
    """Device range [0, d), CPU range [d, c), streamed range [c, N): the merge equals full attention."""
    q, k, v = tensors(seed, heads=heads[0], kv_heads=heads[1])
    d, c = sorted((a, b))
    got = split_attention(q, k, v, 0.25, [d, c])
    torch.testing.assert_close(got, reference(q, k, v, 0.25), rtol=1e-12, atol=1e-12)


def test_empty_ranges_drop_out_and_lse_is_global():
    q, k, v = tensors(1)
    parts = [partial_attention(q, k[:, :, :0], v[:, :, :0], 0.3), partial_attention(q, k, v, 0.3)]
    assert torch.isneginf(parts[0][1]).all() and (parts[0][0] == 0).all()
    out, lse = merge_partials(parts)
    torch.testing.assert_close(out, reference(q, k, v, 0.3), rtol=1e-12, atol=1e-12)
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


def test_prefill_chunk_host_prefix_plus_causal_device_part():
    """A chunk of 5 queries after 40 host tokens: host ranges unmasked, the chunk's own keys causal."""
    q, k, v = tensors(7, queries=5, keys=45)
    causal = torch.ones(5, 45, dtype=torch.bool)
    causal[:, 40:] = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    host_cpu = partial_attention(q, k[:, :, :25], v[:, :, :25], 0.2)
    host_streamed = partial_attention(q, k[:, :, 25:40], v[:, :, 25:40], 0.2)
    chunk = partial_attention(q, k[:, :, 40:], v[:, :, 40:], 0.2, mask=causal[:, 40:])
    out, _ = merge_partials([host_cpu, chunk, host_streamed])  # order does not matter
    torch.testing.assert_close(out, reference(q, k, v, 0.2, causal), rtol=1e-12, atol=1e-12)


def test_bf16_inputs_merge_in_fp32():
    q, k, v = tensors(3, dtype=torch.bfloat16)
    got = split_attention(q, k, v, 0.25, [30, 60])
    assert got.dtype == torch.float32
    want = reference(q.double(), k.double(), v.double(), 0.25)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_bad_arguments():
    q, k, v = tensors(0, heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="multiple"):
        partial_attention(q, k, v, 1.0)
    q, k, v = tensors(0)
    with pytest.raises(ValueError, match="non-decreasing"):
        split_attention(q, k, v, 1.0, [50, 10])
    with pytest.raises(ValueError):
        merge_partials([])
