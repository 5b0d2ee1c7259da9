"""Admission under a bound on the host KV that running requests attend each step (a two-tier pool,
``SchedulerConfig.max_host_blocks_held``): the scheduler asks ``HostAdmission.admit`` for each waiting request.

The bound is on the host KV (and host state blocks) that running requests attend each step. Counted: the host
blocks they hold (``KVCacheManager.num_host_blocks_held``, a shared block once per holder), the request's host
prefix hits, and the prompts still to be written — the running requests', then this one's, as they allocate —
beyond the free device blocks. The request is admitted when the total stays within the bound, or when it adds
nothing to it (a request admitted alone can put the total past the bound; others whose KV goes to the device still
join it). Output tokens are not counted: decoding requests can take the total past the bound by them.

Before the request waits, two things give way, in this order:
* cached prefixes in device blocks: the fewest least recently used ones that make it fit (never its own hits) are
  evicted, so that prompts are written to the device instead (under ``evict_device_prefixes`` allocation evicts
  them itself);
* its own host hits, if they alone leave no room and the device can take them (evictions as above): each free one
  moves to a device block (``_promote``: the backend copies it before the step), and from the first that cannot (in
  use by another request, so perhaps not yet written) the prefix is uncached and recomputed. Either way the device
  copy is the cached one from then on. Else a conversation whose context once spilled would hit its host copy every
  turn, and could run only while the bound had room for it.
With nothing running, the request is admitted whatever the bound (else it might never run), after device prefixes
give way for as much of its prompt as they can. These evictions happen before allocation: should it fail for want
of host blocks (a full tier, which the bound does not see), they are not undone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from moetide.core.blocks import HostTier
from moetide.core.kv_manager import KVCacheManager
from moetide.core.request import Request
from moetide.units import cdiv

if TYPE_CHECKING:
    from moetide.core.step_plan import SchedulerOutput


class HostAdmission:
    """The bound's rule over one ``KVCacheManager`` with a two-tier pool (module docstring)."""

    def __init__(self, kv: KVCacheManager) -> None:
        if kv.pool.host_tier is None:
            raise ValueError("a bound on host KV needs a two-tier pool (BlockPool(host_tier=...))")
        self.kv = kv
        self.tier: HostTier = kv.pool.host_tier
        self.num_promoted = 0  # host prefix hits past the bound copied to device blocks
        self.num_dropped = 0  # ... recomputed instead: from a host hit in use on

    def admit(self, request: Request, hits: list[int], running: Sequence[Request], bound: int,
              out: SchedulerOutput) -> list[int] | None:
        """The prefix hits with which ``request`` can be admitted beside ``running`` under ``bound`` host blocks
        held; None: it waits. Evictions are added to ``out.num_evicted_blocks``, copies to ``out.promoted``."""
        kv, holds = self.kv, self.tier.holds
        bs = kv.block_size
        running_pending = sum(max(cdiv(r.num_tokens, bs) - kv.num_held_blocks(r.request_id), 0) for r in running)
        evict = self._evictions(request, hits, running_pending, bound)
        if evict is None:
            cut = next((i for i, b in enumerate(hits) if holds(b)), None)
            if cut is not None:  # as _promote will do: its free host hits take device blocks, and from the
                # first host hit in use on the prefix is recomputed, so only device hits before that are kept
                pool = kv.pool
                end = next((i for i in range(cut, len(hits))
                            if holds(hits[i]) and not pool.is_free(hits[i])), len(hits))
                device_hits = [b for b in hits[:end] if not holds(b)]
                evict = self._evictions(request, device_hits, running_pending, bound, protect=hits)
            if evict is not None:  # promotion takes uncached device blocks: evict now, in either mode
                self._evict_device(evict, hits, out)
                return self._promote(hits, cut, out)  # type: ignore[arg-type]
            if running:
                return None
            evict = self._evictions(request, hits, running_pending, bound, alone=True)  # alone: as it is
        if evict and not kv.evict_device_prefixes:
            self._evict_device(evict, hits, out)
        return hits

    def _evict_device(self, num_blocks: int, protect: list[int], out: SchedulerOutput) -> None:
        out.num_evicted_blocks += len(self.kv.pool.evict_device(num_blocks, protect=protect))

    def _promote(self, hits: list[int], cut: int, out: SchedulerOutput) -> list[int]:
        """Hits from ``cut`` on, moved to the device: each free host hit's registration goes to a free device block
        (``BlockPool.promote``) whose content the backend copies before the step runs (``out.promoted``). Once no
        free device block is left, the remaining hits stay where they are (recomputing them would only write them
        to the host again). A host hit in use by another request may not be written yet, so it cannot be copied:
        from it on the prefix is uncached, with the rest of its chain, and recomputed."""
        pool, holds = self.kv.pool, self.tier.holds
        kept = hits[:cut]
        for i in range(cut, len(hits)):
            block_id = hits[i]
            if not holds(block_id):
                kept.append(block_id)
                continue
            if not pool.is_free(block_id):
                out.num_evicted_blocks += len(pool.uncache(block_id))
                self.num_dropped += len(hits) - i
                break
            target = pool.promote(block_id)
            if target is None:  # no free device block left
                kept.extend(hits[i:])
                break
            kept.append(target)
            out.promoted.append((block_id, target))
            self.num_promoted += 1
        return kept

    def _evictions(self, request: Request, hits: list[int], running_pending: int, bound: int, alone: bool = False,
                   protect: list[int] | None = None) -> int | None:
        """The fewest cached device blocks to evict for ``request``, with these hits, to pass the test: 0 if none,
        None if evicting every one it may is not enough. ``running_pending``: the running requests' prompt blocks
        still to allocate. ``alone``: as many as keep its own prompt off the host. ``protect``: the request's hits,
        when ``hits`` is a part of them (never evicted)."""
        kv, holds = self.kv, self.tier.holds
        pool = kv.pool
        own = cdiv(request.num_tokens, kv.block_size) - len(hits) + kv.num_state_blocks_per_request
        pending = running_pending + own
        device = pool.num_device_uncached(pending)
        free_device_hits = pool.num_free_among(b for b in (hits if protect is None else protect) if not holds(b))
        evictable = max(pool.num_device_cached(max(pending - device, 0) + free_device_hits) - free_device_hits, 0)
        host_hits = len(hits) - sum(1 for b in hits if not holds(b))
        # e evictions: the total stays within the bound when held + host hits + (pending - device - e) <= bound;
        # the request adds nothing when it has no host hit and every pending block fits on the device
        options = [max(pending - device, 0)] if host_hits == 0 or alone else []
        room = bound - kv.num_host_blocks_held - host_hits
        if room >= 0:
            options.append(max(pending - device - room, 0))
        if alone:
            return min(options[0], evictable)
        fits = [e for e in options if e <= evictable]
        return min(fits) if fits else None
