"""Scheduler scenarios under the `vllm` policy: chunked prefill, prefix reuse across turns, eviction, preemption."""

import pytest

from moetide.core.blocks import BlockPool, HostTier
from moetide.core.kv_manager import KVCacheManager
from moetide.core.pressure import EvictPrefix, PressurePolicy, get_policy
from moetide.core.request import Request, RequestStatus
from moetide.core.scheduler import Scheduler, SchedulerConfig

BS = 4


def make(num_blocks, max_tokens=64, max_seqs=8):
    pool = BlockPool(range(num_blocks))
    kv = KVCacheManager(pool, BS)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs), kv, get_policy("vllm"))


def req(request_id, tokens, out=2, session=None):
    return Request.from_tokens(request_id, tokens, out, BS, session_id=session)


def step(sched, sampled_token=7):
    out = sched.schedule()
    sampled = {r.request_id: sampled_token for r, _ in out.scheduled}
    emitted, finished = sched.update(out, sampled)
    sched.kv.check_invariants()
    return out, emitted, finished


def plan(out):
    return [(r.request_id, n) for r, n in out.scheduled]


def test_chunked_prefill_then_decode():
    sched = make(16, max_tokens=8)
    sched.add_request(req("a", list(range(20)), out=2))
    assert plan(step(sched)[0]) == [("a", 8)]
    assert plan(step(sched)[0]) == [("a", 8)]
    out, emitted, _ = step(sched)
    assert plan(out) == [("a", 4)] and [r.request_id for r in emitted] == ["a"]
    out, emitted, finished = step(sched)
    assert plan(out) == [("a", 1)] and [r.request_id for r in finished] == ["a"]
    assert not sched.has_work and sched.kv.pool.num_used_blocks == 0


def test_budget_is_shared_running_first_then_waiting_fcfs():
    sched = make(32, max_tokens=10)
    sched.add_request(req("a", list(range(6))))
    sched.add_request(req("b", list(range(100, 112))))
    assert plan(step(sched)[0]) == [("a", 6), ("b", 4)]
    assert plan(step(sched)[0]) == [("a", 1), ("b", 8)]


def test_next_turn_hits_the_previous_turns_blocks():
    sched = make(32)
    turn1 = list(range(10))
    first = req("t1", turn1, out=3, session="s")
    sched.add_request(first)
    while sched.has_work:
        step(sched)
    turn2 = first.token_ids + [50, 51, 52, 53, 54]  # previous prompt + its outputs + new user tokens
    second = req("t2", turn2, out=1, session="s")
    sched.add_request(second)
    out, _, _ = step(sched)
    # 13 tokens were computed in turn 1 (10 prompt + 3 outputs, the last output never computed): 3 full blocks
    assert second.num_cached_prompt_tokens == 12 and plan(out) == [("t2", len(turn2) - 12)]
    assert not sched.has_work  # both turns finished


def test_waiting_request_evicts_lru_cached_blocks():
    sched = make(6)
    sched.add_request(req("a", list(range(16)), out=1))
    step(sched)  # a: 16 tokens -> blocks 0-3 (all full, cached), finishes after its one output
    assert sched.kv.pool.num_cached_free_blocks == 4 and sched.kv.pool.num_uncached_free_blocks == 2
    sched.add_request(req("b", list(range(100, 116)), out=2))
    out, _, _ = step(sched)
    assert plan(out) == [("b", 16)] and out.num_evicted_blocks == 2
    assert sched.kv.get_blocks("b") == [4, 5, 3, 2]  # a's tail blocks went first


def test_running_request_preempts_the_newest_and_it_recomputes():
    sched = make(6, max_tokens=64)
    sched.add_request(req("old", list(range(8)), out=8))
    sched.add_request(req("new", list(range(100, 108)), out=8))
    step(sched)  # both prefill: 2 blocks each, 2 free
    preempted = []
    while sched.has_work:
        out, _, _ = step(sched)
        preempted += [r.request_id for r in out.preempted]
        if out.preempted:
            assert all(r.request_id != "new" for r, _ in out.scheduled)  # no admission in a preemption step
    assert preempted == ["new"]
    assert not sched.has_work and sched.num_preemptions == 1


