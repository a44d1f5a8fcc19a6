"""``create_sim_app``: a FastAPI app that answers like one vLLM 0.32 OpenAI server.

Endpoints (vLLM's paths, status codes and bodies; dev-mode ones as with
``VLLM_SERVER_DEV_MODE=1`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``):

  GET  /health /version /v1/models /server_info[?config_format=json] /get_world_size
       /is_paused /metrics
  POST /v1/completions /v1/chat/completions /tokenize /detokenize
       /v1/load_lora_adapter /v1/unload_lora_adapter
       /pause[?mode=abort|wait|keep] /resume /reset_prefix_cache

Sim-only control (for subprocess replicas; in-process tests use ``app.state.sim``):

  GET /sim/faults, POST /sim/faults {"load_not_found": 2, ...}, DELETE /sim/faults,
  GET /sim/stats

Shapes verified against vLLM's source: ``serve/lora/api_router.py`` (LoRA success is a bare
``Response(content=str)``: status 200, body text, *no* Content-Type header; errors are
``JSONResponse(ErrorResponse)``), ``openai/models/serving.py`` (LoRA messages, model 404),
``openai/completion/serving.py`` (choices, logprobs, usage, SSE chunks), and
``serve/dev/rlhf/api_router.py`` (pause/resume/is_paused/get_world_size bodies).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from http import HTTPStatus
from typing import Annotated, Any, Literal

import orjson
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_testbed.sim import responses as R
from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    SimError,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    error_response,
)
from rollout_testbed.sim.state import Faults, Generation, PauseMode, SimState
from rollout_testbed.sim.tokenizer import apply_chat_template, decode, decode_token, encode

__all__ = ["SimConfig", "SimState", "create_sim_app"]


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


async def _require_json(request: Request) -> None:
    """vLLM's ``validate_json_request``: a non-JSON content type is a validation error."""
    media = request.headers.get("content-type", "").lower().split(";", 1)[0].strip()
    if media != "application/json":
        raise RequestValidationError(
            errors=["Unsupported Media Type: Only 'application/json' is allowed"]
        )


def _base_request_id(request: Request) -> str:
    """vLLM's ``OpenAIServing._base_request_id``: the client's ``X-Request-Id`` is the
    engine's request id, so a completion's ``id`` is ``cmpl-<X-Request-Id>`` (which is how
    a test sees the id the gateway sent)."""
    return request.headers.get("x-request-id") or uuid.uuid4().hex


def _validation_message(errors: list[Any]) -> str:
    if not errors:
        return "Validation error"
    label = "error" if len(errors) == 1 else "errors"
    return (f"{len(errors)} validation {label}:\n" + "".join(f"  {e}\n" for e in errors)).rstrip()


def _param(errors: list[Any]) -> str | None:
    first = errors[0] if errors else None
    if isinstance(first, dict) and first.get("loc"):
        return ".".join(str(p) for p in first["loc"])
    return None


def _install_error_handlers(app: FastAPI) -> None:
    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors = list(exc.errors())
        return error_response(
            _validation_message(errors), HTTPStatus.BAD_REQUEST.phrase, 400, _param(errors)
        )

    async def on_sim_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, SimError)
        return exc.response()

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        return error_response(str(exc.detail), HTTPStatus(status).phrase, status)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(SimError, on_sim_error)
    app.add_exception_handler(StarletteHTTPException, on_http)


