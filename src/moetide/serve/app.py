"""The HTTP routes: OpenAI's completions and chat completions (streamed as server-sent events or not), models,
health and metrics, on FastAPI. Every refusal is an OpenAI-style error body (``protocol.error_body``): 400 for bad
input (malformed JSON, unknown fields, values out of range, a prompt and ``max_tokens`` past the context), 404 for
another model's name, 503 past ``max_num_queued_reqs`` requests in flight (vLLM's ``--max-num-queued-reqs``; without
it a request waits in the scheduler's queue however long it is).

A request's choices are engine requests (``n`` per prompt). A client that goes away — a stream it stops reading,
or a connection closed while a non-streamed answer is computed — aborts its engine requests, whose blocks are
freed before the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moetide.engine.sampling import SamplingParams
from moetide.serve.loop import EngineLoop, RequestHandle
from moetide.serve.metrics import CONTENT_TYPE, ServerMetrics
from moetide.serve.middleware import ApiKey, BodyLimit
from moetide.serve.protocol import (ChatCompletionRequest, CompletionRequest, ServeError, completion_prompts,
                                    error_body)
from moetide.serve.text import ChoiceText

DISCONNECT_POLL_S = 0.2


@dataclass(frozen=True)
class ServeConfig:
    model_name: str
    model_dir: str
    max_model_len: int
    max_num_queued_reqs: int | None = None
    chat_template: str | None = None  # None: the tokenizer's own
    default_temperature: float = 1.0  # vLLM's, unless generation_config.json says otherwise
    default_top_p: float = 1.0
    max_request_bytes: int = 1 << 20  # a request body past this is answered 413 (BodyLimit)
    api_key: str | None = field(default=None, repr=False)  # every /v1 route needs it (ApiKey); never printed


@dataclass
class _Choice:
    handle: RequestHandle
    text: ChoiceText
    finish_reason: str | None = None


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def create_app(loop: EngineLoop, tokenizer, config: ServeConfig, metrics: ServerMetrics) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        loop.start()
        yield
        loop.stop(timeout_s=30)

    app = FastAPI(title="moetide", lifespan=lifespan)
    api = _Api(loop, tokenizer, config)
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        alive = loop.error is None and loop.is_alive()
        return Response(status_code=200 if alive else 500)

    @app.get("/metrics")
    async def prometheus():  # the invariant audit waits for the engine's next gap, off the event loop
        metrics.invariants_ok = await asyncio.to_thread(loop.audit)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "moetide", "root": config.model_dir, "parent": None,
                                            "max_model_len": config.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        # tokenized on a worker thread: a long prompt does not hold up the requests the event loop serves meanwhile
        prompts = await asyncio.to_thread(lambda: [api.encode(p) for p in completion_prompts(body)])
        return await api.respond(body, prompts, body.max_tokens, raw, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        prompt = await asyncio.to_thread(api.chat_prompt, body)
        return await api.respond(body, [prompt], body.requested_max_tokens(), raw, chat=True)

    limited = BodyLimit(app, config.max_request_bytes)
    return limited if config.api_key is None else ApiKey(limited, config.api_key)


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal as an OpenAI-style error body: a body FastAPI could not validate (400), a ``ServeError``."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            where = None
            message = f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')}, at "\
                      f"character {first.get('loc', ('', '?'))[-1]})"
        else:
            where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
            message = f"{where}: {first.get('msg')}" if where else str(first.get("msg", "invalid request"))
        return JSONResponse(error_body(message, HTTPStatus.BAD_REQUEST, where), status_code=400)

    @app.exception_handler(ServeError)
    async def refused(_request, exc: ServeError):
        return JSONResponse(error_body(exc.message, exc.status, exc.param), status_code=int(exc.status))


class _Api:
    def __init__(self, loop: EngineLoop, tokenizer, config: ServeConfig) -> None:
        self.loop, self.tokenizer, self.config = loop, tokenizer, config
        self.vocab_size = loop.engine.parts.model.config.vocab_size

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            if not all(0 <= t < self.vocab_size for t in ids):
                raise ServeError(f"prompt has a token id outside the vocabulary [0, {self.vocab_size})", param="prompt")
        if not ids:
            raise ServeError("prompt encodes to no tokens", param="prompt")
        return ids

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        template = self.config.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ServeError("this model's tokenizer has no chat template: start the server with --chat-template")
        messages = [_text_message(m.model_dump(exclude_none=True), i) for i, m in enumerate(body.messages)]
        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                      add_generation_prompt=body.add_generation_prompt)
        except Exception as exc:  # jinja's errors: the messages do not fit the template
            raise ServeError(f"the chat template failed on these messages: {exc}", param="messages") from None
        return self.encode_chat(text)

    def encode_chat(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens
        if not ids:
            raise ServeError("messages encode to no tokens", param="messages")
        return ids

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise ServeError(f"The model `{name}` does not exist.", HTTPStatus.NOT_FOUND, "model")

    def max_tokens(self, prompt: list[int], requested: int | None) -> int:
        limit = self.config.max_model_len
        if requested is None:
            if len(prompt) >= limit:
                raise ServeError(f"This model's maximum context length is {limit} tokens. However, your prompt "
                                 f"contains {len(prompt)} input tokens. Please reduce the length of the input prompt.",
                                 param="input_tokens")
            return limit - len(prompt)
        if len(prompt) + requested > limit:
            raise ServeError(f"This model's maximum context length is {limit} tokens. However, you requested "
                             f"{len(prompt) + requested} tokens ({len(prompt)} in the prompt, {requested} in the "
                             f"completion). Please reduce the length of the prompt or max_tokens.", param="max_tokens")
        return requested

    def params(self, body, max_tokens: int, index: int) -> SamplingParams:
        temperature = body.temperature if body.temperature is not None else self.config.default_temperature
        return SamplingParams(max_tokens, temperature, body.top_p if body.top_p is not None else
                              self.config.default_top_p, None if body.seed is None else body.seed + index,
                              body.ignore_eos, frozenset(body.stop_token_ids or ()))

    async def respond(self, body, prompts: list[list[int]], requested: int | None, raw: Request, *, chat: bool):
        self.check_model(body.model)
        plans = [(prompt, self.max_tokens(prompt, requested)) for prompt in prompts]
        bound = self.config.max_num_queued_reqs
        if bound is not None and self.loop.num_in_flight + len(plans) * body.n > bound:
            raise ServeError("The engine is currently busy and cannot accept new requests. Please try again later "
                             "or on a different instance.", HTTPStatus.SERVICE_UNAVAILABLE)
        if self.loop.error is not None or not self.loop.is_alive():
            raise ServeError("the engine has stopped (see the server's log)", HTTPStatus.SERVICE_UNAVAILABLE)
        stop = body.stop_strings()
        choices = [_Choice(self.loop.submit(prompt, self.params(body, max_tokens, j)), ChoiceText(self.tokenizer, stop))
                   for prompt, max_tokens in plans for j in range(body.n)]
        head = _Head(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()),
                     self.config.model_name, chat, sum(len(p) for p in prompts))
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(choices, head, usage), media_type="text/event-stream")
        try:
            await _unless_disconnected(raw, asyncio.gather(*(self._collect(c) for c in choices)))
        except ClientGone:
            return Response(status_code=499)
        finally:
            self._abort_unfinished(choices)
        if any(c.finish_reason == "error" for c in choices):
            raise ServeError("the engine failed while serving the request (see the server's log)",
                             HTTPStatus.INTERNAL_SERVER_ERROR)
        failed = [c for c in choices if c.finish_reason == "failed"]
        if failed:
            raise ServeError("the request needs more KV cache than the server's budget holds "
                             "(raise --kv-cache-memory)")
        return head.answer(choices)

    async def _collect(self, choice: _Choice) -> None:
        async for _piece in self._pieces(choice):
            pass

    async def _pieces(self, choice: _Choice) -> AsyncIterator[str]:
        """The choice's text pieces as its tokens arrive; sets ``finish_reason`` at the end."""
        while True:
            event = await choice.handle.events.get()
            final = event.finish_reason is not None
            piece = choice.text.add(event.token_ids, final)
            if choice.text.stopped_by is not None:
                if not final:
                    self.loop.abort(choice.handle, "stop")
                choice.finish_reason = "stop"
            elif final:
                piece += choice.text.rest()
                choice.finish_reason = event.finish_reason
            if piece or choice.finish_reason is not None:
                yield piece
            if choice.finish_reason is not None:
                return

    async def _stream(self, choices: list[_Choice], head: _Head, usage: bool) -> AsyncIterator[str]:
        merged: asyncio.Queue = asyncio.Queue()

        async def feed(index: int, choice: _Choice) -> None:
            async for piece in self._pieces(choice):
                await merged.put((index, piece, choice.finish_reason))

        tasks = [asyncio.ensure_future(feed(i, c)) for i, c in enumerate(choices)]
        try:
            if head.chat:
                for i in range(len(choices)):
                    yield _sse(head.chunk(i, None, None, first=True))
            open_choices = len(choices)
            while open_choices:
                index, piece, finish = await merged.get()
                if finish == "failed":
                    yield _sse(error_body("the request needs more KV cache than the server's budget holds",
                                          HTTPStatus.BAD_REQUEST))
                    break
                if finish == "error":
                    yield _sse(error_body("the engine failed while serving the request (see the server's log)",
                                          HTTPStatus.INTERNAL_SERVER_ERROR))
                    break
                yield _sse(head.chunk(index, piece, finish))
                open_choices -= finish is not None
            else:
                if usage:
                    yield _sse(head.usage_chunk(choices))
            yield "data: [DONE]\n\n"
        finally:  # also on cancellation: the client stopped reading
            for task in tasks:
                task.cancel()
            self._abort_unfinished(choices)

    def _abort_unfinished(self, choices: list[_Choice]) -> None:
        for choice in choices:
            if not choice.handle.finished:
                self.loop.abort(choice.handle)


