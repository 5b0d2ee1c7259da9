"""core.splits: write-time placement, split regions, the closed-form planner, baselines, online correction."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetide.core.split_planner import CorrectionConfig, OnlineCorrection, SplitPlanner, probe_split
from moetide.core.splits import (
    SPLIT_POLICIES,
    FixedRatio,
    Region,
    SeqResidency,
    SeqSplit,
    SplitCosts,
    fill_split,
    cpu_side_s,
    optimal_cpu_blocks,
    phase_time_s,
)

BLOCK = 1000.0  # bytes per block in the synthetic cases


def costs(**overrides: float) -> SplitCosts:
    """A CPU that attends 40 B/us and a link that streams 25 B/us, with small fixed costs."""
    values = dict(cpu_s_per_byte=1 / 40e6, cpu_fixed_s=1e-4, cpu_per_seq_s=1e-5, stream_s_per_byte=1 / 25e6,
                  stream_fixed_s=1e-4, stream_per_seq_s=1e-5, gpu_fixed_s=2e-4, merge_per_seq_s=1e-5)
    values.update(overrides)
    return SplitCosts(**values)


def seqs_of(*host_blocks: int, device: int = 2) -> list[SeqResidency]:
    return [SeqResidency(i, device, h) for i, h in enumerate(host_blocks)]


# ---- placement: the pool's ---------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 40), st.integers(1, 6), st.integers(1, 12))
def test_lockstep_writes_in_a_two_tier_pool_give_equal_device_shares_then_host(device, batch, blocks_per_seq):
    """plan-split's placement, through the engine's pool: sequences written block by block in lockstep get device
    blocks in turn while any is free (shares differ by at most one), then host blocks; each is a device prefix
    then a host suffix."""
    from moetide.core.blocks import BlockPool, HostTier

    tier = HostTier(device, batch * blocks_per_seq)
    pool = BlockPool(range(device), host_tier=tier)
    held = [[] for _ in range(batch)]
    for _ in range(blocks_per_seq):
        for blocks in held:
            blocks.extend(pool.allocate(1))
    pool.check_invariants()
    shares = [len(b) - tier.count(b) for b in held]
    assert sum(shares) == min(device, batch * blocks_per_seq) and max(shares) - min(shares) <= 1
    for blocks in held:
        flags = [tier.holds(b) for b in blocks]
        assert flags == sorted(flags)  # device prefix, host suffix


def test_seq_split_regions():
    s = SeqSplit("q", num_device_blocks=2, num_cpu_blocks=3, num_streamed_blocks=1)
    assert [s.region_of(i) for i in range(6)] == [Region.DEVICE_INPLACE] * 2 + [Region.HOST_INPLACE] * 3 + [
        Region.HOST_STREAMED]
    assert s.cpu_blocks == range(2, 5) and s.streamed_blocks == range(5, 6)
    with pytest.raises(IndexError):
        s.region_of(6)


def test_split_costs_validation():
    with pytest.raises(ValueError, match="cpu_fixed_s"):
        costs(cpu_fixed_s=-1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        costs(stream_s_per_byte=0.0)


# ---- the planner against brute force ----------------------------------------------------------------------------


def brute_force_time(c: SplitCosts, seqs: list[SeqResidency], factor: float) -> float:
    total = sum(s.num_host_blocks for s in seqs)
    return min(phase_time_s(c, fill_split(seqs, b), BLOCK, factor) for b in range(total + 1))


positive = st.floats(1e-9, 1e-6)
fixed = st.floats(0.0, 1e-3)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), positive, positive, fixed, fixed, fixed, fixed, fixed,
       fixed, st.floats(0.25, 4.0))
def test_closed_form_equals_grid_search(host, a, b, c, p_c, s, p_s, g, m, factor):
    k = SplitCosts(cpu_s_per_byte=a, cpu_fixed_s=c, cpu_per_seq_s=p_c, stream_s_per_byte=b, stream_fixed_s=s,
                   stream_per_seq_s=p_s, gpu_fixed_s=g, merge_per_seq_s=m)
    seqs = seqs_of(*host)
    chosen = optimal_cpu_blocks(k, host, BLOCK, factor)
    got = phase_time_s(k, fill_split(seqs, chosen), BLOCK, factor)
    assert got == pytest.approx(brute_force_time(k, seqs, factor), rel=1e-12, abs=1e-15)


def test_balanced_interior_optimum_by_hand():
    k = costs(cpu_fixed_s=0, cpu_per_seq_s=0, stream_fixed_s=0, stream_per_seq_s=0, gpu_fixed_s=0, merge_per_seq_s=0)
    # a X = b (H - X)  ->  X / H = b / (a + b) = 40 / 65 of 1300 blocks = 800 blocks
    assert optimal_cpu_blocks(k, [1300], BLOCK) == 800


def test_endpoints_all_streamed_and_all_cpu():
    slow_cpu = costs(cpu_s_per_byte=1 / 1e3)
    slow_link = costs(stream_s_per_byte=1 / 1e3)
    assert optimal_cpu_blocks(slow_cpu, [50, 50], BLOCK) == 0
    assert optimal_cpu_blocks(slow_link, [50, 50], BLOCK) == 100
    assert optimal_cpu_blocks(costs(), [], BLOCK) == 0
    splits = SPLIT_POLICIES["writescope"]().split(slow_link, seqs_of(50, 50), BLOCK)
    assert [(s.num_cpu_blocks, s.num_streamed_blocks) for s in splits] == [(50, 0), (50, 0)]


def test_writescope_fills_longest_first_and_splits_one_sequence():
    k = costs(cpu_fixed_s=0, cpu_per_seq_s=0, stream_fixed_s=0, stream_per_seq_s=0, gpu_fixed_s=0, merge_per_seq_s=0)
    splits = SPLIT_POLICIES["writescope"]().split(k, seqs_of(300, 700, 300), BLOCK)  # 800 of 1300 to the CPU
    assert [(s.num_cpu_blocks, s.num_streamed_blocks) for s in splits] == [(100, 200), (700, 0), (0, 300)]
    assert all(s.num_device_blocks == 2 for s in splits)


# ---- baselines ------------------------------------------------------------------------------------------------


def test_baselines_shapes():
    seqs = seqs_of(10, 30, 20)
    pairs = {name: [(s.num_cpu_blocks, s.num_streamed_blocks) for s in policy().split(costs(), seqs, BLOCK)]
             for name, policy in SPLIT_POLICIES.items()}
    assert pairs["transfer-all"] == [(0, 10), (0, 30), (0, 20)]
    assert pairs["cpu-all"] == [(10, 0), (30, 0), (20, 0)]
    assert pairs["fixed-ratio"] == [(5, 5), (15, 15), (10, 10)]
    assert all(c == 0 or st_ == 0 for c, st_ in pairs["request-split"])  # whole sequences only
    # LPT on a CPU of 40 B/us and a link of 25 B/us: 30 -> CPU, 20 -> stream, 10 -> CPU
    assert pairs["request-split"] == [(10, 0), (30, 0), (0, 20)]
    assert [(s.num_cpu_blocks, s.num_streamed_blocks) for s in FixedRatio(0.3).split(costs(), seqs, BLOCK)] == [
        (3, 7), (9, 21), (6, 14)]
    with pytest.raises(ValueError):
        FixedRatio(1.5)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=8), st.floats(0.25, 4.0))
def test_writescope_never_loses_to_a_baseline_on_its_own_model(host, factor):
    seqs, k = seqs_of(*host), costs()
    ws = phase_time_s(k, SPLIT_POLICIES["writescope"]().split(k, seqs, BLOCK, factor), BLOCK, factor)
    for name, policy in SPLIT_POLICIES.items():
        assert ws <= phase_time_s(k, policy().split(k, seqs, BLOCK, factor), BLOCK, factor) * (1 + 1e-12), name


# ---- chunked prefill ------------------------------------------------------------------------------------------


def prefill_costs(num_queries: int) -> SplitCosts:
    """CPU FLOPs per byte and query/partial-output traffic grow with Q; a streamed byte serves all Q queries."""
    return costs(cpu_s_per_byte=max(1 / 160e6, num_queries / 50e6), cpu_per_seq_s=num_queries * 2e-5,
                 merge_per_seq_s=num_queries * 2e-5)


def test_chunked_prefill_cpu_share_falls_to_zero():
    shares = [optimal_cpu_blocks(prefill_costs(q), [4000], BLOCK) / 4000 for q in (1, 2, 8, 64, 512, 2048)]
    assert shares[0] > 0.5 and shares[-1] == 0.0
    assert all(later <= earlier for earlier, later in zip(shares, shares[1:]))


# ---- online correction ----------------------------------------------------------------------------------------


def test_correction_is_bounded_and_ignores_empty_samples():
    c = OnlineCorrection()
    for _ in range(50):
        c.observe(10.0, 1.0)
    assert c.factor == 4.0
    for _ in range(50):
        c.observe(0.001, 1.0)
    assert c.factor == 0.25
    before = c.num_samples
    assert c.observe(5.0, 0.0) == 0.25 and c.num_samples == before  # no CPU work: nothing learned
    with pytest.raises(ValueError):
        c.observe(float("nan"), 1.0)
    with pytest.raises(ValueError):
        CorrectionConfig(smoothing=0.0)
    with pytest.raises(ValueError):
        CorrectionConfig(min_factor=2.0)


CONVERGENCE_STEPS = 6  # stated in docs/writescope.md: after 6 measured steps the split is within 5%


def test_online_feedback_converges_to_the_new_optimum():
    """The true CPU gets 2x slower than modeled; after CONVERGENCE_STEPS measured steps (and not before) the
    planner's split is within 5% of the new optimum, and stays there (smoothing 0.3: the factor's error after n
    samples is 0.7^n of the step, 12% after 6; the split moves less than the factor)."""
    k, seqs = costs(), seqs_of(400, 400, 400)
    host = [s.num_host_blocks for s in seqs]
    new_opt = optimal_cpu_blocks(k, host, BLOCK, factor=2.0)
    old_opt = optimal_cpu_blocks(k, host, BLOCK, factor=1.0)
    assert new_opt < 0.8 * old_opt  # a real move
    planner = SplitPlanner()
    history = []
    for _ in range(12):
        plan = planner.plan(k, seqs, BLOCK)
        history.append(plan.cpu_bytes / BLOCK)
        n_c = sum(1 for s in plan.splits if s.num_cpu_blocks)
        measured = 2.0 * cpu_side_s(k, plan.cpu_bytes, n_c)  # the injected slowdown
        planner.observe(plan, measured)
    errors = [abs(x - new_opt) / new_opt for x in history]
    first_ok = next(i for i, e in enumerate(errors) if e <= 0.05)
    assert first_ok == CONVERGENCE_STEPS
    assert all(e <= 0.05 for e in errors[first_ok:])
    assert math.isclose(planner.correction.factor, 2.0, rel_tol=0.02)


# ---- probing a CPU that gets no work --------------------------------------------------------------------------


def _run(planner: SplitPlanner, k: SplitCosts, seqs: list[SeqResidency], slowdown: float, steps: int) -> list:
    """Plan, charge the CPU side ``slowdown`` times the model, observe; the plans' CPU blocks."""
    history = []
    for _ in range(steps):
        plan = planner.plan(k, seqs, BLOCK)
        history.append((plan.cpu_bytes / BLOCK, plan.probe))
        n_c = sum(1 for s in plan.splits if s.num_cpu_blocks)
        planner.observe(plan, slowdown * cpu_side_s(k, plan.cpu_bytes, n_c))
    return history


