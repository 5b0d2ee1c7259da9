"""KV block pool with prefix caching, in vLLM-v1 semantics, plus the books a memory policy needs.

What it is: the set of KV block ids the accelerator currently gives to the KV cache, each with a reference count
and, once full and registered, a chained hash (``core.hashing``). Blocks whose count drops to zero stay cached and
can be hit again until they are evicted — vLLM v1's ``BlockPool``.

How it differs from vLLM's pool, and why:

* **Two free queues, not one.** vLLM keeps one LRU queue that mixes never-cached and cached-but-free blocks and
  silently evicts whatever is at its head. Here *uncached* free blocks and *cached* free blocks are kept apart:
  ``allocate`` only ever takes uncached blocks, and turning a cached prefix into free space is a separate, explicit
  ``evict`` call. A memory policy (``core.pressure``) must weigh evicting a reusable prefix against its other ways
  out *before* the prefix is lost, and it can only do that if eviction is never a side effect of allocation.
* **Not a deque.** Hits take blocks out of the middle of the free queues, so each queue is an ``OrderedDict``
  keyed by block id: O(1) append, O(1) pop of the oldest, O(1) removal from anywhere — what vLLM's hand-written
  doubly linked ``FreeKVCacheBlockQueue`` gives, with the linking done in C.
* **Eviction order.** The cached queue is in LRU order of release. Requests release their blocks tail first
  (``KVCacheManager.free`` reverses the block table, as vLLM does), so the tail of a chain is evicted before its
  head and a shared system prompt outlives the conversations built on it.
* **Invalidation down the chain, and duplicates** (``core.prefix_index``, which holds the hash books). Evicting a
  block unregisters every registered descendant at once, since none could be hit again (vLLM leaves them until
  they drift to the queue's head). One hash may be held by several blocks, as vLLM keeps them; it stays registered
  until its last holder goes. A freed duplicate is a cached block like any other, queued by LRU.
* **Never-cached blocks are reused last in, first out.** A freed block without a hash goes to the head of the
  uncached queue (vLLM's ``free_blocks`` prepends them, for locality), a cached one to the tail of its LRU queue.
* **Growth and shrink by given ids.** The arena (``core.arena``) decides which block ids exist; the pool adds and
  removes exactly those. Removal is atomic: all free, or nothing changes.
* **Draining.** ``drain(ids)`` marks blocks that are about to leave (an expert region going back to its experts):
  free ones leave the free queues at once (a cached one is evicted first, with its descendants), and each one in
  use leaves when its last reference goes, instead of rejoining a queue. A drained block is owned, free and never
  allocated; ``remove_blocks`` takes it, ``undrain`` puts it back. So a region in a busy pool empties as its
  requests finish, rather than waiting for a moment when every one of its blocks happens to be free.
* **Two tiers, optionally.** With a ``HostTier`` (the host KV blocks' ids), host blocks have a free queue of
  their own, and every uncached free device block is allocated before any host block. So device KV is used
  first and host KV only once no uncached device block is free (WriteScope's device-first placement,
  ``core.splits``). A free device block holding a cached prefix is not evicted for it: as everywhere here,
  eviction is the policy's call, never allocation's, so new KV spills to the host while old prefixes stay hittable
  in HBM. A freed or uncached device block goes to the head of the device queue, a host block to the tail of the
  host queue. Without a tier, nothing changes.

Atomicity: ``allocate`` either returns all the blocks asked for or returns ``None`` and changes nothing — there is
no separate "can I?" call whose answer could be stale by the time of "do it".
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from itertools import islice

from moetide.core.host_tier import HostTier
from moetide.core.pool_books import PoolBooks

__all__ = ["BlockPool", "HostTier"]


class BlockPool(PoolBooks):
    """Reference-counted KV blocks with an LRU prefix cache and separate uncached/cached free queues: the
    operations (``core.pool_books`` holds the books and what can be read of them)."""

    # ---- allocation and references ------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` uncached free blocks (ref count 1 each), device blocks first, or return None and
        change nothing."""
        device, host = self._uncached_free, self._host_free
        if num_blocks > len(device) + len(host):
            return None
        ref_cnt = self._ref_cnt
        out = []
        for _ in range(num_blocks):
            if device:
                block_id = device.popitem(last=False)[0]
            else:
                block_id = host.popitem(last=False)[0]
                self._num_host_in_use += 1
            ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on each block (cache hits); a free block leaves its free queue."""
        ref_cnt, hashed, cached_free = self._ref_cnt, self._index.hash_by_block, self._cached_free
        host_lo, host_hi = self._host_range()
        for block_id in block_ids:
            count = ref_cnt[block_id]
            if count == 0:
                host = host_lo <= block_id < host_hi
                if host:
                    self._num_host_in_use += 1
                if block_id in hashed:
                    del cached_free[block_id]
                elif host:
                    del self._host_free[block_id]
                else:
                    del self._uncached_free[block_id]
            ref_cnt[block_id] = count + 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given. At zero a cached block joins the tail of the LRU
        queue; the uncached device blocks of this call go, in the order given, to the head of their queue, the
        host ones to the tail of theirs."""
        ref_cnt, hashed = self._ref_cnt, self._index.hash_by_block
        cached_free, uncached_free, draining = self._cached_free, self._uncached_free, self._draining
        host_lo, host_hi = self._host_range()
        self.free_version += 1
        first: list[int] = []
        for block_id in block_ids:
            count = ref_cnt[block_id] - 1
            if count < 0:
                raise ValueError(f"block {block_id} freed more times than it was taken")
            ref_cnt[block_id] = count
            if count == 0:
                host = host_lo <= block_id < host_hi
                if host:
                    self._num_host_in_use -= 1
                if draining and block_id in draining:
                    self._drain_free_block(block_id)
                elif block_id in hashed:
                    cached_free[block_id] = None
                elif host:
                    self._host_free[block_id] = None
                else:
                    uncached_free[block_id] = None
                    first.append(block_id)
        for block_id in reversed(first):
            uncached_free.move_to_end(block_id, last=False)

    # ---- the prefix cache ---------------------------------------------------------------------------------
    def cache_block(self, block_id: int, block_hash: int, parent_hash: int | None) -> bool:
        """Register a full block under ``block_hash`` (``parent_hash`` None for a chain's first block); another
        block may hold the same hash (a duplicate: the module docstring).

        Returns False and changes nothing if caching is off, the block already holds that hash, or the parent hash
        is not registered (an eviction broke the chain: the block could never be hit)."""
        if parent_hash is None:
            return self.cache_chain([block_id], [block_hash], 0, 1) == 1
        return self.cache_chain([block_id, block_id], [parent_hash, block_hash], 1, 2) == 1

    def cache_chain(self, block_ids: Sequence[int], block_hashes: Sequence[int], start: int, end: int) -> int:
        """Register blocks ``start..end-1`` of one chain (``PrefixIndex.register_chain``); a free block among them
        moves to the cached queue. Returns how many were registered. The scheduler's hot path."""
        if not self.enable_caching:
            return 0
        registered = self._index.register_chain(block_ids, block_hashes, start, end)
        ref_cnt = self._ref_cnt
        for block_id in registered:
            if ref_cnt[block_id] == 0:
                del self._uncached_queue(block_id)[block_id]
                self._cached_free[block_id] = None
                self._no_device_cached_at = -1  # a cached-free block appeared without a free()
        return len(registered)

    def registered_descendants(self, block_id: int, limit: int | None = None,
                               skip: Collection[int] = ()) -> list[int]:
        """Registered blocks whose chains pass through this one: what evicting it invalidates besides itself
        (nothing while another block holds its hash). Stops after ``limit`` blocks when given; does not enter
        blocks in ``skip`` (already accounted for)."""
        return self._index.descendants(block_id, limit, skip)

    def peek_victims(self, num_blocks: int, protect: Collection[int] = ()) -> list[int]:
        """The cached-free blocks ``evict(num_blocks, protect)`` would take first (heads of cascades), in order.
        Leaves first in the usual chain-tail-first order, so this is exact unless a victim has descendants."""
        out = []
        for block_id in self._cached_free:
            if len(out) >= num_blocks:
                break
            if block_id not in protect:
                out.append(block_id)
        return out

    def lookup(self, block_hash: int) -> int | None:
        return self._index.lookup(block_hash)

    def lookup_chain(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes`` (a chain; no references taken)."""
        return self._index.lookup_chain(block_hashes)

    def evict(self, num_blocks: int, protect: Collection[int] = ()) -> list[int]:
        """Uncache at least ``num_blocks`` cached-free blocks (fewer only if there are not that many), head of the
        LRU queue first, each with its registered descendants. Returns every block that became uncached-free.

        ``protect`` holds blocks that must survive (a request's own prefix hits, looked up but not yet taken). It
        must be closed under ancestors — a prefix chain is — so no cascade can reach a protected block.
        """
        evicted: list[int] = []
        cached_free = self._cached_free
        if not protect:
            self._evict_from_head(num_blocks, evicted)
            return evicted
        # One snapshot of the queue's head: it holds at most len(protect) protected blocks, and every other
        # block evicts at least itself, so it always holds enough victims (no rescans from the head).
        for block_id in list(islice(cached_free, num_blocks + len(protect))):
            if len(evicted) >= num_blocks:
                break
            if block_id in cached_free and block_id not in protect:
                self._uncache_chain(block_id, evicted)
        return evicted

    def num_device_uncached(self, limit: int) -> int:
        """Uncached free device blocks of a two-tier pool, counted up to ``limit`` (0 without a tier)."""
        return min(len(self._uncached_free), limit) if self.host_tier is not None else 0

    def num_device_cached(self, limit: int, scan: int = 4096) -> int:
        """Cached-free device blocks among the ``scan`` oldest cached-free blocks, counted up to ``limit``: what
        ``evict_device`` with the same ``scan`` could uncache (before protection)."""
        tier, n = self.host_tier, 0
        if tier is None or limit <= 0 or self._no_device_cached_at == self.free_version:
            return 0
        for block_id in islice(self._cached_free, scan):
            if not tier.holds(block_id):
                n += 1
                if n >= limit:
                    break
        return n

    def evict_device(self, num_blocks: int, protect: Collection[int] = (), scan: int = 4096) -> list[int]:
        """Uncache cached-free device blocks of a two-tier pool, least recently used first, each with its registered
        descendants, until ``num_blocks`` of them are uncached or the ``scan`` oldest cached-free blocks are
        exhausted (a bound on the work: the queue mixes both tiers). ``protect`` as in ``evict``. Returns every
        block that became uncached-free, of either tier."""
        tier, cached_free, evicted = self.host_tier, self._cached_free, []
        if tier is None or num_blocks <= 0 or self._no_device_cached_at == self.free_version:
            return evicted
        candidates = [b for b in islice(cached_free, scan) if not tier.holds(b)]
        if not candidates:  # none can appear before a block is freed again (free_version): skip the scans till then
            self._no_device_cached_at = self.free_version
        protected = protect if isinstance(protect, (set, frozenset)) else set(protect)
        victims = [b for b in candidates if b not in protected]
        got = 0
        for block_id in victims:
            if got >= num_blocks:
                break
            if block_id in cached_free:  # not uncached already by an earlier victim's cascade
                start = len(evicted)
                self._uncache_chain(block_id, evicted)
                got += sum(1 for b in evicted[start:] if not tier.holds(b))
        return evicted

    def promote(self, block_id: int) -> int | None:
        """Move a free cached host block's registration — its hash and its place in its chain — to the first
        uncached free device block, and return that block; the old one becomes uncached. The caller copies the
        content (the engine at the start of the step, the replay by charging the copy). Its registered descendants
        stay: their parent hash is unchanged. None, changing nothing, without a tier, when the block is in use (a
        block registered this step may not be computed yet), not cached, or no device block is free."""
        if self.host_tier is None or self._ref_cnt.get(block_id) != 0 or block_id not in self._index:
            return None
        target = next(iter(self._uncached_free), None)
        if target is None:
            return None
        self._index.move(block_id, target)
        del self._cached_free[block_id], self._uncached_free[target]
        self._cached_free[target] = None
        self._release_uncached(block_id)
        self._no_device_cached_at = -1  # a cached-free device block appeared
        return target

    def uncache(self, block_id: int) -> list[int]:
        """Unregister one block and every registered descendant, in use or free (a block in use stays with its
        holders, now private). Returns the free ones, which join the uncached queue. A block not registered: []."""
        evicted: list[int] = []
        if block_id in self._index:
            self._uncache_chain(block_id, evicted)
        return evicted

    def _evict_from_head(self, num_blocks: int, evicted: list[int]) -> None:
        """Unprotected eviction from the LRU head: leaves (the common case) inline, others through the cascade."""
        cached_free, index, pop_head = self._cached_free, self._index, self._cached_free.popitem
        release, append = self._release_uncached, evicted.append
        num_leaves = 0
        while len(evicted) < num_blocks and cached_free:
            block_id = pop_head(False)[0]
            if not index.is_sole_leaf(block_id):  # back to the head, then the general path
                cached_free[block_id] = None
                cached_free.move_to_end(block_id, last=False)
                self._uncache_chain(block_id, evicted)
                continue
            index.unregister_leaf(block_id)
            release(block_id)
            append(block_id)
            num_leaves += 1
        self.num_evicted_blocks += num_leaves

    def _uncache_chain(self, block_id: int, evicted: list[int]) -> None:
        ref_cnt = self._ref_cnt
        for block_id in self._index.unregister_chain(block_id):
            if ref_cnt[block_id] == 0:
                del self._cached_free[block_id]
                self._release_uncached(block_id)
                evicted.append(block_id)
                self.num_evicted_blocks += 1

    # ---- growth and shrink --------------------------------------------------------------------------------
    def add_blocks(self, block_ids: Iterable[int]) -> None:
        """New block ids join the tail of their uncached free queue (device ids of a two-tier pool: its head, in
        the order given)."""
        new_ids = list(block_ids)
        clash = [b for b in new_ids if b in self._ref_cnt]
        if clash or len(set(new_ids)) != len(new_ids):
            raise ValueError(f"block ids already in the pool or repeated: {sorted(set(clash))[:8]}")
        for block_id in new_ids:
            self._ref_cnt[block_id] = 0
            self._uncached_queue(block_id)[block_id] = None
        if self.host_tier is not None:
            for block_id in reversed(new_ids):
                if not self.host_tier.holds(block_id):
                    self._uncached_free.move_to_end(block_id, last=False)
        self.free_version += 1

    def remove_blocks(self, block_ids: Iterable[int]) -> bool:
        """Remove the given blocks if every one is free (cached ones are evicted first; drained ones count as
        free); else change nothing."""
        ids = list(block_ids)
        ref_cnt = self._ref_cnt
        if any(ref_cnt.get(b, 1) != 0 for b in ids) or len(set(ids)) != len(ids):
            return False
        evicted: list[int] = []
        for block_id in ids:
            if block_id in self._index:
                self._uncache_chain(block_id, evicted)
        for block_id in ids:
            if block_id in self._drained:
                self._drained.remove(block_id)
            else:
                del self._uncached_queue(block_id)[block_id]
            self._draining.discard(block_id)
            del ref_cnt[block_id]
        return True

    def drain(self, block_ids: Iterable[int]) -> None:
        """Mark blocks to leave the pool (module docstring: draining). Free ones leave the free queues now; a cached
        one is evicted first, with its registered descendants (read ``block_hash``/``registered_descendants``
        before, to know what a drain invalidates). Blocks in use leave as their last reference goes."""
        ids = [b for b in block_ids if b not in self._draining]
        missing = [b for b in ids if b not in self._ref_cnt]
        if missing:
            raise ValueError(f"cannot drain blocks the pool does not own: {sorted(missing)[:8]}")
        self._draining.update(ids)
        for block_id in ids:
            if self._ref_cnt[block_id] == 0:
                self._drain_free_block(block_id)

    def undrain(self, block_ids: Iterable[int]) -> None:
        """Cancel a drain: drained blocks rejoin the uncached free queue (their cached content is gone)."""
        for block_id in block_ids:
            if block_id not in self._draining:
                continue
            self._draining.remove(block_id)
            if block_id in self._drained:
                self._drained.remove(block_id)
                self._release_uncached(block_id)
        self.free_version += 1

    def _drain_free_block(self, block_id: int) -> None:
        """A draining block with no reference leaves its free queue (uncached first if it holds a prefix)."""
        if block_id in self._index:
            self._cached_free[block_id] = None  # (already there unless it was just released)
            self._uncache_chain(block_id, [])  # an eviction, descendants included; lands in the uncached queue
        self._uncached_queue(block_id).pop(block_id, None)  # (not there if it was just released uncached)
        self._drained.add(block_id)

    # ---- checks -------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the books disagree with each other."""
        device, host, cached = set(self._uncached_free), set(self._host_free), set(self._cached_free)
        uncached = device | host
        assert not device & host and not uncached & cached, "a block sits in two free queues"
        tier = self.host_tier
        assert all(tier is not None and tier.holds(b) for b in host), "a device block sits in the host queue"
        assert tier is None or not any(tier.holds(b) for b in device), "a host block sits in the device queue"
        drained, index = self._drained, self._index
        assert drained <= self._draining <= set(self._ref_cnt), "drain books name blocks the pool does not own"
        assert not drained & (uncached | cached), "a drained block is still in a free queue"
        for block_id in drained:
            assert block_id not in index, f"drained block {block_id} holds a hash"
        for block_id, count in self._ref_cnt.items():
            assert count >= 0, f"block {block_id} has ref count {count}"
            free = block_id in uncached or block_id in cached or block_id in drained
            assert free == (count == 0), f"block {block_id}: ref count {count} but free={free}"
            if block_id in cached:
                assert block_id in index, f"cached-free block {block_id} has no hash"
            if block_id in uncached:
                assert block_id not in index, f"uncached-free block {block_id} has a hash"
        assert uncached | cached <= set(self._ref_cnt), "free queue holds a block the pool does not own"
        in_use = sum(1 for b, count in self._ref_cnt.items() if count and tier is not None and tier.holds(b))
        assert in_use == self._num_host_in_use, f"host blocks in use: counted {self._num_host_in_use}, held {in_use}"
        index.check_invariants()
