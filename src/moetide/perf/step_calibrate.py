"""The step-time model fitted to an engine: this machine's CPU described as the device the replay models.

``moetide calibrate --model DIR`` times the PyTorch engine's steps on a checkpoint (``engine.measure``: whole
``Engine.step`` calls, scheduling and sampling included, of designed batches — decode at several batch sizes and
contexts, prefill chunks of several lengths — not of any trace) and fits ``perf.step.Efficiency`` to them, so that
``moetide replay --gpu DEVICE.toml --model DIR`` predicts what ``moetide serve`` does on this CPU. The device's
rates are the calibration's measurements: HBM bandwidth = the DRAM triad, matmul rate = the fp32 GEMM. The fit
chooses the rest:

    t(step) = step_overhead_s + S x seq_overhead_s
              + roofline(step; e_mm = matmul, e_att = attention, e_hbm = hbm, e_kv = attention_memory)

The four shares (``FACTORS``) are searched coordinate by coordinate on a log scale in [1e-3, 1] — a line of three
decades each way, then ever finer steps, each sweep repeated until it moves nothing — and for each point the two
overheads (>= 0) come from least squares on the relative error, which has a closed form. ``attention_memory`` is
separate from ``hbm`` because the decode attention kernel over paged KV reaches a fraction of the triad that
streaming weights does not (``moetide calibrate`` measures it at 4-7 GB/s against a 27 GB/s triad here). The loss
is the sum of squared relative errors, each step weighted by 1 / (steps of its kind: tokens, sequences and the
power of two of its KV read), so a 2 ms decode step weighs as much as a 100 ms prefill and the forty decode steps of
one batch as much as its one prefill. The fit's error on its own samples is reported; the check that counts is
the replay against a measured serve run (docs/serve.md).

A request also costs the engine something no step carries: ``add_request`` makes its block hashes, so
``fit_request_overhead`` fits a fixed and a per-prompt-token time to the timed calls (``request_overhead_s``,
``request_overhead_s_per_token``, charged by the replay at each send).

Stdlib only: the measuring is ``engine.measure.measure_engine_steps``.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moetide.perf.calibrate import factors_from_table
from moetide.perf.engines import DEFAULT_ENGINE_PROFILE, engine_efficiency
from moetide.perf.step import Efficiency, StepShape, StepTimeModel
from moetide.specs import HardwareSpec, ModelSpec
from moetide.specs.loader import get_gpu_calibration, is_preset

MIN_EFFICIENCY = 1e-3
FACTORS = ("matmul", "attention", "hbm", "attention_memory")  # the searched Efficiency fields
# the coordinate search's stages: (ratio, span) tries ratio^i x the current value, i in [-span, span]; the first
# stage reaches three decades each way, the next two refine
SEARCH_STAGES = ((10 ** (1 / 4), 12), (10 ** (1 / 16), 4), (10 ** (1 / 64), 4))
SWEEPS = 6  # coordinate sweeps per stage, at most


@dataclass(frozen=True, slots=True)
class StepSample:
    shape: StepShape
    seconds: float  # one whole engine step, wall clock


@dataclass(frozen=True, slots=True)
class StepFit:
    """Fitted factors and the fit's relative error (model / measured - 1) on the steps it was fitted to."""

    matmul: float
    attention: float
    hbm: float
    attention_memory: float
    step_overhead_s: float
    seq_overhead_s: float
    median_abs_rel_error: float
    max_abs_rel_error: float
    request_overhead_s: float = 0.0  # the engine's own cost of taking a request (``fit_request_overhead``)
    request_overhead_s_per_token: float = 0.0

    def efficiency(self) -> Efficiency:
        return Efficiency(**self.table())

    def table(self) -> dict[str, float]:
        """The device file's ``[efficiency]`` table."""
        return {name: getattr(self, name) for name in (*FACTORS, "step_overhead_s", "seq_overhead_s",
                                                       "request_overhead_s", "request_overhead_s_per_token")}


