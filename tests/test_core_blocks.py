"""Scenario tests for the block pool and KV cache manager: exact block ids and eviction order (vLLM-v1 style)."""

import pytest

from moetide.core.blocks import BlockPool, HostTier
from moetide.core.hashing import hash_token_blocks
from moetide.core.kv_manager import KVCacheManager

BS = 4  # block size in tokens


def make(num_blocks=10):
    pool = BlockPool(range(num_blocks))
    return pool, KVCacheManager(pool, BS)


def admit(manager, request_id, tokens):
    """Schedule a whole prompt the way the scheduler does: hits first, then the rest."""
    hashes = hash_token_blocks(tokens, BS)
    hits, num_computed = manager.get_computed_blocks(hashes, len(tokens))
    new = manager.allocate_slots(
        request_id, len(tokens) - num_computed, hashes, num_computed_tokens=num_computed, new_computed_blocks=hits
    )
    manager.check_invariants()
    return hits, num_computed, new


def test_allocate_takes_oldest_uncached_and_is_atomic():
    pool = BlockPool([5, 3, 9])
    assert pool.allocate(2) == [5, 3]
    assert pool.allocate(2) is None  # only one left: nothing taken
    assert pool.num_uncached_free_blocks == 1 and pool.uncached_free_block_ids() == [9]
    pool.check_invariants()


