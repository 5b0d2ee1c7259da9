"""Bad input, overload, disconnects and SIGTERM: what vLLM's server answers, and nothing left holding blocks (the
pool's invariants hold and no request holds a block after every test)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    from moetide.commands.serve import serve_in_thread

    live = serve_in_thread(tiny_checkpoint("qwen3_moe"), "--threads", "1", "--max-model-len", str(MAX_MODEL_LEN),
                           "--max-num-queued-reqs", "2")
    yield live
    live.stop()


@pytest.fixture
def client(server):
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    server.idle()


def post(server, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def num_aborted(server) -> float:
    with urllib.request.urlopen(server.url + "/metrics") as response:
        for line in response.read().decode().splitlines():
            if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line:
                return float(line.split()[-1])
    raise AssertionError("no abort counter")


@pytest.mark.parametrize("body, param", [
    (b'{"prompt": "hello", "max_tokens": ', None),
    ({"prompt": "hello", "max_tokens": 4, "best_of_three": 1}, "best_of_three"),
    ({"prompt": "hello", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hello", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "hello", "temperature": -1}, "temperature"),
    ({"prompt": "hello", "top_p": 0}, "top_p"),
    ({"prompt": "hello", "n": 0}, "n"),
    ({"prompt": "hello " * MAX_MODEL_LEN, "max_tokens": 4}, "max_tokens"),
    ({"prompt": "hello", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"prompt": [10**9], "max_tokens": 4}, "prompt"),
    ({"prompt": "hello", "max_tokens": 4, "stop": ""}, "stop"),
    ({"prompt": "hello", "max_tokens": 4, "stop": ["lo", ""]}, "stop"),
])
def test_bad_completion_input_is_400_with_an_openai_error_body(server, client, body, param):
    status, answer = post(server, "/v1/completions", body)
    assert status == 400
    assert answer["error"]["type"] == "BadRequestError" and answer["error"]["code"] == 400
    assert answer["error"]["param"] == param and answer["error"]["message"]


def test_a_chat_prompt_past_the_context_is_400_through_the_client(server, client):
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024"):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi " * 2000}])


def test_another_models_name_is_404(server, client):
    status, answer = post(server, "/v1/completions", {"model": "gpt-5", "prompt": "hello"})
    assert status == 404 and answer["error"]["type"] == "NotFoundError"


def test_past_the_queue_bound_is_503_and_within_it_the_request_waits(server, client):
    status, answer = post(server, "/v1/completions", {"prompt": "hello", "max_tokens": 2, "n": 3})
    assert status == 503 and answer["error"]["code"] == 503
    stream = client.completions.create(model=server.model, prompt="hello", max_tokens=MAX_MODEL_LEN - 8, n=2,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    with pytest.raises(openai.InternalServerError) as refused:
        client.completions.create(model=server.model, prompt="hello", max_tokens=2)
    assert refused.value.status_code == 503
    stream.close()


def test_a_client_that_leaves_mid_stream_aborts_its_request_and_frees_its_blocks(server, client):
    before = num_aborted(server)
    stream = client.completions.create(model=server.model, prompt="hello", max_tokens=MAX_MODEL_LEN - 8,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert server.loop.num_in_flight == 1
    stream.close()
    server.idle()  # no request in flight, none holds a block, the pool's invariants hold
    assert num_aborted(server) == before + 1


def test_a_client_that_leaves_before_a_whole_answer_aborts_it_too(server, client):
    import gc
    import logging

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("asyncio").addHandler(handler)
    before = num_aborted(server)
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port))
    connection.request("POST", "/v1/completions", json.dumps(
        {"prompt": "hello", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True}), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while server.loop.num_in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    connection.close()
    server.idle()
    assert num_aborted(server) == before + 1
    time.sleep(0.3)
    gc.collect()  # an unread future's exception is logged, with its traceback, when the future is collected
    time.sleep(0.2)
    logging.getLogger("asyncio").removeHandler(handler)
    assert not [m for m in logged if "never retrieved" in m], logged


def test_sigterm_lets_the_request_in_flight_finish_then_exits_by_the_signal(tiny_checkpoint, tmp_path):
    from moetide.serve.harness import CHAT_TEMPLATE, free_port, wait_until_up

    port = free_port()
    command = [sys.executable, "-c", "import sys; from moetide.cli import main; sys.exit(main())", "serve",
               "--model", str(tiny_checkpoint("qwen3_moe")), "--threads", "1", "--port", str(port),
               "--host", "127.0.0.1", "--chat-template", CHAT_TEMPLATE, "--uvicorn-log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_up(url, process)
        body = json.dumps({"prompt": "hello", "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                           "stream": True}).encode()
        response = urllib.request.urlopen(urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}))
        first = response.readline()
        assert first.startswith(b"data: ")
        process.send_signal(signal.SIGTERM)
        lines = [line for line in (first + response.read()).decode().splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=30) == -signal.SIGTERM  # uvicorn re-raises it once drained
        assert b"Traceback" not in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_port_in_use_is_one_clear_error_before_the_engine_is_built(tiny_checkpoint, capsys):
    import socket

    from moetide.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(tiny_checkpoint("qwen3_moe")), "--host", "127.0.0.1",
                     "--port", str(port)]) == 2
    assert f"--port {port}: cannot listen there" in capsys.readouterr().err


def test_metrics_say_no_block_is_held_and_the_invariants_hold_once_requests_left(server, client):
    stream = client.completions.create(model=server.model, prompt="hello", max_tokens=MAX_MODEL_LEN - 8,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    with urllib.request.urlopen(server.url + "/metrics") as response:
        during = response.read().decode()
    stream.close()
    server.idle()
    with urllib.request.urlopen(server.url + "/metrics") as response:
        after = response.read().decode()

    def value(text: str, name: str) -> float:
        return float(next(line for line in text.splitlines() if line.startswith(name + "{")).split()[-1])

    assert value(during, "moetide_kv_blocks_held") > 0 and value(during, "moetide_pool_invariants_ok") == 1
    assert value(after, "moetide_kv_blocks_held") == 0 and value(after, "moetide_pool_invariants_ok") == 1
