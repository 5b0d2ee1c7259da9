"""VAMP: each way out is chosen when it should be; the cap holds; conversion moves no KV; reclaim waits."""

import math

import pytest

from moetide.core.blocks import BlockPool
from moetide.core.expert_line import ByteLayout, ExpertLine, staging_room_bytes
from moetide.core.experts import ExpertResidency, ExpertResidencyConfig
from moetide.core.hashing import hash_token_blocks
from moetide.core.kv_manager import KVCacheManager
from moetide.core.pressure import EvictPrefix, OffloadExperts, Preempt, PressureView, VampParams, get_policy
from moetide.core.pressure.vamp_params import DecayedRate
from moetide.core.request import Request
from moetide.core.scheduler import Scheduler, SchedulerConfig

BS = 4
BLOCK_BYTES = 100
EXPERT_BYTES = 200  # one offloaded expert gives two blocks


def make_line(pool, max_ratio=0.25):
    residency = ExpertResidency(ExpertResidencyConfig(num_layers=2, num_experts=4, expert_bytes=EXPERT_BYTES,
                                                      max_offload_ratio=max_ratio))
    layout = ByteLayout(pool, block_bytes=BLOCK_BYTES, kv_bytes_per_expert=residency.config.expert_bytes,
                        first_block_id=1000)
    return ExpertLine(residency, layout)


class FakeSteps:
    """StepStats with a fixed staging share per offloaded expert; ``busy`` is set by a test."""

    def __init__(self, share_per_expert):
        self.share_per_expert = share_per_expert
        self.busy = 0.0
        self.tokens = 0.0  # time-weighted tokens per step

    def busy_s(self):
        return self.busy

    def staging_share(self, num_offloaded):
        return num_offloaded * self.share_per_expert

    def time_weighted_tokens(self):
        return self.tokens


def params(staging_per_expert, prefill_s_per_token=1e-3, **kw):
    """``staging_per_expert``: exposed staging per second of step time that each offloaded expert adds."""
    return VampParams(prefill_s_per_token=prefill_s_per_token, steps=FakeSteps(staging_per_expert),
                      block_size=BS, horizon_s=10.0, **kw)


def cached_prefix(pool, session, num_blocks, seed):
    """A finished request's cached-free chain, registered by ``session``; returns its hashes."""
    kv = KVCacheManager(pool, BS)
    tokens = [seed] * (num_blocks * BS)
    hashes = hash_token_blocks(tokens, BS)
    kv.allocate_slots(f"done-{seed}", len(tokens), hashes)
    kv.free(f"done-{seed}")
    return hashes


def request(rid, computed, session=None, hashes=()):
    r = Request(rid, num_prompt_tokens=max(computed, len(hashes) * BS, 1), max_output_tokens=8, block_size=BS,
                block_hashes=list(hashes), session_id=session)
    r.num_computed_tokens = computed
    return r


def view(pool, line, shortfall, requester, running=False, preemptible=(), now=1000.0, hits=(),
         whole_sequence=False):
    return PressureView(shortfall, requester, running, list(preemptible), pool, frozenset(hits), now, line,
                        list(preemptible), whole_sequence)


def relieve(policy, pressure):
    """What the scheduler does on a shortfall: the admission hook first for a waiting requester, then the
    policy."""
    if not pressure.requester_is_running:
        policy.admitting(pressure.requester, pressure.now_s, pressure.expert_line)
    return policy.relieve(pressure)


def evicted_then_back(policy, pool, line, now, seed, running=()):
    """A prefix is evicted through the policy, then asked for again by a waiting request (a ghost hit);
    returns the policy's answer to that request."""
    hashes = cached_prefix(pool, "s", 2, seed)
    plan = relieve(policy, view(pool, line, 2, request(f"new-{seed}", 0), preemptible=running, now=now))
    assert plan == [EvictPrefix(2)]
    pool.evict(2)
    return relieve(policy, view(pool, line, 1, request(f"back-{seed}", 0, hashes=hashes), preemptible=running,
                               now=now + 0.5))