def test_preempted_request_resumes_from_its_cached_prefix():
    sched = make(6, max_tokens=64)
    old = req("old", list(range(8)), out=8)
    new = req("new", list(range(100, 108)), out=8)
    sched.add_request(old)
    sched.add_request(new)
    while new.num_preemptions == 0:
        step(sched)
    assert new.status is RequestStatus.PREEMPTED and sched.waiting[0] is new
    while sched.has_work:
        step(sched)
    assert old.num_output_tokens == 8 and new.num_output_tokens == 8
    # its full blocks stayed cached while it waited, unless old needed them: recompute is bounded by what was lost
    assert 0 < new.num_recomputed_tokens <= new.max_computed_tokens


def test_request_larger_than_the_pool_fails_cleanly():
    sched = make(4)
    big = req("big", list(range(40)), out=1)
    sched.add_request(big)
    sched.add_request(req("small", list(range(5)), out=1))
    out, _, _ = step(sched)
    assert [r.request_id for r in out.failed] == ["big"] and plan(out) == [("small", 5)]
    assert big.status is RequestStatus.FINISHED


def test_max_num_seqs_caps_the_batch():
    sched = make(64, max_seqs=2)
    for i in range(3):
        sched.add_request(req(f"r{i}", list(range(i * 10, i * 10 + 4)), out=4))
    assert plan(step(sched)[0]) == [("r0", 4), ("r1", 4)]


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy 'lru'; choose one of: static-offload, vamp, vamp-reclaim, vllm"):
        get_policy("lru")


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs must be positive"):
        SchedulerConfig(max_num_seqs=0)


def test_a_waiting_request_is_offered_no_victims_and_a_rogue_preempt_is_refused():
    """Regression: a Preempt for a waiting requester put the victim at the queue head and popped it instead."""
    from moetide.core.pressure import Preempt, PressurePolicy

    class Rogue(PressurePolicy):
        name = "rogue"

        def relieve(self, view):
            if view.requester_is_running:
                return []
            assert view.preemptible == []
            return [Preempt(sched.running[0].request_id)]

    pool = BlockPool(range(2))
    sched = Scheduler(SchedulerConfig(), KVCacheManager(pool, BS), Rogue())
    sched.add_request(req("a", list(range(8)), out=4))
    step(sched)
    sched.add_request(req("b", list(range(100, 108)), out=4))
    with pytest.raises(RuntimeError, match="did not offer"):
        sched.schedule()


# ---- a two-tier pool (host KV) and the admission bound on host blocks held ----------------------------------
HOST_FROM = 100  # host block ids start here; ids below are device blocks


def make_two_tier(device_blocks, host_blocks, bound=None, max_tokens=64, evict=False):
    pool = BlockPool(range(device_blocks), host_tier=HostTier(HOST_FROM, host_blocks))
    kv = KVCacheManager(pool, BS, evict_device_prefixes=evict)
    config = SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=8, max_host_blocks_held=bound)
    return Scheduler(config, kv, get_policy("vllm"))


def host_held(sched):
    kv = sched.kv
    held = sum(1 for rid in kv.request_ids for b in [*kv.get_blocks(rid), *kv.get_state_blocks(rid)] if b >= HOST_FROM)
    assert held == sched.kv.num_host_blocks_held  # the manager's running count agrees with the block tables
    return held


def test_host_blocks_are_counted_per_holder():
    sched = make_two_tier(2, 20)
    shared = list(range(24))  # 6 full blocks: 2 on the device, 4 on the host
    sched.add_request(req("a", shared, out=3))
    step(sched)
    assert sched.kv.num_host_blocks("a") == 4 and sched.kv.num_host_blocks_held == 4
    sched.add_request(req("b", shared + [99], out=3))  # hits all 6 of a's blocks while a still holds them
    step(sched)
    assert sched.kv.num_host_blocks("a") == 5  # its first output token went to a new host block
    assert sched.kv.num_host_blocks("b") == 5  # 4 host hits, and its last prompt token in a new host block
    assert host_held(sched) == 10  # a shared block counts once per holder: each attends it every step
    while sched.has_work:
        step(sched)
    assert sched.kv.num_host_blocks_held == 0


