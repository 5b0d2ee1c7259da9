"""Plots of replays: TTFT CDF, TPOT, throughput and KV usage over time, one line or bar per run.

matplotlib is an optional extra (``pip install -e '.[plot]'``); it is imported here only, with the Agg backend,
and its absence is one clear error.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from moetide.errors import UserError
from moetide.sim.metrics import MetricsCollector


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install -e '.[plot]'") from None
    return plt


def plot_runs(runs: Mapping[str, tuple[dict, MetricsCollector]], path: Path) -> None:
    """One figure comparing runs (a single run is a comparison of one)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax_cdf, ax_bar, ax_tpot, ax_kv = axes.flat
    for name, (result, metrics) in runs.items():
        ttft = sorted(metrics.ttft)
        if ttft:
            ax_cdf.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
        if metrics.kv_usage:
            line, = ax_kv.plot([t for t, _ in metrics.kv_usage], [u for _, u in metrics.kv_usage], label=name)
            if any(r for _, r in metrics.offload_usage):  # the line's other side: experts offloaded to host
                ax_kv.plot([t for t, _ in metrics.offload_usage], [r for _, r in metrics.offload_usage], ls="--",
                           color=line.get_color(), label=f"{name}: offloaded expert share")
        tpot = sorted(metrics.tpot)
        if tpot:
            ax_tpot.plot(tpot, [(i + 1) / len(tpot) for i in range(len(tpot))], label=name)
    names = list(runs)
    ax_bar.bar(names, [runs[n][0]["metrics"]["request_throughput_per_s"] for n in names])
    ax_cdf.set(xscale="log", xlabel="TTFT (s, modeled)", ylabel="share of requests", title="TTFT CDF")
    ax_tpot.set(xscale="log", xlabel="TPOT (s, modeled)", ylabel="share of requests", title="TPOT CDF")
    ax_bar.set(ylabel="requests / s (modeled)", title="request throughput")
    ax_kv.set(xlabel="simulated time (s)", ylabel="used share of KV blocks", title="KV usage and offloaded experts", ylim=(0, 1.05))
    for ax in (ax_cdf, ax_tpot, ax_kv):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    first = next(iter(runs.values()))[0]["config"]
    fig.suptitle(f"{first['workload']['name']} | {first['model']} on {first['tp']} x {first['gpu']} (modeled)")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UserError(f"{path}: cannot write plot: {exc.strerror}") from None
    finally:
        plt.close(fig)