def test_without_measured_reuse_the_line_stays_and_lru_eviction_covers():
    pool = BlockPool(range(8))
    cached_prefix(pool, "s", 4, seed=1)
    plan = relieve(get_policy("vamp", params=params(1e-7)), view(pool, make_line(pool), 2, request("new", 0)))
    assert plan == [EvictPrefix(2)]


def test_cold_experts_go_once_evicted_prefixes_are_seen_to_come_back():
    pool = BlockPool(range(8))
    line = make_line(pool)
    policy = get_policy("vamp", params=params(1e-7))
    running = [request("running", 4)]
    # nothing is cached any more and no review has allowed the line to move yet: the returning request waits
    assert evicted_then_back(policy, pool, line, 1000.0, seed=1, running=running) == []
    # the next review (one horizon on) finds the ghost hits worth more than the staging: the line moves
    cached_prefix(pool, "s", 2, seed=2)
    plan = relieve(policy, view(pool, line, 1, request("next", 0), preemptible=running, now=1011.0))
    assert plan == [OffloadExperts(((0, 0),))]  # one expert (two blocks) covers the shortfall of one


def test_a_review_keeps_the_window_while_pressure_holds_though_nothing_hits_it():
    """Once the ghost hits that grew the line have decayed, no review gives a window back on what it seems to
    save: a drain would lose the region's cached prefixes, and near the cache's cliff the LRU head undervalues the
    capacity. The allowance stays while shortfalls go on (the growth check and a calm pool bring it back)."""
    pool = BlockPool(range(8))
    line = make_line(pool)  # W = 1 block, one expert; the cap: 2
    policy = get_policy("vamp", params=params(1e-5))
    steps, running = policy.params.steps, [request("running", 4)]
    evicted_then_back(policy, pool, line, 1000.0, seed=1, running=running)
    allowed = []
    for t in range(1011, 1300):  # busy all along, no more ghost hits, a shortfall every second
        steps.busy = t - 1000.0
        cached_prefix(pool, "s", 1, seed=t)
        plan = relieve(policy, view(pool, line, 1, request(f"cold-{t}", 0), preemptible=running, now=float(t)))
        assert plan == [OffloadExperts(((0, 0),))]  # the test never applies it: the line has room each time
        allowed.append(policy._allowed)
        pool.evict(pool.num_cached_free_blocks)
    assert allowed[0] == 1 and max(allowed) == allowed[-1] == 2  # grown while the hits lasted, and kept
    assert policy.num_growths_undone == 0


def test_staging_dearer_than_the_measured_reuse_keeps_the_line():
    pool = BlockPool(range(8))
    line = make_line(pool)
    policy = get_policy("vamp", params=params(10.0))
    running = [request("running", 4)]
    evicted_then_back(policy, pool, line, 1000.0, seed=1, running=running)
    policy.params.steps.busy = 11.0  # busy all along: staging costs its full share
    cached_prefix(pool, "s", 2, seed=2)
    plan = relieve(policy, view(pool, line, 1, request("next", 0), preemptible=running, now=1011.0))
    assert plan == [EvictPrefix(1)] and line.residency.num_offloaded == 0


def test_re_prefill_is_priced_at_the_blocks_position():
    """A ghost hit deep in a long context saves its attention too (vLLM pays it to re-prefill there)."""
    p = params(0.0, prefill_s_per_token=1e-5, prefill_s_per_token_per_context=1e-9)
    assert p.block_prefill_s(0) == pytest.approx(BS * (1e-5 + 1e-9 * BS / 2))
    assert p.block_prefill_s(25_000) == pytest.approx(BS * (1e-5 + 1e-9 * 25_000.5 * BS))


