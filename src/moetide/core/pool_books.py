"""The books of a ``core.blocks.BlockPool`` and what can be read of them: reference counts, the free queues (device
uncached, host uncached, cached in LRU order), the drain sets and the prefix index. ``BlockPool`` is the only
subclass and the only writer; the module docstring of ``core.blocks`` says what each queue is for."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

from moetide.core.host_tier import HostTier
from moetide.core.prefix_index import PrefixIndex


class PoolBooks:
    """The state every pool operation reads and writes, its counts and its read-only queries."""

    def __init__(self, block_ids: Iterable[int], *, enable_caching: bool = True,
                 host_tier: HostTier | None = None) -> None:
        """``block_ids``: the device blocks; ``host_tier``'s blocks are added after them."""
        self.enable_caching = enable_caching
        self.host_tier = host_tier
        self._ref_cnt: dict[int, int] = {}
        self._uncached_free: OrderedDict[int, None] = OrderedDict()  # device blocks (every block without a tier)
        self._host_free: OrderedDict[int, None] = OrderedDict()  # uncached free host blocks, allocated after them
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._index = PrefixIndex()
        self._draining: set[int] = set()  # blocks marked to leave (drain); those with no reference are drained
        self._drained: set[int] = set()  # draining blocks with no reference: out of both free queues
        self._num_host_in_use = 0  # host blocks with a reference (a shared one counts once)
        self.num_evicted_blocks = 0  # lifetime counter, for metrics
        # Bumped whenever blocks become free or are added: a caller that failed to allocate can skip retrying
        # until it changes (the scheduler's blocked queue head).
        self.free_version = 0
        self._no_device_cached_at = -1  # free_version at which evict_device found no candidate
        self.add_blocks(block_ids)
        if host_tier is not None:
            self.add_blocks(host_tier.ids())

    # ---- counts -------------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._ref_cnt)

    @property
    def num_free_blocks(self) -> int:
        return len(self._uncached_free) + len(self._host_free) + len(self._cached_free)

    @property
    def num_uncached_free_blocks(self) -> int:
        return len(self._uncached_free) + len(self._host_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._ref_cnt) - self.num_free_blocks - len(self._drained)

    @property
    def num_host_blocks_in_use(self) -> int:
        """Host blocks of a two-tier pool that some request holds, each once however many share it (0 without a
        tier): what a server reports as host KV in use."""
        return self._num_host_in_use

    @property
    def num_drained_blocks(self) -> int:
        """Blocks marked by ``drain`` that have no reference left: owned, never allocated, waiting for removal."""
        return len(self._drained)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, in use or free (duplicates included)."""
        return len(self._index)

    def block_ids(self) -> list[int]:
        return sorted(self._ref_cnt)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def is_free(self, block_id: int) -> bool:
        """No reference (a drained block is free too, though never allocated)."""
        return self._ref_cnt[block_id] == 0

    def is_draining(self, block_id: int) -> bool:
        return block_id in self._draining

    def is_host(self, block_id: int) -> bool:
        return self.host_tier is not None and self.host_tier.holds(block_id)

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of the given blocks are free (e.g. a request's protected prefix hits)."""
        ref_cnt = self._ref_cnt
        return sum(1 for b in block_ids if ref_cnt[b] == 0)

    def block_hash(self, block_id: int) -> int | None:
        return self._index.hash_of(block_id)

    def eviction_covers(self, num_blocks: int, protect: Collection[int] = ()) -> bool:
        """Whether the cached free blocks outside ``protect`` (a requester's own hits) number ``num_blocks`` or
        more: what eviction alone can free."""
        cached = len(self._cached_free)
        return cached - len(protect) >= num_blocks or cached - self.num_free_among(protect) >= num_blocks

    def cached_free_block_ids(self) -> list[int]:
        """Cached-but-free blocks in eviction order (next victim first)."""
        return list(self._cached_free)

    def uncached_free_block_ids(self) -> list[int]:
        """Uncached free blocks in allocation order (device blocks first)."""
        return [*self._uncached_free, *self._host_free]

    def _host_range(self) -> tuple[int, int]:
        """``lo <= b < hi`` for the host ids (an empty range without a tier), for the per-block loops."""
        tier = self.host_tier
        return (tier.first_id, tier.end_id) if tier is not None else (0, 0)

    def _uncached_queue(self, block_id: int) -> OrderedDict[int, None]:
        tier = self.host_tier
        return self._host_free if tier is not None and tier.holds(block_id) else self._uncached_free

    def _release_uncached(self, block_id: int) -> None:
        """An uncached block becomes free outside ``free``: a device block of a two-tier pool to the head of its
        queue (allocated next), any other to the tail."""
        tier = self.host_tier
        if tier is None:
            self._uncached_free[block_id] = None
        elif tier.holds(block_id):
            self._host_free[block_id] = None
        else:
            self._uncached_free[block_id] = None
            self._uncached_free.move_to_end(block_id, last=False)
