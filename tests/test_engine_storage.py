"""The arena tensor, paged attention over it, block-backed linear state, expert staging and the expert line.

Pins the byte layout (a block's K/V where ``core.arena`` says the block is), that paged attention equals the
reference causal attention for any block placement (including a prefix hit on a block written in the same step),
and that converting experts to KV moves no resident KV byte and keeps every offloaded expert servable.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moetide.engine.loader import load_model  # noqa: E402
from moetide.engine.models import StepBatch, causal_attention  # noqa: E402
from moetide.engine.runner import Engine  # noqa: E402
from moetide.engine.models import StateLayout  # noqa: E402
from moetide.engine import native  # noqa: E402
from moetide.engine.storage import ExpertLayout, default_page_bytes, host_zeros, pack_experts  # noqa: E402
from engine_parity import BLOCK_SIZE, PAGE_BYTES  # noqa: E402


def rand(generator, *shape):
    return torch.randn(*shape, generator=generator)


def test_default_page_bytes_fits_one_expert_up_to_two_mib():
    assert default_page_bytes(24 * 1024) == 32 * 1024
    assert default_page_bytes(100) == 4096
    assert default_page_bytes(50 * 1024 * 1024) == 2 * 1024 * 1024


@pytest.mark.parametrize("nbytes", [0, 4096, 9 << 20])
def test_host_zeros_is_a_zeroed_writable_tensor_from_its_first_byte(nbytes):
    """The arena's CPU memory (a huge-page-advised mapping when large): zeros, storage offset 0 (the arena's views
    give absolute storage offsets), and writes land where a view of it reads them."""
    data = host_zeros(nbytes)
    assert data.dtype == torch.uint8 and data.shape == (nbytes,) and data.storage_offset() == 0
    assert int(data.count_nonzero()) == 0
    if nbytes:
        data[nbytes - 1] = 9
        assert int(data.as_strided((1,), (1,), storage_offset=nbytes - 1)) == 9


def test_a_blocks_kv_lives_where_the_arena_puts_the_block(mixtral_engine):
    storage, backend = mixtral_engine.storage, mixtral_engine.parts.attention
    layout, arena = storage.kv_layout, storage.arena
    ids = arena.kv_block_ids()
    table = [ids[5], ids[2]]  # out of order on purpose
    generator = torch.Generator().manual_seed(0)
    batch = StepBatch.of([(0, 6, 0)])
    backend.prepare(batch, [table])
    k, v = rand(generator, 6, layout.num_kv_heads, layout.head_dim), rand(generator, 6, layout.num_kv_heads,
                                                                           layout.head_dim)
    q = rand(generator, 6, 2 * layout.num_kv_heads, layout.head_dim)
    backend.attend(layout.attn_layer_ids[1], q, k, v, batch, 0.25)
    for pos in range(6):
        block = table[pos // BLOCK_SIZE]
        start = arena.block_byte_offset(block)
        raw = storage.data[start : start + arena.config.kv_block_bytes].view(torch.float32)
        tiles = raw.view(len(layout.attn_layer_ids), 2, BLOCK_SIZE, layout.num_kv_heads, layout.head_dim)
        assert torch.equal(tiles[1, 0, pos % BLOCK_SIZE], k[pos])  # [layer][k|v][slot][head][dim]
        assert torch.equal(tiles[1, 1, pos % BLOCK_SIZE], v[pos])
        assert not tiles[0].any(), "layer 0 was not written"


def test_paged_attention_equals_causal_attention_with_a_same_step_prefix_hit(mixtral_engine):
    """Step 1: A prefills 6 tokens. Step 2: A decodes one token, B (new) hits A's first block — registered and
    written in this very step by C, a copy of A's prompt — and prefills 3 more; C prefills 5."""
    backend, layout = mixtral_engine.parts.attention, mixtral_engine.storage.kv_layout
    ids = mixtral_engine.storage.arena.kv_block_ids()
    tables = {"A": [ids[7], ids[3]], "C": [ids[0], ids[9]], "B": [ids[0], ids[4]]}
    generator = torch.Generator().manual_seed(1)
    hq, hkv, d = 4, layout.num_kv_heads, layout.head_dim
    full_k, full_v = {}, {}

    def step(entries):
        batch = StepBatch.of([(i, n, c) for i, (_, n, c) in enumerate(entries)])
        backend.prepare(batch, [tables[name] for name, _, _ in entries])
        t = batch.num_tokens
        q, k, v = rand(generator, t, hq, d), rand(generator, t, hkv, d), rand(generator, t, hkv, d)
        if entries[-1][0] == "C":  # C's first block is B's prefix hit: B's first 4 tokens are C's
            full_k["B"], full_v["B"] = k[-5:-1], v[-5:-1]
        out = backend.attend(layout.attn_layer_ids[0], q, k, v, batch, d**-0.5)
        for (name, n, c), sl in zip(entries, batch.token_slices()):
            keys = torch.cat([full_k.get(name, k[:0])[:c], k[sl]])
            values = torch.cat([full_v.get(name, v[:0])[:c], v[sl]])
            full_k[name], full_v[name] = keys, values
            torch.testing.assert_close(out[sl], causal_attention(q[sl], keys, values, d**-0.5, c),
                                       rtol=1e-5, atol=1e-6)

    step([("A", 6, 0)])
    step([("A", 1, 6), ("B", 3, 4), ("C", 5, 0)])


