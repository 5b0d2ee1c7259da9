"""The grouped native MoE kernel (``engine/native/moe.c``): against the torch paths it replaces, in fp32 and bf16,
with many tokens per expert (its 3-token register blocks and their remainders), and independent of the step's
other tokens; and the MoE block choosing it where it should.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from moetide.engine import native  # noqa: E402
from moetide.engine.models import moe  # noqa: E402
from test_engine_step_paths import strided_experts  # noqa: E402

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")


def routed_step(seed: int, num_tokens: int, num_experts: int, hidden: int, top_k: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    expert_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=generator)
    return x, weights, expert_ids, generator


@needs_native
@pytest.mark.parametrize(("num_tokens", "top_k", "hidden", "inter"), [(1, 2, 40, 12), (7, 2, 64, 48),
                                                                      (40, 3, 72, 20), (97, 2, 36, 12)])
def test_grouped_kernel_equals_the_torch_path_in_fp32(num_tokens, top_k, hidden, inter):
    x, weights, expert_ids, generator = routed_step(num_tokens, num_tokens, 8, hidden, top_k)
    gate_up, down = strided_experts(generator, 8, hidden, inter)
    out = native.moe_experts(x, weights, expert_ids, gate_up, down)
    expected = moe.grouped_experts(x, weights, expert_ids, gate_up, down)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    for t in (0, num_tokens - 1):  # the same bits whatever else shares the step
        assert torch.equal(native.moe_experts(x[t : t + 1], weights[t : t + 1], expert_ids[t : t + 1], gate_up,
                                              down), out[t : t + 1])


@needs_native
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_grouped_kernel_rounds_as_torch_does_in_bf16(num_tokens):
    x, weights, expert_ids, generator = routed_step(num_tokens, num_tokens, 8, 64, 2, torch.bfloat16)
    gate_up, down = (w.to(torch.bfloat16) for w in strided_experts(generator, 8, 64, 32))
    weights = weights.to(torch.bfloat16)  # Qwen3 casts the routing weights to the activation dtype
    out = native.moe_experts(x, weights, expert_ids, gate_up, down)
    assert out.dtype == torch.bfloat16
    expected = moe.grouped_experts(x, weights, expert_ids, gate_up, down)
    # each projection is one rounding of a sum taken in another order: a bf16 ulp here and there, no more
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=2 ** -7 * scale)
    assert (out != expected).float().mean() < 0.1
    assert torch.equal(native.moe_experts(x[:1], weights[:1], expert_ids[:1], gate_up, down), out[:1])


@needs_native
def test_grouped_kernel_refuses_mixed_dtypes_and_bad_ids():
    x, weights, expert_ids, generator = routed_step(0, 3, 4, 16, 2)
    gate_up, down = strided_experts(generator, 4, 16, 8)
    with pytest.raises(ValueError, match="one dtype"):
        native.moe_experts(x.to(torch.bfloat16), weights, expert_ids, gate_up, down)
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 4\)"):
        native.moe_experts(x, weights, expert_ids + 2, gate_up, down)


@needs_native
def test_the_moe_block_takes_the_native_kernel_except_for_a_prefill(monkeypatch):
    _, _, _, generator = routed_step(0, 1, 8, 64, 2)
    gate_up, down = (w.to(torch.bfloat16) for w in strided_experts(generator, 8, 64, 32))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert moe.native_takes(x, 2 * 4, gate_up, down)
        assert moe.native_takes(x.float(), moe.NATIVE_PAIRS_PER_EXPERT * 8, gate_up.float(), down.float())
        assert not moe.native_takes(x, moe.NATIVE_PAIRS_PER_EXPERT * 8 + 1, gate_up, down)
        assert not moe.native_takes(x.float(), 8, gate_up, down)  # activations and weights of two dtypes
    assert not moe.native_takes(x, 8, gate_up, down)  # autograd on: the kernels have no backward
