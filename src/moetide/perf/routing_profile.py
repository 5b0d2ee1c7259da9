"""Measured expert routing, as a file the engine writes and the staging model reads.

``moetide generate --routing-out FILE`` records how many tokens the router sent to every routed expert of every
MoE layer over the run; ``moetide replay|compare|sweep --routing-profile FILE`` prices staging with that
popularity instead of a Zipf law (``perf.staging``). The file is JSON::

    {"format": "moetide-routing-profile/1", "model": "<checkpoint dir>", "top_k": 8,
     "num_experts": 128, "counts": [[c_0, c_1, ...], ...]}     # one row per MoE layer, tokens routed per expert

Staging prices a layer's coldest experts, so the profile the model uses is rank-wise: each layer's counts sorted
from hottest to coldest and normalized, then averaged over layers (``rank_shares``). A profile must come from a
model with the same number of routed experts and the same top-k as the one replayed (its ranks are that model's
ranks).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moetide.errors import UserError, read_json

FORMAT = "moetide-routing-profile/1"


def write_profile(path: str | Path, counts: list[list[float]], *, top_k: int, model: str) -> None:
    if not counts or not counts[0]:
        raise ValueError("a routing profile needs at least one layer of at least one expert")
    data = {"format": FORMAT, "model": model, "top_k": top_k, "num_experts": len(counts[0]), "counts": counts}
    try:
        Path(path).write_text(json.dumps(data) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UserError(f"--routing-out {path}: cannot write: {exc.strerror or exc}") from None


def read_rank_shares(path: str | Path, num_experts: int, top_k: int | None = None) -> tuple[float, ...]:
    """The file's rank-wise routing shares (hottest first, summing to 1), checked against the replayed model's
    ``num_experts`` and (when given) ``top_k``: a profile's shares are per routing slot of its own top-k."""
    where = f"--routing-profile {path}"
    data = read_json(path, where)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{where}: field 'format' must be {FORMAT!r} (a file written by moetide generate "
                        f"--routing-out)")
    if top_k is not None and data.get("top_k") != top_k:
        raise UserError(f"{where}: field 'top_k' is {data.get('top_k')!r}; the replayed model routes each token to "
                        f"{top_k} experts")
    counts = data.get("counts")
    if not isinstance(counts, list) or not counts:
        raise UserError(f"{where}: field 'counts' must be a non-empty list of per-layer lists")
    for i, row in enumerate(counts):
        if not isinstance(row, list) or len(row) != num_experts:
            raise UserError(f"{where}: counts[{i}] must list {num_experts} experts (the replayed model's routed "
                            f"experts), got {len(row) if isinstance(row, list) else type(row).__name__}")
        for j, value in enumerate(row):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise UserError(f"{where}: counts[{i}][{j}] must be a finite count >= 0, got {value!r}")
    return rank_shares(counts)


def rank_shares(counts: list[list[float]]) -> tuple[float, ...]:
    """Each layer's counts sorted hottest first and normalized, averaged rank by rank over the layers that routed
    anything; uniform if none did."""
    rows = [sorted(row, reverse=True) for row in counts if sum(row) > 0]
    num_experts = len(counts[0])
    if not rows:
        return tuple([1.0 / num_experts] * num_experts)
    shares = [0.0] * num_experts
    for row in rows:
        total = sum(row)
        for r, value in enumerate(row):
            shares[r] += value / total / len(rows)
    return tuple(shares)
