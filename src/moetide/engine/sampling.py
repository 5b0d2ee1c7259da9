"""Sampling for the engine: each request's settings (``SamplingParams``, vLLM's names) and the sampler that turns
a step's logits into one token per request.

Apart from the runner so that the loop reads as scheduling and execution; the sampler's one rule that matters
for exactness: a greedy row is an argmax whatever else shares the step, and each sampled request draws from its
own seeded generator, so a request's tokens do not depend on its batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling and stopping. ``temperature`` None or 0: greedy. ``seed`` None: a fresh random seed
    (as vLLM: an unseeded sampled request is not reproducible). ``stop_token_ids`` end the request like an eos."""

    max_tokens: int
    temperature: float | None = None
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature is not None and not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return not self.temperature



class Sampler:
    """Greedy rows by argmax; sampled rows grouped by (temperature, top_p) so that one call with a single setting
    does the same tensor ops whatever the batch mixes in; one generator per sampled request."""

    def __init__(self) -> None:
        self._params: dict[str, SamplingParams] = {}
        self._generators: dict[str, torch.Generator] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        self._params[request_id] = params
        if not params.greedy:
            seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(63)
            self._generators[request_id] = torch.Generator().manual_seed(seed % 2**64)  # any int, as vLLM's

    def remove(self, request_id: str) -> None:
        self._params.pop(request_id, None)
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str]) -> list[int]:
        """logits [n, V] (rows of the listed requests) -> one token id per row."""
        params = [self._params[rid] for rid in request_ids]
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1).tolist()
        tokens: list[int | None] = [None] * len(params)
        groups: dict[tuple[float, float] | None, list[int]] = {}
        for row, p in enumerate(params):
            groups.setdefault(None if p.greedy else (p.temperature, p.top_p), []).append(row)
        for key, rows in groups.items():
            part = logits if len(rows) == len(params) else logits[rows]
            if key is None:
                picked = part.argmax(dim=-1).tolist()
            else:
                probs = _top_p(torch.softmax(part.float().cpu() / key[0], dim=-1), key[1])
                picked = [int(torch.multinomial(probs[i], 1, generator=self._generators[request_ids[row]]))
                          for i, row in enumerate(rows)]
            for row, token in zip(rows, picked):
                tokens[row] = token
        return tokens  # type: ignore[return-value]


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (the top token always stays)."""
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
