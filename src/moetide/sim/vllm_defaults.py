"""The vLLM a replay's baseline follows: its serving defaults per GPU, the defaults of the version chosen
(``ReplayConfig.vllm_version``), and a hybrid model's states under its ``mamba_cache_mode``
(docs/vllm_baseline.md)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from moetide.core.blocks import BlockPool
from moetide.core.mamba_states import MambaStates
from moetide.errors import UserError
from moetide.perf import MemoryBudget, default_block_size
from moetide.specs import HardwareSpec, ModelSpec

if TYPE_CHECKING:
    from moetide.sim.host_kv import HostKV
    from moetide.sim.setup import ReplayConfig

MAMBA_CACHE_MODES = ("align", "none")
VLLM_VERSIONS = ("0.32", "0.15")


def vllm_defaults(config: ReplayConfig, model: ModelSpec) -> ReplayConfig:
    """The options a user left unset, as the chosen vLLM sets them. 0.32: full-sequence admission and prefix
    caching on. 0.15 (vLLM 0.15.1, the VAMP paper's base): first-chunk admission, the threshold on every chunk,
    prefix caching off for hybrid models (``ModelConfig``: ``if attn_type == "hybrid": return False``) and, when
    asked for, every state kept."""
    old = config.vllm_version == "0.15"
    hybrid = model.linear_attention is not None
    caching = config.enable_prefix_caching if config.enable_prefix_caching is not None else not (old and hybrid)
    if hybrid and caching and config.mamba_cache_mode == "none":
        raise UserError("--mamba-cache-mode none keeps no state to hit: vLLM turns it into align with prefix "
                        "caching; give --no-prefix-caching with it")
    full_isl = config.scheduler_reserve_full_isl if config.scheduler_reserve_full_isl is not None else not old
    retention = None if old else config.prefix_cache_retention_interval
    return replace(config, enable_prefix_caching=caching, scheduler_reserve_full_isl=full_isl,
                   prefix_cache_retention_interval=retention)


SSM_CACHE_DTYPES = {"auto": None, "float32": 4}  # vLLM's mamba_ssm_cache_dtype -> the recurrent state's bytes


def ssm_bytes(config: ReplayConfig) -> int | None:
    """The recurrent state's element size under ``mamba_ssm_cache_dtype`` (None: the model's dtype)."""
    return SSM_CACHE_DTYPES[config.mamba_ssm_cache_dtype]


def mamba_states(model: ModelSpec, config: ReplayConfig, pool: BlockPool, budget: MemoryBudget,
                 host_kv: HostKV | None) -> MambaStates | None:
    """A hybrid model's states as vLLM 0.32 caches them with prefix caching ("align"), one pool block per
    linear-attention group per state; None for other models and for "none"."""
    if not budget.state_blocks_per_request or not config.enable_prefix_caching:
        return None
    if config.mamba_cache_mode == "none":
        return None
    aligned = default_block_size(model, tp=config.tp, ssm_dtype_bytes=ssm_bytes(config))
    if config.block_size != aligned:
        raise UserError(f"--block-size {config.block_size}: in mamba_cache_mode align a state fills one block, which "
                        f"vLLM's block size for {model.name} ({aligned}) ensures; "
                        "leave --block-size out, or give --no-prefix-caching")
    if host_kv is not None:
        raise UserError("a host KV tier beside a hybrid model's cached states is not modeled: give "
                        "--no-prefix-caching with --kv-host-memory")
    return MambaStates(pool, config.block_size, budget.state_blocks_per_request,
                       retention_interval=config.prefix_cache_retention_interval)


def vllm_serving_defaults(gpu: HardwareSpec) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` that vLLM 0.32's OpenAI server picks on this GPU
    (``EngineArgs.get_batch_defaults``, vllm/engine/arg_utils.py): the GPU's own where its spec gives them (the
    A100 presets: vLLM excepts the A100 from the 70 GiB tier, PR #17885), else by memory: 16,384 and 1,024 from
    160 GiB; 8,192 and 1,024 from 70 GiB; else 2,048 and 256."""
    if gpu.max_num_batched_tokens:
        return gpu.max_num_batched_tokens, gpu.max_num_seqs
    if gpu.hbm_bytes >= 160 * 2**30:
        return 16384, 1024
    if gpu.hbm_bytes >= 70 * 2**30:
        return 8192, 1024
    return 2048, 256
