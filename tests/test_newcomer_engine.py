"""What a new user meets on ``moetide generate``: an impossible KV budget, a model length passed, every request
failing, a checkpoint without tokenizer files or with a broken config.json, and the engine options' shared
names. Each runs the command as a user would (``cli.main``: exit code and stderr)."""

from __future__ import annotations

import json

import pytest

from moetide.cli import main
from test_newcomer import one_error

pytest.importorskip("torch")
pytest.importorskip("transformers")


def generate(model, *extra: str) -> int:
    return main(["generate", "--model", str(model), "--threads", "1", *extra])


def test_a_kv_budget_past_the_machine_is_one_line(tiny_checkpoint, capsys):
    model = tiny_checkpoint("mixtral")
    capsys.readouterr()  # (the fixture's own output, when it writes the checkpoint)
    rc = generate(model, "--prompt", "hi", "--max-tokens", "4", "--kv-cache-memory", "1e9MiB")
    out, err = capsys.readouterr()
    assert rc == 2 and "MemoryError" not in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.splitlines()[-1].startswith("moetide generate: error: a KV budget of 1,048,576,000,000,000 bytes")
    assert "of cpu memory here" in err


def test_max_tokens_past_the_model_length_is_refused(tiny_checkpoint, capsys):
    rc = generate(tiny_checkpoint("mixtral"), "--prompt", "hi", "--max-tokens", "5000")
    one_error(capsys, rc, "generate", "past --max-model-len 4,096", "--max-tokens 5,000")


def test_max_model_len_past_the_positions_warns_and_runs(tiny_checkpoint, capsys):
    rc = generate(tiny_checkpoint("mixtral"), "--prompt", "hi", "--max-tokens", "2", "--max-model-len", "8k")
    assert rc == 0 and "past the model's max_position_embeddings (4,096)" in capsys.readouterr().err


def test_every_request_failed_is_exit_1(tiny_checkpoint, capsys):
    prompt = " ".join(["the scheduler compares the cost"] * 20)
    rc = generate(tiny_checkpoint("mixtral"), "--prompt", prompt, "--max-tokens", "4", "--kv-cache-memory", "32KiB",
                  "--block-size", "2", "--max-offload-ratio", "0")
    out, err = capsys.readouterr()
    assert rc == 1 and "[failed: it never fits the KV cache]" in out
    assert "every request failed" in err and "--kv-cache-memory" in err


def test_missing_tokenizer_files_say_so(copy_checkpoint, capsys):
    model = copy_checkpoint("mixtral")
    (model / "tokenizer.json").unlink()
    one_error(capsys, generate(model, "--prompt", "hi there", "--max-tokens", "2"), "generate", "no tokenizer files")


def test_a_broken_config_is_blamed_on_itself_with_its_line(copy_checkpoint, capsys):
    model = copy_checkpoint("mixtral")
    (model / "config.json").write_text('{"model_type": "mixtral",\n')
    one_error(capsys, generate(model, "--prompt", "hi", "--max-tokens", "2"), "generate", "config.json: not JSON",
              "line 2 column 1")


def test_model_as_config_json_and_sizes_with_units(tiny_checkpoint, tmp_path, capsys):
    model = tiny_checkpoint("mixtral")
    out = tmp_path / "a.json"
    assert generate(model / "config.json", "--prompt", "hi", "--max-tokens", "3", "--ignore-eos",
                    "--kv-cache-memory", "1MiB", "--json", str(out)) == 0
    assert generate(model, "--prompt", "hi", "--max-tokens", "3", "--ignore-eos", "--kv-cache-memory", "1MiB",
                    "--json", str(tmp_path / "b.json")) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["outputs"] == json.loads((tmp_path / "b.json").read_text())["outputs"]


def test_engine_option_group_is_importable_for_other_verbs():
    import argparse

    from moetide.commands.generate import add_engine_arguments, build_engine

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", "m", "--kv-cache-memory", "2MiB", "--kv-host-memory", "1MiB"])
    assert (args.kv_cache_memory, args.kv_host_memory, args.max_num_batched_tokens) == (2**21, 2**20, None)
    from moetide.engine.build import EngineConfig  # None: the engine's resolution of vLLM's default

    assert EngineConfig(kv_cache_memory=2**21).max_num_batched_tokens == 8192
    assert callable(build_engine)
