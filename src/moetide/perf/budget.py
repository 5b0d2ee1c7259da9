"""Memory budget per GPU: what the weights take, what is left for the KV cache, and how many blocks that makes.

Invariant: every figure is bytes *per GPU* under tensor parallelism ``tp``, laid out as vLLM lays it out, and the
budget is the one vLLM computes before it allocates its KV pool:

    kv_budget = gpu_memory_utilization x HBM - weights_per_gpu - activation_reserve

or, when the user gives one (vLLM's ``--kv-cache-memory``; here ``kv_cache_memory``, bytes), that figure, which
must then
fit beside the weights and the reserve in the whole HBM (vLLM ignores the utilization cap when given a size).

Weights per GPU (``weights_per_gpu``). Column/row-parallel layers are split ``tp`` ways: attention projections,
Gated DeltaNet projections, dense MLPs, shared experts, every routed expert (vLLM's default for MoE is tensor
parallelism *inside* each expert, not expert parallelism), the embedding and the LM head (vocab-parallel).
Replicated on every GPU: RMSNorm weights, routers and shared-expert gates (vLLM builds them as
``ReplicatedLinear``), MLA's ``kv_a_proj_with_mqa``/``q_a_proj`` and their norms, and the K/V projections when
``num_kv_heads < tp`` (each GPU then holds one KV head: ``kv_heads_per_gpu = ceil(num_kv_heads / tp)``).

KV per GPU (``kv_bytes_per_token_per_gpu``): full-attention layers only; ``2 x kv_heads_per_gpu x head_dim`` per
layer and token, so KV heads are *replicated*, not split, when ``num_kv_heads < tp``. MLA's latent (kv_lora_rank
+ qk_rope_head_dim) is not split by heads at all: every GPU keeps the whole latent.

Blocks. A block is ``block_size`` tokens over all full-attention layers of one GPU. Hybrid models (Qwen3-Next's
linear-attention layers) also keep a fixed state per running sequence (conv + recurrent state, split ``tp`` ways
by heads); as in vLLM's hybrid allocator it is carved from the same pool:
``state_blocks_per_request = ceil(state_bytes_per_gpu / block_bytes)``. vLLM makes the two page sizes equal by
raising the attention block size (``_align_hybrid_block_size`` in vllm/platforms/interface.py logs "Setting
attention block size to N tokens to ensure that attention page size is >= mamba page size"):
``N = a x ceil(mamba_page / (a x attn_page_1_token))`` with a = 16 (the attention kernels' block alignment),
mamba_page = one linear-attention layer's state on one GPU, attn_page_1_token = one full-attention layer's KV
for one token on one GPU. ``default_block_size`` applies that rule (Qwen3-Next-80B-A3B: 544 tokens at TP=1 and
2, 272 at TP=4) and 16, vLLM's default, for other models; a user's ``--block-size`` wins. With any block size
the state takes ``state_blocks_per_request`` whole blocks, which charges the same bytes. Prefix caching for hybrid models needs the state at every cached block
boundary (vLLM's ``mamba_cache_mode``); ``state_checkpoints=True`` models that by charging every block
``block_bytes + state_bytes``, which with small blocks cuts the pool by orders of magnitude — that is the point of
showing it.

``UserError`` for a budget that cannot work (weights do not fit, a user KV budget that does not fit, a pool too
small for one request); ``ValueError`` for arguments out of range.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetide.errors import UserError
from moetide.specs import LINEAR_ATTENTION, HardwareSpec, ModelSpec
from moetide.units import cdiv

GiB = 2**30
DEFAULT_BLOCK_SIZE = 16  # vLLM's default block_size
VLLM_KERNEL_BLOCK_ALIGNMENT = 16  # vLLM: attention kernels take blocks in multiples of 16 (hybrid block size rounding)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default gpu_memory_utilization
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM v1's default token budget for online serving
# Activation reserve (vLLM subtracts the peak memory of a profiling forward pass of max_num_batched_tokens).
# Per token: ACTIVATION_HIDDEN_COPIES hidden-width tensors live at the peak (residual, normed input, attention
# output, q/k/v and their projections' outputs, MoE combine), plus the fused-MoE kernel's three intermediate
# buffers, top_k x (2I gate/up + I activated + hidden down-projected).
ACTIVATION_HIDDEN_COPIES = 8
# Fixed: CUDA-graph pools (vLLM >= 0.21 logs "Estimated CUDA graph memory: 0.52 GiB" for Qwen3-8B), the sampler's
# fp32 logits for max_num_seqs rows (256 x 151936 x 4 B = 0.14 GiB), NCCL and cuBLAS workspaces.
RUNTIME_RESERVE_BYTES = 1 * GiB




def check_tp(model: ModelSpec, tp: int) -> None:
    """vLLM's sharding rules: heads split evenly; KV heads split evenly or replicated evenly."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if model.num_attention_heads % tp:
        raise ValueError(f"tp={tp} does not divide num_attention_heads ({model.num_attention_heads}) of "
                         f"{model.name}; tensor parallelism splits attention heads evenly")
    kv = model.num_kv_heads
    if model.mla is None and kv % tp and tp % kv:
        raise ValueError(f"tp={tp} and num_kv_heads ({kv}) of {model.name}: one must divide the other")
    la = model.linear_attention
    if la is not None and (la.num_key_heads % tp or la.num_value_heads % tp):
        raise ValueError(f"tp={tp} does not divide the linear-attention heads ({la.num_key_heads} key, "
                         f"{la.num_value_heads} value) of {model.name}")