def test_a_running_requester_with_nothing_to_evict_preempts_the_newest():
    pool = BlockPool(range(8))
    line = make_line(pool)
    fresh, old = request("fresh", computed=4), request("old", computed=400)
    plan = relieve(get_policy("vamp", params=params(1e-2)), view(pool, line, 1, old, running=True,
                                                                  preemptible=[fresh]))
    assert plan == [Preempt("fresh")]


def test_the_cap_is_never_exceeded():
    pool = BlockPool(range(4))
    line = make_line(pool, max_ratio=0.25)  # 2 of 8 experts
    assert line.residency.max_num_offloaded == 2
    policy = get_policy("vamp", params=params(0.0))
    plan = relieve(policy, view(pool, line, 100, request("w", 0)))
    assert plan == []  # the cap's 4 blocks cannot cover 100: a waiting request waits, nothing moves
    plan = relieve(policy, view(pool, line, 4, request("w", 0)))
    assert plan == [OffloadExperts(((0, 0), (1, 0)))]  # nothing runs: moving the line is the only way
    line.offload(plan[0].region)
    with pytest.raises(ValueError):
        line.offload([(0, 1)])
    assert line.residency.offloaded_ratio == 0.25
    assert relieve(policy, view(pool, line, 1, request("w", 0))) == []


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


@pytest.mark.parametrize("policy_name", ["vamp", "vamp-reclaim"])
def test_a_region_the_line_no_longer_allows_drains_and_goes_back(policy_name):
    """Once the allowance falls below what is offloaded, the last region drains: its free blocks leave the pool at
    once, a block in use leaves when its request lets it go, nothing is allocated from it meanwhile, and the
    experts get their pages back once it is empty. If the line grows again first, the region stays."""
    pool = BlockPool(range(4))
    line = make_line(pool)
    policy = get_policy(policy_name, params=params(1e-3))
    policy._allowed = 1  # what a review grew it to (the reviews' own moves are tested above)
    line.offload([(0, 0)])
    assert pool.allocate(5) == [0, 1, 2, 3, 1000]
    policy._allowed = 0  # ... and what a later review took back
    assert not policy.maybe_reclaim(line, pool, 1.0)
    assert pool.is_draining(1001) and pool.num_drained_blocks == 1 and pool.allocate(1) is None
    pool.free([1000])
    assert policy.maybe_reclaim(line, pool, 2.0) and line.residency.num_offloaded == 0 and pool.num_blocks == 4
    assert policy.num_given_back == 1
    policy._allowed = 1
    line.offload([(0, 0)])
    assert pool.allocate(1) == [1000]
    policy._allowed = 0
    assert not policy.maybe_reclaim(line, pool, 3.0) and pool.is_draining(1001)
    policy._allowed = 1  # the line grows back before the region is empty: it stays, its blocks are KV again
    assert not policy.maybe_reclaim(line, pool, 4.0)
    assert not pool.is_draining(1001) and pool.allocate(1) == [1001] and line.residency.num_offloaded == 1
    line.check_invariants()
    pool.check_invariants()


def test_without_give_back_the_line_only_grows():
    """``give_back=False`` (the VAMP paper's controller): a region the allowance no longer covers stays while any
    of its blocks is in use."""
    pool = BlockPool(range(4))
    line = make_line(pool)
    policy = get_policy("vamp", params=params(1e-3, give_back=False))
    line.offload([(0, 0)])
    assert pool.allocate(5) == [0, 1, 2, 3, 1000]
    for t in range(5):
        assert not policy.maybe_reclaim(line, pool, float(t))
    assert not pool.is_draining(1001) and pool.allocate(1) == [1001]


