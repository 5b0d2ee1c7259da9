"""The grouped native MoE kernel (``engine/native/moe.c``): against the torch paths it replaces, in fp32 and bf16,
with many tokens per expert (its register blocks and their remainders), and independent of the step's other
tokens; the MoE block and the projections choosing the native kernels where they should.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from moetide.engine import native  # noqa: E402
from moetide.engine.models import moe, ops  # noqa: E402
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
        cap = {dtype: moe.native_pairs_per_expert(dtype) for dtype in (torch.float32, torch.bfloat16)}
        assert moe.native_takes(x.float(), cap[torch.float32] * 8, gate_up.float(), down.float())
        assert not moe.native_takes(x.float(), cap[torch.float32] * 8 + 1, gate_up.float(), down.float())
        assert moe.native_takes(x, cap[torch.bfloat16] * 8, gate_up, down)
        assert not moe.native_takes(x, cap[torch.bfloat16] * 8 + 1, gate_up, down)
        assert not moe.native_takes(x.float(), 8, gate_up, down)  # activations and weights of two dtypes
    assert not moe.native_takes(x, 8, gate_up, down)  # autograd on: the kernels have no backward


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_rows", "k", "n"), [(1, 512, 768), (3, 40, 9), (8, 72, 33), (2, 37, 13), (5, 30, 19),
                                                  (33, 23, 50)])
def test_native_linear_equals_torch(dtype, num_rows, k, n):
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(num_rows, k, generator=generator).to(dtype)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    out, expected = native.linear(x, weight), torch.nn.functional.linear(x, weight)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7  # fp32 round-off; bf16: one rounding of the sum
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance * scale)
    for row in (0, num_rows - 1):  # a row's result whatever rows share the call
        assert torch.equal(native.linear(x[row : row + 1], weight), out[row : row + 1])


def gdn_layer(dtype, value_dim=16):
    """A Qwen3-Next Gated DeltaNet layer with random weights (2 key heads of 16, 4 value heads of ``value_dim``)."""
    from types import SimpleNamespace

    from moetide.engine.models.qwen3_next import GatedDeltaNet

    config = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=value_dim, linear_conv_kernel_dim=4, hidden_size=48,
                             rms_norm_eps=1e-6)
    layer = GatedDeltaNet(config, layer_id=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return layer.to(dtype)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("prompt_len", "value_dim"), [(5, 16), (70, 16), (9, 72)])
def test_native_gdn_forward_equals_the_torch_rule_and_updates_the_states_in_place(dtype, prompt_len, value_dim,
                                                                                  monkeypatch):
    """Prefill (token by token, in pieces of ``GDN_PIECE``: 70 takes two), then decode, against the torch rule
    (chunked for the prompt, recurrent for a token). Value heads of 72 take each column path of the state passes:
    64 columns in registers, then 8 one at a time."""
    from moetide.engine.models.hooks import DictLinearStateStore, StepBatch, StepContext

    layer = gdn_layer(dtype, value_dim)
    shapes = {0: layer.state_shape()}
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randn(3 * prompt_len, 48, generator=generator).to(dtype)  # 3 sequences, prompt_len tokens each
    step = torch.randn(3, 48, generator=generator).to(dtype)
    results, calls, kernel = {}, [], native.gdn_forward
    monkeypatch.setattr(native, "gdn_forward", lambda *args: calls.append(args[0].shape[0]) or kernel(*args))
    for path in ("native", "torch"):
        if path == "torch":
            monkeypatch.setattr(native, "worth_it", lambda *args, **kwargs: False)
        store = DictLinearStateStore(shapes, dtype)
        with torch.inference_mode():
            first = layer(prompt, StepContext(StepBatch.of([(s, prompt_len, 0) for s in range(3)]), None, store),
                          None)
            out = layer(step, StepContext(StepBatch.of([(s, 1, prompt_len) for s in range(3)]), None, store), None)
            fresh = layer(step[:1], StepContext(StepBatch.of([(7, 1, 0)]), None, store), None)  # a 1-token prompt
        results[path] = (first, out, fresh, [store.state(0, s) for s in range(3)])
        assert calls == [3 * prompt_len, 3, 1]  # the prefill's rows, then the two decode steps
    (first, out, fresh, states), (ref_first, ref_out, ref_fresh, ref_states) = results["native"], results["torch"]
    # the projections feeding the rule are native too (``models.ops.linear``), so even the conv state's raw inputs
    # agree to round-off only
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -6
    pairs = [(first, ref_first), (out, ref_out), (fresh, ref_fresh)] + [(t, r) for s, rs in zip(states, ref_states)
                                                    for t, r in ((s.conv, rs.conv), (s.recurrent, rs.recurrent))]
    for a, b in pairs:
        torch.testing.assert_close(a.float(), b.float(), rtol=tolerance, atol=tolerance * float(b.float().abs().max()))
    assert not torch.equal(states[0].recurrent, torch.zeros_like(states[0].recurrent))  # written in place


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3])
def test_native_gdn_forward_updates_states_in_scattered_blocks_that_cut_rows(dtype, tokens):
    """A state cut into 200-byte blocks in shuffled order (so the conv state and some 64-byte recurrent rows cross a
    block boundary) is updated exactly as the same state in one contiguous row, fresh sequences included."""
    from moetide.engine.models.hooks import DictLinearStateStore, StateBlocks

    layer = gdn_layer(dtype)
    store = DictLinearStateStore({0: layer.state_shape()}, dtype)
    layout, block_bytes = store.layout, 200
    conv, recurrent = layout.fields[0]
    assert any((recurrent.offset + i * 64) % block_bytes + 64 > block_bytes for i in range(4 * 16))
    assert conv.offset // block_bytes != (conv.offset + conv.nbytes - 1) // block_bytes
    generator = torch.Generator().manual_seed(4)
    B, n = 3, layout.num_blocks(block_bytes)
    for s in range(B):  # random states, in the layout's dtypes
        st = store.state(0, s)
        st.conv.copy_(torch.randn(st.conv.shape, generator=generator).to(dtype))
        st.recurrent.copy_(torch.randn(st.recurrent.shape, generator=generator))
    pool = torch.zeros(B * n + 5, block_bytes, dtype=torch.uint8)
    tables = torch.randperm(pool.shape[0], generator=generator)[: B * n].view(B, n)
    for s in range(B):
        row = torch.zeros(n * block_bytes, dtype=torch.uint8)
        layout.views(row, 0).conv.copy_(store.state(0, s).conv)
        layout.views(row, 0).recurrent.copy_(store.state(0, s).recurrent)
        pool[tables[s]] = row.view(n, block_bytes)
    scattered = StateBlocks(pool.data_ptr() + tables * block_bytes, block_bytes, layout)
    mixed = torch.randn(B * tokens, conv.shape[0], generator=generator).to(dtype)
    g, beta = -torch.rand(B * tokens, 4, generator=generator), torch.rand(B * tokens, 4, generator=generator)
    fresh = [False, True, False]
    with torch.inference_mode():
        args = (layer.conv1d.weight, 0, fresh, g, beta, 2, 16, 16)
        expected = native.gdn_forward(mixed, args[0], store.state_blocks(list(range(B))), *args[1:])
        out = native.gdn_forward(mixed, args[0], scattered, *args[1:])
    assert torch.equal(out, expected)
    for s in range(B):
        got, want = layout.views(pool[tables[s]].reshape(-1), 0), store.state(0, s)
        assert torch.equal(got.conv, want.conv) and torch.equal(got.recurrent, want.recurrent)
    assert torch.equal(pool[~torch.isin(torch.arange(pool.shape[0]), tables)], torch.zeros(5, block_bytes,
                                                                                          dtype=torch.uint8))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["plain", "zero_centered", "gated"])
def test_native_rms_norm_equals_the_torch_forms(dtype, form, monkeypatch):
    """Each RMSNorm form in one native call: fp32 to round-off; bf16 rounds where torch does, so an element
    differs only where fp32 round-off crosses a bf16 rounding boundary (at most one bf16 step, rarely)."""
    from moetide.engine.models.norm_rope import RMSNorm
    from moetide.engine.models.qwen3_next import GatedRMSNorm

    generator = torch.Generator().manual_seed(6)
    x = (torch.randn(37, 136, generator=generator) * 3).to(dtype)
    gate = torch.randn(37, 136, generator=generator).to(dtype)
    norm = GatedRMSNorm(136, 1e-6) if form == "gated" else RMSNorm(136, 1e-6, zero_centered=form == "zero_centered")
    with torch.no_grad():
        norm.weight.copy_(torch.randn(136, generator=generator) * 0.5)
    norm = norm.to(dtype)
    calls, kernel = [], native.rms_norm
    monkeypatch.setattr(native, "rms_norm", lambda *args: calls.append(args[3]) or kernel(*args))
    with torch.inference_mode():
        args = (x, gate) if form == "gated" else (x,)
        out = norm(*args)
        monkeypatch.setattr(native, "worth_it", lambda *args, **kwargs: False)
        ref = norm(*args)
    assert calls == [form == "zero_centered"] and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        step = ref.float().abs() * 2 ** -7
        assert bool(((out.float() - ref.float()).abs() <= step + 1e-30).all())
        assert (out != ref).float().mean() < 0.005


@needs_native
def test_native_decode_attention_reads_a_bf16_cache_as_sdpa_does():
    from moetide.engine.attention import attend_gathered, gather_kv

    generator = torch.Generator().manual_seed(5)
    num_rows, b, L, Hq, Hkv, D = 64, 3, 21, 8, 2, 64
    k_rows, v_rows = (torch.randn(num_rows, Hkv, D, generator=generator).to(torch.bfloat16) for _ in range(2))
    lengths = torch.tensor([L, 1, 9])
    key_rows = torch.randint(0, num_rows, (b, L), generator=generator)
    key_rows = torch.where(torch.arange(L) < lengths[:, None], key_rows, key_rows[:, :1])
    q = torch.randn(b, Hq, D, generator=generator).to(torch.bfloat16)
    keys, values = gather_kv(k_rows, v_rows, key_rows.flatten(), b, L)
    mask = (torch.arange(L) < lengths[:, None])[:, None, None, :]
    expected = attend_gathered(q[:, None], keys, values, mask, 0.125)[:, 0]
    out = native.paged_decode_attention(q, k_rows, v_rows, key_rows, lengths, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 ** -7, atol=2 ** -7)
    with pytest.raises(ValueError, match="fp32 CPU tensors"):  # a bf16 cache with an fp32 query is refused
        native.paged_decode_attention(q.float(), k_rows, v_rows, key_rows, lengths, 0.125)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projections_take_the_native_linear_up_to_the_cap_of_the_kernel_built(dtype, monkeypatch):
    """``models.ops.linear`` hands the native kernel at most its cap of rows for the vector path built (where it
    beats torch's GEMM) and torch the rest; the answer is the same either way, to a sum's rounding."""
    isa = native.linear_isa()
    assert isa in ("c", "avx2", "avx512", "avx512-bf16", "amx")
    cap = ops.native_max_rows(dtype)
    table = ops.NATIVE_LINEAR_MAX_TOKENS.get(isa, {}).get(dtype, 0)
    beside_amx = dtype == torch.bfloat16 and ops.torch_bf16_on_amx()
    assert cap == (min(table, ops.NATIVE_LINEAR_MAX_TOKENS_BESIDE_AMX) if beside_amx else table)
    taken = []
    real = native.linear
    monkeypatch.setattr(native, "linear", lambda x, w: taken.append(x.shape[0]) or real(x, w))
    weight = torch.randn(ops.NATIVE_LINEAR_MIN_OUTPUTS_FP32, 40).to(dtype)
    with torch.inference_mode():
        for rows in sorted({1, max(cap, 1), cap + 1}):
            x = torch.randn(rows, 40).to(dtype)
            tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
            torch.testing.assert_close(ops.linear(x, weight).float(), torch.nn.functional.linear(x, weight).float(),
                                       rtol=tolerance, atol=tolerance * 40)
    assert taken == [r for r in sorted({1, max(cap, 1), cap + 1}) if r <= cap]


@needs_native
def test_projections_with_few_outputs_go_to_torch(monkeypatch):
    """A router's gate (N = the expert count) and a one-output gate cost the native call's fixed price: fp32 below
    ``NATIVE_LINEAR_MIN_OUTPUTS_FP32`` outputs, and bf16 up to ``TORCH_BF16_SMALL_PRODUCT`` = T·N, go to torch."""
    taken = []
    real = native.linear
    monkeypatch.setattr(native, "linear", lambda x, w: taken.append((x.shape[0], w.shape[0], x.dtype)) or real(x, w))
    small = ops.NATIVE_LINEAR_MIN_OUTPUTS_FP32
    cases = [(4, small - 1, torch.float32), (4, small, torch.float32), (1, 8, torch.bfloat16),
             (2, 8, torch.bfloat16), (8, 1, torch.bfloat16), (16, 1, torch.bfloat16)]
    with torch.inference_mode():
        for rows, outputs, dtype in cases:
            x, weight = torch.randn(rows, 32).to(dtype), torch.randn(outputs, 32).to(dtype)
            tolerance = 1e-5 if dtype == torch.float32 else 2 ** -7
            torch.testing.assert_close(ops.linear(x, weight).float(), torch.nn.functional.linear(x, weight).float(),
                                       rtol=tolerance, atol=tolerance * 32)
    native_sized = [(4, small, torch.float32), (2, 8, torch.bfloat16), (16, 1, torch.bfloat16)]
    assert taken == [case for case in native_sized if case[0] <= ops.native_max_rows(case[2])]


@needs_native
def test_copy_blocks_gathers_and_scatters_as_indexing_does_and_refuses_a_block_outside():
    generator = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 5, 24), generator=generator, dtype=torch.uint8)
    index = (torch.tensor([[2, 0], [1, 2]]), torch.tensor([[4, 0], [3, 1]]))
    scratch = torch.empty(2, 2 * 24, dtype=torch.uint8)
    native.copy_blocks(scratch, blocks, index, to_blocks=False)
    assert torch.equal(scratch, blocks[index].reshape(2, -1))
    expected = blocks.clone()
    scratch.add_(1)
    expected[index] = scratch.view(2, 2, 24)
    native.copy_blocks(scratch, blocks, index, to_blocks=True)
    assert torch.equal(blocks, expected)
    with pytest.raises(ValueError, match="outside the 3 x 5 blocks"):
        native.copy_blocks(torch.empty(24, dtype=torch.uint8), blocks, (torch.tensor([3]), torch.tensor([0])),
                           to_blocks=False)
