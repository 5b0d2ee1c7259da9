"""The plugin's own scheduler cost with the line still: vLLM 0.32's v1 scheduler, stock against moetide's plugin.

What: for each of the fidelity benchmark's configurations (``benchmarks/vllm_fidelity.py``: its requests, KV
budgets and scheduler limits), vLLM's real scheduler runs the same requests with no model, driven step by step by
``moetide_testing.vllm_differential.run_side`` over ``vllm_harness.VllmSide``, on four sides:

* ``stock``: vLLM's ``Scheduler``, on the config's KV budget;
* ``vllm``: ``MoetideScheduler`` and its connector under ``policy: vllm`` (vLLM's own decisions; no line), on the
  same budget;
* ``vamp``: the same under ``policy: vamp`` (the fidelity benchmark's experts, cost record and 5 s horizon) with
  nothing to do: on the budget of the config family's roomy configuration, where the line does not move. Every
  side reports its ``line_moves``; a config where ``vamp`` moved it says ``line_still: false``;
* ``stock-still``: stock on ``vamp``'s budget, where that is not the config's own (the tight configs).

Each plugin side is compared with stock on its own budget: ``vllm`` with ``stock``, ``vamp`` with ``stock-still``
(or ``stock`` where the budgets are the same).

Why: issue 57's goal is a plugin scheduler costing at most 3% more CPU per step than stock's. With no model the
steps are deterministic, so what varies is only the clock.

The clock: this thread's CPU time (``time.thread_time_ns``) around each ``schedule()`` and ``update_from_output()``
call, nothing else (the machine is shared; wall time would count other work). The harness's eviction counter (a
walk of the free queue at every allocation) is taken off, so the time is vLLM's and the plugin's. Garbage is
collected before each run; Python's collector still runs inside the timed calls when their allocations trigger
it, which is their cost. A round runs every side once, the order rotated by one each round.

Prints JSON lines. Per (config, side): steps timed, CPU µs per step (each round's mean over its steps: median, min,
max over rounds, and every round's), the per-step median, µs per step in each call, line moves, preemptions. Per
config: each plugin side over its stock, the median of per-round paired ratios with their min and max. Then one
overall line: the geometric mean of the configs' median ratios, and the min and max of the per-round geometric
means. ``--combine FILE...`` prints the overall line of saved runs' config lines instead. ``--profile vllm|vamp``
instead samples that side and its stock (``Sampler``) and prints, per config, where the extra CPU goes. Needs
vLLM 0.32 and ../shared/traces; from the project root:

    nice .venv/bin/python benchmarks/vllm_scheduler_cost.py [--configs mooncake-roomy,...] [--repeats 3]
    nice .venv/bin/python benchmarks/vllm_scheduler_cost.py --profile vllm --configs weka-tight --repeats 3
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import math
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import vllm  # noqa: E402
import vllm_fidelity as fidelity  # noqa: E402
from moetide_testing.vllm_differential import compare, run_side, sampled_token, vllm_record  # noqa: E402
from moetide_testing.vllm_harness import HybridSpec, VllmSide, VllmSideConfig  # noqa: E402

GOAL = 1.03  # issue 57: the plugin's scheduler CPU per step at most 3% over stock's
VAMP = fidelity.PolicyArgs("vamp", 5.0, fidelity.COSTS)  # the fidelity benchmark's defaults
# side -> (scheduler, KV budget): the config's "own", or "still" (its family's roomy config's)
SIDES = {"stock": ("stock", "own"), "vllm": ("vllm", "own"), "vamp": ("vamp", "still"),
         "stock-still": ("stock", "still")}
PAIRS = {"vllm": "stock", "vamp": "stock-still"}  # each plugin side against stock on the same budget


def fidelity_config(name: str) -> tuple[list, dict]:
    """The fidelity benchmark's configuration ``name``: its sessions and ``compare``'s arguments with every default
    filled in, read by running its table entry with ``run`` caught (so the table stays the fidelity benchmark's)."""
    caught: dict = {}

    def catch(_name, sessions, _policy, **kwargs):
        caught.update(sessions=sessions, kwargs=kwargs)

    saved, fidelity.run = fidelity.run, catch
    try:
        fidelity.CONFIGS[name](VAMP)
    finally:
        fidelity.run = saved
    bound = inspect.signature(compare).bind(name, caught["sessions"], **caught["kwargs"])
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    return arguments.pop("sessions"), arguments


def budgets(name: str, arguments: dict) -> dict[str, int]:
    """Each side's KV budget. The still one is the fidelity benchmark's number for the roomy config of the same
    family (mooncake, weka, hybrid); ``stock-still`` runs only where it is not the config's own."""
    own = arguments["num_blocks"]
    family = name.split("-")[0] + "-roomy"
    still = own if family == name else fidelity_config(family)[1]["num_blocks"]
    out = {side: own if budget == "own" else still for side, (_, budget) in SIDES.items()}
    if still == own:
        del out["stock-still"]
    return out


def side_config(scheduler: str, num_blocks: int, sessions: list, a: dict) -> VllmSideConfig:
    """The harness's config for one side, as ``compare`` builds its vLLM side from the same arguments."""
    plugin = None
    if scheduler != "stock":
        plugin = dataclasses.replace(VAMP.settings(a["hybrid"]), policy=scheduler)
    longest = max(len(x.prompt) + x.max_tokens for s in sessions for x in s)
    return VllmSideConfig(num_blocks=num_blocks, block_size=a["block_size"], max_num_seqs=a["max_num_seqs"],
                          max_num_batched_tokens=a["max_num_batched_tokens"], max_model_len=longest + 16,
                          long_prefill_token_threshold=a["threshold"],
                          scheduler_reserve_full_isl=a["reserve_full_isl"],
                          hybrid=HybridSpec() if a["hybrid"] else None,
                          retention_interval=a["retention_interval"] if a["hybrid"] else "default", plugin=plugin)


class Sampler:
    """Where the scheduler's CPU time goes, without cProfile's per-call overhead (which inflates code made of many
    small calls): every ``interval_s`` of this process's CPU (``ITIMER_PROF``; the kernel may tick coarser, 4 ms
    on this project's machine, hence several rounds), the Python stack is read if a timed call is running; each sample counts once for its innermost function (own time, builtins included in
    their caller) and once for every function on the stack (inclusive time). Keys are file:function."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s, self.active, self.samples = interval_s, False, 0
        self.own: Counter[str] = Counter()
        self.inclusive: Counter[str] = Counter()

    def _sample(self, _signum, frame) -> None:
        if not self.active:
            return
        self.samples += 1
        keys = []
        while frame is not None:
            path = frame.f_code.co_filename
            where = path.split("site-packages/")[-1].split("/src/")[-1] if "/" in path else path
            keys.append(f"{Path(where).name if where == path else where}:{frame.f_code.co_name}")
            frame = frame.f_back
        self.own[keys[0]] += 1
        self.inclusive.update(set(keys))

    def __enter__(self) -> Sampler:
        signal.signal(signal.SIGPROF, self._sample)
        signal.setitimer(signal.ITIMER_PROF, self.interval_s, self.interval_s)
        return self

    def __exit__(self, *_exc) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, signal.SIG_DFL)


class Meter:
    """This thread's CPU ns inside the wrapped calls, summed per step; with a ``Sampler``, sampling only there."""

    def __init__(self, sampler: Sampler | None = None) -> None:
        self.step_ns: list[int] = []
        self.call_ns = {"schedule": 0, "update_from_output": 0}
        self.sampler, self._step = sampler, 0

    def wrap(self, name: str, call):
        clock, sampler = time.thread_time_ns, self.sampler or Sampler()

        def timed(*args, **kwargs):
            sampler.active = True
            start = clock()
            try:
                return call(*args, **kwargs)
            finally:
                spent = clock() - start
                sampler.active = False
                self._step += spent
                self.call_ns[name] += spent
        return timed

    def step(self, side: VllmSide):
        """One harness step, its two timed calls' CPU recorded as one step's."""
        self._step = 0
        record = side.step(sampled_token)
        self.step_ns.append(self._step)
        return record


def timed_side(cfg: VllmSideConfig, sampler: Sampler | None = None) -> tuple[VllmSide, Meter]:
    """A harness side whose scheduler calls are timed, the harness's eviction counter taken off (``VllmSide``
    wraps ``get_new_blocks`` on the pool instance; vLLM's own method is the class's)."""
    side = VllmSide(cfg)
    pool = side.sched.kv_cache_manager.block_pool
    counter = vars(pool).get("get_new_blocks")
    if counter is not None and counter.__qualname__.startswith("VllmSide."):
        del pool.get_new_blocks
    meter = Meter(sampler)
    sched = side.sched
    sched.schedule = meter.wrap("schedule", sched.schedule)
    sched.update_from_output = meter.wrap("update_from_output", sched.update_from_output)
    return side, meter


def measure(scheduler: str, num_blocks: int, sessions: list, arguments: dict, max_steps: int | None = None,
            sampler: Sampler | None = None) -> dict:
    """One run of one side over a config's requests: per-step CPU ns of the scheduler calls, and what it did."""
    side, meter = timed_side(side_config(scheduler, num_blocks, sessions, arguments), sampler)
    gc.collect()
    stats = run_side(side, sessions, meter.step, vllm_record, max_steps or arguments["max_steps"])
    books = getattr(side.sched, "moetide", None)
    return {"steps": len(meter.step_ns), "loop_steps": stats.steps, "cpu_ns": sum(meter.step_ns),
            "median_step_ns": statistics.median(meter.step_ns) if meter.step_ns else 0,
            "call_ns": dict(meter.call_ns), "preemptions": stats.preemptions,
            "line_moves": books.num_line_moves if books is not None else 0}


def run_rounds(name: str, repeats: int, max_steps: int | None = None) -> tuple[dict[str, list[dict]], dict]:
    """``repeats`` rounds of every side on config ``name``, the side order rotated by one each round; the runs
    per side, and each side's budget."""
    sessions, arguments = fidelity_config(name)
    blocks = budgets(name, arguments)
    order = list(blocks)
    runs: dict[str, list[dict]] = {side: [] for side in order}
    for r in range(repeats):
        for side in order[r % len(order):] + order[: r % len(order)]:
            runs[side].append(measure(SIDES[side][0], blocks[side], sessions, arguments, max_steps))
    return runs, blocks


def per_step_us(run: dict) -> float:
    return run["cpu_ns"] / max(run["steps"], 1) / 1000


def spread(values: list[float], digits: int) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "rounds": [round(v, digits) for v in values]}


