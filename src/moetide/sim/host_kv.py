"""Host-spilled KV in replay: WriteScope's engine half on a recorded trace, MODELED.

With ``--kv-host-memory`` the replay's pool gets a host tier, built as the engine builds its own
(``engine.host_kv``): host block ids come after every id the device can ever use, and the pool is made with
that ``HostTier``, so device blocks are allocated first and host blocks only once no uncached device block is
free (``core.blocks``, "Two tiers": a device block holding a cached prefix is not evicted
for new KV, which spills instead). A request that would have been preempted for want of KV now gets host blocks
instead; prefix hits on host blocks are used where they lie.

Each step, the named split policy (``core.split_planner.SplitStepper``: the engine's, with the same costs from
``perf.offload.split_coefficients``) splits every sequence's host blocks between the CPU (attended in place) and
the stream (copied into the staging ring). The step is charged as the engine's would be on the modeled machine:
the roofline step over the device-resident KV, plus what the host KV adds to the attention phase, which is
``perf.offload.attention_phase`` (max of the CPU side and the GPU side) minus the device attention already charged.
Writescope's online correction is fed the modeled CPU time, so it stays at 1 unless ``cpu_slowdown`` makes the
CPU slower than the model; its probes run as in the engine.

As in the engine, a step's queries per sequence are its tokens over its sequences (one plan per step), and the
staging ring's device memory comes out of the KV budget. Not modeled: tensor parallelism (one GPU, one host
socket), VAMP's moving line beside a host tier, and PCIe traffic of KV and of staged experts in the same phase.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from typing import TYPE_CHECKING

from moetide.core.blocks import HostTier
from moetide.core.kv_manager import KVCacheManager
from moetide.core.split_planner import SplitStepper
from moetide.core.splits import SeqResidency, SplitCosts
from moetide.errors import UserError
from moetide.perf import MemoryBudget, weights_per_gpu
from moetide.perf.attention import AttentionCostModel, HostKVLayout
from moetide.perf.calibrate import offload_efficiency_for_host
from moetide.perf.offload import SeqTokens, attention_phase, gpu_fixed_s, split_coefficients
from moetide.specs import get_host
from moetide.units import bytes_text, cdiv

if TYPE_CHECKING:
    from moetide.sim.setup import ReplayConfig


@dataclass
class SeqKV:
    """One sequence's KV this step, by residency: used blocks and the tokens in them. ``flags`` is each held
    block's residency (True: host), so a decode run can grow the sequence without asking the pool again."""

    flags: list[bool]
    context: int
    device_blocks: int = 0
    host_blocks: int = 0
    host_tokens: int = 0

    @classmethod
    def of(cls, flags: list[bool], context: int, block_size: int, num_host: int | None = None) -> SeqKV:
        """``num_host``: how many of ``flags`` are True, when the caller keeps that count (else it is summed)."""
        used = cdiv(context, block_size)
        if num_host is None:
            num_host = sum(flags)
        host_blocks = num_host - sum(flags[used:])  # the held blocks past the context are few
        host_tokens = host_blocks * block_size
        if used and flags[used - 1]:  # the last used block is the only partial one
            host_tokens -= used * block_size - context
        return cls(flags, context, used - host_blocks, host_blocks, host_tokens)

    @property
    def device_tokens(self) -> int:
        return self.context - self.host_tokens

    def grow(self, block_size: int) -> None:
        """One more token (a decode step), in a block the sequence already holds."""
        on_host = self.flags[self.context // block_size]
        if self.context % block_size == 0:
            self.host_blocks += on_host
            self.device_blocks += not on_host
        self.host_tokens += on_host
        self.context += 1


@dataclass
class HostKVCounters:
    """Totals over the steps that attended host KV (token-steps: a token counts once per step that reads it)."""

    steps: int = 0
    cpu_tokens: int = 0
    streamed_tokens: int = 0
    device_tokens: int = 0
    added_s: float = 0.0  # what the host KV added to the attention phases, over the whole replay
    peak_host_blocks_used: int = 0
    promoted_blocks: int = 0  # host prefix hits copied to device blocks (the admission bound's promotions)
    promote_s: float = 0.0  # the time those copies took (charged to their steps)

    def as_dict(self, stepper: SplitStepper) -> dict[str, object]:
        host = self.cpu_tokens + self.streamed_tokens
        return {**dataclasses.asdict(self), "cpu_share": self.cpu_tokens / host if host else 0.0,
                "policy": stepper.name, "correction_factor": stepper.correction_factor,
                "probes": stepper.num_probes}


class HostKV:
    """The host tier's ids and the per-step charge (module docstring); ``build_host_kv`` makes one."""

    def __init__(self, attention: AttentionCostModel, policy: str, *, first_host_id: int, num_host_blocks: int,
                 num_device_blocks: int, block_size: int, fixed_ratio: float = 0.5,
                 cpu_slowdown: float = 1.0) -> None:
        self.attention, self.block_size, self.cpu_slowdown = attention, block_size, cpu_slowdown
        self.first_host_id, self.num_host_blocks = first_host_id, num_host_blocks
        self.num_device_blocks = num_device_blocks  # the device KV blocks left beside the staging ring
        self.stepper = SplitStepper(policy, self._costs, attention.block_bytes, fixed_ratio)
        self.counters = HostKVCounters()
        self._base_costs: dict[int, SplitCosts] = {}
        # request id -> (its block list, their flags, how many are host blocks)
        self._flags: dict[str, tuple[list[int], list[bool], int]] = {}

    @property
    def tier(self) -> HostTier:
        return HostTier(self.first_host_id, self.num_host_blocks)

    def _costs(self, device_tokens: int, num_queries: int) -> SplitCosts:
        """``split_coefficients``, of which only g depends on the device-resident tokens: the rest is kept per
        query count (a replay plans hundreds of thousands of steps)."""
        base = self._base_costs.get(num_queries)
        if base is None:
            c = split_coefficients(self.attention, 0, num_queries)
            base = self._base_costs[num_queries] = SplitCosts(**dataclasses.asdict(c))
        return base.with_gpu_fixed_s(gpu_fixed_s(self.attention, device_tokens, num_queries))

    def promote_s(self, num_blocks: int) -> float:
        """Seconds to copy ``num_blocks`` host blocks to device blocks over the link: one transfer, at the rate
        streamed KV gets (``SplitCosts.stream_*``). Counted."""
        costs = self._costs(0, 1)
        seconds = costs.stream_fixed_s + num_blocks * self.attention.block_bytes * costs.stream_s_per_byte
        self.counters.promoted_blocks += num_blocks
        self.counters.promote_s += seconds
        return seconds

    def seqs(self, kv: KVCacheManager, contexts: list[tuple[str, int]]) -> list[SeqKV]:
        """The step's running requests' KV by residency, from (request id, context after the step). A request's
        block list is one list that only grows while the request holds it (``KVCacheManager``; a preempted
        request gets a new one), so its flags are extended, not rebuilt: agent contexts hold thousands of blocks.
        Only the requests of this step are remembered."""
        tier, known, out = self.tier, self._flags, []
        first, end = tier.first_id, tier.end_id
        self._flags = {}
        for request_id, context in contexts:
            blocks = kv.get_blocks(request_id)
            cached = known.get(request_id)
            flags, num_host = (cached[1], cached[2]) if cached is not None and cached[0] is blocks else ([], 0)
            if len(flags) < len(blocks):
                new = [first <= b < end for b in blocks[len(flags):]]  # HostTier.holds, inlined
                flags.extend(new)
                num_host += sum(new)
            self._flags[request_id] = (blocks, flags, num_host)
            out.append(SeqKV.of(flags, context, self.block_size, num_host))
        return out

    def charge(self, seqs: list[SeqKV], num_queries: int) -> tuple[float, int]:
        """(seconds the host KV adds to a step beyond attending the device-resident KV, host tokens attended); (0, 0)
        when none is used. Only the sequences holding host blocks go to the policy: the others would get no CPU and
        no streamed block under every policy, so the split is the same as over the whole batch, for less work."""
        spilled, device_tokens = [], 0
        for s in seqs:
            device_tokens += s.context - s.host_tokens
            if s.host_blocks:
                spilled.append(s)
        if not spilled:
            return 0.0, 0
        residency = [SeqResidency(i, s.device_blocks, s.host_blocks) for i, s in enumerate(spilled)]
        plan = self.stepper.plan(residency, device_tokens, num_queries)
        bs = self.block_size
        tokens = [SeqTokens(device_tokens, 0, 0)]  # every device-resident token: attention_phase sums them
        cpu_tokens = host_tokens = host_blocks = 0
        for s, split in zip(spilled, plan.splits):
            cpu = min(s.host_tokens, split.num_cpu_blocks * bs)
            tokens.append(SeqTokens(0, cpu, s.host_tokens - cpu))
            cpu_tokens += cpu
            host_tokens += s.host_tokens
            host_blocks += s.host_blocks
        phase = attention_phase(self.attention, tokens, num_queries, self.cpu_slowdown)
        self.stepper.observe(plan, phase.cpu_s)
        added = max(0.0, phase.total_s - gpu_fixed_s(self.attention, device_tokens, num_queries))
        c = self.counters
        c.steps += 1
        c.cpu_tokens += cpu_tokens
        c.streamed_tokens += host_tokens - cpu_tokens
        c.device_tokens += device_tokens
        c.added_s += added
        c.peak_host_blocks_used = max(c.peak_host_blocks_used, host_blocks)
        return added, host_tokens


def ring_blocks(budget: MemoryBudget) -> int:
    """Device KV blocks the staging ring of a host KV tier takes from the budget."""
    return cdiv(HostKVLayout().ring_bytes, budget.charged_block_bytes)


def active_host_blocks(config: ReplayConfig, budget: MemoryBudget) -> int | None:
    """``--kv-host-active-memory`` in blocks (None: no bound), at least one."""
    if config.kv_host_active_memory is None:
        return None
    return max(config.kv_host_active_memory // budget.charged_block_bytes, 1)


def build_host_kv(model, gpu, config: ReplayConfig, budget: MemoryBudget) -> HostKV | None:
    """The host tier of ``config.kv_host_memory`` (None without one), its ids above every id the device can use."""
    if not config.kv_host_memory:
        return None
    host = get_host(config.cpu)
    host_bytes = config.kv_host_memory
    if host_bytes > host.dram_bytes:
        raise UserError(f"--kv-host-memory {bytes_text(host_bytes)} exceeds the host's DRAM "
                        f"({host.dram_bytes / 2**30:,.0f} GiB, --cpu {config.cpu})")
    num_host = host_bytes // budget.charged_block_bytes
    device = budget.num_blocks - ring_blocks(budget)
    if num_host < 1 or device < 1 + budget.state_blocks_per_request:
        raise UserError(f"--kv-host-memory {bytes_text(host_bytes)}: {num_host} host blocks and {device} device "
                        f"blocks (after the {HostKVLayout().ring_bytes / 2**20:.0f} MiB staging ring) of "
                        f"{budget.charged_block_bytes:,} B; raise --kv-host-memory or --kv-cache-memory")
    routed = weights_per_gpu(model, tp=config.tp).routed_expert_bytes
    first_host_id = budget.num_blocks + cdiv(routed, budget.charged_block_bytes) + 1  # past the expert line's ids
    try:
        attention = AttentionCostModel(model, gpu, host, layout=HostKVLayout(block_size=config.block_size),
                                       offload=offload_efficiency_for_host(config.cpu))
    except ValueError as exc:
        raise UserError(f"--kv-host-memory: {exc}") from None
    return HostKV(attention, config.split_policy, first_host_id=first_host_id, num_host_blocks=num_host,
                  num_device_blocks=device, block_size=config.block_size, fixed_ratio=config.split_fixed_ratio,
                  cpu_slowdown=config.cpu_slowdown)