def test_expert_pages_hold_the_checkpoint_weights(mixtral_engine, tiny_checkpoint):
    model = load_model(tiny_checkpoint("mixtral"))
    for m, layer_id in enumerate(mixtral_engine.storage.expert_layout.moe_layer_ids):
        experts = model.layers[layer_id].mlp.experts
        for e in range(experts.gate_up_proj.shape[0]):
            weights = mixtral_engine.storage.expert_weights(m, e)
            assert torch.equal(weights.gate_up, experts.gate_up_proj[e])
            assert torch.equal(weights.down, experts.down_proj[e])
    assert mixtral_engine.parts.model.layers[0].mlp.experts.gate_up_proj.numel() == 0, "one copy on the device"


def test_converting_experts_to_kv_moves_no_resident_kv_byte(mixtral_engine, tiny_checkpoint):
    engine, generator = mixtral_engine, torch.Generator().manual_seed(2)
    storage, arena, pool = engine.storage, engine.storage.arena, engine.scheduler.kv.pool
    resident = arena.kv_block_ids()
    for block in resident:
        storage.kv_block(block).copy_(torch.randint(0, 256, (arena.config.kv_block_bytes,), generator=generator,
                                                    dtype=torch.uint8))
    before, snapshot = storage.kv_checksum(resident), [storage.kv_block(b).clone() for b in resident]
    kept_expert = storage.expert_flat(1, 0).clone()
    region = ((0, 1), (1, 2))
    new_ids = engine.parts.expert_line.offload(region)
    assert storage.kv_checksum(resident) == before
    assert all(torch.equal(storage.kv_block(b), s) for b, s in zip(resident, snapshot))
    assert new_ids and not set(new_ids) & set(resident) and set(new_ids) <= set(pool.block_ids())
    home = {p for key in region for p in arena.home_pages(*key)}
    assert all(set(arena.pages_of_block(b)) <= home for b in new_ids)
    assert engine.residency.all_offloaded() == list(region)
    # the new blocks are written as KV; the offloaded expert is still served, from its host copy
    for block in new_ids:
        storage.kv_block(block).fill_(0xFF)  # NaN patterns, as stale bytes may be
    model = load_model(tiny_checkpoint("mixtral"))
    provider = engine.parts.experts
    provider.route(0, torch.tensor([[1, 3]]))
    staged = provider.expert_weights(0, 1)
    assert torch.equal(staged.gate_up, model.layers[0].mlp.experts.gate_up_proj[1])
    assert torch.equal(staged.down, model.layers[0].mlp.experts.down_proj[1])
    assert provider.stager.num_staged == 1 and torch.equal(storage.expert_flat(1, 0), kept_expert)
    arena.check_invariants()


def test_offload_beyond_the_cap_changes_nothing(mixtral_engine):
    line, arena = mixtral_engine.parts.expert_line, mixtral_engine.storage.arena
    blocks = arena.kv_block_ids()
    with pytest.raises(ValueError, match="max_offload_ratio"):
        line.offload(tuple((m, e) for m in range(2) for e in range(3)))  # 6 of 8 experts > 50%
    assert arena.kv_block_ids() == blocks and mixtral_engine.residency.num_offloaded == 0
    assert not arena.converted_experts()


def test_a_fully_offloaded_layer_generates_like_a_resident_one(tiny_checkpoint):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    resident = Engine(tiny_checkpoint("mixtral"), kv_cache_memory=1 * 2**20, ignore_eos=True).generate(prompts, 8)
    engine = Engine(tiny_checkpoint("mixtral"), kv_cache_memory=1 * 2**20, ignore_eos=True, max_offload_ratio=0.5)
    engine.parts.expert_line.offload(tuple((0, e) for e in range(4)))  # every expert of layer 0 staged
    offloaded = engine.generate(prompts, 8)
    assert offloaded.outputs == resident.outputs
    assert engine.parts.experts.stager.num_staged >= 8 * 2  # at least the top-2 of every step
    assert engine.parts.experts.stager.num_slots == 4