def kv_heads_per_gpu(model: ModelSpec, tp: int = 1) -> int:
    """KV heads each GPU holds: split when num_kv_heads >= tp, else one (replicated tp / num_kv_heads times)."""
    return cdiv(model.num_kv_heads, tp)


# ---- weights ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightsPerGpu:
    """Weight bytes one GPU holds. ``layer_bytes`` is everything per layer except routed experts (attention or
    linear attention, norms, routers, shared experts, dense MLPs) plus the final norm."""

    tp: int
    dtype_bytes: int
    embedding_bytes: int
    lm_head_bytes: int  # 0 when tied: the LM head reuses the embedding
    layer_bytes: int
    expert_shard_bytes: int  # this GPU's 1/tp of one routed expert (gate, up, down)
    num_routed_experts: int  # over all MoE layers

    @property
    def routed_expert_bytes(self) -> int:
        return self.expert_shard_bytes * self.num_routed_experts

    @property
    def lm_head_read_bytes(self) -> int:
        """What computing logits reads: the LM head, or the embedding when tied."""
        return self.lm_head_bytes or self.embedding_bytes

    @property
    def total_bytes(self) -> int:
        return self.embedding_bytes + self.lm_head_bytes + self.layer_bytes + self.routed_expert_bytes


def _attention_params_per_gpu(model: ModelSpec, layer_id: int, tp: int) -> int:
    total, h = model.attention_params(layer_id), model.hidden_size
    if model.layer_types[layer_id] == LINEAR_ATTENTION:
        return cdiv(total, tp)
    if model.mla is not None:
        m = model.mla
        replicated = h * m.kv_cache_dim + m.kv_lora_rank  # kv_a_proj_with_mqa + kv_a_layernorm
        if m.q_lora_rank is not None:
            replicated += h * m.q_lora_rank + m.q_lora_rank  # q_a_proj + q_a_layernorm
        return cdiv(total - replicated, tp) + replicated
    kv_proj = 2 * h * model.num_kv_heads * model.head_dim
    qk_norm = 2 * model.head_dim if model.qk_norm else 0
    kv_proj_per_gpu = 2 * h * kv_heads_per_gpu(model, tp) * model.head_dim
    return cdiv(total - kv_proj - qk_norm, tp) + kv_proj_per_gpu + qk_norm


def _mlp_params_per_gpu(model: ModelSpec, layer_id: int, tp: int) -> int:
    h = model.hidden_size
    if layer_id in model.dense_mlp_layer_ids:
        return cdiv(3 * h * model.intermediate_size, tp)
    shared = model.num_shared_experts * 3 * h * model.shared_expert_intermediate_size
    replicated = model.num_experts * h + (h if model.shared_expert_gate else 0)  # router, shared-expert gate
    return cdiv(shared, tp) + replicated


