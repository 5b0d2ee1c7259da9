"""One set of CLI conventions across verbs, following vLLM: sizes in bytes with unit suffixes, old spellings as
aliases that warn once, ``--json PATH`` with ``-`` for stdout, ``--model`` as a preset, a folder or a config.json,
and numbers printed in the unit their magnitude calls for."""

import argparse
import json

import pytest

from moetide.cli import main
from moetide.commands.options import parse_bytes
from moetide.report.units import count_text, duration_text, duration_unit, ratio_text
from test_newcomer import checkpoint_folder, one_error, small_trace


@pytest.mark.parametrize(("text", "value"), [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1e9", 1e9),
                                             ("1k", 1000), ("1K", 1024), ("8 GB", 8e9), ("4096", 4096)])
def test_sizes_take_vllm_suffixes(text, value):
    assert parse_bytes(text) == value


def test_a_size_without_meaning_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", "--kv-cache-memory", "2XB"])
    assert exit_info.value.code == 2
    assert "argument --kv-cache-memory: a size in bytes such as 2GiB" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("-1GiB")


@pytest.mark.parametrize(("argv", "replacement"), [
    (["replay", "--kv-budget-gib", "4"], "use --kv-cache-memory SIZE (e.g. 8GiB)"),
    (["generate", "--model", "x", "--kv-host-mib=4"], "use --kv-host-memory SIZE (e.g. 64MiB)"),
    (["replay", "--fixed-ratio", "0.5"], "use --split-fixed-ratio"),
    (["perf", "--tp", "2"], "use --tensor-parallel-size (or -tp)"),
])
def test_a_removed_spelling_names_its_replacement(capsys, argv, replacement):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [f"moetide {argv[0]}: error: {argv[-2 if '=' not in argv[-1] else -1].split('=')[0]} "
                                f"was removed in 0.2.0: {replacement} (CHANGELOG.md)"]


def test_split_fixed_ratio_is_one_name_in_both_drivers(capsys):
    for verb in ("replay", "generate"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        text = capsys.readouterr().out
        assert "--split-fixed-ratio" in text and "--kv-host-memory" in text and "--kv-cache-memory" in text
        assert "--fixed-ratio" not in text.replace("--split-fixed-ratio", "")


def test_engine_step_budget_is_vllms(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "token budget of a step, as in vLLM (default 8192)" in " ".join(capsys.readouterr().out.split())


def test_json_dash_is_stdout_everywhere(tmp_path, capsys):
    assert main(["replay", str(small_trace(tmp_path)), "--json", "-"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["metrics"]["completed"] == 6 and "MODELED" in captured.err
    for argv in (["specs", "--model", "qwen3-30b-a3b"], ["perf", "--model", "qwen3-30b-a3b", "--gpu", "h100"]):
        assert main([*argv, "--json", "-"]) == 0
        assert json.loads(capsys.readouterr().out)
        assert main([*argv, "--json", str(tmp_path / "x.json")]) == 0
        assert json.loads((tmp_path / "x.json").read_text()) and "wrote" in capsys.readouterr().out


def test_model_takes_a_checkpoint_folder_or_its_config(tmp_path, capsys):
    folder = checkpoint_folder(tmp_path)
    for model in (str(folder), str(folder / "config.json")):
        assert main(["specs", "--model", model]) == 0
        assert "ckpt" in capsys.readouterr().out
        assert main(["perf", "--model", model, "--gpu", "h100"]) == 0
        capsys.readouterr()
    assert main(["replay", str(small_trace(tmp_path)), "--model", str(folder)]) == 0
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    one_error(capsys, main(["specs", "--model", str(tmp_path / "empty")]), "specs", "without a config.json")


def test_tiny_models_show_their_parameters(tmp_path, capsys):
    config = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
              "vocab_size": 256, "max_position_embeddings": 4096}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["specs", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "0.00 B" not in out and " K " in out


def test_numbers_in_the_unit_their_magnitude_calls_for():
    assert duration_text(4158.3951) == "1.16 h" and duration_text(19.7) == "19.70 s"
    assert duration_text(0.0233) == "23.3 ms" and duration_text(150.0) == "2.5 min" and duration_text(None) == "-"
    assert ratio_text(3700.0) == "3,700x" and ratio_text(0.00027) == "0.000270x" and ratio_text(1.88) == "1.88x"
    assert count_text(30.53e9) == "30.53 B" and count_text(48_000) == "48.00 K" and count_text(12) == "12"
    assert duration_unit(400_000.0) == (3600.0, "h") and duration_unit(90.0) == (1.0, "s")


def test_replay_latencies_carry_their_units(tmp_path, capsys):
    assert main(["replay", str(small_trace(tmp_path))]) == 0
    out = capsys.readouterr().out
    ttft = next(line for line in out.splitlines() if line.startswith("TTFT"))
    assert ttft.split()[2] in ("ms", "s", "min", "h")


def test_replay_max_model_len_refuses_longer_requests(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["replay", str(small_trace(tmp_path)), "--max-model-len", "1130", "--json", str(out)]) == 0
    assert "3 requests longer than --max-model-len 1,130 refused" in capsys.readouterr().out
    assert json.loads(out.read_text())["config"]["workload"]["requests"] == 3