def test_linear_state_survives_a_round_trip_through_scattered_blocks(tiny_checkpoint):
    engine = Engine(tiny_checkpoint("qwen3_next"), kv_cache_memory=2**20, block_size=BLOCK_SIZE,
                    page_bytes=PAGE_BYTES)
    store = engine.parts.linear_states
    layout, storage = store.layout, engine.storage
    assert store.num_blocks > 1, "the test needs a state spread over several blocks"
    ids = storage.arena.kv_block_ids()
    tables = [ids[1::2][: store.num_blocks], ids[0::2][: store.num_blocks][::-1]]
    batch = StepBatch.of([(10, 1, 3), (11, 1, 3)])
    generator = torch.Generator().manual_seed(3)
    written = {}
    store.prepare(batch, tables)
    for seq_id in (10, 11):
        for layer_id in layout.fields:
            state = store.state(layer_id, seq_id)
            written[(layer_id, seq_id)] = (rand(generator, *state.conv.shape), rand(generator, *state.recurrent.shape))
            state.conv.copy_(written[(layer_id, seq_id)][0])
            state.recurrent.copy_(written[(layer_id, seq_id)][1])
    store.commit()
    store.prepare(StepBatch.of([(11, 1, 4), (10, 1, 4)]), tables[::-1])
    for (layer_id, seq_id), (conv, recurrent) in written.items():
        state = store.state(layer_id, seq_id)
        assert torch.equal(state.conv, conv) and torch.equal(state.recurrent, recurrent)
    assert state.recurrent.dtype == torch.float32
    store.commit()


@pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.unavailable_reason()}")
def test_state_blocks_are_the_pool_blocks_until_a_layer_gathers_them(tiny_checkpoint):
    """In place, ``state_blocks`` gives each block's own address; once ``state`` has gathered the step's rows it
    points into that scratch, so bytes written through either are what the other reads and ``commit`` keeps."""
    import ctypes

    engine = Engine(tiny_checkpoint("qwen3_next"), kv_cache_memory=2**20, block_size=BLOCK_SIZE,
                    page_bytes=PAGE_BYTES)
    store, storage = engine.parts.linear_states, engine.storage
    ids = storage.arena.kv_block_ids()
    tables = [ids[1::2][: store.num_blocks], ids[0::2][: store.num_blocks][::-1]]
    layer_id = min(store.layout.fields)
    conv = store.layout.fields[layer_id][0]
    store.prepare(StepBatch.of([(10, 1, 3), (11, 1, 3)]), tables)
    blocks = store.state_blocks([11, 10])
    assert blocks.addresses.tolist() == [[storage.kv_block(b).data_ptr() for b in table] for table in tables[::-1]]
    ctypes.memset(int(blocks.addresses[0, 0]) + conv.offset, 0x3F, 2)  # sequence 11's first conv element, in place
    state = store.state(layer_id, 11)  # gathers
    assert state.conv.reshape(-1).view(torch.uint8)[:2].tolist() == [0x3F, 0x3F]
    gathered = store.state_blocks([11])
    assert int(gathered.addresses[0, 0]) + conv.offset == state.conv.data_ptr()
    ctypes.memset(int(gathered.addresses[0, 0]) + conv.offset + 2, 0x41, 2)  # through the scratch's address
    assert state.conv.reshape(-1).view(torch.uint8)[2:4].tolist() == [0x41, 0x41]
    store.commit()
    assert storage.kv_block(tables[1][0])[conv.offset : conv.offset + 4].tolist() == [0x3F, 0x3F, 0x41, 0x41]


def test_state_layout_is_aligned_and_sized():
    from moetide.engine.models import LinearStateShape

    layout = StateLayout.of({3: LinearStateShape((5, 3), (2, 4, 4)), 1: LinearStateShape((5, 3), (2, 4, 4))},
                            torch.bfloat16)
    (conv1, rec1), (conv3, rec3) = layout.fields[1], layout.fields[3]
    assert [conv1.offset, rec1.offset, conv3.offset, rec3.offset] == [0, 64, 192, 256]
    assert layout.total_bytes == 384 and layout.num_blocks(100) == 4


def test_host_copy_packs_experts_like_their_pages_and_takes_them_out_of_the_model(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3_moe"))  # layer 1 is dense: MoE layers are 0 and 2
    layout = ExpertLayout.of(model)
    assert layout.moe_layer_ids == (0, 2)
    experts = model.layers[2].mlp.experts
    gate_up, down = experts.gate_up_proj[3].clone(), experts.down_proj[3].clone()
    host = pack_experts(model, layout, pin=False)
    weights = layout.weights(host[1, 3])
    assert torch.equal(weights.gate_up, gate_up) and torch.equal(weights.down, down)
    assert model.layers[0].mlp.experts.gate_up_proj.numel() == model.layers[2].mlp.experts.down_proj.numel() == 0


@pytest.mark.gpu
def test_cuda_staging_uses_pinned_memory_and_a_copy_stream(tiny_checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    engine = Engine(tiny_checkpoint("mixtral"), kv_cache_memory=1 * 2**20, device="cuda", max_offload_ratio=0.5,
                    ignore_eos=True)
    stager = engine.parts.experts.stager
    assert stager.host.is_pinned() and stager.copy_stream is not None
    engine.parts.expert_line.offload(tuple((0, e) for e in range(4)))
    cpu = Engine(tiny_checkpoint("mixtral"), kv_cache_memory=1 * 2**20, ignore_eos=True)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6]]
    assert engine.generate(prompts, 8).outputs == cpu.generate(prompts, 8).outputs
