"""The native CPU kernels (``engine.native``): each against the torch path it replaces (fp32 round-off), padding and
unreferenced rows that hold NaN never reaching an output, the engine taking them at decode, and the engine without
them (no compiler, or ``MOETIDE_NATIVE=0``) still matching transformers token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moetide.engine import native  # noqa: E402
from moetide.engine.attention import attend_gathered, gather_kv  # noqa: E402
from moetide.engine.models import moe  # noqa: E402
from moetide.engine.models.norm_rope import RMSNorm, apply_rope, rms_normalize, rope_tables  # noqa: E402
from moetide.engine.runner import Engine  # noqa: E402
from moetide.engine.split_attention import cpu_partial_attention  # noqa: E402
from engine_parity import MAX_TOKENS, PAGE_BYTES, STATIC_PAGES, TIGHT, check_books, parity_prompts  # noqa: E402
from test_engine_step_paths import strided_experts  # noqa: E402

needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")


@pytest.fixture
def native_env(monkeypatch):
    """``native_env(NAME=value, ...)``: the loader as it runs under these environment variables (its cached
    library dropped before, and again after the test)."""

    def set_env(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        native.load.cache_clear()

    yield set_env
    monkeypatch.undo()
    native.load.cache_clear()


@pytest.fixture
def without_native(native_env):
    """The engine as it runs where the native kernels cannot be built."""
    native_env(MOETIDE_NATIVE="0")


def count_calls(monkeypatch, *names):
    """Wrap ``native.<name>`` so each call's keyword arguments are recorded: {name: [kwargs, ...]}."""
    calls = {name: [] for name in names}
    for name in names:
        def counted(*args, _name=name, _kernel=getattr(native, name), **kwargs):
            calls[_name].append(kwargs)
            return _kernel(*args, **kwargs)
        monkeypatch.setattr(native, name, counted)
    return calls


def length_mask(lengths, num_keys):
    """[b, 1, 1, L]: key j of sequence s is attended iff j < lengths[s]."""
    return (torch.arange(num_keys) < lengths[:, None])[:, None, None, :]


def reference_decode(q, k_rows, v_rows, key_rows, lengths, scale):
    """The torch path the native decode attention replaces: gather, mask, SDPA."""
    b, num_keys = key_rows.shape
    keys, values = gather_kv(k_rows, v_rows, key_rows.flatten(), b, num_keys)
    return attend_gathered(q[:, None], keys, values, length_mask(lengths, num_keys), scale)[:, 0]


