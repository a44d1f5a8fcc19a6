"""What each run used of the shared fleet, for a cost split (pure).

The tokens are vLLM's own count, read from the ``usage`` object of each answer (the
whole body, or the stream's chunk that carries it when the client asked for
``stream_options.include_usage``): what the replicas computed for the run, the same
numbers their ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total`` add up.
Only the run's rollouts are counted (multi-run mode; single-run mode has one run, whose
use is the fleet's own metrics).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

__all__ = ["RunUsage", "usage_tokens"]

_USAGE = b'"usage":{'


def usage_tokens(content: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens of the last ``"usage":{...}`` in ``content``, or None.

    Only the usage object is parsed (it ends at the first ``}`` after its nested
    ``prompt_tokens_details``, if any): an answer's generated text is never decoded."""
    at = content.rfind(_USAGE)
    if at < 0:
        return None
    start = at + len(_USAGE) - 1
    depth = 0
    for end in range(start, min(len(content), start + 512)):
        char = content[end]
        if char == 0x7B:  # {
            depth += 1
        elif char == 0x7D:  # }
            depth -= 1
            if depth == 0:
                break
    else:
        return None
    try:
        usage = orjson.loads(content[start : end + 1])
    except orjson.JSONDecodeError:
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is not int or type(completion) is not int:
        return None
    return prompt, completion


@dataclass
class RunUsage:
    """One run's counts since the gateway started (Prometheus counters, read at scrape)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    rollouts: Counter[str] = field(default_factory=Counter)
    """Answered rollouts by status class: ``2xx``, ``4xx``, ``5xx``."""
    held_s: float = 0.0
    """Time its rollouts waited at the gateway (its scoped ``/pause``)."""

    def answered(self, status: int) -> None:
        self.rollouts[f"{status // 100}xx"] += 1

    def tokens(self, found: tuple[int, int] | None) -> None:
        if found is not None:
            self.prompt_tokens += found[0]
            self.completion_tokens += found[1]

    def status(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "rollouts": dict(sorted(self.rollouts.items())),
            "held_s": round(self.held_s, 3),
        }