def _prompt_ids(prompt: list[int] | list[list[int]] | str | list[str]) -> list[list[int]]:
    if isinstance(prompt, str):
        return [encode(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [encode(p) for p in prompt if isinstance(p, str)]
    if prompt and all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt if isinstance(p, list)]
    return [[p for p in prompt if isinstance(p, int)]]


def _check_sampling(
    state: SimState,
    prompts: list[list[int]],
    n: int,
    max_tokens: int | None,
    num_top: int,
    top_param: str,
) -> list[int]:
    """vLLM's request checks; returns max_tokens per prompt (clamped to the context)."""
    cfg = state.config
    if n < 1:
        raise SimError(f"n must be at least 1, got {n}.", param="n")
    if max_tokens is not None and max_tokens < 1:
        raise SimError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    if num_top < 0 or num_top > cfg.max_logprobs:
        raise SimError(
            f"Requested sample logprobs of {num_top}, which is greater than max allowed: "
            f"{cfg.max_logprobs}"
            if num_top > 0
            else f"{top_param} must be non-negative.",
            param=top_param,
        )
    out: list[int] = []
    for ids in prompts:
        if not ids:
            raise SimError(
                "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt"
            )
        if any(t < 0 for t in ids):
            raise SimError(f"Token id {min(ids)} is out of vocabulary", param="prompt")
        room = cfg.max_model_len - len(ids)
        if room < 1:
            raise SimError(
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"your request has {len(ids)} input tokens. Please reduce the length of the "
                "input messages.",
                param="input_tokens",
            )
        out.append(room if max_tokens is None else min(max_tokens, room))
    return out


async def _drain(gen: Generation) -> None:
    async for _ in gen.run():
        pass


async def _drain_or_abort(request: Request, gen: Generation) -> bool:
    """Run ``gen`` to the end unless the client hangs up first, then abort it: vLLM's
    ``@with_cancellation`` on its non-streaming handlers. True if it completed."""
    work = asyncio.ensure_future(_drain(gen))

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled():
        return False
    work.result()
    return True


def create_sim_app(config: SimConfig | None = None) -> FastAPI:
    """Build one simulated replica; its engine state and fault control is ``app.state.sim``."""
    cfg = config or SimConfig()
    state = SimState(cfg)
    app = FastAPI(title="rollout-testbed sim-replica", docs_url=None, redoc_url=None)
    app.state.sim = state
    _install_error_handlers(app)
    json_body = [Depends(_require_json)]

    async def start(
        model: str | None,
        prompts: list[list[int]],
        n: int,
        max_tokens: list[int],
        seed: int | None,
        num_top: int,
        cache_salt: str | None,
    ) -> tuple[str, Generation]:
        state.stats.requests_by_model[model or cfg.model] += 1
        await state.apply_completion_faults()
        adapter = state.resolve_model(model)
        gen = state.plan(adapter, prompts, n, max_tokens, seed, num_top, cache_salt)
        return adapter or cfg.model, gen

    def stream(chunks: Callable[[], AsyncIterator[dict[str, Any]]]) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            async for chunk in chunks():
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/completions", dependencies=json_body)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        prompts = _prompt_ids(req.prompt)
        num_top = req.logprobs if req.logprobs is not None else 0
        limits = _check_sampling(state, prompts, req.n, req.max_tokens, num_top, "logprobs")
        name, gen = await start(req.model, prompts, req.n, limits, req.seed, num_top,
                                req.cache_salt)  # fmt: skip
        meta = R.Meta(f"cmpl-{_base_request_id(request)}", int(time.time()), name, cfg)
        if req.stream:
            return stream(lambda: R.completion_chunks(gen, req, meta))
        if not await _drain_or_abort(request, gen):
            return Response(status_code=499)
        return _json(R.completion_body(gen, req, meta))

    @app.post("/v1/chat/completions", dependencies=json_body)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        try:
            prompts = [apply_chat_template(req.messages, req.add_generation_prompt)]
        except ValueError as exc:
            raise SimError(str(exc), param="messages") from None
        num_top = (req.top_logprobs or 0) if req.logprobs else 0
        max_tokens = req.max_completion_tokens or req.max_tokens
        n = req.n if req.n is not None else 1
        limits = _check_sampling(state, prompts, n, max_tokens, num_top, "top_logprobs")
        name, gen = await start(req.model, prompts, n, limits, req.seed, num_top, req.cache_salt)
        meta = R.Meta(f"chatcmpl-{_base_request_id(request)}", int(time.time()), name, cfg)
        if req.stream:
            return stream(lambda: R.chat_chunks(gen, req, meta))
        if not await _drain_or_abort(request, gen):
            return Response(status_code=499)
        return _json(R.chat_body(gen, req, meta))

    @app.post("/v1/load_lora_adapter", dependencies=json_body)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        return Response(await state.load_adapter(req.lora_name, req.lora_path, req.load_inplace))

    @app.post("/v1/unload_lora_adapter", dependencies=json_body)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        return Response(await state.unload_adapter(req.lora_name))

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(R.model_list(state))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=state.faults.health_status)

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": cfg.version})

    @app.get("/server_info")
    async def server_info(
        config_format: Annotated[Literal["text", "json"], Query()] = "text",
    ) -> Response:
        return _json(R.server_info(cfg, as_json=config_format == "json"))

    @app.get("/get_world_size")
    async def get_world_size(include_dp: Annotated[bool, Query()] = True) -> Response:
        return _json({"world_size": 1})

    @app.post("/pause")
    async def pause(
        mode: Annotated[Literal["abort", "wait", "keep"], Query()] = "abort",
        wait_for_inflight_requests: Annotated[bool, Query()] = False,
        clear_cache: Annotated[bool, Query()] = True,
    ) -> Response:
        chosen: PauseMode = "wait" if wait_for_inflight_requests else mode
        fire, state.faults.pause_error = Faults.take(state.faults.pause_error)
        if fire:  # vLLM's handler for an engine error: 500 {"error": ...}
            message = "Failed to pause generation: simulated engine failure"
            return _json({"error": message}, status=500)
        await state.pause(chosen, clear_cache=clear_cache)
        return _json({"status": "paused"})

    @app.post("/resume")
    async def resume() -> Response:
        state.resume()
        return _json({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> Response:
        return _json({"is_paused": state.paused})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        state.reset_prefix_cache()
        return Response(status_code=200)

    @app.post("/tokenize", dependencies=json_body)
    async def tokenize(req: TokenizeRequest) -> Response:
        state.resolve_model(req.model)
        if req.messages is not None:
            ids = apply_chat_template(req.messages, req.add_generation_prompt)
        else:
            ids = encode(req.prompt or "")
        strs = [decode_token(t) for t in ids] if req.return_token_strs else None
        return _json(
            {
                "count": len(ids),
                "max_model_len": cfg.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    @app.post("/detokenize", dependencies=json_body)
    async def detokenize(req: DetokenizeRequest) -> Response:
        state.resolve_model(req.model)
        return _json({"prompt": decode(req.tokens)})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    _install_control_routes(app, state)
    return app


def _install_control_routes(app: FastAPI, state: SimState) -> None:
    """``/sim/...``: fault injection and counters for replicas running in a subprocess."""

    @app.get("/sim/faults")
    async def get_faults() -> Response:
        return _json(asdict(state.faults))

    @app.post("/sim/faults")
    async def set_faults(request: Request) -> Response:
        try:
            values = orjson.loads(await request.body())
            if not isinstance(values, dict):
                raise ValueError("expected a JSON object of fault fields")
            state.faults.update(values)
        except (ValueError, orjson.JSONDecodeError) as exc:
            raise SimError(str(exc)) from None
        return _json(asdict(state.faults))

    @app.delete("/sim/faults")
    async def clear_faults() -> Response:
        state.clear_faults()
        return _json(asdict(state.faults))

    @app.get("/sim/stats")
    async def stats() -> Response:
        return _json(
            {
                **state.stats.snapshot(),
                "adapters": {a.name: a.path for a in state.adapters.values()},
                "running": state.running,
                "waiting": state.waiting,
                "paused": state.paused,
                "prefix_cache": {
                    "blocks": len(state.cache),
                    "queries_tokens": state.cache.queries_tokens,
                    "hits_tokens": state.cache.hits_tokens,
                },
            }
        )
