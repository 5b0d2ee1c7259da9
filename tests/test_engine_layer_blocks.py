"""A decoder layer's halves in one native call each (``native.run_attention``, ``native.run_moe``), and every
layer of a step in one (``native.run_layers``): the attention half and the whole stack give the op-by-op native
path's bits (the arena's KV bytes and the tokens after a run, fp32 and bf16) and announce the same routing, the MoE
half equals the router then the experts; when the engine takes them (a decode step, every expert of the layer
resident) and when not (an expert offloaded, the reference backend); greedy tokens still equal transformers'; bad
key rows refused with nothing written.
"""

from __future__ import annotations

import contextlib
import io

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moetide.engine import native  # noqa: E402
from moetide.engine.models import ContiguousKVCache, DecodeRows  # noqa: E402
from moetide.engine.models import common, moe  # noqa: E402
from moetide.engine.experts import StagedExpertProvider  # noqa: E402
from moetide.engine.runner import Engine  # noqa: E402
from moetide.engine.sampling import SamplingParams  # noqa: E402
from moetide.engine.testmodel import TinyModelArgs, make_test_model  # noqa: E402
from engine_parity import greedy_reference  # noqa: E402
from test_engine_native import assert_close, count_calls  # noqa: E402
from test_engine_step_paths import strided_experts  # noqa: E402

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")

# hidden 128: o_proj has 128 outputs, so in fp32 both projections take the native kernel (``models.ops``)
WIDE = dict(hidden_size=128, num_layers=2, num_attention_heads=4, num_kv_heads=2, head_dim=32, num_experts=4,
            moe_intermediate_size=32, vocab_size=512)
PROMPTS = [[5, 17, 33, 2, 9], [100, 3], [7] * 11, [450, 1, 4, 4, 8, 16, 32]]


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory, torch_one_thread):
    built = {}

    def get(arch: str, dtype: str = "float32"):
        if (arch, dtype) not in built:
            with contextlib.redirect_stderr(io.StringIO()):
                built[arch, dtype] = make_test_model(TinyModelArgs(arch=arch, dtype=dtype, **WIDE),
                                                     tmp_path_factory.mktemp(f"{arch}-{dtype}"))
        return built[arch, dtype]

    return get


def run(checkpoint, **engine_args):
    """(tokens, the arena's bytes) after the prompts decode 12 tokens together."""
    engine = Engine(checkpoint, kv_cache_memory=4 * 2**20, ignore_eos=True, **engine_args)
    tokens = [o.token_ids for o in engine.generate(PROMPTS, 12).outputs]
    return tokens, engine.storage.data.clone()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_layer_blocks_give_the_op_by_op_bits(arch, dtype, wide_checkpoint, monkeypatch):
    """Every layer's K/V of every step lands in the arena: equal bytes there mean every layer's attention half
    (and what fed it) gave the same bits as the native kernels called one by one. fp32 runs the whole stack as
    one call a step, bf16 (whose MoE half is not fused) the attention halves one by one; then each path is
    switched off in turn."""
    checkpoint = wide_checkpoint(arch, dtype)
    routed = []
    original_route = StagedExpertProvider.route
    monkeypatch.setattr(StagedExpertProvider, "route", lambda self, layer, ids: (
        routed.append((layer, ids.tolist())) or original_route(self, layer, ids)))
    recorded = count_calls(monkeypatch, "run_layers", "run_attention")
    results = [run(checkpoint)]
    stacked = dtype == "float32"
    assert len(recorded["run_layers"]) == (11 if stacked else 0)  # every decode step after the prefill's
    assert len(recorded["run_attention"]) == (0 if stacked else 2 * 11)
    routings = [list(routed)]
    monkeypatch.setattr(common.MoECausalLM, "decode_layers", lambda *args: None)
    results.append(run(checkpoint))
    assert len(recorded["run_attention"]) == (2 * 11 if stacked else 4 * 11)
    routings.append(routed[len(routings[0]):])
    monkeypatch.setattr(common.DecoderLayer, "attention_block", lambda *args: None)
    results.append(run(checkpoint))
    for tokens, arena in results[1:]:
        assert tokens == results[0][0]
        assert torch.equal(arena, results[0][1])
    assert routings[0] == routings[1] and len(routings[0]) == 2 * 12  # both layers, every step


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_with_both_blocks_greedy_tokens_equal_transformers(arch, wide_checkpoint, monkeypatch):
    import transformers

    transformers.logging.set_verbosity_error()
    checkpoint = wide_checkpoint(arch)
    recorded = count_calls(monkeypatch, "run_layers")
    tokens, _ = run(checkpoint)
    assert recorded["run_layers"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    assert tokens == greedy_reference(lambda _: hf, PROMPTS, 12)(arch)


def test_the_moe_block_equals_the_router_then_the_experts(torch_one_thread):
    generator = torch.Generator().manual_seed(3)
    gate_up, down = strided_experts(generator, 8, 32, 16)
    gate = torch.randn(8, 32, generator=generator)
    x = torch.randn(19, 32, generator=generator)
    for renormalize in (False, True):
        weights, ids = native.moe_route(x @ gate.T, 2, renormalize)
        out, block_ids = native.run_moe(native.moe_args(32, gate, 2, renormalize, gate_up, down), x)
        assert torch.equal(block_ids, ids)
        assert_close(out, native.moe_experts(x, weights, ids, gate_up, down))
    with pytest.raises(ValueError, match="top_k 9 must lie"):
        native.moe_args(32, gate, 9, True, gate_up, down)
    with pytest.raises(ValueError, match=r"contiguous \[8, 32\]"):
        native.moe_args(32, gate[:4], 2, True, gate_up, down)


def test_the_moe_block_announces_the_routing_it_ran(torch_one_thread):
    """``route`` still hears every layer's routing, after the experts ran (only where they are all resident)."""
    config = type("Config", (), dict(num_experts_per_tok=2, hidden_size=32, num_experts=8, moe_intermediate_size=16))
    block = moe.SparseMoE(config, 3, norm_topk_prob=False, cast_weights=True)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))

    class Resident(moe.ExpertProvider):
        def __init__(self, resident: bool) -> None:
            self.resident, self.routed = resident, []

        def route(self, layer_id, expert_ids):
            self.routed.append((layer_id, expert_ids.clone()))

        def expert_weights(self, layer_id, expert_id):
            return moe.ExpertWeights(block.experts.gate_up_proj[expert_id], block.experts.down_proj[expert_id])

        def stacked_weights(self, layer_id):
            return block.experts.gate_up_proj, block.experts.down_proj

        def resident_weights(self, layer_id):
            return self.stacked_weights(layer_id) if self.resident else None

    x = torch.randn(6, 32, generator=generator)
    with torch.inference_mode():
        fused, announced = Resident(True), Resident(False)
        out = block(x, fused)
        expected = block(x, announced)
    assert_close(out, expected)
    assert [layer for layer, _ in fused.routed] == [3]
    assert torch.equal(fused.routed[0][1], announced.routed[0][1])