def weights_per_gpu(model: ModelSpec, *, tp: int = 1, dtype_bytes: int = 2) -> WeightsPerGpu:
    """Weight bytes per GPU under tensor parallelism ``tp`` (module docstring: what is split, what is not)."""
    check_tp(model, tp)
    h = model.hidden_size
    layer_params = h + sum(2 * h + _attention_params_per_gpu(model, i, tp) + _mlp_params_per_gpu(model, i, tp)
                           for i in range(model.num_layers))  # final norm + per layer (two norms, mixer, MLP)
    embedding = cdiv(model.vocab_size, tp) * h
    return WeightsPerGpu(
        tp=tp, dtype_bytes=dtype_bytes, embedding_bytes=embedding * dtype_bytes,
        lm_head_bytes=0 if model.tie_word_embeddings else embedding * dtype_bytes,
        layer_bytes=layer_params * dtype_bytes,
        expert_shard_bytes=cdiv(model.params_per_expert, tp) * dtype_bytes,
        num_routed_experts=model.num_moe_layers * model.num_experts)


# ---- KV and state -----------------------------------------------------------------------------------------


def kv_bytes_per_token_per_gpu(model: ModelSpec, *, tp: int = 1, kv_dtype_bytes: int = 2) -> int:
    """KV bytes one token adds on one GPU, over full-attention layers (MLA: the whole latent on every GPU)."""
    if model.mla is not None:
        per_layer = model.mla.kv_cache_dim
    else:
        per_layer = 2 * kv_heads_per_gpu(model, tp) * model.head_dim
    return len(model.full_attention_layer_ids) * per_layer * kv_dtype_bytes


def state_bytes_per_seq_per_gpu(model: ModelSpec, *, tp: int = 1, state_dtype_bytes: int = 2,
                                ssm_dtype_bytes: int | None = None) -> int:
    """Linear-attention state (conv + recurrent; the recurrent part at ``ssm_dtype_bytes`` when given) of one
    sequence on one GPU: split tp ways by heads; 0 if none."""
    return cdiv(model.linear_state_bytes_per_seq(state_dtype_bytes, ssm_dtype_bytes), tp)


def hybrid_block_size(model: ModelSpec, *, tp: int = 1, kv_dtype_bytes: int = 2, state_dtype_bytes: int = 2,
                      ssm_dtype_bytes: int | None = None, alignment: int = VLLM_KERNEL_BLOCK_ALIGNMENT) -> int | None:
    """The attention block size vLLM picks for a hybrid model so one attention page holds one linear-attention
    layer's state (its ``_align_hybrid_block_size``, mamba_cache_mode none/align); None for other models."""
    num_linear = len(model.linear_attention_layer_ids) if model.linear_attention is not None else 0
    if not num_linear or model.mla is not None:
        return None
    mamba_page = state_bytes_per_seq_per_gpu(model, tp=tp, state_dtype_bytes=state_dtype_bytes,
                                             ssm_dtype_bytes=ssm_dtype_bytes) // num_linear
    attn_page_1_token = 2 * kv_heads_per_gpu(model, tp) * model.head_dim * kv_dtype_bytes
    return page_aligned_block_size(mamba_page, attn_page_1_token, alignment)


def page_aligned_block_size(state_bytes: int, kv_bytes_per_token: int,
                            alignment: int = VLLM_KERNEL_BLOCK_ALIGNMENT) -> int:
    """The fewest multiples of ``alignment`` tokens whose KV page (``kv_bytes_per_token`` a token) holds
    ``state_bytes``: vLLM's rule for a hybrid model's block size (``hybrid_block_size``; the engine's own bytes in
    ``engine.build.engine_block_size``)."""
    return alignment * cdiv(state_bytes, alignment * kv_bytes_per_token)


def default_block_size(model: ModelSpec, *, tp: int = 1, ssm_dtype_bytes: int | None = None) -> int:
    """vLLM's block size for this model: 16, or the hybrid page-aligned size (``hybrid_block_size``)."""
    return hybrid_block_size(model, tp=tp, ssm_dtype_bytes=ssm_dtype_bytes) or DEFAULT_BLOCK_SIZE


