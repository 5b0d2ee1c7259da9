"""The accelerator's memory as fixed-size pages, each owned by one expert's weights or by the KV pool.

Layout — a pure function of ``ArenaConfig``::

    page   0 ............................................ num_expert_pages-1 | num_expert_pages ... num_pages-1
    owner  expert (0,0) | (0,1) | ... | (L-1,E-1), pages_per_expert each     | the initial KV pages

Routed expert (layer, expert) has fixed *home pages* ``[(layer·E + expert)·pages_per_expert, +pages_per_expert)``;
an expert that does not fill its last page wastes the tail (``ArenaConfig.expert_padding_bytes``). A converted
expert's home pages are owned by KV; reclaiming gives exactly those pages back to the same expert.

KV blocks are cut from *page groups* of ``pages_per_block = ceil(kv_block_bytes / page_bytes)`` aligned pages
(group g is pages ``[g·pages_per_block, (g+1)·pages_per_block)``), each holding ``blocks_per_group`` blocks:

* block ≤ page: one page per group, ``page_bytes // kv_block_bytes`` blocks per page; block id
  ``page·blocks_per_group + slot`` at byte ``slot·kv_block_bytes`` of the page; the page's tail is waste.
* block > page: a block spans its group's pages; block id = group index; the last page's tail is waste.

A block exists exactly while every page of its group is owned by KV, so a big block straddling an expert and its
neighbour appears only once both are converted, and vanishes when either is reclaimed.

Invariant: every page has one owner (its home expert, or KV); the arena's KV block ids are exactly those the rule
above derives from the KV pages, and equal the attached pool's block ids. Because ids are a pure function of page
positions, converting pages only *adds* ids: no resident block is renumbered or moved, so no byte of KV is copied.
vLLM sizes its KV cache once, as one tensor, at start-up; here the line between weights and KV moves at run time,
and only the books move — the engine's storage backend (CUDA VMM map/unmap, or plain tensors) carries them out.
Reclaiming is atomic: the pool's ``remove_blocks`` agrees that every block in the pages is free, or nothing
changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal, Protocol

from moetide.core.experts import ExpertKey, check_expert_key
from moetide.units import cdiv

DEFAULT_PAGE_BYTES: Final = 2 * 1024 * 1024  # CUDA virtual-memory mapping granularity
KV: Final = "kv"  # the owner of a page that belongs to the KV pool
PageOwner = ExpertKey | Literal["kv"]
_GIB = 1024**3


class KVBlockPool(Protocol):
    """What the arena needs of a block pool (``core.blocks.BlockPool`` provides it)."""

    def add_blocks(self, block_ids: Iterable[int]) -> None: ...

    def remove_blocks(self, block_ids: Iterable[int]) -> bool: ...

    def block_ids(self) -> list[int]: ...


def _require_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"ArenaConfig.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class ArenaConfig:
    """Page layout of the expert+KV arena. ``kv_block_bytes`` is one KV block over all layers
    (block_size × KV bytes per token); ``expert_bytes`` one routed expert of one layer."""

    kv_block_bytes: int
    expert_bytes: int
    num_layers: int
    num_experts: int  # routed experts per layer; shared experts are never offloaded and live outside the arena
    num_kv_pages: int  # pages given to KV at start-up, after the experts' pages
    page_bytes: int = DEFAULT_PAGE_BYTES

    def __post_init__(self) -> None:
        for name in ("kv_block_bytes", "expert_bytes", "num_layers", "num_experts", "page_bytes"):
            _require_int(name, getattr(self, name), 1)
        _require_int("num_kv_pages", self.num_kv_pages, 0)

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        *,
        kv_block_bytes: int,
        expert_bytes: int,
        num_layers: int,
        num_experts: int,
        page_bytes: int = DEFAULT_PAGE_BYTES,
    ) -> ArenaConfig:
        """All routed experts resident, and every whole page left over given to KV.

        Raises ValueError if the budget cannot hold the experts, or leaves no room for a single KV block."""
        _require_int("budget_bytes", budget_bytes, 1)
        probe = cls(kv_block_bytes, expert_bytes, num_layers, num_experts, 0, page_bytes)
        num_pages = budget_bytes // page_bytes
        need = probe.num_expert_pages
        if num_pages < need:
            raise ValueError(
                f"a budget of {budget_bytes / _GIB:.2f} GiB holds {num_pages} pages of {page_bytes} bytes, but the "
                f"routed experts alone need {need} pages ({num_layers} layers x {num_experts} experts x "
                f"{probe.pages_per_expert} pages) = {need * page_bytes / _GIB:.2f} GiB; raise the budget "
                f"(e.g. gpu memory utilization) or serve a smaller model"
            )
        config = replace(probe, num_kv_pages=num_pages - need)
        if config.num_initial_kv_blocks == 0:
            raise ValueError(
                f"a budget of {budget_bytes / _GIB:.2f} GiB leaves {config.num_kv_pages} pages for the KV cache after "
                f"the experts, which hold no whole KV block of {kv_block_bytes} bytes ({config.pages_per_block} "
                f"aligned pages each); raise the budget by at least {config.pages_per_block * page_bytes} bytes "
                f"or use a smaller block_size"
            )
        return config

    # ---- derived layout -----------------------------------------------------------------------------------
    @property
    def pages_per_expert(self) -> int:
        return cdiv(self.expert_bytes, self.page_bytes)

    @property
    def num_expert_pages(self) -> int:
        """Pages holding routed experts when all are resident."""
        return self.num_layers * self.num_experts * self.pages_per_expert

    @property
    def num_pages(self) -> int:
        return self.num_expert_pages + self.num_kv_pages

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def expert_padding_bytes(self) -> int:
        """Bytes lost because each expert occupies whole pages (over all routed experts)."""
        per_expert = self.pages_per_expert * self.page_bytes - self.expert_bytes
        return per_expert * self.num_layers * self.num_experts

    @property
    def pages_per_block(self) -> int:
        return cdiv(self.kv_block_bytes, self.page_bytes)

    @property
    def blocks_per_group(self) -> int:
        """Blocks in one group of ``pages_per_block`` pages: page // block when a block fits a page, else 1."""
        return max(1, self.page_bytes // self.kv_block_bytes)

    @property
    def num_groups(self) -> int:
        """Whole page groups in the arena; a trailing partial group never holds a block."""
        return self.num_pages // self.pages_per_block

    @property
    def num_block_ids(self) -> int:
        """Block ids range over ``[0, num_block_ids)``; which exist depends on who owns the pages."""
        return self.num_groups * self.blocks_per_group

    @property
    def num_initial_kv_blocks(self) -> int:
        first_group = cdiv(self.num_expert_pages, self.pages_per_block)
        return max(0, self.num_groups - first_group) * self.blocks_per_group


class Arena:
    """Owner of every page; converts expert regions to KV blocks and back. See the module docstring."""

    def __init__(self, config: ArenaConfig, pool: KVBlockPool | None = None) -> None:
        self.config = config
        ppe = config.pages_per_expert
        self._page_owner: list[PageOwner] = [
            (layer, expert) for layer in range(config.num_layers) for expert in range(config.num_experts)
            for _ in range(ppe)
        ]
        self._page_owner.extend([KV] * config.num_kv_pages)
        self._regions: list[tuple[ExpertKey, ...]] = []  # converted regions, in conversion order
        self._converted: set[ExpertKey] = set()
        self._num_kv_pages = config.num_kv_pages
        kv_pages = range(config.num_expert_pages, config.num_pages)
        self._kv_block_ids: set[int] = set(self._block_ids_of_groups(self._complete_groups(kv_pages)))
        self._pool: KVBlockPool | None = None
        if pool is not None:
            self.attach_pool(pool)

    def attach_pool(self, pool: KVBlockPool) -> None:
        """Attach the pool that receives and gives back blocks; it must hold exactly ``kv_block_ids()``."""
        if self._pool is not None:
            raise ValueError("this arena already has a block pool attached")
        pool_ids = list(pool.block_ids())
        if sorted(pool_ids) != self.kv_block_ids():
            raise ValueError(
                f"the pool holds {len(pool_ids)} blocks but the arena's KV pages hold {len(self._kv_block_ids)}; "
                f"build the pool from arena.kv_block_ids()"
            )
        self._pool = pool

    # ---- moving the line ----------------------------------------------------------------------------------
    def convert_experts_to_kv(self, region: Sequence[ExpertKey]) -> list[int]:
        """Give the region's home pages to KV; hand the blocks that now exist to the pool; return their ids.

        Every key must be a resident expert (not already converted). Existing blocks keep their ids and bytes."""
        keys = self._checked_region(region, converted=False)
        pages = self._pages_of_keys(keys)
        page_set = set(pages)
        groups = [g for g in self._groups_touching(pages) if self._group_is_kv(g, page_set)]
        new_ids = self._block_ids_of_groups(groups)
        if self._pool is not None and new_ids:
            self._pool.add_blocks(new_ids)  # may raise: nothing has changed yet
        for page in pages:
            self._page_owner[page] = KV
        self._num_kv_pages += len(pages)
        self._kv_block_ids.update(new_ids)
        self._converted.update(keys)
        if keys:
            self._regions.append(tuple(keys))
        return new_ids

    def reclaim(self, region: Sequence[ExpertKey]) -> bool:
        """Give converted experts their pages back if every block in those pages is free; else change nothing.

        A big block straddling a reclaimed page is removed with it (its other pages stay KV, blockless)."""
        keys = self._checked_region(region, converted=True)
        pages = self._pages_of_keys(keys)
        doomed = self._block_ids_of_groups(self._complete_groups(pages))
        if self._pool is not None and doomed and not self._pool.remove_blocks(doomed):
            return False
        for key in keys:
            for page in self.home_pages(*key):
                self._page_owner[page] = key
        self._num_kv_pages -= len(pages)
        self._kv_block_ids.difference_update(doomed)
        self._converted.difference_update(keys)
        gone = set(keys)
        self._regions = [kept for r in self._regions if (kept := tuple(k for k in r if k not in gone))]
        return True

    # ---- pure layout --------------------------------------------------------------------------------------
    def home_pages(self, layer: int, expert: int) -> range:
        self._check_key((layer, expert))
        ppe = self.config.pages_per_expert
        start = (layer * self.config.num_experts + expert) * ppe
        return range(start, start + ppe)

    def pages_of_block(self, block_id: int) -> range:
        """The pages a block id occupies (whether or not the block exists now)."""
        group = self._group_of_block(block_id)
        ppb = self.config.pages_per_block
        return range(group * ppb, (group + 1) * ppb)

    def block_location(self, block_id: int) -> tuple[int, int]:
        """(first page, byte offset in that page) of a block; a big block continues on the following pages."""
        group = self._group_of_block(block_id)
        slot = block_id % self.config.blocks_per_group
        return group * self.config.pages_per_block, slot * self.config.kv_block_bytes

    def block_byte_offset(self, block_id: int) -> int:
        """Byte offset of a block from the arena's start (pages are contiguous in the virtual address range)."""
        page, offset = self.block_location(block_id)
        return page * self.config.page_bytes + offset

    # ---- queries ------------------------------------------------------------------------------------------
    def owner(self, page: int) -> PageOwner:
        if not 0 <= page < self.config.num_pages:
            raise ValueError(f"page {page} is outside the arena's {self.config.num_pages} pages")
        return self._page_owner[page]

    def blocks_of_page(self, page: int) -> list[int]:
        """Ids of the blocks that exist now and use ``page`` (empty for an expert page)."""
        self.owner(page)
        return self._block_ids_of_groups(self._complete_groups([page]))

    def blocks_of_region(self, region: Sequence[ExpertKey]) -> list[int]:
        """Ids of the blocks that exist now and use any home page of the region's experts, sorted."""
        keys = [tuple(key) for key in region]
        for key in keys:
            self._check_key(key)
        return self._block_ids_of_groups(self._complete_groups(self._pages_of_keys(keys)))

    def kv_block_ids(self) -> list[int]:
        return sorted(self._kv_block_ids)

    def is_converted(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._converted

    def converted_regions(self) -> list[tuple[ExpertKey, ...]]:
        """Converted experts, grouped as they were converted, oldest first (reclaimed ones dropped)."""
        return list(self._regions)

    def converted_experts(self) -> list[ExpertKey]:
        return sorted(self._converted)

    @property
    def num_kv_pages(self) -> int:
        return self._num_kv_pages

    @property
    def num_expert_pages(self) -> int:
        """Pages holding resident expert weights now."""
        return self.config.num_pages - self._num_kv_pages

    @property
    def num_kv_blocks(self) -> int:
        return len(self._kv_block_ids)

    @property
    def kv_bytes(self) -> int:
        return self._num_kv_pages * self.config.page_bytes

    @property
    def kv_usable_bytes(self) -> int:
        return len(self._kv_block_ids) * self.config.kv_block_bytes

    @property
    def kv_waste_bytes(self) -> int:
        """KV-owned bytes no block uses: page tails, and pages of groups that are not all KV."""
        return self.kv_bytes - self.kv_usable_bytes

    # ---- checks -------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if pages, blocks, regions and the pool disagree."""
        cfg = self.config
        assert len(self._page_owner) == cfg.num_pages, "page table has the wrong length"
        for page in range(cfg.num_expert_pages):
            key = self._page_owner[page]
            home = (page // cfg.pages_per_expert // cfg.num_experts, page // cfg.pages_per_expert % cfg.num_experts)
            expected = KV if home in self._converted else home
            assert key == expected, f"page {page} owned by {key!r}, expected {expected!r}"
        for page in range(cfg.num_expert_pages, cfg.num_pages):
            assert self._page_owner[page] == KV, f"initial KV page {page} owned by {self._page_owner[page]!r}"
        assert self._num_kv_pages == self._page_owner.count(KV), "KV page count drifted"
        derived = set(self._block_ids_of_groups(self._complete_groups(range(cfg.num_pages))))
        assert self._kv_block_ids == derived, f"block ids differ from pages: {sorted(self._kv_block_ids ^ derived)[:8]}"
        for block_id in self._kv_block_ids:
            assert all(self._page_owner[p] == KV for p in self.pages_of_block(block_id)), f"block {block_id}"
        flat = [key for region in self._regions for key in region]
        assert len(flat) == len(set(flat)) and set(flat) == self._converted, "converted regions disagree"
        if self._pool is not None:
            pool_ids = list(self._pool.block_ids())
            assert len(pool_ids) == len(set(pool_ids)), "pool lists a block id twice"
            assert set(pool_ids) == self._kv_block_ids, (
                f"pool and arena disagree on blocks: {sorted(set(pool_ids) ^ self._kv_block_ids)[:8]}"
            )

    # ---- helpers ------------------------------------------------------------------------------------------
    def _check_key(self, key: ExpertKey) -> None:
        check_expert_key(key, self.config.num_layers, self.config.num_experts)

    def _checked_region(self, region: Sequence[ExpertKey], *, converted: bool) -> list[ExpertKey]:
        keys = [tuple(key) for key in region]
        for key in keys:
            self._check_key(key)
            if (key in self._converted) != converted:
                state = "already converted to KV; reclaim it first" if not converted else "not converted to KV"
                raise ValueError(f"expert {key} is {state}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"region lists an expert more than once: {keys}")
        return keys  # type: ignore[return-value]

    def _pages_of_keys(self, keys: Iterable[ExpertKey]) -> list[int]:
        return [page for key in keys for page in self.home_pages(*key)]

    def _groups_touching(self, pages: Iterable[int]) -> list[int]:
        ppb = self.config.pages_per_block
        num_groups = self.config.num_groups
        return sorted({page // ppb for page in pages if page // ppb < num_groups})

    def _group_is_kv(self, group: int, also_kv: set[int] | frozenset[int] = frozenset()) -> bool:
        ppb = self.config.pages_per_block
        owner = self._page_owner
        return all(owner[p] == KV or p in also_kv for p in range(group * ppb, (group + 1) * ppb))

    def _complete_groups(self, pages: Iterable[int]) -> list[int]:
        return [g for g in self._groups_touching(pages) if self._group_is_kv(g)]

    def _block_ids_of_groups(self, groups: Iterable[int]) -> list[int]:
        bpg = self.config.blocks_per_group
        return [g * bpg + slot for g in groups for slot in range(bpg)]

    def _group_of_block(self, block_id: int) -> int:
        if not isinstance(block_id, int) or not 0 <= block_id < self.config.num_block_ids:
            raise ValueError(f"block id {block_id!r} is outside [0, {self.config.num_block_ids})")
        return block_id // self.config.blocks_per_group

