"""The WriteScope paper's named baselines, its monolithic ablation and the prefetch term, on hand-computed cases.

Costs as in tests/test_core_splits.py: a CPU that attends 40 B/us and a link that streams 25 B/us, 1000-byte
blocks, c = s = 100 us, p_c = p_s = m = 10 us, g = 200 us.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetide.core.split_baselines import (
    MODELED_POLICIES,
    NAMED_BASELINES,
    FastDecode,
    HybridGen,
    Monolithic,
    ScoutAttention,
    SolidAttention,
)
from moetide.core.splits import (
    SPLIT_POLICIES,
    SeqResidency,
    SeqSplit,
    SplitCosts,
    WriteScope,
    fill_split,
    _time_s,
    gpu_side_s,
    optimal_cpu_blocks,
    phase_time_s,
)

BLOCK = 1000.0


def costs(**overrides: float) -> SplitCosts:
    values = dict(cpu_s_per_byte=1 / 40e6, cpu_fixed_s=1e-4, cpu_per_seq_s=1e-5, stream_s_per_byte=1 / 25e6,
                  stream_fixed_s=1e-4, stream_per_seq_s=1e-5, gpu_fixed_s=2e-4, merge_per_seq_s=1e-5)
    values.update(overrides)
    return SplitCosts(**values)


def seqs_of(*host_blocks: int, device: int = 2) -> list[SeqResidency]:
    return [SeqResidency(i, device, h) for i, h in enumerate(host_blocks)]


def test_registries_keep_the_engine_exact():
    assert set(NAMED_BASELINES) | set(SPLIT_POLICIES) | {"monolithic"} == set(MODELED_POLICIES)
    assert not set(NAMED_BASELINES) & set(SPLIT_POLICIES)  # the engine never runs a sparse policy


def test_fastdecode_puts_every_host_block_on_the_cpu():
    splits = FastDecode().split(costs(), seqs_of(10, 4), BLOCK)
    assert [(s.num_cpu_blocks, s.num_streamed_blocks) for s in splits] == [(10, 0), (4, 0)]
    # CPU side: c + 2 p_c + 14,000 B / 40 B/us = 100 + 20 + 350 us; GPU side g + 2 m = 220 us
    assert phase_time_s(costs(), splits, BLOCK) == pytest.approx(470e-6)


def test_hybridgen_attends_each_token_where_it_lies():
    splits = HybridGen().split(costs(), seqs_of(10, 4), BLOCK)
    assert splits == FastDecode().split(costs(), seqs_of(10, 4), BLOCK)  # a full device pool: nothing can move


def test_hybridgen_streaming_settles_at_the_balanced_proportional_share():
    # n = 2 sequences both sides: CPU 120 us + X/40, GPU 340 us + (100,000 - X)/25; they cross at X = 64,923 B,
    # so 64 or 65 blocks: T(64) = max(1,720, 1,780) us, T(65) = max(1,745, 1,740) us -> 65, in proportion 39 + 26
    splits = HybridGen(streams=True).split(costs(), seqs_of(60, 40), BLOCK)
    assert [(s.num_cpu_blocks, s.num_streamed_blocks) for s in splits] == [(39, 21), (26, 14)]
    assert phase_time_s(costs(), splits, BLOCK) == pytest.approx(1745e-6)
    # writescope may touch fewer sequences on one side, so it is never slower on the same model
    ws = WriteScope().split(costs(), seqs_of(60, 40), BLOCK)
    assert phase_time_s(costs(), ws, BLOCK) <= phase_time_s(costs(), splits, BLOCK)


def test_hybridgen_feedback_factor_moves_its_share():
    slow = HybridGen(streams=True).split(costs(), seqs_of(60, 40), BLOCK, factor=2.0)
    assert sum(s.num_cpu_blocks for s in slow) < 65


def test_scoutattention_attends_a_sparse_share_on_the_cpu_one_layer_ahead():
    policy = ScoutAttention(density=0.25)
    splits = policy.split(costs(), seqs_of(10, 4), BLOCK)
    assert splits == (SeqSplit(0, 2, 3, 0, 7), SeqSplit(1, 2, 1, 0, 3))  # ceil(2.5), ceil(1.0); rest skipped
    assert policy.mechanism.layer_ahead_cpu and policy.mechanism.lossy
    assert splits[0].region_of(4) is not None and splits[0].region_of(5) is None  # block 5 = d + c: skipped
    with pytest.raises(ValueError, match="density"):
        ScoutAttention(density=0)


def test_solidattention_streams_a_sparse_share_and_reuses_its_selection():
    policy = SolidAttention(density=0.5, locality=0.75)
    splits = policy.split(costs(), seqs_of(10, 3), BLOCK)
    assert [(s.num_cpu_blocks, s.num_streamed_blocks, s.num_skipped_blocks) for s in splits] == [(0, 5, 5),
                                                                                                  (0, 2, 1)]
    assert policy.mechanism.reuse_fraction == 0.75 and policy.mechanism.lossy
    # 7 streamed blocks on 2 sequences: g + s + 2 p_s + 7,000 B / 25 B/us = 200 + 100 + 20 + 280 us
    assert phase_time_s(costs(), splits, BLOCK) == pytest.approx(600e-6)
    with pytest.raises(ValueError, match="locality"):
        SolidAttention(locality=1.0)


def test_monolithic_has_no_device_blocks_and_writescopes_the_rest():
    policy = Monolithic()
    splits = policy.split(costs(), seqs_of(10, device=2), BLOCK)
    assert splits[0].num_device_blocks == 0 and splits[0].num_cpu_blocks + splits[0].num_streamed_blocks == 12
    assert splits == WriteScope().split(costs(), [SeqResidency(0, 0, 12)], BLOCK)
    assert policy.mechanism.relayout and not policy.mechanism.lossy


def test_prefetched_bytes_do_not_pay_the_link():
    c = costs(prefetch_bytes=50_000.0)
    # 80,000 B streamed on one sequence: only 30,000 B pay b -> g + s + p_s + 1,200 us
    assert gpu_side_s(c, 80_000.0, 1, 0) == pytest.approx(2e-4 + 1e-4 + 1e-5 + 1.2e-3)
    assert gpu_side_s(c, 40_000.0, 1, 0) == pytest.approx(3.1e-4)  # all prefetched: the fixed costs stay


def test_optimum_with_prefetch_is_the_crossing_of_the_shifted_line():
    # one sequence of 100 blocks, P = 50,000 B: 110 us + X/40 = 320 us + (50,000 - X)/25 at X = 34,000 B
    c = costs(prefetch_bytes=50_000.0)
    best = optimal_cpu_blocks(c, [100], BLOCK)
    assert best in (34, 35)
    assert _time_s(c, best, 100, 1, 1, BLOCK, 1.0) == pytest.approx(960e-6, rel=1e-6)
    brute = min(range(101), key=lambda b: (_time_s(c, b, 100, 1 if b else 0, 1 if b < 100 else 0, BLOCK, 1.0), b))
    assert best == brute


@pytest.mark.parametrize("prefetch", [0.0, 5_000.0, 37_500.0, 90_000.0, 1e9])
def test_optimum_with_prefetch_matches_brute_force_on_several_sequences(prefetch):
    c = costs(prefetch_bytes=prefetch)
    seqs = seqs_of(40, 25, 10)
    ws = WriteScope().split(c, seqs, BLOCK)
    t = phase_time_s(c, ws, BLOCK)
    assert all(t <= phase_time_s(c, fill_split(seqs, b), BLOCK) + 1e-12 for b in range(76))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=8), st.floats(0.25, 4.0), st.floats(0, 2e5))
def test_writescope_with_prefetch_never_loses_to_an_exact_split(host, factor, prefetch):
    """Prefetch makes the streaming side flat past H - P; the closed form must still find the optimum, so no
    exact policy (the drivers' four, HybridGen's streaming reading) beats it on its own model."""
    seqs, c = seqs_of(*host), costs(prefetch_bytes=prefetch)
    ws = phase_time_s(c, WriteScope().split(c, seqs, BLOCK, factor), BLOCK, factor)
    rivals = {name: make() for name, make in SPLIT_POLICIES.items()} | {"hybridgen": HybridGen(streams=True)}
    for name, policy in rivals.items():
        assert ws <= phase_time_s(c, policy.split(c, seqs, BLOCK, factor), BLOCK, factor) * (1 + 1e-12), name
    best = min(phase_time_s(c, fill_split(seqs, b), BLOCK, factor) for b in range(sum(host) + 1))
    chosen = fill_split(seqs, optimal_cpu_blocks(c, host, BLOCK, factor))
    assert phase_time_s(c, chosen, BLOCK, factor) == pytest.approx(best, rel=1e-12, abs=1e-15) and ws <= best


def test_prefetch_flat_side_ties_go_to_fewer_cpu_blocks():
    # P = 95,000 of 100,000 B: from X = 5 blocks on the streaming side is flat at g + m + s + p_s = 320 us, and the
    # CPU side (110 us + X/40) stays under it up to 8 blocks; the crossing of the extended line (6.3 blocks) would
    # pick 6. The fewest blocks that reach 320 us are 5: T(4) = 360 us.
    c = costs(prefetch_bytes=95_000.0)
    assert optimal_cpu_blocks(c, [100], BLOCK) == 5
    assert _time_s(c, 5, 100, 1, 1, BLOCK, 1.0) == pytest.approx(320e-6)
    assert _time_s(c, 4, 100, 1, 1, BLOCK, 1.0) == pytest.approx(360e-6)
