"""Host KV and split attention (WriteScope's engine half): with a device KV budget small enough that sequences
spill to host blocks, greedy output still matches transformers token for token under every split policy; the
split backend's attention equals the paged backend's for any split point; the pool uses device blocks first; and
the counters prove host blocks were written, attended by the CPU in place and streamed.
"""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from moetide.cli import main  # noqa: E402
from moetide.core.blocks import BlockPool, HostTier  # noqa: E402
from moetide.core.splits import BASELINES, SPLIT_POLICIES, SeqSplit, SplitCosts, SplitPolicy  # noqa: E402
from moetide.engine.attention import PagedAttentionBackend  # noqa: E402
from moetide.engine.models import StepBatch  # noqa: E402
from moetide.engine.loader import load_model  # noqa: E402
from moetide.engine.runner import Engine  # noqa: E402
from moetide.engine.split_attention import cpu_partial_attention, partial_attention  # noqa: E402
from moetide.engine.split_backend import SplitAttentionBackend  # noqa: E402
from moetide.engine.split_plan import SplitStepper  # noqa: E402
from moetide.engine.storage import KVLayout  # noqa: E402
from moetide.engine.testmodel import ARCHS as ENGINE_ARCHS  # noqa: E402
from moetide.errors import UserError  # noqa: E402
from engine_parity import BLOCK_SIZE, MAX_TOKENS, PAGE_BYTES, TIGHT, check_books, parity_prompts  # noqa: E402

DEVICE_PAGES = 3  # a few device blocks: every sequence but the first few spills to host
SPILL = dict(TIGHT, kv_cache_memory=DEVICE_PAGES * PAGE_BYTES, kv_host_memory=1 * 2**20)


def balanced_costs(device_tokens: int, num_queries: int) -> SplitCosts:
    """CPU and streaming equally fast, no fixed costs: writescope's optimum is an interior split (the online
    correction moves it, but within its [0.25, 4] bound, never to an end)."""
    return SplitCosts(cpu_s_per_byte=1e-9, cpu_fixed_s=0.0, cpu_per_seq_s=0.0, stream_s_per_byte=1e-9,
                      stream_fixed_s=0.0, stream_per_seq_s=0.0, gpu_fixed_s=0.0, merge_per_seq_s=0.0)


# ---- the pool: device first ----------------------------------------------------------------------------------


def test_pool_allocates_device_blocks_first_then_host():
    device, host = list(range(4)), list(range(100, 104))
    pool = BlockPool(device, host_tier=HostTier(100, len(host)))
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 100]
    pool.free([1])
    pool.check_invariants()
    assert pool.allocate(2) == [1, 101], "a freed device block is used before any further host block"
    pool.cache_block(0, 11, None)
    pool.free([0, 2, 3])
    assert pool.evict(1) == [0]
    pool.check_invariants()
    assert pool.allocate(3) == [0, 2, 3], "device blocks enter the queue's head: the evicted one, then the freed ones"
    pool.add_blocks([4])  # an expert region converted to KV: new device blocks also go first
    assert pool.allocate(2) == [4, 102]
    pool.check_invariants()
    assert BlockPool([5, 1, 3]).allocate(3) == [5, 1, 3], "without a host tier: plain FIFO"


# ---- the backend: any split equals the paged backend ---------------------------------------------------------


class RandomSplit(SplitPolicy):
    """Each sequence's CPU share of its host blocks drawn at random; ``share`` forces 0 or 1 for all."""

    name = "random"

    def __init__(self, seed: int, share: float | None = None) -> None:
        self.rng, self.share = random.Random(seed), share

    def split(self, costs, seqs, block_bytes, factor=1.0):
        out = []
        for s in seqs:
            n = s.num_host_blocks
            c = self.rng.randint(0, n) if self.share is None else round(self.share * n)
            out.append(SeqSplit(s.seq_id, s.num_device_blocks, c, n - c))
        return tuple(out)


