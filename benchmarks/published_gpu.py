"""The step model against published GPU measurements: each point's modeled figure, its ratio and its terms.

    .venv/bin/python benchmarks/published_gpu.py [--profiles roofline,vllm-0.32] [--fit] [--data PATH]

Reads ``benchmarks/data/published_gpu.jsonl`` (one published measurement a line: setup, value, source, the quoted
text; ``moetide.perf.published`` says how a setup becomes steps) and prints one JSON line per point and profile
(``ratio``: measured over modeled time, or modeled over measured throughput, so above 1 the model is too fast), then
one summary line per profile and set: the RMS of log(ratio) and how many points lie within 1.25x. The ``fit`` points
are what ``--fit`` fits the profile's coefficients on (``FIT_FIELDS``, a search coordinate by coordinate on a log
scale, each source table weighing alike); the ``check`` points are never fitted on. ``--fit`` prints the fitted
table for ``src/moetide/perf/engines.toml`` and its errors. Every modeled figure is the roofline's, not a
measurement; the measurements are others', with their sources in the data file. Offline, about a second a profile
(``--fit``: about ten seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moetide.errors import UserError  # noqa: E402
from moetide.perf.engines import engine_efficiency, engine_profiles  # noqa: E402
from moetide.perf.published import PublishedPoint, explain, load_points, modeled  # noqa: E402
from moetide.perf.step import Efficiency  # noqa: E402
from moetide.perf.step_calibrate import coordinate_search  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "published_gpu.jsonl"
# the fitted Efficiency fields and their bounds; custom_allreduce_max_bytes is vLLM's CustomAllreduce max_size
# default (8 MiB), a fact, not a fit
FIT_FIELDS = {
    "matmul": (0.2, 1.0), "hbm": (0.3, 1.0), "moe_matmul": (0.1, 1.0), "moe_matmul_fp8": (0.05, 1.0),
    "moe_half_tokens": (1.0, 1024.0),
    "moe_layer_s": (1e-6, 3e-4), "attention_layer_s": (1e-6, 3e-4), "linear_layer_s": (1e-6, 3e-4),
    "step_overhead_s": (1e-5, 1e-2), "allreduce": (0.2, 1.0), "allreduce_latency_s": (1e-6, 2e-4),
    "nccl_latency_s": (1e-6, 2e-4),
}
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 1024 * 1024
WITHIN = 1.25
RESTARTS = 4


def ratio(point: PublishedPoint, model_value: float) -> float:
    """Above 1: the model is too fast (it gives less time, or more throughput, than was measured)."""
    if point.metric.endswith("_per_s"):
        return model_value / point.value
    return point.value / model_value


def summary(points: list[PublishedPoint], ratios: list[float]) -> dict:
    logs = [math.log(r) for r in ratios]
    return {"points": len(points), "rms_log": math.sqrt(sum(x * x for x in logs) / len(logs)),
            "within_1_25": sum(1 for r in ratios if 1 / WITHIN <= r <= WITHIN),
            "min_ratio": min(ratios), "max_ratio": max(ratios)}


def weighted_loss(points: list[PublishedPoint], efficiency: Efficiency) -> float:
    """Sum of squared log ratios, each source table (group) weighing one in all."""
    sizes: dict[str, int] = defaultdict(int)
    for p in points:
        sizes[p.group] += 1
    return sum(math.log(ratio(p, modeled(p, efficiency))) ** 2 / sizes[p.group] for p in points)


def fit(points: list[PublishedPoint], start: Efficiency) -> Efficiency:
    names = list(FIT_FIELDS)
    base = replace(start, custom_allreduce_max_bytes=CUSTOM_ALLREDUCE_MAX_BYTES)
    defaults = {"moe_matmul": base.matmul, "moe_matmul_fp8": base.matmul, "moe_half_tokens": 16.0, "moe_layer_s": 1e-5, "attention_layer_s": 1e-5,
                "linear_layer_s": 1e-5, "nccl_latency_s": base.allreduce_latency_s}
    first = tuple(getattr(base, n) if getattr(base, n) else defaults[n] for n in names)
    memo: dict[tuple[float, ...], float] = {}

    def evaluate(point: tuple[float, ...]) -> float:
        if point not in memo:
            memo[point] = weighted_loss(points, replace(base, **dict(zip(names, point))))
        return memo[point]

    best, bounds = first, [FIT_FIELDS[n] for n in names]
    for _ in range(RESTARTS):  # a search restarted where the last one stopped, with its coarse steps again
        best = coordinate_search(best, evaluate, bounds)
    return replace(base, **dict(zip(names, best)))


def report(points: list[PublishedPoint], name: str, efficiency: Efficiency) -> None:
    by_set: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    by_kind: dict[tuple[str, str], tuple[list, list]] = defaultdict(lambda: ([], []))
    for p in points:
        value = modeled(p, efficiency)
        r = ratio(p, value)
        terms = {k: v for k, v in explain(p, efficiency).items() if k.endswith("_s") and v}
        print(json.dumps({"point": p.id, "profile": name, "set": p.set, "group": p.group, "kind": p.kind,
                          "model": p.model, "gpu": p.gpu, "tp": p.tp, "dtype": p.dtype, "engine": p.engine,
                          "setup": p.setup, "metric": p.metric, "measured": p.value, "modeled": value, "ratio": r,
                          "terms_s": terms, "source": p.source}))
        for bucket in (by_set[p.set], by_kind[(p.set, p.kind)]):
            bucket[0].append(p)
            bucket[1].append(r)
    for s, (ps, rs) in sorted(by_set.items()):
        print(json.dumps({"profile": name, "set": s, **summary(ps, rs), "modeled": "roofline, not measured"}))
    for (s, kind), (ps, rs) in sorted(by_kind.items()):
        print(json.dumps({"profile": name, "set": s, "kind": kind, **summary(ps, rs)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--profiles", default=",".join(engine_profiles()), help="engine profiles to compare")
    parser.add_argument("--fit", action="store_true", help="fit the coefficients on the fit set, from roofline")
    args = parser.parse_args()
    try:
        points = load_points(args.data)
        profiles = {name: engine_efficiency(name) for name in args.profiles.split(",")}
    except UserError as exc:
        sys.exit(f"published_gpu: {exc}")
    if args.fit:
        fitted = fit([p for p in points if p.set == "fit"], engine_efficiency("roofline"))
        table = {n: getattr(fitted, n) for n in (*FIT_FIELDS, "custom_allreduce_max_bytes")}
        print(json.dumps({"fitted": table}), flush=True)
        profiles["fitted"] = fitted
    for name, efficiency in profiles.items():
        report(points, name, efficiency)


if __name__ == "__main__":
    main()
