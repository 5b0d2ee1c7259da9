"""vLLM 0.32's scheduler with moetide's policy deciding what vLLM would decide alone: ``--scheduler-cls``.

vLLM's ``Scheduler`` is unchanged but for one seam: its KV cache manager's ``allocate_slots``. Before vLLM would
evict a cached prefix to meet an allocation (its pool evicts whatever cached block reaches the head of the free
queue) or fail it (and preempt), the allocation's shortfall in never-cached free blocks goes to moetide's policy,
exactly where moetide's own scheduler asks it (``core.scheduler``: the full-sequence admission gate, then the
chunk). Its plan is carried out on vLLM's pool: ``EvictPrefix`` uncaches the blocks vLLM would have taken, in
place; ``OffloadExperts`` grows the pool by the region's blocks (``vllm.pool``) and queues the move for the
workers; ``Preempt`` returns no blocks, and vLLM's own loop preempts (the policies name vLLM's own victim, the
newest running request; another name is refused). Before each step the policy may give a drained region back.

Under ``policy: vllm`` every plan is what vLLM does by itself, on the same blocks in the same order: the
differential tests hold this to stock vLLM step for step, block ids included, and hold ``vamp`` to moetide's
replay core.

``--scheduler-cls moetide.vllm.scheduler.MoetideScheduler`` follows vLLM's own choice: vLLM's ``Scheduler`` where
vLLM schedules synchronously (the CPU), ``AsyncScheduler`` (``MoetideAsyncScheduler``) where it schedules
asynchronously (the GPU default).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHashListWithBlockSize
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import RequestStatus

from moetide.core.pressure import EvictPrefix, OffloadExperts, Preempt, PressureView
from moetide.vllm.line import LineBooks, kv_block_bytes, line_reserve_blocks, model_experts, plugin_costs
from moetide.vllm.pool import VllmPool

# vLLM 0.32's allocate_slots parameters, which the seam repeats by name (checked at import: a vLLM that changed
# them is refused rather than called with what it no longer means)
_ALLOCATE_PARAMETERS = ("self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
                        "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks",
                        "num_encoder_tokens", "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs",
                        "skip_zeroing_group_ids")
if tuple(inspect.signature(KVCacheManager.allocate_slots).parameters) != _ALLOCATE_PARAMETERS:
    raise ImportError("moetide's scheduler seam was written against vLLM 0.32's KVCacheManager.allocate_slots, "
                      "whose parameters this vLLM has changed")


class RequestView:
    """What a policy reads of a vLLM request, in moetide's names (``core.request.Request``): hashes at the
    scheduler's block size, and the computed tokens a lookup found."""

    __slots__ = ("request", "num_computed_tokens", "block_hashes")

    def __init__(self, request, block_hashes: Sequence[bytes], num_computed_tokens: int | None = None) -> None:
        self.request, self.block_hashes = request, block_hashes
        self.num_computed_tokens = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_preemptions(self) -> int:
        return self.request.num_preemptions

    @property
    def num_cached_prompt_tokens(self) -> int | None:
        """None until the request's first admission: in vLLM only a preemption sends a request back to wait."""
        return None if self.request.num_preemptions == 0 else 0


