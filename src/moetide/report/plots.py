"""Plots of replays: TTFT and TPOT CDFs, throughput, KV usage over time, one line or bar pair per run.

matplotlib is an optional extra (``pip install -e '.[plot]'``); it is imported here only, with the Agg backend,
and its absence is one clear error that verbs raise before a run (``require_matplotlib``), not after it.
Runs are told apart by colour and by line style, and a run whose curve equals an earlier run's says so in the
legend: identical policies would otherwise hide each other. The time axis is in the unit its length calls for.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from moetide.errors import UserError
from moetide.report.units import duration_unit
from moetide.sim.metrics import MetricsCollector

LINE_STYLES = ("-", "--", "-.", ":")


def require_matplotlib():
    """pyplot on the Agg backend, or a ``UserError`` saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    return plt


def save_figure(fig, path: str | Path, dpi: float | None = None) -> None:
    """Write the figure and close it; a path that cannot be written is one ``UserError`` naming ``--plot``."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        raise UserError(f"--plot {path}: cannot write: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    ordered = sorted(values)
    return ordered, [(i + 1) / len(ordered) for i in range(len(ordered))]


def _labels(runs: Mapping[str, tuple[dict, MetricsCollector]]) -> dict[str, str]:
    """Each run's legend label; ``"b (same as a)"`` where b's TTFTs and KV usage equal a's."""
    labels, seen = {}, {}
    for name, (_, metrics) in runs.items():
        key = (tuple(metrics.ttft), tuple(metrics.kv_usage))
        labels[name] = f"{name} (same as {seen[key]})" if key in seen else name
        seen.setdefault(key, name)
    return labels


def _throughput(ax, runs: Mapping[str, tuple[dict, MetricsCollector]]) -> None:
    """Requests per second of the replay and per busy second of the accelerator, side by side per run."""
    names = list(runs)
    width = 0.38
    for offset, key, label in ((-width / 2, "request_throughput_per_s", "per second"),
                               (width / 2, "requests_per_busy_s", "per busy second")):
        values = [_value(runs[n][0]["metrics"], key) for n in names]
        bars = ax.bar([i + offset for i in range(len(names))], values, width, label=label)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set(ylabel="completed requests (modeled)", title="request throughput")
    ax.legend(fontsize=8)


def _value(m: dict, key: str) -> float:
    """A throughput figure; requests per busy second computed where the run did not record it (one replay)."""
    if key in m:
        return m[key]
    return m["completed"] / m["busy_s"] if m.get("busy_s") else 0.0


def plot_runs(runs: Mapping[str, tuple[dict, MetricsCollector]], path: Path) -> None:
    """One figure comparing runs (a single run is a comparison of one)."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax_cdf, ax_bar, ax_tpot, ax_line = axes.flat
    ax_preempt = ax_line.twinx()
    labels = _labels(runs)
    end_s = max((t for _, (_, m) in runs.items() for t, _ in m.offload_usage), default=0.0)
    divisor, unit = duration_unit(end_s)
    for index, (name, (_, metrics)) in enumerate(runs.items()):
        style = LINE_STYLES[index % len(LINE_STYLES)]
        if metrics.ttft:
            ax_cdf.plot(*_cdf(metrics.ttft), ls=style, label=labels[name])
        if metrics.tpot:
            ax_tpot.plot(*_cdf(metrics.tpot), ls=style, label=labels[name])
        color = f"C{index}"
        if metrics.offload_usage:  # the line: expert bytes given to the KV cache, on their own scale
            ax_line.plot([t / divisor for t, _ in metrics.offload_usage],
                         [100 * r for _, r in metrics.offload_usage], ls="-", color=color,
                         label=f"{labels[name]}: expert bytes given to KV")
        if metrics.preemption_usage:
            ax_preempt.plot([t / divisor for t, _ in metrics.preemption_usage],
                            [n for _, n in metrics.preemption_usage], ls=":", lw=1.2, color=color,
                            marker=".", markevery=max(len(metrics.preemption_usage) // 12, 1),
                            label=f"{labels[name]}: preemptions so far")
    _throughput(ax_bar, runs)
    ax_cdf.set(xscale="log", xlabel="TTFT (s, modeled)", ylabel="share of requests", title="TTFT CDF")
    ax_tpot.set(xscale="log", xlabel="TPOT (s, modeled)", ylabel="share of requests", title="TPOT CDF")
    top = max((100 * r for _, (_, m) in runs.items() for _, r in m.offload_usage), default=0.0)
    ax_line.set(xlabel=f"simulated time ({unit})", ylabel="expert bytes given to the KV cache (%)",
                title="the line moving (solid, left) and preemptions (dotted, right)", ylim=(0, max(top * 1.25, 1)))
    ax_preempt.set(ylabel="preemptions so far")
    ax_preempt.set_ylim(bottom=0)
    for ax in (ax_cdf, ax_tpot):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_line.grid(alpha=0.3)
    handles = [h for ax in (ax_line, ax_preempt) for h in ax.get_legend_handles_labels()[0]]
    ax_line.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="center right")
    first = next(iter(runs.values()))[0]["config"]
    fig.suptitle(f"{first['workload']['name']} | {first['model']} on {first['tp']} x {first['gpu']} (modeled)")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
