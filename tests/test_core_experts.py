"""Expert residency: the offload cap is never exceeded (float rounding included), regions are cold-first and spread
over layers in a pinned order, routing counts decay, and random operation sequences keep the books consistent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetide.core.experts import ExpertResidency, ExpertResidencyConfig


def residency(num_layers=3, num_experts=4, *, max_offload_ratio=1.0, decay=0.9, expert_bytes=100) -> ExpertResidency:
    return ExpertResidency(ExpertResidencyConfig(num_layers=num_layers, num_experts=num_experts,
                                                 expert_bytes=expert_bytes, max_offload_ratio=max_offload_ratio,
                                                 decay=decay))


def routed_3x4() -> ExpertResidency:
    """Cold orders: layer 0 -> [3, 1, 2, 0]; layer 1 -> [0, 1, 2, 3]; layer 2 -> [2, 0, 1, 3]."""
    res = residency()
    res.record_routing(0, {0: 5, 1: 1, 2: 3})
    res.record_routing(1, [2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3])
    res.record_routing(2, {0: 4, 1: 4, 2: 0.5, 3: 7})
    return res


# ---- region choice --------------------------------------------------------------------------------------------
def test_region_is_cold_first_and_round_robin_over_layers():
    res = routed_3x4()
    region = res.next_offload_region(max_experts=7)
    # round 0: each layer's coldest, coldest first (ties by layer); round 1 likewise; then layer 1's third
    assert region == [(0, 3), (1, 0), (2, 2), (1, 1), (0, 1), (2, 0), (1, 2)]
    assert res.num_offloaded == 0  # choosing marks nothing
    res.check_invariants()


def test_region_balances_against_experts_already_offloaded():
    res = routed_3x4()
    res.mark_offloaded([(0, 3), (0, 1)])
    assert res.next_offload_region(max_experts=3) == [(1, 0), (2, 2), (1, 1)]
    assert res.offloaded_experts(0) == [1, 3]
    assert not res.is_resident(0, 3) and res.is_resident(0, 2)


def test_region_skips_layers_with_nothing_left_and_stops_when_all_are_offloaded():
    res = residency(num_layers=2, num_experts=2)
    res.mark_offloaded([(0, 0), (0, 1)])
    assert res.next_offload_region(max_experts=5) == [(1, 0), (1, 1)]
    res.mark_offloaded([(1, 0), (1, 1)])
    assert res.next_offload_region(max_experts=5) == []
    assert res.offloaded_ratio == 1.0


def test_num_bytes_rounds_up_to_whole_experts_and_the_smaller_request_wins():
    res = residency()
    assert len(res.next_offload_region(num_bytes=250)) == 3
    assert len(res.next_offload_region(num_bytes=250, max_experts=2)) == 2
    assert res.next_offload_region(num_bytes=0) == []
    with pytest.raises(ValueError, match="needs max_experts or num_bytes"):
        res.next_offload_region()
    with pytest.raises(ValueError, match="max_experts must be >= 0"):
        res.next_offload_region(max_experts=-1)


# ---- the cap --------------------------------------------------------------------------------------------------
def test_cap_returns_fewer_experts_rather_than_exceed_it():
    res = residency(num_layers=2, num_experts=10, max_offload_ratio=0.15)
    assert res.max_num_offloaded == 3
    region = res.next_offload_region(max_experts=10)
    assert region == [(0, 0), (1, 0), (0, 1)]
    res.mark_offloaded(region)
    assert res.next_offload_region(max_experts=1) == []
    with pytest.raises(ValueError, match=r"above max_offload_ratio=0.15 \(at most 3\)"):
        res.mark_offloaded([(1, 1)])
    assert res.num_offloaded == 3 and res.offloaded_bytes == 300 and res.offloaded_ratio == pytest.approx(0.15)
    res.check_invariants()


@pytest.mark.parametrize("ratio, num_experts, expected", [(0.29, 100, 29), (0.3, 10, 3), (0.7, 10, 7),
                                                          (0.15, 8, 1), (0.0, 8, 0), (1.0, 7, 7), (0.57, 100, 57)])
def test_cap_is_exact_under_float_rounding(ratio, num_experts, expected):
    res = residency(num_layers=1, num_experts=num_experts, max_offload_ratio=ratio, expert_bytes=3)
    assert res.max_num_offloaded == expected
    res.mark_offloaded(res.next_offload_region(max_experts=num_experts))
    assert res.num_offloaded == expected and res.offloaded_ratio <= ratio


def test_zero_ratio_never_offloads():
    res = residency(max_offload_ratio=0.0)
    assert res.next_offload_region(max_experts=3) == []
    with pytest.raises(ValueError, match="above max_offload_ratio"):
        res.mark_offloaded([(0, 0)])


# ---- marking --------------------------------------------------------------------------------------------------
def test_marking_validates_the_whole_region_before_changing_anything():
    res = residency()
    res.mark_offloaded([(0, 1)])
    with pytest.raises(ValueError, match=r"expert \(0, 1\) is already offloaded"):
        res.mark_offloaded([(2, 2), (0, 1)])
    assert res.is_resident(2, 2)
    with pytest.raises(ValueError, match="more than once"):
        res.mark_offloaded([(2, 2), (2, 2)])
    with pytest.raises(ValueError, match=r"expert \(1, 1\) is not offloaded"):
        res.mark_resident([(0, 1), (1, 1)])
    assert not res.is_resident(0, 1)
    with pytest.raises(ValueError, match="shared experts are never offloaded"):
        res.mark_offloaded([(0, 4)])
    res.mark_resident([(0, 1)])
    assert res.num_offloaded == 0 and res.all_offloaded() == []
    res.check_invariants()


# ---- routing statistics ---------------------------------------------------------------------------------------
def test_routing_counts_decay_each_step():
    res = residency(decay=0.5)
    res.record_routing(1, [3, 3, 0])
    assert (res.hotness(1, 3), res.hotness(1, 0), res.hotness(1, 1)) == (2.0, 1.0, 0.0)
    res.end_step()
    res.record_routing(1, {0: 4})
    assert (res.hotness(1, 3), res.hotness(1, 0)) == (1.0, 4.5)
    assert res.next_offload_region(max_experts=3) == [(0, 0), (1, 1), (2, 0)]  # all cold: ties by layer


def test_decay_survives_many_steps_and_keeps_recent_routing_on_top():
    res = residency(decay=0.5)
    res.record_routing(0, {0: 1, 1: 2})
    for _ in range(600):  # 0.5 ** 600 underflows a float; the lazy scale must fold back in first
        res.end_step()
    res.record_routing(0, [2])
    assert res.hotness(0, 2) == 1.0
    assert res.hotness(0, 1) < 1e-150
    assert res.next_offload_region(max_experts=2) == [(0, 3), (1, 0)]
    res.check_invariants()


def test_decay_one_keeps_lifetime_counts():
    res = residency(decay=1.0)
    for _ in range(5):
        res.record_routing(0, [1])
        res.end_step()
    assert res.hotness(0, 1) == 5.0


def test_bad_routing_records_nothing():
    res = residency()
    with pytest.raises(ValueError, match="expert 9 is outside the 4 routed experts"):
        res.record_routing(0, [1, 9])
    with pytest.raises(ValueError, match="finite and >= 0"):
        res.record_routing(0, {1: 2, 2: -1})
    assert res.hotness(0, 1) == 0.0


def test_a_dense_count_row_records_what_the_same_counts_as_a_mapping_record():
    dense, mapped = residency(decay=0.5), residency(decay=0.5)
    for res in (dense, mapped):
        res.record_routing(2, [1, 1])
        res.end_step()
    dense.record_counts(2, [0, 3, 0, 2.5])
    mapped.record_routing(2, {1: 3, 3: 2.5})
    hotness = [dense.hotness(2, e) for e in range(4)]
    assert hotness == [mapped.hotness(2, e) for e in range(4)] == [0, 4.0, 0, 2.5]  # expert 1: 2 decayed to 1, + 3
    assert dense.next_offload_region(max_experts=12) == mapped.next_offload_region(max_experts=12)
    dense.check_invariants()


def test_a_bad_count_row_records_nothing():
    res = residency()
    with pytest.raises(ValueError, match=r"one per routed expert \(4\), got 3"):
        res.record_counts(0, [1, 2, 3])
    with pytest.raises(ValueError, match="finite and >= 0"):
        res.record_counts(0, [1, 2, float("nan"), 0])
    with pytest.raises(ValueError, match="layer 3 is outside"):
        res.record_counts(3, [0, 0, 0, 1])
    assert res.hotness(0, 1) == 0.0


@pytest.mark.parametrize("field, value, message", [
    ("num_layers", 0, "num_layers must be an integer >= 1"),
    ("expert_bytes", 2.5, "expert_bytes must be an integer >= 1"),
    ("max_offload_ratio", 1.5, r"max_offload_ratio must be in \[0, 1\]"),
    ("decay", 0.0, r"decay must be in \(0, 1\]"),
])
def test_config_rejects_bad_fields_by_name(field, value, message):
    kwargs = dict(num_layers=2, num_experts=4, expert_bytes=100)
    kwargs[field] = value
    with pytest.raises(ValueError, match=message):
        ExpertResidencyConfig(**kwargs)


# ---- random operation sequences -------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    num_layers=st.integers(1, 4),
    num_experts=st.integers(1, 5),
    ratio=st.floats(0.0, 1.0),
    data=st.data(),
)
def test_random_operations_never_exceed_the_cap_and_pick_cold_first_spread(num_layers, num_experts, ratio, data):
    res = residency(num_layers, num_experts, max_offload_ratio=ratio)
    for op in data.draw(st.lists(st.sampled_from(["route", "step", "offload", "restore"]), max_size=25)):
        if op == "route":
            layer = data.draw(st.integers(0, num_layers - 1))
            res.record_routing(layer, data.draw(st.lists(st.integers(0, num_experts - 1), max_size=6)))
        elif op == "step":
            res.end_step()
        elif op == "offload":
            region = res.next_offload_region(max_experts=data.draw(st.integers(0, 6)))
            check_region(res, region)
            res.mark_offloaded(region)
        elif res.all_offloaded():
            res.mark_resident(data.draw(st.lists(st.sampled_from(res.all_offloaded()), unique=True)))
        res.check_invariants()
        assert res.offloaded_ratio <= ratio


def check_region(res: ExpertResidency, region: list[tuple[int, int]]) -> None:
    """Distinct resident experts; each layer's picks are its coldest residents; layer counts stay balanced."""
    assert len(set(region)) == len(region)
    assert res.num_offloaded + len(region) <= res.max_num_offloaded
    counts = [len(res.offloaded_experts(layer)) for layer in range(res.config.num_layers)]
    for layer in range(res.config.num_layers):
        picked = [e for (lay, e) in region if lay == layer]
        resident = [e for e in range(res.config.num_experts) if res.is_resident(layer, e)]
        coldest = sorted(resident, key=lambda e: (res.hotness(layer, e), e))
        assert picked == coldest[: len(picked)]
        counts[layer] += len(picked)
    grew = [counts[layer] for layer in {lay for lay, _ in region}]
    open_layers = [counts[layer] for layer in range(res.config.num_layers)
                   if counts[layer] < res.config.num_experts]
    if grew and open_layers:
        assert max(grew) <= min(open_layers) + 1
