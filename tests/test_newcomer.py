"""What a new user meets on the modeled verbs: no traceback for bad input, no result lost to an interrupt or a late
failure, outputs checked before a run, and one set of conventions (vLLM's names, sizes with units, ``--json PATH``
with ``-`` for stdout, ``--model`` as a preset, folder or config.json). Each test runs the command as a user would.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import moetide.commands.compare as compare_module
from moetide import __version__
from moetide.cli import main
from moetide.errors import UserError
from moetide.specs import model_preset_hf_config

MOETIDE = [sys.executable, "-m", "moetide.cli"]


def small_trace(tmp_path, n=6):
    lines = [{"timestamp": 1000 * i, "input_length": 1100 + 10 * i, "output_length": 5, "hash_ids": [1, 2, 100 + i]}
             for i in range(n)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def checkpoint_folder(tmp_path, name="qwen3-30b-a3b"):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model_preset_hf_config(name)))
    return folder


def one_error(capsys, rc, verb, *needles):
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert err.startswith(f"moetide {verb}: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return out


# ---- tracebacks ------------------------------------------------------------------------------------------------


def test_replay_tp_that_splits_no_heads_is_one_line(capsys):
    one_error(capsys, main(["replay", "--tensor-parallel-size", "3"]), "replay", "--tensor-parallel-size",
              "does not divide num_attention_heads")


def test_a_closed_stdout_ends_quietly():
    proc = subprocess.Popen([*MOETIDE, "specs", "--json", "-"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # as `| head` does once it has its lines
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err == b""


def test_ctrl_c_twice_is_one_line_and_exit_130(tmp_path):
    proc = subprocess.Popen([*MOETIDE, "replay"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as at a terminal
    time.sleep(4)  # inside the replay of the built-in sessions (tens of seconds)
    os.kill(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err == "moetide replay: interrupted\n"


def test_an_interrupt_ignores_further_ctrl_c(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("moetide.commands.specs.run", interrupted)
    before = signal.getsignal(signal.SIGINT)
    try:
        assert main(["specs"]) == 130
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert capsys.readouterr().err == "moetide specs: interrupted\n"


# ---- results kept, outputs checked first -----------------------------------------------------------------------


def _fail_on_call(monkeypatch, n, exc):
    real, calls = compare_module.run_replay, []

    def replay(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(compare_module, "run_replay", replay)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), UserError("late failure")])
def test_compare_keeps_the_finished_runs(tmp_path, monkeypatch, capsys, exc):
    _fail_on_call(monkeypatch, 2, exc)
    out = tmp_path / "c.json"
    rc = main(["compare", str(small_trace(tmp_path)), "--policies", "vllm,static-offload", "--json", str(out)])
    assert rc == (130 if isinstance(exc, KeyboardInterrupt) else 2)
    captured = capsys.readouterr()
    partial = json.loads((tmp_path / "c.json.partial").read_text())
    assert list(partial["runs"]) == ["vllm"] and partial["complete"] is False
    assert partial["pending"] == ["static-offload"] and not out.exists()
    assert f"after 1 of 2 policies: the finished runs are in {out}.partial" in captured.err
    assert "vllm" in captured.out  # the finished runs' table


def test_compare_without_json_prints_the_finished_runs(tmp_path, monkeypatch, capsys):
    _fail_on_call(monkeypatch, 2, KeyboardInterrupt())
    assert main(["compare", str(small_trace(tmp_path)), "--policies", "vllm,static-offload"]) == 130
    captured = capsys.readouterr()
    assert "the finished runs are in the table above" in captured.err and "vllm" in captured.out


def test_sweep_keeps_the_finished_runs(tmp_path, monkeypatch, capsys):
    _fail_on_call(monkeypatch, 2, KeyboardInterrupt())
    out = tmp_path / "s.json"
    rc = main(["sweep", str(small_trace(tmp_path)), "--policy", "static-offload", "--max-offload-ratios", "0,0.02",
               "--json", str(out)])
    assert rc == 130
    assert list(json.loads((tmp_path / "s.json.partial").read_text())["runs"]) == ["0"]
    assert "after 1 of 2 caps" in capsys.readouterr().err


def test_compare_complete_json_replaces_the_partial_one(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["compare", str(small_trace(tmp_path)), "--policies", "vllm,static-offload", "--json",
                 str(out)]) == 0
    assert set(json.loads(out.read_text())["runs"]) == {"vllm", "static-offload"}
    assert not (tmp_path / "c.json.partial").exists()


def test_bad_output_paths_fail_before_the_run(tmp_path, capsys):
    rc = main(["compare", str(small_trace(tmp_path)), "--json", "/proc/nope/c.json", "--plot",
               str(tmp_path / "ok.png")])
    assert one_error(capsys, rc, "compare", "--json /proc/nope/c.json", "does not exist") == ""
    rc = main(["replay", str(small_trace(tmp_path)), "--plot", str(tmp_path)])
    assert one_error(capsys, rc, "replay", "--plot", "is a folder") == ""


def test_replay_plot_without_matplotlib_fails_before_the_run(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from moetide.cli import main; "
            f"sys.exit(main(['replay', {str(small_trace(tmp_path))!r}, '--plot', {str(tmp_path / 'x.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "moetide replay: error: --plot needs matplotlib: pip install -e '.[plot]'\n"


def test_replay_max_requests_zero_is_refused(tmp_path, capsys):
    one_error(capsys, main(["replay", "--max-requests", "0"]), "replay", "--max-requests must be >= 1")
    one_error(capsys, main(["replay", "--max-requests", "3"]), "replay", "give a TRACE")


# ---- messages --------------------------------------------------------------------------------------------------


def test_a_folder_as_trace_says_so(tmp_path, capsys):
    one_error(capsys, main(["replay", str(tmp_path)]), "replay", "is a folder; give a trace file")


def test_unknown_format_names_the_flag(tmp_path, capsys):
    path = tmp_path / "x.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    one_error(capsys, main(["replay", str(path)]), "replay", "name it with --format")


def test_weka_turn_gap_names_both_lines(tmp_path, capsys):
    rows = [{"kind": "session", "session": "s", "block_size": 64}] + [
        {"kind": "request", "session": "s", "ctx": "main", "turn": turn, "t": turn, "in": 10, "out": 5,
         "hash_runs": []} for turn in (0, 1, 3)]
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    one_error(capsys, main(["replay", str(path)]), "replay", "w.jsonl:4:", "from turn 1 (line 3) to 3",
              "turn 2 is missing")


def test_unknown_argument_names_the_verb(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["perf", "--model", "qwen3-30b-a3b", "--gpu", "h100", "--bogus"])
    assert exit_info.value.code == 2
    assert "moetide perf: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_help_lists_policies_and_explains_every_option(capsys):
    for verb in ("replay", "compare", "sweep"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert verb == "compare" or "vllm, static-offload, vamp, vamp-reclaim" in text
        assert "--gpu-memory-utilization F share of HBM" in text and "--max-num-seqs N most requests" in text


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"moetide {__version__}\n"


# ---- plots -----------------------------------------------------------------------------------------------------


def test_compare_plot_tells_identical_runs_apart(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from moetide.report.plots import _labels

    out, png = tmp_path / "c.json", tmp_path / "c.png"
    trace = str(small_trace(tmp_path))
    assert main(["compare", trace, "--policies", "vllm,vamp", "--json", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 10_000 and f"wrote {png}" in capsys.readouterr().out

    class Run:
        ttft, kv_usage = [1.0, 2.0], [(0.0, 0.5)]

    class Other(Run):
        ttft = [3.0]

    assert _labels({"vllm": ({}, Run), "vamp": ({}, Run), "x": ({}, Other)}) == {
        "vllm": "vllm", "vamp": "vamp (same as vllm)", "x": "x"}


def test_plot_throughput_panel_has_busy_seconds_and_time_in_hours(tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    from moetide.report import plots

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)

    class Run:
        ttft, tpot, kv_usage = [1.0], [0.01], [(0.0, 0.1), (400_000.0, 0.2)]
        offload_usage, preemption_usage = [(0.0, 0.0), (400_000.0, 0.05)], [(0.0, 0), (400_000.0, 7)]

    result = {"metrics": {"request_throughput_per_s": 0.1, "completed": 10, "busy_s": 20.0},
              "config": {"workload": {"name": "w"}, "model": "m", "tp": 1, "gpu": "g"}}
    plots.plot_runs({"vllm": (result, Run)}, tmp_path / "p.png")
    ax_cdf, ax_bar, ax_tpot, ax_line, ax_preempt = figures[0].axes
    assert ax_line.get_xlabel() == "simulated time (h)"
    assert max(ax_line.lines[0].get_xdata()) == pytest.approx(111.1, 0.01)
    # the line on its own axis, in percent of expert bytes; preemptions on the other
    assert list(ax_line.lines[0].get_ydata()) == [0.0, 5.0] and ax_line.get_ylim()[1] == pytest.approx(6.25)
    assert list(ax_preempt.lines[0].get_ydata()) == [0, 7] and ax_preempt.get_ylabel() == "preemptions so far"
    assert [t.get_text() for t in ax_bar.get_legend().get_texts()] == ["per second", "per busy second"]
    assert [round(p.get_height(), 3) for p in ax_bar.patches] == [0.1, 0.5]
