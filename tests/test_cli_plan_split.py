"""``moetide plan-split`` end to end through ``moetide.cli.main``."""

from __future__ import annotations

import json
import math

import pytest

from moetide.cli import main
from moetide.commands.plan_split import parse_contexts, parse_tokens
from moetide.sim.split_study import COMPARED
from moetide.core.split_baselines import NAMED_BASELINES
from moetide.core.splits import BASELINES
from moetide.errors import UserError
from moetide.report import split_plan

POLICIES = {"writescope", *COMPARED}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["plan-split", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def json_doc(capsys, *argv: str) -> dict:
    rc, out, err = run_cli(capsys, *argv, "--json", "-")
    assert rc == 0 and err == ""
    return json.loads(out)


def test_parse_tokens_and_contexts():
    assert parse_tokens("8k", "--x") == 8192 and parse_tokens("1M", "--x") == 1 << 20
    assert parse_tokens("4096", "--x") == 4096 and parse_tokens(" 16K ", "--x") == 16384
    assert parse_contexts("8k,1M") == [8192, 1 << 20]
    for bad in ("8kb", "0", "-8k", "1.5k", ""):
        with pytest.raises(UserError):
            parse_tokens(bad, "--x")


def test_json_shape(capsys):
    doc = json_doc(capsys, "--model", "deepseek-v2-lite", "--gpu", "a100-80gb", "--context", "4k,8k,64k")
    assert doc["modeled"] is True and [r["context"] for r in doc["rows"]] == [4096, 8192, 65536]
    for row in doc["rows"]:
        assert set(row["step_time_s"]) == POLICIES and 0 <= row["cpu_share"] <= 1
        assert row["batch"] == (1 << 20) // row["context"]  # --aggregate-tokens 1M by default
        assert all(t > 0 for t in row["step_time_s"].values())
        assert row["step_time_s"]["writescope"] <= min(row["step_time_s"][b] for b in BASELINES) * 1.02
    assert set(doc["geomean_speedup"]) == set(COMPARED)
    kept = doc["rows"][1:]  # contexts >= 8K only
    expected = math.exp(sum(math.log(r["step_time_s"]["cpu-all"] / r["step_time_s"]["writescope"]) for r in kept) / 2)
    assert doc["geomean_speedup"]["cpu-all"] == pytest.approx(expected)
    assert doc["geomean_speedup_over_best_baseline"] >= 0.98
    overall = math.exp(sum(math.log(doc["geomean_speedup"][b]) for b in BASELINES) / 4)
    assert doc["geomean_speedup_over_all_baselines"] == pytest.approx(overall)
    named = math.exp(sum(math.log(doc["geomean_speedup"][b]) for b in NAMED_BASELINES) / 4)
    assert doc["geomean_speedup_over_all_named_baselines"] == pytest.approx(named)
    best = math.exp(sum(math.log(min(r["step_time_s"][b] for b in NAMED_BASELINES) / r["step_time_s"]["writescope"])
                        for r in kept) / 2)
    assert doc["geomean_speedup_over_best_named_baseline"] == pytest.approx(best)
    assert set(doc["attention_phase"]["geomean_speedup"]) == set(COMPARED)


def test_no_context_at_8k_or_more(capsys):
    doc = json_doc(capsys, "--model", "deepseek-v2-lite", "--gpu", "a100-80gb", "--context", "4k")
    assert doc["geomean_speedup"] is None and doc["attention_phase"] is None
    rc, out, _ = run_cli(capsys, "--model", "deepseek-v2-lite", "--gpu", "a100-80gb", "--context", "4k")
    assert rc == 0 and "geomean speedup (end to end): no context >= 8k" in out


def test_text_table(capsys):
    rc, out, err = run_cli(capsys, "--model", "mixtral-8x7b", "--gpu", "v100-32gb", "--context", "8k,1M")
    assert rc == 0 and err == ""
    assert "MODELED" in out and "Decode step time, ms" in out and " req-split " in out and " HybridGen " in out
    assert "resident experts" in out and "CPU attention" in out
    assert "writescope geomean speedup, contexts >= 8k (end to end):\n  ours: transfer-all" in out
    assert "the paper's: solidattention" in out and "over the best named" in out and "over all four" in out
    assert "1M           1" in out


def test_fixed_batch_and_host_capacity(capsys):
    doc = json_doc(capsys, "--model", "qwen3-30b-a3b", "--gpu", "a100-80gb", "--context", "8k,32k", "--batch", "4")
    assert [r["batch"] for r in doc["rows"]] == [4, 4]
    rc, out, err = run_cli(capsys, "--model", "qwen3-30b-a3b", "--gpu", "a100-80gb", "--context", "1M",
                           "--batch", "128")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "lower --batch" in err


@pytest.mark.parametrize("argv, needle", [
    (["--context", "8k,lots"], "--context: 'lots' is not a positive token count"),
    (["--context", "8k,,16k"], "--context: expected a comma-separated list"),
    (["--split-fixed-ratio", "2"], "--split-fixed-ratio"),
    (["--gpu-memory", "200GiB"], "exceeds"),
    (["--gpu-memory", "4GiB"], "raise --gpu-memory"),
])
def test_bad_input_is_one_line(capsys, argv, needle):
    rc, out, err = run_cli(capsys, "--model", "deepseek-v2-lite", "--gpu", "a100-80gb", *argv)
    assert rc == 2 and out == ""
    assert err.startswith("moetide plan-split: error: ") and err.count("\n") == 1 and needle in err


def test_tuned_fixed_ratio_is_no_worse(capsys):
    base = ["--model", "deepseek-v2-lite", "--gpu", "a100-80gb", "--context", "8k,128k"]
    half, tuned = json_doc(capsys, *base), json_doc(capsys, *base, "--split-fixed-ratio", "tuned")
    assert tuned["fixed_ratio"] != 0.5
    assert tuned["geomean_speedup"]["fixed-ratio"] < half["geomean_speedup"]["fixed-ratio"]


def test_busy_cpu_moves_the_split(capsys):
    base = ["--model", "qwen3-30b-a3b", "--gpu", "a100-80gb", "--context", "64k"]
    idle, busy = json_doc(capsys, *base), json_doc(capsys, *base, "--cpu-slowdown", "2")
    assert busy["rows"][0]["cpu_share"] < 0.9 * idle["rows"][0]["cpu_share"]  # 0.86 -> 0.76
    assert busy["geomean_speedup"]["cpu-all"] > idle["geomean_speedup"]["cpu-all"]


def test_plot_labels_contexts_and_says_where_it_wrote(capsys, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    labels = []
    save = matplotlib.figure.Figure.savefig

    def spy(fig, *a, **k):
        labels.extend(t.get_text() for t in fig.axes[0].get_xticklabels())
        return save(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    path = tmp_path / "split.png"
    rc, out, err = run_cli(capsys, "--model", "deepseek-v2-lite", "--gpu", "a100-80gb", "--context", "8k,32k,1M",
                           "--plot", str(path))
    assert rc == 0 and err == "" and path.stat().st_size > 1000
    assert labels == ["8k", "32k", "1M"] and out.endswith(f"wrote {path}\n")


def test_json_path_convention(capsys, tmp_path):
    base = ["--model", "deepseek-v2-lite", "--gpu", "a100-80gb", "--context", "8k"]
    path = tmp_path / "out.json"
    rc, out, err = run_cli(capsys, *base, "--json", str(path))
    assert rc == 0 and err == "" and "Decode step time" in out and out.endswith(f"wrote {path}\n")
    from_file = json.loads(path.read_text())
    rc, out, err = run_cli(capsys, *base, "--json", "-")
    assert rc == 0 and err == "" and json.loads(out) == from_file  # '-': stdout, JSON only
    with pytest.raises(SystemExit):  # --json takes a PATH in every verb
        run_cli(capsys, *base, "--json")
    assert "argument --json: expected one argument" in capsys.readouterr().err
    rc, out, err = run_cli(capsys, *base, "--json", str(tmp_path / "no" / "x.json"))
    assert rc == 2 and out == "" and "does not exist" in err


def test_a_saved_document_renders_as_the_run_did(capsys, tmp_path):
    """The table is made from the JSON document alone: what ``--json`` saved prints the run's text again."""
    base = ["--model", "qwen3-30b-a3b", "--gpu", "a100-40gb", "--gpu-memory", "32GiB", "--context", "8k,1m"]
    path = tmp_path / "out.json"
    rc, out, _ = run_cli(capsys, *base, "--json", str(path))
    assert rc == 0
    doc = json.loads(path.read_text())
    assert doc["policies"] == ["writescope", *COMPARED] and doc["rates"]["link_gb_per_s"] > 0
    assert out == split_plan.text(doc) + f"\nwrote {path}\n"


def test_cpu_experts_and_prefetch_change_only_what_they_should(capsys):
    base = ["--model", "qwen3-30b-a3b", "--gpu", "a100-pcie-40gb", "--cpu", "xeon-gold-5318y", "--context", "32k"]
    staged, on_cpu = json_doc(capsys, *base), json_doc(capsys, *base, "--host-experts", "cpu")
    off = json_doc(capsys, *base, "--host-experts", "cpu", "--no-kv-prefetch")
    assert on_cpu["rows"][0]["non_attention_s"] < staged["rows"][0]["non_attention_s"]
    assert on_cpu["rows"][0]["prefetch_bytes"] > 0 == off["rows"][0]["prefetch_bytes"]
    assert on_cpu["rows"][0]["attention_s"]["transfer-all"] < off["rows"][0]["attention_s"]["transfer-all"]
    assert on_cpu["rows"][0]["attention_s"]["cpu-all"] == off["rows"][0]["attention_s"]["cpu-all"]


def test_split_experts_give_the_shortest_moe_phase(capsys):
    """``--host-experts split``: the MoE phase no longer than staged or on the CPU, the share it chose reported."""
    base = ["--model", "mixtral-8x7b", "--gpu", "v100-pcie-32gb", "--cpu", "xeon-gold-5318y", "--context", "32k"]
    docs = {place: json_doc(capsys, *base, "--host-experts", place) for place in ("stage", "cpu", "split")}
    moe = {place: doc["rows"][0]["non_attention_s"] for place, doc in docs.items()}
    assert moe["split"] < min(moe["stage"], moe["cpu"])
    assert docs["split"]["host_experts"] == "split"
    assert 0 < docs["split"]["rows"][0]["host_phase"]["cpu_expert_share"] < 1
    assert docs["stage"]["rows"][0]["host_phase"]["cpu_expert_share"] == 0
