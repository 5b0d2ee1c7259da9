"""Per-request block tables over a ``BlockPool``: vLLM v1's ``KVCacheManager`` (single KV cache group).

The scheduler talks to this, never to the pool directly:

* ``get_computed_blocks(block_hashes, num_tokens)`` finds the longest cached prefix of a new (or resumed)
  request. At most ``num_tokens - 1`` tokens can hit — a fully cached prompt still computes its last token, whose
  logits the first output token needs (vLLM's ``max_cache_hit_length``).
* ``allocate_slots`` takes references on those hits, allocates the blocks the step's new tokens need, and
  registers every block that will be full once the step has run. Registration happens at allocation, as in vLLM:
  a request scheduled later in the *same* step then hits these blocks. This is sound because an engine writes
  every token's KV for a layer before it runs that layer's attention for any of them. It also means a preemption
  victim must never be a request already scheduled in the current step (the scheduler's rule, as in vLLM).
  All or nothing: ``None`` means no reference was taken and no block was allocated.
* ``free`` releases a request's blocks tail first, so the tail of its chain is evicted before its head.

Block hashes are supplied by the caller (``core.hashing``): from token ids in the engine, from a trace's block
keys in the simulator. ``block_hashes[i]`` is the hash of full block i; the list may be shorter than the request's
blocks (the last, partial block has none yet).
"""

from __future__ import annotations

from collections.abc import Sequence

from moetide.core.blocks import BlockPool
from moetide.core.mamba_states import MambaStates
from moetide.units import cdiv


# with a host tier, when no uncached device block is free: keep cached device prefixes and spill new KV, or evict
# the least recently used of them first (``KVCacheManager(evict_device_prefixes=)``); the CLI's --device-prefixes
DEVICE_PREFIXES = ("keep", "evict")


