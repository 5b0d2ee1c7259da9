"""``moetide serve --api-key`` (or ``$MOETIDE_API_KEY``), as vLLM's ``--api-key``: every ``/v1`` route needs the
Bearer key (401 with an OpenAI error body otherwise), ``/health`` and ``/metrics`` stay open, and the key appears
in no log line. Without a key on every interface, the start-up log says what that means."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

KEY = "mt-test-9f3b27c1e5"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    from moetide.commands.serve import serve_in_thread

    live = serve_in_thread(tiny_checkpoint("qwen3_moe"), "--threads", "1", "--max-model-len", "256", "--api-key", KEY)
    yield live
    live.stop()


def client(server, key: str):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def calls(server, key: str):
    c = client(server, key)
    return {"models": lambda: c.models.list(),
            "completions": lambda: c.completions.create(model=server.model, prompt="hi", max_tokens=2),
            "chat": lambda: c.chat.completions.create(model=server.model, max_tokens=2,
                                                      messages=[{"role": "user", "content": "hi"}])}


@pytest.mark.parametrize("route", ["models", "completions", "chat"])
@pytest.mark.parametrize("key", ["wrong-key", KEY + "x", KEY[:-1]])
def test_a_wrong_key_is_401_on_every_v1_route(server, route, key):
    with pytest.raises(openai.AuthenticationError) as caught:
        calls(server, key)[route]()
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "AuthenticationError" and "API key" in caught.value.body["message"]


@pytest.mark.parametrize("path", ["/v1/models", "/v1/completions", "/v1"])
def test_no_key_at_all_is_401(server, path):
    data = json.dumps({"prompt": "hi", "max_tokens": 2}).encode() if path == "/v1/completions" else None
    request = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request)
    assert caught.value.code == 401 and json.loads(caught.value.read())["error"]["code"] == 401


def test_the_right_key_works_and_health_and_metrics_stay_open(server):
    routes = calls(server, KEY)
    assert routes["models"]().data[0].id == server.model
    assert routes["completions"]().usage.completion_tokens == 2
    assert routes["chat"]().usage.completion_tokens == 2
    for path in ("/health", "/metrics"):
        with urllib.request.urlopen(server.url + path) as response:
            assert response.status == 200


def test_the_key_from_the_environment_and_never_in_the_log(tiny_checkpoint, tmp_path):
    from moetide.serve.harness import free_port, wait_until_up

    port = free_port()
    command = [sys.executable, "-c", "import sys; from moetide.cli import main; sys.exit(main())", "serve",
               "--model", str(tiny_checkpoint("qwen3_moe")), "--threads", "1", "--port", str(port),
               "--host", "127.0.0.1", "--max-model-len", "256", "--uvicorn-log-level", "info"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "MOETIDE_API_KEY": KEY})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_up(url, process)
        for key in ("wrong", KEY):
            request = urllib.request.Request(url + "/v1/completions", data=json.dumps(
                {"prompt": "hi", "max_tokens": 2}).encode(), headers={"Content-Type": "application/json",
                                                                      "Authorization": f"Bearer {key}"})
            try:
                status = urllib.request.urlopen(request).status
            except urllib.error.HTTPError as exc:
                status = exc.code
            assert status == (200 if key == KEY else 401)
        process.send_signal(signal.SIGTERM)
        log = process.communicate(timeout=60)[0].decode()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "API key: required" in log and '"POST /v1/completions HTTP/1.1" 401' in log
    assert KEY not in log and "Traceback" not in log


def test_every_interface_without_a_key_is_said_at_start(tiny_checkpoint, capsys):
    import argparse

    from moetide.commands import serve as serve_command
    from moetide.serve.harness import free_port

    parser = argparse.ArgumentParser()
    serve_command.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_checkpoint("qwen3_moe")), "--port", str(free_port()),
                              "--max-model-len", "256", "--threads", "1"])
    env = os.environ.pop(serve_command.API_KEY_ENV, None)
    try:
        serve_command.build_app(args)
    finally:
        if env is not None:
            os.environ[serve_command.API_KEY_ENV] = env
    err = capsys.readouterr().err
    assert "API key: none" in err
    assert "warning: listening on every interface (0.0.0.0) without an API key: anyone who can reach port" in err