def side_line(name: str, side: str, runs: list[dict], num_blocks: int) -> dict:
    """The JSON line of one (config, side)."""
    steps = sorted({r["steps"] for r in runs})
    calls = {k: round(statistics.median(r["call_ns"][k] / max(r["steps"], 1) / 1000 for r in runs), 2)
             for k in runs[0]["call_ns"]}
    return {"config": name, "side": side, "num_blocks": num_blocks, "repeats": len(runs),
            "steps": steps[0] if len(steps) == 1 else steps, "loop_steps": runs[0]["loop_steps"],
            "cpu_us_per_step": spread([per_step_us(r) for r in runs], 2),
            "median_step_us": round(statistics.median(r["median_step_ns"] for r in runs) / 1000, 2),
            "call_us_per_step": calls, "cpu_s": round(statistics.median(r["cpu_ns"] for r in runs) / 1e9, 3),
            "preemptions": runs[0]["preemptions"], "line_moves": max(r["line_moves"] for r in runs)}


def summary_line(name: str, lines: dict[str, dict]) -> dict:
    """The JSON line of one config from its side lines: each plugin side over stock on the same budget (per-round
    paired ratios), and whether ``vamp``'s line stayed still."""
    out: dict = {"config": name, "summary": True}
    for side, base in PAIRS.items():
        base = base if base in lines else "stock"
        mine, theirs = lines[side], lines[base]
        ratios = [a / b for a, b in zip(mine["cpu_us_per_step"]["rounds"], theirs["cpu_us_per_step"]["rounds"])]
        out[f"{side}_over_stock"] = spread(ratios, 4)
        out[f"{side}_within_goal"] = out[f"{side}_over_stock"]["median"] <= GOAL
        out[f"{side}_same_steps_as_stock"] = mine["steps"] == theirs["steps"]
    out["line_moves"] = lines["vamp"]["line_moves"] + lines["vllm"]["line_moves"]
    out["line_still"] = out["line_moves"] == 0
    return out


