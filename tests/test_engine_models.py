"""Engine models against transformers on the same tiny checkpoints: logits to fp32 round-off, greedy tokens exactly.

The engine runs ragged packed steps (several sequences' tokens in one tensor, no padding); transformers runs one
prompt at a time. Agreement therefore also checks that sequences in one step never see each other.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moetide.engine.loader import load_model  # noqa: E402
from moetide.engine.models import (  # noqa: E402
    ContiguousKVCache,
    ExpertProvider,
    ExpertWeights,
    StepBatch,
    StepContext,
    greedy_generate,
)
from moetide.engine.models.qwen3_next import chunked_gated_delta, recurrent_gated_delta  # noqa: E402
from moetide.engine.testmodel import ARCHS  # noqa: E402
from engine_parity import greedy_reference  # noqa: E402

MAX_NEW_TOKENS = 16
PROMPT_LENGTHS = (3, 9, 17, 70)  # 70 > one 64-token chunk of the chunked gated delta rule


def random_prompts(seed: int, lengths: tuple[int, ...], vocab_size: int = 512) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def fresh_context(model, entries: list[tuple[int, int, int]]) -> StepContext:
    return StepContext(StepBatch.of(entries), ContiguousKVCache(), model.new_linear_state_store())


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    """``hf_greedy(arch)``: transformers' greedy continuations of the test prompts, one prompt at a time."""
    return greedy_reference(hf_model, random_prompts(1, PROMPT_LENGTHS), MAX_NEW_TOKENS)