def test_once_pressure_has_receded_for_good_the_line_comes_back_a_window_at_a_time():
    """No shortfall, so no review: once the pool has had room to spare for ``calm_reviews`` horizons (30 s here,
    checked every 5 s), the allowance falls by a window (one expert) and its region goes back; the next window
    needs as long again of the smaller pool, from the check after; a check that finds no room restarts the
    clock."""
    pool = BlockPool(range(8))
    line = make_line(pool)
    policy = get_policy("vamp", params=params(1e-3, calm_reviews=3.0))
    policy._allowed = 2  # what reviews grew it to
    line.offload([(0, 0)])
    line.offload([(1, 0)])
    given_back = {}
    for t in range(0, 100, 5):
        held = pool.allocate(pool.num_free_blocks) if t == 10 else None  # no room at the check at 10 s
        if policy.maybe_reclaim(line, pool, float(t)):
            given_back[t] = line.residency.num_offloaded
        if held:
            pool.free(held)
        line.check_invariants()
        pool.check_invariants()
    assert given_back == {45: 1, 80: 0}  # room since 15 s; the smaller pool's own from the next check, 50 s
    assert policy.num_given_back == 2 and pool.num_blocks == 8


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
    # staging that costs more than re-prefilling the region's blocks once the pressure is gone: only the watermark
    # gives the region back
    policy = get_policy("vamp-reclaim", params=params(1e-2, reclaim_hold_s=3.0))
    sched = Scheduler(SchedulerConfig(), KVCacheManager(pool, BS), policy, expert_line=line)
    sched.add_request(Request.from_tokens("a", list(range(20)), 2, BS, session_id="s"))  # 5 blocks > 4
    out = sched.schedule(0.0)
    assert out.offloaded == [(0, 0)] and [r.request_id for r, _ in out.scheduled] == ["a"]
    steps = policy.params.steps
    while sched.has_work:
        sched.update(out, None, sched.now_s + 0.1)
        steps.busy = sched.now_s  # the accelerator is busy all along
        out = sched.schedule(sched.now_s)
    for t in (5.0, 10.0, 15.0, 20.0):  # the region's blocks are free but hold the cached prefix: no room to spare
        steps.busy = t
        out = sched.schedule(t)
    assert line.num_reclaims == 0 and line.residency.num_offloaded == 1
    pool.evict(pool.num_cached_free_blocks)  # the prefix cache is dropped: the pool has room to spare
    for t in (25.0, 30.0):  # ... seen at one check, held past reclaim_hold_s at the next: the region goes back
        steps.busy = t
        out = sched.schedule(t)
        assert line.num_reclaims == (t == 30.0)
    assert line.residency.num_offloaded == 0
    line.check_invariants()


def test_the_line_moves_out_while_reuse_is_measured_and_back_when_it_stops():
    """vamp-reclaim: each review (every 10 s here) moves the allowance one expert; prefixes evicted and asked for
    again every second push it out to the cap; once nothing is asked for again, the regions go back."""
    pool = BlockPool(range(8))
    line = make_line(pool)  # the cap: 2 experts, 4 blocks
    policy = get_policy("vamp-reclaim", params=params(1e-3))
    steps, running = policy.params.steps, [request("running", 4)]
    most = 0
    for t in range(0, 80):
        steps.busy = float(t)
        hashes = cached_prefix(pool, "s", 2, seed=t)
        plan = relieve(policy, view(pool, line, pool.num_cached_free_blocks, request(f"new-{t}", 0),
                                   preemptible=running, now=float(t)))
        for action in plan:
            if isinstance(action, OffloadExperts):
                line.offload(action.region)
            else:
                pool.evict(action.num_blocks)
        relieve(policy, view(pool, line, 1, request(f"back-{t}", 0, hashes=hashes), preemptible=running,
                            now=t + 0.5))
        policy.maybe_reclaim(line, pool, t + 0.9)
        most = max(most, line.residency.num_offloaded)
    assert most == 2
    for t in range(80, 600):
        steps.busy = float(t)
        policy.maybe_reclaim(line, pool, float(t))
        if not line.residency.num_offloaded:
            break
    assert line.residency.num_offloaded == 0 and 100 < t < 600
    line.check_invariants()


