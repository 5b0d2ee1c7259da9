"""Workloads: recorded traces (Mooncake JSONL, WEKA agent sessions, Azure CSV) and a built-in session generator.

Everything here is stdlib-only and deterministic: a reader or the generator given the same file, arguments and
seed returns an equal ``Workload``. The data model is in ``base``; what the block keys mean, the subsets, and the
generator's defaults (with the measurements they come from) are in docs/workloads.md.
"""

from moetide.workloads.base import NO_KEYS, BlockKeys, Session, Turn, Workload
from moetide.workloads.generator import GeneratorConfig, LogNormal, generate_agent_sessions
from moetide.workloads.registry import READERS, TraceReader, load_workload, select, sniff_format

__all__ = [
    "NO_KEYS",
    "READERS",
    "BlockKeys",
    "GeneratorConfig",
    "LogNormal",
    "Session",
    "TraceReader",
    "Turn",
    "Workload",
    "generate_agent_sessions",
    "load_workload",
    "select",
    "sniff_format",
]