def overall_line(summaries: list[dict]) -> dict:
    """The configs' summaries together: the geometric mean of their median ratios, and the min and max over
    rounds of the per-round geometric means (round r of every config together)."""
    geomean = lambda xs: math.exp(statistics.fmean(math.log(x) for x in xs))  # noqa: E731
    out: dict = {"overall": True, "vllm": vllm.__version__, "configs": [s["config"] for s in summaries]}
    for side in PAIRS:
        ratios = [s[f"{side}_over_stock"] for s in summaries]
        rounds = [geomean(r["rounds"][i] for r in ratios) for i in range(min(len(r["rounds"]) for r in ratios))]
        out[f"{side}_over_stock"] = {"geomean": round(geomean(r["median"] for r in ratios), 4),
                                     "round_min": round(min(rounds), 4), "round_max": round(max(rounds), 4)}
        out[f"{side}_configs_over_goal"] = [s["config"] for s in summaries if not s[f"{side}_within_goal"]]
    out["line_moves"] = sum(s["line_moves"] for s in summaries)
    return out


def config_lines(name: str, repeats: int, max_steps: int | None = None) -> list[dict]:
    """Measure config ``name``: its side lines, then its summary line."""
    runs, blocks = run_rounds(name, repeats, max_steps)
    lines = {side: side_line(name, side, runs[side], blocks[side]) for side in runs}
    return list(lines.values()) + [summary_line(name, lines)]


