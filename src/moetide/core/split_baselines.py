"""The WriteScope paper's named baselines and its monolithic-cache ablation, as split policies of the cost model.

Each is modeled from its system's public description (docs/writescope.md says what each is credited with), with
what it moves and computes per step as a split of every sequence's host blocks plus a ``Mechanism`` for what it
costs beyond that. ``plan-split`` compares them; the engine and the replay do not run them (their policies are
exact, ``core.splits.SPLIT_POLICIES``; two of these are sparse, so lossy).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from moetide.core.splits import (SPLIT_POLICIES, CpuAll, Mechanism, SeqResidency, SeqSplit, SplitPolicy, WriteScope,
                                 fill_split, phase_time_s, proportional_split)


def _density(owner: str, value: float) -> None:
    if not 0 < value <= 1:
        raise ValueError(f"{owner}: density is the share of host blocks attended and must be in (0, 1], got {value!r}")


class FastDecode(CpuAll):
    """FastDecode (He and Zhai, arXiv 2403.11421): the KV-touching "R-part" of every layer runs on the CPU where the
    KV lies; only queries and outputs cross the link. As a split: every host block on the CPU."""

    name = "fastdecode"


@dataclass
class HybridGen(SplitPolicy):
    """HybridGen (arXiv 2604.18529): attention-logit parallelism, "each processor operates on tokens in its local
    memory", rebalanced by a feedback scheduler that maps new KV across the tiers. With the device pool full (a
    32 GiB budget), placement cannot move, so the device attends its tokens and the CPU every host token.
    ``streams=True`` is a more generous reading: its rebalancing may also stream host KV, the same share of every
    sequence (its parallel split is per sequence) at the share where the two sides balance, i.e. where its
    feedback settles, with the CPU factor the caller believes in (writescope's online credit); every sequence then
    pays both sides' per-sequence costs."""

    streams: bool = False
    name: str = field(default="hybridgen", init=False)

    def split(self, costs, seqs, block_bytes, factor=1.0):
        host = sum(s.num_host_blocks for s in seqs)
        if not self.streams:
            return fill_split(seqs, host)
        n = sum(1 for s in seqs if s.num_host_blocks)
        gpu = (costs.gpu_fixed_s + n * costs.merge_per_seq_s + costs.stream_fixed_s + n * costs.stream_per_seq_s
               + costs.stream_s_per_byte * max(0.0, host * block_bytes - costs.prefetch_bytes))
        x = (gpu - factor * (costs.cpu_fixed_s + n * costs.cpu_per_seq_s)) / (
            factor * costs.cpu_s_per_byte + costs.stream_s_per_byte) / block_bytes
        flat = max(0.0, host * block_bytes - costs.prefetch_bytes) / block_bytes
        picks = {min(host, max(0, b)) for b in (math.floor(x), math.ceil(x), math.floor(flat), math.ceil(flat))}
        options = [proportional_split(seqs, b) for b in sorted(picks)]
        return min(options, key=lambda o: phase_time_s(costs, o, block_bytes, factor))


@dataclass
class ScoutAttention(SplitPolicy):
    """ScoutAttention (arXiv 2603.27138): block-sparse attention over host KV on the CPU, started one layer ahead
    with a predicted query, so the CPU works while the GPU runs the previous layer; hot blocks are recalled to the
    device asynchronously (not charged: it overlaps). As a split: ``density`` of every sequence's host blocks on
    the CPU, the rest skipped. Lossy."""

    density: float = 0.125
    name: str = field(default="scoutattention", init=False)
    mechanism: Mechanism = field(default=Mechanism(layer_ahead_cpu=True, lossy=True), init=False)

    def __post_init__(self) -> None:
        _density("ScoutAttention", self.density)

    def split(self, costs, seqs, block_bytes, factor=1.0):
        cpu = [min(s.num_host_blocks, math.ceil(self.density * s.num_host_blocks)) for s in seqs]
        return tuple(SeqSplit(s.seq_id, s.num_device_blocks, c, 0, s.num_host_blocks - c) for s, c in zip(seqs, cpu))


@dataclass
class SolidAttention(SplitPolicy):
    """SolidAttention (FAST '26, Zheng et al.): dynamic sparse attention on the accelerator over KV kept on slower
    storage (an SSD there; host DRAM here), in coarse blocks, speculatively prefetched; consecutive steps select
    mostly the same blocks, so ``locality`` of a step's selection is still on the device when room allows. As a
    split: ``density`` of every sequence's host blocks streamed, the rest skipped; the CPU attends nothing. Lossy."""

    density: float = 0.125
    locality: float = 0.8
    name: str = field(default="solidattention", init=False)

    def __post_init__(self) -> None:
        _density("SolidAttention", self.density)
        if not 0 <= self.locality < 1:
            raise ValueError(f"SolidAttention: locality is a share of blocks and must be in [0, 1), got "
                             f"{self.locality!r}")

    @property
    def mechanism(self) -> Mechanism:
        return Mechanism(reuse_fraction=self.locality, lossy=True)

    def split(self, costs, seqs, block_bytes, factor=1.0):
        out = [min(s.num_host_blocks, math.ceil(self.density * s.num_host_blocks)) for s in seqs]
        return tuple(SeqSplit(s.seq_id, s.num_device_blocks, 0, n, s.num_host_blocks - n) for s, n in zip(seqs, out))


class Monolithic(SplitPolicy):
    """The paper's layout ablation: one monolithic cache (a transformers DynamicCache) instead of four regions.
    All KV lives in one host tensor that each step rewrites on append (``Mechanism.relayout``), so no block is
    device-resident; the split along the sequence is still writescope's (a slice of one tensor is a view)."""

    name = "monolithic"
    mechanism = Mechanism(relayout=True)

    def split(self, costs, seqs, block_bytes, factor=1.0):
        flat = [SeqResidency(s.seq_id, 0, s.num_device_blocks + s.num_host_blocks) for s in seqs]
        return WriteScope().split(costs, flat, block_bytes, factor)


NAMED_BASELINES = ("solidattention", "scoutattention", "hybridgen", "fastdecode")  # the WriteScope paper's four
# Every policy the cost model compares (plan-split); the engine and the replay run SPLIT_POLICIES only.
MODELED_POLICIES: dict[str, Callable[[], SplitPolicy]] = {
    **SPLIT_POLICIES, "fastdecode": FastDecode, "hybridgen": HybridGen, "scoutattention": ScoutAttention,
    "solidattention": SolidAttention, "monolithic": Monolithic}
