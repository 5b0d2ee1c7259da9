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
* **Invalidation down the chain.** A chain's hashes cover their parents, so once block i is gone, blocks i+1…
  can never be hit again. vLLM leaves them cached until they drift to the head of the queue; here evicting a
  block unregisters every registered descendant at once (iteratively — agent chains run to tens of thousands of
  blocks). Invariant: every registered block's parent hash is registered (or is the chain root).
* **Duplicates, as vLLM keeps them.** Two requests that share a prefix and chunk-prefill at once each compute the
  blocks past their common hit, so one hash can be registered by several blocks (vLLM does not de-duplicate, so
  that block tables stay append-only). A lookup returns the first holder still registered (vLLM's
  ``BlockHashToBlockMap.get_one_block``); a freed duplicate is a cached block like any other, queued by LRU; the
  hash, and so every block chained after it, stays registered until its last holder is evicted.
* **Never-cached blocks are reused last in, first out.** A freed block without a hash goes to the head of the
  uncached queue (vLLM's ``free_blocks`` prepends them, for locality), a cached one to the tail of its LRU queue.
* **Growth and shrink by given ids.** The arena (``core.arena``) decides which block ids exist; the pool adds and
  removes exactly those. Removal is atomic: all free, or nothing changes.
* **Draining.** ``drain(ids)`` marks blocks that are about to leave (an expert region going back to its experts):
  free ones leave the free queues at once (a cached one is evicted first, with its descendants), and each one in
  use leaves when its last reference goes, instead of rejoining a queue. A drained block is owned, free and never
  allocated; ``remove_blocks`` takes it, ``undrain`` puts it back. So a region in a busy pool empties as its
  requests finish, rather than waiting for a moment when every one of its blocks happens to be free.
* **Two tiers, optionally.** With ``preferred_below`` set, every uncached free block with an id below it is
  allocated before any other: such a block enters the *head* of the uncached queue instead of its tail. The engine
  numbers its device blocks below its host blocks, so device KV is used first and host KV only once no uncached
  device block is free (WriteScope's device-first placement, ``core.splits``). A free device block holding a cached
  prefix is not evicted for it: as everywhere here, eviction is the policy's call, never allocation's, so new KV
  spills to the host while old prefixes stay hittable in HBM. Unset, nothing changes.

Atomicity: ``allocate`` either returns all the blocks asked for or returns ``None`` and changes nothing — there is
no separate "can I?" call whose answer could be stale by the time of "do it".
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from collections.abc import Collection, Iterable, Sequence


class BlockPool:
    """Reference-counted KV blocks with an LRU prefix cache and separate uncached/cached free queues."""

    def __init__(self, block_ids: Iterable[int], *, enable_caching: bool = True,
                 preferred_below: int | None = None) -> None:
        self.enable_caching = enable_caching
        self.preferred_below = preferred_below  # ids below it are allocated first (module docstring: two tiers)
        self._ref_cnt: dict[int, int] = {}
        self._uncached_free: OrderedDict[int, None] = OrderedDict()
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, int] = {}  # registered block id -> its hash
        self._parent_of: dict[int, int | None] = {}  # registered block id -> parent's hash (None: chain head)
        self._block_of: dict[int, int] = {}  # hash -> its first registered holder (what lookups return)
        self._dups: dict[int, list[int]] = {}  # hash -> its later holders, in registration order (rare)
        self._children: dict[int, set[int]] = {}  # hash -> registered block ids whose parent it is
        self._draining: set[int] = set()  # blocks marked to leave (drain); those with no reference are drained
        self._drained: set[int] = set()  # draining blocks with no reference: out of both free queues
        self.num_evicted_blocks = 0  # lifetime counter, for metrics
        # Bumped whenever blocks become free or are added: a caller that failed to allocate can skip retrying
        # until it changes (the scheduler's blocked queue head).
        self.free_version = 0
        self._no_preferred_cached_at = -1  # free_version at which evict_preferred found no candidate
        self.add_blocks(block_ids)

    # ---- counts -------------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._ref_cnt)

    @property
    def num_free_blocks(self) -> int:
        return len(self._uncached_free) + len(self._cached_free)

    @property
    def num_uncached_free_blocks(self) -> int:
        return len(self._uncached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return len(self._ref_cnt) - len(self._uncached_free) - len(self._cached_free) - len(self._drained)

    @property
    def num_drained_blocks(self) -> int:
        """Blocks marked by ``drain`` that have no reference left: owned, never allocated, waiting for removal."""
        return len(self._drained)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, in use or free (duplicates included)."""
        return len(self._hash_of)

    def block_ids(self) -> list[int]:
        return sorted(self._ref_cnt)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def is_free(self, block_id: int) -> bool:
        """No reference (a drained block is free too, though never allocated)."""
        return self._ref_cnt[block_id] == 0

    def is_draining(self, block_id: int) -> bool:
        return block_id in self._draining

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of the given blocks are free (e.g. a request's protected prefix hits)."""
        ref_cnt = self._ref_cnt
        return sum(1 for b in block_ids if ref_cnt[b] == 0)

    def block_hash(self, block_id: int) -> int | None:
        return self._hash_of.get(block_id)

    def cached_free_block_ids(self) -> list[int]:
        """Cached-but-free blocks in eviction order (next victim first)."""
        return list(self._cached_free)

    def uncached_free_block_ids(self) -> list[int]:
        """Uncached free blocks in allocation order."""
        return list(self._uncached_free)

    # ---- allocation and references ------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` uncached free blocks (ref count 1 each), or return None and change nothing."""
        if num_blocks > len(self._uncached_free):
            return None
        pop = self._uncached_free.popitem
        ref_cnt = self._ref_cnt
        out = []
        for _ in range(num_blocks):
            block_id = pop(last=False)[0]
            ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on each block (cache hits); a free block leaves its free queue."""
        ref_cnt, hash_of = self._ref_cnt, self._hash_of
        cached_free, uncached_free = self._cached_free, self._uncached_free
        for block_id in block_ids:
            count = ref_cnt[block_id]
            if count == 0:
                if block_id in hash_of:
                    del cached_free[block_id]
                else:
                    del uncached_free[block_id]
            ref_cnt[block_id] = count + 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in the order given. At zero a cached block joins the tail of the LRU
        queue; the uncached ones of this call go, in the order given, to the head of the uncached queue (a host
        block of a two-tier pool to its tail, behind every device block)."""
        ref_cnt, prefer = self._ref_cnt, self.preferred_below
        hash_of, cached_free, uncached_free = self._hash_of, self._cached_free, self._uncached_free
        draining = self._draining
        self.free_version += 1
        first: list[int] = []
        for block_id in block_ids:
            count = ref_cnt[block_id] - 1
            if count < 0:
                raise ValueError(f"block {block_id} freed more times than it was taken")
            ref_cnt[block_id] = count
            if count == 0:
                if draining and block_id in draining:
                    self._drain_free_block(block_id)
                elif block_id in hash_of:
                    cached_free[block_id] = None
                else:
                    uncached_free[block_id] = None
                    if prefer is None or block_id < prefer:
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
        """Register blocks ``start..end-1`` of one chain (block i under hash i, parent hash i-1, none for i = 0),
        each as ``cache_block`` describes; returns how many were registered. The scheduler's hot path."""
        if not self.enable_caching:
            return 0
        registered = 0
        block_of, hash_of, parent_of, ref_cnt = self._block_of, self._hash_of, self._parent_of, self._ref_cnt
        children = self._children
        parent_hash = block_hashes[start - 1] if start else None
        for i in range(start, end):
            block_hash = block_hashes[i]
            block_id = block_ids[i]
            if parent_hash is not None and parent_hash not in block_of:
                parent_hash = block_hash
                continue
            if block_id in hash_of:
                if hash_of[block_id] == block_hash:  # (a hit registered again: already there)
                    parent_hash = block_hash
                    continue
                raise ValueError(f"block {block_id} is already cached under another hash")
            hash_of[block_id] = block_hash
            parent_of[block_id] = parent_hash
            if block_hash in block_of:
                self._dups.setdefault(block_hash, []).append(block_id)
            else:
                block_of[block_hash] = block_id
            if parent_hash is not None:
                kids = children.get(parent_hash)
                if kids is None:
                    children[parent_hash] = {block_id}
                else:
                    kids.add(block_id)
            if ref_cnt[block_id] == 0:
                del self._uncached_free[block_id]
                self._cached_free[block_id] = None
                self._no_preferred_cached_at = -1  # a cached-free block appeared without a free()
            registered += 1
            parent_hash = block_hash
        return registered

    def registered_descendants(self, block_id: int, limit: int | None = None,
                               skip: Collection[int] = ()) -> list[int]:
        """Registered blocks whose chains pass through this one: what evicting it invalidates besides itself
        (nothing while another block holds its hash). Stops after ``limit`` blocks when given; does not enter
        blocks in ``skip`` (already accounted for)."""
        block_hash = self._hash_of.get(block_id)
        if block_hash is None or block_hash in self._dups:
            return []
        stack = list(self._children.get(block_hash, ()))
        out = []
        while stack and (limit is None or len(out) < limit):
            child = stack.pop()
            if child in skip:
                continue
            out.append(child)
            stack.extend(self._children.get(self._hash_of[child], ()))
        return out

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
        return self._block_of.get(block_hash)

    def lookup_chain(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes`` (a chain; no references taken).

        Binary search: every registered block's parent hash is registered, so along one chain the registered
        hashes form a prefix. O(log n) lookups for agent contexts of tens of thousands of blocks.
        """
        block_of = self._block_of
        lo, hi = 0, len(block_hashes)  # invariant: hashes[:lo] all registered, hashes[hi:] none
        while lo < hi:
            mid = (lo + hi) // 2
            if block_hashes[mid] in block_of:
                lo = mid + 1
            else:
                hi = mid
        return [block_of[h] for h in block_hashes[:lo]]

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

    def num_preferred_uncached(self, limit: int) -> int:
        """Uncached free blocks below ``preferred_below``, counted up to ``limit`` (they head the queue)."""
        bound, n = self.preferred_below, 0
        if bound is None:
            return 0
        for block_id in self._uncached_free:
            if n >= limit or block_id >= bound:
                break
            n += 1
        return n

    def num_preferred_cached(self, limit: int, scan: int = 4096) -> int:
        """Cached-free blocks below ``preferred_below`` among the ``scan`` oldest cached-free blocks, counted up to
        ``limit``: what ``evict_preferred`` with the same ``scan`` could uncache (before protection)."""
        bound, n = self.preferred_below, 0
        if bound is None or limit <= 0 or self._no_preferred_cached_at == self.free_version:
            return 0
        for block_id in islice(self._cached_free, scan):
            if block_id < bound:
                n += 1
                if n >= limit:
                    break
        return n

    def evict_preferred(self, num_blocks: int, protect: Collection[int] = (), scan: int = 4096) -> list[int]:
        """Uncache cached-free blocks below ``preferred_below`` (device blocks in a two-tier pool), least recently
        used first, each with its registered descendants, until ``num_blocks`` of them are uncached or the ``scan``
        oldest cached-free blocks are exhausted (a bound on the work: the queue mixes both tiers). ``protect`` as in
        ``evict``. Returns every block that became uncached-free, of either tier."""
        bound, cached_free, evicted = self.preferred_below, self._cached_free, []
        if bound is None or num_blocks <= 0 or self._no_preferred_cached_at == self.free_version:
            return evicted
        candidates = [b for b in islice(cached_free, scan) if b < bound]
        if not candidates:  # none can appear before a block is freed again (free_version): skip the scans till then
            self._no_preferred_cached_at = self.free_version
        protected = protect if isinstance(protect, (set, frozenset)) else set(protect)
        victims = [b for b in candidates if b not in protected]
        got = 0
        for block_id in victims:
            if got >= num_blocks:
                break
            if block_id in cached_free:  # not uncached already by an earlier victim's cascade
                start = len(evicted)
                self._uncache_chain(block_id, evicted)
                got += sum(1 for b in evicted[start:] if b < bound)
        return evicted

    def promote(self, block_id: int) -> int | None:
        """Move a free cached block's registration — its hash and its place in its chain — to the first uncached
        free block below ``preferred_below`` (a device block, in a two-tier pool), and return that block; the old
        one becomes uncached. The caller copies the content (the engine at the start of the step, the replay by
        charging the copy). Its registered descendants stay: their parent hash is unchanged. None, changing
        nothing, when the block is in use (a block registered this step may not be computed yet), not cached, or
        no such free block is left."""
        bound = self.preferred_below
        if bound is None or self._ref_cnt.get(block_id) != 0 or block_id not in self._hash_of:
            return None
        target = next(iter(self._uncached_free), None)
        if target is None or target >= bound:
            return None
        block_hash, parent_hash = self._hash_of.pop(block_id), self._parent_of.pop(block_id)
        self._hash_of[target], self._parent_of[target] = block_hash, parent_hash
        if self._block_of[block_hash] == block_id:
            self._block_of[block_hash] = target
        else:
            dups = self._dups[block_hash]
            dups[dups.index(block_id)] = target
        if parent_hash is not None:
            siblings = self._children[parent_hash]
            siblings.discard(block_id)
            siblings.add(target)
        del self._cached_free[block_id], self._uncached_free[target]
        self._cached_free[target] = None
        self._uncached_free[block_id] = None
        if block_id < bound:
            self._uncached_free.move_to_end(block_id, last=False)
        self._no_preferred_cached_at = -1  # a cached-free device block appeared
        return target

    def uncache(self, block_id: int) -> list[int]:
        """Unregister one block and every registered descendant, in use or free (a block in use stays with its
        holders, now private). Returns the free ones, which join the uncached queue. A block not registered: []."""
        evicted: list[int] = []
        if block_id in self._hash_of:
            self._uncache_chain(block_id, evicted)
        return evicted

    def _evict_from_head(self, num_blocks: int, evicted: list[int]) -> None:
        """Unprotected eviction from the LRU head: leaves (the common case) inline, others through the cascade."""
        cached_free, children, hash_of, block_of = self._cached_free, self._children, self._hash_of, self._block_of
        dups = self._dups
        uncached_free, pop_head = self._uncached_free, cached_free.popitem
        parent_pop, append = self._parent_of.pop, evicted.append
        prefer = self.preferred_below
        num_leaves = 0
        while len(evicted) < num_blocks and cached_free:
            block_id = pop_head(False)[0]
            block_hash = hash_of[block_id]
            if block_hash in children or block_hash in dups:  # back to the head, then the general path
                cached_free[block_id] = None
                cached_free.move_to_end(block_id, last=False)
                self._uncache_chain(block_id, evicted)
                continue
            del hash_of[block_id], block_of[block_hash]
            parent_hash = parent_pop(block_id)
            if parent_hash is not None:
                siblings = children[parent_hash]
                if len(siblings) == 1:
                    del children[parent_hash]
                else:
                    siblings.discard(block_id)
            uncached_free[block_id] = None
            if prefer is not None and block_id < prefer:
                uncached_free.move_to_end(block_id, last=False)
            append(block_id)
            num_leaves += 1
        self.num_evicted_blocks += num_leaves

    def _uncache_chain(self, block_id: int, evicted: list[int]) -> None:
        stack = [block_id]
        while stack:
            block_id = stack.pop()
            block_hash = self._hash_of.pop(block_id)
            parent_hash = self._parent_of.pop(block_id)
            siblings = self._children.get(parent_hash) if parent_hash is not None else None
            if siblings is not None:  # None when the parent was uncached in this same cascade
                siblings.discard(block_id)
                if not siblings:
                    del self._children[parent_hash]
            if not self._drop_holder(block_hash, block_id):  # its last holder: the chain after it is lost
                stack.extend(self._children.pop(block_hash, ()))
            if self._ref_cnt[block_id] == 0:
                del self._cached_free[block_id]
                self._uncached_free[block_id] = None
                if self.preferred_below is not None and block_id < self.preferred_below:
                    self._uncached_free.move_to_end(block_id, last=False)
                evicted.append(block_id)
                self.num_evicted_blocks += 1

    def _drop_holder(self, block_hash: int, block_id: int) -> bool:
        """Take ``block_id`` off the holders of ``block_hash``; True while another block still holds it."""
        dups = self._dups.get(block_hash)
        if dups is None:
            del self._block_of[block_hash]
            return False
        if self._block_of[block_hash] == block_id:
            self._block_of[block_hash] = dups.pop(0)
        else:
            dups.remove(block_id)
        if not dups:
            del self._dups[block_hash]
        return True

    # ---- growth and shrink --------------------------------------------------------------------------------
    def add_blocks(self, block_ids: Iterable[int]) -> None:
        """New block ids join the tail of the uncached free queue (preferred ids: its head, in the order given)."""
        new_ids = list(block_ids)
        clash = [b for b in new_ids if b in self._ref_cnt]
        if clash or len(set(new_ids)) != len(new_ids):
            raise ValueError(f"block ids already in the pool or repeated: {sorted(set(clash))[:8]}")
        for block_id in new_ids:
            self._ref_cnt[block_id] = 0
            self._uncached_free[block_id] = None
        prefer = self.preferred_below
        if prefer is not None:
            for block_id in reversed(new_ids):
                if block_id < prefer:
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
            if block_id in self._hash_of:
                self._uncache_chain(block_id, evicted)
        for block_id in ids:
            if block_id in self._drained:
                self._drained.remove(block_id)
            else:
                del self._uncached_free[block_id]
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
        prefer = self.preferred_below
        for block_id in block_ids:
            if block_id not in self._draining:
                continue
            self._draining.remove(block_id)
            if block_id in self._drained:
                self._drained.remove(block_id)
                self._uncached_free[block_id] = None
                if prefer is not None and block_id < prefer:
                    self._uncached_free.move_to_end(block_id, last=False)
        self.free_version += 1

    def _drain_free_block(self, block_id: int) -> None:
        """A draining block with no reference leaves its free queue (uncached first if it holds a prefix)."""
        if block_id in self._hash_of:
            self._cached_free[block_id] = None  # (already there unless it was just released)
            self._uncache_chain(block_id, [])  # an eviction, descendants included; lands in the uncached queue
        self._uncached_free.pop(block_id, None)  # (not there if it was just released uncached)
        self._drained.add(block_id)

    # ---- checks -------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if the books disagree with each other."""
        uncached, cached = set(self._uncached_free), set(self._cached_free)
        assert not uncached & cached, f"blocks in both free queues: {sorted(uncached & cached)[:8]}"
        drained = self._drained
        assert drained <= self._draining <= set(self._ref_cnt), "drain books name blocks the pool does not own"
        assert not drained & (uncached | cached), "a drained block is still in a free queue"
        for block_id in drained:
            assert block_id not in self._hash_of, f"drained block {block_id} holds a hash"
        for block_id, count in self._ref_cnt.items():
            assert count >= 0, f"block {block_id} has ref count {count}"
            free = block_id in uncached or block_id in cached or block_id in drained
            assert free == (count == 0), f"block {block_id}: ref count {count} but free={free}"
            if block_id in cached:
                assert block_id in self._hash_of, f"cached-free block {block_id} has no hash"
            if block_id in uncached:
                assert block_id not in self._hash_of, f"uncached-free block {block_id} has a hash"
        assert uncached | cached <= set(self._ref_cnt), "free queue holds a block the pool does not own"
        if self.preferred_below is not None:
            tiers = [b >= self.preferred_below for b in self._uncached_free]
            assert tiers == sorted(tiers), "a preferred uncached free block sits behind a non-preferred one"
        num_dups = sum(len(d) for d in self._dups.values())
        assert len(self._block_of) + num_dups == len(self._hash_of) == len(self._parent_of), "hash maps differ"
        for block_hash, dups in self._dups.items():
            assert dups and self._block_of[block_hash] not in dups, f"duplicate holders of {block_hash} are off"
        for block_id, block_hash in self._hash_of.items():
            assert (self._block_of[block_hash] == block_id or block_id in self._dups.get(block_hash, ())), (
                f"hash of block {block_id} maps elsewhere")
            parent_hash = self._parent_of[block_id]
            if parent_hash is not None:
                assert parent_hash in self._block_of, f"block {block_id}'s parent hash is not registered"
                assert block_id in self._children[parent_hash], f"block {block_id} missing from its parent's children"
        for parent_hash, children in self._children.items():
            assert children, f"empty child set under {parent_hash}"
            for child in children:
                assert self._parent_of[child] == parent_hash, f"child {child} has another parent"
