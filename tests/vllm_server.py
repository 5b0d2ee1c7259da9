"""``moetide serve --engine vllm`` in a subprocess, for the tests that serve: start it, drive it with the OpenAI
client, read its ``/metrics`` and its log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

KEY = "moetide-test-key-5f2c"  # $MOETIDE_API_KEY: every /v1 call needs it, and no log line may show it


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``moetide serve --engine vllm --model MODEL FLAGS`` on a free port of 127.0.0.1, served as ``tiny``, with
    ``$MOETIDE_API_KEY`` set to ``KEY`` and vLLM's INFO log on (the no-model harness, imported earlier in the same
    session, turns it down in this process's environment); up once ``/health`` answers."""

    def __init__(self, model, *flags: str) -> None:
        self.port = free_port()
        self.log = tempfile.TemporaryFile("w+")  # the server's output, read back at the end (a pipe could fill)
        argv = [sys.executable, "-m", "moetide.cli", "serve", "--engine", "vllm", "--model", str(model),
                "--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(self.port),
                "--served-model-name", "tiny", *flags]
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                        env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1",
                                                 MOETIDE_API_KEY=KEY, VLLM_LOGGING_LEVEL="INFO"))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited ({self.process.returncode}):\n{self.output()[-6000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        self.close()
        raise AssertionError("the server did not answer /health within 300 s")

    def complete_all(self, prompts: list[str]) -> list[tuple[list[int], list[int]]]:
        """Each prompt's (prompt token ids, greedy token ids), all requests in flight at once."""
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=KEY)

        def one(prompt: str) -> tuple[list[int], list[int]]:
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body={"return_token_ids": True})
            choice = answer.choices[0]
            assert choice.finish_reason == "length" and len(choice.token_ids) == 12
            return choice.prompt_token_ids, choice.token_ids

        with ThreadPoolExecutor(len(prompts)) as pool:  # a burst: all in flight at once
            return list(pool.map(one, prompts))

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as response:
            text = response.read().decode()
        assert "vllm:num_requests_running" in text  # vLLM's own series are there too
        values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)]
        assert values, f"{name} not on /metrics"
        return sum(values)

    def refuses_without_the_key(self) -> bool:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/models", headers=headers)
            try:
                urllib.request.urlopen(request, timeout=10)
                return False
            except urllib.error.HTTPError as error:
                if error.code != 401:
                    return False
        return True

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def stream_until_done(port: int, prompt: str, max_tokens: int, started: list) -> dict:
    """One streaming completion read to its end (``started`` gets an entry at its first event): the events
    received, the last finish reason or error event, and when the stream closed (``time.monotonic``)."""
    import json

    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    events, end = 0, None
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            for line in response:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                events += 1
                if events == 1:
                    started.append(1)
                if "error" in event:
                    end = "error"
                elif event["choices"][0].get("finish_reason"):
                    end = event["choices"][0]["finish_reason"]
    except OSError as exc:
        end = f"{type(exc).__name__}: {exc}"
    return {"events": events, "end": end, "closed_at": time.monotonic()}