def assert_close(actual, expected):
    """fp32 round-off of sums with cancellation: errors relative to the output's scale, not to each element."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


@needs_native
@pytest.mark.parametrize(("num_tokens", "top_k"), [(1, 2), (3, 3), (8, 1), (40, 2)])
def test_native_experts_equal_the_grouped_path(num_tokens, top_k):
    generator = torch.Generator().manual_seed(num_tokens)
    num_experts, hidden, inter = 8, 40, 12  # widths that are not multiples of the vector width
    gate_up, down = strided_experts(generator, num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, generator=generator)
    expert_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=generator)
    expected = moe.grouped_experts(x, weights, expert_ids, gate_up, down)
    assert_close(native.moe_experts(x, weights, expert_ids, gate_up, down), expected)
    # a token's result does not depend on the other tokens of the step
    assert torch.equal(native.moe_experts(x[-1:], weights[-1:], expert_ids[-1:], gate_up, down),
                       native.moe_experts(x, weights, expert_ids, gate_up, down)[-1:])


@needs_native
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(4, 2, 64), (6, 6, 20), (8, 1, 16), (16, 2, 128), (5, 1, 80)])
def test_native_decode_attention_equals_gather_and_sdpa(heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(heads * head_dim)
    num_rows, b, L = 300, 5, 37
    # overlapping row views, as the arena's (rows a gcd apart, each reading Hkv·D elements)
    step = kv_heads * head_dim // 2 if kv_heads * head_dim % 2 == 0 else kv_heads * head_dim
    data = torch.randn(2, num_rows * step + kv_heads * head_dim, generator=generator)
    k_rows, v_rows = (data[i].as_strided((num_rows, kv_heads, head_dim), (step, head_dim, 1)) for i in range(2))
    lengths = torch.tensor([L, 1, 17, 36, 8])
    key_rows = torch.randint(0, num_rows, (b, L), generator=generator)
    key_rows = torch.where(torch.arange(L) < lengths[:, None], key_rows, key_rows[:, :1])  # padding: slot 0
    q = torch.randn(b, heads, head_dim, generator=generator)
    expected = reference_decode(q, k_rows, v_rows, key_rows, lengths, 0.3)
    assert_close(native.paged_decode_attention(q, k_rows, v_rows, key_rows, lengths, 0.3), expected)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 24])  # the vector path (a multiple of 16) and the portable loop
def test_native_decode_attention_reads_heads_that_are_not_adjacent(dtype, head_dim):
    """K/V views whose heads lie farther apart than D (a row holds other data between them), in fp32 and bf16."""
    generator = torch.Generator().manual_seed(head_dim)
    num_rows, b, L, Hq, Hkv = 40, 3, 19, 4, 2
    data = torch.randn(2, num_rows, Hkv, 2 * head_dim, generator=generator).to(dtype)
    k_rows, v_rows = data[0, :, :, :head_dim], data[1, :, :, head_dim:]  # head stride 2D, row stride 2 Hkv D
    lengths = torch.tensor([19, 5, 1])
    key_rows = torch.randint(0, num_rows, (b, L), generator=generator)
    q = torch.randn(b, Hq, head_dim, generator=generator).to(dtype)
    expected = reference_decode(q.float(), k_rows.float(), v_rows.float(), key_rows, lengths, 0.2)
    out = native.paged_decode_attention(q, k_rows, v_rows, key_rows, lengths, 0.2)
    if dtype == torch.float32:
        assert_close(out, expected)
    else:
        torch.testing.assert_close(out.float(), expected, rtol=2 ** -7, atol=2 ** -7)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("norm", "rotary"), [(True, 16), (True, 0), (False, 16), (True, 10)])
def test_native_norm_and_rope_equal_the_torch_ops(norm, rotary, dtype):
    """fp32 to round-off; bf16 rounded where each torch op rounds, so an element differs only where the fp32 sum of
    squares, taken in another order, crosses a bf16 rounding (rare, and then by a step or two of the last bit)."""
    generator = torch.Generator().manual_seed(rotary)
    T, q_heads, k_heads, v_heads, D = 5, 4, 2, 2, 16
    heads = (torch.randn(T, q_heads + k_heads + v_heads, D, generator=generator) * 3).to(dtype)
    qk = heads[:, : q_heads + k_heads]  # a strided view, as the fused projection's
    q_weight, k_weight = torch.randn(2, D, generator=generator).to(dtype).unbind(0)
    expected = qk
    if norm:
        expected = rms_normalize(qk, 1e-6)
        expected[:, :q_heads] *= q_weight
        expected[:, q_heads:] *= k_weight
    rope = None
    if rotary:
        rope = rope_tables(torch.tensor([0, 3, 7, 100, 5000]), rotary, 10000.0, dtype)
        expected = apply_rope(expected, rope)
    out = native.rms_norm_rope(qk, 1e-6 if norm else None, (q_weight, k_weight), q_heads, rope)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert_close(out, expected)
    else:
        assert (out != expected).float().mean() < 0.02
        assert bool(((out.float() - expected.float()).abs() <= expected.float().abs() * 2 ** -6 + 1e-30).all())
        if not norm:  # no sum of squares: every rounding is torch's
            assert torch.equal(out, expected)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm_add_forward_is_the_add_then_the_norm(dtype, zero_centered, monkeypatch):
    """vLLM's fused_add_rms_norm: the same bits as the residual add and then the norm, the sum written into the
    residual's memory; with autograd on, the torch ops (and the residual untouched)."""
    recorded = count_calls(monkeypatch, "rms_norm")
    norm = RMSNorm(48, 1e-6, zero_centered)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48) * 0.5)
    norm = norm.to(dtype)
    x, residual = (torch.randn(7, 48) * 3).to(dtype), (torch.randn(7, 48) * 3).to(dtype)
    with torch.inference_mode():
        expected_sum = x + residual
        expected = norm(expected_sum)
        running = residual.clone()
        normed, total = norm.add_forward(x, running)
    assert any(kwargs.get("residual") is not None for kwargs in recorded["rms_norm"])
    assert total.data_ptr() == running.data_ptr() and torch.equal(total, expected_sum)
    if dtype == torch.float32:
        assert_close(normed, expected)
    else:  # the fp32 sum of squares in another order may cross a bf16 rounding, rarely
        assert (normed != expected).float().mean() < 0.02
    kept = residual.clone()
    normed, total = norm.add_forward(x.clone().requires_grad_(), kept)
    assert torch.equal(kept, residual) and torch.equal(total.detach(), expected_sum)


