"""Expert residency: which routed experts are in HBM, which are offloaded, how hot each is, which to give up next.

An offloaded expert is served from its host copy: its weights are staged to the device before its layer runs.
The arena (``core.arena``) turns an offloaded expert's pages into KV blocks; this module only decides *which*
experts and keeps the books. Keys are ``(layer, expert)`` over MoE layers and *routed* experts only: shared
experts run for every token, so offloading one would stage it every step; they are never candidates and are
not named here at all.

Hotness is an exponentially decayed routing count: ``record_routing`` adds each step's counts, ``end_step``
multiplies every count by ``decay`` (1.0 keeps lifetime totals). The decay is applied lazily through one shared
scale factor, so ``end_step`` costs O(1) rather than O(layers × experts); the scale is folded back into the
counts before it underflows. Hotness is therefore deterministic for the same calls, whatever the step count.

``next_offload_region`` picks cold experts first, spread over layers: it repeatedly takes the coldest resident
expert of the layer that has the fewest offloaded experts so far (counting those already offloaded and those
picked in this call), ties broken by hotness, then layer index, then expert index. Why spread: an offloaded
expert of layer l can be staged while layers before l compute, so staging hides behind compute only if each
layer's share of staged bytes is small; the slowest layer sets the stall, and spreading evenly minimises it.
Within a layer, the coldest expert is needed least often and costs least to stage.

Invariant: the offloaded experts' bytes never exceed ``max_offload_ratio`` of all routed-expert bytes — the
number allowed (``max_num_offloaded``) is computed with the very expression ``offloaded_ratio`` reports, so
``offloaded_ratio <= max_offload_ratio`` holds exactly, float rounding included. A request that would exceed it
returns fewer experts (possibly none) rather than more.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from moetide.units import cdiv

ExpertKey = tuple[int, int]  # (MoE layer index, routed expert index)

_MIN_SCALE: Final = 1e-150  # fold the lazy decay scale into the counts below this


def check_expert_key(key: object, num_layers: int, num_experts: int) -> None:
    """Raise ValueError unless ``key`` is a (layer, routed expert) pair inside the model."""
    if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(i, int) for i in key)):
        raise ValueError(f"an expert key is a (layer, expert) pair of ints, got {key!r}")
    layer, expert = key
    if not 0 <= layer < num_layers:
        raise ValueError(f"expert {key}: layer {layer} is outside [0, {num_layers})")
    if not 0 <= expert < num_experts:
        raise ValueError(
            f"expert {key}: expert {expert} is outside the {num_experts} routed experts of a layer "
            f"(shared experts are never offloaded and are not tracked)"
        )


DEFAULT_MAX_OFFLOAD_RATIO = 0.15  # the VAMP paper's cap: the default of every driver and verb


@dataclass(frozen=True)
class ExpertResidencyConfig:
    """Shape of the routed experts and the policy knobs for offloading them."""

    num_layers: int  # MoE layers (dense layers have no routed experts)
    num_experts: int  # routed experts per MoE layer
    expert_bytes: int  # weights of one routed expert of one layer
    max_offload_ratio: float = DEFAULT_MAX_OFFLOAD_RATIO  # cap on offloaded / all routed-expert bytes
    decay: float = 0.9  # per-step multiplier on routing counts; 1.0 = no decay

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_experts", "expert_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ExpertResidencyConfig.{name} must be an integer >= 1, got {value!r}")
        if not 0.0 <= self.max_offload_ratio <= 1.0:
            raise ValueError(
                f"ExpertResidencyConfig.max_offload_ratio must be in [0, 1] (a fraction of routed-expert bytes), "
                f"got {self.max_offload_ratio!r}"
            )
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(
                f"ExpertResidencyConfig.decay must be in (0, 1] (1.0 keeps lifetime counts), got {self.decay!r}"
            )

    @property
    def routed_bytes(self) -> int:
        return self.num_layers * self.num_experts * self.expert_bytes


class ExpertResidency:
    """Residency and decayed routing counts of every routed expert. See the module docstring."""

    def __init__(self, config: ExpertResidencyConfig) -> None:
        self.config = config
        self._raw = [[0.0] * config.num_experts for _ in range(config.num_layers)]  # count / _scale
        self._scale = 1.0
        self._offloaded: list[set[int]] = [set() for _ in range(config.num_layers)]
        self._num_offloaded = 0
        # per layer, resident experts coldest first; None when routing or residency changed since it was sorted
        # (the lazy decay scales every count alike, so it never reorders them)
        self._cold_cache: list[list[int] | None] = [None] * config.num_layers
        self.max_num_offloaded = self._max_offloaded()

    def _ratio(self, num_experts: int) -> float:
        return num_experts * self.config.expert_bytes / self.config.routed_bytes

    def _max_offloaded(self) -> int:
        total = self.config.num_layers * self.config.num_experts
        cap = self.config.max_offload_ratio
        count = min(total, math.floor(cap * total))
        while count < total and self._ratio(count + 1) <= cap:
            count += 1
        while count > 0 and self._ratio(count) > cap:
            count -= 1
        return count

    # ---- routing statistics -------------------------------------------------------------------------------
    def record_routing(self, layer: int, experts: Iterable[int] | Mapping[int, float]) -> None:
        """Add this step's routing of one layer: expert ids (one count per occurrence, e.g. the flattened top-k
        of every token) or a mapping expert id -> count."""
        counts = experts.items() if isinstance(experts, Mapping) else ((e, 1.0) for e in experts)
        updates = []
        for expert, count in counts:
            check_expert_key((layer, expert), self.config.num_layers, self.config.num_experts)
            if not count >= 0 or math.isinf(count):
                raise ValueError(f"routing count of expert {(layer, expert)} must be finite and >= 0, got {count!r}")
            updates.append((expert, count))
        self._add_counts(layer, updates)  # validated first: a bad entry records nothing

    def record_counts(self, layer: int, counts: Sequence[float]) -> None:
        """``record_routing`` for a dense row: ``counts[e]`` tokens routed to expert e of ``layer``, one count per
        routed expert of the layer (what a ``bincount`` of the step's top-k gives), validated as a whole."""
        check_expert_key((layer, 0), self.config.num_layers, self.config.num_experts)
        if len(counts) != self.config.num_experts:
            raise ValueError(f"routing counts of layer {layer}: one per routed expert ({self.config.num_experts}), "
                             f"got {len(counts)}")
        if not all(c >= 0 and not math.isinf(c) for c in counts):
            raise ValueError(f"routing counts of layer {layer} must be finite and >= 0, got {list(counts)}")
        self._add_counts(layer, [(expert, count) for expert, count in enumerate(counts) if count])

    def _add_counts(self, layer: int, updates: list[tuple[int, float]]) -> None:
        """Add validated (expert, count) pairs of one layer to its decayed counts."""
        row, scale = self._raw[layer], self._scale
        for expert, count in updates:
            row[expert] += count / scale
        if updates:
            self._cold_cache[layer] = None

    def end_step(self) -> None:
        """Decay every routing count by ``decay`` (call once per engine step, after recording it)."""
        self._scale *= self.config.decay
        if self._scale < _MIN_SCALE:
            for row in self._raw:
                row[:] = [raw * self._scale for raw in row]
            self._scale = 1.0
            self._cold_cache = [None] * self.config.num_layers  # underflow may have made counts equal

    def hotness(self, layer: int, expert: int) -> float:
        """Decayed routing count of one expert."""
        check_expert_key((layer, expert), self.config.num_layers, self.config.num_experts)
        return self._raw[layer][expert] * self._scale

    # ---- choosing and marking regions ---------------------------------------------------------------------
    def next_offload_region(self, *, max_experts: int | None = None, num_bytes: int | None = None) -> list[ExpertKey]:
        """The next resident experts to offload, in pick order (see the module docstring for the order).

        ``max_experts`` caps the count; ``num_bytes`` asks for at least that many bytes of weights (rounded up
        to whole experts); give either or both (the smaller wins). Never exceeds ``max_offload_ratio``: returns
        fewer experts, possibly none, instead."""
        wanted = self._wanted(max_experts, num_bytes)
        budget = min(wanted, self.max_num_offloaded - self._num_offloaded)
        if budget <= 0:
            return []
        cold_first = [self._cold_order(layer) for layer in range(self.config.num_layers)]
        heap = [
            (len(self._offloaded[layer]), self._raw[layer][order[0]], layer, 0)
            for layer, order in enumerate(cold_first)
            if order
        ]
        heapq.heapify(heap)
        region: list[ExpertKey] = []
        while heap and len(region) < budget:
            count, _, layer, rank = heapq.heappop(heap)
            region.append((layer, cold_first[layer][rank]))
            if rank + 1 < len(cold_first[layer]):
                nxt = cold_first[layer][rank + 1]
                heapq.heappush(heap, (count + 1, self._raw[layer][nxt], layer, rank + 1))
        return region

    def _wanted(self, max_experts: int | None, num_bytes: int | None) -> int:
        if max_experts is None and num_bytes is None:
            raise ValueError("next_offload_region needs max_experts or num_bytes")
        wanted = self.config.num_layers * self.config.num_experts
        if max_experts is not None:
            if max_experts < 0:
                raise ValueError(f"max_experts must be >= 0, got {max_experts}")
            wanted = min(wanted, max_experts)
        if num_bytes is not None:
            if num_bytes < 0:
                raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
            wanted = min(wanted, cdiv(num_bytes, self.config.expert_bytes))
        return wanted

    def _cold_order(self, layer: int) -> list[int]:
        order = self._cold_cache[layer]
        if order is None:
            row, offloaded = self._raw[layer], self._offloaded[layer]
            order = sorted((e for e in range(self.config.num_experts) if e not in offloaded),
                           key=lambda e: (row[e], e))
            self._cold_cache[layer] = order
        return order

    def mark_offloaded(self, region: Sequence[ExpertKey]) -> None:
        """Record that the region's experts now live on the host; all resident, within the cap, or nothing
        changes."""
        keys = self._checked_region(region, offloaded=False)
        if self._num_offloaded + len(keys) > self.max_num_offloaded:
            raise ValueError(
                f"offloading {len(keys)} more experts would put {self._num_offloaded + len(keys)} of "
                f"{self.config.num_layers * self.config.num_experts} routed experts on the host, above "
                f"max_offload_ratio={self.config.max_offload_ratio} (at most {self.max_num_offloaded})"
            )
        for layer, expert in keys:
            self._offloaded[layer].add(expert)
            self._cold_cache[layer] = None
        self._num_offloaded += len(keys)

    def mark_resident(self, region: Sequence[ExpertKey]) -> None:
        """Record that the region's experts are back in HBM; all must be offloaded, or nothing changes."""
        keys = self._checked_region(region, offloaded=True)
        for layer, expert in keys:
            self._offloaded[layer].discard(expert)
            self._cold_cache[layer] = None
        self._num_offloaded -= len(keys)

    def _checked_region(self, region: Sequence[ExpertKey], *, offloaded: bool) -> list[ExpertKey]:
        keys = [tuple(key) for key in region]
        for key in keys:
            check_expert_key(key, self.config.num_layers, self.config.num_experts)
            if (key[1] in self._offloaded[key[0]]) != offloaded:
                raise ValueError(f"expert {key} is {'already offloaded' if not offloaded else 'not offloaded'}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"region lists an expert more than once: {keys}")
        return keys  # type: ignore[return-value]

    # ---- queries ------------------------------------------------------------------------------------------
    def is_resident(self, layer: int, expert: int) -> bool:
        check_expert_key((layer, expert), self.config.num_layers, self.config.num_experts)
        return expert not in self._offloaded[layer]

    def offloaded_experts(self, layer: int) -> list[int]:
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"layer {layer} is outside [0, {self.config.num_layers})")
        return sorted(self._offloaded[layer])

    def all_offloaded(self) -> list[ExpertKey]:
        return [(layer, e) for layer, experts in enumerate(self._offloaded) for e in sorted(experts)]

    @property
    def num_offloaded(self) -> int:
        return self._num_offloaded

    @property
    def offloaded_bytes(self) -> int:
        return self._num_offloaded * self.config.expert_bytes

    @property
    def offloaded_ratio(self) -> float:
        """Offloaded / all routed-expert bytes."""
        return self._ratio(self._num_offloaded)

    def check_invariants(self) -> None:
        """Raise AssertionError if the counts, the cap or the routing statistics are inconsistent."""
        assert self._num_offloaded == sum(len(s) for s in self._offloaded), "offloaded count drifted"
        assert self._num_offloaded <= self.max_num_offloaded, "offload cap exceeded"
        assert self.offloaded_ratio <= self.config.max_offload_ratio, "offloaded ratio above max_offload_ratio"
        for layer, experts in enumerate(self._offloaded):
            assert all(0 <= e < self.config.num_experts for e in experts), f"layer {layer}: bad expert index"
        assert _MIN_SCALE <= self._scale <= 1.0, f"decay scale {self._scale} out of range"
        for layer, row in enumerate(self._raw):
            assert all(0.0 <= raw < math.inf for raw in row), f"layer {layer}: routing count negative or infinite"
