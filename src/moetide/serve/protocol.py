"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``, and the error body every failure answers with.

Field names, defaults and limits are vLLM's (``vllm/entrypoints/openai``): ``max_tokens`` 16 for completions and
"what the context leaves" for chat, ``n`` >= 1, ``top_p`` in (0, 1], ``ignore_eos`` and ``stop_token_ids`` as
vLLM's extensions. One difference, on purpose: a field this server does not know is rejected with HTTP 400
(OpenAI's API does the same: "Unrecognized request argument"), where vLLM 0.32 accepts it and ignores it, because
a silently ignored sampling option makes a benchmark measure something other than what it asked for. Fields that
vLLM's own benchmark client sends at their neutral value (``repetition_penalty`` 1, ``logprobs`` null) are
accepted at that value only.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ServeError(Exception):
    """A request the server refuses: answered with ``error_body`` and the status."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


def error_body(message: str, status: HTTPStatus, param: str | None = None) -> dict:
    """OpenAI's error shape, with vLLM's ``type`` names (``BadRequestError``, ``NotFoundError``, ...)."""
    kind = {HTTPStatus.BAD_REQUEST: "BadRequestError", HTTPStatus.UNAUTHORIZED: "AuthenticationError",
            HTTPStatus.NOT_FOUND: "NotFoundError",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
            HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": int(status)}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Sampling(_Body):
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    repetition_penalty: Literal[1, 1.0] | None = None
    presence_penalty: Literal[0, 0.0] | None = None
    frequency_penalty: Literal[0, 0.0] | None = None
    logprobs: None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not s for s in stops):  # it would match everywhere; vLLM refuses it with the same words
            raise ServeError("stop cannot contain an empty string.", param="stop")
        return stops


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: Literal[False] = False


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: the chat template reads what it knows
    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completion request: one text, several texts, one token list, or several."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ServeError("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]