def run_continuous(model, prompts: list[list[int]], arrival_steps: list[int], chunk: int) -> list[list[int]]:
    """A miniature continuous-batching loop: each step packs, for every arrived unfinished sequence, its next prompt
    chunk (at most ``chunk`` tokens) or its last sampled token; finished sequences free their cache."""
    cache, states = ContiguousKVCache(), model.new_linear_state_store()
    computed, outputs, step = [0] * len(prompts), [[] for _ in prompts], 0
    while any(len(out) < MAX_NEW_TOKENS for out in outputs):
        entries, tokens = [], []
        for i, prompt in enumerate(prompts):
            if arrival_steps[i] > step or len(outputs[i]) == MAX_NEW_TOKENS:
                continue
            new = prompt[computed[i]:computed[i] + chunk] if computed[i] < len(prompt) else outputs[i][-1:]
            entries.append((i, len(new), computed[i]))
            tokens += new
        with torch.no_grad():
            next_ids = model(torch.tensor(tokens), StepContext(StepBatch.of(entries), cache, states)).argmax(-1)
        for (i, num_new, num_computed), token in zip(entries, next_ids.tolist()):
            computed[i] = num_computed + num_new
            if computed[i] >= len(prompts[i]):
                outputs[i].append(token)
            if len(outputs[i]) == MAX_NEW_TOKENS:
                cache.free(i)
                if states is not None:
                    states.free(i)
        step += 1
    return outputs


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_prefill_logits_match_transformers(arch, tiny_checkpoint, hf_model):
    model, hf = load_model(tiny_checkpoint(arch)), hf_model(arch)
    prompts = random_prompts(0, (1, 7, 70))
    tokens = torch.tensor([t for p in prompts for t in p])
    entries = [(i, len(p), 0) for i, p in enumerate(prompts)]
    with torch.no_grad():
        got = model(tokens, fresh_context(model, entries), all_logits=True)
        want = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
        last = model(tokens, fresh_context(model, entries))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    last_rows = torch.tensor([0, 7, 77])
    torch.testing.assert_close(last, got[last_rows], rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_packed_prefill_then_packed_decode_matches_generate(arch, tiny_checkpoint, hf_greedy):
    model = load_model(tiny_checkpoint(arch))
    assert greedy_generate(model, random_prompts(1, PROMPT_LENGTHS), MAX_NEW_TOKENS) == hf_greedy(arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_staggered_arrivals_and_chunked_prefill_match_generate(arch, tiny_checkpoint, hf_greedy):
    """Prompts arrive at steps 0, 0, 1, 2; the 70-token one is prefilled in 32-token chunks while the others
    decode, so steps mix prefill chunks that continue a cached sequence with decode tokens."""
    model = load_model(tiny_checkpoint(arch))
    got = run_continuous(model, random_prompts(1, PROMPT_LENGTHS), arrival_steps=[0, 0, 1, 2], chunk=32)
    assert got == hf_greedy(arch)


class RecordingExperts(ExpertProvider):
    """An ExpertProvider that records routing and fetches, optionally zeroing one expert's weights."""

    def __init__(self, inner, zero_expert: int | None = None) -> None:
        self.inner, self.zero_expert = inner, zero_expert
        self.routed: dict[int, set[int]] = {}
        self.fetched: dict[int, list[int]] = {}

    def route(self, layer_id, expert_ids):
        self.routed.setdefault(layer_id, set()).update(expert_ids.flatten().tolist())

    def expert_weights(self, layer_id, expert_id):
        self.fetched.setdefault(layer_id, []).append(expert_id)
        weights = self.inner.expert_weights(layer_id, expert_id)
        if expert_id == self.zero_expert:
            return ExpertWeights(torch.zeros_like(weights.gate_up), torch.zeros_like(weights.down))
        return weights


def test_expert_provider_sees_exactly_the_routed_experts(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3_moe"))  # layer 1 is dense: no routing there
    tokens = torch.tensor(random_prompts(2, (12,))[0])
    recorder = RecordingExperts(model.own_experts)
    with torch.no_grad():
        baseline = model(tokens, fresh_context(model, [(0, 12, 0)]))
        ctx = fresh_context(model, [(0, 12, 0)])
        ctx.experts = recorder
        recorded = model(tokens, ctx)
        ctx = fresh_context(model, [(0, 12, 0)])
        ctx.experts = RecordingExperts(model.own_experts, zero_expert=sorted(recorder.routed[0])[0])
        without_one = model(tokens, ctx)
    assert set(recorder.routed) == {0, 2}
    assert {layer: sorted(ids) for layer, ids in recorder.routed.items()} == recorder.fetched
    # the looped path (a provider without stacked views) against the native grouped kernel: fp32 round-off
    torch.testing.assert_close(recorded, baseline, rtol=1e-5, atol=1e-5 * float(baseline.abs().max()))
    assert not torch.allclose(without_one, baseline)


def test_chunked_and_recurrent_gated_delta_rule_agree():
    generator = torch.Generator().manual_seed(3)
    B, H, T, Dk, Dv = 2, 3, 70, 8, 6

    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    q = torch.nn.functional.normalize(rand(B, H, T, Dk), dim=-1) * Dk**-0.5
    k = torch.nn.functional.normalize(rand(B, H, T, Dk), dim=-1)
    v, g, beta, state = rand(B, H, T, Dv), -rand(B, H, T).abs(), rand(B, H, T).sigmoid(), rand(B, H, Dk, Dv)
    out_r, state_r = recurrent_gated_delta(q, k, v, g, beta, state)
    out_c, state_c = chunked_gated_delta(q, k, v, g, beta, state, chunk_size=16)
    torch.testing.assert_close(out_c, out_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state_c, state_r, rtol=1e-4, atol=1e-5)


def test_step_batch_layout_and_validation():
    batch = StepBatch.of([(7, 3, 0), (2, 1, 5), (4, 2, 1)])
    assert batch.num_tokens == 6
    assert batch.positions().tolist() == [0, 1, 2, 5, 1, 2]
    assert batch.last_token_indices().tolist() == [2, 3, 5]
    with pytest.raises(ValueError, match="appears twice"):
        StepBatch.of([(1, 1, 0), (1, 1, 1)])
    with pytest.raises(ValueError, match="num_new_tokens"):
        StepBatch.of([(1, 0, 0)])


def test_contiguous_cache_rejects_a_step_that_disagrees_with_it(tiny_checkpoint):
    model = load_model(tiny_checkpoint("mixtral"))
    cache = ContiguousKVCache()
    with torch.no_grad():
        model(torch.tensor([5, 6, 7]), StepContext(StepBatch.of([(0, 3, 0)]), cache))
        assert cache.num_cached_tokens(0, 0) == 3
        with pytest.raises(ValueError, match="step says 2 tokens are computed, the cache holds 3"):
            model(torch.tensor([8]), StepContext(StepBatch.of([(0, 1, 2)]), cache))
        with pytest.raises(ValueError, match="token_ids has shape"):
            model(torch.tensor([8, 9]), StepContext(StepBatch.of([(0, 1, 3)]), cache))


def test_hybrid_model_needs_a_linear_state_store(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3_next"))
    with pytest.raises(ValueError, match="linear_states"), torch.no_grad():
        model(torch.tensor([5, 6]), StepContext(StepBatch.of([(0, 2, 0)]), ContiguousKVCache()))
