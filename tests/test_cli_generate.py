"""``moetide generate`` and ``moetide bench-engine``: JSON shape, agreement with the engine's greedy output,
seeded sampling, counters under a tight budget, and one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from moetide.cli import main

pytest.importorskip("torch")
pytest.importorskip("transformers")

from moetide.engine.experts import StagedExpertProvider  # noqa: E402


def generate(model, *extra: str) -> int:
    return main(["generate", "--model", str(model), "--threads", "1", *extra])


def test_json_output_matches_the_engine_and_decodes_with_the_tokenizer(tiny_checkpoint, tmp_path, capsys):
    import transformers

    from moetide.engine.runner import Engine

    model = tiny_checkpoint("qwen3_moe")
    out = tmp_path / "out.json"
    assert generate(model, "--prompt", "Prefix caching keeps", "--max-tokens", "6", "--ignore-eos",
                    "--kv-cache-memory", "1MiB", "--json", str(out)) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    [entry] = report["outputs"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    assert entry["prompt"] == "Prefix caching keeps"
    assert entry["prompt_token_ids"] == tokenizer.encode("Prefix caching keeps")
    engine = Engine(model, kv_cache_memory=1 * 2**20, ignore_eos=True)
    assert entry["token_ids"] == engine.generate([entry["prompt_token_ids"]], 6).outputs[0].token_ids
    assert entry["text"] == tokenizer.decode(entry["token_ids"], skip_special_tokens=True)
    assert entry["finish_reason"] == "length"
    assert {"prefix_evictions", "preemptions", "experts_offloaded", "prefix_hit_tokens", "steps",
            "recomputed_tokens"} <= set(report["stats"])
    assert printed.startswith(entry["text"] + "\nsteps 6, prefix evictions 0")  # the text as it is, not a literal


def test_prompts_file_under_a_tight_budget_reports_the_counters(tiny_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    lines = ["The scheduler compares the cost of evicting a prefix", "", "Linear attention keeps a state",
             "The scheduler compares the cost of preempting a request", "Numbers matter too: 0 1 2 3 4 5 6 7"]
    prompts.write_text("\n".join(lines) + "\n")
    rc = generate(tiny_checkpoint("mixtral"), "--prompts-file", str(prompts), "--max-tokens", "24",
                  "--ignore-eos", "--kv-cache-memory", "16KiB", "--block-size", "4", "--max-offload-ratio",
                  "0.25", "--static-offload", "--max-num-batched-tokens", "32", "--json", "-")
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert [o["prompt"] for o in report["outputs"]] == [line for line in lines if line]
    assert all(len(o["token_ids"]) == 24 for o in report["outputs"])
    stats = report["stats"]
    assert stats["experts_offloaded"] == 2 and stats["preemptions"] > 0 and stats["prefix_evictions"] > 0


def test_sampling_is_seeded(tiny_checkpoint, capsys):
    def texts(seed: str) -> list[str]:
        assert generate(tiny_checkpoint("mixtral"), "--prompt", "Mixture", "--max-tokens", "10", "--ignore-eos",
                        "--temperature", "1.0", "--seed", seed, "--kv-cache-memory", "1MiB", "--json", "-") == 0
        return [o["token_ids"] for o in json.loads(capsys.readouterr().out)["outputs"]]

    assert texts("3") == texts("3") != texts("4")


@pytest.mark.parametrize(("extra", "message"), [
    (["--kv-cache-memory", "0.001MiB"], "holds no KV block"),
    (["--policy", "nope"], "unknown policy"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--prompt", "  "], "the prompt is empty"),
    (["--prompts-file", "/no/such/file"], "cannot read"),
    (["--static-offload", "--max-offload-ratio", "0"], "--static-offload needs --max-offload-ratio > 0"),
    (["--policy", "vamp", "--max-offload-ratio", "0"], "give it room with --max-offload-ratio"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_checkpoint, capsys, extra, message):
    args = ["--max-tokens", "2", "--prompt", "hi", *extra]
    if "--prompts-file" in extra:
        args.remove("--prompt"), args.remove("hi")
    assert generate(tiny_checkpoint("mixtral"), *args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and err.startswith("moetide generate: error:")


def test_missing_model_dir_is_a_user_error(tmp_path, capsys):
    assert generate(tmp_path / "absent", "--prompt", "hi", "--max-tokens", "2") == 2
    assert "not a checkpoint folder" in capsys.readouterr().err


def test_bench_engine_prints_one_json_line_per_batch_size(tiny_checkpoint, capsys):
    rc = main(["bench-engine", "--model", str(tiny_checkpoint("mixtral")), "--threads", "1",
               "--kv-cache-memory", "1MiB",
               "--batch-sizes", "1,3", "--prompt-tokens", "6", "--decode-tokens", "3", "--repeats", "2",
               "--warmup", "0"])
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["batch"] for line in lines] == [1, 3]
    for line in lines:
        assert line["prefill_tokens_per_s"]["median"] > 0 and line["decode_tokens_per_s"]["min"] > 0
        assert line["native_kernels"] is True or isinstance(line["native_kernels"], str)  # or why not


def test_vamp_runs_from_the_cli_under_a_tight_budget(tiny_checkpoint, tmp_path, capsys):
    """A smoke test of the CLI's wiring (the policy's behavior is tests/test_engine_vamp.py's)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The scheduler compares the cost of evicting a prefix\n" * 3 + "Linear attention keeps\n")
    rc = generate(tiny_checkpoint("mixtral"), "--prompts-file", str(prompts), "--max-tokens", "24", "--ignore-eos",
                  "--kv-cache-memory", "32KiB", "--block-size", "4", "--policy", "vamp-reclaim",
                  "--vamp-horizon-s", "0.01", "--max-num-batched-tokens", "32", "--json", "-")
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert all(len(o["token_ids"]) == 24 and o["finish_reason"] == "length" for o in report["outputs"])
    stats = report["stats"]
    assert {"experts_offloaded", "expert_reclaims", "offloaded_ratio"} <= set(stats)
    assert stats["offloaded_ratio"] <= 0.15
    # the report's cost record, given back, repeats every decision (counters that are not wall times)
    record = tmp_path / "first.json"
    record.write_text(json.dumps(report))
    rc = generate(tiny_checkpoint("mixtral"), "--prompts-file", str(prompts), "--max-tokens", "24", "--ignore-eos",
                  "--kv-cache-memory", "32KiB", "--block-size", "4", "--policy", "vamp-reclaim",
                  "--vamp-horizon-s", "0.01", "--max-num-batched-tokens", "32", "--json", "-",
                  "--vamp-costs", str(record))
    assert rc == 0
    again = json.loads(capsys.readouterr().out)
    assert again["vamp_costs"] == report["vamp_costs"] and again["outputs"] == report["outputs"]
    decisions = ("experts_offloaded", "expert_reclaims", "preemptions", "prefix_evictions", "steps")
    assert {k: again["stats"][k] for k in decisions} == {k: stats[k] for k in decisions}


