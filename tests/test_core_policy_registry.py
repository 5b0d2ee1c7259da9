"""A policy is its module and one registry entry: each driver reads what the policy is from the entry, and prices
it with its own cost provider, so a new policy, cost-aware or not, needs nothing else of either driver."""

from __future__ import annotations

import pytest

from moetide.core.pressure import POLICIES, PolicyEntry, VampParams, get_policy, policy_entry
from moetide.core.pressure.vllm import VllmPolicy
from moetide.sim.setup import ReplayConfig, build_replay
from moetide.workloads import generate_agent_sessions


class PricedVllm(VllmPolicy):
    """vllm's decisions, keeping the cost record it was built with: a cost-aware policy as a newcomer writes it."""

    name = "priced-vllm"

    def __init__(self, params: VampParams) -> None:
        self.params = params


@pytest.fixture
def priced(monkeypatch):
    monkeypatch.setitem(POLICIES, "priced-vllm", PolicyEntry(PricedVllm, "a test policy", offloads_experts=True,
                                                             needs_costs=True))
    return "priced-vllm"


def test_entries_say_what_each_policy_is():
    assert not policy_entry("vllm").offloads_experts and not policy_entry("vllm").needs_costs
    assert policy_entry("static-offload").offloads_experts and not policy_entry("static-offload").moves_line
    for name in ("vamp", "vamp-reclaim"):
        entry = policy_entry(name)
        assert entry.offloads_experts and entry.moves_line and entry.needs_costs
    assert policy_entry("VAMP") is policy_entry("vamp")


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown policy 'lru'; choose one of: static-offload, vamp, vamp-reclaim"):
        policy_entry("lru")


def test_an_entry_that_prices_experts_must_offload_them():
    with pytest.raises(ValueError, match="offloads experts"):
        PolicyEntry(VllmPolicy, "x", needs_costs=True)


def test_costs_are_asked_only_by_a_policy_that_needs_them():
    def never() -> VampParams:
        raise AssertionError("vllm asked for costs")

    assert get_policy("vllm", costs=never).name == "vllm"
    with pytest.raises(ValueError, match="priced by the driver's costs"):
        get_policy("vamp")


def test_the_replay_prices_a_newly_registered_policy(priced):
    workload = generate_agent_sessions(num_sessions=4, seed=1)
    built = build_replay(workload, ReplayConfig(policy=priced, kv_cache_memory=2 * 2**30))
    policy = built.replay.scheduler.policy
    assert isinstance(policy, PricedVllm) and isinstance(policy.params, VampParams)
    assert policy.params.block_size == built.config.block_size
    plain = build_replay(workload, ReplayConfig(policy="vllm", kv_cache_memory=2 * 2**30))
    assert built.budget.kv_budget_bytes == plain.budget.kv_budget_bytes  # --kv-cache-memory is the KV's own
    assert built.budget.staging_room_bytes > 0 == plain.budget.staging_room_bytes  # it offloads: staging room
    built.replay.run()
    built.replay.scheduler.kv.check_invariants()


def test_the_engine_prices_a_newly_registered_policy(priced, tiny_checkpoint):
    pytest.importorskip("torch")
    from moetide.engine.runner import Engine

    engine = Engine(tiny_checkpoint("mixtral"), policy=priced, kv_cache_memory=2**20, max_offload_ratio=0.25,
                    costs={"prefill_s_per_token": 3e-6, "copy_s_per_expert": 1e-6, "expert_call_s": 2e-5})
    policy = engine.parts.scheduler.policy
    assert isinstance(policy, PricedVllm) and isinstance(policy.params, VampParams)
    assert engine.parts.step_stats is not None  # the runner feeds the steps the policy's costs read
