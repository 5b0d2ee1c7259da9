"""WriteScope: the four KV regions, where blocks are placed, and the per-step CPU/accelerator split of the
host-resident KV. Stdlib only; the cost coefficients come in as plain numbers (``SplitCosts``) that the caller
derives from ``moetide.perf`` — core never imports perf.

Regions, {device, host} x {in-place, streamed}:
  device/in-place   KV resident in HBM, attended where it lies.
  device/streamed   a small staging ring in HBM that receives host KV during a step; no block lives there.
  host/streamed     pinned host blocks the accelerator reads by DMA into the ring.
  host/in-place     host blocks the CPU attends where they lie (partial output + log-sum-exp, merged on the GPU).

Placement (one model for every driver: the pool's, ``core.blocks``, two tiers).
- A block's residency (device or host) is fixed when it is written: KV is never migrated to change residency.
  Device blocks are allocated first and host blocks only once no uncached device block is free, so a sequence
  written alone or in lockstep with others is a device prefix then a host suffix. In a shared pool a sequence that
  spilled may get a device block again when one frees up, and a cached host prefix past the admission bound is
  copied to a new device block (``BlockPool.promote``, ``core.host_admission``): a new block, not a move. Either
  way the split needs only counts: a sequence's host blocks in table order, the first ``num_cpu_blocks`` of them
  attended by the CPU and the rest streamed, wherever device blocks sit between them (``SeqResidency``). Device
  first rather than host first because a sequence grows at its end and residency cannot be revised: "the last N
  blocks on the device" would need a migration for every new block, while a device prefix keeps shared prompt
  prefixes, which prefix caching hits, in HBM.
- Host blocks use one layout that both consumers read, so moving the split point moves no data.

The attention phase of one step, for X bytes of host KV attended by the CPU out of H (S = H - X streamed), with
n_c sequences that have CPU work and n_s that have streamed work (``SplitCosts`` names the coefficients):

    T(X) = max( k ([X>0] (c + n_c p_c) + a X),   g + n_c m + [S>0] (s + n_s p_s + b S) )

k is the online correction (measured / predicted CPU time, EWMA-smoothed, bounded). WriteScope gives the CPU
whole sequences' host parts, longest first, and splits at most one sequence (the fewest sequences pay a
per-sequence cost on either side), and takes the X that minimises T; for each count of touched sequences T is
convex in X and its minimum is the crossing of the two sides, solved in closed form (``optimal_cpu_blocks``).
Endpoints X = 0 and X = H are candidates because their fixed costs vanish; the whole-sequence assignment that
request-split would pick is a candidate too, so writescope never loses to a baseline on its own model.
In a chunked-prefill step of Q queries the caller's a, p_c and m grow with Q (CPU FLOPs per byte, query and
partial-output traffic) while b does not (each streamed byte serves all Q queries), so the CPU share falls, and is
exactly 0 once the CPU's fixed costs exceed what it could take off the streaming side.
The online correction, its probes and the per-step runner of a named policy are in ``core.split_planner``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum


class Region(Enum):
    DEVICE_INPLACE = "device/in-place"
    DEVICE_STREAMED = "device/streamed"  # the staging ring: streamed host blocks pass through it
    HOST_STREAMED = "host/streamed"
    HOST_INPLACE = "host/in-place"


@dataclass(frozen=True, slots=True)
class SeqResidency:
    """A sequence's blocks: ``num_device_blocks`` device-resident, then ``num_host_blocks`` host-resident."""

    seq_id: Hashable
    num_device_blocks: int
    num_host_blocks: int


