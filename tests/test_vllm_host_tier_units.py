"""The host tier's parts without a running engine (``vllm.host_tier``, ``vllm.split_attn``): vLLM's device block
order as probed through its own write kernel, writes split between device and host slots, each sequence's regions
and masks, and one sequence's split attention against vLLM's own kernel over the same keys all on the device."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from moetide.core.splits import SplitCosts  # noqa: E402
from moetide.engine import native  # noqa: E402
from moetide.engine.split_plan import SplitStepper  # noqa: E402
from moetide.engine.storage import KVLayout  # noqa: E402
from moetide.vllm.host_tier import BlockOrder, HostTier, num_host_blocks  # noqa: E402

HEADS, KV_HEADS, DIM = 4, 2, 64
COSTS = SplitCosts(cpu_s_per_byte=1e-9, cpu_fixed_s=0, cpu_per_seq_s=0, stream_s_per_byte=1e-9, stream_fixed_s=0,
                   stream_per_seq_s=0, gpu_fixed_s=0, merge_per_seq_s=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [32, 128])
def test_the_probed_order_reads_back_what_vllms_kernel_wrote(dtype, block_size):
    isa = _get_attn_isa(dtype, block_size, DIM)
    order = BlockOrder.probe(isa, dtype, block_size, DIM)
    assert sorted(order.index.tolist()) == list(range(2 * block_size * DIM))
    order.check(isa, dtype, KV_HEADS)  # raises where a scattered write does not read back exactly


def tier(first_host_id: int, num_blocks: int, block_size: int = 32, policy: str = "fixed-ratio") -> HostTier:
    layout = KVLayout((0, 1), block_size, KV_HEADS, DIM, torch.bfloat16)
    order = BlockOrder.probe(_get_attn_isa(torch.bfloat16, block_size, DIM), torch.bfloat16, block_size, DIM)
    stepper = SplitStepper(policy, lambda tokens, queries: COSTS, layout.block_bytes, 0.5)
    return HostTier(layout, ["layer.0", "layer.1"], num_blocks, first_host_id, order, stepper, pin=False)


def test_host_slots_go_to_the_host_blocks_and_leave_vllm_only_the_device_slots():
    t = tier(first_host_id=4, num_blocks=3)
    key, value = torch.randn(5, KV_HEADS, DIM).bfloat16(), torch.randn(5, KV_HEADS, DIM).bfloat16()
    slots = torch.tensor([3, 4 * 32 + 1, 40, 6 * 32 + 31, -1])  # device, host block 0, device, host block 2, padding
    left = t.write("layer.1", key, value, slots)
    assert left.tolist() == [3, -1, 40, -1, -1]
    k, v = t.host_kv("layer.1", torch.tensor([0, 2]))  # [Hkv, 2 · 32, D]
    assert torch.equal(k[:, 1], key[1]) and torch.equal(v[:, 32 + 31], value[3])
    streamed_k, _ = t.streamed_kv("layer.1", torch.tensor([2]))
    assert torch.equal(streamed_k[:, 31], key[3])
    assert torch.equal(t.host_kv("layer.0", torch.tensor([0]))[0], torch.zeros(KV_HEADS, 32, DIM, dtype=torch.bfloat16))
    assert t.host_blocks_written == 0 and t.counters.host_tokens_written == 0  # counted on the first layer only
    t.write("layer.0", key, value, slots)
    assert (t.host_blocks_written, t.counters.host_tokens_written) == (0, 2)  # neither host slot is a block's first
    assert num_host_blocks(64 << 20, 1 << 20, 2) == 32 and num_host_blocks(0, 1 << 20, 1) == 0


def test_regions_follow_table_order_and_mask_by_position():
    from moetide.vllm.split_attn import _regions

    table = torch.tensor([9, 2, 11, 3, 12])  # a prefix hit on host block 9, then device and host blocks
    regions = _regions(table, [True, False, True, False, True], num_cpu=2, first_host_id=8, block_size=4,
                       context=19, num_queries=3)
    assert [(r.kind, r.blocks.tolist()) for r in regions] == [("device", [2, 3]), ("cpu", [1, 3]), ("stream", [4])]
    device, cpu, stream = regions
    assert device.mask is None and cpu.mask is None  # every query (positions 16-18) sees positions 0-15
    assert stream.mask[0, 0].tolist() == [[True, False, False, False], [True, True, False, False],
                                          [True, True, True, False]]


def test_a_chunks_mask_covers_only_the_blocks_it_overlaps():
    from moetide.vllm.split_attn import _regions

    regions = _regions(torch.tensor([5, 6, 7, 8]), [False] * 4, num_cpu=0, first_host_id=9, block_size=4,
                       context=16, num_queries=8)  # queries at 8-15: blocks 5 and 6 (keys 0-7) seen by all
    assert [(r.kind, r.blocks.tolist(), r.mask is None) for r in regions] == [("device", [5, 6], True),
                                                                             ("device", [7, 8], False)]
    assert regions[1].mask.shape == (1, 1, 8, 8) and regions[1].last_row_keys == 8


@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("num_cpu", [0, 1, 3])
def test_one_sequence_split_three_ways_equals_vllms_kernel_over_all_of_it_on_the_device(num_cpu, queries):
    """Blocks 0-1 on the device, 2-4 on the host: the merged partials against ``cpu_attention_with_kv_cache``
    with the same five blocks in vLLM's tensor (fp32, so the two kernels' roundings stay below 1e-5). A decode
    query's in-place blocks go through the native paged kernel, a chunk's through torch's flash attention."""
    from moetide.vllm.split_attn import MoetideCPUAttentionImpl, _regions, _Seq

    dtype, bs, context = torch.float32, 32, 150
    isa = _get_attn_isa(dtype, bs, DIM)
    generator = torch.Generator().manual_seed(1)
    k, v = (torch.randn(context, KV_HEADS, DIM, generator=generator) for _ in range(2))
    q = torch.randn(queries, HEADS, DIM, generator=generator)
    whole = torch.zeros(5, KV_HEADS, 2 * bs, DIM, dtype=dtype)
    ops.cpu_attn_reshape_and_cache(k, v, *whole.chunk(2, dim=2), torch.arange(context), isa)
    expected = torch.empty(queries, HEADS, DIM)
    starts, lengths = torch.tensor([0, queries], dtype=torch.int32), torch.tensor([context], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, seq_lens=lengths, dtype=dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False,
        dynamic_causal=None, kv_cache_dtype="auto")
    key_cache, value_cache = whole.chunk(2, dim=2)
    ops.cpu_attention_with_kv_cache(query=q, key_cache=key_cache, value_cache=value_cache, output=expected,
                                    query_start_loc=starts, seq_lens=lengths, scale=0.125, causal=True,
                                    alibi_slopes=None, sliding_window=-1, softcap=0, scheduler_metadata=metadata,
                                    block_table=torch.tensor([[0, 1, 2, 3, 4]], dtype=torch.int32), s_aux=None,
                                    dynamic_causal=None)
    t = tier(first_host_id=2, num_blocks=3)
    t.storage = type(t.storage)(KVLayout((0,), bs, KV_HEADS, DIM, dtype), 3, 2, pin=False)
    t.order, t.layer_index = BlockOrder.probe(isa, dtype, bs, DIM), {"layer": 0}
    device = torch.zeros(2, KV_HEADS, 2 * bs, DIM, dtype=dtype)
    left = t.write("layer", k, v, torch.arange(context))
    ops.cpu_attn_reshape_and_cache(k, v, *device.chunk(2, dim=2), left, isa)
    table = torch.tensor([0, 1, 2, 3, 4])
    seq = _Seq(0, queries, _regions(table, [False, False, True, True, True], num_cpu, 2, bs, context, queries))
    impl = MoetideCPUAttentionImpl.__new__(MoetideCPUAttentionImpl)
    impl.num_heads, impl.head_size, impl.scale = HEADS, DIM, 0.125
    with torch.inference_mode():  # as vLLM runs the forward (the native kernels take no autograd)
        got = impl._attend(t, "layer", q, device, seq)
        if queries == 1 and native.available():  # the decode query's in-place blocks took the native kernel
            assert all(t.decode_partial("layer", q.view(1, HEADS, 1, DIM), r.blocks, r.last_row_keys, 0.125)
                       is not None for r in seq.regions if r.kind == "cpu")
    assert (got - expected).abs().max() < 1e-5
