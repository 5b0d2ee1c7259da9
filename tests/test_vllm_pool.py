"""``moetide.vllm.pool.VllmPool`` on a bare vLLM 0.32 ``BlockPool``: the reserve, where grown blocks go, drains,
atomic removal, and chain cascades, with the view's invariants checked after every operation."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from moetide.vllm.pool import VllmPool  # noqa: E402

TOTAL, BASE = 16, 10  # ids 10..15 are the line's reserve; 0 is vLLM's null block


def queue(view: VllmPool) -> list[int]:
    return [b.block_id for b in view._free_blocks()]



@pytest.fixture
def view():
    pool = BlockPool(TOTAL, enable_caching=True, hash_block_size=16)
    v = VllmPool(pool, num_base_blocks=BASE)
    v.check_invariants()
    return v


def test_the_reserve_is_neither_free_nor_used(view):
    assert view.num_reserved_blocks == TOTAL - BASE and view.num_blocks == BASE - 1
    assert queue(view) == list(range(1, BASE)) and view.pool.get_num_free_blocks() == BASE - 1


def test_grown_blocks_go_after_blank_blocks_and_back_atomically(view):
    pool = view.pool
    taken = pool.get_new_blocks(7)  # 1..7 in use, 8 and 9 free and blank
    view.add_blocks([10, 11])
    view.check_invariants()
    assert queue(view) == [8, 9, 10, 11] and view.num_blocks == BASE + 1
    assert not view.remove_blocks([9, 10]) and queue(view) == [8, 9, 10, 11]  # 9 is not the line's
    grabbed = pool.get_new_blocks(3)
    assert [b.block_id for b in grabbed] == [8, 9, 10]
    assert not view.remove_blocks([10, 11])  # 10 is in use: nothing changes
    view.check_invariants()
    pool.free_blocks(grabbed)
    assert view.remove_blocks([10, 11])
    view.check_invariants()
    assert 10 not in queue(view) and view.num_reserved_blocks == TOTAL - BASE
    pool.free_blocks(taken)
    view.check_invariants()


def test_a_drained_block_in_use_leaves_when_freed(view):
    pool = view.pool
    view.add_blocks([10, 11, 12])
    pool.get_new_blocks(BASE - 1)
    held = pool.get_new_blocks(2)  # 10 and 11
    view.drain([10, 11, 12])  # 12 is free: it leaves at once
    view.check_invariants()
    assert view.num_drained_blocks == 1 and 12 not in queue(view)
    pool.free_blocks(held)  # their last references: they leave instead of rejoining the queue
    view.check_invariants()
    assert view.num_drained_blocks == 3 and queue(view) == []
    view.undrain([12])
    view.check_invariants()
    assert queue(view) == [12]
    assert view.remove_blocks([10, 11, 12])
    view.check_invariants()


def test_the_allocation_takes_what_peek_says_it_would_evict(view):
    pool = view.pool
    blocks = pool.get_new_blocks(BASE - 1)
    for i, block in enumerate(blocks[:4]):
        block.set_block_hash(make_block_hash_with_group_id(bytes([i]), 0), 16 * (i + 1))
        pool.cached_block_hash_to_block.insert(block.block_hash, block)
    pool.free_blocks(reversed(blocks))  # never-cached ones go ahead, cached ones behind in LRU order
    view.check_invariants()
    uncached = view.num_uncached_free_blocks
    assert uncached == BASE - 1 - 4 and view.num_cached_free_blocks == 4
    victims = view.peek_victims(2)
    assert view.num_cached_among_next(uncached + 2) == 2
    assert view.eviction_covers(4) and not view.eviction_covers(5)  # as many as the cached free blocks
    assert not view.eviction_covers(4, protect={victims[0]}) and view.eviction_covers(3, protect={victims[0]})
    assert view.eviction_covers(0)
    assert view.evict(2) == victims
    view.check_invariants()
    got = pool.get_new_blocks(uncached + 2)
    assert [b.block_id for b in got][-2:] == victims and all(b.block_hash is None for b in got)