@dataclass(frozen=True, slots=True)
class SeqSplit:
    """One step's regions of one sequence: blocks [0, d) device/in-place, [d, d + c) host/in-place (CPU),
    [d + c, d + c + s) host/streamed (through the ring), and ``num_skipped_blocks`` host blocks that a sparse
    (lossy) policy of ``MODELED_POLICIES`` does not attend this step. Counts, not positions: a sparse policy picks
    its blocks anywhere; the exact policies of ``SPLIT_POLICIES`` never skip one."""

    seq_id: Hashable
    num_device_blocks: int
    num_cpu_blocks: int
    num_streamed_blocks: int
    num_skipped_blocks: int = 0

    def region_of(self, block_index: int) -> Region | None:
        """The region of an attended block; None for a skipped one."""
        d, c, s = self.num_device_blocks, self.num_cpu_blocks, self.num_streamed_blocks
        if not 0 <= block_index < d + c + s + self.num_skipped_blocks:
            raise IndexError(f"block {block_index} is outside sequence {self.seq_id!r}")
        if block_index >= d + c + s:
            return None
        if block_index < d:
            return Region.DEVICE_INPLACE
        return Region.HOST_INPLACE if block_index < d + c else Region.HOST_STREAMED

    @property
    def cpu_blocks(self) -> range:
        return range(self.num_device_blocks, self.num_device_blocks + self.num_cpu_blocks)

    @property
    def streamed_blocks(self) -> range:
        start = self.num_device_blocks + self.num_cpu_blocks
        return range(start, start + self.num_streamed_blocks)


@dataclass(frozen=True, slots=True)
class SplitCosts:
    """Per-step coefficients of the attention phase (formula: module docstring). Seconds, and seconds per byte of
    host KV summed over layers. ``moetide.perf.offload`` computes them; the field names are the contract."""

    cpu_s_per_byte: float  # a: CPU in-place attention, max(DRAM, FLOP) roofline per byte
    cpu_fixed_s: float  # c: per step when the CPU has work (per-layer hand-off and sync)
    cpu_per_seq_s: float  # p_c: per sequence with CPU work (ship its queries down, its partial output up)
    stream_s_per_byte: float  # b: transfer (with per-transfer latency amortised) or device attention, the slower
    stream_fixed_s: float  # s: per step when anything is streamed (ring pipeline fill)
    stream_per_seq_s: float  # p_s: per sequence with streamed blocks (its first transfer's latency)
    gpu_fixed_s: float  # g: device/in-place attention and launches, paid by every placement
    merge_per_seq_s: float  # m: GPU-side cost of receiving and merging one sequence's CPU partial
    prefetch_bytes: float = 0.0  # P: streamed bytes the link moved while it idled in the previous phase (free here)

    def __post_init__(self) -> None:
        for name in _SPLIT_COST_FIELDS:
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"SplitCosts.{name} must be a finite number >= 0, got {value!r}")
        if self.cpu_s_per_byte <= 0 or self.stream_s_per_byte <= 0:
            raise ValueError("SplitCosts: cpu_s_per_byte and stream_s_per_byte must be > 0")

    def with_gpu_fixed_s(self, gpu_fixed_s: float) -> SplitCosts:
        """The same coefficients with another g, the one that depends on the step's device-resident tokens
        (``dataclasses.replace`` costs a replay planning every step several times as much)."""
        return SplitCosts(self.cpu_s_per_byte, self.cpu_fixed_s, self.cpu_per_seq_s, self.stream_s_per_byte,
                          self.stream_fixed_s, self.stream_per_seq_s, gpu_fixed_s, self.merge_per_seq_s,
                          self.prefetch_bytes)


_SPLIT_COST_FIELDS = tuple(f.name for f in fields(SplitCosts))


def cpu_side_s(costs: SplitCosts, cpu_bytes: float, num_cpu_seqs: int, factor: float = 1.0) -> float:
    if cpu_bytes <= 0:
        return 0.0
    return factor * (costs.cpu_fixed_s + num_cpu_seqs * costs.cpu_per_seq_s + costs.cpu_s_per_byte * cpu_bytes)


def gpu_side_s(costs: SplitCosts, streamed_bytes: float, num_streamed_seqs: int, num_cpu_seqs: int) -> float:
    """The streamed bytes beyond the prefetched P pay b each; the per-step and per-sequence costs stay."""
    t = costs.gpu_fixed_s + num_cpu_seqs * costs.merge_per_seq_s
    if streamed_bytes > 0:
        t += costs.stream_fixed_s + num_streamed_seqs * costs.stream_per_seq_s
        t += costs.stream_s_per_byte * max(0.0, streamed_bytes - costs.prefetch_bytes)
    return t