def profile_side(name: str, side: str, repeats: int, top: int) -> dict:
    """Where a plugin side's extra CPU goes: it and stock on the same budget, ``repeats`` rounds each, sampled
    (``Sampler``); per file:function, its own CPU µs per step on the plugin side less stock's, as a share of the
    plugin side's CPU (the ``top`` largest), and the plugin's own functions (src/moetide/) by inclusive share."""
    sessions, arguments = fidelity_config(name)
    blocks = budgets(name, arguments)
    base = PAIRS[side] if PAIRS[side] in blocks else "stock"
    samplers, runs = {side: Sampler(), base: Sampler()}, {side: [], base: []}
    for r in range(repeats):
        for run in (side, base) if r % 2 == 0 else (base, side):
            with samplers[run]:
                runs[run].append(measure(SIDES[run][0], blocks[run], sessions, arguments, sampler=samplers[run]))
    per_step = {run: sum(x["cpu_ns"] for x in rs) / sum(x["steps"] for x in rs) / 1000 for run, rs in runs.items()}

    def us(run: str, counts: Counter, key: str) -> float:  # a key's CPU µs per step, from its share of samples
        return per_step[run] * counts[key] / max(samplers[run].samples, 1)

    mine, theirs = samplers[side], samplers[base]
    delta = {k: us(side, mine.own, k) - us(base, theirs.own, k) for k in set(mine.own) | set(theirs.own)}
    pct = lambda v: round(100 * v / per_step[side], 2)  # noqa: E731
    ours = [k for k in mine.inclusive if k.startswith("moetide/")]
    return {"config": name, "side": side, "against": base, "profile": True, "samples": mine.samples,
            "cpu_us_per_step": round(per_step[side], 2), "stock_cpu_us_per_step": round(per_step[base], 2),
            "extra_pct": pct(per_step[side] - per_step[base]),
            "extra_own_pct": {k: pct(v) for k, v in sorted(delta.items(), key=lambda kv: -kv[1])[:top]},
            "moetide_inclusive_pct": {k: pct(us(side, mine.inclusive, k))
                                      for k in sorted(ours, key=lambda k: -mine.inclusive[k])[:top]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(fidelity.CONFIGS),
                        help="comma-separated: " + ", ".join(fidelity.CONFIGS))
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every side per config")
    parser.add_argument("--profile", choices=list(PAIRS), help="instead: where this side's extra CPU over stock goes")
    parser.add_argument("--top", type=int, default=25, help="with --profile: functions listed")
    parser.add_argument("--combine", nargs="+", metavar="FILE", help="instead: the overall line of saved runs")
    args = parser.parse_args()
    if args.combine:
        lines = [json.loads(x) for f in args.combine for x in Path(f).read_text().splitlines() if x.strip()]
        print(json.dumps(overall_line([x for x in lines if x.get("summary")])))
        return
    names = args.configs.split(",")
    unknown = [n for n in names if n not in fidelity.CONFIGS]
    if unknown or args.repeats < 1:
        parser.error(f"unknown configs: {', '.join(unknown)}" if unknown else "--repeats must be at least 1")
    summaries = []
    for name in names:
        if args.profile:
            print(json.dumps(profile_side(name, args.profile, args.repeats, args.top)), flush=True)
            continue
        for line in config_lines(name, args.repeats):
            print(json.dumps(line), flush=True)
        summaries.append(line)
    if summaries:
        print(json.dumps(overall_line(summaries)), flush=True)


if __name__ == "__main__":
    main()