def test_two_requests_sharing_a_prefix_in_the_same_step():
    pool, manager = make()
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    assert admit(manager, "a", shared + [10, 11]) == ([], 0, [0, 1, 2])
    # b is scheduled in the same step, after a: a's full blocks are registered at allocation, so b hits them
    assert admit(manager, "b", shared + [20, 21]) == ([0, 1], 8, [3])
    assert [pool.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert manager.get_blocks("b") == [0, 1, 3]


def test_fully_cached_prompt_still_computes_one_token():
    pool, manager = make()
    prompt = list(range(8))  # exactly two full blocks
    admit(manager, "a", prompt)
    manager.free("a")
    # the last block cannot be a hit: its last token must be computed for the first output's logits
    hits, num_computed, new = admit(manager, "b", prompt)
    assert (hits, num_computed) == ([0], 4)
    assert len(new) == 1
    # one more token and both full blocks hit; the ninth token is computed
    manager.free("b")
    hits, num_computed, _ = admit(manager, "c", prompt + [99])
    assert (hits, num_computed) == ([0, 1], 8)


def test_free_is_tail_first_and_eviction_takes_chain_tail_first():
    pool, manager = make()
    admit(manager, "a", list(range(12)))  # blocks 0,1,2, all full
    manager.free("a")
    assert pool.cached_free_block_ids() == [2, 1, 0]
    assert pool.evict(1) == [2]
    hashes = hash_token_blocks(list(range(12)), BS)
    assert pool.lookup_chain(hashes) == [0, 1]
    assert pool.num_uncached_free_blocks == 8 and pool.num_cached_free_blocks == 2
    pool.check_invariants()


def test_shared_system_prompt_outlives_the_conversations_on_it():
    pool, manager = make(12)
    system = list(range(8))
    admit(manager, "a", system + [100, 101, 102, 103])
    admit(manager, "b", system + [200, 201, 202, 203])
    manager.free("a")
    manager.free("b")
    # a's tail, then b's tail, then the shared head (released last, by b)
    assert pool.cached_free_block_ids() == [2, 3, 1, 0]
    assert pool.evict(2) == [2, 3]
    assert pool.lookup_chain(hash_token_blocks(system, BS)) == [0, 1]


def test_evicting_a_head_invalidates_down_the_chain():
    pool = BlockPool(range(6))
    blocks = pool.allocate(3)
    hashes = hash_token_blocks(list(range(12)), BS)
    for i, block_id in enumerate(blocks):
        assert pool.cache_block(block_id, hashes[i], hashes[i - 1] if i else None)
    pool.free(blocks)  # head first (not what a request does): the head is now the LRU victim
    assert pool.cached_free_block_ids() == [0, 1, 2]
    # asking for one block loses the whole chain: 1 and 2 could never be hit without 0
    assert pool.evict(1) == [0, 1, 2]
    assert pool.num_cached_blocks == 0 and pool.lookup_chain(hashes) == []
    pool.check_invariants()


def test_descendants_of_a_chain_computed_twice_are_each_listed_once():
    """Two requests computed the same 40-block chain after one shared head: every hash below the head is held by
    two blocks, and the descendants are the 80 blocks once each, what evicting the head unregisters — not the
    2^40 paths through the duplicated hashes."""
    depth = 40
    pool = BlockPool(range(2 * depth + 1))
    hashes = hash_token_blocks(list(range(BS * (depth + 1))), BS)
    head, *rest = pool.allocate(2 * depth + 1)
    assert pool.cache_block(head, hashes[0], None)
    for chain in (rest[:depth], rest[depth:]):
        for i, block_id in enumerate(chain, start=1):
            assert pool.cache_block(block_id, hashes[i], hashes[i - 1])
    pool.check_invariants()
    assert sorted(pool.registered_descendants(head, limit=len(rest) + 1)) == sorted(rest)  # bounded: fails fast
    assert sorted(pool.registered_descendants(head)) == sorted(rest)
    assert len(pool.registered_descendants(head, limit=7)) == 7
    pool.free([head])
    assert pool.evict(1) == [head]
    assert all(pool.block_hash(b) is None for b in rest)
    pool.check_invariants()


def test_invalidation_reaches_referenced_descendants_without_freeing_them():
    pool = BlockPool(range(4))
    hashes = hash_token_blocks(list(range(8)), BS)
    a = pool.allocate(2)
    pool.cache_block(a[0], hashes[0], None)
    pool.cache_block(a[1], hashes[1], hashes[0])
    pool.free([a[0]])  # head free, tail still held (only reachable through the pool API, never via a request)
    assert pool.evict(1) == [a[0]]
    assert pool.block_hash(a[1]) is None and pool.ref_count(a[1]) == 1
    pool.free([a[1]])
    assert a[1] in pool.uncached_free_block_ids()
    pool.check_invariants()


def test_cache_block_refuses_broken_chains_and_uncached_blocks_are_reused_last_in_first_out():
    pool = BlockPool(range(5))
    a, b, c = pool.allocate(3)
    assert not pool.cache_block(c, 12345, 999)  # parent never registered
    pool.free([b, c])  # vLLM's free_blocks prepends never-cached blocks in the order given
    assert pool.uncached_free_block_ids() == [b, c, 3, 4]
    pool.check_invariants()


def test_duplicate_hashes_are_kept_as_vllm_keeps_them():
    """Two requests computing the same block at once both register it (vLLM's BlockHashToBlockMap): a lookup
    returns the first holder; evicting it leaves the hash, and the chain after it, hittable through the other."""
    pool = BlockPool(range(6))
    hashes = hash_token_blocks(list(range(8)), BS)
    a0, a1, b0, b1 = pool.allocate(4)
    assert pool.cache_block(a0, hashes[0], None) and pool.cache_block(a1, hashes[1], hashes[0])
    assert pool.cache_block(b0, hashes[0], None) and pool.cache_block(b1, hashes[1], hashes[0])
    pool.check_invariants()
    assert pool.num_cached_blocks == 4
    assert pool.lookup_chain(hashes[:2]) == [a0, a1]
    assert pool.registered_descendants(a0) == []  # b0 still holds hashes[0]
    pool.free([a1, a0])
    pool.free([b1, b0])
    assert pool.cached_free_block_ids() == [a1, a0, b1, b0]
    assert pool.evict(2) == [a1, a0]  # LRU order; no cascade, since b0 and b1 hold the same hashes
    pool.check_invariants()
    assert pool.lookup_chain(hashes[:2]) == [b0, b1]
    assert pool.evict(1) == [b1] and pool.evict(1) == [b0]
    assert pool.lookup_chain(hashes[:2]) == []
    pool.check_invariants()


def test_evicting_the_last_holder_of_a_hash_invalidates_the_chain_after_it():
    pool = BlockPool(range(6))
    hashes = hash_token_blocks(list(range(12)), BS)
    a0, a1, a2, b1 = pool.allocate(4)
    pool.cache_block(a0, hashes[0], None)
    pool.cache_block(a1, hashes[1], hashes[0])
    pool.cache_block(b1, hashes[1], hashes[0])  # a duplicate of block 1
    pool.cache_block(a2, hashes[2], hashes[1])
    pool.free([a0, a1, a2, b1])  # the head first: only reachable through the pool API
    assert sorted(pool.evict(1)) == sorted([a0, a1, b1, a2])  # b1's eviction was the last hold on hashes[1]
    assert pool.num_cached_blocks == 0
    pool.check_invariants()


def test_cached_free_blocks_are_reusable_until_evicted():
    pool, manager = make(4)
    admit(manager, "a", list(range(9)))  # blocks 0,1 full and cached, 2 partial
    manager.free("a")
    assert pool.num_uncached_free_blocks == 2 and pool.num_cached_free_blocks == 2
    hits, num_computed, new = admit(manager, "b", list(range(9)))
    assert (hits, num_computed, new) == ([0, 1], 8, [2])  # the partial block, freed last, is reused first
    assert pool.num_cached_free_blocks == 0


def test_allocate_slots_returns_none_without_side_effects():
    pool, manager = make(4)
    admit(manager, "a", list(range(8)))
    manager.free("a")  # 0,1 cached-free; 2,3 uncached-free
    tokens = list(range(4)) + [50] * 16  # hits block 0, needs 4 more blocks; only 2 uncached
    hashes = hash_token_blocks(tokens, BS)
    hits, num_computed = manager.get_computed_blocks(hashes, len(tokens))
    assert hits == [0]
    assert manager.num_blocks_short("b", len(tokens) - num_computed, num_computed, len(hits)) == 2
    before = (pool.cached_free_block_ids(), pool.uncached_free_block_ids())
    assert manager.allocate_slots("b", 16, hashes, num_computed_tokens=4, new_computed_blocks=hits) is None
    assert (pool.cached_free_block_ids(), pool.uncached_free_block_ids()) == before
    assert pool.ref_count(0) == 0 and manager.get_blocks("b") == []
    manager.check_invariants()


def test_decode_growth_registers_blocks_as_they_fill():
    pool, manager = make()
    tokens = list(range(6))
    admit(manager, "a", tokens)  # blocks 0,1; block 0 registered
    assert pool.num_cached_blocks == 1
    tokens += [6, 7]  # two decode steps fill block 1
    hashes = hash_token_blocks(tokens, BS)
    assert manager.allocate_slots("a", 1, hashes, num_computed_tokens=7) == []
    assert pool.num_cached_blocks == 2 and pool.block_hash(1) == hashes[1]
    tokens.append(8)
    assert manager.allocate_slots("a", 1, hash_token_blocks(tokens, BS), num_computed_tokens=8) == [2]


def test_grow_and_shrink_by_given_ids():
    pool, manager = make(3)
    pool.add_blocks([10, 11])
    assert pool.num_blocks == 5 and pool.uncached_free_block_ids() == [0, 1, 2, 10, 11]
    with pytest.raises(ValueError):
        pool.add_blocks([11])
    admit(manager, "a", list(range(5)))  # takes 0 and 1; 0 cached
    assert not pool.remove_blocks([1, 2])  # 1 is in use: nothing removed
    assert pool.num_blocks == 5
    manager.free("a")
    assert pool.remove_blocks([0, 2])  # 0 is cached-free: dropped from the cache
    assert pool.block_ids() == [1, 10, 11] and pool.num_cached_blocks == 0
    pool.check_invariants()


def test_double_free_is_an_error():
    pool = BlockPool(range(2))
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(ValueError, match="freed more times"):
        pool.free([a])


def test_caching_disabled_never_hits():
    pool = BlockPool(range(8), enable_caching=False)
    manager = KVCacheManager(pool, BS)
    admit(manager, "a", list(range(9)))
    manager.free("a")
    assert admit(manager, "b", list(range(9)))[:2] == ([], 0)
    assert pool.num_cached_blocks == 0


def test_evict_spares_protected_prefix_hits():
    pool, manager = make(6)
    admit(manager, "a", list(range(8)) + [1])  # 0,1 cached, 2 partial
    manager.free("a")
    admit(manager, "b", [5] * 9)  # 2,3 cached (2 was a's partial block, reused first), 4 partial
    manager.free("b")
    assert pool.cached_free_block_ids() == [1, 0, 3, 2]
    assert pool.evict(2, protect={0, 1}) == [3, 2]
    assert pool.evict(1, protect={0, 1}) == []


def test_hybrid_state_blocks_come_with_the_first_allocation():
    pool = BlockPool(range(6))
    manager = KVCacheManager(pool, BS, num_state_blocks_per_request=2)
    hashes = hash_token_blocks(list(range(5)), BS)
    assert manager.num_blocks_short("a", 5, 0) == 0
    assert manager.allocate_slots("a", 5, hashes) == [2, 3]
    assert manager.get_state_blocks("a") == [0, 1] and manager.get_blocks("a") == [2, 3]
    assert manager.allocate_slots("a", 1, hashes, num_computed_tokens=5) == []  # state is taken once
    assert manager.num_blocks_short("b", 9, 0) == 3  # 3 KV + 2 state blocks wanted, 2 free
    manager.free("a")
    assert pool.num_free_blocks == 6
    manager.check_invariants()


def test_lookup_chain_finds_the_longest_registered_prefix():
    pool = BlockPool(range(8))
    hashes = hash_token_blocks(list(range(24)), BS)
    blocks = pool.allocate(6)
    for i in range(4):
        assert pool.cache_block(blocks[i], hashes[i], hashes[i - 1] if i else None)
    for n in range(7):
        assert pool.lookup_chain(hashes[:n]) == blocks[: min(n, 4)]
    assert pool.lookup_chain(hash_token_blocks([9] * 24, BS)) == []


def test_stale_prefix_hits_are_refused():
    """Regression: hits looked up, then evicted before allocate_slots, were handed out twice in one table."""
    pool, manager = make(4)
    admit(manager, "a", list(range(8)) + [1])
    manager.free("a")
    tokens = list(range(8)) + [2]
    hashes = hash_token_blocks(tokens, BS)
    hits, num_computed = manager.get_computed_blocks(hashes, len(tokens))
    pool.evict(4)  # evicts the hits too
    free_before = pool.num_uncached_free_blocks
    with pytest.raises(ValueError, match="stale prefix hit"):
        manager.allocate_slots("b", 1, hashes, num_computed_tokens=num_computed, new_computed_blocks=hits)
    assert pool.num_uncached_free_blocks == free_before and manager.get_blocks("b") == []
    manager.check_invariants()


def test_drain_takes_blocks_out_as_they_come_free_and_never_allocates_them():
    """A region going back to its experts: free blocks leave at once (a cached one evicted with its descendants),
    a block in use leaves when its last reference goes; none is allocated meanwhile; removal takes them."""
    pool, manager = make(6)
    cached = [1, 2, 3, 4, 5, 6, 7, 8]
    admit(manager, "done", cached)  # blocks 0, 1: a two-block chain
    manager.free("done")
    assert admit(manager, "busy", [9] * 4) == ([], 0, [2])
    pool.drain([0, 2, 5])
    assert pool.block_hash(0) is None and pool.block_hash(1) is None  # 0 evicted, its descendant 1 with it
    assert pool.num_drained_blocks == 2 and pool.is_draining(2) and not pool.is_free(2)
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 1  # 1, 3, 4 free; 0 and 5 drained; 2 in use
    assert pool.allocate(3) == [3, 4, 1] and pool.allocate(1) is None  # never a draining block
    pool.free([3, 4, 1])
    assert pool.remove_blocks([0, 2, 5]) is False  # 2 is still held
    manager.free("busy")
    assert pool.num_drained_blocks == 3 and pool.num_free_blocks == 3
    pool.check_invariants()
    assert pool.remove_blocks([0, 2, 5]) and pool.num_blocks == 3 and pool.num_drained_blocks == 0
    pool.check_invariants()


def test_undrain_puts_drained_blocks_back_as_uncached_free():
    pool, manager = make(3)
    admit(manager, "a", [1, 2, 3, 4])  # block 0, registered, in use
    pool.drain([0, 1])
    pool.undrain([0, 1])
    assert not pool.is_draining(0) and pool.num_drained_blocks == 0
    manager.free("a")
    assert pool.num_cached_free_blocks == 1  # released normally again: its prefix stays cached
    assert pool.uncached_free_block_ids() == [2, 1]
    pool.check_invariants()
    with pytest.raises(ValueError, match="does not own"):
        pool.drain([7])


def test_evict_device_takes_the_oldest_device_prefixes_only():
    """A two-tier pool (ids below 10: device): evict_device uncaches least recently used device blocks, with
    their descendants of either tier, never a host block on its own and never a protected one."""
    pool = BlockPool(range(4), host_tier=HostTier(10, 6))
    a = pool.allocate(3)  # device 0, 1, 2: a chain
    for i, b in enumerate(a):
        assert pool.cache_block(b, 100 + i, 100 + i - 1 if i else None)
    h = pool.allocate(2)  # device 3, then host 10
    assert h == [3, 10]
    assert pool.cache_block(10, 200, None)
    pool.free([10])  # the host block is freed first: the oldest cached-free block
    pool.free(a[::-1])
    assert pool.num_device_uncached(8) == 0 and pool.num_cached_free_blocks == 4
    assert pool.evict_device(1, protect={0}) == [2]  # the oldest device leaf that is not protected
    assert pool.block_hash(10) == 200 and pool.num_device_uncached(8) == 1  # the host block stays cached
    assert pool.evict_device(5) == [1, 0]  # LRU order (1 was freed before 0); no other cached device block
    assert pool.num_device_uncached(8) == 3 and pool.allocate(3) == [0, 1, 2]  # device blocks first
    pool.check_invariants()
    assert BlockPool(range(4)).evict_device(2) == []  # one tier: nothing to prefer


def test_promote_moves_a_host_block_into_a_device_block_and_keeps_its_chain():
    """promote: a free cached host block's hash and place in its chain go to the first free device block; the
    chain's later blocks stay registered (their parent hash is unchanged) and a lookup now finds the device block."""
    pool = BlockPool(range(2), host_tier=HostTier(10, 4))
    assert pool.allocate(2) == [0, 1] and pool.allocate(2) == [10, 11]
    assert pool.cache_chain([0, 10, 11], [100, 101, 102], 0, 3) == 3  # device 0, then host 10, 11
    assert pool.promote(10) is None  # in use: it may not be written yet
    pool.free([11, 10, 0])
    assert pool.promote(10) is None  # no free uncached device block
    pool.free([1])
    assert pool.promote(10) == 1
    assert pool.lookup_chain([100, 101, 102]) == [0, 1, 11]  # the child stays hit-able through the new parent
    assert pool.block_hash(10) is None and 10 in pool.uncached_free_block_ids()
    assert 1 in pool.cached_free_block_ids() and pool.num_device_cached(4) == 2
    assert pool.promote(11) is None  # no free device block left
    assert pool.promote(12) is None  # not cached
    pool.check_invariants()
    assert pool.evict_device(1, protect={0}) == [1, 11]  # the moved block evicts like any other, descendants too
    pool.check_invariants()
    assert BlockPool(range(4)).promote(0) is None  # one tier


def test_host_blocks_in_use_count_a_shared_block_once():
    """The pool's host-in-use count is distinct blocks held (what a server reports), not holders."""
    pool = BlockPool(range(1), host_tier=HostTier(10, 3))
    assert pool.allocate(3) == [0, 10, 11] and pool.num_host_blocks_in_use == 2
    pool.cache_block(10, 7, None)
    pool.touch([10])  # a second request hits the host block
    assert pool.num_host_blocks_in_use == 2
    pool.free([10])
    assert pool.num_host_blocks_in_use == 2  # still held once
    pool.free([10, 11])
    assert pool.num_host_blocks_in_use == 0 and pool.num_cached_free_blocks == 1
    pool.touch([10])  # a hit on the cached, free host block
    assert pool.num_host_blocks_in_use == 1
    pool.check_invariants()


def test_eviction_covers_counts_cached_free_blocks_outside_the_protected_ones():
    from moetide.core.blocks import BlockPool
    from moetide.core.kv_manager import KVCacheManager

    pool = BlockPool(range(6))
    kv = KVCacheManager(pool, 4)
    kv.allocate_slots("a", 12, [11, 12, 13])  # three full blocks, registered
    kv.free("a")
    hits = kv.find_prefix([11, 12, 13], 13)[0]
    assert pool.eviction_covers(3) and not pool.eviction_covers(4)
    assert pool.eviction_covers(2, protect=hits[:1]) and not pool.eviction_covers(3, protect=hits[:1])
    pool.check_invariants()