class _MoetideScheduling:
    """The seam (module docstring), mixed into vLLM's schedulers."""

    def _init_moetide(self) -> None:
        from moetide.vllm.connector import MoetideConnector
        from moetide.vllm.plugin import check_supported
        from moetide.vllm.versions import check_prefix_hit

        check_supported()
        check_prefix_hit(Scheduler._get_local_prefix_cache_hit)
        if self.vllm_config.diffusion_config is not None:  # vLLM would pick its DiffusionScheduler, not this
            raise ValueError("moetide's scheduler does not schedule diffusion models: leave out --scheduler-cls "
                             "and --kv-transfer-config")
        if schedules_asynchronously(self.vllm_config) and not isinstance(self, AsyncScheduler):
            raise ValueError(f"vLLM schedules asynchronously here, and {type(self).__qualname__} subclasses the "
                             f"synchronous MoetideScheduler: subclass MoetideAsyncScheduler, or pass "
                             f"--no-async-scheduling")
        if not isinstance(self.connector, MoetideConnector):
            raise ValueError("moetide's scheduler needs moetide's connector: pass --kv-transfer-config with "
                             "kv_connector MoetideConnector (moetide.vllm.settings.PluginSettings.kv_transfer_config)")
        settings = self.connector.settings
        shape, active = model_experts(settings, self.vllm_config)
        kv_config = self.kv_cache_config
        block_bytes = kv_block_bytes(kv_config)
        reserve = line_reserve_blocks(settings, shape, block_bytes)
        kvm = self.kv_cache_manager
        groups = kv_config.kv_cache_groups
        self._hash_group = next((i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)), 0)
        # full-attention-only caches: each group's block size, for ``_surely_fits``
        self._full_block_sizes = [g.kv_cache_spec.block_size for g in groups] \
            if all(isinstance(g.kv_cache_spec, FullAttentionSpec) for g in groups) else None
        pool = VllmPool(kvm.block_pool, num_base_blocks=kv_config.num_blocks - reserve, hash_group_id=self._hash_group)
        self.moetide = LineBooks(settings, shape, pool, block_bytes=block_bytes, block_size=self.block_size,
                                 max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
                                 costs=None if shape is None else plugin_costs(settings, shape, active))
        self.connector.bind_line(self.moetide)
        self._vllm_allocate = kvm.allocate_slots
        kvm.allocate_slots = self._allocate_slots

    # ---- vLLM's scheduler methods -------------------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        self.moetide.begin_step()
        output = super().schedule(*args, **kwargs)
        self.moetide.end_step(output.total_num_scheduled_tokens)
        return output

    def _get_local_prefix_cache_hit(self, request, *args, **kwargs):
        """vLLM's prefix lookup for a waiting request, then the policy's admission hook (what moetide's scheduler
        calls at each lookup, before allocating). vLLM's own arguments pass through as given (0.33 added
        ``max_cache_hit_length``; ``_init_moetide`` checks the series' parameters, ``vllm.versions``)."""
        hit = super()._get_local_prefix_cache_hit(request, *args, **kwargs)
        self.moetide.policy.admitting(self._view(request, hit[1]), self.moetide.now_s, self.moetide.line)
        return hit

    # ---- the seam -----------------------------------------------------------------------------------------
    def _view(self, request, num_computed_tokens: int | None = None) -> RequestView:
        hashes = request.block_hashes
        kvm = self.kv_cache_manager
        if kvm.block_pool.hash_block_size != self.block_size:
            hashes = BlockHashListWithBlockSize(hashes, kvm.block_pool.hash_block_size, self.block_size)
        return RequestView(request, hashes, num_computed_tokens)

    def _allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                        num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False,
                        num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0,
                        has_scheduled_reqs=True, skip_zeroing_group_ids=()):
        """``KVCacheManager.allocate_slots`` (its parameters and defaults, ``_ALLOCATE_PARAMETERS``) with the policy
        asked first (module docstring)."""
        a = dict(locals())
        del a["self"], a["request"]
        hits = self._hit_blocks(a)
        if full_sequence_must_fit:
            while True:
                short, cached = self._shortfall(request, a, hits, full=True)
                if short == 0 or short <= cached:
                    break
                if not self._relieve(request, short, hits, running=False, whole_sequence=True):
                    return None
        if self._surely_fits(request, a):
            return self._vllm_allocate(request, **a)
        while True:
            short, _ = self._shortfall(request, a, hits, full=False)
            if short == 0:
                return self._vllm_allocate(request, **a)
            if not self._relieve(request, short, hits, running=request.status == RequestStatus.RUNNING):
                return None

    def _surely_fits(self, request, a) -> bool:
        """The common case, answered without ``_shortfall``'s walk through vLLM's coordinator (which would run for
        every running request every step): a running request with no new hits, in a full-attention cache. There
        vLLM's own count for a running request (``SingleTypeKVCacheManager.get_num_blocks_to_allocate``) is the
        blocks its tokens need beyond those it holds; when that is 0, or that many blocks at the head of the free
        queue are all never-cached, the shortfall is 0. Anything else goes the counted way."""
        if (self._full_block_sizes is None or request.status != RequestStatus.RUNNING
                or a["new_computed_blocks"] is not None or a["num_external_computed_tokens"]
                or a["num_encoder_tokens"] or a["num_new_computed_tokens"]):
            return False
        kvm = self.kv_cache_manager
        num_tokens = min(request.num_computed_tokens + a["num_new_tokens"] + a["num_lookahead_tokens"],
                         kvm.max_model_len)
        need = a["reserved_blocks"]
        for manager, size in zip(kvm.coordinator.single_type_managers, self._full_block_sizes):
            if request.request_id not in manager.num_cached_block:
                return False
            need += max(-(-num_tokens // size) - len(manager.req_to_blocks.get(request.request_id, ())), 0)
        return need == 0 or (kvm.block_pool.get_num_free_blocks() >= need
                             and self.moetide.pool.num_cached_among_next(need) == 0)

    def _hit_blocks(self, a) -> list:
        blocks = a["new_computed_blocks"]
        if blocks is None:
            return []
        return [b for group in blocks.blocks for b in group if not b.is_null]

    def _shortfall(self, request, a, hits: list, *, full: bool) -> tuple[int, int]:
        """(blocks the allocation needs beyond the never-cached free blocks, cached free blocks outside its hits),
        counted as vLLM's ``allocate_slots`` counts them (its watermark and reserved blocks included). The free
        queue holds never-cached blocks before cached ones (``vllm.pool``), so the shortfall is the cached blocks
        among those the allocation would take, found by walking only that far; the gate that passes counting
        cached blocks as free is answered from vLLM's free count alone."""
        kvm = self.kv_cache_manager
        groups = a["new_computed_blocks"].blocks if a["new_computed_blocks"] is not None \
            else kvm.empty_kv_cache_blocks.blocks
        reused = a["num_new_computed_tokens"] + a["num_external_computed_tokens"]
        if a["new_computed_blocks"] is not None and kvm.retained_hit_group_ids:
            groups = list(groups)
            for group_id in kvm.retained_hit_group_ids:
                size = kvm.coordinator.single_type_managers[group_id].block_size
                groups[group_id] = groups[group_id][: -(-reused // size)]
            groups = tuple(groups)
        local = request.num_computed_tokens + a["num_new_computed_tokens"]
        total = min(local + a["num_external_computed_tokens"], kvm.max_model_len)
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        common = dict(request_id=request.request_id, new_computed_blocks=groups,
                      num_encoder_tokens=a["num_encoder_tokens"], num_local_computed_tokens=local,
                      prefill_end=prefill_end)
        if full:
            n = min(request.num_tokens, kvm.max_model_len)
            need = kvm.coordinator.get_num_blocks_to_allocate(num_tokens=n, total_computed_tokens=total,
                                                              num_tokens_main_model=n, apply_admission_cap=True,
                                                              **common)
        else:
            main = total + a["num_new_tokens"]
            kvm.coordinator.remove_skipped_blocks(request.request_id, max(0, total - request.num_in_flight_tokens),
                                                  num_prompt_tokens=request.num_prompt_tokens)
            need = kvm.coordinator.get_num_blocks_to_allocate(
                num_tokens=min(main + a["num_lookahead_tokens"], kvm.max_model_len),
                total_computed_tokens=local + a["num_external_computed_tokens"], num_tokens_main_model=main, **common)
        watermark = kvm.watermark_blocks if a["has_scheduled_reqs"] and request.status in (
            RequestStatus.WAITING, RequestStatus.PREEMPTED) else 0
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        free_others = kvm.block_pool.get_num_free_blocks() - free_hits
        wanted = need - free_hits + watermark + a["reserved_blocks"]  # blocks to take from the free queue
        if full and wanted <= free_others:
            return 0, 0  # it fits counting cached blocks as free: the gate passes without a count
        walked = min(wanted, free_others)
        uncached = walked - self.moetide.pool.num_cached_among_next(walked, {b.block_id for b in hits})
        return max(wanted - uncached, 0), free_others - uncached

    def _relieve(self, request, short: int, hits: list, *, running: bool, whole_sequence: bool = False) -> bool:
        """Ask the policy and carry out its plan; False when there is no way out here (the caller fails the
        allocation: a waiting request waits, and for a running one vLLM's loop preempts its victim)."""
        books = self.moetide
        index = self.running.index(request) if running else -1
        preemptible = [self._view(r) for r in self.running[index + 1:]] if running else []
        protected = frozenset(b.block_id for b in hits)
        view = PressureView(short, self._view(request), running, preemptible, books.pool, protected, books.now_s,
                            books.line, [self._view(r) for r in self.running], whole_sequence)
        actions = books.policy.relieve(view)
        freed = 0  # blocks the plan made never-cached and free
        for action in actions:
            if isinstance(action, EvictPrefix):
                freed += books.evict(action.num_blocks, protected)
            elif isinstance(action, OffloadExperts):
                if books.line is None:
                    raise RuntimeError(f"policy {books.policy.name!r} offloaded experts but no expert line is set")
                freed += books.offload(action.region)
            elif isinstance(action, Preempt):
                victim = self.running[-1].request_id if self.running else None
                if len(actions) != 1 or action.request_id != victim:
                    raise RuntimeError(f"policy {books.policy.name!r} preempted {action.request_id!r}; inside vLLM "
                                       f"only vLLM's own victim ({victim!r}, the newest running request) can go")
                return False
            else:
                raise TypeError(f"unknown pressure action {action!r}")
        return freed > 0


def schedules_asynchronously(vllm_config) -> bool:
    """What vLLM decided (``VllmConfig`` resolves ``async_scheduling``: on by default on a GPU, off on the CPU)."""
    return bool(vllm_config.scheduler_config.async_scheduling)


class MoetideScheduler(_MoetideScheduling, Scheduler):
    """moetide's scheduler as ``--scheduler-cls`` names it: vLLM's ``Scheduler`` with moetide's policy where vLLM
    schedules synchronously (the CPU), else a ``MoetideAsyncScheduler``, as vLLM picks ``AsyncScheduler`` over
    ``Scheduler`` itself. A subclass is built as it is and must match vLLM's choice (``_init_moetide``)."""

    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if cls is MoetideScheduler and schedules_asynchronously(vllm_config):
            return MoetideAsyncScheduler(*args, **kwargs)  # not a MoetideScheduler: Python does not init it again
        return super().__new__(cls)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_moetide()


class MoetideAsyncScheduler(_MoetideScheduling, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with moetide's policy (what ``MoetideScheduler`` becomes where vLLM schedules
    asynchronously, the GPU default; on a synchronous engine it runs too, as vLLM's own does)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._init_moetide()


def refuse_foreign_scheduler(scheduler_cls: type) -> None:
    """``ValueError`` in one line where moetide's connector is configured with a scheduler that is not moetide's:
    the pool would hold the line's reserve, and nothing would ever move the line."""
    if not issubclass(scheduler_cls, _MoetideScheduling):
        raise ValueError(f"moetide's connector needs moetide's scheduler, not {scheduler_cls.__module__}."
                         f"{scheduler_cls.__qualname__}: pass --scheduler-cls moetide.vllm.scheduler.MoetideScheduler "
                         f"(or a subclass of it)")
