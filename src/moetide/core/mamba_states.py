"""Linear-attention state blocks of a hybrid model with prefix caching: vLLM 0.32's ``MambaManager``, "align" mode.

A hybrid model (Qwen3-Next: Gated DeltaNet layers beside full attention) keeps, per sequence and per group of
linear-attention layers, one fixed-size state instead of a growing KV cache. vLLM puts those states in the same
block pool as KV, one block per group per state (the attention block size is raised until one page holds one
layer's state: ``perf.budget.default_block_size``). With prefix caching it runs ``mamba_cache_mode="align"``:

* **Block tables with holes.** Group g's table of a request has one slot per ``block_size`` tokens; slot p may
  hold the state after exactly (p + 1)·block_size tokens. Only the newest slot and the one before it hold real
  blocks; older slots are nulls. So a running request holds one or two blocks per group, and each allocation adds
  at most one (``get_num_blocks_to_allocate``'s cap).
* **Freeing old states** (``remove_skipped_blocks``, run before every allocation, whether or not it succeeds):
  every real slot before the one holding token ``computed - 1`` is released, and the previous state once the
  request has moved past it.
* **Which states are cached** (``cache_blocks`` with ``reachable_block_mask``): with ``retention_interval`` 0,
  vLLM 0.32's default, only the state at the prompt's replay boundary (the last block boundary before its last
  token) and at a shared-prefix junction (below); with ``None``, every real full slot (dense, as vLLM 0.15.1 and
  0.32 with the interval unset). A cached state is registered in the pool under its block's hash and group
  (vLLM's ``BlockHashWithGroupId``), as a chain of its own; it is evicted in LRU order like any cached block.
* **Hits** (``HybridKVCacheCoordinator.find_longest_cache_hit``): the full-attention hit A is cut back to the
  longest prefix whose state is cached in every group. When A is longer, A is the request's
  ``shared_prefix_boundary`` (a junction): its prefill chunk stops there and the state there is kept, so the
  next request on the same prefix hits it. A state cached in the current step cannot be used until the next
  one (vLLM defers such a request: its allocation reports no room).
* **Chunks** (``Scheduler._mamba_block_aligned_split``): a prefill chunk ends on a block boundary, never runs
  past the replay boundary or a junction, and a chunk starting mid-block stops at the next boundary.

Not modeled (off by default in vLLM 0.32): speculative decoding, partial-block hash hits, internal prefill
checkpoints, shared-prefix checkpoints. ``benchmarks/vllm_fidelity.py`` holds this to vLLM's own managers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moetide.units import cdiv

if TYPE_CHECKING:
    from moetide.core.blocks import BlockPool

_STATE_TAG = 0x4D414D42  # "MAMB": keeps a state's hash apart from its block's KV hash


def state_hash(block_hash: int, group: int) -> int:
    """The pool hash a group's state after a block is cached under (vLLM keys it by hash and group id)."""
    return hash((block_hash, _STATE_TAG, group))


