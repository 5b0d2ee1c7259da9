"""Drive vLLM's real v1 ``Scheduler`` step by step with no model, stock or with moetide's plugin.

Why: the fidelity benchmark and the plugin's differential tests compare vLLM's scheduling with moetide's core,
step by step. Re-implementing vLLM's rules would only test our reading of them, so this module builds the real
``Scheduler`` + ``KVCacheManager`` + ``BlockPool`` the way vLLM's own tests do (``create_scheduler`` in
tests/v1/core/utils.py), then loops ``schedule()`` -> fake ``ModelRunnerOutput`` -> ``update_from_output()``.
With ``VllmSideConfig.plugin`` the scheduler is moetide's (``vllm.scheduler``) with its connector configured as
``vllm serve`` would configure it, and the pool is built with the line's reserve beyond ``num_blocks``.

Import it only where vLLM is installed. In-process: the ``Scheduler`` is built directly, so no engine core or
worker processes. It runs on vLLM 0.32, which the plugin serves, and on the series whose scheduler-side seams
``moetide.vllm.versions`` covers (0.33, 0.34): there moetide's scheduler starts only inside
``scheduler_side_only()`` (scripts/vllm_versions_check.sh), since the plugin refuses those series in production.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import math
import os
import shutil
import tempfile
import functools
from dataclasses import dataclass
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# vLLM's logger reads its level when first imported; set only for that, so that vLLM servers a test session starts
# after this import keep their own INFO log
_QUIET_IMPORT = "VLLM_LOGGING_LEVEL" not in os.environ
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from moetide.vllm import plugin, versions  # noqa: E402
from moetide.vllm.line import LineStep, kv_block_bytes, line_reserve_blocks  # noqa: E402
from moetide.vllm.plugin import register  # noqa: E402
from moetide.vllm.scheduler import MoetideScheduler  # noqa: E402
from moetide.vllm.settings import SCHEDULER_CLS, PluginSettings  # noqa: E402

if _QUIET_IMPORT:
    del os.environ["VLLM_LOGGING_LEVEL"]

# Where each series keeps what the harness builds a side from (paths under vllm/; docs/vllm_plugin/versions.md).
_KV_CACHE_GROUPS_MODULE = versions.for_series("get_kv_cache_groups", {
    ("0.32",): "vllm.v1.core.kv_cache_utils",
    ("0.33", "0.34"): "vllm.v1.core.kv_cache_planning",  # the KV planning moved out of kv_cache_utils
})
get_kv_cache_groups = importlib.import_module(_KV_CACHE_GROUPS_MODULE).get_kv_cache_groups
# ModelRunnerOutput.req_id_to_index (0.34 dropped it: the runner's order is req_ids')
_OUTPUT_HAS_INDEX = versions.for_series("ModelRunnerOutput", {("0.32", "0.33"): True, ("0.34",): False})
# CachedRequestData.resumed_req_ids (0.34 dropped it: a resumed request is scheduled as a new one)
_RESUMED_AS_CACHED = versions.for_series("CachedRequestData", {("0.32", "0.33"): True, ("0.34",): False})


@contextlib.contextmanager
def scheduler_side_only():
    """Within: moetide's scheduler and connector start on a vLLM series the plugin refuses but whose
    scheduler-side seams ``versions`` covers, for no-model checks of the scheduler alone (the version gate,
    ``plugin.check_supported``, passes; the engine patches, written for 0.32, stay unapplied: nothing here runs a
    model). A harness option only, never a setting: in production those series stay refused. On a series the
    plugin serves it changes nothing."""
    import vllm

    versions.require_scheduler_side()
    if vllm.__version__.startswith(plugin.SUPPORTED):
        yield
        return
    saved = plugin.SUPPORTED, plugin._REGISTERED
    plugin.SUPPORTED, plugin._REGISTERED = vllm.__version__, True
    try:
        yield
    finally:
        plugin.SUPPORTED, plugin._REGISTERED = saved


@dataclass
class HybridSpec:
    """A Qwen3-Next-shaped KV cache: full-attention layers + Gated DeltaNet layers.

    Defaults are Qwen3-Next-80B-A3B (48 layers, every 4th full attention; 2 KV
    heads x 256; GDN 16 key / 32 value heads of 128, conv kernel 4, bf16
    states). Byte sizes only matter for vLLM's page-size unification; the
    scheduler sees block counts. ``attention_block_size=None`` applies vLLM's
    ``Platform._align_hybrid_block_size`` rule (smallest multiple of the
    16-token kernel block whose attention page >= the mamba page: 544 here, at
    TP 1 or 2). ``mamba_block_size=None``: 'align' -> the attention block size,
    'none' -> max_model_len (``MambaModelConfig``). ``mamba_cache_mode=None``:
    what vLLM resolves ('align' with prefix caching, else 'none'); 'none' with
    prefix caching is refused: vLLM flips it to 'align', and forced it asserts.
    """
    num_attention_layers: int = 12
    num_mamba_layers: int = 36
    mamba_cache_mode: str | None = None  # vLLM 0.32 values: 'none' | 'align'
    attention_block_size: int | None = None
    mamba_block_size: int | None = None
    tp_size: int = 1
    num_kv_heads: int = 2
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    dtype: torch.dtype = torch.bfloat16

    def mamba_shapes(self) -> tuple[tuple[int, ...], ...]:
        """GDN (conv state, ssm state) per TP rank, as gated_delta_net_state_shape."""
        conv_dim = (self.linear_key_head_dim * self.linear_num_key_heads * 2
                    + self.linear_value_head_dim * self.linear_num_value_heads)
        return ((conv_dim // self.tp_size, self.linear_conv_kernel_dim - 1),
                (self.linear_num_value_heads // self.tp_size,
                 self.linear_value_head_dim, self.linear_key_head_dim))


@dataclass
class VllmSideConfig:
    """What the baseline varies. ``num_blocks`` includes vLLM's null block 0."""
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072  # set it from the longest prompt + max_tokens
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    scheduler_reserve_full_isl: bool = True  # vLLM 0.32's default
    watermark: float = 0.0  # vLLM 0.32's default (off)
    hash_algo: str = "sha256"  # vLLM's default; xxhash is faster but not installed
    hybrid: HybridSpec | None = None  # None: one full-attention group
    retention_interval: int | str | None = "default"  # prefix_cache_retention_interval: "default" is vLLM's (0)
    plugin: PluginSettings | None = None  # moetide's scheduler and connector with these settings (experts given)
    async_scheduling: bool = False  # vLLM's AsyncScheduler (moetide's: MoetideAsyncScheduler), as on a GPU