@needs_native
def test_native_rms_norm_refuses_a_residual_of_another_shape():
    with pytest.raises(ValueError, match="residual must be a contiguous CPU"):
        native.rms_norm(torch.randn(3, 8), 1e-6, torch.ones(8), False, residual=torch.zeros(3, 4))


@needs_native
def test_rmsnorm_takes_the_native_kernel_and_equals_the_torch_ops():
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x = torch.randn(7, 48) * 5
    with torch.no_grad():
        assert_close(norm(x), norm.weight * rms_normalize(x, 1e-5))
    assert norm(x).requires_grad  # with autograd on, the torch ops run


@needs_native
def test_native_decode_attention_returns_the_split_merges_log_sum_exp():
    generator = torch.Generator().manual_seed(11)
    b, L, heads, kv_heads, head_dim = 4, 12, 6, 2, 16
    k_rows, v_rows = torch.randn(2, 60, kv_heads, head_dim, generator=generator).unbind(0)
    key_rows = torch.randint(0, 60, (b, L), generator=generator)
    lengths = torch.tensor([12, 0, 5, 1])  # a sequence with no key in this range: lse = -inf, output 0
    q = torch.randn(b, heads, head_dim, generator=generator)
    lse = torch.empty(b, heads)
    out = native.paged_decode_attention(q, k_rows, v_rows, key_rows, lengths, 0.2, lse=lse)
    keys, values = gather_kv(k_rows, v_rows, key_rows.flatten(), b, L)
    expected_out, expected_lse = cpu_partial_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                                       0.2, length_mask(lengths, L))
    assert_close(out, expected_out[:, :, 0])
    assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse[:, :, 0]))
    finite = torch.isfinite(expected_lse[:, :, 0])
    assert_close(lse[finite], expected_lse[:, :, 0][finite])


@needs_native
def test_the_split_backend_attends_host_blocks_in_place_at_decode(tiny_checkpoint, monkeypatch):
    recorded = count_calls(monkeypatch, "paged_decode_attention")
    engine = Engine(tiny_checkpoint("qwen3_moe"), kv_cache_memory=PAGE_BYTES, kv_host_memory=2**20,
                    split_policy="cpu-all",
                    page_bytes=PAGE_BYTES, block_size=4)
    engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 5, 6, 7]], 6)
    calls = [kwargs.get("lse") is not None for kwargs in recorded["paged_decode_attention"]]
    assert any(calls), "decode partials over host blocks went to the native kernel, with the log-sum-exp"


@needs_native
def test_native_decode_attention_writes_each_new_token_into_its_slot_first():
    generator = torch.Generator().manual_seed(3)
    b, L, heads, kv_heads, head_dim = 3, 9, 4, 2, 16
    k_rows, v_rows = torch.randn(2, 40, kv_heads, head_dim, generator=generator).unbind(0)
    key_rows = torch.randperm(40, generator=generator)[: b * L].view(b, L)  # distinct slots
    lengths = torch.tensor([9, 4, 1])
    q, k_new, v_new = torch.randn(3, b, heads, head_dim, generator=generator).unbind(0)
    k_new, v_new = k_new[:, :kv_heads], v_new[:, :kv_heads]
    expected_k, expected_v = k_rows.clone(), v_rows.clone()
    last = key_rows[torch.arange(b), lengths - 1]
    expected_k[last], expected_v[last] = k_new, v_new
    expected = reference_decode(q, expected_k, expected_v, key_rows, lengths, 0.25)
    out = native.paged_decode_attention(q, k_rows, v_rows, key_rows, lengths, 0.25, new_kv=(k_new, v_new))
    assert_close(out, expected)
    assert torch.equal(k_rows, expected_k) and torch.equal(v_rows, expected_v)  # only the new slots changed