@dataclass(frozen=True)
class _Head:
    """What every chunk and answer of one request repeats."""

    id: str
    created: int
    model: str
    chat: bool
    prompt_tokens: int

    def usage(self, choices: list[_Choice]) -> dict:
        completion = sum(len(c.text.token_ids) for c in choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _base(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, index: int, piece: str | None, finish: str | None, first: bool = False) -> dict:
        if not self.chat:
            choice = {"index": index, "text": piece, "logprobs": None, "finish_reason": finish, "stop_reason": None}
            return {**self._base("text_completion"), "choices": [choice]}
        delta = {"role": "assistant", "content": ""} if first else {"content": piece}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, choices: list[_Choice]) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(kind), "choices": [], "usage": self.usage(choices)}

    def answer(self, choices: list[_Choice]) -> dict:
        if self.chat:
            items = [{"index": i, "message": {"role": "assistant", "content": c.text.text}, "logprobs": None,
                      "finish_reason": c.finish_reason, "stop_reason": c.text.stopped_by}
                     for i, c in enumerate(choices)]
            return {**self._base("chat.completion"), "choices": items, "usage": self.usage(choices)}
        items = [{"index": i, "text": c.text.text, "logprobs": None, "finish_reason": c.finish_reason,
                  "stop_reason": c.text.stopped_by} for i, c in enumerate(choices)]
        return {**self._base("text_completion"), "choices": items, "usage": self.usage(choices)}


def _text_message(message: dict, index: int) -> dict:
    """A message whose ``content`` is a list of parts (what the openai client and most UIs send) with its text
    parts joined by newlines, as vLLM joins them for a template that takes a string; a part that is not text is
    refused (this server serves text models)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ServeError(f"messages[{index}].content[{j}]: a part of type {kind!r}; this model takes text parts "
                             f"only ({{\"type\": \"text\", \"text\": ...}})", param="messages")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _unless_disconnected(raw: Request, awaitable) -> object:
    """Await ``awaitable`` unless the client disconnects first (then cancel it and raise ``ClientGone``)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future) -> None:
    """Read a cancelled gather's outcome: its children's ``CancelledError`` is expected, and a future whose
    exception nobody reads is logged with a traceback when it is collected."""
    if not task.cancelled():
        task.exception()
