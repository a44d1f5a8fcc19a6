"""Reward functions for TRL's rollout worker (a spawned process: module-level, picklable).

TRL hands reward functions the completions of a conversational dataset as message lists
(``[{"role": "assistant", "content": ...}]``); the companion driver's ``digits`` reward
scores text, so it is applied to the messages' joined content. Kept free of torch imports:
the worker process unpickles this module by name.
"""

from __future__ import annotations

from typing import Any

from trainer.tasks import digit_reward as _digit_reward_text


def completion_text(completion: Any) -> str:
    """The text of one TRL completion (a message list, or already a string)."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion)


def digit_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """Share of non-space characters that are digits (``trainer.tasks.digit_reward``)."""
    return _digit_reward_text([completion_text(c) for c in completions], **kwargs)
