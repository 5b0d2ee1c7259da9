"""The engine models' seams: step metadata and the three hooks through which a model reaches memory it does not own.

A step is a set of sequences whose new tokens are packed end to end into one ``T``-long token tensor, with no
padding, as a continuous-batching engine runs them (vLLM's "there are no prefill and decode phases"): a sequence
may bring its whole prompt, a chunk of it, or one decode token. ``StepBatch`` says which tokens belong to whom.

The model never owns per-sequence memory. Full attention hands each layer's q, k, v to an ``AttentionBackend``
(which stores k, v wherever it keeps KV and attends over the sequence's whole context); Gated DeltaNet layers read
and update their fixed-size state through a ``LinearStateStore``; MoE layers fetch each selected expert's weights
from an ``ExpertProvider`` after announcing the step's routing to it. The defaults here are the simplest correct
ones (a contiguous per-sequence KV list, a dict of state tensors, the module's own weights); the paged backend over
arena pages, pool-block state and expert staging replace them without touching the model code.

Conventions: ``T`` = tokens in the step, ``B`` = sequences, ``H`` = hidden size, ``Hq``/``Hkv`` = query/KV heads,
``D`` = head dim, ``E`` = experts, ``K`` = top-k, ``I`` = expert intermediate size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from moetide.units import cdiv


@dataclass(frozen=True)
class StepBatch:
    """Sequence ``i`` owns tokens ``[start_i, start_i + num_new_tokens[i])`` of the step, in ``seq_ids`` order;
    its first new token sits at position ``num_computed_tokens[i]`` (tokens already in its cache)."""

    seq_ids: tuple[int, ...]
    num_new_tokens: tuple[int, ...]
    num_computed_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.seq_ids) == len(self.num_new_tokens) == len(self.num_computed_tokens)):
            raise ValueError("StepBatch: seq_ids, num_new_tokens and num_computed_tokens must have equal lengths")
        if len(set(self.seq_ids)) != len(self.seq_ids):
            raise ValueError(f"StepBatch: a sequence appears twice in one step: {self.seq_ids}")
        if any(n < 1 for n in self.num_new_tokens) or any(c < 0 for c in self.num_computed_tokens):
            raise ValueError("StepBatch: num_new_tokens must be >= 1 and num_computed_tokens >= 0")

    @classmethod
    def of(cls, entries: list[tuple[int, int, int]]) -> StepBatch:
        """From ``(seq_id, num_new_tokens, num_computed_tokens)`` triples."""
        seq_ids, new, computed = zip(*entries) if entries else ((), (), ())
        return cls(tuple(seq_ids), tuple(new), tuple(computed))

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def token_slices(self) -> list[slice]:
        slices, start = [], 0
        for n in self.num_new_tokens:
            slices.append(slice(start, start + n))
            start += n
        return slices

    def positions(self, device: torch.device | str = "cpu") -> Tensor:
        """LongTensor[T]: each token's position in its own sequence."""
        if self.num_tokens == len(self.seq_ids):  # one token each (pure decode)
            return torch.tensor(self.num_computed_tokens, device=device)
        return torch.tensor([p for n, c in zip(self.num_new_tokens, self.num_computed_tokens)
                             for p in range(c, c + n)], device=device)

    def last_token_indices(self, device: torch.device | str = "cpu") -> Tensor:
        """LongTensor[B]: index in the step of each sequence's last new token."""
        ends = torch.tensor(self.num_new_tokens, device=device).cumsum(0)
        return ends - 1


# ---- attention ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeRows:
    """Where a pure decode step's keys lie, for attention computed in place (``engine.native``'s decode kernels):
    ``k_rows``, ``v_rows`` [rows, Hkv, D] views of the cache (equal strides, unit stride along D); ``key_rows``
    [B, L] int64, sequence s's keys in position order, its first ``lengths[s]`` valid ([B] int64), the last of
    them its decode token's own slot, not yet written."""

    k_rows: Tensor
    v_rows: Tensor
    key_rows: Tensor
    lengths: Tensor


