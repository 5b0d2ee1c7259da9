"""The plugin in a running vLLM 0.32 on the CPU, with ``make-test-model`` checkpoints (qwen3_moe, mixtral, and
qwen3_next in bf16 with linear-attention heads of 128), in vLLM's default mode (a compiled forward: Dynamo traces
through the MoE method), and eager (``enforce_eager``) on qwen3_moe. The two modes' kernels differ, so each is
compared with stock vLLM in the same mode.

The line is exercised (``line_cycle_steps``: grant the reserve, give it back once drained, grant it again) while
batches of prompts longer than the base pool holds run, in-process and with vLLM's multiprocessing. While a region
is out its experts are offloaded and the expert pager stages them from host copies when routed. Greedy outputs
must equal stock vLLM's (the plugin disabled by ``MOETIDE_VLLM_DISABLE``), up to stock vLLM's own near-ties
(``tests/greedy.py``: with more KV blocks vLLM batches differently, which flips near-tied tokens in stock vLLM
too), and no offloaded expert may be routed without being staged. The worker's KV backing must show the memory:
the reserve's resident bytes rise while a granted region holds KV and fall to nothing when it goes back.
Each engine runs in a fresh process (``tests/vllm_generate.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from greedy import check_greedy, run_vllm, stock_scorer

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")

ARCHS = {  # KV budget per architecture: a base pool smaller than a batch needs
    "qwen3_moe": 2 << 20,
    "mixtral": 2 << 20,
    "qwen3_next": 8 << 20,
}
PLUGIN = {"policy": "static-offload", "max_offload_ratio": 0.5, "line_cycle_steps": 5,
          "costs": {"prefill_s_per_token": 1e-4, "copy_s_per_expert": 1e-6}}
MOE_LAYERS = {"qwen3_moe": 2, "mixtral": 2, "qwen3_next": 4}  # the tiny checkpoints' MoE layers, of 4 experts


def plugin_for(arch: str) -> dict:
    """``PLUGIN`` with a 16 MiB line whatever the checkpoint's experts weigh (the settings' ``experts`` stand in for
    them, layer for layer and expert for expert, so the workers' routing counts fit the line)."""
    layers = MOE_LAYERS[arch]
    return {**PLUGIN, "experts": {"num_layers": layers, "num_experts": 4, "experts_per_token": 2,
                                  "expert_bytes": (8 << 20) // layers}}


BATCHES = [[f"request {i} " + "word " * (80 + 30 * i) for i in range(8)],
           [f"again {i} " + "token " * (60 + 25 * i) for i in range(6)]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    pytest.importorskip("transformers")
    from moetide.engine.testmodel import TinyModelArgs, make_test_model

    root = tmp_path_factory.mktemp("vllm_checkpoints")
    out = {}
    for arch in ARCHS:  # vLLM's CPU attention needs head_dim >= 32 and bf16
        extra = {"linear_head_dim": 128} if arch == "qwen3_next" else {}
        make_test_model(TinyModelArgs(arch=arch, head_dim=64, dtype="bfloat16", **extra), root / arch)
        out[arch] = root / arch
    return out


MODES = {"default": False, "eager": True}  # enforce_eager


ASYNC_SCHEDULER = "moetide.vllm.scheduler.MoetideAsyncScheduler"


def generate(model: Path, arch: str, *, plugin: dict | None, multiprocessing: bool, mode: str) -> dict:
    """One run; with the plugin under vLLM's multiprocessing, moetide's ``AsyncScheduler`` (what the GPU default
    runs; vLLM's CPU engine steps it synchronously), in-process its ``Scheduler``."""
    spec = {"model": str(model), "max_model_len": 1024, "kv_cache_memory": ARCHS[arch], "max_tokens": 24,
            "batches": BATCHES, "plugin": plugin, "enforce_eager": MODES[mode]}
    if plugin is not None and multiprocessing:
        spec["scheduler_cls"] = ASYNC_SCHEDULER
    return run_vllm(spec, plugin=plugin is not None, multiprocessing=multiprocessing)


def check_outputs(model: Path, result: dict, stock_result: dict, mode: str) -> dict:
    """The plugin's greedy tokens against stock vLLM's, up to stock vLLM's own near-ties (``tests/greedy.py``)."""
    def flat(batches: list) -> list:
        return [seq for batch in batches for seq in batch]

    assert result["prompts"] == stock_result["prompts"]
    report = check_greedy(flat(result["outputs"]), flat(stock_result["outputs"]), flat(result["prompts"]),
                          stock_scorer(model, enforce_eager=MODES[mode]))
    print("greedy against stock vLLM:", report)
    return report


@pytest.fixture(scope="module")
def stock(checkpoints):
    """Stock vLLM's outputs per (architecture, mode), each run once when first asked for."""
    runs: dict[tuple[str, str], dict] = {}

    def outputs(arch: str, mode: str) -> dict:
        if (arch, mode) not in runs:
            runs[arch, mode] = generate(checkpoints[arch], arch, plugin=None, multiprocessing=False, mode=mode)
        return runs[arch, mode]

    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("arch, multiprocessing, mode", [  # every architecture in vLLM's default mode; eager once,
    # as its path through the plugin is the same for each; multiprocessing once, the same for every arch
    ("qwen3_moe", False, "default"), ("mixtral", False, "default"), ("qwen3_next", False, "default"),
    ("qwen3_moe", True, "default"), ("qwen3_moe", False, "eager"),
])
def test_outputs_equal_stock_vllm_through_grants_and_give_backs(checkpoints, stock, arch, multiprocessing, mode):
    result = generate(checkpoints[arch], arch, plugin=plugin_for(arch), multiprocessing=multiprocessing, mode=mode)
    check_outputs(checkpoints[arch], result, stock(arch, mode), mode)
    (stats,) = result["stats"]  # one worker
    grows = [h for h in stats["history"] if h[0]]
    backs = [h for h in stats["history"] if not h[0]]
    assert len(grows) >= 2 and backs, stats["history"]
    # a region given back held KV (resident bytes rose while granted) and returns every page it had
    assert any(before > 0 for _, before, _, _ in backs), stats["history"]
    assert all(after == lent == 0 for _, _, after, lent in backs), stats["history"]
    assert all(before == after == 0 for _, before, after, _ in grows)  # a grant commits nothing by itself
    assert stats["resident_reserve_bytes"] <= stats["reserve_bytes"]
    # the regions' experts were served from their host copies: staged into slots when routed
    pager = stats["pager"]
    assert pager["stagings"] > 0 and pager["staged_bytes"] > 0
    assert pager["unstaged"] == 0  # every routed offloaded expert was staged, in every step
    if not multiprocessing:  # the workers' routing reached the scheduler's residency, which picks the coldest
        line = result["line"]
        assert line["routed_steps"] > 0 and sum(map(sum, line["hotness"])) > 0, line
    # ... and their home rows' pages were lent to the KV cache while they were out (none while all are home)
    assert pager["peak_lent_bytes"] > 0
    assert (pager["lent_bytes"] > 0) == (pager["offloaded_experts"] > 0)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """Experts of 1.5 MiB (whole pages), so the offload cap of a tiny model is worth KV blocks of its own."""
    pytest.importorskip("transformers")
    from moetide.engine.testmodel import TinyModelArgs, make_test_model

    return make_test_model(TinyModelArgs(arch="qwen3_moe", head_dim=64, dtype="bfloat16", moe_intermediate_size=4096),
                           tmp_path_factory.mktemp("vllm_wide") / "qwen3_moe")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default"])  # the backing is the same in eager, which the test above runs
def test_the_kv_cache_grows_into_the_experts_own_memory(wide_checkpoint, mode):
    """The whole line: the line's blocks are the offloaded experts' pages (the model's own experts size the line
    here), so a grant takes no memory beyond the experts', and the outputs are stock vLLM's."""
    stock_result = generate(wide_checkpoint, "qwen3_moe", plugin=None, multiprocessing=False, mode=mode)
    result = generate(wide_checkpoint, "qwen3_moe", plugin=PLUGIN, multiprocessing=True, mode=mode)
    check_outputs(wide_checkpoint, result, stock_result, mode)
    (stats,) = result["stats"]
    grows = [h for h in stats["history"] if h[0]]
    assert len(grows) >= 2 and all(lent > 0 for *_, lent in grows), stats["history"]
    # no anonymous page in the reserve, ever: every granted block is backed by an expert page
    assert all(before == after == 0 for _, before, after, _ in stats["history"]), stats["history"]
    pager = stats["pager"]
    assert pager["stagings"] > 0 and pager["unstaged"] == 0
    # the experts' memory is all there is: their rows and the staging rows written, nothing for the KV it lent ...
    assert 0 < pager["expert_file_bytes"] <= pager["home_bytes"] + pager["staging_bytes"]
    # ... and the staging rows, one area for every layer, cost less than the line lent to the KV cache
    assert pager["staging_bytes"] < pager["peak_lent_bytes"], pager


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default"])  # the compiled forward; the design touches nothing eager runs apart
def test_the_cuda_design_of_the_line_runs_inside_vllm_on_the_host_driver(wide_checkpoint, mode):
    """The line as CUDA runs it (``vllm.vmm``: the experts' and the KV cache's memory as driver chunks, a grant
    moving the offloaded experts' own chunks under the granted blocks), inside vLLM on the CPU, with the driver's
    calls done by ``HostDriver`` (``cpu_vmm_granule``). A 384 KiB granule cuts the experts' 1 MiB and 512 KiB rows,
    so the line values an expert at its whole granules and the backing's spare covers the blocks' edges. The
    device never holds more than at start-up, and the tokens are stock vLLM's."""
    plugin = {**PLUGIN, "cpu_vmm_granule": 384 << 10}
    stock_result = generate(wide_checkpoint, "qwen3_moe", plugin=None, multiprocessing=False, mode=mode)
    result = generate(wide_checkpoint, "qwen3_moe", plugin=plugin, multiprocessing=True, mode=mode)
    check_outputs(wide_checkpoint, result, stock_result, mode)
    (stats,) = result["stats"]
    grows = [grow for grow, _ in stats["history"]]
    assert grows.count(True) >= 2 and False in grows, stats["history"]
    assert stats["device_peak_bytes"] == stats["device_budget_bytes"] > 0  # nothing created after start-up
    assert all(held <= stats["device_budget_bytes"] for _, held in stats["history"])
    pager = stats["pager"]
    assert pager["stagings"] > 0 and pager["unstaged"] == 0 and pager["peak_lent_bytes"] > 0