def block_bytes_per_gpu(model: ModelSpec, block_size: int, tp: int = 1, kv_dtype_bytes: int = 2) -> int:
    """One KV block (block_size tokens over all full-attention layers) on one GPU."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return block_size * kv_bytes_per_token_per_gpu(model, tp=tp, kv_dtype_bytes=kv_dtype_bytes)


def num_kv_blocks(kv_budget_bytes: int, block_bytes: int, *, state_bytes_per_block: int = 0) -> int:
    """Whole blocks in the budget; with state checkpoints each block also carries one state copy."""
    return max(0, kv_budget_bytes // (block_bytes + state_bytes_per_block))


# ---- the budget -------------------------------------------------------------------------------------------


def default_activation_reserve_bytes(model: ModelSpec, *, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                                     dtype_bytes: int = 2) -> int:
    """max_num_batched_tokens x dtype_bytes x (8 x hidden + top_k x (3 x moe_intermediate + hidden)) + 1 GiB.
    Not divided by tp (conservative: the hidden-width tensors are whole on every GPU)."""
    h = model.hidden_size
    per_token = ACTIVATION_HIDDEN_COPIES * h + model.num_experts_per_tok * (3 * model.moe_intermediate_size + h)
    return max_num_batched_tokens * per_token * dtype_bytes + RUNTIME_RESERVE_BYTES


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def kv_budget_bytes(model: ModelSpec, gpu: HardwareSpec, *, tp: int = 1,
                    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                    activation_reserve_bytes: int | None = None, kv_cache_memory: int | None = None,
                    dtype_bytes: int = 2, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS) -> int:
    """KV budget per GPU (module docstring); ``UserError`` with the numbers when it cannot be met."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    weights = weights_per_gpu(model, tp=tp, dtype_bytes=dtype_bytes).total_bytes
    reserve = activation_reserve_bytes
    if reserve is None:
        reserve = default_activation_reserve_bytes(model, max_num_batched_tokens=max_num_batched_tokens,
                                                   dtype_bytes=dtype_bytes)
    hint = "raise --tensor-parallel-size or pick a GPU with more memory"
    if kv_cache_memory is not None:
        if not kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be positive, got {kv_cache_memory}")
        budget = int(kv_cache_memory)
        if weights + reserve + budget > gpu.hbm_bytes:
            raise UserError(f"KV budget {_gib(budget)} per GPU does not fit beside the weights "
                            f"({_gib(weights)} per GPU at tp={tp}) and the activation reserve ({_gib(reserve)}) "
                            f"in {gpu.name}'s {_gib(gpu.hbm_bytes)} HBM; lower --kv-cache-memory or {hint}")
        return budget
    usable = int(gpu_memory_utilization * gpu.hbm_bytes)
    budget = usable - weights - reserve
    if budget <= 0:
        raise UserError(f"{model.name} does not fit on {gpu.name} at tp={tp}: weights need {_gib(weights)} per GPU "
                        f"plus {_gib(reserve)} activation reserve, but only {_gib(usable)} is usable "
                        f"({gpu_memory_utilization:g} x {_gib(gpu.hbm_bytes)} HBM); {hint}")
    return budget


@dataclass(frozen=True)
class MemoryBudget:
    """Every figure of one GPU's budget, so that a user can redo the arithmetic. Bytes are per GPU."""

    model_name: str
    gpu_name: str
    tp: int
    hbm_bytes: int
    gpu_memory_utilization: float
    weights_bytes_per_gpu: int
    activation_reserve_bytes: int
    kv_budget_bytes: int
    kv_budget_from_user: bool
    block_size: int
    kv_bytes_per_token: int
    block_bytes: int
    state_bytes_per_seq: int  # linear-attention state of one sequence; 0 for models without it
    state_checkpoints: bool
    charged_block_bytes: int  # block_bytes, plus state_bytes_per_seq with state checkpoints
    num_blocks: int
    state_blocks_per_request: int
    staging_room_bytes: int = 0  # offloaded experts' staging buffers, beside the activation reserve

    @property
    def max_tokens(self) -> int:
        """Tokens the pool holds when no block is spent on sequence state."""
        return self.num_blocks * self.block_size

    def blocks_for(self, num_seqs: int, context_tokens: int) -> int:
        """Blocks that num_seqs sequences of context_tokens tokens each hold, state included."""
        return num_seqs * (cdiv(context_tokens, self.block_size) + self.state_blocks_per_request)

    def describe(self) -> list[tuple[str, str]]:
        """(figure, value with its arithmetic) rows for ``moetide perf``."""
        usable = "user --kv-cache-memory" if self.kv_budget_from_user else (
            f"{self.gpu_memory_utilization:g} x {_gib(self.hbm_bytes)} - weights - reserve")
        charged = (f"{self.charged_block_bytes:,} B (block + state checkpoint)" if self.state_checkpoints
                   else f"{self.charged_block_bytes:,} B")
        rows = [
            ("HBM per GPU", f"{_gib(self.hbm_bytes)} ({self.hbm_bytes:,} B)"),
            ("weights per GPU", f"{_gib(self.weights_bytes_per_gpu)} ({self.weights_bytes_per_gpu:,} B, tp={self.tp})"),
            ("activation reserve", f"{_gib(self.activation_reserve_bytes)} ({self.activation_reserve_bytes:,} B)"),
            ("KV budget per GPU", f"{_gib(self.kv_budget_bytes)} ({self.kv_budget_bytes:,} B = {usable})"),
            ("KV bytes per token", f"{self.kv_bytes_per_token:,} B (full-attention layers, this GPU's heads)"),
            ("block", f"{self.block_size} tokens x {self.kv_bytes_per_token:,} B = {self.block_bytes:,} B"),
            ("charged per block", charged),
            ("KV blocks", f"{self.num_blocks:,} (= {self.kv_budget_bytes:,} // {self.charged_block_bytes:,})"),
            ("max tokens", f"{self.max_tokens:,} (= {self.num_blocks:,} x {self.block_size})"),
        ]
        if self.state_bytes_per_seq:
            noun = "block" if self.state_blocks_per_request == 1 else "blocks"
            rows.append(("state per sequence", f"{self.state_bytes_per_seq:,} B = {self.state_blocks_per_request} "
                                               f"{noun} (ceil({self.state_bytes_per_seq:,} / "
                                               f"{self.charged_block_bytes:,}))"))
        return rows


