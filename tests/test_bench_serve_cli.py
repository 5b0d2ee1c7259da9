"""``moetide bench-serve`` as a user meets it, run as a subprocess against a small fake OpenAI server on the
loopback address: it reads the server's max_model_len and says what it does with requests that exceed it, says
how many requests and how long before it sends, groups failures by reason, sends chat bodies to a chat endpoint,
takes URLs as people write them, and keeps what finished when interrupted."""

from __future__ import annotations

import http.server
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

CLI = [sys.executable, "-c", "import sys; from moetide.cli import main; sys.exit(main())", "bench-serve"]


class FakeServer:
    """/v1/models with a max_model_len; streamed completions and chats of two tokens; every body kept."""

    def __init__(self, max_model_len: int = 1024, delay_s: float = 0.0, fail_every: int = 0) -> None:
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/v1/models":
                    self.send_error(404)
                    return
                self._json(200, {"object": "list", "data": [{"id": "fake", "max_model_len": max_model_len}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.bodies.append(body)
                    outer.paths.append(self.path)
                    number = len(outer.bodies)
                if fail_every and number % fail_every == 0:
                    self._json(400, {"error": {"message": "prompt too long for this test", "code": 400}})
                    return
                time.sleep(delay_s)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                if self.path.endswith("/chat/completions"):
                    chunks = [{"choices": [{"delta": {"role": "assistant"}}]},
                              {"choices": [{"delta": {"content": "a"}}]}, {"choices": [{"delta": {"content": "b"}}]}]
                else:
                    chunks = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}]
                chunks.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}})
                for chunk in chunks:
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")

            def _json(self, status, doc):
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        lock = threading.Lock()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_port
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture
def fake():
    servers = []

    def make(**kwargs) -> FakeServer:
        servers.append(FakeServer(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def trace(tmp_path: Path, prompts: list[int], gap_ms: int = 10) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i * gap_ms, "input_length": n, "output_length": 4,
                                        "hash_ids": [i]}) + "\n" for i, n in enumerate(prompts)))
    return str(path)


def bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_requests_past_the_servers_max_model_len_are_skipped_and_said_so(fake, tmp_path):
    server = fake(max_model_len=1024)
    result = bench(trace(tmp_path, [100, 2000, 300]), "--url", f"http://127.0.0.1:{server.port}")
    assert result.returncode == 0, result.stderr
    assert "1 of 3 requests need more than the server's max_model_len of 1,024 tokens" in result.stdout
    assert "skipped (--too-long)" in result.stdout
    assert [len(b["prompt"]) for b in server.bodies] == [100, 300]
    assert "2 requests (open loop, 2 sessions)" in result.stdout and "the trace's timing alone takes" in result.stdout


def test_too_long_truncate_keeps_the_leading_tokens_and_fail_sends_nothing(fake, tmp_path):
    server = fake(max_model_len=1024)
    path = trace(tmp_path, [100, 2000])
    result = bench(path, "--url", f"http://127.0.0.1:{server.port}", "--too-long", "truncate")
    assert result.returncode == 0, result.stderr
    assert "truncated to fit" in result.stdout
    assert sorted(len(b["prompt"]) for b in server.bodies) == [100, 1020]  # 1,024 - 4 output tokens
    failing = fake(max_model_len=1024)
    result = bench(path, "--url", f"http://127.0.0.1:{failing.port}", "--too-long", "fail")
    assert result.returncode == 2 and failing.bodies == []
    assert "1 requests need more than the server's max_model_len of 1,024 tokens" in result.stderr
    assert "Traceback" not in result.stderr


WEKA = Path(__file__).resolve().parents[2] / "shared/traces/weka_claude_code/weka_cc_traces_compact.jsonl.gz"


@pytest.mark.skipif(not WEKA.exists(), reason=f"{WEKA} is absent (../shared/traces beside the checkout)")
def test_a_closed_loop_slice_says_it_keeps_whole_sessions(fake):
    server = fake(max_model_len=1_000_000)
    result = bench(str(WEKA), "--url", f"http://127.0.0.1:{server.port}", "--max-requests", "2",
                   "--time-scale", "0.00001", "--length-scale", "0.001")
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if "--max-requests 2 keeps whole sessions" in x)
    assert int(line.split(": ")[-1].split()[0]) > 2


def test_failures_are_grouped_by_reason_on_the_console(fake, tmp_path):
    server = fake(fail_every=2)
    result = bench(trace(tmp_path, [50] * 6), "--url", f"http://127.0.0.1:{server.port}")
    assert result.returncode == 1
    assert "Failed requests by reason:" in result.stdout
    assert "3 x HTTP 400:" in result.stdout and "prompt too long for this test" in result.stdout


def test_a_chat_endpoint_gets_chat_bodies_and_its_role_chunk_is_not_a_token(fake, tmp_path):
    server = fake()
    out = tmp_path / "r.json"
    result = bench(trace(tmp_path, [40, 40]), "--url", f"http://127.0.0.1:{server.port}", "--endpoint",
                   "/v1/chat/completions", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert set(server.paths) == {"/v1/chat/completions"}
    assert all(len(b["messages"]) == 1 and b["messages"][0]["role"] == "user" for b in server.bodies)
    assert all(len(b["messages"][0]["content"].split()) == 40 and "prompt" not in b for b in server.bodies)
    doc = json.loads(out.read_text())
    assert doc["completed"] == 2 and doc["output_lens"] == [2, 2] and all(len(x) == 1 for x in doc["itls"])


@pytest.mark.parametrize(("url", "warning"), [
    ("127.0.0.1:{port}", "no scheme; using http://127.0.0.1:{port}"),
    ("localhost:{port}", "no scheme; using http://localhost:{port}"),
    ("http://127.0.0.1:{port}/v1", "dropping the trailing /v1"),
])
def test_urls_as_people_write_them_work_with_one_warning(fake, tmp_path, url, warning):
    server = fake()
    result = bench(trace(tmp_path, [30]), "--url", url.format(port=server.port))
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(warning.format(port=server.port)) == 1 and len(server.bodies) == 1


@pytest.mark.parametrize(("url", "message"), [
    ("ftp://127.0.0.1:1", "scheme 'ftp' is not http or https"),
    ("http://127.0.0.1:abc", "the port is not a number"),
    ("http://127.0.0.1:1", "connection refused; is the server up"),
])
def test_urls_that_cannot_work_get_one_line_and_exit_2(tmp_path, url, message):
    result = bench(trace(tmp_path, [30]), "--url", url)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_ctrl_c_keeps_what_finished(fake, tmp_path):
    server = fake(delay_s=0.2)
    out = tmp_path / "r.json"
    process = subprocess.Popen([*CLI, trace(tmp_path, [20] * 40, gap_ms=250), "--url",
                                f"http://127.0.0.1:{server.port}", "--json", str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(server.bodies) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "interrupted after" in stdout and "Serving Benchmark Result" in stdout
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and 4 <= doc["completed"] < 40 and doc["failed"] == 0
