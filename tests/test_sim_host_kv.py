"""A host KV tier in replay (sim.host_kv): the engine's two-tier pool and split policies, charged by perf.offload."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from moetide.commands.replay import flag_message
from moetide.core.splits import BASELINES, SPLIT_POLICIES
from moetide.errors import UserError
from moetide.sim.host_kv import SeqKV
from moetide.sim.setup import ReplayConfig, build_replay, ring_blocks, run_replay
from moetide.workloads import generate_agent_sessions

TIGHT = dict(model="qwen3-30b-a3b", gpu="h100", kv_cache_memory=2 * 2**30)  # preempts, evicts on these sessions


def sessions():
    return generate_agent_sessions(3, num_sessions=6)


def test_seq_kv_counts_tokens_by_residency_and_grows():
    # blocks of 4: device, device, host, host(partial: 2 of 4 used), then a held host block not yet used
    s = SeqKV.of([False, False, True, True, True], 14, 4)
    assert (s.device_blocks, s.host_blocks, s.host_tokens, s.device_tokens) == (2, 2, 6, 8)
    s.grow(4)
    s.grow(4)  # fills the fourth block
    assert (s.device_blocks, s.host_blocks, s.host_tokens, s.context) == (2, 2, 8, 16)
    s.grow(4)  # into the fifth block
    assert (s.host_blocks, s.host_tokens) == (3, 9)
    d = SeqKV.of([True, False], 6, 4)  # a host block, then a partial device block (placement is not sticky)
    assert (d.device_blocks, d.host_blocks, d.host_tokens, d.device_tokens) == (1, 1, 4, 2)
    d.grow(4)
    assert (d.host_tokens, d.device_tokens) == (4, 3)


def test_a_host_tier_replaces_preemption_and_is_charged():
    without, _ = run_replay(sessions(), ReplayConfig(**TIGHT))
    with_host, _ = run_replay(sessions(), ReplayConfig(**TIGHT, kv_host_memory=16 * 2**30))
    m0, m1 = without["metrics"], with_host["metrics"]
    assert m0["preemptions"] > 0 and m1["preemptions"] < m0["preemptions"]
    assert m1["prefix_hit_rate"] > m0["prefix_hit_rate"] + 0.2  # prefixes kept on the host are hit there
    assert m1["completed"] + m1["failed"] == sessions().num_requests
    host = m1["host_kv"]
    assert host["steps"] > 0 and host["cpu_tokens"] > 0 and host["added_s"] > 0 and host["policy"] == "writescope"
    mem = with_host["config"]["memory"]
    assert mem["device_kv_blocks"] == mem["num_blocks"] - mem["ring_blocks"] and mem["ring_blocks"] > 0
    assert mem["host_kv_blocks"] == int(16 * 2**30 // mem["block_bytes"])
    assert "host_kv" not in m0 and "host_kv_blocks" not in without["config"]["memory"]


def test_evicting_device_prefixes_first_keeps_running_kv_on_the_device():
    """--device-prefixes evict: the least recently used cached device prefixes go before new KV spills, so less
    KV is attended from the host; keep (the default) spills and keeps them."""
    keep, _ = run_replay(sessions(), ReplayConfig(**TIGHT, kv_host_memory=16 * 2**30))
    evict, _ = run_replay(sessions(), ReplayConfig(**TIGHT, kv_host_memory=16 * 2**30, device_prefixes="evict"))
    k, e = keep["metrics"]["host_kv"], evict["metrics"]["host_kv"]
    assert e["cpu_tokens"] + e["streamed_tokens"] < 0.98 * (k["cpu_tokens"] + k["streamed_tokens"])  # 4% here
    assert e["device_tokens"] > 1.05 * k["device_tokens"] and e["added_s"] < k["added_s"]
    built = build_replay(sessions(), ReplayConfig(**TIGHT, device_prefixes="evict"))  # no tier: nothing to prefer
    assert not built.replay.scheduler.kv.evict_device_prefixes


def test_the_pool_uses_device_blocks_first():
    built = build_replay(sessions(), ReplayConfig(**TIGHT, kv_host_memory=16 * 2**30))
    pool, host = built.replay.scheduler.kv.pool, built.host_kv
    device = built.budget.num_blocks - ring_blocks(built.budget)
    assert pool.num_blocks == device + host.num_host_blocks and pool.host_tier == host.tier
    from moetide.perf import weights_per_gpu
    from moetide.specs import get_model

    routed = weights_per_gpu(get_model("qwen3-30b-a3b")).routed_expert_bytes
    line_ids = -(-routed // built.expert_line.block_bytes)  # every expert offloaded: the line's most ids
    assert host.first_host_id > built.budget.num_blocks + line_ids  # above any id the expert line can hand out
    first = pool.allocate(device)
    assert max(first) < device  # every device block before any host block
    second = pool.allocate(3)
    assert all(b >= host.first_host_id for b in second)
    pool.free(first + second)


@pytest.mark.parametrize("policy,prefixes,active", [
    ("writescope", "keep", None), ("transfer-all", "keep", None), ("cpu-all", "keep", None),
    ("writescope", "evict", None), ("writescope", "keep", 1.0)])
def test_fast_decode_runs_are_exact_with_a_host_tier(policy, prefixes, active):
    """The decode runs grow each sequence's residency step by step without the pool: every metric must be the
    same as stepping one by one (with an admission bound too: a run starts only while the queue's head waits)."""
    results = []
    for fast in (False, True):
        built = build_replay(sessions(), ReplayConfig(
            **TIGHT, kv_host_memory=16 * 2**30, split_policy=policy, device_prefixes=prefixes,
            kv_host_active_memory=None if active is None else int(active * 2**30)))
        built.replay.fast_forward = fast
        metrics = built.replay.run()
        built.replay.scheduler.kv.pool.check_invariants()
        results.append((metrics.to_dict(), list(metrics.ttft), list(metrics.itl), built.host_kv.counters))
    assert results[0] == results[1]


def test_split_policies_on_the_same_schedule():
    """All turns sent at once (open loop at t = 0): the schedule does not depend on step times, so every policy
    sees the same steps, and writescope adds no more than the best baseline (its planner is the charged model
    linearised: within 2%)."""
    wl = sessions()
    opened = replace(wl, mode="open", sessions=tuple(
        replace(s, start_s=0.0, turns=tuple(replace(t, arrival_s=0.0) for t in s.turns)) for s in wl.sessions))
    added, shares, steps = {}, {}, set()
    for policy in SPLIT_POLICIES:
        result, _ = run_replay(opened, ReplayConfig(**TIGHT, kv_host_memory=16 * 2**30, split_policy=policy))
        host = result["metrics"]["host_kv"]
        added[policy], shares[policy] = host["added_s"], host["cpu_share"]
        steps.add((result["metrics"]["steps"], host["steps"], host["cpu_tokens"] + host["streamed_tokens"]))
    assert len(steps) == 1  # one schedule
    assert shares["transfer-all"] == 0 and shares["cpu-all"] == 1 and 0 < shares["fixed-ratio"] < 1
    assert added["writescope"] <= 1.02 * min(added[b] for b in BASELINES)
    assert added["transfer-all"] > 1.5 * added["writescope"]


def test_a_slower_cpu_is_learned_by_writescope_only():
    results = {}
    for policy in ("writescope", "cpu-all"):
        for slowdown in (1.0, 3.0):
            result, _ = run_replay(sessions(), ReplayConfig(**TIGHT, kv_host_memory=16 * 2**30, split_policy=policy,
                                                            cpu_slowdown=slowdown))
            results[policy, slowdown] = result["metrics"]["host_kv"]
    assert results["writescope", 1.0]["correction_factor"] == pytest.approx(1.0, rel=1e-9)
    assert results["writescope", 3.0]["correction_factor"] == pytest.approx(3.0, rel=0.01)
    assert results["writescope", 3.0]["cpu_share"] < results["writescope", 1.0]["cpu_share"]
    assert results["cpu-all", 3.0]["cpu_share"] == 1 and results["cpu-all", 3.0]["correction_factor"] == 1.0


@pytest.mark.parametrize("options,message", [
    (dict(kv_host_memory=-1 * 2**30), "--kv-host-memory must be"),
    (dict(kv_host_memory=8 * 2**30, tp=2), "use --tensor-parallel-size 1"),
    (dict(kv_host_memory=8 * 2**30, policy="vamp"), "not modeled yet"),
    (dict(split_policy="half"), "--split-policy must be one of"),
    (dict(split_fixed_ratio=1.5), "--split-fixed-ratio must be in"),
    (dict(cpu_slowdown=0.0), "--cpu-slowdown must be"),
    (dict(kv_host_memory=8 * 2**30, cold_experts="cpu"), "not modeled; use --cold-experts fetch"),
    (dict(device_prefixes="drop"), "--device-prefixes must be one of"),
    (dict(kv_host_active_memory=1 * 2**30), "give --kv-host-memory too"),
    (dict(kv_host_memory=8 * 2**30, kv_host_active_memory=9 * 2**30),
     r"must be in \(0, --kv-host-memory = 8589934592\] bytes"),
    (dict(kv_host_memory=8 * 2**30, kv_host_active_memory=0 * 2**30), "--kv-host-active-memory must be in"),
])
def test_bad_host_kv_settings_are_one_line_errors(options, message):
    """The config names its fields (a ValueError); the CLI says the same in its flags."""
    with pytest.raises(ValueError, match="ReplayConfig\\.") as error:
        ReplayConfig(**{**TIGHT, **options})
    assert re.search(message, flag_message(str(error.value)))


def test_a_host_tier_larger_than_the_host_is_refused():
    with pytest.raises(UserError, match="exceeds the host's DRAM"):
        build_replay(sessions(), ReplayConfig(**TIGHT, kv_host_memory=int(1e6 * 2**30)))


def test_replay_cli_with_a_host_tier(capsys, tmp_path):
    from moetide.cli import main

    trace = tmp_path / "t.jsonl"  # six 4k-token prompts at once: 24k tokens against ~8k of device KV
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": 4000 + i, "output_length": 20,
                                         "hash_ids": [100 * i + j for j in range(8)]}) + "\n" for i in range(6)))
    out = tmp_path / "r.json"
    assert main(["replay", str(trace), "--model", "qwen3-30b-a3b", "--gpu", "h100", "--kv-cache-memory", "1GiB",
                 "--kv-host-memory", "4GiB", "--split-policy", "fixed-ratio", "--split-fixed-ratio", "0.25",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "host KV tier" in text and "CPU share 0.2" in text and "(fixed-ratio)" in text
    result = json.loads(out.read_text())
    assert result["config"]["split_policy"] == "fixed-ratio" and result["metrics"]["host_kv"]["steps"] > 0
    assert result["metrics"]["preemptions"] == 0 and result["metrics"]["completed"] == 6


def test_an_admission_bound_on_host_kv_trades_ttft_for_tpot(capsys, tmp_path):
    """Six 4k-token prompts at once against ~8k tokens of device KV, on the plain roofline (a fitted profile's
    per-layer floors are the same with and without the bound and only dilute the ratio). Unbounded, all run together and every step
    attends the spilled KV of four; with --kv-host-active-memory 0.5GiB (341 blocks, one spilled prompt is 250) the
    rest wait, so steps are shorter and first tokens later. Every request completes either way."""
    from moetide.cli import main

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": 4000 + i, "output_length": 50,
                                         "hash_ids": [100 * i + j for j in range(8)]}) + "\n" for i in range(6)))
    runs = {}
    for bound in ([], ["--kv-host-active-memory", "0.5GiB"]):
        out = tmp_path / "r.json"
        assert main(["replay", str(trace), "--model", "qwen3-30b-a3b", "--gpu", "h100", "--kv-cache-memory", "1GiB",
                     "--kv-host-memory", "4GiB", "--engine-profile", "roofline", *bound, "--json", str(out)]) == 0
        runs[bool(bound)] = json.loads(out.read_text())["metrics"]
    text = capsys.readouterr().out
    assert "host KV bound         512 MiB (341 blocks) attended per step" in text
    free, bounded = runs[False], runs[True]
    assert free["host_kv"]["peak_host_blocks_used"] > 3 * 250 and free["host_kv"]["bound_waits"] == 0
    # the bound counts prompts, not outputs: each of the six may add its 50 output tokens (4 blocks of 16)
    assert bounded["host_kv"]["peak_host_blocks_used"] <= 341 + 6 * 4 and bounded["host_kv"]["bound_waits"] > 0
    assert bounded["tpot_s"]["p50"] < 0.6 * free["tpot_s"]["p50"]
    assert bounded["ttft_s"]["p90"] > free["ttft_s"]["p90"]
    assert free["completed"] == bounded["completed"] == 6 and bounded["preemptions"] == 0