def _roofline_s(samples: Sequence[StepSample], model: ModelSpec, device: HardwareSpec, dtype_bytes: int,
                point: Sequence[float]) -> list[float]:
    eff = Efficiency(**dict(zip(FACTORS, point)), step_overhead_s=0.0, seq_overhead_s=0.0)
    step = StepTimeModel(model, device, dtype_bytes=dtype_bytes, kv_dtype_bytes=dtype_bytes, efficiency=eff)
    return [step.step_time_s(*s.shape.as_args()) for s in samples]


def _kind(shape: StepShape) -> tuple[int, int, int]:
    return shape.num_tokens, shape.num_seqs, shape.kv_tokens_read.bit_length()


def _weights(samples: Sequence[StepSample]) -> list[float]:
    """1 / (steps of the same kind): each kind counts once, however many decode steps repeat it."""
    counts = Counter(_kind(s.shape) for s in samples)
    return [1.0 / counts[_kind(s.shape)] for s in samples]


def _overheads(samples: Sequence[StepSample], roof: Sequence[float],
               weights: Sequence[float]) -> tuple[float, float, float]:
    """(a, b, loss): a, b >= 0 minimising sum w_i ((roof_i + a + b S_i) / t_i - 1)^2, in closed form."""
    rows = [(w, (s.seconds - r) / s.seconds, 1.0 / s.seconds, s.shape.num_seqs / s.seconds)
            for s, r, w in zip(samples, roof, weights)]

    def loss(a: float, b: float) -> float:
        return sum(w * (a * u + b * v - y) ** 2 for w, y, u, v in rows)

    suu = sum(w * u * u for w, _, u, _ in rows)
    svv = sum(w * v * v for w, _, _, v in rows)
    suv = sum(w * u * v for w, _, u, v in rows)
    syu = sum(w * y * u for w, y, u, _ in rows)
    syv = sum(w * y * v for w, y, _, v in rows)
    candidates = [(0.0, 0.0), (max(0.0, syu / suu), 0.0), (0.0, max(0.0, syv / svv))]
    det = suu * svv - suv * suv
    if det > 0:
        a, b = (syu * svv - syv * suv) / det, (syv * suu - syu * suv) / det
        if a >= 0 and b >= 0:
            candidates.append((a, b))
    a, b = min(candidates, key=lambda ab: loss(*ab))
    return a, b, loss(a, b)


def fit_step_efficiency(samples: Sequence[StepSample], model: ModelSpec, device: HardwareSpec,
                        dtype_bytes: int) -> StepFit:
    """The factors of the module docstring; deterministic."""
    if not samples:
        raise ValueError("fit_step_efficiency needs at least one step")

    weights = _weights(samples)
    memo: dict[tuple[float, ...], tuple[float, float, float]] = {}

    def evaluate(point: tuple[float, ...]) -> float:
        if point not in memo:
            memo[point] = _overheads(samples, _roofline_s(samples, model, device, dtype_bytes, point), weights)
        return memo[point][2]

    point = coordinate_search((0.5,) * len(FACTORS), evaluate, [(MIN_EFFICIENCY, 1.0)] * len(FACTORS))
    fixed, per_seq, _ = memo[point]
    roof = _roofline_s(samples, model, device, dtype_bytes, point)
    errors = [abs((r + fixed + per_seq * s.shape.num_seqs) / s.seconds - 1) for s, r in zip(samples, roof)]
    return StepFit(*point, fixed, per_seq, statistics.median(errors), max(errors))


def coordinate_search(start: Sequence[float], evaluate: Callable[[tuple[float, ...]], float],
                      bounds: Sequence[tuple[float, float]]) -> tuple[float, ...]:
    """The point (every coordinate > 0, within its bounds) that ``evaluate`` finds lowest by a search coordinate
    by coordinate on a log scale (``SEARCH_STAGES``); deterministic."""
    point = tuple(start)
    for ratio, span in SEARCH_STAGES:
        for _ in range(SWEEPS):
            before = point
            for axis, (low, high) in enumerate(bounds):
                line = sorted({min(high, max(low, point[axis] * ratio ** i)) for i in range(-span, span + 1)})
                point = min((point[:axis] + (x,) + point[axis + 1:] for x in line), key=evaluate)
            if point == before:
                break
    return point


