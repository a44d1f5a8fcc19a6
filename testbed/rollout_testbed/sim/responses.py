"""Response bodies of the sim, field for field like vLLM's pydantic models produce them.

Non-streaming bodies are ``model_dump()`` of vLLM's response models, so every field is
present (``None`` as null). Streaming chunks are ``model_dump_json(exclude_unset=True)``:
only fields vLLM sets explicitly appear (``logprobs``, ``finish_reason``, ``stop_reason``,
``token_ids``/``prompt_token_ids`` even when null); the final usage chunk drops nulls.
``usage.prompt_tokens_details`` is present only when the cache hit (vLLM checks
``num_cached_tokens`` for truthiness) and ``enable_prompt_tokens_details`` is on.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from rollout_testbed.sim.config import SimConfig
from rollout_testbed.sim.protocol import ChatCompletionRequest, CompletionRequest
from rollout_testbed.sim.state import Generation, SimState
from rollout_testbed.sim.tokenizer import SampledToken, decode, decode_token

__all__ = [
    "Meta",
    "chat_body",
    "chat_chunks",
    "completion_body",
    "completion_chunks",
    "model_list",
    "server_info",
]


@dataclass(frozen=True, slots=True)
class Meta:
    id: str
    created: int
    model: str
    config: SimConfig


def _usage(gen: Generation, meta: Meta, drop_none: bool = False) -> dict[str, Any]:
    prompt = sum(len(p) for p in gen.prompts)
    completion = sum(min(gen.produced, len(o)) for o in gen.outputs)
    cached = gen.cached[-1] if gen.cached else 0
    details = (
        {"cached_tokens": cached} if meta.config.enable_prompt_tokens_details and cached else None
    )
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
    }
    if drop_none and details is None:
        del usage["prompt_tokens_details"]
    return usage


def _completion_logprobs(
    tokens: Sequence[SampledToken], num_top: int, offset: int = 0
) -> dict[str, Any]:
    """Completions-API logprobs: the sampled token plus ``num_top`` alternatives per step."""
    strs = [decode_token(t.token_id) for t in tokens]
    offsets: list[int] = []
    for s in strs:
        offsets.append(offset)
        offset += len(s)
    return {
        "text_offset": offsets,
        "token_logprobs": [t.logprob for t in tokens],
        "tokens": strs,
        "top_logprobs": [
            {decode_token(tid): lp for tid, lp in t.top[: num_top + 1]} for t in tokens
        ],
    }


def _chat_logprobs(tokens: Sequence[SampledToken], num_top: int) -> dict[str, Any]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = decode_token(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {
        "content": [
            {
                **entry(t.token_id, t.logprob),
                "top_logprobs": [entry(tid, lp) for tid, lp in t.top[:num_top]],
            }
            for t in tokens
        ]
    }


def _seq_tokens(gen: Generation, seq: int) -> list[SampledToken]:
    return gen.outputs[seq][: gen.produced]


def completion_body(gen: Generation, req: CompletionRequest, meta: Meta) -> dict[str, Any]:
    choices = []
    for s in range(len(gen.outputs)):
        toks = _seq_tokens(gen, s)
        ids = [t.token_id for t in toks]
        choices.append(
            {
                "index": s,
                "text": decode(ids),
                "logprobs": None
                if req.logprobs is None
                else _completion_logprobs(toks, req.logprobs),
                "finish_reason": gen.finish_reason(),
                "stop_reason": None,
                "prompt_logprobs": None,
                "prompt_token_ids": gen.prompts[s // gen.n] if req.return_token_ids else None,
                "token_ids": ids if req.return_token_ids else None,
            }
        )
    return {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(gen, meta),
        "kv_transfer_params": None,
    }


def _stream_usage(req_opts: Any) -> tuple[bool, bool]:
    if req_opts is None:
        return False, False
    return bool(req_opts.include_usage), bool(
        req_opts.include_usage and req_opts.continuous_usage_stats
    )


async def completion_chunks(
    gen: Generation, req: CompletionRequest, meta: Meta
) -> AsyncIterator[dict[str, Any]]:
    include_usage, continuous = _stream_usage(req.stream_options)
    offsets = [0] * len(gen.outputs)
    head = {
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
    }

    def chunk(s: int, toks: list[SampledToken], finish: str | None, first: bool) -> dict[str, Any]:
        text = decode(t.token_id for t in toks)
        lp = None if req.logprobs is None else _completion_logprobs(toks, req.logprobs, offsets[s])
        offsets[s] += len(text)
        out: dict[str, Any] = {
            **head,
            "choices": [
                {
                    "index": s,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "prompt_token_ids": gen.prompts[s // gen.n]
                    if req.return_token_ids and first
                    else None,
                    "token_ids": [t.token_id for t in toks] if req.return_token_ids else None,
                }
            ],
        }
        if continuous:
            out["usage"] = _usage(gen, meta, drop_none=True)
        return out

    async for k in gen.run():
        for s, seq in enumerate(gen.outputs):
            if k <= len(seq):
                yield chunk(s, [seq[k - 1]], "length" if k == len(seq) else None, k == 1)
    if gen.aborted:
        for s, seq in enumerate(gen.outputs):
            if gen.produced < len(seq):
                yield chunk(s, [], "abort", gen.produced == 0)
    if include_usage:
        yield {**head, "choices": [], "usage": _usage(gen, meta, drop_none=True)}


def chat_body(gen: Generation, req: ChatCompletionRequest, meta: Meta) -> dict[str, Any]:
    num_top = req.top_logprobs or 0
    choices = []
    for s in range(len(gen.outputs)):
        toks = _seq_tokens(gen, s)
        ids = [t.token_id for t in toks]
        choices.append(
            {
                "index": s,
                "message": {
                    "role": "assistant",
                    "content": decode(ids),
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": _chat_logprobs(toks, num_top) if req.logprobs else None,
                "finish_reason": gen.finish_reason(),
                "stop_reason": None,
                "token_ids": ids if req.return_token_ids else None,
            }
        )
    return {
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _usage(gen, meta),
        "prompt_logprobs": None,
        "prompt_token_ids": gen.prompts[0] if req.return_token_ids else None,
        "kv_transfer_params": None,
    }


async def chat_chunks(
    gen: Generation, req: ChatCompletionRequest, meta: Meta
) -> AsyncIterator[dict[str, Any]]:
    include_usage, continuous = _stream_usage(req.stream_options)
    num_top = req.top_logprobs or 0
    head = {
        "id": meta.id,
        "object": "chat.completion.chunk",
        "created": meta.created,
        "model": meta.model,
    }

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        out = {**head, "choices": [choice]}
        if continuous:
            out["usage"] = _usage(gen, meta, drop_none=True)
        return out

    started = False
    async for k in gen.run():
        if not started:
            started = True
            for s in range(len(gen.outputs)):
                first = chunk(
                    {
                        "index": s,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
                if req.return_token_ids:
                    first["prompt_token_ids"] = gen.prompts[0]
                yield first
        for s, seq in enumerate(gen.outputs):
            if k <= len(seq):
                tok = seq[k - 1]
                yield chunk(
                    {
                        "index": s,
                        "delta": {"content": decode_token(tok.token_id)},
                        "logprobs": _chat_logprobs([tok], num_top) if req.logprobs else None,
                        "finish_reason": "length" if k == len(seq) else None,
                        **({"token_ids": [tok.token_id]} if req.return_token_ids else {}),
                    }
                )
    if gen.aborted:
        for s, seq in enumerate(gen.outputs):
            if gen.produced < len(seq):
                yield chunk({"index": s, "delta": {}, "logprobs": None, "finish_reason": "abort"})
    if include_usage:
        yield {**head, "choices": [], "usage": _usage(gen, meta, drop_none=True)}


def _permission() -> dict[str, Any]:
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": int(time.time()),
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def _card(id_: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
    return {
        "id": id_,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [_permission()],
    }


def model_list(state: SimState) -> dict[str, Any]:
    """Base model (with ``max_model_len``), then one card per registered adapter."""
    cfg = state.config
    data = [_card(cfg.model, cfg.root, None, cfg.max_model_len)]
    data += [_card(a.name, a.path, cfg.model, None) for a in state.adapters.values()]
    return {"object": "list", "data": data}


def server_info(cfg: SimConfig, as_json: bool) -> dict[str, Any]:
    """``/server_info``: ``vllm_config`` is the pydantic dump (json) or ``str()`` (text).

    Only the sections TRL and the gateway read are filled in; TRL reads
    ``lora_config.{max_lora_rank,max_loras}`` and ``parallel_config.data_parallel_size``.
    """
    vllm_config: dict[str, Any] = {
        "model_config": {
            "model": cfg.root,
            "served_model_name": cfg.model,
            "tokenizer": cfg.root,
            "max_model_len": cfg.max_model_len,
            "dtype": "bfloat16",
            "max_logprobs": cfg.max_logprobs,
        },
        "cache_config": {
            "block_size": cfg.block_size,
            "enable_prefix_caching": True,
            "num_gpu_blocks": cfg.cache_blocks,
        },
        "parallel_config": {
            "data_parallel_size": 1,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "world_size": 1,
            "data_parallel_rank": 0,
        },
        "scheduler_config": {"max_model_len": cfg.max_model_len},
        "device_config": {"device": "cpu"},
        "lora_config": {
            "max_lora_rank": cfg.max_lora_rank,
            "max_loras": cfg.max_loras,
            "max_cpu_loras": cfg.cpu_loras,
            "fully_sharded_loras": False,
            "lora_dtype": "auto",
        },
    }
    text = (
        f"model='{cfg.root}', served_model_name={cfg.model}, max_seq_len={cfg.max_model_len}, "
        f"enable_prefix_caching=True, block_size={cfg.block_size}, "
        f"max_loras={cfg.max_loras}, max_lora_rank={cfg.max_lora_rank}, sim_latency="
        f"{cfg.latency}"
    )
    return {
        "vllm_config": vllm_config if as_json else text,
        "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True, "VLLM_SERVER_DEV_MODE": True},
        "system_env": {"platform": "rollout-testbed sim-replica"},
    }
