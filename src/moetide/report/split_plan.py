"""The text table and the plot of ``moetide plan-split``, made from its JSON document alone (what ``--json``
writes), so a saved document renders the same as the run that made it."""

from __future__ import annotations

from moetide.report.tables import format_table
from moetide.units import GiB

SHORT = {"writescope": "ws", "transfer-all": "xfer-all", "cpu-all": "cpu-all", "request-split": "req-split",
         "fixed-ratio": "fixed", "solidattention": "Solid", "scoutattention": "Scout", "hybridgen": "HybridGen",
         "fastdecode": "FastDecode", "monolithic": "monolithic"}


def _fmt_tokens(n: int) -> str:
    """``8k``, ``1M``; a count that is neither, with separators."""
    for suffix, unit in (("M", 1024**2), ("k", 1024)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return f"{n:,}"


def _rates_line(rates: dict) -> str:
    return (f"CPU attention {rates['cpu_attention_gb_per_s']:,.1f} GB/s of KV ({rates['cpu_attention_bound']}-bound, "
            f"{rates['flop_per_kv_byte']:.1f} FLOP per KV byte); host link {rates['link_gb_per_s']:,.1f} GB/s; "
            f"device attention {rates['device_attention_gb_per_s']:,.0f} GB/s")


def text(doc: dict) -> str:
    policies, ours, named_baselines = doc["policies"], doc["baselines"], doc["named_baselines"]
    head = (f"{doc['model']} on {doc['gpu']} + {doc['cpu']} ({doc['cpu_model']}), VRAM budget "
            f"{doc['vram_gib']:g} GiB; fixed-ratio = {doc['fixed_ratio']:.2f}, CPU slowdown {doc['cpu_slowdown']:g}; "
            f"host experts: {doc['host_experts']}, KV prefetch {'on' if doc['kv_prefetch'] else 'off'}; sparse "
            f"baselines attend {doc['sparse_density']:g} of host KV (lossy)\n{doc['note']}\n"
            f"{_rates_line(doc['rates'])}")
    layout = format_table(["VRAM", "bytes"], doc["vram_layout"], align="<<")
    headers = ["context", "batch", "host KV GiB", "CPU share", *(SHORT.get(p, p) for p in policies),
               "vs best", "vs named"]
    body = []
    for r in doc["rows"]:
        t = r["step_time_s"]
        best, named = min(t[b] for b in ours), min(t[b] for b in named_baselines)
        body.append([_fmt_tokens(r["context"]), r["batch"], f"{r['host_kv_bytes'] / GiB:,.1f}",
                     f"{r['cpu_share']:.3f}", *(f"{t[p] * 1e3:,.1f}" for p in policies),
                     f"{best / t['writescope']:.2f}x", f"{named / t['writescope']:.2f}x"])
    parts = [head, layout, "Decode step time, ms (end to end)\n" + format_table(headers, body)]
    attention = doc["attention_phase"] or {}
    e2e = {"geomean_speedup": doc["geomean_speedup"],
           "over_all_baselines": doc["geomean_speedup_over_all_baselines"],
           "over_best_baseline": doc["geomean_speedup_over_best_baseline"],
           "over_all_named_baselines": doc["geomean_speedup_over_all_named_baselines"],
           "over_best_named_baseline": doc["geomean_speedup_over_best_named_baseline"]}
    for label, g in (("end to end", e2e), ("attention phase only", attention)):
        per = g.get("geomean_speedup")
        if per is None:
            parts.append(f"geomean speedup ({label}): no context >= 8k")
            continue
        over_ours = ", ".join(f"{b} {per[b]:.2f}x" for b in ours)
        named = ", ".join(f"{b} {per[b]:.2f}x" for b in (*named_baselines, "monolithic"))
        parts.append(f"writescope geomean speedup, contexts >= 8k ({label}):\n  ours: {over_ours}; over the best "
                     f"{g['over_best_baseline']:.2f}x\n  the paper's: {named}; over the best named "
                     f"{g['over_best_named_baseline']:.2f}x, over all four {g['over_all_named_baselines']:.2f}x")
    return "\n\n".join(parts)


def plot(doc: dict, path: str) -> None:
    from moetide.report.plots import require_matplotlib, save_figure

    plt = require_matplotlib()
    import matplotlib.ticker
    rows = doc["rows"]
    x = [r["context"] for r in rows]
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    for p in doc["policies"]:
        ax_t.plot(x, [r["step_time_s"][p] * 1e3 for r in rows], marker="o", label=p,
                  linestyle="--" if p in doc["named_baselines"] or p == "monolithic" else "-")
    ax_s.plot(x, [r["cpu_share"] for r in rows], marker="o", color="black")
    for ax, label in ((ax_t, "modeled decode step (ms)"), (ax_s, "writescope CPU share of host KV")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [_fmt_tokens(c) for c in x])
        ax.minorticks_off()
        ax.set_xlabel("context tokens per sequence")
        ax.set_ylabel(label)
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax_t.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax_t.legend(fontsize=7, ncol=2)
    ax_s.set_ylim(0, 1)
    fig.suptitle(f"{doc['model']} on {doc['gpu']} + {doc['cpu']}, {doc['vram_gib']:g} GiB VRAM (MODELED)")
    fig.tight_layout()
    save_figure(fig, path)