def aligned_chunk(*, start: int, num_new_tokens: int, num_prompt_tokens: int, num_tokens: int, block_size: int,
                  max_prefill_tokens: int, shared_prefix_boundary: int) -> int:
    """vLLM 0.32's ``_mamba_block_aligned_split`` (no speculative decoding, no partial hits): how many of
    ``num_new_tokens`` a prefill chunk starting at ``start`` may take so that it ends where a state can be kept.
    ``max_prefill_tokens``: the step's token budget, or the long-prefill threshold when one is set."""
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end:
        return num_new_tokens
    last_cache_position = max((num_tokens - 1) // block_size * block_size, 0)
    end = start + num_new_tokens
    if end < prefill_end:
        aligned_end = end // block_size * block_size
        if aligned_end > start or block_size <= max_prefill_tokens:
            end = aligned_end
    junction = shared_prefix_boundary
    stops = (
        (start // block_size + 1) * block_size if start % block_size else 0,
        last_cache_position,
        start + (junction - start) // block_size * block_size if start < junction < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


@dataclass
class _Table:
    """One request's slots in one group: ``length`` slots, real blocks only at the indices in ``real``."""

    length: int = 0
    real: dict[int, int] = field(default_factory=dict)
    num_retired: int = 0
    last_state: int | None = None
    num_cached: int = 0


class MambaStates:
    """State block tables of every running request, for ``num_groups`` linear-attention groups (module docstring).

    Owned by ``KVCacheManager``, which calls it around its own KV bookkeeping in vLLM's order: free old states,
    count, allocate (the groups' blocks before the attention blocks), cache."""

    def __init__(self, pool: BlockPool, block_size: int, num_groups: int, *,
                 retention_interval: int | None = 0) -> None:
        if num_groups <= 0:
            raise ValueError(f"num_groups must be positive, got {num_groups}")
        if retention_interval not in (None, 0):
            raise ValueError(f"retention_interval must be None (dense) or 0 (replay boundaries and junctions), got "
                             f"{retention_interval}")
        self.pool = pool
        self.block_size = block_size
        self.num_groups = num_groups
        self.retention_interval = retention_interval
        self._tables: dict[str, list[_Table]] = {}
        # request -> the fewest computed tokens at which ``remove_skipped`` could release anything (``_due_at``);
        # below it the call is a no-op, which is most decode steps. Dropped whenever a table changes.
        self._due: dict[str, int] = {}
        self._allocated: set[str] = set()
        self._cached_this_step: set[int] = set()
        # request -> (source, destination) state blocks, group by group, of the slots allocated this step: the
        # state a step starts from is the previous slot's (or a prefix hit's); a driver that holds real states
        # copies it into the new slot before the step (``state_copies``)
        self._copies: dict[str, list[tuple[int, int]]] = {}
        # attention block hashes after which some group's state was registered: a superset of those with a state
        # still cached (the pool evicts states on its own), pruned when a lookup finds none left
        self._state_after: set[int] = set()

    # ---- lookups --------------------------------------------------------------------------------------------
    def hit_blocks(self, block_hashes: Sequence[int], num_attention_hits: int) -> int:
        """Of a full-attention hit of ``num_attention_hits`` blocks, the longest prefix whose state is cached in
        every group (vLLM's right-to-left search)."""
        lookup, candidates = self.pool.lookup, self._state_after
        for i in range(num_attention_hits - 1, -1, -1):
            block_hash = block_hashes[i]
            if block_hash not in candidates:
                continue
            found = [lookup(state_hash(block_hash, g)) is not None for g in range(self.num_groups)]
            if all(found):
                return i + 1
            if not any(found):
                candidates.discard(block_hash)
        return 0

    def hit_states(self, block_hash: int) -> list[int]:
        """The state blocks, one per group, that a hit ending on the block with ``block_hash`` takes."""
        return [self.pool.lookup(state_hash(block_hash, g)) for g in range(self.num_groups)]  # type: ignore[misc]

    def ready(self, block_hash: int) -> bool:
        """False when a hit ending on this block would read a state cached in this step (not computed yet)."""
        return not any(state_hash(block_hash, g) in self._cached_this_step for g in range(self.num_groups))

    def new_step(self) -> None:
        self._cached_this_step.clear()
        self._copies.clear()

    def state_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block pairs of this step's new slots: each group's state the step starts from,
        to be copied into the slot it writes before the step runs. Empty for a request with no earlier state."""
        return [pair for pairs in self._copies.values() for pair in pairs]

    # ---- the allocation, in vLLM's order ------------------------------------------------------------------
    def remove_skipped(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the states the request no longer needs (``remove_skipped_blocks``), group by group: the slots
        before the one holding token ``num_computed_tokens - 1`` (tail first), then the previous state."""
        if num_computed_tokens < self._due.get(request_id, 0):
            return
        tables = self._tables.get(request_id, ())
        for t in tables:
            older, previous, t.num_retired = self._stale(t, num_computed_tokens)
            if older:
                self.pool.free([t.real.pop(i) for i in older])
            if previous is not None:
                self.pool.free([t.real.pop(previous)])
        if tables:
            self._due[request_id] = min(self._due_at(t) for t in tables)

    def _due_at(self, t: _Table) -> int:
        """The fewest computed tokens at which ``_stale`` finds anything in this table as it stands: an older slot
        needs ``(n - 1) // block_size`` past ``num_retired``, the previous state ``cdiv(n, block_size) - 1`` past
        its slot."""
        bs = self.block_size
        due = (t.num_retired + 1) * bs + 1
        if t.last_state is not None and t.last_state in t.real:
            due = min(due, (t.last_state + 1) * bs + 1)
        return due

    def num_stale(self, request_id: str, num_computed_tokens: int) -> int:
        """How many blocks ``remove_skipped`` with these tokens would release (0: nothing is due)."""
        if num_computed_tokens < self._due.get(request_id, 0):
            return 0
        n = 0
        for t in self._tables.get(request_id, ()):
            older, previous, _ = self._stale(t, num_computed_tokens)
            n += len(older) + (previous is not None)
        return n

    def _stale(self, t: _Table, num_computed_tokens: int) -> tuple[list[int], int | None, int]:
        """What ``remove_skipped`` releases of one table: (older real slots, tail first; the previous state's
        slot or None; the table's retired count after)."""
        bs = self.block_size
        last = min(max(num_computed_tokens - 1, 0) // bs, t.length)
        older, retired = [], t.num_retired
        if retired < last:
            older = [i for i in range(last - 1, retired - 1, -1) if i in t.real]
            retired = last
        previous = t.last_state
        if previous is None or previous in older or previous not in t.real \
                or previous >= cdiv(num_computed_tokens, bs) - 1:
            previous = None
        return older, previous, retired

    def num_new_blocks(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        """Blocks the groups take to hold ``num_tokens`` tokens (at most one each); ``num_hit_blocks``: the
        prefix hit of a request with no table yet."""
        tables = self._tables.get(request_id)
        num_required = cdiv(num_tokens, self.block_size)
        if tables is None:
            return self.num_groups * min(max(num_required - num_hit_blocks, 0), 1)
        return sum(min(max(num_required - t.length, 0), 1) for t in tables)

    def take_hits(self, request_id: str, hit_states: Sequence[int], num_hit_blocks: int) -> None:
        """A new request's table: nulls, then its hit's state in slot ``num_hit_blocks - 1`` (referenced)."""
        tables = self._tables[request_id] = [_Table() for _ in range(self.num_groups)]
        self._due.pop(request_id, None)
        if num_hit_blocks:
            self.pool.touch(hit_states)
            for t, block_id in zip(tables, hit_states):
                t.length = t.num_cached = num_hit_blocks
                t.real[num_hit_blocks - 1] = block_id

    def allocate(self, request_id: str, num_tokens: int, new_blocks: Sequence[int]) -> None:
        """Grow each group's table to ``num_tokens`` tokens with the blocks ``num_new_blocks`` counted, in group
        order (``MambaManager.allocate_new_blocks``)."""
        tables = self._tables.setdefault(request_id, [_Table() for _ in range(self.num_groups)])
        self._due.pop(request_id, None)
        num_required = cdiv(num_tokens, self.block_size)
        was_allocated = request_id in self._allocated
        it = iter(new_blocks)
        for t in tables:
            if num_required <= t.length:
                continue
            if was_allocated or t.length > 0:
                t.last_state = t.length - 1
            t.length = max(t.length, num_required - 1)
            if num_required > t.length:
                t.real[t.length] = new = next(it)
                t.length += 1
                source = t.real.get(t.last_state) if t.last_state is not None else None
                if source is not None:
                    self._copies.setdefault(request_id, []).append((source, new))
        self._allocated.add(request_id)

    def cache(self, request_id: str, block_hashes: Sequence[int], num_tokens: int, num_prompt_tokens: int,
              shared_prefix_boundary: int) -> None:
        """Register the states of the full slots below ``num_tokens`` that are kept (module docstring)."""
        tables = self._tables.get(request_id)
        if tables is None:
            return
        bs = self.block_size
        num_full = min(num_tokens // bs, len(block_hashes))
        keep = None
        if self.retention_interval == 0:
            keep = {(num_prompt_tokens - 1) // bs - 1}
            if shared_prefix_boundary:
                keep.add(shared_prefix_boundary // bs - 1)
        # the prompt's last boundary reached now (its chunk ends there, or a hit ends there): its state is this
        # step's to write, so it is (re)registered and marked as such (``_cache_partial_tail_block``)
        boundary = (num_prompt_tokens - 1) // bs
        tail = boundary - 1 if boundary > 0 and num_tokens // bs == boundary else None
        for g, t in enumerate(tables):
            for i in range(t.num_cached, num_full):
                block_id = t.real.get(i)
                if block_id is None or (keep is not None and i not in keep):
                    continue
                key = state_hash(block_hashes[i], g)
                if self.pool.cache_block(block_id, key, None):
                    self._cached_this_step.add(key)
                    self._state_after.add(block_hashes[i])
            t.num_cached = max(t.num_cached, num_full)
            if tail is not None and tail in t.real and tail < len(block_hashes):
                key = state_hash(block_hashes[tail], g)
                if self.pool.block_hash(t.real[tail]) != key:
                    self.pool.cache_block(t.real[tail], key, None)
                self._cached_this_step.add(key)
                self._state_after.add(block_hashes[tail])

    def free(self, request_id: str) -> None:
        """Release a finished or preempted request's states, group by group, each table tail first."""
        self._allocated.discard(request_id)
        self._due.pop(request_id, None)
        self._copies.pop(request_id, None)
        for t in self._tables.pop(request_id, ()):
            if t.real:
                self.pool.free([t.real[i] for i in sorted(t.real, reverse=True)])

    # ---- reading ----------------------------------------------------------------------------------------------
    def blocks(self, request_id: str) -> list[int]:
        """Every real state block the request holds (group order, then slot order)."""
        return [b for t in self._tables.get(request_id, ()) for _, b in sorted(t.real.items())]

    def current(self, request_id: str) -> list[int]:
        """Each group's newest state block (what the next step reads and writes)."""
        return [t.real[max(t.real)] for t in self._tables.get(request_id, ()) if t.real]
