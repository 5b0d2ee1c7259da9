"""moetide's pool books over vLLM's own ``BlockPool``: what a policy reads, and how the line grows and shrinks it.

The core's policies read a pool through a handful of queries (``core.pool_books``) and the expert line changes it
through ``add_blocks``/``remove_blocks``/``drain`` (``core.expert_line``). ``VllmPool`` answers the same calls from
vLLM's ``BlockPool``, so the policy that decides in the replay decides here, on vLLM's blocks, with nothing copied.

* **The reserve.** vLLM sizes its pool once. The plugin builds it for the whole line (``num_base_blocks`` plus the
  blocks the offload cap can add) and holds every id past the base out of the free queue: those ids exist (the
  worker's KV views span them) but are neither free nor in use until a region of experts is given to the KV cache.
* **Where grown blocks go.** vLLM keeps one free queue: never-cached blocks at the head (freed ones are prepended),
  cached ones behind them in LRU order, and it evicts whatever cached block reaches the head. A region's blocks are
  inserted after the last never-cached block and before the first cached one: allocated before any cached prefix is
  evicted, after the blank blocks already there (moetide's pool appends new ids to its uncached queue the same way).
* **Eviction.** ``evict`` uncaches the first cached blocks of the queue in place, the blocks vLLM's next allocation
  would have evicted, in the same order, so the blocks an allocation takes are the same either way. It takes
  moetide's semantics, whose plan the policy counted: a victim goes with its registered descendants (none could be
  hit again), whose free blocks join the never-cached ones. vLLM leaves them cached; LRU victims are chain tails,
  with no descendants, so the two differ only where a drain or a shared prefix breaks a chain in its middle.
  For that the view keeps the chains of the hash group's cached blocks (``cache_full_blocks`` is wrapped), as
  moetide's prefix index does.
* **Draining.** A region going back to its experts drains: its free blocks leave the queue now (evicted first,
  as above); a block in use leaves when vLLM frees its last reference (``free_blocks`` is wrapped for that).

Counting free blocks by kind walks the free queue (vLLM keeps no such count): O(free blocks), read only when a
policy is asked at a shortfall or checks its room. Where vLLM's series differ (how its hash map holds a hash's
blocks), ``vllm.versions`` reads them; a series it does not cover is refused when the pool is adopted.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence

from vllm.v1.core.block_pool import BlockPool as VllmBlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash

from moetide.vllm.versions import holders_reader


class VllmPool:
    """The core's pool protocol (reads, line growth, drains) over one vLLM ``BlockPool`` (module docstring)."""

    host_tier = None  # no host KV tier inside vLLM

    def __init__(self, pool: VllmBlockPool, *, num_base_blocks: int, hash_group_id: int = 0) -> None:
        """``num_base_blocks``: the pool's blocks at start, vLLM's null block 0 included; every id past them is the
        line's reserve. ``hash_group_id``: the KV cache group whose hashes stand for a block's prefix (a
        full-attention group)."""
        if not 1 < num_base_blocks <= len(pool.blocks):
            raise ValueError(f"num_base_blocks must be in (1, {len(pool.blocks)}], got {num_base_blocks}")
        self.pool, self.hash_group_id, self.num_base_blocks = pool, hash_group_id, num_base_blocks
        self.enable_caching = pool.enable_caching
        self._read_holders = holders_reader()  # refuses a vLLM series it does not cover, before anything changes
        reserve = pool.blocks[num_base_blocks:]
        if any(b.ref_cnt or b.prev_free_block is None for b in reserve):
            raise RuntimeError("the line's reserve must be free when the pool is adopted")
        for block in reserve:
            pool.free_block_queue.remove(block)
        self._reserve = {b.block_id for b in reserve}
        pool.num_gpu_blocks = num_base_blocks
        self._draining: set[int] = set()
        self._drained: set[int] = set()
        self.num_evicted_blocks = 0
        # the hash group's chains: children under their parent's hash key; each child's own key when registered
        self._children: dict[object, set[int]] = {}
        self._key_of: dict[int, object] = {}
        self._parent_of: dict[int, object] = {}
        cache_full_blocks = pool.cache_full_blocks

        def cache_and_chain(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                            *args, **kwargs) -> None:
            cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
                              *args, **kwargs)
            if kv_cache_group_id == hash_group_id:
                self._chain(blocks, num_cached_blocks, num_full_blocks)

        pool.cache_full_blocks = cache_and_chain
        free_blocks = pool.free_blocks

        def free_and_drain(ordered_blocks: Iterable[KVCacheBlock], *args, **kwargs) -> None:
            blocks = list(ordered_blocks)
            free_blocks(blocks, *args, **kwargs)
            if self._draining:
                for block in blocks:
                    if block.block_id in self._draining and block.ref_cnt == 0 and block.block_id not in self._drained:
                        self._drain_free(block)

        pool.free_blocks = free_and_drain

    # ---- counts -------------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks the pool owns now, the null block left out (as moetide's pool numbers them from 1)."""
        return self.pool.num_gpu_blocks - 1

    @property
    def num_reserved_blocks(self) -> int:
        return len(self._reserve)

    def _free_blocks(self) -> Iterator[KVCacheBlock]:
        """The free queue from its head (the next block vLLM allocates)."""
        queue = self.pool.free_block_queue
        block, tail = queue.fake_free_list_head.next_free_block, queue.fake_free_list_tail
        while block is not tail:
            yield block
            block = block.next_free_block

    def _is_cached(self, block: KVCacheBlock) -> bool:
        return block.block_hash is not None or block.block_id in self.pool.cached_block_hashes_by_block

    @property
    def num_uncached_free_blocks(self) -> int:
        return sum(1 for b in self._free_blocks() if not self._is_cached(b))

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self._free_blocks() if self._is_cached(b))

    @property
    def num_drained_blocks(self) -> int:
        return len(self._drained)

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        blocks = self.pool.blocks
        return sum(1 for b in block_ids if blocks[b].ref_cnt == 0)

    def is_free(self, block_id: int) -> bool:
        return self.pool.blocks[block_id].ref_cnt == 0

    def is_draining(self, block_id: int) -> bool:
        return block_id in self._draining

    def block_hash(self, block_id: int) -> bytes | None:
        """The block's prefix hash as a request's ``block_hashes`` hold it (vLLM's group id stripped)."""
        key = self.pool.blocks[block_id].block_hash
        return None if key is None else get_block_hash(key)

    def block_ids(self) -> list[int]:
        return [b for b in range(1, len(self.pool.blocks)) if b not in self._reserve]

    def eviction_covers(self, num_blocks: int, protect: Collection[int] = ()) -> bool:
        """Whether the cached free blocks outside ``protect`` number ``num_blocks`` or more, found by walking the
        free queue only until that many are seen (a shortfall is small; the queue may hold the whole pool)."""
        if num_blocks <= 0:
            return True
        found = 0
        for block in self._free_blocks():
            if self._is_cached(block) and block.block_id not in protect:
                found += 1
                if found >= num_blocks:
                    return True
        return False

    def num_cached_among_next(self, num_blocks: int, skip: Collection[int] = ()) -> int:
        """How many of the next ``num_blocks`` blocks vLLM would allocate (``skip``'s aside: a request's hits,
        which leave the queue first) are cached: those its allocation would evict. O(num_blocks)."""
        cached = taken = 0
        for block in self._free_blocks():
            if taken >= num_blocks:
                break
            if block.block_id in skip:
                continue
            taken += 1
            cached += self._is_cached(block)
        return cached

    # ---- what eviction would take -------------------------------------------------------------------------
    def peek_victims(self, num_blocks: int, protect: Collection[int] = ()) -> list[int]:
        """The cached free blocks vLLM would evict next, in order (its requester's own hits excepted)."""
        out: list[int] = []
        for block in self._free_blocks():
            if len(out) >= num_blocks:
                break
            if self._is_cached(block) and block.block_id not in protect:
                out.append(block.block_id)
        return out

    def _chain(self, blocks: Sequence[KVCacheBlock], start: int, end: int) -> None:
        """Record the chain links of blocks ``start..end-1`` of a request's table, as vLLM just cached them."""
        for i in range(max(start, 1), end):
            block, parent = blocks[i], blocks[i - 1]
            if block.is_null or parent.is_null or block.block_hash is None or parent.block_hash is None:
                continue
            old = self._parent_of.get(block.block_id)
            if old is not None:  # the block held another prefix before: drop that link (bounded books)
                siblings = self._children[old]
                siblings.discard(block.block_id)
                if not siblings:
                    del self._children[old]
            self._key_of[block.block_id] = block.block_hash
            self._parent_of[block.block_id] = parent.block_hash
            self._children.setdefault(parent.block_hash, set()).add(block.block_id)

    def registered_descendants(self, block_id: int, limit: int | None = None, skip: Collection[int] = ()) -> list[int]:
        """Cached blocks whose chains pass through this one (none while another block holds its hash), each once:
        what draining it takes besides itself (``core.prefix_index.PrefixIndex.descendants``)."""
        blocks = self.pool.blocks
        key = blocks[block_id].block_hash
        if key is None or len(self._holders(key)) > 1:
            return []
        stack = [(key, child) for child in self._children.get(key, ())]
        entered, out = {key}, []
        while stack and (limit is None or len(out) < limit):
            parent_key, child = stack.pop()
            child_key = blocks[child].block_hash
            if (child in skip or child_key is None or self._key_of.get(child) != child_key
                    or self._parent_of.get(child) != parent_key):
                continue  # evicted (and maybe cached again under another parent) since the link was made
            out.append(child)
            if child_key not in entered:
                entered.add(child_key)
                stack.extend((child_key, c) for c in self._children.get(child_key, ()))
        return out

    def _holders(self, key) -> list[int]:
        """Ids of every block vLLM has cached under ``key`` (more than one where requests filled the same prefix
        apart: vLLM does not deduplicate)."""
        return self._read_holders(self.pool.cached_block_hash_to_block, key)

    def _uncache_chain(self, block: KVCacheBlock) -> list[int]:
        """Evict a cached block and its registered descendants (moetide's semantics); free descendants move to
        where never-cached blocks wait, the block itself stays where it is. Returns the free blocks evicted."""
        freed = []
        for block_id in [block.block_id, *self.registered_descendants(block.block_id)]:
            victim = self.pool.blocks[block_id]
            self.pool.evict_blocks({block_id})
            self._key_of.pop(block_id, None)
            if victim.ref_cnt == 0 and block_id not in self._drained:
                freed.append(block_id)
                if victim is not block and victim.prev_free_block is not None:
                    self.pool.free_block_queue.remove(victim)
                    self._insert_before(self._first_cached(), victim)
        return freed

    def lookup_chain(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes`` in the hash group (no references taken)."""
        out = []
        for block_hash in block_hashes:
            hit = self.pool.get_cached_block(block_hash, [self.hash_group_id])
            if hit is None:
                break
            out.append(hit[0].block_id)
        return out

    def evict(self, num_blocks: int, protect: Collection[int] = ()) -> list[int]:
        """Uncache at least ``num_blocks`` cached free blocks, the queue's first cached blocks first, each with
        its registered descendants (``core.blocks.BlockPool.evict``, whose plan the policy counted); returns every
        block that became never-cached and free. A victim is uncached in place: the blocks vLLM's next allocation
        would have evicted, in the same order (LRU victims are chain tails, with no descendants)."""
        evicted: list[int] = []
        for block_id in self.peek_victims(num_blocks + len(protect)):
            if len(evicted) >= num_blocks:
                break
            block = self.pool.blocks[block_id]
            if block_id not in protect and self._is_cached(block):
                evicted += self._uncache_chain(block)
        self.num_evicted_blocks += len(evicted)
        return evicted

    # ---- the line -----------------------------------------------------------------------------------------
    def add_blocks(self, block_ids: Iterable[int]) -> None:
        """Give reserve blocks to the pool, after its never-cached free blocks and before its cached ones."""
        ids = list(block_ids)
        missing = [b for b in ids if b not in self._reserve]
        if missing or len(set(ids)) != len(ids):
            raise ValueError(f"block ids not in the line's reserve, or repeated: {sorted(set(missing))[:8]}")
        anchor = self._first_cached()
        for block_id in ids:
            self._insert_before(anchor, self.pool.blocks[block_id])
            self._reserve.discard(block_id)
        self.pool.num_gpu_blocks += len(ids)

    def _first_cached(self) -> KVCacheBlock:
        """The first cached block of the free queue (its tail sentinel if none): where blank blocks go before."""
        tail = self.pool.free_block_queue.fake_free_list_tail
        return next((b for b in self._free_blocks() if self._is_cached(b)), tail)

    def _insert_before(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        prev = anchor.prev_free_block
        prev.next_free_block, block.prev_free_block = block, prev
        block.next_free_block, anchor.prev_free_block = anchor, block
        self.pool.free_block_queue.num_free_blocks += 1

    def remove_blocks(self, block_ids: Iterable[int]) -> bool:
        """Take the blocks back into the reserve if every one is free (drained ones count); else change nothing."""
        ids = list(block_ids)
        blocks = self.pool.blocks
        if (len(set(ids)) != len(ids) or any(b in self._reserve or b < self.num_base_blocks for b in ids)
                or any(blocks[b].ref_cnt for b in ids)):
            return False  # only granted blocks leave, and only when every one is free
        for block_id in ids:
            if self._is_cached(blocks[block_id]):
                self._uncache_chain(blocks[block_id])
        for block_id in ids:
            if block_id in self._drained:
                self._drained.remove(block_id)
            else:
                self.pool.free_block_queue.remove(blocks[block_id])
            self._draining.discard(block_id)
            self._reserve.add(block_id)
        self.pool.num_gpu_blocks -= len(ids)
        return True

    def drain(self, block_ids: Iterable[int]) -> None:
        """Mark blocks to leave the pool: free ones leave the free queue now, the rest when vLLM frees them."""
        ids = [b for b in block_ids if b not in self._draining]
        if any(b in self._reserve or b < self.num_base_blocks for b in ids):
            raise ValueError(f"only blocks the line granted can drain, not {sorted(ids)[:8]}")
        self._draining.update(ids)
        for block_id in ids:
            block = self.pool.blocks[block_id]
            if block.ref_cnt == 0:
                self._drain_free(block)

    def undrain(self, block_ids: Iterable[int]) -> None:
        """Cancel a drain: drained blocks rejoin the queue where a grown block goes (their cached content is gone)."""
        back = []
        for block_id in block_ids:
            if block_id in self._draining:
                self._draining.remove(block_id)
                if block_id in self._drained:
                    self._drained.remove(block_id)
                    back.append(block_id)
        if back:
            self._reserve.update(back)
            self.pool.num_gpu_blocks -= len(back)
            self.add_blocks(back)

    def _drain_free(self, block: KVCacheBlock) -> None:
        """A draining block with no reference leaves the free queue (uncached first, with its descendants)."""
        if self._is_cached(block):
            self._uncache_chain(block)
        self.pool.free_block_queue.remove(block)
        self._drained.add(block.block_id)

    # ---- checks -------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The free queue, the reserve and the drained set partition the free ids; counts agree with vLLM's."""
        free = [b.block_id for b in self._free_blocks()]
        assert len(free) == len(set(free)) == self.pool.get_num_free_blocks(), "free queue and its count differ"
        assert not (set(free) & self._reserve) and not (set(free) & self._drained), "a reserved block is free"
        assert self._drained <= self._draining, "drained blocks must be draining"
        assert all(self.pool.blocks[b].ref_cnt == 0 for b in self._reserve | self._drained), "a reserved block is used"
        assert self.pool.num_gpu_blocks == len(self.pool.blocks) - len(self._reserve), "num_gpu_blocks is off"
