"""``moetide serve`` at start, as vLLM starts: it logs what it serves (model, max_model_len, the KV cache, the
policy, the chat template), refuses a KV cache that cannot hold one max_model_len sequence, with the numbers, and
refuses a chat template that fails on a one-message conversation, before any request arrives."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from moetide.cli import main  # noqa: E402


def serve(model, *args: str) -> int:
    from moetide.serve.harness import free_port

    return main(["serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(free_port()), "--threads", "1",
                 *args])


def test_a_kv_cache_too_small_for_one_sequence_is_refused_with_the_numbers(tiny_checkpoint, capsys):
    assert serve(tiny_checkpoint("qwen3_moe"), "--kv-cache-memory", "256KiB", "--max-offload-ratio", "0") == 2
    err = capsys.readouterr().err
    # 256 KiB is 8 arena pages of 32 KiB; a block is 16 tokens x 768 B = 12 KiB, two to a page: 16 blocks, 256 tokens
    assert "the KV cache holds at most 256 tokens of one sequence (--kv-cache-memory 256 KiB), less than " \
           "--max-model-len 4,096: raise --kv-cache-memory, or serve --max-model-len 256 or less" in err
    assert len(err.strip().splitlines()) == 1


def test_the_offload_cap_counts_toward_what_one_sequence_can_hold(tiny_checkpoint, capsys):
    # the same KV cache under vamp may grow by the cap's experts: more tokens than under vllm, still short of 4,096
    assert serve(tiny_checkpoint("qwen3_moe"), "--kv-cache-memory", "256KiB", "--policy", "vamp") == 2
    held = int(capsys.readouterr().err.split("holds at most ")[1].split()[0].replace(",", ""))
    assert held > 256


def test_a_broken_chat_template_is_refused_at_start(tiny_checkpoint, capsys):
    assert serve(tiny_checkpoint("qwen3_moe"), "--chat-template", "{% for m in messages %}{{ m.content }") == 2
    err = capsys.readouterr().err
    assert "--chat-template {% for m in messages %}{{ m.content }: it fails on a one-message conversation: " \
           "TemplateSyntaxError" in err


def test_the_start_up_log_names_what_is_served(tiny_checkpoint, capsys):
    from moetide.commands.serve import serve_in_thread

    live = serve_in_thread(tiny_checkpoint("qwen3_moe"), "--threads", "1", "--max-model-len", "512",
                           "--kv-cache-memory", "1MiB")
    try:
        err = capsys.readouterr().err
    finally:
        live.stop()
    [line] = [x for x in err.splitlines() if x.startswith("moetide serve: model ")]
    assert "max_model_len 512;" in line and "blocks of 16 tokens (1 MiB; one sequence at most" in line
    assert "policy vllm (max offload ratio" in line and "chat template: --chat-template" in line


def test_without_any_chat_template_the_log_says_what_chat_will_answer(tiny_checkpoint, capsys):
    from moetide.commands.serve import check_chat_template

    class NoTemplate:
        chat_template = None

    assert check_chat_template(NoTemplate(), None, None).startswith(
        "none: /v1/chat/completions answers 400 until the server is started with --chat-template")


def test_a_body_past_the_limit_is_413_and_prompts_are_tokenized_off_the_event_loop(tiny_checkpoint, monkeypatch):
    """A 10 MB prompt is refused before anything parses it (413, an OpenAI error body); an accepted prompt is
    tokenized on a worker thread, so the event loop keeps serving other requests meanwhile."""
    import asyncio
    import json
    import urllib.error
    import urllib.request

    import moetide.commands.serve as serve_command
    from moetide.commands.serve import serve_in_thread

    on_loop: list[bool] = []
    load = serve_command.load_tokenizer

    def recording_tokenizer(model):
        tokenizer = load(model)
        encode = tokenizer.encode

        def recorded(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:
                on_loop.append(False)
            return encode(*args, **kwargs)

        tokenizer.encode = recorded
        return tokenizer

    monkeypatch.setattr(serve_command, "load_tokenizer", recording_tokenizer)
    live = serve_in_thread(tiny_checkpoint("qwen3_moe"), "--threads", "1", "--max-model-len", "512")
    try:
        def post(body: bytes) -> tuple[int, dict]:
            request = urllib.request.Request(live.url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        status, doc = post(json.dumps({"prompt": "x " * 5_000_000, "max_tokens": 1}).encode())
        assert status == 413 and doc["error"]["type"] == "RequestTooLargeError"
        assert "larger than this server's limit of 1,048,576 bytes (--max-request-bytes)" in doc["error"]["message"]
        assert on_loop == []  # refused before any tokenizing
        status, doc = post(json.dumps({"prompt": "hello there", "max_tokens": 2}).encode())
        assert status == 200 and on_loop and not any(on_loop)
    finally:
        live.stop()