class AttentionBackend(Protocol):
    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, batch: StepBatch, scale: float) -> Tensor:
        """Store this step's k, v [T, Hkv, D] for ``layer_id`` and return causal attention of q [T, Hq, D] over
        each sequence's whole context (cached tokens, then its new ones) as [T, Hq, D]."""
        ...

    def decode_rows(self, layer_id: int, num_heads: int, like: Tensor) -> DecodeRows | None:
        """For a step of one token per sequence whose attention this backend would compute in place with the
        native decode kernel (for ``num_heads`` query heads in ``like``'s dtype and device), where its keys lie:
        a caller that writes each sequence's new K/V into its last row and attends there, as that kernel does,
        may then skip ``attend`` for the layer. None (the default) where the backend must see ``attend``."""
        return None


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, num_computed_tokens: int) -> Tensor:
    """One sequence: q [Tq, Hq, D] at positions ``num_computed_tokens + j`` over k, v [Tk, Hkv, D] (positions
    0..Tk-1); grouped-query heads map as in transformers' ``repeat_kv`` (query head h reads KV head h // group).
    Softmax in fp32, like transformers' eager attention."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, Tq, Tk]
    query_pos = torch.arange(q.shape[0], device=q.device) + num_computed_tokens
    future = torch.arange(k.shape[0], device=q.device)[None, :] > query_pos[:, None]  # [Tq, Tk]
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", probs, v)


class ContiguousKVCache(AttentionBackend):
    """The reference ``AttentionBackend``: per (layer, sequence), K and V as contiguous [L, Hkv, D] tensors that
    grow by concatenation. Simple and exact, O(L) copying per step; the paged backend replaces it. A sequence that
    claims ``num_computed_tokens`` its cache does not hold is a bug upstream, so it raises rather than guesses."""

    def __init__(self) -> None:
        self._kv: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def num_cached_tokens(self, layer_id: int, seq_id: int) -> int:
        entry = self._kv.get((layer_id, seq_id))
        return 0 if entry is None else entry[0].shape[0]

    def free(self, seq_id: int) -> None:
        for key in [key for key in self._kv if key[1] == seq_id]:
            del self._kv[key]

    def attend(self, layer_id: int, q: Tensor, k: Tensor, v: Tensor, batch: StepBatch, scale: float) -> Tensor:
        out = torch.empty_like(q)
        for seq_id, sl, computed in zip(batch.seq_ids, batch.token_slices(), batch.num_computed_tokens):
            cached = self.num_cached_tokens(layer_id, seq_id)
            if computed not in (0, cached):
                raise ValueError(f"sequence {seq_id} layer {layer_id}: step says {computed} tokens are computed, "
                                 f"the cache holds {cached}")
            seq_k, seq_v = k[sl], v[sl]
            if computed:
                past_k, past_v = self._kv[(layer_id, seq_id)]
                seq_k, seq_v = torch.cat([past_k, seq_k]), torch.cat([past_v, seq_v])
            self._kv[(layer_id, seq_id)] = (seq_k.contiguous(), seq_v.contiguous())
            out[sl] = causal_attention(q[sl], seq_k, seq_v, scale, computed)
        return out


# ---- linear-attention state --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearState:
    """One sequence's Gated DeltaNet state in one layer, as tensors the layer updates in place (``copy_``):
    ``conv`` [C, kernel-1] (the last inputs of the causal conv) and ``recurrent`` [Hv, Dk, Dv] (fp32)."""

    conv: Tensor
    recurrent: Tensor


@dataclass(frozen=True)
class LinearStateShape:
    conv: tuple[int, ...]
    recurrent: tuple[int, ...]


STATE_ALIGN_BYTES = 64


@dataclass(frozen=True)
class StateField:
    offset: int  # bytes from the start of the sequence's state
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class StateLayout:
    """Byte layout of one sequence's state over all linear layers: layer id -> (conv field, recurrent field), per
    layer ``conv`` [C, kernel-1] in the model dtype then ``recurrent`` [Hv, Dk, Dv] in fp32, each 64-byte aligned.
    Both stores keep a sequence's state as these bytes, so one native kernel reads either in place."""

    fields: dict[int, tuple[StateField, StateField]]
    total_bytes: int

    @classmethod
    def of(cls, shapes: dict[int, LinearStateShape], conv_dtype: torch.dtype) -> StateLayout:
        def align(n: int) -> int:
            return cdiv(n, STATE_ALIGN_BYTES) * STATE_ALIGN_BYTES

        fields, offset = {}, 0
        for layer_id in sorted(shapes):
            conv = StateField(offset, shapes[layer_id].conv, conv_dtype)
            offset = align(offset + conv.nbytes)
            recurrent = StateField(offset, shapes[layer_id].recurrent, torch.float32)
            offset = align(offset + recurrent.nbytes)
            fields[layer_id] = (conv, recurrent)
        return cls(fields, offset)

    def num_blocks(self, block_bytes: int) -> int:
        return cdiv(self.total_bytes, block_bytes) if self.total_bytes else 0

    @property
    def largest_layer_bytes(self) -> int:
        """One layer's state bytes (conv then recurrent, as laid out), the largest over the layers; 0 if none."""
        return max((rec.offset + rec.nbytes - conv.offset for conv, rec in self.fields.values()), default=0)

    def views(self, row: Tensor, layer_id: int) -> LinearState:
        """The layer's state as tensors over ``row``, one sequence's ``total_bytes`` (or more) of uint8."""
        conv, recurrent = self.fields[layer_id]
        return LinearState(*(row[f.offset : f.offset + f.nbytes].view(f.dtype).view(f.shape)
                             for f in (conv, recurrent)))


