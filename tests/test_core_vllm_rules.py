"""vLLM 0.32's scheduler rules that the `vllm` baseline follows, pinned without vLLM (exact ids and decisions).

``benchmarks/vllm_fidelity.py`` checks the same rules step for step against vLLM's own scheduler; these scenarios
keep them from drifting in a checkout that has no vLLM: full-sequence admission (``scheduler_reserve_full_isl``),
duplicate block hashes, and the long-prefill threshold dropped for a lone request.
"""

from moetide.core.blocks import BlockPool
from moetide.core.kv_manager import KVCacheManager
from moetide.core.pressure import get_policy
from moetide.core.scheduler import Scheduler, SchedulerConfig
from core_steps import BS, req, run_step


def make(num_blocks, *, full_isl=True, threshold=0, max_tokens=64):
    pool = BlockPool(range(1, num_blocks + 1))  # vLLM numbers usable blocks from 1 (0 is its null block)
    kv = KVCacheManager(pool, BS)
    config = SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=8, scheduler_reserve_full_isl=full_isl,
                             long_prefill_token_threshold=threshold)
    return Scheduler(config, kv, get_policy("vllm"))


def step(sched):
    out = run_step(sched)
    return [(r.request_id, n) for r, n in out.scheduled], [r.request_id for r in out.preempted]


def test_a_waiting_request_is_admitted_only_when_its_whole_sequence_fits():
    """10 blocks; a holds 5 and decodes (33 tokens in all: 9 blocks). b's 24-token prompt needs 6 blocks: under
    vLLM 0.32 it waits, although its first chunk (4 tokens, one block) fits, until a is done. Admitted on its
    first chunk (older vLLM), it takes blocks a's decode later needs, and a preempts the newest request, b."""
    runs = {}
    for full_isl in (True, False):
        sched = make(10, full_isl=full_isl, threshold=4)
        sched.add_request(req("a", list(range(17)), out=16))
        sched.add_request(req("z", [900], out=1))  # a second request, so the threshold applies at first
        assert step(sched) == ([("a", 4), ("z", 1)], [])
        assert step(sched) == ([("a", 13)], [])  # alone now: the threshold is dropped
        sched.add_request(req("b", list(range(100, 124)), out=2))
        trace = []
        while sched.has_work:
            trace.append(step(sched))
        runs[full_isl] = trace
    assert runs[True][:15] == [([("a", 1)], [])] * 15 and runs[True][15:] == [([("b", 24)], []), ([("b", 1)], [])]
    assert runs[False][:5] == [([("a", 1), ("b", 4)], [])] * 4 + [([("a", 1)], ["b"])]
    assert runs[False][-2:] == [([("b", 16)], []), ([("b", 1)], [])]  # 8 of b's 24 tokens hit its own blocks


def test_cached_free_blocks_count_as_room_and_are_not_evicted_at_admission():
    """The gate counts cached-free blocks other than the request's own hits as free (they would be evicted as
    its chunks come) and evicts nothing itself: each cached prefix stays hittable until a chunk needs its block,
    and then the least recently used goes first (vLLM's lazy eviction in ``get_new_blocks``)."""
    pool = BlockPool(range(1, 7))
    kv = KVCacheManager(pool, BS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8), kv, get_policy("vllm"))
    sched.add_request(req("old", list(range(500, 516)), out=1))
    while sched.has_work:
        step(sched)
    assert pool.cached_free_block_ids() == [4, 3, 2, 1] and pool.uncached_free_block_ids() == [5, 6]
    sched.add_request(req("b", list(range(100, 120)), out=1))  # 5 blocks: fits only counting the cached ones
    cached = []
    while sched.has_work:
        assert step(sched)[0][0][0] == "b"
        cached.append(pool.cached_free_block_ids())
    assert cached[:4] == [[4, 3, 2, 1], [4, 3, 2, 1], [3, 2, 1], [2, 1]]
    assert kv.get_blocks("b") == [] and pool.cached_free_block_ids() == [1, 2, 3, 4, 6, 5]


def test_two_requests_computing_one_block_at_once_both_register_it():
    """a is chunked 4 tokens a step; b, with the same prompt, arrives and hits a's three registered blocks, then
    registers blocks 3, 4, … before a computes them: a's are duplicates. Both stay registered, a lookup returns
    b's (registered first), and after both finish a's duplicates are cached-free in LRU order, not reused first
    as never-cached blocks would be."""
    sched = make(16, threshold=4)
    kv, pool = sched.kv, sched.kv.pool
    prompt = list(range(24))
    sched.add_request(req("a", prompt, out=3))
    sched.add_request(req("z", [900], out=8))  # keeps two requests eligible, so the threshold applies
    assert step(sched) == ([("a", 4), ("z", 1)], [])
    assert step(sched) == ([("a", 4), ("z", 1)], [])
    sched.add_request(req("b", prompt, out=3))
    assert step(sched) == ([("a", 4), ("z", 1), ("b", 4)], [])
    assert kv.get_blocks("a") == [1, 3, 4] and kv.get_blocks("b") == [1, 3, 4, 5]
    assert step(sched) == ([("a", 4), ("z", 1), ("b", 4)], [])
    assert kv.get_blocks("a") == [1, 3, 4, 6] and kv.get_blocks("b") == [1, 3, 4, 5, 7]
    assert pool.block_hash(6) == pool.block_hash(5) and pool.num_cached_blocks == 7  # z's first block too
    assert pool.lookup_chain(sched.running[0].block_hashes) == [1, 3, 4, 5, 7]
    while sched.has_work:
        step(sched)
    assert pool.cached_free_block_ids() == [10, 7, 5, 11, 8, 6, 4, 3, 1, 9, 2]
    assert pool.uncached_free_block_ids() == [13, 12, 14, 15, 16]


def test_the_long_prefill_threshold_applies_only_when_more_than_one_request_is_eligible():
    sched = make(32, threshold=4)
    sched.add_request(req("a", list(range(20)), out=1))
    assert step(sched) == ([("a", 20)], [])  # alone: nobody to starve
    sched = make(32, threshold=4)
    sched.add_request(req("a", list(range(20)), out=1))
    sched.add_request(req("b", list(range(100, 120)), out=1))
    assert step(sched) == ([("a", 4), ("b", 4)], [])


def test_vllm_015_caps_a_lone_requests_chunks_too():
    pool = BlockPool(range(1, 33))
    config = SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=4,
                             threshold_caps_lone_request=True)
    sched = Scheduler(config, KVCacheManager(pool, BS), get_policy("vllm"))
    sched.add_request(req("a", list(range(20)), out=1))
    assert step(sched) == ([("a", 4)], [])
