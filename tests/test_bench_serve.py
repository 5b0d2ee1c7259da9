"""``moetide bench-serve``: prompts whose prefix structure is the trace's, vLLM's metric definitions, and a replay
against a live ``moetide serve`` whose prefix cache finds the trace's reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetide.cli import main
from moetide.serve.bench_client import RequestResult
from moetide.serve.bench_metrics import calculate_metrics, percentile
from moetide.serve.bench_prompts import FIRST_TOKEN_ID, PromptBuilder, bench_sessions
from moetide.workloads.scale import WorkloadScale, scale_workload
from moetide.workloads import load_workload

SHARED_TRACES = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"


def write_mooncake(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    """(timestamp ms, input_length, output_length, hash_ids) per line."""
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
                            for t, i, o, h in rows))
    return path


def test_equal_keys_are_equal_token_blocks_and_the_rest_is_private():
    builder = PromptBuilder(8, 50, seed=1)
    a = builder.prompt("", [5, 6, 7], 30, "a")
    b = builder.prompt("", [5, 6, 9], 30, "b")
    c = PromptBuilder(8, 50, seed=1).prompt("", [5, 6, 7], 30, "a")
    assert len(a) == len(b) == 30 and a == c  # same seed, same prompt, in any builder
    assert a[:16] == b[:16] and a[16:24] != b[16:24]  # keys 5, 6 shared; 7 vs 9 not
    assert a[24:] != b[24:]  # the uncovered tail is the request's own
    assert builder.prompt("other", [5], 8, "d") != a[:8]  # another key scope is another namespace
    assert all(FIRST_TOKEN_ID <= t < 50 for t in a + b)


def test_length_scale_scales_blocks_with_prompts_and_caps_keep_the_leading_blocks(tmp_path):
    trace = write_mooncake(tmp_path / "t.jsonl", [(0, 2048, 100, [1, 2, 3, 4]), (10, 1536, 300, [1, 2, 9])])
    workload = load_workload(trace, seed=0)
    full = bench_sessions(scale_workload(workload, WorkloadScale(length_scale=1 / 16)), seed=0)
    capped = bench_sessions(scale_workload(workload, WorkloadScale(length_scale=1 / 16, max_input_tokens=40,
                                                                   max_output_tokens=8)), seed=0)
    first, second = (s.turns[0] for s in full)
    assert (len(first.prompt_token_ids), len(second.prompt_token_ids)) == (128, 96)
    assert (first.output_tokens, second.output_tokens) == (6, 19)
    assert first.prompt_token_ids[:64] == second.prompt_token_ids[:64] != first.prompt_token_ids[64:]
    cut = capped[0].turns[0]
    assert len(cut.prompt_token_ids) == 40 and cut.prompt_token_ids[:32] == first.prompt_token_ids[:32]
    assert cut.output_tokens == 6 and capped[1].turns[0].output_tokens == 8
    assert (first.arrival_s, second.arrival_s) == (0.0, 0.01)


def test_metrics_follow_vllms_definitions():
    np = pytest.importorskip("numpy")
    results = [RequestResult("a", 10, 4, start_s=100.0, success=True, ttft_s=0.2, itl_s=[0.1, 0.1, 0.2],
                             latency_s=0.6, output_tokens=4),
               RequestResult("b", 20, 1, start_s=100.5, success=True, ttft_s=0.4, latency_s=0.4, output_tokens=1),
               RequestResult("c", 30, 5, start_s=101.0, error="HTTP 400")]
    m = calculate_metrics(results, duration_s=2.0)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 5)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 2.5 and m["total_token_throughput"] == 17.5
    assert m["mean_ttft_ms"] == pytest.approx(300) and m["median_ttft_ms"] == pytest.approx(300)
    assert m["mean_tpot_ms"] == pytest.approx((0.6 - 0.2) / 3 * 1000)  # only "a" has more than one token
    assert m["mean_itl_ms"] == pytest.approx(400 / 3) and m["p99_itl_ms"] == pytest.approx(np.percentile(
        [100, 100, 200], 99))
    assert m["std_e2el_ms"] == pytest.approx(np.std([600, 400]))
    assert m["max_concurrent_requests"] == 2 and m["max_output_tokens_per_s"] == 5  # all five tokens in second 0
    values = [3.0, 1.0, 4.0, 1.5, 9.0]
    assert [percentile(values, p) for p in (0, 37.5, 90, 100)] == pytest.approx(
        list(np.percentile(values, [0, 37.5, 90, 100])))


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    pytest.importorskip("fastapi")
    from moetide.commands.serve import serve_in_thread

    live = serve_in_thread(tiny_checkpoint("qwen3_moe"), "--threads", "1", "--max-model-len", "512")
    yield live
    live.stop()


def prefix_hits(server) -> float:
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics") as response:
        line = [s for s in response.read().decode().splitlines() if s.startswith("vllm:prefix_cache_hits_total")]
    return float(line[0].split()[-1])


def test_a_replay_against_moetide_serve_finds_the_traces_reuse(server, tmp_path, capsys):
    rows = [(0, 2048, 64, [1, 2, 3, 4]), (100, 2048, 48, [1, 2, 3, 5]), (200, 1536, 32, [1, 2]),
            (300, 1024, 16, [7, 8])]
    trace = write_mooncake(tmp_path / "t.jsonl", rows)
    hits = prefix_hits(server)
    out = tmp_path / "bench.json"
    assert main(["bench-serve", str(trace), "--url", server.url, "--length-scale", "0.0625", "--time-scale", "1",
                 "--json", str(out), "--plot", str(tmp_path / "bench.png")]) == 0
    report = json.loads(out.read_text())
    assert (report["completed"], report["failed"]) == (4, 0)
    assert report["output_lens"] == [4, 3, 2, 1] and report["input_lens"] == [128, 128, 96, 64]
    assert report["total_output_tokens"] == 10 and report["model_id"] == server.model
    assert all(t > 0 for t in report["ttfts"]) and report["p90_ttft_ms"] >= report["p50_ttft_ms"] > 0
    assert all(text for text in report["generated_texts"])  # each request streamed its text
    # the later requests share 3, then 2, key blocks of 32 tokens with what came before: 96 + 64 tokens cached
    assert prefix_hits(server) - hits == 96 + 64
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    server.idle()


def test_a_request_the_server_refuses_is_a_failure_with_its_reason(server, tmp_path, capsys):
    trace = write_mooncake(tmp_path / "t.jsonl", [(0, 600, 4, []), (0, 64, 4, [])])
    assert main(["bench-serve", str(trace), "--url", server.url, "--json", "-", "--too-long", "send"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["completed"] == 1 and "HTTP 400" in report["errors"][0] and "context length" in report["errors"][0]
    assert main(["bench-serve", str(trace), "--url", server.url, "--json", "-"]) == 0  # by default: skipped
    report = json.loads(capsys.readouterr().out)
    assert (report["num_prompts"], report["completed"], report["failed"]) == (1, 1, 0)
    server.idle()


def test_no_server_is_one_clear_error(tmp_path, capsys):
    trace = write_mooncake(tmp_path / "t.jsonl", [(0, 64, 4, [])])
    from moetide.serve.harness import free_port

    assert main(["bench-serve", str(trace), "--url", f"http://127.0.0.1:{free_port()}"]) == 2
    assert "connection refused; is the server up" in capsys.readouterr().err


@pytest.mark.skipif(not (SHARED_TRACES / "mooncake").is_dir(), reason="shared traces not present")
def test_a_slice_of_the_recorded_mooncake_trace_replays(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench-serve", str(SHARED_TRACES / "mooncake" / "conversation_trace.jsonl.gz"), "--url",
                 server.url, "--max-requests", "4", "--length-scale", "0.03125", "--max-input-tokens", "256",
                 "--max-output-tokens", "8", "--time-scale", "0.05", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 4 and max(report["input_lens"]) <= 256 and max(report["output_lens"]) <= 8
    server.idle()


def test_closed_loop_sessions_send_each_turn_after_the_previous_one_completes(server, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench-serve", "--url", server.url, "--sessions", "2", "--length-scale", "0.01",
                 "--max-input-tokens", "256", "--max-output-tokens", "4", "--time-scale", "0.001",
                 "--json", str(out)]) == 0  # no TRACE: the built-in agent sessions (closed loop)
    report = json.loads(out.read_text())
    assert report["failed"] == 0 and report["completed"] == len(report["request_ids"]) > 2
    turns: dict[str, list[int]] = {}
    for i, request_id in enumerate(report["request_ids"]):
        turns.setdefault(request_id.split("/")[0], []).append(i)
    assert len(turns) == 2
    for indices in turns.values():
        for before, after in zip(indices, indices[1:]):
            done = report["start_times"][before] + report["e2els"][before]
            assert report["start_times"][after] >= done
    server.idle()


def replay_against_stream(stream: bytes, endpoint: str = "/v1/completions"):
    """Three closed-loop turns against a server that answers every request with ``stream``; their results."""
    import http.server
    import threading

    from moetide.serve.bench_client import Target, replay
    from moetide.serve.bench_prompts import BenchSession, BenchTurn

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(stream)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        turns = tuple(BenchTurn(str(i), [5, 6, 7], 4, 0.0, 0.0) for i in range(3))
        target = Target(f"http://127.0.0.1:{httpd.server_port}", "m", endpoint)
        results, _, _ = replay([BenchSession("s", 0.0, turns)], "closed", target)
    finally:
        httpd.shutdown()
    return results


@pytest.mark.parametrize("stream", [
    b'data: {"error": "model overloaded"}\n\ndata: [DONE]\n\n',
    b'data: {"choices": [{"text": "a"}]}\n\ndata: {"error": {"message": "engine failed"}}\n\n',
    b'data: [1, 2]\n\n',
])
def test_whatever_a_server_streams_every_request_gets_a_result(stream):
    """An error chunk (a string or an object, before or after a token) or a chunk that is not an object fails
    that request with the server's words; the run goes on and every turn has a result."""
    results = replay_against_stream(stream)
    assert [r.request_id for r in results] == ["0", "1", "2"]
    assert not any(r.success for r in results) and all(r.error for r in results)


@pytest.mark.parametrize("endpoint, stream", [
    ("/v1/completions", b'data: {"choices": [{"text": "ab"}]}\n\ndata: {"choices": [{"text": ""}]}\n\n'
                        b'data: {"choices": [{"text": "c"}]}\n\ndata: [DONE]\n\n'),
    ("/v1/chat/completions", b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
                             b'data: {"choices": [{"delta": {"content": "ab"}}]}\n\n'
                             b'data: {"choices": [{"delta": {"content": "c"}}]}\n\ndata: [DONE]\n\n'),
])
def test_the_streamed_text_is_kept_as_vllms_generated_texts(endpoint, stream):
    """Each request keeps the text it streamed (an empty completion piece still counts as a token; a chat's
    role-only delta does not), and the per-request arrays carry it as vLLM's bench serve does."""
    from moetide.serve.bench_metrics import per_request

    results = replay_against_stream(stream, endpoint)
    assert [r.text for r in results] == ["abc"] * 3
    assert [r.output_tokens for r in results] == ([3] * 3 if endpoint == "/v1/completions" else [2] * 3)
    assert per_request(results)["generated_texts"] == ["abc"] * 3