def test_plain_vamp_is_exact_under_the_decode_fast_path():
    """vamp reads nothing the replay's decode fast path skips, so it may use it; every metric must agree."""
    from moetide.sim.setup import ReplayConfig, build_replay
    from moetide.workloads import generate_agent_sessions

    results = []
    for fast in (False, True):
        built = build_replay(generate_agent_sessions(2, num_sessions=5),
                             ReplayConfig(kv_cache_memory=3 * 2**30, policy="vamp", vamp_horizon_s=30.0))
        assert not built.replay.scheduler.policy.reads_every_step
        built.replay.fast_forward = fast
        metrics = built.replay.run()
        results.append((metrics.to_dict(), list(metrics.ttft), list(metrics.itl), metrics.kv_usage,
                        metrics.offload_usage))
    assert results[0] == results[1]
    assert results[0][0]["offloaded_ratio_max"] > 0  # the line moved: the comparison covers offloads


def test_an_offloaded_expert_gives_its_whole_bytes_and_staging_room_is_counted_at_the_cap():
    """The pool gets every byte of an offloaded expert (the engine's arena gives its whole pages); the staging
    buffers' room, two layers of the most experts a layer can have offloaded, is kept outside the KV budget."""
    pool = BlockPool([])
    line = make_line(pool, 0.5)
    assert line.kv_bytes_per_expert == EXPERT_BYTES and line.blocks_gained(2) == 2 * EXPERT_BYTES // BLOCK_BYTES
    assert len(line.offload([(0, 0), (1, 0)])) == 2 * EXPERT_BYTES // BLOCK_BYTES
    assert line.reclaim_last() and pool.num_blocks == 0
    line.check_invariants()
    cap = line.residency.max_num_offloaded  # 4 of 2 layers x 4 experts: 2 a layer
    assert staging_room_bytes(line.residency.config, cap) == 2 * 2 * EXPERT_BYTES
    assert staging_room_bytes(line.residency.config, 3) == 2 * 2 * EXPERT_BYTES  # 3 over 2 layers: 2 in one


def test_admissions_without_a_shortfall_are_measured_through_the_schedulers_hook():
    """A pool with room never asks the policy for blocks, yet a prefix the policy evicted may come back to it:
    a ghost hit, what more KV would have saved. The scheduler's admission hook lets vamp count it."""
    pool = BlockPool(range(16))
    line = make_line(pool)
    policy = get_policy("vamp-reclaim", params=params(1e-3))
    prompt = list(range(8))
    kv = KVCacheManager(pool, BS)
    hashes = hash_token_blocks(prompt, BS)
    kv.allocate_slots("a", len(prompt), hashes)
    kv.free("a")
    assert relieve(policy, view(pool, line, pool.num_cached_free_blocks, request("new", 0))) == \
        [EvictPrefix(pool.num_cached_free_blocks)]  # what the policy evicts goes to its ghost list
    pool.evict(pool.num_cached_free_blocks)
    assert not policy._next.rate(1000.0)
    sched = Scheduler(SchedulerConfig(), KVCacheManager(pool, BS), policy, expert_line=line)
    sched.add_request(Request.from_tokens("b", prompt + [99] * 4, 1, BS, session_id="s"), now_s=1001.0)
    out = sched.schedule(1001.0)
    assert out.num_computed_before == [0] and not out.offloaded  # both prompt blocks missed; no shortfall
    assert policy._next.rate(1001.5) > 0