@dataclass
class StepRecord:
    scheduled: dict[str, int]  # vLLM's num_scheduled_tokens, in vLLM's order
    preempted: list[str]  # in the order vLLM preempted them
    new_hits: dict[str, int]  # new/resumed this step: num_computed_tokens at admission
    # Per request, per KV cache group: for new/resumed requests vLLM hands the
    # worker the whole block table (prefix-hit blocks first, then new ones);
    # for running ones only the blocks allocated this step.
    new_block_ids: dict[str, list[list[int]]]
    finished: list[str]
    num_free_blocks: int
    num_scheduled: int = 0  # sum(scheduled.values())
    num_evicted: int = 0  # cached blocks evicted this step: by vLLM's allocations, plus the plugin's policy's
    line: LineStep | None = None  # with the plugin: what moetide's policy did this step
    line_ops: tuple = ()  # with the plugin: the line moves this step's connector metadata carries to the workers


@functools.lru_cache(maxsize=None)
def _tiny_model_dir(max_model_len: int) -> str:
    """A config-only llama folder: ModelConfig needs a config, never weights.

    The Scheduler reads no hybrid flag from ModelConfig (it reads
    ``kv_cache_config.has_mamba_layers`` and ``cache_config.mamba_cache_mode``),
    so a plain llama config serves the hybrid case too."""
    d = tempfile.mkdtemp(prefix="moetide_vllm_harness_")
    atexit.register(shutil.rmtree, d, True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 32000,
           "max_position_embeddings": max_model_len,
           "torch_dtype": "bfloat16"}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def _hybrid_layer_specs(h: HybridSpec, cfg: VllmSideConfig, mode: str) -> dict:
    """Per-layer specs; pages padded equal so vLLM's grouping keeps our block sizes."""
    kv_heads = max(1, h.num_kv_heads // h.tp_size)  # KV heads replicate past TP 2
    attn_1tok = 2 * kv_heads * h.head_dim * h.dtype.itemsize
    shapes = h.mamba_shapes()
    mamba_page = sum(math.prod(s) for s in shapes) * h.dtype.itemsize
    attn_bs = h.attention_block_size or 16 * math.ceil(mamba_page / (16 * attn_1tok))
    mamba_bs = h.mamba_block_size or (attn_bs if mode == "align" else cfg.max_model_len)
    page = max(attn_bs * attn_1tok, mamba_page)
    attn = FullAttentionSpec(block_size=attn_bs, num_kv_heads=kv_heads,
                             head_size=h.head_dim, dtype=h.dtype, page_size_padded=page)
    mamba = MambaSpec(block_size=mamba_bs, shapes=shapes, dtypes=(h.dtype, h.dtype),
                      page_size_padded=page, mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
                      mamba_cache_mode=mode)
    n = h.num_attention_layers + h.num_mamba_layers
    every = max(1, n // max(1, h.num_attention_layers))  # Qwen3-Next: every 4th layer
    specs, n_attn = {}, 0
    for i in range(n):
        if (i + 1) % every == 0 and n_attn < h.num_attention_layers:
            specs[f"model.layers.{i}.self_attn.attn"] = attn
            n_attn += 1
        else:
            specs[f"model.layers.{i}.linear_attn"] = mamba
    return specs


def _queue_head(block_pool, n: int):
    """The first ``n`` blocks of vLLM's free queue (those ``get_new_blocks(n)`` takes)."""
    block = block_pool.free_block_queue.fake_free_list_head.next_free_block
    for _ in range(n):
        yield block
        block = block.next_free_block


def _vllm_config(cfg: VllmSideConfig) -> tuple[VllmConfig, str]:
    """vLLM's config for the side (with moetide's scheduler and connector where ``cfg.plugin`` is set) and the
    hybrid model's mamba cache mode."""
    h = cfg.hybrid
    mode = "none"
    if h is not None:
        mode = h.mamba_cache_mode or ("align" if cfg.enable_prefix_caching else "none")
        if mode == "none" and cfg.enable_prefix_caching:  # MambaModelConfig flips it;
            raise ValueError("vLLM 0.32 runs mamba_cache_mode 'none' only without "
                             "prefix caching (its hybrid coordinator asserts)")
    model_config = ModelConfig(model=_tiny_model_dir(max(cfg.max_model_len, 1 << 20)),
                               skip_tokenizer_init=True, dtype="bfloat16",
                               max_model_len=cfg.max_model_len, seed=0)
    sched_config = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len, is_encoder_decoder=False,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        enable_chunked_prefill=True, async_scheduling=False,
        scheduler_reserve_full_isl=cfg.scheduler_reserve_full_isl,
        watermark=cfg.watermark, scheduler_cls=None if cfg.plugin is None else SCHEDULER_CLS)
    cache_config = CacheConfig(block_size=cfg.block_size,
                               enable_prefix_caching=cfg.enable_prefix_caching,
                               prefix_caching_hash_algo=cfg.hash_algo,
                               mamba_cache_mode=mode)
    if cfg.plugin is not None:  # moetide's scheduler starts only where the plugin is loaded, as vLLM loads it
        register()
    transfer = None if cfg.plugin is None else KVTransferConfig(**cfg.plugin.kv_transfer_config())
    vc = VllmConfig(model_config=model_config, scheduler_config=sched_config,
                    cache_config=cache_config, kv_transfer_config=transfer)
    # what vLLM decides on a GPU (the CPU platform's hook turns async scheduling off, and nothing here runs a model)
    vc.scheduler_config.async_scheduling = cfg.async_scheduling
    # The CPU platform's config hooks must not have changed what we compare.
    s, c = vc.scheduler_config, vc.cache_config
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.enable_chunked_prefill,
            s.long_prefill_token_threshold, c.enable_prefix_caching) == (
        cfg.max_num_seqs, cfg.max_num_batched_tokens, True,
        cfg.long_prefill_token_threshold, cfg.enable_prefix_caching), (s, c)
    return vc, mode


