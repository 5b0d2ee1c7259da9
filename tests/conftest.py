"""Shared fixtures. Engine fixtures import torch only when a test asks for them, so core-only runs stay light."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

# Tiny, but with every code path on: qwen3_moe has a dense MLP layer (mlp_only_layers) and no top-k renormalization;
# qwen3_next has 3 Gated DeltaNet layers + 1 gated full-attention layer and twice as many value heads as key heads;
# deepseek_v2 has MLA, a first dense layer, group-limited routing, a shared expert and YaRN RoPE.
TINY_CHECKPOINTS = {
    "qwen3_moe": dict(arch="qwen3_moe", num_layers=3, dense_layer_ids=(1,)),
    "mixtral": dict(arch="mixtral", num_layers=2),
    "qwen3_next": dict(arch="qwen3_next", num_layers=4),
    "deepseek_v2": dict(arch="deepseek_v2", num_layers=3),
}
ENGINE_ARCHS = tuple(TINY_CHECKPOINTS)


@pytest.fixture(scope="session")
def torch_one_thread():
    """torch on one thread: on a loaded 2-core machine, OpenMP spinning makes tiny ops 10-100x slower."""
    torch = pytest.importorskip("torch")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, torch_one_thread):
    """``tiny_checkpoint(arch) -> Path``: a random transformers checkpoint + tokenizer, built once per session.
    Shared: tests that damage a checkpoint must copy it first (``copy_checkpoint``)."""
    pytest.importorskip("transformers")
    from moetide.engine.testmodel import TinyModelArgs, make_test_model

    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            # transformers' save progress bar would land in the stderr of whichever test first asks for the arch
            with contextlib.redirect_stderr(io.StringIO()):
                built[arch] = make_test_model(TinyModelArgs(**TINY_CHECKPOINTS[arch]), tmp_path_factory.mktemp(arch))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint):
    """``hf_model(arch)``: transformers' own model for the tiny checkpoint (eval mode), loaded once per session."""
    import transformers

    transformers.logging.set_verbosity_error()
    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            loaded[arch] = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch)).eval()
        return loaded[arch]

    return get


@pytest.fixture(scope="session")
def hf_reference(hf_model):
    """``hf_reference(arch)``: transformers' greedy continuations of the engine parity prompts, computed once per
    session (``engine_parity``)."""
    from engine_parity import MAX_TOKENS, greedy_reference, parity_prompts

    return greedy_reference(hf_model, parity_prompts(), MAX_TOKENS)


@pytest.fixture
def mixtral_engine(tiny_checkpoint):
    """A fresh engine on the tiny Mixtral: 4 KV pages of 8 KiB, blocks of 4, half the experts may be offloaded."""
    from engine_parity import BLOCK_SIZE, PAGE_BYTES
    from moetide.engine.runner import Engine

    return Engine(tiny_checkpoint("mixtral"), kv_cache_memory=4 * PAGE_BYTES, page_bytes=PAGE_BYTES,
                  block_size=BLOCK_SIZE, max_offload_ratio=0.5, ignore_eos=True)


@pytest.fixture
def copy_checkpoint(tiny_checkpoint, tmp_path):
    """``copy_checkpoint(arch) -> Path``: a private copy of the tiny checkpoint, free to damage."""
    import shutil

    def copy(arch: str) -> Path:
        return Path(shutil.copytree(tiny_checkpoint(arch), tmp_path / arch))

    return copy
