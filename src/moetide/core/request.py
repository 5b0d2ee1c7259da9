"""A request as the scheduler sees it: known tokens, computed tokens, and the chained hashes of its full blocks.

vLLM v1's model: there is no prefill or decode phase, only ``num_computed_tokens`` catching up to ``num_tokens``
(prompt plus outputs so far). A step that brings them level samples one output token, which makes one more token
known. The same class serves the engine (real token ids, hashes over them) and the simulator (only counts; block
hashes from a trace's keys, generated blocks salted with the request's own salt — ``core.hashing``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from moetide.core.hashing import ROOT_HASH, extend_salted_hashes, hash_token_blocks


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """Mutable per-request state owned by the scheduler."""

    __slots__ = (
        "request_id", "session_id", "arrival_s", "num_prompt_tokens", "max_output_tokens", "token_ids",
        "block_hashes", "block_size", "salt", "eos_token_ids", "status", "num_computed_tokens", "num_output_tokens",
        "num_cached_prompt_tokens", "max_computed_tokens", "num_preemptions", "num_recomputed_tokens", "stopped",
        "shared_prefix_boundary",
    )

    def __init__(
        self,
        request_id: str,
        *,
        num_prompt_tokens: int,
        max_output_tokens: int,
        block_size: int,
        block_hashes: list[int],
        token_ids: list[int] | None = None,
        session_id: str | None = None,
        arrival_s: float = 0.0,
        salt: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        if num_prompt_tokens <= 0:
            raise ValueError(f"request {request_id!r}: a prompt needs at least one token, got {num_prompt_tokens}")
        if max_output_tokens <= 0:
            raise ValueError(f"request {request_id!r}: max_output_tokens must be positive, got {max_output_tokens}")
        self.request_id = request_id
        self.session_id = session_id
        self.arrival_s = arrival_s
        self.num_prompt_tokens = num_prompt_tokens
        self.max_output_tokens = max_output_tokens
        self.token_ids = token_ids
        self.block_hashes = block_hashes
        self.block_size = block_size
        self.salt = salt
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_prompt_tokens: int | None = None  # prefix hit at first scheduling (metrics)
        self.max_computed_tokens = 0  # high-water mark: computing below it again is recomputation
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.stopped = False
        # a hybrid model's attention hit past its last kept state, set at each prefix lookup (core.mamba_states)
        self.shared_prefix_boundary = 0

    @classmethod
    def from_tokens(cls, request_id: str, token_ids: Sequence[int], max_output_tokens: int, block_size: int,
                    **kwargs) -> Request:
        """An engine request: hashes over the real token ids."""
        tokens = list(token_ids)
        return cls(request_id, num_prompt_tokens=len(tokens), max_output_tokens=max_output_tokens,
                   block_size=block_size, block_hashes=hash_token_blocks(tokens, block_size), token_ids=tokens,
                   **kwargs)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def computed_to(self, start: int, end: int) -> None:
        """Tokens ``start..end`` were just computed (``start`` = ``num_computed_tokens`` before the step); what
        lies below the high-water mark counts as recomputed."""
        if start < self.max_computed_tokens:
            self.num_recomputed_tokens += min(end, self.max_computed_tokens) - start
        self.num_computed_tokens = end
        if end > self.max_computed_tokens:
            self.max_computed_tokens = end

    def append_output(self, token_id: int | None) -> None:
        """Record one sampled token (None in replay, where only counts exist) and extend the block hashes."""
        self.num_output_tokens += 1
        num_full = self.num_tokens // self.block_size
        if self.token_ids is not None:
            self.token_ids.append(token_id if token_id is not None else 0)
            if num_full > len(self.block_hashes):
                parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
                self.block_hashes.extend(hash_token_blocks(
                    self.token_ids, self.block_size, parent_hash=parent, start_block=len(self.block_hashes)))
        elif num_full > len(self.block_hashes):
            extend_salted_hashes(self.block_hashes, num_full, self.salt)
        if token_id is not None and token_id in self.eos_token_ids:
            self.stopped = True

    def append_outputs(self, num_tokens: int) -> None:
        """Record ``num_tokens`` sampled tokens at once (replay, where only counts exist): the same state as that
        many ``append_output(None)`` calls, with the block hashes extended once."""
        if self.token_ids is not None:
            for _ in range(num_tokens):
                self.append_output(None)
            return
        self.num_output_tokens += num_tokens
        num_full = (self.num_prompt_tokens + self.num_output_tokens) // self.block_size
        if num_full > len(self.block_hashes):
            extend_salted_hashes(self.block_hashes, num_full, self.salt)

    @property
    def is_done(self) -> bool:
        """Generated its last token (length or a stop token)."""
        return self.stopped or self.num_output_tokens >= self.max_output_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens}, out={self.num_output_tokens}/{self.max_output_tokens})")
