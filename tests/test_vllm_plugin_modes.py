"""How vLLM runs the forward, as the plugin sees it: which modes it refuses (one line naming the flag to add), and
the compile cache's key, which must tell a forward holding the expert pager from one without it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moetide.vllm.plugin import unsupported_mode


@pytest.mark.parametrize("policy, device, cuda_graphs, refused", [
    ("vamp", "cuda", True, True),
    ("static-offload", "cuda", True, True),
    ("vamp", "cuda", False, False),  # --enforce-eager
    ("vllm", "cuda", True, False),  # nothing offloaded: the pager is not in the forward
    ("vamp", "cpu", False, False),  # the CPU: eager and compiled (its graphs are never CUDA graphs)
])
def test_offloading_under_cuda_graphs_is_refused_in_one_line(policy, device, cuda_graphs, refused):
    reason = unsupported_mode(policy, device, cuda_graphs)
    assert (reason is not None) == refused
    if refused:
        assert "\n" not in reason and reason.endswith("add --enforce-eager") and repr(policy) in reason


@pytest.mark.parametrize("cuda_graphs", [True, False])  # vLLM's default, and --enforce-eager
@pytest.mark.parametrize("device, mode, flag", [
    ("cpu", dict(pipeline_parallel=2), "--pipeline-parallel-size"),
    ("cuda", dict(expert_parallel=True), "--enable-expert-parallel"),
    ("xpu", {}, "policy 'vllm'"),
])
def test_parallelism_and_platforms_the_line_does_not_cover_are_refused_in_one_line(device, mode, flag, cuda_graphs):
    reason = unsupported_mode("vamp", device, cuda_graphs, **mode)
    assert reason is not None and "\n" not in reason and flag in reason
    assert unsupported_mode("vllm", device, cuda_graphs, **mode) is None  # nothing offloaded: vLLM's own modes


def test_the_compile_cache_key_covers_the_plugins_settings():
    """vLLM's ``KVTransferConfig.compute_hash`` counts no factor; with the plugin loaded (vLLM's own entry-point
    loading, in a fresh process) two settings that change the forward hash apart, and other connectors are left
    as vLLM hashes them."""
    pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")
    code = """
import json
from vllm.config.kv_transfer import KVTransferConfig
before = KVTransferConfig(kv_connector="OtherConnector", kv_role="kv_both").compute_hash()
from vllm.plugins import load_general_plugins
load_general_plugins()
from moetide.vllm.settings import PluginSettings
hashes = {p: KVTransferConfig(**PluginSettings(policy=p).kv_transfer_config()).compute_hash()
          for p in ("vllm", "vamp")}
hashes["other"] = KVTransferConfig(kv_connector="OtherConnector", kv_role="kv_both").compute_hash()
hashes["other_before"] = before
print(json.dumps(hashes))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    hashes = json.loads(done.stdout.strip().splitlines()[-1])
    assert hashes["vllm"] != hashes["vamp"]
    assert hashes["other"] == hashes["other_before"]


def test_moetides_scheduler_without_its_plugin_is_refused_in_one_line(tmp_path):
    """``MOETIDE_VLLM_DISABLE=1`` with moetide's scheduler and connector configured: without the plugin's patches
    the pool would be sized without the line and nothing would back its blocks, so the engine refuses to start."""
    pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")
    pytest.importorskip("transformers")
    import os
    from pathlib import Path

    from moetide.engine.testmodel import TinyModelArgs, make_test_model

    model = make_test_model(TinyModelArgs(arch="qwen3_moe", head_dim=64, dtype="bfloat16"), tmp_path / "m")
    spec = {"model": str(model), "max_model_len": 512, "kv_cache_memory": 4 << 20, "max_tokens": 2,
            "batches": [["hello"]], "plugin": {"policy": "static-offload"}}  # vLLM's default mode
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_generate.py")), json.dumps(spec)],
                          env=dict(os.environ, MOETIDE_VLLM_DISABLE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "MOETIDE_VLLM_DISABLE=1 turns its vLLM plugin off: unset it, or leave out --scheduler-cls" in done.stderr
    assert "Model loading took" not in done.stderr, "refused only after the model loaded"