def test_an_offloaded_expert_keeps_its_layer_on_the_announced_path(wide_checkpoint, monkeypatch):
    engine = Engine(wide_checkpoint("mixtral"), kv_cache_memory=4 * 2**20, ignore_eos=True, max_offload_ratio=0.5)
    engine.parts.expert_line.offload(((0, 1),))
    assert engine.parts.experts.resident_weights(0) is None
    assert engine.parts.experts.resident_weights(1) is not None
    seen = []
    original = moe.SparseMoE.native_block

    def spy(self, x, experts):
        out = original(self, x, experts)
        seen.append((self.layer_id, out is not None))
        return out

    monkeypatch.setattr(moe.SparseMoE, "native_block", spy)
    engine.generate(PROMPTS, 4)
    assert {layer for layer, fused in seen if fused} == {1}
    assert {layer for layer, fused in seen if not fused} == {0}


def test_the_reference_cache_hands_out_no_rows():
    """A backend that must see ``attend`` (the reference cache; the split backend) keeps the default."""
    assert ContiguousKVCache().decode_rows(0, 4, torch.zeros(1)) is None


def test_the_attention_block_refuses_rows_outside_the_cache_and_writes_nothing(torch_one_thread):
    generator = torch.Generator().manual_seed(5)
    T, H, Hq, Hkv, D = 2, 32, 4, 2, 16
    k_rows, v_rows = torch.zeros(2, 8, Hkv, D).unbind(0)
    residual, x = torch.randn(2, T, H, generator=generator).unbind(0)
    before = residual.clone()
    rope = (torch.ones(T, D), torch.zeros(T, D))
    norm = (torch.ones(H), 1e-6)
    qkv, o = torch.randn((Hq + 2 * Hkv) * D, H, generator=generator), torch.randn(H, Hq * D, generator=generator)
    rows = DecodeRows(k_rows, v_rows, torch.tensor([[0, 1], [2, 8]]), torch.tensor([2, 2]))

    def attention_half(qkv):
        weights = native.attention_weights(H, torch.float32, norm, qkv, Hq, None, 0.25, o, norm, k_rows, v_rows)
        return native.attention_step(weights, rope, rows)

    with pytest.raises(ValueError, match=r"key_rows must lie in \[0, 8\)"):
        native.run_attention(attention_half(qkv), x, residual)
    assert torch.equal(residual, before) and not k_rows.any() and not v_rows.any()
    with pytest.raises(ValueError, match="shapes disagree"):
        attention_half(qkv[:-1])


