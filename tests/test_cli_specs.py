"""``moetide specs`` end to end through ``moetide.cli.main``, and the shared table formatter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moetide.cli import main
from moetide.report.tables import format_table


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["specs", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_one_line_error(rc: int, out: str, err: str, *needles: str) -> None:
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("moetide specs: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_default_prints_all_three_tables(capsys):
    rc, out, err = run_cli(capsys)
    assert rc == 0 and err == ""
    for title in ("Models (", "GPUs\n", "Host CPUs\n"):
        assert title in out
    for name in ("qwen3-next-80b-a3b", "mixtral-8x7b", "h200", "v100-32gb", "ddr5-4800-12ch"):
        assert name in out
    assert "48 (12/36)" in out and "24,576" in out and "79.67 B" in out and "38.25 MiB" in out


def test_selection_prints_only_what_was_asked(capsys):
    rc, out, _ = run_cli(capsys, "--gpu", "H100")
    assert rc == 0 and out.startswith("GPUs\n") and "h100-sxm" in out
    assert "Models" not in out and "Host CPUs" not in out and "h200" not in out


def test_model_from_config_json(tmp_path, capsys):
    from moetide.specs import model_preset_hf_config

    path = tmp_path / "Qwen3-30B-A3B-Local" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(model_preset_hf_config("qwen3-30b-a3b")))
    rc, out, _ = run_cli(capsys, "--model", str(path))
    assert rc == 0 and "Qwen3-30B-A3B-Local" in out and "98,304" in out and "GPUs" not in out


def test_json_output_has_exact_figures(capsys):
    rc, out, _ = run_cli(capsys, "--json", "-", "--model", "qwen3-next-80b-a3b", "--cpu", "ddr4-3200-8ch")
    doc = json.loads(out)
    assert rc == 0 and sorted(doc) == ["dtype_bytes", "hosts", "models"]
    derived = doc["models"][0]["derived"]
    assert (derived["params_total"], derived["params_active"]) == (79_674_391_296, 3_874_929_408)
    assert derived["kv_bytes_per_token"] == 24_576 and derived["expert_bytes"] == 6 * 2**20
    assert doc["models"][0]["linear_attention"]["conv_kernel_size"] == 4
    assert doc["hosts"][0]["derived"]["peak_dram_bandwidth_bytes_per_s"] == 204.8e9


def test_json_default_is_everything_and_dtype_bytes_scales(capsys):
    _, out, _ = run_cli(capsys, "--json", "-", "--dtype-bytes", "1")
    doc = json.loads(out)
    assert [len(doc[k]) for k in ("models", "gpus", "hosts")] == [4, 10, 4]
    mixtral = next(m for m in doc["models"] if m["name"] == "mixtral-8x7b")
    assert mixtral["derived"]["kv_bytes_per_token"] == 65_536


def test_malformed_config_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "qwen3_moe", ')
    assert_one_line_error(*run_cli(capsys, "--model", str(path)), str(path), "not valid JSON")


def test_unsupported_model_type_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096}))
    assert_one_line_error(*run_cli(capsys, "--model", str(path)), str(path), "'model_type'", "qwen3_next")


@pytest.mark.parametrize("argv, needle", [
    (["--gpu", "b200"], "valid names: h200, h100-sxm"),
    (["--cpu", "ddr3"], "valid names: ddr4-3200-8ch"),
    (["--model", "llama"], "valid names: qwen3-next-80b-a3b"),
    (["--dtype-bytes", "0"], "--dtype-bytes must be a positive integer"),
])
def test_bad_arguments_are_one_line_exit_2(capsys, argv, needle):
    assert_one_line_error(*run_cli(capsys, *argv), needle)


def test_subprocess_error_has_no_traceback(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 4096}))
    proc = subprocess.run([sys.executable, "-m", "moetide.cli", "specs", "--model", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"moetide specs: error: {path}: field 'num_hidden_layers': missing (required for model_type 'mixtral')"]


def test_specs_does_not_import_torch():
    code = "import sys; from moetide.cli import main; main(['specs']); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("False")


# ---- report.tables.format_table -------------------------------------------------------------------------------


def test_format_table_exact_output():
    text = format_table(["name", "n", "note"], [["a", 1, "x"], ["bbb", 22, None]])
    assert text == "name   n  note\n----  --  ----\na      1  x\nbbb   22  -"


def test_format_table_explicit_align_and_no_trailing_space():
    text = format_table(["k", "v"], [["long-key", "1"], ["k", "22"]], align="><")
    assert text.splitlines() == ["       k  v", "--------  --", "long-key  1", "       k  22"]
    assert all(line == line.rstrip() for line in text.splitlines())


def test_format_table_default_alignment_treats_unit_strings_as_numbers():
    text = format_table(["m", "size"], [["a", "1.50 GiB"], ["b", "12.00 GiB"]])
    assert text.splitlines()[2] == "a   1.50 GiB"


def test_format_table_rejects_bad_shapes():
    with pytest.raises(ValueError, match="row 1 has 1 cells, expected 2"):
        format_table(["a", "b"], [[1, 2], [3]])
    with pytest.raises(ValueError, match="align must give one of"):
        format_table(["a", "b"], [[1, 2]], align="<|")
