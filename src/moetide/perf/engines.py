"""Engine efficiency profiles: the step model's ``Efficiency`` for a serving engine, chosen by name.

Engines differ in what the roofline cannot see (CUDA graphs, kernel generations, host-side scheduling), so each
profile is a table of ``Efficiency`` fields in ``engines.toml`` beside this file, fitted on published GPU
measurements (``benchmarks/published_gpu.py --fit``; the points, their sources and the fit and check errors are in
docs/perf.md). ``roofline`` is ``Efficiency``'s own defaults, the model before any fit. The replay's GPU presets use
``DEFAULT_ENGINE_PROFILE``; a device file's ``[efficiency]`` table (``moetide calibrate``) replaces it.
"""

from __future__ import annotations

import tomllib
from functools import cache
from pathlib import Path

from moetide.errors import UserError
from moetide.perf.calibrate import factors_from_table
from moetide.perf.efficiency import Efficiency

PROFILES_PATH = Path(__file__).with_name("engines.toml")
DEFAULT_ENGINE_PROFILE = "vllm-0.32"
DESCRIBING_KEYS = ("about", "fitted_on")  # what a profile says of itself, beside its fields


@cache
def _profiles() -> dict[str, dict]:
    with PROFILES_PATH.open("rb") as f:
        return tomllib.load(f)


def engine_profiles() -> list[str]:
    return sorted(_profiles())


def engine_efficiency(name: str = DEFAULT_ENGINE_PROFILE) -> Efficiency:
    """The named profile's ``Efficiency``; ``UserError`` listing the profiles for an unknown name."""
    table = _profiles().get(name)
    if table is None:
        raise UserError(f"unknown engine profile {name!r}; profiles: {', '.join(engine_profiles())}")
    fields = {k: v for k, v in table.items() if k not in DESCRIBING_KEYS}
    return factors_from_table(Efficiency, fields, str(PROFILES_PATH), name)