def test_the_stack_refuses_rows_outside_the_cache_before_any_layer_runs(torch_one_thread):
    """A bad key row in the last layer's rows: the first layer's K/V and the residual are not touched either."""
    generator = torch.Generator().manual_seed(6)
    T, H, Hq, Hkv, D, E = 2, 32, 4, 2, 16, 4
    caches = [torch.zeros(2, 8, Hkv, D).unbind(0) for _ in range(2)]
    residual = torch.randn(T, H, generator=generator)
    before = residual.clone()
    rope, norm = (torch.ones(T, D), torch.zeros(T, D)), (torch.ones(H), 1e-6)
    qkv, o = torch.randn((Hq + 2 * Hkv) * D, H, generator=generator), torch.randn(H, Hq * D, generator=generator)
    key_rows = [torch.tensor([[0, 1], [2, 3]]), torch.tensor([[0, 1], [2, 8]])]
    attention = [native.attention_step(native.attention_weights(H, torch.float32, norm, qkv, Hq, None, 0.25, o,
                                                                norm, k, v),
                                       rope, DecodeRows(k, v, rows, torch.tensor([2, 2])))
                 for (k, v), rows in zip(caches, key_rows)]
    gate_up, down = strided_experts(generator, E, H, 16)
    moe_halves = [native.moe_args(H, torch.randn(E, H, generator=generator), 2, True, gate_up, down)] * 2
    with pytest.raises(ValueError, match=r"key_rows must lie in \[0, 8\)"):
        native.run_layers(attention, moe_halves, None, residual)
    assert torch.equal(residual, before) and not any(c.any() for pair in caches for c in pair)
    wider = native.moe_args(H + 8, torch.randn(E, H + 8, generator=generator), 2, True,
                            *strided_experts(generator, E, H + 8, 16))
    with pytest.raises(ValueError, match="fp32 for the same tokens"):
        native.run_layers(attention, [moe_halves[0], wider], None, residual)


def test_a_layer_keeps_its_checked_weights_until_one_moves(wide_checkpoint):
    """``DecoderLayer.native_attention_args`` and ``SparseMoE.native_args`` check a layer once and keep the result;
    a weight that moves (a new tensor behind the parameter, or a new parameter) is checked again, so no stale
    pointer reaches the kernels, and the generations are unchanged by it."""
    engine = Engine(wide_checkpoint("qwen3_moe"), kv_cache_memory=4 * 2**20, ignore_eos=True)
    first = engine.generate(PROMPTS, 6)
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(6, 0.0))
    layer, attn = engine.parts.model.layers[0], engine.parts.model.layers[0].self_attn
    tokens = [engine.step() for _ in range(2)]  # the prefill, then a decode step, which keeps its checks
    kept, moe_kept = layer.native_weights, layer.mlp.native_weights
    assert kept is not None and kept.args is not None and moe_kept is not None and moe_kept.args is not None
    tokens.append(engine.step())
    assert layer.native_weights is kept and layer.mlp.native_weights is moe_kept
    with torch.no_grad():
        attn.qkv_proj.weight.data = attn.qkv_proj.weight.data.clone()
        layer.mlp.gate.weight.data = layer.mlp.gate.weight.data.clone()
    tokens.append(engine.step())
    assert layer.native_weights.args.qkv_w == attn.qkv_proj.weight.data_ptr() != kept.args.qkv_w
    assert layer.mlp.native_weights.args.gate_w == layer.mlp.gate.weight.data_ptr() != moe_kept.args.gate_w
    kept, moe_kept = layer.native_weights, layer.mlp.native_weights
    attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight.detach().clone(), requires_grad=False)
    layer.mlp.gate.weight = torch.nn.Parameter(layer.mlp.gate.weight.detach().clone(), requires_grad=False)
    tokens.append(engine.step())
    assert layer.native_weights.args.o_w == attn.o_proj.weight.data_ptr() != kept.args.o_w
    assert layer.mlp.native_weights.args.gate_w == layer.mlp.gate.weight.data_ptr() != moe_kept.args.gate_w
    while engine.has_unfinished_requests():
        tokens.append(engine.step())
    emitted: dict[str, list[int]] = {}
    for step in tokens:
        for out in step:
            emitted.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert list(emitted.values()) == [o.token_ids for o in first.outputs]


def test_a_kept_check_follows_what_it_read():
    """``keep_checked`` runs its check again when its key, a live tensor, grad mode or a module's registrations
    change, and returns the kept record otherwise; a layer that does not take the native half is kept as None."""

    class Owner:
        native_weights = None

    owner, calls = Owner(), []
    weight = torch.ones(4)
    moe = native.moe_args(2, torch.ones(2, 2), 1, False, *strided_experts(torch.Generator().manual_seed(0), 2, 2, 4))

    def check():
        calls.append(1)
        return moe

    live = (weight,)
    with torch.inference_mode():
        assert native.keep_checked(owner, (1,), live, check) is moe
        assert native.keep_checked(owner, (1,), live, check) is moe and len(calls) == 1
        native.keep_checked(owner, (2,), live, check)
        assert len(calls) == 2
        native.keep_checked(owner, (2,), (weight.clone(),), check)
        assert len(calls) == 3
        torch.nn.Linear(2, 2)  # registers parameters: any module may have changed
        native.keep_checked(owner, (2,), owner.native_weights.live, check)
        assert len(calls) == 4
    native.keep_checked(owner, (2,), owner.native_weights.live, check)  # grad mode on again
    assert len(calls) == 5
    none_owner = Owner()
    assert native.keep_checked(none_owner, (), (), lambda: calls.append(1)) is None
    assert native.keep_checked(none_owner, (), (), lambda: calls.append(1)) is None and len(calls) == 6
