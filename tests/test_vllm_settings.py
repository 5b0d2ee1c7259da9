"""The plugin's settings as vLLM carries them (kv_connector_extra_config): parsed without vLLM installed."""

from __future__ import annotations

import pytest

from moetide.vllm.settings import CONNECTOR_MODULE, CONNECTOR_NAME, ExpertShape, PluginSettings


def test_round_trip_and_transfer_config():
    settings = PluginSettings(policy="vamp", max_offload_ratio=0.2, vamp_horizon_s=30.0, clock="wall",
                              costs={"prefill_s_per_token": 1e-4, "copy_s_per_expert": 1e-3},
                              experts=ExpertShape(num_layers=4, num_experts=8, experts_per_token=2, expert_bytes=4096))
    assert PluginSettings.from_extra_config(settings.as_extra_config()) == settings
    transfer = settings.kv_transfer_config()
    assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == (CONNECTOR_NAME, CONNECTOR_MODULE)
    assert transfer["kv_connector_extra_config"] == settings.as_extra_config()
    assert PluginSettings.from_extra_config(None) == PluginSettings()  # vLLM's default extra config is {}


@pytest.mark.parametrize("extra, message", [
    ({"polcy": "vamp"}, "unknown key(s) polcy"),
    ({"policy": "lru"}, "kv_connector_extra_config.policy: unknown policy 'lru'"),
    ({"clock": "cpu"}, "kv_connector_extra_config.clock must be one of modeled, wall"),
    ({"max_offload_ratio": 1.5}, "kv_connector_extra_config.max_offload_ratio must be in [0, 1]"),
    ({"experts": {"num_layers": 0, "num_experts": 8, "experts_per_token": 2, "expert_bytes": 1}},
     "kv_connector_extra_config.experts.num_layers must be a positive whole number"),
    ({"experts": {"num_layers": 2}}, "kv_connector_extra_config.experts:"),
    ({"costs": {"prefill_s_per_token": "fast"}}, "kv_connector_extra_config.costs must be an object of finite"),
])
def test_bad_settings_name_the_key(extra, message):
    with pytest.raises(ValueError) as error:
        PluginSettings.from_extra_config(extra)
    assert message in str(error.value)


def test_cpu_vmm_granule_is_a_whole_number_of_pages():
    import mmap

    assert PluginSettings.from_extra_config({"cpu_vmm_granule": 16 * mmap.PAGESIZE}).cpu_vmm_granule == \
        16 * mmap.PAGESIZE
    for bad in (-1, mmap.PAGESIZE + 1, True, 1.5):
        with pytest.raises(ValueError, match="cpu_vmm_granule"):
            PluginSettings.from_extra_config({"cpu_vmm_granule": bad})
