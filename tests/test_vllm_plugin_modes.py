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
