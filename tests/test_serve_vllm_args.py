"""``moetide serve --engine vllm``'s translation to vLLM's server (``commands.serve_vllm``), without starting it:
the API key reaches vLLM in its environment and never on its command line, which is printed."""

from __future__ import annotations

import pytest

from moetide.cli import build_parser
from moetide.commands.serve import api_key
from moetide.commands.serve_vllm import vllm_argv, vllm_env
from moetide.errors import UserError


def translate(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    args, extra = build_parser("serve").parse_known_args(["serve", "--engine", "vllm", "--model", "DIR", *argv])
    defaults = args._parser.parse_known_args(["--model", "DIR"])[0]
    return vllm_argv(args, defaults, extra), vllm_env(api_key(args))


def test_the_key_goes_to_vllms_environment_not_its_command_line(monkeypatch):
    monkeypatch.delenv("MOETIDE_API_KEY", raising=False)
    argv, env = translate(["--api-key", "s3cret"])
    assert env == {"VLLM_API_KEY": "s3cret"}
    assert not any("s3cret" in word for word in argv) and "--api-key" not in argv
    monkeypatch.setenv("MOETIDE_API_KEY", "from-env")
    assert translate([])[1] == {"VLLM_API_KEY": "from-env"}
    assert translate(["--api-key", "flag-wins"])[1] == {"VLLM_API_KEY": "flag-wins"}
    monkeypatch.delenv("MOETIDE_API_KEY")
    assert translate([])[1] == {}


def test_a_key_with_spaces_is_refused(monkeypatch):
    monkeypatch.delenv("MOETIDE_API_KEY", raising=False)
    with pytest.raises(UserError, match="--api-key must be a non-empty key without spaces"):
        translate(["--api-key", "two words"])


def test_a_cost_record_becomes_the_plugins_costs(tmp_path):
    """--vamp-costs (a record, or the report `moetide calibrate --engine vllm --costs-out` writes) reaches the
    plugin as its settings' ``costs``, not as a flag vLLM would refuse."""
    import json

    record = {"prefill_s_per_token": 1.2e-4, "copy_s_per_expert": 1.4e-4}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"vamp_costs": record}))
    argv, _ = translate(["--policy", "vamp", "--vamp-costs", str(path)])
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["costs"] == record
    assert "--vamp-costs" not in argv
    assert "costs" not in json.loads(translate(["--policy", "vamp"])[0][3])["kv_connector_extra_config"]


def test_the_host_tier_options_become_the_plugins_settings():
    """--kv-host-memory and the split options reach the plugin (``vllm.host_tier``); the host tier's admission
    bound, which only moetide's engine has, goes to vLLM's parser as written, where ``vllm.server`` refuses it."""
    import json

    argv, _ = translate(["--kv-host-memory", "64MiB", "--split-policy", "fixed-ratio", "--split-fixed-ratio", "0.25",
                         "--kv-host-active-memory", "8MiB"])
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert (extra["kv_host_memory"], extra["split_policy"], extra["split_fixed_ratio"]) == (64 << 20, "fixed-ratio",
                                                                                           0.25)
    assert "--kv-host-memory" not in argv and "--kv-host-active-memory" in argv
    with pytest.raises(UserError, match="kv_host_memory .* and policy 'vamp'"):
        translate(["--kv-host-memory", "64MiB", "--policy", "vamp"])