def test_a_cost_record_that_means_nothing_is_one_clear_error(tiny_checkpoint, tmp_path, capsys):
    bad = tmp_path / "costs.json"
    bad.write_text(json.dumps({"vamp_costs": {"prefill_s_per_token": -1, "copy_s_per_expert": 0}}))
    rc = generate(tiny_checkpoint("mixtral"), "--prompt", "x", "--max-tokens", "2", "--policy", "vamp",
                  "--vamp-costs", str(bad))
    assert rc == 2 and "costs: EngineCosts.prefill_s_per_token" in capsys.readouterr().err


def test_routing_out_counts_every_token_top_k_times_per_layer(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """And the same counts, row for row, with one expert of layer 0 offloaded (staged when routed): what the
    residency's cold-first choice reads does not depend on where an expert's weights came from."""
    layers_routed = {True: set(), False: set()}  # has an offloaded expert -> MoE layers routed
    route = StagedExpertProvider.route

    def recording_route(self, layer_id, expert_ids):
        m = self.moe_index[layer_id]
        layers_routed[any(key[0] == m for key in self.residency.all_offloaded())].add(m)
        return route(self, layer_id, expert_ids)

    monkeypatch.setattr(StagedExpertProvider, "route", recording_route)
    profiles = []
    for run, offload in enumerate([[], ["--static-offload", "--max-offload-ratio", "0.125"]]):
        out = tmp_path / f"routing{run}.json"
        assert generate(tiny_checkpoint("qwen3_moe"), "--prompt", "Mixture of experts", "--max-tokens", "5",
                        "--ignore-eos", "--kv-cache-memory", "1MiB", "--routing-out", str(out), "--json", "-",
                        *offload) == 0
        stats = json.loads(capsys.readouterr().out)["stats"]
        profile = json.loads(out.read_text())
        assert profile["format"] == "moetide-routing-profile/1"
        assert profile["num_experts"] == len(profile["counts"][0])
        computed = stats["prompt_tokens"] + stats["generated_tokens"] - 1  # the last token is sampled, never fed
        assert [sum(row) for row in profile["counts"]] == [computed * profile["top_k"]] * len(profile["counts"])
        profiles.append(profile["counts"])
        assert layers_routed == ({True: {0}, False: {1}} if offload else {True: set(), False: {0, 1}})
        for layers in layers_routed.values():
            layers.clear()
    assert profiles[0] == profiles[1] and profiles[0][0] != profiles[0][1]


def test_a_moved_line_is_reported_in_words(tiny_checkpoint, tmp_path, capsys):
    """24 prompts sharing a prefix in a KV cache of two blocks: under vllm none fits, under vamp all finish by
    giving one expert's memory to the KV cache, and the report says so in words."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"You are a careful assistant. Answer briefly. Question {i}: what is a prefix "
                               f"cache?\n" for i in range(24)))
    common = ("--prompts-file", str(prompts), "--max-tokens", "8", "--kv-cache-memory", "32KiB")
    assert generate(tiny_checkpoint("qwen3_moe"), *common, "--policy", "vllm") == 1
    err = capsys.readouterr().err
    assert "every request failed: none of the 24 requests fits the KV cache of 32 KiB (raise --kv-cache-memory, " \
           "or give --kv-host-memory)" in err
    assert generate(tiny_checkpoint("qwen3_moe"), *common, "--policy", "vamp") == 0
    out = capsys.readouterr().out
    assert out.count("--- prompt ") == 24 and "[failed" not in out
    [line] = [x for x in out.splitlines() if x.startswith("the weights/KV line moved: ")]
    assert line.startswith("the weights/KV line moved: 1 expert is served from host memory (12.5% of "
                           "routed-expert bytes), and the KV cache went from 2 to ")
    assert int(line.split(" to ")[-1].split()[0]) > 2


def test_every_request_failing_with_a_host_tier_says_which_budgets_to_raise(tiny_checkpoint, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text((" ".join(["the scheduler compares the cost"] * 20) + "\n") * 2)
    rc = generate(tiny_checkpoint("mixtral"), "--prompts-file", str(prompts), "--max-tokens", "4",
                  "--kv-cache-memory", "32KiB", "--kv-host-memory", "8KiB", "--block-size", "2",
                  "--max-offload-ratio", "0")
    err = capsys.readouterr().err
    assert rc == 1 and "none of the 2 requests fits the KV cache of 32 KiB and 8 KiB of host KV" in err
    assert "(raise --kv-cache-memory or --kv-host-memory)" in err


@pytest.mark.parametrize(("max_tokens", "reason", "ran"), [(71, "length", True), (72, "failed", False)])
def test_a_request_that_can_never_be_held_fails_before_any_step(tiny_checkpoint, capsys, max_tokens, reason, ran):
    """32 KiB of device KV and 8 KiB of host KV in 2-token blocks hold 40 blocks, 80 tokens of one sequence; a
    10-token prompt with 71 output tokens needs 80 of them (the last token is sampled, never stored) and runs; with
    72 it can never be held and fails before any step (it used to run 71 steps first)."""
    rc = generate(tiny_checkpoint("mixtral"), "--prompt", "the scheduler compares the cost", "--max-tokens",
                  str(max_tokens), "--ignore-eos", "--kv-cache-memory", "32KiB", "--kv-host-memory", "8KiB",
                  "--block-size", "2", "--max-offload-ratio", "0", "--json", "-")
    report = json.loads(capsys.readouterr().out)
    [out] = report["outputs"]
    assert len(out["prompt_token_ids"]) == 10 and out["finish_reason"] == reason
    assert (rc, report["stats"]["steps"] > 0, len(out["token_ids"])) == ((0, True, 71) if ran else (1, False, 0))
