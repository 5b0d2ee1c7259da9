"""The engine against transformers: greedy output token for token, under a roomy KV budget and under budgets so
small that prefix eviction, preemption (by recompute) and expert offload all happen — by static offload at start,
and by a pressure policy's ``OffloadExperts`` action through the engine's expert line. Counters prove each
mechanism ran; equality with transformers proves none of them changed a token.

Qwen3-Next (hybrid) runs with prefix caching off (a linear state cannot be rebuilt from a cached prefix), so it
never evicts a prefix; its preempted requests recompute from token 0.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moetide.core.pressure import OffloadExperts, PressurePolicy  # noqa: E402
from moetide.core.pressure.vllm import VllmPolicy  # noqa: E402
from moetide.engine.runner import Engine  # noqa: E402
from moetide.errors import UserError  # noqa: E402
from moetide.engine.testmodel import ARCHS as ENGINE_ARCHS  # noqa: E402
from engine_parity import (  # noqa: E402
    MAX_TOKENS,
    PAGE_BYTES,
    POLICY_PAGES,
    STATIC_PAGES,
    TIGHT,
    check_books,
    greedy_reference,
    parity_prompts,
)


class OffloadOnPressure(PressurePolicy):
    """A stand-in for a VAMP-like policy: on pressure, offload the residency's next cold expert (one per call,
    ``max_offloads`` times), then behave like ``vllm``. ``residency`` is set once the engine exists."""

    name = "offload-on-pressure"

    def __init__(self, max_offloads: int) -> None:
        self.max_offloads, self.residency, self.num_offload_actions = max_offloads, None, 0
        self.fallback = VllmPolicy()

    def relieve(self, view):
        if self.num_offload_actions < self.max_offloads:
            region = self.residency.next_offload_region(max_experts=1)
            if region:
                self.num_offload_actions += 1
                return [OffloadExperts(tuple(region))]
        return self.fallback.relieve(view)


def assert_complete(result) -> None:
    assert all(o.finish_reason == "length" and len(o.token_ids) == MAX_TOKENS for o in result.outputs)
    assert [o.prompt_token_ids for o in result.outputs] == parity_prompts()


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_roomy_budget_matches_transformers(arch, tiny_checkpoint, hf_reference):
    engine = Engine(tiny_checkpoint(arch), kv_cache_memory=4 * 2**20, ignore_eos=True)
    result = engine.generate(parity_prompts(), MAX_TOKENS)
    assert [o.token_ids for o in result.outputs] == hf_reference(arch)
    assert_complete(result)
    stats = result.stats
    assert (stats.prefix_evictions, stats.preemptions, stats.experts_offloaded) == (0, 0, 0)
    # every token computed once: each prompt token and each output but the last (a hybrid model's aligned chunks
    # may put other requests' decodes in a prefill step, so the split between the two counts is not fixed)
    assert stats.prompt_tokens == sum(map(len, parity_prompts())) and stats.prefix_hit_tokens == 0
    assert stats.prefill_tokens + stats.decode_tokens == stats.prompt_tokens + stats.generated_tokens - len(
        result.outputs) and stats.recomputed_tokens == 0
    check_books(engine)


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_tight_budget_with_static_offload_matches_transformers(arch, tiny_checkpoint, hf_reference):
    engine = Engine(tiny_checkpoint(arch), kv_cache_memory=STATIC_PAGES[arch] * PAGE_BYTES, max_offload_ratio=0.25,
                    static_offload=True, **TIGHT)
    offloaded_at_start = engine.residency.num_offloaded
    result = engine.generate(parity_prompts(), MAX_TOKENS)
    assert [o.token_ids for o in result.outputs] == hf_reference(arch)
    assert_complete(result)
    stats = result.stats
    assert offloaded_at_start == stats.experts_offloaded == engine.residency.max_num_offloaded > 0
    assert stats.preemptions > 0 and stats.recomputed_tokens > 0
    # hybrid models cache too (their states at block boundaries): evicted prefixes, and hits where a state was kept
    assert stats.prefix_evictions > 0 and (stats.prefix_hit_tokens > 0 or arch == "qwen3_next")
    assert engine.parts.experts.stager.num_staged > 0, "offloaded experts were routed, so they were staged"
    check_books(engine)


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_cold_experts_computed_from_host_copies_match_transformers(arch, tiny_checkpoint, hf_reference):
    """``cold_experts="cpu"``: offloaded experts with few routed rows run from their host copies (rows there and
    back), the rest are staged; both happen (a limit of 2 rows splits prefill chunks from decode steps) and
    neither changes a token."""
    engine = Engine(tiny_checkpoint(arch), kv_cache_memory=STATIC_PAGES[arch] * PAGE_BYTES, max_offload_ratio=0.25,
                    static_offload=True, cold_experts="cpu", cold_expert_max_rows=2, **TIGHT)
    result = engine.generate(parity_prompts(), MAX_TOKENS)
    assert [o.token_ids for o in result.outputs] == hf_reference(arch)
    assert_complete(result)
    provider = engine.parts.experts
    assert provider.num_host_computed > 0 and provider.stager.num_staged > 0
    assert (result.stats.experts_on_host, result.stats.experts_staged) == (provider.num_host_computed,
                                                                          provider.stager.num_staged)
    check_books(engine)
    with pytest.raises(UserError, match="cold_experts"):
        Engine(tiny_checkpoint(arch), kv_cache_memory=4 * 2**20, cold_experts="gpu")


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_offload_by_policy_action_matches_transformers(arch, tiny_checkpoint, hf_reference):
    """The path a VAMP policy takes: ``OffloadExperts`` returned on pressure, carried out by the expert line."""
    policy = OffloadOnPressure(max_offloads=2)
    engine = Engine(tiny_checkpoint(arch), kv_cache_memory=POLICY_PAGES[arch] * PAGE_BYTES, max_offload_ratio=0.5,
                    policy=policy, **TIGHT)
    policy.residency = engine.residency
    blocks_at_start = engine.scheduler.kv.pool.num_blocks
    result = engine.generate(parity_prompts(), MAX_TOKENS)
    assert [o.token_ids for o in result.outputs] == hf_reference(arch)
    assert_complete(result)
    stats = result.stats
    assert policy.num_offload_actions == 2 and stats.experts_offloaded == 2
    assert stats.kv_blocks == blocks_at_start + engine.parts.expert_line.num_new_blocks > blocks_at_start
    assert stats.preemptions > 0
    assert stats.prefix_evictions > 0
    assert engine.residency.offloaded_experts(0) or engine.residency.offloaded_experts(1)
    check_books(engine)


@pytest.mark.parametrize(("arch", "block_size"), [("qwen3_moe", 16), ("qwen3_next", 32)])
def test_blocks_larger_than_pages_match_transformers(arch, block_size, tiny_checkpoint, hf_reference):
    """4 KiB pages: a 12 KiB qwen3_moe block spans 3 pages, an 8 KiB qwen3_next block 2 (and its 17 KiB of
    linear state 3 blocks); converting a 24 KiB expert completes groups that straddle its neighbours."""
    engine = Engine(tiny_checkpoint(arch), kv_cache_memory=6 * 4096, page_bytes=4096, block_size=block_size,
                    max_offload_ratio=0.5, static_offload=True, max_num_batched_tokens=64, ignore_eos=True)
    assert engine.storage.arena.config.pages_per_block > 1
    result = engine.generate(parity_prompts(), MAX_TOKENS)
    assert [o.token_ids for o in result.outputs] == hf_reference(arch)
    assert_complete(result)
    assert result.stats.preemptions > 0 and result.stats.experts_offloaded > 0
    check_books(engine)


def test_routing_statistics_reach_the_residency(tiny_checkpoint):
    engine = Engine(tiny_checkpoint("mixtral"), kv_cache_memory=1 * 2**20, ignore_eos=True)
    engine.generate(parity_prompts()[:2], 4)
    hotness = [engine.residency.hotness(m, e) for m in range(2) for e in range(4)]
    assert sum(hotness) > 0 and all(h >= 0 for h in hotness)


def test_prefix_cache_persists_across_generate_calls(tiny_checkpoint, hf_reference):
    engine = Engine(tiny_checkpoint("qwen3_moe"), kv_cache_memory=1 * 2**20, block_size=4, ignore_eos=True)
    prompts = parity_prompts()
    first = engine.generate(prompts[:1], MAX_TOKENS)
    again = engine.generate(prompts[:1], MAX_TOKENS)
    assert first.outputs == again.outputs and first.outputs[0].token_ids == hf_reference("qwen3_moe")[0]
    assert first.stats.prefix_hit_tokens == 0 and again.stats.prefix_hit_tokens == 4  # 5 tokens: 1 full block


def test_sampling_is_seeded_and_independent_of_the_batch(tiny_checkpoint):
    engine = Engine(tiny_checkpoint("mixtral"), kv_cache_memory=1 * 2**20, ignore_eos=True)
    prompts = parity_prompts()[:3]
    a = engine.generate(prompts, 12, temperature=1.0, seed=7)
    b = engine.generate(prompts, 12, temperature=1.0, seed=7)
    c = engine.generate(prompts, 12, temperature=1.0, seed=8)
    alone = engine.generate(prompts[:1], 12, temperature=1.0, seed=7)
    assert a.outputs == b.outputs and a.outputs != c.outputs
    assert alone.outputs[0] == a.outputs[0]
    greedy = engine.generate(prompts, 12, temperature=0.0)
    assert greedy.outputs == engine.generate(prompts, 12).outputs


def test_an_eos_token_stops_a_request(tiny_checkpoint, hf_reference):
    engine = Engine(tiny_checkpoint("mixtral"), kv_cache_memory=1 * 2**20)
    assert engine.parts.eos_token_ids == {0}  # config.json's eos_token_id
    reference = hf_reference("mixtral")[0]
    stop = reference[5]
    engine.parts.eos_token_ids = frozenset({stop})
    out = engine.generate(parity_prompts()[:1], MAX_TOKENS).outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == reference[: reference.index(stop) + 1]


def test_a_request_that_can_never_fit_fails_alone(tiny_checkpoint):
    engine = Engine(tiny_checkpoint("mixtral"), kv_cache_memory=PAGE_BYTES, **TIGHT)  # 16 blocks: 64 tokens
    result = engine.generate([[5] * 100, [6] * 3], 4)
    assert [o.finish_reason for o in result.outputs] == ["failed", "length"]
    assert result.outputs[0].token_ids == [] and len(result.outputs[1].token_ids) == 4
    assert result.stats.failed_requests == 1


@pytest.mark.parametrize(("options", "message"), [
    (dict(kv_cache_memory=100, page_bytes=PAGE_BYTES), "holds no KV block"),
    (dict(kv_cache_memory=-1), "kv_cache_memory must be a whole number of bytes"),
    (dict(kv_cache_memory=1 * 2**20, policy="no-such-policy"), "unknown policy"),
    (dict(kv_cache_memory=1 * 2**20, block_size=0), "block_size must be a positive whole number"),
    (dict(kv_cache_memory=1 * 2**20, static_offload=True, max_offload_ratio=0.0),
     "static_offload needs EngineConfig.max_offload_ratio"),
    (dict(kv_cache_memory=1 * 2**20, device="tpu"), "device must be one of"),
])
def test_bad_options_are_user_errors(tiny_checkpoint, options, message):
    with pytest.raises(UserError, match=message):
        Engine(tiny_checkpoint("mixtral"), **options)


def test_missing_model_dir_and_hybrid_caching_beside_host_kv_are_user_errors(tmp_path, tiny_checkpoint):
    with pytest.raises(UserError, match="not a checkpoint directory"):
        Engine(tmp_path / "nope", kv_cache_memory=1 * 2**20)
    with pytest.raises(UserError, match="prefix caching of a hybrid .* beside host KV is not supported"):
        Engine(tiny_checkpoint("qwen3_next"), kv_cache_memory=2**20, kv_host_memory=2**20, enable_prefix_caching=True)
    engine = Engine(tiny_checkpoint("mixtral"), kv_cache_memory=1 * 2**20)
    with pytest.raises(UserError, match="outside the vocabulary"):
        engine.generate([[1, 2, 10**6]], 2)
    with pytest.raises(UserError, match="empty"):
        engine.generate([[]], 2)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_cuda_tight_budget_matches_transformers(arch, tiny_checkpoint, hf_reference):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    engine = Engine(tiny_checkpoint(arch), kv_cache_memory=STATIC_PAGES[arch] * PAGE_BYTES, max_offload_ratio=0.25,
                    static_offload=True, device="cuda", **TIGHT)
    assert engine.parts.experts.stager.host.is_pinned()
    result = engine.generate(parity_prompts(), MAX_TOKENS)
    assert [o.token_ids for o in result.outputs] == hf_reference(arch)
    assert result.stats.preemptions > 0 and result.stats.experts_offloaded > 0


def test_a_hybrid_models_default_block_size_fits_one_layers_state_in_a_page(tiny_checkpoint):
    """vLLM's rule on the engine's bytes: the fewest multiples of 16 tokens whose KV page holds one Gated DeltaNet
    layer's state (recurrent part in fp32), so a sequence's state is one block per linear layer; 16 for a model of
    full attention alone; a given block size is kept."""
    from moetide.engine.models.hooks import StateLayout

    engine = Engine(tiny_checkpoint("qwen3_next"), kv_cache_memory=2**20)
    model, kv = engine.parts.model, engine.scheduler.kv
    layout = StateLayout.of(model.linear_state_shapes(), model.embed_tokens.weight.dtype)
    per_token = engine.storage.kv_layout.bytes_per_token
    bs = engine.config.block_size
    assert bs % 16 == 0 and (bs - 16) * per_token < layout.largest_layer_bytes <= bs * per_token
    assert kv.mamba.num_groups == len(model.linear_state_shapes()) == 3
    assert Engine(tiny_checkpoint("qwen3_next"), kv_cache_memory=2**20, block_size=16).config.block_size == 16
    assert Engine(tiny_checkpoint("qwen3_moe"), kv_cache_memory=2**20).config.block_size == 16


@pytest.mark.parametrize("block_size", [4, 16])
def test_a_hybrid_model_resumes_from_a_cached_state_token_for_token(block_size, tiny_checkpoint, hf_model):
    """Qwen3-Next with prefix caching (vLLM 0.32's align mode): the second turn extends the first, hits the
    blocks of the first prompt's last full boundary and resumes from the linear-attention state kept there; its
    continuation is transformers' greedy one of the whole second prompt."""
    generator = torch.Generator().manual_seed(3)
    first = torch.randint(1, 512, (21,), generator=generator).tolist()
    engine = Engine(tiny_checkpoint("qwen3_next"), kv_cache_memory=2**20, block_size=block_size, ignore_eos=True)
    out = engine.generate([first], 4).outputs[0].token_ids
    second = first + out + torch.randint(1, 512, (7,), generator=generator).tolist()
    result = engine.generate([second], 5)
    assert result.stats.prefix_hit_tokens == 20 // block_size * block_size > 0
    assert [o.token_ids for o in result.outputs] == greedy_reference(hf_model, [second], 5)("qwen3_next")
    check_books(engine)
