"""Arena: exact page owners and block ids for small layouts, conversion that moves no KV, reclaim that waits for
free blocks, and random operation sequences against the real BlockPool with invariants checked after each."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moetide.core.arena import KV, Arena, ArenaConfig
from moetide.core.blocks import BlockPool

PAGE = 1024


def small_block_arena() -> Arena:
    """2 layers x 2 experts on 2 pages each (pages 0-7), then KV pages 8-9; 3 blocks of 300 B per page."""
    return Arena(ArenaConfig(kv_block_bytes=300, expert_bytes=1500, num_layers=2, num_experts=2, num_kv_pages=2,
                             page_bytes=PAGE))


def big_block_arena() -> Arena:
    """2 layers x 2 experts on 1 page each (pages 0-3), KV pages 4-8; a block spans 3 aligned pages."""
    return Arena(ArenaConfig(kv_block_bytes=2500, expert_bytes=1000, num_layers=2, num_experts=2, num_kv_pages=5,
                             page_bytes=PAGE))


def with_pool(arena: Arena) -> BlockPool:
    pool = BlockPool(arena.kv_block_ids())
    arena.attach_pool(pool)
    return pool


def check(arena: Arena, pool: BlockPool | None = None) -> None:
    arena.check_invariants()
    if pool is not None:
        pool.check_invariants()


# ---- layout ---------------------------------------------------------------------------------------------------
def test_small_blocks_layout_pins_owners_and_ids():
    arena = small_block_arena()
    cfg = arena.config
    assert (cfg.pages_per_expert, cfg.pages_per_block, cfg.blocks_per_group) == (2, 1, 3)
    assert [arena.owner(p) for p in range(10)] == [(0, 0)] * 2 + [(0, 1)] * 2 + [(1, 0)] * 2 + [(1, 1)] * 2 + [KV] * 2
    assert arena.kv_block_ids() == [24, 25, 26, 27, 28, 29]
    assert cfg.num_initial_kv_blocks == 6
    assert arena.blocks_of_page(9) == [27, 28, 29]
    assert arena.blocks_of_page(3) == []
    assert arena.block_location(28) == (9, 300)
    assert arena.block_byte_offset(28) == 9 * PAGE + 300
    assert list(arena.pages_of_block(28)) == [9]
    assert cfg.expert_padding_bytes == 4 * (2 * PAGE - 1500)
    assert arena.kv_waste_bytes == 2 * (PAGE - 900)
    check(arena)


def test_big_blocks_layout_pins_owners_and_ids():
    arena = big_block_arena()
    cfg = arena.config
    assert (cfg.pages_per_expert, cfg.pages_per_block, cfg.blocks_per_group, cfg.num_groups) == (1, 3, 1, 3)
    assert [arena.owner(p) for p in range(9)] == [(0, 0), (0, 1), (1, 0), (1, 1)] + [KV] * 5
    # group 1 (pages 3-5) starts on expert (1, 1)'s page, so only group 2 (pages 6-8) is a block
    assert arena.kv_block_ids() == [2]
    assert cfg.num_initial_kv_blocks == 1
    assert arena.block_location(2) == (6, 0)
    assert list(arena.pages_of_block(1)) == [3, 4, 5]
    assert arena.blocks_of_page(4) == []
    assert arena.kv_waste_bytes == 5 * PAGE - 2500
    check(arena)


def test_block_equal_to_page_uses_page_index_as_block_id():
    arena = Arena(ArenaConfig(kv_block_bytes=PAGE, expert_bytes=PAGE, num_layers=1, num_experts=3, num_kv_pages=2,
                              page_bytes=PAGE))
    assert arena.kv_block_ids() == [3, 4]
    assert arena.convert_experts_to_kv([(0, 1)]) == [1]
    assert arena.block_location(1) == (1, 0)
    assert arena.kv_waste_bytes == 0
    check(arena)


# ---- conversion -----------------------------------------------------------------------------------------------
def test_convert_small_blocks_adds_ids_of_the_region_pages_only():
    arena = small_block_arena()
    pool = with_pool(arena)
    before = {b: arena.block_location(b) for b in arena.kv_block_ids()}
    new_ids = arena.convert_experts_to_kv([(0, 1)])
    assert new_ids == [6, 7, 8, 9, 10, 11]
    assert arena.block_location(7) == (2, 300)
    assert [arena.owner(p) for p in (1, 2, 3, 4)] == [(0, 0), KV, KV, (1, 0)]
    assert {b: arena.block_location(b) for b in before} == before  # no byte of resident KV moves
    assert not set(new_ids) & set(before)
    assert pool.block_ids() == sorted([*before, *new_ids])
    assert pool.uncached_free_block_ids() == [24, 25, 26, 27, 28, 29, 6, 7, 8, 9, 10, 11]
    assert (arena.num_kv_pages, arena.num_expert_pages) == (4, 6)
    assert arena.converted_regions() == [((0, 1),)]
    check(arena, pool)


def test_convert_big_blocks_forms_a_block_only_when_its_whole_group_is_kv():
    arena = big_block_arena()
    pool = with_pool(arena)
    assert arena.convert_experts_to_kv([(1, 1)]) == [1]  # completes group 1 with KV pages 4-5
    assert arena.convert_experts_to_kv([(0, 0)]) == []  # group 0 still has experts on pages 1-2
    assert arena.blocks_of_region([(0, 0)]) == []
    assert arena.convert_experts_to_kv([(1, 0), (0, 1)]) == [0]
    assert arena.kv_block_ids() == [0, 1, 2]
    assert arena.blocks_of_region([(0, 1), (1, 1)]) == [0, 1]
    assert arena.converted_regions() == [((1, 1),), ((0, 0),), ((1, 0), (0, 1))]
    check(arena, pool)


def test_converting_an_already_converted_expert_is_refused_and_changes_nothing():
    arena = small_block_arena()
    pool = with_pool(arena)
    arena.convert_experts_to_kv([(0, 1)])
    with pytest.raises(ValueError, match=r"expert \(0, 1\) is already converted"):
        arena.convert_experts_to_kv([(1, 0), (0, 1)])
    assert arena.owner(4) == (1, 0)
    with pytest.raises(ValueError, match="more than once"):
        arena.convert_experts_to_kv([(1, 0), (1, 0)])
    with pytest.raises(ValueError, match="layer 2 is outside"):
        arena.convert_experts_to_kv([(2, 0)])
    with pytest.raises(ValueError, match="not converted"):
        arena.reclaim([(1, 1)])
    check(arena, pool)


def test_convert_is_atomic_when_the_pool_refuses():
    class RefusingPool:
        def block_ids(self):
            return [24, 25, 26, 27, 28, 29]

        def add_blocks(self, block_ids):
            raise RuntimeError("pool refused")

        def remove_blocks(self, block_ids):
            return True

    arena = Arena(small_block_arena().config, RefusingPool())
    with pytest.raises(RuntimeError):
        arena.convert_experts_to_kv([(0, 0)])
    assert arena.owner(0) == (0, 0) and arena.kv_block_ids() == [24, 25, 26, 27, 28, 29]
    assert arena.converted_regions() == []
    check(arena)


# ---- reclaim --------------------------------------------------------------------------------------------------
def test_reclaim_waits_until_every_block_in_the_pages_is_free():
    arena = small_block_arena()
    pool = with_pool(arena)
    arena.convert_experts_to_kv([(0, 1)])
    held = pool.allocate(7)
    assert held == [24, 25, 26, 27, 28, 29, 6]  # block 6 lies in the converted region
    assert arena.reclaim([(0, 1)]) is False
    assert arena.owner(2) == KV and pool.num_blocks == 12 and arena.converted_experts() == [(0, 1)]
    check(arena, pool)
    pool.free([6])
    assert arena.reclaim([(0, 1)]) is True
    assert [arena.owner(p) for p in (2, 3)] == [(0, 1), (0, 1)]
    assert pool.block_ids() == [24, 25, 26, 27, 28, 29]
    assert arena.converted_regions() == []
    check(arena, pool)


def test_reclaim_drops_cached_free_blocks_from_the_prefix_cache():
    arena = small_block_arena()
    pool = with_pool(arena)
    arena.convert_experts_to_kv([(1, 1)])
    ids = pool.allocate(8)
    assert ids[-2:] == [18, 19]
    assert pool.cache_block(18, block_hash=1001, parent_hash=None)
    pool.free(ids)
    assert pool.num_cached_free_blocks == 1
    assert arena.reclaim([(1, 1)]) is True
    assert pool.num_cached_free_blocks == 0 and pool.lookup(1001) is None
    check(arena, pool)


def test_reclaim_part_of_a_region_keeps_the_rest_converted():
    arena = small_block_arena()
    pool = with_pool(arena)
    arena.convert_experts_to_kv([(0, 0), (1, 1)])
    assert arena.reclaim([(1, 1)]) is True
    assert arena.converted_regions() == [((0, 0),)]
    assert arena.kv_block_ids() == [0, 1, 2, 3, 4, 5, 24, 25, 26, 27, 28, 29]
    check(arena, pool)


def test_reclaim_removes_a_big_block_straddling_a_neighbour():
    arena = big_block_arena()
    pool = with_pool(arena)
    arena.convert_experts_to_kv([(0, 0), (0, 1), (1, 0)])  # group 0 = pages 0-2
    assert arena.kv_block_ids() == [0, 2]
    assert arena.reclaim([(0, 0)]) is True  # block 0 also covered (0, 1) and (1, 0)
    assert arena.kv_block_ids() == [2]
    assert [arena.owner(p) for p in range(3)] == [(0, 0), KV, KV]
    assert arena.kv_waste_bytes == arena.kv_bytes - 2500
    assert arena.convert_experts_to_kv([(0, 0)]) == [0]  # the same id comes back at the same place
    check(arena, pool)


# ---- configuration --------------------------------------------------------------------------------------------
def test_from_budget_gives_every_leftover_page_to_kv():
    cfg = ArenaConfig.from_budget(13 * PAGE + 5, kv_block_bytes=300, expert_bytes=1500, num_layers=2,
                                  num_experts=2, page_bytes=PAGE)
    assert (cfg.num_expert_pages, cfg.num_kv_pages, cfg.num_pages) == (8, 5, 13)
    assert cfg.num_initial_kv_blocks == 15


def test_from_budget_rejects_a_budget_smaller_than_the_experts():
    with pytest.raises(ValueError, match=r"routed experts alone need 8 pages \(2 layers x 2 experts x 2 pages\)"):
        ArenaConfig.from_budget(7 * PAGE, kv_block_bytes=300, expert_bytes=1500, num_layers=2, num_experts=2,
                                page_bytes=PAGE)


def test_from_budget_rejects_a_budget_without_room_for_one_block():
    with pytest.raises(ValueError, match="hold no whole KV block of 2500 bytes"):
        ArenaConfig.from_budget(8 * PAGE, kv_block_bytes=2500, expert_bytes=1000, num_layers=2, num_experts=2,
                                page_bytes=PAGE)


@pytest.mark.parametrize("field, value", [("kv_block_bytes", 0), ("expert_bytes", -1), ("num_layers", 0),
                                          ("num_experts", 1.5), ("num_kv_pages", -1), ("page_bytes", True)])
def test_config_rejects_bad_fields_by_name(field, value):
    kwargs = dict(kv_block_bytes=300, expert_bytes=1500, num_layers=2, num_experts=2, num_kv_pages=2)
    kwargs[field] = value
    with pytest.raises(ValueError, match=f"ArenaConfig.{field} must be an integer"):
        ArenaConfig(**kwargs)


def test_attach_pool_requires_the_arena_block_set():
    arena = small_block_arena()
    with pytest.raises(ValueError, match="build the pool from arena.kv_block_ids"):
        arena.attach_pool(BlockPool([24, 25]))
    with pytest.raises(ValueError, match="outside"):
        arena.pages_of_block(30)
    with pytest.raises(ValueError, match="outside"):
        arena.owner(10)


# ---- random operation sequences -------------------------------------------------------------------------------
configs = st.builds(
    ArenaConfig,
    kv_block_bytes=st.sampled_from([16, 30, 64, 100, 200]),
    expert_bytes=st.sampled_from([40, 64, 130]),
    num_layers=st.integers(1, 3),
    num_experts=st.integers(1, 3),
    num_kv_pages=st.integers(0, 4),
    page_bytes=st.just(64),
)
OPS = ["convert", "reclaim", "allocate", "free", "cache_free", "evict"]


@settings(max_examples=150, deadline=None)
@given(config=configs, data=st.data())
def test_random_operations_keep_arena_and_pool_consistent(config, data):
    arena = Arena(config)
    pool = with_pool(arena)
    experts = [(layer, e) for layer in range(config.num_layers) for e in range(config.num_experts)]
    held: list[int] = []
    next_hash = 1
    for op in data.draw(st.lists(st.sampled_from(OPS), max_size=30)):
        before = {b: arena.block_location(b) for b in arena.kv_block_ids()}
        if op == "convert":
            free = [k for k in experts if not arena.is_converted(*k)]
            region = data.draw(st.lists(st.sampled_from(free), unique=True)) if free else []
            new_ids = arena.convert_experts_to_kv(region)
            assert not set(new_ids) & set(before)
            assert {b: arena.block_location(b) for b in before} == before  # nothing resident moved or vanished
        elif op == "reclaim":
            done = arena.converted_experts()
            region = data.draw(st.lists(st.sampled_from(done), unique=True)) if done else []
            blocks = set(arena.blocks_of_region(region))
            ok = arena.reclaim(region)
            assert ok == (not blocks & set(held))
            assert set(arena.kv_block_ids()) == (set(before) - blocks if ok else set(before))
        elif op == "allocate":
            got = pool.allocate(data.draw(st.integers(0, 4)))
            held.extend(got or [])
        elif op in ("free", "cache_free") and held:
            block_id = held.pop(data.draw(st.integers(0, len(held) - 1)))
            if op == "cache_free":
                pool.cache_block(block_id, next_hash, None)
                next_hash += 1
            pool.free([block_id])
        elif op == "evict":
            pool.evict(data.draw(st.integers(0, 3)))
        assert set(held) <= set(arena.kv_block_ids())
        check(arena, pool)
