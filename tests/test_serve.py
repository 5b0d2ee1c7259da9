"""``moetide serve`` through the real ``openai`` client: completions and chat, streamed and not, equal to
``moetide generate``; sampling options; after every test the pool's invariants hold and no request holds blocks."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from moetide.cli import main  # noqa: E402

PROMPTS = ["Prefix caching keeps", "The quick brown fox", "hello"]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    from moetide.commands.serve import serve_in_thread

    live = serve_in_thread(tiny_checkpoint("qwen3_moe"), "--threads", "1", "--max-num-queued-reqs", "4",
                           "--max-num-seqs", "2")
    yield live
    live.stop()


@pytest.fixture
def client(server):
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    server.idle()


def generated(model, prompt: str, max_tokens: int, tmp_path, *extra: str) -> dict:
    out = tmp_path / "gen.json"
    assert main(["generate", "--model", model, "--threads", "1", "--prompt", prompt,
                 "--max-tokens", str(max_tokens), "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())["outputs"][0]


def finished(server, reason: str) -> float:
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics") as response:
        text = response.read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == reason)


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_completion_equals_moetide_generate_streamed_or_not(server, client, tmp_path, prompt):
    expected = generated(server.model, prompt, 12, tmp_path, "--ignore-eos")
    answer = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert answer.choices[0].text == expected["text"] and answer.choices[0].finish_reason == "length"
    assert answer.usage.prompt_tokens == len(expected["prompt_token_ids"]) and answer.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_applies_the_template_and_equals_the_engine_on_its_tokens(server, client):
    import transformers

    from moetide.commands.generate import build_engine
    from moetide.serve.harness import CHAT_TEMPLATE

    messages = [{"role": "user", "content": "What keeps a prefix?"}]
    tokenizer = transformers.AutoTokenizer.from_pretrained(server.model)
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                                         add_generation_prompt=True), add_special_tokens=False)
    engine = build_engine(server.args, ignore_eos=True)  # the server's engine options
    expected = tokenizer.decode(engine.generate([ids], 10).outputs[0].token_ids, skip_special_tokens=True)
    answer = client.chat.completions.create(model=server.model, messages=messages, max_tokens=10, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert answer.choices[0].message.content == expected and answer.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_content_parts_are_joined_as_vllm_joins_them_and_a_non_text_part_is_refused(server, client):
    parts = [{"type": "text", "text": "What keeps"}, {"type": "text", "text": "a prefix?"}]
    ask = dict(model=server.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    joined = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **ask)
    plain = client.chat.completions.create(messages=[{"role": "user", "content": "What keeps\na prefix?"}], **ask)
    assert joined.choices[0].message.content == plain.choices[0].message.content
    assert joined.usage.prompt_tokens == plain.usage.prompt_tokens
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: a part of type 'image_url'"):
        client.chat.completions.create(messages=[{"role": "user", "content": [parts[0], image]}], **ask)


def test_concurrent_requests_queue_and_batch_and_answer_as_alone(server, client):
    """Three at once with two sequences a step: one waits in the scheduler's queue, then joins the batch."""
    alone = {p: client.completions.create(model=server.model, prompt=p, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS}
    together: dict[str, str] = {}

    def ask(prompt: str) -> None:
        together[prompt] = client.completions.create(model=server.model, prompt=prompt, max_tokens=16,
                                                     temperature=0,
                                                     extra_body={"ignore_eos": True}).choices[0].text

    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS]
    most_waiting = 0
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        most_waiting = max(most_waiting, server.loop.metrics.num_waiting)
        time.sleep(0.002)
    for thread in threads:
        thread.join(60)
    assert together == alone and most_waiting >= 1


def test_seeded_sampling_repeats_and_n_gives_distinct_choices(server, client):
    def sample():
        return [c.text for c in client.completions.create(model=server.model, prompt="hello", max_tokens=8, n=2,
                                                           temperature=1.0, top_p=0.9, seed=7,
                                                           extra_body={"ignore_eos": True}).choices]

    first = sample()
    assert first == sample() and len(first) == 2 and first[0] != first[1]


def test_a_stop_string_cuts_the_text_before_it(server, client):
    full = client.completions.create(model=server.model, prompt="hello", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[3:5]
    stops_before = finished(server, "stop")
    cut = client.completions.create(model=server.model, prompt="hello", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = list(client.completions.create(model=server.model, prompt="hello", max_tokens=12, temperature=0,
                                              stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"
    server.idle()
    assert finished(server, "stop") == stops_before + 2  # counted as vLLM counts it, not as an abort


def test_models_health_and_metrics(server, client):
    import urllib.request

    assert [m.id for m in client.models.list().data] == [server.model]
    client.completions.create(model=server.model, prompt="hello", max_tokens=4, temperature=0)
    with urllib.request.urlopen(server.url + "/health") as response:
        assert response.status == 200
    with urllib.request.urlopen(server.url + "/metrics") as response:
        text = response.read().decode()
    samples = {(s.name, s.labels.get("finished_reason")): s for family in text_string_to_metric_families(text)
               for s in family.samples}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "moetide_offloaded_expert_ratio", "moetide_kv_host_blocks", "moetide_experts_staged_total"):
        sample = samples[name, None]
        assert sample.labels["model_name"] == server.model and sample.labels["engine"] == "0"
    assert samples["vllm:num_requests_running", None].value == 0
    assert samples["vllm:time_to_first_token_seconds_count", None].value >= 1
    assert samples["vllm:prefix_cache_queries_total", None].value >= samples["vllm:prefix_cache_hits_total", None].value
    assert samples["vllm:request_success_total", "length"].value >= 1
    assert not any(name.endswith("_created") for name, _ in samples)
    # the loop's step counters and the two threads' CPU seconds (benchmarks/serve_prediction.py reads them)
    steps = samples["moetide_engine_steps_total", None].value
    assert steps >= 4 and samples["moetide_engine_step_seconds_total", None].value > 0
    assert 0 < samples["moetide_engine_step_cpu_seconds_total", None].value
    assert samples["moetide_server_thread_cpu_seconds_total", None].value > 0