RECOVERY_AFTER_PROBE = 11  # stated in docs/writescope.md: within 5% of the optimum 11 plans after the probe


def test_probe_notices_a_cpu_that_recovers():
    """The CPU gets 8x slower: k saturates at 4 and a 13 ms fixed cost makes the CPU not worth any work (13 ms x 4 >
    the 48 ms stream), so the split is 0. The CPU recovers. Without probes nothing is ever measured again and the
    split stays 0. With them, a probe comes within probe_every + 1 plans, and RECOVERY_AFTER_PROBE plans after it
    the split is within 5% of the optimum, and stays there (k falls from 4 to 1 by 0.7 per sample)."""
    k, seqs = costs(cpu_fixed_s=13e-3), seqs_of(400, 400, 400)
    host = [s.num_host_blocks for s in seqs]
    opt = optimal_cpu_blocks(k, host, BLOCK)
    assert opt > 0.3 * sum(host) and optimal_cpu_blocks(k, host, BLOCK, factor=4.0) == 0
    for probe_every in (0, 16):
        planner = SplitPlanner(probe_every=probe_every)
        slow = _run(planner, k, seqs, 8.0, 40)
        assert planner.correction.factor == 4.0 and slow[-1] == (0, False)
        after = _run(planner, k, seqs, 1.0, 60)
        if probe_every == 0:
            assert after == [(0, False)] * 60 and planner.num_probes == 0
            continue
        probe = next(i for i, (_, p) in enumerate(after) if p)
        assert probe < probe_every + 1
        errors = [abs(x - opt) / opt for x, _ in after]
        first_ok = next(i for i, e in enumerate(errors) if e <= 0.05)
        assert first_ok - probe == RECOVERY_AFTER_PROBE and all(e <= 0.05 for e in errors[first_ok:])
        assert not any(p for _, p in after[probe + 1:])  # the CPU has work again: no more probes