def test_host_hits_past_the_bound_are_copied_and_charged():
    """With 4 GiB of device KV and a 2 GiB bound, later turns' host prefix hits move to device blocks: each copy is
    charged at the link's streaming rate, and the replay is the same stepped or fast-forwarded."""
    config = ReplayConfig(model="qwen3-30b-a3b", gpu="h100", kv_cache_memory=4 * 2**30, kv_host_memory=16 * 2**30,
                          kv_host_active_memory=2 * 2**30)
    results = []
    for fast in (False, True):
        built = build_replay(sessions(), config)
        built.replay.fast_forward = fast
        metrics = built.replay.run()
        built.replay.scheduler.kv.check_invariants()
        sched, counters = built.replay.scheduler, built.host_kv.counters
        results.append((metrics.to_dict(), list(metrics.ttft), sched.num_host_hits_promoted, counters))
    (m, _, promoted, counters), _ = results
    assert results[0] == results[1]
    assert promoted == counters.promoted_blocks > 0 and m["completed"] == sessions().num_requests
    costs = built.host_kv._costs(0, 1)
    per_block = built.host_kv.attention.block_bytes * costs.stream_s_per_byte
    assert promoted * per_block < counters.promote_s <= promoted * per_block + counters.steps * costs.stream_fixed_s


