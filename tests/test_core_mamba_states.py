"""Hybrid prefix caching as vLLM 0.32 does it (``core.mamba_states``): exact block ids and admission decisions.

``benchmarks/vllm_fidelity.py`` holds these rules to vLLM's own ``MambaManager`` step for step (hybrid
configurations, docs/vllm_baseline.md); the scenarios here pin them without vLLM.
"""

import pytest

from moetide.core.blocks import BlockPool
from moetide.core.kv_manager import KVCacheManager
from moetide.core.mamba_states import MambaStates, aligned_chunk, state_hash
from moetide.core.pressure import get_policy
from moetide.core.scheduler import Scheduler, SchedulerConfig
from core_steps import BS, req, run_step


def make(num_blocks, retention=0, groups=2):
    pool = BlockPool(range(1, num_blocks + 1))
    kv = KVCacheManager(pool, BS, mamba=MambaStates(pool, BS, groups, retention_interval=retention))
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), kv, get_policy("vllm"))


def step(sched):
    out = run_step(sched)
    return [(r.request_id, n, start) for (r, n), start in zip(out.scheduled, out.num_computed_before)]


def chunk(start, num_new_tokens, num_prompt_tokens, num_tokens=None, junction=0):
    return aligned_chunk(start=start, num_new_tokens=num_new_tokens, num_prompt_tokens=num_prompt_tokens,
                         num_tokens=num_tokens or num_prompt_tokens, block_size=BS, max_prefill_tokens=64,
                         shared_prefix_boundary=junction)


def test_chunks_end_where_a_state_can_be_kept():
    # a 10-token prompt in one 64-token budget stops at its last block boundary before the last token (8)
    assert chunk(0, 10, 10) == 8 and chunk(8, 2, 10) == 2
    # a chunk cut by the budget ends on a block boundary; one starting mid-block stops at the next boundary
    assert chunk(0, 7, 40) == 4 and chunk(6, 20, 40) == 2
    # a junction (an attention hit past the last kept state) stops the chunk, block-floored
    assert chunk(8, 30, 40, junction=20) == 12
    # decode is never cut
    assert chunk(40, 1, 40, num_tokens=41) == 1


def test_a_state_is_kept_at_the_replay_boundary_and_hit_from_the_step_after():
    """a's 10-token prompt runs 8 tokens, then 2: its state after 8 tokens (slot 1; blocks 1 and 2, one per group)
    is cached. b, the same prompt, waits while that state is written (the step it is cached, and the step a's
    hit-able boundary is reached again), then hits it: 8 tokens, attention blocks 3 and 4 and states 1 and 2."""
    sched = make(30)
    kv, pool = sched.kv, sched.kv.pool
    sched.add_request(req("a", list(range(10)), out=3))
    sched.add_request(req("b", list(range(10)), out=1))
    assert step(sched) == [("a", 8, 0)]
    assert kv.get_blocks("a") == [3, 4] and kv.mamba.blocks("a") == [1, 2]
    assert pool.block_hash(1) == state_hash(pool.block_hash(4), 0) and pool.block_hash(2) == state_hash(
        pool.block_hash(4), 1)
    assert step(sched) == [("a", 2, 8)]  # b waits: the state was cached this step
    assert kv.get_blocks("a") == [3, 4, 7] and kv.mamba.blocks("a") == [1, 5, 2, 6]  # old and new state
    assert step(sched) == [("a", 1, 10), ("b", 2, 8)]  # a's old state released (cached-free), b hits it
    assert kv.mamba.blocks("a") == [5, 6]
    assert step(sched) == [("a", 1, 11)]
    assert not sched.has_work and pool.cached_free_block_ids() == [1, 2, 7, 4, 3]


def test_only_boundary_states_are_kept_by_default_and_every_one_when_dense():
    """A 21-token prompt in 4-token chunks: its states after 4, 8, …, 20 tokens pass through the pool; with
    retention 0 only the one at 20 (its replay boundary) is registered, with retention None all five."""
    for retention, kept in ((0, 1), (None, 5)):
        pool = BlockPool(range(1, 41))
        kv = KVCacheManager(pool, BS, mamba=MambaStates(pool, BS, 1, retention_interval=retention))
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8), kv, get_policy("vllm"))
        sched.add_request(req("a", list(range(21)), out=1))
        while sched.has_work:
            step(sched)
        hashes = req("x", list(range(21))).block_hashes
        registered = [i for i in range(5) if pool.lookup(state_hash(hashes[i], 0)) is not None]
        assert len(registered) == kept and registered[-1] == 4


def test_an_attention_hit_past_the_last_kept_state_is_a_junction_and_its_state_is_kept():
    """a's prompt (21 tokens) keeps its state after 20; its decoded tokens fill one more attention block (24).
    b extends a's whole context: it hits 20 tokens (the last kept state), its first chunk stops at the junction
    (24) and the state there is kept, so c, extending b, hits 24."""
    sched = make(60, groups=1)
    base = list(range(21))
    sched.add_request(req("a", base, out=4))  # outputs 7, 7, 7, 7: tokens 21-24
    while sched.has_work:
        step(sched)
    context = base + [7, 7, 7]
    sched.add_request(req("b", context + list(range(100, 112)), out=1))
    trace = []
    while sched.has_work:
        trace.append(step(sched))
    assert trace[0] == [("b", 4, 20)] and trace[1][0][2] == 24
    sched.add_request(req("c", context + list(range(100, 104)) + list(range(300, 310)), out=1))
    assert step(sched)[0][2] == 24


def test_mamba_states_need_their_own_pool_and_block_size():
    pool = BlockPool(range(8))
    with pytest.raises(ValueError, match="share the pool"):
        KVCacheManager(pool, BS, num_state_blocks_per_request=2, mamba=MambaStates(pool, BS, 2))
    with pytest.raises(ValueError, match="retention_interval"):
        MambaStates(pool, BS, 2, retention_interval=8)