def fit_request_overhead(requests: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, per prompt token) seconds, both >= 0, by least squares over (prompt tokens, seconds) of timed
    ``Engine.add_request`` calls: the request's block hashes are made there, a cost no step carries."""
    if not requests:
        return 0.0, 0.0
    n = len(requests)
    mean_x = sum(x for x, _ in requests) / n
    mean_y = sum(y for _, y in requests) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in requests)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in requests) / sxx if sxx else 0.0
    slope = max(slope, 0.0)
    fixed = mean_y - slope * mean_x
    if fixed < 0:  # through the origin
        fixed, slope = 0.0, max(sum(x * y for x, y in requests) / max(sum(x * x for x, _ in requests), 1), 0.0)
    return fixed, slope


def step_efficiency_for_gpu(name_or_path: str, engine_profile: str = DEFAULT_ENGINE_PROFILE) -> Efficiency:
    """For a GPU preset, and for a hardware file without an ``[efficiency]`` table (a datasheet written by hand),
    the engine profile's (``perf.engines``: fitted on published measurements), so a file and the preset it copies
    price steps alike; for a device file with the table (``moetide calibrate`` measures a device whole), its values
    over ``Efficiency``'s defaults. ``UserError`` naming the file and field when one is bad."""
    table = {} if is_preset("gpu", name_or_path) else get_gpu_calibration(name_or_path)["efficiency"]
    if not table:
        return engine_efficiency(engine_profile)
    return factors_from_table(Efficiency, table, name_or_path, "efficiency")


# (batch, prompt tokens, output tokens) of the runs an engine's steps are timed on (moetide's engine,
# ``engine.measure.measure_engine_steps``; vLLM, ``vllm.measure``): decode at batch 1-32
# at contexts of 32 to ~2K tokens, prefill chunks of 32-6144 tokens. Not a trace: the replay is judged on traces.
ENGINE_STEP_RUNS = {
    True: ((1, 32, 8), (1, 512, 4), (4, 128, 8), (16, 32, 8), (8, 512, 8)),
    False: ((1, 32, 16), (1, 128, 8), (1, 512, 8), (1, 1024, 8), (2, 32, 16), (4, 32, 16), (4, 256, 16),
            (4, 512, 8), (4, 1024, 8), (8, 32, 16), (8, 128, 16), (8, 256, 8), (8, 512, 16), (16, 32, 16),
            (16, 256, 16), (32, 32, 16), (32, 128, 8), (1, 2048, 16), (4, 1536, 8)),
}
ENGINE_STEP_REPEATS = {True: 1, False: 2}  # each run again after the whole list: a prefill is one step per run


def designed_runs(quick: bool, longest: int, repeats: int | None = None) -> list[tuple[int, int, int]]:
    """The (batch, prompt tokens, output tokens) runs an engine's steps are timed on: an untimed warm-up run, then
    ``ENGINE_STEP_RUNS`` ``repeats`` times over (default ``ENGINE_STEP_REPEATS``); a model whose context is shorter
    than ``longest`` tokens skips the longest prompts."""
    runs = ENGINE_STEP_RUNS[quick] * (ENGINE_STEP_REPEATS[quick] if repeats is None else repeats)
    return [run for run in ((2, 64, 4), *runs) if run[1] + run[2] <= longest]


def vamp_costs_from_device(device: HardwareSpec, efficiency: Efficiency, model: ModelSpec, *, chunk_tokens: int,
                           dtype_bytes: int) -> dict[str, float]:
    """The cost record ``vamp`` is priced by (``core.pressure.step_costs.EngineCosts``' fields) from a measured
    device, as the replay prices the same work: a prefill token at a full chunk's step seconds per token, and a
    staged expert at its bytes over the device's host link."""
    steps = StepTimeModel(model, device, dtype_bytes=dtype_bytes, kv_dtype_bytes=dtype_bytes, efficiency=efficiency)
    chunk = StepShape.prefill(chunk_tokens)
    return {"prefill_s_per_token": steps.step_time_s(*chunk.as_args()) / chunk_tokens,
            "copy_s_per_expert": model.expert_bytes(dtype_bytes) / device.host_link_bandwidth_bytes_per_s}