def test_compare_refuses_a_bad_policy_before_any_replay(capsys, monkeypatch):
    """--kv-host-memory with vamp among the policies: one error line before the first replay runs, not after."""
    from moetide.cli import main
    from moetide.commands import compare, sweep  # noqa: F401 (imported before the patch: sweep binds the name)

    ran = []
    monkeypatch.setattr(compare, "replay_with_metrics", lambda *a: ran.append(a) or ({}, None))
    assert main(["compare", "--kv-host-memory", "4GiB", "--policies", "vllm,vamp"]) == 2
    assert "not modeled yet" in capsys.readouterr().err and not ran


def test_the_replay_prices_a_step_as_the_engine_does():
    """The replay caches the coefficients that do not depend on the device-resident tokens: its costs must equal
    ``split_coefficients``' (what the engine's ``PerfSplitCosts`` passes the same stepper), in any call order."""
    import dataclasses

    from moetide.core.splits import SplitCosts
    from moetide.perf.offload import split_coefficients

    host = build_replay(sessions(), ReplayConfig(**TIGHT, kv_host_memory=16 * 2**30)).host_kv
    for device_tokens, num_queries in [(0, 1), (5000, 1), (123, 64), (10**6, 1), (7, 64), (0, 8192)]:
        expected = SplitCosts(**dataclasses.asdict(split_coefficients(host.attention, device_tokens, num_queries)))
        assert host._costs(device_tokens, num_queries) == expected


def test_a_failed_allocation_evicts_nothing():
    """allocate_slots returns None with no effect: with both tiers full it must not evict device prefixes first."""
    from moetide.core.blocks import BlockPool, HostTier
    from moetide.core.kv_manager import KVCacheManager

    pool = BlockPool([0, 1], host_tier=HostTier(10, 1))
    kv = KVCacheManager(pool, 4, evict_device_prefixes=True)
    assert kv.allocate_slots("a", 8, [1, 2]) == [0, 1]  # two full device blocks, cached under 1 and 2
    kv.free("a")
    assert pool.num_cached_free_blocks == 2
    assert kv.allocate_slots("b", 16, []) is None  # 4 blocks: more than the pool has
    assert pool.num_cached_free_blocks == 2 and pool.num_evicted_blocks == 0
    assert kv.allocate_slots("c", 4, []) == [1]  # 1 block: the oldest device prefix (the chain's tail) goes
    pool.check_invariants()