def test_admission_waits_while_host_blocks_held_would_pass_the_bound():
    """Device: 2 blocks. Three 10-token prompts (3 blocks each, their 2 output tokens fit in the third) need 7 host
    blocks together; a bound of 5 admits two (1 + 3 host blocks) and holds the third until one finishes, where
    without a bound all three run at once. Every request completes either way."""
    runs = {}
    for bound in (None, 5):
        sched = make_two_tier(2, 20, bound=bound)
        for i in range(3):
            sched.add_request(req(f"r{i}", list(range(100 * i, 100 * i + 10)), out=2))
        first, done = step(sched)[0], 0
        peak = host_held(sched)
        while sched.has_work:
            done += len(step(sched)[2])
            peak = max(peak, host_held(sched))
        runs[bound] = (plan(first), peak, done, sched.num_host_bound_waits)
    assert runs[None][0] == [("r0", 10), ("r1", 10), ("r2", 10)] and runs[None][1] == 7
    assert runs[5][0] == [("r0", 10), ("r1", 10)]  # r2 waits
    assert runs[5][1] == 4 and runs[5][3] > 0 and runs[5][2] == 3


def test_a_request_larger_than_the_host_bound_runs_alone():
    """The bound defers admission while others run; alone, a request past it is admitted (else it never runs)."""
    sched = make_two_tier(2, 20, bound=2)
    sched.add_request(req("small", list(range(8)), out=2))
    sched.add_request(req("big", list(range(200, 224)), out=2))  # 6 blocks, 4 or more on the host
    out, _, _ = step(sched)
    assert plan(out) == [("small", 8)]  # big waits: 4 host blocks > 2
    while "big" not in sched.kv.request_ids:
        step(sched)
    # 4 on the host: alone, it is admitted past the bound, after small's cached prefix gives way on the device
    assert [r.request_id for r in sched.running] == ["big"] and host_held(sched) == 4
    while sched.has_work:
        step(sched)


@pytest.mark.parametrize("evict", [False, True])
def test_device_prefixes_give_way_before_the_host_bound_holds_a_request(evict):
    """Two of four device blocks hold a finished request's prefix, a third a running one's. A 12-token request
    (3 blocks) under a bound of 1 host block would spill 3 blocks past the cached prefix: rather than wait, the
    prefix is evicted (by the scheduler, or by allocation under evict_device_prefixes) and it spills 1."""
    sched = make_two_tier(4, 8, bound=1, evict=evict)
    sched.add_request(req("old", list(range(8)), out=1))
    sched.add_request(req("long", list(range(50, 54)), out=20))
    step(sched)  # old finishes: blocks 0, 1 cached and free
    old_hashes = req("old", list(range(8))).block_hashes
    assert len(sched.kv.pool.lookup_chain(old_hashes)) == 2
    sched.add_request(req("new", list(range(200, 212)), out=2))
    out, _, _ = step(sched)  # long's second token takes the last uncached device block first
    assert plan(out) == [("long", 1), ("new", 12)] and sched.num_host_bound_waits == 0
    assert host_held(sched) == 1 and sched.kv.pool.lookup_chain(old_hashes) == []
    assert out.num_evicted_blocks == (0 if evict else 2)


def test_the_host_bound_waits_when_evicting_device_prefixes_would_not_make_room():
    sched = make_two_tier(4, 8, bound=1)
    sched.add_request(req("old", list(range(4)), out=1))  # one cached device block
    sched.add_request(req("long", list(range(50, 54)), out=20))
    step(sched)
    sched.add_request(req("new", list(range(200, 216)), out=2))  # 4 blocks: 1 uncached + 1 cached device block
    out, _, _ = step(sched)
    assert plan(out) == [("long", 1)] and sched.num_host_bound_waits == 1 and out.num_evicted_blocks == 0
    assert len(sched.kv.pool.lookup_chain(req("old", list(range(4))).block_hashes)) == 1  # nothing evicted


