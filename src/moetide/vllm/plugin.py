"""vLLM's general plugin entry point (``vllm.general_plugins``): what vLLM cannot be told by a flag.

vLLM loads general plugins in every process it starts (API server, engine core, workers), possibly more than once.
``register`` is idempotent, checks that the installed vLLM is the 0.32 series the seams were written against, and
does nothing when ``MOETIDE_VLLM_DISABLE=1`` or when moetide's connector is not configured (the patches look at
the config they are handed and step aside). It patches what vLLM exposes no seam for:

* **The compile cache's key** (``KVTransferConfig.compute_hash``): with moetide's connector it covers the plugin's
  settings, which decide what the compiled forward holds (``_patch_compile_key``).
* **KV sizing** (engine core, ``kv_cache_utils.get_kv_cache_config_from_groups``): the pool and its backing are
  built for the whole line, the base vLLM sized (less, on CUDA, the backing's spare granules: ``spare_bytes``)
  plus the blocks the offload cap can add (``line_reserve_blocks``).
  The scheduler (``vllm.scheduler``) holds the extra ids out of its free queue until the line grants them. vLLM's
  start-up check that one ``max_model_len`` sequence fits counts the offload cap's bytes too
  (``get_kv_cache_configs``): a sequence longer than the base pool is served once the line has grown for it.
* **KV allocation** (workers, ``allocate_kv_cache`` as ``gpu_model_runner`` imports it): the buffer is a
  ``vllm.backing.CpuBacking`` on the CPU, a ``vllm.vmm_backing.VmmBacking`` on CUDA, whose ids past the base are
  backed only while granted, by the offloaded experts' own memory.
* **Line moves** (workers, ``GPUModelRunner.execute_model``): the step's ``LineOp``s, which arrive in the
  connector's metadata of that step (``vllm.connector``), are applied to the backing and to the expert pager
  (``vllm.pager``: vLLM's unquantized fused-MoE method, replaced through ``CustomOp.register_oot``) first, before
  the runner zeroes the step's new blocks and before the forward. The connector's own hook, ``start_load_kv``,
  runs after the forward when a step loads nothing, too late for a block the step writes.

The scheduler class and the connector are ordinary vLLM options (``--scheduler-cls``, ``--kv-transfer-config``);
``PluginSettings.kv_transfer_config`` and ``moetide serve --engine vllm`` give them.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import os

SUPPORTED = "0.32."
DISABLE_ENV = "MOETIDE_VLLM_DISABLE"
_REGISTERED = False
_EXTRA_BLOCKS: contextvars.ContextVar[int] = contextvars.ContextVar("moetide_extra_blocks", default=0)
_CAP_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("moetide_cap_bytes", default=0)
_RUNNER_CONFIG: contextvars.ContextVar[object | None] = contextvars.ContextVar("moetide_runner_config", default=None)
_ENGINE_CONFIG: contextvars.ContextVar[object | None] = contextvars.ContextVar("moetide_engine_config", default=None)
logger = logging.getLogger(__name__)


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "") not in ("", "0")


def register() -> None:
    """The entry point: apply the patches once per process (module docstring). On a vLLM it was not written
    against, or when disabled, it patches nothing; moetide's scheduler and connector then refuse to start
    (``check_supported``), while vLLM without them runs as installed."""
    global _REGISTERED
    if _REGISTERED or _disabled():
        return
    import vllm

    if not vllm.__version__.startswith(SUPPORTED):
        logger.warning("moetide's vLLM plugin supports vLLM %sx; found %s: not loaded", SUPPORTED, vllm.__version__)
        return
    from moetide.vllm import pager

    pager.register()
    _register_attention()
    _patch_compile_key()
    _patch_sizing()
    _patch_host_blocks()
    _patch_worker()
    _REGISTERED = True


def check_supported() -> None:
    """Raise, in one line, where moetide's scheduler or connector starts in a process the plugin did not patch:
    without the patches the pool would be sized without the line's reserve, and the workers would neither back
    granted blocks nor stage offloaded experts."""
    import vllm

    if not vllm.__version__.startswith(SUPPORTED):
        raise RuntimeError(f"moetide's vLLM plugin supports vLLM {SUPPORTED}x; this is vLLM {vllm.__version__}: "
                           f"leave out --scheduler-cls and --kv-transfer-config")
    if _disabled():
        raise RuntimeError(f"moetide's scheduler or connector is configured, but {DISABLE_ENV}=1 turns its vLLM "
                           f"plugin off: unset it, or leave out --scheduler-cls and --kv-transfer-config")
    if not _REGISTERED:
        raise RuntimeError("moetide's vLLM plugin is not loaded in this process: vLLM loads it from the "
                           "'vllm.general_plugins' entry point (is VLLM_PLUGINS leaving it out?)")


def plugin_settings(vllm_config):
    """The plugin's settings when moetide's connector is configured, else None; parsed once per process for a
    given ``kv_connector_extra_config`` (the sizing, the scheduler, the connector and every MoE layer ask)."""
    from moetide.vllm.settings import CONNECTOR_NAME

    # the sizing patches wrap vLLM functions that vLLM's own tests call with stand-ins for VllmConfig lacking the
    # field: read as no connector, so the wrapped function behaves as vLLM's
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None or transfer.kv_connector != CONNECTOR_NAME:
        return None
    return _parsed_settings(json.dumps(transfer.kv_connector_extra_config, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _parsed_settings(extra_config_json: str):
    from moetide.vllm.settings import PluginSettings

    return PluginSettings.from_extra_config(json.loads(extra_config_json))


def unsupported_mode(policy: str, device_type: str, cuda_graphs: bool, *, pipeline_parallel: int = 1,
                     expert_parallel: bool = False) -> str | None:
    """Why the plugin refuses to start ``policy`` on ``device_type`` (vLLM's platform: ``cpu``, ``cuda``, ...)
    in this mode, in one line that names the flag to change; None where it starts. A policy that offloads experts is
    refused on a platform other than the CPU and CUDA (no KV backing there), with pipeline parallelism (each stage's
    pool would need its own line), with expert parallelism (the pager reads expert ids as the rank's own rows), and
    under CUDA graphs, where the expert pager's per-call path is written to be captured and replayed
    (``vllm.staging``) but has not run on a GPU. On the CPU, eager and compiled forwards both run it."""
    from moetide.core.pressure import policy_entry

    if not policy_entry(policy).offloads_experts:
        return None
    if device_type not in ("cpu", "cuda"):
        return f"moetide: policy {policy!r} offloads experts, which the plugin does on the CPU and CUDA only, " \
               f"not {device_type}: use policy 'vllm'"
    if pipeline_parallel > 1:
        return f"moetide: policy {policy!r} offloads experts, which the plugin does not do under pipeline " \
               f"parallelism: leave out --pipeline-parallel-size, or use policy 'vllm'"
    if expert_parallel:
        return f"moetide: policy {policy!r} offloads experts, which the plugin does not do under expert " \
               f"parallelism: leave out --enable-expert-parallel, or use policy 'vllm'"
    if device_type != "cpu" and cuda_graphs:
        return (f"moetide: policy {policy!r} offloads experts, and its expert pager has not run under CUDA graphs "
                f"yet: add --enforce-eager")
    return None


def refuse_unsupported_mode(vllm_config, settings) -> None:
    """Raise ``ValueError`` with ``unsupported_mode``'s line for this vLLM config (the connector calls it)."""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    cuda_graphs = vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
    parallel = vllm_config.parallel_config
    reason = unsupported_mode(settings.policy, current_platform.device_type, cuda_graphs,
                              pipeline_parallel=parallel.pipeline_parallel_size,
                              expert_parallel=parallel.enable_expert_parallel)
    if reason is not None:
        raise ValueError(reason)


def _settings_and_shape(vllm_config):
    from moetide.vllm.line import model_experts

    settings = plugin_settings(vllm_config)
    return (None, None) if settings is None else (settings, model_experts(settings, vllm_config)[0])


def reserve_blocks(vllm_config, kv_cache_config) -> int:
    """The line's reserve for this config (0 without moetide's connector or for a policy that never offloads)."""
    from moetide.vllm.line import kv_block_bytes, line_reserve_blocks

    settings, shape = _settings_and_shape(vllm_config)
    if settings is None or not kv_cache_config.kv_cache_groups:
        return 0
    return line_reserve_blocks(settings, shape, kv_block_bytes(kv_cache_config))


def spare_bytes(vllm_config, kv_cache_config) -> int:
    """Device memory the KV backing holds from the start for the granules a grant needs beyond its experts' whole
    granules (``vmm_backing.spare_granules``), taken from the base's share where the line moves granules
    (``line_memory``); 0 where it moves pages."""
    from moetide.vllm.line import device_granule

    granule = device_granule(plugin_settings(vllm_config))
    if granule is None:
        return 0
    from moetide.vllm.vmm_backing import spare_granules

    return spare_granules(kv_cache_config.kv_cache_tensors) * granule


def cap_bytes(vllm_config) -> int:
    """Bytes a rank's KV cache can hold beyond vLLM's sizing: the experts the offload cap can give it, or the
    rank's share of the host tier (0 without the plugin)."""
    from moetide.vllm.line import line_reserve_blocks

    settings, shape = _settings_and_shape(vllm_config)
    if settings is None:
        return 0
    return line_reserve_blocks(settings, shape, block_bytes=1) + settings.kv_host_memory // _world_size(vllm_config)


def host_blocks(vllm_config, kv_cache_config) -> int:
    """Block ids the host tier adds after the device's (``vllm.host_tier``; 0 without one)."""
    from moetide.vllm.host_tier import num_host_blocks
    from moetide.vllm.line import kv_block_bytes

    settings = plugin_settings(vllm_config)
    if settings is None or not settings.kv_host_memory or not kv_cache_config.kv_cache_tensors:
        return 0
    return num_host_blocks(settings.kv_host_memory, kv_block_bytes(kv_cache_config), _world_size(vllm_config))


def _world_size(vllm_config) -> int:
    return vllm_config.parallel_config.tensor_parallel_size


def _register_attention() -> None:
    """vLLM's CPU attention, as moetide's subclass that adds the host tier and is vLLM's own without one
    (``vllm.split_attn``), under the name ``CPU_ATTN``: vLLM's CPU platform picks that name whatever is asked."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "moetide.vllm.split_attn.MoetideCPUAttentionBackend")


def _patch_compile_key() -> None:
    """vLLM keys its compiled-graph cache on the config's hash, in which the KV-transfer config counts for nothing
    (``KVTransferConfig.compute_hash``); but moetide's settings decide whether the expert pager's op is in the graph
    and how many staging rows the weights have. Without this, a graph compiled under a policy that offloads
    nothing would be loaded for one that does, and the pager would never run. With moetide's connector the hash
    covers its settings."""
    import hashlib

    from vllm.config.kv_transfer import KVTransferConfig

    from moetide.vllm.settings import CONNECTOR_NAME

    base = KVTransferConfig.compute_hash

    def compute_hash(self) -> str:
        if self.kv_connector != CONNECTOR_NAME:
            return base(self)
        factors = json.dumps([base(self), CONNECTOR_NAME, self.kv_connector_extra_config], sort_keys=True)
        return hashlib.sha256(factors.encode()).hexdigest()

    KVTransferConfig.compute_hash = compute_hash


def _patch_sizing() -> None:
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import core

    from_groups, override = kv_cache_utils.get_kv_cache_config_from_groups, kv_cache_utils.may_override_num_blocks
    configs, check = kv_cache_utils.get_kv_cache_configs, kv_cache_utils._check_enough_kv_cache_memory

    def kv_cache_configs(vllm_config, kv_cache_specs, available_memory):
        token = _CAP_BYTES.set(cap_bytes(vllm_config))
        try:
            return configs(vllm_config, kv_cache_specs, available_memory)
        finally:
            _CAP_BYTES.reset(token)

    def check_enough(available_memory, *args, **kwargs):
        return check(available_memory + _CAP_BYTES.get(), *args, **kwargs)

    def config_from_groups(vllm_config, kv_cache_groups, available_memory):
        config = from_groups(vllm_config, kv_cache_groups, available_memory)
        extra = reserve_blocks(vllm_config, config) if config.kv_cache_tensors else 0
        if not extra:
            return config
        token = _EXTRA_BLOCKS.set(extra)
        try:
            return from_groups(vllm_config, kv_cache_groups, available_memory - spare_bytes(vllm_config, config))
        finally:
            _EXTRA_BLOCKS.reset(token)

    def override_num_blocks(vllm_config, num_blocks):
        return override(vllm_config, num_blocks) + _EXTRA_BLOCKS.get()

    kv_cache_utils.get_kv_cache_config_from_groups = config_from_groups
    kv_cache_utils.may_override_num_blocks = override_num_blocks
    kv_cache_utils.get_kv_cache_configs = core.get_kv_cache_configs = kv_cache_configs  # core imports it by name
    kv_cache_utils._check_enough_kv_cache_memory = check_enough


def _patch_host_blocks() -> None:
    """The host tier's block ids join the scheduler's KV config only (``host_blocks``); the engine's config is
    carried to the scheduler's through a context variable, as vLLM passes it no further."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import core

    scheduler_config = kv_cache_utils.generate_scheduler_kv_cache_config
    initialize = core.EngineCore._initialize_kv_caches

    def initialize_kv_caches(self, vllm_config):
        token = _ENGINE_CONFIG.set(vllm_config)
        try:
            return initialize(self, vllm_config)
        finally:
            _ENGINE_CONFIG.reset(token)

    def scheduler_kv_cache_config(kv_cache_configs):
        config = scheduler_config(kv_cache_configs)
        vllm_config = _ENGINE_CONFIG.get()
        if vllm_config is not None:
            config.num_blocks += host_blocks(vllm_config, config)
        return config

    core.EngineCore._initialize_kv_caches = initialize_kv_caches
    kv_cache_utils.generate_scheduler_kv_cache_config = core.generate_scheduler_kv_cache_config = \
        scheduler_kv_cache_config


def _patch_worker() -> None:
    from vllm.v1.worker import gpu_model_runner

    from moetide.vllm.backing import registered_backing
    from moetide.vllm.connector import MoetideConnectorMetadata
    from moetide.vllm.pager import STEPS, apply_line_op

    allocate = gpu_model_runner.allocate_kv_cache
    runner = gpu_model_runner.GPUModelRunner
    initialize, execute = runner.initialize_kv_cache_tensors, runner.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        metadata, backing = scheduler_output.kv_connector_metadata, registered_backing()
        if isinstance(metadata, MoetideConnectorMetadata):
            for op in metadata.line_ops:
                apply_line_op(op, backing)
            STEPS.begin_step(scheduler_output.total_num_scheduled_tokens)
        return execute(self, scheduler_output, *args, **kwargs)

    def initialize_kv_cache_tensors(self, *args, **kwargs):
        token = _RUNNER_CONFIG.set(self.vllm_config)
        try:
            return initialize(self, *args, **kwargs)
        finally:
            _RUNNER_CONFIG.reset(token)

    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
        vllm_config = _RUNNER_CONFIG.get()
        extra = reserve_blocks(vllm_config, kv_cache_config) if vllm_config is not None else 0
        if not extra or device.type not in ("cpu", "cuda") or not kv_cache_config.kv_cache_tensors:
            kv_caches = allocate(kv_cache_config, device, layout, kernel_block_sizes)
            if vllm_config is not None and host_blocks(vllm_config, kv_cache_config):
                from moetide.vllm import host_tier

                host_tier.install(host_tier.build(vllm_config, plugin_settings(vllm_config), kv_cache_config,
                                                  kv_caches))
            return kv_caches
        return _allocate_on_backing(vllm_config, kv_cache_config, device, layout, kernel_block_sizes, extra)

    gpu_model_runner.allocate_kv_cache = allocate_kv_cache
    runner.initialize_kv_cache_tensors = initialize_kv_cache_tensors
    runner.execute_model = execute_model


def _allocate_on_backing(vllm_config, kv_cache_config, device, layout, kernel_block_sizes, extra: int):
    """vLLM's ``allocate_kv_cache`` over a ``CpuBacking`` or, where the line moves granules (``line_memory``: CUDA,
    or the CPU when asked), a ``vmm_backing.VmmBacking`` on the device memory the expert pager's rows hold; the
    views are built by vLLM's own ``create_kv_cache_views``."""
    import torch
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.worker.utils import create_kv_cache_views

    from moetide.vllm.backing import CpuBacking, install
    from moetide.vllm.line_memory import device_memory
    from moetide.vllm.pager import check_every_layer_paged

    check_every_layer_paged(vllm_config)
    tensors = kv_cache_config.kv_cache_tensors
    num_blocks = kv_cache_config.num_blocks
    sizes = dict(num_base_blocks=num_blocks - extra, num_blocks=num_blocks)
    memory = device_memory(plugin_settings(vllm_config), device)
    if memory is not None:
        from moetide.vllm.vmm_backing import VmmBacking

        backing = VmmBacking(tensors[0].size, tensors, memory[0], **sizes)
    else:
        backing = CpuBacking(tensors[0].size, tensors, **sizes)
    install(backing)
    kv_caches: dict[str, torch.Tensor] = {}
    for tensor in tensors:
        layer_name = tensor.layers[0]
        group_id, group = next((i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups)
                               if layer_name in g.layer_names)
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[layer_name]
        if not spec.has_layer_views:
            kv_caches.update((name, backing.buffer) for name in tensor.layers)
            continue
        kernel_block_size = kernel_block_sizes[group_id] if kernel_block_sizes and group_id < len(
            kernel_block_sizes) else None
        views = create_kv_cache_views(backing.buffer, spec, kv_cache_config.num_blocks_of(tensor), layout, tensor,
                                      kernel_block_size=kernel_block_size)
        kv_caches.update(zip(tensor.layers, views))
    return kv_caches