def test_probe_split_size_and_when_it_happens():
    k, seqs = costs(cpu_fixed_s=1e-4, cpu_per_seq_s=0.4e-4), seqs_of(30, 50, 50)  # c + p_c = 5.6 blocks
    split = probe_split(k, seqs, BLOCK)
    assert [s.num_cpu_blocks for s in split] == [0, 6, 0]  # the first sequence with the most host blocks
    assert [s.num_cpu_blocks + s.num_streamed_blocks for s in split] == [30, 50, 50]
    assert [s.num_cpu_blocks for s in probe_split(costs(cpu_fixed_s=1.0), seqs, BLOCK)] == [0, 50, 0]  # capped
    assert [s.num_cpu_blocks for s in probe_split(costs(cpu_fixed_s=0, cpu_per_seq_s=0), seqs, BLOCK)] == [0, 1, 0]
    slow = costs(cpu_fixed_s=1.0)  # the CPU never worth it
    planner = SplitPlanner(probe_every=3)
    assert not any(planner.plan(slow, seqs, BLOCK).probe for _ in range(8))  # k = 1: nothing to learn
    planner.correction.factor = 1.5  # a CPU judged slower than its model
    probes = [planner.plan(slow, seqs, BLOCK).probe for _ in range(8)]
    assert probes == [True, False, False, False, True, False, False, False] and planner.num_probes == 2
    no_host = seqs_of(0, 0)
    assert not any(planner.plan(slow, no_host, BLOCK).probe for _ in range(10))  # nothing to probe with
    busy = SplitPlanner(probe_every=1)
    assert not any(busy.plan(k, seqs, BLOCK).probe for _ in range(5))  # the CPU has work every step
    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError, match="probe_every"):
            SplitPlanner(probe_every=bad)


def test_with_gpu_fixed_s_is_replace_of_g():
    """It lists the fields by position (a replay calls it every step): a new or reordered field must not shift."""
    costs = SplitCosts(*(float(i + 1) for i in range(len(dataclasses.fields(SplitCosts)))))
    assert costs.with_gpu_fixed_s(0.5) == dataclasses.replace(costs, gpu_fixed_s=0.5)