def test_the_host_bound_needs_a_positive_block_count():
    with pytest.raises(ValueError, match="max_host_blocks_held must be a positive"):
        SchedulerConfig(max_host_blocks_held=0)


@pytest.mark.parametrize("other_blocks", [4, 1])
def test_host_hits_past_the_bound_are_copied_to_the_device_if_it_has_room(other_blocks):
    """A request whose own host prefix hits take it past the bound: rather than wait, their places in the prefix
    cache move to device blocks, freed by evicting another prefix, and the backend copies them before the step
    (``out.promoted``). With too few device blocks to evict, it waits and nothing is evicted or moved."""
    sched = make_two_tier(2 + other_blocks, 12, bound=3)
    other, shared = list(range(500, 500 + 4 * other_blocks)), list(range(20))
    sched.add_request(req("other", other, out=1))
    step(sched)  # done: cached device blocks
    sched.add_request(req("first", shared, out=1))
    step(sched)  # done: 2 cached device blocks, 3 cached host blocks
    sched.add_request(req("running", list(range(300, 304)), out=30))  # no uncached device block: a host one
    step(sched)
    assert host_held(sched) == 1
    sched.add_request(req("again", shared + [99], out=2))  # hits 2 device and 3 host blocks: 1 + 3 + 1 > 3
    first_host_blocks = sched.kv.pool.lookup_chain(req("x", shared).block_hashes)[2:]
    out, _, _ = step(sched)
    chain = sched.kv.pool.lookup_chain(req("x", shared).block_hashes)
    if other_blocks == 4:  # 3 of other's 4 device blocks are evicted for the 3 host hits
        assert plan(out) == [("running", 1), ("again", 1)]  # all 5 blocks hit: only its last token is computed
        assert [src for src, _ in out.promoted] == first_host_blocks and sched.num_host_hits_promoted == 3
        assert chain[2:] == [dst for _, dst in out.promoted] and max(chain) < HOST_FROM
        assert sched.num_host_hits_dropped == 0 and out.num_evicted_blocks == 3
        assert host_held(sched) == 3  # running's 2 and again's last, partial block
    else:
        assert plan(out) == [("running", 1)] and sched.num_host_bound_waits == 1 and out.num_evicted_blocks == 0
        assert out.promoted == [] and chain[2:] == first_host_blocks


def test_host_hits_in_use_are_recomputed_not_copied():
    """Host hits another running request holds may still be being written: they are not moved but uncached, and
    the request recomputes them onto device blocks a finished request's prefix gives way for."""
    sched = make_two_tier(4, 20, bound=8)
    shared = list(range(20))
    sched.add_request(req("filler", list(range(500, 516)), out=2))  # the 4 device blocks
    sched.add_request(req("holder", shared, out=40))  # 5 host blocks
    step(sched)
    step(sched)  # filler done: its 4 device blocks cached; holder's first output took a sixth host block
    sched.add_request(req("again", shared + [99], out=2))  # its 5 host hits, held by holder: 6 + 5 > 8
    out, _, _ = step(sched)
    assert plan(out) == [("holder", 1), ("again", 21)] and out.promoted == []
    assert sched.num_host_hits_dropped == 5 and sched.num_host_hits_promoted == 0
    assert sched.kv.get_blocks("again")[:4] == [0, 1, 2, 3] and host_held(sched) == 8
    chain = sched.kv.pool.lookup_chain(req("x", shared).block_hashes)
    assert chain[:4] == [0, 1, 2, 3]  # the recomputed device copy is the cached one now


def test_a_request_that_adds_no_host_kv_is_admitted_past_the_bound():
    """big's first output token takes it to 3 host blocks against a bound of 2 (outputs are not counted at
    admission). A small request whose prompt fits on the device, once a finished request's 2 cached blocks are
    evicted, adds no host KV: it joins big rather than waiting for it to finish."""
    sched = make_two_tier(4, 20, bound=2)
    sched.add_request(req("a", list(range(7)), out=2))
    sched.add_request(req("big", list(range(100, 116)), out=40))
    step(sched)  # a: 2 device blocks; big: 2 device, 2 host (within the bound)
    step(sched)  # a finishes (cached); big's first output goes to a third host block
    assert host_held(sched) == 3
    sched.add_request(req("small", list(range(200, 208)), out=2))
    out, _, _ = step(sched)
    assert plan(out) == [("big", 1), ("small", 8)] and out.num_evicted_blocks == 2
    assert host_held(sched) == 3 and sched.kv.num_host_blocks("small") == 0


