"""The plugin's scheduler seam on vLLM 0.32's real ``Scheduler``, with no model weights (``moetide_testing.vllm_harness``).

* Under ``policy: vllm`` the plugin changes nothing: every step equals stock vLLM's, block ids included.
* Under ``vamp`` the plugin and moetide's core, driven from one cost record, make the same decisions step for step:
  scheduled tokens, preemptions, evictions and line moves (``moetide_testing.vllm_differential``), on recorded traces.
* The line's moves reach the step's connector metadata once each, in order.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")

from moetide_testing.vllm_differential import compare, mooncake, run_side, sampled_token, vllm_record, weka  # noqa: E402
from moetide_testing.vllm_harness import HybridSpec, VllmSide, VllmSideConfig  # noqa: E402
from moetide.vllm.scheduler import MoetideAsyncScheduler, MoetideScheduler  # noqa: E402
from moetide.vllm.settings import ExpertShape, PluginSettings  # noqa: E402

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
COSTS = {"prefill_s_per_token": 2e-5, "copy_s_per_expert": 2e-6}
QWEN3_30B = ExpertShape(num_layers=48, num_experts=128, experts_per_token=8, expert_bytes=3 * 2048 * 768 * 2)
QWEN3_NEXT = ExpertShape(num_layers=48, num_experts=512, experts_per_token=10, expert_bytes=3 * 2048 * 512 * 2)


def token(request_id: str, index: int) -> int:
    return 1000 + index


def drive(config: VllmSideConfig, *, num_requests: int = 40, max_steps: int = 4000, seed: int = 0):
    """Requests sharing prefixes of several lengths, more than the pool holds at once; every step checked."""
    rng = random.Random(seed)
    side = VllmSide(config)
    shared = [rng.randrange(32000) for _ in range(600)]
    for i in range(num_requests):
        prompt = shared[: rng.randrange(600)] + [rng.randrange(32000) for _ in range(rng.randrange(100, 900))]
        side.add_request(f"r{i}", prompt, rng.randrange(50, 300))
    records = []
    while side.has_work and len(records) < max_steps:
        records.append(side.step(token))
        side.check()
    assert not side.has_work, "the requests did not finish"
    return side, records


def settings(policy: str, experts: ExpertShape = QWEN3_30B, horizon_s: float = 0.5) -> PluginSettings:
    return PluginSettings(policy=policy, costs=COSTS, experts=experts, vamp_horizon_s=horizon_s)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["full-attention", "hybrid"])
def test_policy_vllm_is_stock_vllm_block_for_block(hybrid, async_scheduling):
    """Stock vLLM's ``Scheduler``, or its ``AsyncScheduler`` where vLLM schedules asynchronously, against
    ``MoetideScheduler``, which becomes ``MoetideAsyncScheduler`` there."""
    common = dict(num_blocks=60 if hybrid else 500, block_size=64 if hybrid else 16, max_model_len=4096,
                  max_num_batched_tokens=1024, max_num_seqs=32,
                  hybrid=HybridSpec(attention_block_size=64) if hybrid else None, async_scheduling=async_scheduling)
    _, stock = drive(VllmSideConfig(**common))
    side, plugged = drive(VllmSideConfig(**common, plugin=settings("vllm", QWEN3_NEXT if hybrid else QWEN3_30B)))
    assert type(side.sched) is (MoetideAsyncScheduler if async_scheduling else MoetideScheduler)
    assert len(stock) == len(plugged)
    for a, b in zip(stock, plugged):
        assert (a.scheduled, a.preempted, a.new_hits, a.new_block_ids, a.finished, a.num_free_blocks,
                a.num_evicted) == (b.scheduled, b.preempted, b.new_hits, b.new_block_ids, b.finished,
                                   b.num_free_blocks, b.num_evicted)
        assert b.line_ops == () and not b.line.offloaded
    assert sum(len(r.preempted) for r in stock) > 0 and sum(r.num_evicted for r in stock) > 0  # pressure was real
    assert side.sched.moetide.pool.num_reserved_blocks == 0  # vllm never offloads: no reserve


needs_traces = pytest.mark.skipif(not TRACES.is_dir(), reason=f"recorded traces not found at {TRACES}")


def weka_slice():
    return weka(TRACES, 8, 4, 20, 16_384, 10)  # 8 sessions x 4 turns, closed loop


@needs_traces
def test_plugin_and_core_agree_on_a_weka_slice():
    """Contexts up to 16K tokens on a 6.4K-token pool: the first turn fits only once the line has moved, and
    regions come back as pressure recedes."""
    result = compare("weka-vamp", weka_slice(), num_blocks=400, plugin=settings("vamp"))
    assert result["identical_share"] == 1.0, result["first_divergence"]
    vllm_side = result["vllm"]
    assert vllm_side["preemptions"] > 0 and vllm_side["evicted_blocks"] > 0
    assert vllm_side["offloaded_experts"] > 0 and vllm_side["reclaimed_regions"] > 0


@needs_traces
def test_plugin_and_core_agree_on_a_mooncake_slice():
    result = compare("mooncake-vllm", mooncake(TRACES, 60, 50, 4096), num_blocks=340, plugin=settings("vllm"))
    assert result["identical_share"] == 1.0, result["first_divergence"]
    assert result["vllm"]["preemptions"] > 0 and result["vllm"]["evicted_blocks"] > 0


@needs_traces
def test_plugin_and_core_agree_with_vamp_reclaim():
    result = compare("weka-vamp-reclaim", weka(TRACES, 8, 4, 20, 5000, 10), num_blocks=340,
                     plugin=settings("vamp-reclaim"))
    assert result["identical_share"] == 1.0, result["first_divergence"]
    assert result["vllm"]["offloaded_experts"] > 0 and result["vllm"]["evicted_blocks"] > 0


@needs_traces
def test_line_moves_reach_the_connector_metadata_once_each():
    longest = max(len(a.prompt) + a.max_tokens for s in weka_slice() for a in s)
    side = VllmSide(VllmSideConfig(num_blocks=400, max_num_seqs=1024, max_model_len=longest + 16,
                                   plugin=settings("vamp")))
    records = []
    run_side(side, weka_slice(), lambda s: s.step(sampled_token), lambda r: records.append(r) or vllm_record(r),
             100_000)
    ops = [op for r in records for op in r.line_ops]
    grown = [op for op in ops if op.grow]
    assert grown and [k for op in grown for k in op.region] == [k for r in records for k in r.line.offloaded]
    given_back = [op for op in ops if not op.grow]
    assert given_back and len(given_back) == sum(r.line.reclaimed for r in records)
    held: set[int] = set()
    for op in ops:  # a region's blocks come from the reserve and go back to it whole
        assert held.isdisjoint(op.block_ids) if op.grow else set(op.block_ids) <= held
        held = held | set(op.block_ids) if op.grow else held - set(op.block_ids)
    assert len(held) == side.sched.moetide.num_kv_blocks_granted
    side.check()


@needs_traces
@pytest.mark.parametrize("policy", ["vllm", "vamp"])
def test_plugin_and_core_agree_on_a_hybrid_weka_slice(policy):
    result = compare(f"hybrid-{policy}", weka(TRACES, 12, 4, 20, 16_384, 10), num_blocks=120, block_size=544,
                     hybrid=True, plugin=settings(policy, QWEN3_NEXT, horizon_s=2.0))
    assert result["identical_share"] == 1.0, result["first_divergence"]
    if policy != "vllm":
        assert result["vllm"]["offloaded_experts"] > 0


def test_moetides_scheduler_follows_vllms_choice_and_a_subclass_must_match_it():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from moetide.vllm.scheduler import refuse_foreign_scheduler

    class UsersSync(MoetideScheduler):
        pass

    side = VllmSide(VllmSideConfig(num_blocks=100, max_model_len=4096, plugin=settings("vllm"),
                                   async_scheduling=True))
    assert type(side.sched) is MoetideAsyncScheduler
    sched = side.sched
    kwargs = dict(vllm_config=sched.vllm_config, kv_cache_config=sched.kv_cache_config,
                  structured_output_manager=StructuredOutputManager(sched.vllm_config), block_size=sched.block_size,
                  hash_block_size=side.hash_block_size, log_stats=False)
    with pytest.raises(ValueError, match="vLLM schedules asynchronously here, and .*UsersSync subclasses the "
                                         "synchronous MoetideScheduler: subclass MoetideAsyncScheduler"):
        UsersSync(**kwargs)
    refuse_foreign_scheduler(UsersSync)
    with pytest.raises(ValueError, match="moetide's connector needs moetide's scheduler, not "
                                         "vllm.v1.core.sched.scheduler.Scheduler"):
        refuse_foreign_scheduler(Scheduler)


def test_vllms_scheduler_process_loads_no_moetide_engine():
    """The scheduler and connector price the policy from the cost record (``core.pressure.step_costs``): neither
    moetide's engine, its replay nor its server is imported into vLLM's engine-core process."""
    import subprocess
    import sys

    code = ("import sys; import moetide.vllm.scheduler, moetide.vllm.connector, moetide.vllm.metrics; "
            "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['moetide', 'engine'], ['moetide', 'sim'], "
            "['moetide', 'serve'], ['moetide', 'commands'])))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
