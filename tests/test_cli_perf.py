"""``moetide perf`` end to end through ``moetide.cli.main``."""

from __future__ import annotations

import json

import pytest

from moetide.cli import main
from moetide.perf import Efficiency, StepShape, StepTimeModel
from moetide.perf.engines import engine_efficiency
from moetide.specs import get_gpu, get_model


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["perf", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_one_line_error(rc: int, out: str, err: str, *needles: str) -> None:
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("moetide perf: error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err


def test_decode_qwen3_30b_on_h100(capsys):
    rc, out, err = run_cli(capsys, "--model", "qwen3-30b-a3b", "--gpu", "h100", "--batch", "1", "--context", "4096")
    assert rc == 0 and err == ""
    step = StepTimeModel(get_model("qwen3-30b-a3b"), get_gpu("h100"), efficiency=engine_efficiency())
    total_s = step.step_time_s(*StepShape.decode(1, 4096).as_args())
    assert "MODELED times" in out and "not measurements" in out
    assert f"throughput: 1 token / {total_s * 1e3:.3f} ms = {1 / total_s:,.1f} tokens/s" in out
    assert "routed experts (8.00 of 128/layer)" in out and "attention (48 full layers)" in out
    assert "linear attention (" not in out and "all-reduce (" not in out and "Prefill" not in out
    assert "9,112 (= 14,332,563,456 // 1,572,864)" in out
    assert "decode batch: 1 x 4,097 tokens needs 257 of 9,112 blocks (fits)" in out


def test_hybrid_tp2_with_prefill(capsys):
    rc, out, _ = run_cli(capsys, "--model", "qwen3-next-80b-a3b", "--gpu", "h200", "-tp", "2", "--batch", "64",
                         "--context", "32768", "--prefill-tokens", "8192")
    assert rc == 0
    assert "Decode step: 64 sequences at context 32,768" in out and "Prefill step: one sequence, 8,192" in out
    assert "linear attention (36 layers)" in out and "attention (12 full layers)" in out
    assert "all-reduce (2 x 48 layers)" in out and "3 blocks" in out
    assert "block               544 tokens" in out  # the replay's default block size for the model (issue 21)
    assert "needs 4,096 of 8,168 blocks (fits)" in out


def test_json_has_exact_figures(capsys):
    rc, out, _ = run_cli(capsys, "--json", "-", "--model", "qwen3-30b-a3b", "--gpu", "h100", "--batch", "8",
                         "--context", "1000", "--prefill-tokens", "2048")
    doc = json.loads(out)
    assert rc == 0 and doc["modeled"] is True
    step = StepTimeModel(get_model("qwen3-30b-a3b"), get_gpu("h100"), efficiency=engine_efficiency())
    assert doc["decode"]["step_time_s"] == step.step_time_s(*StepShape.decode(8, 1000).as_args())
    assert doc["decode"]["tokens_per_s"] == pytest.approx(8 / doc["decode"]["step_time_s"])
    assert doc["prefill"]["shape"]["num_tokens"] == 2048
    assert doc["memory"]["num_blocks"] == 9_112 and doc["memory"]["max_tokens"] == 145_792
    assert doc["efficiency"]["hbm"] == 0.8


def test_batch_that_does_not_fit_is_reported_not_refused(capsys):
    rc, out, _ = run_cli(capsys, "--model", "qwen3-30b-a3b", "--gpu", "h100", "--batch", "64", "--context", "131072")
    assert rc == 0 and "(DOES NOT FIT)" in out


def test_weights_that_do_not_fit_exit_2(capsys):
    rc, out, err = run_cli(capsys, "--model", "qwen3-next-80b-a3b", "--gpu", "a100-40gb")
    assert_one_line_error(rc, out, err, "does not fit on a100-40gb", "148.41 GiB", "--tensor-parallel-size")


@pytest.mark.parametrize(("argv", "needle"), [
    (["--tensor-parallel-size", "3"], "--tensor-parallel-size"),
    (["--batch", "0"], "--batch"),
    (["--context", "-1"], "--context"),
    (["--prefill-tokens", "0"], "--prefill-tokens"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--kv-cache-memory", "500GiB"], "--kv-"),
])
def test_bad_arguments_are_one_line(capsys, argv, needle):
    rc, out, err = run_cli(capsys, "--model", "qwen3-30b-a3b", "--gpu", "h100", *argv)
    assert_one_line_error(rc, out, err, needle)


def test_unknown_model(capsys):
    rc, out, err = run_cli(capsys, "--model", "no-such-model", "--gpu", "h100")
    assert_one_line_error(rc, out, err, "unknown model")


def test_engine_profile_roofline_gives_the_plain_roofline(capsys):
    rc, out, _ = run_cli(capsys, "--json", "-", "--model", "qwen3-30b-a3b", "--gpu", "h100",
                         "--engine-profile", "roofline")
    doc = json.loads(out)
    step = StepTimeModel(get_model("qwen3-30b-a3b"), get_gpu("h100"), efficiency=Efficiency())
    assert rc == 0 and doc["engine_profile"] == "roofline"
    assert doc["decode"]["step_time_s"] == step.step_time_s(*StepShape.decode(1, 4096).as_args())