def phase_time_s(costs: SplitCosts, splits: Sequence[SeqSplit], block_bytes: float, factor: float = 1.0) -> float:
    """T of an actual per-sequence split (each sequence counted in n_c / n_s only if it has such blocks)."""
    cpu_blocks, streamed_blocks, n_c, n_s = _split_totals(splits)
    return _time_s(costs, cpu_blocks, cpu_blocks + streamed_blocks, n_c, n_s, block_bytes, factor)


def _split_totals(splits: Sequence[SeqSplit]) -> tuple[int, int, int, int]:
    """(CPU blocks, streamed blocks, sequences with CPU blocks, with streamed ones), in one pass: a replay prices
    several splits every step."""
    cpu_blocks = streamed_blocks = n_c = n_s = 0
    for s in splits:
        if s.num_cpu_blocks:
            cpu_blocks += s.num_cpu_blocks
            n_c += 1
        if s.num_streamed_blocks:
            streamed_blocks += s.num_streamed_blocks
            n_s += 1
    return cpu_blocks, streamed_blocks, n_c, n_s


def fill_split(seqs: Sequence[SeqResidency], total_cpu_blocks: int) -> tuple[SeqSplit, ...]:
    """Give the CPU whole sequences' host blocks, longest host part first (ties: batch order), and at most one
    sequence a partial range: the fewest sequences pay a per-sequence cost on either side."""
    cpu, left = [0] * len(seqs), total_cpu_blocks
    for i in sorted(range(len(seqs)), key=lambda i: (-seqs[i].num_host_blocks, i)):
        cpu[i] = min(left, seqs[i].num_host_blocks)
        left -= cpu[i]
    return tuple(SeqSplit(s.seq_id, s.num_device_blocks, c, s.num_host_blocks - c) for s, c in zip(seqs, cpu))


def proportional_split(seqs: Sequence[SeqResidency], total_cpu_blocks: int) -> tuple[SeqSplit, ...]:
    """The same share of every sequence's host blocks, largest remainder first (ties: batch order)."""
    host = sum(s.num_host_blocks for s in seqs)
    exact = [total_cpu_blocks * s.num_host_blocks / host if host else 0.0 for s in seqs]
    cpu = [math.floor(e) for e in exact]
    for i in sorted(range(len(seqs)), key=lambda i: (cpu[i] - exact[i], i))[:total_cpu_blocks - sum(cpu)]:
        cpu[i] += 1
    return tuple(SeqSplit(s.seq_id, s.num_device_blocks, c, s.num_host_blocks - c) for s, c in zip(seqs, cpu))


def _time_s(costs: SplitCosts, cpu_blocks: int, host_blocks: int, n_c: int, n_s: int, block_bytes: float,
            factor: float) -> float:
    return max(cpu_side_s(costs, cpu_blocks * block_bytes, n_c, factor),
               gpu_side_s(costs, (host_blocks - cpu_blocks) * block_bytes, n_s, n_c))