@dataclass(frozen=True)
class StateBlocks:
    """Where some sequences' state bytes lie, for a kernel that updates them in place: sequence ``s``'s byte
    ``o`` of ``layout`` is at address ``addresses[s, o // block_bytes] + o % block_bytes`` (CPU memory, valid
    until the step ends; int64 [B, layout.num_blocks(block_bytes)])."""

    addresses: Tensor
    block_bytes: int
    layout: StateLayout


class LinearStateStore(Protocol):
    def state(self, layer_id: int, seq_id: int) -> LinearState:
        """The sequence's state in ``layer_id``. Contents are ignored (read as zeros) when the step says the
        sequence has no computed tokens, so a store may hand out recycled memory without clearing it."""
        ...

    def state_blocks(self, seq_ids: list[int]) -> StateBlocks | None:
        """The sequences' state bytes in place, in ``seq_ids`` order, or None where the store can only hand out
        tensors (the default). What a kernel writes there is what ``state`` reads afterwards, and the reverse."""
        return None


class DictLinearStateStore(LinearStateStore):
    """The reference ``LinearStateStore``: one zeroed byte row per sequence in ``StateLayout``, allocated on first
    use."""

    def __init__(self, shapes: dict[int, LinearStateShape], conv_dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.layout, self.device = StateLayout.of(shapes, conv_dtype), torch.device(device)
        self._rows: dict[int, Tensor] = {}

    def _row(self, seq_id: int) -> Tensor:
        if seq_id not in self._rows:
            self._rows[seq_id] = torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device)
        return self._rows[seq_id]

    def state(self, layer_id: int, seq_id: int) -> LinearState:
        return self.layout.views(self._row(seq_id), layer_id)

    def state_blocks(self, seq_ids: list[int]) -> StateBlocks | None:
        if self.device.type != "cpu" or not self.layout.total_bytes:
            return None
        addresses = torch.tensor([[self._row(s).data_ptr()] for s in seq_ids], dtype=torch.int64)
        return StateBlocks(addresses, self.layout.total_bytes, self.layout)

    def free(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)


# ---- experts -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert: ``gate_up`` [2I, H] (gate rows, then up rows: transformers v5's fused layout) and
    ``down`` [H, I]."""

    gate_up: Tensor
    down: Tensor


class ExpertProvider(Protocol):
    def route(self, layer_id: int, expert_ids: Tensor) -> None:
        """The step's top-k expert ids [T, K] for ``layer_id``, before any of its experts runs: where routing
        statistics are recorded and staging of offloaded experts starts."""
        ...

    def expert_weights(self, layer_id: int, expert_id: int) -> ExpertWeights:
        """Weights of one expert the step selected, on the compute device, valid until the layer returns."""
        ...

    def stacked_weights(self, layer_id: int) -> tuple[Tensor, Tensor] | None:
        """Called after ``route``: views (gate_up [E, 2I, H], down [E, H, I]) of all E experts of the layer, valid
        for every expert routed in this step (rows of experts nobody chose may hold anything: they are not
        read), or None when some routed expert is only reachable through ``expert_weights`` (staged). With
        them the MoE block runs the grouped path (``models.moe``); the default, None, serves expert by expert."""
        return None

    def resident_weights(self, layer_id: int) -> tuple[Tensor, Tensor] | None:
        """``stacked_weights``' views where they are valid whatever the step routes (every expert of the layer
        resident), so the MoE block may run its experts before it announces the routing (``route``, then called
        right after them, still before the layer returns). None (the default): announce first."""
        return None


class ModuleExpertProvider(ExpertProvider):
    """The default ``ExpertProvider``: views into each MoE layer's own stacked parameters (read at call time, so
    the model may be moved or cast after this is built); records nothing."""

    def __init__(self, experts_by_layer: dict[int, torch.nn.Module]) -> None:
        self.experts_by_layer = experts_by_layer  # layer -> module with gate_up_proj [E, 2I, H], down_proj [E, H, I]

    def route(self, layer_id: int, expert_ids: Tensor) -> None:
        return None

    def expert_weights(self, layer_id: int, expert_id: int) -> ExpertWeights:
        module = self.experts_by_layer[layer_id]
        return ExpertWeights(module.gate_up_proj[expert_id], module.down_proj[expert_id])

    def stacked_weights(self, layer_id: int) -> tuple[Tensor, Tensor]:
        module = self.experts_by_layer[layer_id]
        return module.gate_up_proj, module.down_proj

    def resident_weights(self, layer_id: int) -> tuple[Tensor, Tensor]:
        return self.stacked_weights(layer_id)


@dataclass
class StepContext:
    """Everything a forward pass needs besides the tokens: who owns them, and the three hooks.
    ``experts=None`` means the model's own expert weights; ``linear_states`` is needed only by hybrid models."""

    batch: StepBatch
    attention: AttentionBackend
    linear_states: LinearStateStore | None = None
    experts: ExpertProvider | None = None