@needs_native
def test_native_decode_attention_reads_no_row_past_a_sequence_length():
    k_rows, v_rows = torch.full((2, 10, 1, 8), float("nan")).unbind(0)
    k_rows[:3], v_rows[:3] = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    key_rows = torch.tensor([[0, 1, 9, 9], [2, 9, 9, 9]])  # rows past each length point at NaN rows
    out = native.paged_decode_attention(torch.randn(2, 2, 8), k_rows, v_rows, key_rows, torch.tensor([2, 1]), 1.0)
    assert torch.isfinite(out).all()
    assert_close(out[1], v_rows[2].expand(2, 8))  # one key: the output is its value


@needs_native
def test_the_engine_takes_the_native_kernels_at_decode(tiny_checkpoint, monkeypatch):
    """Its two MoE layers' experts in one call with their router (``run_moe``: every expert resident, the
    prefill too), each of its three layers' decode attention op by op (o_proj's 64 outputs go to torch, so not in
    ``run_attention``, nor the whole stack in ``run_layers``), over the three decode steps."""
    recorded = count_calls(monkeypatch, "run_moe", "moe_experts", "paged_decode_attention", "run_attention",
                           "run_layers")
    Engine(tiny_checkpoint("qwen3_moe"), kv_cache_memory=4 * 2**20).generate([[1, 2, 3], [4, 5, 6, 7]], 4)
    calls = {name: len(kwargs) for name, kwargs in recorded.items()}
    assert calls == {"run_moe": 2 * 4, "moe_experts": 0, "paged_decode_attention": 3 * 3, "run_attention": 0,
                     "run_layers": 0}


def test_without_a_compiler_the_reason_is_kept(native_env, tmp_path):
    native_env(CC=str(tmp_path / "no-such-cc"), MOETIDE_NATIVE_DIR=str(tmp_path))
    assert not native.available()
    assert "no C compiler" in native.unavailable_reason()
    assert not native.worth_it(torch.ones(2), 1)


def test_disabled_native_kernels_leave_the_torch_paths(without_native):
    assert not native.available() and native.unavailable_reason() == "disabled by MOETIDE_NATIVE=0"


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_without_native_kernels_a_tight_budget_still_matches_transformers(arch, tiny_checkpoint, hf_reference,
                                                                           without_native):
    engine = Engine(tiny_checkpoint(arch), kv_cache_memory=STATIC_PAGES[arch] * PAGE_BYTES, max_offload_ratio=0.25,
                    static_offload=True, **TIGHT)
    result = engine.generate(parity_prompts(), MAX_TOKENS)
    assert [o.token_ids for o in result.outputs] == hf_reference(arch)
    assert result.stats.preemptions > 0 and result.stats.experts_offloaded > 0
    check_books(engine)


def test_native_kernels_refuse_views_they_cannot_read():
    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    gate_up = torch.zeros(4, 8, 6).transpose(1, 2)  # columns not unit-stride
    with pytest.raises(ValueError, match="packed rows"):
        native.moe_experts(torch.zeros(1, 8), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), gate_up,
                           torch.zeros(4, 8, 3))
    k_rows = torch.zeros(4, 1, 8, dtype=torch.bfloat16)  # raw memory of another dtype is refused, never misread
    with pytest.raises(ValueError, match="fp32 CPU tensors"):
        native.paged_decode_attention(torch.zeros(1, 1, 8), k_rows, k_rows, torch.zeros(1, 2, dtype=torch.long),
                                      torch.ones(1, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        native.rms_norm_rope(torch.zeros(2, 1, 8, dtype=torch.bfloat16), 1e-6, (torch.ones(8), None))
    k_rows = torch.zeros(4, 1, 8)  # indices past the views would read or write outside them: refused
    with pytest.raises(ValueError, match=r"key_rows must lie in \[0, 4\)"):
        native.paged_decode_attention(torch.zeros(1, 1, 8), k_rows, k_rows, torch.tensor([[0, 4]]),
                                      torch.tensor([2]), 1.0)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, 2\]"):
        native.paged_decode_attention(torch.zeros(1, 1, 8), k_rows, k_rows, torch.tensor([[0, 1]]),
                                      torch.tensor([3]), 1.0)
    gate_up, down = strided_experts(torch.Generator().manual_seed(0), 4, 8, 2)
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 4\)"):
        native.moe_experts(torch.zeros(1, 8), torch.ones(1, 1), torch.tensor([[4]]), gate_up, down)
    short_v = torch.zeros(3, 1, 8)  # a row valid in K but not in V is refused too
    with pytest.raises(ValueError, match=r"key_rows must lie in \[0, 3\)"):
        native.paged_decode_attention(torch.zeros(1, 1, 8), k_rows, short_v, torch.tensor([[3]]), torch.tensor([1]),
                                      1.0)
    with pytest.raises(ValueError, match="head dim"):  # q's head dim must be the rows'
        native.paged_decode_attention(torch.zeros(1, 1, 16), k_rows, k_rows, torch.tensor([[0]]), torch.tensor([1]),
                                      1.0)
    with pytest.raises(ValueError, match="weights must be"):
        native.rms_norm_rope(torch.zeros(2, 1, 8), 1e-6, (torch.ones(4), None))