def memory_budget(model: ModelSpec, gpu: HardwareSpec, *, tp: int = 1, block_size: int = DEFAULT_BLOCK_SIZE,
                  dtype_bytes: int = 2, kv_dtype_bytes: int = 2, state_dtype_bytes: int | None = None,
                  ssm_dtype_bytes: int | None = None,
                  gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                  max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                  activation_reserve_bytes: int | None = None, kv_cache_memory: int | None = None,
                  state_checkpoints: bool = False, staging_room_bytes: int = 0) -> MemoryBudget:
    """The whole per-GPU budget. ``state_dtype_bytes`` defaults to ``dtype_bytes`` (vLLM's
    ``mamba_ssm_cache_dtype="auto"``; ``ssm_dtype_bytes`` 4 is its ``float32``, for the recurrent state alone);
    ``staging_room_bytes`` (offloaded experts' staging buffers) is held beside the activation reserve, outside the
    KV budget. ``UserError`` when the pool cannot hold even one
    request's state + block."""
    reserve = activation_reserve_bytes
    if reserve is None:
        reserve = default_activation_reserve_bytes(model, max_num_batched_tokens=max_num_batched_tokens,
                                                   dtype_bytes=dtype_bytes)
    budget = kv_budget_bytes(model, gpu, tp=tp, gpu_memory_utilization=gpu_memory_utilization,
                             activation_reserve_bytes=reserve + staging_room_bytes, kv_cache_memory=kv_cache_memory,
                             dtype_bytes=dtype_bytes)
    block = block_bytes_per_gpu(model, block_size, tp, kv_dtype_bytes)
    state = state_bytes_per_seq_per_gpu(model, tp=tp, state_dtype_bytes=state_dtype_bytes or dtype_bytes,
                                        ssm_dtype_bytes=ssm_dtype_bytes)
    charged = block + (state if state_checkpoints else 0)
    num_blocks = num_kv_blocks(budget, charged)
    state_blocks = cdiv(state, charged)
    if num_blocks < 1 + state_blocks:
        raise UserError(f"the KV budget of {_gib(budget)} per GPU holds {num_blocks} blocks of {charged:,} B, fewer "
                        f"than one request needs ({state_blocks} state + 1 KV); give more memory or a smaller "
                        f"--block-size")
    return MemoryBudget(
        model_name=model.name, gpu_name=gpu.name, tp=tp, hbm_bytes=gpu.hbm_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_bytes_per_gpu=weights_per_gpu(model, tp=tp, dtype_bytes=dtype_bytes).total_bytes,
        activation_reserve_bytes=reserve, kv_budget_bytes=budget, kv_budget_from_user=kv_cache_memory is not None,
        block_size=block_size, kv_bytes_per_token=block // block_size, block_bytes=block, state_bytes_per_seq=state,
        state_checkpoints=state_checkpoints, charged_block_bytes=charged, num_blocks=num_blocks,
        state_blocks_per_request=state_blocks, staging_room_bytes=staging_room_bytes)