def test_host_state_blocks_count_toward_the_bound():
    """A hybrid model's per-request state blocks are read every step, like KV: those on the host are counted."""
    pool = BlockPool(range(2), host_tier=HostTier(HOST_FROM, 8))
    kv = KVCacheManager(pool, BS, num_state_blocks_per_request=1)
    sched = Scheduler(SchedulerConfig(max_host_blocks_held=2), kv, get_policy("vllm"))
    sched.add_request(req("a", list(range(4)), out=5))  # a state block and a KV block: both on the device
    sched.add_request(req("b", list(range(100, 104)), out=5))  # both on the host: 2, the bound
    sched.add_request(req("c", list(range(200, 204)), out=5))  # 2 more: waits
    out, _, _ = step(sched)
    assert plan(out) == [("a", 4), ("b", 4)] and sched.kv.num_host_blocks("b") == 2 and host_held(sched) == 2
    assert sched.num_host_bound_waits == 1


def test_under_evict_mode_running_prompts_count_cached_device_prefixes_as_room():
    """evict_device_prefixes: a running request's prompt still to be written goes to cached device blocks (its
    allocations evict them), not to the host, so a request with 3 host hits fits a bound of 3 and keeps them."""
    sched = make_two_tier(16, 20, max_tokens=128, evict=True)
    sched.add_request(req("old", list(range(1000, 1064)), out=1))  # 16 blocks: every device block, then cached
    sched.add_request(req("sp", list(range(2000, 2012)), out=1))  # 3 host blocks, then cached
    while sched.has_work:
        step(sched)
    sched.config = SchedulerConfig(max_num_batched_tokens=8, max_host_blocks_held=3)
    sched.add_request(req("long", list(range(3000, 3040)), out=10))  # prefilled 8 tokens a step
    step(sched)  # (alone, it is not capped by a threshold: the step's budget keeps it at 8)
    sched.config = SchedulerConfig(max_num_batched_tokens=128, max_host_blocks_held=3, long_prefill_token_threshold=8)
    sched.add_request(req("w", list(range(2000, 2012)) + list(range(4000, 4008)), out=2))
    out, _, _ = step(sched)
    assert plan(out) == [("long", 8), ("w", 8)] and out.num_computed_before[1] == 12  # its 3 host hits
    peak = host_held(sched)
    while sched.has_work:
        step(sched)
        peak = max(peak, host_held(sched))
    assert sched.num_host_hits_dropped == 0 and peak == 3


def test_an_own_device_hit_after_host_hits_is_kept_when_they_are_promoted():
    """A chain host, host, device (its context spilled, then got a device block again): moving the host hits must
    not evict the device hit after them (a review's crash: 'stale prefix hit')."""
    pool = BlockPool(range(3), host_tier=HostTier(HOST_FROM, 20))
    kv = KVCacheManager(pool, BS)
    sched = Scheduler(SchedulerConfig(), kv, get_policy("vllm"))
    sched.add_request(req("occ", list(range(1000, 1012)), out=1))  # 3 device blocks, then cached
    step(sched)
    sched.add_request(req("s", list(range(8)), out=5))  # its prompt spills: 2 host blocks
    step(sched)
    pool.evict_device(3)  # occ's prefix goes: s's next block is a device one
    while sched.has_work:
        step(sched)
    s_tokens = list(range(8)) + [7] * 4
    assert pool.lookup_chain(req("q", s_tokens).block_hashes) == [HOST_FROM, HOST_FROM + 1, 0]
    sched.config = SchedulerConfig(max_host_blocks_held=1)
    sched.add_request(req("t", s_tokens + [1], out=2))
    out, _, _ = step(sched)
    assert out.promoted == [(HOST_FROM, 1), (HOST_FROM + 1, 2)] and plan(out) == [("t", 1)]
    assert sched.kv.get_blocks("t")[:3] == [1, 2, 0]


