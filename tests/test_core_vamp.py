"""VAMP: each way out is chosen when it should be; the cap holds; conversion moves no KV; reclaim waits."""

import pytest

from moetide.core.blocks import BlockPool
from moetide.core.expert_line import ExpertLine
from moetide.core.experts import ExpertResidency, ExpertResidencyConfig
from moetide.core.hashing import hash_token_blocks
from moetide.core.kv_manager import KVCacheManager
from moetide.core.pressure import EvictPrefix, OffloadExperts, Preempt, PressureView, VampParams, get_policy
from moetide.core.request import Request
from moetide.core.scheduler import Scheduler, SchedulerConfig, SessionState

BS = 4
BLOCK_BYTES = 100
EXPERT_BYTES = 200  # one offloaded expert gives two blocks


def make_line(pool, max_ratio=0.25):
    residency = ExpertResidency(ExpertResidencyConfig(num_layers=2, num_experts=4, expert_bytes=EXPERT_BYTES,
                                                      max_offload_ratio=max_ratio))
    return ExpertLine(residency, pool, block_bytes=BLOCK_BYTES, first_block_id=1000)


def params(staging_per_expert_s, prefill_s_per_token=1e-3, **kw):
    return VampParams(prefill_s_per_token=prefill_s_per_token, decode_step_s=0.01,
                      staging_s_per_step=lambda n, tokens: n * staging_per_expert_s, block_size=BS, horizon_s=10.0, **kw)


def cached_prefix(pool, session, num_blocks, seed):
    """A finished request's cached-free chain, registered by ``session``."""
    kv = KVCacheManager(pool, BS)
    tokens = [seed] * (num_blocks * BS)
    kv.allocate_slots(f"done-{seed}", len(tokens), hash_token_blocks(tokens, BS), owner=session)
    kv.free(f"done-{seed}")


def request(rid, computed, session=None):
    r = Request(rid, num_prompt_tokens=max(computed, 1), max_output_tokens=8, block_size=BS, block_hashes=[],
                session_id=session)
    r.num_computed_tokens = computed
    return r


def view(pool, line, shortfall, requester, running=False, preemptible=(), sessions=None, now=1000.0, nrun=1):
    return PressureView(shortfall, requester, running, list(preemptible), pool, frozenset(), now, sessions or {},
                        line, nrun, list(preemptible), 0, 0.01)


def test_idle_sessions_prefix_is_evicted_rather_than_moving_the_line():
    pool = BlockPool(range(8))
    cached_prefix(pool, "idle", 4, seed=1)
    line = make_line(pool)
    sessions = {"idle": SessionState(last_active_s=0.0)}  # idle for 1000 s: p(reuse) = e^-(1000/300)
    plan = get_policy("vamp", params=params(staging_per_expert_s=1e-3)).relieve(
        view(pool, line, 2, request("new", 0), sessions=sessions))
    assert plan == [EvictPrefix(2)]


def test_cold_experts_go_when_the_prefix_is_hot_and_staging_is_cheap():
    pool = BlockPool(range(8))
    cached_prefix(pool, "active", 4, seed=1)
    line = make_line(pool)
    sessions = {"active": SessionState(last_active_s=999.0, num_in_flight=1)}  # its next turn is running
    plan = get_policy("vamp", params=params(staging_per_expert_s=1e-7)).relieve(
        view(pool, line, 3, request("new", 0), sessions=sessions))
    assert plan == [OffloadExperts(((0, 0), (1, 0)))]  # two experts (4 blocks), spread over the two layers


def test_a_request_that_just_started_is_preempted_before_anything_costly():
    pool = BlockPool(range(8))
    line = make_line(pool)
    fresh = request("fresh", computed=4)  # 4 tokens to recompute
    old = request("old", computed=400)
    plan = get_policy("vamp", params=params(staging_per_expert_s=1e-2)).relieve(
        view(pool, line, 1, old, running=True, preemptible=[fresh], nrun=2))
    assert plan == [Preempt("fresh")]


def test_the_cap_is_never_exceeded():
    pool = BlockPool(range(4))
    line = make_line(pool, max_ratio=0.25)  # 2 of 8 experts
    assert line.residency.max_num_offloaded == 2
    policy = get_policy("vamp", params=params(staging_per_expert_s=0.0))
    plan = policy.relieve(view(pool, line, 100, request("w", 0)))
    assert plan == []  # the cap's 4 blocks cannot cover 100: a waiting request waits, nothing moves
    plan = policy.relieve(view(pool, line, 4, request("w", 0)))
    assert plan == [OffloadExperts(((0, 0), (1, 0)))]
    line.offload(plan[0].region)
    with pytest.raises(ValueError):
        line.offload([(0, 1)])
    assert line.residency.offloaded_ratio == 0.25
    assert policy.relieve(view(pool, line, 1, request("w", 0))) == []


def test_conversion_moves_no_resident_kv():
    pool = BlockPool(range(6))
    kv = KVCacheManager(pool, BS)
    tokens = list(range(16))
    kv.allocate_slots("a", 16, hash_token_blocks(tokens, BS))
    before = {b: (pool.ref_count(b), pool.block_hash(b)) for b in pool.block_ids()}
    line = make_line(pool)
    assert line.offload([(0, 3)]) == [1000, 1001]
    assert {b: (pool.ref_count(b), pool.block_hash(b)) for b in before} == before
    assert kv.get_blocks("a") == [0, 1, 2, 3]
    line.check_invariants()


def test_reclaim_waits_until_the_regions_blocks_are_free():
    pool = BlockPool([])
    line = make_line(pool)
    line.offload([(1, 2)])
    taken = pool.allocate(1)
    assert taken == [1000]
    assert not line.reclaim_last() and line.residency.num_offloaded == 1
    pool.free(taken)
    assert line.reclaim_last() and line.residency.num_offloaded == 0 and pool.num_blocks == 0
    line.check_invariants()


def test_vamp_in_the_scheduler_admits_by_offloading_and_reclaims_later():
    pool = BlockPool(range(4))
    line = make_line(pool, max_ratio=0.5)
    policy = get_policy("vamp-reclaim", params=params(1e-7, reclaim_patience_s=1.0, reclaim_free_share=0.5))
    sched = Scheduler(SchedulerConfig(), KVCacheManager(pool, BS), policy, expert_line=line)
    sched.add_request(Request.from_tokens("a", list(range(20)), 2, BS, session_id="s"))  # 5 blocks > 4
    out = sched.schedule(0.0)
    assert out.offloaded == [(0, 0)] and [r.request_id for r, _ in out.scheduled] == ["a"]
    while sched.has_work:
        sched.update(out, None, sched.now_s + 0.1)
        out = sched.schedule(sched.now_s)
    for t in (5.0, 7.0):  # free for long enough: the region goes back to its expert
        out = sched.schedule(t)
    assert line.num_reclaims == 1 and line.residency.num_offloaded == 0
    line.check_invariants()
