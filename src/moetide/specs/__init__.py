"""Model and hardware facts: frozen dataclasses, preset data files, and readers for users' own files.

The bottom layer of moetide: it imports nothing from the rest of the package except ``errors``, and nothing
outside the standard library, so ``perf``, ``core`` and the CLI can use it without torch.
"""

from moetide.specs.hardware import HardwareSpec, HostSpec
from moetide.specs.loader import (
    all_gpus,
    all_hosts,
    all_models,
    get_gpu,
    get_host,
    get_model,
    host_for,
    model_preset_hf_config,
    preset_names,
)
from moetide.specs.model import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    LinearAttentionSpec,
    MLASpec,
    ModelSpec,
)

__all__ = [
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "HardwareSpec",
    "HostSpec",
    "LinearAttentionSpec",
    "MLASpec",
    "ModelSpec",
    "all_gpus",
    "all_hosts",
    "all_models",
    "get_gpu",
    "get_host",
    "get_model",
    "host_for",
    "model_preset_hf_config",
    "preset_names",
]