@needs_native
def test_native_paths_fall_back_to_torch_for_layouts_they_cannot_read():
    norm = RMSNorm(8, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x = torch.randn(8, 4).t()  # rows not contiguous
    with torch.inference_mode():
        assert_close(norm(x), norm.weight * rms_normalize(x, 1e-6))
    gate_up = torch.zeros(4, 8, 6).transpose(1, 2)
    assert not native.experts_readable(gate_up, torch.zeros(4, 8, 3))


@needs_native
def test_a_native_library_another_user_could_write_is_not_loaded(native_env, tmp_path):
    native_env(MOETIDE_NATIVE_DIR=str(tmp_path))
    assert native.available()
    (library,) = tmp_path.glob("moetide_kernels_*.so")
    library.chmod(0o777)
    native.load.cache_clear()
    loaded = native.load()  # it builds another (the next flag set) rather than load the writable one
    assert loaded is None or Path(loaded._name) != library


@needs_native
@pytest.mark.parametrize(("num_experts", "top_k"), [(16, 2), (8, 2), (512, 10), (4, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_native_route_equals_softmax_and_topk(num_experts, top_k, renormalize):
    generator = torch.Generator().manual_seed(num_experts + top_k)
    logits = torch.randn(33, num_experts, generator=generator) * 3
    for rows in (logits, logits.to(torch.bfloat16)):
        probs = torch.softmax(rows, dim=-1, dtype=torch.float32)
        expected_weights, expected_ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            expected_weights = expected_weights / expected_weights.sum(dim=-1, keepdim=True)
        weights, ids = native.moe_route(rows, top_k, renormalize)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int64
        assert_close(weights, expected_weights)
        if rows.dtype == torch.float32:  # bf16 logits tie, and of tied experts torch.topk's order is its own
            assert torch.equal(ids, expected_ids)
        else:
            assert torch.equal(probs.gather(1, ids), probs.gather(1, expected_ids))
    with pytest.raises(ValueError, match="top_k 0 must lie"):
        native.moe_route(logits, 0, True)


@needs_native
def test_sparse_moe_routes_fp32_natively_and_bf16_through_torch(monkeypatch):
    recorded = count_calls(monkeypatch, "moe_route")
    config = type("Config", (), dict(num_experts_per_tok=2, hidden_size=16, num_experts=8, moe_intermediate_size=8))
    block = moe.SparseMoE(config, 0, norm_topk_prob=True, cast_weights=True)
    with torch.no_grad():
        block.gate.weight.normal_()
    x = torch.randn(5, 16)
    with torch.inference_mode():
        weights, ids = block.route(x)
        assert len(recorded["moe_route"]) == 1
        probs = torch.softmax(x @ block.gate.weight.T, dim=-1)
        expected_weights, expected_ids = torch.topk(probs, 2, dim=-1)
        assert torch.equal(ids, expected_ids)
        assert_close(weights, expected_weights / expected_weights.sum(dim=-1, keepdim=True))
        block.to(torch.bfloat16).route(x.to(torch.bfloat16))
        assert len(recorded["moe_route"]) == 1