@pytest.mark.parametrize("busy_after", [0.2, 0.6])
def test_a_growth_that_makes_each_asked_token_dearer_is_taken_back(busy_after):
    """The review after a growth compares the accelerator's busy seconds per prompt token asked for with what they
    were when the line grew: three times dearer (busy 0.2 -> 0.6 of the time for the same demand), the window is
    taken back and the line holds; as dear as before, it keeps growing."""
    pool = BlockPool(range(8))
    line = make_line(pool)  # the cap: 2 experts
    policy = get_policy("vamp", params=params(1e-7))
    steps, running = policy.params.steps, [request("running", 4)]

    def ten_seconds(start, busy_share):  # a request of 8 prompt tokens asked for every second
        for t in range(start, start + 10):
            steps.busy += busy_share
            policy.admitting(request(f"ask-{t}", 0, hashes=[10_000 + t, 20_000 + t]), float(t), line)

    evicted_then_back(policy, pool, line, 1000.0, seed=1, running=running)  # ghost hits; the first review at 1010
    ten_seconds(1001, 0.2)
    cached_prefix(pool, "s", 2, seed=2)
    assert relieve(policy, view(pool, line, 1, request("grow", 0), preemptible=running, now=1011.0)) == \
        [OffloadExperts(((0, 0),))]  # the review grew the line by one expert (two blocks)
    line.offload(((0, 0),))
    evicted_then_back(policy, pool, line, 1011.5, seed=3, running=running)  # reuse is still measured
    ten_seconds(1012, busy_after)
    cached_prefix(pool, "s", 2, seed=4)
    plan = relieve(policy, view(pool, line, 1, request("next", 0), preemptible=running, now=1022.0))
    if busy_after > 0.2 * 1.1:
        assert policy.num_growths_undone == 1 and plan == [EvictPrefix(1)]  # no room for another offload
    else:
        assert policy.num_growths_undone == 0 and plan == [OffloadExperts(((1, 0),))]


@pytest.mark.parametrize("staging,grows", [(1e-7, True), (10.0, False)])
def test_the_recompute_a_preemption_causes_is_priced_against_staging(staging, grows):
    """Nothing to evict and a running requester: vLLM preempts. The victim's re-prefill (400 computed tokens,
    none kept by a cache) is what one more window of blocks would have saved; at the next review the line
    moves when staging costs less than half of it (the margin), and stays when it costs more."""
    pool = BlockPool(range(8))  # nothing cached: every block of the victim is recomputed on its return
    line = make_line(pool)
    policy = get_policy("vamp", params=params(staging))
    policy.params.steps.busy = 0.0
    victim, requester = request("victim", computed=400), request("old", computed=40)
    assert relieve(policy, view(pool, line, 1, requester, running=True, preemptible=[victim])) == [Preempt("victim")]
    policy.params.steps.busy = 11.0  # busy all along: staging costs its full share
    later = relieve(policy, view(pool, line, 1, requester, running=True, preemptible=[request("v2", 4)],
                                 now=1011.0))
    assert later == ([OffloadExperts(((0, 0),))] if grows else [Preempt("v2")])


def test_a_preempted_requests_cached_prefix_is_not_priced_as_lost():
    """A victim whose computed blocks are all registered loses nothing yet (its return hits them, unless they are
    evicted first, which the ghost list prices): no growth from that preemption."""
    pool = BlockPool(range(8))
    kv = KVCacheManager(pool, BS)
    hashes = hash_token_blocks([3] * 16, BS)
    kv.allocate_slots("victim", 16, hashes)  # the victim's 16 tokens, registered and held: nothing to evict
    kv.allocate_slots("other", 16, hash_token_blocks([4] * 16, BS))
    line = make_line(pool)
    policy = get_policy("vamp", params=params(1e-7))
    victim = request("victim", computed=16, hashes=hashes)
    assert relieve(policy, view(pool, line, 1, request("old", 40), running=True,
                                preemptible=[victim])) == [Preempt("victim")]
    policy.params.steps.busy = 11.0
    assert relieve(policy, view(pool, line, 1, request("old", 40), running=True, preemptible=[request("v2", 4)],
                                now=1011.0)) == [Preempt("v2")]