def optimal_cpu_blocks(costs: SplitCosts, host_blocks: Sequence[int], block_bytes: float,
                       factor: float = 1.0) -> int:
    """Closed-form optimum of T over whole blocks under the ``fill_split`` assignment, ties to fewer CPU blocks.

    With host parts h_1 >= ... >= h_n and prefix sums P_j, CPU bytes X in segment (P_j, P_j+1) touch
    n_c = j + 1 sequences on the CPU and n_s = n - j streamed; there T is convex (max of an increasing and a
    decreasing line), so its best whole block is the floor or ceiling of the crossing
    X_j = (g + n_c m + s + n_s p_s + b (H - P) - k (c + n_c p_c)) / (k a + b). A crossing outside the segment is
    dominated by the segment's end P_j or P_j+1 (fewer sequences pay there), which are candidates too. With
    prefetched bytes P the streaming side is flat for X >= H - P, so that point (its floor and ceiling in blocks)
    is a candidate as well: past it more CPU work only lengthens the CPU side."""
    parts = sorted((h for h in host_blocks if h > 0), reverse=True)
    n, total = len(parts), sum(parts)
    prefix = [0]
    for h in parts:
        prefix.append(prefix[-1] + h)
    candidates = [(prefix[j], j, n - j) for j in range(n + 1)]
    k, bb = factor, block_bytes
    for j in range(n):
        n_c, n_s = j + 1, n - j
        gpu = (costs.gpu_fixed_s + n_c * costs.merge_per_seq_s + costs.stream_fixed_s + n_s * costs.stream_per_seq_s
               + costs.stream_s_per_byte * max(0.0, total * bb - costs.prefetch_bytes))
        cpu = k * (costs.cpu_fixed_s + n_c * costs.cpu_per_seq_s)
        x = (gpu - cpu) / (k * costs.cpu_s_per_byte + costs.stream_s_per_byte)
        lo = math.floor(x / bb) if math.isfinite(x) else prefix[j]
        flat = math.floor(max(0.0, total * bb - costs.prefetch_bytes) / bb)
        candidates += [(b, n_c, n_s) for b in (lo, lo + 1, flat, flat + 1) if prefix[j] < b < prefix[j + 1]]
    best = min(candidates, key=lambda c: (_time_s(costs, c[0], total, c[1], c[2], bb, factor), c[0]))
    return best[0]


# ---- policies: one short class each, behind a registry -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mechanism:
    """What a policy's step does beyond its split, for the cost model to charge (``perf.offload.attention_phase``
    reads these as plain numbers). The defaults are an exact policy over the four-region layout.

    layer_ahead_cpu   the CPU starts layer l+1's attention during layer l's non-attention phase (a predicted query),
                      so the CPU side is shortened by the CPU's idle time in that phase (ScoutAttention)
    reuse_fraction    of the streamed blocks, the share the device still holds from the previous step (a sparse
                      selection changes little step to step); capped by the device room the caller has for them
    relayout          one monolithic cache: each step rewrites the whole cache before a consumer reads it (a
                      transformers DynamicCache appends by concatenation), and no KV is device-resident
    lossy             attends a selection of the host KV, not all of it: its cost is modeled, not its accuracy"""

    layer_ahead_cpu: bool = False
    reuse_fraction: float = 0.0
    relayout: bool = False
    lossy: bool = False


class SplitPolicy:
    """Given this step's coefficients and sequences, return each sequence's split. ``factor`` is the CPU
    correction the caller currently believes in (1.0 for the static baselines' own model)."""

    name = "?"
    mechanism = Mechanism()

    def split(self, costs: SplitCosts, seqs: Sequence[SeqResidency], block_bytes: float,
              factor: float = 1.0) -> tuple[SeqSplit, ...]:
        raise NotImplementedError


class WriteScope(SplitPolicy):
    """The optimum of T(X) re-chosen every step: ``fill_split`` at the closed-form X, unless the whole-sequence (LPT)
    assignment is cheaper — it can be, by one per-sequence cost, when a subset of whole sequences lands on the
    crossing — so that writescope never loses to request-split on its own model."""

    name = "writescope"

    def split(self, costs, seqs, block_bytes, factor=1.0):
        fill = fill_split(seqs, optimal_cpu_blocks(costs, [s.num_host_blocks for s in seqs], block_bytes, factor))
        whole = RequestSplit().split(costs, seqs, block_bytes, factor)
        t_fill, t_whole = (phase_time_s(costs, x, block_bytes, factor) for x in (fill, whole))
        return whole if t_whole < t_fill else fill


class TransferAll(SplitPolicy):
    """Stream every host block every step (FlexGen/vLLM-offload style); the CPU only holds bytes."""

    name = "transfer-all"

    def split(self, costs, seqs, block_bytes, factor=1.0):
        return fill_split(seqs, 0)