def _kv_cache_groups(cfg: VllmSideConfig, vc: VllmConfig, mode: str) -> list:
    if cfg.hybrid is None:
        # Qwen3-30B-A3B's attention (48 layers, 4 KV heads of 128, bf16): the scheduler sees block counts only,
        # the plugin's line prices a block by these bytes
        return [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(48)], FullAttentionSpec(
            block_size=cfg.block_size, num_kv_heads=4, head_size=128, dtype=torch.bfloat16))]
    c = vc.cache_config  # pages are equal, so the layout (normally the engine's pick) is moot
    c.kv_cache_layout = c.kv_cache_layout or "LBNHC"
    return get_kv_cache_groups(vc, _hybrid_layer_specs(cfg.hybrid, cfg, mode))


class VllmSide:
    """One real vLLM Scheduler, advanced one step per ``step()`` call."""

    def __init__(self, cfg: VllmSideConfig):
        self.cfg = cfg
        vc, mode = _vllm_config(cfg)
        groups = _kv_cache_groups(cfg, vc, mode)
        # one block's bytes over every layer (what the line prices a block at)
        self.block_bytes = kv_block_bytes(KVCacheConfig(num_blocks=cfg.num_blocks, kv_cache_tensors=[],
                                                        kv_cache_groups=groups))
        kv_cfg = self._kv_cache_config(vc, groups)
        sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cfg, vc)
        kv_cfg.hash_block_size = hash_bs
        self.scheduler_block_size, self.hash_block_size = sched_bs, hash_bs
        scheduler_cls = MoetideScheduler if cfg.plugin is not None else (
            AsyncScheduler if cfg.async_scheduling else Scheduler)
        self.sched = scheduler_cls(vllm_config=vc, kv_cache_config=kv_cfg,
                                   structured_output_manager=StructuredOutputManager(vc),
                                   block_size=sched_bs, hash_block_size=hash_bs, log_stats=False)
        self.group_kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        self.group_block_sizes = [g.kv_cache_spec.block_size for g in groups]
        self.mamba_cache_mode = mode if cfg.hybrid is not None else None
        self._hasher = None
        if cfg.enable_prefix_caching:  # as EngineCore does
            hash_fn = get_hash_fn_by_name(cfg.hash_algo)
            init_none_hash(hash_fn)
            self._hasher = get_request_block_hasher(hash_bs, hash_fn)
        self._arrival = 0
        self._record_preemptions()
        self._count_implicit_evictions()

    def _kv_cache_config(self, vc, groups) -> KVCacheConfig:
        """The KV cache config ``EngineCore`` would build (with the plugin's reserve, as its engine patch adds it),
        and the cache config fields it sets after profiling."""
        cfg, c = self.cfg, vc.cache_config
        num_blocks = cfg.num_blocks
        if cfg.plugin is not None:  # what the plugin's engine patch adds: the line's reserve
            if cfg.plugin.experts is None:
                raise ValueError("VllmSideConfig.plugin needs its experts' shape: the driver loads no model")
            num_blocks += line_reserve_blocks(cfg.plugin, cfg.plugin.experts, self.block_bytes)
        # get_kv_cache_config_from_groups copies the cache config's retention interval (0 by default in 0.32:
        # keep only the replay boundary's and junctions' states); None keeps every state (dense)
        kv_cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                               prefix_cache_retention_interval=(c.prefix_cache_retention_interval if
                                                                cfg.retention_interval == "default"
                                                                else cfg.retention_interval))
        c.num_gpu_blocks = num_blocks
        c.block_size = min(g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable)
        if cfg.hybrid is not None:
            c.mamba_block_size = next(g.kv_cache_spec.block_size for g in groups
                                      if isinstance(g.kv_cache_spec, MambaSpec))
        return kv_cfg

    def _record_preemptions(self) -> None:
        """vLLM's victims, in the order it preempts them."""
        self._preempted_order: list[str] = []
        real_preempt = self.sched._preempt_request

        def preempt(request, *args, **kwargs):
            self._preempted_order.append(request.request_id)
            return real_preempt(request, *args, **kwargs)
        self.sched._preempt_request = preempt

    def _count_implicit_evictions(self) -> None:
        """Cached blocks vLLM's pool evicts as it allocates (the plugin's policy evicts before, so none there)."""
        self.num_implicit_evictions = 0
        block_pool = self.sched.kv_cache_manager.block_pool
        real_get_new_blocks = block_pool.get_new_blocks

        def get_new_blocks(num_blocks):
            cached = sum(1 for b in _queue_head(block_pool, num_blocks) if b.block_hash is not None
                         or b.block_id in block_pool.cached_block_hashes_by_block)
            self.num_implicit_evictions += cached
            return real_get_new_blocks(num_blocks)
        block_pool.get_new_blocks = get_new_blocks

    def add_request(self, request_id: str, prompt_token_ids: list[int], max_tokens: int) -> None:
        """Exactly ``max_tokens`` outputs: ignore_eos and no stop tokens."""
        self._arrival += 1
        req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                      sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      pooling_params=None, arrival_time=float(self._arrival),
                      block_hasher=self._hasher)
        self.sched.add_request(req)

    def step(self, sampled_token: Callable[[str, int], int]) -> StepRecord:
        """schedule() -> one token for each request whose prompt is done -> update."""
        self._preempted_order = []
        implicit = self.num_implicit_evictions
        so = self.sched.schedule()
        scheduled = dict(so.num_scheduled_tokens)
        new_hits: dict[str, int] = {}
        new_blocks: dict[str, list[list[int]]] = {}
        for nr in so.scheduled_new_reqs:
            new_hits[nr.req_id] = nr.num_computed_tokens
            new_blocks[nr.req_id] = [list(b) for b in nr.block_ids]
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            if _RESUMED_AS_CACHED and rid in cr.resumed_req_ids:
                new_hits[rid] = cr.num_computed_tokens[i]
            if cr.new_block_ids[i] is not None:
                new_blocks[rid] = [list(b) for b in cr.new_block_ids[i]]
        requests = self.sched.requests
        sampled = []
        for rid in scheduled:  # num_computed_tokens is already advanced here
            r = requests[rid]
            sampled.append([sampled_token(rid, r.num_output_tokens)]
                           if r.num_computed_tokens >= r.num_tokens else [])
        index = {"req_id_to_index": {rid: i for i, rid in enumerate(scheduled)}} if _OUTPUT_HAS_INDEX else {}
        out = ModelRunnerOutput(req_ids=list(scheduled), sampled_token_ids=sampled, **index)
        eco = self.sched.update_from_output(so, out)
        finished = [o.request_id for outs in eco.values() for o in outs.outputs
                    if o.finish_reason is not None]
        preempted = self._preempted_order
        assert set(preempted) == set(so.preempted_req_ids or ()), (preempted, so.preempted_req_ids)
        return StepRecord(scheduled=scheduled, preempted=list(preempted), new_hits=new_hits,
                          new_block_ids=new_blocks, finished=finished,
                          num_free_blocks=self.sched.kv_cache_manager.block_pool.get_num_free_blocks(),
                          num_scheduled=so.total_num_scheduled_tokens,
                          num_evicted=self.num_implicit_evictions - implicit + (
                              self.sched.moetide.step.num_evicted if self.cfg.plugin is not None else 0),
                          line=self.sched.moetide.step if self.cfg.plugin is not None else None,
                          line_ops=so.kv_connector_metadata.line_ops if self.cfg.plugin is not None else ())

    @property
    def has_work(self) -> bool:
        return self.sched.get_num_unfinished_requests() > 0

    def check(self) -> None:
        """Pool accounting and the budgets; O(num_blocks), so call it sparingly."""
        pool = self.sched.kv_cache_manager.block_pool
        in_use = sum(1 for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)
        if self.cfg.plugin is None:
            assert in_use + pool.get_num_free_blocks() == self.cfg.num_blocks - 1, in_use
        else:
            moetide_pool = self.sched.moetide.pool
            moetide_pool.check_invariants()
            assert (in_use + pool.get_num_free_blocks() + moetide_pool.num_drained_blocks
                    == pool.num_gpu_blocks - 1), in_use
        assert len(self.sched.running) <= self.cfg.max_num_seqs
        for r in self.sched.running:
            assert r.num_computed_tokens <= r.num_tokens, r.request_id