def random_step(backends_tables, layout, steps, seed):
    """Run the same steps (StepBatch, per-layer q/k/v) through each (backend, tables); return every output."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = 4, layout.num_kv_heads, layout.head_dim
    outs = [[] for _ in backends_tables]
    for batch in steps:
        t = batch.num_tokens
        layers = [(torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g),
                   torch.randn(t, hkv, d, generator=g)) for _ in layout.attn_layer_ids]
        for (backend, tables), out in zip(backends_tables, outs):
            backend.prepare(batch, tables)
            for layer_id, (q, k, v) in zip(layout.attn_layer_ids, layers):
                out.append(backend.attend(layer_id, q, k, v, batch, d**-0.5))
            backend.end_step()
    return outs


@pytest.mark.parametrize("share", [0.0, 1.0, None, None])
def test_split_backend_equals_paged_for_any_split(tiny_checkpoint, share):
    """Sequences of 3-40 tokens whose blocks mix device and host ids at random: a prefill step writes them, then
    a step of decodes and prefill chunks attends them. The split backend (CPU in place / streamed cut at random,
    or all to one side) gives the paged backend's output (all-device tables, same K/V) to fp32 rounding."""
    engine = Engine(tiny_checkpoint("qwen3_moe"), kv_cache_memory=64 * PAGE_BYTES, kv_host_memory=1 * 2**20,
                    page_bytes=PAGE_BYTES, block_size=BLOCK_SIZE)
    storage, host, layout = engine.storage, engine.host_kv, engine.storage.kv_layout
    rng = random.Random(7 if share is None else int(share))
    contexts, extra = [3, 17, 40, 9, 24], [1, 1, 7, 1, 5]
    num_blocks = [-(-(c + e) // BLOCK_SIZE) for c, e in zip(contexts, extra)]
    device_ids = storage.arena.kv_block_ids()
    paged_tables, split_tables, d_next, h_next = [], [], 0, iter(host.block_ids)
    split_device = iter(device_ids[sum(num_blocks):])
    for n in num_blocks:
        paged_tables.append(device_ids[d_next : d_next + n])
        d_next += n
        split_tables.append([next(h_next) if rng.random() < 0.6 else next(split_device) for _ in range(n)])
    stepper = SplitStepper(RandomSplit(seed=3, share=share), balanced_costs, layout.block_bytes)
    split = SplitAttentionBackend(storage, host, stepper)
    steps = [StepBatch.of([(i, c, 0) for i, c in enumerate(contexts)]),
             StepBatch.of([(i, e, c) for i, (c, e) in enumerate(zip(contexts, extra))])]
    paged_out, split_out = random_step([(PagedAttentionBackend(storage), paged_tables), (split, split_tables)],
                                       layout, steps, seed=11)
    for a, b in zip(paged_out, split_out):
        torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-5)
    c = split.counters
    assert c.steps == 2 and c.host_tokens_written > 0
    if share == 0.0:
        assert c.cpu_blocks == 0 < c.streamed_blocks
    elif share == 1.0:
        assert c.streamed_blocks == 0 < c.cpu_blocks
    else:
        assert c.cpu_blocks > 0 and c.streamed_blocks > 0 and c.cpu_s > 0
    split.close()


@pytest.mark.parametrize(("heads", "kv_heads", "queries", "head_dim"), [(8, 2, 5, 16), (8, 2, 200, 8), (4, 4, 70, 8)])
def test_cpu_kernel_matches_the_reference_with_empty_rows(heads, kv_heads, queries, head_dim):
    """torch's CPU flash kernel says lse = 0 for a row with no key; the wrapper says -inf, as the merge needs.
    Short chunks fold the GQA group into rows, long masked chunks (200 queries) repeat the KV heads instead."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, queries, head_dim, generator=g)
    k, v = (torch.randn(2, kv_heads, 9, head_dim, generator=g) for _ in range(2))
    mask = torch.rand(2, 1, queries, 9, generator=g) > 0.4
    mask[1, 0, 3] = False
    out, lse = cpu_partial_attention(q, k, v, 0.25, mask)
    ref_out, ref_lse = partial_attention(q, k, v, 0.25, mask)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[1, :, 3]).all() and (out[1, :, 3] == 0).all()
    torch.testing.assert_close(cpu_partial_attention(q, k, v, 0.25)[0], partial_attention(q, k, v, 0.25)[0],
                               rtol=1e-5, atol=1e-5)
    empty_out, empty_lse = cpu_partial_attention(q, k[:, :, :0], v[:, :, :0], 0.25)
    assert (empty_out == 0).all() and torch.isneginf(empty_lse).all()


# ---- the engine against transformers, with spilling ----------------------------------------------------------


def run_spilled(checkpoint, policy, **options):
    engine = Engine(checkpoint, split_policy=policy, **{**SPILL, **options})
    result = engine.generate(parity_prompts(), MAX_TOKENS)
    return engine, result


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
@pytest.mark.parametrize("policy", tuple(SPLIT_POLICIES))
def test_spilled_kv_matches_transformers_under_every_split_policy(arch, policy, tiny_checkpoint, hf_reference):
    engine, result = run_spilled(tiny_checkpoint(arch), policy, split_costs=balanced_costs)
    assert [o.token_ids for o in result.outputs] == hf_reference(arch)
    assert all(o.finish_reason == "length" for o in result.outputs)
    stats, split = result.stats, result.stats.split
    assert stats.split_policy == policy and stats.kv_host_blocks == engine.host_kv.num_blocks
    assert split["host_tokens_written"] > 0 and split["steps"] > 0 and split["device_blocks"] > 0
    if policy in ("writescope", "fixed-ratio"):
        assert split["cpu_blocks"] > 0 and split["streamed_blocks"] > 0
    if policy == "transfer-all":
        assert split["cpu_blocks"] == 0 < split["streamed_blocks"] and split["cpu_s"] == 0
    if policy == "cpu-all":
        assert split["streamed_blocks"] == 0 < split["cpu_blocks"]
    if policy == "writescope":  # the measured CPU time reached the online correction
        assert split["cpu_s"] > 0 and split["correction_factor"] != 1.0
        assert engine.parts.attention.stepper.planner.correction.num_samples > 0
    if arch != "qwen3_next":
        assert stats.prefix_hit_tokens > 0
    check_books(engine)


def test_writescope_probes_a_cpu_it_gives_no_work(tiny_checkpoint, hf_reference):
    """A CPU judged 4x slower than its model (k = 4) with costs that never make it worth any work (a 10 ms fixed
    cost against microseconds of streaming): writescope streams everything, except that every 17th plan without
    CPU work is a probe. Each probe's measured CPU time (far below the 10 ms predicted) takes k by 0.7 toward ~0,
    and the output still matches transformers."""
    def slow_cpu(device_tokens: int, num_queries: int) -> SplitCosts:
        return SplitCosts(cpu_s_per_byte=1e-9, cpu_fixed_s=0.01, cpu_per_seq_s=0.0, stream_s_per_byte=1e-9,
                          stream_fixed_s=0.0, stream_per_seq_s=0.0, gpu_fixed_s=0.0, merge_per_seq_s=0.0)

    engine = Engine(tiny_checkpoint("qwen3_moe"), split_policy="writescope", split_costs=slow_cpu, **SPILL)
    planner = engine.parts.attention.stepper.planner
    planner.correction.factor = 4.0
    result = engine.generate(parity_prompts(), MAX_TOKENS)
    assert [o.token_ids for o in result.outputs] == hf_reference("qwen3_moe")
    split = result.stats.split
    assert split["probes"] == planner.num_probes >= 2
    assert 0 < split["cpu_blocks"] < split["streamed_blocks"] and split["cpu_s"] > 0
    assert planner.correction.num_samples == split["probes"] and split["correction_factor"] < 0.7 ** 2 * 4 + 0.3
    check_books(engine)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_next"])
def test_everything_on_the_host_with_perf_costs_matches_transformers(arch, tiny_checkpoint, hf_reference):
    """A device KV budget of 0: every block — and Qwen3-Next's linear state blocks — is a host block; the split
    comes from perf's costs (the default path), and preemption happens on top (a small host budget)."""
    checkpoint = tiny_checkpoint(arch)
    block_bytes = KVLayout.of(load_model(checkpoint), BLOCK_SIZE).block_bytes
    host_bytes = 60 * block_bytes + (68 * 1024 if arch == "qwen3_next" else 0)
    engine = Engine(checkpoint, kv_cache_memory=0, kv_host_memory=host_bytes, **TIGHT)
    assert engine.storage.arena.num_kv_blocks == 0
    result = engine.generate(parity_prompts(), MAX_TOKENS)
    assert [o.token_ids for o in result.outputs] == hf_reference(arch)
    split = result.stats.split
    assert split["device_blocks"] == 0 and split["cpu_blocks"] + split["streamed_blocks"] > 0
    assert result.stats.preemptions > 0
    check_books(engine)


def test_spilling_with_expert_offload_matches_transformers(tiny_checkpoint, hf_reference):
    """Static expert offload turns expert pages into device KV blocks beside the host ones."""
    engine, result = run_spilled(tiny_checkpoint("mixtral"), "writescope", split_costs=balanced_costs,
                                 max_offload_ratio=0.25, static_offload=True)
    assert [o.token_ids for o in result.outputs] == hf_reference("mixtral")
    assert result.stats.experts_offloaded > 0 and result.stats.split["host_tokens_written"] > 0
    check_books(engine)


def test_a_host_kv_bound_and_prefix_eviction_keep_parity(tiny_checkpoint, hf_reference):
    """A bound of 4 host blocks attended per step defers admissions (the prompts spill far more than that
    together); evicting cached device prefixes first writes less KV to the host. Output matches transformers."""
    checkpoint = tiny_checkpoint("qwen3_moe")
    block_bytes = KVLayout.of(load_model(checkpoint), BLOCK_SIZE).block_bytes
    free_engine, free = run_spilled(checkpoint, "writescope", split_costs=balanced_costs)
    bound_engine, bound = run_spilled(checkpoint, "writescope", split_costs=balanced_costs,
                                      kv_host_active_memory=4 * block_bytes)
    evict_engine, evict = run_spilled(checkpoint, "writescope", split_costs=balanced_costs,
                                      device_prefixes="evict")
    for result in (free, bound, evict):
        assert [o.token_ids for o in result.outputs] == hf_reference("qwen3_moe")
    assert free.stats.host_bound_waits == 0 < bound.stats.host_bound_waits
    assert bound.stats.steps > free.stats.steps  # fewer sequences at once
    assert bound_engine.scheduler.config.max_host_blocks_held == 4
    assert evict.stats.split["host_tokens_written"] < free.stats.split["host_tokens_written"]
    for engine in (free_engine, bound_engine, evict_engine):
        check_books(engine)


def test_host_hits_copied_to_device_blocks_keep_parity(tiny_checkpoint, monkeypatch):
    """Two turns: the second extends every first-turn conversation. Under a bound of 8 host blocks the second turn's
    host prefix hits do not fit, so their places in the prefix cache move to device blocks and the engine copies
    them before the step. Output equals an engine that keeps all KV on the device (itself transformers' parity
    engine); without the copy it does not."""
    checkpoint = tiny_checkpoint("qwen3_moe")
    block_bytes = KVLayout.of(load_model(checkpoint), BLOCK_SIZE).block_bytes
    prompts = parity_prompts()
    reference = Engine(checkpoint, **{**TIGHT, "kv_cache_memory": 512 * PAGE_BYTES})
    first = reference.generate(prompts, 8)
    second = [p + o.token_ids for p, o in zip(prompts, first.outputs)]
    expected = reference.generate(second, 8)
    engine = Engine(checkpoint, split_policy="writescope", split_costs=balanced_costs,
                    kv_host_active_memory=8 * block_bytes, **{**SPILL, "kv_cache_memory": 6 * PAGE_BYTES})
    assert [o.token_ids for o in engine.generate(prompts, 8).outputs] == [o.token_ids for o in first.outputs]
    result = engine.generate(second, 8)
    assert [o.token_ids for o in result.outputs] == [o.token_ids for o in expected.outputs]
    assert result.stats.host_blocks_promoted > 0 and result.stats.host_hits_recomputed == 0
    check_books(engine)
    monkeypatch.setattr(Engine, "_copy_promoted", lambda self, pairs: None)
    engine = Engine(checkpoint, split_policy="writescope", split_costs=balanced_costs,
                    kv_host_active_memory=8 * block_bytes, **{**SPILL, "kv_cache_memory": 6 * PAGE_BYTES})
    engine.generate(prompts, 8)
    assert [o.token_ids for o in engine.generate(second, 8).outputs] != [o.token_ids for o in expected.outputs]


# ---- options and the CLI -------------------------------------------------------------------------------------


def test_generate_cli_with_host_kv(tiny_checkpoint, capsys):
    model = tiny_checkpoint("qwen3_moe")
    rc = main(["generate", "--model", str(model), "--threads", "1", "--prompt", "Prefix caching keeps the blocks",
               "--max-tokens", "12", "--ignore-eos", "--kv-cache-memory", "0MiB", "--kv-host-memory", "1MiB",
               "--block-size", "4", "--split-policy", "fixed-ratio", "--split-fixed-ratio", "0.5", "--json", "-"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    [entry] = report["outputs"]
    engine = Engine(model, kv_cache_memory=1 * 2**20, block_size=4, ignore_eos=True)
    assert entry["token_ids"] == engine.generate([entry["prompt_token_ids"]], 12).outputs[0].token_ids
    stats = report["stats"]
    assert stats["split_policy"] == "fixed-ratio" and stats["kv_host_blocks"] > 0
    assert stats["split"]["cpu_blocks"] > 0 and stats["split"]["streamed_blocks"] > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--kv-host-memory", "0.0001MiB"], "holds no KV block"),
    (["--kv-host-memory", "1MiB", "--split-fixed-ratio", "2"], "--split-fixed-ratio must be in [0, 1]"),
    (["--kv-host-memory", "1MiB", "--cpu", "no-such-host"], "no-such-host"),
    (["--kv-host-active-memory", "1MiB"], "--kv-host-active-memory bounds a host KV tier: give --kv-host-memory too"),
    (["--kv-host-memory", "1MiB", "--kv-host-active-memory", "2MiB"],
     "--kv-host-active-memory must be in (0, --kv-host-memory = 1048576] bytes"),
])
def test_bad_host_kv_options_are_one_line_errors(tiny_checkpoint, capsys, args, message):
    model = str(tiny_checkpoint("mixtral"))
    capsys.readouterr()  # making the checkpoint may print progress
    rc = main(["generate", "--model", model, "--prompt", "hi", "--max-tokens", "2", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1


def test_baselines_are_the_core_registry():
    assert set(BASELINES) | {"writescope"} == set(SPLIT_POLICIES)
    with pytest.raises(UserError, match="unknown split policy"):
        SplitStepper("no-such", balanced_costs, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["writescope", "transfer-all", "cpu-all"])
def test_cuda_spilled_kv_matches_transformers(policy, tiny_checkpoint, hf_reference):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    engine, result = run_spilled(tiny_checkpoint("qwen3_moe"), policy, split_costs=balanced_costs, device="cuda")
    assert engine.host_kv.data.is_pinned()
    assert [o.token_ids for o in result.outputs] == hf_reference("qwen3_moe")
    assert result.stats.split["host_tokens_written"] > 0
    check_books(engine)


def test_perf_costs_read_a_calibrated_host_file(tiny_checkpoint, tmp_path):
    """``--cpu FILE``: the file's host figures and its fitted ``[offload_efficiency]`` set the CPU side."""
    from moetide.engine.split_plan import PerfSplitCosts

    host = tmp_path / "host.toml"
    host.write_text('cpu_model = "a calibrated VM"\nnum_cores = 2\nnum_memory_channels = 1\n'
                    'dram_mega_transfers_per_s = 3200\ndram_efficiency = 1.0\nfp32_flops_per_s = 9.0e10\n'
                    'dram_bytes = 25769803776\n\n[offload_efficiency]\ncpu_memory = 0.2\ncpu_sync_s = 8e-5\n')
    checkpoint = tiny_checkpoint("qwen3_moe")
    options = dict(gpu="a100-80gb", kv_dtype_bytes=4, block_size=BLOCK_SIZE)
    preset = PerfSplitCosts(checkpoint, host="ddr4-3200-8ch", **options)
    calibrated = PerfSplitCosts(checkpoint, host=str(host), **options)
    assert calibrated.attention.offload.cpu_memory == 0.2 and preset.attention.offload.cpu_memory == 0.9
    slow, fast = calibrated(100, 1), preset(100, 1)
    assert slow.cpu_s_per_byte > 10 * fast.cpu_s_per_byte and slow.cpu_fixed_s > fast.cpu_fixed_s
    assert slow.stream_s_per_byte == fast.stream_s_per_byte  # the GPU side is the GPU's
