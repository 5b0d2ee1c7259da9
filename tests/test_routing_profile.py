"""Measured routing profiles: the engine writes them, the staging model prices with them, bad files are one
clear error naming the field."""

import json
import re

import pytest

from moetide.cli import main
from moetide.errors import UserError
from moetide.perf.routing_profile import FORMAT, rank_shares, read_rank_shares, write_profile
from moetide.perf.staging import StagingConfig, StagingModel
from moetide.specs import get_gpu, get_model
from test_cli_compare import small_trace

MODEL = get_model("qwen3-30b-a3b")  # the replay's default model: 128 routed experts, top-8


def zipf_counts(s: float, layers: int = 3) -> list[list[float]]:
    """Per-layer counts following Zipf(s), each layer's ranks in a different expert order."""
    n = MODEL.num_experts
    rows = []
    for layer in range(layers):
        order = [(e * (2 * layer + 1)) % n for e in range(n)]  # a permutation (odd multiplier, n a power of 2)
        row = [0.0] * n
        for rank, expert in enumerate(order):
            row[expert] = 1e6 / (rank + 1) ** s
        rows.append(row)
    return rows


def test_rank_shares_sort_each_layer_and_average():
    assert rank_shares([[1, 3], [2, 2], [0, 0]]) == (0.625, 0.375)  # the all-zero layer routed nothing
    assert rank_shares([[0, 0]]) == (0.5, 0.5)


def test_a_profile_of_a_zipf_law_prices_exactly_as_the_zipf_model(tmp_path):
    shares = read_rank_shares(_written(tmp_path, zipf_counts(0.88)), MODEL.num_experts)
    gpu = get_gpu("h100")
    zipf = StagingModel(MODEL, gpu, config=StagingConfig(routing_zipf_s=0.88))
    measured = StagingModel(MODEL, gpu, config=StagingConfig(routing_shares=shares))
    for tokens in (1, 8, 64, 4096):
        for offloaded in (1, 10, 40):
            assert measured.layer(tokens, offloaded, 1e-4) == pytest.approx(zipf.layer(tokens, offloaded, 1e-4))
    colder = StagingModel(MODEL, gpu, config=StagingConfig(
        routing_shares=read_rank_shares(_written(tmp_path, zipf_counts(1.5)), MODEL.num_experts)))
    assert colder.layer(16, 20, 0.0)[1] < measured.layer(16, 20, 0.0)[1]  # a colder tail stages less


def _written(tmp_path, counts, name="q.json"):
    path = tmp_path / name
    write_profile(path, counts, top_k=8, model="x")
    return path


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.update(format="v0"), "field 'format'"),
    (lambda d: d.update(top_k=2), "field 'top_k' is 2"),
    (lambda d: d.update(counts=[]), "field 'counts'"),
    (lambda d: d["counts"][1].pop(), "counts[1] must list 128 experts"),
    (lambda d: d["counts"][2].__setitem__(5, -1), "counts[2][5] must be a finite count"),
])
def test_bad_profiles_are_one_clear_error(tmp_path, mutate, message):
    data = {"format": FORMAT, "model": "x", "top_k": 8, "num_experts": 128, "counts": zipf_counts(1.0)}
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match=re.escape(message)):
        read_rank_shares(path, MODEL.num_experts, MODEL.num_experts_per_tok)


def test_replay_prices_staging_with_a_profile(tmp_path, capsys):
    trace = str(small_trace(tmp_path))
    common = ["compare", trace, "--kv-cache-memory", "0.5GiB", "--max-offload-ratio", "0.05", "--policies",
              "static-offload"]
    staged = {}
    for name, counts in (("flat", [[1.0] * 128] * 3), ("skewed", zipf_counts(1.5))):
        out = tmp_path / f"{name}.json"
        assert main([*common, "--routing-profile", str(_written(tmp_path, counts, f"{name}-p.json")),
                     "--json", str(out)]) == 0
        run = json.loads(out.read_text())["runs"]["static-offload"]
        assert run["config"]["routing_profile"].endswith(f"{name}-p.json")
        staged[name] = run["metrics"]["staged_bytes"]
    assert 0 < staged["skewed"] < staged["flat"]
    capsys.readouterr()
    assert main([*common, "--routing-profile", str(_written(tmp_path, [[1.0] * 16])), "--routing-zipf-s",
                 "0.5"]) == 2
    assert main([*common, "--routing-profile", str(_written(tmp_path, [[1.0] * 16]))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "not both" in err[0] and "counts[0] must list 128 experts" in err[1]


def test_a_shared_host_uplink_divides_the_link():
    gpu = get_gpu("h100")
    alone = StagingModel(MODEL, gpu, config=StagingConfig(mode="segment"))
    shared = StagingModel(MODEL, gpu, config=StagingConfig(mode="segment", host_link_shared_by=2))
    assert shared.link_bytes_per_s == pytest.approx(alone.link_bytes_per_s / 2)
    latency = StagingConfig().transfer_latency_s
    assert shared.expert_transfer_s - latency == pytest.approx(2 * (alone.expert_transfer_s - latency))
    with pytest.raises(ValueError, match="host_link_shared_by"):
        StagingConfig(host_link_shared_by=0)


def test_replay_takes_a_shared_uplink(tmp_path):
    out = tmp_path / "r.json"
    common = ["compare", str(small_trace(tmp_path)), "--kv-cache-memory", "0.5GiB", "--max-offload-ratio", "0.05",
              "--policies", "static-offload", "--staging", "segment"]
    assert main([*common, "--json", str(out)]) == 0
    alone = json.loads(out.read_text())["runs"]["static-offload"]
    assert main([*common, "--host-link-shared-by", "2", "--json", str(out)]) == 0
    shared = json.loads(out.read_text())["runs"]["static-offload"]
    assert shared["config"]["host_link_shared_by"] == 2
    assert shared["metrics"]["tpot_s"]["mean"] > alone["metrics"]["tpot_s"]["mean"]
