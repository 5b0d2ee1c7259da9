"""``moetide serve --engine vllm``: vLLM's own OpenAI server with the plugin, driven by the OpenAI client, on
qwen3_moe, mixtral and qwen3_next checkpoints.

A burst of requests sharing a prefix, the last one longer than the base KV pool holds (2 MiB), sent twice against
``--policy vamp``: the line moves to admit it (``moetide:line_moves_total`` > 0 on ``/metrics``, beside vLLM's own
series), the offloaded experts (the coldest, by the workers' routing counts) are staged from their host copies
when routed (``moetide:stagings_total``) and none is routed without being staged (``moetide:unstaged_total`` 0),
every request completes, and the greedy tokens of both rounds equal ``--policy vllm``'s on a pool large enough for
the burst, up to stock vLLM's own near-ties (``tests/greedy.py``: how vLLM batches a burst depends on its pool, and
on these random-weight checkpoints that flips tokens whose log-probabilities are a few thousandths of a nat apart,
in stock vLLM too). In vLLM's default mode (the documented command: a compiled forward) and with
``--enforce-eager``; the two modes are compared each with itself, as their kernels differ.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import tempfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from greedy import check_greedy, stock_scorer

pytest.importorskip("vllm", reason="vLLM 0.32 is not installed here (scripts/install_vllm.sh installs it)")
openai = pytest.importorskip("openai")

SHARED = "shared " * 250
# the last request's length per architecture: longer than its base pool holds (qwen3_next's 640-token blocks and
# its linear-attention states need a longer one)
LONG_WORDS = {"qwen3_moe": 600, "mixtral": 600, "qwen3_next": 800}


EXPERT_BYTES = 3 * 64 * 4096 * 2  # one expert's w13 and w2 rows: hidden 64, width 4096, bf16


def prompts(arch: str) -> list[str]:
    return [SHARED + f"tail {i} " + "x " * (20 + 15 * i) for i in range(8)] + [SHARED + "long " * LONG_WORDS[arch]]


@pytest.fixture(scope="module", params=list(LONG_WORDS))
def checkpoint(request, tmp_path_factory):
    pytest.importorskip("transformers")
    from moetide.engine.testmodel import TinyModelArgs, make_test_model

    # experts of 1.5 MiB each, so that the offload cap of a tiny model is worth KV blocks
    extra = {"linear_head_dim": 128} if request.param == "qwen3_next" else {}
    return request.param, make_test_model(
        TinyModelArgs(arch=request.param, head_dim=64, dtype="bfloat16", moe_intermediate_size=4096, **extra),
        tmp_path_factory.mktemp("vllm_serve") / request.param)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


KEY = "moetide-test-key-5f2c"  # $MOETIDE_API_KEY: every /v1 call needs it, and no log line may show it


class Server:
    def __init__(self, model, policy: str, kv_cache_memory: str, *flags: str) -> None:
        self.port = free_port()
        self.log = tempfile.TemporaryFile("w+")  # the server's output, read back at the end (a pipe could fill)
        argv = [sys.executable, "-m", "moetide.cli", "serve", "--engine", "vllm", "--model", str(model),
                "--policy", policy, "--max-offload-ratio", "0.5", "--kv-cache-memory", kv_cache_memory,
                "--max-model-len", "4096", "--host", "127.0.0.1", "--port", str(self.port),
                "--served-model-name", "tiny", "--dtype", "bfloat16", "--max-num-seqs", "16", *flags]
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                        env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1",
                                                 MOETIDE_API_KEY=KEY))
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


MODES = {"default": (), "eager": ("--enforce-eager",)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_vamp_moves_the_line_for_a_burst_and_answers_as_vllm(checkpoint, mode):
    arch, model = checkpoint
    server = Server(model, "vamp", "2MiB", *MODES[mode])
    try:
        vamp_answers = [server.complete_all(prompts(arch)) for _ in range(2)]
        moves = server.metric("moetide:line_moves_total")
        granted = server.metric("moetide:kv_blocks_granted")
        ratio = server.metric("moetide:expert_offload_ratio")
        stagings = server.metric("moetide:stagings_total")
        staged_bytes = server.metric("moetide:staged_bytes_total")
        unstaged = server.metric("moetide:unstaged_total")
        assert server.refuses_without_the_key()
    finally:
        server.close()
    assert KEY not in server.output()
    assert moves > 0 and granted > 0 and 0 < ratio <= 0.5
    assert unstaged == 0  # no offloaded expert computed from memory the KV cache holds
    assert staged_bytes == stagings * EXPERT_BYTES  # whole experts, copied when routed
    # the residency offloads the coldest experts (the workers' routing counts): the qwen3_moe and qwen3_next bursts
    # route to them, mixtral's (deterministically) never does
    assert stagings > 0 or arch == "mixtral"
    server = Server(model, "vllm", "8MiB", *MODES[mode])
    try:
        vllm_answers = server.complete_all(prompts(arch))
        assert server.metric("moetide:line_moves_total") == 0
    finally:
        server.close()
    stock = [tokens for _, tokens in vllm_answers]
    for answers in vamp_answers:
        assert [prompt for prompt, _ in answers] == [prompt for prompt, _ in vllm_answers]
        report = check_greedy([tokens for _, tokens in answers], stock, [prompt for prompt, _ in answers],
                              stock_scorer(model, enforce_eager=mode == "eager"))
        print("greedy against stock vLLM:", report)