def test_a_growth_bought_back_from_preemptions_is_not_judged_by_busy_seconds_per_token():
    """The same threefold rise in busy seconds per asked token as above, after a growth that preemption recompute
    (not ghost hits) paid for: the line is kept, since it trades recompute for staging where preemption costs
    latency, not the accelerator's time."""
    pool = BlockPool(range(8))
    line = make_line(pool)
    policy = get_policy("vamp", params=params(1e-7))
    steps = policy.params.steps

    def ten_seconds(start, busy_share):
        for t in range(start, start + 10):
            steps.busy += busy_share
            policy.admitting(request(f"ask-{t}", 0, hashes=[10_000 + t, 20_000 + t]), float(t), line)

    requester = request("old", computed=40)
    assert relieve(policy, view(pool, line, 1, requester, running=True,
                                preemptible=[request("victim", 400)])) == [Preempt("victim")]
    ten_seconds(1001, 0.2)
    assert relieve(policy, view(pool, line, 1, requester, running=True, preemptible=[request("v2", 4)],
                                now=1011.0)) == [OffloadExperts(((0, 0),))]
    line.offload(((0, 0),))
    ten_seconds(1012, 0.6)
    relieve(policy, view(pool, line, 1, requester, running=True, preemptible=[request("v3", 4)], now=1022.0))
    assert policy.num_growths_undone == 0


def test_busy_seconds_read_after_a_gap_count_as_spread_over_it():
    """The policy reads the step timer only at shortfalls: 50 busy seconds found after a gap of 100 s are a busy
    share of 0.5 over that gap, not an event of 50 s now (which the decayed rate would read as 50 / τ(1 − e^−10),
    above 1 for τ = 10)."""
    rate = DecayedRate(10.0)
    rate.add_spread(0.0, 123.0)  # the first reading only starts the clock: its interval is unknown
    assert rate.rate(0.0) is None
    rate.add_spread(100.0, 50.0)
    assert rate.rate(100.0) == pytest.approx(0.5)
    rate.add_spread(110.0, 10.0)  # busy all the last 10 s: e^-1 of the weight is the old 0.5, the rest 1.0
    assert rate.rate(110.0) == pytest.approx((0.5 * math.exp(-1) * (1 - math.exp(-10)) + (1 - math.exp(-1)))
                                             / (math.exp(-1) * (1 - math.exp(-10)) + (1 - math.exp(-1))))
    lump = DecayedRate(10.0)
    lump.add(0.0, 0.0)
    lump.add(100.0, 50.0)
    assert lump.rate(100.0) > 1.0


def test_a_request_that_preempted_itself_is_measured_again_when_it_returns():
    """Its return is an admission of its own: if its prefix was evicted meanwhile, the miss is a ghost hit, even
    though it was also the last request admitted before (the hook measures a blocked retry only once)."""
    pool = BlockPool(range(8))
    line = make_line(pool)
    policy = get_policy("vamp", params=params(1e-7))
    hashes = cached_prefix(pool, "s", 2, seed=1)
    policy.admitting(request("A", 0, hashes=hashes), 1000.0, line)
    held = pool.lookup_chain(hashes)
    assert relieve(policy, view(pool, line, 1, request("A", 8, hashes=hashes), running=True,
                                hits=held)) == [Preempt("A")]
    assert relieve(policy, view(pool, line, 2, request("B", 4), running=True, now=1000.5)) == [EvictPrefix(2)]
    pool.evict(2)
    pool.check_invariants()
    assert not policy._next.rate(1000.5)
    back = request("A", 0, hashes=hashes)
    back.num_preemptions = 1  # as the scheduler counts the preemption it applied
    policy.admitting(back, 1001.0, line)
    assert policy._next.rate(1001.0) > 0


