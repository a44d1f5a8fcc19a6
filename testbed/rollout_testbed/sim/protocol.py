"""Request models and error bodies of the simulated replica, shaped like vLLM's.

Error envelope, checked against vLLM's source (``vllm/entrypoints/openai/engine/protocol.py``
``ErrorInfo``/``ErrorResponse`` and ``vllm/entrypoints/serve/utils/error_response.py``
``create_error_response``; nested since v0.10-ish, so it applies to 0.32)::

    {"error": {"message": str, "type": str, "param": str | None, "code": <HTTP status int>}}

``type`` is a class-like name: ``BadRequestError`` (400 default), ``NotFoundError`` (404),
``InternalServerError`` (500), ``InvalidUserInput`` (LoRA request checks, 400). Request
validation failures (pydantic, malformed JSON, non-JSON content type) are turned into 400
with ``type`` ``"Bad Request"`` by vLLM's ``validation_exception_handler``
(``serve/exception_handling/handlers/validation.py``), never FastAPI's 422.

Request models accept unknown fields (vLLM's ``OpenAIBaseModel`` uses ``extra="allow"``):
sampling knobs the sim ignores (temperature, top_p, ...) are accepted silently.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, field_validator

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "LoadLoRAAdapterRequest",
    "SimError",
    "StreamOptions",
    "TokenizeRequest",
    "UnloadLoRAAdapterRequest",
    "error_json",
    "error_response",
]


def error_json(
    message: str, err_type: str, status: int, param: str | None = None
) -> dict[str, Any]:
    """vLLM's ``ErrorResponse.model_dump()``: nested, ``code`` is the HTTP status."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(
    message: str, err_type: str, status: int, param: str | None = None
) -> JSONResponse:
    return JSONResponse(error_json(message, err_type, status, param), status_code=status)


class SimError(Exception):
    """An error the sim answers with vLLM's envelope; raised anywhere, rendered once."""

    def __init__(
        self,
        message: str,
        status: int = HTTPStatus.BAD_REQUEST,
        err_type: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.err_type = err_type
        self.param = param

    def response(self) -> JSONResponse:
        return error_response(self.message, self.err_type, self.status, self.param)


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")


_SALT_FORBIDDEN = frozenset("@/\\\x00")


class _Salted(_Base):
    """``cache_salt`` as vLLM 0.32 checks it (``validate_cache_salt``): it keys the
    request's prefix-cache blocks, so two salts never share KV."""

    cache_salt: str | None = None

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _salt(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        if len(value) > 128 or any(c in _SALT_FORBIDDEN for c in value):
            raise ValueError(
                "Parameter 'cache_salt' must be at most 128 characters and must "
                "not contain '@', '/', '\\\\', or NUL."
            )
        return value


class StreamOptions(_Base):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class CompletionRequest(_Salted):
    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    n: int = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    seed: int | None = None
    return_token_ids: bool | None = None


class ChatCompletionRequest(_Salted):
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    seed: int | None = None
    return_token_ids: bool | None = None
    add_generation_prompt: bool = True


class LoadLoRAAdapterRequest(_Base):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Base):
    lora_name: str
    lora_int_id: int | None = None


class TokenizeRequest(_Base):
    """Either vLLM's ``TokenizeCompletionRequest`` (prompt) or ``TokenizeChatRequest``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]
