"""The engine tests' shared prompts, transformers reference, budgets and book checks (imported by test modules
after their ``pytest.importorskip("torch")``; not collected itself; ``conftest.hf_reference`` serves the
reference once per session)."""

from __future__ import annotations

import torch

MAX_TOKENS = 64
PROMPT_LENGTHS = (5, 9, 14, 17, 21, 26, 33, 40)
SHARED_PREFIX_TOKENS = 12  # odd-numbered prompts start with the same 12 tokens (prefix hits, then evictions)
PAGE_BYTES = 8192  # tiny experts are 24 KiB: 3 pages each, so the KV budget moves in small steps
BLOCK_SIZE = 4
TIGHT = dict(page_bytes=PAGE_BYTES, block_size=BLOCK_SIZE, max_num_batched_tokens=64, ignore_eos=True)
# KV pages (of 8 KiB) that make every mechanism fire for N=64 while the largest request still fits alone
STATIC_PAGES = {"qwen3_moe": 10, "mixtral": 6, "qwen3_next": 4, "deepseek_v2": 4}
POLICY_PAGES = {"qwen3_moe": 16, "mixtral": 8, "qwen3_next": 6, "deepseek_v2": 5}


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


def check_books(engine) -> None:
    """After a finished ``generate``: every book consistent, every block released, and the pool holding exactly
    the arena's KV blocks (plus the host KV blocks, allocated after the device ones)."""
    kv, arena, host = engine.scheduler.kv, engine.storage.arena, engine.host_kv
    kv.check_invariants()
    arena.check_invariants()
    engine.residency.check_invariants()
    assert kv.pool.num_used_blocks == 0, "a finished generate must release every block"
    assert sorted(kv.pool.block_ids()) == arena.kv_block_ids() + (list(host.block_ids) if host else [])
    if host is not None:
        assert kv.pool.host_tier.first_id == host.first_block_id == arena.config.num_block_ids