class KVCacheManager:
    """Block tables of running requests, over one pool with one block size."""

    def __init__(self, pool: BlockPool, block_size: int, *, num_state_blocks_per_request: int = 0,
                 evict_device_prefixes: bool = False, mamba: MambaStates | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_state_blocks_per_request < 0:
            raise ValueError(f"num_state_blocks_per_request must be >= 0, got {num_state_blocks_per_request}")
        self.pool = pool
        self.block_size = block_size
        # Hybrid models (linear-attention layers) keep a fixed-size state per running sequence; like vLLM's hybrid
        # allocator, it is carved from the same pool: these blocks are taken with the request's first allocation.
        self.num_state_blocks_per_request = num_state_blocks_per_request
        # Or, with prefix caching on a hybrid model, vLLM's "align" mode: states as cached blocks of their own,
        # moving with the sequence (``core.mamba_states``); hits then end where a state was kept.
        if mamba is not None and (num_state_blocks_per_request or mamba.pool is not pool
                                  or mamba.block_size != block_size):
            raise ValueError("mamba states replace num_state_blocks_per_request and share the pool and block size")
        self.mamba = mamba
        # Two-tier pool (``BlockPool.host_tier``): by default new KV spills to the host once no uncached device
        # block is free, and cached device prefixes stay. With this set, the least recently used cached device
        # prefixes are evicted first (``BlockPool.evict_device``, never the request's own hits), so running
        # contexts stay on the device and only what no longer fits there spills.
        self.evict_device_prefixes = evict_device_prefixes
        # Two-tier pool: how many host blocks each request holds, state blocks included, and their total. A block
        # shared by two requests counts twice: each attends it every step (the scheduler's host bound).
        self._host_tier = pool.host_tier
        self._num_host: dict[str, int] = {}
        self.num_host_blocks_held = 0
        self._blocks: dict[str, list[int]] = {}
        self._state_blocks: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of a request already offered to the cache

    def get_computed_blocks(self, block_hashes: Sequence[int], num_tokens: int) -> tuple[list[int], int]:
        """Cached prefix of a request with ``num_tokens`` known tokens: (block ids, computed tokens). No refs."""
        hits, num_computed, _ = self.find_prefix(block_hashes, num_tokens)
        return hits, num_computed

    def find_prefix(self, block_hashes: Sequence[int], num_tokens: int) -> tuple[list[int], int, int]:
        """``get_computed_blocks`` plus the shared-prefix boundary. With mamba states the attention hit is cut
        back to the last block whose state is kept, and when it was longer its length is the boundary (a junction
        whose state the request should keep, vLLM's ``shared_prefix_boundary``); 0 otherwise."""
        max_hit_blocks = max(num_tokens - 1, 0) // self.block_size
        hits = self.pool.lookup_chain(block_hashes[:max_hit_blocks])
        junction = 0
        if self.mamba is not None and hits:
            kept = self.mamba.hit_blocks(block_hashes, len(hits))
            if kept < len(hits):
                junction = len(hits) * self.block_size
                del hits[kept:]
        return hits, len(hits) * self.block_size, junction

    def protected(self, hits: Sequence[int]) -> frozenset[int]:
        """Blocks an admission must not lose before it takes them: its hits, and with mamba their states."""
        if self.mamba is None or not hits:
            return frozenset(hits)
        return frozenset([*hits, *self.mamba.hit_states(self.pool.block_hash(hits[-1]))])  # type: ignore[arg-type]

    def hits_ready(self, hits: Sequence[int]) -> bool:
        """False when the hits' states were cached in this step: vLLM admits such a request the step after."""
        return self.mamba is None or not hits or self.mamba.ready(self.pool.block_hash(hits[-1]))  # type: ignore

    def new_step(self) -> None:
        """The scheduler's call at the start of every step."""
        if self.mamba is not None:
            self.mamba.new_step()

    def num_blocks_short(
        self, request_id: str, num_new_tokens: int, num_computed_tokens: int, num_new_computed_blocks: int = 0
    ) -> int:
        """How many more uncached free blocks ``allocate_slots`` would need than the pool has now (0 = fits)."""
        need = self._num_blocks_to_allocate(request_id, num_new_tokens, num_computed_tokens, num_new_computed_blocks)
        return max(need - self.pool.num_uncached_free_blocks, 0)

    def _num_blocks_to_allocate(
        self, request_id: str, num_new_tokens: int, num_computed_tokens: int, num_new_computed_blocks: int
    ) -> int:
        num_required = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        held = self._blocks.get(request_id)
        states = 0 if self.mamba is None else self.mamba.num_new_blocks(
            request_id, num_computed_tokens + num_new_tokens, num_new_computed_blocks)
        if held is None:
            return max(num_required - num_new_computed_blocks, 0) + self.num_state_blocks_per_request + states
        return max(num_required - len(held) - num_new_computed_blocks, 0) + states

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        block_hashes: Sequence[int],
        *,
        num_computed_tokens: int = 0,
        new_computed_blocks: Sequence[int] = (),
        num_prompt_tokens: int = 0,
        shared_prefix_boundary: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` after ``num_computed_tokens`` (which include ``new_computed_blocks``,
        the hits from ``get_computed_blocks``). Returns the newly allocated block ids, or None with no effect —
        except that with mamba states those the request no longer needs are released first, as vLLM does
        whether or not the allocation succeeds. ``num_prompt_tokens`` and ``shared_prefix_boundary`` say which
        states to keep (mamba only)."""
        blocks = self._blocks.get(request_id)
        total = num_computed_tokens + num_new_tokens
        mamba = self.mamba
        if mamba is not None:
            mamba.remove_skipped(request_id, num_computed_tokens)
        if (blocks is not None and not new_computed_blocks and total <= len(blocks) * self.block_size
                and (mamba is None or not mamba.num_new_blocks(request_id, total, 0))):
            self._register_full_blocks(request_id, blocks, block_hashes, total)  # decode in held blocks
            if mamba is not None:
                mamba.cache(request_id, block_hashes, total, num_prompt_tokens, shared_prefix_boundary)
            return []
        if new_computed_blocks:  # checked before anything changes
            if self._blocks.get(request_id):
                raise ValueError(f"request {request_id!r} already holds blocks; prefix hits apply to new requests")
            self._check_hits(new_computed_blocks, block_hashes)
        num_new = self._num_blocks_to_allocate(
            request_id, num_new_tokens, num_computed_tokens, len(new_computed_blocks)
        )
        if self.evict_device_prefixes and 0 < num_new <= self.pool.num_uncached_free_blocks:  # it will succeed
            short = num_new - self.pool.num_device_uncached(num_new)
            if short > 0:  # device blocks before host ones: the least recently used device prefixes go first
                self.pool.evict_device(short, protect=new_computed_blocks)
        new_blocks = self.pool.allocate(num_new)
        if new_blocks is None:
            return None
        if self._host_tier is not None:  # state blocks included: they are read every step too
            self._count_host(request_id, new_computed_blocks, new_blocks)
        blocks, new_blocks = self._install(request_id, new_computed_blocks, new_blocks, total)
        self._register_full_blocks(request_id, blocks, block_hashes, total)
        if mamba is not None:
            mamba.cache(request_id, block_hashes, total, num_prompt_tokens, shared_prefix_boundary)
        return new_blocks

    def _install(self, request_id: str, new_computed_blocks: Sequence[int], new_blocks: list[int],
                 total: int) -> tuple[list[int], list[int]]:
        """Hand freshly allocated blocks out: mamba states and per-request state blocks first (as vLLM's
        coordinator allocates the groups), then the hits and the new KV blocks onto the block table. Returns the
        table and the new KV blocks."""
        mamba = self.mamba
        if mamba is not None:
            if request_id not in self._blocks:
                hit_states = mamba.hit_states(self.pool.block_hash(new_computed_blocks[-1])) if new_computed_blocks \
                    else []  # type: ignore[arg-type]
                mamba.take_hits(request_id, hit_states, len(new_computed_blocks))
            num_states = mamba.num_new_blocks(request_id, total, 0)
            mamba.allocate(request_id, total, new_blocks[:num_states])
            new_blocks = new_blocks[num_states:]
        blocks = self._blocks.get(request_id)
        if blocks is None:
            blocks = self._blocks[request_id] = []
            if self.num_state_blocks_per_request:
                self._state_blocks[request_id] = new_blocks[: self.num_state_blocks_per_request]
                new_blocks = new_blocks[self.num_state_blocks_per_request :]
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self._num_registered[request_id] = len(new_computed_blocks)
        blocks.extend(new_blocks)
        return blocks, new_blocks

    def _count_host(self, request_id: str, *block_lists: Sequence[int]) -> None:
        n = sum(self._host_tier.count(blocks) for blocks in block_lists)  # type: ignore[union-attr]
        if n:
            self._num_host[request_id] = self._num_host.get(request_id, 0) + n
            self.num_host_blocks_held += n

    def append_slot(self, request_id: str, num_tokens: int, block_hashes: Sequence[int], *,
                    num_prompt_tokens: int = 0, shared_prefix_boundary: int = 0) -> bool:
        """Decode fast path: True when the request's held blocks already have room for ``num_tokens`` tokens
        (registering a block that this step fills, exactly as ``allocate_slots`` would); False changes nothing
        and the caller takes ``allocate_slots``."""
        blocks = self._blocks.get(request_id)
        if self.mamba is not None:
            self.mamba.remove_skipped(request_id, num_tokens - 1)
        if blocks is None or num_tokens > len(blocks) * self.block_size:
            return False
        if num_tokens // self.block_size > self._num_registered.get(request_id, 0):
            self._register_full_blocks(request_id, blocks, block_hashes, num_tokens)
            if self.mamba is not None:
                self.mamba.cache(request_id, block_hashes, num_tokens, num_prompt_tokens, shared_prefix_boundary)
        return True

    def _check_hits(self, hits: Sequence[int], block_hashes: Sequence[int]) -> None:
        """Hits looked up earlier must still be cached under the same hashes (nothing evicted them since).

        Checking the last hit suffices: evicting any block of a chain unregisters every block after it."""
        last = len(hits) - 1
        if self.pool.block_hash(hits[last]) != block_hashes[last]:
            raise ValueError(f"stale prefix hit: block {hits[last]} no longer holds block {last} of the request")

    def _register_full_blocks(self, request_id: str, blocks: list[int], block_hashes: Sequence[int],
                              num_tokens: int) -> None:
        start = self._num_registered.get(request_id, 0)
        end = min(num_tokens // self.block_size, len(block_hashes), len(blocks))
        if end > start:
            self.pool.cache_chain(blocks, block_hashes, start, end)
            self._num_registered[request_id] = end

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (so a chain's tail is evicted before its head)."""
        blocks = self._blocks.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self.num_host_blocks_held -= self._num_host.pop(request_id, 0)
        if self.mamba is not None:  # vLLM's coordinator frees the linear-attention groups first
            self.mamba.free(request_id)
        if blocks:
            self.pool.free(reversed(blocks))
        state_blocks = self._state_blocks.pop(request_id, None)
        if state_blocks:
            self.pool.free(state_blocks)

    def get_state_blocks(self, request_id: str) -> list[int]:
        """Blocks holding the request's fixed-size (linear-attention) state, each group's newest with mamba
        states; [] for pure-attention models."""
        if self.mamba is not None:
            return self.mamba.current(request_id)
        return self._state_blocks.get(request_id, [])

    def get_blocks(self, request_id: str) -> list[int]:
        """The request's block table (block i holds tokens [i·block_size, (i+1)·block_size))."""
        return self._blocks.get(request_id, [])

    def num_held_blocks(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def num_host_blocks(self, request_id: str) -> int:
        """Host blocks the request holds, its state blocks included (0 without a two-tier pool)."""
        return self._num_host.get(request_id, 0)

    @property
    def request_ids(self) -> list[str]:
        return list(self._blocks)

    def check_invariants(self) -> None:
        """Pool books plus: every held block is referenced at least as often as requests hold it."""
        self.pool.check_invariants()
        holders: dict[int, int] = {}
        for request_id, blocks in self._blocks.items():
            assert len(set(blocks)) == len(blocks), f"request {request_id!r} holds a block twice: {blocks}"
            if self._host_tier is not None:
                num_host = self._host_tier.count([*blocks, *self._state_blocks.get(request_id, ())])
                assert self._num_host.get(request_id, 0) == num_host, f"request {request_id!r}: host count is off"
        assert self.num_host_blocks_held == sum(self._num_host.values()), "host block total is off"
        mamba = [self.mamba.blocks(rid) for rid in self._blocks] if self.mamba is not None else []
        for blocks in [*self._blocks.values(), *self._state_blocks.values(), *mamba]:
            for block_id in blocks:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id, count in holders.items():
            assert self.pool.ref_count(block_id) == count, (
                f"block {block_id} held by {count} requests but ref count {self.pool.ref_count(block_id)}"
            )