def test_random_two_tier_runs_keep_the_bound_and_every_token_in_place():
    """Seeded random runs (both device-prefix modes, chunked prefill, shared prefixes, outputs): the books check
    every step; an admission beside running requests never takes the host total past the bound with blocks of
    its own; and every token a step reads sits where the backend would find it, promoted copies included."""
    import random

    checked = promoted = 0
    for seed in range(150):
        rng = random.Random(seed)
        pool = BlockPool(range(rng.randint(3, 12)), host_tier=HostTier(HOST_FROM, rng.randint(4, 24)))
        kv = KVCacheManager(pool, BS, evict_device_prefixes=rng.random() < 0.5)
        bound = rng.randint(1, 8)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=rng.choice([8, 16, 64]), max_num_seqs=4,
                                          long_prefill_token_threshold=rng.choice([0, 4]),
                                          max_host_blocks_held=bound), kv, get_policy("vllm"))
        bases = [list(range(10_000 * k, 10_000 * k + rng.randint(4, 24))) for k in range(4)]
        content: dict[int, list] = {}
        for t in range(150):
            if rng.random() < 0.4:
                base = rng.choice(bases)
                tokens = base[: rng.randint(1, len(base))] + [rng.randint(50_000, 60_000) for _ in range(4)]
                sched.add_request(req(f"r{t}", tokens, out=rng.randint(1, 6)))
                if rng.random() < 0.3:
                    bases.append(tokens)
            if not sched.has_work:
                continue
            before = {r.request_id for r in sched.running}
            out = sched.schedule()
            kv.check_invariants()
            for src, dst in out.promoted:
                assert src >= HOST_FROM > dst
                content[dst] = list(content.get(src, [None] * BS))
            promoted += len(out.promoted)
            new = [r.request_id for r, _ in out.scheduled if r.request_id not in before]
            for rid in new[0 if before else 1:]:  # the first admitted into an empty batch may pass the bound
                assert not (kv.num_host_blocks(rid) and kv.num_host_blocks_held > bound and not out.preempted)
            for (r, n), start in zip(out.scheduled, out.num_computed_before):
                table = kv.get_blocks(r.request_id)
                for p in range(start, start + n):
                    content.setdefault(table[p // BS], [None] * BS)[p % BS] = r.token_ids[p]
                for p in range(start + n):
                    assert content[table[p // BS]][p % BS] == r.token_ids[p]
                    checked += 1
            sched.update(out, {r.request_id: 7 for r, _ in out.scheduled})
    assert promoted > 0 and checked > 10_000


def test_a_host_hit_in_use_makes_the_rest_of_the_prefix_count_as_prompt_to_write():
    """A running request holds the chain host, device. Another request's hits are both; past the bound, its host
    hit in use cannot be copied, so from it on the prefix would be recomputed, the device hit after it included:
    three blocks to write, with two device prefixes to evict and no host room. It waits, nothing evicted; counting
    the device hit as kept would admit it and then spill past the bound (a review's fuzz found this)."""
    pool = BlockPool(range(4), host_tier=HostTier(HOST_FROM, 20))
    kv = KVCacheManager(pool, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4), kv, get_policy("vllm"))
    sched.add_request(req("occ", list(range(1000, 1016)), out=1))  # 4 device blocks, then cached
    while sched.has_work:
        step(sched)
    sched.add_request(req("a", list(range(8)), out=40))
    step(sched)  # a's first chunk: a host block (alone, a is capped by the step's budget, not a threshold)
    pool.evict_device(4)  # occ's prefix goes
    step(sched)  # a's second chunk: a device block
    sched.config = SchedulerConfig(long_prefill_token_threshold=4)
    sched.add_request(req("occ2", list(range(2000, 2012)), out=1))
    while len(sched.running) > 1 or sched.waiting:
        step(sched)
    assert kv.get_blocks("a") == [HOST_FROM, 0, 1] and pool.num_device_cached(8) == 2
    sched.config = SchedulerConfig(max_host_blocks_held=1, long_prefill_token_threshold=4)
    sched.add_request(req("b", list(range(8)) + [9], out=2))  # hits a's host block and a's device block
    out, _, _ = step(sched)
    assert plan(out) == [("a", 1)] and sched.num_host_bound_waits == 1
    assert sched.num_host_hits_dropped == 0 and out.num_evicted_blocks == 0 and host_held(sched) == 1


def test_abort_frees_a_running_a_waiting_and_a_preempted_request_and_the_rest_go_on():
    """A client that leaves: its request goes from whichever queue holds it, with every block it held; the
    requests behind it are admitted as if it had never come, and its blocks' cached prefixes stay hittable."""
    sched = make(6, max_tokens=64)
    sched.add_request(req("old", list(range(8)), out=8))
    sched.add_request(req("new", list(range(100, 108)), out=8))
    sched.add_request(req("queued", list(range(200, 216)), out=2))
    step(sched)  # old and new prefill (2 blocks each); queued needs 4 + 1: it waits
    assert sched.abort_request("queued").request_id == "queued"
    sched.kv.check_invariants()
    while not sched.num_preemptions:
        step(sched)
    assert [r.request_id for r in sched.waiting] == ["new"]  # preempted: back in the waiting queue
    preempted = sched.abort_request("new")
    assert preempted.status is RequestStatus.FINISHED and not sched.waiting
    sched.kv.check_invariants()
    running = sched.abort_request("old")
    assert running.request_id == "old" and not sched.has_work
    sched.kv.check_invariants()
    assert sched.kv.pool.num_used_blocks == 0 and sched.kv.pool.num_free_blocks == 6
    assert sched.abort_request("old") is None and sched.abort_request("never") is None
    sched.add_request(req("again", list(range(8)), out=1))
    out, _, _ = step(sched)
    assert plan(out) == [("again", 4)], "old's prompt blocks are hit: 4 of its 8 tokens are recomputed"


class RefusesUntil(PressurePolicy):
    """Refuses every shortfall before ``until_s``, then evicts what is short; says so through
    ``refusal_holds_until`` when ``tells`` (else the default: ask at every step)."""

    name = "refuses-until"
    reads_every_step = False

    def __init__(self, until_s: float, tells: bool) -> None:
        self.until_s, self.tells, self.asked = until_s, tells, []

    def relieve(self, view):
        self.asked.append(view.now_s)
        return [EvictPrefix(view.shortfall_blocks)] if view.now_s >= self.until_s else []

    def refusal_holds_until(self, now_s):
        return max(now_s, self.until_s) if self.tells else now_s


@pytest.mark.parametrize("tells", [True, False])
def test_a_refused_head_is_asked_again_when_the_policy_says_its_answer_may_change(tells):
    """A waiting head the policy refused is not asked again while nothing is freed, until the time the policy
    gives (vamp: its next review); then it is asked, in the same step as asking at every step would."""
    policy = RefusesUntil(5.0, tells)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                      KVCacheManager(BlockPool(range(8)), BS), policy)
    sched.add_request(req("done", list(range(100, 112)), out=1))
    assert step_at(sched, 0.0)[2] == ["done"]  # its 3 blocks stay cached, free
    sched.add_request(req("r", list(range(200, 205)), out=4))  # 2 blocks, decodes until t=5
    step_at(sched, 0.1)
    sched.add_request(req("w", list(range(300, 320)), out=1))  # 5 blocks: 3 uncached free, 2 short
    for now in (0.2, 1.0):
        assert plan(step_at(sched, now)[0]) == [("r", 1)]
    assert plan(step_at(sched, 5.0)[0]) == [("r", 1), ("w", 20)]  # asked again at 5.0, not after r's free
    assert policy.asked == ([0.2, 5.0] if tells else [0.2, 1.0, 5.0])


def step_at(sched, now_s):
    out = sched.schedule(now_s)
    emitted, finished = sched.update(out, {r.request_id: 7 for r, _ in out.scheduled})
    sched.kv.check_invariants()
    return out, emitted, [r.request_id for r in finished]
