"""The engine's fast paths against their references: the grouped and single-token expert paths against the
per-expert loop (same bits), the arena's stacked expert views and when the provider withholds them (a routed
expert is staged), paged attention whose padding slots hold NaN bytes, the RoPE cache against per-step tables,
and the fused q/k/v projection against the checkpoint's three tensors.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from moetide.engine.loader import load_model  # noqa: E402
from moetide.engine.models import ExpertProvider, ExpertWeights, StepBatch, causal_attention  # noqa: E402
from moetide.engine.models.norm_rope import RopeCache, rope_tables  # noqa: E402
from moetide.engine.models.moe import grouped_experts, looped_experts, single_token_experts  # noqa: E402
from moetide.engine.runner import Engine  # noqa: E402
from engine_parity import BLOCK_SIZE, PAGE_BYTES  # noqa: E402


class StackedExperts(ExpertProvider):
    """An ExpertProvider over stacked [E, ...] weights that are strided like the arena's (padding between
    experts), serving expert by expert (so the MoE block takes the loop)."""

    def __init__(self, gate_up, down) -> None:
        self.gate_up, self.down = gate_up, down

    def route(self, layer_id, expert_ids) -> None:
        return None

    def expert_weights(self, layer_id, expert_id) -> ExpertWeights:
        return ExpertWeights(self.gate_up[expert_id], self.down[expert_id])


def strided_experts(generator, num_experts, hidden, inter):
    """gate_up [E, 2I, H] and down [E, H, I] as views into one buffer with a gap after every expert."""
    stride = 3 * inter * hidden + 64
    buffer = torch.randn(num_experts * stride, generator=generator)
    gate_up = buffer.as_strided((num_experts, 2 * inter, hidden), (stride, hidden, 1))
    down = buffer.as_strided((num_experts, hidden, inter), (stride, inter, 1), 2 * inter * hidden)
    return gate_up, down


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 40])
def test_grouped_and_single_token_experts_give_the_loops_bits(num_tokens, torch_one_thread):
    generator = torch.Generator().manual_seed(num_tokens)
    num_experts, hidden, inter, top_k = 8, 32, 16, 3
    gate_up, down = strided_experts(generator, num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, generator=generator)
    expert_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=generator)
    looped = looped_experts(x, weights, expert_ids, StackedExperts(gate_up, down), layer_id=0)
    assert torch.equal(grouped_experts(x, weights, expert_ids, gate_up, down), looped)
    if num_tokens == 1:
        assert torch.equal(single_token_experts(x, weights, expert_ids, gate_up, down), looped)


def test_stacked_views_are_withheld_while_a_routed_expert_is_staged(mixtral_engine):
    engine = mixtral_engine
    provider, storage = engine.parts.experts, engine.storage
    gate_up, down = provider.stacked_weights(0)
    for e in range(gate_up.shape[0]):
        resident = storage.expert_weights(0, e)
        assert torch.equal(gate_up[e], resident.gate_up) and torch.equal(down[e], resident.down)
    engine.parts.expert_line.offload(((0, 1),))
    provider.route(0, torch.tensor([[0, 2]]))  # the offloaded expert is not routed: nothing staged
    assert provider.stacked_weights(0) is not None and provider.stager.num_staged == 0
    provider.route(0, torch.tensor([[1, 3]]))
    assert provider.stacked_weights(0) is None, "expert 1 lives in the staging buffer, not in its home pages"
    assert provider.stager.num_staged == 1
    provider.route(1, torch.tensor([[1, 3]]))  # layer 1 has nothing offloaded
    assert provider.stacked_weights(1) is not None


def test_padding_slots_holding_nan_bytes_never_reach_the_output(tiny_checkpoint):
    """Every KV byte starts as 0xFF (a NaN pattern, as recycled pages may hold); three sequences prefill, then
    decode together, padded to the longest context: each output equals the reference and is finite."""
    engine = Engine(tiny_checkpoint("mixtral"), kv_cache_memory=8 * PAGE_BYTES, page_bytes=PAGE_BYTES,
                    block_size=BLOCK_SIZE, ignore_eos=True)
    storage, backend, layout = engine.storage, engine.parts.attention, engine.storage.kv_layout
    ids = storage.arena.kv_block_ids()
    for block in ids:
        storage.kv_block(block).fill_(0xFF)
    tables = [[ids[0]], [ids[1], ids[2]], [ids[3], ids[4], ids[5]]]
    lengths, generator = [2, 5, 9], torch.Generator().manual_seed(4)
    hq, hkv, d, layer = 4, layout.num_kv_heads, layout.head_dim, layout.attn_layer_ids[0]
    history = []
    for entries in ([(i, n, 0) for i, n in enumerate(lengths)], [(i, 1, n) for i, n in enumerate(lengths)]):
        batch = StepBatch.of(entries)
        backend.prepare(batch, tables)
        t = batch.num_tokens
        q, k, v = (torch.randn(t, h, d, generator=generator) for h in (hq, hkv, hkv))
        out = backend.attend(layer, q, k, v, batch, d**-0.5)
        history.append((batch, k, v))
    assert torch.isfinite(out).all()
    for i, n in enumerate(lengths):
        keys = torch.cat([history[0][1][history[0][0].token_slices()[i]], k[i : i + 1]])
        values = torch.cat([history[0][2][history[0][0].token_slices()[i]], v[i : i + 1]])
        torch.testing.assert_close(out[i : i + 1], causal_attention(q[i : i + 1], keys, values, d**-0.5, n),
                                   rtol=1e-5, atol=1e-6)


def test_rope_cache_regrows_and_matches_per_step_tables():
    cache = RopeCache(rotary_dim=16, theta=10_000.0)
    for positions in ([0, 5, 255], [3, 700, 40], [1999, 0]):
        index = torch.tensor(positions)
        cos, sin = cache.lookup(index, max(positions), torch.float32)
        want_cos, want_sin = rope_tables(index, 16, 10_000.0, torch.float32)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_fused_qkv_holds_the_checkpoints_three_projections(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    attention = load_model(path).layers[2].self_attn
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        want = torch.cat([f.get_tensor(f"model.layers.2.self_attn.{p}_proj.weight") for p in "qkv"])
    assert torch.equal(attention.qkv_proj.weight.detach(), want)