class CpuAll(SplitPolicy):
    """The CPU attends every host block in place; nothing is streamed."""

    name = "cpu-all"

    def split(self, costs, seqs, block_bytes, factor=1.0):
        return fill_split(seqs, sum(s.num_host_blocks for s in seqs))


@dataclass
class FixedRatio(SplitPolicy):
    """The same static CPU share of every sequence's host blocks, whatever the length or the CPU's load."""

    ratio: float = 0.5
    name: str = field(default="fixed-ratio", init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"FixedRatio: ratio is a CPU share and must be in [0, 1], got {self.ratio!r}")

    def split(self, costs, seqs, block_bytes, factor=1.0):
        return proportional_split(seqs, round(self.ratio * sum(s.num_host_blocks for s in seqs)))


class RequestSplit(SplitPolicy):
    """NEO-style: whole sequences' host KV goes to the CPU or is streamed, never a part. Longest first, each to
    the side whose finish time after taking it is smaller (LPT greedy), on the same cost model."""

    name = "request-split"

    def split(self, costs, seqs, block_bytes, factor=1.0):
        order = sorted(range(len(seqs)), key=lambda i: (-seqs[i].num_host_blocks, i))
        to_cpu = [False] * len(seqs)
        cpu_b = gpu_b = 0.0
        n_c = n_s = 0
        for i in order:
            h = seqs[i].num_host_blocks * block_bytes
            if h == 0:
                continue
            on_cpu = max(cpu_side_s(costs, cpu_b + h, n_c + 1, factor), gpu_side_s(costs, gpu_b, n_s, n_c + 1))
            on_gpu = max(cpu_side_s(costs, cpu_b, n_c, factor), gpu_side_s(costs, gpu_b + h, n_s + 1, n_c))
            if on_cpu < on_gpu:
                to_cpu[i], cpu_b, n_c = True, cpu_b + h, n_c + 1
            else:
                gpu_b, n_s = gpu_b + h, n_s + 1
        return tuple(SeqSplit(s.seq_id, s.num_device_blocks, s.num_host_blocks if c else 0,
                              0 if c else s.num_host_blocks) for s, c in zip(seqs, to_cpu))


SPLIT_POLICIES: dict[str, Callable[[], SplitPolicy]] = {
    "writescope": WriteScope,
    "transfer-all": TransferAll,
    "cpu-all": CpuAll,
    "request-split": RequestSplit,
    "fixed-ratio": FixedRatio,
}
BASELINES = ("transfer-all", "cpu-all", "request-split", "fixed-ratio")
DEFAULT_SPLIT_GPU = "a100-80gb"  # the GPU preset a split's costs are priced for when none is named


@dataclass(frozen=True, slots=True)
class StepSplit:
    splits: tuple[SeqSplit, ...]
    cpu_bytes: float
    host_bytes: float
    predicted_cpu_s: float  # uncorrected model, for OnlineCorrection.observe
    predicted_s: float  # T with the correction applied
    probe: bool = False  # the CPU's blocks are a probe (SplitPlanner), not the optimum

    @property
    def cpu_share(self) -> float:
        return self.cpu_bytes / self.host_bytes if self.host_bytes else 0.0

    @classmethod
    def of(cls, costs: SplitCosts, seqs: Sequence[SeqResidency], splits: tuple[SeqSplit, ...], block_bytes: float,
           factor: float = 1.0, probe: bool = False) -> StepSplit:
        """A step's split with its bytes and modeled times (the CPU side scaled by ``factor`` in the total)."""
        cpu_blocks, streamed_blocks, n_c, n_s = _split_totals(splits)
        cpu_bytes = cpu_blocks * block_bytes
        return cls(splits, cpu_bytes, sum(s.num_host_blocks for s in seqs) * block_bytes,
                   cpu_side_s(costs, cpu_bytes, n_c),
                   _time_s(costs, cpu_blocks, cpu_blocks + streamed_blocks, n_c, n_s, block_bytes, factor), probe)