def queue_setup(share_per_expert, num_running=1, step_tokens=0.0, **kw):
    """A pool of 4 blocks all held by running requests (nothing cached, nothing to evict), a cap of 4 experts,
    steps of ``step_tokens`` (time-weighted) against a budget of 100 tokens."""
    pool = BlockPool(range(4))
    line = make_line(pool, max_ratio=0.5)
    policy = get_policy("vamp", params=params(share_per_expert, token_budget=100, **kw))
    policy.params.steps.tokens = step_tokens
    held = pool.allocate(4)
    running = [request(f"running-{i}", 4) for i in range(num_running)]
    return pool, line, policy, running, held


def ask_for_queue(policy, pool, line, running, whole_sequence=True, now=1000.0, rid="head"):
    return relieve(policy, view(pool, line, 2, request(rid, 0), preemptible=running, now=now,
                                whole_sequence=whole_sequence))


def test_a_queue_at_the_full_sequence_gate_moves_the_line_at_once():
    """No review has allowed anything and nothing can be evicted: the head of the queue, refused at vLLM 0.32's
    full-sequence gate, gets the one expert (two blocks) it needs, since one more running request beside two adds
    half to the rate the queue drains at (steps a fifth full), far more than twice the expert's 1% of staging."""
    pool, line, policy, running, _ = queue_setup(0.01, num_running=2, step_tokens=20)
    assert ask_for_queue(policy, pool, line, running) == [OffloadExperts(((0, 0),))]
    line.offload([(0, 0)])
    assert policy.refusal_holds_until(1000.0) == 1000.0  # its answer follows the step mix: asked every step
    line.check_invariants()
    pool.check_invariants()


@pytest.mark.parametrize("case", ["first-chunk", "staging-bound", "big-batch", "full-steps", "turned-off"])
def test_a_queue_waits_where_moving_the_line_does_not_pay(case):
    """First-chunk admission (a request admitted early is one preempted later), staging past
    ``queue_staging_share``, a batch so large that one more request adds less than twice the staging, steps
    that fill the token budget (compute-bound: a larger batch waits on compute), or the rule turned off: the
    head waits."""
    share, num_running, step_tokens, whole, kw = {
        "first-chunk": (0.01, 1, 0, False, {}),
        "staging-bound": (0.2, 1, 0, True, {}),  # one expert is 20% of every step, past the 10% bound
        "big-batch": (0.05, 10, 0, True, {}),  # 1/10 <= 2 x 0.05
        "full-steps": (0.01, 2, 98, True, {}),  # (1 - 0.98) / 2 = 0.01 <= 2 x 0.01
        "turned-off": (0.01, 1, 0, True, {"queue_staging_share": 0.0}),
    }[case]
    pool, line, policy, running, _ = queue_setup(share, num_running, step_tokens, **kw)
    assert ask_for_queue(policy, pool, line, running, whole) == []
    assert line.residency.num_offloaded == 0


def test_the_queues_region_stays_with_the_allowance_until_the_pool_is_calm():
    """The queue raises the allowance itself, so its region is not given back while the pool stays full (a drain
    would lose the cached prefixes in it); once the pool has had room to spare for ``calm_reviews`` horizons (two
    here, 20 s, checked every 5 s) the allowance falls and the region goes back."""
    pool, line, policy, running, held = queue_setup(0.01, num_running=2, step_tokens=20, calm_reviews=2.0)
    assert ask_for_queue(policy, pool, line, running) == [OffloadExperts(((0, 0),))]
    line.offload([(0, 0)])
    region = pool.allocate(2)  # the head is admitted into the region
    for t in range(1000, 1060, 5):  # the pool stays full
        assert not policy.maybe_reclaim(line, pool, float(t))
    assert line.residency.num_offloaded == 1 and not pool.is_draining(region[0])
    pool.free(held + region)  # the requests finish: room to spare
    returned = [t for t in range(1060, 1100, 5) if policy.maybe_reclaim(line, pool, float(t))]
    assert returned == [1080] and line.residency.num_offloaded == 0 and pool.num_blocks == 4
    line.check_invariants()
    pool.check_invariants()
