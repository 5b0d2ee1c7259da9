"""The engine parity tests' shared prompts and transformers reference (imported by test modules after their
``pytest.importorskip("torch")``; not collected itself)."""

from __future__ import annotations

import pytest
import torch

MAX_TOKENS = 64
PROMPT_LENGTHS = (5, 9, 14, 17, 21, 26, 33, 40)
SHARED_PREFIX_TOKENS = 12  # odd-numbered prompts start with the same 12 tokens (prefix hits, then evictions)


def parity_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    shared = torch.randint(1, 512, (SHARED_PREFIX_TOKENS,), generator=generator).tolist()
    return [(shared if i % 2 else []) + torch.randint(1, 512, (n,), generator=generator).tolist()
            for i, n in enumerate(PROMPT_LENGTHS)]


def greedy_reference(hf_model, prompts: list[list[int]], max_new_tokens: int):
    """``get(arch)``: transformers' greedy continuations of ``prompts``, one prompt at a time, cached per arch."""
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            model = hf_model(arch)
            with torch.no_grad():
                cache[arch] = [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                               for p in prompts]
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def hf_reference(hf_model):
    """``hf_reference(arch)``: transformers' greedy continuations of the parity prompts."""
    return greedy_reference(hf_model, parity_prompts(), MAX_TOKENS)
