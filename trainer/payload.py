"""TRL 1.16's rollout request body, in one place.

Stdlib only, so the gateway venv (no torch) can import it: the demo, tests and benchmarks
send exactly what the driver sends, which is exactly what TRL sends
(``shared/reference/trl-wire.md``, checked against the recorded trace in
``tests/trainer/test_pipeline.py``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_payload"]


def build_payload(
    model: str,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    seed: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    repetition_penalty: float = 1.0,
    min_p: float | None = None,
) -> dict[str, Any]:
    """TRL 1.16 ``_generate_one_turn``'s body, key for key and in the same order
    (defaults are TRL's sampling defaults)."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "repetition_penalty": repetition_penalty,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": seed,
    }
    if min_p is not None:
        payload["min_p"] = min_p
    return payload
